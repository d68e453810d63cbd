"""Delay levels, timer messages and retry backoff against the real broker.

One test measures RocketMQ's real times (level 1 = 1 s, level 2 = 5 s, a RECONSUME_LATER back after
10 s, a timer at 3 s); the others start the broker with level n = n x 100 ms so the suite does not sleep.
Exactly-once delivery is checked across a kill -9 paced by deliveries seen, a clean restart, and a disk
that refuses writes while messages fall due.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from producer import LocalTransactionState, Producer, TransactionProducer
from protocol.codes import RequestCode, ResponseCode, SysFlag
from protocol.errors import MessageIllegalError
from protocol.message import SendMessageRequestHeader, properties_to_string
from producer.routes import MessageQueue
from tests.support.cluster_process import create_topic, request, stored_count
from tests.support.delays import FAST

pytestmark = pytest.mark.asyncio


async def _first_arrival(namesrv, group, topic, queue_id, sent_at):
    """Seconds from ``sent_at`` until the topic's queue holds a message, and that message."""
    consumer = PullConsumer(namesrv, group)
    try:
        mq = next(q for q in await consumer.fetch_queues(topic) if q.queue_id == queue_id)
        while True:
            got = await consumer.pull(mq, 0, suspend_ms=2000)
            if got.messages:
                return time.monotonic() - sent_at, got.messages[0]
    finally:
        await consumer.shutdown()


async def _delivered(namesrv, group, topic, queue_id):
    """The first message the topic's queue holds (long-polled until it is delivered)."""
    return (await _first_arrival(namesrv, group, topic, queue_id, 0.0))[1]


async def _all_messages(namesrv, topic):
    """Every message stored in the topic's queues (from offset 0)."""
    consumer = PullConsumer(namesrv, "CG_audit")
    out = []
    try:
        for mq in await consumer.fetch_queues(topic):
            offset = 0
            while True:
                got = await consumer.pull(mq, offset, max_nums=256)
                if not got.messages:
                    break
                out += got.messages
                offset = got.next_begin_offset
    finally:
        await consumer.shutdown()
    return out


def _scrape(broker) -> dict:
    text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_rocketmqs_real_delays_level_1_level_2_timer_and_reconsume_later(broker):
    """The one slow test (about 11 s): the default levels, measured."""
    retried = asyncio.get_running_loop().create_future()
    attempts = []

    def listener(msg):
        attempts.append((time.monotonic(), msg.reconsume_times))
        if len(attempts) == 1:
            return ConsumeStatus.RECONSUME_LATER
        if not retried.done():
            retried.set_result(None)
        return ConsumeStatus.CONSUME_SUCCESS

    push = PushConsumer(broker.namesrv, "CG_backoff", listener, consume_from="first", suspend_ms=1000)
    push.subscribe("Backoff", "*")
    async with asyncio.timeout(30):
        async with Producer(broker.namesrv, "PG_delay") as producer:
            await producer.send("Backoff", b"fails once")
            await push.start()
            r1 = await producer.send("DelayOne", b"level 1", delay_level=1)
            r2 = await producer.send("DelayTwo", b"level 2", delay_level=2)
            deliver_at_ms = int(time.time() * 1000) + 3000
            rt = await producer.send("Timer", b"at +3 s", deliver_at_ms=deliver_at_ms)
        one, two, timer = await asyncio.gather(
            _delivered(broker.namesrv, "CG_one", "DelayOne", r1.queue.queue_id),
            _delivered(broker.namesrv, "CG_two", "DelayTwo", r2.queue.queue_id),
            _delivered(broker.namesrv, "CG_timer", "Timer", rt.queue.queue_id))
        await retried
        await push.shutdown()
    # Delays by the broker's own stamps (the delivered copy keeps the producer's born time; one wall clock, in
    # whole ms). Timed here, they also held how long this process took to send and to start its consumers:
    # up to a second on a loaded machine, which failed the upper bounds.
    measured = {"level 1": (one.store_timestamp - one.born_timestamp) / 1000,
                "level 2": (two.store_timestamp - two.born_timestamp) / 1000,
                "timer 3 s": 3 + (timer.store_timestamp - deliver_at_ms) / 1000,
                "RECONSUME_LATER": attempts[1][0] - attempts[0][0]}
    print("measured delays:", {k: round(v, 3) for k, v in measured.items()})
    assert 1.0 <= measured["level 1"] < 2.0
    assert 5.0 <= measured["level 2"] < 6.0
    assert 2.9 <= measured["timer 3 s"] < 4.0        # a timer is due by the broker's monotonic clock: allow rounding
    # The retry is timed here (its copy's born time is the first send's): from the first call, which is before
    # the send-back the broker stores in whole ms (its due time up to 1 ms before 10 s after that instant).
    assert 10.0 - 0.001 <= measured["RECONSUME_LATER"] < 11.5
    assert [n for _, n in attempts] == [0, 1]         # back with reconsume times 1
    assert "DELAY" not in one.properties and one.properties["REAL_TOPIC"] == "DelayOne"
    assert one.body == b"level 1" and two.body == b"level 2" and timer.body == b"at +3 s"
    m = _scrape(broker)
    assert m[("txmq_schedule_delivered_total", (("level", "1"),))] == 1
    assert m[("txmq_schedule_delivered_total", (("level", "3"),))] == 1       # the retry: level 3 + 0
    assert m[("txmq_schedule_delivered_total", (("level", "timer"),))] == 1
    assert m[("txmq_schedule_delivered_late_total", ())] == 0


