"""A client keeps reading answers while its own writes are backed up. Reading was paused then, as a server does
to a peer that does not read its answers; but a broker does that too, so a client whose requests outran the
broker stopped reading the answers the broker was blocked on, and the connection stalled for good: every request
on it timed out, later ones too, while the broker waited for the client to read."""
from __future__ import annotations

import asyncio

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.frame import FrameDecoder
from tests.support.bounded import bounded


@bounded(60)
async def test_a_client_reads_answers_while_its_own_writes_are_backed_up():
    first: asyncio.Future = asyncio.get_running_loop().create_future()

    async def serve(reader, writer):
        decoder = FrameDecoder()
        while not first.done():
            for frame in decoder.feed(await reader.read(65536)):
                first.set_result((RemotingCommand.decode(frame), writer))
                break
        # and reads nothing more: a peer busy with other work, its socket buffers filling up

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    conn = await open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        answer = conn.start_request(RemotingCommand.request(RequestCode.HEART_BEAT, body=b"{}"), 60)
        request, writer = await first
        big = b"x" * (1 << 20)
        for _ in range(512):                        # until the client's own writes back up (a few MiB here)
            if conn._writing_paused:
                break
            conn.oneway(RemotingCommand.request(RequestCode.SEND_MESSAGE, {"topic": "T"}, big))
            await asyncio.sleep(0)
        assert conn._writing_paused
        writer.write(request.response(ResponseCode.SUCCESS).encode())
        assert (await asyncio.wait_for(answer, 20)).code == ResponseCode.SUCCESS
    finally:
        conn.abort()
        server.close()
