"""Start-up mode of bench_transactions.py: what a store of decided transactions costs at start.

    python bench/bench_transactions.py --startup [N] [--starts 3] [--inflight 256] [--size 1024]

Two stores are built by the real broker (sync flush, port 0, each its own temporary
directory), in the same run:

    tx      N transactions through TransactionProducer, each committed with an acknowledged
            END: per transaction a half, the committed message and a decision op record
    plain   plain sends with as many commit-log records and as many bytes as the tx store.
            A probe send gives the plain record's fixed overhead (header, topic, properties);
            the remaining records get bodies of b or b+1 bytes, as many of b+1 as make the
            byte count exact (see fill_plain)

Each builder is ended with kill -9, and a copy of that store is kept (the crash image).
Then, interleaving tx and plain, each store is started ``starts`` times from a fresh (sparse) copy
of its crash image and killed again (crash start-up), then started once and stopped
cleanly, then started ``starts`` times with a clean stop after each (clean start-up).
A start is timed from just before the process is spawned to its LISTENING line; RSS is
read from /proc/PID/status (VmRSS and RssAnon) right after that line. Medians are
reported. The files are in the page cache throughout (warm starts, both stores alike).

The last line is JSON: startup_tx_s, startup_plain_s, ratio = tx / plain,
bytes_per_decided = (VmRSS tx - VmRSS plain) / N (and _anon from RssAnon), the same for
the crash starts (crash_*), and the records and bytes of both logs.
"""
from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

BROKER_FLAGS = ("--flush", "sync", "--metrics-snapshot-interval-s", "0")
START_TIMEOUT_S = 600.0
FILL_TIMEOUT_S = 3600.0


class Commit:
    """A local transaction that always commits (checks, should any come, commit too)."""

    def execute_local_transaction(self, msg, arg):
        from producer import LocalTransactionState
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        from producer import LocalTransactionState
        return LocalTransactionState.COMMIT_MESSAGE


# ------------------------------------------------------------------ the logs
def log_extent(store_dir: Path) -> tuple[int, int]:
    """(records, bytes) of a store's commit log: every record up to the end of written data."""
    from protocol.message import MESSAGE_MAGIC, peek_record

    directory = store_dir / "commitlog"
    names = sorted((n for n in os.listdir(directory) if n.isdigit()), key=int) if directory.is_dir() else []
    records = size = 0
    for name in names:
        with open(directory / name, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                continue
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)   # read only what is written
        try:
            pos = 0
            while len(data) - pos >= 8:
                total, magic = peek_record(data, pos)
                if magic != MESSAGE_MAGIC or total <= 0:
                    break
                records += 1
                size += total
                pos += total
        finally:
            data.close()
    return records, size


# ------------------------------------------------------------------ filling
async def _run_workers(count: int, inflight: int, one) -> None:
    """Call ``one(i)`` for i in range(count), ``inflight`` at a time."""
    counter = iter(range(count))

    async def worker():
        for i in counter:
            await one(i)

    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(inflight))), FILL_TIMEOUT_S)


async def fill_tx(namesrv: str, n: int, size: int, inflight: int) -> None:
    """N transactions, each committed with an END the broker acknowledged."""
    from producer import TransactionProducer

    producer = TransactionProducer(namesrv, "PG_benchstartup", Commit())
    await producer.start()
    body = b"t" * size

    async def one(_):
        result = await producer.send_in_transaction("BenchStartupTx", body)
        if not result.acknowledged:
            raise RuntimeError("END_TRANSACTION was not acknowledged")

    try:
        await _run_workers(n, inflight, one)
    finally:
        await producer.shutdown()


async def fill_plain(namesrv: str, store_dir: Path, records: int, total_bytes: int, inflight: int) -> None:
    """Plain sends until the log holds ``records`` records of ``total_bytes`` bytes.

    A 64-byte probe gives the plain record's overhead (its size less its body: fixed for
    one topic and producer, the properties being UNIQ_KEY and WAIT of fixed lengths). The
    remaining records share the remaining bytes: body b = the average less that overhead,
    and ``extra`` of them one byte more, where extra = what is left after b everywhere."""
    from producer import Producer

    producer = Producer(namesrv, "PG_benchstartup_plain")
    await producer.start()
    try:
        before = log_extent(store_dir)
        probe = 64
        await producer.send("BenchStartupPlain", b"p" * probe)
        have_records, have_bytes = log_extent(store_dir)
        if have_records != before[0] + 1:
            raise RuntimeError(f"probe send wrote {have_records - before[0]} records, not 1")
        overhead = have_bytes - before[1] - probe
        left_records, left_bytes = records - have_records, total_bytes - have_bytes
        if left_records <= 0:
            return
        body_len = left_bytes // left_records - overhead
        extra = left_bytes - left_records * (overhead + body_len)
        if body_len < 0:
            raise RuntimeError(f"tx records average less than a plain record's overhead ({overhead} B)")
        small, large = b"p" * body_len, b"p" * (body_len + 1)
        await _run_workers(left_records, inflight,
                           lambda i: producer.send("BenchStartupPlain", large if i < extra else small))
    finally:
        await producer.shutdown()


