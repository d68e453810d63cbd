"""A consumer's subVersion (its heartbeats'): the broker keeps a group's subscription with the newest one."""
from __future__ import annotations

import json

import consumer.pull_consumer as pull_consumer
from consumer import PullConsumer
from protocol.codes import ResponseCode
from tests.support.bounded import bounded


class _Answered:
    code, remark = ResponseCode.SUCCESS, ""


@bounded(10)
async def test_a_heartbeat_after_the_wall_clock_stepped_back_still_has_the_newest_subscription_version(monkeypatch):
    """By the wall clock alone, a heartbeat after a step back of an hour carried a subVersion an hour older than the
    last, and a broker (stock or ours) kept the subscription it had: a change made then was kept out, its messages
    filtered by the old expression. Each heartbeat's version is later than the last one's."""
    consumer = PullConsumer("127.0.0.1:1", "CG_version")
    consumer._brokers = {"b": "127.0.0.1:2"}
    sent: list[int] = []

    async def request(addr, cmd, timeout):
        sent.append(json.loads(cmd.body)["consumerDataSet"][0]["subscriptionDataSet"][0]["subVersion"])
        return _Answered()
    monkeypatch.setattr(consumer.pool, "request", request)
    wall = [1_700_000_000.0]
    monkeypatch.setattr(pull_consumer.time, "time", lambda: wall[0])
    consumer.subscriptions["T"] = "A"
    await consumer.heartbeat()
    wall[0] -= 3600                                     # stepped back an hour
    consumer.subscriptions["T"] = "B"
    await consumer.heartbeat()
    await consumer.heartbeat()
    wall[0] += 7200
    await consumer.heartbeat()
    assert sent[0] == 1_700_000_000_000
    assert sent[0] < sent[1] < sent[2] < sent[3] == 1_700_003_600_000, sent
