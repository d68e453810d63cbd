"""MessageStore: the storage facade of docs/design.md -- commit log, consume queues, checkpoint.

Threads: everything runs on the event loop except msync / fsync / unmap, which go to ONE
I/O thread in submission order (so a file queued for removal is never unmapped while an
earlier flush of it is pending), and segment creation and the zero-writing ahead of the
commit-log writer, on a second thread that only ever writes past the writer's reserved mark.

Disk: ``disk`` (a DiskMonitor) is probed every PROBE_INTERVAL_S; above its refuse ratio puts
are refused before they are queued, and they resume by themselves once it falls.

Consumer offsets live next door in offsets.py (ConsumerOffsets), persisted on their own.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import time
from functools import partial
from typing import Callable

from protocol.errors import CorruptRecordError, StoreError
from protocol.message import MESSAGE_MAGIC, peek_record, validate_topic
from protocol.record import MIN_RECORD_SIZE, body_crc_ok, record_intact, store_timestamp_at

from .checkpoint import (FILE_NAME as CHECKPOINT_FILE, QUEUES_FILE, Checkpoint, read_checkpoint, read_queue_list,
                         write_checkpoint, write_queue_list)
from .commit_log import CommitLog, Segment
from .config import StoreConfig
from .consume_queue import BLANK_SIZE, TOMBSTONE, UNIT, ConsumeQueue, make_first_file, read_tombstone, write_tombstone
from .disk import PROBE_INTERVAL_S, DiskMonitor
from .manifest import (CORRUPT_KEPT_FILE, MANIFEST_FILE, NUL_COPY_FILE, SegmentFacts, load_or_create_store_id,
                       read_corrupt_kept, read_nul_copy_from, read_nul_free_from, removed_from_disk, sealed_from_disk,
                       summarize_file, write_corrupt_kept, write_manifest, write_nul_copy_from, write_nul_free_from)
from .mapped_file import fsync_dir, fsync_dirs, keep_files, make_dirs, parse_name, remove_files
from .progress import Progress
from .recovery import recover
from .replica import parse_chunk
from .saved import retrieved, timed
from .results import DispatchInfo, GetResult, GetStatus, PutRequest, RecoveryReport, SegmentInfo
from .writer import IoThread, Writer

log = logging.getLogger("txmq.store")
REBUILD_FILE = "checkpoint.rebuild"     # the checkpoint, moved aside while consume queues are rebuilt from the log

_MIN_SCAN_UNITS = 800       # RocketMQ scans at least 16000 bytes of consume queue per pull
_GONE_NAMED = 8             # segments found gone at a start named each in the WARNING; more as a span
_CORRUPT_REMEMBERED = 4096  # corrupt records logged once each (a consumer retrying one must not flood the log)
_FOUND, _NO_MATCH, _REMOVING = GetStatus.FOUND, GetStatus.NO_MATCHED_MESSAGE, GetStatus.MESSAGE_WAS_REMOVING


def _default_clock() -> int:
    return time.time_ns() // 1_000_000


class MessageStore:
    def __init__(self, store_dir: str, config: StoreConfig | None = None, *,
                 clock: Callable[[], int] | None = None, tag_rule: Callable | None = None):
        self.store_dir = os.path.abspath(store_dir)
        # tag_rule(topic, properties, store ts) -> tagsCode | None: the consume-queue tag of a unit rebuilt
        # from the log when it is not the TAGS hash (a delayed message's delivery time; see PutRequest.delay_ms).
        self.tag_rule = tag_rule
        self.config = config or StoreConfig()
        self.clock = clock or _default_clock
        self._log = CommitLog(os.path.join(self.store_dir, "commitlog"), self.config, self.clock)
        self.disk = DiskMonitor(self.store_dir, self.config.disk_refuse_ratio)
        self._writer = Writer(self._log, self._on_commit, self.disk)
        self._writer.raise_nul_free_from = self._raise_nul_free_from
        self._writer.begin_nul_copy = self._begin_nul_copy
        # The hot path skips a call layer: put / put_many ARE the writer's (documented below).
        self.put = self._writer.put
        self.set_flush_observer = lambda fn: setattr(self._writer, "on_flush", fn)   # fn(seconds) per flush
        self.put_many = self._writer.put_many
        self._cq_root = os.path.join(self.store_dir, "consumequeue")
        self._cqs: dict[tuple[str, int], ConsumeQueue] = {}
        # Read only, for the send path's one lookup: the queues prepare_queue found with a file. A key not in it is
        # a new queue (or one the writer made whose file it could not open), for prepare_queue first, which adds it.
        self.queue_index: set[tuple[str, int]] = set()
        self._listeners: list[Callable[[DispatchInfo], None]] = []        # all: recovery replays reach each
        self._live: list[Callable[[DispatchInfo], None]] = []             # new records of any topic
        self._live_by_topic: dict[str, list[Callable[[DispatchInfo], None]]] = {}   # new records of one topic
        self._removal_listeners: list[Callable[[int], object]] = []   # fn(new min offset) after a removal
        self.queue_files_left: list[OSError] = []    # the last remove_segment's: a queue's files it could not unlink
        self._queue_leftovers: list[str] = []   # paths of queue files removals could not unlink, oldest first: each
        # removal tries them again (kept until a restart, every later removal's files of an immutable queue directory
        # made mutable again joined them); after the start, changed in place only by the removals' jobs on the flush
        # thread (_remove_runs), each after the one before
        self._landed_listeners: list[Callable[[str, int, int], None]] = []   # see add_landed_listener
        # fn(topic, queue id) when a new record makes a consume queue that did not exist (the server sets it:
        # a topic whose config a crash lost, committed into by a half or a scheduled message, is made again).
        self.on_new_queue: Callable[[str, int], object] | None = None
        # topic -> log offset it was deleted at (delete_topic's marks, read by open): recovery indexes none of
        # its records below it, which would bring a deleted topic back with its old messages.
        self._deleted: dict[str, int] = {}
        self._io: IoThread | None = None                    # msync, checkpoint, unmap: in order
        self._io_probe: tuple | None = None     # (a no-op's future on _io, when queued): io_stalled_s
        self._io2: IoThread | None = None                   # a second group commit's msync while one is in flight
        self._reserve_io: IoThread | None = None            # new segments, zeros ahead of the writer
        self._queue_io: IoThread | None = None              # new queues' first files (make_queue_file)
        # new queue -> the callers waiting for its first file, in the order they asked (make_queue_file)
        self._making: dict[tuple[str, int], list[Callable[[BaseException | None], object]]] = {}
        self._housekeeping: asyncio.Task | None = None
        self._disk_task: asyncio.Task | None = None
        self._backlogged: set = set()                       # consume queues with units waiting for space
        self._unmarked: set = set()     # damaged consume queues whose rebuild mark was refused (tried again)
        self._marking: dict = {}        # ...and those whose mark is being written (its future)
        self._dirs_to_sync: list[str] = []                  # new queue files' directories a failed checkpoint left
        self._ranges_to_retry: list = []                    # queue ranges a failed checkpoint took and did not flush
        self._last_checkpoint: Checkpoint | None = None
        # Where the checkpoint on disk vouches for the log up to: a start after a crash scans the log from there
        # (checkpoint_lag_bytes). A checkpoint that cannot be written (a full disk, an I/O error) lets it fall behind.
        self._checkpointed = 0
        self._rebuilding: str | None = None     # REBUILD_FILE while no checkpoint has followed the rebuild
        # The queue list (checkpoint.QUEUES_FILE): every queue, written before a checkpoint once the set changed;
        # a change bumps _queues_version (queues made or deleted), _listed_version is what the file on disk says.
        self._queues_version, self._listed_version = 1, 0
        self._lock_fd = -1
        self._state = "new"
        self.report: RecoveryReport | None = None
        self.store_id = ""                                  # manifest.py: written when the store is created
        self._facts: dict[str, SegmentFacts] = {}           # sealed segments, computed once from their bytes
        self._removed: SegmentFacts | None = None           # the newest segment removed (segments.json "removed")
        self._manifest_key: tuple | None = None             # what the manifest on disk describes
        # Records found failing their body CRC on a read, by reader (pull, commit, ...): each counted and logged
        # once (txmq_store_corrupt_records_total). Start-up verifies only the newest segments, so a bit flipped
        # in an older one is first met here.
        self.corrupt: dict[str, int] = {}
        self._check_below = 0       # pulls check the body CRC of records below this offset (set by open)
        # records from here on hold no NUL in topic or properties (set by open; before it, an older broker's)
        self._nul_free_from = 0
        self._written_from = (1 << 63) - 1
        self._corrupt_seen: set[tuple[int, str]] = set()
        # log offsets of damaged records kept in place (store file corrupt_kept): a master sends them to its
        # slave as they are; a slave takes one only when the master sent the same bytes twice (append_replica)
        self._kept: set[int] = set()
        self._kept_unsaved = False      # the corrupt_kept file lags ``_kept`` (a full disk): the disk loop retries
        self._kept_failing = False      # its last write was refused (said once per outage)
        self._refused_chunk: tuple[int, bytes] | None = None

    # ---------------------------------------------------------- lifecycle
    def add_dispatch_listener(self, fn: Callable[[DispatchInfo], None], *, live: bool = True,
                              topics: tuple[str, ...] | None = None) -> None:
        """fn(DispatchInfo) for every stored record; added before open() it also sees recovery replays.

        A listener that ignores new records (``live=False``: it wants only recovery replays) or all but
        those of some ``topics`` says so, and the store does not call it for the rest: a call per record
        and listener is a good part of a batched send's cost. Recovery replays reach every listener.
        """
        self._listeners.append(fn)
        if live and topics is None:
            self._live.append(fn)
        elif live:
            for topic in topics:
                self._live_by_topic.setdefault(topic, []).append(fn)
        self._log.dispatching = True

    def add_removal_listener(self, fn: Callable[[int], object]) -> None:
        """fn(min physical offset) after each segment removal (the index drops files with it)."""
        self._removal_listeners.append(fn)

    def add_landed_listener(self, fn: Callable[[str, int, int], None]) -> None:
        """fn(topic, queue id, its new max offset) when units that waited in memory (no disk space, no file for
        the queue yet) are written and become readable. Their records were dispatched when stored, before any
        reader could see them: a pull woken then found nothing, was parked again, and slept its whole suspend
        time (15 s and more) past the moment they landed."""
        self._landed_listeners.append(fn)

    def _retry_queue(self, cq: ConsumeQueue) -> bool:
        """``cq.retry()``, telling the landed listeners of the units it wrote (all, or some on a disk still full)."""
        before, had_file = cq.max_offset, bool(cq.files)
        try:
            return cq.retry()
        finally:
            if cq.files and not had_file:
                self._queues_version += 1   # listed once it has a file (_checkpoint)
            if cq.max_offset > before:
                for fn in self._landed_listeners:
                    try:
                        fn(cq.topic, cq.queue_id, cq.max_offset)
                    except Exception:
                        log.exception("landed listener %r failed on %s-%d", fn, cq.topic, cq.queue_id)

    async def open(self) -> RecoveryReport:
        if self._state != "new":
            raise StoreError(f"the store at {self.store_dir} was already opened")
        made = []
        for sub in ("commitlog", "consumequeue", "config"):
            made += make_dirs(os.path.join(self.store_dir, sub))
        if made:    # a new store: its directories must outlive a power loss before its first segment counts
            fsync_dirs([os.path.dirname(self.store_dir)] + made)
        self.disk.read_mounts()
        self.disk.probe()
        self._lock()
        try:
            checkpoint = read_checkpoint(self.store_dir)
            rebuilding = os.path.join(self.store_dir, REBUILD_FILE)
            # every queue, from the whole log (consumequeue/ removed): one begun that no checkpoint ended yet (a
            # refused start, a crash or power loss before it) is begun again
            rebuild = checkpoint is None and os.path.exists(rebuilding)
            if rebuild:
                checkpoint = read_checkpoint(self.store_dir, REBUILD_FILE)
                log.warning("consume queues: a rebuild from the whole log no checkpoint ended yet: begun again")
            elif os.path.exists(rebuilding):        # ended: the checkpoint written, the crash before its removal
                os.unlink(rebuilding)
            self._load_queues(None if checkpoint is None or rebuild else checkpoint.flushed_offset)
            if (not rebuild and checkpoint is not None and not self._cqs and not self._deleted
                    and self._first_segment_start() < checkpoint.flushed_offset):
                # consumequeue/ removed (RocketMQ's way to have them rebuilt, or a restore without it), or left holding
                # no queue and no deleted topic's mark (its topics' directories emptied, a stray file): scanned
                # from the checkpoint, only queues with a record past it came back, every other message unreachable
                log.warning("consumequeue/ holds no queue, but the checkpoint vouches for the log below offset %d: "
                            "every consume queue is rebuilt from the whole log (the checkpoint moved to %s until "
                            "the rebuilt queues are flushed)", checkpoint.flushed_offset, REBUILD_FILE)
                # The scan covers every segment; the checkpoint still rules it (below it there is no torn tail: a
                # log ending there is refused, not cut; dispatch listeners replay only past it, as their own files
                # are there) but is moved aside before the rebuild: until the first checkpoint after it
                # flushes the rebuilt queues and their new directories, a power loss could lose some of them while
                # the old one still vouched for the log below it (the next start scanned from it: lost for good).
                rebuild = True
                os.replace(os.path.join(self.store_dir, CHECKPOINT_FILE), rebuilding)
                fsync_dir(self.store_dir)
            elif not rebuild and checkpoint is not None:
                self._mark_missing_queues()
            if rebuild:
                self._rebuilding = rebuilding       # removed by the first checkpoint written after it
            # A store no NUL-refusing broker opened yet holds an older one's records, which may hold a NUL:
            # none of them is judged by that rule, only what is written from the end recovery finds.
            nul_free_from = read_nul_free_from(self.store_dir)
            copy_from = read_nul_copy_from(self.store_dir)      # a copy its mark never vouched for
            if copy_from is not None and checkpoint is not None and copy_from < checkpoint.flushed_offset:
                # Nothing at or past a copy not yet vouched for is flushed as far as the checkpoint knows (the
                # writer completes the copy's flush only once the mark is past it): a file a power loss brought
                # back after the start that cut there removed it, the log written on since. Cut there again, that
                # acknowledged, checkpointed log was lost without a word.
                copy_from = None
            known_corrupt = read_corrupt_kept(self.store_dir)
            self.report = recover(self._log, self._cqs, self._make_queue, checkpoint,
                                  (1 << 63) - 1 if rebuild else self.config.recovery_verify_segments,
                                  self.config.truncate_corrupt_tail,
                                  self._listeners, self.tag_rule,
                                  nul_free_from=(1 << 63) - 1 if nul_free_from is None else nul_free_from,
                                  deleted=self._deleted,
                                  cut_from=copy_from if nul_free_from is not None and copy_from is not None
                                  and copy_from >= nul_free_from else None,
                                  keep_corrupt=self.config.keep_corrupt_records, known_corrupt=known_corrupt)
            # files below the log's start this start could not unlink: the next segment removal tries them again
            self._queue_leftovers = [path for cq in self._cqs.values() for path in cq.leftovers]
            if rebuild:     # every queue came from the whole log: counted as one directory removed alone is
                self.report.queues_rebuilt = sorted(set(self.report.queues_rebuilt)
                                                    | {f"{t}-{q}" for t, q in self._cqs})
            kept = {int(t.segment) + t.position: t.length for t in self.report.corrupt_kept}
            # (only those still in the log: one a --truncate-corrupt-tail start cut the log below, left named,
            # had the sound record later written at its offset refused as corrupt, a COMMIT of it too)
            self._kept = set(kept) | {o for o in known_corrupt if self._log.min_offset <= o < self._log.readable}
            if self._kept != known_corrupt:
                # before anything is served past them: a restart without the flag must not refuse them again;
                # and the ones whose segments retention removed, or the log was cut below, leave the file.
                # A full disk does not stop the start (it starts, serves reads and refuses writes): the disk loop
                # writes it once there is room.
                self._kept_unsaved = True
                try:
                    write_corrupt_kept(self.store_dir, self._kept)      # (no I/O thread yet)
                except OSError as exc:
                    self._kept_written(exc)
                    if any(o >= self._log.readable for o in known_corrupt):
                        self._drop_stale_kept_file(known_corrupt)
                else:
                    self._kept_written()
            if os.path.exists(os.path.join(self.store_dir, NUL_COPY_FILE)):
                os.unlink(os.path.join(self.store_dir, NUL_COPY_FILE))     # (cut; or vouched for by the mark)
                # durable before anything is written where the log was cut: back after a power loss, it cut
                # there again at the next start, every record written there since with it
                fsync_dir(self.store_dir)
            if nul_free_from is None or nul_free_from > self.report.end_offset:
                # (past the end: left by an earlier version, which moved it before writing a copy or, on a slave,
                # its master's chunk, and crashed between; no record lies past the end, and those written there
                # next are this broker's)
                nul_free_from = self.report.end_offset
                write_nul_free_from(self.store_dir, nul_free_from)
            self._nul_free_from = nul_free_from
            self._written_from = self.report.end_offset     # what this process writes (verified_record)
            if checkpoint is not None and self.report.end_offset < checkpoint.flushed_offset:
                # truncate_corrupt_tail cut flushed data: the old checkpoint would have the next start refuse
                # the log again for the same loss. A rebuild's is checkpoint.rebuild, read again by a start
                # that follows a crash before the rebuild's first checkpoint: left above the cut, that start
                # and every later one were refused, "acknowledged messages are missing".
                write_checkpoint(self.store_dir, Checkpoint(self.report.end_offset, self._log.flushed_ts),
                                 REBUILD_FILE if rebuild else CHECKPOINT_FILE)
            self._checkpointed = (min(checkpoint.flushed_offset, self.report.end_offset)
                                  if checkpoint is not None and not rebuild else self._log.min_offset)
            self._settle_marks(self._log.min_offset, self.report.end_offset)
            self.store_id = load_or_create_store_id(self.store_dir)
            # Recovery verified every record from scanned_from on (CRC included); those before it never were.
            # (and every record up to the last damaged one kept in place: a pull must stop at it, not serve it)
            self._check_below = ((1 << 63) - 1 if self.config.verify_all_reads else
                                 max([self.report.scanned_from] + [o + n for o, n in kept.items()]))
        except BaseException:
            self._close_files()
            raise
        known = sealed_from_disk(self.store_dir)
        if not self.report.truncations:     # a cut segment is not what its old entry says
            sealed = {seg.name for seg in self._log.segments[:-1]}
            self._facts = {n: f for n, f in known.items() if n in sealed}
        removed = removed_from_disk(self.store_dir)
        first = self._log.segments[0].start if self._log.segments else None
        gone = self._gone_before(known, first)
        if gone:
            removed = gone[-1]
        # Only while it is the segment just before the log's first (a store wiped or copied is not it any more).
        self._removed = removed if (removed is not None and first is not None
                                    and removed.start < first == removed.start + self._log.seg_size) else None
        self._io = IoThread("txmq-flush")
        self._io2 = IoThread("txmq-flush-2") if self.config.flush == "sync" else None
        self._reserve_io = IoThread("txmq-reserve")
        self._queue_io = IoThread("txmq-queue-files")
        if self._log.reserver is not None:
            self._log.reserver.start(self._reserve_io)
            self._log.reserver.after_job = self.disk.probe     # reserving is what fills the disk
        self._writer.start(self._io, self._io2)
        loop = asyncio.get_running_loop()
        self._housekeeping = loop.create_task(self._checkpoint_loop(), name="txmq-store-checkpoint")
        self._disk_task = loop.create_task(self._disk_loop(), name="txmq-store-disk")
        self._state = "open"
        return self.report

    def _gone_before(self, known: dict[str, SegmentFacts], first: int | None) -> list[SegmentFacts]:
        """The segments the last run's manifest named before the log's first that are gone from disk, oldest first,
        said at WARNING and named in the report (``gone_segments``). A removal unlinks the file first and writes
        the manifest last: a kill between left the log starting one segment later, and the start took that
        without a word, as it did a segment removed by hand or missed by a copy, its messages gone, consumers
        behind it moved on, and the manifest's ``removed`` entry (the rollup's cut day) lost with it."""
        if first is None:
            return []
        gone = sorted((f for f in known.values() if f.start < first), key=lambda f: f.start)
        if gone:
            self.report.gone_segments = [f.name for f in gone]
            dated = [f for f in gone if f.first_ts >= 0]
            end = gone[-1].start + self._log.seg_size      # below ``first``: segments it did not name went too
            # Many (a copy that missed months of them) as a span: 3,900 names made one line of 86 KB, past what
            # journald keeps as one line (48 KiB); the report names each.
            names = ("commit-log segments " + ", ".join(f.name for f in gone) if len(gone) <= _GONE_NAMED
                     else f"{len(gone)} commit-log segments {gone[0].name}..{gone[-1].name}")
            log.warning("%s, named by the segment manifest, are gone from disk: the log now "
                        "starts at %d. %s records went with them%s%s: a removal (retention, disk pressure, an expiry "
                        "plan) that a crash cut short, or removed by hand or missed by a copy of the store. Their "
                        "messages are no longer served: consumers behind them go on from their queues' first "
                        "offsets (txmq_store_segments_removed_total{reason=\"gone\"})",
                        names, first, sum(max(f.records, 0) for f in gone),
                        f" (stored {min(f.first_ts for f in dated)}..{max(f.last_ts for f in dated)})" if dated else "",
                        f"; more went with the log from {end} to {first}, which the manifest did not name as sealed "
                        f"(a manifest older than the log: a copy taken segments.json first)" if end < first else "")
        return gone

    async def close(self) -> None:
        """Drain queued puts, flush, checkpoint, unmap."""
        if self._state != "open":
            return
        self._state = "closing"
        given_up = False
        try:
            await self._writer.close()
            for task in (self._housekeeping, self._disk_task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._retry_backlogs()
            self._retry_marks()     # once more; one still refused is said: the next start will not rebuild it
            if self._marking:
                await asyncio.wait(list(self._marking.values()))
            for cq in self._unmarked:
                log.error("consume queue %s-%d: stopped with its rebuild mark unwritten: the next start does not "
                          "rebuild it (its reads stop at the damage again); delete %s before it to have it rebuilt",
                          cq.topic, cq.queue_id, cq.directory)
            try:
                await self._checkpoint()
            except OSError as exc:
                log.error("final checkpoint failed: %s", exc)
            try:
                await self.refresh_manifest(force=True)
            except OSError as exc:
                log.error("final segment manifest not written: %s", exc)
        except asyncio.CancelledError:
            # Given up by a stop behind an I/O thread that hangs (server._stop_behind_the_log): joining it blocked the
            # loop for ever, past the stop's "stopped", and unmapping files it may still flush is unsafe. Left as
            # they are: the process ends with them, as a kill -9 would.
            given_up = True
            raise
        finally:        # whatever the last writes raised, the threads end and the files (and the lock) are released
            if not given_up:
                self._release()

    def _release(self) -> None:
        """End the I/O threads (each after its queued jobs) and close the files and the lock."""
        self._io.stop()
        if self._io2 is not None:
            self._io2.stop()
        self._reserve_io.stop()
        self._queue_io.stop()
        self._close_files()
        self._state = "closed"

    async def __aenter__(self) -> "MessageStore":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _lock(self) -> None:
        fd = os.open(os.path.join(self.store_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreError(f"the store at {self.store_dir} is in use by another process") from None
        self._lock_fd = fd

    def _close_files(self) -> None:
        if self._log.reserver is not None:
            self._log.reserver.close()
        for cq in self._cqs.values():
            cq.close()
        for seg in self._log.segments:
            seg.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _mark_missing_queues(self) -> None:
        """Queues the queue list names whose directory is gone, or holds no file (what a start refused over a
        damaged queue file advises; a restore that missed one), are marked for a rebuild from the whole log, as a
        queue a read found damaged: scanned from the checkpoint, one with no record past it came back empty, its
        messages unreachable, unsaid. (A deleted topic's queues are not missing, unless the list was written
        after its delete: the topic made again.)"""
        queues, marks = read_queue_list(self.store_dir) or ((), {})
        # A listed queue of a topic with a mark: gone with a delete the list does not know of (a kill before the
        # checkpoint after it), or the topic made again after a delete it does (its mark listed, as high): missing.
        missing = sorted(key for key in queues
                         if (key[0] not in self._deleted or marks.get(key[0], -1) >= self._deleted[key[0]])
                         and not (key in self._cqs and self._cqs[key].files))
        if not missing:
            return
        log.warning("consume queues %s (%d in all, named by %s) are missing from consumequeue/: rebuilt from the "
                    "whole log", ", ".join(f"{t}-{q}" for t, q in missing[:20]), len(missing), QUEUES_FILE)
        for key in missing:
            cq = self._cqs[key] if key in self._cqs else self._make_queue(key)
            try:
                fsync_dirs(make_dirs(cq.directory))
            except OSError as exc:      # (a full disk does not stop a start: left as it was, said)
                log.error("consume queue %s-%d: its directory cannot be made again (%s): not rebuilt at this start",
                          *key, exc)
                continue
            # marked on disk (fsynced) before anything is rebuilt: a crash before the rebuilt units are flushed
            # leaves the mark, and the next start rebuilds it again (recovery removes it once they are)
            cq.mark_missing()
            self._cqs[key] = cq
        self._queues_version += 1   # listed again after the rebuild: without those it found no record of

    def _first_segment_start(self) -> int:
        """The commit log's first segment's offset, from its files' names (before recovery loads them): the
        checkpoint vouches for records only from there (an empty slave rebased past 0 holds none below it). No
        segment at all: past any checkpoint (what recovery says of a log missing under one, not a rebuild)."""
        starts = [s for s in map(parse_name, os.listdir(os.path.join(self.store_dir, "commitlog"))) if s is not None]
        return min(starts, default=(1 << 63) - 1)

    def _load_queues(self, durable_below: int | None) -> None:
        size = self.config.cq_file_size
        log_start = self._first_segment_start()
        began = time.monotonic()
        topics = sorted(os.listdir(self._cq_root))
        progress = Progress("loading consume queues", len(topics), "topics")
        for done, topic in enumerate(topics):
            progress.step(done)
            tdir = os.path.join(self._cq_root, topic)
            if validate_topic(topic) is not None or not os.path.isdir(tdir):
                continue
            below = read_tombstone(tdir)
            if below is not None:
                self._deleted[topic] = below
            for qid in sorted(os.listdir(tdir)):
                if qid.isdigit():
                    cq = ConsumeQueue.load(os.path.join(tdir, qid), topic, int(qid), size, durable_below,
                                           log_start)
                    if below is not None and _left_by_delete(cq, below):
                        # a kill cut the delete short (mark written, queue files not all removed yet)
                        log.warning("consume queue %s-%s of the topic deleted at log offset %d: removed", topic,
                                    qid, below)
                        for mf in cq.files:
                            mf.remove()
                        shutil.rmtree(os.path.join(tdir, qid), ignore_errors=True)
                        continue
                    self._cqs[(topic, int(qid))] = cq
        log.info("loaded %d consume queues of %d topics in %.3f s", len(self._cqs), len(topics),
                 time.monotonic() - began)

    def _settle_marks(self, first: int, end: int) -> None:
        """Deleted topics' marks past the recovered log's end (its tail cut, or lost with the power before it was
        flushed) come down to it: records written from there on are a topic made again, which a mark above them
        hid from the next recovery. Marks at or below the log's first offset hide nothing any more and go (with
        their directory when it holds nothing else): kept, every topic ever deleted was read at each start."""
        self._forget_marks(_unlink_marks(self._cq_root, self._spent_marks(first), self._log.directory))
        for topic, below in list(self._deleted.items()):
            if below <= end:
                continue
            log.warning("deleted topic %s's mark at log offset %d is past the log's end %d: moved down to it",
                        topic, below, end)
            self._deleted[topic] = end
            try:
                write_tombstone(os.path.join(self._cq_root, topic), end)
            except OSError as exc:
                raise StoreError(f"deleted topic {topic}'s mark cannot be moved down to the log's end {end} "
                                 f"(records written after it would be hidden from the next recovery): {exc}")

    def _spent_marks(self, first: int) -> list[str]:
        """Deleted topics whose marks hide nothing any more: every record below them is gone from the log."""
        return [topic for topic, below in self._deleted.items() if below <= first]

    def _forget_marks(self, topics: list[str]) -> None:
        """Marks ``_unlink_marks`` removed: forgotten, with their directory when it holds nothing else. On the
        loop, where every queue but the queue-file thread's is made: a topic made again keeps its directory."""
        busy = {key[0] for key in self._cqs}.union(key[0] for key in self._making)
        for topic in topics:
            del self._deleted[topic]
            if topic not in busy:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(self._cq_root, topic))      # (only when empty)

    def _make_queue(self, key: tuple[str, int]) -> ConsumeQueue:
        topic, qid = key
        return ConsumeQueue(os.path.join(self._cq_root, topic, str(qid)), topic, qid, self.config.cq_file_size)

    def prepare_queue(self, topic: str, queue_id: int) -> None:
        """Make the consume queue (``topic``, ``queue_id``) and its first file now if it has none, raising the
        OSError when the file cannot be opened or mapped: EMFILE, ENFILE (open-files limits), ENOMEM
        (vm.max_map_count), ENOSPC. A send to a new queue is then refused with it before its record is written.
        Made by the writer (``_on_commit``) as before, such a failure left the units of records already
        acknowledged waiting in memory (logged as no space), unreadable by any consumer until a file could
        be opened. A slave's queue (its start offset comes from its master) is left to the writer."""
        key = (topic, queue_id)
        cq = self._cqs.get(key)
        if cq is not None and cq.files:
            self.queue_index.add(key)
            return
        if key in self._log.queue_starts:
            return
        if key in self._making:
            # its file is being made on the queue-file thread (make_queue_file): made here too, one of the two
            # would fail "File exists", said as if no file could be made
            raise OSError(errno.EAGAIN, f"consume queue {topic}-{queue_id}: its file is being made, try again")
        if cq is not None:
            # made by the writer, its file not: its units wait (backlog), written by the retry that makes it; or
            # loaded with none (a directory left empty by a failed open, or a crash, before a restart): made now
            if not self._retry_queue(cq):
                # A fresh error each time: raised, the one the queue keeps would take this caller's frames into its
                # traceback and keep them (a decision's records, an older NUL copy counted for the writer among
                # them) until the queue's next failure or its file.
                err = cq.last_error
                raise (OSError(err.errno, err.strerror, err.filename) if err is not None else
                       OSError(errno.EIO, f"consume queue {topic}-{queue_id} has no file"))
            if not cq.files:
                cq.open_file()
                self._queues_version += 1   # listed once it has a file (_checkpoint)
            self.queue_index.add(key)
            return
        cq = self._make_queue(key)
        cq.open_file()
        self._cqs[key] = cq
        self.queue_index.add(key)
        self._new_queue(key)

    def make_queue_file(self, topic: str, queue_id: int, then: Callable[[BaseException | None], object]) -> None:
        """``prepare_queue`` off the event loop: ``then(None)`` once the queue has its file, ``then(exc)`` with
        what stopped it (the OSError, as prepare_queue raises it). A new queue's first file is made on the
        store's queue-file thread: made on the loop, a burst of new queues (one client's 1,000 topics of 8)
        held every other connection 1-2 s at a time, each file waiting on the file system's journal.

        ``then`` runs on the loop, for the callers of one queue in the order they asked, all of them before the
        queue joins ``queue_index``: a send that finds it there puts its record after theirs, never ahead of
        a record sent before it. The rare queues prepare_queue has more to do for (one the writer made without
        its file, a slave's) are made at once, as there."""
        key = (topic, queue_id)
        waiting = self._making.get(key)
        if waiting is not None:
            waiting.append(then)
            return
        if self._queue_io is None or key in self._cqs or key in self._log.queue_starts:
            try:
                self.prepare_queue(topic, queue_id)
            except OSError as exc:
                then(exc)
                return
            then(None)
            return
        self._making[key] = [then]
        made = self._queue_io.submit(make_first_file, os.path.join(self._cq_root, topic, str(queue_id)),
                                     self.config.cq_file_size)
        made.add_done_callback(partial(self._queue_file_made, key))

    def making_queue_file(self, topic: str, queue_id: int) -> bool:
        """Whether the queue-file thread is making this queue's first file (prepare_queue would say EAGAIN):
        a caller that cannot wait in ``make_queue_file``'s order awaits ``queue_file`` instead."""
        return (topic, queue_id) in self._making

    def queue_file(self, topic: str, queue_id: int) -> asyncio.Future:
        """``make_queue_file`` as a future: None once the queue has its file, else the error it met."""
        fut = asyncio.get_running_loop().create_future()

        def then(exc):
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

        self.make_queue_file(topic, queue_id, then)
        return fut

    def _queue_file_made(self, key: tuple[str, int], made: asyncio.Future) -> None:
        waiting = self._making.pop(key)
        exc = made.exception()
        cq = self._cqs.get(key)
        if exc is None:
            if cq is None:
                cq = self._cqs[key] = self._make_queue(key)
                cq.adopt_first_file(made.result())
                self._new_queue(key)
            elif not cq.files:      # the writer made it meanwhile (a scheduled message), its file not: ours
                cq.adopt_first_file(made.result())
                self._queues_version += 1   # listed once it has a file (_checkpoint)
                if self._retry_queue(cq):
                    self._backlogged.discard(cq)
            else:                   # made meanwhile, file and all, on the loop: it cannot be ours (O_EXCL)
                made.result()[0].close()
        elif cq is not None and cq.files:   # EEXIST: the file made meanwhile on the loop is this queue's
            exc = None
        if exc is None:
            self.queue_index.add(key)
        for then in waiting:
            try:
                then(exc)
            except Exception:
                log.exception("new queue %s: a caller waiting for its file failed", key)

    def _new_queue(self, key: tuple[str, int]) -> None:
        self._queues_version += 1       # the queue list is written again before the next checkpoint
        if self.on_new_queue is not None:
            try:
                self.on_new_queue(*key)
            except Exception:
                log.exception("new queue listener failed on %s", key)

    def _on_commit(self, units: list, infos: list) -> None:
        """Records just became readable: index them, then tell the listeners."""
        cqs = self._cqs
        restarts = self._log.queue_restarts
        for key, packed in units.items():
            cq = cqs.get(key)
            if restarts and cq is not None and key in restarts:
                self._restart_queue(cq, restarts.pop(key))
            if cq is None:
                cq = cqs[key] = self._make_queue(key)
                cq.begin_at(self._log.queue_starts.pop(key, 0))
                self._new_queue(key)
            if not cq.extend(packed):       # no space: the units wait in memory (see consume_queue.py)
                self._backlogged.add(cq)
        live, by_topic = self._live, self._live_by_topic
        for info in infos:
            for fn in live:
                try:
                    fn(info)
                except Exception:
                    log.exception("dispatch listener %r failed on %s", fn, info)
            if by_topic:
                fns = by_topic.get(info.topic)
                if fns is not None:
                    for fn in fns:
                        try:
                            fn(info)
                        except Exception:
                            log.exception("dispatch listener %r failed on %s", fn, info)

    def _restart_queue(self, cq: ConsumeQueue, qoff: int) -> None:
        """(Slave) the master's queue starts again at ``qoff`` (commit_log._queue_went_back): the units from there
        go, as the master's went with its delete, and the copied records' units follow from ``qoff``."""
        dropped = cq.truncate(qoff)
        if not cq.files:        # every file was past ``qoff`` (retention took those below): begun as a new queue
            cq.begin_at(qoff)
        log.warning("consume queue %s-%d: the master numbered a copied record %d, below this queue's end: the "
                    "topic was deleted and made again there; %d units from %d on dropped, the queue goes on "
                    "as the master's", cq.topic, cq.queue_id, qoff, dropped, qoff)

    async def _checkpoint_loop(self) -> None:
        failing = {"checkpoint": False, "segment manifest": False}     # log once per outage, not each turn
        while True:
            await asyncio.sleep(self.config.checkpoint_interval_ms / 1000)
            for what, step in (("checkpoint", self._checkpoint), ("segment manifest", self.refresh_manifest)):
                try:
                    await step()
                except Exception as exc:  # noqa: BLE001 - a bug too: ending the loop would stop every later one
                    if not failing[what]:
                        log.error("%s not written (retrying every %d ms): %s", what,
                                  self.config.checkpoint_interval_ms, exc, exc_info=not isinstance(exc, OSError))
                    failing[what] = True
                    continue
                if failing[what]:
                    log.warning("%s written again", what)
                    failing[what] = False

    async def _disk_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                if self.disk.mounts_due():      # off the loop: ~10 ms of CPU on a host of 10k mounts
                    await asyncio.to_thread(self.disk.read_mounts)
                self.disk.probe()
                self._retry_backlogs()
                self._retry_marks()
                if self._kept_unsaved:
                    await self._save_kept()
            except Exception:  # noqa: BLE001 - ending here would leave backlogged units (and the checkpoint) stuck
                log.exception("disk check failed; trying again in %.1f s", PROBE_INTERVAL_S)

    def _retry_backlogs(self) -> None:
        if self._backlogged:
            self._backlogged = {cq for cq in self._backlogged if not self._retry_queue(cq)}

    async def _checkpoint(self) -> None:
        if self._backlogged:        # units below the flushed offset are not all in their queues yet
            return
        point = Checkpoint(self._log.flushed, self._log.flushed_ts)
        # Every queue, listed before the checkpoint vouches for their units: only once the set changed (a queue made,
        # a topic deleted, which may come with no new record)
        version = self._queues_version
        if point == self._last_checkpoint and version == self._listed_version:
            return
        # (a queue with no file is not listed: one a start rebuilt from the whole log and found no record of, its
        # records all gone with retention, listed was taken for a removed directory, and rebuilt, at every start)
        listed = (([k for k, cq in self._cqs.items() if cq.files], dict(self._deleted))
                  if version != self._listed_version else None)
        # Every unit of a record below ``point`` is in its queue now; flush them, then say so.
        # (with those a failed checkpoint took: their marks have moved on, and no later range covers them)
        ranges, self._ranges_to_retry = self._ranges_to_retry, []
        ranges += [r for cq in self._cqs.values() for r in cq.dirty_ranges()]
        # ...and the directory entries of queue files made since the last one (one fsync per new file or
        # directory, none per unit): a file whose name was lost at a power loss would take its units with it.
        if self._kept_unsaved:
            # corrupt_kept first: no checkpoint passes a kept record the file does not name (a kill -9 before
            # the disk loop's turn): a start without the flag would not keep it again
            await self._save_kept()
            if self._kept_unsaved:
                self._ranges_to_retry = _coalesce(ranges + self._ranges_to_retry)
                raise OSError(f"waits for {CORRUPT_KEPT_FILE}, not written")
        dirs, self._dirs_to_sync = self._dirs_to_sync, []
        for cq in self._cqs.values():
            if cq.unsynced:
                dirs += cq.take_unsynced()
        try:
            await self._io.submit(timed, CHECKPOINT_FILE, _checkpoint_job, ranges, self.store_dir, point, dirs,
                                  self._rebuilding, listed)
        except BaseException:
            self._dirs_to_sync = dirs + self._dirs_to_sync
            # One range per file, whatever the number of failures: kept as they came, a checkpoint that kept
            # failing (a bad block under one queue file) added every active queue's range each turn, so memory
            # and the msyncs each attempt makes grew for as long as it failed. Flushing more is harmless.
            self._ranges_to_retry = _coalesce(ranges + self._ranges_to_retry)
            raise
        self._last_checkpoint, self._rebuilding, self._listed_version = point, None, version
        self._checkpointed = point.flushed_offset

    @property
    def checkpoint_lag(self) -> int:
        """Bytes of flushed log past the checkpoint on disk: what a start after a crash scans (and verifies)
        again. Grows while checkpoints fail (logged at ERROR once per outage) or wait for queue units a full disk
        holds in memory; a checkpoint written brings it back to about one checkpoint interval's writes. Not below
        the log's start: a slave's log rebased where its master's starts, or one retention trimmed past a checkpoint
        that kept failing, was counted from where no segment is any more (a false TxmqCheckpointBehind)."""
        return max(0, self._log.flushed - max(self._checkpointed, self._log.min_offset))

    # ---------------------------------------------------------- writes
    def put(self, req: PutRequest, then=None) -> "asyncio.Future":
        """Queue one record; await the returned future for its PutResult (or see Writer.put's ``then``)."""
        return self._writer.put(req, then=then)

    def put_many(self, reqs: list[PutRequest], reclaim: bool = False, then=None) -> "asyncio.Future":
        """Queue records to be written back to back in one batch and flushed together.

        All or none are accepted (MESSAGE_ILLEGAL for all if any is illegal); they land in one
        segment unless together they are larger than a segment. ``reclaim``: written to free space
        (see Writer.put), so not refused by the disk watermark.
        """
        return self._writer.put_many(reqs, reclaim, then)

    # ---------------------------------------------------------- replication (replica.py)
    def set_replica_only(self) -> None:
        """Make this a slave's store: puts are refused, only ``append_replica`` writes."""
        self._writer.replica_only = True

    def append_replica(self, phys: int, data) -> tuple["asyncio.Future", int]:
        """(Slave) check and queue a chunk of the master's log for ``phys``: (future, log end after it).
        The future's PutResult is PUT_OK once the bytes are on disk (sync flush) and indexed.
        ValueError at once for a malformed chunk.

        A record failing only its body CRC that the master sends again, byte for byte, after this slave refused
        it is the master's own (a record its start kept in place, keep_corrupt_records), not a damaged transfer:
        it is taken, remembered in corrupt_kept (a restart keeps it) and, as on the master, a pull stops at it."""
        try:
            chunk = parse_chunk(phys, data, self._log.seg_size, self.tag_rule)
        except ValueError:
            again = self._refused_chunk == (phys, bytes(data))
            self._refused_chunk = (phys, bytes(data))
            if not again:
                raise
            chunk = parse_chunk(phys, data, self._log.seg_size, self.tag_rule, check_crc=False)
            if len(chunk.records) != 1:
                raise
            rec = chunk.records[0]
            size = rec.size
            if validate_topic(rec.topic) is not None:
                # its TOPIC damaged (outside the CRC): filed, as by its master's start, under the queue of its id
                # that misses exactly its offset; under the damaged name its own queue here was one short
                owners = [t for (t, q), cq in self._cqs.items() if q == rec.queue_id and t != rec.topic
                          and cq.max_offset == rec.queue_offset]
                if len(owners) == 1:
                    chunk.records[0] = rec._replace(topic=owners[0])
            log.error("the master sent the record at log offset %d (%d bytes), which fails its body CRC, twice the "
                      "same: it is the master's damaged record kept in place (keep_corrupt_records), copied as it "
                      "is; lost, not served (a pull stops at it, as on the master)", phys, size)
            self._kept.add(phys)
            # Named before the record is in the log: its bytes outlive a kill -9 at once, and a start finding it
            # below the checkpoint unnamed refused to start ("commit log damaged ... a valid record follows"). (Two
            # fsyncs on the loop, once per record a master kept: rare.) Refused (a full disk), the copy goes on
            # (the OSError dropped the link: the master sent the record again, refused again, the slave copying
            # nothing); the disk loop writes it once there is room (txmq_store_corrupt_kept_unwritten meanwhile).
            try:
                write_corrupt_kept(self.store_dir, {o for o in self._kept if o >= self._log.min_offset})
            except OSError as exc:
                self._kept_unsaved = True
                self._kept_written(exc)
            self._check_below = max(self._check_below, phys + size)
        self._refused_chunk = None
        if chunk.nul_end > self._nul_free_from:
            # The master's records are not this broker's to refuse: one an older txmq (or RocketMQ) master
            # stored with a NUL in its properties (or a copy of one) must not read as torn here (cut at the next
            # start, refused on reads). The writer moves the mark past it as for a copy (Writer._vouch_first):
            # written here, on the loop, before the chunk was queued, it blocked the loop on an fsync and passed
            # this slave's chunks not yet flushed, which a crash could then leave torn and kept.
            chunk.older_nul = True
        return self._writer.put_replica(chunk), chunk.end

    def copying(self, phys: int, req: PutRequest) -> PutRequest:
        """``req`` (returned) copies the record at ``phys`` to the log's end: a commit, a scheduled delivery, a
        retry or a dead letter. Every path that copies a record says so here before it puts ``req``.

        An older broker's record (before nul_free_from) may hold a NUL in a property value, which the copy
        carries; past the mark that NUL reads as a torn page (cut by the next start after a crash, with every
        record after it, and refused by reads). Such a copy is marked for the writer, which writes it alone and
        flushed, then moves nul_free_from past it, fsynced, before it is readable or acknowledged
        (Writer._vouch_first): rare, upgrades only. The copy's own bytes
        are what is judged (its body CRC is fresh, so record_intact fails only on a NUL or a bad tail), and
        only for records before the mark: a copy of this broker's records costs one comparison."""
        if phys < self._nul_free_from and not record_intact(req.record, 0, len(req.record)):
            req.older_nul = True
            self._writer.nul_copies[id(req)] = req
        return req

    async def _begin_nul_copy(self, start: int) -> None:
        """(Writer) on disk: a copy of an older NUL record is written from ``start``, not yet vouched for."""
        await self._io.submit(write_nul_copy_from, self.store_dir, start)

    async def _raise_nul_free_from(self, end: int) -> None:
        """(Writer) nul_free_from at least ``end``, on disk; it never goes back while the store is open."""
        if end <= self._nul_free_from:
            return
        await self._io.submit(write_nul_free_from, self.store_dir, end)
        self._nul_free_from = end
        log.warning("a record with a NUL in its properties (an older broker's, a copy of one, or on a slave its "
                    "master's) ends at %d; NUL checks of this store start after it", end)

    def replica_chunk(self, phys: int, limit: int) -> memoryview | None:
        """(Master) readable bytes at ``phys`` for a slave: whole records up to ``limit`` bytes (at least
        one) or an end marker; None when nothing is readable there yet.

        Records start-up did not verify have their body CRC checked: a chunk stops before a corrupt one, and
        CorruptRecordError (counted, logged) when it starts at it. Sent on, the slave refused it with only a
        WARNING on its side, and reconnected for ever; the damage is this master's disk, said here."""
        chunk = self._log.read_chunk(phys, limit)
        if chunk is None or phys >= self._check_below or len(chunk) == 8:      # (8 bytes: an end marker)
            return chunk
        if phys in self._kept:      # a damaged record kept in place: the slave's log is this log, it included
            return chunk[:int.from_bytes(chunk[0:4], "big")]
        pos, n = 0, len(chunk)
        while pos < n:
            size = int.from_bytes(chunk[pos:pos + 4], "big")
            if pos and phys + pos in self._kept:    # sent alone (above): one whose TOPIC alone is damaged is intact
                return chunk[:pos]
            if not self._intact(chunk, pos, size, phys + pos):
                if pos == 0:
                    chunk.release()
                    raise self.corrupt_record(phys, "replication")
                return chunk[:pos]
            pos += size
        return chunk

    def log_bytes(self, phys: int, n: int) -> bytes | None:
        """A copy of the log's bytes [phys, phys + n) if they are readable and in one segment (a slave compares
        its own with its master's copy, ha/slave.py)."""
        return self._log.bytes_at(phys, n)

    @property
    def segment_size(self) -> int:
        return self._log.seg_size

    def last_indexed_record(self) -> int | None:
        """The start of the newest record of the readable log a consume queue points at; None if there is none.
        (A slave's log ends with it unless records without a unit -- old-style PREPARED ones -- follow.)"""
        clog = self._log
        best = None
        for cq in self._cqs.values():
            if cq.max_offset <= cq.min_offset:
                continue
            unit = cq.unit(cq.max_offset - 1)
            if unit is None or not unit[1]:
                continue
            phys, size, _tag = unit
            if (best is None or phys > best) and clog.min_offset <= phys and clog.slice(phys, size) is not None:
                best = phys
        return best

    @property
    def is_empty(self) -> bool:
        """Nothing was ever written (a new slave may then start its log where its master's starts)."""
        clog = self._log
        return len(clog.segments) == 1 and clog.segments[0].start == 0 and clog.written == 0

    async def rebase_empty(self, start: int) -> None:
        """(Empty store) begin the log at segment offset ``start``: a new slave whose master's log was
        trimmed by retention. The new segment is made on the I/O thread, swapped in by the writer.

        The empty segment's file is unlinked before the new one is made: a crash in between leaves no
        segment (the store starts empty at 0 and is rebased again), never both, which recovery refuses
        as a log with segments missing from the middle."""
        if start % self._log.seg_size:
            raise ValueError(f"offset {start} is not the start of a segment")
        if start == 0 or not self.is_empty:
            return

        async def op():
            if self._log.reserver is not None and self._log.reserver.idle is not None:
                await self._log.reserver.idle
            if not self.is_empty:
                raise AssertionError("only an empty log can be rebased")
            await self._io.submit(os.unlink, self._log.segments[0].path)
            new = await self._reserve_io.submit(self._log.make_segment, start)
            old = self._log.rebase(new)
            failed = await self._io.submit(remove_files, [old])
            if failed is not None:
                raise failed

        await self._writer.control(op)
        log.warning("empty store: the log now starts at offset %d, where the master's does", start)

    @property
    def writable(self) -> bool:
        return self._state == "open" and self._log.failed is None

    @property
    def failure(self) -> str | None:
        """Why the store stopped accepting writes, if it did."""
        return self._log.failed

    def refusal(self, why: str) -> str:
        """A refused write's remark once the store stopped (``failure``), or ``why`` a write met a read-only file
        system (EROFS) before the log did."""
        return self._log.refusal(why)

    def stopped_by(self, exc: OSError) -> bool:
        """Whether a write's OSError (a new queue's file not made) is the store's stop, not the broker's limits:
        its file system turned read-only (EROFS, maybe before the log met it), or the log failed. Answered as
        every write then is (SERVICE_NOT_AVAILABLE, ``refusal``), not as the open-files limit (SYSTEM_ERROR
        "create mapped file failed", counted queue-file-failed, whose advice, raise ulimit -n, is wrong)."""
        return exc.errno == errno.EROFS or self.failure is not None

    @property
    def min_physical_offset(self) -> int:
        return self._log.min_offset

    @property
    def kept_corrupt(self) -> int:
        """Damaged records kept in place (corrupt_kept) still in the log: each a lost message a pull of its queue
        stops at. Counted from the remembered set, not from what this start's scan met (a record in a segment
        older than the ones recovery verifies is kept again unseen); a removed segment's leave it."""
        return len(self._kept)

    @property
    def kept_unwritten(self) -> bool:
        """The corrupt_kept file lags the records kept in place, its write refused (a full disk):
        txmq_store_corrupt_kept_unwritten. (Not while a rewrite is merely under way.)"""
        return self._kept_unsaved and self._kept_failing

    async def _forget_kept_before(self, low: int) -> None:
        """The kept records of removed segments leave the set and the corrupt_kept file (off the loop): counted
        as kept for as long as the broker ran, the file holding them for good."""
        gone = {o for o in self._kept if o < low}
        if not gone:
            return
        self._kept -= gone
        self._kept_unsaved = True
        await self._save_kept()

    async def _save_kept(self) -> None:
        """Off the loop: the corrupt_kept file brought up to ``_kept``; refused (a full disk), the disk loop retries."""
        kept = set(self._kept)      # (taken on the loop)
        try:
            await self._io.submit(write_corrupt_kept, self.store_dir, kept)
        except OSError as exc:
            self._kept_written(exc)
        else:
            self._kept_written()
            if self._kept != kept:  # one kept (a slave's copy) while it was written: the next turn writes it
                self._kept_unsaved = True

    def _drop_stale_kept_file(self, known: frozenset[int]) -> None:
        """The corrupt_kept file names an offset at or past the log's end (a start cut the log below a kept
        record) and cannot be rewritten (a full disk): the next record is written there, sound, as soon as a write
        finds room, before the disk loop's next turn rewrites the file, and a kill -9 between had the next start
        keep that acknowledged record as damaged. The file goes (a removal needs no room): a start before it is
        written again refuses the records kept in place (and names them), as for a record kept since."""
        path = os.path.join(self.store_dir, CORRUPT_KEPT_FILE)
        try:
            os.unlink(path)
            fsync_dir(self.store_dir)
        except OSError as exc:
            raise StoreError(f"{path} names log offsets at or past the log's end "
                             f"({sorted(o for o in known if o >= self._log.readable)}), where the next records "
                             f"go, and can be neither rewritten nor removed: {exc}") from exc
        log.error("%s removed: it named log offsets at or past the log's end (%s), where the next records go, and "
                  "the disk has no room to rewrite it", path, sorted(o for o in known if o >= self._log.readable))

    def _kept_written(self, exc: OSError | None = None) -> None:
        """After a write of the corrupt_kept file, refused with ``exc`` or not: said once per outage. Unwritten, a
        record kept in place since is refused again by a start without keep_corrupt_records (which says so and
        where); one of a removed segment is left named, harmless (a start drops what is below the log)."""
        path = os.path.join(self.store_dir, CORRUPT_KEPT_FILE)
        if exc is not None:
            if not self._kept_failing:
                log.error("%s not written (retried as the disk has room; until it is, a start without "
                          "keep_corrupt_records refuses the damaged records kept in place again): %s", path, exc)
            self._kept_failing = True
            return
        if self._kept_failing:
            log.warning("%s written again", path)
        self._kept_unsaved = self._kept_failing = False

    @property
    def max_physical_offset(self) -> int:
        """End of the readable log."""
        return self._log.readable

    @property
    def flushed_offset(self) -> int:
        return self._log.flushed

    # ---------------------------------------------------------- reads
    def get_record(self, physical_offset: int) -> memoryview | None:
        """The record at ``physical_offset`` as it lies (magic, size and offset field checked, not its CRC)."""
        return self._log.record(physical_offset)

    def _intact(self, buf, pos: int, size: int, phys: int) -> bool:
        """record_intact for a record at ``phys``; before nul_free_from (an older broker's, which may have stored
        a NUL in its properties) its body CRC only."""
        return (record_intact if phys >= self._nul_free_from else body_crc_ok)(buf, pos, size)

    def verified_record(self, physical_offset: int, reader: str) -> memoryview | None:
        """``get_record``, its body CRC checked too, and its topic and properties for zeroed bytes
        (record_intact): what a read that copies or serves a record must use. CorruptRecordError (counted and
        logged once, under ``reader``) when it fails.

        Before nul_free_from a NUL in the properties is an older broker's data and is served; a read that
        copies the record to the log's end passes its copy through ``copying``, which has nul_free_from moved
        past it first.

        A record this process wrote, past nul_free_from (its properties were refused a NUL when sent), has its
        body CRC checked only, also for a copy: a COMMIT's read of a half sent since start-up costs what it did
        before the NUL scan, which such a record fails only by damage at rest in the running broker's own pages,
        which its pulls are not guarded against either. A record from before start-up is scanned as ever: the
        crash recovery cuts torn records only past the checkpoint, so one zeroed before it reaches the reads."""
        view = self._log.record(physical_offset)
        if view is None:
            return None
        if physical_offset >= self._written_from and physical_offset >= self._nul_free_from:
            ok = body_crc_ok(view, 0, len(view))
        else:
            ok = self._intact(view, 0, len(view), physical_offset)
        if not ok or physical_offset in self._kept:
            raise self.corrupt_record(physical_offset, reader)
        return view

    def corrupt_record(self, phys: int, reader: str) -> CorruptRecordError:
        """Count and log (once per record and reader) a record whose body fails its CRC; the error to raise."""
        seg = f"{phys - phys % self._log.seg_size:020d}"
        err = CorruptRecordError(phys, segment=seg, position=phys % self._log.seg_size)
        if self.count_corrupt(phys, reader):
            log.error("%s: %s; not served or copied", reader, err)
        return err

    def count_corrupt(self, phys: int, reader: str) -> bool:
        """Count a damaged record met by ``reader`` (txmq_store_corrupt_records_total), once per record and
        reader; True the first time (the caller logs it then)."""
        key = (phys, reader)
        if key in self._corrupt_seen:
            return False
        if len(self._corrupt_seen) < _CORRUPT_REMEMBERED:
            self._corrupt_seen.add(key)
        self.corrupt[reader] = self.corrupt.get(reader, 0) + 1
        return True

    def get_messages(self, topic: str, queue_id: int, offset: int, max_count: int, max_bytes: int,
                     tag_filter: Callable[[int], bool] | None = None,
                     record_filter: Callable[[memoryview], bool | None] | None = None, verify: bool = True) -> GetResult:
        """Up to ``max_count`` records (``max_bytes``) of a queue from ``offset``, as slices of the log: those whose
        tag code passes ``tag_filter`` and then, read from the log, whose record passes ``record_filter``
        (RocketMQ's isMatchedByConsumeQueue and isMatchedByCommitLog); a unit either filter refuses is passed
        over, as a NO_MATCHED_MESSAGE when nothing was found. ``record_filter`` answering None (it has done all
        it may in one read) ends the read before that record, with what was found.

        ``verify``: the body CRC of each record start-up did not verify is checked (all of them with
        ``verify_all_reads``; about 0.7 us for 1 KiB); a read stops before a record that fails it, and one that
        starts at it is RECORD_CORRUPT (counted and logged): a damaged message is never served as if sound, nor
        skipped without a word (nor judged by a filter). Only readers that take no body (the transaction index's
        scans of its own topics) pass False."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None:
            return GetResult(GetStatus.NO_MATCHED_LOGIC_QUEUE, 0, 0, 0)
        lo, hi = cq.min_offset, cq.max_offset
        if hi == 0:
            return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, 0, lo, hi)
        if offset < lo:
            return GetResult(GetStatus.OFFSET_TOO_SMALL, lo, lo, hi)
        if offset == hi:
            return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, offset, lo, hi)
        if offset > hi:
            return GetResult(GetStatus.OFFSET_OVERFLOW_BADLY, hi, lo, hi)
        # Never more units than max_bytes of records could fill: a filtered pull asking for 2**31-1 messages
        # scanned a whole consume-queue file on the loop, every other client waiting.
        raw = cq.read(offset, max(_MIN_SCAN_UNITS, min(max_count, max_bytes // MIN_RECORD_SIZE + 1)))
        if raw is None:
            return GetResult(GetStatus.OFFSET_FOUND_NULL, cq.next_file_offset(offset), lo, hi)
        status = _NO_MATCH
        buffers: list[memoryview] = []
        total = scanned = 0
        skip_below = -1
        clog = self._log
        crc_ok, check_below, nul_from = record_intact, self._check_below if verify else -1, self._nul_free_from
        kept = self._kept       # damaged records kept in place: one whose TOPIC alone is damaged passes its CRC
        for phys, size, tag in UNIT.iter_unpack(raw):
            if not size:        # a zeroed unit (a lost page, a damaged file): its message must not be skipped
                if not buffers:
                    self._damaged(cq, offset + scanned)
                    return GetResult(GetStatus.QUEUE_DAMAGED, offset + scanned, lo, hi)
                break
            if phys < skip_below:
                scanned += 1
                continue
            if buffers and (len(buffers) >= max_count or total + size > max_bytes):
                break
            scanned += 1
            if tag_filter is not None and not tag_filter(tag):
                if not buffers:
                    status = _NO_MATCH
                continue
            view = clog.slice(phys, size)
            if view is None:
                if size == BLANK_SIZE:      # pre-blank: a record no longer in the log; just this one unit
                    if not buffers:
                        status = _REMOVING
                    continue
                if not clog.removed(phys):
                    # Its segment was not removed, yet no such record is there: the unit or the record's head
                    # is damaged. Skipping the rest of the segment (as for a removed one) dropped every
                    # intact message after it without a word; stop here instead, like a zeroed unit.
                    if not buffers:
                        self._damaged(cq, offset + scanned - 1, f"unit ({phys}, {size}) names no record in the "
                                      "commit log (the unit or the record's head is damaged)")
                        return GetResult(GetStatus.QUEUE_DAMAGED, offset + scanned - 1, lo, hi)
                    scanned -= 1
                    break
                if not buffers:
                    status = _REMOVING
                skip_below = phys - phys % clog.seg_size + clog.seg_size     # the rest of that segment
                continue
            if phys < check_below and ((kept and phys in kept) or
                                       not (crc_ok if phys >= nul_from else body_crc_ok)(view, 0, size)):
                if not buffers:
                    self.corrupt_record(phys, "pull")
                    return GetResult(GetStatus.RECORD_CORRUPT, offset + scanned - 1, lo, hi)
                scanned -= 1            # the next read starts at it, and says so
                break
            if record_filter is not None:
                matched = record_filter(view)
                if not matched:
                    if matched is None:
                        scanned -= 1
                        break
                    if not buffers:
                        status = _NO_MATCH
                    continue
            buffers.append(view)
            total += size
            status = _FOUND
        return GetResult(status, offset + scanned, lo, hi, buffers)

    def queue_unit(self, topic: str, queue_id: int, offset: int) -> tuple[int, int, int] | None:
        """(commit-log offset, size, tagsCode) of the unit at a queue offset; None outside the queue."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None or not cq.min_offset <= offset < cq.max_offset:
            return None
        return self._real_unit(cq, offset)

    def record_before(self, topic: str, queue_id: int, phys: int) -> int | None:
        """Commit-log offset of the queue's last record stored before ``phys``; None when it has none there."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None:
            return None
        at = cq.first_unit_at_or_after(phys) - 1
        unit = self._real_unit(cq, at) if at >= cq.min_offset else None
        return None if unit is None else unit[0]

    def _damaged(self, cq: ConsumeQueue, offset: int, what: str = "zeroed unit") -> None:
        if cq.mark_damaged(offset, what) and self._io is not None:
            self._mark(cq)

    def _mark(self, cq: ConsumeQueue) -> None:
        """Write ``cq``'s rebuild mark on the I/O thread; one refused is tried again by the disk loop."""
        def done(fut) -> None:
            self._marking.pop(cq, None)
            if fut.cancelled() or fut.exception() is not None or not fut.result():   # it logs its own failure
                self._unmarked.add(cq)
        fut = self._marking[cq] = self._io.submit(cq.write_damage_mark)
        fut.add_done_callback(done)

    def _retry_marks(self) -> None:
        for cq in self._unmarked - self._marking.keys():
            self._unmarked.discard(cq)
            # A queue deleted meanwhile (its topic) wants no mark: tried again, it failed for the broker's life,
            # or landed in the directory of a queue of the same name made since, rebuilt at the next start.
            if self._cqs.get((cq.topic, cq.queue_id)) is cq:
                self._mark(cq)

    def _real_unit(self, cq: ConsumeQueue, offset: int) -> tuple[int, int, int] | None:
        """``cq.unit(offset)``, or None for a zeroed unit (marked damaged): (0, 0, 0) read as a unit would name
        the log's first record, which a scheduled delivery would then copy to the wrong topic."""
        unit = cq.unit(offset)
        if unit is not None and not unit[1]:
            self._damaged(cq, offset)
            return None
        return unit

    def flush_age_s(self) -> float:
        """How long the oldest commit-log flush in flight has run (0.0: none; Writer.flush_age_s)."""
        return self._writer.flush_age_s()

    def slowest_flush_s(self) -> float:
        """The longest a commit-log flush has taken and returned in the last 5 minutes (Writer.slowest_flush_s): a
        stop waits twice that for one in flight before saying the disk hung (server._stop_behind_the_log)."""
        return self._writer.slowest_flush_s()

    def io_stalled_s(self) -> float:
        """How long a no-op has waited on the store's I/O thread behind the jobs queued before it (0.0 once it came
        through, and then the next is queued). For a stop (server._stop_behind_the_log): it waited for ever behind a
        write that hangs there with no flush in flight (the transactions' snapshot, store.run_io). Not the hot path:
        called once a second, at most one no-op queued at a time."""
        probe = self._io_probe
        if probe is not None and not probe[0].done():
            return time.monotonic() - probe[1]
        if self._io is not None:
            fut = self._io.submit(_no_op)
            fut.add_done_callback(retrieved)    # (a stopped thread fails it: nothing to say)
            self._io_probe = (fut, time.monotonic())
        return 0.0

    def damaged_queues(self) -> dict[tuple[str, int], int]:
        """(topic, queue id) -> queue offset of the zeroed unit a read met; rebuilt at the next start."""
        return {key: cq.damage for key, cq in self._cqs.items() if cq.damage is not None}

    def queues(self) -> list[tuple[str, int]]:
        """Every (topic, queue id) with a consume queue."""
        return list(self._cqs)

    def max_offset(self, topic: str, queue_id: int) -> int:
        cq = self._cqs.get((topic, queue_id))
        return cq.max_offset if cq is not None else 0

    def min_offset(self, topic: str, queue_id: int) -> int:
        cq = self._cqs.get((topic, queue_id))
        return cq.min_offset if cq is not None else 0

    def queue_bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        """(min_offset, max_offset) in one look-up: the gauges ask it of every consumer offset each second."""
        cq = self._cqs.get((topic, queue_id))
        return (cq.min_offset, cq.max_offset) if cq is not None else (0, 0)

    def queue_units(self, topic: str, queue_id: int, index: int, count: int) -> list[tuple[int, int, int]] | None:
        """Up to ``count`` raw units (commit-log offset, size, tag code) from ``index``, as stored: a zeroed unit
        too (mqadmin queryCq is how one is looked at); none when ``index`` is outside the queue (it numbers the
        units it prints from ``index``). None when the queue does not exist."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None:
            return None
        units = []
        if index < cq.min_offset:
            return units
        for offset in range(index, min(index + count, cq.max_offset)):
            unit = cq.unit(offset)
            if unit is None:
                break
            units.append(unit)
        return units

    def _store_time_at(self, cq: ConsumeQueue, offset: int) -> int | None:
        unit = self._real_unit(cq, offset)
        view = self._log.record(unit[0]) if unit is not None else None
        if view is None:
            return None
        return store_timestamp_at(view, 0)

    def store_time_of(self, topic: str, queue_id: int, offset: int) -> int:
        """Store time of the message at a queue offset, -1 when there is none (getMessageStoreTimeStamp)."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None or not cq.min_offset <= offset < cq.max_offset:
            return -1
        ts = self._store_time_at(cq, offset)
        return -1 if ts is None else ts

    async def delete_topic(self, topic: str, forget: Callable[[], object] | None = None,
                           unmarked: Callable[[str], object] | None = None, written_from: int | None = None) -> int:
        """Remove every consume queue of ``topic`` (its records stay in the log until retention);
        returns how many queues went. A topic of the same name later starts again at offset 0.

        ``forget``: called between writer batches, with the queues: the topic's config goes there (a record
        accepted before the delete and written after its config went opened a queue, and on_new_queue made the
        topic again; its queues then went, the config stayed). ``unmarked``: called with the reason when the
        deleted topic's mark could not be written (the delete stands until a restart, which may index the
        topic's records again): for the reply to say so, where the log alone said it.
        ``written_from``: (slave) nothing is deleted, -1 returned, when a queue of the topic holds a record at or
        past this log offset (checked between writer batches, with the delete): its master's table, asked for
        when the log ended there, cannot know the topic was made again since."""
        if self._state != "open":
            raise StoreError("the store is not open")
        gone: list[ConsumeQueue] = []

        kept = False

        async def op():
            nonlocal kept
            keys = [k for k in self._cqs if k[0] == topic]
            if written_from is not None:
                for key in keys:
                    cq = self._cqs[key]
                    last = cq.unit(cq.max_offset - 1) if cq.max_offset > cq.min_offset else None
                    if last is not None and last[0] >= written_from:
                        kept = True
                        return
            if forget is not None:
                forget()
            for key in keys:
                cq = self._cqs.pop(key)
                self._queues_version += 1
                self.queue_index.discard(key)
                self._backlogged.discard(cq)
                self._log.qoffsets.pop(key, None)
                gone.append(cq)
            directory = os.path.join(self._cq_root, topic)
            # No queue, no record of it to hide (a mark per name asked for filled the disk) -- unless an earlier
            # delete of it could not write its mark and left its directory: asked again, as that reply said to,
            # the mark is written now (found no queue, it answered SUCCESS, and a restart served the topic again).
            if not gone and not await self._io.submit(_unmarked_directory, directory):
                return
            # Every record of the topic lies below the readable end now (this runs between writer batches).
            below = self._log.readable
            why = await self._io.submit(_remove_queue_files, gone, directory, below)
            if why is None:     # removed once retention has removed every record below it (remove_segment)
                self._deleted[topic] = below
                self._queues_version += 1       # the list names the marks too (a topic made again after it)
            elif unmarked is not None:
                unmarked(why)

        # A new queue of the topic whose first file the queue-file thread is making: the sends waiting for it
        # were accepted before this delete. Its file first, their records queued with it, then the delete takes
        # the queue with them. Not waited for, the delete removed the directory under the thread (the sends
        # refused ENOENT), or the file, made first, was adopted after the delete: a live queue of a deleted topic.
        for key in [k for k in self._making if k[0] == topic]:
            try:
                await self.queue_file(*key)
            except OSError:
                pass                # no file, no queue: nothing of it to delete
        await self._writer.control(op)
        if kept:
            return -1
        try:        # recovery must not bring the queues back from records before this point
            await self._checkpoint()
        except OSError as exc:
            log.error("checkpoint after deleting topic %s failed: %s", topic, exc)
        return len(gone)

    def earliest_message_time(self) -> int:
        """Store time of the commit log's first record, -1 when there is none (RocketMQ's getEarliestMessageTime:
        one record read, whatever the number of queues)."""
        view = self._log.record(self._log.min_offset)
        return -1 if view is None else store_timestamp_at(view, 0)

    def earliest_store_time(self, topic: str, queue_id: int) -> int:
        """Store time of the message at the queue's min offset; -1 if there is none."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None or cq.min_offset >= cq.max_offset:
            return -1
        ts = self._store_time_at(cq, cq.min_offset)
        return -1 if ts is None else ts

    def search_offset_by_time(self, topic: str, queue_id: int, timestamp: int) -> int:
        """Spec 3.13: the first offset stored exactly at ``timestamp``, else the one closest in time
        (the earlier on a tie); an empty queue's end (0 for one never written)."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None:
            return 0
        if cq.min_offset >= cq.max_offset:
            # Emptied by retention: not 0, below its start, which a reset by time committed (its whole length
            # shown as lag) and a consumer starting from a time pulled only to be moved.
            return cq.max_offset
        first, last = cq.min_offset, cq.max_offset - 1
        lo, hi = first, last + 1
        while lo < hi:                      # lower bound: first offset with store time >= timestamp
            mid = (lo + hi) // 2
            ts = self._store_time_at(cq, mid)
            if ts is not None and ts >= timestamp:
                hi = mid
            else:
                lo = mid + 1
        right_ts = self._store_time_at(cq, lo) if lo <= last else None
        if right_ts == timestamp:
            return lo
        left_ts = self._store_time_at(cq, lo - 1) if lo - 1 >= first else None
        if left_ts is None:
            return lo if right_ts is not None else 0
        if right_ts is None:
            return lo - 1
        return lo if timestamp - left_ts > right_ts - timestamp else lo - 1

    # ---------------------------------------------------------- retention
    def run_io(self, fn, *args) -> "asyncio.Future":
        """Run ``fn(*args)`` on the store's I/O thread, after the flushes queued before it."""
        if self._io is None:
            raise StoreError(f"the store at {self.store_dir} is not open")
        return self._io.submit(fn, *args)

    def segments(self) -> list[SegmentInfo]:
        segs = self._log.segments
        out = []
        for seg in segs:
            sealed = seg is not segs[-1]
            if sealed and seg.written < 0:
                _summarize(seg)
            out.append(SegmentInfo(seg.name, seg.path, seg.start, seg.size, max(seg.written, 0), seg.first_ts,
                                   seg.last_ts, sealed))
        return out

    def storage_bytes(self) -> int:
        """Bytes of commit-log segments, without summarising anything (safe for gauges)."""
        return sum(seg.size for seg in self._log.segments)

    def queue_offset_at(self, topic: str, queue_id: int, phys: int) -> int | None:
        """The queue offset whose unit points at the record at commit-log offset ``phys`` (a binary search of the
        queue), or None when none does: the queue's own word, where the record's QUEUEOFFSET is outside its CRC."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None:
            return None
        at = cq.first_unit_at_or_after(phys)
        unit = self._real_unit(cq, at) if at < cq.max_offset else None
        return at if unit is not None and unit[0] == phys else None

    def physical_offset_of(self, topic: str, queue_id: int, offset: int) -> int | None:
        """Commit-log offset of the message at a queue offset (None past the end or before the start)."""
        cq = self._cqs.get((topic, queue_id))
        unit = self._real_unit(cq, offset) if cq is not None and cq.min_offset <= offset < cq.max_offset else None
        return None if unit is None else unit[0]

    async def segment_facts(self) -> list[SegmentFacts]:
        """Every segment, oldest first: sealed ones as read from their bytes, the active one as of now."""
        segs = self._log.segments
        missing = [(seg.name, seg.path, seg.start) for seg in segs[:-1] if seg.name not in self._facts]
        if missing:
            # A walk over a 1 GiB segment's headers takes about a second: never on the event loop.
            found = await asyncio.get_running_loop().run_in_executor(None, _summarize_files, missing)
            self._facts.update(found)
        segs, clog = self._log.segments, self._log
        out = [self._facts[seg.name] for seg in segs[:-1] if seg.name in self._facts]
        if segs:
            act = segs[-1]
            out.append(SegmentFacts(act.name, act.start, clog.written, -1, act.first_ts,
                                    clog.last_ts if act.first_ts >= 0 else -1, False))
        return out

    async def refresh_manifest(self, force: bool = False) -> None:
        """Rewrite segments.json when the set of segments changed (a roll or a removal)."""
        if self._state not in ("open", "closing"):
            return
        segs = self._log.segments
        key = (tuple(seg.name for seg in segs), segs[-1].first_ts if segs else -1)
        if key == self._manifest_key and not force:
            return
        facts = await self.segment_facts()
        await self._io.submit(timed, MANIFEST_FILE, write_manifest, self.store_dir, self.store_id, self.clock(), facts,
                              self._removed)
        self._manifest_key = key

    async def remove_segment(self, name: str, reason: str = "") -> SegmentFacts:
        """Delete the oldest segment (never the active one), through the writer so no append races it.

        Returns what the segment held (its manifest entry); the manifest is rewritten after.
        """
        if self._state != "open":
            raise StoreError("the store is not open", segment=name)
        clog = self._log
        facts = {f.name: f for f in await self.segment_facts()}

        async def op():
            segs = clog.segments
            if len(segs) < 2 or segs[0].name != name:
                why = "the active segment" if segs and segs[-1].name == name else "not the oldest segment"
                raise StoreError(f"cannot remove segment {name}: {why} (oldest is "
                                 f"{segs[0].name if segs else None})", segment=name)
            if segs[0].start + clog.seg_size > clog.flushed:
                raise StoreError(f"cannot remove segment {name}: not flushed yet", segment=name)
            if clog.reserver is not None and clog.reserver.idle is not None:
                await clog.reserver.idle    # no reserve job may still hold the file
            # Its file unlinked first, the log untouched until it is: one that cannot be (EACCES, EIO, EROFS)
            # was taken out of the running log all the same, its records unreadable and its space not freed, so the
            # next pass took the next segment the same way (the whole log but the active segment, one a pass)
            # (one already gone, an operator's rm to free space, is removed as MappedFile.remove always let it be)
            # On the reserve thread, idle now: queued on the first flush thread behind a checkpoint's fsyncs (a slow
            # or hung disk), this unlink held the writer, so every put, for as long as the checkpoint took.
            await self._reserve_io.submit(_unlink_if_there, segs[0].path)
            dead = [[clog.release_oldest()]] + [cq.expire_before(clog.min_offset) for cq in self._cqs.values()]
            # A queue file that cannot be unlinked (an immutable directory, EIO) is out of its queue already: the
            # removal goes on (its queue's minimum is past it; the next removal tries it again, as does a start).
            # Raised, it left the message index, the manifest, the log line and the count undone, the files after
            # it mapped. Unmapped after the checkpoints queued before (their msyncs of these queue files), awaited
            # outside the writer: puts go on while it waits behind them. (The kept records' file and the spent
            # marks, rare, are still written in it, after.)
            removing.append(self._io.submit(_remove_runs, [run for run in dead if run], self._queue_leftovers))
            await self._forget_kept_before(clog.min_offset)
            # Deleted topics' marks hiding nothing now go too: kept until a restart, a broker that ran for months
            # kept a directory and a file for every topic ever deleted (and its next start read them all).
            spent = self._spent_marks(clog.min_offset)
            if spent:
                self._forget_marks(await self._io.submit(_unlink_marks, self._cq_root, spent, clog.directory))
            f = facts.get(name)
            log.warning("removed segment %s (%s; %s records, store times %s..%s); the log now starts at %d",
                        name, reason or "asked", f.records if f else "?", f.first_ts if f else "?",
                        f.last_ts if f else "?", clog.min_offset)

        removing: list[asyncio.Future] = []
        try:
            await self._writer.control(op)
        finally:
            if removing:
                self.queue_files_left = await removing[0]
        for fn in self._removal_listeners:
            try:
                fn(clog.min_offset)
            except Exception:
                log.exception("removal listener %r failed", fn)
        self._facts.pop(name, None)
        if facts.get(name) is not None:
            self._removed = facts[name]
        try:
            await self.refresh_manifest()
        except OSError as exc:
            log.error("segment manifest not written (retried at the next checkpoint): %s", exc)
        return facts.get(name)


def _coalesce(ranges) -> list:
    """(file, lo, hi) ranges merged into one per file, [lowest lo, highest hi); files since removed dropped."""
    merged: dict[int, list] = {}
    for mf, lo, hi in ranges:
        if mf.mm is None:                   # removed (topic deleted, queue truncated): nothing left to flush
            continue
        seen = merged.get(id(mf))
        if seen is None:
            merged[id(mf)] = [mf, lo, hi]
        else:
            seen[1], seen[2] = min(seen[1], lo), max(seen[2], hi)
    return [tuple(r) for r in merged.values()]


def _checkpoint_job(ranges, store_dir: str, point: Checkpoint, dirs: list[str] = (),
                    rebuilt: str | None = None, queues: tuple | None = None) -> None:
    for mf, lo, hi in ranges:
        mf.flush(lo, hi)
    for path in dict.fromkeys(dirs):        # once each, parents first (the order they were made in)
        try:
            fsync_dir(path)
        except FileNotFoundError:           # its topic was deleted meanwhile: nothing there to keep
            pass
    if queues is not None:
        write_queue_list(store_dir, *queues)
    write_checkpoint(store_dir, point)
    if rebuilt is not None:     # the queues a whole-log rebuild made are flushed: the next start is a usual one
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rebuilt)


def _unlink_marks(cq_root: str, topics: list[str], log_dir: str) -> list[str]:
    """Remove these deleted topics' marks; returns those removed (or gone already). One that cannot be is said
    and kept, tried again at the next removal or start. The log's directory is synced first: the segments'
    removals that spent the marks outlast a power loss before the marks' do (else a segment back with no mark
    over it had its deleted topic's records indexed again by the next start)."""
    if not topics:
        return []
    try:
        fsync_dir(log_dir)
    except OSError as exc:
        log.warning("%d deleted topics' spent marks kept: the log's directory not synced: %s", len(topics), exc)
        return []
    done = []
    for topic in topics:
        try:
            os.unlink(os.path.join(cq_root, topic, TOMBSTONE))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("deleted topic %s's spent mark not removed: %s", topic, exc)
            continue
        done.append(topic)
    return done


