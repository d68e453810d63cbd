"""The commit log: segments and the bytes in them. The only code that writes segment files.

``<store_dir>/commitlog/<20-digit start offset>``, every segment ``segment_size`` bytes,
records back to back in the store-record layout of ``protocol.message`` (spec 6.1). A
record never spans two segments: when ``record + 8`` does not fit in what is left, the
segment is closed with an end marker and the record starts at byte 0 of the next:

    offset  size  field
    0       4     TOTALSIZE    bytes left in the segment, the marker included
    4       4     MAGIC        BLANK_MAGIC 0xCBD43194
    8       ...   zeros        (never written)

Segments are sparse files kept zero-filled (pwrite + fdatasync) 4-16 MiB ahead of the
writer by SpaceReserver, on a helper thread that only writes past the writer's mark:
pwrite reserves the blocks and fails with ENOSPC where a store into an unbacked mapped
page would SIGBUS; the pages it leaves make the writer's copy a cheap minor fault
(copying into fallocated, never written pages cost 2-3 us per KiB in page faults); and
msync then overwrites allocated, written blocks with no journal commit.

``append`` is the writer's hot loop (writer.py calls it with everything it drained): it
validates each pre-encoded record, assigns its physical and queue offsets, patches them
and the store timestamp into the record and copies it into the mapping -- one frame,
locals only, one clock read per batch. Readers see only bytes below ``readable``, which
the writer advances once a batch is flushed (sync) or copied (async), so they never meet
a half-written record.
"""
from __future__ import annotations

import logging
import os
import struct
from typing import Callable

from protocol.message import BLANK_MAGIC, MESSAGE_MAGIC, POS_PHYSICAL_OFFSET, POS_QUEUE_OFFSET, validate_topic

from .config import StoreConfig
from .consume_queue import UNIT
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
RESERVE_LOW = 4 << 20       # keep at least this much zero-written space ahead of the writer ...
RESERVE_HIGH = 16 << 20     # ... topping it up to this much


