"""Name-server bodies: TopicRouteData and ClusterInfo JSON, as a 4.x name server writes them.

fastjson writes keys sorted, and writes Long-keyed maps (``brokerAddrs``) with
unquoted numeric keys: ``{0:"127.0.0.1:10911"}``. That is not JSON, but
clients released before 4.9.4 parse it by hand and expect it, so the 4.9.8
name server keeps it for requests below version 401 and answers strictly valid
JSON (quoted keys) to newer ones or on ``acceptStandardJsonOnly`` (spec 3.1).
The queue-data flag was spelled ``topicSynFlag`` until 4.8.0; both spellings are
written, readers ignore the one they do not know.
"""
from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import dataclass, field

from .codes import VERSION_STRICT_ROUTE_JSON
from .errors import HeaderError

log = logging.getLogger("txmq.namesrv_client")


@dataclass(slots=True)
class QueueData:
    broker_name: str
    read_queue_nums: int
    write_queue_nums: int
    perm: int
    topic_sys_flag: int = 0


@dataclass(slots=True)
class BrokerData:
    cluster: str
    broker_name: str
    broker_addrs: dict[int, str] = field(default_factory=dict)


@dataclass(slots=True)
class TopicRouteData:
    queue_datas: list[QueueData]
    broker_datas: list[BrokerData]
    order_topic_conf: str | None = None


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _addrs(addrs: dict[int, str], strict: bool) -> str:
    items = sorted(addrs.items())
    if strict:
        return "{" + ",".join(f'"{k}":{_dump(v)}' for k, v in items) + "}"
    return "{" + ",".join(f"{k}:{_dump(v)}" for k, v in items) + "}"


def _broker_data(bd: BrokerData, strict: bool) -> str:
    return (f'{{"brokerAddrs":{_addrs(bd.broker_addrs, strict)},"brokerName":{_dump(bd.broker_name)},'
            f'"cluster":{_dump(bd.cluster)}}}')


def _queue_data(qd: QueueData) -> str:
    return (f'{{"brokerName":{_dump(qd.broker_name)},"perm":{qd.perm},"readQueueNums":{qd.read_queue_nums},'
            f'"topicSynFlag":{qd.topic_sys_flag},"topicSysFlag":{qd.topic_sys_flag},'
            f'"writeQueueNums":{qd.write_queue_nums}}}')


def strict_json_for(version: int, accept_standard_json_only: bool = False) -> bool:
    return accept_standard_json_only or version >= VERSION_STRICT_ROUTE_JSON


def encode_route(route: TopicRouteData, *, strict: bool) -> bytes:
    parts = ['{"brokerDatas":[', ",".join(_broker_data(b, strict) for b in route.broker_datas), "]",
             ',"filterServerTable":{}']
    if route.order_topic_conf:
        parts.append(f',"orderTopicConf":{_dump(route.order_topic_conf)}')
    parts.append(',"queueDatas":[')
    parts.append(",".join(_queue_data(q) for q in sorted(route.queue_datas, key=lambda q: q.broker_name)))
    parts.append("]}")
    return "".join(parts).encode()


def encode_cluster_info(brokers: list[BrokerData], *, strict: bool) -> bytes:
    table = ",".join(f"{_dump(b.broker_name)}:{_broker_data(b, strict)}" for b in brokers)
    clusters: dict[str, list[str]] = {}
    for b in brokers:
        clusters.setdefault(b.cluster, []).append(b.broker_name)
    return f'{{"brokerAddrTable":{{{table}}},"clusterAddrTable":{_dump(clusters)}}}'.encode()


_UNQUOTED_INT_KEY = re.compile(r'([{,])\s*(-?\d+)\s*:')


def encode_topic_list(topics, broker_addr: str | None = None) -> bytes:
    """TopicList as fastjson writes it: ``{"brokerAddr":..,"topicList":[..]}``, brokerAddr left out when null.
    The topics sorted: a Java reader holds them in a HashSet, so their order carries nothing."""
    head = "" if broker_addr is None else f'"brokerAddr":{_dump(broker_addr)},'
    return f'{{{head}"topicList":{_dump(sorted(topics))}}}'.encode()


def decode_route(body: bytes) -> TopicRouteData:
    """Parse either form of route JSON (the non-strict one has unquoted integer keys)."""
    try:
        text = body.decode("utf-8")
        obj = json.loads(_UNQUOTED_INT_KEY.sub(r'\1"\2":', text))
        queue_datas = [QueueData(q["brokerName"], int(q["readQueueNums"]), int(q["writeQueueNums"]),
                                 int(q["perm"]), int(q.get("topicSysFlag", q.get("topicSynFlag", 0))))
                       for q in obj.get("queueDatas") or []]
        broker_datas = [BrokerData(b.get("cluster", ""), b["brokerName"],
                                   {int(k): v for k, v in (b.get("brokerAddrs") or {}).items()})
                        for b in obj.get("brokerDatas") or []]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HeaderError(f"route data does not parse: {exc}") from None
    return TopicRouteData(queue_datas, broker_datas, obj.get("orderTopicConf"))


class NameServers:
    """The name servers a client asks, in turn from the one that answered last (RocketMQ's client, too, keeps
    the name server it reached): a first one that is down costs one connect timeout, not one per route fetch.

    Each client starts at a name server picked at random, as RocketMQ's does (namesrvIndex starts random):
    all starting at the first, every client of a cluster loaded the first name server alone.

    One that fails is logged at WARNING once per ``LOG_EVERY_S`` (a client asks per topic, and a name server
    down for an hour must neither go unsaid nor fill the log), and once more when it answers again: two lines a
    minute at most, a name server that fails every other request too."""

    LOG_EVERY_S = 60.0

    def __init__(self, addrs: list[str], *, first: int | None = None):
        self.addrs = list(addrs)
        self._first = first if first is not None else random.randrange(len(self.addrs)) if self.addrs else 0
        self._logged: dict[str, float] = {}     # addr -> clock() when its failure was last logged
        self._failing: set[str] = set()         # failures logged and not yet said to be over
        self.clock = time.monotonic

    def __iter__(self):
        first = self._first     # once: another lookup's answered() must not move this walk past a server
        return iter(self.addrs[first:] + self.addrs[:first])

    def __len__(self) -> int:
        return len(self.addrs)

    @property
    def current(self) -> str | None:
        """The name server a walk starts at: the one that answered last."""
        return self.addrs[self._first] if self.addrs else None

    def failing(self, addr: str) -> bool:
        """Whether ``addr`` failed (said so) and has not answered since."""
        return addr in self._failing

    def answered(self, addr: str) -> None:
        self._first = self.addrs.index(addr)
        if self._failing and addr in self._failing:
            self._failing.discard(addr)
            log.info("name server %s answers again", addr)

    def failed(self, addr: str, exc: BaseException) -> None:
        """``addr`` did not answer a request (refused, timed out, closed): said, at most once per LOG_EVERY_S."""
        now = self.clock()
        last = self._logged.get(addr)
        if last is None or now - last >= self.LOG_EVERY_S:     # not reset by an answer: one that flaps, too
            self._logged[addr] = now
            self._failing.add(addr)
            others = "; asking the next one" if len(self.addrs) > 1 else ""
            log.warning("name server %s did not answer: %s%s (logged at most every %g s while it fails)",
                        addr, exc, others, self.LOG_EVERY_S)
