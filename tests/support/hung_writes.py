"""Hung-write stop tests (a FIFO no one reads where a table's .tmp copy goes: its open() blocks for ever, as on
a stopped NFS): SIGTERM, then the process must end within a bound; the FIFO released after."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest


def sigterm_ends(server, hung: str, within: float = 30.0) -> None:
    """SIGTERM ``server`` (a BrokerProcess or NamesrvProcess): it ends, with 0, within ``within`` s though
    ``hung``'s write hangs."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"not ended within {within:g} s of SIGTERM behind a hung {hung} write\n{server.log()}")
    assert code == 0, server.log()


def hung_flush_env(fifo, repo=None) -> dict:
    """The ``env`` of a BrokerProcess (of ``repo``, this checkout by default) whose commit-log flushes hang while
    ``fifo`` exists (made by the test, released with ``unblock``): hung_flush_hook/sitecustomize.py."""
    from tests.support.broker_process import REPO
    hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hung_flush_hook")
    return {"PYTHONPATH": os.pathsep.join((hook, str(repo or REPO))), "TXMQ_TEST_HUNG_FLUSH_FIFO": str(fifo)}


def slow_flush_env(flag, seconds: float) -> dict:
    """The ``env`` of a BrokerProcess whose commit-log flushes each take ``seconds`` more, and then complete (a slow
    disk, not a hung one), while the file ``flag`` exists: hung_flush_hook/sitecustomize.py."""
    env = hung_flush_env("")
    del env["TXMQ_TEST_HUNG_FLUSH_FIFO"]
    return {**env, "TXMQ_TEST_SLOW_FLUSH": f"{flag}:{seconds:g}"}


def hung_recovery_env(fifo) -> dict:
    """The ``env`` of a BrokerProcess whose store recovery, at start-up, hangs before it reads the log while ``fifo``
    exists (made by the test, released with ``unblock``): hung_flush_hook/sitecustomize.py."""
    return _hook_env("TXMQ_TEST_HUNG_RECOVERY_FIFO", fifo)


def hung_checkpoint_env(fifo) -> dict:
    """The ``env`` of a BrokerProcess whose store checkpoints (fsyncs of directories, the queue list, the checkpoint
    file) hang while ``fifo`` exists: hung_flush_hook/sitecustomize.py."""
    return _hook_env("TXMQ_TEST_HUNG_CHECKPOINT_FIFO", fifo)


def _hook_env(name: str, value) -> dict:
    env = hung_flush_env("")
    del env["TXMQ_TEST_HUNG_FLUSH_FIFO"]
    return {**env, name: str(value)}


def unblock(fifo) -> None:
    """A reader lets a writer still blocked in open() go on."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))


def release(fifo, server) -> None:
    unblock(fifo)
    server.kill()


async def flush_in_flight(broker, within: float = 20.0) -> None:
    """Until ``broker`` (a BrokerProcess) shows a commit-log flush in flight (txmq_store_flush_in_flight_seconds
    above 0, its gauges refreshed each second): a flush held by a slow or hung disk has begun."""
    await gauge_above_0(broker, "txmq_store_flush_in_flight_seconds", "no commit-log flush in flight", within)


async def gauge_above_0(broker, name: str, failure: str, within: float = 20.0) -> None:
    """Until ``broker``'s gauge ``name`` (one series, refreshed each second) is above 0; ``failure`` said if not."""
    url = f"http://{broker.metrics}/metrics"
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        if m and float(m[1]) > 0:
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"{failure} within {within:g} s\n{broker.log()}")
