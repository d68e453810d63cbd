"""DELETE_TOPIC_IN_BROKER against a send already accepted: the store makes a topic without config again when a
record gives it a new queue (topics.queue_appeared), so the config must go with the queues, not before them."""
from __future__ import annotations

import asyncio

import pytest

from broker.processors.ops import delete_topic_in_broker
from broker.store import PutRequest
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from tests.support.bounded import bounded
from tests.unit.test_review_pull import make_ctx

pytestmark = [pytest.mark.asyncio]


@bounded(20)
async def test_a_send_accepted_before_a_delete_does_not_bring_the_topic_back(tmp_path):
    """The send's record waited for the writer while the delete forgot the config; written, it opened queue 3,
    which made the topic again (read-write, registered) -- and the delete then removed only its queues: the
    operator was told SUCCESS and the topic was back in the routes."""
    ctx = await make_ctx(tmp_path)
    store = ctx.store._store
    store.on_new_queue = ctx.topics.queue_appeared
    try:
        assert (await ctx.store.put(PutRequest.build("PT", b"m", queue_id=0))).ok
        cmd = RemotingCommand.request(RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": "PT"})
        put, resp = await asyncio.gather(ctx.store.put(PutRequest.build("PT", b"m", queue_id=3)),
                                         delete_topic_in_broker(ctx, None, cmd))
        assert put.ok and resp.code == ResponseCode.SUCCESS
        assert ctx.topics.get("PT") is None
        assert [k for k in store.queues() if k[0] == "PT"] == []
    finally:
        await store.close()
