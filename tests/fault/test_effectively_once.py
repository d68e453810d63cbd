"""The mission end to end, under crashes: an order and its message succeed or fail together, and
the consumer ships each committed order exactly once.

Producers run real local transactions in SQLite: each inserts an ``orders`` row and, in the same
SQLite transaction, decides COMMIT or ROLLBACK at random; some answer UNKNOW instead, so the broker's
check-back must ask the database. A consumer in its own process (tests/support/shipping_consumer.py)
applies every message with ``SqliteIdempotency.run_once`` into its own database (``shipments``).

Faults, each paced by progress (acknowledged transactions, shipments since the consumer started),
never by the clock: the consumer is SIGKILLed and restarted twice, the broker twice (same store, same
ports; the second after the stream, the producer idle with transactions in doubt), and once the
producer "crashes": a few transactions have run in the database but their
END_TRANSACTION is never sent, the producer dies without a word (tasks cancelled, connections cut,
no unregister), and a fresh TransactionProducer of the same group answers the broker's checks from
the database alone.

At the end, once no transaction is undecided and the consumer's offsets reach the end of every
queue: the shipments are exactly the committed orders, each once, and no rolled-back order shipped;
the broker stored each committed order once. It fails when the consumer ships without run_once
(shipping_consumer.py --no-idempotency: duplicates after the consumer kills), when the checks are
answered wrongly (rolled-back orders shipped), and when an idle producer is not asked about its
transactions in doubt soon after a broker restart.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import sys
from pathlib import Path

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import BrokerError
from tests.support.bounded import bounded
from tests.support.broker_process import REPO
from tests.support.cluster_process import create_topic
from tests.support.delays import FAST
from tests.support.offsets import queues_behind

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

TOPIC = "Orders"
PGROUP = "PG_shop"
CGROUP = "CG_shipping"
TOTAL = 1200            # orders at least; the stream goes on until every fault has happened
CONCURRENCY = 8
HUNG = 6                # transactions decided in the database whose END the crashed producer never sends
# (fault, acknowledged transactions before it): the consumer kills also wait for shipments since its start.
# The broker's second kill comes after the stream, with transactions in doubt and the producer idle.
FAULTS = [("consumer", 150), ("broker", 350), ("producer", 550), ("consumer", 750)]
SHIPPED_BEFORE_CONSUMER_KILL = 20
# The stream's last transactions answer UNKNOW, at least this many, for the last restart to find in doubt.
IN_DOUBT = 4
# After that last restart the checks settle everything within about immunity (1 s) plus a few check rounds;
# an idle producer the broker could not ask until its next heartbeat (30 s) took far longer.
SETTLE_S = 10
FLAGS = ("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "1000", *FAST)


class Stats:
    def __init__(self):
        self.transactions = self.commits = self.rollbacks = self.unknown = 0
        self.checks = self.checks_after_crash = self.failed_sends = self.acked = 0


class Shop:
    """One producer process's side: the orders database and the TransactionListener over it.

    A check is answered from the database alone (the row is there: COMMIT; not: ROLLBACK), except for
    an order whose local transaction this process has not run yet (its half is being sent): UNKNOW."""

    def __init__(self, path: Path, stats: Stats, rng: random.Random, *, fresh: bool = False):
        self.db = sqlite3.connect(path, isolation_level=None, timeout=10)
        self.db.execute("CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, amount INTEGER NOT NULL)")
        self.stats, self.rng, self.fresh = stats, rng, fresh
        self.not_run: set[str] = set()          # sent or being sent, local transaction not run
        self.hang_next = 0                      # the next n local transactions never return (the crash)
        self.hung: list[str] = []
        self.all_hung = asyncio.Event()
        self.dying = False
        self.unknown_next = 0                   # the next n local transactions answer UNKNOW
        # From the stream's end to the listing after the last restart, checks are held: answered, they could
        # decide every transaction in doubt before the listing (a loaded machine pausing past the 1 s immunity).
        # A check the killed broker sent is then answered UNKNOW, as if lost with it: only the restarted
        # broker's checks decide, so the idle producer must still be asked after the restart.
        self.held: asyncio.Event | None = None
        self.old_broker_gone = False

    async def execute_local_transaction(self, msg, arg):
        order = msg.body.decode()
        self.not_run.discard(order)
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute("INSERT INTO orders VALUES (?, ?)", (order, self.rng.randrange(1, 1000)))
        commit = self.rng.random() < 0.6
        self.db.execute("COMMIT" if commit else "ROLLBACK")
        self.stats.transactions += 1
        if commit:
            self.stats.commits += 1
        else:
            self.stats.rollbacks += 1
        if self.hang_next > 0:                  # decided here, never announced: the process dies now
            self.hang_next -= 1
            self.hung.append(order)
            if len(self.hung) == HUNG:
                self.all_hung.set()
            await asyncio.Event().wait()
        if self.unknown_next > 0 or self.rng.random() < 0.25:
            self.unknown_next = max(self.unknown_next - 1, 0)
            self.stats.unknown += 1
            return S.UNKNOW
        return S.COMMIT_MESSAGE if commit else S.ROLLBACK_MESSAGE

    async def check_local_transaction(self, msg):
        if self.dying:                          # a process about to die answers nothing
            await asyncio.Event().wait()
        order = msg.body.decode()
        self.stats.checks += 1
        self.stats.checks_after_crash += self.fresh
        if self.held is not None and not self.held.is_set():
            asked_by_the_old_broker = not self.old_broker_gone
            await self.held.wait()
            if asked_by_the_old_broker:
                return S.UNKNOW
        if order in self.not_run:
            return S.UNKNOW
        row = self.db.execute("SELECT 1 FROM orders WHERE order_id = ?", (order,)).fetchone()
        return S.COMMIT_MESSAGE if row else S.ROLLBACK_MESSAGE


class ShippingConsumer:
    """tests/support/shipping_consumer.py as a child process; its stdout lines counted as they come."""

    def __init__(self, namesrv: str, db: Path, log: Path, progress: asyncio.Event, *options: str):
        self.namesrv, self.db, self.log, self.progress = namesrv, db, log, progress
        self.options = options
        self.applied: set[str] = set()           # shipped, or suppressed as shipped before
        self.suppressed = self.shipped_since_start = 0
        self.proc = None
        self._reader = None

    async def start(self) -> None:
        with open(self.log, "ab") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.support.shipping_consumer", self.namesrv, CGROUP, TOPIC, str(self.db),
                *self.options,
                cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.shipped_since_start = 0
        ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read(ready))
        await ready

    async def _read(self, ready: asyncio.Future) -> None:
        async for line in self.proc.stdout:
            kind, _, order = line.decode().strip().partition(" ")
            if kind == "READY":
                ready.set_result(None)
            elif kind in ("S", "D"):
                self.applied.add(order)
                if kind == "S":
                    self.shipped_since_start += 1
                else:
                    self.suppressed += 1
                self.progress.set()
        if not ready.done():
            ready.set_exception(RuntimeError(f"shipping consumer exited before READY: {self.log.read_text()[-3000:]}"))

    async def _end(self, sig: int) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        await self.proc.wait()
        await self._reader                    # every line it wrote before it died is counted

    async def kill(self) -> None:
        await self._end(signal.SIGKILL)

    async def stop(self) -> None:
        await self._end(signal.SIGTERM)


async def _admin(addr: str) -> dict:
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 5}), 5)
        return json.loads(resp.body_bytes())
    finally:
        conn.close()


async def _queues_behind(namesrv: str) -> list[tuple[int, int | None, int]]:
    """(queue, committed, end) of every queue of TOPIC whose committed offset is behind its end."""
    return await queues_behind(namesrv, CGROUP, TOPIC)


async def _stored(namesrv: str) -> list[str]:
    """Every message the broker holds in TOPIC's queues: what run_once would hide if stored twice."""
    probe = PullConsumer(namesrv, "CG_audit")
    bodies = []
    try:
        for mq in await probe.fetch_queues(TOPIC):
            offset = 0
            for _ in range(10_000):
                res = await probe.pull(mq, offset, max_nums=256)
                bodies += [m.body.decode() for m in res.messages]
                if not res.messages or res.next_begin_offset == offset:
                    break
                offset = res.next_begin_offset
        return bodies
    finally:
        await probe.shutdown()


