"""One nightly rollup into an --out holding months of history: what reading --out costs.

    .venv/bin/python bench/bench_rollup_history.py [--code DIR] [--history-days 120] [--runs 5]

Two brokers' small stores (tests/spark/test_history.build: three days, 2024-03-09..11) are rolled
up whole into a fresh --out; each table's partitions are then copied to --history-days earlier
dates (a long history), and `rollup --date 2024-03-10` of broker-a is timed --runs times (the
first run is a warm-up and not counted). --code runs another checkout's ops/spark (e.g. a
detached worktree of main) on the same stores and history: run both, one after the other, to
compare. Prints the median and each run's seconds, then a JSON line. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--code", default=ROOT, help="checkout whose ops/spark to run (default: this one)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "txmq-bench-rollup-history"))
    ap.add_argument("--history-days", type=int, default=120)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.code))
    sys.path.insert(1, ROOT)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)

    from ops.spark.rollup import run_rollup
    from ops.spark.session import build_session
    from tests.spark.test_history import build

    stores = [os.path.join(args.dir, name) for name in ("broker-a", "broker-b")]
    if not all(os.path.isdir(s) for s in stores):
        shutil.rmtree(args.dir, ignore_errors=True)
        for s in stores:
            build(s)
    spark = build_session(args.master, app_name="txmq-bench", shuffle_partitions=4, progress=False)
    out = os.path.join(args.dir, "out")
    shutil.rmtree(out, ignore_errors=True)
    run_rollup(spark, stores, out)
    for table in ("traffic", "transactions", "consumer_lag", "broker"):
        src = os.path.join(out, table, "date=2024-03-09")
        for k in range(1, args.history_days + 1):
            day = (dt.date(2024, 3, 8) - dt.timedelta(days=k)).isoformat()
            shutil.copytree(src, os.path.join(out, table, f"date={day}"))
    seconds = []
    for _ in range(args.runs + 1):
        t = time.perf_counter()
        run_rollup(spark, stores[0], out, date="2024-03-10")
        seconds.append(time.perf_counter() - t)
    spark.stop()
    runs = seconds[1:]
    print(f"{args.code}: rollup --date 2024-03-10 of one broker into {args.history_days + 4} dates of history: "
          f"median {statistics.median(runs):.2f} s ({', '.join(f'{s:.2f}' for s in runs)})")
    print(json.dumps({"code": args.code, "history_days": args.history_days, "runs": [round(s, 3) for s in runs],
                      "median_s": round(statistics.median(runs), 3)}))


if __name__ == "__main__":
    main()
