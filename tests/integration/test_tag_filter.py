"""TAG subscriptions read as RocketMQ 4.9.8's FilterAPI.buildSubscriptionData reads them: split on "||", each
tag taken by Java's String.trim (the chars up to U+0020 off its ends, no others), and filtered by the Java
String.hashCode of the tag as stored. A stock lite pull consumer (DefaultLitePullConsumer, DefaultMQPullConsumer)
sends its expression in every pull (sysFlag SUBSCRIPTION), and the broker builds the filter from it."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import decode_records, encode_batch
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

TOPIC = "TagTrim"
# Tags a producer may set, as stored: an ideographic space (U+3000, what a CJK keyboard types) or a no-break space
# at the end is part of the tag for Java's trim, and so of the tag's hash code; a control char (U+0010) is not.
TAGS = ["TagA\u3000", "TagA", "B\u00a0", "B", "C"]


def _hostport(addr):
    host, _, port = addr.rpartition(":")
    return host, int(port)


async def _send(conn, tags: str, body: bytes) -> None:
    reply = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, {
        "a": "PG_tags", "b": TOPIC, "c": "TBW102", "d": 1, "e": 0, "f": 0, "g": int(time.time() * 1000),
        "h": 0, "i": f"TAGS\x01{tags}\x02", "j": 0}, body), 5)
    assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)


async def _send_batch(conn, topic: str, entries: list[tuple[int, bytes, str]]) -> None:
    reply = await conn.request(RemotingCommand.request(RequestCode.SEND_BATCH_MESSAGE, {
        "a": "PG_tags", "b": topic, "c": "TBW102", "d": 1, "e": 0, "f": 0, "g": int(time.time() * 1000),
        "h": 0, "i": "", "j": 0, "m": "true"}, encode_batch(entries)), 5)
    assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)


async def _pulled(conn, expression: str, topic: str = TOPIC) -> list[str]:
    """The tags of the messages a stock lite pull consumer's pull (its expression in it) is given."""
    reply = await conn.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
        "consumerGroup": "CG_tags", "topic": topic, "queueId": 0, "queueOffset": 0, "maxMsgNums": 32,
        "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": expression, "subVersion": 0,
        "expressionType": "TAG"}), 5)
    if reply.code in (ResponseCode.PULL_NOT_FOUND, ResponseCode.PULL_RETRY_IMMEDIATELY):   # (none matched)
        return []
    assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
    return [m.tags for m in decode_records(reply.body_bytes())]


@bounded(30)
async def test_a_tag_subscription_is_trimmed_as_java_trims_it_not_as_python_strips(broker):
    """Python's str.strip took the ideographic and no-break spaces off "TagA\\u3000": a pull for that tag was
    given the messages tagged "TagA", and none of those tagged "TagA\\u3000" it asked for (which a stock broker
    gives, and which the stock client's own tag check then keeps): its messages skipped, its offset past them,
    nothing said. A control char Java trims, Python kept: "\\u0010B" matched nothing."""
    conn = await open_connection(*_hostport(broker.broker))
    try:
        for i, tags in enumerate(TAGS):
            await _send(conn, tags, f"m{i}".encode())
        assert await _pulled(conn, "TagA\u3000") == ["TagA\u3000"]
        assert await _pulled(conn, "B\u00a0 || C") == ["B\u00a0", "C"]
        assert await _pulled(conn, " \u0010B\u0010 ||") == ["B"]
        assert await _pulled(conn, "TagA") == ["TagA"]
    finally:
        conn.close()


