"""Heavy group churn against one real broker: PushConsumers of one group join, leave and rebalance (also
two rebalances of one consumer at once) while 1,500 messages over 8 queues are consumed, with listeners
that are slow, fail once, raise, or raise a stray CancelledError. Every acknowledged message must be
consumed successfully, the group's committed offsets must reach every queue's end (no queue owned and
never pulled again) and, orderly, each queue's messages are first consumed in order, one call at a time.

The driver is paced by consumption (an action every K successful consumptions), never by the clock."""
from __future__ import annotations

import asyncio
import random

import pytest

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from consumer.pull_consumer import MessageQueue
from producer import Producer
from tests.support.cluster_process import create_topic
from tests.support.delays import FAST

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

N, QUEUES, K, MAX_POOL = 1500, 8, 15, 5
STALL_S = 45        # no message acknowledged or consumed (then: no offset committed) for this long: a stall


class _Churn:
    def __init__(self, namesrv: str, group: str, topic: str, orderly: bool, seed: int):
        self.namesrv, self.group, self.topic, self.orderly = namesrv, group, topic, orderly
        self.rng = random.Random(seed)
        self.acked: set[bytes] = set()
        self.ok: set[bytes] = set()
        self.first_ok: dict[int, list[int]] = {q: [] for q in range(QUEUES)}
        self.seen: set[bytes] = set()             # delivered at least once (first delivery may be failed)
        self.active: dict[int, int] = {q: 0 for q in range(QUEUES)}
        self.overlaps: list = []
        self.progress = asyncio.Event()
        self.pool: list[PushConsumer] = []
        self.ending: list[asyncio.Task] = []      # shutdowns and direct rebalances under way
        self.made = 0
        self.actions: list[str] = []

    def _new(self) -> PushConsumer:
        self.made += 1
        c = PushConsumer(self.namesrv, self.group, self.listener, consume_from="first", orderly=self.orderly,
                         instance_name=f"churn{self.made:03d}", rebalance_interval_s=0.3,
                         offset_commit_interval_s=0.2, handover_grace_s=0.01, shutdown_grace_s=0.1,
                         suspend_ms=300, suspend_s=0.02, lock_retry_s=0.1, local_retry_delay_s=0.05)
        c.subscribe(self.topic)
        return c

    async def listener(self, msg):
        qid, seq = (int(x) for x in msg.body.decode().split(":"))
        if self.orderly:
            self.active[qid] += 1
            if self.active[qid] > 1:
                self.overlaps.append((qid, seq))
        try:
            r = self.rng.random()
            if r < 0.3:                 # slow: a chain of yields, not the clock
                for _ in range(self.rng.choice((10, 100, 3000))):      # the longest outlast handover_grace_s
                    await asyncio.sleep(0)
            first = msg.body not in self.seen
            self.seen.add(msg.body)
            r = self.rng.random()
            if first and r < 0.1:
                return ConsumeStatus.RECONSUME_LATER
            if r < 0.15:
                raise RuntimeError("listener failure")
            if r < 0.16:
                raise asyncio.CancelledError()      # a stray cancellation from something it awaited
            if msg.body not in self.ok:
                self.ok.add(msg.body)
                self.first_ok[qid].append(seq)
                if len(self.ok) % K == 0 or len(self.ok) >= N:
                    self.progress.set()
            return ConsumeStatus.CONSUME_SUCCESS
        finally:
            if self.orderly:
                self.active[qid] -= 1

    async def produce(self):
        async with Producer(self.namesrv, "PG_churn") as producer:
            queues = [MessageQueue(self.topic, producer_broker, q) for q in range(QUEUES)
                      for producer_broker in [self.broker_name]]
            sem = asyncio.Semaphore(16)

            async def one(i):
                body = f"{i % QUEUES}:{i // QUEUES}".encode()
                async with sem:
                    await producer.send(self.topic, body, queue=queues[i % QUEUES])
                self.acked.add(body)
            # per queue in order (orderly), the queues side by side
            async def queue_run(q):
                for i in range(q, N, QUEUES):
                    await one(i)
            await asyncio.gather(*(queue_run(q) for q in range(QUEUES)))

    def _live(self):
        return [c for c in self.pool if not c.shutting_down]

    async def drive(self):
        loop = asyncio.get_running_loop()
        while len(self.ok) < N:
            self.progress.clear()
            await self.progress.wait()
            live = self._live()
            action = self.rng.choice(["start", "stop", "rebalance", "rebalance2"])
            if action == "start" and len(live) < MAX_POOL:
                c = self._new()
                self.pool.append(c)
                await c.start()
            elif action == "stop" and len(live) > 1:
                victim = self.rng.choice(live)
                self.ending.append(loop.create_task(victim.shutdown()))
            elif action.startswith("rebalance") and live:
                c = self.rng.choice(live)
                self.ending.append(loop.create_task(c.rebalance()))
                if action == "rebalance2":
                    self.ending.append(loop.create_task(c.rebalance()))
            else:
                continue
            self.actions.append(action)


