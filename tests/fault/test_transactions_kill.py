"""SIGKILL the broker during a stream of at least 1,000 transactions with random outcomes.

The kills are paced by progress, not by the clock: one after every KILL_EVERY acknowledged
transactions, and the stream goes on (past 1,000 if need be) until all KILLS happened, so
the test means the same on a fast machine as on a slow one. After every restart (same
store, same ports) the stream goes on. At the end,
once every transaction is decided: each transaction whose local transaction
committed is delivered exactly once, no rolled-back one is, and the broker
stored no message twice. Checks answer from what the local transactions really
did: one that never ran (its half send failed as the broker died) rolls back; one not run yet (its SEND_OK on
its way, slower than the transaction timeout) is UNKNOW until it has run.
"""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import BrokerError

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

TOTAL = 1000
CONCURRENCY = 16
KILLS = 4
KILL_EVERY = 150        # acknowledged transactions between kills: 4 kills need 600 of the 1,000
OUTCOMES = [S.COMMIT_MESSAGE, S.ROLLBACK_MESSAGE, "unknown-commit", "unknown-rollback"]


class Ledger:
    """What each local transaction did: the truth the broker's checks are answered from."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.plan: dict[bytes, object] = {}
        self.executed: dict[bytes, S] = {}
        self.failed: set[bytes] = set()     # halves whose send raised: their local transaction never runs

    def execute_local_transaction(self, msg, arg):
        outcome = self.plan[msg.body]
        final = {"unknown-commit": S.COMMIT_MESSAGE, "unknown-rollback": S.ROLLBACK_MESSAGE}.get(outcome, outcome)
        self.executed[msg.body] = final
        return S.UNKNOW if isinstance(outcome, str) else outcome

    def check_local_transaction(self, msg):
        if msg.body in self.executed:
            return self.executed[msg.body]
        # Not run yet: a check that came before a late SEND_OK rolled back a transaction about to commit, and
        # the ledger called it committed (its END refused as a conflict). Rolled back only once its send failed.
        return S.ROLLBACK_MESSAGE if msg.body in self.failed else S.UNKNOW


async def _pending(addr) -> int:
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 1}), 5)
        return json.loads(resp.body_bytes())["total"]
    finally:
        conn.close()


async def _delivered(namesrv, topic) -> list[bytes]:
    consumer = PullConsumer(namesrv, "CG_kill")
    bodies = []
    for mq in await consumer.fetch_queues(topic):
        offset = 0
        while True:
            res = await consumer.pull(mq, offset, max_nums=256)
            bodies += [m.body for m in res.messages]
            if res.next_begin_offset == offset or not res.messages:
                break
            offset = res.next_begin_offset
    await consumer.shutdown()
    return bodies


async def test_kill_during_transactions_loses_and_duplicates_nothing(broker_factory):
    flags = ("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "500")
    b = broker_factory(*flags)
    fixed = ("--port", str(b.broker_port), "--namesrv-port", b.namesrv.rsplit(":", 1)[1], *flags)
    ledger = Ledger(seed=20261121)
    producer = TransactionProducer(b.namesrv, "PG_kill", ledger, end_retries=8, end_timeout=2.0, retries=0)
    await producer.start()
    started = 0
    failed_sends = acked = kills = 0
    brokers = [b]
    up = asyncio.Event()
    up.set()
    kill_due = asyncio.Event()

    def next_body() -> bytes | None:
        nonlocal started
        if started >= TOTAL and kills >= KILLS:
            return None
        body = f"tx-{started}".encode()
        started += 1
        ledger.plan[body] = ledger.rng.choice(OUTCOMES)
        return body

    async def worker():
        nonlocal failed_sends, acked
        while (body := next_body()) is not None:
            try:
                await producer.send_in_transaction("TxKill", body)
            except (BrokerError, OSError):
                ledger.failed.add(body)
                failed_sends += 1           # never retried: its half may be stored, and checks settle it
                await up.wait()
                continue
            acked += 1
            if acked % KILL_EVERY == 0:
                kill_due.set()

    async def killer():
        nonlocal kills
        while kills < KILLS:
            await kill_due.wait()           # progress, not time: KILL_EVERY more acknowledged
            kill_due.clear()
            up.clear()
            brokers[-1].kill()
            kills += 1
            brokers.append(await asyncio.to_thread(broker_factory, *fixed))
            up.set()

    async with asyncio.timeout(240):
        await asyncio.gather(killer(), *(worker() for _ in range(CONCURRENCY)))
        while await _pending(brokers[-1].broker):     # checks settle what the crashes left undecided
            await asyncio.sleep(0.2)
    await producer.shutdown()
    delivered = await _delivered(brokers[-1].namesrv, "TxKill")
    committed = {body for body, state in ledger.executed.items() if state is S.COMMIT_MESSAGE}
    assert len(delivered) == len(set(delivered)), "a message was stored twice"
    assert set(delivered) == committed
    assert kills == KILLS, "the broker must actually have been killed mid-stream"
    print(f"{started} transactions, {kills} kills, {failed_sends} sends failed, "
          f"{len(committed)} committed and delivered once, {len(ledger.executed) - len(committed)} rolled back")


async def test_an_idle_producer_is_asked_about_its_undecided_transaction_soon_after_a_broker_restart(broker_factory):
    """After a restart the broker knows a producer group only once it heartbeats or sends a half again.
    A producer with nothing more to send heartbeated every heartbeat_interval_s (30 s): its undecided
    transactions went unchecked, and their messages unseen, for up to that long. It now heartbeats as
    soon as a broker connection is lost, retrying with a short back-off until the broker is back."""
    flags = ("--transaction-check-interval-ms", "200", "--transaction-timeout-ms", "1500")
    b = broker_factory(*flags)
    fixed = ("--port", str(b.broker_port), "--namesrv-port", b.namesrv.rsplit(":", 1)[1], *flags)
    restarted, checked = asyncio.Event(), asyncio.Event()

    class Undecided:
        def execute_local_transaction(self, msg, arg):
            return S.UNKNOW

        async def check_local_transaction(self, msg):
            if not restarted.is_set():
                # Asked before the kill (the machine paused past the immunity): answered, it decided the
                # transaction then, and nothing was left to check after the restart. Held, it stays undecided.
                await restarted.wait()
                return S.UNKNOW
            checked.set()
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(b.namesrv, "PG_idle", Undecided(), retries=0)    # heartbeats every 30 s
    async with asyncio.timeout(60):
        await producer.start()
        await producer.send_in_transaction("TxIdle", b"in doubt")
        assert await _pending(b.broker) == 1
        b.kill()
        b2 = await asyncio.to_thread(broker_factory, *fixed)
        restarted.set()
    try:
        async with asyncio.timeout(10):       # immunity 1.5 s, then a check every 0.2 s: well within this
            await checked.wait()
            while await _pending(b2.broker):
                await asyncio.sleep(0.1)
    except TimeoutError:
        pytest.fail("the idle producer's undecided transaction was not checked within 10 s of the restart")
    finally:
        await producer.shutdown()
