"""Start-up from the transaction snapshot and the op records after it; the decision table on disk.

A real store with a controllable clock. "Crash" = the store is closed (its records are durable, as after
kill -9 of a process whose page cache survives) without the transaction service's stop, so the snapshot
on disk is whatever was last written.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os

from broker.transaction.decisions import DecisionTable
from broker.transaction.records import COMMIT, DEAD, ROLLBACK
from protocol.message import Prop
from tests.support.bounded import bounded
from tests.unit.test_review_transactions import (Clock, add_half, first_queue_files_made_on_loop, half_stored_while,
                                                 make_service)


def _snapshot(ctx) -> dict:
    with open(os.path.join(ctx.store.store_dir, "transactions", "snapshot.json")) as f:
        return json.load(f)


async def _history(ctx, n: int = 30):
    """n halves: a third committed, a third rolled back, a third undecided (one dead-lettered)."""
    halves = [await add_half(ctx, f"h{i}".encode()) for i in range(n)]
    for i, p in enumerate(halves):
        if i % 3 == 0:
            await ctx.tx.decide(p.half_offset, COMMIT, group="PG")
        elif i % 3 == 1:
            await ctx.tx.decide(p.half_offset, ROLLBACK, group="PG")
    await ctx.tx.decide(halves[2].half_offset, DEAD, reason="max-checks")
    return halves


def _expected(halves):
    want = {}
    for i, p in enumerate(halves):
        want[p.half_offset] = COMMIT if i % 3 == 0 else ROLLBACK if i % 3 == 1 else None
    want[halves[2].half_offset] = DEAD
    return want


@bounded(30)
async def test_a_clean_restart_reads_the_snapshot_not_the_history(tmp_path, caplog):
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    halves = await _history(ctx)
    ctx.tx.pending[halves[5].half_offset].checks = 4
    await ctx.tx.stop()
    await ctx.store._store.close()
    snap = _snapshot(ctx)
    assert snap["op_offset"] == 30 - 10 + 1 and snap["dead"] == 1     # 20 decisions + 1 dead letter

    caplog.set_level(logging.INFO, "txmq.transaction")
    ctx2 = await make_service(tmp_path, clock)
    try:
        assert "from the snapshot" in caplog.text
        assert sorted(ctx2.tx.pending) == sorted(o for o, d in _expected(halves).items() if d is None)
        assert ctx2.tx.pending[halves[5].half_offset].checks == 4
        assert {o: ctx2.tx.decision_of(o) for o in _expected(halves)} == _expected(halves)
        assert ctx2.tx.dead_count == 1
        # A late, repeated END of an old transaction is answered from the table ...
        assert await ctx2.tx.decide(halves[0].half_offset, COMMIT, group="PG") == "already COMMIT; nothing changed"
        # ... and a conflicting one refused: the first decision wins, whatever was kept in memory.
        refused = await _refusal(ctx2.tx.decide(halves[1].half_offset, COMMIT, group="PG"))
        assert "already ROLLBACK" in refused
    finally:
        await ctx2.store._store.close()


async def _refusal(coro) -> str:
    from broker.transaction import DecisionError
    try:
        await coro
    except DecisionError as exc:
        return exc.remark
    raise AssertionError("not refused")


@bounded(30)
async def test_a_crash_after_the_snapshot_replays_only_what_came_after(tmp_path, caplog):
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    halves = await _history(ctx)
    await ctx.tx.write_snapshot()
    at_snapshot = _snapshot(ctx)
    # After the snapshot: a commit of an undecided one, a resume of the dead letter, two new halves.
    await ctx.tx.decide(halves[5].half_offset, COMMIT, group="PG")
    await ctx.tx.resume(halves[2].half_offset)
    late = [await add_half(ctx, b"late-1"), await add_half(ctx, b"late-2")]
    await ctx.tx.decide(late[0].half_offset, ROLLBACK, group="PG")
    await ctx.store._store.close()                 # crash: no stop, no new snapshot
    assert _snapshot(ctx) == at_snapshot

    caplog.set_level(logging.INFO, "txmq.transaction")
    ctx2 = await make_service(tmp_path, clock)
    try:
        assert "from the snapshot" in caplog.text
        want = _expected(halves)
        want[halves[5].half_offset] = COMMIT
        want[halves[2].half_offset] = None
        want[late[0].half_offset] = ROLLBACK
        want[late[1].half_offset] = None
        assert sorted(ctx2.tx.pending) == sorted(o for o, d in want.items() if d is None)
        assert {o: ctx2.tx.decision_of(o) for o in want} == want
        assert ctx2.tx.dead_count == 0
    finally:
        await ctx2.store._store.close()


@bounded(30)
async def test_a_snapshot_of_another_store_is_ignored_and_the_log_rebuilds_everything(tmp_path, caplog):
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    halves = await _history(ctx)
    await ctx.tx.stop()
    await ctx.store._store.close()
    path = os.path.join(ctx.store.store_dir, "transactions", "snapshot.json")
    snap = _snapshot(ctx)
    snap["store_id"] = "someone-else"
    snap["pending"] = []                           # were it believed, every undecided one would be lost
    with open(path, "w") as f:
        json.dump(snap, f)

    caplog.set_level(logging.INFO, "txmq.transaction")
    ctx2 = await make_service(tmp_path, clock)
    try:
        assert "written for another store" in caplog.text and "from the whole log" in caplog.text
        assert sorted(ctx2.tx.pending) == sorted(o for o, d in _expected(halves).items() if d is None)
        assert {o: ctx2.tx.decision_of(o) for o in _expected(halves)} == _expected(halves)
        assert _snapshot(ctx2)["store_id"] == ctx2.store.store_id          # rewritten at once
    finally:
        await ctx2.store._store.close()


@bounded(20)
async def test_a_snapshot_taken_while_a_half_is_being_indexed_does_not_skip_it(tmp_path):
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    p = await half_stored_while(ctx, ctx.tx.write_snapshot)
    await ctx.store._store.close()        # crash: the snapshot above is the one on disk

    ctx2 = await make_service(tmp_path, clock)
    try:
        assert p.half_offset in ctx2.tx.pending, "a half stored just before a snapshot was forgotten"
    finally:
        await ctx2.store._store.close()


@bounded(20)
async def test_a_snapshot_taken_while_a_decision_is_being_written_replays_it(tmp_path):
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    p = await add_half(ctx, b"deciding")
    ctx.store.gate = asyncio.Event()
    deciding = asyncio.ensure_future(ctx.tx.decide(p.half_offset, COMMIT, group="PG"))
    await ctx.store.entered.wait()
    await ctx.tx.write_snapshot()                   # while the decision waits at the writer's gate
    ctx.store.gate.set()
    assert await deciding == COMMIT
    assert _snapshot(ctx)["op_offset"] == 0          # held down by the decision in flight
    await ctx.store._store.close()

    ctx2 = await make_service(tmp_path, clock)
    try:
        assert p.half_offset not in ctx2.tx.pending and ctx2.tx.decision_of(p.half_offset) == COMMIT
    finally:
        await ctx2.store._store.close()


def test_decision_table_files_and_trim(tmp_path):
    t = DecisionTable(str(tmp_path), file_entries=8)
    for i, op in enumerate([COMMIT, ROLLBACK, DEAD, None] * 5):
        t.set(i, op)
    assert [t.get(i) for i in range(5)] == [COMMIT, ROLLBACK, DEAD, None, COMMIT]
    assert t.get(10_000) is None and t.get(-1) is None
    assert t.file_count == 3 and t.count(DEAD) == 5
    t.set(2, None)                                   # a resume
    assert t.get(2) is None
    assert t.trim(17) == 3                           # files [0, 8) and [8, 16) go, with 3 DEAD entries
    assert t.file_count == 1 and sorted(os.listdir(tmp_path)) == [f"{16:020d}"]
    t.close()
    again = DecisionTable(str(tmp_path), file_entries=8)
    assert again.get(16) == COMMIT and again.get(18) == DEAD
    again.close()


def test_a_cleared_decision_table_hands_back_what_it_said(tmp_path):
    """A rebuild clears the table; an op record it cannot read is then asked of what the table said before."""
    t = DecisionTable(str(tmp_path), file_entries=8)
    for i, op in enumerate([COMMIT, ROLLBACK, DEAD, None, COMMIT, COMMIT, COMMIT, COMMIT, ROLLBACK]):
        t.set(i, op)
    earlier = t.clear()
    assert os.listdir(tmp_path) == [] and t.get(0) is None
    t.set(0, ROLLBACK)                              # the rebuild's own files: new ones, not the earlier's pages
    assert [earlier.get(i) for i in (0, 1, 2, 3, 8, 9, 100, -1)] == [COMMIT, ROLLBACK, DEAD, None, ROLLBACK, None,
                                                                      None, None]
    earlier.close()
    assert earlier.get(0) is None and t.get(0) == ROLLBACK
    t.close()


def test_what_a_cleared_table_hands_back_gives_way_to_the_rebuild_on_a_full_disk(tmp_path):
    """The table a rebuild clears is handed back (its files unlinked, their pages mapped), so its files' blocks
    stay allocated until it is closed. Cleared on a full disk, the old files freed the space the rebuild's new
    ones take; kept, not one file could be made: every decision waited in memory, and no snapshot could be
    written (every start rebuilt again). It gives way (closed, said) when the rebuild needs the space."""
    from tests.support.tmpfs import tmpfs
    with tmpfs(tmp_path / "disk", "64k") as disk:
        t = DecisionTable(str(disk / "decisions"), file_entries=16 * 1024)
        t.set(0, COMMIT)
        t.set(16 * 1024, ROLLBACK)                        # two files: 32 KiB of 64
        ballast = disk / "ballast"
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)   # take everything that is left
        try:
            while os.write(fd, b"\xff" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        earlier = t.clear()
        assert earlier.get(0) == COMMIT
        t.set(0, DEAD)                                    # the rebuild's first file: the space the old ones had
        t.set(16 * 1024, DEAD)
        assert t.file_count == 2 and not t.waiting and t.get(0) == DEAD and t.get(16 * 1024) == DEAD
        assert earlier.get(0) is None                     # given way: its evidence is gone, nothing else
        earlier.close()
        t.close()


@bounded(20)
async def test_a_commit_type_copy_with_prepared_offset_0_does_not_commit_the_half_stored_there(tmp_path):
    """Older txmq wrote retries with the committed message's sysFlag and PREPARED OFFSET 0; recovery's
    lost-op repair must not take that for the commit of the half at offset 0."""
    from broker.store import PutRequest
    from protocol.codes import SysFlag
    from protocol.message import encode_record
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    first = await add_half(ctx, b"first-half")
    assert first.half_offset == 0
    record = encode_record(topic=b"%RETRY%CG", body=b"some other message", queue_id=0, flag=0,
                           sys_flag=SysFlag.TRANSACTION_COMMIT, born_timestamp=clock(), born_host=ctx.store_host,
                           store_host=ctx.store_host, properties=b"UNIQ_KEY\x01OTHER")
    copy = await ctx.store.put(PutRequest(record, "%RETRY%CG", 0, 0, SysFlag.TRANSACTION_COMMIT))
    assert copy.ok
    ctx.tx.recovered_commits.add((0, copy.physical_offset))     # as the replay of the log tail reports it
    await ctx.tx.recover()
    try:
        assert 0 in ctx.tx.pending and ctx.tx.decision_of(0) is None
        assert ctx.store.max_offset("RMQ_SYS_TRANS_OP_HALF_TOPIC", 0) == 0, "a repair op was written"
    finally:
        await ctx.store._store.close()


def test_a_decision_file_that_cannot_be_made_waits_in_memory_instead_of_crashing(tmp_path):
    """On a full disk a store into a hole of a mapping is SIGBUS: files are allocated before they are
    mapped, and when that fails (ENOSPC) the entries wait in memory, answered, until a file can be made."""
    from tests.support.tmpfs import tmpfs
    with tmpfs(tmp_path / "disk", "64k") as disk:
        t = DecisionTable(str(disk / "decisions"), file_entries=16 * 1024)
        t.set(0, COMMIT)                                  # the first file: 16 KiB of 64
        ballast = disk / "ballast"
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)   # take everything that is left
        try:
            while os.write(fd, b"\xff" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        t.set(16 * 1024 + 5, ROLLBACK)                    # a second file cannot be allocated: no SIGBUS
        t.set(16 * 1024 + 6, DEAD)
        assert t.get(16 * 1024 + 5) == ROLLBACK and t.get(16 * 1024 + 6) == DEAD and t.count(DEAD) == 1
        assert t.file_count == 1 and len(os.listdir(disk / "decisions")) == 1   # no half-made file left
        os.unlink(ballast)
        t.set(1, ROLLBACK)                                # any later write retries the waiting ones
        assert t.file_count == 2 and t.get(16 * 1024 + 5) == ROLLBACK and t.get(16 * 1024 + 6) == DEAD
        t.close()


@bounded(20)
async def test_no_snapshot_is_written_past_decisions_that_wait_in_memory(tmp_path, monkeypatch):
    """A decision whose table file could not be made (a full disk) lives in memory: a snapshot naming an
    op-queue offset past it would leave it out of the next start."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    p1 = await add_half(ctx, b"before")
    await ctx.tx.decide(p1.half_offset, COMMIT, group="PG")
    await ctx.tx.write_snapshot()
    before = _snapshot(ctx)
    table = ctx.tx.table

    def no_space(base):
        raise OSError(28, "No space left on device")
    p2 = await add_half(ctx, b"waiting")
    monkeypatch.setattr(table, "_open", no_space)
    table.clear()                                   # the next decision needs a new file: it cannot be made
    await ctx.tx.decide(p2.half_offset, ROLLBACK, group="PG")
    assert table.waiting == 1 and ctx.tx.decision_of(p2.half_offset) == ROLLBACK
    await ctx.tx.write_snapshot()
    assert _snapshot(ctx) == before                 # kept: its replay covers the waiting decision
    await ctx.store._store.close()                  # crash

    monkeypatch.undo()
    ctx2 = await make_service(tmp_path, clock)
    try:
        assert ctx2.tx.decision_of(p2.half_offset) == ROLLBACK and p2.half_offset not in ctx2.tx.pending
    finally:
        await ctx2.store._store.close()


