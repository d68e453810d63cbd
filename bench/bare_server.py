"""The floor of txmq's design: a uvloop server that does only what a durable send must.

    python bench/bare_server.py DIR        (prints its port, serves until killed)

Each request is a frame (4-byte big-endian length, then that many bytes). The server copies every frame
it reads into a preallocated file with ``os.pwritev`` (one call per read), hands the msync of the written
range to one I/O thread (``queue.SimpleQueue`` there, ``call_soon_threadsafe`` back: txmq's hand-off),
and when the msync returns answers every frame it covered with a 20-byte frame, one write per connection.
Frames read while an msync is in flight wait for the next one (group commit). No headers, no index, no
consume queue, no metrics: what it costs is what any broker built this way costs before its own work,
so ``bench_peers.py`` runs it beside txmq and Redis in the same run to show how far each target is from
what this design can reach on this machine at all.

The file is a ring of 256 MiB, zero-filled and fsync'ed before the port is printed, so no write
allocates blocks (txmq's segments are made and zero-filled ahead of need, too).
"""
from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import queue
import sys
import threading

SIZE = 256 << 20
PAGE = mmap.PAGESIZE
REPLY = (16).to_bytes(4, "big") + bytes(16)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MS_SYNC = 4


class Store:
    def __init__(self, directory: str):
        path = os.path.join(directory, "bare.log")
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        zeros = bytes(1 << 20)
        for off in range(0, SIZE, len(zeros)):
            os.pwrite(self.fd, zeros, off)
        os.fsync(self.fd)
        self.mm = mmap.mmap(self.fd, SIZE)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.pos = 0
        self.dirty: list[tuple[int, int]] = []
        self.waiting: list = []         # (connection, frames) written since the last flush started
        self.flushing = False
        self.loop = asyncio.get_running_loop()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._io, daemon=True).start()

    def write(self, conn, frames: list) -> None:
        n = sum(len(f) for f in frames)
        if self.pos + n > SIZE:
            self.pos = 0
        os.pwritev(self.fd, frames, self.pos)
        self.dirty.append((self.pos, self.pos + n))
        self.pos += n
        self.waiting.append((conn, len(frames)))
        if not self.flushing:
            self._start()

    def _start(self) -> None:
        ranges, self.dirty = self.dirty, []
        done, self.waiting = self.waiting, []
        self.flushing = True
        self.jobs.put((ranges, done))

    def _io(self) -> None:
        while True:
            ranges, done = self.jobs.get()
            for lo, hi in ranges:
                start = lo - lo % PAGE
                if _libc.msync(self.addr + start, hi - start, _MS_SYNC) != 0:
                    # nothing more would be answered: say why and end, rather than leave the bench waiting
                    print(f"bare_server: msync failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr, flush=True)
                    os._exit(1)
            self.loop.call_soon_threadsafe(self._flushed, done)

    def _flushed(self, done: list) -> None:
        self.flushing = False
        replies: dict = {}
        for conn, count in done:
            replies[conn] = replies.get(conn, 0) + count
        for conn, count in replies.items():
            conn.answer(count)
        if self.waiting:
            self._start()


class Conn(asyncio.Protocol):
    def __init__(self, store: Store):
        self.store = store
        self.buf = bytearray()
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        frames, pos, end = [], 0, len(buf)
        while end - pos >= 4:
            n = int.from_bytes(buf[pos:pos + 4], "big")
            if end - pos - 4 < n:
                break
            frames.append(bytes(buf[pos + 4:pos + 4 + n]))
            pos += 4 + n
        del buf[:pos]
        if frames:
            self.store.write(self, frames)

    def answer(self, count: int) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(REPLY * count)

    def connection_lost(self, exc):
        self.transport = None


async def serve(directory: str) -> None:
    store = Store(directory)
    server = await asyncio.get_running_loop().create_server(lambda: Conn(store), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    import uvloop
    uvloop.run(serve(sys.argv[1]))
