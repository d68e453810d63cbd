"""RouteTable: what a name server knows, RocketMQ's RouteInfoManager as plain data.

Tables (all keyed as in RouteInfoManager):

| table     | key                  | value                                                       |
|-----------|----------------------|-------------------------------------------------------------|
| clusters  | cluster name         | broker names in it                                          |
| brokers   | broker name          | BrokerData: cluster, {broker id: address}                   |
| queues    | topic                | {broker name: QueueData} -- from the master's registration  |
| live      | broker address       | BrokerLive: last heard, data version, connection, HA address |
| write_wiped | broker name        | (a set) wipeWritePerm took it out of write routes           |

A master's registration replaces that broker's queue data when its data
version changed or it is new (a topic it no longer holds leaves the routes;
RocketMQ 4.9.8 only adds and updates, and needs DELETE_TOPIC_IN_NAMESRV for
that, which is answered too). A slave's registration adds its address only. A broker goes when it
unregisters, when its connection closes, or when it has not registered for
``expire_ms`` (RocketMQ's BROKER_CHANNEL_EXPIRED_TIME, 120 s); the last address
of a broker name going takes that name's queues out of every route.

WIPE_WRITE_PERM_OF_BROKER takes a broker's write permission out of every route it
is in, until ADD_WRITE_PERM_OF_BROKER, until its name leaves the table, or until its
master registers afresh (a restarted broker, as in RocketMQ, its slave still here or not). The queue data
keep the perm the broker registered and the mask is applied when a route is
answered, so a registration with changed topics does not bring writes back behind
the operator's back, and addWritePerm gives back what the broker registered: a
read-only topic stays read-only (RocketMQ 4.9.8 rewrites the stored perm, losing both).

No I/O and no asyncio: the clock is a parameter, so expiry is tested by
moving it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from protocol.codes import Perm
from protocol.registration import DataVersion, RegisterBrokerBody
from protocol.route import BrokerData, QueueData, TopicRouteData

from ..limits import peer_host

log = logging.getLogger("txmq.namesrv")

MASTER_ID = 0
CLASH_SAID_MS = 600_000     # two live brokers taking one name and id from each other: said at most this often


@dataclass(slots=True)
class BrokerLive:
    """A registered broker address: when it was last heard from and over which connection."""

    last_ms: int
    data_version: DataVersion
    conn: object
    ha_server_addr: str
    cluster: str
    broker_name: str
    broker_id: int


@dataclass(frozen=True, slots=True)
class RegisterResult:
    """What the name server tells a registering slave: its master's address and HA address."""

    master_addr: str | None = None
    ha_server_addr: str | None = None


