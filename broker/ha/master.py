"""The master's side of HA: one link per connected slave, and what a SYNC_MASTER's sends wait for.

Per slave (RocketMQ's HAConnection): a reader takes the slave's offset reports -- the first one says
where to start, each later one past it acknowledges (a txmq slave's first report is the start of its
newest record, still to be compared: it acknowledges nothing) -- and a sender streams the log from
there: chunks of whole records (store/replica.py), at most ``ha_transfer_batch_size`` bytes each, or
an empty frame after a heartbeat interval with nothing to send (and one at once when it accepts the first
report, nothing to send: the slave tells an accepted session from a refused one by a first transfer). The sender sleeps on an event the store's dispatch sets, so
a new record goes out at once and an idle master costs nothing.

A new slave (it reports 0) gets the whole log from the master's first segment, not, as RocketMQ
does, only from the start of the last segment: consumers that fail over to the slave can then read
everything the master still holds. The slave starts its own log at that segment (rebase_empty).

SYNC_MASTER (RocketMQ's CommitLog.submitReplicaRequest + GroupTransferService): after a message is
stored, ``confirm(end)`` answers SUCCESS at once if a slave already reported ``end``,
SLAVE_NOT_AVAILABLE at once if no slave is connected or it is ``ha_slave_fallbehind_max`` behind,
else a future of SUCCESS / FLUSH_SLAVE_TIMEOUT from the offset watermark (waiter.py).

Sockets are opened by broker/server.py; this module gets the streams.
"""
from __future__ import annotations

import asyncio
import logging

from protocol.codes import ResponseCode
from protocol.connection import wait_within
from protocol.errors import CorruptRecordError

from ..store.replica import chunk_end
from .codec import HAProtocolError, OffsetDecoder, encode_transfer
from .waiter import OffsetWatermark

log = logging.getLogger("txmq.ha")


BEHIND_SAID_MAX = 256   # (slave host, offset) pairs remembered as said at ERROR


class SlaveBehindError(HAProtocolError):
    """The slave's position (``offset``) is below this master's log start: retention removed what it still had
    to copy."""

    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


class SlaveLink:
    """One connected slave: where it asked to start and what it last acknowledged."""

    def __init__(self, peer: str):
        self.peer = peer
        self.request_offset = -1        # its first report: where it asks to start (not an acknowledgement)
        self.acked = -1                 # its latest report past the first
        self.reported = asyncio.Event()
        self.wake = asyncio.Event()     # set when the master's log grew


