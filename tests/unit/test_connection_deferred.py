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


class _Transport:
    """What RemotingConnection asks of its transport, reading paused or not as it said last."""

    def __init__(self):
        self.paused, self.closing = False, False

    def get_extra_info(self, name, default=None):
        return default

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def is_closing(self):
        return self.closing


def _fat_frame(opaque: int) -> bytes:
    from protocol.codes import FLAG_ONEWAY, RequestCode
    fields = {format(i, "x"): "" for i in range(9000)}     # a header past TURN_HEADER_BYTES
    return RemotingCommand(RequestCode.GET_MAX_OFFSET, opaque=opaque, flag=FLAG_ONEWAY, ext_fields=fields).encode()


@bounded()
async def test_reading_paused_for_headers_and_for_an_unread_peer_resume_only_for_their_own_reason():
    """A connection pauses reading to the loop's next iteration after TURN_HEADER_BYTES of headers, and for as long
    as its peer leaves responses unread (pause_writing). Neither may resume the other's pause: the next iteration
    resumed reading from a peer reading nothing, or a peer catching up resumed one mid-flood of headers."""
    from protocol.connection import TURN_HEADER_BYTES
    frame = _fat_frame(1)
    assert int.from_bytes(frame[5:8], "big") > TURN_HEADER_BYTES
    conn, t = RemotingConnection(lambda c, m: None), _Transport()
    conn.connection_made(t)
    conn.pause_writing()                    # the peer reads nothing
    conn.data_received(frame)
    assert t.paused
    for _ in range(3):
        await asyncio.sleep(0)              # the next iteration: the headers' pause is over, not the peer's
    assert t.paused and conn.reading_paused
    conn.resume_writing()
    assert not t.paused
    conn.data_received(_fat_frame(2))       # a flood of headers; the peer catches up within the same iteration
    conn.pause_writing()
    conn.resume_writing()
    assert t.paused, "a peer catching up resumed reading paused for headers"
    await asyncio.sleep(0)
    assert not t.paused and not conn.reading_paused
    conn.data_received(_fat_frame(3))       # closed while paused for headers: nothing resumes, nothing raises
    conn.connection_lost(None)
    await asyncio.sleep(0)
    assert conn.transport is None and not conn.reading_paused
