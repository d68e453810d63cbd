"""PullConsumer.drain: pulls in flight with guessed offsets give exactly what one pull at a time gives."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from consumer import PullConsumer, PullStatus
from producer import Producer

pytestmark = pytest.mark.asyncio


def _summary(results):
    return [(r.status, r.next_begin_offset, [(m.queue_offset, m.body, m.tags, m.msg_id, m.reconsume_times)
                                             for m in r.messages]) for r in results]


async def _serial(consumer, mq, offset, max_nums, expression):
    out = []
    while True:
        res = await consumer.pull(mq, offset, max_nums=max_nums, expression=expression)
        out.append(res)
        if res.status not in (PullStatus.FOUND, PullStatus.NO_MATCHED_MSG):
            return out
        offset = res.next_begin_offset


async def test_drain_yields_what_serial_pulls_yield(broker):
    async with asyncio.timeout(60):
        async with Producer(broker.namesrv, "PG_drain") as producer:
            first = await producer.send("Drained", b"m0", tags="TagA")
            mq = first.queue
            # Small ones, a run of 40 KiB ones (256 KiB a pull: fewer than max_nums each, so the guessed
            # step is wrong until it adapts), then small ones again, tags alternating.
            for i in range(1, 300):
                body = (b"big%d-" % i) * 5000 if 100 <= i < 130 else b"m%d" % i
                await producer.send("Drained", body, tags="TagA" if i % 3 else "TagB", queue=mq)
        async with PullConsumer(broker.namesrv, "CG_drain") as consumer:
            await consumer.fetch_queues("Drained")
            for offset, max_nums, expression, inflight in [(0, 32, "*", 4), (7, 16, "*", 8), (0, 32, "TagB", 4),
                                                           (0, 32, "TagA || TagB", 1), (290, 32, "*", 4),
                                                           (300, 32, "*", 4), (5000, 32, "*", 4)]:
                expected = await _serial(consumer, mq, offset, max_nums, expression)
                got = [r async for r in consumer.drain(mq, offset, max_nums=max_nums, expression=expression,
                                                       inflight=inflight)]
                assert _summary(got) == _summary(expected), (offset, max_nums, expression, inflight)
            full = [r async for r in consumer.drain(mq, 0)]
            assert [m.queue_offset for r in full for m in r.messages] == list(range(300))
            assert full[-1].status is PullStatus.NO_NEW_MSG and full[-1].next_begin_offset == 300
            assert [r.status for r in expected] == [PullStatus.OFFSET_ILLEGAL]          # from 5000


async def test_drain_closed_early_leaves_no_pull_behind(broker):
    async with asyncio.timeout(30):
        async with Producer(broker.namesrv, "PG_drain2") as producer:
            mq = (await producer.send("Drained2", b"m0")).queue
            await producer.send_batch("Drained2", [b"m%d" % i for i in range(1, 200)], queue=mq)
        async with PullConsumer(broker.namesrv, "CG_drain2") as consumer:
            await consumer.fetch_queues("Drained2")
            async with contextlib.aclosing(consumer.drain(mq, 0, max_nums=10, inflight=6)) as pulls:
                async for res in pulls:
                    assert [m.queue_offset for m in res.messages] == list(range(10))
                    break
            # The pulls sent ahead were cancelled: the connection waits for no answer.
            assert all(not conn._pending for conn in consumer.pool.connections())
            with pytest.raises(ValueError):
                async for _ in consumer.drain(mq, 0, inflight=0):
                    pass
