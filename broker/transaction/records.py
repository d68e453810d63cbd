"""Builds the records a transaction writes, as PutRequests for the store.

Their layout and every name in them (topics, op tags, TXMQ_* properties, decision words,
OpRecord and parse_op) are declared once in protocol/txlog.py, shared with ops/spark;
they are re-exported here so the transaction service imports them from one place.

    record             topic / queue                       marks
    half               RMQ_SYS_TRANS_HALF_TOPIC q0          REAL_TOPIC, REAL_QID, TXMQ_OWNER (last: the sender's
                                                           client id, left off the committed message)
    committed message  REAL_TOPIC / REAL_QID               sysFlag COMMIT, PREPARED TX OFFSET = half offset
    decision op        RMQ_SYS_TRANS_OP_HALF_TOPIC q0      TAGS=d, body = half queue offset, TXMQ_OP, TXMQ_HALF
    check attempt      RMQ_SYS_TRANS_OP_HALF_TOPIC q0      TAGS=c, body = half queue offset, TXMQ_CHECKS, TXMQ_HALF,
                                                           TXMQ_OWNER (the sender's client id: recovery asks it first)
    sender named       RMQ_SYS_TRANS_OP_HALF_TOPIC q0      TAGS=c, TXMQ_CHECKS=0, TXMQ_HALF, TXMQ_OWNER (named by a
                                                           heartbeat after the half: see protocol/txlog.py)
    dead letter        TRANS_CHECK_MAX_TIME_TOPIC q0       TXMQ_REASON, TXMQ_HALF, TXMQ_OWNER (the sender the broker
                                                           knew: a resume asks it first, see TransactionService.resume)
    resume             RMQ_SYS_TRANS_OP_HALF_TOPIC q0      a decision op (RESUME), TXMQ_OWNER as its dead letter's
"""
from __future__ import annotations

from protocol.codes import SysFlag
from protocol.message import (MAX_PROPERTIES_LENGTH, MessageExt, Prop, encode_record, pack_host, properties_to_string,
                              retopic_record, tags_code)
from protocol.txlog import (COMMIT, DEAD, DEAD_TOPIC, HALF_TOPIC, OP_TAG_CHECK, OP_TAG_CODES, OP_TAG_DECISION,
                            OP_TOPIC, P_CHECKS, P_HALF, P_OP, P_OWNER, P_REASON, RESUME, ROLLBACK, OpRecord,
                            check_extra, dead_letter_properties, decision_extra, half_properties, op_body, op_properties,
                            parse_dead_letter, parse_op, plain_owner, sender_extra)

from ..store import PutRequest

__all__ = ["RecordFactory", "OpRecord", "parse_op", "parse_dead_letter", "plain_owner", "OP_TAG_DECISION", "OP_TAG_CHECK", "P_OP",
           "P_HALF", "P_CHECKS", "P_REASON", "P_OWNER", "COMMIT", "ROLLBACK", "DEAD", "RESUME", "DEAD_TOPIC"]

_OP_TOPIC = OP_TOPIC.encode()
_OWNER = P_OWNER.encode()


