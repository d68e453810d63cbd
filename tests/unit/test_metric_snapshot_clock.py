"""Which metric snapshot files are old is judged against the broker's start, not the wall clock alone."""
from __future__ import annotations

import asyncio
import time
import types

import pytest

from broker.context import aged_clock
from broker.server import BrokerServer
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


@bounded(30)
async def test_a_snapshot_task_first_run_or_restarted_after_a_step_ahead_removes_no_file(tmp_path, monkeypatch):
    """The start's clocks were read when the snapshot task first ran: a step ahead before that (the task runs once
    the broker serves), or before the supervisor restarted the task after a crash, was taken as the start's time,
    and the files of the days the rollup had yet to read were removed. Read at the start, before serving."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    real = time.time()
    kept = [folder / (time.strftime("%Y-%m-%d", time.gmtime(real - days * 86400)) + ".jsonl") for days in (1, 3)]
    for path in kept:
        path.write_text("{}\n")
    passes = asyncio.Queue()

    async def write_snapshot(store_dir):
        await passes.put(store_dir)

    disk = types.SimpleNamespace(still_refusing=lambda: False)
    server = types.SimpleNamespace(
        config=types.SimpleNamespace(metrics_snapshot_retention_days=7, metrics_snapshot_interval_s=0),
        ctx=types.SimpleNamespace(store=types.SimpleNamespace(disk=disk), aged=aged_clock()),
        metrics=None, write_snapshot=write_snapshot)
    monkeypatch.setattr(time, "time", lambda: real + 30 * 86400)      # stepped 30 days ahead since the start
    task = asyncio.get_running_loop().create_task(BrokerServer._snapshots(server, str(tmp_path)))
    try:
        for _ in range(2):          # the second write comes after the first pass's pruning
            await passes.get()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [p.name for p in kept if not p.exists()] == []
