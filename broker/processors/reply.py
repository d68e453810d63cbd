"""SEND_REPLY_MESSAGE (324) and SEND_REPLY_MESSAGE_V2 (325): request-reply, RocketMQ 4.6+ (ReplyMessageProcessor).

A requester (``producer.request()``) sends an ordinary message carrying CORRELATION_ID, REPLY_TO_CLIENT (its client
id) and TTL; the send stamps CLUSTER on it. The consumer that handles it builds a reply with MSG_TYPE=reply for
"<CLUSTER>_REPLY_TOPIC" and sends it with one of these codes. The broker then:

1. checks the topic as any send (unknown, forbidden, bad queue id: the same answers);
2. pushes the reply to the connection its request came on (the send remembered it by CORRELATION_ID) while that
   still gives REPLY_TO_CLIENT, else to the producer connection registered (HEART_BEAT) last under REPLY_TO_CLIENT,
   as PUSH_REPLY_MESSAGE_TO_CLIENT (326), a ReplyMessageRequestHeader and the body, and waits for its answer;
3. stores the reply in its topic as well (storeReplyMessageEnable, on by default in RocketMQ);
4. answers the replier: SUCCESS (msgId and queueOffset of the stored copy) once the requester took the reply, else
   SYSTEM_ERROR with RocketMQ's remark -- no REPLY_TO_CLIENT, requester not connected here, push refused or
   timed out -- so a reply that reached nobody is never answered as sent.
"""
from __future__ import annotations

from protocol.codes import RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.message import (
    Prop,
    SendMessageRequestHeader,
    encode_record,
    nul_in_properties,
    offset_msg_id,
    properties_to_string,
    string_to_properties,
    tags_code,
    unpack_host,
)

from ..store import PutRequest
from .send import _born_host, _check_topic, plain_type_refused

REPLY_TO_CLIENT = Prop.REPLY_TO_CLIENT   # MessageConst.PROPERTY_MESSAGE_REPLY_TO_CLIENT
PUSH_REPLY_TIME = "PUSH_REPLY_TIME"     # MessageConst.PROPERTY_PUSH_REPLY_TIME
PUSH_TIMEOUT_S = 3.0                    # the replier's own send times out at 3 s: answer before it gives up


def _addr(host: str, port: int) -> str:
    return f"/{host}:{port}"            # InetSocketAddress.toString(), as RocketMQ writes both hosts


