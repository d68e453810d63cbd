"""Consumer-side failures that used to be silent: each test drives the client with a stand-in for the
broker (no sockets) and shows the message reaching the listener, or the queue staying consumed."""
from __future__ import annotations

import asyncio
import zlib

import pytest

from consumer import MessageQueue, PullConsumer
from protocol.codes import ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.message import encode_record, pack_host
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


def _record(body: bytes, sys_flag: int = 0, queue_offset: int = 0) -> bytearray:
    return encode_record(topic=b"T", body=body, queue_id=0, flag=0, sys_flag=sys_flag, born_timestamp=1,
                         born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                         properties=b"TAGS\x01a\x02", queue_offset=queue_offset)


@bounded(10)
async def test_a_body_its_producer_compressed_reaches_the_consumer_as_sent():
    """Java and Go producers zlib-compress bodies over 4 KiB and set sysFlag COMPRESSED; the broker stores
    and serves them compressed (as RocketMQ does), so the consumer must inflate them, as RocketMQ's
    client does. The listener was handed the zlib bytes, with nothing said."""
    sent = b"order line " * 1000
    body = _record(zlib.compress(sent), SysFlag.COMPRESSED) + _record(b"small", 0, 1)
    client = PullConsumer("127.0.0.1:1", "G")

    async def request(mq, cmd, timeout):
        return cmd.response(ResponseCode.SUCCESS, None, {"nextBeginOffset": 2, "minOffset": 0, "maxOffset": 2},
                            body=bytes(body))
    client._request = request
    try:
        res = await client.pull(MessageQueue("T", "b", 0), 0)
    finally:
        await client.shutdown()
    assert [m.body for m in res.messages] == [sent, b"small"]
