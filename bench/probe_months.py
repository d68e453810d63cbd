"""Start the real broker on a store built by gen_months.py and measure what months of history cost.

    python bench/probe_months.py STORE [--segment-size 131072] [--watch S] [broker flags ...]

Reports (last line JSON): seconds to the LISTENING line, seconds from there to the first SEND
accepted, VmRSS after start and after the probes, open descriptors and mappings, and the worst
round trip of a HEART_BEAT sent every 5 ms while each admin command below runs (a long one means
the event loop was blocked): broker runtime info, topic list, consume stats of a group, topic
stats, query by key, plus the broker's own worst loop lag (txmq_event_loop_lag_max_seconds).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from protocol.codes import RequestCode as R  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from protocol.connection import open_connection  # noqa: E402
from tests.support.broker_process import BrokerProcess  # noqa: E402


def proc_facts(pid: int) -> dict:
    rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS"))
    return {"rss_mib": round(rss / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "maps": sum(1 for _ in open(f"/proc/{pid}/maps"))}


async def heartbeat(conn) -> float:
    t = time.perf_counter()
    await conn.request(RemotingCommand.request(R.HEART_BEAT, body=json.dumps(
        {"clientID": "probe", "producerDataSet": [], "consumerDataSet": []}).encode()), 30.0)
    return time.perf_counter() - t


async def while_running(conn, probe, what) -> dict:
    """Run ``what`` (a coroutine) while heartbeats go every 5 ms on ``probe``: its time, the worst heartbeat."""
    worst, done = 0.0, asyncio.Event()

    async def beat():
        nonlocal worst
        while not done.is_set():
            worst = max(worst, await heartbeat(probe))
            await asyncio.sleep(0.005)
    task = asyncio.create_task(beat())
    t = time.perf_counter()
    try:
        resp = await what
    finally:
        done.set()
        await task
    return {"s": round(time.perf_counter() - t, 3), "worst_heartbeat_ms": round(worst * 1000, 1),
            "code": resp.code, "body_kb": len(resp.body or b"") // 1024}


async def probes(b: BrokerProcess, ready: float, watch: float) -> dict:
    host, port = b.broker.rsplit(":", 1)
    conn = await open_connection(host, int(port))
    probe = await open_connection(host, int(port))
    out = {}
    from producer import Producer
    async with Producer(b.namesrv, "PG_probe") as p:
        r = await p.send("T000", b"first after start")
        out["first_send_after_listening_s"] = round(time.monotonic() - ready, 3)
        out["first_send"] = str(r.status)

    def req(code, **fields):
        return conn.request(RemotingCommand.request(code, {k: str(v) for k, v in fields.items()}), 120.0)
    now = int(time.time() * 1000)
    out["runtime_info"] = await while_running(conn, probe, req(R.GET_BROKER_RUNTIME_INFO))
    out["all_topic_config"] = await while_running(conn, probe, req(R.GET_ALL_TOPIC_CONFIG))
    out["consume_stats"] = await while_running(conn, probe, req(R.GET_CONSUME_STATS, consumerGroup="CG_0001"))
    out["topic_stats"] = await while_running(conn, probe, req(R.GET_TOPIC_STATS_INFO, topic="T007"))
    out["query_key"] = await while_running(conn, probe, req(
        R.QUERY_MESSAGE, topic="T001", key="cust-64", maxNum=64, beginTimestamp=0, endTimestamp=now))
    out["query_key_miss"] = await while_running(conn, probe, req(
        R.QUERY_MESSAGE, topic="T001", key="nope", maxNum=64, beginTimestamp=0, endTimestamp=now))
    if watch:       # background work (a retention pass, the check timer): the worst heartbeat meanwhile
        segs = lambda: len(os.listdir(os.path.join(b.store_dir, "commitlog")))  # noqa: E731
        before, worst, t = segs(), 0.0, time.monotonic()
        while time.monotonic() - t < watch:
            worst = max(worst, await heartbeat(probe))
            await asyncio.sleep(0.005)
        out["watch"] = {"s": watch, "worst_heartbeat_ms": round(worst * 1000, 1), "segments_before": before,
                        "segments_after": segs()}
    conn.close()
    probe.close()
    return out


def metric(b: BrokerProcess, name: str) -> float | None:
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    p.add_argument("--segment-size", type=int, default=128 * 1024)
    p.add_argument("--settle", type=float, default=0.0, help="seconds to wait after LISTENING before probing")
    p.add_argument("--watch", type=float, default=0.0, help="then heartbeat this many seconds, report the worst")
    a, broker_flags = p.parse_known_args()     # the rest go to the broker
    flags = ["--segment-size", str(a.segment_size), "--max-message-size", "65536",
             "--metrics-snapshot-interval-s", "0", *broker_flags]
    b = BrokerProcess(a.store, *flags)
    t = time.monotonic()
    b.start(timeout=1800)
    ready = time.monotonic()
    out = {"listening_s": round(ready - t, 2), **{f"start_{k}": v for k, v in proc_facts(b.proc.pid).items()}}
    try:
        if a.settle:
            time.sleep(a.settle)
        out.update(asyncio.run(probes(b, ready, a.watch)))
        out.update({f"end_{k}": v for k, v in proc_facts(b.proc.pid).items()})
        out["loop_lag_max_s"] = metric(b, "txmq_event_loop_lag_max_seconds")
    finally:
        b.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