@bounded(30)
async def test_an_undecided_half_whose_record_is_damaged_is_dropped_with_an_error_not_silently(tmp_path, caplog,
                                                                                              monkeypatch):
    """The snapshot names the half; its record no longer reads as one (the log damaged there, in a segment
    older than start-up verifies; not removed by retention). It cannot be checked or committed: dropped, as
    before, but now said at ERROR."""
    from broker.store import MessageStore
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    halves = await _history(ctx, 9)
    damaged = halves[5].half_offset                 # undecided (i % 3 == 2; 2 is dead-lettered), as is 8
    await ctx.tx.stop()
    await ctx.store._store.close()
    real = MessageStore.get_record
    monkeypatch.setattr(MessageStore, "get_record", lambda self, off: None if off == damaged else real(self, off))
    caplog.set_level(logging.INFO, "txmq.transaction")
    ctx2 = await make_service(tmp_path, clock)
    try:
        assert damaged not in ctx2.tx.pending and list(ctx2.tx.pending) == [halves[8].half_offset]
        assert any(r.levelno == logging.ERROR and str(damaged) in r.getMessage() and "damaged" in r.getMessage()
                   for r in caplog.records)
    finally:
        await ctx2.store._store.close()


def test_snapshot_owners_are_read_as_far_as_they_are_well_formed():
    """An older txmq's snapshot has no "owners"; a damaged entry costs only its own sender (asked first), never
    the start-up or the other transactions."""
    from broker.transaction.recovery import _owners
    assert _owners({"pending": []}) == {}
    assert _owners({"owners": ["not", "a", "map"]}) == {}
    assert _owners({"owners": {"a@1": [10, 20], "b@2": "x", "c@3": [30, "40", None]}}) == {10: "a@1", 20: "a@1",
                                                                                          30: "c@3"}


