"""Consume queues: the per-(topic, queue) index of the commit log (spec 7.3).

``<store_dir>/consumequeue/<topic>/<queueId>/<20-digit start byte offset>``; each file holds
``cq_units_per_file`` units; logical offset n lives at byte n * 20. A unit, big-endian:

    offset  size  field
    0       8     commit-log offset of the record
    8       4     record size
    12      8     tag code (Java String.hashCode of TAGS, sign-extended; 0 without a tag)

Units before a queue's first real unit (a queue rebuilt after old segments expired) are
RocketMQ's pre-blank ``(0, 0x7FFFFFFF, 0)``. Consume queues are derived data: the
writer appends units only for records that are already readable, the files are flushed
lazily before each checkpoint, and recovery rebuilds any tail they lack from the log. A new
file's (or queue directory's) name is synced into its directory once, by that same checkpoint
(``unsynced``): the checkpoint vouches for the units in it, and a name a power loss took would
take them along where recovery does not look.
Only the event-loop thread touches a queue, except ``flush`` (the flush thread, on
ranges snapshotted by ``dirty_ranges``).

Full disk: blocks are allocated (posix_fallocate, in RESERVE_CHUNK steps) before units are
copied through the mapping, and start-up finds the written length with pread, never by
reading the mapping (a read fault on a tmpfs hole SIGBUSes when the disk is full). Units
that cannot get space wait in ``backlog`` (in memory, in order) and are written by the next
``extend`` or ``retry``; meanwhile readers see the queue up to ``max_offset`` and the store
does not checkpoint past them, so a crash rebuilds them from the log.
"""
from __future__ import annotations

import logging
import os
import struct

from protocol.errors import StoreError

from .mapped_file import MappedFile, fsync_dir, last_nonzero, make_dirs, parse_name

log = logging.getLogger("txmq.store")

UNIT = struct.Struct(">qiq")
UNIT_SIZE = 20
BLANK_SIZE = 0x7FFFFFFF
RESERVE_CHUNK = 64 * 1024      # allocate ahead in small steps: a queue costs disk only as it fills


