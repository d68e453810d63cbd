"""Broker lifecycle: bind, recover, serve the broker, name-server and metrics roles, stop gracefully.

Start-up order matters: the listeners are bound first (so port 0 resolves and
message ids can carry the real address), then the store recovers and the
transaction index is rebuilt, and only then do the listeners accept. The
``LISTENING`` line is printed last, when every role answers.

SIGTERM / SIGINT: stop accepting, release parked pulls, let in-flight requests
finish (bounded), stop the check timer, flush and close the store, exit 0.
"""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import math
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable

from protocol import logline
from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import DEFERRED, ReadBudget, RemotingConnection, WriteBudget
from protocol.errors import ProtocolError
from protocol.message import validate_topic
from protocol.txlog import OP_TOPIC

from .acl import NAMESRV_CHECKED, PlainAcl
from . import ha as ha_roles
from . import live_config
from .ha.sync import SlaveSync
from .clients import ClientRegistry
from .config import BrokerConfig
from .context import BrokerContext, aged_clock, monotonic_ms, wall_clock_ms
from .heap import HeapSettler
from .kv_config import FILE_NAME as KV_FILE_NAME
from .kv_config import KvConfig
from .limits import ConnectionGate, Limits, peer_host, set_ipv6_client_prefix
from .longpoll import PullHoldService
from .metrics import BrokerMetrics, append_snapshot, prune_snapshots
from .metrics_http import start_metrics_server
from .slices import in_slices
from .processors import broker_table, namesrv_table
from .processors.transaction import end_plan_watchers
from .queue_locks import CLIENT_LOCK_TRUST_MS, LockFile
from .registration import BrokerRegistrar
from .retention import Retention
from .schedule import DelayLevels, ScheduleService
from .schedule.levels import SCHEDULE_TOPIC, TIMER_TOPIC
from .store import ConsumerOffsets, DiskMonitor, MessageStore, StoreConfig
from .store import offsets as offsets_store
from .store.index import IndexService
from .store.saved import daemon_default_executor, observe_writes, retrieved
from .subscriptions import SubscriptionGroups, retry_queues
from .supervise import LoopLag, Supervisor
from .topics import RETRY_PREFIX, TopicLimitError, TopicManager
from .transaction import TransactionService

log = logging.getLogger("txmq.server")
FLUSH_HUNG_S = 10.0     # a commit-log flush in flight this long is said at ERROR (_flush_age)
# ...and one this long is, however slow the disk's flushes were (_said_hung): TxmqStoreFlushHung, TxmqStoreIoStalled
# and TxmqIndexStalled fire past it (ops/prometheus/alerts.yml); twice a 100 s flush that returned held the ERROR
# back to 200 s, the critical alert long fired with nothing in the log.
HUNG_SAID_BY_S = 30.0
# The most a stop waits for a slow store disk (_stop_behind_the_log), counted from the stop's start (the grace, the
# queue lock file before it): the consumer offsets' last save after it waits for a write until it is said hung and
# HUNG_CLOSE_WAIT_S more (32 s), and all must end under systemd's and compose's 60 s, with 3 s to spare. (30 s from
# the store's first part, after a 5 s grace and 2 s of lock file: 70 s, SIGKILL before the offsets were saved.)
STOP_BEHIND_THE_LOG_S = 60.0 - (offsets_store.WRITE_HUNG_S + offsets_store.HUNG_CLOSE_WAIT_S) - 3.0
LAG_SLICE = 4096        # consumer offsets summed between two turns of the loop (the lag gauge)


class _HAPeer:
    """An HA connection as ConnectionGate counts one (its remote address)."""

    def __init__(self, peer):
        self.peer = peer


