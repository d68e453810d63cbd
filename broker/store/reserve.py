"""Disk space for the commit log, reserved ahead of the writer on a thread of its own.

Why reserve at all: a store through a mapping into a page the file system has no block for
raises SIGBUS on a full disk and kills the process; ``pwrite`` of zeros into the same range
fails with a plain ENOSPC, which is a refusal of one write. So no byte is copied into a
segment below which ``reserved`` has not moved, and ``reserved`` only moves once zeros are
on disk (pwrite + fdatasync: the later msync then overwrites allocated, written blocks, with
no extent to allocate or convert and no journal commit on the commit path, the reason
PostgreSQL zero-fills its WAL segments).

Why a thread (RocketMQ's AllocateMappedFileService): zero-filling megabytes and fdatasync
must not run on the event loop. ``SpaceReserver`` keeps the active segment ``low``..``high``
bytes ahead of the writer and the NEXT segment created and partly zeroed (``spare``), so a
roll is a pointer swap. When the writer does get ahead of it, it awaits ``ensure`` /
``prepare_roll`` (the writer coroutine waits; the loop does not), and a failure there is an
OSError for that one write: the next write asks again, so the store stays writable and
resumes by itself when space comes back.

Threads: every job runs on one IoThread, in order. ``MappedFile.zeroed`` (how far zeros
are on disk) is written only by that thread; ``reserved`` (how far the writer may copy) only
by the loop, from a finished job's result. A job only writes at or past ``zeroed``, the writer
only below ``reserved <= zeroed``: a job never overwrites data.
"""
from __future__ import annotations

import errno
import logging
import os

from .mapped_file import MappedFile

log = logging.getLogger("txmq.store")

_ZEROS = memoryview(bytes(1 << 20))


def stalled_write(path: str, at: int, left: int) -> OSError:
    """The error for a pwrite that wrote nothing and reported nothing: a loop that retried it would spin
    for ever on the thread or loop that called it, so every write loop of the store raises this instead."""
    return OSError(errno.EIO, f"a write of {left} bytes at offset {at} wrote 0 bytes and reported no error",
                   path)


def write_zeros(fd: int, lo: int, hi: int, path: str) -> None:
    """Zero-fill [lo, hi) of ``path`` (open as ``fd``) and make the block allocation durable (OSError,
    ENOSPC included, on failure)."""
    start = lo
    while lo < hi:
        # 1 MiB a call. The writer copies records into the same file with pwritev on the event loop,
        # and both take the inode's lock: one pwritev of 12 MiB of zeros held the loop up to 5.6 ms
        # (1 MiB a call: 0.9 ms; p99.9 of 4 KiB sends at c=8 7.5-8.1 ms -> 3.8-4.2 ms). Getting the
        # GIL back between calls costs at most the broker's switch interval (0.2 ms; it was 5 ms when
        # one call did it all).
        n = min(hi - lo, len(_ZEROS))
        done = os.pwrite(fd, _ZEROS[:n], lo)
        if done <= 0:
            raise stalled_write(path, lo, hi - lo)
        lo += done
    if hi > start:
        os.fdatasync(fd)


