"""What became of every transaction, one byte each, on disk: the decision table.

Indexed by the half message's offset in the half queue (RMQ_SYS_TRANS_HALF_TOPIC queue 0, dense
from 0), in files of ``FILE_ENTRIES`` bytes named by their first index, mmap'd:

    0 undecided (or resumed)    1 COMMIT    2 ROLLBACK    3 DEAD

A late or repeated END, or an admin action on an old half, is answered from here, so the broker
keeps nothing in memory per decided transaction (RocketMQ keeps nothing either, and answers from its
op queue). The bytes are set after the decision's op record is durable; ``flush()`` (on the store's
I/O thread) makes them durable before a snapshot names the op-queue offset they cover. Files wholly
below the half queue's first offset (removed by retention) are deleted by ``trim``.
"""
from __future__ import annotations

import logging
import mmap
import os

from broker.store.mapped_file import fsync_dir, fsync_dirs, make_dirs
from broker.store.reserve import write_zeros
from protocol.txlog import COMMIT, DEAD, ROLLBACK

log = logging.getLogger("txmq.transaction")

FILE_ENTRIES = 1 << 20
_CODE = {COMMIT: 1, ROLLBACK: 2, DEAD: 3}
_NAME = {1: COMMIT, 2: ROLLBACK, 3: DEAD}
_CODES = bytes([0, *_NAME])
_AHEAD = ".ahead"


