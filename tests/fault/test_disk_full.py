"""The store on a 48 MiB tmpfs, filled to the brim: refused, survived, resumed, nothing lost or doubled.

A real broker process with its store on its own small tmpfs, and a 20 MiB ballast file:

1. sends and transactions until the disk passes disk_refuse_ratio (90%): the writes are
   refused with SERVICE_NOT_AVAILABLE and a remark saying the disk is full and how full;
   pulls and metrics keep working;
2. the rest of the file system is filled to 100%; there the broker stops cleanly (exit 0),
   starts (no SIGBUS reading its files), serves reads and refuses writes, is killed (-9)
   and starts again;
3. the ballast goes: writes resume without a restart (the time it took is printed);
4. a clean restart, the checks settle what the refusals left undecided, and then every
   acknowledged send and every committed transaction is there exactly once, and no
   rolled-back one.

Mounting needs root; elsewhere the test is skipped and says why. Faults are driven by
progress (until the broker refuses), never by the clock.
"""
from __future__ import annotations

import asyncio
import os
import time
import urllib.request

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import ResponseCode
from protocol.errors import ResponseError
from tests.fault.test_transactions_kill import Ledger, _pending
from tests.support.broker_process import BrokerProcess
from tests.support.tmpfs import tmpfs

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

MiB = 1 << 20
BODY = 24 * 1024
MAX_OPS = 4000          # a bound: 48 MiB is reached in well under 2,000 of these
FLAGS = ("--segment-size", str(4 * MiB), "--max-message-size", str(256 * 1024),
         "--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "500",
         "--metrics-snapshot-interval-s", "0")


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "48m") as mount:
        yield mount


def _fill(path, size: int | None) -> int:
    """Write zeros to ``path``: ``size`` bytes, or until the disk is full. Returns bytes written."""
    written = 0
    chunk = bytes(MiB)
    with open(path, "wb", buffering=0) as f:
        while size is None or written < size:
            try:
                written += f.write(chunk if size is None else chunk[:size - written])
            except OSError:
                break
    return written


