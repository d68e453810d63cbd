"""The stand-alone name server process: listen, answer, expire silent brokers, stop on SIGTERM.

``python -m broker namesrv`` prints ``LISTENING namesrv=HOST:PORT`` once it
answers. Routes live in memory only, as in RocketMQ: brokers register again
within one period after a restart. The KV config is kept in ``--kv-config-path``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys

from protocol import logline
from protocol.codes import ResponseCode
from protocol.connection import ReadBudget, RemotingConnection, WriteBudget
from protocol.errors import StoreError

from ..context import monotonic_ms
from ..kv_config import KvConfig
from ..limits import ConnectionGate, set_ipv6_client_prefix
from ..store.saved import daemon_default_executor
from .config import NamesrvConfig
from .processors import NamesrvContext, namesrv_table
from .table import RouteTable

log = logging.getLogger("txmq.namesrv")


class NameServer:
    def __init__(self, config: NamesrvConfig, clock=monotonic_ms):
        self.config = config
        set_ipv6_client_prefix(config.ipv6_client_prefix)     # before any connection is counted
        table = RouteTable(expire_ms=config.broker_expire_ms, max_addresses_per_host=config.max_broker_addresses_per_host)
        self.ctx = NamesrvContext(table, clock, KvConfig(os.path.expanduser(config.kv_config_path)))
        self.connections = ConnectionGate(config.max_connections, config.max_connections_per_host, log, "name server")
        # unread replies of every connection, together (max_total_write_buffer); WriteBudget logs each close
        self.write_budget = WriteBudget(config.max_total_write_buffer, owner="name server")
        self.read_budget = ReadBudget(config.max_total_read_buffer, owner="name server")    # frames not yet whole
        self.address = ""
        self._server = None
        self._scan: asyncio.Task | None = None

    async def start(self) -> None:
        c = self.config
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, c.host, c.port, backlog=1024)
        self.address = f"{c.public_host}:{self._server.sockets[0].getsockname()[1]}"
        self._scan = loop.create_task(self._scan_loop())

    def _connection(self) -> RemotingConnection:
        table = namesrv_table()
        ctx = self.ctx

        def handle(conn, cmd):
            fn = table.get(cmd.code)
            if fn is None:
                return None if cmd.is_oneway else cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                                               f" request type {cmd.code} not supported")
            return fn(ctx, conn, cmd)

        def opened(conn) -> bool:
            return self.connections.admit(conn) is None

        def closed(conn) -> None:
            if self.connections.release(conn):     # refused on accept: it registered nothing
                ctx.table.connection_closed(conn)

        return RemotingConnection(handle, max_frame_size=self.config.max_frame_size, on_open=opened, on_close=closed,
                                  budget=self.write_budget, read_budget=self.read_budget)

    async def _scan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.scan_interval_ms / 1000)
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - ending the loop would keep every dead broker in the routes
                log.exception("broker expiry scan failed; scanning again in %d ms", self.config.scan_interval_ms)

    def scan(self) -> list[str]:
        """Expire silent brokers and close their connections (what RocketMQ's scanNotActiveBroker does), and
        close every connection that sent nothing for broker_expire_ms (ConnectionGate.close_quiet)."""
        c = self.config
        closed = self.connections.close_quiet(math.ceil(c.broker_expire_ms / c.scan_interval_ms))
        if closed:
            log.info("closed %d connections whose peer sent nothing for %d ms (broker_expire_ms)", closed,
                     c.broker_expire_ms)
        conns = {addr: live.conn for addr, live in self.ctx.table.live.items()}
        gone = self.ctx.table.expire(self.ctx.clock())
        for addr in gone:
            conn = conns.get(addr)
            if conn is not None:
                conn.close()
        return gone

    async def stop(self) -> None:
        if self._scan is not None:
            self._scan.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        if self.ctx.kv is not None:
            await self.ctx.kv.close()       # a save a full disk refused: tried a last time


async def serve(config: NamesrvConfig) -> int:
    daemon_default_executor()      # kvConfig.json's write that hangs must not keep the process from ending (saved.py)
    try:
        server = NameServer(config)         # (reads the KV config file)
        await server.start()
    except (OSError, StoreError) as exc:
        print(f"txmq-namesrv: cannot start: {exc}", file=sys.stderr, flush=True)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"LISTENING namesrv={server.address}", flush=True)
    await stop.wait()
    log.info("signal received: stopping")
    await server.stop()
    return 0


def run(config: NamesrvConfig) -> int:
    logline.configure(config.log_level)
    import uvloop
    return uvloop.run(serve(config))
