"""The slave's side of HA (RocketMQ's HAClient): follow the master's commit log, byte for byte.

Connect, report where the own log ends, then take transfers: each body is checked and parsed
(store/replica.py), queued to the store's single writer for exactly the offset it came from, and
once it is on disk and indexed -- consume queues from the records' own queue offsets, dispatch as
after a put, so long polls wake on the slave too -- the new end is reported back; reports are
coalesced (one per writer batch) and repeated every heartbeat interval. Transfers are pipelined: the
next is queued before the previous is flushed, the writer's group commit flushes them together.

A transfer for any offset other than the log's end is a protocol error (RocketMQ: "master pushed
offset not equal the max phy offset in slave"): the connection is closed and made again, and the
master starts over from the reported end. So is silence longer than the housekeeping interval. A
new, empty slave takes its log start from the first transfer (the master's first segment).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from protocol.connection import wait_within

from .codec import HAProtocolError, TransferDecoder, encode_offset

log = logging.getLogger("txmq.ha")

RECONNECT_S = 1.0       # RocketMQ's HAClient retries every 5 s; a slave behind is worth a quicker retry


class HASlave:
    def __init__(self, store, config, connect: Callable[[], Awaitable[tuple]]):
        self.store = store
        self.master_addr = config.ha_master_addr
        self.heartbeat_s = config.ha_heartbeat_interval_ms / 1000
        self.housekeeping_s = config.ha_housekeeping_interval_ms / 1000
        self.connect = connect
        self.sync = False
        self.connected = False
        self.master_offset = 0          # the master's offset in the latest transfer header
        self.sessions = 0
        self._writer: asyncio.StreamWriter | None = None
        self._report_due = False
        self._failure: str | None = None
        self._last_put: asyncio.Future | None = None    # appends outlive a session: the next waits for them

    def slave_lag_bytes(self) -> int:
        """How far this slave's log is behind what the master last said it was sending."""
        return max(0, self.master_offset - self.store.max_physical_offset)

    async def run(self) -> None:
        """Follow the master for ever: a lost connection is made again after RECONNECT_S."""
        while True:
            try:
                reader, writer = await wait_within(self.connect(), self.housekeeping_s)
            except (OSError, asyncio.TimeoutError) as exc:
                log.debug("master %s not reachable: %s", self.master_addr, exc)
                await asyncio.sleep(RECONNECT_S)
                continue
            self.sessions += 1
            try:
                await self._session(reader, writer)
            except (OSError, asyncio.TimeoutError, HAProtocolError, ValueError) as exc:
                log.warning("replication from %s stopped: %s; reconnecting", self.master_addr, exc or type(exc).__name__)
            finally:
                self.connected = False
                self._writer = None
                writer.close()
            await asyncio.sleep(RECONNECT_S)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._last_put is not None and not self._last_put.done():
            await asyncio.wait({self._last_put}, timeout=self.housekeeping_s)
        self._writer, self._failure = writer, None
        self.connected = True
        expected = self.store.max_physical_offset
        self._report(expected)
        log.info("following master %s from offset %d", self.master_addr, expected)
        heartbeat = asyncio.ensure_future(self._heartbeats())
        decoder = TransferDecoder()
        try:
            while True:
                data = await wait_within(reader.read(256 * 1024), self.housekeeping_s)
                if not data:
                    raise ConnectionResetError(self._failure or "the master closed the connection")
                for phys, body in decoder.feed(data):
                    if self._failure is not None:
                        raise HAProtocolError(self._failure)
                    self.master_offset = max(self.master_offset, phys + len(body))
                    if not body:
                        continue
                    if phys != expected and expected == 0 and self.store.is_empty:
                        await self.store.rebase_empty(phys)
                        expected = phys
                    if phys != expected:
                        raise HAProtocolError(f"the master sent offset {phys}, this slave's log ends at {expected}")
                    put, expected = self.store.append_replica(phys, body)
                    put.add_done_callback(self._stored)
                    self._last_put = put
        finally:
            heartbeat.cancel()

    def _stored(self, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        result = fut.result()
        if not result.ok:
            self._failure = f"storing the master's bytes failed: {result.remark or result.status.name}"
            if self._writer is not None:
                self._writer.close()
            return
        self._schedule_report()

    def _schedule_report(self) -> None:
        if not self._report_due:
            self._report_due = True
            asyncio.get_running_loop().call_soon(self._report_now)

    def _report_now(self) -> None:
        self._report_due = False
        self._report(self.store.max_physical_offset)

    def _report(self, offset: int) -> None:
        w = self._writer
        if w is not None and not w.is_closing():
            w.write(encode_offset(offset))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._report(self.store.max_physical_offset)
