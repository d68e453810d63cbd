"""Consumer retries through the broker: CONSUMER_SEND_MSG_BACK copies a failed message to %RETRY%<group>
with its retry count, after the backoff of level 3 + retries, and past the group's maximum to %DLQ%<group>
at once; nothing is dropped on the way."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from consumer.pull_consumer import MessageQueue
from producer import LocalTransactionState, Producer, TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import SendMessageRequestHeader, properties_to_string
from tests.support.bounded import bounded
from tests.support.delays import FAST
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio


async def _send_back(consumer, mq_addr, msg, group, max_times):
    cmd = RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
        "offset": msg.physical_offset, "group": group, "delayLevel": 0, "originMsgId": msg.msg_id,
        "originTopic": msg.properties.get("RETRY_TOPIC", msg.topic), "maxReconsumeTimes": max_times})
    return await consumer.pool.request(mq_addr, cmd, 5)


async def _pull_one(consumer, mq, offset):
    """The message at ``offset``, waiting (long polls) for the scheduler to deliver it."""
    while True:
        got = await consumer.pull(mq, offset, suspend_ms=1000)
        if got.messages:
            return got.messages[0]


async def test_failed_messages_go_to_retry_then_dead_letter_queue(broker_factory):
    broker = broker_factory(*FAST)      # level n waits n x 100 ms
    group = "CG_retry"
    async with Producer(broker.namesrv, "PG_retry") as producer:
        sent = await producer.send("Work", b"fails every time", tags="job")
    consumer = PullConsumer(broker.namesrv, group)
    async with asyncio.timeout(20):
        queues = await consumer.fetch_queues("Work")
        mq = next(q for q in queues if q.queue_id == sent.queue.queue_id)
        msg = (await consumer.pull(mq, sent.queue_offset)).messages[0]
        born = (msg.born_host, msg.born_timestamp)      # the producer's connection, not the consumer's
        addr = consumer._addr(mq)
        seen = []
        for attempt in range(1, 4):
            resp = await _send_back(consumer, addr, msg, group, max_times=2)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            if attempt < 3:
                retry_mq = (await consumer.fetch_queues(f"%RETRY%{group}"))[0]
                msg = await _pull_one(consumer, retry_mq, attempt - 1)
                seen.append((msg.topic, msg.reconsume_times, msg.properties["RETRY_TOPIC"], (msg.born_host,
                                                                                           msg.born_timestamp)))
        dlq = MessageQueue(f"%DLQ%{group}", mq.broker_name, 0)
        await consumer.fetch_queues(f"%DLQ%{group}")
        dead = (await consumer.pull(dlq, 0)).messages
    await consumer.shutdown()
    assert seen == [(f"%RETRY%{group}", 1, "Work", born), (f"%RETRY%{group}", 2, "Work", born)]
    assert [m.body for m in dead] == [b"fails every time"] and (dead[0].born_host, dead[0].born_timestamp) == born
    assert dead[0].properties["ORIGIN_MESSAGE_ID"] == sent.msg_id and dead[0].reconsume_times == 3


async def _call(broker, code, fields, body=b""):
    host, _, port = broker.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        return await conn.request(RemotingCommand.request(code, fields, body), 5.0)
    finally:
        conn.close()


async def _queue_size(broker, topic, qid=0):
    resp = await _call(broker, RequestCode.GET_MAX_OFFSET, {"topic": topic, "queueId": qid})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    return resp.int_field("offset")


@bounded(60)
async def test_group_retry_max_times_applies_when_the_request_names_none(broker_factory):
    """A consumer that sends no maxReconsumeTimes (rocketmq-client-cpp 1.x) gets its group's retryMaxTimes, as
    RocketMQ gives it; the broker's default (16 retries) was used whatever the operator had set."""
    broker = broker_factory()
    strict, lenient = "CG_no_retries", "CG_default_retries"
    resp = await _call(broker, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
                       json.dumps({"groupName": strict, "retryMaxTimes": 0}).encode())
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    async with Producer(broker.namesrv, "PG_retry_cfg") as producer:
        sent = await producer.send("Work", b"fails once")
    offset = int(sent.offset_msg_id[-16:], 16)
    for group in (strict, lenient):
        resp = await _call(broker, RequestCode.CONSUMER_SEND_MSG_BACK,
                           {"offset": offset, "group": group, "delayLevel": 0, "originMsgId": sent.msg_id})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
    # A retry sent straight to %RETRY% (the Java client's fallback when send-back fails) with no maximum either.
    header = SendMessageRequestHeader(producer_group="PG_retry_cfg", topic=f"%RETRY%{strict}", queue_id=0,
                                      properties="RETRY_TOPIC\x01Work\x02", reconsume_times=0)
    resp = await _call(broker, RequestCode.SEND_MESSAGE, header.to_ext_fields(v2=False), b"fails again")
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert await _queue_size(broker, f"%DLQ%{strict}") == 2
    assert await _queue_size(broker, f"%DLQ%{lenient}") == 0
    assert await _queue_size(broker, "SCHEDULE_TOPIC_XXXX", 2) == 1      # level 3 (the first retry): the lenient one
    # The request's own maximum still wins over the group's (V3_4_9 and later).
    resp = await _call(broker, RequestCode.CONSUMER_SEND_MSG_BACK,
                       {"offset": offset, "group": strict, "delayLevel": 0, "maxReconsumeTimes": 5})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert await _queue_size(broker, f"%DLQ%{strict}") == 2
    assert await _queue_size(broker, "SCHEDULE_TOPIC_XXXX", 2) == 2


