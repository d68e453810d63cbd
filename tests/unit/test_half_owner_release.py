"""An undecided half names the connection that sent it (Tx.owner, to ask its checks there first). It held that
connection after the connection closed, so every closed connection that had sent a still-undecided half stayed in
memory whole (its transport, buffers, handler): found by bench/fuzz_broker.py's RSS growth, 13 KB a connection
(one half a connection, 1,000 of them: RSS +14 MB; +1 MB with the owner not kept)."""
from __future__ import annotations

import asyncio
import gc
import random
import weakref
from types import SimpleNamespace

from broker.config import BrokerConfig
from broker.server import BrokerServer
from protocol.codes import ResponseCode as C
from tests.support.bounded import bounded
from tests.support.frame_fuzz import canary, sequence_step
from tests.support.raw_client import RawClient

CONNECTIONS = 20


def _conn(tx):
    owner = tx.owner
    return owner() if isinstance(owner, weakref.ref) else owner


@bounded(60)
async def test_a_closed_connection_is_not_kept_by_the_undecided_halves_it_sent(tmp_path):
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    await server.start()
    try:
        rnd, conns = random.Random(7), []
        for _ in range(CONNECTIONS):
            client = await RawClient.open(server.addresses["broker"], "127.0.0.1")
            try:
                while True:
                    cmd, kind = sequence_step(rnd, 1, [])
                    if kind == "half":
                        break
                [reply] = await client.call(cmd, 10)
                assert reply.code == C.SUCCESS, reply.remark
                conns.append(_conn(list(server.ctx.tx.pending.values())[-1]))     # (the server's end, still open)
            finally:
                client.close()
        assert len(server.ctx.tx.pending) == CONNECTIONS
        assert len({id(conn) for conn in conns}) == CONNECTIONS and None not in conns
        for conn in conns:
            await asyncio.wait_for(conn.closed.wait(), 10)
        # (the store writer's last batch holds its requests' connections until the next batch: one more write)
        assert await canary(SimpleNamespace(broker=server.addresses["broker"]), 1)
        kept = [weakref.ref(conn) for conn in conns]
        del conns, conn
        gc.collect()
        assert [ref for ref in kept if ref() is not None] == [], "closed connections kept by their halves"
        assert all(_conn(tx) is None for tx in server.ctx.tx.pending.values())
    finally:
        await server.stop()