class Segment(MappedFile):
    __slots__ = ("first_ts", "last_ts", "written")

    def __init__(self, *args):
        super().__init__(*args)
        self.first_ts = -1      # store timestamps of the first and last record, -1 while unknown
        self.last_ts = -1
        self.written = -1       # end of the last record; -1 while unknown (sealed, not yet walked)


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
        self.on_fail: Callable[[], None] = lambda: None
        self.qoffsets: dict[tuple[str, int], int] = {}   # next queue offset per (topic, queue)
        self.dispatching = False    # build DispatchInfo only when someone listens
        self.reserver = SpaceReserver(RESERVE_LOW, RESERVE_HIGH) if config.preallocate else None
        self.last_ts = 0            # store timestamp of the last record written
        self._clock = clock
        self._limit = config.record_limit
        self._pos = 0               # write position in the active segment
        self._dirty_lo = 0          # the active segment is unflushed from here ...
        self._dirty_sealed: list[tuple[Segment, int, int]] = []   # ... and so are these sealed ranges

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
        if self.reserver is not None:
            seg.reserved = 0
            self.reserver.reserve_now(seg, min(self.seg_size, RESERVE_LOW))
        else:
            seg.reserved = self.seg_size
        self.segments.append(seg)
        return seg

    def fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            log.error("store stops accepting writes: %s", reason)
        self.on_fail()

    # ------------------------------------------------------------ recovery and retention
    def set_end(self, phys: int, last_ts: int) -> None:
        """Where appends continue after recovery; everything below is durable and readable."""
        last = self.segments[-1]
        if not last.start <= phys <= last.start + self.seg_size - 8:
            raise AssertionError(f"log end {phys} is not in the active segment {last.name}")
        self._pos = self._dirty_lo = last.written = phys - last.start
        if self.reserver is not None:
            last.reserved = self._pos      # nothing beyond the data is known to be backed
        self.readable = self.flushed = phys
        self.flushed_ts = self.last_ts = last_ts

    def zero(self, seg: Segment, lo: int, hi: int) -> None:
        """Erase a torn or cut tail so the next start does not see it again."""
        seg.mm[lo:hi] = bytes(hi - lo)
        seg.flush(lo, hi)

    def drop_segments_from(self, index: int) -> list[str]:
        gone = [seg.name for seg in self.segments[index:]]
        for seg in self.segments[index:]:
            seg.remove()
        del self.segments[index:]
        return gone

    def release_oldest(self) -> Segment:
        """Take the oldest segment out of the log; the caller unmaps and unlinks it."""
        seg = self.segments.pop(0)
        if self.reserver is not None:
            self.reserver.forget(seg)
        return seg

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
                or _I64.unpack_from(seg.mm, pos + POS_PHYSICAL_OFFSET)[0] != phys):
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

    # ------------------------------------------------------------ appends
    def append(self, entries: list, done: list, units: dict, infos: list | None) -> None:
        """Copy drained (request or list of requests, future) entries into the log.

        Accepted entries go to ``done`` as (future, result); the consume-queue units of their
        records, already packed, to ``units[(topic, queue id)]`` (a bytearray each, so a queue
        takes a whole batch in one copy); refused entries are resolved at once.
        """
        qoffsets = self.qoffsets
        limit, seg_size = self._limit, self.seg_size
        seg = self.segments[-1]
        mm, base, pos, room = seg.mm, seg.start, self._pos, min(seg.reserved, seg_size)
        now = self._clock()
        check, pack_qp, pack_ts, pack_unit = _CHECK.unpack_from, _QOFF_PHYS.pack_into, _I64.pack_into, UNIT.pack
        wrote = False
        for req, fut in entries:
            if self.failed is not None:
                resolve(fut, unavailable(req))
                continue
            if req.__class__ is list:
                batch, results = req, []
                total = self._precheck(batch)
                if total < 0:
                    resolve(fut, [PutResult(_ILLEGAL) for _ in batch])
                    continue
                if pos + total + 8 > seg_size and total + 8 <= seg_size:   # keep the batch contiguous
                    new = self._roll(pos)
                    if new is None:
                        resolve(fut, [PutResult(_CREATE_FAILED) for _ in batch])
                        continue
                    seg, mm, base, pos, room = new, new.mm, new.start, 0, min(new.reserved, seg_size)
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
                    resolve(fut, PutResult(_ILLEGAL))       # only single puts get here; batches are prechecked
                    break
                if pos + n + 8 > room:
                    new = self._roll(pos) if pos + n + 8 > seg_size else self._reserve(seg, pos + n + 8)
                    if new is None:
                        if results is None:
                            resolve(fut, PutResult(_CREATE_FAILED))
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
                    packed = units.get(key)
                    if packed is None:
                        packed = units[key] = bytearray()
                    packed += pack_unit(phys, n, r.tags_code)
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
            seg.last_ts = self.last_ts = now
            if self.reserver is not None:
                self.reserver.top_up(seg, pos)

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
            self.reserver.reserve_now(seg, end)
            return seg
        except OSError as exc:
            self.fail(f"cannot reserve space in segment {seg.name}: {exc}")
            return None

    def _roll(self, pos: int) -> Segment | None:
        """Seal the active segment with an end marker and start the next; None (and stop) if it cannot be made."""
        old = self.segments[-1]
        try:
            if self.reserver is not None:
                self.reserver.reserve_now(old, pos + 8)
            new = self.new_segment(old.start + self.seg_size)    # before the marker: on failure nothing is written
        except OSError as exc:
            self.fail(f"cannot create segment {old.start + self.seg_size:020d}: {exc}")
            return None
        _SIZE_MAGIC.pack_into(old.mm, pos, self.seg_size - pos, BLANK_MAGIC)
        old.written = pos
        self._dirty_sealed.append((old, self._dirty_lo, pos + 8))
        self._pos = self._dirty_lo = new.written = 0
        return new

    # ------------------------------------------------------------ flushing
    @property
    def dirty(self) -> bool:
        return bool(self._dirty_sealed) or self._pos > self._dirty_lo

    def take_dirty(self) -> list[tuple[Segment, int, int]]:
        """The ranges written since the last call: what the next flush must cover."""
        ranges = self._dirty_sealed
        ranges.append((self.segments[-1], self._dirty_lo, self._pos))
        self._dirty_sealed = []
        self._dirty_lo = self._pos
        return ranges


