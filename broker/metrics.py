"""Prometheus metrics on a per-broker registry, and the minute snapshots the Spark rollups read.

Names follow RocketMQ 5's metrics where one exists (``rocketmq_messages_in_total``,
``rocketmq_rpc_latency``, ``rocketmq_half_messages``, ...); txmq-only ones start
with ``txmq_``. A per-broker registry (not the global one) lets tests run
several brokers in one process.

Snapshots: every ``metrics_snapshot_interval_s`` one JSON line is appended to
<store>/metrics/<UTC date>.jsonl:
``{"ts": ms, "connections": n, "consumer_lag": [{"group", "topic", "queue_id", "lag"}],
"requests": {"SEND_MESSAGE_V2": {"count": n, "p50_ms": x, "p99_ms": y}}}``
"""
from __future__ import annotations

import heapq
import json
import logging
import os
import random
import time
from bisect import bisect_left
from collections import deque
from datetime import date

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

import platform

from protocol import __version__
from protocol.codes import request_name

from .stats_windows import StatsWindows
from .store.reserve import stalled_write

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DECISION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 6 * 3600, 24 * 3600, 72 * 3600)
_RESERVOIR = 4096
OTHER = "_other"         # the label values of series past BrokerMetrics.max_series
SNAPSHOT_LAG = "snapshot_consumer_lag"      # the metric snapshots' consumer_lag rows, in txmq_metric_series_folded
_TPS_SLOT_S = 10        # consume TPS: messages pulled per (topic, group) in 10 s slots over the last minute
_TPS_SLOTS = 6
# RocketMQ's putTps and getTransferedTps (GET_BROKER_RUNTIME_INFO, read by mqadmin clusterList): messages per
# second over the last 10 s, minute and 10 minutes, from totals sampled once a second.
_STORE_TPS_SPANS_S = (10, 60, 600)
_random = random.random
log = logging.getLogger("txmq.metrics")


class LoopHistogram:
    """A histogram observed from the event loop's thread only, exported at scrape time.

    prometheus_client's Histogram takes a mutex for the sum and one for the bucket on every
    observation (0.55 us; 1.5 us with the label lookup): here an observation is a bisect and two
    additions on plain lists. The scrape, on the HTTP server's thread, copies the counts; the
    exposition is the same (``_bucket`` with ``le``, ``_count``, ``_sum``; no ``_created``).
    """

    def __init__(self, name: str, doc: str, labelnames: list[str], buckets, registry):
        self.name, self.doc, self.labelnames = name, doc, list(labelnames)
        self.bounds = [float(b) for b in buckets if b != float("inf")]
        self._children: dict[tuple, "_LoopHistogramChild"] = {}
        if not labelnames:
            self._default = self.labels()
        registry.register(self)

    def labels(self, *values) -> "_LoopHistogramChild":
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _LoopHistogramChild(self.bounds)
        return child

    def observe(self, seconds: float) -> None:
        self._default.observe(seconds)

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)]

    def collect(self):
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for key, child in list(self._children.items()):
            counts, total = list(child.counts), child.sum
            running, buckets = 0, []
            for le, n in zip(les, counts):
                running += n
                buckets.append((le, running))
            fam.add_metric(list(key), buckets, total)
        yield fam


class _LoopHistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)      # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


