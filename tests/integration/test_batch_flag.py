"""Batches the way every stock client sends them: SEND_BATCH_MESSAGE (320), and SEND_MESSAGE (10) /
SEND_MESSAGE_V2 (310) with the header's batch field set, as rocketmq-client-cpp 1.0.1 does.

Each entry must arrive as its own message with its own UNIQ_KEY, KEYS and TAGS; the batch header's properties
(the cpp client puts the batch's own UNIQ_KEY there) must not overwrite them. A malformed or delayed batch is
refused with MESSAGE_ILLEGAL and stores nothing.
"""
from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from consumer import PullConsumer
from consumer.pull_consumer import MessageQueue
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import encode_batch

pytestmark = pytest.mark.asyncio

SEP, PAIR = "\x02", "\x01"


def _props(**pairs) -> str:
    """A properties string as the Java and cpp clients write it (each pair ends with U+0002)."""
    return "".join(f"{k}{PAIR}{v}{SEP}" for k, v in pairs.items())


def _entries(n: int, tag: str):
    return [(0, f"{tag}-{i}".encode(),
             _props(WAIT="true", KEYS=f"order-{tag}-{i}", TAGS=f"T{i % 3}", UNIQ_KEY=f"UNIQ-{tag}-{i:04d}"))
            for i in range(n)]


def _v1_fields(topic: str, queue_id: int, properties: str, **extra) -> dict:
    fields = {"producerGroup": "PG_cpp", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "4",
              "queueId": str(queue_id), "sysFlag": "0", "bornTimestamp": str(int(time.time() * 1000)),
              "flag": "0", "properties": properties, "reconsumeTimes": "0", "unitMode": "false"}
    fields.update(extra)
    return fields


_V2 = {"producerGroup": "a", "topic": "b", "defaultTopic": "c", "defaultTopicQueueNums": "d", "queueId": "e",
       "sysFlag": "f", "bornTimestamp": "g", "flag": "h", "properties": "i", "reconsumeTimes": "j",
       "unitMode": "k", "batch": "m"}


async def _send(broker, code: int, fields: dict, body: bytes) -> RemotingCommand:
    host, _, port = broker.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        return await conn.request(RemotingCommand.request(code, fields, body, version=409), 10)
    finally:
        conn.close()


async def _pull_all(broker, topic: str, queue_id: int, group: str):
    consumer = PullConsumer(broker.namesrv, group)
    try:
        queues = await consumer.fetch_queues(topic)
        mq = MessageQueue(topic, queues[0].broker_name, queue_id)
        res = await consumer.pull(mq, 0, max_nums=64)
        return res.messages
    finally:
        await consumer.shutdown()


@pytest.mark.parametrize("code, header", [
    (RequestCode.SEND_MESSAGE, "v1"),            # rocketmq-client-cpp 1.0.1: code 10, "batch": "true"
    (RequestCode.SEND_MESSAGE_V2, "v2"),         # code 310 with the V2 key "m"
    (RequestCode.SEND_BATCH_MESSAGE, "v2"),      # Java and Go clients
])
async def test_each_entry_of_a_batch_is_its_own_message(broker, code, header):
    topic = f"CppBatch{code}"
    entries = _entries(10, str(code))
    batch_props = _props(WAIT="true", UNIQ_KEY="THE-BATCH-ITSELF", KEYS="batch-level-key")
    fields = _v1_fields(topic, 1, batch_props, batch="true")
    if header == "v2":
        fields = {_V2[k]: v for k, v in fields.items()}
    async with asyncio.timeout(30):
        reply = await _send(broker, code, fields, encode_batch(entries))
        assert reply.code == ResponseCode.SUCCESS, reply.remark
        assert len(reply.ext_fields["msgId"].split(",")) == 10
        assert int(reply.ext_fields["queueOffset"]) == 0
        messages = await _pull_all(broker, topic, 1, f"CG_{code}")
    assert [m.body for m in messages] == [e[1] for e in entries]          # not one message holding the batch
    assert [m.queue_offset for m in messages] == list(range(10))
    for i, m in enumerate(messages):
        assert m.properties["UNIQ_KEY"] == f"UNIQ-{code}-{i:04d}"         # its own id, not the batch's
        assert m.properties["KEYS"] == f"order-{code}-{i}"                # its own keys win over the batch's
        assert m.tags == f"T{i % 3}"
        assert m.properties["CLUSTER"] == "DefaultCluster"
        assert "WAIT" not in m.properties
    assert len({m.msg_id for m in messages}) == 10