async def test_timer_limits_and_a_delayed_commit(broker_factory):
    broker = broker_factory(*FAST, "--timer-max-delay-s", "60")
    async with Producer(broker.namesrv, "PG_timer") as producer:
        with pytest.raises(MessageIllegalError, match="beyond the 60 s maximum"):
            await producer.send("Timed", b"too far", properties={"TIMER_DELAY_SEC": "61"})
        with pytest.raises(MessageIllegalError, match="not a whole number"):
            await producer.send("Timed", b"bad", properties={"TIMER_DELIVER_MS": "tomorrow"})
        past = await producer.send("Timed", b"past", deliver_at_ms=int(time.time() * 1000) - 1000)
    got = await _all_messages(broker.namesrv, "Timed")
    assert [m.body for m in got] == [b"past"] and past.queue_offset == 0     # a time gone by: at once

    class Commit:
        def execute_local_transaction(self, msg, arg):
            return LocalTransactionState.COMMIT_MESSAGE

        def check_local_transaction(self, msg):
            return LocalTransactionState.COMMIT_MESSAGE

    async with asyncio.timeout(15):
        async with TransactionProducer(broker.namesrv, "PG_tx_delay", Commit()) as tx:
            started = time.monotonic()
            r = await tx.send_in_transaction("TxDelayed", b"paid", properties={"TIMER_DELAY_MS": "800"})
            committed_ms = int(time.time() * 1000)
            # Aliyun's absolute __STARTDELIVERTIME on a half: the commit must wait for it too (asks_delay).
            ali_at = committed_ms + 1500
            ra = await tx.send_in_transaction("TxDelayedAli", b"paid at",
                                              properties={"__STARTDELIVERTIME": str(ali_at)})
            assert await _all_messages(broker.namesrv, "TxDelayed") == []    # committed, still waiting
            assert await _all_messages(broker.namesrv, "TxDelayedAli") == []
            took, msg = await _first_arrival(broker.namesrv, "CG_txd", "TxDelayed", r.send_result.queue.queue_id,
                                               started)
            ali = await _delivered(broker.namesrv, "CG_txd_ali", "TxDelayedAli", ra.send_result.queue.queue_id)
    # not before its time (the behaviour); the upper bound only says "not held for good" -- how late the scheduler
    # delivers is speed (bench/): it was + 2 s, a wall-clock margin flaky under load, now + 10 s
    assert ali_at <= ali.store_timestamp < ali_at + 10_000, (ali.store_timestamp - ali_at, ali.properties)
    # Kept, as RocketMQ 4.9.8 and Aliyun keep it: ali-ons' getStartDeliverTime() read 0 when it was dropped.
    assert ali.body == b"paid at" and ali.properties["__STARTDELIVERTIME"] == str(ali_at)
    assert took >= 0.8
    # Delivered after its due time (above) and not held for good, by the broker's store time; committed_ms is after
    # the commit, by the same wall clock. (Was within 1 s of due: the scheduler's lateness is speed, a wall-clock
    # margin flaky under load -- bench/ -- now within 10 s.)
    assert msg.store_timestamp - committed_ms < 800 + 10_000
    assert msg.body == b"paid" and "TIMER_DELAY_MS" not in msg.properties


