"""Build a store that looks like months of use, offline, through the broker's own store writer.

    python bench/gen_months.py DIR [--records 1200000] [--topics 500] [--queues 8] [--segment-size 131072]
                                   [--transactions 200000] [--pending 2000] [--groups 200] [--days 60]

Writes through broker.store.MessageStore (the real writer, async flush, a controlled clock), so the
bytes are exactly the broker's, at ~50-100k records/s instead of the ~10k/s a TCP client gets here:

  plain     ``records`` messages over ``topics`` x ``queues``, each with a UNIQ_KEY and two KEYS words
            (three index entries), store times spread evenly over ``days`` days up to now
  tx        ``transactions`` committed transactions (half, committed message, COMMIT op: one batch each,
            as the broker writes them) and ``pending`` undecided halves, already due for a check
  offsets   ``groups`` consumer groups, each with an offset on every queue of 20 topics

Start the broker on it with the same segment size (``--segment-size``, ``--max-message-size 65536``);
the first start builds the message index (and the transaction snapshot) from the log.
The last line printed is JSON: records, segments, bytes, seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from broker.store import MessageStore, PutRequest, StoreConfig  # noqa: E402
from broker.store.offsets import ConsumerOffsets  # noqa: E402
from protocol.codes import SysFlag  # noqa: E402
from protocol.message import Prop, encode_record, pack_host, properties_to_string, tags_code  # noqa: E402

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
BORN = pack_host("10.0.0.7", 40000)
STORE = pack_host("10.0.0.1", 10911)
RUN = 64                # plain records in a row to one queue
TX_BATCH = 256
DAY_MS = 86_400_000


def _req(topic: str, qid: int, props: dict, body: bytes, ts: int, sys_flag: int = 0, prepared: int = 0):
    rec = encode_record(topic=topic.encode(), body=body, queue_id=qid, flag=0, sys_flag=sys_flag, born_timestamp=ts,
                        born_host=BORN, store_host=STORE, properties=properties_to_string(props).encode(),
                        prepared_offset=prepared)
    return PutRequest(rec, topic, qid, tags_code(props), sys_flag)


class Gen:
    def __init__(self, store_dir: str, segment_size: int, start_ms: int):
        self.now = start_ms
        self.store = MessageStore(store_dir, StoreConfig(segment_size=segment_size, flush="async",
                                                         max_message_size=65536 + 65536, preallocate=False),
                                  clock=lambda: self.now)
        self.n = 0

    async def put(self, reqs: list) -> list:
        results = await self.store.put_many(reqs)
        for r in results:
            assert r.ok, r
        self.n += len(reqs)
        return results

    def plain(self, i: int, topics: int, queues: int, ts: int):
        # RUN records in a row to one queue: spread one a queue, each batch wrote a unit into hundreds of
        # consume-queue pages the last checkpoint had cleaned (a write fault each: 20x slower to generate)
        run = i // RUN
        t, q = run % topics, (run // topics) % queues
        props = {Prop.UNIQ_KEY: f"0A00000700002A9F{i:016X}", Prop.KEYS: f"order-{i} cust-{i % 50_000}",
                 Prop.TAGS: "created", Prop.WAIT: "true"}
        return _req(f"T{t:03d}", q, props, b"p" * 48, ts)

    async def transactions(self, first: int, n: int, topics: int, decide: bool, ts: int) -> None:
        """n transactions of one topic: their halves in one batch, then each commit (message + op) in one."""
        topic = f"T{first // n % topics:03d}"
        props = [{Prop.TRAN_MSG: "true", Prop.PGROUP: f"PG_{i % 20}", Prop.UNIQ_KEY: f"0A00000700002A9FFF{i:014X}",
                  Prop.KEYS: f"tx-{i}", Prop.WAIT: "true", Prop.REAL_TOPIC: topic, Prop.REAL_QID: "0"}
                 for i in range(first, first + n)]
        halves = await self.put([_req(HALF_TOPIC, 0, p, b"t" * 48, ts) for p in props])  # as the broker stores it
        if not decide:
            return
        flag = SysFlag.with_transaction_type(0, SysFlag.TRANSACTION_COMMIT)
        reqs = []
        for i, p, half in zip(range(first, first + n), props, halves):
            op = {Prop.TAGS: "d", Prop.WAIT: "false", Prop.UNIQ_KEY: f"0A00000700002A9FEE{i:014X}",
                  "TXMQ_OP": "COMMIT", "TXMQ_HALF": str(half.physical_offset)}
            reqs += [_req(topic, 0, p, b"t" * 48, ts, flag, half.physical_offset),
                     _req(OP_TOPIC, 0, op, str(half.queue_offset).encode(), ts)]
        await self.put(reqs)


async def build(a) -> dict:
    began = time.monotonic()
    now = int(time.time() * 1000)
    first = now - a.days * DAY_MS
    g = Gen(a.dir, a.segment_size, first)
    await g.store.open()
    total = a.records + 3 * a.transactions
    step = (now - 60_000 - first) / max(1, total)
    batch: list = []
    tx_every = a.records // max(1, a.transactions // TX_BATCH) if a.transactions else 0
    done_tx = 0
    for i in range(a.records):
        g.now = int(first + step * g.n)
        batch.append(g.plain(i, a.topics, a.queues, g.now))
        if len(batch) >= RUN:
            await g.put(batch)
            batch = []
        if tx_every and i % tx_every == 0 and done_tx + TX_BATCH <= a.transactions:
            await g.transactions(done_tx, TX_BATCH, a.topics, True, g.now)
            done_tx += TX_BATCH
        if i % 200_000 == 0:
            print(f"  {i} plain, {done_tx} tx, {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    if batch:
        await g.put(batch)
    while done_tx < a.transactions:
        n = min(TX_BATCH, a.transactions - done_tx)
        await g.transactions(done_tx, n, a.topics, True, g.now)
        done_tx += n
    g.now = now - 600_000          # ten minutes old: every pending half is due for a check at start
    for k in range(0, a.pending, TX_BATCH):
        await g.transactions(a.transactions + k, min(TX_BATCH, a.pending - k), a.topics, False, g.now)
    segments = len(g.store.segments())
    size = g.store.max_physical_offset - g.store.min_physical_offset
    await g.store.close()
    offsets = ConsumerOffsets(a.dir)
    for grp in range(a.groups):
        for t in range(20):
            for q in range(a.queues):
                offsets.commit(f"CG_{grp:04d}", f"T{(grp + t) % a.topics:03d}", q, 1)
    offsets.persist()
    return {"records": g.n, "segments": segments, "bytes": size, "seconds": round(time.monotonic() - began, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--records", type=int, default=1_200_000)
    p.add_argument("--topics", type=int, default=500)
    p.add_argument("--queues", type=int, default=8)
    p.add_argument("--segment-size", type=int, default=128 * 1024)
    p.add_argument("--transactions", type=int, default=200_000)
    p.add_argument("--pending", type=int, default=2000)
    p.add_argument("--groups", type=int, default=200)
    p.add_argument("--days", type=int, default=60)
    a = p.parse_args()
    print(json.dumps(asyncio.run(build(a))))


if __name__ == "__main__":
    main()