async def _crash(producer: TransactionProducer, shop: Shop, tasks: list[asyncio.Task]) -> None:
    """What a kill -9 of the producer's process does to it: its work stops where it is, its connections
    break, it unregisters nothing."""
    shop.dying = True
    for task in (*tasks, *producer._check_tasks, producer._heartbeat_task, producer._route_task):
        task.cancel()
    for conn in producer.pool.connections():
        conn.abort()
    await producer.pool.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    shop.db.close()


@pytest.mark.parametrize("listener", ["run_once", "run_once_async"])
async def test_orders_ship_exactly_once_across_broker_consumer_and_producer_crashes(broker_factory, tmp_path, listener):
    b = broker_factory(*FLAGS)
    fixed = ("--port", str(b.broker_port), "--namesrv-port", b.namesrv.rsplit(":", 1)[1], *FLAGS)
    namesrv = b.namesrv
    brokers = [b]
    orders_db, shipments_db = tmp_path / "orders.db", tmp_path / "shipments.db"
    stats = Stats()
    rng = random.Random(20261126)
    progress = asyncio.Event()
    up = asyncio.Event()
    up.set()
    started = 0
    kills = {"broker": 0, "consumer": 0, "producer": 0}
    faults_done = False

    def new_producer(shop: Shop) -> TransactionProducer:
        return TransactionProducer(namesrv, PGROUP, shop, retries=0, send_timeout=2.0, end_retries=8,
                                   end_timeout=2.0)

    shop = Shop(orders_db, stats, rng)
    producer = new_producer(shop)
    consumer = ShippingConsumer(namesrv, shipments_db, tmp_path / "shipping-consumer.log", progress,
                                *(["--async"] if listener == "run_once_async" else []))

    def next_order() -> str | None:
        nonlocal started
        if started >= TOTAL and faults_done and shop.unknown_next == 0:
            return None
        started += 1
        return f"order-{started}"

    async def worker(producer: TransactionProducer, shop: Shop):
        while (order := next_order()) is not None:
            shop.not_run.add(order)
            try:
                await producer.send_in_transaction(TOPIC, order.encode(), keys=order)
            except (BrokerError, OSError, TimeoutError):
                stats.failed_sends += 1   # never retried: a half it may have stored is checked, and rolls back
                shop.not_run.discard(order)
                await up.wait()
                continue
            stats.acked += 1
            progress.set()

    async def until(predicate) -> None:
        while not predicate():
            progress.clear()
            await progress.wait()

    async def restart_broker() -> None:
        up.clear()
        brokers[-1].kill()
        kills["broker"] += 1
        brokers.append(await asyncio.to_thread(broker_factory, *fixed))
        up.set()

    async def crash_producer() -> None:
        nonlocal producer, shop, workers
        shop.hang_next = HUNG
        await shop.all_hung.wait()
        await _crash(producer, shop, workers)
        kills["producer"] += 1
        shop = Shop(orders_db, stats, rng, fresh=True)          # the restarted process: the database, nothing else
        producer = new_producer(shop)
        await producer.start()
        workers = [asyncio.create_task(worker(producer, shop)) for _ in range(CONCURRENCY)]

    async def faults() -> None:
        nonlocal faults_done
        for fault, after in FAULTS:
            if fault == "consumer":
                await until(lambda: stats.acked >= after
                            and consumer.shipped_since_start >= SHIPPED_BEFORE_CONSUMER_KILL)
                await consumer.kill()
                kills["consumer"] += 1
                await consumer.start()
            else:
                await until(lambda: stats.acked >= after)
                await (restart_broker() if fault == "broker" else crash_producer())
        shop.held = asyncio.Event()
        shop.unknown_next = IN_DOUBT
        faults_done = True

    pending = behind = None
    in_doubt = after_restart = 0
    committed: set[str] = set()
    workers: list[asyncio.Task] = []
    try:
        async with asyncio.timeout(100):
            await producer.start()
            workers = [asyncio.create_task(worker(producer, shop)) for _ in range(CONCURRENCY)]
            await until(lambda: stats.acked > 0)      # the topic exists: the consumer finds its route at once
            await consumer.start()
            await faults()
            await asyncio.gather(*workers)
            in_doubt = (await _admin(brokers[-1].broker))["total"]
            await restart_broker()
            # the check answers held since the stream's end stay held until the listing; a check that came
            # before this (the killed broker's, or rarely the new one's, asked again later) is answered UNKNOW
            shop.old_broker_gone = True
            # the checks settle what the crashes left undecided; the consumer catches up
            try:
                async with asyncio.timeout(SETTLE_S):
                    pending = await _admin(brokers[-1].broker)
                    # still in doubt, their checks held: what the idle producer must now be asked about
                    after_restart = pending["total"]
                    shop.held.set()             # listed: now the restarted broker's checks decide them
                    while pending["total"]:
                        await asyncio.sleep(0.2)
                        pending = await _admin(brokers[-1].broker)
            except TimeoutError:
                pytest.fail(f"{pending['total']} transactions still undecided {SETTLE_S} s after the last restart "
                            f"({in_doubt} were in doubt before it): {pending['pending']}")
            committed = {r[0] for r in sqlite3.connect(orders_db).execute("SELECT order_id FROM orders")}
            await until(lambda: committed <= consumer.applied)
            while behind := await _queues_behind(namesrv):
                await asyncio.sleep(0.2)
            await consumer.stop()
            stored = await _stored(namesrv)
    except TimeoutError:
        missing = sorted(committed - consumer.applied)
        pytest.fail(f"stalled: kills {kills}, acked {stats.acked}, undecided {pending}, queues behind "
                    f"(id, committed, end) {behind}, committed orders not shipped {missing[:5]}")
    finally:
        if consumer.proc is not None and consumer.proc.returncode is None:
            await consumer.kill()
    await producer.shutdown()

    shipments = [r[0] for r in sqlite3.connect(shipments_db).execute("SELECT order_id FROM shipments")]
    orders = sqlite3.connect(orders_db)
    committed = {r[0] for r in orders.execute("SELECT order_id FROM orders")}
    duplicates = len(shipments) - len(set(shipments))
    print(f"\n{started} orders: {stats.transactions} local transactions ({stats.commits} committed, "
          f"{stats.rollbacks} rolled back, {stats.unknown} answered UNKNOW), {stats.failed_sends} sends failed, "
          f"{in_doubt} in doubt at the last broker kill ({after_restart} after it), "
          f"{stats.checks} checks answered ({stats.checks_after_crash} by the restarted producer); kills {kills}; "
          f"{len(shipments)} shipments, {consumer.suppressed} redeliveries suppressed by run_once; "
          f"{pending['dead_lettered']} dead-lettered")
    assert kills == {"broker": 2, "consumer": 2, "producer": 1}
    assert in_doubt > 0 and after_restart > 0, \
        "the last broker restart was to find transactions in doubt, for the idle producer to be asked about"
    assert duplicates == 0, f"{duplicates} orders shipped more than once"
    assert set(shipments) - committed == set(), "an order that was rolled back (or never ran) was shipped"
    assert committed - set(shipments) == set(), "a committed order was never shipped"
    assert len(committed) == stats.commits
    assert sorted(stored) == sorted(committed), "the broker stored a committed order twice, or a wrong one"
    assert pending["dead_lettered"] == 0, "a transaction went to the dead-letter topic instead of being decided"
    assert stats.checks_after_crash > 0, "the restarted producer was to settle the crashed one's transactions"