async def test_batch_flag_false_stays_a_single_message(broker):
    body = b"just one message"
    reply = await _send(broker, RequestCode.SEND_MESSAGE,
                        _v1_fields("CppSingle", 0, _props(UNIQ_KEY="ONE"), batch="false"), body)
    assert reply.code == ResponseCode.SUCCESS, reply.remark
    async with asyncio.timeout(30):
        messages = await _pull_all(broker, "CppSingle", 0, "CG_single")
    assert [m.body for m in messages] == [body]


@pytest.mark.parametrize("what, body, props, remark", [
    ("cut short", encode_batch(_entries(3, "cut"))[:-5], "", "claims"),
    ("garbage", b"\x00\x00\x00\x05garbage-that-is-not-a-batch", "", "batch entry"),
    ("delayed entry", encode_batch([(0, b"x", _props(DELAY="2", UNIQ_KEY="D1"))]), "", "cannot be delayed"),
    ("delayed batch", encode_batch(_entries(2, "d")), _props(DELAY="1"), "cannot be delayed"),
    ("timer entry", encode_batch([(0, b"x", _props(TIMER_DELIVER_MS="9999999999999"))]), "", "cannot be delayed"),
    # Aliyun's timer (ali-ons' setStartDeliverTime) names no TIMER_: it was stored at once, by both batch paths.
    ("aliyun timer entry", encode_batch([(0, b"x", _props(__STARTDELIVERTIME="9999999999999"))]), "",
     "cannot be delayed"),
    ("aliyun timer entry, not first", encode_batch(
        [(0, b"x", _props(UNIQ_KEY="A1")), (0, b"x", _props(__STARTDELIVERTIME="9999999999999"))]), "",
     "cannot be delayed"),
    ("aliyun timer entry, slow path", encode_batch(
        [(0, b"x", _props(WAIT="true", __STARTDELIVERTIME="9999999999999"))]), "", "cannot be delayed"),
    # A single send waits for TIMER_DELAY_SEC (it comes before TIMER_DELIVER_MS); the batch paths judged the first
    # key of TIMER_PROPS alone, TIMER_DELIVER_MS=0 (a time gone by), and stored it at once.
    ("timer entry behind a zero", encode_batch([(0, b"x", _props(TIMER_DELIVER_MS="0", TIMER_DELAY_SEC="60"))]),
     "", "cannot be delayed"),
    ("timer entry behind a zero, slow path", encode_batch(
        [(0, b"x", _props(WAIT="true", TIMER_DELIVER_MS="0", TIMER_DELAY_SEC="60"))]), "", "cannot be delayed"),
    ("timer batch behind a zero", encode_batch(_entries(2, "z")), _props(TIMER_DELIVER_MS="0", TIMER_DELAY_MS="60000"),
     "cannot be delayed"),
    ("transactional entry", encode_batch([(0, b"x", _props(TRAN_MSG="true"))]), "", "cannot be transactional"),
    ("spaced delay batch", encode_batch(_entries(2, "d")), _props(DELAY=" 3"), "DELAY=' 3', which is not a whole"),
    ("spaced timer entry", encode_batch([(0, b"x", _props(TIMER_DELAY_SEC=" 5"))]), "", "' 5', which is not a whole"),
    # past int()'s 4,300 digits: its ValueError escaped the batch check, answered SYSTEM_ERROR "ValueError"
    ("huge delay entry", encode_batch([(0, b"x", _props(DELAY="9" * 5000))]), "", "which is past Java's int range"),
    ("huge timer batch", encode_batch(_entries(2, "h")), _props(TIMER_DELAY_MS="9" * 5000), "past Java's long range"),
])
async def test_bad_batches_are_refused_and_store_nothing(broker, what, body, props, remark):
    topic = "CppRefused"
    async with asyncio.timeout(30):
        reply = await _send(broker, RequestCode.SEND_MESSAGE, _v1_fields(topic, 0, props, batch="true"), body)
        assert reply.code == ResponseCode.MESSAGE_ILLEGAL, (what, reply.code, reply.remark)
        assert remark in reply.remark
        good = await _send(broker, RequestCode.SEND_MESSAGE, _v1_fields(topic, 0, "", batch="true"),
                           encode_batch(_entries(2, "ok")))
        assert good.code == ResponseCode.SUCCESS
        messages = await _pull_all(broker, topic, 0, "CG_refused")
    # Only the good batch was stored: the refused one left no partial entries before it.
    assert [m.body for m in messages][-2:] == [b"ok-0", b"ok-1"]
    assert all(not m.body.startswith((b"cut", b"x", b"d-")) for m in messages)


