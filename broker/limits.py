"""Per-client and broker-wide limits, each answered with a remark that names the limit.

A broker facing unknown clients must not let one of them starve the rest: a client that
sends to thousands of new topic names, a producer that outruns the disk, a producer group
that never decides its transactions. Each check here is O(1) on the request path, and each
refusal is counted in ``txmq_requests_refused_total{reason}``.
"""
from __future__ import annotations

import functools
import heapq
import ipaddress
import logging
import time

from protocol.codes import ResponseCode
from protocol.message import validate_group

log = logging.getLogger("txmq.limits")

# RocketMQ's remark for a broker shedding load; stock clients back off and retry on it.
BUSY_REMARK = "[TIMEOUT_CLEAN_QUEUE]broker busy, start flow control for a while"


def peer_host(conn) -> str:
    """Who ``conn``'s peer is for every per-host cap: one client, whatever number of connections it opens
    (its remote address, keyed by ``client_key``)."""
    peer = getattr(conn, "peer", None)
    return client_key(peer[0]) if peer else ""


class EveryKey:
    """Whether a line about ``key`` is due: at most once every ``interval_s`` for one key, for a table of at most
    ``max_keys`` (cleared when full: a key a client chooses must not grow it). For lines said on a request
    path about a name a client gave (a group, a topic), which a loop of requests would repeat without end."""

    def __init__(self, interval_s: float, max_keys: int = 1024, clock=time.monotonic, *, total: int | None = None,
                 rotate: bool = False):
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.clock = clock
        self.said: dict[str, float] = {}       # key -> when last said
        # ``total``: keys said in one interval, all together. Once a minute each is no bound where the client
        # chooses the keys (made-up group names cost nothing): each new one was a line.
        self.total = total
        self._window = (float("-inf"), 0)      # (when the interval began, keys said in it)
        # Keys refused as an interval's ``total`` was said, and those refused in the interval before, which have the
        # first claim on this one's: the keys said in one interval are due again as the next begins, and where they
        # come first each time (a pass in the same order), they took every interval's ``total`` and the others were
        # never said. A key with the first claim that does not come back holds its room for that interval alone,
        # so this is for keys that recur (``rotate``: a group named each pass); keys said once (one transaction's
        # line) would hold a busy minute's ``total`` in the next for nothing.
        self.rotate = rotate
        self._refused: set[str] = set()
        self._first: set[str] = set()

    def due(self, key: str) -> bool:
        now = self.clock()
        if now - self.said.get(key, float("-inf")) < self.interval_s:
            return False
        if self.total is not None:
            began, n = self._window
            if now - began >= self.interval_s:
                began, n = now, 0
                self._first, self._refused = self._refused, set()
            first = self._first
            if n >= self.total or (key not in first and n + len(first) >= self.total):
                if self.rotate and len(self._refused) < self.max_keys:
                    self._refused.add(key)
                self._window = (began, n)
                return False        # (not marked said: said once the interval is over)
            first.discard(key)
            self._window = (began, n + 1)
        if len(self.said) >= self.max_keys:
            self.said.clear()
        self.said[key] = now
        return True

    def full(self) -> bool:
        """Whether this interval's ``total`` is said, or the rest of it held for the keys held back last interval: a
        due() False for that, not for the key said lately. (Counting only those said, a key refused for the room
        held was taken for one said lately: a summary line not said, a dead-lettered COMMIT named nowhere.)"""
        began, n = self._window
        return (self.total is not None and n + len(self._first) >= self.total
                and self.clock() - began < self.interval_s)


_NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")     # RFC 6052: an IPv4 address in its last 32 bits
_ipv6_prefix = 64      # set_ipv6_client_prefix: the server's ipv6_client_prefix, one a process


def set_ipv6_client_prefix(bits: int) -> None:
    """Key IPv6 peers by their first ``bits`` bits from now on (128: each address as itself)."""
    global _ipv6_prefix
    if not 1 <= bits <= 128:
        raise ValueError(f"an IPv6 prefix is 1 to 128 bits, not {bits}")
    _ipv6_prefix = bits
    client_key.cache_clear()


