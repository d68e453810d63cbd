"""A push consumer on a slave behind the consumer's offset (the slave answers retry, offset
unchanged) waits between pulls rather than spinning, and keeps its offset."""
from __future__ import annotations

import asyncio

import pytest

from consumer.pull_consumer import MessageQueue, PullResult, PullStatus
from tests.support.bounded import bounded
from tests.unit.test_background_loops import _push_consumer


@pytest.mark.asyncio
@bounded(20)
async def test_a_push_consumer_waits_between_pulls_a_lagging_slave_answers_retry():
    consumer = _push_consumer()
    consumer.pull_retry_delay_s = 0.1
    mq = MessageQueue("T", "b", 0)
    asked = []

    async def start_offset(q):
        return 9

    async def pull(q, offset, **kw):
        asked.append(offset)
        return PullResult(PullStatus.NO_MATCHED_MSG, offset, 0, 5)
    consumer._start_offset = start_offset
    consumer.client.pull = pull
    consumer._owned.add(mq)
    task = asyncio.get_running_loop().create_task(consumer._pull_loop(mq))
    try:
        await asyncio.sleep(0.35)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await consumer.client.shutdown()
    assert 2 <= len(asked) <= 5 and set(asked) == {9} and consumer._offsets[mq] == 9, asked
