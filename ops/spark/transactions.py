"""What the records say about transactions (docs/design.md, "Transaction records").

    record              recognised by                                 here
    half                topic RMQ_SYS_TRANS_HALF_TOPIC                kind "half"
    committed message   real topic, tx type COMMIT, prepared offset   counted as traffic
    decision op         RMQ_SYS_TRANS_OP_HALF_TOPIC, TAGS=d           kind "op" (TXMQ_OP, TXMQ_HALF)
    check attempt       RMQ_SYS_TRANS_OP_HALF_TOPIC, TAGS=c           kind "check" (TXMQ_HALF)
    dead letter         TRANS_CHECK_MAX_TIME_TOPIC                    kind "dead" (TXMQ_REASON, TXMQ_HALF)

A half is *open* (undecided) until its first COMMIT or ROLLBACK op (the first decision
wins; later ones are ignored). Before that, a DEAD op closes it and a RESUME op opens it
again. Ops and dead letters find their half through TXMQ_HALF = the half's commit-log offset.
"""
from __future__ import annotations

from .segments import DEAD_TOPIC, HALF_TOPIC, NO_GROUP, OP_TOPIC  # noqa: F401 (re-exported)

ALL_GROUPS = "*"
DECISIONS = ("COMMIT", "ROLLBACK")


def classify(records):
    """Add kind (half / op / check / dead / other) to the transaction records of a scan."""
    from pyspark.sql import functions as F

    topic, tags = F.col("topic"), F.col("tags")
    kind = (F.when(topic == HALF_TOPIC, "half")
            .when((topic == OP_TOPIC) & (tags == "d"), "op")
            .when((topic == OP_TOPIC) & (tags == "c"), "check")
            .when(topic == DEAD_TOPIC, "dead")
            .otherwise("other"))
    return records.withColumn("kind", kind)


def halves(classified):
    from pyspark.sql import functions as F

    return classified.where(F.col("kind") == "half").select(
        F.col("offset").alias("half"), F.col("segment"), F.col("store_ts").alias("half_ts"), F.col("queue_offset"),
        F.coalesce(F.col("pgroup"), F.lit(NO_GROUP)).alias("producer_group"),
        F.coalesce(F.col("real_topic"), F.lit(NO_GROUP)).alias("real_topic"), F.col("uniq_key"))


def ops(classified):
    from pyspark.sql import functions as F

    return classified.where((F.col("kind") == "op") & F.col("txmq_half").isNotNull()).select(
        F.col("txmq_half").alias("half"), F.col("offset").alias("op_offset"), F.col("store_ts").alias("op_ts"),
        F.col("txmq_op"))


def first_decisions(op_rows):
    """(half, dec_offset, dec_ts, outcome): the first COMMIT or ROLLBACK op of each half."""
    from pyspark.sql import functions as F

    return (op_rows.where(F.col("txmq_op").isin(*DECISIONS))
            .groupBy("half").agg(F.min(F.struct("op_offset", "op_ts", "txmq_op")).alias("d"))
            .select("half", F.col("d.op_offset").alias("dec_offset"), F.col("d.op_ts").alias("dec_ts"),
                    F.col("d.txmq_op").alias("outcome")))


def dead_resume(op_rows, first):
    """DEAD / RESUME ops that came before their half's decision, if any: (half, op_ts, delta)."""
    from pyspark.sql import functions as F

    return (op_rows.where(F.col("txmq_op").isin("DEAD", "RESUME"))
            .join(first.select("half", "dec_offset"), "half", "left")
            .where(F.col("dec_offset").isNull() | (F.col("op_offset") < F.col("dec_offset")))
            .select("half", "op_offset", "op_ts",
                    F.when(F.col("txmq_op") == "DEAD", -1).otherwise(1).alias("delta")))


def open_halves(classified):
    """Halves that are undecided now: no decision, and not closed by a DEAD op since the last RESUME."""
    from pyspark.sql import functions as F

    op_rows = ops(classified)
    first = first_decisions(op_rows)
    last_toggle = (dead_resume(op_rows, first).groupBy("half")
                   .agg(F.max(F.struct("op_offset", "delta")).alias("t"))
                   .select("half", F.col("t.delta").alias("last_delta")))
    return (halves(classified).join(first.select("half"), "half", "left_anti")
            .join(last_toggle, "half", "left")
            .where(F.col("last_delta").isNull() | (F.col("last_delta") == 1))
            .drop("last_delta"))