_ZEROS = memoryview(bytes(1 << 20))


def write_zeros(fd: int, lo: int, hi: int) -> None:
    """Zero-fill [lo, hi) and make its block allocation durable.

    After this, a later msync over these bytes overwrites allocated, written blocks: no
    extent to allocate or convert, no journal commit on the commit path (the reason
    PostgreSQL zero-fills its WAL segments). The cost is writing the log's bytes twice,
    once as zeros, off the commit path.
    """
    start = lo
    while lo < hi:
        lo += os.pwrite(fd, _ZEROS[:min(len(_ZEROS), hi - lo)], lo)
    if hi > start:
        os.fdatasync(fd)


class SpaceReserver:
    """Keeps ``low``..``high`` bytes ahead of an appender zero-written, one job at a time on a helper thread.

    The appender never writes at or past ``MappedFile.reserved``, which only moves once a job has
    finished, and a job only writes past it: a job never overwrites data.
    """

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high
        self._executor = None
        self._job = None            # (concurrent future, file, target)

    def start(self, executor) -> None:
        self._executor = executor

    def poll(self, wait: bool = False) -> None:
        job = self._job
        if job is None or not (wait or job[0].done()):
            return
        self._job = None
        fut, mf, target = job
        try:
            fut.result()
        except OSError as exc:      # the appender finds out for itself when it gets there
            log.warning("reserving %s up to %d failed: %s", mf.path, target, exc)
            return
        mf.reserved = max(mf.reserved, target)

    def forget(self, mf: MappedFile) -> None:
        """Before closing ``mf``: its fd must not be closed (and reused) under a running pwrite."""
        if self._job is not None and self._job[1] is mf:
            self.poll(wait=True)

    def reserve_now(self, mf: MappedFile, end: int) -> None:
        """Make [0, end) writable before returning (OSError on a full disk)."""
        self.forget(mf)
        if end > mf.reserved:
            target = min(mf.size, max(end, mf.reserved + self.low))
            write_zeros(mf.fd, mf.reserved, target)
            mf.reserved = target

    def top_up(self, mf: MappedFile, pos: int) -> None:
        self.poll()
        if (self._job is None and self._executor is not None and mf.reserved < mf.size
                and mf.reserved - pos < self.low):
            target = min(mf.size, pos + self.high)
            self._job = (self._executor.submit(write_zeros, mf.fd, mf.reserved, target), mf, target)


def _info(r: PutRequest, rec: bytearray, qoff: int, phys: int, n: int, now: int, sys_flag: int) -> DispatchInfo:
    prepared = 0
    if sys_flag & 0xC:
        at = 76 + (12 if sys_flag & _BORN_V6 else 0) + (12 if sys_flag & _STORE_V6 else 0)
        prepared = _I64.unpack_from(rec, at)[0]
    return DispatchInfo(r.topic, r.queue_id, qoff, phys, n, r.tags_code, now, sys_flag, prepared, False)


def unavailable(req_or_res):
    """SERVICE_NOT_AVAILABLE shaped like the request: one result, or a list for put_many."""
    if req_or_res.__class__ is list:
        return [PutResult(_UNAVAILABLE) for _ in req_or_res]
    return PutResult(_UNAVAILABLE)


def resolve(fut, value) -> None:
    if not fut.done():
        fut.set_result(value)
