"""SIGKILL the broker while push consumers of one group consume a stream, some messages failing once.

The producer keeps sending while the broker is killed and restarted (same store, same ports)
three times, paced by progress: one kill after every KILL_EVERY messages consumed. Between the
second and third kill one consumer leaves and a new one joins, so queues move while the broker's
offsets are being rebuilt. A message whose first delivery fails goes back through %RETRY% (fast
delay levels). At the end every acknowledged send is consumed successfully at least once, none is
lost in a retry hand-back cut by a kill, and the group's committed offsets reach every queue's end
(a consumer that stalled after a restart would leave its queues behind, with nothing said).
"""
from __future__ import annotations

import asyncio
import zlib
from collections import Counter

import pytest

from consumer import ConsumeStatus, PushConsumer
from producer import Producer
from protocol.errors import BrokerError
from tests.support.delays import FAST
from tests.support.offsets import queues_behind

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

TOTAL = 1200
KILLS = 3
KILL_EVERY = 250        # messages consumed successfully between kills
TOPIC = "ConsKill"
GROUP = "CG_kill"


def _fails_first(body: bytes) -> bool:
    return zlib.crc32(body) % 16 == 0            # ~6% go back through %RETRY% once


async def _committed_everywhere(namesrv: str) -> list[tuple[int, int | None, int]]:
    """(queue, committed, max) of every queue of TOPIC whose committed offset is behind its end."""
    return await queues_behind(namesrv, GROUP, TOPIC)


async def test_consumers_lose_nothing_across_broker_kills_and_a_rebalance(broker_factory):
    b = broker_factory(*FAST)
    fixed = ("--port", str(b.broker_port), "--namesrv-port", b.namesrv.rsplit(":", 1)[1], *FAST)
    namesrv = b.namesrv
    brokers = [b]
    acked: set[bytes] = set()
    attempts: Counter[bytes] = Counter()
    succeeded: set[bytes] = set()
    progress = asyncio.Event()
    up = asyncio.Event()
    up.set()
    sent = kills = failed_sends = 0

    def listener(msg):
        attempts[msg.body] += 1
        if msg.reconsume_times == 0 and _fails_first(msg.body):
            return ConsumeStatus.RECONSUME_LATER
        succeeded.add(msg.body)
        progress.set()
        return ConsumeStatus.CONSUME_SUCCESS

    def consumer(name: str) -> PushConsumer:
        c = PushConsumer(namesrv, GROUP, listener, consume_from="first", rebalance_interval_s=1.0,
                         offset_commit_interval_s=0.2, suspend_ms=1000, local_retry_delay_s=0.2,
                         instance_name=name)
        c.subscribe(TOPIC)
        return c

    producer = Producer(namesrv, "PG_kill", retries=0, send_timeout=2.0)
    async with asyncio.timeout(60):
        await producer.start()
        await producer.send(TOPIC, b"warm-up")          # makes the topic before any consumer looks for it
    acked.add(b"warm-up")
    consumers = [consumer("c1"), consumer("c2")]
    for c in consumers:
        await c.start()

    async def send_all():
        nonlocal sent, failed_sends
        while sent < TOTAL:
            body = f"m-{sent}".encode()
            sent += 1
            try:
                await producer.send(TOPIC, body)
            except (BrokerError, OSError, TimeoutError):
                failed_sends += 1               # may or may not be stored: not required, may be consumed
                await up.wait()
                continue
            acked.add(body)

    async def killer():
        nonlocal kills
        while kills < KILLS:
            target = (kills + 1) * KILL_EVERY
            while len(succeeded) < target:      # progress, not time
                progress.clear()
                await progress.wait()
            up.clear()
            brokers[-1].kill()
            kills += 1
            if kills == 2:                      # one consumer leaves while the broker is down ...
                await consumers.pop(0).shutdown()
            brokers.append(await asyncio.to_thread(broker_factory, *fixed))
            up.set()
            if kills == 2:                      # ... and another joins (start needs a name server)
                consumers.append(consumer("c3"))
                await consumers[-1].start()

    behind = None
    try:
        async with asyncio.timeout(240):
            await asyncio.gather(send_all(), killer())
            while not acked <= succeeded:
                progress.clear()
                await progress.wait()
            behind = await _committed_everywhere(namesrv)
            while behind:                       # the commit loops catch up within a few of their rounds
                await asyncio.sleep(0.2)
                behind = await _committed_everywhere(namesrv)
    except TimeoutError:
        missing = sorted(acked - succeeded)
        pytest.fail(f"stalled: {kills} kills, {len(missing)} acknowledged never consumed (first {missing[:5]}), "
                    f"queues behind (id, committed, end): {behind}")
    for c in consumers:
        await c.shutdown()
    await producer.shutdown()
    assert kills == KILLS, "the broker must actually have been killed mid-stream"
    assert acked <= succeeded, f"{len(acked - succeeded)} acknowledged messages never consumed"
    retried = [body for body in acked if _fails_first(body)]
    assert retried and all(attempts[body] >= 2 for body in retried)
    dups = sum(n - 1 for body, n in attempts.items() if n > 1 and not _fails_first(body))
    print(f"{sent} sent, {failed_sends} failed, {len(acked)} acked, {len(succeeded)} consumed, "
          f"{len(retried)} retried once, {dups} redelivered after a kill")


async def test_an_idle_queue_offset_lost_to_a_kill_is_committed_again(broker_factory):
    """The broker saves committed offsets every --flush-consumer-offset-interval-ms; a kill -9 loses the
    commits since. The push consumer committed an offset only when it changed, so a queue with nothing
    new after the restart kept its old offset on the broker for good: the next consumer to take it
    (a rebalance, a restart of the group) consumed everything since again. It now commits its position
    every round, as RocketMQ's client does."""
    flags = ("--flush-consumer-offset-interval-ms", "600000", *FAST)      # the kill surely loses them
    b = broker_factory(*flags)
    fixed = ("--port", str(b.broker_port), "--namesrv-port", b.namesrv.rsplit(":", 1)[1], *flags)
    consumed: set[bytes] = set()
    all_in = asyncio.Event()

    def listener(msg):
        consumed.add(msg.body)
        if len(consumed) == 20:
            all_in.set()
        return ConsumeStatus.CONSUME_SUCCESS

    async with Producer(b.namesrv, "PG_idle") as producer:
        for i in range(20):
            await producer.send(TOPIC, f"i-{i}".encode())
    c = PushConsumer(b.namesrv, GROUP, listener, consume_from="first", offset_commit_interval_s=0.2,
                     suspend_ms=1000)
    c.subscribe(TOPIC)
    behind = None
    try:
        async with asyncio.timeout(60):
            await c.start()
            await all_in.wait()
            while await _committed_everywhere(b.namesrv):     # committed, in the broker's memory only
                await asyncio.sleep(0.1)
            b.kill()
            b2 = await asyncio.to_thread(broker_factory, *fixed)
            assert await _committed_everywhere(b2.namesrv), "the kill was to lose the commits"
            behind = await _committed_everywhere(b2.namesrv)
            while behind:
                await asyncio.sleep(0.2)
                behind = await _committed_everywhere(b2.namesrv)
    except TimeoutError:
        pytest.fail(f"queues left behind after the restart (id, committed, end): {behind}")
    finally:
        await c.shutdown()
    assert len(consumed) == 20
