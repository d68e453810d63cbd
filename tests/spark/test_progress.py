"""What a job run with --no-progress (the nightly units) says while its Spark stages run."""
from __future__ import annotations

import logging
import os
import time

import pytest

pytestmark = pytest.mark.spark


def _held_until(flag: str):
    """A task body that holds its task running until ``flag`` exists (at most 60 s), then yields one row."""
    def body(rows):
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        yield sum(1 for _ in rows)
    return body


def test_a_running_job_says_how_far_its_stages_got_without_the_console_bar(spark, tmp_path):
    """Without the console bar a job said nothing between its steps' lines: a scan of a large store wrote no line
    for hours, alike to a job that hangs. The stage is held running until the progress line came."""
    from ops.spark.session import progress_log

    flag = str(tmp_path / "said")
    lines = []

    class Said(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
            if "tasks done" in record.getMessage():
                open(flag, "w").close()

    log = logging.getLogger("ops.spark")
    handler, level = Said(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with progress_log(spark, "rollup", every=0.05):
            counts = spark.sparkContext.parallelize(range(4), 2).mapPartitions(_held_until(flag)).collect()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert counts == [2, 2]
    said = [x for x in lines if x.startswith("rollup: ") and "tasks done" in x]
    assert said, lines
    assert " of 2 tasks done, " in said[0] and "1 stage(s) (collect at " in said[0], said[0]


def test_a_context_gone_before_the_progress_thread_starts_raises_nothing_from_it(monkeypatch):
    """The status tracker was asked for outside the thread's guard: a SparkContext stopped (or its gateway gone)
    before the thread's first turn raised in the thread, a traceback on stderr of a job otherwise ending cleanly."""
    import threading

    from ops.spark.session import progress_log

    class Gone:
        @property
        def sparkContext(self):
            raise RuntimeError("the SparkContext was shut down")

    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    with progress_log(Gone(), "rollup", every=0.01):
        pass
    assert raised == []
