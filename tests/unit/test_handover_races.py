"""PushConsumer hand-over races on the event loop, without a broker: a queue given away by one rebalance
and taken back by another while its old pull loop still has a message in hand."""
from __future__ import annotations

import asyncio

import pytest

from consumer import ConsumeStatus, PushConsumer
from consumer.pull_consumer import MessageQueue, PullResult, PullStatus
from protocol.message import MessageExt
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


@bounded(20)
async def test_a_queue_taken_back_during_its_hand_over_is_consumed_again_once_the_hand_over_ends():
    """``rebalance()`` is public: one called while the loop's own waits on a hand-over can take the queue
    back. Its pull loop was started at once and, the queue still leaving, ended before its first pull,
    left in ``_loops`` as a finished task that no later rebalance replaced: the queue stopped for good."""
    mq = MessageQueue("T", "b", 0)
    release = asyncio.Event()
    in_hand = asyncio.Event()
    pulls = []

    async def listener(msg):
        in_hand.set()
        await release.wait()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer("127.0.0.1:1", "G", listener, handover_grace_s=10)
    consumer.subscribe("T")
    me = consumer.client.client_id
    ids = [me]

    async def fetch_queues(topic):
        return [mq] if topic == "T" else []

    async def consumer_ids(q):
        return list(ids)

    stored = {mq: 0}            # the broker's committed offsets

    async def start_offset(q):
        return stored[q]

    async def pull(q, offset, **kw):
        pulls.append(offset)
        if offset == 0:
            return PullResult(PullStatus.FOUND, 1, 0, 1, [MessageExt("T", b"m0", queue_offset=0)])
        await asyncio.Event().wait()        # a long poll with nothing new

    async def write(q, offset):
        stored[q] = offset
    consumer.client.fetch_queues, consumer.client.consumer_ids = fetch_queues, consumer_ids
    consumer.client.pull = pull
    consumer._start_offset = start_offset
    consumer.offset_store.write = write
    first = None
    try:
        await consumer.rebalance()
        await in_hand.wait()
        ids[:] = ["!", me]                  # "!" sorts first: it gets the queue
        first = asyncio.get_running_loop().create_task(consumer.rebalance())
        while mq not in consumer._leaving:
            await asyncio.sleep(0)
        ids[:] = [me]
        await consumer.rebalance()          # taken back while m0 is still in hand
        release.set()
        await first
        for _ in range(100):
            if pulls[-1:] == [1]:
                break
            await asyncio.sleep(0.01)
        assert mq in consumer._loops and not consumer._loops[mq].done(), "the queue taken back has no pull loop"
        assert pulls == [0, 1], "the queue taken back is not pulled again after its hand-over, from its commit"
    finally:
        release.set()
        if first is not None:
            await asyncio.gather(first, return_exceptions=True)
        await consumer.shutdown()


@bounded(20)
async def test_a_message_that_could_not_be_handed_back_is_not_given_to_the_listener_again_once_halted():
    """RECONSUME_LATER, and the broker does not take the message back: it is retried here after
    local_retry_delay_s. A hand-over or shutdown that began meanwhile leaves it uncommitted for the next
    consumer; the listener was called on it once more first (a new call after "no new message")."""
    from protocol.errors import ConnectionClosedError
    mq = MessageQueue("T", "b", 0)
    calls = []

    def listener(msg):
        calls.append(msg.body)
        return ConsumeStatus.RECONSUME_LATER

    consumer = PushConsumer("127.0.0.1:1", "G", listener, local_retry_delay_s=0.3, shutdown_grace_s=10)
    handed_back = asyncio.Event()

    async def send_back(q, msg, **kw):
        handed_back.set()
        raise ConnectionClosedError("the broker went away")

    async def pull(q, offset, **kw):
        if offset == 0:
            return PullResult(PullStatus.FOUND, 1, 0, 1, [MessageExt("T", b"m0", queue_offset=0)])
        await asyncio.Event().wait()

    async def start_offset(q):
        return 0
    writes = []

    async def write(q, offset):
        writes.append(offset)
    consumer.client.send_back, consumer.client.pull = send_back, pull
    consumer._start_offset = start_offset
    consumer.offset_store.write = write
    consumer._owned = {mq}
    consumer._start_loop(mq)
    await handed_back.wait()            # the listener said later, the hand-back failed: waiting to retry
    await consumer.shutdown()
    assert calls == [b"m0"], "the listener was called again after shutdown began"
    assert writes == [0], "m0 was committed though not consumed"
