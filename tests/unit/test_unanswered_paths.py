"""Requests answered later must be answered even when building or sending that answer raises: a failure there
used to leave the client waiting for its own timeout and the request counted in flight forever."""
from __future__ import annotations

import asyncio
import types

from broker.processors import send as send_processor
from broker.store.results import PutResult, PutStatus
from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import DEFERRED, RemotingConnection, open_connection
from protocol.errors import ConnectionClosedError
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


def _unencodable(cmd):
    """A reply with a bug in it: its body holds something that is not a buffer, so encoding it raises."""
    return cmd.response(ResponseCode.SUCCESS, body=[b"ok", 42])


@bounded()
async def test_a_reply_that_cannot_be_encoded_is_answered_and_the_connection_keeps_reading():
    """Pipelined past one turn (FRAMES_PER_TURN), the bad reply's exception escaped the deferred turn: only the
    loop logged it, the frames after it were dropped and reading stayed paused -- every later request on the
    connection waited for its client's timeout. Each request must get its answer, the bad one SYSTEM_ERROR."""
    def handler(conn, cmd):
        return _unencodable(cmd) if cmd.ext_fields.get("bad") else cmd.response(ResponseCode.SUCCESS, "ok")

    server, client, conns = await _serve(handler, frames_per_turn=4)
    try:
        calls = [client.request(RemotingCommand.request(10, {"bad": "1"} if i == 6 else {}), 5) for i in range(12)]
        replies = await asyncio.gather(*calls)
        assert [r.code for r in replies] == [ResponseCode.SUCCESS] * 6 + [ResponseCode.SYSTEM_ERROR] \
            + [ResponseCode.SUCCESS] * 5
        assert "TypeError" in replies[6].remark
        later = await client.request(RemotingCommand.request(10, {}), 5)   # still reading
        assert later.code == ResponseCode.SUCCESS and not conns[0]._reading_paused_for
    finally:
        await _stop(server, client)


@bounded()
async def test_a_handler_returning_no_awaitable_is_answered():
    def handler(conn, cmd):
        return ("not", "a", "reply")    # a bug: neither a command, None, DEFERRED nor an awaitable

    server, client, _ = await _serve(handler)
    try:
        reply = await client.request(RemotingCommand.request(10, {}), 5)
        assert reply.code == ResponseCode.SYSTEM_ERROR
    finally:
        await _stop(server, client)


@bounded()
async def test_a_task_whose_reply_cannot_be_encoded_is_answered():
    async def later(cmd):
        await asyncio.sleep(0)
        return _unencodable(cmd)

    server, client, conns = await _serve(lambda conn, cmd: later(cmd))
    try:
        reply = await client.request(RemotingCommand.request(10, {}), 5)
        assert reply.code == ResponseCode.SYSTEM_ERROR and "TypeError" in reply.remark
        assert conns[0].in_flight == []
    finally:
        await _stop(server, client)


@bounded()
async def test_a_store_completion_whose_reply_cannot_be_encoded_is_answered():
    """Answer (a store completion) logged the failed send and nothing went back."""
    from broker.answer import Answer

    ctx = types.SimpleNamespace(metrics=types.SimpleNamespace(observe_request=lambda *a: None))
    loop = asyncio.get_running_loop()

    def handler(conn, cmd):
        later = Answer(ctx, conn, cmd, lambda result: _unencodable(cmd))
        loop.call_soon(later.set_result, None)     # the store's writer, a moment later
        return DEFERRED

    server, client, conns = await _serve(handler)
    try:
        reply = await client.request(RemotingCommand.request(10, {}), 5)
        assert reply.code == ResponseCode.SYSTEM_ERROR and "TypeError" in reply.remark
        assert conns[0].in_flight == []
    finally:
        await _stop(server, client)


