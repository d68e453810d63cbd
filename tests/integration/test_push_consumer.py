"""PushConsumer against the real broker: every message consumed, failures retried through %RETRY%,
a poison message parked in %DLQ%, and SqliteIdempotency turning duplicates into exactly-once effects."""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from consumer import ConsumeStatus, PullConsumer, PushConsumer, SqliteIdempotency
from consumer.pull_consumer import MessageQueue
from producer import Producer
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import BrokerError
from tests.support.bounded import bounded
from tests.support.cluster_process import request
from tests.support.delays import FAST
from tests.support.offsets import queues_behind

pytestmark = pytest.mark.asyncio


async def test_push_consumer_retries_parks_poison_and_applies_once(broker_factory, tmp_path):
    broker = broker_factory(*FAST)      # retries back off n x 100 ms, not RocketMQ's 10 s, 30 s
    async with Producer(broker.namesrv, "PG_push") as producer:
        for i in range(20):
            await producer.send("Jobs", f"job-{i}".encode(), tags="job")
        await producer.send("Jobs", b"job-5", tags="job", properties={"UNIQ_KEY": "DUP-KEY"})
        await producer.send("Jobs", b"job-5", tags="job", properties={"UNIQ_KEY": "DUP-KEY"})   # resent
        await producer.send("Jobs", b"poison", tags="job")

    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    ledger.db.execute("CREATE TABLE applied (body TEXT)")
    attempts = Counter()
    done = asyncio.Event()
    skipped = []

    def apply(msg, db):
        db.execute("INSERT INTO applied VALUES (?)", (msg.body.decode(),))

    def listener(msg):
        body = msg.body.decode()
        attempts[body] += 1
        assert msg.topic == "Jobs"                    # retries come back under the subscribed topic
        if body == "poison" or (body.endswith(("0", "4", "8")) and attempts[body] == 1):
            return ConsumeStatus.RECONSUME_LATER
        if not ledger.run_once(msg, apply):
            skipped.append(body)
        if ledger.db.execute("SELECT COUNT(*) FROM applied").fetchone()[0] >= 21:
            done.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(broker.namesrv, "CG_push", listener, consume_from="first", max_reconsume_times=2,
                            suspend_ms=500)
    consumer.subscribe("Jobs", "job")
    async with asyncio.timeout(30):
        await consumer.start()
        await done.wait()
        while attempts["poison"] < 3:                 # first delivery + two retries, then the DLQ
            await asyncio.sleep(0.05)
        # The third attempt's hand-back may still be on its way when the listener has returned (a pull
        # before it landed found the DLQ empty, once in a full-suite run): wait for the dead letter
        # itself, the consumer still running, then shut down.
        probe = PullConsumer(broker.namesrv, "CG_probe")
        dead = []
        while not dead:
            try:
                dlq = (await probe.fetch_queues("%DLQ%CG_push"))[0]
            except BrokerError:                       # that hand-back makes the DLQ topic
                await asyncio.sleep(0.05)
                continue
            dead = (await probe.pull(MessageQueue(dlq.topic, dlq.broker_name, 0), 0, suspend_ms=1000)).messages
        await consumer.shutdown()
        await probe.shutdown()
    applied = Counter(row[0] for row in ledger.db.execute("SELECT body FROM applied"))
    assert applied == Counter([f"job-{i}" for i in range(20)] + ["job-5"])   # the resent copy applied once
    assert skipped == ["job-5"]
    assert all(attempts[f"job-{i}"] == 2 for i in (0, 4, 8, 10, 14, 18))
    assert [m.body for m in dead] == [b"poison"]


async def _orderly_dead_letters(broker, group: str):
    """A poison message, then one more in its queue, consumed orderly with 3 retries in place: (the poison's
    SendResult, the retry counts the listener saw, everything in %DLQ%<group> once the next message was consumed
    -- so after the poison's dead letter was done with, however many copies it stored)."""
    async with Producer(broker.namesrv, "PG_orderly_dead") as producer:
        sent = await producer.send("OrderlyDead", b"poison")
        await producer.send("OrderlyDead", b"next", queue=sent.queue)
    attempts = []
    passed = asyncio.Event()

    def listener(msg):
        if msg.body == b"next":
            passed.set()
            return ConsumeStatus.CONSUME_SUCCESS
        attempts.append(msg.reconsume_times)
        return ConsumeStatus.RECONSUME_LATER

    consumer = PushConsumer(broker.namesrv, group, listener, consume_from="first", orderly=True,
                            max_reconsume_times=3, suspend_s=0.05)
    consumer.subscribe("OrderlyDead")
    probe = PullConsumer(broker.namesrv, "CG_orderly_dead_probe")
    await consumer.start()
    try:
        await passed.wait()
        [dlq] = await probe.fetch_queues(f"%DLQ%{group}")
        dead = (await probe.pull(dlq, 0, max_nums=32, suspend_ms=0)).messages
    finally:
        await consumer.shutdown()
        await probe.shutdown()
    return sent, attempts, dead


