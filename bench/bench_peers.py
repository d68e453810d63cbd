"""txmq beside its durable peer, Redis with appendfsync always, in one run on one disk.

    python bench/bench_peers.py [--seconds 5] [--size 1024] [--inflight 64] [--batch 32] [--no-floor]

Every figure is acknowledged-after-sync (txmq: sync flush, msync per group commit;
Redis: AOF with appendfsync always, fsync per event-loop cycle), loopback, 1 KiB bodies,
Python clients on uvloop in their own process, so the client's CPU is not the server's:

| row            | what is measured                                                        |
|----------------|-------------------------------------------------------------------------|
| fdatasync      | p50 of pwrite(1 KiB) + fdatasync in the store's directory: the disk     |
| redis xadd     | XADD to one stream, ``--inflight`` pipelined on one connection          |
| redis consume  | XRANGE COUNT 32 pages over what was added                               |
| plain c=N      | ``Producer.send`` with N in flight (N = ``--inflight`` and 1)           |
| batch          | ``Producer.send_batch`` of ``--batch`` messages, 8 batches in flight    |
| linger         | ``Producer(batch_size=--batch, linger_ms=1).send``, 256 in flight       |
| transactions   | ``TransactionProducer.send_in_transaction`` (half + acknowledged END)   |
| consume        | ``PullConsumer`` draining the plain topic, 32 a pull                    |
| consume x4     | the same with ``PullConsumer.drain``: 4 pulls of a queue in flight      |
| floor c=N, c=1 | bench/bare_server.py: frames pwritev'ed, msync on a thread, answered    |

The floor rows are not txmq: a server that does only what this design must for a durable
send (read, copy into a file, msync handed to a thread and back, answer), driven by a raw
client like Redis's. They show, in the same run, how much of a target's gap belongs to the
design and the machine rather than to txmq's own work.

Redis comes from the Debian package (``apt-get install redis-server``); without it the
Redis rows are skipped and said so. The last line is JSON with every figure and
``"ratio"`` = txmq plain c=N sends/s / Redis XADD/s (the issue's first target).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOPIC, TX_TOPIC = "PeerPlain", "PeerTx"


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))] if sorted_values else 0.0


def summary(latencies: list[float], count: int, elapsed: float, **extra) -> dict:
    latencies.sort()
    return {"count": count, "seconds": elapsed, "per_s": count / elapsed if elapsed else 0.0,
            "p50_ms": percentile(latencies, 0.5) * 1000, "p99_ms": percentile(latencies, 0.99) * 1000, **extra}


async def closed_loop(seconds: float, inflight: int, op) -> tuple[list[float], float]:
    """Keep ``inflight`` calls of ``op()`` going for ``seconds``; their latencies and the elapsed time."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds
    latencies: list[float] = []

    async def worker():
        while loop.time() < stop_at:
            t0 = time.perf_counter()
            await op()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return latencies, time.perf_counter() - t0


