"""Send throughput of one broker and of two brokers under one name server, on this machine, in one run.

    python bench/bench_cluster.py [--seconds 5] [--clients 3] [--concurrency 64] [--size 1024]

Each setup is a stand-alone name server plus 1 or 2 brokers (sync flush), the topic created with
8 queues on every broker. ``--clients`` client processes, each one of our Producers with
``--concurrency`` sends in flight, start together (a barrier on stdin) and send for ``--seconds``;
the producers spread sends round robin over every broker's queues, as a stock client does. The
figure is acknowledged sends per second over all clients.

The last line is JSON with "ratio" = 2-broker msgs/s / 1-broker msgs/s. On an N-core machine the
brokers, the name server and the clients share the cores: the ratio says what a second broker buys
when the clients run on the same machine, not what it buys with clients elsewhere.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOPIC = "BenchCluster"
QUEUES = 8


# ------------------------------------------------------------------ client
async def client(namesrv: str, seconds: float, concurrency: int, size: int) -> dict:
    from producer import Producer
    body = b"x" * size
    sent = errors = 0
    by_broker: dict[str, int] = {}
    async with Producer(namesrv, f"PG_bench_{os.getpid()}", send_timeout=10.0) as producer:
        await producer.routes.publish_queues(TOPIC)
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)     # the barrier
        loop = asyncio.get_running_loop()
        start = loop.time()
        stop_at = start + seconds

        async def worker():
            nonlocal sent, errors
            while loop.time() < stop_at:
                try:
                    r = await producer.send(TOPIC, body)
                except Exception:  # noqa: BLE001 - counted, the run goes on
                    errors += 1
                    continue
                sent += 1
                by_broker[r.queue.broker_name] = by_broker.get(r.queue.broker_name, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = loop.time() - start
    return {"sent": sent, "errors": errors, "elapsed_s": elapsed, "by_broker": by_broker}


# -------------------------------------------------------------- one setup
async def _prepare(brokers) -> None:
    from tests.support.cluster_process import create_topic
    for b in brokers:
        await create_topic(b.broker, TOPIC, QUEUES)


async def _wait_route(namesrv: str, names: set[str]) -> None:
    from tests.support.cluster_process import wait_for_route
    await wait_for_route(namesrv, TOPIC, names, timeout=30)


def run_setup(n_brokers: int, args, tmp: str) -> dict:
    from tests.support.broker_process import BrokerProcess
    from tests.support.cluster_process import NamesrvProcess, cluster_flags

    ns = NamesrvProcess(Path(tmp) / f"ns{n_brokers}.log").start()
    brokers = []
    clients: list[subprocess.Popen] = []
    try:
        for i in range(n_brokers):
            name = f"broker-{i}"
            brokers.append(BrokerProcess(Path(tmp) / f"{n_brokers}-{name}", *cluster_flags(ns.addr, name),
                                         "--flush", "sync", "--metrics-port", "-1",
                                         "--metrics-snapshot-interval-s", "0").start())
        asyncio.run(_prepare(brokers))
        asyncio.run(_wait_route(ns.addr, {b_name for b_name in (f"broker-{i}" for i in range(n_brokers))}))
        clients = [subprocess.Popen([sys.executable, __file__, "--client", ns.addr, "--seconds", str(args.seconds),
                                     "--concurrency", str(args.concurrency), "--size", str(args.size)],
                                    cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for _ in range(args.clients)]
        for c in clients:
            line = c.stdout.readline()
            if line.strip() != "READY":
                raise RuntimeError(f"client did not get ready: {line!r}")
        for c in clients:
            c.stdin.write("GO\n")
            c.stdin.flush()
        results = [json.loads(c.communicate(timeout=args.seconds + 120)[0].strip().splitlines()[-1])
                   for c in clients]
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        for b in brokers:
            b.stop()
        ns.stop()
    sent = sum(r["sent"] for r in results)
    elapsed = max(r["elapsed_s"] for r in results)
    by_broker: dict[str, int] = {}
    for r in results:
        for k, v in r["by_broker"].items():
            by_broker[k] = by_broker.get(k, 0) + v
    return {"brokers": n_brokers, "msgs_per_s": sent / elapsed, "sent": sent,
            "errors": sum(r["errors"] for r in results), "by_broker": by_broker}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=3, help="client processes")
    p.add_argument("--concurrency", type=int, default=64, help="sends in flight per client")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--client")
    args = p.parse_args()
    if args.client:
        import uvloop
        print(json.dumps(uvloop.run(client(args.client, args.seconds, args.concurrency, args.size))), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="txmq-bench-cluster-") as tmp:
        one = run_setup(1, args, tmp)
        two = run_setup(2, args, tmp)
    ratio = two["msgs_per_s"] / one["msgs_per_s"]
    for r in (one, two):
        print(f"{r['brokers']} broker(s): {r['msgs_per_s']:9.0f} msgs/s  ({r['sent']} sent, {r['errors']} errors, "
              f"by broker {r['by_broker']})")
    print(f"ratio 2/1: {ratio:.2f}  ({args.clients} clients x {args.concurrency} in flight, {args.size} B, "
          f"{args.seconds:.0f} s, {os.cpu_count()} cores)")
    print(json.dumps({"bench": "cluster", "one_broker_msgs_s": round(one["msgs_per_s"]),
                      "two_broker_msgs_s": round(two["msgs_per_s"]), "errors": one["errors"] + two["errors"],
                      "clients": args.clients, "concurrency": args.concurrency, "size": args.size,
                      "cores": os.cpu_count(), "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
