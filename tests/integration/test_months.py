"""A store after months of use: far more files than a fresh one, each mapped and open while the broker runs.

The stores are built offline through the broker's own store writer (tests/spark/storegen.py), with small
segments so that a few hundred stand for months of history.
"""
from __future__ import annotations

import asyncio
import resource
import subprocess
import sys

from producer import Producer
from tests.spark.storegen import StoreBuilder
from tests.support.broker_process import REPO, BrokerProcess

SEGMENT = 64 * 1024
FLAGS = ("--segment-size", str(SEGMENT), "--max-message-size", "32768", "--metrics-snapshot-interval-s", "0")
SEGMENTS = 150          # two descriptors each (ours and the one mmap keeps): 300, above the limit below
LOW = 200


def _many_segments(store_dir) -> None:
    with StoreBuilder(str(store_dir), segment_size=SEGMENT) as b:
        for i in range(2 * SEGMENTS):           # two 30 KB records fill a segment
            b.at(1_700_000_000_000 + i).send("Orders", b"o" * 30_000, props={"KEYS": f"order-{i}"})


def _soft_limit(n: int):
    def set_it():       # in the child only: the hard limit stays what it was
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return set_it


def test_a_store_needing_more_descriptors_than_the_soft_limit_starts(tmp_path):
    # A distribution's default soft limit (1024) with a hard limit far above it: the broker raises its own
    # soft limit (as the JVM does for RocketMQ) instead of refusing a store the hard limit allows.
    _many_segments(tmp_path / "store")
    with BrokerProcess(tmp_path / "store", *FLAGS, preexec_fn=_soft_limit(LOW)) as b:
        soft = next(line for line in open(f"/proc/{b.proc.pid}/limits") if line.startswith("Max open files"))
        assert int(soft.split()[3]) > LOW

        async def send_and_query():
            async with Producer(b.namesrv, "PG_months") as p:
                r = await asyncio.wait_for(p.send("Orders", b"after months", keys="late"), 30)
            return r
        assert asyncio.run(send_and_query()).status.name == "SEND_OK"


def test_a_hard_limit_too_low_says_which_limit_and_why(tmp_path):
    _many_segments(tmp_path / "store")

    def both():
        resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, LOW))
    done = subprocess.run([sys.executable, "-m", "broker", "--host", "127.0.0.1", "--port", "0", "--namesrv-port",
                           "0", "--metrics-port", "0", "--store-dir", str(tmp_path / "store"), *FLAGS],
                          cwd=REPO, capture_output=True, text=True, timeout=60, preexec_fn=both)
    assert done.returncode == 1, done
    line = next(x for x in done.stderr.splitlines() if "cannot start" in x)
    assert "Too many open files" in line and f"at most {LOW}" in line and "LimitNOFILE" in line, line
