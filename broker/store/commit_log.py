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

from protocol.errors import StoreError
from protocol.message import BLANK_MAGIC, MESSAGE_MAGIC, POS_PHYSICAL_OFFSET, POS_QUEUE_OFFSET, validate_topic

from .config import StoreConfig
from .mapped_file import MappedFile
from .results import DispatchInfo, PutRequest, PutResult, PutStatus

log = logging.getLogger("txmq.store")

_SIZE_MAGIC = struct.Struct(">ii")
_CHECK = struct.Struct(">ii4xi20xi")   # TOTALSIZE, MAGIC, QUEUEID, SYSFLAG
_QOFF_PHYS = struct.Struct(">qq")      # QUEUEOFFSET, PHYSICALOFFSET: adjacent, one pack patches both
assert POS_PHYSICAL_OFFSET == POS_QUEUE_OFFSET + 8
_I64 = struct.Struct(">q")
_OK, _ILLEGAL = PutStatus.PUT_OK, PutStatus.MESSAGE_ILLEGAL
_UNAVAILABLE, _CREATE_FAILED = PutStatus.SERVICE_NOT_AVAILABLE, PutStatus.CREATE_MAPPED_FILE_FAILED
_BORN_V6, _STORE_V6 = 0x10, 0x20
RESERVE_LOW = 4 << 20       # top up the zero-written space ahead of the writer below this much ...
RESERVE_HIGH = 16 << 20     # ... to this much


class Segment(MappedFile):
    __slots__ = ("first_ts", "last_ts", "written")

    def __init__(self, *args):
        super().__init__(*args)
        self.first_ts = -1      # store timestamps of the first and last record, -1 while unknown
        self.last_ts = -1
        self.written = -1       # end of the last record; -1 while unknown (sealed, not yet walked)


