"""A broker stopped (SIGTERM) while its topics.json write hangs: the process ends, and saves what closes after the
topics. The hang is real: topics.json.tmp is a FIFO no one reads, so the config thread's open() blocks for ever,
as on a stopped NFS."""
from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

from protocol.errors import RequestTimeoutError
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import request, stored_count
from tests.support.hung_writes import flush_in_flight, hung_flush_env, release, sigterm_ends, slow_flush_env

pytestmark = pytest.mark.asyncio


async def _send(broker: BrokerProcess, topic: str, properties: str, body: bytes, timeout: float = 5.0):
    """SEND_MESSAGE to queue 0 of ``topic`` (created from TBW102 if new)."""
    return await request(broker.broker, R.SEND_MESSAGE, {
        "producerGroup": "PG_hung", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "4",
        "queueId": "0", "sysFlag": "0", "bornTimestamp": "0", "flag": "0", "properties": properties}, body,
        timeout=timeout)


@bounded(90)
async def test_sigterm_behind_a_hung_catalogue_write_ends_the_process_and_saves_offsets(tmp_path):
    """The config thread was a ThreadPoolExecutor worker: not a daemon, so even once the stop gave the catalogue
    up, the interpreter's exit joined the thread stuck in the hung write and the process never ended (SIGTERM,
    then a supervisor's SIGKILL). Nor is the write said to have ended when the loop's end cancels it."""
    broker = BrokerProcess(tmp_path / "store").start()
    fifo = tmp_path / "store" / "config" / "topics.json.tmp"
    try:
        os.mkfifo(fifo)
        send = await _send(broker, "HungStop", "", b"m")
        assert send.code == C.SUCCESS, send.remark       # past write_wait_s (2 s): the write hangs
        commit = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, {
            "consumerGroup": "CG_hung_stop", "topic": "HungStop", "queueId": "0", "commitOffset": "1"})
        assert commit.code == C.SUCCESS, commit.remark
        sigterm_ends(broker, "topics.json")
        saved = (tmp_path / "store" / "config" / "consumerOffset.json").read_text()
        assert "CG_hung_stop" in saved, broker.log()
        # the loop's end cancelled the wrapped write: that is no end of the write, and no success
        assert "the write that hung has ended" not in broker.log(), broker.log()
    finally:
        release(fifo, broker)


@bounded(90)
async def test_sigterm_behind_a_hung_queue_lock_write_ends_the_process_and_saves_offsets(tmp_path):
    """The queue lock file (queueLocks.json) is written at a stop a holder changed since its last save, before the
    store and the offsets close: on the default executor (a thread the interpreter's exit joins) and waited for
    without a bound, a write that hung kept the stop from ever ending, and nothing after it -- the store, the
    offsets -- was closed or saved."""
    broker = BrokerProcess(tmp_path / "store").start()
    fifo = tmp_path / "store" / "config" / "queueLocks.json.tmp"
    try:
        os.mkfifo(fifo)
        locked = await request(broker.broker, R.LOCK_BATCH_MQ, {}, json.dumps({
            "consumerGroup": "CG_hung_locks", "clientId": "127.0.0.1@locker",
            "mqSet": [{"topic": "TBW102", "brokerName": "broker-a", "queueId": 0}]}).encode())
        assert locked.code == C.SUCCESS and b'"queueId": 0' in locked.body_bytes(), (locked.code, locked.body_bytes())
        commit = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, {
            "consumerGroup": "CG_hung_locks", "topic": "TBW102", "queueId": "0", "commitOffset": "0"})
        assert commit.code == C.SUCCESS, commit.remark
        sigterm_ends(broker, "queueLocks.json")
        assert "CG_hung_locks" in (tmp_path / "store" / "config" / "consumerOffset.json").read_text(), broker.log()
        assert "queueLocks.json" in broker.log() and "not written at stop" in broker.log(), broker.log()
    finally:
        release(fifo, broker)


