"""Consumer offsets and queue bounds: codes 14, 15, 29, 30, 31, 32, 43 (spec 3.8, 3.9, 3.13, 9.2)."""
from __future__ import annotations

import errno
import logging

from protocol.admin_bodies import consumer_offset_entries, consumer_offsets_body, key_consumer_offsets
from protocol.codes import ResponseCode
from protocol.message import validate_group
from protocol.txlog import PROGRESS_GROUP

from ..limits import EveryKey, peer_host
from ..slices import in_slices
from ..store.offsets import REST_FACTOR
from .pull import on_disk, pulled_groups

log = logging.getLogger("txmq.offsets")
MOVES_SAID_A_MINUTE = 20
# groups and topics whose offsets a non-consumer moved, said this minute (MOVES_SAID_A_MINUTE of them at most)
_moves_said = EveryKey(60.0, total=MOVES_SAID_A_MINUTE)


def _queue(cmd):
    return cmd.str_field("topic", required=True), cmd.int_field("queueId", required=True)


def query_consumer_offset(ctx, conn, cmd):
    group = cmd.str_field("consumerGroup", required=True)
    topic, qid = _queue(cmd)
    stored = ctx.offsets.get(group, topic, qid)
    if stored is not None and stored >= 0:
        return cmd.response(ResponseCode.SUCCESS, None, {"offset": stored})
    # RocketMQ answers 0 while the queue starts at 0 and its first message is still "in memory" (spec 9.2 rule 2):
    # a young queue is read from its start. One whose start is far behind the log's end is not, though nothing
    # was deleted: QUERY_NOT_FOUND lets the client start at the end or at its consumeFromWhere timestamp, where
    # 0 had a new group replay days of messages and ignore the timestamp it was given.
    if ctx.store.min_offset(topic, qid) <= 0:
        first = ctx.store.physical_offset_of(topic, qid, 0)
        if first is None or not on_disk(ctx, first):
            return cmd.response(ResponseCode.SUCCESS, None, {"offset": 0})
    return cmd.response(ResponseCode.QUERY_NOT_FOUND, "Not found, V3_0_6_SNAPSHOT maybe this group consumer boot first")


