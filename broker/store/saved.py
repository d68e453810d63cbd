"""Reading a JSON table that is saved with its previous copy (``keep_previous``): consumer offsets, topics,
subscription groups.

One rule for all of them: a table that is missing, torn, zero-length, not JSON, unreadable, or JSON of the
wrong shape is read from ``<file>.bak`` (at most one save older), with an ERROR that says so, moved aside
to ``<file>.damaged`` and written again from the copy; when the copy cannot be read either, start-up stops
with both files and both reasons named. Starting with an empty table instead would reset it without a word -- every group's offsets (mass
redelivery, or a skip by the consume-from policy), every topic's queues and permissions, every group's
settings -- and the next save would make that for good.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import threading
import time
import zlib
from concurrent.futures import Executor, Future
from typing import Callable, TypeVar

from protocol.errors import StoreError

from .mapped_file import BACKUP_SUFFIX, copy_synced, fsync_dir, keep_previous

T = TypeVar("T")
_log = logging.getLogger("txmq.store")
DAMAGED_SUFFIX = ".damaged"

# What a parse raises for JSON of the wrong shape (a list where a table was, a string where a number was).
SHAPE_ERRORS = (ValueError, TypeError, KeyError, AttributeError)


def read_saved(path: str, parse: Callable[[object], T]) -> tuple[T | None, str | None]:
    """(``parse`` of the file's JSON, None), or (None, why not): "missing", or what is wrong with it."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:          # a directory where the file was, EIO, EACCES
        return None, str(exc)
    if not raw.strip(b"\0 \t\r\n"):
        return None, f"{len(raw)} bytes of nothing (zeros or blanks)"
    try:
        return parse(json.loads(raw)), None
    except SHAPE_ERRORS as exc:     # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None, str(exc) or type(exc).__name__


def load_saved(path: str, parse: Callable[[object], T], what: str, log: logging.Logger, *,
               fallback_cost: str, reset_hint: str) -> T | None:
    """The table in ``path`` or, when it cannot be read, in its previous copy (logged at ERROR, with
    ``fallback_cost``: what one save older means); None for a new store (neither file exists).

    Raises StoreError, naming both files and ``reset_hint`` (what an operator may do), when neither can be read."""
    value, why = read_saved(path, parse)
    if why is None:
        return value
    bak = path + BACKUP_SUFFIX
    value, bad = read_saved(bak, parse)
    if bad == "missing" and why == "missing":
        return None
    if bad is not None:
        raise StoreError(f"{what} {path} cannot be read ({why}), nor its previous copy {bak} ({bad}): {reset_hint}")
    kept = ""
    if why != "missing":
        # Moved aside, not left for the next save's keep_previous to make the previous copy: a crash between
        # that and the rename of the new table would leave no readable copy at all. Kept for a post-mortem.
        try:
            os.replace(path, path + DAMAGED_SUFFIX)
            kept = f"; the damaged file is kept as {path + DAMAGED_SUFFIX}"
        except OSError as exc:
            kept = f"; the damaged file could not be moved aside ({exc})"
    try:        # two good copies again at once, not only after the next change (which may be days away)
        _copy_durably(bak, path)
        kept += f"; {path} is written again from it"
    except OSError as exc:
        kept += f"; {path} could not be written again from it ({exc})"
    log.error("%s %s %s: using its previous copy %s (%s)%s", what, path,
              "is missing" if why == "missing" else f"cannot be read ({why})", bak, fallback_cost, kept)
    return value


# fn(file, seconds) for each metadata write that ended (txmq_metadata_write_seconds{file}); set by the broker's
# server. Only the hung ones were said (past 30 s, 1 min): a consumerOffset.json save or a checkpoint taking 4 s
# every time, on a disk whose fsyncs took 2 s, was shown by nothing, while the log flushes had their histogram.
_on_write: Callable[[str, float], None] | None = None


def observe_writes(fn: Callable[[str, float], None] | None) -> None:
    """``fn(file, seconds)`` is called, on the writing thread, for each metadata write that ends (``save``,
    ``timed``)."""
    global _on_write
    _on_write = fn


def timed(file: str, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` (a blocking write of metadata ``file``: a name from a fixed set, the histogram's label), its
    duration observed when it returns."""
    began = time.monotonic()
    result = fn(*args)
    if _on_write is not None:
        _on_write(file, time.monotonic() - began)
    return result


def save(path: str, data: bytes) -> None:
    """Replace the table in ``path`` with ``data`` (written and synced first), its current contents kept as the
    previous copy ``load_saved`` falls back to. Blocking: off the loop. Timed (``observe_writes``), by file name."""
    timed(os.path.basename(path), _save, path, data)


def _save(path: str, data: bytes) -> None:
    tmp = write_synced(path + ".tmp", data, then=lambda: keep_previous(path))
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_synced(tmp: str, data: bytes, then=None) -> str:
    """``tmp`` made to hold ``data``, synced (then ``then()``), for the caller to rename over the file it replaces;
    removed again when any of that fails. Blocking: off the loop.

    A full disk cut the copy short: left there, it held every page that was free, and the other tables of the
    directory (brokerConfig.json's few bytes, written before SUCCESS and never retried) were refused on a disk with
    room for them until this one's retried save fitted (retried_save.py); the transaction snapshot's, written again
    at its next change or stop, held it until one fitted (left by a stop: through the next start too)."""
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if then is not None:
            then()
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def retrieved(task) -> None:
    """Done callback of a shared save (topics' and offsets' ``saved``): one whose every waiter was cancelled (its
    connection gone) must not log "never retrieved" -- its caller was told, or is gone."""
    if not task.cancelled():
        task.exception()


def _copy_durably(src: str, dst: str) -> None:
    tmp = dst + ".tmp"
    copy_synced(src, tmp)
    os.replace(tmp, dst)
    fsync_dir(os.path.dirname(dst))


def check(cond: bool, what: str) -> None:
    """For ``parse`` functions: a wrong shape is a ValueError naming it."""
    if not cond:
        raise ValueError(what)


def is_int(value) -> bool:
    """A JSON integer (a bool is an int to Python, never to the tables)."""
    return isinstance(value, int) and not isinstance(value, bool)


# A JSON snapshot may end with its checksum: ``,"crc":N}``, N the CRC-32 of the bytes written before it closed
# by "}". Damage that leaves valid JSON (a flipped digit) is otherwise believed; a snapshot that is only a
# shortcut (the log has the truth) is then ignored instead. Files of older versions have none.
_CRC_MARK = b',"crc":'


def with_crc(data: bytes) -> bytes:
    """``data`` (one JSON object with a key at least, compact) with its checksum as its last key."""
    return data[:-1] + _CRC_MARK + b"%d}" % zlib.crc32(data)


def crc_matches(raw: bytes, crc) -> bool:
    """Whether ``raw`` (the file) ends with checksum ``crc`` (its "crc" key) of what comes before it."""
    at = raw.rfind(_CRC_MARK)
    return type(crc) is int and at >= 0 and raw[at:] == _CRC_MARK + b"%d}" % crc and zlib.crc32(raw[:at] + b"}") == crc


class DaemonThreads(Executor):
    """Daemon threads sharing one queue of work (an executor for run_in_executor): the topics catalogue's and the
    consumer offsets' writes, one thread each (``workers`` 1: in order), and the loop's default executor (server.py
    ``serve``: ``asyncio.to_thread``, the subscription groups', KV config's, snapshots' writes).

    Daemons, unlike a ThreadPoolExecutor's workers: the interpreter's exit joins those, and the event loop's close
    joins its default executor's, so a write that hangs (a stopped NFS) kept the process from ending after its stop
    had given the table up (topics.py, offsets.py ``close``), or after it had logged "stopped", SIGTERM answered by
    nothing until a SIGKILL. ``shutdown(wait=True)`` joins them for at most ``join_s``, then says which still hang
    and leaves them to the exit. A write cut by the exit leaves only its .tmp copy (``save``)."""

    def __init__(self, name: str, workers: int = 1, join_s: float | None = None):
        self._work_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._join_s = join_s
        self._threads = [threading.Thread(target=self._main, name=name if workers == 1 else f"{name}-{i}",
                                          daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        self._work_queue.put((fut, fn, args, kwargs))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for _ in self._threads:
            self._work_queue.put(None)
        if not wait:
            return
        until = None if self._join_s is None else time.monotonic() + self._join_s
        for thread in self._threads:
            thread.join(None if until is None else max(0.0, until - time.monotonic()))
        hung = [t.name for t in self._threads if t.is_alive()]
        if hung:
            _log.error("%d thread(s) still blocked %g s after the stop (%s: a write to a hung disk or a stopped "
                       "network file system?); the process ends without them (a table they were writing keeps "
                       "its previous save)", len(hung), self._join_s, ", ".join(hung))

    def _main(self) -> None:
        while (job := self._work_queue.get()) is not None:
            fut, fn, args, kwargs = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - the caller's to see, as ThreadPoolExecutor's
                fut.set_exception(exc)


def daemon_default_executor() -> None:
    """The running loop's default executor made DaemonThreads joined at most 10 s (the broker's and the name
    server's ``serve``): asyncio.to_thread's writes (subscription groups, KV config, snapshots) that hung kept the
    process from ending after its stop, for ever (the loop's close and the interpreter's exit join a
    ThreadPoolExecutor's workers). As many threads as a ThreadPoolExecutor's default."""
    asyncio.get_running_loop().set_default_executor(
        DaemonThreads("txmq-io", workers=min(32, (os.cpu_count() or 1) + 4), join_s=10.0))
