"""Broker CPU per message for SEND_BATCH_MESSAGE (issue 15: batched sends at least 150,000 msgs/s).

A raw client (no producer library) sends pre-encoded SEND_BATCH_MESSAGE frames of BATCH entries of
SIZE bytes, INFLIGHT frames in flight on one connection, to a real broker process (sync flush). The
broker's CPU is utime+stime of its process (/proc/PID/stat) over the timed run, per message. Each
broker tree (``--old`` and ``--new``, e.g. a worktree at main and this one) runs with the message
index on (the default) and off, alternating old/new, ``--reps`` times; the medians are reported.

    BATCH=32 INFLIGHT=8 python bench/bench_batch.py --old /work/wt-main --new . --frames 3000 --reps 3

The last line is JSON: per (tree, index) the medians, and "ratio" = old / new broker us per message
with the index on (and "ratio_index_off").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from protocol.codes import RequestCode  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from protocol.frame import FrameDecoder  # noqa: E402
from protocol.message import SendMessageRequestHeader, encode_batch  # noqa: E402

BATCH = int(os.environ.get("BATCH", "32"))
INFLIGHT = int(os.environ.get("INFLIGHT", "8"))
SIZE = int(os.environ.get("SIZE", "1024"))
_LISTENING = re.compile(r"LISTENING broker=(\S+)")


def cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def frames() -> list[bytes]:
    out = []
    for q in range(4):
        h = SendMessageRequestHeader("PG_bench", "BatchBench", queue_id=q, born_timestamp=int(time.time() * 1000),
                                     properties="WAIT\x01true\x02")
        body = encode_batch([(0, b"x" * SIZE,
                              f"TAGS\x01t{i % 4}\x02KEYS\x01k{i}\x02UNIQ_KEY\x017F00000100000000000000000000{i:04X}\x02")
                             for i in range(BATCH)])
        cmd = RemotingCommand.request(RequestCode.SEND_BATCH_MESSAGE, h.to_ext_fields(v2=True), body)
        cmd.opaque = 1000000000 + q
        out.append(cmd.encode())
    return out


def start_broker(tree: Path, store: Path, index: bool):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(store.parent / f"{store.name}.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "broker", "--host", "127.0.0.1", "--port", "0", "--namesrv-port", "0",
         "--metrics-port", "0", "--store-dir", str(store), "--flush", "sync", "--metrics-snapshot-interval-s", "0",
         "--message-index-enable", "true" if index else "false"],
        cwd=tree, stdout=subprocess.PIPE, stderr=log, env=env)
    log.close()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + 30
    while b"\n" not in buf and time.monotonic() < deadline:
        if not sel.select(max(0.0, deadline - time.monotonic())):
            break
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
    sel.close()
    m = _LISTENING.search(buf.decode(errors="replace"))
    if not m:
        proc.kill()
        raise SystemExit(f"broker in {tree} did not start: {buf!r}")
    return proc, m.group(1)


async def drive(addr: str, n: int, pid: int, fr: list[bytes]) -> dict:
    host, _, port = addr.rpartition(":")
    r, w = await asyncio.open_connection(host, int(port))
    dec = FrameDecoder()
    sent = [0]
    errs = [0]

    async def read(expect: int, total: int) -> None:
        got = 0
        while got < expect:
            data = await asyncio.wait_for(r.read(1 << 20), 30)
            if not data:
                raise SystemExit("the broker closed the connection")
            for f in dec.feed(data):
                if RemotingCommand.decode(f).code != 0:
                    errs[0] += 1
                got += 1
                if sent[0] < total:
                    w.write(fr[sent[0] % 4])
                    sent[0] += 1

    warm = min(200, n)                  # the topic is created, the code paths warmed
    for i in range(min(INFLIGHT, warm)):
        w.write(fr[i % 4])
        sent[0] += 1
    await read(warm, warm)
    sent[0] = 0
    c0, t0 = cpu_s(pid), time.perf_counter()
    for i in range(INFLIGHT):
        w.write(fr[i % 4])
        sent[0] += 1
    await read(n, n)
    el, c1 = time.perf_counter() - t0, cpu_s(pid)
    w.close()
    msgs = n * BATCH
    return {"msgs_per_s": msgs / el, "broker_us_per_msg": (c1 - c0) / msgs * 1e6, "errors": errs[0]}


def one(tree: Path, index: bool, n: int, fr: list[bytes]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_broker(tree, Path(tmp) / "store", index)
        try:
            return asyncio.run(asyncio.wait_for(drive(addr, n, proc.pid, fr), 300))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="broker tree of the baseline (e.g. a worktree at main)")
    ap.add_argument("--new", default=str(HERE))
    ap.add_argument("--frames", type=int, default=3000, help="batches per timed run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--index", default="on,off")
    a = ap.parse_args()
    fr = frames()
    runs: dict[str, list[dict]] = {}
    for rep in range(a.reps):
        for idx in a.index.split(","):
            for name, tree in (("old", a.old), ("new", a.new)):
                res = one(Path(tree).resolve(), idx == "on", a.frames, fr)
                key = f"{name}_index_{idx}"
                runs.setdefault(key, []).append(res)
                print(f"rep {rep} {key:14s} {res['broker_us_per_msg']:6.2f} us/msg {res['msgs_per_s']:9.0f} msgs/s"
                      f" errors {res['errors']}", flush=True)
    out = {"batch": BATCH, "inflight": INFLIGHT, "size": SIZE, "frames": a.frames, "reps": a.reps}
    for key, rs in runs.items():
        out[key] = {"broker_us_per_msg": round(statistics.median(r["broker_us_per_msg"] for r in rs), 2),
                    "msgs_per_s": round(statistics.median(r["msgs_per_s"] for r in rs)),
                    "errors": sum(r["errors"] for r in rs)}
    for idx in a.index.split(","):
        o, nw = out.get(f"old_index_{idx}"), out.get(f"new_index_{idx}")
        if o and nw:
            out["ratio" if idx == "on" else f"ratio_index_{idx}"] = round(
                o["broker_us_per_msg"] / nw["broker_us_per_msg"], 2)
    if "ratio" not in out:
        out["ratio"] = out.get("ratio_index_off")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
