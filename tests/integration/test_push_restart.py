"""Push consumers across a broker restart (kill -9, started again on the same port and store), against the real
broker: a restarted broker knows a consumer again only from its heartbeat."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal

import pytest

from consumer import ConsumeStatus, PushConsumer
from producer import Producer
from tests.support.bounded import bounded
from tests.support.cluster_process import create_topic

pytestmark = pytest.mark.asyncio

QUEUES = 4


def _consumer(b, topic, group, got, consumed, **kw):
    def consume(msg):
        got[msg.body] += 1
        consumed.set()
        return ConsumeStatus.CONSUME_SUCCESS
    consumer = PushConsumer(b.namesrv, group, consume, consume_from="first", offset_commit_interval_s=0.2, **kw)
    consumer.subscribe(topic)
    return consumer


async def _until(condition, changed: asyncio.Event):
    """Wait, event by event, for ``condition()``: paced by consumption, not by a clock."""
    while not condition():
        changed.clear()
        await changed.wait()


async def _members(consumer: PushConsumer, topic: str) -> set[str]:
    try:
        mq = (await consumer.client.fetch_queues(topic))[0]
        return set(await consumer.client.consumer_ids(mq))
    except Exception:  # noqa: BLE001 - the broker not back yet
        return set()


def _saved(b, group: str, topic: str) -> dict[str, int]:
    """The group's offsets of ``topic`` as the broker's offsets file holds them now."""
    try:
        table = json.loads((b.store_dir / "config" / "consumerOffset.json").read_text())
    except (OSError, ValueError):       # not written yet, or caught half-way through its replacement
        return {}
    return table.get("offsetTable", table).get(f"{topic}@{group}", {})


@bounded(60)
async def test_push_consumers_heartbeat_a_restarted_broker_at_once_not_at_their_next_rebalance(broker_factory,
                                                                                             caplog):
    """After its broker restarted, a push consumer heartbeat it only at its next rebalance (rebalance_interval_s,
    20 s by default; 120 s here): until then the broker listed only the consumers whose rebalance came first, they
    took every queue, and the queues' messages were consumed twice. A lost connection now makes the consumer
    heartbeat at once (again after a back-off while the broker is down, one WARNING for the outage), then
    rebalance: the restarted broker lists both consumers, each keeps its own queues, nothing is consumed twice."""
    caplog.set_level(logging.DEBUG, logger="txmq.consumer")
    # offsets saved within 50 ms: what the kill loses is not what this test is about
    b = broker_factory("--flush-consumer-offset-interval-ms", "50")
    fixed = ("--flush-consumer-offset-interval-ms", "50", "--port", str(b.broker_port),
             "--namesrv-port", b.namesrv.rsplit(":", 1)[1])
    topic, group = "PushRestart", "CG_push_restart"
    got: collections.Counter = collections.Counter()
    consumed = asyncio.Event()
    async with Producer(b.namesrv, "PG_push_restart") as producer:
        await create_topic(b.broker, topic, QUEUES)      # saved when answered: a kill -9 keeps it
        queues = await producer.routes.publish_queues(topic)
        # The first rebalances every two minutes: on its own it never heartbeats the restarted broker in this test.
        # The second rebalances every second, as a member whose periodic rebalance comes first after the restart.
        first = await _consumer(b, topic, group, got, consumed, rebalance_interval_s=120).start()
        second = await _consumer(b, topic, group, got, consumed, rebalance_interval_s=1).start()
        try:
            def split():
                mine = {q for q in first._owned if q.topic == topic}
                theirs = {q for q in second._owned if q.topic == topic}
                return len(mine) == len(theirs) == QUEUES // 2 and not mine & theirs
            while not split():      # the first hears of the second from the broker (NOTIFY_CONSUMER_IDS_CHANGED)
                await asyncio.sleep(0.05)
            before = [b"before-%d-%d" % (q.queue_id, i) for q in queues for i in range(5)]
            for body, q in zip(before, [q for q in queues for _ in range(5)]):
                await producer.send(topic, body, queue=q)
            await _until(lambda: all(got[m] for m in before), consumed)
            while _saved(b, group, topic) != {str(q.queue_id): 5 for q in queues}:     # committed, and on disk
                await asyncio.sleep(0.05)
            b.kill()
            b = broker_factory(*fixed)
            ids = {first.client.client_id, second.client.client_id}
            while await _members(second, topic) != ids:
                await asyncio.sleep(0.05)
            while not split() or first._leaving or second._leaving:    # the rebalances both asked for are done
                await asyncio.sleep(0.05)
            after = [b"after-%d-%d" % (q.queue_id, i) for q in queues for i in range(5)]
            for body, q in zip(after, [q for q in queues for _ in range(5)]):
                await producer.send(topic, body, queue=q)
            await _until(lambda: all(got[m] for m in after), consumed)
        finally:
            await second.shutdown()
            await first.shutdown()
    twice = sorted(m for m in (*before, *after) if got[m] > 1)
    assert not twice, f"{len(twice)} message(s) consumed twice: {twice}"
    assert first.beats_failed == second.beats_failed == 0
    beat_warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                     and r.getMessage().startswith(f"heartbeat of {group} failed")]
    assert len(beat_warnings) <= 2, "one WARNING per consumer for the outage"


@bounded(60)
async def test_a_push_consumer_backs_off_and_warns_once_while_its_broker_stays_down(broker_factory, caplog):
    """While its broker is down the consumer beats again after a back-off (0.5 s doubling up to 4 s, jittered), never in a
    tight loop, says so once (WARNING) and not at every attempt, and rebalances only when a beat is heard (or its
    own time comes): once the broker is back, it beats, is listed and consumes again."""
    caplog.set_level(logging.DEBUG, logger="txmq.consumer")
    b = broker_factory()
    fixed = ("--port", str(b.broker_port), "--namesrv-port", b.namesrv.rsplit(":", 1)[1])
    topic, group = "PushDown", "CG_push_down"
    got: collections.Counter = collections.Counter()
    consumed = asyncio.Event()
    await create_topic(b.broker, topic, QUEUES)
    consumer = _consumer(b, topic, group, got, consumed, rebalance_interval_s=120)
    attempts: list[tuple[float, bool]] = []
    rebalances = []
    attempted = asyncio.Event()
    heartbeat, rebalance = consumer._heartbeat, consumer.rebalance

    async def counted_heartbeat(only=None):
        loop = asyncio.get_running_loop()
        try:
            await heartbeat(only)
            attempts.append((loop.time(), True))
        except Exception:
            attempts.append((loop.time(), False))
            raise
        finally:
            attempted.set()

    async def counted_rebalance():
        rebalances.append(len(attempts))
        await rebalance()
    consumer._heartbeat, consumer.rebalance = counted_heartbeat, counted_rebalance
    await consumer.start()
    try:
        b.kill()
        start = len(attempts)
        await _until(lambda: sum(not ok for _, ok in attempts[start:]) >= 5, attempted)
        failed = [t for t, ok in attempts[start:] if not ok]
        # each wait at least half its back-off (0.5, 1, 2, 4 s, jittered over their second halves: clients that
        # failed together retry apart): a slower machine only makes them longer
        assert failed[4] - failed[0] >= (0.5 + 1 + 2 + 4) / 2 - 0.1
        assert all(ok is False for _, ok in attempts[start:])
        beat_warnings = [r for r in caplog.records if r.levelno >= logging.WARNING
                         and r.getMessage().startswith(f"heartbeat of {group} failed")]
        assert len(beat_warnings) == 1, [r.getMessage() for r in beat_warnings]
        # the turn the lost connection asked for rebalanced; the retries after it did not
        assert len([n for n in rebalances if n > start]) <= 1
        b = broker_factory(*fixed)
        while await _members(consumer, topic) != {consumer.client.client_id}:
            await asyncio.sleep(0.05)
        q = (await consumer.client.fetch_queues(topic))[0]
        async with Producer(b.namesrv, "PG_push_down") as producer:
            await producer.send(topic, b"back", queue=q)
        await _until(lambda: got[b"back"], consumed)
        assert consumer.beats_failed == 0
        assert any(r.getMessage().startswith(f"heartbeat of {group} heard again") for r in caplog.records)
    finally:
        await consumer.shutdown()


@bounded(60)
async def test_a_replaced_connections_late_close_still_makes_the_consumer_heartbeat(broker_factory):
    """A connection the client closed itself (a malformed frame) whose close ends late, once a new connection to
    the broker was made: the broker drops the consumer's channel when that old connection closes, and lists it
    again only after a heartbeat on the new one. The pool stopped reporting such a close (it is no longer the
    address's current connection): the consumer heartbeat only at its next rebalance (120 s here), the broker
    listing the group without it meanwhile -- its queues taken by the others, consumed twice."""
    b = broker_factory()
    topic, group = "LateClose", "CG_late_close"
    got: collections.Counter = collections.Counter()
    await create_topic(b.broker, topic, QUEUES)
    consumer = _consumer(b, topic, group, got, asyncio.Event(), rebalance_interval_s=120)
    beats = []
    beaten = asyncio.Event()
    heartbeat = consumer._heartbeat

    async def counted_heartbeat(only=None):
        await heartbeat(only)
        beats.append(consumer.client.pool.cached(b.broker))
        beaten.set()
    consumer._heartbeat = counted_heartbeat
    await consumer.start()
    try:
        me = {consumer.client.client_id}
        assert await _members(consumer, topic) == me
        pool = consumer.client.pool
        old = pool.cached(b.broker)
        os.kill(b.proc.pid, signal.SIGSTOP)     # reads nothing: what the client writes waits in its buffer
        try:
            old.transport.write(b"\0" * (16 << 20))
            old.close()                         # what a malformed frame does: no longer open, not closed yet
            assert not old.closed.is_set()
            new = await pool.get(b.broker)      # the kernel completes the handshake for the stopped broker
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        await old.closed.wait()                 # the broker read it, and dropped the consumer's channel
        beats.clear()
        beaten.clear()
        async with asyncio.timeout(30):         # a quarter of rebalance_interval_s: only a prompt beat is in time
            while not beats or beats[-1] is not new:
                await beaten.wait()
                beaten.clear()
        assert await _members(consumer, topic) == me, "the broker lists the group without the consumer"
    finally:
        await consumer.shutdown()


@bounded(60)
async def test_a_push_consumer_shut_down_during_its_back_off_ends_and_leaves_no_task(broker_factory):
    """Shut down while its heartbeat backs off (the broker down): the back-off is cut short, shutdown returns,
    and no loop of the consumer is left running."""
    b = broker_factory()
    topic, group = "PushDownStop", "CG_push_down_stop"
    got: collections.Counter = collections.Counter()
    await create_topic(b.broker, topic, QUEUES)
    consumer = _consumer(b, topic, group, got, asyncio.Event(), rebalance_interval_s=120)
    failed = asyncio.Event()
    heartbeat = consumer._heartbeat

    async def counted_heartbeat(only=None):
        try:
            await heartbeat(only)
        except Exception:
            if consumer.beats_failed >= 1:      # this one is the second failure in a row: backing off now
                failed.set()
            raise
    consumer._heartbeat = counted_heartbeat
    await consumer.start()
    b.kill()
    await failed.wait()
    tasks = set(consumer._tasks)
    await consumer.shutdown()
    assert all(t.done() for t in tasks)
    assert not [t for t in asyncio.all_tasks() if "_rebalance_loop" in repr(t.get_coro()) and not t.done()]


@bounded(60)
async def test_a_push_consumers_commit_rounds_go_oneway_as_a_java_consumers_persist_all(broker_factory):
    """The commit loop's rounds went answered; RocketMQ's persistAll sends them oneway (RemoteBrokerOffsetStore,
    isOneway true). Answered, a round reaching a restarted broker on a connection it had seen no heartbeat or pull
    of the group on yet was taken for an admin tool's moves: each commit waited for a save of the broker's offsets
    (past 256 of an address, its next periodic save), queue after queue. The rounds go oneway now, and the
    broker's offsets file holds what was consumed all the same; shutdown's commits are still answered."""
    from protocol.codes import RequestCode
    b = broker_factory("--flush-consumer-offset-interval-ms", "50")
    topic, group = "PushOneway", "CG_push_oneway"
    got: collections.Counter = collections.Counter()
    consumed = asyncio.Event()
    async with Producer(b.namesrv, "PG_push_oneway") as producer:
        await create_topic(b.broker, topic, QUEUES)
        queues = await producer.routes.publish_queues(topic)
        consumer = _consumer(b, topic, group, got, consumed)
        answered = []
        request = consumer.client.pool.request

        async def recording(addr, cmd, timeout):
            if cmd.code == RequestCode.UPDATE_CONSUMER_OFFSET:
                answered.append(cmd)
            return await request(addr, cmd, timeout)
        consumer.client.pool.request = recording
        await consumer.start()
        try:
            sent = [b"oneway-%d-%d" % (q.queue_id, i) for q in queues for i in range(3)]
            for body, q in zip(sent, [q for q in queues for _ in range(3)]):
                await producer.send(topic, body, queue=q)
            await _until(lambda: all(got[m] for m in sent), consumed)
            while _saved(b, group, topic) != {str(q.queue_id): 3 for q in queues}:     # committed, and on disk
                await asyncio.sleep(0.05)
            by_rounds = list(answered)
        finally:
            await consumer.shutdown()
    assert by_rounds == [], f"{len(by_rounds)} answered commit(s) by the commit loop's rounds"
    assert answered, "shutdown's commits are answered"
