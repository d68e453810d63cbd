"""Turn a store directory into DataFrames: decoded records (cached) and metric snapshots."""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field

from protocol.errors import StoreError

from . import segments as seg_mod
from .snapshots import SNAPSHOT_FIELDS, parse_lines, snapshot_files

log = logging.getLogger("ops.spark")
DEFAULT_CHUNK_BYTES = 64 << 20


def record_schema():
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    longs = ("offset", "size", "queue_offset", "store_ts", "prepared_offset", "txmq_half", "n", "bytes",
             "body_bytes", "ts_max", "qo_max")
    types = {**{n: LongType() for n in longs}, "queue_id": IntegerType(), "tx_type": IntegerType(),
             "txmq_checks": IntegerType()}
    return StructType([StructField(n, types.get(n, StringType())) for n in seg_mod.ROW_FIELDS])


@dataclass
class Scan:
    """What a pass over the commit log found."""

    rows: object                    # every row but damage reports (damaged tails left out)
    records: object                 # transaction records, one row each ("rec" rows of segments.ROW_FIELDS)
    traffic: object                 # per-chunk user traffic partials ("msg" rows)
    queues: object                  # per-chunk (topic, queue) partials ("seg" rows)
    cached: object                  # the persisted DataFrame the three are read from
    segments: list                  # [segments.Segment]
    chunks: int
    record_count: int
    damage: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def release(self) -> None:
        self.cached.unpersist()


def scan_store(spark, store_dir: str, *, job: str, skip_damaged: bool = False, check_crc: bool = False,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Scan:
    """Decode every segment in the executors. Damage raises StoreError unless skip_damaged,
    in which case the damaged tail of each segment (from the bad record on) is left out."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    started = time.monotonic()
    segments, chunks = seg_mod.plan_chunks(store_dir, chunk_bytes)
    schema = record_schema()
    sc = spark.sparkContext
    if chunks:
        total = sum(s.size for s in segments)
        slices = min(len(chunks), max(sc.defaultParallelism, math.ceil(total / chunk_bytes)))
        rdd = sc.parallelize(chunks, slices).mapPartitions(
            lambda part: seg_mod.decode_chunks(part, check_crc))
        df = spark.createDataFrame(rdd, schema, verifySchema=False)
    else:
        df = spark.createDataFrame([], schema)
    df = df.persist(StorageLevel.MEMORY_AND_DISK)
    damage = [_damage_dict(r, segments) for r in
              df.where(F.col("row") == "dmg").select("segment", "offset", "size", "damage").collect()]
    damage.sort(key=lambda d: (d["segment"], d["position"]))
    rows = df.where(F.col("row") != "dmg")
    if damage and not skip_damaged:
        df.unpersist()
        first = damage[0]
        more = f" (and {len(damage) - 1} more damaged place(s))" if len(damage) > 1 else ""
        raise StoreError(f"{job}: damaged record in {first['file']} at byte {first['position']}: "
                         f"{first['reason']}{more}; rerun with --skip-damaged to leave damaged tails out",
                         segment=first["file"], position=first["position"])
    for d in damage:
        log.warning("%s: skipped damaged tail of %s from byte %d (%d bytes): %s", job, d["file"], d["position"],
                    d["skipped_bytes"], d["reason"])
        rows = rows.where(~((F.col("segment") == d["segment"]) & (F.col("offset") >= d["offset"])))
    count = rows.where(F.col("row") == "seg").agg(F.sum("n")).first()[0] or 0
    seconds = time.monotonic() - started
    log.info("%s: decoded %d records from %d segments (%d chunks) in %.1f s", job, count, len(segments),
             len(chunks), seconds)
    return Scan(rows, rows.where(F.col("row") == "rec"), rows.where(F.col("row") == "msg"),
                rows.where(F.col("row") == "seg"), df, segments, len(chunks), count, damage, seconds)


def _damage_dict(row, segments) -> dict:
    base = int(row["segment"])
    path = next((s.path for s in segments if s.name == row["segment"]), row["segment"])
    return {"segment": row["segment"], "file": path, "offset": row["offset"], "position": row["offset"] - base,
            "skipped_bytes": row["size"], "reason": row["damage"]}


@dataclass
class Snapshots:
    rows: object            # DataFrame (kind, ts, connections, group, topic, queue_id, lag)
    cached: object          # the persisted DataFrame rows is read from
    files: int
    lines: int              # usable lines
    bad_lines: int
    incomplete_lines: int


def load_snapshots(spark, store_dir: str, dates: list[str] | None, *, job: str) -> Snapshots:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    types = {"ts": LongType(), "connections": IntegerType(), "queue_id": IntegerType(), "lag": LongType()}
    schema = StructType([StructField(n, types.get(n, StringType())) for n in SNAPSHOT_FIELDS])
    files = snapshot_files(store_dir, dates)
    if files:
        text = spark.sparkContext.textFile(",".join(_uri(p) for p in files))
        df = spark.createDataFrame(text.mapPartitions(parse_lines), schema, verifySchema=False)
    else:
        df = spark.createDataFrame([], schema)
    df = df.persist(StorageLevel.MEMORY_AND_DISK)
    counts = {r["kind"]: r["count"] for r in df.groupBy("kind").count().collect()}
    snaps = Snapshots(df.where(F.col("kind").isin("snap", "lag")), df, len(files), counts.get("snap", 0),
                      counts.get("bad", 0), counts.get("incomplete", 0))
    log.info("%s: read %d snapshot lines from %d files (%d bad lines skipped, %d incomplete)", job, snaps.lines,
             snaps.files, snaps.bad_lines, snaps.incomplete_lines)
    return snaps


def _uri(path: str) -> str:
    return path if "://" in path else "file://" + os.path.abspath(path)