# ------------------------------------------------------------------ the disk
def fdatasync_p50(directory: str, size: int, count: int = 400) -> dict:
    path = os.path.join(directory, "fdatasync.probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, count * size)
        os.fsync(fd)
        block, latencies = b"x" * size, []
        for i in range(count):
            t0 = time.perf_counter()
            os.pwrite(fd, block, i * size)
            os.fdatasync(fd)
            latencies.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return summary(latencies, count, sum(latencies))


# ------------------------------------------------------------------ redis
class Pipelined(asyncio.Protocol):
    """A pipelining client's bookkeeping: answers arrive in request order, one future per request."""

    def __init__(self):
        self.waiters: list[asyncio.Future] = []
        self.head = 0
        self.buf = bytearray()
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def _expect(self) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        return fut

    def _answered(self, n: int) -> list[asyncio.Future]:
        """The futures of the next ``n`` answers, in order."""
        futs = self.waiters[self.head:self.head + n]
        self.head += n
        if self.head > 4096:
            del self.waiters[:self.head]
            self.head = 0
        return futs


class Resp(Pipelined):
    """A minimal pipelining RESP2 client."""

    def command(self, *args: bytes) -> asyncio.Future:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            out += (b"$%d\r\n" % len(a), a, b"\r\n")
        self.transport.writelines(out)
        return self._expect()

    def data_received(self, data):
        self.buf += data
        pos = 0
        while True:
            parsed = _parse(self.buf, pos)
            if parsed is None:
                break
            value, pos = parsed
            [fut] = self._answered(1)
            if isinstance(value, Exception):
                fut.set_exception(value)
            else:
                fut.set_result(value)
        del self.buf[:pos]


def _parse(buf: bytearray, pos: int):
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    kind, line = buf[pos:pos + 1], bytes(buf[pos + 1:end])
    pos = end + 2
    if kind == b"+":
        return line, pos
    if kind == b"-":
        return RuntimeError(line.decode()), pos
    if kind == b":":
        return int(line), pos
    if kind == b"$":
        n = int(line)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            return None
        return bytes(buf[pos:pos + n]), pos + n + 2
    if kind == b"*":
        n, items = int(line), []
        for _ in range(max(n, 0)):
            parsed = _parse(buf, pos)
            if parsed is None:
                return None
            item, pos = parsed
            items.append(item)
        return items, pos
    raise RuntimeError(f"unexpected RESP reply type {kind!r}")


async def redis_client(port: int, seconds: float, inflight: int, size: int) -> dict:
    _, resp = await asyncio.get_running_loop().create_connection(Resp, "127.0.0.1", port)
    body = b"x" * size
    await resp.command(b"DEL", b"s")
    latencies, elapsed = await closed_loop(seconds, inflight,
                                           lambda: resp.command(b"XADD", b"s", b"*", b"d", body))
    add = summary(latencies, len(latencies), elapsed)
    total, last, t0 = 0, b"-", time.perf_counter()
    while True:
        page = await resp.command(b"XRANGE", b"s", last, b"+", b"COUNT", b"32")
        if last != b"-" and page and page[0][0] == last:
            page = page[1:]
        if not page:
            break
        total += len(page)
        last = page[-1][0]
    consume_s = time.perf_counter() - t0
    resp.transport.close()
    return {"xadd": add, "consume": {"count": total, "seconds": consume_s, "per_s": total / consume_s}}


# ------------------------------------------------------------------ the design's floor
class Framed(Pipelined):
    """Length-prefixed requests to bench/bare_server.py; its answers are 20 bytes each."""

    def request(self, frame: bytes) -> asyncio.Future:
        self.transport.write(frame)
        return self._expect()

    def data_received(self, data):
        self.buf += data
        answers = len(self.buf) // 20
        del self.buf[:answers * 20]
        for fut in self._answered(answers):
            fut.set_result(None)


async def bare_client(port: int, seconds: float, inflight: int, size: int) -> dict:
    _, conn = await asyncio.get_running_loop().create_connection(Framed, "127.0.0.1", port)
    frame = size.to_bytes(4, "big") + b"x" * size
    latencies, elapsed = await closed_loop(seconds, inflight, lambda: conn.request(frame))
    conn.transport.close()
    return summary(latencies, len(latencies), elapsed)


def run_bare(tmp: str, args) -> dict:
    data = os.path.join(tmp, "bare")
    os.makedirs(data)
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "bare_server.py"), data],
                            stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)     # printed once its file is zero-filled
        line = proc.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            raise RuntimeError(f"bench/bare_server.py did not start (exit {proc.poll()})")
        port = line.strip()
        return {"c": _child(["--bare", port], args), "c1": _child(["--bare", port, "--inflight-override", "1"], args)}
    finally:
        proc.kill()
        proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_redis(tmp: str, args) -> dict | None:
    server = shutil.which("redis-server")
    if server is None:
        print("redis-server not found (apt-get install redis-server): the Redis rows are skipped")
        return None
    port = free_port()
    data = os.path.join(tmp, "redis")
    os.makedirs(data)
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--dir", data, "--save", "",
                             "--appendonly", "yes", "--appendfsync", "always", "--protected-mode", "no"],
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
        return _child(["--redis", str(port)], args)
    finally:
        proc.terminate()
        proc.wait(10)


# ------------------------------------------------------------------ txmq
class Commit:
    def execute_local_transaction(self, msg, arg):
        from producer import LocalTransactionState
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        from producer import LocalTransactionState
        return LocalTransactionState.COMMIT_MESSAGE


