"""Start-up of the transaction service, and the snapshot that keeps it short (docs/design.md).

``transactions/snapshot.json`` holds the undecided index, the op-queue offset up to which the decision
table is complete, the half-queue offset below which every half is pending or decided, and the decision
files that table had (one missing at start-up, or damaged, is rebuilt from the whole op queue). Start-up
replays only what the log holds after those two offsets; without a usable snapshot, the whole op queue
and the half queue from the saved progress rebuild everything (and a snapshot is written at once).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import struct

from broker.store.mapped_file import fsync_dir
from broker.store.progress import Progress
from broker.store.saved import crc_matches, timed, with_crc, write_synced
from protocol.errors import RecordError, StoreError
from protocol.message import Prop, decode_record, store_timestamp_pos
from protocol.record import body_crc_ok
from protocol.txlog import PROGRESS_GROUP

from ..store import GetStatus
from ..topics import HALF_TOPIC, OP_TOPIC
from .core import tx_from_half
from .decisions import DecisionTable, flush_maps
from .records import COMMIT, DEAD, DEAD_TOPIC, OP_TAG_CHECK, P_HALF, RESUME, parse_dead_letter, parse_op, plain_owner
from .salvage import (Damaged, damaged_op, foreign, misnamed, own_letter, settle, settle_unplaced, superseded,
                      unreadable)

log = logging.getLogger("txmq.transaction")

SNAPSHOT_VERSION = 1
_PHYS = struct.Struct(">q")          # a record's PHYSICALOFFSET, at byte 28
# A half's STORETIMESTAMP (the broker's clock) and BORNTIMESTAMP (its producer's) lie seconds apart. Neither is
# under the body CRC: a store time that is one flipped bit (an hour's worth or more) from being within a minute of
# its born time is taken for damage at rest and read with the bit put back (_unflipped_stamp). A producer's clock
# merely off by hours is no such bit: the chance its error lands within a minute of a power of two is small.
STAMP_CLOSE_MS = 60_000
_STAMP_BITS = range(22, 63)         # 2^22 ms: 70 min


def scan(store, topic: str, start: int | None = None, check_body: bool = False, undecodable: list | None = None):
    """The decoded records of ``topic`` queue 0 from ``start`` (or its first offset) to its end.

    ``check_body``: a record whose body fails its CRC (counted and logged by the store) is yielded with an empty
    body. An op record's body is the half's queue offset: a flipped digit there recorded the decision against
    another transaction; the caller takes it from the half its TXMQ_HALF property names instead.

    A record that cannot be decoded (a length inside it damaged at rest) is counted, logged and left out, its
    offset appended to ``undecodable``: raising, it kept the broker from starting at all."""
    offset = store.min_offset(topic, 0) if start is None else max(start, store.min_offset(topic, 0))
    end = store.max_offset(topic, 0)
    first, progress = offset, Progress(f"transactions: reading {topic} from queue offset {offset}", end - offset,
                                       "records", log)
    while offset < end:
        progress.step(offset - first)
        # (bodies unchecked: the index needs only the records' properties; a commit checks the half's body)
        got = store.get_messages(topic, 0, offset, 256, 8 * 1024 * 1024, None, verify=False)
        if got.status is GetStatus.QUEUE_DAMAGED:      # stopping here would forget the transactions after it
            raise StoreError(f"consume queue {topic}-0 is damaged at offset {offset} (see the log): it is marked "
                             "to be rebuilt from the commit log; start the broker again")
        if not got.buffers:
            if got.next_begin_offset <= offset:
                break
            offset = got.next_begin_offset
            continue
        # (units passed over, zeroed ones, leave the buffers' queue offsets unknown: each is looked up then)
        dense = topic == HALF_TOPIC and len(got.buffers) == got.next_begin_offset - offset
        for i, buf in enumerate(got.buffers):
            msg = _decoded(buf, None, store, topic)
            if msg is None:
                if undecodable is not None:
                    undecodable.append(_PHYS.unpack_from(buf, 28)[0])
                continue
            if topic == HALF_TOPIC and not filed_at(store, msg, offset + i if dense else None):
                continue
            if check_body and not body_crc_ok(buf):
                store.corrupt_record(msg.physical_offset, f"transaction recovery ({topic})")
                msg.body = b""
            yield msg
        offset = got.next_begin_offset


HALF_LOOKUP = "transaction half lookup"     # txmq_store_corrupt_records_total{read=...}: a half's QUEUEOFFSET


def filed_at(store, half, queue_offset: int | None = None) -> bool:
    """Whether the half queue files ``half`` at the queue offset its record says (QUEUEOFFSET, outside the body
    CRC; ``queue_offset``: where a walk of the queue found it, when known); if not, that field is put right from
    the queue, counted and said once. Taken as read, a decided transaction was looked up in the decision table
    under another's entry: a committed one damaged to name a dead letter's was resumed (SUCCESS), checked, and
    its producer's COMMIT delivered it twice; at start an undecided one naming a decided entry was left out of
    the pending index, never checked. False: no unit of the queue names it, and the one its field names is another
    record's (a unit lost at rest, or none there, leaves the field's word)."""
    phys = half.physical_offset
    if queue_offset is None:
        at = store.physical_offset_of(HALF_TOPIC, 0, half.queue_offset)
        if at == phys:
            return True
        queue_offset = store.queue_offset_at(HALF_TOPIC, 0, phys)
        if queue_offset is None and at is None:
            # No unit names it, nor another record at the offset its field says: that unit was lost at rest (zeroed,
            # marked damaged by that read; or a zeroed tail the start took for the queue's end), and the queue says
            # nothing against the field. Taken for "not a half", a sound dead-lettered half was refused a resume
            # ("no half message is stored there"), and its END or admin decision likewise.
            return True
    elif half.queue_offset == queue_offset:
        return True
    if store.count_corrupt(phys, HALF_LOOKUP):
        log.error("the half at commit-log offset %d says queue offset %d, but the half queue files it at %s: its "
                  "header is damaged; %s", phys, half.queue_offset, queue_offset,
                  "taken from the queue" if queue_offset is not None else "not taken for a half")
    if queue_offset is None:
        return False
    half.queue_offset = queue_offset
    return True


def _decoded(buf, phys: int | None, store=None, topic: str = ""):
    """The record in ``buf`` decoded, or None (logged, and counted when ``store`` is given) when a length inside it
    was damaged at rest. ``phys``: its offset (else read from its header, which the store checked)."""
    try:
        return decode_record(buf)[0]
    except RecordError as exc:
        phys = _PHYS.unpack_from(buf, 28)[0] if phys is None else phys
        if store is not None:
            store.count_corrupt(phys, f"transaction recovery ({topic})")
        log.error("transaction recovery: the record at commit-log offset %d%s cannot be decoded (%s): damaged at "
                  "rest, left out", phys, f" ({topic})" if topic else "", exc)
        return None


FOREIGN = "written for another store"


def read_snapshot(directory: str, store, why_not: list | None = None) -> dict | None:
    """The snapshot, or None (missing, unreadable, or not this store's as it is now: said in the log, and
    appended to ``why_not``)."""
    path = os.path.join(directory, "snapshot.json")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        snap = json.loads(raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("transaction snapshot %s unreadable (%s): rebuilding from the log", path, exc)
        return None
    why = None
    if not isinstance(snap, dict) or snap.get("version") != SNAPSHOT_VERSION:
        why = f"version {snap.get('version') if isinstance(snap, dict) else '?'}"
    elif snap.get("store_id") != store.store_id:
        why = FOREIGN
    elif not isinstance(snap.get("op_offset"), int) or not isinstance(snap.get("half_offset"), int):
        why = "its offsets are missing"
    elif snap["op_offset"] > store.max_offset(OP_TOPIC, 0):
        why = "it covers op records the log no longer has"
    elif snap["half_offset"] > store.max_offset(HALF_TOPIC, 0):
        why = "it covers half messages the log no longer has"
    elif not _pending_rows(snap.get("pending", [])):
        why = "its pending list is malformed"
    elif not isinstance(snap.get("decision_files", []), list) or not all(
            type(b) is int for b in snap.get("decision_files", [])):
        why = "its list of decision files is malformed"
    elif "crc" in snap and not crc_matches(raw, snap["crc"]):
        # (its last key: a flipped digit would leave valid JSON and drop an undecided transaction for good)
        why = "its checksum does not match: it was changed after it was written"
    if why:
        log.warning("transaction snapshot %s not used (%s): rebuilding from the log", path, why)
        if why_not is not None:
            why_not.append(why)
        return None
    return snap


def _pending_rows(rows) -> bool:
    """Whether ``rows`` is a list of [half offset, queue offset, checks] (all integers)."""
    return isinstance(rows, list) and all(
        isinstance(row, list) and len(row) == 3 and all(type(v) is int and v >= 0 for v in row) for row in rows)


async def recover(tx) -> None:
    """Rebuild ``tx``'s (a TransactionService) index and decision table."""
    ctx, store = tx.ctx, tx.ctx.store
    started = ctx.clock()
    tx.table = DecisionTable(os.path.join(tx.directory, "decisions"))
    half_end = store.max_offset(HALF_TOPIC, 0)
    gone = tx.table.forget_from(half_end)
    if gone:
        log.warning("transactions: %d decisions were for halves at queue offset %d or later, which the recovered "
                    "log no longer holds (it was cut); forgotten, as new halves take those offsets", gone, half_end)
    why_not: list[str] = []
    snap = read_snapshot(tx.directory, store, why_not)
    slave = getattr(ctx.config, "broker_role", "") == "SLAVE"
    legacy = slave and snap is not None and "written_as" not in snap
    if legacy:
        # An earlier txmq slave saved its start-up index at its stop as covering its whole log, and its half floor
        # with it: read, the halves its master took since were decided, and the slave, once promoted, never
        # checked them. Which broker wrote this one cannot be told (a demoted master's is sound): rebuilt from
        # the whole log once, the floor left aside too; the snapshot written at the end says it is sound.
        log.warning("transaction snapshot %s was written by an earlier txmq, which saved a slave's start-up index "
                    "as covering its log: not used; the index is rebuilt from the whole log once",
                    os.path.join(tx.directory, "snapshot.json"))
        snap = None
    if tx.table.damaged:
        # The snapshot vouches for the table up to its op offset: with files of it damaged, only the whole op
        # queue can say what the decisions were.
        log.warning("transactions: decision files damaged (%s): the decision table is rebuilt from the op queue",
                    "; ".join(f"{path}: {why}" for path, why in tx.table.damaged))
        snap = None
    elif snap is not None:
        lost = tx.table.lost(snap.get("decision_files", []), store.min_offset(HALF_TOPIC, 0))
        if lost:
            log.warning("transactions: decision files missing (%s): the decision table is rebuilt from the op queue",
                        ", ".join(lost))
            snap = None
    checks: dict[int, int] = {}
    undecided: set[int] = set()        # half offsets known undecided (the snapshot's, resumed ones)
    owners: dict[int, str] = {}        # half offset -> client id of its sender (asked first)
    checked: dict[int, int] = {}       # half offset -> when its last check record was written (wall ms)
    earlier = None          # the table as the last process left it, read for op records that cannot be (salvage.py)
    if snap is None:
        earlier = tx.table.clear()
        if FOREIGN in why_not:      # its decision files likely are too: no evidence for this log
            earlier.close()
            earlier = None
        op_from, half_from = None, None if legacy else ctx.offsets.get(PROGRESS_GROUP, HALF_TOPIC, 0)
    else:
        op_from, half_from = snap["op_offset"], snap["half_offset"]
        for off, _q, n in snap.get("pending", []):
            undecided.add(off)
            checks[off] = n
        owners = _owners(snap)
        checked = _checked(snap)
        removed = snap.get("removed_undecided")
        if isinstance(removed, list):           # (a slave's, see _removed_undecided)
            undecided.update(off for off in removed if type(off) is int and off >= 0)
    gone_queue = snap.get("removed_undecided_queue") if snap is not None else None
    gone_queue = {q for q in gone_queue if type(q) is int and q >= 0} if isinstance(gone_queue, list) else set()
    try:
        repaired = await _replay(tx, snap, earlier, checks, undecided, owners, op_from, half_from, gone_queue,
                                 checked)
    finally:
        if earlier is not None:
            earlier.close()
    tx.table.trim(store.min_offset(HALF_TOPIC, 0))
    tx.dead_count = tx.table.count(DEAD)    # the table may be ahead of the snapshot: count it
    log.info("transactions recovered %s in %d ms: %d undecided, %d dead-lettered, %d repaired",
             "from the snapshot and the op records after it" if snap else "from the whole log",
             ctx.clock() - started, len(tx.pending), tx.dead_count, repaired)
    if snap is None or slave or tx.lost_said:
        # (lost_said: the snapshot read still names the halves said lost; killed before the first periodic one,
        # each start said and counted them again.)
        # A slave writes none later (its index follows no decisions: service.stop), so this one, true as the log
        # is now (nothing is copied before recovery ends), is what its next start replays after: without it each
        # start (and the one promoting it) read every op and half since the first start it ever had.
        await write_snapshot(tx)