@functools.lru_cache(maxsize=4096)
def client_key(host: str) -> str:
    """The key one client's caps are counted under: an IPv4 address as it is (an IPv4-mapped IPv6 one, or one
    under the NAT64 prefix 64:ff9b::/96, as its IPv4 address), an IPv6 address by its /64 ("2001:db8:1:2::/64";
    the prefix is the server's ipv6_client_prefix), the loopback ::1 and a link-local address (whose /64, fe80::,
    every host on the link shares) as themselves.

    A /64 is what one IPv6 host or site is given (RFC 6177): by address, one client picking address after
    address from its own /64 got round every per-host cap. Anything not an IP address is kept as given."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host
    if addr.version == 4:
        return str(addr)
    if addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    if addr in _NAT64_WELL_KNOWN:     # IPv4 clients seen through a translator (SIIT-DC): by /64, all were one client
        return str(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    if addr.is_loopback or addr.is_link_local or _ipv6_prefix == 128:
        return str(addr)
    return str(ipaddress.IPv6Network((addr, _ipv6_prefix), strict=False))


def count_down(counts: dict, key) -> None:
    """One fewer of ``key`` in ``counts``; a key at zero goes, so the table holds only who holds something."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


class Limits:
    def __init__(self, config, metrics, *, monotonic=time.monotonic):
        self.config = config
        self.metrics = metrics
        self.monotonic = monotonic
        self.queued_bytes = 0               # send bodies handed to the writer and not yet answered
        self._undecided: dict[str, int] = {}
        self._topic_tokens: dict[str, tuple[float, float]] = {}    # client host -> (tokens, when)
        self._undecided_at = -1.0
        self._undecided_total = 0           # every group's, with the halves accepted since the last copy
        self._undecided_most = ""           # the groups holding the most, for the total limit's WARNING
        self._warned: dict[str, float] = {}         # reason -> when its refusal was last logged

    def refused(self, reason: str, warning: str | None = None) -> None:
        """Count a refusal; ``warning`` says it in the log, at most every _GATE_LOG_INTERVAL_S for one reason."""
        self.metrics.refused.labels(reason).inc()
        if warning is not None:
            self.warn(reason, warning)

    def warn(self, reason: str, warning: str) -> None:
        """Log ``warning`` at most every _GATE_LOG_INTERVAL_S for one ``reason`` (one of a fixed few: each is kept)."""
        now = self.monotonic()
        if now - self._warned.get(reason, -_GATE_LOG_INTERVAL_S) >= _GATE_LOG_INTERVAL_S:
            self._warned[reason] = now
            log.warning("%s (logged at most every %d s)", warning, _GATE_LOG_INTERVAL_S)

    # ------------------------------------------------------------ topics
    def may_create(self, conn, cmd, topics, topic: str, *, queues: int = 1, per_host: bool = True):
        """None, or the response refusing to create ``topic`` with ``queues`` queues: past max_topics, or
        (``per_host``) this client past max_topics_per_host -- else one client could fill max_topics, every other
        client's new topic refused until an operator deleted topics -- or its queues past max_queues or
        max_queues_per_host (``queue_room``). What it created is counted by ``topics`` (created_by)."""
        c = self.config
        if len(topics.topics) >= c.max_topics:
            self.refused("topic-limit")
            return cmd.response(ResponseCode.NO_PERMISSION,
                                f"topic[{topic}] not created: the broker holds {len(topics.topics)} topics, "
                                f"its limit (max_topics={c.max_topics})")
        if per_host:
            host = peer_host(conn)
            if not topics.room_for(host, c.max_topics_per_host):
                held = topics.created_by(host)
                why = (f"topic[{topic}] not created: client {host} created {held} topics, its limit "
                       f"(max_topics_per_host={c.max_topics_per_host}); delete some first")
                self.refused("topic-host-limit", why)
                return cmd.response(ResponseCode.NO_PERMISSION, why)
        why = self.queue_room(topics, topic, queues, peer_host(conn) if per_host else None)
        return None if why is None else cmd.response(ResponseCode.NO_PERMISSION, why)

    def may_add_group(self, conn, cmd, subscriptions, group):
        """None, or the response refusing to store ``group``, a subscription group not stored yet, past
        max_subscription_groups: every update rewrites the whole file, and a loop of made-up names grew it, and the
        broker, without bound. (A group stored already is updated as ever; a name no group may have -- not a
        string, empty, too long, not UTF-8 -- is refused later, as below the cap: one with a lone surrogate put in
        this remark made the reply unencodable, a traceback logged at each.)"""
        held, cap = len(subscriptions.groups), self.config.max_subscription_groups
        if held < cap or not isinstance(group, str) or not group or group in subscriptions.groups \
                or validate_group(group) is not None:
            return None
        why = (f"subscription group {group[:200]} not created: the broker stores {held} subscription groups, its "
               f"limit (max_subscription_groups={cap}); delete some first")
        self.refused("subscription-group-limit", f"{why} (asked by {peer_host(conn)})")
        return cmd.response(ResponseCode.NO_PERMISSION, why)

    def queue_room(self, topics, topic: str, queues: int, host: str | None, verb: str = "created", *,
                   count: bool = True) -> str | None:
        """None, or why ``topic`` may not have ``queues`` queues (``count``: counted and logged): the broker's queues past
        max_queues, or (``host``: the client asking) its client's past max_queues_per_host. Only what it would
        count for beyond now is checked, and a client growing a topic is charged all its queues.

        A topic may have 1024 queues, and each written one holds a consume-queue file mapped with two file
        descriptors: without these one client's 512 topics could ask for half a million, far past the process's
        open-files limit and vm.max_map_count (65530), and every client's next new queue, segment or connection
        failed."""
        c = self.config
        counted, owner = topics.queues_counted(topic)
        grown = queues - counted
        if grown <= 0:
            return None
        # At a limit, the empty %RETRY% topics of groups gone go first (as at max_topics_per_host): else a host whose
        # groups come and go was held at it by retry topics of groups long gone, each new group left without one.
        # (max_queues 0, unset, is resolved from the process's limits by the server at start; a config not
        # through it has no broker-wide cap)
        if c.max_queues and topics.queue_total + grown > c.max_queues and topics.reclaim_retry(
                f"max_queues={c.max_queues}"):
            counted, owner = topics.queues_counted(topic)
            grown = queues - counted
        if c.max_queues and topics.queue_total + grown > c.max_queues:
            why = (f"topic[{topic}] not {verb}: its {queues} queues would bring the broker's {topics.queue_total} "
                   f"queues past its limit (max_queues={c.max_queues})")
            if count:
                self.refused("queue-limit", why)
            return why
        if host is not None:
            held = topics.queues_of(host) - (counted if owner == host else 0)
            if held + queues > c.max_queues_per_host and topics.reclaim_retry_of(
                    host, f"max_queues_per_host={c.max_queues_per_host}"):
                held = topics.queues_of(host) - (counted if owner == host else 0)
            if held + queues > c.max_queues_per_host:
                why = (f"topic[{topic}] not {verb}: its {queues} queues would bring client {host}'s {held} queues "
                       f"past its limit (max_queues_per_host={c.max_queues_per_host}); delete topics it no "
                       f"longer uses")
                if count:
                    self.refused("queue-host-limit", why)
                return why
        return None

    def may_auto_create(self, conn, cmd, topics, topic: str, queues: int = 1):
        """None, or the response refusing to create ``topic`` with ``queues`` queues for this client
        (``may_create``, then its rate).

        A client is its address, not its connection: opening fifty connections must not buy
        fifty times the rate (each new topic costs files and a catalogue entry)."""
        refused = self.may_create(conn, cmd, topics, topic, queues=queues)
        if refused is not None:
            return refused
        rate = self.config.max_auto_create_topics_per_s
        host = peer_host(conn)
        if not self._take(self._topic_tokens, host, rate, rate):
            self.refused("topic-rate")
            return cmd.response(ResponseCode.SYSTEM_BUSY,
                                f"topic[{topic}] not created: client {host} creates topics faster than "
                                f"max_auto_create_topics_per_s={rate:g}; retry later")
        return None

    def _take(self, buckets: dict, host: str, rate: float, burst: float) -> bool:
        """Take a token from ``host``'s bucket in ``buckets`` (``burst`` at most, ``rate`` more a second): whether
        there was one. A client is its address, not its connection: fifty connections buy no more."""
        now = self.monotonic()
        tokens, last = buckets.get(host, (float(burst), now))
        tokens = min(float(burst), tokens + (now - last) * rate)
        if len(buckets) > 4096:         # forget clients whose bucket has refilled: they lose nothing
            for h, (t, when) in list(buckets.items()):
                if t + (now - when) * rate >= burst:
                    del buckets[h]
        if tokens < 1.0:
            buckets[host] = (tokens, now)
            return False
        buckets[host] = (tokens - 1.0, now)
        return True

    # ------------------------------------------------------------ offsets
    def offsets_full(self, offsets, group: str, topic: str, queue_id: int) -> str | None:
        """None, or why a new offset of (``group``, ``topic``, ``queue_id``) may not be made: the broker holds
        max_offsets (counted, said at most every 10 s). For every path that makes one: a client's commit
        (``may_commit``) and a forced reset (INVOKE_BROKER_TO_RESET_OFFSET), which sets queues the group has none
        for. Not on a slave (its offsets are its master's copies)."""
        held, limit = offsets.count(), self.config.max_offsets
        if held < limit or not offsets.per_host:
            return None
        why = (f"offset of group {group} on {topic} queue {queue_id} not stored: the broker holds {held} "
               f"offsets, its limit (max_offsets={limit}); delete groups no longer used")
        self.refused("offset-limit", why)
        return why

    def may_commit(self, conn, offsets, group: str, topic: str, queue_id: int) -> str | None:
        """None, or why this client may not make the offset of (``group``, ``topic``, ``queue_id``): past max_offsets
        (every client's together: per address alone, clients from enough addresses grew the table without bound) or
        max_offsets_per_host. An offset there is (its own or not) is always moved."""
        if offsets.has(group, topic, queue_id):
            return None
        why = self.offsets_full(offsets, group, topic, queue_id)
        if why is not None:
            return why
        limit = self.config.max_offsets_per_host
        host = peer_host(conn)
        held = offsets.made_by(host)
        if held < limit:
            return None
        why = (f"offset of group {group} on {topic} queue {queue_id} not stored: client {host} made {held} "
               f"offsets, its limit (max_offsets_per_host={limit}); delete groups it no longer uses")
        self.refused("offset-host-limit", why)
        return why

    # ------------------------------------------------------------ writer pressure
    def busy(self, cmd, size: int):
        """SYSTEM_BUSY while the bytes queued for the writer are over max_writer_queued_bytes."""
        if self.queued_bytes + size > self.config.max_writer_queued_bytes and self.queued_bytes > 0:
            self.refused("busy")
            return cmd.response(ResponseCode.SYSTEM_BUSY,
                                f"{BUSY_REMARK}, queued bytes: {self.queued_bytes}, "
                                f"limit (max_writer_queued_bytes): {self.config.max_writer_queued_bytes}")
        return None

    def track(self, fut, size: int):
        """Count ``size`` bytes as queued until ``fut`` (the store's put) completes."""
        self.queued_bytes += size

        def done(_f, n=size):
            self.queued_bytes -= n
        fut.add_done_callback(done)
        return fut

    # ------------------------------------------------------------ transactions
    def may_prepare(self, cmd, tx, group: str):
        """None, or the refusal of one more undecided transaction for ``group``.

        The counts come at most once a second from the pending index's per-group counts (a copy of one
        number per group, never a walk of the index) and the halves still being stored (not in the index
        yet), plus the halves accepted since: an over-estimate between copies, never an under-estimate.
        """
        limit, total_limit = self.config.max_undecided_per_group, self.config.max_undecided
        now = self.monotonic()
        if now - self._undecided_at >= 1.0:
            counts = dict(tx.core.per_group)
            for g, n in tx.storing_groups.items():
                counts[g] = counts.get(g, 0) + n
            self._undecided, self._undecided_at = counts, now
            self._undecided_total = sum(counts.values())
            self._undecided_most = ""       # (made when a refusal says it: once a copy at most)
        n = self._undecided.get(group, 0)
        if n >= limit:
            self.refused("undecided-limit")
            return cmd.response(ResponseCode.SYSTEM_BUSY,
                                f"producer group {group} has {n} undecided transactions, its limit "
                                f"(max_undecided_per_group={limit}); decide some first")
        if self._undecided_total >= total_limit:
            # Each group under its own limit, the groups together grew the pending index (about 1 KB of memory
            # a transaction) without bound: 30 groups of 100,000 were 3 GB.
            if not self._undecided_most:
                most = heapq.nlargest(3, self._undecided.items(), key=lambda item: item[1])
                self._undecided_most = ", ".join(f"{g} ({c})" for g, c in most)
            remark = (f"the broker holds {self._undecided_total} undecided transactions, its limit "
                      f"(max_undecided={total_limit}), every producer group together; decide some first")
            self.refused("undecided-total-limit", f"half message of producer group {group} refused: {remark} "
                         f"(most held by {self._undecided_most}), or raise --max-undecided with the memory to hold "
                         "them (about 1 KB each)")
            return cmd.response(ResponseCode.SYSTEM_BUSY, remark)
        self._undecided[group] = n + 1
        self._undecided_total += 1
        return None


