"""What the message index costs the broker: CPU per send with the index on and off, old code vs new, one run.

    python bench/bench_index.py [--count 30000] [--inflight 64] [--size 1024] [--rounds 2] [--base main]

For each round and each arm (base code and this tree, each with the index on and with
``--message-index-enable false``): a fresh broker process (sync flush) on 127.0.0.1, one
connection keeping ``--inflight`` SEND_MESSAGE_V2 requests of ``--size`` bytes in flight until
``--count`` were acknowledged, every message with its own UNIQ_KEY and a KEYS property. With the
index on, a QUERY_MESSAGE for the last key follows (answered only once the index has caught up, so
the CPU it lags behind is counted, and it must find the message). The broker's CPU is utime+stime
from /proc/PID/stat, from after the warm-up to the answer.

The base code is ``git archive <ref>`` of this repository into a temporary directory (``--base-dir``
to use a checkout instead). First, in-process, the hash of ``topic#key`` in us per key on the bench's
keys (the base's key_hash, this tree's, and the cached KeyHasher the index thread uses). The last line
is JSON; "ratio" = this tree's index cost (CPU per send on less off) / the base's, medians over the rounds.
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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from protocol.codes import RequestCode, ResponseCode  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from protocol.message import SendMessageRequestHeader  # noqa: E402

TOPIC = "BenchIndex"
_LISTENING = re.compile(rb"LISTENING broker=(\S+)")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    return proc_stat(pid)[0]


def proc_stat(pid: int) -> tuple[float, int]:
    """(utime + stime in seconds, minor page faults) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK, int(fields[7])


def start_broker(repo: Path, store: Path, index: bool) -> tuple[subprocess.Popen, str]:
    flags = ["--flush", "sync", "--metrics-snapshot-interval-s", "0"]
    if not index:
        flags += ["--message-index-enable", "false"]
    proc = subprocess.Popen([sys.executable, "-m", "broker", "--host", "127.0.0.1", "--port", "0", "--namesrv-port",
                             "0", "--metrics-port", "-1", "--store-dir", str(store), *flags],
                            cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + 60
    while b"\n" not in buf and time.monotonic() < deadline:
        if not sel.select(max(0.0, deadline - time.monotonic())):
            break
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
    sel.close()
    m = _LISTENING.search(buf)
    if not m:
        proc.kill()
        raise RuntimeError(f"broker in {repo} did not start: {buf!r}")
    return proc, m.group(1).decode()


def send_frame(i: int, size: int, body: bytes) -> RemotingCommand:
    props = f"KEYS\x01order-{i:08d}\x02TAGS\x01bench\x02UNIQ_KEY\x017F0000010C3418B4AAC2{i:012X}"
    h = SendMessageRequestHeader("PG_bench", TOPIC, queue_id=i % 4, born_timestamp=int(time.time() * 1000),
                                 properties=props)
    return RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, h.to_ext_fields(v2=True), body)


async def drive(addr: str, pid: int, index: bool, count: int, inflight: int, size: int) -> dict:
    from protocol.connection import open_connection
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port), max_in_flight=10 * inflight)
    body = b"x" * size
    for q in range(4):                          # warm-up: creates the topic and its queues
        resp = await conn.request(send_frame(count + q, size, body), 10)
        assert resp.code == 0, resp.remark
    errors = 0
    nxt = 0
    (cpu0, flt0), t0 = proc_stat(pid), time.perf_counter()

    async def worker():
        nonlocal errors, nxt
        while nxt < count:
            i = nxt
            nxt += 1
            resp = await conn.request(send_frame(i, size, body), 30)
            errors += resp.code != 0
    await asyncio.gather(*(worker() for _ in range(inflight)))
    sent = time.perf_counter()
    found = None
    if index:
        q = RemotingCommand.request(RequestCode.QUERY_MESSAGE, {"topic": TOPIC, "key": f"order-{count - 1:08d}",
                                                                 "maxNum": 4, "beginTimestamp": 0,
                                                                 "endTimestamp": 1 << 62})
        resp = await conn.request(q, 60)
        found = resp.code == ResponseCode.SUCCESS
    (cpu1, flt1), t1 = proc_stat(pid), time.perf_counter()
    conn.close()
    return {"cpu_us_per_msg": (cpu1 - cpu0) / count * 1e6, "msgs_per_s": count / (sent - t0),
            "minflt_per_msg": (flt1 - flt0) / count,
            "query_wait_ms": (t1 - sent) * 1000, "errors": errors, "found": found}


