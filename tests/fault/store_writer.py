"""Child process for test_store_kill: appends with sync flush until SIGKILLed.

    python tests/fault/store_writer.py STORE_DIR SEED

Prints ``READY`` once the store is open, then one line per ACKNOWLEDGED record:

    ACK <physical offset> <queue offset> <body crc> <topic> <queue id> <size>

written with os.write straight after the put resolved, so every line the parent reads
is a record the store promised to keep.
"""
from __future__ import annotations

import asyncio
import os
import random
import sys
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from broker.store import MessageStore, PutRequest, StoreConfig  # noqa: E402
from protocol.codes import SysFlag  # noqa: E402

CONFIG = StoreConfig(segment_size=1 << 20, cq_units_per_file=50, flush="sync", checkpoint_interval_ms=20)
TOPICS = [("T0", 3), ("T1", 2)]


def make(rng: random.Random) -> tuple[PutRequest, int]:
    topic, queues = rng.choice(TOPICS)
    r = rng.random()     # mostly small; a few big ones widen the window in which a kill tears a copy
    body = rng.randbytes(rng.randint(1, 300) if r < 0.5 else rng.randint(300, 6000) if r < 0.98
                         else rng.randint(100_000, 600_000))
    sys_flag = SysFlag.TRANSACTION_PREPARED if rng.random() < 0.05 else 0
    req = PutRequest.build(topic, body, queue_id=rng.randrange(queues), sys_flag=sys_flag,
                           properties={"TAGS": rng.choice("abc"), "KEYS": str(rng.random())})
    return req, zlib.crc32(body) & 0x7FFFFFFF


def ack(req: PutRequest, crc: int, res) -> None:
    if res.ok:
        os.write(1, f"ACK {res.physical_offset} {res.queue_offset} {crc} {req.topic} {req.queue_id} "
                    f"{res.size}\n".encode())


async def appender(store: MessageStore, rng: random.Random) -> None:
    while True:
        if rng.random() < 0.1:      # a transaction commit: message + op record in one batch
            pairs = [make(rng), make(rng)]
            results = await store.put_many([p[0] for p in pairs])
            for (req, crc), res in zip(pairs, results):
                ack(req, crc, res)
        else:
            req, crc = make(rng)
            ack(req, crc, await store.put(req))


async def main(store_dir: str, seed: int) -> None:
    store = MessageStore(store_dir, CONFIG)
    await store.open()
    os.write(1, b"READY\n")
    await asyncio.gather(*[appender(store, random.Random(seed * 100 + i)) for i in range(12)])


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