class BrokerServer:
    def __init__(self, config: BrokerConfig, clock=wall_clock_ms):
        self.config = config
        self.clock = clock
        set_ipv6_client_prefix(config.ipv6_client_prefix)     # before any connection is counted
        self.metrics = BrokerMetrics()
        self.connections = {listener: ConnectionGate(config.max_connections, config.max_connections_per_host, log,
                                                     f"{listener} listener")
                            for listener in ("broker", "namesrv")}
        # unread responses of every connection of both listeners, together (max_total_write_buffer)
        self.write_budget = WriteBudget(config.max_total_write_buffer,
                                        on_close=lambda reason: self.metrics.unread_closes.labels(reason).inc())
        # frames received in part on every connection of both listeners, together (max_total_read_buffer)
        self.read_budget = ReadBudget(config.max_total_read_buffer,
                                      on_close=lambda reason: self.metrics.refused.labels(reason).inc())
        self._servers: list = []
        self._tasks: list[asyncio.Task] = []
        self.lock_file: LockFile | None = None
        self._metrics_httpd = None
        self.addresses: dict[str, str] = {}
        self.starting = "reading the configuration"     # what start() is doing: said by a signal that ends it
        self.serving = False
        self.ctx: BrokerContext | None = None
        self.stopping = asyncio.Event()
        self.fatal: str | None = None
        self.supervisor = Supervisor(self.metrics, self._fatal)
        self.loop_lag = LoopLag(self.metrics.loop_lag, self.metrics.loop_lag_worst)
        self.heap: HeapSettler | None = None            # the big tables frozen out of full collections (heap.py)
        self._gauges: dict = {}         # immutable snapshot the metrics thread reads; replaced, never changed
        self._lag_totals: tuple | None = None   # (lag, removed unread) rows, summed in slices (see _gauge_loop)
        self._flush_hung = False    # a commit-log flush has run past FLUSH_HUNG_S (_flush_age)
        self._io_hung = False       # the store's I/O thread has held a no-op past FLUSH_HUNG_S (_io_stalled)
        self._index_hung = False    # the index thread has held a no-op past FLUSH_HUNG_S (_index_stalled)
        self._wait_peaks: dict[str, float] = {}     # the longest age each of those reached while said (_said_hung)
        self._stop_began: float | None = None   # when stop() began (_stop_behind_the_log's budget counts from it)
        self._loop = None
        self.registrar: BrokerRegistrar | None = None   # with --namesrv-addr: registers with the name servers
        self.slave_sync: SlaveSync | None = None         # a slave: copies its master's consumer offsets

    def _fatal(self, why: str) -> None:
        self.fatal = why
        self.stopping.set()

    def _share_descriptors(self, gates: list) -> None:
        """Hold the listeners' connections together to what the open-files limit leaves beside max_queues'
        files (connections_limits_hold), said once at start when that is fewer than max_connections (the HA
        listener joining may be what puts it on)."""
        held = connections_limits_hold(resource.getrlimit(resource.RLIMIT_NOFILE)[0], self.config.max_queues)
        if held is None or held >= self.config.max_connections * len(gates):
            return
        said = gates[0].max_together is not None
        ConnectionGate.share_descriptors(gates, held)
        if not said:
            log.info("%d connections at once, all listeners together: what the open-files limit leaves beside "
                     "max_queues=%d (more are refused on accept, counted in txmq_requests_refused_total"
                     "{reason=\"open-files\"})", held, self.config.max_queues)

    # ------------------------------------------------------------- start-up
    async def start(self) -> None:
        # max_queues from the limits as they are now (run raised the open-files one to its hard limit)
        max_queues, short = effective_max_queues(self.config.max_queues,
                                                 resource.getrlimit(resource.RLIMIT_NOFILE)[0], _max_map_count())
        if short is not None:
            log.warning("%s", short)
        derived = max_queues != self.config.max_queues
        if derived:
            log.info("max_queues %d: what the open-files limit and vm.max_map_count hold", max_queues)
            self.config = dataclasses.replace(self.config, max_queues=max_queues)
        self._share_descriptors(list(self.connections.values()))
        c = self.config
        loop = asyncio.get_running_loop()
        store_dir = os.path.abspath(c.store_dir)
        os.makedirs(store_dir, exist_ok=True)
        clients = ClientRegistry(monotonic_ms, c.max_groups_per_host,     # liveness, queue locks: not the wall clock
                                 c.max_subscription_bytes_per_group, c.max_subscription_bytes_per_host)
        topics = TopicManager(os.path.join(store_dir, "config"), auto_create=c.auto_create_topic,
                              default_queue_nums=c.default_topic_queue_nums, cluster=c.cluster_name,
                              broker=c.broker_name, max_retry_groups=c.max_retry_groups,
                              trace_topic=c.trace_topic_enable,
                              per_host=not ha_roles.is_slave(c))     # a slave's follow its master's: no caps
        clients.on_new_retry_group = self._new_retry_group
        clients.on_stale_subscription = lambda group: self.metrics.child(self.metrics.stale_subscriptions, group).inc()
        self.lock_file = LockFile(os.path.join(store_dir, "config"), clients, self.metrics,
                                  max_live_ms=c.queue_lock_max_live_ms)
        self.lock_file.load()
        clients.call_later = loop.call_later
        clients.on_notice_merged = self.metrics.notices_merged.inc
        topics.retry_reclaimable = self._retry_topic_idle
        # aged: the wall clock and CLOCK_BOOTTIME read at the start, before a client can connect, what retention
        # and the metric snapshot task judge ages by (read when the snapshot task first ran, a step just after the
        # start, or before the supervisor restarted the task, was taken as the start's time: files were removed).
        ctx = self.ctx = BrokerContext(c, None, None, topics, clients, self.metrics, clock=self.clock,
                                       aged=aged_clock(self.clock))
        config_dir = os.path.join(store_dir, "config")
        perm = live_config.load(config_dir).get("brokerPermission", ctx.broker_permission)
        if perm != ctx.broker_permission:   # before any registration or request: routes carry it from the first
            ctx.broker_permission = perm
            log.warning("broker permission %s (%d), as updateBrokerConfig set it before this start (%s); "
                        "mqadmin updateBrokerConfig -k brokerPermission -v 6 makes it read-write again",
                        live_config.PERMISSIONS[perm], perm, live_config.path_in(config_dir))
        ctx.limits = Limits(c, self.metrics)
        if c.acl_file:
            ctx.acl = PlainAcl(c.acl_file)
        if (warning := exposure_warning(c)) is not None:
            log.warning("!" * 20 + " " + warning)
            print(f"WARNING: {warning}", file=sys.stderr, flush=True)

        broker_srv = await self._broker_listener(loop, c.port)
        ns_srv = None               # with --namesrv-addr the broker registers elsewhere and serves no routes
        if not c.namesrv_addrs:
            ns_srv = await loop.create_server(lambda: self._connection("namesrv", namesrv_table()), c.host,
                                              c.namesrv_port, start_serving=False, backlog=1024)
        vip_srv = None
        if c.vip_channel and c.port > 2:
            # the HA listener binds later: port - 2 taken first, a master given it as --ha-port failed to start
            if c.port - 2 == c.ha_port and c.broker_role != "SLAVE":
                log.warning("no VIP channel on port %d (the broker port - 2): it is this broker's --ha-port",
                            c.port - 2)
            else:
                vip_srv = await self._vip_listener(loop, c.port - 2)
        self._servers = [srv for srv in (broker_srv, ns_srv, vip_srv) if srv is not None]
        broker_port = broker_srv.sockets[0].getsockname()[1]
        ctx.set_address(c.public_host, broker_port)

        if c.queue_lock_max_live_ms < CLIENT_LOCK_TRUST_MS:
            log.warning("queue_lock_max_live_ms=%d is below the %d ms a stock orderly consumer trusts a queue lock it "
                        "was granted (rocketmq.client.rebalance.lockMaxLiveTime; renewed every 20 s): a lock lapses "
                        "here while its holder still consumes the queue, and another consumer of the group asking "
                        "then is granted it too: both consume it at once, out of order. Keep it at %d or more (60000, "
                        "RocketMQ's, by default)", c.queue_lock_max_live_ms, CLIENT_LOCK_TRUST_MS, CLIENT_LOCK_TRUST_MS)
        retention_ms = int(c.file_reserved_hours * 3_600_000)
        levels = DelayLevels(c.message_delay_level, c.timer_max_delay_s * 1000, retention_ms)
        if levels.timer_max_delay_ms < c.timer_max_delay_s * 1000:
            log.warning("timer messages are refused beyond %d s, the retention (file_reserved_hours=%g), not "
                        "timer_max_delay_s=%d: retention would remove a later one before its time",
                        levels.timer_max_delay_ms // 1000, c.file_reserved_hours, c.timer_max_delay_s)
        longer = [i + 1 for i, d in enumerate(levels.delays_ms) if d >= retention_ms]
        if longer:
            log.warning("delay levels %s wait at least the retention (file_reserved_hours=%g): their messages (and "
                        "retries sent back to them) may be removed before their time, counted in "
                        "txmq_schedule_dropped_total{reason=\"removed\"}", longer, c.file_reserved_hours)
        store = MessageStore(store_dir, StoreConfig(segment_size=c.segment_size, flush=c.flush,
                                                    cq_units_per_file=c.cq_units_per_file,
                                                    flush_interval_ms=c.flush_interval_ms,
                                                    max_message_size=c.max_message_size + 64 * 1024,
                                                    truncate_corrupt_tail=c.truncate_corrupt_tail,
                                                    keep_corrupt_records=c.keep_corrupt_records,
                                                    verify_all_reads=c.verify_all_reads,
                                                    disk_refuse_ratio=c.disk_refuse_ratio),
                             clock=self.clock, tag_rule=levels.consume_queue_tag)
        ctx.store = store
        store.set_flush_observer(self.metrics.flush_latency.observe)
        written = self.metrics.metadata_write       # (not self: one hook a process, it kept a stopped broker alive)
        observe_writes(lambda file, seconds: written.labels(file).observe(seconds))
        ctx.holds = PullHoldService(c.max_parked_pulls_per_host)
        ctx.tx = TransactionService(ctx)
        ctx.schedule = ScheduleService(ctx, levels)
        ctx.holds.attach(store)
        store.add_dispatch_listener(ctx.tx.on_dispatch, live=False)          # it keeps recovered commits only
        if not ha_roles.is_slave(c):     # a slave delivers nothing: its master does, and the copies replicate
            store.add_dispatch_listener(ctx.schedule.on_dispatch, topics=(SCHEDULE_TOPIC, TIMER_TOPIC))
        self.starting = "recovering the store"
        report = await store.open()
        log.info("store open: %s", report)
        if report.queues_rebuilt:
            self.metrics.queues_rebuilt.inc(len(report.queues_rebuilt))
        if report.truncations:
            self.metrics.tail_cuts.inc(len(report.truncations))
        if report.gone_segments:
            self.metrics.child(self.metrics.segments_removed, "gone").inc(len(report.gone_segments))
        if report.corrupt_kept:
            self.metrics.corrupt_kept.inc(len(report.corrupt_kept))
        ctx.ha = ha_roles.build(c, store, self._connect_master)
        slave = ha_roles.is_slave(c)
        if slave:
            store.add_dispatch_listener(ha_roles.topic_follower(topics))
        self.starting = "opening the message index"
        await self._open_index(ctx, store_dir)
        topics.adopt(store.queues())
        if derived and topics.queue_total + c.default_topic_queue_nums > c.max_queues:
            # Not a limit anyone set: at a small open-files limit (128 holds 48 queues) the system topics alone
            # (51) took it all, and every new topic was refused, with a warning to delete topics or raise a
            # --max-queues that was never given.
            log.error("%s", no_room_for_topics(topics.queue_total, c.max_queues, c.default_topic_queue_nums,
                                               resource.getrlimit(resource.RLIMIT_NOFILE)[0], _max_map_count()))
        elif topics.queue_total > c.max_queues:     # a store from before the limit, or a limit lowered since
            log.warning("the topics held have %d consume queues, past max_queues=%d: they are all served, but no "
                        "topic is created or given more queues until topics are deleted (or --max-queues is "
                        "raised, within the open-files limit and vm.max_map_count)", topics.queue_total, c.max_queues)
        if not slave:       # a slave's topics follow its master's (topic_follower)
            store.on_new_queue = topics.queue_appeared
        self.starting = "reading the consumer offsets"      # (and their first offsets' journal; then fitted)
        ctx.offsets = ConsumerOffsets(store_dir, persist_interval_s=c.flush_consumer_offset_interval_ms / 1000,
                                      per_host=not slave)   # a slave's are its master's copies: no caps
        # the groups deleted with their offsets kept, read back with them: a restart that forgot the deletes
        # brought the deleted groups' lag series (and alerts) back
        self.metrics.deleted_groups = ctx.offsets.deleted
        ctx.offsets.fit(store.max_offset)       # queues a cut log left shorter than what was committed
        if not slave and ctx.offsets.count() >= c.max_offsets:     # a store from before the limit, or one lowered
            log.warning("the consumer offsets held are %d, at or past max_offsets=%d: all are kept and moved, but "
                        "every new one (a new group's, a queue's first commit) is refused, its consumer told "
                        "nothing (its commits are oneway): delete groups no longer used or raise --max-offsets",
                        ctx.offsets.count(), c.max_offsets)
        await _maybe_await(getattr(ctx.offsets, "open", None))
        self.starting = "recovering transactions and the schedule"
        await ctx.tx.recover()
        await ctx.schedule.recover()
        self.starting = "starting to serve"
        ctx.retention = Retention(ctx)
        if not slave:       # a slave writes nothing of its own: no checks or deliveries
            clients.on_new_producer = ctx.tx.producer_joined
            clients.on_producer_left = ctx.tx.producer_left    # (dropped for silence, its connection open)
            ctx.tx.start()
            ctx.schedule.start()
        # A slave cleans its disk as its master does (RocketMQ's CleanCommitLogService runs on both): keeping
        # every segment, it reached the refuse ratio and took no more of its master's bytes.
        ctx.retention.start()
        self._install_metrics(ctx)

        topics.start_background(loop)
        self._loop = loop
        # Recovery loaded the big tables (undecided transactions, offsets): out of the full collections' walks
        # before the first request, and again each time they double (_gauge_loop).
        self.heap = HeapSettler(lambda: len(ctx.tx.core.pending) + ctx.offsets.count(),
                                on_settled=lambda _took: self.metrics.heap_settles.inc())
        self.heap.settle("start-up")
        self.heap.watch()
        self._refresh_gauges()
        self.metrics.sample_totals()        # the rates' first sample: nothing stored or pulled yet
        await broker_srv.start_serving()
        self.serving = True         # from here a signal stops the broker cleanly once its start ends
        if vip_srv is not None:
            await vip_srv.start_serving()
        if ns_srv is not None:
            await ns_srv.start_serving()
        ha_addr = await self._start_ha(ctx)
        spawn = self.supervisor.spawn
        spawn("txmq-housekeeping", self._housekeeping)
        spawn("txmq-queue-locks", self.lock_file.run)
        spawn("txmq-loop-lag", self.loop_lag.run)
        spawn("txmq-gauges", self._gauge_loop)
        if ctx.acl is not None:
            spawn("txmq-acl-reload", self._acl_reload)
        if c.metrics_snapshot_interval_s > 0:
            spawn("txmq-metric-snapshots", lambda: self._snapshots(store_dir))
        host = c.public_host
        self.addresses = {"broker": f"{host}:{broker_port}",
                          "namesrv": f"{host}:{ns_srv.sockets[0].getsockname()[1]}" if ns_srv is not None
                          else ";".join(c.namesrv_addrs),
                          "metrics": f"{host}:{self._metrics_port}" if self._metrics_httpd else "disabled"}
        if ha_addr:
            self.addresses["ha"] = ha_addr
        if c.namesrv_addrs:
            self.starting = "registering with the name server"
            await self._start_registration(host, broker_port)

    async def _start_registration(self, host: str, broker_port: int) -> None:
        """Register once before the ready line (so a client that reads it finds this broker in the routes
        when the name servers are up), then every period. The HA address is RocketMQ's default, the
        broker port + 1, unless an HA listener said otherwise (``self.addresses["ha"]``)."""
        ha = self.addresses.get("ha") or f"{host}:{broker_port + 1}"
        self.registrar = BrokerRegistrar(self.ctx, self.config.namesrv_addrs, ha_server_addr=ha,
                                         on_result=self.slave_sync.on_registered if self.slave_sync else None)
        accepted = await self.registrar.register_first()
        if not accepted:
            log.warning("no name server accepted the registration yet (%s); retrying every %d ms",
                        self.config.namesrv_addr, self.config.register_period_ms)

    async def _start_ha(self, ctx) -> str:
        """The master's HA listener (returns its address) or the slave's follower task (broker/ha)."""
        c = self.config
        if isinstance(ctx.ha, ha_roles.HASlave):
            self.slave_sync = SlaveSync(ctx.offsets, c.slave_sync_interval_ms / 1000,
                                        forget_after_s=c.slave_group_forget_ms / 1000)
            self.slave_sync.subscriptions = ctx.subscriptions       # the master's groups are copied too
            self.slave_sync.topics = ctx.topics                     # and its topics, deletes with them
            self.slave_sync.delete_topic = self._delete_followed_topic
            self.slave_sync.forget_groups = self.metrics.forget_consumer_groups     # with the offsets, as the master
            self.slave_sync.log_end = lambda: ctx.store.max_physical_offset
            self.slave_sync.master_end_learnt = ctx.ha.master_log_end_learnt    # the slave's lag gauge
            self.slave_sync.ha_master_addr = c.ha_master_addr                   # checked against the name server's
            self.slave_sync.following = lambda: ctx.ha.following
            ctx.retention.master_removed_to = self.slave_sync.removable_end    # removes what the master did
            if not c.namesrv_addrs:
                # Said at start: otherwise the first word of it came once the disk passed --disk-clean-ratio, the
                # next the ERRORs of pressure cleaning at --disk-force-clean-ratio, days later.
                log.warning("this slave has no --namesrv-addr: it cannot learn where its master's log starts "
                            "(GET_BROKER_RUNTIME_INFO from the master broker the name server names), so its "
                            "cleaner removes no expired segment: its disk fills to --disk-force-clean-ratio "
                            "(%.0f%%), where the oldest segments go with an ERROR each (undecided halves in them "
                            "lost to this slave promoted). Give it --namesrv-addr",
                            c.disk_force_clean_ratio * 100)
            self.supervisor.spawn("txmq-slave-sync", self.slave_sync.run)
            self.supervisor.spawn("txmq-ha-slave", ctx.ha.run)
            return ""
        if ctx.ha is None:
            return ""
        # Held to the client listeners' caps: each connection is a link the master streams its whole log to.
        gate = ConnectionGate(c.max_connections, c.max_connections_per_host, log, "ha listener")
        self._share_descriptors([*self.connections.values(), gate])

        async def serve(reader, writer):
            peer = _HAPeer(writer.get_extra_info("peername") or ("?", 0))
            why = gate.admit(peer)
            if why is not None:
                self.metrics.refused.labels(why).inc()
                writer.close()
                return
            try:
                await ctx.ha.serve(reader, writer)
            finally:
                gate.release(peer)
        srv = await asyncio.start_server(serve, c.host, c.ha_port)
        self._servers.append(srv)
        return f"{c.public_host}:{srv.sockets[0].getsockname()[1]}"

    async def _delete_followed_topic(self, topic: str, written_from: int | None = None) -> bool:
        """(Slave) a topic its master no longer has goes as DELETE_TOPIC_IN_BROKER took it there: config, consume
        queues (with the deleted-topic mark, so a restart does not index its records again) and offsets. False,
        nothing deleted, when its queues hold a record copied at or past ``written_from`` (the log's end when the
        master's table was asked for): made again on the master since, the table could not know it."""
        ctx = self.ctx
        def forget():   # with the queues, as the master's delete_topic_in_broker (not after: see there)
            ctx.topics.delete(topic)
            ctx.offsets.remove_topic(topic)
            self.metrics.forget_topic(topic)
        queues = await ctx.store.delete_topic(topic, forget, written_from=written_from)
        if queues < 0:
            return False
        log.warning("topic %s deleted: its master has it no more (%d consume queues removed)", topic, queues)
        return True

    async def _connect_master(self):
        """(Slave) open the connection to the master's HA port; broker/ha gets the streams."""
        host, _, port = self.config.ha_master_addr.rpartition(":")
        return await asyncio.open_connection(host, int(port))

    async def _open_index(self, ctx, store_dir: str) -> None:
        """The key index (QUERY_MESSAGE) and the subscription groups; both off the hot path."""
        c, store = self.config, ctx.store
        ctx.subscriptions = SubscriptionGroups(os.path.join(store_dir, "config"), self.clock)
        ctx.kv = KvConfig(os.path.join(store_dir, "config", KV_FILE_NAME))
        ctx.started_ms = self.clock()
        if not c.message_index_enable:
            return
        ctx.index = IndexService(store_dir, segment_size=c.segment_size, slots=c.index_hash_slots,
                                 entries=c.index_max_entries, period_ms=int(c.index_file_period_hours * 3_600_000),
                                 clock=self.clock, unindexed=(OP_TOPIC,),
                                 # Below the force-clean ratio too: past it retention removes the oldest segments
                                 # whatever their age, live messages lost for a table of derived data.
                                 refuse_ratio=min(c.disk_refuse_ratio, c.disk_force_clean_ratio))
        store.add_dispatch_listener(ctx.index.on_dispatch)
        store.add_removal_listener(ctx.index.expire)
        await ctx.index.open(store.min_physical_offset, store.max_physical_offset)

    def _install_metrics(self, ctx) -> None:
        m = self.metrics
        # The scrape runs on prometheus' thread: these read the snapshot _refresh_gauges builds on
        # the loop each second, never the live store or registries (a segment may be removed meanwhile).
        server = self

        class _Refresh:                 # registered before the gauges below: runs first in each scrape
            def describe(self):
                return []

            def collect(self):
                server._fresh_gauges()
                return []
        m.registry.register(_Refresh())
        snap = lambda key: lambda: self._gauges.get(key, [])  # noqa: E731
        m.add_gauge_collector("rocketmq_consumer_lag_messages",
                              "Messages not yet consumed that the store still holds, by group and topic (those "
                              "retention removed first: txmq_consumer_removed_unread_messages).",
                              ["consumer_group", "topic"], snap("lag"),
                              known=lambda labels: self._known_group(labels[0]))
        m.add_gauge_collector("txmq_consumer_removed_unread_messages",
                              "Messages retention removed before the group read them (from its offset to the queue's "
                              "minimum), by group and topic; gone when it pulls or is moved past them.",
                              ["consumer_group", "topic"], snap("removed_unread"),
                              known=lambda labels: self._known_group(labels[0]))
        m.add_gauge_collector("rocketmq_storage_size", "Commit-log bytes on disk.", [], snap("storage"))
        m.add_gauge_collector("rocketmq_producer_connections", "Live producer connections, by group.",
                              ["producer_group"], snap("producers"))
        m.add_gauge_collector("rocketmq_consumer_connections", "Live consumer connections, by group.",
                              ["consumer_group"], snap("consumers"))
        m.add_gauge_collector("txmq_half_message_oldest_age_seconds",
                              "Age of the oldest undecided half message, by producer group (absent: none).",
                              ["producer_group"], snap("oldest_half"), fold=max)
        m.describe_broker(self.config)
        m.add_gauge_collector("txmq_parked_pulls", "Pulls held by long polling.", [], snap("parked"))
        m.add_gauge_collector("txmq_unsent_response_bytes", "Response bytes all connections hold that their "
                              "peers have not read yet (as of each connection's last write; limit: "
                              "max_total_write_buffer).", [], snap("unsent"))
        m.add_gauge_collector("txmq_topics", "Topics the broker holds.", [], snap("topics"))
        m.add_gauge_collector("txmq_store_consume_queues_damaged", "Consume queues where a read met a zeroed unit "
                              "(units lost, their messages still in the commit log): pulls there get SYSTEM_ERROR "
                              "until a restart rebuilds them.", [], snap("damaged"))
        m.add_gauge_collector("txmq_schedule_messages_waiting", "Delayed messages not yet delivered, by level "
                              "(\"timer\" for timer messages).", ["level"], snap("schedule"))
        m.add_gauge_collector("txmq_topics_catalogue_write_hung", "1 while a topics.json write has run past "
                              "2 s without ending (a hung disk or a stopped network file system): sends to new "
                              "topics go on without waiting for it: if the broker stops before it ends, such a topic "
                              "without messages is lost, one with messages restored from the store with the queues "
                              "that hold them.", [], lambda: [((), 1 if ctx.topics.write_hung else 0)])
        m.add_gauge_collector("txmq_consumer_offsets_write_hung", "1 while a consumerOffset.json save's write (not "
                              "its encode) has run past 30 s without ending (a hung disk or a stopped network file "
                              "system): commits are held in memory only, admin offset moves are answered SYSTEM_ERROR, "
                              "a stop gives the last save up.", [],
                              lambda: [((), 1 if getattr(ctx.offsets, "write_hung", False) else 0)])
        m.add_gauge_collector("txmq_config_write_hung", "1 while a write of this config file has run past 2 s "
                              "without ending (a hung disk or a stopped network file system): its updates are "
                              "answered SYSTEM_ERROR \"not saved\" and held in memory, written once it ends "
                              "(queueLocks.json: locks granted meanwhile are not saved; delayOffset.json: no "
                              "scheduler snapshot is written until it ends; slaveMasterDelayOffset.json, on a slave: "
                              "its Java master's delay progress not copied until it ends).",
                              ["file"], lambda: [((os.path.basename(t.path),), 1 if t.write_hung else 0)
                                                 for t in (ctx.subscriptions, ctx.kv, self.lock_file, ctx.schedule,
                                                           self.slave_sync) if t is not None])
        m.add_gauge_collector("txmq_store_flush_in_flight_seconds", "How long the oldest commit-log flush (msync) in "
                              "flight has run, 0 with none: one that does not return (a hung disk, a stopped "
                              "network file system) holds every SYNC_FLUSH send unanswered.", [], snap("flush_age"))
        m.add_gauge_collector("txmq_store_io_stalled_seconds", "How long a no-op queued on the store's I/O thread "
                              "(flushes, checkpoints, the transaction snapshot, in order) has waited, 0 once it "
                              "came through: a write that hangs there holds every flush queued behind it.", [],
                              snap("io_stalled"))
        m.add_gauge_collector("txmq_index_stalled_seconds", "How long the job now running on the message index's "
                              "thread (indexing, a query by key, its periodic progress save) has run, 0 between "
                              "jobs: a write that hangs there holds every query by key (answered SYSTEM_ERROR "
                              "past 10 s) and the indexing (absent with the index off).", [], snap("index_stalled"))
        m.add_gauge_collector("txmq_index_failed", "1 when the message index stopped after a write error: "
                              "QUERY_MESSAGE misses messages stored since, until it catches up from the commit "
                              "log (by itself once a file-system error passes: a full disk, out of descriptors, "
                              "an I/O error, its files removed; after another error, at the next start).", [], snap("index_failed"))
        m.add_gauge_collector("txmq_index_behind_bytes", "Bytes of the commit log past what the message index has "
                              "indexed: large while it catches up (a start after the index was lost, rebuilt or "
                              "stopped long) or while it is stopped (txmq_index_failed); QUERY_MESSAGE does not search "
                              "them (its remark says so) (absent with the index off).", [], snap("index_behind"))
        m.add_counter_collector("txmq_index_queries_cut", "Queries by key (QUERY_MESSAGE) that stopped after "
                                "reading 4,096 records of the key's hash or 16,384 index entries, more left: keys "
                                "sharing its String.hashCode or index slot (made on purpose, or the key's own outside "
                                "the time range); older matches not "
                                "answered (absent with the index off).", snap("index_cut"))
        m.add_gauge_collector("txmq_transaction_decisions_waiting_for_disk",
                              "Transaction decisions whose decision-table file could not be made (a full disk): "
                              "answered from memory until it can.", [], snap("decisions_waiting"))
        m.add_disk_collector(ctx.store.disk)
        m.add_corrupt_collector(ctx.store)
        m.add_compaction_collector(ctx.tx.core)
        m.add_gauge_collector("txmq_ha_slave_lag_bytes", "Replication lag in bytes: on a master, its log end less "
                              "the furthest offset a slave acknowledged; on a slave, its master's log end (as last "
                              "learnt, every --slave-sync-interval-ms) less what is stored here (absent without "
                              "replication).", [], snap("ha_lag"))
        m.add_gauge_collector("txmq_ha_slave_connected", "On a master, slaves connected to its HA port; on a "
                              "slave, 1 while it follows its master (absent without replication).", [],
                              snap("ha_connected"))
        m.add_gauge_collector("txmq_ha_slave_diverged", "On a slave, 1 while its log has diverged from its "
                              "master's (it appends nothing; rebuild its store); absent elsewhere.", [],
                              snap("ha_diverged"))
        m.add_gauge_collector("txmq_ha_slave_cannot_catch_up", "On a slave, 1 while its master closes every session on "
                              "its first report and its log holds nothing to compare from instead: retention on the "
                              "master removed what it still had to copy (rebuild its store); absent elsewhere.", [],
                              snap("ha_cannot_catch_up"))
        m.add_gauge_collector("txmq_ha_slave_sync_age_seconds", "On a slave, seconds since it last copied its "
                              "master's consumer offsets, subscription groups and topic configs whole (since its "
                              "start while never): consumers failing over to it go on from offsets that old; "
                              "absent elsewhere.", [], snap("ha_sync_age"))
        m.add_gauge_collector("txmq_ha_slave_sync_interval_seconds", "On a slave, its --slave-sync-interval-ms in "
                              "seconds: how old txmq_ha_slave_sync_age_seconds gets between sound copies (the stale "
                              "alert's threshold follows it); absent elsewhere.", [], snap("ha_sync_interval"))
        m.add_gauge_collector("txmq_ha_slave_master_mismatch", "On a slave, 1 while its name server names a master "
                              "whose registered HA address is not the --ha-master-addr it follows: its log is one "
                              "broker's, its copied consumer offsets another's; absent elsewhere.", [],
                              snap("ha_master_mismatch"))
        m.add_counter_collector("txmq_ha_slave_sessions_behind_log_start", "On a master, slave sessions closed "
                                "because the slave was below this master's log start: retention removed what it "
                                "still had to copy; absent elsewhere.", snap("ha_behind"))
        m.add_folded_collector()
        self._metrics_port = None
        if self.config.metrics_port >= 0:
            httpd = start_metrics_server(self.config.metrics_port, self.config.host, m.registry, lambda: self._loop,
                                         m.process.refresh)
            self._metrics_httpd = httpd
            self._metrics_port = httpd.server_address[1]

    def _fresh_gauges(self) -> None:
        """Once per scrape: build a new snapshot (on the loop, where metrics_http renders a scrape), or from
        another thread ask the loop for one and wait up to 1 s for it (else the last one serves)."""
        if self._loop is None:
            return
        if _running_loop() is self._loop:       # (rendered on the loop: see metrics_http)
            self._refresh_gauges()
            return
        done = threading.Event()

        def build():
            try:
                self._refresh_gauges()
            finally:
                done.set()
        try:
            self._loop.call_soon_threadsafe(build)
        except RuntimeError:            # the loop is closed: the last snapshot will do
            return
        done.wait(1.0)

    def _refresh_gauges(self) -> None:
        ctx = self.ctx
        mono_ms = ctx.monotonic()
        counted = self._lag_counted()
        # (as consumer-progress: not a topic no online member of its group subscribes to, where its offset
        # stays and the lag grew with every message others sent there, an alert firing for good)
        if self._lag_totals is None:
            lags, removed = (_counted_rows(rows, counted) for rows in self._lag_by_group_topic())
        else:
            lags, removed = self._lag_totals        # counted in slices by _gauge_loop
        self._gauges = {
            "at": time.monotonic(),
            "lag": lags,
            "removed_unread": removed,      # rows only while there is a loss
            "storage": [((), ctx.store.storage_bytes())],
            "producers": [((g,), len(ctx.clients.producer_channels(g))) for g in list(ctx.clients.producers)],
            "consumers": [((g,), len(ctx.clients.consumer_ids(g))) for g in list(ctx.clients.consumers)],
            "parked": [((), ctx.holds.parked)],
            "unsent": [((), self.write_budget.total)],
            "topics": [((), len(ctx.topics.topics))],
            "damaged": [((), len(ctx.store.damaged_queues()))],
            "flush_age": [((), self._flush_age())],
            "io_stalled": [((), self._io_stalled())],
            "index_stalled": [((), self._index_stalled())] if ctx.index is not None else [],
            # (none on a slave: its delivery progress and undecided index are the ones it had at start-up,
            # never following its master's, so what they count as waiting, and for how long, only grows)
            "schedule": [] if ha_roles.is_slave(self.config) else
            [((level,), n) for level, n in ctx.schedule.waiting()],
            "oldest_half": [] if ha_roles.is_slave(self.config) else
            # by the check schedule's clock (monotonic): by the wall clock, a step back of an hour said 0 s for
            # that hour of a transaction stuck for days (its alert silent), a step forward aged a second-old one
            # by the step (a page for nothing)
            [((g,), max(0.0, (mono_ms - at) / 1000)) for g, at in ctx.tx.oldest_by_group().items()],
            "index_failed": [((), 1 if ctx.index is not None and ctx.index.stopped else 0)],
            "index_cut": [((), ctx.index.queries_cut)] if ctx.index is not None else [],
            "index_behind": [((), max(0, ctx.store.max_physical_offset - ctx.index.covered))]
            if ctx.index is not None else [],
            "decisions_waiting": [((), ctx.tx.table.waiting if ctx.tx.table is not None else 0)],
            **_ha_gauges(ctx.ha),
            "ha_sync_age": [] if self.slave_sync is None else [((), self.slave_sync.copy_age_s())],
            "ha_sync_interval": [] if self.slave_sync is None else [((), self.slave_sync.interval_s)],
            "ha_master_mismatch": [] if self.slave_sync is None else
            [((), int(self.slave_sync.ha_mismatch is not None))],
        }

    def _flush_age(self) -> float:
        """The oldest commit-log flush's age (the gauge), said once at ERROR past FLUSH_HUNG_S (every second, by
        the gauge loop) and once at WARNING when flushes return again."""
        return self._said_hung("_flush_hung", self.ctx.store.flush_age_s(),
                               "a commit-log flush (msync) has not returned in %.0f s (a hung disk or a stopped "
                               "network file system?): sends in SYNC_FLUSH are not answered, nothing after it is "
                               "acknowledged (txmq_store_flush_in_flight_seconds)",
                               "commit-log flushes return again")

    def _io_stalled(self) -> float:
        """How long a no-op has waited on the store's I/O thread (store.io_stalled_s: the gauge), said as
        ``_flush_age`` says a flush. A transaction snapshot write that hung there (each later flush queued behind
        it, every sync send unanswered once one came) showed on no gauge while no flush was in flight."""
        return self._said_hung("_io_hung", self.ctx.store.io_stalled_s(),
                               "the store's I/O thread (flushes, checkpoints, the transaction snapshot) has not come "
                               "through in %.0f s (a hung disk or a stopped network file system?): flushes queued "
                               "behind it do not start, nothing written after it is acknowledged "
                               "(txmq_store_io_stalled_seconds)",
                               "the store's I/O thread comes through again")

    def _index_stalled(self) -> float:
        """How long the message index's thread has been in one job (index.stalled_s: the gauge), said as
        ``_io_stalled`` says the store's. Its periodic progress save hung there (an msync of the newest index file,
        index/progress: a hung disk, a stopped NFS) held every query by key, unanswered, with nothing said; and
        with no send in flight no store gauge moved."""
        return self._said_hung("_index_hung", self.ctx.index.stalled_s(),
                               "the message index's thread (indexing, queries by key, its progress save) has not "
                               "come through in %.0f s (a hung disk or a stopped network file system?): queries by "
                               "key are answered SYSTEM_ERROR, nothing stored since is indexed until it does "
                               "(txmq_index_stalled_seconds)",
                               "the message index's thread comes through again")

    def _said_hung(self, flag: str, age: float, hung: str, again: str) -> float:
        """``age`` (s) of a store wait, said once at ERROR (``hung``) past ``_hung_after`` and once at WARNING
        (``again``, with how long it ran) when it is 0 again; ``flag`` the attribute that remembers which was said
        last. Past FLUSH_HUNG_S alone, a disk whose flushes each took 12 s was said hung at ERROR, and back, every
        12 s (300 ERRORs an hour), and nothing said the waits ended or how long they took: a slow disk, not a hung
        one. Twice the slowest flush of the last 5 minutes, as a stop judges it, says the first and any longer, and
        HUNG_SAID_BY_S any wait, as the alerts do.
        A sample younger than the one before is a new wait (the last ended): under steady sync sends the next flush
        starts as the last returns, no sample is 0, and a flush that hung after a slow one was never said."""
        if getattr(self, flag):
            peak = self._wait_peaks.get(flag, 0.0)
            if 0.0 < age < peak:        # the wait said ended, the next already in flight: said as ended
                self._said_hung(flag, 0.0, hung, again)
            else:
                self._wait_peaks[flag] = max(peak, age)
        if age > min(self._hung_after(), HUNG_SAID_BY_S) and not getattr(self, flag):
            setattr(self, flag, True)
            self._wait_peaks[flag] = age
            log.error(hung, age)
        elif age == 0.0 and getattr(self, flag):
            setattr(self, flag, False)
            log.warning("%s, after %.0f s or more: the disk is slow, not hung (txmq_store_flush_latency_seconds; "
                        "a wait is said again past twice the slowest flush of the last 5 minutes, 30 s at most)", again,
                        self._wait_peaks.pop(flag))
        return age

    async def _gauge_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            # Months of consumer groups: 200 groups x 160 queues is 32,000 offsets, and summing their lag in
            # one go held the loop 40-80 ms every second (and on every scrape), growing with the table. Above
            # a slice's worth it is summed here a slice at a time, and the gauges (and scrapes) use the last
            # sum: up to a second old. A small table is still summed fresh each time.
            offsets = self.ctx.offsets.items()
            # The rows are kept to those counted (_lag_counted) here too, a slice at a time: 150,000 made-up
            # groups' rows filtered in _refresh_gauges held the loop some 190 ms every second.
            self._lag_totals = (await self._lag_in_slices(offsets, self._lag_counted())
                                if len(offsets) > LAG_SLICE else None)
            self._refresh_gauges()
            self.metrics.sample_totals()
            for pause in self.heap.drain():
                self.metrics.gc_full_pause.observe(pause)
            self.heap.maybe_settle()

    async def _lag_in_slices(self, offsets: list, counted=None) -> tuple[list, list]:
        """(Lag, removed unread) rows (_lag_rows) by (group, topic) over ``offsets`` ((group, topic, qid), offset),
        only those ``counted(group, topic)`` says True of when given, yielding to the loop between slices of
        LAG_SLICE."""
        totals: tuple[dict, dict] = ({}, {})
        async for part in in_slices(offsets, LAG_SLICE):
            _add_lag(totals, part, self.ctx.store)
        rows = _lag_rows(totals)
        if counted is None:
            return rows
        kept: tuple[list, list] = ([], [])
        for have, keep in zip(rows, kept):
            async for part in in_slices(have, LAG_SLICE):
                keep += _counted_rows(part, counted)
        return kept

    async def _acl_reload(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(self.ctx.acl.reload_if_changed)

    def _new_retry_group(self, group: str, first: bool = True, conn=None) -> None:
        """A consumer group's heartbeat: its %RETRY% topic must exist. Checked on every heartbeat, as RocketMQ's
        heartBeat does: made only on a group's first one, a retry topic deleted later (admin delete-group
        --force, a topic deletion) stayed gone while the group's consumers ran on, and their failed messages
        could not be handed back. Said (and counted) on the first heartbeat only."""
        topic = RETRY_PREFIX + group
        if not first and topic in self.ctx.topics.topics:
            return                      # every later heartbeat: one dict lookup
        # The name comes from a heartbeat body: one the store cannot write (any length, any character) would
        # only sit in the catalogue and in every registration (1024 of 15 KB make a body past the frame limit).
        why = validate_topic(topic)
        if why is not None:
            if first:       # (at most every 10 s: made-up group names cost nothing, each was a line)
                self.ctx.limits.warn("retry-topic-name", f"consumer group {group[:200]!r}: no retry topic: {why[:200]}")
            return
        # The heartbeat's client makes it (max_topics_per_host): else one address heartbeating max_retry_groups
        # made-up groups, and staying, left every other host's new group with no retry topic.
        creator = peer_host(conn) if conn is not None else None
        if creator is not None and topic not in self.ctx.topics.topics:
            limit = self.ctx.config.max_topics_per_host
            if not self.ctx.topics.room_for(creator, limit):
                held = self.ctx.topics.created_by(creator)
                if first:
                    self.ctx.limits.refused("topic-host-limit", f"consumer group {group}: no retry topic: client "
                                            f"{creator} created {held} topics, its limit (max_topics_per_host={limit})")
                return
        queues = retry_queues(self.ctx.subscriptions, group)
        slave = ha_roles.is_slave(self.ctx.config)
        # A slave makes a missing one (as RocketMQ's heartBeat does: failed-over consumers pull it there) but never
        # grows one nor weighs queues: its queues are its master's, made by the records it copies (topic_follower),
        # and no heartbeat makes a file. Since it copies its master's groups (SlaveSync), a group's retryQueueNums
        # had every heartbeat on the slave grow the topic, charge the consumer's address, refuse it past the
        # slave's queue limits (counted, logged: no retry topic there at all) and sweep its %RETRY% topics.
        if not slave and self.ctx.limits.queue_room(self.ctx.topics, topic, queues, creator, count=first):
            return                      # made or grown past max_queues or max_queues_per_host: said on the first
        try:
            # grown too: a topic made with fewer queues before the group's retryQueueNums was raised, or by a
            # version that ignored it (the first heartbeat after an upgrade)
            (not slave and self.ctx.topics.grow(topic, queues, creator)) or self.ctx.topics.ensure(
                topic, queues, creator=creator)
        except TopicLimitError as exc:
            if first:       # (at most every 10 s: made-up group names cost nothing, each was a line)
                self.ctx.limits.refused("retry-group-limit", f"consumer group {group[:200]}: {exc}")
        else:
            if not first:
                log.info("consumer group %s: its retry topic %s was gone; made again", group, topic)

    def _retry_topic_idle(self, topic: str) -> bool:
        """A %RETRY% topic that may go at max_retry_groups: no consumer of its group is connected, the group has no
        config of its own (made by an operator), and no message was ever stored in it. A delayed retry still in
        SCHEDULE_TOPIC_XXXX is delivered to the store all the same, and the group's next heartbeat makes the
        topic again (a restart restores it from the store)."""
        ctx = self.ctx
        group = topic[len(RETRY_PREFIX):]
        if ctx.clients.consumer_ids(group) or group in ctx.subscriptions.groups:
            return False
        # Every queue it counts for: one made smaller (UPDATE_AND_CREATE_TOPIC) keeps its queues past its count
        # and what is in them; looked at up to its count only, it was forgotten with retries in them unread.
        queues = max(ctx.topics.topics[topic].queue_count, ctx.topics.queues_counted(topic)[0])
        return all(ctx.store.max_offset(topic, q) == 0 for q in range(queues))

    def _lag(self):
        store = self.ctx.store
        for (group, topic, qid), offset in self.ctx.offsets.items():
            yield group, topic, qid, _behind(store, topic, qid, offset)[0]

    def _lag_counted(self) -> Callable[[str, str], bool]:
        """fn(group, topic): is that lag counted (ClientRegistry.reads_elsewhere, asking topics_read once a group)?
        The gauge and the metric snapshots leave out what consumer-progress does.

        On a slave, only the groups with a consumer online there (failed over, or a stock client, which beats
        every broker of its topics): the others' offsets are its master's, copied every sync, and their members
        on the master, which leaves out the topics none of them reads. Counted here as a group nobody reads
        (every topic), a group moved off a topic had its old offset there show a lag the master did not, growing
        with every message copied: a lag alert on the slave alone, firing for good."""
        read: dict[str, frozenset | None] = {}
        clients = self.ctx.clients
        slave = ha_roles.is_slave(self.config)
        # A group deleted with its offsets kept: its lag goes with it until it comes again, looked at here, once
        # a group holding offsets (the sum's walk, in slices past LAG_SLICE): a walk of every deleted name at each
        # call held the loop some 40-55 ms every second with 100,000 such groups (one client's
        # max_offsets_per_host, each deleted without removeOffset), for as long as the broker ran. A name goes once
        # its group is known (a consumer connected, its config made again) or commits (metrics.group_in_use).
        deleted = self.metrics.deleted_groups

        def counted(group: str, topic: str) -> bool:
            if group not in read:
                if group in deleted and self._known_group(group):
                    deleted.discard(group)
                read[group] = frozenset() if (slave and not clients.online(group)) or group in deleted else \
                    clients.topics_read(group)
            return read[group] is None or topic in read[group]
        return counted

    def _lag_by_group_topic(self):
        totals: tuple[dict, dict] = ({}, {})
        _add_lag(totals, self.ctx.offsets.items(), self.ctx.store)
        return _lag_rows(totals)

    async def _broker_listener(self, loop, port: int):
        return await loop.create_server(lambda: self._connection("broker", broker_table()), self.config.host, port,
                                        start_serving=False, backlog=1024)

    async def _vip_listener(self, loop, port: int):
        """The broker port again on ``port`` (its port - 2), where a Java client before 4.5.1 sends by default
        (MixAll.brokerVIPChannel); None, said, when it cannot be had: the broker port serves every other client."""
        try:
            return await self._broker_listener(loop, port)
        except OSError as exc:
            log.warning("no VIP channel on port %d (the broker port - 2, where Java clients before 4.5.1 send unless "
                        "setVipChannelEnabled(false)): %s", port, exc)
            return None

    def _connection(self, listener: str, table: dict) -> RemotingConnection:
        c = self.config
        conns = self.connections[listener]
        gauge = self.metrics.connections.labels(listener)

        def opened(conn) -> bool:
            why = conns.admit(conn)
            if why is not None:
                self.metrics.refused.labels(why).inc()
                return False
            gauge.inc()
            return True

        def closed(conn) -> None:
            if not conns.release(conn):
                return          # refused on accept: it read nothing, so it is in no table (and costs no walk)
            gauge.dec()
            if listener == "broker" and self.ctx is not None:
                # Each step runs whatever the one before did: a step raising must not leave the connection in
                # the client tables (its per-host cap and rebalance share held by a dead connection).
                for step in (self._close_holds, self._close_checks, self._close_groups):
                    try:
                        step(conn)
                    except Exception:  # noqa: BLE001 - the other steps still run
                        log.exception("closing the connection from %s:%s: %s failed", conn.peer[0], conn.peer[1],
                                      step.__name__)

        guarded = True if listener == "broker" else NAMESRV_CHECKED
        return RemotingConnection(self._handler(table, guarded=guarded), max_frame_size=c.max_frame_size,
                                  max_in_flight=c.max_in_flight, max_write_buffer=c.max_write_buffer,
                                  on_open=opened, on_close=closed, budget=self.write_budget,
                                  read_budget=self.read_budget, on_reject=self.metrics.rejected_frames.inc,
                                  on_refuse=lambda reason: self.metrics.refused.labels(reason).inc())

    def _close_holds(self, conn) -> None:
        if self.ctx.holds is not None:
            self.ctx.holds.connection_closed(conn)

    def _close_checks(self, conn) -> None:
        if self.ctx.tx is not None:     # its unanswered checks go to a live producer now
            self.ctx.tx.connection_closed(conn)

    def _close_groups(self, conn) -> None:
        for group in self.ctx.clients.connection_closed(conn):
            self.ctx.clients.notify_ids_changed(group)

    def _handler(self, table: dict, guarded: bool | frozenset = False):
        """``guarded``: the ACL checks every request (True), those of these codes (the name-server port), none."""
        ctx = self.ctx
        checked = () if guarded is True or not guarded else guarded
        observe = self.metrics.observe_request
        perf = time.perf_counter
        create_task = asyncio.get_running_loop().create_task
        acl_refused = self.metrics.refused.labels("acl")

        def handle(conn, cmd):
            if (guarded is True or cmd.code in checked) and ctx.acl is not None:
                why = ctx.acl.check(cmd, conn.peer[0])
                if why is not None:
                    acl_refused.inc()
                    log.info("refused %s from %s:%s: %s", cmd.code, conn.peer[0], conn.peer[1], why)
                    return None if cmd.is_oneway else cmd.response(ResponseCode.NO_PERMISSION, why)
            fn = table.get(cmd.code)
            if fn is None:
                if cmd.is_oneway:
                    return None
                return cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED, f" request type {cmd.code} not supported")
            start = perf()
            try:
                result = fn(ctx, conn, cmd)
            except Exception as exc:    # the connection answers it with its error reply: counted with that code
                observe(cmd.code, _error_code(exc), perf() - start)
                raise
            if result is DEFERRED:                  # the handler answers, and observes, by itself
                return result
            if result is None or isinstance(result, RemotingCommand):
                observe(cmd.code, result.code if result is not None else 0, perf() - start)
                return result
            task = result if isinstance(result, asyncio.Future) else create_task(result)
            task.add_done_callback(lambda t, code=cmd.code: t.cancelled() or observe(code, _outcome(t), perf() - start))
            return task

        return handle

    # ------------------------------------------------------------ background
    async def _housekeeping(self) -> None:
        expire_ms = self.config.channel_expire_ms
        tick_s = min(10.0, expire_ms / 4000)
        ticks = math.ceil(expire_ms / 1000 / tick_s)
        while True:
            await asyncio.sleep(tick_s)
            for listener, conns in self.connections.items():
                closed = conns.close_quiet(ticks)
                if closed:
                    log.info("%s listener: closed %d connections whose peer sent nothing for %d ms "
                             "(channel_expire_ms), or read none of its responses for as long", listener, closed, expire_ms)
            for group in self.ctx.clients.expire(expire_ms):
                self.ctx.clients.notify_ids_changed(group)
            self.ctx.clients.expire_locks(self.config.queue_lock_max_live_ms)

    async def _snapshots(self, store_dir: str) -> None:
        keep = self.config.metrics_snapshot_retention_days
        pruned_day = None
        paused = False
        # Said once a failure run (a file system turned read-only failed both at every interval for ever)
        write_failing = prune_failing = False
        disk = self.ctx.store.disk
        while True:
            await asyncio.sleep(self.config.metrics_snapshot_interval_s)
            # Above disk_refuse_ratio the room left is the broker's own durable writes' (decisions, offsets,
            # config saves): a snapshot appended there ate it a line a minute. Paused, said once, counted.
            if disk.still_refusing():
                self.metrics.snapshots_paused.inc()
                if not paused:
                    paused = True
                    log.warning("metric snapshots paused: the store's disk is %s, at or above "
                                "disk_refuse_ratio %.0f%%; they resume below %.0f%%", disk.fullness(),
                                disk.refuse_ratio * 100, disk.resume_ratio * 100)
            else:
                if paused:
                    paused = False
                    log.warning("metric snapshots resumed: the store's disk is %s", disk.fullness())
                try:
                    await self.write_snapshot(store_dir)
                except OSError as exc:
                    log.log(logging.DEBUG if write_failing else logging.ERROR,
                            "metric snapshot not written: %s (said once until one is)", exc)
                    write_failing = True
                else:
                    if write_failing:
                        write_failing = False
                        log.warning("metric snapshots written again")
            # The files are named by the UTC date of the wall clock; which are old is judged by the time that passed
            # since the start as well. By the wall clock alone, a step days ahead (a VM's host, a bad NTP source)
            # removed every file before the future date, those the nightly rollup had yet to read with them. (A
            # step back, or a start with a clock behind, keeps files longer: never fewer.)
            now_ms = self.ctx.aged()
            day = now_ms // 86_400_000
            if keep > 0 and day != pruned_day:
                try:
                    for path in await asyncio.to_thread(prune_snapshots, store_dir, keep, now_ms):
                        log.info("metric snapshot file %s removed (older than metrics_snapshot_retention_days=%d)",
                                 path, keep)
                    pruned_day = day
                    prune_failing = False
                except OSError as exc:
                    log.log(logging.DEBUG if prune_failing else logging.ERROR,
                            "old metric snapshot files not removed: %s (tried again each interval, said once)", exc)
                    prune_failing = True

    async def write_snapshot(self, store_dir: str) -> str:
        # A row per consumer offset: built, encoded and appended in one go, 32,000 of them held the loop
        # 60-115 ms each minute. Built a slice at a time here; encoded (a slice a call, so the GIL passes
        # between them) and appended on a thread.
        offsets, store = self.ctx.offsets.items(), self.ctx.store
        lag = []
        counted = self._lag_counted()       # as the gauge (a topic no online member of the group reads: no row)
        async for part in in_slices(offsets, LAG_SLICE):
            lag += [{"group": g, "topic": t, "queue_id": q, "lag": _behind(store, t, q, n)[0]}
                    for (g, t, q), n in part if counted(g, t)]
        connections = sum(len(s) for s in self.connections.values())
        snapshot = self.metrics.snapshot(connections, lag)
        return await asyncio.to_thread(lambda: append_snapshot(store_dir, self.metrics.fold_snapshot(
            snapshot, self._known_group)))

    def _known_group(self, group: str) -> bool:
        """A consumer group the broker knows other than by a name a client wrote in an offset: one with a
        consumer connected, or one an operator created (its consumers may all be down: its lag matters most
        then). Named first where lag rows are capped (metrics._fold_past_limit). Read off the loop (scrape and
        snapshot threads): dict lookups only."""
        subs = self.ctx.subscriptions
        return group in self.ctx.clients.consumers or (subs is not None and group in subs.groups)

    # -------------------------------------------------------------- shutdown
    async def _offset_saves_answered(self, left: set, most_s: float = 120.0) -> None:
        """Requests still in flight after the grace that wait on an offsets save the stop hurried (a large table on
        a slow or loaded disk: 200,000 offsets took 14 s on a loaded host): that save is written before the store
        closes all the same, so they wait for it (at most ``most_s``) and are answered, not cut off unanswered with
        their moves made."""
        saves = getattr(self.ctx.offsets, "saving", None) if self.ctx is not None else None
        if not left or saves is None:
            return
        loop = asyncio.get_running_loop()
        until, waited = loop.time() + most_s, False
        while left and (step := saves()) is not None and loop.time() < until:
            waited = True
            try:
                _done, left = await asyncio.wait(list(left) + [step], timeout=until - loop.time(),
                                                 return_when=asyncio.FIRST_COMPLETED)
            finally:
                step.cancel()
            left.discard(step)
        if left and waited:     # answers of a save that just ended: a few loop turns to be written
            await asyncio.wait(left, timeout=1.0)

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stop_began = time.monotonic()
        if self.registrar is not None:      # out of the routes first: clients stop choosing this broker
            await self.registrar.stop()
        if self.slave_sync is not None:
            await self.slave_sync.close()
        for srv in self._servers:
            srv.close()
        for task in self._tasks:
            task.cancel()
        self.supervisor.cancel()
        if self.heap is not None:
            self.heap.close()
        ctx = self.ctx
        if ctx is not None and ctx.holds is not None:
            ctx.holds.wake_all()
        if ctx is not None and isinstance(ctx.ha, ha_roles.HAMaster):
            ctx.ha.close()
        if ctx is not None and getattr(ctx.offsets, "hurry", None) is not None:
            ctx.offsets.hurry()     # admin moves waiting for the next periodic save: answered within the grace
        pending = [t for conns in self.connections.values() for conn in conns for t in conn.in_flight]
        if pending:
            _done, left = await asyncio.wait(pending, timeout=grace_s)
            await self._offset_saves_answered(left)
        open_conns = [conn for conns in self.connections.values() for conn in conns]
        for conn in open_conns:
            conn.close()
        await end_plan_watchers(open_conns)
        if self.lock_file is not None:
            await self.lock_file.close()    # held again at the next start (queue_locks.py); bounded
        if ctx is not None:
            # In this order; one that fails is logged and the rest still stop: everything they save
            # is derived from the log or replayed from it, and the store must always be closed.
            for name, part, method in (("retention", ctx.retention, "stop"), ("scheduler", ctx.schedule, "stop"),
                                       ("transactions", ctx.tx, "stop"), ("store", ctx.store, "close"),
                                       ("index", ctx.index, "close")):
                await self._stop_part(name, part, method)
            # Then the config tables, at once: each its own file, each write bounded (2 s; the offsets' 30 s). One
            # after the other, a config directory that hung made the stop wait the sum of their bounds, near
            # systemd's and compose's 60 s before SIGKILL (ops/systemd/txmq.service; bench_hung_config_stop.py).
            await asyncio.gather(*(self._stop_part(name, part, "close") for name, part in (
                ("topics", ctx.topics), ("subscription groups", ctx.subscriptions), ("KV config", ctx.kv),
                ("offsets", ctx.offsets))))
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        if self.addresses:      # a start that failed has said so in its one line already
            log.info("stopped")

    async def _stop_part(self, name: str, part, method: str) -> None:
        if part is None or getattr(part, method, None) is None:
            return
        try:
            if name in _BEHIND_THE_LOG:
                await self._stop_behind_the_log(name, getattr(part, method))
            else:
                await _maybe_await(getattr(part, method))
        except Exception:  # noqa: BLE001 - see stop
            log.exception("stopping the %s failed; going on with the rest", name)

    async def _stop_behind_the_log(self, name: str, stop) -> None:
        """``stop()``, given up once a commit-log flush has been in flight past ``_hung_after`` (at once if it already
        has), or a no-op on the store's I/O thread has waited that long (a write there hangs: store.io_stalled_s).
        The transactions' last snapshot (store.run_io: after the flushes queued before it) and the store's
        close (the writer drains its flushes) waited for an msync that never returned (a hung disk, a stopped NFS)
        for ever: the process never ended after SIGTERM, and what stops after them -- the topics, the groups, the
        consumer offsets -- was never saved (a supervisor's SIGKILL then lost every commit since the last periodic
        save). Given up, the log is left as a kill -9 leaves it: nothing acknowledged is lost (a sync send is
        acknowledged once flushed; an async one's bytes are in the page cache, which outlives the process), and the
        next start recovers it from the checkpoint as after a crash; a send the flush holds was never answered.
        A slow disk is not a hung one: a flush no slower than this disk's flushes have been (returned) is waited for,
        all these parts together within STOP_BEHIND_THE_LOG_S of the first (under the service manager's 60 s)."""
        stopping = asyncio.ensure_future(_maybe_await(stop))
        store = self.ctx.store
        started = time.monotonic()
        if self._stop_began is None:    # (called without stop())
            self._stop_began = started
        while True:
            age = max(store.flush_age_s(), store.io_stalled_s()) if store is not None else 0.0
            hung_after = self._hung_after()
            waited = time.monotonic() - started
            # (the index's thread already seen held, its gauge past the bound: at once, not hung_after more)
            held = self.ctx.index.stalled_s() if name in _OWN_BOUND else 0.0
            own = max(waited, held) if name in _OWN_BOUND else 0.0
            if own > hung_after and age <= hung_after:
                stopping.add_done_callback(retrieved)
                log.error("stopping without closing the %s: %s (on its own thread, on the store's disk) has not "
                          "returned in %.0f s (a hung disk or a stopped network file system?); the next start "
                          "catches up from the commit log", name,
                          "a write its thread was already held by when the stop began" if held > waited + 1.0
                          else "its last save", own)
                return
            if age > hung_after:
                stopping.add_done_callback(retrieved)
                log.error("stopping without closing the %s: a commit-log flush (msync) or a write on the store's I/O "
                          "thread has not returned in %.0f s (a hung disk or a stopped network file system?); nothing "
                          "acknowledged is lost, the next start recovers the log as after a crash "
                          "(txmq_store_flush_in_flight_seconds, txmq_store_io_stalled_seconds)", name, age)
                return
            if time.monotonic() - self._stop_began > STOP_BEHIND_THE_LOG_S:
                stopping.add_done_callback(retrieved)
                slowest = store.slowest_flush_s()
                # (one in flight longer than any returned is not known to be only slow: not said so)
                disk = ("slow, not hung (its flushes return, the slowest in %.1f s)" % slowest if age <= slowest else
                        "slow or hung (a flush or a write on its I/O thread has run %.0f s, the slowest to return in "
                        "the last 5 minutes %.1f s)" % (age, slowest))
                log.error("stopping without closing the %s: the store's disk is %s, but the stop has run %.0f s, "
                          "all it may with the offsets' last save to come under 60 s; nothing acknowledged is lost, "
                          "the next start recovers the log as after a crash (txmq_store_flush_latency_seconds)",
                          name, disk, time.monotonic() - self._stop_began)
                return
            done, _ = await asyncio.wait({stopping}, timeout=1.0)
            if done:
                return stopping.result()

    def _hung_after(self) -> float:
        """How long a store wait runs before a stop says the disk hung: FLUSH_HUNG_S, or twice the slowest flush
        this disk has returned from (a flush that slow is one it makes, slowly: given up at 10 s, a slow disk's stop
        left the store unclosed, its last checkpoint unwritten, and said at ERROR that the disk hung)."""
        store = self.ctx.store
        return max(FLUSH_HUNG_S, 2 * store.slowest_flush_s()) if store is not None else FLUSH_HUNG_S


# The parts of a stop that wait for the commit log's flushes (server.stop: _stop_behind_the_log)
# The index too: its last progress save (an msync of its last file, index/progress) is on the store's disk, which
# a stopped NFS hangs with the commit log's flush -- given up at once then -- and bounded by itself (FLUSH_HUNG_S,
# _OWN_BOUND) when only it hangs. Waited for without a bound, the stop never ended, the offsets never saved.
_BEHIND_THE_LOG = frozenset(("transactions", "store", "index"))
_OWN_BOUND = frozenset(("index",))


def _error_code(exc: BaseException) -> int:
    """The code a handler's exception is answered with (RemotingConnection._reply_error)."""
    return exc.response_code if isinstance(exc, ProtocolError) else ResponseCode.SYSTEM_ERROR


def _outcome(task: asyncio.Future) -> int:
    """The code a handler's task was answered with: its reply's, 0 for none (a oneway request), its error's.
    (A cancelled one -- its connection closed, a parked pull released -- was answered nothing: not counted.)"""
    exc = task.exception()
    if exc is not None:
        return _error_code(exc)
    reply = task.result()
    return reply.code if reply is not None else 0


def _ha_gauges(ha) -> dict:
    if ha is None:
        return {}
    connected = int(ha.connected) if isinstance(ha, ha_roles.HASlave) else len(ha.links)
    out = {"ha_lag": [((), ha.slave_lag_bytes())], "ha_connected": [((), connected)]}
    if isinstance(ha, ha_roles.HASlave):
        out["ha_diverged"] = [((), int(ha.diverged is not None))]
        out["ha_cannot_catch_up"] = [((), int(ha.cannot_catch_up is not None))]
    else:
        out["ha_behind"] = [((), ha.behind_total)]
    return out


def exposure_warning(config: BrokerConfig) -> str | None:
    """What to shout when the broker listens beyond loopback with no access control, or with an HA port
    the access control does not cover."""
    host = config.host
    if host in ("localhost", "::1") or host.startswith("127."):
        return None
    if not config.acl_file:
        return (f"txmq broker bound to {host or 'all interfaces'} WITHOUT an ACL file: anyone who reaches the "
                f"port can send, create topics, decide transactions and delete data. Pass --acl-file plain_acl.yml.")
    if config.broker_role != "SLAVE" and config.ha_port >= 0:
        return (f"txmq broker bound to {host or 'all interfaces'} with an HA port the ACL does not cover (as in "
                "RocketMQ): anyone who reaches it is sent the whole commit log, every topic's messages, and a "
                "SYNC_MASTER counts its reports as a slave's. Let only the slaves reach the HA port.")
    return None


async def _maybe_await(fn):
    if fn is None:
        return None
    result = fn()
    if asyncio.iscoroutine(result):
        return await result
    return result


async def serve(config: BrokerConfig) -> int:
    daemon_default_executor()      # a write that hangs must not keep the process from ending (saved.py)
    server = BrokerServer(config)
    said = _ending_during_start(server, asyncio.get_running_loop())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, said)
    try:
        await server.start()
    except Exception as exc:  # noqa: BLE001 - start-up failures end the process with their reason
        print(f"txmq-broker: cannot start: {start_failure(exc, config.store_dir)}", file=sys.stderr, flush=True)
        try:        # release what was opened; its own troubles would only bury the one line above
            await server.stop(grace_s=0)
        except Exception:  # noqa: BLE001
            log.debug("cleanup after a failed start", exc_info=True)
        return 1
    stop = server.stopping
    loop = asyncio.get_running_loop()
    # Before the ready line: a supervisor may send SIGTERM as soon as it reads it, and that must be a clean stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    a = server.addresses
    ha = f" ha={a['ha']}" if "ha" in a else ""
    print(f"LISTENING broker={a['broker']} namesrv={a['namesrv']} metrics={a['metrics']}{ha}", flush=True)
    await stop.wait()
    if server.fatal:
        log.critical("stopping on a fatal error: %s", server.fatal)
        print(f"txmq-broker: fatal: {server.fatal}", file=sys.stderr, flush=True)
    else:
        log.info("signal received: stopping")
    await server.stop()
    return 1 if server.fatal else 0


