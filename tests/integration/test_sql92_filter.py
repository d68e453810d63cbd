"""SQL92 message filtering (MessageSelector.bySql) against the real broker, in the frames a stock Java 4.9.8
client sends: CHECK_CLIENT_CONFIG at start, the subscription in its heartbeat, then pulls that name it (a
lite pull consumer: sysFlag SUBSCRIPTION) or not (a push consumer: the heartbeat's). The frames are
written here byte by byte, as fastjson writes a JSON header, not with protocol.command."""
from __future__ import annotations

import asyncio
import contextlib
import json
import struct

import pytest

from consumer import MessageSelector, PullConsumer
from producer import Producer
from protocol.codes import ResponseCode
from protocol.message import decode_records
from tests.support.bounded import bounded
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio

TOPIC = "SqlOrders"
GROUP = "CG_sql"
CLIENT_ID = "127.0.0.1@4242#1"
QUEUES = 4       # a topic a producer creates has its defaultTopicQueueNums, 4
SQL = "a BETWEEN 3 AND 7 AND TAGS IN ('red') OR vip = 'yes'"


def _expected(messages) -> set[bytes]:
    """What SQL selects, worked out by hand: a (an Integer) 3..7 with tag red, or vip yes. A message whose a
    is not a number cannot be compared, and is passed over unless vip decided first (OR is left to right)."""
    out = set()
    for body, tags, props in messages:
        a = props.get("a")
        numeric = a is not None and a.lstrip("-").isdigit()
        left = numeric and 3 <= int(a) <= 7 and tags == "red"
        if left or (numeric or a is None) and props.get("vip") == "yes":
            out.add(body)
    return out


def _messages():
    out = []
    for i in range(24):
        props = {"a": str(i)} if i % 5 else {}            # every fifth has no a: null, unknown
        if i % 7 == 3:
            props["vip"] = "yes"
        if i == 11:
            props["a"] = "eleven"                          # not a number: this one cannot be evaluated
        out.append((f"m{i}".encode(), "red" if i % 2 else "blue", props))
    return out


def java_frame(code: int, opaque: int, ext: dict[str, str] | None, body: bytes = b"") -> bytes:
    """A request frame as RocketMQ 4.9.8's Java client writes it: JSON header, fields in fastjson's order."""
    fields = f'"extFields":{json.dumps(ext, separators=(",", ":"))},' if ext else ""
    header = (f'{{"code":{code},{fields}"flag":0,"language":"JAVA","opaque":{opaque},'
              f'"serializeTypeCurrentRPC":"JSON","version":409}}').encode()
    return struct.pack(">ii", 4 + len(header) + len(body), len(header)) + header + body