def test_snapshot_checked_times_are_read_as_far_as_they_are_well_formed():
    """An older txmq's snapshot has no "checked"; a malformed entry (a key int() refuses though str.isdigit()
    accepts it, an offset not an int) costs only its own transactions' last-check times, never the start-up."""
    from broker.transaction.recovery import _checked
    assert _checked({"pending": []}) == {}
    assert _checked({"checked": [1, 2]}) == {}
    assert _checked({"checked": {"\u00b2": [1], "1" * 5000: [2], "-5": [3], "x": [4], "1700000000000": [5, "6", True],
                                 "1700000000001": "7"}}) == {5: 1_700_000_000_000}


@bounded(30)
async def test_a_crash_keeps_the_sender_of_a_half_checked_after_the_last_snapshot(tmp_path):
    """The snapshot names each sender; a half stored after it (and checked before the crash) is named by its
    check record, so its checks go to its sender after the restart too."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    before = await add_half(ctx, b"before")
    before.owner_id = "10.0.0.7@1"
    await ctx.tx.write_snapshot()
    after, unchecked = await add_half(ctx, b"after"), await add_half(ctx, b"unchecked")
    rf = ctx.tx.records
    assert (await ctx.store.put(rf.check(after.half_offset, after.queue_offset, 1, "10.0.0.7@2"))).ok
    await ctx.store._store.close()                 # crash: no stop, no new snapshot
    ctx2 = await make_service(tmp_path, clock)
    try:
        owners = {off: tx.owner_id for off, tx in ctx2.tx.pending.items()}
        assert owners == {before.half_offset: "10.0.0.7@1", after.half_offset: "10.0.0.7@2",
                          unchecked.half_offset: ""}   # stored and never checked since the snapshot: not known
        assert ctx2.tx.pending[after.half_offset].checks == 1
    finally:
        await ctx2.store._store.close()


@bounded(30)
async def test_a_last_check_ahead_of_a_wall_clock_stepped_back_delays_the_next_by_one_interval_at_most(tmp_path):
    """The next check after a restart is an interval after the last one, by the wall clock (a check record's store
    time, the snapshot's "checked"): a check stamped a day ahead of the clock a restart finds (stepped back since)
    must not hold its next check a day and an interval, nor for ever. As a half's store time ahead (tx.stored_at),
    it is taken as made at the restart: the next check one interval on (1000 ms here)."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    snapped, logged = await add_half(ctx, b"in the snapshot"), await add_half(ctx, b"by its check record")
    day = 86_400_000
    clock.now += day                                # the wall clock a day ahead while they were checked
    snapped.checks, snapped.checked_at = 1, clock.now
    await ctx.tx.write_snapshot()
    rf = ctx.tx.records
    assert (await ctx.store.put(rf.check(logged.half_offset, logged.queue_offset, 1, ""))).ok
    await ctx.store._store.close()                  # crash
    clock.now -= day                                # stepped back
    ctx2 = await make_service(tmp_path, clock)
    try:
        for half in (snapped, logged):
            t = ctx2.tx.pending[half.half_offset]
            assert t.checks == 1 and clock.now < t.next_check <= clock.now + 1000, t.next_check - clock.now
    finally:
        await ctx2.store._store.close()


async def _sender_after_a_crash(ctx, tmp_path, clock, half) -> str:
    """Closes the store under `ctx` (a crash: no stop, no new snapshot), starts a service on it again and returns
    the sender it knows for `half`."""
    await ctx.store._store.close()
    ctx2 = await make_service(tmp_path, clock)
    try:
        return ctx2.tx.pending[half.half_offset].owner_id
    finally:
        await ctx2.store._store.close()


class _Producer:
    """A live producer connection as the check pass sees it: records the checks it is sent."""

    peer = ("127.0.0.1", 2)
    is_open = True
    writing_paused = False
    unsent_bytes = 0

    def __init__(self, client_id: str | None):
        self.attributes = {"client_id": client_id} if client_id else {}      # None: no heartbeat named it yet
        self.asked: list[int] = []

    def oneway(self, cmd) -> None:
        self.asked.append(int(cmd.ext_fields["commitLogOffset"]))


@bounded(30)
async def test_after_a_restart_checks_go_first_to_the_sender_that_reconnected(tmp_path):
    """Both producers are back before anything is due (the clock says when): every check goes to the instance
    that sent the halves, known by the client id its connection's heartbeat gave after them (a stock Java
    producer's first halves precede its first heartbeat), not to the group in turn."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    conn = _Producer(None)
    halves = [await add_half(ctx, f"h{i}".encode(), conn=conn) for i in range(4)]
    assert {p.owner_id for p in halves} == {"127.0.0.1:2"}          # taken under the connection's address
    conn.attributes["client_id"] = "10.0.0.7@4242"                  # its heartbeat, after its halves
    await ctx.tx.connection_named(conn)
    assert {p.owner_id for p in halves} == {"10.0.0.7@4242"}
    await ctx.tx.stop()
    await ctx.store._store.close()
    ctx2 = await make_service(tmp_path, clock)
    try:
        other, sender = _Producer("10.0.0.8@99"), _Producer("10.0.0.7@4242")
        for conn in (other, sender):           # the other first: the group's turn would start with it
            ctx2.clients.add_producer("PG", conn, conn.attributes["client_id"])
        clock.now += 60_000
        await ctx2.tx.run_due(clock.now)
        assert sorted(sender.asked) == sorted(p.half_offset for p in halves) and other.asked == []
    finally:
        await ctx2.store._store.close()


@bounded(30)
async def test_a_half_whose_connection_was_named_while_it_was_stored_keeps_that_sender_across_a_crash(tmp_path):
    """The heartbeat came while the half was being written without a name (a Java process's timer thread and its
    sending thread share the connection): it found nothing unnamed yet, so the half is named once indexed, and its
    sender record written then."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    conn = _Producer(None)

    answers = []

    def heartbeat():
        conn.attributes["client_id"] = "10.0.0.7@4242"
        answers.append(asyncio.ensure_future(ctx.tx.connection_named(conn)))    # waits for the half being stored

    p = await half_stored_while(ctx, heartbeat, conn=conn)
    assert p.owner_id == "10.0.0.7@4242"
    await answers[0]
    await asyncio.gather(*ctx.tx._naming)       # its sender record
    assert await _sender_after_a_crash(ctx, tmp_path, clock, p) == "10.0.0.7@4242"


@bounded(60)
async def test_a_connection_never_named_keeps_only_its_undecided_halves_for_a_heartbeat(tmp_path):
    """A client that never heartbeats, sending and deciding transaction after transaction on one connection:
    the halves waiting for its name are the undecided ones (and those decided since the list last grew)."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    conn = _Producer(None)
    try:
        kept = await add_half(ctx, b"undecided", conn=conn)
        for i in range(300):
            p = await add_half(ctx, f"h{i}".encode(), conn=conn)
            await ctx.tx.decide(p.half_offset, COMMIT, group="PG")
        unnamed = ctx.tx._unnamed[conn].halves
        assert kept in unnamed and len(unnamed) < 64
        conn.attributes["client_id"] = "10.0.0.7@4242"
        await ctx.tx.connection_named(conn)
        assert kept.owner_id == "10.0.0.7@4242" and conn not in ctx.tx._unnamed
    finally:
        await ctx.store._store.close()


@bounded(30)
async def test_the_snapshot_keeps_only_client_ids_a_check_record_could_carry(tmp_path):
    """A client names itself, in up to a 16 MiB frame: the snapshot, written every few seconds, carried each such
    name whole (a hundred connections, 1.6 GB), where a check record leaves it out. Both keep the same ones."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    try:
        plain, huge, spliced = [await add_half(ctx, f"h{i}".encode()) for i in range(3)]
        plain.owner_id = "10.0.0.7@4242"        # as their connections' heartbeats named them
        huge.owner_id = "x" * (1 << 20)
        spliced.owner_id = "evil\x02TXMQ_CHECKS\x011"
        await ctx.tx.write_snapshot()
        assert _snapshot(ctx)["owners"] == {"10.0.0.7@4242": [plain.half_offset]}
    finally:
        await ctx.store._store.close()


def test_a_decision_file_the_snapshot_named_is_lost_unless_retention_removed_it(tmp_path):
    t = DecisionTable(str(tmp_path), file_entries=8)
    t.set(3, COMMIT)
    t.set(11, ROLLBACK)
    assert t.bases == [0, 8]
    assert t.lost([0, 8, 16], first_index=0) == [os.path.join(str(tmp_path), f"{16:020d}")]
    assert t.lost([0, 8, 16], first_index=24) == []         # every half of file 16 removed by retention


@bounded(30)
async def test_the_snapshot_view_taken_on_the_loop_leaves_the_garbage_collector_nothing_per_transaction(
        tmp_path, monkeypatch):
    """The loop's view is one list of the index's own entries, nothing made per transaction: 500,000 rows as
    lists stayed tracked by the garbage collector, set off full collections that walked the whole index, and
    held the loop 660 ms every snapshot (70 as tuples; now the rows are made on a worker thread). They are
    written as ever ([half, queue offset, checks])."""
    from broker.transaction import recovery
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    halves = [await add_half(ctx, f"h{i}".encode()) for i in range(20)]
    taken, encode = [], recovery.encode_snapshot

    def spy(snap, pending):
        taken.append(pending)
        return encode(snap, pending)
    monkeypatch.setattr(recovery, "encode_snapshot", spy)
    try:
        await ctx.tx.write_snapshot()
        assert sorted(map(id, taken[0])) == sorted(map(id, ctx.tx.pending.values()))
        on_disk = _snapshot(ctx)["pending"]
        assert sorted(on_disk) == sorted([p.half_offset, p.queue_offset, p.checks] for p in halves)
    finally:
        await ctx.store._store.close()


@bounded(30)
async def test_the_first_heartbeat_is_answered_in_bounded_time_while_sender_records_wait_on_the_store(tmp_path,
                                                                                                     monkeypatch):
    """A stock Java client (4.9.8) closes its connection when a HEART_BEAT is not answered within 3 s
    (clientCloseSocketIfTimeout, true by default), failing every request in flight on it. The sender records are
    written 256 at a time, one writer cycle (a flush when flush is sync) each, behind whatever else is queued: the
    answer waited for all of them, however long that took (a stalled writer: never). It waits at most
    NAMING_WAIT_S; the records are still written, and a restart after them still knows the sender."""
    from broker.transaction import service as service_module
    monkeypatch.setattr(service_module, "NAMING_WAIT_S", 0.01)
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    conn = _Producer(None)
    p = await add_half(ctx, b"before the heartbeat", conn=conn)
    ctx.store.gate = asyncio.Event()            # the writer holds every record from here on
    conn.attributes["client_id"] = "10.0.0.7@4242"
    await ctx.tx.connection_named(conn)         # answered, the record not yet written
    # (the record reaches the held writer once the new op queue's file is made, on the queue-file thread: maybe
    # after the answer, which must not wait for it either way)
    await ctx.store.entered.wait()
    assert not ctx.store.gate.is_set() and ctx.tx._naming
    ctx.store.gate.set()
    await asyncio.gather(*ctx.tx._naming)       # still written once the store takes it
    assert await _sender_after_a_crash(ctx, tmp_path, clock, p) == "10.0.0.7@4242"


@bounded(30)
async def test_a_heartbeat_during_a_halfs_write_is_answered_once_that_halfs_sender_record_is_written(tmp_path):
    """The half was sent before the heartbeat, on the same connection, and is still being written when the heartbeat
    comes: nothing of the connection is indexed yet, so the heartbeat was answered at once, and the half's sender
    record written only after (a kill -9 between left its checks to any producer of the group, the claim of the
    first heartbeat broken for the halves closest to it). The heartbeat waits for that half too."""
    from broker.topics import OP_TOPIC

    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    conn = _Producer(None)
    answered = []

    def heartbeat():
        conn.attributes["client_id"] = "10.0.0.7@4242"
        answer = ctx.tx.connection_named(conn)
        answered.append(asyncio.ensure_future(answer) if answer is not None else None)

    p = await half_stored_while(ctx, heartbeat, conn=conn)
    if answered[0] is not None:
        await answered[0]
    # The heartbeat is answered: its half's sender record is in the op queue now (nothing else was written there).
    assert ctx.store.max_offset(OP_TOPIC, 0) == 1
    assert await _sender_after_a_crash(ctx, tmp_path, clock, p) == "10.0.0.7@4242"


@bounded(30)
async def test_on_a_sync_master_a_heartbeat_before_the_halfs_write_begins_waits_for_its_sender_record(tmp_path):
    """On a SYNC_MASTER a half is stored by a coroutine the connection runs after the request was read: a heartbeat
    read next on the same connection can run before it begins. The half was sent first; the heartbeat is answered
    once its sender record is written all the same."""
    from broker.topics import OP_TOPIC
    from protocol.codes import ResponseCode
    from protocol.message import SendMessageRequestHeader

    class Slave:
        sync = True

        async def confirm_async(self, offset):
            return ResponseCode.SUCCESS

    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    ctx.ha = Slave()
    conn = _Producer(None)

    class Cmd:
        language = version = serialize_type = 0
        opaque = 1
        body = b"sent before the heartbeat"

    h = SendMessageRequestHeader("PG", "T", queue_id=0, born_timestamp=clock())
    props = {Prop.UNIQ_KEY: "U1", Prop.PGROUP: "PG", Prop.TRAN_MSG: "true"}
    try:
        storing = ctx.tx.prepare(conn, Cmd(), h, 0, props, ctx.store_host)      # not begun yet
        conn.attributes["client_id"] = "10.0.0.7@4242"                          # the heartbeat, read next
        answer = ctx.tx.connection_named(conn)
        sent = asyncio.ensure_future(storing)
        if answer is not None:
            await answer
        assert ctx.store.max_offset(OP_TOPIC, 0) == 1       # answered once the half's sender record is written
        await sent
    finally:
        await ctx.store._store.close()


@bounded(30)
async def test_sender_records_that_open_the_op_queue_have_its_file_made_off_the_loop(tmp_path, monkeypatch):
    """A stock producer's first heartbeat on a new broker: its halves' sender records are the op queue's first
    records. Put straight to the writer, the queue's first file was made on the event loop (what the queue-file
    thread is for), and past the open-files limit the records were stored with their units waiting in memory,
    unreadable by a restart's replay. They wait for the file as a decision does."""
    from broker.topics import OP_TOPIC

    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    conn = _Producer(None)
    p = await add_half(ctx, b"before the heartbeat", conn=conn)
    assert (OP_TOPIC, 0) not in ctx.store.queue_index           # nothing decided yet: no op queue
    made_on_loop = first_queue_files_made_on_loop(monkeypatch)
    conn.attributes["client_id"] = "10.0.0.7@4242"
    await ctx.tx.connection_named(conn)
    await asyncio.gather(*ctx.tx._naming)
    assert ctx.store.max_offset(OP_TOPIC, 0) == 1 and made_on_loop == []
    await ctx.store._store.close()              # crash: no stop, no new snapshot
    ctx2 = await make_service(tmp_path, clock)
    try:
        assert ctx2.tx.pending[p.half_offset].owner_id == "10.0.0.7@4242"
    finally:
        await ctx2.store._store.close()


@bounded(20)
async def test_the_snapshot_rows_and_owners_are_made_off_the_event_loop(tmp_path, monkeypatch):
    """Made on the loop they held it 73 + 82 ms at 500,000 undecided; the loop keeps only the copy of which
    transactions are undecided, and a worker thread (not the store's I/O thread: the flushes wait behind that)
    makes the rows and the owners map from it."""
    import threading
    from broker.transaction import recovery
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    halves = await _history(ctx)
    made_on, by_owner = [], recovery._by_owner

    def recorded(pending):
        made_on.append(threading.current_thread())
        return by_owner(pending)
    monkeypatch.setattr(recovery, "_by_owner", recorded)
    rows_on, dumps = [], recovery._dumps

    def recorded_dumps(value):
        rows_on.append(threading.current_thread())
        return dumps(value)
    monkeypatch.setattr(recovery, "_dumps", recorded_dumps)
    await ctx.tx.write_snapshot()
    assert made_on and threading.main_thread() not in made_on
    assert rows_on and threading.main_thread() not in rows_on
    undecided = sorted(o for o, d in _expected(halves).items() if d is None)
    assert sorted(row[0] for row in _snapshot(ctx)["pending"]) == undecided
    assert sorted(sum(_snapshot(ctx)["owners"].values(), [])) == undecided
    await ctx.store._store.close()


@bounded(20)
async def test_a_decision_taken_while_the_snapshot_rows_are_made_is_replayed(tmp_path, monkeypatch):
    """The rows are made on a worker thread from the loop's list of undecided transactions: one decided in
    between is in the snapshot as undecided, and its op record, past the snapshot's op offset, decides it again
    at the next start."""
    import threading
    from broker.transaction import recovery
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    p = await add_half(ctx, b"decided-meanwhile")
    loop = asyncio.get_running_loop()
    making, decided, encode = asyncio.Event(), threading.Event(), recovery.encode_snapshot

    def held(snap, pending):
        loop.call_soon_threadsafe(making.set)
        assert decided.wait(10)
        return encode(snap, pending)
    monkeypatch.setattr(recovery, "encode_snapshot", held)
    snapshot = asyncio.ensure_future(ctx.tx.write_snapshot())
    await making.wait()
    assert await ctx.tx.decide(p.half_offset, COMMIT, group="PG") == COMMIT
    decided.set()
    await snapshot
    assert [row[0] for row in _snapshot(ctx)["pending"]] == [p.half_offset]     # the view: still undecided
    await ctx.store._store.close()                  # crash: the snapshot above is the one on disk

    ctx2 = await make_service(tmp_path, clock)
    try:
        assert p.half_offset not in ctx2.tx.pending and ctx2.tx.decision_of(p.half_offset) == COMMIT
    finally:
        await ctx2.store._store.close()


async def _changes_around_a_snapshot(tmp_path, monkeypatch, hold: bool):
    """A snapshot, and while its rows are made (``hold``: the worker thread waits until they are all done;
    else they are made first): commits, a rollback, dead letters resumed, halves stored and one decided, checks
    counted with their records, a connection named. Then a crash and a start: (its index {half: (checks,
    sender)}, the decisions)."""
    import threading
    from broker.transaction import recovery
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    conn = _Producer(None)
    hs = [await add_half(ctx, f"h{i}".encode(), conn=conn if i % 2 else None) for i in range(12)]
    await ctx.tx.decide(hs[0].half_offset, DEAD, reason="max-checks")
    for i, p in enumerate(hs):
        p.checks = i % 4
    loop = asyncio.get_running_loop()
    making, go, encode = asyncio.Event(), threading.Event(), recovery.encode_snapshot

    def held(snap, pending):
        loop.call_soon_threadsafe(making.set)
        assert go.wait(10)
        return encode(snap, pending)
    monkeypatch.setattr(recovery, "encode_snapshot", held if hold else encode)
    snapshot = asyncio.ensure_future(ctx.tx.write_snapshot())
    await (making.wait() if hold else snapshot)
    await ctx.tx.decide(hs[1].half_offset, COMMIT, group="PG")
    await ctx.tx.decide(hs[2].half_offset, ROLLBACK, group="PG")
    await ctx.tx.resume(hs[0].half_offset)
    await ctx.tx.decide(hs[4].half_offset, DEAD, reason="max-checks")
    await ctx.tx.resume(hs[4].half_offset)
    late = [await add_half(ctx, b"late1"), await add_half(ctx, b"late2")]
    await ctx.tx.decide(late[0].half_offset, COMMIT, group="PG")
    for p in (hs[3], hs[5]):
        p.checks += 5
        assert (await ctx.store.put(ctx.tx.records.check(p.half_offset, p.queue_offset, p.checks, "10.0.0.9@1"))).ok
        p.owner_id = "10.0.0.9@1"
    conn.attributes["client_id"] = "10.0.0.7@4242"
    await ctx.tx.connection_named(conn)
    await asyncio.gather(*ctx.tx._naming)
    go.set()
    await snapshot
    await ctx.store._store.close()                 # crash: the snapshot above is the one on disk
    ctx2 = await make_service(tmp_path, clock)
    try:
        return ({o: (t.checks, t.owner_id) for o, t in ctx2.tx.pending.items()},
                {p.half_offset: ctx2.tx.decision_of(p.half_offset) for p in hs + late})
    finally:
        await ctx2.store._store.close()


@bounded(30)
async def test_whatever_changes_while_the_snapshot_rows_are_made_a_start_ends_as_after_a_view_taken_at_once(
        tmp_path, monkeypatch):
    """The rows are read on a worker thread from entries the loop goes on changing; each change has its record
    past the snapshot's op offset, so the start after a crash ends where it would had the rows been made at the
    moment the offsets were taken (as they were on the loop)."""
    at_once = await _changes_around_a_snapshot(tmp_path / "at-once", monkeypatch, False)
    meanwhile = await _changes_around_a_snapshot(tmp_path / "meanwhile", monkeypatch, True)
    assert meanwhile == at_once
    assert at_once[1][next(iter(at_once[1]))] is None       # (the first half: dead-lettered, resumed)


@bounded(30)
async def test_a_stop_while_a_periodic_snapshots_rows_are_made_writes_its_own_complete_one(tmp_path, monkeypatch):
    """stop cancels the periodic snapshot waiting for its worker thread, and writes one of the index as it is at
    stop: the decision taken meanwhile is in neither its rows nor below its op offset unrecorded."""
    import threading
    from broker.transaction import recovery
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    hs = [await add_half(ctx, f"h{i}".encode()) for i in range(5)]
    loop = asyncio.get_running_loop()
    making, go, encode, calls = asyncio.Event(), threading.Event(), recovery.encode_snapshot, []

    def held(snap, pending):
        calls.append(1)
        if len(calls) == 1:
            loop.call_soon_threadsafe(making.set)
            assert go.wait(10)
        return encode(snap, pending)
    monkeypatch.setattr(recovery, "encode_snapshot", held)
    ctx.tx.snapshot_interval_s = 0
    ctx.tx.changed = True
    ctx.tx.start()
    try:
        await making.wait()
        await ctx.tx.decide(hs[1].half_offset, COMMIT, group="PG")
        await ctx.tx.stop()
    finally:
        go.set()
    snap = _snapshot(ctx)
    assert sorted(r[0] for r in snap["pending"]) == sorted(p.half_offset for i, p in enumerate(hs) if i != 1)
    assert snap["op_offset"] == 1 and len(calls) == 2
    await ctx.store._store.close()


@bounded(30)
async def test_a_check_lost_with_its_connection_is_asked_at_once_after_a_clean_restart(tmp_path):
    """A check lost with its producer (its connection closed, or it unregistered the group) is due again at once;
    with no other producer of the group it waits for one. The snapshot a clean stop wrote still named it checked
    a moment ago ("checked"), so the restart held its re-ask a whole interval (1000 ms here; a minute by default)
    after the producer came back, where before the snapshot kept check times it was asked at once."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    half = await add_half(ctx, b"its check lost")
    clock.now += 10_000                             # (past its immunity: checked once, an interval ago)
    core = ctx.tx.core
    t = core.pending[half.half_offset]
    t.checks, t.checked_at = 1, clock.now
    assert core._lost(t, ctx.monotonic())           # (as channel_closed / producer_left do)
    await ctx.tx.write_snapshot()
    await ctx.store._store.close()
    ctx2 = await make_service(tmp_path, clock)
    try:
        t = ctx2.tx.pending[half.half_offset]
        assert t.checks == 1 and t.next_check <= clock.now, t.next_check - clock.now
    finally:
        await ctx2.store._store.close()