@pytest.mark.parametrize("group, counted", [("CG_orderly_dead", 3), ("G" * 121, 1)], ids=["group", "long-group"])
@bounded(60)
async def test_an_orderly_dead_letter_carries_the_retries_it_had(broker, group, counted, caplog):
    """An orderly consumer retries a failed message in place, counting each retry on its own, and past
    max_reconsume_times dead-letters it as RocketMQ's (ConsumeMessageOrderlyService.sendMessageBack): a send to
    %RETRY%<group> carrying that count, which the broker stores in %DLQ%<group>. It handed it back with
    CONSUMER_SEND_MSG_BACK and delayLevel -1 instead, which counts from the stored record: every orderly dead
    letter said RECONSUME_TIMES 1 after its 3 retries here (a stock consumer's says 3). A group whose %RETRY%
    topic would be past the name limit (its %DLQ% one is not) is still dead-lettered, by that hand-back."""
    caplog.set_level("WARNING", logger="txmq.consumer")
    sent, attempts, dead = await _orderly_dead_letters(broker, group)
    assert attempts == [0, 1, 2, 3]                   # the first delivery and three retries in place
    # said, as the queue goes on past it (nothing on the consumer's side told of a message left out)
    [said] = [r.getMessage() for r in caplog.records if "dead-lettered to" in r.getMessage()]
    assert sent.msg_id in said and "3 retries" in said and f"%DLQ%{group}" in said
    [letter] = dead
    assert letter.body == b"poison" and letter.reconsume_times == counted
    assert letter.properties["RETRY_TOPIC"] == "OrderlyDead"
    assert letter.properties["ORIGIN_MESSAGE_ID"] == sent.msg_id


@bounded(60)
async def test_an_orderly_dead_letter_of_a_group_without_retries_is_stored_as_a_stock_consumers(broker):
    """A group set to retryQueueNums 0 has its hand-backs answered SUCCESS and dropped; an orderly consumer's dead
    letter is no hand-back but a send to %RETRY%<group> (as a stock orderly consumer's), which RocketMQ's
    handleRetryAndDLQ stores in %DLQ%<group> whatever the group's retryQueueNums: so does this broker (README)."""
    from tests.integration.test_retry import _set_retry_queue_nums
    await _set_retry_queue_nums(broker, "CG_orderly_dead_no_retry", 0)
    _, attempts, dead = await _orderly_dead_letters(broker, "CG_orderly_dead_no_retry")
    assert attempts == [0, 1, 2, 3]
    assert [(m.body, m.reconsume_times) for m in dead] == [(b"poison", 3)]


@bounded(60)
async def test_an_orderly_dead_letter_a_sync_master_stored_late_is_stored_once(broker_factory):
    """A SYNC_MASTER with no slave answers the dead letter's send SLAVE_NOT_AVAILABLE, the message stored (as
    RocketMQ's, whose producer returns such a send as sent). Read as a refusal, the dead letter was handed back
    with delayLevel -1 too: two copies in %DLQ%<group>, the second counting 1."""
    b = broker_factory("--broker-role", "SYNC_MASTER", "--ha-port", "0")
    _, attempts, dead = await _orderly_dead_letters(b, "CG_orderly_dead_sync")
    assert attempts == [0, 1, 2, 3]
    assert [(m.body, m.reconsume_times) for m in dead] == [(b"poison", 3)]


async def _wide_topic_one_message_a_queue(b, queues: int, other_groups: int):
    """Topic Wide of ``queues`` queues, a message in each, and ``other_groups`` groups' offsets on every queue (a
    save of the broker's offsets table is no longer free); an event set once a listener, the other returned, has
    consumed a message of every queue."""
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(R.UPDATE_AND_CREATE_TOPIC, {
            "topic": "Wide", "readQueueNums": queues, "writeQueueNums": queues, "perm": 6}), 5.0)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        for g in range(other_groups):     # other groups' offsets: a save of the table is no longer free
            for q in range(queues):
                conn.oneway(RemotingCommand.request(R.UPDATE_CONSUMER_OFFSET, {
                    "consumerGroup": f"CG_other{g}", "topic": "Wide", "queueId": q, "commitOffset": 0}, oneway=True))
        resp = await conn.request(RemotingCommand.request(R.GET_MAX_OFFSET, {"topic": "Wide", "queueId": 0}), 5.0)
        assert resp.code == ResponseCode.SUCCESS        # (after the oneways on this connection)
    finally:
        conn.close()
    async with Producer(b.namesrv, "PG_wide") as producer:
        for q in range(queues):
            await producer.send("Wide", b"m%d" % q, queue=MessageQueue("Wide", "broker-a", q))
    seen: set = set()
    everyone = asyncio.Event()

    def listener(msg):
        seen.add(msg.queue_id)
        if len(seen) == queues:
            everyone.set()
        return ConsumeStatus.CONSUME_SUCCESS
    return everyone, listener


