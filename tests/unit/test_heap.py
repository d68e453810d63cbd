"""broker/heap.py: the undecided index, once settled, is out of the full collections' walk, and still freed."""
from __future__ import annotations

import gc

import pytest

from broker.heap import HeapSettler
from broker.transaction.core import Tx
from tests.support.bounded import bounded
from tests.unit.test_review_transactions import Clock, make_service

pytestmark = pytest.mark.asyncio

N = 5_000


@pytest.fixture(autouse=True)
def thawed():
    """The test process's heap as it was: what a test froze goes back to the collected generations."""
    yield
    gc.unfreeze()


def _tx(i: int) -> Tx:
    return Tx(half_offset=1000 + 300 * i, queue_offset=i, group="PG", topic="T", uniq_key=f"U{i}", store_ts=0,
              owner_id=f"client-{i % 10}@host")


def _walked() -> set[int]:
    """Ids of the objects a full collection walks (generation 2 holds all the older ones after a collection)."""
    gc.collect()
    return {id(o) for o in gc.get_objects(generation=2)}


@bounded(60)
async def test_settled_transactions_are_not_walked_by_full_collections(tmp_path):
    ctx = await make_service(tmp_path, Clock())
    core = ctx.tx.core
    for i in range(N):
        core._put(_tx(i))
    ids = {id(tx) for tx in core.pending.values()}
    assert ids <= _walked()         # the mechanism's premise: unsettled, every full pass walks each of them

    HeapSettler(lambda: len(core.pending)).settle("test")

    assert not ids & _walked()
    assert gc.get_freeze_count() >= N
    await ctx.store.close()


@bounded(60)
async def test_settled_transactions_are_still_freed_when_decided(tmp_path):
    """Frozen is not kept: reference counting frees a decided transaction, and a churn of transactions made
    and decided after the settle leaves nothing behind in the frozen generation or the collected ones."""
    ctx = await make_service(tmp_path, Clock())
    core = ctx.tx.core
    for i in range(N):
        core._put(_tx(i))
    HeapSettler(lambda: len(core.pending)).settle("test")
    frozen = gc.get_freeze_count()
    for i in range(N):
        core.withdraw(1000 + 300 * i)
    assert gc.get_freeze_count() <= frozen - N

    gc.collect()
    walked, frozen = len(gc.get_objects()), gc.get_freeze_count()
    for i in range(N, N + 20 * N):          # 100,000 made and decided, 1,000 in flight
        core._put(_tx(i))
        if i >= N + 1000:
            core.withdraw(1000 + 300 * (i - 1000))
    for i in range(N + 20 * N - 1000, N + 20 * N):
        core.withdraw(1000 + 300 * i)
    gc.collect()
    assert not core.pending
    assert gc.get_freeze_count() <= frozen
    assert len(gc.get_objects()) <= walked + 100      # what the loop's own bookkeeping may keep, not its 100,000
    await ctx.store.close()


@bounded(10)
async def test_settles_again_only_when_the_tables_doubled():
    size = [0]
    heap = HeapSettler(lambda: size[0], min_growth=100)
    heap.settle("start-up")
    size[0] = 99
    assert not heap.maybe_settle()          # not min_growth more
    size[0] = 100
    assert heap.maybe_settle() and heap.settled_at == 100
    size[0] = 199
    assert not heap.maybe_settle()          # not doubled
    size[0] = 0
    assert not heap.maybe_settle()          # shrunk: reference counting freed them, nothing to settle
    size[0] = 200
    assert heap.maybe_settle() and heap.settles == 3


@bounded(10)
async def test_full_collections_are_timed_until_closed():
    heap = HeapSettler(lambda: 0)
    heap.watch()
    try:
        gc.collect()
        gc.collect(1)               # not a full one: not timed
    finally:
        heap.close()
    gc.collect()
    pauses = heap.drain()
    assert len(pauses) == 1 and pauses[0] >= 0
    assert heap.drain() == []


@bounded(30)
async def test_a_stopped_in_process_broker_is_not_kept_by_its_settle(tmp_path):
    """gc.freeze() is process-wide: a broker started in a process that goes on (the tests, the in-process benches)
    froze itself with the rest, and once stopped its own cycles (the server and its supervisor, the store and its
    parts) were garbage no collection would ever walk again: every such broker was kept whole until the process
    ended (found in review)."""
    import weakref

    from broker.config import BrokerConfig
    from broker.server import BrokerServer
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    await server.start()
    await server.stop()
    gone = weakref.ref(server)
    del server
    gc.collect()
    assert gone() is None
