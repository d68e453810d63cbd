"""An orderly PushConsumer in its own process, for tests that kill it (kill -9) while it holds queue locks.

    python -m tests.support.orderly_consumer NAMESRV GROUP TOPIC STALL_AFTER

Prints ``LOCKED <n>`` whenever the number of queues it holds locked changes, and ``C <queue> <body>`` for
each message it consumes. After STALL_AFTER messages its listener stops returning (a hung consumer),
so the test decides when it dies by progress, not by the clock.
"""
from __future__ import annotations

import asyncio
import sys

from consumer import ConsumeStatus, PushConsumer


async def main(namesrv: str, group: str, topic: str, stall_after: int) -> None:
    consumed = 0
    stalled = asyncio.Event()

    async def listener(msg):
        nonlocal consumed
        if consumed >= stall_after:
            stalled.set()
            await asyncio.Event().wait()          # hangs until the process is killed or the queue is taken away
        consumed += 1
        print(f"C {msg.queue_id} {msg.body.decode()}", flush=True)
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(namesrv, group, listener, orderly=True, consume_from="first", suspend_ms=500,
                            lock_interval_s=0.5, lock_expire_s=1.5, lock_retry_s=0.2,
                            offset_commit_interval_s=0.2, rebalance_interval_s=1.0)
    consumer.subscribe(topic)
    await consumer.start()
    held = -1
    while True:
        locked = len(consumer.locked_queues)
        if locked != held:
            held = locked
            print(f"LOCKED {held}", flush=True)
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    namesrv, group, topic, stall = sys.argv[1:5]
    asyncio.run(main(namesrv, group, topic, int(stall)))
