"""A broker whose config writes hang (a stopped NFS, a stuck FUSE): the hang is real, as in
test_hung_catalogue_stop.py -- the table's .tmp copy is a FIFO no one reads, so the save's open() blocks for ever."""
from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.request

import pytest

from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.codes import SysFlag
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import NamesrvProcess, request
from tests.support.hung_writes import release, sigterm_ends

pytestmark = pytest.mark.asyncio


async def _page(broker) -> str:
    def scrape() -> str:
        with urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5) as page:
            return page.read().decode()
    return await asyncio.to_thread(scrape)


async def _gauge(broker, name: str) -> float | None:
    lines = [x for x in (await _page(broker)).splitlines() if x.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else None


@bounded(150)
async def test_a_hung_offsets_save_is_said_answered_and_the_stop_still_ends(tmp_path):
    """The offsets save hung with nothing said (no log, no gauge), an admin's move (a commit by no consumer of the
    group, saved before its reply) was never answered, and the stop's last save ran ON the loop: blocked behind
    the same write, the process never ended after SIGTERM (then a supervisor's SIGKILL). Now past the bound (30 s)
    the gauge and an ERROR say it, the move is answered SYSTEM_ERROR "not saved" (the next at once), and the stop
    gives its last save up after the bound, with an ERROR, and ends."""
    broker = BrokerProcess(tmp_path / "store", "--flush-consumer-offset-interval-ms", "200").start()
    fifo = tmp_path / "store" / "config" / "consumerOffset.json.tmp"
    move = {"consumerGroup": "CG_hung_offsets", "topic": "TBW102", "queueId": "0", "commitOffset": "0"}
    try:
        os.mkfifo(fifo)
        first = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, move, timeout=60)
        assert first.code == C.SYSTEM_ERROR and "not saved" in first.remark, (first.code, first.remark)
        assert "has not ended in 30 s" in first.remark, first.remark
        assert await _gauge(broker, "txmq_consumer_offsets_write_hung") == 1, broker.log()
        assert "consumer offsets: a write has not ended in 30 s" in broker.log(), broker.log()
        again = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, {**move, "commitOffset": "1"}, timeout=5)
        assert again.code == C.SYSTEM_ERROR and "not saved" in again.remark, (again.code, again.remark)
        sigterm_ends(broker, "consumerOffset.json", within=60)
        assert "consumer offsets not persisted at close: a write has not ended" in broker.log(), broker.log()
    finally:
        release(fifo, broker)


@bounded(90)
async def test_a_hung_subscription_groups_write_is_answered_said_and_the_stop_ends(tmp_path):
    """A subscriptionGroup.json write (asyncio.to_thread: the loop's default executor) that hangs: the update was
    never answered and nothing said it; at SIGTERM the broker logged "stopped" and never ended, the loop's close
    joining the stuck ThreadPoolExecutor worker (then the interpreter's exit would have). Now the update is
    answered SYSTEM_ERROR "not saved" after 2 s, txmq_config_write_hung says it, and the default executor's threads
    are daemons joined at most 10 s at the stop: the process ends, saying which thread it left."""
    broker = BrokerProcess(tmp_path / "store").start()
    fifo = tmp_path / "store" / "config" / "subscriptionGroup.json.tmp"
    try:
        os.mkfifo(fifo)
        update = await request(broker.broker, R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {}, json.dumps(
            {"groupName": "CG_hung_groups", "consumeEnable": True}).encode(), timeout=15)
        assert update.code == C.SYSTEM_ERROR and "not saved" in update.remark, (update.code, update.remark)
        assert "has not ended in 2 s" in update.remark, update.remark
        page = await _page(broker)
        assert 'txmq_config_write_hung{file="subscriptionGroup.json"} 1.0' in page, page
        assert 'txmq_config_write_hung{file="kvConfig.json"} 0.0' in page, page
        assert 'txmq_config_write_hung{file="queueLocks.json"} 0.0' in page, page     # (gauged too)
        sigterm_ends(broker, "subscriptionGroup.json", within=45)
        assert re.search(r"1 thread\(s\) still blocked 10 s after the stop \(txmq-io-\d+", broker.log()), broker.log()
        # (the loop's end cancels its tasks: the write's, a task, was then said to have ended while it still hung)
        assert "the write that hung has ended" not in broker.log(), broker.log()
    finally:
        release(fifo, broker)


@bounded(90)
async def test_a_hung_kv_config_write_on_the_name_server_is_answered_and_its_stop_ends(tmp_path):
    """The second path: the name server keeps kvConfig.json with the same RetriedSave, on its loop's default
    executor, which its serve() (broker/namesrv/server.py) left a ThreadPoolExecutor: PUT_KV_CONFIG was answered
    "not saved" after 2 s, but at SIGTERM the name server never ended, its loop's close joining the worker stuck in
    the write (then a supervisor's SIGKILL)."""
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    fifo = tmp_path / "namesrv.kv.json.tmp"
    try:
        os.mkfifo(fifo)
        put = await request(namesrv.addr, R.PUT_KV_CONFIG, {"namespace": "ORDER_TOPIC_CONFIG", "key": "TopicA",
                                                            "value": "broker-a:4"}, timeout=15)
        assert put.code == C.SYSTEM_ERROR and "not saved" in put.remark, (put.code, put.remark)
        sigterm_ends(namesrv, "kvConfig.json", within=40)
        assert re.search(r"1 thread\(s\) still blocked 10 s after the stop \(txmq-io-\d+", namesrv.log()), \
            namesrv.log()
        assert "the write that hung has ended" not in namesrv.log(), namesrv.log()
    finally:
        release(fifo, namesrv)


