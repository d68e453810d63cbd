"""SEND_MESSAGE (10), SEND_MESSAGE_V2 (310), SEND_BATCH_MESSAGE (320), CONSUMER_SEND_MSG_BACK (36).

Checks and their answers follow RocketMQ's SendMessageProcessor (spec 3.4): a
bad topic name is SYSTEM_ERROR, a system topic NO_PERMISSION, an unknown topic
is created from its template or TOPIC_NOT_EXIST, an oversized body
MESSAGE_ILLEGAL. A message whose TRAN_MSG is true becomes a half message.
"""
from __future__ import annotations

import errno
from asyncio import ensure_future, get_running_loop
from inspect import isawaitable
import logging
import random
import resource
from functools import partial
from time import perf_counter

from protocol.codes import Perm, ResponseCode, SysFlag
from protocol.connection import DEFERRED
from protocol.txlog import HALF_TOPIC, OP_TOPIC
from protocol.message import (
    TIMER_PROPS,
    Prop,
    SendMessageRequestHeader,
    batch_entries_past,
    decode_batch,
    decode_record,
    drop_property,
    encode_batch_records,
    encode_record,
    java_string_hash,
    nul_in_properties,
    offset_msg_id,
    pack_host,
    properties_appender,
    properties_to_string,
    property_value,
    separator_in,
    string_to_properties,
    tags_code,
    validate_group,
    validate_topic,
)

from ..answer import Answer
from ..limits import EveryKey, peer_host
from ..results import put_failure_response, send_ok
from ..schedule.levels import java_int, timer_waits
from ..store import PutRequest
from ..subscriptions import retry_queues
from ..topics import (DLQ_PREFIX, NO_SEND_TOPICS, RETRY_PREFIX, SCHEDULE_PROGRESS_TOPIC, SCHEDULE_TOPIC,
                      SYSTEM_TOPIC_PREFIX, TIMER_TOPIC, TopicConfig, TopicLimitError)
from .admin import stored_record

log = logging.getLogger("txmq.send")

_rand = random.Random()
_MAX_RECONSUME_TIMES = (1 << 31) - 1     # the record's RECONSUMETIMES is a Java int
_V3_4_9 = 121                             # MQVersion.Version.V3_4_9.ordinal(): requests may carry maxReconsumeTimes


def _retry_limit(ctx, cmd, group: str, from_request: int | None) -> int:
    """How many retries ``group`` gets, as RocketMQ decides it: the request's maxReconsumeTimes from a client
    of V3_4_9 or later, else the group's retryMaxTimes (UPDATE_AND_CREATE_SUBSCRIPTIONGROUP), else the broker's
    default. Clients that send none (rocketmq-client-cpp before 2.0 among them) follow the group's config."""
    if from_request is not None and cmd.version >= _V3_4_9:
        return from_request
    subs = ctx.subscriptions
    configured = subs.retry_max_times(group) if subs is not None else None
    return ctx.config.max_reconsume_times if configured is None else configured


def _born_host(conn) -> bytes:
    host = conn.attributes.get("born_host")
    if host is None:
        host = conn.attributes["born_host"] = pack_host(*conn.peer) if conn.peer[0] else pack_host("127.0.0.1", 0)
    return host


def _check_topic(ctx, conn, cmd, h: SendMessageRequestHeader):
    """(topic config, queue id) or an error response."""
    tc = ctx.topics.topics.get(h.topic)
    if tc is None or h.topic in NO_SEND_TOPICS:      # known topics were validated when they were made
        why = validate_topic(h.topic)
        if why is not None:
            return cmd.response(ResponseCode.SYSTEM_ERROR, why)
        if h.topic in NO_SEND_TOPICS:
            return cmd.response(ResponseCode.NO_PERMISSION, f"sending message to topic[{h.topic}] is forbidden")
        if tc is None and h.topic.startswith(SYSTEM_TOPIC_PREFIX):
            # Made by a send, it could never be deleted (DELETE_TOPIC_IN_BROKER refuses system topics, as
            # RocketMQ's does): a client planting such names held places of max_topics for good.
            return cmd.response(ResponseCode.NO_PERMISSION, f"topic[{h.topic}] not created: names starting with "
                                f"{SYSTEM_TOPIC_PREFIX} are the broker's system topics")
        tc = ctx.topics.auto_config(h.topic, h.default_topic, h.default_topic_queue_nums)
        if tc is None:
            return cmd.response(ResponseCode.TOPIC_NOT_EXIST,
                                f"topic[{h.topic}] not exist, apply first please!")
        if h.topic.startswith(RETRY_PREFIX):
            # as its heartbeat or send-back makes it, and as its route said before it was made (get_route_info):
            # made with one queue, a stock consumer's fallback send to a queue of that route was refused "illegal"
            queues = retry_queues(ctx.subscriptions, h.topic[len(RETRY_PREFIX):])
            tc = TopicConfig(h.topic, queues, queues)
        refused = ctx.limits.may_auto_create(conn, cmd, ctx.topics, h.topic, tc.queue_count)
        if refused is not None:
            return refused
        try:
            tc = ctx.topics.create(tc, peer_host(conn))
        except TopicLimitError as exc:
            ctx.limits.refused("retry-group-limit")
            return cmd.response(ResponseCode.NO_PERMISSION, str(exc))
    if not tc.perm & Perm.WRITE:
        return cmd.response(ResponseCode.NO_PERMISSION, f"the topic[{h.topic}] sending message is forbidden")
    qid = h.queue_id
    if qid < 0:
        qid = _rand.randrange(tc.write_queue_nums)
    elif qid >= tc.queue_count:
        return cmd.response(ResponseCode.SYSTEM_ERROR,
                            f"request queueId[{qid}] is illegal, topic {h.topic} has {tc.queue_count} queues")
    return tc, qid


