"""The commit log and its single writer: the only code that writes segment files.

``<store_dir>/commitlog/<20-digit start offset>``, every segment ``segment_size`` bytes,
records back to back in the store-record layout of ``protocol.message`` (spec 6.1). A
record never spans two segments: when ``record + 8`` does not fit in what is left, the
writer closes the segment with an end marker and starts the record at byte 0 of the next:

    offset  size  field
    0       4     TOTALSIZE    bytes left in the segment, the marker included
    4       4     MAGIC        BLANK_MAGIC 0xCBD43194
    8       ...   zeros        (never written)

The writer coroutine owns every append. ``put`` / ``put_many`` queue (request, future);
the writer drains everything queued, validates, assigns queue and physical offsets,
patches them and the store timestamp into each record, and copies it into the mmap. In
sync mode the written range is msync'ed on the flush thread while the writer keeps
copying newer batches; when a flush returns, everything it covered becomes readable,
gets its consume-queue units and dispatch, and its futures resolve (group commit: one
msync for all that was written meanwhile). In async mode a batch is readable and
resolved as soon as it is copied, and a timer flushes every ``flush_interval_ms``.

Readers see only bytes below ``readable``, so they never meet a half-written record, and
in sync mode never an unflushed one. An I/O error stops the writer for good: nothing more
is accepted and nothing unflushed is acknowledged.
"""
from __future__ import annotations

import asyncio
import logging
import os
import struct
from typing import Callable

from protocol.message import BLANK_MAGIC, MESSAGE_MAGIC, POS_QUEUE_OFFSET, validate_topic

from .config import StoreConfig
from .mapped_file import MappedFile
from .results import DispatchInfo, PutRequest, PutResult, PutStatus

log = logging.getLogger("txmq.store")

_SIZE_MAGIC = struct.Struct(">ii")
_CHECK = struct.Struct(">ii4xi20xi")   # TOTALSIZE, MAGIC, QUEUEID, SYSFLAG
_QOFF_PHYS = struct.Struct(">qq")      # QUEUEOFFSET, PHYSICALOFFSET (adjacent at 20)
_I64 = struct.Struct(">q")
_OK, _ILLEGAL = PutStatus.PUT_OK, PutStatus.MESSAGE_ILLEGAL
_UNAVAILABLE, _CREATE_FAILED = PutStatus.SERVICE_NOT_AVAILABLE, PutStatus.CREATE_MAPPED_FILE_FAILED
_BORN_V6, _STORE_V6 = 0x10, 0x20


class Segment(MappedFile):
    __slots__ = ("first_ts", "last_ts", "written")

    def __init__(self, *args):
        super().__init__(*args)
        self.first_ts = -1      # store timestamps of the first and last record, -1 while unknown
        self.last_ts = -1
        self.written = -1       # end of the last record; -1 while unknown (sealed, not yet walked)


class _Illegal(Exception):
    pass


