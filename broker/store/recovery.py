"""Start-up recovery: find where the valid log ends, cut a torn tail, bring consume queues in line.

Where the scan starts: the segment holding the checkpoint's flushed offset, or earlier if
``recovery_verify_segments`` asks to re-verify more of the newest segments; the first
segment when there is no valid checkpoint. Each record is checked for MESSAGE magic, a
size that fits the segment (with room for the 8-byte end marker), its PHYSICALOFFSET
field equal to where it lies, a layout whose lengths add up to TOTALSIZE, and its body
CRC, and a valid topic name; at or past the checkpoint's flushed offset also properties with
no NUL byte (the body CRC leaves them unguarded, and a crash can lose their pages while the
head and body reached the disk: they read as zeros; the broker stores no NUL there). Below the
checkpoint nothing is torn, but a TOPIC byte flipped at rest is damage all the same: each
name is judged once a scan. Before ``nul_free_from`` (an older broker's records) neither. An end
marker (BLANK magic, TOTALSIZE = bytes left) moves the scan to the next segment. Eight
zero bytes where a record would start are the end of the data.

Torn tail or damage in the middle -- the rule:

* A bad record (or zeros) followed by nothing but zeros, in a segment after which no
  later segment holds a non-zero byte, is the end of the log: a write cut short by a
  crash. Bytes from the bad record to the last non-zero byte are zeroed and the cut is
  logged (segment, position, length) and reported; later all-zero segments are deleted.
* A bad record with a valid record anywhere after it in its segment (found by searching
  for the magic and checking every candidate in full, its offset field included), or
  with a later segment holding any non-zero byte, is damage in the middle of the log:
  acknowledged data lies beyond it. Start-up stops with StoreError naming the segment
  and position, unless ``StoreConfig.truncate_corrupt_tail`` is set, in which case the
  log is cut at the bad record and every later segment is deleted (logged at ERROR).
  ``StoreConfig.keep_corrupt_records`` loses only the bad record instead, when where it ends
  is sure (its head sound and a valid record or the end marker right after it): it stays in
  place, indexed (a pull stops at it: RECORD_CORRUPT), replayed into nothing, and logged at
  ERROR with topic, queue and offset; the log after it is recovered as usual. Its offset goes
  into the store's ``corrupt_kept`` file, so later starts keep it again without the flag.
* A segment file shorter than ``segment_size`` is re-extended with zeros first; its
  missing tail then reads as zeros and the rule above applies.
* Below the checkpoint's flushed offset there is no torn tail: nothing is checkpointed
  before it is flushed, so a crash cannot damage those bytes. A bad record, or the end of
  the data (a cut file, a deleted last segment, no segment at all) below it is treated as
  damage in the middle: StoreError, or with ``truncate_corrupt_tail`` the cut (logged at
  ERROR) and a new checkpoint at the new end, so the next start does not refuse it again.

Consume queues: units that point at or past the new end are dropped; each record
scanned is checked against its unit, tag included (a wrong unit is rewritten from there on) and
missing units are appended. A queue with a gap (units lost before the scanned range, or
a file before its last one found cut short, ending in a zeroed unit or missing when it
loaded) is rebuilt by a second, CRC-free pass over the whole log; units that no longer
exist in the log become pre-blank units, up to the offset the queue had reached. An all-zero
unit with units after it, anywhere in a queue's files (a lost page, a zeroed range), is damage
too: the scan rewrites it when its record is in the verified range, otherwise the queue is
rebuilt that way (logged at ERROR with file and byte; ``RecoveryReport.queues_rebuilt`` and
the broker's ``txmq_store_consume_queues_rebuilt_total`` count it), so a pull never meets it. Dispatch listeners are called, with
``recovering=True``, for every valid record at or after the checkpoint offset.
"""
from __future__ import annotations

import logging
import os
import struct
import time
from typing import Callable

from protocol.errors import RecordError, StoreError
from protocol.message import BLANK_MAGIC, MESSAGE_MAGIC, POS_QUEUE_ID, POS_QUEUE_OFFSET, peek_record, validate_topic
from protocol.record import MESSAGE_MAGIC_BYTES, MIN_RECORD_SIZE, RECORD_HEAD, check_tail_fields, read_index_fields

from .checkpoint import Checkpoint
from .commit_log import CommitLog, Segment
from .consume_queue import ConsumeQueue
from .mapped_file import keep_files, last_nonzero, parse_name, remove_files
from .progress import Progress
from .replica import tag_of
from .results import DispatchInfo, RecoveryReport, Truncation

log = logging.getLogger("txmq.store")



class BadRecord(Exception):
    pass


