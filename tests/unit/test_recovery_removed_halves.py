"""Recovery's account of halves retention removed since the transaction snapshot (broker/transaction/recovery.py)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from broker.topics import HALF_TOPIC, OP_TOPIC
from broker.transaction import recovery
from tests.support.bounded import bounded


class _Table:
    """Counts its lookups: a promoted slave's recovery looked up every half queue offset since its snapshot."""
    def __init__(self):
        self.lookups = 0

    def get(self, _q):
        self.lookups += 1
        if self.lookups > 10_000:
            raise AssertionError("recovery went over the removed half queue offsets one by one")
        return None


@pytest.mark.parametrize("role", ["ASYNC_MASTER", "SLAVE"])
@bounded(10)
async def test_a_slave_promoted_long_after_its_snapshot_does_not_go_over_every_half_removed_since(monkeypatch,
                                                                                                  caplog, role):
    """A slave writes its snapshot at start only. Promoted months later, the halves removed since then (with the
    op records that decided them) ran to billions: each was looked up and listed, only to be said as undecidable. (A slave's restart
    keeps none of them: no op can come to clear them.)"""
    async def none(*_a, **_k):
        return 0
    monkeypatch.setattr(recovery, "scan", lambda *a, **k: iter(()))
    for name in ("settle", "_repair_lost_dead_op", "_repair_lost_commit_ops"):
        monkeypatch.setattr(recovery, name, none)
    starts = {HALF_TOPIC: 3_000_000_000, OP_TOPIC: 2_000_000_000}    # both removed far past the snapshot's
    store = SimpleNamespace(min_offset=lambda topic, _q: starts[topic], min_physical_offset=1 << 40,
                            get_record=lambda _off: None)
    lost = []
    counter = SimpleNamespace(labels=lambda *_: SimpleNamespace(inc=lost.append))
    tx = SimpleNamespace(ctx=SimpleNamespace(store=store, monotonic=lambda: 0.0, config=SimpleNamespace(broker_role=role),
                                             metrics=SimpleNamespace(transactions_lost=counter)),
                         table=_Table(), pending={})
    snap = {"op_offset": 5, "half_offset": 7}
    with caplog.at_level(logging.INFO, logger=recovery.log.name):
        await recovery._replay(tx, snap, None, {}, set(), {}, 5, 7)
    assert not lost
    assert "half queue offsets 7 to 2999999999" in caplog.text and "cannot be told" in caplog.text
    if role == "SLAVE":
        assert tx.removed_undecided == [] and tx.removed_undecided_queue == []


def test_a_store_time_one_flipped_bit_from_its_born_time_is_put_back_a_skewed_producers_is_not():
    born = 1_795_800_000_000
    for bit, skew in ((28, 0), (40, 0), (22, 35_000), (45, -59_000)):     # cleared or set, the producer seconds off
        true = born + skew
        msg = SimpleNamespace(store_timestamp=true ^ (1 << bit), born_timestamp=born)
        assert recovery._unflipped_stamp(msg) == bit and msg.store_timestamp == true
    hour = 3_600_000
    for skew in (30_000, -80 * hour, 5 * hour, -(1 << 28) + 2 * 60_000):   # sound, or a producer's clock hours off
        msg = SimpleNamespace(store_timestamp=born + skew, born_timestamp=born)
        assert recovery._unflipped_stamp(msg) is None and msg.store_timestamp == born + skew


def test_a_born_time_one_flipped_bit_from_its_store_time_leaves_the_store_time():
    """The born time is as likely the flipped one: the halves around it in the log bound the store time."""
    store = 1_795_800_000_000
    for bit in (28, 22, 40):
        msg = SimpleNamespace(store_timestamp=store, born_timestamp=store ^ (1 << bit))     # the born time damaged
        bounds = (store - 60_000, store + 5_000)        # the half before it; the one after it or the wall clock
        assert recovery._unflipped_stamp(msg, lambda: bounds) is None and msg.store_timestamp == store
    # the store time damaged, out of those bounds: put back as before; nothing to bound it: put back
    msg = SimpleNamespace(store_timestamp=store ^ (1 << 28), born_timestamp=store)
    assert recovery._unflipped_stamp(msg, lambda: (store - 60_000, store + 5_000)) == 28
    msg = SimpleNamespace(store_timestamp=store ^ (1 << 28), born_timestamp=store)
    assert recovery._unflipped_stamp(msg, lambda: (None, None)) == 28 and msg.store_timestamp == store
