"""A raw remoting client for hostile tests: sends any bytes, and records every reply by opaque.

Not protocol.connection: that one fixes opaques and flags, and a hostile test needs to choose both (and to see
a second reply to one request, or a reply to a oneway one).
"""
from __future__ import annotations

import asyncio

from protocol.command import RemotingCommand
from protocol.frame import FrameDecoder


class RawClient:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.replies: dict[int, list[RemotingCommand]] = {}
        self.closed = asyncio.Event()
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, addr: str, local_host: str | None = None) -> "RawClient":
        """``local_host``: the address to connect from (any 127.x.y.z on loopback), to be another client host."""
        host, _, port = addr.rpartition(":")
        local = None if local_host is None else (local_host, 0)
        return cls(*await asyncio.open_connection(host, int(port), local_addr=local))

    @classmethod
    async def open_silent_until_closed(cls, addr: str, n: int, local_host: str, timeout: float = 10.0) -> None:
        """Open ``n`` connections from ``local_host`` that never send a byte (peers gone without a FIN); return
        once the server has closed each (asyncio.TimeoutError if one is still open after ``timeout`` s)."""
        silent = [await cls.open(addr, local_host) for _ in range(n)]
        try:
            for client in silent:
                await asyncio.wait_for(client.closed.wait(), timeout)
        finally:
            for client in silent:
                client.close()

    async def _read(self) -> None:
        decoder = FrameDecoder(64 << 20)
        try:
            while data := await self.reader.read(1 << 16):
                for frame in decoder.feed(data):
                    cmd = RemotingCommand.decode(frame, 64 << 20)
                    self.replies.setdefault(cmd.opaque, []).append(cmd)
                self._arrived.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed.set()
            self._arrived.set()

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def reply(self, opaque: int, timeout: float) -> list[RemotingCommand] | None:
        """The replies to ``opaque`` so far once there is one; [] if none came within ``timeout`` seconds,
        None if the connection closed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while opaque not in self.replies:
            if self.closed.is_set():
                return None
            left = deadline - loop.time()
            if left <= 0:
                return []
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                pass
        return self.replies[opaque]

    async def call(self, cmd: RemotingCommand, timeout: float = 5.0):
        return await self.call_raw(cmd.encode(), cmd.opaque, timeout)

    async def call_raw(self, frame: bytes, opaque: int, timeout: float = 5.0):
        self.write(frame)
        return await self.reply(opaque, timeout)

    def close(self) -> None:
        self.writer.transport.abort()
        self._task.cancel()
