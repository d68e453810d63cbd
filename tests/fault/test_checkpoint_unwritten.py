"""A real broker whose checkpoint cannot be written (its file's ``.tmp`` made a directory, as an I/O error on the
checkpoint alone would: the log's segments are fine, sends go on): txmq_store_checkpoint_lag_bytes grows with every
record flushed, survives a kill -9 (the next start reports the log past the checkpoint it found) and falls to 0 once
a checkpoint is written again. (A full disk refuses the sends themselves, so the log stops growing there.)"""
from __future__ import annotations

import asyncio

import pytest

from producer import Producer
from tests.integration.test_disk_watermark import _metrics
from tests.support.broker_process import BrokerProcess

pytestmark = pytest.mark.asyncio

LAG = "txmq_store_checkpoint_lag_bytes"
BODY = b"x" * 1000


async def _lag_until(b, ok) -> float:
    """The gauge once ``ok(lag)`` holds (scraped every 0.1 s; bounded)."""
    async with asyncio.timeout(20):
        while not ok(lag := (await asyncio.to_thread(_metrics, b.metrics))[LAG]):
            await asyncio.sleep(0.1)
    return lag


def _log(b) -> str:
    """The broker's whole log (b.log() is its tail: the first run's lines scroll out of it)."""
    return b.log_path.read_text(errors="replace")


async def _said(b, line: str, times: int = 1) -> None:
    """Until the broker's log (both runs': appended) holds ``line`` ``times`` times (read every 0.1 s; bounded)."""
    async with asyncio.timeout(20):
        while _log(b).count(line) < times:
            await asyncio.sleep(0.1)


async def _send(b, n: int) -> None:
    async with Producer(b.namesrv, "PG_ckpt", retries=0) as producer:
        for i in range(n):
            await producer.send("Ckpt", BODY + str(i).encode())


async def test_the_lag_grows_while_the_checkpoint_fails_survives_a_crash_and_falls_when_written(tmp_path):
    store = tmp_path / "store"
    b = BrokerProcess(store).start()
    try:
        await _send(b, 10)
        await _lag_until(b, lambda lag: lag == 0)
        (store / "checkpoint.tmp").mkdir()          # every checkpoint from now on fails (IsADirectoryError)
        await _send(b, 100)
        await _said(b, "checkpoint not written")
        grown = await _lag_until(b, lambda lag: lag >= 100 * len(BODY))
        b.kill()

        b = BrokerProcess(store).start()            # the directory still there: the start's lag, and no checkpoint
        assert (await asyncio.to_thread(_metrics, b.metrics))[LAG] >= grown
        await _said(b, "checkpoint not written", 2)
        await _send(b, 10)
        await _lag_until(b, lambda lag: lag >= grown + 10 * len(BODY))
        (store / "checkpoint.tmp").rmdir()
        await _said(b, "checkpoint written again")
        await _lag_until(b, lambda lag: lag == 0)
        assert _log(b).count("checkpoint not written") == 2, b.log()   # (once a run, not every second)
    finally:
        b.stop()