class CommitLog:
    def __init__(self, directory: str, config: StoreConfig, clock: Callable[[], int]):
        self.directory = directory
        self.config = config
        self.seg_size = config.segment_size
        self.segments: list[Segment] = []
        self.readable = 0           # readers may see [min_offset, readable)
        self.flushed = 0
        self.flushed_ts = 0         # store timestamp of the last record below ``flushed``
        self.failed: str | None = None
        self.qoffsets: dict[tuple[str, int], int] = {}   # next queue offset per (topic, queue)
        self.on_commit: Callable[[list, list], None] = lambda units, infos: None
        self.dispatching = False    # build DispatchInfo only when someone listens
        self._clock = clock
        self._limit = config.record_limit
        self._sync = config.flush == "sync"
        self._pos = 0               # write position in the active segment
        self._last_ts = 0
        self._queue: list = []
        self._controls: list = []
        self._wake: asyncio.Future | None = None
        self._closing = False
        self._dirty_lo = 0          # active segment unflushed from here; sealed ones are in _dirty_sealed
        self._dirty_sealed: list[tuple[Segment, int, int]] = []
        self._waiting: list = []    # sync: (future, result) awaiting the next flush
        self._units: list = []      # consume-queue units and dispatch of records not yet readable
        self._infos: list = []
        self._flushing = None       # (executor future, end, end ts, waiting, units, infos)
        self._flush_due = False
        self._tick = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------ layout
    @property
    def min_offset(self) -> int:
        return self.segments[0].start if self.segments else 0

    @property
    def written(self) -> int:
        return self.segments[-1].start + self._pos if self.segments else 0

    def locate(self, phys: int) -> tuple[Segment, int] | None:
        segs = self.segments
        if not segs or phys < segs[0].start:
            return None
        idx = (phys - segs[0].start) // self.seg_size
        if idx >= len(segs):
            return None
        seg = segs[idx]
        return seg, phys - seg.start

    def new_segment(self, start: int) -> Segment:
        seg = Segment.create(self.directory, start, self.seg_size,
                             reserve=self.seg_size if self.config.preallocate else 0)
        self.segments.append(seg)
        return seg

    def set_end(self, phys: int, last_ts: int) -> None:
        """Where appends continue after recovery; everything below is durable and readable."""
        last = self.segments[-1]
        if not last.start <= phys <= last.start + self.seg_size - 8:
            raise AssertionError(f"log end {phys} is not in the active segment {last.name}")
        self._pos = self._dirty_lo = last.written = phys - last.start
        self.readable = self.flushed = phys
        self.flushed_ts = self._last_ts = last_ts

    def zero(self, seg: Segment, lo: int, hi: int) -> None:
        """Recovery only: erase a torn or cut tail so the next start does not see it again."""
        seg.mm[lo:hi] = bytes(hi - lo)
        seg.flush(lo, hi)

    def drop_segments_from(self, index: int) -> list[str]:
        gone = [seg.name for seg in self.segments[index:]]
        for seg in self.segments[index:]:
            seg.remove()
        del self.segments[index:]
        return gone

    # ------------------------------------------------------------ reads
    def record(self, phys: int) -> memoryview | None:
        """One whole record, checked: in bounds, readable, MESSAGE magic, and its own offset field."""
        if phys.__class__ is not int or phys >= self.readable:
            return None
        where = self.locate(phys)
        if where is None:
            return None
        seg, pos = where
        if pos + 91 > self.seg_size or seg.mm is None:
            return None
        size, magic = _SIZE_MAGIC.unpack_from(seg.mm, pos)
        if (magic != MESSAGE_MAGIC or size < 91 or pos + size > self.seg_size or phys + size > self.readable
                or _I64.unpack_from(seg.mm, pos + 28)[0] != phys):
            return None
        return seg.view[pos:pos + size]

    def slice(self, phys: int, size: int) -> memoryview | None:
        """The record a consume-queue unit points at; None when removed or not what the unit says."""
        if phys + size > self.readable:
            return None
        where = self.locate(phys)
        if where is None:
            return None
        seg, pos = where
        if pos + size > self.seg_size or size < 91 or seg.mm is None:
            return None
        if _SIZE_MAGIC.unpack_from(seg.mm, pos) != (size, MESSAGE_MAGIC):
            return None
        return seg.view[pos:pos + size]

    # ------------------------------------------------------------ writer API
    def start(self, executor) -> None:
        self._loop = asyncio.get_running_loop()
        self._executor = executor
        self._task = self._loop.create_task(self._run(), name="txmq-store-writer")

    def put(self, req: PutRequest) -> asyncio.Future:
        fut = self._loop.create_future()
        if self.failed is not None or self._closing:
            fut.set_result(PutResult(_UNAVAILABLE))
            return fut
        self._queue.append((req, fut))
        w = self._wake
        if w is not None:
            self._wake = None
            w.set_result(None)
        return fut

    def put_many(self, reqs: list[PutRequest]) -> asyncio.Future:
        if not reqs:
            fut = self._loop.create_future()
            fut.set_result([])
            return fut
        return self.put(list(reqs))

    async def control(self, fn):
        """Run ``fn`` (a coroutine function) in the writer, between batches, with no flush in flight."""
        fut = self._loop.create_future()
        self._controls.append((fn, fut))
        self._wakeup()
        return await fut

    async def close(self) -> None:
        self._closing = True
        self._wakeup()
        if self._task is not None:
            await self._task

    def _wakeup(self, _=None) -> None:
        w = self._wake
        if w is not None and not w.done():
            self._wake = None
            w.set_result(None)

    # ------------------------------------------------------------ the writer
    async def _run(self) -> None:
        loop = self._loop
        try:
            while True:
                if self._queue and not self._controls:
                    entries, self._queue = self._queue, []
                    self._write(entries)
                fl = self._flushing
                if fl is not None and fl[0].done():
                    self._flush_done()
                    fl = None
                dirty = self._dirty_sealed or self._pos > self._dirty_lo
                if fl is None:
                    if dirty and (self._sync or self._flush_due or self._closing or self._controls):
                        self._start_flush()
                        continue
                    if self._controls:
                        fn, fut = self._controls.pop(0)
                        try:
                            fut.set_result(await fn())
                        except Exception as exc:
                            fut.set_exception(exc)
                        continue
                    if self._closing and not self._queue:
                        break
                if self._queue and not self._controls:
                    continue
                if not self._sync and dirty and self._tick is None:
                    self._tick = loop.call_later(self.config.flush_interval_ms / 1000, self._flush_tick)
                self._wake = w = loop.create_future()
                await w
        except BaseException as exc:
            self._fail(f"the writer stopped unexpectedly: {exc!r}")
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("store writer crashed")
            pending = list(self._waiting) + (list(self._flushing[3]) if self._flushing else [])
            self._waiting = []
            for fut, res in pending:
                _resolve(fut, _unavailable(res))
            for fn, fut in self._controls:
                if not fut.done():
                    fut.set_exception(RuntimeError("the store writer stopped"))
            raise
        finally:
            if self._tick is not None:
                self._tick.cancel()

    def _flush_tick(self) -> None:
        self._tick = None
        self._flush_due = True
        self._wakeup()

    def _write(self, entries: list) -> None:
        sync = self._sync
        done = self._waiting if sync else []
        units = self._units
        infos = self._infos
        for i, (req, fut) in enumerate(entries):
            if self.failed is not None:
                for req, fut in entries[i:]:
                    _resolve(fut, _unavailable(req))
                break
            many = req.__class__ is list
            try:
                res = self._append_many(req) if many else self._append(req, self._check(req))
            except _Illegal:
                _resolve(fut, [PutResult(_ILLEGAL) for _ in req] if many else PutResult(_ILLEGAL))
                continue
            except OSError as exc:
                self._fail(f"cannot create segment {self.segments[-1].start + self.seg_size:020d}: {exc}")
                res = [PutResult(_CREATE_FAILED) for _ in req] if many else PutResult(_CREATE_FAILED)
            done.append((fut, res))
        self.segments[-1].written = self._pos
        if not sync:
            self.readable = self.written
            self._units, self._infos = [], []
            self.on_commit(units, infos)
            for fut, res in done:
                _resolve(fut, res)

    def _check(self, req: PutRequest):
        rec = req.record
        if rec.__class__ is not bytearray:
            rec = bytearray(rec)
        n = len(rec)
        if n < 91 or n > self._limit:
            raise _Illegal
        total, magic, qid, sys_flag = _CHECK.unpack_from(rec, 0)
        if total != n or magic != MESSAGE_MAGIC or qid != req.queue_id or qid < 0:
            raise _Illegal
        key = None
        if not sys_flag & 0x4:      # NOT (0) and COMMIT (8) get a consume-queue unit; PREPARED, ROLLBACK none
            key = (req.topic, qid)
            if key not in self.qoffsets:
                if validate_topic(req.topic) is not None:
                    raise _Illegal
                self.qoffsets[key] = 0
        return rec, n, sys_flag, key

    def _append_many(self, reqs: list) -> list[PutResult]:
        checked = [self._check(r) for r in reqs]
        total = sum(c[1] for c in checked)
        if self._pos + total + 8 > self.seg_size and total + 8 <= self.seg_size:
            self._roll()        # keep the batch in one segment, contiguous
        return [self._append(r, c) for r, c in zip(reqs, checked)]

    def _append(self, req: PutRequest, checked) -> PutResult:
        rec, n, sys_flag, key = checked
        pos = self._pos
        if pos + n + 8 > self.seg_size:
            self._roll()
            pos = 0
        seg = self.segments[-1]
        phys = seg.start + pos
        if key is not None:
            qoff = self.qoffsets[key]
            self.qoffsets[key] = qoff + 1
        else:
            qoff = 0
        now = self._clock()
        _QOFF_PHYS.pack_into(rec, POS_QUEUE_OFFSET, qoff, phys)
        _I64.pack_into(rec, 68 if sys_flag & _BORN_V6 else 56, now)
        seg.mm[pos:pos + n] = rec
        self._pos = pos + n
        if pos == 0:
            seg.first_ts = now
        seg.last_ts = self._last_ts = now
        tag = req.tags_code
        if key is not None:
            self._units.append((key, phys, n, tag))
        else:
            qoff = -1
        if self.dispatching:
            prepared = 0
            if sys_flag & 0xC:
                p = 76 + (12 if sys_flag & _BORN_V6 else 0) + (12 if sys_flag & _STORE_V6 else 0)
                prepared = _I64.unpack_from(rec, p)[0]
            self._infos.append(DispatchInfo(req.topic, req.queue_id, qoff, phys, n, tag, now, sys_flag, prepared,
                                            False))
        return PutResult(_OK, phys, n, now, qoff)

    def _roll(self) -> None:
        old = self.segments[-1]
        pos = self._pos
        new = self.new_segment(old.start + self.seg_size)     # OSError: nothing written yet
        _SIZE_MAGIC.pack_into(old.mm, pos, self.seg_size - pos, BLANK_MAGIC)
        old.written = pos
        self._dirty_sealed.append((old, self._dirty_lo, pos + 8))
        self._pos = self._dirty_lo = 0
        new.written = 0

    def _start_flush(self) -> None:
        ranges = self._dirty_sealed
        ranges.append((self.segments[-1], self._dirty_lo, self._pos))
        self._dirty_sealed = []
        self._dirty_lo = self._pos
        self._flush_due = False
        fut = self._loop.run_in_executor(self._executor, _flush_ranges, ranges)
        fut.add_done_callback(self._wakeup)
        self._flushing = (fut, self.written, self._last_ts, self._waiting, self._units, self._infos)
        if self._sync:
            self._waiting, self._units, self._infos = [], [], []

    def _flush_done(self) -> None:
        fut, end, end_ts, waiting, units, infos = self._flushing
        self._flushing = None
        exc = fut.exception()
        if exc is not None:
            self._fail(f"msync failed: {exc}")
            for f, res in waiting:
                _resolve(f, _unavailable(res))
            return
        self.flushed, self.flushed_ts = end, end_ts
        if self._sync:
            self.readable = end
            self.on_commit(units, infos)
            for f, res in waiting:
                _resolve(f, res)

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            log.error("store stops accepting writes: %s", reason)
        queued, self._queue = self._queue, []
        for req, fut in queued:
            _resolve(fut, _unavailable(req))


def _flush_ranges(ranges) -> None:
    for seg, lo, hi in ranges:
        seg.flush(lo, hi)


def _unavailable(req_or_res):
    if req_or_res.__class__ is list:
        return [PutResult(_UNAVAILABLE)] * len(req_or_res)
    return PutResult(_UNAVAILABLE)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