def _queue_file(ctx, cmd, topic: str, qid: int):
    """None once the consume queue a send goes to has its file, or the refusal saying why it cannot (RocketMQ's
    CREATE_MAPEDFILE_FAILED remark, and the error): past the open-files limit or vm.max_map_count, each send to a
    new queue is refused, the broker serving every queue there is."""
    try:
        ctx.store.prepare_queue(topic, qid)
    except OSError as exc:
        return _queue_file_refused(ctx, cmd, topic, qid, exc)
    return None


async def _made_meanwhile(ctx, topic: str, qid: int) -> None:
    """Wait while the queue-file thread makes this queue's first file (a send to it came first): prepare_queue
    meanwhile says EAGAIN "try again", which a send-back or a reply answered as a queue file that cannot be made.
    What stops the file is left to prepare_queue to say."""
    if ctx.store.making_queue_file(topic, qid):
        try:
            await ctx.store.queue_file(topic, qid)
        except OSError:
            pass


def _after_queue_file(ctx, cmd, topic: str, qid: int, go):
    """A send to a new queue: a future of its answer, ``go()``'s once the queue's file is made off the event loop
    (store.make_queue_file; made here, one client's burst of new queues stalled every other connection), or the
    refusal saying why it cannot be (as ``_queue_file``). ``go`` runs as soon as the file is there, in the order
    the sends came: records are put in the order they were sent."""
    out = get_running_loop().create_future()

    def ready(exc):
        if isinstance(exc, OSError):
            _settle(out, _queue_file_refused(ctx, cmd, topic, qid, exc))
        elif exc is not None:       # the store is closing
            if not out.done():
                out.set_exception(exc)
        else:
            _go(out, go)

    ctx.store.make_queue_file(topic, qid, ready)
    return out


def _after_durable(ctx, topic: str, go):
    """None when ``topic`` needs no wait; else a future of ``go()``'s answer, run once topics.json holds the topic
    (TopicManager.when_durable): sends waiting for one topic run in the order they came, before any later one."""
    out = get_running_loop().create_future()
    if not ctx.topics.when_durable(topic, partial(_go, out, go)):
        return None
    return out


def _go(out, go) -> None:
    """Run ``go`` and settle ``out`` with its answer (None: it answers by itself, DEFERRED)."""
    try:
        answer = go()
    except Exception as exc:  # noqa: BLE001 - this request's error reply
        if not out.done():
            out.set_exception(exc)
        return
    if isawaitable(answer):
        ensure_future(answer).add_done_callback(partial(_chain, out))
    else:
        _settle(out, None if answer is DEFERRED else answer)


def _settle(out, answer) -> None:
    if not out.done():      # (cancelled: its connection went)
        out.set_result(answer)


def _chain(out, answered) -> None:
    if out.done():
        return
    if answered.cancelled():
        out.cancel()
    elif answered.exception() is not None:
        out.set_exception(answered.exception())
    else:
        out.set_result(answered.result())


def _queue_file_refused(ctx, cmd, topic: str, qid: int, exc: OSError):
    """The refusal of a send whose new queue's file cannot be made: RocketMQ's CREATE_MAPEDFILE_FAILED remark,
    with what to raise."""
    if exc.errno == errno.ENOSPC and ctx.store.disk.probe():
        # the disk (its blocks, or its inodes: a new file takes one) filled since the last probe: refused as the
        # guard refuses every write from now on, not as a broken broker
        return cmd.response(ResponseCode.SERVICE_NOT_AVAILABLE,
                            ctx.store.disk.refuse(f"consume queue {topic}-{qid}: no space for its file"))
    if ctx.store.stopped_by(exc):
        # the store stopped, or is about to (its file system turned read-only): as every write is refused, not
        # as a broken broker (SYSTEM_ERROR, counted queue-file-failed as if past the open-files limit)
        return cmd.response(ResponseCode.SERVICE_NOT_AVAILABLE,
                            ctx.store.refusal(f"consume queue {topic}-{qid}: {exc}"))
    why = f"create mapped file failed, server is busy or broken: consume queue {topic}-{qid}: {exc}"
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        why += (f" (this process may open {soft} files, two a queue file: raise ulimit -n, or lower "
                f"--max-queues={ctx.config.max_queues})")
    elif exc.errno == errno.ENOMEM:
        why += f" (a mapping a queue file: raise vm.max_map_count, or lower --max-queues={ctx.config.max_queues})"
    ctx.limits.refused("queue-file-failed", why)
    return cmd.response(ResponseCode.SYSTEM_ERROR, why)


# Transaction types the store gives no consume-queue unit: a record of them is only ever a half's business.
_NO_UNIT_TYPES = (SysFlag.TRANSACTION_PREPARED, SysFlag.TRANSACTION_ROLLBACK)


