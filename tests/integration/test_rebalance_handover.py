"""A queue given away by a rebalance, against the real broker: the old owner stops fetching, lets the
listener call in hand finish (within handover_grace_s), commits what was consumed and, orderly, only
then unlocks; a call past the grace is cancelled and its message comes again.

Each topic has one queue and two consumers share the group: "a-new" sorts before "b-old", so when the
new one joins, allocate_averagely gives it the queue (and the %RETRY% one) and the old one gives them up
while its listener holds m0."""
from __future__ import annotations

import asyncio

import pytest

from consumer import ConsumeStatus, PushConsumer
from tests.integration.test_client_shutdown import BODIES, _committed, _one_queue_topic
from tests.support.delays import FAST

pytestmark = pytest.mark.asyncio


class _Old:
    """The consumer that holds the queue first; its listener blocks on m0 until ``release``."""

    def __init__(self, namesrv: str, group: str, topic: str, *, returns: bool = True, **options):
        self.entered, self.release = asyncio.Event(), asyncio.Event()
        self.handing_over = asyncio.Event()     # the old consumer began giving ``topic``'s queue up (or cut m0)
        self.handing_over_at = self.cancelled_at = None
        self.finished, self.cancelled, self.cut = [], [], asyncio.Event()
        self.returns = returns
        self.consumer = PushConsumer(namesrv, group, self.listener, consume_from="first", suspend_ms=300,
                                     instance_name="b-old", offset_commit_interval_s=60, **options)
        self.consumer.subscribe(topic)
        self.commits, self.committed = [], asyncio.Event()     # the old consumer's commits of ``topic``'s queue
        write = self.consumer.offset_store.write

        async def traced_write(mq, offset):
            await write(mq, offset)
            if mq.topic == topic:
                self.commits.append(offset)
                self.committed.set()
        self.consumer.offset_store.write = traced_write
        real = getattr(self.consumer, "_hand_over", None)
        if real is not None:
            async def hand_over(leaving):
                # Only the topic's queue: a rebalance of the old consumer's own (run as it joined) may give the
                # %RETRY% queue away while it still counts itself alone for the topic, the list asked per topic.
                if any(q.topic == topic for q in leaving):
                    self.handing_over_at = asyncio.get_running_loop().time()
                    self.handing_over.set()
                return await real(leaving)
            self.consumer._hand_over = hand_over

    async def listener(self, msg):
        self.entered.set()
        try:
            await self.release.wait()
            if not self.returns:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled_at = asyncio.get_running_loop().time()
            self.cancelled.append(msg.body)
            if self.handing_over_at is None:    # the code before: cut at once, no hand-over
                self.handing_over_at = self.cancelled_at
            self.handing_over.set()
            self.cut.set()
            raise
        self.finished.append(msg.body)
        return ConsumeStatus.CONSUME_SUCCESS


class _New:
    """The consumer that joins; ``got`` is what it is given, ``enough`` is set after ``count``."""

    def __init__(self, namesrv: str, group: str, topic: str, count: int, **options):
        self.got, self.enough, self.count = [], asyncio.Event(), count
        self.consumer = PushConsumer(namesrv, group, self.listener, consume_from="first", suspend_ms=300,
                                     instance_name="a-new", **options)
        self.consumer.subscribe(topic)

    def listener(self, msg):
        self.got.append(msg.body)
        if len(self.got) >= self.count:
            self.enough.set()
        return ConsumeStatus.CONSUME_SUCCESS


async def test_a_concurrent_message_in_hand_is_finished_and_committed_not_consumed_again(broker_factory):
    broker = broker_factory(*FAST)
    topic = await _one_queue_topic(broker, "Handover")
    old = _Old(broker.namesrv, "CG_handover", topic, handover_grace_s=10)
    new = _New(broker.namesrv, "CG_handover", topic, 9)
    # A concurrent queue has no lock: its new owner reads where to start as soon as it takes the queue, so
    # a message the old owner still has in hand comes again (as in RocketMQ). Here it reads only after the
    # old owner's hand-over commit, which is what is tested: that commit includes the message in hand.
    start_offset = new.consumer._start_offset

    async def new_start_offset(mq):
        if mq.topic == topic:
            await old.committed.wait()
        return await start_offset(mq)
    new.consumer._start_offset = new_start_offset
    try:
        async with asyncio.timeout(30):
            await old.consumer.start()
            await old.entered.wait()
            await new.consumer.start()          # joins: the old consumer is told, and gives the queue up
            await old.handing_over.wait()
            assert old.cancelled == [], "the listener in hand was cancelled when its queue was given away"
            assert old.commits == []            # nothing committed while m0 is in hand
            old.release.set()
            await new.enough.wait()
            assert old.finished == [b"m0"] and old.cancelled == []
            assert old.commits == [1]
            assert await _committed(broker.namesrv, "CG_handover", topic) >= 1
            assert new.got == BODIES[1:]        # m0 not again, none lost
    finally:
        old.release.set()
        await new.consumer.shutdown()
        await old.consumer.shutdown()


