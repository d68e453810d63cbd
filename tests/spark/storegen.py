"""Build txmq stores for the Spark tests and the benchmark.

StoreBuilder writes through the real broker store (broker.store.MessageStore) with a
controlled clock, so the jobs are tested on exactly the bytes the broker writes.

The transaction helpers write exactly the records docs/design.md lists under "Transaction
records": half, committed message + COMMIT op in one batch, ROLLBACK op, `c` check attempt,
dead letter + DEAD op, RESUME op.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from broker.store import MessageStore, PutRequest, StoreConfig
from protocol.codes import SysFlag
from protocol.message import Prop, encode_record, pack_host, properties_to_string, tags_code

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
DEAD_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
BORN_HOST = pack_host("10.0.0.7", 40000)
STORE_HOST = pack_host("10.0.0.1", 10911)


@dataclass
class Stored:
    offset: int            # commit-log offset
    queue_offset: int      # -1 when not indexed
    store_ts: int
    size: int
    topic: str
    props: dict
    body: bytes
    sys_flag: int = 0


def _encode(topic: str, body: bytes, queue_id: int, props: dict, sys_flag: int, prepared_offset: int,
            born_ts: int) -> bytearray:
    return encode_record(topic=topic.encode(), body=body, queue_id=queue_id, flag=0, sys_flag=sys_flag,
                         born_timestamp=born_ts, born_host=BORN_HOST, store_host=STORE_HOST,
                         properties=properties_to_string(props).encode(), prepared_offset=prepared_offset)


class _Log:
    """broker.store.MessageStore driven synchronously, its clock under the builder's control."""

    def __init__(self, store_dir: str, segment_size: int, clock):
        self.loop = asyncio.new_event_loop()
        self.store = MessageStore(store_dir, StoreConfig(segment_size=segment_size, flush="async"), clock=clock)
        self.loop.run_until_complete(self.store.open())

    def put_many(self, items):
        reqs = [PutRequest(*item) for item in items]
        results = self.loop.run_until_complete(self.store.put_many(reqs))
        for r in results:
            assert r.ok, r
        return [(r.physical_offset, r.queue_offset, r.store_timestamp, r.size) for r in results]

    def close(self):
        self.loop.run_until_complete(self.store.close())
        self.loop.close()


class StoreBuilder:
    """Write plain and transactional traffic at controlled store times (ms)."""

    def __init__(self, store_dir: str, *, segment_size: int = 64 * 1024):
        self.dir = store_dir
        self.now = 0
        self.log = _Log(store_dir, segment_size, lambda: self.now)
        self.written: list[Stored] = []

    def at(self, ms: int) -> "StoreBuilder":
        self.now = ms
        return self

    def close(self) -> None:
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ records
    def put_many(self, specs) -> list[Stored]:
        """specs: (topic, body, queue_id, props, sys_flag, prepared_offset); one writer batch."""
        items = []
        for topic, body, queue_id, props, sys_flag, prepared in specs:
            rec = _encode(topic, body, queue_id, props, sys_flag, prepared, self.now - 5)
            items.append((rec, topic, queue_id, tags_code(props), sys_flag))
        results = self.log.put_many(items)
        out = [Stored(off, qo, ts, size, spec[0], dict(spec[3]), spec[1], spec[4])
               for (off, qo, ts, size), spec in zip(results, specs)]
        self.written += out
        return out

    def send(self, topic: str, body: bytes = b"x" * 100, *, queue_id: int = 0, tags: str | None = None,
             props: dict | None = None) -> Stored:
        p = {Prop.UNIQ_KEY: f"U{len(self.written):08d}", Prop.WAIT: "true"}
        if tags:
            p[Prop.TAGS] = tags
        p.update(props or {})
        return self.put_many([(topic, body, queue_id, p, 0, 0)])[0]

    def half(self, group: str, topic: str, body: bytes = b"tx" * 50, *, queue_id: int = 0) -> Stored:
        """The half as the broker stores it: half topic q0, tx type NOT, REAL_TOPIC / REAL_QID added."""
        p = {Prop.TRAN_MSG: "true", Prop.PGROUP: group, Prop.UNIQ_KEY: f"H{len(self.written):08d}",
             Prop.WAIT: "true", Prop.REAL_TOPIC: topic, Prop.REAL_QID: str(queue_id)}
        return self.put_many([(HALF_TOPIC, body, 0, p, 0, 0)])[0]

    # Each *_specs method returns the records one broker action writes (one writer batch).
    def op_spec(self, half: Stored, op: str, extra: dict | None = None) -> tuple:
        p = {Prop.TAGS: "d", Prop.WAIT: "false", Prop.UNIQ_KEY: f"O{len(self.written):08d}", "TXMQ_OP": op,
             "TXMQ_HALF": str(half.offset)}
        p.update(extra or {})
        return (OP_TOPIC, str(half.queue_offset).encode(), 0, p, 0, 0)

    def commit_specs(self, half: Stored) -> list[tuple]:
        """Committed message (half's properties unchanged, COMMIT type, prepared offset) + COMMIT op."""
        real = (half.props[Prop.REAL_TOPIC], half.body, int(half.props[Prop.REAL_QID]), half.props,
                SysFlag.with_transaction_type(half.sys_flag, SysFlag.TRANSACTION_COMMIT), half.offset)
        return [real, self.op_spec(half, "COMMIT")]

    def check_specs(self, half: Stored, attempt: int) -> list[tuple]:
        p = {Prop.TAGS: "c", Prop.WAIT: "false", Prop.UNIQ_KEY: f"C{len(self.written):08d}",
             "TXMQ_HALF": str(half.offset), "TXMQ_CHECKS": str(attempt)}
        return [(OP_TOPIC, str(half.queue_offset).encode(), 0, p, 0, 0)]

    def sender_specs(self, half: Stored, owner: str) -> list[tuple]:
        """The broker's sender record: check-tagged, attempt 0, naming the half's sender (TXMQ_OWNER)."""
        p = {Prop.TAGS: "c", Prop.WAIT: "false", Prop.UNIQ_KEY: f"C{len(self.written):08d}",
             "TXMQ_HALF": str(half.offset), "TXMQ_CHECKS": "0", "TXMQ_OWNER": owner}
        return [(OP_TOPIC, str(half.queue_offset).encode(), 0, p, 0, 0)]

    def dead_specs(self, half: Stored, reason: str) -> list[tuple]:
        """Dead letter (user body, half's properties + TXMQ_REASON / TXMQ_HALF) + DEAD op."""
        p = dict(half.props)
        p.update({"TXMQ_REASON": reason, "TXMQ_HALF": str(half.offset)})
        return [(DEAD_TOPIC, half.body, 0, p, 0, 0), self.op_spec(half, "DEAD", {"TXMQ_REASON": reason})]

    def commit(self, half: Stored) -> list[Stored]:
        return self.put_many(self.commit_specs(half))

    def rollback(self, half: Stored) -> Stored:
        return self.put_many([self.op_spec(half, "ROLLBACK")])[0]

    def resume(self, half: Stored) -> Stored:
        return self.put_many([self.op_spec(half, "RESUME")])[0]

    def check(self, half: Stored, attempt: int) -> Stored:
        return self.put_many(self.check_specs(half, attempt))[0]

    def sender(self, half: Stored, owner: str) -> Stored:
        return self.put_many(self.sender_specs(half, owner))[0]

    def dead(self, half: Stored, reason: str) -> list[Stored]:
        return self.put_many(self.dead_specs(half, reason))
