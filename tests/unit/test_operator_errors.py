"""Errors an operator can act on: the Spark jobs refuse a path that is no store; no ``*_created`` noise."""
from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import generate_latest

from broker.metrics import BrokerMetrics
from tests.support.broker_process import REPO


def _spark_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.spark", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("job", ["rollup", "expiry"])
@pytest.mark.parametrize("kind, says", [
    ("missing", "does not exist"),
    ("file", "is not a directory"),
    ("empty", "holds no txmq store"),
])
def test_spark_jobs_refuse_a_path_that_is_no_store(tmp_path, job, kind, says):
    target = tmp_path / "store"
    if kind == "file":
        target.write_text("not a store")
    elif kind == "empty":
        target.mkdir()
    proc = _spark_cli(job, "--store-dir", str(target), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{job}: ") and says in lines[0] and str(target) in lines[0]
    assert proc.stdout == "" and not (tmp_path / "out").exists()


def test_a_directory_with_a_commitlog_is_a_store(tmp_path):
    from ops.spark.segments import require_store

    (tmp_path / "commitlog").mkdir()
    require_store(str(tmp_path))           # no error: an empty store is still a store


def test_counters_export_no_created_series():
    m = BrokerMetrics()
    m.child(m.commits, "PG").inc()
    m.rpc_latency.labels("SEND_MESSAGE_V2", "0").observe(0.001)
    text = generate_latest(m.registry).decode()
    assert "rocketmq_commit_messages_total" in text and "rocketmq_rpc_latency_bucket" in text
    assert "_created" not in text


@pytest.mark.parametrize("job", ["rollup", "expiry"])
def test_spark_jobs_refuse_an_output_they_cannot_write_before_the_work(tmp_path, job):
    """An --out under a file (or a read-only mount) used to fail only when the results were written,
    after the whole store was decoded, as some 400 lines of Java stack traces (rollup) or a Python
    traceback (expiry's plan). It is one line, before Spark starts."""
    (tmp_path / "store" / "commitlog").mkdir(parents=True)
    (tmp_path / "blocker").write_text("a file where a directory should be")
    out = tmp_path / "blocker" / ("out" if job == "rollup" else "plan.json")
    proc = _spark_cli(job, "--store-dir", str(tmp_path / "store"), "--out", str(out))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{job}: cannot write ") and str(tmp_path / "blocker") in lines[0]
    assert proc.stdout == ""


def test_a_file_uri_with_one_slash_is_checked_where_spark_writes(tmp_path, monkeypatch):
    """`file:/path` is how Hadoop prints a local path (Path.toString()), and Spark writes it to /path:
    the check made `./file:/path` under the working directory instead (a stray tree there, and a
    refusal of a good --out when the working directory, /opt/txmq in the cron lines, is read-only)."""
    from ops.spark.cli import require_writable
    from protocol.errors import StoreError

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "file:").write_text("stands in for a read-only working directory")
    monkeypatch.chdir(cwd)
    require_writable(f"file:{tmp_path}/out", "--out")
    assert (tmp_path / "out").is_dir()
    require_writable(f"file://{tmp_path}/out2", "--out")
    assert (tmp_path / "out2").is_dir()
    require_writable("hdfs:/user/txmq/rollups", "--out")       # not a local path: Spark's to reach
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(StoreError, match="blocker"):
        require_writable(f"file:{tmp_path}/blocker/out", "--out")
    from ops.spark.rollup import _local_form

    assert _local_form(f"file:{tmp_path}/out") == _local_form(f"file://{tmp_path}/out") == f"{tmp_path}/out"
    assert _local_form("out") == "out" and _local_form("hdfs://nn/out") == "hdfs://nn/out"