_GONE_BY = str(int(time.time() * 1000) - 600_000)     # a time a delivered message's __STARTDELIVERTIME holds


@pytest.mark.parametrize("what, body, props", [
    # A message the timer delivered keeps __STARTDELIVERTIME (ali-ons' getStartDeliverTime()); a consumer that
    # forwards what it got in a batch was refused MESSAGE_ILLEGAL "cannot be delayed", where the same message sent
    # alone is stored at once (levels.divert: a time gone by asks nothing).
    ("forwarded delivered entries", encode_batch(
        [(0, b"f-%d" % i, _props(UNIQ_KEY=f"F{i}", __STARTDELIVERTIME=_GONE_BY)) for i in range(2)]), ""),
    ("forwarded delivered entry, slow path", encode_batch(
        [(0, b"f-0", _props(WAIT="true", __STARTDELIVERTIME=_GONE_BY)), (0, b"f-1", _props(UNIQ_KEY="F1"))]), ""),
    ("a batch with a time gone by", encode_batch([(0, b"f-0", ""), (0, b"f-1", "")]),
     _props(TIMER_DELIVER_MS=_GONE_BY)),
    # DELAY 0 or below is no delay for a single send and for RocketMQ's batch check (getDelayTimeLevel() > 0).
    ("a batch with DELAY -1", encode_batch([(0, b"f-0", ""), (0, b"f-1", "")]), _props(DELAY="-1")),
    ("an entry with DELAY -1", encode_batch([(0, b"f-0", _props(DELAY="-1")), (0, b"f-1", "")]), ""),
])
async def test_batches_a_single_send_stores_at_once_are_stored(broker, what, body, props):
    topic = "BatchNoWait"
    async with asyncio.timeout(30):
        reply = await _send(broker, RequestCode.SEND_MESSAGE, _v1_fields(topic, 0, props, batch="true"), body)
        assert reply.code == ResponseCode.SUCCESS, (what, reply.code, reply.remark)
        messages = await _pull_all(broker, topic, 0, "CG_no_wait")
    assert [m.body for m in messages][-2:] == [b"f-0", b"f-1"], what


async def test_a_oneway_send_is_stored_and_answers_nothing(broker):
    """sendOneway: the store's completion answers no one, and the connection goes on."""
    topic = "OnewaySend"
    host, _, port = broker.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        async with asyncio.timeout(30):
            for i in range(10):
                conn.oneway(RemotingCommand.request(RequestCode.SEND_MESSAGE, _v1_fields(topic, 0, _props(
                    UNIQ_KEY=f"OW-{i}")), f"oneway-{i}".encode(), version=409))
            reply = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, _v1_fields(
                topic, 0, _props(UNIQ_KEY="LAST")), b"answered", version=409), 10)
            assert reply.code == ResponseCode.SUCCESS, reply.remark
            assert int(reply.ext_fields["queueOffset"]) == 10
            messages = await _pull_all(broker, topic, 0, "CG_oneway")
    finally:
        conn.close()
    assert [m.body for m in messages] == [f"oneway-{i}".encode() for i in range(10)] + [b"answered"]


