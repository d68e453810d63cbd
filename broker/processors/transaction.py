"""END_TRANSACTION (37), RESUME_CHECK_HALF_MESSAGE (323) and txmq's transaction administration (901-904).

END_TRANSACTION arrives oneway from stock clients and is then never answered;
our clients send it as a request and get the outcome, so a lost END is
retried instead of waiting for a check.
"""
from __future__ import annotations

import asyncio
import json
import logging
import struct
import weakref
from collections import Counter
from functools import partial

from protocol.codes import ResponseCode
from protocol.connection import DEFERRED
from protocol.errors import HeaderError, RecordError
from protocol.message import decode_offset_msg_id, decode_record
from protocol.txlog import DEAD_TOPIC, HALF_TOPIC, P_OWNER, parse_dead_letter

from ..answer import Answer
from ..retention import PlanRefused, applied_counts, applied_line, applied_totals
from ..transaction import DecisionError
from ..transaction.core import NO_HALF, UNKNOWN
from ..transaction.records import COMMIT, ROLLBACK
from ..transaction.service import dumps
from .admin import stored_record

log = logging.getLogger("txmq.admin")


_STATES = {8: COMMIT, 12: ROLLBACK, 0: UNKNOWN}     # commitOrRollback: TransactionCommitType, RollbackType, NotType


def end_transaction(ctx, conn, cmd):
    group = cmd.str_field("producerGroup", required=True)
    table_offset = cmd.int_field("tranStateTableOffset", required=True)
    half_offset = cmd.int_field("commitLogOffset", required=True)
    try:
        state = cmd.int_field("commitOrRollback", required=True)
    except HeaderError:     # made up as much as 5 is: counted alike (refused, and logged, by the connection)
        ctx.limits.refused("end-bad-state")
        raise
    from_check = cmd.bool_field("fromTransactionCheck")
    op = _STATES.get(state)
    if op is None:      # (RocketMQ answers nothing and says nothing: the decision it carried was lost unseen)
        ctx.limits.refused("end-bad-state")
        return _end_reply(cmd, ctx, (ResponseCode.SYSTEM_ERROR, f"{_BAD_STATE}{state}: expected 0, 8 or 12"))
    later = Answer(ctx, conn, cmd, partial(_end_reply, cmd, ctx))
    try:
        answer = ctx.tx.end(half_offset, op, group=group, table_offset=table_offset, from_check=from_check,
                            later=later, conn=conn,
                            keys=(cmd.str_field("transactionId", ""), cmd.str_field("msgId", "")))
    except BaseException:
        conn.release()                  # answered by the connection's error reply, not by ``later``
        raise
    if answer is None:                  # written at once: the store's writer answers through ``later``
        return DEFERRED
    conn.release()                      # answered here after all
    if isinstance(answer, tuple):
        return _end_reply(cmd, ctx, answer)
    return _end_reply_later(cmd, ctx, answer)


# END fields a refusal's log line shows, each cut to _FIELD_CHARS: the whole header was written, and one END can
# carry megabytes of made-up fields.
_LOGGED_FIELDS = ("producerGroup", "tranStateTableOffset", "commitLogOffset", "commitOrRollback",
                  "fromTransactionCheck", "msgId", "transactionId")
_FIELD_CHARS = 256
# Refusals any client can repeat at will, each counted (txmq_requests_refused_total end-no-half, end-half-removed,
# end-not-its-half, end-bad-state; txmq_conflicting_decisions_total): logged at most every 10 s each, not a line (a
# disk write) a request. One client sending oneway ENDs of a made-up commitOrRollback, or a rollback of a committed half again
# and again, wrote a WARNING of ~400 bytes each: 2,000 ENDs, 2,000 lines.
_QUEUE_FILE_FAILED = "create mapped file failed"     # TransactionService._decision_begin's refusal (EMFILE, ...)
_BAD_STATE = "commitOrRollback="
_GATED = frozenset(("Find prepared transaction message failed", "The producer group wrong",
                    "The transaction state table offset wrong"))