class JavaConsumer:
    """The requests of a stock consumer with an SQL92 subscription, on one raw connection."""

    def __init__(self, raw: RawClient):
        # Above the broker's own opaques: its requests to this client (NOTIFY_CONSUMER_IDS_CHANGED after a
        # heartbeat) are recorded by opaque too, and one of them is no reply.
        self.raw, self.opaque = raw, 10_000

    async def call(self, code: int, ext=None, body: bytes = b""):
        self.opaque += 1
        replies = await self.raw.call_raw(java_frame(code, self.opaque, ext, body), self.opaque, 10.0)
        assert replies, f"no reply to request code {code}"
        return replies[0]

    def subscription(self, expression: str, version: int = 1) -> dict:
        return {"classFilterMode": False, "codeSet": [], "expressionType": "SQL92", "subString": expression,
                "subVersion": version, "tagsSet": [], "topic": TOPIC}

    async def check(self, expression: str):
        body = {"clientId": CLIENT_ID, "group": GROUP, "subscriptionData": self.subscription(expression)}
        return await self.call(46, None, json.dumps(body).encode())

    async def heartbeat(self, expression: str, version: int):
        body = {"clientID": CLIENT_ID, "consumerDataSet": [{
            "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "consumeType": "CONSUME_PASSIVELY", "groupName": GROUP,
            "messageModel": "CLUSTERING", "subscriptionDataSet": [self.subscription(expression, version)],
            "unitMode": False}], "producerDataSet": [{"groupName": "CLIENT_INNER_PRODUCER"}]}
        reply = await self.call(34, None, json.dumps(body).encode())
        assert reply.code == ResponseCode.SUCCESS, reply.remark

    async def pull(self, queue_id: int, offset: int, version: int, expression: str | None):
        ext = {"consumerGroup": GROUP, "topic": TOPIC, "queueId": str(queue_id), "queueOffset": str(offset),
               "maxMsgNums": "32", "sysFlag": "0", "commitOffset": "0", "suspendTimeoutMillis": "0",
               "subVersion": str(version), "expressionType": "SQL92"}
        if expression is not None:      # a lite pull consumer sends its subscription; a push consumer does not
            ext.update(sysFlag="4", subscription=expression)
        return await self.call(11, ext)

    def held_pull(self, queue_id: int, body: bytes = b"", **fields) -> asyncio.Future:
        """A pull at offset 1 held up to 20 s (written, not awaited); its reply's future."""
        self.opaque += 1
        self.raw.write(java_frame(11, self.opaque, {
            "consumerGroup": GROUP, "topic": TOPIC, "queueId": str(queue_id), "queueOffset": "1", "maxMsgNums": "32",
            "commitOffset": "0", "suspendTimeoutMillis": "20000", "subVersion": "1", "expressionType": "SQL92",
            **fields}, body))
        return asyncio.ensure_future(self.raw.reply(self.opaque, 30.0))

    async def drain(self, version: int, expression: str | None = None) -> list[bytes]:
        """Every queue pulled from 0 until caught up; the bodies delivered."""
        bodies = []
        for qid in range(QUEUES):
            offset = 0
            for _ in range(50):                              # bounded: 24 messages in all
                reply = await self.pull(qid, offset, version, expression)
                assert reply.code in (ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND,
                                      ResponseCode.PULL_RETRY_IMMEDIATELY), (reply.code, reply.remark)
                if reply.code == ResponseCode.SUCCESS:
                    bodies += [m.body for m in decode_records(reply.body_bytes())]
                nxt = reply.int_field("nextBeginOffset")
                if reply.code == ResponseCode.PULL_NOT_FOUND or nxt >= reply.int_field("maxOffset"):
                    break
                assert nxt > offset, (qid, offset, reply.code)
                offset = nxt
            else:
                pytest.fail(f"queue {qid} never caught up")
        return bodies


async def _produce(broker, messages):
    async with Producer(broker.namesrv, "PG_sql") as producer:
        for body, tags, props in messages:
            await producer.send(TOPIC, body, tags=tags, properties=props or None)


async def _filtering_broker(broker_factory):
    """A broker with the property filter on, holding _messages(); and those messages, and what SQL selects."""
    broker = broker_factory("--enable-property-filter", "true")
    messages = _messages()
    await _produce(broker, messages)
    return broker, messages, _expected(messages)


@bounded(90)
async def test_a_stock_sql92_consumer_gets_exactly_the_matching_messages(broker_factory):
    broker, messages, want = await _filtering_broker(broker_factory)
    assert 0 < len(want) < len(messages) and b"m11" not in want
    raw = await RawClient.open(broker.broker)
    try:
        java = JavaConsumer(raw)
        ok = await java.check(SQL)
        assert ok.code == ResponseCode.SUCCESS, ok.remark
        bad = await java.check("a > ")
        assert bad.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED and "found the end" in bad.remark, bad.remark

        await java.heartbeat(SQL, 1)
        got = await java.drain(1)                            # push consumer: the heartbeat's subscription
        assert sorted(got) == sorted(want)
        got = await java.drain(1, SQL)                       # lite pull consumer: the pull's own
        assert sorted(got) == sorted(want)
        assert sorted(await java.drain(1, "TAGS = 'blue'")) == sorted(b for b, t, _ in messages if t == "blue")

        reply = await java.pull(0, 0, 1, "a >>> 1")          # RocketMQ would have given every message
        assert reply.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED, (reply.code, reply.remark)
        await java.heartbeat("a >>> 1", 2)                   # a heartbeat's cannot be refused; its pulls are
        reply = await java.pull(0, 0, 2, None)
        assert reply.code == ResponseCode.FILTER_DATA_NOT_EXIST and "'>'" in reply.remark, (reply.code, reply.remark)
    finally:
        raw.close()


