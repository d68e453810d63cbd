"""Subscription groups (RocketMQ's SubscriptionGroupManager): UPDATE_AND_CREATE_SUBSCRIPTIONGROUP and
GET_ALL_SUBSCRIPTIONGROUP_CONFIG.

``<store>/config/subscriptionGroup.json`` is the body a 4.x broker keeps and answers::

    {"dataVersion":{"counter":N,"timestamp":MS},"subscriptionGroupTable":{"<group>":{...config...}}}

Groups created by an operator are stored; a group the broker only knows from its clients (a
heartbeat, a committed offset) is listed with the defaults, as RocketMQ auto-creates it
(autoCreateSubscriptionGroup). ``consumeEnable: false`` stops the group's pulls (NO_PERMISSION), and
``consumeBroadcastEnable: false`` those of its BROADCASTING consumers; ``retryMaxTimes`` is the group's retries
when a send-back names none; ``retryQueueNums`` the queues of its retry topic (0: no retries at all);
``brokerId`` and ``whichBrokerWhenConsumeSlowly`` the broker ids pulls suggest with slaveReadEnable;
``notifyConsumerIdsChangedEnable: false`` stops NOTIFY_CONSUMER_IDS_CHANGED on heartbeats and UNREGISTER_CLIENT
(not when a connection closes, as RocketMQ).
"""
from __future__ import annotations

import logging
import os
import threading

from protocol.admin_bodies import dump, json_members
from protocol.message import validate_group
from protocol.txlog import PROGRESS_GROUP

from .retried_save import RetriedSave
from .slices import members_in_slices, sorted_in_slices
from .store.saved import check, load_saved, save
from .topics import version_taken

log = logging.getLogger("txmq.subscriptions")

FILE_NAME = "subscriptionGroup.json"
# SubscriptionGroupManager.init: the groups every 4.x broker lists.
SYSTEM_GROUPS = ("TOOLS_CONSUMER", "FILTERSRV_CONSUMER", "SELF_TEST_C_GROUP", "CID_ONS-HTTP-PROXY",
                 "CID_ONSAPI_PULL", "CID_ONSAPI_PERMISSION", "CID_ONSAPI_OWNER", PROGRESS_GROUP)    # (CID_SYS_RMQ_TRANS)
DEFAULTS = {"brokerId": 0, "consumeBroadcastEnable": True, "consumeEnable": True, "consumeFromMinEnable": True,
            "notifyConsumerIdsChangedEnable": True, "retryMaxTimes": 16, "retryQueueNums": 1,
            "whichBrokerWhenConsumeSlowly": 1}
# Groups encoded between two turns of the loop (GET_ALL_SUBSCRIPTIONGROUP_CONFIG, encode_in_slices), ~9 us each.
GROUP_SLICE = 512
_JAVA_BITS = {"brokerId": 64, "whichBrokerWhenConsumeSlowly": 64, "retryMaxTimes": 32, "retryQueueNums": 32}
_TYPES = {"brokerId": int, "retryMaxTimes": int, "retryQueueNums": int, "whichBrokerWhenConsumeSlowly": int,
          "consumeBroadcastEnable": bool, "consumeEnable": bool, "consumeFromMinEnable": bool,
          "notifyConsumerIdsChangedEnable": bool}


def group_config(name: str, values: dict | None = None) -> dict:
    """A whole SubscriptionGroupConfig: the defaults, overridden by the known fields of ``values``."""
    cfg = dict(DEFAULTS, groupName=name)
    for key, kind in _TYPES.items():
        if values and key in values and values[key] is not None:
            value = values[key]
            if kind is bool and isinstance(value, str):
                flag = value.strip().lower()
                if flag not in ("true", "false"):   # "yes", "on": read as false, a group stopped without a word
                    raise ValueError(f"{key} = {value!r} (true or false)")
                value = flag == "true"
            cfg[key] = kind(value)
    return cfg


