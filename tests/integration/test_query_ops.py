"""Query by key and operations against the real broker: the admin CLI as a subprocess, our clients over TCP."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from consumer.pull_consumer import MessageQueue
from producer import LocalTransactionState, Producer, TransactionProducer
from protocol.admin_bodies import decode_consumer_offsets, decode_mq_table
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import decode_records
from protocol.txlog import HALF_TOPIC, OP_TOPIC
from tests.integration.test_hostile_caps import _scraped
from tests.support.bounded import bounded
from tests.support.broker_process import REPO

pytestmark = pytest.mark.asyncio


def _admin(b, *args):
    return subprocess.run([sys.executable, "-m", "broker", "admin", "--broker", b.broker, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=30)


async def _admin_json(b, *args):
    done = await asyncio.to_thread(_admin, b, *args, "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    return json.loads(done.stdout)


async def _request(b, code, fields=None, body=b""):
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        return await conn.request(RemotingCommand.request(code, fields, body), 5.0)
    finally:
        conn.close()


async def _create(b, topic, queues):
    resp = await _request(b, R.UPDATE_AND_CREATE_TOPIC, {"topic": topic, "readQueueNums": queues,
                                                         "writeQueueNums": queues, "perm": 6})
    assert resp.code == ResponseCode.SUCCESS, resp.remark


@bounded(60)
async def test_found_by_key_by_uniq_key_and_by_id(broker):
    b = broker
    async with Producer(b.namesrv, "PG_query") as producer:
        sent = [await producer.send("Orders", f"order {i}".encode(), tags="created", keys=[f"order-{i}", "shop-1"])
                for i in range(5)]
        other = await producer.send("Refunds", b"refund", keys="order-3")
    rows = await _admin_json(b, "query-key", "Orders", "order-3")
    assert [(r["msg_id"], r["body"], r["keys"], r["queue_offset"]) for r in rows] == [
        (sent[3].msg_id, "order 3", "order-3 shop-1", sent[3].queue_offset)]
    shop = await _admin_json(b, "query-key", "Orders", "shop-1")
    assert sorted(r["msg_id"] for r in shop) == sorted(s.msg_id for s in sent)
    table = await asyncio.to_thread(_admin, b, "query-key", "Orders", "order-3")
    assert table.returncode == 0 and sent[3].msg_id in table.stdout and "1 message(s)" in table.stdout
    missing = await asyncio.to_thread(_admin, b, "query-key", "Orders", "order-99")
    assert missing.returncode == 1 and "0 message(s)" in missing.stdout

    # QUERY_MESSAGE as a Java client's queryMessageByUniqKey sends it
    resp = await _request(b, R.QUERY_MESSAGE, {"topic": "Orders", "key": sent[1].msg_id, "maxNum": 32,
                                               "beginTimestamp": 0, "endTimestamp": 2**63 - 1,
                                               "_UNIQUE_KEY_QUERY": "true"})
    assert resp.code == ResponseCode.SUCCESS
    assert [m.body for m in decode_records(resp.body_bytes())] == [b"order 1"]
    assert resp.int_field("indexLastUpdatePhyoffset") == int(other.offset_msg_id[-16:], 16)
    assert resp.int_field("indexLastUpdateTimestamp") > 0
    nothing = await _request(b, R.QUERY_MESSAGE, {"topic": "Orders", "key": "nope", "maxNum": 32,
                                                  "beginTimestamp": 0, "endTimestamp": 2**63 - 1})
    assert nothing.code == ResponseCode.QUERY_NOT_FOUND and "maybe time range not correct" in nothing.remark
    # maxNum as a Java queryMessage(topic, key, maxNum, ..) passes it: RocketMQ's index takes at most min(maxNum,
    # 64), none at all for 0 or less
    for max_num, bodies in ((0, []), (-1, []), (2, [b"order 3", b"order 4"]), (1_000, [b"order 0", b"order 1",
                                                                                      b"order 2", b"order 3",
                                                                                      b"order 4"])):
        asked = await _request(b, R.QUERY_MESSAGE, {"topic": "Orders", "key": "shop-1", "maxNum": max_num,
                                                    "beginTimestamp": 0, "endTimestamp": 2**63 - 1})
        got = [m.body for m in decode_records(asked.body_bytes())] if asked.body else []
        assert (asked.code, got) == (ResponseCode.SUCCESS if bodies else ResponseCode.QUERY_NOT_FOUND, bodies), \
            max_num

    by_offset_id = await _admin_json(b, "show-msg", sent[2].offset_msg_id)
    assert [(m["body"], m["msg_id"]) for m in by_offset_id] == [("order 2", sent[2].msg_id)]
    by_uniq = await _admin_json(b, "show-msg", sent[4].msg_id)
    assert [(m["topic"], m["body"], m["properties"]["TAGS"]) for m in by_uniq] == [("Orders", "order 4", "created")]
    shown = await asyncio.to_thread(_admin, b, "show-msg", sent[4].msg_id, "--topic", "Orders")
    assert shown.returncode == 0 and "order 4" in shown.stdout


class _Commit:
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT_MESSAGE


@bounded(60)
async def test_a_committed_transaction_is_found_by_key_and_id_and_its_op_record_by_neither(broker):
    """RocketMQ indexes the half and the committed message; its op messages have no key. The committed
    message is what a client finds on the real topic, by KEYS or by its msgId; the op record has no entry."""
    b = broker
    async with TransactionProducer(b.namesrv, "PG_txquery", _Commit()) as producer:
        tx = await producer.send_in_transaction("TxOrders", b"paid", keys="order-tx")
    assert tx.acknowledged
    msg_id = tx.send_result.msg_id
    by_key = await _admin_json(b, "query-key", "TxOrders", "order-tx")
    assert [(r["msg_id"], r["body"]) for r in by_key] == [(msg_id, "paid")]
    for key, unique in ((msg_id, "true"), ("order-tx", "false")):
        resp = await _request(b, R.QUERY_MESSAGE, {"topic": "TxOrders", "key": key, "maxNum": 32,
                                                   "beginTimestamp": 0, "endTimestamp": 2**63 - 1,
                                                   "_UNIQUE_KEY_QUERY": unique})
        assert resp.code == ResponseCode.SUCCESS
        [found] = decode_records(resp.body_bytes())
        assert (found.topic, found.body) == ("TxOrders", b"paid")      # the committed message, not the half
    half = await _request(b, R.QUERY_MESSAGE, {"topic": HALF_TOPIC, "key": msg_id, "maxNum": 32,
                                               "beginTimestamp": 0, "endTimestamp": 2**63 - 1})
    assert [m.body for m in decode_records(half.body_bytes())] == [b"paid"]
    by_id = await _admin_json(b, "show-msg", msg_id, "--topic", "TxOrders")
    assert [(m["topic"], m["body"]) for m in by_id] == [("TxOrders", "paid")]
    ops = await _request(b, R.PULL_MESSAGE, {"consumerGroup": "CG_ops", "topic": OP_TOPIC, "queueId": 0,
                                             "queueOffset": 0, "maxMsgNums": 32, "sysFlag": 4, "subscription": "*",
                                             "commitOffset": 0, "suspendTimeoutMillis": 0, "subVersion": 0})
    assert ops.code == ResponseCode.SUCCESS, (ops.code, ops.remark)
    [op] = decode_records(ops.body_bytes())
    op_key = await _request(b, R.QUERY_MESSAGE, {"topic": OP_TOPIC, "key": op.properties["UNIQ_KEY"], "maxNum": 32,
                                                 "beginTimestamp": 0, "endTimestamp": 2**63 - 1})
    assert op_key.code == ResponseCode.QUERY_NOT_FOUND
    # the committed message counts its body's bytes on its topic (read from the record it was made of)
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read())
    assert b'rocketmq_throughput_in_total{topic="TxOrders"} 4.0' in text


@bounded(60)
async def test_consumer_progress_lag_is_exact(broker):
    b = broker
    await _create(b, "Progress", 2)
    async with Producer(b.namesrv, "PG_progress") as producer:
        sent = [await producer.send("Progress", b"p%d" % i) for i in range(7)]
    per_queue = {q: sum(1 for s in sent if s.queue.queue_id == q) for q in (0, 1)}
    consumer = PullConsumer(b.namesrv, "CG_progress")
    try:
        queues = await consumer.fetch_queues("Progress")
        await consumer.commit_offset(next(q for q in queues if q.queue_id == 0), 1)
        await consumer.commit_offset(next(q for q in queues if q.queue_id == 1), 0)
        report = await _admin_json(b, "consumer-progress", "CG_progress")
        lags = {r["queue_id"]: (r["broker_offset"], r["consumer_offset"], r["lag"]) for r in report["queues"]}
        assert lags == {0: (per_queue[0], 1, per_queue[0] - 1), 1: (per_queue[1], 0, per_queue[1])}
        assert report["total_lag"] == 6 and report["consumers"] == []
        table = await asyncio.to_thread(_admin, b, "consumer-progress", "CG_progress")
        assert "total lag 6; 0 consumer(s) online" in table.stdout
        status = await _admin_json(b, "topic-status", "Progress")
        assert [r["max_offset"] for r in status["queues"]] == [per_queue[0], per_queue[1]]
        assert status["consumer_groups"] == ["CG_progress"]
    finally:
        await consumer.shutdown()


@bounded(90)
async def test_reset_by_timestamp_makes_a_live_consumer_read_again(broker):
    b = broker
    await _create(b, "Replay", 1)
    async with Producer(b.namesrv, "PG_replay") as producer:
        for i in range(6):
            await producer.send("Replay", b"r%d" % i)
            await asyncio.sleep(0.01)       # distinct store times, so the target offset is unambiguous
    seen: list = []
    got = asyncio.Event()

    def listener(msg):
        seen.append(msg)
        got.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(b.namesrv, "CG_replay", listener, consume_from="first", offset_commit_interval_s=0.2,
                            suspend_ms=1000)
    consumer.subscribe("Replay")
    await consumer.start()
    try:
        while len(seen) < 6:
            got.clear()
            await got.wait()
        mq = MessageQueue("Replay", "broker-a", 0)
        while (await consumer.client.fetch_offset(mq)) != 6:        # committed by the commit loop
            await asyncio.sleep(0.05)
        target = seen[2]
        before = len(seen)
        report = await _admin_json(b, "reset-offset", "CG_replay", "Replay", "--timestamp",
                                   str(target.store_timestamp))
        assert [(r["queue_id"], r["offset"]) for r in report["queues"]] == [(0, target.queue_offset)]
        while len(seen) < before + 4:
            got.clear()
            await got.wait()
        assert [m.queue_offset for m in seen[before:]] == [2, 3, 4, 5]
        assert consumer.client.reset_offsets[mq] == 2
    finally:
        await consumer.shutdown()


@bounded(60)
async def test_a_reset_without_force_leaves_a_queue_the_group_never_committed_as_it_is(broker):
    # resetOffsetByTime -f false (mqadmin, the admin API, `admin reset-offset --no-force`) moves each queue back
    # to the time, never forward. A queue the group has no offset for has nothing to move back from: it was
    # committed 0, and its consumer read the whole queue again from its start.
    b = broker
    await _create(b, "Partial", 2)
    async with Producer(b.namesrv, "PG_partial") as producer:
        for qid in (0, 1):
            for i in range(4):
                await producer.send("Partial", b"p%d" % i, queue=MessageQueue("Partial", "broker-a", qid))
    committed = await _request(b, R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "CG_partial", "topic": "Partial",
                                                             "queueId": 0, "commitOffset": 4})
    assert committed.code == ResponseCode.SUCCESS
    reset = await _request(b, R.INVOKE_BROKER_TO_RESET_OFFSET, {"topic": "Partial", "group": "CG_partial",
                                                                "timestamp": 1, "isForce": False})
    assert reset.code == ResponseCode.SUCCESS, reset.remark
    assert decode_mq_table(reset.body_bytes())[1] == {("Partial", "broker-a", 0): 0}
    one = await _request(b, R.INVOKE_BROKER_TO_RESET_OFFSET, {"topic": "Partial", "group": "CG_partial",
                                                              "timestamp": -1, "isForce": False,
                                                              "queueId": 1, "offset": 2})
    assert one.code == ResponseCode.SUCCESS, one.remark
    assert decode_mq_table(one.body_bytes())[1] == {}
    said = await asyncio.to_thread(_admin, b, "reset-offset", "CG_partial", "Partial", "--queue", "1", "--offset", "2",
                                   "--no-force")
    # (the group has an offset on the topic, queue 0's: not "no offset on Partial")
    assert said.returncode == 0 and "no offset on queue 1 of Partial to move back: nothing reset" in said.stdout, \
        said.stdout + said.stderr
    offsets = decode_consumer_offsets((await _request(b, R.GET_ALL_CONSUMER_OFFSET)).body_bytes())
    assert {k: v for k, v in offsets.items() if k[0] == "CG_partial"} == {("CG_partial", "Partial", 0): 0}
    # with force, as asked: every queue to the time, the one never committed too
    forced = await _request(b, R.INVOKE_BROKER_TO_RESET_OFFSET, {"topic": "Partial", "group": "CG_partial",
                                                                 "timestamp": -1, "isForce": True})
    assert decode_mq_table(forced.body_bytes())[1] == {("Partial", "broker-a", 0): 4, ("Partial", "broker-a", 1): 4}


@bounded(60)
async def test_a_reset_without_force_leaves_a_live_consumers_uncommitted_queue_consuming(broker_factory):
    # Without force the broker's table leaves out a queue the group never committed. The consumer stopped every
    # loop of the topic all the same and started that queue again from where a queue with no offset starts --
    # the end, past what it had pulled and not yet consumed: those messages were never delivered. (Ratio 0: the
    # queue's first message counts as on disk, so a group with no offset is told QUERY_NOT_FOUND, not 0, as for
    # any queue older than 40 % of RAM or one retention trimmed.)
    b = broker_factory("--access-message-in-memory-max-ratio", "0")
    await _create(b, "Untold", 2)
    q1 = MessageQueue("Untold", "broker-a", 1)
    committed = await _request(b, R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "CG_untold", "topic": "Untold",
                                                             "queueId": 0, "commitOffset": 0})
    assert committed.code == ResponseCode.SUCCESS
    blocked, release, seen = asyncio.Event(), asyncio.Event(), asyncio.Queue()

    async def listener(msg):
        if msg.body == b"block":
            blocked.set()
            await release.wait()
        seen.put_nowait((msg.queue_id, msg.queue_offset))
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(b.namesrv, "CG_untold", listener, consume_from="last", offset_commit_interval_s=3600,
                            suspend_ms=1000)
    consumer.subscribe("Untold")
    applied = asyncio.Event()
    reset = consumer.reset_offsets

    async def told(topic, offsets):
        try:
            await reset(topic, offsets)
        finally:
            applied.set()
    consumer.reset_offsets = told
    await consumer.start()
    try:
        while consumer._offsets.get(q1) != 0:       # its loop started, at the queue's end (0): none committed
            await asyncio.sleep(0.02)
        async with Producer(b.namesrv, "PG_untold") as producer:
            for body in (b"ok", b"block", b"after"):
                await producer.send("Untold", body, queue=q1)
            await blocked.wait()        # offset 1 in hand, 2 pulled or not: the queue's end is 3
            said = await _request(b, R.INVOKE_BROKER_TO_RESET_OFFSET, {"topic": "Untold", "group": "CG_untold",
                                                                       "timestamp": -1, "isForce": False})
            assert said.code == ResponseCode.SUCCESS, said.remark
            assert decode_mq_table(said.body_bytes())[1] == {("Untold", "broker-a", 0): 0}
            await applied.wait()
            release.set()
            await producer.send("Untold", b"last", queue=q1)
        got = []
        while (1, 3) not in got:
            got.append(await seen.get())
        assert [o for q, o in got if q == 1] == [0, 1, 2, 3]
    finally:
        await consumer.shutdown()


@bounded(90)
async def test_an_old_style_reset_by_time_survives_a_kill_9(broker_factory):
    """mqadmin resetOffsetByTimeOld (the admin API's resetOffsetByTimestampOld, also how resetOffsetNew falls back)
    moves a group that has no consumer running: SEARCH_OFFSET_BY_TIMESTAMP, then UPDATE_CONSUMER_OFFSET from the
    admin tool, which is no consumer of the group. Answered SUCCESS from memory, the rewind was on disk only at the
    next periodic save (--flush-consumer-offset-interval-ms): a kill -9 before it put the group back where it
    was, the replay asked for never came, nothing said. A rewind by a client that is no consumer of the group is
    on disk before SUCCESS, as INVOKE_BROKER_TO_RESET_OFFSET is."""
    flags = ("--flush-consumer-offset-interval-ms", "600000")       # no periodic save within the test
    b = broker_factory(*flags)
    await _create(b, "OldReset", 1)
    mq = MessageQueue("OldReset", "broker-a", 0)
    async with Producer(b.namesrv, "PG_old_reset") as producer:
        for i in range(6):
            await producer.send("OldReset", b"o%d" % i, queue=mq)
            await asyncio.sleep(0.01)       # distinct store times, so the target offset is unambiguous
    async with PullConsumer(b.namesrv, "CG_old_reset") as consumer:
        await consumer.fetch_queues("OldReset")
        stored_at = [m.store_timestamp for m in (await consumer.pull(mq, 0)).messages]
        await consumer.commit_offset(mq, 6)             # consumed it all
    assert b.stop() == 0                                # saved at the stop
    b = broker_factory(*flags)
    async with PullConsumer(b.namesrv, "CG_old_reset") as tool:     # no heartbeat: no consumer of the group
        await tool.fetch_queues("OldReset")
        target = await tool.search_offset(mq, stored_at[2])
        assert target == 2
        await tool.commit_offset(mq, target)
    b.kill()
    b = broker_factory(*flags)
    async with PullConsumer(b.namesrv, "CG_old_reset") as consumer:
        await consumer.fetch_queues("OldReset")
        assert await consumer.fetch_offset(mq) == 2, "the reset was undone by the kill"
    assert "offset of group CG_old_reset on OldReset queue 0 moved back from 6 to 2" in b.log()


@bounded(90)
async def test_an_admin_skip_forward_and_a_cloned_group_survive_a_kill_9(broker_factory):
    """An admin's move FORWARD is UPDATE_CONSUMER_OFFSET from a client that is no consumer of the group too:
    skipAccumulatedMessage and resetOffsetByTimeOld --force fall back to it (max offset or a later time) when the
    group has no consumer online, and cloneGroupOffset sends it per queue to the destination group, which has no
    offset yet. Only rewinds were saved before SUCCESS: a kill -9 within the periodic save had the group redeliver
    all it was told to skip (6 of 6 here) and the clone start over, the operator told SUCCESS each time."""
    flags = ("--flush-consumer-offset-interval-ms", "600000")       # no periodic save within the test
    b = broker_factory(*flags)
    await _create(b, "SkipFwd", 1)
    mq = MessageQueue("SkipFwd", "broker-a", 0)
    async with Producer(b.namesrv, "PG_skip_fwd") as producer:
        for i in range(6):
            await producer.send("SkipFwd", b"s%d" % i, queue=mq)
    async with PullConsumer(b.namesrv, "CG_skip_fwd") as consumer:
        await consumer.fetch_queues("SkipFwd")
        await consumer.commit_offset(mq, 0)
    assert b.stop() == 0                                # saved at the stop: the group at 0 of 6
    b = broker_factory(*flags)
    async with PullConsumer(b.namesrv, "CG_skip_fwd") as tool:      # no heartbeat: no consumer of the group
        await tool.fetch_queues("SkipFwd")
        end = await tool.max_offset(mq)
        assert end == 6
        await tool.commit_offset(mq, end)                           # skipAccumulatedMessage's fallback
    async with PullConsumer(b.namesrv, "CG_skip_clone") as tool:    # cloneGroupOffset into a new group
        await tool.fetch_queues("SkipFwd")
        await tool.commit_offset(mq, 4)
    b.kill()
    b = broker_factory(*flags)
    async with PullConsumer(b.namesrv, "CG_skip_fwd") as consumer:
        await consumer.fetch_queues("SkipFwd")
        assert await consumer.fetch_offset(mq) == 6, "the skip was undone by the kill"
    async with PullConsumer(b.namesrv, "CG_skip_clone") as consumer:
        await consumer.fetch_queues("SkipFwd")
        assert await consumer.fetch_offset(mq) == 4, "the cloned offset was lost to the kill"
    assert "offset of group CG_skip_fwd on SkipFwd queue 0 moved forward from 0 to 6" in b.log()
    assert "offset of group CG_skip_clone on SkipFwd queue 0 set to 4 (none before)" in b.log()


@bounded(90)
async def test_kill_9_loses_no_index_entry_and_a_lost_index_is_rebuilt(broker_factory):
    b = broker_factory()
    async with Producer(b.namesrv, "PG_kill") as producer:
        sent = [await producer.send("Crash", b"c%d" % i, keys=f"k{i} batch") for i in range(50)]
    b.kill()
    b = broker_factory()
    rows = await _admin_json(b, "query-key", "Crash", "batch")
    assert sorted(r["msg_id"] for r in rows) == sorted(s.msg_id for s in sent)
    assert [r["body"] for r in await _admin_json(b, "query-key", "Crash", "k49")] == ["c49"]
    b.stop()
    shutil.rmtree(b.store_dir / "index")
    b = broker_factory()
    assert len(await _admin_json(b, "query-key", "Crash", "batch")) == 50
    # (the rebuild's end is said: queries meanwhile were answered from a prefix, their remark saying so)
    assert "index: caught up with the commit log (" in b.log()     # (not "... again after a write error")


@bounded(90)
async def test_an_index_directory_removed_under_a_running_broker_is_rebuilt_without_a_restart(broker):
    """index/ removed while the broker runs (an operator's cleanup of a "large sparse" directory): its next progress
    save failed ENOENT and indexing stopped until a restart, every key stored before and after it missing from
    queries by key for as long as the broker ran. The error is tried again like a full disk's (every 10 s): the
    directory is made again and the index rebuilt from the commit log."""
    b = broker
    async with Producer(b.namesrv, "PG_rm_index") as producer:
        before = await producer.send("RmIndex", b"before", keys="before")
        assert [m.msg_id for m in await _query_key(b, "RmIndex", "before")] == [before.msg_id]
        shutil.rmtree(b.store_dir / "index")
        after = await producer.send("RmIndex", b"after", keys="after")
        async with asyncio.timeout(60):     # a progress save within 10 s (at a send: it fails), a resume 10 s later
            while "caught up with the commit log again" not in b.log():
                await producer.send("RmIndex", b"more", keys="more")
                await asyncio.sleep(0.2)
    # (the files found unlinked at the progress save, before its write failed ENOENT: rebuilt whole)
    assert "removed from" in b.log() and "under the running broker" in b.log() and "once the error passes" in b.log()
    assert "rebuilding the message index from the commit log" in b.log()
    assert (b.store_dir / "index").is_dir() and any(p.name.isdigit() for p in (b.store_dir / "index").iterdir())
    assert [m.msg_id for m in await _query_key(b, "RmIndex", "before")] == [before.msg_id]
    assert [m.msg_id for m in await _query_key(b, "RmIndex", "after")] == [after.msg_id]


@bounded(90)
async def test_an_index_file_a_start_cannot_open_is_kept_and_read_once_it_can_be(broker_factory):
    """An index file a start could not open (an I/O error, a file a broker once run as root left root's: here a
    directory in its place, EISDIR) was taken for damaged: it and every newer file unlinked and rebuilt from the
    commit log. It is kept: the start answers from the files before it, its remark saying indexing is stopped, and
    reads them all once the file can be opened again -- nothing removed, nothing rebuilt."""
    flags = ("--index-hash-slots", "1000", "--index-max-entries", "4")     # (a new index file every 3 entries)
    b = broker_factory(*flags)
    async with Producer(b.namesrv, "PG_unread") as producer:
        sent = [await producer.send("Unread", b"u%d" % i, keys=f"k{i} shop") for i in range(5)]
    assert len(await _query_key(b, "Unread", "shop")) == 5
    b.stop()
    index = b.store_dir / "index"
    names = sorted(p.name for p in index.iterdir() if p.name.isdigit())
    assert len(names) >= 4
    victim = index / names[2]
    victim.rename(index / "kept-aside")
    victim.mkdir()
    b = broker_factory(*flags)
    resp = await _request(b, R.QUERY_MESSAGE, {"topic": "Unread", "key": "shop", "maxNum": 32, "beginTimestamp": 0,
                                               "endTimestamp": 2**63 - 1})
    assert "indexing is stopped" in (resp.remark or ""), (resp.code, resp.remark, b.log())
    assert resp.code == ResponseCode.QUERY_NOT_FOUND or len(decode_records(resp.body_bytes())) < 5
    assert f"index file {names[2]} could not be read" in b.log() and "is damaged" not in b.log()
    assert sorted(p.name for p in index.iterdir() if p.name.isdigit()) == names
    victim.rmdir()
    (index / "kept-aside").rename(victim)
    async with asyncio.timeout(60):     # read again within 10 s
        while "caught up with the commit log again" not in b.log():
            await asyncio.sleep(0.2)
    assert sorted(m.msg_id for m in await _query_key(b, "Unread", "shop")) == sorted(s.msg_id for s in sent)
    assert sorted(p.name for p in index.iterdir() if p.name.isdigit()) == names and "is damaged" not in b.log()


async def _query_key(b, topic, key, begin=0, end=2**63 - 1):
    resp = await _request(b, R.QUERY_MESSAGE, {"topic": topic, "key": key, "maxNum": 32, "beginTimestamp": begin,
                                               "endTimestamp": end})
    assert resp.code in (ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND), resp.remark
    return decode_records(resp.body_bytes()) if resp.code == ResponseCode.SUCCESS else []


@bounded(60)
async def test_a_key_is_found_behind_a_colliding_key_and_by_its_exact_store_time(broker):
    """"Aa" and "BB" share String.hashCode: one message of Aa behind 100 of BB was NOT FOUND (the query took 80
    entries of the hash and dropped BB's). A message asked for by its own store time, to the millisecond, was NOT
    FOUND unless stored a whole number of seconds after its index file's first entry."""
    b = broker
    async with Producer(b.namesrv, "PG_collide") as producer:
        aa = await producer.send("Collide", b"aa", keys="Aa")
        for i in range(100):
            await producer.send("Collide", b"bb%d" % i, keys="BB")
    assert [m.msg_id for m in await _query_key(b, "Collide", "Aa")] == [aa.msg_id]
    bb = await _query_key(b, "Collide", "BB")
    assert len(bb) == 32 and all(m.keys == "BB" for m in bb)
    for m in bb:
        got = await _query_key(b, "Collide", "BB", m.store_timestamp, m.store_timestamp)
        assert m.msg_id in [g.msg_id for g in got], f"not found at its store time {m.store_timestamp}"
        assert {g.store_timestamp for g in got} == {m.store_timestamp}, "outside [begin, end]"


@bounded(60)
async def test_subscription_groups_topic_delete_and_broker_status(broker):
    b = broker
    resp = await _request(b, R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=json.dumps(
        {"groupName": "CG_off", "consumeEnable": False, "retryMaxTimes": 3}).encode())
    assert resp.code == ResponseCode.SUCCESS
    table = json.loads((await _request(b, R.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)).body_bytes())
    assert table["subscriptionGroupTable"]["CG_off"]["retryMaxTimes"] == 3
    assert table["dataVersion"]["counter"] == 1
    async with Producer(b.namesrv, "PG_ops") as producer:
        await producer.send("Doomed", b"x")
    pull = await _request(b, R.PULL_MESSAGE, {"consumerGroup": "CG_off", "topic": "Doomed", "queueId": 0,
                                              "queueOffset": 0, "maxMsgNums": 1, "sysFlag": 0, "commitOffset": 0,
                                              "suspendTimeoutMillis": 0, "subVersion": 0})
    assert pull.code == ResponseCode.NO_PERMISSION and "subscription group no permission" in pull.remark
    bad = await _request(b, R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=b"{not json")
    assert bad.code == ResponseCode.SYSTEM_ERROR

    stats = await _request(b, R.GET_TOPIC_STATS_INFO, {"topic": "Doomed"})
    _obj, offsets = decode_mq_table(stats.body_bytes())
    assert sum(v["maxOffset"] for v in offsets.values()) == 1
    assert (await _request(b, R.DELETE_TOPIC_IN_BROKER, {"topic": "Doomed"})).code == ResponseCode.SUCCESS
    gone = await _request(b, R.GET_TOPIC_STATS_INFO, {"topic": "Doomed"})
    assert gone.code == ResponseCode.TOPIC_NOT_EXIST and gone.remark == "topic[Doomed] not exist"
    system = await _request(b, R.DELETE_TOPIC_IN_BROKER, {"topic": "SCHEDULE_TOPIC_XXXX"})
    assert system.code == ResponseCode.SYSTEM_ERROR and "conflict with system topic" in system.remark

    status = await _admin_json(b, "broker-status")
    assert status["brokerVersionDesc"] == "V4_9_8" and int(status["commitLogMaxOffset"]) > 0
    assert status["dispatchBehindBytes"] == "0" and int(status["txmqIndexEntries"]) >= 1


@bounded(60)
async def test_consumer_progress_reports_the_rate_the_group_consumes_at(broker):
    """consumeTps (GET_CONSUME_STATS; consumer-progress --json) was always 0.0: a group consuming steadily
    looked stopped. It is the group's messages pulled per second over the last minute, as RocketMQ's
    (within 50-60 s: the minute is counted in 10 s slots, the current one partly)."""
    b = broker
    await _create(b, "Rate", 1)
    async with Producer(b.namesrv, "PG_rate") as producer:
        for i in range(30):
            await producer.send("Rate", b"r%d" % i)
    async with PullConsumer(b.namesrv, "CG_rate") as consumer:
        mq = (await consumer.fetch_queues("Rate"))[0]
        got = 0
        while got < 30:
            got += len((await consumer.pull(mq, got)).messages)
        await consumer.commit_offset(mq, got)
    report = await _admin_json(b, "consumer-progress", "CG_rate")
    assert 30 / 60 <= report["consume_tps"] <= 30 / 50, report
    other = decode_mq_table((await _request(b, R.GET_CONSUME_STATS, {"consumerGroup": "CG_idle", "topic": "Rate"}))
                            .body_bytes())[0]
    assert other["consumeTps"] == 0.0


def _group_series(broker, group: str) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.labels.get("consumer_group") == group}


async def _groups_known(b, topic: str) -> tuple[set, set]:
    table = json.loads((await _request(b, R.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)).body_bytes())
    who = json.loads((await _request(b, R.QUERY_TOPIC_CONSUME_BY_WHO, {"topic": topic})).body_bytes())
    return set(table["subscriptionGroupTable"]), set(who["groupList"])


@bounded(90)
async def test_a_deleted_subscription_group_leaves_its_offsets_config_and_series(broker_factory):
    """DELETE_SUBSCRIPTIONGROUP was answered REQUEST_CODE_NOT_SUPPORTED (mqadmin deleteSubGroup failed): a group
    that was gone kept its committed offsets (rewritten with the whole table every 5 s), its lag and delivery
    series in every scrape and its place in every group listing, for as long as the broker ran. With removeOffset
    the offsets go too, as RocketMQ's; both survive a restart."""
    b = broker_factory()
    await _create(b, "Ended", 1)
    async with Producer(b.namesrv, "PG_ended") as producer:
        for i in range(3):
            await producer.send("Ended", b"e%d" % i)
    resp = await _request(b, R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=json.dumps(
        {"groupName": "CG_ended", "retryMaxTimes": 2}).encode())
    assert resp.code == ResponseCode.SUCCESS
    for group in ("CG_ended", "CG_stays"):
        async with PullConsumer(b.namesrv, group) as consumer:
            mq = (await consumer.fetch_queues("Ended"))[0]
            assert len((await consumer.pull(mq, 0)).messages) == 3
            await consumer.commit_offset(mq, 2)
    listed, consuming = await _groups_known(b, "Ended")
    assert {"CG_ended", "CG_stays"} <= listed and {"CG_ended", "CG_stays"} <= consuming
    series = await asyncio.to_thread(_group_series, b, "CG_ended")
    assert series[("rocketmq_consumer_lag_messages", (("consumer_group", "CG_ended"), ("topic", "Ended")))] == 1
    assert series[("rocketmq_messages_out_total", (("consumer_group", "CG_ended"), ("topic", "Ended")))] == 3

    gone = await _request(b, R.DELETE_SUBSCRIPTIONGROUP, {"groupName": "CG_ended", "removeOffset": "true"})
    assert gone.code == ResponseCode.SUCCESS, gone.remark
    kept = await _request(b, R.DELETE_SUBSCRIPTIONGROUP, {"groupName": "CG_never", "removeOffset": "false"})
    assert kept.code == ResponseCode.SUCCESS

    async def check():
        listed, consuming = await _groups_known(b, "Ended")
        assert "CG_ended" not in listed and "CG_ended" not in consuming
        assert "CG_stays" in listed and "CG_stays" in consuming
        assert await asyncio.to_thread(_group_series, b, "CG_ended") == {}
        stays = await asyncio.to_thread(_group_series, b, "CG_stays")
        assert stays[("rocketmq_consumer_lag_messages", (("consumer_group", "CG_stays"), ("topic", "Ended")))] == 1
    await check()
    assert b.stop() == 0
    b = broker_factory()
    await check()


@bounded(60)
async def test_admin_delete_group_removes_its_retry_and_dead_letter_topics(broker):
    b = broker
    for topic in ("%RETRY%CG_old", "%DLQ%CG_old", "%RETRY%CG_new"):
        await _create(b, topic, 1)
    await _request(b, R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "CG_old", "topic": "%RETRY%CG_old", "queueId": 0,
                                                 "commitOffset": 0})
    done = await _admin_json(b, "delete-group", "CG_old")
    assert done == {"group": "CG_old", "offsets_removed": True, "topics_deleted": ["%RETRY%CG_old", "%DLQ%CG_old"]}
    for topic, code in (("%RETRY%CG_old", ResponseCode.TOPIC_NOT_EXIST), ("%DLQ%CG_old", ResponseCode.TOPIC_NOT_EXIST),
                        ("%RETRY%CG_new", ResponseCode.SUCCESS)):
        assert (await _request(b, R.GET_TOPIC_STATS_INFO, {"topic": topic})).code == code
    listed, _ = await _groups_known(b, "%RETRY%CG_old")
    assert "CG_old" not in listed



@bounded(60)
async def test_admin_delete_group_refuses_a_group_with_connected_consumers(broker):
    """delete-group removes the group's %RETRY% and %DLQ% topics: with consumers still connected, their retries
    waiting there went. Refused unless --force; forced, the consumers' next heartbeat makes the retry topic
    again (as RocketMQ's heartBeat does: made only on a group's first heartbeat, it stayed gone)."""
    b = broker
    for topic in ("%RETRY%CG_live", "%DLQ%CG_live"):
        await _create(b, topic, 1)
    host, _, port = b.broker.rpartition(":")
    live = await open_connection(host, int(port))
    try:
        body = {"clientID": "10.0.0.9@live", "consumerDataSet": [{
            "groupName": "CG_live", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
            "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET",
            "subscriptionDataSet": [{"topic": "%RETRY%CG_live", "subString": "*", "subVersion": 1}]}]}
        beat = await live.request(RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()), 5.0)
        assert beat.code == ResponseCode.SUCCESS
        refused = await asyncio.to_thread(_admin, b, "delete-group", "CG_live")
        assert refused.returncode == 1 and "10.0.0.9@live" in refused.stderr, refused.stderr + refused.stdout
        for topic in ("%RETRY%CG_live", "%DLQ%CG_live"):
            assert (await _request(b, R.GET_TOPIC_STATS_INFO, {"topic": topic})).code == ResponseCode.SUCCESS
        done = await _admin_json(b, "delete-group", "CG_live", "--force")
        assert done["topics_deleted"] == ["%RETRY%CG_live", "%DLQ%CG_live"]
        assert (await _request(b, R.GET_TOPIC_STATS_INFO, {"topic": "%RETRY%CG_live"})).code \
            == ResponseCode.TOPIC_NOT_EXIST
        beat = await live.request(RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()), 5.0)
        assert beat.code == ResponseCode.SUCCESS
        assert (await _request(b, R.GET_TOPIC_STATS_INFO, {"topic": "%RETRY%CG_live"})).code == ResponseCode.SUCCESS
        assert (await _request(b, R.GET_TOPIC_STATS_INFO, {"topic": "%DLQ%CG_live"})).code \
            == ResponseCode.TOPIC_NOT_EXIST                    # made by the first dead letter, as before
    finally:
        live.close()


