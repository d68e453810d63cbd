"""ScheduleService: delivers delayed and timer messages to their real topics when due.

One coroutine on the event loop. Each turn it looks at the head of every level's queue
in SCHEDULE_TOPIC_XXXX (a level's messages share one delay, so they fall due in queue
order, and the head's consume-queue tagsCode is its delivery time) and at the in-memory
heap of timer messages (rmq_sys_wheel_timer, rebuilt from its consume queue at start),
takes what is due (at most BATCH_MESSAGES / BATCH_BYTES), and writes the delivered copies
(RocketMQ's messageTimeup: real topic and queue, DELAY removed, a new record) plus one
progress record in a single all-or-none ``put_many`` (see progress.py). Only when that
put succeeds does it move on; when the store refuses (a full disk) it waits and tries
the same messages again, so nothing is lost or delivered twice. Between turns it
sleeps until the next delivery time, at most MAX_SLEEP_S, and a new waiting message
that is due sooner wakes it.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import os
import time

from protocol.codes import SysFlag
from protocol.connection import wait_within
from protocol.errors import CorruptRecordError, ProtocolError
from protocol.message import (TIMER_PROPS, Prop, decode_record, encode_record, pack_host, properties_to_string,
                              tags_code, validate_topic)
from protocol.record import store_timestamp_at

from ..limits import EveryKey
from ..store import PutRequest
from ..store.results import PutStatus
from ..store.saved import retrieved
from ..topics import HALF_TOPIC, readable_queue
from .levels import SCHEDULE_TOPIC, TIMER_TOPIC, DelayLevels
from .progress import (MASTER_COPY_NAME, PROGRESS_TOPIC, SNAPSHOT_NAME, Progress, decode_progress, encode_progress,
                       drop_master_copy, load_snapshot, read_master_copy, write_snapshot)

# Dropped from a delivered copy: forwarded with its properties, a relative ask (DELAY, TIMER_DELAY_*) would wait
# again. Aliyun's __STARTDELIVERTIME stays, as RocketMQ 4.9.8 and Aliyun keep it: ali-ons' getStartDeliverTime()
# read 0 on a message that waited for it, and an absolute time gone by asks nothing of a forward.
_ASKS_DROPPED = tuple(key for key in TIMER_PROPS if key != Prop.START_DELIVER_TIME)

log = logging.getLogger("txmq.schedule")

BATCH_MESSAGES = 256
BATCH_BYTES = 4 * 1024 * 1024
MAX_SLEEP_S = 1.0
REFUSED_RETRY_S = 1.0           # the disk monitor probes once a second
SNAPSHOT_INTERVAL_S = 10.0      # RocketMQ's flushDelayOffsetInterval
STOP_WRITE_WAIT_S = 2.0         # what a stop waits for delayOffset.json's write (then given up: replayed from the log)
LATE_MS = 1000
LOST_PER_BATCH = 4096           # removed timers passed over in one progress record (about 8 bytes each)
# Timer queue offsets a turn looks at for removed timers, and moves the delivered-timer floor over (each a few
# ms of the loop): a removed segment of timers held millions (one undelivered timer holding the floor back).
SCAN_PER_TURN = 65536
REMOVED_SCAN_PER_TURN = 1 << 22     # ... looked over for removed timers (a chunk of 4,096 at a time: 1,024 chunks)


class ScheduleService:
    def __init__(self, ctx, levels: DelayLevels):
        self.ctx = ctx
        self.levels = levels
        self.progress = Progress()
        # (due by the monotonic clock, timer queue offset, commit-log offset): see _due
        self._timers: list[tuple[int, int, int]] = []
        self._timers_indexed = 0                            # timer queue offsets below this are in the heap or done
        self._wake = asyncio.Event()
        self._sleep_until: int | None = None    # the loop's wake-up time by the monotonic clock, while it sleeps
        self._task: asyncio.Task | None = None
        self._snap_task: asyncio.Task | None = None
        self._progress_end = 0          # commit-log end of the last progress record applied
        self._snapshot_key = None
        self.write_hung = False         # a delayOffset.json write has run past STOP_WRITE_WAIT_S, not ended yet
        self._writing: asyncio.Future | None = None     # the delayOffset.json write under way (one at a time)
        self._drops: dict[str, int] = {}    # reason -> entries the batch being gathered passes over
        self._requeued: dict[str, list[int]] = {}   # topic -> [messages, queues it reads]: see _readable_queue
        self._requeue_said = EveryKey(float("inf"), max_keys=4096)     # "topic\0queues it reads" said at WARNING
        self._removed: list[tuple[str, int]] = []   # (which, how many): waiting ones it moves past, removed
        self._timers_min_seen = 0       # timer queue offsets below it that retention removed are accounted for
        self._timers_min_next = 0
        self._more = False              # a bounded step (SCAN_PER_TURN) left work for the next turn, at once
        self._lost: list[int] = []      # timer queue offsets the batch being gathered passes over, removed
        self._written_off: set[int] = set()     # ... and once written, those still in the heap (skipped there)
        self._gone_early: set[int] = set()      # ... and those whose heap entry went before they were written
        self._unindexed: set[int] = set()       # timer offsets recovery found no readable unit for: not in the heap
        self.delivered = 0
        self._held_since: float | None = None   # when deliveries began to wait (a full disk): said once, not per turn
        self._held_why: object = None           # ... and why, as last said (the store's status and remark)
        self.next_due: int | None = None    # earliest delivery time not yet due, after the last turn
        self._top_level = levels.max_level  # the highest level with a queue to read (see _read_levels)
        self._recovered = False
        m = ctx.metrics
        self._late = m.schedule_delivered_late
        self._delivered = m.schedule_delivered
        self._dropped_total = m.schedule_dropped        # txmq_schedule_dropped_total{reason}
        self._requeued_total = m.requeued                # txmq_requeued_total{topic}

    # ----------------------------------------------------------- start / stop
    @property
    def config_dir(self) -> str:
        return os.path.join(self.ctx.store.store_dir, "config")

    async def recover(self) -> None:
        """Load delayOffset.json, replay the progress records after it, index the waiting timers."""
        store = self.ctx.store
        p = self.progress = load_snapshot(self.config_dir, store.max_offset(TIMER_TOPIC, 0))
        # (refused as naming timers past the log: written over at once too, or it reads as good once the log grows)
        rewrite = p.past_the_log
        ahead = p.progress_offset > store.max_offset(PROGRESS_TOPIC, 0)
        if ahead:       # the log was cut below it: its deliveries and timer offsets may be gone or reused
            log.warning("%s covers schedule progress records the recovered log no longer has (it was cut); "
                        "replaying the progress records of the log alone", SNAPSHOT_NAME)
            p = self.progress = Progress()
        # Progress records retention removed before they were applied here: what they delivered is not known.
        known = p.progress_offset >= store.min_offset(PROGRESS_TOPIC, 0)
        start = max(p.progress_offset, store.min_offset(PROGRESS_TOPIC, 0))
        end = store.max_offset(PROGRESS_TOPIC, 0)
        replayed = 0
        for offset in range(start, end):
            unit = store.queue_unit(PROGRESS_TOPIC, 0, offset)
            try:
                view = store.verified_record(unit[0], "schedule recovery") if unit is not None else None
            except CorruptRecordError:
                # A flipped digit in its body marked another timer (or a level offset further on) delivered,
                # which then never was. Passed over, at worst a delivery is repeated (logged by the store).
                continue
            if view is None:
                continue
            parsed = decode_progress(decode_record(view)[0].body)
            if parsed is not None:
                p.apply(*parsed)
                replayed += 1
        p.progress_offset = end
        copied = self._take_master_copy(p)
        removed = []        # (what, messages): waiting ones retention removed while the broker was down
        self._top_level = self._stored_top_level()
        for level in self._read_levels():
            qid = level - 1
            lo, hi = store.min_offset(SCHEDULE_TOPIC, qid), store.max_offset(SCHEDULE_TOPIC, qid)
            if p.levels.get(level, 0) < min(lo, hi):
                removed.append((f"level {level} offsets {p.levels.get(level, 0)}..{min(lo, hi) - 1}",
                                min(lo, hi) - p.levels.get(level, 0)))
            p.levels[level] = min(max(p.levels.get(level, 0), lo), hi)
        hi = store.max_offset(TIMER_TOPIC, 0)
        lo = min(store.min_offset(TIMER_TOPIC, 0), hi)
        if p.timer_floor < lo:
            # Timers below the queue's minimum are never indexed again: taken as passed over, or the floor stayed
            # below them for good and every timer delivered after was kept in timerDone (and the file) for ever.
            gone = lo - p.timer_floor - p.timer_done.discard_below(lo)
            if gone:
                removed.append((f"timer offsets {p.timer_floor}..{lo - 1}", gone))
            p.timer_floor = lo
            p.raise_floor()     # the floor moves on over timers delivered just above it
        self._removed_while_down(removed, known)
        for offset in range(max(p.timer_floor, store.min_offset(TIMER_TOPIC, 0)), hi):
            if not p.timer_delivered(offset):
                unit = store.queue_unit(TIMER_TOPIC, 0, offset)
                view = store.get_record(unit[0]) if unit is not None else None
                if view is not None:
                    self._timers.append((self._due(unit[2], store_timestamp_at(view, 0)), offset, unit[0]))
                elif unit is not None:      # removed or damaged: _delivery says so and drops it, as before
                    self._timers.append((self._due(unit[2], None), offset, unit[0]))
                else:           # a zeroed unit (the store logs it): no heap entry to skip when retention takes it
                    self._unindexed.add(offset)
        heapq.heapify(self._timers)
        self._timers_indexed = hi
        self._timers_min_seen = lo      # (those below: said just above)
        self._recovered = True
        if ahead or rewrite:    # replace it now: once new progress records pass its offset, it would look valid
            try:
                await asyncio.wait_for(self.snapshot(), STOP_WRITE_WAIT_S)     # a hung one held the start for ever
            except TimeoutError:
                log.error("%s not rewritten yet: the write has not ended in %g s (a hung disk?); if it never does, "
                          "remove the file before the next start", SNAPSHOT_NAME, STOP_WRITE_WAIT_S)
            except OSError as exc:
                log.error("%s not rewritten (%s): remove it before the next start", SNAPSHOT_NAME, exc)
        if copied:
            await self._drop_master_copy()
        log.info("schedule recovered: %d progress records replayed, %d level messages and %d timers waiting",
                 replayed, sum(n for _, n in self.waiting() if _ != "timer"), len(self._timers))

    def _take_master_copy(self, p: Progress) -> bool:
        """Levels the delay progress copied from a Java master (read_master_copy) has further on than the log: a
        Java master writes no progress record, so a slave of one, promoted, had every delayed message its log held
        waiting again, those its master had delivered (their copies in the log too) delivered twice. Taken at a
        start as a master (the promotion); the log's own progress wins where it is further on. Not by a slave: it
        delivers nothing, and its delayOffset.json carried the levels on, a copy left from a Java master it no
        longer follows (its sync removes it under a txmq one) raised over its log's undelivered messages."""
        config = getattr(self.ctx, "config", None)
        if config is not None and config.broker_role == "SLAVE":
            return False
        raised = []
        copy = read_master_copy(self.config_dir)
        for level, offset in sorted(copy.items()):
            if offset > p.levels.get(level, 0):
                raised.append(f"level {level} {p.levels.get(level, 0)} -> {offset}")
                p.levels[level] = offset
        if raised:
            log.warning("schedule recovery: delay progress taken from the copy of a Java master's (%s): %s",
                        MASTER_COPY_NAME, "; ".join(raised))
        return bool(copy)

    async def _drop_master_copy(self) -> None:
        """Once taken (capped by the log) and in delayOffset.json, the copy goes: kept, the next start took it
        again over this master's own progress, a level raised past the delayed messages sent here since (their
        offsets under the Java master's further one) and those never delivered. Not written, it stays (taken
        again, capped by that start's log), said at ERROR.

        A write that hangs (a stopped NFS under config/) held the start for ever, never listening, nothing said:
        waited STOP_WRITE_WAIT_S, then said (as a periodic one: ERROR, txmq_config_write_hung) and left to end on
        its thread, the copy removed only after it."""
        if self.writing():
            log.error("%s not removed: an earlier write of %s has not ended; the start goes on (the next start takes "
                      "its levels again)", MASTER_COPY_NAME, SNAPSHOT_NAME)
            return
        write = self._write(_write_then_drop, self._view())
        done, _ = await asyncio.wait({write}, timeout=STOP_WRITE_WAIT_S + 0.1)
        if not done:
            log.error("%s not removed yet: the write of %s before it has not ended; the start goes on (stopped "
                      "first, the next start takes its levels again)", MASTER_COPY_NAME, SNAPSHOT_NAME)
            return
        try:
            write.result()
        except OSError as exc:
            log.error("%s not removed (%s): until it is, each start takes its levels over this broker's own "
                      "progress, and may skip delayed messages sent here since", MASTER_COPY_NAME, exc)

    def _removed_while_down(self, removed: list[tuple[str, int]], known: bool) -> None:
        """Said at start-up: waiting messages whose records retention removed before they were delivered (the
        broker was down, or stopped before its scheduler moved past them). Moved past unsaid, they were lost
        without a count or a line; counted as txmq_schedule_dropped_total{reason="removed"}, as when running."""
        if not removed:
            return
        config = getattr(self.ctx, "config", None)
        if config is not None and config.broker_role == "SLAVE":
            # A slave's retention runs on its own disk: what it removed its master may still hold and deliver
            # (a slave delivers nothing), and what the master lost the master counts.
            log.info("schedule recovery (slave): %s no longer in this slave's log (its retention); its master "
                     "delivers, and counts what it loses", "; ".join(what for what, _ in removed))
            return
        where = "; ".join(what for what, _ in removed)
        if not known:       # the progress records of their deliveries went too: some may have been delivered
            log.warning("schedule recovery: %s were removed by retention; whether they were delivered is not known "
                        "(the progress records saying so were removed too)", where)
            return
        n = sum(k for _, k in removed)
        self._dropped_total.labels("removed").inc(n)
        log.error("schedule recovery: %d waiting messages were removed by retention before delivery (%s); moved "
                  "past them", n, where)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="txmq-schedule")
        self._snap_task = asyncio.get_running_loop().create_task(self._snapshots(), name="txmq-schedule-snapshot")

    async def stop(self) -> None:
        """Stop delivering; a batch in the writer still lands with its progress record. Then write
        delayOffset.json for what is on disk."""
        for task in (self._task, self._snap_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                except Exception:  # noqa: BLE001 - logged; stopping goes on
                    log.exception("schedule task failed")
        if self.writing():
            log.error("%s/%s not written at stop (progress is replayed from the log): an earlier write has not "
                      "ended (a hung disk or a stopped network file system?)", self.config_dir, SNAPSHOT_NAME)
            return
        try:
            # Bounded, as the other config/ writes at stop (topics, groups, KV, queue locks, offsets): a write that
            # hangs (a stopped NFS) kept the stop here for ever, the store and the offsets never closed or saved.
            await asyncio.wait_for(self.snapshot(), STOP_WRITE_WAIT_S)
        except TimeoutError:
            log.error("%s/%s not written at stop (progress is replayed from the log): a write has not ended in %g s "
                      "(a hung disk or a stopped network file system?)", self.config_dir, SNAPSHOT_NAME,
                      STOP_WRITE_WAIT_S)
        except OSError as exc:
            log.error("%s/%s not written at stop (progress is replayed from the log): %s", self.config_dir,
                      SNAPSHOT_NAME, exc)

    async def snapshot(self) -> bool:
        """Write delayOffset.json when progress moved and its last record is flushed (True when it did). The loop
        copies the progress (``timer_done`` is chunks: its dict is copied, bitmaps shared until changed); its JSON
        is made on a worker thread (``write_snapshot``)."""
        if not self._recovered or self._progress_end > self.ctx.store.flushed_offset:
            return False
        p = self.progress
        # Progress moves by progress records (progress_offset) or the floor's bounded steps (raise_floor)
        key = (p.progress_offset, p.timer_floor, len(p.timer_done), tuple(sorted(p.levels.items())))
        if key == self._snapshot_key or self.writing():
            return False
        # Shielded: a caller's bound (the stop's, the start's) gives the wait up, not the write, which stays the
        # one under way until its thread returns
        await asyncio.shield(self._write(write_snapshot, self._view()))
        self._snapshot_key = key
        return True

    def writing(self) -> bool:
        """A delayOffset.json write is under way (hung, maybe): no other starts beside it. A second thread on the
        same .tmp (the stop's or the start's write behind a hung periodic one) could, once the hang cleared, leave
        a file mixing the two, and the first write's end cleared the hung gauge while the second still hung."""
        return self._writing is not None and not self._writing.done()

    def _write(self, fn, view: Progress) -> asyncio.Future:
        """Run ``fn(config_dir, view)`` on a worker thread, said at ERROR and gauged past STOP_WRITE_WAIT_S."""
        loop = asyncio.get_running_loop()
        write = self._writing = loop.run_in_executor(None, fn, self.config_dir, view)
        timer = loop.call_later(STOP_WRITE_WAIT_S, self._write_hangs, write)
        write.add_done_callback(lambda f: (timer.cancel(), self._write_ended(f)))
        write.add_done_callback(retrieved)
        return write

    def _view(self) -> Progress:
        """A copy of the progress for write_snapshot (on the loop; ``timer_done``'s bitmaps shared until changed)."""
        p = self.progress
        return Progress(levels=dict(p.levels), timer_floor=p.timer_floor, timer_done=p.timer_done.copy(),
                        progress_offset=p.progress_offset)

    @property
    def path(self) -> str:
        return os.path.join(self.config_dir, SNAPSHOT_NAME)

    def _write_hangs(self, write) -> None:
        """A periodic write that hung (a stopped NFS) held the snapshot loop, said by nothing: no later snapshot
        was written (a start replays the progress records after the last one, for as long as it hangs). Said at
        ERROR and by txmq_config_write_hung{file="delayOffset.json"} until it ends."""
        if not write.done() and not self.write_hung:
            self.write_hung = True
            log.error("%s: a write has not ended in %g s (a hung disk or a stopped network file system?): no "
                      "snapshot is written until it does (a start replays the progress records after the last one)",
                      self.path, STOP_WRITE_WAIT_S)

    def _write_ended(self, write) -> None:
        # (cancelled: the loop's end, the write still under way on its thread -- no end to say)
        if self.write_hung and not write.cancelled():
            self.write_hung = False
            log.warning("%s: the write that hung has ended", self.path)

    async def _snapshots(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
            try:
                written = await self.snapshot()
            except Exception as exc:  # noqa: BLE001 - a bug too: ending the loop would stop every later snapshot
                # Once per failure run (a full disk): it was an ERROR every 10 s for as long as the disk stayed full
                if not failing or not isinstance(exc, OSError):
                    log.error("%s/%s not written (retried every %g s; until it is, a start replays the progress "
                              "records after the last one): %s", self.config_dir, SNAPSHOT_NAME, SNAPSHOT_INTERVAL_S,
                              exc, exc_info=not isinstance(exc, OSError))
                failing = isinstance(exc, OSError)
                continue
            if failing and written:
                failing = False
                log.warning("%s/%s written again", self.config_dir, SNAPSHOT_NAME)

    # ----------------------------------------------------------- dispatch
    def on_dispatch(self, info) -> None:
        """Store listener: index a new timer message; wake the loop for one due before it would wake."""
        topic = info.topic
        if info.recovering or (topic != SCHEDULE_TOPIC and topic != TIMER_TOPIC):
            return
        if topic == TIMER_TOPIC:
            if info.queue_offset < self._timers_indexed:
                return
            self._timers_indexed = info.queue_offset + 1
            due = self._due(info.tags_code, info.store_timestamp)
            heapq.heappush(self._timers, (due, info.queue_offset, info.physical_offset))
        else:       # a level's delivery time, by the wall clock: the wait it has left, from now
            due = self.ctx.monotonic() + info.tags_code - self.ctx.clock()
        # Compared by the monotonic clock: against a wall-clock deadline, after a step forward every new
        # delivery time lay past it, and a 50 ms timer waited out the whole sleep.
        if self._sleep_until is not None and due < self._sleep_until:
            self._wake.set()

    # ----------------------------------------------------------- the loop
    async def _run(self) -> None:
        clock, monotonic = self.ctx.clock, self.ctx.monotonic
        while True:
            now = clock()
            try:
                moved = await self.run_due(now, monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive a bad turn, loudly
                log.exception("schedule pass failed; trying again in %.0f s", REFUSED_RETRY_S)
                crashes = getattr(self.ctx.metrics, "task_crashes", None)
                if crashes is not None:         # txmq_background_task_crashes_total: the alert sees it
                    crashes.labels("txmq-schedule").inc()
                moved = -1
            if moved < 0:
                await asyncio.sleep(REFUSED_RETRY_S)
                continue
            if moved > 0:
                continue
            next_due = self.next_due
            wait_ms = MAX_SLEEP_S * 1000 if next_due is None else min(MAX_SLEEP_S * 1000, max(1, next_due - now))
            self._sleep_until = monotonic() + wait_ms
            self._wake.clear()
            try:
                await wait_within(self._wake.wait(), wait_ms / 1000)
            except asyncio.TimeoutError:
                pass
            self._sleep_until = None

    async def run_due(self, now: int, mono: int) -> int:
        """One turn: deliver (at most one batch of) what is due at ``now`` (the wall clock's: delay levels) and
        ``mono`` (the monotonic clock's: timers). Returns how many queue entries it moved past (delivered, or
        dropped as undeliverable), 0 when nothing was due, -1 when the store refused the batch (nothing moved;
        the same messages are tried next time). Sets ``next_due`` (by the wall clock)."""
        batch, levels, timers, self.next_due = self._collect(now, mono)
        if not levels and not timers and not self._lost:
            return 0
        moved = (sum(offset - self.progress.levels.get(level, 0) for level, offset in levels.items()) + len(timers)
                 + len(self._lost))
        if not await self._deliver(batch, levels, timers):
            return -1
        return moved

    def _collect(self, now: int, mono: int):
        """What is due now: (delivery requests with their due times, new level offsets, timer entries taken,
        the earliest time something not yet due falls due), due times by the wall clock."""
        store = self.ctx.store
        self._drops, self._removed, self._requeued = {}, [], {}
        batch: list[tuple[PutRequest, int, str]] = []
        levels: dict[int, int] = {}
        size = 0
        next_due = None
        # A batch is written all or none, and one larger than a segment is refused whole, every time: it
        # would stall every level behind it for good. Stay within half a segment (one message alone may
        # be bigger: at most max_message_size, which a segment always holds).
        budget = min(BATCH_BYTES, store.config.segment_size // 2)
        for level in self._read_levels():
            qid, delay = level - 1, self.levels.delay_ms(level)
            offset = self.progress.levels.get(level, 0)
            start = offset
            end = store.max_offset(SCHEDULE_TOPIC, qid)
            if offset < end and offset < store.min_offset(SCHEDULE_TOPIC, qid):
                # Removed by retention meanwhile: counted and said once moved past, as each dropped entry is
                # (the consume queue's minimum moves with the segment, so the record-by-record check below
                # never sees these: txmq_schedule_dropped_total said 0 while every one of them was lost).
                offset = store.min_offset(SCHEDULE_TOPIC, qid)
                self._removed.append((f"level {level} offsets {start}..{offset - 1}", offset - start))
                self._dropped("removed", offset - start)
            while offset < end and len(batch) < BATCH_MESSAGES and size < budget:
                unit = store.queue_unit(SCHEDULE_TOPIC, qid, offset)
                if unit is None:
                    break
                due = self.levels.corrected(unit[2], now, delay)
                if due > now:
                    next_due = due if next_due is None else min(next_due, due)
                    break
                req = self._delivery(unit[0], SCHEDULE_TOPIC, offset)
                if req is not None:
                    if batch and size + len(req.record) > budget:
                        next_due = now          # it goes in the next batch, at once
                        break
                    batch.append((req, due, str(level)))
                    size += len(req.record)
                offset += 1
            if offset != start:
                levels[level] = offset
        self._more = self.progress.raise_floor(SCAN_PER_TURN)
        self._lost = self._removed_timers()
        gone = self._written_off.union(self._lost) if self._lost else self._written_off
        timers: list[tuple[int, int, int]] = []
        heap = self._timers
        while heap and heap[0][0] <= mono and len(batch) < BATCH_MESSAGES and size < budget:
            entry = heap[0]
            if entry[1] in gone:        # passed over as removed by retention (_removed_timers): not twice
                heapq.heappop(heap)
                if entry[1] in self._written_off:
                    self._written_off.discard(entry[1])
                else:       # due when found removed: written off with this batch, or the next if it is refused
                    self._gone_early.add(entry[1])
                continue
            req = self._delivery(entry[2], TIMER_TOPIC, entry[1])
            if req is not None and batch and size + len(req.record) > budget:
                break                           # the next batch takes it, at once (next_due = now below)
            heapq.heappop(heap)
            timers.append(entry)
            if req is not None:
                batch.append((req, now - (mono - entry[0]), "timer"))
                size += len(req.record)
        if heap and heap[0][0] > mono:
            due = now + (heap[0][0] - mono)
            next_due = due if next_due is None else min(next_due, due)
        elif heap:
            next_due = now
        if self._more:          # the next bounded step at once (a turn of the loop between)
            next_due = now
        return batch, levels, timers, next_due

    def _removed_timers(self) -> list[int]:
        """The timer queue offsets, not yet delivered, whose records retention removed since the last look: passed
        over with this batch (in its progress record), counted and said, as the removed level messages are. Left
        to be found at their time, they were said days after they were lost. Found from the timer queue's new
        minimum, in what the removal took (a walk of the heap cost 0.3 s on the loop with a million timers);
        their entries stay in the heap, skipped when they come up."""
        p = self.progress
        tmin = min(self.ctx.store.min_offset(TIMER_TOPIC, 0), self._timers_indexed)
        if tmin <= self._timers_min_seen:
            return []
        # At most LOST_PER_BATCH a batch: each is named in its progress record, which must stay well within a
        # message (one refused as too large would be refused again every second, and all delivery stall).
        start = max(self._timers_min_seen, p.timer_floor)
        if tmin > start + REMOVED_SCAN_PER_TURN:    # the rest next turn (again every second while the disk refused
            tmin = start + REMOVED_SCAN_PER_TURN    # the batch that would pass over them)
            self._more = True
        # Above the floor, the offsets timer_done does not hold: a chunk of the runs at a time. An offset at a time
        # (timer_delivered each), SCAN_PER_TURN a turn, a million delivered behind one held back took 16 turns of
        # 150-210 ms of the loop (0.02-0.5 ms a turn now, one turn).
        lost = p.timer_done.missing(start, tmin, LOST_PER_BATCH)
        if len(lost) == LOST_PER_BATCH:
            tmin = lost[-1] + 1
        self._timers_min_next = tmin
        if not lost:
            self._timers_min_seen = tmin
            return []
        self._dropped("removed", len(lost))
        self._removed.append((f"{len(lost)} timer(s) at offsets {lost[0]}..{lost[-1]}", len(lost)))
        return lost

    def _due(self, deliver: int, stored: int | None) -> int:
        """When a timer falls due by the monotonic clock: the wait it has left by the wall clock, from now.
        Timed by the wall clock, a step back of an hour held a 1 s timer for an hour, nothing said, and a
        step back put right later delivered timers early. A store time ahead of the wall clock (it went back
        since, e.g. before a restart) counts as stored now: the timer waits what it asked for (delivery minus
        store time) from now, as RocketMQ's correctDeliverTimestamp bounds delay levels. A TIMER_DELIVER_MS
        one is taken as the wait it asked for too; the consume queue keeps the time, not how it was asked.
        ``stored``: None when the record is gone (_delivery drops it)."""
        wall = self.ctx.clock()
        if stored is None or stored < wall:
            stored = wall
        return self.ctx.monotonic() + deliver - stored

    def _delivery(self, phys: int, source: str, offset: int) -> PutRequest | None:
        """The message as it goes to its real topic, or None (logged) when it cannot go anywhere."""
        try:
            view = self.ctx.store.verified_record(phys, "scheduled delivery")
        except CorruptRecordError:
            # Its body was damaged on disk: re-encoded for its real topic, the damage would pass for the message
            # under a fresh, valid CRC. Passed over like an undecodable one (logged by the store); it stays here.
            self._dropped("corrupt")
            return None
        if view is None:
            log.error("%s offset %d: its record at %d was removed before delivery", source, offset, phys)
            self._dropped("removed")
            return None
        try:
            msg, _ = decode_record(view)
        except ProtocolError as exc:
            # A damaged record never decodes: raising here failed every pass, and all delayed delivery
            # (every level, every timer) stalled behind it for good. Passed over loudly, as RocketMQ's
            # scheduler passes over a message it cannot look up.
            log.error("%s offset %d (record %d) dropped: it cannot be decoded: %s", source, offset, phys, exc)
            self._dropped("undecodable")
            return None
        props = dict(msg.properties)
        props.pop(Prop.DELAY, None)
        for key in _ASKS_DROPPED:
            props.pop(key, None)
        topic = props.get(Prop.REAL_TOPIC, "")
        try:
            qid = int(props.get(Prop.REAL_QID, ""))
        except ValueError:
            qid = -1
        why = validate_topic(topic)
        if why is None and (topic in (HALF_TOPIC, SCHEDULE_TOPIC, TIMER_TOPIC) or qid < 0):
            why = f"REAL_TOPIC {topic!r} / REAL_QID {props.get(Prop.REAL_QID)!r} is not a destination"
        if why is not None:
            log.error("%s offset %d (record %d) dropped: %s", source, offset, phys, why)
            self._dropped("no_destination")
            return None
        qid = self._readable_queue(topic, qid)
        sys_flag = msg.sys_flag
        if sys_flag & 0x4:
            # Only NOT and COMMIT wait here (DelayLevels.divert): PREPARED / ROLLBACK is its bit 0x4 flipped at rest
            # (outside the CRC), which the start read put back to give it its unit here. Copied as stored, the
            # delivered message got no unit in its topic: served to no one, counted delivered.
            log.error("%s offset %d (record %d): SYSFLAG %#x, a transaction type that never waits: the bit 0x4 is "
                      "damaged (outside the body CRC); delivered as %#x", source, offset, phys, sys_flag,
                      sys_flag ^ 0x4)
            sys_flag ^= 0x4
        record = encode_record(
            topic=topic.encode(), body=msg.body, queue_id=qid, flag=msg.flag, sys_flag=sys_flag,
            born_timestamp=msg.born_timestamp, born_host=pack_host(*msg.born_host),
            store_host=pack_host(*msg.store_host), properties=properties_to_string(props).encode(),
            reconsume_times=msg.reconsume_times, prepared_offset=msg.prepared_offset)
        return self.ctx.store.copying(phys, PutRequest(record, topic, qid, tags_code(props), sys_flag))

    def _readable_queue(self, topic: str, qid: int) -> int:
        """The queue a message due for ``topic`` queue ``qid`` goes to (topics.readable_queue), one moved
        counted for the batch (_deliver). A retry's queue was one of the group's retryQueueNums when it was handed
        back, and its topic may have been made again with fewer since (reclaimed as idle while its retries waited,
        or deleted and made again by a heartbeat after the group's config was lowered)."""
        qid, queues = readable_queue(self.ctx.topics.topics, topic, qid)
        if queues:
            counts = self._requeued.setdefault(topic, [0, queues])
            counts[0] += 1
        return qid

    def _dropped(self, reason: str, n: int = 1) -> None:
        # Counted once the batch's progress is written (_deliver): a refused batch is gathered again.
        self._drops[reason] = self._drops.get(reason, 0) + n

    def _progress_record(self, levels: dict[int, int], timers: list[int]) -> PutRequest:
        ctx = self.ctx
        record = encode_record(topic=PROGRESS_TOPIC.encode(), body=encode_progress(levels, timers), queue_id=0,
                               flag=0, sys_flag=0, born_timestamp=ctx.clock(), born_host=ctx.store_host,
                               store_host=ctx.store_host, properties=b"WAIT\x01false")
        return PutRequest(record, PROGRESS_TOPIC, 0, 0, 0)

    async def _deliver(self, batch, levels: dict[int, int], timers: list) -> bool:
        timer_offsets = [t[1] for t in timers] + self._lost
        reqs = [req for req, _, _ in batch] + [self._progress_record(levels, timer_offsets)]
        store = self.ctx.store
        for req in reqs:
            if (req.topic, req.queue_id) not in store.queue_index:
                # A new queue's file first, as a send's: one that could not be made (past the open-files limit)
                # had its units wait in memory, unreadable, and the checkpoint stood still until a descriptor
                # came free. The batch waits here instead, in the schedule queue, and is tried again.
                try:
                    await store.queue_file(req.topic, req.queue_id)
                except BaseException as exc:
                    for entry in timers:            # not taken after all, whatever stopped it
                        heapq.heappush(self._timers, entry)
                    if not isinstance(exc, OSError):
                        raise
                    self._held(logging.WARNING, (req.topic, req.queue_id, str(exc)),
                               "schedule delivery of %d messages waits: consume queue %s-%d has no "
                               "file (%s); retrying every %.0f s", len(batch), req.topic, req.queue_id, exc,
                               REFUSED_RETRY_S)
                    return False
        try:
            results = await store.put_many(reqs)
        except BaseException:
            for entry in timers:            # not taken after all (the put's outcome is in the log)
                heapq.heappush(self._timers, entry)
            raise
        if not all(r.ok for r in results):
            for entry in timers:
                heapq.heappush(self._timers, entry)
            status = next(r for r in results if not r.ok)
            if status.status is PutStatus.MESSAGE_ILLEGAL:
                self._held(logging.ERROR, status.status, "schedule delivery batch refused as illegal; retrying")
            else:
                self._held(logging.WARNING, (status.status, status.remark),
                           "schedule delivery of %d messages refused (%s %s); retrying every %.0f s",
                           len(batch), status.status.name, status.remark, REFUSED_RETRY_S)
            return False
        if self._held_since is not None:
            log.warning("schedule delivering again (deliveries waited %.1f s)", time.monotonic() - self._held_since)
            self._held_since = self._held_why = None
        last = results[-1]
        if self.progress.apply(levels, timer_offsets, SCAN_PER_TURN):
            self._more = True
        self.progress.progress_offset = last.queue_offset + 1
        self._progress_end = last.physical_offset + last.size
        for reason, n in self._drops.items():
            self._dropped_total.labels(reason).inc(n)
        for topic, (n, queues) in self._requeued.items():
            self.ctx.metrics.child(self._requeued_total, topic).inc(n)
            if not self._requeue_said.due(f"{topic}\0{queues}"):   # once a topic and queue count: counted after
                continue
            log.warning("schedule: %d delayed, timer or retry messages for %s were due in queues past the %d it "
                        "reads now (its queues were cut while they waited): delivered to queue (their queue id mod "
                        "%d) instead; later ones of %s are counted in txmq_requeued_total", n, topic, queues, queues,
                        topic)
        if self._removed:
            log.error("schedule: %d waiting messages were removed by retention before delivery (%s); moved past "
                      "them", sum(n for _, n in self._removed), "; ".join(what for what, _ in self._removed))
        # Only those still in the heap are kept (skipped there): one whose entry already went, or never was (its
        # unit unreadable at start-up), stayed in the set for good and the waiting count was one low for it.
        self._written_off.update(q for q in self._lost if q not in self._gone_early and q not in self._unindexed)
        self._gone_early.difference_update(self._lost)
        self._unindexed.difference_update(self._lost)
        self._timers_min_seen = max(self._timers_min_seen, self._timers_min_next)
        for (req, due, label), result in zip(batch, results):
            self.delivered += 1
            self._delivered.labels(label).inc()
            if result.store_timestamp - due > LATE_MS:
                self._late.inc()
        return True

    def _held(self, level: int, why: object, msg: str, *args) -> None:
        """A batch not delivered, tried again every REFUSED_RETRY_S: said when deliveries begin to wait, not at each
        try (a full disk for an hour was 3,600 lines); 'delivering again' ends it."""
        if self._held_since is None:
            self._held_since = time.monotonic()
        if why != self._held_why:       # (a new reason is said too; ``why``, not the line: its count may grow)
            self._held_why = why
            log.log(level, msg + " (said once until deliveries go on)", *args)

    def delayed_commit(self, half, topic: str, queue_id: int, half_offset: int) -> PutRequest | None:
        """The committed message of a half that asked for a delay, as it waits; None: it goes now."""
        return diverted_request(self.levels, half, topic, queue_id, half_offset, self.ctx.store_host,
                                self.ctx.clock())

    def _read_levels(self) -> range:
        return range(1, self._top_level + 1)

    def _stored_top_level(self) -> int:
        """The configured levels, or more when an earlier run's longer ``message_delay_level`` left messages waiting
        past them: read by nobody (RocketMQ 4.9.8's schedule walks its configured levels alone), they were never
        delivered, nor counted as waiting. They are read at the last level's delay now, as a send asking past it
        is: by correctDeliverTimestamp, one due further ahead than that from now goes at once, the others at their
        own time (as a configured level's messages when its delay is shortened), said once here. A level whose
        waiting messages retention removed, all of them, is read too: recover() counts and says them as removed,
        as a configured level's (left out, they were neither)."""
        store, top = self.ctx.store, self.levels.max_level
        done = self.progress.levels
        undone = {qid + 1: (store.min_offset(SCHEDULE_TOPIC, qid), store.max_offset(SCHEDULE_TOPIC, qid))
                  for topic, qid in store.queues() if topic == SCHEDULE_TOPIC and qid >= top}
        undone = {level: (lo, hi) for level, (lo, hi) in sorted(undone.items()) if hi > done.get(level, 0)}
        past = {level: hi - max(lo, done.get(level, 0)) for level, (lo, hi) in undone.items()}
        past = {level: n for level, n in past.items() if n > 0}
        if past:
            # (not "at the last level's delay": one due an hour on went at once, by correctDeliverTimestamp's rule)
            config = getattr(self.ctx, "config", None)
            slave = config is not None and config.broker_role == "SLAVE"
            then = (" by the master (this slave delivers none)" if slave
                    else "; to keep their delays, start with the longer message_delay_level again")
            log.warning("delay levels past the %d configured (message_delay_level; an earlier run had more) hold "
                        "messages waiting (%s): those due more than the last level's delay, %d ms, from now are "
                        "delivered at once, the others at their time%s", top,
                        ", ".join(f"level {level}: {n}" for level, n in past.items()), self.levels.delays_ms[-1], then)
        return max([top, *undone])

    # ----------------------------------------------------------- views
    def waiting(self) -> list[tuple[str, int]]:
        """(level, messages waiting) for every level with a queue, and ("timer", n)."""
        store = self.ctx.store
        out = []
        for level in self._read_levels():
            hi = store.max_offset(SCHEDULE_TOPIC, level - 1)
            if hi:
                out.append((str(level), max(0, hi - self.progress.levels.get(level, 0))))
        out.append(("timer", len(self._timers) - len(self._written_off)))     # (removed ones: passed over)
        return out


def diverted_request(levels: DelayLevels, msg, topic: str, queue_id: int, prepared_offset: int, store_host: bytes,
                     now: int) -> PutRequest | None:
    """A committed transaction whose half asked for a delay: its message in SCHEDULE_TOPIC_XXXX (or the
    timer topic) instead of ``topic`` (CommitLog applies DELAY to COMMIT messages). None: it goes now."""
    props = dict(msg.properties)
    sys_flag = SysFlag.with_transaction_type(msg.sys_flag, SysFlag.TRANSACTION_COMMIT)
    d = levels.divert(topic, queue_id, props, sys_flag, now)
    if d is None or isinstance(d, str):
        return None
    record = encode_record(
        topic=d.topic.encode(), body=msg.body, queue_id=d.queue_id, flag=msg.flag, sys_flag=sys_flag,
        born_timestamp=msg.born_timestamp, born_host=pack_host(*msg.born_host), store_host=store_host,
        properties=properties_to_string(props).encode(), reconsume_times=msg.reconsume_times,
        prepared_offset=prepared_offset)
    return PutRequest(record, d.topic, d.queue_id, d.tags_code, sys_flag, d.delay_ms)


def _write_then_drop(config_dir: str, view: Progress) -> None:
    """Blocking: off the loop. delayOffset.json with a Java master's copied levels, then the copy removed."""
    write_snapshot(config_dir, view)
    drop_master_copy(config_dir)
