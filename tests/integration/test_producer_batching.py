"""Producer(batch_size, linger_ms): concurrent sends leave as SEND_BATCH_MESSAGE, each keeps its own identity."""
from __future__ import annotations

import asyncio

import pytest

from consumer import PullConsumer
from producer import Producer, SendStatus
from protocol.message import Prop

pytestmark = pytest.mark.asyncio


async def _pull_all(namesrv: str, topic: str, expect: int) -> list:
    consumer = PullConsumer(namesrv, f"CG_{topic}")
    got = []
    try:
        for mq in await consumer.fetch_queues(topic):
            offset = 0
            while True:
                res = await consumer.pull(mq, offset, max_nums=64)
                if not res.messages:
                    break
                got += res.messages
                offset = res.next_begin_offset
    finally:
        await consumer.shutdown()
    assert len(got) == expect
    return got


async def test_gathered_sends_are_separate_messages_with_their_own_results(broker):
    async with asyncio.timeout(30):
        async with Producer(broker.namesrv, "PG_linger", batch_size=16, linger_ms=50) as producer:
            await producer.send("Lingered", b"warm-up")           # creates the topic
            results = await asyncio.gather(*(
                producer.send("Lingered", f"m{i}".encode(), tags=f"t{i % 3}", keys=f"order-{i}",
                              properties={"trace": str(i)}) for i in range(40)))
        got = await _pull_all(broker.namesrv, "Lingered", 41)
    assert all(r.status is SendStatus.SEND_OK for r in results)
    assert len({r.msg_id for r in results}) == 40                   # a UNIQ_KEY each
    assert len({r.offset_msg_id for r in results}) == 40            # a record each
    assert len({(r.queue.queue_id, r.queue_offset) for r in results}) == 40
    by_body = {m.body: m for m in got}
    for i, r in enumerate(results):
        m = by_body[f"m{i}".encode()]                               # not an encoded batch blob
        assert m.properties[Prop.UNIQ_KEY] == r.msg_id
        assert m.properties[Prop.KEYS] == f"order-{i}"
        assert m.properties[Prop.TAGS] == f"t{i % 3}"
        assert m.properties["trace"] == str(i)
        assert (m.queue_id, m.queue_offset) == (r.queue.queue_id, r.queue_offset)
        assert m.offset_msg_id == r.offset_msg_id


async def test_shutdown_sends_what_is_still_lingering(broker):
    async with asyncio.timeout(30):
        producer = await Producer(broker.namesrv, "PG_linger2", batch_size=1000, linger_ms=60_000).start()
        pending = [asyncio.ensure_future(producer.send("Lingered2", f"m{i}".encode())) for i in range(6)]
        await asyncio.wait(pending, timeout=0.5)                     # they linger: nobody fills the batch ...
        assert not any(p.done() for p in pending)
        await producer.shutdown()                                    # ... until shutdown sends it
        assert all(p.result().status is SendStatus.SEND_OK for p in pending)
        await _pull_all(broker.namesrv, "Lingered2", 6)
