"""One fixed-size file mapped read-write: the unit of the commit log and of each consume queue.

Files are named by the offset of their first byte in their log, 20 decimal digits
(``00000000001073741824``), so a directory listing sorts in log order and RocketMQ
tools recognise them.

Why things are done this way:

* Nothing is written through a mapping into space not reserved first: writing to a
  sparse page on a full disk raises SIGBUS and kills the process, while reserving
  fails with a plain ENOSPC the writer can turn into a status. Consume-queue files
  reserve with posix_fallocate in small steps.
* Commit-log segments are sparse files kept zero-written a few MiB ahead of the writer by
  ``SpaceReserver`` (pwrite on a helper thread): pwrite reserves the blocks (delayed
  allocation) and fails with ENOSPC just as fallocate does, and the page-cache pages it
  leaves make the writer's copy a cheap minor fault -- copying into fallocated, never
  written pages cost 2-3 us per KiB in page faults, more than all the writer's bookkeeping.
* ``flush`` is msync(MS_SYNC) on the page-aligned range (mmap.flush drops the GIL while
  the kernel writes), so it can run on a worker thread while the event loop goes on.
* Readers get slices of ``view``; while any slice is alive the mapping cannot be closed
  (mmap.close raises BufferError). ``close`` then just drops our references: the mapping
  is unmapped by the garbage collector when the last slice goes, and the file, already
  unlinked by ``remove``, disappears with it.
"""
from __future__ import annotations

import logging
import mmap
import os

log = logging.getLogger("txmq.store")

PAGE = mmap.PAGESIZE
NAME_DIGITS = 20


def file_name(start: int) -> str:
    return f"{start:0{NAME_DIGITS}d}"


def parse_name(name: str) -> int | None:
    """The start offset a file name stands for, or None for files that are not ours."""
    if len(name) != NAME_DIGITS or not name.isdigit():
        return None
    return int(name)


def fsync_dir(path: str) -> None:
    """Make a create, rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MappedFile:
    __slots__ = ("path", "name", "start", "size", "fd", "mm", "view", "reserved")

    def __init__(self, path: str, start: int, size: int, fd: int, reserved: int):
        self.path = path
        self.name = os.path.basename(path)
        self.start = start
        self.size = size
        self.fd = fd
        self.reserved = reserved    # bytes from 0 known to be allocated on disk
        self.mm = mmap.mmap(fd, size)
        self.view = memoryview(self.mm)

    @classmethod
    def create(cls, directory: str, start: int, size: int, *, reserve: int, durable_name: bool = True) -> "MappedFile":
        """A new zero-filled file of ``size`` bytes with the first ``reserve`` bytes allocated.

        ``durable_name=False`` skips the directory fsync, for derived files that recovery rebuilds.
        """
        path = os.path.join(directory, file_name(start))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, size)
            if reserve:
                os.posix_fallocate(fd, 0, min(reserve, size))
            mf = cls(path, start, size, fd, min(reserve, size))
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        if durable_name:
            fsync_dir(directory)
        return mf

    @classmethod
    def open(cls, path: str, start: int, size: int) -> tuple["MappedFile", int]:
        """Map an existing file; a short file is extended to ``size``. Returns (file, length found)."""
        fd = os.open(path, os.O_RDWR)
        try:
            found = os.fstat(fd).st_size
            if found < size:
                os.ftruncate(fd, size)
            mf = cls(path, start, size, fd, 0)
        except BaseException:
            os.close(fd)
            raise
        return mf, found

    def reserve(self, end: int) -> None:
        """Allocate disk blocks up to ``end`` (a chunk ahead of the writer), raising OSError on ENOSPC."""
        end = min(end, self.size)
        if end > self.reserved:
            os.posix_fallocate(self.fd, self.reserved, end - self.reserved)
            self.reserved = end

    def flush(self, lo: int, hi: int) -> None:
        """msync bytes [lo, hi); msync wants a page-aligned start."""
        mm = self.mm
        if hi > lo and mm is not None:
            start = lo - lo % PAGE
            mm.flush(start, hi - start)

    def close(self) -> bool:
        """Unmap now if no reader holds a slice; otherwise leave it to the garbage collector. True if unmapped."""
        if self.mm is None:
            return True
        self.view.release()
        try:
            self.mm.close()
            closed = True
        except BufferError:
            closed = False
            log.debug("%s is still referenced by readers; it is unmapped when they release it", self.path)
        self.mm = None
        self.view = None
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.fd = -1
        return closed

    def remove(self) -> bool:
        """Unlink and close; readers holding slices keep reading the unlinked pages safely."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        return self.close()


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
