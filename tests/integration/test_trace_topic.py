"""Message tracing with topic auto-create off: clients send their traces to RMQ_SYS_TRACE_TOPIC, a system topic.

A system topic cannot be made with updateTopic, and with --auto-create-topic false a send cannot make it,
so a stock client with tracing on had nowhere to send its traces. RocketMQ's broker makes it at start when
traceTopicEnable is set (off by default); --trace-topic-enable does the same here.
"""
from __future__ import annotations

import asyncio

import pytest

from consumer import PullConsumer
from producer import Producer, SendStatus
from protocol.codes import Perm, RequestCode, ResponseCode
from protocol.errors import TopicNotExistError
from tests.support.bounded import bounded
from tests.support.cluster_process import request, route

pytestmark = pytest.mark.asyncio

TRACE = "RMQ_SYS_TRACE_TOPIC"


async def _send(namesrv: str, body: bytes):
    # a trace dispatcher's producer: an ordinary send to the trace topic, TBW102 as its template
    async with Producer(namesrv, "PG_trace", retries=0) as producer:
        return await asyncio.wait_for(producer.send(TRACE, body), 10)


@bounded(60)
async def test_without_the_option_and_auto_create_off_the_trace_topic_cannot_be_made(broker_factory):
    b = broker_factory("--auto-create-topic", "false")
    assert await route(b.namesrv, TRACE) is None
    with pytest.raises(TopicNotExistError):
        await _send(b.namesrv, b"trace")
    refused = await request(b.broker, RequestCode.UPDATE_AND_CREATE_TOPIC, {
        "topic": TRACE, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6})
    assert refused.code == ResponseCode.SYSTEM_ERROR and "system topic" in refused.remark


@bounded(90)
async def test_trace_topic_enable_makes_the_trace_topic_at_start_and_keeps_it(broker_factory):
    b = broker_factory("--auto-create-topic", "false", "--trace-topic-enable", "true")
    r = await route(b.namesrv, TRACE)
    assert r is not None
    assert [(q.read_queue_nums, q.write_queue_nums, q.perm) for q in r.queue_datas] == [(1, 1, Perm.READ_WRITE)]
    result = await _send(b.namesrv, b"trace-1")
    assert result.status is SendStatus.SEND_OK
    # Kept in the catalogue like any topic: the traces stay routed after a restart without the option.
    assert b.stop() == 0
    b.flags = [f for f in b.flags if f not in ("--trace-topic-enable", "true")]
    b.start()
    consumer = PullConsumer(b.namesrv, "CG_trace")
    try:
        [mq] = await consumer.fetch_queues(TRACE)
        got = await consumer.pull(mq, 0, max_nums=8)
        assert [m.body for m in got.messages] == [b"trace-1"]
    finally:
        await consumer.shutdown()
