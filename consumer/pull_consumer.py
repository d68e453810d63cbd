"""PullConsumer: pull by queue from an offset, with long polling, and commit offsets. Plain RocketMQ 4.x.

Broker addresses come from the topic routes the name server gives; a route is fetched on first use,
again when it is older than ``route_ttl_s`` (30 s), and again at once after a routing error (the
broker cannot be reached, or does not know the topic), so a failover is followed by the next call.
A route past its ttl is fetched in the background while the address known serves: a call waits for the
name server only when it knows no address of its broker, or that address just failed (RocketMQ's pulls,
too, never wait for a route refresh). Lookups of a topic share one fetch, and one that fails leaves the
route known serving for another ttl: a name server that takes requests and never answers cost every pull
of every queue a whole request timeout, again and again.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from protocol.admin_bodies import decode_mq_table, encode_client_consumer_status, encode_consumer_running_info
from protocol.codes import Perm, PullSysFlag, RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.connection import ConnectionPool
from protocol.errors import (BrokerError, ConnectionClosedError, HeaderError, RequestTimeoutError, ResponseError,
                             TopicNotExistError, error_for_code)
from protocol.message import (MAX_INFLATED_BODY, MessageExt, Prop, decode_records, inflate, java_trim,
                              properties_to_string)
from protocol.route import NameServers, decode_route
from protocol.signature import Credentials

log = logging.getLogger("txmq.consumer")
_MAX_OFFLINE = 256          # forgotten brokers whose address is kept for their own queues' last calls


@dataclass(frozen=True, slots=True)
class MessageQueue:
    """One queue of a topic on one broker (RocketMQ's MessageQueue)."""

    topic: str
    broker_name: str
    queue_id: int


class PullStatus(enum.Enum):
    """How a pull ended: messages found, nothing new, none matching the tags, or the offset was illegal."""

    FOUND = ResponseCode.SUCCESS
    NO_NEW_MSG = ResponseCode.PULL_NOT_FOUND
    NO_MATCHED_MSG = ResponseCode.PULL_RETRY_IMMEDIATELY
    OFFSET_ILLEGAL = ResponseCode.PULL_OFFSET_MOVED


@dataclass(frozen=True, slots=True)
class MessageSelector:
    """What a subscription selects (RocketMQ's MessageSelector): ``by_tag("a || b")`` (``"*"``: everything) or
    ``by_sql("a > 5 AND TAGS IN ('x')")``, evaluated by the broker on each message's properties, which a
    broker filters by only when its property filter is on (txmq: ``--enable-property-filter``; a refusal
    raises at ``subscribe`` or start, as a Java consumer fails to start). Wherever a consumer takes an
    expression, a plain string is a tag expression."""
    expression: str
    expression_type: str = "TAG"

    @classmethod
    def by_tag(cls, tags: str | None) -> "MessageSelector":
        """Messages whose tag is one of ``tags`` (``"a || b"``); ``"*"`` or nothing: every message. ValueError for
        an expression that names no tag (``" "``, ``"||"``): a broker refuses its pulls (a 4.9.8 one matches no
        message with it, and the Java client refuses ``"||"`` at subscribe)."""
        return cls(tags or "*", "TAG")

    def __post_init__(self):
        # here, not in by_tag alone: MessageSelector(" ") went past the check into a subscription, a push consumer
        # storing its consume_from="last" starts and then refused every pull
        if self.is_tag and self.expression not in ("", "*") and not self.tags:
            raise ValueError(f"the tag expression {self.expression[:200]!r} names no tag (\"*\" selects every "
                             "message)")

    @classmethod
    def by_sql(cls, sql: str) -> "MessageSelector":
        """Messages whose properties make ``sql`` true (RocketMQ 4.9.8's SQL92 subset); ValueError if empty."""
        if not sql or not sql.strip():      # as FilterAPI.build: the Java client refuses it before sending
            raise ValueError("an SQL92 expression cannot be empty")
        return cls(sql, "SQL92")

    @property
    def is_tag(self) -> bool:
        return self.expression_type == "TAG"

    @property
    def tags(self) -> list[str]:
        """The tags a tag selector names; [] when it selects every message ("*") or is SQL92."""
        if not self.is_tag or self.expression in ("", "*"):
            return []
        # as FilterAPI.buildSubscriptionData: Java's trim (str.strip took U+3000 off "TagA\u3000"), no empty tags
        return [tag for tag in map(java_trim, self.expression.split("||")) if tag]

    def subscription_data(self, topic: str, version: int) -> dict:
        """RocketMQ's SubscriptionData, as a heartbeat and CHECK_CLIENT_CONFIG carry it."""
        return {"topic": topic, "subString": self.expression, "tagsSet": self.tags, "codeSet": [],
                "subVersion": version, "expressionType": self.expression_type, "classFilterMode": False}


def thread_stacks() -> str:
    """Every thread's stack, as a Java consumer's jstack (GET_CONSUMER_RUNNING_INFO with jstackEnable)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"{names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}"
                     for ident, frame in sys._current_frames().items())


def as_selector(expression: "str | MessageSelector") -> MessageSelector:
    return expression if isinstance(expression, MessageSelector) else MessageSelector.by_tag(expression)


@dataclass(slots=True)
class PullResult:
    """A pull's messages and where to pull next (``next_begin_offset``), with the queue's min/max."""

    status: PullStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    messages: list[MessageExt] = field(default_factory=list)


# The put statuses a RocketMQ broker answers a send-back with as SYSTEM_ERROR although it stored the copy.
DEFAULT_MAX_RECONSUME_TIMES = 16   # RocketMQ's: what a push consumer's maxReconsumeTimes -1 stands for
_STORED_LATE = frozenset({"FLUSH_DISK_TIMEOUT", "FLUSH_SLAVE_TIMEOUT", "SLAVE_NOT_AVAILABLE"})
# The same for a send (a retry's resend): its own codes, the message stored (a Java producer returns it as sent).
_SENT_LATE = frozenset({ResponseCode.FLUSH_DISK_TIMEOUT, ResponseCode.FLUSH_SLAVE_TIMEOUT,
                        ResponseCode.SLAVE_NOT_AVAILABLE})


class PullConsumer:
    """Pull messages queue by queue and manage the group's offsets yourself (DefaultMQPullConsumer).

    ``namesrv_addr``: name servers, ``;``-separated; ``group``: the consumer group; ``timeout``: seconds
    per request (a long poll adds its suspend time); ``route_ttl_s``: how long a topic route serves;
    ``credentials`` sign every request (ACL). Use it as ``async with PullConsumer(...) as consumer``.
    """

    def __init__(self, namesrv_addr: str, group: str, *, timeout: float = 3.0, instance_name: str | None = None,
                 credentials: Credentials | None = None, route_ttl_s: float = 30.0,
                 max_inflated_body: int = MAX_INFLATED_BODY):
        if max_inflated_body < 1:
            raise ValueError(f"max_inflated_body must be at least 1, not {max_inflated_body}")
        self.group = group
        # A COMPRESSED body is inflated up to this many bytes; past it (a zip bomb) it is given as stored.
        self.max_inflated_body = max_inflated_body
        self.timeout = timeout
        self.route_ttl_s = route_ttl_s
        self._route_at: dict[str, float] = {}      # topic -> time.monotonic() of its last route
        self._fetching: dict[str, asyncio.Task] = {}    # topic -> its route fetch under way, shared
        self._suspect: set[str] = set()     # brokers whose address failed: their next call waits for the route
        self.namesrv_addrs = NameServers([a.strip() for a in namesrv_addr.split(";") if a.strip()])
        try:
            ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            ip = "127.0.0.1"
        self.client_id = f"{ip}@{instance_name or f'{os.getpid()}#{time.monotonic_ns()}'}"
        self.pool = ConnectionPool(self._on_request, sign=credentials.sign if credentials else None)
        self._brokers: dict[str, str] = {}
        self._route_brokers: dict[str, set[str]] = {}     # topic -> the brokers its last route named
        self._offline: dict[str, str] = {}      # broker forgotten (no route names it) -> its last address
        self.beat_unreached: list[str] = []     # the broker addresses the last heartbeat met no answer from
        # broker addresses whose connection carried an answered heartbeat (a push consumer forgets one whose
        # connection closes: the broker dropped what it knew of the consumer with it)
        self.heard: set[str] = set()
        self.subscriptions: dict[str, "str | MessageSelector"] = {}
        self._sub_version = 0           # the last heartbeat's subVersion: each one's is later (heartbeat)
        self.on_ids_changed = None
        self.on_reset_offset = None     # fn(topic, {MessageQueue: offset}) on RESET_CONSUMER_CLIENT_OFFSET
        # fn(jstack: bool) -> the ConsumerRunningInfo body of GET_CONSUMER_RUNNING_INFO (a push consumer's replaces
        # this pull consumer's: its properties and subscriptions, no queues, as DefaultMQPullConsumerImpl's)
        self.running_info = self._running_info
        self._created_ms = int(time.time() * 1000)      # (PROP_CONSUMER_START_TIMESTAMP of a pull consumer)
        # async fn(MessageExt) -> the ConsumeMessageDirectlyResult body of CONSUME_MESSAGE_DIRECTLY (a push consumer's),
        # or a str: why it was not consumed (answered SYSTEM_ERROR), or (response code, remark)
        self.consume_directly = None
        # fn(topic) -> {MQ: offset} GET_CONSUMER_STATUS_FROM_CLIENT answers (a push consumer's replaces this pull
        # consumer's: the offsets it last committed, as a Java pull consumer answers its offset store's)
        self.consumer_status = self._committed_of
        # each queue's offset of the last commit_offset call that went through, with the call's number: calls
        # side by side reach the broker in the order they are made and it holds the later, whichever answer
        # comes back last (an answered one's comes after a oneway one made after it is sent)
        self._committed: dict[MessageQueue, tuple[int, int]] = {}
        self._commit_calls = 0
        self.reset_offsets: dict[MessageQueue, int] = {}   # the last offsets a broker reset, by queue

    async def __aenter__(self) -> "PullConsumer":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _on_request(self, conn, cmd):
        # NOTIFY_CONSUMER_IDS_CHANGED is oneway; a pull consumer does not rebalance, a push consumer does.
        if self.on_ids_changed is not None and cmd.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
            self.on_ids_changed()
        elif cmd.code == RequestCode.RESET_CONSUMER_CLIENT_OFFSET:
            return self._on_reset(cmd)
        elif cmd.code == RequestCode.GET_CONSUMER_RUNNING_INFO and self.running_info is not None:
            return self._on_running_info(cmd)
        elif cmd.code == RequestCode.CONSUME_MESSAGE_DIRECTLY and self.consume_directly is not None:
            return self._on_consume_directly(cmd)
        elif cmd.code == RequestCode.GET_CONSUMER_STATUS_FROM_CLIENT and self.consumer_status is not None:
            # (mqadmin getConsumerStatus, through the broker's 223) a Java consumer's: its offsets of the topic,
            # an empty table for a group it is not
            offsets = self.consumer_status(cmd.ext_fields.get("topic")) if cmd.ext_fields.get("group") == self.group \
                else {}
            return cmd.response(ResponseCode.SUCCESS, body=encode_client_consumer_status(offsets))
        # Said at once: left unanswered, a broker passing on an operator's GET_CONSUMER_RUNNING_INFO or
        # CONSUME_MESSAGE_DIRECTLY waited 10 s for it, and the operator's tool gave up first.
        return None if cmd.is_oneway else cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                                      f"txmq consumer does not serve request {cmd.code}")

    @property
    def sub_version(self) -> int:
        """The subVersion of the subscriptions the last heartbeat carried (0 before the first)."""
        return self._sub_version

    def _not_our_group(self, cmd):
        """SYSTEM_ERROR as a Java consumer's ClientRemotingProcessor answers a group it is not, else None."""
        group = cmd.ext_fields.get("consumerGroup")
        if group == self.group:
            return None
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"The Consumer Group <{group}> not exist in this consumer")

    def _on_running_info(self, cmd):
        """GET_CONSUMER_RUNNING_INFO (mqadmin consumerStatus, consumerProgress -s, passed on by the broker)."""
        other = self._not_our_group(cmd)
        if other is not None:
            return other
        jstack = str(cmd.ext_fields.get("jstackEnable", "false")).lower() == "true"
        return cmd.response(ResponseCode.SUCCESS, body=self.running_info(jstack))

    def running_props(self, consume_type: str, started_ms: int) -> dict[str, str]:
        """The ConsumerRunningInfo properties every Java consumer has (MQClientInstance.consumerRunningInfo adds the
        PROP_ ones to the consumer's own): a push consumer adds its settings."""
        return {"consumerGroup": self.group, "instanceName": self.client_id.split("@")[-1],
                "PROP_NAMESERVER_ADDR": "".join(f"{a};" for a in self.namesrv_addrs),
                "PROP_CONSUME_TYPE": consume_type, "PROP_CONSUMER_START_TIMESTAMP": str(started_ms),
                "PROP_CLIENT_VERSION": "V4_9_8"}

    def _running_info(self, jstack: bool) -> bytes:
        """A pull consumer's ConsumerRunningInfo, as DefaultMQPullConsumerImpl.consumerRunningInfo: its properties
        and subscriptions, no queue (it holds none: its owner pulls). Answered REQUEST_CODE_NOT_SUPPORTED,
        mqadmin consumerStatus failed on a group of txmq pull consumers."""
        props = {**self.running_props("CONSUME_ACTIVELY", self._created_ms), "messageModel": "CLUSTERING"}
        subs = [as_selector(e).subscription_data(t, self._sub_version) for t, e in self.subscriptions.items()]
        return encode_consumer_running_info(props, subs, {}, thread_stacks() if jstack else None)

    def _committed_of(self, topic: str) -> dict:
        return {(mq.topic, mq.broker_name, mq.queue_id): offset for mq, (_, offset) in self._committed.items()
                if mq.topic == topic}

    def _committed_now(self, mq: MessageQueue, call: int, offset: int) -> None:
        """``offset`` went through for ``mq`` in commit_offset call number ``call``: kept unless a later one has."""
        if call > self._committed.get(mq, (0, 0))[0]:
            self._committed[mq] = (call, offset)

    def _on_consume_directly(self, cmd):
        """CONSUME_MESSAGE_DIRECTLY (mqadmin queryMsgById -g -d, the dashboard's resend): the stored record the
        broker passed on handed to the listener once more, its ConsumeMessageDirectlyResult answered."""
        other = self._not_our_group(cmd)
        if other is not None:
            return other
        try:
            [msg] = decode_records(cmd.body_bytes())
        except (BrokerError, ValueError) as exc:
            return cmd.response(ResponseCode.SYSTEM_ERROR, f"the message passed on does not decode: {exc}")
        why = inflate(msg, self.max_inflated_body) if msg.sys_flag & SysFlag.COMPRESSED else None
        if why is not None:
            return cmd.response(ResponseCode.SYSTEM_ERROR, f"message {msg.msg_id}: {why}")

        async def answer():
            body = await self.consume_directly(msg)
            if isinstance(body, str):
                return cmd.response(ResponseCode.SYSTEM_ERROR, body)
            if isinstance(body, tuple):
                return cmd.response(*body)
            return cmd.response(ResponseCode.SUCCESS, body=body)
        return answer()

    def _on_reset(self, cmd):
        """An operator reset the group's offsets (INVOKE_BROKER_TO_RESET_OFFSET): remember them in
        ``reset_offsets`` (a pull consumer's owner reads them) and tell ``on_reset_offset``."""
        if cmd.ext_fields.get("group") not in (None, self.group):
            return None
        try:
            _obj, table = decode_mq_table(cmd.body_bytes())
            offsets = {MessageQueue(t, b, q): int(o) for (t, b, q), o in table.items()}
        except (HeaderError, TypeError, ValueError) as exc:
            log.warning("RESET_CONSUMER_CLIENT_OFFSET with a body that does not parse: %s", exc)
            return None
        self.reset_offsets.update(offsets)
        log.info("group %s: offsets of %s reset by the broker to %s", self.group, cmd.ext_fields.get("topic"),
                 {mq.queue_id: o for mq, o in offsets.items()})
        if self.on_reset_offset is not None:
            self.on_reset_offset(cmd.ext_fields.get("topic"), offsets)
        return None

    async def fetch_queues(self, topic: str) -> list[MessageQueue]:
        """The readable queues of ``topic``, from the name server (also refreshes its broker addresses)."""
        route = await self._fetch_route(topic)
        return [MessageQueue(topic, qd.broker_name, i) for qd in route.queue_datas if qd.perm & Perm.READ
                for i in range(qd.read_queue_nums)]

    async def _fetch_route(self, topic: str):
        """``topic``'s TopicRouteData from the name server (also refreshes its broker addresses)."""
        last = None
        for addr in self.namesrv_addrs:
            try:
                resp = await self.pool.request(addr, RemotingCommand.request(
                    RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic}), self.timeout)
            except Exception as exc:  # noqa: BLE001 - next name server
                self.namesrv_addrs.failed(addr, exc)
                last = exc
                continue
            self.namesrv_addrs.answered(addr)
            if resp.code != ResponseCode.SUCCESS:
                raise error_for_code(resp.code, resp.remark)
            route = decode_route(resp.body_bytes())
            for bd in route.broker_datas:
                if bd.broker_addrs:     # the master (id 0); while it is gone, a slave (RocketMQ's
                    self._brokers[bd.broker_name] = bd.broker_addrs[min(bd.broker_addrs)]  # findBrokerAddressInSubscribe)
                    self._offline.pop(bd.broker_name, None)
            self._forget_offline(topic, {bd.broker_name for bd in route.broker_datas if bd.broker_addrs})
            self._route_at[topic] = time.monotonic()
            return route
        raise last or ConnectionError("no name server")

    def _forget_offline(self, topic: str, brokers: set[str]) -> None:
        """Drop the brokers no route fetched names any more (RocketMQ's cleanOfflineBroker): kept, a broker
        retired or moved was sent every heartbeat, unlock and unregister for good, each failing (a connect
        timeout each when its host is gone).

        Its address is kept aside for the calls about its own queues alone (_broker_addr): a name server just
        restarted lists a broker only once it registers again, and the rebalance that dropped its queues
        meanwhile still commits their offsets and unlocks them there."""
        self._route_brokers[topic] = brokers
        named = set().union(*self._route_brokers.values())
        for name in [n for n in self._brokers if n not in named]:
            addr = self._offline[name] = self._brokers.pop(name)
            log.info("broker %s (%s) is in no route any more: forgotten", name, addr)
        while len(self._offline) > _MAX_OFFLINE:
            del self._offline[next(iter(self._offline))]

    def _addr(self, mq: MessageQueue) -> str:
        return self._brokers[mq.broker_name]

    def brokers_at(self, addr: str) -> set[str]:
        """The names of the brokers known at ``addr`` (those no route names any more too)."""
        return {name for name, a in (*self._brokers.items(), *self._offline.items()) if a == addr}

    async def _broker_addr(self, mq: MessageQueue) -> str:
        """``mq``'s broker address. A route older than route_ttl_s is fetched again in the background while the
        known address serves; the call waits for the fetch only when it knows no address, or its address just
        failed (then, when the name servers cannot answer, the known address still serves)."""
        known = self._brokers.get(mq.broker_name)
        stale = time.monotonic() - self._route_at.get(mq.topic, float("-inf")) >= self.route_ttl_s
        if known is not None and mq.broker_name not in self._suspect:
            if stale and mq.topic not in self._fetching:
                self._refresh(mq.topic)
            return known
        try:
            await asyncio.shield(self._fetching.get(mq.topic) or self._refresh(mq.topic))
        except Exception:
            if known is None and mq.broker_name not in self._offline:
                raise
        finally:
            self._suspect.discard(mq.broker_name)
        known = self._brokers.get(mq.broker_name) or self._offline.get(mq.broker_name)
        if known is None:
            raise error_for_code(ResponseCode.TOPIC_NOT_EXIST, f"no route of {mq.topic} names broker {mq.broker_name}")
        return known

    def _refresh(self, topic: str) -> asyncio.Task:
        """Start the one fetch of ``topic``'s route; when it fails, the route known serves another ttl."""
        task = self._fetching[topic] = asyncio.get_running_loop().create_task(self.fetch_queues(topic))

        def done(t: asyncio.Task) -> None:
            if self._fetching.get(topic) is t:
                del self._fetching[topic]
            exc = None if t.cancelled() else t.exception()
            if exc is not None:
                self._route_at[topic] = time.monotonic()
                # a name server out of reach is said by NameServers (once a minute), a topic gone by the pulls
                if not isinstance(exc, (RequestTimeoutError, ConnectionClosedError, TopicNotExistError)):
                    log.warning("route of %s: %s; the brokers known serve", topic, exc)
        task.add_done_callback(done)
        return task

    async def _request(self, mq: MessageQueue, cmd: RemotingCommand, timeout: float) -> RemotingCommand:
        """One request to ``mq``'s broker; a routing error makes the next call fetch the route again."""
        addr = await self._broker_addr(mq)
        try:
            resp = await self.pool.request(addr, cmd, timeout)
        except (ConnectionClosedError, RequestTimeoutError):
            self._unreachable(mq)
            raise
        if resp.code in (ResponseCode.TOPIC_NOT_EXIST, ResponseCode.NO_PERMISSION):
            self._unreachable(mq)
        return resp

    def _unreachable(self, mq: MessageQueue) -> None:
        """``mq``'s broker failed a call: the next one fetches the route again (a master gone: the slave)."""
        self._route_at.pop(mq.topic, None)
        self._suspect.add(mq.broker_name)

    async def subscribe(self, topic: str, expression: str | MessageSelector = "*") -> None:
        """Register the group and subscription with a heartbeat (needed only for pulls without a subscription).
        An SQL92 selector is first checked by every broker of the topic: a refusal (the broker's property filter
        is off, or the expression does not parse) raises its ResponseError and subscribes nothing."""
        await self.fetch_queues(topic)
        await self.check_subscription(topic, expression)
        self.subscriptions[topic] = expression
        await self.heartbeat()

    async def check_subscription(self, topic: str, expression: str | MessageSelector) -> None:
        """CHECK_CLIENT_CONFIG, as a Java consumer sends it at start for each subscription that is not by tag
        (MQClientInstance.checkClientInBroker), to every broker known. A refusal raises; a broker out of reach
        (a timeout, a closed connection) is passed over while another accepts (the Java client asks one broker of
        the topic), else its failure raises: one broker hanging kept a consumer from starting."""
        selector = as_selector(expression)
        if selector.is_tag:
            return
        body = json.dumps({"clientId": self.client_id, "group": self.group,
                           "subscriptionData": selector.subscription_data(topic, 0)}).encode()
        unreached, accepted = None, False
        for addr in dict.fromkeys(self._brokers.values()):
            try:
                resp = await self.pool.request(addr, RemotingCommand.request(RequestCode.CHECK_CLIENT_CONFIG,
                                                                             body=body), self.timeout)
            except (RequestTimeoutError, ConnectionClosedError) as exc:
                log.warning("group %s: broker %s did not check the %s expression %r: %s", self.group, addr,
                            selector.expression_type, selector.expression, exc)
                unreached = unreached or exc
                continue
            if resp.code != ResponseCode.SUCCESS:
                raise error_for_code(resp.code, f"broker {addr} refuses {selector.expression_type} expression "
                                                f"{selector.expression!r}: {resp.remark}")
            accepted = True
        if unreached is not None and not accepted:
            raise unreached

    async def heartbeat(self, consume_type: str = "CONSUME_ACTIVELY",
                        consume_from: str = "CONSUME_FROM_FIRST_OFFSET", message_model: str = "CLUSTERING", *,
                        only: list[str] | None = None) -> None:
        """Announce the group and its subscriptions to every known broker (``only``: those of them at these
        addresses); a broker that does not answer does not keep the others from hearing (once all were tried, the
        first refusal is raised, else the first failure)."""
        # A broker keeps a group's subscription with the newest subVersion (RocketMQ). By the wall clock alone,
        # after it stepped back every heartbeat's was older than the one kept, and a subscription changed then
        # was kept out (said by the broker, txmq_subscriptions_kept_older_total): this process's never go back.
        version = self._sub_version = max(int(time.time() * 1000), self._sub_version + 1)
        subs = [as_selector(e).subscription_data(t, version) for t, e in self.subscriptions.items()]
        body = json.dumps({"clientID": self.client_id, "producerDataSet": [], "consumerDataSet": [{
            "groupName": self.group, "consumeType": consume_type, "messageModel": message_model,
            "consumeFromWhere": consume_from, "subscriptionDataSet": subs, "unitMode": False}]})
        failed = None
        unreached = []
        for addr in dict.fromkeys(self._brokers.values()):     # in the order learnt
            if only is not None and addr not in only:
                continue
            try:
                resp = await self.pool.request(addr, RemotingCommand.request(RequestCode.HEART_BEAT,
                                                                             body=body.encode()), self.timeout)
                if resp.code != ResponseCode.SUCCESS:
                    raise error_for_code(resp.code, resp.remark)
                self.heard.add(addr)
            except BrokerError as exc:      # a refusal is raised before a broker out of reach (start tells them apart)
                if not isinstance(exc, ResponseError):
                    unreached.append(addr)
                if failed is None or isinstance(exc, ResponseError) and not isinstance(failed, ResponseError):
                    failed = exc
        # the brokers this beat did not reach, refused by another or not: a push consumer beats them again soon.
        # A beat of some (``only``) leaves what is known of the others: the push consumer's beat of one broker
        # before an answered commit there made one still down look reached, and its retries stopped.
        self.beat_unreached = unreached if only is None else [
            *(a for a in self.beat_unreached if a not in only), *unreached]
        if failed is not None:
            raise failed

    async def unheard(self, mq: MessageQueue) -> str | None:
        """The address of ``mq``'s broker when the connection to it has carried no answered heartbeat of this
        group (new, or a broker the last heartbeat did not know), else None. An answered UPDATE_CONSUMER_OFFSET
        on such a connection is taken for an admin tool's move: said at WARNING, saved before its answer."""
        addr = await self._broker_addr(mq)
        return None if addr in self.heard else addr

    async def pull(self, mq: MessageQueue, offset: int, *, max_nums: int = 32,
                   expression: str | MessageSelector = "*", suspend_ms: int = 0,
                   commit_offset: int | None = None) -> PullResult:
        """One pull; with ``suspend_ms`` > 0 the broker holds it until a message arrives (long polling).
        ``expression``: tags (``"a || b"``) or a ``MessageSelector``."""
        selector = as_selector(expression)
        sys_flag = PullSysFlag.SUBSCRIPTION
        if suspend_ms > 0:
            sys_flag |= PullSysFlag.SUSPEND
        if commit_offset is not None:
            sys_flag |= PullSysFlag.COMMIT_OFFSET
        cmd = RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": self.group, "topic": mq.topic, "queueId": mq.queue_id, "queueOffset": offset,
            "maxMsgNums": max_nums, "sysFlag": sys_flag, "commitOffset": commit_offset or 0,
            "suspendTimeoutMillis": suspend_ms, "subscription": selector.expression, "subVersion": 0,
            "expressionType": selector.expression_type})
        resp = await self._request(mq, cmd, self.timeout + suspend_ms / 1000)
        if resp.code not in (0, 19, 20, 21):
            raise error_for_code(resp.code, resp.remark)
        messages = decode_records(resp.body_bytes()) if resp.code == ResponseCode.SUCCESS else []
        for m in messages:
            if m.sys_flag & SysFlag.COMPRESSED:
                why = inflate(m, self.max_inflated_body)
                if why is not None:
                    log.error("message %s of %s (queue %d offset %d): %s; it is given as stored, sysFlag "
                              "COMPRESSED still set", m.msg_id, m.topic, m.queue_id, m.queue_offset, why)
        if tags := selector.tags:       # SQL92 has none: only the broker can tell
            tags = set(tags)
            messages = [m for m in messages if m.tags in tags]
        return PullResult(PullStatus(resp.code), resp.int_field("nextBeginOffset", offset),
                          resp.int_field("minOffset", 0), resp.int_field("maxOffset", 0), messages)

    async def drain(self, mq: MessageQueue, offset: int, *, max_nums: int = 32,
                    expression: str | MessageSelector = "*",
                    inflight: int = 4) -> AsyncIterator[PullResult]:
        """Pull ``mq`` from ``offset`` until caught up, with up to ``inflight`` pulls in flight.

        Yields every pull's result in queue order, each pull starting at the previous one's
        ``next_begin_offset``; the last result yielded is the first that is neither FOUND nor
        NO_MATCHED_MSG (NO_NEW_MSG once caught up, OFFSET_ILLEGAL), or a NO_MATCHED_MSG that did not
        move the offset (a slave behind its master answers so for an offset it lacks). The pulls after the first are
        sent before their offsets are known: each is guessed to start where the previous one
        advanced by as much as the last result did (``max_nums`` at first; queue offsets are dense,
        so a pull that found ``max_nums`` messages unfiltered ends ``max_nums`` further), never past
        the queue's last known max offset. A result that ends elsewhere drops the pulls sent after
        it (their answers are not used) and the next ones start where it ended, so what is yielded is
        what one pull at a time would give. No long polling and no offset commit: commit with
        ``commit_offset`` (the last result's ``next_begin_offset``). Close it early with
        ``contextlib.aclosing`` (or let ``break`` and the loop's async-generator finalizer do it).
        """
        if inflight < 1:
            raise ValueError(f"inflight must be at least 1, not {inflight}")
        pending: collections.deque = collections.deque()      # (offset, task), in queue order
        create_task = asyncio.get_running_loop().create_task
        step, guess, max_known = max_nums, offset, None

        dropped: set = set()

        def cancel_pending():
            for _, task in pending:
                task.cancel()
                dropped.add(task)
                # A dropped pull's failure (a timeout, a closed connection) is not this drain's.
                task.add_done_callback(lambda t: dropped.discard(t) or t.cancelled() or t.exception())
            pending.clear()

        try:
            while True:
                # Topped up once half are answered, so the new requests leave together (one write,
                # and the broker's answers to them go back in one write too).
                if len(pending) <= inflight // 2:
                    while len(pending) < inflight and (not pending or max_known is None or guess < max_known):
                        pending.append((guess, create_task(self.pull(mq, guess, max_nums=max_nums,
                                                                     expression=expression))))
                        guess += step
                at, task = pending.popleft()
                res = await task
                yield res
                if res.status not in (PullStatus.FOUND, PullStatus.NO_MATCHED_MSG):
                    return
                if res.status is PullStatus.NO_MATCHED_MSG and res.next_begin_offset == at:
                    return          # a slave behind its master: it has nothing at ``at`` yet
                max_known = res.max_offset
                if res.next_begin_offset > at:
                    step = res.next_begin_offset - at
                if res.next_begin_offset != (pending[0][0] if pending else guess):
                    cancel_pending()
                    guess = res.next_begin_offset
        finally:
            cancel_pending()
            if dropped:         # settled before the caller goes on (they wait for no answer then)
                await asyncio.gather(*dropped, return_exceptions=True)

    async def _offset_call(self, code, mq: MessageQueue, **extra) -> RemotingCommand:
        fields = {"topic": mq.topic, "queueId": mq.queue_id, **extra}
        return await self._request(mq, RemotingCommand.request(code, fields), self.timeout)

    async def commit_offset(self, mq: MessageQueue, offset: int, *, oneway: bool = False) -> None:
        """Store the group's offset for ``mq`` on its broker (the next message to consume). ``oneway``: sent with
        no reply asked for, as a Java consumer's periodic persistAll (RemoteBrokerOffsetStore, isOneway true): an
        answered commit on a connection the broker has seen neither a heartbeat nor a pull of the group on (just
        reconnected to a restarted broker) is taken for an admin tool's move, and answered only once the broker's
        offsets file holds it (past an address's budget of such saves, after its next periodic save). An answered
        commit that gives the group its first offset of ``mq`` is answered once the broker has it on disk too (a
        line of its first offsets' journal, one fsync: a few ms whatever the size of its offsets table; the commits
        side by side, ``asyncio.gather``, share the fsync; a disk that cannot take it: SYSTEM_ERROR "... not
        saved")."""
        self._commit_calls += 1
        call = self._commit_calls
        if oneway:
            addr = await self._broker_addr(mq)
            try:
                await self.pool.oneway(addr, RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET, {
                    "topic": mq.topic, "queueId": mq.queue_id, "consumerGroup": self.group, "commitOffset": offset},
                    oneway=True))
            except (ConnectionClosedError, RequestTimeoutError):
                # as an answered call's (_request): else the commits went on to a dead master until a pull or
                # the route's age refetched it, not to the slave the route names while it is gone
                self._unreachable(mq)
                raise
            self._committed_now(mq, call, offset)
            return
        resp = await self._offset_call(RequestCode.UPDATE_CONSUMER_OFFSET, mq, consumerGroup=self.group,
                                       commitOffset=offset)
        if resp.code != ResponseCode.SUCCESS:
            raise error_for_code(resp.code, resp.remark)
        self._committed_now(mq, call, offset)

    async def consumer_ids(self, mq: MessageQueue) -> list[str]:
        """Client ids of the group's live consumers, as ``mq``'s broker knows them."""
        resp = await self._request(mq, RemotingCommand.request(
            RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": self.group}), self.timeout)
        if resp.code != ResponseCode.SUCCESS:
            return []
        return json.loads(resp.body_bytes()).get("consumerIdList") or []

    async def lock_queues(self, mqs: list[MessageQueue] | set[MessageQueue]) -> set[MessageQueue]:
        """LOCK_BATCH_MQ: ask the brokers for exclusive use of ``mqs`` within the group (orderly
        consumption); returns the queues granted. A lock lasts the broker's queue_lock_max_live_ms
        unless renewed."""
        return await self._lock_call(RequestCode.LOCK_BATCH_MQ, mqs)

    async def unlock_queues(self, mqs: list[MessageQueue] | set[MessageQueue]) -> None:
        """UNLOCK_BATCH_MQ: give queues up so another consumer of the group can lock them at once.

        Every broker is asked, whatever the others answer: one that cannot be reached does not keep the
        other brokers' queues locked until they expire. Each failure is logged; the first is raised once
        all were asked (that broker's locks expire after its queue_lock_max_live_ms)."""
        failed = None
        for broker_name, queues in self._by_broker(mqs).items():
            try:
                await self._lock_call_one(RequestCode.UNLOCK_BATCH_MQ, queues)
            except Exception as exc:  # noqa: BLE001 - a route lookup may fail with anything; the next broker is still asked
                log.warning("group %s: could not unlock %d queue(s) on broker %s: %s", self.group, len(queues),
                            broker_name, exc)
                failed = failed or exc
        if failed is not None:
            raise failed

    @staticmethod
    def _by_broker(mqs) -> dict[str, list[MessageQueue]]:
        by_broker: dict[str, list[MessageQueue]] = {}
        for mq in mqs:
            by_broker.setdefault(mq.broker_name, []).append(mq)
        return by_broker

    async def _lock_call(self, code, mqs) -> set[MessageQueue]:
        granted: set[MessageQueue] = set()
        for queues in self._by_broker(mqs).values():
            granted |= await self._lock_call_one(code, queues)
        return granted

    async def _lock_call_one(self, code, queues: list[MessageQueue]) -> set[MessageQueue]:
        """One LOCK/UNLOCK_BATCH_MQ to the broker of ``queues`` (all of one broker); the queues granted."""
        body = json.dumps({"consumerGroup": self.group, "clientId": self.client_id, "mqSet": [
            {"topic": q.topic, "brokerName": q.broker_name, "queueId": q.queue_id} for q in queues]})
        resp = await self._request(queues[0], RemotingCommand.request(code, body=body.encode()), self.timeout)
        if resp.code != ResponseCode.SUCCESS:
            raise error_for_code(resp.code, resp.remark)
        if code != RequestCode.LOCK_BATCH_MQ:
            return set()
        return {MessageQueue(q["topic"], q["brokerName"], int(q["queueId"]))
                for q in json.loads(resp.body_bytes() or b"{}").get("lockOKMQSet") or []}

    async def send_back(self, mq: MessageQueue, msg: MessageExt, *, max_reconsume_times: int = 16,
                        delay_level: int = 0) -> None:
        """Give a failed message (pulled from ``mq``) back to the broker: %RETRY%<group>, or %DLQ%<group>
        when out of retries (``delay_level`` -1: at once). ``max_reconsume_times`` -1 means RocketMQ's default, 16.

        The broker copies the stored record. When it refuses (that record is gone, deleted by retention
        while the message was in hand, or its body went bad on disk since the pull), the message as pulled
        is sent to %RETRY%<group> instead, as RocketMQ's consumer does, with the same retry properties;
        only if that fails too does this raise (the second error, the broker's refusal as its cause). A refusal
        naming a late flush or slave (FLUSH_DISK_TIMEOUT, FLUSH_SLAVE_TIMEOUT, SLAVE_NOT_AVAILABLE: a RocketMQ
        broker's SYNC_FLUSH or SYNC_MASTER) is not one: the copy is stored, and nothing more is sent."""
        if max_reconsume_times < -1:    # sent, the broker read it as no retries left: dead-lettered at once
            raise ValueError(f"max_reconsume_times={max_reconsume_times!r}: 0 or more, or -1 for the default")
        if max_reconsume_times == -1:   # RocketMQ's "default", never sent as such: the broker reads -1 as none
            max_reconsume_times = DEFAULT_MAX_RECONSUME_TIMES
        origin_topic = _origin_topic(mq, msg)
        cmd = RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
            "offset": msg.physical_offset, "group": self.group, "delayLevel": delay_level,
            "originMsgId": msg.msg_id, "originTopic": origin_topic, "maxReconsumeTimes": max_reconsume_times})
        resp = await self._request(mq, cmd, self.timeout)
        if resp.code == ResponseCode.SUCCESS:
            return
        if resp.code == ResponseCode.SYSTEM_ERROR and resp.remark in _STORED_LATE:
            # RocketMQ's broker: the copy is stored, only its flush or its slave was late. Resent, it came twice.
            log.warning("group %s: %s handed back to %s, stored there but %s", self.group, msg.msg_id, mq,
                        resp.remark)
            return
        refused = error_for_code(resp.code, resp.remark)
        # Retried here instead, the message came back to the listener every second for good, never counted
        # towards max_reconsume_times nor dead-lettered, and nothing after it in the queue was consumed.
        log.warning("group %s: broker refused to take back %s of %s (%s); sending it to %%RETRY%%%s itself",
                    self.group, msg.msg_id, mq, refused, self.group)
        try:
            await self._resend_for_retry(mq, msg, origin_topic, max_reconsume_times, delay_level)
        except BrokerError as exc:
            raise exc from refused

    async def dead_letter(self, mq: MessageQueue, msg: MessageExt, *, max_reconsume_times: int) -> None:
        """Give an orderly consumer's message (pulled from ``mq``) that ran out of retries in place to
        %DLQ%<group>, as RocketMQ's ConsumeMessageOrderlyService.sendMessageBack does: a send to %RETRY%<group>
        whose count is ``msg.reconsume_times``, the retries counted here, which the broker dead-letters. Handed back
        with CONSUMER_SEND_MSG_BACK and delayLevel -1, the broker counts from the stored record (0): every orderly
        dead letter said RECONSUME_TIMES 1, whatever retries it had.

        Refused (a group name of 121 or 122 characters, whose %RETRY% topic is past the 127-character limit where
        its %DLQ% one is not; a broker without the retry topic and auto-creation), it is handed back with delayLevel
        -1 as before, its count 1, rather than kept from the dead-letter queue for good, its queue stalled behind
        it. Not after a timeout or a lost connection: the send may have been stored."""
        origin_topic = _origin_topic(mq, msg)
        try:
            await self._resend_for_retry(mq, msg, origin_topic, max_reconsume_times, -1)
        except ResponseError as exc:
            log.warning("group %s: %s not dead-lettered with its count (%s); handing it back with delayLevel -1",
                        self.group, msg.msg_id, exc)
            await self.send_back(mq, msg, max_reconsume_times=max_reconsume_times, delay_level=-1)

    async def _resend_for_retry(self, mq: MessageQueue, msg: MessageExt, origin_topic: str,
                                max_reconsume_times: int, delay_level: int) -> None:
        """The message as pulled, sent to %RETRY%<group> on ``mq``'s broker with RocketMQ's retry properties
        (DefaultMQPushConsumerImpl.sendMessageBack's fallback); the broker dead-letters it when its count says
        so. ``delay_level`` -1 sends it with the count at least ``max_reconsume_times``: straight to %DLQ%<group>."""
        props = dict(msg.properties)
        props.setdefault(Prop.ORIGIN_MESSAGE_ID, msg.msg_id)
        props[Prop.RETRY_TOPIC] = origin_topic
        times = max(max_reconsume_times, msg.reconsume_times) if delay_level < 0 else msg.reconsume_times + 1
        props[Prop.RECONSUME_TIME] = str(times)
        props[Prop.MAX_RECONSUME_TIMES] = str(max_reconsume_times)
        props[Prop.DELAY] = str(delay_level if delay_level > 0 else 3 + max(msg.reconsume_times, 0))
        props.pop(Prop.TRAN_MSG, None)      # a retry is a plain message, never a half
        for stale in (Prop.REAL_TOPIC, Prop.REAL_QID, Prop.WAIT):
            props.pop(stale, None)
        retry_topic = f"%RETRY%{self.group}"

        def command() -> RemotingCommand:
            return RemotingCommand.request(RequestCode.SEND_MESSAGE, {
                "producerGroup": "CLIENT_INNER_PRODUCER", "topic": retry_topic, "defaultTopic": "TBW102",
                "defaultTopicQueueNums": 1, "queueId": 0,
                # still COMPRESSED only when it did not inflate: the body goes as it came
                "sysFlag": msg.sys_flag & SysFlag.COMPRESSED, "bornTimestamp": int(time.time() * 1000),
                "flag": msg.flag, "properties": properties_to_string(props), "reconsumeTimes": times,
                "unitMode": False, "maxReconsumeTimes": max_reconsume_times}, body=msg.body)
        resp = await self._request(mq, command(), self.timeout)
        if resp.code == ResponseCode.SUCCESS or _sent_late(self.group, msg, retry_topic, mq.broker_name, resp):
            return
        refused = error_for_code(resp.code, f"resending {msg.msg_id} to {retry_topic} on {mq.broker_name}: "
                                            f"{resp.remark}")
        if resp.code not in (ResponseCode.NO_PERMISSION, ResponseCode.SERVICE_NOT_AVAILABLE):
            raise refused
        # That broker takes no new message (read-only for maintenance: brokerPermission 4, or a slave, or a full
        # disk): the retry topic's other writable brokers, as RocketMQ's fallback producer routes it. On mq's
        # broker alone, each failed message of a read-only broker was retried in place for as long as it stayed
        # so, and its backlog -- what an operator makes it read-only to drain -- never drained past it.
        try:
            route = await self._fetch_route(retry_topic)
        except Exception as exc:  # noqa: BLE001 - no route: the broker's refusal is what the caller needs
            log.info("group %s: no route of %s to resend %s elsewhere: %s", self.group, retry_topic, msg.msg_id, exc)
            raise refused from None
        masters = {bd.broker_name: bd.broker_addrs[0] for bd in route.broker_datas if 0 in bd.broker_addrs}
        for qd in sorted(route.queue_datas, key=lambda q: q.broker_name):
            addr = masters.get(qd.broker_name)
            if qd.broker_name == mq.broker_name or not qd.perm & Perm.WRITE or addr is None:
                continue
            try:
                resp = await self.pool.request(addr, command(), self.timeout)
            except (ConnectionClosedError, RequestTimeoutError) as exc:
                log.warning("group %s: resending %s to %s on %s: %s", self.group, msg.msg_id, retry_topic,
                            qd.broker_name, exc)
                continue
            if resp.code == ResponseCode.SUCCESS or _sent_late(self.group, msg, retry_topic, qd.broker_name, resp):
                return
            log.warning("group %s: resending %s to %s on %s refused: %s", self.group, msg.msg_id, retry_topic,
                        qd.broker_name, resp.remark)
        raise refused

    async def fetch_offset(self, mq: MessageQueue) -> int | None:
        """The group's stored offset for ``mq``, or None when it has none. Kept as this consumer's offset of ``mq``
        (its 221 answer, mqadmin getConsumerStatus) until a commit made after it, as a Java pull consumer's
        fetchConsumeOffset(mq, true) puts it in its offset store: left out, a consumer that fetched its offsets
        and had not committed yet answered an empty table."""
        before = self._commit_calls      # (commits made before it reach the broker first, on the one connection)
        resp = await self._offset_call(RequestCode.QUERY_CONSUMER_OFFSET, mq, consumerGroup=self.group)
        if resp.code == ResponseCode.QUERY_NOT_FOUND:
            return None
        if resp.code != ResponseCode.SUCCESS:
            raise error_for_code(resp.code, resp.remark)
        offset = resp.int_field("offset")
        if before >= self._committed.get(mq, (0, 0))[0]:
            self._committed[mq] = (before, offset)
        return offset

    async def max_offset(self, mq: MessageQueue) -> int:
        """The offset after the last message of ``mq``."""
        resp = await self._offset_call(RequestCode.GET_MAX_OFFSET, mq)
        return _offset(resp)

    async def min_offset(self, mq: MessageQueue) -> int:
        """The offset of the oldest message ``mq`` still holds."""
        resp = await self._offset_call(RequestCode.GET_MIN_OFFSET, mq)
        return _offset(resp)

    async def search_offset(self, mq: MessageQueue, timestamp_ms: int) -> int:
        """The offset of the message of ``mq`` stored nearest ``timestamp_ms`` (RocketMQ's searchOffset): the first
        stored at it, else the nearer of the last before and the first after (the earlier on a tie), so it may
        be one stored before ``timestamp_ms``; the last message for a time after it; an empty queue's end."""
        resp = await self._offset_call(RequestCode.SEARCH_OFFSET_BY_TIMESTAMP, mq, timestamp=timestamp_ms)
        return _offset(resp)

    async def shutdown(self) -> None:
        """Unregister from the brokers and close the connections."""
        for task in list(self._fetching.values()):
            task.cancel()
        for addr in set(self._brokers.values()):
            try:
                await self.pool.request(addr, RemotingCommand.request(RequestCode.UNREGISTER_CLIENT, {
                    "clientID": self.client_id, "consumerGroup": self.group}), 1.0)
            except Exception:  # noqa: BLE001 - best effort
                pass
        await self.pool.close()


