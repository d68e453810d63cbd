"""A handler that answers later by itself (returns DEFERRED after conn.hold()): the connection counts it in
flight like a Task, stops reading at max_in_flight, and reads again once the answers went out."""
from __future__ import annotations

import asyncio

from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import DEFERRED, RemotingConnection, open_connection
from tests.support.bounded import bounded

LIMIT = 8


@bounded()
async def test_deferred_answers_count_in_flight_and_pause_reading():
    loop = asyncio.get_running_loop()
    held: list = []
    limit_reached = asyncio.Event()

    def handler(conn, cmd):
        conn.hold()
        held.append((conn, cmd))
        if len(held) == LIMIT:
            limit_reached.set()
        return DEFERRED

    server = await loop.create_server(lambda: RemotingConnection(handler, max_in_flight=LIMIT), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = await open_connection("127.0.0.1", port)
    try:
        calls = [asyncio.ensure_future(client.request(RemotingCommand.request(11, {"i": str(i)}), 10))
                 for i in range(3 * LIMIT)]
        await limit_reached.wait()
        conn = held[0][0]
        assert "in-flight" in conn._reading_paused_for      # no more reads while LIMIT wait (frames read go on)
        answered = 0
        while answered < 3 * LIMIT:                        # answer what is held; reading resumes, more arrive
            while not held:
                await asyncio.sleep(0)
            c, cmd = held.pop(0)
            c.release()
            c.send(cmd.response(ResponseCode.SUCCESS, cmd.ext_fields["i"]))
            answered += 1
        replies = await asyncio.gather(*calls)
        assert [r.remark for r in replies] == [str(i) for i in range(3 * LIMIT)]
        assert not conn._reading_paused_for
    finally:
        client.close()
        server.close()
        await server.wait_closed()


@bounded()
async def test_a_held_request_is_in_flight_until_released():
    """A graceful stop waits for conn.in_flight: requests answered by their store completion count too
    (found in review: the stop closed the connection at once and the answers went nowhere)."""
    conn = RemotingConnection(lambda c, m: None)
    assert conn.in_flight == []
    conn.hold()
    conn.hold()
    pending = conn.in_flight
    assert len(pending) == 1 and not pending[0].done()
    conn.release()
    assert not pending[0].done()
    conn.release()
    await asyncio.wait_for(asyncio.gather(*pending), 5)
    assert conn.in_flight == []
