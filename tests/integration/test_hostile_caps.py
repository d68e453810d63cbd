"""Shared tables with a cap: one client (one address, however many connections or client ids) must not fill
them for everyone else, and what a client leaves behind must be reclaimed."""
from __future__ import annotations

import itertools
import json

import pytest

from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.command import RemotingCommand
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio

_OPAQUES = itertools.count(1)


async def _call(client: RawClient, code: int, body: dict | None = None, timeout: float = 10.0):
    payload = b"" if body is None else json.dumps(body).encode()
    [reply] = await client.call(RemotingCommand(code, opaque=next(_OPAQUES), body=payload), timeout)
    return reply


async def _queues(client: RawClient) -> list[dict]:
    reply = await _call(client, R.GET_ALL_TOPIC_CONFIG)
    table = json.loads(reply.body_bytes())["topicConfigTable"]
    return [{"topic": t, "brokerName": "broker-a", "queueId": q}
            for t, tc in sorted(table.items()) for q in range(tc["readQueueNums"])]


async def _lock(client: RawClient, group: str, client_id: str, mqs: list[dict]) -> list[dict]:
    reply = await _call(client, R.LOCK_BATCH_MQ, {"consumerGroup": group, "clientId": client_id, "mqSet": mqs})
    assert reply.code == C.SUCCESS
    return json.loads(reply.body_bytes())["lockOKMQSet"]


async def test_one_address_with_many_connections_cannot_take_every_queue_lock(broker_factory):
    """Each connection was held to max_queue_locks_per_connection, but nothing bounded one address: a client
    opening connection after connection (closed ones keep their locks until they expire, 60 s) filled
    max_queue_locks, and every orderly consumer on any other host was silently never granted a queue (left out
    of lockOKMQSet: it waits forever). One address now holds at most max_queue_locks_per_host."""
    broker = broker_factory("--max-queue-locks", "40", "--max-queue-locks-per-connection", "10",
                            "--max-queue-locks-per-host", "20")
    probe = await RawClient.open(broker.broker)
    try:
        mqs = (await _queues(probe))[:10]
        assert len(mqs) == 10
    finally:
        probe.close()
    for i in range(6):              # 60 locks asked for, one connection after another, each closed after
        hostile = await RawClient.open(broker.broker, "127.0.0.1")
        try:
            await _lock(hostile, f"G_hostile{i}", f"hostile{i}", mqs)
        finally:
            hostile.close()
    victim = await RawClient.open(broker.broker, "127.0.0.2")       # another host
    try:
        assert await _lock(victim, "G_victim", "victim", mqs) == mqs
    finally:
        victim.close()
    assert "max_queue_locks_per_host" in broker.log()