def handle_send(ctx, conn, cmd):
    h = SendMessageRequestHeader.from_command(cmd)
    if h.batch:             # rocketmq-client-cpp sends batches as SEND_MESSAGE with batch=true (`m` in V2)
        return handle_batch(ctx, conn, cmd, h)
    checked = _check_topic(ctx, conn, cmd, h)
    if not isinstance(checked, tuple):
        return checked
    if h.topic in ctx.topics.unsaved:   # a topic made moments ago: stored once it is written (made_durable)
        waits = _after_durable(ctx, h.topic, partial(handle_send, ctx, conn, cmd))
        if waits is not None:
            return waits
    _, qid = checked
    body = cmd.body
    if len(body) > ctx.config.max_message_size:
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL,
                            f"the message body size {len(body)} is over the maximum {ctx.config.max_message_size}")
    illegal = nul_in_properties(h.properties)
    if illegal is not None:
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, illegal)
    busy = ctx.limits.busy(cmd, len(body))
    if busy is not None:
        return busy
    props = string_to_properties(h.properties)
    topic = h.topic
    reconsume = h.reconsume_times
    # RocketMQ's "client under version 4.6.1" exception: a retry that asks for a delay is a consumer's fallback
    # send of a transactional message it failed, carrying the message's TRAN_MSG=true, never a new half. Judged
    # by the delay sent: the one a dead letter's DELAY=0 below replaces made such a retry, out of retries, a half
    # for %RETRY%<group> (refused as another group's, or checked with a producer that never began it).
    half = props.get(Prop.TRAN_MSG, "").lower() == "true" and not (reconsume > 0 and props.get(Prop.DELAY, "0") != "0")
    if topic.startswith(RETRY_PREFIX):
        if reconsume >= _retry_limit(ctx, cmd, topic[len(RETRY_PREFIX):], h.max_reconsume_times):
            topic = DLQ_PREFIX + topic[len(RETRY_PREFIX):]
            refused = _ensure_back_topic(ctx, conn, cmd, topic)     # made as send-back makes it
            if refused is not None:
                return refused
            qid = 0
            props[Prop.DELAY] = "0"
    props[Prop.CLUSTER] = ctx.config.cluster_name
    if Prop.REPLY_TO_CLIENT in props:       # a request (request-reply): its reply goes back to this connection
        ctx.clients.requested(conn, props)
    if half:
        if Prop.DELAY in props or any(k in props for k in TIMER_PROPS):
            # A half waits only once committed, where a refused delay could only mean "deliver now": judge it
            # here, as a plain send's (on a copy: the half keeps its properties as sent).
            illegal = ctx.schedule.levels.divert(topic, qid, dict(props), SysFlag.TRANSACTION_COMMIT, ctx.clock())
            if isinstance(illegal, str):
                return cmd.response(ResponseCode.MESSAGE_ILLEGAL, illegal)
        group = props.get(Prop.PGROUP) or h.producer_group
        why = validate_group(group, "producerGroup")    # the half's sender joins it, and it is kept with the half
        if why is not None:
            return cmd.response(ResponseCode.MESSAGE_ILLEGAL, why)
        if Prop.PGROUP not in props and separator_in(group):
            # It becomes the half's PGROUP: with a \x02 it was stored as more properties than the broker wrote,
            # and recovery re-read another group and another REAL_TOPIC (a commit then wrote there).
            return cmd.response(ResponseCode.MESSAGE_ILLEGAL, f"producerGroup {group!r} holds a properties "
                                "separator (\\x01 or \\x02) or a NUL: it cannot be stored as the half's PGROUP")
        if group != h.producer_group:
            # The half is kept, checked and limited as PGROUP's: sent by another group it was charged to that
            # group's max_undecided_per_group (one group's flood refused another's halves), its checks went to
            # producers that never began it, and its sender could not decide it. Stock clients set both alike.
            # (said at most every 10 s: a line each was any client's to repeat, one a message)
            ctx.limits.refused("producer-group-mismatch", f"half message from {conn.peer[0]}:{conn.peer[1]} refused: "
                               f"producerGroup {h.producer_group[:200]!r}, PGROUP {group[:200]!r}")
            return cmd.response(ResponseCode.MESSAGE_ILLEGAL,
                                f"transaction message claims producer group {group} (PGROUP) but is sent by "
                                f"producer group {h.producer_group}: they must be the same")
        refused = ctx.limits.may_prepare(cmd, ctx.tx, group)
        if refused is None and (HALF_TOPIC, 0) not in ctx.store.queue_index:
            # the store's first half makes the half queue: its file first, as a send's (else acknowledged, its
            # unit waiting in memory, the half unseen by a restart's pending index until a descriptor came free)
            refused = _queue_file(ctx, cmd, HALF_TOPIC, 0)
        if refused is not None:
            return refused
        # (to ``topic``: out of retries, %DLQ%<group> -- RocketMQ rewrites the topic before it makes the half)
        return ctx.tx.prepare(conn, cmd, h, qid, props, _born_host(conn), topic)
    sys_flag = h.sys_flag
    if SysFlag.transaction_type(sys_flag) != SysFlag.TRANSACTION_NOT_TYPE:
        retry = props.get(Prop.TRAN_MSG, "").lower() == "true"
        why = "a retry asking for a delay is none, whatever its TRAN_MSG" if retry else "TRAN_MSG is not true"
        refused = plain_type_refused(ctx, cmd, sys_flag, retry, why)
        if refused is not None:
            return refused
        # The retry above (a client before 4.6.1 types it PREPARED, as it sends TRAN_MSG=true): a plain message,
        # stored so. Kept PREPARED it skipped its delay and got no unit: acknowledged, and lost.
        sys_flag = SysFlag.with_transaction_type(sys_flag, SysFlag.TRANSACTION_NOT_TYPE)
    if Prop.TRAN_MSG in props and h.topic.startswith(RETRY_PREFIX):    # (one dict look-up a plain send)
        # No half gets here: a retry (or its dead letter) is a plain message, as a send-back's copy. A client
        # before 4.6.1 resends the failed message with its TRAN_MSG=true (4.6.1+ clear it): kept, a redrive of
        # the retry or dead letter with its properties through a stock producer (typed PREPARED) became a half.
        props.pop(Prop.TRAN_MSG, None)
    waits_for_slave = props.pop(Prop.WAIT, "true").lower() != "false"     # isWaitStoreMsgOK
    to_topic, to_qid, tags, delay_ms = topic, qid, None, -1
    waits = ctx.schedule.levels.divert(topic, qid, props, sys_flag, ctx.clock())   # DELAY, TIMER_*
    if isinstance(waits, str):
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, waits)
    if waits is not None:
        to_topic, to_qid, delay_ms, tags = waits
    if (to_topic, to_qid) not in ctx.store.queue_index:     # a new queue: its file first
        return _after_queue_file(ctx, cmd, to_topic, to_qid, partial(
            _put, ctx, conn, cmd, h, body, props, reconsume, sys_flag, topic, qid, to_topic, to_qid, tags, delay_ms,
            waits_for_slave))
    return _put(ctx, conn, cmd, h, body, props, reconsume, sys_flag, topic, qid, to_topic, to_qid, tags, delay_ms,
                waits_for_slave)


