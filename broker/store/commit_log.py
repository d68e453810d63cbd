"""The commit log: segments and the bytes in them. The only code that writes segment files.

``<store_dir>/commitlog/<20-digit start offset>``, every segment ``segment_size`` bytes,
records back to back in the store-record layout of ``protocol.message`` (spec 6.1). A
record never spans two segments: when ``record + 8`` does not fit in what is left, the
segment is closed with an end marker and the record starts at byte 0 of the next:

    offset  size  field
    0       4     TOTALSIZE    bytes left in the segment, the marker included
    4       4     MAGIC        BLANK_MAGIC 0xCBD43194
    8       ...   zeros        (never written)

Segments are sparse files; reserve.py keeps them zero-filled ahead of the writer and the
next one made before it is needed, on a thread of its own. ``append`` never copies a byte
past ``Segment.reserved``: a store into an unbacked mapped page would SIGBUS on a full disk.
When a record (or a whole ``put_many`` batch: all or none) does not fit what is reserved,
``append`` stops before it and says what it needs (``need``); the writer awaits that from
the reserver and calls ``append`` again, or refuses that one entry if the disk has no room.

``append`` is the writer's hot loop (writer.py calls it with everything it drained): it
validates each pre-encoded record, assigns its physical and queue offsets, patches them
and the store timestamp into the record and copies it into the mapping -- one frame,
locals only, one clock read per batch. Readers see only bytes below ``readable``, which
the writer advances once a batch is flushed (sync) or copied (async), so they never meet
a half-written record.
"""
from __future__ import annotations

import errno
import logging
import os
import struct
from typing import Callable

from protocol.message import BLANK_MAGIC, MESSAGE_MAGIC, POS_PHYSICAL_OFFSET, POS_QUEUE_OFFSET, validate_topic

from .config import StoreConfig
from .consume_queue import UNIT
from .mapped_file import MappedFile
from .replica import ReplicaChunk, chunk_span
from .reserve import SpaceReserver, stalled_write, write_zeros
from .results import DispatchInfo, PutRequest, PutResult, PutStatus

log = logging.getLogger("txmq.store")

_SIZE_MAGIC = struct.Struct(">ii")
_CHECK = struct.Struct(">ii4xi20xi")   # TOTALSIZE, MAGIC, QUEUEID, SYSFLAG
_QOFF_PHYS = struct.Struct(">qq")      # QUEUEOFFSET, PHYSICALOFFSET: adjacent, one pack patches both
assert POS_PHYSICAL_OFFSET == POS_QUEUE_OFFSET + 8
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_OK, _ILLEGAL = PutStatus.PUT_OK, PutStatus.MESSAGE_ILLEGAL
_UNAVAILABLE = PutStatus.SERVICE_NOT_AVAILABLE
_BORN_V6, _STORE_V6 = 0x10, 0x20
RESERVE_LOW = 4 << 20       # keep at least this much zero-written space ahead of the writer ...
RESERVE_HIGH = 16 << 20     # ... topping it up to this much


class Segment(MappedFile):
    __slots__ = ("first_ts", "last_ts", "written")

    def __init__(self, *args):
        super().__init__(*args)
        # Store timestamps, -1 while unknown: the oldest record's (not the first's: the wall clock may step back
        # while the segment is written, and the segment manifest's first_ts says which days it can hold) and the
        # last record's.
        self.first_ts = -1
        self.last_ts = -1
        self.written = -1       # end of the last record; -1 while unknown (sealed, not yet walked)


