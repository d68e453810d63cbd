"""Filtered pulls: what a pull costs the broker's loop with no filter, a tag filter, and SQL92 selectors.

    python bench/bench_filter.py [--messages 20000] [--size 256] [--repeat 5] [--baseline /path/to/checkout]

A store (flush async) holds ``--messages`` records of ``--size`` bytes in one queue, each with TAGS (one of
four), ``a`` (0..99), ``region`` and a UNIQ_KEY, as a producer's messages have. Each mode drains the queue
from offset 0 with the store read a PULL makes (get_messages, 32 messages or 256 KiB a call, the filters the
pull processor builds), ``--repeat`` times; the figure is the median microseconds per message scanned, and
per pull. Tag rows run on the baseline tree too (``--baseline``, e.g. a detached worktree of main), in
turns with this one, to show the tag path did not slow down. The last line is JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TAGS = ("tagA", "tagB", "tagC", "tagD")
MODES = {                     # name -> (tag expression, SQL92 expression); a quarter of messages are tagA
    "all": ("*", None),
    "tag": ("tagA", None),
    "sql_tag": (None, "TAGS = 'tagA'"),
    "sql_3": (None, "a BETWEEN 10 AND 30 AND region IN ('eu', 'us')"),
    "sql_none": (None, "a > 1000"),                     # matches nothing: every unit scanned and evaluated
    "sql_10": (None, " OR ".join(f"(a = {i} AND TAGS = 'tagB')" for i in range(10))),
}


async def _run(tree: str, messages: int, size: int, modes: list[str]) -> dict:
    sys.path.insert(0, tree)
    from broker.clients import build_subscription
    from broker.store import MessageStore, PutRequest, StoreConfig
    d = tempfile.mkdtemp(prefix="bench-filter-")
    store = MessageStore(d, StoreConfig(flush="async"))
    await store.open()
    try:
        for i in range(messages):
            props = {"TAGS": TAGS[i % 4], "a": str(i % 100), "region": ("eu", "us", "ap")[i % 3],
                     "UNIQ_KEY": f"7F000001{i:024X}"}
            req = PutRequest.build("T", b"x" * size, queue_id=0, properties=props)
            res = await store.put(req)
            assert res.status.value == "PUT_OK", res
        out = {}
        for mode in modes:
            tags, sql = MODES[mode]
            selector = None
            if sql is not None:
                try:
                    from broker.processors.pull import selector_filter
                except ImportError:
                    continue                    # a tree without SQL92
                selector = build_subscription("T", sql, 0, "SQL92").selector
            tag_filter = build_subscription("T", tags).tag_filter() if tags else None
            t0 = time.perf_counter()
            offset, pulls, found = 0, 0, 0
            while offset < messages:
                # A filter per read, as the pull builds it: it carries the read's evaluation budget.
                args = (tag_filter,) if selector is None else (tag_filter, selector_filter(selector, "g", "T"))
                got = store.get_messages("T", 0, offset, 32, 256 * 1024, *args)
                offset, pulls, found = got.next_begin_offset, pulls + 1, found + len(got.buffers)
            dt = time.perf_counter() - t0
            out[mode] = {"us_per_msg": dt / messages * 1e6, "us_per_pull": dt / pulls * 1e6, "found": found}
        return out
    finally:
        await store.close()
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--baseline")
    p.add_argument("--child", action="store_true")
    p.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = p.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_run(args.tree, args.messages, args.size, list(MODES)))))
        return
    trees = {"new": args.tree, **({"base": args.baseline} if args.baseline else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():          # in turns, so drift hits both
            out = subprocess.run([sys.executable, __file__, "--child", "--tree", tree, "--messages",
                                  str(args.messages), "--size", str(args.size)],
                                 capture_output=True, text=True, check=True, cwd=tree)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    fig = {}
    for name, results in runs.items():
        for mode in MODES:
            rows = [r[mode] for r in results if mode in r]
            if rows:
                fig[f"{name}.{mode}"] = {k: round(statistics.median(r[k] for r in rows), 2)
                                         for k in ("us_per_msg", "us_per_pull")} | {"found": rows[0]["found"]}
    for key, row in fig.items():
        print(f"{key:16} {row['us_per_msg']:8.2f} us/msg {row['us_per_pull']:10.1f} us/pull  found {row['found']}")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
