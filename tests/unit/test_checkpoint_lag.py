"""txmq_store_checkpoint_lag_bytes: how much flushed log a start after a crash scans again. A checkpoint that could
not be written (a full disk, an I/O error) was said at ERROR once per outage, and nothing said how far behind it
fell: an outage of hours meant a start that scanned hours of log, unannounced.

(A unit test: the checkpoint's write job is made to fail as an I/O error would; the store is otherwise real.)
"""
from __future__ import annotations

import errno

import pytest

import broker.store.store as store_mod
from broker.metrics import _CorruptCollector
from broker.store import MessageStore, PutRequest, StoreConfig
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

CFG = StoreConfig(segment_size=1 << 20, checkpoint_interval_ms=3_600_000)     # checkpoints only when called


def _gauge(store) -> float:
    families = {f.name: f for f in _CorruptCollector(store).collect()}
    return families["txmq_store_checkpoint_lag_bytes"].samples[0].value


async def _put(store, n: int) -> None:
    results = [await store.put(PutRequest.build("T", bytes([i]) * 200, queue_id=0)) for i in range(n)]
    assert all(r.ok for r in results)


def _failing_job(*_args):
    raise OSError(errno.EIO, "Input/output error")


@bounded(30)
async def test_the_lag_grows_while_checkpoints_fail_and_falls_once_one_is_written(tmp_path, monkeypatch):
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    try:
        await _put(store, 20)
        assert store.checkpoint_lag == store._log.flushed > 0     # a new store: no checkpoint yet
        await store._checkpoint()
        assert store.checkpoint_lag == 0 and _gauge(store) == 0
        checkpointed = store._log.flushed

        real = store_mod._checkpoint_job
        monkeypatch.setattr(store_mod, "_checkpoint_job", _failing_job)
        for _ in range(3):
            await _put(store, 20)
            with pytest.raises(OSError):
                await store._checkpoint()
        lag = store._log.flushed - checkpointed
        assert lag >= 60 * 200
        assert store.checkpoint_lag == lag and _gauge(store) == lag

        monkeypatch.setattr(store_mod, "_checkpoint_job", real)
        await store._checkpoint()
        assert store.checkpoint_lag == 0 and _gauge(store) == 0
    finally:
        await store.close()


@bounded(30)
async def test_a_start_reports_the_log_past_the_checkpoint_it_found(tmp_path, monkeypatch):
    """The final checkpoint at close failed too (the disk still full): the next start says how far behind the
    one on disk is, until it writes its own."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    await _put(store, 10)
    await store._checkpoint()
    checkpointed = store._log.flushed
    monkeypatch.setattr(store_mod, "_checkpoint_job", _failing_job)
    await _put(store, 30)
    end = store._log.flushed
    await store.close()
    monkeypatch.undo()

    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    try:
        assert store.checkpoint_lag == end - checkpointed > 0
        await store._checkpoint()
        assert store.checkpoint_lag == 0
    finally:
        await store.close()


@bounded(30)
async def test_a_log_rebased_past_the_checkpoint_is_not_counted_below_its_start(tmp_path, monkeypatch):
    """A new slave's empty log rebased where its master's starts (rebase_empty), the checkpoint failing: the log
    below the new start does not exist, so no start scans it. Counted from offset 0, the gauge said the master's
    whole trimmed history (GiBs: TxmqCheckpointBehind after 10 minutes) for 30 records written. So does a log
    retention trimmed past a checkpoint that kept failing."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    try:
        start = 8 * CFG.segment_size
        monkeypatch.setattr(store_mod, "_checkpoint_job", _failing_job)
        await store.rebase_empty(start)
        await _put(store, 30)
        with pytest.raises(OSError):
            await store._checkpoint()
        assert store._log.min_offset == start
        assert 30 * 200 <= store.checkpoint_lag == store._log.flushed - start == _gauge(store) < start
    finally:
        await store.close()
