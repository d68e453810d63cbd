"""Metric snapshots on a disk over disk_refuse_ratio: paused, said once, counted, resumed by themselves.

The room the refuse ratio keeps free is the broker's own durable writes' (decisions, offsets, config saves).
A snapshot line appended there every interval ate it while every send was refused. A real broker process
on a 48 MiB tmpfs filled to 1 MiB short of full with a ballast file, then emptied again; progress is read
from the broker's metrics and log, never waited for by the clock. Mounting needs root; elsewhere skipped.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from tests.fault.test_disk_full import _metric
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.tmpfs import tmpfs

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

MiB = 1 << 20


def _snapshot_bytes(store) -> int:
    return sum(p.stat().st_size for p in (store / "metrics").glob("*.jsonl"))


def _fill_to(path, free_left: int) -> None:
    st = os.statvfs(path.parent)
    size = st.f_bavail * st.f_frsize - free_left
    with open(path, "wb") as f:
        f.write(bytes(size))


async def _until(what, test, broker):
    # Polled for progress, bounded by the test alone: a count of 50 ms polls was a 20 s clock, which a broker
    # starting on a loaded machine could outlast. A broker that exited is said at once, with its log.
    while not test():
        if broker.proc.poll() is not None:
            raise AssertionError(f"the broker exited before {what}\n{broker.log()}")
        await asyncio.sleep(0.05)


@bounded(90)
async def test_metric_snapshots_pause_over_the_refuse_ratio_and_resume_below_it(tmp_path):
    with tmpfs(tmp_path / "disk", "48m") as store:
        broker = BrokerProcess(store, "--segment-size", str(4 * MiB), "--max-message-size", str(256 * 1024),
                               "--metrics-snapshot-interval-s", "0.05").start()
        try:
            await _until("a first snapshot", lambda: _snapshot_bytes(store) > 0, broker)
            _fill_to(store / "ballast", MiB)                # about 98% full: past the 90% refuse ratio
            paused = lambda: _metric(broker.metrics, "txmq_metric_snapshots_paused_total")  # noqa: E731
            await _until("a paused snapshot", lambda: paused() >= 1, broker)
            size = _snapshot_bytes(store)
            await _until("five more paused snapshots", lambda: paused() >= 6, broker)
            assert _snapshot_bytes(store) == size           # nothing appended while paused
            (store / "ballast").unlink()
            await _until("snapshots again", lambda: _snapshot_bytes(store) > size, broker)
            log = broker.log()
            assert log.count("metric snapshots paused") == 1, log       # said once, not once per snapshot
            assert log.count("metric snapshots resumed") == 1, log
            assert "metric snapshot not written" not in log, log
        finally:
            assert broker.stop() == 0, broker.log()
