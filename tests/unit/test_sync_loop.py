"""txmq.sync: a blocking call that times out ends its coroutine too."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from txmq.sync import _LoopThread


def test_a_call_that_times_out_is_cancelled_not_left_running():
    """Left running, a send whose blocking call had raised TimeoutError could still be stored later, after the
    caller had sent it again (or given up on it)."""
    thread = _LoopThread("test-sync")
    ended = threading.Event()
    outcome = []

    async def slow_send():
        try:
            await asyncio.sleep(30)
            outcome.append("stored")
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        finally:
            ended.set()
    try:
        with pytest.raises((TimeoutError, concurrent.futures.TimeoutError)):
            thread.run(slow_send(), 0.05)
        assert ended.wait(10)
        assert outcome == ["cancelled"]
    finally:
        thread.close()
