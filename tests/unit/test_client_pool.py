"""ConnectionPool: sends waiting for the same connection share one connect attempt, so each fails within the
connect timeout when the broker cannot be reached, not one connect timeout after another."""
from __future__ import annotations

import asyncio

import pytest

from protocol import connection
from protocol.connection import ConnectionPool
from protocol.errors import ConnectionClosedError, RequestTimeoutError

pytestmark = pytest.mark.asyncio


async def test_concurrent_gets_of_an_unreachable_broker_share_one_connect_timeout(monkeypatch):
    """A black-holed broker (its host down, SYNs dropped): each connect attempt ends only at the connect
    timeout. Every send waiting for that connection queued on the address's lock and then made its own
    attempt, so the n-th of them failed after n connect timeouts -- 64 sends in flight, 64 x 3 s: a send
    with a 3 s send_timeout waiting over three minutes."""
    attempts = []

    async def black_hole(host, port, handler=None, *, timeout, **kwargs):
        attempts.append((host, port))
        await asyncio.sleep(timeout)
        raise RequestTimeoutError(f"connecting to {host}:{port} timed out after {timeout:.3g} s")

    monkeypatch.setattr(connection, "open_connection", black_hole)
    pool = ConnectionPool(connect_timeout=0.2)
    loop = asyncio.get_running_loop()
    ended = []

    async def get():
        t0 = loop.time()
        with pytest.raises(RequestTimeoutError):
            await pool.get("10.0.0.1:10911")
        ended.append(loop.time() - t0)

    async with asyncio.timeout(10):
        await asyncio.gather(*(get() for _ in range(8)))
        # every get refused by one shared connect attempt, not one each queued behind the others (the n-th after n
        # connect timeouts); was also max(ended) < 1.0 s of the loop's clock: a timed bound, the count says it
        assert len(ended) == 8 and len(attempts) == 1, (ended, attempts)
        await asyncio.gather(*(get() for _ in range(2)))   # a later get tries again
        assert len(attempts) == 2
    await pool.close()


async def test_a_closed_pool_opens_no_connection_again():
    """After close() (a client's shutdown) nothing reopens a connection behind it: a send gathered in the
    batching accumulator during the shutdown, the answer to a transaction check that was running, a
    heartbeat. Each reopened one and left it open for good -- a socket the client never closes, a producer
    still sending after its shutdown returned. They now fail with ConnectionClosedError, and a connect under
    way when the pool closes is closed, not kept."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: connection.RemotingConnection(), "127.0.0.1", 0)
    addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = ConnectionPool()
    async with asyncio.timeout(10):
        await pool.get(addr)
        under_way = loop.create_task(pool.get(addr.replace("127.0.0.1", "localhost")))
        await asyncio.sleep(0)
        assert pool._connecting, "the second connect is under way when the pool closes"
        await pool.close()
        with pytest.raises(ConnectionClosedError):
            await pool.get(addr)
        with pytest.raises(ConnectionClosedError):
            await under_way
        assert pool.connections() == [] and pool._conns == {}
    server.close()


async def test_connections_to_brokers_gone_away_are_not_kept():
    """A client in service for months sees brokers move (a new address after each restart, scaled in, replaced):
    the pool kept the closed connection of every address it ever used. They go when another is made."""
    loop = asyncio.get_running_loop()
    pool = ConnectionPool()
    async with asyncio.timeout(10):
        for _ in range(20):         # each broker comes up at a new address, serves, and goes away for good
            server = await loop.create_server(lambda: connection.RemotingConnection(), "127.0.0.1", 0)
            conn = await pool.get(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
            server.close()
            conn.close()
            await conn.closed.wait()
            await server.wait_closed()
        assert len(pool._conns) == 1 and pool.connections() == []
    await pool.close()


async def test_a_replaced_connections_late_close_is_reported_with_the_new_one_open():
    """A connection the client closes itself (a malformed frame) is no longer open at once, but its close ends
    only once its write buffer reaches a peer that reads slowly; a new connection to the address is made
    meanwhile. Its close is still reported (the broker drops the client's channel only then, and a consumer must
    heartbeat to be listed again), with ``cached(addr)`` the new, open connection: what tells a replaced one's
    late close from the current one lost (an orderly consumer keeps its locks for the former)."""
    loop = asyncio.get_running_loop()
    peers: list[asyncio.Transport] = []

    class Stalled(asyncio.Protocol):
        def connection_made(self, transport):
            peers.append(transport)
            transport.pause_reading()       # reads nothing until told: what the client writes waits in its buffer

    server = await loop.create_server(Stalled, "127.0.0.1", 0)
    addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = ConnectionPool()
    lost = []
    pool.on_lost = lambda addr: lost.append((addr, pool.cached(addr)))
    async with asyncio.timeout(10):
        old = await pool.get(addr)
        old.transport.write(b"\0" * (16 << 20))     # far more than the socket buffers hold
        old.close()
        assert not old.is_open and not old.closed.is_set()
        new = await pool.get(addr)
        assert new is not old and new.is_open
        peers[0].resume_reading()                  # the old one's buffer drains, and its close ends now
        await old.closed.wait()
        assert lost == [(addr, new)], "the late close of a replaced connection: reported, the new one open"
        peers[1].close()                           # the current one lost: reported, none open
        await new.closed.wait()
        assert lost == [(addr, new), (addr, None)]
    await pool.close()
    server.close()