async def test_runtime_info_earliest_time_is_the_commit_logs_first_message(broker_factory):
    """earliestMessageTimeStamp is the store time of the commit log's first record (RocketMQ's
    getEarliestMessageTime reads that one record). The broker read the head of every queue instead (60-80 ms on
    the loop with 4,000 queues), which also missed a first message whose topic was deleted since."""
    b = broker_factory()
    async with Producer(b.namesrv, "PG_earliest") as producer:
        sent = await producer.send("Early", b"first")
    async with PullConsumer(b.namesrv, "CG_earliest") as consumer:
        await consumer.fetch_queues("Early")
        [first] = (await consumer.pull(sent.queue, sent.queue_offset, max_nums=1)).messages
    assert (await _request(b, R.DELETE_TOPIC_IN_BROKER, {"topic": "Early"})).code == ResponseCode.SUCCESS
    info = await _request(b, R.GET_BROKER_RUNTIME_INFO)
    table = json.loads(info.body_bytes())["table"]
    assert table["commitLogMinOffset"] == "0" and sent.offset_msg_id.endswith("0" * 16)    # the log's first
    assert table["earliestMessageTimeStamp"] == str(first.store_timestamp)


async def _snapshot_lag(folder, group: str, topic: str) -> int:
    """The lag of ``group`` in ``topic`` (summed over its queues; 0 when it has no row) in the second metric
    snapshot written from now (the first may have summed its rows before)."""
    after = int(time.time() * 1000)

    def later():        # whole lines only: one may be being appended
        lines = [line for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().split("\n")[:-1]]
        return [s for s in map(json.loads, lines) if s["ts"] > after]
    async with asyncio.timeout(10):
        while len(snaps := later()) < 2:
            await asyncio.sleep(0.1)
    return sum(r["lag"] for r in snaps[1]["consumer_lag"] if (r["group"], r["topic"]) == (group, topic))


