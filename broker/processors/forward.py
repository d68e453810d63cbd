"""Admin requests the broker passes on to one consumer and whose answer it passes back (RocketMQ's callConsumer).

GET_CONSUMER_RUNNING_INFO (307) {consumerGroup, clientId, jstackEnable}: mqadmin consumerStatus, consumerProgress
-s and the dashboard ask the broker, which asks the named consumer over its own connection with the same fields
and body, and answers with the consumer's code, remark, fields and body (a ConsumerRunningInfo the tool parses).

CONSUME_MESSAGE_DIRECTLY (309) {consumerGroup, clientId, msgId}: mqadmin queryMsgById -g G -d C (and
queryMsgByUniqueKey), the dashboard's resend: the stored record of the offset message id goes to the consumer
as the body, with brokerName added to the fields; its ConsumeMessageDirectlyResult comes back.

RocketMQ's answers where the consumer cannot: SYSTEM_ERROR "The Consumer <G> <C> not online"; after 10 s,
CONSUME_MSG_TIMEOUT "consumer <G> <C> Timeout: ..."; a connection that fails, SYSTEM_ERROR "invoke consumer ...".

INVOKE_BROKER_TO_GET_CONSUMER_STATUS (223) {topic, group, clientAddr}: mqadmin getConsumerStatus. The broker asks
each consumer of the group (only the one whose client id is clientAddr, when given) for its offsets of the
topic with GET_CONSUMER_STATUS_FROM_CLIENT (221), 5 s each, and answers a GetConsumerStatusBody of those that
answered (RocketMQ's Broker2Client.getConsumeStatus); no consumer online is SYSTEM_ERROR.

At most MAX_FORWARDING of these wait for consumers at once, broker-wide; past it, SYSTEM_BUSY at once.
"""
from __future__ import annotations

import asyncio
import logging

from protocol.admin_bodies import consumer_status_steps, mq_table_steps
from protocol.codes import LanguageCode, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import RequestTimeoutError
from protocol.message import decode_offset_msg_id

from ..limits import at_most
from ..slices import in_steps, stop_if_gone
from .admin import stored_record

log = logging.getLogger("txmq.ops")

CALL_TIMEOUT_S = 10.0           # RocketMQ's Broker2Client.callClient
STATUS_TIMEOUT_S = 5.0          # and its getConsumeStatus
# Each waits up to CALL_TIMEOUT_S holding its request (CONSUME_MESSAGE_DIRECTLY: a copy of a stored message, up
# to 4 MiB). Unlimited, a consumer that never answers and admins asking again and again (256 in flight a
# connection) held gigabytes; RocketMQ runs them on its 16 admin threads.
MAX_FORWARDING = 64


_limited = at_most("forwarding", MAX_FORWARDING,
                   f"{MAX_FORWARDING} requests are waiting for consumers' answers already, try again later")


@_limited
async def get_consumer_running_info(ctx, conn, cmd):
    return await _call_consumer(ctx, cmd, RequestCode.GET_CONSUMER_RUNNING_INFO, dict(cmd.ext_fields),
                                cmd.body_bytes())


@_limited
async def consume_message_directly(ctx, conn, cmd):
    msg_id = cmd.str_field("msgId", required=True)
    _host, _port, offset = decode_offset_msg_id(msg_id)         # (a HeaderError saying what is wrong with it)
    record, error = stored_record(ctx, cmd, offset, "consume message directly",
                                  f"can not find message by the offset message id, {msg_id}")
    if error is not None:
        return error
    fields = dict(cmd.ext_fields, brokerName=ctx.config.broker_name)
    return await _call_consumer(ctx, cmd, RequestCode.CONSUME_MESSAGE_DIRECTLY, fields, bytes(record))


async def _call_consumer(ctx, cmd, code: int, fields: dict, body: bytes) -> RemotingCommand:
    group = cmd.str_field("consumerGroup", required=True)
    client_id = cmd.str_field("clientId", required=True)
    g = ctx.clients.consumers.get(group)
    ch = next((c for c in (g.channels.values() if g is not None else ()) if c.client_id == client_id and c.alive),
              None)
    if ch is None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"The Consumer <{group}> <{client_id}> not online")
    request = RemotingCommand.request(code, fields, body, language=LanguageCode.JAVA)
    try:
        answer = await ch.conn.request(request, CALL_TIMEOUT_S)
    except RequestTimeoutError as exc:
        return cmd.response(ResponseCode.CONSUME_MSG_TIMEOUT, f"consumer <{group}> <{client_id}> Timeout: {exc}")
    except Exception as exc:  # noqa: BLE001 - the consumer's connection failing is this request's answer
        log.info("calling consumer %s of %s failed: %s", client_id, group, exc)
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"invoke consumer <{group}> <{client_id}> Exception: {exc}")
    return cmd.response(answer.code, answer.remark, answer.ext_fields, answer.body_bytes())


@_limited
async def invoke_broker_to_get_consumer_status(ctx, conn, cmd):
    topic = cmd.str_field("topic", required=True)
    group = cmd.str_field("group", required=True)
    only = cmd.str_field("clientAddr")          # (a client id, despite its name)
    g = ctx.clients.consumers.get(group)
    channels = [ch for ch in (g.channels.values() if g is not None else ()) if ch.alive]
    if not channels:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"No Any Consumer online in the consumer group: [{group}]")
    asked = [ch for ch in channels if not only or ch.client_id == only][:1 if only else None]
    answers = await asyncio.gather(*(_consumer_status(ctx, ch, topic, group, conn) for ch in asked))
    stop_if_gone(conn)      # (the asker went while its consumers answered)
    return cmd.response(ResponseCode.SUCCESS, body=await in_steps(consumer_status_steps(
        {ch.client_id: offsets for ch, offsets in zip(asked, answers) if offsets is not None}), conn))


async def _consumer_status(ctx, ch, topic: str, group: str, asker=None) -> dict | None:
    """One consumer's {queue: offset} of ``topic``, or None when it did not say (logged, as RocketMQ, at most every
    10 s: a consumer answering garbage and a client asking in a loop wrote a WARNING an ask); cancelled once the
    ``asker``'s connection went while it was read."""
    request = RemotingCommand.request(RequestCode.GET_CONSUMER_STATUS_FROM_CLIENT, {"topic": topic, "group": group},
                                      language=LanguageCode.JAVA)
    try:
        answer = await ch.conn.request(request, STATUS_TIMEOUT_S)
        if answer.code != ResponseCode.SUCCESS or not answer.body_bytes():
            return None
        # (read a slice at a time: a consumer's answer may be a frame's 16 MiB, 2.5 s of the event loop in one go)
        return await in_steps(mq_table_steps(answer.body_bytes(), "messageQueueTable", int), asker)
    except Exception as exc:  # noqa: BLE001 - one consumer failing leaves it out of the answer, as RocketMQ
        ctx.limits.warn("consumer-status-failed", f"[get-consumer-status] consumer {ch.client_id[:200]} of "
                        f"{group[:200]}: {str(exc)[:200]}")
        return None