def _ending_during_start(server: BrokerServer, loop: asyncio.AbstractEventLoop):
    """The handler of SIGTERM and SIGINT until the broker is ready: it says what was cut short, then ends the process
    by the signal as before. Unhandled, a supervisor's stop during a long recovery ended it without a word (exit -15,
    the log's last line the store's queues loaded): nobody knew the start had been stopped, not failed or hung, nor
    that the next one begins its recovery again. A Python handler, not the loop's: recovery runs on the loop's
    thread without a turn, and a loop handler would have held the stop until it ended (minutes for a big store).
    Ending at once is safe: the start answered nothing yet, or only what a crash (kill -9) would keep. Once its
    listeners serve (what is left is bounded: the first registration, register_timeout_ms) the broker stops cleanly
    instead, as after the ready line, once the start ends; a second signal then ends it at once. As PID 1 of a
    container the signal re-raised is dropped by the kernel: the handler then exits itself, 128 + the signal."""
    began = time.monotonic()

    def said(signum, _frame) -> None:
        if server.serving and not server.stopping.is_set():
            log.warning("%s during start-up (%s): the broker stops cleanly once its start ends",
                        signal.Signals(signum).name, server.starting)
            loop.call_soon_threadsafe(server.stopping.set)
            return
        signal.signal(signum, signal.SIG_DFL)
        log.warning("%s during start-up (%s, %.0f s in): ending now, as after a crash; nothing acknowledged is "
                    "lost, and the next start %s again. To stop a broker cleanly, wait for its LISTENING line",
                    signal.Signals(signum).name, server.starting, time.monotonic() - began,
                    "recovers the store" if server.starting == "recovering the store" else "runs its recovery")
        logging.shutdown()
        os.kill(os.getpid(), signum)
        # Still here: PID 1 of its namespace (a container's broker with no init before it), to which the kernel
        # drops a signal it sends itself while the action is the default. The status a shell gives that death.
        os._exit(128 + signum)
    return said