@bounded(60)
async def test_a_batch_entry_naming_its_tag_twice_is_filtered_by_the_tag_its_consumers_read(broker_factory):
    """A batch entry's TAGS was read for its consume-queue code as the FIRST pair of that name, where the message
    itself is read (by every consumer, by Java's string2messageProperties, by this broker's own start-up rebuild
    of its queues) as the LAST pair with a value: "TAGS=a, TAGS=b" was filtered as "a" and read as "b", so a
    consumer of "b" never got it (and one of "a" dropped it as not its own), SEND_OK and nothing said (a slave's
    copy of the queue, and a start-up's rebuild of it, read the last). Both of the batch encoder's paths (the
    ASCII one and the other)."""
    broker = broker_factory()
    batches = {"TagTwiceAscii": [(0, b"two", "TAGS\x01a\x02KEYS\x01k\x02TAGS\x01b\x02"),
                                 (0, b"empty-first", "TAGS\x01\x02TAGS\x01c\x02"),
                                 (0, b"empty-last", "TAGS\x01d\x02TAGS\x01\x02")],
               "TagTwiceWide": [(0, b"two", "TAGS\x01\u00e4\x02TAGS\x01b\x02"),
                                (0, b"empty-first", "TAGS\x01\x02TAGS\x01c\x02"),
                                (0, b"empty-last", "TAGS\x01d\x02TAGS\x01\x02")]}
    expected = {"b": ["b"], "c": ["c"], "d": ["d"], "a || \u00e4": []}
    conn = await open_connection(*_hostport(broker.broker))
    try:
        for topic, entries in batches.items():
            await _send_batch(conn, topic, entries)
            assert {e: await _pulled(conn, e, topic) for e in expected} == expected, topic
    finally:
        conn.close()


@bounded(90)
async def test_a_batch_entry_naming_its_tag_twice_is_filtered_alike_after_its_queue_is_rebuilt(broker_factory,
                                                                                                tmp_path):
    """The start-up rebuild of a queue from the commit log (its queue files lost) reads the tag the batch encoder
    filtered on: the last pair with a value. Killed (-9), its queue files gone, restarted: the same pulls give
    the same messages as before."""
    import shutil
    entries = [(0, b"two", "TAGS\x01a\x02KEYS\x01k\x02TAGS\x01b\x02"), (0, b"empty-last", "TAGS\x01d\x02TAGS\x01\x02")]
    expected = {"b": ["b"], "d": ["d"], "a": []}
    broker = broker_factory()
    conn = await open_connection(*_hostport(broker.broker))
    try:
        await _send_batch(conn, "TagTwiceRebuilt", entries)
        assert {e: await _pulled(conn, e, "TagTwiceRebuilt") for e in expected} == expected
    finally:
        conn.close()
    broker.kill()
    shutil.rmtree(tmp_path / "store" / "consumequeue" / "TagTwiceRebuilt")
    broker = broker_factory()
    conn = await open_connection(*_hostport(broker.broker))
    try:
        assert {e: await _pulled(conn, e, "TagTwiceRebuilt") for e in expected} == expected
    finally:
        conn.close()


async def _pull(conn, group: str, expression: str | None, topic: str = TOPIC):
    """A pull of queue 0 from offset 0: a lite pull consumer's, naming ``expression`` (sysFlag SUBSCRIPTION), or
    (None) a push consumer's, filtered by what its group's heartbeat subscribed."""
    fields = {"consumerGroup": group, "topic": topic, "queueId": 0, "queueOffset": 0, "maxMsgNums": 32,
              "sysFlag": 0, "commitOffset": 0, "suspendTimeoutMillis": 0, "subVersion": 0, "expressionType": "TAG"}
    if expression is not None:
        fields.update(sysFlag=4, subscription=expression)
    return await conn.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, fields), 5)


def _refused(broker, reason: str) -> float:
    scraped = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode()
    line = f'txmq_requests_refused_total{{reason="{reason}"}} '
    return sum(float(x[len(line):]) for x in scraped.splitlines() if x.startswith(line))


