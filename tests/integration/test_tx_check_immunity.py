"""A producer's CHECK_IMMUNITY_TIME_IN_SECONDS, read as RocketMQ's broker reads it (Long.parseLong, its getLong):
what it refuses is no value, and the half gets the broker's transaction timeout."""
from __future__ import annotations

import json

import pytest

from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode
from tests.integration.test_transactions import Listener, _admin
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