def _metric(addr: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def _bodies(namesrv: str, topic: str) -> list[bytes]:
    consumer = PullConsumer(namesrv, "CG_disk")
    bodies = []
    for mq in await consumer.fetch_queues(topic):
        offset = 0
        while True:
            res = await consumer.pull(mq, offset, max_nums=64)
            bodies += [m.body for m in res.messages]
            if res.next_begin_offset == offset or not res.messages:
                break
            offset = res.next_begin_offset
    await consumer.shutdown()
    return bodies


class Workload:
    """Sends and transactions, one after another; remembers what the broker acknowledged."""

    def __init__(self, namesrv: str):
        self.ledger = Ledger(seed=10)
        self.sender = Producer(namesrv, "PG_disk", retries=0)
        self.tx = TransactionProducer(namesrv, "PG_disk_tx", self.ledger, retries=0, end_retries=0)
        self.acked_sends: list[bytes] = []
        self.refusals: list[ResponseError] = []
        self.n = 0

    async def start(self):
        await self.sender.start()
        await self.tx.start()

    async def shutdown(self):
        await self.sender.shutdown()
        await self.tx.shutdown()

    async def step(self) -> bool:
        """One send, or one transaction every third step; False when the broker refused it."""
        self.n += 1
        body = f"{self.n:06d}".encode() + bytes(BODY)
        try:
            if self.n % 3:
                await self.sender.send("DiskSend", body)
                self.acked_sends.append(body)
            else:
                self.ledger.plan[body] = self.ledger.rng.choice([S.COMMIT_MESSAGE, S.ROLLBACK_MESSAGE])
                await self.tx.send_in_transaction("DiskTx", body)
        except ResponseError as exc:
            self.refusals.append(exc)
            return False
        return True


async def test_a_full_disk_is_refused_survived_and_resumed(small_disk):
    store = small_disk
    ballast = store / "ballast"                         # on the small disk, next to the store's files
    assert _fill(ballast, 20 * MiB) == 20 * MiB
    broker = BrokerProcess(store, *FLAGS).start()
    brokers = [broker]
    try:
        fixed = ("--port", str(broker.broker_port), "--namesrv-port", broker.namesrv.rsplit(":", 1)[1])
        work = Workload(broker.namesrv)
        await work.start()
        async with asyncio.timeout(90):
            # 1. fill up to the watermark: the broker refuses, with a remark that says why
            while await work.step():
                assert work.n < MAX_OPS, "the disk never filled"
            refused = work.refusals[-1]
            assert refused.code == ResponseCode.SERVICE_NOT_AVAILABLE
            assert "disk is full" in refused.remark and "% used" in refused.remark, refused.remark
            assert _metric(broker.metrics, "txmq_store_writes_refused") == 1
            assert _metric(broker.metrics, "txmq_store_disk_usage_ratio") >= 0.90
            assert _metric(broker.metrics, "txmq_store_write_refusals_total") >= 1
            for _ in range(5):                          # and it keeps refusing, transactions included
                assert not await work.step()
            assert len(await _bodies(broker.namesrv, "DiskSend")) == len(work.acked_sends)   # reads go on
            print(f"full disk: {type(refused).__name__} code {refused.code}: {refused.remark}")

            # 2. fill the last 10% too; on a disk with no byte free: a clean stop, a start, a crash, a start
            await work.shutdown()
            _fill(store / "ballast-2", None)
            assert broker.stop() == 0, broker.log()
            for crash in (False, True):
                broker = BrokerProcess(store, *FLAGS, *fixed).start()
                brokers.append(broker)
                _fill(store / f"ballast-{3 + crash}", None)     # whatever start-up released, take it too
                work = _resumed(work, broker.namesrv)
                await work.start()
                assert len(await _bodies(broker.namesrv, "DiskSend")) == len(work.acked_sends)
                assert not await work.step() and "disk is full" in work.refusals[-1].remark
                await work.shutdown()
                if crash:
                    broker.kill()
                else:
                    assert broker.stop() == 0, broker.log()
            broker = BrokerProcess(store, *FLAGS, *fixed).start()
            brokers.append(broker)
            work = _resumed(work, broker.namesrv)
            await work.start()

            # 3. free the space: writes resume by themselves
            for name in ("ballast-2", "ballast-3", "ballast-4"):
                os.unlink(store / name)
            os.unlink(ballast)
            freed = time.monotonic()
            attempts = 0
            while not await work.step():
                attempts += 1
                assert attempts < 400, "writes did not resume"
                await asyncio.sleep(0.025)              # polling the broker from outside: there is no event
            resumed_after = time.monotonic() - freed
            for _ in range(30):
                assert await work.step()
            print(f"writes resumed {resumed_after:.3f} s after the space was freed ({attempts} refused meanwhile)")

            # 4. restart cleanly; checks settle the refused ENDs; then count
            await work.shutdown()
            assert broker.stop() == 0
            broker = BrokerProcess(store, *FLAGS, *fixed).start()
            brokers.append(broker)
            work = _resumed(work, broker.namesrv)
            await work.start()                          # the transaction producer answers the checks
            while await _pending(broker.broker):
                await asyncio.sleep(0.1)
            sends = await _bodies(broker.namesrv, "DiskSend")
            committed = await _bodies(broker.namesrv, "DiskTx")
            await work.shutdown()
        assert sorted(sends) == sorted(set(sends)) and set(work.acked_sends) <= set(sends)
        assert len(committed) == len(set(committed)), "a transaction was delivered twice"
        executed_commits = {b for b, s in work.ledger.executed.items() if s is S.COMMIT_MESSAGE}
        assert set(committed) == executed_commits, "a commit is missing or a rollback was delivered"
        print(f"{len(work.acked_sends)} sends acknowledged, {len(executed_commits)} commits, "
              f"{len(work.ledger.executed) - len(executed_commits)} rollbacks, {len(work.refusals)} refusals")
    finally:
        for b in brokers:
            b.kill()


def _resumed(old: Workload, namesrv: str) -> Workload:
    """A new client pair for a restarted broker, keeping what the old one saw."""
    new = Workload(namesrv)
    new.ledger, new.acked_sends, new.refusals, new.n = old.ledger, old.acked_sends, old.refusals, old.n
    new.tx.listener = old.ledger
    return new