@bounded(60)
async def test_a_topic_an_online_group_no_longer_subscribes_has_no_lag_series_as_in_its_progress(broker_factory,
                                                                                                 tmp_path):
    """A group moved from one topic to another (its consumers now subscribe only to the new one) keeps its offsets
    in the old: GET_CONSUME_STATS (consumer-progress) leaves the old topic out while the group is online, as
    RocketMQ's getConsumeStats does, but rocketmq_consumer_lag_messages went on counting it, growing with every
    message other groups' producers sent there: a lag alert that fired for good on a topic the group does not
    read. The series follows the progress now, and so do the metric snapshots the Spark rollups and report read
    (they went on counting it); once the group has nobody online, all count every topic again."""
    b = broker_factory("--metrics-snapshot-interval-s", "0.2")
    folder = tmp_path / "store" / "metrics"
    for topic in ("Left", "Joined"):
        await _create(b, topic, 1)
    async with Producer(b.namesrv, "PG_moved") as producer:
        await producer.send("Left", b"read")
        consumer = PullConsumer(b.namesrv, "CG_moved")
        async with consumer:
            mq = (await consumer.fetch_queues("Left"))[0]
            await consumer.subscribe("Left")
            await consumer.commit_offset(mq, len((await consumer.pull(mq, 0)).messages))
            await consumer.fetch_queues("Joined")
            consumer.subscriptions = {"Joined": "*"}        # the group's consumers now read only Joined
            await consumer.heartbeat()
            for i in range(5):
                await producer.send("Left", b"not for it %d" % i, queue=MessageQueue("Left", mq.broker_name, 0))
            stats = decode_mq_table((await _request(b, R.GET_CONSUME_STATS, {"consumerGroup": "CG_moved"}))
                                    .body_bytes())[1]
            assert "Left" not in {t for t, _, _ in stats}, stats
            series = await asyncio.to_thread(_group_series, b, "CG_moved")
            lag_left = ("rocketmq_consumer_lag_messages", (("consumer_group", "CG_moved"), ("topic", "Left")))
            assert lag_left not in series, series
            assert await _snapshot_lag(folder, "CG_moved", "Left") == 0
        async with asyncio.timeout(20):     # its connection closed: the group is offline, every topic counts
            while lag_left not in (series := await asyncio.to_thread(_group_series, b, "CG_moved")):
                await asyncio.sleep(0.1)
        assert series[lag_left] == 5
        assert await _snapshot_lag(folder, "CG_moved", "Left") == 5