# (the rest of the remark names the END's own values, or the store's refusal: while the disk was full, every END
# and every producer's answer to every check wrote a line)
_GATED_PREFIXES = (_BAD_STATE, "transaction already ", "store refused the decision: ", "not committed: ")


def _end_reply(cmd, ctx, answer: tuple[int, str]):
    """Stock clients send END oneway: nothing goes back to them, but a refusal is logged either way."""
    code, remark = answer
    if code != ResponseCode.SUCCESS:
        fields = {k: str(cmd.ext_fields[k])[:_FIELD_CHARS] for k in _LOGGED_FIELDS if k in cmd.ext_fields}
        gate = _gate(remark)
        if gate is not None:
            ctx.limits.warn(gate, f"END_TRANSACTION refused: {remark} ({fields})")
        else:
            log.warning("END_TRANSACTION refused: %s (%s)", remark, fields)
    return None if cmd.is_oneway else cmd.response(code, remark)


def _gate(remark: str) -> str | None:
    """The reason a refusal's log line is rate-limited under (one of a fixed few), or None: a line each."""
    if remark in _GATED:
        return f"END_TRANSACTION {remark}"
    if remark.startswith(_QUEUE_FILE_FAILED):
        # (the decision's queue file could not be made: counted and said, gated, under the send path's reason by
        # _decision_begin; said again here, a line each, every END past the open-files limit was logged)
        return "queue-file-failed"
    for prefix in _GATED_PREFIXES:
        if remark.startswith(prefix):
            return f"END_TRANSACTION {prefix}"
    return None


async def _end_reply_later(cmd, ctx, answer):
    return _end_reply(cmd, ctx, await answer)


# Rows a list answers at most, whatever its limit: each costs the loop 7-10 us to build and encode, and ~235
# bytes. Unbounded, limit=10**9 at 500k undecided held the loop 3.5 s for a 118 MB body that no client could read
# (a frame is at most 16 MB); 10,000 rows were still 70-100 ms, 2,000 are 15-20 ms and 0.5 MB.
LISTED_MAX = 2_000


def list_transactions(ctx, conn, cmd):
    if ctx.config.broker_role == "SLAVE":
        # Its index is the one recovery built at start-up: the master's later halves and decisions reach its
        # log but not its index (a slave runs no checks). That list would be a wrong answer, not a stale view.
        return cmd.response(ResponseCode.SYSTEM_ERROR, "this broker is a SLAVE: it does not follow its master's "
                            "undecided transactions; list them on the master")
    group = cmd.str_field("group")
    limit = cmd.int_field("limit", 1000)
    if limit < 0:
        raise HeaderError(f"limit={limit}: expected 0 or more")
    limit = min(limit, LISTED_MAX)
    if cmd.ext_fields.get("after") is not None:
        return _list_page(ctx, cmd, group, limit, cmd.int_field("after"))
    rows = ctx.tx.describe(group, limit)
    total = _listed_total(ctx, group)
    # "more": undecided of what is listed and not in the answer (the oldest come first): say it, a cut list
    # read as the whole one hides the newest in doubt.
    return cmd.response(ResponseCode.SUCCESS, body=dumps({"pending": rows, "total": total, "more": total - len(rows),
                                                          "limit": limit, "dead_lettered": ctx.tx.dead_count}))


# Index entries a page's walk reads between two turns of the event loop: a group's few among many others' (or
# a page far in) are walked to, not read in one go.
PAGE_WALK_SLICE = 4_096


def _listed_total(ctx, group) -> int:
    """The undecided of what is listed: of ``group``, or all."""
    return ctx.tx.core.per_group.get(group, 0) if group else len(ctx.tx.pending)


