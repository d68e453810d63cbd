"""Op records damaged at rest: what the rest of the store says they were (called by recovery.py).

An op record's properties are under no CRC, and crash recovery cuts only what lies past the checkpoint: a page
zeroed there, or a byte flipped, leaves an op whose TAGS, TXMQ_HALF or TXMQ_OP cannot be read. Passed over without
a word, its transaction came back undecided and was checked again: a committed one was delivered twice when its
producer answered COMMIT (or dead-lettered after its copy was delivered), a rolled-back one could be committed.

Its body (the half's queue offset, under the body CRC), or else its TXMQ_HALF, still names the half; a later
readable decision op of that half replaces it as ever. Otherwise the store is asked, in this order:

    the op itself             its TXMQ_OP, when it is a whole decision word and its TXMQ_HALF agrees with its body
                              (the damage was elsewhere: its TAGS)
    the decision table        the byte its decision set once the op was durable, as the last process left it
    the committed message     written in the op's own batch, just before it: the real queue's last record
                              before the op, if it is this half's COMMIT (prepared offset, UNIQ_KEY, body)
    the dead letter           likewise the dead-letter queue's last record before the op, naming this half
                              and ending where the op begins (an older one may be of a DEAD a RESUME undid)
    the op's queue unit       its tag code says a check attempt (c): nothing was decided, nothing is lost
                              (a unit recovery rewrote from the record, its TAGS flipped: TXMQ_CHECKS says it)

A decision found is recorded and written again as a sound op record (a slave's arrives from its master), so the
next rebuild reads it. A decision op whose decision is found nowhere (a ROLLBACK leaves no other trace) is
dead-lettered, reason ``op-unreadable``, its half copied for whoever inspects it: never checked as if undecided,
where a producer's answer could deliver it twice or deliver a rolled-back message; ``admin resume`` checks it
again. Each op is logged at ERROR with its offset and counted (txmq_store_corrupt_records_total).

An op that names no half (its body damaged too, or a length in it, so that it cannot be decoded at all) is
matched once the undecided transactions are indexed (settle_unplaced): one the earlier decision table has as
decided, or whose committed message or dead letter ends exactly where the op begins, leaves the index decided.
One left unmatched is only said: the transaction it decided, if any (a ROLLBACK's), is checked again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from protocol.codes import SysFlag
from protocol.errors import RecordError
from protocol.message import Prop, decode_record

from ..topics import HALF_TOPIC, OP_TOPIC, TIMER_TOPIC, readable_queue
from .core import tx_from_half
from .records import (COMMIT, DEAD, DEAD_TOPIC, OP_TAG_CHECK, OP_TAG_CODES, OP_TAG_DECISION, P_CHECKS, P_HALF, P_OP,
                      RESUME, ROLLBACK, parse_dead_letter)

log = logging.getLogger("txmq.transaction")

UNREADABLE = "op-unreadable"        # the dead-letter reason of a decision op nothing else can tell
READER = f"transaction recovery ({OP_TOPIC})"
_TAGS = {code: tag for tag, code in OP_TAG_CODES.items()}
_OPS = (COMMIT, ROLLBACK, DEAD)


@dataclass(slots=True)
class Damaged:
    """An op record recovery could not read."""

    at: int                 # its commit-log offset
    half: int | None        # its half's commit-log offset (None: the half queue has no unit there any more)
    tag: str | None         # d or c, as its consume-queue unit says (its TAGS property is as suspect as the rest)
    earlier: str | None     # the decision table's byte for its half before the replay
    said: str | None = None  # its own TXMQ_OP, whole (COMMIT, ROLLBACK, DEAD) and for this half (TXMQ_HALF agrees)


def damaged_op(tx, msg, earlier) -> tuple[int, Damaged] | None:
    """(the half's queue offset, Damaged) for an op record that cannot be read; None when nothing names its half
    (logged). ``earlier(q)``: the decision table's byte for half queue offset ``q`` as the last process left it."""
    store = tx.ctx.store
    store.count_corrupt(msg.physical_offset, READER)
    q = _number(msg.body)           # emptied by the scan when it fails its CRC
    if q is None:
        half = _number(msg.properties.get(P_HALF, "").encode())
        q = tx._half_queue_offset(half) if half is not None else None
    if q is None:
        log.error("transaction recovery: the op record at commit-log offset %d cannot be read (its properties are "
                  "damaged) and names no half (its body is damaged too): looked for among the undecided transactions",
                  msg.physical_offset)
        return None
    unit = store.queue_unit(OP_TOPIC, 0, msg.queue_offset)
    tag = _TAGS.get(unit[2]) if unit is not None and unit[0] == msg.physical_offset else None
    if tag is None:
        # Recovery rewrites the unit of a record it verifies from the record, tag included: a flipped TAGS made it
        # no tag of ours. What the op carries says it then: only a check has TXMQ_CHECKS, only a decision TXMQ_OP.
        has_checks, has_op = P_CHECKS in msg.properties, P_OP in msg.properties
        tag = OP_TAG_CHECK if has_checks and not has_op else OP_TAG_DECISION if has_op and not has_checks else None
    half = store.physical_offset_of(HALF_TOPIC, 0, q)
    # Damage elsewhere (its TAGS, say) leaves its decision word whole: one byte flipped makes no other word of it.
    said = msg.properties.get(P_OP)
    said = said if said in _OPS and half is not None and _number(msg.properties.get(P_HALF, "").encode()) == half \
        else None
    return q, Damaged(msg.physical_offset, half, tag, earlier(q), said)


def misnamed(tx, msg, op, half_offset: int) -> None:
    """``op``'s TXMQ_HALF names another offset than the half its body (the half's queue offset, under the body
    CRC) does, ``half_offset``: the body's is taken. A digit flipped there gave a check's count (and sender) to no
    half or another, and a decision cleared another transaction from the undecided."""
    tx.ctx.store.count_corrupt(msg.physical_offset, READER)
    log.error("transaction recovery: the op record at commit-log offset %d names half %d in TXMQ_HALF but %d by its "
              "body (queue offset %d): its properties are damaged; taken for half %d", msg.physical_offset,
              op.half_offset, half_offset, op.half_queue_offset, half_offset)


def superseded(d: Damaged, op: str) -> None:
    """``d`` is followed by a readable decision op of its half (``op``): that one stands."""
    log.error("transaction recovery: the op record at commit-log offset %d (half %s) cannot be read (its properties "
              "are damaged); a later op record of its half (%s) stands", d.at, d.half, op)


async def settle(tx, damaged: dict[int, Damaged], undecided: set[int],
                 owners: dict[int, str] | None = None) -> int:
    """Decide what each op record that stayed unreadable (no later decision op of its half) recorded, from the
    rest of the store (see the top); returns how many transactions it decided. ``owners``: the senders the replay
    found (snapshot, check and sender records, RESUME ops), put on a dead letter as the check path's has it: a
    stock Java producer's first halves name none, and a resume asks the one the dead letter names."""
    settled = 0
    for q, d in sorted(damaged.items()):
        half = tx._half_at(d.half) if d.half is not None else None
        if half is None:
            log.error("transaction recovery: the op record at commit-log offset %d cannot be read; its half (queue "
                      "offset %d) is gone from the log, nothing is left to decide", d.at, q)
            continue
        decision, evidence = _evidence(tx, half, d)
        what = f"the op record at commit-log offset {d.at} (half {d.half}) cannot be read (its properties are damaged)"
        if decision is None and d.tag == OP_TAG_CHECK:
            log.error("transaction recovery: %s; it was a check attempt (its queue unit's tag): that count is lost, "
                      "nothing was decided", what)
            continue
        if decision is None:
            log.error("transaction recovery: %s; it decided the transaction, and neither the decision table, a "
                      "committed message nor a dead letter says how: dead-lettered (%s), not checked again", what,
                      UNREADABLE)
            decision = DEAD
            reqs = tx._decision_records(tx_from_half(half, owner_id=(owners or {}).get(d.half, "")), DEAD,
                                        UNREADABLE)
            metrics = tx.ctx.metrics
            metrics.child(metrics.dead_letters, half.properties.get(Prop.PGROUP, ""), UNREADABLE).inc()
        else:
            log.error("transaction recovery: %s; %s, as %s says: recorded, and its op written again", what,
                      decision, evidence)
            reqs = [tx.records.decision(decision, d.half, q)]
        await _conclude(tx, d.half, q, decision, reqs)
        undecided.discard(d.half)
        settled += 1
    return settled


async def settle_unplaced(tx, unplaced: list[int], earlier) -> int:
    """Op records that cannot be read and name no half (``unplaced``: their offsets), once the undecided
    transactions are indexed: one of those whose decision the table as the last process left it (``earlier``)
    records, or whose committed message or dead letter ends where such an op record begins (they are written in
    one batch), was decided by it, and leaves the index. Returns how many; the others are only said."""
    store, settled, left = tx.ctx.store, 0, set(unplaced)
    for x in sorted(left):
        at = store.record_before(DEAD_TOPIC, 0, x)
        letter = _record(store, at, ends_at=x)
        t = tx.pending.get((parse_dead_letter(letter) or (None,))[0]) if letter is not None else None
        if t is not None and not own_letter(tx._half_at(t.half_offset), letter):
            # Its TXMQ_HALF (under no CRC) names another, undecided transaction: that one is not ended by it.
            log.error("transaction recovery: the dead letter at commit-log offset %d, before the op record at %d that "
                      "cannot be read, names half %d (TXMQ_HALF) but is not its copy (UNIQ_KEY, body): its "
                      "properties are damaged too; nothing is decided by it", at, x, t.half_offset)
            t = None
        if t is not None:
            left.discard(x)
            settled += await _unplaced(tx, t, DEAD, f"its dead letter at commit-log offset {at}, which ends where "
                                       f"the op record at {x} that cannot be read begins")
    for t in list(tx.pending.values()):
        said = earlier.get(t.queue_offset) if earlier is not None else None
        if said in _OPS:
            settled += await _unplaced(tx, t, said, "the decision table")
            continue
        half = None
        for x in sorted(left):
            if x <= t.half_offset:
                continue
            if half is None:
                half = tx._half_at(t.half_offset)
                if half is None:
                    break
            at = next((at for at in (store.record_before(topic, qid, x) for topic, qid in _copy_queues(tx, half,
                       t.half_offset)) if _commits(tx, store, at, t.half_offset, x)), None)
            if at is not None:
                left.discard(x)
                settled += await _unplaced(tx, t, COMMIT, f"its committed message at commit-log offset {at}, "
                                           f"which ends where the op record at {x} that cannot be read begins")
                break
    for x in sorted(left):
        log.error("transaction recovery: the op record at commit-log offset %d cannot be read and names no half; "
                  "nothing in the store ties it to an undecided transaction (a ROLLBACK leaves no other trace): one "
                  "it decided, if it decided one, is checked again", x)
    return settled


async def _unplaced(tx, t, decision: str, evidence: str) -> int:
    log.error("transaction recovery: the transaction at %d (group %s, topic %s) was %s, as %s says (an op record "
              "of it cannot be read): recorded, and its op written again", t.half_offset, t.group, t.topic,
              decision, evidence)
    await _conclude(tx, t.half_offset, t.queue_offset, decision, [tx.records.decision(decision, t.half_offset,
                                                                                      t.queue_offset)])
    tx.core.written(t, True)        # out of the undecided index
    return 1


async def _conclude(tx, half_offset: int, q: int, decision: str, reqs: list) -> None:
    """Record ``decision`` for the half, its records (``reqs``) written first (a slave's arrive from its master,
    its log being the master's byte for byte)."""
    if getattr(tx.ctx.config, "broker_role", "") != "SLAVE":
        results = await tx.ctx.store.put_many(reqs)
        failed = [r.status.name for r in results if not r.ok]
        if failed:
            log.error("transaction recovery: the op record of half %d not written again (%s): %s stands for this "
                      "run, the next start reads the damaged op again", half_offset, failed[0], decision)
    tx.record(q, decision)


def _evidence(tx, half, d: Damaged) -> tuple[str | None, str]:
    """(the decision the store shows for ``d``'s half, where), or (None, "")."""
    if d.said is not None:
        return d.said, "its own TXMQ_OP"
    if d.earlier in _OPS:
        return d.earlier, "the decision table"
    store = tx.ctx.store
    for topic, qid in _copy_queues(tx, half, d.half):
        at = store.record_before(topic, qid, d.at)
        if _commits(tx, store, at, d.half):
            return COMMIT, f"its committed message at commit-log offset {at}"
    at = store.record_before(DEAD_TOPIC, 0, d.at)
    # Its own batch's (written just before the op): an older one may be a DEAD that a RESUME undid.
    letter = _record(store, at, ends_at=d.at)
    if letter is not None and (parse_dead_letter(letter) or (None,))[0] == d.half:
        return DEAD, f"its dead letter at commit-log offset {at}"
    return None, ""


def own_letter(half, letter) -> bool:
    """True when ``letter`` (a dead letter) is the copy of ``half`` (its UNIQ_KEY and body; None: no half): its
    TXMQ_HALF is under no CRC, and a flipped digit there names another transaction."""
    return half is not None and (half.properties.get(Prop.UNIQ_KEY), half.body) == (
        letter.properties.get(Prop.UNIQ_KEY), letter.body)


def _copy_queues(tx, half, half_offset: int) -> list[tuple[str, int]]:
    """Where a COMMIT of ``half`` wrote its message: its real queue, or (a delay asked) the schedule's.

    The timer queue too whenever a delay was asked: where the commit went was judged by the clock and limits of
    then, and a wall-clock time (TIMER_DELIVER_MS, __STARTDELIVERTIME) gone by since, or a lower timer_max_delay_s,
    judges it "now" here. Asked with that alone, a commit waiting in the timer topic was not found: its op was
    dead-lettered op-unreadable while the timer delivered the message too. (_commits checks the half's offset.)"""
    t = tx_from_half(half)
    queues = [(t.topic, t.real_qid)]
    moved, cut = readable_queue(tx.ctx.topics.topics, t.topic, t.real_qid)
    if cut:
        queues.append((t.topic, moved))     # its topic's queues cut since the half: where its COMMIT went
    if t.delayed and tx.ctx.schedule is not None:
        waits = tx.ctx.schedule.delayed_commit(half, t.topic, t.real_qid, half_offset)
        if waits is not None:
            queues.append((waits.topic, waits.queue_id))
        if (TIMER_TOPIC, 0) not in queues:
            queues.append((TIMER_TOPIC, 0))
    return queues


def _commits(tx, store, at: int | None, half_offset: int, ends_at: int | None = None) -> bool:
    """True when the record at ``at`` (ending at ``ends_at``, given) is the committed message of that half."""
    copy = _record(store, at, ends_at)
    return (copy is not None and SysFlag.transaction_type(copy.sys_flag) == SysFlag.TRANSACTION_COMMIT
            and copy.prepared_offset == half_offset and tx.committed_half(half_offset, at) is not None)


def _record(store, at: int | None, ends_at: int | None = None):
    """The record at ``at`` decoded (it ends at ``ends_at``, given), or None."""
    view = store.get_record(at) if at is not None else None
    if view is None or (ends_at is not None and at + len(view) != ends_at):
        return None
    try:
        return decode_record(view)[0]
    except RecordError:     # damaged at rest too: no evidence
        return None


def _number(raw: bytes) -> int | None:
    try:
        n = int(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return n if n >= 0 else None


def foreign(msg) -> bool:
    """True for an op record txmq did not write, not one whose properties went bad: a RocketMQ broker's (tag d, the
    half's queue offset as its body, WAIT; a slave follows such a master's log byte for byte), well formed and
    without one TXMQ_* property. txmq's have two or more (TXMQ_HALF and TXMQ_OP or TXMQ_CHECKS), so a flipped
    byte leaves one; a zeroed page leaves no TAGS, or a NUL. parse_op leaves these out, and so does recovery."""
    props = msg.properties
    return (props.get(Prop.TAGS) in OP_TAG_CODES and _number(msg.body) is not None
            and not any(key.startswith("TXMQ_") or "\x00" in key or "\x00" in value for key, value in props.items()))


def unreadable(op) -> bool:
    """True for an op record recovery cannot take at its word: no OpRecord, or a decision op naming no decision."""
    return op is None or (op.tag == OP_TAG_DECISION and op.op not in (*_OPS, RESUME))
