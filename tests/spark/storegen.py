"""Build txmq stores for the Spark tests and the benchmark.

StoreBuilder writes through the real broker store (broker.store.MessageStore with a
controlled clock) when it is importable, else through FallbackLog, a small stand-in that
lays out segments the same way (RocketMQ 7.1: records never straddle segments, an 8-byte
BLANK end marker, queue offsets only for NOT / COMMIT records).

The transaction helpers write exactly the records docs/design.md lists under "Transaction
records": half, committed message + COMMIT op in one batch, ROLLBACK op, `c` check attempt,
dead letter + DEAD op, RESUME op.
"""
from __future__ import annotations

import asyncio
import os
import struct
from dataclasses import dataclass

from protocol.codes import SysFlag
from protocol.message import (BLANK_MAGIC, POS_PHYSICAL_OFFSET, POS_QUEUE_OFFSET, Prop, encode_record, pack_host,
                              properties_to_string, store_timestamp_pos, tags_code)

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
DEAD_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
BORN_HOST = pack_host("10.0.0.7", 40000)
STORE_HOST = pack_host("10.0.0.1", 10911)

try:  # the real store, once broker/store exports it
    from broker.store import MessageStore, PutRequest, StoreConfig
    HAVE_REAL_STORE = True
except ImportError:  # pragma: no cover - depends on the store engineer's progress
    HAVE_REAL_STORE = False


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


class FallbackLog:
    """Test-only segment writer used until broker.store is importable."""

    def __init__(self, store_dir: str, segment_size: int, clock):
        self.dir = os.path.join(store_dir, "commitlog")
        os.makedirs(self.dir, exist_ok=True)
        self.segment_size = segment_size
        self.clock = clock
        self.offset = 0
        self.queues: dict[tuple[str, int], int] = {}
        self._file = None

    def _segment(self):
        base = self.offset - self.offset % self.segment_size
        name = os.path.join(self.dir, f"{base:020d}")
        if self._file is None or self._file.name != name:
            if self._file:
                self._file.close()
            new = not os.path.exists(name)
            self._file = open(name, "r+b" if not new else "w+b")
            if new:
                self._file.truncate(self.segment_size)
        return self._file

    def put_many(self, items):
        out = []
        now = self.clock()
        for rec, topic, queue_id, _tags, sys_flag in items:
            left = self.segment_size - self.offset % self.segment_size
            if len(rec) + 8 > left:
                f = self._segment()
                f.seek(self.offset % self.segment_size)
                f.write(struct.pack(">ii", left, BLANK_MAGIC))
                self.offset += left
            tx = sys_flag & SysFlag.TRANSACTION_MASK
            qo = -1
            if tx in (SysFlag.TRANSACTION_NOT_TYPE, SysFlag.TRANSACTION_COMMIT):
                qo = self.queues.get((topic, queue_id), 0)
                self.queues[(topic, queue_id)] = qo + 1
            struct.pack_into(">q", rec, POS_QUEUE_OFFSET, max(qo, 0))
            struct.pack_into(">q", rec, POS_PHYSICAL_OFFSET, self.offset)
            struct.pack_into(">q", rec, store_timestamp_pos(sys_flag), now)
            f = self._segment()
            f.seek(self.offset % self.segment_size)
            f.write(rec)
            out.append((self.offset, qo, now, len(rec)))
            self.offset += len(rec)
        return out

    def close(self):
        if self._file:
            self._file.close()


class _RealLog:
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

    def __init__(self, store_dir: str, *, segment_size: int = 64 * 1024, real: bool | None = None):
        self.dir = store_dir
        self.now = 0
        use_real = HAVE_REAL_STORE if real is None else real
        backend = _RealLog if use_real else FallbackLog
        self.real = use_real
        self.log = backend(store_dir, segment_size, lambda: self.now)
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

    def _op(self, half: Stored, op: str, extra: dict | None = None):
        p = {Prop.TAGS: "d", Prop.WAIT: "false", Prop.UNIQ_KEY: f"O{len(self.written):08d}", "TXMQ_OP": op,
             "TXMQ_HALF": str(half.offset)}
        p.update(extra or {})
        return (OP_TOPIC, str(half.queue_offset).encode(), 0, p, 0, 0)

    def commit(self, half: Stored) -> list[Stored]:
        """Committed message (half's properties unchanged, COMMIT type, prepared offset) + op, one batch."""
        real = (half.props[Prop.REAL_TOPIC], half.body, int(half.props[Prop.REAL_QID]), half.props,
                SysFlag.with_transaction_type(half.sys_flag, SysFlag.TRANSACTION_COMMIT), half.offset)
        return self.put_many([real, self._op(half, "COMMIT")])

    def rollback(self, half: Stored) -> Stored:
        return self.put_many([self._op(half, "ROLLBACK")])[0]

    def resume(self, half: Stored) -> Stored:
        return self.put_many([self._op(half, "RESUME")])[0]

    def check(self, half: Stored, attempt: int) -> Stored:
        p = {Prop.TAGS: "c", Prop.WAIT: "false", Prop.UNIQ_KEY: f"C{len(self.written):08d}",
             "TXMQ_HALF": str(half.offset), "TXMQ_CHECKS": str(attempt)}
        return self.put_many([(OP_TOPIC, str(half.queue_offset).encode(), 0, p, 0, 0)])[0]

    def dead(self, half: Stored, reason: str) -> list[Stored]:
        """Dead letter (user body, half's properties + TXMQ_REASON / TXMQ_HALF) + DEAD op, one batch."""
        p = dict(half.props)
        p.update({"TXMQ_REASON": reason, "TXMQ_HALF": str(half.offset)})
        return self.put_many([(DEAD_TOPIC, half.body, 0, p, 0, 0),
                              self._op(half, "DEAD", {"TXMQ_REASON": reason})])