def _put(ctx, conn, cmd, h, body, props, reconsume, sys_flag, topic, qid, to_topic, to_qid, tags, delay_ms,
         waits_for_slave):
    """A plain send's record to the store, answered when it is stored."""
    record = encode_record(
        topic=to_topic.encode(), body=body, queue_id=to_qid, flag=h.flag, sys_flag=sys_flag,
        born_timestamp=h.born_timestamp, born_host=_born_host(conn), store_host=ctx.store_host,
        properties=properties_to_string(props).encode(), reconsume_times=reconsume)
    req = PutRequest(record, to_topic, to_qid, tags_code(props) if tags is None else tags, sys_flag, delay_ms)
    if ctx.ha is not None and ctx.ha.sync and waits_for_slave:      # SYNC_MASTER: the answer waits for the slave
        return reply_when_stored(ctx, cmd, ctx.limits.track(ctx.store.put(req), len(body)), qid, topic, len(body),
                                 waits_for_slave)
    ctx.limits.queued_bytes += len(body)
    ctx.store.put(req, then=Answer(ctx, conn, cmd, partial(_stored, ctx, cmd, qid, topic, len(body), perf_counter())))
    return DEFERRED


def plain_type_refused(ctx, cmd, sys_flag: int, retry_of_transactional: bool = False,
                       why_not_half: str = "TRAN_MSG is not true"):
    """The refusal of a message stored as it came (no half) whose sysFlag names a transaction type, or None for
    the old clients' retry (``retry_of_transactional``: typed PREPARED), which the caller stores as a plain one.

    PREPARED and ROLLBACK records get no consume-queue unit (as in RocketMQ): answered SEND_OK with queue offset
    -1, no consumer could ever read one. COMMIT is the type of a committed transaction's message, and its
    prepared offset (0 for a send) names the half it commits: after a crash, start-up took a COMMIT-typed send
    repeating that half's UNIQ_KEY and body for its commit and wrote the decision. No stock client sends them.
    ``why_not_half`` says why this message is none, in the answer: a retry's or a reply's TRAN_MSG may be true."""
    tx_type = SysFlag.transaction_type(sys_flag)
    if tx_type in _NO_UNIT_TYPES and retry_of_transactional:
        return None
    ctx.limits.refused("transaction-type-without-half")
    name = {SysFlag.TRANSACTION_PREPARED: "PREPARED", SysFlag.TRANSACTION_COMMIT: "COMMIT"}.get(tx_type, "ROLLBACK")
    return cmd.response(ResponseCode.MESSAGE_ILLEGAL, f"sysFlag {sys_flag} says transaction type {name} but the "
                        f"message is not a half ({why_not_half}): only the broker stores transaction-typed records")


def _stored(ctx, cmd, qid, topic, body_len, started, result):
    """The reply to a plain send once the store is done with it (called by the writer, through Answer)."""
    ctx.limits.queued_bytes -= body_len
    if not result.ok:
        return put_failure_response(cmd, result)
    metrics = ctx.metrics
    metrics.count_in(topic, 1, body_len)
    metrics.append_latency.observe(perf_counter() - started)
    return send_ok(ctx, cmd, offset_msg_id(ctx.store_host, result.physical_offset), qid, result.queue_offset)


def reply_when_stored(ctx, cmd, put, qid, topic, body_len, waits_for_slave=True):
    """A future of the send response, chained on the store's put future (no coroutine, no Task)."""
    out = put.get_loop().create_future()
    started = perf_counter()

    def settle(make, *args):
        # These run as loop callbacks: an exception from building the reply would only be logged, and ``out``
        # (the request, counted in flight by its connection) would never complete -- the client waiting for
        # its own timeout, the in-flight count never released. Hand it to ``out``: the connection answers
        # SYSTEM_ERROR, as for any handler's exception.
        try:
            make(*args)
        except Exception as exc:  # noqa: BLE001 - becomes this request's error reply
            if not out.done():
                out.set_exception(exc)

    def stored(f):
        if f.cancelled():
            out.cancel()
            return
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        result = f.result()
        if not result.ok:
            out.set_result(put_failure_response(cmd, result))
            return
        ctx.metrics.count_in(topic, 1, body_len)
        ctx.metrics.append_latency.observe(perf_counter() - started)
        msg_id = offset_msg_id(ctx.store_host, result.physical_offset)
        ha = ctx.ha
        if ha is None or not ha.sync or not waits_for_slave:
            out.set_result(send_ok(ctx, cmd, msg_id, qid, result.queue_offset))
            return
        verdict = ha.confirm(result.physical_offset + result.size)      # SYNC_MASTER: the slave must have it
        if isinstance(verdict, int):
            out.set_result(send_ok(ctx, cmd, msg_id, qid, result.queue_offset, verdict))
        else:
            verdict.add_done_callback(lambda v: settle(confirmed, msg_id, result, v))

    def confirmed(msg_id, result, v):
        if not out.done():
            out.set_result(send_ok(ctx, cmd, msg_id, qid, result.queue_offset, v.result()))

    put.add_done_callback(lambda f: settle(stored, f))
    return out