def parse_record(seg: Segment, pos: int, check_crc: bool = True, torn: bool = True):
    """(size, queue id, queue offset, sys flag, store ts, prepared offset, topic, props span) or BadRecord.

    Reads only below ``seg.reserved``, which load_segments sets to the file's first hole.
    The fields are read by protocol.record; what they must say of this segment is judged here.
    With ``check_crc`` and ``torn`` the topic and properties are checked too (check_tail_fields): the body
    CRC leaves them unguarded, and a crash can lose their pages while the head and body reached the disk.
    """
    limit = seg.size - 8
    if pos + MIN_RECORD_SIZE > limit:
        raise BadRecord("no room for a record before the end marker")
    if pos + MIN_RECORD_SIZE > seg.reserved:
        raise BadRecord("no data on disk here")
    size, magic, crc, qid, _flag, qoff, phys, sys_flag = RECORD_HEAD.unpack_from(seg.mm, pos)
    if magic != MESSAGE_MAGIC:
        raise BadRecord(f"magic {magic & 0xFFFFFFFF:#010x} is not a record's")
    if size < MIN_RECORD_SIZE or pos + size > limit:
        raise BadRecord(f"size {size} does not fit the segment")
    if pos + size > seg.reserved:
        raise BadRecord(f"size {size} runs into a hole at byte {seg.reserved}")
    if phys != seg.start + pos:
        raise BadRecord(f"its offset field says {phys}, not {seg.start + pos}")
    try:
        ts, prepared, topic, span = read_index_fields(seg.view, pos, size, sys_flag, crc if check_crc else None)
        if check_crc and torn:
            check_tail_fields(seg.mm, topic, span)
    except RecordError as exc:
        raise BadRecord(str(exc)) from None
    return size, qid, qoff, sys_flag, ts, prepared, topic, span


def _tag(seg: Segment, span, topic: str = "", ts: int = 0, rule: Callable | None = None) -> int:
    lo, n = span
    return tag_of(seg.mm[lo:lo + n], topic, ts, rule)


def data_end(seg: Segment, lo: int) -> int:
    """One past the last non-zero byte at or after ``lo`` (``lo`` if none), read with pread, never the mapping."""
    return last_nonzero(seg.fd, lo, seg.size)


def _valid_record_in(seg: Segment, lo: int, hi: int, tail_from: int = 0) -> int | None:
    """Position of a fully valid record starting in (lo, hi), found through its magic, or None. Topic and
    properties are checked for the zeros of a torn record only at or past ``tail_from``."""
    at = lo + 1
    hi = min(hi, seg.reserved)      # the mapping is read only where the file has data
    while True:
        hit = seg.mm.find(MESSAGE_MAGIC_BYTES, at + 4, hi)
        if hit < 0:
            return None
        try:
            parse_record(seg, hit - 4, torn=seg.start + hit - 4 >= tail_from)
            return hit - 4
        except BadRecord:
            at = hit - 3


def load_segments(clog: CommitLog, truncate_corrupt: bool) -> int | None:
    """Map every segment; returns the index of the first one found short, if any."""
    short = None
    seg_size = clog.seg_size
    starts = sorted(s for s in map(parse_name, os.listdir(clog.directory)) if s is not None)
    for i, start in enumerate(starts):
        name = f"{start:020d}"
        if start % seg_size or (i and start != starts[i - 1] + seg_size):
            raise StoreError(f"segment {name} does not follow the previous one for segment_size={seg_size} "
                             "(was segment_size changed, or a segment deleted from the middle?)", segment=name)
        found = os.stat(os.path.join(clog.directory, name)).st_size
        if found > seg_size:
            raise StoreError(f"segment {name} is {found} bytes but segment_size is {seg_size} "
                             "(was segment_size changed?)", segment=name, position=seg_size)
        if found < seg_size and i < len(starts) - 1 and not truncate_corrupt:
            raise StoreError(f"segment {name} is cut short at {found} of {seg_size} bytes and later segments "
                             "exist: the log is damaged in the middle (--keep-corrupt-records cannot skip it: what "
                             "is lost has no known extent). To start anyway, discarding the log from the first bad "
                             "record on, set truncate_corrupt_tail=True (the broker's --truncate-corrupt-tail)",
                             segment=name, position=found)
        seg, found = Segment.open(os.path.join(clog.directory, name), start, seg_size)
        seg.reserved = seg.allocated_prefix()      # what recovery may read through the mapping
        clog.segments.append(seg)
        if found < seg_size:
            log.warning("segment %s was %d bytes, short of %d; extended with zeros", name, found, seg_size)
            short = i if short is None else short
    return short