def _commits_in_flight(consumer) -> list:
    """Counts the consumer's offset commits as they run: [in flight now, the most at once]. One queue after
    another, the most is 1; side by side, as many as the queues committed (they share the broker's saves)."""
    count, inner = [0, 0], consumer._commit

    async def counted(*args, **kwargs):
        count[0] += 1
        count[1] = max(count)
        try:
            return await inner(*args, **kwargs)
        finally:
            count[0] -= 1
    consumer._commit = counted
    return count


@bounded(180)
async def test_a_shutdown_before_the_first_commit_round_commits_its_queues_side_by_side(broker_factory):
    """A consume_from="first" consumer stopped before its first commit round commits each queue's first offset
    at shutdown, answered, and the broker saves a group's first offset of a queue before its answer (paced: a rest
    of 3 saves, then a save). One queue after another, each waited for its own: 128 queues on a broker holding
    10,240 offsets took 35-100 s to stop. Side by side, they share the broker's saves."""
    b = broker_factory("--flush-consumer-offset-interval-ms", "600000")    # no periodic save within the test
    queues = 128
    everyone, listener = await _wide_topic_one_message_a_queue(b, queues, 80)

    consumer = PushConsumer(b.namesrv, "CG_wide", listener, consume_from="first", offset_commit_interval_s=600)
    consumer.subscribe("Wide", "*")
    await consumer.start()
    try:
        await everyone.wait()       # every queue's loop started (at 0, stored nowhere) and consumed its message
    finally:
        commits = _commits_in_flight(consumer)
        await consumer.shutdown()
    assert await queues_behind(b.namesrv, "CG_wide", "Wide") == []
    assert commits[1] >= queues, f"at most {commits[1]} of {queues} first offsets committed at once"  # (+ its retry queue)


@bounded(240)
async def test_a_hand_over_before_the_first_commit_round_commits_its_queues_side_by_side(broker_factory):
    """A rebalance giving away queues of a consume_from="first" consumer before its first commit round commits
    each one's first offset, answered, and the broker saves a group's first offset of a queue before its answer
    (paced). One queue after another (as shutdown's were until they were gathered), the hand-over of 64 queues on a
    broker holding 20,480 offsets took one paced save each (14.9 s; 9.9 s at 10,240), the rebalance waiting for it
    and the queues' new owner redelivering what the old one had consumed meanwhile."""
    b = broker_factory("--flush-consumer-offset-interval-ms", "600000")    # no periodic save within the test
    queues = 128
    everyone, listener = await _wide_topic_one_message_a_queue(b, queues, 160)

    first = PushConsumer(b.namesrv, "CG_wide_hand", listener, consume_from="first", offset_commit_interval_s=600,
                         rebalance_interval_s=600)
    first.subscribe("Wide", "*")
    second = PushConsumer(b.namesrv, "CG_wide_hand", lambda msg: ConsumeStatus.CONSUME_SUCCESS,
                          consume_from="first", offset_commit_interval_s=600, rebalance_interval_s=600)
    second.subscribe("Wide", "*")
    await first.start()
    try:
        await everyone.wait()       # every queue's loop started (at 0, stored nowhere) and consumed its message
        # counted from before the second member starts: the broker's notice of it (NOTIFY_CONSUMER_IDS_CHANGED) can
        # start the first's hand-over while second.start() is awaited, which, counted only after, counted no commit
        commits = _commits_in_flight(first)
        await second.start()        # (its heartbeat names it to the broker: the group has two members)
        await first.rebalance()     # (or the broker's notice of the new member began it): returns once handed over
        await asyncio.gather(*first._handovers)
        given, most = queues - len(first._owned), commits[1]
    finally:
        await second.shutdown()
        await first.shutdown()
    assert given >= queues // 2 - 1
    assert most >= given, f"at most {most} of the {given} handed-over queues' first offsets committed at once"