def start_failure(exc: BaseException, store_dir: str) -> str:
    """The one line a failed start prints: the reason, and for a full disk the store, its free space and
    what it needs."""
    text = str(exc) or type(exc).__name__
    cause = exc
    while cause is not None and not (isinstance(cause, OSError) and cause.errno == errno.ENOSPC):
        cause = cause.__cause__
    if cause is not None:
        disk = DiskMonitor(os.path.abspath(store_dir))
        text += (f" ({disk.describe()}; start-up needs room for its checkpoint, offsets and configuration "
                 f"files: free some space, or move the store)")
    elif _errno_in(exc, errno.EMFILE):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        text += (f" (this process may open {soft} files, at most {hard}: every commit-log segment and consume-queue "
                 "file of the store holds two descriptors while the broker runs; raise the limit: ulimit -n, "
                 "systemd LimitNOFILE)")
    return text.replace("\n", " ")


def _behind(store, topic: str, qid: int, offset: int) -> tuple[int, int]:
    """(lag, removed unread) of a consumer offset: the messages of the queue from it on that the store still holds,
    and those retention removed before it read them (from it up to the queue's minimum). Counted as lag, a group
    that stopped showed every message sent since, whether on disk or long gone: months of traffic, never read and
    never to be, its loss unsaid until it pulled again."""
    # (branches, not max(): run for every consumer offset each second, the builtin calls and a new pair per
    # offset summed made the lag sum 1.6-1.9x main's)
    low, high = store.queue_bounds(topic, qid)
    if offset >= low:
        return (high - offset if high > offset else 0), 0
    return high - low, low - offset


