"""How many times other work ran on the event loop while one awaitable ran: a unit test's check that a long walk
lets the loop run between its slices."""
from __future__ import annotations

import asyncio


async def turns_while(awaitable):
    """(its result, how many times another task ran meanwhile)."""
    turns, done = 0, False

    async def other_work():
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)
    other = asyncio.ensure_future(other_work())
    await asyncio.sleep(0)
    before = turns
    try:
        return await awaitable, turns - before
    finally:
        done = True
        await other
