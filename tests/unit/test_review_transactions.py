"""Review regressions for the transaction service, on a real store with a controllable clock."""
from __future__ import annotations

import asyncio
import logging

import pytest

from broker.clients import ClientRegistry
from broker.config import BrokerConfig
from broker.context import BrokerContext
from broker.metrics import BrokerMetrics
from broker.retention import Retention
from broker.store import (
    ConsumerOffsets,
    MessageStore,
    PutResult,
    PutStatus,
    StoreConfig,
)
from broker.store.index import QueryResult
from broker.topics import TopicManager
from broker.transaction import DecisionError, TransactionService
from broker.transaction.records import COMMIT
from protocol.message import Prop, offset_msg_id
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


class Clock:
    def __init__(self, now=1_000_000):
        self.now = now

    def __call__(self):
        return self.now


class GatedStore:
    """Delegates to a real store; ``put_many`` can be held at a gate and made to fail."""

    def __init__(self, store):
        self._store = store
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.fail = False

    def __getattr__(self, name):
        return getattr(self._store, name)

    def put_many(self, reqs, reclaim=False, then=None):
        if self.gate is None:
            return self._store.put_many(reqs, reclaim, then)
        gated = asyncio.ensure_future(self._gated(reqs, reclaim))
        if then is None:
            return gated
        gated.add_done_callback(lambda f: then.set_result(f.result()))     # as the writer completes ``then``
        return then

    async def _gated(self, reqs, reclaim):
        self.entered.set()
        await self.gate.wait()
        if self.fail:
            return [PutResult(PutStatus.SERVICE_NOT_AVAILABLE) for _ in reqs]
        return await self._store.put_many(reqs, reclaim)


async def make_service(tmp_path, clock, **cfg):
    config = BrokerConfig(store_dir=str(tmp_path), transaction_check_interval_ms=1000,
                          transaction_timeout_ms=1000, **cfg)
    store = MessageStore(str(tmp_path / "s"), StoreConfig(segment_size=1 << 20), clock=clock)
    topics = TopicManager(str(tmp_path / "config"), auto_create=True, default_queue_nums=4, cluster="c",
                          broker="b")
    ctx = BrokerContext(config, None, None, topics, ClientRegistry(clock), BrokerMetrics(), clock=clock,
                        monotonic=clock)     # one fake clock: the schedule moves only when the test moves it
    ctx.set_address("127.0.0.1", 10911)
    ctx.tx = TransactionService(ctx)
    store.add_dispatch_listener(ctx.tx.on_dispatch)
    await store.open()
    ctx.offsets = ConsumerOffsets(str(tmp_path / "s"))
    ctx.store = GatedStore(store)
    await ctx.tx.recover()
    return ctx


async def add_half(ctx, body=b"x", group="PG", conn=None):
    """Store a half message and index it as the send path does (on ``conn``, else on a closed connection no
    heartbeat named); returns its Pending."""
    tx = ctx.tx
    props = {Prop.UNIQ_KEY: f"U{body!r}", Prop.PGROUP: group, Prop.TRAN_MSG: "true"}
    req = tx.records.half(body=body, real_topic="T", real_qid=0, flag=0, sys_flag=0, born_timestamp=ctx.clock(),
                          born_host=ctx.store_host, props=props)

    class Conn:
        peer = ("127.0.0.1", 1)
        is_open = False

        def __init__(self):
            self.attributes = {}

    class Cmd:
        language = 0
        version = 0
        opaque = 1
        serialize_type = 0

    cmd = Cmd()
    cmd.body = body         # the half's, as sent: counted under the half topic
    conn = conn or Conn()
    await tx._prepare(conn, cmd, req, group, "T", 0, props, conn.attributes.get("client_id"))
    return max(tx.pending.values(), key=lambda p: p.half_offset)



async def half_stored_while(ctx, during, body=b"in-flight", conn=None):
    """Store a half (as add_half) and run ``during()`` (awaited if it returns an awaitable) once the half is
    stored and dispatched but before its sender indexed it; returns its Pending."""
    real_put = ctx.store._store.put
    written, release = asyncio.Event(), asyncio.Event()

    async def slow_put(req):
        result = await real_put(req)      # stored and dispatched ...
        written.set()
        await release.wait()              # ... but the sender has not indexed it yet
        return result

    ctx.store.put = slow_put
    try:
        adding = asyncio.ensure_future(add_half(ctx, body, conn=conn))
        await written.wait()
        outcome = during()
        if asyncio.iscoroutine(outcome):
            await outcome
        release.set()
        return await adding
    finally:
        del ctx.store.put                 # GatedStore delegates to the real store again

@bounded(20)
async def test_check_pass_during_a_failing_decision_keeps_the_transaction_scheduled(tmp_path):
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        p = await add_half(ctx)
        ctx.store.gate = asyncio.Event()
        ctx.store.fail = True
        deciding = asyncio.ensure_future(tx.decide(p.half_offset, COMMIT, group="PG"))
        await ctx.store.entered.wait()
        clock.now = p.next_check + 1          # due while the decision is being written
        await tx.run_due(clock.now)
        ctx.store.gate.set()
        with pytest.raises(DecisionError):
            await deciding
        ctx.store.gate = None
        assert p.half_offset in tx.pending
        # Still undecided, so it must still be scheduled for a check.
        assert tx.next_due() is not None, "the undecided transaction fell out of the check schedule"
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_resumed_transaction_survives_a_crash_before_the_progress_is_persisted(tmp_path):
    from broker.transaction.records import DEAD
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    p = await add_half(ctx, b"dead-then-resumed")
    await tx.decide(p.half_offset, DEAD, reason="max-checks")
    later = await add_half(ctx, b"younger")
    tx._save_progress()                   # progress moves past the dead-lettered half
    ctx.offsets.persist()
    assert ctx.offsets.get("CID_RMQ_SYS_TRANS", "RMQ_SYS_TRANS_HALF_TOPIC", 0) == later.queue_offset
    await tx.resume(p.half_offset)
    assert p.half_offset in tx.pending
    # Crash: the store's records are durable, the lowered progress never reached the offsets file.
    await ctx.store._store.close()

    ctx2 = await make_service(tmp_path, clock)
    try:
        assert set(ctx2.tx.pending) == {p.half_offset, later.half_offset}, \
            "the resumed transaction was forgotten by recovery"
    finally:
        await ctx2.store._store.close()


@bounded(20)
async def test_a_resumed_transactions_sender_survives_a_crash_before_the_next_snapshot(tmp_path, monkeypatch):
    """The sender a resume found in the dead letter (TransactionService._dead_letter_sender: the message index,
    which this context has none of) is written with the RESUME op: recovery replays it as a check record's. Left
    out, a crash after a snapshot written while the transaction was dead (no "owners" entry for it) rebuilt it from
    the half alone, which a stock Java producer's first halves do not name it in: checked with the group in turn."""
    from broker.transaction.records import DEAD
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    p = await add_half(ctx, b"named-then-dead")
    await tx.decide(p.half_offset, DEAD, reason="max-checks")
    await tx.write_snapshot()             # the transaction is in no snapshot's "owners"

    async def found(half):
        return "10.0.0.7@sender"
    monkeypatch.setattr(tx, "_dead_letter_sender", found)
    await tx.resume(p.half_offset)
    assert tx.pending[p.half_offset].owner_id == "10.0.0.7@sender"
    await ctx.store._store.close()        # crash: no snapshot since the resume

    ctx2 = await make_service(tmp_path, clock)
    try:
        assert ctx2.tx.pending[p.half_offset].owner_id == "10.0.0.7@sender", "the resumed sender was forgotten"
    finally:
        await ctx2.store._store.close()