# Batch-level properties an entry never inherits: WAIT is the producer's affair, and the batch's own UNIQ_KEY
# would give every message of the batch the same id.
_NOT_INHERITED = (Prop.WAIT, Prop.UNIQ_KEY)


def handle_batch(ctx, conn, cmd, h: SendMessageRequestHeader | None = None):
    """SEND_BATCH_MESSAGE, or a SEND_MESSAGE(_V2) whose header says batch: one record per entry.

    Each entry keeps its own properties (UNIQ_KEY, KEYS, TAGS) byte for byte; the batch header's properties
    and CLUSTER are appended only where the entry does not name them. A batch may not be transactional or
    delayed, in the header or in any entry: RocketMQ's store refuses both (MESSAGE_ILLEGAL), and storing them
    as plain messages would deliver at once what the producer meant to hold back.
    """
    if h is None:
        h = SendMessageRequestHeader.from_command(cmd)
    if h.topic.startswith(RETRY_PREFIX):
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, "batch message does not support retry group")
    checked = _check_topic(ctx, conn, cmd, h)
    if not isinstance(checked, tuple):
        return checked
    if h.topic in ctx.topics.unsaved:   # as handle_send's
        waits = _after_durable(ctx, h.topic, partial(handle_batch, ctx, conn, cmd, h))
        if waits is not None:
            return waits
    _, qid = checked
    if len(cmd.body) > ctx.config.max_message_size:
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL,
                            f"the batch body size {len(cmd.body)} is over the maximum {ctx.config.max_message_size}")
    if SysFlag.transaction_type(h.sys_flag) != SysFlag.TRANSACTION_NOT_TYPE:
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, "batch messages cannot be transactional")
    cap = ctx.config.batch_messages_cap
    if batch_entries_past(cmd.body, cap):      # stored as one unit on the loop: more held every other client
        why = f"the batch holds more than {cap} messages (max_batch_messages): split it, nothing was stored"
        ctx.limits.refused("batch-messages", f"SEND_BATCH_MESSAGE to {h.topic} from {peer_host(conn)} refused: {why}")
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, why)
    illegal = nul_in_properties(h.properties)
    if illegal is not None:
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, illegal)
    busy = ctx.limits.busy(cmd, len(cmd.body))
    if busy is not None:
        return busy
    if (h.topic, qid) not in ctx.store.queue_index:     # a new queue: its file first
        return _after_queue_file(ctx, cmd, h.topic, qid, partial(_put_batch, ctx, conn, cmd, h, qid))
    return _put_batch(ctx, conn, cmd, h, qid)


def _put_batch(ctx, conn, cmd, h, qid):
    """A batch's records to the store, answered when they are stored (or the refusal of an entry)."""
    batch_props = string_to_properties(h.properties)
    refused = _held_back(batch_props.get(Prop.DELAY), batch_props.get(Prop.TRAN_MSG), "the batch",
                         timer_waits(batch_props.get, ctx.clock()))
    for name in _NOT_INHERITED:
        batch_props.pop(name, None)
    batch_props[Prop.CLUSTER] = ctx.config.cluster_name
    born = _born_host(conn)
    topic_b = h.topic.encode()
    store_host = ctx.store_host
    fast = None if refused is not None else encode_batch_records(
        cmd.body, topic=topic_b, queue_id=qid, sys_flag=h.sys_flag, born_timestamp=h.born_timestamp,
        born_host=born, store_host=store_host, extra=batch_props)
    if fast is not None:        # the usual batch: records packed in one pass, properties copied as they came
        reqs = _batch_requests(fast, h.topic, qid, h.sys_flag)
        body_bytes = fast[3]
    else:
        reqs = _batch_requests_slow(ctx, cmd, h, qid, refused, batch_props, born, topic_b, store_host)
        if reqs.__class__ is not list:
            return reqs
        body_bytes = reqs.pop()
    if ctx.ha is not None and ctx.ha.sync:      # SYNC_MASTER: the answer waits for the slave
        return _store_batch(ctx, cmd, reqs, qid, h.topic, body_bytes)
    ctx.limits.queued_bytes += body_bytes
    ctx.store.put_many(reqs, then=Answer(ctx, conn, cmd, partial(_batch_stored, ctx, cmd, qid, h.topic, body_bytes)))
    return DEFERRED


def _batch_requests(fast, topic: str, qid: int, sys_flag: int) -> list:
    """PutRequests over the records of encode_batch_records: each record a view of the one buffer."""
    out, sizes, tags, _ = fast
    view = memoryview(out)
    reqs = []
    append = reqs.append
    at = 0
    for size, tag in zip(sizes, tags):
        append(PutRequest(view[at:at + size], topic, qid, tag, sys_flag))
        at += size
    return reqs


