"""The records a transaction writes, and how to read them back (docs/design.md, "Transaction records").

    record             topic / queue                       marks
    half               RMQ_SYS_TRANS_HALF_TOPIC q0          REAL_TOPIC, REAL_QID
    committed message  REAL_TOPIC / REAL_QID               sysFlag COMMIT, PREPARED TX OFFSET = half offset
    decision op        RMQ_SYS_TRANS_OP_HALF_TOPIC q0      TAGS=d, body = half queue offset, TXMQ_OP, TXMQ_HALF
    check attempt      RMQ_SYS_TRANS_OP_HALF_TOPIC q0      TAGS=c, body = half queue offset, TXMQ_CHECKS, TXMQ_HALF
    dead letter        TRANS_CHECK_MAX_TIME_TOPIC q0       TXMQ_REASON, TXMQ_HALF

Decision ops are what RocketMQ writes (tag ``d``, body = the half's queue
offset), so RocketMQ tooling reads them; the TXMQ_* properties carry what
RocketMQ would have to re-read the log for.
"""
from __future__ import annotations

from dataclasses import dataclass

from protocol.codes import SysFlag
from protocol.message import MessageExt, Prop, encode_record, pack_host, properties_to_string, retopic_record, tags_code

from ..store import PutRequest
from ..topics import HALF_TOPIC, OP_TOPIC, TRANS_DLQ_TOPIC

OP_TAG_DECISION = "d"
OP_TAG_CHECK = "c"
P_OP = "TXMQ_OP"
P_HALF = "TXMQ_HALF"
P_CHECKS = "TXMQ_CHECKS"
P_REASON = "TXMQ_REASON"

COMMIT = "COMMIT"
ROLLBACK = "ROLLBACK"
DEAD = "DEAD"
RESUME = "RESUME"

_OP_TAG_CODE = {OP_TAG_DECISION: 100, OP_TAG_CHECK: 99}  # Java hashCode of "d" and "c"
_OP_TOPIC = OP_TOPIC.encode()


@dataclass(slots=True)
class OpRecord:
    tag: str
    half_offset: int            # commit-log offset of the half
    half_queue_offset: int
    op: str | None = None       # decision ops
    checks: int = 0             # check attempts
    reason: str | None = None
    store_timestamp: int = 0


class RecordFactory:
    """Builds PutRequests for transaction records; ``store_host`` is this broker's packed address."""

    def __init__(self, store_host: bytes, uniq_ids, clock):
        self.store_host = store_host
        self.uniq_ids = uniq_ids
        self.clock = clock

    def half(self, *, body, real_topic: str, real_qid: int, flag: int, sys_flag: int, born_timestamp: int,
             born_host: bytes, props: dict, reconsume_times: int = 0) -> PutRequest:
        props[Prop.REAL_TOPIC] = real_topic
        props[Prop.REAL_QID] = str(real_qid)
        sys_flag = SysFlag.with_transaction_type(sys_flag, SysFlag.TRANSACTION_NOT_TYPE)
        record = encode_record(topic=HALF_TOPIC.encode(), body=body, queue_id=0, flag=flag, sys_flag=sys_flag,
                               born_timestamp=born_timestamp, born_host=born_host, store_host=self.store_host,
                               properties=properties_to_string(props).encode(), reconsume_times=reconsume_times)
        return PutRequest(record, HALF_TOPIC, 0, tags_code(props), sys_flag)

    def committed(self, half_view, half_offset: int, topic: str, queue_id: int, tags: int) -> PutRequest:
        """The half's message on its real topic (RocketMQ 8.3: properties unchanged, sysFlag COMMIT),
        made from the half's stored bytes without decoding them."""
        record = retopic_record(half_view, topic=topic.encode(), queue_id=queue_id,
                                transaction_type=SysFlag.TRANSACTION_COMMIT, prepared_offset=half_offset)
        return PutRequest(record, topic, queue_id, tags, SysFlag.TRANSACTION_COMMIT)

    def op(self, tag: str, half_offset: int, half_queue_offset: int, **extra: str) -> PutRequest:
        # The properties string written directly: fixed keys, values that never hold separators.
        props = f"TAGS\x01{tag}\x02WAIT\x01false\x02UNIQ_KEY\x01{self.uniq_ids.next()}\x02{P_HALF}\x01{half_offset}"
        for key, value in extra.items():
            props += f"\x02{key}\x01{value}"
        record = encode_record(topic=_OP_TOPIC, body=str(half_queue_offset).encode(), queue_id=0, flag=0,
                               sys_flag=0, born_timestamp=self.clock(), born_host=self.store_host,
                               store_host=self.store_host, properties=props.encode())
        return PutRequest(record, OP_TOPIC, 0, _OP_TAG_CODE[tag], 0)

    def decision(self, op: str, half_offset: int, half_queue_offset: int, reason: str | None = None) -> PutRequest:
        extra = {P_OP: op}
        if reason:
            extra[P_REASON] = reason
        return self.op(OP_TAG_DECISION, half_offset, half_queue_offset, **extra)

    def check(self, half_offset: int, half_queue_offset: int, attempt: int) -> PutRequest:
        return self.op(OP_TAG_CHECK, half_offset, half_queue_offset, **{P_CHECKS: str(attempt)})

    def dead_letter(self, half: MessageExt, half_offset: int, reason: str) -> PutRequest:
        props = dict(half.properties)
        props[P_REASON] = reason
        props[P_HALF] = str(half_offset)
        record = encode_record(topic=TRANS_DLQ_TOPIC.encode(), body=half.body, queue_id=0, flag=half.flag,
                               sys_flag=half.sys_flag, born_timestamp=half.born_timestamp,
                               born_host=_host(half.born_host), store_host=self.store_host,
                               properties=properties_to_string(props).encode(),
                               reconsume_times=half.reconsume_times)
        return PutRequest(record, TRANS_DLQ_TOPIC, 0, tags_code(props), half.sys_flag)


def _host(host: tuple[str, int]) -> bytes:
    return pack_host(*host)


def parse_op(msg: MessageExt) -> OpRecord | None:
    """An op-queue record as an OpRecord; None for ops txmq did not write (no TXMQ_HALF)."""
    props = msg.properties
    tag = props.get(Prop.TAGS)
    half = props.get(P_HALF)
    if tag not in (OP_TAG_DECISION, OP_TAG_CHECK) or half is None:
        return None
    try:
        return OpRecord(tag, int(half), int(msg.body.decode() or -1), props.get(P_OP),
                        int(props.get(P_CHECKS, "0")), props.get(P_REASON), msg.store_timestamp)
    except (ValueError, UnicodeDecodeError):
        return None