@bounded(90)
async def test_sigterm_behind_a_hung_delay_offset_write_ends_the_process_and_saves_offsets(tmp_path):
    """config/delayOffset.json (the scheduler's progress) is written at every stop a delayed message moved it,
    before the store and the offsets close: on the default executor and waited for without a bound. The stop of a
    broker whose config directory hung (hungfs's case: topics, groups, offsets, queue locks each bounded) never
    got past the scheduler: the store and the offsets were never closed or saved, SIGTERM answered by nothing."""
    import asyncio

    broker = BrokerProcess(tmp_path / "store").start()
    fifo = tmp_path / "store" / "config" / "delayOffset.json.tmp"
    try:
        os.mkfifo(fifo)
        send = await _send(broker, "HungDelay", "DELAY\x011\x02", b"later")
        assert send.code == C.SUCCESS, send.remark
        for _ in range(300):        # level 1: delivered 1 s later, the scheduler's progress moved
            stored = await request(broker.broker, R.GET_MAX_OFFSET, {"topic": "HungDelay", "queueId": "0"})
            if stored.code == C.SUCCESS and int(stored.ext_fields.get("offset", 0)) > 0:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the delayed message was not delivered\n{broker.log()}")
        commit = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, {
            "consumerGroup": "CG_hung_delay", "topic": "HungDelay", "queueId": "0", "commitOffset": "1"})
        assert commit.code == C.SUCCESS, commit.remark
        sigterm_ends(broker, "delayOffset.json")
        assert "CG_hung_delay" in (tmp_path / "store" / "config" / "consumerOffset.json").read_text(), broker.log()
        assert broker.log().count("delayOffset.json not written at stop") == 1, broker.log()
    finally:
        release(fifo, broker)


async def _acknowledged_then_committed(broker: BrokerProcess, sends: int) -> None:
    for i in range(sends):
        sent = await _send(broker, "HungFlush", "", b"m%d" % i)
        assert sent.code == C.SUCCESS, sent.remark
    commit = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, {
        "consumerGroup": "CG_hung_flush", "topic": "HungFlush", "queueId": "0", "commitOffset": str(sends)})
    assert commit.code == C.SUCCESS, commit.remark


async def _restarted_holds(store, sends: int) -> None:
    """Started again on ``store`` (the hang gone): every acknowledged send is there, and the commit saved at the
    stop."""
    offsets = json.loads((store / "config" / "consumerOffset.json").read_text())
    assert offsets["offsetTable"]["HungFlush@CG_hung_flush"]["0"] == sends, offsets
    again = BrokerProcess(store).start()
    try:
        assert await stored_count(again.broker, "HungFlush", 4) >= sends, again.log()
        queried = await request(again.broker, R.QUERY_CONSUMER_OFFSET, {
            "consumerGroup": "CG_hung_flush", "topic": "HungFlush", "queueId": "0"})
        assert queried.code == C.SUCCESS and queried.int_field("offset", -1) == sends, (queried.code, queried.remark)
    finally:
        again.kill()


@bounded(120)
async def test_sigterm_behind_a_hung_commit_log_flush_ends_saves_offsets_and_loses_nothing_acknowledged(tmp_path):
    """A commit-log flush (msync) that never returns (a hung disk, a stopped NFS; here the hook's, on the store's
    flush thread): the transactions' last snapshot (store.run_io, behind the flush) and the store's close (its
    writer drains its flushes) waited for it for ever, so SIGTERM never ended the process and the consumer offsets,
    closed after the store, were never saved. Now both are given up once the flush has hung FLUSH_HUNG_S (10 s),
    ERROR, and the rest is saved; restarted, the store holds every acknowledged send."""
    store, fifo = tmp_path / "store", tmp_path / "flush.fifo"
    broker = BrokerProcess(store, env=hung_flush_env(fifo)).start()
    try:
        await _acknowledged_then_committed(broker, 5)
        os.mkfifo(fifo)
        with pytest.raises(RequestTimeoutError):    # its flush hangs: never answered (may be stored, or not)
            await request(broker.broker, R.SEND_MESSAGE, {
                "producerGroup": "PG_hung", "topic": "HungFlush", "queueId": "0", "sysFlag": "0",
                "bornTimestamp": "0", "flag": "0", "properties": ""}, b"unanswered", timeout=3)
        sigterm_ends(broker, "commit-log flush", within=45)
        assert "stopping without closing the store: a commit-log flush" in broker.log(), broker.log()
    finally:
        release(fifo, broker)
    os.unlink(fifo)
    await _restarted_holds(store, 5)


