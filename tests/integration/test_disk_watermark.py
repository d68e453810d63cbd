"""The disk watermark seen from a client, on any machine: a broker whose disk_refuse_ratio is below what
its file system already uses refuses every write at the door and keeps serving reads.

(The real thing, a small tmpfs filled up, emptied and restarted, is tests/fault/test_disk_full.py;
it needs root to mount.)
"""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import ServiceNotAvailableError

pytestmark = pytest.mark.asyncio


class Commit:
    def execute_local_transaction(self, msg, arg):
        return S.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        return S.COMMIT_MESSAGE


def _metrics(addr: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        rows = [line.split() for line in resp.read().decode().splitlines() if line.startswith("txmq_store_")]
    return {row[0]: float(row[1]) for row in rows}


async def test_over_the_watermark_writes_are_refused_and_reads_go_on(broker_factory, tmp_path):
    b = broker_factory()
    async with Producer(b.namesrv, "PG_w") as producer:
        stored = [await producer.send("Kept", f"m{i}".encode()) for i in range(5)]
    assert b.stop() == 0 and len(stored) == 5
    b = broker_factory("--disk-refuse-ratio", "0.0001")     # any real disk is fuller than this
    async with asyncio.timeout(30):
        async with Producer(b.namesrv, "PG_w", retries=0) as producer:
            with pytest.raises(ServiceNotAvailableError) as refused:
                await producer.send("Kept", b"more")
            with pytest.raises(ServiceNotAvailableError):
                await producer.send("NewTopic", b"x")           # auto-create would have written a file
            with pytest.raises(ServiceNotAvailableError):
                await producer.send_batch("Kept", [b"a", b"b"])
        tx = TransactionProducer(b.namesrv, "PG_w_tx", Commit(), retries=0)
        await tx.start()
        with pytest.raises(ServiceNotAvailableError):
            await tx.send_in_transaction("Kept", b"half")
        await tx.shutdown()
        consumer = PullConsumer(b.namesrv, "CG_w")
        got = []
        for mq in await consumer.fetch_queues("Kept"):
            got += [m.body for m in (await consumer.pull(mq, 0, max_nums=64)).messages]
        await consumer.shutdown()
        host, _, port = b.broker.rpartition(":")
        conn = await open_connection(host, int(port))
        listed = await conn.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 5}), 5)
        conn.close()
    remark = refused.value.remark
    assert refused.value.code == ResponseCode.SERVICE_NOT_AVAILABLE
    assert remark.startswith("service not available now: the broker's disk is full [")
    assert "% used" in remark and "free of" in remark and "refused at 0%" in remark
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(5))       # reads go on
    assert listed.code == ResponseCode.SUCCESS and json.loads(listed.body_bytes())["total"] == 0
    assert "NewTopic" not in (tmp_path / "store" / "config" / "topics.json").read_text()
    m = _metrics(b.metrics)
    assert m["txmq_store_writes_refused"] == 1 and 0 < m["txmq_store_disk_usage_ratio"] <= 1
    assert m["txmq_store_write_refusals_total"] >= 4
    assert b.log().count("refusing writes until") == 1         # said once, not once per request
