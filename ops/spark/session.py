"""One place that builds the SparkSession for the jobs, the CLI and the tests.

Small-machine defaults: few shuffle partitions (the aggregates here are tiny), no web UI,
log4j quiet (ops/spark/log4j2.properties), UTC session time zone (every window is UTC),
dynamic partition overwrite (re-running a day replaces that day only). Under spark-submit
the master and anything in spark-defaults.conf win unless --master is given.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import zipfile

log = logging.getLogger("ops.spark")

LOG4J2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")


def build_session(master: str | None = None, *, app_name: str = "txmq-ops", shuffle_partitions: int | None = None,
                  progress: bool = True, conf: dict[str, str] | None = None):
    from pyspark.sql import SparkSession

    if master is None and not _master_configured():
        master = "local[*]"
    if master and master.startswith("local") and "PYSPARK_PYTHON" not in os.environ:
        # Python workers run the interpreter (and venv) that runs the driver.
        os.environ["PYSPARK_PYTHON"] = sys.executable
    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "true" if progress else "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.sources.partitionOverwriteMode": "dynamic",
        "spark.sql.shuffle.partitions": str(shuffle_partitions or _default_shuffle_partitions()),
        "spark.sql.adaptive.enabled": "true",
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{LOG4J2}",
        "spark.executor.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{LOG4J2}",
        "spark.python.worker.reuse": "true",
    }
    settings.update(conf or {})
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    ship_code(spark)
    return spark


PROGRESS_S = 60.0       # with --no-progress (the nightly units), how often a running job says how far it got


def progress_line(tracker) -> str | None:
    """One line for the Spark stages running now (None: none), from a pyspark StatusTracker."""
    stages = [s for s in map(tracker.getStageInfo, tracker.getActiveStageIds()) if s is not None]
    if not stages:
        return None
    stages.sort(key=lambda s: s.stageId)
    done, total = sum(s.numCompletedTasks for s in stages), sum(s.numTasks for s in stages)
    failed = sum(s.numFailedTasks for s in stages)
    return (f"{done} of {total} tasks done, {sum(s.numActiveTasks for s in stages)} running"
            + (f", {failed} failed (retried)" if failed else "")
            + f" in {len(stages)} stage(s) ({stages[0].name}{', ...' if len(stages) > 1 else ''})")


@contextlib.contextmanager
def progress_log(spark, job: str, every: float = PROGRESS_S):
    """Say at INFO every ``every`` seconds how far the running Spark stages got. Without the console progress bar
    (--no-progress, as the nightly units run) a job said nothing between its steps' lines: a scan of a large store,
    hours, wrote no line at all until it was over, alike to a job that hangs."""
    stop = threading.Event()
    started = time.monotonic()

    def run() -> None:
        tracker = None
        while not stop.wait(every):
            try:        # (the tracker too: a context stopped before the first turn raised in the thread)
                tracker = tracker or spark.sparkContext.statusTracker()
                line = progress_line(tracker)
            except Exception:  # noqa: BLE001 - the JVM stopping under the job: nothing left to say
                return
            if line is not None:
                log.info("%s: %s; %.0f s since the start", job, line, time.monotonic() - started)

    thread = threading.Thread(target=run, name="txmq-spark-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(every + 5)


def _master_configured() -> bool:
    """True under spark-submit (or with spark.master in spark-defaults.conf)."""
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()
    return SparkConf().contains("spark.master")


def _default_shuffle_partitions() -> int:
    # The grouped results are a few thousand rows: a handful of partitions per core is plenty.
    return max(2, min(16, 2 * (os.cpu_count() or 2)))


def ship_code(spark) -> None:
    """Send the protocol and ops packages to the executors once per SparkContext.

    Workers then import the very code the driver runs, on a cluster as well as locally,
    whether or not txmq is installed there.
    """
    sc = spark.sparkContext
    if getattr(sc, "_txmq_shipped", False):
        return
    import importlib

    # "protocol" and "ops" in a checkout, "txmq.protocol" and "txmq.ops" in an installed wheel: ship
    # them under the names this process uses (with txmq/__init__.py when they live inside it).
    ops_name = __name__.rsplit(".spark.", 1)[0]
    prefix = ops_name[:-len("ops")]
    packages = [importlib.import_module(prefix + "protocol"), importlib.import_module(ops_name)]
    if prefix:
        packages.insert(0, importlib.import_module(prefix.rstrip(".")))
    directory = tempfile.mkdtemp(prefix="txmq-spark-")
    atexit.register(shutil.rmtree, directory, True)
    path = os.path.join(directory, "txmq_code.zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for package in packages:
            root = os.path.dirname(os.path.abspath(package.__file__))
            base = root
            for _ in package.__name__.split("."):
                base = os.path.dirname(base)
            if package.__name__ == prefix.rstrip("."):       # txmq itself: its __init__ only
                zf.write(package.__file__, os.path.relpath(package.__file__, base))
                continue
            for folder, dirs, files in os.walk(root):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                for name in files:
                    if name.endswith((".py", ".properties")):
                        full = os.path.join(folder, name)
                        zf.write(full, os.path.relpath(full, base))
    sc.addPyFile(path)
    sc._txmq_shipped = True