def _spoil_stored_body(store_dir, phys: int) -> None:
    """Flip a bit of the body of the record at commit-log offset ``phys``: its CRC fails from now on."""
    segments = sorted(int(name) for name in os.listdir(os.path.join(store_dir, "commitlog")))
    start = max(s for s in segments if s <= phys)
    with open(os.path.join(store_dir, "commitlog", f"{start:020d}"), "r+b") as f:
        f.seek(phys - start + 88)       # IPv4 hosts: the body starts at byte 88 of the record
        first = f.read(1)
        f.seek(phys - start + 88)
        f.write(bytes([first[0] ^ 0x01]))


@bounded(40)
async def test_a_message_the_broker_cannot_take_back_still_retries_and_dead_letters(broker_factory):
    """CONSUMER_SEND_MSG_BACK copies the stored record, and the broker refuses when it cannot: the record was
    deleted by retention while the message was in hand, or its body went bad on disk since the pull. The push
    consumer then retried the message in place for good, every local_retry_delay_s: never counted towards
    max_reconsume_times, never dead-lettered, and nothing after it in its queue consumed. It now sends the
    message as pulled to %RETRY%<group> itself, as RocketMQ's consumer does, and the retries run their course."""
    b = broker_factory(*FAST)
    group = "CG_back_refused"
    async with Producer(b.namesrv, "PG_back_refused") as producer:
        sent = await producer.send("Spoilt", b"fails every time", tags="job")
        after = await producer.send("Spoilt", b"the next one", tags="job", queue=sent.queue)
    calls, done = [], asyncio.Event()

    def listener(msg):
        if msg.body == b"the next one":
            done.set()
            return ConsumeStatus.CONSUME_SUCCESS
        if not calls:       # pulled sound; spoilt on disk before it is handed back
            _spoil_stored_body(b.store_dir, msg.physical_offset)
        calls.append((msg.topic, msg.reconsume_times, msg.properties.get("RETRY_TOPIC")))
        if len(calls) >= 6:     # retried in place on and on: enough to tell
            done.set()
        return ConsumeStatus.RECONSUME_LATER

    consumer = PushConsumer(b.namesrv, group, listener, consume_from="first", max_reconsume_times=2,
                            local_retry_delay_s=0.05, suspend_ms=500)
    consumer.subscribe("Spoilt")
    handed_back = consumer.client.send_back
    dead_lettered = asyncio.Event()

    async def send_back(mq, msg, **kwargs):
        await handed_back(mq, msg, **kwargs)
        if msg.reconsume_times >= 2:
            dead_lettered.set()
    consumer.client.send_back = send_back
    async with consumer:
        await done.wait()       # the queue moved on to the next message; the retries go on through %RETRY%
        assert calls[:1] == [("Spoilt", 0, None)]
        assert len(calls) < 6, f"retried in place, never handed back: {calls}"
        await dead_lettered.wait()
    probe = PullConsumer(b.namesrv, "CG_probe")
    await probe.fetch_queues(f"%DLQ%{group}")
    dead = await _pull_one(probe, MessageQueue(f"%DLQ%{group}", sent.queue.broker_name, 0), 0)
    await probe.shutdown()
    assert calls == [("Spoilt", 0, None), ("Spoilt", 1, "Spoilt"), ("Spoilt", 2, "Spoilt")]
    assert dead.body == b"fails every time" and dead.reconsume_times == 3
    assert dead.properties["RETRY_TOPIC"] == "Spoilt" and dead.properties["UNIQ_KEY"] == sent.msg_id
    check = PullConsumer(b.namesrv, group)
    mq = MessageQueue("Spoilt", sent.queue.broker_name, sent.queue.queue_id)
    await check.fetch_queues("Spoilt")
    assert await check.fetch_offset(mq) == after.queue_offset + 1
    await check.shutdown()


