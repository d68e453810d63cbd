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


async def test_an_end_refused_for_naming_no_half_is_logged_at_most_every_10_s_and_never_whole(caplog):
    """A refused END was logged a line a request with its whole header: any client repeating an END that names no
    half (counted in txmq_requests_refused_total{reason="end-no-half"}) wrote to the broker's disk as fast as it
    could send, megabytes a line with made-up fields. Now such a refusal is logged at most every 10 s, and every
    refusal's line shows the END's own fields, cut short."""
    import logging

    from broker.limits import Limits

    now = [100.0]
    refusal = (1, "Find prepared transaction message failed")
    ctx = types.SimpleNamespace(tx=types.SimpleNamespace(end=lambda *a, **kw: refusal),
                                limits=Limits(None, None, monotonic=lambda: now[0]))
    conn = RemotingConnection(lambda c, m: None)

    def end(state="8"):
        cmd = RemotingCommand.request(37, {"producerGroup": "g", "tranStateTableOffset": "0", "commitLogOffset": "7",
                                           "commitOrRollback": state, "junk": "x" * 1_000_000,
                                           "msgId": "m" * 100_000}, oneway=True)
        assert end_transaction(ctx, conn, cmd) is None

    with caplog.at_level(logging.WARNING):
        for _ in range(1000):
            end()
        assert len(caplog.records) == 1
        now[0] += 10
        end()
        assert len(caplog.records) == 2
        refusal = (4, "transaction already COMMIT; ROLLBACK refused (the first decision wins)")
        end("12")                       # a conflict: each one said, still
        assert len(caplog.records) == 3
    assert all(len(r.getMessage()) < 2000 for r in caplog.records)
    assert "commitLogOffset': '7'" in caplog.records[-1].getMessage()


async def test_an_end_refused_for_its_queue_file_is_logged_at_most_every_10_s(caplog):
    """Past the open-files limit a COMMIT to a new queue is refused (its file cannot be made): counted and said by
    the decision path under the send path's gated reason (queue-file-failed), and said again here, a WARNING line
    an END, ungated: every producer's END to such a queue wrote a line while the broker was out of descriptors."""
    import logging

    from broker.limits import Limits

    now = [100.0]
    refusal = (1, "create mapped file failed, server is busy or broken: [Errno 24] Too many open files")
    ctx = types.SimpleNamespace(tx=types.SimpleNamespace(end=lambda *a, **kw: refusal),
                                limits=Limits(None, None, monotonic=lambda: now[0]))
    conn = RemotingConnection(lambda c, m: None)
    with caplog.at_level(logging.WARNING):
        for i in range(1000):
            cmd = RemotingCommand.request(37, {"producerGroup": "g", "tranStateTableOffset": str(i),
                                               "commitLogOffset": str(i), "commitOrRollback": "8"}, oneway=True)
            assert end_transaction(ctx, conn, cmd) is None
        assert len(caplog.records) == 1
        now[0] += 10
        end_transaction(ctx, conn, cmd)
        assert len(caplog.records) == 2
    assert "create mapped file failed" in caplog.records[-1].getMessage()


async def test_ends_the_store_refuses_are_logged_at_most_every_10_s(caplog):
    """An END whose decision the store refused (a full disk: SERVICE_NOT_AVAILABLE; a damaged half's commit) was
    logged a WARNING each, ungated: while the disk was full every END, and every producer's answer to every check
    of every half, wrote a line to the broker's log (on that disk or another), as fast as the clients sent them.
    Each is still answered; the line is said at most every 10 s a kind of refusal."""
    import logging

    from broker.limits import Limits

    now = [100.0]
    refusals = [(14, "store refused the decision: SERVICE_NOT_AVAILABLE"),
                (1, "not committed: record at 4096 fails its body CRC")]
    ctx = types.SimpleNamespace(tx=types.SimpleNamespace(end=lambda *a, **kw: refusals[0]),
                                limits=Limits(None, None, monotonic=lambda: now[0]))
    conn = RemotingConnection(lambda c, m: None)

    def ends(n):
        for i in range(n):
            cmd = RemotingCommand.request(37, {"producerGroup": "g", "tranStateTableOffset": str(i),
                                               "commitLogOffset": str(i), "commitOrRollback": "8"})
            assert end_transaction(ctx, conn, cmd).code == refusals[0][0]

    with caplog.at_level(logging.WARNING):
        ends(500)
        assert len(caplog.records) == 1
        refusals.pop(0)
        ends(500)
        assert len(caplog.records) == 2
        now[0] += 10
        ends(1)
        assert len(caplog.records) == 3
