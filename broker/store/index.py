"""IndexService: the message index by key and by UNIQ_KEY, kept off the event loop (RocketMQ's IndexService).

Every stored record that is not a ROLLBACK, nor of a topic given as ``unindexed`` (the transaction op
topic: nobody looks its records up by key, and RocketMQ's op messages have no UNIQ_KEY to index), gets
one entry for ``topic#UNIQ_KEY`` and one for each word of its KEYS property (space separated), in index
files of index_file.py; a new file starts when the last is full, or a record's store time is ``period_ms``
past its begin or over BACK_STEP_MS before its newest entry (the clock stepped back: at most once per
BACK_ROLL_EVERY_S), a
batch of records cut where one leaves its file's time; a file is
removed once retention has removed every segment it points into (its END PHYOFFSET is below the log's
first offset; never the last).

Threads: the dispatch listener only appends ``(offset, size)`` to a deque, and wakes the thread only
when the deque was empty; ONE index thread, woken, lets records gather for ``lag_ms`` (10 ms: one
wake-up and one run of reads and writes per 10 ms under load instead of one per group commit), then
reads the records back from their segment files (pread, its own descriptors), writes the entries,
answers queries and removes files. A job (a query) ends the wait, and the thread takes every record
dispatched before it first -- so a query sent after a send was acknowledged sees it.

What is indexed is a prefix of the log: ``covered`` is the offset below which every record is
indexed (or needs no entry). A dispatch beyond ``covered`` first fills the gap from the log, so
nothing can be skipped. At start-up ``covered`` is the larger of ``index/progress`` (written
every 10 s after an fsync of the files) and the newest entry's record, neither past the end
recovery left the log at (records written over a cut range are new), and the thread catches
up from there to the end of the log: a broker killed with -9 loses no entry of an acknowledged
message. A damaged index file (IndexCorrupt; one that cannot be read is kept, indexing stopped until it
can be: IndexUnreadable; one that can be read but not written is opened read-only, searched and never
written) is removed with the files after it, logged at ERROR, and rebuilt
from the commit log. A write error stops indexing (``failed``); an OSError (a full disk's, ENOSPC or
EDQUOT, or any other: out of descriptors, a mapping refused, an I/O error that passed) is
tried again every ``resume_every_s``: the files are read back as a start-up reads them (a batch the
error cut short undone) and the log is caught up from where they end, without a restart.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import itertools
import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from typing import Callable, Iterable, NamedTuple

from protocol.errors import StoreError
from protocol.message import BLANK_MAGIC, MESSAGE_MAGIC, Prop, property_bytes, string_to_properties
from protocol.record import MESSAGE_MAGIC_BYTES

from .index_file import BACK_STEP_MS, HEADER, MAX_BATCH, TIME, IndexCorrupt, IndexFile, KeyHasher, WalkBudget, key_hash
from .mapped_file import fsync_dir, fsync_dirs, make_dirs
from .saved import retrieved, timed

log = logging.getLogger("txmq.index")

_NAME = re.compile(r"^\d{17}$")
_SIZE_MAGIC = struct.Struct(">ii")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_I16 = struct.Struct(">h")
_PROGRESS = struct.Struct(">qI")        # covered, crc32 of it (what 4.9.8-era txmq wrote; still read)
# covered, 1 if no index file was held when it was saved, crc32 of both. Without the flag a start that found no
# file could not tell "removed" (``rm index/*``: rebuild from the log's start) from "never needed one" (no record
# had a key or UNIQ_KEY: raw sends, clients that set none) and re-read the whole commit log at every start.
_PROGRESS_FLAGGED = struct.Struct(">qBI")
PROGRESS_FILE = "progress"
PROGRESS_EVERY_S = 10.0        # each fsync writes back every slot-table page dirtied since the last (under
                                # load, most of its 20 MB): once a second that cost the broker 2-5 us per send
MAX_QUERY = 64                  # RocketMQ's maxMsgsNumBatch
# Records of the key's hash a query reads and checks, over all files. Hashes collide ("Aa"/"BB" families make
# any number of keys with one String.hashCode), and a query reads on past the other keys' records: behind 50,000
# of them it held the index thread 0.8-1.4 s (no record indexed meanwhile; the loop's clients 3x slower at p99).
# 4,096 is ~80 ms; a key that is really there is met long before, unless that many of its hash are newer.
MAX_QUERY_CHECKS = 4096
# Index entries a query reads in all, of any hash: a slot (hash % slots) holds other hashes' entries too, and the
# entries newer than endTimestamp are walked past. Uncounted, 100,000 of them held the thread 0.66-0.81 s (one
# pread each, 7-10 us on a loaded host); 16,384 is 0.16 s there.
MAX_QUERY_READS = 4 * MAX_QUERY_CHECKS
_CUT_LOG_EVERY_S = 60.0
# A record stored more than BACK_STEP_MS (index_file.py) before the newest entry of the file being written (the wall
# clock stepped back) starts a new file. In that file, each entry's time is its TIME DIFF from the file's begin,
# never negative: after a jump ahead started the file, every later entry was taken as stored at that begin, and a
# query by key with a window around its real time found nothing. And a key's walk, newest first, stops at the
# first entry older than the window: an entry stored after a step back (still past the file's begin) hid the
# entries of the key stored before it in the window. At most one such file per BACK_ROLL_EVERY_S (each takes a slot
# table of 4 * index_hash_slots bytes): a clock that flaps back and forth has its entries kept, out of order, said.
BACK_ROLL_EVERY_S = 600.0
_ROLLBACK = 0xC
_CHUNK = 1 << 20
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)     # write errors that pass once the disk has room (said so)
# Errors opening a file that say nothing of the file (a file system turned read-only, no descriptors, no memory):
# not damage. Taken for it, a resume on an ext4 remounted read-only said every file "damaged: removing it".
_NOT_THE_FILE = (errno.EROFS, errno.EMFILE, errno.ENFILE, errno.ENOMEM)
CATCH_UP_SLICE = 2 * _CHUNK     # start-up catch-up bytes between two turns of the index thread's queue
OPEN_SEGMENTS = 32              # segment descriptors the index thread keeps open (least recently read closed first)
OPEN_INDEX_FILES = 16           # older index files' descriptors kept open (least recently queried closed first)
LAG_MS = 10.0                   # how long a woken index thread lets dispatched records gather before it indexes them
# A job on the index thread that has run this long (not its wait behind others): a write there hangs (the periodic
# progress save's msync of the newest file or its index/progress write, on a hung disk or a stopped NFS). A query
# waiting behind it is answered SYSTEM_ERROR then (stalled_s): it waited for ever, answered by nothing.
STALLED_S = 10.0
# Records dispatched a job takes at most (the rest in the next, behind the jobs queued meanwhile): those that waited
# for the start-up catch-up (many slices: a removed index/, a long-stopped broker) were indexed in one job, ~14 us
# a record: 700,000 of them (3 min of catch-up at 4,000 sends/s) ran past STALLED_S, a legitimate job gauged and
# refused as a hung disk's. 16,384: ~0.25 s.
BACKLOG_SLICE = 16_384
_WAKE = object()
_MORE = object()        # (the thread's own: records left in the deque by BACKLOG_SLICE; no LAG_MS wait)


def record_keys(raw, pos: int = 0):
    """(topic, store timestamp, sys flag, UNIQ_KEY or None, [KEYS words]) of the record at ``pos``."""
    sys_flag = _I32.unpack_from(raw, pos + 36)[0]
    p = pos + 48 + (20 if sys_flag & 0x10 else 8)
    ts = _I64.unpack_from(raw, p)[0]
    p += 8 + (20 if sys_flag & 0x20 else 8) + 12
    body_len = _I32.unpack_from(raw, p)[0]
    p += 4 + body_len
    topic_len = raw[p]
    topic = bytes(raw[p + 1:p + 1 + topic_len]).decode("utf-8", "replace")
    p += 1 + topic_len
    props_len = _I16.unpack_from(raw, p)[0]
    props = string_to_properties(bytes(raw[p + 2:p + 2 + props_len]).decode("utf-8", "replace"))
    keys = [k for k in (props.get(Prop.KEYS) or "").split(" ") if k]
    return topic, ts, sys_flag, props.get(Prop.UNIQ_KEY), keys


_UNIQ_PAIR = b"\x02" + Prop.UNIQ_KEY.encode() + b"\x01"
_KEYS_PAIR = b"\x02" + Prop.KEYS.encode() + b"\x01"
_V4_FIELDS = struct.Struct(">i16xq20xi")   # at 36: sys flag, store time, body length (both hosts IPv4)


class IndexService:
    def __init__(self, store_dir: str, *, segment_size: int, slots: int = 5_000_000, entries: int = 20_000_000,
                 period_ms: int = 86_400_000, lag_ms: float = LAG_MS, clock: Callable[[], int] | None = None,
                 unindexed: Iterable[str] = (), refuse_ratio: float = 1.0):
        self.directory = os.path.join(store_dir, "index")
        self.log_dir = os.path.join(store_dir, "commitlog")
        self.seg_size = segment_size
        self.slots, self.entries, self.period_ms = slots, entries, period_ms
        # A file's slot table is allocated only below it, one segment to spare (IndexFile._check_room)
        self.refuse_ratio = refuse_ratio
        self.clock = clock or (lambda: time.time_ns() // 1_000_000)
        self.files: list[IndexFile] = []
        self._queried: collections.OrderedDict[IndexFile, None] = collections.OrderedDict()  # older files open
        self.covered = 0                # every record below is indexed (or has no key)
        self.rebuilt: list[str] = []    # files found damaged at start-up (removed and re-indexed)
        self._skip = -1                 # the newest entry's record: indexed already (at least in part) ...
        self._skip_hashes: set[int] = set()     # ... these of its keys: a crash may have cut its batch
        self._q: queue.SimpleQueue = queue.SimpleQueue()       # jobs, _WAKE, None (stop)
        self._pending: collections.deque = collections.deque()  # (offset, size) dispatched, not yet taken
        self.lag_s = lag_ms / 1000
        self._hasher = KeyHasher()
        self._unindexed = frozenset(t.encode() for t in unindexed)     # topics whose records get no entry
        self._thread: threading.Thread | None = None
        # segment start -> descriptor, the index thread's own, most recently read last. At most OPEN_SEGMENTS:
        # kept for every segment it ever read, a catch-up over a long log (or queries over months of index
        # files) held one per segment on top of the store's two, and the broker ran out of descriptors.
        self._fds: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._last_progress = 0.0
        self._catching_up = False       # records dispatched meanwhile wait in _pending until the catch-up ends
        self._backlog = False           # records left in _pending for the next job (BACKLOG_SLICE): partial too
        self._loop = None
        self._closed = False
        self._stopping = False          # close() queued the thread's last job: later jobs would never run
        self._saved = -1
        self.failed: str | None = None
        # After a write error (a full disk's, an OSError) stopped indexing: tried again every resume_every_s (see _resume). Without it a
        # query by key missed every message stored after the disk was full, until the broker restarted.
        self.resume_every_s = PROGRESS_EVERY_S
        self._resumable = False         # the failure was an OSError's: tried again (_resume)
        self._said_kinds: set = set()   # the errnos (or exception types) said in this failure run: another is said
        self._failed_at = 0.0
        self._failing = False           # in a failure run (said once): until a resume has caught up
        self._log_min = 0               # the log's first offset (open, expire) ...
        self._seen_end = 0              # ... and the end of the last record dispatched: what a resume indexes
        self.max_checks = MAX_QUERY_CHECKS
        self.max_reads = MAX_QUERY_READS
        self.queries_cut = 0            # queries that stopped at max_checks (txmq_index_queries_cut_total)
        self._job_began: float | None = None    # time.monotonic() the index thread began its job now running
        self._cut_logged = -_CUT_LOG_EVERY_S
        self.back_roll_every_s = BACK_ROLL_EVERY_S
        self._back_rolled: float | None = None  # time.monotonic() a record older than its file started one
        self._back_said = -_CUT_LOG_EVERY_S
        self._removed_under = False     # a progress save found index files removed (unlinked) under it: _resume
        self._expired_left: list[str] = []     # paths of expired index files that could not be unlinked (_expire)
        self._expire_said = False       # an expiry's unlink error was said (until an expiry leaves none)
        self._catch_up_from: tuple[int, float] | None = None   # (offset, time.monotonic()) the start's catch-up began

    # ------------------------------------------------------------ lifecycle
    def on_dispatch(self, info) -> None:
        """The store's dispatch listener: a record is durable and readable; index it (on the thread)."""
        if not info.recovering:
            pending = self._pending
            pending.append((info.physical_offset, info.size))
            if len(pending) == 1:       # the first since the thread last took them: wake it
                self._q.put(_WAKE)

    async def open(self, log_min: int, log_end: int) -> None:
        """Load the files (blocking work on a thread), start the index thread and let it catch up to
        ``log_end`` in the background, a slice at a time: a query waits for one slice, not all of it, and
        is answered from what is indexed so far (with how far that is), as RocketMQ's queryOffset answers
        from its index while the reput service catches up."""
        self._loop = asyncio.get_running_loop()
        self._log_min, self._seen_end = log_min, log_end
        try:
            await self._loop.run_in_executor(None, self._load, log_min, log_end)
        except IndexUnreadable as exc:
            self._stopped_at_start(exc, log_min, log_end)
        self._catch_up_from = (self.covered, time.monotonic())     # (said once the start's catch-up is through)
        self._thread = threading.Thread(target=self._main, name="txmq-index", daemon=True)
        self._catching_up = True
        self._thread.start()
        self._q.put(lambda: self._catch_up(log_end))

    def _stopped_at_start(self, exc: "IndexUnreadable", log_min: int, log_end: int) -> None:
        """An index file the start could not read (EIO, EACCES): answered from the files before it, indexing stopped
        as by a write error (txmq_index_failed) and the files read again every resume_every_s (_resume), as a start
        reads them. The progress is not taken: it covers the files not read."""
        newest = next((f for f in reversed(self.files) if f.count > 1), None)
        self.covered = max(log_min, min(newest.end_phy, log_end)) if newest is not None else log_min
        self.failed = str(exc)
        self._failing = self._resumable = True
        self._failed_at = time.monotonic()
        self._said_kinds = {exc.errno}      # (said here; a resume that fails again the same way is quiet)
        log.error("index: %s; queries by key are answered from the %d index files before it (messages from "
                  "commit-log offset %d on are not searched) and it is read again every %.0f s", exc, len(self.files),
                  self.covered, self.resume_every_s)

    async def close(self) -> None:
        if self._thread is None:
            return
        done = self._submit(self._shutdown)
        self._stopping = True
        given_up = False
        try:
            await done
        except asyncio.CancelledError:
            # Given up by a stop behind a save that hangs (server._stop_behind_the_log): joining the thread stuck in
            # it blocked the loop's end for ever. A daemon: the process ends with it, as after a kill -9 (the next
            # start catches up from the commit log).
            given_up = True
            raise
        finally:
            self._q.put(None)
            if not given_up:
                await self._loop.run_in_executor(None, self._thread.join)
                self._thread = None

    def _submit(self, fn, *args) -> asyncio.Future:
        fut = self._loop.create_future()
        if self._stopping:      # a query arriving while the broker stops: answered, not left waiting
            fut.set_exception(StoreError("the message index is closed"))
            return fut
        loop = self._loop

        def job():
            try:
                value = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, value, None)
        self._q.put(job)
        return fut

    @property
    def stopped(self) -> bool:
        """Indexing stopped by a write error (or an index file a start could not read) and not caught up since
        (txmq_index_failed). Not ``failed`` alone: a resume clears that while it tries, and the gauge read 0 for that
        moment every interval of a full disk."""
        return self.failed is not None or self._failing

    @property
    def partial(self) -> bool:
        """A query is answered from a prefix of the log: the start-up catch-up (or a full disk's resume) has not
        reached its end (nor the records dispatched meanwhile, BACKLOG_SLICE a job), or a write error stopped indexing. Who must know a record is absent (not merely not
        indexed yet) says so when this is true (TransactionService resume)."""
        return self._catching_up or self._backlog or self.stopped

    # ------------------------------------------------------------ the API (awaitable)
    async def query(self, topic: str, key: str, max_num: int, begin: int, end: int) -> "QueryResult":
        """A QueryResult: the commit-log offsets of records of ``topic`` whose KEYS or UNIQ_KEY is ``key``, newest
        first, at most min(max_num, 64), from at most ``max_checks`` records of its hash (``cut`` if more were
        left). StoreError once the index thread has not come through in STALLED_S (a write there hangs)."""
        self._check_held()      # (seen held already: at once, no job left queued behind it for nobody)
        asked = self._submit(self._query, topic, key, max(0, min(max_num, MAX_QUERY)), begin, end)
        while True:
            done, _ = await asyncio.wait({asked}, timeout=1.0)
            if done:
                return asked.result()
            try:
                self._check_held()
            except StoreError:
                asked.add_done_callback(retrieved)     # (answered by the thread if it ever comes through)
                raise

    def _check_held(self) -> None:
        stalled = self.stalled_s()
        if stalled > STALLED_S:
            raise StoreError(f"the message index's thread has not come through in {stalled:.0f} s (a write "
                             "there hangs: a hung disk or a stopped network file system?; "
                             "txmq_index_stalled_seconds)")

    def stalled_s(self) -> float:
        """How long the job now running on the index thread has run (0.0 between jobs). Polled by the gauge loop
        and a query still waiting: a write there that hung held every query by key behind it, unanswered, and
        nothing said it. The job's own time, not a no-op's wait behind the queue: a backlog of quick jobs (a burst
        of queries by key on a cold disk) made a probe wait seconds, and queries the thread was answering one
        after the other were refused as behind a hang. Not the hot path."""
        began = self._job_began
        return 0.0 if began is None else max(0.0, time.monotonic() - began)

    def expire(self, min_offset: int) -> asyncio.Future:
        """Remove the files every entry of which points below ``min_offset`` (never the last one). An error is
        said here: the store's removal listener drops the future (it said nothing, the file left on disk)."""
        fut = self._submit(self._expire, min_offset)
        fut.add_done_callback(lambda done: _said_expire_error(done, min_offset, self.directory))
        return fut

    def stats(self) -> dict:
        files = list(self.files)
        return {"files": len(files), "entries": sum(f.count - 1 for f in files), "covered": self.covered,
                "last_update_ts": files[-1].end_ts if files else 0}

    # ------------------------------------------------------------ start-up (a worker thread)
    def _load(self, log_min: int, log_end: int, quiet: bool = False) -> None:
        fsync_dirs(make_dirs(self.directory))
        names = sorted(n for n in os.listdir(self.directory) if _NAME.match(n))
        for i, name in enumerate(names):
            path = os.path.join(self.directory, name)
            try:
                f = IndexFile.open(path, self.slots, self.entries, self.refuse_ratio, self.seg_size)
                # The one before closed now, not once all are read: every file open at once (~2,600 over 30 days),
                # past the open-files limit a start failed EMFILE. Not before this one opened: a damaged one after
                # it leaves it the file written (its descriptor read-write).
                if self.files:
                    self.files[-1].park()
                self.files.append(f)
            except OSError as exc:
                if exc.errno == errno.ENOENT:       # removed since listed: the newer ones start past a gap
                    self._drop_damaged(names[i:], str(exc), log_min)
                    break
                # Only IndexCorrupt is the file's damage. An error reading it -- the process's or the file system's
                # (EROFS, EMFILE, ENOMEM), the disk's (EIO: a flaky disk's passes) or a permission (EACCES: a broker
                # once run as root) -- was taken for it: the file and every newer one unlinked and rebuilt from the
                # log for nothing (a full rebuild for an error that passes; a resume's queries answered nothing
                # meanwhile). Raised: a resume keeps the files it had open, searched as far as before, and is tried
                # again (the index thread's ERROR, once); a start answers from the files before it (open).
                if exc.errno in _NOT_THE_FILE:
                    raise
                if i + 1 < len(names) and _begins_below(os.path.join(self.directory, names[i + 1]), log_min):
                    # Every entry of it points below the log's first offset (the next file begins there): nothing
                    # in it could answer a query. Kept, indexing stayed stopped for good once retention had
                    # removed its records (read again every resume_every_s, failing), every message since unfound.
                    self._said_once(("expired-unreadable", name), "index: index file %s could not be read (%s), "
                                    "but its entries all point below the commit log's first offset %d (retention "
                                    "removed their records): passed over and removed", name, exc.strerror, log_min)
                    with contextlib.suppress(OSError):      # (one that cannot be is passed over again)
                        os.unlink(path)
                    continue
                # (The progress too: left, it says their records indexed, and the start caught up past them.)
                raise IndexUnreadable(exc.errno, f"index file {name} could not be read ({exc.strerror}); nothing "
                                      "was removed; if the error stays, remove that file, the "
                                      f"{len(names) - i - 1} newer ones and {PROGRESS_FILE} from {self.directory} "
                                      "and the broker rebuilds their entries from the commit log", path) from exc
            except IndexCorrupt as exc:
                self._drop_damaged(names[i:], str(exc), log_min)
                break
        read_only = [f.name for f in self.files if f.read_only]
        if read_only:
            self._said_once(("read-only",), "index: %d index file(s) (%s .. %s) can be opened read-only only "
                            "(Permission denied at read-write): searched, never written, new entries go to a new "
                            "file; chown them to the broker's user (was a broker run as root?)", len(read_only),
                            read_only[0], read_only[-1])
        newest = next((f for f in reversed(self.files) if f.count > 1), None)
        start = log_min
        # Entries at or past the log's end name records recovery cut off: the records written there from now
        # on are new and must be indexed, not taken as covered.
        if newest is not None:
            start = max(start, min(newest.end_phy, log_end))
        if newest is not None and newest.end_phy < log_end:
            self._skip = newest.end_phy
            self._skip_hashes = newest.tail_hashes(newest.end_phy)
            if newest is not self.files[-1]:
                newest.park()       # (read again for that: closed as the other older files are)
        # (No index file at all: they were removed, ``rm index/*``, the progress left or saved again; a progress
        # with no entries behind it would skip the whole log before it -- unless it was saved with no file: then
        # no record before it needed an entry, and a file made after it holds entries of records past it only.)
        progress, without_files, damage = self._read_progress()
        if not self.rebuilt and (names or without_files):
            start = max(start, min(progress, log_end))
        if damage is not None:
            # Not taken, unsaid: the start re-read the log from the newest entry's record -- with no index file (a
            # log of records without keys), all of it, a slow start nobody could explain.
            self._said_once(("progress", damage), "index: %s is %s: not taken; catching up %d bytes of the commit log "
                            "from offset %d (%s); it is written again once caught up", self._progress_path(), damage,
                            max(log_end - start, 0), start, "the newest index entry's record" if newest is not None
                            else "the log's first: no index file to go by")
        self.covered = start
        behind = log_end - start
        (log.debug if quiet else log.info)("index: %d files, catching up %d bytes of the commit log from offset %d",
                                           len(self.files), max(behind, 0), start)

    def _drop_damaged(self, names: list[str], why: str, log_min: int) -> None:
        prev = self.files[-1].end_phy if self.files else 0
        # From the log's first offset when retention removed the records before it: said "from offset <prev>", the
        # entries of those records seemed rebuilt. (They are lost, and could not be answered anyway: a query reads
        # each match's record back.)
        lost = (f" (not those of records below the commit log's first offset {log_min}: retention removed them, "
                "no query could be answered from them)") if log_min > prev else ""
        # Once a failure run, as its write errors: a file a resume could not remove (a file system turned read-only)
        # was found again at every attempt, two ERRORs each 10 s for as long as the disk stayed so.
        kind = ("damaged", names[0])
        self._said_once(kind, "index file %s is damaged (%s): removing it%s and rebuilding their entries from the "
                        "commit log from offset %d%s", names[0], why,
                        f" and the {len(names) - 1} newer files" if len(names) > 1 else "", max(prev, log_min), lost,
                        level=logging.ERROR)
        for name in names:
            try:
                os.unlink(os.path.join(self.directory, name))
            except OSError as exc:
                self._said_once(kind + (name,), "could not remove index file %s: %s", name, exc, level=logging.ERROR)
        self.rebuilt = list(names)

    def _said_once(self, kind, msg: str, *args, level: int = logging.WARNING) -> None:
        """Once a failure run, as its write errors: what a resume found again (a file a file system turned read-only
        would not let it remove) was said at every attempt, each 10 s for as long as the disk stayed so."""
        seen = self._failing and kind in self._said_kinds
        self._said_kinds.add(kind)
        log.log(logging.DEBUG if seen else level, msg, *args)

    def _progress_path(self) -> str:
        return os.path.join(self.directory, PROGRESS_FILE)

    def _read_progress(self) -> tuple[int, bool, str | None]:
        """(covered as saved, whether it was saved with no index file, None); (0, False, why) if damaged or not
        readable, (0, False, None) if there is none."""
        try:
            with open(self._progress_path(), "rb") as fh:
                raw = fh.read(_PROGRESS_FLAGGED.size + 1)
        except FileNotFoundError:
            return 0, False, None
        except OSError as exc:
            return 0, False, f"not readable ({exc.strerror})"
        if len(raw) == _PROGRESS.size:
            (value, crc), without_files = _PROGRESS.unpack(raw), 0
        elif len(raw) == _PROGRESS_FLAGGED.size:
            value, without_files, crc = _PROGRESS_FLAGGED.unpack(raw)
        else:
            return 0, False, f"damaged ({len(raw)} bytes, not {_PROGRESS_FLAGGED.size})"
        if crc != zlib.crc32(raw[:-4]) or value < 0:
            return 0, False, "damaged (its checksum does not match)"
        return value, without_files == 1, None

    # ------------------------------------------------------------ the index thread
    def _main(self) -> None:
        q, pending, popleft = self._q, self._pending, self._pending.popleft
        while True:
            if self.failed is not None and self._resumable and not self._closed:
                # A resume is due by the clock, not only at the next send or query: on a broker quiet once the
                # disk had room, the index stayed stopped (and the first query by key was answered stale).
                try:
                    item = q.get(timeout=max(self._failed_at + self.resume_every_s - time.monotonic(), 0.01))
                except queue.Empty:
                    item = _WAKE
            else:
                item = q.get()
            if item is _WAKE and self.lag_s > 0:
                try:                    # let records gather; a job (a query) ends the wait
                    item = q.get(timeout=self.lag_s)
                except queue.Empty:
                    item = _WAKE
            # Before the job, so a query sees them. Until empty, not len(pending) of them: a record the
            # loop appends after that count would find the deque non-empty, skip its wake-up and wait for
            # the next send (found in review).
            batch = []
            while pending and not self._catching_up and len(batch) < BACKLOG_SLICE:
                batch.append(popleft())
            if batch:
                self._seen_end = max(self._seen_end, batch[-1][0] + batch[-1][1])
                self._guarded(self._index, batch)
                self._backlog = len(batch) >= BACKLOG_SLICE and bool(pending)
                if self._backlog:       # (on_dispatch wakes the thread only for a record that finds the deque empty)
                    q.put(_MORE)
            if (self.failed is not None and self._resumable and item is not None and not self._closed
                    and time.monotonic() - self._failed_at >= self.resume_every_s):
                self._guarded(self._resume)
            if item is None:
                return
            if item is not _WAKE and item is not _MORE:       # a job: each runs whatever failed before it (a query must be answered)
                self._guarded(item)
            if time.monotonic() - self._last_progress >= PROGRESS_EVERY_S:
                self._guarded(self._save_progress)

    def _guarded(self, fn, *args) -> None:
        self._job_began = time.monotonic()      # (stalled_s)
        covered = self.covered
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the index is derived: log, keep serving queries
            # ``covered`` passes each record before its entries are written: left past a batch whose write failed,
            # a query's remark ("not searched from offset N") and txmq_index_behind_bytes left out the records lost.
            self.covered = min(self.covered, covered)
            # Any OSError, not only a full disk's: one that passes (out of descriptors, a mapping refused at
            # vm.max_map_count, an I/O error, index/ removed) stopped indexing until the next restart, every later
            # message missing from queries by key for as long as the broker ran. A resume reads the files back as a
            # start does; one that fails again is quiet.
            resumable = isinstance(exc, OSError)
            kind = exc.errno if resumable else type(exc)
            # Once a failure run; again when a resume meets another kind of error (one not retried, another errno):
            # said nothing, the log still promised a resume once there was room. Each kind once a run: two in turn
            # (ENOSPC, EIO) said an ERROR with its traceback at every attempt, 8,640 a day.
            if self.failed is None and not self._failing:
                self._said_kinds = set()
            if kind not in self._said_kinds:
                self._said_kinds.add(kind)
                log.exception("index thread: %s; indexing stops here and resumes from the commit log %s (queries "
                              "go on answering from what is indexed)", exc,
                              "once the disk has room" if resumable and exc.errno in _NO_ROOM else
                              f"by itself once the error passes (tried again every {self.resume_every_s:.0f} s)"
                              if resumable else "at the next start")
            self.failed = str(exc)
            self._failing, self._resumable, self._failed_at = True, resumable, time.monotonic()
        finally:
            self._job_began = None

    def _resume(self) -> None:
        """(Index thread) after a write error (a full disk's, an OSError) stopped indexing: the files read back as a start-up reads them (the
        entries of a batch the error cut short undone; the newest record's missing keys found again) and the log
        caught up from where they end to the last record dispatched, in slices, as at start-up. Failing again
        (the disk still full), it is tried again an interval later, without another word."""
        self._failed_at = time.monotonic()
        # The files open are closed once they are read back, not before: closed first, a resume that could not open
        # them (a file system turned read-only, EROFS at O_RDWR; out of descriptors) left none, and every query by
        # key answered nothing for as long as that lasted. Failing, they go on answering, searched as far as before.
        kept, covered = self.files, self.covered
        self.files = []
        self._skip, self._skip_hashes = -1, set()
        try:
            if self._removed_under:
                # Files removed under the running broker: the ones made since begin past what they held. Started
                # from the newest's end, the resume indexed none of the records before it again.
                for name in (os.listdir(self.directory) if os.path.isdir(self.directory) else []):
                    if _NAME.match(name) or name.startswith(PROGRESS_FILE):
                        os.unlink(os.path.join(self.directory, name))
                self._removed_under = False
                log.warning("index: rebuilding the message index from the commit log (offset %d): its files were "
                            "removed under the running broker", self._log_min)
            self._load(self._log_min, self._seen_end, quiet=True)     # (a line every interval of a full disk)
        except BaseException:
            for f in self.files:
                f.close()
            self.files, self.covered = kept, covered
            raise
        for f in kept:
            f.close()
        # (Not before: failing, the older files kept open stay the ones the LRU closes. Forgotten at each attempt,
        # a read-only disk's resume every 10 s between queries of time windows left every file they read open.)
        self._queried.clear()
        self.failed = None
        self._catching_up = True
        end = self._seen_end
        self._q.put(lambda: self._catch_up(end))

    def _shutdown(self) -> None:
        try:
            self._save_progress()
        except OSError as exc:      # a full disk must not turn a clean stop into a crash
            log.error("index progress not saved at stop (the next start catches up from the commit log): %s", exc)
        self._closed = True
        for f in self.files:
            f.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _save_progress(self) -> None:
        self._last_progress = time.monotonic()
        value = self.covered
        if value == self._saved or self.failed is not None:
            return
        # ``rm index/*`` under a running broker (the directory kept): the entries went on into the unlinked files
        # and this save said them indexed, no error; the next start took the progress and rebuilt nothing before
        # it. An OSError: indexing stops and the resume rebuilds the index from the log. (A stat a file each save:
        # a file per day or per 20M entries. By path, not st_nlink, which some file systems do not keep. ENOENT only:
        # os.path.exists, False for any error of stat, took a file a failing disk could not stat (EIO) for removed,
        # and the resume unlinked every index file; that error is raised, tried again as any OSError.)
        gone = [f.name for f in self.files if not _exists(f.path)]
        if gone:
            self._removed_under = True      # the resume rebuilds all of it: the files left start past a gap
            raise OSError(errno.ENOENT, f"{len(gone)} index file(s) ({gone[0]} ...) removed from {self.directory} "
                                        "under the running broker")
        timed("index/progress", self._write_progress, value)     # (txmq_metadata_write_seconds)
        self._saved = value

    def _write_progress(self, value: int) -> None:
        if self.files:
            self.files[-1].sync()       # entries before the progress that says they exist
        raw = struct.pack(">qB", value, not self.files)
        raw += struct.pack(">I", zlib.crc32(raw))
        path = self._progress_path()
        tmp = path + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(raw)
        os.replace(tmp, path)

    def _index(self, batch: list[tuple[int, int]]) -> None:
        if self._closed or self.failed is not None:
            return      # after a failure, ``covered`` may be past what was written: never save it
        items: list[tuple[int, int, int]] = []
        run: list[tuple[int, int]] = []         # contiguous records of one segment: read with one pread
        seg = self.seg_size
        lo = 0                                  # the run's first offset
        for phy, size in batch:
            covered = self.covered
            if phy != covered:
                if phy < covered:
                    continue
                self._index_run(run, items)     # a record the queue never saw (or a segment's end): read the log
                self._flush(items)
                self._scan(covered, phy)
            if run and (phy + size - lo > _CHUNK or phy // seg != lo // seg):
                self._index_run(run, items)
            if not run:
                lo = phy
            run.append((phy, size))
            self.covered = phy + size
        self._index_run(run, items)
        self._flush(items)

    def _index_run(self, run: list[tuple[int, int]], items: list) -> None:
        if not run:
            return
        lo = run[0][0]
        raw = self._read(lo, run[-1][0] + run[-1][1] - lo)
        n, head, collect = len(raw), _SIZE_MAGIC.unpack_from, self._collect
        for phy, size in run:
            at = phy - lo
            if n >= at + size and head(raw, at) == (size, MESSAGE_MAGIC):
                collect(items, raw, at, phy)
        run.clear()
        if len(items) >= 4096:
            self._flush(items)

    def _collect(self, items: list, raw: bytes, pos: int, phy: int) -> None:
        """Append (hash, phy, store time) for the keys of the record at ``pos`` -- what record_keys and
        key_hash give, read straight from the bytes (see KeyHasher): the index thread's per-record work."""
        sys_flag, ts, body_len = _V4_FIELDS.unpack_from(raw, pos + 36)
        if sys_flag & 0xC == _ROLLBACK and not _I64.unpack_from(raw, pos + 20)[0]:
            # (ROLLBACK is stored with QUEUEOFFSET 0: one carrying another is a COMMIT whose bit 0x4 flipped at rest,
            # served by the store with the bit put back, recovery._typed_away; left out, a query missed it)
            return
        if sys_flag & 0x30:             # an IPv6 host: the fields after it move
            p = pos + 48 + (20 if sys_flag & 0x10 else 8)
            ts = _I64.unpack_from(raw, p)[0]
            p += 8 + (20 if sys_flag & 0x20 else 8) + 12
            p += 4 + _I32.unpack_from(raw, p)[0]
        else:
            p = pos + 88 + body_len
        topic_len = raw[p]
        hasher = self._hasher
        tb = raw[p + 1:p + 1 + topic_len]
        if tb in self._unindexed:
            return
        th = hasher.topics.get(tb)
        if th is None:
            th = hasher.topic(tb)
        p += 1 + topic_len
        props = b"\x02" + raw[p + 2:p + 2 + _I16.unpack_from(raw, p)[0]]
        key, append, first = hasher.key, items.append, len(items)
        uniq = property_bytes(props, _UNIQ_PAIR)
        if uniq is not None:
            append((key(th, uniq), phy, ts))
        keys = property_bytes(props, _KEYS_PAIR)
        if keys is not None:
            for k in keys.split(b" "):
                if k:
                    append((key(th, k), phy, ts))
        if phy == self._skip:           # the record the newest entry names: only the keys it lacks
            items[first:] = [it for it in items[first:] if it[0] not in self._skip_hashes]
            self._skip, self._skip_hashes = -1, set()

    def _flush(self, items: list) -> None:
        while items:
            f = self._writable(items[0][2])
            n = f.put_many(items[:self._fitting(f, items)])
            del items[:n]

    def _fitting(self, f: IndexFile, items: list) -> int:
        """How many of ``items`` from the first go to ``f``: as far as the first whose store time is past the file's
        period or (unless the first already is) over BACK_STEP_MS below the newest before it in the file. The file
        was chosen by the first only: a batch across a step back of the clock had the records after it clamped to
        a begin a day ahead, and a catch-up over days of the log put them all in one file."""
        n = min(len(items), f.room, MAX_BATCH)
        if n == 1:          # one record, one key (a send at a time): _writable chose the file for it
            return 1
        first = items[0][2]
        begin, top = (f.begin_ts, max(f.end_ts, first)) if f.count > 1 else (first, first)
        hi = begin + self.period_ms
        times = list(map(TIME, itertools.islice(items, n)))
        if first < f.end_ts - BACK_STEP_MS and f.count > 1:     # stepped back, no new file (_may_roll_back): kept
            return next((i for i in range(1, n) if times[i] >= hi), n)
        lo, most = min(times), max(times)
        if top - BACK_STEP_MS <= lo and most - BACK_STEP_MS <= lo and most < hi:    # (the common case)
            return n
        for i in range(1, n):
            t = times[i]
            if t >= hi or t < top - BACK_STEP_MS:
                return i
            if t > top:
                top = t
        return n

    def _writable(self, ts: int) -> IndexFile:
        last = self.files[-1] if self.files else None
        if last is not None and not last.full and not (last.count > 1 and ts - last.begin_ts >= self.period_ms):
            if not (last.count > 1 and ts < last.end_ts - BACK_STEP_MS and self._may_roll_back(last, ts)):
                return last
        name = _file_name(self.clock())
        if last is not None and name <= last.name:
            name = f"{int(last.name) + 1:017d}"
        f = IndexFile.create(os.path.join(self.directory, name), self.slots, self.entries,
                             last.end_phy if last else 0, last.end_ts if last else 0, self.refuse_ratio, self.seg_size)
        # Once a file (this is the index thread): the progress saved later says its entries exist, and a file
        # whose name a power loss took would be skipped, not rebuilt, at the next start.
        fsync_dir(self.directory)
        if last is not None:
            last.release_slots()
            last.sync()
            last.park()
            log.info("index file %s %s; new file %s", last.name, "is read-only" if last.read_only else
                     "is full" if last.full else "ends its period", name)
        self.files.append(f)
        return f

    def _may_roll_back(self, last: IndexFile, ts: int) -> bool:
        """A record stored over BACK_STEP_MS before ``last``'s newest entry: a new file for it, unless one was started
        so less than back_roll_every_s ago (then its entry is kept in ``last``, out of time order, said once a
        minute)."""
        now = time.monotonic()
        if self._back_rolled is None or now - self._back_rolled >= self.back_roll_every_s:
            self._back_rolled = now
            log.warning("index: a record stored %.1f s before the newest entry of index file %s (the wall clock stepped "
                        "back): a new index file for it, so a query by key with a time window finds it at its store "
                        "time", (last.end_ts - ts) / 1000, last.name)
            return True
        if now - self._back_said >= _CUT_LOG_EVERY_S:
            self._back_said = now
            log.warning("index: a record stored %.1f s before the newest entry of index file %s: the wall clock stepped "
                        "back again within %.0f s of the last new file for that, so its entry is kept in that file out "
                        "of time order (taken as stored at the file's begin if before it): a query by key with a time "
                        "window may miss it or the key's entries stored before it (check NTP; said once a minute)",
                        (last.end_ts - ts) / 1000, last.name, self.back_roll_every_s)
        return False

    def _catch_up(self, hi: int) -> None:
        """One slice of the start-up catch-up; the rest goes to the back of the queue, behind the queries
        queued meanwhile. In one job, over months of segments (17 s), a key lookup at start waited past a
        client's timeout."""
        done = True
        try:
            done = self._closed or self.failed is not None or self._scan(self.covered, hi, CATCH_UP_SLICE)
            if done and self._failing and self.failed is None and not self._closed:    # a resume's, through
                # ... and its progress written: the failure may have been the progress file's, and a catch-up
                # with nothing to write proves no room. Said caught up before it, the next save failed again:
                # an ERROR and this WARNING every interval while the disk stayed full. Failing, it stays quiet.
                self._save_progress()
                self._failing = False
                log.warning("index: caught up with the commit log again after an error stopped it (to offset %d)",
                            self.covered)
            elif done and self._catch_up_from is not None and not self._closed and self.failed is None:
                start, began = self._catch_up_from
                self._catch_up_from = None
                if hi > start:      # queries by key were answered from a prefix until now (their remark said so)
                    log.info("index: caught up with the commit log (%d bytes from offset %d in %.1f s): queries by "
                             "key search every message again", hi - start, start, time.monotonic() - began)
        finally:
            if done:
                self._catching_up = False
                self._q.put(_WAKE)      # the records dispatched meanwhile
            else:
                self._q.put(lambda: self._catch_up(hi))

    def _scan(self, lo: int, hi: int, budget: int | None = None) -> bool:
        """Index the records in [lo, hi) straight from the segment files. With a budget, stops at the first
        record boundary ``budget`` bytes past ``lo``: returns whether it reached ``hi``."""
        items: list = []
        pos = lo
        while pos < hi:
            if budget is not None and pos - lo >= budget:
                self.covered = max(self.covered, pos)     # a record's start, or a segment's
                return False
            start = pos - pos % self.seg_size
            chunk = self._pread(start, pos - start, min(_CHUNK, hi - pos, start + self.seg_size - pos))
            if not chunk:
                pos = start + self.seg_size     # removed meanwhile, or nothing there
                continue
            at = 0
            while at + 8 <= len(chunk):
                size, magic = _SIZE_MAGIC.unpack_from(chunk, at)
                if magic == BLANK_MAGIC:
                    at = -1
                    break
                here = pos + at
                if (magic != MESSAGE_MAGIC or size < 91 or here + size > start + self.seg_size
                        or (at + 36 <= len(chunk) and _I64.unpack_from(chunk, at + 28)[0] != here)):
                    # A damaged record head. Stopping the scan here (once with only a WARNING) left every sound
                    # record after it out of the index; a size past the segment re-read it for ever. Go on
                    # from the next record that is where it says it is.
                    nxt = self._next_record(here, min(hi, start + self.seg_size))
                    log.error("index catch-up: commit log segment %020d byte %d holds no record (magic %#x, size %d)"
                              "; %s", start, here - start, magic & 0xFFFFFFFF, size,
                              f"{nxt - here} bytes passed over, indexing on from byte {nxt - start}"
                              if nxt is not None else "no record after it in this segment is indexed")
                    at = -1 if nxt is None else nxt - pos
                    break
                if at + size > len(chunk):
                    if at == 0:         # a record larger than the chunk
                        chunk = self._pread(start, pos - start, size)
                        if len(chunk) < size:   # the file ends inside it (below)
                            break
                    else:
                        break
                self._collect(items, chunk, at, pos + at)
                at += size
            if at == 0:
                # No record read from a chunk that is not empty: the file ends inside a record (cut short; every
                # segment is preallocated whole, and ends with an end marker). Read again from here for ever,
                # the index thread spinning and every query waiting.
                log.error("index catch-up: commit log segment %020d ends inside the record at byte %d; the rest "
                          "of the segment is not indexed", start, pos - start)
                at = -1
            if at < 0:          # an end marker, or damage with no record after it in the segment
                pos = start + self.seg_size
            else:
                pos += at
            self.covered = max(self.covered, min(pos, hi))
            self._flush(items)
        self.covered = max(self.covered, hi)
        return True

    def _next_record(self, bad: int, hi: int) -> int | None:
        """The first offset in (bad, hi) of the same segment where a record head says it lies there (MESSAGE
        magic, its PHYSICALOFFSET field = where it is); None if there is none."""
        start = bad - bad % self.seg_size
        at = bad + 1
        while at + 36 <= hi:
            chunk = self._pread(start, at - start, min(_CHUNK, hi - at))
            if len(chunk) < 36:
                return None
            find = chunk.find(MESSAGE_MAGIC_BYTES, 4)
            while find >= 0 and find + 32 <= len(chunk):
                cand = at + find - 4
                if _I64.unpack_from(chunk, find + 24)[0] == cand:
                    return cand
                find = chunk.find(MESSAGE_MAGIC_BYTES, find + 1)
            at += max(1, len(chunk) - 36)       # overlap: a head cut by the chunk's end is found in the next
        return None

    def _read(self, phy: int, size: int):
        start = phy - phy % self.seg_size
        return self._pread(start, phy - start, size)

    def _pread(self, start: int, pos: int, n: int) -> bytes:
        fds = self._fds
        fd = fds.get(start)
        if fd is None:
            try:
                fd = os.open(os.path.join(self.log_dir, f"{start:020d}"), os.O_RDONLY)
            except FileNotFoundError:
                return b""
            if len(fds) >= OPEN_SEGMENTS:
                os.close(fds.popitem(last=False)[1])
            fds[start] = fd
        else:
            fds.move_to_end(start)
        return os.pread(fd, n, pos)

    def _query(self, topic: str, key: str, max_num: int, begin: int, end: int) -> QueryResult:
        found: list[int] = []
        h = key_hash(f"{topic}#{key}")
        files = self.files
        checks, cut = self.max_checks, False
        budget = WalkBudget(self.max_reads)
        # The newest END TIMESTAMP of files[:i + 1]: after the clock stepped back, an older file may begin (and end)
        # after a newer one, and the walk reads on past a file that begins before the range while one may match.
        ends = list(itertools.accumulate((f.end_ts for f in files), max))
        for i in range(len(files) - 1, -1, -1):
            f = files[i]
            if len(found) >= max_num or cut or budget.cut:  # before the first file too: a maxNum of 0 asks for
                break                                       # nothing (RocketMQ)
            if f.count > 1 and f.time_matched(begin, end):
                if i < len(files) - 1:
                    self._reopened(f)
                for phy in f.walk(h, begin, end, budget):   # every entry of the hash, not a count of them: see walk
                    if checks <= 0:
                        cut = True
                        break
                    checks -= 1
                    if phy not in found and self._has_key(phy, topic, key, begin, end):
                        found.append(phy)
                        if len(found) >= max_num:
                            break
            if f.count > 1 and f.begin_ts < begin and (i == 0 or ends[i - 1] < begin):
                break
        cut = cut or budget.cut
        if cut:
            self._said_cut(topic, key, len(found))
        last = files[-1] if files else None
        return QueryResult(found, (last.end_ts if last else 0), (last.end_phy if last else 0), cut,
                           self.covered if self.partial else None)

    def _reopened(self, f: IndexFile) -> None:
        """An older file a query reads: opened again if parked, the last OPEN_INDEX_FILES queried kept open."""
        try:
            f.reopen()
        except OSError as exc:      # out of descriptors; removed under the broker (the next progress save rebuilds)
            what = ("the broker's open files are at its limit: raise it (ulimit -n, systemd LimitNOFILE)"
                    if exc.errno in (errno.EMFILE, errno.ENFILE) else
                    f"removed under the broker: the index is rebuilt from the commit log within "
                    f"{PROGRESS_EVERY_S:.0f} s; ask again" if exc.errno == errno.ENOENT else "ask again")
            raise StoreError(f"index file {f.name} could not be opened for this query: {exc} ({what})") from exc
        self._queried[f] = None
        self._queried.move_to_end(f)
        # Here, not at the query's end: a window of every file (a stock client's 0 to Long.MAX_VALUE, a dead-letter
        # lookup) held each older file open at once until then, thousands past an open-files limit of 1,024.
        while len(self._queried) > OPEN_INDEX_FILES:
            self._queried.popitem(last=False)[0].park()     # (not f: the newest in the list)

    def _said_cut(self, topic: str, key: str, found: int) -> None:
        self.queries_cut += 1
        now = time.monotonic()
        if now - self._cut_logged >= _CUT_LOG_EVERY_S:
            self._cut_logged = now
            log.warning("a query by key (topic %r, key %r) stopped after %d records of its hash or %d index "
                        "entries (other keys with the same String.hashCode or index slot), %d match(es) found: older "
                        "ones are not answered (%d such queries so far; said once a minute)", topic, key[:64],
                        self.max_checks, self.max_reads, found, self.queries_cut)

    def _has_key(self, phy: int, topic: str, key: str, begin: int, end: int) -> bool:
        """The record at ``phy`` is still there, really has the key (hashes collide) and was stored in [begin,
        end], both ends inclusive, by its own store time in milliseconds (an entry's time is in whole seconds, so
        the walk widens each to its second and the record decides)."""
        head = self._read(phy, 8)
        if len(head) < 8:
            return False
        size, magic = _SIZE_MAGIC.unpack(head)
        if magic != MESSAGE_MAGIC or size < 91:
            return False
        raw = self._read(phy, size)
        if len(raw) < size or _I64.unpack_from(raw, 28)[0] != phy:
            return False
        t, ts, _sf, uniq, keys = record_keys(raw, 0)
        return t == topic and begin <= ts <= end and (uniq == key or key in keys)

    def _expire(self, min_offset: int) -> list[str]:
        """Remove the files every entry of which points below ``min_offset``, after the ones earlier expiries could
        not unlink (``_expired_left``: EACCES, EPERM, EIO), tried again oldest first. Raises the first error of a
        failure run (said by ``expire``'s callback); the later ones of the run are quiet, the files tried again."""
        self._log_min = max(self._log_min, min_offset)
        gone, failed, retry, self._expired_left = [], None, self._expired_left, []
        for path in retry:
            try:
                os.unlink(path)
                gone.append(os.path.basename(path))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._expired_left.append(path)
                failed = failed or exc
        while len(self.files) > 1 and self.files[0].end_phy < min_offset:
            f = self.files.pop(0)
            self._queried.pop(f, None)
            try:
                f.remove()
                gone.append(f.name)
            except OSError as exc:      # out of the list all the same (closed): tried again at the next expiry
                self._expired_left.append(f.path)
                failed = failed or exc
        for start in [s for s in self._fds if s + self.seg_size <= min_offset]:
            os.close(self._fds.pop(start))
        gone = list(dict.fromkeys(gone))    # (a resume read a file left again: in the list and among them)
        if gone:
            log.info("removed index files %s: every entry points below the log's first offset %d", gone,
                     min_offset)
        if failed is None:
            self._expire_said = False     # (none left: every file went, the retried ones too)
        elif not self._expire_said:
            self._expire_said = True
            raise failed
        return gone


class QueryResult(NamedTuple):
    found: list[int]        # commit-log offsets of the matches, newest first
    last_ts: int            # the last file's END TIMESTAMP
    last_phy: int           # its END PHYOFFSET
    cut: bool               # MAX_QUERY_CHECKS records of the hash read and more left: older matches may be missed
    # The commit-log offset from which records were not searched, taken on the index thread with the answer: the
    # index catching up (a start, a resume after a full disk, a backlog) or stopped; None when it searched them all.
    behind: int | None = None


class IndexUnreadable(OSError):
    """An index file that could not be read (an I/O error, a permission): not damage, nothing removed."""

    def __str__(self) -> str:       # (OSError's "[Errno 5] <message>: '<path>'" broke the ERROR's sentence in two)
        return self.strerror


def _said_expire_error(fut: asyncio.Future, min_offset: int, directory: str) -> None:
    if fut.cancelled() or fut.exception() is None or isinstance(fut.exception(), StoreError):   # (closed: a stop)
        return
    log.error("index files whose entries all point below commit-log offset %d (the oldest of %s) not removed: %s; "
              "they take disk space and are tried again at each segment removal (said again once one leaves none): fix "
              "the error (permissions, a read-only file system) or remove them by hand", min_offset, directory,
              fut.exception())


def _begins_below(path: str, log_min: int) -> bool:
    """Whether the index file at ``path`` begins below commit-log offset ``log_min`` by its header (a file begins
    where the one before it ended: every entry of that one points at or below its begin): False when unread."""
    try:
        with open(path, "rb") as fh:
            raw = os.pread(fh.fileno(), HEADER.size, 0)
    except OSError:
        return False
    return len(raw) == HEADER.size and 0 <= HEADER.unpack(raw)[2] < log_min


def _exists(path: str) -> bool:
    """Whether ``path`` is there: False for ENOENT only (a file removed), any other error of stat raised."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    return True


def _file_name(ms: int) -> str:
    """UtilAll.timeMillisToHumanString: yyyyMMddHHmmssSSS, local time."""
    return time.strftime("%Y%m%d%H%M%S", time.localtime(ms / 1000)) + f"{ms % 1000:03d}"


def _settle(fut: asyncio.Future, value, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
