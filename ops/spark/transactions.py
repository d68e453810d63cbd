"""What the records say about transactions (protocol/txlog.py, docs/design.md "Transaction records").

    record              recognised by                                 here
    half                topic RMQ_SYS_TRANS_HALF_TOPIC                kind "half"
    committed message   real topic, tx type COMMIT, prepared offset   counted as traffic
    decision op         RMQ_SYS_TRANS_OP_HALF_TOPIC, TAGS=d           kind "op" (TXMQ_OP, TXMQ_HALF)
    check attempt       RMQ_SYS_TRANS_OP_HALF_TOPIC, TAGS=c           kind "check" (TXMQ_HALF)
    dead letter         TRANS_CHECK_MAX_TIME_TOPIC                    kind "dead" (TXMQ_REASON, TXMQ_HALF)

A half is *open* (undecided) until its first COMMIT or ROLLBACK op (the first decision
wins; later ones are ignored). Before that, a DEAD op closes it and a RESUME op opens it
again. Ops and dead letters find their half through TXMQ_HALF = the half's commit-log offset,
so one groupBy on that offset (half_summary) gathers a transaction's whole story.
"""
from __future__ import annotations

from protocol.txlog import (DEAD, DEAD_TOPIC, DECISIONS, HALF_TOPIC, OP_TAG_CHECK, OP_TAG_DECISION, OP_TOPIC,
                            RESUME)

from .segments import NO_GROUP

ALL_GROUPS = "*"


def classify(records):
    """Add kind (half / op / check / dead / other) to the transaction records of a scan."""
    from pyspark.sql import functions as F

    topic, tags = F.col("topic"), F.col("tags")
    kind = (F.when(topic == HALF_TOPIC, "half")
            .when((topic == OP_TOPIC) & (tags == OP_TAG_DECISION), "op")
            .when((topic == OP_TOPIC) & (tags == OP_TAG_CHECK), "check")
            .when(topic == DEAD_TOPIC, "dead")
            .otherwise("other"))
    return records.withColumn("kind", kind)


def half_summary(classified):
    """One row per half commit-log offset (one shuffle), everything the log says about it:

    half      struct(ts, group, segment, queue_offset, real_topic, uniq_key), or null when the
              half itself is gone (its segment was removed) but ops still name it
    decision  struct(off, ts, outcome): the first COMMIT / ROLLBACK op, or null
    toggles   [struct(off, ts, delta)]: DEAD (-1) / RESUME (+1) ops before the decision
    checks    [store ts] of `c` check attempts
    deads     [struct(ts, reason, group)] of dead letters
    """
    from pyspark.sql import functions as F

    kind, op = F.col("kind"), F.col("txmq_op")
    key = F.when(kind == "half", F.col("offset")).otherwise(F.col("txmq_half"))
    group = F.coalesce(F.col("pgroup"), F.lit(NO_GROUP))
    return (classified.where(kind.isin("half", "op", "check", "dead") & key.isNotNull())
            .groupBy(key.alias("half"))
            .agg(F.max(F.when(kind == "half", F.struct(
                     F.col("store_ts").alias("ts"), group.alias("group"), "segment", "queue_offset",
                     F.coalesce(F.col("real_topic"), F.lit(NO_GROUP)).alias("real_topic"), "uniq_key")))
                 .alias("h"),
                 F.min(F.when((kind == "op") & op.isin(*DECISIONS), F.struct(
                     F.col("offset").alias("off"), F.col("store_ts").alias("ts"), op.alias("outcome"))))
                 .alias("decision"),
                 F.collect_list(F.when((kind == "op") & op.isin(DEAD, RESUME), F.struct(
                     F.col("offset").alias("off"), F.col("store_ts").alias("ts"),
                     F.when(op == DEAD, -1).otherwise(1).alias("delta")))).alias("all_toggles"),
                 F.collect_list(F.when(kind == "check", F.col("store_ts"))).alias("checks"),
                 F.collect_list(F.when(kind == "dead", F.struct(
                     F.col("store_ts").alias("ts"), F.col("txmq_reason").alias("reason"),
                     F.col("pgroup").alias("group")))).alias("deads"))
            .withColumn("toggles", F.filter("all_toggles", lambda t: F.col("decision").isNull()
                                            | (t["off"] < F.col("decision.off"))))
            .drop("all_toggles")
            .withColumn("group", F.coalesce(F.col("h.group"), F.col("deads")[0]["group"], F.lit(NO_GROUP))))


def open_halves(summary):
    """Halves that are undecided now: no decision, and not closed by a DEAD op since the last RESUME."""
    from pyspark.sql import functions as F

    last = F.array_max("toggles")          # structs compare by their first field, the op's offset
    return (summary.where(F.col("h").isNotNull() & F.col("decision").isNull()
                          & (last.isNull() | (last["delta"] == 1)))
            .select("half", F.col("h.ts").alias("half_ts"), F.col("h.group").alias("producer_group"),
                    "h.segment", "h.queue_offset", "h.real_topic", "h.uniq_key"))
