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


@bounded(20)
async def test_a_delete_cancelled_while_the_store_runs_it_still_forgets_the_topics_offsets(tmp_path, monkeypatch):
    """A delete whose caller is cancelled while the writer runs it (a stop closing the admin's connection after the
    grace, its queue files being removed behind a slow disk) is finished by the writer: config and queues gone. The
    offsets, the metrics and the moves went after it, in the caller, which never ran again: the topic's consumer
    offsets were saved at the stop, and a topic of that name made later found its groups at the old positions."""
    import threading

    from broker.store import store as store_mod
    ctx = await make_ctx(tmp_path)
    store = ctx.store._store
    removing, gate = threading.Event(), threading.Event()
    real = store_mod._remove_queue_files

    def slow_remove(*args):
        removing.set()
        assert gate.wait(10), "the test never opened the gate"
        return real(*args)
    monkeypatch.setattr(store_mod, "_remove_queue_files", slow_remove)
    try:
        assert (await ctx.store.put(PutRequest.build("PT", b"m", queue_id=0))).ok
        ctx.offsets.commit("CG", "PT", 0, 1)
        cmd = RemotingCommand.request(RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": "PT"})
        deleting = asyncio.ensure_future(delete_topic_in_broker(ctx, None, cmd))
        assert await asyncio.to_thread(removing.wait, 10)       # the writer runs it: the config already gone
        deleting.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await deleting
        assert (await ctx.store.put(PutRequest.build("Other", b"m", queue_id=0))).ok    # after the delete's end
        assert ctx.topics.get("PT") is None and [k for k in store.queues() if k[0] == "PT"] == []
        assert ctx.offsets.get("CG", "PT", 0) is None, "the deleted topic's offsets kept"
    finally:
        gate.set()
        await store.close()
