"""What the delivered timers behind one held-back timer cost: memory, delayOffset.json, its save.

    python bench/bench_timer_runs.py [--delivered 1000000] [--every 1] [--baseline-rev main]

One timer (offset 0) is not delivered; the ``--delivered`` after it are, in progress records of 256 offsets (a
delivery batch), so the floor stays at 0 and all of them are kept above it (up to timer_max_delay_s, 3 days, in
the broker). ``--every 2``: only every other offset is delivered (the worst case for runs: a gap after each).
The same is done with this checkout's Progress and with ``--baseline-rev``'s (its broker/schedule/progress.py,
read with git show), in one process. Prints, for each: the memory the delivered set holds (tracemalloc), the time
to apply the records, the loop's copy for a snapshot, the save (JSON made and written, synced: write_snapshot),
the file's size, and the load at start-up (save and load: the best of ``--repeat``). Last line JSON, "ratio" = ours / baseline save time.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--delivered", type=int, default=1_000_000)
ap.add_argument("--every", type=int, default=1)
ap.add_argument("--baseline-rev", default="main")
ap.add_argument("--repeat", type=int, default=3)
args = ap.parse_args()
repo = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(repo))

import broker.schedule.progress as ours  # noqa: E402


def baseline_module():
    source = subprocess.run(["git", "-C", str(repo), "show", f"{args.baseline_rev}:broker/schedule/progress.py"],
                            check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType("broker.schedule._baseline_progress")
    mod.__package__ = "broker.schedule"
    sys.modules[mod.__name__] = mod          # (dataclass looks its module up)
    exec(compile(source, "baseline progress.py", "exec"), mod.__dict__)
    return mod


def measure(mod, name):
    offsets = list(range(1, 1 + args.delivered * args.every, args.every))

    def build():
        p = mod.Progress()
        for i in range(0, len(offsets), 256):
            p.apply({}, offsets[i:i + 256])
        return p
    t0 = time.perf_counter()
    build()
    apply_s = time.perf_counter() - t0
    gc.collect()
    tracemalloc.start()             # (it slows what it traces: the time is taken without it, above)
    p = build()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert p.timer_floor == 0 and len(p.timer_done) == args.delivered
    t0 = time.perf_counter()
    done = p.timer_done.copy() if hasattr(p.timer_done, "iter_runs") else list(p.timer_done)    # as snapshot() does
    view = mod.Progress(levels={}, timer_floor=0, timer_done=done, progress_offset=1)
    copy_s = time.perf_counter() - t0
    save_s = load_s = float("inf")      # the best of --repeat: the machine is shared
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            mod.write_snapshot(d, view)
            save_s = min(save_s, time.perf_counter() - t0)
            size = os.path.getsize(os.path.join(d, mod.SNAPSHOT_NAME))
            t0 = time.perf_counter()
            loaded = mod.load_snapshot(d)
            load_s = min(load_s, time.perf_counter() - t0)
    assert len(loaded.timer_done) == args.delivered and loaded.timer_delivered(offsets[-1])
    out = {"held_mb": round(held / 2**20, 2), "apply_s": round(apply_s, 3), "loop_copy_ms": round(copy_s * 1000, 2),
           "save_s": round(save_s, 4), "file_bytes": size, "load_s": round(load_s, 4)}
    print(name, out)
    return out


base = measure(baseline_module(), f"baseline ({args.baseline_rev})")
mine = measure(ours, "runs")
print(json.dumps({"delivered": args.delivered, "every": args.every, "baseline": base, "ours": mine,
                  "ratio": round(mine["save_s"] / base["save_s"], 4)}))
