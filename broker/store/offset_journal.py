"""FirstsJournal: a consumer's first offsets of queues, on disk before their answer without a save of the table.

``<store_dir>/config/consumerOffset.json.firsts``, one JSON line per first offset, appended and fsync'ed, a batch
at a time shared by every commit waiting (group commit):

    [<seq>, "<topic>", "<group>", <queueId>, <offset>, "<client>" or null]

``seq`` numbers the lines, rising for good. The table file says the newest ``seq`` its snapshot holds ("firsts",
offsets.py): a start applies only the lines after it, in order, so a line the table already holds (and may have
moved on or removed since: a topic deleted, a group's offsets removed) is never read back over it. Once a table
holding lines is on disk and so is its previous copy (``.bak``, read when the table is damaged), they are trimmed off
(``trim``), so the file holds about two save periods of first commits.

Why: a first offset answered from memory was lost to a kill -9 before the next periodic save, the successor of a
consumer gone too starting at the end (skipping what was sent meanwhile); saved as a whole table before its answer,
each cost a paced save (10,000 offsets: 150 ms a commit, one queue after another; 100,000: past a client's 3 s
timeout), a pull consumer's commits over many new queues falling behind. An append costs one fsync.

A line cut by a crash (the last, never answered) is skipped at the start; any other that does not read is skipped
and said at ERROR (a hand or a disk changed the file: the table's periodic save holds what it had anyway, unless the
crash came first), and dropped from the file at the next save. An append a full disk cut short is cut back to the
last whole line and its waiters told (left, the next line appended joined it: neither read).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import threading

from .mapped_file import fsync_dir, fsync_dirs, make_dirs
from .saved import DaemonThreads, is_int, retrieved, timed, write_synced

log = logging.getLogger("txmq.store")

SUFFIX = ".firsts"

Entry = tuple[int, str, str, int, int, "str | None"]     # seq, group, topic, queue id, offset, client


class FirstsJournal:
    def __init__(self, table_path: str):
        self.path = table_path + SUFFIX
        self.seq = 0                # the newest line numbered (on the loop): a snapshot taken now holds every one
        self._pending: list[bytes] = []
        self._batch: asyncio.Future | None = None   # the pending lines' write, once one is in flight or queued
        self._flushing: asyncio.Task | None = None
        self._writing: asyncio.Future | None = None  # the batch being written
        self._thread: DaemonThreads | None = None
        self._file_lock = threading.Lock()      # appends (the journal's thread) and trims (the saves' thread)
        self._saved = 0             # the newest line the newest table written holds ("firsts"; trim)

    def load(self, after: int) -> list[Entry]:
        """The lines after ``after`` (the table's "firsts"), in order; numbering goes on past every line read."""
        self.seq = self._saved = after
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return []
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            # A line a crash cut (never answered): cut off, or the next line appended joined it and did not read.
            os.truncate(self.path, whole)
            log.warning("consumer offsets: a line cut by a crash at the end of %s dropped (%d bytes; its commit "
                        "was never answered)", self.path, len(data) - whole)
        entries, bad, shown = [], [], []
        for n, line in enumerate(data[:whole].split(b"\n")):
            if not line:
                continue
            entry = _parse(line)
            if entry is None:
                bad.append(n + 1)
                shown.append(line[:200])
                continue
            self.seq = max(self.seq, entry[0])
            if entry[0] > after:
                entries.append(entry)
        if bad:
            log.error("consumer offsets: %d line(s) of %s do not read (lines %s): skipped, and dropped from the "
                      "file at the next save; a consumer's first offset of a queue there since the last save may be "
                      "missing (it starts from its consume-from policy there: set it with txmq-admin reset-offset "
                      "if the line says where it was): %s", len(bad), self.path, ", ".join(map(str, bad[:10])),
                      " | ".join(line.decode(errors="replace") for line in shown[:3]))
        entries.sort(key=lambda e: e[0])
        return entries

    def add(self, group: str, topic: str, queue_id: int, offset: int, client: str | None) -> asyncio.Future:
        """Number and queue one first offset (on the loop, right after it is committed in memory); the future
        ends once it is on disk (OSError when it cannot be)."""
        self.seq += 1
        self._pending.append(json.dumps([self.seq, topic, group, queue_id, offset, client]).encode() + b"\n")
        if self._batch is None:
            self._batch = asyncio.get_running_loop().create_future()
            self._batch.add_done_callback(retrieved)
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())
        return self._batch

    def in_flight(self) -> asyncio.Future | None:
        """The write of the lines queued last (None: none is queued or being written)."""
        return self._batch or self._writing

    async def _flush(self) -> None:
        try:
            while self._pending:
                lines, self._writing = self._pending, self._batch
                self._pending, self._batch = [], None
                try:
                    await asyncio.get_running_loop().run_in_executor(self._threads(), self._append, b"".join(lines))
                except Exception as exc:    # noqa: BLE001 - a bug too: its waiters are answered, not left hanging
                    self._writing.set_exception(exc)
                else:
                    self._writing.set_result(None)
        finally:
            self._flushing = self._writing = None

    def _threads(self) -> DaemonThreads:
        if self._thread is None:
            self._thread = DaemonThreads("txmq-offsets-firsts")
        return self._thread

    def _append(self, data: bytes) -> None:
        with self._file_lock:
            timed(os.path.basename(self.path), self._append_locked, data)     # (txmq_metadata_write_seconds)

    def _append_locked(self, data: bytes) -> None:
        made = not os.path.exists(self.path)
        if made:
            fsync_dirs(make_dirs(os.path.dirname(self.path)))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            whole = os.fstat(fd).st_size        # (appends and trims hold _file_lock: nothing else moves the end)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            except BaseException:
                # A full disk cuts a write short: the part written, left, was a torn line the next append joined
                # (neither read back at a start). Cut back to the last whole line; the waiters are told.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, whole)
                raise
        finally:
            os.close(fd)
        if made:
            fsync_dir(os.path.dirname(self.path))

    def trim(self, upto: int) -> None:
        """A table holding every line up to ``upto`` is on disk (called on the saves' thread, after its write):
        the lines the table it replaced (now its previous copy, .bak) held too go. Left, the file grew with every
        first commit for good; trimmed up to ``upto`` itself, a start from the previous copy of a damaged table
        missed the first offsets committed between the two saves (the group started by its consume-from policy)."""
        # (min: an older table, not written over a newer one, trims only what it holds)
        upto, self._saved = min(upto, self._saved), max(upto, self._saved)
        if upto > 0:
            try:
                with self._file_lock:       # (not with an append in flight on the journal's thread)
                    self._trim(upto)
            except OSError as exc:      # (the save it follows is on disk: its lines are only read past)
                log.warning("consumer offsets: %s not trimmed after a save (tried again at the next): %s",
                            self.path, exc)

    def _trim(self, upto: int) -> None:
        try:
            with open(self.path, "rb") as fh:
                lines = fh.read().split(b"\n")
        except FileNotFoundError:
            return
        # A line that does not read goes too: said at the start that skipped it (kept, it was said at every start
        # for good). None is being written (appends hold the lock; one that failed was cut back).
        whole = [line for line in lines if line]
        kept = [line for line in whole if (e := _parse(line)) is not None and e[0] > upto]
        if len(kept) == len(whole):     # nothing to drop (an empty file too): no rewrite, no fsync, each save
            return
        if not kept:
            # (no fsync: lines the table holds are skipped at a start anyway, so a crash bringing them back is harmless)
            os.truncate(self.path, 0)
            return
        os.replace(write_synced(self.path + ".tmp", b"".join(line + b"\n" for line in kept)), self.path)
        fsync_dir(os.path.dirname(self.path))

    def close(self) -> None:
        """At the stop, after the last save (which holds every line): appends still queued are not waited for."""
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None


def _write_all(fd: int, data: bytes) -> None:
    """``data`` written whole: a short write (a full disk takes what fits, no error) is ENOSPC, not a line on disk."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "the first offsets' journal: a write took no bytes (disk full?)")
        view = view[n:]


def _parse(line: bytes) -> Entry | None:
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not (isinstance(raw, list) and len(raw) == 6 and is_int(raw[0]) and isinstance(raw[1], str)
            and isinstance(raw[2], str) and is_int(raw[3]) and is_int(raw[4]) and raw[4] >= 0
            and (raw[5] is None or isinstance(raw[5], str))):
        return None
    seq, topic, group, queue_id, offset, client = raw
    return seq, group, topic, queue_id, offset, client