@bounded(60)
async def test_the_retries_a_subscribed_pull_consumer_reads_have_a_lag_series_and_progress(broker_factory):
    """A pull consumer subscribing to its topic and reading its own retries (it pulls %RETRY%<group>, as a
    DefaultMQPullConsumer user does: neither it nor a DefaultLitePullConsumer names the retry topic in its
    heartbeat) commits offsets there. Its heartbeat names only the topic, so consumer-progress and
    rocketmq_consumer_lag_messages left the retry topic out as one the group does not read: retries piling up
    unread showed no lag and no alert. The group's own retry topic counts now whatever its members name."""
    b = broker_factory()
    retry = "%RETRY%CG_own_retries"
    async with Producer(b.namesrv, "PG_own_retries") as producer, PullConsumer(b.namesrv, "CG_own_retries") as c:
        for i in range(3):
            await producer.send("Failing", b"fails %d" % i)
        await c.subscribe("Failing")
        pulled = []
        for mq in await c.fetch_queues("Failing"):
            msgs = (await c.pull(mq, 0)).messages
            pulled += [(mq, m) for m in msgs]
            await c.commit_offset(mq, len(msgs))
        for mq, m in pulled:
            await c.send_back(mq, m, delay_level=1)
        [rq] = await c.fetch_queues(retry)
        async with asyncio.timeout(20):     # each back from its 1 s delay
            while await c.max_offset(rq) < 3:
                await asyncio.sleep(0.1)
        assert len((await c.pull(rq, 0, max_nums=1)).messages) == 1
        await c.commit_offset(rq, 1)        # one retry read, two waiting
        await c.heartbeat()
        stats = decode_mq_table((await _request(b, R.GET_CONSUME_STATS, {"consumerGroup": "CG_own_retries"}))
                                .body_bytes())[1]
        lag = {}
        for (topic, _, _), row in stats.items():
            lag[topic] = lag.get(topic, 0) + row["brokerOffset"] - row["consumerOffset"]
        assert lag == {"Failing": 0, retry: 2}, stats
        series = await asyncio.to_thread(_group_series, b, "CG_own_retries")
        lag_retry = ("rocketmq_consumer_lag_messages", (("consumer_group", "CG_own_retries"), ("topic", retry)))
        assert series[lag_retry] == 2, series
        # The group turned BROADCASTING: its consumers never read the retry topic again (a stock one drops what
        # it fails), so the two left there are no backlog of it; counted, they were a lag alert that never cleared.
        await c.heartbeat(message_model="BROADCASTING")
        stats = decode_mq_table((await _request(b, R.GET_CONSUME_STATS, {"consumerGroup": "CG_own_retries"}))
                                .body_bytes())[1]
        assert {topic for topic, _, _ in stats} == {"Failing"}, stats
        assert lag_retry not in await asyncio.to_thread(_group_series, b, "CG_own_retries")
        # Mid-switch (a rolling restart back to CLUSTERING): one member still reads the retries. They count
        # whichever member's heartbeat came last, not only when it was the CLUSTERING one's.
        async with PullConsumer(b.namesrv, "CG_own_retries") as clustering:
            await clustering.subscribe("Failing")
            await clustering.fetch_queues("Failing")
            await clustering.heartbeat()
            await c.heartbeat(message_model="BROADCASTING")
            stats = decode_mq_table((await _request(b, R.GET_CONSUME_STATS, {"consumerGroup": "CG_own_retries"}))
                                    .body_bytes())[1]
            assert {topic for topic, _, _ in stats} == {"Failing", retry}, stats
            assert (await asyncio.to_thread(_group_series, b, "CG_own_retries"))[lag_retry] == 2