# ------------------------------------------------------------------ starts
def _status(pid: int) -> dict[str, int]:
    """VmRSS and RssAnon of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


def timed_start(store_dir: Path):
    """Start a broker on the store: (seconds to LISTENING, VmRSS, RssAnon, the BrokerProcess)."""
    from tests.support.broker_process import BrokerProcess

    broker = BrokerProcess(store_dir, *BROKER_FLAGS)
    t0 = time.perf_counter()
    broker.start(timeout=START_TIMEOUT_S)
    seconds = time.perf_counter() - t0
    status = _status(broker.proc.pid)
    return seconds, status["VmRSS"], status["RssAnon"], broker


def _stop_clean(broker) -> None:
    code = broker.stop(timeout=START_TIMEOUT_S)
    if code != 0:
        raise RuntimeError(f"broker did not stop cleanly (exit {code}):\n{broker.log()}")


def _median(samples: list[tuple]) -> dict:
    return {"s": statistics.median(s[0] for s in samples), "rss": statistics.median(s[1] for s in samples),
            "anon": statistics.median(s[2] for s in samples), "all_s": [round(s[0], 3) for s in samples]}


def _copy(src: Path, dst: Path) -> None:
    """Copy a store keeping its segments sparse: a copy that fills the 1 GiB segment's unwritten
    tail with real zero blocks makes every start read them (about 3 s here), which no real store does."""
    subprocess.run(["cp", "-a", "--sparse=always", str(src), str(dst)], check=True)


def build(kind: str, root: Path, n: int, size: int, inflight: int, like: tuple[int, int] | None):
    """Build one store with a broker that is then killed -9; keep a copy as its crash image."""
    import uvloop

    from tests.support.broker_process import BrokerProcess

    store = root / kind / "store"
    broker = BrokerProcess(store, *BROKER_FLAGS).start()
    t0 = time.perf_counter()
    try:
        if kind == "tx":
            uvloop.run(fill_tx(broker.namesrv, n, size, inflight))
        else:
            uvloop.run(fill_plain(broker.namesrv, store, like[0], like[1], inflight))
    finally:
        broker.kill()
    seconds = time.perf_counter() - t0
    _copy(store, root / kind / "crash-image")
    return store, log_extent(store), seconds


def measure(stores: dict[str, Path], root: Path, starts: int) -> tuple[dict, dict]:
    """Crash starts (fresh copy of the crash image each time, ended by kill -9), then clean starts."""
    crash = {kind: [] for kind in stores}
    clean = {kind: [] for kind in stores}
    for _ in range(starts):
        for kind, store in stores.items():
            shutil.rmtree(store)
            _copy(root / kind / "crash-image", store)
            *figures, broker = timed_start(store)
            broker.kill()
            crash[kind].append(figures)
    for kind, store in stores.items():       # recover the last crash, then stop cleanly
        _stop_clean(timed_start(store)[-1])
    for _ in range(starts):
        for kind, store in stores.items():
            *figures, broker = timed_start(store)
            _stop_clean(broker)
            clean[kind].append(figures)
    return ({k: _median(v) for k, v in clean.items()}, {k: _median(v) for k, v in crash.items()})


def _figures(prefix: str, med: dict, n: int) -> dict:
    tx, plain = med["tx"], med["plain"]
    return {f"{prefix}startup_tx_s": round(tx["s"], 3), f"{prefix}startup_plain_s": round(plain["s"], 3),
            f"{prefix}ratio": round(tx["s"] / plain["s"], 3),
            f"{prefix}rss_tx": tx["rss"], f"{prefix}rss_plain": plain["rss"],
            f"{prefix}rss_anon_tx": tx["anon"], f"{prefix}rss_anon_plain": plain["anon"],
            f"{prefix}bytes_per_decided": round((tx["rss"] - plain["rss"]) / n, 1),
            f"{prefix}bytes_per_decided_anon": round((tx["anon"] - plain["anon"]) / n, 1),
            f"{prefix}starts_tx_s": tx["all_s"], f"{prefix}starts_plain_s": plain["all_s"]}


def main(n: int, *, starts: int = 3, inflight: int = 256, size: int = 1024) -> dict:
    with tempfile.TemporaryDirectory(prefix="txmq-benchstartup-") as tmp:
        root = Path(tmp)
        tx_store, tx_extent, tx_fill_s = build("tx", root, n, size, inflight, None)
        plain_store, plain_extent, plain_fill_s = build("plain", root, n, size, inflight, tx_extent)
        print(f"built: tx {n} transactions = {tx_extent[0]} records, {tx_extent[1]} B in {tx_fill_s:.1f} s; "
              f"plain {plain_extent[0]} records, {plain_extent[1]} B in {plain_fill_s:.1f} s", flush=True)
        clean, crash = measure({"tx": tx_store, "plain": plain_store}, root, starts)
    result = {"bench": "transactions_startup", "n": n, "starts": starts, "size": size,
              "records_tx": tx_extent[0], "records_plain": plain_extent[0],
              "bytes_tx": tx_extent[1], "bytes_plain": plain_extent[1],
              "fill_tx_s": round(tx_fill_s, 1), "fill_plain_s": round(plain_fill_s, 1),
              **_figures("", clean, n), **_figures("crash_", crash, n)}
    for label, prefix in (("clean stop", ""), ("kill -9", "crash_")):
        r = result
        print(f"start-up after {label:10}  tx {r[prefix + 'startup_tx_s']:.3f} s  plain "
              f"{r[prefix + 'startup_plain_s']:.3f} s  ratio {r[prefix + 'ratio']:.2f}  "
              f"RSS tx {r[prefix + 'rss_tx'] / 2**20:.1f} MiB plain {r[prefix + 'rss_plain'] / 2**20:.1f} MiB  "
              f"{r[prefix + 'bytes_per_decided']:.0f} B/decided (anon {r[prefix + 'bytes_per_decided_anon']:.0f})")
    print(json.dumps(result))
    return result
