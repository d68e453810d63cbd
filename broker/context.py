"""BrokerContext: what every processor needs, built once by the server."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from protocol.codes import Perm
from protocol.message import UniqIdGenerator, pack_host

from .clients import ClientRegistry
from .config import BrokerConfig
from .metrics import BrokerMetrics
from .topics import TopicManager


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


def monotonic_ms() -> int:
    """For timing liveness (client channels, queue locks, name-server broker expiry) and waits (transaction
    checks): a wall clock stepped forward (NTP, a VM resumed) expired every client, lock or broker at once;
    stepped back, kept dead ones, held a crashed consumer's orderly queues locked, or left every undecided
    transaction unchecked until the clock caught up."""
    return int(time.monotonic() * 1000)


def boottime_ms() -> int:
    """Like monotonic_ms, never stepped, but counting the time the host was suspended (Linux CLOCK_BOOTTIME;
    CLOCK_MONOTONIC stands still while it sleeps). The monotonic clock where there is none."""
    if _BOOTTIME is None:
        return monotonic_ms()
    return int(time.clock_gettime(_BOOTTIME) * 1000)


_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def aged_clock(clock=wall_clock_ms, monotonic=boottime_ms):
    """A clock to judge ages by (what retention removes): the wall clock, but never further ahead of its reading
    now than the time that passes from now (boottime_ms: a suspended host's sleep counts; by CLOCK_MONOTONIC ages
    were judged short by every sleep for the rest of the run). Store times are the wall clock's; judged by it
    alone, a step days ahead while the broker runs (a VM's host, a bad NTP source) aged every record and undecided
    half by the step at once, and retention removed them. A step back (or a clock behind at the start) keeps
    things longer: never removes more. Until a restart, a clock put right by a step forward keeps them longer by
    that step."""
    wall0, mono0 = clock(), monotonic()
    return lambda: min(clock(), wall0 + monotonic() - mono0)


@dataclass
class BrokerContext:
    config: BrokerConfig
    store: object                    # broker.store.MessageStore
    offsets: object                  # broker.store.ConsumerOffsets
    topics: TopicManager
    clients: ClientRegistry
    metrics: BrokerMetrics
    broker_addr: str = ""            # host:port clients reach the broker at
    store_host: bytes = b""          # packed host of broker_addr, in every stored record
    clock: object = wall_clock_ms    # what records and reports carry (store timestamps): the wall clock
    monotonic: object = monotonic_ms  # what times waits (the check schedule): never stepped
    aged: object = None              # what ages are judged by (retention): aged_clock(), set by the server; None: clock
    holds: object = None             # broker.longpoll.PullHoldService
    tx: object = None                # broker.transaction.TransactionService
    limits: object = None            # broker.limits.Limits
    acl: object = None               # broker.acl.PlainAcl, None without --acl-file
    retention: object = None         # broker.retention.Retention
    schedule: object = None          # broker.schedule.ScheduleService
    index: object = None             # broker.store.index.IndexService, None when message_index_enable is off
    subscriptions: object = None     # broker.subscriptions.SubscriptionGroups
    kv: object = None                # broker.kv_config.KvConfig: its name server's KV config
    ha: object = None                # broker.ha.HAMaster / HASlave; None: a master nobody follows
    started_ms: int = 0              # when the broker began serving (runtime info)
    # mqadmin updateBrokerConfig brokerPermission (processors/broker_config.py), saved in broker/live_config.py's
    # file and read again at start-up; config_lock: one change saved and applied at a time
    broker_permission: int = Perm.READ_WRITE
    config_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    config_version: int = 0          # live configuration changes (GET_BROKER_CONFIG's version counter)
    routes_write_wiped: bool = False  # wipeWritePerm on its name server: routes say no writes (processors/namesrv)
    forwarding: int = 0              # requests waiting for a consumer's answer (processors/forward.py)
    broker_consume_stats: int = 0    # GET_BROKER_CONSUME_STATS being gathered (processors/ops.py)
    # remote address -> [lock, its large heartbeats waiting or under way] (processors/client.py)
    heartbeat_turns: dict = field(default_factory=dict)
    uniq_ids: UniqIdGenerator = field(default_factory=UniqIdGenerator)

    def topic_perm(self, perm: int) -> int:
        """A topic's perm as routes and registrations carry it: masked by the broker permission when that is
        not read-write, as RocketMQ's registerBrokerAll (which drops INHERIT then too)."""
        bp = self.broker_permission
        return perm if bp == Perm.READ_WRITE else perm & bp

    def set_address(self, host: str, port: int) -> None:
        self.broker_addr = f"{host}:{port}"
        self.store_host = pack_host(host, port)
        self.uniq_ids = UniqIdGenerator(host)
