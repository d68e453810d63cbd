"""A broker killed in the middle of removing its oldest commit-log segment, started again.

A removal (retention, disk pressure, an expiry plan) unlinks the segment file first and writes the segment
manifest (segments.json) last; a kill -9 between them leaves the log starting one segment later while the
manifest still names the segment. The window is a few system calls inside the writer, so the test makes the
state it leaves -- the broker killed, the oldest segment's file unlinked -- rather than aiming a kill at it by
the clock. The start used to take that without a word (its own line: "N records verified from offset X");
now it names the segment gone and what it held, counts it, and keeps it as the manifest's ``removed`` entry.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from producer import LocalTransactionState, Producer, TransactionProducer
from tests.support.bounded import bounded
from tests.support.offsets import drain

pytestmark = pytest.mark.asyncio

SEG = 256 * 1024
FLAGS = ("--segment-size", str(SEG), "--max-message-size", str(16 * 1024))
N = 600         # about two and a half segments of ~1 KiB records


def _gone_metric(addr: str) -> float:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith('txmq_store_segments_removed_total{reason="gone"} '):
                return float(line.split()[1])
    return 0.0


class Undecided:
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.UNKNOW

    def check_local_transaction(self, msg):
        return LocalTransactionState.UNKNOW


async def _fill(b) -> None:
    async with Producer(b.namesrv, "PG_gone") as producer:
        for lo in range(0, N, 50):
            await asyncio.gather(*(producer.send("Gone", f"m-{i}".encode().ljust(1000, b"."))
                                   for i in range(lo, lo + 50)))


async def _oldest_gone(broker_factory, b) -> tuple[dict, object]:
    """``b`` stopped (a clean stop writes the manifest naming every sealed segment, as a running broker has),
    started, killed, its oldest segment's file unlinked (a removal's first step); started again."""
    b.stop()
    oldest = json.loads((b.store_dir / "segments.json").read_text())["segments"][0]
    assert oldest["name"] == "0" * 20 and oldest["sealed"] and oldest["records"] > 0
    b = await asyncio.to_thread(broker_factory, *FLAGS)
    b.kill()
    (b.store_dir / "commitlog" / oldest["name"]).unlink()
    return oldest, await asyncio.to_thread(broker_factory, *FLAGS)


@bounded(90)
async def test_a_segment_removal_cut_short_by_a_kill_is_said_at_the_next_start(broker_factory):
    b = broker_factory(*FLAGS)
    await _fill(b)
    oldest, b = await _oldest_gone(broker_factory, b)
    log = b.log()
    assert (f"commit-log segments {oldest['name']}, named by the segment manifest, are gone from disk: the log now "
            f"starts at {SEG}. {oldest['records']} records went with them") in log
    assert _gone_metric(b.metrics) == 1
    _statuses, moved, bodies = await drain(b.namesrv, "CG_gone", "Gone")
    assert moved >= 1 and len(bodies) == len(set(bodies)) == N - oldest["records"]
    b.stop()
    # Kept as the manifest's "removed" entry: the rollup tells the day it cut from the days left whole by it.
    assert json.loads((b.store_dir / "segments.json").read_text())["removed"]["name"] == oldest["name"]
    b = broker_factory(*FLAGS)      # said once: the manifest written since no longer names it
    assert _gone_metric(b.metrics) == 0
    assert "gone from disk" not in b.log().split("signal received: stopping")[-1]


@bounded(90)
async def test_an_undecided_half_in_a_segment_gone_by_hand_is_said_lost_without_blaming_a_slave(broker_factory):
    """A master's retention dead-letters a segment's undecided halves before it removes it: one gone from a
    master's segment went some other way, and the ERROR naming it said only a slave's cleaner could do that."""
    b = broker_factory(*FLAGS)
    async with TransactionProducer(b.namesrv, "PG_gone_tx", Undecided()) as tx:
        await tx.send_in_transaction("GoneTx", b"undecided in the oldest segment")
    await _fill(b)
    _oldest, b = await _oldest_gone(broker_factory, b)
    (said,) = [line for line in b.log().splitlines() if "transaction recovery: 1 undecided half message(s) are in "
               "commit-log segments removed without a dead letter" in line]
    assert "ERROR" in said and "or removed by hand or missed by a copy of the store" in said


@bounded(120)
async def test_removals_that_finished_are_never_said_gone_after_a_kill_or_a_stop(broker_factory, tmp_path):
    """The other side: a plan's removals (one, then two in one pass) that finished wrote segments.json after their
    unlinks, so neither a kill -9 right after them nor a clean stop has the next start say a segment gone."""
    from tests.integration.test_retention_process import _admin, _plan     # (skips without libfaketime, as there)
    flags = (*FLAGS, "--file-reserved-hours", "0.0001")     # 0.36 s: every sealed segment may go by a plan
    b = broker_factory(*flags)
    for _ in range(2):
        await _fill(b)      # 1,200 records: four sealed segments and more
    b.stop()                # the manifest written (a running broker writes it within a checkpoint interval)
    b = await asyncio.to_thread(broker_factory, *flags)
    removed = []
    for take, restart in ((1, "kill"), (2, "stop")):
        plan = _plan(b.store_dir, int(time.time() * 1000), retention_ms=0)
        plan["segments"] = plan["segments"][:take]
        code, reply = await asyncio.to_thread(_admin, b, plan, tmp_path, f"take{take}")
        assert code == 0 and reply["segments_removed"] == [s["name"] for s in plan["segments"]], reply
        removed += reply["segments_removed"]
        b.kill() if restart == "kill" else b.stop()
        b = await asyncio.to_thread(broker_factory, *flags)
        assert _gone_metric(b.metrics) == 0
        assert json.loads((b.store_dir / "segments.json").read_text())["removed"]["name"] == removed[-1]
    assert len(removed) == 3 and "gone from disk" not in b.log_path.read_text()
    _statuses, moved, bodies = await drain(b.namesrv, "CG_after", "Gone")
    assert moved >= 1 and 0 < len(bodies) < 2 * N
