"""PushConsumer: RocketMQ's clustering push consumer over PullConsumer — rebalance, long-poll loops,
retries through the broker, periodic offset commits. At-least-once; see consumer/idempotent.py for once.

Each subscribed topic, and the group's %RETRY% topic, is split among the group's live consumers
(allocate_averagely over GET_CONSUMER_LIST_BY_GROUP, redone every ``rebalance_interval_s`` and when
the broker says the group changed). Each owned queue has one pull loop. A message whose listener
returns RECONSUME_LATER (or raises) goes back to the broker (CONSUMER_SEND_MSG_BACK), which
redelivers it through %RETRY%<group> and, after ``max_reconsume_times``, parks it in %DLQ%<group>.
If the broker cannot take it back, it is retried here: a queue never moves past a message that
was neither consumed nor handed back.
"""
from __future__ import annotations

import asyncio
import enum
import inspect
import logging

from protocol.errors import BrokerError
from protocol.message import MessageExt, Prop

from .pull_consumer import MessageQueue, PullConsumer, PullStatus
from .rebalance import allocate_averagely

log = logging.getLogger("txmq.consumer")


class ConsumeStatus(enum.Enum):
    CONSUME_SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"


class PushConsumer:
    def __init__(self, namesrv_addr: str, group: str, listener, *, consume_from: str = "last",
                 max_reconsume_times: int = 16, rebalance_interval_s: float = 20.0, suspend_ms: int = 15000,
                 offset_commit_interval_s: float = 5.0, local_retry_delay_s: float = 1.0, credentials=None):
        self.group = group
        self.listener = listener          # listener(msg) -> ConsumeStatus, plain or async
        self.consume_from = consume_from  # where a queue with no committed offset starts: "first" or "last"
        self.max_reconsume_times = max_reconsume_times
        self.rebalance_interval_s = rebalance_interval_s
        self.suspend_ms = suspend_ms
        self.offset_commit_interval_s = offset_commit_interval_s
        self.local_retry_delay_s = local_retry_delay_s
        self.client = PullConsumer(namesrv_addr, group, credentials=credentials)
        self.client.on_ids_changed = self._request_rebalance
        self.subscriptions: dict[str, str] = {}
        self._loops: dict[MessageQueue, asyncio.Task] = {}
        self._offsets: dict[MessageQueue, int] = {}
        self._committed: dict[MessageQueue, int] = {}
        self._tasks: list[asyncio.Task] = []
        self.crashes = 0                  # background loops that raised (each logged with its traceback)
        self._rebalance_now = asyncio.Event()

    def subscribe(self, topic: str, expression: str = "*") -> None:
        self.subscriptions[topic] = expression

    @property
    def retry_topic(self) -> str:
        return f"%RETRY%{self.group}"

    async def start(self) -> "PushConsumer":
        for topic, expression in {**self.subscriptions, self.retry_topic: "*"}.items():
            self.client.subscriptions[topic] = expression
            await self.client.fetch_queues(topic)
        await self.client.heartbeat("CONSUME_PASSIVELY", "CONSUME_FROM_LAST_OFFSET" if self.consume_from == "last"
                                    else "CONSUME_FROM_FIRST_OFFSET")
        await self.rebalance()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._rebalance_loop()), loop.create_task(self._commit_loop())]
        for task in self._tasks:
            task.add_done_callback(self._crashed)
        return self

    def _crashed(self, task: asyncio.Task, mq: MessageQueue | None = None) -> None:
        """A background loop that raised is logged, never silent; a crashed pull loop is dropped so
        the next rebalance starts it again."""
        if task.cancelled() or task.exception() is None:
            return
        self.crashes += 1
        exc = task.exception()
        log.error("push consumer %s: %s crashed", self.group, f"pull loop of {mq}" if mq else task.get_coro(),
                  exc_info=(type(exc), exc, exc.__traceback__))
        if mq is not None and self._loops.get(mq) is task:
            del self._loops[mq]
            self._request_rebalance()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.shutdown()

    # ------------------------------------------------------------ rebalance
    def _request_rebalance(self) -> None:
        self._rebalance_now.set()

    async def _rebalance_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._rebalance_now.wait(), self.rebalance_interval_s)
            except asyncio.TimeoutError:
                pass
            self._rebalance_now.clear()
            try:
                await self.client.heartbeat("CONSUME_PASSIVELY")
                await self.rebalance()
            except BrokerError as exc:
                log.warning("rebalance of %s failed: %s", self.group, exc)

    async def rebalance(self) -> None:
        owned: set[MessageQueue] = set()
        for topic in (*self.subscriptions, self.retry_topic):
            queues = await self.client.fetch_queues(topic)
            if not queues:
                continue
            ids = await self.client.consumer_ids(queues[0])
            owned.update(allocate_averagely(queues, ids, self.client.client_id))
        for mq in [q for q in self._loops if q not in owned]:
            self._loops.pop(mq).cancel()
            await self._commit(mq)
        for mq in owned - set(self._loops):
            task = self._loops[mq] = asyncio.get_running_loop().create_task(self._pull_loop(mq))
            task.add_done_callback(lambda t, q=mq: self._crashed(t, q))

    # ------------------------------------------------------------ consuming
    async def _start_offset(self, mq: MessageQueue) -> int:
        stored = await self.client.fetch_offset(mq)
        if stored is not None:
            return stored
        if mq.topic == self.retry_topic or self.consume_from == "first":
            return 0
        return await self.client.max_offset(mq)

    async def _pull_loop(self, mq: MessageQueue) -> None:
        expression = self.subscriptions.get(mq.topic, "*")
        offset = None
        while True:
            try:
                if offset is None:
                    offset = self._offsets[mq] = await self._start_offset(mq)
                res = await self.client.pull(mq, offset, expression=expression, suspend_ms=self.suspend_ms)
                for msg in res.messages:
                    await self._consume(mq, msg)
                if res.status is not PullStatus.NO_NEW_MSG or res.next_begin_offset != offset:
                    offset = res.next_begin_offset
                    self._offsets[mq] = offset
            except asyncio.CancelledError:
                raise
            except BrokerError as exc:
                log.info("pull of %s failed: %s; retrying in 3 s", mq, exc)
                await asyncio.sleep(3)

    async def _consume(self, mq: MessageQueue, msg: MessageExt) -> None:
        pulled_topic = msg.topic
        if pulled_topic == self.retry_topic and Prop.RETRY_TOPIC in msg.properties:
            msg.topic = msg.properties[Prop.RETRY_TOPIC]     # the user sees the topic it subscribed to
        while True:
            try:
                status = self.listener(msg)
                if inspect.isawaitable(status):
                    status = await status
            except Exception as exc:  # noqa: BLE001 - a failing listener is RECONSUME_LATER, as in Java
                log.warning("listener failed on %s: %s", msg.msg_id, exc)
                status = ConsumeStatus.RECONSUME_LATER
            if status is ConsumeStatus.CONSUME_SUCCESS:
                return
            try:
                msg.topic = pulled_topic
                await self.client.send_back(mq, msg, max_reconsume_times=self.max_reconsume_times)
                return
            except BrokerError as exc:
                log.warning("could not hand %s back (%s); retrying it here", msg.msg_id, exc)
                await asyncio.sleep(self.local_retry_delay_s)

    # ------------------------------------------------------------ offsets
    async def _commit(self, mq: MessageQueue) -> None:
        offset = self._offsets.get(mq)
        if offset is not None and self._committed.get(mq) != offset:
            await self.client.commit_offset(mq, offset)
            self._committed[mq] = offset

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.offset_commit_interval_s)
            for mq in list(self._offsets):
                try:
                    await self._commit(mq)
                except BrokerError as exc:
                    log.info("offset commit of %s failed: %s", mq, exc)

    async def shutdown(self) -> None:
        for task in [*self._tasks, *self._loops.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._loops.values(), return_exceptions=True)
        self._loops.clear()
        for mq in list(self._offsets):
            try:
                await self._commit(mq)
            except BrokerError:
                pass
        await self.client.shutdown()