class HAMaster:
    def __init__(self, store, config):
        self.store = store
        self.sync = config.broker_role == "SYNC_MASTER"
        self.batch = config.ha_transfer_batch_size
        self.heartbeat_s = config.ha_heartbeat_interval_ms / 1000
        self.housekeeping_s = config.ha_housekeeping_interval_ms / 1000
        self.fallbehind_max = config.ha_slave_fallbehind_max
        self.links: set[SlaveLink] = set()
        self.watermark = OffsetWatermark(config.ha_slave_timeout_ms / 1000)
        self.connections_total = 0
        self.behind_total = 0           # sessions closed because the slave is below this master's log start
        self._behind_said: set[tuple[str, int]] = set()     # (slave host, offset) said at ERROR once

    # ------------------------------------------------------------ what others ask
    def on_dispatch(self, _info) -> None:
        """Store dispatch listener: records became readable; wake the senders."""
        for link in self.links:
            if not link.wake.is_set():
                link.wake.set()

    @property
    def acked(self) -> int:
        """The furthest offset a connected slave has confirmed (RocketMQ's push2SlaveMaxOffset, which also
        keeps the confirmations of slaves since gone)."""
        return self.watermark.acked

    def slave_lag_bytes(self) -> int:
        """The master's log end less the furthest slave acknowledgement (the whole log if none ever came)."""
        return max(0, self.store.max_physical_offset - self.acked)

    def confirm(self, end: int):
        """(SYNC_MASTER) the send response code for a message stored up to ``end``: an int now, or a
        future of one."""
        # How far behind: from where a slave stands, its first report included (that one counts as no
        # acknowledgement, but a slave comparing its newest record with ours is not absent).
        near = max((max(link.acked, link.request_offset) for link in self.links), default=-1)
        if not self.links or end - max(self.acked, near) >= self.fallbehind_max:
            return ResponseCode.SLAVE_NOT_AVAILABLE
        if end <= self.acked:
            return ResponseCode.SUCCESS
        fut = self.watermark.wait(end)
        out = fut.get_loop().create_future()
        fut.add_done_callback(lambda f: out.done() or out.set_result(
            ResponseCode.SUCCESS if f.result() else ResponseCode.FLUSH_SLAVE_TIMEOUT))
        return out

    async def confirm_async(self, end: int) -> int:
        verdict = self.confirm(end)
        return verdict if isinstance(verdict, int) else await verdict

    def close(self) -> None:
        self.watermark.fail_all()

    # ------------------------------------------------------------ one slave
    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The whole life of one slave connection (broker/server.py's HA listener calls this)."""
        peer = writer.get_extra_info("peername")
        link = SlaveLink(f"{peer[0]}:{peer[1]}" if peer else "?")
        self.links.add(link)
        self.connections_total += 1
        log.info("slave %s connected", link.peer)
        reading = asyncio.ensure_future(self._read(link, reader))
        sending = asyncio.ensure_future(self._send(link, writer))
        try:
            done, _ = await asyncio.wait({reading, sending}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if isinstance(exc, SlaveBehindError):
                    self._say_behind(link, exc)
                elif isinstance(exc, HAProtocolError):
                    log.error("slave %s dropped: %s", link.peer, exc)
                elif isinstance(exc, asyncio.TimeoutError):     # its str() is empty
                    log.warning("slave %s dropped: no offset report for %g s (--ha-housekeeping-interval-ms): "
                                "it is stalled, or the network between us is", link.peer, self.housekeeping_s)
                elif exc is not None and not isinstance(exc, (ConnectionError, asyncio.IncompleteReadError)):
                    log.warning("slave %s: %s", link.peer, exc)
        finally:
            self.links.discard(link)
            # Only a connected slave's confirmation counts: a new, empty slave must not inherit the old one's.
            self.watermark.reset(max(0, max((other.acked for other in self.links), default=0)))
            for task in (reading, sending):
                task.cancel()
            await asyncio.gather(reading, sending, return_exceptions=True)
            writer.close()
            log.info("slave %s disconnected (acknowledged up to %d)", link.peer, link.acked)

    async def _read(self, link: SlaveLink, reader: asyncio.StreamReader) -> None:
        decoder = OffsetDecoder()
        while True:
            data = await wait_within(reader.read(4096), self.housekeeping_s)
            if not data:
                return
            offsets = decoder.feed(data)
            if not offsets:
                continue
            if offsets[-1] > self.store.max_physical_offset:
                # Its log holds bytes this master never had (the master cut a torn tail at recovery, or its
                # store was replaced): counting it would acknowledge sends no slave holds.
                raise HAProtocolError(
                    f"slave {link.peer} reports offset {offsets[-1]}, past this master's log end "
                    f"{self.store.max_physical_offset}: its log has diverged from this master's and it is not "
                    "counted for acknowledgements; rebuild the slave's store")
            if link.request_offset < 0:
                self._check_start(link, offsets[0])
                link.request_offset = offsets[0]
            # The first report is where the slave asks to start: a txmq slave's is the start of its newest
            # record, not yet compared with this master's copy (ha/slave.py); below it may lie other records.
            # Only a report past it -- bytes taken from this master, or its end once compared -- counts.
            if offsets[-1] > link.request_offset:
                link.acked = offsets[-1]
                self.watermark.advance(link.acked)
            link.reported.set()

    def _check_start(self, link: SlaveLink, start: int) -> None:
        """A slave's first report says where its log ends; before it counts, this master's log must have
        a record boundary there (or end there). Anywhere else the two logs hold different bytes."""
        if start == 0:
            return                                  # a new slave
        if start < self.store.min_physical_offset:
            raise self._behind(link, start)
        try:
            chunk = self.store.replica_chunk(start, 1)
        except ValueError as exc:
            raise HAProtocolError(
                f"slave {link.peer} reports its log ends at {start}, where this master's log has no record "
                f"boundary ({exc}): its log has diverged from this master's and it is not counted for "
                "acknowledgements; rebuild the slave's store") from None
        if chunk is not None:
            chunk.release()

    def _behind(self, link: SlaveLink, offset: int) -> SlaveBehindError:
        return SlaveBehindError(
            f"slave {link.peer} is at offset {offset}, but this master's log now starts at "
            f"{self.store.min_physical_offset}: retention removed what the slave had still to copy, and it cannot "
            "catch up. Rebuild the slave's store (stop it, empty its store directory, start it): it copies this "
            "master's log from its start", offset)

    def _say_behind(self, link: SlaveLink, exc: SlaveBehindError) -> None:
        """Counted each time; said at ERROR once a slave host and offset (it reconnects every second, for ever)."""
        self.behind_total += 1
        # (the error's offset: one refused at its first report has no request_offset yet, -1 for every slave)
        key = (link.peer.rpartition(":")[0], exc.offset)
        if key in self._behind_said:
            log.debug("slave %s dropped again: %s", link.peer, exc)
            return
        if len(self._behind_said) >= BEHIND_SAID_MAX:
            # Anyone reaching the HA port may report offsets below the log start, a new one each connection:
            # remembered all, the set grew by one per connection for ever. Forgotten, a slave is said again.
            self._behind_said.clear()
        self._behind_said.add(key)
        log.error("slave %s dropped: %s (said once; counted in txmq_ha_slave_sessions_behind_log_start_total)",
                  link.peer, exc)

    def _start_offset(self, link: SlaveLink) -> int:
        start = link.request_offset
        return self.store.min_physical_offset if start == 0 else start   # 0: everything this master holds

    async def _send(self, link: SlaveLink, writer: asyncio.StreamWriter) -> None:
        await link.reported.wait()
        nxt = self._start_offset(link)
        log.info("slave %s: sending the log from offset %d", link.peer, nxt)
        loop = asyncio.get_running_loop()
        # A heartbeat at once if there is nothing to send: the slave counts a session closed before any transfer as
        # this master refusing its first report (ha/slave.py). An empty slave caught up with an idle master had its
        # first transfer 5 s on, so a master restarting twice quickly made it say it cannot catch up (paging).
        last_write = loop.time() - self.heartbeat_s
        stopped = False         # at a record that fails its CRC: heartbeats only, from then on
        while True:
            link.wake.clear()
            chunk = None
            if not stopped:
                if nxt < self.store.min_physical_offset:    # retention removed it while the slave was copying it
                    raise self._behind(link, nxt)
                try:
                    chunk = self.store.replica_chunk(nxt, self.batch)
                except CorruptRecordError:
                    # Counted and logged (ERROR, segment and byte) by the store. Closing the link made the slave
                    # reconnect every second, a WARNING on each side each time, for ever; it stays open, idle.
                    log.error("slave %s: replication stops at offset %d, a corrupt record on this master's disk; "
                              "the slave stays behind from there (txmq_ha_slave_lag_bytes)", link.peer, nxt)
                    stopped = True
            if chunk is not None:
                body = bytes(chunk)     # a copy: the mapping may be unmapped while bytes wait in the buffer
                chunk.release()
                writer.write(encode_transfer(nxt, body) + body)
                nxt = chunk_end(nxt, body)      # after an end marker: the next segment, not 8 bytes on
                await writer.drain()
                last_write = loop.time()
                continue
            idle = self.heartbeat_s - (loop.time() - last_write)
            if idle <= 0:
                writer.write(encode_transfer(nxt))
                await writer.drain()
                last_write = loop.time()
                continue
            try:
                await wait_within(link.wake.wait(), idle)
            except asyncio.TimeoutError:
                pass
