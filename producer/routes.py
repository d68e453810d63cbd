"""Route lookup through the name server, cached per topic, and queue selection."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from protocol.codes import Perm, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import NoPermissionError, TopicNotExistError, error_for_code
from protocol.route import TopicRouteData, decode_route

AUTO_CREATE_TOPIC = "TBW102"


@dataclass(frozen=True, slots=True)
class MessageQueue:
    topic: str
    broker_name: str
    queue_id: int


class RouteCache:
    def __init__(self, pool, namesrv_addrs: list[str], *, ttl_s: float = 30.0, timeout: float = 3.0,
                 default_queue_nums: int = 4):
        self.pool = pool
        self.namesrv_addrs = namesrv_addrs
        self.ttl_s = ttl_s
        self.timeout = timeout
        self.default_queue_nums = default_queue_nums
        self._routes: dict[str, tuple[float, TopicRouteData]] = {}
        self._counter = itertools.count()

    async def fetch(self, topic: str) -> TopicRouteData:
        last_error = None
        for addr in self.namesrv_addrs:
            try:
                resp = await self.pool.request(addr, RemotingCommand.request(
                    RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic}), self.timeout)
            except OSError as exc:
                last_error = exc
                continue
            except Exception as exc:  # noqa: BLE001 - try the next name server
                last_error = exc
                continue
            if resp.code == ResponseCode.SUCCESS:
                return decode_route(resp.body_bytes())
            raise error_for_code(resp.code, resp.remark)
        raise last_error or TopicNotExistError("no name server answered")

    async def route(self, topic: str, *, refresh: bool = False) -> TopicRouteData:
        cached = self._routes.get(topic)
        if cached is not None and not refresh and time.monotonic() - cached[0] < self.ttl_s:
            return cached[1]
        route = await self.fetch(topic)
        self._routes[topic] = (time.monotonic(), route)
        return route

    async def publish_queues(self, topic: str) -> list[MessageQueue]:
        """Writable queues of a topic; an unknown topic uses TBW102's brokers (auto-creation on send)."""
        try:
            route = await self.route(topic)
            limit = None
        except TopicNotExistError:
            route = await self.route(AUTO_CREATE_TOPIC)
            limit = self.default_queue_nums
        queues = []
        for qd in sorted(route.queue_datas, key=lambda q: q.broker_name):
            if not qd.perm & Perm.WRITE:
                continue
            n = qd.write_queue_nums if limit is None else min(limit, qd.read_queue_nums)
            queues.extend(MessageQueue(topic, qd.broker_name, i) for i in range(n))
        return queues

    async def subscribe_queues(self, topic: str) -> list[MessageQueue]:
        route = await self.route(topic)
        return [MessageQueue(topic, qd.broker_name, i) for qd in sorted(route.queue_datas, key=lambda q: q.broker_name)
                if qd.perm & Perm.READ for i in range(qd.read_queue_nums)]

    def broker_addr(self, broker_name: str) -> str | None:
        for _, route in self._routes.values():
            for bd in route.broker_datas:
                if bd.broker_name == broker_name and 0 in bd.broker_addrs:
                    return bd.broker_addrs[0]
        return None

    def all_broker_addrs(self) -> set[str]:
        return {bd.broker_addrs[0] for _, route in self._routes.values() for bd in route.broker_datas
                if 0 in bd.broker_addrs}

    def select(self, queues: list[MessageQueue], avoid: str | None = None) -> MessageQueue:
        """Round robin, skipping the broker that just failed when another exists."""
        if not queues:
            raise NoPermissionError("the topic has no writable queue on any broker")
        n = next(self._counter)
        for i in range(len(queues)):
            mq = queues[(n + i) % len(queues)]
            if mq.broker_name != avoid:
                return mq
        return queues[n % len(queues)]