@bounded()
async def test_an_unexpected_failure_in_a_later_turn_closes_the_connection_instead_of_stalling_it(monkeypatch):
    """Whatever escapes a frame's handling (a bug: decoding raises no ProtocolError here) in the first turn of
    a read makes the transport close the connection, so its client learns at once. In a later turn (past
    frames_per_turn) it reached only the loop's log and left reading paused: the client waited for its
    timeouts on a connection that would never read again."""
    real_decode = RemotingCommand.decode

    def decode(frame, *a, **kw):
        if b"poison" in bytes(frame):
            raise RuntimeError("a bug in decoding")
        return real_decode(frame, *a, **kw)
    monkeypatch.setattr(RemotingCommand, "decode", staticmethod(decode))

    server, client, conns = await _serve(lambda conn, cmd: cmd.response(ResponseCode.SUCCESS), frames_per_turn=4)
    try:
        calls = [client.request(RemotingCommand.request(10, {"poison": "1"} if i == 6 else {}), 10)
                 for i in range(12)]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        assert all(not isinstance(r, Exception) for r in replies[:6])     # those handled before it: answered
        assert all(isinstance(r, ConnectionClosedError) for r in replies[6:]), replies
        await conns[0].closed.wait()
    finally:
        await _stop(server, client)


@bounded()
async def test_a_request_past_the_frame_limit_is_refused_unsent_and_the_connection_carries_on():
    """A frame past the peer's limit (16 MiB) made it close the connection, failing every request in flight there.
    Refused before it is written, request or oneway, and the connection's other requests are answered."""
    from protocol.errors import MessageIllegalError

    def handler(conn, cmd):
        return None if cmd.is_oneway else cmd.response(ResponseCode.SUCCESS, "ok")

    server, client, conns = await _serve(handler)
    try:
        beside = asyncio.ensure_future(client.request(RemotingCommand.request(10, {}), 5))
        await asyncio.sleep(0)                      # in flight
        big = RemotingCommand.request(10, {}, b"x" * (16 << 20))
        for send in (client.oneway, client.start_request):
            try:
                send(big)
                raise AssertionError(f"{send.__name__} sent a frame past the limit")
            except MessageIllegalError as exc:
                assert "not sent" in str(exc)
        assert len(client._pending) == 1            # the refused one left nothing waiting
        assert (await beside).code == ResponseCode.SUCCESS
        assert (await client.request(RemotingCommand.request(10, {}, b"x" * 1000), 5)).code == ResponseCode.SUCCESS
    finally:
        await _stop(server, client)


@bounded()
async def test_a_request_frame_of_exactly_the_limit_is_sent_and_one_byte_more_is_refused():
    """The limit is on the whole frame, its 4-byte length field included, as RocketMQ's NettyDecoder
    (LengthFieldBasedFrameDecoder(16 MiB, 0, 4, 0, 4): length field + 4 > 16 MiB is too long) reads it. The check
    compared the length field alone: frames of 16 MiB + 1 to + 4 bytes were sent, and a stock broker closed the
    connection on them, failing every request in flight there. The peer here reads as a stock broker does."""
    from protocol.codes import SerializeType
    from protocol.errors import MessageIllegalError
    from protocol.frame import MAX_FRAME_SIZE

    def handler(conn, cmd):
        return cmd.response(ResponseCode.SUCCESS, "ok")

    def frame_of(total):        # a binary header: its length is not the opaque's number of digits, set when sent
        cmd = RemotingCommand.request(10, {}, serialize_type=SerializeType.ROCKETMQ)
        cmd.body = b"x" * (total - len(b"".join(cmd.encode_parts())))
        assert len(b"".join(cmd.encode_parts())) == total
        return cmd

    server, client, conns = await _serve(handler, max_frame_size=MAX_FRAME_SIZE - 4)    # Netty's reading of it
    try:
        beside = asyncio.ensure_future(client.request(RemotingCommand.request(10, {}), 5))
        await asyncio.sleep(0)                      # in flight
        for over in (1, 4):
            try:
                client.start_request(frame_of(MAX_FRAME_SIZE + over))
                raise AssertionError(f"a frame of {MAX_FRAME_SIZE} + {over} bytes was sent")
            except MessageIllegalError as exc:
                assert "not sent" in str(exc)
        assert (await beside).code == ResponseCode.SUCCESS
        assert (await client.request(frame_of(MAX_FRAME_SIZE), 10)).code == ResponseCode.SUCCESS
    finally:
        await _stop(server, client)
