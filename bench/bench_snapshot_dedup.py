"""The rollup's consumer_lag and broker tables over a day of metric snapshots, one line a ts (as read now: the
lag rows semi-joined, by broadcast, with the first line of each ts) against the same rows not deduplicated (as
read before), over the same loaded snapshots in one run.

    .venv/bin/python bench/bench_snapshot_dedup.py [--lines 1440] [--lag-rows 2000] [--rounds 3]

Prints the times, then as the LAST line a JSON object; "ratio" = deduplicated / not (best of --rounds each).
Not collected by pytest.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DAY_MS = 1710028800000          # 2024-03-10 00:00 UTC


def write_day(store: str, lines: int, lag_rows: int) -> None:
    os.makedirs(os.path.join(store, "metrics"))
    with open(os.path.join(store, "metrics", "2024-03-10.jsonl"), "w") as f:
        for i in range(lines):
            lag = [{"group": f"cg{r % 50}", "topic": f"T{r // 50}", "queue_id": r % 8, "lag": (i * r) % 997}
                   for r in range(lag_rows)]
            f.write(json.dumps({"ts": DAY_MS + i * 60_000, "connections": i % 40, "consumer_lag": lag}) + "\n")
    old = time.time() - 3600
    os.utime(os.path.join(store, "metrics", "2024-03-10.jsonl"), (old, old))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1440)
    ap.add_argument("--lag-rows", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args()
    from pyspark.sql import functions as F

    from ops.spark.load import load_snapshots
    from ops.spark.rollup import broker_table, consumer_lag_table
    from ops.spark.session import build_session

    spark = build_session(args.master, app_name="bench-snapshot-dedup", shuffle_partitions=4, progress=False)
    with tempfile.TemporaryDirectory() as store:
        write_day(store, args.lines, args.lag_rows)
        snaps = load_snapshots(spark, store, ["2024-03-10"], job="bench")
        undeduped = snaps.cached[0].where(F.col("kind").isin("snap", "lag"))
        best = {"dedup": float("inf"), "plain": float("inf")}
        for _ in range(args.rounds):
            for name, rows in (("plain", undeduped), ("dedup", snaps.rows)):
                started = time.perf_counter()
                consumer_lag_table(rows, ["2024-03-10"]).collect()
                broker_table(rows, ["2024-03-10"]).collect()
                best[name] = min(best[name], time.perf_counter() - started)
        snaps.release()
    spark.stop()
    rows = args.lines * (args.lag_rows + 1)
    print(f"{rows:,} snapshot rows: not deduplicated {best['plain']:.2f} s, one line a ts {best['dedup']:.2f} s")
    print(json.dumps({"bench": "snapshot_dedup", "rows": rows, "plain_s": round(best["plain"], 3),
                      "dedup_s": round(best["dedup"], 3), "ratio": round(best["dedup"] / best["plain"], 3)}))


if __name__ == "__main__":
    main()
