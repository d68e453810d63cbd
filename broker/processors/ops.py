"""Operators' codes, with the bodies a 4.x broker writes (protocol/admin_bodies.py):

GET_CONSUME_STATS (208), GET_BROKER_CONSUME_STATS (317), GET_CONSUMER_CONNECTION_LIST (203),
GET_PRODUCER_CONNECTION_LIST (204), GET_TOPIC_STATS_INFO (202), GET_BROKER_RUNTIME_INFO (28), QUERY_TOPIC_CONSUME_BY_WHO (300),
GET_ALL_SUBSCRIPTIONGROUP_CONFIG (201), UPDATE_AND_CREATE_SUBSCRIPTIONGROUP (200), DELETE_SUBSCRIPTIONGROUP (207),
DELETE_TOPIC_IN_BROKER (215), INVOKE_BROKER_TO_RESET_OFFSET (222), which tells live consumers with
RESET_CONSUMER_CLIENT_OFFSET (220), and CLONE_GROUP_OFFSET (314).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging

from protocol.admin_bodies import (consume_stats_head, consume_stats_members, dump, encode_reset_offset,
                                   encode_topic_stats)
from protocol.codes import LanguageCode, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.message import validate_group, validate_topic
from protocol.txlog import PROGRESS_GROUP

from ..store.disk import human_bytes
from ..limits import at_most, peer_host
from ..slices import in_steps, members_in_slices, sorted_in_slices, stop_if_gone
from ..subscriptions import SYSTEM_GROUPS, retry_queues
from ..topics import RETRY_PREFIX, is_system_topic
from .admin import refused_on_slave, topics_saved
from ..store.offsets import ADMIN_REST_MAX_S
from .offsets import offsets_saved
from .pull import forget_moves

log = logging.getLogger("txmq.ops")

VERSION_DESC = "V4_9_8"
SUBSCRIPTION_SLICE = 2000       # subscriptions written between two turns of the loop (GET_CONSUMER_CONNECTION_LIST)
CONSUME_STATS_SLICE = 2048      # queues read, and written, between two turns (GET_CONSUME_STATS; topics: 1,024 each)
_RESPONSE_HEAD_ROOM = 1024     # bytes of a frame a response's length, header and brokerAddr may take beside its body (GET_BROKER_CONSUME_STATS)
# GET_BROKER_CONSUME_STATS gathered at once (each holds up to a frame until sent; RocketMQ answers admin codes on
# 16 threads); one past them SYSTEM_BUSY
MAX_BROKER_CONSUME_STATS = 4
PRODUCER_GROUP_SLICE = 512      # producer groups written between two turns (GET_ALL_PRODUCER_INFO)
CORRECTION_SLICE = 1024         # offsets read between two turns (QUERY_CORRECTION_OFFSET)


def _language(code: int) -> str:
    try:
        return LanguageCode(code).name
    except ValueError:
        return "OTHER"


def _peer(conn) -> str:
    peer = getattr(conn, "peer", None) or ("", 0)
    return f"{peer[0]}:{peer[1]}"


def _queue_nums(tc, read: bool) -> int:
    return tc.read_queue_nums if read else tc.write_queue_nums


# ------------------------------------------------------------------ consumer progress
async def get_consume_stats(ctx, conn, cmd):
    group = cmd.str_field("consumerGroup", required=True)
    topic = cmd.str_field("topic")
    topics = [topic] if topic else ctx.offsets.topics_of(group)
    rows = {}
    tps = 0.0
    # The rows a slice of queues at a time (a turn once CONSUME_STATS_SLICE were read: a turn a slice of topics
    # instead made a group on thousands of one-queue topics wait thousands of turns), then the body a slice of
    # queues at a time, the loop running between: a group holding offsets on many topics is every queue of each
    # (32 topics of 1,024 queues: 32,768 rows, some 1 s of the event loop in one go on a loaded host).
    read = 0
    for t in topics:
        if read >= CONSUME_STATS_SLICE:
            read = 0
            await asyncio.sleep(0)
            stop_if_gone(conn)      # (the asker went: nobody to answer)
        tc = ctx.topics.get(t)
        if tc is None or ctx.clients.reads_elsewhere(group, t):
            continue
        tps += ctx.metrics.consume_tps(group, t)
        read += max(1, tc.read_queue_nums)
        rows.update(_offset_rows(ctx, group, t, tc, read=True))
    return cmd.response(ResponseCode.SUCCESS, body=await members_in_slices(
        consume_stats_head(tps), sorted(rows), CONSUME_STATS_SLICE, functools.partial(consume_stats_members, rows),
        ",", "}}", conn))


def _offset_rows(ctx, group: str, t: str, tc, read: bool) -> dict:
    """ConsumeStats' OffsetWrapper of each of topic ``t``'s read (or write) queues (its config ``tc``):
    {MessageQueue: (broker offset, ``group``'s offset, store time of the last message it consumed)}, each at least 0."""
    rows = {}
    for qid in range(_queue_nums(tc, read)):
        broker_offset = max(0, ctx.store.max_offset(t, qid))
        consumer_offset = max(0, ctx.offsets.get(group, t, qid) or 0)
        last = ctx.store.store_time_of(t, qid, consumer_offset - 1) if consumer_offset > 0 else 0
        rows[(t, ctx.config.broker_name, qid)] = (broker_offset, consumer_offset, max(last, 0))
    return rows


@at_most("broker_consume_stats", MAX_BROKER_CONSUME_STATS,
         f"{MAX_BROKER_CONSUME_STATS} GET_BROKER_CONSUME_STATS are being answered already, try again later")
async def get_broker_consume_stats(ctx, conn, cmd):
    """GET_BROKER_CONSUME_STATS (317), mqadmin brokerConsumeStats: every group's ConsumeStats of each topic it holds
    offsets on, a ConsumeStatsList {"brokerAddr","consumeStatsList":[{group:[ConsumeStats]}],"totalDiff"}, as
    4.9.8's AdminBrokerProcessor.fetchAllConsumeStatsInBroker: the groups of its subscription table (here the
    stored, system and known ones GET_ALL_SUBSCRIPTIONGROUP_CONFIG lists), each topic's write queues, a topic
    gone or (isOrder) not ordered left out, and one the group's online members do not read (as GET_CONSUME_STATS);
    totalDiff the sum of broker less consumer offsets. Read CONSUME_STATS_SLICE queues between two turns of the
    loop, as 208's (a broker holding 100,000 offsets is as many rows). It was REQUEST_CODE_NOT_SUPPORTED, and the
    command failed.

    The body is the whole broker's progress in one frame: past max_frame_size (RocketMQ's 16 MiB, what a client
    reads) it is refused SYSTEM_ERROR as soon as it is, naming what to ask instead. Sent whole, 200 groups on 100
    topics of 8 queues were 19.6 MB that mqadmin could not decode, and 8 such requests at once held 330 MB.
    MAX_BROKER_CONSUME_STATS are gathered at once (RocketMQ's 16 admin threads), one past them SYSTEM_BUSY."""
    order_only = cmd.bool_field("isOrder", False)
    known = set(ctx.clients.consumers).union(ctx.offsets.groups(), ctx.subscriptions.groups, SYSTEM_GROUPS)
    entries, total_diff, read, size = [], 0, 0, 0
    room = ctx.config.max_frame_size - _RESPONSE_HEAD_ROOM
    for group in await sorted_in_slices(known, CONSUME_STATS_SLICE * 4, conn):
        read += 1       # (a group with no offset is a member of the body too)
        if read >= CONSUME_STATS_SLICE:         # (50,000 groups holding no offset turn the loop too)
            read = 0
            await asyncio.sleep(0)
            stop_if_gone(conn)
        stats = []
        size += len(group) + 8
        for t in ctx.offsets.topics_of(group):
            if read >= CONSUME_STATS_SLICE:     # (before each topic: a group's may be thousands of queues)
                read = 0
                await asyncio.sleep(0)
                stop_if_gone(conn)
            read += 1
            tc = ctx.topics.get(t)
            if tc is None or (order_only and not tc.order) or ctx.clients.reads_elsewhere(group, t):
                continue
            read += tc.write_queue_nums
            rows = _offset_rows(ctx, group, t, tc, read=False)
            total_diff += sum(broker - consumer for broker, consumer, _ in rows.values())
            stats.append(consume_stats_head(ctx.metrics.consume_tps(group, t))
                         + consume_stats_members(rows, sorted(rows)) + "}}")
            size += len(stats[-1]) + 1
            if size > room:     # (checked at each topic: one group's may be the whole frame)
                return cmd.response(ResponseCode.SYSTEM_ERROR, (
                    f"the ConsumeStatsList of every group passed {human_bytes(room)} at group {group} ({len(entries)}"
                    f" of {len(known)} groups before it), more than the frame a client reads (max_frame_size "
                    f"{human_bytes(ctx.config.max_frame_size)}): ask each group's progress with mqadmin "
                    f"consumerProgress -g GROUP (GET_CONSUME_STATS), or brokerConsumeStats -o true for the ordered "
                    f"topics only"))
        entries.append(f"{{{dump(group)}:[{','.join(stats)}]}}")
    body = (f'{{"brokerAddr":{dump(ctx.broker_addr)},"consumeStatsList":[{",".join(entries)}],'
            f'"totalDiff":{total_diff}}}')
    return cmd.response(ResponseCode.SUCCESS, body=body.encode())


def subscription_data(topic: str, s) -> dict:
    """A consumer's Subscription as RocketMQ's SubscriptionData (keys as fastjson sorts them)."""
    return {"classFilterMode": False, "codeSet": sorted(s.codes), "expressionType": s.expression_type,
            "subString": s.sub_string, "subVersion": s.sub_version, "tagsSet": sorted(s.tags), "topic": topic}


async def get_consumer_connection_list(ctx, conn, cmd):
    name = cmd.str_field("consumerGroup", required=True)
    group = ctx.clients.consumers.get(name)
    if group is None or not group.channels:
        return cmd.response(ResponseCode.CONSUMER_NOT_ONLINE, f"the consumer group[{name}] not online")
    connections = [_connection(ch) for ch in group.channels.values()]
    head = dump({"connectionSet": sorted(connections, key=lambda c: c["clientId"]),
                 "consumeFromWhere": group.consume_from_where, "consumeType": group.consume_type,
                 "messageModel": group.message_model})
    subs = group.subscriptions

    def members(topics) -> str:     # (one a heartbeat dropped meanwhile is left out)
        return dump({t: subscription_data(t, subs[t]) for t in topics if t in subs})[1:-1]

    # The subscription table a slice at a time: a group's can be some 37,000 topics (max_subscription_bytes_per_group
    # of short names), 0.6 s of the event loop written in one go.
    return cmd.response(ResponseCode.SUCCESS, body=await members_in_slices(
        head[:-1] + ',"subscriptionTable":{', sorted(subs), SUBSCRIPTION_SLICE, members, ",", "}}", conn))


def get_producer_connection_list(ctx, conn, cmd):
    """GET_PRODUCER_CONNECTION_LIST (mqadmin producerConnection): the group's live producers, a ProducerConnection.
    A group with none is SYSTEM_ERROR with RocketMQ's remark."""
    name = cmd.str_field("producerGroup", required=True)
    channels = ctx.clients.producer_channels(name)
    if not channels:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"the producer group[{name}] not exist")
    connections = sorted((_connection(ch) for ch in channels), key=lambda c: c["clientId"])
    return cmd.response(ResponseCode.SUCCESS, body=dump({"connectionSet": connections}).encode())


async def get_all_producer_info(ctx, conn, cmd):
    """GET_ALL_PRODUCER_INFO (328), mqadmin producer: every producer group's live clients, a ProducerTableInfo
    {"data":{group:[ProducerInfo]}}; remoteIP as Java's InetSocketAddress.toString writes it ("/host:port"),
    lastUpdateTimestamp the wall-clock time of its last heartbeat (the registry keeps it on the monotonic clock).
    Written PRODUCER_GROUP_SLICE groups at a time, the loop running between: one client's heartbeats may make up
    max_groups_per_host (10,000) groups, 0.7-1.2 s of the event loop written in one go on a loaded host."""
    wall_minus_mono = ctx.clock() - ctx.clients.clock()

    def members(groups) -> str:     # (a group whose clients left meanwhile is left out, as an empty one was)
        data = {}
        for group in groups:
            channels = sorted(ctx.clients.producer_channels(group), key=lambda ch: ch.client_id)
            if channels:
                data[group] = [{"clientId": ch.client_id, "language": _language(ch.language),
                                "lastUpdateTimestamp": ch.last_seen_ms + wall_minus_mono,
                                "remoteIP": "/" + _peer(ch.conn), "version": ch.version} for ch in channels]
        return dump(data)[1:-1]

    return cmd.response(ResponseCode.SUCCESS, body=await members_in_slices(
        '{"data":{', sorted(ctx.clients.producers), PRODUCER_GROUP_SLICE, members, ",", "}}", conn))


def _connection(ch) -> dict:
    """RocketMQ's Connection, as fastjson writes it."""
    return {"clientAddr": _peer(ch.conn), "clientId": ch.client_id, "language": _language(ch.language),
            "version": ch.version}


def query_topic_consume_by_who(ctx, conn, cmd):
    topic = cmd.str_field("topic", required=True)
    groups = {name for name, g in ctx.clients.consumers.items() if topic in g.subscriptions}
    groups |= ctx.offsets.groups_of(topic)       # (not a walk of every offset: asked of every topic)
    return cmd.response(ResponseCode.SUCCESS, body=dump({"groupList": sorted(groups)}).encode())


def query_consume_time_span(ctx, conn, cmd):
    """QueryConsumeTimeSpanBody, a QueueTimeSpan for each write queue of ``topic`` (AdminBrokerProcessor.
    queryConsumeTimeSpan): the store times of its first and last messages and of the last one ``group`` consumed
    (its first's when it consumed none), and how long ago the next one it has to consume was stored (0: none).
    That next one is the queue's first when the group has no offset or one retention went past: RocketMQ reads
    a time of -1 there and says the group is now+1 ms behind (56 years)."""
    topic = cmd.str_field("topic", required=True)
    group = cmd.str_field("group", required=True)
    tc = ctx.topics.get(topic)
    if tc is None:
        return cmd.response(ResponseCode.TOPIC_NOT_EXIST, f"topic[{topic}] not exist")
    store, now, spans = ctx.store, ctx.clock(), []
    for qid in range(tc.write_queue_nums):
        lo, hi = max(0, store.min_offset(topic, qid)), max(0, store.max_offset(topic, qid))
        min_time = store.earliest_store_time(topic, qid)
        consumed = ctx.offsets.get(group, topic, qid)
        consumed = -1 if consumed is None else consumed
        behind = 0
        if consumed < hi:
            next_time = store.store_time_of(topic, qid, max(consumed, lo))
            behind = now - next_time if next_time >= 0 else 0
        spans.append({"consumeTimeStamp": store.store_time_of(topic, qid, consumed - 1) if consumed > 0 else min_time,
                      "delayTime": behind, "maxTimeStamp": store.store_time_of(topic, qid, hi - 1),
                      "messageQueue": {"brokerName": ctx.config.broker_name, "queueId": qid, "topic": topic},
                      "minTimeStamp": min_time})
    return cmd.response(ResponseCode.SUCCESS, body=dump({"consumeTimeSpanSet": spans}).encode())


async def query_correction_offset(ctx, conn, cmd):
    """QUERY_CORRECTION_OFFSET (308; MQClientAPIImpl.queryCorrectionOffset): QueryCorrectionOffsetBody, for each
    queue of ``topic`` the least offset any group holding offsets on it has committed there, a group named in
    ``filterGroups`` (comma-separated) left out, an offset retention already went past (below the queue's first)
    left out, a queue no offset counts for left out (AdminBrokerProcessor.queryCorrectionOffset with
    ConsumerOffsetManager.queryMinOffsetInAllGroup). It was REQUEST_CODE_NOT_SUPPORTED.
    Unlike 4.9.8, the groups filtered out keep their offsets: RocketMQ removes them from its offset table
    (its keySet) while it answers, every topic's, and a restart or the next save loses them. ``compareGroup``
    is required, as there, and changes nothing, as there (4.9.8 looks it up as the group named by the topic
    on the topic it names, and finds no offset). The groups are read CORRECTION_SLICE offsets at a time, the
    loop running between (in one go, 10,000 groups of one topic held it some 45 ms)."""
    topic = cmd.str_field("topic", required=True)
    cmd.str_field("compareGroup", required=True)
    left_out = {g for g in (cmd.str_field("filterGroups") or "").split(",") if g}
    least = await in_steps(_least_offsets(ctx, topic, ctx.offsets.groups_of(topic) - left_out), conn)
    return cmd.response(ResponseCode.SUCCESS, body=dump(
        {"correctionOffsets": {str(qid): offset for qid, offset in least.items()}}).encode())


def _least_offsets(ctx, topic: str, groups: set[str]):
    """Steps (in_steps) of QUERY_CORRECTION_OFFSET: each queue's least offset of ``groups`` on ``topic`` not below
    its first, a step ending once CORRECTION_SLICE offsets were read (between two groups: each one's read whole)."""
    least: dict[int, int] = {}
    first: dict[int, int] = {}      # each queue's first offset, looked up once, not once a group
    read = 0
    for group in groups:
        offsets = ctx.offsets.of(group, topic)      # (a copy: a commit between two steps changes nothing here)
        for qid, offset in offsets.items():
            floor = first.get(qid)
            if floor is None:
                floor = first[qid] = ctx.store.min_offset(topic, qid)
            if offset >= floor and offset < least.get(qid, offset + 1):
                least[qid] = offset
        read += len(offsets)
        if read >= CORRECTION_SLICE:
            read = 0
            yield
    return least


# ------------------------------------------------------------------ topics and the broker
def get_topic_stats_info(ctx, conn, cmd):
    topic = cmd.str_field("topic", required=True)
    tc = ctx.topics.get(topic)
    if tc is None:
        return cmd.response(ResponseCode.TOPIC_NOT_EXIST, f"topic[{topic}] not exist")
    rows = {}
    for qid in range(tc.write_queue_nums):
        lo, hi = max(0, ctx.store.min_offset(topic, qid)), max(0, ctx.store.max_offset(topic, qid))
        rows[(topic, ctx.config.broker_name, qid)] = (lo, hi, ctx.store.store_time_of(topic, qid, hi - 1)
                                                       if hi > 0 else 0)
    return cmd.response(ResponseCode.SUCCESS, body=encode_topic_stats(rows))


def runtime_info(ctx) -> dict[str, str]:
    """The KVTable of GET_BROKER_RUNTIME_INFO: RocketMQ's keys where this broker has the value, txmq's after."""
    store, disk = ctx.store, ctx.store.disk
    now = ctx.clock()
    up = max(0, now - ctx.started_ms) // 1000
    index = ctx.index.stats() if ctx.index is not None else None
    put_tps, get_tps = ctx.metrics.store_tps()
    info = {
        "brokerVersionDesc": VERSION_DESC, "brokerVersion": "409",
        "bootTimestamp": str(ctx.started_ms),
        "runtime": f"[ {up // 86400} days, {up % 86400 // 3600} hours, {up % 3600 // 60} minutes, "
                   f"{up % 60} seconds ]",
        # totals since start, never forgotten (a deleted topic's too), and at the last two local midnights:
        # exportMetrics parses the mornings' (a missing one failed it for every broker)
        "msgPutTotalTodayNow": str(getattr(ctx.metrics, "put_total", 0)),
        "msgGetTotalTodayNow": str(getattr(ctx.metrics, "get_total", 0)),
        **{key: str(total) for key, total in getattr(ctx.metrics, "mornings", {}).items()},
        # mqadmin clusterList splits these and reads the first rate: missing, it printed a NullPointerException
        # for each broker and 0 in and out
        "putTps": put_tps, "getTransferedTps": get_tps,
        "commitLogMinOffset": str(store.min_physical_offset), "commitLogMaxOffset": str(store.max_physical_offset),
        "commitLogDiskRatio": str(disk.ratio), "consumeQueueDiskRatio": str(disk.ratio),
        "commitLogDirCapacity": f"Total : {human_bytes(disk.total_bytes)}, Free : {human_bytes(disk.free_bytes)}.",
        "remainHowManyDataToFlush": human_bytes(store.max_physical_offset - store.flushed_offset),
        "dispatchBehindBytes": str(max(0, store.max_physical_offset - index["covered"]) if index else 0),
        "earliestMessageTimeStamp": str(store.earliest_message_time()),
        "startAcceptSendRequestTimeStamp": "0",
        "txmqTopics": str(len(ctx.topics.topics)),
        "txmqConsumerGroups": str(len(ctx.clients.consumers)),
        "txmqProducerGroups": str(len(ctx.clients.producers)),
        "txmqQueueLocks": str(len(ctx.clients.locks)),
        "txmqDiskRefusingWrites": str(disk.refusing).lower(),
    }
    if ctx.tx is not None and ctx.config.broker_role != "SLAVE":    # a slave's index is its start-up one
        info["txmqUndecidedTransactions"] = str(len(ctx.tx.pending))
    if index is not None:
        info.update(txmqIndexFiles=str(index["files"]), txmqIndexEntries=str(index["entries"]),
                    txmqIndexLastUpdateTimestamp=str(index["last_update_ts"]))
    return info


def get_broker_runtime_info(ctx, conn, cmd):
    return cmd.response(ResponseCode.SUCCESS, body=dump({"table": runtime_info(ctx)}).encode())


def get_all_delay_offset(ctx, conn, cmd):
    """GET_ALL_DELAY_OFFSET (45): the delay levels' delivery progress as RocketMQ's delayOffset.json has it,
    {"offsetTable": {level: next SCHEDULE_TOPIC_XXXX queue offset}}. A Java slave of this master asks it every
    sync and writes it to its own delayOffset.json: refused (logged there every 10 s), it kept none, and restarted
    as the master it delivered every delayed message its log still held again. (A txmq slave needs no copy: the
    progress is in the log it copies.) A slave's own progress is the one it had at start-up: it says so."""
    if ctx.config.broker_role == "SLAVE":
        return cmd.response(ResponseCode.SYSTEM_ERROR, "this broker is a slave: its delay progress is in the log it "
                            "copies, and the one it holds is its start-up one; ask its master")
    levels = ctx.schedule.progress.levels
    return cmd.response(ResponseCode.SUCCESS, body=json.dumps(
        {"offsetTable": {str(level): offset for level, offset in sorted(levels.items())}}).encode())


async def delete_topic_in_broker(ctx, conn, cmd):
    # Refused on a slave (validateSlave). Accepted, its queues went with the deleted-topic mark while the master kept
    # the topic: its next records were indexed from their own offset on, and a consumer failed over to the slave
    # found every earlier message gone (OFFSET_TOO_SMALL), for good (the mark holds at restart).
    refused = refused_on_slave(ctx, cmd)
    if refused is not None:
        return refused
    topic = cmd.str_field("topic", required=True)
    why = validate_topic(topic)
    if why is not None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, why)
    if is_system_topic(topic):
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"The topic[{topic}] is conflict with system topic.")
    existed, unmarked = [], []

    # The config goes with the queues, between the writer's batches: forgotten before, a send accepted earlier and
    # written after it opened a new queue, and the store made the topic again (topics.queue_appeared). The offsets
    # with them: after the delete, in this coroutine, a stop cancelling it while the writer ran the delete (which
    # then finishes) left the deleted topic's offsets to be saved, its groups at their old positions on a new one.
    def forget():
        existed.append(ctx.topics.delete(topic))
        ctx.offsets.remove_topic(topic)
        ctx.metrics.forget_topic(topic)
        forget_moves(topic)
    queues = await ctx.store.delete_topic(topic, forget, unmarked.append)
    existed = bool(existed and existed[0])
    log.warning("topic %s deleted by %s (%s, %d consume queues removed; its records stay in the log until "
                "retention)", topic, _peer(conn), "configured" if existed else "not configured", queues)
    # Answered once the catalogue and the offsets say so: a kill before their batched writes brought the topic
    # back with its old settings (and its groups' offsets) though the operator was told it was gone.
    reply = await topics_saved(ctx, cmd, f"topic {topic} deleted")
    # (paced: a topic made, a oneway commit on it, then this, in a loop, had the offsets saved back to back; the
    # rest bounded: a stock mqadmin deleteTopic times out after 5 s, and then leaves the topic in the name server)
    reply = await offsets_saved(ctx, cmd, f"topic {topic} deleted", reply, paced=True, max_rest=ADMIN_REST_MAX_S)
    if unmarked and reply.code == ResponseCode.SUCCESS:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"topic {topic} deleted, but its mark was not written "
                            f"({unmarked[0]}): a restart may index its old records again and serve it with the "
                            "default settings; delete it again once the store's disk is writable")
    return reply