READ_ONLY_ADVICE = ("the store's file system turned read-only (remounted so by the kernel after an I/O error, as ext4 "
                    "errors=remount-ro does): see dmesg, repair it (umount, fsck) and restart the broker; "
                    "writes are refused until then")


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
        self.failed_read_only = False   # ``failed`` by EROFS: the file system went read-only under the store
        self.on_fail: Callable[[], None] = lambda: None
        self.qoffsets: dict[tuple[str, int], int] = {}   # next queue offset per (topic, queue)
        # (slave) queues new to this log whose first record the master numbered past 0 (the slave's log began
        # where retention had trimmed the master's): that first queue offset, where the store begins the queue
        self.queue_starts: dict[tuple[str, int], int] = {}
        # (slave) queues whose master numbered a record below their end (the topic deleted and made again): the
        # queue offset the store cuts the queue at before this batch's units go in (_queue_went_back)
        self.queue_restarts: dict[tuple[str, int], int] = {}
        self.dispatching = False    # build DispatchInfo only when someone listens
        self.reserver = SpaceReserver(self, RESERVE_LOW, RESERVE_HIGH) if config.preallocate else None
        self.need: tuple[Segment, int, int] | None = None   # set when append stops for space (see append)
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

    def removed(self, phys: int) -> bool:
        """``phys`` lies in a segment retention removed (or is removing): below the log's first offset, or
        in a segment already unmapped. Anything else a unit names is in the log, or beyond its end."""
        at = self.locate(phys)
        return phys < self.min_offset or (at is not None and at[0].mm is None)

    def make_segment(self, start: int) -> Segment:
        """A new sparse segment file, nothing reserved (unless preallocate is off); not yet in the log."""
        seg = Segment.create(self.directory, start, self.seg_size, reserve=0)
        if self.reserver is None:
            seg.reserved = seg.zeroed = self.seg_size       # preallocate=False: trust the file system
        return seg

    def new_segment(self, start: int) -> Segment:
        """Start-up only (recovery): append a fresh segment; space is reserved when first written."""
        seg = self.make_segment(start)
        self.segments.append(seg)
        return seg

    def fail(self, reason: str, exc: BaseException | None = None) -> None:
        if self.failed is None:
            self.failed = reason
            self.failed_read_only = getattr(exc, "errno", None) == errno.EROFS
            # (flush async) acknowledged when copied: what no flush took to the disk may be gone with the error
            unflushed = self.readable - self.flushed
            lost = (f"; {unflushed} bytes of the log, offsets {self.flushed} to {self.readable}, were acknowledged "
                    f"(flush async) and never flushed: their messages may be lost (a restart's recovery says what "
                    f"it keeps)" if unflushed > 0 else "")
            log.error("store stops accepting writes: %s; %s%s", reason, self.failed_advice(), lost)
        self.on_fail()

    def failed_advice(self) -> str:
        """What to do about ``failed``: every later write is refused until a restart (the log's state past its
        last good flush is unknown), so say which disk fault it was and that a restart is the way back."""
        if self.failed_read_only:
            return READ_ONLY_ADVICE
        return "an I/O error: see dmesg, fix the disk and restart the broker; writes are refused until then"

    def refusal(self, why: str = "") -> str:
        """A refused client's remark once the log ``failed``; before (a file other than the log's met the file
        system turned read-only first: a new queue's), ``why`` and what to do about a read-only one."""
        if self.failed is None:
            return f"service not available now: the broker's store is read-only [{why}; {READ_ONLY_ADVICE}]"
        return (f"service not available now: the broker's store stopped accepting writes [{self.failed}; "
                f"{self.failed_advice()}]")

    # ------------------------------------------------------------ recovery and retention
    def set_end(self, phys: int, last_ts: int) -> None:
        """Where appends continue after recovery; everything below is durable and readable."""
        last = self.segments[-1]
        if not last.start <= phys <= last.start + self.seg_size - 8:
            raise AssertionError(f"log end {phys} is not in the active segment {last.name}")
        self._pos = self._dirty_lo = last.written = phys - last.start
        # Nothing beyond the data is known to be backed (unless preallocate is off: trust the fs).
        last.reserved = last.zeroed = self._pos if self.reserver is not None else self.seg_size
        self.readable = self.flushed = phys
        self.flushed_ts = self.last_ts = last_ts

    def zero(self, seg: Segment, lo: int, hi: int) -> None:
        """Erase a torn or cut tail so the next start does not see it again (pwrite: the range may hold a
        hole, and a store through the mapping into a hole SIGBUSes on a full disk)."""
        write_zeros(seg.fd, lo, hi, seg.path)

    def drop_segments_from(self, index: int) -> list[str]:
        """Remove the segments from ``index`` on, newest first: a crash part way leaves a log without a gap
        (the next start cuts the rest again), not one whose later segments follow a missing one."""
        gone = [seg.name for seg in self.segments[index:]]
        for seg in reversed(self.segments[index:]):
            seg.remove()
        del self.segments[index:]
        return gone

    def release_oldest(self) -> Segment:
        """Take the oldest segment out of the log; the caller unmaps and unlinks it."""
        return self.segments.pop(0)

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

    def bytes_at(self, phys: int, n: int) -> bytes | None:
        """A copy of the readable log's bytes [phys, phys + n), all in one segment; None otherwise."""
        if n <= 0 or phys < 0 or phys + n > self.readable:
            return None
        where = self.locate(phys)
        if where is None:
            return None
        seg, pos = where
        if seg.mm is None or pos + n > self.seg_size:
            return None
        return bytes(seg.view[pos:pos + n])

    # ------------------------------------------------------------ appends
    def append(self, entries: list, i: int, done: list, units: dict, infos: list | None) -> int:
        """Copy drained (request or list of requests, future) entries, from index ``i``, into the log.

        Accepted entries go to ``done`` as (future, result); the consume-queue units of their
        records, already packed, to ``units[(topic, queue id)]`` (a bytearray each, so a queue
        takes a whole batch in one copy); refused entries are resolved at once. Returns the index
        it stopped at: ``len(entries)``, or an entry that does not fit the reserved space, with
        ``need`` = (segment, end of the space it needs there, bytes in the next segment) -- the
        last is 0 unless the entry must go to the next segment.
        """
        qoffsets = self.qoffsets
        limit, seg_size = self._limit, self.seg_size
        seg = self.segments[-1]
        base, pos, room = seg.start, self._pos, seg.reserved
        pend, pend_at = [], pos         # records copied in with one pwritev per run, not one mmap store each
        now = self._clock()
        check, pack_qp, pack_ts, pack_unit = _CHECK.unpack_from, _QOFF_PHYS.pack_into, _I64.pack_into, UNIT.pack
        sys_flag_of, new_tuple = _I32.unpack_from, tuple.__new__
        last_key = next_qoff = packed = None
        wrote = False
        stop = len(entries)
        while i < stop:
            req, fut = entries[i]
            if self.failed is not None:
                resolve(fut, unavailable(req))
                i += 1
                continue
            if req.__class__ is ReplicaChunk:   # a slave copying its master's bytes (replica.py)
                if pend:
                    _pwrite_all(seg, pend_at, pend)
                    pend = []
                self._pos = seg.written = pos
                if not self._append_replica(req, fut, done, units, infos):
                    break
                seg = self.segments[-1]
                base, pos, room = seg.start, self._pos, seg.reserved
                pend_at = pos
                i += 1
                continue
            if req.__class__ is list:
                batch, results = req, []
                need = self._precheck(batch) + 8
                if need < 8 or need > seg_size:     # illegal, or more than a segment holds: none is written
                    resolve(fut, [PutResult(_ILLEGAL) for _ in batch])
                    i += 1
                    continue
            else:
                batch, results = (req,), None
                rec = req.record
                if rec.__class__ is not bytearray:
                    rec = req.record = bytearray(rec)
                n = len(rec)
                size_field, magic, qid, sys_flag = check(rec, 0) if n >= 91 else (0, 0, 0, 0)
                key = (req.topic, qid)
                if (n > limit or size_field != n or magic != MESSAGE_MAGIC or qid != req.queue_id or qid < 0
                        or (not sys_flag & 0x4 and key not in qoffsets and validate_topic(req.topic) is not None)):
                    resolve(fut, PutResult(_ILLEGAL))
                    i += 1
                    continue
                need = n + 8
            if pos + need > room:           # every record keeps room for the end marker after it
                if pos + need <= seg_size:
                    self.need = (seg, pos + need, 0)
                    break
                if self.reserver is not None:
                    spare = self.reserver.spare
                else:                       # preallocate=False: made here, on the loop
                    try:
                        spare = self.make_segment(base + seg_size)
                    except OSError as exc:
                        resolve(fut, unavailable(req, f"the broker's disk is full: cannot create a segment: {exc}"))
                        i += 1
                        continue
                if pos + 8 > room or spare is None or spare.reserved < need:
                    self.need = (seg, pos + 8, need)
                    break
                if pend:
                    _pwrite_all(seg, pend_at, pend)
                    pend = []
                self._seal(seg, pos, spare)
                seg, base, pos, room = spare, spare.start, 0, spare.reserved
                pend_at = 0
            for r in batch:
                rec = r.record
                n = len(rec)
                sys_flag = sys_flag_of(rec, 36)[0]
                phys = base + pos
                pack_ts(rec, 68 if sys_flag & _BORN_V6 else 56, now)
                pend.append(rec)
                if pos == 0:
                    seg.first_ts = now
                pos += n
                wrote = True
                if sys_flag & 0x4:          # PREPARED / ROLLBACK: no consume-queue unit (spec 7.2)
                    pack_qp(rec, POS_QUEUE_OFFSET, 0, phys)
                    qoff = -1
                    tag = r.tags_code if r.delay_ms < 0 else now + r.delay_ms
                else:
                    key = (r.topic, r.queue_id)
                    if key != last_key:     # a batch is mostly one queue: one lookup, not one a record
                        if last_key is not None:
                            qoffsets[last_key] = next_qoff
                        last_key = key
                        next_qoff = qoffsets.get(key, 0)
                        packed = units.get(key)
                        if packed is None:
                            packed = units[key] = bytearray()
                    qoff = next_qoff
                    next_qoff += 1
                    pack_qp(rec, POS_QUEUE_OFFSET, qoff, phys)
                    tag = r.tags_code if r.delay_ms < 0 else now + r.delay_ms
                    packed += pack_unit(phys, n, tag)
                if infos is not None:
                    infos.append(_info(r, rec, qoff, phys, n, now, sys_flag) if sys_flag & 0xC else
                                 new_tuple(DispatchInfo, (r.topic, r.queue_id, qoff, phys, n, tag, now, sys_flag,
                                                          0, False)))
                if results is None:
                    done.append((fut, PutResult(_OK, phys, n, now, qoff)))
                else:
                    results.append(PutResult(_OK, phys, n, now, qoff))
            if last_key is not None:
                qoffsets[last_key] = next_qoff
                last_key = None
            if results is not None:
                done.append((fut, results))
            i += 1
        if pend:
            _pwrite_all(seg, pend_at, pend)
        self._pos = seg.written = pos
        if wrote:
            seg.last_ts = self.last_ts = now
            if now < seg.first_ts:      # the clock stepped back (each record of a cycle is stamped ``now``)
                seg.first_ts = now
        if self.reserver is not None:
            self.reserver.top_up(seg, pos)
        return i

    def _append_replica(self, chunk: ReplicaChunk, fut, done: list, units: dict, infos: list | None) -> bool:
        """Copy a master's chunk in at its own offset (a slave); False when it waits for space (``need``).

        The bytes go in as they are: records keep the queue offsets, physical offsets and store times the
        master gave them, an end marker seals the segment exactly where the master's did.
        """
        seg = self.segments[-1]
        pos = self._pos
        here = seg.start + pos
        if chunk.phys != here:
            resolve(fut, PutResult(_ILLEGAL, remark=f"the master sent offset {chunk.phys}, this log ends at {here}"))
            return True
        if chunk.seal:
            spare = self.reserver.spare if self.reserver is not None else None
            if self.reserver is None:
                try:
                    spare = self.make_segment(seg.start + self.seg_size)
                except OSError as exc:
                    resolve(fut, unavailable(chunk, f"cannot create a segment: {exc}"))
                    return True
            if pos + 8 > seg.reserved or spare is None or spare.reserved < 8:
                self.need = (seg, pos + 8, RESERVE_LOW)
                return False
            self._seal(seg, pos, spare)
            done.append((fut, PutResult(_OK, chunk.phys, 8, self.last_ts, -1)))
            return True
        n = len(chunk.data)
        if pos + n + 8 > seg.reserved:
            self.need = (seg, pos + n + 8, 0)
            return False
        seg.mm[pos:pos + n] = chunk.data
        qoffsets = self.qoffsets
        pack_unit = UNIT.pack
        for r in chunk.records:
            if r.queue_offset >= 0:
                key = (r.topic, r.queue_id)
                expected = qoffsets.get(key)
                if expected is None:
                    if r.queue_offset:
                        self.queue_starts[key] = r.queue_offset
                elif r.queue_offset < expected:
                    self._queue_went_back(key, r.queue_offset, expected, units)
                qoffsets[key] = r.queue_offset + 1
                packed = units.get(key)
                if packed is None:
                    packed = units[key] = bytearray()
                packed += pack_unit(here + r.pos, r.size, r.tags_code)
        if infos is not None:
            infos.extend(chunk.infos())
        if chunk.records:
            oldest = min(r.store_timestamp for r in chunk.records)    # (the master's clock may have stepped back)
            if pos == 0 or oldest < seg.first_ts:
                seg.first_ts = oldest
            seg.last_ts = self.last_ts = chunk.records[-1].store_timestamp
        self._pos = seg.written = pos + n
        done.append((fut, PutResult(_OK, chunk.phys, n, self.last_ts, -1)))
        return True

    def _queue_went_back(self, key, qoff: int, expected: int, units: dict) -> None:
        """(Slave) the master numbered a record of ``key`` ``qoff``, below the ``expected`` next: its queue starts
        again there -- the topic deleted and made again (offset 0), as recovery reads such a record
        (recovery._checked_qoff). Appended at the end of the slave's queue instead, the new messages had the
        deleted ones' offsets there, and a consumer failed over to the slave was served those. This batch's units
        from ``qoff`` on go, and the store cuts its queue there (``queue_restarts``) before appending the rest."""
        packed = units.get(key)
        first = expected - (len(packed) // UNIT.size if packed else 0)     # the batch's first unit of ``key``
        if packed:
            del packed[max(0, qoff - first) * UNIT.size:]
        if qoff < first:
            restarts = self.queue_restarts
            restarts[key] = min(qoff, restarts.get(key, qoff))

    def read_chunk(self, phys: int, limit: int) -> memoryview | None:
        """(Master) the readable chunk at ``phys`` for a slave (replica.py): whole records or an end marker;
        None when nothing is readable there yet. ValueError when ``phys`` is outside the log or not a
        record boundary."""
        if phys >= self.readable:
            return None
        where = self.locate(phys)
        if where is None:
            raise ValueError(f"offset {phys} is not in the log (it starts at {self.min_offset})")
        seg, pos = where
        if seg.mm is None:
            raise ValueError(f"offset {phys} is in a segment being removed")
        avail = min(self.readable - phys, self.seg_size - pos)
        n = chunk_span(seg.mm, pos, self.seg_size, avail, limit)
        return seg.view[pos:pos + n] if n else None

    def rebase(self, new: Segment) -> Segment:
        """(Empty log only) start the log at segment ``new`` instead of 0: a new slave of a master whose log
        no longer begins at 0. Returns the segment taken out; the caller removes its file."""
        if len(self.segments) != 1 or self._pos or self.segments[0].start or self.dirty:
            raise AssertionError("only an empty log that starts at 0 can be rebased")
        old = self.segments.pop()
        self.segments.append(new)
        self.set_end(new.start, 0)
        return old

    def _precheck(self, batch: list) -> int:
        """Total size of a put_many batch, or -1 if any record is illegal (then none is written).

        A record may be a bytearray or a writable memoryview (handle_batch's records are views of one buffer);
        anything else is copied into a bytearray first, as the writer patches records in place.
        """
        total = 0
        limit, qoffsets, unpack = self._limit, self.qoffsets, _CHECK.unpack_from
        checked = None
        for r in batch:
            rec = r.record
            cls = rec.__class__
            if cls is not bytearray and (cls is not memoryview or rec.readonly or rec.format != "B"):
                rec = r.record = bytearray(rec)
            n = len(rec)
            if n < 91 or n > limit:
                return -1
            size_field, magic, qid, sys_flag = unpack(rec, 0)
            if size_field != n or magic != MESSAGE_MAGIC or qid != r.queue_id or qid < 0:
                return -1
            if not sys_flag & 0x4:
                key = (r.topic, qid)
                if key != checked and key not in qoffsets:
                    if validate_topic(r.topic) is not None:
                        return -1
                    checked = key
            total += n
        return total

    def _seal(self, old: Segment, pos: int, new: Segment) -> None:
        """Close the active segment with an end marker (in reserved space) and make ``new`` active."""
        if self.reserver is not None:
            self.reserver.take_spare()
        _SIZE_MAGIC.pack_into(old.mm, pos, self.seg_size - pos, BLANK_MAGIC)
        old.written = pos
        self._dirty_sealed.append((old, self._dirty_lo, pos + 8))
        self._pos = self._dirty_lo = new.written = 0
        self.segments.append(new)

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


def _info(r: PutRequest, rec: bytearray, qoff: int, phys: int, n: int, now: int, sys_flag: int) -> DispatchInfo:
    prepared = 0
    if sys_flag & 0xC:
        at = 76 + (12 if sys_flag & _BORN_V6 else 0) + (12 if sys_flag & _STORE_V6 else 0)
        prepared = _I64.unpack_from(rec, at)[0]
    tag = r.tags_code if r.delay_ms < 0 else now + r.delay_ms
    return DispatchInfo(r.topic, r.queue_id, qoff, phys, n, tag, now, sys_flag, prepared, False)


def unavailable(req_or_res, remark: str = ""):
    """SERVICE_NOT_AVAILABLE shaped like the request: one result, or a list for put_many."""
    if req_or_res.__class__ is list:
        return [PutResult(_UNAVAILABLE, remark=remark) for _ in req_or_res]
    return PutResult(_UNAVAILABLE, remark=remark)


def resolve(fut, value) -> None:
    if not fut.done():
        fut.set_result(value)


_IOV_MAX = 1024


def _pwrite_all(seg: Segment, at: int, bufs: list) -> None:
    """Copy ``bufs`` into ``seg`` at ``at`` through the page cache (pwritev; the mapping sees the same pages).

    Not a store through the mapping: that write-faults every fresh page into ext4's page_mkwrite, which
    joins the inode to the running journal transaction, so each group commit's sync then waited for a
    journal commit (msync of 30 KiB: 0.22 ms against 0.09 ms for pwrite + fdatasync on this disk, and the
    faults cost the loop ~40 us a batch). The range is reserved (zeroed, allocated), so this cannot hit
    ENOSPC short of a failing disk; an OSError here stops the log like any I/O error, and so does a call
    that writes nothing without an error (it would be retried for ever, with the loop held).
    """
    fd = seg.fd
    for k in range(0, len(bufs), _IOV_MAX):
        part = bufs[k:k + _IOV_MAX] if len(bufs) > _IOV_MAX else bufs
        want = sum(map(len, part))
        done = os.pwritev(fd, part, at)
        while done < want:              # a short write: finish it byte-exact
            flat = b"".join(part)
            n = os.pwrite(fd, memoryview(flat)[done:], at + done)
            if n <= 0:
                raise stalled_write(seg.path, at + done, want - done)
            done += n
        at += want
