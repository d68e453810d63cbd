"""Route lookup through the name server, cached per topic, and queue selection.

A cached route serves for ``ttl_s`` (30 s, the Java client's pollNameServerInterval); the producer
also refreshes every cached route in the background at that period, and asks again at once after a
routing error (a broker that cannot be reached or does not know the topic), so a failover or a new
broker is seen within one period or one failed attempt. While no name server answers, the route known
last serves on, for a ttl at a time (the Java client keeps its topicPublishInfoTable so). A route past its
ttl still serves sends while one fetch of it runs in the background: a send waits for the name server only
for a topic it knows no route of, or after a routing error. Concurrent lookups of a topic share one fetch.

A topic the name servers do not know yet (a broker creates it on its first send) gets TBW102's route, cut to
``default_queue_nums`` queues a broker, cached under the topic for a ttl as any route (the Java client's
updateTopicRouteInfoFromNameServer(topic, isDefault=true)): asked again on every send, each paid a name-server
round trip until the broker registered the new topic.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from protocol.codes import Perm, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import (ConnectionClosedError, NoPermissionError, RequestTimeoutError, TopicNotExistError,
                             error_for_code)
from protocol.route import NameServers, QueueData, TopicRouteData, decode_route

AUTO_CREATE_TOPIC = "TBW102"
FORGET_AFTER_S = 3600.0     # a cached route whose topic the name servers have not known this long is forgotten
log = logging.getLogger("txmq.producer")
_UNREACHED = (RequestTimeoutError, ConnectionClosedError)     # what NameServers.failed says, once a minute


@dataclass(frozen=True, slots=True)
class MessageQueue:
    """One queue of a topic on one broker (RocketMQ's MessageQueue)."""

    topic: str
    broker_name: str
    queue_id: int


class RouteCache:
    """Topic routes from the name servers, cached for ``ttl_s``; round-robin queue selection."""

    def __init__(self, pool, namesrv_addrs: list[str], *, ttl_s: float = 30.0, timeout: float = 3.0,
                 default_queue_nums: int = 4, forget_after_s: float | None = FORGET_AFTER_S):
        self.pool = pool
        self.namesrv_addrs = NameServers(namesrv_addrs)
        self.ttl_s = ttl_s
        self.timeout = timeout
        self.default_queue_nums = default_queue_nums
        self._routes: dict[str, tuple[float, TopicRouteData]] = {}
        self._addrs: dict[str, str] = {}          # broker name -> master address, from the latest route
        # topic -> (the _routes entry they were computed from, its writable queues): a send's fast path
        self._queues: dict[str, tuple[tuple[float, TopicRouteData], list[MessageQueue]]] = {}
        self._counter = itertools.count()
        self._fetching: dict[str, asyncio.Task] = {}     # topic -> its fetch under way, shared by every lookup
        self._defaulted: set[str] = set()   # topics whose cached route is TBW102's (_default_route), not their own
        # topic -> time.monotonic() of the first TOPIC_NOT_EXIST since its route was last found: kept a while (its
        # only broker away, unregistered by a clean stop), forgotten ``forget_after_s`` on (None: never)
        self._missing: dict[str, float] = {}
        self.forget_after_s = forget_after_s
        self.forgotten = 0      # routes forgotten so

    async def fetch(self, topic: str) -> TopicRouteData:
        """Ask the name servers (from the one that answered last) for ``topic``'s route; raises the first answer's error."""
        last_error = None
        for addr in self.namesrv_addrs:
            try:
                resp = await self._ask(addr, topic)
            except Exception as exc:  # noqa: BLE001 - try the next name server
                self.namesrv_addrs.failed(addr, exc)
                last_error = exc
                continue
            self.namesrv_addrs.answered(addr)
            if resp.code == ResponseCode.SUCCESS:
                return decode_route(resp.body_bytes())
            raise error_for_code(resp.code, resp.remark)
        raise last_error or TopicNotExistError("no name server answered")

    async def route(self, topic: str, *, refresh: bool = False) -> TopicRouteData:
        """The cached route; one older than ``ttl_s`` is fetched again in the background and serves meanwhile.
        Fetched and waited for when missing or ``refresh`` is set (after a routing error)."""
        cached = self._routes.get(topic)
        if cached is not None and not refresh:
            if time.monotonic() - cached[0] >= self.ttl_s and topic not in self._fetching:
                self._start_fetch(topic).add_done_callback(_retrieve)
            return cached[1]
        return await asyncio.shield(self._fetching.get(topic) or self._start_fetch(topic))

    def _start_fetch(self, topic: str) -> asyncio.Task:
        task = self._fetching[topic] = asyncio.get_running_loop().create_task(self._update(topic))
        task.add_done_callback(lambda t: self._fetching.pop(topic, None) if self._fetching.get(topic) is t else None)
        return task

    async def _update(self, topic: str) -> TopicRouteData:
        """Fetch ``topic``'s route and cache it; when no name server answers, the route known serves another ttl."""
        try:
            route = await self.fetch(topic)
        except TopicNotExistError:
            # due to be forgotten: the other name servers asked first (a lookup takes the answer of the one that
            # answered last, which may have lost the topic's broker while another still has it)
            route = await self._known_elsewhere(topic) if self._overdue(topic) else None
            if route is None:
                if self._overdue(topic):
                    self._forget_gone(topic)
                    raise
                cached = self._routes.get(topic)
                default = self._routes.get(AUTO_CREATE_TOPIC)
                if cached is not None and topic in self._defaulted and default is not None:
                    # still on TBW102's route: taken again from TBW102's latest, so a broker whose write permission
                    # was wiped since (or made read-only) leaves its sends at the refresh, as from any route
                    self._routes[topic] = (time.monotonic(), _default_route(default[1], self.default_queue_nums))
                elif cached is not None:    # kept (see refresh_all), asked again a ttl later, not by every send
                    self._routes[topic] = (time.monotonic(), cached[1])
                raise
        except Exception as exc:  # noqa: BLE001 - no name server answered: the route known serves, as in Java
            cached = self._routes.get(topic)
            if cached is None or self.pool.closed:     # closed: the producer's own shutdown, not an outage
                raise
            # for another ttl: each send asking (each waiting out a connect) would fail while the brokers are up.
            # A name server out of reach is said by NameServers, once a minute: not again here, once a topic.
            log.log(logging.DEBUG if isinstance(exc, _UNREACHED) else logging.WARNING,
                    "route of %s: %s; the route known last serves", topic, exc)
            self._routes[topic] = (time.monotonic(), cached[1])
            return cached[1]
        self._routes[topic] = (time.monotonic(), route)
        self._defaulted.discard(topic)
        self._missing.pop(topic, None)
        for bd in route.broker_datas:       # the newest answer wins: a broker that moved is found there
            if 0 in bd.broker_addrs:
                self._addrs[bd.broker_name] = bd.broker_addrs[0]
        return route

    def close(self) -> None:
        """Cancel the fetches under way (the producer's shutdown)."""
        for task in list(self._fetching.values()):
            task.cancel()

    def _overdue(self, topic: str) -> bool:
        """After a TOPIC_NOT_EXIST for a cached ``topic``: whether it has been answered that for ``forget_after_s``
        on end (the clock starts at the first such answer since the route was last found)."""
        if topic not in self._routes or topic == AUTO_CREATE_TOPIC or self.forget_after_s is None:
            return False
        now = time.monotonic()
        return now - self._missing.setdefault(topic, now) >= self.forget_after_s

    def _ask(self, addr: str, topic: str):
        return self.pool.request(addr, RemotingCommand.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic}),
                                 self.timeout)

    async def _known_elsewhere(self, topic: str) -> TopicRouteData | None:
        """``topic``'s route from a name server other than the one that answered TOPIC_NOT_EXIST last, or None
        when none knows it (or answers): asked once a route is due to be forgotten, so at most once a period; one
        down (failed, not answered since) is not asked."""
        answered = self.namesrv_addrs.current
        for addr in self.namesrv_addrs:
            if addr == answered or self.namesrv_addrs.failing(addr):     # (down: a timeout each route)
                continue
            try:
                resp = await self._ask(addr, topic)
            except Exception as exc:  # noqa: BLE001 - unreachable: not one that knows it
                self.namesrv_addrs.failed(addr, exc)
                continue
            if resp.code == ResponseCode.SUCCESS:
                return decode_route(resp.body_bytes())
        return None

    def _forget_gone(self, topic: str) -> None:
        """Forget an overdue route: said at INFO, counted in ``forgotten``."""
        since = self._missing.get(topic, time.monotonic())
        self.forget(topic)
        self.forgotten += 1
        log.info("route of %s forgotten: no name server has known the topic for %.0f s (deleted?); a send to it "
                 "asks again", topic, time.monotonic() - since)

    def forget(self, topic: str) -> None:
        """Drop ``topic``'s route: the next use asks the name server (after a routing error)."""
        self._routes.pop(topic, None)
        self._queues.pop(topic, None)
        self._missing.pop(topic, None)
        self._defaulted.discard(topic)

    def forget_default(self, topic: str) -> None:
        """Drop ``topic``'s route if it is TBW102's, taken for a topic no name server knows: after a send that
        failed (refused: TOPIC_NOT_EXIST, or NO_PERMISSION past max_topics / max_topics_per_host, or no writable
        queue), else refresh_all asked for that name each period for good."""
        if topic in self._defaulted:
            self.forget(topic)

    async def refresh_all(self) -> None:
        """Fetch every cached route again (the background refresh); a failure keeps the old route.

        TOPIC_NOT_EXIST too, as in the Java client: a name server answers it while the topic's only broker is
        away (unregistered on a clean stop) or before brokers register again after its own restart. Dropped,
        the route's brokers would get no heartbeat, even once back, until a send asked for the topic again."""
        # TBW102 first: the topics on its route (not created yet) are taken again from the one just fetched
        for topic in sorted(self._routes, key=lambda t: t != AUTO_CREATE_TOPIC):
            try:
                await self.route(topic, refresh=True)
            except Exception as exc:  # noqa: BLE001 - name server unreachable or forgetful: keep the old one
                log.info("route refresh of %s failed: %s", topic, exc)

    def cached_publish_queues(self, topic: str) -> list[MessageQueue] | None:
        """``publish_queues(topic)`` without awaiting, while the route they came from is cached and fresh; else None."""
        entry = self._queues.get(topic)
        if entry is None:
            return None
        source, queues = entry
        if self._routes.get(topic) is not source or time.monotonic() - source[0] >= self.ttl_s:
            return None
        return queues

    async def publish_queues(self, topic: str, *, refresh: bool = False) -> list[MessageQueue]:
        """Writable queues of a topic; an unknown topic uses TBW102's brokers (auto-creation on send)."""
        try:
            route = await self.route(topic, refresh=refresh)
        except TopicNotExistError:
            default = await self.route(AUTO_CREATE_TOPIC, refresh=refresh)
            route = _default_route(default, self.default_queue_nums)
            # cached as the topic's own: the next sends use it without asking, the refresh finds the real one
            self._routes[topic] = (time.monotonic(), route)
            self._defaulted.add(topic)
        source = self._routes.get(topic)
        # a broker without a master in this route (its slave still registered) takes no sends, and the address
        # an older route gave its master is stale: none of its queues, as in the Java client
        masters = {bd.broker_name for bd in route.broker_datas if 0 in bd.broker_addrs}
        queues = []
        for qd in sorted(route.queue_datas, key=lambda q: q.broker_name):
            if not qd.perm & Perm.WRITE or qd.broker_name not in masters:
                continue
            queues.extend(MessageQueue(topic, qd.broker_name, i) for i in range(qd.write_queue_nums))
        if source is not None and source[1] is route:
            if len(self._queues) >= 4096:
                self._queues.clear()
            self._queues[topic] = (source, queues)
        return queues

    async def subscribe_queues(self, topic: str) -> list[MessageQueue]:
        """Readable queues of a topic."""
        route = await self.route(topic)
        return [MessageQueue(topic, qd.broker_name, i) for qd in sorted(route.queue_datas, key=lambda q: q.broker_name)
                if qd.perm & Perm.READ for i in range(qd.read_queue_nums)]

    def broker_addr(self, broker_name: str) -> str | None:
        """The master address of ``broker_name`` in the latest route that named it, or None."""
        return self._addrs.get(broker_name)

    def all_broker_addrs(self) -> set[str]:
        """Master addresses of every broker in the cached routes (heartbeats go to each)."""
        return {bd.broker_addrs[0] for _, route in self._routes.values() for bd in route.broker_datas
                if 0 in bd.broker_addrs}

    def select(self, queues: list[MessageQueue], avoid: str | None = None, passed_over=()) -> MessageQueue:
        """Round robin, skipping the broker that just failed, and those ``passed_over`` (unreachable lately),
        when another exists."""
        if not queues:
            raise NoPermissionError("the topic has no writable queue on any broker")
        n = next(self._counter)
        for i in range(len(queues)):
            mq = queues[(n + i) % len(queues)]
            if mq.broker_name != avoid and mq.broker_name not in passed_over:
                return mq
        return queues[n % len(queues)]


def _default_route(default: TopicRouteData, queue_nums: int) -> TopicRouteData:
    """The route a topic not created yet gets from TBW102's: each of its brokers with ``queue_nums`` queues
    at most (what the broker creates on the first send: defaultTopicQueueNums, capped by TBW102's own)."""
    queue_datas = [QueueData(qd.broker_name, min(queue_nums, qd.read_queue_nums), min(queue_nums, qd.read_queue_nums),
                             qd.perm, qd.topic_sys_flag) for qd in default.queue_datas]
    return TopicRouteData(queue_datas, default.broker_datas, default.order_topic_conf)


def _retrieve(task: asyncio.Task) -> None:
    """A background fetch nobody awaited: its failure is logged where it happens (or is a TOPIC_NOT_EXIST the
    next lookup meets again), not left to the loop's 'exception never retrieved'."""
    if not task.cancelled():
        task.exception()