@bounded(60)
async def test_a_pull_consumers_own_commits_are_not_taken_for_an_admins_moves(broker_factory):
    """A PullConsumer that pulls with its subscription in each pull sends no heartbeat (subscribe() is needed
    only for pulls without one): it is the group's consumer all the same, on the connection it pulls on. Its
    commits of what it pulled were taken for an admin tool's moves: each one forward waited for a save of the
    whole offsets table (100,000 offsets: 1.0-1.5 s, one save after another while it commits) and
    was said at WARNING as "no consumer of the group (an admin tool ...)". Only a move by a connection that
    neither heartbeated nor pulled for the group waits, and a consumer's first offset of a queue (once)."""
    b = broker_factory("--flush-consumer-offset-interval-ms", "600000")    # no periodic save within the test
    await _create(b, "OwnPulls", 1)
    mq = MessageQueue("OwnPulls", "broker-a", 0)
    async with Producer(b.namesrv, "PG_own_pulls") as producer:
        for i in range(4):
            await producer.send("OwnPulls", b"p%d" % i, queue=mq)
    async with PullConsumer(b.namesrv, "CG_own_pulls") as consumer:
        await consumer.fetch_queues("OwnPulls")
        offset = 0
        for _ in range(2):
            got = await consumer.pull(mq, offset, max_nums=2)
            assert len(got.messages) == 2
            offset = got.next_begin_offset
            await consumer.commit_offset(mq, offset)
        assert await consumer.fetch_offset(mq) == 4
    # the group's first offset of the queue is on disk before its answer (a kill -9 left the group none); the next not
    assert _on_disk(b, "CG_own_pulls", "OwnPulls") == {0: 2}, "a pull consumer's later commit waited for a save"
    assert "CG_own_pulls" not in b.log(), "a pull consumer's commit was said as an admin's move"


