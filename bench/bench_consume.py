"""Consuming: txmq's PullConsumer draining a topic beside Redis XRANGE paging, in one run.

    python bench/bench_consume.py [--messages 100000] [--size 1024] [--max-nums 32] [--repeat 3]
                                  [--baseline /path/to/another/checkout] [--pipeline 0]

Each tree (this checkout, and ``--baseline`` when given, e.g. a worktree of main) gets its own broker
(its own code, sync flush) holding ``--messages`` records of ``--size`` bytes in the topic's queues,
sent as batches of 32 (``--fill-mode plain``: single sends); then a client process of the same tree drains every queue from offset 0,
``--max-nums`` a pull, one pull at a time (bench_peers' consume row), ``--repeat`` times, the trees
taking turns so drift hits both. Redis (appendfsync always) holds the same count of bodies in one
stream and is drained with XRANGE COUNT ``--max-nums`` pages by bench_peers' client. ``--pipeline K`` adds a row per tree
for ``PullConsumer.drain`` with K pulls in flight per queue (only where the tree has it).

CPU per message: the broker's utime+stime from /proc/PID/stat over the drain, the client's from
os.times() in the client process. Figures are medians of the repetitions. The last line is JSON;
``"ratio"`` = this tree's msgs/s / Redis msgs/s (issue 15's target: >= 2); ``"vs_baseline"`` = this
tree / the baseline tree; ``"pipelined_ratio"`` = this tree's pipelined row / Redis.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPIC = "BenchConsume"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


# ------------------------------------------------------------------ children (run inside a tree)
async def _fill(namesrv: str, count: int, size: int, mode: str) -> None:
    from producer import Producer
    body = b"x" * size
    sem = asyncio.Semaphore(8 if mode == "batch" else 64)

    async def one(n):
        async with sem:
            if mode == "batch":
                await producer.send_batch(TOPIC, [body] * n)
            else:
                await producer.send(TOPIC, body)

    async with Producer(namesrv, "PG_bench_consume") as producer:
        if mode == "batch":
            sizes = [32] * (count // 32) + ([count % 32] if count % 32 else [])
        else:
            sizes = [1] * count
        await asyncio.gather(*(one(n) for n in sizes))


async def _drain(namesrv: str, max_nums: int, pipeline: int) -> dict:
    from consumer import PullConsumer
    consumer = PullConsumer(namesrv, "CG_bench_consume")
    queues = await consumer.fetch_queues(TOPIC)
    checksum = 0
    t0, c0 = time.perf_counter(), os.times()
    total = 0
    for mq in queues:
        if pipeline:
            async for res in consumer.drain(mq, 0, max_nums=max_nums, inflight=pipeline):
                if res.messages:
                    total += len(res.messages)
                    checksum += res.messages[-1].queue_offset
        else:
            offset = 0
            while True:
                res = await consumer.pull(mq, offset, max_nums=max_nums)
                if not res.messages:
                    break
                total += len(res.messages)
                checksum += res.messages[-1].queue_offset
                offset = res.next_begin_offset
    elapsed, c1 = time.perf_counter() - t0, os.times()
    await consumer.shutdown()
    return {"count": total, "seconds": elapsed, "client_cpu_s": (c1.user - c0.user) + (c1.system - c0.system)}


def child_main(args) -> None:
    sys.path.insert(0, args.tree)
    import uvloop
    if args.fill:
        uvloop.run(_fill(args.namesrv, args.messages, args.size, args.fill_mode))
        print(json.dumps({"filled": args.messages}))
    else:
        print(json.dumps(uvloop.run(_drain(args.namesrv, args.max_nums, args.pipeline))))


def child(tree: str, *extra: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", "--tree", tree, *extra],
                         capture_output=True, text=True, cwd=tree, timeout=600)
    if out.returncode:
        raise RuntimeError(f"child failed in {tree}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ brokers
class Broker:
    def __init__(self, tree: str, store: str):
        self.tree = tree
        self.log = open(store + ".log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "broker", "--host", "127.0.0.1", "--port", "0", "--namesrv-port", "0",
             "--metrics-port", "0", "--store-dir", store, "--flush", "sync", "--metrics-snapshot-interval-s", "0"],
            cwd=tree, stdout=subprocess.PIPE, stderr=self.log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        buf, deadline = b"", time.monotonic() + 30
        while b"\n" not in buf and time.monotonic() < deadline:
            if not sel.select(1):       # quiet for a second (a loaded machine): wait on, up to the deadline
                continue
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
        sel.close()
        m = re.search(rb"LISTENING broker=(\S+) namesrv=(\S+)", buf)
        if not m:
            self.stop()
            raise RuntimeError(f"broker in {tree} did not start: {buf!r}")
        self.namesrv = m.group(2).decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def drain_once(broker: Broker, args, pipeline: int) -> dict:
    b0 = cpu_s(broker.proc.pid)
    r = child(broker.tree, "--namesrv", broker.namesrv, "--max-nums", str(args.max_nums), "--pipeline", str(pipeline))
    r["broker_cpu_s"] = cpu_s(broker.proc.pid) - b0
    if r["count"] != args.messages:
        raise RuntimeError(f"drained {r['count']} of {args.messages} messages from {broker.tree}")
    return r


# ------------------------------------------------------------------ redis
async def redis_drain(port: int, count: int, size: int, max_nums: int, repeat: int) -> list[float]:
    """bench_peers' client (asyncio on uvloop, like ours): pipelined XADDs, then XRANGE COUNT pages."""
    from bench_peers import Resp
    _, resp = await asyncio.get_running_loop().create_connection(Resp, "127.0.0.1", port)
    body = b"x" * size
    for i in range(0, count, 256):
        await asyncio.gather(*(resp.command(b"XADD", b"s", b"*", b"d", body) for _ in range(min(256, count - i))))
    rates = []
    for _ in range(repeat):
        total, last, t0 = 0, b"-", time.perf_counter()
        while True:
            page = await resp.command(b"XRANGE", b"s", last, b"+", b"COUNT", str(max_nums).encode())
            if last != b"-" and page and page[0][0] == last:
                page = page[1:]
            if not page:
                break
            total += len(page)
            last = page[-1][0]
        rates.append(total / (time.perf_counter() - t0))
    resp.transport.close()
    return rates