async def test_a_transactional_message_with_an_illegal_timer_is_refused_at_its_half(broker_factory):
    """A half is never diverted: its timer applies at COMMIT. One the broker would refuse on a plain send
    (beyond timer_max_delay_s, not a number) was stored as a half all the same, and at COMMIT the refusal
    came back as "no delay": the message was delivered at once, with nobody told."""
    broker = broker_factory(*FAST, "--timer-max-delay-s", "60")
    executed = []

    class Commit:
        def execute_local_transaction(self, msg, arg):
            executed.append(msg.body)
            return LocalTransactionState.COMMIT_MESSAGE

        def check_local_transaction(self, msg):
            return LocalTransactionState.COMMIT_MESSAGE

    async with asyncio.timeout(15):
        async with TransactionProducer(broker.namesrv, "PG_tx_timer", Commit()) as tx:
            with pytest.raises(MessageIllegalError, match="beyond the 60 s maximum"):
                await tx.send_in_transaction("TxTimed", b"too far", properties={"TIMER_DELAY_SEC": "61"})
            with pytest.raises(MessageIllegalError, match="not a whole number"):
                await tx.send_in_transaction("TxTimed", b"bad", properties={"TIMER_DELIVER_MS": "tomorrow"})
        assert executed == [] and await _all_messages(broker.namesrv, "TxTimed") == []


async def test_a_delay_level_that_is_no_number_is_refused_not_delivered_at_once(broker_factory):
    """A DELAY that is no whole number ("2.5" from a JavaScript producer's ``msg.delayTimeLevel = 2.5``) was
    answered SEND_OK and delivered at once, as if no delay was asked; RocketMQ's Integer.parseInt throws on it and
    the send fails (SYSTEM_ERROR). Refused MESSAGE_ILLEGAL now, on a plain send and on a half (whose delay applies
    at its commit, where a refusal could only mean "now"; stock producers clear DELAY on halves, a raw one may not)."""
    broker = broker_factory(*FAST)
    async with asyncio.timeout(20):
        async with Producer(broker.namesrv, "PG_bad_delay") as producer:
            for delay in ("2.5", "soon"):
                with pytest.raises(MessageIllegalError, match=f"DELAY='{delay}' is not a whole number"):
                    await producer.send("BadDelay", b"early", properties={"DELAY": delay})
            kept = await producer.send("BadDelay", b"no delay asked", properties={"DELAY": ""})
        half = SendMessageRequestHeader(
            producer_group="PG_raw_half", topic="BadDelay", queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
            properties=properties_to_string({"TRAN_MSG": "true", "PGROUP": "PG_raw_half", "DELAY": "2.5"}),
            born_timestamp=int(time.time() * 1000))
        resp = await request(broker.broker, RequestCode.SEND_MESSAGE_V2, half.to_ext_fields(v2=True), b"half")
        assert (resp.code, resp.remark) == (ResponseCode.MESSAGE_ILLEGAL,
                                            "delay level illegal: DELAY='2.5' is not a whole number")
        assert [m.body for m in await _all_messages(broker.namesrv, "BadDelay")] == [b"no delay asked"]
        assert kept.queue_offset == 0
        assert await stored_count(broker.broker, "RMQ_SYS_TRANS_HALF_TOPIC", 1) == 0


async def _count_keys(namesrv, topic) -> Counter:
    return Counter(m.properties["UNIQ_KEY"] for m in await _all_messages(namesrv, topic))


