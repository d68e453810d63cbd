"""Our Producer's cost per message: client CPU (utime+stime from /proc) per message and msgs/s.

    python bench/bench_client.py [--client LABEL=REPO ...] [--broker REPO|own] [--modes plain,linger]
                                 [--seconds 3] [--reps 3] [--inflight 64] [--linger-inflight 256]

Each ``--client`` is a checkout of this project (e.g. a second worktree at main); the first is the
baseline, the last the candidate. One broker (sync flush, from ``--broker``, default this checkout;
``own``: every client against a broker from its own checkout, for bisecting) serves the runs; each
run is a fresh client process, with the clients alternating within each repetition, so old and new
are measured back to back. Modes:

| mode   | what is measured                                                              |
|--------|-------------------------------------------------------------------------------|
| plain  | ``Producer.send``, ``--inflight`` in flight                                   |
| linger | ``Producer(batch_size=32, linger_ms=1).send``, ``--linger-inflight`` in flight |
| batch  | ``Producer.send_batch`` of 32, 8 in flight                                    |

``cpu_us`` is the client process's CPU per message over the timed loop only (after a warm-up);
``broker_us`` the broker's over the same run. The last line is JSON: the medians per client and
mode and ``"ratio"``: baseline client CPU per plain message / candidate's (> 1: the candidate is
cheaper).
"""
from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
TOPIC = "BenchClient"
_LISTENING = re.compile(r"LISTENING broker=(\S+) namesrv=(\S+) metrics=(\S+)")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str = "self") -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK          # utime, stime (fields 14 and 15)