class DecisionTable:
    def __init__(self, directory: str, file_entries: int = FILE_ENTRIES):
        self.directory = directory
        self.file_entries = file_entries
        fsync_dirs(make_dirs(directory))       # once, at start-up (a new store)
        # Files whose names are not synced into the directory yet: the snapshot that relies on their bytes
        # syncs it first (``files_made`` != ``files_synced``), once per new file, never per decision.
        self.files_made = self.files_synced = 0
        self._maps: dict[int, mmap.mmap] = {}
        self._dirty: set[int] = set()
        self._pending: dict[int, int] = {}      # entries whose file could not be made yet (a full disk)
        self._making: set[int] = set()          # files a thread is making ahead of need (see ``wants``)
        self._closed = False
        self._earlier: "Earlier | None" = None      # what ``clear`` handed back: closed when its blocks are needed
        # Files that cannot be this table's (the wrong size, bytes no decision has): recovery rebuilds the table
        # from the op queue. Resized or read as they were, the decisions in them were lost without a word: a
        # late END or an admin action on those halves answered "not found", and the DEAD count was wrong.
        self.damaged: list[tuple[str, str]] = []
        for name in sorted(os.listdir(directory)):
            if name.isdigit() and len(name) == 20:
                why = self._damage(self._path(int(name)))
                if why is None:
                    self._open(int(name))
                else:
                    self.damaged.append((self._path(int(name)), why))
            elif name.endswith(_AHEAD):         # a file made ahead by a process that stopped before linking it
                try:
                    os.unlink(os.path.join(directory, name))
                except FileNotFoundError:       # or by a table of this process, whose thread just did
                    pass

    def _path(self, base: int) -> str:
        return os.path.join(self.directory, f"{base:020d}")

    def _damage(self, path: str) -> str | None:
        """What is wrong with an existing decision file, or None. (An unreadable one raises, naming it.)"""
        with open(path, "rb") as f:
            data = f.read(self.file_entries + 1)
        if len(data) != self.file_entries:
            return f"{len(data)} bytes, not {self.file_entries}"
        if data.translate(None, _CODES):
            return "bytes that are no decision"
        return None

    def _open(self, base: int) -> mmap.mmap:
        """Map the file of ``base``, its blocks allocated first: a store through a mapping into a hole
        of a full disk is SIGBUS, not an error (ENOSPC comes from fallocate instead, here)."""
        path = self._path(base)
        # Created by this call, known from the open itself: a check before it could be stale (the
        # thread of ``make`` may link the file in between), and a failure below would then unlink a
        # file this call did not make.
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
            created = False
        try:
            if os.fstat(fd).st_size != self.file_entries:
                os.ftruncate(fd, self.file_entries)     # holes read as 0, undecided
            try:
                os.posix_fallocate(fd, 0, self.file_entries)
            except OSError:
                if not self._give_way():
                    raise
                os.posix_fallocate(fd, 0, self.file_entries)
            m = mmap.mmap(fd, self.file_entries)
        except OSError:
            if created:     # leave no half-made file for the next start to trip over
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        if created:
            self.files_made += 1
        self._maps[base] = m
        return m

    # ------------------------------------------------------------ files made ahead of need
    # Making a file (create, fallocate 1 MiB, map) took 0.5 ms alone and ~70 ms under a busy disk: on the
    # loop, at the first decision of each file, it stalled every connection. So a thread makes it when a
    # half message arrives whose file is missing, or which is past half of its file (the next one), and
    # ``set`` finds it there. ``_open`` on the loop stays the fallback (a decision before the thread is done).

    def wants(self, index: int) -> int | None:
        """The base of a file to make ahead for half-queue entry ``index`` (then call ``make`` on a thread and
        ``adopt`` on the loop), or None. Cheap: two dict lookups a half message."""
        n = self.file_entries
        base = index - index % n
        if base in self._maps:
            if index - base < n // 2:
                return None
            base += n
        if base in self._maps or base in self._making or index < 0:
            return None
        self._making.add(base)
        return base

    def make(self, base: int) -> mmap.mmap | None:
        """(Thread) the file of ``base``, allocated and mapped, or None if it exists already (the loop made it).

        Made under a temporary name and linked into place only if the name is free: the loop may be
        making the same file meanwhile (``_open``), and neither may replace or unlink the other's."""
        path, tmp = self._path(base), self._path(base) + _AHEAD
        if os.path.exists(path):
            return None
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        linked = False
        try:
            # Zeros written, not fallocate'd: the first store into an allocated-but-unwritten block through
            # the mapping converts the extent on the loop (first decision 187 us against 15 us, each new page
            # 2.7 us against 0.2; ext4, /tmp/dec_micro2.py in docs/performance.md).
            write_zeros(fd, 0, self.file_entries, tmp)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return None
            linked = True
            return mmap.mmap(fd, self.file_entries)
        finally:
            os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:   # a table opened meanwhile took it for a dead process's leftover
                pass
            if linked:      # a thread: the name is durable before any decision goes in (the temporary one gone)
                fsync_dir(self.directory)

    def adopt(self, base: int, made: mmap.mmap | None) -> None:
        """(Loop) take a file ``make`` returned (None: it failed, or the loop made it first)."""
        self._making.discard(base)
        if made is None:
            return
        if self._closed or base in self._maps:
            made.close()
            return
        self._maps[base] = made
        if self._pending:
            self.retry()

    def get(self, index: int) -> str | None:
        if index < 0:
            return None
        if self._pending and index in self._pending:
            return _NAME.get(self._pending[index])
        m = self._maps.get(index - index % self.file_entries)
        return None if m is None else _NAME.get(m[index % self.file_entries])

    def set(self, index: int, op: str | None) -> None:
        """Record ``op`` (COMMIT, ROLLBACK, DEAD) or None (undecided again: a resume).

        When a new file cannot be made (a full disk), the entry waits in memory, still answered by
        ``get``, and is written when a later ``set`` or ``retry`` can make the file: the decision's op
        record is durable already, so nothing is lost meanwhile (a restart replays it)."""
        if index < 0:
            return
        code = _CODE.get(op, 0) if op is not None else 0
        base = index - index % self.file_entries
        m = self._maps.get(base)
        if m is None:
            try:
                m = self._open(base)
            except OSError as exc:
                if not self._pending:
                    log.error("decision file %s cannot be made (%s): decisions wait in memory until it can",
                              self._path(base), exc)
                self._pending[index] = code
                return
        m[index % self.file_entries] = code
        self._dirty.add(base)
        self._pending.pop(index, None)
        if self._pending:
            self.retry()

    def retry(self) -> None:
        """Write the entries that waited in memory for their file (those whose file still cannot be
        made wait on)."""
        for index, code in sorted(self._pending.items()):
            base = index - index % self.file_entries
            m = self._maps.get(base)
            if m is None:
                try:
                    m = self._open(base)
                except OSError:
                    continue
            m[index % self.file_entries] = code
            self._dirty.add(base)
            del self._pending[index]

    def undecided_in(self, lo: int, hi: int) -> list[int]:
        """The indexes in [lo, hi) without a decision (start-up: the halves retention removed before a start read
        them). A file's zero bytes are found by ``bytes.find``, not index by index: decided halves are most."""
        out: list[int] = []
        n = self.file_entries
        base = lo - lo % n if lo >= 0 else 0
        while base < hi:
            a, b = max(lo, base), min(hi, base + n)
            m = self._maps.get(base)
            if m is None:
                candidates = range(a, b)
            else:
                chunk, candidates = m[a - base:b - base], []
                i = chunk.find(0)
                while i >= 0:
                    candidates.append(a + i)
                    i = chunk.find(0, i + 1)
            out += [q for q in candidates if self.get(q) is None]
            base += n
        return out

    def count(self, op: str) -> int:
        """How many entries hold ``op`` (a full read: start-up and tests, not the request path)."""
        return (sum(_count(m, _CODE[op]) for m in self._maps.values())
                + sum(1 for c in self._pending.values() if c == _CODE[op]))

    def dirty(self) -> list[mmap.mmap]:
        """The maps changed since the last call: hand them to ``flush_maps`` on the I/O thread."""
        maps = [self._maps[b] for b in self._dirty if b in self._maps]
        self._dirty.clear()
        return maps

    def trim(self, first_index: int) -> int:
        """Delete the files wholly below ``first_index``; returns how many DEAD entries went with them."""
        dead = 0
        for base in [b for b in self._maps if b + self.file_entries <= first_index]:
            m = self._maps.pop(base)
            dead += _count(m, _CODE[DEAD])
            m.close()
            self._dirty.discard(base)
            try:
                os.unlink(self._path(base))
            except OSError as exc:
                log.warning("decision file %s not removed: %s", self._path(base), exc)
        return dead

    def forget_from(self, index: int) -> int:
        """Undecide every entry from ``index`` on; returns how many were decided. At start-up, with the
        half queue's end: a log cut shorter at recovery leaves decisions for halves that are gone, and
        the new halves stored at those queue offsets would be taken as decided."""
        forgotten = 0
        for base, m in self._maps.items():
            lo = max(index - base, 0)
            if lo < self.file_entries:
                tail = m[lo:]
                decided = len(tail) - tail.count(0)
                if decided:
                    m[lo:] = bytes(len(tail))
                    self._dirty.add(base)
                    forgotten += decided
        for i in [i for i in self._pending if i >= index]:
            del self._pending[i]
            forgotten += 1
        return forgotten

    def _give_way(self) -> bool:
        """Close what ``clear`` handed back, its unlinked files' blocks freed for this table's (a full disk: once
        they freed the space the rebuild's files take); True when that freed anything."""
        earlier, self._earlier = self._earlier, None
        if earlier is None or not earlier.maps:
            return False
        log.warning("decision table: the disk is full; the decisions the last process left (kept for op records "
                    "the rebuild cannot read) are let go to make room for the rebuilt table")
        earlier.close()
        return True

    def clear(self) -> "Earlier":
        """Forget everything, damaged files included (a rebuild from the log follows). Returns what the sound
        files said, read-only (their names unlinked, their pages still mapped): an op record the rebuild cannot
        read had its decision's byte set here once it was durable (recovery.py). Close it when done; it is closed
        (and reads as undecided) when this table cannot make a file without its blocks (a full disk)."""
        earlier = Earlier(self._maps, self.file_entries)
        self._maps = {}
        for base in earlier.maps:
            os.unlink(self._path(base))
        for path, _why in self.damaged:
            os.unlink(path)
        self.damaged.clear()
        self._dirty.clear()
        self._earlier = earlier
        return earlier

    def close(self) -> None:
        self._closed = True
        for m in self._maps.values():
            m.flush()
            m.close()
        self._maps.clear()

    @property
    def bases(self) -> list[int]:
        """The files the table has (a snapshot names them: see ``lost``)."""
        return sorted(self._maps)

    def lost(self, bases: list[int], first_index: int) -> list[str]:
        """The files of ``bases`` (a snapshot's) that are gone though retention did not remove them (not
        wholly below ``first_index``): deleted by hand or by a file-system repair, their decisions with them."""
        return [self._path(b) for b in bases if b not in self._maps and b + self.file_entries > first_index]

    @property
    def waiting(self) -> int:
        """Entries waiting in memory for a file that could not be made."""
        return len(self._pending)

    @property
    def file_count(self) -> int:
        return len(self._maps)


class Earlier:
    """The decisions a table held before ``DecisionTable.clear``: looked up, never written."""

    def __init__(self, maps: dict[int, mmap.mmap], file_entries: int):
        self.maps = maps
        self.file_entries = file_entries

    def get(self, index: int) -> str | None:
        m = self.maps.get(index - index % self.file_entries) if index >= 0 else None
        return None if m is None else _NAME.get(m[index % self.file_entries])

    def close(self) -> None:
        for m in self.maps.values():
            m.close()
        self.maps = {}


def _count(m: mmap.mmap, code: int, chunk: int = 1 << 20) -> int:
    needle = bytes([code])
    return sum(m[i:i + chunk].count(needle) for i in range(0, len(m), chunk))


def flush_maps(maps: list[mmap.mmap]) -> None:
    """msync each map (blocking: the store's I/O thread)."""
    for m in maps:
        try:
            m.flush()
        except ValueError:      # closed meanwhile (trimmed): nothing to keep
            pass