async def _list_page(ctx, cmd, group, limit, after):
    """A page of the list: the undecided whose half-queue offset is past ``after``, in the order they were
    stored (oldest first), and "next_after", the cursor of the next page (None at the end). Without it the
    list answered the oldest LISTED_MAX alone, and no request could reach the 48,000 behind them."""
    txs, more = [], False
    for walked, tx in enumerate(ctx.tx.core.stored_after(after, group or None), 1):
        if walked % PAGE_WALK_SLICE == 0:
            await asyncio.sleep(0)
        if tx is None or ctx.tx.pending.get(tx.half_offset) is not tx:   # (decided while the walk yielded)
            continue
        if len(txs) == limit:
            more = True
            break
        txs.append(tx)
    # (counted as the page is answered: halves come and go while a long walk yields)
    total = _listed_total(ctx, group)
    # (the last found, decided or not; none after a page of limit=0, a count: its cursor, ``after`` again, never
    # moved, and a script following next_after asked the same empty page for ever)
    next_after = (txs[-1].queue_offset if txs else after) if more and limit else None
    # found, then decided in a later turn of the walk: not listed as undecided (its commit would be refused)
    txs = [tx for tx in txs if ctx.tx.pending.get(tx.half_offset) is tx]
    body = {"pending": ctx.tx.describe(txs=txs), "total": total, "after": after, "limit": limit,
            "next_after": next_after,
            "dead_lettered": ctx.tx.dead_count}
    if after < 0:       # the first page: all of them lie past its cursor. Past another one, counting is a walk.
        body["more"] = total - len(txs)
    return cmd.response(ResponseCode.SUCCESS, body=dumps(body))


async def resolve_transaction(ctx, conn, cmd):
    off = cmd.int_field("commitLogOffset", required=True)
    decision = (cmd.str_field("decision", required=True) or "").upper()
    if decision not in (COMMIT, ROLLBACK):
        raise HeaderError(f"decision={decision!r}: expected commit or rollback")
    log.warning("admin %s:%s forces %s of the transaction at %d", conn.peer[0], conn.peer[1], decision, off)
    try:
        remark = await ctx.tx.decide(off, decision)
    except DecisionError as exc:
        remark = exc.remark
        if remark == NO_HALF:
            remark = f"{remark}: {_not_a_half(ctx, off)}"
        return _refused(conn, cmd, decision, off, exc.code, remark)
    return cmd.response(ResponseCode.SUCCESS, remark)


def _refused(conn, cmd, what: str, off: int, code: int, remark: str):
    """The answer to an admin's ``what`` (COMMIT, ROLLBACK, resume) of the transaction at ``off``, refused: said in the
    log too, after its "forces"/"resumes" line, which read as done (a typo's read as a forced decision)."""
    log.warning("admin %s:%s: %s of the transaction at %d refused: %s", conn.peer[0], conn.peer[1], what, off, remark)
    return cmd.response(code, remark)


def _not_a_half(ctx, off: int) -> str:
    """What lies at commit-log ``off``, neither undecided nor decided: said to an admin whose commit or rollback named
    it, RocketMQ's "Find prepared transaction message failed" alone whether it was a typo, a plain message's offset,
    a removed segment or past the log's end."""
    if off in ctx.tx.pending:
        # (a COMMIT copies the half: its record gone or its head damaged, this was "no message starts at N ...
        # `admin list` names the undecided halves", the list naming N)
        return (f"the half at {off} is undecided but its record does not read (removed or damaged); nothing changed: "
                f"it cannot be committed, `admin rollback {off}` decides it without reading it")
    return f"{_what_lies_at(ctx.store, off)}; nothing changed (`admin list` names the undecided halves)"


