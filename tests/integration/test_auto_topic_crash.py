"""A topic a send made (auto-creation; a transaction's half names it) survives a SIGKILL that comes right after the
send's answer, with the queues and perm it was made with.

Its catalogue write was batched up to 100 ms after the topic was made: killed before it, the broker came back with
the topic restored from the store's queues -- one queue when only queue 0 held a message, none for a half's topic --
and sends to queues 1-3 (every client still held the 4-queue route) were refused SYSTEM_ERROR "queueId illegal" for
good: the restored topic never grew back. The kill here follows the acknowledged send at once, so it nearly always
fell inside that window (when the first send's queue file took longer to make, the write came before the SEND_OK
and the old code passed too: the assertions mean the same either way)."""
from __future__ import annotations

import asyncio
import json

import pytest

from protocol.codes import RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import encode_batch
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


def _hostport(addr):
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _send(topic: str, queue_id: int, kind: str = "send") -> RemotingCommand:
    code = RequestCode.SEND_BATCH_MESSAGE if kind == "batch" else RequestCode.SEND_MESSAGE
    body = encode_batch([(0, b"m", "")]) if kind == "batch" else b"m"
    half = kind == "half"       # a transaction's half: its topic holds nothing until the commit
    return RemotingCommand.request(code, {
        "producerGroup": "PG_auto", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": 4,
        "queueId": queue_id, "sysFlag": SysFlag.TRANSACTION_PREPARED if half else 0, "bornTimestamp": 0, "flag": 0,
        "properties": "TRAN_MSG\x01true\x02PGROUP\x01PG_auto\x02" if half else ""}, body)


async def _topic_table(conn) -> dict:
    reply = await conn.request(RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG), 5)
    assert reply.code == ResponseCode.SUCCESS, reply.remark
    return json.loads(reply.body_bytes())["topicConfigTable"]


@pytest.mark.parametrize("kind", ["send", "batch", "half"])
@bounded(90)
async def test_a_topic_made_by_a_send_keeps_its_queues_through_a_kill_right_after_its_send_ok(
        broker_factory, kind):
    b = broker_factory()
    conn = await open_connection(*_hostport(b.broker))
    try:
        reply = await conn.request(_send("AutoMade", 0, kind), 5)
        assert reply.code == ResponseCode.SUCCESS, reply.remark
    finally:
        conn.close()
    b.kill()                # acknowledged: whatever the broker still had to write is its own business

    b = broker_factory()
    conn = await open_connection(*_hostport(b.broker))
    try:
        made = (await _topic_table(conn)).get("AutoMade")
        assert made is not None, "the topic is gone"
        assert (made["readQueueNums"], made["writeQueueNums"], made["perm"]) == (4, 4, 6)
        for qid in range(4):    # every queue of the route the clients were given takes messages
            reply = await conn.request(_send("AutoMade", qid), 5)
            assert reply.code == ResponseCode.SUCCESS, (qid, reply.remark)
    finally:
        conn.close()


@bounded(60)
async def test_sends_pipelined_to_a_new_topic_are_stored_in_the_order_they_came(broker):
    """The first sends to a new topic wait for its catalogue write, together: queued behind it, none may overtake
    another (a send arriving as the write ends included), or an orderly producer's messages swap places."""
    n = 64
    conn = await open_connection(*_hostport(broker.broker))
    try:
        pending = [asyncio.ensure_future(conn.request(_send("Pipelined", 0), 10)) for _ in range(n)]
        replies = await asyncio.gather(*pending)
    finally:
        conn.close()
    assert [r.code for r in replies] == [ResponseCode.SUCCESS] * n
    assert [int(r.ext_fields["queueOffset"]) for r in replies] == list(range(n))


@pytest.mark.parametrize("delay_level", [0, -1], ids=["retry", "dead-letter"])
@bounded(90)
async def test_a_retry_topic_a_send_back_made_keeps_its_queues_through_a_kill_right_after_its_success(
        broker_factory, delay_level):
    """RocketMQ's send-back writes the %RETRY% (or %DLQ%) topic it makes before it stores the copy. Here it was
    batched: killed right after the SUCCESS, the broker came back without %RETRY%CG_back -- its only message still
    waited in SCHEDULE_TOPIC_XXXX, so no queue of it was on disk to restore it from -- and its consumers' routes,
    pulls and locks of it were answered TOPIC_NOT_EXIST until the retry was delivered, which made it again with
    one queue of the group's four."""
    table = await _topics_after_a_kill_right_after_a_send_back(broker_factory, "CG_back", delay_level)
    made, queues = ("%RETRY%CG_back", 4) if delay_level == 0 else ("%DLQ%CG_back", 1)
    assert made in table, f"{made} is gone"
    assert (table[made]["readQueueNums"], table[made]["writeQueueNums"], table[made]["perm"]) == (queues, queues, 6)


@bounded(90)
async def test_a_retry_topic_a_send_back_grew_keeps_its_queues_through_a_kill_right_after_its_success(
        broker_factory):
    """The same for a %RETRY% topic the send-back grows to its group's retryQueueNums (one set to fewer queues):
    killed right after the SUCCESS, the broker came back with the one queue it had, while the retry, waiting in
    SCHEDULE_TOPIC_XXXX, went to any of the four -- into a queue past the topic's count, which no consumer is
    given until something grows the topic again."""
    table = await _topics_after_a_kill_right_after_a_send_back(broker_factory, "CG_grow", 0, RemotingCommand.request(
        RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic": "%RETRY%CG_grow", "readQueueNums": 1, "writeQueueNums": 1,
                                              "perm": 6}))
    grown = table["%RETRY%CG_grow"]
    assert (grown["readQueueNums"], grown["writeQueueNums"]) == (4, 4)


async def _topics_after_a_kill_right_after_a_send_back(broker_factory, group: str, delay_level: int, *first) -> dict:
    """A broker: ``group`` given retryQueueNums 4, the ``first`` requests, a message sent and handed back at once
    (CONSUMER_SEND_MSG_BACK, ``delay_level``), the broker killed -9 at its SUCCESS; the topic table of the broker
    started again on that store."""
    b = broker_factory()
    conn = await open_connection(*_hostport(b.broker))
    try:
        reply = await conn.request(RemotingCommand.request(
            RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
            json.dumps({"groupName": group, "retryQueueNums": 4}).encode()), 5)
        assert reply.code == ResponseCode.SUCCESS, reply.remark
        for cmd in first:
            reply = await conn.request(cmd, 5)
            assert reply.code == ResponseCode.SUCCESS, reply.remark
        sent = await conn.request(_send("Failing", 0), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        reply = await conn.request(RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
            "offset": int(sent.ext_fields["msgId"][-16:], 16), "group": group, "delayLevel": delay_level,
            "originMsgId": sent.ext_fields["msgId"], "maxReconsumeTimes": 16}), 5)
        assert reply.code == ResponseCode.SUCCESS, reply.remark
    finally:
        conn.close()
    b.kill()

    b = broker_factory()
    conn = await open_connection(*_hostport(b.broker))
    try:
        return await _topic_table(conn)
    finally:
        conn.close()