async def test_a_retry_of_a_message_that_waited_for_its_start_deliver_time_keeps_it(broker_factory):
    """The delivered message keeps Aliyun's __STARTDELIVERTIME (ali-ons' getStartDeliverTime()); its retry lost it:
    the send-back's delay level dropped every timer property, as a send's asks, and the retry read 0. RocketMQ's
    send-back copies every property and its schedule drops DELAY alone."""
    broker = broker_factory(*FAST)
    at = str(int(time.time() * 1000) + 300)
    async with asyncio.timeout(30):
        async with Producer(broker.namesrv, "PG_ali_retry") as producer:
            sent = await producer.send("AliRetry", b"retry me", properties={"__STARTDELIVERTIME": at})
        msg = await _delivered(broker.namesrv, "CG_ali_retry", "AliRetry", sent.queue.queue_id)
        assert msg.properties["__STARTDELIVERTIME"] == at
        consumer = PullConsumer(broker.namesrv, "CG_ali_retry")
        try:
            mq = next(q for q in await consumer.fetch_queues("AliRetry") if q.queue_id == sent.queue.queue_id)
            await consumer.send_back(mq, msg, delay_level=1)
        finally:
            await consumer.shutdown()
        retry = await _delivered(broker.namesrv, "CG_ali_retry_audit", "%RETRY%CG_ali_retry", 0)
    assert retry.body == b"retry me" and retry.reconsume_times == 1
    assert retry.properties.get("__STARTDELIVERTIME") == at, retry.properties


async def test_a_delay_or_timer_javas_parse_refuses_is_refused_not_taken(broker_factory):
    """RocketMQ reads DELAY with Integer.parseInt (and RocketMQ 5 its timers with Long.parseLong), which throw on
    spaces, "_" and a number past Java's range: the send fails. txmq's int() took them: " 3" and "1_000" were
    delayed (level 3, level 18), "3000000000" 2 hours, a TIMER_DELAY_SEC of " 60" held a minute, all SEND_OK.
    Refused MESSAGE_ILLEGAL now, and nothing stored. (An empty value is no property, as in Java's
    string2messageProperties: no delay, test above.)"""
    broker = broker_factory(*FAST)
    asks = [("DELAY", " 3", "is not a whole number"),
            ("DELAY", "1_000", "is not a whole number"), ("DELAY", "3000000000", "is past Java's int range"),
            ("TIMER_DELAY_SEC", " 60", "is not a whole number"),
            ("__STARTDELIVERTIME", "99999999999999999999", "is past Java's long range"),
            ("DELAY", "9" * 5000, "is past Java's int range")]     # past int()'s 4,300 digits: SYSTEM_ERROR
    async with asyncio.timeout(20):
        async with Producer(broker.namesrv, "PG_parse_delay") as producer:
            for key, value, why in asks:
                with pytest.raises(MessageIllegalError, match=re.escape(f"{key}={value!r} {why}")):
                    await producer.send("ParseDelay", b"refused", properties={key: value})
            kept = await producer.send("ParseDelay", b"level 0", properties={"DELAY": "+0"})    # parseInt takes "+"
        assert [m.body for m in await _all_messages(broker.namesrv, "ParseDelay")] == [b"level 0"]
        assert kept.queue_offset == 0
        assert await stored_count(broker.broker, "SCHEDULE_TOPIC_XXXX", 18) == 0
        assert await stored_count(broker.broker, "rmq_sys_wheel_timer", 1) == 0


async def test_kill_9_mid_delivery_loses_and_repeats_nothing(broker_factory):
    broker = broker_factory(*FAST)
    total = 150
    sent = set()
    async with asyncio.timeout(60):
        async with Producer(broker.namesrv, "PG_kill") as producer:
            for i in range(total):             # levels 5..18: due 0.5 s .. 1.8 s after their send
                r = await producer.send("Sched", f"m{i}".encode(), delay_level=5 + i % 14)
                sent.add(r.msg_id)
        while sum((await _count_keys(broker.namesrv, "Sched")).values()) < 40:
            await asyncio.sleep(0.02)
        broker.kill()                           # SIGKILL while deliveries go on
        broker = broker_factory(*FAST)          # same store
        while True:
            keys = await _count_keys(broker.namesrv, "Sched")
            if sum(keys.values()) >= total:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)                # anything repeated would show by now
        keys = await _count_keys(broker.namesrv, "Sched")
    assert set(keys) == sent
    assert [k for k, n in keys.items() if n > 1] == []