def _what_lies_at(store, off: int) -> str:
    """What the commit log holds at ``off``, read through its checked record (never past a segment's end or the
    log's), a damaged record's decode error said, not raised (it was answered as the admin request's failure)."""
    if off < 0:
        return f"{off} is not a commit-log offset (0 or more)"
    if off < store.min_physical_offset:
        return (f"{off} is below the commit log's first offset {store.min_physical_offset} (its segment was removed; "
                "retention dead-letters an undecided half before it removes its segment)")
    if off >= store.max_physical_offset:
        return f"{off} is past the commit log's end {store.max_physical_offset}"
    view = store.get_record(off)
    if view is None:
        return f"no message starts at offset {off}"
    try:
        topic = decode_record(view)[0].topic
    except (RecordError, ValueError, IndexError, struct.error) as exc:
        return f"the record at {off} does not decode ({exc})"
    if topic != HALF_TOPIC:
        return f"{off} is a message of topic {topic}, not a transaction's half"
    return f"the half at {off} is not held undecided"


async def resume_transaction(ctx, conn, cmd):
    return await _resume(ctx, conn, cmd, cmd.int_field("commitLogOffset", required=True))


async def resume_check_half_message(ctx, conn, cmd):
    """RESUME_CHECK_HALF_MESSAGE (323), a stock admin's resumeCheckHalfMessage(msgId): the transaction whose dead
    letter (TRANS_CHECK_MAX_TIME_TOPIC; its TXMQ_HALF names the half) or half the offset message id names is
    checked again from a check count of 0. RocketMQ stores the dead letter again as a half with that count; here
    its half is made pending again, as txmq's own resume (903). Any other record is refused by name."""
    msg_id = cmd.str_field("msgId", required=True)
    _host, _port, offset = decode_offset_msg_id(msg_id)         # (a HeaderError saying what is wrong with it)
    view, error = stored_record(ctx, cmd, offset, "resume check", f"can not find message by the offset message "
                                f"id, {msg_id}")
    if error is not None:
        return error
    msg = decode_record(view)[0]
    dead = parse_dead_letter(msg) if msg.topic == DEAD_TOPIC else None
    if dead is None and msg.topic != HALF_TOPIC:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"message {msg_id} is a message of {msg.topic}, neither a "
                            f"dead-lettered transaction ({DEAD_TOPIC}) nor a half ({HALF_TOPIC}): nothing resumed")
    # The dead letter in hand names the sender (TXMQ_OWNER): given as it is, not looked up again through the
    # message index -- with --message-index-enable false that lookup found nothing and the sender was lost.
    return await _resume(ctx, conn, cmd, offset if dead is None else dead[0],
                         None if dead is None else msg.properties.get(P_OWNER, ""))


async def _resume(ctx, conn, cmd, off: int, owner: str | None = None):
    log.warning("admin %s:%s resumes the dead-lettered transaction at %d", conn.peer[0], conn.peer[1], off)
    try:
        remark = await ctx.tx.resume(off, owner)
    except DecisionError as exc:
        return _refused(conn, cmd, "resume", off, exc.code, exc.remark)
    return cmd.response(ResponseCode.SUCCESS, remark)


class _PlanInParts:
    """A plan in parts being applied on a connection: how many parts, the next one expected, what those applied did."""

    def __init__(self, parts: int, done: Counter):
        self.parts, self.next, self.done = parts, 2, done


# The plan in parts each connection is applying (`admin apply-expiry` sends a big plan in parts, on one): one at most a
# connection, gone with it. Its watcher says what a plan cut short applied when the connection closes.
_PLAN_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLAN_WATCHERS: dict = {}


def _part_of(plan) -> tuple[int, int] | None:
    """(part, parts) when ``plan`` says it is a part of a plan sent in several (the admin's "part" and "parts")."""
    part, parts = (plan.get("part"), plan.get("parts")) if isinstance(plan, dict) else (None, None)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (part, parts)) and 1 <= part <= parts and parts > 1:
        return part, parts
    return None


def _in_place(conn, part: tuple[int, int]) -> bool:
    """Whether ``part`` is the next one of the plan in parts applied on ``conn`` (or a first part)."""
    now = _PLAN_PARTS.get(conn)
    return part[0] == 1 or (now is not None and (now.next, now.parts) == part)