def recover(clog: CommitLog, queues: dict[tuple[str, int], ConsumeQueue], make_queue: Callable,
            checkpoint: Checkpoint | None, verify_segments: int, truncate_corrupt: bool,
            listeners: list, tag_rule: Callable | None = None, nul_free_from: int = 0,
            deleted: dict[str, int] | None = None, cut_from: int | None = None, keep_corrupt: bool = False,
            known_corrupt: frozenset[int] = frozenset()) -> RecoveryReport:
    """``nul_free_from``: where the records of brokers that refuse NUL in topic and properties begin (store
    file nul_free_from); before it, a NUL there may be an older broker's data, not a torn page.
    ``deleted``: topic -> log offset its queues were deleted at (consume_queue.TOMBSTONE): its records
    below that offset are indexed nowhere. ``cut_from``: where a copy of an older broker's record with a NUL
    began that its mark never vouched for (manifest.read_nul_copy_from): the log is cut there.
    ``keep_corrupt``: a damaged record whose extent is sound (see _keep_corrupt) is kept in place with the log
    after it, instead of refusing the start; ``known_corrupt``: log offsets of records kept so at an earlier
    start (MessageStore's corrupt_kept file), kept again without being asked."""
    deleted = deleted or {}
    cut_from = (1 << 63) - 1 if cut_from is None else cut_from
    began = time.monotonic()
    short = load_segments(clog, truncate_corrupt)
    segs = clog.segments
    point = checkpoint.flushed_offset if checkpoint else 0
    tail_from = max(point, nul_free_from)
    first = 0
    if checkpoint is not None and segs:
        at = clog.locate(point)
        ck_idx = (0 if point < segs[0].start else len(segs) - 1) if at is None else segs.index(at[0])
        first = min(ck_idx, max(0, len(segs) - verify_segments), len(segs) if short is None else short)
    report = RecoveryReport(point, segs[first].start if segs else 0, 0)
    end, last_ts = None, 0
    gaps = {key for key, cq in queues.items() if cq.damaged is not None}     # units lost before the last file
    expect: dict[tuple[str, int], int] = {}     # queue offset the next record of each queue must carry
    named: set[str] = set()     # topic names judged sound in this scan

    progress = Progress(f"recovering the commit log from offset {report.scanned_from}", len(segs) - first,
                        "segments")
    for i in range(first, len(segs)):
        progress.step(i - first)
        seg, pos = segs[i], 0
        while True:
            if seg.start + pos >= cut_from:
                end = _cut_unvouched_copy(clog, seg, pos, report)
                break
            corrupt = False
            try:
                # below the checkpoint nothing is torn (it was flushed first), and before nul_free_from an older
                # broker may have stored a NUL: records there keep the old checks
                fields = parse_record(seg, pos, torn=seg.start + pos >= tail_from)
                if fields[6] not in named and seg.start + pos >= nul_free_from:
                    # (below the checkpoint: a TOPIC byte flipped at rest, outside the body CRC, read as sound,
                    # filed the message under the damaged name, lost with no word; one set lookup a record)
                    _check_topic(fields[6], named)
                if known_corrupt and seg.start + pos in known_corrupt and seg.start + pos < tail_from:
                    # kept for damaged properties, judged only past the checkpoint (a TOPIC before nul_free_from):
                    # below it at a later start, it was read as sound (replayed, served)
                    try:
                        check_tail_fields(seg.mm, fields[6], fields[7])
                    except RecordError as exc:
                        raise BadRecord(str(exc)) from None
            except BadRecord as bad:
                total, magic = peek_record(seg.mm, pos) if pos + 8 <= seg.reserved else (0, 0)
                if magic == BLANK_MAGIC and total == seg.size - pos:
                    seg.written = pos
                    break
                fields = (_keep_corrupt(seg, pos, str(bad), report, tail_from,
                                        lambda t, q, o, n, i=i, p=pos: _kept_owner(segs, i, p, n, t, q, o, queues,
                                                                                    expect))
                          if keep_corrupt or seg.start + pos in known_corrupt else None)
                if fields is None:
                    end = _end_of_data(clog, i, pos, str(bad) if (total, magic) != (0, 0) else None,
                                       truncate_corrupt, report, point, tail_from)
                    seg.written = pos
                    break
                corrupt = True
            size, qid, qoff, sys_flag, ts, prepared, topic, span = fields
            if not corrupt:                 # (a damaged record's store timestamp may be damaged too)
                if seg.first_ts < 0 or ts < seg.first_ts:     # the oldest: the clock may have stepped back
                    seg.first_ts = ts
                seg.last_ts = last_ts = ts
            phys = seg.start + pos
            report.records_scanned += 1
            if sys_flag & 0x4 and qoff and _typed_away(seg, pos, size, (topic, qid), qoff, sys_flag, queues, expect,
                                                       lambda: _next_qoff(segs, i, pos + size, (topic, qid))):
                sys_flag ^= 0x4
            if not sys_flag & 0x4 and not (deleted and phys < deleted.get(topic, -1)):
                key = (topic, qid)
                want = expect.get(key)
                filed = _filed_elsewhere(seg, pos, size, key, qoff, queues) if want is None else None
                if filed is not None:
                    qoff = filed
                # rare: no call, no closure per record otherwise (want is None once a queue and scan)
                elif want is not None and qoff != want or want is None and qoff > _units(queues, key):
                    moved = _misfiled(seg, pos, size, key, qoff, queues,
                                      lambda: _owner_by_log(segs, i, pos, size, key, qoff, expect) if want is None
                                      else None)
                    if moved is not None:
                        key = (topic, moved)
                        want = expect.get(key)
                    if want is not None and qoff != want:
                        qoff = _checked_qoff(seg, pos, key, qoff, want, lambda: _next_qoff(segs, i, pos + size, key))
                key = _replay_unit(queues, make_queue, key, qoff, phys, size, seg, span, gaps, report,
                                   ts, tag_rule)
                expect[key] = qoff + 1
            if listeners and phys >= point and not corrupt:
                info = DispatchInfo(topic, qid, qoff if not sys_flag & 0x4 else -1, phys, size,
                                    _tag(seg, span, topic, ts, tag_rule),
                                    ts, sys_flag, prepared, True)
                for fn in listeners:
                    fn(info)
                report.dispatched += 1
            pos += size
        if end is not None:
            break
    if not segs:
        _short_of_checkpoint(clog, 0, point, "there is no segment", truncate_corrupt)
        clog.new_segment(0)
        end = 0
    elif end is None:                       # the last segment ends with an end marker
        end = segs[-1].start + clog.seg_size
        _short_of_checkpoint(clog, end, point, f"the last segment {segs[-1].name} is sealed", truncate_corrupt)
        clog.new_segment(end).written = 0
    at = clog.locate(end)
    if at is not None:
        report.removed_segments += clog.drop_segments_from(segs.index(at[0]) + 1)
    clog.set_end(end, last_ts or (checkpoint.store_timestamp if checkpoint else 0))
    report.end_offset = end

    for key, cq in queues.items():
        report.cq_units_dropped += cq.truncate(cq.first_unit_at_or_after(end, lo=0))
    for key, cq in queues.items():      # after the cut: zeros past the log's recovered end went with it
        if cq.zeroed is not None and key not in gaps:
            _check_zeroed(key, cq, gaps)
    report.queues_rebuilt = sorted(f"{t}-{q}" for t, q in gaps)
    if gaps:
        _fill_gaps(clog, queues, gaps, end, report, tag_rule, deleted)
    left = []
    for cq in queues.values():
        dead = cq.expire_before(clog.min_offset)
        if cq.leftovers:        # refused at load: these wait behind them (unlinked, a gap between)
            cq.leftovers += keep_files(dead)
            dead = []
        failed = remove_files(dead)
        if failed is not None:
            left.append(failed)
            cq.leftovers += [mf.path for mf in dead if os.path.exists(mf.path)]
        clog.qoffsets[(cq.topic, cq.queue_id)] = cq.max_offset
    if left:
        # Wholly below the log's start (a removal that could not unlink them): out of their queues all the same.
        # Raised, the broker did not start for a file it does not need.
        log.warning("consume-queue files of %d queue(s) below the log's start could not be removed (the first: %s); "
                    "their queues start past them: make them removable (ls -l, lsattr; chattr -i) or see dmesg "
                    "(EIO); the next segment removal or start removes them", len(left), left[0])
    report.seconds = time.monotonic() - began
    log.info("recovered the commit log: %d records verified from offset %d, end %d, %d cut, "
             "%d consume-queue units appended and %d dropped, in %.3f s", report.records_scanned,
             report.scanned_from, end, len(report.truncations), report.cq_units_appended,
             report.cq_units_dropped, report.seconds)
    return report