class SubscriptionGroups(RetriedSave):
    _what, _log = "subscription groups file", log
    _undone = "a group's settings changed since are undone (consumeEnable false consumes again)"

    def __init__(self, config_dir: str, clock):
        self.path = os.path.join(config_dir, FILE_NAME)
        self.clock = clock
        self.groups: dict[str, dict] = {}
        self.counter = 0
        self.timestamp = clock()
        self._write_lock = threading.Lock()
        self._load()
        self._saved_counter = self.counter     # the newest table on disk (write)
        # (version, known groups, body parts) of the last whole encode_in_slices: a slave asks every 10 s, and
        # the same table encoded again each time cost the master 200-250 ms of CPU at 50,000 groups
        self._answered: tuple | None = None

    def _load(self) -> None:
        # The previous save: without it the next update would replace the damaged (or lost) file for good, every
        # other group's settings gone (a group stopped with consumeEnable false would consume again).
        saved = load_saved(self.path, _parse_file, "subscription groups file", log,
                           fallback_cost="at most one save older: a group updated since has its older settings",
                           reset_hint="move both away to start every group with the defaults, then set them "
                                      "again with updateSubGroup")
        if saved is not None:
            self.counter, self.timestamp, self.groups = saved
        for name, cfg in self.groups.items():
            _warn_if_not_retried(name, cfg)

    def update(self, values: dict) -> dict:
        """Create or replace a group's config (the caller persists: ``encode`` then ``write``)."""
        name = values.get("groupName")
        if not isinstance(name, str) or not name:
            raise ValueError("the body names no groupName")
        why = validate_group(name, "groupName")     # as a heartbeat's: one not UTF-8 failed every later save
        if why is not None:
            raise ValueError(why)
        cfg = group_config(name, values)
        for key, bits in _JAVA_BITS.items():
            if not -(1 << (bits - 1)) <= cfg[key] < 1 << (bits - 1):
                # sent back to clients (brokerId in every pull reply with slaveReadEnable, all of them to tools):
                # past a Java int / long, the stock client fails to decode the whole reply
                raise ValueError(f"{key} = {cfg[key]} is out of range for a Java {'long' if bits == 64 else 'int'}")
        self.groups[name] = cfg
        _warn_if_not_retried(name, cfg)
        self.counter += 1
        self.timestamp = self.clock()
        log.info("subscription group %s: %s", name, cfg)
        return cfg

    def delete(self, name: str) -> bool:
        """Forget a group's config (DELETE_SUBSCRIPTIONGROUP; the caller persists); False when it had none."""
        if self.groups.pop(name, None) is None:
            return False
        self.counter += 1
        self.timestamp = self.clock()       # (said by the caller, with who asked: one line a delete)
        return True

    def consume_enabled(self, group: str) -> bool:
        cfg = self.groups.get(group)
        return cfg is None or cfg["consumeEnable"]

    def broadcast_enabled(self, group: str) -> bool:
        cfg = self.groups.get(group)
        return cfg is None or cfg["consumeBroadcastEnable"]

    def notify_enabled(self, group: str) -> bool:
        """notifyConsumerIdsChangedEnable: tell the group's consumers when one joins or leaves it (HEART_BEAT,
        UNREGISTER_CLIENT). Operators turn it off for large groups, whose members then rebalance on their own
        timer (20 s) instead of all at once on every join."""
        cfg = self.groups.get(group)
        return cfg is None or cfg["notifyConsumerIdsChangedEnable"]

    def retry_max_times(self, group: str) -> int | None:
        """The group's retryMaxTimes when an operator set its config, else None (the broker's default)."""
        cfg = self.groups.get(group)
        return None if cfg is None else cfg["retryMaxTimes"]

    def retry_queue_nums(self, group: str) -> int:
        """retryQueueNums: the queues of the group's retry topic (its heartbeat or first send-back makes it with
        that many); 0 or less: its failed messages are not retried (RocketMQ's send-back answers SUCCESS and
        stores nothing)."""
        cfg = self.groups.get(group)
        return DEFAULTS["retryQueueNums"] if cfg is None else cfg["retryQueueNums"]

    def read_from(self, group: str) -> tuple[int, int]:
        """(brokerId, whichBrokerWhenConsumeSlowly): the broker ids a pull reply suggests to the group's consumers
        with slaveReadEnable, one keeping up and one far behind."""
        cfg = self.groups.get(group) or DEFAULTS
        ids = cfg["brokerId"], cfg["whichBrokerWhenConsumeSlowly"]
        # (a file saved before update() checked the range: a number a Java client cannot read is not suggested)
        return ids if all(-(1 << 63) <= i < 1 << 63 for i in ids) else (0, 1)

    def adopt(self, body: bytes) -> bool:
        """(Slave) take its master's table (the body of GET_ALL_SUBSCRIPTIONGROUP_CONFIG) for its own, as RocketMQ's
        SlaveSynchronize does: the groups whose config is not all defaults, replacing this broker's. True when that
        changed anything (the caller saves it). ValueError or TypeError for a body of the wrong shape. In one go:
        a slave reads the body a step at a time (read_group_table), then ``take``s its groups."""
        reader = read_group_table(body)
        while True:
            try:
                next(reader)
            except StopIteration as done:
                return self.take(done.value[1])

    def take(self, groups: dict[str, dict]) -> bool:
        """(Slave) ``groups`` (read_group_table's) for this broker's own: True when that changed anything."""
        if groups == self.groups:
            return False
        self.groups = groups
        self.counter += 1
        self.timestamp = self.clock()
        return True

    def encode(self, known_groups=()) -> bytes:
        """The body of GET_ALL_SUBSCRIPTIONGROUP_CONFIG (and the file): stored groups, then the system
        groups and those the broker knows from clients, with the defaults."""
        table = {name: group_config(name) for name in (*SYSTEM_GROUPS, *known_groups)}
        table.update(self.groups)
        return dump({"dataVersion": {"counter": self.counter, "timestamp": self.timestamp},
                     "subscriptionGroupTable": table}).encode()

    async def encode_in_slices(self, known_groups=(), conn=None) -> list[bytes]:
        """``encode``'s body, the same bytes in parts, a slice of groups at a time, the loop running between two. The
        version as it starts: a group updated meanwhile is read again at the next sync (see get_all_topic_config).
        Stopped once ``conn`` (the asker's) is gone (members_in_slices). The parts of the last whole one again while
        neither the version (every change of ``groups`` moves it) nor the known groups changed."""
        version, known = (self.counter, self.timestamp), frozenset(known_groups)
        if self._answered is not None and self._answered[:2] == (version, known):
            return self._answered[2]
        parts = await _table_in_slices(self.groups, version, known, conn)
        if (self.counter, self.timestamp) == version:    # (not a table changed while it was written)
            self._answered = (version, known, parts)
        return parts

    async def _encoded(self) -> tuple[bytes, int]:
        """(RetriedSave) ``encode()``'s bytes a slice of groups at a time, of the table as it was when the save
        began: encoded whole on the loop, 50,000 groups held it about a second at each update's save on a loaded
        host (bench/bench_config_holds.py), and anyone may send UPDATE_AND_CREATE_SUBSCRIPTIONGROUP back to
        back. (An update replaces a group's dict, never changes it: a copy of the table is the table then.)"""
        counter = self.counter
        parts = await _table_in_slices(dict(self.groups), (counter, self.timestamp), frozenset())
        return b"".join(parts), counter

    def write(self, data: bytes, counter: int | None = None) -> None:
        """Blocking (fsync, rename): call it off the loop. ``counter``: the one ``data`` was encoded at; two
        updates' writes run on two threads and may finish in either order, and an older table written
        after a newer one would lose the newer update, so it is skipped."""
        with self._write_lock:
            if counter is not None and counter < self._saved_counter:
                return
            save(self.path, data)
            if counter is not None:
                self._saved_counter = counter