def _add_lag(totals: tuple[dict, dict], offsets, store) -> None:
    """Add each ((group, topic, qid), offset)'s lag and removed unread (_behind) to ``totals`` (lags, removed), two
    dicts of ints by (group, topic), the second holding only those with some. Not a pair or a list a (group,
    topic): a new pair an offset made the sum 1.6-1.9x main's, and lists (200,000 for as many made-up groups, held
    a second) were scanned by every collection of the garbage collector meanwhile; ints are not tracked."""
    lags, removed_by = totals
    for (group, topic, qid), offset in offsets:
        lag, removed = _behind(store, topic, qid, offset)
        key = (group, topic)
        lags[key] = lags.get(key, 0) + lag
        if removed:
            removed_by[key] = removed_by.get(key, 0) + removed


def _lag_rows(totals: tuple[dict, dict]) -> tuple[list, list]:
    """``_add_lag``'s totals as (lag rows, removed unread rows), each ((group, topic), n): the second only of those
    with some, as the gauge's."""
    return list(totals[0].items()), list(totals[1].items())


def _counted_rows(rows, counted) -> list:
    """The ((group, topic), n) ``rows`` ``counted(group, topic)`` says True of."""
    return [(k, n) for k, n in rows if counted(*k)]


def _errno_in(exc: BaseException | None, code: int) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == code:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one, as the JVM does for RocketMQ (MaxFDLimit); returns
    (soft, hard) as they are now. Every segment and consume-queue file stays mapped with two descriptors (our
    own and the one mmap keeps), so a store of months of small segments or thousands of queues needs
    thousands: at a distribution's default soft limit of 1024 the broker could not open such a store, or ran
    out later (a new segment, a new queue, a connection) while the hard limit allowed far more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:     # e.g. an infinite hard limit above the kernel's nr_open
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