class BrokerMetrics:
    # Label sets one metric may have through child(): group names are the client's to choose, and a client
    # inventing one per request would otherwise add series (and cached children) for good. Past it, the label
    # sets that have not moved for ``idle_s`` give their places up; while none has, new ones are counted under
    # OTHER, so sums over a label stay exact.
    max_series = 10_000
    # A scrape-time gauge's label values (group names: up to 255 characters, an emoji 4 bytes) in the series it
    # names, at most this many bytes; the rest under OTHER as past max_series. By count alone, 10,000 made-up
    # groups of such names were 10 MB of every scrape, stored by Prometheus. 10,000 series of 100 bytes fit.
    max_series_bytes = 2 * 1024 * 1024
    idle_s = 3600.0
    # Consumer-lag rows (one a consumer offset) one metric snapshot line keeps: the largest lags, the rest summed
    # in one row (group and topic OTHER, queue -1). Offsets cost a client nothing up to max_offsets_per_host
    # (100,000 an address, and again for each address): made-up groups' offsets made each line 4 MB, 5.7 GB a
    # day kept for metrics_snapshot_retention_days on the store's disk. 200 groups of 160 queues are 32,000.
    max_snapshot_lag_rows = 50_000
    # ... and the bytes their group and topic names take in the line, at most this: a group name may be 255
    # characters, each a 12-byte JSON escape (an emoji), so 50,000 made-up rows were a 150 MB line each minute.
    # 32,000 rows of 60-byte names and topics are 3.5 MB with the rest of each row.
    max_snapshot_lag_bytes = 4 * 1024 * 1024

    def __init__(self):
        # ``*_created`` series (one per counter and histogram child) are noise nobody graphs; the
        # switch is process-wide, which suits a broker process (PROMETHEUS_DISABLE_CREATED_SERIES=True
        # does the same from the environment).
        disable_created_metrics()
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.process = _ProcessFamilies()
        r.register(self.process)
        # Stored messages are counted in plain ints and exported at scrape time: a prometheus
        # Counter takes a lock per increment, on the path every message takes.
        self._in: dict[str, list[int]] = {}
        r.register(_InCollector(self._in))
        self.put_total = 0                      # messages stored and pulled since start, never forgotten
        self.get_total = 0
        self._totals: deque[tuple[float, int, int]] = deque(maxlen=_STORE_TPS_SPANS_S[-1] + 1)
        # VIEW_BROKER_STATS_DATA's TOPIC_PUT_NUMS (from _in) and GROUP_GET_NUMS (from _got, (topic, group) ->
        # messages pulled since start, the pairs with a delivery series of their own) over a minute, an hour and a day
        self._got: dict[tuple[str, str], int] = {}
        # RocketMQ's BrokerStats: the put and get totals at the last two local midnights (0 before the first),
        # which mqadmin exportMetrics parses (Long.parseLong of a missing key: it failed for every broker)
        self.mornings = dict.fromkeys(("msgPutTotalYesterdayMorning", "msgPutTotalTodayMorning",
                                       "msgGetTotalYesterdayMorning", "msgGetTotalTodayMorning"), 0)
        self._morning_day = date.fromtimestamp(time.time()).toordinal()
        self.put_windows = StatsWindows(time.monotonic())
        self.get_windows = StatsWindows(time.monotonic())
        self.messages_out = Counter("rocketmq_messages_out", "Messages delivered by pulls.",
                                    ["topic", "consumer_group"], registry=r)
        self.bytes_out = Counter("rocketmq_throughput_out", "Record bytes delivered by pulls.",
                                 ["topic", "consumer_group"], registry=r)
        self.pulls_moved_past = Counter("txmq_pull_offset_moved_messages", "Messages a pull asked for that retention "
                                        "had removed: the consumer was moved past them to the queue's minimum "
                                        "(PULL_OFFSET_MOVED) unread.", ["topic", "consumer_group"], registry=r)
        for pairs in (self.messages_out, self.bytes_out, self.pulls_moved_past):     # up to max_series each
            pairs.collect_parts = _counter_parts(pairs)
        # Observed once or twice per request on the event loop: lock-free histograms (see LoopHistogram).
        self.rpc_latency = LoopHistogram("rocketmq_rpc_latency", "Request handling time in seconds.",
                                         ["request_code", "response_code"], _LATENCY_BUCKETS, r)
        self.append_latency = LoopHistogram("txmq_store_append_latency_seconds",
                                            "From a put entering the writer queue to its acknowledgement.",
                                            [], _LATENCY_BUCKETS, r)
        self.flush_latency = Histogram("txmq_store_flush_latency_seconds", "Duration of one commit-log flush.",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.metadata_write = Histogram("txmq_metadata_write_seconds", "Duration of one metadata write, synced: a "
                                        "config table (consumerOffset.json, topics.json, subscriptionGroup.json, ...), "
                                        "the store checkpoint, segments.json, the transactions' snapshot.json, "
                                        "the first offsets' journal, the index progress.",
                                        ["file"], buckets=_LATENCY_BUCKETS, registry=r)
        self.connections = Gauge("txmq_open_connections", "Open client connections.", ["listener"], registry=r)
        self.rejected_frames = Counter("txmq_rejected_frames", "Connections closed for malformed input.",
                                       registry=r)
        self.refused = Counter("txmq_requests_refused", "Requests refused by a guard, by reason "
                               "(acl, topic-limit, topic-host-limit, queue-limit, queue-host-limit, queue-file-failed, topic-rate, offset-limit, offset-host-limit, busy, undecided-limit, undecided-total-limit, retry-group-limit, subscription-group-limit, queue-lock-limit, "
                               "max_connections, max_connections_per_host, open-files, max_total_read_buffer, unfinished-frame, group-limit, subscription-limit, subscription-host-limit, heartbeat-size, parked-pull-limit, "
                               "producer-group-mismatch, end-not-its-half, end-no-half, end-half-removed, end-bad-state, transaction-type-without-half, "
                               "send-back-unconsumable, batch-messages, header-size, tag-expression, forwarding, broker-consume-stats).",
                               ["reason"], registry=r)
        self.offset_moves_deferred = Counter(
            "txmq_offset_moves_deferred", "Offset moves by a client that is no consumer of the group (an admin "
            "tool's UPDATE_CONSUMER_OFFSET), resets (INVOKE_BROKER_TO_RESET_OFFSET) and removals (DELETE_SUBSCRIPTIONGROUP "
            "with removeOffset) and topic deletions (DELETE_TOPIC_IN_BROKER) whose save waited for the offsets saver's rest (3 times its last save, after a save "
            "in flight ended; a reset or removal at most 1 s of it): on disk before SUCCESS all the same; saves moves "
            "start keep the saver at most a quarter busy.", registry=r)
        self.unread_closes = Counter("txmq_unread_closes", "Connections closed for holding unread responses, by "
                                     "limit (max_write_buffer: this one's; max_total_write_buffer: all "
                                     "connections' together, the largest holders closed first; channel_expire_ms: "
                                     "its peer read none of them for that long).", ["reason"],
                                     registry=r)
        self.queue_lock_saves_failed = Counter("txmq_queue_lock_saves_failed", "Saves of the queue lock file "
                                               "(config/queueLocks.json) the disk refused: retried every second; a "
                                               "restart meanwhile forgets the locks granted since.", registry=r)
        self.notices_merged = Counter("txmq_consumer_notices_merged", "Consumer-group changes told to its "
                                      "consumers with the one NOTIFY_CONSUMER_IDS_CHANGED at the end of a 0.5 s "
                                      "gap after the last (each notice starts a rebalance in every consumer).",
                                      registry=r)
        self.loop_lag = Gauge("txmq_event_loop_lag_seconds", "Worst event-loop lag seen over the last second.",
                              registry=r)
        self.loop_lag_worst = Gauge("txmq_event_loop_lag_max_seconds", "Worst event-loop lag since start.",
                                    registry=r)
        self.task_crashes = Counter("txmq_background_task_crashes", "Background tasks that raised, by task.",
                                    ["task"], registry=r)
        # transactions
        self.half_messages = Gauge("rocketmq_half_messages", "Undecided half messages.", registry=r)
        self.half_in = Counter("txmq_half_messages", "Half messages stored, by producer group.",
                               ["producer_group"], registry=r)
        self.commits = Counter("rocketmq_commit_messages", "Transactions committed, by producer group.",
                               ["producer_group"], registry=r)
        self.rollbacks = Counter("rocketmq_rollback_messages", "Transactions rolled back, by producer group.",
                                 ["producer_group"], registry=r)
        self.unknowns = Counter("txmq_unknown_decisions", "END_TRANSACTION with UNKNOWN, by producer group.",
                                ["producer_group"], registry=r)
        self.conflicts = Counter("txmq_conflicting_decisions",
                                 "Decisions refused because another was recorded first.", ["producer_group"],
                                 registry=r)
        self.commits_after_dead = Counter("txmq_transaction_commits_after_dead_letter",
                                          "COMMITs refused because the transaction was dead-lettered first: its "
                                          "producer committed, its message is on the dead-letter topic until an "
                                          "operator resumes it.", ["producer_group"], registry=r)
        self.duplicates = Counter("txmq_duplicate_decisions", "Repeated identical decisions acknowledged.",
                                  ["producer_group"], registry=r)
        self.checks_sent = Counter("txmq_transaction_checks", "CHECK_TRANSACTION_STATE sent.", ["producer_group"],
                                   registry=r)
        self.check_answers = Counter("txmq_transaction_check_answers", "Answers to checks, by result.",
                                     ["producer_group", "result"], registry=r)
        self.checks_lost = Counter("txmq_transaction_checks_lost",
                                   "Checks whose connection closed (or whose producer unregistered its group on it) "
                                   "before they were answered: asked again of a "
                                   "live producer at once (each still counts against transaction_check_max; a "
                                   "re-ask lost so in turn is not counted: it waits its schedule).",
                                   ["producer_group"], registry=r)
        self.checks_rerouted = Counter("txmq_transaction_checks_rerouted",
                                       "Checks sent to another producer of the group than the half's sender, by why "
                                       "(sender-busy: at its in-flight cap; sender-unanswered: its last check went "
                                       "unanswered; sender-silent: a check of another of its transactions went "
                                       "unanswered, none answered since; sender-gone: not connected; sender-left: unregistered the "
                                       "group; sender-unknown: not known, e.g. a half stored just before a crash).",
                                       ["producer_group", "reason"], registry=r)
        self.producers_silent = Counter("txmq_transaction_producers_silent",
                                        "Times a producer connection left a transaction check unanswered (it came "
                                        "due again) after answering the ones before: it is asked only when no other "
                                        "producer of the group has room, until it answers. The log names its client "
                                        "id and address.", ["producer_group"], registry=r)
        self.checks_skipped = Counter("txmq_transaction_checks_deferred",
                                      "Checks not sent because no producer of the group was connected.",
                                      ["producer_group"], registry=r)
        self.stale_subscriptions = Counter("txmq_subscriptions_kept_older", "Heartbeats whose changed "
                                           "subscription was kept out: its subVersion (the client's wall clock when it "
                                           "subscribed) older than the one kept, by consumer group.",
                                           ["consumer_group"], registry=r)
        self.dead_letters = Counter("txmq_transaction_dead_letters", "Transactions dead-lettered, by reason.",
                                    ["producer_group", "reason"], registry=r)
        self.transactions_lost = Counter("txmq_transactions_lost", "Undecided transactions whose half message the "
                                         "log lost without a decision or dead letter, by reason (segment-removed: "
                                         "by a slave's cleaner, then promoted before its master dead-lettered them).",
                                         ["reason"], registry=r)
        self.segments_removed = Counter("txmq_store_segments_removed_total",
                                        "Commit-log segments removed, by reason (expired, plan, pressure; gone: found "
                                        "missing at start-up, a removal a crash cut short or a hand's).",
                                        ["reason"], registry=r)
        self.segment_removals_failed = Counter(
            "txmq_store_segment_removals_failed_total", "Commit-log segment removals (by retention) that failed on a "
            "file the file system would not unlink, by what (segment: the segment is kept and readable, tried again "
            "each pass; queue-file: the segment went, a consume-queue file of it stayed, tried again at the next removal and start) and "
            "errno (EACCES, EPERM, EIO, ...). Said once per failure run at ERROR.", ["what", "errno"], registry=r)
        self.tail_cuts = Counter("txmq_store_tail_truncations_total",
                                 "Commit-log cuts made at start-up: a torn tail (a record a crash left incomplete: "
                                 "failing its body CRC, or its topic or properties zero-filled), or with "
                                 "truncate_corrupt_tail, damage. Each is logged with segment, byte and reason.",
                                 registry=r)
        self.corrupt_kept = Counter("txmq_store_corrupt_records_kept_total",
                                    "Damaged commit-log records found mid-log at start-up and kept in place, the log "
                                    "after them served (keep_corrupt_records, or remembered from a start with it): "
                                    "each is a lost message, logged at ERROR with topic, queue and offset.",
                                    registry=r)
        self.queues_rebuilt = Counter("txmq_store_consume_queues_rebuilt_total",
                                      "Consume queues found damaged at start-up (zeroed, cut or missing units, "
                                      "consumequeue/ removed) and rebuilt from the commit log.", registry=r)
        self.gc_full_pause = Histogram("txmq_gc_full_collection_seconds",
                                       "Pauses of the garbage collector's full (generation 2) passes: the event loop "
                                       "and every request wait them out (see broker/heap.py).",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.heap_settles = Counter("txmq_heap_settles_total",
                                    "Times the heap was settled (collected, then frozen out of the full passes): at "
                                    "start-up and each time the big tables doubled.", registry=r)
        self.snapshots_paused = Counter("txmq_metric_snapshots_paused",
                                        "Metric snapshots not written because the store's disk was over "
                                        "disk_refuse_ratio (the room left is for the broker's own writes).",
                                        registry=r)
        # scheduled messages (broker/schedule); the waiting gauge is collected from the server's snapshot
        self.schedule_delivered = Counter("txmq_schedule_delivered", "Delayed and timer messages delivered to "
                                          "their real topic, by level (\"timer\" for timer messages).", ["level"],
                                          registry=r)
        self.schedule_dropped = Counter("txmq_schedule_dropped", "Scheduled messages passed over because they "
                                        "cannot be delivered (each logged), by reason: removed (by retention "
                                        "before delivery), undecodable (a damaged record), corrupt (its body fails its CRC), no_destination.",
                                        ["reason"], registry=r)
        self.requeued = Counter("txmq_requeued", "Delayed, timer and retry messages that fell due, and transactional "
                                "messages committed, for a queue their topic no longer reads (its queues cut while "
                                "they waited), written to one it reads (their queue id mod its read queues), by "
                                "topic.", ["topic"], registry=r)
        self.schedule_delivered_late = Counter("txmq_schedule_delivered_late", "Scheduled messages delivered "
                                               "more than 1 s after they were due.", registry=r)
        self.finish_latency = Histogram("rocketmq_finish_message_latency",
                                        "Seconds from half message to decision.", ["producer_group"],
                                        buckets=_DECISION_BUCKETS, registry=r)
        self._samples: dict[str, list[float]] = {}
        self._counts: dict[str, int] = {}
        self._rpc_children: dict[tuple[int, int], object] = {}
        self._names: dict[int, str] = {}
        self._children: dict[tuple, object] = {}
        # label value -> the child() keys holding it, and ("pulled", pair) for the rates' pairs: a deleted topic's or
        # group's series found without a walk of every family's series (each topic or group delete walked them
        # all, on the loop: 24 ms a delete with 10,000 gone groups' series, each delete slower than the last)
        self._keys_of: dict[str, set[tuple]] = {}
        self._pulled: dict[tuple[str, str], dict[int, int]] = {}     # (topic, group) -> {slot: messages}
        self._pulled_swept = -1                                        # the slot of the last sweep of _pulled
        self._made: dict[int, int] = {}                                # id(metric) -> label sets made by child()
        self._marks: dict[int, tuple[float, dict]] = {}    # id(metric) at its limit -> (when, {labels: reading})
        self._folded: dict[str, int] = {}       # scrape-time gauge -> its rows under OTHER at its last collect
        # Consumer groups deleted (DELETE_SUBSCRIPTIONGROUP) whose offsets were kept (no removeOffset): their lag is
        # left out of the gauges and snapshots until the group is known again (a consumer, its config made
        # again: Server._lag_counted drops the name) or an offset of it is committed (group_in_use). A name
        # holding no offset is not kept (delete_subscription_group).
        self.deleted_groups: set[str] = set()
        self.monotonic = time.monotonic

    def child(self, metric, *labels):
        """``metric.labels(*labels)``, cached: labels() takes a lock and builds a tuple per call. Past
        ``max_series`` label sets of ``metric``, its child with OTHER in every label."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            made = self._made.get(id(metric), 0)
            if made >= self.max_series:
                if not self._evict_idle(metric):
                    return self._other(metric, len(labels))
                made = self._made[id(metric)]
            self._made[id(metric)] = made + 1
            found = self._children[key] = metric.labels(*labels)
            self._index(key, labels)
        return found

    def _index(self, key: tuple, labels: tuple) -> None:
        for value in labels:
            self._keys_of.setdefault(value, set()).add(key)

    def _unindex(self, key: tuple, labels: tuple) -> None:
        for value in labels:
            keys = self._keys_of.get(value)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._keys_of[value]

    def _evict_idle(self, metric) -> bool:
        """At ``metric``'s limit: remove its label sets whose value has not changed for ``idle_s`` (a group that
        is gone: a producer group named after its host, made anew by each deployment); True if that made room.
        Values are read when the limit is reached and compared ``idle_s`` later, so a call costs O(1) in between.
        Kept, the first ``max_series`` names ever seen held every place for good, and after months of such
        churn every new group's transactions and deliveries were counted under OTHER, unseen."""
        mid, now = id(metric), self.monotonic()
        marked = self._marks.get(mid)
        if marked is not None and now - marked[0] < self.idle_s:
            return False
        mine = [(key[1], child) for key, child in self._children.items()
                if key[0] == mid and key[1] != (OTHER,) * len(key[1])]
        before = marked[1] if marked is not None else {}
        idle = {labels for labels, child in mine if before.get(labels) == _reading(child)}
        for labels in idle:
            del self._children[(mid, labels)]
            self._unindex((mid, labels), labels)
            metric.remove(*labels)
        if metric is self.messages_out:     # their GROUP_GET_NUMS go with them (pairs unchanged for idle_s)
            gone = [labels for labels in idle if self._got.pop(labels, None) is not None]
            self.get_windows.forget(gone)
        self._made[mid] -= len(idle)
        if idle:
            log.info("%s: %d label sets unchanged for %.0f s removed to make room", metric._name, len(idle),
                     self.idle_s)
        self._marks[mid] = (now, {labels: _reading(child) for labels, child in mine if labels not in idle})
        return self._made[mid] < self.max_series

    def _other(self, metric, n: int):
        key = (id(metric), (OTHER,) * n)
        found = self._children.get(key)
        if found is None:
            log.warning("%s has %d label sets: new ones are counted under %s (names a client makes up?)",
                        metric._name, self.max_series, OTHER)
            found = self._children[key] = metric.labels(*key[1])
        return found

    def forget_topic(self, topic: str) -> None:
        """Drop the series and rates of a deleted topic (DELETE_TOPIC_IN_BROKER), as RocketMQ's broker stats do
        with autoDeleteUnusedStats: kept, every topic ever deleted stayed in each scrape and in memory, and a
        topic made again under its name went on from the old counts."""
        if self._in.pop(topic, None) is not None:
            self.put_windows.forget((topic,))
        self._forget_out((topic,), lambda labels: labels[0] == topic)
        self._forget_series((self.requeued,), (topic,), lambda labels: labels[0] == topic)

    def forget_consumer_group(self, group: str) -> None:
        """Drop the delivery series and rates of a deleted consumer group (DELETE_SUBSCRIPTIONGROUP)."""
        self.forget_consumer_groups({group})

    def forget_consumer_groups(self, groups: set[str]) -> None:
        """forget_consumer_group of each, in one walk of the series (a slave forgets its master's deleted groups
        together: SlaveSync)."""
        self._forget_out(groups, lambda labels: labels[1] in groups)
        self.deleted_groups |= groups
        # labels (consumer group) alone: kept, a deleted group's count stayed in every scrape, and went on from it
        # when a group of its name came again
        self._forget_series((self.stale_subscriptions,), groups, lambda labels: labels[0] in groups)

    def group_in_use(self, group: str) -> None:
        """An offset of ``group`` committed (by its client, a pull's commit, a reset or clone): a group deleted with
        its offsets kept is in use again, its lag counted from the next scrape. Left out until a consumer connected
        or updateSubGroup made it again, a client that only commits (no heartbeat, as before the delete, when its
        lag was exported) had its lag hidden for as long as the broker ran."""
        if self.deleted_groups:
            self.deleted_groups.discard(group)

    def _forget_out(self, names, match) -> None:
        # labels (topic, consumer group)
        gone = self._forget_series((self.messages_out, self.bytes_out, self.pulls_moved_past), names, match)
        for key in self._keyed(names, ("pulled",), match):
            del self._pulled[key[1]]
            self._unindex(key, key[1])
        # (a pair's GROUP_GET_NUMS is kept only with its messages_out series: count_out, _evict_idle)
        gone = [key[1] for key in gone if key[0] == id(self.messages_out) and self._got.pop(key[1], None) is not None]
        self.get_windows.forget(gone)

    def _keyed(self, names, ids, match) -> set[tuple]:
        """The indexed keys of ``ids`` holding one of ``names`` whose labels ``match`` (O(their keys))."""
        keys_of = self._keys_of
        return {key for name in names for key in keys_of.get(name, ()) if key[0] in ids and match(key[1])}

    def _forget_series(self, metrics, names, match) -> set[tuple]:
        """Remove the child() series of ``metrics`` labelled with one of ``names`` whose labels ``match`` (never
        the OTHER one: not indexed); their keys."""
        by_id = {id(metric): metric for metric in metrics}
        gone = self._keyed(names, by_id, match)
        for key in gone:
            mid, labels = key
            del self._children[key]
            self._unindex(key, labels)
            self._made[mid] -= 1
            by_id[mid].remove(*labels)
            marked = self._marks.get(mid)
            if marked is not None:      # its last reading must not judge a series made again under the name
                marked[1].pop(labels, None)
        return gone

    def count_in(self, topic: str, messages: int, body_bytes: int) -> None:
        counts = self._in.get(topic)
        if counts is None:
            counts = self._in[topic] = [0, 0]
        counts[0] += messages
        counts[1] += body_bytes
        self.put_total += messages

    def count_out(self, topic: str, group: str, messages: int, nbytes: int, now: float | None = None) -> None:
        """Messages delivered by a pull: the counters, and the slots consume_tps reads."""
        series = self.child(self.messages_out, topic, group)
        series.inc(messages)
        self.child(self.bytes_out, topic, group).inc(nbytes)
        self.get_total += messages
        # GROUP_GET_NUMS: kept for the pairs with a series of their own, and given up with it (_evict_idle).
        # Kept apart, the first max_series pairs ever seen held every place for good.
        got = self._got.get((topic, group))
        if got is not None or series is not self._children.get((id(self.messages_out), (OTHER, OTHER))):
            self._got[(topic, group)] = (got or 0) + messages
        slot = int((time.monotonic() if now is None else now) // _TPS_SLOT_S)
        slots = self._pulled.get((topic, group))
        if slots is None:
            if len(self._pulled) >= self.max_series and not self._room_for_rate(slot):
                return                                  # (no rate for pairs past it, as for their series)
            slots = self._pulled[(topic, group)] = {}
            self._index(("pulled", (topic, group)), (topic, group))
        slots[slot] = slots.get(slot, 0) + messages
        if len(slots) > _TPS_SLOTS:
            for old in [s for s in slots if s <= slot - _TPS_SLOTS]:
                del slots[old]

    def _room_for_rate(self, slot: int) -> bool:
        """Forget the pairs that pulled nothing over the last minute (their rate is 0 either way), at most once
        a slot; True if that made room. Kept, the first ``max_series`` (topic, group) pairs ever seen held
        every place, and each group that came after them read a rate of 0 however fast it consumed."""
        if self._pulled_swept == slot:
            return False
        self._pulled_swept = slot
        stale = slot - _TPS_SLOTS          # consume_tps counts only the slots after this one
        for pair in [p for p, slots in self._pulled.items() if max(slots) <= stale]:
            del self._pulled[pair]
            self._unindex(("pulled", pair), pair)
        return len(self._pulled) < self.max_series

    def consume_tps(self, group: str, topic: str, now: float | None = None) -> float:
        """Messages of ``topic`` pulled by ``group`` per second over the last minute (RocketMQ's consumeTps):
        the five slots before the current one and the current one so far."""
        now = time.monotonic() if now is None else now
        first = int(now // _TPS_SLOT_S) - _TPS_SLOTS + 1
        slots = self._pulled.get((topic, group), {})
        return sum(n for s, n in slots.items() if s >= first) / (now - first * _TPS_SLOT_S)

    def sample_totals(self, now: float | None = None, wall: float | None = None) -> None:
        """Once a second (the broker's gauge loop): the put and get totals store_tps reads, the stats windows'
        snapshots when due, and the mornings' totals after a local midnight."""
        day = date.fromtimestamp(time.time() if wall is None else wall).toordinal()
        # Only a later day: a wall clock stepped back across midnight (NTP, a VM resumed) moved them at the step and
        # again when the clock reached the same midnight, yesterday's count then the minutes between (a count that
        # lied, nothing said). After a step back they move at the next midnight the clock has not yet passed.
        if day > self._morning_day:
            self._morning_day = day
            m = self.mornings
            m["msgPutTotalYesterdayMorning"], m["msgPutTotalTodayMorning"] = m["msgPutTotalTodayMorning"], self.put_total
            m["msgGetTotalYesterdayMorning"], m["msgGetTotalTodayMorning"] = m["msgGetTotalTodayMorning"], self.get_total
        elif day < self._morning_day - 1:
            # Back by more than a day: the clock was set ahead (a wrong RTC at boot, then NTP) and corrected.
            # Waited for, that far date froze them for as long (a year ahead: a year): they move at the next midnight.
            self._morning_day = day
        now = time.monotonic() if now is None else now
        self._totals.append((now, self.put_total, self.get_total))
        self.put_windows.snapshot(now, lambda: {topic: counts[0] for topic, counts in self._in.items()})
        self.get_windows.snapshot(now, lambda: dict(self._got))

    def stats_windows(self, stats_name: str, stats_key: str, now: float | None = None) -> dict | None:
        """VIEW_BROKER_STATS_DATA: {window: (sum, per second)} of TOPIC_PUT_NUMS <topic> or GROUP_GET_NUMS
        <topic>@<group>; None for any other name, or a key not counted (a pair past max_series too)."""
        now = time.monotonic() if now is None else now
        if stats_name == "TOPIC_PUT_NUMS":
            counts = self._in.get(stats_key)
            return None if counts is None else self.put_windows.windows(stats_key, counts[0], now)
        if stats_name == "GROUP_GET_NUMS":
            topic, at, group = stats_key.partition("@")     # a topic name has no '@'; a group may
            total = self._got.get((topic, group)) if at else None
            return None if total is None else self.get_windows.windows((topic, group), total, now)
        return None

    def store_tps(self) -> tuple[str, str]:
        """putTps and getTransferedTps as RocketMQ writes them: three rates, space separated, over the last
        10 s, minute and 10 minutes (each over what has been sampled when the broker is younger)."""
        return self._rates(1), self._rates(2)

    def _rates(self, which: int) -> str:
        samples = self._totals
        rates = []
        for span in _STORE_TPS_SPANS_S:
            if len(samples) < 2:
                rates.append(0.0)
                continue
            first, last = samples[max(0, len(samples) - 1 - span)], samples[-1]
            rates.append((last[which] - first[which]) / (last[0] - first[0]) if last[0] > first[0] else 0.0)
        return " ".join(str(float(r)) for r in rates)

    # --------------------------------------------------------------- helpers
    def observe_request(self, code: int, response_code: int, seconds: float) -> None:
        # Once or twice per request: one dict lookup for the histogram child, one for the snapshot's
        # per-request state (its name, count and reservoir of latencies).
        child = self._rpc_children.get((code, response_code))
        if child is None:
            child = self._rpc_children[(code, response_code)] = self.rpc_latency.labels(request_name(code),
                                                                                        str(response_code))
        child.observe(seconds)
        name = self._names.get(code)
        if name is None:
            name = self._names[code] = request_name(code)
        n = self._counts.get(name, 0) + 1
        self._counts[name] = n
        samples = self._samples.get(name)
        if samples is None:
            samples = self._samples[name] = []
        if n <= _RESERVOIR:
            samples.append(seconds)
        else:
            j = int(_random() * n)              # reservoir sampling (Algorithm R)
            if j < _RESERVOIR:
                samples[j] = seconds

    def add_gauge_collector(self, name: str, doc: str, labels: list[str], fn, fold=sum, known=None) -> None:
        """A gauge computed at scrape time: fn() yields (label values, value). Past ``max_series`` rows, the
        ``max_series`` largest keep their labels and the rest are folded into one row with OTHER in every label,
        its value ``fold`` of theirs (sum; max for an age), counted in txmq_metric_series_folded: the rows
        follow names clients choose (a group per offset commit), and one client committing offsets for 100,000
        made-up groups made each scrape 100,000 lines, 8 MB, for as long as the offsets were kept. ``known``
        (label values -> bool; run on the scrape thread, only past the limit): rows it says True of are named
        before any other, whatever their value (see _fold_past_limit)."""
        metrics = self

        class _Collector(_InParts):
            def collect_parts(self_inner):
                # fn may read dicts another thread changes (a scrape from a thread of the tests' own); a
                # read that races a resize is simply taken again.
                for attempt in range(5):
                    try:
                        rows = list(fn())
                        break
                    except RuntimeError:
                        if attempt == 4:
                            raise
                if labels:
                    rows = metrics._fold_past_limit(name, rows, fold, known)
                for part in _parts(rows):
                    family = GaugeMetricFamily(name, doc, labels=labels)
                    for label_values, value in part:
                        family.add_metric(list(label_values), value)
                    yield family

            def describe(self_inner):
                return [GaugeMetricFamily(name, doc, labels=labels)]

        self.registry.register(_Collector())

    def fold_snapshot(self, snapshot: dict, known=None) -> dict:
        """``snapshot`` with its consumer_lag rows past max_snapshot_lag_rows folded into one OTHER row (the rows of
        the largest lags kept, in their order), counted in txmq_metric_series_folded{metric="snapshot_consumer_lag"}
        and logged; the rows of the groups ``known`` (group -> bool) says True of first. Sorts: call it on a
        thread, with the encoding."""
        rows = snapshot.get("consumer_lag", [])
        sizes = [_row_bytes(r) for r in rows]
        was = self._folded.get(SNAPSHOT_LAG, 0)
        if len(rows) <= self.max_snapshot_lag_rows and sum(sizes) <= self.max_snapshot_lag_bytes:
            self._folded[SNAPSHOT_LAG] = 0
            if was:
                log.info("metric snapshots hold every consumer-lag row again (%d)", len(rows))
            return snapshot
        if known is None:
            order = sorted(range(len(rows)), key=lambda i: rows[i]["lag"], reverse=True)
        else:
            order = sorted(range(len(rows)), key=lambda i: (known(rows[i]["group"]), rows[i]["lag"]), reverse=True)
        kept, used, rest = [], 0, 0
        for i in order:
            if len(kept) < self.max_snapshot_lag_rows and used + sizes[i] <= self.max_snapshot_lag_bytes:
                kept.append(i)
                used += sizes[i]
            else:
                rest += rows[i]["lag"]
        over = len(rows) - len(kept)
        self._folded[SNAPSHOT_LAG] = over
        if not was:
            log.warning("metric snapshots: %d consumer offsets, more than %d or %d bytes of names: the smallest lags "
                        "of %d are summed in one row of group %s (names a client makes up?)", len(rows),
                        self.max_snapshot_lag_rows, self.max_snapshot_lag_bytes, over, OTHER)
        kept = [rows[i] for i in sorted(kept)]
        kept.append({"group": OTHER, "topic": OTHER, "queue_id": -1, "lag": rest})
        return {**snapshot, "consumer_lag": kept}

    def add_folded_collector(self) -> None:
        """txmq_metric_series_folded: register it after every add_gauge_collector, so a scrape reads the
        counts its own gauges just made."""
        folded = self._folded

        class _Folded:
            def collect(self_inner):
                family = GaugeMetricFamily("txmq_metric_series_folded", "Series of a scrape-time gauge past the "
                                           f"{self.max_series} (or {self.max_series_bytes} bytes of label values) "
                                           f"it names, counted under the {OTHER} label at the last scrape, by "
                                           f"metric ({SNAPSHOT_LAG}: the last metric snapshot's consumer-lag rows "
                                           f"past {self.max_snapshot_lag_rows} or {self.max_snapshot_lag_bytes} "
                                           "bytes of names).", labels=["metric"])
                for name, n in list(folded.items()):
                    family.add_metric([name], n)
                yield family

            def describe(self_inner):
                return list(self_inner.collect())

        self.registry.register(_Folded())

    def _fold_past_limit(self, name: str, rows: list, fold, known=None) -> list:
        """``rows`` as they are, or the ``max_series`` largest and one OTHER row for the rest (scrape thread).
        The largest, not the first seen: the groups that lag most, or hold the oldest half, are the ones an
        operator must see. But a made-up group's lag is what its client commits (offset 0 on a long queue: the
        largest of all), so the rows ``known`` says True of (groups the broker knows other than by a name a
        client wrote) come first: ranked by value alone, made-up groups pushed every real one under OTHER, and
        the alert on its lag went quiet."""
        was = self._folded.get(name, 0)
        # (label values are at most 1,150 bytes a row: below this many rows no sizes need counting)
        sizes = None if len(rows) * 1150 <= self.max_series_bytes else [_label_bytes(r[0]) for r in rows]
        if len(rows) <= self.max_series and (sizes is None or sum(sizes) <= self.max_series_bytes):
            self._folded[name] = 0
            if was:
                log.info("%s has %d series again: none counted under %s", name, len(rows), OTHER)
            return rows
        if known is None:
            kept = heapq.nlargest(self.max_series, range(len(rows)), key=lambda i: rows[i][1])
        else:
            kept = heapq.nlargest(self.max_series, range(len(rows)), key=lambda i: (known(rows[i][0]), rows[i][1]))
        if sizes is not None and sum(sizes[i] for i in kept) > self.max_series_bytes:
            within, used = [], 0
            for i in kept:                      # (largest first)
                if used + sizes[i] <= self.max_series_bytes:
                    within.append(i)
                    used += sizes[i]
            kept = within
        over = len(rows) - len(kept)
        self._folded[name] = over
        if not was:
            log.warning("%s has %d series, more than %d or %d bytes of labels: the smallest %d are counted under %s "
                        "(names a client makes up?)", name, len(rows), self.max_series, self.max_series_bytes, over,
                        OTHER)
        named = set(kept)
        rest = fold(value for i, (_labels, value) in enumerate(rows) if i not in named)
        return [rows[i] for i in sorted(kept)] + [((OTHER,) * len(rows[0][0]), rest)]

    def describe_broker(self, config) -> None:
        """Constant series a dashboard and alerts join on: the build, and the configured disk ratios
        (so an alert compares the disk with this broker's own thresholds, not a number copied into a rule)."""
        info = GaugeMetricFamily("txmq_build_info", "Always 1; the labels say which txmq runs.",
                                 labels=["version", "python"])
        info.add_metric([__version__, platform.python_version()], 1)
        limits = GaugeMetricFamily("txmq_store_disk_ratio_limit",
                                   "Configured disk usage ratios: clean (expired segments go at once), "
                                   "force_clean (the oldest go), refuse (writes are refused).", labels=["limit"])
        for name in ("clean", "force_clean", "refuse"):
            limits.add_metric([name], getattr(config, f"disk_{name}_ratio"))
        self.registry.register(_Constant([info, limits]))

    def add_counter_collector(self, name: str, doc: str, fn) -> None:
        """A label-less counter kept by another object and read at scrape time: fn() yields ((), value) rows, none
        where the broker has no such thing (absent then), as add_gauge_collector's."""
        self.registry.register(_RowsCounter(name, doc, fn))

    def add_disk_collector(self, disk) -> None:
        """The store's disk watermark state (a store/disk.py DiskMonitor), read at scrape time."""
        self.registry.register(_DiskCollector(disk))

    def add_corrupt_collector(self, store) -> None:
        """Records the store's reads found failing their body CRC (MessageStore.corrupt), read at scrape time."""
        self.registry.register(_CorruptCollector(store))

    def add_compaction_collector(self, core) -> None:
        """The undecided index's lazy heaps swept (or rebuilt) of their decided entries (TransactionCore.compactions)."""
        self.registry.register(_CompactionCollector(core))

    # ------------------------------------------------------------- snapshots
    def snapshot(self, connections: int, lag: list[dict]) -> dict:
        requests = {}
        for name, samples in self._samples.items():
            ordered = sorted(samples)
            requests[name] = {"count": self._counts.get(name, 0),
                              "p50_ms": round(_quantile(ordered, 0.50) * 1000, 3),
                              "p99_ms": round(_quantile(ordered, 0.99) * 1000, 3)}
        self._samples = {}
        self._counts = {}
        return {"ts": int(time.time() * 1000), "connections": connections, "consumer_lag": lag,
                "requests": requests}


_PART = 256     # series in one part of a family (see _InParts)


def _parts(rows: list):
    """``rows`` PART at a time; one empty part for none (a family with no series still has its header)."""
    return (rows[i:i + _PART] for i in range(0, max(len(rows), 1), _PART))


class _InParts:
    """A collector whose families come in parts of up to PART series (collect_parts, consecutive families of one
    name): metrics_http renders a scrape on the event loop and lets it run between parts. Built whole, 6,000
    topics' or 10,000 groups' series held the loop 30-230 ms each. collect() gives each family whole, as any
    other reader of a registry expects."""

    def collect(self):
        whole = {}
        for part in self.collect_parts():
            family = whole.setdefault(part.name, part)
            if family is not part:
                family.samples.extend(part.samples)
        return list(whole.values())

    def describe(self):
        return self.collect()


def _counter_parts(metric):
    """collect_parts (see _InParts) for a labelled prometheus-client Counter: its children PART at a time, as its
    collect() gives them whole (no ``_created``: disable_created_metrics)."""
    def collect_parts():
        with metric._lock:
            children = list(metric._metrics.items())
        for part in _parts(children):
            family = CounterMetricFamily(metric._name, metric._documentation, labels=metric._labelnames)
            for labels, child in part:
                family.add_metric(list(labels), child._value.get())
            yield family
    return collect_parts


class _ProcessFamilies:
    """prometheus-client's process_* families: process_open_fds against process_max_fds (segments, queue files and
    connections share the descriptors), RSS, CPU; the default registry's, which a broker's own did not have. Read
    by ``refresh`` on the /metrics thread before each page: counting the open descriptors lists /proc/self/fd,
    21-35 ms at 10,000 of them, which the event loop rendering the page would have been held for."""

    def __init__(self):
        self._source = ProcessCollector(registry=None)
        self.refresh()

    def refresh(self) -> None:
        self._families = list(self._source.collect())

    def collect(self):
        return self._families


class _InCollector(_InParts):
    def __init__(self, counts: dict):
        self.counts = counts

    def collect_parts(self):
        rows = list(self.counts.items())
        for name, doc, which in (("rocketmq_messages_in", "Messages stored, by topic.", 0),
                                 ("rocketmq_throughput_in", "Message body bytes stored, by topic.", 1)):
            for part in _parts(rows):
                family = CounterMetricFamily(name, doc, labels=["topic"])
                for topic, counts in part:
                    family.add_metric([topic], counts[which])
                yield family


class _Constant:
    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return list(self.families)

    def describe(self):
        return list(self.families)


class _CorruptCollector:
    def __init__(self, store):
        self.store = store

    def collect(self):
        family = CounterMetricFamily("txmq_store_corrupt_records", "Commit-log records found failing their body "
                                     "CRC, or with a zeroed topic or properties, when read (damaged on disk; each logged with segment and byte), by the "
                                     "read that met them: not served, not copied.", labels=["read"])
        for read, n in list(self.store.corrupt.items()):
            family.add_metric([read], n)
        yield family
        yield GaugeMetricFamily("txmq_store_kept_corrupt_records", "Damaged commit-log records kept in place "
                                "(keep_corrupt_records; store file corrupt_kept) still in the log: each a lost "
                                "message a pull of its queue stops at. Held across restarts and on a slave from the "
                                "copy; 0 once retention removed their segments.", value=self.store.kept_corrupt)
        yield GaugeMetricFamily("txmq_store_corrupt_kept_unwritten", "1 while the store file corrupt_kept lags the "
                                "damaged records kept in place (a full disk; said once at ERROR, retried every half "
                                "second; checkpoints wait for it): a restart without keep_corrupt_records meanwhile "
                                "refuses them again.", value=int(self.store.kept_unwritten))
        yield GaugeMetricFamily("txmq_store_checkpoint_lag_bytes", "Bytes of flushed commit log past the "
                                "checkpoint on disk: what a start after a crash scans and verifies again. It grows "
                                "while the checkpoint cannot be written (a full disk, no inodes, an I/O error; logged "
                                "at ERROR once) or waits for queue units a full disk holds: free the disk, or the "
                                "next start after a crash takes that much longer.", value=self.store.checkpoint_lag)
        yield GaugeMetricFamily("txmq_store_write_stopped", "1 once the store stopped accepting writes after an "
                                "I/O error writing or flushing the commit log (EIO, EROFS: said at ERROR with the "
                                "error), else 0. Every send is refused SERVICE_NOT_AVAILABLE until a restart.",
                                value=int(self.store.failure is not None))

    def describe(self):
        return list(self.collect())


class _RowsCounter:
    def __init__(self, name: str, doc: str, fn):
        self.name, self.doc, self.fn = name, doc, fn

    def collect(self):
        for _labels, value in list(self.fn()):
            yield CounterMetricFamily(self.name, self.doc, value=value)

    def describe(self):
        return [CounterMetricFamily(self.name, self.doc)]


class _CompactionCollector:
    def __init__(self, core):
        self.core = core

    def collect(self):
        yield CounterMetricFamily("txmq_transaction_index_compactions", "Times a producer group's check "
                                  "schedule or age heap began a sweep of the entries of decided transactions (when "
                                  "those outnumbered the live ones: decisions under an older undecided one), or the "
                                  "age heaps were rebuilt on a read.",
                                  value=self.core.compactions)

    def describe(self):
        return list(self.collect())


class _DiskCollector:
    def __init__(self, disk):
        self.disk = disk

    def collect(self):
        d = self.disk
        yield GaugeMetricFamily("txmq_store_disk_usage_ratio", "Fraction (0..1) of the store's file system in use.",
                                value=d.ratio)
        yield GaugeMetricFamily("txmq_store_disk_inode_usage_ratio",
                                "Fraction (0..1) of the store's file system's inodes in use (df -i; 0 where it has no "
                                "fixed number, as btrfs or CephFS): out of them no file can be made, whatever space "
                                "is free.",
                                value=d.inode_ratio)
        yield GaugeMetricFamily("txmq_store_writes_refused",
                                "1 while writes are refused because the disk (its space or its inodes) is over "
                                "disk_refuse_ratio, else 0.",
                                value=1 if d.refusing else 0)
        yield CounterMetricFamily("txmq_store_write_refusals", "Write requests refused for disk space or inodes.",
                                  value=d.refusals)
        yield GaugeMetricFamily("txmq_store_read_only", "1 while the store's file system is mounted read-only "
                                "(statvfs ST_RDONLY: the kernel remounts ext4 so after an I/O error with "
                                "errors=remount-ro), else 0. Every write fails: repair the disk and restart.",
                                value=int(d.read_only))

    def describe(self):
        return list(self.collect())


def _reading(child):
    """What changes when a counter or histogram child is used (prometheus-client's value holders)."""
    value = getattr(child, "_value", None)
    if value is not None:
        return value.get()
    return child._sum.get(), tuple(b.get() for b in child._buckets)


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prune_snapshots(store_dir: str, keep_days: int, now_ms: int) -> list[str]:
    """Remove the snapshot files of UTC dates more than ``keep_days`` before ``now_ms``'s; returns their paths.
    Blocking: call it off the loop. Nothing else removed them: one file a day, for as long as the broker ran,
    on the store's disk (whose pressure cleaning removes commit-log segments, never these)."""
    folder = os.path.join(store_dir, "metrics")
    oldest = time.strftime("%Y-%m-%d", time.gmtime(now_ms / 1000 - keep_days * 86400))
    removed = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        day, dot, ext = name.partition(".")
        if ext == "jsonl" and _is_date(day) and day < oldest:
            path = os.path.join(folder, name)
            os.unlink(path)
            removed.append(path)
    return removed


def _is_date(text: str) -> bool:
    try:
        return time.strftime("%Y-%m-%d", time.strptime(text, "%Y-%m-%d")) == text
    except ValueError:
        return False


def _label_bytes(labels) -> int:
    """The UTF-8 bytes of a series' label values."""
    return sum(len(v) if v.isascii() else len(v.encode("utf-8", "surrogatepass")) for v in map(str, labels))


def _row_bytes(row: dict) -> int:
    """About the bytes a consumer_lag row takes in a snapshot line: its names as JSON writes them (a character
    outside ASCII as one or two 6-byte escapes), and 45 for the rest."""
    return sum(len(v) if v.isascii() else len(json.dumps(v)) for v in (row["group"], row["topic"])) + 45


def _encode(snapshot: dict) -> str:
    """The snapshot as one JSON line, its consumer_lag rows (one per consumer offset: tens of thousands) a
    slice per call: json's C encoder holds the GIL for a whole call, and the event loop waited for it."""
    rows = snapshot.get("consumer_lag", [])
    if len(rows) <= _ROWS_A_CALL:
        return json.dumps(snapshot, separators=(",", ":"))
    head = json.dumps({k: v for k, v in snapshot.items() if k != "consumer_lag"}, separators=(",", ":"))
    parts = [json.dumps(rows[i:i + _ROWS_A_CALL], separators=(",", ":"))[1:-1]
             for i in range(0, len(rows), _ROWS_A_CALL)]
    return head[:-1] + ("," if len(head) > 2 else "") + '"consumer_lag":[' + ",".join(parts) + "]}"


_ROWS_A_CALL = 4096


def append_snapshot(store_dir: str, snapshot: dict) -> str:
    """Append one snapshot line under <store>/metrics/<UTC date>.jsonl; returns the path."""
    folder = os.path.join(store_dir, "metrics")
    os.makedirs(folder, exist_ok=True)
    day = time.strftime("%Y-%m-%d", time.gmtime(snapshot["ts"] / 1000))
    path = os.path.join(folder, f"{day}.jsonl")
    line = memoryview((_encode(snapshot) + "\n").encode())
    whole = len(line)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = os.fstat(fd).st_size
        if before and os.pread(fd, 1, before - 1) != b"\n":
            # A line a kill -9 tore (its first part only): ended here, so it is one bad line and this one whole;
            # appended to it, the two read as one bad line and this snapshot was lost with it.
            line = memoryview(b"\n" + bytes(line))
            whole = len(line)
        try:
            while line:
                n = os.write(fd, line)
                if n <= 0:      # nothing written, nothing said: retried, the thread spun for ever (as the store's)
                    raise stalled_write(path, before + whole - len(line), len(line))
                line = line[n:]
        except OSError:
            # A full disk takes part of the line: cut it off again, or the next snapshot is appended to the torn
            # one and both read as one bad line (ops/spark counts it and drops it).
            try:
                os.ftruncate(fd, before)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)
    return path