async def _table_in_slices(groups: dict[str, dict], version: tuple[int, int], known, conn=None) -> list[bytes]:
    """SubscriptionGroups.encode's bytes in parts, GROUP_SLICE groups at a time, the loop running between two."""
    head = dump({"counter": version[0], "timestamp": version[1]})
    names = await sorted_in_slices({*SYSTEM_GROUPS, *known, *groups}, GROUP_SLICE * 4, conn)

    def members(part) -> str:
        return dump({name: groups.get(name) or group_config(name) for name in part})[1:-1]
    return await members_in_slices(f'{{"dataVersion":{head},"subscriptionGroupTable":{{', names, GROUP_SLICE,
                                   members, ",", "}}", conn)


# Groups of the master's table read between two of read_group_table's steps (~20 us each).
GROUP_READ_STEP = 256


def read_group_table(body: bytes, known=None):
    """A GET_ALL_SUBSCRIPTIONGROUP_CONFIG body's (dataVersion, groups whose config is not all defaults: what a slave
    takes), read a step at a time (a generator: it yields between two steps and returns them): a slave reads its
    master's table on its loop, the loop running between two steps. Read whole (json.loads, then every group
    checked), 10,000 groups held the slave's loop 70-80 ms at every sync, 50,000 360 ms. ValueError or TypeError
    for a body of the wrong shape, found before anything is taken (as _parse_file's: a table missing is an empty
    one). A body of dataVersion ``known`` (the one last taken, as RocketMQ's slave compares it) is not read past its
    version, first in txmq's and a Java master's bodies: (known, None). Read each time, 50,000 groups cost the
    slave 0.6-0.9 s of CPU at every sync (10 s), the table unchanged for days."""
    version, groups, read = {}, {}, 0
    try:
        for inside, name, cfg in json_members(body.decode("utf-8"), "subscriptionGroupTable"):
            if not inside:
                if name == "dataVersion":
                    version = cfg or {}
                    check(isinstance(version, dict), f"malformed dataVersion {cfg!r}")
                    if version_taken(version, known):
                        return known, None
                continue
            check(isinstance(cfg, dict), f"group {name}: {cfg!r}")
            full = group_config(name, cfg)
            if full != group_config(name):
                groups[name] = full
            read += 1
            if read % GROUP_READ_STEP == 0:
                yield
    except KeyError:        # no subscriptionGroupTable: none configured (as _parse_file reads it)
        pass
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None
    if version_taken(version, known):
        return known, None
    return (version.get("timestamp"), version.get("counter")), groups


