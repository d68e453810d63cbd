"""Retention on a store whose files the file system will not let it unlink: a real broker on an ext4 loop device,
one queue's consume-queue directory made immutable (chattr +i: every unlink in it EPERM) before disk pressure
removes the sealed segments. The removals complete, said once and counted, consumers see the queue's right minimum,
and the broker starts again with the files still there (it did not: the leftover's unlink raised out of recovery).
Mounting needs root; elsewhere the test is skipped and says why.
"""
from __future__ import annotations

import asyncio
import subprocess

import pytest

from consumer import PullConsumer
from consumer.pull_consumer import PullStatus
from tests.fault.test_disk_full import _metric
from tests.integration.test_retention_process import _send
from tests.support.tmpfs import ext4

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

MIB = 1 << 20
FLAGS = ("--segment-size", str(MIB), "--max-message-size", "16384", "--cq-units-per-file", "64", "--index-hash-slots",
         "700000")
PRESSED = ("--disk-clean-ratio", "0.001", "--disk-force-clean-ratio", "0.002", "--disk-clean-interval-s", "0.1")
FAILED = 'txmq_store_segment_removals_failed_total{errno="EPERM",what="queue-file"}'
REMOVED = 'txmq_store_segments_removed_total{reason="pressure"}'
POLLS = 300


def _count(b, name: str) -> float:
    """A labelled counter's value, 0 before its first increment (not exported until then)."""
    try:
        return _metric(b.metrics, name)
    except AssertionError:
        return 0.0


async def _queue_zero(b) -> tuple[int, PullStatus]:
    """Queue 0 of Flow: its minimum offset, and how a pull from it ends."""
    consumer = PullConsumer(b.namesrv, "CG_unremovable")
    try:
        mq = next(q for q in await consumer.fetch_queues("Flow") if q.queue_id == 0)
        low = await consumer.min_offset(mq)
        return low, (await consumer.pull(mq, low, max_nums=4)).status
    finally:
        await consumer.shutdown()


async def test_a_queue_directory_retention_cannot_empty_leaves_removals_whole_and_the_broker_starting(
        broker_factory, tmp_path):
    started = []

    def start(*flags):
        started.append(broker_factory(*FLAGS, *flags, store=str(store)))
        return started[-1]
    with ext4(tmp_path / "disk", tmp_path / "disk.img", "128M") as disk:
        store = disk.mount_point / "store"
        queue_dir = store / "consumequeue" / "Flow" / "0"
        try:
            b = start()
            await _send(b, "old", 4000)                          # ~4 MiB: four sealed segments
            assert b.stop() == 0
            first = sorted(p.name for p in queue_dir.iterdir())[0]
            subprocess.run(["chattr", "+i", str(queue_dir)], check=True)
            b = start(*PRESSED)
            for _ in range(POLLS):
                if _count(b, REMOVED) >= 3:
                    break
                await asyncio.sleep(0.1)
            assert _count(b, REMOVED) >= 3, b.log()
            assert _count(b, FAILED) >= 1, b.log()
            said = b.log_path.read_text(errors="replace")
            assert said.count("could not be unlinked") == 1, said[-4000:]
            assert "disk pressure check failed" not in said
            low, status = await _queue_zero(b)
            assert low > 0 and status == PullStatus.FOUND, (low, status)
            assert b.stop() == 0
            b = start()                                          # the files still there: it starts all the same
            assert await _queue_zero(b) == (low, PullStatus.FOUND)
            assert (queue_dir / first).exists()
            assert b.stop() == 0
            subprocess.run(["chattr", "-i", str(queue_dir)], check=True)
            b = start()                                          # made removable: this start removes them
            assert await _queue_zero(b) == (low, PullStatus.FOUND)
            assert not (queue_dir / first).exists()
            assert b.stop() == 0
        finally:
            for b in started:
                b.kill()
            subprocess.run(["chattr", "-i", str(queue_dir)], check=False, capture_output=True)