# Descriptors and mappings a broker holds besides its consume queues: libraries, threads, segments, index files,
# connections (measured at rest: 20 descriptors, 293 mappings); a quarter of a limit under 4 times this.
_QUEUE_HEADROOM = 4096


def _max_map_count() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _headroom(limit: int) -> int:
    return min(_QUEUE_HEADROOM, limit // 4)


def queues_limits_hold(open_files: int, max_map_count: int | None) -> int | None:
    """How many consume queues, each a file mapped with two descriptors (measured), this process's limits hold
    besides the rest of the broker; None: no limit known (an infinite open-files limit, no max_map_count)."""
    held = []
    if open_files != resource.RLIM_INFINITY:
        held.append((open_files - _headroom(open_files)) // 2)
    if max_map_count is not None:
        held.append(max_map_count - _headroom(max_map_count))
    return max(1, min(held)) if held else None


# Descriptors kept for the rest of the broker (libraries, threads, segments, index files, files being written: 20
# at rest) when connections are counted against the open-files limit; never fewer connections than _MIN_CONNECTIONS.
_REST_FDS = 1024
_MIN_CONNECTIONS = 16


def connections_limits_hold(open_files: int, max_queues: int) -> int | None:
    """How many connections, every listener together, the open-files limit holds beside ``max_queues`` consume
    queues (two descriptors each) and the rest of the broker; None: no limit known. max_queues derived from the
    limit leaves its headroom (a quarter of a small limit): half of it is the connections'. Without it a broker at
    ulimit -n 256 took 236 idle connections, every descriptor, and refused 45 of 60 sends ("create mapped file
    failed ... lower --max-queues=96", which was no cause) until they left."""
    if open_files == resource.RLIM_INFINITY:
        return None
    rest = min(_REST_FDS, _headroom(open_files) // 2)
    return max(_MIN_CONNECTIONS, open_files - 2 * max_queues - rest)


# max_queues when the limits say nothing (non-Linux, unlimited): every topic (max_topics' default) of 1024 queues.
_QUEUES_UNBOUNDED = 2048 * 1024


def effective_max_queues(max_queues: int, open_files: int, max_map_count: int | None) -> tuple[int, str | None]:
    """(max_queues to apply, a warning or None). 0 (the default) is what the limits hold, never warned about: a
    fixed default warned on every start of a machine with a smaller open-files limit (20000 here, systemd's
    1024/524288, containers' 1048576) and refused queues a machine with larger limits could hold. A value set is
    kept, and warned about when the limits cannot hold it: past them a new queue's file fails to open or map
    (EMFILE, ENOMEM), refused by the send as "create mapped file failed"."""
    held = queues_limits_hold(open_files, max_map_count)
    if max_queues == 0:
        # never more than with no limit known: an open-files limit of 2**62 with no vm.max_map_count to read (not
        # Linux) made the default 2**61, a cap that caps nothing, said as such in every log and metric
        return (_QUEUES_UNBOUNDED if held is None else min(held, _QUEUES_UNBOUNDED)), None
    if held is None or max_queues <= held:
        return max_queues, None
    short = []
    if open_files != resource.RLIM_INFINITY and (open_files - _headroom(open_files)) // 2 < max_queues:
        short.append(f"the open-files limit {open_files} holds about {(open_files - _headroom(open_files)) // 2} "
                     f"(ulimit -n, systemd LimitNOFILE: {2 * max_queues + _QUEUE_HEADROOM} or more)")
    if max_map_count is not None and max_map_count - _headroom(max_map_count) < max_queues:
        short.append(f"vm.max_map_count={max_map_count} holds about {max_map_count - _headroom(max_map_count)} "
                     f"(sysctl vm.max_map_count={max_queues + _QUEUE_HEADROOM} or more)")
    return max_queues, (f"max_queues={max_queues} consume queues need two file descriptors and a mapping each, "
                        f"but {' and '.join(short)}: lower --max-queues to fit (or leave it unset: the limits "
                        f"decide), or raise the limits")


def no_room_for_topics(held: int, max_queues: int, one_topic: int, open_files: int,
                       max_map_count: int | None) -> str:
    """What start-up says when the max_queues it derived from the process's limits leaves no room for one more
    topic of the default size: every send to a new topic, every UPDATE_AND_CREATE_TOPIC, will be refused."""
    want = held + one_topic
    short = []
    if open_files != resource.RLIM_INFINITY and (open_files - _headroom(open_files)) // 2 < want:
        short.append(f"the open-files limit {open_files} (ulimit -n, systemd LimitNOFILE: raise it to "
                     f"{2 * want + _QUEUE_HEADROOM} or more)")
    if max_map_count is not None and max_map_count - _headroom(max_map_count) < want:
        short.append(f"vm.max_map_count={max_map_count} (sysctl vm.max_map_count={want + _QUEUE_HEADROOM} or more)")
    limits = " and ".join(short) or "the process's limits"
    room = max_queues - held
    # Only with no room at all is every new topic refused: with a little, a stock producer's auto-created topic
    # (4 queues, its defaultTopicQueueNums) or one made with fewer queues is made, and "every" was false.
    refused = ("every new topic and every topic given more queues will be refused NO_PERMISSION" if room <= 0 else
               f"a new topic, or more queues for one, past {room} more queues in all will be refused NO_PERMISSION "
               f"(a topic of the default {one_topic} queues is)")
    return (f"NO NEW TOPICS: {refused}: "
            f"the topics held (the system topics included) have {held} consume queues, and {limits} "
            f"hold only {max_queues} (max_queues, unset, is what the limits hold), not one more topic of "
            f"{one_topic} queues; raise the limit, or set --max-queues to accept the risk that a new queue's file "
            f"fails to open")


def run(config: BrokerConfig) -> int:
    logline.configure(config.log_level)
    import uvloop
    sys.setswitchinterval(config.gil_switch_interval_ms / 1000)
    soft, hard = raise_open_files_limit()
    log.info("open-files limit %d (hard %d)", soft, hard)
    return uvloop.run(serve(config))


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
