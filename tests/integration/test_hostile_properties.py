"""Header fields the broker copies into a message's properties must not carry the \\x01 / \\x02 separators.

A properties string is ``name\\x01value`` pairs joined by ``\\x02``, re-parsed by everyone who reads the record
(the broker's own recovery and scheduler included; a later pair of the same name wins). A value holding a
separator is stored as more pairs than the broker wrote: a property smuggled past every check on the way in.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import decode_offset_msg_id, decode_records

pytestmark = pytest.mark.asyncio


def _hostport(addr):
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _send(group: str, topic: str, properties: str, body: bytes) -> RemotingCommand:
    return RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, {
        "a": group, "b": topic, "c": "TBW102", "d": 4, "e": 0, "f": 0, "g": int(time.time() * 1000), "h": 0,
        "i": properties}, body)


async def _max_offset(conn, topic: str, qid: int = 0) -> int:
    reply = await conn.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": topic, "queueId": qid}), 5)
    return int(reply.ext_fields.get("offset", 0)) if reply.code == ResponseCode.SUCCESS else 0


async def test_a_producer_group_holding_separators_is_not_stored_as_the_halfs_pgroup(broker):
    """A half message without PGROUP got the header's producerGroup as its PGROUP, separators and all: stored,
    ``PG\\x02REAL_TOPIC\\x01Victim`` re-parsed as PGROUP=PG plus a REAL_TOPIC after the broker's own. After a
    restart the recovered transaction named another group (its producer's END refused as not its half) and
    another destination: a commit would write into a topic the producer never sent to, past every check."""
    conn = await open_connection(*_hostport(broker.broker))
    try:
        reply = await conn.request(_send("PG\x02REAL_TOPIC\x01Victim", "TxSmuggle",
                                         "REAL_TOPIC\x01x\x02TRAN_MSG\x01true\x02UNIQ_KEY\x01u1", b"half"), 5)
        assert reply.code == ResponseCode.MESSAGE_ILLEGAL, (reply.code, reply.remark)
        assert await _max_offset(conn, "RMQ_SYS_TRANS_HALF_TOPIC") == 0
        # the same half from a group without separators is taken
        ok = await conn.request(_send("PG_fine", "TxSmuggle", "TRAN_MSG\x01true\x02UNIQ_KEY\x01u2", b"half"), 5)
        assert ok.code == ResponseCode.SUCCESS, ok.remark
    finally:
        conn.close()


async def test_a_send_backs_origin_msg_id_cannot_redirect_the_retry(broker):
    """CONSUMER_SEND_MSG_BACK stored the header's originMsgId as ORIGIN_MESSAGE_ID. With a \\x02 in it, a
    REAL_TOPIC pair followed the broker's own (a message may carry REAL_TOPIC from its producer, which keeps
    the broker's pair in front): when the retry's delay ended, the scheduler delivered it there -- into a
    topic that did not even exist -- and the group's %RETRY% topic never got it."""
    conn = await open_connection(*_hostport(broker.broker))
    try:
        sent = await conn.request(_send("PG_src", "BackSrc", "REAL_TOPIC\x01x\x02UNIQ_KEY\x01u1", b"plain"), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        offset = decode_offset_msg_id(sent.ext_fields["msgId"])[2]

        async def back(origin):
            return await conn.request(RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
                "offset": offset, "group": "CG_back", "delayLevel": 1, "originMsgId": origin,
                "originTopic": "BackSrc", "maxReconsumeTimes": 16}), 5)
        refused = await back("X\x02REAL_TOPIC\x01VictimTopic")
        assert refused.code == ResponseCode.MESSAGE_ILLEGAL, (refused.code, refused.remark)
        assert (await back("AC11000100002A9F0000000000000000")).code == ResponseCode.SUCCESS
        async with asyncio.timeout(15):    # delay level 1: delivered to %RETRY% after a second
            while await _max_offset(conn, "%RETRY%CG_back") < 1:
                await asyncio.sleep(0.1)
        assert await _max_offset(conn, "VictimTopic") == 0
        assert await _max_offset(conn, "%RETRY%CG_back") == 1
        pulled = await conn.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "CG_back", "topic": "%RETRY%CG_back", "queueId": 0, "queueOffset": 0, "maxMsgNums": 8,
            "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": "*", "subVersion": 0}), 5)
        assert pulled.code == ResponseCode.SUCCESS, pulled.remark
        [msg] = decode_records(pulled.body_bytes())
        assert msg.body == b"plain"
        assert msg.properties["ORIGIN_MESSAGE_ID"] == "AC11000100002A9F0000000000000000"
    finally:
        conn.close()
