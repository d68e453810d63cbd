"""Rollup throughput on a >= 1 GiB store, beside a single-process pure-Python decode of the same segments.

    .venv/bin/python bench/bench_spark.py [--dir DIR] [--gib 1.1] [--master local[*]]

The store is generated once through the real broker store (1 GiB segments, 1 KiB messages,
a transaction mix over ~26 hours) and reused while DIR/BENCH_DONE matches the parameters.
Prints a table, then as the LAST line a JSON object; "ratio" = Spark rollup records/s over
pure-Python decode records/s. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ops.spark import segments as seg_mod  # noqa: E402

T0 = 1710028800000          # 2024-03-10 00:00 UTC
HOUR = 3_600_000
TOPICS = ("Orders", "Payments", "Shipping", "Audit")
GROUPS = ("pg-orders", "pg-payments", "pg-billing")


def generate(store_dir: str, gib: float, seed: int = 7) -> dict:
    """~gib GiB of traffic: 80% plain 1 KiB messages, 20% transactions decided in the next batch
    (85% commit, 10% rollback, 3% checked and left open, 2% dead-lettered)."""
    from tests.spark.storegen import HALF_TOPIC, StoreBuilder

    rng = random.Random(seed)
    target = int(gib * (1 << 30))
    body = bytes(rng.randrange(256) for _ in range(1024))
    span = 26 * HOUR
    written = n = 0
    pending = []
    b = StoreBuilder(store_dir, segment_size=1 << 30)
    try:
        while written < target:
            now = T0 + span * written // target
            batch = []
            for _ in range(400):
                n += 1
                if rng.random() < 0.8:
                    batch.append((TOPICS[n % len(TOPICS)], body, n % 8,
                                  {"UNIQ_KEY": f"{n:032X}", "TAGS": "t", "WAIT": "true"}, 0, 0))
                else:
                    batch.append((HALF_TOPIC, body, 0, {"TRAN_MSG": "true", "PGROUP": GROUPS[n % len(GROUPS)],
                                                        "UNIQ_KEY": f"{n:032X}", "WAIT": "true",
                                                        "REAL_TOPIC": "Payments", "REAL_QID": str(n % 8)}, 0, 0))
            stored = b.at(now).put_many(batch)
            decisions = []
            for h in pending:
                r = rng.random()
                if r < 0.85:
                    decisions += b.commit_specs(h)
                elif r < 0.95:
                    decisions.append(b.op_spec(h, "ROLLBACK"))
                elif r < 0.98:
                    decisions += b.check_specs(h, 1)
                else:
                    decisions += b.dead_specs(h, "max-checks")
            if decisions:
                stored += b.at(now + rng.randrange(50, 5000)).put_many(decisions)
            written += sum(s.size for s in stored)
            n += len(decisions)
            pending = [s for s in stored if s.topic == HALF_TOPIC]
            b.written.clear()
    finally:
        b.close()
    return {"records": n, "bytes": written}


def ensure_store(store_dir: str, gib: float) -> dict:
    marker = os.path.join(store_dir, "BENCH_DONE")
    want = {"gib": gib, "format": 1}
    if os.path.exists(marker):
        with open(marker) as f:
            info = json.load(f)
        if info.get("params") == want:
            print(f"reusing the store in {store_dir}", file=sys.stderr)
            return info
    shutil.rmtree(store_dir, ignore_errors=True)
    os.makedirs(store_dir)
    print(f"generating a {gib} GiB store in {store_dir} ...", file=sys.stderr)
    t = time.monotonic()
    info = generate(store_dir, gib)
    info.update(params=want, seconds=round(time.monotonic() - t, 1))
    with open(marker, "w") as f:
        json.dump(info, f)
    print(f"generated {info['records']} records in {info['seconds']} s", file=sys.stderr)
    return info


def pure_python(store_dir: str) -> tuple[int, float]:
    """One process, the same decode the executors run, whole segments, no Spark."""
    t = time.perf_counter()
    _, chunks = seg_mod.plan_chunks(store_dir, 1 << 62)
    n = sum(row[18] for row in seg_mod.decode_chunks(chunks) if row[0] == "seg")   # "n" of the partials
    return n, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "txmq-bench-spark"))
    ap.add_argument("--gib", type=float, default=1.1)
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--chunk-mb", type=int, default=64)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    store = os.path.join(args.dir, "store")
    ensure_store(store, args.gib)
    store_bytes = sum(s.size for s in seg_mod.list_segments(store))

    py_records, py_s = pure_python(store)

    from ops.spark.rollup import run_rollup
    from ops.spark.session import build_session

    t = time.perf_counter()
    spark = build_session(args.master, app_name="txmq-bench", progress=False)
    start_s = time.perf_counter() - t
    out = os.path.join(args.dir, "out")
    t = time.perf_counter()
    summary = run_rollup(spark, store, out, chunk_bytes=args.chunk_mb << 20)
    rollup_s = time.perf_counter() - t
    cores = spark.sparkContext.defaultParallelism
    spark.stop()
    assert summary["records"] == py_records, (summary["records"], py_records)

    rows = [("pure-Python decode (1 process)", py_records, py_s),
            (f"Spark rollup ({args.master}, {cores} cores)", summary["records"], rollup_s)]
    print(f"store: {store_bytes / (1 << 30):.2f} GiB of segment files, {py_records:,} records; "
          f"Spark session start {start_s:.1f} s (not counted)")
    print(f"{'pass':<40} {'records':>12} {'seconds':>9} {'records/s':>12}")
    for name, n, s in rows:
        print(f"{name:<40} {n:>12,} {s:>9.1f} {n / s:>12,.0f}")
    py_rate, spark_rate = py_records / py_s, summary["records"] / rollup_s
    print(json.dumps({"store_bytes": store_bytes, "records": py_records, "cores": cores,
                      "python_seconds": round(py_s, 2), "python_records_per_s": round(py_rate),
                      "spark_seconds": round(rollup_s, 2), "spark_records_per_s": round(spark_rate),
                      "spark_session_start_s": round(start_s, 2), "ratio": round(spark_rate / py_rate, 3)}))


if __name__ == "__main__":
    main()