def _batch_requests_slow(ctx, cmd, h, qid, refused, batch_props, born, topic_b, store_host):
    """The general path: a list of PutRequests followed by the body bytes, or an error response."""
    entries = decode_batch(cmd.body)
    if not entries:
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, "the batch is empty")
    if refused is not None:
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, refused)
    append_batch_props = properties_appender(batch_props)
    now = ctx.clock()
    reqs = []
    body_bytes = 0
    for i, (flag, body, text) in enumerate(entries):
        if "\x00" in text:
            return cmd.response(ResponseCode.MESSAGE_ILLEGAL, f"message {i} of the batch not stored: "
                                f"{nul_in_properties(text)}")
        if "DELAY\x01" in text or "TRAN_MSG\x01" in text or "TIMER_" in text or _START_DELIVER_MARK in text:
            refused = _held_back(property_value(text, Prop.DELAY), property_value(text, Prop.TRAN_MSG),
                                 f"message {i} of the batch", timer_waits(partial(property_value, text), now))
            if refused is not None:
                return cmd.response(ResponseCode.MESSAGE_ILLEGAL, refused)
        if "WAIT\x01" in text:
            text = drop_property(text, Prop.WAIT)
        text = append_batch_props(text)
        record = encode_record(topic=topic_b, body=body, queue_id=qid, flag=flag, sys_flag=h.sys_flag,
                               born_timestamp=h.born_timestamp, born_host=born, store_host=store_host,
                               properties=text.encode())
        tags = property_value(text, Prop.TAGS)
        reqs.append(PutRequest(record, h.topic, qid, java_string_hash(tags) if tags else 0, h.sys_flag))
        body_bytes += len(body)
    reqs.append(body_bytes)
    return reqs


_START_DELIVER_MARK = Prop.START_DELIVER_TIME + "\x01"     # a timer of TIMER_PROPS that names no TIMER_


def _held_back(delay: str | None, tran: str | None, what: str, timer: str | None = None) -> str | None:
    """Why a batch (entry) may not be stored as it is, or None."""
    if tran is not None and tran.lower() == "true":
        return f"{what} is transactional: batch messages cannot be transactional"
    if delay:       # an empty value is no property (string_to_properties, as Java's string2messageProperties)
        # As a single send's DELAY (levels.divert): one Integer.parseInt refuses is refused, a level of 0 or below
        # stored (RocketMQ's batch takes it; a batch with DELAY=-1 was refused).
        level = java_int(delay, 32)
        if isinstance(level, str):
            return f"{what} has DELAY={delay!r}, which {level}"
        if level > 0:
            return f"{what} has delay level {delay}: batch messages cannot be delayed"
    if timer is not None:
        why = java_int(timer, 64)
        if isinstance(why, str):
            return f"{what} has a delivery time {timer!r}, which {why}"
        return f"{what} asks for a delivery time ({timer}): batch messages cannot be delayed"
    return None


async def _store_batch(ctx, cmd, reqs, qid, topic, body_bytes):
    """A batch on a SYNC_MASTER: stored, then confirmed by the slave."""
    results = await ctx.limits.track(ctx.store.put_many(reqs), body_bytes)
    refused = _batch_refused(ctx, cmd, topic, body_bytes, results)
    if refused is not None:
        return refused
    code = await ctx.ha.confirm_async(results[-1].physical_offset + results[-1].size)
    return _batch_ok(ctx, cmd, qid, results, code)


def _batch_stored(ctx, cmd, qid, topic, body_bytes, results):
    """The reply to a batch once the store is done with it (called by the writer, through Answer)."""
    ctx.limits.queued_bytes -= body_bytes
    return _batch_refused(ctx, cmd, topic, body_bytes, results) or _batch_ok(ctx, cmd, qid, results)


def _batch_refused(ctx, cmd, topic, body_bytes, results):
    """The refusal of a batch the store did not take (all or none), else None once counted."""
    for result in results:
        if not result.ok:
            return put_failure_response(cmd, result)
    ctx.metrics.count_in(topic, len(results), body_bytes)
    return None


def _batch_ok(ctx, cmd, qid, results, code=ResponseCode.SUCCESS):
    host = ctx.store_host
    return send_ok(ctx, cmd, ",".join([offset_msg_id(host, r.physical_offset) for r in results]), qid,
                   results[0].queue_offset, code)


def _ensure_back_topic(ctx, conn, cmd, topic: str, queues: int = 1):
    """None once ``topic`` (%RETRY% or %DLQ% and the group the client names) exists, or the refusal: a new one
    is checked and limited as any topic a send creates, or one client naming group after group filled the
    catalogue (every other client's new topic then refused) with names the store cannot write."""
    if topic in ctx.topics.topics:
        # One made with fewer queues (before the group's retryQueueNums was raised, or by a version that ignored
        # it) grows to them, within the queue limits; past them (counted, logged) it is retried in those it has.
        if ctx.limits.queue_room(ctx.topics, topic, queues, peer_host(conn), "grown") is None:
            ctx.topics.grow(topic, queues, peer_host(conn))
        return None
    why = validate_topic(topic)
    if why is not None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, why)
    refused = ctx.limits.may_auto_create(conn, cmd, ctx.topics, topic, queues)
    if refused is not None:
        return refused
    try:
        ctx.topics.ensure(topic, queues, creator=peer_host(conn))
    except TopicLimitError as exc:
        ctx.limits.refused("retry-group-limit")
        return cmd.response(ResponseCode.NO_PERMISSION, str(exc))
    return None