def _check_topic(topic: str, named: set[str]) -> None:
    """BadRecord unless ``topic`` is a name the broker accepts; remembered in ``named`` when it is."""
    why = validate_topic(topic)
    if why is not None:
        raise BadRecord(f"topic: {why}")
    named.add(topic)


def _sound_extent(seg: Segment, pos: int, tail_from: int):
    """The fields of the damaged record at ``pos`` if where it ends is sure, else None: its head is sound (magic,
    a size that fits, its own offset) and a fully valid record or the segment's end marker starts right after
    it. Only its body, topic or properties fail their checks; a torn tail (zeros after it) is never this."""
    try:
        fields = parse_record(seg, pos, check_crc=False)
    except BadRecord:
        return None
    nxt = pos + fields[0]
    if _end_marker_at(seg, nxt):
        return fields
    try:
        parse_record(seg, nxt, torn=seg.start + nxt >= tail_from)
    except BadRecord:
        return None
    return fields


def _keep_corrupt(seg: Segment, pos: int, reason: str, report: RecoveryReport, tail_from: int,
                  owner: Callable[[str, int, int, int], str | None] = lambda t, q, o, n: None):
    """Keep the damaged record at ``pos`` where it lies (keep_corrupt_records): the log after it stays. Its queue
    unit stays too, and a pull stops at it with RECORD_CORRUPT (the store stops reads at a kept record) until
    the group is moved past it; it is replayed into nothing else (transactions, schedule, index).

    Its TOPIC is outside the body CRC: one that is no topic name (a flipped bit) is read as ``owner``'s (the queue
    of its id whose unit at its offset points at it, or whose sequence in the log misses exactly it). Filed under
    the damaged name, its own queue was one short, every later record of it had its offset rewritten one down, and
    no pull met it."""
    fields = _sound_extent(seg, pos, tail_from)
    if fields is None:
        return None
    size, qid, qoff, sys_flag, _ts, _p, topic, _span = fields
    read_as = owner(topic, qid, qoff, size) if validate_topic(topic) is not None else None
    if read_as is not None:
        log.error("commit log segment %s byte %d: the damaged record's TOPIC reads %r, no topic name; it is the "
                  "record queue %d of %s misses at offset %d (filed there)", seg.name, pos, topic, qid, read_as, qoff)
        topic = read_as
        fields = (*fields[:6], topic, fields[7])
    what = f"{topic}-{qid} queue offset {qoff}, sys flag {sys_flag:#x}"
    log.error("keep_corrupt_records: commit log segment %s byte %d, %d bytes (%s) is damaged (%s); kept in place "
              "with the log after it: it is lost, not served (a pull of %s-%d stops at offset %d until the group "
              "is moved past it: python -m broker admin reset-offset GROUP %s --queue %d --offset %d)", seg.name, pos,
              size, what, reason, topic, qid, qoff, topic, qid, qoff + 1)
    report.corrupt_kept.append(Truncation(seg.name, pos, size, f"{what}: {reason}"))
    return fields


