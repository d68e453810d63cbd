"""Hostile clients: the broker answers what it can, closes what it must, and keeps serving everyone else."""
from __future__ import annotations

import asyncio
import os
import struct

import pytest

from producer import Producer, SendStatus
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand

pytestmark = pytest.mark.asyncio


def _hostport(addr):
    host, _, port = addr.rpartition(":")
    return host, int(port)


async def _still_serves(broker):
    async with Producer(broker.namesrv, "PG_alive", retries=0) as producer:
        result = await asyncio.wait_for(producer.send("Alive", b"still here"), 10)
    assert result.status is SendStatus.SEND_OK


async def _closed_by_peer(reader, timeout=10.0) -> bytes:
    """Everything the broker sends until it closes the connection."""
    data = b""
    async with asyncio.timeout(timeout):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def test_random_bytes_close_the_connection(broker):
    reader, writer = await asyncio.open_connection(*_hostport(broker.broker))
    writer.write(os.urandom(4096))
    await _closed_by_peer(reader)
    writer.close()
    await _still_serves(broker)


async def test_frame_claiming_2_gib_is_refused_at_once(broker):
    reader, writer = await asyncio.open_connection(*_hostport(broker.broker))
    writer.write(struct.pack(">i", 0x7FFFFFF0) + b"\x00\x00\x00\x10")
    await _closed_by_peer(reader)
    writer.close()
    await _still_serves(broker)


async def test_malformed_header_with_findable_opaque_gets_an_error_reply(broker):
    reader, writer = await asyncio.open_connection(*_hostport(broker.broker))
    header = b'{"code":10,"opaque":77,"flag":0,"extFields":["not","a","map"]}'
    writer.write(struct.pack(">ii", 4 + len(header), len(header)) + header)
    data = await _closed_by_peer(reader)
    writer.close()
    reply = RemotingCommand.decode(data)
    assert reply.opaque == 77 and reply.is_response and reply.code == ResponseCode.SYSTEM_ERROR
    assert "extFields" in reply.remark


async def test_half_a_frame_then_silence_does_not_block_others(broker):
    _, writer = await asyncio.open_connection(*_hostport(broker.broker))
    frame = RemotingCommand.request(RequestCode.HEART_BEAT, body=b"{}").encode()
    writer.write(frame[: len(frame) // 2])
    await writer.drain()
    await _still_serves(broker)
    writer.close()


async def test_a_thousand_idle_connections(broker):
    writers = []
    try:
        for _ in range(1000):
            _, w = await asyncio.open_connection(*_hostport(broker.broker))
            writers.append(w)
        await _still_serves(broker)
    finally:
        for w in writers:
            w.close()


async def test_a_client_that_never_reads(broker):
    """Pipelined requests whose responses are never read: the broker stops reading, or drops it, and lives."""
    reader, writer = await asyncio.open_connection(*_hostport(broker.broker))
    frame = RemotingCommand.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}).encode()
    async with asyncio.timeout(20):
        for _ in range(200):
            writer.write(frame * 500)
            try:
                await asyncio.wait_for(writer.drain(), 0.2)
            except (asyncio.TimeoutError, ConnectionError):
                break   # the broker stopped reading us: back-pressure works
    await _still_serves(broker)
    writer.transport.abort()
