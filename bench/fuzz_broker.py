"""Run tests/support/frame_fuzz.py long against a real broker process, and watch it from outside.

    python bench/fuzz_broker.py [--frames N] [--sequences N] [--seed S] [--vectors DIR]

Besides the fuzzer's findings (an unanswered request, SYSTEM_ERROR naming an exception, a canary SEND refused,
the broker's death, a half stored twice) it reports the worst event-loop lag (txmq_event_loop_lag_max_seconds),
the broker's RSS before and after, and the log: tracebacks, WARNING/ERROR lines and their commonest kinds. Prints
the findings, then one JSON line (frames per request code).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.broker_process import BrokerProcess  # noqa: E402
from tests.support.frame_fuzz import VECTORS, fuzz, load_vectors, seeds  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def loop_lag_max(metrics: str) -> float | None:
    page = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    m = re.search(r"^txmq_event_loop_lag_max_seconds (\S+)$", page, re.M)
    return float(m.group(1)) if m else None


async def run(frames: int, sequences: int, seed: int, vectors: Path) -> dict:
    pool = seeds(load_vectors(vectors))
    with tempfile.TemporaryDirectory(prefix="txmq-fuzz-") as tmp:
        broker = BrokerProcess(Path(tmp) / "store", "--max-suspend-ms", "200").start()
        try:
            rss0 = rss_mb(broker.proc.pid)
            found = await fuzz(broker, pool, frames, sequences, random.Random(seed))
            log = broker.log_path.read_text(errors="replace")
            said = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
            return {"frames": frames, "sequences": found["sequences"], "seed": seed,
                    "per_code": dict(sorted(found["per_code"].items())),
                    "loop_lag_max_s": loop_lag_max(broker.metrics),
                    "rss_start_mb": round(rss0, 1), "rss_end_mb": round(rss_mb(broker.proc.pid), 1),
                    "tracebacks": log.count("Traceback"), "warnings_errors": len(said),
                    "log_kinds": collections.Counter(re.sub(r"[0-9]+", "N", line.split(" ", 3)[-1])[:70]
                                                     for line in said).most_common(8),
                    "findings": [repr(f) for f in found["findings"]]}
        finally:
            broker.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--sequences", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vectors", type=Path, default=VECTORS)
    args = ap.parse_args()
    result = asyncio.run(run(args.frames, args.sequences, args.seed, args.vectors))
    for f in result["findings"]:
        print(f)
    print(json.dumps({**result, "findings": len(result["findings"])}))


if __name__ == "__main__":
    main()
