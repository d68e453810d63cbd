"""Retention: which commit-log segments go, judged by the broker's own clock and store, never by a plan's word.

Three ways a segment goes, one at a time, oldest first, never the active one:

    reason     when                                                         who asks
    plan       listed by the nightly plan AND every check below holds       `admin apply-expiry PLAN`
    expired    newest record older than file_reserved_hours, disk above     this module, every
               disk_clean_ratio                                             disk_clean_interval_s
    pressure   any age, disk above disk_force_clean_ratio                   this module

A plan is refused whole (nothing changes) when it is not version 2, names another store
(store_id), or its now_ms is ahead of the broker's clock by more than plan_clock_skew_ms.
Each listed segment is then kept, with its reason in the reply and the log, unless:
it is in the store and sealed; its start, end offset and newest store timestamp are the
ones the plan saw (a segment that grew, or another store's segment of the same name, is
not what was planned); its newest record, read from the store, is older than the broker's
clock minus the retention (the larger of the broker's and the plan's); and every older
listed segment went. A listed segment the store no longer has that ends at or before its log start went
already (an earlier apply, one killed midway, the cleaner): it is in the reply's segments_gone, not kept, and
keeps no later one. Undecided halves inside a segment are dead-lettered first (reason
`expired`, or `disk-pressure` for a forced removal); one that cannot be keeps the segment, and so
does one younger than transaction_retention_hours (set above file_reserved_hours, it keeps
undecided transactions, and the log they are in, longer) unless the disk forces it out.

The cleaner says once a segment why an expired-looking oldest segment stays: young undecided halves, or a
newest record it cannot date by its clock (stamped ahead of it: the clock stepped back). Segments go oldest
first, so every later segment waits with it.

A slave runs the disk-pressure cleaner too (expired and pressure), without the halves step: it
writes nothing, its master dead-letters them. So an expired segment goes from a slave only once its master
removed it (the master's log start, learnt by ha/sync.py, at or past the segment's end, and the slave's log
holding the master's log as it was then: the halves' dead-letter records with it); until then the slave keeps
it, and says so once. Removed first, its undecided halves were lost to the slave promoted before its master
decided them. Disk pressure still forces it out, with an ERROR that says what a promotion loses. A plan is
applied on the master: a slave refuses it whole.

Consumed or not does not matter (RocketMQ's fileReservedTime): a consumer behind a removed
segment gets PULL_OFFSET_MOVED and continues from the new minimum. retain_unconsumed_max_bytes
> 0 keeps expired segments a group has not consumed while the log is within that size.
"""
from __future__ import annotations

import asyncio
import errno
import logging
from collections import Counter

from protocol.errors import StoreError

log = logging.getLogger("txmq.retention")
HOUR_MS = 3_600_000
PLAN_VERSION = 2
STEP_SAID_MS = 60_000   # a wall clock ahead of the time passed by more than this (again) is said


class PlanRefused(Exception):
    """The plan as a whole cannot be applied; nothing was changed."""


def check_plan_header(plan, store_id: str, now: int, skew_ms: int) -> None:
    """Raise PlanRefused unless the plan is this store's, in a format this broker knows, and not from the future."""
    if not isinstance(plan, dict):
        raise PlanRefused("the plan is not a JSON object")
    if plan.get("version") != PLAN_VERSION:
        raise PlanRefused(f"plan version {plan.get('version')!r} is not {PLAN_VERSION}; a version 1 plan carries "
                          "no store id or segment identity: make a new plan with `python -m ops.spark expiry`")
    if plan.get("store_id") != store_id:
        raise PlanRefused(f"the plan is for store {plan.get('store_id')!r}, this broker's store is {store_id}: "
                          "check --broker / BROKER_ADMIN_ADDR")
    plan_now = plan.get("now_ms")
    if not isinstance(plan_now, int) or isinstance(plan_now, bool):
        raise PlanRefused(f"now_ms {plan_now!r} is not an integer")
    if plan_now > now + skew_ms:
        raise PlanRefused(f"the plan was made for {plan_now}, {plan_now - now} ms ahead of this broker's clock "
                          f"({now}; allowed skew {skew_ms} ms): a future plan would remove live data")
    check_plan_lists(plan)


