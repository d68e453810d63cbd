"""A PushConsumer in its own process that ships orders effectively once, for tests that kill it (kill -9).

    python -m tests.support.shipping_consumer NAMESRV GROUP TOPIC DB [--no-idempotency] [--async] [--from-last]

Each message announces an order (its body is the order id); the listener applies it with
``SqliteIdempotency.run_once`` into DB: one ``shipments`` row and the message's key commit in one
SQLite transaction. It prints ``READY`` once started, then ``S <order>`` for each shipment made and
``D <order>`` for each redelivery run_once suppressed, so the test paces its kills by progress.
``--no-idempotency`` ships without run_once (every delivery inserts): only for showing that the
test fails without it. ``--async``: an async listener with ``run_once_async`` (the worker thread's
connection commits the shipment and the key). ``--from-last``: a queue the group never committed starts at its
end (consume_from="last"), not its first message. SIGTERM is the clean shutdown (commits offsets, leaves
the group).
"""
from __future__ import annotations

import asyncio
import signal
import sqlite3
import sys

from consumer import ConsumeStatus, PushConsumer, SqliteIdempotency


def ship(msg, db: sqlite3.Connection) -> None:
    db.execute("INSERT INTO shipments (order_id) VALUES (?)", (msg.body.decode(),))


async def main(namesrv: str, group: str, topic: str, path: str, idempotent: bool, in_worker: bool = False,
               consume_from: str = "first") -> None:
    once = SqliteIdempotency(path)
    once.db.execute("CREATE TABLE IF NOT EXISTS shipments (order_id TEXT NOT NULL)")   # no UNIQUE: a duplicate shows

    def listener(msg):
        order = msg.body.decode()
        if idempotent:
            ran = once.run_once(msg, ship)
        else:
            ship(msg, once.db)      # autocommit: each delivery is an effect
            ran = True
        print(f"{'S' if ran else 'D'} {order}", flush=True)
        return ConsumeStatus.CONSUME_SUCCESS

    async def async_listener(msg):
        ran = await once.run_once_async(msg, ship)
        print(f"{'S' if ran else 'D'} {msg.body.decode()}", flush=True)
        return ConsumeStatus.CONSUME_SUCCESS

    # commits every 0.5 s: a kill -9 leaves consumed-but-uncommitted messages to be delivered again
    consumer = PushConsumer(namesrv, group, async_listener if idempotent and in_worker else listener,
                            consume_from=consume_from, suspend_ms=1000, rebalance_interval_s=1.0,
                            offset_commit_interval_s=0.5)
    consumer.subscribe(topic)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await consumer.start()
    print("READY", flush=True)
    await stop.wait()
    await consumer.shutdown()
    await once.aclose()


if __name__ == "__main__":
    namesrv, group, topic, path = sys.argv[1:5]
    asyncio.run(main(namesrv, group, topic, path, "--no-idempotency" not in sys.argv[5:],
                     "--async" in sys.argv[5:], "last" if "--from-last" in sys.argv[5:] else "first"))
