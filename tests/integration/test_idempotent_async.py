"""SqliteIdempotency.run_once_async in a PushConsumer listener, against the real broker, while another
connection holds the shared database's write lock: the consumer's event loop goes on (another task
ticks, another topic's message is consumed), and once the lock is released the message runs exactly
once. ``run_once`` there blocked the whole loop for up to busy_timeout_s (30 s): heartbeats, lock
renewals and the pulls of every other queue stopped with it."""
from __future__ import annotations

import asyncio
import sqlite3

import pytest

from consumer import ConsumeStatus, PushConsumer, SqliteIdempotency
from producer import Producer

pytestmark = pytest.mark.asyncio


async def test_a_locked_database_does_not_stop_the_consumers_event_loop(broker, tmp_path):
    path = str(tmp_path / "ledger.db")
    ledger = SqliteIdempotency(path, busy_timeout_s=20)
    ledger.db.execute("CREATE TABLE applied (body TEXT)")
    holder = sqlite3.connect(path, isolation_level=None)     # another process, committing
    holder.execute("BEGIN IMMEDIATE")

    def apply(msg, db):
        db.execute("INSERT INTO applied VALUES (?)", (msg.body.decode(),))

    entered, other_consumed, others = asyncio.Event(), asyncio.Event(), []
    results, ran = [], asyncio.Event()

    async def listener(msg):
        if msg.topic == "Other":
            others.append(msg.body)
            other_consumed.set()
            return ConsumeStatus.CONSUME_SUCCESS
        entered.set()
        calls.append(msg.body)
        in_call.append(msg.body)
        try:
            results.append(await ledger.run_once_async(msg, apply))
        finally:
            in_call.remove(msg.body)
        ran.set()
        return ConsumeStatus.CONSUME_SUCCESS

    ticks, in_call, calls = 0, [], []

    async def tick():       # the loop runs other tasks: counted
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    consumer = PushConsumer(broker.namesrv, "CG_idem_async", listener, consume_from="first", suspend_ms=300)
    consumer.subscribe("Orders")
    consumer.subscribe("Other")
    ticker = asyncio.get_running_loop().create_task(tick())
    try:
        async with asyncio.timeout(40), Producer(broker.namesrv, "PG_idem_async") as producer:
            await producer.send("Orders", b"order-1", properties={"UNIQ_KEY": "ORDER-1"})
            await producer.send("Other", b"warm-up")           # the topic exists before the consumer starts
            await consumer.start()
            await entered.wait()           # the listener is in run_once_async, waiting for the lock
            before = ticks
            await producer.send("Other", b"meanwhile")
            while b"meanwhile" not in others:      # another queue is still pulled and consumed
                other_consumed.clear()
                await other_consumed.wait()
            while ticks < before + 20:     # and the loop runs other tasks
                await asyncio.sleep(0.01)
            # All that while, the one call waits for the lock: entered once, not ended. Blocked on the lock, the loop
            # ran nothing until busy_timeout_s (20 s) ended that call with an error, and the ticks and the other
            # message came only after it (the call ended, or entered again on a retry). (Was max(gaps) < 5 s, the
            # loop's stalls on the wall clock: a timed bound; the order of the events is what tells them apart.)
            assert calls == [b"order-1"] and in_call == [b"order-1"] and results == []
            assert ledger.db.execute("SELECT COUNT(*) FROM applied").fetchone()[0] == 0
            holder.execute("ROLLBACK")
            await ran.wait()
            assert results == [True]
            ran.clear()
            # The producer resends it (a lost acknowledgement): consumed again, applied not again.
            await producer.send("Orders", b"order-1", properties={"UNIQ_KEY": "ORDER-1"})
            await ran.wait()
            await consumer.shutdown()
    finally:
        ticker.cancel()
        holder.close()
    assert results == [True, False]
    assert ledger.db.execute("SELECT body FROM applied").fetchall() == [("order-1",)]
    await ledger.aclose()