def _warn_if_not_retried(name: str, cfg: dict) -> None:
    """Said when set and at every start: a store from a version that ignored retryQueueNums 0 would otherwise
    start dropping the group's failed messages on upgrade with nothing said until the first one went."""
    if cfg["retryQueueNums"] <= 0:
        log.warning("consumer group %s has retryQueueNums %d: its failed messages are answered SUCCESS and dropped, "
                    "neither retried nor dead-lettered, as RocketMQ does (an orderly consumer's dead letters, sent to "
                    "its retry topic, still go to its dead-letter queue); updateSubGroup -q 1 (or more) retries them",
                    name, cfg["retryQueueNums"])


_MAX_RETRY_QUEUES = 1024      # as UPDATE_AND_CREATE_TOPIC allows: one heartbeat must not make a million queues


def retry_queues(subs: SubscriptionGroups | None, group: str) -> int:
    """How many queues ``group``'s retry topic is made with: its retryQueueNums, at least one (a group set to 0
    is not retried, yet its consumers still subscribe to the topic) and at most 1024."""
    wanted = DEFAULTS["retryQueueNums"] if subs is None else subs.retry_queue_nums(group)
    return min(max(1, wanted), _MAX_RETRY_QUEUES)


def _parse_file(data) -> tuple[int, int, dict[str, dict]]:
    """(counter, timestamp, groups) of the file's JSON; ValueError or TypeError for the wrong shape (a group
    skipped would be back to the defaults)."""
    check(isinstance(data, dict), "not a JSON object")
    table = data.get("subscriptionGroupTable") or {}
    version = data.get("dataVersion") or {}
    check(isinstance(table, dict) and isinstance(version, dict), "malformed subscriptionGroupTable or dataVersion")
    for name, cfg in table.items():
        check(isinstance(cfg, dict), f"group {name}: {cfg!r}")
    return (int(version.get("counter", 0)), int(version.get("timestamp", 0)),
            {name: group_config(name, cfg) for name, cfg in table.items()})
