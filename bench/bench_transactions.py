"""Committed transactions per second end to end, beside plain sends, in one run;
or, with ``--startup``, start-up time and memory of a store full of decided transactions.

    python bench/bench_transactions.py [--seconds 5] [--inflight 64] [--size 1024] [--baseline DIR --rounds 3]
    python bench/bench_transactions.py --startup [N=60000] [--starts 3] [--inflight 256] [--size 1024]

A client process keeps ``--inflight`` transactions in flight against the real
broker (sync flush): half message, a no-op local transaction, END_TRANSACTION
(acknowledged), and counts a transaction done when a long-polling consumer in
the same process has received its message. In the same run, the same client
stack does plain sends with the same concurrency. A transaction is two round
trips and three appends (half; committed message + op record in one batch).

The last line is JSON: the figures and "ratio" = transactions/s / plain sends/s.

``--baseline DIR``: another checkout's broker (e.g. ``git worktree add --detach /tmp/base main``) measured in
the same run, ``--rounds`` times, alternated with this one's (the clients are this checkout's for both);
each row adds the broker's CPU per operation (``/proc/PID/stat``), medians are printed, and "ratio" is
this checkout's transactions/plain over the baseline's, "tx_cpu_ratio" its broker CPU per transaction over
the baseline's (on a busy machine the CPU figures hold better than the rates).

Start-up mode (``--startup``, bench/startup.py does the work): the real broker (sync
flush, port 0, its own temporary store) takes N committed transactions (acknowledged
END, ``--inflight`` at once); a second broker takes plain sends of the same number of
records and the same bytes; each is restarted ``--starts`` times, after a clean stop and
after kill -9, and the medians are reported. JSON figures: startup_tx_s, startup_plain_s,
"ratio" = startup_tx_s / startup_plain_s, bytes_per_decided = (RSS tx - RSS plain) / N,
and the same after a crash (crash_*).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class Commit:
    def execute_local_transaction(self, msg, arg):
        from producer import LocalTransactionState
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        from producer import LocalTransactionState
        return LocalTransactionState.COMMIT_MESSAGE


async def consume(namesrv, topic, target, seen, stop):
    from consumer import PullConsumer
    consumer = PullConsumer(namesrv, f"CG_{topic}")
    queues = await consumer.fetch_queues(topic)
    offsets = {mq: 0 for mq in queues}
    last = time.perf_counter()

    async def one(mq):
        nonlocal last
        while not stop.is_set() or seen[0] < target[0]:
            res = await consumer.pull(mq, offsets[mq], max_nums=32, suspend_ms=500)
            if res.messages:
                seen[0] += len(res.messages)
                last = time.perf_counter()
            offsets[mq] = res.next_begin_offset
            if stop.is_set() and seen[0] >= target[0]:
                break

    await asyncio.gather(*(one(mq) for mq in queues))
    await consumer.shutdown()
    return last


async def run(namesrv: str, mode: str, seconds: float, inflight: int, size: int) -> dict:
    from producer import Producer, TransactionProducer
    topic = "BenchTx" if mode == "tx" else "BenchPlain"
    producer = TransactionProducer(namesrv, "PG_benchtx", Commit()) if mode == "tx" else Producer(namesrv, "PG_bench")
    await producer.start()
    body = b"x" * size
    # warm-up creates the topic so the consumer can find its queues
    await (producer.send_in_transaction(topic, body) if mode == "tx" else producer.send(topic, body))
    loop = asyncio.get_running_loop()
    target, seen, stop = [1], [0], asyncio.Event()
    consumer = loop.create_task(consume(namesrv, topic, target, seen, stop))
    done = 0
    stop_at = loop.time() + seconds
    t0 = time.perf_counter()

    async def worker():
        nonlocal done
        while loop.time() < stop_at:
            if mode == "tx":
                r = await producer.send_in_transaction(topic, body)
                assert r.acknowledged
            else:
                await producer.send(topic, body)
            done += 1

    await asyncio.gather(*(worker() for _ in range(inflight)))
    target[0] = done + 1
    stop.set()
    last_seen = await asyncio.wait_for(consumer, 60)
    await producer.shutdown()
    elapsed = max(last_seen, time.perf_counter() if seen[0] < target[0] else last_seen) - t0
    return {"count": done, "seconds": elapsed, "per_s": done / elapsed, "consumed": seen[0]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--inflight", type=int, default=None, help="in flight at once (64; start-up mode 256)")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--client", nargs=2, metavar=("NAMESRV", "MODE"))
    p.add_argument("--startup", type=int, nargs="?", const=60000, metavar="N",
                   help="start-up / memory mode: a store of N committed transactions against a plain one")
    p.add_argument("--starts", type=int, default=3, help="start-up mode: restarts per store (median)")
    p.add_argument("--baseline", type=Path, help="another checkout, measured in the same run")
    p.add_argument("--rounds", type=int, default=3, help="with --baseline: rounds, alternated")
    args = p.parse_args()
    if args.startup is not None:
        from bench.startup import main as startup_main
        startup_main(args.startup, starts=args.starts, inflight=args.inflight or 256, size=args.size)
        return
    args.inflight = args.inflight or 64
    import uvloop
    if args.client:
        print(json.dumps(uvloop.run(run(args.client[0], args.client[1], args.seconds, args.inflight, args.size))))
        return
    if args.baseline:
        compare(args)
        return
    results = measure(REPO, args)
    ratio = results["tx"]["per_s"] / results["plain"]["per_s"]
    for mode, label in (("plain", "plain sends"), ("tx", "transactions (committed, consumed)")):
        r = results[mode]
        print(f"{label:36}{r['per_s']:10.0f}/s  ({r['count']} in {r['seconds']:.1f} s, {r['consumed']} consumed)")
    print(f"ratio transactions/plain: {ratio:.2f}  (inflight {args.inflight}, {args.size} B, sync flush)")
    print(json.dumps({"bench": "transactions", "tx_per_s": round(results["tx"]["per_s"]),
                      "plain_per_s": round(results["plain"]["per_s"]), "ratio": round(ratio, 3)}))


def measure(repo: Path, args) -> dict:
    """plain and tx rows against a fresh broker of ``repo``, with the broker's CPU per operation."""
    from bench.bench_send_path import _cpu_s        # the broker's utime + stime, s
    from tests.support.broker_process import BrokerProcess
    results = {}
    with tempfile.TemporaryDirectory(prefix="txmq-benchtx-") as tmp:
        broker = BrokerProcess(Path(tmp) / "store", "--flush", "sync", "--metrics-snapshot-interval-s", "0",
                               repo=repo).start()
        try:
            for mode in ("plain", "tx"):
                cpu = _cpu_s(broker.proc.pid)
                out = subprocess.run([sys.executable, __file__, "--client", broker.namesrv, mode,
                                      "--seconds", str(args.seconds), "--inflight", str(args.inflight),
                                      "--size", str(args.size)], capture_output=True, text=True, check=True,
                                     cwd=REPO)
                results[mode] = r = json.loads(out.stdout.strip().splitlines()[-1])
                r["broker_us_per_op"] = (_cpu_s(broker.proc.pid) - cpu) / r["count"] * 1e6
        finally:
            broker.stop()
    return results


