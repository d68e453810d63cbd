"""Hostile load against a broker, in its own process (so its CPU is not the measuring client's loop).

    python -m tests.support.hostile_load HOST:PORT --idle N --flood-topics N --flood-conns N

At once: N idle connections that never send; one client that pipelines route requests and
never reads a reply; ``--flood-conns`` connections sending SEND_MESSAGE_V2 to ``--flood-topics``
new topic names (auto-create), each connection 64 requests in flight, cycling through the
names not yet accepted until told to stop. Prints "READY" when the idle connections are open;
a line on stdin starts the flood, the next stops it and prints one JSON line of the answers
it saw; end of stdin closes everything. Every request has a 10 s timeout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter

from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import BrokerError
from protocol.message import SendMessageRequestHeader


async def _never_reads(host: str, port: int) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    frame = RemotingCommand.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}).encode()
    for _ in range(400):
        writer.write(frame * 200)
        try:
            await asyncio.wait_for(writer.drain(), 0.5)
        except (asyncio.TimeoutError, ConnectionError):
            break       # the broker stopped reading us (or dropped us): hold the socket as it is
    await asyncio.sleep(3600)


async def _flood(host: str, port: int, names: list[str], codes: Counter, stop: asyncio.Event) -> None:
    conn = await open_connection(host, port, max_in_flight=1 << 16)
    sem = asyncio.Semaphore(64)
    left = list(names)

    async def one(topic: str) -> None:
        async with sem:
            if stop.is_set():
                return
            fields = SendMessageRequestHeader("PG_flood", topic, default_topic_queue_nums=8).to_ext_fields()
            try:
                resp = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, fields, b"f" * 100),
                                          10.0)
                codes[resp.code] += 1
                if resp.code == 0:
                    left.remove(topic)
            except BrokerError as exc:
                codes[type(exc).__name__] += 1

    while left and not stop.is_set():
        await asyncio.gather(*(one(t) for t in list(left)))
        await asyncio.sleep(0.05)
    conn.close()


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("broker")
    p.add_argument("--idle", type=int, default=1000)
    p.add_argument("--flood-topics", type=int, default=3000)
    p.add_argument("--flood-conns", type=int, default=20)
    args = p.parse_args(argv)
    host, _, port = args.broker.rpartition(":")
    port = int(port)
    idle = [await asyncio.open_connection(host, port) for _ in range(args.idle)]
    stuck = asyncio.get_running_loop().create_task(_never_reads(host, port))
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)        # "go"
    codes: Counter = Counter()
    stop = asyncio.Event()
    names = [f"Flood_{i}" for i in range(args.flood_topics)]
    shards = [names[i::args.flood_conns] for i in range(args.flood_conns)]
    floods = asyncio.gather(*(_flood(host, port, shard, codes, stop) for shard in shards))
    await loop.run_in_executor(None, sys.stdin.readline)        # "stop"
    stop.set()
    await floods
    print(json.dumps({"codes": {str(k): v for k, v in codes.items()}}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)        # end of input: let go of everything
    stuck.cancel()
    for _, w in idle:
        w.close()
    return 0


if __name__ == "__main__":
    import uvloop
    sys.exit(uvloop.run(main(sys.argv[1:])))
