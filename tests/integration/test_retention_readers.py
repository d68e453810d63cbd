"""Readers still pointing into segments retention removed, through the real broker process.

Every disk is "above the clean ratio" here and a sealed segment expires about a second after its newest
record (--file-reserved-hours 0.0003), so the broker removes its sealed segments by itself; each test
waits for that by the broker's own commitLogMinOffset, never by a clock.
"""
from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import pytest

from consumer import PullConsumer
from consumer.pull_consumer import PullStatus
from producer import Producer
from producer.producer import SendStatus
from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from protocol.connection import ConnectionPool
from protocol.errors import MessageIllegalError
from tests.support.cluster_process import stored_count

pytestmark = pytest.mark.asyncio

SEGMENT = 262144
EXPIRING = ("--segment-size", str(SEGMENT), "--max-message-size", "16384", "--disk-clean-ratio", "0.0001",
            "--disk-force-clean-ratio", "0.9999", "--disk-refuse-ratio", "1.0", "--file-reserved-hours", "0.0003",
            "--disk-clean-interval-s", "0.2")


async def _min_offset(b) -> int:
    pool = ConnectionPool()
    try:
        info = await pool.request(b.broker, RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO), 5.0)
        return int(json.loads(info.body_bytes())["table"]["commitLogMinOffset"])
    finally:
        await pool.close()


async def _until_removed(b, below: int) -> None:
    """Until the broker's log starts at or past ``below`` (bounded by the caller's timeout)."""
    while await _min_offset(b) < below:
        await asyncio.sleep(0.1)


async def _fill_until_removed(b, group: str, topic: str):
    """About 600 KB sent to one queue of ``topic``, then until retention removed its first two segments: its queue."""
    async with Producer(b.namesrv, group) as producer:
        mq = (await producer.send(topic, b"m" * 1000)).queue
        for _ in range(0, 600, 50):
            await asyncio.gather(*(producer.send(topic, b"m" * 1000, queue=mq) for _ in range(50)))
    await _until_removed(b, 2 * SEGMENT)
    return mq


def _scrape(b, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}(\{{[^}}]*\}}) (\S+)$", text, re.M)}


async def test_a_consumer_moved_past_messages_retention_removed_is_counted_and_logged(broker_factory):
    """A group far behind pulls at an offset whose segment is gone: PULL_OFFSET_MOVED takes it to the queue's
    minimum, as RocketMQ does. The messages between were never read by it; the answer alone said so to nobody
    but the client, which moves on without a word. The broker counts them
    (txmq_pull_offset_moved_messages_total{topic, consumer_group}) once, however often it asks again before it
    takes the correction, and logs the move at WARNING. A group with no
    offset stored there (its first pull) lost nothing and is neither counted nor said."""
    b = broker_factory(*EXPIRING)
    async with asyncio.timeout(60):
        async with Producer(b.namesrv, "PG_behind") as producer:
            mq = (await producer.send("Behind", b"m" * 1000)).queue
            for _ in range(0, 600, 50):
                await asyncio.gather(*(producer.send("Behind", b"m" * 1000, queue=mq) for _ in range(50)))
        await _until_removed(b, 2 * SEGMENT)       # two sealed segments gone: hundreds of unread messages
        async with PullConsumer(b.namesrv, "CG_behind") as consumer:
            await consumer.fetch_queues("Behind")
            await consumer.commit_offset(mq, 5)             # consumed a little, then fell behind
            res = await consumer.pull(mq, 5)
            assert res.status is PullStatus.OFFSET_ILLEGAL
            first = res.next_begin_offset
            assert first == res.min_offset > 5
            again = await consumer.pull(mq, 5)              # asked again before taking the correction
            assert again.status is PullStatus.OFFSET_ILLEGAL and again.next_begin_offset == first
            assert (await consumer.pull(mq, first)).status is PullStatus.FOUND
        async with PullConsumer(b.namesrv, "CG_new") as newcomer:     # a first pull (CONSUME_FROM_FIRST_OFFSET):
            await newcomer.fetch_queues("Behind")                       # it lost nothing, and is not counted
            assert (await newcomer.pull(mq, 0)).status is PullStatus.OFFSET_ILLEGAL
        counted = _scrape(b, "txmq_pull_offset_moved_messages_total")
        assert counted == {'{consumer_group="CG_behind",topic="Behind"}': first - 5}, counted     # once
        said = re.findall(r"group CG_behind pulled Behind queue \d+ at offset 5, below the queue's minimum (\d+): "
                          r"the (\d+) messages between were removed by retention", b.log())
        assert said == [(str(first), str(first - 5))], b.log()[-3000:]   # once a minute a queue, not once a pull
        assert "group CG_new" not in b.log()