def _kept_owner(segs: list, i: int, pos: int, size: int, topic: str, qid: int, qoff: int, queues: dict,
                expect: dict) -> str | None:
    """The topic of a kept damaged record whose TOPIC field is no name: the one other topic whose queue ``qid``
    has a unit at ``qoff`` pointing at it, else whose previous record in the log is one before it and next one
    after it; None when not exactly one."""
    phys = segs[i].start + pos
    found = {t for (t, q), cq in queues.items() if q == qid and t != topic and qoff < cq.max_offset
             and (cq.unit_on_disk(qoff) or (0, 0))[:2] == (phys, size)}
    if not found:
        found = {t for (t, q), want in expect.items() if q == qid and t != topic and want == qoff
                 and _next_qoff(segs, i, pos + size, (t, q)) == qoff + 1}
    return found.pop() if len(found) == 1 else None


def _cut_unvouched_copy(clog: CommitLog, seg: Segment, pos: int, report: RecoveryReport) -> int:
    """The log's end at a copy of an older broker's NUL record whose mark was never written (a crash came
    between its write and its mark): neither it nor anything after it was acknowledged."""
    tail_end = data_end(seg, pos)
    seg.written = pos
    if tail_end > pos:
        reason = "a copy of an older broker's record with a NUL, written before a crash, never vouched for"
        log.warning("torn tail: cut %d bytes from segment %s at byte %d (%s)", tail_end - pos, seg.name, pos,
                    reason)
        clog.zero(seg, pos, tail_end)
        report.truncations.append(Truncation(seg.name, pos, tail_end - pos, reason))
    return seg.start + pos


def _short_of_checkpoint(clog: CommitLog, end: int, point: int, what: str, truncate_corrupt: bool) -> None:
    """The log ends at ``end`` below the checkpoint's flushed offset: acknowledged, flushed data is gone (a file
    deleted or cut by hand or a disk; a crash cannot do it, as nothing is checkpointed before it is flushed)."""
    if end >= point:
        return
    text = (f"the commit log ends at offset {end} ({what}), but the checkpoint says every byte below {point} was "
            "flushed: acknowledged messages are missing (a segment deleted or cut short?)")
    if not truncate_corrupt:
        raise StoreError(text + ". To start anyway with the log as it is, set truncate_corrupt_tail=True (the "
                         "broker's --truncate-corrupt-tail)",
                         segment=f"{end - end % clog.seg_size:020d}", position=end % clog.seg_size)
    log.error("truncate_corrupt_tail: %s; starting with the log as it is", text)


def _end_of_data(clog: CommitLog, i: int, pos: int, reason: str | None, truncate_corrupt: bool,
                 report: RecoveryReport, point: int = 0, tail_from: int = 0) -> int:
    """Decide torn tail, clean end or mid-log damage at segment ``i``, byte ``pos``; returns the log end.

    Below ``point`` (the checkpoint's flushed offset) there is no torn tail: those bytes were flushed before the
    checkpoint said so, so a bad record or the end of the data there is damage, as in the middle of the log."""
    segs = clog.segments
    seg = segs[i]
    tail_end = data_end(seg, pos)
    later = next((s for s in segs[i + 1:] if data_end(s, 0) > 0), None)
    vouched = seg.start + pos < point
    if reason is None and tail_end <= pos and later is None and not vouched:
        return seg.start + pos                              # zeros: the clean end of the data
    reason = reason or "zeros where a record should start"
    valid_at = _valid_record_in(seg, pos, tail_end, tail_from) if tail_end > pos else None
    if valid_at is not None or later is not None or vouched:
        where = (f"a valid record follows at byte {valid_at}" if valid_at is not None
                 else f"later segment {later.name} holds data" if later is not None
                 else f"the checkpoint says every byte below offset {point} was flushed")
        if not truncate_corrupt:
            # Past the checkpoint the same shape is what a power loss part-way through one flush leaves (the
            # disk wrote a later page of the write before this one's; in sync mode none of it was acknowledged):
            # it cannot be told from a damaged acknowledged record, so it is refused, saying both. Keeping the
            # records after the hole is no way out: a commit's message and its op record are one write, and the
            # op kept without its message is a transaction decided and never delivered.
            lost = (f"{tail_end - pos} bytes to the end of the data" if later is None
                    else f"{tail_end - pos} bytes and segments {[s.name for s in segs[i + 1:]]}")
            why = ("so acknowledged data lies beyond it" if vouched else
                   "so data that may have been acknowledged lies beyond it (or a power loss part-way through a "
                   "flush wrote later pages of that write before this one's; then none of it was acknowledged)")
            sound = _sound_extent(seg, pos, tail_from)
            keep = (f"To start losing only this record ({sound[0]} bytes), the intact ones after it kept and served, "
                    "set keep_corrupt_records=True (the broker's --keep-corrupt-records). " if sound is not None else
                    "Where this record ends is unknown (its head is damaged): it cannot be skipped alone. ")
            raise StoreError(f"commit log damaged at segment {seg.name} byte {pos} (file {seg.path}; {reason}) "
                             f"and {where}, {why}. {keep}"
                             f"To start discarding this record and everything after it ({lost}), set "
                             "truncate_corrupt_tail=True (the broker's --truncate-corrupt-tail)",
                             segment=seg.name, position=pos)
        log.error("truncate_corrupt_tail: cutting the commit log at segment %s byte %d (%s; %s): %d bytes "
                  "and segments %s discarded", seg.name, pos, reason, where, tail_end - pos,
                  [s.name for s in segs[i + 1:]])
    else:
        log.warning("torn tail: cut %d bytes from segment %s at byte %d (%s)", tail_end - pos, seg.name, pos,
                    reason)
    if tail_end > pos:
        clog.zero(seg, pos, tail_end)
    report.truncations.append(Truncation(seg.name, pos, tail_end - pos, reason))
    return seg.start + pos