def _remove_queue_files(queues, directory: str, deleted_below: int) -> str | None:
    """None, or why the deleted topic's mark was not written (the queues go all the same)."""
    # The mark first: a kill before it left the queues gone and no mark, and recovery indexed the topic again;
    # queue files a kill leaves beside it are removed by the next open (_left_by_delete).
    try:
        write_tombstone(directory, deleted_below)
        unmarked = None
    except OSError as exc:      # the delete stands; written after the queue files went, below, if it can be
        unmarked = exc
    for cq in queues:
        for mf in cq.files:
            mf.remove()
        cq.files = []
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    for name in names:
        if name != TOMBSTONE:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    if unmarked is None:
        return None
    # A full disk refused the mark; the queue files just removed freed room for it. Not tried again, the next
    # restart indexed the topic's records again and served it, old messages and all, on a disk that was fine.
    try:
        write_tombstone(directory, deleted_below)
    except OSError as exc:
        log.error("deleted topic's mark not written in %s (%s, then %s): a restart may index the topic's records "
                  "below log offset %d again and serve it (delete it again then)", directory, unmarked, exc,
                  deleted_below)
        return f"{unmarked}, then {exc}"
    log.warning("deleted topic's mark written in %s once its queue files were removed (at first: %s)",
                directory, unmarked)
    return None