def hash_figures(base: Path) -> dict:
    """us per key of abs(hashCode("topic#key")): the base tree's key_hash, this tree's key_hash, and this
    tree's KeyHasher as the index thread uses it (topic# and a UNIQ_KEY's head cached), on the bench's keys."""
    import importlib.util
    import timeit
    spec = importlib.util.spec_from_file_location("base_index_file", base / "broker/store/index_file.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    from broker.store.index_file import KeyHasher, key_hash
    keys = [f"7F0000010C3418B4AAC2{i:012X}" for i in range(1000)] + [f"order-{i:08d}" for i in range(1000)]
    texts = [f"{TOPIC}#{k}" for k in keys]
    raw = [k.encode() for k in keys]
    hasher = KeyHasher()
    th = hasher.topic(TOPIC.encode())
    assert [hasher.key(th, k) for k in raw] == [key_hash(t) for t in texts] == [old.key_hash(t) for t in texts]
    out = {}
    for name, fn in (("base key_hash", lambda: [old.key_hash(t) for t in texts]),
                     ("new key_hash", lambda: [key_hash(t) for t in texts]),
                     ("new KeyHasher.key", lambda: [hasher.key(th, k) for k in raw])):
        out[name] = round(min(timeit.repeat(fn, number=20, repeat=3)) / 20 / len(keys) * 1e6, 3)
    return out


def run_arm(repo: Path, index: bool, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        proc, addr = start_broker(repo, Path(tmp) / "store", index)
        try:
            return asyncio.run(drive(addr, proc.pid, index, args.count, args.inflight, args.size))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=30_000)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--base", default="main", help="git ref of the code to compare with")
    ap.add_argument("--base-dir", help="a checkout of the code to compare with (instead of --base)")
    args = ap.parse_args()
    tmp = None
    if args.base_dir:
        base = Path(args.base_dir).resolve()
    else:
        tmp = tempfile.mkdtemp(prefix="bench-index-base-")
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.base], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        base = Path(tmp)
    hashes = hash_figures(base)
    print("hash us/key:", hashes, flush=True)
    arms = [("base", base, False), ("base", base, True), ("new", REPO, False), ("new", REPO, True)]
    results: dict[str, list[dict]] = {}
    try:
        for r in range(args.rounds):
            for name, repo, index in arms:
                key = f"{name} index {'on' if index else 'off'}"
                res = run_arm(repo, index, args)
                results.setdefault(key, []).append(res)
                print(f"round {r + 1} {key:16} {res['cpu_us_per_msg']:7.1f} us CPU/msg {res['msgs_per_s']:8.0f} msgs/s"
                      f"  faults/msg {res['minflt_per_msg']:5.2f}  query wait {res['query_wait_ms']:6.1f} ms"
                      f"  errors {res['errors']}  found {res['found']}",
                      flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(r["cpu_us_per_msg"] for r in v) for k, v in results.items()}
    rate = {k: statistics.median(r["msgs_per_s"] for r in v) for k, v in results.items()}
    base_cost = med["base index on"] - med["base index off"]
    new_cost = med["new index on"] - med["new index off"]
    ok = all(r["errors"] == 0 and r["found"] in (None, True) for v in results.values() for r in v)
    print(json.dumps({"bench": "index", "count": args.count, "inflight": args.inflight, "size": args.size,
                      "rounds": args.rounds, "cpu_us_per_msg": {k: round(v, 1) for k, v in med.items()},
                      "msgs_per_s": {k: round(v) for k, v in rate.items()},
                      "index_cost_us": {"base": round(base_cost, 1), "new": round(new_cost, 1)},
                      "hash_us_per_key": hashes, "all_ok": ok,
                      "ratio": round(new_cost / base_cost, 3) if base_cost > 0 else None}))


if __name__ == "__main__":
    main()
