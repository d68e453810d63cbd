"""What the records say about transactions (protocol/txlog.py, docs/design.md "Transaction records").

    record              recognised by                                 here
    half                topic RMQ_SYS_TRANS_HALF_TOPIC                kind "half"
    committed message   real topic, tx type COMMIT, prepared offset   counted as traffic
    decision op         RMQ_SYS_TRANS_OP_HALF_TOPIC, TAGS=d           kind "op" (TXMQ_OP, TXMQ_HALF)
    check attempt       RMQ_SYS_TRANS_OP_HALF_TOPIC, TAGS=c           kind "check" (TXMQ_HALF)
    sender named        the same, TXMQ_CHECKS=0 (no attempt made)     kind "sender" (not counted as a check)
    dead letter         TRANS_CHECK_MAX_TIME_TOPIC                    kind "dead" (TXMQ_REASON, TXMQ_HALF)
    damaged op          RMQ_SYS_TRANS_OP_HALF_TOPIC, anything else    kind "bad_op" (see below)
    RocketMQ's op       RMQ_SYS_TRANS_OP_HALF_TOPIC, TAGS d / c, a    kind "other", left out as the broker does
                        number as body, no TXMQ_* property

A half is *open* (undecided) until its first COMMIT or ROLLBACK op (the first decision
wins; later ones are ignored). Before that, a DEAD op closes it and a RESUME op opens it
again. Ops and dead letters find their half through TXMQ_HALF = the half's commit-log offset,
so one groupBy on that offset (half_summary) gathers a transaction's whole story.

An op record's body is the half's queue offset, under the body CRC (segments.py checks it for op bodies: one
that fails names no half); its properties are under none. Like the
broker's recovery (broker/transaction/salvage.py), the body wins: an op or check whose TXMQ_HALF names another
half than its body does is taken for the body's half (a flipped digit there would have decided another
transaction and left its own open, to be planned for expiry). An op whose properties cannot be read (a zeroed
page, a flipped byte in TAGS, TXMQ_OP or TXMQ_HALF) is the broker's to settle at its next start, from evidence
the Spark jobs do not read (its decision table, the committed message, the dead letter): unless its own TXMQ_OP
is whole and its TXMQ_HALF agrees with its body (then it is that decision, as the broker reads it), or it is
plainly a check attempt (TXMQ_CHECKS, no TXMQ_OP: nothing was decided), its half is *unsettled*: neither open
nor decided, never planned for expiry, and counted and said by the jobs.
"""
from __future__ import annotations

from protocol.txlog import (DEAD, DEAD_TOPIC, DECISIONS, HALF_TOPIC, OP_TAG_CHECK, OP_TAG_DECISION, OP_TOPIC, OPS,
                            RESUME)

from .segments import NO_GROUP

ALL_GROUPS = "*"


def classify(records):
    """Add kind (half / op / check / sender / bad_op / dead / other) to the transaction records of a scan."""
    from pyspark.sql import functions as F

    topic, tags, half, op = F.col("topic"), F.col("tags"), F.col("txmq_half"), F.col("txmq_op")
    ours = half.isNotNull() | op.isNotNull() | F.col("txmq_checks").isNotNull() | F.col("txmq_reason").isNotNull()
    kind = (F.when(topic == HALF_TOPIC, "half")
            .when((topic == OP_TOPIC) & (tags == OP_TAG_DECISION) & half.isNotNull() & op.isin(*OPS), "op")
            .when((topic == OP_TOPIC) & (tags == OP_TAG_CHECK) & half.isNotNull() & op.isNull()
                  & (F.col("txmq_checks") == 0), "sender")
            .when((topic == OP_TOPIC) & (tags == OP_TAG_CHECK) & half.isNotNull() & op.isNull(), "check")
            .when((topic == OP_TOPIC) & (ours | ~F.coalesce(tags.isin(OP_TAG_DECISION, OP_TAG_CHECK), F.lit(False))
                                         | F.col("half_qo").isNull()), "bad_op")
            .when(topic == DEAD_TOPIC, "dead")
            .otherwise("other"))
    return records.withColumn("kind", kind)