def _sent_late(group: str, msg: MessageExt, topic: str, broker: str, resp: RemotingCommand) -> bool:
    """True (said at WARNING) when a resend was stored though its flush or slave was late (a SYNC_MASTER with no
    slave: SLAVE_NOT_AVAILABLE). Read as a refusal, the caller sent it again: an orderly dead letter stored twice
    in %DLQ%<group> (handed back with delayLevel -1 after it), a retry resent for good."""
    if resp.code not in _SENT_LATE:
        return False
    log.warning("group %s: %s resent to %s on %s, stored there but %s", group, msg.msg_id, topic, broker,
                ResponseCode(resp.code).name)
    return True


def _origin_topic(mq: MessageQueue, msg: MessageExt) -> str:
    """The topic a handed-back message retries as: a retry's copy names its first copy's topic; any other message
    is its queue's (a push consumer has set msg.topic to RETRY_TOPIC, and a message forwarded from a retry carries
    its source's RETRY_TOPIC)."""
    return msg.properties.get(Prop.RETRY_TOPIC, msg.topic) if mq.topic.startswith(("%RETRY%", "%DLQ%")) else mq.topic


def _offset(resp: RemotingCommand) -> int:
    """The offset an offset query answered; a refusal raises (read as 0, a consumer told to start a queue at
    its last offset started at its first: every message again)."""
    if resp.code != ResponseCode.SUCCESS:
        raise error_for_code(resp.code, resp.remark)
    return resp.int_field("offset", 0)
