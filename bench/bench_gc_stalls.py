"""Full garbage collections with a large undecided index: their pauses and the sends they stall, main against this.

    python bench/bench_gc_stalls.py [--undecided 500000] [--churn 400000] [--base /work/main]

Runs itself twice, once on ``--base``'s broker code and once on this checkout's (run with
PYTHONDONTWRITEBYTECODE=1). Each run: a real store and transaction service (the unit tests' make_service), its
index given ``--undecided`` transactions of 10 senders (as recovery or a burst of halves leaves it), then what the
broker does after a load (this checkout: broker.heap settles the heap; main: nothing). Then ``--churn`` more
transactions are indexed and decided, 20,000 in flight, while a probe puts 100-byte messages one after the other
(a SEND's store path) between them. gc.callbacks times every generation-2 collection. Each run prints its JSON
(gen-2 count / worst / total, the probe's p50 / p99 / worst put and step, RSS before and after the churn); the last line is
JSON with both and "ratio" = this checkout's worst step (200 transactions and a put: what a request queued behind
them waits) / main's (ours over the baseline: below 1 is better), and "gen2_max_ratio" the same for the worst gen-2
pause (0 counted as 0.01 ms).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ap = argparse.ArgumentParser()
ap.add_argument("--undecided", type=int, default=500_000)
ap.add_argument("--churn", type=int, default=400_000)
ap.add_argument("--base", default="/work/main")
ap.add_argument("--repo", help=argparse.SUPPRESS)      # set on the child runs
args = ap.parse_args()


def _ms(xs, q):
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(len(xs) * q))], 2) if xs else 0.0


def _rss_mib():
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


async def run():
    sys.path.insert(0, args.repo)
    from broker.store import PutRequest
    from broker.transaction.core import Tx
    from tests.unit.test_review_transactions import Clock, make_service
    try:
        from broker.heap import HeapSettler
    except ImportError:
        HeapSettler = None

    pauses, started = [], [0.0]

    def timing(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - started[0])

    with tempfile.TemporaryDirectory() as d:
        ctx = await make_service(Path(d), Clock())
        core = ctx.tx.core

        def tx(i):
            return Tx(half_offset=1000 + 300 * i, queue_offset=i, group="PG", topic="T", uniq_key=f"U{i}",
                      store_ts=0, checks=i % 5, owner_id=f"client-{i % 10}@host")
        for i in range(args.undecided):
            core._put(tx(i))
        settled = None
        if HeapSettler is not None:
            settled = round(HeapSettler(lambda: len(core.pending)).settle("bench load"), 3)
        store = ctx.store._store
        rss_before = _rss_mib()
        gc.callbacks.append(timing)
        lat, steps = [], []
        n = args.undecided
        step0 = time.perf_counter()
        for k in range(args.churn):
            core._put(tx(n + k))
            if k >= 20_000:
                core.withdraw(1000 + 300 * (n + k - 20_000))
            if k % 200 == 0:
                t0 = time.perf_counter()
                r = await store.put(PutRequest.build("P", b"x" * 100))
                lat.append(time.perf_counter() - t0)
                assert r.ok
                steps.append(time.perf_counter() - step0)    # what a request queued behind this work waits
                step0 = time.perf_counter()
        gc.callbacks.remove(timing)
        out = {"repo": args.repo, "undecided": args.undecided, "churn": args.churn, "settle_s": settled,
               "gen2_n": len(pauses), "gen2_max_ms": _ms(pauses, 1), "gen2_total_ms": round(1000 * sum(pauses), 1),
               "puts": len(lat), "put_p50_ms": _ms(lat, .5), "put_p99_ms": _ms(lat, .99),
               "put_max_ms": _ms(lat, 1), "step_p99_ms": _ms(steps, .99), "step_max_ms": _ms(steps, 1),
               "rss_mib_before": rss_before, "rss_mib_after": _rss_mib(),
               "pending": len(core.pending)}
        await store.close()
        print(json.dumps(out), flush=True)


def compare():
    runs = {}
    for name, repo in (("main", args.base), ("this", str(HERE))):
        cmd = [sys.executable, __file__, "--undecided", str(args.undecided), "--churn", str(args.churn),
               "--repo", repo]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        if proc.returncode:
            sys.exit(proc.stderr)
        line = proc.stdout.strip().splitlines()[-1]
        print(name, line, flush=True)
        runs[name] = json.loads(line)
    main, this = runs["main"], runs["this"]
    print(json.dumps({"main": main, "this": this,
                      "ratio": round(this["step_max_ms"] / main["step_max_ms"], 2),
                      "gen2_max_ratio": round(max(this["gen2_max_ms"], 0.01) / max(main["gen2_max_ms"], 0.01), 2)}))


if args.repo:
    asyncio.run(run())
else:
    compare()
