"""Hung-write stop tests (a FIFO no one reads where a table's .tmp copy goes: its open() blocks for ever, as on
a stopped NFS): SIGTERM, then the process must end within a bound; the FIFO released after."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess

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


def slow_flush_env(delay_ms: int, repo=None) -> dict:
    """The ``env`` of a BrokerProcess whose every commit-log flush takes ``delay_ms`` more (a slow disk)."""
    env = hung_flush_env("", repo)
    env.pop("TXMQ_TEST_HUNG_FLUSH_FIFO")
    return {**env, "TXMQ_TEST_FLUSH_DELAY_MS": str(delay_ms)}


def unblock(fifo) -> None:
    """A reader lets a writer still blocked in open() go on."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))


def release(fifo, server) -> None:
    unblock(fifo)
    server.kill()