def _checked_qoff(seg: Segment, pos: int, key, qoff: int, want: int, next_qoff: Callable[[], int | None]) -> int:
    """The record's queue offset, which is not ``want`` (the previous record's + 1), repaired when its header
    is damaged there.

    A queue's records follow one another in the log: each carries the previous one's offset + 1, or 0 when
    the topic was deleted and made again. The field is outside the body CRC, so a flipped bit there went
    unseen: a jump up made the rebuild pad the queue to it (every message before it gone from the queue),
    a jump down rewrote the queue's units from there and left the record's own unit pre-blank (skipped).

    A 0 is a new run only if the queue's next record in the log (``next_qoff``) does not go on with the old
    one (``want`` + 1): taken on its word, a 16 flipped to 0 started the queue over there and every later
    record of it was "repaired" to follow (1, 2, ...): the messages before it gone from the queue, and the
    offsets of the intact ones after it rewritten in the log.
    """
    if qoff == 0 and next_qoff() != want + 1:
        return qoff
    log.error("commit log segment %s byte %d: a record of %s-%d says queue offset %d where the queue's previous "
              "record says %d: its header is damaged; rewritten to %d", seg.name, pos, *key, qoff, want - 1, want)
    os.pwrite(seg.fd, struct.pack(">q", want), pos + POS_QUEUE_OFFSET)
    return want


def _filed_elsewhere(seg: Segment, pos: int, size: int, key, qoff: int, queues: dict) -> int | None:
    """For the first record of a queue in a scan (none before it to check its QUEUEOFFSET against): the offset of
    the queue's unit naming exactly it when that is not the field's, the field rewritten (None: nothing to repair).

    The field is outside the body CRC. Damaged 0 -> 1 in the queue's first record, the unit at 1 (the next
    record's) was taken as stale: the queue rewritten from there, the record filed twice, and every intact record
    after it rewritten one up in the log; damaged to a high bit, the start asked for a queue the disk cannot hold.
    Once a queue and scan: a unit read, a binary search only when that unit names another record."""
    cq = queues.get(key)
    if cq is None:
        return None
    phys = seg.start + pos
    if qoff < cq.max_offset:
        unit = cq.unit(qoff)
        if unit is None or unit[:2] == (phys, size) or not unit[1]:
            return None
    at = cq.first_unit_at_or_after(phys)
    unit = cq.unit(at) if at < cq.max_offset else None
    if unit is None or unit[:2] != (phys, size) or at == qoff:
        return None
    log.error("commit log segment %s byte %d: a record of %s-%d says queue offset %d where its queue's unit %d names "
              "it: its header is damaged; rewritten to %d", seg.name, pos, *key, qoff, at, at)
    os.pwrite(seg.fd, struct.pack(">q", at), pos + POS_QUEUE_OFFSET)
    return at


_LOOKAHEAD_RECORDS = 65536


def _typed_away(seg: Segment, pos: int, size: int, key, qoff: int, sys_flag: int, queues: dict, expect: dict,
                next_qoff: Callable[[], int | None]) -> bool:
    """True (logged) if the record at ``pos``, typed PREPARED or ROLLBACK (TRANSACTION bit 0x4: no consume-queue
    unit), is a plain or COMMIT record whose bit flipped at rest: those types are stored with QUEUEOFFSET 0 (spec
    7.2; no send stores them), and it carries its queue's next offset (the previous record's + 1; else its queue's
    unit there points at it, or its queue's next record in the log carries the one after). The SYSFLAG is outside
    the body CRC: taken as read, its unit was dropped, every later record of its queue had its QUEUEOFFSET
    rewritten one down in the log ("its header is damaged"), and the message was served to no one, unsaid."""
    want = expect.get(key)
    phys = seg.start + pos
    if want is not None:
        ours = qoff == want
    else:
        cq = queues.get(key)
        ours = (cq is not None and qoff < cq.max_offset and (cq.unit_on_disk(qoff) or (0, 0))[:2] == (phys, size)
                or next_qoff() == qoff + 1)
    if ours:
        log.error("commit log segment %s byte %d: a record of %s-%d at queue offset %d has SYSFLAG %#x, a transaction "
                  "type stored with no queue offset: the bit 0x4 is damaged (outside the body CRC); read as %#x, "
                  "indexed", seg.name, pos, key[0], key[1], qoff, sys_flag, sys_flag ^ 0x4)
    return ours


