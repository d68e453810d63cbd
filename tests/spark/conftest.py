"""One local SparkSession (local[2]) for the whole test session: starting a JVM costs seconds."""
from __future__ import annotations

import importlib.util
import shutil

import pytest

if shutil.which("java") is None:
    SPARK_SKIP = "no `java` on PATH: the Spark jobs need a JVM (Java 17)"
elif importlib.util.find_spec("pyspark") is None:
    SPARK_SKIP = "pyspark is not installed (pip install -e '.[spark]')"
else:
    SPARK_SKIP = None


@pytest.fixture(scope="session")
def spark():
    if SPARK_SKIP:
        pytest.skip(SPARK_SKIP)
    from ops.spark.session import build_session

    session = build_session("local[2]", app_name="txmq-tests", shuffle_partitions=4, progress=False,
                            conf={"spark.default.parallelism": "2", "spark.driver.memory": "1g"})
    yield session
    session.stop()