_BACK_TOPIC_TRIES = 3     # a send-back's topic made again after a DELETE_TOPIC while it waited: at most so often


async def _back_topic_written(ctx, conn, cmd, topic: str, queues: int):
    """The config of a send-back's ``topic`` once it exists and is in topics.json, or the refusal.

    A topic the send-back just made (or grew, or a heartbeat did) is in topics.json before the copy is stored, as
    RocketMQ's createTopicInSendMessageBackMethod persists it: a retry waits in SCHEDULE_TOPIC_XXXX, so no queue of
    its topic is on disk for start-up to restore it from, and a kill -9 within the batched write's 100 ms left the
    group's consumers without the topic (TOPIC_NOT_EXIST) until the retry was delivered, or (grown) with fewer
    queues than the one the retry went to. Deleted (DELETE_TOPIC_IN_BROKER) during that wait, it is made again,
    as a send-back that came just after the delete makes it (and RocketMQ's, which does not wait, stores the retry
    and has its delivery make it): each such send-back was answered SYSTEM_ERROR "KeyError" and logged as a bug."""
    for _ in range(_BACK_TOPIC_TRIES):
        refused = _ensure_back_topic(ctx, conn, cmd, topic, queues)
        if refused is not None:
            return refused
        made = ctx.topics.made_durable(topic)
        if made is not None:
            await made
        tc = ctx.topics.topics.get(topic)
        if tc is not None:
            return tc
        log.warning("topic %s was deleted while a send-back from %s:%s waited for it to be written: made again",
                    topic, *conn.peer)
    # (deleted at every try: RocketMQ's answer when createTopicInSendMessageBackMethod gives no topic)
    return cmd.response(ResponseCode.SYSTEM_ERROR, f"topic[{topic}] not exist: deleted while this send-back "
                        f"waited for it, {_BACK_TOPIC_TRIES} times")


# Records no consumer is given, which a send-back must not copy to one: halves (undecided), their op records,
# messages waiting for their delay or timer, and the scheduler's progress.
_NOT_HANDED_BACK = frozenset({HALF_TOPIC, OP_TOPIC, SCHEDULE_TOPIC, TIMER_TOPIC, SCHEDULE_PROGRESS_TOPIC})
_not_retried = EveryKey(60.0)       # consumer groups whose dropped send-backs were said this minute


def _said_not_retried(group: str, offset: int) -> None:
    """Said at INFO, once a minute a group: a message handed back and dropped on purpose."""
    if not _not_retried.due(group):
        return
    log.info("consumer group %s has retryQueueNums 0: the failed message at commit-log offset %d (and any more "
             "in the next minute) is not retried nor dead-lettered, as RocketMQ does", group, offset)


def _past_java_int(cmd, *keys):
    """SYSTEM_ERROR naming the first of ``keys`` (Integer fields of the request's header) past Java's int range, as
    RocketMQ's header decode throws for it, or None."""
    for key in keys:
        value = cmd.int_field(key)
        if value is not None and not -(1 << 31) <= value <= _MAX_RECONSUME_TIMES:
            return cmd.response(ResponseCode.SYSTEM_ERROR, f"the header field {key}={cmd.ext_fields[key]!r} is "
                                "past Java's int range")
    return None