def update_consumer_offset(ctx, conn, cmd):
    group = cmd.str_field("consumerGroup", required=True)
    topic, qid = _queue(cmd)
    offset = cmd.int_field("commitOffset", required=True)
    # Only a queue this broker has: stored as given, any topic name and queue id grew the table (its file,
    # the lag computed every second, what slaves copy) without bound, each answered SUCCESS.
    tc = ctx.topics.get(topic)
    if tc is None:
        return cmd.response(ResponseCode.TOPIC_NOT_EXIST, f"topic[{topic}] not exist, offset not stored")
    why = validate_group(group, "consumerGroup")    # kept in the table, its file and every slave's copy
    if why is not None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"{why}, offset not stored")
    if qid < 0 or qid >= tc.queue_count:
        return cmd.response(ResponseCode.SYSTEM_ERROR,
                            f"queueId[{qid}] is illegal, topic:[{topic}] has {tc.queue_count} queues")
    if group == PROGRESS_GROUP:
        # How far the half queue is settled: a start-up without a usable transaction snapshot reads halves from
        # it, and one moved past undecided halves was never seen again (never checked, never decided).
        return cmd.response(ResponseCode.NO_PERMISSION, f"consumer group {group} is the broker's own (its "
                            "transaction progress): offset not stored")
    if offset < 0:
        # RocketMQ 4.9.8 keeps a negative offset and reads it back as none (QUERY_CONSUMER_OFFSET answers as for a
        # group that never committed): the queue's offset is forgotten. It was answered SUCCESS and the old one
        # kept, the group going on from where the client had just taken it away.
        offset = None
    else:
        refused = ctx.limits.may_commit(conn, ctx.offsets, group, topic, qid)
        if refused is not None:
            return cmd.response(ResponseCode.SYSTEM_ERROR, refused)
    ctx.metrics.group_in_use(group)
    moved_from = None if cmd.is_oneway else _moved_by_another(ctx, conn, group, topic, qid, offset)
    first = (moved_from is None and offset is not None and not cmd.is_oneway
             and not ctx.offsets.has(group, topic, qid))
    if offset is None:
        ctx.offsets.forget(group, topic, qid)
    elif not first:
        ctx.offsets.commit(group, topic, qid, offset, peer_host(conn))
    if first:
        # A consumer's first offset of the queue: our push consumer's start (consume_from="last" stores the
        # queue's end before its first pull), a pull consumer's first commit. Answered from memory, a kill -9
        # before the next periodic save left the group with no offset, and the successor of a consumer gone
        # too was told none again and started at the end of ITS moment: everything sent since the first one
        # began and not consumed by it, passed over. Once a queue and group, so on disk before SUCCESS.
        # On disk as a line of the first offsets' journal (one fsync, shared), not a save of the whole table: a
        # paced save each held a pull consumer committing new queue after queue 150 ms a commit at 10,000 offsets,
        # past its 3 s timeout at 100,000.
        return offsets_saved(ctx, cmd, f"first offset {offset} of group {group} on {topic} queue {qid} stored",
                             cmd.response(ResponseCode.SUCCESS),
                             saving=ctx.offsets.commit_first(group, topic, qid, offset, peer_host(conn)))
    if moved_from is not None:
        # An admin tool's move, either way (resetOffsetByTimeOld and its --force forward, the fallback of
        # resetOffsetNew and of skipAccumulatedMessage, cloneGroupOffset into the destination group): answered
        # from memory, a kill -9 before the next periodic save put the group back where it was, its replay
        # lost or its skip redelivered. On disk before SUCCESS, as INVOKE_BROKER_TO_RESET_OFFSET is. A
        # consumer's own commits stay cheap: a Java consumer's (persistAll) are oneway, told nothing, and so
        # are never waited for even on a connection it has not heartbeated on yet (a restarted broker).
        done = (f"offset of group {group} on {topic} queue {qid} "
                + (f"{moved_from} forgotten (a negative offset was committed)" if offset is None else
                   f"set to {offset} (none before)" if moved_from < 0 else
                   f"moved {'back' if offset < moved_from else 'forward'} from {moved_from} to {offset}"))
        if _moves_said.due(f"{group}\0{topic}"):
            # A tool reaches a slave only while its master is gone; the slave's next copy from the master
            # takes the master's offset for the queue (putAll), undoing the move once the master is back.
            slave = ("; on a slave: its master's offset for the queue replaces it at the next copy from the "
                     "master (move it on the master)" if ctx.config.broker_role == "SLAVE" else "")
            log.warning("%s by %s, no consumer of the group (an admin tool: resetOffsetByTimeOld, "
                        "skipAccumulatedMessage, cloneGroupOffset?); saved before the reply%s (more of this "
                        "group and topic in the next minute are not said)", done, peer_host(conn), slave)
        elif _moves_said.full():
            # made-up groups (they cost nothing) were a line each: 296 moves, 296 lines
            ctx.limits.warn("offset-move-said", f"offsets of more than {MOVES_SAID_A_MINUTE} groups and topics "
                            f"moved this minute by clients that are no consumer of the group (latest: {done} by "
                            f"{peer_host(conn)}): not said one by one")
        return offsets_saved(ctx, cmd, done, cmd.response(ResponseCode.SUCCESS), paced=True)
    return cmd.response(ResponseCode.SUCCESS)


def _why(ctx, exc: OSError) -> str:
    """What a save's failure says: a full disk (ENOSPC: its blocks, or its inodes, which the first offsets' journal
    takes one of when made, and every save's .tmp) measured at once and said as every refused write says it (bare
    "[Errno 28]", the guard accepting on until its next probe, the inodes named nowhere), else the error."""
    if exc.errno == errno.ENOSPC and ctx.store.disk.probe():
        return ctx.store.disk.remark(f"{exc.filename or 'consumer offsets'}: no space")
    return str(exc)


def _moved_by_another(ctx, conn, group: str, topic: str, qid: int, offset: int | None) -> int | None:
    """The offset a commit moves from (-1: none was stored) when the committer is no consumer of the group (an
    admin tool: no heartbeat for it and no pull for it on that connection), else None: a consumer's own commits,
    and a commit that moves nothing, go on disk with the periodic save (one lost to a kill -9 costs
    redeliveries)."""
    current = ctx.offsets.get(group, topic, qid)
    if offset == current:
        return None
    g = ctx.clients.consumers.get(group)
    if g is not None and conn in g.channels:
        return None
    if group in pulled_groups(conn):
        return None
    return -1 if current is None else current