@bounded(30)
async def test_a_message_the_broker_cannot_take_back_is_dead_lettered_when_asked(broker_factory):
    """delayLevel -1 (an orderly consumer out of retries) goes to %DLQ%<group> at once, also when the broker
    cannot copy the stored record and the message as pulled is sent instead."""
    b = broker_factory(*FAST)
    group = "CG_dead_refused"
    async with Producer(b.namesrv, "PG_dead_refused") as producer:
        sent = await producer.send("Spoilt", b"out of retries")
    consumer = PullConsumer(b.namesrv, group)
    await consumer.subscribe("Spoilt")
    [msg] = (await consumer.pull(sent.queue, sent.queue_offset, max_nums=1)).messages
    _spoil_stored_body(b.store_dir, msg.physical_offset)
    await consumer.send_back(sent.queue, msg, max_reconsume_times=5, delay_level=-1)
    await consumer.fetch_queues(f"%DLQ%{group}")
    dead = await _pull_one(consumer, MessageQueue(f"%DLQ%{group}", sent.queue.broker_name, 0), 0)
    await consumer.shutdown()
    assert dead.body == b"out of retries" and dead.reconsume_times == 5
    assert dead.properties["RETRY_TOPIC"] == "Spoilt" and dead.properties["ORIGIN_MESSAGE_ID"] == sent.msg_id


@bounded(40)
async def test_a_message_forwarded_from_a_retry_is_its_own_when_it_is_retried_in_turn(broker_factory, tmp_path):
    """A message consumed from a retry (RETRY_TOPIC=Orders) and forwarded to Enriched with its properties
    carries RETRY_TOPIC=Orders there. When the Enriched consumer fails it, the broker's copy kept that
    RETRY_TOPIC (set only when missing), so the retry claimed to be an Orders message: the push consumer
    gave it to the listener as one, and run_once, keys scoped by topic, found stage one's Orders key and
    skipped it: the forwarded message's handler never ran, nothing said. A copy of a record stored in an
    ordinary topic names that topic."""
    from consumer import SqliteIdempotency
    b = broker_factory(*FAST)
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    ran, outcome = [], asyncio.Event()
    stage2_seen = []
    from tests.support.cluster_process import create_topic
    await create_topic(f"127.0.0.1:{b.broker_port}", "Enriched", 1)
    async with Producer(b.namesrv, "PG_fwd") as producer:
        await producer.send("Orders", b"order-1")

        async def stage1(msg):
            if msg.reconsume_times == 0:
                return ConsumeStatus.RECONSUME_LATER        # consumed from %RETRY%CG_stage1 the next time
            if ledger.run_once(msg, lambda m, db: ran.append(("stage1", m.topic))):
                props = {k: v for k, v in msg.properties.items() if k not in ("DELAY", "REAL_TOPIC", "REAL_QID")}
                await producer.send("Enriched", msg.body, properties=props)
            return ConsumeStatus.CONSUME_SUCCESS

        def stage2(msg):
            stage2_seen.append((msg.topic, msg.reconsume_times))
            if msg.reconsume_times == 0:
                return ConsumeStatus.RECONSUME_LATER
            if not ledger.run_once(msg, lambda m, db: ran.append(("stage2", m.topic))):
                ran.append(("stage2 skipped", msg.topic))
            outcome.set()
            return ConsumeStatus.CONSUME_SUCCESS

        first = PushConsumer(b.namesrv, "CG_stage1", stage1, consume_from="first", suspend_ms=300)
        first.subscribe("Orders")
        second = PushConsumer(b.namesrv, "CG_stage2", stage2, consume_from="first", suspend_ms=300)
        second.subscribe("Enriched")
        async with first, second:
            await outcome.wait()
    ledger.close()
    assert ran == [("stage1", "Orders"), ("stage2", "Enriched")], ran
    assert stage2_seen == [("Enriched", 0), ("Enriched", 1)], stage2_seen


