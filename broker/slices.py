"""Work over a long list done a slice at a time, the event loop running between two slices."""
from __future__ import annotations

import asyncio


async def in_slices(items: list, size: int):
    """``items`` ``size`` at a time, the event loop running between two slices."""
    for i in range(0, len(items), size):
        if i:
            await asyncio.sleep(0)
        yield items[i:i + size]


async def members_in_slices(head: str, names: list, size: int, members, sep: str, tail: str) -> list[bytes]:
    """The parts of a JSON body (to send without joining) that holds an object's members: ``head``, then
    ``members(slice)`` (a slice of ``names``' members, written out, without braces) for each slice of ``size``
    names, the event loop running between two, ``sep`` between them, then ``tail``."""
    parts = [head.encode()]
    async for part in in_slices(names, size):
        text = members(part)
        if text:
            parts += (sep.encode(), text.encode()) if len(parts) > 1 else (text.encode(),)
    parts.append(tail.encode())
    return parts