class RecordFactory:
    """Builds PutRequests for transaction records; ``store_host`` is this broker's packed address."""

    def __init__(self, store_host: bytes, uniq_ids, clock):
        self.store_host = store_host
        self.uniq_ids = uniq_ids
        self.clock = clock

    def half(self, *, body, real_topic: str, real_qid: int, flag: int, sys_flag: int, born_timestamp: int,
             born_host: bytes, props: dict, reconsume_times: int = 0, owner: str | None = None) -> PutRequest:
        """``owner``: the sender's client id, kept on the half (TXMQ_OWNER) so that a crash cannot lose it."""
        props[Prop.REAL_TOPIC] = real_topic
        props[Prop.REAL_QID] = str(real_qid)
        sys_flag = SysFlag.with_transaction_type(sys_flag, SysFlag.TRANSACTION_NOT_TYPE)
        record = encode_record(topic=HALF_TOPIC.encode(), body=body, queue_id=0, flag=flag, sys_flag=sys_flag,
                               born_timestamp=born_timestamp, born_host=born_host, store_host=self.store_host,
                               properties=half_properties(props, owner), reconsume_times=reconsume_times)
        return PutRequest(record, HALF_TOPIC, 0, tags_code(props), sys_flag)

    def committed(self, half_view, half_offset: int, topic: str, queue_id: int, tags: int) -> PutRequest:
        """The half's message on its real topic (RocketMQ 8.3: properties unchanged but the broker's TXMQ_OWNER,
        sysFlag COMMIT), made from the half's stored bytes without decoding them."""
        record = retopic_record(half_view, topic=topic.encode(), queue_id=queue_id,
                                transaction_type=SysFlag.TRANSACTION_COMMIT, prepared_offset=half_offset,
                                drop_last=_OWNER)
        return PutRequest(record, topic, queue_id, tags, SysFlag.TRANSACTION_COMMIT)

    def op(self, tag: str, half_offset: int, half_queue_offset: int, **extra: str) -> PutRequest:
        props = op_properties(tag, half_offset, self.uniq_ids.next(), **extra)
        record = encode_record(topic=_OP_TOPIC, body=op_body(half_queue_offset), queue_id=0, flag=0,
                               sys_flag=0, born_timestamp=self.clock(), born_host=self.store_host,
                               store_host=self.store_host, properties=props.encode())
        return PutRequest(record, OP_TOPIC, 0, OP_TAG_CODES[tag], 0)

    def decision(self, op: str, half_offset: int, half_queue_offset: int, reason: str | None = None,
                 owner: str = "") -> PutRequest:
        """``owner``: the half's sender (a RESUME's, read by recovery as a check record's), when a plain_owner."""
        extra = decision_extra(op, reason)
        if plain_owner(owner):
            extra[P_OWNER] = owner
        return self.op(OP_TAG_DECISION, half_offset, half_queue_offset, **extra)

    def check(self, half_offset: int, half_queue_offset: int, attempt: int, owner: str = "") -> PutRequest:
        return self.op(OP_TAG_CHECK, half_offset, half_queue_offset, **check_extra(attempt, owner))

    def sender(self, half_offset: int, half_queue_offset: int, owner: str) -> PutRequest:
        """The record naming ``owner`` (a plain_owner) the sender of the half at ``half_offset`` (sender_extra)."""
        return self.op(OP_TAG_CHECK, half_offset, half_queue_offset, **sender_extra(owner))

    def dead_letter(self, half: MessageExt, half_offset: int, reason: str, checks: int | None = None,
                    owner: str = "") -> PutRequest:
        """``owner``: the sender the broker knew (Tx.owner_id), over the half's mark: a stock Java producer's first
        halves have none (sent before its first heartbeat, a sender record names it), and a resume reads it here."""
        props = dead_letter_properties(half.properties, half_offset, reason, checks)
        if plain_owner(owner):
            props[P_OWNER] = owner
        text = properties_to_string(props).encode()
        if len(text) > MAX_PROPERTIES_LENGTH and P_OWNER in props:
            # The broker's mark fitted the half but not with the dead letter's own properties: left off, as it
            # is off a half that had no room for it, or the half could never be dead-lettered (RecordError,
            # retried every interval) where an unmarked one of the same size was.
            del props[P_OWNER]
            text = properties_to_string(props).encode()
        record = encode_record(topic=DEAD_TOPIC.encode(), body=half.body, queue_id=0, flag=half.flag,
                               sys_flag=half.sys_flag, born_timestamp=half.born_timestamp,
                               born_host=_host(half.born_host), store_host=self.store_host,
                               properties=text, reconsume_times=half.reconsume_times)
        return PutRequest(record, DEAD_TOPIC, 0, tags_code(props), half.sys_flag)


def _host(host: tuple[str, int]) -> bytes:
    return pack_host(*host)
