"""protocol/connection.py: connections closed for malformed input are each counted (on_reject) and logged at most
every REFUSAL_LOG_GAP_S, the line after a quiet gap saying how many went unlogged since."""
from __future__ import annotations

import logging

from protocol import connection
from protocol.connection import REFUSAL_LOG_GAP_S, RemotingConnection
from protocol.errors import ProtocolError
from tests.support.bounded import bounded


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def time(self) -> float:
        return self.now


@bounded()
async def test_the_line_after_a_gap_says_how_many_rejected_connections_went_unlogged(caplog, monkeypatch):
    monkeypatch.setattr(connection, "_rejections_logged", {})
    counted = []
    conn = RemotingConnection(None, on_reject=lambda: counted.append(1))
    clock = conn._loop = _Clock()
    conn.peer = ("127.0.0.1", 5555)
    with caplog.at_level(logging.WARNING, logger=connection.log.name):
        for step in range(5):                           # one line, then 4 inside the gap
            conn._rejected("malformed frame from %s:%s: %s", ProtocolError(f"bad {step}"))
            clock.now += 1
        clock.now += REFUSAL_LOG_GAP_S
        conn._rejected("closing %s:%s: %s", ProtocolError("bad again"))
    said = [r.getMessage() for r in caplog.records]
    assert len(counted) == 6
    assert len(said) == 2, said
    assert "bad 0" in said[0] and "more connections" not in said[0]
    assert "bad again" in said[1] and "; 4 more connections closed for malformed input since the last line" in said[1]
