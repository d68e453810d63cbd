"""A consumer's own UPDATE_CONSUMER_OFFSET: what the handler costs, this tree against a baseline checkout.

    .venv/bin/python bench/bench_offset_commit.py --baseline /work/main [--commits 20000] [--repeat 7]

The handler (broker/processors/offsets.py update_consumer_offset) of this tree and of the --baseline
checkout's, each run in process against the same real ConsumerOffsets table (a temporary directory) with a
group whose member commits: a synchronous commit moving each of 64 queues forward (our clients' path), and a
oneway one (a Java consumer's persistAll). Both sides' runs interleaved, best of --repeat, this process's CPU
time, in microseconds per commit. Only the handler differs (the rest is this tree's).

Prints a table, then as the LAST line one JSON object with each figure and "ratio" = this tree / baseline for
the synchronous commit (1.0: nothing new on a consumer's own commits). Not collected by pytest.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from broker.clients import ConsumerGroup  # noqa: E402
from broker.processors import offsets as ours  # noqa: E402
from broker.store.offsets import ConsumerOffsets  # noqa: E402
from protocol.codes import RequestCode  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402

QUEUES = 64


def _baseline(checkout: Path):
    spec = importlib.util.spec_from_file_location("broker.processors._baseline_offsets",
                                                  checkout / "broker" / "processors" / "offsets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Conn:
    peer = ("127.0.0.1", 1)


def _commands(n: int, start: int, oneway: bool) -> list:
    return [RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET, {
        "consumerGroup": "CG", "topic": "T", "queueId": i % QUEUES, "commitOffset": start + i // QUEUES},
        oneway=oneway) for i in range(n)]


def _run(handler, ctx, conn, cmds) -> float:
    t0 = time.process_time()
    for cmd in cmds:
        handler(ctx, conn, cmd)
    return (time.process_time() - t0) / len(cmds) * 1e6


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout to compare against (e.g. /work/main)")
    ap.add_argument("--commits", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    base = _baseline(args.baseline)
    with tempfile.TemporaryDirectory() as tmp:
        table = ConsumerOffsets(tmp)
        await table.open()
        member = _Conn()
        ctx = SimpleNamespace(offsets=table, topics=SimpleNamespace(get=lambda t: SimpleNamespace(queue_count=QUEUES)),
                              limits=SimpleNamespace(may_commit=lambda *a: None),
                              clients=SimpleNamespace(consumers={"CG": ConsumerGroup("CG", channels={member: object()})}))
        best: dict[str, float] = {}
        start = 0
        for _ in range(args.repeat):
            for kind, oneway in (("sync", False), ("oneway", True)):
                for side, module in (("baseline", base), ("ours", ours)):
                    cmds = _commands(args.commits, start, oneway)
                    start += args.commits // QUEUES + 1          # every commit moves its queue forward
                    us = _run(module.update_consumer_offset, ctx, member, cmds)
                    key = f"{kind}_{side}_us"
                    best[key] = min(best.get(key, us), us)
        await table.close()
    print(f"{'commit':<8} {'baseline us':>12} {'ours us':>9} {'ratio':>6}")
    for kind in ("sync", "oneway"):
        b, o = best[f"{kind}_baseline_us"], best[f"{kind}_ours_us"]
        print(f"{kind:<8} {b:>12.3f} {o:>9.3f} {o / b:>6.3f}")
    best = {k: round(v, 4) for k, v in best.items()}
    print(json.dumps({**best, "oneway_ratio": round(best["oneway_ours_us"] / best["oneway_baseline_us"], 3),
                      "ratio": round(best["sync_ours_us"] / best["sync_baseline_us"], 3)}))


if __name__ == "__main__":
    asyncio.run(main())