@bounded(30)
async def test_a_forwarded_message_the_broker_cannot_take_back_is_retried_as_its_own_topics(broker_factory):
    """The consumer's own resend (the broker could not copy the record) named the topic from the message's
    RETRY_TOPIC when it had one: a message forwarded from a retry, pulled from its own topic, went to
    %RETRY%<group> as a message of the topic it was forwarded from. The queue pulled from says which it is."""
    b = broker_factory(*FAST)
    group = "CG_fwd_refused"
    async with Producer(b.namesrv, "PG_fwd_refused") as producer:
        sent = await producer.send("Enriched", b"forwarded", properties={"RETRY_TOPIC": "Orders"})
    consumer = PullConsumer(b.namesrv, group)
    await consumer.subscribe("Enriched")
    [msg] = (await consumer.pull(sent.queue, sent.queue_offset, max_nums=1)).messages
    _spoil_stored_body(b.store_dir, msg.physical_offset)
    await consumer.send_back(sent.queue, msg, max_reconsume_times=5)
    await consumer.fetch_queues(f"%RETRY%{group}")
    again = await _pull_one(consumer, MessageQueue(f"%RETRY%{group}", sent.queue.broker_name, 0), 0)
    await consumer.shutdown()
    assert again.body == b"forwarded" and again.reconsume_times == 1
    assert again.properties["RETRY_TOPIC"] == "Enriched"


@bounded(90)
async def test_a_read_only_brokers_failed_message_is_resent_to_another_brokers_retry_topic(tmp_path, broker_factory):
    """A broker made read-only for maintenance (updateBrokerConfig brokerPermission=4) refuses send-backs
    NO_PERMISSION while its backlog drains. The consumer's own resend to %RETRY%<group> went to that same broker
    alone and was refused too, so each failed message of it was retried in place for as long as it stayed
    read-only: its queue never drained past it. The resend now goes to another writable broker of the retry
    topic's route, as RocketMQ's fallback producer routes it."""
    from tests.support.cluster_process import (NamesrvProcess, cluster_flags, create_topic, request, stored_count,
                                               wait_for_route)
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    try:
        a = broker_factory(*cluster_flags(namesrv.addr, "broker-a", 60_000), store="a")
        b = broker_factory(*cluster_flags(namesrv.addr, "broker-b", 60_000), store="b")
        for broker in (a, b):
            await create_topic(broker.broker, "Drain", 1)
        await wait_for_route(namesrv.addr, "Drain", {"broker-a", "broker-b"})
        mq = MessageQueue("Drain", "broker-a", 0)
        async with Producer(namesrv.addr, "PG_drain") as producer:
            for body in (b"to-retry", b"to-dlq"):
                await producer.send("Drain", body, queue=mq)
        async with PullConsumer(namesrv.addr, "CG_drain") as consumer:
            await consumer.subscribe("Drain")        # its heartbeat makes %RETRY%CG_drain on both brokers
            await wait_for_route(namesrv.addr, "%RETRY%CG_drain", {"broker-a", "broker-b"})
            done = await request(a.broker, RequestCode.UPDATE_BROKER_CONFIG, None, b"brokerPermission=4\n")
            assert done.code == ResponseCode.SUCCESS, done.remark
            got = await consumer.pull(mq, 0)
            retry, dead = got.messages
            await consumer.send_back(mq, retry)                     # backoff: into B's schedule topic
            await consumer.send_back(mq, dead, delay_level=-1)      # dead-lettered at once, on B
        assert await stored_count(b.broker, "%DLQ%CG_drain", 1) == 1
        assert await stored_count(b.broker, "SCHEDULE_TOPIC_XXXX", 18) == 1
        assert await stored_count(a.broker, "SCHEDULE_TOPIC_XXXX", 18) == 0
    finally:
        namesrv.kill()


def _stock_heartbeat(group: str) -> bytes:
    """A 4.9.8 push consumer's HEART_BEAT body: its group and the retry topic it subscribes to."""
    return json.dumps({"clientID": "127.0.0.1@stock", "producerDataSet": [], "consumerDataSet": [{
        "groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
        "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False, "subscriptionDataSet": [{
            "topic": f"%RETRY%{group}", "subString": "*", "tagsSet": [], "codeSet": [], "subVersion": 1,
            "expressionType": "TAG", "classFilterMode": False}]}]}).encode()