async def txmq_client(namesrv: str, mode: str, seconds: float, inflight: int, size: int, batch: int) -> dict:
    from consumer import PullConsumer
    from producer import Producer, TransactionProducer
    body = b"x" * size
    if mode in ("consume", "consume_x4"):
        consumer = PullConsumer(namesrv, "CG_peers")
        total, t0 = 0, time.perf_counter()
        for mq in await consumer.fetch_queues(TOPIC):
            if mode == "consume_x4":
                async for res in consumer.drain(mq, 0, max_nums=32, inflight=4):
                    total += len(res.messages)
                continue
            offset = 0
            while True:
                res = await consumer.pull(mq, offset, max_nums=32)
                if not res.messages:
                    break
                total += len(res.messages)
                offset = res.next_begin_offset
        elapsed = time.perf_counter() - t0
        await consumer.shutdown()
        return {"count": total, "seconds": elapsed, "per_s": total / elapsed if elapsed else 0.0}
    if mode == "tx":
        async with TransactionProducer(namesrv, "PG_peers_tx", Commit()) as tx:
            await tx.send_in_transaction(TX_TOPIC, body)
            latencies, elapsed = await closed_loop(seconds, inflight, lambda: tx.send_in_transaction(TX_TOPIC, body))
        return summary(latencies, len(latencies), elapsed)
    options = {"batch_size": batch, "linger_ms": 1.0} if mode == "linger" else {}
    async with Producer(namesrv, "PG_peers", **options) as producer:
        await producer.send(TOPIC, body)
        if mode == "batch":
            bodies = [body] * batch
            latencies, elapsed = await closed_loop(seconds, inflight, lambda: producer.send_batch(TOPIC, bodies))
            return summary(latencies, len(latencies) * batch, elapsed, batches=len(latencies))
        latencies, elapsed = await closed_loop(seconds, inflight, lambda: producer.send(TOPIC, body))
    return summary(latencies, len(latencies), elapsed)