class ConnectionGate:
    """Who may connect: at most ``max_total`` connections, and at most ``max_per_host`` from one remote address
    (an IPv6 one by its /64: ``client_key``).

    Without the second, one client opening connections until the total was reached (idle ones cost it
    nothing) left every other client unable to connect at all. A refusal is logged at most every
    _GATE_LOG_INTERVAL_S with the count since, as one such client refuses thousands a second."""

    def __init__(self, max_total: int, max_per_host: int, log, what: str, *, monotonic=time.monotonic):
        self.max_total = max_total
        self.max_per_host = max_per_host
        self.log = log
        self.what = what
        self.monotonic = monotonic
        self.open: set = set()
        self._by_host: dict[str, int] = {}
        # the gates whose connections share the process's descriptors, and how many they may hold together
        # (share_descriptors); None: no cap but each gate's own
        self._together: list["ConnectionGate"] = [self]
        self.max_together: int | None = None
        self.reserved = 0                   # of max_together, this gate's alone: the others' connections never take it
        self._refused = 0                   # since the last log line
        self._logged_at = -_GATE_LOG_INTERVAL_S
        self._unfinished = 0                # connections closed for a frame never finished, since the last such line
        self._unfinished_logged_at = -_GATE_LOG_INTERVAL_S

    def __len__(self) -> int:
        return len(self.open)

    def __iter__(self):
        return iter(self.open)

    def admit(self, conn) -> str | None:
        """None when ``conn`` is let in (then counted until release), else the limit it is past."""
        host = peer_host(conn)
        if len(self.open) >= self.max_total:
            why = "max_connections"
        elif self.max_together is not None and not self._room_together():
            why = "open-files"
        elif self._by_host.get(host, 0) >= self.max_per_host:
            why = "max_connections_per_host"
        else:
            self.open.add(conn)
            self._by_host[host] = self._by_host.get(host, 0) + 1
            return None
        self._refused += 1
        now = self.monotonic()
        if now - self._logged_at >= _GATE_LOG_INTERVAL_S:
            self.log.warning("%s: refusing %s:%s (past %s; %d connections open, %d from %s%s); %d refused since "
                             "the last such line (logged at most every %d s)", self.what, conn.peer[0], conn.peer[1], why,
                             len(self.open), self._by_host.get(host, 0), host, self._holders(why), self._refused,
                             _GATE_LOG_INTERVAL_S)
            self._logged_at, self._refused = now, 0
        return why

    def _holders(self, why: str) -> str:
        """Past a limit of every address together, who holds the room: the refused one's own count named no one
        when many addresses hold a few each (a local client may connect from any of 127.0.0.0/8)."""
        if why == "max_connections_per_host":
            return ""
        gates = self._together if why == "open-files" else [self]
        held: dict[str, int] = {}
        for gate in gates:
            for host, count in gate._by_host.items():
                held[host] = held.get(host, 0) + count
        top = heapq.nlargest(3, held.items(), key=lambda item: item[1])
        raise_what = "ulimit -n (LimitNOFILE)" if why == "open-files" else "--max-connections"
        return ("; the addresses holding the most: " + ", ".join(f"{host} ({count})" for host, count in top)
                + f"; every new client is refused until some close: stop a client that leaks connections, or raise "
                  f"{raise_what}")

    @staticmethod
    def share_descriptors(gates: list["ConnectionGate"], max_together: int) -> None:
        """Hold ``gates`` to ``max_together`` connections between them: what the open-files limit leaves beside
        the store's files. Past it a connection is refused on accept (reason "open-files"), not taken from the
        store: accepted until accept() itself failed, idle connections held every descriptor, and sends to a
        queue whose file was not open yet failed, checkpoints and offsets went unwritten, until they left.
        Each gate keeps a share of its own (a quarter of the total between two, a sixth between three) and takes
        the rest from a pool: the name-server port is unauthenticated, and a flood of idle connections to it (2,000
        allowed per address) took the whole total and locked producers out of the broker port and the slave out of
        replication."""
        reserved = max(1, max_together // (2 * len(gates)))
        for gate in gates:
            gate._together = gates
            gate.max_together = max_together
            gate.reserved = reserved

    def _room_together(self) -> bool:
        if len(self.open) < self.reserved:
            return True
        pooled = sum(max(0, len(g.open) - g.reserved) for g in self._together)
        return pooled < self.max_together - sum(g.reserved for g in self._together)

    def close_quiet(self, ticks: int) -> int:
        """Close the connections whose peer sent nothing for ``ticks`` calls of this (while its reading is paused or
        a request of its is being handled, a connection is not quiet, unless its peer read nothing since the last
        call); how many. A peer gone without a FIN (its host down, a NAT or firewall that dropped the flow) left
        its connection open for good, holding its address's room: RocketMQ's server closes a channel idle for
        120 s, and a stock client heartbeats every 30 s on each connection."""
        closed = 0
        for conn in list(self.open):
            if self._frame_overdue(conn, ticks):
                pass                        # (said and counted there, not as quiet)
            elif (conn.reading_paused or conn.handling) and not _read_nothing(conn):
                conn.quiet_ticks = 0
            elif conn.quiet_ticks >= ticks:
                if conn.writing_paused and conn.budget is not None:
                    conn.budget.closed_for("channel_expire_ms")
                conn.abort()
                closed += 1
            else:
                conn.quiet_ticks += 1
        return closed

    def _frame_overdue(self, conn, ticks: int) -> bool:
        """Close ``conn`` when the frame it is sending has stayed unfinished for ``ticks`` calls of close_quiet
        (its reading paused by us, the frame is not the peer's to finish: not counted). A peer that sent nothing at
        all for as long (gone mid-frame: its host down, the link cut) is left to the quiet rule, not counted here. Any byte reset the quiet
        count, so a peer trickling one byte of a frame every 100 s (or every 10 s) held its connection, the bytes
        of that frame and its address's room for good, nothing said. RocketMQ 4.9.8 closes it: its IdleStateHandler
        sits behind NettyDecoder, so only whole frames count as reads (ALL_IDLE, 120 s). Counted (``on_refuse("unfinished-frame")``: a metric) and
        logged at most every _GATE_LOG_INTERVAL_S naming the address, with the count since."""
        if not conn.unfinished_bytes or conn.reading_paused:
            conn.frame_ticks = 0
            return False
        if conn.frame_ticks < ticks:
            conn.frame_ticks += 1
            return False
        if conn.quiet_ticks >= ticks:
            return False                    # nothing came for as long: a peer gone mid-frame, closed as quiet
        if conn.on_refuse is not None:
            conn.on_refuse("unfinished-frame")
        self._unfinished += 1
        now = self.monotonic()
        if now - self._unfinished_logged_at >= _GATE_LOG_INTERVAL_S:
            self.log.warning("%s: closing %s:%s: its request frame (%d bytes so far) stayed unfinished for as long as a "
                             "silent connection is kept (channel_expire_ms, %d sweeps), its bytes coming a few at a "
                             "time; %d closed so since the "
                             "last such line (logged at most every %d s): a client that cannot send a frame of "
                             "max_frame_size within that time is broken or hostile, find it by its address",
                             self.what, conn.peer[0], conn.peer[1], conn.unfinished_bytes, ticks, self._unfinished,
                             _GATE_LOG_INTERVAL_S)
            self._unfinished_logged_at, self._unfinished = now, 0
        conn.abort()
        return True

    def release(self, conn) -> bool:
        """Forget ``conn``; False when it was never admitted."""
        if conn not in self.open:
            return False
        self.open.discard(conn)
        count_down(self._by_host, peer_host(conn))
        return True


_GATE_LOG_INTERVAL_S = 10


def _read_nothing(conn) -> bool:
    """The peer of ``conn`` stopped reading and took none of its responses since the last close_quiet. Its
    reading paused for it, a frozen client (SIGSTOP, a hung process or VM) was never quiet: kept for good with
    what it left unread (6 MB of 3,000 answers here, up to max_write_buffer) and its address's room, nothing
    said. RocketMQ closes a channel that neither reads nor completes a write for 120 s."""
    if not conn.writing_paused:     # it keeps up: no ioctl (unread_bytes, ~10 us) for every parked pull's connection
        conn.quiet_unsent = 0
        return False
    unread = conn.unread_bytes()
    stuck = unread >= conn.quiet_unsent
    conn.quiet_unsent = unread
    return stuck


def at_most(counter: str, limit: int, busy: str):
    """A decorator: the request handler it wraps runs ``limit`` requests at once at most (counted in the context's
    ``counter``), one past them answered SYSTEM_BUSY ``busy``, counted in txmq_requests_refused_total{reason} (the
    counter's name, ``-`` for ``_``) and logged at most every _GATE_LOG_INTERVAL_S: unsaid, an operator's tool
    refused again and again left nothing on the broker's side."""
    reason = counter.replace("_", "-")

    def wrap(handler):
        @functools.wraps(handler)
        async def limited(ctx, conn, cmd):
            if getattr(ctx, counter) >= limit:
                ctx.limits.refused(reason, f"request {cmd.code} from {peer_host(conn)} refused SYSTEM_BUSY: {busy}")
                return cmd.response(ResponseCode.SYSTEM_BUSY, busy)
            setattr(ctx, counter, getattr(ctx, counter) + 1)
            try:
                return await handler(ctx, conn, cmd)
            finally:
                setattr(ctx, counter, getattr(ctx, counter) - 1)
        return limited
    return wrap