def zero_to(mf: MappedFile, need: int, want: int) -> int:
    """(Job) zeros on disk up to at least ``need``, ``want`` if there is room; returns the new mark.

    On ENOSPC for ``want`` it tries once more for exactly ``need``: a disk too full for the
    read-ahead chunk may still take this write.
    """
    need, want = min(need, mf.size), min(max(want, need), mf.size)
    if mf.zeroed >= want:
        return mf.zeroed
    # A file descriptor of its own: Linux reports a file's writeback error to one fsync / msync per open
    # file, so this fdatasync on the mapping's file could take the error of a page the writer's next msync
    # must see (and that msync would then return 0 for a page that never reached the disk).
    fd = os.open(mf.path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        try:
            write_zeros(fd, mf.zeroed, want, mf.path)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or want <= need:
                raise
            if mf.zeroed >= need:       # what was asked for is there; the read-ahead must wait
                return mf.zeroed
            want = need
            write_zeros(fd, mf.zeroed, want, mf.path)
    finally:
        os.close(fd)
    mf.zeroed = want
    return want


class SpaceReserver:
    def __init__(self, clog, low: int, high: int):
        self.clog = clog
        self.low, self.high = low, high
        self.spare = None           # the next segment, created and zeroed ahead (loop-owned)
        self._made = {}             # start -> segment the thread created (thread-owned; the newest only)
        self._io = None
        self._bg = None             # the background job in flight, if any (one at a time)
        self._last = None           # the newest job submitted: retention waits for it before unmapping
        self._warned = False        # a background job failed (logged once until one succeeds)
        self.after_job = None       # called on the loop after every job: space was just taken (disk probe)

    def start(self, io) -> None:
        self._io = io

    @property
    def idle(self):
        """An awaitable for the newest job (or None): no job of ours touches a file after it."""
        return self._last if self._last is not None and not self._last.done() else None

    # ------------------------------------------------------------ what the writer awaits
    def ensure(self, seg, need: int, then):
        """Submit: ``seg`` backed up to ``need``. Returns (future, settle); call settle() once it is done:
        it claims the space and returns the job's exception, if any."""
        fut = self._submit(zero_to, seg, need, need + self.low, then=then)
        return fut, lambda: _claim(seg, fut)

    def prepare_roll(self, seg, marker_end: int, need: int, then):
        """Submit: ``seg`` backed up to its end marker and the next segment made and backed up to ``need``."""
        fut = self._submit(self._roll_job, seg, marker_end, seg.start + self.clog.seg_size, need, need + self.low,
                           then=then)
        return fut, lambda: self._got_spare(seg, fut)

    # ------------------------------------------------------------ keeping ahead
    def top_up(self, seg, pos: int) -> None:
        """After a batch: keep ``low``..``high`` zeroed ahead, and the next segment ready past half way."""
        if self._io is None or (self._bg is not None and not self._bg.done()):
            return
        size = seg.size
        # Top up in low-sized steps while more than low of the high-sized cushion is used, so the
        # writer meets a full cushion, not one just drained, when it runs faster than a single job.
        if seg.reserved < size and seg.reserved - pos < self.high - self.low:
            fut = self._bg = self._submit(zero_to, seg, min(size, pos + self.low), pos + self.high)
            fut.add_done_callback(lambda f: self._warn(_claim(seg, f), "reserve space ahead in segment " + seg.name))
        elif self.spare is None and pos >= size // 2:
            fut = self._bg = self._submit(self._roll_job, None, 0, seg.start + size, self.low, self.low)
            fut.add_done_callback(lambda f: self._warn(self._got_spare(None, f), "prepare the next segment"))

    def take_spare(self):
        spare, self.spare = self.spare, None
        return spare

    def _got_spare(self, seg, fut):
        if fut.cancelled():
            return None
        exc = fut.exception()
        if exc is not None:
            return exc
        marker_end, spare = fut.result()
        if seg is not None:
            seg.reserved = max(seg.reserved, marker_end)
        spare.reserved = max(spare.reserved, spare.zeroed)
        if self.spare is None and spare.start == self.clog.segments[-1].start + self.clog.seg_size:
            self.spare = spare
        return None

    def _warn(self, exc, what: str) -> None:
        if exc is None:
            self._warned = False
        elif not self._warned:  # the writer meets the shortage itself when it gets there, as a refusal
            self._warned = True
            log.warning("could not %s ahead of need: %s", what, exc)

    def _submit(self, fn, *args, then=None):
        fut = self._io.submit(fn, *args, then=then)
        if self.after_job is not None:
            fut.add_done_callback(lambda _f: self.after_job())
        self._last = fut
        return fut

    def _roll_job(self, seg, marker_end: int, start: int, need: int, want: int):
        """(Job) back ``seg``'s end marker, then create (once) and back the segment at ``start``."""
        if seg is not None:
            marker_end = zero_to(seg, marker_end, marker_end)
        spare = self._made.get(start)
        if spare is None:
            spare = self.clog.make_segment(start)
            self._made = {start: spare}
        zero_to(spare, need, want)
        return marker_end, spare

    def close(self) -> None:
        """After the I/O thread stopped: a spare nobody wrote goes (recovery would remove it anyway)."""
        for seg in self._made.values():
            if seg not in self.clog.segments:
                seg.remove()
        self._made = {}
        self.spare = None


def _claim(seg, fut):
    """Move ``seg.reserved`` to a finished zero_to job's mark; returns the job's exception, if any."""
    if fut.cancelled():
        return None
    exc = fut.exception()
    if exc is None:
        seg.reserved = max(seg.reserved, fut.result())
    return exc

