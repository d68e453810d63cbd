"""A push consumer on a slave behind the consumer's offset (the slave answers retry, offset
unchanged) waits between pulls rather than spinning, keeps its offset, and says so when it lasts."""
from __future__ import annotations

import asyncio
import logging

import pytest

from consumer import push_consumer
from consumer.pull_consumer import MessageQueue, PullResult, PullStatus
from tests.support.bounded import bounded
from tests.unit.test_background_loops import _push_consumer


@pytest.mark.asyncio
@bounded(20)
async def test_a_push_consumer_waits_between_pulls_a_lagging_slave_answers_retry():
    consumer = _push_consumer()
    consumer.pull_retry_delay_s = 0.1
    mq = MessageQueue("T", "b", 0)
    asked, third = [], asyncio.Event()
    loop = asyncio.get_running_loop()

    async def start_offset(q):
        return 9

    async def pull(q, offset, **kw):
        asked.append((offset, loop.time()))
        if len(asked) == 3:
            third.set()
        return PullResult(PullStatus.NO_MATCHED_MSG, offset, 0, 5)
    consumer._start_offset = start_offset
    consumer.client.pull = pull
    consumer._owned.add(mq)
    task = loop.create_task(consumer._pull_loop(mq))
    try:
        await third.wait()
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await consumer.client.shutdown()
    offsets = [o for o, _ in asked]
    assert set(offsets) == {9} and consumer._offsets[mq] == 9, asked
    # two waits of pull_retry_delay_s between three pulls: not a tight loop (a lower bound, whatever the machine)
    assert asked[2][1] - asked[0][1] >= 2 * 0.1 * 0.9, asked


def test_a_queue_stuck_behind_is_warned_of_after_a_minute_then_every_ten(monkeypatch, caplog):
    consumer = _push_consumer()
    mq = MessageQueue("T", "b", 0)
    now = [1000.0]
    monkeypatch.setattr(push_consumer.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.WARNING, logger=push_consumer.log.name)
    since = None
    for t in range(0, 60 * 12, 3):              # a pull every 3 s for 12 minutes, always "retry" at offset 9
        now[0] = 1000.0 + t
        since = consumer._still_behind(mq, 9, since)
    warnings = [r for r in caplog.records if "has waited" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]    # at 60 s and at 660 s
    assert "offset 9" in warnings[0].getMessage() and "slave behind its master" in warnings[0].getMessage()
    caplog.clear()
    since = consumer._still_behind(mq, 10, since)  # progress: the clock starts again
    now[0] += 59
    consumer._still_behind(mq, 10, since)
    assert not [r for r in caplog.records if "has waited" in r.getMessage()]