def _child(extra: list[str], args) -> dict:
    out = subprocess.run([sys.executable, __file__, *extra, "--seconds", str(args.seconds), "--size", str(args.size),
                          "--inflight", str(args.inflight), "--batch", str(args.batch)],
                         capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_txmq(tmp: str, args) -> dict:
    from tests.support.broker_process import BrokerProcess
    broker = BrokerProcess(Path(tmp) / "store", "--flush", "sync", "--metrics-snapshot-interval-s", "0").start()
    res = {}
    try:
        res["plain"] = _child(["--txmq", broker.namesrv, "plain"], args)
        res["plain_c1"] = _child(["--txmq", broker.namesrv, "plain", "--inflight-override", "1"], args)
        res["batch"] = _child(["--txmq", broker.namesrv, "batch", "--inflight-override", "8"], args)
        res["linger"] = _child(["--txmq", broker.namesrv, "linger", "--inflight-override", "256"], args)
        res["tx"] = _child(["--txmq", broker.namesrv, "tx"], args)
        res["consume"] = _child(["--txmq", broker.namesrv, "consume"], args)
        res["consume_x4"] = _child(["--txmq", broker.namesrv, "consume_x4"], args)
    finally:
        broker.stop()
    return res


def report(disk: dict, redis: dict | None, txmq: dict, args, bare: dict | None = None) -> dict:
    rows = [("fdatasync (disk)", disk), ("txmq plain c=%d" % args.inflight, txmq["plain"]),
            ("txmq plain c=1", txmq["plain_c1"]), ("txmq batch %dx, c=8" % args.batch, txmq["batch"]),
            ("txmq send, linger 1 ms, c=256", txmq["linger"]),
            ("txmq transactions c=%d" % args.inflight, txmq["tx"]), ("txmq consume", txmq["consume"]),
            ("txmq consume, 4 in flight", txmq["consume_x4"])]
    if redis is not None:
        rows[1:1] = [("redis xadd c=%d" % args.inflight, redis["xadd"]), ("redis consume", redis["consume"])]
    if bare is not None:
        rows[1:1] = [("floor c=%d (bare_server)" % args.inflight, bare["c"]), ("floor c=1 (bare_server)", bare["c1"])]
    print(f"{'':28}{'msgs/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    for label, r in rows:
        print(f"{label:28}{r['per_s']:12.0f}{r.get('p50_ms', float('nan')):10.3f}{r.get('p99_ms', float('nan')):10.3f}")
    fig = {"bench": "peers", "plain_per_s": round(txmq["plain"]["per_s"]), "tx_per_s": round(txmq["tx"]["per_s"]),
           "batch_msgs_per_s": round(txmq["batch"]["per_s"]), "linger_per_s": round(txmq["linger"]["per_s"]), "consume_per_s": round(txmq["consume"]["per_s"]),
           "consume_x4_per_s": round(txmq["consume_x4"]["per_s"]),
           "c1_p50_ms": round(txmq["plain_c1"]["p50_ms"], 3), "fdatasync_p50_ms": round(disk["p50_ms"], 3),
           "tx_over_plain": round(txmq["tx"]["per_s"] / txmq["plain"]["per_s"], 3),
           "c1_p50_over_fdatasync": round(txmq["plain_c1"]["p50_ms"] / disk["p50_ms"], 3)}
    if redis is not None:
        fig.update(redis_xadd_per_s=round(redis["xadd"]["per_s"]), redis_consume_per_s=round(redis["consume"]["per_s"]),
                   consume_over_redis=round(txmq["consume"]["per_s"] / redis["consume"]["per_s"], 3),
                   consume_x4_over_redis=round(txmq["consume_x4"]["per_s"] / redis["consume"]["per_s"], 3),
                   ratio=round(txmq["plain"]["per_s"] / redis["xadd"]["per_s"], 3))
    else:
        fig["ratio"] = None
    if bare is not None:
        fig.update(floor_per_s=round(bare["c"]["per_s"]), floor_c1_p50_ms=round(bare["c1"]["p50_ms"], 3),
                   floor_c1_p50_over_fdatasync=round(bare["c1"]["p50_ms"] / disk["p50_ms"], 3),
                   plain_over_floor=round(txmq["plain"]["per_s"] / bare["c"]["per_s"], 3))
        if redis is not None:
            fig["floor_over_redis"] = round(bare["c"]["per_s"] / redis["xadd"]["per_s"], 3)
    targets = [("plain / redis xadd", fig.get("ratio"), ">=", 1.5), ("transactions / plain", fig["tx_over_plain"], ">=", 0.6),
               ("c=1 p50 / fdatasync p50", fig["c1_p50_over_fdatasync"], "<=", 2.5),
               ("consume / redis consume", fig.get("consume_over_redis"), ">=", 2.0),
               ("consume x4 / redis consume", fig.get("consume_x4_over_redis"), ">=", 2.0),
               ("batched msgs/s", fig["batch_msgs_per_s"], ">=", 150_000)]
    for name, value, op, goal in targets:
        if value is None:
            continue
        met = value >= goal if op == ">=" else value <= goal
        print(f"{name:28}{value:>12,.3f}  target {op} {goal:,}  {'met' if met else 'MISSED'}")
    if bare is not None:
        print("the design's floor (bench/bare_server.py, same run): "
              f"c={args.inflight} {fig['floor_per_s']:,} msgs/s"
              + (f" = {fig['floor_over_redis']:.3f}x Redis" if "floor_over_redis" in fig else "")
              + f", txmq plain at {fig['plain_over_floor']:.3f} of it; "
              f"c=1 p50 {fig['floor_c1_p50_ms']:.3f} ms = {fig['floor_c1_p50_over_fdatasync']:.2f}x fdatasync")
    return fig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--inflight", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--inflight-override", type=int)
    p.add_argument("--redis", type=int, metavar="PORT")
    p.add_argument("--txmq", nargs=2, metavar=("NAMESRV", "MODE"))
    p.add_argument("--bare", type=int, metavar="PORT")
    p.add_argument("--no-floor", action="store_true", help="skip the bare_server rows")
    args = p.parse_args()
    inflight = args.inflight_override or args.inflight
    if args.redis or args.txmq or args.bare:
        import uvloop
        coro = (redis_client(args.redis, args.seconds, inflight, args.size) if args.redis else
                bare_client(args.bare, args.seconds, inflight, args.size) if args.bare else
                txmq_client(args.txmq[0], args.txmq[1], args.seconds, inflight, args.size, args.batch))
        print(json.dumps(uvloop.run(coro)))
        return
    with tempfile.TemporaryDirectory(prefix="txmq-peers-", dir=os.environ.get("TXMQ_BENCH_DIR")) as tmp:
        disk = fdatasync_p50(tmp, args.size)
        redis = run_redis(tmp, args)
        bare = None if args.no_floor else run_bare(tmp, args)
        txmq = run_txmq(tmp, args)
    print(json.dumps(report(disk, redis, txmq, args, bare)))


if __name__ == "__main__":
    main()