async def _ship_a_probe(producer: Producer, shop: ShippingConsumer, progress: asyncio.Event, name: str) -> str:
    """Send probes until ``shop`` applies one (a consumer starting at a queue's end skips those sent before its
    pull loop read the end); the body of the one applied."""
    for n in range(200):
        body = f"{name}-{n}"
        await producer.send(TOPIC, body.encode())
        try:
            async with asyncio.timeout(0.5):    # one sent before the pull loop read the end never comes
                while True:
                    progress.clear()
                    if body in shop.applied:
                        return body
                    await progress.wait()
        except TimeoutError:
            continue
    raise AssertionError(f"{name}: no probe of 200 was applied")


@bounded(120)
async def test_a_consumer_killed_before_its_first_commit_loses_nothing_sent_after_it_began(broker_factory, tmp_path):
    """consume_from="last": a queue the group never committed starts at its end. The consumer that read the end
    committed nothing before its commit period (here 0.5 s; 5 s by default): killed within it, its successor was
    told no offset again and started at the end of the day, passing over every message sent since the first one
    began, consumed or not (RocketMQ's consumer does the same). Its start position is committed before its first
    pull now: the successor goes on from there, and run_once hides what the first one had applied."""
    b = broker_factory("--access-message-in-memory-max-ratio", "0")     # the queue's first message is "on disk":
    await create_topic(b.broker, TOPIC, 1)                               # no offset is QUERY_NOT_FOUND, not 0
    progress = asyncio.Event()
    db, log = tmp_path / "shipments.db", tmp_path / "consumer.log"
    async with Producer(b.namesrv, PGROUP) as producer:
        for i in range(3):
            await producer.send(TOPIC, f"before-{i}".encode())       # before the group: never its to consume
        first = ShippingConsumer(b.namesrv, db, log, progress, "--from-last")
        await first.start()
        try:
            await _ship_a_probe(producer, first, progress, "first")
        finally:
            await first.kill()          # at once: its commit round (0.5 s) has not come
        sent_meanwhile = [f"meanwhile-{i}" for i in range(20)]
        for body in sent_meanwhile:
            await producer.send(TOPIC, body.encode())
        second = ShippingConsumer(b.namesrv, db, log, progress, "--from-last")
        await second.start()
        try:
            await _ship_a_probe(producer, second, progress, "second")     # consumed in order: all before it too
        finally:
            await second.stop()
    lost = [body for body in sent_meanwhile if body not in second.applied]
    assert not lost, f"{len(lost)} of {len(sent_meanwhile)} messages sent while no consumer ran never consumed"
    shipped = [row[0] for row in sqlite3.connect(db).execute("SELECT order_id FROM shipments")]
    assert len(shipped) == len(set(shipped)), "a message applied twice"


