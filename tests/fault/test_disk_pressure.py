"""Disk pressure cleaned by the broker itself, on a real file system that fills: a 128 MiB tmpfs.

A broker 80 hours in the past (libfaketime) writes 4 MiB and leaves a transaction undecided;
the same store is then served at the real time with watermarks set just above the usage it
starts at (clean at +2 MiB, force at +7 MiB: what the broker's own files take on a fresh
tmpfs depends on the store's version) and written to, round by round: above the clean mark
the expired segments go (the old half dead-lettered `expired` first), above the force mark
the oldest young ones go too (a young undecided half in them dead-lettered `disk-pressure`
first), the active segment never, and every send is acknowledged. Paced by progress: each
round sends a fixed amount, then waits (bounded) for the cleaner to bring usage back down.
"""
from __future__ import annotations

import asyncio
import os
import re
import urllib.request

import pytest

from tests.integration.test_retention_process import Undecided, _send
from producer import TransactionProducer
from tests.support.faketime import LIBFAKETIME, SKIP_REASON, past_env
from tests.support.tmpfs import tmpfs

pytestmark = pytest.mark.asyncio

MIB = 1 << 20
FLAGS = ("--segment-size", str(MIB), "--max-message-size", "16384", "--transaction-timeout-ms", "600000",
         "--transaction-check-interval-ms", "600000")


@pytest.fixture
def disk(tmp_path):
    if LIBFAKETIME is None:
        pytest.skip(SKIP_REASON)
    with tmpfs(tmp_path / "disk", "128m") as mount:
        yield mount


def usage(path) -> float:
    st = os.statvfs(path)
    return 1 - st.f_bavail / st.f_blocks


def disk_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def removed(b) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'txmq_store_segments_removed_total\{reason="(\w+)"\} (\S+)', text)}


async def _half(b, body: bytes) -> None:
    async with TransactionProducer(b.namesrv, "PG_tx", Undecided()) as tx:
        await tx.send_in_transaction("Paid", body)


async def _until(check, timeout=15.0):
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.05)


async def test_the_broker_cleans_its_disk_by_itself(broker_factory, disk):
    store = disk / "store"
    past = broker_factory(*FLAGS, store=str(store), env=past_env("-80h"))
    await _half(past, b"undecided-80h")
    await _send(past, "old", 4000)                               # ~4 MiB: four sealed segments
    assert past.stop() == 0
    old = sorted(os.listdir(store / "commitlog"))[:-1]
    assert len(old) >= 3

    plain = broker_factory(*FLAGS, store=str(store))            # what a started broker takes, idle
    base = usage(disk)
    assert plain.stop() == 0
    clean, force = base + 2 * MIB / disk_bytes(disk), base + 7 * MIB / disk_bytes(disk)
    b = broker_factory(*FLAGS, "--disk-clean-ratio", f"{clean:.4f}", "--disk-force-clean-ratio", f"{force:.4f}",
                       "--disk-clean-interval-s", "0.1", store=str(store))
    await _half(b, b"young-undecided")                           # into the segment after the old ones
    rounds = 0
    while removed(b).get("pressure", 0) < 2 and rounds < 40:     # bounded: ~40 MiB at most
        rounds += 1
        await _send(b, f"r{rounds}", 1000)
        await _until(lambda: usage(disk) < force + 2 * MIB / disk_bytes(disk))   # the cleaner keeps up
    counts = removed(b)
    assert counts.get("expired") == len(old) and counts.get("pressure", 0) >= 2, (counts, rounds)
    left = sorted(os.listdir(store / "commitlog"))
    assert left and not set(old) & set(left)

    # The dead letters themselves may since have gone with a forced segment: the counts say it.
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
    assert 'txmq_transaction_dead_letters_total{producer_group="PG_tx",reason="expired"} 1.0' in text
    assert 'txmq_transaction_dead_letters_total{producer_group="PG_tx",reason="disk-pressure"} 1.0' in text
    assert "transaction" in b.log() and "dead-lettered: expired" in b.log() and "dead-lettered: disk-pressure" in b.log()
    logged = re.findall(r"removing segment (\d+) \((\w+)\)", b.log())
    assert [n for n, why in logged if why == "expired"] == old

    def log_and_count_agree():
        # The cleaner may still be at work (its interval is 0.1 s): it logs a removal just before it counts it.
        pressure = [n for n, why in re.findall(r"removing segment (\d+) \((\w+)\)", b.log()) if why == "pressure"]
        return len(pressure) == len(set(pressure)) == removed(b).get("pressure", 0) >= counts["pressure"]
    await _until(log_and_count_agree)