@bounded(90)
async def test_our_pull_consumer_subscribes_by_sql(broker_factory):
    broker, messages, want = await _filtering_broker(broker_factory)
    async with PullConsumer(broker.namesrv, "CG_sql_ours") as consumer:
        selector = MessageSelector.by_sql(SQL)
        await consumer.subscribe(TOPIC, selector)            # checks the expression with the broker first
        got = []
        for mq in await consumer.fetch_queues(TOPIC):
            async for res in consumer.drain(mq, 0, expression=selector):
                got += [m.body for m in res.messages]
        assert sorted(got) == sorted(want)
        with pytest.raises(Exception, match="found the end") as info:
            await consumer.subscribe(TOPIC, MessageSelector.by_sql("a >"))
        assert getattr(info.value, "code", None) == ResponseCode.SUBSCRIPTION_PARSE_FAILED


@bounded(120)
async def test_an_expensive_expression_does_bounded_work_per_pull(broker_factory):
    """An expression near the caps, on messages that never match: each pull evaluates only as many as its budget
    allows and answers where it stopped (PULL_RETRY_IMMEDIATELY, nextBeginOffset short of what it could scan),
    so the loop is never held for a whole scan; pulls from there cover the queue and find the one match."""
    from broker.processors.pull import _FILTER_BUDGET
    broker = broker_factory("--enable-property-filter", "true")
    names = [f"p{i}" for i in range(120)]
    expensive = " OR ".join(f"{n} > 1000" for n in names)         # 239 operators, 120 look-ups a message
    at_most = _FILTER_BUDGET // (239 + 1 + len(names)) + 1          # messages one read may examine
    count = 3 * at_most
    props = {n: "1" for n in names}
    async with Producer(broker.namesrv, "PG_sql_budget") as producer:
        mq = (await producer.send(TOPIC, b"warm-up")).queue
        for i in range(count):
            await producer.send(TOPIC, f"n{i}".encode(), properties=props, queue=mq)
        await producer.send(TOPIC, b"match", properties={**props, "p7": "1001"}, queue=mq)
    raw = await RawClient.open(broker.broker)
    try:
        java = JavaConsumer(raw)
        offset, pulls, got = 0, 0, []
        while True:
            reply = await java.pull(mq.queue_id, offset, 1, expensive)
            pulls += 1
            nxt = reply.int_field("nextBeginOffset")
            if reply.code == ResponseCode.PULL_NOT_FOUND:
                break
            assert reply.code in (ResponseCode.SUCCESS, ResponseCode.PULL_RETRY_IMMEDIATELY), reply.code
            assert offset < nxt <= offset + at_most, (offset, nxt)        # stopped early, and went on
            if reply.code == ResponseCode.SUCCESS:
                got += [m.body for m in decode_records(reply.body_bytes())]
            offset = nxt
            assert pulls <= count + 2, "no progress"
        assert got == [b"match"] and pulls >= 3
    finally:
        raw.close()


@contextlib.asynccontextmanager
async def _one_message_in(broker, producer_group: str):
    """``broker``, a producer of ``producer_group`` that stored m0 (a=0) at offset 0 of a queue, that queue, and a
    JavaConsumer on a raw connection."""
    async with Producer(broker.namesrv, producer_group) as producer:
        mq = (await producer.send(TOPIC, b"m0", properties={"a": "0"})).queue
        raw = await RawClient.open(broker.broker)
        try:
            yield broker, producer, mq, JavaConsumer(raw)
        finally:
            raw.close()


@bounded(60)
async def test_a_held_pull_answers_by_the_expression_its_group_has_now(broker_factory):
    """A push consumer's pull names no expression: the heartbeat's is used. One held (long polling) while a
    heartbeat changes the expression answers by the new one, as RocketMQ runs a woken pull again: by the
    expression it was parked with, a message only the old expression wanted was delivered."""
    async with _one_message_in(broker_factory("--enable-property-filter", "true"), "PG_sql_change") as (
            broker, producer, mq, java):
        await java.heartbeat("a = 1", 1)
        held = java.held_pull(mq.queue_id, sysFlag="2")   # written now: the broker reads it before the next
        await java.heartbeat("a = 2", 2)                 # the consumer subscribed again
        await producer.send(TOPIC, b"m1", properties={"a": "1"}, queue=mq)
        await producer.send(TOPIC, b"m2", properties={"a": "2"}, queue=mq)
        reply = (await held)[0]
        assert reply.code in (ResponseCode.SUCCESS, ResponseCode.PULL_RETRY_IMMEDIATELY), reply.code
        bodies = [m.body for m in decode_records(reply.body_bytes())] if reply.code == ResponseCode.SUCCESS else []
        assert b"m1" not in bodies, "delivered by the expression the consumer no longer has"