async def test_a_refusing_disk_holds_deliveries_until_it_has_room_then_each_goes_once(broker_factory, tmp_path):
    broker = broker_factory(*FAST)
    async with Producer(broker.namesrv, "PG_full") as producer:
        sent = {(await producer.send("Held", f"h{i}".encode(), delay_level=10)).msg_id for i in range(20)}
    assert broker.stop() == 0
    assert (tmp_path / "store" / "config" / "delayOffset.json").exists()
    broker = broker_factory(*FAST, "--disk-refuse-ratio", "0.0001")       # every write refused
    await asyncio.sleep(2.0)                    # they fell due 1 s after their send, and are held
    assert await _all_messages(broker.namesrv, "Held") == []
    m = _scrape(broker)
    assert m[("txmq_schedule_messages_waiting", (("level", "10"),))] == 20
    assert broker.stop() == 0
    broker = broker_factory(*FAST)
    async with asyncio.timeout(20):
        while sum((keys := await _count_keys(broker.namesrv, "Held")).values()) < 20:
            await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)
    keys = await _count_keys(broker.namesrv, "Held")
    assert set(keys) == sent and max(keys.values()) == 1
    offsets = json.loads((tmp_path / "store" / "config" / "delayOffset.json").read_text())
    assert offsets["offsetTable"]["10"] == 0    # written at the stop, when nothing had been delivered
    assert _scrape(broker)[("txmq_schedule_delivered_late_total", ())] == 20    # held past due by the disk


async def test_kill_9_mid_timer_delivery_after_a_delay_offset_json_of_bitmaps_loses_and_repeats_nothing(
        broker_factory):
    """delayOffset.json's new timerDone (every other timer delivered behind held ones: a chunk's bitmap) loaded at
    start-up, then a kill -9 while timers are delivered: each due timer arrives once, the held ones wait."""
    broker = broker_factory(*FAST)
    due, held = set(), set()
    async with asyncio.timeout(60):
        async with Producer(broker.namesrv, "PG_tkill") as producer:
            for i in range(300):
                props = {"TIMER_DELAY_SEC": "50"} if i % 2 == 0 else {"TIMER_DELAY_MS": str(200 + i)}
                (held if i % 2 == 0 else due).add((await producer.send("Timed", b"a%d" % i, properties=props)).msg_id)
        while sum((await _count_keys(broker.namesrv, "Timed")).values()) < 150:
            await asyncio.sleep(0.05)
        broker.stop()                           # writes delayOffset.json
        saved = json.loads((broker.store_dir / "config" / "delayOffset.json").read_bytes())
        assert saved["timerFloor"] == 0 and any(isinstance(item, str) for item in saved["timerDone"])
        broker = broker_factory(*FAST)          # loads it
        async with Producer(broker.namesrv, "PG_tkill") as producer:
            for i in range(150):
                due.add((await producer.send("Timed", b"b%d" % i, properties={"TIMER_DELAY_MS": str(300 + 5 * i)}))
                        .msg_id)
        while sum((await _count_keys(broker.namesrv, "Timed")).values()) < 190:
            await asyncio.sleep(0.02)
        broker.kill()                           # SIGKILL while deliveries go on
        broker = broker_factory(*FAST)          # same store
        while sum((keys := await _count_keys(broker.namesrv, "Timed")).values()) < len(due):
            await asyncio.sleep(0.1)
    assert set(keys) == due and not held & set(keys)
    assert [k for k, n in keys.items() if n > 1] == []


async def test_messages_waiting_at_a_level_the_restarted_broker_no_longer_has_are_delivered_at_its_last(
        broker_factory):
    """An operator who shortens ``message_delay_level`` (18 levels to 2) while messages wait at level 18: their
    SCHEDULE_TOPIC_XXXX queue 17 was read by nobody after the restart, the messages never delivered, not counted
    as waiting, nothing said (RocketMQ 4.9.8's schedule walks only the configured levels too). They are taken at
    the last level now, as a send asking a level past it is, counted, and said at WARNING at start. (Said as
    "delivered at the last level's delay" at first: each due an hour on went at once, by correctDeliverTimestamp's
    rule, as a configured level's messages do when its delay is shortened.)"""
    hour_last = " ".join(f"{n * 100}ms" for n in range(1, 18)) + " 1h"
    broker = broker_factory("--message-delay-level", hour_last)
    async with asyncio.timeout(60):
        async with Producer(broker.namesrv, "PG_cut") as producer:
            sent = {(await producer.send("Cut", b"c%d" % i, delay_level=18)).msg_id for i in range(5)}
        assert _scrape(broker)[("txmq_schedule_messages_waiting", (("level", "18"),))] == 5
        assert broker.stop() == 0
        broker = broker_factory("--message-delay-level", "100ms 200ms")
        assert ("delay levels past the 2 configured (message_delay_level; an earlier run had more) hold messages "
                "waiting (level 18: 5): those due more than the last level's delay, 200 ms, from now are delivered "
                "at once") in broker.log()
        while sum((keys := await _count_keys(broker.namesrv, "Cut")).values()) < 5:
            await asyncio.sleep(0.1)
    assert set(keys) == sent and max(keys.values()) == 1
    assert _scrape(broker)[("txmq_schedule_messages_waiting", (("level", "18"),))] == 0


