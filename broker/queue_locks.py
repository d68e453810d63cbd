"""Orderly consumers' queue locks (LOCK_BATCH_MQ) kept across a broker restart.

RocketMQ keeps them in memory only, and a stock orderly consumer trusts a lock it was granted for 30 s
(rocketmq.client.rebalance.lockMaxLiveTime) after its last renewal, broker restart or not. A restarted broker
holding no lock granted the queue to the first other consumer of the group that asked (the one whose heartbeat
reached it first took every queue at its rebalance): two consumers of one orderly queue at once, out of order
and again, with nothing said. Saved here (at most ``interval_s`` after a holder changes, and at a stop), a lock
is held again at start for ``RESTORED_LIFE_MS`` (35 s, past the 30 s its holder can still trust it): its holder
renews it as ever, any other consumer waits for it to lapse. A change of holder within ``interval_s``
before a kill -9 is not in the file: a new lock is not held again (RocketMQ's behaviour for that queue), a lock
that went to another consumer is held again for its previous holder (the new one refused until it lapses).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os

from .store.saved import DaemonThreads, read_saved, retrieved, save

log = logging.getLogger("txmq.locks")
FILE_NAME = "queueLocks.json"
# How long a lock held again at start lives unless its holder renews it. Its holder trusts it for 30 s after its
# last renewal (rocketmq.client.rebalance.lockMaxLiveTime), which came before the stop: 35 s outlives that trust
# with 5 s to spare, where the whole queue_lock_max_live_ms (60 s) kept the queue of a holder gone during the
# restart from the rest of its group 25 s longer than any consumer could still be using it.
RESTORED_LIFE_MS = 35_000
# How long a stock orderly consumer trusts a lock after its grant (rocketmq.client.rebalance.lockMaxLiveTime): a
# queue_lock_max_live_ms below it lets the broker grant a queue to another consumer while its holder still consumes it.
CLIENT_LOCK_TRUST_MS = 30_000
_SLICE = 2048           # entries encoded at a time (a few ms holding the GIL)


def _parse(data) -> list[list]:
    holders = data["locks"]
    for entry in holders:
        group, topic, qid, client_id = entry
        if not (isinstance(group, str) and isinstance(topic, str) and type(qid) is int and isinstance(client_id, str)):
            raise TypeError(f"lock entry {entry!r} is not [group, topic, queue id, client id]")
    return holders


def _write(path: str, locks: dict, now: int, max_live_ms: int) -> None:
    """Save ``ClientRegistry.lock_table()`` as [group, topic, queue id, client id] entries, but those lapsed at
    ``now`` (not swept yet: each would be held again at start as renewed then, a queue whose consumer is gone kept
    from the others for another ``max_live_ms``). Blocking: on the lock file's own thread (``LockFile._writer``), one
    save at a time, as all write ``<path>.tmp``: the stop's save may be queued while the periodic one, its task
    cancelled, still runs there."""
    entries = [[*key, holder[0]] for key, holder in locks.items() if now - holder[1] <= max_live_ms]
    # A slice at a time: one json.dumps is one C call holding the GIL throughout, and the loop stood still for the
    # whole table's (200,000 locks: 0.5-0.8 s); between slices the thread gives the GIL back.
    slices = (json.dumps(entries[i:i + _SLICE])[1:-1] for i in range(0, len(entries), _SLICE))
    data = ('{"locks": [' + ", ".join(slices) + "]}").encode()
    save(path, data)


class LockFile:
    stop_wait_s = 2.0       # what a stop waits for its save (behind a write still running: a hung disk?)
    write_wait_s = 2.0      # a save's write not ended by then is said hung (txmq_config_write_hung{file}), as the
                            # other config files' (retried_save.py): the locks granted meanwhile are not saved

    def __init__(self, config_dir: str, clients, metrics=None, interval_s: float = 1.0, max_live_ms: int = 60_000):
        self.path = os.path.join(config_dir, FILE_NAME)
        self.clients = clients
        self.metrics = metrics
        self.interval_s = interval_s
        self.max_live_ms = max_live_ms      # queue_lock_max_live_ms: a lock lapsed is not saved
        self._saved = -1            # clients.lock_holders_changed as of the last save (-1: none yet)
        self._failing = False
        self.write_hung = False     # a save's write has run past write_wait_s and not ended yet
        # A daemon thread, not the default executor's (the interpreter's exit joins those): a write that hangs (a
        # stopped NFS) kept the stop waiting for ever, before the store and the offsets were closed, and the process
        # from ending. Made at the first save.
        self._writer: DaemonThreads | None = None

    def load(self) -> int:
        """Hold again the locks the previous run saved, each for ``RESTORED_LIFE_MS`` unless renewed; how many.
        An unreadable file is said at ERROR and the broker starts with none (as RocketMQ always does)."""
        holders, why = read_saved(self.path, _parse)
        if why == "missing":
            self._saved = self.clients.lock_holders_changed     # no file, no lock: nothing to write until a grant
            return 0
        if why is not None:
            log.error("queue lock file %s cannot be read (%s): starting with no queue locks; an orderly consumer "
                      "that held one before the restart may share its queue with another for up to 30 s",
                      self.path, why)
            return 0
        clients = self.clients
        clients.restore_locks(holders, clients.clock() - max(0, self.max_live_ms - RESTORED_LIFE_MS))
        self._saved = clients.lock_holders_changed
        if holders:
            log.info("%d queue locks held again from %s: their holders renew them, others wait for them to lapse",
                     len(holders), self.path)
        return len(holders)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.clients.lock_holders_changed != self._saved:
                await self.save()

    def _start_write(self) -> tuple[int, asyncio.Future]:
        if self._writer is None:
            self._writer = DaemonThreads("txmq-queue-locks")
        changed = self.clients.lock_holders_changed
        locks = self.clients.lock_table()       # the loop only copies (200,000 locks: 55 ms); encoded off it
        return changed, asyncio.get_running_loop().run_in_executor(self._writer, _write, self.path, locks,
                                                                   self.clients.clock(), self.max_live_ms)

    async def close(self) -> None:
        """(The broker stops) write the locks held now, waiting ``stop_wait_s`` at most: a stop behind a hung write
        gives the file up (the next start holds the locks of its last save), said at ERROR, and goes on. Nothing
        changed since the last save (or the start, with no file and no lock): nothing written. Every stop wrote the
        file, a broker no orderly consumer ever used included: the 4 KiB block it takes on a full disk was the room
        a stop's other writes were left (the transaction snapshot's full-disk test saw 45,056 bytes free, not 49,152)."""
        if self.clients.lock_holders_changed == self._saved:
            if self._writer is not None:
                self._writer.shutdown(wait=False)
                self._writer = None
            return
        changed, writing = self._start_write()
        writer, self._writer = self._writer, None
        try:
            await asyncio.wait_for(asyncio.shield(writing), self.stop_wait_s)
        except TimeoutError:
            writing.add_done_callback(retrieved)
            log.error("queue lock file %s not written at stop: a write has not ended in %g s (a hung disk or a "
                      "stopped network file system?); the next start holds the locks of its last save",
                      self.path, self.stop_wait_s)
        except OSError as exc:      # a full disk must not turn a clean stop into a crash
            if self.metrics is not None:
                self.metrics.queue_lock_saves_failed.inc()
            log.error("queue lock file %s not written at stop (the next start holds the locks of its last save): "
                      "%s", self.path, exc)
        else:
            self._saved = changed
        finally:
            writer.shutdown(wait=False)

    async def save(self) -> None:
        """Write the locks held now, off the loop; a failure is said at ERROR once until a save succeeds again."""
        changed, writing = self._start_write()
        try:
            try:
                await asyncio.wait_for(asyncio.shield(writing), self.write_wait_s)
            except TimeoutError:
                self.write_hung = True
                log.error("queue lock file %s: a write has not ended in %g s (a hung disk or a stopped network file "
                          "system?); locks granted meanwhile are not saved, a restart forgets them", self.path,
                          self.write_wait_s)
                await asyncio.shield(writing)   # (a stop cancelling the loop here has not ended the write)
        except OSError as exc:
            if self.metrics is not None:
                self.metrics.queue_lock_saves_failed.inc()
            if not self._failing:
                self._failing = True
                log.error("queue lock file %s not written (retrying every %g s; a restart meanwhile forgets the "
                          "locks granted since): %s", self.path, self.interval_s, exc)
            return
        finally:
            if self.write_hung and writing.done():
                self.write_hung = False
                log.warning("queue lock file %s: the write that hung has ended", self.path)
        if self._failing:
            self._failing = False
            log.warning("queue lock file %s written again", self.path)
        self._saved = changed
