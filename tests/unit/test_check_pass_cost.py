"""A check pass costs what is due, not what is pending: the half-queue floor it saves at its end came from a scan
of the whole undecided index (45 ms on the event loop at 500k undecided, after every pass, and a pass runs
whenever an answer frees a check slot). The floor is still the lowest undecided half's queue offset."""
from __future__ import annotations

from broker.topics import HALF_TOPIC
from broker.transaction.records import ROLLBACK
from broker.transaction.recovery import PROGRESS_GROUP
from tests.support.bounded import bounded
from tests.unit.test_review_transactions import Clock, add_half, make_service



class CountingIndex(dict):
    """The pending index, counting every walk over all of it."""

    scans = 0

    def _walked(self):
        CountingIndex.scans += 1

    def values(self):
        self._walked()
        return super().values()

    def items(self):
        self._walked()
        return super().items()

    def keys(self):
        self._walked()
        return super().keys()

    def __iter__(self):
        self._walked()
        return super().__iter__()


@bounded(60)
async def test_a_check_pass_saves_the_lowest_undecided_offset_without_walking_the_index(tmp_path):
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    tx = ctx.tx
    try:
        txs = [await add_half(ctx, b"%d" % i) for i in range(60)]
        index = CountingIndex(tx.pending)
        tx.pending = tx.core.pending = index
        CountingIndex.scans = 0
        # Decided oldest first, in the middle, and newest last: the floor follows the oldest undecided.
        order = txs[:20] + txs[40:50] + txs[20:40] + txs[50:]
        for done, t in enumerate(order, 1):
            await tx.decide(t.half_offset, ROLLBACK, group="PG", queue_offset=t.queue_offset)
            await tx.run_due(clock.now)          # nothing due: the pass only saves its floor
            left = [p.queue_offset for p in txs if p.half_offset in index]
            expected = min(left) if left else ctx.store.max_offset(HALF_TOPIC, 0)
            assert ctx.offsets.get(PROGRESS_GROUP, HALF_TOPIC, 0) == expected, f"after {done} decisions"
        assert CountingIndex.scans == 0
    finally:
        await ctx.store._store.close()


def test_the_floor_never_walks_the_index_however_many_transactions_come_and_go_above_it():
    """Old undecided halves stay while newer ones are decided as they come (the usual shape of a backlog): the
    floor's entries for the decided ones never reached the top of a lazy heap, which was rebuilt from a walk of
    the whole index each time they outnumbered the live ones (200-500 ms on the loop at 500k undecided, every
    ~500k decisions: worse than the scan it replaced). The floor is kept exactly, a walk of nothing."""
    from broker.transaction.check import Policy
    from broker.transaction.core import TransactionCore, Tx

    core = TransactionCore(Policy(1000, 1000, 3, 72 * 3600_000), lambda off: None)
    index = CountingIndex()
    core.pending = index
    for q in range(50):
        core.add(Tx(q * 100, q, "PG", "T", f"U{q}", 0))
    CountingIndex.scans = 0
    for q in range(50, 5000):
        core.add(Tx(q * 100, q, "PG", "T", f"U{q}", 0))
        core.withdraw(q * 100)
        assert core.lowest_queue_offset() == 0
    for q in range(5000, 9000):             # between two passes (the floor not read): nothing piles up either
        core.add(Tx(q * 100, q, "PG", "T", f"U{q}", 0))
        core.withdraw(q * 100)
    assert len(core._buckets) <= 2 * len(core._by_queue) + 65
    for q in (0, 1, 7, 2, 3):
        core.withdraw(q * 100)
    assert core.lowest_queue_offset() == 4
    core.add(Tx(200, 2, "PG", "T", "U2", 0))      # pending again below the floor (a resume, recovery)
    assert core.lowest_queue_offset() == 2
    for q in range(2, 50):
        core.withdraw(q * 100)
    assert core.lowest_queue_offset() is None
    assert CountingIndex.scans == 0


def test_a_segments_halves_under_a_sparse_backlog_are_found_without_walking_every_bucket():
    """A backlog that never decides is most often a few halves in thousands (one in 2,000 over months): each
    undecided half then has a bucket of its own, and TransactionCore.between sorted the numbers of every bucket
    for each segment retention removed, twice: 73 ms on the loop at 500k undecided, where the walk of the index it
    replaced was 82 ms. The buckets up to the segment's end are taken off the lazy heap of bucket numbers."""
    from broker.transaction.check import Policy
    from broker.transaction.core import TransactionCore, Tx

    core = TransactionCore(Policy(1000, 1000, 3, 72 * 3600_000), lambda off: None)
    core._by_queue = CountingIndex()
    for i in range(5000):                       # one half in 2,000 left undecided, 1 KiB each
        core.add(Tx(i * 2000 * 1024, i * 2000, "PG", "T", f"U{i}", 0))
    core.withdraw(2000 * 1024)                  # a bucket emptied: its number stays on the heap, stale
    CountingIndex.scans = 0
    segment = 4 * 2000 * 1024
    for s in range(3):                          # a segment a few halves long, lowest first, as retention asks
        lo, hi = s * segment, (s + 1) * segment
        assert [tx.half_offset for tx in core.between(lo, hi)] == [
            off for off in range(lo, hi, 2000 * 1024) if off in core.pending]
    assert core.lowest_queue_offset() == 0
    for i in range(4):
        core.withdraw(i * 2000 * 1024)
    assert [tx.half_offset for tx in core.between(0, segment * 2)] == [off * 2000 * 1024 for off in range(4, 8)]
    assert core.lowest_queue_offset() == 4 * 2000
    assert CountingIndex.scans == 0, f"{CountingIndex.scans} walks of every bucket"
