"""The transaction service: a thin shell around the rules in core.py.

It parses nothing off the wire (processors/transaction.py does), keeps the undecided transactions in
the core's index, performs the core's actions (records to append, checks to send, replies) and keeps
what became of every decided transaction in the decision table (decisions.py): one byte each, on disk.

Promises, beyond RocketMQ 4.x:

* the first recorded decision wins: a later different one is refused
  (TRANSACTION_FAILED) and counted, a repeated identical one is acknowledged
  and changes nothing, so an END_TRANSACTION retried by our client or replayed
  by a check never delivers twice, however old the transaction;
* a commit writes the real message and its op record in ONE writer batch; at
  start-up a committed message whose op record was lost in a crash is found in
  the replayed log tail, so it is never committed a second time (a dead letter
  likewise: never dead-lettered twice);
* undecided transactions live in memory, ordered by next check time: a check
  pass costs O(due), and writes a small check record, never the payload; decided
  ones cost no memory;
* start-up reads a snapshot of the undecided index and replays only the op
  records written after it, not every decision ever made;
* nothing is dropped silently: after ``transaction_check_max`` checks, or when
  retention (or disk pressure) expires it (broker/retention.py), a transaction is
  copied to TRANS_CHECK_MAX_TIME_TOPIC with its reason, and can be resumed.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import os
import weakref

from protocol.codes import LanguageCode, RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.errors import CorruptRecordError, RecordError, StoreError
from protocol.connection import DEFERRED
from protocol.message import Prop, decode_record, offset_msg_id, record_body_length

from ..answer import Answer
from ..limits import EveryKey
from ..results import put_failure_response, response_code, send_ok
from ..topics import HALF_TOPIC, OP_TOPIC, readable_queue
from .check import CheckTimer, Policy
from .core import (BUSY, Origin, Reply, SendCheck, TransactionCore, Tx, Wait, Write, asks_delay, owner_of,
                   tx_from_half)
from .decisions import DecisionTable
from .records import (COMMIT, DEAD, DEAD_TOPIC, P_OWNER, RESUME, ROLLBACK, RecordFactory, parse_dead_letter,
                      plain_owner)
from .recovery import PROGRESS_GROUP, filed_at, recover, restamp_half, sender_id, write_snapshot

# How long a heartbeat naming a connection waits for its halves' sender records at most: a stock Java client (4.9.8)
# closes its connection when a HEART_BEAT is not answered within 3 s (clientCloseSocketIfTimeout, true by default),
# failing every request in flight on it. The records take one writer cycle per 256 (about 17 ms per 1,000 halves
# here, more with sync flush or a busy writer); those not written by then are written after the answer.
NAMING_WAIT_S = 1.0
# Dead letters retention (or a plan) queues together, to share a group commit: a half may be max_message_size
# (4 MiB), each copied in memory until written, so not the whole segment's at once.
DEAD_LETTER_BATCH = 32
# ... and a batch ends once its halves reach this many bytes: 32 halves of 4 MiB held 130 MiB at once (a big write
# is a flush's cost anyway, a group commit of them saves little).
DEAD_LETTER_BATCH_BYTES = 4 << 20

CORRUPT_HALF = "corrupt-half"       # the dead-letter reason of a half whose body fails its CRC
_FOREVER = (1 << 63) - 1         # a message-index query over all time
_MAX_CHECKS = Origin.MAX_CHECKS.value     # (run_due's, each pass: an enum member's value is two calls a read)
# An END's transactionId or msgId longer than this is no UNIQ_KEY (32 hex digits): not looked up in the index
_KEY_CHARS_MAX = 128

log = logging.getLogger("txmq.transaction")

Pending = Tx                            # the name the rest of the broker and the tests know


class _FileBeingMade(Exception):
    """A decision's record goes to a queue whose first file the store's queue-file thread is making: args
    (topic, queue id), for ``store.queue_file``. The decision stays claimed."""


class DecisionError(Exception):
    def __init__(self, code: int, remark: str):
        super().__init__(remark)
        self.code = code
        self.remark = remark


# Dead-lettered transactions committed late, past the ERROR lines a minute, kept to be named at its end
_UNSAID_MAX = 2000
# (group, client id) keys of silent producers whose WARNING is held back for the minute (TransactionService._say_silent)
_SILENT_KEYS_MAX = 10_000


class TransactionService:
    def __init__(self, ctx):
        c = ctx.config
        self.ctx = ctx
        self.policy = Policy(c.transaction_check_interval_ms, c.transaction_timeout_ms, c.transaction_check_max,
                             int(c.transaction_retention_hours * 3600 * 1000))
        self.core = TransactionCore(self.policy, self.decision_of, self._identity)
        self.pending = self.core.pending
        self.table: DecisionTable | None = None
        self._refused = [0, ""]     # (run_due) check records refused this pass, and why
        self._dead_refused: list[tuple[Tx, str]] = []   # (run_due) max-check dead letters refused this pass, and why
        self.dead_count = 0
        # (a slave) undecided halves its cleaner removed, its master's to dead-letter: kept in its snapshot until an
        # op decides them, so the start that promotes it can say the ones it lost (recovery._removed_undecided)
        self.removed_undecided: list[int] = []
        self.removed_undecided_queue: list[int] = []     # (those stored after its snapshot: by half queue offset)
        self.lost_said = False      # this start said removed halves lost (its snapshot is written at once)
        # [start, end) of the commit-log segment retention is dead-lettering and removing (Retention._remove): no
        # resume of a half in it meanwhile, or it is pending again, in no list, and its half removed under it
        self.removing: tuple[int, int] | None = None
        self.snapshot_interval_s = c.transaction_snapshot_interval_s
        self._deciding: dict[int, asyncio.Future] = {}
        # Halves a dead_letter() call is dead-lettering: each said in its one line, not a WARNING of its own
        self._said_together: dict[int, _SaidTogether] = {}
        self._requeue_said = EveryKey(float("inf"), max_keys=4096)    # "topic\0its read queues" said: _say_requeued
        self.recovered_commits: set[int] = set()
        self.recovered_dead_letter: tuple[int, int] | None = None     # (offset, size)
        self.storing: list[int] = []      # half-queue end offsets seen by halves still being stored
        # group -> its halves still being stored (not in the index yet): the undecided limit counts them with
        # the index's (Limits.may_prepare), or a group past it was let in again for as many as the writer queued.
        self.storing_groups: dict[str, int] = {}
        self.writing_ops: list[int] = []  # op-queue end offsets seen by decisions still being written
        self.changed = True
        self._snapshot_task: asyncio.Task | None = None
        self.snapshot_held = False      # a snapshot held back for decisions waiting for disk space (said once)
        self._rr = 0
        # COMMITs of dead-lettered transactions said: each once a minute, 20 a minute in all (a client may repeat them)
        self._dead_commit_said = EveryKey(60, total=20)
        # Silent producers named: each (group, client id) once a minute, by the broker's clock. A slow producer goes
        # silent and back at each late answer: once a check pass under a stream of its transactions, each a line.
        # The times not said are counted by key (at most _SILENT_KEYS_MAX keys) and given in its next line.
        self._silent_said = EveryKey(60, max_keys=_SILENT_KEYS_MAX, clock=lambda: ctx.monotonic() / 1000)
        # Groups whose due transactions found no producer to ask: each said every 10 minutes (group names are the
        # halves' own, chosen by clients: 20 groups an interval at most).
        self._nobody_said = EveryKey(600, total=20, rotate=True, clock=lambda: ctx.monotonic() / 1000)
        # ... once nobody was there for an interval: a producer restarted (a deploy) is back within it, its group's
        # deferred checked at once, and that is no news. {group: when its due transactions first found nobody}
        self._nobody_since: dict[str, int] = {}
        self._nobody_pruned = -(1 << 62)    # when the full table last dropped groups with nothing deferred
        self._nobody_asked: set[str] = set()
        self._silent_unsaid: dict[str, int] = {}
        # A late COMMIT's dead-letter lookup that could not see it all (_commit_after_removed), said once a 10 s:
        # any client can send COMMITs naming made-up offsets below the log, and each wrote two WARNINGs.
        self._end_lookup_said = EveryKey(10, clock=lambda: ctx.monotonic() / 1000)
        # ... and those lookups, one at a time: each is a job on the message index's one thread (~110 ms for a key
        # sharing its String.hashCode with 4,096 records), and 1,024 oneway ENDs in flight on one connection queued
        # as many at once, the indexing of new records and every QUERY_MESSAGE behind them.
        self._end_lookups = asyncio.Semaphore(1)
        # ... and those past the 20, named together once the minute is over (say_unsaid_dead_commits): half offset
        # -> group, at most _UNSAID_MAX (the rest counted), each named once
        self._dead_commits_unsaid: dict[int, str] = {}
        self._dead_commits_unsaid_more = 0
        # ... of which those whose half retention removed: half offset -> its dead letter's id (no resume for them)
        self._dead_commits_removed: dict[int, str] = {}
        self.check_cap = c.transaction_check_in_flight_max
        self._check_bytes = max(1, c.max_write_buffer // 4)    # check bytes one slice may queue to a connection
        self._slice_bytes: dict = {}
        self._slice_full: dict[str, frozenset] = {}     # group -> its producers' connections, all at their cap
        self._slice_gone: set[str] = set()                # groups no producer of which is here
        # group -> its live producers, listed once a slice (nothing registers or closes within one): listed again for
        # each due transaction, 1,000 producers and 5,000 due transactions held the event loop ~1 s a slice
        self._slice_channels: dict[str, list] = {}
        self._slice_short: set[str] = set()               # groups parked for this slice's check bytes alone
        self._slice_released = 0                          # core.released when _slice_full was last valid
        self._unnamed: dict = {}            # conn -> _Unnamed: halves sent before a heartbeat named it
        self._naming: set = set()           # sender records being written for halves named while stored
        # conn -> {id(half's PutRequest): future}: its halves being stored before a heartbeat named it, done once
        # each is indexed and (named meanwhile) its sender record written: what a heartbeat waits for too
        self._unnamed_storing: dict = {}
        # Checks are timed by the monotonic clock: timed by the wall clock, a step back of an hour (NTP, a VM
        # resumed) left every undecided transaction unchecked for that hour, and a step forward checked all of
        # them at once, before their immunity ended.
        self.timer = CheckTimer(self, ctx.monotonic, max_sleep_s=min(1.0, c.transaction_check_interval_ms / 1000))
        if c.broker_role == "SLAVE":    # its index is its start-up one, never following its master's decisions
            ctx.metrics.half_messages.set_function(lambda: 0)
        else:
            ctx.metrics.half_messages.set_function(lambda: len(self.pending))

    @functools.cached_property
    def records(self) -> RecordFactory:
        # Built on first use: by then the server has bound its port and set the store host.
        return RecordFactory(self.ctx.store_host, self.ctx.uniq_ids, self.ctx.clock)

    @property
    def directory(self) -> str:
        return os.path.join(self.ctx.store.store_dir, "transactions")

    # ------------------------------------------------------------ what became of a transaction
    def decision_of(self, half_offset: int) -> str | None:
        """COMMIT, ROLLBACK or DEAD for a decided transaction; None if undecided or unknown here."""
        if half_offset in self.pending or self.table is None:
            return None
        q = self._half_queue_offset(half_offset)
        return None if q is None else self.table.get(q)

    def _identity(self, half_offset: int) -> tuple[str, int] | None:
        """(producer group, queue offset) of the half stored at ``half_offset``, or None."""
        msg = self._half_at(half_offset)
        return None if msg is None else (msg.properties.get(Prop.PGROUP, ""), msg.queue_offset)

    def _half_queue_offset(self, half_offset: int) -> int | None:
        msg = self._half_at(half_offset)
        return None if msg is None else msg.queue_offset

    def committed_half(self, half_offset: int, record_offset: int) -> int | None:
        """The queue offset of the half that the COMMIT-type record at ``record_offset`` commits, or None.

        The record must be that half's message (same UNIQ_KEY, same body): a COMMIT-type record can also
        be a copy of a committed message (a retry written by an older txmq, with PREPARED OFFSET 0), and
        taking its prepared offset at its word would commit whatever half is stored there."""
        half = self._half_at(half_offset)
        view = self.ctx.store.get_record(record_offset)
        if half is None or view is None:
            return None
        msg = decode_record(view)[0]
        if msg.properties.get(Prop.UNIQ_KEY) != half.properties.get(Prop.UNIQ_KEY) or msg.body != half.body:
            return None
        return half.queue_offset

    def stored_at(self, store_ts: int) -> int:
        """When a half stored at ``store_ts`` (the wall clock's) was stored by the check schedule's clock: its
        age by the wall clock, taken from the monotonic now. A store time ahead of the wall clock (stepped back
        since) is an age of 0, so its immunity runs in full, and no longer than it."""
        return self.ctx.monotonic() - max(0, self.ctx.clock() - store_ts)

    def _half_at(self, half_offset: int):
        """The half message stored at ``half_offset``, or None (removed, or not a half's offset)."""
        if half_offset < 0:
            return None
        try:
            view = self.ctx.store.get_record(half_offset)
            msg = decode_record(view)[0] if view is not None else None
        except Exception:  # noqa: BLE001 - not a record boundary: no half there
            return None
        if msg is None or msg.topic != HALF_TOPIC:
            return None
        return msg if filed_at(self.ctx.store, msg) else None

    def record(self, queue_offset: int, op: str | None) -> None:
        before = self.table.get(queue_offset)
        if before == DEAD and op != DEAD:
            self.dead_count -= 1
        elif op == DEAD and before != DEAD:
            self.dead_count += 1
        self.table.set(queue_offset, op)
        self.changed = True

    # ------------------------------------------------------------ recovery
    def on_dispatch(self, info) -> None:
        """Store dispatch listener: remember commits and dead letters replayed by recovery (their op may be lost)."""
        # (prepared_offset may be 0: the very first record of a store can be a half message)
        if info.recovering and SysFlag.transaction_type(info.sys_flag) == SysFlag.TRANSACTION_COMMIT:
            self.recovered_commits.add((info.prepared_offset, info.physical_offset))
        elif info.recovering and info.topic == DEAD_TOPIC:
            self.recovered_dead_letter = (info.physical_offset, info.size)      # the last one replayed

    async def recover(self) -> None:
        """Rebuild the index: from the snapshot and the op records after it, or from the whole log."""
        await recover(self)

    def trim(self) -> None:
        """Forget the decisions of halves that retention removed."""
        self.dead_count -= self.table.trim(self.ctx.store.min_offset(HALF_TOPIC, 0))

    def start(self) -> None:
        self.timer.start()
        self._snapshot_task = asyncio.get_running_loop().create_task(self._snapshots(), name="txmq-tx-snapshot")

    async def stop(self) -> None:
        # First (nothing here waits on the disk): the snapshot loop named them once their minute was over; a stop
        # within it cancelled the loop, and the late COMMITs past the 20 lines were named nowhere.
        self.say_unsaid_dead_commits(now=True)
        await self.timer.stop()
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
            try:
                await self._snapshot_task
            except asyncio.CancelledError:
                pass
        if self.ctx.config.broker_role == "SLAVE":
            # Its index is its start-up one (it follows no decisions, runs no checks): a snapshot or a half floor
            # saved from it said every half its master took since was decided, and the slave restarted as the
            # master (broker-role changed) never checked them -- undecided transactions gone without a word.
            # Its next start reads the log it copied after the snapshot it had.
            if self.table is not None:
                self.table.close()
            return
        self._save_progress()
        if self.table is not None:
            try:
                await self.write_snapshot()
            except (OSError, StoreError) as exc:
                log.error("transaction snapshot not written at stop: %s", exc)
            self.table.close()

    def _save_progress(self) -> None:
        if self.ctx.offsets is None:    # a start that failed before the offsets were opened
            return
        self.ctx.offsets.commit(PROGRESS_GROUP, HALF_TOPIC, 0, self._half_floor())

    def _half_floor(self) -> int:
        # A half being stored is not pending yet; its queue offset is at or past the end it saw. Runs after
        # every check pass: the core keeps the lowest pending offset, never a scan of the index.
        lowest = self.core.lowest_queue_offset()
        floors = self.storing if lowest is None else self.storing + [lowest]
        return min(floors) if floors else self.ctx.store.max_offset(HALF_TOPIC, 0)

    # ------------------------------------------------------------ snapshots
    async def _snapshots(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            self.say_unsaid_dead_commits()
            if not self.changed:
                continue
            try:
                written = await self.write_snapshot()
            except Exception as exc:  # noqa: BLE001 - a bug too: ending the loop would stop every later snapshot
                self.changed = True     # write_snapshot cleared it before writing: try again next turn
                # Once per failure run (a full disk): an ERROR every interval for as long as it lasted
                if not failing or not isinstance(exc, OSError):
                    log.error("transaction snapshot not written (retried every %g s; until it is, a start replays "
                              "the op records after the last one): %s", self.snapshot_interval_s, exc,
                              exc_info=not isinstance(exc, OSError))
                failing = isinstance(exc, OSError)
                continue
            if failing and written:
                failing = False
                log.warning("transaction snapshot written again")

    async def write_snapshot(self) -> bool:
        return await write_snapshot(self)

    # -------------------------------------------------------- half messages
    def prepare(self, conn, cmd, h, qid: int, props: dict, born_host: bytes, topic: str | None = None):
        """``topic``: where the half's message goes once committed, when not the one the request names."""
        group = props.get(Prop.PGROUP) or h.producer_group
        props.setdefault(Prop.PGROUP, group)
        topic = h.topic if topic is None else topic
        owner = conn.attributes.get("client_id")     # None: no heartbeat named the connection yet
        req = self.records.half(body=cmd.body, real_topic=topic, real_qid=qid, flag=h.flag, sys_flag=h.sys_flag,
                                born_timestamp=h.born_timestamp, born_host=born_host, props=props,
                                reconsume_times=h.reconsume_times, owner=owner)
        ctx = self.ctx
        if owner is None:       # (here: the coroutine below runs later, a heartbeat may come before it does)
            self._storing_unnamed(conn, req)
        if ctx.ha is not None and ctx.ha.sync and props.get(Prop.WAIT, "true").lower() != "false":
            return self._prepare(conn, cmd, req, group, topic, qid, props, owner)    # SYNC_MASTER: waits for the slave
        floor = ctx.store.max_offset(HALF_TOPIC, 0)
        self.storing.append(floor)
        self._storing_group(group, 1)
        ctx.store.put(req, then=Answer(ctx, conn, cmd, functools.partial(
            self._half_answer, conn, cmd, req, group, topic, qid, props, owner, floor)))
        return DEFERRED

    def _half_answer(self, conn, cmd, req, group, topic, qid, props, owner, floor, result):
        """The reply to a half once stored (called by the store's writer, through Answer)."""
        self.storing.remove(floor)
        self._storing_group(group, -1)
        return self._half_stored(conn, cmd, req, group, topic, qid, props, owner, result) or send_ok(
            self.ctx, cmd, offset_msg_id(self.ctx.store_host, result.physical_offset), qid, result.queue_offset)

    async def _prepare(self, conn, cmd, req, group, topic, qid, props, owner):
        ctx = self.ctx
        if owner is None:
            self._storing_unnamed(conn, req)
        floor = ctx.store.max_offset(HALF_TOPIC, 0)
        self.storing.append(floor)
        self._storing_group(group, 1)
        try:
            result = await ctx.store.put(req)
        except BaseException:
            self._stored_unnamed(conn, req, None)
            raise
        finally:
            self.storing.remove(floor)
            self._storing_group(group, -1)
        refused = self._half_stored(conn, cmd, req, group, topic, qid, props, owner, result)
        if refused is not None:
            return refused
        code = ResponseCode.SUCCESS
        if ctx.ha is not None and ctx.ha.sync and props.get(Prop.WAIT, "true").lower() != "false":
            code = await ctx.ha.confirm_async(result.physical_offset + result.size)   # SYNC_MASTER
        return send_ok(ctx, cmd, offset_msg_id(ctx.store_host, result.physical_offset), qid, result.queue_offset,
                       code)

    def _storing_group(self, group: str, n: int) -> None:
        left = self.storing_groups.get(group, 0) + n
        if left:
            self.storing_groups[group] = left
        else:
            del self.storing_groups[group]

    def _half_stored(self, conn, cmd, req, group, topic, qid, props, owner, result):
        """A half's store result: the refusal to answer, or None once it is in the undecided index. ``owner``: the
        client id its connection had when the half was written (TXMQ_OWNER), None when no heartbeat had named it."""
        if not result.ok:
            if owner is None:
                self._stored_unnamed(conn, req, None)
            return put_failure_response(cmd, result)
        ctx = self.ctx
        tx = Tx(result.physical_offset, result.queue_offset, group, topic, props.get(Prop.UNIQ_KEY, ""),
                result.store_timestamp, real_qid=qid, tags_code=req.tags_code, owner=weakref.ref(conn),
                owner_id=owner or f"{conn.peer[0]}:{conn.peer[1]}", delayed=asks_delay(props))
        if self.core.add(tx, immunity_s=props.get(Prop.CHECK_IMMUNITY_TIME_IN_SECONDS),
                         stored_at=self.stored_at(tx.store_ts)):
            self.timer.wake()
        self.changed = True
        if owner is None:
            self._stored_unnamed(conn, req, self._unnamed_half(conn, tx))
        client_id = conn.attributes.get("client_id") or tx.owner_id
        ahead = self.table.wants(result.queue_offset)
        if ahead is not None:
            self._make_ahead(ahead)
        ctx.clients.add_producer(group, conn, client_id, cmd.language, cmd.version)
        ctx.metrics.child(ctx.metrics.half_in, group).inc()
        # As RocketMQ 4.9.8 counts it (SendMessageProcessor, the message's topic already the half topic): TOPIC_PUT_NUMS
        # RMQ_SYS_TRANS_HALF_TOPIC is what mqadmin exportMetrics reads as transInTps and transOneDayInNum (0 without
        # it), and the half is one of the broker's puts (putTps, msgPutTotal*).
        ctx.metrics.count_in(HALF_TOPIC, 1, len(cmd.body))
        return None

    # ------------------------------------------------------- whose halves
    def _storing_unnamed(self, conn, req) -> None:
        """A half is being stored on ``conn``, which no heartbeat has named: a heartbeat naming it meanwhile is
        answered once this half's sender record is written too (connection_named)."""
        storing = self._unnamed_storing.setdefault(conn, {})
        if id(req) not in storing:
            storing[id(req)] = asyncio.get_running_loop().create_future()

    def _stored_unnamed(self, conn, req, writing) -> None:
        """The half of ``req`` is indexed (or refused): what waits for it ends once ``writing`` (its sender
        record's task, or None) has."""
        storing = self._unnamed_storing.get(conn)
        done = storing.pop(id(req), None) if storing else None
        if storing is not None and not storing:
            del self._unnamed_storing[conn]
        if done is None or done.done():
            return
        if writing is None:
            done.set_result(None)
        else:
            writing.add_done_callback(lambda _: done.done() or done.set_result(None))

    def _unnamed_half(self, conn, tx: Tx) -> asyncio.Task | None:
        """``tx`` came on a connection no heartbeat had named: its sender is named when one does (connection_named),
        at once when one did while the half was being written (the task writing its sender record, returned)."""
        if conn.attributes.get("client_id") is not None:
            writing = self._name([tx], conn.attributes["client_id"])
            return None if writing is None else self._writing(writing)
        if getattr(conn, "is_open", False):       # (closed: it never will be; connection_closed has run)
            unnamed = self._unnamed.get(conn)
            if unnamed is None:
                unnamed = self._unnamed[conn] = _Unnamed()
            unnamed.add(tx, self.pending)
        return None

    def connection_named(self, conn):
        """A heartbeat named ``conn`` (its client id): the undecided halves it sent before get that id as their
        sender; an awaitable that ends once a sender record for each is in the log, or after NAMING_WAIT_S (the
        heartbeat is answered then; the records still being written are written after), or None. A stock Java producer sends its first halves before its first heartbeat (it heartbeats a
        broker it learnt from a route at its next 30 s tick): their checks went to any producer of the group after
        a kill -9, the half not naming its sender and the next snapshot only written once something else changed.
        Only the connection's first name counts: a later heartbeat giving it another id leaves every half named as
        it was (the id its connection had when it came, or the first one given after)."""
        unnamed = self._unnamed.pop(conn, None)
        client_id = conn.attributes.get("client_id")
        writing = self._name(unnamed.halves, client_id) if unnamed is not None and client_id is not None else None
        # Those being stored meanwhile, sent before the heartbeat: named once indexed (_unnamed_half), and waited for.
        waits = list(self._unnamed_storing.get(conn, {}).values()) if client_id is not None else []
        if writing is not None:
            waits.append(self._writing(writing))
        return self._awaited(waits, len(unnamed.halves) if unnamed else 0, client_id) if waits else None

    def _writing(self, writing) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(writing)
        self._naming.add(task)
        task.add_done_callback(self._naming.discard)
        return task

    @staticmethod
    async def _awaited(waits: list, halves: int, client_id: str) -> None:
        _, left = await asyncio.wait(waits, timeout=NAMING_WAIT_S)
        if left:
            log.warning("the sender records naming %s of up to %d halves not all written after %.1f s: the heartbeat "
                        "is answered (a stock client closes its connection after 3 s), they are written after",
                        client_id, halves, NAMING_WAIT_S)

    def _name(self, halves: list[Tx], client_id: str):
        named = [t for t in halves if self.pending.get(t.half_offset) is t]     # not decided meanwhile
        for t in named:
            t.owner_id = client_id
        if not named:
            return None
        self.changed = True         # and the next snapshot's "owners"
        if not plain_owner(client_id):
            return None             # kept in memory only, as a check record or a snapshot would keep it
        return self._write_senders(named, client_id)

    async def _op_queue_file(self) -> None:
        """The op queue's file made, off the loop (store.queue_file), before records that may be its first (sender
        or check records; a decision's makes it its own way). Put straight to the writer, the file was made on the
        event loop, and past the open-files limit the records were stored with their units waiting in memory,
        unreadable by a restart's replay, the checkpoint standing still meanwhile. Raises as queue_file does."""
        store = self.ctx.store
        if (OP_TOPIC, 0) not in store.queue_index:
            await store.queue_file(OP_TOPIC, 0)

    async def _write_senders(self, named: list[Tx], client_id: str) -> None:
        rf = self.records
        failed, why = 0, ""
        try:    # a stock producer's first heartbeat on a new broker: its sender records may be the op queue's first
            await self._op_queue_file()
        except (OSError, StoreError) as exc:     # (StoreError: the store is closing)
            log.warning("the sender %s of %d undecided halves was not recorded (op queue file: %s): known until "
                        "a restart, and after one if the next snapshot is written first", client_id,
                        len(named), exc)
            return
        step = self.CHECK_SLICE     # batches of a check slice's size
        for i in range(0, len(named), step):
            batch = named[i:i + step]
            try:
                results = await self.ctx.store.put_many([rf.sender(t.half_offset, t.queue_offset, client_id)
                                                         for t in batch])
            except Exception as exc:  # noqa: BLE001 - as a refusal: the snapshot still carries them
                log.exception("sender records of %d halves not written", len(batch))
                failed, why = failed + len(batch), f"{type(exc).__name__}: {exc}"
                continue
            refused = [r for r in results if not r.ok]
            if refused:
                failed, why = failed + len(refused), refused[0].status.name
        if failed:
            log.warning("the sender %s of %d undecided halves was not recorded (%s): known until a restart, and "
                        "after one if the next snapshot is written first", client_id, failed, why)

    def _make_ahead(self, base: int) -> None:
        """A decision-table file made on a thread before the first decision needs it (see DecisionTable.wants)."""
        table = self.table

        def made(fut: asyncio.Future) -> None:
            exc = None if fut.cancelled() else fut.exception()
            if exc is not None:     # the decision that needs it makes it (or waits in memory) and says why
                log.debug("decision file %d not made ahead: %s", base, exc)
            table.adopt(base, None if fut.cancelled() or exc is not None else fut.result())

        try:
            fut = asyncio.get_running_loop().run_in_executor(None, table.make, base)
        except RuntimeError:        # stopping: the executor is gone; the decision makes its file itself
            table.adopt(base, None)
            return
        fut.add_done_callback(made)

    # ------------------------------------------------------------ decisions
    def end(self, half_offset: int, op: str, *, group: str, table_offset: int, from_check: bool, later=None,
            conn=None, keys: tuple[str, ...] = ()):
        """An END_TRANSACTION (parsed by its processor): (code, remark) now, or an awaitable of it; or, when
        ``later`` (an Answer of (code, remark) results) is given and the decision is written at once, None:
        the store's writer hands ``later`` the answer. ``keys``: the END's transactionId and msgId (a stock
        producer's are its half's UNIQ_KEY), by which a COMMIT of a half retention removed finds its dead letter."""
        metrics = self.ctx.metrics
        tx = self.pending.get(half_offset)
        if from_check and tx is not None and tx.group == group:    # another group's answer is refused below
            metrics.child(metrics.check_answers, group, op).inc()
        origin = Origin.CHECK if from_check else Origin.PRODUCER
        held = tx is not None and tx.check_channel is not None
        action = self.core.end(half_offset, op, origin=origin, group=group, queue_offset=table_offset, channel=conn)
        # An answer that freed a check slot: the parked may go now. Only such a one: a pass reads the whole pending
        # index (the progress floor), and an "answer" repeated for a transaction nobody was asked about (or another
        # group's) woke one each, cutting END throughput 8x while anything was parked. Nor one of a group with nothing
        # parked: a slot is a group's, and a group answering quickly ended at every slice a pass over another's backlog.
        if held and tx.check_channel is None and self.core.has_parked(tx.group):
            self.timer.wake()
        if isinstance(action, Reply):
            self._count(action, group, half_offset)
            if action.event == "no-half" and op == COMMIT and self._half_removed(half_offset) and any(keys):
                return self._commit_after_removed(half_offset, group, keys, action)
            return action.code, action.remark
        if isinstance(action, Write):       # claimed now, before any other request is handled
            done = self._claim(action.tx)
            if later is None:
                return self._answer(self._write_decision(action, done))
            try:
                self._put_decision(action, done, later)
            except DecisionError as exc:
                return exc.code, exc.remark
            except _FileBeingMade:      # its queue's file is being made: written once it is (_write_decision)
                return self._answer(self._write_decision(action, done))
            return None
        return self._answer(self.decide(half_offset, op, group=group, origin=origin, queue_offset=table_offset))

    def _count(self, reply: Reply, group: str, half_offset: int | None = None, dead_letter: str = "") -> None:
        metrics = self.ctx.metrics
        if reply.event == "not-its-half":   # another group's END, or a wrong offset: refused, counted by reason
            metrics.refused.labels("end-not-its-half").inc()
            return
        if reply.event == "no-half":
            # No half stored at the offset it names (a normal message's, an op record's, past the log's end, or a
            # half retention removed): a stock client's oneway END is never answered, so the decision it carried
            # was lost with only a log line; counted, a producer ending transactions it cannot have is seen. One
            # below the log's first offset is counted apart: retention removed its half (a producer deciding very
            # late, after the dead letter), not an END naming something that was never a half.
            removed = half_offset is not None and self._half_removed(half_offset)
            metrics.refused.labels("end-half-removed" if removed else "end-no-half").inc()
            return
        if reply.event == "commit-after-dead":
            self._commit_after_dead(reply, group, half_offset, dead_letter)
        counter = {"unknown": metrics.unknowns, "duplicate": metrics.duplicates, "conflict": metrics.conflicts,
                   "commit-after-dead": metrics.conflicts}.get(reply.event)
        if counter is not None:
            metrics.child(counter, group).inc()

    def _half_removed(self, half_offset: int) -> bool:
        """``half_offset`` is below the log's first offset: retention removed the segment it was in."""
        return 0 <= half_offset < self.ctx.store.min_physical_offset

    async def _commit_after_removed(self, half_offset: int, group: str, keys: tuple[str, ...],
                                    refused: Reply) -> tuple[int, str]:
        """A COMMIT for a half retention removed (``refused``: no half). Retention dead-letters an undecided half
        before it removes its segment, so its producer committed a message that sits on the dead-letter topic:
        refused as "Find prepared transaction message failed" alone (a stock client's END is oneway, nobody hears
        it), and counted with every END naming an offset below the log, nothing said where the message was. Its
        dead letter, found by the END's ids and matched by the half offset it names, is said as any commit after
        a dead letter is (alert TxmqCommitAfterDeadLetter), with where it is and how to deliver it."""
        found = None

        def warn(fmt, *args) -> None:
            # (any client can send such COMMITs, oneway, at will: one line a 10 s for them all, not one a lookup)
            if self._end_lookup_said.due("lookup"):
                log.warning(fmt + " (said at most every 10 s; such COMMITs are counted in "
                            "txmq_requests_refused_total{reason=\"end-half-removed\"})", *args)
        async with self._end_lookups:
            for key in dict.fromkeys(k for k in keys if k and len(k) <= _KEY_CHARS_MAX):
                found = await self._dead_letter_of(half_offset, key, f"COMMIT of the transaction at {half_offset}",
                                                   "the COMMIT is refused as for no half, its message not found", warn)
                if found is not None:
                    break
        if found is None:
            return refused.code, refused.remark
        phy, dead = found
        reason = parse_dead_letter(dead)[1] or "?"
        where = offset_msg_id(self.ctx.store_host, phy)
        # (the prefix "transaction already " gates the END's own refusal line: one a 10 s, as the other conflicts)
        reply = Reply(ResponseCode.TRANSACTION_FAILED,
                      f"transaction already DEAD (dead-lettered, {reason}) and its half at {half_offset} removed by "
                      f"retention; COMMIT refused: its message is on {DEAD_TOPIC} as {where} (UNIQ_KEY "
                      f"{dead.properties.get(Prop.UNIQ_KEY, '?')}), undelivered; it cannot be resumed (its half is "
                      f"gone): `admin show-msg {where}` shows it; to deliver it, send its body and keys to "
                      f"{dead.properties.get(Prop.REAL_TOPIC, '?')}", "commit-after-dead")
        self._count(reply, group, half_offset, where)
        return reply.code, reply.remark

    def _commit_after_dead(self, reply: Reply, group: str, half_offset: int | None, dead_letter: str = "") -> None:
        """A COMMIT for a dead-lettered transaction: its producer committed, its message sits on the dead-letter
        topic. Said among the conflicts alone (one line a 10 s for all), nobody knew which to resume: counted apart
        (alert TxmqCommitAfterDeadLetter) and said with the resume it needs, once a minute a transaction.
        ``dead_letter``: the dead letter's id when retention removed the half (no resume: named by that id)."""
        metrics = self.ctx.metrics
        metrics.child(metrics.commits_after_dead, group).inc()
        said = self._dead_commit_said
        if said.due(reply.remark):
            log.error("group %s committed a transaction already dead-lettered: %s", group, reply.remark)
        elif half_offset is not None and said.full() and reply.remark not in said.said:
            # Past the lines a minute: named with the others at the minute's end. Dropped, they were counted and
            # named nowhere (a stock client's END comes once), which dead letters to resume known to nobody.
            unsaid = self._dead_commits_unsaid
            if half_offset in unsaid or len(unsaid) < _UNSAID_MAX:
                unsaid[half_offset] = group
                if dead_letter:
                    self._dead_commits_removed[half_offset] = dead_letter
            else:
                self._dead_commits_unsaid_more += 1

    def say_unsaid_dead_commits(self, now: bool = False) -> None:
        """Name in one ERROR the dead-lettered transactions committed past the lines a minute (_commit_after_dead),
        once that minute is over; from the snapshot loop. ``now``: whatever the minute (the stop: the loop is over)."""
        unsaid, more, removed = self._dead_commits_unsaid, self._dead_commits_unsaid_more, self._dead_commits_removed
        if not (unsaid or more) or (self._dead_commit_said.full() and not now):
            return
        self._dead_commits_unsaid, self._dead_commits_unsaid_more, self._dead_commits_removed = {}, 0, {}
        # (one whose half retention removed cannot be resumed -- `admin resume` refuses an offset below the log --:
        # named by its dead letter, which is all that is left of its message)
        log.error("%d more transactions already dead-lettered were committed by their producers (groups %s); each "
                  "is on the dead-letter topic until `admin resume OFFSET` checks it again%s; offsets: %s%s",
                  len(unsaid) + more, ", ".join(sorted(set(unsaid.values()))[:20]),
                  "; one marked removed cannot be resumed (its half was removed by retention): `admin show-msg ID` "
                  "shows its dead letter, send its body and keys to its topic to deliver it" if removed else "",
                  " ".join(f"{off} (removed: dead letter {removed[off]})" if off in removed else str(off)
                           for off in unsaid),
                  f" (and {more} more, not kept: see txmq_transaction_commits_after_dead_letter_total)" if more else "")

    @staticmethod
    async def _answer(deciding) -> tuple[int, str]:
        try:
            return ResponseCode.SUCCESS, await deciding
        except DecisionError as exc:
            return exc.code, exc.remark

    async def decide(self, half_offset: int, op: str, *, group: str | None = None, reason: str | None = None,
                     reclaim: bool = False, origin: Origin = Origin.ADMIN, queue_offset: int | None = None) -> str:
        """Record ``op`` for the transaction; returns a remark, raises DecisionError when refused.

        ``reclaim``: the decision is written to free space (retention), past the disk watermark."""
        while True:
            action = self.core.end(half_offset, op, origin=origin, group=group, queue_offset=queue_offset,
                                   reason=reason)
            if not isinstance(action, Wait):
                break
            await asyncio.shield(self._deciding[half_offset])
        if isinstance(action, Reply):
            if action.event in ("duplicate", "conflict", "commit-after-dead"):
                self._count(action, group or self._group_of(half_offset), half_offset)
            if action.code != ResponseCode.SUCCESS:
                raise DecisionError(action.code, action.remark)
            return action.remark
        return await self._write_decision(action, self._claim(action.tx), reclaim)

    def _group_of(self, half_offset: int) -> str:
        msg = self._half_at(half_offset)
        return msg.properties.get(Prop.PGROUP, "") if msg is not None else ""

    def _claim(self, tx: Tx) -> asyncio.Future:
        """Mark the write of ``tx``'s decision as under way, at once: others wait on this future."""
        fut = self._deciding[tx.half_offset] = asyncio.get_running_loop().create_future()
        return fut

    async def _write_decision(self, action: Write, done: asyncio.Future, reclaim: bool = False) -> str:
        """Write a claimed decision; its remark, or DecisionError.

        Settled by the store's writer when the records are written, not by this coroutine: once queued they
        are written whoever waits, so a caller cancelled meanwhile (a stop cancels the check timer) must not
        settle the decision as refused, leaving it pending with its op record in the log."""
        code, remark = await asyncio.shield(await self._queue_decision(action, done, reclaim))
        if code != ResponseCode.SUCCESS:
            raise DecisionError(code, remark)
        return remark

    async def _queue_decision(self, action: Write, done: asyncio.Future, reclaim: bool = False) -> asyncio.Future:
        """Hand a claimed decision's records to the store's writer; the future of its (code, remark). Returns
        without yielding to the loop unless its queue's file is being made, so decisions queued one after
        another share a group commit."""
        answer = asyncio.get_running_loop().create_future()
        while True:
            try:
                self._put_decision(action, done, answer, reclaim)
                return answer
            except _FileBeingMade as being:
                # Its queue's first file is being made off the loop (a send to it came first): wait for it, as
                # that send does. Refused "try again", a stock client's oneway END was lost until a check.
                try:
                    await self.ctx.store.queue_file(*being.args)
                except OSError:
                    pass                # said by prepare_queue on the next try: refused, the half kept
                except BaseException:
                    self._unclaim(action.tx, done, False)
                    raise

    def _put_decision(self, action: Write, done: asyncio.Future, answer: asyncio.Future, reclaim: bool = False) -> None:
        """Queue a claimed decision's records, ``answer`` settled with (code, remark) once written. If they
        cannot be queued it is settled as not written here: left claimed, every later decision Waited for ever."""
        floor, reqs = self._decision_begin(action, done)
        # The committed message's body is the half's: its length (a metric) read here, not the half again.
        size = record_body_length(reqs[0].record) if action.op == COMMIT else 0
        written = _DecisionWritten(self, action, floor, done, answer, size)
        try:
            self.ctx.store.put_many(reqs, reclaim, then=written)
        except BaseException:
            if not written.done():
                self._decision_settled(action.tx, floor, done, False)
            raise

    def _decision_begin(self, action: Write, done: asyncio.Future) -> tuple[int, list]:
        """(op-queue floor held, records to write) for a claimed decision; if the records cannot be made,
        the decision is settled as not written and the DecisionError raised."""
        floor = self.ctx.store.max_offset(OP_TOPIC, 0)
        self.writing_ops.append(floor)
        try:
            reqs = self._decision_records(action.tx, action.op, action.reason)
            # A new queue's file first (the committed message's topic may have none yet): past the open-files
            # limit the decision is refused and the half stays pending, where its commit was acknowledged and
            # its message left unreadable, waiting in memory for a descriptor.
            store = self.ctx.store
            ready = store.queue_index       # a queue there is (every commit but a queue's first): one set lookup
            for req in reqs:
                if (req.topic, req.queue_id) not in ready:
                    if store.making_queue_file(req.topic, req.queue_id):
                        raise _FileBeingMade(req.topic, req.queue_id)
                    store.prepare_queue(req.topic, req.queue_id)
            return floor, reqs
        except _FileBeingMade:
            self.writing_ops.remove(floor)      # still claimed: written once the file is there (_write_decision)
            raise
        except OSError as exc:
            self._decision_settled(action.tx, floor, done, False)
            if self.ctx.store.stopped_by(exc):
                # the store stopped (its file system read-only): refused as a send then is, the half kept
                # undecided (checked again after the repair and a restart); not the open-files limit's answer
                why = self.ctx.store.refusal(f"consume queue of transaction {action.tx.uniq_key}: {exc}")
                raise DecisionError(ResponseCode.SERVICE_NOT_AVAILABLE,
                                    f"store refused the decision: SERVICE_NOT_AVAILABLE ({why})") from exc
            why = f"create mapped file failed, server is busy or broken: {exc}"
            self.ctx.limits.refused("queue-file-failed", f"transaction {action.tx.uniq_key} not decided: {why}")
            raise DecisionError(ResponseCode.SYSTEM_ERROR, why) from exc
        except BaseException:
            self._decision_settled(action.tx, floor, done, False)
            raise

    def _decision_settled(self, tx: Tx, floor: int, done: asyncio.Future, ok: bool) -> None:
        self.writing_ops.remove(floor)
        self._unclaim(tx, done, ok)

    def _unclaim(self, tx: Tx, done: asyncio.Future, ok: bool) -> None:
        """End a claim (``_claim``): the decision was written (``ok``) or not; whoever waits on it goes on."""
        self.core.written(tx, ok)
        del self._deciding[tx.half_offset]
        done.set_result(None)

    def _decision_end(self, action: Write, floor: int, done: asyncio.Future, results: list, size: int = 0) -> str:
        """The store's results for a decision's records: settle it, count it (``size``: a committed message's
        body bytes); its remark, or DecisionError."""
        tx, op, reason = action.tx, action.op, action.reason
        metrics = self.ctx.metrics
        failed = [r for r in results if not r.ok]
        try:
            if not failed:
                self.record(tx.queue_offset, op)
        finally:
            self._decision_settled(tx, floor, done, not failed)
        if failed:
            raise DecisionError(response_code(failed[0]), f"store refused the decision: {failed[0].status.name}")
        # by the schedule's (monotonic) clock, as the oldest-half gauge: by the wall clock, a step forward of an
        # hour while a local transaction ran observed its commit a second later as an hour (a p99 alert), back as 0
        took_ms = self.ctx.monotonic() - tx.stored_at
        if op == COMMIT:
            metrics.child(metrics.commits, tx.group).inc()
            metrics.count_in(tx.topic, 1, size)
            if tx.requeued:
                self._say_requeued(tx)
        elif op == ROLLBACK:
            metrics.child(metrics.rollbacks, tx.group).inc()
        else:
            metrics.child(metrics.dead_letters, tx.group, reason or "").inc()
            together = self._said_together.get(tx.half_offset)
            if together is not None and together.reason == reason:     # (not a check pass's max-checks, racing)
                together.add(tx)
            else:
                _say_dead_letter(tx, reason)
        metrics.child(metrics.finish_latency, tx.group).observe(max(0, took_ms) / 1000)
        return op

    def _say_requeued(self, tx: Tx) -> None:
        """Count a committed message written to another queue than its half's (see _decision_records); say it at
        WARNING the first time for its topic and queue count (a topic's every commit then is not a line each)."""
        metrics = self.ctx.metrics
        metrics.child(metrics.requeued, tx.topic).inc()
        if not self._requeue_said.due(f"{tx.topic}\0{tx.requeued}"):
            return
        log.warning("transaction %s (group %s): committed for %s queue %d, past the %d it reads now (its queues were "
                    "cut since the half was sent): written to queue %d instead; later ones of %s are counted in "
                    "txmq_requeued_total", tx.uniq_key, tx.group, tx.topic, tx.real_qid, tx.requeued,
                    tx.real_qid % tx.requeued, tx.topic)

    def _decision_records(self, p: Tx, op: str, reason: str | None):
        rf = self.records
        if op == ROLLBACK:
            return [rf.decision(ROLLBACK, p.half_offset, p.queue_offset)]
        try:
            view = self.ctx.store.verified_record(p.half_offset, "commit" if op == COMMIT else "dead letter")
        except CorruptRecordError as exc:
            # Its body was damaged on disk after it was stored. Copied, the damage would be re-encoded on the real
            # topic (or the dead-letter topic) under a valid CRC and pass for the producer's message. A COMMIT is
            # refused (it stays pending: checked, then dead-lettered); a dead letter is the op record alone, the
            # damaged half staying where it is for whoever inspects it.
            if op == COMMIT:
                raise DecisionError(ResponseCode.SYSTEM_ERROR, f"not committed: {exc}") from None
            return [rf.decision(DEAD, p.half_offset, p.queue_offset, f"{reason or 'unknown'}; the half is corrupt "
                                "(body CRC), no dead letter copied")]
        if view is None:
            raise DecisionError(ResponseCode.SYSTEM_ERROR, "Find prepared transaction message failed")
        if op == COMMIT:
            real = None
            if p.delayed and self.ctx.schedule is not None:     # RocketMQ delays COMMIT messages too
                half = decode_record(view)[0]
                half.properties.pop(P_OWNER, None)      # the broker's mark on the half (records.committed)
                real = self.ctx.schedule.delayed_commit(half, p.topic, p.real_qid, p.half_offset)
            if real is None:
                # its topic's queues cut since the half (updateTopic -r 4 -w 4 on 8): into one it reads, as a
                # delayed one is when due (schedule), not REAL_QID where no consumer reads it (as 4.9.8 does)
                qid, p.requeued = readable_queue(self.ctx.topics.topics, p.topic, p.real_qid)
                real = rf.committed(view, p.half_offset, p.topic, qid, p.tags_code)
            return [self.ctx.store.copying(p.half_offset, real), rf.decision(COMMIT, p.half_offset, p.queue_offset)]
        half, _ = decode_record(view)
        try:
            dead = rf.dead_letter(half, p.half_offset, reason or "unknown", p.checks, p.owner_id)
        except RecordError as exc:
            # The half's properties leave no room for the dead letter's own (TXMQ_REASON, TXMQ_HALF, the check
            # count): raising, it was retried every interval and never dead-lettered, and an expiry raised out of
            # retention's pass. The op record alone, as for a corrupt half; the half stays for whoever inspects it.
            log.warning("transaction %s (half %d): no dead letter copied: %s", p.uniq_key, p.half_offset, exc)
            return [rf.decision(DEAD, p.half_offset, p.queue_offset, f"{reason or 'unknown'}; no dead letter "
                                f"copied: {exc}")]
        return [self.ctx.store.copying(p.half_offset, dead), rf.decision(DEAD, p.half_offset, p.queue_offset, reason)]

    # --------------------------------------------------------------- checks
    def _channel_for(self, tx: Tx):
        """The producer that sent the half first, else one of its group, in turn, that has room for another
        check (fewer than ``transaction_check_in_flight_max`` of the group unanswered, reading what is sent to it, and
        this slice's checks to it under a quarter of ``max_write_buffer``); None if no producer of the group
        is here, BUSY if none has room. A check that goes to another producer than the sender says why in
        ``tx.rerouted`` (counted once sent: txmq_transaction_checks_rerouted_total).

        A sender at its cap of checks in flight (or not reading) is passed over for another producer of the
        group with room, not waited for: liveness over affinity. A sender with 2000 checks unanswered, hung or
        slow, must not hold up the group's other transactions while producers that could answer them are idle;
        each check asks the sender first again, so they come back to it as it has room."""
        if self._slice_released != self.core.released:
            # A slot was given back since (in this slice: a transaction due again frees its unanswered check's
            # slot before it is placed): a group noted full may have room. Parked on that word, the transaction
            # due again was parked beside its own free slot, its producer idle until the next pass.
            self._slice_full.clear()
            self._slice_released = self.core.released
        full = self._slice_full.get(tx.group)
        gone = tx.group in self._slice_gone
        if full is not None or gone:
            # What an earlier transaction of the group found in this slice holds for every one whose sender
            # is not connected (it is then asked of one of the group's producers): nothing in a slice registers
            # a producer, and a slot it frees clears what was noted full (above). 100,000 due transactions of a group whose producer is hung or
            # gone were otherwise each looked up again, and another group's due check waited behind them.
            owner = owner_of(tx)
            if owner is None or not getattr(owner, "is_open", False):
                return BUSY if full is not None else None
            if full is not None and owner in full:
                return BUSY             # its sender too is one of those connections, none of which has a slot
        channels = self._slice_channels.get(tx.group)
        if channels is None:
            channels = self._slice_channels[tx.group] = self.ctx.clients.producer_channels(tx.group)
        owner, why = self._sender(tx, channels)
        if owner is None and not channels:
            self._slice_gone.add(tx.group)
            return None                 # (before the half is read for its size: nobody to ask costs nothing)
        size = self._check_size(tx)
        silent = self.core.unanswered_checks
        # A sender known silent (a check of another of its transactions came due unanswered, none answered since)
        # is asked first no more than one whose own check went unanswered: asked first, each new transaction of a
        # hung sender waited a doubled interval before a producer that answers was asked. It answers, or comes
        # back on a new connection, and it is asked first again.
        if owner is not None and ((not tx.unanswered and not silent(owner, tx.group)) or not channels):
            if self._has_room(owner, tx.group, size):
                return self._take_sender(tx, owner, channels, size)
            why = "sender-busy"
        elif owner is not None:
            why = "sender-unanswered" if tx.unanswered else "sender-silent"
        if not channels:
            return None                 # its sender has no room and no other is registered: after an interval
        # Producers that answer first, in turn; one that left its last checks unanswered (hung, its connection
        # open) only when none of them has room: asked in turn with the others, each check it took waited a
        # (doubled) interval before another producer was asked.
        for hushed in (False, True):
            if hushed and why == "sender-silent" and self._has_room(owner, tx.group, size):
                # Every producer with room is silent too: its sender first, as when it answered (the one that
                # knows the transaction, should it answer). In turn with the others, another hung instance was
                # asked about a transaction it never began.
                return self._take_sender(tx, owner, channels, size)
            for _ in range(len(channels)):
                self._rr += 1
                conn = channels[self._rr % len(channels)].conn
                if bool(silent(conn, tx.group)) is hushed and self._has_room(conn, tx.group, size):
                    return self._take(tx, conn, size, "" if conn is owner else why)
        if not self._full(tx.group, channels):
            self._slice_short.add(tx.group)
        return BUSY

    def _take_sender(self, tx: Tx, owner, channels, size: int):
        """``tx``'s check given to its sender ``owner`` (_channel_for)."""
        if owner is not owner_of(tx):   # a claimant of its sender's id: the next check asks the next one
            tx.asked_seq = next(ch.seq for ch in channels if ch.conn is owner)
        return self._take(tx, owner, size, "")

    def _full(self, group: str, channels) -> bool:
        """Note ``group`` full for the rest of the slice when none of its producers has a check slot (each at its
        cap of unanswered checks, or not reading): the slice parks the group's other due transactions without
        asking again for each, until a check slot is given back (core.released: a transaction due again frees
        its unanswered check's slot in the slice itself; answers come between slices). A group with
        100,000 due checks and a hung producer took a whole second of passes to park, one by one, while the
        due check of another group waited behind them. Not when only this slice's byte budget was short: a
        smaller check may still fit (False: the group has room in the next slice, which nothing will say)."""
        conns = [ch.conn for ch in channels]
        in_flight, cap = self.core.in_flight, self.check_cap
        if all(in_flight(conn, group) >= cap or getattr(conn, "writing_paused", False) for conn in conns):
            self._slice_full[group] = frozenset(conns)
            return True
        return False

    def _sender(self, tx: Tx, channels) -> tuple[object, str]:
        """(the connection of the producer that sent ``tx``'s half, ""), if it may be asked first; else (None,
        why not: sender-gone, sender-unknown, sender-left).

        The sender is found by its client id when it reconnected (a new connection, the same instance: the
        one that knows its local transaction), after a broker restart too (the snapshot keeps its client id).
        It is not asked first again once a check went unanswered (see _channel_for): a sender hung with its
        connection open would otherwise get every check until the transaction is dead-lettered, while the
        group's other producers could answer. Nor is it asked once it unregistered the group
        (UNREGISTER_CLIENT) on a connection that stays open: as RocketMQ's ProducerManager, only producers still
        in the group are asked (a Java client ignores a check for a group it has left, and the transaction was
        checked to its limit and dead-lettered while another producer was never asked).

        A client id is only what a heartbeat says: several live producers may give the sender's (instances
        sharing an address and an instance name, containers whose process id is 1, or a hostile one). Which of
        them sent the half is then not known, so each check asks the next of them in turn, and the one found is
        not kept as the sender: the first to register took every check, and one that answered UNKNOWN (it never
        began the transaction) had it checked to its limit and dead-lettered while the instance that did, back
        on a new connection, was never asked. The newest of them is asked first (the sender, back on a new
        connection, registered last), then the others from the oldest, each once a round (``tx.asked_seq``,
        their order of registration, so one joining or leaving meanwhile skips nobody): asked from the oldest
        at ``checks % claimants``, those registered first took every check left and the transaction was
        dead-lettered before the sender's turn came."""
        owner = owner_of(tx)
        if owner is None or not getattr(owner, "is_open", False):
            owner_id = sender_id(tx)
            claimant = _claimant(tx, channels, owner_id) if owner_id else None
            if claimant is None:
                return None, "sender-gone" if owner_id else "sender-unknown"
            owner = claimant.conn
        if self.ctx.clients.left_group(owner, tx.group):
            return None, "sender-left"
        return owner, ""

    def _check_size(self, tx: Tx) -> int:
        view = self.ctx.store.get_record(tx.half_offset)
        return 0 if view is None else len(view)

    def _take(self, tx: Tx, conn, size: int, rerouted: str):
        self._slice_bytes[conn] = self._slice_bytes.get(conn, 0) + size
        tx.rerouted = rerouted
        return conn

    def _has_room(self, conn, group: str, size: int = 0) -> bool:
        # A producer that stopped reading would have the checks pile up unread until the unread-reply cap closes
        # it: every one of them spent, none answered. Nor may one slice queue more than the cap allows: 256
        # checks of 1 MB messages (196 MB) had a producer that reads closed at once, every check lost.
        if self.core.in_flight(conn, group) >= self.check_cap or getattr(conn, "writing_paused", False):
            return False
        queued = self._slice_bytes.get(conn, 0) + getattr(conn, "unsent_bytes", 0)
        return queued == 0 or queued + size <= self._check_bytes

    def _room_for(self, group: str) -> int | None:
        """Checks the group's producers can take now (see _channel_for); None when none of them is here (its
        parked transactions are then deferred as any due one with nobody to ask, or asked of their sender)."""
        channels = self.ctx.clients.producer_channels(group)
        if not channels:
            return None
        in_flight = self.core.in_flight
        return sum(max(0, self.check_cap - in_flight(ch.conn, group))
                   for ch in channels if not getattr(ch.conn, "writing_paused", False))

    def producer_joined(self, group: str) -> None:
        """A producer of ``group`` registered on a connection (ClientRegistry.on_new_producer): what was deferred
        for want of one is checked now, not an interval later (after a restart, or once the group's producers
        all reconnected, transactions in doubt waited up to a whole --transaction-check-interval-ms)."""
        self._nobody_since.pop(group, None)
        if self.core.producer_joined(group, self.ctx.monotonic()):
            self.timer.wake()

    def next_due(self) -> int | None:
        return self.core.next_due()

    def oldest_by_group(self) -> dict[str, int]:
        """{producer group: store time (ms) of its oldest undecided half}, for the age gauge."""
        return self.core.oldest_by_group()

    # Due entries taken per slice of a check pass: the pass yields to the event loop between slices, so 50000
    # transactions due at once (a restart after the producers died) do not hold every request for seconds.
    CHECK_SLICE = 256

    async def run_due(self, now: int) -> None:
        room_for, started = self._room_for, now
        self._refused = [0, ""]             # check records the store refused this pass: said once, at its end
        # The pass's max-check dead letters, said in one WARNING at its end (as retention's): a line each, a burst
        # of 100,000 halves whose producers all crashed reaching the limit together was 100,000 lines.
        said = _SaidTogether(_MAX_CHECKS)
        self._dead_refused = []     # said once, at its end, as the check records: a line each was a burst's every one
        self._nobody_asked: set[str] = set()    # groups of this pass's deferred whose line was considered
        try:
            while True:
                await self._run_slice(now, room_for, said)
                # Parked ones come back once a pass, with the room there is then, and in a long pass at each offer to
                # every group (once a second): offered room in a pass's first slice alone, they waited for the whole
                # of a pass over another group's backlog (up to a check interval), not the second said. Not at every
                # slice: a group short of a slice's bytes alone would be unparked and parked again at each of them.
                # Each slice by the clock of its own start: a check that came due during a long pass (another group's
                # backlog) is taken in its group's turn in the next slice, not after the whole pass. Woken meanwhile
                # (a slot freed, a producer joined, a check lost), or an interval long, the pass ends: the next one
                # starts at once and gives parked transactions the room there is now.
                now = max(now, self.ctx.monotonic())
                room_for = self._room_for if self.core.offer_all_due(now) else None
                due = self.core.next_due()
                if (due is None or due > now or self.timer.woken()
                        or now - started >= self.core.policy.check_interval_ms):
                    break
                await asyncio.sleep(0)
        finally:
            refused, why = self._refused
            if refused:     # a full disk: no check goes out unrecorded, and the transactions wait (said, per pass)
                log.warning("%d transaction checks not sent: their check records were refused (%s); checked again "
                            "an interval on", refused, why)
            if said.n:      # (a pass a transaction at one in flight, dead-lettering none: no calls for nothing)
                said.say()
            if self._dead_refused:
                self._say_dead_refused()
        self._save_progress()

    async def _run_slice(self, now: int, room_for, said: _SaidTogether) -> None:
        self._slice_bytes = {}      # written out (or the connection paused) by the time the next slice runs
        self._slice_full = {}       # answers may have come back by then too, and producers joined
        self._slice_gone = set()
        self._slice_channels = {}
        self._slice_short = set()
        actions, deferred = self.core.due(now, self._channel_for, room_for, limit=self.CHECK_SLICE)
        for group in self._slice_short:     # the next slice's bytes are its room: offered it at the next pass
            self.core.room_changed(group)
        if self.core.newly_silent:
            self._say_silent()
        if deferred:        # (most slices defer nothing: no Counter built for them, one a transaction at one in flight)
            metrics = self.ctx.metrics
            asked = self._nobody_asked
            for group, n in collections.Counter(tx.group for tx in deferred).items():
                metrics.child(metrics.checks_skipped, group).inc(n)
                if group not in asked:      # once a pass (a slice each, 1000 groups' 20,000: 5% of the pass)
                    asked.add(group)
                    self._say_nobody(group, now)
        # due() took every one of these off the schedule and claimed the dead letters (the core marked them
        # DECIDING; a decision arriving meanwhile, a producer's END_TRANSACTION included, waits on the claim).
        # Each must be put back or settled whatever goes wrong below, or it is never checked again and a
        # decision on it waits forever (the timer logs and counts a raising pass and goes on).
        checks = [a for a in actions if isinstance(a, SendCheck)]
        deaths = [(a, self._claim(a.tx)) for a in actions if isinstance(a, Write)]
        together = self._said_together
        if deaths:
            together.update((a.tx.half_offset, said) for a, _ in deaths if a.reason == said.reason)
        try:
            if checks:
                await self._send_checks(checks, now)       # a failed write reschedules them (below)
            while deaths:
                # DEAD_LETTER_BATCH queued before any is waited for: they share a group commit (one waited for
                # after another, a burst reaching the check limit together was a sync flush per transaction).
                queued, size = [], 0
                while deaths and len(queued) < DEAD_LETTER_BATCH and size < DEAD_LETTER_BATCH_BYTES:
                    action, claim = deaths.pop(0)
                    size += self._half_size(action.tx.half_offset)
                    try:
                        queued.append((action, await self._queue_decision(action, claim)))   # settles its claim
                    except Exception as exc:  # noqa: BLE001 - e.g. a corrupt half: the others still go
                        self._dead_letter_failed(action.tx, now, exc)
                for action, answer in queued:
                    code, remark = await asyncio.shield(answer)
                    if code != ResponseCode.SUCCESS:
                        self._dead_letter_failed(action.tx, now, DecisionError(code, remark))
        finally:
            for action, claim in deaths:    # not attempted (the checks raised, or a stop): undecided again
                self._unclaim(action.tx, claim, False)
                self.core.dead_letter_failed(action.tx, now)
            for action in actions:
                if isinstance(action, Write) and together.get(action.tx.half_offset) is said:
                    del together[action.tx.half_offset]

    def _say_nobody(self, group: str, now: int) -> None:
        """Due transactions of ``group`` were deferred, none of its producers here: said every 10 minutes a group once
        nobody was there for an interval (a metric alone, a broker without Prometheus said nothing for days)."""
        since, interval = self._nobody_since, self.policy.check_interval_ms
        first = since.get(group)
        if first is None:
            # (group names are the halves': a client's to choose.) Cleared when full, one group more than it holds
            # deferred every pass cleared it at each pass and no group was ever said: the groups with nothing
            # deferred any more go (once an interval at most: a scan of the table), and a group there is still no
            # room for is said without the interval's grace (the 20 a window bound the lines).
            if len(since) >= _SILENT_KEYS_MAX and now - self._nobody_pruned >= interval:
                self._nobody_pruned = now
                for gone in [g for g in since if not self.core.deferred_in(g)]:
                    del since[gone]
            if len(since) < _SILENT_KEYS_MAX:
                since[group] = first = now
        if (first is None or first <= now - interval) and self._nobody_said.due(group):
            log.warning("%d undecided transactions of producer group %s came due for a check and no producer "
                        "of the group is connected: nobody can decide them. They wait, no check spent, and are "
                        "checked as soon as a producer of the group registers; else retention dead-letters "
                        "them as expired. Start a producer of the group, or decide them by hand (`python -m "
                        "broker admin list --group %s`, then `admin commit|rollback OFFSET`). Said every 10 "
                        "minutes a group (txmq_transaction_checks_deferred_total counts each deferral).",
                        self.core.deferred_in(group), group, group)

    def _half_size(self, half_offset: int) -> int:
        """The bytes of the half at ``half_offset`` (its dead letter's, near enough); 0 if none is there."""
        record = self.ctx.store.get_record(half_offset)
        return len(record) if record is not None else 0

    def _dead_letter_failed(self, tx: Tx, now: int, exc: Exception) -> None:
        """A max-checks dead letter not written: said, and the transaction retried an interval on (DecisionError:
        refused, said with the pass's others at its end: a line each, a full disk refusing a burst's 100,000 was
        100,000 ERROR lines at every interval)."""
        if isinstance(exc, DecisionError):
            self._dead_refused.append((tx, exc.remark))
        else:
            log.error("could not dead-letter %d", tx.half_offset, exc_info=exc)
        self.core.dead_letter_failed(tx, now)

    def _say_dead_refused(self) -> None:
        """One ERROR a reason (the first one's for all: a half gone from the log said among a full disk's refusals
        was said as refused by the store, or they all as the missing half), for the SAMPLE commonest; the rest in
        one more (a reason may name its transaction: a store stopped read-only refuses each with its uniq key)."""
        by_reason: dict[str, list[Tx]] = {}
        for tx, why in self._dead_refused:
            by_reason.setdefault(why, []).append(tx)
        self._dead_refused = []
        reasons = sorted(by_reason.items(), key=lambda item: -len(item[1]))
        rest = reasons[_SaidTogether.SAMPLE:]
        if rest:
            log.error("%d more transactions at the check limit not dead-lettered for %d other reasons (first: %s); "
                      "tried again an interval on", sum(len(txs) for _, txs in rest), len(rest), rest[0][0])
        for why, refused in reasons[:_SaidTogether.SAMPLE]:
            first = refused[:_SaidTogether.SAMPLE]
            more = len(refused) - len(first)
            log.error("%d transactions at the check limit not dead-lettered: %s (groups %s): %s%s; tried again an "
                      "interval on (see the store's disk alerts: a full disk is freed by retention or more room)",
                      len(refused), why, _some({tx.group for tx in refused}),
                      "; ".join(f"{tx.uniq_key} (half {tx.half_offset})" for tx in first),
                      f"; and {more} more" if more else "")

    async def _send_checks(self, batch: list[SendCheck], now: int) -> None:
        sound, damaged = [], []
        for action in batch:
            try:
                self.ctx.store.verified_record(action.tx.half_offset, "transaction check")
                sound.append(action)
            except CorruptRecordError:
                damaged.append(action.tx)
                self.core.check_written(action.tx, now, False)     # back on the schedule, no check spent
        if sound:
            await self._write_and_send_checks(sound, now)
        for tx in damaged:
            await self._dead_letter_damaged(tx)

    async def _dead_letter_damaged(self, tx: Tx) -> None:
        """A check carries the half's body to the producer, which decides on it: a half whose body no longer
        matches its CRC (damaged on disk after it was stored; start-up verifies only the newest segments) is
        never sent as if it were the message the producer sent (the store counted and logged it). It is
        dead-lettered (the op record alone: see _decision_records) with its reason, counted in
        txmq_transaction_dead_letters_total{reason="corrupt-half"}; a refused write leaves it due again."""
        log.error("transaction %s (group %s, topic %s, half %d) not checked: its half is corrupt; dead-lettering it",
                  tx.uniq_key, tx.group, tx.topic, tx.half_offset)
        try:
            await self.decide(tx.half_offset, DEAD, reason=CORRUPT_HALF, origin=Origin.DAMAGE)
        except DecisionError as err:        # decided meanwhile, or the store refused: said, and due again
            log.error("transaction at %d (damaged half) not dead-lettered: %s", tx.half_offset, err.remark)
        except Exception:  # noqa: BLE001 - the other transactions of the pass go on
            log.exception("transaction at %d (damaged half) not dead-lettered", tx.half_offset)

    async def _write_and_send_checks(self, batch: list[SendCheck], now: int) -> None:
        rf = self.records
        try:
            await self._op_queue_file()     # (a new broker whose first transactions were never decided)
            results = await self.ctx.store.put_many([
                rf.check(a.tx.half_offset, a.tx.queue_offset, a.tx.checks, sender_id(a.tx)) for a in batch])
        except OSError as exc:      # the op queue's file: as a refusal (said once a pass), checked again later
            results = [None] * len(batch)
            self._refused[0] += len(batch)
            self._refused[1] = self._refused[1] or f"op queue file: {exc}"
        except Exception:  # noqa: BLE001 - as a refusal: rescheduled below, the attempt not counted
            log.exception("check records of %d transactions not written", len(batch))
            results = [None] * len(batch)
        refused = [r for r in results if r is not None and not r.ok]
        if refused:     # said by run_due, once a pass (per slice of 256 was 200 lines a pass for 50000 waiting)
            self._refused[0] += len(refused)
            self._refused[1] = self._refused[1] or refused[0].remark or refused[0].status.name
        self.changed = True
        not_sent: dict[str, list[str]] = {}     # why -> the keys of the checks it kept from going out
        wall = self.ctx.clock()
        for action, result in zip(batch, results):
            tx = action.tx
            if not self.core.check_written(tx, now, result is not None and result.ok):
                continue
            tx.checked_at = wall            # (the snapshot keeps it: a restart's next check is an interval on)
            if self.ctx.clients.left_group(action.channel, tx.group):
                # Its producer unregistered the group while the record was written (producer_left gave the slot
                # back): sent, the check went to one that drops it, on an open connection, and waited an interval.
                # Not sent, as on a closed connection: asked again of the group at once.
                if self.core.check_not_sent(tx, self.ctx.monotonic()):
                    self._checks_lost([tx])
                continue
            try:
                action.channel.oneway(self._check_command(tx))
            except Exception as exc:  # noqa: BLE001 - a dead channel: the next pass picks another
                not_sent.setdefault(str(exc), []).append(tx.uniq_key)
                closed = not getattr(action.channel, "is_open", False)
                if self.core.check_not_sent(tx, self.ctx.monotonic() if closed else None):
                    self._checks_lost([tx])
                continue
            self.core.check_sent(tx)
            metrics = self.ctx.metrics
            metrics.child(metrics.checks_sent, tx.group).inc()
            if tx.rerouted:
                metrics.child(metrics.checks_rerouted, tx.group, tx.rerouted).inc()
        _say_not_sent(not_sent)

    def connection_closed(self, conn) -> None:
        """A client connection closed (server.py): the checks sent on it and not answered are asked again of a
        live producer at once, not after a whole check interval (core.channel_closed). The halves it sent
        unnamed stay so (their sender is known by its address only)."""
        self._unnamed.pop(conn, None)
        for group in self.ctx.clients.producer_groups_of(conn):     # (still registered: server.py closes them next)
            self.core.room_changed(group)       # its last producer gone: its parked ones are deferred at the next pass
        for done in self._unnamed_storing.pop(conn, {}).values():
            if not done.done():
                done.set_result(None)
        self._checks_lost(self.core.channel_closed(conn, self.ctx.monotonic()))

    def producer_left(self, conn, groups: str | frozenset) -> None:
        """``conn`` unregistered its producer of ``groups`` (processors/client.py: one) or was dropped from them for
        silence (ClientRegistry.on_producer_left: a set) and stays open: the groups' checks it holds are asked
        again of another producer at once, as a closed connection's (core.producer_left)."""
        self._checks_lost(self.core.producer_left(conn, groups, self.ctx.monotonic()))

    def _say_silent(self) -> None:
        """Name the producers that left a check unanswered (hung listener, stuck local transaction) since they last
        answered one: they are asked only when no other producer of the group has room, so nothing else would say
        one is stuck. Once a producer, until it answers again (or reconnects)."""
        silent, self.core.newly_silent = self.core.newly_silent, []
        metrics = self.ctx.metrics
        for conn, group in silent:
            if self.core.unanswered_checks(conn, group) == 0:
                continue                # answered (or gone) since
            # (the heartbeat's name of the connection: the group's producers looked through for each, 1,000 hung at
            # once held the event loop ~0.1 s a check slice)
            client_id = getattr(conn, "attributes", {}).get("client_id") or "?"
            host, port = getattr(conn, "peer", ("?", 0))[:2]
            metrics.child(metrics.producers_silent, group).inc()
            key = f"{group}\0{client_id}"
            unsaid = self._silent_unsaid
            if not self._silent_said.due(key):
                if key in unsaid or len(unsaid) < _SILENT_KEYS_MAX:
                    unsaid[key] = unsaid.get(key, 0) + 1
                continue
            more = unsaid.pop(key, 0)
            log.warning("producer %s at %s:%s of group %s left a transaction check unanswered%s: it is asked only "
                        "when no other producer of the group has room, until it answers one. Look at that instance's "
                        "transaction listener (hung or slower than the check interval checkLocalTransaction, thread "
                        "pool full).", client_id, host, port, group,
                        f" ({more} more times since it was last named, a minute ago or more: it answers late)"
                        if more else "")

    def _checks_lost(self, lost: list[Tx]) -> None:
        if not lost:
            return
        metrics = self.ctx.metrics
        for tx in lost:
            metrics.child(metrics.checks_lost, tx.group).inc()
        self.timer.wake()

    def _check_command(self, tx: Tx) -> RemotingCommand:
        view = self.ctx.store.get_record(tx.half_offset)
        msg, _ = decode_record(view)
        msg.properties.pop(P_OWNER, None)       # the broker's mark: the producer is shown the message it sent
        msg.topic = msg.properties.get(Prop.REAL_TOPIC, msg.topic)
        msg.queue_id = int(msg.properties.get(Prop.REAL_QID, "0") or 0)
        return RemotingCommand.request(RequestCode.CHECK_TRANSACTION_STATE, {
            "tranStateTableOffset": tx.queue_offset, "commitLogOffset": tx.half_offset, "msgId": tx.uniq_key,
            "transactionId": tx.uniq_key, "offsetMsgId": offset_msg_id(self.ctx.store_host, tx.half_offset),
        }, _with_check_count(msg, tx.checks), language=LanguageCode.JAVA)

    # ---------------------------------------------------------------- admin
    def describe(self, group: str | None = None, limit: int = 1000, txs: list[Tx] | None = None) -> list[dict]:
        """The admin list's rows: of ``txs``, or of the ``limit`` oldest stored (of ``group``)."""
        # age by the schedule's (monotonic) clock, as next_check_in_ms and the oldest-half gauge: by the wall
        # clock, a step back of an hour listed a half just sent as -3,600,000 ms old, a step forward an hour old
        ticks = self.ctx.monotonic()
        rows = []
        for p in self.core.oldest(group or None, limit) if txs is None else txs:
            # As a check would find it: a sender reconnected (after a restart too) is here, not "gone".
            conn, why = self._sender(p, self.ctx.clients.producer_channels(p.group))
            rows.append({"commit_log_offset": p.half_offset, "queue_offset": p.queue_offset, "group": p.group,
                         "topic": p.topic, "uniq_key": p.uniq_key, "age_ms": ticks - p.stored_at,
                         "checks": p.checks, "owner": sender_id(p) + ("" if conn is not None else " (left the group)"
                                                                      if why == "sender-left" else " (gone)"),
                         "last_answer": p.last_answer or "-", "next_check_in_ms": max(0, p.next_check - ticks)})
        return rows

    async def resume(self, half_offset: int, owner: str | None = None) -> str:
        """Make the dead-lettered transaction whose half is at ``half_offset`` pending again. ``owner``: the
        sender its dead letter names, when the caller holds the dead letter (a stock admin's 323 names it):
        taken as it is, not looked up again through the message index (off, or behind, it lost the sender);
        none or not a sender's name, looked up as for 903."""
        msg = self._half_at(half_offset)
        if msg is None and 0 <= half_offset < self.ctx.store.min_physical_offset:
            # Retention removed its segment (it dead-lettered the half first, as expired, if undecided): the dead
            # letter is all that is left, and nothing can be checked again. "(unknown)" said the broker had no idea.
            raise DecisionError(ResponseCode.SYSTEM_ERROR, f"transaction at {half_offset} can not be checked again: "
                                "its half was removed with its commit-log segment (the log starts at "
                                f"{self.ctx.store.min_physical_offset}); its dead letter keeps the message")
        if msg is None:
            raise DecisionError(ResponseCode.SYSTEM_ERROR, f"transaction at {half_offset} is not dead-lettered "
                                "(unknown): no half message is stored there")
        # its store time as the start reads it into the pending index: a bit flipped at rest (outside the CRC), taken
        # as read, aged the resumed half 74.6 h (bit 28) and the next plan dead-lettered it again, unchecked
        restamp_half(self.ctx.store, msg, self.ctx.clock())
        if not owner or not plain_owner(owner):      # none in hand (903), or its dead letter had no room for it
            owner = await self._dead_letter_sender(msg)
        # Asked of a dead-lettered one only (anything else is refused as what it is, by core.resume below).
        retention = self.ctx.retention
        # Said, not refused: checked at once (its half is long past the transaction timeout), a producer that is
        # back decides it before any plan or cleaning pass comes; refused, every such resume was left to be
        # decided by hand from its dead letter.
        expiring = (await retention.undoes_resume(half_offset, msg.store_timestamp)
                    if retention is not None and self.core.decided(half_offset) == DEAD else None)
        # (checked after the lookup's await: from here to core.resume nothing yields)
        if self.removing is not None and self.removing[0] <= half_offset < self.removing[1]:
            raise DecisionError(ResponseCode.SYSTEM_ERROR, f"transaction at {half_offset} not resumed: retention is "
                                "removing the commit-log segment its half is in; its dead letter keeps the message")
        tx = tx_from_half(msg, owner_id=owner)
        why = self.core.resume(tx, self.ctx.monotonic(), self.stored_at(tx.store_ts))   # (a second is refused)
        if why is not None:
            raise DecisionError(ResponseCode.SYSTEM_ERROR, why)
        result = await self.ctx.store.put(self.records.decision(RESUME, half_offset, msg.queue_offset,
                                                                owner=sender_id(tx)))
        if not result.ok:
            self.core.withdraw(half_offset)
            raise DecisionError(response_code(result), f"store refused: {result.status.name}")
        # A decision taken once it was pending again (an END, a check answer) may have been written in the
        # writer's same cycle, and recorded before this coroutine went on: it left the index, and its byte
        # must stay, or the table says undecided of a transaction nobody checks any more.
        if self.pending.get(half_offset) is tx:
            self.record(msg.queue_offset, None)
        self.timer.wake()
        if expiring is not None:
            log.warning("resume of the transaction at %d: %s", half_offset, expiring)
            return f"resumed: pending again with its check count reset; {expiring}"
        return "resumed: pending again with its check count reset"

    async def _dead_letter_sender(self, half) -> str:
        """The sender its dead letter names (the broker's Tx.owner_id when it was dead-lettered), found by the
        message index (_dead_letter_of); "" when none does (the half's own mark then: tx_from_half). A stock Java
        producer's first halves carry no mark (sent before its first heartbeat, a sender record names them):
        rebuilt from the half alone, a resumed one's checks went to the group's producers in turn, other
        instances asked about a transaction they never began."""
        uniq = half.properties.get(Prop.UNIQ_KEY)
        if not uniq:
            return ""
        found = await self._dead_letter_of(
            half.physical_offset, uniq, f"resume of the transaction at {half.physical_offset}",
            "its checks ask the sender its half names, if any, else the group's producers in turn")
        owner = found[1].properties.get(P_OWNER, "") if found is not None else ""
        return owner if plain_owner(owner) else ""

    async def _dead_letter_of(self, half_offset: int, uniq: str, what: str, lost: str, warn=log.warning):
        """(commit-log offset, MessageExt) of the newest dead letter of the half at ``half_offset``, found by the
        message index (``TRANS_CHECK_MAX_TIME_TOPIC#UNIQ_KEY``, newest first) and matched by the half offset it
        names; None when none is. ``what`` (the lookup's purpose) and ``lost`` (what not finding it costs) make its
        WARNINGs (through ``warn``: gated on the END path) when the lookup could not see it all."""
        index = self.ctx.index
        if index is None:
            return None
        try:
            looked = await index.query(DEAD_TOPIC, uniq, 8, 0, _FOREVER)
        except (StoreError, OSError) as exc:        # the broker is stopping
            warn("%s: its dead letter not looked up (%s): %s", what, exc, lost)
            return None
        for phy in looked.found:    # newest first: a transaction dead-lettered again after a resume
            try:
                view = self.ctx.store.get_record(phy)
                dead = decode_record(view)[0] if view is not None else None
            except Exception as exc:  # noqa: BLE001 - damaged (as _half_at): the lookup is a help, not the resume
                warn("%s: the dead letter the message index names at %d does not decode (%s): passed over",
                            what, phy, exc)
                continue
            if dead is not None and (parse_dead_letter(dead) or (None,))[0] == half_offset:
                return phy, dead
        if looked.behind is not None:
            # Answered from a prefix of the log (catching up at start-up, or stopped by a write error): its dead
            # letter may lie past it. Silent, a resume just after a restart went to the group in turn unsaid. The
            # answer's own offset, taken with it on the index thread: ``index.partial`` read once it came back
            # missed a catch-up that ended meanwhile.
            warn("%s: its dead letter not looked up in the whole log (the message index %s, to offset %d): %s",
                 what, "stopped by an error" if index.stopped else "is catching up", looked.behind, lost)
        elif looked.cut:
            # The lookup read max_checks records of the key's hash and stopped (other keys with the same
            # String.hashCode, which any client can send in any topic): unsaid, the checks went to the group in turn.
            warn("%s: its dead letter not looked up in the whole index (the lookup stopped after %d records "
                        "of its key's String.hashCode, other keys share it): %s", what, index.max_checks, lost)
        return None

    # ------------------------------------------------------------ retention (broker/retention.py)
    def undecided(self, lo: int, hi: int) -> dict[int, int]:
        """{half offset: store time} of the undecided halves stored in commit-log range [lo, hi): a segment's,
        found without a walk of the whole index (TransactionCore.between)."""
        return {p.half_offset: p.store_ts for p in self.core.between(lo, hi)}

    async def dead_letter(self, offsets, reason: str) -> tuple[list[int], list[dict]]:
        """Dead-letter these undecided halves with ``reason``; (done, [{commit_log_offset, why}] not done).

        Retention calls this to remove segments, so the records pass the disk watermark (a full disk
        that refused them could never clean itself). DEAD_LETTER_BATCH at a time are queued together and share
        the writer's group commit: one awaited after another, each was a sync flush of its own (an expired
        segment's 100,000 abandoned halves, 100,000 flushes in a row)."""
        done, failed = [], []
        offsets = list(offsets)
        # Said in one WARNING, however it ends: a line each, a segment of 100,000 expired halves was 100,000 lines.
        said = _SaidTogether(reason)
        together = self._said_together
        try:
            at = 0
            while at < len(offsets):
                batch, size = [], 0
                while at < len(offsets) and len(batch) < DEAD_LETTER_BATCH and size < DEAD_LETTER_BATCH_BYTES:
                    batch.append(offsets[at])
                    size += self._half_size(offsets[at])
                    at += 1
                together.update(dict.fromkeys(batch, said))
                outcomes = await asyncio.gather(*(self.decide(off, DEAD, reason=reason, reclaim=True,
                                                              origin=Origin.EXPIRY) for off in batch),
                                                return_exceptions=True)
                for off, outcome in zip(batch, outcomes):
                    if isinstance(outcome, DecisionError):      # decided meanwhile (an END, a check answer, an admin)
                        failed.append({"commit_log_offset": off, "why": outcome.remark})
                    elif isinstance(outcome, BaseException):    # the batch's others are written: raised as before
                        raise outcome
                    else:
                        done.append(off)
        finally:
            for off in offsets:
                if together.get(off) is said:
                    del together[off]
            said.say()
        return done, failed


class _Unnamed:
    """The halves a connection sent before a heartbeat named it. Those decided meanwhile are dropped as the list
    grows (at twice what was left the last time): a client that never heartbeats, sending transaction after
    transaction on one connection, kept every one it ever sent until the connection closed."""

    __slots__ = ("halves", "limit")

    def __init__(self):
        self.halves: list[Tx] = []
        self.limit = 64

    def add(self, tx: Tx, pending: dict) -> None:
        self.halves.append(tx)
        if len(self.halves) >= self.limit:
            self.halves = [t for t in self.halves if pending.get(t.half_offset) is t]
            self.limit = max(64, 2 * len(self.halves))


def _say_dead_letter(tx: Tx, reason: str | None) -> None:
    log.warning("transaction %s (group %s, topic %s, half %d) dead-lettered: %s after %d checks",
                tx.uniq_key, tx.group, tx.topic, tx.half_offset, reason, tx.checks)


class _SaidTogether:
    """The dead letters of one dead_letter() call, said in one WARNING: how many, their groups and topics, the first
    few named (kept: counts and names, not every transaction)."""

    SAMPLE = 5

    def __init__(self, reason: str):
        self.reason = reason
        self.n = 0
        self.groups: set[str] = set()
        self.topics: set[str] = set()
        self.first: list[Tx] = []

    def add(self, tx: Tx) -> None:
        self.n += 1
        self.groups.add(tx.group)
        self.topics.add(tx.topic)
        if len(self.first) < self.SAMPLE:
            self.first.append(tx)

    def say(self) -> None:
        reason = self.reason
        if self.n <= 1:
            for tx in self.first:
                _say_dead_letter(tx, reason)
            return
        more = self.n - len(self.first)
        log.warning("%d transactions dead-lettered: %s (groups %s; topics %s): %s%s", self.n, reason,
                    _some(self.groups), _some(self.topics),
                    "; ".join(f"{tx.uniq_key} (group {tx.group}, topic {tx.topic}, half {tx.half_offset})"
                              for tx in self.first),
                    f"; and {more} more (counted in txmq_transaction_dead_letters_total)" if more > 0 else "")


def _some(names: set[str], most: int = 20) -> str:
    names = sorted(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _say_not_sent(not_sent: dict[str, list[str]]) -> None:
    """One line for each reason checks of a slice did not go out (a producer's connection closed while they were
    written: one line for it with the count, where each of its 60 due transactions was one line of its own)."""
    for why, keys in not_sent.items():
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        log.info("%d transaction checks written but not sent (%s%s): %s", len(keys), ", ".join(keys[:3]), more, why)


def _claimant(tx: Tx, channels, owner_id: str):
    """The channel of the producer claiming ``owner_id`` to ask next about ``tx`` (see TransactionService._sender):
    the newest first, then from the oldest in the order they registered, after the one asked last."""
    claimants = [ch for ch in channels if ch.client_id == owner_id]
    if not claimants:
        return None
    newest = max(claimants, key=_seq)
    if not tx.asked_seq or tx.asked_seq >= newest.seq:
        return newest if not tx.asked_seq else min(claimants, key=_seq)
    return min((ch for ch in claimants if ch.seq > tx.asked_seq), key=_seq)


def _seq(ch) -> int:
    return ch.seq


def _with_check_count(msg, checks: int) -> bytes:
    """The check's body: the half with TRANSACTION_CHECK_TIMES, this check's number (1 for the first), as RocketMQ
    4.9.8's broker puts it on the message it checks (needDiscard), the producer's own value replaced. A listener
    that gives up after N checks reads it (``msg.getProperty("TRANSACTION_CHECK_TIMES")``); without it the
    listener's parse threw (null) or never saw N, each check was answered UNKNOW, and the transaction was
    dead-lettered after transaction_check_max checks instead of rolled back by its producer. Left off a half
    whose properties have no room for it: the check still goes, without any count (the producer's own value
    left off too: kept, a listener read it as the broker's count, as it did before the count was put)."""
    props = msg.properties
    props[Prop.TRANSACTION_CHECK_TIMES] = str(checks)
    try:
        return bytes(msg.encode())
    except RecordError:
        del props[Prop.TRANSACTION_CHECK_TIMES]     # (no longer than the half's: it fits)
        return bytes(msg.encode())


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class _DecisionWritten:
    """The store completion of a producer's decision written at once: settles it and answers (code, remark)."""

    __slots__ = ("svc", "action", "floor", "claim", "later", "size", "_done")

    def __init__(self, svc, action: Write, floor: int, claim: asyncio.Future, later, size: int = 0):
        self.svc, self.action, self.floor, self.claim, self.later = svc, action, floor, claim, later
        self.size = size
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, results) -> None:
        self._done = True
        try:
            remark = self.svc._decision_end(self.action, self.floor, self.claim, results, self.size)
            answer = ResponseCode.SUCCESS, remark
        except DecisionError as exc:
            answer = exc.code, exc.remark
        except Exception as exc:    # noqa: BLE001 - never into the writer
            log.exception("recording the decision of the transaction at %d failed", self.action.tx.half_offset)
            answer = ResponseCode.SYSTEM_ERROR, f"{type(exc).__name__}: {exc}"
        self.later.set_result(answer)
