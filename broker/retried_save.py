"""A config table written whole on each change (subscription groups, the KV config), whose write a full disk
refused: the change holds in memory, and the table is written again every ``retry_write_s`` until it is.

Not only at the next change, which may never come: until then a restart undid it without a word (the client
was told SYSTEM_ERROR "... but not saved" once). The topics catalogue retries the same way (topics.py).
"""
from __future__ import annotations

import asyncio
import logging


class RetriedSave:
    """Mixin for a table with ``path``, ``counter``, ``_saved_counter`` (the newest counter on disk), ``encode()``
    and ``write(data, counter)`` (blocking; skips a table older than the one on disk)."""

    _what = "table"                         # for the log: "subscription groups file"
    _undone = "a change made since is undone"   # what a stop before the write costs
    _log = logging.getLogger("txmq")
    retry_write_s = 5.0
    _retry: asyncio.Task | None = None

    async def save(self) -> None:
        """Write the table, off the loop; OSError when it cannot be (logged once per failure run, then
        retried)."""
        try:
            await asyncio.to_thread(self.write, self.encode(), self.counter)
        except OSError as exc:
            if self._retry is None:         # once per failure run: each retry would say the same
                self._log.error("%s %s not written, retrying every %g s (%s if the broker stops before it is): %s",
                                self._what, self.path, self.retry_write_s, self._undone, exc)
                self._retry = asyncio.get_running_loop().create_task(self._write_again())
            raise

    async def _write_again(self) -> None:
        while self._saved_counter < self.counter:       # (else a later change's save wrote it meanwhile)
            await asyncio.sleep(self.retry_write_s)
            try:
                await asyncio.to_thread(self.write, self.encode(), self.counter)
            except OSError:
                continue
        self._retry = None
        self._log.warning("%s %s written again", self._what, self.path)

    async def close(self) -> None:
        """(The broker stops) a failed save is tried a last time, not retried any more."""
        if self._retry is None:
            return
        self._retry.cancel()
        self._retry = None
        try:
            await asyncio.to_thread(self.write, self.encode(), self.counter)
        except OSError as exc:      # a full disk must not turn a clean stop into a crash
            self._log.error("%s %s not written at stop (%s): %s", self._what, self.path, self._undone, exc)
