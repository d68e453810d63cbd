"""Start-up recovery of a commit log, this checkout against a baseline checkout, in one run.

    python bench/bench_recovery.py --baseline /work/main [--records 30000] [--runs 5] [--queues 8]

One store of ``records`` records (1 KiB bodies over ``queues`` queues of one topic) is written once with this
checkout's MessageStore. Each run copies it afresh, writes a checkpoint at offset 0 (a crash that flushed
nothing: every record is scanned, CRC included, and its consume-queue unit compared) and times (CPU seconds
of the process: the machine is shared) ``MessageStore.open()`` in a fresh interpreter whose cwd and sys.path are the checkout measured. Runs of the two
checkouts alternate (the same page cache, the same machine load). Two modes:

    intact   consume queues as written
    cq_lost  one queue's consume-queue directory deleted (its first record in the scan past its units: the
             QUEUEID check's rare path, then a rebuild of that queue)
    stopped  a clean stop's checkpoint (at the log's end) and the default recovery_verify_segments: every record
             lies below the checkpoint in a verified segment (its TOPIC and properties judged there too)

The last line is JSON: per mode the median CPU seconds of each checkout and ratio = this / baseline.
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

FILL = """
import asyncio, sys
from broker.store import MessageStore, PutRequest, StoreConfig
async def main(path, n, queues):
    s = MessageStore(path, StoreConfig(segment_size=64 << 20))
    await s.open()
    for lo in range(0, n, 1000):
        rs = await asyncio.gather(*[s.put(PutRequest.build("Bench", bytes([i % 251]) * 1024, queue_id=i % queues,
                                                           properties={"TAGS": "t"})) for i in range(lo, min(n, lo + 1000))])
        assert all(r.ok for r in rs)
    await s.close()
asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""

OPEN = """
import asyncio, sys, time
from broker.store import MessageStore, StoreConfig
from broker.store.checkpoint import Checkpoint, write_checkpoint
async def main(path, mode):
    if mode != "stopped":
        write_checkpoint(path, Checkpoint(0, 0))
    s = MessageStore(path, StoreConfig(segment_size=64 << 20, **({} if mode == "stopped" else
                                                                 {"recovery_verify_segments": 1000})))
    t = time.process_time()
    await s.open()
    took = time.process_time() - t
    assert s.report.records_scanned > 0
    await s.close()
    print(took)
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _python(repo: Path) -> str:
    venv = repo / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _time_open(repo: Path, image: Path, work: Path, mode: str) -> float:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(image, work)
    if mode == "cq_lost":
        shutil.rmtree(work / "consumequeue" / "Bench" / "1")
    out = subprocess.run([_python(HERE), "-c", OPEN, str(work), mode], cwd=repo, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    return float(out.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", type=Path, required=True, help="another checkout, measured in the same run")
    p.add_argument("--records", type=int, default=30000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--queues", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_recovery_") as tmp:
        image, work = Path(tmp) / "image", Path(tmp) / "work"
        subprocess.run([_python(HERE), "-c", FILL, str(image), str(args.records), str(args.queues)], cwd=HERE,
                       check=True, env={**os.environ, "PYTHONPATH": str(HERE)})
        fig: dict = {"records": args.records, "runs": args.runs}
        for mode in ("intact", "cq_lost", "stopped"):
            this, base = [], []
            for _ in range(args.runs):
                this.append(_time_open(HERE, image, work, mode))
                base.append(_time_open(args.baseline.resolve(), image, work, mode))
            t, b = statistics.median(this), statistics.median(base)
            fig[mode] = {"this_s": round(t, 4), "baseline_s": round(b, 4), "ratio": round(t / b, 3)}
            print(f"{mode:8} this {t:.4f} s  baseline {b:.4f} s  ratio {t / b:.3f}", flush=True)
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
