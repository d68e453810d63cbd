"""A pull consumer's answered first commits, one queue after another, on a broker holding many offsets.

    .venv/bin/python bench/bench_first_commits.py [--offsets 100000] [--queues 64]

Starts the real broker on a temporary store whose consumerOffset.json holds --offsets offsets of other groups, makes
a topic of --queues queues, and has a PullConsumer (the group's consumer: it pulls first) commit its first offset of
each queue, then each again. Prints one JSON line: the milliseconds a commit for both rounds and their ratio. Before
the first offsets' journal (offset_journal.py) each first commit waited a paced save of the whole table: 106 ms at
10,000 offsets, 1.2 s at 100,000; with it, 4 ms at either. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from consumer import PullConsumer  # noqa: E402
from tests.support.broker_process import BrokerProcess  # noqa: E402
from tests.support.cluster_process import create_topic  # noqa: E402


async def _rounds(b: BrokerProcess, queues: int) -> list[float]:
    await create_topic(b.broker, "NEW", queues)
    async with PullConsumer(b.namesrv, "CG_new") as consumer:
        mqs = await consumer.fetch_queues("NEW")
        await consumer.pull(mqs[0], 0)          # the group's consumer on this connection, as a pull consumer is
        took = []
        for offset in (0, 1):                   # first commits, then commits of offsets the group has
            began = time.monotonic()
            for mq in mqs:
                await consumer.commit_offset(mq, offset)
            took.append((time.monotonic() - began) / len(mqs) * 1000)
        return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offsets", type=int, default=100_000)
    ap.add_argument("--queues", type=int, default=64)
    args = ap.parse_args()
    store = tempfile.mkdtemp(prefix="bench-first-commits-")
    try:
        os.makedirs(f"{store}/config")
        with open(f"{store}/config/consumerOffset.json", "w") as fh:
            json.dump({f"Other@G{g}": {str(q): 0 for q in range(100)} for g in range(args.offsets // 100)}, fh)
        b = BrokerProcess(store, "--max-offsets", str(2 * args.offsets + args.queues)).start(60)
        try:
            first, again = asyncio.run(_rounds(b, args.queues))
        finally:
            b.kill()
        # one JSON line, as the other benches: the first commit's cost over a plain one's (1 at best: no save each)
        print(json.dumps({"offsets": args.offsets, "queues": args.queues, "first_commit_ms": round(first, 2),
                          "later_commit_ms": round(again, 2), "first_over_later": round(first / again, 1)}))
    finally:
        shutil.rmtree(store)


if __name__ == "__main__":
    main()