def check_plan_lists(plan: dict) -> None:
    """Raise PlanRefused unless the plan's segments and halves are lists of objects. (The admin asks it too before
    it sends a plan in parts: the broker refuses one part, the parts before it were applied.)"""
    for key in ("segments", "halves"):
        items = plan.get(key) or []
        if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
            raise PlanRefused(f"{key} must be a list of objects")


def _another_half(half: dict, tx) -> str | None:
    """Why the undecided half at a listed offset is not the one the plan saw (None: it is, or the plan does not say).
    A store restored from a backup (same store id) and written on holds another half there: expired on the plan's
    word, that other transaction was dead-lettered. Only the fields the plan carries are compared (a hand-made
    plan may give the offset alone)."""
    seen = []
    ts = half.get("store_timestamp")
    # One bit apart is the same half: an undecided half's flipped STORETIMESTAMP is read with the bit put back when
    # the index is rebuilt, the record is not rewritten, so the plan says the flipped time (docs/operations.md).
    if isinstance(ts, int) and not isinstance(ts, bool) and (ts ^ tx.store_ts).bit_count() > 1:
        seen.append(f"store_timestamp {ts}, the store's half {tx.store_ts}")
    key = half.get("uniq_key")
    if isinstance(key, str) and key != tx.uniq_key:
        seen.append(f"uniq_key {key!r}, the store's half {tx.uniq_key!r}")
    if not seen:
        return None
    return ("not the half the plan saw (the plan says " + "; ".join(seen)
            + "): the store was restored or the plan is of another copy; make a new plan")


def judge(seg: dict, facts, *, cutoff: int) -> str | None:
    """Why the broker keeps a segment the plan lists (None: it may go). ``facts``: the store's SegmentFacts or None."""
    if facts is None:
        return "not in this store (already removed?)"
    if not facts.sealed:
        return "it is the active segment"
    seen = (seg.get("start_offset"), seg.get("end_offset"), seg.get("last_store_timestamp"))
    if seen != (facts.start, facts.end, facts.last_ts):
        return (f"it changed since the plan: the plan saw start {seen[0]}, end {seen[1]}, newest {seen[2]}; "
                f"the store has start {facts.start}, end {facts.end}, newest {facts.last_ts}")
    if facts.last_ts < 0:
        return "it holds no record the broker can date"
    if facts.last_ts >= cutoff:
        return (f"its newest record ({facts.last_ts}) is not older than the retention by the broker's clock "
                f"(cutoff {cutoff})")
    return None


def applied_counts(summary: dict) -> Counter:
    """What an applied plan (or part) did, counted: added up over a plan's parts."""
    return Counter(expired=len(summary["expired"]), skipped=len(summary["skipped"]),
                   undecided=sum(1 for s in summary["skipped"] if s.get("undecided")),
                   removed=len(summary["segments_removed"]), kept=len(summary["segments_kept"]),
                   gone=len(summary["segments_gone"]))


def applied_totals(n: Counter) -> str:
    """applied_counts said: "N halves expired, N skipped (...), N segments removed, N kept, N gone before"."""
    return (f"{n['expired']} halves expired, {n['skipped']} skipped ({n['undecided']} still undecided: not "
            f"dead-lettered), {n['removed']} segments removed, {n['kept']} kept, {n['gone']} gone before")


def applied_line(n: Counter, parts: int = 1) -> str:
    return f"expiry plan applied{f' in {parts} parts' if parts > 1 else ''}: {applied_totals(n)}"


def _remedy(exc: OSError) -> str:
    """What to do about a file the file system would not unlink."""
    if exc.errno == errno.EIO:
        return "see dmesg and check the disk"
    if exc.errno == errno.EROFS:
        return "the file system is read-only: see dmesg, repair the disk and restart the broker"
    return "give the broker's user write access to the directory and make the file mutable (ls -l, lsattr; chattr -i)"


