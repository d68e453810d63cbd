"""The 72-hour expiry: which undecided halves and which sealed segments may go.

A half is listed when it is open (transactions.open_halves) and its store time is strictly
older than the retention: now - store_ts > retention (71h59m kept, 72h01m listed).

A sealed segment (every segment but the newest) is listed when
  * every record in it is strictly older than the retention,
  * every record is consumed: on topic T, queue q, at queue offset o, every consumer group
    with an entry for T in config/consumerOffset.json has an offset > o for q (a group with
    T but without q has consumed nothing of q; records no consume queue indexes, and topics
    no group has an entry for, count as consumed). The scan gives, per chunk and (T, q),
    the highest queue offset, so this is one comparison per (chunk, T, q),
  * no open half in it stays behind (an open half must be in the plan's list), and
  * nothing in it is damaged.
Segments are listed oldest first and only as an unbroken run from the oldest: the store's
first offset is its first segment's start, and a hole would leave consume-queue units that
point at nothing.

The broker applies the plan: expired halves first (copied to the dead-letter topic with
reason `expired`, then a DEAD op), then the segments. See docs/ops-spark.md.
"""
from __future__ import annotations

import json
import logging
import os
import time

from .load import DEFAULT_CHUNK_BYTES, scan_store
from .plan import PLAN_VERSION, write_plan
from .transactions import classify, half_summary, open_halves

log = logging.getLogger("ops.spark")
HOUR = 3_600_000


def read_consumer_offsets(store_dir: str) -> dict[str, dict[str, dict[int, int]]]:
    """{topic: {group: {queue_id: offset}}} from config/consumerOffset.json ({} when absent).

    Accepts the flat {"topic@group": {"queueId": offset}} of docs/design.md and RocketMQ's own
    {"offsetTable": {...}} wrapper. Anything else is an error: a plan must not rest on a guess.
    """
    path = os.path.join(store_dir, "config", "consumerOffset.json")
    try:
        with open(path, "rb") as f:
            raw = json.load(f)
    except FileNotFoundError:
        log.warning("expiry: %s does not exist; no consumer group holds any segment back", path)
        return {}
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if isinstance(raw, dict) and isinstance(raw.get("offsetTable"), dict):
        raw = raw["offsetTable"]
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected an object of \"topic@group\" keys")
    out: dict[str, dict[str, dict[int, int]]] = {}
    for key, queues in raw.items():
        topic, sep, group = key.rpartition("@")
        if not sep or not isinstance(queues, dict):
            raise ValueError(f"{path}: entry {key!r} is not \"topic@group\": {{queueId: offset}}")
        try:
            out.setdefault(topic, {})[group] = {int(q): int(o) for q, o in queues.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{path}: entry {key!r} has a queue id or offset that is not an integer") from None
    return out


def consumed_floor(offsets) -> list[tuple[str, int, int]]:
    """(topic, queue_id, lowest committed offset over the topic's groups); 0 where a group lacks the queue."""
    rows = []
    for topic, groups in offsets.items():
        queues = set().union(*(g.keys() for g in groups.values())) if groups else set()
        for q in sorted(queues):
            rows.append((topic, q, min(g.get(q, 0) for g in groups.values())))
    return rows


def build_plan(spark, store_dir: str, *, retention_ms: int, now_ms: int, skip_damaged: bool = False,
               check_crc: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict:
    from pyspark.sql import functions as F

    cutoff = now_ms - retention_ms
    offsets = read_consumer_offsets(store_dir)
    scan = scan_store(spark, store_dir, job="expiry", skip_damaged=skip_damaged, check_crc=check_crc,
                      chunk_bytes=chunk_bytes)
    try:
        started = time.monotonic()
        rec = classify(scan.records)
        open_ = open_halves(half_summary(rec)).cache()
        expired = open_.where(F.col("half_ts") < cutoff).orderBy("half").collect()
        kept_open = {r["segment"] for r in open_.where(F.col("half_ts") >= cutoff).select("segment")
                     .distinct().collect()}
        open_.unpersist()

        floor = spark.createDataFrame(consumed_floor(offsets) or [], "topic string, queue_id int, floor long")
        # A (topic, queue) partial is consumed when its highest indexed queue offset is below
        # every group's offset (qo_max is None: nothing in it reaches a consume queue).
        consumed = (~F.col("topic").isin(list(offsets)) | F.col("qo_max").isNull()
                    | (F.col("floor").isNotNull() & (F.col("floor") > F.col("qo_max"))))
        per_segment = {r["segment"]: r for r in (
            scan.queues.join(F.broadcast(floor), ["topic", "queue_id"], "left")
            .groupBy("segment")
            .agg(F.min("store_ts").alias("first"), F.max("ts_max").alias("last"),
                 F.min(consumed.cast("int")).alias("all_consumed"), F.sum("n").alias("records"))
            .collect())}

        damaged = {d["segment"] for d in scan.damage}
        chosen = []
        for seg in scan.segments[:-1]:              # the newest segment is never sealed
            info = per_segment.get(seg.name)
            why = (("it is damaged" if seg.name in damaged else None)
                   or ("no record could be read from it" if info is None else None)
                   or (f"its newest record ({info['last']}) is not older than the retention"
                       if info["last"] >= cutoff else None)
                   or ("a consumer group has not consumed all of it" if not info["all_consumed"] else None)
                   or ("it holds an undecided half message younger than the retention"
                       if seg.name in kept_open else None))
            if why:
                log.info("expiry: keeping segment %s and every newer one: %s", seg.name, why)
                break
            chosen.append({"name": seg.name, "first_store_timestamp": info["first"],
                           "last_store_timestamp": info["last"]})
        plan = {
            "version": PLAN_VERSION, "created_ms": int(time.time() * 1000), "retention_ms": retention_ms,
            "now_ms": now_ms,
            "halves": [{"commit_log_offset": r["half"], "queue_offset": r["queue_offset"],
                        "producer_group": r["producer_group"], "topic": r["real_topic"],
                        "store_timestamp": r["half_ts"], "uniq_key": r["uniq_key"]} for r in expired],
            "segments": chosen,
        }
        log.info("expiry: %d undecided half messages older than %.4g h; %d of %d sealed segments can go "
                 "(planned in %.1f s)", len(plan["halves"]), retention_ms / HOUR, len(chosen),
                 max(len(scan.segments) - 1, 0), time.monotonic() - started)
        return plan
    finally:
        scan.release()


def run_expiry(spark, store_dir: str, out_path: str, *, retention_hours: float = 72, now_ms: int | None = None,
               **scan_options) -> dict:
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    plan = build_plan(spark, store_dir, retention_ms=int(round(retention_hours * HOUR)), now_ms=now_ms,
                      **scan_options)
    write_plan(plan, out_path)
    log.info("expiry: wrote %s", out_path)
    return plan