async def test_messages_of_a_dropped_level_go_once_across_a_kill_9_and_a_start_with_the_longer_table_again(
        broker_factory):
    """The dropped level's progress is kept as the configured ones' is: a kill -9 while its messages are delivered
    repeats and loses none, and a start with the longer table again finds none waiting (its gauge 0): taken for
    waiting again, each would have gone a second time an hour on."""
    hour_last = " ".join(f"{n * 100}ms" for n in range(1, 18)) + " 1h"
    broker = broker_factory("--message-delay-level", hour_last)
    total = 300
    async with asyncio.timeout(90):
        async with Producer(broker.namesrv, "PG_cut_kill") as producer:
            sent = set()
            for i in range(0, total, 50):
                sent |= {r.msg_id for r in await asyncio.gather(*(
                    producer.send("CutKill", b"k%d" % j, delay_level=18) for j in range(i, i + 50)))}
        assert broker.stop() == 0
        broker = broker_factory("--message-delay-level", "100ms 200ms")
        while sum((await _count_keys(broker.namesrv, "CutKill")).values()) < 30:
            await asyncio.sleep(0.02)
        broker.kill()                           # SIGKILL while deliveries go on
        broker = broker_factory("--message-delay-level", "100ms 200ms")
        while sum((keys := await _count_keys(broker.namesrv, "CutKill")).values()) < total:
            await asyncio.sleep(0.1)
        assert broker.stop() == 0
        broker = broker_factory("--message-delay-level", hour_last)
        keys = await _count_keys(broker.namesrv, "CutKill")
    assert set(keys) == sent and max(keys.values()) == 1
    assert _scrape(broker)[("txmq_schedule_messages_waiting", (("level", "18"),))] == 0


async def test_delayed_messages_due_in_queues_their_topic_no_longer_reads_go_to_one_it_reads(broker_factory):
    """A topic cut from 8 queues to 4 (updateTopic -r 4 -w 4, once queues 4..7 were drained: their lag read 0) while
    delayed messages sent to queues 4..7 still waited: delivered to those queues, as RocketMQ 4.9.8's
    ScheduleMessageService writes REAL_QID, they were stored where no consumer reads (8 of 16), nothing said.
    They go to a queue the topic reads now, once each, and are counted in txmq_requeued_total."""
    hour = "100ms 1h"
    broker = broker_factory("--message-delay-level", hour)
    async with asyncio.timeout(60):
        await create_topic(broker.broker, "Shrunk", 8)
        async with Producer(broker.namesrv, "PG_shrunk") as producer:
            sent = {(await producer.send("Shrunk", b"s%d" % i, delay_level=2,
                                         queue=MessageQueue("Shrunk", "broker-a", i % 8))).msg_id
                    for i in range(16)}
        await create_topic(broker.broker, "Shrunk", 4)
        assert broker.stop() == 0
        broker = broker_factory("--message-delay-level", "100ms 100ms")   # due at once: stored an hour before it
        delivered = ("txmq_schedule_delivered_total", (("level", "2"),))
        while _scrape(broker).get(delivered, 0) < 16:
            await asyncio.sleep(0.05)
        keys = await _count_keys(broker.namesrv, "Shrunk")
        consumer = PullConsumer(broker.namesrv, "CG_shrunk")
        try:
            readable = {mq.queue_id for mq in await consumer.fetch_queues("Shrunk")}
        finally:
            await consumer.shutdown()
    assert readable == {0, 1, 2, 3}
    assert set(keys) == sent and max(keys.values()) == 1
    assert _scrape(broker)[("txmq_requeued_total", (("topic", "Shrunk"),))] == 8
