"""PULL_MESSAGE (11): consume-queue reads, long polling, offset commit through the pull (spec 3.7).

The response body is the stored records themselves, as memoryview slices of
the commit log handed to the transport without a copy.
"""
from __future__ import annotations

import logging
import os
import struct
import time

from protocol.codes import Perm, PullSysFlag, ResponseCode
from protocol.message import POS_PHYSICAL_OFFSET, property_bytes, validate_group
from protocol.record import record_properties
from protocol.txlog import PROGRESS_GROUP

from ..clients import build_subscription, is_tag_type
from ..limits import EveryKey, peer_host
from ..store import GetStatus

log = logging.getLogger("txmq.pull")

# Store status -> (response code, how nextBeginOffset is chosen) on a master (spec 3.7 table).
_MAX_BYTES = 256 * 1024
_PHYS = struct.Struct(">q")
_RAM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
_EVAL_LOG_INTERVAL_S = 10.0
_eval_errors = {"logged_at": float("-inf"), "unlogged": 0}
# What one read may spend evaluating SQL92, in units of at most about a microsecond here: each record costs a
# few, and each of its expression's operators and property look-ups one per KiB of the record's properties (a
# look-up searches them, a comparison may convert a value as long). An expression near the caps costs some 400 a
# record: without a bound one pull scanned 800 or more such records, a third of a second or more (seconds with
# long properties) during which the loop answered nobody. Past it the read ends with what it found.
_FILTER_BUDGET = 10_000


def selector_filter(selector, group: str, topic: str, budget: int = _FILTER_BUDGET):
    """The store's record filter for one read of an SQL92 subscription (ExpressionMessageFilter.
    isMatchedByCommitLog): the record's properties (TAGS among them) evaluated; only TRUE passes. A message
    whose values cannot be compared does not pass, as in RocketMQ, and is logged (at most every 10 s, a count
    of the others). Once ``budget`` is spent it examines no more records (None: the read ends there); it
    always examines the first."""
    evaluate = selector.evaluate
    # Only the properties it reads are looked for, in the record's bytes: each found as string_to_properties
    # would give it (the last pair with a value wins), without decoding the rest or building a dict of all.
    pairs = tuple((name, b"\x02" + name.encode() + b"\x01") for name in selector.names)
    per_kib = selector.operators + 1 + len(pairs)
    spent = 0

    def matches(record) -> bool | None:
        nonlocal spent
        if spent and spent >= budget:     # never before the first: every read makes progress
            return None
        try:
            raw = b"\x02" + record_properties(record)      # one copy: bytes + a memoryview is bytes
            spent += 4 + per_kib * (1 + (len(raw) >> 10))
            props = {}
            for name, pair in pairs:
                value = property_bytes(raw, pair)
                if value is not None:
                    props[name] = str(value, "utf-8", "replace")
            return evaluate(props) is True
        except Exception as exc:    # noqa: BLE001 - as ExpressionMessageFilter's catch (Throwable): passed over, said
            now = time.monotonic()
            if now - _eval_errors["logged_at"] < _EVAL_LOG_INTERVAL_S:
                _eval_errors["unlogged"] += 1
                return False
            log.warning("group %s, topic %s: SQL92 filter %r cannot evaluate a message, which it passes over: %s "
                        "(%d more such messages since the last warning)", group, topic, selector.expression, exc,
                        _eval_errors["unlogged"])
            _eval_errors.update(logged_at=now, unlogged=0)
            return False
    return matches


def on_disk(ctx, physical_offset: int) -> bool:
    """RocketMQ's checkInDiskByCommitOffset: the record at ``physical_offset`` is further from the log's end than
    access_message_in_memory_max_ratio of RAM (so no longer expected in the page cache)."""
    return ctx.store.max_physical_offset - physical_offset > _RAM * ctx.config.access_message_in_memory_max_ratio // 100


def _code(cmd, status):
    if status is GetStatus.FOUND:
        return ResponseCode.SUCCESS
    if status is GetStatus.QUEUE_DAMAGED or status is GetStatus.RECORD_CORRUPT:
        return ResponseCode.SYSTEM_ERROR        # an error the client retries, never a skip past lost units
    if status in (GetStatus.NO_MATCHED_MESSAGE, GetStatus.MESSAGE_WAS_REMOVING):
        return ResponseCode.PULL_RETRY_IMMEDIATELY
    if status in (GetStatus.OFFSET_OVERFLOW_ONE, GetStatus.OFFSET_FOUND_NULL):
        return ResponseCode.PULL_NOT_FOUND
    if status in (GetStatus.NO_MATCHED_LOGIC_QUEUE, GetStatus.NO_MESSAGE_IN_QUEUE):
        return ResponseCode.PULL_OFFSET_MOVED if cmd.int_field("queueOffset", 0) != 0 else ResponseCode.PULL_NOT_FOUND
    return ResponseCode.PULL_OFFSET_MOVED  # OFFSET_TOO_SMALL, OFFSET_OVERFLOW_BADLY


