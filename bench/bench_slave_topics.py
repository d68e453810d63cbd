"""The slave's read of its master's GET_ALL_TOPIC_CONFIG body at many topics: how long its loop is held.

    python bench/bench_slave_topics.py [--topics 50000] [--runs 3]

"before": as the sync read it, parse_topic_table in a thread (asyncio.to_thread). Its json.loads of the whole body
is one C call that keeps the GIL throughout, so the loop is held for all of it, thread or not: its CPU time is the
hold (run it with a ticker on the loop to see the gap: the same, on an idle machine). "now": read_topic_table
driven a step at a time, as broker/slices.in_steps runs it on the loop: its longest step's CPU time is the hold;
"now_unchanged", with the version last taken (an unchanged table: every sync but the first). CPU times, not wall
gaps: on a loaded machine the wall measures the other processes. The same body, the same run, the heap settled
first as the broker settles it (broker/heap.py). Last line JSON: "ratio" = the longest hold now / before.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.topics import read_topic_table  # noqa: E402


def steps_cpu(reader) -> list[float]:
    """The CPU seconds of each step of the generator ``reader``."""
    steps = []
    while True:
        t0 = time.process_time()
        try:
            next(reader)
        except StopIteration:
            steps.append(time.process_time() - t0)
            return steps
        steps.append(time.process_time() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topics", type=int, default=50_000)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    table = {f"T{i}": {"topicName": f"T{i}", "readQueueNums": 8, "writeQueueNums": 8, "perm": 6,
                       "topicFilterType": "SINGLE_TAG", "topicSysFlag": 0, "order": False} for i in range(a.topics)}
    body = json.dumps({"dataVersion": {"counter": 3, "timestamp": 1}, "topicConfigTable": table}).encode()
    del table
    gc.collect()
    gc.freeze()
    fig = {"topics": a.topics, "body_bytes": len(body)}
    holds = {"before": [], "now": [], "now_unchanged": []}
    for _ in range(a.runs):
        t0 = time.process_time()
        json.loads(body)
        holds["before"].append([time.process_time() - t0])
        holds["now"].append(steps_cpu(read_topic_table(body)))
        holds["now_unchanged"].append(steps_cpu(read_topic_table(body, (1, 3))))
    for name, runs in holds.items():
        hold = min(max(steps) for steps in runs)        # the best run's longest step: the least disturbed
        cpu = min(sum(steps) for steps in runs)
        print(f"{name}: the loop held {hold * 1000:.1f} ms at most ({len(runs[0])} steps, {cpu * 1000:.0f} ms CPU; "
              f"best of {a.runs})")
        fig[f"{name}_hold_ms"], fig[f"{name}_cpu_ms"] = round(hold * 1000, 2), round(cpu * 1000, 1)
    fig["ratio"] = round(fig["now_hold_ms"] / fig["before_hold_ms"], 4)
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