@bounded(60)
async def test_group_retry_queue_nums_is_its_retry_topics_queues_and_zero_turns_retries_off(broker_factory):
    """retryQueueNums (updateSubGroup -q), as RocketMQ's heartbeat and send-back read it: the group's retry topic
    has that many queues and each failed message goes to one of them at random; 0 turns retries off (the send-back
    is answered SUCCESS and nothing is stored, not even for the dead-letter queue). It was ignored: every group had
    one retry queue, so all its retries landed on the one consumer holding it, and a group set to 0 had its failed
    messages delivered again and dead-lettered all the same."""
    broker = broker_factory(*FAST)      # level n waits n x 100 ms
    wide, none = "CG_wide_retry", "CG_no_retry"
    for group, queues in ((wide, 4), (none, 0)):
        resp = await _call(broker, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
                           json.dumps({"groupName": group, "retryQueueNums": queues}).encode())
        assert resp.code == ResponseCode.SUCCESS, resp.remark
    resp = await _call(broker, RequestCode.HEART_BEAT, {}, _stock_heartbeat(wide))
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    async with Producer(broker.namesrv, "PG_retry_queues") as producer:
        sent = await producer.send("Work", b"fails")
    offset = int(sent.offset_msg_id[-16:], 16)
    async with PullConsumer(broker.namesrv, "CG_retry_queues_probe") as consumer:
        retry_queues = await consumer.fetch_queues(f"%RETRY%{wide}")
        assert sorted(q.queue_id for q in retry_queues) == [0, 1, 2, 3]
        count = 24
        for _ in range(count):
            resp = await _call(broker, RequestCode.CONSUMER_SEND_MSG_BACK, {
                "offset": offset, "group": wide, "delayLevel": 1, "originMsgId": sent.msg_id, "maxReconsumeTimes": 16})
            assert resp.code == ResponseCode.SUCCESS, resp.remark
        got = {q.queue_id: 0 for q in retry_queues}
        while sum(got.values()) < count:        # each delivered after its level-1 wait: read them as they come
            for q in retry_queues:
                got[q.queue_id] += len((await consumer.pull(q, got[q.queue_id], suspend_ms=100)).messages)
    assert sum(got.values()) == count and sum(1 for n in got.values() if n) > 1, got   # 4**-23 to fail by chance
    for delay_level in (0, -1):
        resp = await _call(broker, RequestCode.CONSUMER_SEND_MSG_BACK, {
            "offset": offset, "group": none, "delayLevel": delay_level, "originMsgId": sent.msg_id,
            "maxReconsumeTimes": 16})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert await _queue_size(broker, "SCHEDULE_TOPIC_XXXX", 2) == 0      # level 3: a first retry's backoff
    assert await _queue_size(broker, f"%DLQ%{none}") == 0



async def _set_retry_queue_nums(broker, group: str, queues: int) -> None:
    resp = await _call(broker, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
                       json.dumps({"groupName": group, "retryQueueNums": queues}).encode())
    assert resp.code == ResponseCode.SUCCESS, resp.remark


async def _send_backs_land(broker, consumer, group: str, sent, count: int, start: dict) -> dict:
    """Hand ``sent`` back ``count`` times for ``group`` (delay level 1) and read the retry topic's queues, from the
    offsets in ``start``, until all ``count`` copies are delivered: {queue id: copies read}."""
    offset = int(sent.offset_msg_id[-16:], 16)
    for _ in range(count):
        resp = await _call(broker, RequestCode.CONSUMER_SEND_MSG_BACK, {
            "offset": offset, "group": group, "delayLevel": 1, "originMsgId": sent.msg_id, "maxReconsumeTimes": 16})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
    queues = await consumer.fetch_queues(f"%RETRY%{group}")
    got = {q.queue_id: 0 for q in queues}
    while sum(got.values()) < count:
        for q in queues:
            got[q.queue_id] += len((await consumer.pull(q, start.get(q.queue_id, 0) + got[q.queue_id],
                                                        suspend_ms=100)).messages)
    for qid, n in got.items():
        start[qid] = start.get(qid, 0) + n
    return got