# ------------------------------------------------------------------ subscription groups
async def get_all_subscription_group(ctx, conn, cmd):
    # The groups holding offsets off the offsets' per-group index, and encoded a slice at a time: a walk of every
    # offset and the table in one go held the loop 90-130 ms at 100,000 offsets of 10,000 groups, at each sync.
    known = set(ctx.clients.consumers).union(ctx.offsets.groups())
    return cmd.response(ResponseCode.SUCCESS, body=await ctx.subscriptions.encode_in_slices(known, conn))


async def update_and_create_subscription_group(ctx, conn, cmd):
    refused = refused_on_slave(ctx, cmd)    # the master's groups replace a slave's at its next copy
    if refused is not None:
        return refused
    try:
        values = json.loads(cmd.body_bytes() or b"null")
        if not isinstance(values, dict):
            raise ValueError("not a JSON object")
        refused = ctx.limits.may_add_group(conn, cmd, ctx.subscriptions, values.get("groupName"))
        if refused is not None:
            return refused
        cfg = ctx.subscriptions.update(values)
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"subscription group config body is not usable: {exc}")
    log.info("subscription group %s updated by %s", cfg["groupName"], _peer(conn))
    # A retry topic made already (the group's consumers run) grows to a raised retryQueueNums now, so its route
    # says so before the next send-back; lowered, it keeps its queues and what is in them.
    # Grown within the queue limits (max_queues, max_queues_per_host: the asker is charged, as for a topic it
    # grows); past them it keeps the queues it has, the refusal counted and logged, and the config is saved.
    # (With an ACL the request was signed by an account allowed to: an operator's, charged to no address, as
    # UPDATE_AND_CREATE_TOPIC's.)
    topic, queues = RETRY_PREFIX + cfg["groupName"], retry_queues(ctx.subscriptions, cfg["groupName"])
    asker = peer_host(conn) if ctx.acl is None else None
    growing = topic in ctx.topics.topics and ctx.limits.queue_room(
        ctx.topics, topic, queues, asker, "grown") is None and ctx.topics.grow(topic, queues, asker)
    reply = await _saved(ctx, cmd, f"subscription group {cfg['groupName']} set")
    if growing and reply.code == ResponseCode.SUCCESS:     # saved too (if it grew), as UPDATE_AND_CREATE_TOPIC's
        reply = await topics_saved(ctx, cmd, f"subscription group {cfg['groupName']} set, topic {topic} grown,")
    return reply


