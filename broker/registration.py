"""The broker's side of the name servers: REGISTER_BROKER every period, UNREGISTER_BROKER at a clean stop.

What a 4.9.8 broker does (BrokerOuterAPI.registerBrokerAll): one request per
name server, all in parallel, the same header and body to each; the body lists
every topic config and the table's data version, so a name server re-reads the
table only when the version moved. A topic created or deleted registers at once
(RocketMQ registers on topic creation too), so clients see a new topic's queues
on this broker without waiting a period. A name server that cannot be reached
is logged and tried again next period; it never stops the broker.

Each name server is registered with on its own: one that takes the request and
never answers holds up only its own registration (for register_timeout_ms), not
the others' next rounds or topic changes, and is sent no second one meanwhile
(a registration that changed meanwhile follows as soon as it is answered).
"""
from __future__ import annotations

import asyncio
import logging

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import ConnectionPool, wait_within
from protocol.registration import (RegisterBrokerBody, RegisteredTopic, encode_register_body, register_header,
                                   unregister_header)

log = logging.getLogger("txmq.registration")
DEBOUNCE_S = 0.05           # topic changes arriving together register once


class BrokerRegistrar:
    """Registers one broker (``ctx``: its BrokerContext) with ``namesrv_addrs``.

    ``on_result(namesrv_addr, response)`` sees every SUCCESS answer (a slave learns its master's
    address and HA address there)."""

    def __init__(self, ctx, namesrv_addrs: list[str], *, ha_server_addr: str, on_result=None):
        c = ctx.config
        self.ctx = ctx
        self.namesrv_addrs = namesrv_addrs
        self.ha_server_addr = ha_server_addr
        self.period_s = c.register_period_ms / 1000
        self.timeout_s = c.register_timeout_ms / 1000
        self.compressed = c.register_compressed
        self.on_result = on_result
        self.pool = ConnectionPool(connect_timeout=min(3.0, self.timeout_s))
        self.registrations = 0          # successful REGISTER_BROKER answers, all name servers
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._inflight: dict[str, asyncio.Task] = {}     # name server -> its registration under way
        self._again: set[str] = set()       # name servers to register with again once the one in flight ends
        # From now, not from start(): a topic made while the first registration is under way (the broker
        # already listens) registers right after it, not a period later.
        ctx.topics.on_change = self.topics_changed

    def body(self) -> RegisterBrokerBody:
        topics = {tc.name: RegisteredTopic(tc.name, tc.read_queue_nums, tc.write_queue_nums,
                                           self.ctx.topic_perm(tc.perm),
                                           tc.filter_type, tc.sys_flag, tc.order)
                  for tc in list(self.ctx.topics.topics.values())}
        return RegisterBrokerBody(topics, self.ctx.topics.data_version, [])

    def request(self) -> RemotingCommand:
        c = self.ctx.config
        body = encode_register_body(self.body(), compressed=self.compressed)
        return RemotingCommand.request(RequestCode.REGISTER_BROKER, register_header(
            broker_name=c.broker_name, broker_addr=self.ctx.broker_addr, cluster_name=c.cluster_name,
            ha_server_addr=self.ha_server_addr, broker_id=c.broker_id, compressed=self.compressed, body=body), body)

    async def register_all(self) -> int:
        """One registration with every name server at once; how many accepted it."""
        results = await asyncio.gather(*(asyncio.shield(t) for t in self._round()))
        return sum(results)

    async def register_first(self) -> int:
        """The broker's start: the registering loop, then one registration with every name server, waited for
        (how many accepted it). The loop first: a topic made while a name server that hangs holds this one up
        reaches the others at once, not after its register_timeout_ms."""
        self.start()
        return await self.register_all()

    def _round(self) -> list[asyncio.Task]:
        """Start a registration with every name server that has none under way (those that have get another
        once theirs ends, with what changed meanwhile); the registrations this round waits on."""
        tasks = []
        for addr in self.namesrv_addrs:
            task = self._inflight.get(addr)
            if task is None:
                task = self._start(addr)
            else:
                self._again.add(addr)
            tasks.append(task)
        return tasks

    def _start(self, addr: str) -> asyncio.Task:
        task = self._inflight[addr] = asyncio.get_running_loop().create_task(self._register(addr))
        task.add_done_callback(lambda t: self._ended(addr, t))
        return task

    def _ended(self, addr: str, task: asyncio.Task) -> None:
        if self._inflight.get(addr) is task:
            del self._inflight[addr]
        if addr in self._again and not task.cancelled():
            self._again.discard(addr)
            self._start(addr)

    async def _register(self, addr: str) -> bool:
        try:
            resp = await self.pool.request(addr, self.request(), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a name server down is retried next period
            log.warning("registering with name server %s failed: %s", addr, exc)
            return False
        if resp.code != ResponseCode.SUCCESS:
            log.warning("name server %s refused the registration: code %d %s", addr, resp.code, resp.remark)
            return False
        self.registrations += 1
        if self.on_result is not None:
            self.on_result(addr, resp)
        return True

    def topics_changed(self) -> None:
        """A topic was created or deleted: register now rather than at the next period."""
        self._changed.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="txmq-registration")

    async def _run(self) -> None:
        while True:
            try:
                await wait_within(self._changed.wait(), self.period_s)
                await asyncio.sleep(DEBOUNCE_S)
            except asyncio.TimeoutError:
                pass
            self._changed.clear()
            self._round()       # not waited for: a name server that hangs holds up none of the others

    async def stop(self) -> None:
        """Stop registering and tell every name server this broker is going (bounded by the timeout)."""
        self.ctx.topics.on_change = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._again.clear()
        inflight = list(self._inflight.values())
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
        c = self.ctx.config
        cmd = lambda: RemotingCommand.request(RequestCode.UNREGISTER_BROKER, unregister_header(  # noqa: E731
            broker_name=c.broker_name, broker_addr=self.ctx.broker_addr, cluster_name=c.cluster_name,
            broker_id=c.broker_id))
        results = await asyncio.gather(*(self.pool.request(a, cmd(), min(3.0, self.timeout_s))
                                         for a in self.namesrv_addrs), return_exceptions=True)
        for addr, r in zip(self.namesrv_addrs, results):
            if isinstance(r, BaseException):
                log.warning("unregistering from name server %s failed: %s", addr, r)
        await self.pool.close()
