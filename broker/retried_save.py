"""A config table written whole on each change (subscription groups, the KV config), whose write a full disk
refused: the change holds in memory, and the table is written again every ``retry_write_s`` until it is.

Not only at the next change, which may never come: until then a restart undid it without a word (the client
was told SYSTEM_ERROR "... but not saved" once). The topics catalogue retries the same way (topics.py).

A write that HANGS (a stopped NFS, a stuck FUSE) is waited for ``write_wait_s``, then taken as failed: the
update was never answered, nothing said, and each later update or retry would have stuck one more of the loop's
default-executor threads in the same write. While it hangs (``write_hung``) no other write of the table starts.
"""
from __future__ import annotations

import asyncio
import errno
import logging


class RetriedSave:
    """Mixin for a table with ``path``, ``counter``, ``_saved_counter`` (the newest counter on disk), ``encode()``
    and ``write(data, counter)`` (blocking; skips a table older than the one on disk)."""

    _what = "table"                         # for the log: "subscription groups file"
    _undone = "a change made since is undone"   # what a stop before the write costs
    _log = logging.getLogger("txmq")
    retry_write_s = 5.0
    write_wait_s = 2.0                      # under a stock admin's 5 s timeout
    _retry: asyncio.Task | None = None
    _writes = 0                             # writes on a thread not ended
    write_hung = False                      # one of them has run past write_wait_s (txmq_config_write_hung)

    _saving: asyncio.Lock | None = None     # one save at a time (save)

    async def save(self) -> None:
        """Write the table, off the loop; OSError when it cannot be, or has not been in ``write_wait_s`` (logged
        once per failure run, then retried).

        One save at a time, and none when a save that began after the caller's change has written it: each
        encoded and held its own copy of the whole table, so updates sent back to back (a client pipelining
        them, 256 a connection) were as many copies at once: 100 of one group at 20,000 groups took the broker
        from 50 MB to 787 MB (562 MB kept), 45 s before the last answer."""
        changed = self.counter
        if self._saving is None:
            self._saving = asyncio.Lock()
        try:
            async with self._saving:
                if self._saved_counter >= changed:
                    return          # written by the save that ran meanwhile, begun after the change
                await self._write_within()
        except OSError as exc:
            if self._retry is None:         # once per failure run: each retry would say the same
                self._log.error("%s %s not written, retrying every %g s (%s if the broker stops before it is): %s",
                                self._what, self.path, self.retry_write_s, self._undone, exc)
                self._retry = asyncio.get_running_loop().create_task(self._write_again())
            raise

    async def _encoded(self) -> tuple[bytes, int]:
        """The table's bytes and the counter they were taken at (a table that may be large encodes it a slice at
        a time, the loop running between two)."""
        return self.encode(), self.counter

    async def _write_within(self) -> None:
        if self.write_hung:     # not one more thread stuck behind it, nor the table encoded for nothing
            raise self._hung_error()
        data, counter = await self._encoded()
        if self.write_hung:     # (hung while it was encoded, a slice at a time)
            raise self._hung_error()
        # A future of the thread's, not a task: the loop's end cancels every task, and the write's, cancelled, was
        # said to have ended ("the write that hung has ended") while it still hung, the gauge back to 0.
        write = asyncio.get_running_loop().run_in_executor(None, self.write, data, counter)
        self._writes += 1
        write.add_done_callback(self._write_ended)
        try:
            await asyncio.wait_for(asyncio.shield(write), self.write_wait_s)
        except TimeoutError:
            if not write.done():
                self.write_hung = True
            raise self._hung_error() from None

    def _hung_error(self) -> OSError:
        return OSError(errno.ETIMEDOUT, f"a write of it has not ended in {self.write_wait_s:g} s (a hung disk or "
                                        f"a stopped network file system?)")

    def _write_ended(self, write: asyncio.Future) -> None:
        if write.cancelled():       # (not by its thread: the write may still run)
            return
        write.exception()           # (its waiter's to raise; none once it was given up)
        self._writes -= 1
        if self.write_hung and not self._writes:
            self.write_hung = False
            self._log.warning("%s %s: the write that hung has ended", self._what, self.path)

    async def _write_again(self) -> None:
        while self._saved_counter < self.counter:       # (else a later change's save wrote it meanwhile)
            await asyncio.sleep(self.retry_write_s)
            try:
                await self._write_within()
            except OSError:
                continue
        self._retry = None
        self._log.warning("%s %s written again", self._what, self.path)

    async def close(self) -> None:
        """(The broker stops) a failed save is tried a last time, not retried any more; within ``write_wait_s``."""
        if self._retry is None:
            return
        self._retry.cancel()
        self._retry = None
        try:
            await self._write_within()
        except OSError as exc:      # a full disk, a hung one, must not turn a clean stop into a crash or a hang
            self._log.error("%s %s not written at stop (%s): %s", self._what, self.path, self._undone, exc)