async def offsets_saved(ctx, cmd, done: str, reply, *, paced: bool = False, max_rest: float | None = None,
                        saving=None):
    """``reply`` once the consumer offsets file holds what was changed, or SYSTEM_ERROR saying ``done`` but not
    saved (``reply`` too when it is an error already). ``paced``: an admin's move, reset or removal, which a client
    may loop over: its save starts after the saver's rest (``ConsumerOffsets.saved``), counted when it waits one.
    ``saving``: what to wait for instead of a save (a consumer's own first offset of a queue: ``commit_first``)."""
    try:
        rested = await ctx.offsets.saved(paced=paced, max_rest=max_rest) if saving is None else await saving or 0.0
    except OSError as exc:
        if reply.code == ResponseCode.SUCCESS:
            return cmd.response(ResponseCode.SYSTEM_ERROR, f"{done} but the consumer offsets are not saved (they "
                                f"are lost if the broker stops before the next periodic save): {_why(ctx, exc)}")
        return reply
    if rested > 0:
        ctx.metrics.offset_moves_deferred.inc()
        if rested >= 1.0:       # a big table (a rest is REST_FACTOR saves), or many moves at once
            ctx.limits.warn("offset-move-rest", f"{done}: its save waited {rested:.1f} s for the offsets saver's "
                            f"rest ({REST_FACTOR} times its last save; saves admin moves start keep it at most "
                            f"1/{REST_FACTOR + 1} busy) (txmq_offset_moves_deferred_total)")
    return reply


def get_max_offset(ctx, conn, cmd):
    topic, qid = _queue(cmd)
    return cmd.response(ResponseCode.SUCCESS, None, {"offset": ctx.store.max_offset(topic, qid)})


def get_min_offset(ctx, conn, cmd):
    topic, qid = _queue(cmd)
    return cmd.response(ResponseCode.SUCCESS, None, {"offset": ctx.store.min_offset(topic, qid)})


def search_offset_by_timestamp(ctx, conn, cmd):
    topic, qid = _queue(cmd)
    ts = cmd.int_field("timestamp", required=True)
    return cmd.response(ResponseCode.SUCCESS, None, {"offset": ctx.store.search_offset_by_time(topic, qid, ts)})


def get_earliest_msg_storetime(ctx, conn, cmd):
    topic, qid = _queue(cmd)
    ts = ctx.store.earliest_store_time(topic, qid)
    return cmd.response(ResponseCode.SUCCESS, None, {"timestamp": -1 if ts is None else ts})


async def get_all_consumer_offset(ctx, conn, cmd):
    """Every committed offset (GET_ALL_CONSUMER_OFFSET): what a slave copies from its master every
    ``slave_sync_interval_ms`` (RocketMQ's SlaveSynchronize), so consumers that fail over to it go on from
    where they were, not from the start or the end. Encoded a slice at a time (OFFSET_SLICE offsets, then
    KEY_SLICE topic@group entries), the loop running between: in one go, 100,000 offsets held it 100-190 ms at
    every slave's sync. A queue whose offset was forgotten (a negative commit) is listed at -1, as a Java master
    lists the -1 it keeps: a slave forgets its copy too (kept, a consumer failing over to it went on from the
    offset the client had taken away)."""
    by_key: dict = {}
    listed = ctx.offsets.items() + [(key, -1) for key in ctx.offsets.forgotten()]
    async for part in in_slices(listed, OFFSET_SLICE):
        key_consumer_offsets(part, by_key)
    entries = []
    async for part in in_slices(sorted(by_key.items()), KEY_SLICE):
        entries.append(consumer_offset_entries(part))
    # (the groups deleted with their offsets kept: a slave promoted leaves their lag out as this master does)
    return cmd.response(ResponseCode.SUCCESS, body=consumer_offsets_body(entries, ctx.offsets.kept_deleted()))


OFFSET_SLICE = 4096
KEY_SLICE = 64          # (a key's entry holds one offset per queue: up to a topic's queue count)