class Retention:
    def __init__(self, ctx, usage=None):
        self.ctx = ctx
        c = ctx.config
        self.retention_ms = int(c.file_reserved_hours * HOUR_MS)
        self.half_retention_ms = int(c.transaction_retention_hours * HOUR_MS)
        self.usage = usage or self._probe
        # Ages by the wall clock bounded by the time that passed since the start (context.aged_clock): a step
        # ahead while the broker ran expired every sealed segment and undecided half by the step at once.
        self._aged = ctx.aged or ctx.clock
        self._ahead_said = 0                # how far the wall clock ran ahead of it when last said (or since)
        self._lock = asyncio.Lock()          # one removal pass at a time: a plan or the pressure cleaner
        self._task: asyncio.Task | None = None
        self._young_said: tuple | None = None   # the segment the cleaner last said young halves keep
        self._undated_said: tuple | None = None  # the segment the cleaner last said it cannot date by this clock
        self._master_said: tuple | None = None   # the segment the slave's cleaner last said its master holds
        self._paused_said = False           # the pause for a store that cannot be written was said (until it can)
        # A removal met EROFS before the disk monitor saw the file system read-only (ext4's emergency_ro is read
        # from the mount table every 5 s): paused until the monitor's next mount-table reading (its
        # table_readings then), which then decides; None when not. A monitor that never sees it (a bind mount, an
        # overlay) does not pause the cleaner for good: it tries again after each reading, said once
        self._met_read_only: int | None = None
        self._erofs_said = False            # a removal's EROFS was said (until one succeeds or the monitor sees it)
        self._unseen_said = False           # an EROFS the monitor did not see at its next reading was said
        self._unremovable_said = False      # a segment file the file system would not unlink (EACCES, EPERM,
        # EIO) was said (until a removal succeeds): the segment stays, readable, and each pass tries it again
        self._left_said = False             # a removal's consume-queue files left on disk were said (until one
        # leaves none)
        # (a slave) fn(log end) -> the offset up to which its master removed its log, None while not known
        # (ha/sync.py SlaveSync.removable_end; set by the server)
        self.master_removed_to = lambda _end: None

    def now(self) -> int:
        """The broker's clock to judge ages by; says once a step when the wall clock ran ahead of it."""
        now = self._aged()
        ahead = self.ctx.clock() - now
        if ahead - self._ahead_said > STEP_SAID_MS:
            self._ahead_said = ahead
            log.warning("the wall clock is %d s ahead of the time that passed since the broker started (stepped "
                        "ahead while it ran): retention judges ages by the latter, so nothing expires by the step; "
                        "until a restart segments and undecided halves stay that much longer", ahead // 1000)
        elif ahead < self._ahead_said - STEP_SAID_MS:
            self._ahead_said = max(ahead, 0)    # put back: the next step ahead is said again
        return now

    def _probe(self) -> float:
        disk = self.ctx.store.disk   # the store's watermark monitor: one measure of the disk
        disk.probe()                 # fresh after a removal, and writes resume as soon as space is back
        return disk.ratio

    # ------------------------------------------------------------------ plans
    async def apply_plan(self, plan: dict, *, say: bool = True) -> dict:
        """Apply ``plan``; its summary said at WARNING (``say``) or left to the caller (a part of a plan: applied_line
        of the parts' totals)."""
        ctx = self.ctx
        if ctx.config.broker_role == "SLAVE":
            # Its store refuses the dead letters (its master writes them) and its index is its start-up one:
            # taken, a plan made from the slave's store "skipped" its halves and removed its segments, a
            # success while the master, whose halves they are, was never told.
            raise PlanRefused("this broker is a SLAVE: a plan is applied on the master (make it from the master's "
                              "store: a slave's store has its own store id); the slave cleans its disk by itself")
        now = self.now()
        check_plan_header(plan, ctx.store.store_id, ctx.clock(), ctx.config.plan_clock_skew_ms)
        plan_retention = plan.get("retention_ms") if isinstance(plan.get("retention_ms"), int) else 0
        cutoff = now - max(self.retention_ms, plan_retention)
        async with self._lock:
            expired, skipped = await self._expire_halves(plan.get("halves") or [], now)
            removed, kept, gone = [], [], []
            by_name = {f.name: f for f in await ctx.store.segment_facts()}
            blocked = None
            for seg in sorted(plan.get("segments") or [], key=lambda s: str(s.get("name"))):
                name = str(seg.get("name"))
                if name not in by_name and self._went(seg):
                    # Removed since the plan was made (an apply killed midway, applied before, the cleaner): gone
                    # as the plan wanted, so no older listed segment is kept; kept, it held back every later one.
                    gone.append(name)
                    continue
                why = (blocked or judge(seg, by_name.get(name), cutoff=cutoff) or self._held(by_name[name])
                       or self._young_halves(by_name[name], now))
                if why is None:
                    try:
                        why = await self._remove(by_name[name], "plan", "expired")
                    except OSError as exc:
                        # Raised, the admin got SYSTEM_ERROR with the errno alone, no word of what the plan did
                        if exc.errno != errno.EROFS:
                            self._count_unremovable("segment", exc)
                        why = f"its file could not be removed: {exc}; {_remedy(exc)}"
                if why is None:
                    removed.append(name)
                    continue
                kept.append({"name": name, "why": why})
                log.warning("expiry plan: keeping segment %s: %s", name, why)
                blocked = blocked or f"an older listed segment ({name}) is kept"
        summary = {"store_id": ctx.store.store_id, "now_ms": now, "cutoff_ms": cutoff, "expired": expired,
                   "skipped": skipped, "segments_removed": removed, "segments_kept": kept, "segments_gone": gone}
        if say:
            log.warning("%s", applied_line(applied_counts(summary)))
        return summary

    def _went(self, seg: dict) -> bool:
        """Whether a listed segment the store no longer has lies wholly before its log start (removed already)."""
        end = seg.get("end_offset")
        return isinstance(end, int) and not isinstance(end, bool) and end <= self.ctx.store.min_physical_offset

    async def _expire_halves(self, listed: list, now: int) -> tuple[list[int], list[dict]]:
        """Listed halves older than the retention by the broker's own record of their store time."""
        tx = self.ctx.tx
        due, skipped = [], []
        for half in listed:
            off = half.get("commit_log_offset")
            undecided = tx.pending.get(off) if isinstance(off, int) else None     # (a lookup, not a copy of all)
            if undecided is None:
                skipped.append({"commit_log_offset": off, "why": "already decided or unknown"})
            elif (other := _another_half(half, undecided)) is not None:
                skipped.append({"commit_log_offset": off, "why": other})
            elif now - undecided.store_ts <= self.half_retention_ms:
                skipped.append({"commit_log_offset": off, "why": "younger than the retention by the broker's clock"})
            else:
                due.append(off)
        done, failed = await tx.dead_letter(due, "expired")
        # Refused by the store (a full disk, an I/O error), a half is still undecided: not expired, unlike one
        # decided meanwhile. Said so, the admin exits non-zero (a nightly unit reported success, nothing expired).
        for f in failed:
            if f["commit_log_offset"] in tx.pending:
                f["undecided"] = True
        return done, skipped + failed

    async def undoes_resume(self, half_offset: int, store_ts: int) -> str | None:
        """What would undo a resume (903, 323) of the dead-lettered transaction whose half is at ``half_offset``
        should it still be undecided then (None: nothing soon). A half past transaction_retention_hours, undecided
        again, is what the next expiry plan lists and dead-letters as `expired`, as does the cleaning pass that
        removes its segment once that is past file_reserved_hours. Said with the resume, not a refusal: the resumed
        transaction is checked at once, and a producer that is back decides it before either comes."""
        now = self.now()
        age = now - store_ts
        if age <= self.half_retention_ms:
            return None
        c = self.ctx.config
        facts = next((f for f in await self.ctx.store.segment_facts() if f.start <= half_offset < f.end), None)
        # (the plan lists open halves older than its own --retention-hours, not transaction_retention_hours)
        when = "an expiry plan listing it (the nightly one lists the open halves older than its --retention-hours)"
        if facts is not None and facts.sealed and 0 <= facts.last_ts < now - self.retention_ms:
            when = (f"the next cleaning pass (every {c.disk_clean_interval_s:g} s) with the disk above "
                    f"disk_clean_ratio ({c.disk_clean_ratio * 100:g}%), or {when}, its segment {facts.name} being past "
                    f"file_reserved_hours ({self.retention_ms / HOUR_MS:g} h),")
        return (f"its half, stored {age / HOUR_MS:.1f} h ago, is past transaction_retention_hours "
                f"({self.half_retention_ms / HOUR_MS:g} h): undecided by then, {when} would dead-letter it again as "
                "expired")

    def _held(self, facts) -> str | None:
        """The opt-in: an unconsumed expired segment stays while the log is within retain_unconsumed_max_bytes."""
        cap = self.ctx.config.retain_unconsumed_max_bytes
        store = self.ctx.store
        if cap <= 0 or store.max_physical_offset - store.min_physical_offset > cap:
            return None
        for (group, topic, qid), offset in self.ctx.offsets.items():
            phys = store.physical_offset_of(topic, qid, offset)
            if phys is not None and phys < facts.end:
                return (f"group {group} has not consumed {topic}:{qid} in it and the log is within "
                        f"retain_unconsumed_max_bytes ({cap})")
        return None

    def _young_halves(self, facts, now: int) -> str | None:
        """An undecided half inside that transaction_retention_hours still keeps (None: none).

        With transaction_retention_hours above file_reserved_hours the operator keeps undecided
        transactions longer than the log: the segment stays with them, rather than be removed after
        dead-lettering them as `expired` before their time."""
        young = [(off, ts) for off, ts in self.ctx.tx.undecided(facts.start, facts.end).items()
                 if now - ts <= self.half_retention_ms]
        if not young:
            return None
        off, ts = min(young)
        return (f"it holds {len(young)} undecided half message(s) younger than transaction_retention_hours "
                f"({self.half_retention_ms / HOUR_MS:g} h) by the broker's clock, the first at {off} stored at {ts}")

    async def _remove(self, facts, reason: str, half_reason: str) -> str | None:
        """Dead-letter the undecided halves inside, then remove; None when it went, else why not."""
        tx = self.ctx.tx
        # A slave writes nothing: its master dead-letters the halves (the slave's index is its start-up one).
        slave = self.ctx.config.broker_role == "SLAVE"
        # The halves are taken once (between()) and the loop runs while they are dead-lettered and the segment
        # removed: a resume (903, 323) landing meanwhile made a transaction in it pending again, in no list, its
        # half then removed under it. Resumes of a half in the range are refused until the removal is over.
        tx.removing = (facts.start, facts.end)
        try:
            inside = [] if slave else sorted(tx.undecided(facts.start, facts.end))
            if inside:
                done, failed = await tx.dead_letter(inside, half_reason)
                log.warning("segment %s: %d undecided halves dead-lettered (%s) before removal", facts.name,
                            len(done), half_reason)
                # Each failed half is inside the segment: still undecided is still in the index. (Asked of
                # undecided(start, end), a walk of the whole index per failed half: 2,000 refused under 200,000
                # undecided held the loop 50 s, and again each cleaning interval while the store refused writes.)
                still = [f for f in failed if f["commit_log_offset"] in tx.pending]
                if still:
                    first = still[0]
                    return f"undecided half at {first['commit_log_offset']} could not be dead-lettered: {first['why']}"
            try:
                await self.ctx.store.remove_segment(facts.name, reason)
            except StoreError as exc:        # not the oldest, not yet flushed
                return str(exc)
        finally:
            tx.removing = None
        self.ctx.metrics.child(self.ctx.metrics.segments_removed, reason).inc()
        left = self.ctx.store.queue_files_left
        for exc in left:
            self._count_unremovable("queue-file", exc)
        if left and not self._left_said:
            self._left_said = True
            log.error("segment %s removed, but consume-queue files of %d queue(s) below it could not be unlinked "
                      "(the first: %s): out of their queues (consumers go on from past them), on disk until a later "
                      "removal or a start removes them (txmq_store_segment_removals_failed_total; said again once a "
                      "removal leaves none): %s", facts.name, len(left), left[0], _remedy(left[0]))
        elif not left:
            self._left_said = False
        return None

    # --------------------------------------------------------------- pressure
    async def clean_once(self) -> list[tuple[str, str]]:
        """One pass of disk-pressure cleaning; [(segment, reason)] removed."""
        c = self.ctx.config
        self.now()                  # a step ahead is said when it happens, not when the disk first fills after it
        usage = self.usage()
        if usage < c.disk_clean_ratio or self._paused():
            return []
        removed = []
        async with self._lock:
            while True:
                facts = await self.ctx.store.segment_facts()
                if len(facts) < 2:
                    break
                oldest = facts[0]
                now = self.now()
                expired = 0 <= oldest.last_ts < now - self.retention_ms
                young = self._young_halves(oldest, now) if expired else None
                if young is not None:
                    expired = False
                    if usage < c.disk_force_clean_ratio and self._young_said != (oldest.name, oldest.start):
                        # Once a segment: the disk stays above disk_clean_ratio with it (and every later
                        # segment) until the half is decided or expired, or disk pressure forces it out.
                        self._young_said = (oldest.name, oldest.start)
                        self._say_kept(oldest, usage, young)
                if not (0 <= oldest.last_ts <= now) and usage < c.disk_force_clean_ratio:
                    self._say_undated(oldest, now, usage)
                if expired and (usage >= c.disk_force_clean_ratio or self._held(oldest) is None):
                    reason, half_reason = "expired", "expired"
                elif usage >= c.disk_force_clean_ratio:
                    reason, half_reason = "pressure", "disk-pressure"
                else:
                    break
                held = self._master_holds(oldest)
                if held is not None:
                    if reason == "expired" and usage < c.disk_force_clean_ratio:
                        if self._master_said != (oldest.name, oldest.start):
                            self._master_said = (oldest.name, oldest.start)
                            self._say_kept(oldest, usage, held)
                        break
                    log.error("disk pressure: removing segment %s although %s; undecided halves in it are lost to this "
                              "slave promoted before its master decides them", oldest.name, held)
                if not self._unremovable_said:      # (tried again each pass while a file cannot go: said once)
                    log.warning("disk %.1f%% used (clean above %.0f%%, force above %.0f%%): removing segment %s "
                                "(%s)", usage * 100, c.disk_clean_ratio * 100, c.disk_force_clean_ratio * 100,
                                oldest.name, reason)
                try:
                    why = await self._remove(oldest, reason, half_reason)
                except OSError as exc:
                    if exc.errno != errno.EROFS:
                        self._say_unremovable(oldest, exc)
                        break
                    self._met_read_only = self.ctx.store.disk.table_readings
                    if not self._erofs_said:
                        # The pause this starts is said here, not by a WARNING "retention paused" after this ERROR
                        self._erofs_said = self._paused_said = True
                        log.error("disk pressure: cannot remove segment %s: %s; the file system turned read-only: "
                                  "retention paused, no segment is removed until it can write (the cleaner waits "
                                  "for the disk monitor's next mount-table reading): see dmesg, repair the disk and "
                                  "restart the broker (what was acknowledged is kept)", oldest.name, exc)
                    elif not self._unseen_said:
                        self._unseen_said = True
                        log.warning("disk pressure: cannot remove segment %s: %s; the disk monitor does not see "
                                    "its file system read-only (a bind mount or an overlay?): retention tries again "
                                    "after each mount-table reading (5 s), said again once a removal succeeds; "
                                    "see dmesg and remount the store's file system read-write",
                                    oldest.name, exc)
                    self._paused()
                    break
                if why is not None:
                    log.error("disk pressure: cannot remove segment %s: %s", oldest.name, why)
                    break
                removed.append((oldest.name, reason))
                self._erofs_said = self._unseen_said = self._unremovable_said = False
                usage = self.usage()
        return removed

    def _say_unremovable(self, oldest, exc: OSError) -> None:
        """A removal whose segment file cannot be unlinked (EACCES, EPERM: an immutable file or directory, its
        permissions; EIO): the segment stays in the log, readable, and the next pass tries it again. It was raised
        out of the pass, an ERROR "disk pressure check failed" every disk_clean_interval_s for as long as it lasted,
        counted nowhere. Counted each pass, said once per failure run (again once a removal succeeds)."""
        self._count_unremovable("segment", exc)
        if self._unremovable_said:
            return
        self._unremovable_said = True
        log.error("disk pressure: cannot remove segment %s: %s; it is kept, readable, and tried again every %g s "
                  "(txmq_store_segment_removals_failed_total; said again once a removal succeeds): %s",
                  oldest.name, exc, self.ctx.config.disk_clean_interval_s, _remedy(exc))

    def _count_unremovable(self, what: str, exc: OSError) -> None:
        code = errno.errorcode.get(exc.errno, str(exc.errno))
        self.ctx.metrics.child(self.ctx.metrics.segment_removals_failed, what, code).inc()

    def _paused(self) -> bool:
        """Whether the store can be written to (a removal unlinks files and writes the manifest, its halves'
        dead letters first): on a read-only file system, or a store stopped by an I/O error, every pass's removal
        failed, a WARNING and an ERROR every disk_clean_interval_s (5 s) for as long as the broker ran. Said once
        then, and again once it turned writable and back."""
        store = self.ctx.store
        if store.disk.read_only or (self._met_read_only is not None
                                    and store.disk.table_readings > self._met_read_only):
            self._met_read_only = None      # the monitor's word decides now (read-write: tried again)
            if store.disk.read_only:
                self._erofs_said = self._unseen_said = False
        why = (store.failure if store.failure is not None else
               "its file system is mounted read-only" if store.disk.read_only or self._met_read_only is not None
               else None)
        if why is None:
            self._paused_said = False
            return False
        if not self._paused_said:
            self._paused_said = True
            if self._unseen_said:           # an EROFS the monitor does not see: said once by its own warning
                return True
            log.warning("retention paused: the store cannot be written (%s): no segment is removed until it can; "
                        "repair the disk and restart the broker (what was acknowledged is kept)", why)
        return True

    def _say_kept(self, oldest, usage: float, why: str) -> None:
        """The warning that an expired oldest segment, and every one after it, stays until disk pressure."""
        c = self.ctx.config
        log.warning("disk %.1f%% used (clean above %.0f%%): keeping expired segment %s and the ones after it until "
                    "disk pressure (%.0f%%): %s", usage * 100, c.disk_clean_ratio * 100, oldest.name,
                    c.disk_force_clean_ratio * 100, why)

    def _master_holds(self, facts) -> str | None:
        """(A slave) why its master may still hold the segment (None: it removed it, or this is no slave)."""
        if self.ctx.config.broker_role != "SLAVE":
            return None
        removed_to = self.master_removed_to(self.ctx.store.max_physical_offset)
        if removed_to is not None and removed_to >= facts.end:
            return None
        if removed_to is None:
            return ("its master still holds it, as far as this slave knows: it has not learnt where its master's "
                    "log starts (GET_BROKER_RUNTIME_INFO from the master broker the name server names)")
        return (f"its master still holds it (the master's log starts at {removed_to}, the segment ends at "
                f"{facts.end}): the master dead-letters the undecided halves in it first")

    def _say_undated(self, oldest, now: int, usage: float) -> None:
        """Once a segment: the oldest cannot expire by the broker's clock, so neither can any after it (oldest
        first). A newest record stamped ahead of the clock (it was stepped back since, or was ahead then) kept
        the disk above disk_clean_ratio with every expired segment behind it, and not a line said why."""
        if self._undated_said == (oldest.name, oldest.start):
            return
        self._undated_said = (oldest.name, oldest.start)
        c = self.ctx.config
        why = (f"its newest record is stamped {oldest.last_ts}, {oldest.last_ts - now} ms ahead of the broker's "
               f"clock ({now}): the clock was stepped back since, or was ahead when it was written"
               if oldest.last_ts > now else "it holds no record the broker can date")
        log.warning("disk %.1f%% used (clean above %.0f%%): segment %s cannot expire, %s; it and every segment after "
                    "it are kept until disk pressure (%.0f%%) or its time comes", usage * 100,
                    c.disk_clean_ratio * 100, oldest.name, why, c.disk_force_clean_ratio * 100)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="txmq-retention")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.config.disk_clean_interval_s)
            try:
                await self.clean_once()
            except OSError as exc:
                log.error("disk pressure check failed: %s", exc)
            except Exception:  # noqa: BLE001 - the cleaner must survive a bad pass
                log.exception("disk pressure cleaning failed")
                # Counted where the alert looks (txmq_background_task_crashes_total): a cleaner failing
                # every pass, logged only, lets the disk fill unnoticed.
                self.ctx.metrics.task_crashes.labels("txmq-retention").inc()