def run_redis(tmp: str, args) -> list[float] | None:
    server = shutil.which("redis-server")
    if server is None:
        print("redis-server not found (apt-get install redis-server): no Redis row")
        return None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.makedirs(os.path.join(tmp, "redis"))
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", os.path.join(tmp, "redis"),
                             "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
        import uvloop
        return uvloop.run(redis_drain(port, args.messages, args.size, args.max_nums, args.repeat))
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--max-nums", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--baseline", help="another checkout (e.g. a worktree of main) measured in the same run")
    p.add_argument("--pipeline", type=int, default=0, help="also drain with K pulls in flight per queue")
    p.add_argument("--fill-mode", choices=["batch", "plain"], default="batch",
                   help="batch: batches of 32, each a run of one queue; plain: single sends, 64 in flight, "
                        "queues taking turns (no two records of a queue side by side)")
    p.add_argument("--child", action="store_true")
    p.add_argument("--fill", action="store_true")
    p.add_argument("--tree", default=str(REPO))
    p.add_argument("--namesrv")
    args = p.parse_args()
    if args.child:
        child_main(args)
        return
    trees = {"new": str(REPO)}
    if args.baseline:
        trees = {"base": str(Path(args.baseline).resolve()), **trees}
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="txmq-consume-", dir=os.environ.get("TXMQ_BENCH_DIR")) as tmp:
        redis = run_redis(tmp, args)
        brokers = {}
        try:
            for name, tree in trees.items():
                brokers[name] = Broker(tree, os.path.join(tmp, name))
                child(tree, "--fill", "--namesrv", brokers[name].namesrv, "--messages", str(args.messages),
                      "--size", str(args.size), "--fill-mode", args.fill_mode)
            rows = [(name, 0) for name in trees]
            if args.pipeline:
                rows += [(name, args.pipeline) for name in trees
                         if "def drain" in Path(trees[name], "consumer", "pull_consumer.py").read_text()]
            for _ in range(args.repeat):
                for name, k in rows:
                    label = name if not k else f"{name} pipelined x{k}"
                    results.setdefault(label, []).append(drain_once(brokers[name], args, k))
        finally:
            for b in brokers.values():
                b.stop()
    fig: dict = {"bench": "consume", "fill": args.fill_mode, "messages": args.messages, "size": args.size, "max_nums": args.max_nums,
                 "repeat": args.repeat}
    print(f"{'':26}{'msgs/s':>10}{'broker us/msg':>15}{'client us/msg':>15}   (median of {args.repeat})")
    if redis:
        fig["redis_per_s"] = round(statistics.median(redis))
        print(f"{'redis XRANGE':26}{fig['redis_per_s']:10,}")
    for label, runs in results.items():
        rate = statistics.median(r["count"] / r["seconds"] for r in runs)
        broker_us = statistics.median(r["broker_cpu_s"] / r["count"] * 1e6 for r in runs)
        client_us = statistics.median(r["client_cpu_s"] / r["count"] * 1e6 for r in runs)
        key = label.replace(" ", "_")
        fig[key] = {"per_s": round(rate), "broker_us": round(broker_us, 2), "client_us": round(client_us, 2),
                    "runs": [round(r["count"] / r["seconds"]) for r in runs]}
        print(f"{label:26}{round(rate):10,}{broker_us:15.2f}{client_us:15.2f}   {fig[key]['runs']}")
    if redis:
        fig["ratio"] = round(fig["new"]["per_s"] / fig["redis_per_s"], 3)
    else:
        fig["ratio"] = None
    if "base" in fig:
        fig["vs_baseline"] = round(fig["new"]["per_s"] / fig["base"]["per_s"], 3)
    piped = f"new_pipelined_x{args.pipeline}"
    if redis and piped in fig:
        fig["pipelined_ratio"] = round(fig[piped]["per_s"] / fig["redis_per_s"], 3)
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