@bounded(90)
async def test_a_retry_topic_made_before_retry_queue_nums_was_raised_grows_to_it_and_never_shrinks(broker_factory):
    """A group's retry topic is usually made by its first heartbeat, with the queues its config says then: one for a
    group an operator sets later (updateSubGroup -q 4 once its consumers run), or for every group of a store
    written before retryQueueNums was obeyed. Such a topic kept its one queue for good, so the setting did nothing.
    It grows to the group's retryQueueNums (as soon as it is set, and at the group's next heartbeat or send-back,
    as after an upgrade); lowered again, the topic keeps its queues, so no retry already in one is left unread,
    and new retries go to the group's first queues only, as RocketMQ's send-back picks them."""
    broker = broker_factory(*FAST)
    group, upgraded = "CG_grown_retry", "CG_upgraded_retry"
    for g in (group, upgraded):
        resp = await _call(broker, RequestCode.HEART_BEAT, {}, _stock_heartbeat(g))
        assert resp.code == ResponseCode.SUCCESS, resp.remark
    async with Producer(broker.namesrv, "PG_grown_retry") as producer:
        sent = await producer.send("Work", b"fails")
    async with PullConsumer(broker.namesrv, "CG_grown_retry_probe") as consumer:
        read: dict[int, int] = {}
        assert await _send_backs_land(broker, consumer, group, sent, 3, read) == {0: 3}
        await _set_retry_queue_nums(broker, group, 4)
        queues = await consumer.fetch_queues(f"%RETRY%{group}")
        assert sorted(q.queue_id for q in queues) == [0, 1, 2, 3]
        got = await _send_backs_land(broker, consumer, group, sent, 24, read)
        assert sum(1 for n in got.values() if n) > 1, got        # 4**-23 to fail by chance
        await _set_retry_queue_nums(broker, group, 1)
        queues = await consumer.fetch_queues(f"%RETRY%{group}")
        assert sorted(q.queue_id for q in queues) == [0, 1, 2, 3]     # what is in queues 1-3 is still read
        assert await _send_backs_land(broker, consumer, group, sent, 8, read) == {0: 8, 1: 0, 2: 0, 3: 0}
    # A store written before: the group configured for 4 retry queues, its retry topic made with one.
    await _set_retry_queue_nums(broker, upgraded, 4)
    assert broker.stop() == 0
    path = broker.store_dir / "config" / "topics.json"
    catalogue = json.loads(path.read_text())
    for entry in catalogue["topics"]:
        if entry["name"] == f"%RETRY%{upgraded}":
            entry["read_queue_nums"] = entry["write_queue_nums"] = 1
    path.write_text(json.dumps(catalogue))
    broker.start()
    resp = await _call(broker, RequestCode.HEART_BEAT, {}, _stock_heartbeat(upgraded))
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    async with PullConsumer(broker.namesrv, "CG_grown_retry_probe") as consumer:
        queues = await consumer.fetch_queues(f"%RETRY%{upgraded}")
        assert sorted(q.queue_id for q in queues) == [0, 1, 2, 3]


@bounded(60)
async def test_a_stored_group_with_retry_queue_nums_zero_is_warned_of_at_start_and_when_set(broker_factory):
    """retryQueueNums 0 was stored and ignored before this version; obeyed now, that group's failed messages are
    gone (SUCCESS, nothing stored, as RocketMQ). A store carried over from before changes behaviour on upgrade
    with nothing said but an INFO line on the first such message: the broker warns at start, for each group so set,
    and when an operator sets it."""
    broker = broker_factory()
    await _set_retry_queue_nums(broker, "CG_set_to_zero", 0)
    assert "CG_set_to_zero has retryQueueNums 0" in broker.log()
    assert broker.stop() == 0
    before = len(broker.log_path.read_text())
    broker.start()
    resp = await _call(broker, RequestCode.GET_BROKER_RUNTIME_INFO, {})      # started and serving
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert "CG_set_to_zero has retryQueueNums 0" in broker.log_path.read_text()[before:]


@bounded(60)
async def test_a_retry_topic_deleted_while_its_send_back_waits_is_made_again_and_the_retry_delivered(broker_factory):
    """A send-back that makes %RETRY%<group> waits for topics.json; a DELETE_TOPIC_IN_BROKER of that topic in the
    same moment (sent right behind it) took it away meanwhile, and the send-back was answered SYSTEM_ERROR
    "KeyError" (logged as a bug), every time. It is made again now, as by a send-back just after the delete (and
    RocketMQ, whose send-back does not wait, stores the retry): both answered SUCCESS, the retry delivered."""
    broker = broker_factory(*FAST)
    async with Producer(broker.namesrv, "PG_retry_del") as producer:
        sent = await producer.send("Work", b"fails while its retry topic goes")
    offset = int(sent.offset_msg_id[-16:], 16)
    groups = [f"CG_del_race{i}" for i in range(4)]
    client = await RawClient.open(broker.broker)
    try:
        for i, group in enumerate(groups):
            back = RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK,
                                           {"offset": offset, "group": group, "delayLevel": 0}, opaque=2 * i + 1)
            delete = RemotingCommand.request(RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": f"%RETRY%{group}"},
                                             opaque=2 * i + 2)
            client.write(back.encode() + delete.encode())     # one write: read and dispatched together
            backed, deleted = await client.reply(back.opaque, 10), await client.reply(delete.opaque, 10)
            assert [(r.code, r.remark) for r in backed] == [(ResponseCode.SUCCESS, None)], group
            assert [r.code for r in deleted] == [ResponseCode.SUCCESS], deleted[0].remark
    finally:
        client.close()
    consumer = PullConsumer(broker.namesrv, "CG_del_reader")
    try:
        async with asyncio.timeout(30):
            for group in groups:
                retry_mq = (await consumer.fetch_queues(f"%RETRY%{group}"))[0]
                msg = await _pull_one(consumer, retry_mq, 0)
                assert (msg.body, msg.reconsume_times) == (b"fails while its retry topic goes", 1)
    finally:
        await consumer.shutdown()
    assert "CONSUMER_SEND_MSG_BACK from" not in broker.log()


