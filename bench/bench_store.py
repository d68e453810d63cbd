"""Store append throughput against the raw floor (not collected by pytest).

    python bench/bench_store.py [--seconds 3] [--appenders 64] [--size 1024] [--dir /tmp] [--compare]

* store sync   64 coroutines each awaiting ``store.put`` in a loop, flush="sync" (group commit)
* store async  the same with flush="async"
* raw floor    one plain loop: copy the same record into an mmap of a sparse 1 GiB file 64 times,
               msync once; no event loop, no bookkeeping
* floor_prewritten  the same loop, with the file kept zero-filled and fdatasync'ed 4-16 MiB ahead
               in the same thread, as the store's reserver does on its helper thread (reported
               for transparency: it shows how much of the store's speed comes from that alone)
* --compare    also runs sync mode with the writer NOT copying while a flush is in flight, and
               with msync called on the event loop instead of the flush thread

Prints a table per round and the medians, then as the LAST line one JSON object with the
medians; "ratio" = median over rounds of (store sync appends/s / raw floor appends/s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import uvloop  # noqa: E402

from broker.store import MessageStore, PutRequest, StoreConfig  # noqa: E402
from broker.store.writer import Writer  # noqa: E402


# Run directories are deleted only at the end: on a file system mounted with "discard",
# freeing a GiB of blocks slows the journal commits of the runs that follow.
_garbage: list[str] = []


def make_request(size: int, queue_id: int = 0) -> PutRequest:
    """A record of exactly ``size`` bytes."""
    probe = PutRequest.build("BenchTopic", b"", queue_id=queue_id, properties={"TAGS": "bench"})
    body = b"x" * max(0, size - len(probe.record))
    return PutRequest.build("BenchTopic", body, queue_id=queue_id, properties={"TAGS": "bench"})


async def store_run(base: str, flush: str, seconds: float, appenders: int, size: int, queues: int) -> dict:
    d = tempfile.mkdtemp(prefix=f"bench-{flush}-", dir=base)
    try:
        store = MessageStore(d, StoreConfig(flush=flush))
        await store.open()
        reqs = [make_request(size, q) for q in range(queues)]
        count = 0
        stop = False

        async def appender(i: int):
            nonlocal count
            req = reqs[i % len(reqs)]
            req = PutRequest(bytearray(req.record), req.topic, req.queue_id, req.tags_code)
            put = store.put
            while not stop:
                res = await put(req)
                if res.status.value != "PUT_OK":
                    raise RuntimeError(res)
                count += 1

        tasks = [asyncio.ensure_future(appender(i)) for i in range(appenders)]
        await asyncio.sleep(0.5)                    # warm-up: first pages, first segment
        c0, t0, cpu0 = count, time.perf_counter(), time.thread_time()
        await asyncio.sleep(seconds)
        c1, t1, cpu1 = count, time.perf_counter(), time.thread_time()
        stop = True
        await asyncio.gather(*tasks)
        await store.close()
        rate = (c1 - c0) / (t1 - t0)
        return {"appends_per_s": rate, "mb_per_s": rate * size / 1e6, "loop_cpu_us": (cpu1 - cpu0) / (c1 - c0) * 1e6}
    finally:
        _garbage.append(d)


def floor_run(base: str, seconds: float, batch: int, size: int, prewrite: bool = False) -> dict:
    """prewrite: keep 16 MiB ahead zero-written with pwrite, as the store's reserver does (same thread)."""
    d = tempfile.mkdtemp(prefix="bench-floor-", dir=base)
    path = os.path.join(d, "seg")
    seg = 1 << 30
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, seg)           # a plain sparse file: the cheapest pages to fault in
        mm = mmap.mmap(fd, seg)
        data = bytes(make_request(size).record)
        page = mmap.PAGESIZE
        pos = n = ahead = 0
        zeros = bytes(1 << 20)
        warm_end = time.perf_counter() + 0.5
        t0 = None
        while True:
            now = time.perf_counter()
            if t0 is None and now >= warm_end:
                t0, n, cpu0 = now, 0, time.thread_time()
            if t0 is not None and now - t0 >= seconds:
                break
            if pos + batch * size > seg:
                pos = 0
                ahead = 0
            if prewrite and ahead < min(seg, pos + (4 << 20)):       # the store's 4..16 MiB policy
                while ahead < min(seg, pos + (16 << 20)):
                    os.pwrite(fd, zeros, ahead)
                    ahead += len(zeros)
                os.fdatasync(fd)
            start = pos
            for _ in range(batch):
                mm[pos:pos + size] = data
                pos += size
            a = start - start % page
            mm.flush(a, pos - a)
            n += batch
        rate = n / (time.perf_counter() - t0)
        cpu = (time.thread_time() - cpu0) / n * 1e6
        mm.close()
        return {"appends_per_s": rate, "mb_per_s": rate * size / 1e6, "loop_cpu_us": cpu}
    finally:
        os.close(fd)
        _garbage.append(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3, help="floor/sync/async rounds; medians are reported")
    ap.add_argument("--appenders", type=int, default=64)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--queues", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    ap.add_argument("--compare", action="store_true",
                    help="also run sync without copy/flush overlap, and with msync on the event loop")
    args = ap.parse_args()
    base = args.dir or tempfile.gettempdir()

    def run(flush: str) -> dict:
        return uvloop.run(store_run(base, flush, args.seconds, args.appenders, args.size, args.queues))

    # Floor and store alternate within each round: the disk's speed drifts, and a ratio of
    # neighbouring runs is steadier than a ratio of runs minutes apart.
    rounds = []
    for _ in range(args.rounds):
        r = {"floor": floor_run(base, args.seconds, args.appenders, args.size), "sync": run("sync"),
             "async": run("async"),
             "floor_prewritten": floor_run(base, args.seconds, args.appenders, args.size, prewrite=True)}
        if args.compare:
            Writer._overlap = False
            r["sync_no_overlap"] = run("sync")
            Writer._overlap = True
            Writer._flush_inline = True
            r["sync_inline_msync"] = run("sync")
            Writer._flush_inline = False
        r["ratio"] = r["sync"]["appends_per_s"] / r["floor"]["appends_per_s"]
        r["ratio_prewritten"] = r["sync"]["appends_per_s"] / r["floor_prewritten"]["appends_per_s"]
        rounds.append(r)
    names = [k for k in rounds[0] if not k.startswith("ratio")]

    print(f"{args.size}-byte records, {args.appenders} concurrent appenders, {args.seconds:g} s a run, "
          f"{args.rounds} rounds, in {base}")
    w = {n: max(len(n), 9) + 3 for n in names}
    print("appends/s")
    print(f"{'round':<7}" + "".join(f"{n:>{w[n]}}" for n in names) + f"{'sync/floor':>12}")
    for i, r in enumerate(rounds):
        print(f"{i:<7}" + "".join(f"{r[n]['appends_per_s']:>{w[n]},.0f}" for n in names) + f"{r['ratio']:>12.2f}")
    med = {n: {k: statistics.median(r[n][k] for r in rounds) for k in ("appends_per_s", "mb_per_s")}
           for n in names}
    ratio = statistics.median(r["ratio"] for r in rounds)
    ratio_pre = statistics.median(r["ratio_prewritten"] for r in rounds)
    print(f"{'median':<7}" + "".join(f"{med[n]['appends_per_s']:>{w[n]},.0f}" for n in names) + f"{ratio:>12.2f}")
    print(f"sync / floor_prewritten (median) = {ratio_pre:.2f}")
    print("MB/s (median): " + ", ".join(f"{n} {med[n]['mb_per_s']:.1f}" for n in names))
    print("CPU of the appending thread, us per append (median): " + ", ".join(
        f"{n} {statistics.median(r[n]['loop_cpu_us'] for r in rounds):.1f}" for n in names))
    for d in _garbage:
        shutil.rmtree(d, ignore_errors=True)
    out = {"record_bytes": args.size, "appenders": args.appenders, "seconds": args.seconds, "rounds": args.rounds,
           **{f"{n}_appends_per_s": round(med[n]["appends_per_s"]) for n in names},
           **{f"{n}_mb_per_s": round(med[n]["mb_per_s"], 1) for n in names},
           "ratio_vs_prewritten_floor": round(ratio_pre, 3), "ratio": round(ratio, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
