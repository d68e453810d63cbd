"""Whom a transaction check goes to: the producer instance that sent the half first, across a broker
restart too; and a check whose connection closes unanswered goes to a live producer at once.

Check intervals are long (a minute) so that "asked again well before the interval" means the same on a
slow machine; every wait is for an event (a check arriving, a metric moving), bounded by the test's deadline.
"""
from __future__ import annotations

import asyncio
import urllib.request

import pytest

from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.message import Prop
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

GROUP = "PG_routing"
TOPIC = "Routing"
LONG = ("--transaction-check-interval-ms", "60000")


class Listener:
    """Leaves its local transactions undecided; records the checks it is asked, answers them when ``answers``."""

    def __init__(self, answers: bool = True, changed: asyncio.Event | None = None):
        self.answers = answers
        self.asked: list[bytes] = []
        self.changed = changed or asyncio.Event()       # may be shared: any of several listeners asked
        self.never = asyncio.Event()

    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    async def check_local_transaction(self, msg):
        self.asked.append(msg.body)
        self.changed.set()
        if not self.answers:
            await self.never.wait()     # hung: the check is never answered on this connection
        return S.COMMIT_MESSAGE

    async def until_asked(self, n: int, *others: "Listener") -> None:
        """Until this listener (and ``others``, sharing its event) were asked ``n`` checks in all."""
        while len(self.asked) + sum(len(o.asked) for o in others) < n:
            self.changed.clear()
            await self.changed.wait()


def _producer(b, instance: str, listener: Listener) -> TransactionProducer:
    return TransactionProducer(b.namesrv, GROUP, listener, instance_name=instance, shutdown_grace_s=0)


async def _die(producer: TransactionProducer) -> None:
    """The producer's process dies: its connections close, and nothing more is sent (no UNREGISTER_CLIENT)."""
    for task in (producer._heartbeat_task, producer._route_task):
        task.cancel()
    await producer.pool.close()


async def _metric(b, name: str, label: str = "") -> float:
    """The value of ``name`` for GROUP (summed over its other labels, or only those with ``label``)."""
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode())
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'producer_group="{GROUP}"' in line and label in line)


@bounded(90)
async def test_a_check_whose_connection_closes_unanswered_is_asked_again_of_a_live_producer_at_once(
        broker_factory):
    b = broker_factory(*LONG, "--transaction-timeout-ms", "1000")
    hung, other = Listener(answers=False), Listener()
    async with _producer(b, "other", other):
        sender = await _producer(b, "sender", hung).start()
        try:
            await sender.send_in_transaction(TOPIC, b"order 1")
            await hung.until_asked(1)               # the first check goes to the sender
            await _die(sender)
            # Asked again of the live producer within seconds, not after the minute's interval.
            await asyncio.wait_for(other.until_asked(1), 20)
        finally:
            hung.never.set()
        assert other.asked == [b"order 1"]
        assert await _metric(b, "txmq_transaction_checks_lost_total") == 1
        assert await _metric(b, "txmq_transaction_checks_total") == 2      # both count against the max