class RouteTable:
    def __init__(self, *, expire_ms: int = 120_000, max_addresses_per_host: int = 1 << 30):
        self.expire_ms = expire_ms
        self.max_addresses_per_host = max_addresses_per_host
        self.refusal_logged_ms = -(1 << 62)     # the last WARNING about max_addresses_per_host (one per 10 s)
        self.clusters: dict[str, set[str]] = {}
        self.brokers: dict[str, BrokerData] = {}
        self.queues: dict[str, dict[str, QueueData]] = {}
        self.live: dict[str, BrokerLive] = {}
        self.write_wiped: set[str] = set()     # broker names; only names in ``brokers``, so bounded by them
        # (broker name, id) -> ({live address a registration took them from: when, within expire_ms}, when its clash
        # was last said): only ids in ``brokers`` (_drop_id), only addresses that lost them within expire_ms
        self.taken: dict[tuple[str, int], tuple[dict[str, int], int]] = {}
        self.id_clashes = 0             # registrations that took a name and id back from a live address that took them

    # ---------------------------------------------------------- registration
    def room_for(self, broker_addr: str, conn: object) -> bool:
        """May ``conn`` register ``broker_addr``: one it holds already, or a new one while the connections from its
        remote address hold fewer than max_addresses_per_host. Any client may register any address and its topic
        table (RocketMQ's name server has no credentials), and each address stayed while its connection did: one
        connection registering address after address grew the table, and every scan of it, without bound."""
        if broker_addr in self.live:
            return True
        host = peer_host(conn)
        return sum(1 for live in self.live.values() if peer_host(live.conn) == host) < self.max_addresses_per_host

    def register(self, *, cluster: str, broker_addr: str, broker_name: str, broker_id: int, ha_server_addr: str,
                 body: RegisterBrokerBody, conn: object, now_ms: int) -> RegisterResult:
        self.clusters.setdefault(cluster, set()).add(broker_name)
        bd = self.brokers.get(broker_name)
        first = bd is None
        if bd is None:
            bd = self.brokers[broker_name] = BrokerData(cluster, broker_name, {})
        # One address, one id: a slave promoted to master drops its old id first.
        for bid, addr in list(bd.broker_addrs.items()):
            if addr == broker_addr and bid != broker_id:
                self._drop_id(bd, bid)
        old_addr = bd.broker_addrs.get(broker_id)
        bd.broker_addrs[broker_id] = broker_addr
        first = first or old_addr is None
        if old_addr is not None and old_addr != broker_addr:
            if old_addr in self.live:
                self._taken_from_live(cluster, broker_name, broker_id, old_addr, broker_addr, now_ms)
            self._forget_address(old_addr)
        prev = self.live.get(broker_addr)
        if broker_id == MASTER_ID and prev is None:
            # a master registering afresh (a restart) is routed as it registers, as RocketMQ's registerFirst
            # rewrites its queue data: its slave keeping the name must not keep the wipe past it
            self.write_wiped.discard(broker_name)
        if broker_id == MASTER_ID and (first or prev is None or prev.data_version != body.data_version):
            self._replace_queues(broker_name, body)
        self.live[broker_addr] = BrokerLive(now_ms, body.data_version, conn, ha_server_addr, cluster, broker_name,
                                            broker_id)
        if prev is None:
            log.info("broker registered: %s %s id %d at %s (%d topics)", cluster, broker_name, broker_id,
                     broker_addr, len(body.topics))
        if broker_id != MASTER_ID:
            master = bd.broker_addrs.get(MASTER_ID)
            live = self.live.get(master) if master else None
            if live is not None:
                return RegisterResult(master, live.ha_server_addr)
        return RegisterResult()

    def _taken_from_live(self, cluster: str, name: str, bid: int, old: str, new: str, now_ms: int) -> None:
        """A registration takes ``name`` id ``bid`` from ``old``, an address still registered: a broker restarted at
        another address (its old connection not closed yet), or two live brokers with one name and id -- a second
        master left at the default name, two slaves given one id, another cluster's broker -- each taking it back at
        its next registration. Routes then flipped between them every registration period, in silence (as in
        RocketMQ 4.9.8): producers sent into two logs, consumers read and committed on either. Said (WARNING, at most
        every CLASH_SAID_MS a name and id) once an address it was taken from within expire_ms takes it again (three
        brokers taking it in turn too; an address taking it back later was restarted there, not said)."""
        key = (name, bid)
        lost, said_ms = self.taken.get(key, ({}, -(1 << 62)))
        # A live broker registers again within expire_ms: one that lost the name and id longer ago and takes them now
        # is a broker restarted there (a switch back), not one taking them back.
        clash = now_ms - lost.get(new, -(1 << 62)) <= self.expire_ms
        lost = {a: ms for a, ms in lost.items() if a != new and now_ms - ms <= self.expire_ms}
        lost[old] = now_ms
        self.id_clashes += clash
        if not clash or now_ms - said_ms < CLASH_SAID_MS:   # not clash: the first take (a restart, likely)
            self.taken[key] = (lost, said_ms)
            return
        self.taken[key] = (lost, now_ms)
        log.warning("brokers %s and %s both register as %s %s id %d (%s): each takes the name and id back from the "
                    "other at its registration, and routes flip between them -- producers send into two logs, "
                    "consumers read and commit offsets on either. Give each broker its own --broker-name (each master "
                    "its own; a slave its master's name and its own --broker-id), or point it at its own cluster's "
                    "name server. %d such registrations so far; said at most every %d minutes",
                    old, new, cluster, name, bid, "a master" if bid == MASTER_ID else "a slave", self.id_clashes,
                    CLASH_SAID_MS // 60_000)

    def _replace_queues(self, broker_name: str, body: RegisterBrokerBody) -> None:
        for topic in [t for t, by_broker in self.queues.items() if broker_name in by_broker
                      and t not in body.topics]:
            self._drop_queue(topic, broker_name)
        for t in body.topics.values():
            self.queues.setdefault(t.name, {})[broker_name] = QueueData(broker_name, t.read_queue_nums,
                                                                         t.write_queue_nums, t.perm, t.sys_flag)

    def _drop_queue(self, topic: str, broker_name: str) -> None:
        by_broker = self.queues.get(topic)
        if by_broker is not None:
            by_broker.pop(broker_name, None)
            if not by_broker:
                del self.queues[topic]

    def unregister(self, *, cluster: str, broker_addr: str, broker_name: str, broker_id: int) -> bool:
        """UNREGISTER_BROKER: the broker says it is going (a clean shutdown)."""
        known = self.live.pop(broker_addr, None) is not None
        bd = self.brokers.get(broker_name)
        if bd is not None and bd.broker_addrs.get(broker_id) == broker_addr:
            self._drop_id(bd, broker_id)
            if not bd.broker_addrs:
                self._forget_broker_name(broker_name)
        log.info("broker unregistered: %s %s id %d at %s", cluster, broker_name, broker_id, broker_addr)
        return known

    def delete_topic(self, topic: str, cluster: str = "") -> int:
        """DELETE_TOPIC_IN_NAMESRV: the topic leaves the routes of ``cluster``'s brokers (every broker when
        empty); the number of brokers it left. A broker still holding it routes it again at its next
        registration with a new data version, as in RocketMQ."""
        by_broker = self.queues.get(topic)
        if not by_broker:
            return 0
        names = [n for n in by_broker if not cluster or n in self.clusters.get(cluster, ())]
        for name in names:
            self._drop_queue(topic, name)
        return len(names)

    def wipe_write_perm(self, broker_name: str) -> int:
        """WIPE_WRITE_PERM_OF_BROKER: ``broker_name`` leaves the write routes; the number of topics it is in
        (0 for a name not registered, which is not remembered: as RocketMQ, SUCCESS and 0)."""
        if broker_name not in self.brokers:
            return 0
        self.write_wiped.add(broker_name)
        return self._topic_count(broker_name)

    def add_write_perm(self, broker_name: str) -> int:
        """ADD_WRITE_PERM_OF_BROKER: the write permission the broker registered is routed again."""
        self.write_wiped.discard(broker_name)
        return self._topic_count(broker_name)

    def _topic_count(self, broker_name: str) -> int:
        return sum(1 for by_broker in self.queues.values() if broker_name in by_broker)

    # --------------------------------------------------------------- going
    def connection_closed(self, conn: object) -> list[str]:
        """The broker's connection closed: every address registered over it goes at once."""
        gone = [addr for addr, live in self.live.items() if live.conn is conn]
        for addr in gone:
            log.warning("broker %s: connection closed, removed from routes", addr)
            self._forget_address(addr)
        return gone

    def expire(self, now_ms: int) -> list[str]:
        """Drop brokers not heard from for ``expire_ms``; their addresses, for closing their connections."""
        gone = [addr for addr, live in self.live.items() if now_ms - live.last_ms > self.expire_ms]
        for addr in gone:
            log.warning("broker %s: not heard from for %d ms, removed from routes", addr, self.expire_ms)
            self._forget_address(addr)
        return gone

    def _forget_address(self, addr: str) -> None:
        self.live.pop(addr, None)
        for name, bd in list(self.brokers.items()):
            for bid in [bid for bid, a in bd.broker_addrs.items() if a == addr]:
                self._drop_id(bd, bid)
            if not bd.broker_addrs:
                self._forget_broker_name(name)

    def _drop_id(self, bd: BrokerData, bid: int) -> None:
        """``bid`` leaves ``bd``'s addresses, and who took it from whom with it: ``taken`` holds the ids registered
        only (kept while the name was, a client registering one name under id after id, each taken once from
        another of its addresses, grew it without bound; a clash is between two brokers holding the id in turn)."""
        del bd.broker_addrs[bid]
        self.taken.pop((bd.broker_name, bid), None)

    def _forget_broker_name(self, broker_name: str) -> None:
        self.brokers.pop(broker_name, None)
        self.write_wiped.discard(broker_name)     # (its ids, and their ``taken``, went before it: _drop_id)
        for cluster, names in list(self.clusters.items()):
            names.discard(broker_name)
            if not names:
                del self.clusters[cluster]
        for topic in [t for t, by_broker in self.queues.items() if broker_name in by_broker]:
            self._drop_queue(topic, broker_name)

    # ------------------------------------------------------------- answers
    def route(self, topic: str) -> TopicRouteData | None:
        """The topic's route (every broker name holding it, sorted), or None: TOPIC_NOT_EXIST."""
        by_broker = self.queues.get(topic)
        if not by_broker:
            return None
        names = sorted(by_broker)
        broker_datas = [BrokerData(bd.cluster, bd.broker_name, dict(bd.broker_addrs))
                        for bd in (self.brokers.get(n) for n in names) if bd is not None]
        if not broker_datas:
            return None
        return TopicRouteData([self._routed(by_broker[n]) for n in names], broker_datas)

    def _routed(self, qd: QueueData) -> QueueData:
        if qd.broker_name not in self.write_wiped:
            return qd
        return QueueData(qd.broker_name, qd.read_queue_nums, qd.write_queue_nums, qd.perm & ~Perm.WRITE,
                         qd.topic_sys_flag)

    def broker_datas(self) -> list[BrokerData]:
        """Every broker name with its addresses, for GET_BROKER_CLUSTER_INFO."""
        return [BrokerData(bd.cluster, bd.broker_name, dict(bd.broker_addrs)) for _, bd in sorted(self.brokers.items())]

    def topic_names(self) -> list[str]:
        return sorted(self.queues)

    def topics_of_cluster(self, cluster: str) -> list[str]:
        """GET_TOPICS_BY_CLUSTER: topics with queues on any broker of ``cluster`` (none for an unknown one)."""
        names = self.clusters.get(cluster, set())
        return sorted(t for t, by_broker in self.queues.items() if not names.isdisjoint(by_broker))

    def system_topic_list(self) -> tuple[list[str], str | None]:
        """GET_SYSTEM_TOPIC_LIST_FROM_NS: every cluster name and broker name (each broker makes a topic of
        both), and one broker address, which the Java admin then asks for its system topics (305)."""
        names = set(self.clusters).union(*self.clusters.values())
        addr = next((a for _, bd in sorted(self.brokers.items()) for _, a in sorted(bd.broker_addrs.items())), None)
        return sorted(names), addr
