"""Plain-send throughput and latency against the real broker, beside the floor, in one run.

    python bench/bench_broker.py [--seconds 5] [--inflight 64] [--size 1024]

* broker: the real broker process (sync flush, group commit) on 127.0.0.1; a
  separate client process keeps ``--inflight`` SEND_MESSAGE_V2 requests of
  ``--size`` bytes in flight for ``--seconds``, recording each latency;
* floor: in the same run, a uvloop server with the same framing that appends
  each frame to an mmap and flushes once per batch, answered by the same client;
* pull drain: a PullConsumer process drains what was sent, 32 per pull.

The last line is JSON: the figures and "ratio" = broker sends/s / floor sends/s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from protocol.codes import RequestCode  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from protocol.message import SendMessageRequestHeader  # noqa: E402

TOPIC = "BenchTopic"


def send_frame(size: int, queue_id: int) -> RemotingCommand:
    h = SendMessageRequestHeader("PG_bench", TOPIC, queue_id=queue_id, born_timestamp=int(time.time() * 1000),
                                 properties="TAGS\x01bench\x02UNIQ_KEY\x017F0000010000000000000000000000AA")
    return RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, h.to_ext_fields(v2=True), b"x" * size)


# ------------------------------------------------------------------ client
async def client(addr: str, seconds: float, inflight: int, size: int) -> dict:
    from protocol.connection import open_connection
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port), max_in_flight=10 * inflight)
    latencies: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    # warm-up: creates the topic and its queues
    for q in range(4):
        await conn.request(send_frame(size, q), 10)
    stop_at = loop.time() + seconds

    async def worker(i: int):
        nonlocal errors
        while loop.time() < stop_at:
            cmd = send_frame(size, i % 4)
            t0 = time.perf_counter()
            resp = await conn.request(cmd, 10)
            latencies.append(time.perf_counter() - t0)
            if resp.code != 0:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(inflight)))
    elapsed = time.perf_counter() - t0
    conn.close()
    latencies.sort()
    n = len(latencies)
    return {"count": n, "seconds": elapsed, "per_s": n / elapsed, "errors": errors,
            "p50_ms": latencies[n // 2] * 1000, "p99_ms": latencies[int(n * 0.99)] * 1000}


async def drain(namesrv: str) -> dict:
    from consumer import PullConsumer
    consumer = PullConsumer(namesrv, "CG_bench")
    queues = await consumer.fetch_queues(TOPIC)
    total = 0
    nbytes = 0
    t0 = time.perf_counter()
    for mq in queues:
        offset = 0
        while True:
            res = await consumer.pull(mq, offset, max_nums=32)
            if not res.messages:
                break
            total += len(res.messages)
            nbytes += sum(len(m.body) for m in res.messages)
            offset = res.next_begin_offset
    elapsed = time.perf_counter() - t0
    await consumer.shutdown()
    return {"count": total, "seconds": elapsed, "per_s": total / elapsed if elapsed else 0.0,
            "mb_per_s": nbytes / elapsed / 1e6 if elapsed else 0.0}


# ------------------------------------------------------------------- floor
async def floor_server(portfile: str) -> None:
    from protocol.frame import FrameDecoder
    fd = os.open(os.path.join(os.path.dirname(portfile), "floor.mmap"), os.O_RDWR | os.O_CREAT, 0o644)
    size = 1 << 30
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
    state = {"pos": 0}
    reply_header = b'{"code":0,"flag":1,"language":"JAVA","opaque":%d,"version":409}'

    class Floor(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport
            self.dec = FrameDecoder()

        def data_received(self, data):
            frames = self.dec.feed(data)
            if not frames:
                return
            out = []
            start = state["pos"]
            for frame in frames:
                pos = state["pos"]
                if pos + len(frame) > size:
                    pos = 0
                mm[pos:pos + len(frame)] = frame
                state["pos"] = pos + len(frame)
                opaque = RemotingCommand.decode(frame).opaque
                header = reply_header % opaque
                out.append((4 + len(header)).to_bytes(4, "big") + len(header).to_bytes(4, "big") + header)
            lo = start & ~(mmap.PAGESIZE - 1)
            mm.flush(lo, max(state["pos"] - lo, 1)) if state["pos"] > lo else mm.flush()
            self.t.writelines(out)

    server = await asyncio.get_running_loop().create_server(Floor, "127.0.0.1", 0)
    Path(portfile).write_text(str(server.sockets[0].getsockname()[1]))
    await asyncio.Event().wait()


def _run_client(addr, args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--client", addr, "--seconds", str(args.seconds),
                          "--inflight", str(args.inflight), "--size", str(args.size)],
                         capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--inflight", type=int, default=64)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--client")
    p.add_argument("--drain")
    p.add_argument("--serve-floor")
    args = p.parse_args()
    import uvloop
    if args.client:
        print(json.dumps(uvloop.run(client(args.client, args.seconds, args.inflight, args.size))))
        return
    if args.drain:
        print(json.dumps(uvloop.run(drain(args.drain))))
        return
    if args.serve_floor:
        uvloop.run(floor_server(args.serve_floor))
        return

    from tests.support.broker_process import BrokerProcess
    with tempfile.TemporaryDirectory(prefix="txmq-bench-") as tmp:
        portfile = os.path.join(tmp, "floor.port")
        floor = subprocess.Popen([sys.executable, __file__, "--serve-floor", portfile], cwd=REPO)
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(portfile) or not Path(portfile).read_text():
                if time.monotonic() > deadline:
                    raise RuntimeError("floor server did not start")
                time.sleep(0.05)
            floor_res = _run_client(f"127.0.0.1:{Path(portfile).read_text()}", args)
        finally:
            floor.kill()
            floor.wait()
        broker = BrokerProcess(Path(tmp) / "store", "--flush", "sync", "--metrics-snapshot-interval-s", "0").start()
        try:
            broker_res = _run_client(broker.broker, args)
            out = subprocess.run([sys.executable, __file__, "--drain", broker.namesrv], capture_output=True,
                                 text=True, check=True, cwd=REPO)
            drain_res = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            broker.stop()
    ratio = broker_res["per_s"] / floor_res["per_s"]
    print(f"{'':24}{'sends/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'floor (mmap+flush)':24}{floor_res['per_s']:12.0f}{floor_res['p50_ms']:10.2f}{floor_res['p99_ms']:10.2f}")
    print(f"{'txmq broker (sync)':24}{broker_res['per_s']:12.0f}{broker_res['p50_ms']:10.2f}{broker_res['p99_ms']:10.2f}")
    print(f"pull drain: {drain_res['count']} messages at {drain_res['per_s']:.0f} msg/s ({drain_res['mb_per_s']:.1f} MB/s)")
    print(f"ratio broker/floor: {ratio:.2f}  (inflight {args.inflight}, {args.size} B, {args.seconds:.0f} s)")
    print(json.dumps({"bench": "broker", "send_per_s": round(broker_res["per_s"]), "floor_per_s": round(floor_res["per_s"]),
                      "p50_ms": round(broker_res["p50_ms"], 3), "p99_ms": round(broker_res["p99_ms"], 3),
                      "pull_per_s": round(drain_res["per_s"]), "send_errors": broker_res["errors"],
                      "ratio": round(ratio, 3)}))


if __name__ == "__main__":
    main()