@bounded(90)
async def test_a_hung_topics_write_answers_the_topic_admin_codes_not_saved_and_the_stop_ends(tmp_path):
    """UPDATE_AND_CREATE_TOPIC and DELETE_TOPIC_IN_BROKER wait for topics.json (their SUCCESS means saved): behind
    a write that hung they were never answered, each later one held on the same write with its connection, and a
    stock mqadmin timed out saying nothing of why. Now the first is answered SYSTEM_ERROR "not saved" after 2 s,
    the next at once, the topic kept in memory; txmq_topics_catalogue_write_hung says it; the stop still ends."""
    broker = BrokerProcess(tmp_path / "store").start()
    fifo = tmp_path / "store" / "config" / "topics.json.tmp"
    create = {"topic": "HungAdmin", "readQueueNums": "4", "writeQueueNums": "4", "perm": "6"}
    try:
        os.mkfifo(fifo)
        first = await request(broker.broker, R.UPDATE_AND_CREATE_TOPIC, create, timeout=15)
        assert first.code == C.SYSTEM_ERROR and "not saved" in first.remark, (first.code, first.remark)
        assert "has not ended in 2 s" in first.remark, first.remark
        assert await _gauge(broker, "txmq_topics_catalogue_write_hung") == 1, broker.log()
        again = await request(broker.broker, R.UPDATE_AND_CREATE_TOPIC, {**create, "topic": "HungAdmin2"}, timeout=1)
        assert again.code == C.SYSTEM_ERROR and "not saved" in again.remark, (again.code, again.remark)
        route = await request(broker.broker, R.GET_ALL_TOPIC_CONFIG, {}, timeout=5)
        assert b"HungAdmin2" in route.body_bytes(), route.body_bytes()[:500]     # kept, written with the next write
        deleted = await request(broker.broker, R.DELETE_TOPIC_IN_BROKER, {"topic": "HungAdmin"}, timeout=5)
        assert deleted.code == C.SYSTEM_ERROR and "deleted but not saved" in deleted.remark, deleted.remark
        sigterm_ends(broker, "topics.json", within=45)
    finally:
        release(fifo, broker)


@bounded(90)
async def test_a_hung_periodic_delay_offset_write_is_said_and_gauged_until_the_stop(tmp_path):
    """The scheduler's periodic delayOffset.json write (every 10 s once a delayed message moved its progress) that
    hung held the snapshot loop with nothing said: no log, no gauge, no later snapshot written for as long as it
    hung. Now an ERROR after 2 s and txmq_config_write_hung{file="delayOffset.json"} say it; the stop still ends."""
    broker = BrokerProcess(tmp_path / "store").start()
    fifo = tmp_path / "store" / "config" / "delayOffset.json.tmp"
    gauge = 'txmq_config_write_hung{file="delayOffset.json"}'
    try:
        os.mkfifo(fifo)
        sent = await request(broker.broker, R.SEND_MESSAGE, {
            "producerGroup": "PG_hung", "topic": "HungDelayGauge", "defaultTopic": "TBW102",
            "defaultTopicQueueNums": "4", "queueId": "0", "sysFlag": "0", "bornTimestamp": "0", "flag": "0",
            "properties": "DELAY\x011\x02"}, b"later")
        assert sent.code == C.SUCCESS, sent.remark
        assert f"{gauge} 0.0" in await _page(broker)
        for _ in range(500):    # delivered after 1 s, the next periodic snapshot (within 10 s) hangs 2 s later
            if f"{gauge} 1.0" in await _page(broker):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"{gauge} never read 1\n{broker.log()}")
        assert "delayOffset.json: a write has not ended in 2 s" in broker.log(), broker.log()
        sigterm_ends(broker, "delayOffset.json", within=45)
        assert "the write that hung has ended" not in broker.log(), broker.log()
    finally:
        release(fifo, broker)


