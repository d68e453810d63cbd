"""A start's transaction recovery with many undecided halves, this checkout against a baseline, in one run.

    python bench/bench_tx_start.py --baseline /work/main [--undecided 300000] [--runs 3]

One store of ``--undecided`` halves (100-byte bodies), none decided, is written once with this checkout (the unit
tests' make_service), its transaction snapshot written at the end. Each run copies it afresh and times (CPU
seconds of the process: the machine is shared) ``TransactionService.recover()`` after the store's open, in a
fresh interpreter whose cwd and sys.path are the checkout measured; runs of the two checkouts alternate. Modes:

    snapshot  the snapshot read: its halves looked up by their commit-log offsets
    log       the snapshot deleted: the half queue scanned from its start

Last line JSON: per mode the median CPU seconds of each checkout and ratio = this / baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

SETUP = """
import asyncio, sys, time
from pathlib import Path
from broker.config import BrokerConfig
from broker.context import BrokerContext
from broker.clients import ClientRegistry
from broker.metrics import BrokerMetrics
from broker.store import MessageStore, StoreConfig, ConsumerOffsets
from broker.topics import TopicManager
from broker.transaction.service import TransactionService
from tests.unit.test_review_transactions import Clock, GatedStore

async def service(path, clock):
    config = BrokerConfig(store_dir=str(path), transaction_check_interval_ms=1000, transaction_timeout_ms=1000)
    store = MessageStore(str(path / "s"), StoreConfig(segment_size=64 << 20), clock=clock)
    topics = TopicManager(str(path / "config"), auto_create=True, default_queue_nums=4, cluster="c", broker="b")
    ctx = BrokerContext(config, None, None, topics, ClientRegistry(clock), BrokerMetrics(), clock=clock,
                        monotonic=clock)
    ctx.set_address("127.0.0.1", 10911)
    ctx.tx = TransactionService(ctx)
    store.add_dispatch_listener(ctx.tx.on_dispatch)
    await store.open()
    ctx.offsets = ConsumerOffsets(str(path / "s"))
    ctx.store = GatedStore(store)
    return ctx, store
"""

FILL = SETUP + """
from protocol.message import Prop
async def main(path, n):
    clock = Clock()
    ctx, store = await service(Path(path), clock)
    await ctx.tx.recover()
    rf = ctx.tx.records
    for lo in range(0, n, 2000):
        reqs = [rf.half(body=b"x" * 100, real_topic="T", real_qid=i % 4, flag=0, sys_flag=0, born_timestamp=clock(),
                        born_host=ctx.store_host, props={Prop.UNIQ_KEY: f"U{i}", Prop.PGROUP: "PG",
                                                         Prop.TRAN_MSG: "true"})
                for i in range(lo, min(n, lo + 2000))]
        rs = await asyncio.gather(*[store.put(r) for r in reqs])
        assert all(r.ok for r in rs)
    await store.close()
    ctx, store = await service(Path(path), clock)       # indexed from the log, then the snapshot of that
    await ctx.tx.recover()
    assert len(ctx.tx.pending) == n, len(ctx.tx.pending)
    assert await ctx.tx.write_snapshot()
    await store.close()
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""

OPEN = SETUP + """
async def main(path, n):
    ctx, store = await service(Path(path), Clock())
    t = time.process_time()
    await ctx.tx.recover()
    took = time.process_time() - t
    assert len(ctx.tx.pending) == n, len(ctx.tx.pending)
    await store.close()
    print(took)
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def _python(repo: Path) -> str:
    venv = repo / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _snapshots(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "snapshot" in p.name]


def _time(repo: Path, image: Path, work: Path, mode: str, n: int) -> float:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(image, work)
    if mode == "log":
        for p in _snapshots(work):
            p.unlink()
    out = subprocess.run([_python(HERE), "-c", OPEN, str(work), str(n)], cwd=repo, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"})
    return float(out.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", type=Path, required=True, help="another checkout, measured in the same run")
    p.add_argument("--undecided", type=int, default=300_000)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_tx_start_") as tmp:
        image, work = Path(tmp) / "image", Path(tmp) / "work"
        subprocess.run([_python(HERE), "-c", FILL, str(image), str(args.undecided)], cwd=HERE, check=True,
                       env={**os.environ, "PYTHONPATH": str(HERE)})
        assert _snapshots(image), "no transaction snapshot written"
        fig: dict = {"undecided": args.undecided, "runs": args.runs}
        for mode in ("snapshot", "log"):
            this, base = [], []
            for _ in range(args.runs):
                this.append(_time(HERE, image, work, mode, args.undecided))
                base.append(_time(args.baseline.resolve(), image, work, mode, args.undecided))
            t, b = statistics.median(this), statistics.median(base)
            fig[mode] = {"this_s": round(t, 3), "baseline_s": round(b, 3), "ratio": round(t / b, 3)}
            print(f"{mode:8} this {t:.3f} s  baseline {b:.3f} s  ratio {t / b:.3f}", flush=True)
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
