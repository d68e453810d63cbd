"""The slave's side of HA (RocketMQ's HAClient): follow the master's commit log, byte for byte.

Connect, report where the own log ends, then take transfers: each body is checked and parsed
(store/replica.py), queued to the store's single writer for exactly the offset it came from, and
once it is on disk and indexed -- consume queues from the records' own queue offsets, dispatch as
after a put, so long polls wake on the slave too -- the new end is reported back; reports are
coalesced (one per writer batch) and repeated every heartbeat interval. Transfers are pipelined: the
next is queued before the previous is flushed, the writer's group commit flushes them together; past
PENDING_MAX bytes queued and not yet stored the slave stops reading, and TCP holds the master back.

A transfer for any offset other than the log's end is a protocol error (RocketMQ: "master pushed
offset not equal the max phy offset in slave"): the connection is closed and made again, and the
master starts over from the reported end. So is silence longer than the housekeeping interval. A
new, empty slave takes its log start from the first transfer (the master's first segment).

Before it appends anything, a slave with a log checks that the master's log is the one it copied: its
first report is the start of its own newest record, not its end, so the master sends that record again,
and the slave compares it byte for byte with its own (RocketMQ 4.x checks only that the offsets agree).
Other bytes there, or a master whose log ends before the slave's, mean the two logs have diverged -- a
master that lost an unflushed tail and took new sends, a wiped or another broker's store behind the
same address. Offsets and record sizes alike are no proof: equal-sized records put record boundaries in
the same places. The slave then appends nothing, logs an ERROR every DIVERGED_RETRY_S and tries again
(the master may come back with its own store). Its first report, the comparison start, and the heartbeats
repeating it are no acknowledgement: a master counts only reports past a slave's first (ha/master.py), so a
SYNC_MASTER counts none from a diverged slave. Rebuild its store to copy the master afresh.

A master no longer holds the slave's newest record when its retention removed that record's segment while
the slave was away and the slave's log ends at the next segment's start (it had the end marker, not the
record after it): the master then closes the link on the first report ("cannot catch up"). After
REFUSED_MAX such sessions in a row, closed before a single transfer, the slave compares from the first
segment start after that record instead; if that is its end there is nothing left to compare, and it
follows on offsets alone (as RocketMQ 4.x always does) with a WARNING saying so. With no segment start
after that record in its log (a new slave still copying the master's oldest segment when the master's
retention removed it), or when the master refuses that later start REFUSED_MAX times too (its retention removed
the segments past this slave's end while it was away; the slave goes on asking from there, so a refusal by chance
is no verdict for good), it cannot catch up by itself: an ERROR says so once, txmq_ha_slave_cannot_catch_up
is 1 while it lasts, and the master says it too (ERROR once, txmq_ha_slave_sessions_behind_log_start_total).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Awaitable, Callable

from protocol.connection import wait_within

from ..store.replica import chunk_end
from .codec import HAProtocolError, TransferDecoder, encode_offset

log = logging.getLogger("txmq.ha")

RECONNECT_S = 1.0       # RocketMQ's HAClient retries every 5 s; a slave behind is worth a quicker retry
PENDING_MAX = 32 * 1024 * 1024  # bytes handed to the writer, not yet stored: past it the socket is not read
DIVERGED_RETRY_S = 30.0  # a diverged log stays diverged until someone acts: retry, but do not flood the log
REFUSED_MAX = 2         # sessions closed at once on the first report before comparing from a later segment start


class HADivergedError(HAProtocolError):
    """The master's log is not the one this slave copied: the slave must not append to its own."""


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
        self.master_log_end = 0         # the master's log end as SlaveSync last learnt it (GET_BROKER_RUNTIME_INFO)
        self.sessions = 0
        self._writer: asyncio.StreamWriter | None = None
        self._report_due = False
        self._failure: str | None = None
        self._last_put: asyncio.Future | None = None    # appends outlive a session: the next waits for them
        self._unverified: int | None = None     # while the master's copy of our tail is compared: what to report
        self.diverged: str | None = None        # why the last session found the master's log not ours
        self._pending = 0                       # bytes queued to the store's writer and not yet stored
        self._room = asyncio.Event()            # set when _pending drops to PENDING_MAX
        self.paused = False                     # not reading: the writer is that far behind
        self._asked: int | None = None          # what this session's refusal counts against (see _session)
        self._received = False                  # a transfer came in this session
        self._refused = (None, 0)               # (that offset, sessions in a row the master closed at once)
        self.cannot_catch_up: str | None = None     # why the master refuses every session (said once, a gauge)
        self.disk_full = False                  # holding the master back: this slave's disk refuses writes (said once)
        self.store_stopped = False              # holding the master back: this slave's store stopped (said once)

    def slave_lag_bytes(self) -> int:
        """How far this slave's log is behind its master's: the master's log end as last learnt (SlaveSync, every
        sync interval), or the end of the latest transfer if further. The transfers alone say only what is in
        flight: a slave 1 GB behind, copying chunk after chunk, showed at most the bytes queued to its writer."""
        return max(0, max(self.master_offset, self.master_log_end) - self.store.max_physical_offset)

    def master_log_end_learnt(self, end: int) -> None:
        """(SlaveSync) the master's log end, as its GET_BROKER_RUNTIME_INFO answered."""
        self.master_log_end = end

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
            pause = RECONNECT_S
            self._asked, self._received = None, False
            try:
                await self._session(reader, writer)
            except HADivergedError as exc:
                self.diverged = str(exc)
                pause = DIVERGED_RETRY_S
                log.error("NOT replicating from %s: this slave's log has diverged from its master's: %s. Nothing "
                          "of the master's is appended; rebuild this slave's store (start it with an empty store "
                          "directory) to copy the master afresh. Trying again in %.0f s",
                          self.master_addr, exc, pause)
            except asyncio.TimeoutError:       # its str() is empty
                log.warning("replication from %s stopped: nothing from the master for %g s "
                            "(--ha-housekeeping-interval-ms): it is stalled, or the network between us is; "
                            "reconnecting", self.master_addr, self.housekeeping_s)
            except (OSError, HAProtocolError, ValueError) as exc:
                # Said at ERROR once (_say_stuck) while the master refuses every session: not again every second
                log.log(logging.DEBUG if self.cannot_catch_up is not None else logging.WARNING,
                        "replication from %s stopped: %s; reconnecting", self.master_addr, exc or type(exc).__name__)
                if isinstance(exc, ConnectionResetError) and self._asked is not None and not self._received:
                    start, n = self._refused       # the master closed the link on our first report
                    self._refused = (self._asked, n + 1 if start == self._asked else 1)
            finally:
                if self._received:
                    self._refused = (None, 0)
                    self.cannot_catch_up = None
                self.connected = False
                self._writer = None
                self._unverified = None
                writer.close()
            await asyncio.sleep(pause)

    def _disk_full(self) -> bool:
        """Whether this slave's disk refuses writes (said once when it starts and once when it ends). Each session
        then failed at the master's first bytes: the slave reconnected every second for as long as the disk stayed
        full, a WARNING and two INFO lines on the slave and three on the master a second (10,800 lines an hour
        each, onto a disk that may be that full one), and the master read and sent its log tail again each time.
        The session now waits, not reading (TCP holds the master back), before appending a transfer. Not
        connecting at all instead stopped following: SlaveSync copied no offsets, topics or groups, and learnt no
        new log start of the master's, the one thing that lets this slave's cleaner remove an expired segment."""
        disk = self.store.disk
        full = disk.refusing and disk.still_refusing()
        if full != self.disk_full:
            self.disk_full = full
            if full:
                log.warning("replication from %s paused: this slave's disk is %s, at or above "
                            "disk_refuse_ratio; it stays connected, holds the master's bytes back and resumes by "
                            "itself below %.0f%%", self.master_addr, disk.fullness(), disk.resume_ratio * 100)
            else:
                log.warning("replication from %s resumes: this slave's disk has room again", self.master_addr)
        return full

    def _store_stopped(self) -> bool:
        """Whether this slave's store stopped accepting writes (an I/O error; its file system turned read-only):
        until a restart. Each transfer was refused, the session failed and the slave reconnected every second for
        ever, a WARNING each time and the master sending its log tail again; now it holds the master back as
        while its disk is full, said at ERROR once."""
        failure = getattr(self.store, "failure", None)
        if failure is not None and not self.store_stopped:
            self.store_stopped = True
            log.error("NOT replicating from %s: this slave's store stopped accepting writes (%s): see its ERROR "
                      "'store stops accepting writes', fix the disk and restart this broker; meanwhile it stays "
                      "connected and holds the master's bytes back", self.master_addr, failure)
        return failure is not None

    @property
    def following(self) -> bool:
        """Connected to the master, its log found to be the one this slave copied (SlaveSync copies only then)."""
        return self.connected and self._unverified is None and self.diverged is None

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._last_put is not None and not self._last_put.done():
            await asyncio.wait({self._last_put}, timeout=self.housekeeping_s)
        self._writer, self._failure = writer, None
        self.connected = True
        end = self.store.max_physical_offset
        last = self.store.last_indexed_record() if end > self.store.min_physical_offset else None
        expected = end if last is None else last        # from ``last`` to ``end``: compared, not appended
        # Refusals count against the newest record (the log end if none) whatever was asked: counted against the
        # later start instead, a refusal there too went unnoticed -- and against the log end not at all -- and the
        # slave went round for ever, a WARNING a second, never saying it cannot catch up.
        self._asked = end if last is None else last
        refused = self._refused[1] if self._refused[0] == self._asked else 0
        if refused >= REFUSED_MAX:
            seg = self.store.segment_size
            later = None if last is None else last - last % seg + seg  # the first segment start after the newest record
            if later is None or later > end:
                self._say_stuck(f"{last}, the start of its newest record" if last is not None
                                else f"{end}, its log end", end)
            else:
                # Asked from there every session from now on, said stuck or not: one session there closed by chance
                # (the master restarting) made it say so and ask from the removed record for ever, copying nothing.
                expected = later
                if refused >= 2 * REFUSED_MAX:      # the master refused the later start as often: it goes on
                    self._say_stuck(f"{last}, the start of its newest record, then {later}, the next segment start",
                                    end)
                elif refused == REFUSED_MAX:        # said once, not at each session from there
                    log.warning("master %s closed the link %d times on this slave's first report (%d, the start of "
                                "its newest record): its log no longer holds that record -- retention removed the "
                                "segment while this slave was away -- or it has no record there. %s",
                                self.master_addr, refused, last,
                                f"Comparing its copy from the next segment start {later} instead" if later < end else
                                f"This slave's log ends at the next segment's start {end}: nothing is left to compare, "
                                "following on offsets alone (unverified; if the master lost its store or an unflushed "
                                "tail while this slave was away, rebuild this slave's store)")
        self._unverified = None if expected == end else expected
        self._report(expected)
        log.info("following master %s from offset %d%s", self.master_addr, end,
                 "" if expected == end else f" (its copy of this slave's log from {expected} compared first)")
        heartbeat = asyncio.ensure_future(self._heartbeats())
        decoder = TransferDecoder()
        try:
            while True:
                if self._pending > PENDING_MAX:     # the disk is behind: let TCP hold the master back
                    self._room.clear()
                    self.paused = True
                    try:
                        await self._room.wait()
                    finally:
                        self.paused = False
                data = await wait_within(reader.read(256 * 1024), self.housekeeping_s)
                if not data:
                    raise ConnectionResetError(self._failure or "the master closed the connection")
                for phys, body in decoder.feed(data):
                    self._received = True
                    if self._failure is not None:
                        raise HAProtocolError(self._failure)
                    self.master_offset = max(self.master_offset, phys + len(body))
                    if expected < end:      # a copy of what this slave holds: compare, append what follows
                        expected, body = self._compare(phys, body, expected, end)
                        if expected < end or not body:
                            continue
                        phys = end
                    if not body:
                        continue
                    if phys != expected and expected == 0 and self.store.is_empty:
                        await self.store.rebase_empty(phys)
                        expected = phys
                    if phys != expected:
                        raise HAProtocolError(f"the master sent offset {phys}, this slave's log ends at {expected}")
                    while self._disk_full() or self._store_stopped():    # hold the master back (TCP), following
                        if writer.is_closing():
                            raise ConnectionResetError("the link was lost while this slave's store "
                                                       + ("stopped accepting writes" if self.store_stopped
                                                          else "disk was full"))
                        await asyncio.sleep(RECONNECT_S)
                    put, expected = self.store.append_replica(phys, body)
                    self._pending += len(body)
                    put.add_done_callback(functools.partial(self._stored, len(body)))
                    self._last_put = put
        finally:
            heartbeat.cancel()

    def _say_stuck(self, asked: str, end: int) -> None:
        """The master closed every session on this slave's first report, and its log holds no later segment start
        to compare from (or the master refused that too): most likely the master's retention removed the segment
        this slave was still copying, or the segments after its end while it was away.
        It reconnected every second for ever with a WARNING naming no cause; now an ERROR once, and a gauge."""
        if self.cannot_catch_up is not None:
            return
        self.cannot_catch_up = (f"master {self.master_addr} closed the link {self._refused[1]} times on this slave's "
                                f"first report ({asked}; its log ends at {end})")
        log.error("NOT replicating: %s. Its retention has most likely removed the segment this slave was still "
                  "copying (the master's log says 'cannot catch up'), or its log is not the one this slave copied. "
                  "This slave cannot catch up by itself: rebuild its store (stop it, empty its store directory, "
                  "start it) to copy the master's log from its start. Still trying (txmq_ha_slave_cannot_catch_up "
                  "is 1 meanwhile)", self.cannot_catch_up)

    def _compare(self, phys: int, body: bytes, expected: int, end: int) -> tuple[int, bytes]:
        """A transfer for ``expected``, below this slave's log ``end``: the master's copy of bytes this slave
        holds. (offset compared up to, the part of ``body`` from ``end`` on); HADivergedError if they differ."""
        if phys != expected:
            raise HAProtocolError(f"the master sent offset {phys}, this slave asked for {expected}")
        if not body:        # a heartbeat: the master has sent all it has, and this slave's log goes on
            raise HADivergedError(f"the master's log ends at offset {phys}, this slave's at {end}: the slave holds "
                                  "records its master does not")
        n = min(len(body), end - phys)
        own = self.store.log_bytes(phys, n)
        if own is None and phys < self.store.min_physical_offset:     # this slave's own retention removed it
            raise HAProtocolError(f"this slave's log no longer holds offset {phys} (its retention removed the segment "
                                  "while it was being compared); comparing again")
        if own is None or own != body[:n]:
            raise HADivergedError(f"at offset {phys} the master's log holds other bytes than this slave's (whose "
                                  f"log ends at {end}): a master that lost its tail and took new messages, or "
                                  "another store than the one this slave copied")
        # after a whole end marker, the next segment's start
        upto = chunk_end(phys, body) if n == len(body) else phys + n
        if upto >= end:
            self._unverified = self.diverged = None
            log.info("master %s holds this slave's log up to its end %d: following", self.master_addr, end)
            self._schedule_report()
        return min(upto, end), body[n:]

    def _position(self) -> int:
        """What to report: the log end, or while the master's copy is being compared, where the comparison
        began (a SYNC_MASTER must not count bytes this slave may not share with it)."""
        return self.store.max_physical_offset if self._unverified is None else self._unverified

    def _stored(self, size: int, fut: asyncio.Future) -> None:
        self._pending -= size
        if self._pending <= PENDING_MAX:
            self._room.set()
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
        self._report(self._position())

    def _report(self, offset: int) -> None:
        w = self._writer
        if w is not None and not w.is_closing():
            w.write(encode_offset(offset))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._report(self._position())