class _Commits:
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    async def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT_MESSAGE


@bounded(60)
async def test_a_committed_transactions_retry_and_dead_letter_are_plain_messages_a_redrive_delivers(broker_factory):
    """The retries and dead letter of a committed transaction's message are plain messages, as a stock client's own
    resend makes them since 4.6.1 (RocketMQ 4.9.8's send-back copies the commit's TRAN_MSG: this differs on
    purpose): they carried the half's TRAN_MSG=true, so a dead letter sent again with its properties
    -- a stock producer types it PREPARED for that -- was refused MESSAGE_ILLEGAL as another producer group's half
    (under its own group: stored as a half, checked, never delivered to the topic)."""
    broker = broker_factory(*FAST)
    group = "CG_tx_retry"
    async with TransactionProducer(broker.namesrv, "PG_tx_orig", _Commits()) as producer:
        done = await producer.send_in_transaction("TxWork", b"committed, then failed")
    assert done.acknowledged
    consumer = PullConsumer(broker.namesrv, group)
    try:
        async with asyncio.timeout(30):
            mq = next(q for q in await consumer.fetch_queues("TxWork")
                      if q.queue_id == done.send_result.queue.queue_id)
            msg = await _pull_one(consumer, mq, 0)
            addr = consumer._addr(mq)
            resp = await _send_back(consumer, addr, msg, group, max_times=1)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            retry = await _pull_one(consumer, (await consumer.fetch_queues(f"%RETRY%{group}"))[0], 0)
            resp = await _send_back(consumer, addr, retry, group, max_times=1)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            await consumer.fetch_queues(f"%DLQ%{group}")
            dead = await _pull_one(consumer, MessageQueue(f"%DLQ%{group}", mq.broker_name, 0), 0)
    finally:
        await consumer.shutdown()
    assert (retry.reconsume_times, dead.reconsume_times, dead.body) == (1, 2, b"committed, then failed")
    assert "TRAN_MSG" not in retry.properties and "TRAN_MSG" not in dead.properties, dead.properties
    # An operator's redrive: the dead letter to its topic with its properties, typed as DefaultMQProducerImpl
    # types a message by its TRAN_MSG.
    before = await _queue_size(broker, "TxWork", mq.queue_id)
    prepared = 4 if dead.properties.get("TRAN_MSG", "").lower() == "true" else 0
    header = SendMessageRequestHeader(producer_group="PG_redrive", topic="TxWork", queue_id=mq.queue_id,
                                      sys_flag=prepared, properties=properties_to_string(dead.properties))
    resp = await _call(broker, RequestCode.SEND_MESSAGE, header.to_ext_fields(v2=False), dead.body)
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert await _queue_size(broker, "TxWork", mq.queue_id) == before + 1


@bounded(60)
async def test_a_send_back_to_a_read_only_retry_topic_is_refused_and_stores_nothing(broker_factory):
    """An operator made a group's retry topic read-only (updateTopicPerm -p 4): RocketMQ's send-back answers
    NO_PERMISSION, for a retry and a dead letter alike, and the consumer retries the message itself. The broker
    stored both as if the topic were writable, the retry delivered into the read-only topic."""
    broker = broker_factory()
    group = "CG_read_only_retries"
    resp = await _call(broker, RequestCode.UPDATE_AND_CREATE_TOPIC, {
        "topic": f"%RETRY%{group}", "readQueueNums": 1, "writeQueueNums": 1, "perm": 4})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    async with Producer(broker.namesrv, "PG_read_only") as producer:
        sent = await producer.send("Work", b"fails")
    offset = int(sent.offset_msg_id[-16:], 16)
    for delay_level in (0, -1):
        resp = await _call(broker, RequestCode.CONSUMER_SEND_MSG_BACK,
                           {"offset": offset, "group": group, "delayLevel": delay_level, "maxReconsumeTimes": 16})
        assert (resp.code, resp.remark) == (ResponseCode.NO_PERMISSION,
                                            f"the topic[%RETRY%{group}] sending message is forbidden")
    assert await _queue_size(broker, "SCHEDULE_TOPIC_XXXX", 2) == 0       # level 3: the first retry's
    resp = await _call(broker, RequestCode.GET_MAX_OFFSET, {"topic": f"%DLQ%{group}", "queueId": 0})
    assert resp.code != ResponseCode.SUCCESS or resp.int_field("offset") == 0, resp.remark


