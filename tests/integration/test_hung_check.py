"""A transaction check that hangs in the producer (its check_local_transaction awaits a database that is down)
while the broker asks again, each interval: against the real broker."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode
from tests.integration.test_transactions import _admin, _drain
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


async def _pending(b, group: str) -> list[dict]:
    """The broker's undecided transactions of ``group``."""
    body = (await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"group": group})).body_bytes()
    return json.loads(body)["pending"]


async def _until_decided(b, group: str) -> None:
    while await _pending(b, group):
        await asyncio.sleep(0.05)


@bounded(60)
async def test_a_check_still_running_is_not_started_again_when_the_broker_asks_again(broker_factory, caplog):
    """Each ask started another call beside the hung one, with nothing said: one task more per transaction each
    interval for as long as it hung, and as many ENDs once it returned. The ask is now left to the call in hand,
    counted and said once; once that call returns, the next ask runs again."""
    b = broker_factory("--transaction-check-interval-ms", "100", "--transaction-timeout-ms", "0")
    release = asyncio.Event()
    calls = []

    class Hung:
        def execute_local_transaction(self, msg, arg):
            return S.UNKNOW

        async def check_local_transaction(self, msg):
            calls.append(msg.body)
            first = len(calls) == 1
            await release.wait()
            # the first says UNKNOW: the ask after it must still be taken, nothing of the hung call left in its way
            return S.UNKNOW if first else S.COMMIT_MESSAGE

    async with TransactionProducer(b.namesrv, "PG_hung", Hung()) as producer:
        await producer.send_in_transaction("TxHung", b"once")
        # paced by the asks the producer received: four while the first call hangs
        while len(calls) + producer.checks_overlapped < 4:
            await asyncio.sleep(0.02)
        assert len(calls) == 1, "an ask started another call while the first still ran"
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "still running" in r.getMessage()]
        assert len(warned) == 1 and "PG_hung" in warned[0].getMessage()
        release.set()
        await _until_decided(b, "PG_hung")
        assert len(calls) >= 2
    assert await _drain(b.namesrv, "TxHung", expect=1) == [b"once"]


@bounded(60)
async def test_a_check_that_raises_is_said_in_the_producers_log(broker_factory, caplog):
    """An exception in check_local_transaction is UNKNOW, as in execute_local_transaction, whose exception was
    logged: the check's went to the broker's remark alone, and a bug there answered UNKNOW at every ask until
    the transaction was dead-lettered, nothing in the producer's log."""
    b = broker_factory("--transaction-check-interval-ms", "100", "--transaction-timeout-ms", "0")
    calls = []

    class Buggy:
        def execute_local_transaction(self, msg, arg):
            return S.UNKNOW

        def check_local_transaction(self, msg):
            calls.append(msg.body)
            if len(calls) == 1:
                raise KeyError("order-17")
            return S.COMMIT_MESSAGE

    async with TransactionProducer(b.namesrv, "PG_buggy", Buggy()) as producer:
        sent = await producer.send_in_transaction("TxBuggy", b"once")
        assert await _drain(b.namesrv, "TxBuggy", expect=1, timeout=30) == [b"once"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "order-17" in r.getMessage()]
    assert len(said) == 1 and sent.send_result.msg_id in said[0] and "UNKNOW" in said[0]


@bounded(90)
async def test_checks_in_hand_are_bounded_when_the_listener_hangs(broker_factory, caplog):
    """Every ask for another transaction started one more check_local_transaction call, however many were hung
    (a database down): a broker that bounds nothing (Apache RocketMQ asks about every half each interval) had the
    producer hold a task and the decoded half, body and all, for each of its undecided transactions. A stock Java
    producer holds checkRequestHoldMax (2000) and drops the rest. At most ``max_checks_at_once`` run now; the asks
    past it are not taken, counted (checks_refused) and said, and the broker asks about them again."""
    b = broker_factory("--transaction-check-interval-ms", "100", "--transaction-timeout-ms", "0",
                       "--transaction-check-in-flight-max", "10000", "--transaction-check-max", "10000")
    release = asyncio.Event()
    running, most = [], 0

    class Hung:
        def execute_local_transaction(self, msg, arg):
            return S.UNKNOW

        async def check_local_transaction(self, msg):
            nonlocal most
            running.append(msg.body)
            most = max(most, len(running))
            try:
                await release.wait()
            finally:
                running.remove(msg.body)
            return S.COMMIT_MESSAGE

    sent = 12
    async with TransactionProducer(b.namesrv, "PG_many", Hung(), max_checks_at_once=4) as producer:
        for i in range(sent):
            await producer.send_in_transaction("TxMany", b"m%d" % i)
        # paced by the asks the producer received and did not take: every one past the four in hand
        while producer.checks_refused < sent - 4:
            await asyncio.sleep(0.02)
        assert most == 4, f"{most} check calls ran at once, past max_checks_at_once=4"
        said = [r.getMessage() for r in caplog.records if "max_checks_at_once" in r.getMessage()]
        assert said and "PG_many" in said[0]
        release.set()
        await _until_decided(b, "PG_many")
    assert sorted(await _drain(b.namesrv, "TxMany", expect=sent, timeout=30)) == sorted(b"m%d" % i for i in range(sent))


@bounded(60)
async def test_a_check_during_its_own_local_transaction_does_not_decide_it(broker_factory, caplog):
    """A local transaction still running when the broker's immunity passed (a database slow under load) had its
    check run beside it: a check that looks the outcome up found none yet, and the usual answer for that
    (ROLLBACK: no order, no message) had the broker roll the transaction back while its local part went on to
    commit. The END was refused TRANSACTION_FAILED and the message never delivered, the order made. The ask is
    now answered UNKNOW, the listener not called, and left to the END of the local transaction running in this
    producer (counted, said)."""
    b = broker_factory("--transaction-check-interval-ms", "100", "--transaction-timeout-ms", "0")
    entered, release = asyncio.Event(), asyncio.Event()
    orders, checked = set(), []

    class Orders:
        async def execute_local_transaction(self, msg, arg):
            entered.set()
            await release.wait()        # the database slow
            orders.add(msg.body)
            return S.COMMIT_MESSAGE

        def check_local_transaction(self, msg):
            checked.append(msg.body)
            return S.COMMIT_MESSAGE if msg.body in orders else S.ROLLBACK_MESSAGE

    async with TransactionProducer(b.namesrv, "PG_slow_local", Orders()) as producer:
        sending = asyncio.get_running_loop().create_task(producer.send_in_transaction("TxSlowLocal", b"order-1"))
        await entered.wait()
        # paced by the broker's asks: two while the local transaction runs (or none pending: decided already)
        while (pending := await _pending(b, "PG_slow_local")) and pending[0]["checks"] < 2:
            await asyncio.sleep(0.05)
        release.set()
        result = await sending
        assert result.state is S.COMMIT_MESSAGE and result.acknowledged
        assert checked == [] and producer.checks_during_local >= 1
    said = [r.getMessage() for r in caplog.records if "checks_during_local" in r.getMessage()]
    assert len(said) == 1 and result.send_result.msg_id in said[0] and "PG_slow_local" in said[0]
    assert await _drain(b.namesrv, "TxSlowLocal", expect=1) == [b"order-1"]
