"""A producer's CHECK_IMMUNITY_TIME_IN_SECONDS, read as RocketMQ's broker reads it (Long.parseLong, its getLong):
what it refuses is no value, and the half gets the broker's transaction timeout."""
from __future__ import annotations

import asyncio
import json

import pytest

from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode
from tests.integration.test_transactions import Listener, _admin, _drain
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

TIMEOUT_MS = 60_000     # the default immunity: no check comes during the test


@bounded(30)
async def test_an_immunity_java_does_not_parse_gets_the_default_not_what_python_reads(broker_factory):
    """int() took " 600", "600 " and "1_000": those halves' first checks waited 10 and 16 minutes, where RocketMQ
    checks them after the transaction timeout (Long.parseLong throws, getLong gives -1: the default). A value it
    does read (Unicode digits, a "+") is still the producer's."""
    b = broker_factory("--transaction-timeout-ms", str(TIMEOUT_MS))
    values = {" 600": False, "600 ": False, "1_000": False, "+600": True, "\u0666\u0660\u0660": True}   # Arabic 600
    async with TransactionProducer(b.namesrv, "PG_immune", Listener(execute=S.UNKNOW, check=S.UNKNOW)) as producer:
        keys = {}
        for value, honoured in values.items():
            sent = await producer.send_in_transaction("TxImmune", value.encode(), properties={
                "CHECK_IMMUNITY_TIME_IN_SECONDS": value})
            keys[sent.send_result.msg_id] = (value, honoured)
        rows = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())["pending"]
    assert len(rows) == len(values)
    for row in rows:
        value, honoured = keys[row["uniq_key"]]
        wait = row["next_check_in_ms"]
        if honoured:
            assert TIMEOUT_MS < wait <= 600_000, (value, wait)
        else:
            assert wait <= TIMEOUT_MS, (value, wait)


class SlowCommit:
    """A local transaction of 100 ms of work that commits; its check looks the row up and answers ROLLBACK when the
    row is not there (yet), as many listeners do."""

    def __init__(self):
        self.committed: set[str] = set()
        self.asked_while_executing = 0

    async def execute_local_transaction(self, msg, arg):
        await asyncio.sleep(0.1)        # the local transaction's own work, not a wait for the broker
        self.committed.add(msg.properties["UNIQ_KEY"])
        return S.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        if msg.properties["UNIQ_KEY"] in self.committed:
            return S.COMMIT_MESSAGE
        self.asked_while_executing += 1
        return S.ROLLBACK_MESSAGE


@bounded(60)
async def test_an_immunity_of_0_is_no_check_before_the_local_transaction_can_end(broker_factory):
    """CHECK_IMMUNITY_TIME_IN_SECONDS=0 had the first check sent ~15 ms after the half was stored, while the
    producer's local transaction still ran: its listener found no row yet and answered ROLLBACK, the COMMIT that
    came 100 ms later was refused (the first decision wins) and the committed message was lost. RocketMQ 4.9.8
    checks a half at its next check pass at the earliest (transactionCheckInterval, 60 s). An immunity below
    1 s is now 1 s (or transaction_timeout_ms, when that is lower)."""
    b = broker_factory("--transaction-timeout-ms", str(TIMEOUT_MS), "--transaction-check-interval-ms", "1000")
    listener = SlowCommit()
    async with TransactionProducer(b.namesrv, "PG_immune0", listener) as producer:
        for i in range(3):
            await producer.send_in_transaction("TxImmune0", b"order %d" % i,
                                               properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "0"})
        assert sorted(await _drain(b.namesrv, "TxImmune0", expect=3, timeout=20)) == [b"order 0", b"order 1",
                                                                                        b"order 2"]
    assert listener.asked_while_executing == 0
