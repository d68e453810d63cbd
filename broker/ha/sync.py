"""(Slave) what the commit log does not carry, copied from the master (RocketMQ's SlaveSynchronize).

The log gives a slave every message, but not where each consumer group is: committed offsets live in the
master's consumerOffset.json. Without them, a consumer that fails over to the slave (its master gone from
the routes) asks for its offset and gets none: it starts over from the first message (every one again) or,
once retention has trimmed the queue, from the last (the rest never delivered). So every
``slave_sync_interval_ms`` the slave asks its master GET_ALL_CONSUMER_OFFSET and takes every offset it
lists, as RocketMQ's slave does (putAll: the master's value wins; offsets only the slave has stay), and removes
those of a group the master listed at an earlier copy and its answers have missed for ``slave_group_forget_ms``
(deleted with its offsets there; not a master back from a kill -9 without its last seconds of commits).

The master's broker address comes from the name server's answer to the slave's registration
(``masterAddr``), as in RocketMQ; a slave that registers with no name server has nobody to ask, and says so.

It also asks where the master's log starts and ends (GET_BROKER_RUNTIME_INFO: commitLogMinOffset and
commitLogMaxOffset). The slave's own cleaner removes no segment its master still holds (retention.py): the
master dead-letters the undecided halves in a segment before removing it, the slave never does, and a slave
promoted with the segment gone lost them. ``removable_end`` is how far it may remove: the master's log start,
once this slave's log reaches the master's end as it was then (and so holds the dead-letter records too).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time

from protocol.admin_bodies import (add_offset_entries, offset_table_members, quote_int_keys,
                                   string_literal_pieces)
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import ConnectionPool
from protocol.txlog import PROGRESS_GROUP

from ..schedule.progress import MASTER_COPY_NAME, decode_delay_offsets, drop_master_copy, write_master_copy
from ..slices import in_slices, in_steps
from ..store.mapped_file import fsync_dirs, make_dirs
from ..store.saved import check, read_saved, retrieved, save
from ..subscriptions import read_group_table
from ..topics import read_topic_table

log = logging.getLogger("txmq.ha")


OFFSET_SLICE = 1024     # offsets committed in one turn of the loop (4,096 held it 10-20 ms on a loaded machine)
KEY_SLICE = 64          # topic@group entries decoded in one turn (each up to a topic's queue count of offsets)
# Beside consumerOffset.json: the groups its master's answers named (a sorted JSON list), for a restarted slave.
NAMED_GROUPS_FILE = "slaveMasterGroups.json"
COPY_WRITE_WAIT_S = 2.0     # a write of the Java master's delay progress copy waited, then left (_copy_bounded)
QUOTE_SLICE = 512       # pieces of the body (a key, then its queues' ids and offsets) quoted in one turn: even


class SlaveSync:
    def __init__(self, offsets, interval_s: float, *, timeout_s: float = 3.0, forget_after_s: float = 30.0):
        self.offsets = offsets
        self.interval_s = interval_s
        self.forget_after_s = forget_after_s    # a group missing from the master's answers this long goes here too
        self.clock = time.monotonic
        self.copied_at = self.clock()           # the last whole copy's time (the start's while none): copy_age_s
        self.timeout_s = timeout_s
        self.master_addr: str | None = None     # the master's broker address, from the name server
        self.ha_master_addr = ""        # set by the server: the HA address this slave follows (--ha-master-addr)
        # name server -> the HA address its master registered, when not ha_master_addr; and the check under way of
        # each name server's answer (resolved off the loop): both bounded by --namesrv-addr
        self._ha_mismatches: dict[str, str] = {}
        self._ha_checks: dict[str, asyncio.Task] = {}
        self.synced = 0                         # copies taken (metrics, tests)
        # unsigned, as RocketMQ's slave asks: a master with an ACL must whitelist the slave's address
        self.pool = ConnectionPool(connect_timeout=min(3.0, timeout_s))
        self._failing: str | None = None
        self.subscriptions = None       # set by the server: the master's subscription groups are copied too
        self._groups_unsaved = False    # copied, but their file could not be written (a full disk): written again
        self.topics = None              # set by the server: the master's topic configs are copied too
        self.delete_topic = None        # async fn(topic, written_from) -> deleted: as the master did (config, queues,
                                        # offsets), unless its queues hold a record at or past written_from
        self.log_end = lambda: None     # set by the server: the slave's readable log end
        self.master_end_learnt = lambda end: None   # set by the server: told the master's log end at each sync (lag)
        # (the master's dataVersion last taken, this slave's own counter right after): a table of that version is not
        # gone over again while nothing here changed the slave's since (RocketMQ compares the slave's own version)
        self._topics_version = None, None
        self._groups_version = None, None   # the same for its subscription groups
        self.following = lambda: True   # set by the server: the HA link follows the master's log (HASlave.following)
        self._master_log: tuple[int, int] | None = None     # (start, end) of the master's log, not yet reached
        self._removable = None          # the master's log start once this slave's log reached its end then
        self._bounds_failing: str | None = None
        self._master_groups: set[str] | None = None     # the groups the master's copied offsets named (and _absent)
        path = getattr(offsets, "path", None)
        self._named_path = path and os.path.join(os.path.dirname(path), NAMED_GROUPS_FILE)
        self._named_saved: set[str] | None = None      # _master_groups as last written there
        self._named_failing: str | None = None
        if self._named_path is not None:
            self._master_groups = self._named_saved = self._read_named()
        self._absent: dict[str, float] = {}     # of those, the ones the last answer missed: seconds of answers since
        self._answered_at: float | None = None  # the last answer's time (self.clock); None after a sync that got none
        self._master_boot = None                # the master's bootTimestamp as last answered (a restart: _absent afresh)
        self._unsaved_removals: set[str] = set()    # groups removed here whose removal is not on disk yet: still named
        self.forget_groups = lambda groups: None    # set by the server: their delivery series go too (metrics)
        # A master whose runtime info has no txmq keys (a Java one) keeps its delay progress in delayOffset.json, not
        # in its log: copied (GET_ALL_DELAY_OFFSET) to MASTER_COPY_NAME, as a Java slave copies it.
        self._master_is_java: bool | None = None    # unknown until its runtime info is read
        self._copy_dropped = False      # a copy left from a Java master removed (or none) under a txmq one
        self._config_dir = path and os.path.dirname(path)
        self._delay_copied: dict[int, int] | None = None    # as last written there
        self._delay_failing: str | None = None
        self._copy_io: asyncio.Future | None = None     # the last write or removal of the copy (one at a time)
        self.write_hung = False     # that one has run past COPY_WRITE_WAIT_S (txmq_config_write_hung), until it ends

    def copy_age_s(self) -> float:
        """Seconds since the master's offsets, groups and topics were last copied whole (since this slave's start
        while never). A failed copy was said once at WARNING and nowhere else: a slave following its master's log,
        its copies refused for days (an ACL on the master without the slave's address, a master address the name
        server gave that the slave cannot reach, a full disk), looked as sound as any in its metrics, and consumers
        that failed over to it went on from offsets days old -- those days' messages again."""
        return max(0.0, self.clock() - self.copied_at)

    @property
    def path(self) -> str:
        """The Java master's delay progress copy (txmq_config_write_hung's ``file``)."""
        return os.path.join(self._config_dir or "", MASTER_COPY_NAME)

    def on_registered(self, namesrv: str, resp: RemotingCommand) -> None:
        """The registrar's on_result: the name server names this broker's master (empty while none), and the HA
        address that master registered."""
        fields = resp.ext_fields or {}
        addr = fields.get("masterAddr") or None
        if addr != self.master_addr:
            log.info("master broker address for offset copies: %s", addr or "none (not registered yet)")
            self.master_addr = addr
        self._check_ha_master(namesrv, addr, fields.get("haServerAddr") or None)

    def _check_ha_master(self, namesrv: str, addr: str | None, registered: str | None) -> None:
        """The master this slave's name server names must be the one its log follows (--ha-master-addr). Another --
        a typo'd port, another cluster's master, a slave under the wrong --broker-name -- and the slave copied one
        broker's log and another's consumer offsets, topics and groups: consumers failing over to it went on from
        offsets of another log. Said at ERROR once an address, txmq_ha_slave_master_mismatch 1 meanwhile; the copies
        go on (a proxy or port mapping between the two is no mismatch this can tell). One master under two
        names -- a host name here, its IP registered -- is one: the two are resolved (off the loop) before said."""
        if not self.ha_master_addr:
            return
        if registered is None:      # no master named (yet, or gone): no master to be another (the gauge's help)
            self._ha_mismatches.pop(namesrv, None)
            return
        under_way = self._ha_checks.get(namesrv)
        if under_way is not None and not under_way.done():
            return      # the check under way decides; the next registration (a period on) checks again
        self._ha_checks[namesrv] = asyncio.get_running_loop().create_task(self._check_ha(namesrv, addr, registered))

    @property
    def ha_mismatch(self) -> str | None:
        """An HA address a name server's master registered that is not the one this slave follows (the gauge)."""
        return next(iter(self._ha_mismatches.values()), None)

    async def ha_checked(self) -> None:
        """(tests) The latest registrations' HA address checks done."""
        await asyncio.gather(*(asyncio.shield(t) for t in self._ha_checks.values()))

    async def _check_ha(self, namesrv: str, addr: str | None, registered: str) -> None:
        """Each name server apart: one of another cluster listed among them is said once, not at every
        registration's turn between it and the others."""
        same = registered == self.ha_master_addr or await _same_endpoint(registered, self.ha_master_addr,
                                                                          self.timeout_s)
        if same is None:    # not resolved (a DNS outage): as it was, checked again at the next registration
            return
        if same:
            if self._ha_mismatches.pop(namesrv, None) is not None:
                log.warning("name server %s now names master %s with HA address %s, the one this slave follows",
                            namesrv, addr, registered)
            return
        if registered != self._ha_mismatches.get(namesrv):
            self._ha_mismatches[namesrv] = registered
            log.error("this slave follows the log of %s (--ha-master-addr), but name server %s names its master %s, "
                      "whose HA address is %s: it copies consumer offsets, topics and groups from that master, and "
                      "consumers failing over to it go on from offsets of another log. Point --ha-master-addr at %s "
                      "(or, if that is the same broker under another address, at the address it registers; or give "
                      "this slave its master's --broker-name). txmq_ha_slave_master_mismatch is 1 meanwhile",
                      self.ha_master_addr, namesrv, addr, registered, registered)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)    # first after one interval: registration names the master
            await self.sync_once()

    async def sync_once(self) -> bool:
        addr = self.master_addr
        if addr is None:
            self._failed("no master broker address yet (it comes from the name server's answer to this "
                         "slave's registration; a slave with no --namesrv-addr never learns it)")
            return False
        answer = await self._master_offsets(addr)
        if answer is None:
            # The master away (or its log not followed): the time until its next answer does not count as its
            # answers' (_forget_groups). Counted, a master killed -9 that missed a new group at its first answer,
            # then stayed away longer than forget_after_s, had the group removed here at its first answer back,
            # before the group's consumers could reach it and commit again.
            self._answered_at = None
            return False
        table, deleted = answer
        # A Java master keeps any offset a client commits (-1 too); this broker's own commits take none below 0,
        # and a negative one in consumerOffset.json makes the file damaged at the next start (store/saved.py).
        # The master's own transaction progress (its half floor) is not a consumer's: copied, a slave started
        # without a usable transaction snapshot (and so one promoted) scanned its halves from the master's
        # floor, past halves whose decisions had not reached it yet, never checking them.
        # Taken off the table as they are committed, not listed first: a list of 100,000 items made in one step
        # (and freed in one as this returns).
        # A negative one is an offset the master was told to forget (UPDATE_CONSUMER_OFFSET -1, kept by a Java master
        # and read back as none, as a Java slave reads its copy; a txmq master lists the queues it forgot so): this
        # slave's copy goes too. Kept, a consumer failing over here went on from where the client had taken it away.
        groups = set()
        async for part in in_slices((table.popitem() for _ in range(len(table))), OFFSET_SLICE):
            for (group, topic, qid), offset in part:
                if group == PROGRESS_GROUP:
                    continue
                if offset < 0:      # (not counted as listed: a group the master deleted may still list them)
                    self.offsets.forget(group, topic, qid)
                    continue
                self.offsets.commit(group, topic, qid, offset)
                groups.add(group)
        self.offsets.take_deleted(deleted)     # (its groups deleted with their offsets kept: promoted, as it does)
        if not await self._forget_groups(addr, groups):
            return False
        if self.topics is not None and not await self._sync_topics(addr):
            return False
        if self.subscriptions is not None and not await self._sync_groups(addr):
            return False
        await self._sync_log_bounds(addr)      # its failure is said apart: the copies above stand
        if self._master_is_java:
            await self._sync_delay_offsets(addr)    # said apart too
        elif self._master_is_java is False and not self._copy_dropped:
            await self._drop_delay_copy(addr)
        self.synced += 1
        self.copied_at = self.clock()
        if self._failing is not None:
            log.warning("consumer offsets copied from master %s again", addr)
            self._failing = None
        return True

    async def _master_offsets(self, addr: str) -> tuple[dict, list[str]] | None:
        """The master's GET_ALL_CONSUMER_OFFSET table, {(group, topic, queue id): offset}, and the groups it names
        deleted with their offsets kept (a txmq master's "deleted"; none from a Java one); None (said) when not
        had."""
        if not self.following():
            # A master that lost its store (or another broker behind the address) has none of this slave's topics,
            # groups or offsets: copied, its empty table deleted every topic here, queues and all, while the slave
            # kept the log it had (diverged) for its consumers to fail over to.
            self._failed(f"nothing copied from master {addr}: this slave does not follow its log (not connected, "
                         "or the logs diverged)")
            return None
        try:
            resp = await self.pool.request(addr, RemotingCommand.request(RequestCode.GET_ALL_CONSUMER_OFFSET),
                                           self.timeout_s)
            if resp.code != ResponseCode.SUCCESS:
                self._failed(f"master {addr} refused GET_ALL_CONSUMER_OFFSET: code {resp.code} {resp.remark}")
                return None
            # A slice at a time, the loop running between (as the master encodes it): 100,000 offsets decoded and
            # committed in one go held this slave's loop 0.4-1.7 s at every sync.
            pieces = []     # (QUOTE_SLICE is even: a slice starts with a piece outside the literals, as the body)
            async for part in in_slices(string_literal_pieces(resp.body_bytes().decode("utf-8")), QUOTE_SLICE):
                pieces += [quote_int_keys(p) if i % 2 == 0 else p for i, p in enumerate(part)]
            table: dict = {}
            others: dict = {}
            async for part in in_slices(offset_table_members(pieces, others), KEY_SLICE):
                add_offset_entries(part, table)
            deleted = others.get("deleted", [])
            if not isinstance(deleted, list) or not all(isinstance(group, str) for group in deleted):
                raise ValueError(f"its deleted groups are not a list of names: {str(deleted)[:200]}")
        except Exception as exc:  # noqa: BLE001 - the master away, a bad body: said once, tried next interval
            self._failed(f"consumer offsets not copied from master {addr}: {exc}")
            return None
        return table, deleted

    async def _forget_groups(self, addr: str, groups: set[str]) -> bool:
        """Remove the offsets of the groups the master's earlier copies named and its answers have missed since at
        least ``forget_after_s`` ago, the last one too: the master removed them (DELETE_SUBSCRIPTIONGROUP with
        removeOffset). The copy (putAll) kept them for good: a slave promoted resumed a group made again from its
        deleted offsets, and its lag series lived on.
        Not at the first answer that misses one, nor at the second: a master killed -9 comes back with its offsets
        as saved up to 5 s before, without a group whose first commits came since, until its consumers commit
        again (every 5 s once they reach it again); removed then, saved, a consumer failing over to this slave
        meanwhile started the group over. Two answers in a row held that off only while the sync interval (10 s)
        was longer than the consumers' way back: at --slave-sync-interval-ms 1000 two answers came 1 s apart.
        Offsets only this slave ever had (committed here while the master was away) stay, as RocketMQ's."""
        # Only the time between two answers in a row counts, kept over a sync that got none: restarted at each, an
        # HA link that dropped once within every forget_after_s (a flapping network, a master's GC pauses past the
        # timeout) kept a group the master had deleted on this slave for good.
        now = self.clock()
        step = 0.0 if self._answered_at is None else now - self._answered_at
        self._answered_at = now
        missed = set() if self._master_groups is None else self._master_groups - groups
        self._absent = {group: self._absent[group] + step if group in self._absent else 0.0 for group in missed}
        gone = {group for group, missed_for in self._absent.items() if missed_for >= self.forget_after_s}
        if gone and await self._master_restarted(addr):
            # Back from a kill -9 within one interval, no sync failed: the time since its last answer counted.
            gone = set()
        for group in gone:
            del self._absent[group]
        self._master_groups = groups | self._absent.keys()
        if not gone:
            if self._unsaved_removals:      # a removal's save failed: named on, until it is on disk
                try:
                    await self.offsets.saved()
                    self._unsaved_removals.clear()
                except OSError:
                    pass                    # said when it failed; the file names them still
            await self._save_named()
            return True
        self._unsaved_removals |= gone
        self.offsets.remove_groups(gone)
        # As the master's DELETE_SUBSCRIPTIONGROUP forgot them: kept, the slave's own deliveries of the group (pulls
        # failed over to it, slave_read_enable) stayed in every scrape, and a group made again went on from them.
        self.forget_groups(gone)
        log.warning("consumer offsets of %d group(s) removed as master %s did (e.g. %s): it lists them no more",
                    len(gone), addr, min(gone))
        try:
            await self.offsets.saved()     # else a kill before the periodic save brought them back for good
        except OSError as exc:
            self._failed(f"offsets of groups removed as master {addr} did, but their removal not saved: {exc}")
            return False
        # Only now: named no more in the file while their offsets still were, a kill in between kept them for good.
        self._unsaved_removals.clear()
        await self._save_named()
        return True

    def _read_named(self) -> set[str] | None:
        """The groups the master's answers named as this slave last saved them; None (said) when not had. Known in
        memory only, a group the master deleted while this slave was down (or restarted while it timed the group's
        absence) was one only the slave had to the restarted slave, and stayed for good. Timed afresh from its
        first answer (not removed at once: the master may be the one back from a kill -9)."""
        def parse(raw) -> set[str]:
            check(isinstance(raw, list) and all(isinstance(group, str) for group in raw), "not a list of group names")
            return set(raw)
        named, why = read_saved(self._named_path, parse)
        if why is not None and why != "missing":
            log.warning("groups named by the master %s not read (%s): a group it deleted while this slave was down "
                        "keeps its offsets here", self._named_path, why)
        return named

    async def _save_named(self) -> None:
        """_master_groups written for the next start once changed; a write refused is tried again next sync."""
        # Replaced at each answer, never changed: encoded on a thread as it is. A removal not saved yet stays named: a
        # kill before its save left the offsets on disk, and unnamed, the restarted slave kept them for good.
        named = self._master_groups | self._unsaved_removals if self._unsaved_removals else self._master_groups
        if self._named_path is None or named == self._named_saved:
            return
        try:
            await asyncio.to_thread(_save_named, self._named_path, named)
        except OSError as exc:
            why = f"groups named by the master not saved to {self._named_path} ({exc}): tried again at the next sync"
            if why != self._named_failing:      # once per cause
                log.warning("%s", why)
                self._named_failing = why
            return
        self._named_saved, self._named_failing = named, None

    async def _sync_log_bounds(self, addr: str) -> None:
        """Where the master's log starts and ends (GET_BROKER_RUNTIME_INFO, a Java master answers it too)."""
        try:
            resp = await self.pool.request(addr, RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO),
                                           self.timeout_s)
            if resp.code != ResponseCode.SUCCESS:
                raise ValueError(f"refused: code {resp.code} {resp.remark}")
            table = json.loads(resp.body_bytes())["table"]
            self._master_booted(table.get("bootTimestamp"))
            self._master_is_java = not any(key.startswith("txmq") for key in table)
            bounds = int(table["commitLogMinOffset"]), int(table["commitLogMaxOffset"])
        except Exception as exc:  # noqa: BLE001 - the master away, a bad body: said once, tried next interval
            why = (f"master {addr}'s log start not learnt from GET_BROKER_RUNTIME_INFO ({exc or type(exc).__name__}): "
                   "this slave's cleaner keeps every segment its master may still hold")
            if why != self._bounds_failing:
                log.warning("%s", why)
                self._bounds_failing = why
            return
        if self._bounds_failing is not None:
            log.warning("master %s's log start learnt again", addr)
            self._bounds_failing = None
        self.master_end_learnt(bounds[1])
        self.removable_end(self.log_end())      # latches the pending bounds if this slave's log reached them
        if self._master_log is None:
            # Replaced only once reached: a slave steadily behind by more than one interval's writes never held the
            # master's end as last said, replaced at each sync, and so removed nothing until disk pressure.
            self._master_log = bounds
        self.removable_end(self.log_end())

    async def _sync_delay_offsets(self, addr: str) -> None:
        """A Java master's delay levels' progress (GET_ALL_DELAY_OFFSET), written for this slave's start as a
        master (ScheduleService._take_master_copy) when it changed. Not copied, a slave of a Java master promoted
        delivered again every delayed message its log still held: that master writes no progress record there."""
        if self._config_dir is None:
            return
        try:
            resp = await self.pool.request(addr, RemotingCommand.request(RequestCode.GET_ALL_DELAY_OFFSET),
                                           self.timeout_s)
            if resp.code != ResponseCode.SUCCESS:
                raise ValueError(f"refused: code {resp.code} {resp.remark}")
            levels = decode_delay_offsets(resp.body_bytes())
            if levels != self._delay_copied:
                await self._copy_bounded(write_master_copy, self._config_dir, levels)
                self._delay_copied = levels
        except Exception as exc:  # noqa: BLE001 - the master away, a bad body, a full disk: said once, tried again
            why = (f"delay progress not copied from Java master {addr} ({exc or type(exc).__name__}): promoted, this "
                   "slave delivers again the delayed messages its master delivered since the last copy")
            if why != self._delay_failing:
                log.warning("%s", why)
                self._delay_failing = why
            return
        if self._delay_failing is not None:
            log.warning("delay progress copied from Java master %s again", addr)
            self._delay_failing = None

    async def _drop_delay_copy(self, addr: str) -> None:
        """A txmq master keeps its delay progress in its log: a copy left from a Java master this slave had (its
        store since rebuilt under this one) named levels of another log, and a promotion took them over this log's
        own, its undelivered delayed messages taken as delivered. Removed once; refused, tried next sync."""
        if self._config_dir is None:
            self._copy_dropped = True
            return
        try:
            removed = await self._copy_bounded(drop_master_copy, self._config_dir)
        except OSError as exc:      # (TimeoutError too: a removal that hangs)
            why = f"{MASTER_COPY_NAME} of a Java master not removed under txmq master {addr} ({exc}): promoted, " \
                  "this slave takes its levels and may skip delayed messages"
            if why != self._delay_failing:
                log.warning("%s", why)
                self._delay_failing = why
            return
        self._copy_dropped = True
        self._delay_failing = None
        if removed:
            log.warning("removed %s, a Java master's delay progress: master %s is a txmq broker (its progress is "
                        "in its log)", MASTER_COPY_NAME, addr)

    async def _copy_bounded(self, fn, *args):
        """``fn(*args)`` (a write or removal of MASTER_COPY_NAME) on a worker thread, waited COPY_WRITE_WAIT_S: one
        that hung (a stopped NFS under the config directory) held the sync for ever, unsaid, the master's offsets,
        groups, topics and log bounds never copied again. Past it, said at ERROR and left to end on its thread
        (TimeoutError: the caller's failure, tried again next sync); no other is started while it is under way."""
        if self._copy_io is not None and not self._copy_io.done():
            raise TimeoutError(f"a write of {MASTER_COPY_NAME} that hung has not ended")
        fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        self._copy_io = fut
        done, _ = await asyncio.wait({fut}, timeout=COPY_WRITE_WAIT_S)
        if not done:
            # Said by an ERROR alone, a copy that hung for days showed on no gauge, and its end by nothing
            self.write_hung = True
            fut.add_done_callback(self._copy_hung_ended)
            log.error("%s: a write has not ended in %g s (a hung disk or a stopped network file system?): the sync "
                      "goes on without it, the copy written again once it ends (txmq_config_write_hung)",
                      self.path, COPY_WRITE_WAIT_S)
            raise TimeoutError(f"a write of {MASTER_COPY_NAME} has not ended in {COPY_WRITE_WAIT_S:g} s")
        return fut.result()

    def _copy_hung_ended(self, fut: asyncio.Future) -> None:
        retrieved(fut)
        self.write_hung = False
        log.warning("%s: the write that hung has ended", self.path)

    async def _master_restarted(self, addr: str) -> bool:
        """Whether the master's bootTimestamp is another than last answered (the missed times set to 0 then); asked
        only before a group goes. Not had (said by the log bounds' sync): False, as a master that never says."""
        try:
            resp = await self.pool.request(addr, RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO),
                                           self.timeout_s)
            boot = json.loads(resp.body_bytes())["table"].get("bootTimestamp") \
                if resp.code == ResponseCode.SUCCESS else None
        except Exception:  # noqa: BLE001 - the master away, a bad body: as before this check
            return False
        known = self._master_boot
        self._master_booted(boot)
        return known is not None and boot is not None and boot != known

    def _master_booted(self, boot) -> None:
        """A master restarted (its bootTimestamp another) times the groups its answers miss afresh. The missed time
        is kept over a sync that got no answer (a flapping link to the same master), but a master killed -9 comes
        back without the commits of its last flush interval until its consumers reach it again: kept over the
        restart, the time its previous run had missed a group removed the group that much sooner after the master
        came back (2/3 of forget_after_s before, gone 1/3 of it after, in the test), the consumers not on it yet."""
        if boot is None:
            return
        if self._master_boot is not None and boot != self._master_boot:
            self._absent = dict.fromkeys(self._absent, 0.0)
        self._master_boot = boot

    def removable_end(self, log_end: int | None) -> int | None:
        """The offset up to which this slave may remove segments: the master's log start, as learnt once this
        slave's log (ending at ``log_end``) held the master's whole log of then; None while never."""
        bounds = self._master_log
        if bounds is not None and log_end is not None and log_end >= bounds[1]:
            self._removable = bounds[0] if self._removable is None else max(self._removable, bounds[0])
            self._master_log = None     # reached: the next sync's bounds are the next to wait for
        return self._removable

    async def _sync_topics(self, addr: str) -> bool:
        """The master's topic configs (GET_ALL_TOPIC_CONFIG) replace the slave's, as RocketMQ's slave takes them.
        The log names only the queues that hold records: a topic made on the master with 16 queues, read-only
        or ordered, was on the slave with the queues its records reached (none: not at all), read-write, and
        failed-over consumers and GET_TOPIC_STATS_INFO saw that; a topic deleted on the master lived on in the
        slave with its old messages, and came back on a slave restarted as the master."""
        # Deleted on the master and made again (a send) after it answered, a topic has its new records copied past
        # this point, maybe before the answer is applied: deleted, its queues went with the deleted mark over live
        # messages, never indexed on the slave again. store.delete_topic keeps it (checked with the delete); the
        # same table is then gone over again next time (a topic kept as its last records came late goes then).
        log_end = self.log_end()
        try:
            resp = await self.pool.request(addr, RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG),
                                           self.timeout_s)
            if resp.code != ResponseCode.SUCCESS:
                self._failed(f"master {addr} refused GET_ALL_TOPIC_CONFIG: code {resp.code} {resp.remark}")
                return False
            # A step at a time on the loop: read in a thread, json.loads held the GIL, and the loop, for the whole
            # body all the same (50,000 topics: 300-800 ms at every sync).
            # Compared with the master's version alone, a topic changed on the slave itself (a heartbeat's retry
            # topic; before the slave refused UPDATE_AND_CREATE_TOPIC, an updateTopic -b aimed at it) stayed so until
            # the master's table changed for some other reason, days maybe, failed-over consumers seeing the
            # slave's; RocketMQ's slave takes the master's at the next sync.
            version, taken = self._topics_version
            version, table = await in_steps(read_topic_table(
                resp.body_bytes(), version if taken == self.topics.data_version.counter else None))
        except Exception as exc:  # noqa: BLE001 - the master away, a bad body: said once, tried next interval
            self._failed(f"topic configs not copied from master {addr}: {exc}")
            return False
        if table is None:       # the table last taken (RocketMQ compares dataVersion too)
            return True
        changed, gone = self.topics.follow(table)
        newer = []
        for topic in gone:
            try:
                if not await self.delete_topic(topic, log_end):
                    newer.append(topic)
            except Exception as exc:  # noqa: BLE001 - a store that stopped taking writes: tried next interval
                self._failed(f"topic {topic}, deleted on master {addr}, not deleted here: {exc}")
                return False
        deleted = [topic for topic in gone if topic not in newer]
        if changed or deleted:
            log.info("topic configs copied from master %s: %d set (e.g. %s), %d deleted (e.g. %s)", addr,
                     len(changed), changed[:1], len(deleted), deleted[:1])
        try:
            await self.topics.saved()
        except OSError as exc:      # version not taken: tried again next interval, as the topics' own retry does
            self._failed(f"topic configs copied from master {addr} but not saved: {exc}")
            return False
        if deleted:
            # The deleted topics' offsets went with them (as DELETE_TOPIC_IN_BROKER's on the master, saved before
            # its SUCCESS): left to the periodic save, a kill within its interval brought them back at the restart,
            # where the master no longer has them and the copy (putAll) keeps what only the slave has -- for good.
            # The topic made again on the master starts at 0, and a consumer failed over to the slave (or to it
            # promoted) went on from the deleted topic's offset, past the new messages.
            try:
                await self.offsets.saved()
            except OSError as exc:  # the periodic save retries; the next sync says it again
                self._failed(f"topics deleted as master {addr} did, but their offsets' removal not saved: {exc}")
                return False
        if newer:       # the same table next time is read again: a topic the master deleted meanwhile goes then
            log.info("topics %s not deleted: records copied since master %s's table was asked for; the next sync "
                     "decides", newer[:3], addr)
            return True
        self._topics_version = version, self.topics.data_version.counter
        return True

    async def _sync_groups(self, addr: str) -> bool:
        """The master's subscription groups (GET_ALL_SUBSCRIPTIONGROUP_CONFIG) replace the slave's, as RocketMQ's
        slave takes them: set on the master (updateSubGroup), a group's brokerId and whichBrokerWhenConsumeSlowly
        were unknown to the slave, whose pulls (slave_read_enable) then suggested the defaults -- a group set to
        read from the slave was sent back to the master on every pull -- and so were consumeEnable and the rest
        for consumers that failed over to it."""
        subs = self.subscriptions
        try:
            resp = await self.pool.request(
                addr, RemotingCommand.request(RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG), self.timeout_s)
            if resp.code != ResponseCode.SUCCESS:
                self._failed(f"master {addr} refused GET_ALL_SUBSCRIPTIONGROUP_CONFIG: code {resp.code} "
                             f"{resp.remark}")
                return False
            # A step at a time on the loop (as the topics): read in one go, 10,000 groups held it 70-80 ms.
            # Skipped while the master's dataVersion is the one taken and nothing here changed the groups since
            # (the slave's own groups changed since, however: the master's table is taken over them again).
            version, taken = self._groups_version
            version, groups = await in_steps(read_group_table(
                resp.body_bytes(), version if taken == subs.counter else None))
            changed = groups is not None and subs.take(groups)
            self._groups_version = version, subs.counter
        except Exception as exc:  # noqa: BLE001 - the master away, a bad body: said once, tried next interval
            self._failed(f"subscription groups not copied from master {addr}: {exc}")
            return False
        if changed:
            log.info("subscription groups copied from master %s: %d configured", addr, len(subs.groups))
        if changed or self._groups_unsaved:
            # Tried again at each sync until it is written: the next copy is unchanged (adopt says False), and the
            # file stayed the old one for good (a slave restarted without its master read stale groups), while
            # the next sync said the copies worked again. And as any refused save (retried_save.py), every 5 s
            # and at stop: a master away once the disk had room -- what the copy is for -- left it stale.
            try:
                await subs.save()
            except OSError as exc:
                self._groups_unsaved = True
                self._failed(f"subscription groups copied from master {addr} but not saved: {exc}")
                return False
            self._groups_unsaved = False
        return True

    def _failed(self, why: str) -> None:
        if why != self._failing:        # once per cause, not every interval
            log.warning("%s", why)
            self._failing = why

    async def close(self) -> None:
        for task in self._ha_checks.values():
            task.cancel()
        await self.pool.close()


async def _same_endpoint(a: str, b: str, timeout_s: float) -> bool | None:
    """HOST:PORT ``a`` and ``b`` one endpoint: one port, hosts resolving to a shared IP ("localhost" and 127.0.0.1, a
    host name and the IP a master registers). Unresolved in ``timeout_s``: None, not known (a DNS outage said as
    another master's log was an ERROR and TxmqSlaveMasterMismatch on a correctly configured slave)."""
    (host_a, _, port_a), (host_b, _, port_b) = a.rpartition(":"), b.rpartition(":")
    if port_a != port_b:
        return False
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            ips = [{info[4][0] for info in await loop.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)}
                   for host in (host_a, host_b)]
    except (OSError, TimeoutError, ValueError):     # (UnicodeError, a NUL in a name: ValueErrors)
        return None
    return not ips[0].isdisjoint(ips[1])


def _save_named(path: str, named: set[str]) -> None:
    """Blocking: off the loop."""
    fsync_dirs(make_dirs(os.path.dirname(path)))
    save(path, json.dumps(sorted(named)).encode())
