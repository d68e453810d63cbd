"""What finding a segment's undecided halves costs the retention pass, at two sizes of undecided index.

    python bench/bench_retention_undecided.py [--pending 50000 500000] [--segments 20] [--failed 200] [--every 1]

An undecided index of ``--pending`` halves (a backlog that never decides, ~1 KiB each, so ~1,000 to a
1 MiB segment) built in a real TransactionCore. A cleaning pass over the ``--segments`` oldest segments
asks, for each, which undecided halves it holds twice (are any young; which to dead-letter first); the
last segment's ``--failed`` halves could not be dead-lettered (the store refusing writes), and the pass
asks which of those are still undecided. Timed per pass, in one process, both arms on the same index:
before (a walk of the whole index per question, one per failed half) and now (TransactionCore.between,
membership in the index). Last line JSON, "ratio" = now / before at the largest index. ``--every N``: one
undecided half in N stored, the rest decided (a sparse backlog: each undecided half a bucket of its own).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.transaction.check import Policy  # noqa: E402
from broker.transaction.core import TransactionCore, Tx  # noqa: E402

SEGMENT = 1 << 20
HALF = 1024


def walk(pending: dict, lo: int, hi: int) -> dict:
    """The whole-index walk TransactionService.undecided was."""
    return {off: p.store_ts for off, p in pending.items() if lo <= off and off < hi}


def before(core, segments: int, failed: int) -> None:
    for s in range(segments):
        lo, hi = s * SEGMENT, (s + 1) * SEGMENT
        walk(core.pending, lo, hi)                                  # _young_halves
        inside = sorted(walk(core.pending, lo, hi))                 # _remove
    failures = inside[:failed]
    [off for off in failures if off in walk(core.pending, lo, hi)]  # noqa: B015 - the `still` of one refused pass


def now(core, segments: int, failed: int) -> None:
    for s in range(segments):
        lo, hi = s * SEGMENT, (s + 1) * SEGMENT
        {p.half_offset: p.store_ts for p in core.between(lo, hi)}   # noqa: B018
        inside = [p.half_offset for p in core.between(lo, hi)]
    [off for off in inside[:failed] if off in core.pending]          # noqa: B015


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pending", type=int, nargs="+", default=[50_000, 500_000])
    p.add_argument("--segments", type=int, default=20)
    p.add_argument("--failed", type=int, default=200)
    p.add_argument("--every", type=int, default=1, help="one undecided half in this many stored (2000: a sparse "
                   "backlog, a bucket of the index each)")
    a = p.parse_args()
    out = {}
    for n in a.pending:
        core = TransactionCore(Policy(60_000, 6_000, 15, 72 * 3_600_000), {}.get)
        for i in range(n):
            q = i * a.every
            core.add(Tx(q * HALF, q, f"PG{i % 8}", "T", f"U{i}", 1_000))
        row = {}
        for name, arm in (("before", before), ("now", now)):
            t = time.perf_counter()
            arm(core, a.segments, a.failed)
            row[f"{name}_s"] = round(time.perf_counter() - t, 4)
        print(f"{n:>8} undecided, {a.segments} segments, {a.failed} refused: before {row['before_s']:.3f} s, "
              f"now {row['now_s']:.4f} s", flush=True)
        out[n] = row
    last = out[a.pending[-1]]
    print(json.dumps({"pending": out, "segments": a.segments, "failed": a.failed, "every": a.every,
                      "ratio": round(last["now_s"] / last["before_s"], 5)}))


if __name__ == "__main__":
    main()