class CommitLog:
    # Copy newer batches while a flush is in flight (measured in bench/bench_store.py --compare).
    _overlap = True

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
        self._reserver = None       # the helper thread that writes zeros ahead of the writer
        self._reserve_job = None    # (concurrent future, segment, target)
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
        seg = Segment.create(self.directory, start, self.seg_size, reserve=0)
        if self.config.preallocate:
            seg.reserved = 0
            self._reserve_now(seg, min(self.seg_size, RESERVE_LOW))
        else:
            seg.reserved = self.seg_size
        self.segments.append(seg)
        return seg

    # ------------------------------------------------------------ space reservation
    # Segments are sparse files; the writer only copies into bytes already written as zeros by
    # pwrite ("reserved"). pwrite reserves the blocks (delalloc) and fails with ENOSPC on a full
    # disk, where a write to an unbacked mmap page would SIGBUS; and the page-cache pages it leaves
    # behind make the writer's copy a cheap minor fault. A helper thread keeps RESERVE_LOW..HIGH
    # bytes reserved ahead of the writer; the writer only waits for it when it outruns it.
    def _poll_reservation(self, wait: bool = False) -> None:
        job = self._reserve_job
        if job is None or not (wait or job[0].done()):
            return
        self._reserve_job = None
        fut, seg, target = job
        try:
            fut.result()
        except OSError as exc:
            log.warning("reserving segment %s up to %d failed: %s", seg.name, target, exc)
            return
        seg.reserved = max(seg.reserved, target)

    def _reserve_now(self, seg: Segment, end: int) -> None:
        """Make [0, end) writable now (OSError on a full disk). Never overlaps a running job."""
        self._poll_reservation(wait=self._reserve_job is not None and self._reserve_job[1] is seg)
        if end > seg.reserved:
            target = min(self.seg_size, max(end, seg.reserved + RESERVE_LOW))
            _write_zeros(seg.fd, seg.reserved, target)
            seg.reserved = target

    def _top_up(self, seg: Segment, pos: int) -> None:
        self._poll_reservation()
        if (self._reserve_job is None and self._reserver is not None and seg.reserved < self.seg_size
                and seg.reserved - pos < RESERVE_LOW):
            target = min(self.seg_size, pos + RESERVE_HIGH)
            fut = self._reserver.submit(_write_zeros, seg.fd, seg.reserved, target)
            self._reserve_job = (fut, seg, target)

    def set_end(self, phys: int, last_ts: int) -> None:
        """Where appends continue after recovery; everything below is durable and readable."""
        last = self.segments[-1]
        if not last.start <= phys <= last.start + self.seg_size - 8:
            raise AssertionError(f"log end {phys} is not in the active segment {last.name}")
        self._pos = self._dirty_lo = last.written = phys - last.start
        if self.config.preallocate:
            last.reserved = self._pos      # nothing beyond the data is known to be backed
        self.readable = self.flushed = phys
        self.flushed_ts = self._last_ts = last_ts

    def zero(self, seg: Segment, lo: int, hi: int) -> None:
        """Recovery only: erase a torn or cut tail so the next start does not see it again."""
        seg.mm[lo:hi] = bytes(hi - lo)
        seg.flush(lo, hi)

    def release_oldest(self) -> Segment:
        """Take the oldest segment out of the log (the caller unmaps and unlinks it)."""
        seg = self.segments.pop(0)
        if self._reserve_job is not None and self._reserve_job[1] is seg:
            self._poll_reservation(wait=True)   # its fd must not be closed under a running pwrite
        return seg

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
    def start(self, executor, reserver) -> None:
        self._loop = asyncio.get_running_loop()
        self._executor = executor
        self._reserver = reserver
        self._task = self._loop.create_task(self._run(), name="txmq-store-writer")

    def put(self, req: PutRequest) -> asyncio.Future:
        fut = (self._loop or asyncio.get_running_loop()).create_future()
        if self._task is None or self.failed is not None or self._closing:
            fut.set_result(_unavailable(req))       # not open, closed, or stopped after an I/O error
            return fut
        self._queue.append((req, fut))
        w = self._wake
        if w is not None:
            self._wake = None
            w.set_result(None)
        return fut

    def put_many(self, reqs: list[PutRequest]) -> asyncio.Future:
        if not reqs:
            fut = (self._loop or asyncio.get_running_loop()).create_future()
            fut.set_result([])
            return fut
        return self.put(list(reqs))

    async def control(self, fn):
        """Run ``fn`` (a coroutine function) in the writer, between batches, with no flush in flight."""
        if self._task is None or self._task.done():
            raise StoreError("the store writer is not running")
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
                if self._queue and not self._controls and (self._overlap or self._flushing is None):
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
                if self._queue and not self._controls and (self._overlap or fl is None):
                    continue
                if not self._sync and dirty and self._tick is None:
                    self._tick = loop.call_later(self.config.flush_interval_ms / 1000, self._flush_tick)
                self._wake = w = loop.create_future()
                await w
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                self.failed = self.failed or "the writer was cancelled"
            else:
                log.exception("store writer crashed")
            self.fail(f"the writer stopped unexpectedly: {exc!r}")
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
        """Copy drained entries into the log. The hot loop: one frame, locals only, one clock read."""
        sync = self._sync
        done = self._waiting if sync else []
        units = self._units
        infos = self._infos if self.dispatching else None
        qoffsets = self.qoffsets
        limit, seg_size = self._limit, self.seg_size
        seg = self.segments[-1]
        mm, base, pos, room = seg.mm, seg.start, self._pos, min(seg.reserved, seg_size)
        now = self._clock()
        check, pack_qp, pack_ts = _CHECK.unpack_from, _QOFF_PHYS.pack_into, _I64.pack_into
        wrote = False
        for req, fut in entries:
            if self.failed is not None:
                _resolve(fut, _unavailable(req))
                continue
            if req.__class__ is list:
                batch, results = req, []
                total = self._precheck(batch)
                if total < 0:
                    _resolve(fut, [PutResult(_ILLEGAL) for _ in batch])
                    continue
                if pos + total + 8 > seg_size and total + 8 <= seg_size:   # keep the batch contiguous
                    new = self._roll(pos)
                    if new is None:
                        _resolve(fut, [PutResult(_CREATE_FAILED) for _ in batch])
                        continue
                    seg, mm, base, pos, room = new, new.mm, new.start, 0, new.reserved
            else:
                batch, results = (req,), None
            for r in batch:
                rec = r.record
                if rec.__class__ is not bytearray:
                    rec = r.record = bytearray(rec)
                n = len(rec)
                size_field, magic, qid, sys_flag = check(rec, 0) if n >= 91 else (0, 0, 0, 0)
                key = None
                if not sys_flag & 0x4:      # NOT and COMMIT records get a consume-queue unit (spec 7.2)
                    key = (r.topic, qid)
                if (n > limit or size_field != n or magic != MESSAGE_MAGIC or qid != r.queue_id or qid < 0
                        or (key is not None and key not in qoffsets and validate_topic(r.topic) is not None)):
                    _resolve(fut, PutResult(_ILLEGAL))      # only single puts get here; batches are prechecked
                    break
                if pos + n + 8 > room:
                    new = self._roll(pos) if pos + n + 8 > seg_size else self._reserve(seg, pos + n + 8)
                    if new is None:
                        if results is None:
                            _resolve(fut, PutResult(_CREATE_FAILED))
                        else:
                            results += [PutResult(_CREATE_FAILED) for _ in range(len(batch) - len(results))]
                        break
                    if new is not seg:
                        seg, mm, base, pos = new, new.mm, new.start, 0
                    room = min(seg.reserved, seg_size)
                phys = base + pos
                if key is None:
                    qoff = 0
                else:
                    qoff = qoffsets.get(key, 0)
                    qoffsets[key] = qoff + 1
                pack_qp(rec, POS_QUEUE_OFFSET, qoff, phys)
                pack_ts(rec, 68 if sys_flag & _BORN_V6 else 56, now)
                mm[pos:pos + n] = rec
                if pos == 0:
                    seg.first_ts = now
                pos += n
                wrote = True
                if key is None:
                    qoff = -1
                else:
                    units.append((key, phys, n, r.tags_code))
                if infos is not None:
                    infos.append(_info(r, rec, qoff, phys, n, now, sys_flag))
                if results is None:
                    done.append((fut, PutResult(_OK, phys, n, now, qoff)))
                else:
                    results.append(PutResult(_OK, phys, n, now, qoff))
            if results:
                done.append((fut, results))
        self._pos = seg.written = pos
        if wrote:
            seg.last_ts = self._last_ts = now
            self._top_up(seg, pos)
        if not sync:
            self.readable = self.written
            self._units, self._infos = [], []
            self.on_commit(units, infos or ())
            for fut, res in done:
                _resolve(fut, res)

    def _precheck(self, batch: list) -> int:
        """Total size of a put_many batch, or -1 if any record is illegal (then none is written)."""
        total = 0
        new_keys = set()
        for r in batch:
            if r.record.__class__ is not bytearray:
                r.record = bytearray(r.record)
            n = len(r.record)
            if n < 91 or n > self._limit:
                return -1
            size_field, magic, qid, sys_flag = _CHECK.unpack_from(r.record, 0)
            if size_field != n or magic != MESSAGE_MAGIC or qid != r.queue_id or qid < 0:
                return -1
            key = (r.topic, qid)
            if not sys_flag & 0x4 and key not in self.qoffsets and key not in new_keys:
                if validate_topic(r.topic) is not None:
                    return -1
                new_keys.add(key)
            total += n
        return total

    def _reserve(self, seg: Segment, end: int) -> Segment | None:
        try:
            self._reserve_now(seg, end)
            return seg
        except OSError as exc:
            self.fail(f"cannot reserve space in segment {seg.name}: {exc}")
            return None

    def _roll(self, pos: int) -> Segment | None:
        """Seal the active segment with an end marker and start the next; None (and stop) if it cannot be made."""
        old = self.segments[-1]
        try:
            self._reserve_now(old, pos + 8)
            new = self.new_segment(old.start + self.seg_size)    # before the marker: on failure nothing is written
        except OSError as exc:
            self.fail(f"cannot create segment {old.start + self.seg_size:020d}: {exc}")
            return None
        _SIZE_MAGIC.pack_into(old.mm, pos, self.seg_size - pos, BLANK_MAGIC)
        old.written = pos
        self._dirty_sealed.append((old, self._dirty_lo, pos + 8))
        self._pos = self._dirty_lo = new.written = 0
        return new

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
            # Nothing of this flush, nor of what was written after it, is acknowledged or made
            # readable, and nothing is flushed again: the store's state on disk is unknown.
            self.fail(f"msync failed: {exc}")
            later, self._waiting, self._units, self._infos = self._waiting, [], [], []
            self._dirty_sealed, self._dirty_lo = [], self._pos
            for f, res in waiting + later:
                _resolve(f, _unavailable(res))
            return
        self.flushed, self.flushed_ts = end, end_ts
        if self._sync:
            self.readable = end
            self.on_commit(units, infos)
            for f, res in waiting:
                _resolve(f, res)

    def fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            log.error("store stops accepting writes: %s", reason)
        queued, self._queue = self._queue, []
        for req, fut in queued:
            _resolve(fut, _unavailable(req))


def _info(r: PutRequest, rec: bytearray, qoff: int, phys: int, n: int, now: int, sys_flag: int) -> DispatchInfo:
    prepared = 0
    if sys_flag & 0xC:
        prepared = _I64.unpack_from(rec, 76 + (12 if sys_flag & _BORN_V6 else 0) + (12 if sys_flag & _STORE_V6 else 0))[0]
    return DispatchInfo(r.topic, r.queue_id, qoff, phys, n, r.tags_code, now, sys_flag, prepared, False)


_ZEROS = memoryview(bytes(1 << 20))


def _write_zeros(fd: int, lo: int, hi: int) -> None:
    while lo < hi:
        lo += os.pwrite(fd, _ZEROS[:min(len(_ZEROS), hi - lo)], lo)


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
