"""Operations jobs for txmq that run beside the broker (see ops/spark and docs/ops-spark.md)."""
