"""The transaction records' vocabulary, declared once (docs/design.md, "Transaction records").

The broker writes these records (broker/transaction) and the Spark jobs read them
(ops/spark); both take every name from here. Pure: no I/O, nothing of the broker.

    record             topic / queue                       marks
    half               RMQ_SYS_TRANS_HALF_TOPIC q0          REAL_TOPIC, REAL_QID (the real destination)
                                                           (+ TXMQ_OWNER, its last property: the sender's
                                                           client id; not on the committed message)
    committed message  REAL_TOPIC / REAL_QID               sysFlag COMMIT, PREPARED TX OFFSET = half offset
    decision op        RMQ_SYS_TRANS_OP_HALF_TOPIC q0      TAGS=d, body = half queue offset, TXMQ_OP, TXMQ_HALF
                                                           (+ TXMQ_REASON on a DEAD op; TXMQ_OWNER on a RESUME)
    check attempt      RMQ_SYS_TRANS_OP_HALF_TOPIC q0      TAGS=c, body = half queue offset, TXMQ_CHECKS, TXMQ_HALF
                                                           (+ TXMQ_OWNER: the half's sender's client id)
    sender named       RMQ_SYS_TRANS_OP_HALF_TOPIC q0      TAGS=c, body = half queue offset, TXMQ_CHECKS=0, TXMQ_HALF,
                                                           TXMQ_OWNER: the client id a heartbeat gave the half's
                                                           connection after the half came (no check was made)
    dead letter        TRANS_CHECK_MAX_TIME_TOPIC q0       the half's properties + TXMQ_REASON, TXMQ_HALF, and
                                                           TXMQ_OWNER: the sender the broker knew (a resume asks it)

    op record properties, in this order:
    TAGS      d | c                     tag code in the consume queue: Java "d".hashCode() = 100, "c" = 99
    WAIT      false
    UNIQ_KEY  the op's own message id
    TXMQ_HALF the half's commit-log offset: how an op or a dead letter finds its half
    TXMQ_OP   COMMIT | ROLLBACK | DEAD | RESUME            decision ops
    TXMQ_REASON why a half was dead-lettered               DEAD ops
    TXMQ_CHECKS the attempt's number (1, 2, ...)            check ops (0: a sender named, no attempt)
    TXMQ_OWNER  client id of the producer that sent the half check and RESUME ops, when it can be written (see
                                                            check_extra)

    A half carries TXMQ_OWNER too, as its last property, when its connection had a client id that can be
    written (a heartbeat named it before the half came): after a crash, a half stored since the last snapshot
    and never checked is asked of its sender first all the same. The committed message is the half without it
    (retopic_record(drop_last=...): the producer's own properties, as sent), and so is a check's message; a
    dead letter keeps it, to show who sent the half
    (when it still fits the dead letter's properties), or the sender a heartbeat named after the half (a stock
    Java producer's first halves have no mark): an operator's resume reads it there (by the message index) and
    writes it with the RESUME op, so the resumed transaction is asked of its sender first, after a crash too.

Decision ops are what RocketMQ writes (tag ``d``, body = the half's queue offset), so
RocketMQ tooling reads them; the TXMQ_* properties carry what RocketMQ would have to
re-read the log for. A half is open until its first COMMIT or ROLLBACK op (the first
decision wins); before that a DEAD op closes it and a RESUME op opens it again.
"""
from __future__ import annotations

from dataclasses import dataclass

from .message import MAX_PROPERTIES_LENGTH, MessageExt, Prop, properties_to_string

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
DEAD_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"       # RocketMQ's name: transactions checked too often
# RocketMQ's owner of the half-queue progress offset: the broker's own consumer group, no client's to commit
PROGRESS_GROUP = "CID_RMQ_SYS_TRANS"
TOPICS = (HALF_TOPIC, OP_TOPIC, DEAD_TOPIC)

OP_TAG_DECISION = "d"
OP_TAG_CHECK = "c"
OP_TAG_CODES = {OP_TAG_DECISION: 100, OP_TAG_CHECK: 99}     # Java String.hashCode of "d" and "c"

P_OP = "TXMQ_OP"
P_HALF = "TXMQ_HALF"
P_CHECKS = "TXMQ_CHECKS"
P_REASON = "TXMQ_REASON"
P_OWNER = "TXMQ_OWNER"
PROPERTIES = (P_OP, P_HALF, P_CHECKS, P_REASON, P_OWNER)
OWNER_MAX = 255         # longer client ids are not written (a RocketMQ client id is an address and a name)

COMMIT = "COMMIT"
ROLLBACK = "ROLLBACK"
DEAD = "DEAD"
RESUME = "RESUME"
DECISIONS = (COMMIT, ROLLBACK)          # final: the first of them wins
OPS = (COMMIT, ROLLBACK, DEAD, RESUME)


@dataclass(slots=True)
class OpRecord:
    """One op-queue record as txmq wrote it (decision or check attempt)."""

    tag: str
    half_offset: int            # commit-log offset of the half
    half_queue_offset: int
    op: str | None = None       # decision ops
    checks: int = 0             # check attempts
    reason: str | None = None
    store_timestamp: int = 0
    owner: str | None = None    # check attempts: the half's sender's client id