@bounded(60)
async def test_consume_from_timestamp_starts_a_new_groups_queue_at_the_message_stored_then(broker_factory):
    """CONSUME_FROM_TIMESTAMP (RocketMQ's consumeTimestamp), which a consumer ported from Java asks for: it was
    refused (ValueError), "first" and "last" alone. A queue the group never committed starts at the message
    SEARCH_OFFSET_BY_TIMESTAMP finds for the time. (Its first
    message "on disk": while it is in memory, the broker tells a group with no offset 0, RocketMQ's rule, and every
    consume_from starts there, as a Java consumer's.)"""
    broker = broker_factory("--access-message-in-memory-max-ratio", "0")
    resp = await request(broker.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "FromTime", "readQueueNums": 1,
                                                                    "writeQueueNums": 1, "perm": 6})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    async with Producer(broker.namesrv, "PG_from_time") as producer:
        first = [await producer.send("FromTime", b"early-%d" % i) for i in range(5)]
        probe = PullConsumer(broker.namesrv, "CG_from_time_probe")
        mq = MessageQueue("FromTime", first[0].queue.broker_name, 0)
        early = (await probe.pull(mq, 0, max_nums=32)).messages
        while int(time.time() * 1000) <= max(m.store_timestamp for m in early):     # the next ones stored later
            await asyncio.sleep(0.001)
        for i in range(5):
            await producer.send("FromTime", b"late-%d" % i)
    late = [m for m in (await probe.pull(mq, 0, max_nums=32)).messages if m.body.startswith(b"late-")]
    await probe.shutdown()
    got, done = [], asyncio.Event()

    def listener(msg):
        got.append((msg.queue_offset, msg.body))
        if len(got) >= len(late):
            done.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(broker.namesrv, "CG_from_time", listener, consume_from="timestamp",
                            consume_timestamp_ms=late[0].store_timestamp, suspend_ms=500)
    consumer.subscribe("FromTime")
    async with consumer:
        await done.wait()
    assert got == [(m.queue_offset, m.body) for m in late]      # from the first late one, none of the early
    with pytest.raises(ValueError, match="consume_from=\"timestamp\" only"):
        PushConsumer(broker.namesrv, "CG_x", listener, consume_from="last", consume_timestamp_ms=1)


@bounded(60)
async def test_an_orderly_queue_held_at_a_failing_message_is_said_and_shown_not_silent(broker, caplog):
    """An orderly listener that keeps answering RECONSUME_LATER (SUSPEND_CURRENT_QUEUE_A_MOMENT) holds its queue at
    that message for good (max_reconsume_times is Integer.MAX_VALUE by default, as RocketMQ's). Nothing was said:
    the queue stalled with no log line and nothing on the consumer to read. Now a WARNING names the queue, the
    message and its offset at the first retry and again at the 10th, 100th, ... (bounded), and stalled_queues
    gives the retries of each queue held; a success clears it."""
    group, topic = "CG_orderly_stall", "OrderlyStall"
    async with Producer(broker.namesrv, "PG_orderly_stall") as producer:
        sent = await producer.send(topic, b"stuck")
    calls = 0
    reached = asyncio.Event()
    fixed = asyncio.Event()
    healed = asyncio.Event()

    def listener(msg):
        nonlocal calls
        if fixed.is_set():
            healed.set()
            return ConsumeStatus.CONSUME_SUCCESS
        calls += 1
        if calls == 25:
            reached.set()
        return ConsumeStatus.RECONSUME_LATER

    consumer = PushConsumer(broker.namesrv, group, listener, consume_from="first", orderly=True, suspend_s=0.01,
                            max_reconsume_times=-1)
    consumer.subscribe(topic)
    caplog.set_level("WARNING", logger="txmq.consumer")
    await consumer.start()
    try:
        await reached.wait()
        said = [r.getMessage() for r in caplog.records if "held at" in r.getMessage()]
        assert len(said) == 2, said                   # the 1st and the 10th retry, not one line per retry
        assert sent.msg_id in said[0] and f"queue {sent.queue.queue_id} " in said[0] and "offset 0" in said[0]
        [(mq, retries)] = [(q, n) for q, n in consumer.stalled_queues.items() if q.topic == topic]
        assert mq.queue_id == sent.queue.queue_id and 24 <= retries <= 25
        fixed.set()
        await healed.wait()     # set in the listener's call, which returns before anything else runs
        assert not any(q.topic == topic for q in consumer.stalled_queues), consumer.stalled_queues
    finally:
        await consumer.shutdown()
