"""TAG subscriptions read as RocketMQ 4.9.8's FilterAPI.buildSubscriptionData reads them: split on "||", each
tag taken by Java's String.trim (the chars up to U+0020 off its ends, no others), and filtered by the Java
String.hashCode of the tag as stored. A stock lite pull consumer (DefaultLitePullConsumer, DefaultMQPullConsumer)
sends its expression in every pull (sysFlag SUBSCRIPTION), and the broker builds the filter from it."""
from __future__ import annotations

import time

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
