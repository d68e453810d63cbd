"""A deadline for async tests, so a hang fails the test instead of stalling the suite."""
from __future__ import annotations

import asyncio
import contextlib
import functools


def bounded(seconds: float = 15):
    def deco(fn):
        @functools.wraps(fn)
        async def run(*args, **kwargs):
            return await asyncio.wait_for(fn(*args, **kwargs), seconds)
        return run
    return deco


@contextlib.asynccontextmanager
async def other_client():
    """Another client's work on the loop: yields [turns], the loop turns it was given while the block ran (a
    handler that holds the loop for its whole work gives it none)."""
    turns = [0]

    async def other_client():
        while True:
            turns[0] += 1
            await asyncio.sleep(0)
    other = asyncio.ensure_future(other_client())
    await asyncio.sleep(0)
    try:
        yield turns
    finally:
        other.cancel()         # (it counts no more: cancelled, its next turn raises at the sleep)
