"""A plain SEND every 10 ms while a bench's load runs: the broker's loop lag as a client sees it."""
import asyncio
import time


async def probe_sends(producer, lat: list, stop: asyncio.Event, topic: str = "TProbe") -> None:
    """Sends to ``topic`` one after another, 10 ms apart, until ``stop`` is set; each one's seconds go to ``lat``."""
    while not stop.is_set():
        t = time.perf_counter()
        await producer.send(topic, b"p")
        lat.append(time.perf_counter() - t)
        await asyncio.sleep(0.01)