def _suggest(ctx, group, got) -> int:
    """suggestWhichBrokerId (RocketMQ's PullMessageProcessor): 0, the master, unless slaveReadEnable; then the
    group's whichBrokerWhenConsumeSlowly (1 by default) when the consumer is further behind the log end than 40%
    of RAM would cache (accessMessageInMemoryMaxRatio), else the group's brokerId (0 by default). Suggesting the
    defaults whatever the group said, a group kept on the master went to the slave when it fell behind."""
    if not ctx.config.slave_read_enable:
        return 0
    subs = ctx.subscriptions
    broker_id, when_slow = subs.read_from(group) if subs is not None else (0, 1)
    if got.buffers and on_disk(ctx, _PHYS.unpack_from(got.buffers[-1], POS_PHYSICAL_OFFSET)[0]):
        return when_slow
    return broker_id


# Statuses whose nextBeginOffset is a correction of the consumer's offset (DefaultMessageStore.nextOffsetCorrection).
_CORRECTIONS = frozenset({GetStatus.NO_MATCHED_LOGIC_QUEUE, GetStatus.NO_MESSAGE_IN_QUEUE, GetStatus.OFFSET_TOO_SMALL,
                          GetStatus.OFFSET_OVERFLOW_ONE, GetStatus.OFFSET_OVERFLOW_BADLY, GetStatus.OFFSET_FOUND_NULL})


_moved = EveryKey(60.0)      # "group\0topic\0queue" keys whose move past removed messages was said this minute
_moved_to: dict[str, int] = {}      # "group\0topic\0queue" -> the minimum a pull last moved it to: counted to there
_MOVED_KEYS = 4096
MOVED_LINES_A_MINUTE = 100      # move lines of all groups: group names are a client's to make up, one a request
_moved_lines = {"since": float("-inf"), "n": 0}


def forget_moves(topic: str) -> None:
    """A deleted topic: one made again under its name starts at offset 0, below what was counted in the old one
    (kept, its groups' moves were taken for asks again of what was counted, and went unsaid)."""
    for key in [k for k in _moved_to if k.rsplit("\0", 2)[1] == topic]:
        del _moved_to[key]


def _moved_past_removed(ctx, group: str, topic: str, qid: int, asked: int, first: int) -> None:
    """A consumer asked for messages retention removed before it read them: PULL_OFFSET_MOVED takes it to the
    queue's minimum, past them. Unsaid, a group far behind lost ``first - asked`` messages with nothing to show
    for it (RocketMQ logs its correction at WARN): counted (txmq_pull_offset_moved_messages_total) once, however
    often its consumers ask again before they take the correction, and logged once a minute a queue of a group.
    A first pull lost nothing: it asks at 0 (CONSUME_FROM_FIRST_OFFSET; the others ask where the broker's search
    answered, at or past the minimum) and is moved to where the queue starts now. One past 0 with no offset stored
    here was there before: a broadcasting consumer (its offsets are its host's, never committed) or a pull
    consumer tracking its own; taken as a first pull, each of its moves went uncounted."""
    if asked <= 0 and ctx.offsets.get(group, topic, qid) is None:
        return
    key = f"{group}\0{topic}\0{qid}"
    since = max(0, asked, _moved_to.get(key, 0))
    if first <= since:
        return
    if len(_moved_to) >= _MOVED_KEYS:      # names a client chose: the table must not grow without end
        _moved_to.clear()
    _moved_to[key] = first
    ctx.metrics.child(ctx.metrics.pulls_moved_past, topic, group).inc(first - since)
    if not _moved.due(key):
        return
    now = time.monotonic()
    if now - _moved_lines["since"] >= 60.0:
        _moved_lines.update(since=now, n=0)
    _moved_lines["n"] += 1
    if _moved_lines["n"] <= MOVED_LINES_A_MINUTE:
        log.warning("group %s pulled %s queue %d at offset %d, below the queue's minimum %d: the %d messages "
                    "between were removed by retention before it read them; moved to %d (PULL_OFFSET_MOVED)",
                    group, topic, qid, asked, first, first - since, first)
    elif _moved_lines["n"] == MOVED_LINES_A_MINUTE + 1:
        log.warning("more than %d moves past messages retention removed this minute (new group names each "
                    "pull?): the rest are not logged one by one, only counted in "
                    "txmq_pull_offset_moved_messages_total", MOVED_LINES_A_MINUTE)