async def _replay(tx, snap, earlier, checks: dict[int, int], undecided: set[int], owners: dict[int, str],
                  op_from: int | None, half_from: int | None, gone_queue: set[int] = frozenset(),
                  checked: dict[int, int] | None = None) -> int:
    """The op records from ``op_from`` into the decision table, then the undecided halves into the index; returns
    how many transactions it repaired. ``earlier``: the table as the last process left it (None: it is still
    ``tx.table``, or was another store's), for op records that cannot be read (salvage.py)."""
    store = tx.ctx.store
    checked = {} if checked is None else checked
    resumed_floor = None
    damaged: dict[int, Damaged] = {}    # half queue offset -> its last op record, unreadable
    unplaced: list[int] = []            # unreadable op records that name no half
    touched: set[int] = set()           # (with the snapshot's table) halves whose byte the replay set already
    others = 0                          # op records txmq did not write (salvage.foreign), left out as ever
    # Whether every op record after the snapshot is still here: a slave writes its snapshot at start only, and one
    # up longer than the retention removed the op records of its master's decisions after it (with their halves).
    ops_gone = op_from is not None and op_from < store.min_offset(OP_TOPIC, 0)
    for msg in scan(store, OP_TOPIC, op_from, check_body=True, undecodable=unplaced):
        op = parse_op(msg)
        if op is None and foreign(msg):
            others += 1
            continue
        if unreadable(op):
            found = damaged_op(tx, msg, earlier.get if earlier is not None else
                               lambda q: None if q in touched else tx.table.get(q))
            if found is not None:
                damaged[found[0]] = found[1]
            else:
                unplaced.append(msg.physical_offset)
            continue
        q = op.half_queue_offset
        if q >= 0:      # its body (under the CRC) names the half as well as TXMQ_HALF (under none) does
            at = store.physical_offset_of(HALF_TOPIC, 0, q)
            if at is not None and at != op.half_offset:
                misnamed(tx, msg, op, at)
                op.half_offset = at
        if op.tag == OP_TAG_CHECK:
            checks[op.half_offset] = max(checks.get(op.half_offset, 0), op.checks)
            if op.checks:               # a check's (a sender record has none): the next is an interval after it
                checked[op.half_offset] = max(checked.get(op.half_offset, 0), msg.store_timestamp)
            if op.owner:                # its sender, for a half stored after the snapshot (or with none usable)
                owners[op.half_offset] = op.owner
            continue
        if q < 0:       # its body was damaged (scan emptied it): the half TXMQ_HALF names says it
            q = tx._half_queue_offset(op.half_offset)
            if q is None:       # nor that: said, and looked for once the undecided are known
                damaged_op(tx, msg, lambda q: None)
                unplaced.append(msg.physical_offset)
                continue
        if damaged and q in damaged:    # a later decision of its half: what the unreadable one said is past
            superseded(damaged.pop(q), op.op)
        if earlier is None:
            touched.add(q)
        if op.op == RESUME:
            if op.owner:            # the sender its dead letter named (TransactionService.resume)
                owners[op.half_offset] = op.owner
            tx.record(q, None)
            undecided.add(op.half_offset)
            checks[op.half_offset] = 0
            checked.pop(op.half_offset, None)
            resumed_floor = q if resumed_floor is None else min(resumed_floor, q)
        else:
            tx.record(q, op.op)
            undecided.discard(op.half_offset)
    if others:
        log.warning("transaction recovery: %d op records without TXMQ_* properties (not written by txmq: a RocketMQ "
                    "broker's) left out", others)
    repaired = await settle(tx, damaged, undecided, owners)
    repaired += await _repair_lost_dead_op(tx, undecided) + await _repair_lost_commit_ops(tx, undecided)
    # The undecided halves: those the snapshot or a resume names, and every half stored after.
    now = tx.ctx.monotonic()        # the check schedule's clock (service.py)
    restamped: list[int] = []

    def index(msg, off: int) -> None:
        if _unflipped_stamp(msg, lambda: _stamp_bounds(store, msg, tx.ctx.clock())) is not None:
            restamped.append(off)
        t = tx_from_half(msg, checks.get(off, 0), owners.get(off, ""))
        last = checked.get(off) if t.checks else None
        if last is not None:
            t.checked_at = last
        tx.core.add(t, now, msg.properties.get(Prop.CHECK_IMMUNITY_TIME_IN_SECONDS), tx.stored_at(msg.store_timestamp),
                    None if last is None else tx.stored_at(last))

    removed: list[int] = []             # undecided halves in segments removed without their dead letter
    # Halves stored after the snapshot (a slave's is its start's: most halves of a slave up for days) whose segments
    # were removed before this start: the scan below begins past them. By half queue offset, those without a
    # decision, and those a slave's earlier start found so (the snapshot's "removed_undecided_queue").
    removed_queue: list[int] = []
    # With the op records after the snapshot removed too, those halves are not gone over, only said as a range: a
    # slave writes its snapshot at start only, and promoted after months its removed halves since then ran to
    # billions, each looked up and listed only to be said as undecidable.
    gone: range = range(0)
    if snap is not None and half_from is not None:
        gone_to = store.min_offset(HALF_TOPIC, 0)
        candidates = set(gone_queue)
        if half_from < gone_to:
            if ops_gone:
                gone = range(half_from, gone_to)
            else:
                candidates.update(tx.table.undecided_in(half_from, gone_to))
        removed_queue = sorted(q for q in candidates if q < gone_to and tx.table.get(q) is None)
    for off in sorted(undecided):
        view = store.get_record(off)
        msg = _decoded(view, off, store, HALF_TOPIC) if view is not None else None
        if msg is None:
            if off >= store.min_physical_offset:    # not removed by retention: its record is damaged
                log.error("transaction recovery: the undecided half at %d is not a readable record (the commit log "
                          "is damaged there): it cannot be checked or committed, and is dropped", off)
            else:
                removed.append(off)
            continue
        filed_at(store, msg)        # (none of the queue's units naming it: its own word, as before, not dropped)
        if tx.table.get(msg.queue_offset) is None:
            index(msg, off)
    if (removed or removed_queue or gone) and ops_gone:
        # The op records that decided them may have gone with them (a commit seconds after the slave's start, both
        # removed days later): taken as lost, every long-running slave's promotion said and alerted on committed
        # transactions, and a slave kept their offsets for good (no op can come to clear them).
        _undecidable(tx, removed, removed_queue, gone, op_from)
        removed, removed_queue = [], []
    if getattr(tx.ctx.config, "broker_role", "") == "SLAVE":
        # its master may decide them yet: the next start looks again
        tx.removed_undecided, tx.removed_undecided_queue = removed, removed_queue
    elif removed or removed_queue:
        _removed_undecided(tx, removed, removed_queue)
    if half_from is not None and resumed_floor is not None and snap is None:
        half_from = min(half_from, resumed_floor)
    for msg in scan(store, HALF_TOPIC, half_from):
        if msg.physical_offset in tx.pending or tx.table.get(msg.queue_offset) is not None:
            continue
        index(msg, msg.physical_offset)
    if unplaced:
        repaired += await settle_unplaced(tx, unplaced, earlier)
    if restamped:
        log.error("transaction recovery: %d undecided halves have a store timestamp one bit (an hour's worth or "
                  "more) from lying within %d s of their born timestamp: damaged at rest (outside the body CRC), "
                  "read with that bit put back (taken as stored, a cleared bit aged a half just sent past "
                  "transaction_retention_hours, expired by the next plan unchecked); the halves at %s",
                  len(restamped), STAMP_CLOSE_MS // 1000, _span(restamped))
    return repaired


def _unflipped_stamp(msg, bounds=None) -> int | None:
    """The bit of the half ``msg``'s store timestamp flipped at rest, put back (None: no such bit): the one that
    brings it within STAMP_CLOSE_MS of its born time. Cleared, it aged a half just sent into the nightly plan's
    expiry (74.6 hours for bit 28) unchecked; set, it put its checks' and its expiry's age off for ever.

    The born timestamp is as far outside the CRC, as likely the one flipped: ``bounds`` () -> (lo, hi), what the
    log says of when the half was stored (_stamp_bounds). A store time within them whose put-back value is not
    is left as read: put back, a born time's cleared bit 28 aged a half sent a minute before 74.6 hours."""
    store, born = msg.store_timestamp, msg.born_timestamp
    if abs(store - born) <= STAMP_CLOSE_MS:
        return None
    for bit in _STAMP_BITS:
        if abs((store ^ (1 << bit)) - born) <= STAMP_CLOSE_MS:
            if bounds is not None:
                lo, hi = bounds()

                def fits(t: int) -> bool:
                    return (lo is None or t >= lo - STAMP_CLOSE_MS) and (hi is None or t <= hi + STAMP_CLOSE_MS)
                if fits(store) and not fits(store ^ (1 << bit)):
                    return None
            msg.store_timestamp = store ^ (1 << bit)
            return bit
    return None


def restamp_half(store, msg, wall: int) -> int | None:
    """_unflipped_stamp with the log's bounds (the bit put back in ``msg``, said at ERROR; None: none): for a half
    read from the log after the start (a resume), which the start's pending index read so."""
    bit = _unflipped_stamp(msg, lambda: _stamp_bounds(store, msg, wall))
    if bit is not None:
        log.error("the half at %d has a store timestamp one bit (bit %d) from lying within %d s of its born timestamp: "
                  "damaged at rest (outside the body CRC), read with that bit put back", msg.physical_offset, bit,
                  STAMP_CLOSE_MS // 1000)
    return bit


def _stamp_bounds(store, msg, wall: int) -> tuple[int | None, int | None]:
    """When the half ``msg`` can have been stored, by the log: not before the half stored before it in the half
    queue, not after the next one nor the wall clock now (lo, hi; None: nothing says)."""
    def stored(qoff: int) -> int | None:
        unit = store.queue_unit(HALF_TOPIC, 0, qoff) if qoff >= 0 else None
        try:
            view = store.get_record(unit[0]) if unit is not None else None
        except (StoreError, OSError, ValueError):       # damaged: says nothing
            return None
        if view is None or len(view) < 76:
            return None
        at = store_timestamp_pos(int.from_bytes(view[36:40], "big"))
        return int.from_bytes(view[at:at + 8], "big")
    after = stored(msg.queue_offset + 1)
    return stored(msg.queue_offset - 1), wall if after is None else min(after, wall)


def _span(items, most: int = 20) -> str:
    """Offsets for a log line: a range as its ends (billions of halves), a list as its first ``most`` and its last."""
    if isinstance(items, range):
        return f"{items.start} to {items.stop - 1}" if len(items) else "-"
    if not items:
        return "-"
    shown = ", ".join(map(str, items[:most]))
    return shown if len(items) <= most else f"{shown} ... ({len(items) - most} more, up to {items[-1]})"


def _removed_undecided(tx, removed: list[int], removed_queue: list[int] = ()) -> None:
    """Say and count the undecided halves whose segment went without their dead letter. A master's retention
    dead-letters a half before it removes its segment; a slave's does not (it writes nothing: its master does).
    A slave promoted before its master dead-lettered them held them in its start-up index only: dropped
    unsaid, an undecided transaction was gone with no dead letter, log line or count. (A slave keeps
    quiet, and keeps their offsets in its snapshot, "removed_undecided": its master may decide them yet,
    and the op that does replicates.)"""
    tx.lost_said = True
    tx.ctx.metrics.transactions_lost.labels("segment-removed").inc(len(removed) + len(removed_queue))
    log.error("transaction recovery: %d undecided half message(s) are in commit-log segments removed without a "
              "dead letter (by this broker's cleaner while it was a slave, before its master dead-lettered them; "
              "or removed by hand or missed by a copy of the store, not by the broker's retention, which "
              "dead-letters them first): "
              "lost, never checked or committed (ask their producers); the log now starts at %d; half offsets %s; half queue offsets "
              "(of %s-0) %s", len(removed) + len(removed_queue), tx.ctx.store.min_physical_offset,
              _span(removed), HALF_TOPIC, _span(removed_queue))


def _undecidable(tx, removed: list[int], removed_queue: list[int], gone: range, op_from: int) -> None:
    """Halves undecided as of the snapshot whose segments were removed, as were op records after the snapshot:
    whether their master decided them cannot be told. Said, not counted as lost (most were decided: a slave's
    snapshot is its start's, its halves those in flight then). ``gone``: the half queue offsets stored after the
    snapshot and removed, decided or not (not looked up one by one: they may be billions)."""
    store = tx.ctx.store
    log.log(logging.INFO if getattr(tx.ctx.config, "broker_role", "") == "SLAVE" else logging.WARNING,
            "transaction recovery: %d undecided half message(s), and the %d stored after the transaction snapshot, "
            "are in removed commit-log segments, and so are op records after the snapshot (op queue offsets "
            "%d..%d): whether they were decided cannot be told (not counted as lost); half offsets %s; half queue "
            "offsets %s; stored after the snapshot, half queue offsets %s", len(removed) + len(removed_queue),
            len(gone), op_from, store.min_offset(OP_TOPIC, 0), _span(removed), _span(removed_queue), _span(gone))


def _owners(snap: dict) -> dict[int, str]:
    """{half offset: its sender's client id} from a snapshot's "owners" ({client id: [half offsets]}); a snapshot
    without them (an older txmq's) or with a malformed entry gives what it can: a sender not known here is only
    not asked first."""
    owners = {}
    found = snap.get("owners")
    if not isinstance(found, dict):
        return owners
    for client_id, offsets in found.items():
        if isinstance(offsets, list):
            owners.update((off, client_id) for off in offsets if isinstance(off, int))
    return owners


async def _repair_lost_commit_ops(tx, undecided: set[int]) -> int:
    """Committed messages replayed from the log tail whose op record a crash lost: write the op now."""
    repaired = 0
    slave = getattr(tx.ctx.config, "broker_role", "") == "SLAVE"
    for off, at in sorted(tx.recovered_commits):
        q = tx.committed_half(off, at)
        if q is not None and tx.table.get(q) is None:
            if slave:       # its log is its master's, byte for byte: the master writes the op, it arrives here
                tx.record(q, COMMIT)
                undecided.discard(off)
                continue
            res = await tx.ctx.store.put(tx.records.decision(COMMIT, off, q))
            log.warning("recovery: committed transaction at %d had lost its op record; rewritten (%s)",
                        off, res.status.name)
            tx.record(q, COMMIT)
            undecided.discard(off)
            repaired += 1
    tx.recovered_commits.clear()
    return repaired


async def _repair_lost_dead_op(tx, undecided: set[int]) -> int:
    """A dead letter that ends the replayed log had its batch torn before its op record (the two are written
    together, the dead letter first, and only the log's last batch can be torn): write the op now, or the
    transaction would be pending again with its dead letter out, and be dead-lettered twice or decided anew."""
    at, tx.recovered_dead_letter = tx.recovered_dead_letter, None
    store = tx.ctx.store
    if at is None or at[0] + at[1] != store.max_physical_offset:
        return 0
    view = store.get_record(at[0])
    letter = _decoded(view, at[0], store, DEAD_TOPIC) if view is not None else None
    parsed = parse_dead_letter(letter) if letter is not None else None
    half = tx._half_at(parsed[0]) if parsed is not None else None
    if not own_letter(half, letter):
        # Its TXMQ_HALF damaged: the DEAD op written for the half it names would end another transaction.
        log.error("recovery: the dead letter at %d ends the log without its op record, and names no half of its own "
                  "(TXMQ_HALF %s): no op written; its transaction is pending again and may be dead-lettered twice",
                  at[0], letter.properties.get(P_HALF) if letter is not None else "unreadable")
        return 0
    off, reason = parsed
    q = half.queue_offset
    if tx.table.get(q) is not None:
        return 0
    if getattr(tx.ctx.config, "broker_role", "") != "SLAVE":   # a slave's log is its master's: the op arrives
        res = await store.put(tx.records.decision(DEAD, off, q, reason))
        log.warning("recovery: dead-lettered transaction at %d had lost its op record; rewritten (%s)",
                    off, res.status.name)
    tx.record(q, DEAD)
    undecided.discard(off)
    return 1


async def write_snapshot(tx) -> bool:
    """The undecided index and the op-queue offset the decision table covers, through the I/O thread; False when
    it is not written for decisions waiting for disk space (said, ``tx.changed`` left set).

    Taken on the loop in one step: every op record below ``op_offset`` has its byte in the table
    (decisions being written hold the offset down), every half below ``half_offset`` is pending or
    decided (halves being stored hold it down). The table is msync'd before the file names them."""
    store = tx.ctx.store
    tx.table.retry()
    if tx.table.waiting:
        # Decisions whose file could not be made live only in memory: a snapshot past their op records
        # would leave them out of the next start. Keep the last snapshot; its replay covers them.
        # Once a run: it was a WARNING every interval for as long as the disk stayed full
        if not tx.snapshot_held:
            tx.snapshot_held = True
            log.warning("transaction snapshot not written: %d decisions wait for disk space to be recorded (tried "
                        "again every %g s, said again once written)", tx.table.waiting,
                        tx.ctx.config.transaction_snapshot_interval_s)
        tx.changed = True
        return False
    tx.changed = False
    tx.trim()
    snap = {"version": SNAPSHOT_VERSION, "store_id": store.store_id,
            "op_offset": min(tx.writing_ops + [store.max_offset(OP_TOPIC, 0)]),
            "half_offset": min(tx.storing + [store.max_offset(HALF_TOPIC, 0)]),
            "dead": tx.dead_count, "written_ms": tx.ctx.clock(), "decision_files": tx.table.bases,
            # (the "checked" rows are of transactions checked since: see encode_snapshot)
            "checked_since": tx.ctx.clock() - tx.ctx.config.transaction_check_interval_ms,
            # (a slave writes one at start only: true then; a snapshot without it is an earlier txmq's, see recover)
            "written_as": getattr(tx.ctx.config, "broker_role", ""), "removed_undecided": tx.removed_undecided,
            "removed_undecided_queue": tx.removed_undecided_queue}
    # The loop's one consistent view is which transactions are undecided: a copy of the index's entries (7 ms at
    # 500,000). The rows, the owners map and the JSON are made from it on a worker thread, the JSON a slice of
    # rows at a time: made on the loop, the rows and owners held it 73 + 82 ms at 500,000, and the JSON, one
    # json.dumps on the flush thread, held the interpreter lock (so the loop) 330 ms, and the flushes behind it.
    # A row read there may be newer than the view (a check counted, a sender named, a decision taken since): each
    # such change has its op record at or past op_offset, which the next start replays over the snapshot (a
    # check count as the larger, a sender and a decision as written), so it ends where the view would have.
    table = tx.table
    made = table.files_made
    new_files = table.directory if made != table.files_synced else None
    data = await asyncio.to_thread(encode_snapshot, snap, list(tx.pending.values()))
    # (the maps taken after that wait: a snapshot cancelled there, by stop, leaves them for the one stop writes)
    await store.run_io(timed, "snapshot.json", _write_files, tx.directory, table.dirty(), data, new_files)
    table.files_synced = made
    if tx.snapshot_held:
        tx.snapshot_held = False
        log.warning("transaction snapshot written again: the decisions that waited for disk space are recorded")
    return True


_SLICE = 4096       # rows (or owners' offsets) a json.dumps: ~3 ms with the interpreter lock held, then a hand-off


def encode_snapshot(snap: dict, pending: list) -> bytes:
    """``snap`` with the undecided transactions ``pending`` (``Tx``) as "pending" rows and "owners", as JSON with
    its CRC. The rows are tuples, written as arrays: the garbage collector stops tracking a tuple of ints at its
    first pass, while 500,000 rows as lists stayed tracked and set off full collections that walk the whole
    index (660 ms a snapshot instead of 70). Encoded a slice at a time: one json.dumps holds the interpreter lock
    to the end, and the event loop with it."""
    def array(items: list, row) -> str:
        return ints([row(x) for x in items[i:i + _SLICE]] for i in range(0, len(items), _SLICE))

    def ints(items) -> str:      # a list of ints, or its slices' lists
        slices = (items[i:i + _SLICE] for i in range(0, len(items), _SLICE)) if isinstance(items, list) else items
        return "[" + ",".join(filter(None, (_dumps(s)[1:-1] for s in slices))) + "]"
    pending_rows = array(pending, lambda t: (t.half_offset, t.queue_offset, t.checks))
    # When those checked within an interval were last checked (wall ms: a restart after the snapshot finds any other
    # due), grouped by that time as "owners" by id (a check pass stamps its batch alike): a key of its own, so an
    # older txmq reads the snapshot as before. As [offset, ms] rows it made a snapshot 1.5x as long to encode.
    # A steady stream of checks stamps about one batch a millisecond (one time per 2 or 3 transactions at 134,000 in
    # a minute): written a group at a time (a json.dumps each) that took 3x as long as the snapshot without them.
    # Small groups go a slice of offsets at a time to one json.dumps (int keys written as strings); a group of a
    # slice or more (a pass's batch) a slice of its offsets at a time, as the rows.
    since, by_time = snap.get("checked_since", 0), {}
    for t in pending:
        if t.checked_at > since:
            by_time.setdefault(t.checked_at, []).append(t.half_offset)
    chunks, chunk, rows = [], {}, 0
    for ms, offsets in by_time.items():
        if len(offsets) >= _SLICE:
            chunks.append(f'"{ms}":{ints(offsets)}')
            continue
        chunk[ms] = offsets
        rows += len(offsets)
        if rows >= _SLICE:
            chunks.append(_dumps(chunk)[1:-1])
            chunk, rows = {}, 0
    if chunk:
        chunks.append(_dumps(chunk)[1:-1])
    checked = ",".join(chunks)
    owners = ",".join(f"{_dumps(client_id)}:{array(offsets, int)}"
                      for client_id, offsets in _by_owner(pending).items())
    head = _dumps(snap)
    return with_crc(f'{head[:-1]}{"," if len(head) > 2 else ""}"pending":{pending_rows},"checked":{{{checked}}},"owners":{{{owners}}}}}'
                    .encode())


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _by_owner(pending) -> dict[str, list[int]]:
    """{sender's client id: its undecided half offsets}: each id written once, however many halves it sent. A key
    of its own, not a fourth field of "pending": an older txmq reads a newer snapshot as before (and leaves it out).
    Only ids a check record could carry (plain_owner): a client names itself, and a 16 MiB name was written whole
    each time."""
    owners: dict[str, list[int]] = {}
    for t in pending:
        owners.setdefault(t.owner_id, []).append(t.half_offset)
    for client_id in [c for c in owners if not plain_owner(c)]:
        del owners[client_id]
    return owners


def _checked(snap: dict) -> dict[int, int]:
    """{half offset: when it was last checked (wall ms)} from the snapshot's "checked" ({ms: [half offsets]}); what
    is malformed (or none, an older txmq's snapshot) is left out: those are due at once after the restart, as before."""
    groups = snap.get("checked")
    if not isinstance(groups, dict):
        return {}
    checked = {}
    for ms, offsets in groups.items():
        # ASCII digits, at most 18 (a wall ms fits in 13): str.isdigit() alone took a superscript or 5,000 digits,
        # which int() refuses, and the broker did not start
        if ms.isascii() and ms.isdigit() and len(ms) <= 18 and isinstance(offsets, list):
            checked.update((off, int(ms)) for off in offsets if type(off) is int and off >= 0)
    return checked


def sender_id(t) -> str:
    """The client id of the producer that sent ``t``'s half: the one its connection had when the half came, or, when
    no heartbeat had named the connection yet (a stock Java producer's first halves), the first one given after
    (TransactionService.connection_named); until then the connection's address. Not the connection's name of the
    moment: a connection named again by another id had every half it ever sent re-attributed to that one."""
    return t.owner_id


def _write_files(directory: str, maps, data: bytes, new_files: str | None = None) -> None:
    """On the store's I/O thread: the decision bytes first (and the names of files made since the last
    snapshot: ``new_files`` is their directory), then the snapshot (``encode_snapshot``) that relies on them."""
    flush_maps(maps)
    if new_files is not None:
        fsync_dir(new_files)
    path = os.path.join(directory, "snapshot.json")
    os.replace(write_synced(path + ".tmp", data), path)
    fsync_dir(directory)
