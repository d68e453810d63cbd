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


async def turns_before_hand_off(monkeypatch, save, meanwhile=None):
    """Run ``save`` (a RetriedSave's save()) and return (the bytes, the counter it handed its write thread, how many
    times another task ran before that hand-off: the write's wait in its thread is no part of the encoding).
    ``meanwhile``: called on that task's first turn (a change made while the save encodes)."""
    loop, turns, handed = asyncio.get_running_loop(), [0], []
    real = loop.run_in_executor
    monkeypatch.setattr(loop, "run_in_executor", lambda executor, write, data, at: (
        handed.append((data, at, turns[0])), real(executor, write, data, at))[1])

    async def other_work():
        await asyncio.sleep(0)
        if meanwhile is not None:
            meanwhile()
        while not handed:
            turns[0] += 1
            await asyncio.sleep(0)
    other = asyncio.ensure_future(other_work())
    try:
        await save()
    finally:
        handed.append(None)     # (stops other_work if the save raised before its hand-off)
        await other
    return handed[0]