async def delete_subscription_group(ctx, conn, cmd):
    """DELETE_SUBSCRIPTIONGROUP: the group's config goes and, with removeOffset, its committed offsets, as
    RocketMQ's (mqadmin deleteSubGroup -c, and `admin delete-group`, then delete its %RETRY% and %DLQ% topics).
    A group that was gone kept its offsets, its lag series and its entry in every group listing for good."""
    refused = refused_on_slave(ctx, cmd)    # its offsets gone there until a copy: while the master is away, none
    if refused is not None:
        return refused
    group = cmd.str_field("groupName", required=True)
    remove_offset = cmd.bool_field("removeOffset", False)
    existed = ctx.subscriptions.delete(group)
    held = group in ctx.offsets.groups()
    if remove_offset:
        ctx.offsets.remove_group(group)
    ctx.metrics.forget_consumer_group(group)
    # Its offsets kept: the delete is saved with them (mark_deleted), its lag left out across restarts too. A name
    # holding no offset is not kept (nothing of it left to count: made-up names).
    kept = ctx.offsets.mark_deleted(group)
    # Said at INFO, as RocketMQ's and as an update (a clean-up script's 1,000 deletes were 1,000 WARNING lines); a
    # delete that found nothing to remove at most every 10 s (any client may loop made-up names: each was a line).
    if existed or held:
        log.info("subscription group %s deleted by %s (%s%s)", group, _peer(conn),
                 "configured" if existed else "not configured",
                 "" if not held else ", offsets removed" if remove_offset else ", offsets kept")
    else:
        ctx.limits.warn("group-delete-nothing", f"subscription group {group[:200]!r} deleted by {_peer(conn)}: it "
                        "had no config and no offsets, nothing removed (a misspelt name?)")
    reply = await _saved(ctx, cmd, f"subscription group {group} deleted") if existed else cmd.response(
        ResponseCode.SUCCESS)
    if remove_offset or kept:   # else a kill before the periodic save brought the group's offsets (or lag) back
        # (paced: a oneway commit then this, in a loop, had the table saved back to back)
        done = f"subscription group {group}'s offsets removed" if remove_offset else \
            f"subscription group {group} deleted (its offsets kept)"
        reply = await offsets_saved(ctx, cmd, done, reply, paced=True, max_rest=ADMIN_REST_MAX_S)
    return reply


