"""The single writer coroutine: queueing, group commit, completion.

``put`` / ``put_many`` queue (request, future) and return the future. The writer drains
everything queued and hands it to ``CommitLog.append`` in one go. Then:

* sync: the written ranges are msync'ed on the flush thread while the writer goes on
  copying whatever arrives meanwhile; when the flush returns, everything it covered
  becomes readable, gets its consume-queue units and dispatch (``on_commit``), and its
  futures resolve; the next flush covers all that was copied during this one (group
  commit: one msync per batch, never one per message).
* async: a batch is readable, indexed and resolved as soon as it is copied; a timer
  flushes every ``flush_interval_ms``.

Sync mode keeps up to two flushes in flight, one per flush thread: a batch copied while
one msync has been in the kernel for ``second_flush_after`` (0.5 ms: the disk is slow right
now) starts its own instead of waiting a whole cycle. Flushes in flight together complete
together, in log order, once both have returned, and an error from either refuses both (a
file's writeback error reaches one msync of it, not necessarily the one whose range failed). Controls (segment removal) run
between batches with no flush in flight.

Space: when ``append`` stops at an entry that does not fit the reserved space, the rest
goes back to the head of the queue and the writer awaits the reserver (off the loop's
thread); then it goes on, or, if the disk had no room, refuses that one entry
(SERVICE_NOT_AVAILABLE, "the broker's disk is full") and goes on with the next. While
the disk is over its refuse ratio (``DiskMonitor.refusing``) puts are refused before
they are queued. Only an I/O error after bytes reached a segment stops the writer for
good: nothing more is accepted and nothing unflushed is acknowledged.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import weakref
from typing import Callable

from protocol.errors import StoreError

from .commit_log import CommitLog, resolve, unavailable
from .replica import ReplicaChunk
from .disk import DiskMonitor
from .results import PutRequest

log = logging.getLogger("txmq.store")
# RocketMQ's DefaultMessageStore answers a put on a slave SERVICE_NOT_AVAILABLE; its log line says why.
_SLAVE_REMARK = "the broker role is SLAVE: messages are written to its master, never to a slave"
SLOW_FLUSH_WINDOW_S = 300   # the flushes a stop judges the disk by (Writer.slowest_flush_s): the last 5 minutes


class Writer:
    # Copy newer batches while a flush is in flight (measured in bench/bench_store.py --compare).
    _overlap = True
    # msync on the event loop itself instead of the flush thread (only for that measurement).
    _flush_inline = False

    def __init__(self, clog: CommitLog, on_commit: Callable[[list, list], None], disk: DiskMonitor):
        self.clog = clog
        self.disk = disk
        self.on_commit = on_commit  # ({queue: packed units}, dispatch infos) of records just made readable
        self._sync = clog.config.flush == "sync"
        self._interval = clog.config.flush_interval_ms / 1000
        self._queue: list = []
        self._controls: list = []
        self._wake: asyncio.Future | None = None
        self._closing = False
        self._waiting: list = []    # sync: (future, result) and the units / dispatch awaiting the next flush
        self._units: dict = {}
        self._infos: list = []
        self._flushing: list = []   # in log order: (future, end, end ts, waiting, units, infos, started, thread)
        self._flush_due = False
        self._tick = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._io: IoThread | None = None
        self._task: asyncio.Task | None = None
        self._space = None          # (job future, settle, the entry waiting for it) while awaiting the reserver
        self._space_failing = False
        self._taken: list | None = None     # the (request, future) entries _write is copying
        self.on_flush: Callable[[float], None] | None = None    # seconds one flush took (metrics)
        # The longest flush that returned in each of the last minutes (minute, seconds): how slow this disk is now,
        # not hung (slowest_flush_s). Over the process's life, one slow minute hours ago bounded every later stop.
        self._slowest: collections.deque = collections.deque(maxlen=SLOW_FLUSH_WINDOW_S // 60 + 1)
        # A second flush starts only once the one in flight has run this long (seconds): the disk is slow
        # right now and the next batch should not wait a whole cycle for it. Sooner, waiting is cheaper:
        # a second flush splits the group commit in two, and each costs hand-offs to a thread and back.
        # Measured (docs/performance.md): 0 (always) / 0.5 ms / never: plain c=64 23-25k / 24-26k /
        # 27-28k msgs/s; transactions 8.4-8.5k / 8.6-8.9k / 7.7-7.8k a second.
        self.second_flush_after = 0.0005
        self.replica_only = False   # a slave: its log takes its master's bytes only (put_replica)
        # Copies of an older broker's records with a NUL in their properties built and not yet written
        # (PutRequest.older_nul), by id, held weakly: one refused before it is queued, or built and never put
        # (a scheduled delivery left for the next batch), leaves by itself. Counted by hand, such a copy stayed
        # counted for good and every batch after it paid the scan. And the store's coroutine that makes
        # nul_free_from durably at least a given offset (_vouch_first).
        self.nul_copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.raise_nul_free_from: Callable[[int], object] | None = None
        self.begin_nul_copy: Callable[[int], object] | None = None     # (-1: withdrawn)
        self._nul_chunks = 0        # a slave's queued chunks with ReplicaChunk.older_nul
        clog.on_fail = self._drop_queue

    def start(self, io: "IoThread", io2: "IoThread | None" = None) -> None:
        """``io2``, if given, lets a second flush start while the first is in the kernel (pipelined group
        commit: the hand-off to a thread and back costs about what the msync itself does)."""
        self._loop = asyncio.get_running_loop()
        self._io = io
        self._threads = [t for t in (io, io2) if t is not None]
        self._task = self._loop.create_task(self._run(), name="txmq-store-writer")

    # ------------------------------------------------------------ API
    def put(self, req, reclaim: bool = False, then=None) -> asyncio.Future:
        """Queue ``req`` (a PutRequest, or a list written all or none). ``reclaim`` marks the few records
        written to free space (dead letters before a segment is removed): the watermark does not refuse
        them, though a disk with truly no room still does.

        ``then``: instead of a new future, any object with ``done()`` and ``set_result(result)`` (a
        completion called directly when the result is known, with no loop callback between; it must not
        raise). It is returned."""
        fut = then if then is not None else (self._loop or asyncio.get_running_loop()).create_future()
        if self._task is None or self.clog.failed is not None or self._closing or self.replica_only:
            fut.set_result(unavailable(req, self._closed_remark()))
            return fut                              # not open, closed, stopped after an I/O error, a slave
        if not reclaim and self.disk.refusing and self.disk.still_refusing():
            fut.set_result(unavailable(req, self.disk.refuse()))
            return fut
        self._queue.append((req, fut))
        w = self._wake
        if w is not None:
            self._wake = None
            w.set_result(None)
        return fut

    def _closed_remark(self) -> str:
        if self.replica_only:
            return _SLAVE_REMARK
        return self.clog.refusal() if self.clog.failed is not None else ""

    def put_replica(self, chunk) -> asyncio.Future:
        """Queue a master's chunk (a ReplicaChunk) on a slave: the one write a slave's log takes."""
        fut = (self._loop or asyncio.get_running_loop()).create_future()
        if self._task is None or self.clog.failed is not None or self._closing:
            fut.set_result(unavailable(chunk, self.clog.refusal() if self.clog.failed is not None else ""))
            return fut
        if self.disk.refusing and self.disk.still_refusing():
            fut.set_result(unavailable(chunk, self.disk.refuse()))
            return fut
        self._queue.append((chunk, fut))
        if chunk.older_nul:
            self._nul_chunks += 1
        self._wakeup()
        return fut

    def put_many(self, reqs: list[PutRequest], reclaim: bool = False, then=None) -> asyncio.Future:
        if not reqs:
            fut = then if then is not None else (self._loop or asyncio.get_running_loop()).create_future()
            fut.set_result([])
            return fut
        return self.put(list(reqs), reclaim, then)

    async def control(self, fn):
        """Run ``fn`` (a coroutine function) in the writer, between batches, with no flush in flight."""
        if self._task is None or self._task.done():
            raise StoreError("the store writer is not running")
        fut = self._loop.create_future()
        self._controls.append((fn, fut))
        self._wakeup()
        return await fut

    async def close(self) -> None:
        """Write and flush everything queued, then stop."""
        self._closing = True
        self._wakeup()
        if self._task is not None:
            try:
                await self._task
            except Exception:   # a crash: logged when it happened, and the log's failure says why
                pass

    def _wakeup(self, _=None) -> None:
        w = self._wake
        if w is not None and not w.done():
            self._wake = None
            w.set_result(None)

    # ------------------------------------------------------------ the loop
    async def _run(self) -> None:
        loop = self._loop
        clog = self.clog
        try:
            while True:
                sp = self._space
                if sp is not None and sp[0].done():
                    self._space_done()
                if (self._queue and self._space is None and not self._controls
                        and (self._overlap or not self._flushing)):
                    entries, self._queue = self._queue, []
                    self._taken = entries       # if _write raises, the clean-up below refuses them
                    if self.nul_copies or self._nul_chunks:
                        entries = self._taken = await self._vouch_first(entries)
                        if not entries:     # (written there, or refused: an empty _write would still make
                            self._taken = None      # what a failed log holds readable in async mode)
                            continue
                    self._write(entries)
                    self._taken = None
                fl = self._flushing
                if fl and all(f[0].done() for f in fl):
                    self._flushes_done()
                if (clog.dirty and (not fl or (self._overlap
                                               and time.perf_counter() - fl[-1][6] >= self.second_flush_after
                                               and self._flush_thread() is not None))
                        and (self._sync or self._flush_due or self._closing or self._controls)):
                    self._start_flush()
                    continue
                if not fl:
                    if self._controls:
                        fn, fut = self._controls.pop(0)
                        if not fut.done():  # (else its caller was cancelled before it ran -- a stop's: not
                            await _control(fn, fut)     # done, as the caller was told)
                        continue
                    if self._closing and not self._queue and self._space is None:
                        break
                if self._queue and self._space is None and not self._controls and (self._overlap or not fl):
                    continue
                sp = self._space
                if sp is not None and sp[0].done():     # (settled while _vouch_first awaited: its wake-up lost)
                    continue
                if not self._sync and clog.dirty and self._tick is None:
                    self._tick = loop.call_later(self._interval, self._flush_tick)
                self._wake = w = loop.create_future()
                await w
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                clog.failed = clog.failed or "the writer was cancelled"
            else:
                log.exception("store writer crashed")
            clog.fail(f"the writer stopped unexpectedly: {exc!r}")
            # Everything not yet answered: what waits for a flush, what is in one (a batch leaves _flushing
            # only once completed), and the batch being copied (only its copied part is on a list so far).
            pending = self._waiting + [w for fl in self._flushing for w in fl[3]]
            pending += [(fut, req) for req, fut in self._taken or ()]
            self._waiting, self._taken = [], None
            remark = clog.refusal()
            for fut, res in pending:
                resolve(fut, unavailable(res, remark))
            for _fn, fut in self._controls:
                if not fut.done():
                    fut.set_exception(StoreError("the store writer stopped"))
            raise
        finally:
            if self._tick is not None:
                self._tick.cancel()

    def _flush_tick(self) -> None:
        self._tick = None
        self._flush_due = True
        self._wakeup()

    async def _vouch_first(self, entries: list) -> list:
        """The entries to write now: those before the first copy of an older broker's NUL record (the rest go
        back to the head of the queue), or none once the entry holding that copy has been written alone, here.
        A slave's chunk holding its master's NUL record past the slave's mark goes the same way.

        Past nul_free_from a NUL in the properties is what a torn page leaves: the next start after a crash cuts
        it as torn, and reads refuse it. So, in order: everything before the entry is flushed and completed
        (moved past this broker's records a crash may still tear, the mark would take away the NUL check that
        cuts them); where the entry begins is written down (manifest.write_nul_copy_from, fsynced); the entry
        is written alone and flushed; the mark is moved past its end and fsynced; only then is it readable and
        acknowledged (like a sync batch, whatever the flush mode). A crash before the mark: the next start cuts
        the log where the entry began (nothing after it was written, nothing of it acknowledged), so a copy a
        crash tore is never kept with a page of its properties lost, and its NUL is never read as damage with
        the rest of its entry (a commit's op record, a delivery batch's progress) sound after it. An entry not
        written after all has its beginning withdrawn before anything else is written there. If the mark
        cannot be written, the entry's bytes are in the log: the store stops, as after a failed msync."""
        for k, (req, fut) in enumerate(entries):
            if req.__class__ is ReplicaChunk:
                if req.older_nul:
                    break
            elif any(r.__class__ is PutRequest and r.older_nul for r in (req if req.__class__ is list else (req,))):
                break
        else:
            return entries
        if k:
            self._queue[:0] = entries[k:]
            return entries[:k]
        self._queue[:0] = entries[1:]
        self._taken = entries[:1]
        flagged = [r for r in (req if req.__class__ is list else (req,)) if r.older_nul]
        for r in flagged:
            r.older_nul = False
            if r.__class__ is ReplicaChunk:
                self._nul_chunks -= 1
            else:
                self.nul_copies.pop(id(r), None)
        clog = self.clog
        while clog.failed is None and (self._flushing or clog.dirty):
            if self._flushing:
                await asyncio.wait([f[0] for f in self._flushing])
                self._flushes_done()
            else:
                self._start_flush()
        if clog.failed is not None:
            return entries[:1]          # refused by append
        begin = clog.written
        try:
            await self.begin_nul_copy(begin)
        except OSError as exc:
            log.error("a copy of an older broker's record with a NUL in its properties is refused: where it "
                      "begins could not be written down: %s", exc)
            resolve(fut, unavailable(req, f"cannot record where this store's NUL checks start: {exc}"))
            return []
        sync, self._sync = self._sync, True
        try:
            self._write(entries[:1])
            if clog.written == begin:       # not written: refused (illegal, the log failed), or waiting for room
                if self._space is not None:     # back at the queue's head: still to vouch for
                    for r in flagged:
                        r.older_nul = True
                        if r.__class__ is ReplicaChunk:
                            self._nul_chunks += 1
                        else:
                            self.nul_copies[id(r)] = r
                try:
                    await self.begin_nul_copy(-1)
                except OSError as exc:
                    clog.fail(f"where a copy of an older broker's NUL record began could not be withdrawn: {exc}")
                return []
            self._start_flush()
            flush = self._flushing[-1][0]
            await asyncio.wait([flush])
            failure = flush.exception()
            if failure is None:
                try:
                    await self.raise_nul_free_from(req.nul_end if req.__class__ is ReplicaChunk else clog.written)
                except OSError as exc:
                    failure = exc
                    clog.fail("a copy of an older broker's record with a NUL in its properties is in the log, "
                              f"and the store's nul_free_from could not be moved past it: {exc}")
            if failure is None:
                self._flushes_done()
            else:
                self._flush_done(failure)
        finally:
            self._sync = sync
        return []

    def _write(self, entries: list) -> None:
        clog = self.clog
        try:
            if self._sync:
                stop = clog.append(entries, 0, self._waiting, self._units, self._infos if clog.dispatching else None)
            else:
                done, units, infos = [], {}, []
                stop = clog.append(entries, 0, done, units, infos if clog.dispatching else None)
        except OSError as exc:
            self._write_failed(entries, exc)
            return
        if not self._sync:
            clog.readable = clog.written
            self.on_commit(units, infos)
            for fut, res in done:
                if not fut.done():
                    fut.set_result(res)
        if stop < len(entries):             # out of reserved space: the rest waits, in order, for the reserver
            self._queue[:0] = entries[stop:]
            seg, end, next_need = clog.need
            if next_need:
                job, settle = clog.reserver.prepare_roll(seg, end, next_need, then=self._wakeup)
            else:
                job, settle = clog.reserver.ensure(seg, end, then=self._wakeup)
            self._space = (job, settle, entries[stop])

    def _write_failed(self, entries: list, exc: OSError) -> None:
        """Copying records into a segment failed (an I/O error: the space was reserved). As after a failed
        msync: nothing not yet flushed is acknowledged, nothing more is written or flushed."""
        self.clog.fail(f"writing to the commit log failed: {exc}", exc)
        waiting, self._waiting, self._units, self._infos = self._waiting, [], {}, []
        self.clog.take_dirty()
        remark = self.clog.refusal()
        for fut, res in waiting:
            resolve(fut, unavailable(res, remark))
        for req, fut in entries:
            resolve(fut, unavailable(req, remark))

    def _space_done(self) -> None:
        _job, settle, entry = self._space
        self._space = None
        exc = settle()
        if exc is None:
            if self._space_failing:
                log.warning("space for writes is back: accepting them again")
                self._space_failing = False
            return
        if not isinstance(exc, OSError):
            raise exc                       # a bug, not the disk: the writer stops and says so
        # No room for this entry: refuse it alone; the next one asks again (it may be smaller, or
        # space may be back), so the store stays writable and resumes by itself.
        self.disk.probe()
        if self._queue and self._queue[0] is entry:
            del self._queue[0]
            req, fut = entry
            if req.__class__ is ReplicaChunk and req.older_nul:
                req.older_nul = False
                self._nul_chunks -= 1
            if not self._space_failing:     # once per shortage: every write would say the same
                log.warning("refusing writes that find no space to reserve (%s)", exc)
                self._space_failing = True
            resolve(fut, unavailable(req, self.disk.refuse(f"no space for this write: {exc.strerror or exc}")))

    def _start_flush(self) -> None:
        clog = self.clog
        ranges = clog.take_dirty()
        self._flush_due = False
        io = self._flush_thread()
        if self._flush_inline:
            fut = self._loop.create_future()
            try:
                fut.set_result(_flush_ranges(ranges))
            except OSError as exc:
                fut.set_exception(exc)
        else:
            fut = io.submit(_flush_ranges, ranges, then=self._wakeup)
        self._flushing.append((fut, clog.written, clog.last_ts, self._waiting, self._units, self._infos,
                               time.perf_counter(), io))
        if self._sync:
            self._waiting, self._units, self._infos = [], {}, []

    def _flush_thread(self) -> "IoThread | None":
        """The thread for the next flush: one with no flush in flight and nothing else queued; with none such, the
        least loaded when no flush is in flight, else None (a second flush waits for the first). The first thread
        also runs the checkpoint, the queue list, segments.json and the transactions' snapshot, each fsynced: a
        flush queued there behind them on a slow disk (2 s an fsync, the ten of a checkpoint after a new topic's
        first sends) held every sync send for 20 s, their producers timing out, though the other thread was idle
        and the flush itself was quick."""
        flushing = self._flushing
        if not flushing:        # (every flush at one in flight: the first thread with nothing queued, no lists made)
            for t in self._threads:
                if not t.queued:
                    return t
            return min(self._threads, key=lambda t: t.queued)
        busy = [fl[7] for fl in flushing]       # (never empty here: a flush in flight waits for an idle thread)
        return next((t for t in self._threads if t not in busy and not t.queued), None)

    def flush_age_s(self) -> float:
        """How long the oldest flush in flight has been in the kernel (0.0: none). For the gauge only (not the hot
        path): an msync that never returns (a hung disk, a stopped NFS) held every sync send unanswered, and the
        flush-latency histogram, observed only when a flush ends, never showed it."""
        flushing = self._flushing
        return time.perf_counter() - flushing[0][6] if flushing else 0.0

    def _flushes_done(self) -> None:
        """Every flush in flight has returned: complete them in log order, judged together. Linux reports
        a file's writeback error to one msync of that open file, whatever range it asked for: a later
        flush may return the error of an earlier one's page, which then returns 0 (found in review)."""
        failure = next((f[0].exception() for f in self._flushing if f[0].exception() is not None), None)
        while self._flushing:
            self._flush_done(failure)

    def slowest_flush_s(self) -> float:
        """The longest a flush that returned took within the last SLOW_FLUSH_WINDOW_S (0.0: none)."""
        since = int(time.monotonic() // 60) - SLOW_FLUSH_WINDOW_S // 60
        return max((took for minute, took in self._slowest if minute >= since), default=0.0)

    def _flush_done(self, exc: BaseException | None) -> None:
        # Left in _flushing until completed: if completing raises (a bug), the writer's clean-up answers it.
        fut, end, end_ts, waiting, units, infos, started, _io = self._flushing[0]
        took = time.perf_counter() - started
        minute = int(time.monotonic() // 60)
        if self._slowest and self._slowest[-1][0] == minute:
            if took > self._slowest[-1][1]:
                self._slowest[-1] = (minute, took)
        else:
            self._slowest.append((minute, took))
        if self.on_flush is not None:
            self.on_flush(took)
        if exc is not None:
            # Nothing of this flush, nor of what was written after it, is acknowledged or made
            # readable, and nothing is flushed again: the state on disk is unknown.
            self.clog.fail(f"msync failed: {exc}", exc)
            later, self._waiting, self._units, self._infos = self._waiting, [], {}, []
            for fl in self._flushing[1:]:   # flushes after this one: in flight, but never acknowledged
                later = fl[3] + later
            del self._flushing[:]
            self.clog.take_dirty()
            remark = self.clog.refusal()
            for f, res in waiting + later:
                resolve(f, unavailable(res, remark))
            return
        self.clog.flushed, self.clog.flushed_ts = end, end_ts
        if self._sync:
            self.clog.readable = end
            self.on_commit(units, infos)
            for f, res in waiting:
                if not f.done():
                    f.set_result(res)
        del self._flushing[0]

    def _drop_queue(self) -> None:
        """The log failed: refuse everything still queued."""
        queued, self._queue = self._queue, []
        remark = self.clog.refusal()
        for req, fut in queued:
            resolve(fut, unavailable(req, remark))


async def _control(fn, fut) -> None:
    """Run a control (Writer.control) and answer its caller, if it still waits: one cancelled while ``fn`` ran (a
    stop cancelling the retention or the slave's copy mid-delete) has it done all the same, said if it failed.
    set_result on the cancelled future raised in the writer's loop: the writer crashed, the log failed, every
    later send refused SERVICE_NOT_AVAILABLE until a restart."""
    try:
        result = await fn()
    except Exception as exc:
        if fut.done():
            log.error("a store operation its caller gave up on failed: %s", exc, exc_info=not isinstance(exc, OSError))
        else:
            fut.set_exception(exc)
    else:
        resolve(fut, result)


def _flush_ranges(ranges) -> None:
    for seg, lo, hi in ranges:
        seg.flush(lo, hi)


class IoThread:
    """One thread running blocking file calls (msync, fsync, unmap) in submission order.

    Lighter than run_in_executor -- no concurrent.futures.Future to chain, no pool -- which
    matters because the sync-flush cycle is serial (every appender of a batch waits for the
    same msync), so this hand-off is on its critical path: measured ~57 us against ~92 us a
    round trip. FIFO order also means a file queued for unmapping is never unmapped while an
    earlier flush of it is pending.
    """

    def __init__(self, name: str):
        self._loop = asyncio.get_running_loop()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self.queued = 0     # jobs submitted and not yet settled on the loop (Writer._flush_thread)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args, then: Callable[[], None] | None = None) -> asyncio.Future:
        """Run fn(*args) on the thread; the future resolves on the loop, then ``then()`` runs."""
        fut = self._loop.create_future()
        if self._stopped:       # the thread has ended (or will, before this job): fail it now, not never
            fut.set_exception(StoreError(f"{self._thread.name} is stopped"))
            if then is not None:
                self._loop.call_soon(then)
            return fut
        self.queued += 1
        self._jobs.put((fn, args, fut, then))
        return fut

    def stop(self) -> None:
        """Finish the queued jobs and end the thread (blocking)."""
        self._stopped = True
        self._jobs.put(None)
        self._thread.join()

    def _main(self) -> None:
        call = self._loop.call_soon_threadsafe
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, fut, then = job
            try:
                outcome = (fn(*args), None)
            except BaseException as exc:    # handed to the awaiting coroutine
                outcome = (None, exc)
            try:
                call(self._settle, fut, outcome, then)
            except RuntimeError:            # the loop is closed: nobody is waiting any more
                return

    def _settle(self, fut: asyncio.Future, outcome, then) -> None:
        self.queued -= 1
        # (_settle's body, not a call of it: a call more on every flush's way back, the sync send's critical path)
        if not fut.done():
            result, exc = outcome
            if exc is None:
                fut.set_result(result)
            else:
                fut.set_exception(exc)
        if then is not None:
            then()


def _settle(fut: asyncio.Future, outcome, then) -> None:
    if not fut.done():
        result, exc = outcome
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)
    if then is not None:
        then()