async def test_a_batch_past_max_batch_messages_is_refused_whole_and_counted(broker_factory):
    """A batch is stored as one unit on the event loop, so its message count is how long every other client
    waits: 150,000 one-byte messages (3.5 MB, under max_message_size) held the loop 3.6 s and were stored. Past
    max_batch_messages (max_message_size / 64 by default) a batch is MESSAGE_ILLEGAL now, nothing of it stored, counted and
    logged; one at the cap is stored whole."""
    broker = broker_factory("--max-batch-messages", "100")
    topic = "BatchCap"
    async with asyncio.timeout(60):
        past = await _send(broker, RequestCode.SEND_BATCH_MESSAGE, _v1_fields(topic, 0, "", batch="true"),
                           encode_batch([(0, b"p", "")] * 101))
        assert past.code == ResponseCode.MESSAGE_ILLEGAL, (past.code, past.remark)
        assert "max_batch_messages" in past.remark
        at = await _send(broker, RequestCode.SEND_BATCH_MESSAGE, _v1_fields(topic, 0, "", batch="true"),
                         encode_batch([(0, b"a", "")] * 100))
        assert at.code == ResponseCode.SUCCESS, at.remark
        assert int(at.ext_fields["queueOffset"]) == 0               # the refused one stored nothing before it
        scraped = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode())
    assert 'txmq_requests_refused_total{reason="batch-messages"} 1.0' in scraped
    assert "more than 100 messages (max_batch_messages)" in broker.log()


async def test_by_default_no_stock_producers_batch_meets_the_count_cap(broker_factory):
    """The default cap is max_message_size / 64: a stock producer's smallest entry (a one-byte body naming WAIT
    and UNIQ_KEY) is 75 bytes, so no batch it can send within max_message_size reaches it. A cap of 4,096 had
    refused a stock Java producer's batch of 4,097 such messages (MQBrokerException 13, not retried), where
    RocketMQ stores it. Here max_message_size 64 KiB: a cap of 1,024; a batch of 4 MiB, 65,536."""
    small = broker_factory("--max-message-size", "65536")
    stock_entry = "WAIT\x01true\x02UNIQ_KEY\x017F0000010001000000000000000{:05d}"
    async with asyncio.timeout(120):
        past = await _send(small, RequestCode.SEND_BATCH_MESSAGE, _v1_fields("BatchCapDefault", 0, "", batch="true"),
                           encode_batch([(0, b"p", "")] * 1025))
        assert past.code == ResponseCode.MESSAGE_ILLEGAL and "1024 messages" in past.remark, (past.code, past.remark)
        at = await _send(small, RequestCode.SEND_BATCH_MESSAGE, _v1_fields("BatchCapDefault", 0, "", batch="true"),
                         encode_batch([(0, b"a", "")] * 1024))
        assert at.code == ResponseCode.SUCCESS, at.remark
        assert len(at.ext_fields["msgId"].split(",")) == 1024 and int(at.ext_fields["queueOffset"]) == 0
        roomy = broker_factory(store="roomy")
        body = encode_batch([(0, b"j", stock_entry.format(i)) for i in range(4097)])
        stock = await _send(roomy, RequestCode.SEND_BATCH_MESSAGE, _v1_fields("BatchCapDefault", 0, "", batch="true"),
                            body)
        assert stock.code == ResponseCode.SUCCESS, stock.remark
        assert len(stock.ext_fields["msgId"].split(",")) == 4097