def _reply(ctx, cmd, group, topic, got):
    status = got.status
    code = _code(cmd, status)
    next_begin = got.next_begin_offset
    suggest = _suggest(ctx, group, got)
    if ctx.config.broker_role == "SLAVE" and status in _CORRECTIONS:
        # A slave never corrects a consumer's offset (RocketMQ's default offsetCheckInSlave=false): it may only be
        # behind its master. PULL_OFFSET_MOVED became PULL_RETRY_IMMEDIATELY with the offset as asked, pointing
        # at the master; answered as on a master, a consumer that failed over to a lagging slave (or one without
        # the queue yet) moved its committed offset back to the slave's end, or to 0, and consumed again.
        next_begin = cmd.int_field("queueOffset")
        if code == ResponseCode.PULL_OFFSET_MOVED:
            code, suggest = ResponseCode.PULL_RETRY_IMMEDIATELY, 0
    elif status is GetStatus.OFFSET_TOO_SMALL:
        _moved_past_removed(ctx, group, topic, cmd.int_field("queueId"), cmd.int_field("queueOffset"), next_begin)
    fields = {"suggestWhichBrokerId": suggest, "nextBeginOffset": next_begin,
              "minOffset": got.min_offset, "maxOffset": got.max_offset}
    if code == ResponseCode.SUCCESS:
        size = sum(len(b) for b in got.buffers)
        ctx.metrics.count_out(topic, group, len(got.buffers), size)
        return cmd.response(code, status.name, fields, got.buffers)
    if status is GetStatus.QUEUE_DAMAGED:
        return cmd.response(code, f"consume queue {topic}-{cmd.int_field('queueId')} is damaged at offset "
                            f"{got.next_begin_offset} (a zeroed unit, or one naming no record; see the broker's log): "
                            "restart the broker to rebuild it from the commit log", fields)
    if status is GetStatus.RECORD_CORRUPT:
        qid, at = cmd.int_field("queueId"), got.next_begin_offset
        return cmd.response(code, f"the message at offset {at} of {topic}-{qid} is corrupt: its body fails its CRC "
                            "or its topic or properties hold zeros (damaged on the broker's disk; see the broker's log). It is not served; to go on "
                            f"without it: python -m broker admin reset-offset {group} {topic} --queue {qid} "
                            f"--offset {at + 1}", fields)
    return cmd.response(code, status.name, fields)


_unconfigured = EveryKey(60.0)      # topics whose pulls were said answered TOPIC_NOT_EXIST this minute (below)


def _unconfigured_with_messages(ctx, topic: str, qid: int) -> None:
    """A pull answered TOPIC_NOT_EXIST for a queue that holds messages: their topic's config is missing (the
    store makes it again for new messages, topics.queue_appeared, so this is a slave or a bug). Said at ERROR,
    once a minute a topic: consumers are told the topic does not exist while messages wait in it."""
    held = ctx.store.max_offset(topic, qid) - ctx.store.min_offset(topic, qid)
    if held <= 0:       # none, or all removed by retention: nothing waits
        return
    if not _unconfigured.due(topic):
        return
    log.error("pull of %s queue %d answered TOPIC_NOT_EXIST although the queue holds %d messages: the topic "
              "has no config (create it with updateTopic to serve them)", topic, qid, held)


PULLED_GROUPS = 256     # groups a connection's pulls are remembered for (past it its commits are taken for a tool's)


def pulled_for(conn, group: str) -> None:
    """``conn`` pulled for ``group``: a consumer of it, heartbeat or not. A PullConsumer that puts its subscription
    in each pull sends none, and its own commits were taken for an admin tool's moves, each forward one waiting for
    a save of the whole offsets table (100,000 offsets: 1.0-1.5 s) and said at WARNING. Tools never pull for the
    group they move (skipAccumulatedMessage, resetOffsetByTimeOld, cloneGroupOffset's destination)."""
    attributes = getattr(conn, "attributes", None)
    if attributes is None:
        return
    groups = attributes.get("pulled_for")
    if groups is None:
        groups = attributes["pulled_for"] = set()
    if group not in groups and len(groups) < PULLED_GROUPS:
        groups.add(group)


def pulled_groups(conn):
    """The groups ``conn`` pulled for (``pulled_for``)."""
    return getattr(conn, "attributes", {}).get("pulled_for", ())


