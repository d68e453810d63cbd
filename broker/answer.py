"""Answering a request when the store is done with it, with no future, callback chain or Task between.

The store's writer calls a completion's ``set_result`` directly when a group commit returns (see
Writer.put's ``then``). ``Answer`` turns that into the request's reply: ``make(result)`` builds it, the
request's latency is observed, the connection's in-flight count released and the reply queued (one write
per connection per loop turn). Before, each such request cost two futures and three loop callbacks.
"""
from __future__ import annotations

import logging
from time import perf_counter

from protocol.codes import ResponseCode

log = logging.getLogger("txmq.answer")


class Answer:
    """A store completion that answers ``cmd`` on ``conn`` with ``make(result)``; it never raises into the writer.

    Made when the request is handed to the store, it counts the request in flight on the connection until
    it answers. ``make`` may return None (nothing to send; a oneway request sends nothing anyway)."""

    __slots__ = ("ctx", "conn", "cmd", "make", "started", "_done")

    def __init__(self, ctx, conn, cmd, make):
        self.ctx, self.conn, self.cmd, self.make = ctx, conn, cmd, make
        self.started = perf_counter()
        self._done = False
        conn.hold()

    def done(self) -> bool:
        return self._done

    def set_result(self, result) -> None:
        if self._done:
            return
        self._done = True
        cmd = self.cmd
        try:
            reply = self.make(result)
        except Exception as exc:    # noqa: BLE001 - the writer must go on; this request gets an error
            log.exception("answering %s failed", cmd.code)
            reply = cmd.response(ResponseCode.SYSTEM_ERROR, f"{type(exc).__name__}: {exc}")
        self.answer(reply)

    def answer(self, reply) -> None:
        """Send ``reply`` (None: nothing) and release the request; also for answers that come from elsewhere."""
        self._done = True
        cmd, conn = self.cmd, self.conn
        conn.release()
        try:
            # Sent before the metrics: the answer must not depend on them. conn.answer replaces a reply that
            # cannot be encoded with SYSTEM_ERROR (only logging it here left the client waiting).
            conn.answer(cmd, reply)
            self.ctx.metrics.observe_request(cmd.code, reply.code if reply is not None else 0,
                                             perf_counter() - self.started)
        except Exception:           # noqa: BLE001 - never into the store's writer
            log.exception("answering %s failed", cmd.code)