def compare(args) -> None:
    import statistics
    repos = {"this": REPO, "baseline": args.baseline.resolve()}
    runs: dict[str, list] = {k: [] for k in repos}
    for r in range(args.rounds):
        for name in (repos if r % 2 == 0 else reversed(list(repos))):
            res = measure(repos[name], args)
            row = {"tx_per_s": res["tx"]["per_s"], "plain_per_s": res["plain"]["per_s"],
                   "ratio": res["tx"]["per_s"] / res["plain"]["per_s"],
                   "tx_us": res["tx"]["broker_us_per_op"], "plain_us": res["plain"]["broker_us_per_op"]}
            runs[name].append(row)
            print(f"round {r + 1} {name:8} tx {row['tx_per_s']:7.0f}/s {row['tx_us']:6.1f} us  plain "
                  f"{row['plain_per_s']:7.0f}/s {row['plain_us']:6.1f} us  ratio {row['ratio']:.3f}", flush=True)
    med = {name: {k: statistics.median(row[k] for row in rows) for k in rows[0]} for name, rows in runs.items()}
    print(f"\nmedians of {args.rounds} rounds (broker CPU in us per operation)")
    for name, m in med.items():
        print(f"{name:8} tx {m['tx_per_s']:7.0f}/s {m['tx_us']:6.1f} us  plain {m['plain_per_s']:7.0f}/s "
              f"{m['plain_us']:6.1f} us  ratio {m['ratio']:.3f}")
    fig = {"bench": "transactions", "rounds": args.rounds}
    for name, m in med.items():
        fig[name] = {k: round(v, 3 if k == "ratio" else 1) for k, v in m.items()}
    fig["ratio"] = round(med["this"]["ratio"] / med["baseline"]["ratio"], 3)
    fig["tx_cpu_ratio"] = round(med["this"]["tx_us"] / med["baseline"]["tx_us"], 3)   # below 1: cheaper
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
