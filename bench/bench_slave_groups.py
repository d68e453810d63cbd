"""The slave's sync of its master's subscription groups (GET_ALL_SUBSCRIPTIONGROUP_CONFIG) at many groups, unchanged.

    python bench/bench_slave_groups.py [--groups 50000] [--runs 3]

"before": every sync read and checked the whole body (read_group_table with no version known) and compared the
groups with the slave's (SubscriptionGroups.take), the table unchanged. "now": the same body at the version last
taken, as every sync but the first after a change reads it: it stops at the dataVersion. CPU seconds per sync (the
slave pays them every --slave-sync-interval-ms, 10 s), best of the runs, the same body in the same run. Last line
JSON: "ratio" = CPU now / before.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.subscriptions import SubscriptionGroups, group_config, read_group_table  # noqa: E402


def sync_cpu(subs: SubscriptionGroups, body: bytes, known) -> float:
    """CPU seconds of one sync's read of ``body`` and, when it was read, its take."""
    t0 = time.process_time()
    _version, groups = _value(read_group_table(body, known))
    if groups is not None:
        subs.take(groups)
    return time.process_time() - t0


def _value(reader):
    """Drive the generator ``reader`` to its end (as broker/slices.in_steps does, without the loop): its value."""
    while True:
        try:
            next(reader)
        except StopIteration as done:
            return done.value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=50_000)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    master = SubscriptionGroups(tempfile.mkdtemp(), lambda: 1)
    for i in range(a.groups):
        master.groups[f"CG{i}"] = group_config(f"CG{i}", {"retryMaxTimes": 5})
    master.counter = 3
    body = master.encode()
    subs = SubscriptionGroups(tempfile.mkdtemp(), lambda: 1)
    version, groups = _value(read_group_table(body))
    subs.take(groups)                                   # the first sync: taken
    fig = {"groups": a.groups, "body_bytes": len(body)}
    for name, known in (("before", None), ("now", version)):
        cpu = min(sync_cpu(subs, body, known) for _ in range(a.runs))
        print(f"{name}: {cpu * 1000:.1f} ms CPU a sync of an unchanged table (best of {a.runs})")
        fig[f"{name}_cpu_ms"] = round(cpu * 1000, 2)
    fig["ratio"] = round(fig["now_cpu_ms"] / fig["before_cpu_ms"], 4)
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