@bounded(20)
async def test_a_resume_while_the_message_index_catches_up_warns_that_its_sender_was_not_found(tmp_path, caplog):
    """The message index answers a query from what it has indexed so far while it catches up with the log at
    start-up (a slice at a time), or after a write error stopped it: a resume then found no dead letter and went
    on silently with the half's mark, none for a stock Java producer's first halves, its checks to the group in
    turn, though its sender was in the dead letter. The lookup that could not see the whole log is said."""
    import threading
    from broker.store.index import IndexService
    from broker.topics import OP_TOPIC
    from broker.transaction.records import DEAD
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx, store = ctx.tx, ctx.store._store
    p = await add_half(ctx, b"named-then-dead")
    p.owner_id = "10.0.0.7@sender"        # named after the half (a sender record): the half has no mark
    await tx.decide(p.half_offset, DEAD, reason="max-checks")
    # A broker restarted with its index behind the log: the catch-up is held, so the dead letter is not indexed.
    index = IndexService(str(tmp_path / "s"), segment_size=1 << 20, slots=1024, entries=4096, clock=clock,
                         unindexed=(OP_TOPIC,))
    released, real = threading.Event(), index._scan
    index._scan = lambda *a: real(*a) if released.wait(0.02) else False
    store.add_dispatch_listener(index.on_dispatch)
    await index.open(store.min_physical_offset, store.max_physical_offset)
    ctx.index = index
    try:
        with caplog.at_level(logging.WARNING, logger="txmq.transaction"):
            await tx.resume(p.half_offset)
        assert tx.pending[p.half_offset].owner_id == ""          # the half's mark: none
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("not looked up" in m and "index" in m for m in said), said
    finally:
        released.set()
        await index.close()
        await store.close()


@bounded(20)
async def test_a_dead_letter_recovery_writes_for_an_unreadable_op_names_the_sender_a_record_named(tmp_path):
    """The second path to a dead letter: recovery dead-letters (op-unreadable) a transaction whose decision op went
    bad and that nothing else says the decision of. Its dead letter was made from the half alone, which a stock
    Java producer's first halves name no sender in (a sender record does): resumed, its checks went to the group
    in turn. It carries the sender the replayed records named, as the check path's dead letter does."""
    import shutil
    from broker.transaction.records import DEAD_TOPIC, P_OWNER, ROLLBACK
    from protocol.message import decode_record
    from tests.integration.test_corrupt_records import _op_records
    from tests.integration.test_op_damage import _damage_properties
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    p = await add_half(ctx, b"named-then-rolled-back")        # no heartbeat: the half names no sender
    assert (await ctx.store.put(tx.records.sender(p.half_offset, p.queue_offset, "10.0.0.7@sender"))).ok
    await tx.decide(p.half_offset, ROLLBACK)
    await ctx.store._store.close()
    store_dir = tmp_path / "s"
    [(pos, _)] = [(at, body) for at, body in _op_records(store_dir) if body == str(p.queue_offset).encode()][-1:]
    _damage_properties(store_dir, pos, "zeroed")                # the ROLLBACK op, the last op record
    shutil.rmtree(store_dir / "transactions")                     # no snapshot, no decision table: nothing says it

    ctx2 = await make_service(tmp_path, clock)
    try:
        letters = [decode_record(ctx2.store.get_record(at))[0] for at, _ in _op_records(store_dir, DEAD_TOPIC)]
        assert [m.properties.get(P_OWNER) for m in letters] == ["10.0.0.7@sender"]
    finally:
        await ctx2.store._store.close()


@bounded(20)
async def test_progress_saved_while_a_half_is_being_indexed_does_not_skip_it(tmp_path):
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx

    def save_progress():                  # a check pass ends here, with nothing pending yet
        tx._save_progress()
        ctx.offsets.persist()
    p = await half_stored_while(ctx, save_progress)
    await ctx.store._store.close()        # crash: the progress saved above is the persisted one

    ctx2 = await make_service(tmp_path, clock)
    try:
        assert p.half_offset in ctx2.tx.pending, "a half stored just before a progress save was forgotten"
    finally:
        await ctx2.store._store.close()


@bounded(20)
async def test_expiry_plan_racing_a_commit_skips_that_half_and_finishes(tmp_path):
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        p = await add_half(ctx, b"committed-meanwhile")
        old = await add_half(ctx, b"really-expired")
        clock.now += tx.policy.retention_ms + 1
        ctx.store.gate = asyncio.Event()
        committing = asyncio.ensure_future(tx.decide(p.half_offset, COMMIT, group="PG"))
        await ctx.store.entered.wait()
        plan = {"version": 2, "store_id": ctx.store.store_id, "now_ms": clock.now,
                "halves": [{"commit_log_offset": p.half_offset}, {"commit_log_offset": old.half_offset}],
                "segments": []}
        applying = asyncio.ensure_future(Retention(ctx).apply_plan(plan))
        await asyncio.sleep(0)
        ctx.store.gate.set()
        ctx.store.gate = None
        assert await committing == COMMIT
        summary = await applying
        assert summary["expired"] == [old.half_offset]
        assert [s["commit_log_offset"] for s in summary["skipped"]] == [p.half_offset]
        assert tx.decision_of(p.half_offset) == COMMIT
    finally:
        await ctx.store._store.close()