def _unmarked_directory(directory: str) -> bool:
    """A topic's queue directory without its deleted mark: left so by a delete whose mark was not written."""
    return os.path.isdir(directory) and not os.path.exists(os.path.join(directory, TOMBSTONE))


def _left_by_delete(cq: ConsumeQueue, below: int) -> bool:
    """Whether ``cq``, loaded beside a deleted topic's mark at log offset ``below``, is what a delete cut short
    left: no file, or units below the mark (a topic made again writes only above it)."""
    if not cq.files:
        return True
    last = cq.unit(cq.max_offset - 1) if cq.max_offset > cq.min_offset else None
    return last is not None and last[0] < below


def _summarize_files(items) -> dict[str, SegmentFacts]:
    out = {}
    for name, path, start in items:
        try:
            end, n, first, last = summarize_file(path, start)
        except FileNotFoundError:       # removed meanwhile: it has no facts any more
            continue
        out[name] = SegmentFacts(name, start, end, n, first, last, True)
    return out


def _unlink_if_there(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_runs(runs, leftovers: list[str]) -> list[OSError]:
    """remove_files of each run (a queue's files), after the earlier removals' ``leftovers`` are tried again (oldest
    first; in a directory, the ones after a refused one wait with it, and so do the runs of that directory: no gap).
    Returns the errors of the runs that could not all be unlinked; ``leftovers`` becomes the paths still left on
    disk, in place, here on the flush thread: a removal's job sees the one before it's (two removals at once, the
    second's writer op ran before the first's job: handed the list from before it and assigned on the loop after it,
    the first's refused file was dropped until a restart and the second's file of that queue unlinked behind it)."""
    left, refused = [], {}
    for path in leftovers:
        where = os.path.dirname(path)
        if where not in refused:
            try:
                os.unlink(path)
                continue
            except FileNotFoundError:
                continue
            except OSError as exc:
                refused[where] = exc
        left.append(path)
    errors = []
    for run in runs:
        exc = refused.get(os.path.dirname(run[0].path))
        if exc is not None:     # a leftover there refused again: these wait behind it (the queue's error, counted)
            errors.append(exc)
            left += keep_files(run)
            continue
        exc = remove_files(run)
        if exc is not None:
            errors.append(exc)
            left += [mf.path for mf in run if os.path.exists(mf.path)]
    leftovers[:] = left
    return errors


def _summarize(seg: Segment) -> None:
    """Oldest/last store time and data length of a sealed segment, by hopping over record headers."""
    pos, first, last = 0, -1, -1
    limit = seg.size - 8
    while pos + MIN_RECORD_SIZE <= limit:
        size, magic = peek_record(seg.mm, pos)
        if magic != MESSAGE_MAGIC or size < MIN_RECORD_SIZE or pos + size > limit:
            break
        last = store_timestamp_at(seg.mm, pos)
        if first < 0 or last < first:       # the oldest, as Segment.first_ts
            first = last
        pos += size
    seg.first_ts, seg.last_ts, seg.written = first, last, pos


def _no_op() -> None:
    return None