async def test_a_timer_longer_than_the_retention_is_refused_not_accepted_and_lost(broker_factory):
    """timer_max_delay_s (3 days) was the only bound: with --file-reserved-hours 1 a timer for two hours was SEND_OK,
    and retention, once the disk was above its clean ratio, removed its record an hour before its time. The
    retention bounds it too: refused MESSAGE_ILLEGAL, naming why, and said at start-up."""
    b = broker_factory("--file-reserved-hours", "1")
    async with asyncio.timeout(30), Producer(b.namesrv, "PG_timer") as producer:
        with pytest.raises(MessageIllegalError, match=r"beyond the 3600 s maximum \(file_reserved_hours: retention "
                                                      r"would remove it before its time\)"):
            await producer.send("Timed", b"two hours", properties={"TIMER_DELAY_SEC": "7200"})
        kept = await producer.send("Timed", b"one hour", properties={"TIMER_DELAY_SEC": "3600"})
        assert kept.status is SendStatus.SEND_OK
    assert "timer messages are refused beyond 3600 s, the retention (file_reserved_hours=1)" in b.log()


async def test_a_broadcasting_consumer_moved_past_removed_messages_is_counted_though_it_stores_no_offset(
        broker_factory):
    """A broadcasting consumer keeps its offsets on its own host (LocalFileOffsetStore: RocketMQ's push consumer
    never commits them to the broker), as does a pull consumer that tracks its own. Taken as "a first pull, lost
    nothing" because the broker had no offset stored for the group, every move of such a consumer past removed
    messages went uncounted and unlogged. A first pull asks at 0 (or where the broker's search answered, at or
    past the minimum): one that asks past 0 and below the minimum was there, and lost what is between."""
    b = broker_factory(*EXPIRING)
    async with asyncio.timeout(60):
        mq = await _fill_until_removed(b, "PG_bcast", "Bcast")
        async with PullConsumer(b.namesrv, "CG_bcast") as consumer:
            await consumer.fetch_queues("Bcast")
            res = await consumer.pull(mq, 5)            # its local offset: 5 read, then it fell behind
            assert res.status is PullStatus.OFFSET_ILLEGAL
            first = res.next_begin_offset
            assert first > 5
        counted = _scrape(b, "txmq_pull_offset_moved_messages_total")
        assert counted == {'{consumer_group="CG_bcast",topic="Bcast"}': first - 5}, counted
        assert re.search(rf"group CG_bcast pulled Bcast queue \d+ at offset 5, below the queue's minimum {first}",
                         b.log()), b.log()[-3000:]


async def _log_end(b) -> int:
    pool = ConnectionPool()
    try:
        info = await pool.request(b.broker, RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO), 5.0)
        return int(json.loads(info.body_bytes())["table"]["commitLogMaxOffset"])
    finally:
        await pool.close()


async def _fill(b, topic: str, queue=None):
    async with Producer(b.namesrv, "PG_fill") as producer:
        mq = (await producer.send(topic, b"m" * 1000, queue=queue)).queue
        for _ in range(0, 600, 50):
            await asyncio.gather(*(producer.send(topic, b"m" * 1000, queue=mq) for _ in range(50)))
    return mq