# ------------------------------------------------------------------ the client process
async def client(namesrv: str, mode: str, seconds: float, inflight: int, size: int) -> dict:
    import asyncio
    from producer import Producer
    body = b"x" * size
    options = {"batch_size": 32, "linger_ms": 1.0} if mode == "linger" else {}
    async with Producer(namesrv, "PG_bench_client", **options) as producer:
        for _ in range(3):
            await asyncio.gather(*(producer.send(TOPIC, body) for _ in range(inflight)))     # warm-up
        if mode == "batch":
            bodies = [body] * 32
            op, per_op, inflight = (lambda: producer.send_batch(TOPIC, bodies)), 32, 8
        else:
            op, per_op = (lambda: producer.send(TOPIC, body)), 1
        requests = 0
        name = "_send_text" if hasattr(producer, "_send_text") else "_send"     # the method every send calls
        send = getattr(producer, name)

        def counted(*a, **kw):          # requests on the wire: messages / requests is the batch size reached
            nonlocal requests
            requests += 1
            return send(*a, **kw)
        setattr(producer, name, counted)
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + seconds
        done = 0

        async def worker():
            nonlocal done
            while loop.time() < stop_at:
                await op()
                done += per_op

        cpu0, t0 = cpu_seconds(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    return {"count": done, "seconds": elapsed, "per_s": done / elapsed, "cpu_us": cpu / done * 1e6,
            "per_request": done / max(requests, 1)}


# ------------------------------------------------------------------ the driver
class Broker:
    def __init__(self, repo: Path, store: Path, extra: list[str]):
        flags = ["--flush", "sync", *extra]
        if "metrics_snapshot_interval_s" in (repo / "broker" / "config.py").read_text():
            flags += ["--metrics-snapshot-interval-s", "0"]
        self.log = open(store.parent / f"{store.name}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "broker", "--host", "127.0.0.1", "--port", "0", "--namesrv-port", "0",
             "--metrics-port", "0", "--store-dir", str(store), *flags],
            cwd=repo, stdout=subprocess.PIPE, stderr=self.log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        buf, deadline = b"", time.monotonic() + 30
        while b"\n" not in buf and time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
        sel.close()
        m = _LISTENING.search(buf.decode(errors="replace"))
        if not m:
            self.stop()
            raise RuntimeError(f"broker in {repo} did not start: {buf!r}")
        self.namesrv = m.group(2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_client(repo: Path, broker: Broker, mode: str, args) -> dict:
    inflight = args.linger_inflight if mode == "linger" else args.inflight
    b0 = cpu_seconds(broker.proc.pid)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", mode, "--namesrv", broker.namesrv,
                          "--repo", str(repo), "--seconds", str(args.seconds), "--inflight", str(inflight),
                          "--size", str(args.size)], capture_output=True, text=True, cwd=repo, timeout=120)
    if out.returncode:
        raise RuntimeError(f"client {repo} {mode} failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["broker_us"] = (cpu_seconds(broker.proc.pid) - b0) / res["count"] * 1e6   # includes warm-up: rough
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--client", action="append", metavar="LABEL=REPO",
                   help="a checkout to measure (repeatable; first = baseline, last = candidate); default this one")
    p.add_argument("--broker", default=str(REPO), help="checkout whose broker serves every client, or 'own'")
    p.add_argument("--broker-flag", action="append", default=[], help="passed to the broker (repeatable)")
    p.add_argument("--modes", default="plain,linger")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--inflight", type=int, default=64)
    p.add_argument("--linger-inflight", type=int, default=256)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--child", metavar="MODE", help=argparse.SUPPRESS)
    p.add_argument("--namesrv", help=argparse.SUPPRESS)
    p.add_argument("--repo", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        sys.path.insert(0, args.repo)
        import uvloop
        print(json.dumps(uvloop.run(client(args.namesrv, args.child, args.seconds, args.inflight, args.size))))
        return
    clients = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in (args.client or [f"this={REPO}"])]
    modes = args.modes.split(",")
    results: dict[str, dict[str, list[dict]]] = {label: {m: [] for m in modes} for label, _ in clients}
    with tempfile.TemporaryDirectory(prefix="txmq-bench-client-", dir=os.environ.get("TXMQ_BENCH_DIR")) as tmp:
        shared = None if args.broker == "own" else Broker(Path(args.broker).resolve(), Path(tmp) / "store",
                                                             args.broker_flag)
        try:
            for rep in range(args.reps):
                order = clients if rep % 2 == 0 else clients[::-1]
                for mode in modes:
                    for label, repo in order:
                        broker = shared or Broker(repo, Path(tmp) / f"store-{label}-{rep}-{mode}", args.broker_flag)
                        try:
                            r = run_client(repo, broker, mode, args)
                        finally:
                            if shared is None:
                                broker.stop()
                        results[label][mode].append(r)
                        print(f"rep {rep} {mode:7} {label:10} {r['per_s']:9.0f} msgs/s  client {r['cpu_us']:6.1f} "
                              f"us/msg  broker {r['broker_us']:6.1f} us/msg  {r['per_request']:5.1f} msgs/request",
                              flush=True)
        finally:
            if shared is not None:
                shared.stop()
    fig: dict = {"bench": "client", "reps": args.reps, "seconds": args.seconds}
    print(f"\n{'median':18}{'msgs/s':>10}{'client us/msg':>15}{'broker us/msg':>15}")
    for label, _ in clients:
        for mode in modes:
            rs = results[label][mode]
            med = {k: statistics.median(r[k] for r in rs) for k in ("per_s", "cpu_us", "broker_us")}
            fig[f"{label}_{mode}"] = {k: round(v, 1) for k, v in med.items()}
            print(f"{label + ' ' + mode:18}{med['per_s']:10.0f}{med['cpu_us']:15.1f}{med['broker_us']:15.1f}")
    base, cand = clients[0][0], clients[-1][0]
    for mode in modes:
        fig[f"{mode}_cpu_ratio"] = round(fig[f"{base}_{mode}"]["cpu_us"] / fig[f"{cand}_{mode}"]["cpu_us"], 3)
        fig[f"{mode}_rate_ratio"] = round(fig[f"{cand}_{mode}"]["per_s"] / fig[f"{base}_{mode}"]["per_s"], 3)
    fig["ratio"] = fig.get(f"{modes[0]}_cpu_ratio")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
