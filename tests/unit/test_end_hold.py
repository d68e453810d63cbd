"""END_TRANSACTION holds the connection (an Answer) before ctx.tx.end: an exception from end must release it,
or the request stays counted in flight and the connection eventually stops reading (found in review)."""
from __future__ import annotations

import types

import pytest

from broker.processors.transaction import end_transaction
from protocol.command import RemotingCommand
from protocol.connection import RemotingConnection


async def test_an_exception_from_tx_end_releases_the_connection():
    def end(*a, **kw):      # e.g. _decision_begin -> _decision_records -> decode_record on a damaged half
        raise ValueError("damaged half")
    ctx = types.SimpleNamespace(tx=types.SimpleNamespace(end=end), metrics=None)
    conn = RemotingConnection(lambda c, m: None)
    cmd = RemotingCommand.request(37, {"producerGroup": "g", "tranStateTableOffset": "0", "commitLogOffset": "0",
                                       "commitOrRollback": "8"})
    with pytest.raises(ValueError):     # RemotingConnection._dispatch answers it with an error reply ...
        end_transaction(ctx, conn, cmd)
    assert conn._held == 0, "... but the request stays counted in flight forever"
