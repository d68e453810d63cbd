"""A topic made only by messages waiting to be delivered must survive a SIGKILL before the catalogue is saved.

Halves are stored on RMQ_SYS_TRANS_HALF_TOPIC with REAL_TOPIC=T; T's config is auto-created by the first half,
but the topics catalogue (config/topics.json) is written in the background. A broker killed before that write
had no consume queue of T to restore T from at start-up, and the commit that followed (by check) put the
messages in a consume queue of a topic consumers were answered TOPIC_NOT_EXIST for.

The catalogue write is kept from happening (a directory where its temporary file goes), so the kill falls
before it on a fast machine as on a slow one; the kill comes after N acknowledged halves.
"""
from __future__ import annotations

import asyncio
import shutil

import pytest

from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.errors import TopicNotExistError
from tests.fault.test_disk_full import _bodies
from tests.fault.test_transactions_kill import _pending
from tests.support.bounded import bounded
from tests.support.cluster_process import request

pytestmark = [pytest.mark.asyncio]

HALVES = 5
TOPIC = "TxBornInCrash"


class Undecided:
    """Every local transaction answers UNKNOW; checks answer COMMIT once the broker was killed (a check the
    broker asks before the kill is held until then, on a machine however slow: nothing is committed before it)."""

    def __init__(self):
        self.checked = 0
        self.killed = asyncio.Event()

    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    async def check_local_transaction(self, msg):
        await self.killed.wait()
        self.checked += 1
        return S.COMMIT_MESSAGE


@bounded(90)
async def test_topic_of_halves_only_survives_kill_before_catalogue_write(broker_factory, tmp_path):
    # A half checked (and committed) before the kill gave T a queue, and adopt, not queue_appeared, made T
    # again (the log line below tells which): the listener holds every check until the kill.
    flags = ("--transaction-check-interval-ms", "200", "--transaction-timeout-ms", "3000")
    b = broker_factory(*flags)
    blocker = tmp_path / "store" / "config" / "topics.json.tmp"
    blocker.mkdir()             # the catalogue cannot be written: T lives in memory only
    listener = Undecided()
    producer = TransactionProducer(b.namesrv, "PG_topic_crash", listener, retries=0)
    await producer.start()
    try:
        for i in range(HALVES):
            res = await producer.send_in_transaction(TOPIC, f"half-{i}".encode())
            assert res.send_result.status.name == "SEND_OK" and res.state is S.UNKNOW
        b.kill()                # after HALVES acknowledged halves, the catalogue never written
        listener.killed.set()
        catalogue = tmp_path / "store" / "config" / "topics.json"
        assert not catalogue.exists() or TOPIC not in catalogue.read_text()
        shutil.rmtree(blocker)
        fixed = ("--port", str(b.broker_port), "--namesrv-port", b.namesrv.rsplit(":", 1)[1], *flags)
        b = await asyncio.to_thread(broker_factory, *fixed)
        while await _pending(b.broker):     # checks commit every half
            await asyncio.sleep(0.1)
    finally:
        await producer.shutdown()
    delivered = await _bodies(b.namesrv, TOPIC)
    assert sorted(delivered) == sorted(f"half-{i}".encode() for i in range(HALVES))
    assert f"topic {TOPIC} was missing from" in b.log()
    assert "made again for a new message in its consume queue" in b.log()


@pytest.mark.parametrize("flush", ["sync", "async"])
@bounded(60)
async def test_deleted_topic_is_not_restored_by_recovery(broker_factory, tmp_path, flush):
    """The other side: a topic an operator deleted lost its consume queues, and the checkpoint taken with the
    delete keeps recovery from rebuilding them from its records still in the log; nothing makes it again."""
    flags = ("--flush", flush, "--flush-interval-ms", "60000")
    b = broker_factory(*flags)
    (tmp_path / "store" / "config" / "topics.json.tmp").mkdir()     # only the store can keep the topic
    producer = Producer(b.namesrv, "PG_topic_deleted", retries=0)
    await producer.start()
    try:
        for i in range(HALVES):
            await producer.send("TxDeleted", f"m-{i}".encode())
    finally:
        await producer.shutdown()
    resp = await request(b.broker, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": "TxDeleted"})
    # done, and said not saved (the catalogue cannot be written): the store's mark alone keeps it deleted
    assert resp.code == ResponseCode.SYSTEM_ERROR and "topic TxDeleted deleted but not saved" in resp.remark
    b.kill()
    shutil.rmtree(tmp_path / "store" / "config" / "topics.json.tmp")
    b = await asyncio.to_thread(broker_factory, *flags)
    resp = await request(b.broker, RequestCode.GET_ALL_TOPIC_CONFIG, {})
    assert resp.code == ResponseCode.SUCCESS
    assert b"TxDeleted" not in resp.body_bytes()
    assert "TxDeleted was missing" not in b.log()


@bounded(60)
async def test_topic_of_delayed_messages_only_survives_kill_before_catalogue_write(broker_factory, tmp_path):
    """The same for delayed messages: stored on SCHEDULE_TOPIC_XXXX with REAL_TOPIC=T, delivered after the
    restart into a queue of T, which the restart had forgotten."""
    b = broker_factory()
    blocker = tmp_path / "store" / "config" / "topics.json.tmp"
    blocker.mkdir()
    producer = Producer(b.namesrv, "PG_delayed_crash", retries=0)
    await producer.start()
    try:
        for i in range(HALVES):
            await producer.send("DelayedBornInCrash", f"d-{i}".encode(), delay_level=3)
    finally:
        await producer.shutdown()
    b.kill()                    # after HALVES acknowledged sends, none delivered yet (10 s delay: room for a slow machine)
    shutil.rmtree(blocker)
    b = await asyncio.to_thread(broker_factory, "--port", str(b.broker_port),
                                "--namesrv-port", b.namesrv.rsplit(":", 1)[1])
    want = sorted(f"d-{i}".encode() for i in range(HALVES))
    while True:                 # delivered 10 s after their store time; until then the topic is unknown
        try:
            got = sorted(await _bodies(b.namesrv, "DelayedBornInCrash"))
        except TopicNotExistError:
            got = []
        if got == want:
            break
        assert len(got) < HALVES
        await asyncio.sleep(0.1)
    assert "topic DelayedBornInCrash was missing from" in b.log()
    # made by the delivery, not by adopt (which a delivery before the kill would have left to)
    assert "made again for a new message in its consume queue" in b.log()