@bounded(90)
async def test_a_query_behind_thousands_of_a_colliding_key_stops_and_says_so(broker):
    """"Aa" and "BB" share String.hashCode. A query for "Aa" behind 50,000 messages of "BB" read every one of them
    on the index thread: 0.8-1.4 s per query, nothing indexed meanwhile, the broker's other clients 3x slower at
    p99 (bench/bench_index_collisions.py). Now it reads 4,096 records of the hash at most, answers NOT FOUND
    saying the search stopped, and counts it; a query that finds its key within the bound says nothing."""
    b = broker
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))

    def send(key):
        return conn.request(RemotingCommand.request(R.SEND_MESSAGE, {
            "producerGroup": "PG_collide", "topic": "Collide", "defaultTopic": "TBW102", "defaultTopicQueueNums": 4,
            "queueId": 0, "sysFlag": 0, "bornTimestamp": 0, "flag": 0, "properties": f"KEYS\x01{key}\x02"}, b"m"),
            10.0)
    try:
        assert (await send("Aa")).code == ResponseCode.SUCCESS
        for _ in range(4100 // 50):
            assert {r.code for r in await asyncio.gather(*(send("BB") for _ in range(50)))} == {ResponseCode.SUCCESS}
    finally:
        conn.close()
    query = {"topic": "Collide", "maxNum": 32, "beginTimestamp": 0, "endTimestamp": 2**63 - 1}
    bb = await _request(b, R.QUERY_MESSAGE, {**query, "key": "BB"})    # a query sees every acknowledged send
    assert bb.code == ResponseCode.SUCCESS and bb.remark is None and len(decode_records(bb.body_bytes())) == 32
    aa = await _request(b, R.QUERY_MESSAGE, {**query, "key": "Aa"})
    assert aa.code == ResponseCode.QUERY_NOT_FOUND and "search stopped after 4096 records" in aa.remark, aa.remark
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read())
    assert b"txmq_index_queries_cut_total 1.0" in text
    # The admin CLI said "0 message(s)" and dropped the remark: an operator was told the key is not there.
    by_key = await asyncio.to_thread(_admin, b, "query-key", "Collide", "Aa")
    assert by_key.returncode == 1 and "0 message(s)" in by_key.stdout
    assert "search stopped after 4096 records" in by_key.stderr, by_key.stderr
    as_json = await asyncio.to_thread(_admin, b, "query-key", "Collide", "BB", "--max", "4200", "--json")
    assert len(json.loads(as_json.stdout)) == 64 and "search stopped" not in as_json.stderr
    by_id = await asyncio.to_thread(_admin, b, "show-msg", "Aa", "--topic", "Collide")
    assert by_id.returncode == 1 and "search stopped after 4096 records" in by_id.stderr, by_id.stderr