def _cut_short(conn, why: str) -> None:
    """Say (WARNING) what the parts of a plan applied on ``conn`` did, when its last part will not come."""
    now = _PLAN_PARTS.pop(conn, None)
    if now is not None:
        log.warning("expiry plan from %s:%s cut short: %d of %d parts applied, then %s: %s; apply the plan again to "
                    "finish it (what was done is skipped)", conn.peer[0], conn.peer[1], now.next - 1, now.parts, why,
                    applied_totals(now.done))


async def _watch(conn) -> None:
    try:
        await conn.closed.wait()
        _cut_short(conn, "the connection closed")
    finally:
        _PLAN_WATCHERS.pop(conn, None)


async def end_plan_watchers(conns) -> None:
    """At a stop, for ``conns`` (the broker's): say each plan in parts still open cut short, and end its watcher, else
    left waiting on a connection whose close had not come through when the loop closed."""
    watchers = [(conn, _PLAN_WATCHERS.pop(conn, None)) for conn in conns]
    for conn, task in watchers:
        if task is not None:
            _cut_short(conn, "the broker stopped")
            task.cancel()
    await asyncio.gather(*(task for _conn, task in watchers if task is not None), return_exceptions=True)


def _begin(conn, parts: int, done: Counter) -> None:
    _cut_short(conn, "a new plan began on the connection")     # (one begun while this first part was applied)
    _PLAN_PARTS[conn] = _PlanInParts(parts, done)
    closed = getattr(conn, "closed", None)
    if closed is not None and closed.is_set():
        _cut_short(conn, "the connection closed")
    elif closed is not None and conn not in _PLAN_WATCHERS:
        _PLAN_WATCHERS[conn] = asyncio.get_running_loop().create_task(_watch(conn))


async def apply_expiry(ctx, conn, cmd):
    try:
        plan = json.loads(cmd.body_bytes())
    except (ValueError, RecursionError) as exc:
        raise HeaderError(f"expiry plan does not parse: {exc}") from None
    n_halves = len(plan.get("halves") or []) if isinstance(plan, dict) else 0
    n_segments = len(plan.get("segments") or []) if isinstance(plan, dict) else 0
    # A plan in parts is said at its first part and its last (with every part's totals), not twice a part: 10,000
    # parts (10M halves) were 20,000 WARNINGs. One cut short (the connection closed, a part refused, a new plan begun)
    # is said with what its parts did; a part out of its place (no first part before it on this connection, or not
    # the next) is said as a plan of its own.
    part = _part_of(plan)
    if part is not None and not _in_place(conn, part):
        part = None
    if part is not None and part[0] == 1:
        _cut_short(conn, "a new plan began on the connection")
    if part is None or part[0] == 1:
        log.warning("admin %s:%s applies an expiry plan%s: %d halves, %d segments", conn.peer[0], conn.peer[1],
                    f" in {part[1]} parts (the first)" if part else "", n_halves, n_segments)
    try:
        summary = await ctx.retention.apply_plan(plan, say=part is None)
    except PlanRefused as exc:
        if part is not None:
            _cut_short(conn, f"part {part[0]} was refused")
        log.warning("expiry plan from %s:%s refused, nothing changed: %s", conn.peer[0], conn.peer[1], exc)
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"plan refused, nothing changed: {exc}")
    if part is not None:
        done = applied_counts(summary)
        if part[0] == 1:
            _begin(conn, part[1], done)
        elif not _in_place(conn, part):         # (the plan was cut short while this part was applied)
            log.warning("expiry plan part %d of %d applied, its plan cut short before it: %s", part[0], part[1],
                        applied_totals(done))
        else:
            now = _PLAN_PARTS[conn]
            now.done += done
            now.next += 1
            if part[0] == part[1]:
                _PLAN_PARTS.pop(conn, None)
                log.warning("%s", applied_line(now.done, part[1]))
            else:
                log.debug("expiry plan part %d of %d applied (so far: %s)", part[0], part[1], dict(now.done))
    return cmd.response(ResponseCode.SUCCESS, body=dumps(summary))
