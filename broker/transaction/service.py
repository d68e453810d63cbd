"""The transaction service: half messages, decisions, the in-memory index of undecided transactions.

Promises, beyond RocketMQ 4.x:

* the first recorded decision wins: a later different one is refused
  (TRANSACTION_FAILED) and counted, a repeated identical one is acknowledged
  and changes nothing, so an END_TRANSACTION retried by our client or replayed
  by a check never delivers twice;
* a commit writes the real message and its op record in ONE writer batch; at
  start-up a committed message whose op record was lost in a crash is found in
  the replayed log tail, so it is never committed a second time;
* undecided transactions live in memory (``pending``), ordered by next check
  time: a check pass costs O(due), and writes a small check record, never the
  payload;
* nothing is dropped silently: after ``transaction_check_max`` checks, or when
  the nightly expiry plan (or disk pressure) expires it (broker/retention.py), a
  transaction is copied to TRANS_CHECK_MAX_TIME_TOPIC with its reason, and can be
  resumed.
"""
from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import json
import logging
from dataclasses import dataclass

from protocol.codes import LanguageCode, RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.message import Prop, decode_record, offset_msg_id, tags_code

from ..results import put_failure_response, response_code, send_ok
from ..topics import HALF_TOPIC, OP_TOPIC
from .check import Action, CheckTimer, Policy, decide, first_check_time, next_check_after_check
from .records import COMMIT, DEAD, OP_TAG_CHECK, RESUME, ROLLBACK, RecordFactory, parse_op

log = logging.getLogger("txmq.transaction")

PROGRESS_GROUP = "CID_RMQ_SYS_TRANS"   # RocketMQ's owner of the half-queue progress offset
# Decisions remembered to answer a repeated END ("already COMMIT") or refuse a conflicting
# one. Past this many the oldest are forgotten: a very late END then finds no half message
# to decide and is refused, so forgetting can cost a nicer answer, never a second delivery.
DECIDED_MEMORY = 1_000_000
UNKNOWN = "UNKNOWN"
_STATES = {8: COMMIT, 12: ROLLBACK, 0: UNKNOWN}


@dataclass(slots=True, eq=False)
class Pending:
    half_offset: int
    queue_offset: int
    group: str
    topic: str
    uniq_key: str
    store_ts: int
    next_check: int
    checks: int = 0
    unanswered: int = 0
    awaiting: bool = False
    owner: object = None
    owner_id: str = ""
    last_answer: str = ""
    deciding: asyncio.Future | None = None
    deciding_op: str | None = None
    real_qid: int = 0
    tags_code: int = 0


def _pending_from_half(msg, next_check: int, checks: int) -> Pending:
    props = msg.properties
    try:
        real_qid = int(props.get(Prop.REAL_QID, "0") or 0)
    except ValueError:
        real_qid = 0
    return Pending(msg.physical_offset, msg.queue_offset, props.get(Prop.PGROUP, ""), props.get(Prop.REAL_TOPIC, ""),
                   props.get(Prop.UNIQ_KEY, ""), msg.store_timestamp, next_check, checks, real_qid=real_qid,
                   tags_code=tags_code(props))


class DecisionError(Exception):
    def __init__(self, code: int, remark: str):
        super().__init__(remark)
        self.code = code
        self.remark = remark