@bounded(60)
async def test_a_consumers_first_offsets_are_not_counted_as_an_admins_deferred_moves(broker_factory):
    """A consumer's first offset of a queue is on disk before its answer (once on the saver's pace: its rest after
    the last save, as an admin tool's moves). Waiting that rest, it was counted in txmq_offset_moves_deferred_total,
    whose help names moves by a client that is no consumer of the group: a pull consumer committing its 8 queues
    one after another made it 7, as if a tool had moved them. It stays 0 (admin moves: test_hostile_caps)."""
    b = broker_factory("--flush-consumer-offset-interval-ms", "600000")    # no periodic save within the test
    await _create(b, "FirstOwn", 8)
    async with PullConsumer(b.namesrv, "CG_first_own") as consumer:
        queues = [MessageQueue("FirstOwn", "broker-a", q) for q in range(8)]
        await consumer.pull(queues[0], 0)                  # the group's consumer on this connection
        for mq in queues:
            await consumer.commit_offset(mq, 0)     # one after another
    assert _on_disk(b, "CG_first_own", "FirstOwn") == {q: 0 for q in range(8)}
    deferred = _scraped(b, "txmq_offset_moves_deferred_total")
    assert deferred == 0, f"{deferred:g} of a consumer's own first commits counted as an admin's deferred moves"