def handle_pull(ctx, conn, cmd, woken: bool = False):
    """PULL_MESSAGE. ``woken``: run again for a held pull (RocketMQ's executeRequestWhenWakeup): by the
    subscription its group has now, without committing its offset again or being held again."""
    if not ctx.broker_permission & Perm.READ:
        return cmd.response(ResponseCode.NO_PERMISSION, f"the broker[{ctx.broker_addr.rpartition(':')[0]}] "
                                                        "pulling message is forbidden")
    group = cmd.str_field("consumerGroup", required=True)
    topic = cmd.str_field("topic", required=True)
    qid = cmd.int_field("queueId", required=True)
    offset = cmd.int_field("queueOffset", required=True)
    # 0 is not "the default": RocketMQ's getMessage takes the first message and then finds the batch full
    # (isTheBatchFull: maxMsgNums <= messages taken), one message, as the store here does for max_count 0.
    max_nums = cmd.int_field("maxMsgNums", 32)
    sys_flag = cmd.int_field("sysFlag", 0)
    tc = ctx.topics.get(topic)
    if tc is None:
        _unconfigured_with_messages(ctx, topic, qid)
        return cmd.response(ResponseCode.TOPIC_NOT_EXIST, f"topic[{topic}] not exist, apply first please!")
    if not tc.perm & Perm.READ:
        return cmd.response(ResponseCode.NO_PERMISSION, f"the topic[{topic}] pulling message is forbidden")
    if qid < 0 or qid >= tc.read_queue_nums:
        return cmd.response(ResponseCode.SYSTEM_ERROR,
                            f"queueId[{qid}] is illegal, topic:[{topic}] topicConfig.readQueueNums:[{tc.read_queue_nums}]")
    why = validate_group(group, "consumerGroup")    # its commitOffset is kept under it (UPDATE_CONSUMER_OFFSET's)
    if why is not None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, why)
    if sys_flag & PullSysFlag.SUBSCRIPTION:
        sub = build_subscription(topic, cmd.str_field("subscription"), cmd.int_field("subVersion", 0),
                                 cmd.str_field("expressionType") or "TAG")
    else:
        sub = ctx.clients.subscription(group, topic)
        if sub is None:
            return cmd.response(ResponseCode.SUBSCRIPTION_NOT_EXIST,
                                f"the consumer's subscription not exist, group: {group}")
        if sub.sub_version < cmd.int_field("subVersion", 0):   # filtered by older tags, wanted ones were skipped
            return cmd.response(ResponseCode.SUBSCRIPTION_NOT_LATEST, "the consumer's subscription not latest")
        # As RocketMQ, checked where the broker knows the group's model (a pull carrying its subscription
        # is not): a group set to consumeBroadcastEnable=false went on being consumed by broadcast.
        subs = ctx.subscriptions
        if subs is not None and subs.groups and not subs.broadcast_enabled(group) \
                and getattr(ctx.clients.consumers.get(group), "message_model", None) == "BROADCASTING":
            return cmd.response(ResponseCode.NO_PERMISSION,
                                f"the consumer group[{group}] can not consume by broadcast way")
    record_filter = None
    if sub.selector is not None or sub.filter_error is not None:       # not a TAG subscription, or one of no tag
        if sub.selector is None and is_tag_type(sub.expression_type):
            ctx.limits.refused("tag-expression", f"pull of group {group[:200]}, topic {topic[:200]} refused: "
                               f"{sub.filter_error}")
            return cmd.response(ResponseCode.SUBSCRIPTION_PARSE_FAILED,
                                f"parse the consumer's subscription failed: {sub.filter_error}")
        if not ctx.config.enable_property_filter:   # read as a tag no message has, it skipped every message unsaid
            return cmd.response(ResponseCode.SYSTEM_ERROR,
                                f"The broker does not support consumer to filter message by {sub.expression_type}")
        if sub.selector is None:
            # RocketMQ builds no filter from an expression carried by the pull that does not parse, and then
            # gives every message: refused here, as its code means to.
            if sys_flag & PullSysFlag.SUBSCRIPTION:
                return cmd.response(ResponseCode.SUBSCRIPTION_PARSE_FAILED,
                                    f"parse the consumer's subscription failed: {sub.filter_error}")
            return cmd.response(ResponseCode.FILTER_DATA_NOT_EXIST, "The broker's consumer filter data is not "
                                f"exist!Your expression may be wrong! ({sub.filter_error})")
        record_filter = selector_filter(sub.selector, group, topic)
    if not woken:
        pulled_for(conn, group)
    # As RocketMQ: not on a slave, nor again when a held pull is run again.
    if sys_flag & PullSysFlag.COMMIT_OFFSET and ctx.config.broker_role != "SLAVE" and not woken:
        commit = cmd.int_field("commitOffset", -1)
        # (past max_offsets_per_host the pull is answered all the same: only its commit is not kept)
        if (commit is not None and commit >= 0 and group != PROGRESS_GROUP      # (the broker's own: see offsets.py)
                and ctx.limits.may_commit(conn, ctx.offsets, group, topic, qid) is None):
            ctx.offsets.commit(group, topic, qid, commit, peer_host(conn))
            ctx.metrics.group_in_use(group)
    got = ctx.store.get_messages(topic, qid, offset, max_nums, _MAX_BYTES, sub.tag_filter(), record_filter)
    # RocketMQ holds every PULL_NOT_FOUND that may be suspended (a queue never written included).
    if sys_flag & PullSysFlag.SUSPEND and not woken and _code(cmd, got.status) == ResponseCode.PULL_NOT_FOUND:
        suspend_ms = cmd.int_field("suspendTimeoutMillis", 15000) or 0
        hold_ms = min(suspend_ms, ctx.config.max_suspend_ms) if ctx.config.long_polling else ctx.config.short_polling_ms
        if hold_ms > 0:
            return _parked(ctx, conn, cmd, topic, qid, offset, hold_ms)
    return _reply(ctx, cmd, group, topic, got)