@bounded(90)
async def test_kill_9_with_retries_waiting_in_the_schedule_delivers_each_once_with_its_count(broker_factory):
    """Messages given back with delay levels wait in SCHEDULE_TOPIC_XXXX; a kill -9 paced by the send-backs
    answered: after the restart each answered one reaches %RETRY%<group> once, reconsumeTimes 1, RETRY_TOPIC kept."""
    broker = broker_factory(*FAST)
    group, total = "CG_sched_kill", 120
    async with Producer(broker.namesrv, "PG_sched_kill") as producer:
        sent = {(await producer.send("SchedRetry", b"r%d" % i)).msg_id for i in range(total)}
    consumer = PullConsumer(broker.namesrv, group)
    answered = set()
    try:
        pulled = [(mq, msg) for mq in await consumer.fetch_queues("SchedRetry")
                  for msg in (await consumer.pull(mq, 0, max_nums=64)).messages]
        for mq, msg in pulled[:total // 2]:
            await consumer.send_back(mq, msg, delay_level=5 + len(answered) % 14)
            answered.add(msg.properties["UNIQ_KEY"])
        broker.kill()                       # SIGKILL with half given back, most of them still waiting
    finally:
        await consumer.shutdown()
    broker = broker_factory(*FAST)          # same store
    consumer = PullConsumer(broker.namesrv, group)
    retry = []
    try:
        mq = (await consumer.fetch_queues(f"%RETRY%{group}"))[0]
        offset = 0
        while len(retry) < len(answered):
            got = await consumer.pull(mq, offset, suspend_ms=1000)
            retry += got.messages
            offset = got.next_begin_offset
        await asyncio.sleep(2.0)            # past the longest delay (1.8 s): anything repeated is there now
        retry += (await consumer.pull(mq, offset)).messages
    finally:
        await consumer.shutdown()
    keys = [m.properties["UNIQ_KEY"] for m in retry]
    assert sorted(keys) == sorted(answered) and answered <= sent
    assert {(m.reconsume_times, m.properties["RETRY_TOPIC"]) for m in retry} == {(1, "SchedRetry")}


@bounded(60)
async def test_a_send_back_whose_counts_are_past_javas_int_is_refused_and_stores_nothing(broker_factory):
    """ConsumerSendMsgBackRequestHeader's delayLevel and maxReconsumeTimes are Java Integers: RocketMQ 4.9.8's
    header decode throws past the int range and the send-back is SYSTEM_ERROR, nothing stored. Taken, a
    maxReconsumeTimes of 2^31 was never reached (the count stops at the int's maximum): the message was retried
    for good, never dead-lettered; a delayLevel of 2^31 sent the retry at once, its DELAY kept in it."""
    broker = broker_factory()
    group = "CG_past_int"
    async with Producer(broker.namesrv, "PG_past_int") as producer:
        sent = await producer.send("PastInt", b"fails")
    offset = int(sent.offset_msg_id[-16:], 16)
    for field, value in (("maxReconsumeTimes", 1 << 31), ("delayLevel", 1 << 31), ("delayLevel", -(1 << 31) - 1)):
        fields = {"offset": offset, "group": group, "delayLevel": 0, "maxReconsumeTimes": 16, field: value}
        resp = await _call(broker, RequestCode.CONSUMER_SEND_MSG_BACK, fields)
        assert (resp.code, resp.remark) == (ResponseCode.SYSTEM_ERROR,
                                            f"the header field {field}={str(value)!r} is past Java's int range")
    for topic in (f"%RETRY%{group}", f"%DLQ%{group}"):
        resp = await _call(broker, RequestCode.GET_MAX_OFFSET, {"topic": topic, "queueId": 0})
        assert resp.code != ResponseCode.SUCCESS or resp.int_field("offset") == 0, resp.remark
    assert sum([await _queue_size(broker, "SCHEDULE_TOPIC_XXXX", qid) for qid in range(18)]) == 0
