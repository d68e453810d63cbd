"""GET_CONSUME_STATS of one group on a broker whose offsets table holds the groups of months (gone or not).

    python bench/bench_consume_stats_groups.py [--groups 1000 10000] [--asks 100]

A ConsumerOffsets of ``--groups`` groups, each with offsets on 20 topics x 8 queues (160, as gen_months.py's),
and the real handler (broker/processors/ops.py) asked for one group's stats ``--asks`` times, store and topics
stubbed so only the broker's own work is timed. Both arms in one process on the same table: before (the group's
topics found in a walk of every offset, as the handler did) and now (ConsumerOffsets.topics_of). mqadmin
consumerProgress and dashboards ask every group in turn: the per-ask time times the groups is what one such
listing holds the loop. Last line JSON, "ratio" = now / before at the largest table.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.processors.ops import get_consume_stats  # noqa: E402
from broker.store import ConsumerOffsets  # noqa: E402
from protocol.codes import RequestCode  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402


def _answer(coro):
    """Run the handler (a coroutine since GET_CONSUME_STATS is sliced) to its answer, no event loop's cost in the
    figure: its only awaits are the turns it gives between slices."""
    try:
        while True:
            coro.send(None)
    except StopIteration as done:
        return done.value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--asks", type=int, default=100)
    a = p.parse_args()
    out = {}
    for groups in a.groups:
        with tempfile.TemporaryDirectory() as d:
            offsets = ConsumerOffsets(d)
        for g in range(groups):
            for t in range(20):
                for q in range(8):
                    offsets.commit(f"CG_{g:05d}", f"T{(g + t) % 500:03d}", q, 1)
        ctx = SimpleNamespace(
            offsets=offsets, clients=SimpleNamespace(consumers={}, reads_elsewhere=lambda g, t: False),
            config=SimpleNamespace(broker_name="b"),
            topics=SimpleNamespace(get=lambda t: SimpleNamespace(read_queue_nums=8)),
            metrics=SimpleNamespace(consume_tps=lambda g, t: 0.0),
            store=SimpleNamespace(max_offset=lambda t, q: 10, store_time_of=lambda t, q, o: 1_000))
        row = {}
        for name in ("before", "now"):
            if name == "before":    # the walk the handler made
                offsets.topics_of = lambda group, o=offsets: sorted(
                    {t for (g, t, _q), _o in o.items() if g == group})
            else:
                del offsets.topics_of
            t0 = time.perf_counter()
            for i in range(a.asks):
                cmd = RemotingCommand.request(RequestCode.GET_CONSUME_STATS, {"consumerGroup": f"CG_{i % groups:05d}"})
                _answer(get_consume_stats(ctx, None, cmd))
            row[f"{name}_ms_an_ask"] = round((time.perf_counter() - t0) * 1000 / a.asks, 3)
        row["offsets"] = offsets.count()
        row["before_s_all_groups"] = round(row["before_ms_an_ask"] * groups / 1000, 1)
        row["now_s_all_groups"] = round(row["now_ms_an_ask"] * groups / 1000, 2)
        print(f"{groups:>6} groups ({row['offsets']} offsets): an ask {row['before_ms_an_ask']} ms before, "
              f"{row['now_ms_an_ask']} ms now; every group in turn {row['before_s_all_groups']} s before, "
              f"{row['now_s_all_groups']} s now", flush=True)
        out[groups] = row
    last = out[a.groups[-1]]
    print(json.dumps({"groups": out, "ratio": round(last["now_ms_an_ask"] / last["before_ms_an_ask"], 4)}))


if __name__ == "__main__":
    main()