@bounded(120)
async def test_sigterm_behind_a_hung_transaction_snapshot_write_ends_and_saves_offsets(tmp_path):
    """The transactions' snapshot is written on the store's I/O thread (store.run_io) at every stop: one whose
    write hangs (transactions/snapshot.json.tmp a FIFO no one reads) kept the stop there for ever, with no flush in
    flight for a flush's age to show, the store never closed, the offsets never saved. Given up past 10 s now."""
    store = tmp_path / "store"
    fifo = store / "transactions" / "snapshot.json.tmp"
    broker = BrokerProcess(store).start()
    try:
        await _acknowledged_then_committed(broker, 3)
        os.mkfifo(fifo)
        sigterm_ends(broker, "transactions/snapshot.json", within=45)
        assert "stopping without closing the transactions: a commit-log flush (msync) or a write on the store's " \
               "I/O thread has not returned" in broker.log(), broker.log()
    finally:
        release(fifo, broker)
    os.unlink(fifo)
    await _restarted_holds(store, 3)


@bounded(120)
async def test_sigterm_behind_a_hung_index_progress_write_ends_and_saves_offsets(tmp_path):
    """The message index's last progress save (index/progress, after an msync of its last file, on the index's own
    thread) is on the store's disk too: behind a stopped NFS it hangs with the commit log's flush. The stop gave
    up the transactions and the store, then waited for the index's close without a bound, so SIGTERM never ended
    the process and the consumer offsets, closed after it, were never saved. Here its progress .tmp is a FIFO no
    one reads (the index alone hung): the stop must still end, the offsets saved, the index rebuilt from the log."""
    store = tmp_path / "store"
    fifo = store / "index" / "progress.tmp"
    broker = BrokerProcess(store).start()
    try:
        await _acknowledged_then_committed(broker, 3)
        os.mkfifo(fifo)
        sigterm_ends(broker, "index/progress", within=45)
        assert "stopping without closing the index" in broker.log(), broker.log()
    finally:
        release(fifo, broker)
    os.unlink(fifo)
    await _restarted_holds(store, 3)


@bounded(150)
async def test_sigterm_on_a_slow_disk_waits_for_flushes_that_complete_and_closes_the_store(tmp_path):
    """A slow disk, not a hung one: each commit-log flush takes 12 s and completes. The stop gave up the
    transactions' snapshot and the store's close once a flush had run 10 s, said at ERROR that the disk hung, and
    left the store as a kill -9 does (no last checkpoint: the next start recovers the log as after a crash). A flush
    no slower than flushes this disk has completed is moving: the stop waits for it (within the service manager's
    60 s), closes everything, and says nothing of a hung disk."""
    store, flag = tmp_path / "store", tmp_path / "slow.flag"
    broker = BrokerProcess(store, env=slow_flush_env(flag, 12)).start()
    try:
        await _acknowledged_then_committed(broker, 3)
        flag.touch()
        sent = await _send(broker, "HungFlush", "", b"slow", timeout=30)    # answered once its 12 s flush returned
        assert sent.code == C.SUCCESS, sent.remark
        last = asyncio.ensure_future(_send(broker, "HungFlush", "", b"last", timeout=60))
        last.add_done_callback(lambda f: f.exception())     # (answered or not: the stop closes its connection)
        await flush_in_flight(broker)   # its flush under way, held by the slow disk
        sigterm_ends(broker, "slow commit-log flush", within=60)
    finally:
        flag.unlink(missing_ok=True)
        broker.kill()
    stop = broker.log().partition("signal received: stopping")[2]   # (running, a 12 s flush is said, as it should)
    assert "stopping without closing" not in stop and "hung disk" not in stop and "stopped" in stop, broker.log()
    again = BrokerProcess(store).start()
    try:    # the slow send acknowledged, and the last one, flushed by the close that waited for it
        assert await stored_count(again.broker, "HungFlush", 4) == 5, again.log()
    finally:
        again.kill()
    # closed: checkpointed at the log's end, the transactions' snapshot written (not recovered as after a crash)
    start = again.log().partition("INFO txmq.server: stopped")[2]
    report = re.search(r"checkpoint_offset=(\d+), scanned_from=\d+, end_offset=(\d+)", start)
    assert report and report[1] == report[2], start
    assert "transactions recovered from the snapshot" in start, start
    await _restarted_holds(store, 3)