def _units(queues, key) -> int:
    cq = queues.get(key)
    return cq.max_offset if cq is not None else 0


def _misfiled(seg: Segment, pos: int, size: int, key, qoff: int, queues: dict, by_log: Callable) -> int | None:
    """The queue a record whose QUEUEID field was damaged belongs to, its field rewritten; None if it is not that.

    The field is outside the body CRC. A flipped bit there filed the message under a queue its topic does not
    have (pulled by no consumer: lost without a word) or under a sibling, where it was taken for a damaged
    QUEUEOFFSET or a stale unit: that queue's units, or offsets in the log, rewritten from there, the message
    delivered from the wrong queue and its own queue one short. Its queue is the one other queue of the topic
    whose unit at that offset points at it; with no such unit, ``by_log()`` (or None)."""
    topic, claimed = key
    phys = seg.start + pos
    found = {q for (t, q), cq in queues.items() if t == topic and q != claimed and qoff < cq.max_offset
             and (cq.unit_on_disk(qoff) or (0, 0))[:2] == (phys, size)}
    queue = found.pop() if len(found) == 1 else None if found else by_log()
    if queue is None:
        return None
    log.error("commit log segment %s byte %d: a record of %s says queue %d, offset %d, where queue %d of its topic "
              "is missing exactly that offset: its QUEUEID field is damaged; rewritten to %d", seg.name, pos, topic,
              claimed, qoff, queue, queue)
    os.pwrite(seg.fd, struct.pack(">i", queue), pos + POS_QUEUE_ID)
    return queue


def _owner_by_log(segs: list, i: int, pos: int, size: int, key, qoff: int, expect: dict) -> int | None:
    """For a record filed under a queue that has no record yet at an offset past 0 (a queue id its topic likely
    does not have): the one other queue of its topic whose previous record in the log is one before it and whose
    next one after it. (Not one with no next record: a queue whose files were lost also starts past 0 in the scan,
    and a sibling that ends waiting for that very offset would take its record.)"""
    topic, claimed = key
    found = [q for (t, q), want in expect.items() if t == topic and q != claimed and want == qoff
             and _next_qoff(segs, i, pos + size, (t, q)) == qoff + 1]
    return found[0] if len(found) == 1 else None


def _end_marker_at(seg: Segment, pos: int) -> bool:
    """A segment's end marker (BLANK magic, TOTALSIZE the bytes left) starts at ``pos``."""
    total, magic = peek_record(seg.mm, pos) if pos + 8 <= seg.reserved else (0, 0)
    return magic == BLANK_MAGIC and total == seg.size - pos


def _next_qoff(segs: list, i: int, pos: int, key, end: int | None = None) -> int | None:
    """The queue offset the next record of ``key`` in the log carries, from segment ``i`` byte ``pos`` (headers
    only, no CRC); None when there is none before the end of the data (or ``end``), damage, or none within
    _LOOKAHEAD_RECORDS records (a queue made again with one message must not cost a scan of the whole log)."""
    budget = _LOOKAHEAD_RECORDS
    for seg in segs[i:]:
        while end is None or seg.start + pos < end:
            budget -= 1
            if budget < 0:
                return None
            try:
                size, qid, qoff, sys_flag, _ts, _p, topic, _span = parse_record(seg, pos, check_crc=False)
            except BadRecord:
                if _end_marker_at(seg, pos):
                    break                           # on in the next segment
                return None
            if not sys_flag & 0x4 and (topic, qid) == key:
                return qoff
            pos += size
        else:
            return None
        pos = 0
    return None


def _check_zeroed(key, cq: ConsumeQueue, gaps: set) -> None:
    """A unit load found all zeros (a lost page, a zeroed range) is damage, not the end of the queue: the
    units after it are real. The scan rewrote it if its record was in the verified range; if it is still
    zero, the queue is rebuilt from the whole log, or a pull there would skip messages without a word."""
    off, name, byte = cq.zeroed
    cq.zeroed = None
    if off >= cq.max_offset:            # cut with the log's torn tail: nothing was lost there
        return
    unit = cq.unit_on_disk(off)
    if unit is None or unit[1] != 0:
        log.warning("consume queue %s-%d: the zeroed unit %d (file %s byte %d) was rewritten from the verified "
                    "part of the log", *key, off, name, byte)
        return
    log.error("consume queue %s-%d: file %s is zeroed at byte %d (queue offset %d) with units after it: units "
              "are missing; rebuilding the queue from the commit log", *key, name, byte, off)
    gaps.add(key)