@bounded(20)
async def test_two_concurrent_resumes_write_one_resume(tmp_path):
    from broker.transaction.records import DEAD
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        p = await add_half(ctx, b"dead")
        await tx.decide(p.half_offset, DEAD, reason="max-checks")
        writes = []
        real_put = ctx.store._store.put
        ctx.store.put = lambda req: (writes.append(req), real_put(req))[1]
        results = await asyncio.gather(tx.resume(p.half_offset), tx.resume(p.half_offset), return_exceptions=True)
        assert sum(isinstance(r, str) for r in results) == 1
        refused = [r for r in results if isinstance(r, DecisionError)]
        assert len(refused) == 1 and "not dead-lettered" in refused[0].remark
        assert len(writes) == 1 and p.half_offset in tx.pending
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_dead_letter_that_raises_leaves_no_transaction_unscheduled_or_claimed_forever(tmp_path):
    """Two transactions reach transaction_check_max in one pass and making the first one's dead letter
    raises (a corrupt half record, a bug). The pass must not end there: the other one is dead-lettered,
    the failed one stays pending and scheduled, and no decision on either waits forever for a claim that
    is never settled (an END_TRANSACTION or admin resolve would otherwise hang)."""
    from broker.transaction.records import DEAD
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        a = await add_half(ctx, b"a")
        b = await add_half(ctx, b"b")
        for p in (a, b):
            p.checks = tx.policy.check_max
        real, calls = tx.records.dead_letter, []

        def dead_letter(half, half_offset, reason, checks=None, owner=""):
            calls.append(half_offset)
            if len(calls) == 1:
                raise ValueError("corrupt half record")
            return real(half, half_offset, reason, checks, owner)
        tx.records.dead_letter = dead_letter
        clock.now = max(a.next_check, b.next_check) + 1
        try:
            await tx.run_due(clock.now)
        except ValueError:
            pass                            # (the timer would log it and go on)
        first = a if calls[0] == a.half_offset else b
        other = b if first is a else a
        assert tx.decision_of(other.half_offset) == DEAD, "the pass stopped before the other dead letter"
        assert first.half_offset in tx.pending and first.deciding is None
        assert tx.next_due() is not None, "the transaction whose dead letter failed fell out of the schedule"
        # A decision on it is answered, not left waiting for a claim nobody settles.
        assert await asyncio.wait_for(tx.decide(first.half_offset, COMMIT, group="PG"), 5) == COMMIT
        assert first.half_offset not in tx._deciding and other.half_offset not in tx._deciding
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_check_pass_whose_write_raises_keeps_its_transactions_scheduled(tmp_path):
    """The check records' write raises (a bug, not a refusal): the transactions the pass took off the
    schedule are put back (checked again later) and the dead letter due in the same pass is still written."""
    from broker.transaction.records import DEAD
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        checked = await add_half(ctx, b"checked")
        dying = await add_half(ctx, b"dying")
        dying.checks = tx.policy.check_max

        class Producer:
            is_open = True

            def oneway(self, cmd):
                pass
        checked.owner = Producer()
        real = ctx.store._store.put_many

        def put_many(reqs, reclaim=False, then=None):
            if len(reqs) == 1 and reqs[0].topic == "RMQ_SYS_TRANS_OP_HALF_TOPIC":
                raise RuntimeError("a bug in the check write")
            return real(reqs, reclaim, then)
        ctx.store.put_many = put_many
        clock.now = max(checked.next_check, dying.next_check) + 1
        try:
            await tx.run_due(clock.now)
        except RuntimeError:
            pass
        del ctx.store.put_many
        assert checked.half_offset in tx.pending and checked.checks == 0, "a check never written was counted"
        assert tx.next_due() is not None, "the transaction whose check failed fell out of the schedule"
        assert tx.decision_of(dying.half_offset) == DEAD, "the dead letter due in the same pass was not written"
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_check_pass_that_raises_is_counted_and_the_timer_goes_on(tmp_path):
    """A check pass that raises is logged and counted in txmq_background_task_crashes_total (the alert's
    metric): a timer failing every pass would otherwise stop all checks with only a log line to show."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    tx.timer.max_sleep_s = 0.01
    second = asyncio.Event()
    calls = []

    async def run_due(now):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("a bug in the check pass")
        second.set()
    tx.run_due = run_due
    tx.timer.start()
    try:
        await second.wait()
    finally:
        await tx.timer.stop()
        await ctx.store._store.close()
    assert ctx.metrics.task_crashes.labels("txmq-check-timer")._value.get() == 1


@bounded(20)
async def test_a_failing_check_write_does_not_strand_the_dead_letters_of_its_pass(tmp_path):
    """The same pass claims a dead letter and sends a check; the check's write raises before the dead letter
    is attempted: the dead letter must not stay claimed (DECIDING, every decision for it waiting)."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        dying, checked = await add_half(ctx, b"a"), await add_half(ctx, b"b")
        dying.checks = ctx.config.transaction_check_max

        async def send_checks(batch, now):
            raise RuntimeError("the check's write failed")

        tx._channel_for = lambda p: object()      # a producer to check with
        tx._send_checks = send_checks
        clock.now = max(dying.next_check, checked.next_check) + 1
        with pytest.raises(RuntimeError):
            await tx.run_due(clock.now)
        del tx._send_checks, tx._channel_for
        assert await asyncio.wait_for(tx.decide(dying.half_offset, COMMIT, group="PG"), 5) == COMMIT
        assert dying.half_offset not in tx.pending
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_new_half_at_a_queue_offset_a_cut_log_freed_is_not_taken_as_decided(tmp_path, monkeypatch):
    """truncate_corrupt_tail cut the log at a committed half; the decision table kept its COMMIT, and the next
    half stored at that queue offset was taken as decided by the following recovery: never checked."""
    import tests.unit.test_review_transactions as here
    real = StoreConfig
    monkeypatch.setattr(here, "StoreConfig", lambda **kw: real(truncate_corrupt_tail=True, **kw))
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    await add_half(ctx, b"kept")
    await tx.write_snapshot()             # a snapshot older than the cut: it is used, with the table
    cut = await add_half(ctx, b"cut")
    await tx.decide(cut.half_offset, COMMIT, group="PG")
    await add_half(ctx, b"after")         # valid data after the damage: the cut is a truncate_corrupt_tail
    await ctx.store._store.close()
    with open(tmp_path / "s" / "commitlog" / f"{0:020d}", "r+b") as f:
        f.seek(cut.half_offset + 4)
        f.write(b"\0\0\0\0")
    ctx = await make_service(tmp_path, clock)
    new = await add_half(ctx, b"new")
    assert new.queue_offset == cut.queue_offset
    await ctx.store._store.close()        # a crash before the new half is decided
    ctx = await make_service(tmp_path, clock)
    try:
        assert new.half_offset in ctx.tx.pending, "the new half was taken as decided by a gone half's COMMIT"
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_dead_letter_written_after_its_pass_was_cancelled_is_recorded_once(tmp_path):
    """A stop cancels the check timer while its pass waits for a max-checks dead letter. Its records were the
    writer's already and were written; the cancelled wait settled the decision as refused, so the transaction
    stayed pending with nothing recorded: the snapshot written at stop named it pending past its DEAD op, and
    after the restart it was dead-lettered a second time (an END COMMIT meanwhile would have overruled the
    first recorded decision)."""
    from broker.transaction.records import DEAD
    from protocol.txlog import DEAD_TOPIC
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    dying = await add_half(ctx, b"dying")
    dying.checks = tx.policy.check_max
    queued = asyncio.Event()
    real = ctx.store._store.put_many

    def put_many(reqs, reclaim=False, then=None):
        written = real(reqs, reclaim, then)
        queued.set()                        # handed to the writer: it will be written, whoever waits for it
        return written
    ctx.store.put_many = put_many
    clock.now = dying.next_check + 1
    passing = asyncio.ensure_future(tx.run_due(clock.now))
    await queued.wait()
    passing.cancel()                        # as timer.stop() does
    with pytest.raises(asyncio.CancelledError):
        await passing
    del ctx.store.put_many
    await add_half(ctx, b"after")           # the writer is FIFO: the dead letter's batch is done
    assert ctx.store.max_offset(DEAD_TOPIC, 0) == 1
    assert tx.decision_of(dying.half_offset) == DEAD and dying.half_offset not in tx.pending
    await tx.stop()
    await ctx.store._store.close()

    ctx2 = await make_service(tmp_path, clock)
    try:
        assert dying.half_offset not in ctx2.tx.pending and ctx2.tx.decision_of(dying.half_offset) == DEAD
        assert ctx2.tx.dead_count == 1
        await ctx2.tx.run_due(clock.now + 3_600_000)
        assert ctx2.store.max_offset(DEAD_TOPIC, 0) == 1, "dead-lettered twice"
    finally:
        await ctx2.store._store.close()