@bounded(30)
async def test_an_expression_of_no_tag_is_refused_and_one_of_the_tag_star_is_that_tag(broker):
    """FilterAPI.buildSubscriptionData (common/.../filter/FilterAPI.java:44-61 at rocketmq-all-4.9.8) takes only
    "*" and "" as every message: " * " is the tag "*" (hash 42), " " and " || " parse to no tag (which
    ExpressionMessageFilter.isMatchedByConsumeQueue:77-81 then matches no message with, the pull's offset moved
    past them), and "||" throws "subString split error", answered SUBSCRIPTION_PARSE_FAILED
    (PullMessageProcessor:156-169). Ours trimmed the expression first and gave every message to all four."""
    conn = await open_connection(*_hostport(broker.broker))
    try:
        for i, tags in enumerate(["*", "A", "B"]):
            await _send(conn, tags, f"m{i}".encode())
        assert await _pulled(conn, " * ") == ["*"]
        assert await _pulled(conn, "*") == ["*", "A", "B"]
        assert await _pulled(conn, "") == ["*", "A", "B"]
        for expression in ("||", " ", " || ", "||||"):
            reply = await _pull(conn, "CG_tags", expression)
            assert reply.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED, (expression, reply.code, reply.remark)
            assert "names no tag" in reply.remark
        assert _refused(broker, "tag-expression") == 4
    finally:
        conn.close()


@bounded(30)
async def test_a_pulls_tag_expression_past_the_sql92_length_is_refused_unparsed(broker):
    """A pull carrying its TAG expression (a lite pull consumer's) had it split and every tag hashed, a Python
    loop a character, on the event loop at every pull, whatever its length: 200 pulls of a 253 KiB one pipelined
    held the loop 14.8 s and another client's request up to 4.8 s (the same headers without it: 0.25 s). One past
    16 KiB, the length an SQL92 one may have, is refused SUBSCRIPTION_PARSE_FAILED naming it, counted; one at it
    is read as ever."""
    conn = await open_connection(*_hostport(broker.broker))
    try:
        await _send(conn, "A", b"m")
        at_limit = " || ".join(["A"] + [f"t{i:05d}" for i in range(2047)])[:16 * 1024]
        assert await _pulled(conn, at_limit) == ["A"]
        reply = await _pull(conn, "CG_tags", at_limit + "||B")
        assert reply.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED, (reply.code, reply.remark)
        assert "more than 16384" in reply.remark, reply.remark
        assert _refused(broker, "tag-expression") == 1
    finally:
        conn.close()


@bounded(30)
async def test_a_push_consumer_subscribed_to_no_tag_is_refused_its_messages_kept(broker):
    """A stock push consumer that subscribes " " (an unset tag in its configuration) sends it in its heartbeat with
    no tag and no code, and pulls without it. 4.9.8 matches no message with it (ExpressionMessageFilter:77-81) and
    moves the group past them; ours gave it every message. Now its pulls are refused, nothing given, nothing
    passed over: the group's offset stays where it was."""
    conn = await open_connection(*_hostport(broker.broker))
    try:
        await _send(conn, "A", b"kept")
        beat = json.dumps({"clientID": "127.0.0.1@blank", "producerDataSet": [], "consumerDataSet": [{
            "groupName": "CG_blank", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
            "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "unitMode": False, "subscriptionDataSet": [{
                "topic": TOPIC, "subString": " ", "subVersion": 1, "tagsSet": [], "codeSet": [],
                "classFilterMode": False, "expressionType": "TAG"}]}]}).encode()
        reply = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, {}, beat), 5)
        assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
        reply = await _pull(conn, "CG_blank", None)
        assert reply.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED, (reply.code, reply.remark)
        assert reply.ext_fields.get("nextBeginOffset") is None     # nothing to move the group past its message
        reply = await conn.request(RemotingCommand.request(RequestCode.QUERY_CONSUMER_OFFSET, {
            "consumerGroup": "CG_blank", "topic": TOPIC, "queueId": 0}), 5)
        assert (reply.code, reply.ext_fields.get("offset")) == (ResponseCode.SUCCESS, "0"), reply
        # the same consumer subscribing "*" is given the message the refused pulls kept
        beat = beat.replace(b'"subString": " ", "subVersion": 1', b'"subString": "*", "subVersion": 2')
        reply = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, {}, beat), 5)
        assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
        reply = await _pull(conn, "CG_blank", None)
        assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
        assert [m.body for m in decode_records(reply.body_bytes())] == [b"kept"]
    finally:
        conn.close()