def _by_body(classified):
    """The op records re-aimed at the half their body names (see the top): kind and txmq_half as the broker's
    recovery reads them, and ``misnamed`` (TXMQ_HALF disagreed with the body) / ``unreadable`` (its properties
    are damaged) / ``unsettled`` (an unreadable op that may have decided its half) flags. A body naming no half
    the scan holds leaves TXMQ_HALF as it is."""
    from pyspark.sql import functions as F

    kind, op = F.col("kind"), F.col("txmq_op")
    halves = classified.where(kind == "half").select(F.col("queue_offset").alias("_q"), F.col("offset").alias("_at"))
    # (sender records too: the broker's recovery takes their body's half, and counts one whose TXMQ_HALF disagrees)
    ops = classified.where(kind.isin("op", "check", "sender", "bad_op"))
    ops = ops.join(halves, ops["half_qo"] == halves["_q"], "left")
    known = lambda cond: F.coalesce(cond, F.lit(False))     # noqa: E731  (a missing property: not so, never null)
    agrees = known(F.col("txmq_half") == F.col("_at"))
    said = (kind == "bad_op") & agrees & known(op.isin(*OPS))     # damage elsewhere: its own decision word stands
    plain_check = (kind == "bad_op") & F.col("txmq_checks").isNotNull() & op.isNull()
    return (ops.withColumn("misnamed", F.col("_at").isNotNull() & F.col("txmq_half").isNotNull() & ~agrees)
            .withColumn("unreadable", kind == "bad_op")
            .withColumn("unsettled", (kind == "bad_op") & ~said & ~plain_check)
            .withColumn("kind", F.when(said, "op").when(plain_check, "bad_check").otherwise(kind))
            .withColumn("txmq_half", F.coalesce("_at", "txmq_half"))
            .drop("_q", "_at"))


def half_summary(classified):
    """One row per half commit-log offset (a join of the op records with the halves, then one shuffle),
    everything the log says about it:

    half      struct(ts, group, segment, queue_offset, real_topic, uniq_key), or null when the
              half itself is gone (its segment was removed) but ops still name it
    decision  struct(off, ts, outcome): the first COMMIT / ROLLBACK op, or null
    toggles   [struct(off, ts, delta)]: DEAD (-1) / RESUME (+1) ops before the decision
    checks    [store ts] of `c` check attempts
    deads     [struct(ts, reason, group)] of dead letters
    damaged   [commit-log offset] of its op records whose properties were damaged (misnamed, unreadable)
    unsettled the offset of its last op record that cannot be read and may have decided it, when no readable
              decision op follows (see the top): the broker settles it at its next start; null otherwise
    """
    from pyspark.sql import functions as F

    ops = _by_body(classified)
    rest = (classified.where(~F.col("kind").isin("op", "check", "sender", "bad_op"))
            .withColumn("misnamed", F.lit(False)).withColumn("unreadable", F.lit(False))
            .withColumn("unsettled", F.lit(False)))
    records = rest.unionByName(ops)
    kind, op = F.col("kind"), F.col("txmq_op")
    key = F.when(kind == "half", F.col("offset")).otherwise(F.col("txmq_half"))
    group = F.coalesce(F.col("pgroup"), F.lit(NO_GROUP))
    last_op = F.max(F.when(kind == "op", F.col("offset")))
    last_unsettled = F.max(F.when(F.col("unsettled"), F.col("offset")))
    return (records.where(kind.isin("half", "op", "check", "bad_op", "bad_check", "dead") & key.isNotNull())
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
                     F.col("pgroup").alias("group")))).alias("deads"),
                 F.collect_list(F.when(F.col("misnamed") | F.col("unreadable"), F.col("offset")))
                 .alias("damaged"),
                 F.when(last_op.isNull() | (last_unsettled > last_op), last_unsettled).alias("unsettled"))
            .withColumn("toggles", F.filter("all_toggles", lambda t: F.col("decision").isNull()
                                            | (t["off"] < F.col("decision.off"))))
            .drop("all_toggles")
            .withColumn("group", F.coalesce(F.col("h.group"), F.col("deads")[0]["group"], F.lit(NO_GROUP))))


def open_halves(summary):
    """Halves that are undecided now: no decision, not closed by a DEAD op since the last RESUME, and no op
    record that cannot be read since (unsettled: see the top)."""
    from pyspark.sql import functions as F

    last = F.array_max("toggles")          # structs compare by their first field, the op's offset
    return (summary.where(F.col("h").isNotNull() & F.col("decision").isNull() & F.col("unsettled").isNull()
                          & (last.isNull() | (last["delta"] == 1)))
            .select("half", F.col("h.ts").alias("half_ts"), F.col("h.group").alias("producer_group"),
                    "h.segment", "h.queue_offset", "h.real_topic", "h.uniq_key"))


def op_damage(classified) -> dict:
    """How many op records had damaged properties (one aggregate): ``misnamed`` (TXMQ_HALF disagreed with the
    body, which was taken), ``unreadable`` (properties that cannot be read: whatever their half was taken for),
    ``unplaced`` (of those, the ones naming no half at all: left out). Each is the broker's to repair at its
    next start (broker/transaction/salvage.py); a job says them, it does not guess."""
    from pyspark.sql import functions as F

    bad = F.col("unreadable")
    row = _by_body(classified).agg(
        F.count(F.when(F.col("misnamed"), 1)).alias("misnamed"), F.count(F.when(bad, 1)).alias("unreadable"),
        F.count(F.when(bad & F.col("txmq_half").isNull(), 1)).alias("unplaced")).first()
    return {k: int(row[k] or 0) for k in ("misnamed", "unreadable", "unplaced")}
