"""PullConsumer: pull by queue from an offset, with long polling, and commit offsets. Plain RocketMQ 4.x."""
from __future__ import annotations

import enum
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from protocol.admin_bodies import decode_mq_table
from protocol.codes import Perm, PullSysFlag, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import ConnectionPool
from protocol.errors import HeaderError, error_for_code
from protocol.message import MessageExt, decode_records
from protocol.route import decode_route
from protocol.signature import Credentials

log = logging.getLogger("txmq.consumer")


@dataclass(frozen=True, slots=True)
class MessageQueue:
    topic: str
    broker_name: str
    queue_id: int


class PullStatus(enum.Enum):
    FOUND = ResponseCode.SUCCESS
    NO_NEW_MSG = ResponseCode.PULL_NOT_FOUND
    NO_MATCHED_MSG = ResponseCode.PULL_RETRY_IMMEDIATELY
    OFFSET_ILLEGAL = ResponseCode.PULL_OFFSET_MOVED


@dataclass(slots=True)
class PullResult:
    status: PullStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    messages: list[MessageExt] = field(default_factory=list)


class PullConsumer:
    def __init__(self, namesrv_addr: str, group: str, *, timeout: float = 3.0, instance_name: str | None = None,
                 credentials: Credentials | None = None):
        self.group = group
        self.timeout = timeout
        self.namesrv_addrs = [a.strip() for a in namesrv_addr.split(";") if a.strip()]
        try:
            ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            ip = "127.0.0.1"
        self.client_id = f"{ip}@{instance_name or f'{os.getpid()}#{time.monotonic_ns()}'}"
        self.pool = ConnectionPool(self._on_request, sign=credentials.sign if credentials else None)
        self._brokers: dict[str, str] = {}
        self.subscriptions: dict[str, str] = {}
        self.on_ids_changed = None
        self.on_reset_offset = None     # fn(topic, {MessageQueue: offset}) on RESET_CONSUMER_CLIENT_OFFSET
        self.reset_offsets: dict[MessageQueue, int] = {}   # the last offsets a broker reset, by queue

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.shutdown()

    def _on_request(self, conn, cmd):
        # NOTIFY_CONSUMER_IDS_CHANGED is oneway; a pull consumer does not rebalance, a push consumer does.
        if self.on_ids_changed is not None and cmd.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
            self.on_ids_changed()
        elif cmd.code == RequestCode.RESET_CONSUMER_CLIENT_OFFSET:
            return self._on_reset(cmd)
        return None

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
        last = None
        for addr in self.namesrv_addrs:
            try:
                resp = await self.pool.request(addr, RemotingCommand.request(
                    RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic}), self.timeout)
            except Exception as exc:  # noqa: BLE001 - next name server
                last = exc
                continue
            if resp.code != ResponseCode.SUCCESS:
                raise error_for_code(resp.code, resp.remark)
            route = decode_route(resp.body_bytes())
            for bd in route.broker_datas:
                if 0 in bd.broker_addrs:
                    self._brokers[bd.broker_name] = bd.broker_addrs[0]
            return [MessageQueue(topic, qd.broker_name, i) for qd in route.queue_datas if qd.perm & Perm.READ
                    for i in range(qd.read_queue_nums)]
        raise last or ConnectionError("no name server")

    def _addr(self, mq: MessageQueue) -> str:
        return self._brokers[mq.broker_name]

    async def subscribe(self, topic: str, expression: str = "*") -> None:
        """Register the group and subscription with a heartbeat (needed only for pulls without a subscription)."""
        self.subscriptions[topic] = expression
        await self.fetch_queues(topic)
        await self.heartbeat()

    async def heartbeat(self, consume_type: str = "CONSUME_ACTIVELY",
                        consume_from: str = "CONSUME_FROM_FIRST_OFFSET", message_model: str = "CLUSTERING") -> None:
        subs = [{"topic": t, "subString": e, "tagsSet": [] if e == "*" else [x.strip() for x in e.split("||")],
                 "codeSet": [], "subVersion": int(time.time() * 1000), "expressionType": "TAG",
                 "classFilterMode": False} for t, e in self.subscriptions.items()]
        body = json.dumps({"clientID": self.client_id, "producerDataSet": [], "consumerDataSet": [{
            "groupName": self.group, "consumeType": consume_type, "messageModel": message_model,
            "consumeFromWhere": consume_from, "subscriptionDataSet": subs, "unitMode": False}]})
        for addr in set(self._brokers.values()):
            resp = await self.pool.request(addr, RemotingCommand.request(RequestCode.HEART_BEAT, body=body.encode()),
                                           self.timeout)
            if resp.code != ResponseCode.SUCCESS:
                raise error_for_code(resp.code, resp.remark)

    async def pull(self, mq: MessageQueue, offset: int, *, max_nums: int = 32, expression: str = "*",
                   suspend_ms: int = 0, commit_offset: int | None = None) -> PullResult:
        """One pull; with ``suspend_ms`` > 0 the broker holds it until a message arrives (long polling)."""
        sys_flag = PullSysFlag.SUBSCRIPTION
        if suspend_ms > 0:
            sys_flag |= PullSysFlag.SUSPEND
        if commit_offset is not None:
            sys_flag |= PullSysFlag.COMMIT_OFFSET
        cmd = RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": self.group, "topic": mq.topic, "queueId": mq.queue_id, "queueOffset": offset,
            "maxMsgNums": max_nums, "sysFlag": sys_flag, "commitOffset": commit_offset or 0,
            "suspendTimeoutMillis": suspend_ms, "subscription": expression, "subVersion": 0,
            "expressionType": "TAG"})
        resp = await self.pool.request(self._addr(mq), cmd, self.timeout + suspend_ms / 1000)
        if resp.code not in (0, 19, 20, 21):
            raise error_for_code(resp.code, resp.remark)
        messages = decode_records(resp.body_bytes()) if resp.code == ResponseCode.SUCCESS else []
        if expression not in ("", "*"):
            tags = {t.strip() for t in expression.split("||")}
            messages = [m for m in messages if m.tags in tags]
        return PullResult(PullStatus(resp.code), resp.int_field("nextBeginOffset", offset),
                          resp.int_field("minOffset", 0), resp.int_field("maxOffset", 0), messages)

    async def _offset_call(self, code, mq: MessageQueue, **extra) -> RemotingCommand:
        fields = {"topic": mq.topic, "queueId": mq.queue_id, **extra}
        return await self.pool.request(self._addr(mq), RemotingCommand.request(code, fields), self.timeout)

    async def commit_offset(self, mq: MessageQueue, offset: int) -> None:
        resp = await self._offset_call(RequestCode.UPDATE_CONSUMER_OFFSET, mq, consumerGroup=self.group,
                                       commitOffset=offset)
        if resp.code != ResponseCode.SUCCESS:
            raise error_for_code(resp.code, resp.remark)

    async def consumer_ids(self, mq: MessageQueue) -> list[str]:
        resp = await self.pool.request(self._addr(mq), RemotingCommand.request(
            RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": self.group}), self.timeout)
        if resp.code != ResponseCode.SUCCESS:
            return []
        return json.loads(resp.body_bytes()).get("consumerIdList") or []

    async def lock_queues(self, mqs) -> set[MessageQueue]:
        """LOCK_BATCH_MQ: ask the brokers for exclusive use of ``mqs`` within the group (orderly
        consumption); returns the queues granted. A lock lasts the broker's queue_lock_max_live_ms
        unless renewed."""
        return await self._lock_call(RequestCode.LOCK_BATCH_MQ, mqs)

    async def unlock_queues(self, mqs) -> None:
        """UNLOCK_BATCH_MQ: give queues up so another consumer of the group can lock them at once."""
        await self._lock_call(RequestCode.UNLOCK_BATCH_MQ, mqs)

    async def _lock_call(self, code, mqs) -> set[MessageQueue]:
        by_broker: dict[str, list[MessageQueue]] = {}
        for mq in mqs:
            by_broker.setdefault(mq.broker_name, []).append(mq)
        granted: set[MessageQueue] = set()
        for broker_name, queues in by_broker.items():
            body = json.dumps({"consumerGroup": self.group, "clientId": self.client_id, "mqSet": [
                {"topic": q.topic, "brokerName": q.broker_name, "queueId": q.queue_id} for q in queues]})
            resp = await self.pool.request(self._brokers[broker_name], RemotingCommand.request(
                code, body=body.encode()), self.timeout)
            if resp.code != ResponseCode.SUCCESS:
                raise error_for_code(resp.code, resp.remark)
            if code == RequestCode.LOCK_BATCH_MQ:
                for q in json.loads(resp.body_bytes() or b"{}").get("lockOKMQSet") or []:
                    granted.add(MessageQueue(q["topic"], q["brokerName"], int(q["queueId"])))
        return granted

    async def send_back(self, mq: MessageQueue, msg: MessageExt, *, max_reconsume_times: int = 16,
                        delay_level: int = 0) -> None:
        """Give a failed message (pulled from ``mq``) back to the broker: %RETRY%<group>, or %DLQ%<group>
        when out of retries."""
        addr = self._addr(mq)
        cmd = RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
            "offset": msg.physical_offset, "group": self.group, "delayLevel": delay_level,
            "originMsgId": msg.msg_id, "originTopic": msg.properties.get("RETRY_TOPIC", msg.topic),
            "maxReconsumeTimes": max_reconsume_times})
        resp = await self.pool.request(addr, cmd, self.timeout)
        if resp.code != ResponseCode.SUCCESS:
            raise error_for_code(resp.code, resp.remark)

    async def fetch_offset(self, mq: MessageQueue) -> int | None:
        resp = await self._offset_call(RequestCode.QUERY_CONSUMER_OFFSET, mq, consumerGroup=self.group)
        if resp.code == ResponseCode.QUERY_NOT_FOUND:
            return None
        if resp.code != ResponseCode.SUCCESS:
            raise error_for_code(resp.code, resp.remark)
        return resp.int_field("offset")

    async def max_offset(self, mq: MessageQueue) -> int:
        resp = await self._offset_call(RequestCode.GET_MAX_OFFSET, mq)
        return resp.int_field("offset", 0)

    async def min_offset(self, mq: MessageQueue) -> int:
        resp = await self._offset_call(RequestCode.GET_MIN_OFFSET, mq)
        return resp.int_field("offset", 0)

    async def search_offset(self, mq: MessageQueue, timestamp_ms: int) -> int:
        resp = await self._offset_call(RequestCode.SEARCH_OFFSET_BY_TIMESTAMP, mq, timestamp=timestamp_ms)
        return resp.int_field("offset", 0)

    async def shutdown(self) -> None:
        for addr in set(self._brokers.values()):
            try:
                await self.pool.request(addr, RemotingCommand.request(RequestCode.UNREGISTER_CLIENT, {
                    "clientID": self.client_id, "consumerGroup": self.group}), 1.0)
            except Exception:  # noqa: BLE001 - best effort
                pass
        await self.pool.close()