async def test_a_topic_made_again_under_its_name_counts_its_groups_moves_from_its_own_offsets(broker_factory):
    """A deleted topic made again starts at offset 0. The broker remembered how far it had counted each group's
    move past removed messages in the old topic's offsets: in the new one, a group moved past fewer than that was
    taken as asking again for what was counted, and its loss went unsaid (no count, no line)."""
    b = broker_factory(*EXPIRING)
    async with asyncio.timeout(90):
        mq = await _fill(b, "Again")
        await _until_removed(b, 2 * SEGMENT)
        async with PullConsumer(b.namesrv, "CG_again") as consumer:
            await consumer.fetch_queues("Again")
            await consumer.commit_offset(mq, 5)
            assert (await consumer.pull(mq, 5)).status is PullStatus.OFFSET_ILLEGAL
        pool = ConnectionPool()
        try:
            deleted = await pool.request(b.broker, RemotingCommand.request(RequestCode.DELETE_TOPIC_IN_BROKER,
                                                                           {"topic": "Again"}), 5.0)
        finally:
            await pool.close()
        assert deleted.code == 0, deleted.remark
        start = await _log_end(b)
        await _fill(b, "Again", queue=mq)                           # made again: from offset 0
        await _until_removed(b, start + 16384)      # the segment with its first dozen messages went (the log's
        #                                             start is a segment's: sealed, as 600 messages fill two more)
        async with PullConsumer(b.namesrv, "CG_again") as consumer:
            await consumer.fetch_queues("Again")
            await consumer.commit_offset(mq, 5)
            res = await consumer.pull(mq, 5)
            assert res.status is PullStatus.OFFSET_ILLEGAL
        counted = _scrape(b, "txmq_pull_offset_moved_messages_total")
        assert counted == {'{consumer_group="CG_again",topic="Again"}': res.next_begin_offset - 5}, counted


async def test_a_group_behind_removed_messages_shows_as_lag_only_what_it_can_still_read(broker_factory):
    """A group that stopped at offset 5 while retention removed what followed: its lag was the queue's end less 5,
    messages the broker no longer holds counted as waiting for it, and for a group that never comes back it grew
    with every message sent for as long as the broker ran (months of traffic, with a few days' of it on disk).
    The lag is what it can still read (end less the queue's minimum); what retention removed before it read it
    is txmq_consumer_removed_unread_messages, until it pulls (or is moved) past it."""
    b = broker_factory(*EXPIRING)
    async with asyncio.timeout(60):
        mq = await _fill(b, "Stopped")
        async with PullConsumer(b.namesrv, "CG_stopped") as consumer:
            await consumer.fetch_queues("Stopped")
            await consumer.commit_offset(mq, 5)             # consumed a little, then stopped for good
        end = await _log_end(b)
        await _until_removed(b, end - end % SEGMENT)        # every sealed segment gone: the queue holds still
        async with PullConsumer(b.namesrv, "CG_look") as look:     # a first pull: where the queue starts and ends
            await look.fetch_queues("Stopped")
            res = await look.pull(mq, 0)
        low, high = res.min_offset, res.max_offset
        assert 5 < low < high
        labels = '{consumer_group="CG_stopped",topic="Stopped"}'
        lag, removed = await _lag_and_removed_once(b, lambda removed: removed.get(labels) == low - 5)
        assert (lag.get(labels), removed.get(labels)) == (high - low, low - 5), (high, low, lag, removed)
        assert '{consumer_group="CG_look",topic="Stopped"}' not in removed    # pulled, never committed: no loss

        async with PullConsumer(b.namesrv, "CG_stopped") as consumer:      # moved past what was removed
            await consumer.fetch_queues("Stopped")
            await consumer.commit_offset(mq, low)
        lag, removed = await _lag_and_removed_once(b, lambda removed: labels not in removed)
        assert (lag.get(labels), removed.get(labels)) == (high - low, None), (high, low, lag, removed)  # row gone


async def _lag_and_removed_once(b, done) -> tuple[dict, dict]:
    """(rocketmq_consumer_lag_messages, txmq_consumer_removed_unread_messages) by labels once ``done(the
    second)`` (the gauges are summed once a second), or the last of 100 looks."""
    for _ in range(100):
        lag = _scrape(b, "rocketmq_consumer_lag_messages")
        removed = _scrape(b, "txmq_consumer_removed_unread_messages")
        if done(removed):
            break
        await asyncio.sleep(0.1)
    return lag, removed


