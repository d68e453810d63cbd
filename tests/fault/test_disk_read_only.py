"""The store's file system turned read-only under a running broker, as ext4 with errors=remount-ro does after an
I/O error: said as read-only (not full) in the log, the metrics and every refused send's remark; nothing
acknowledged lost through a kill -9, the disk's repair and a restart.

A real broker on a 64 MiB ext4 loop device; the kernel is made to take the file system for damaged (ext4's
trigger_fs_error) after a number of acknowledged sends, so it remounts it read-only under the broker's open
files. Mounting needs root; elsewhere the test is skipped and says why.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os

import pytest

from broker.store import MessageStore, PutRequest, StoreConfig
from broker.store import index as index_mod
from broker.store.index import IndexService
from producer import Producer
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.errors import ResponseError
from protocol.message import Prop, decode_offset_msg_id, properties_to_string
from tests.fault.test_disk_full import _bodies, _metric
from tests.integration.test_queue_caps import _refusals
from tests.support.broker_process import BrokerProcess
from tests.support.raw_client import RawClient
from tests.support.tmpfs import ext4

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

ACKED = 20
POLLS = 200             # a bound on waiting for the disk probe (every 0.5 s) to see the remount


async def _send_all(namesrv: str, bodies: list[bytes]) -> list:
    """Each body sent once (no retries): what the broker answered, a SendResult or the ResponseError."""
    producer = Producer(namesrv, "PG_ro", retries=0)
    await producer.start()
    answers = []
    try:
        for body in bodies:
            try:
                answers.append(await producer.send("RoTopic", body))
            except ResponseError as exc:
                answers.append(exc)
    finally:
        await producer.shutdown()
    return answers


def _start(disk, log_path) -> BrokerProcess:
    """A broker whose store is on ``disk``, its log at ``log_path`` (not on the disk that turns read-only)."""
    b = BrokerProcess(disk.mount_point / "store")
    b.log_path = log_path
    return b.start()


async def _turn_read_only(disk, b: BrokerProcess) -> None:
    """Has the kernel remount ``disk`` read-only, and waits until the broker says so (txmq_store_read_only 1)."""
    disk.turn_read_only()
    for _ in range(POLLS):      # polling the broker from outside: there is no event to await
        if _metric(b.metrics, "txmq_store_read_only") == 1:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"txmq_store_read_only never turned 1\n{b.log()}")


def _restart_repaired(disk, b: BrokerProcess, tmp_path) -> BrokerProcess:
    """kill -9 (what a crash on a failing disk leaves), the disk repaired (fsck) and mounted, a new broker on it."""
    b.kill()
    disk.repair()
    return _start(disk, tmp_path / "broker-2.log")


async def test_a_store_whose_file_system_turns_read_only_says_so_and_loses_nothing_acknowledged(tmp_path):
    """Before: every send after the remount was answered "store refused the message: SERVICE_NOT_AVAILABLE" (no
    reason, nothing to do), no metric moved (txmq_store_writes_refused 0, no alert: the only trace one ERROR line),
    and an idle broker said nothing at all until its checkpoint failed."""
    with ext4(tmp_path / "disk", tmp_path / "disk.img") as disk:
        b = _start(disk, tmp_path / "broker.log")
        try:
            async with asyncio.timeout(120):
                acked = [f"acked-{i}".encode() for i in range(ACKED)]
                assert all(not isinstance(a, ResponseError) for a in await _send_all(b.namesrv, acked))
                assert _metric(b.metrics, "txmq_store_read_only") == 0
                await _turn_read_only(disk, b)
                refused = await _send_all(b.namesrv, [f"refused-{i}".encode() for i in range(5)])
                assert all(isinstance(r, ResponseError) and r.code == ResponseCode.SERVICE_NOT_AVAILABLE
                           for r in refused), refused
                for r in refused:
                    assert "read-only" in r.remark and "restart the broker" in r.remark, r.remark
                    assert "disk is full" not in r.remark, r.remark
                assert _metric(b.metrics, "txmq_store_write_stopped") == 1
                # a topic new to the store: its queue's file cannot be made. Before: SYSTEM_ERROR "create mapped
                # file failed, server is busy or broken ... Read-only file system", counted queue-file-failed
                new = Producer(b.namesrv, "PG_ro_new", retries=0)
                await new.start()
                try:
                    with pytest.raises(ResponseError) as first:
                        await new.send("RoTopicNew", b"new")
                finally:
                    await new.shutdown()
                assert first.value.code == ResponseCode.SERVICE_NOT_AVAILABLE, first.value
                assert "read-only" in first.value.remark and "restart the broker" in first.value.remark, first.value
                assert _refusals(b, "queue-file-failed") == 0     # not the open-files limit: the store stopped
                assert _metric(b.metrics, "txmq_store_writes_refused") == 0     # not a full disk
                said = [line for line in b.log().splitlines() if "is read-only now" in line]
                assert len(said) == 1 and "ERROR" in said[0], b.log()
                assert b.log().count("store stops accepting writes") == 1
                assert "turned read-only" in b.log()
                assert len(await _bodies(b.namesrv, "RoTopic")) == ACKED      # reads go on
            b = _restart_repaired(disk, b, tmp_path)
            async with asyncio.timeout(60):
                assert sorted(await _bodies(b.namesrv, "RoTopic")) == sorted(acked)
                assert _metric(b.metrics, "txmq_store_read_only") == 0
                assert _metric(b.metrics, "txmq_store_write_stopped") == 0
                assert all(not isinstance(a, ResponseError) for a in await _send_all(b.namesrv, [b"after"]))
        finally:
            if b.proc is not None and b.proc.poll() is None:
                b.kill()


async def test_the_message_index_on_a_file_system_turned_read_only_answers_from_its_files_and_removes_none(
        tmp_path, monkeypatch, caplog):
    """The message index on a real ext4 remounted read-only under it: a record dispatched after the remount could not
    be indexed (EROFS), and the resume tried 10 s later closed every index file before opening them again read-write,
    which failed EROFS: every query by key answered nothing from then on (mqadmin queryMsgByKey, a late COMMIT's
    dead-letter lookup) though the files were there to read. Now it is said once, tried again quietly, answers from
    the files it has, and removes none."""
    monkeypatch.setattr(index_mod, "PROGRESS_EVERY_S", 3600)  # the start's save only, until the remount
    with ext4(tmp_path / "disk", tmp_path / "disk.img") as disk:
        root = disk.mount_point / "store"
        store = MessageStore(str(root), StoreConfig(segment_size=4096 * 4, max_message_size=2048))
        await store.open()
        svc = IndexService(str(root), segment_size=4096 * 4, slots=1024, entries=4096)
        store.add_dispatch_listener(svc.on_dispatch)
        await svc.open(store.min_physical_offset, store.max_physical_offset)
        svc.resume_every_s = 0          # at each turn of the index thread (the default paces it by 10 s)
        try:
            async with asyncio.timeout(60):
                await svc.query("T", "x", 1, 0, 1)      # (the start's catch-up and its progress save)
                for i in range(12):     # indexed as a broker's sends, their progress not saved yet
                    assert (await store.put(PutRequest.build("T", b"x" * 100, properties={"KEYS": f"k{i} shared"}))).ok
                assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 12
                names = sorted(os.listdir(root / "index"))
                disk.turn_read_only()
                monkeypatch.setattr(index_mod, "PROGRESS_EVERY_S", 0)     # the save due: at each turn
                with caplog.at_level(logging.ERROR, logger="txmq.index"):
                    for _ in range(4):      # each query a turn of the index thread: the save, then resumes failing
                        answer = await svc.query("T", "shared", 64, 0, 2**62)
                assert svc.stopped and "Read-only file system" in svc.failed, svc.failed
                assert len(answer.found) == 12 and answer.behind is not None, answer
                said = [r.getMessage() for r in caplog.records]
                assert sum("indexing stops here" in m for m in said) == 1 and not any("damaged" in m for m in said), \
                    said
                assert sorted(os.listdir(root / "index")) == names        # none removed
        finally:
            await svc.close()
            with contextlib.suppress(Exception):    # (its flush refused: the file system is read-only)
                await store.close()


async def _send_raw(client: RawClient, opaque: int, topic: str, body: bytes, half: bool = False) -> RemotingCommand:
    """One SEND_MESSAGE of ``body`` to ``topic``'s queue 0 (a transaction's half of PG_ro_tx if ``half``)."""
    props = properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: "PG_ro_tx"} if half else {})
    [answer] = await client.call(RemotingCommand(R.SEND_MESSAGE, opaque=opaque, body=body, ext_fields={
        "producerGroup": "PG_ro_tx", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "1",
        "queueId": "0", "sysFlag": str(SysFlag.TRANSACTION_PREPARED if half else 0), "bornTimestamp": "0",
        "flag": "0", "properties": props}), 10)
    return answer


def _end(half, opaque: int) -> RemotingCommand:
    """The COMMIT of ``half`` (a SEND_MESSAGE's answer), as a producer's END_TRANSACTION (not oneway: answered)."""
    return RemotingCommand(R.END_TRANSACTION, opaque=opaque, ext_fields={
        "producerGroup": "PG_ro_tx", "tranStateTableOffset": half.ext_fields["queueOffset"],
        "commitLogOffset": str(decode_offset_msg_id(half.ext_fields["msgId"])[2]), "commitOrRollback": "8",
        "fromTransactionCheck": "false", "msgId": half.ext_fields["msgId"]})


async def test_a_commit_and_a_reply_into_new_queues_of_a_read_only_store_say_so_and_the_half_is_kept(tmp_path):
    """Before: a COMMIT whose topic's queue had no file yet, and a reply to a reply topic new to the store, met
    EROFS making that file and were answered as the open-files limit is: the END SYSTEM_ERROR "create mapped file
    failed, server is busy or broken" (a stock producer's END is oneway: only the broker's log had it), both
    counted txmq_requests_refused_total{reason="queue-file-failed"} (whose advice is to raise ulimit -n). Now the
    END is SERVICE_NOT_AVAILABLE naming the read-only store and what to do, nothing is counted as the limit, and
    the half, kept undecided through a kill -9 and the repair, is committed after the restart."""
    opaques = itertools.count(1)
    with ext4(tmp_path / "disk", tmp_path / "disk.img") as disk:
        b = _start(disk, tmp_path / "broker.log")
        try:
            async with asyncio.timeout(120):
                client = await RawClient.open(b.broker, "127.0.0.1")
                try:
                    half = await _send_raw(client, next(opaques), "RoTxNew", b"tx", half=True)
                    assert half.code == ResponseCode.SUCCESS, half.remark
                    # a topic whose queue has its file: its COMMIT meets the stopped log, not a new file
                    assert (await _send_raw(client, next(opaques), "RoTxOld", b"plain")).code == ResponseCode.SUCCESS
                    old = await _send_raw(client, next(opaques), "RoTxOld", b"tx-old", half=True)
                    assert old.code == ResponseCode.SUCCESS, old.remark
                    await _turn_read_only(disk, b)
                    [refused] = await client.call(_end(half, next(opaques)), 10)
                    assert refused.code == ResponseCode.SERVICE_NOT_AVAILABLE, (refused.code, refused.remark)
                    assert "read-only" in refused.remark and "restart the broker" in refused.remark, refused.remark
                    reply_props = properties_to_string({"CORRELATION_ID": "c1", "REPLY_TO_CLIENT": "127.0.0.1@gone",
                                                        "TTL": "3000", "MSG_TYPE": "reply",
                                                        "CLUSTER": "DefaultCluster"})
                    [replied] = await client.call(RemotingCommand(R.SEND_REPLY_MESSAGE, opaque=next(opaques),
                                                                  body=b"answer", ext_fields={
                        "producerGroup": "PG_ro_replier", "topic": "DefaultCluster_REPLY_TOPIC",
                        "defaultTopic": "TBW102", "defaultTopicQueueNums": "1", "queueId": "0", "sysFlag": "0",
                        "bornTimestamp": "0", "flag": "0", "properties": reply_props}), 10)
                    assert "not found" in (replied.remark or ""), replied.remark    # nobody to push it to
                    # a write to the log meets EROFS: the store stops. Before: the COMMIT was refused "store refused
                    # the decision: SERVICE_NOT_AVAILABLE", no reason, nothing to do
                    stopping = await _send_raw(client, next(opaques), "RoTxOld", b"tx-refused", half=True)
                    assert stopping.code == ResponseCode.SERVICE_NOT_AVAILABLE, (stopping.code, stopping.remark)
                    [stopped] = await client.call(_end(old, next(opaques)), 10)
                    assert stopped.code == ResponseCode.SERVICE_NOT_AVAILABLE, (stopped.code, stopped.remark)
                    assert "read-only" in stopped.remark and "restart the broker" in stopped.remark, stopped.remark
                finally:
                    client.close()
                assert _refusals(b, "queue-file-failed") == 0     # not the open-files limit: the store stopped
                assert "create mapped file failed" not in b.log(), b.log()
            b = _restart_repaired(disk, b, tmp_path)
            async with asyncio.timeout(60):
                client = await RawClient.open(b.broker, "127.0.0.1")
                try:
                    for kept in (half, old):        # each half was kept undecided
                        [committed] = await client.call(_end(kept, next(opaques)), 10)
                        assert committed.code == ResponseCode.SUCCESS, committed.remark
                finally:
                    client.close()
                assert await _bodies(b.namesrv, "RoTxNew") == [b"tx"]
                assert await _bodies(b.namesrv, "RoTxOld") == [b"plain", b"tx-old"]
        finally:
            if b.proc is not None and b.proc.poll() is None:
                b.kill()
