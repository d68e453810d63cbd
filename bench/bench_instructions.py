"""The broker's instructions per operation, counted by valgrind, against a baseline checkout, in one run.

    python bench/bench_instructions.py [--baseline DIR] [--count 1000] [--modes plain,tx] [--inflight 1]

CPU time on this kind of machine (a shared VM, its clock speed and neighbours changing) moves 10-15% between
runs of the same code, so a change of a few percent cannot be seen in bench_send_path's or
bench_transactions' CPU figures. An instruction count can: the broker runs under callgrind
(``valgrind --tool=callgrind``, from the valgrind package), the client (this checkout's Producer /
TransactionProducer, in this process) sends ``--warm`` operations, the broker's counters are zeroed
(``callgrind_control -z``), ``--count`` operations are sent, and the counters are dumped: the broker's
instructions for exactly those operations, divided by their number. Its timers (the loop-lag probe, the
housekeeping) run by the wall clock, and a broker under valgrind takes ~50x longer over each operation, so
their share would be the machine's speed again: they are counted first on the idle broker for ``--idle``
seconds, and that rate times each mode's wall time is taken off. One operation at a time (``--inflight 1``,
the default) then gives about the same figure run after run on a quiet machine (within 1-4%): every request
takes the same path, a group commit of its own. On a loaded one the timers' share grows and the broker's
polling (the writer's flush waits) runs more often: up to 10% again. With more in flight the batches, and so
the figure, depend on timing too.

Modes: ``plain`` (a 1 KiB send), ``tx`` (half, a no-op local transaction, acknowledged END COMMIT: a
half, a committed message and an op record). The broker is ~50x slower under valgrind: 1,000 transactions
take about a minute per checkout.

The last line is JSON: instructions per operation for each mode and checkout, and "ratio" = this
checkout's instructions per transaction (the last mode given) over the baseline's (below 1: cheaper).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

_LISTENING = re.compile(rb"LISTENING broker=(\S+) namesrv=(\S+)")


class _Commit:
    def execute_local_transaction(self, msg, arg):
        from producer import LocalTransactionState
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        from producer import LocalTransactionState
        return LocalTransactionState.COMMIT_MESSAGE


async def _drive(namesrv: str, mode: str, count: int, inflight: int) -> None:
    from producer import Producer, TransactionProducer
    producer = (TransactionProducer(namesrv, "PG_instr_tx", _Commit()) if mode == "tx"
                else Producer(namesrv, "PG_instr"))
    await producer.start()
    body = b"x" * 1024
    left = [count]

    async def worker():
        while left[0] > 0:
            left[0] -= 1
            if mode == "tx":
                result = await producer.send_in_transaction("BenchInstr", body)
                assert result.acknowledged, result
            else:
                await producer.send("BenchInstr", body)

    try:
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(inflight))), 60 + count)
    finally:
        await producer.shutdown()


def _callgrind(pid: int, flag: str) -> None:
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True, timeout=120)


def _totals(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"{path}: no totals line")


def _count(pid: int, directory: Path, work) -> int:
    """The broker's instructions while ``work()`` runs: counters zeroed before, dumped after."""
    _callgrind(pid, "-z")
    work()
    for old in directory.glob("callgrind.out.*"):
        old.unlink()
    _callgrind(pid, "-d")
    dumps = list(directory.glob("callgrind.out.*"))
    if not dumps:
        raise RuntimeError("callgrind_control -d wrote no dump")
    return _totals(max(dumps, key=lambda p: p.stat().st_mtime))


def measure(repo: Path, modes: list[str], count: int, warm: int, inflight: int, idle_s: float) -> dict[str, float]:
    """Instructions per operation of ``repo``'s broker for each mode."""
    import uvloop
    figures = {}
    with tempfile.TemporaryDirectory(prefix="txmq-instr-") as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m", "broker",
             "--host", "127.0.0.1", "--port", "0", "--namesrv-port", "0", "--metrics-port", "0",
             "--store-dir", str(Path(tmp) / "store"), "--flush", "sync", "--metrics-snapshot-interval-s", "0"],
            cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            line = proc.stdout.readline()       # the broker's first line, or nothing if it died
            m = _LISTENING.search(line)
            if not m:
                raise RuntimeError(f"{repo}: the broker did not start under valgrind: {line!r}")
            namesrv = m.group(2).decode()
            uvloop.run(_drive(namesrv, modes[0], warm, inflight))
            idle_rate = _count(proc.pid, Path(tmp), lambda: time.sleep(idle_s)) / idle_s
            print(f"{repo.name:>12} idle   {idle_rate:12,.0f} instructions per second (its timers)", flush=True)
            for mode in modes:
                uvloop.run(_drive(namesrv, mode, warm, inflight))
                started = time.monotonic()
                total = _count(proc.pid, Path(tmp), lambda: uvloop.run(_drive(namesrv, mode, count, inflight)))
                wall = time.monotonic() - started
                # (the client's connect, heartbeat and shutdown are in the count too, the same for both checkouts)
                figures[mode] = (total - idle_rate * wall) / count
                print(f"{repo.name:>12} {mode:6} {figures[mode]:12,.0f} instructions per operation "
                      f"({total / count:,.0f} before taking off {idle_rate * wall / count:,.0f} of timers, "
                      f"{wall:.0f} s)", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, help="another checkout, measured in the same run")
    p.add_argument("--count", type=int, default=1000, help="operations counted per mode (default 1000)")
    p.add_argument("--warm", type=int, default=200, help="operations first, not counted (default 200)")
    p.add_argument("--modes", default="plain,tx", help="plain, tx, or both comma-separated (default)")
    p.add_argument("--idle", type=float, default=5.0, help="seconds the idle broker's timers are counted (5)")
    p.add_argument("--inflight", type=int, default=1, help="operations in flight (1: the same figure every run)")
    args = p.parse_args()
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"bench_instructions: {', '.join(missing)} not found; install the valgrind package "
                 "(apt-get install valgrind)")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"plain", "tx"}:
        sys.exit(f"bench_instructions: --modes takes plain and tx, not {args.modes!r}")
    started = time.monotonic()
    this = measure(HERE, modes, args.count, args.warm, args.inflight, args.idle)
    fig = {"bench": "instructions", "count": args.count, "inflight": args.inflight,
           "this": {m: round(v) for m, v in this.items()}}
    if args.baseline:
        base = measure(args.baseline.resolve(), modes, args.count, args.warm, args.inflight, args.idle)
        fig["baseline"] = {m: round(v) for m, v in base.items()}
        for m in modes:
            print(f"{m:6} this/baseline {this[m] / base[m]:.4f}")
        fig["ratio"] = round(this[modes[-1]] / base[modes[-1]], 4)
    else:
        fig["ratio"] = 1.0
    print(f"({time.monotonic() - started:.0f} s)")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