async def test_an_orderly_queue_goes_to_its_new_owner_only_after_the_message_in_hand_and_the_unlock(
        broker_factory):
    broker = broker_factory()
    topic = await _one_queue_topic(broker, "OrderlyHandover")
    options = dict(orderly=True, lock_retry_s=0.1)
    old = _Old(broker.namesrv, "CG_orderly_handover", topic, handover_grace_s=10, **options)
    new = _New(broker.namesrv, "CG_orderly_handover", topic, 9, **options)
    unlocked = asyncio.Event()          # set as the old owner sends its unlock: nobody gets the lock before
    unlock = old.consumer.client.unlock_queues

    async def old_unlock(mqs):
        if any(q.topic == topic for q in mqs):
            unlocked.set()
        await unlock(mqs)
    old.consumer.client.unlock_queues = old_unlock
    refused = asyncio.Event()           # the new owner asked for the queue's lock and was refused
    lock = new.consumer.client.lock_queues

    async def new_lock(mqs):
        granted = await lock(mqs)
        if any(q.topic == topic and q not in granted for q in mqs):
            refused.set()
        return granted
    new.consumer.client.lock_queues = new_lock
    consumed_before_unlock = []

    def listener(msg):
        if not unlocked.is_set():
            consumed_before_unlock.append(msg.body)
        return _New.listener(new, msg)
    new.consumer.listener = listener
    try:
        async with asyncio.timeout(30):
            await old.consumer.start()
            await old.entered.wait()
            await new.consumer.start()
            await old.handing_over.wait()
            await refused.wait()                # the old owner holds the lock while m0 is in hand
            assert old.cancelled == [], "the listener in hand was cancelled when its queue was given away"
            assert new.got == [] and not unlocked.is_set()
            old.release.set()
            await new.enough.wait()
            assert old.finished == [b"m0"] and old.cancelled == []
            assert consumed_before_unlock == []
            assert await _committed(broker.namesrv, "CG_orderly_handover", topic) >= 1
            assert new.got == BODIES[1:]        # in order, after m0, none lost
    finally:
        old.release.set()
        await new.consumer.shutdown()
        await old.consumer.shutdown()


async def test_a_listener_past_the_handover_grace_is_cancelled_and_its_message_comes_again(broker_factory):
    broker = broker_factory()
    topic = await _one_queue_topic(broker, "HandoverLate")
    old = _Old(broker.namesrv, "CG_handover_late", topic, returns=False, handover_grace_s=0.3)
    new = _New(broker.namesrv, "CG_handover_late", topic, 10)
    try:
        async with asyncio.timeout(30):
            await old.consumer.start()
            await old.entered.wait()
            old.release.set()                   # the listener still never returns
            await new.consumer.start()          # joins: the old consumer gives the queue up
            await old.cut.wait()
            assert old.cancelled == [b"m0"] and old.finished == []
            assert old.cancelled_at - old.handing_over_at >= 0.3    # given its grace, then cut
            await new.enough.wait()
            assert new.got == BODIES            # m0 again, then the rest
            await old.committed.wait()
            assert old.commits == [0]           # the hand-over committed nothing past m0
    finally:
        await new.consumer.shutdown()
        await old.consumer.shutdown()


async def test_shutdown_during_a_handover_still_finishes_commits_and_unlocks_the_queue(broker_factory):
    """Shutdown cancels the rebalance waiting on a hand-over: the hand-over still ends (the message in hand
    finished within shutdown's grace, committed, the orderly queue unlocked), so its new owner goes on."""
    broker = broker_factory()
    topic = await _one_queue_topic(broker, "HandoverStop")
    options = dict(orderly=True, lock_retry_s=0.1)
    old = _Old(broker.namesrv, "CG_handover_stop", topic, handover_grace_s=10, shutdown_grace_s=10, **options)
    new = _New(broker.namesrv, "CG_handover_stop", topic, 9, **options)
    try:
        async with asyncio.timeout(30):
            await old.consumer.start()
            await old.entered.wait()
            await new.consumer.start()
            await old.handing_over.wait()
            stopping = asyncio.get_running_loop().create_task(old.consumer.shutdown())
            while not old.consumer.shutting_down:
                await asyncio.sleep(0)
            assert old.cancelled == [] and new.got == []
            old.release.set()
            await stopping
            assert old.finished == [b"m0"] and old.cancelled == []
            assert await _committed(broker.namesrv, "CG_handover_stop", topic) >= 1
            await new.enough.wait()             # unlocked at once: lock_expire would be 60 s on the broker
            assert new.got == BODIES[1:]
    finally:
        old.release.set()
        await new.consumer.shutdown()
        if not old.consumer.shutting_down:
            await old.consumer.shutdown()
