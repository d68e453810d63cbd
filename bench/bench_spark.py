"""Incremental rollup: bytes read for one day of a three-day store against the whole store.

    .venv/bin/python bench/bench_spark.py [--dir DIR] [--gib 0.4] [--segment-mb 16] [--master local[*]]

The store is generated once through the real broker store (1 KiB messages, a transaction mix,
spread evenly over three UTC days, 2024-03-09..11) and reused while DIR/BENCH_DONE matches the
parameters. In one run: a pure-Python single-process decode of every segment (the throughput
baseline), a Spark rollup of the whole store (every date), then `rollup --date 2024-03-10`,
which finds 2024-03-09 rolled up and reads only the segments the broker's manifest says can
hold that day. Prints a table, then as the LAST line a JSON object; "ratio" = bytes read for
the day / bytes read for the whole store (target: at most 0.40). Not collected by pytest.
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

T0 = 1709942400000          # 2024-03-09 00:00 UTC
DAYS = 3
DAY = "2024-03-10"          # the middle day: both its neighbours are in the store
HOUR = 3_600_000
TOPICS = ("Orders", "Payments", "Shipping", "Audit")
GROUPS = ("pg-orders", "pg-payments", "pg-billing")


def generate(store_dir: str, gib: float, segment_bytes: int, seed: int = 7) -> dict:
    """~gib GiB of traffic: 80% plain 1 KiB messages, 20% transactions decided in the next batch
    (85% commit, 10% rollback, 3% checked and left open, 2% dead-lettered)."""
    from tests.spark.storegen import HALF_TOPIC, StoreBuilder

    rng = random.Random(seed)
    target = int(gib * (1 << 30))
    body = bytes(rng.randrange(256) for _ in range(1024))
    span = DAYS * 24 * HOUR
    written = n = 0
    pending = []
    b = StoreBuilder(store_dir, segment_size=segment_bytes)
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


def ensure_store(store_dir: str, gib: float, segment_mb: int) -> dict:
    marker = os.path.join(store_dir, "BENCH_DONE")
    want = {"gib": gib, "segment_mb": segment_mb, "days": DAYS, "format": 2}
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
    info = generate(store_dir, gib, segment_mb << 20)
    info.update(params=want, seconds=round(time.monotonic() - t, 1))
    with open(marker, "w") as f:
        json.dump(info, f)
    print(f"generated {info['records']} records in {info['seconds']} s", file=sys.stderr)
    return info


def pure_python(store_dir: str) -> tuple[int, float]:
    """One process, the same decode the executors run, whole segments, no Spark."""
    t = time.perf_counter()
    _, chunks = seg_mod.plan_chunks(store_dir, 1 << 62)
    n_at = seg_mod.ROW_FIELDS.index("n")        # the partials' record count
    n = sum(row[n_at] for row in seg_mod.decode_chunks(chunks) if row[0] == "seg")
    return n, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "txmq-bench-spark"))
    ap.add_argument("--gib", type=float, default=0.4)
    ap.add_argument("--segment-mb", type=int, default=16)
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--chunk-mb", type=int, default=64)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    store = os.path.join(args.dir, "store")
    ensure_store(store, args.gib, args.segment_mb)
    segments = seg_mod.list_segments(store)
    store_bytes = sum(s.size for s in segments)

    py_records, py_s = pure_python(store)

    from ops.spark.rollup import run_rollup
    from ops.spark.session import build_session

    t = time.perf_counter()
    spark = build_session(args.master, app_name="txmq-bench", progress=False)
    start_s = time.perf_counter() - t
    out = os.path.join(args.dir, "out")
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    whole = run_rollup(spark, store, out, chunk_bytes=args.chunk_mb << 20)
    whole_s = time.perf_counter() - t
    t = time.perf_counter()
    day = run_rollup(spark, store, out, date=DAY, chunk_bytes=args.chunk_mb << 20)
    day_s = time.perf_counter() - t
    cores = spark.sparkContext.defaultParallelism
    spark.stop()
    assert whole["records"] == py_records, (whole["records"], py_records)
    assert day["incremental"], "the day before was rolled up just above: the day should be incremental"

    print(f"store: {store_bytes / (1 << 20):.0f} MiB in {len(segments)} segments of {args.segment_mb} MiB over "
          f"{DAYS} days, {py_records:,} records; Spark ({args.master}, {cores} cores) session start "
          f"{start_s:.1f} s (not counted); machine shared with other jobs")
    print(f"{'pass':<44} {'segments':>8} {'MiB read':>9} {'records':>11} {'seconds':>8} {'records/s':>10}")
    for name, segs, nbytes, n, sec in (
            ("pure-Python decode, whole store (1 process)", len(segments), store_bytes, py_records, py_s),
            ("Spark rollup, whole store (every date)", whole["segments_read"], whole["bytes_read"], whole["records"],
             whole_s),
            (f"Spark rollup --date {DAY} (incremental)", day["segments_read"], day["bytes_read"], day["records"],
             day_s)):
        print(f"{name:<44} {segs:>8} {nbytes / (1 << 20):>9.1f} {n:>11,} {sec:>8.1f} {n / sec:>10,.0f}")
    ratio = day["bytes_read"] / whole["bytes_read"]
    print(f"one day read {ratio:.1%} of the bytes of the whole store (target <= 40%)")
    print(json.dumps({"store_bytes": store_bytes, "segments": len(segments), "segment_mb": args.segment_mb,
                      "records": py_records, "cores": cores, "python_seconds": round(py_s, 2),
                      "python_records_per_s": round(py_records / py_s),
                      "whole_seconds": round(whole_s, 2), "whole_bytes_read": whole["bytes_read"],
                      "whole_records_per_s": round(whole["records"] / whole_s),
                      "day": DAY, "day_seconds": round(day_s, 2), "day_bytes_read": day["bytes_read"],
                      "day_segments_read": day["segments_read"], "spark_session_start_s": round(start_s, 2),
                      "target": 0.4, "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