def _on_disk(b, group: str, topic: str) -> dict[int, int]:
    """``group``'s offsets on ``topic`` as a start of the broker would read them from its store now (the table file
    and the first offsets' journal)."""
    from broker.store import ConsumerOffsets
    return ConsumerOffsets(str(b.store_dir)).of(group, topic)


@bounded(90)
async def test_a_pull_consumers_first_commits_over_many_queues_are_no_table_save_each(broker_factory, tmp_path):
    """A pull consumer committing its first offsets of new queues one after another (each answered, so on disk
    before SUCCESS) paid a paced save of the whole offsets table for each: 106 ms a commit at 10,000 offsets, 1.2 s
    at 100,000 (64 queues: 77 s, a commit loop falling behind unsaid; one past the client's 3 s timeout). Each is a
    line of the first offsets' journal now (4 ms at either size): the table file is not written again, and every
    first offset survives a kill -9 before any save of it."""
    flags = ("--flush-consumer-offset-interval-ms", "600000")      # no periodic save within the test
    table = tmp_path / "store" / "config" / "consumerOffset.json"
    table.parent.mkdir(parents=True)
    table.write_text(json.dumps({f"Other@G{g}": {str(q): 0 for q in range(100)} for g in range(100)}))  # 10,000
    b = broker_factory(*flags)
    await _create(b, "ManyNew", 32)
    queues = [MessageQueue("ManyNew", "broker-a", q) for q in range(32)]
    async with Producer(b.namesrv, "PG_many_new") as producer:
        for mq in queues:                       # one each: a stored 1 reads back as 1, never as a young queue's 0
            await producer.send("ManyNew", b"m", queue=mq)
    before = table.stat().st_ino
    async with PullConsumer(b.namesrv, "CG_many_new") as consumer:
        await consumer.pull(queues[0], 0)                  # the group's consumer on this connection
        for mq in queues:
            await consumer.commit_offset(mq, 1)
    assert table.stat().st_ino == before, "a consumer's first offset of a queue was a save of the whole table"
    b.kill()
    b = broker_factory(*flags)
    stored = [await _request(b, R.QUERY_CONSUMER_OFFSET, {"consumerGroup": "CG_many_new", "topic": "ManyNew",
                                                          "queueId": q}) for q in range(32)]
    assert [(r.code, r.int_field("offset")) for r in stored] == [(ResponseCode.SUCCESS, 1)] * 32
    assert _on_disk(b, "G7", "Other") == {q: 0 for q in range(100)}


@bounded(60)
async def test_deleting_groups_that_hold_nothing_in_a_loop_is_not_a_log_line_each(broker_factory):
    """Every DELETE_SUBSCRIPTIONGROUP was a WARNING line, whatever it removed: a clean-up of 1,000 groups was 1,000
    WARNING lines, and any client looping over made-up names (answered SUCCESS, nothing removed) wrote the log
    without bound. A delete that removes something is said at INFO, as RocketMQ's and as an update; one that finds
    nothing at most every 10 s, as a WARNING naming it."""
    b = broker_factory()
    resp = await _request(b, R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=json.dumps({"groupName": "CG_real"}).encode())
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    for i in range(40):
        resp = await _request(b, R.DELETE_SUBSCRIPTIONGROUP, {"groupName": f"CG_nothing{i}", "removeOffset": "true"})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
    resp = await _request(b, R.DELETE_SUBSCRIPTIONGROUP, {"groupName": "CG_real", "removeOffset": "true"})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert b.stop() == 0        # (the log flushed)
    lines = b.log_path.read_text(errors="replace").splitlines()
    nothing = [line for line in lines if "CG_nothing" in line]
    assert len(nothing) == 1 and "WARNING" in nothing[0] and "nothing removed" in nothing[0]
    real = [line for line in lines if "subscription group CG_real deleted" in line]
    assert len(real) == 1 and "INFO" in real[0]