async def _saved(ctx, cmd, done: str):
    """Write the subscription groups' file (off the loop); SUCCESS, or SYSTEM_ERROR saying ``done`` but not saved."""
    try:
        await ctx.subscriptions.save()      # (a failure is logged, and the save retried until it is done)
    except OSError as exc:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"{done} but not saved (retried until it is): {exc}")
    return cmd.response(ResponseCode.SUCCESS)


def consume_guard(handler):
    """Pulls of a group whose config says consumeEnable=false are refused, as RocketMQ does."""
    @functools.wraps(handler)
    def guarded(ctx, conn, cmd):
        subs = ctx.subscriptions
        if subs is not None and subs.groups:
            group = cmd.ext_fields.get("consumerGroup")
            if group is not None and not subs.consume_enabled(group):
                return cmd.response(ResponseCode.NO_PERMISSION, f"subscription group no permission, {group}")
        return handler(ctx, conn, cmd)
    return guarded


# ------------------------------------------------------------------ offsets reset
async def reset_offset(ctx, conn, cmd):
    """Move a group's offsets on a topic to the message stored at ``timestamp`` (-1: the end).

    Broker2Client.resetOffset, with one addition: the new offsets are also committed here, so a
    group with no live consumer is reset as well (RocketMQ answers CONSUMER_NOT_ONLINE, and
    mqadmin then writes the same offsets itself). With ``queueId`` and ``offset`` (RocketMQ 5's fields; a
    4.x client never sends them), that one queue moves to that offset and no other: how a group gets past a
    corrupt record (a pull's SYSTEM_ERROR names the command), where a time would move every queue.
    """
    topic = cmd.str_field("topic", required=True)
    group = cmd.str_field("group", required=True)
    timestamp = cmd.int_field("timestamp", required=True)
    force = cmd.bool_field("isForce", False)
    one_qid, one_offset = cmd.int_field("queueId", -1), cmd.int_field("offset", -1)
    if group == PROGRESS_GROUP:
        # The broker's own (its half queue's progress), refused as UPDATE_CONSUMER_OFFSET refuses it: reset past
        # an undecided half, a start-up without a usable transaction snapshot never read that half again.
        return cmd.response(ResponseCode.NO_PERMISSION, f"[reset-offset] consumer group {group} is the broker's "
                            "own (its transaction progress): not reset")
    tc = ctx.topics.get(topic)
    if tc is None:
        return cmd.response(ResponseCode.SYSTEM_ERROR,
                            f"[reset-offset] reset offset failed, no topic in this broker. topic={topic}")
    if not ctx.offsets.holds(group, topic):     # (a walk of every offset: 27 ms at 100,000)
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"THe consumer group <{group}> not exist")
    broker = ctx.config.broker_name
    one = one_qid >= 0 and one_offset >= 0
    if one:
        lo, hi = ctx.store.min_offset(topic, one_qid), ctx.store.max_offset(topic, one_qid)
        if one_qid >= tc.write_queue_nums or not lo <= one_offset <= hi:
            return cmd.response(ResponseCode.SYSTEM_ERROR, f"[reset-offset] queue {one_qid} of {topic} holds "
                                f"offsets {lo} to {hi}, not {one_offset}")
    table = {}
    for qid in (one_qid,) if one else range(tc.write_queue_nums):
        current = ctx.offsets.get(group, topic, qid)
        if current is None and not force:
            # Without force a queue only moves back; one the group never committed has no place to move back
            # from, and is left as it is (RocketMQ refuses the whole reset). Taken as 0, it was committed 0 and
            # its consumer read the whole queue again.
            continue
        if current is None and ctx.limits.offsets_full(ctx.offsets, group, topic, qid) is not None:
            # a new offset, past max_offsets: left as it is (each queue of a wide topic was one more past it)
            continue
        if one:
            target = one_offset
        else:
            target = max(ctx.store.max_offset(topic, qid) if timestamp == -1
                         else ctx.store.search_offset_by_time(topic, qid, timestamp), 0)
        table[(topic, broker, qid)] = target if force or target < current else current
    for (_t, _b, qid), offset in table.items():
        ctx.offsets.commit(group, topic, qid, offset)
    notified = 0
    if table:       # (with nothing to move no consumer is told: a Java one pauses some 10 s when it is)
        ctx.metrics.group_in_use(group)     # (a group deleted with its offsets kept: its lag counted again)
        notified = _notify_reset(ctx, group, topic, timestamp, force, table, cmd.language == LanguageCode.CPP)
    log.warning("[reset-offset] group %s topic %s to timestamp %d (force=%s) by %s: %s; %d consumers told",
                group, topic, timestamp, force, _peer(conn), {q: o for (_t, _b, q), o in table.items()}, notified)
    # On disk before SUCCESS: left to the periodic save, a kill within its interval put the group back where
    # it was -- the replay asked for never came, or the records skipped were delivered again.
    return await offsets_saved(ctx, cmd, f"[reset-offset] group {group} topic {topic} reset",
                                cmd.response(ResponseCode.SUCCESS, body=encode_reset_offset(table)),
                                paced=True, max_rest=ADMIN_REST_MAX_S)


