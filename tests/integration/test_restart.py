"""Messages and consumer offsets survive a clean stop and a SIGKILL."""
from __future__ import annotations

import asyncio
import json

import pytest

from consumer import PullConsumer
from consumer.pull_consumer import MessageQueue
from producer import Producer

pytestmark = pytest.mark.asyncio


async def _send(broker, n):
    async with Producer(broker.namesrv, "PG_restart") as producer:
        await producer.send("Durable", b"seed")
        mq = (await producer.routes.publish_queues("Durable"))[0]
        for i in range(n):
            await producer.send("Durable", f"m{i}".encode(), queue=mq)
    return MessageQueue("Durable", mq.broker_name, mq.queue_id)


async def _bodies(broker, mq):
    consumer = PullConsumer(broker.namesrv, "CG_restart")
    await consumer.fetch_queues("Durable")
    res = await consumer.pull(mq, 0, max_nums=1000)
    offset = await consumer.fetch_offset(mq)
    await consumer.shutdown()
    return [m.body for m in res.messages], offset


async def _wait_offset_persisted(store_dir, group, expected, timeout=15.0):
    path = store_dir / "config" / "consumerOffset.json"
    async with asyncio.timeout(timeout):
        while True:
            try:
                data = json.loads(path.read_text())
                if expected in str(data) and group in str(data):
                    return
            except (OSError, ValueError):
                pass
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("crash", [False, True], ids=["clean-stop", "sigkill"])
async def test_messages_and_offsets_survive(broker_factory, tmp_path, crash):
    b = broker_factory()
    mq = await _send(b, 50)
    consumer = PullConsumer(b.namesrv, "CG_restart")
    await consumer.fetch_queues("Durable")
    await consumer.commit_offset(mq, 42)
    await consumer.shutdown()
    if crash:
        await _wait_offset_persisted(tmp_path / "store", "CG_restart", "42")
        b.kill()
    else:
        assert b.stop() == 0
    b2 = broker_factory()
    bodies, offset = await _bodies(b2, mq)
    assert [f"m{i}".encode() for i in range(50)] == [x for x in bodies if x != b"seed"]
    assert offset == 42
