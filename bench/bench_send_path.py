"""The broker's send path with a client that costs next to nothing, against a baseline checkout, in one run.

    python bench/bench_send_path.py [--baseline DIR] [--count 40000] [--rounds 2] [--index on|off]

A raw client (pre-encoded SEND_MESSAGE_V2 / SEND_BATCH_MESSAGE frames, replies only counted) drives a real
broker (sync flush, port 0, its own store) so that the figures are the broker's: its CPU per message
(utime + stime from /proc/PID/stat), throughput, the mean group-commit flush (from its own
txmq_store_flush_latency_seconds) and the c=1 round trip. Rows:

| row       | what                                                                   |
|-----------|------------------------------------------------------------------------|
| plain c64 | ``--count`` single 1 KiB sends, 64 in flight                           |
| c=1 p50   | 3,000 single sends one at a time: p50 / p90 of the round trip          |
| batch     | SEND_BATCH_MESSAGE of 32 x 1 KiB, 8 in flight, ``--count`` / 16 batches |

``--baseline DIR``: a second checkout (e.g. ``git worktree add /tmp/base <ref>``) measured in the same run,
alternating with this one round by round; medians are reported. The last line is JSON with every figure
and "ratio" = this checkout's plain c64 broker CPU per message / the baseline's (below 1: cheaper).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _frames(batch: int) -> list[bytes]:
    from protocol.codes import RequestCode
    from protocol.command import RemotingCommand
    from protocol.message import SendMessageRequestHeader, encode_batch
    out = []
    for q in range(4):
        h = SendMessageRequestHeader("PG_bench", "SendPath", queue_id=q, born_timestamp=int(time.time() * 1000),
                                     properties="TAGS\x01bench\x02KEYS\x01k1\x02UNIQ_KEY\x017F0000010000000000000000000000AA")
        if batch > 1:
            h.properties = ""
            body = encode_batch([(0, b"x" * 1024, f"KEYS\x01k{i}\x02UNIQ_KEY\x017F00000100000000000000000000{i:04X}\x02")
                                 for i in range(batch)])
            out.append(RemotingCommand.request(RequestCode.SEND_BATCH_MESSAGE, h.to_ext_fields(v2=True), body).encode())
        else:
            out.append(RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, h.to_ext_fields(v2=True),
                                               b"x" * 1024).encode())
    return out


async def _closed_loop(addr: str, n: int, inflight: int, batch: int, pid: int) -> dict:
    """``n`` requests with ``inflight`` outstanding; each reply sends the next. Broker CPU over the run."""
    from protocol.frame import FrameDecoder
    host, _, port = addr.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    frames, dec = _frames(batch), FrameDecoder()
    sent = got = errors = 0

    async def replies(expect: int, refill: bool) -> None:
        nonlocal sent, got, errors
        while got < expect:
            try:
                data = await asyncio.wait_for(reader.read(1 << 20), 30)
            except asyncio.TimeoutError:
                raise RuntimeError(f"no reply for 30 s: {got} of {expect} replies, {sent} sent") from None
            if not data:
                raise RuntimeError("the broker closed the connection")
            for fr in dec.feed(data):
                errors += b'{"code":0,' not in fr[8:20]   # a JSON reply header starts with its code
                got += 1
                if refill and sent < n:
                    writer.write(frames[sent % 4])
                    sent += 1

    for f in frames:                    # warm-up: creates the topic and its queues
        writer.write(f)
    # No refill here: a read holding the last warm-up reply and the reply to a frame sent on an earlier
    # one counted that reply as warm-up, and the run then waited for it forever (a hang found in round 3).
    await replies(len(frames), refill=False)
    got = 0
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    for _ in range(min(inflight, n)):
        writer.write(frames[sent % 4])
        sent += 1
    await replies(n, refill=True)
    elapsed, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
    writer.close()
    msgs = n * batch
    return {"msgs_per_s": msgs / elapsed, "broker_us_per_msg": cpu / msgs * 1e6, "errors": errors}


async def _one_at_a_time(addr: str, n: int) -> dict:
    host, _, port = addr.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    frame = _frames(1)[0]
    lat = []
    for i in range(n + 50):
        t = time.perf_counter()
        writer.write(frame)
        size = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 30), "big")
        await asyncio.wait_for(reader.readexactly(size), 30)
        if i >= 50:
            lat.append(time.perf_counter() - t)
    writer.close()
    lat.sort()
    return {"p50_ms": lat[len(lat) // 2] * 1e3, "p90_ms": lat[int(len(lat) * 0.9)] * 1e3}


def _flush_ms(metrics: str, before: dict) -> tuple[float, dict]:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    now = {k: float(v) for k, v in re.findall(r"^txmq_store_flush_latency_seconds_(count|sum) (\S+)", text, re.M)}
    n = now.get("count", 0) - before.get("count", 0)
    return (1000 * (now.get("sum", 0) - before.get("sum", 0)) / n if n else 0.0), now


def measure(count: int, index: str) -> dict:
    """(In a child process whose sys.path is one checkout) every row against a fresh broker of that checkout."""
    import uvloop
    from tests.support.broker_process import BrokerProcess
    out = {}
    with tempfile.TemporaryDirectory(prefix="txmq-sendpath-") as tmp:
        b = BrokerProcess(Path(tmp) / "store", "--flush", "sync", "--metrics-snapshot-interval-s", "0",
                          "--message-index-enable", "true" if index == "on" else "false").start()
        try:
            pid = b.proc.pid
            _, seen = _flush_ms(b.metrics, {})
            out["plain"] = uvloop.run(_closed_loop(b.broker, count, 64, 1, pid))
            out["plain"]["flush_ms"], seen = _flush_ms(b.metrics, seen)
            out["c1"] = uvloop.run(_one_at_a_time(b.broker, 3000))
            _, seen = _flush_ms(b.metrics, seen)
            out["batch"] = uvloop.run(_closed_loop(b.broker, max(count // 16, 100), 8, 32, pid))
            out["batch"]["flush_ms"], seen = _flush_ms(b.metrics, seen)
        finally:
            b.stop()
    return out


def _run_checkout(repo: Path, args) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(repo)!r}); sys.argv = ['x']; "
            f"import importlib.util as u; s = u.spec_from_file_location('sp', {str(HERE / 'bench' / 'bench_send_path.py')!r}); "
            f"m = u.module_from_spec(s); s.loader.exec_module(m); print(json.dumps(m.measure({args.count}, {args.index!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo)
    if res.returncode:
        raise SystemExit(f"measuring {repo} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", type=Path, help="another checkout, measured in the same run")
    p.add_argument("--count", type=int, default=40000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--index", choices=("on", "off"), default="on")
    args = p.parse_args()
    repos = {"this": HERE} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    runs: dict[str, list] = {k: [] for k in repos}
    for r in range(args.rounds):
        for name, repo in repos.items():
            runs[name].append(_run_checkout(repo, args))
            print(f"round {r + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    med = {name: {row: {k: statistics.median(run[row][k] for run in rs) for k in rs[0][row]} for row in rs[0]}
           for name, rs in runs.items()}
    print(f"\n{'':10}{'':22}{'plain c64':>12}{'us/msg':>8}{'flush ms':>10}{'c=1 p50':>9}{'batch':>10}{'us/msg':>8}")
    for name, m in med.items():
        print(f"{name:10}{str(repos[name])[-22:]:22}{m['plain']['msgs_per_s']:12.0f}{m['plain']['broker_us_per_msg']:8.1f}"
              f"{m['plain']['flush_ms']:10.2f}{m['c1']['p50_ms']:9.3f}{m['batch']['msgs_per_s']:10.0f}"
              f"{m['batch']['broker_us_per_msg']:8.1f}")
    fig = {"bench": "send_path", "index": args.index, "rounds": args.rounds}
    for name, m in med.items():
        fig[name] = {"plain_per_s": round(m["plain"]["msgs_per_s"]), "plain_us_per_msg": round(m["plain"]["broker_us_per_msg"], 2),
                     "plain_flush_ms": round(m["plain"]["flush_ms"], 3), "c1_p50_ms": round(m["c1"]["p50_ms"], 3),
                     "c1_p90_ms": round(m["c1"]["p90_ms"], 3), "batch_per_s": round(m["batch"]["msgs_per_s"]),
                     "batch_us_per_msg": round(m["batch"]["broker_us_per_msg"], 2),
                     "errors": int(m["plain"]["errors"] + m["batch"]["errors"])}
    fig["ratio"] = (round(fig["this"]["plain_us_per_msg"] / fig["baseline"]["plain_us_per_msg"], 3)
                    if "baseline" in fig else None)
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