async def clone_group_offset(ctx, conn, cmd):
    """Make one group's offsets on a topic another's (DefaultMQAdminExt.cloneGroupOffset; 4.9.8's
    AdminBrokerProcessor.cloneGroupOffset): the destination's offsets there become the source's, queue for queue
    (ConsumerOffsetManager.cloneOffset replaces the destination's whole map). Without ``offline``, a topic none of
    the source's online members subscribes to is left out, as 4.9.8 leaves it. With no topic, every topic the
    source holds offsets on, which 4.9.8 means and misses (it clones the topic named "null": nothing, SUCCESS).
    It was REQUEST_CODE_NOT_SUPPORTED. Live consumers of the destination are not told (nor by 4.9.8): their next
    commit wins. On disk before SUCCESS, as an admin's offset move."""
    src = cmd.str_field("srcGroup", required=True)
    dest = cmd.str_field("destGroup", required=True)
    topic = (cmd.str_field("topic") or "").strip()
    offline = cmd.bool_field("offline", False)
    why = validate_group(dest, "destGroup")     # kept in the table, its file and every slave's copy
    if why is not None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"{why}, no offset cloned")
    if dest == PROGRESS_GROUP:      # the broker's own, as UPDATE_CONSUMER_OFFSET refuses it
        return cmd.response(ResponseCode.NO_PERMISSION, f"consumer group {dest} is the broker's own (its "
                            "transaction progress): no offset cloned")
    cloned: dict[str, dict[int, int]] = {}
    unyielded = 0
    for t in [topic] if topic else ctx.offsets.topics_of(src):
        if unyielded >= CLONE_SLICE:    # every topic of a group of 100,000 offsets in one go: the loop held ~2 s
            await asyncio.sleep(0)
            unyielded = 0
        offsets = ctx.offsets.of(src, t)
        if ctx.topics.get(t) is None or not offsets or (not offline and ctx.clients.reads_elsewhere(src, t)):
            continue
        for qid in ctx.offsets.of(dest, t).keys() - offsets.keys():
            ctx.offsets.forget(dest, t, qid)
        for qid, offset in sorted(offsets.items()):
            if not ctx.offsets.has(dest, t, qid):
                full = ctx.limits.offsets_full(ctx.offsets, dest, t, qid)
                if full is not None:
                    done = (f"offsets of group {src} cloned to {dest} on {_topics_said(cloned) or 'no topic'} "
                            f"before it, and {t}'s in part")
                    return await offsets_saved(ctx, cmd, done, cmd.response(ResponseCode.SYSTEM_ERROR,
                                                                            f"{full} ({done})"))
            ctx.offsets.commit(dest, t, qid, offset, peer_host(conn))
        cloned[t] = offsets
        unyielded += len(offsets)
        ctx.metrics.group_in_use(dest)
    done = (f"offsets of group {src} cloned to {dest}: {sum(map(len, cloned.values()))} offsets on "
            f"{_topics_said(cloned)}" if cloned else f"no offset of group {src} cloned to {dest}: it holds none on "
            + (f"topic {topic}" if topic else "any topic") + " here"
            + ("" if offline else " that an online member of it subscribes to"))
    if cloned:      # (as a reset is: each said)
        log.warning("[clone-group-offset] %s (by %s)", done, _peer(conn))
    else:           # (a client looping over made-up groups is said once every few seconds)
        ctx.limits.warn("clone-nothing", f"[clone-group-offset] {done} (by {_peer(conn)})")
    # (nothing cloned is SUCCESS as in 4.9.8: the admin API asks every broker of the source's retry topic, and a
    # broker without the topic holds nothing to clone; the remark, which a Java client does not read, says so)
    reply = cmd.response(ResponseCode.SUCCESS, None if cloned else done)
    return await offsets_saved(ctx, cmd, done, reply, paced=True, max_rest=ADMIN_REST_MAX_S)


