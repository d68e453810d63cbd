"""A deadline for async tests, so a hang fails the test instead of stalling the suite."""
from __future__ import annotations

import asyncio
import functools


def bounded(seconds: float = 15):
    def deco(fn):
        @functools.wraps(fn)
        async def run(*args, **kwargs):
            return await asyncio.wait_for(fn(*args, **kwargs), seconds)
        return run
    return deco