@bounded(60)
async def test_a_held_pull_carrying_its_sql_subscription_is_woken_by_it(broker_factory):
    """A lite pull consumer's held pull names its expression and its type (SQL92); a held pull keeps only the
    fields it reads again (not its body, nor made-up fields). Run again without expressionType it was read as
    a TAG expression: the message its SQL wants was answered as no match."""
    from tests.integration.test_hostile import _parked_becomes
    async with _one_message_in(broker_factory("--enable-property-filter", "true"), "PG_sql_held") as (
            broker, producer, mq, java):
        held = java.held_pull(mq.queue_id, b"a body no pull reads", sysFlag="6", subscription="a = 2",
                              madeUp="x" * 1000)
        assert await _parked_becomes(broker, 1, 20) == 1
        await producer.send(TOPIC, b"m2", properties={"a": "2"}, queue=mq)
        reply = (await held)[0]
        assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
        assert [m.body for m in decode_records(reply.body_bytes())] == [b"m2"]

@bounded(90)
async def test_our_push_consumer_consumes_by_sql(broker_factory):
    """PushConsumer with MessageSelector.by_sql: every matching message, none other."""
    from consumer import ConsumeStatus, PushConsumer
    broker, messages, want = await _filtering_broker(broker_factory)
    got, complete = [], asyncio.Event()

    def listener(msg):
        got.append(msg.body)
        if want <= set(got):
            complete.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(broker.namesrv, "CG_sql_push", listener, consume_from="first", suspend_ms=500)
    consumer.subscribe(TOPIC, MessageSelector.by_sql(SQL))
    await consumer.start()
    try:
        await complete.wait()
    finally:
        await consumer.shutdown()
    assert sorted(got) == sorted(want)


@bounded(60)
async def test_our_push_consumer_is_refused_by_sql_where_the_filter_is_off(broker_factory):
    from consumer import PushConsumer
    from protocol.errors import BrokerError
    broker = broker_factory()
    await _produce(broker, _messages()[:1])
    refused = PushConsumer(broker.namesrv, "CG_sql_push_off", lambda msg: None)
    refused.subscribe(TOPIC, MessageSelector.by_sql(SQL))
    with pytest.raises(BrokerError, match="does not support") as info:
        await refused.start()
    assert getattr(info.value, "code", None) == ResponseCode.SYSTEM_ERROR
    await refused.shutdown()


@pytest.mark.parametrize("bad", ["a > " + "(" * 10_000, "a " + "y" * 10_000], ids=["nested", "echoed"])
@bounded(60)
async def test_a_client_asking_again_and_again_with_a_bad_expression_is_not_a_log_line_each(broker_factory, bad):
    """CHECK_CLIENT_CONFIG with an expression that does not parse is SUBSCRIPTION_PARSE_FAILED, and it was said at
    WARNING each time, the expression at any length: one client asking 300 times made 300 lines (a 10 KB
    expression, 3 MB of log). Said at most every 10 s now (the expression cut at 200 characters); each ask is
    still answered SUBSCRIPTION_PARSE_FAILED with the reason. The reason may quote the expression ("echoed":
    unexpected 'yyy...', 10 KB): cut too, else the line was the expression's length still (a frame's, 16 MB,
    every 10 s)."""
    from protocol.codes import RequestCode
    from protocol.command import RemotingCommand
    broker = broker_factory("--enable-property-filter", "true")
    raw = await RawClient.open(broker.broker)
    asks = 300
    body = json.dumps({"clientId": "flood", "group": "CG_flood", "subscriptionData": {
        "topic": TOPIC, "subString": bad, "expressionType": "SQL92"}}).encode()
    try:
        frames = [RemotingCommand.request(RequestCode.CHECK_CLIENT_CONFIG, body=body, opaque=10_000 + i)
                  for i in range(asks)]
        raw.write(b"".join(f.encode() for f in frames))
        replies = [await raw.reply(f.opaque, 20) for f in frames]
    finally:
        raw.close()
    assert [r and r[0].code for r in replies] == [ResponseCode.SUBSCRIPTION_PARSE_FAILED] * asks
    log = broker.log_path.read_text(errors="replace")
    said = [line for line in log.splitlines() if "SQL92 expression" in line]
    assert 1 <= len(said) <= 2, len(said)
    assert max(len(line) for line in said) < 2_000