CLONED_TOPICS_SAID = 5
CLONE_SLICE = 4096      # offsets a clone makes between two turns of the loop (and one topic's queues)


def _topics_said(cloned: dict[str, dict[int, int]]) -> str:
    """The topics a clone went through, a few named with their offset counts: the line listed every offset (100,000
    offsets, megabytes a clone) and every topic."""
    named = ", ".join(f"{t} ({len(o)} queues)" for t, o in list(cloned.items())[:CLONED_TOPICS_SAID])
    rest = len(cloned) - CLONED_TOPICS_SAID
    return named + (f" and {rest} more topic(s)" if rest > 0 else "")


def _notify_reset(ctx, group: str, topic: str, timestamp: int, force: bool, table: dict, for_c: bool) -> int:
    g = ctx.clients.consumers.get(group)
    if g is None:
        return 0
    if for_c:       # ResetOffsetBodyForC: a list of MessageQueueForC
        body = dump({"offsetTable": [{"brokerName": b, "offset": o, "queueId": q, "topic": t}
                                     for (t, b, q), o in sorted(table.items())]}).encode()
    else:
        body = encode_reset_offset(table)
    told = 0
    for ch in list(g.channels.values()):
        if not ch.alive:
            continue
        request = RemotingCommand.request(RequestCode.RESET_CONSUMER_CLIENT_OFFSET,
                                          {"topic": topic, "group": group, "timestamp": timestamp,
                                           "isForce": force}, body, oneway=True, language=LanguageCode.JAVA)
        try:
            ch.conn.oneway(request)
            told += 1
        except Exception as exc:  # noqa: BLE001 - one dying channel must not stop the others
            log.info("[reset-offset] could not tell %s: %s", ch.client_id, exc)
    return told