@bounded(120)
async def test_a_hung_transaction_snapshot_write_is_gauged_and_said_with_no_flush_waiting(tmp_path):
    """The periodic transaction snapshot is written on the store's I/O thread (store.run_io): one that hung there
    held every later flush (each sync send unanswered once one came), and while none came no gauge moved and
    nothing was said. txmq_store_io_stalled_seconds counts how long a no-op has waited there, ERROR past 10 s."""
    store = tmp_path / "store"
    broker = BrokerProcess(store, "--transaction-snapshot-interval-s", "1").start()
    fifo = store / "transactions" / "snapshot.json.tmp"
    try:
        os.mkfifo(fifo)
        half = await request(broker.broker, R.SEND_MESSAGE, {
            "producerGroup": "PG_hung_tx", "topic": "TBW102", "queueId": "0",
            "sysFlag": str(SysFlag.TRANSACTION_PREPARED), "bornTimestamp": "0", "flag": "0",
            "properties": "TRAN_MSG\x01true\x02PGROUP\x01PG_hung_tx\x02"}, b"half")
        assert half.code == C.SUCCESS, half.remark       # the next snapshot (within 1 s) hangs
        for _ in range(300):
            stalled = await _gauge(broker, "txmq_store_io_stalled_seconds")
            if stalled is not None and stalled > 10 and "I/O thread (flushes" in broker.log():
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"the stalled I/O thread was never said\n{broker.log()}")
        assert "the store's I/O thread (flushes, checkpoints, the transaction snapshot) has not come through" \
            in broker.log(), broker.log()
        sigterm_ends(broker, "transactions/snapshot.json", within=45)
        assert "stopping without closing the transactions" in broker.log(), broker.log()
    finally:
        release(fifo, broker)


@bounded(90)
async def test_a_promotions_hung_delay_offset_write_does_not_hold_the_start(tmp_path):
    """A start as a master with a Java master's copied delay progress (slaveMasterDelayOffset.json: a slave
    promoted) writes delayOffset.json with the copy's levels, then removes the copy. That write hanging (a stopped
    NFS under config/) held the start for ever: no listener, no "listening" line, nothing said. Now it is waited
    2 s, said at ERROR (the copy stays, taken again at the next start), and the broker serves; the stop ends."""
    from broker.schedule.progress import MASTER_COPY_NAME, write_master_copy

    config = tmp_path / "store" / "config"
    write_master_copy(str(config), {18: 3})
    fifo = config / "delayOffset.json.tmp"
    os.mkfifo(fifo)
    broker = BrokerProcess(tmp_path / "store")
    try:
        try:
            broker.start(timeout=20)
        except Exception as exc:  # noqa: BLE001 - the start that never listens
            pytest.fail(f"the start never listened behind a hung delayOffset.json write: {exc}\n{broker.log()}")
        assert "delayOffset.json" in broker.log() and "has not ended in 2 s" in broker.log(), broker.log()
        assert (config / MASTER_COPY_NAME).exists()     # kept: its levels are not in delayOffset.json yet
        sigterm_ends(broker, "delayOffset.json", within=45)
    finally:
        release(fifo, broker)


async def _query_key(broker, key: str, timeout: float = 3.0):
    return await request(broker.broker, R.QUERY_MESSAGE, {
        "topic": "TBW102", "key": key, "maxNum": "32", "beginTimestamp": "0",
        "endTimestamp": str((1 << 63) - 1)}, timeout=timeout)


@bounded(150)
async def test_a_hung_index_progress_save_is_gauged_queries_answered_and_nothing_lost(tmp_path):
    """The message index saves its progress every 10 s on its one thread, which also answers queries by key. That
    write hung (here index/progress.tmp is a FIFO no one reads: its open() blocks, as on a stopped NFS) and every
    QUERY_MESSAGE queued behind it was answered by nothing (a client's timeout, the broker's task held for ever),
    with no gauge and no log: no send was in flight for the store's gauges to move. Now the index thread's stall
    is gauged (txmq_index_stalled_seconds) and said at ERROR past 10 s, a query behind it is answered
    SYSTEM_ERROR saying so, and the stop gives the index up at once; restarted, the key is found."""
    store = tmp_path / "store"
    broker = BrokerProcess(store).start()
    fifo = store / "index" / "progress.tmp"
    try:
        os.mkfifo(fifo)
        for _ in range(400):
            # a send wakes the index thread (an idle one saves nothing): the first save 10 s after its start hangs
            sent = await request(broker.broker, R.SEND_MESSAGE, {
                "producerGroup": "PG_hung_index", "topic": "TBW102", "queueId": "0", "sysFlag": "0",
                "bornTimestamp": "0", "flag": "0", "properties": "KEYS\x01hung-key\x02"}, b"indexed")
            assert sent.code == C.SUCCESS, sent.remark
            stalled = await _gauge(broker, "txmq_index_stalled_seconds")
            if stalled is not None and stalled > 10 and "the message index's thread" in broker.log():
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"the held index thread was never said\n{broker.log()}")
        asked = await _query_key(broker, "hung-key")
        assert asked.code == C.SYSTEM_ERROR and "the message index's thread has not come through" in asked.remark, \
            (asked.code, asked.remark)
        sigterm_ends(broker, "index/progress", within=45)   # (a hang guard only)
        # given up at once, as its thread was already seen held: not its own bound (FLUSH_HUNG_S) from the stop
        assert "stopping without closing the index: a write its thread was already held by when the stop began" \
            in broker.log(), broker.log()
    finally:
        release(fifo, broker)
    os.unlink(fifo)
    again = BrokerProcess(store).start()
    try:
        found = await _query_key(again, "hung-key", timeout=10)
        assert found.code == C.SUCCESS and b"indexed" in found.body_bytes(), (found.code, found.remark)
    finally:
        again.kill()
