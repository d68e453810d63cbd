"""Turn a store directory into DataFrames: decoded records (cached) and metric snapshots."""
from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import dataclass, field

from protocol.errors import StoreError

from . import segments as seg_mod
from .snapshots import SNAPSHOT_FIELDS, parse_lines, read_lines, snapshot_files, whole_part

log = logging.getLogger("ops.spark")
DEFAULT_CHUNK_BYTES = 64 << 20


def record_schema():
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    longs = ("offset", "size", "queue_offset", "store_ts", "prepared_offset", "txmq_half", "n", "bytes",
             "body_bytes", "ts_max", "qo_max", "half_qo")
    types = {**{n: LongType() for n in longs}, "queue_id": IntegerType(), "tx_type": IntegerType(),
             "txmq_checks": IntegerType()}
    return StructType([StructField(n, types.get(n, StringType())) for n in seg_mod.ROW_FIELDS])


@dataclass
class Scan:
    """What a pass over the commit log found."""

    rows: object                    # every rec / msg / seg row (damaged tails left out)
    records: object                 # transaction records, one row each ("rec" rows of segments.ROW_FIELDS)
    traffic: object                 # per-chunk user traffic partials ("msg" rows)
    queues: object                  # per-chunk (topic, queue) partials ("seg" rows)
    cached: object                  # the persisted DataFrame the three are read from
    segments: list                  # [segments.Segment]: every segment of the store
    chunks: int
    record_count: int
    damage: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    read: list = field(default_factory=list)        # the segments actually read
    ends: dict = field(default_factory=dict)        # segment name -> commit-log offset after its data
    bytes_read: int = 0                             # bytes of record data decoded
    kept: list[dict] = field(default_factory=list)  # damaged records the broker kept in place: stepped over
    check_crc: bool = False                         # records were read with their CRC (read_halves reads so too)

    def release(self) -> None:
        self.cached.unpersist()


