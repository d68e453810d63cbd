"""A name server in the test process that forwards every request to a real one and counts what clients ask.

Clients (or a broker registering) are pointed at ``addr``; each request goes on to ``upstream`` (a
NamesrvProcess or a broker's embedded name server) and its answer comes back unchanged. ``route_requests``
counts GET_ROUTEINFO_BY_TOPIC requests per topic. A request whose code is in ``stall`` is read and never
answered (a name server stuck with its socket open); ``unanswered`` counts those.
"""
from __future__ import annotations

import asyncio
import collections

from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from protocol.connection import DEFERRED, ConnectionPool, RemotingConnection


class CountingNamesrv:
    def __init__(self, upstream: str):
        self.upstream = upstream
        self.addr = ""
        self.stall: set[int] = set()
        self.unanswered = 0
        self.route_requests: collections.Counter = collections.Counter()
        self._pool = ConnectionPool()
        self._server: asyncio.Server | None = None

    async def start(self) -> "CountingNamesrv":
        self._server = await asyncio.get_running_loop().create_server(
            lambda: RemotingConnection(self._handle), "127.0.0.1", 0)
        self.addr = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def _handle(self, conn, cmd):
        if cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
            self.route_requests[cmd.ext_fields.get("topic", "")] += 1
        if cmd.code in self.stall:
            self.unanswered += 1
            return DEFERRED
        return self._forward(cmd)

    async def _forward(self, cmd: RemotingCommand) -> RemotingCommand:
        ahead = RemotingCommand(cmd.code, language=cmd.language, version=cmd.version, flag=cmd.flag,
                                ext_fields=dict(cmd.ext_fields), body=cmd.body_bytes())
        resp = await self._pool.request(self.upstream, ahead, 5.0)
        return cmd.response(resp.code, resp.remark, resp.ext_fields, resp.body_bytes())

    async def close(self) -> None:
        self._server.close()
        await self._pool.close()
