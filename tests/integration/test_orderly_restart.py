"""An orderly consumer across a broker restart (kill -9, started again on the same ports), against the real
broker: the queue locks it held died with the broker, and another consumer of the group may lock them there."""
from __future__ import annotations

import asyncio
import logging

import pytest

from consumer import ConsumeStatus, PushConsumer
from producer import Producer
from tests.support.bounded import bounded
from tests.support.cluster_process import create_topic

pytestmark = pytest.mark.asyncio


@bounded(90)
async def test_an_orderly_consumer_trusts_no_lock_of_a_broker_it_lost_its_connection_to(broker_factory, caplog):
    """A restarted broker holds no queue lock. The consumer that held them went on trusting its own for up to
    lock_expire_s (renewing them only every lock_interval_s), and went on consuming, while a consumer the
    restarted broker met first (before the first one's next heartbeat) took every queue and was granted their
    locks: two consumers of one orderly queue at once, out of order, with nothing said. A lost connection now
    ends the trust in the locks its broker granted (WARNING), and they are asked for again at once."""
    b = broker_factory()
    fixed = ("--port", str(b.broker_port), "--namesrv-port", b.namesrv.rsplit(":", 1)[1])
    topic, group = "OrderlyRestart", "CG_orderly_restart"
    got: dict[str, list[bytes]] = {"first": [], "second": []}
    probed = asyncio.Event()

    def listener(name):
        def consume(msg):
            got[name].append(msg.body)
            if name == "first" and msg.body.startswith(b"probe") and \
                    sum(m.startswith(b"probe") for m in got["first"]) >= 4:
                probed.set()
            return ConsumeStatus.CONSUME_SUCCESS
        return consume

    def orderly(name):
        # The first renews its locks once a minute and trusts them for two: on its own it trusts them all
        # through this test; rebalancing once a minute, it does not heartbeat the restarted broker meanwhile.
        consumer = PushConsumer(b.namesrv, group, listener(name), orderly=True, consume_from="first",
                                suspend_ms=300, lock_interval_s=60, lock_expire_s=120, lock_retry_s=0.2,
                                rebalance_interval_s=60)
        consumer.subscribe(topic)
        return consumer

    async with Producer(b.namesrv, "PG_orderly_restart") as producer:
        await create_topic(b.broker, topic, 4)          # saved when answered: a kill -9 keeps it
        queues = await producer.routes.publish_queues(topic)
        assert len(queues) == 4
        first = orderly("first")
        rebalanced = []
        rebalance = first.rebalance

        async def counted():
            await rebalance()
            rebalanced.append(True)
        first.rebalance = counted
        await first.start()
        second = None
        try:
            assert {q.queue_id for q in first.locked_queues if q.topic == topic} == {0, 1, 2, 3}
            # and its %RETRY% queue (routed once the group's first heartbeat made it): a queue not locked yet
            # has the lock loop ask every lock_retry_s, for every queue
            # and the rebalance its own joining asks for (the broker's NOTIFY_CONSUMER_IDS_CHANGED, sent before
            # the answer to its first heartbeat) is over: nothing of it asks the restarted broker for locks
            while first.locked_queues != first._owned or len(rebalanced) < 2:
                await asyncio.sleep(0.05)
            b.kill()
            b = broker_factory(*fixed)
            # the first consumes again after the restart: a probe on every queue, sent now, reaches it
            await asyncio.gather(*(producer.send(topic, b"probe%d" % q.queue_id, queue=q) for q in queues))
            await probed.wait()
            second = await orderly("second").start()     # the restarted broker knows only it: it takes every queue
            both = {q.queue_id for q in first.locked_queues & second.locked_queues if q.topic == topic}
            assert not both, f"two consumers take themselves for the holders of the locks of queues {sorted(both)}"
        finally:
            if second is not None:
                await second.shutdown()
            await first.shutdown()
    assert any(r.levelno == logging.WARNING and "no longer trusted" in r.getMessage() for r in caplog.records)
