"""Exported numbers compared with what the broker really holds: a metric an operator trusts must not drift
from the state it describes."""
from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producer import LocalTransactionState, TransactionProducer

pytestmark = pytest.mark.asyncio


class Commit:
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    async def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT_MESSAGE


def _scrape(broker) -> dict:
    text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def _commit(broker, group: str, topic: str, bodies: list[bytes]) -> None:
    async with TransactionProducer(broker.namesrv, group, Commit()) as producer:
        for body in bodies:
            await producer.send_in_transaction(topic, body)


async def test_committed_transactional_messages_count_their_body_bytes(broker_factory):
    """rocketmq_throughput_in counts the body bytes stored on a topic; a committed transaction's message was
    counted with 0 bytes, so a topic fed by transactions showed messages coming in and no bytes at all."""
    broker = broker_factory()
    await _commit(broker, "PG_bytes", "TxBytes", [b"x" * 100, b"y" * 23])
    m = await asyncio.to_thread(_scrape, broker)
    assert m[("rocketmq_messages_in_total", (("topic", "TxBytes"),))] == 2
    assert m[("rocketmq_throughput_in_total", (("topic", "TxBytes"),))] == 123