async def handle_send_back(ctx, conn, cmd):
    """A consumer failed a message: copy it to %RETRY%<group>, or %DLQ%<group> when out of retries."""
    # ConsumerSendMsgBackRequestHeader's Integers. Taken, a maxReconsumeTimes of 2^31 was never reached (the count
    # stops at the int's maximum): the message was retried for good, never dead-lettered; a delayLevel of 2^31
    # went to the retry topic at once, its DELAY kept in it.
    refused = _past_java_int(cmd, "delayLevel", "maxReconsumeTimes")
    if refused is not None:
        return refused
    offset = cmd.int_field("offset", required=True)
    group = cmd.str_field("group", required=True)
    delay_level = cmd.int_field("delayLevel", 0)
    origin_id = cmd.str_field("originMsgId")
    if separator_in(origin_id):
        # Stored as ORIGIN_MESSAGE_ID, a \x02 in it added pairs after the broker's own: a REAL_TOPIC among
        # them sent the retry, when its delay ended, to any topic instead of %RETRY%<group>.
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, f"originMsgId {origin_id!r} holds a properties "
                            "separator (\\x01 or \\x02) or a NUL")
    if ctx.subscriptions is not None and ctx.subscriptions.retry_queue_nums(group) <= 0:
        # retryQueueNums 0 (updateSubGroup -q 0): the operator turned the group's retries off, and RocketMQ's
        # send-back answers SUCCESS storing nothing, not even a dead letter. Retried all the same, such a group's
        # failed messages came back to its consumers up to 16 times and then sat in its dead-letter queue.
        _said_not_retried(group, offset)
        return cmd.response(ResponseCode.SUCCESS)
    retry_tc = ctx.topics.topics.get(RETRY_PREFIX + group)
    if retry_tc is not None and not retry_tc.perm & Perm.WRITE:
        # The operator made the group's retry topic read-only (updateTopicPerm -p 4): RocketMQ's send-back refuses,
        # retries and dead letters alike, and the consumer retries the message itself. Stored all the same, the
        # retries went on as if the topic were writable.
        return cmd.response(ResponseCode.NO_PERMISSION, f"the topic[{RETRY_PREFIX + group}] sending message is "
                            "forbidden")
    # (a body damaged on disk, copied, would go to the retry topic under a fresh, valid CRC)
    view, error = stored_record(ctx, cmd, offset, "send back", f"look message by offset failed, {offset}")
    if error is not None:
        return error
    msg, _ = decode_record(view)
    # (a record typed PREPARED/ROLLBACK that its queue's unit points at is served: its bit 0x4 flipped at rest, read
    # put back by the start, recovery._typed_away; refused, its consumer was told no consumer is given it)
    unitless = (SysFlag.transaction_type(msg.sys_flag) in _NO_UNIT_TYPES
                and ctx.store.physical_offset_of(msg.topic, msg.queue_id, msg.queue_offset) != offset)
    if msg.topic in _NOT_HANDED_BACK or unitless:
        # No consumer was given this record: a half not yet decided (its copy went to the group, and stayed there
        # when the transaction was rolled back), a message still waiting for its delivery time (delivered hours
        # early), the broker's own bookkeeping. The offset is wrong, or not a consumer's to hand back.
        ctx.limits.refused("send-back-unconsumable", f"send-back from {conn.peer[0]}:{conn.peer[1]} (group "
                           f"{group!r}) refused: commit-log offset {offset} is a record of {msg.topic}")
        return cmd.response(ResponseCode.MESSAGE_ILLEGAL, f"the message at offset {offset} is a record of topic "
                            f"{msg.topic}, which no consumer is given: it cannot be sent back")
    props = dict(msg.properties)
    if msg.topic.startswith((RETRY_PREFIX, DLQ_PREFIX)):
        props.setdefault(Prop.RETRY_TOPIC, msg.topic)   # a retry's copy: the topic its first copy was sent to
    else:
        # The record's own topic, whatever it carries: RocketMQ keeps a RETRY_TOPIC already there, and a message
        # consumed from a retry and forwarded with its properties carried its source's, so its own retry was
        # delivered (and keyed by SqliteIdempotency) as a message of that other topic.
        props[Prop.RETRY_TOPIC] = msg.topic
    props.setdefault(Prop.ORIGIN_MESSAGE_ID, origin_id or msg.offset_msg_id)
    # A committed transaction's message keeps its half's TRAN_MSG=true (RocketMQ 4.9.8's commit keeps it too, and
    # its send-back copies it; stock clients since 4.6.1 clear it from their own resend): copied, its retries and
    # dead letter carried it, and a dead letter sent again with its properties (a stock producer then types it
    # PREPARED) became a half, or was refused as another producer group's, never a message. Differs on purpose.
    props.pop(Prop.TRAN_MSG, None)
    limit = _retry_limit(ctx, cmd, group, cmd.int_field("maxReconsumeTimes"))
    # A producer may send any count; a negative one gave a negative backoff level, retried at once for good.
    times = max(msg.reconsume_times, 0)
    if times >= limit or delay_level < 0:
        topic, queues = DLQ_PREFIX + group, 1       # (DLQ_NUMS_PER_GROUP)
        props[Prop.DELAY] = "0"
    else:
        # Backoff: the n-th retry waits level 3 + n (10 s, 30 s, 1 min, ...) in SCHEDULE_TOPIC_XXXX.
        topic, queues = RETRY_PREFIX + group, retry_queues(ctx.subscriptions, group)
        props[Prop.DELAY] = str(delay_level or 3 + times)
    tc = await _back_topic_written(ctx, conn, cmd, topic, queues)
    if not isinstance(tc, TopicConfig):
        return tc
    # One of the group's first retryQueueNums queues at random, as RocketMQ spreads a group's retries. Never past
    # the queues the topic has (a queue limit can keep it from growing): a queue past them would never be read.
    writable = tc.write_queue_nums
    qid = _rand.randrange(min(writable, queues)) if queues > 1 and writable > 1 else 0
    to_topic, to_qid, tags, delay_ms = topic, qid, tags_code(props), -1
    # A retry is a new message, not a transaction's commit record: a COMMIT type copied from a committed
    # message (with PREPARED OFFSET 0) would claim to commit whatever half is stored at offset 0.
    sys_flag = SysFlag.with_transaction_type(msg.sys_flag, SysFlag.TRANSACTION_NOT_TYPE)
    waits = ctx.schedule.levels.divert(topic, qid, props, sys_flag, ctx.clock())
    if waits is not None and not isinstance(waits, str):
        to_topic, to_qid, delay_ms, tags = waits
    await _made_meanwhile(ctx, to_topic, to_qid)
    refused = _queue_file(ctx, cmd, to_topic, to_qid)
    if refused is not None:
        return refused
    record = encode_record(
        topic=to_topic.encode(), body=msg.body, queue_id=to_qid, flag=msg.flag, sys_flag=sys_flag,
        # the producer's born host, as RocketMQ copies it: the consumer that failed the message did not make it
        born_timestamp=msg.born_timestamp, born_host=pack_host(*msg.born_host), store_host=ctx.store_host,
        properties=properties_to_string(props).encode(),
        # (a producer may send any 32-bit count: one more must still fit, or the failed message goes nowhere)
        reconsume_times=min(times + 1, _MAX_RECONSUME_TIMES))
    req = ctx.store.copying(offset, PutRequest(record, to_topic, to_qid, tags, sys_flag, delay_ms))
    result = await ctx.store.put(req)
    if not result.ok:
        return cmd.response(ResponseCode.SYSTEM_ERROR, result.status.name)
    ctx.metrics.count_in(topic, 1, len(msg.body))
    return cmd.response(ResponseCode.SUCCESS)
