"""What the transaction snapshot's "checked" key (when each transaction checked within an interval was last
checked, so a restart spends no check) costs its encoding, against the encoder of another revision.

    python bench/bench_snapshot_checked.py [--undecided 500000] [--checked 0.67] [--baseline-rev d8f8d1c] [--spread]

``--checked`` of the ``--undecided`` transactions were checked within the last interval: all in one check pass (one
group of offsets), or with ``--spread`` one batch a millisecond over the interval (a steady stream of checks, the
worst case: 60,000 groups). Each encoder runs ``--repeat`` times, interleaved; the best of each is printed. Last
line JSON, "ratio" = this tree's encode / the baseline revision's (the same run's).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import broker.transaction.recovery as recovery  # noqa: E402
from broker.transaction.core import Tx  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--undecided", type=int, default=500_000)
ap.add_argument("--checked", type=float, default=0.67)
ap.add_argument("--baseline-rev", default="d8f8d1c")
ap.add_argument("--repeat", type=int, default=5)
ap.add_argument("--spread", action="store_true")
args = ap.parse_args()

source = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.baseline_rev}:broker/transaction/recovery.py"],
                        check=True, capture_output=True, text=True).stdout
names = dict(vars(recovery))
exec(re.search(r"\ndef encode_snapshot.*?(?=\n\n\ndef )", source, re.S).group(0), names)
baseline = names["encode_snapshot"]

now = 1_700_000_000_000
cut = int(args.undecided * args.checked)
pending = [Tx(i * 300, i, "PG", "T", "U", 0, checks=1 if i < cut else 0,
              checked_at=(now - i % 60_000 if args.spread else now) if i < cut else 0, owner_id=f"127.0.0.1@p{i % 10}") for i in range(args.undecided)]
snap = {"version": 1, "op_offset": 0, "written_ms": now, "checked_since": now - 60_000}
best = {}
for name, encode in (("ours", recovery.encode_snapshot), ("baseline", baseline)) * args.repeat:
    t = time.perf_counter()
    size = len(encode(snap, pending))
    best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    print(f"{name:<9} {size:>10} bytes {1000 * (time.perf_counter() - t):8.0f} ms")
print(json.dumps({"bench": "snapshot_checked", "undecided": args.undecided, "checked": cut, "spread": args.spread,
                  "ours_ms": round(1000 * best["ours"]), "baseline_ms": round(1000 * best["baseline"]),
                  "ratio": round(best["ours"] / best["baseline"], 3)}))
