"""Topic administration and message lookup: UPDATE_AND_CREATE_TOPIC (17), VIEW_MESSAGE_BY_ID (33),
GET_ALL_TOPIC_CONFIG (21)."""
from __future__ import annotations

import json

from protocol.codes import Perm, ResponseCode
from protocol.errors import CorruptRecordError
from protocol.message import validate_topic

from ..limits import peer_host
from ..slices import members_in_slices
from ..topics import TopicConfig, TopicLimitError, is_system_topic


def refused_on_slave(ctx, cmd):
    """RocketMQ 4.9.8's validateSlave, first thing in UPDATE_AND_CREATE_TOPIC (17), UPDATE_AND_CREATE_SUBSCRIPTIONGROUP
    (200), DELETE_SUBSCRIPTIONGROUP (207) and DELETE_TOPIC_IN_BROKER (215): on a slave, SYSTEM_ERROR with its words;
    else None. A slave's topics and groups are its master's (SlaveSync copies them). Taken, a change held only until
    the next copy, and for as long as the master was away -- when an operator reaches for the slave: a group deleted
    there with its offsets had its consumers failing over to the slave start from the queue's start again, a topic's
    queues went with the deleted-topic mark."""
    if ctx.config.broker_role != "SLAVE":
        return None
    return cmd.response(ResponseCode.SYSTEM_ERROR, "Can't modify topic or subscription group from slave broker, "
                        "please execute it from master broker.")


async def update_and_create_topic(ctx, conn, cmd):
    refused = refused_on_slave(ctx, cmd)
    if refused is not None:
        return refused
    topic = cmd.str_field("topic", required=True)
    why = validate_topic(topic)
    if why is not None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, why)
    if is_system_topic(topic):
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"The topic[{topic}] is conflict with system topic.")
    read = cmd.int_field("readQueueNums", 16)
    write = cmd.int_field("writeQueueNums", 16)
    if not (0 < read <= 1024 and 0 < write <= 1024):
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"queue numbers must be 1..1024, got read={read} write={write}")
    # Without an ACL anyone may ask: the topic is its client's, as a send's (max_topics_per_host). With one, the
    # request was signed by an account allowed to, an operator's.
    creator = peer_host(conn) if ctx.acl is None else None
    if topic not in ctx.topics.topics:
        refused = ctx.limits.may_create(conn, cmd, ctx.topics, topic, queues=max(read, write),
                                        per_host=creator is not None)
    else:       # more queues for a topic there is: as many more files (queue_room)
        why = ctx.limits.queue_room(ctx.topics, topic, max(read, write), creator, "updated")
        refused = None if why is None else cmd.response(ResponseCode.NO_PERMISSION, why)
    if refused is not None:
        return refused
    try:
        ctx.topics.create(TopicConfig(topic, read, write, cmd.int_field("perm", Perm.READ_WRITE),
                                      cmd.str_field("topicFilterType", "SINGLE_TAG"), cmd.int_field("topicSysFlag", 0),
                                      cmd.bool_field("order")), creator)
    except TopicLimitError as exc:      # a %RETRY% topic past max_retry_groups, refused as a send's is
        ctx.limits.refused("retry-group-limit")
        return cmd.response(ResponseCode.NO_PERMISSION, str(exc))
    return await topics_saved(ctx, cmd, f"topic {topic} set")


async def topics_saved(ctx, cmd, done: str):
    """SUCCESS once the topics catalogue on disk holds the change (RocketMQ's ConfigManager.persist, before it
    answers), or SYSTEM_ERROR saying ``done`` but not saved: answered before the batched write, a broker killed
    then brought back the old settings (or no topic) though the operator was told SUCCESS."""
    try:
        await ctx.topics.saved()
    except OSError as exc:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"{done} but not saved (it is lost if the broker stops "
                            f"before a later write succeeds; retried every {ctx.topics.retry_write_s:g} s): {exc}")
    return cmd.response(ResponseCode.SUCCESS)


def stored_record(ctx, cmd, offset: int, reader: str, missing: str):
    """(the verified record at commit-log ``offset``, None), or (None, the SYSTEM_ERROR answer to ``cmd``): its body
    failing its CRC (never served, nor copied under a fresh one, as if sound), or no record there (``missing``)."""
    try:
        view = ctx.store.verified_record(offset, reader)
    except CorruptRecordError as exc:
        return None, cmd.response(ResponseCode.SYSTEM_ERROR, str(exc))
    if view is None:
        return None, cmd.response(ResponseCode.SYSTEM_ERROR, missing)
    return view, None


def view_message_by_id(ctx, conn, cmd):
    offset = cmd.int_field("offset", required=True)
    view, error = stored_record(ctx, cmd, offset, "view by id", f"can not find message by the offset, {offset}")
    return error or cmd.response(ResponseCode.SUCCESS, body=[view])


# Topics encoded between two turns of the loop (~5 us each): in one go, 50,000 held it 117-270 ms at each slave's
# sync (every slave_sync_interval_ms).
TOPIC_SLICE = 1024


async def get_all_topic_config(ctx, conn, cmd):
    # TopicConfigSerializeWrapper, keys in fastjson's order; a Java slave's SlaveSynchronize assigns dataVersion
    # to its own (a NullPointerException every sync when it was missing) and re-reads the table when it changed.
    # The version as the encoding starts: a topic changed while it runs is read again at the next sync (a version
    # of its end could name a table that missed the change, never read again).
    version = ctx.topics.data_version
    head = json.dumps({"counter": version.counter, "timestamp": version.timestamp})
    topics = ctx.topics.topics

    def members(names) -> str:      # (one deleted meanwhile is left out)
        return json.dumps({name: _topic_entry(topics[name]) for name in names if name in topics})[1:-1]

    # (the names alone: a list of 50,000 (name, config) pairs made work enough to start a full collection)
    return cmd.response(ResponseCode.SUCCESS, body=await members_in_slices(
        f'{{"dataVersion": {head}, "topicConfigTable": {{', list(topics), TOPIC_SLICE, members, ", ", "}}"))


def _topic_entry(tc: TopicConfig) -> dict:
    return {"topicName": tc.name, "readQueueNums": tc.read_queue_nums, "writeQueueNums": tc.write_queue_nums,
            "perm": tc.perm, "topicFilterType": tc.filter_type, "topicSysFlag": tc.sys_flag, "order": tc.order}