# The fields a held pull reads when it runs again (handle_pull with woken, _reply, _code): the numbers, kept as
# read (int() takes a number padded with any whitespace); the names; the last two only by a pull that carries its
# subscription (PullSysFlag.SUBSCRIPTION).
_HELD_NUMBERS = ("queueId", "queueOffset", "maxMsgNums", "sysFlag", "subVersion")
_HELD_NAMES = ("consumerGroup", "topic")
_HELD_SUBSCRIPTION = ("subscription", "expressionType")


def _keep_what_a_held_pull_reads(cmd) -> None:
    """Drop what a pull about to be held will not read again: its body, remark and other fields. A pull is held up
    to max_suspend_ms, a connection may hold max_in_flight * 4 of them, and each kept its whole request: a body
    (none is read; a frame may carry 16 MiB) and a header of made-up fields (256 KiB of them decoded to 2.3 MB).
    500 held pulls of a 1 MiB body each grew the broker by 500 MB, counted nowhere (a held pull's cost, for
    max_parked_pulls_per_host, is some 5.6 KB). A pull filtered by its group's stored subscription (a stock push
    consumer's) never reads its own subscription field: 200 KiB of one, parsed by nothing, was kept too, as were
    numbers padded with 200 KiB of spaces."""
    fields = cmd.ext_fields
    kept = {name: str(cmd.int_field(name)) for name in _HELD_NUMBERS if fields.get(name) not in (None, "")}
    names = _HELD_NAMES + _HELD_SUBSCRIPTION if cmd.int_field("sysFlag", 0) & PullSysFlag.SUBSCRIPTION else _HELD_NAMES
    kept.update((name, fields[name]) for name in names if name in fields)
    cmd.ext_fields = kept
    cmd.body = b""
    cmd.remark = None


async def _parked(ctx, conn, cmd, topic, qid, offset, hold_ms):
    if conn is not None and not conn.is_open:      # closed before this task ran: nobody to answer
        return None
    # Read again as the wait registers (no await in between): a message stored since the first
    # read, before this task ran, was dispatched to no waiter and would not wake this one.
    resp = handle_pull(ctx, conn, cmd, woken=True)
    if resp.code != ResponseCode.PULL_NOT_FOUND:
        return resp
    if not ctx.holds.room(conn):
        # Not PULL_NOT_FOUND, which a stock push consumer answers with the next pull at once (a busy loop):
        # an error code makes it pull again after 3 s (pullTimeDelayMillsWhenException). Nothing is skipped.
        why = (f"pull not held: the connections from {peer_host(conn)} hold {ctx.holds.max_per_host} parked pulls, "
               f"the limit (max_parked_pulls_per_host); pull again later")
        ctx.limits.refused("parked-pull-limit", why)
        return cmd.response(ResponseCode.SYSTEM_BUSY, why)
    _keep_what_a_held_pull_reads(cmd)
    parked = conn is not None and conn.park()      # not counted in flight while it waits
    try:
        await ctx.holds.wait(topic, qid, offset, hold_ms / 1000, conn)   # cancelled if conn closes
    finally:
        if parked:
            conn.unpark()
    # Run again rather than read with the filter it was parked with: a heartbeat that changed the group's
    # expression meanwhile (a push consumer subscribing again) is obeyed, as in RocketMQ, where the old one
    # delivered messages the consumer no longer wants (its client filters tags again, never SQL92).
    return handle_pull(ctx, conn, cmd, woken=True)
