"""PySpark jobs over a txmq store: the nightly rollup and the 72-hour expiry plan.

    python -m ops.spark rollup --store-dir DIR --out DIR [--date YYYY-MM-DD]
    python -m ops.spark expiry --store-dir DIR --out PLAN [--retention-hours 72]
    python -m ops.spark validate-plan PLAN

Importing this package does not import pyspark: the broker's admin command uses
validate_plan() from here without a JVM. See docs/ops-spark.md.
"""
from .plan import PLAN_VERSION, PlanError, validate_plan

__all__ = ["PLAN_VERSION", "PlanError", "validate_plan"]
