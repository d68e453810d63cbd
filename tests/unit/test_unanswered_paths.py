"""Requests answered later must be answered even when building or sending that answer raises: a failure there
used to leave the client waiting for its own timeout and the request counted in flight forever."""
from __future__ import annotations

import asyncio
import types

from broker.processors import send as send_processor
from broker.store.results import PutResult, PutStatus
from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import RemotingConnection, open_connection
from tests.support.bounded import bounded


async def _serve(handler, **kwargs):
    loop = asyncio.get_running_loop()
    conns: list = []

    def make():
        conn = RemotingConnection(handler, **kwargs)
        conns.append(conn)
        return conn

    server = await loop.create_server(make, "127.0.0.1", 0)
    client = await open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    return server, client, conns


async def _stop(server, client):
    client.close()
    server.close()
    await server.wait_closed()


def _sync_master_ctx(confirm):
    """Just what reply_when_stored reads: a SYNC_MASTER whose slave confirms with ``confirm(end)``."""
    return types.SimpleNamespace(
        ha=types.SimpleNamespace(sync=True, confirm=confirm),
        metrics=types.SimpleNamespace(count_in=lambda *a: None, append_latency=types.SimpleNamespace(
            observe=lambda *a: None)),
        store_host=b"\x7f\x00\x00\x01\x00\x00\x27\x11",
        config=types.SimpleNamespace(region_id="DefaultRegion"))


async def _sync_master_send_answers(monkeypatch, confirm):
    def broken_send_ok(*a, **kw):
        raise RuntimeError("a bug while building the reply")
    monkeypatch.setattr(send_processor, "send_ok", broken_send_ok)
    loop = asyncio.get_running_loop()
    ctx = _sync_master_ctx(confirm)

    def handler(conn, cmd):
        put = loop.create_future()
        loop.call_soon(put.set_result, PutResult(PutStatus.PUT_OK, physical_offset=0, queue_offset=0, size=10))
        return send_processor.reply_when_stored(ctx, cmd, put, 0, "t", 1)

    server, client, conns = await _serve(handler)
    try:
        reply = await client.request(RemotingCommand.request(10, {}), 5)
        assert reply.code == ResponseCode.SYSTEM_ERROR and "a bug while building the reply" in reply.remark
        assert conns[0].in_flight == []     # and the request no longer counts in flight
    finally:
        await _stop(server, client)


@bounded()
async def test_sync_master_send_is_answered_when_its_reply_raises(monkeypatch):
    await _sync_master_send_answers(monkeypatch, lambda end: ResponseCode.SUCCESS)


@bounded()
async def test_sync_master_send_is_answered_when_its_reply_after_the_slave_raises(monkeypatch):
    def confirm(end):       # the slave confirms later
        verdict = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(verdict.set_result, ResponseCode.SUCCESS)
        return verdict
    await _sync_master_send_answers(monkeypatch, confirm)
