"""The 72-hour expiry plan: which undecided halves and which sealed segments may go, and what that costs whom.

RocketMQ's retention (fileReservedTime): a sealed segment (not one being written) is
listed when its newest record is strictly older than the retention and nothing in it is
damaged, consumed or not. Segments are listed oldest first and only as an unbroken run from
the oldest: the store's first offset is its first segment's start. Each is listed with its
identity as read here (start offset, end of data, newest store timestamp); the broker
removes it only if it still has exactly that identity and is old by its own clock.

A half is listed when it is open (transactions.open_halves) and its store time is strictly
older than the retention: now - store_ts > retention (71h59m kept, 72h01m listed). The
broker dead-letters it with reason `expired`, once; it also dead-letters any undecided half
inside a segment it removes, first.

The report (plan["report"], and one log line each) says per topic how many messages go and
per topic and consumer group how many of them that group has not consumed: the group's
committed offset in config/consumerOffset.json is below their queue offsets.
"""
from __future__ import annotations

import json
import logging
import os
import time

from protocol.admin_bodies import split_offset_key
from protocol.errors import StoreError
from protocol.txlog import HALF_TOPIC, OP_TOPIC

from .load import DEFAULT_CHUNK_BYTES, scan_store
from .manifest import read_store_id
from .plan import PLAN_VERSION, write_plan_streaming
from .transactions import classify, half_summary, op_damage, open_halves

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
        split = split_offset_key(key)       # at the first "@": a group name may hold one, a topic name may not
        if split is None or not isinstance(queues, dict):
            raise ValueError(f"{path}: entry {key!r} is not \"topic@group\": {{queueId: offset}}")
        topic, group = split
        try:
            out.setdefault(topic, {})[group] = {int(q): int(o) for q, o in queues.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{path}: entry {key!r} has a queue id or offset that is not an integer") from None
    return out


def group_offsets(offsets) -> list[tuple[str, str, int, int]]:
    """(topic, group, queue_id, committed offset) rows."""
    return [(topic, group, q, o) for topic, groups in offsets.items() for group, queues in groups.items()
            for q, o in queues.items()]


# A segment whose newest record is stamped at most this far ahead of the time planned for is young, not ahead: one
# sealed after the plan took its time (a scan starts after it), or hosts' clocks a little apart (the broker's own
# plan_clock_skew_ms). Said at WARNING, "every plan stops there" was false: it is planned once past the retention.
AHEAD_SLACK_MS = 60_000


# Of the halves an op record that cannot be read may have decided, the ones the plan's report names (all counted).
UNSETTLED_LISTED = 1000

# Halves the driver holds at a time while it writes a plan (a partition of the sorted list; about 100 MB of it).
HALVES_A_PARTITION = 100_000


def build_plan(spark, store_dir: str, *, retention_ms: int, now_ms: int, skip_damaged: bool = False,
               check_crc: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES, out_path: str | None = None) -> dict:
    """The plan. With ``out_path`` it is written there (write_plan_streaming) and returned without its halves,
    ``halves_listed`` saying how many the file lists: the driver holds one partition of them at a time."""
    from pyspark.sql import functions as F

    store_id = read_store_id(store_dir)
    if store_id is None:
        raise StoreError(f"{store_dir}/store_id is missing or unreadable: a plan must name its store; start a "
                         "broker of this version on the store once to give it an id")
    cutoff = now_ms - retention_ms
    offsets = read_consumer_offsets(store_dir)
    scan = scan_store(spark, store_dir, job="expiry", skip_damaged=skip_damaged, check_crc=check_crc,
                      chunk_bytes=chunk_bytes)
    try:
        started = time.monotonic()
        rec = classify(scan.records)
        summary = half_summary(rec).cache()
        expired = open_halves(summary).where(F.col("half_ts") < cutoff).select(
            F.col("half").alias("commit_log_offset"), "queue_offset", "producer_group",
            F.col("real_topic").alias("topic"), F.col("half_ts").alias("store_timestamp"), "uniq_key")
        held = summary.where(F.col("unsettled").isNotNull() & F.col("h").isNotNull() & (F.col("h.ts") < cutoff))
        # Counted, the first UNSETTLED_LISTED named: collected whole, a damaged run of op records (one a half) put
        # every half it held back on the driver and in the plan's report, without bound.
        damaged_ops = {**op_damage(rec), "unsettled": held.count(),
                       "unsettled_halves": [r["half"] for r in held.orderBy("half").limit(UNSETTLED_LISTED).collect()]}
        per_segment = {r["segment"]: r for r in (
            scan.queues.groupBy("segment")
            .agg(F.min("store_ts").alias("first"), F.max("ts_max").alias("last"), F.sum("n").alias("records"))
            .collect())}
        damaged = {d["segment"] for d in scan.damage}
        chosen = []
        for seg in scan.segments:
            if seg.active:                          # the newest, or the one before the broker's spare
                break
            info = per_segment.get(seg.name)
            why = (("it is damaged" if seg.name in damaged else None)
                   or ("no record could be read from it" if info is None or seg.name not in scan.ends else None)
                   or (f"its newest record is stamped {info['last']}, {info['last'] - now_ms} ms ahead of the time "
                       f"planned for ({now_ms}): the broker's clock was ahead when it was written, or the plan's "
                       "--now-ms or this host's clock is behind" if info["last"] > now_ms + AHEAD_SLACK_MS else None))
            if why:
                # Not young by the retention: a segment that will not grow old by it, every plan stopping there
                # night after night (said in an INFO line as the young one is) until the broker's cleaner takes it.
                log.warning("expiry: keeping segment %s and every newer one (%d sealed) out of the plan: %s; every "
                            "plan stops there until the broker's own cleaner removes it", seg.name,
                            sum(1 for s in scan.segments if not s.active and s.name >= seg.name), why)
                break
            if info["last"] >= cutoff:
                log.info("expiry: keeping segment %s and every newer one: its newest record (%d) is not older than "
                         "the retention", seg.name, info["last"])
                break
            chosen.append({"name": seg.name, "start_offset": seg.base, "end_offset": scan.ends[seg.name],
                           "first_store_timestamp": info["first"], "last_store_timestamp": info["last"],
                           "records": info["records"]})
        report = _report(spark, scan, [c["name"] for c in chosen], offsets)
        report["damaged_ops"] = damaged_ops
        report["kept_corrupt"] = scan.kept
        plan = {
            "version": PLAN_VERSION, "store_id": store_id, "created_ms": int(time.time() * 1000),
            "retention_ms": retention_ms, "now_ms": now_ms,
            "halves": [], "segments": chosen, "report": report,
        }
        if out_path is None:
            plan["halves"] = [r.asDict() for r in expired.orderBy("commit_log_offset").collect()]
            listed = len(plan["halves"])
        else:
            del plan["halves"]
            # Not collect(): 1M halves took 850 MB of the driver, 10M would stop it with no plan written. Sorted
            # in partitions of HALVES_A_PARTITION (by range: partition i's all precede partition i+1's), read and
            # written one partition at a time.
            parts = max(1, -(-expired.count() // HALVES_A_PARTITION))
            rows = (expired.repartitionByRange(parts, "commit_log_offset").sortWithinPartitions("commit_log_offset")
                    .toLocalIterator(prefetchPartitions=False))
            listed = plan["halves_listed"] = write_plan_streaming(plan, (r.asDict() for r in rows), out_path)
        summary.unpersist()
        log.info("expiry: %d undecided half messages older than %.4g h; %d of %d sealed segments can go "
                 "(planned in %.1f s)", listed, retention_ms / HOUR, len(chosen),
                 max(len(scan.segments) - 1, 0), time.monotonic() - started)
        _say_damaged_ops(damaged_ops)
        for t in report["messages_by_topic"]:
            log.info("expiry: topic %s: %d messages go", t["topic"], t["messages"])
        for u in report["unconsumed"]:
            log.warning("expiry: group %s has not consumed %d of them on topic %s", u["group"], u["messages"],
                        u["topic"])
        return plan
    finally:
        scan.release()


def _say_damaged_ops(d: dict) -> None:
    if d["misnamed"]:
        log.error("expiry: %d op record(s) name another half (their half property) than by their body (the half's "
                  "queue offset, under the body CRC): taken for the body's half, as the broker does", d["misnamed"])
    if d["unreadable"]:
        log.error("expiry: %d op record(s) cannot be read (damaged properties), %d of them naming no half; the "
                  "broker settles them at its next start (see its log)", d["unreadable"], d["unplaced"])
    if d["unsettled_halves"]:
        named = len(d["unsettled_halves"])
        log.error("expiry: %d half message(s) older than the retention are not listed: an op record of theirs that "
                  "cannot be read may have decided them (first: %d; the report names %s); the broker settles them "
                  "at its next start", d["unsettled"], d["unsettled_halves"][0],
                  "them all" if named >= d["unsettled"] else f"the first {named}")


def _report(spark, scan, names: list[str], offsets) -> dict:
    """Per topic, messages in the segments that go; per topic and group, how many of those are unconsumed."""
    from pyspark.sql import functions as F

    # Transaction bookkeeping queues are the broker's own (their halves are in "halves").
    going = scan.queues.where(F.col("segment").isin(names) & F.col("qo_max").isNotNull()
                              & ~F.col("topic").isin(HALF_TOPIC, OP_TOPIC))
    by_topic = [{"topic": r["topic"], "messages": r["n"]} for r in
                going.groupBy("topic").agg(F.sum("n").alias("n")).orderBy("topic").collect()]
    committed = spark.createDataFrame(group_offsets(offsets) or [],
                                      "topic string, group string, queue_id int, committed long")
    # A partial holds queue offsets qo_max - n + 1 .. qo_max of its queue; those at or past the
    # group's committed offset are unconsumed.
    lo = F.col("qo_max") - F.col("n") + 1
    unconsumed = F.greatest(F.lit(0), F.col("qo_max") - F.greatest(lo, F.col("committed")) + 1)
    rows = (going.join(F.broadcast(committed), ["topic", "queue_id"])
            .groupBy("topic", "group").agg(F.sum(unconsumed).alias("n")).where(F.col("n") > 0)
            .orderBy("topic", "group").collect())
    return {"segments": len(names), "messages_by_topic": by_topic,
            "unconsumed": [{"topic": r["topic"], "group": r["group"], "messages": r["n"]} for r in rows]}
def run_expiry(spark, store_dir: str, out_path: str, *, retention_hours: float = 72, now_ms: int | None = None,
               **scan_options) -> dict:
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    plan = build_plan(spark, store_dir, retention_ms=int(round(retention_hours * HOUR)), now_ms=now_ms,
                      out_path=out_path, **scan_options)
    log.info("expiry: wrote %s", out_path)
    return plan