def op_properties(tag: str, half_offset: int, uniq_key: str, **extra: str) -> str:
    """An op record's properties string (the order above), written directly: its keys are fixed and
    its values (numbers, op and reason words) never hold the \\x01 / \\x02 separators."""
    if tag not in OP_TAG_CODES:
        raise ValueError(f"op tag {tag!r} is not one of {sorted(OP_TAG_CODES)}")
    props = f"{Prop.TAGS}\x01{tag}\x02{Prop.WAIT}\x01false\x02{Prop.UNIQ_KEY}\x01{uniq_key}\x02{P_HALF}\x01{half_offset}"
    for key, value in extra.items():
        props += f"\x02{key}\x01{value}"
    return props


def decision_extra(op: str, reason: str | None = None) -> dict[str, str]:
    """The op_properties extras of a decision op."""
    if op not in OPS:
        raise ValueError(f"decision {op!r} is not one of {OPS}")
    return {P_OP: op, P_REASON: reason} if reason else {P_OP: op}


def check_extra(attempt: int, owner: str = "") -> dict[str, str]:
    """The op_properties extras of a check attempt; with ``owner``, the client id of the half's sender, when it
    can be a property value: a client names itself, and a \\x01 or \\x02 in its name would write properties of
    its choosing into the op record (a larger TXMQ_CHECKS, say), a NUL made start-up read the acknowledged record
    as torn (store recovery cuts properties holding one past the checkpoint), and a lone surrogate (JSON "\\ud800") made the
    record fail to encode, with every check of its batch. Left out, its sender is only not known."""
    extra = {P_CHECKS: str(attempt)}
    if plain_owner(owner):
        extra[P_OWNER] = owner
    return extra


def sender_extra(owner: str) -> dict[str, str]:
    """The op_properties extras of a sender record: a check-tagged record of attempt 0 (none was made) naming the
    half's sender, written when a heartbeat names the connection the half came on after the half (a stock Java
    producer's first halves): the half itself could not say it. Recovery takes its TXMQ_OWNER as it takes a
    check record's and its count as no attempt; an older txmq reads it the same way. Only for a ``plain_owner``."""
    if not plain_owner(owner):
        raise ValueError(f"client id {owner[:64]!r} cannot be written as {P_OWNER}")
    return check_extra(0, owner)


def plain_owner(owner: str) -> bool:
    """True when ``owner`` (a client id) can be written as TXMQ_OWNER (see check_extra); the broker keeps no other
    ones across a restart either (its snapshot), so a client cannot make that grow by the name it gives itself."""
    return (bool(owner) and len(owner) <= OWNER_MAX and "\x01" not in owner and "\x02" not in owner
            and "\x00" not in owner and (owner.isascii() or _encodes(owner)))


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def half_properties(half_props: dict[str, str], owner: str | None) -> bytes:
    """A half's properties as stored: ``half_props`` (a TXMQ_OWNER the producer sent dropped, in place: a client
    does not say which instance is asked about a transaction, the connection that sent it does), then its
    sender's client id as the last pair, when it can be a property value (plain_owner) and still fits the
    record's properties (MAX_PROPERTIES_LENGTH): a half that fits without it is never refused for it, its
    sender is only not known after a crash."""
    half_props.pop(P_OWNER, None)
    text = properties_to_string(half_props).encode()
    if owner and plain_owner(owner):
        mark = f"\x02{P_OWNER}\x01{owner}".encode() if text else f"{P_OWNER}\x01{owner}".encode()
        if len(text) + len(mark) <= MAX_PROPERTIES_LENGTH:
            text += mark
    return text


def op_body(half_queue_offset: int) -> bytes:
    """An op record's body: the half's queue offset in decimal, as RocketMQ writes it."""
    return str(half_queue_offset).encode()


def dead_letter_properties(half_props: dict[str, str], half_offset: int, reason: str,
                           checks: int | None = None) -> dict[str, str]:
    """A dead letter's properties: the half's, plus why and which half, and (``checks`` given) the checks it
    had as TRANSACTION_CHECK_TIMES, where RocketMQ's dead letters carry it: a value the producer put on its
    half would otherwise be what a RocketMQ tool reads there."""
    props = dict(half_props)
    props[P_REASON] = reason
    props[P_HALF] = str(half_offset)
    if checks is not None:
        props[Prop.TRANSACTION_CHECK_TIMES] = str(checks)
    return props


def parse_op(msg: MessageExt) -> OpRecord | None:
    """An op-queue record as an OpRecord; None for ops txmq did not write (no TXMQ_HALF)."""
    props = msg.properties
    tag = props.get(Prop.TAGS)
    half = props.get(P_HALF)
    if tag not in OP_TAG_CODES or half is None:
        return None
    try:
        return OpRecord(tag, int(half), int(msg.body.decode() or -1), props.get(P_OP),
                        int(props.get(P_CHECKS, "0")), props.get(P_REASON), msg.store_timestamp, props.get(P_OWNER))
    except (ValueError, UnicodeDecodeError):
        return None


def parse_dead_letter(msg: MessageExt) -> tuple[int, str | None] | None:
    """(half offset, reason) of a dead letter; None for a record without TXMQ_HALF."""
    half = msg.properties.get(P_HALF)
    try:
        return (int(half), msg.properties.get(P_REASON)) if half is not None else None
    except ValueError:
        return None