async def _committed(namesrv: str, group: str, topic: str) -> dict[int, int | None]:
    probe = PullConsumer(namesrv, group)
    try:
        return {mq.queue_id: await probe.fetch_offset(mq) for mq in await probe.fetch_queues(topic)}
    finally:
        await probe.shutdown()


def _state(churn: _Churn) -> str:
    missing = sorted(churn.acked - churn.ok)
    lines = [f"missing {len(missing)}: {missing[:20]}", f"actions {churn.actions}"]
    for c in churn.pool:
        lines.append(f"{c.client.client_id} stopping={c.shutting_down} owned={sorted((q.topic[:6], q.queue_id) for q in c._owned)} "
                     f"loops={ {(q.topic[:6], q.queue_id): t.done() for q, t in c._loops.items()} } "
                     f"leaving={sorted(q.queue_id for q in c._leaving)} crashes={c.crashes}")
    for t in churn.ending:     # a shutdown() stuck before it leaves the group keeps its queues from the others
        if not t.done():
            lines.append(f"still running: {t.get_coro().__qualname__} {t.get_stack(limit=8)}")
    return "\n".join(lines)


class _Stall:
    """Fails a wait that made no progress (a count that moves) for STALL_S."""

    def __init__(self, loop):
        self.loop, self.seen, self.since = loop, None, loop.time()

    def check(self, progress: int, state: str) -> None:
        if progress != self.seen:
            self.seen, self.since = progress, self.loop.time()
        assert self.loop.time() - self.since < STALL_S, f"no progress for {STALL_S} s (at {progress})\n{state}"


@pytest.mark.parametrize("orderly", [False, True], ids=["concurrent", "orderly"])
async def test_no_queue_stalls_and_no_message_is_lost_under_group_churn(broker_factory, orderly):
    broker = broker_factory(*FAST)
    topic = "Churn" + ("Orderly" if orderly else "")
    group = "CG_churn_" + ("orderly" if orderly else "concurrent")
    await create_topic(broker.broker, topic, QUEUES)
    churn = _Churn(broker.namesrv, group, topic, orderly, seed=int(__import__("os").environ.get("CHURN_SEED", "7")))
    churn.broker_name = None
    probe = PullConsumer(broker.namesrv, "CG_probe")
    churn.broker_name = (await probe.fetch_queues(topic))[0].broker_name
    await probe.shutdown()
    loop = asyncio.get_running_loop()
    first = churn._new()
    churn.pool.append(first)
    await first.start()
    producing = loop.create_task(churn.produce())
    driving = loop.create_task(churn.drive())
    try:
        # Bounded, ended by progress: every acknowledged message consumed, then every queue committed to its end.
        # A stall is STALL_S without progress; the run's length is not bounded by a clock (it took 20-75 s,
        # against a total budget of 90 s that a loaded machine nearly used up with every queue moving).
        stall = _Stall(loop)
        while not (producing.done() and driving.done()):
            stall.check(len(churn.acked) + len(churn.ok), _state(churn))
            await asyncio.wait([producing, driving], timeout=1.0, return_when=asyncio.FIRST_EXCEPTION)
            for t in (producing, driving):
                if t.done() and t.exception() is not None:
                    raise t.exception()
        await producing
        await driving
        assert churn.ok >= churn.acked, _state(churn)
        assert len(churn.acked) == N
        ends = {q: N // QUEUES + (1 if q < N % QUEUES else 0) for q in range(QUEUES)}
        stall = _Stall(loop)
        while True:
            committed = await _committed(broker.namesrv, group, topic)
            if all((committed.get(q) or 0) >= ends[q] for q in range(QUEUES)):
                break
            stall.check(sum(o or 0 for o in committed.values()), f"{committed}\n{_state(churn)}")
            await asyncio.sleep(0.2)
        if orderly:
            assert churn.overlaps == [], churn.overlaps[:20]
            for q, seqs in churn.first_ok.items():
                assert seqs == sorted(seqs), (q, seqs)
        _, stuck = await asyncio.wait(churn.ending, timeout=20)
        assert not stuck, "rebalance()/shutdown() never returned:\n" + "\n".join(
            str(t.get_stack()) for t in stuck) + "\n" + _state(churn)
        assert sum(c.crashes for c in churn.pool) == 0, _state(churn)
    finally:
        producing.cancel()
        driving.cancel()
        for t in churn.ending:
            t.cancel()
        await asyncio.wait([*churn.ending, *(asyncio.ensure_future(c.shutdown()) for c in churn.pool
                                            if not c.shutting_down)], timeout=20)