@bounded(20)
async def test_the_in_doubt_view_of_one_group_counts_that_group(tmp_path):
    """TXMQ_LIST_TRANSACTIONS with a group: its "total" (printed as "N undecided" under the group's rows) was
    every group's count, so a group with nothing in doubt read as having the whole broker's undecided ones."""
    import json

    from broker.processors.transaction import list_transactions
    from protocol.codes import RequestCode
    from protocol.command import RemotingCommand
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    try:
        for i in range(3):
            await add_half(ctx, f"a{i}".encode(), group="PG_A")
        await add_half(ctx, b"b", group="PG_B")

        def listed(**fields):
            cmd = RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, fields)
            return json.loads(list_transactions(ctx, None, cmd).body_bytes())
        assert listed()["total"] == 4 == len(ctx.tx.pending)
        one = listed(group="PG_B", limit=10)
        assert [r["group"] for r in one["pending"]] == ["PG_B"] and one["total"] == 1
        some = listed(group="PG_A", limit=1)
        assert len(some["pending"]) == 1 and some["total"] == 3
        assert listed(group="PG_NONE")["total"] == 0
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_slave_does_not_export_its_start_up_undecided_count(tmp_path):
    """A slave builds its undecided index once, at start-up, and never follows its master's decisions (its list
    is refused, its runtime info and oldest-half gauge leave it out). Its rocketmq_half_messages still exported
    that start-up count, for good: a half its master decided long ago stayed "undecided" there, and a sum over
    the cluster counted the master's ones twice."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    await add_half(ctx, b"undecided at the slave's start")
    await ctx.tx.stop()
    await ctx.store._store.close()
    slave = await make_service(tmp_path, clock, broker_role="SLAVE", broker_id=1,
                               ha_master_addr="127.0.0.1:1")
    try:
        assert len(slave.tx.pending) == 1       # the start-up index (the master goes on without it)
        assert slave.metrics.registry.get_sample_value("rocketmq_half_messages") == 0
    finally:
        await slave.store._store.close()
    master = await make_service(tmp_path, clock)
    try:
        assert master.metrics.registry.get_sample_value("rocketmq_half_messages") == 1
    finally:
        await master.store._store.close()


@bounded(20)
async def test_a_decision_written_with_the_resume_is_not_erased_by_it(tmp_path):
    """Admin resume of a dead letter and a producer's END COMMIT in one writer cycle: the commit is recorded as
    its records are written, then the resume went on and set the table back to undecided: the transaction was
    neither pending nor decided, and a repeated END got "Find prepared transaction message failed"."""
    from broker.transaction.core import Origin
    from broker.transaction.records import DEAD
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        p = await add_half(ctx)
        await tx.decide(p.half_offset, DEAD, reason="max-checks", origin=Origin.EXPIRY)

        async def end():        # queued right behind the RESUME record, before the writer runs
            answer = tx.end(p.half_offset, COMMIT, group="PG", table_offset=p.queue_offset, from_check=False)
            return answer if isinstance(answer, tuple) else await answer

        resumed, ended = await asyncio.gather(tx.resume(p.half_offset), end())
        assert ended == (0, COMMIT)
        assert p.half_offset not in tx.pending
        assert tx.decision_of(p.half_offset) == COMMIT
        assert tx.end(p.half_offset, COMMIT, group="PG", table_offset=p.queue_offset,
                      from_check=False) == (0, "already COMMIT; nothing changed")
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_an_end_whose_write_raises_leaves_no_pending_decision(tmp_path):
    """END_TRANSACTION written at once (the processor's ``later``): the store's put_many raises (a bug, not a
    refusal). The claim was never released, so the transaction's decision stayed under way: every later
    END, check answer or admin decision for it Waited for ever (the producer's retry timed out, the check
    timer's pass hung) instead of being written."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        p = await add_half(ctx)
        later = asyncio.get_running_loop().create_future()

        def put_many(reqs, reclaim=False, then=None):
            raise RuntimeError("a bug in the decision write")
        ctx.store.put_many = put_many
        with pytest.raises(RuntimeError):
            tx.end(p.half_offset, COMMIT, group="PG", table_offset=p.queue_offset, from_check=False, later=later)
        del ctx.store.put_many
        assert not later.done(), "answered through later as well as by the raise"
        assert p.half_offset in tx.pending and tx.decision_of(p.half_offset) is None
        assert p.half_offset not in tx._deciding, "the failed write's decision is still under way"
        again = asyncio.get_running_loop().create_future()
        assert tx.end(p.half_offset, COMMIT, group="PG", table_offset=p.queue_offset, from_check=False,
                      later=again) is None
        assert await asyncio.wait_for(again, 5) == (0, COMMIT)
        assert p.half_offset not in tx.pending and tx.decision_of(p.half_offset) == COMMIT
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_commit_into_a_queue_there_is_does_not_call_into_the_store_to_prepare_it(tmp_path):
    """A COMMIT opens its message's queue's file first when it is new (EMFILE refused, the half kept); into a
    queue there is -- every commit but the first of each queue -- that must cost a set lookup, not two calls into
    the store (prepare_queue, for the message's queue and the op queue) on the broker's busiest path."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        first, second = await add_half(ctx, b"a"), await add_half(ctx, b"b")
        later = asyncio.get_running_loop().create_future()
        assert tx.end(first.half_offset, COMMIT, group="PG", table_offset=first.queue_offset, from_check=False,
                      later=later) is None
        assert await asyncio.wait_for(later, 5) == (0, COMMIT)
        calls = []
        real = ctx.store._store.prepare_queue
        ctx.store.prepare_queue = lambda topic, qid: calls.append((topic, qid)) or real(topic, qid)
        later = asyncio.get_running_loop().create_future()
        assert tx.end(second.half_offset, COMMIT, group="PG", table_offset=second.queue_offset, from_check=False,
                      later=later) is None
        assert await asyncio.wait_for(later, 5) == (0, COMMIT)
        del ctx.store.prepare_queue
        assert calls == []
    finally:
        await ctx.store._store.close()


def _checks_sent_to(pending) -> list:
    """The list ``pending``'s checks land in: its producer, a live channel that keeps what it is sent."""
    sent = []

    class Producer:
        is_open = True

        def oneway(self, cmd):
            sent.append(cmd)
    pending.owner = Producer()
    return sent


def first_queue_files_made_on_loop(monkeypatch) -> list:
    """(topic, queue id) of every queue whose first file ConsumeQueue makes itself from here on: on the event
    loop, where the store's queue-file thread should have made it."""
    from broker.store.consume_queue import ConsumeQueue

    made = []
    real = ConsumeQueue._new_file

    def new_file(self, byte):
        if not self.files:
            made.append((self.topic, self.queue_id))
        return real(self, byte)
    monkeypatch.setattr(ConsumeQueue, "_new_file", new_file)
    return made


@bounded(20)
async def test_checks_whose_records_a_full_disk_refuses_are_not_sent_and_say_so(tmp_path, caplog):
    """A check goes out only once its record is written; on a full disk the record is refused, and the pass ended
    with no check sent and not a word in the log (the transactions waited in silence). Now it says how many and
    why; they are not counted as checked and stay on the schedule."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        pending = await add_half(ctx, b"waiting")
        sent = _checks_sent_to(pending)
        ctx.store.gate, ctx.store.fail = asyncio.Event(), True
        ctx.store.gate.set()
        clock.now = pending.next_check + 1
        with caplog.at_level(logging.WARNING, logger="txmq.transaction"):
            await tx.run_due(clock.now)
        assert sent == [] and pending.checks == 0 and tx.next_due() is not None
        assert any("1 transaction checks not sent" in r.getMessage() and "refused" in r.getMessage()
                   for r in caplog.records)
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_check_records_that_open_the_op_queue_have_its_file_made_off_the_loop(tmp_path, monkeypatch, caplog):
    """A new broker whose first transactions were never decided: their check records are the op queue's first.
    Put straight to the writer, the queue's first file was made on the event loop (what the queue-file thread
    is for), and past the open-files limit the records were stored with their units waiting in memory. They
    wait for the file as a decision and a sender record do; a file that cannot be made is a refusal, said once
    a pass, the check not counted and asked again later."""
    from broker.topics import OP_TOPIC

    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        pending = await add_half(ctx, b"never decided")
        assert (OP_TOPIC, 0) not in ctx.store.queue_index           # nothing decided yet: no op queue
        sent = _checks_sent_to(pending)
        made_on_loop = first_queue_files_made_on_loop(monkeypatch)
        clock.now = pending.next_check + 1
        await tx.run_due(clock.now)
        assert len(sent) == 1 and pending.checks == 1
        assert ctx.store.max_offset(OP_TOPIC, 0) == 1 and made_on_loop == []
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_check_records_whose_op_queue_file_cannot_be_made_are_refused_and_said(tmp_path, monkeypatch, caplog):
    """The op queue's first file cannot be made (the open-files limit): no check goes out unrecorded; the pass
    says so once, the attempt is not counted, and the transaction stays on the schedule."""
    import errno

    from broker.topics import OP_TOPIC

    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        pending = await add_half(ctx, b"never decided")
        sent = _checks_sent_to(pending)

        def no_file(topic, queue_id):
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(OSError(errno.EMFILE, "Too many open files"))
            return fut
        monkeypatch.setattr(ctx.store._store, "queue_file", no_file)
        clock.now = pending.next_check + 1
        with caplog.at_level(logging.WARNING, logger="txmq.transaction"):
            await tx.run_due(clock.now)
        assert sent == [] and pending.checks == 0 and tx.next_due() is not None
        assert (OP_TOPIC, 0) not in ctx.store.queue_index
        assert any("1 transaction checks not sent" in r.getMessage() and "op queue file" in r.getMessage()
                   for r in caplog.records)
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_checks_a_full_disk_refuses_are_said_once_a_pass_however_many_slices_it_takes(tmp_path, caplog):
    """The warning was written per slice of CHECK_SLICE (256) transactions, not per pass: 50000 transactions
    waiting on a full disk logged about 200 lines every check interval. Now one line a pass, with the total."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    tx.CHECK_SLICE = 1          # a slice each: three slices in the pass
    try:
        halves = [await add_half(ctx, bytes([65 + i])) for i in range(3)]

        class Producer:
            is_open = True

            def oneway(self, cmd):
                raise AssertionError("a check went out without its record")
        for p in halves:
            p.owner = Producer()
        ctx.store.gate, ctx.store.fail = asyncio.Event(), True
        ctx.store.gate.set()
        clock.now = max(p.next_check for p in halves) + 1
        with caplog.at_level(logging.WARNING, logger="txmq.transaction"):
            await tx.run_due(clock.now)
        said = [r.getMessage() for r in caplog.records if "transaction checks not sent" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("3 transaction checks not sent"), said
        assert all(p.checks == 0 for p in halves)
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_checks_a_closing_connection_does_not_take_are_said_in_one_line_with_their_count(tmp_path, caplog):
    """A producer disconnected while its due checks were written: "check of <key> not sent: connection ... is
    closed" was said once for each of them (60 lines in one burst; 100,000 due transactions, as many lines). Now
    one line for the slice, with the count, a few of the keys and why; each is due again as before."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        halves = [await add_half(ctx, b"%d" % i) for i in range(60)]

        class Closing:
            is_open = True

            def oneway(self, cmd):
                self.is_open = False
                raise ConnectionError("connection 127.0.0.1:5 is closed")
        closing = Closing()
        for p in halves:
            p.owner = closing
        clock.now = max(p.next_check for p in halves) + 1
        with caplog.at_level(logging.INFO, logger="txmq.transaction"):
            await tx.run_due(clock.now)
        said = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
        assert len(said) == 1, said
        assert said[0].startswith("60 transaction checks written but not sent (") and "and 57 more" in said[0]
        assert said[0].endswith("connection 127.0.0.1:5 is closed"), said
        assert all(p.checks == 1 and p.check_channel is None for p in halves)
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_resume_whose_indexed_dead_letter_is_damaged_falls_back_to_the_halfs_mark(tmp_path, caplog):
    """The dead letter the message index names is decoded to read its sender: a damaged one (its body length past
    its record) raised out of the resume, which failed -- the transaction stayed dead-lettered -- where a damaged
    half is taken as no half (_half_at). The lookup is a help to the resume: it falls back to the half's mark,
    said."""
    import struct
    from broker.transaction.records import DEAD, DEAD_TOPIC
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx, store = ctx.tx, ctx.store._store
    p = await add_half(ctx, b"dead-then-damaged")
    await tx.decide(p.half_offset, DEAD, reason="max-checks")
    phy = store.queue_unit(DEAD_TOPIC, 0, 0)[0]

    class Index:
        partial = stopped = False

        async def query(self, topic, key, max_num, begin, end):
            return QueryResult([phy], 0, 0, False)
    ctx.index = Index()
    view = store.get_record(phy)
    at = 4 + 4 + 4 + 4 + 4 + 8 + 8 + 4 + 8 + 8 + 8 + 8 + 4 + 8     # the body length (IPv4 hosts)
    view[at:at + 4] = struct.pack(">i", 1 << 30)
    try:
        with caplog.at_level(logging.WARNING, logger="txmq.transaction"):
            await tx.resume(p.half_offset)
        assert p.half_offset in tx.pending and tx.pending[p.half_offset].owner_id == ""
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("dead letter" in m and str(phy) in m for m in said), said
    finally:
        await store.close()


@bounded(20)
async def test_a_resume_whose_dead_letter_lookup_was_cut_says_so(tmp_path, caplog):
    """The message index reads at most max_checks records of a key's hash (IndexService: keys sharing its
    String.hashCode, which any client can make, in any topic). A lookup of the dead letter that stopped there
    answered nothing, and the resume's checks went to the group's producers in turn unsaid (as a partial index's
    did before it was said): the resume now says its dead letter was not looked up in the whole index."""
    from broker.transaction.records import DEAD
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx, store = ctx.tx, ctx.store._store
    p = await add_half(ctx, b"dead-behind-collisions")
    await tx.decide(p.half_offset, DEAD, reason="max-checks")

    class Index:
        partial = stopped = False
        max_checks = 4096

        async def query(self, topic, key, max_num, begin, end):
            return QueryResult([], 0, 0, True)
    ctx.index = Index()
    try:
        with caplog.at_level(logging.WARNING, logger="txmq.transaction"):
            await tx.resume(p.half_offset)
        assert p.half_offset in tx.pending
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(m.startswith(f"resume of the transaction at {p.half_offset}: its dead letter") and "hashCode" in m
                   for m in said), said
    finally:
        await store.close()


@bounded(20)
@pytest.mark.parametrize("how", ["catching-up", "cut", "stalled"])
async def test_commits_naming_removed_halves_whose_lookup_could_not_see_it_all_are_said_gated(tmp_path, caplog, how):
    """A COMMIT naming an offset below the log looks its dead letter up in the message index; a lookup that could
    not see it all (the index catching up or stopped, cut at max_checks, its thread stalled) said so at WARNING for
    each END: any client sending oneway COMMITs with made-up offsets below the log (free: no half needed) wrote a
    line of ~300 bytes each, 1,000 ENDs 1,000 lines. On the END path it is said once a 10 s, as the other
    refusals any client can repeat; a resume (an operator's, one at a time) still says each."""
    from protocol.errors import StoreError
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx

    class Index:
        partial = how == "catching-up"
        stopped = False
        covered = 0
        max_checks = 4096

        async def query(self, topic, key, max_num, begin, end):
            if how == "stalled":
                raise StoreError("the message index's thread has not come through in 31 s")
            return QueryResult([], 0, 0, how == "cut", 0 if how == "catching-up" else None)
    ctx.index = Index()
    tx._half_removed = lambda offset: 0 <= offset < 1 << 40     # retention removed everything below
    try:
        with caplog.at_level(logging.WARNING, logger="txmq.transaction"):
            for off in range(1000):
                answer = await tx.end(off, COMMIT, group="PG", table_offset=0, from_check=False,
                                      keys=(f"K{off}", f"M{off}"))
                assert answer[1] == "Find prepared transaction message failed", answer
        said = [r.getMessage() for r in caplog.records if "dead letter not looked up" in r.getMessage()]
        assert len(said) == 1, (len(said), said[:3])
        assert ctx.metrics.refused.labels("end-half-removed")._value.get() == 1000
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_commits_naming_removed_halves_look_their_dead_letters_up_one_at_a_time(tmp_path):
    """Each COMMIT naming an offset below the log queues a query on the message index's one thread (two: its
    transactionId and its msgId). A query of a key sharing its String.hashCode with 4,096 stored records holds that
    thread ~110 ms; 1,024 oneway ENDs in flight on one connection queued them all at once, the indexing of new
    records and every client's QUERY_MESSAGE behind them. Those lookups now go one at a time: the ENDs wait their
    turn (each is still answered, its dead letter still found), the index thread's queue holds one of them."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    running, most, asked = [0], [0], [0]

    class Index:
        partial = stopped = False

        async def query(self, topic, key, max_num, begin, end):
            running[0] += 1
            asked[0] += 1
            most[0] = max(most[0], running[0])
            for _ in range(3):
                await asyncio.sleep(0)      # the index thread's turn
            running[0] -= 1
            return QueryResult([], 0, 0, False)
    ctx.index = Index()
    tx._half_removed = lambda offset: 0 <= offset < 1 << 40
    try:
        answers = await asyncio.gather(*(tx.end(off, COMMIT, group="PG", table_offset=0, from_check=False,
                                                keys=(f"K{off}", f"M{off}")) for off in range(200)))
        assert {a[1] for a in answers} == {"Find prepared transaction message failed"}
        assert (asked[0], most[0]) == (400, 1)
    finally:
        await ctx.store._store.close()


async def test_late_commits_of_removed_halves_past_the_lines_a_minute_are_named_by_their_dead_letters(
        tmp_path, caplog):
    """A late COMMIT of a half retention removed is said at ERROR with its dead letter's id (it cannot be resumed:
    `admin resume` refuses an offset below the log). Past the 20 lines a minute, such COMMITs were named in the
    minute's summary line by their half offsets alone, "each is on the dead-letter topic until `admin resume
    OFFSET` checks it again": the one thing that cannot deliver them. The summary names their dead letters."""
    from broker.transaction.core import Reply
    from broker.transaction.records import DEAD, DEAD_TOPIC
    from protocol.codes import ResponseCode
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx, store = ctx.tx, ctx.store._store
    dead_at: dict[str, int] = {}
    halves = []
    for i in range(25):
        p = await add_half(ctx, b"removed-%d" % i)
        await tx.decide(p.half_offset, DEAD, reason="expired")
        dead_at[p.uniq_key] = store.queue_unit(DEAD_TOPIC, 0, i)[0]
        halves.append(p)

    class Index:
        partial = stopped = False

        async def query(self, topic, key, max_num, begin, end):
            return QueryResult([dead_at[key]] if key in dead_at else [], 0, 0, False)
    ctx.index = Index()
    said = tx._dead_commit_said
    ticks = [0.0]
    said.clock = lambda: ticks[0]
    caplog.set_level(logging.ERROR, logger="txmq")
    refused = Reply(ResponseCode.SYSTEM_ERROR, "Find prepared transaction message failed", "no-half")
    try:
        for p in halves:
            code, remark = await tx._commit_after_removed(p.half_offset, "PG", (p.uniq_key,), refused)
            assert code == ResponseCode.TRANSACTION_FAILED and "removed by retention" in remark, remark
        ticks[0] = 61.0
        tx.say_unsaid_dead_commits()
        (summary,) = [r.getMessage() for r in caplog.records if "more transactions already dead-lettered" in
                      r.getMessage()]
        for p in halves[20:]:
            where = offset_msg_id(ctx.store_host, dead_at[p.uniq_key])
            assert f"{p.half_offset} (removed: dead letter {where})" in summary, summary
        assert "admin show-msg" in summary, summary
    finally:
        await store.close()


def _commit_late(ctx, offsets) -> None:
    """A producer's COMMIT of each of these dead-lettered transactions, as the service counts and says it."""
    from broker.transaction.core import Reply
    from protocol.codes import ResponseCode
    for off in offsets:
        ctx.tx._count(Reply(ResponseCode.TRANSACTION_FAILED, f"transaction already DEAD (dead-lettered); COMMIT "
                            f"refused: its message is on the dead-letter topic, `admin resume {off}` checks it again",
                            "commit-after-dead"), "PG", off)


async def test_every_commit_after_a_dead_letter_is_named_even_past_the_lines_a_minute(tmp_path, caplog):
    """The ERROR naming a dead-lettered transaction its producer committed, with the `admin resume OFFSET` it needs,
    is said 20 a minute at most: past that (a group's backlog dead-lettered, then its late COMMITs in a burst) the
    rest were counted in txmq_transaction_commits_after_dead_letter_total and named nowhere, so which dead letters
    to resume was again known to nobody. They are named together once the minute is over (the snapshot loop's
    turn), one line, each offset once."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    said = ctx.tx._dead_commit_said
    ticks = [0.0]
    said.clock = lambda: ticks[0]
    caplog.set_level(logging.ERROR, logger="txmq")
    offsets = list(range(1000, 1030))
    _commit_late(ctx, offsets)
    assert ctx.metrics.child(ctx.metrics.commits_after_dead, "PG")._value.get() == 30
    ticks[0] = 61.0
    ctx.tx.say_unsaid_dead_commits()
    text = caplog.text
    assert [off for off in offsets if f"admin resume {off}" not in text and f" {off}" not in text] == []
    ctx.tx.say_unsaid_dead_commits()        # said once
    assert caplog.text == text
    await ctx.store._store.close()


async def test_commits_after_a_dead_letter_are_named_in_the_minute_after_a_busy_one(tmp_path, caplog):
    """The minute after one past its 20 lines holds room for the keys it held back (EveryKey's first claim): a new
    one refused for that room, not for the 20 said, was kept for no summary and named nowhere."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    said = ctx.tx._dead_commit_said
    ticks = [0.0]
    said.clock = lambda: ticks[0]
    caplog.set_level(logging.ERROR, logger="txmq")
    _commit_late(ctx, range(1000, 1030))
    ticks[0] = 61.0
    ctx.tx.say_unsaid_dead_commits()
    offsets = list(range(2000, 2030))
    _commit_late(ctx, offsets)
    ticks[0] = 122.0
    ctx.tx.say_unsaid_dead_commits()
    text = caplog.text
    assert [off for off in offsets if f"admin resume {off}" not in text and f" {off}" not in text] == []
    await ctx.store._store.close()


async def test_commits_after_a_dead_letter_past_the_lines_a_minute_are_named_at_stop(tmp_path, caplog):
    """Those past the 20 ERROR lines a minute wait for the minute's end to be named (the snapshot loop's turn): a
    stop within that minute cancelled the loop and dropped them, counted and named nowhere (a stock client's END
    comes once), which dead letters to resume again known to nobody. The stop names them."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    said = ctx.tx._dead_commit_said
    said.clock = lambda: 0.0        # the minute is not over when the stop comes
    caplog.set_level(logging.ERROR, logger="txmq")
    offsets = list(range(1000, 1030))
    _commit_late(ctx, offsets)
    await ctx.tx.stop()
    text = caplog.text
    assert [off for off in offsets if f"admin resume {off}" not in text and f" {off}" not in text] == []
    await ctx.store._store.close()


@bounded(60)
async def test_many_transactions_reaching_the_check_limit_together_are_dead_lettered_in_a_few_flushes(
        tmp_path, monkeypatch):
    """A burst of halves whose producer group went away reaches transaction_check_max in one pass: their dead
    letters were written one after another, each waited for, one sync flush each (300 halves, 300 flushes in a row
    on the check pass; the next slice's checks behind them)."""
    from broker.transaction.records import DEAD
    from protocol.txlog import DEAD_TOPIC
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        dying = [await add_half(ctx, f"abandoned-{n}".encode()) for n in range(300)]
        for p in dying:
            p.checks = tx.policy.check_max
        writer = type(ctx.store._store._writer)
        flushes, start = [], writer._start_flush
        monkeypatch.setattr(writer, "_start_flush", lambda self: flushes.append(1) or start(self))
        clock.now = max(p.next_check for p in dying) + 1
        await tx.run_due(clock.now)
        assert ctx.store.max_offset(DEAD_TOPIC, 0) == len(dying)
        assert all(tx.decision_of(p.half_offset) == DEAD for p in dying) and not tx.pending and not tx._deciding
        assert len(flushes) <= 30, len(flushes)
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_transactions_reaching_the_check_limit_in_one_pass_are_said_in_one_warning(tmp_path, caplog):
    """A burst of halves whose producers all crashed reaches transaction_check_max in one pass: each dead letter was
    said in a WARNING of its own (300 here; 100,000 halves, 100,000 lines, written on the event loop as the pass
    ran), where retention's and an expiry plan's are said together. A pass's max-check dead letters are one
    WARNING now, the first few named and the rest counted; one alone is said as before."""
    from broker.transaction.records import DEAD
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    caplog.set_level(logging.WARNING, logger="txmq")
    try:
        dying = [await add_half(ctx, f"abandoned-{n}".encode()) for n in range(300)]
        for p in dying:
            p.checks = tx.policy.check_max
        clock.now = max(p.next_check for p in dying) + 1
        await tx.run_due(clock.now)
        assert all(tx.decision_of(p.half_offset) == DEAD for p in dying)
        said = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
        assert len(said) == 1, len(said)
        assert said[0].startswith("300 transactions dead-lettered: max-checks"), said[0]
        assert "and 295 more" in said[0] and dying[0].uniq_key in said[0], said[0]
        assert not tx._said_together
        caplog.clear()
        alone = await add_half(ctx, b"abandoned-alone")
        alone.checks = tx.policy.check_max
        clock.now = alone.next_check + 1
        await tx.run_due(clock.now)
        said = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
        assert len(said) == 1 and alone.uniq_key in said[0] and f"after {tx.policy.check_max} checks" in said[0], said
    finally:
        await ctx.store._store.close()


def _refuse_puts(store, bodies=None):
    """The store refuses the writes waited on (no room for a new segment: the completion comes later, nothing
    written), those of records holding one of ``bodies`` only, if given; returns its own put_many."""
    put_many = store.put_many

    def refusing(reqs, reclaim=False, then=None):
        if then is not None and (bodies is None or any(b in bytes(req.record) for req in reqs for b in bodies)):
            asyncio.get_running_loop().call_soon(
                then.set_result, [PutResult(PutStatus.CREATE_MAPPED_FILE_FAILED)] * len(reqs))
            return None
        return put_many(reqs, reclaim, then)
    store.put_many = refusing
    return put_many


@bounded(60)
async def test_dead_letters_refused_inside_a_batch_are_each_retried_and_the_others_written(tmp_path, caplog):
    """Of 40 transactions reaching transaction_check_max in one pass (two batches of dead letters queued together),
    the store refuses 5, in both batches and at their edges: the refused ones are said, each stays undecided and is
    scheduled an interval on (not left off the schedule, never checked again), none is counted or recorded dead that
    is not in the log, and the next pass dead-letters them."""
    from broker.transaction.records import DEAD
    from protocol.txlog import DEAD_TOPIC
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx, store = ctx.tx, ctx.store._store
    try:
        dying = [await add_half(ctx, f"abandoned-{n:03d}".encode()) for n in range(40)]
        for p in dying:
            p.checks = tx.policy.check_max
        refused_at = (0, 3, 31, 32, 39)
        refused = {dying[i].half_offset for i in refused_at}
        bodies = [f"abandoned-{i:03d}".encode() for i in refused_at]
        put_many = _refuse_puts(store, bodies)
        clock.now = max(p.next_check for p in dying) + 1
        await tx.run_due(clock.now)
        assert ctx.store.max_offset(DEAD_TOPIC, 0) == 35
        assert {p.half_offset for p in dying if tx.decision_of(p.half_offset) == DEAD} == {
            p.half_offset for p in dying} - refused
        assert set(tx.pending) == refused and not tx._deciding
        assert all(tx.pending[off].next_check == clock.now + tx.policy.check_interval_ms for off in refused)
        assert caplog.text.count("5 transactions at the check limit not dead-lettered") == 1
        store.put_many = put_many
        clock.now += tx.policy.check_interval_ms + 1
        await tx.run_due(clock.now)
        assert ctx.store.max_offset(DEAD_TOPIC, 0) == 40 and not tx.pending
    finally:
        await store.close()


async def _halves_at_the_check_limit(tmp_path, caplog, n: int):
    """A service logging its WARNINGs and ``n`` halves whose checks are all spent, which its next pass
    dead-letters: (clock, context, halves)."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    caplog.set_level(logging.WARNING, logger="txmq")
    dying = [await add_half(ctx, f"abandoned-{i:03d}".encode()) for i in range(n)]
    for p in dying:
        p.checks = ctx.tx.policy.check_max
    return clock, ctx, dying


@bounded(60)
async def test_dead_letters_the_store_refuses_in_a_pass_are_said_in_one_error(tmp_path, caplog):
    """A full disk refuses every dead letter of a burst reaching transaction_check_max: each refusal was an ERROR
    line of its own, again at every interval while the disk stayed full (300 a pass here; 100,000 halves, 100,000
    lines a minute, onto the disk that is full), where the pass's refused check records are one line. One ERROR a
    pass now says how many, why, the first few halves, and that they are tried again an interval on."""
    clock, ctx, dying = await _halves_at_the_check_limit(tmp_path, caplog, 300)
    tx, store = ctx.tx, ctx.store._store
    try:
        put_many = _refuse_puts(store)
        clock.now = max(p.next_check for p in dying) + 1
        await tx.run_due(clock.now)
        assert len(tx.pending) == 300
        assert all(p.next_check == clock.now + tx.policy.check_interval_ms for p in dying)
        said = [r.getMessage() for r in caplog.records if "dead-letter" in r.getMessage()]
        assert len(said) == 1, len(said)
        assert said[0].startswith("300 transactions at the check limit not dead-lettered"), said[0]
        assert "CREATE_MAPPED_FILE_FAILED" in said[0] and str(dying[0].half_offset) in said[0], said[0]
        store.put_many = put_many
        clock.now += tx.policy.check_interval_ms + 1
        await tx.run_due(clock.now)
        assert not tx.pending
    finally:
        await store.close()


@bounded(60)
async def test_dead_letters_not_written_for_different_reasons_in_a_pass_each_say_theirs(tmp_path, caplog):
    """The pass's dead letters not written were one ERROR with the first one's reason for all: a half gone from
    the log (not a full disk: it never will be written) said among a full disk's refusals was said as refused by the
    store, or 9 refusals as `Find prepared transaction message failed`, the operator sent to the wrong problem. One
    ERROR a reason, each with its count and its own halves."""
    clock, ctx, dying = await _halves_at_the_check_limit(tmp_path, caplog, 10)
    tx, store = ctx.tx, ctx.store._store
    try:
        gone = dying[7].half_offset
        verified = store.verified_record
        ctx.store.verified_record = lambda off, what: None if off == gone else verified(off, what)
        put_many = _refuse_puts(store)
        clock.now = max(p.next_check for p in dying) + 1
        await tx.run_due(clock.now)
        assert len(tx.pending) == 10
        said = [r.getMessage() for r in caplog.records if "not dead-lettered" in r.getMessage()]
        assert len(said) == 2, said
        refused = next(line for line in said if "CREATE_MAPPED_FILE_FAILED" in line)
        missing = next(line for line in said if "Find prepared transaction message failed" in line)
        assert refused.startswith("9 transactions") and f"half {gone})" not in refused, refused
        assert missing.startswith("1 transactions") and f"half {gone})" in missing, missing
        caplog.clear()      # a reason may name its transaction (a store stopped read-only): not a line each
        tx._dead_refused = [(p, f"store refused the decision: SERVICE_NOT_AVAILABLE ({p.uniq_key})") for p in dying]
        tx._say_dead_refused()
        said = [r.getMessage() for r in caplog.records if "not dead-lettered" in r.getMessage()]
        assert len(said) == 6 and said[0].startswith("5 more transactions"), said
        store.put_many = put_many
    finally:
        await store.close()


@bounded(60)
async def test_due_transactions_of_a_group_with_no_producer_are_said_every_ten_minutes(tmp_path, caplog):
    """A producer group none of whose producers is connected (all crashed, or the service retired with halves
    undecided): its due transactions were deferred an interval at a time, for hours, counted in
    txmq_transaction_checks_deferred_total and said in no line: a broker without Prometheus said nothing until
    retention dead-lettered them as expired, days on. A WARNING says it now, once every 10 minutes a group: how many
    wait, and what to do."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    caplog.set_level(logging.WARNING, logger="txmq")
    try:
        waiting = [await add_half(ctx, f"orphan-{n}".encode(), group="PG_gone") for n in range(50)]
        clock.now = max(p.next_check for p in waiting) + 1
        for n in range(5):      # five passes, an interval apart: each defers all 50 again
            await tx.run_due(clock.now)
            clock.now += tx.policy.check_interval_ms + 1
            if n == 0:          # nobody for less than an interval (a producer restarting): not said yet
                assert "no producer of the group is connected" not in caplog.text
        assert ctx.metrics.child(ctx.metrics.checks_skipped, "PG_gone")._value.get() == 250
        said = [r.getMessage() for r in caplog.records if "no producer of the group is connected" in r.getMessage()]
        assert len(said) == 1, said
        assert said[0].startswith("50 undecided transactions of producer group PG_gone"), said[0]
        assert "admin list --group PG_gone" in said[0], said[0]
        clock.now += 600_000
        await tx.run_due(clock.now)
        said = [r.getMessage() for r in caplog.records if "no producer of the group is connected" in r.getMessage()]
        assert len(said) == 2, said
        assert all(p.checks == 0 for p in waiting)      # no check spent meanwhile
        tx.producer_joined("PG_gone")   # one came, then went again before its checks: an interval before it is said
        clock.now += 600_001
        await tx.run_due(clock.now)
        assert len([r for r in caplog.records if "no producer of the group is connected" in r.getMessage()]) == 2
    finally:
        await ctx.store._store.close()


def _nobody_said_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no producer of the group is connected" in r.getMessage()]


async def _nobody_said_in_passes(tmp_path, caplog, groups: list[str], passes: int, step_ms: int | None = None):
    """A half of each of ``groups``, none of whose producers is here, checked in ``passes`` passes ``step_ms`` apart
    (an interval, if not given): (the no-producer lines said, the groups named in them, the service)."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    caplog.set_level(logging.WARNING, logger="txmq")
    try:
        clock.now = max([(await add_half(ctx, f"orphan-{g}".encode(), group=g)).next_check for g in groups]) + 1
        for _ in range(passes):
            await tx.run_due(clock.now)
            clock.now += step_ms or tx.policy.check_interval_ms + 1
    finally:
        await ctx.store._store.close()
    said = _nobody_said_of(caplog)
    return said, {g for g in groups if any(f"producer group {g} came" in line for line in said)}, tx


@bounded(60)
async def test_more_groups_with_no_producer_than_the_table_holds_are_still_said(tmp_path, caplog, monkeypatch):
    """The groups whose due transactions found nobody are timed in a table of at most _SILENT_KEYS_MAX groups,
    cleared when full: with one group more than it holds deferred every pass, each pass cleared it on the way round
    and began every group's interval again, and no group was ever said (hours of passes, no line), the real orphaned
    group included among a client's made-up ones. Groups with nothing deferred any more go first; a group the table
    has no room for is said without the interval's grace (the 20 a window still bound the lines)."""
    import broker.transaction.service as service
    monkeypatch.setattr(service, "_SILENT_KEYS_MAX", 3)
    groups = [f"PG_gone_{n}" for n in range(4)]
    said, named, tx = await _nobody_said_in_passes(tmp_path, caplog, groups, 5)
    assert named == set(groups), said
    assert len(tx._nobody_since) <= 3


@bounded(60)
async def test_groups_with_no_producer_past_a_window_s_twenty_are_said_in_a_later_window(tmp_path, caplog):
    """At most 20 groups with no producer are said a 10-minute window; the 21st waits for the next one. The same 20
    came first in every pass (due in the same order), each due again as the window turned: they took every window's
    20 and the 21st was never said, however long it waited. Each said group waits out the next window's others."""
    groups = [f"PG_gone_{n:02d}" for n in range(21)]
    said, named, _ = await _nobody_said_in_passes(tmp_path, caplog, groups, 40, 60_000)   # 4 windows
    assert named == set(groups), sorted(line.split(" came")[0] for line in said)
    assert len(said) <= 20 * 4, len(said)


@bounded(60)
async def test_large_halves_reaching_the_check_limit_are_dead_lettered_a_few_bytes_at_a_time(tmp_path, monkeypatch):
    """As retention's (test_large_expired_halves_are_dead_lettered_a_few_bytes_at_a_time): the check pass's dead
    letters queued together end at DEAD_LETTER_BATCH_BYTES of halves as well as at DEAD_LETTER_BATCH."""
    import broker.transaction.service as service
    from protocol.txlog import DEAD_TOPIC
    from tests.unit.test_retention import DeadLettersQueued
    monkeypatch.setattr(service, "DEAD_LETTER_BATCH_BYTES", 50 * 1024, raising=False)
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        dying = [await add_half(ctx, bytes([65 + n]) * 10 * 1024) for n in range(10)]
        for p in dying:
            p.checks = tx.policy.check_max
        queued = DeadLettersQueued(ctx.store._store)
        clock.now = max(p.next_check for p in dying) + 1
        await tx.run_due(clock.now)
        assert ctx.store.max_offset(DEAD_TOPIC, 0) == 10 and not tx.pending and queued.now == 0
        assert 2 * 20 * 1024 < queued.most < 4 * 20 * 1024, queued.most
    finally:
        await ctx.store._store.close()


@pytest.mark.parametrize("own", [None, "7"])
async def test_a_check_of_a_half_with_no_room_for_its_count_goes_without_it(own):
    """TRANSACTION_CHECK_TIMES on a check's message must not keep the check from going: a half stored with
    32767 bytes of properties has no room for it, and an encode error there is a check never sent, each pass.
    Nor may the producer's own value stand in for it there: a listener read 7 as the broker's seventh ask (and
    gave up at its first), the very misreading the count replaces; the check goes with no count at all."""
    from broker.transaction.service import _with_check_count
    from protocol.message import MAX_PROPERTIES_LENGTH, MessageExt, decode_record, properties_to_string
    props = {} if own is None else {Prop.TRANSACTION_CHECK_TIMES: own}
    props["fill"] = ""
    props["fill"] = "y" * (MAX_PROPERTIES_LENGTH - len(properties_to_string(props).encode()))
    full = MessageExt("T", b"body", properties=dict(props), store_host=("127.0.0.1", 10911))
    props.pop(Prop.TRANSACTION_CHECK_TIMES, None)
    assert decode_record(_with_check_count(full, 12))[0].properties == props      # (12: longer than any own)
    roomy = MessageExt("T", b"body", properties={"k": "v"}, store_host=("127.0.0.1", 10911))
    assert decode_record(_with_check_count(roomy, 3))[0].properties == {"k": "v", Prop.TRANSACTION_CHECK_TIMES: "3"}


class _IndexCaughtUpSince:
    """A message index whose answer was from a prefix of the log (``behind``) and that caught up before the
    awaiting coroutine ran again."""
    partial = stopped = False
    covered, max_checks = 1 << 20, 4096

    async def query(self, topic, key, max_num, begin, end):
        return QueryResult([], 0, 0, False, 4096)


@bounded(10)
async def test_a_dead_letter_lookup_answered_from_a_prefix_of_the_log_says_so(caplog):
    """The resume's dead-letter lookup read ``index.partial`` after its answer came back, not the answer's own
    ``behind``: an answer from a prefix of the log (a start's catch-up) whose catch-up ended before the coroutine
    ran again was taken as searched in full, the checks sent to the group's producers in turn unsaid."""
    from types import SimpleNamespace
    half = SimpleNamespace(properties={Prop.UNIQ_KEY: "U1"}, physical_offset=77)
    tx = SimpleNamespace(ctx=SimpleNamespace(index=_IndexCaughtUpSince(), store=None))
    tx._dead_letter_of = lambda *args, **kw: TransactionService._dead_letter_of(tx, *args, **kw)
    with caplog.at_level(logging.WARNING, logger="txmq"):
        assert await TransactionService._dead_letter_sender(tx, half) == ""
    said = [r.getMessage() for r in caplog.records if "not looked up in the whole log" in r.getMessage()]
    assert len(said) == 1 and "to offset 4096" in said[0], caplog.text