async def test_a_deleted_topics_mark_goes_once_retention_removed_its_records_not_at_the_next_restart(
        broker_factory):
    """DELETE_TOPIC_IN_BROKER leaves a mark (consumequeue/<topic>/deleted) so that recovery indexes none of the
    topic's records still in the log. It was removed only by a start after retention had removed them: a broker
    that ran for months kept a directory and a file for every topic ever deleted (2,000 topics made and deleted:
    4,000 entries under consumequeue/, read by its next start). It goes now once the log starts past it; a topic
    made again under the name keeps its directory, its queue and its messages, over a restart too."""
    b = broker_factory(*EXPIRING)
    cq_root = b.store_dir / "consumequeue"
    async with asyncio.timeout(90):
        pool = ConnectionPool()
        try:
            async with Producer(b.namesrv, "PG_marks") as producer:
                for topic in ("Doomed0", "Doomed1", "Reborn"):
                    await producer.send(topic, b"old")
                    deleted = await pool.request(b.broker, RemotingCommand.request(
                        RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": topic}), 5.0)
                    assert deleted.code == 0, deleted.remark
                    assert (cq_root / topic / "deleted").exists()
                mq = (await producer.send("Reborn", b"new0")).queue          # made again: from offset 0
                for n in range(1, 5):
                    await producer.send("Reborn", b"new%d" % n, queue=mq)
        finally:
            await pool.close()
        assert (cq_root / "Reborn" / "deleted").exists()
        await _fill(b, "Filler")
        # the first segment (every old record and mark's offset lay in it) and the next: the first's removal,
        # marks included, is over once the second's began (one at a time, between the writer's batches)
        await _until_removed(b, 2 * SEGMENT)
        assert not any((cq_root / t / "deleted").exists() for t in ("Doomed0", "Doomed1", "Reborn"))
        assert not (cq_root / "Doomed0").exists() and not (cq_root / "Doomed1").exists()
        assert (cq_root / "Reborn" / str(mq.queue_id)).is_dir()
        assert await stored_count(b.broker, "Reborn", 4) == 5
        b.stop()
        b.start()
        assert await stored_count(b.broker, "Reborn", 4) == 5
        assert sorted(p.name for p in cq_root.iterdir() if p.name.startswith(("Doomed", "Reborn"))) == ["Reborn"]


async def test_a_correction_offset_leaves_out_an_offset_retention_went_past(broker_factory):
    """QUERY_CORRECTION_OFFSET (308) takes, per queue, the least offset of the groups holding offsets on the topic,
    but not one below the queue's first message (ConsumerOffsetManager.queryMinOffsetInAllGroup: entry >=
    getMinOffsetInQueue): a group left behind by retention does not hold the correction back to messages gone."""
    b = broker_factory(*EXPIRING)
    async with asyncio.timeout(60):
        mq = await _fill_until_removed(b, "PG_corr_behind", "CorrBehind")
        pool = ConnectionPool()
        try:
            async def call(code, fields):
                return await pool.request(b.broker, RemotingCommand.request(code, fields), 5.0)

            first = int((await call(RequestCode.GET_MIN_OFFSET, {"topic": "CorrBehind", "queueId": mq.queue_id}))
                        .ext_fields["offset"])
            assert first > 5
            for group, offset in (("CG_corr_gone", 5), ("CG_corr_first", first), ("CG_corr_later", first + 3)):
                reply = await call(RequestCode.UPDATE_CONSUMER_OFFSET, {
                    "consumerGroup": group, "topic": "CorrBehind", "queueId": mq.queue_id, "commitOffset": offset})
                assert reply.code == 0, reply.remark
            reply = await call(RequestCode.QUERY_CORRECTION_OFFSET, {"topic": "CorrBehind", "compareGroup": "x"})
            assert reply.code == 0, reply.remark
            assert json.loads(reply.body_bytes()) == {"correctionOffsets": {str(mq.queue_id): first}}    # (>=)
        finally:
            await pool.close()