def scan_store(spark, store_dir: str, *, job: str, skip_damaged: bool = False, check_crc: bool = False,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, select=None) -> Scan:
    """Decode segments in Spark tasks: every one, or those ``select(segments)`` returns.

    Damage raises StoreError unless skip_damaged, in which case the damaged tail of each
    segment (from the bad record on) is left out. A file a task cannot read raises
    StoreError with one line naming the path and the host, whatever skip_damaged says.
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    started = time.monotonic()
    segments = seg_mod.list_segments(store_dir)
    chosen = segments if select is None else select(segments)
    schema = record_schema()
    sc = spark.sparkContext
    par = sc.defaultParallelism
    if not chosen:
        df = spark.createDataFrame([], schema)
    elif all(s.size <= chunk_bytes for s in chosen):       # one chunk a segment: nothing to walk
        chunks = [seg_mod.Chunk(s, 0, s.size, True) for s in chosen]
        rdd = sc.parallelize(chunks, min(len(chunks), max(par, 1))).mapPartitions(
            lambda part: seg_mod.decode_chunks(part, check_crc))
        df = spark.createDataFrame(rdd, schema, verifySchema=False)
    else:
        # The record-boundary walk runs in tasks (one per segment), then the chunks spread out.
        total = sum(s.size for s in chosen)
        slices = max(par, math.ceil(total / chunk_bytes))
        rdd = (sc.parallelize(chosen, len(chosen)).flatMap(lambda s: seg_mod.split_segment(s, chunk_bytes))
               .repartition(slices).mapPartitions(lambda part: seg_mod.decode_chunks(part, check_crc)))
        df = spark.createDataFrame(rdd, schema, verifySchema=False)
    df = df.persist(StorageLevel.MEMORY_AND_DISK)
    notes = df.where(F.col("row").isin("dmg", "err", "end", "kept")).select("row", "segment", "offset", "size",
                                                                              "damage").collect()
    errors = sorted(r["damage"] for r in notes if r["row"] == "err")
    if errors:
        df.unpersist()
        more = f" (and {len(errors) - 1} more file(s))" if len(errors) > 1 else ""
        raise StoreError(f"{job}: {errors[0]}{more}")
    ends = {r["segment"]: r["offset"] for r in notes if r["row"] == "end"}
    damage = [_damage_dict(r, segments) for r in notes if r["row"] == "dmg"] + holes(segments)
    damage.sort(key=lambda d: (d["segment"], d["position"]))
    kept = _kept(notes, segments, job)
    rows = df.where(F.col("row").isin("rec", "msg", "seg"))
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
    bytes_read = sum(r["size"] or 0 for r in notes if r["row"] == "end")
    seconds = time.monotonic() - started
    log.info("%s: decoded %d records from %d of %d segments (%d bytes) in %.1f s", job, count, len(chosen),
             len(segments), bytes_read, seconds)
    return Scan(rows, rows.where(F.col("row") == "rec"), rows.where(F.col("row") == "msg"),
                rows.where(F.col("row") == "seg"), df, segments, len(chosen), count, damage, seconds,
                list(chosen), ends, bytes_read, kept, check_crc=check_crc)


def _kept(notes, segments, job: str) -> list[dict]:
    """The kept rows among ``notes`` (damaged records the broker kept in place), each said at WARNING."""
    kept = sorted((_damage_dict(r, segments) for r in notes if r["row"] == "kept"),
                  key=lambda d: (d["segment"], d["position"]))
    for k in kept:
        log.warning("%s: left out the damaged record %s byte %d (%d bytes) the broker kept in place (corrupt_kept), "
                    "read on after it%s", job, k["file"], k["position"], k["skipped_bytes"],
                    f": {k['reason']}" if k["reason"] else "")
    return kept


def read_halves(spark, scan: Scan, offsets: list[int], *, skip_damaged: bool = False):
    """rec rows of the records at these commit-log offsets (halves an incremental scan did not
    read but whose decisions it met), read one record each in Spark tasks; also adds their
    bytes to scan.bytes_read. Offsets whose segment is gone are skipped. A record that does not
    decode is damage, as in scan_store: StoreError, or with skip_damaged left out and added to
    scan.damage."""
    from pyspark.sql import functions as F

    read = {s.name for s in scan.read}
    items = []
    for off in sorted(set(offsets)):
        seg = _segment_of(scan.segments, off)
        if seg is not None and seg.name not in read:
            items.append((seg, off))
    if not items:
        return None
    sc = spark.sparkContext
    # Read as the scan read: else a damaged half its --check-crc scan stops at (or leaves out) came back sound
    # here, and its decision was counted.
    rdd = sc.parallelize(items, min(len(items), sc.defaultParallelism)).mapPartitions(
        functools.partial(seg_mod.read_records, check_crc=scan.check_crc))
    df = spark.createDataFrame(rdd, record_schema(), verifySchema=False).cache()
    notes = df.where(F.col("row").isin("dmg", "err", "kept")).select("row", "segment", "offset", "size",
                                                                      "damage").collect()
    errors = [r["damage"] for r in notes if r["row"] == "err"]
    if errors:
        df.unpersist()
        raise StoreError(errors[0])
    damage = sorted((_damage_dict(r, scan.segments) for r in notes if r["row"] == "dmg"),
                    key=lambda d: (d["segment"], d["position"]))
    if damage and not skip_damaged:
        df.unpersist()
        first = damage[0]
        more = f" (and {len(damage) - 1} more)" if len(damage) > 1 else ""
        raise StoreError(f"rollup: damaged half in {first['file']} at byte {first['position']}: {first['reason']}"
                         f"{more}; rerun with --skip-damaged to leave it out", segment=first["file"],
                         position=first["position"])
    for d in damage:
        log.warning("rollup: left out the damaged half in %s at byte %d: %s", d["file"], d["position"], d["reason"])
    scan.damage += damage
    scan.kept += _kept(notes, scan.segments, "rollup")     # its decision is met with no half, as in a whole scan
    got = df.where(F.col("row") == "rec")
    scan.bytes_read += got.agg(F.sum("size")).first()[0] or 0
    log.info("read %d records outside the segments scanned (halves decided in them)", got.count())
    return got


def half_offsets_by_queue(store_dir: str, queue_offsets) -> list[int]:
    """The commit-log offsets of the halves at these queue offsets of RMQ_SYS_TRANS_HALF_TOPIC queue 0, read on
    the driver from the broker's consume queue (20-byte units, ``<20-digit start byte>`` files), as the broker's
    recovery finds an op body's half (``physical_offset_of``). For a one-day run: an op's body names its half by
    queue offset, and a half in a segment the run does not read is found no other way (its TXMQ_HALF, under no
    CRC, may name another). Units the queue no longer has (files gone, RocketMQ's pre-blank) are skipped."""
    from protocol.schema import CQ_UNIT_SIZE, ConsumeQueueUnit
    from protocol.txlog import HALF_TOPIC

    qdir = os.path.join(store_dir, "consumequeue", HALF_TOPIC, "0")
    try:
        files = sorted((int(n), os.path.join(qdir, n)) for n in os.listdir(qdir) if n.isdigit() and len(n) == 20)
    except OSError:
        return []
    out = []
    for q in sorted(set(queue_offsets)):
        at = q * CQ_UNIT_SIZE
        start, path = next(((b, f) for b, f in reversed(files) if b <= at), (None, None))
        if path is None:
            continue
        try:
            with open(path, "rb") as f:
                f.seek(at - start)
                raw = f.read(CQ_UNIT_SIZE)
        except OSError:
            continue
        if len(raw) == CQ_UNIT_SIZE:
            u = ConsumeQueueUnit.parse(raw)
            if u.size > 0 and u.size != 0x7FFFFFFF and u.physical_offset >= 0:
                out.append(u.physical_offset)
    return out


def holes(segments) -> list[dict]:
    """Damage entries for places where a segment file does not run to the next one's start: a
    segment missing from the middle of the log, or cut short (the broker will not start on either)."""
    out = []
    for seg, nxt in zip(segments, segments[1:]):
        if seg.base + seg.size != nxt.base:
            out.append({"segment": seg.name, "file": seg.path, "offset": seg.base + seg.size, "position": seg.size,
                        "skipped_bytes": nxt.base - seg.base - seg.size,
                        "reason": f"the log has a hole: this file ends at commit-log offset {seg.base + seg.size} "
                                  f"but the next segment starts at {nxt.base} (a segment file missing or cut short)"})
    return out


def _segment_of(segments, offset: int):
    for seg in segments:
        if seg.base <= offset < seg.base + seg.size:
            return seg
    return None


def _damage_dict(row, segments) -> dict:
    base = int(row["segment"])
    path = next((s.path for s in segments if s.name == row["segment"]), row["segment"])
    return {"segment": row["segment"], "file": path, "offset": row["offset"], "position": row["offset"] - base,
            "skipped_bytes": row["size"], "reason": row["damage"]}


@dataclass
class Snapshots:
    rows: object            # DataFrame (kind, ts, connections, group, topic, queue_id, lag, line), one line a ts
    cached: list            # the persisted DataFrames rows is read from
    files: int
    lines: int              # usable lines, one a ts
    bad_lines: int
    incomplete_lines: int
    duplicate_lines: int    # usable lines not read: another of the same ts was
    early_lines: int = 0    # lines stamped before MIN_SNAPSHOT_TS_MS (seconds, not milliseconds): not read

    def release(self) -> None:
        for df in self.cached:
            df.unpersist()


# 2001-09-09 in milliseconds: a snapshot's "ts" below it is in seconds (any date since 1970: 1.7e9 in 2024), from
# a metrics file not written by the broker (a converter, a hand-made backfill). Read as milliseconds, each such line
# fell on 1970-01-20: a rollup --date of its file's day had no broker or lag row of it, exit 0 and nothing said.
MIN_SNAPSHOT_TS_MS = 10 ** 12


def load_snapshots(spark, store_dir: str, dates: list[str] | None, *, job: str) -> Snapshots:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    types = {"ts": LongType(), "connections": IntegerType(), "queue_id": IntegerType(), "lag": LongType(),
             "line": LongType()}
    schema = StructType([StructField(n, types.get(n, StringType())) for n in SNAPSHOT_FIELDS])
    files = snapshot_files(store_dir, dates)
    if files:
        # The file the broker appends to now (today's, and so a neighbour of the date rolled up) is read only
        # up to its last newline: the line being written is not a bad line, and the next run reads it whole.
        # Hadoop's reader would take it (and one appended while it reads: its last split finishes a line).
        sc = spark.sparkContext
        parts = {p: whole_part(p) for p in files}
        done = [p for p in files if parts[p] is None]
        live = [(p, parts[p]) for p in files if parts[p]]
        text = sc.textFile(",".join(_uri(p) for p in done)) if done else sc.emptyRDD()
        if live:
            text = text.union(sc.parallelize(live, len(live)).mapPartitions(read_lines))
        df = spark.createDataFrame(text.mapPartitionsWithIndex(parse_lines), schema, verifySchema=False)
    else:
        df = spark.createDataFrame([], schema)
    df = df.persist(StorageLevel.MEMORY_AND_DISK)
    early = F.coalesce(F.col("kind").isin("snap", "lag") & (F.col("ts") < MIN_SNAPSHOT_TS_MS), F.lit(False))
    counts = {r["kind"]: r["count"] for r in
              df.withColumn("kind", F.when(early & (F.col("kind") == "snap"), "early").otherwise(F.col("kind")))
              .groupBy("kind").count().collect()}
    lines = df.where(~early)
    # One line a ts (the broker writes one a ts): a line read twice (a file restored with `cat old >> new`) was a
    # snapshot of twice each group's lag, summed over its queues. The line kept is the first read; a few thousand
    # (ts, line) pairs a day, persisted and counted so Spark knows their size: broadcast under
    # spark.sql.autoBroadcastJoinThreshold (the lag rows are not shuffled), a shuffle join above it (no hint: every
    # retained day's lines, kept for good at a short interval, were collected whole on the driver).
    one = lines.where(F.col("kind") == "snap").groupBy("ts").agg(F.min("line").alias("line")).persist()
    kept = one.count()
    rows = lines.where(F.col("kind").isin("snap", "lag")).join(one, ["ts", "line"], "left_semi")
    snaps = Snapshots(rows, [df, one], len(files), kept, counts.get("bad", 0), counts.get("incomplete", 0),
                      counts.get("snap", 0) - kept, counts.get("early", 0))
    log.info("%s: read %d snapshot lines from %d files (%d bad lines skipped, %d incomplete)", job, snaps.lines,
             snaps.files, snaps.bad_lines, snaps.incomplete_lines)
    if snaps.early_lines:
        log.warning("%s: %d snapshot lines are stamped before 2001-09-09 (their ts below %d: seconds, not "
                    "milliseconds?) and are not rolled up; the broker writes milliseconds: fix what wrote them and "
                    "roll their dates up again", job, snaps.early_lines, MIN_SNAPSHOT_TS_MS)
    if snaps.duplicate_lines:
        log.warning("%s: %d snapshot lines repeat the ts of another (a metrics file with lines twice: restored or "
                    "appended over a copy?): one line a ts is read", job, snaps.duplicate_lines)
    return snaps


def _uri(path: str) -> str:
    return path if "://" in path else "file://" + os.path.abspath(path)
