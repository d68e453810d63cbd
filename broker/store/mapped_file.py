"""One fixed-size file mapped read-write: the unit of the commit log and of each consume queue.

Files are named by the offset of their first byte in their log, 20 decimal digits
(``00000000001073741824``), so a directory listing sorts in log order and RocketMQ
tools recognise them.

Why things are done this way:

* Nothing is written through a mapping into space not reserved first: writing to a
  sparse page on a full disk raises SIGBUS and kills the process, while reserving
  fails with a plain ENOSPC the writer can turn into a status. Consume-queue files
  reserve with posix_fallocate in small steps.
* Commit-log segments are created sparse; reserve.py keeps them zero-filled ahead of
  the writer (``zeroed`` is its thread's mark, ``reserved`` the writer's).
* Nothing reads a file through its mapping where it may hold a hole, either: on tmpfs a
  read fault on a hole needs a page the full disk no longer has (SIGBUS too). Start-up
  finds where data ends with ``last_nonzero`` (lseek SEEK_DATA + pread), never the mapping.
* ``flush`` is msync(MS_SYNC) on the page-aligned range, called through libc so the GIL
  is released while the kernel writes, on a worker thread while the event loop goes on.
* The commit log's records go in with pwritev, not stores through the mapping (see
  commit_log._pwrite_all): the mapping reads the same page-cache pages.
* Readers get slices of ``view``; while any slice is alive the mapping cannot be closed
  (mmap.close raises BufferError). ``close`` then just drops our references: the mapping
  is unmapped by the garbage collector when the last slice goes, and the file, already
  unlinked by ``remove``, disappears with it.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import shutil
import sys

log = logging.getLogger("txmq.store")

PAGE = mmap.PAGESIZE


def _libc_msync():
    """libc's msync through ctypes, which lets go of the GIL for the call; None where it is not found.

    CPython's ``mmap.flush`` (3.11) holds the GIL for the whole msync: while the flush thread waited for
    the disk, the event loop could not run at all (measured: the loop thread stalled up to 29 ms and ran
    half its iterations beside a thread msyncing 64 KiB at a time; beside fdatasync, 0.4 ms)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.msync
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MSYNC = _libc_msync()
_MS_SYNC = 4        # Linux <sys/mman.h>


def _address(mm: mmap.mmap) -> int:
    """The mapping's start address (the temporary buffer export is released at once)."""
    ref = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(ref)
    finally:
        del ref
NAME_DIGITS = 20


def file_name(start: int) -> str:
    return f"{start:0{NAME_DIGITS}d}"


def parse_name(name: str) -> int | None:
    """The start offset a file name stands for, or None for files that are not ours."""
    if len(name) != NAME_DIGITS or not name.isdigit():
        return None
    return int(name)


BACKUP_SUFFIX = ".bak"


def keep_previous(path: str) -> None:
    """Before ``path`` is replaced by a rename: make its current contents ``path.bak`` (a hard link renamed into
    place, so ``path`` itself never goes missing). The caller's directory fsync makes both durable."""
    bak, tmp = path + BACKUP_SUFFIX, path + BACKUP_SUFFIX + ".tmp"
    try:
        os.unlink(tmp)                  # left by a save cut short
    except FileNotFoundError:
        pass
    try:
        os.link(path, tmp)
    except FileNotFoundError:           # the first save
        return
    except OSError:
        # A file system without hard links (EPERM, EOPNOTSUPP: vfat, some network and FUSE mounts) made
        # every save of the catalogues fail: a copy, synced before it is renamed into place, does instead.
        try:
            copy_synced(path, tmp)
        except FileNotFoundError:
            return
    os.replace(tmp, bak)


