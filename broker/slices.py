"""Work over a long list done a slice at a time, the event loop running between two slices."""
from __future__ import annotations

import asyncio


async def in_slices(items: list, size: int):
    """``items`` ``size`` at a time, the event loop running between two slices."""
    for i in range(0, len(items), size):
        if i:
            await asyncio.sleep(0)
        yield items[i:i + size]