def _replay_unit(queues, make_queue, key, qoff, phys, size, seg, span, gaps, report, ts=0, rule=None):
    """Bring ``key``'s unit at ``qoff`` in line with the record; returns the key it is filed under (another queue
    of its topic when its unit there says the record's QUEUEID field is damaged: _misfiled)."""
    cq = queues.get(key)
    if cq is None:
        if validate_topic(key[0]) is not None or key[1] < 0:
            log.warning("record at %d has topic %r queue %d, which cannot be a consume queue; not indexed",
                        phys, key[0], key[1])
            return key
        cq = queues[key] = make_queue(key)
    if key in gaps:
        return key
    if qoff < cq.max_offset:
        unit = cq.unit(qoff)
        # the tag too: a unit torn by the crash may hold the offset and size but not the tag, which
        # filters the message out of tag subscriptions (or, for a delayed one, makes it due at once)
        if unit is not None and unit[:2] == (phys, size) and unit[2] == _tag(seg, span, key[0], ts, rule):
            return key
        if unit is not None and unit[:2] != (phys, size):
            moved = _misfiled(seg, phys - seg.start, size, key, qoff, queues, lambda: None)
            if moved is not None:
                return _replay_unit(queues, make_queue, (key[0], moved), qoff, phys, size, seg, span, gaps, report,
                                    ts, rule)
        log.warning("consume queue %s-%d: unit %d does not match the log; rewriting from there", *key, qoff)
        report.cq_units_dropped += cq.truncate(qoff)
    if qoff == cq.max_offset:
        cq.append(phys, size, _tag(seg, span, key[0], ts, rule))
        report.cq_units_appended += 1
    else:
        gaps.add(key)
    return key


def _fill_gaps(clog: CommitLog, queues, gaps: set, end: int, report: RecoveryReport, rule=None,
               deleted: dict[str, int] | None = None) -> None:
    """Rebuild queues that lost units before the verified range from the whole log (no CRC: read-only)."""
    log.warning("consume queues %s lack units before the verified range; rebuilding them from the whole log",
                sorted(gaps))
    had = {key: queues[key].max_offset for key in gaps}
    for key in gaps:
        report.cq_units_dropped += queues[key].truncate(0)
    seen: set = set()           # queues whose previous record this pass appended: the next must follow it
    named: set[str] = set()     # topic names judged sound in this pass
    for si, seg in enumerate(clog.segments):
        pos = 0
        while seg.start + pos < end:
            try:
                size, qid, qoff, sys_flag, ts, _p, topic, span = parse_record(seg, pos, check_crc=False)
            except BadRecord as bad:
                if _end_marker_at(seg, pos):
                    break
                # Damage before the verified range (the scan does not read it). Breaking here took every
                # record after it in this segment for gone: their units became pre-blank and pulls skipped
                # them. Go on from the next valid record; only the damaged one is lost.
                hi = data_end(seg, pos) if seg.start + seg.size > end else seg.size
                nxt = _valid_record_in(seg, pos, hi)
                log.error("rebuilding consume queues: commit log damaged at segment %s byte %d (%s); %s", seg.name,
                          pos, bad, f"going on from the valid record at byte {nxt}" if nxt is not None else
                          "no valid record after it in this segment")
                seen.clear()                # a record was lost here: the next of its queue may follow a gap
                if nxt is None:
                    break
                pos = nxt
                continue
            key = (topic, qid)
            if topic not in named and key not in gaps:
                if validate_topic(topic) is None:
                    named.add(topic)
                else:
                    # A TOPIC byte flipped at rest (outside the body CRC; the start judges none in old segments):
                    # taken for another queue's, the next record of its own was "repaired" one down in the log,
                    # and the message skipped without a word. Filed where its queue misses exactly it, a pull
                    # stops at it (RECORD_CORRUPT: the reads of old segments judge the topic).
                    owners = [k for k in gaps if k[1] == qid and queues[k].max_offset == qoff]
                    if len(owners) == 1:
                        key, topic = owners[0], owners[0][0]
            if sys_flag & 0x4 and qoff and key in gaps and _typed_away(
                    seg, pos, size, key, qoff, sys_flag, queues, {key: queues[key].max_offset} if key in seen else {},
                    lambda: _next_qoff(clog.segments, si, pos + size, key, end)):
                # as the start-up scan reads it: taken as typed, the record got no unit here and every later record
                # of its queue was "repaired" one down in the log
                sys_flag ^= 0x4
            if not sys_flag & 0x4 and key in gaps and not (deleted and seg.start + pos < deleted.get(topic, -1)):
                cq = queues[key]
                if key in seen and qoff != cq.max_offset:     # only a mismatch costs a call and a closure
                    qoff = _checked_qoff(seg, pos, key, qoff, cq.max_offset,
                                         lambda: _next_qoff(clog.segments, si, pos + size, key, end))
                seen.add(key)
                if qoff == 0 and cq.max_offset:
                    # The topic was deleted and made again: its new run replaces the old one, as in the start-up
                    # scan. Kept, the old run's units stayed and the new records (1, 2, ...) were taken for
                    # damage against it and rewritten in the log to follow it.
                    report.cq_units_dropped += cq.truncate(0)
                if qoff > cq.max_offset:
                    cq.pad(qoff)
                if qoff == cq.max_offset:
                    cq.append(seg.start + pos, size, _tag(seg, span, topic, ts, rule))
                    report.cq_units_appended += 1
            pos += size
    for key in gaps:        # records retention removed: their offsets stay taken (pre-blank), never reused
        queues[key].pad(had[key])
        queues[key].clear_damage_mark()