@bounded(120)
async def test_a_start_stored_before_a_broker_kill_9_survives_it(broker_factory, tmp_path):
    """The start a consume_from="last" consumer stores before its first pull was answered from the broker's memory,
    on disk only at the next periodic save (5 s; here a minute, to make the window certain). The broker killed -9
    within it, and the consumer too (one host's power cut), the restarted broker held no offset for the group, and
    the successor started at the end again: everything sent since the first one began that it had not consumed was
    passed over. A consumer's first offset for a queue is on disk before its answer now."""
    flags = ("--access-message-in-memory-max-ratio", "0", "--flush-consumer-offset-interval-ms", "60000")
    b = broker_factory(*flags)
    await create_topic(b.broker, TOPIC, 1)
    progress = asyncio.Event()
    db, log = tmp_path / "shipments.db", tmp_path / "consumer.log"
    async with Producer(b.namesrv, PGROUP) as producer:
        await producer.send(TOPIC, b"before")      # the queue is not young: no offset is QUERY_NOT_FOUND, not 0
        first = ShippingConsumer(b.namesrv, db, log, progress, "--from-last")
        await first.start()
        try:
            await _ship_a_probe(producer, first, progress, "first")
        finally:
            await first.kill()
        sent_meanwhile = [f"meanwhile-{i}" for i in range(20)]
        for body in sent_meanwhile:
            await producer.send(TOPIC, body.encode())
    b.kill()                                        # within the offsets' save period
    b = broker_factory(*flags)                      # same store, same ports
    second = ShippingConsumer(b.namesrv, db, log, progress, "--from-last")
    await second.start()
    try:
        async with Producer(b.namesrv, PGROUP) as producer:
            await _ship_a_probe(producer, second, progress, "second")     # consumed in order: all before it too
    finally:
        await second.stop()
    lost = [body for body in sent_meanwhile if body not in second.applied]
    assert not lost, f"{len(lost)} of {len(sent_meanwhile)} messages sent before the broker's kill never consumed"
