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
import logging
import os

import pytest

from broker.store import MessageStore, PutRequest, StoreConfig
from broker.store import index as index_mod
from broker.store.index import IndexService
from producer import Producer
from protocol.codes import ResponseCode
from protocol.errors import ResponseError
from tests.fault.test_disk_full import _bodies, _metric
from tests.integration.test_queue_caps import _refusals
from tests.support.broker_process import BrokerProcess
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


async def test_a_store_whose_file_system_turns_read_only_says_so_and_loses_nothing_acknowledged(tmp_path):
    """Before: every send after the remount was answered "store refused the message: SERVICE_NOT_AVAILABLE" (no
    reason, nothing to do), no metric moved (txmq_store_writes_refused 0, no alert: the only trace one ERROR line),
    and an idle broker said nothing at all until its checkpoint failed."""
    with ext4(tmp_path / "disk", tmp_path / "disk.img") as disk:
        b = BrokerProcess(disk.mount_point / "store")
        b.log_path = tmp_path / "broker.log"            # not on the disk that turns read-only
        b.start()
        try:
            async with asyncio.timeout(120):
                acked = [f"acked-{i}".encode() for i in range(ACKED)]
                assert all(not isinstance(a, ResponseError) for a in await _send_all(b.namesrv, acked))
                assert _metric(b.metrics, "txmq_store_read_only") == 0
                disk.turn_read_only()
                for _ in range(POLLS):      # polling the broker from outside: there is no event to await
                    if _metric(b.metrics, "txmq_store_read_only") == 1:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"txmq_store_read_only never turned 1\n{b.log()}")
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
            b.kill()                        # kill -9: what a crash on a failing disk leaves
            disk.repair()
            b = BrokerProcess(disk.mount_point / "store")
            b.log_path = tmp_path / "broker-2.log"
            b.start()
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