async def handle_reply(ctx, conn, cmd):
    h = SendMessageRequestHeader.from_command(cmd)
    checked = _check_topic(ctx, conn, cmd, h)
    if not isinstance(checked, tuple):
        return checked
    if h.topic in ctx.topics.unsaved:   # a topic this reply made: its copy is stored once it is written, as a send's
        gate = ctx.topics.made_durable(h.topic)
        if gate is not None:
            await gate
    _, qid = checked
    body = cmd.body_bytes()
    if len(body) > ctx.config.max_message_size:
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL,
                            f"the message body size {len(body)} is over the maximum {ctx.config.max_message_size}")
    illegal = nul_in_properties(h.properties)
    if illegal is not None:
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, illegal)
    if SysFlag.transaction_type(h.sys_flag) != SysFlag.TRANSACTION_NOT_TYPE:
        # its stored copy would be a send's (see there)
        return plain_type_refused(ctx, cmd, h.sys_flag, why_not_half="a reply is never one, whatever its TRAN_MSG")
    props = string_to_properties(h.properties)
    pushed, remark = await _push(ctx, conn, h, props, body)
    record = encode_record(
        topic=h.topic.encode(), body=body, queue_id=qid, flag=h.flag, sys_flag=h.sys_flag,
        born_timestamp=h.born_timestamp, born_host=_born_host(conn), store_host=ctx.store_host,
        properties=h.properties.encode(), reconsume_times=h.reconsume_times)
    result = not_stored = None
    if ctx.store.making_queue_file(h.topic, qid):
        # its file is being made off the loop (a send to it came first): waited for, as that send does;
        # prepare_queue meanwhile says EAGAIN "try again", and the copy was not stored
        try:
            await ctx.store.queue_file(h.topic, qid)
        except OSError:
            pass                                        # said by prepare_queue below
    if (h.topic, qid) not in ctx.store.queue_index:
        # a new queue's file first, as a send's: past the open-files limit the copy was stored and answered with
        # its msgId while its unit waited in memory, unreadable; now it is not stored, said as a copy not stored
        try:
            ctx.store.prepare_queue(h.topic, qid)
        except OSError as exc:
            if ctx.store.stopped_by(exc):
                # the store stopped (its file system read-only): said as every write then is, not as the
                # open-files limit (counted queue-file-failed, "raise ulimit -n")
                not_stored = ctx.store.refusal(f"consume queue {h.topic}-{qid}: {exc}")
            else:
                not_stored = (f"create mapped file failed, server is busy or broken: consume queue {h.topic}-{qid}: "
                              f"{exc}")
                ctx.limits.refused("queue-file-failed",
                                   f"reply to {props.get(REPLY_TO_CLIENT)} not stored: {not_stored}")
    if not_stored is None:
        result = await ctx.store.put(PutRequest(record, h.topic, qid, tags_code(props), h.sys_flag))
        if not result.ok:
            not_stored = result.status.name
    if not pushed:
        return cmd.response(ResponseCode.SYSTEM_ERROR, remark)
    msg_id, queue_offset = "0", 0               # RocketMQ's answer when the push worked but the copy was not stored
    if not_stored is None:
        ctx.metrics.count_in(h.topic, 1, len(body))
        msg_id, queue_offset = offset_msg_id(ctx.store_host, result.physical_offset), result.queue_offset
    else:
        ctx.limits.warn("reply-not-stored", f"reply to {str(props.get(REPLY_TO_CLIENT))[:200]} pushed but not "
                        f"stored in {h.topic}: {not_stored}")
    return cmd.response(ResponseCode.SUCCESS, None, {"msgId": msg_id, "queueId": qid, "queueOffset": queue_offset,
                                                      "MSG_REGION": ctx.config.region_id, "TRACE_ON": "true"})


async def _push(ctx, conn, h: SendMessageRequestHeader, props: dict, body: bytes) -> tuple[bool, str | None]:
    """PUSH_REPLY_MESSAGE_TO_CLIENT to the requester: (taken, why not)."""
    sender = props.get(REPLY_TO_CLIENT)
    if sender is None:
        return False, f"reply message properties[{REPLY_TO_CLIENT}] is null"
    requester = ctx.clients.reply_connection(sender, props.get(Prop.CORRELATION_ID))
    if requester is None:
        return False, f"push reply message fail, channel of <{sender}> not found."
    props = dict(props, **{PUSH_REPLY_TIME: str(ctx.clock())})
    store_host = unpack_host(ctx.store_host)
    fields = {
        "producerGroup": h.producer_group, "topic": h.topic, "defaultTopic": h.default_topic,
        "defaultTopicQueueNums": h.default_topic_queue_nums, "queueId": h.queue_id, "sysFlag": h.sys_flag,
        "bornTimestamp": h.born_timestamp, "flag": h.flag, "properties": properties_to_string(props),
        "reconsumeTimes": h.reconsume_times, "unitMode": "true" if h.unit_mode else "false",
        "bornHost": _addr(*conn.peer[:2]) if conn.peer[0] else _addr("127.0.0.1", 0),
        "storeHost": _addr(*store_host), "storeTimestamp": ctx.clock()}
    push = RemotingCommand.request(RequestCode.PUSH_REPLY_MESSAGE_TO_CLIENT, fields, body)
    try:
        answer = await requester.request(push, PUSH_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a dead or slow requester is this reply's failure, said to the replier
        # (each said at most every 10 s, the requester's remark cut: a requester refusing or dropping every push,
        # and a replier sending in a loop, had a line a reply, at the rate of the loop)
        ctx.limits.warn("reply-push-failed", f"push reply message to <{sender[:200]}> failed: {exc}")
        return False, f"push reply message to {sender}fail."
    if answer.code != ResponseCode.SUCCESS:
        ctx.limits.warn("reply-push-failed", f"push reply message to <{sender[:200]}> return fail, response "
                        f"remark: {str(answer.remark)[:200]}")
        return False, f"push reply message to {sender}fail."
    return True, None
