"""The index thread's work per transaction, with the op topic's records indexed or not, in one process.

    python bench/bench_tx_index.py [--count 3000] [--rounds 7]

A store of ``--count`` transactions as the broker writes them (a half of 1 KiB, then its committed
message and COMMIT op record in one batch; no KEYS, so a UNIQ_KEY entry per indexed record), then,
alternated, ``--rounds`` catch-ups of a fresh IndexService over that log on this thread: one indexing
every topic, one given the op topic as ``unindexed`` (what the broker does). Thread CPU time per
transaction, medians. Same code for both arms: this measures what indexing the op records cost, without
the noise of a broker and its clients on a shared machine. Last line JSON, "ratio" = not indexed / indexed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.store import MessageStore, StoreConfig  # noqa: E402
from broker.store.index import IndexService  # noqa: E402
from broker.transaction.records import RecordFactory  # noqa: E402
from protocol.message import UniqIdGenerator, pack_host  # noqa: E402
from protocol.txlog import COMMIT, OP_TOPIC  # noqa: E402


async def _write(store_dir: str, count: int) -> MessageStore:
    store = MessageStore(store_dir, StoreConfig(segment_size=64 << 20))
    await store.open()
    rf = RecordFactory(pack_host("127.0.0.1", 10911), UniqIdGenerator(), lambda: time.time_ns() // 1_000_000)
    for i in range(count):
        props = {"UNIQ_KEY": f"AC11000100002A9F0000{i:012X}", "TRAN_MSG": "true", "PGROUP": "PG", "WAIT": "true"}
        half = await store.put(rf.half(body=b"x" * 1024, real_topic="BenchTx", real_qid=i % 4, flag=0, sys_flag=0,
                                       born_timestamp=1, born_host=pack_host("127.0.0.1", 5000), props=props))
        view = store.get_record(half.physical_offset)
        done = await store.put_many([rf.committed(view, half.physical_offset, "BenchTx", i % 4, 0),
                                     rf.decision(COMMIT, half.physical_offset, half.queue_offset)])
        assert half.ok and all(r.ok for r in done)
    return store


def _catch_up(store_dir: str, store: MessageStore, unindexed: tuple, name: str, count: int) -> tuple[float, float]:
    svc = IndexService(os.path.join(store_dir, name), segment_size=store.config.segment_size, slots=500_000,
                       entries=2_000_000, unindexed=unindexed)
    svc.log_dir = os.path.join(store_dir, "commitlog")
    os.makedirs(svc.directory)
    t = time.thread_time()
    svc._scan(0, store.max_physical_offset)     # what the index thread does with dispatched records
    cpu = time.thread_time() - t
    entries = sum(f.count - 1 for f in svc.files)
    for f in svc.files:
        f.close()
    return cpu / count * 1e6, entries / count


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    arms = {"indexed": (), "not indexed": (OP_TOPIC,)}
    runs: dict[str, list] = {k: [] for k in arms}
    with tempfile.TemporaryDirectory(prefix="txmq-txindex-") as tmp:
        store = await _write(tmp, args.count)
        for r in range(args.rounds):
            for name in (arms if r % 2 == 0 else reversed(list(arms))):
                runs[name].append(_catch_up(tmp, store, arms[name], f"index-{r}-{len(arms[name])}", args.count))
        await store.close()
    med = {name: statistics.median(us for us, _ in rows) for name, rows in runs.items()}
    for name, rows in runs.items():
        print(f"op records {name:12} {med[name]:6.2f} us per transaction ({rows[0][1]:.0f} entries each; "
              f"rounds {' '.join(f'{us:.1f}' for us, _ in rows)})")
    print(json.dumps({"bench": "tx_index", "count": args.count, "rounds": args.rounds,
                      "indexed_us": round(med["indexed"], 2), "not_indexed_us": round(med["not indexed"], 2),
                      "ratio": round(med["not indexed"] / med["indexed"], 3)}))


if __name__ == "__main__":
    asyncio.run(main())