class ConsumeQueue:
    def __init__(self, directory: str, topic: str, queue_id: int, file_size: int):
        self.directory = directory
        self.topic = topic
        self.queue_id = queue_id
        self.file_size = file_size
        self.files: list[MappedFile] = []
        self.min_offset = 0
        self.max_offset = 0
        self._flush_mark: tuple[MappedFile | None, int] = (None, 0)
        self.backlog = bytearray()      # packed units waiting for disk space
        self._attempt_from = 0
        self.last_error: OSError | None = None
        self.damaged: str | None = None     # why load found units missing before the last file (recovery rebuilds)
        self.leftovers: list[str] = []      # paths of files below the log's start the start could not unlink
        # (the store's removals try them again)
        # (queue offset, file name, byte in it) of the first all-zero unit load found below max_offset, if any:
        # a lost page. Recovery rewrites it if its record is in the verified range, else rebuilds the queue.
        self.zeroed: tuple[int, str, int] | None = None
        # Directories whose entries changed (a new file, a new queue directory) and are not fsynced yet: the
        # store syncs them once, on its I/O thread, before the checkpoint that says these units are durable.
        self.unsynced: list[str] = []
        self.damage: int | None = None      # queue offset of a zeroed unit a read met (mark_damaged)
        self._mark_failed = False           # its rebuild mark was refused (write_damage_mark): said once

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, directory: str, topic: str, queue_id: int, file_size: int,
             durable_below: int | None = None, log_start: int | None = None) -> "ConsumeQueue":
        """Open a queue's files. ``durable_below`` is the checkpoint's commit-log offset: an older file whose
        last unit names a record below it was flushed whole before that checkpoint, so a crash cannot have
        left a hole in it and it is not read through (start-up must not grow with the history kept); the
        others, and every file when there is no checkpoint, are searched for zeroed units (lost pages).
        Damage outside the crash model (a disk, a hand) is found when a read meets it (``mark_damaged``).
        ``log_start``: the commit log's first segment's offset (files wholly below it are a removal's leftovers)."""
        cq = cls(directory, topic, queue_id, file_size)
        names = os.listdir(directory)
        if DAMAGE_MARK in names:
            cq.damaged = f"a read found a zeroed unit ({_read_mark(directory)})"
        starts = sorted(s for s in map(parse_name, names) if s is not None)
        # Keep the newest run of consecutive files: a gap means the units in it and before are lost here, so
        # the older files go and recovery rebuilds the queue from the log.
        for i in range(len(starts) - 1, 0, -1):
            if starts[i] - starts[i - 1] != file_size:
                older = [os.path.join(directory, f"{start:020d}") for start in starts[:i]]
                leftovers = _unit_below(older[-1], file_size - UNIT_SIZE, log_start)
                if not (leftovers and _unit_below(os.path.join(directory, f"{starts[i]:020d}"), 0, log_start)):
                    # The units in the gap are below the log's start only if the file after it begins below it:
                    # the file before it wholly below says nothing of them (a leftover, then a live file lost to
                    # a disk or a hand: taken for leftovers, its units left the queue without a word).
                    cq.damaged = f"file {starts[i]:020d} does not follow {starts[i - 1]:020d}"
                if leftovers:
                    # A segment removal's leftovers (a file it could not unlink, EACCES or EIO, the later
                    # removals' files gone). Taken for a gap, the queue was rebuilt from the log (and the
                    # leftovers' unlink, refused again, failed the start).
                    cq.leftovers = _remove_leftovers(older, topic, queue_id)
                else:
                    for path in older:
                        os.unlink(path)
                starts = starts[i:]
                break
        for start in starts:
            if start % file_size:
                raise StoreError(f"consume queue {topic}-{queue_id}: file name is not a multiple of the "
                                 f"{file_size}-byte file size (was cq_units_per_file changed? delete "
                                 f"{directory} to rebuild it from the commit log)", segment=f"{start:020d}")
            mf, found = MappedFile.open(os.path.join(directory, f"{start:020d}"), start, file_size)
            cq.files.append(mf)
            if found > file_size:
                raise StoreError(f"consume queue {topic}-{queue_id}: file is {found} bytes, expected {file_size} "
                                 f"(delete {directory} to rebuild it from the commit log)", segment=mf.name)
            if start != starts[-1] and cq.damaged is None:     # a file before the last one must be full
                if found < file_size:
                    cq.damaged = f"file {mf.name} is cut short at {found} of {file_size} bytes"
                    continue
                if cq.zeroed is None and not _vouched(os.pread(mf.fd, UNIT_SIZE, file_size - UNIT_SIZE),
                                                      durable_below):
                    cq._find_zeroed(mf, file_size)
        if cq.files:
            last = cq.files[-1]
            used = _written_length(last)
            if cq.damaged is None and cq.zeroed is None:     # only the part no checkpoint vouches for
                cq._find_zeroed(last, used, _unvouched_from(last.fd, used, durable_below))
            # Blocks up to the first hole exist; past it the next extend allocates before writing.
            last.reserved = min(used, last.allocated_prefix())
            cq.max_offset = (last.start + used) // UNIT_SIZE
            cq.min_offset = cq.files[0].start // UNIT_SIZE
            cq._flush_mark = (last, used)
        if cq.damaged is not None:
            log.warning("consume queue %s-%d: %s: units are missing; rebuilding the queue from the commit log",
                        topic, queue_id, cq.damaged)
        return cq

    def _find_zeroed(self, mf: MappedFile, end: int, start: int = 0) -> None:
        """Note the first all-zero unit in ``mf`` in bytes [start, end) (every unit there must be real: its size
        is never 0). Read with pread in large chunks and searched with bytes.find: a 6 MB file costs a few ms."""
        at = _first_zeroed_unit(mf.fd, end, start)
        if at is not None:
            self.zeroed = ((mf.start + at) // UNIT_SIZE, mf.name, at)

    # ------------------------------------------------------------ appends
    def append(self, phys: int, size: int, tag: int) -> None:
        """One unit (recovery's path; the writer packs a batch's units and calls extend).

        Recovery cannot leave units waiting (queue offsets are assigned from what is written), so
        here no space is a StoreError: start-up stops with one line saying so.
        """
        if not self.extend(UNIT.pack(phys, size, tag)):
            raise StoreError(f"no disk space to rebuild consume queue {self.topic}-{self.queue_id} in "
                             f"{self.directory}: it needs {RESERVE_CHUNK // 1024} KiB; free some space and start "
                             "again", segment=self.files[-1].name if self.files else None) from self.last_error

    def begin_at(self, offset: int) -> None:
        """(Empty queue) its first unit is logical offset ``offset``: a slave copying a master queue that does
        not begin at 0. Units are written where their offset says, not at 0; the file holding ``offset`` is
        filled before it with pre-blank units, as RocketMQ's fillPreBlank does. Zeros there would read, after a
        restart starts the queue at its file, as units lost (a damaged queue)."""
        if self.files or self.backlog or offset <= 0:
            return
        byte = offset * UNIT_SIZE
        self.min_offset = self.max_offset = (byte - byte % self.file_size) // UNIT_SIZE
        if offset > self.max_offset:
            self.extend(_BLANK_UNIT * (offset - self.max_offset))    # one copy; no space: they wait in backlog
        if not self.backlog:
            self.min_offset = offset

    def extend(self, packed) -> bool:
        """Append already packed units (a batch's worth for this queue): one copy per file touched.

        False when the disk has no room: what was not written waits in ``backlog``.
        """
        if self.backlog:
            self.backlog += packed
            return self.retry()
        try:
            self._write(memoryview(packed))
        except OSError as exc:
            self._defer(packed, exc)
            return False
        return True

    def retry(self) -> bool:
        """Write the backlog; True once it is empty."""
        if not self.backlog:
            return True
        pending, self.backlog = self.backlog, bytearray()
        try:
            self._write(memoryview(pending))
        except OSError as exc:
            # (said when they were first deferred: prepare_queue retries on every send, commit and send-back to
            # the queue, and each failed retry wrote the line again, one a refused request past the open-files limit)
            self._defer(pending, exc, said=True)
            return False
        log.info("consume queue %s-%d: space is back, %d waiting units written", self.topic, self.queue_id,
                 len(pending) // UNIT_SIZE)
        return True

    def _defer(self, packed, exc: OSError, said: bool = False) -> None:
        # Kept without its traceback: its frames' f_back chain reaches whoever called (prepare_queue's caller, a
        # decision with its records), all kept alive until the queue's next failure or its file.
        self.last_error = exc.with_traceback(None)
        written = self.max_offset * UNIT_SIZE
        # _write advances max_offset unit by unit run; keep exactly the units it did not copy
        done = written - self._attempt_from
        if not self.backlog and not said:
            log.warning("consume queue %s-%d: units not written, no space or no file for them (%s); they wait in "
                        "memory until they can be", self.topic, self.queue_id, exc)
        self.backlog = bytearray(packed[done:]) + self.backlog

    def _write(self, data: memoryview) -> None:
        self._attempt_from = self.max_offset * UNIT_SIZE
        while data:
            byte = self.max_offset * UNIT_SIZE
            files = self.files
            if not files or byte >= files[-1].start + self.file_size:
                self._new_file(byte)
            mf = files[-1]
            pos = byte - mf.start
            n = min(len(data), self.file_size - pos)
            if pos + n > mf.reserved:
                try:
                    mf.reserve(pos + n + RESERVE_CHUNK)
                except OSError:
                    mf.reserve(pos + n)     # a disk too full for the chunk may still take these units
            mf.mm[pos:pos + n] = data[:n]
            self.max_offset += n // UNIT_SIZE
            data = data[n:]

    def open_file(self) -> None:
        """Make the file the next unit goes to now, when it has none (the OSError when it cannot be made)."""
        byte = self.max_offset * UNIT_SIZE
        if not self.files or byte >= self.files[-1].start + self.file_size:
            self._new_file(byte)

    def _new_file(self, byte: int) -> None:
        if not self.files:
            self.unsynced += make_dirs(self.directory)
            self.min_offset = self.max_offset
        start = byte - byte % self.file_size
        # Not synced here (this is the event loop): the next checkpoint syncs the directory, and the units in
        # the file are not durable before that checkpoint either (a crash rebuilds them from the log).
        self.files.append(MappedFile.create(self.directory, start, self.file_size, reserve=RESERVE_CHUNK,
                                            durable_name=False))
        self.unsynced.append(self.directory)

    def adopt_first_file(self, made: tuple[MappedFile, list[str]]) -> None:
        """Take the first file ``make_first_file`` made (on a thread) for this queue, which has none."""
        mf, dirs = made
        assert not self.files and mf.start == 0 == self.max_offset, (self.topic, self.queue_id)
        self.unsynced += dirs
        self.min_offset = 0
        self.files.append(mf)
        self.unsynced.append(self.directory)

    def mark_damaged(self, offset: int, what: str = "zeroed unit") -> bool:
        """A read met an all-zero unit at ``offset`` (no real unit has size 0): the units there are lost from
        this file though their records are in the log; or a unit whose record is not in its live segment
        (``what`` says which). Said once (ERROR); reads stop at it (pulls get an error, never a skip). True
        the first time: the caller then has ``write_damage_mark`` run on its I/O thread, so that the next
        start rebuilds the queue from the commit log."""
        if self.damage is not None:
            return False
        self.damage = offset
        where = self._locate(offset)
        self._damage_where = f"queue offset {offset}, file {where[0].name if where else '?'}"
        log.error("consume queue %s-%d: %s at %s: messages from there are not served until the broker "
                  "restarts and rebuilds the queue from the commit log", self.topic, self.queue_id, what,
                  self._damage_where)
        return True

    def write_damage_mark(self) -> bool:
        """(I/O thread) The mark that has the next start rebuild this queue (see ``load``); True once written.
        Its name is synced into the directory too: only its presence counts, and a crash that lost the entry
        left the queue unrebuilt, its zeroed units found again only when a read met them. One refused (a full
        disk, no descriptor free) is said once and tried again by the store until it is written: not retried,
        the restart an operator makes to rebuild the queue rebuilt nothing, its reads still stopped there."""
        try:
            with open(os.path.join(self.directory, DAMAGE_MARK), "w") as f:
                f.write(self._damage_where + "\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.directory)
        except OSError as exc:      # a restart would not know: say so once; reads stay refused meanwhile
            if not self._mark_failed:
                self._mark_failed = True
                log.error("consume queue %s-%d: could not mark it for a rebuild (%s): tried again until it is "
                          "written; or delete %s before the next start to have it rebuilt", self.topic,
                          self.queue_id, exc, self.directory)
            return False
        if self._mark_failed:
            self._mark_failed = False
            log.warning("consume queue %s-%d: rebuild mark written again: the next start rebuilds the queue",
                        self.topic, self.queue_id)
        return True

    def mark_missing(self) -> None:
        """Its directory was found missing or empty at start while the store's queue list names it: rebuilt by
        this start's recovery from the whole log, the mark written first (see write_damage_mark)."""
        self.damaged = "its directory was missing or held no file"
        self._damage_where = self.damaged
        self.write_damage_mark()

    def clear_damage_mark(self) -> None:
        """Recovery rebuilt the queue: the mark has served, once the rebuilt units are on disk. They are
        flushed here, before the unlink: an unlink reaches the disk with whatever journal commit comes next
        (any file's fsync forces one), whether or not its directory is fsynced, and durable before the units
        (dirty pages of the mapping; the rebuild zeroed and flushed the file first), a crash could leave a
        queue with lost units and no mark. The removal's own sync is left to the next checkpoint
        (``unsynced``): lost, it only costs one more rebuild."""
        path = os.path.join(self.directory, DAMAGE_MARK)
        if not os.path.exists(path):
            return
        mark = self._flush_mark
        try:
            for mf, lo, hi in self.dirty_ranges():
                mf.flush(lo, hi)
        except OSError as exc:      # kept: the next start rebuilds again; the checkpoint flushes them meanwhile
            self._flush_mark = mark
            log.error("consume queue %s-%d: rebuilt units not flushed (%s): its rebuild mark is kept", self.topic,
                      self.queue_id, exc)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        self.unsynced.append(self.directory)

    def take_unsynced(self) -> list[str]:
        """The directories to fsync before the next checkpoint (parents first); the list is handed over."""
        dirs, self.unsynced = self.unsynced, []
        return dirs

    # --------------------------------------------------------------- reads
    def _locate(self, offset: int) -> tuple[MappedFile, int] | None:
        files = self.files
        if not files:
            return None
        byte = offset * UNIT_SIZE
        idx = (byte - files[0].start) // self.file_size
        if idx < 0 or idx >= len(files):
            return None
        mf = files[idx]
        return mf, byte - mf.start

    def _unit_at(self, offset: int) -> tuple[MappedFile, int] | None:
        return self._locate(offset) if 0 <= offset < self.max_offset else None

    def unit(self, offset: int) -> tuple[int, int, int] | None:
        where = self._unit_at(offset)
        return None if where is None else UNIT.unpack_from(where[0].mm, where[1])

    def unit_on_disk(self, offset: int) -> tuple[int, int, int] | None:
        """``unit``, read with pread: for start-up, where the file may hold a hole (see the top)."""
        where = self._unit_at(offset)
        raw = b"" if where is None else os.pread(where[0].fd, UNIT_SIZE, where[1])
        return UNIT.unpack(raw) if len(raw) == UNIT_SIZE else None

    def read(self, offset: int, count: int) -> bytes | None:
        """Raw units from ``offset``, at most ``count`` and never past the end of its file; None if no file."""
        where = self._locate(offset)
        if where is None:
            return None
        mf, pos = where
        n = min(count, self.max_offset - offset, (self.file_size - pos) // UNIT_SIZE)
        return mf.mm[pos:pos + n * UNIT_SIZE]

    def next_file_offset(self, offset: int) -> int:
        byte = offset * UNIT_SIZE
        return (byte - byte % self.file_size + self.file_size) // UNIT_SIZE

    def first_unit_at_or_after(self, phys: int, lo: int | None = None) -> int:
        """The smallest logical offset whose unit points at ``phys`` or later (units are in log order)."""
        lo = self.min_offset if lo is None else lo
        hi = self.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            u = self.unit(mid)
            if u is not None and u[0] >= phys and u[1] != BLANK_SIZE:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # ------------------------------------------------------ maintenance
    def truncate(self, offset: int) -> int:
        """Drop units from ``offset`` on (zeroed, so a restart does not see them); returns how many."""
        dropped = self.max_offset - offset
        if dropped <= 0:
            return 0
        byte = offset * UNIT_SIZE
        keep = [mf for mf in self.files if mf.start <= byte]
        for mf in self.files[len(keep):]:
            mf.remove()
        self.files = keep
        self.max_offset = offset
        self.min_offset = min(self.min_offset, offset)
        if keep:
            mf = keep[-1]
            pos = byte - mf.start
            end = min(pos + dropped * UNIT_SIZE, self.file_size)
            mf.mm[pos:end] = bytes(end - pos)
            mf.flush(pos, end)
            self._flush_mark = (mf, pos)
        return dropped

    def pad(self, offset: int) -> None:
        """Fill up to ``offset`` with pre-blank units (for records whose units cannot be rebuilt).

        An empty queue starts at the file that holds ``offset``, as RocketMQ's fillPreBlank does.
        """
        if not self.files:
            byte = offset * UNIT_SIZE
            self.max_offset = self.min_offset = (byte - byte % self.file_size) // UNIT_SIZE
        while self.max_offset < offset:
            self.append(0, BLANK_SIZE, 0)

    def expire_before(self, phys: int) -> list[MappedFile]:
        """Move min_offset past units below commit-log offset ``phys``; returns whole files to delete."""
        dead = []
        while len(self.files) > 1:
            first = self.files[0]
            last_unit = UNIT.unpack_from(first.mm, self.file_size - UNIT_SIZE)
            if last_unit[0] >= phys:
                break
            dead.append(self.files.pop(0))
        if self.files:
            self.min_offset = max(self.min_offset, self.files[0].start // UNIT_SIZE)
            # Most queues have nothing in the segment going: one unit read says so. The search read ~log2(units)
            # units of every queue at every removal, on the loop: 40 ms a segment with 4,000 queues.
            u = self.unit(self.min_offset)
            if u is None or u[0] < phys or u[1] == BLANK_SIZE:
                self.min_offset = self.first_unit_at_or_after(phys)
        return dead

    def dirty_ranges(self) -> list[tuple[MappedFile, int, int]]:
        """Ranges written since the last call, for the flush thread."""
        if not self.files:
            return []
        mark_file, mark_pos = self._flush_mark
        last = self.files[-1]
        end = self.max_offset * UNIT_SIZE - last.start
        if mark_file is last and mark_pos == end:
            return []
        ranges = []
        started = mark_file not in self.files
        for mf in self.files:
            if mf is mark_file:
                started = True
                lo = mark_pos
            elif started:
                lo = 0
            else:
                continue
            hi = end if mf is last else self.file_size
            if hi > lo:
                ranges.append((mf, lo, hi))
        self._flush_mark = (last, end)
        return ranges

    def close(self) -> None:
        for mf in self.files:
            mf.close()
        self.files = []


_BLANK_UNIT = UNIT.pack(0, BLANK_SIZE, 0)
DAMAGE_MARK = "DAMAGED"        # in a queue's directory: rebuild it at the next start (mark_damaged)


def _read_mark(directory: str) -> str:
    try:
        with open(os.path.join(directory, DAMAGE_MARK)) as f:
            return f.read(200).strip()
    except OSError as exc:
        return str(exc)


def _vouched(last_unit: bytes, durable_below: int | None) -> bool:
    """The file whose last unit this is was flushed whole before the checkpoint at ``durable_below``."""
    if durable_below is None:
        return False
    phys, size, _tag = UNIT.unpack(last_unit)
    return size != 0x7FFFFFFF and 0 < size and phys + size <= durable_below


_ZERO_UNIT = bytes(UNIT_SIZE)
_SCAN = UNIT_SIZE * 52_428      # about 1 MiB of whole units per pread


def _unvouched_from(fd: int, end: int, durable_below: int | None) -> int:
    """A unit-aligned byte of the file before which every unit is vouched for by the checkpoint: found from the
    end back, a chunk at a time, until a chunk starts with a vouched unit (units are in log order, so all
    before it are vouched too). What start-up reads of a queue's last file is then about what was written
    since the last checkpoint, not the whole file."""
    if durable_below is None:
        return 0
    pos = end - end % UNIT_SIZE
    while pos > 0:
        start = max(0, pos - _SCAN)
        if _vouched(os.pread(fd, UNIT_SIZE, start), durable_below):
            return start
        pos = start
    return 0


def _first_zeroed_unit(fd: int, end: int, start: int = 0) -> int | None:
    """Byte position of the first unit-aligned run of UNIT_SIZE zero bytes in [start, end), or None."""
    pos = start
    while pos < end:
        n = min(_SCAN, end - pos)
        data = os.pread(fd, n, pos)
        if len(data) < n:                   # the file ends early: what is missing is lost too
            return pos + len(data) - len(data) % UNIT_SIZE
        hit = data.find(_ZERO_UNIT)
        while hit >= 0:
            # a real unit's size field is never 0, so 20 zero bytes not on a unit boundary are the ends of
            # two real units (a zero tag, then offset 0): the aligned units around the run decide
            u = hit - hit % UNIT_SIZE
            for cand in (u, u + UNIT_SIZE):
                if cand + UNIT_SIZE <= n and data[cand:cand + UNIT_SIZE] == _ZERO_UNIT:
                    return pos + cand
            hit = data.find(_ZERO_UNIT, hit + 1)
        pos += n
    return None


def _written_length(mf: MappedFile) -> int:
    """Bytes up to the last whole unit holding a non-zero byte (every real unit has a non-zero size).

    pread, not the mapping: the file's tail may be a hole, and on a full tmpfs reading one
    through a mapping is SIGBUS.
    """
    last = last_nonzero(mf.fd, 0, mf.size)
    return min(-(-last // UNIT_SIZE) * UNIT_SIZE, mf.size - mf.size % UNIT_SIZE)


# A deleted topic's directory keeps one file, ``deleted``: the log offset (decimal) below which its records are
# no longer its (the topic's queues were removed there). Recovery re-indexes records of the newest segments for
# queues that lack them; without the mark it brought a deleted topic's queues back, old messages and all, and
# the broker served the topic again (topics.adopt). A topic made again later starts its queues at 0 beside it.
TOMBSTONE = "deleted"


def write_tombstone(topic_dir: str, below: int) -> None:
    """Mark ``topic_dir`` deleted below log offset ``below``, durably (blocking: the store's I/O thread)."""
    made = make_dirs(topic_dir)
    path = os.path.join(topic_dir, TOMBSTONE)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(str(below))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    for d in [topic_dir] + made:
        fsync_dir(d)


def read_tombstone(topic_dir: str) -> int | None:
    """The offset ``write_tombstone`` left in ``topic_dir``, None when there is none (or it is unreadable:
    logged, as the deleted topic's records may come back)."""
    path = os.path.join(topic_dir, TOMBSTONE)
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error("deleted-topic mark %s cannot be read (%s): the topic's old records may be indexed again", path, exc)
        return None
    if not text.strip().isdigit():
        log.error("deleted-topic mark %s holds %r, not an offset: the topic's old records may be indexed again",
                  path, text[:40])
        return None
    return int(text)


def make_first_file(directory: str, file_size: int) -> tuple[MappedFile, list[str]]:
    """A new queue's first file, made off the event loop (``ConsumeQueue.adopt_first_file`` takes it): its
    directories, the file, its mapping, and its first page written once, so that the loop's first unit does not
    fault it in. Each of those waits on the file system's journal (ext4: 1-4 ms while checkpoints fsync), and a
    burst of new queues held the loop for all of them. Returns the file and the directories to sync (as
    ``_new_file``: before the checkpoint that says its units are durable)."""
    dirs = make_dirs(directory)
    mf = MappedFile.create(directory, 0, file_size, reserve=RESERVE_CHUNK, durable_name=False)
    mf.mm[0:1] = b"\0"
    return mf, dirs


def _unit_below(path: str, at: int, log_start: int | None) -> bool:
    """Whether the unit at byte ``at`` of the queue file at ``path`` names a record below ``log_start`` (the last
    unit of a full file: every unit in it does, a queue's units going up the log; the first: every unit before it)."""
    if log_start is None:
        return False
    try:
        with open(path, "rb") as f:
            unit = os.pread(f.fileno(), UNIT_SIZE, at)
    except OSError:     # (unread, not dated: a gap as before, the older files unlinked; raised, it failed the start)
        return False
    if len(unit) < UNIT_SIZE:
        return False
    phys, size, _tag = UNIT.unpack(unit)
    return size > 0 and 0 <= phys < log_start     # (a zeroed unit is damage: it is not dated)


def _remove_leftovers(paths: list[str], topic: str, queue_id: int) -> list[str]:
    """Unlink a queue's files wholly below the log's start, oldest first; said when one cannot be (it and the ones
    after it wait for the store's next removal, or the next start). Returns the paths left."""
    for i, path in enumerate(paths):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("consume queue %s-%d: a file below the log's start, left by a segment removal, could not be "
                        "removed: %s; nothing is read from it: make it removable (ls -l, lsattr; chattr -i) or see "
                        "dmesg (EIO); the next segment removal or start tries again", topic, queue_id, exc)
            return paths[i:]
    return []