def copy_synced(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` and fsync ``dst`` (its directory is the caller's); ``dst`` (a temporary file
    each caller renames) is removed again when that fails: a full disk cut it short, and it held the pages that
    were free, a partial copy of a whole table, after the save whose .tmp was removed (saved.write_synced)."""
    try:
        shutil.copyfile(src, dst)
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(dst)
        raise


def fsync_dir(path: str) -> None:
    """Make a create, rename or unlink in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str) -> list[str]:
    """``os.makedirs(path, exist_ok=True)``; returns the directories whose entries it changed (the parent of
    each directory it created), which ``fsync_dirs`` must sync before anything in ``path`` is relied on:
    a directory created but not synced into its parent can vanish at a power loss with every file in it."""
    missing = []
    at = os.path.abspath(path)
    while not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    if not missing:
        return []
    os.makedirs(path, exist_ok=True)
    return [os.path.dirname(d) for d in reversed(missing)]


def fsync_dirs(paths) -> None:
    """fsync each directory once, in order (parents first when listed so)."""
    seen = set()
    for path in paths:
        if path not in seen:
            seen.add(path)
            fsync_dir(path)


class MappedFile:
    __slots__ = ("path", "name", "start", "size", "fd", "mm", "addr", "view", "reserved", "zeroed")

    def __init__(self, path: str, start: int, size: int, fd: int, reserved: int):
        self.path = path
        self.name = os.path.basename(path)
        self.start = start
        self.size = size
        self.fd = fd
        self.reserved = reserved    # bytes from 0 known to be allocated on disk: writes go only below it
        self.zeroed = reserved      # (segments) how far the reserver thread has written zeros
        self.mm = mmap.mmap(fd, size)
        self.addr = _address(self.mm) if _MSYNC is not None else 0
        self.view = memoryview(self.mm)

    @classmethod
    def create(cls, directory: str, start: int, size: int, *, reserve: int, durable_name: bool = True) -> "MappedFile":
        """A new zero-filled file of ``size`` bytes with the first ``reserve`` bytes allocated.

        ``durable_name=False`` skips the directory fsync here, on the event loop: the caller has it done later,
        before anything relies on the file (consume queues: by the next checkpoint, ConsumeQueue.unsynced).
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

    def allocated_prefix(self) -> int:
        """Bytes from 0 up to the first hole: what may be read through the mapping on any file system."""
        try:
            return min(os.lseek(self.fd, 0, os.SEEK_HOLE), self.size)
        except OSError:     # no SEEK_HOLE: not tmpfs, where reading a hole maps a zero page harmlessly
            return self.size

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
            if self.addr:
                # Safe: flushes and unmapping of a file run in order on one I/O thread, so the mapping
                # is alive for the whole call.
                if _MSYNC(self.addr + start, hi - start, _MS_SYNC) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"msync of {self.path} [{start}, {hi}): {os.strerror(err)}")
            else:
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


def remove_files(files) -> OSError | None:
    """Remove (unlink and close) ``files``, one queue's (or one segment), oldest first; the error of the first the
    file system would not unlink (EACCES, EPERM: an immutable file or directory; EIO), None when all went. That one
    and the ones after it stay on disk, closed: a queue's files left a run with no gap, which a start would take for
    lost units (the queue rebuilt from the log). Raised, the files after it stayed mapped and what the caller had
    still to do was left undone."""
    for i, mf in enumerate(files):
        try:
            mf.remove()
        except OSError as exc:
            keep_files(files[i:])
            return exc
    return None


def keep_files(files) -> list[str]:
    """Close ``files`` (out of their queue, wholly below the log's start) and leave them on disk, behind an older
    one of their directory that could not be unlinked: unlinked, they left a gap between it and the live files, which
    a start took for a live file lost (the queue rebuilt from the log as damaged). Their paths, oldest first."""
    for mf in files:
        mf.close()
    return [mf.path for mf in files]


_PREAD_CHUNK = 1 << 20


def last_nonzero(fd: int, lo: int, hi: int) -> int:
    """One past the last non-zero byte of the file in [lo, hi), ``lo`` if none. Reads with pread, so
    holes cost nothing to read and fault nothing in; skips them outright where the fs has SEEK_DATA."""
    regions = []
    pos = lo
    while pos < hi:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            stop = min(os.lseek(fd, start, os.SEEK_HOLE), hi)
        except OSError as exc:
            if exc.errno != errno.ENXIO:    # no SEEK_DATA here: look at every byte
                regions = [(lo, hi)]
            break                           # ENXIO: nothing but holes after pos
        if start >= hi:
            break
        regions.append((start, stop))
        pos = stop
    for start, stop in reversed(regions):
        end = stop
        while end > start:
            a = max(start, end - _PREAD_CHUNK)
            tail = os.pread(fd, end - a, a).rstrip(b"\0")
            if tail:
                return a + len(tail)
            end = a
    return lo
