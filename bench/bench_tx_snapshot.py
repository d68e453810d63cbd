"""What a transaction snapshot of a large undecided index costs the sends around it, in one process.

    python bench/bench_tx_snapshot.py [--undecided 500000] [--snapshots 3] [--repo PATH]

A real store and transaction service (the unit tests' make_service) whose index is given ``--undecided``
transactions of 10 senders directly (no halves written: a snapshot reads only the index). A probe puts a 100-byte
message into the store, one after the other, as a SEND does (writer, group commit, flush): 300 with no snapshot
(the baseline), then all the while ``--snapshots`` snapshots are written one after the other. Prints the probe's
p50 / p99 / worst put during the snapshots and before, the snapshot's time, and the event loop's worst gap (a
task that sleeps 1 ms at a time). Last line JSON, "ratio" = p99 put during the snapshots / p99 before (the same
run's). ``--repo``: the checkout whose broker code runs (a baseline; run with PYTHONDONTWRITEBYTECODE=1 there).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--undecided", type=int, default=500_000)
ap.add_argument("--snapshots", type=int, default=3)
ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
args = ap.parse_args()
sys.path.insert(0, args.repo)

from broker.store import PutRequest  # noqa: E402
from broker.transaction.core import Tx  # noqa: E402
from tests.unit.test_review_transactions import Clock, make_service  # noqa: E402


def _ms(xs, q):
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(len(xs) * q))], 2)


async def main():
    with tempfile.TemporaryDirectory() as d:
        ctx = await make_service(Path(d), Clock())
        core = ctx.tx.core
        for i in range(args.undecided):
            core._put(Tx(half_offset=1000 + 300 * i, queue_offset=i, group="PG", topic="T", uniq_key=f"U{i}",
                         store_ts=0, checks=i % 5, owner_id=f"client-{i % 10}@host"))
        store = ctx.store._store

        async def probe(lat, until):
            while not until():
                t0 = time.perf_counter()
                r = await store.put(PutRequest.build("P", b"x" * 100))
                lat.append(time.perf_counter() - t0)
                assert r.ok

        gaps = []

        async def ticker(stop):
            while not stop.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                gaps.append(time.perf_counter() - t0)

        quiet = []
        await probe(quiet, lambda: len(quiet) >= 300)
        took = []

        async def snapshots():
            for _ in range(args.snapshots):
                ctx.tx.changed = True
                t0 = time.perf_counter()
                await ctx.tx.write_snapshot()
                took.append(round(time.perf_counter() - t0, 3))
        stop = asyncio.Event()
        tick = asyncio.ensure_future(ticker(stop))
        during = []
        snaps = asyncio.ensure_future(snapshots())
        await probe(during, snaps.done)
        await snaps
        stop.set()
        await tick
        out = {"undecided": args.undecided, "snapshot_s": took, "puts": len(during),
               "put_p50_ms": _ms(during, .5), "put_p99_ms": _ms(during, .99), "put_max_ms": _ms(during, 1),
               "quiet_put_p50_ms": _ms(quiet, .5), "quiet_put_p99_ms": _ms(quiet, .99),
               "loop_gap_max_ms": _ms(gaps, 1)}
        out["ratio"] = round(out["put_p99_ms"] / out["quiet_put_p99_ms"], 2)
        print(json.dumps(out))
        await store.close()


asyncio.run(main())