class TransactionService:
    def __init__(self, ctx):
        c = ctx.config
        self.ctx = ctx
        self.policy = Policy(c.transaction_check_interval_ms, c.transaction_timeout_ms, c.transaction_check_max,
                             int(c.transaction_retention_hours * 3600 * 1000))
        self.pending: dict[int, Pending] = {}
        self.decided: dict[int, tuple[str, str]] = {}     # half offset -> (decision, group)
        self._heap: list[tuple[int, int]] = []
        self._by_age: dict[str, list[tuple[int, int]]] = {}     # group -> heap of (store time, half offset)
        self._by_age_entries = 0
        self._recovered_commits: set[int] = set()
        self._storing: list[int] = []      # half-queue end offsets seen by halves still being stored
        self._rr = 0
        self.timer = CheckTimer(self, ctx.clock, max_sleep_s=min(1.0, c.transaction_check_interval_ms / 1000))
        ctx.metrics.half_messages.set_function(lambda: len(self.pending))

    @functools.cached_property
    def records(self) -> RecordFactory:
        # Built on first use: by then the server has bound its port and set the store host.
        return RecordFactory(self.ctx.store_host, self.ctx.uniq_ids, self.ctx.clock)

    # ------------------------------------------------------------ recovery
    def on_dispatch(self, info) -> None:
        """Store dispatch listener: remember commits replayed by recovery (their op may be lost)."""
        # (prepared_offset may be 0: the very first record of a store can be a half message)
        if info.recovering and SysFlag.transaction_type(info.sys_flag) == SysFlag.TRANSACTION_COMMIT:
            self._recovered_commits.add(info.prepared_offset)

    def _scan(self, topic: str, start: int | None = None):
        store = self.ctx.store
        offset = store.min_offset(topic, 0) if start is None else max(start, store.min_offset(topic, 0))
        end = store.max_offset(topic, 0)
        while offset < end:
            got = store.get_messages(topic, 0, offset, 256, 8 * 1024 * 1024, None)
            if not got.buffers:
                if got.next_begin_offset <= offset:
                    break
                offset = got.next_begin_offset
                continue
            for buf in got.buffers:
                yield decode_record(buf)[0]
            offset = got.next_begin_offset

    async def recover(self) -> None:
        """Rebuild the index from the op queue, the replayed tail and the half queue."""
        checks: dict[int, int] = {}
        resumed: dict[int, int] = {}    # half offset -> half queue offset, for halves a RESUME re-opened
        for msg in self._scan(OP_TOPIC):
            op = parse_op(msg)
            if op is None:
                continue
            if op.tag == OP_TAG_CHECK:
                checks[op.half_offset] = max(checks.get(op.half_offset, 0), op.checks)
            elif op.op == RESUME:
                self.decided.pop(op.half_offset, None)
                checks[op.half_offset] = 0
                resumed[op.half_offset] = op.half_queue_offset
            elif op.op in (COMMIT, ROLLBACK, DEAD):
                self.decided[op.half_offset] = (op.op, "")
                resumed.pop(op.half_offset, None)
        repaired = [off for off in self._recovered_commits if off not in self.decided]
        for off in self._recovered_commits:
            self.decided.setdefault(off, (COMMIT, ""))
        progress = self.ctx.offsets.get(PROGRESS_GROUP, HALF_TOPIC, 0)
        if progress is not None and resumed:
            # The progress may have been persisted while the resumed half was dead, past it.
            progress = min(progress, min(resumed.values()))
        now = self.ctx.clock()
        for msg in self._scan(HALF_TOPIC, progress):
            off = msg.physical_offset
            props = msg.properties
            if off in self.decided:
                if off in repaired:
                    res = await self.ctx.store.put(self.records.decision(COMMIT, off, msg.queue_offset))
                    log.warning("recovery: committed transaction at %d had lost its op record; rewritten (%s)",
                                off, res.status.name)
                    self.decided[off] = (COMMIT, props.get(Prop.PGROUP, ""))
                continue
            p = _pending_from_half(msg, 0, checks.get(off, 0))
            p.next_check = max(first_check_time(self.policy, msg.store_timestamp,
                                                props.get(Prop.CHECK_IMMUNITY_TIME_IN_SECONDS)), now)
            self._add(p)
        for off in list(itertools.islice(self.decided, max(0, len(self.decided) - DECIDED_MEMORY))):
            del self.decided[off]
        log.info("transactions recovered: %d undecided, %d decided, %d repaired", len(self.pending),
                 len(self.decided), len(repaired))

    def start(self) -> None:
        self.timer.start()

    async def stop(self) -> None:
        await self.timer.stop()
        self._save_progress()

    def _save_progress(self) -> None:
        if self.ctx.offsets is None:    # a start that failed before the offsets were opened
            return
        # A half being stored is not pending yet; its queue offset is at or past the end it saw.
        floors = [p.queue_offset for p in self.pending.values()] + self._storing
        progress = min(floors) if floors else self.ctx.store.max_offset(HALF_TOPIC, 0)
        self.ctx.offsets.commit(PROGRESS_GROUP, HALF_TOPIC, 0, progress)

    # ------------------------------------------------------------ the index
    def _remember(self, half_offset: int, op: str, group: str) -> None:
        decided = self.decided
        decided[half_offset] = (op, group)
        if len(decided) > DECIDED_MEMORY:
            del decided[next(iter(decided))]      # dicts keep insertion order: the oldest decision

    def _add(self, p: Pending) -> None:
        self.pending[p.half_offset] = p
        heapq.heappush(self._heap, (p.next_check, p.half_offset))
        heapq.heappush(self._by_age.setdefault(p.group, []), (p.store_ts, p.half_offset))
        self._by_age_entries += 1

    def oldest_by_group(self) -> dict[str, int]:
        """{producer group: store time (ms) of its oldest undecided half}, for the age gauge.

        Lazy heaps: a decided half leaves its entry behind until it reaches the top, so a read
        costs O(log n) per decided entry; when stale entries outnumber the live ones the heaps
        are rebuilt from the pending index (amortised O(1) per decision)."""
        pending = self.pending
        if self._by_age_entries > 2 * len(pending) + 1024:
            self._by_age = {}
            for p in pending.values():
                self._by_age.setdefault(p.group, []).append((p.store_ts, p.half_offset))
            for heap in self._by_age.values():
                heapq.heapify(heap)
            self._by_age_entries = len(pending)
        out = {}
        for group, heap in list(self._by_age.items()):
            while heap and (heap[0][1] not in pending or pending[heap[0][1]].group != group):
                heapq.heappop(heap)
                self._by_age_entries -= 1
            if heap:
                out[group] = heap[0][0]
            else:
                del self._by_age[group]
        return out

    def _reschedule(self, p: Pending, when: int) -> None:
        p.next_check = when
        heapq.heappush(self._heap, (when, p.half_offset))

    def next_due(self) -> int | None:
        heap = self._heap
        while heap:
            when, off = heap[0]
            p = self.pending.get(off)
            if p is not None and p.next_check == when:
                return when
            heapq.heappop(heap)
        return None

    # -------------------------------------------------------- half messages
    def prepare(self, conn, cmd, h, qid: int, props: dict, born_host: bytes):
        group = props.get(Prop.PGROUP) or h.producer_group
        props.setdefault(Prop.PGROUP, group)
        req = self.records.half(body=cmd.body, real_topic=h.topic, real_qid=qid, flag=h.flag, sys_flag=h.sys_flag,
                                born_timestamp=h.born_timestamp, born_host=born_host, props=props,
                                reconsume_times=h.reconsume_times)
        return self._prepare(conn, cmd, req, group, h.topic, qid, props)

    async def _prepare(self, conn, cmd, req, group, topic, qid, props):
        ctx = self.ctx
        floor = ctx.store.max_offset(HALF_TOPIC, 0)
        self._storing.append(floor)
        try:
            result = await ctx.store.put(req)
        finally:
            self._storing.remove(floor)
        if not result.ok:
            return put_failure_response(cmd, result)
        client_id = conn.attributes.get("client_id") or f"{conn.peer[0]}:{conn.peer[1]}"
        p = Pending(result.physical_offset, result.queue_offset, group, topic, props.get(Prop.UNIQ_KEY, ""),
                    result.store_timestamp, 0, owner=conn, owner_id=client_id, real_qid=qid,
                    tags_code=req.tags_code)
        p.next_check = first_check_time(self.policy, result.store_timestamp,
                                        props.get(Prop.CHECK_IMMUNITY_TIME_IN_SECONDS))
        self._add(p)
        if p.next_check <= (self._heap[0][0] if self._heap else p.next_check):
            self.timer.wake()
        ctx.clients.add_producer(group, conn, client_id, cmd.language, cmd.version)
        ctx.metrics.child(ctx.metrics.half_in, group).inc()
        return send_ok(ctx, cmd, offset_msg_id(ctx.store_host, result.physical_offset), qid, result.queue_offset)

    # ------------------------------------------------------------ decisions
    def end(self, conn, cmd):
        group = cmd.str_field("producerGroup", required=True)
        table_offset = cmd.int_field("tranStateTableOffset", required=True)
        half_offset = cmd.int_field("commitLogOffset", required=True)
        state = cmd.int_field("commitOrRollback", required=True)
        from_check = cmd.bool_field("fromTransactionCheck")
        op = _STATES.get(state)
        if op is None:
            return None if cmd.is_oneway else cmd.response(
                ResponseCode.SYSTEM_ERROR, f"commitOrRollback={state}: expected 0, 8 or 12")
        p = self.pending.get(half_offset)
        if p is not None:
            if p.group != group:
                return self._refuse(cmd, ResponseCode.SYSTEM_ERROR, "The producer group wrong")
            if p.queue_offset != table_offset:
                return self._refuse(cmd, ResponseCode.SYSTEM_ERROR, "The transaction state table offset wrong")
            if from_check:
                p.awaiting = False
                p.unanswered = 0
                self.ctx.metrics.child(self.ctx.metrics.check_answers, group, op).inc()
            p.last_answer = op
        if op == UNKNOWN:
            self.ctx.metrics.child(self.ctx.metrics.unknowns, group).inc()
            return None if cmd.is_oneway else cmd.response(
                ResponseCode.SUCCESS, "UNKNOWN recorded; the broker will check back")
        return self._end(cmd, group, half_offset, op)

    def _refuse(self, cmd, code, remark):
        log.warning("END_TRANSACTION refused: %s (%s)", remark, cmd.ext_fields)
        return None if cmd.is_oneway else cmd.response(code, remark)

    async def _end(self, cmd, group, half_offset, op):
        try:
            outcome = await self.decide(half_offset, op, group=group)
        except DecisionError as exc:
            return self._refuse(cmd, exc.code, exc.remark)
        return None if cmd.is_oneway else cmd.response(ResponseCode.SUCCESS, outcome)

    async def decide(self, half_offset: int, op: str, *, group: str | None = None, reason: str | None = None,
                     reclaim: bool = False) -> str:
        """Record ``op`` for the transaction; returns a remark, raises DecisionError when refused.

        ``reclaim``: the decision is written to free space (retention), past the disk watermark."""
        metrics = self.ctx.metrics
        p = self.pending.get(half_offset)
        while p is not None and p.deciding is not None:
            await asyncio.shield(p.deciding)
            p = self.pending.get(half_offset)
        if p is None:
            earlier = self.decided.get(half_offset)
            if earlier is None:
                raise DecisionError(ResponseCode.SYSTEM_ERROR, "Find prepared transaction message failed")
            if earlier[0] == op:
                metrics.child(metrics.duplicates, group or earlier[1]).inc()
                return f"already {op}; nothing changed"
            metrics.child(metrics.conflicts, group or earlier[1]).inc()
            raise DecisionError(ResponseCode.TRANSACTION_FAILED,
                                f"transaction already {earlier[0]}; {op} refused (the first decision wins)")
        p.deciding = asyncio.get_running_loop().create_future()
        p.deciding_op = op
        try:
            reqs = self._decision_records(p, op, reason)
            results = await self.ctx.store.put_many(reqs, reclaim)
            failed = [r for r in results if not r.ok]
            if failed:
                raise DecisionError(response_code(failed[0]), f"store refused the decision: {failed[0].status.name}")
            del self.pending[half_offset]
            self._remember(half_offset, op, p.group)
            now = self.ctx.clock()
            if op == COMMIT:
                metrics.child(metrics.commits, p.group).inc()
                metrics.count_in(p.topic, 1, 0)
            elif op == ROLLBACK:
                metrics.child(metrics.rollbacks, p.group).inc()
            else:
                metrics.child(metrics.dead_letters, p.group, reason or "").inc()
                log.warning("transaction %s (group %s, topic %s, half %d) dead-lettered: %s after %d checks",
                            p.uniq_key, p.group, p.topic, half_offset, reason, p.checks)
            metrics.child(metrics.finish_latency, p.group).observe(max(0, now - p.store_ts) / 1000)
            return op
        finally:
            fut, p.deciding = p.deciding, None
            fut.set_result(None)

    def _decision_records(self, p: Pending, op: str, reason: str | None):
        rf = self.records
        if op == ROLLBACK:
            return [rf.decision(ROLLBACK, p.half_offset, p.queue_offset)]
        view = self.ctx.store.get_record(p.half_offset)
        if view is None:
            raise DecisionError(ResponseCode.SYSTEM_ERROR, "Find prepared transaction message failed")
        if op == COMMIT:
            return [rf.committed(view, p.half_offset, p.topic, p.real_qid, p.tags_code),
                    rf.decision(COMMIT, p.half_offset, p.queue_offset)]
        half, _ = decode_record(view)
        return [rf.dead_letter(half, p.half_offset, reason or "unknown"),
                rf.decision(DEAD, p.half_offset, p.queue_offset, reason)]

    # --------------------------------------------------------------- checks
    def _channel_for(self, p: Pending):
        owner = p.owner
        if owner is not None and getattr(owner, "is_open", False):
            return owner
        channels = self.ctx.clients.producer_channels(p.group)
        if not channels:
            return None
        self._rr += 1
        return channels[self._rr % len(channels)].conn

    async def run_due(self, now: int) -> None:
        heap = self._heap
        check_batch: list[tuple[Pending, object]] = []
        deaths: list[tuple[Pending, str]] = []
        while heap and heap[0][0] <= now:
            when, off = heapq.heappop(heap)
            p = self.pending.get(off)
            if p is None or p.next_check != when:
                continue
            if p.deciding is not None:
                # Keep it scheduled: should the decision being written fail, it is still undecided.
                self._reschedule(p, now + self.policy.check_interval_ms)
                continue
            if p.awaiting:
                p.unanswered += 1
                p.awaiting = False
            conn = self._channel_for(p)
            action = decide(self.policy, now=now, store_ts=p.store_ts, next_check=p.next_check, checks=p.checks,
                            has_producer=conn is not None)
            if action is Action.CHECK:
                check_batch.append((p, conn))
            elif action is Action.DEFER:
                self.ctx.metrics.child(self.ctx.metrics.checks_skipped, p.group).inc()
                self._reschedule(p, now + self.policy.check_interval_ms)
            elif action in (Action.DEAD_MAX_CHECKS, Action.DEAD_EXPIRED):
                deaths.append((p, action.value))
            else:
                self._reschedule(p, p.next_check)
        if check_batch:
            await self._send_checks(check_batch, now)
        for p, reason in deaths:
            try:
                await self.decide(p.half_offset, DEAD, reason=reason)
            except DecisionError as exc:
                log.error("could not dead-letter %d: %s", p.half_offset, exc.remark)
                self._reschedule(p, now + self.policy.check_interval_ms)
        self._save_progress()

    async def _send_checks(self, batch, now: int) -> None:
        rf = self.records
        for p, _ in batch:
            p.checks += 1
        results = await self.ctx.store.put_many([rf.check(p.half_offset, p.queue_offset, p.checks) for p, _ in batch])
        for (p, conn), result in zip(batch, results):
            if p.half_offset not in self.pending:
                continue
            self._reschedule(p, next_check_after_check(self.policy, now, p.unanswered))
            if not result.ok:
                p.checks -= 1
                continue
            try:
                conn.oneway(self._check_command(p))
            except Exception as exc:  # noqa: BLE001 - a dead channel: the next pass picks another
                log.info("check of %s not sent: %s", p.uniq_key, exc)
                continue
            p.awaiting = True
            self.ctx.metrics.child(self.ctx.metrics.checks_sent, p.group).inc()

    def _check_command(self, p: Pending) -> RemotingCommand:
        view = self.ctx.store.get_record(p.half_offset)
        msg, _ = decode_record(view)
        msg.topic = msg.properties.get(Prop.REAL_TOPIC, msg.topic)
        msg.queue_id = int(msg.properties.get(Prop.REAL_QID, "0") or 0)
        return RemotingCommand.request(RequestCode.CHECK_TRANSACTION_STATE, {
            "tranStateTableOffset": p.queue_offset, "commitLogOffset": p.half_offset, "msgId": p.uniq_key,
            "transactionId": p.uniq_key, "offsetMsgId": offset_msg_id(self.ctx.store_host, p.half_offset),
        }, bytes(msg.encode()), language=LanguageCode.JAVA)

    # ---------------------------------------------------------------- admin
    def describe(self, group: str | None = None, limit: int = 1000) -> list[dict]:
        now = self.ctx.clock()
        rows = []
        for p in sorted(self.pending.values(), key=lambda p: p.store_ts):
            if group and p.group != group:
                continue
            owner_alive = p.owner is not None and getattr(p.owner, "is_open", False)
            rows.append({"commit_log_offset": p.half_offset, "queue_offset": p.queue_offset, "group": p.group,
                         "topic": p.topic, "uniq_key": p.uniq_key, "age_ms": now - p.store_ts,
                         "checks": p.checks, "owner": p.owner_id + ("" if owner_alive else " (gone)"),
                         "last_answer": p.last_answer or "-", "next_check_in_ms": max(0, p.next_check - now)})
            if len(rows) >= limit:
                break
        return rows

    def dead_letters(self) -> list[int]:
        return [off for off, (op, _) in self.decided.items() if op == DEAD]

    async def resume(self, half_offset: int) -> str:
        earlier = self.decided.get(half_offset)
        if earlier is None or earlier[0] != DEAD:
            raise DecisionError(ResponseCode.SYSTEM_ERROR,
                                f"transaction at {half_offset} is not dead-lettered"
                                + (f" (it is {earlier[0]})" if earlier else " (unknown)"))
        view = self.ctx.store.get_record(half_offset)
        if view is None:
            raise DecisionError(ResponseCode.SYSTEM_ERROR, f"half message at {half_offset} is no longer stored")
        msg, _ = decode_record(view)
        # Marked before the write: a second resume racing this one is refused, not written twice.
        self.decided[half_offset] = (RESUME, earlier[1])
        result = await self.ctx.store.put(self.records.decision(RESUME, half_offset, msg.queue_offset))
        if not result.ok:
            self.decided[half_offset] = earlier
            raise DecisionError(response_code(result), f"store refused: {result.status.name}")
        del self.decided[half_offset]
        p = _pending_from_half(msg, self.ctx.clock(), 0)
        self._add(p)
        self.timer.wake()
        return "resumed: pending again with its check count reset"

    # ------------------------------------------------------------ retention (broker/retention.py)
    def undecided(self, lo: int = 0, hi: int | None = None) -> dict[int, int]:
        """{half offset: store time} of the undecided halves stored in commit-log range [lo, hi)."""
        return {off: p.store_ts for off, p in self.pending.items() if lo <= off and (hi is None or off < hi)}

    async def dead_letter(self, offsets, reason: str) -> tuple[list[int], list[dict]]:
        """Dead-letter these undecided halves with ``reason``; (done, [{commit_log_offset, why}] not done).

        Retention calls this to remove segments, so the records pass the disk watermark (a full disk
        that refused them could never clean itself)."""
        done, failed = [], []
        for off in offsets:
            try:
                await self.decide(off, DEAD, reason=reason, reclaim=True)
            except DecisionError as exc:    # decided meanwhile (an END, a check answer, an admin)
                failed.append({"commit_log_offset": off, "why": exc.remark})
                continue
            done.append(off)
        return done, failed


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
