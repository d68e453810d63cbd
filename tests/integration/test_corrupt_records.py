"""Records whose body went bad on disk, in segments older than the start-up scan verifies.

Between two runs of a real broker one byte of a stored body is flipped (its BODYCRC no longer matches),
in the first of several segments, so start-up does not see it. Every read of that record must notice:
a pull stops at it with an error naming it (never the flipped bytes handed out as the message), a
lookup by id or key refuses it, and nothing copies it elsewhere -- a COMMIT of its half, a scheduled
delivery -- where it would be re-encoded under a fresh, valid CRC and pass for sound. Each is counted
(txmq_store_corrupt_records_total) and logged with its segment and byte.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request

import pytest

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from consumer.pull_consumer import MessageQueue
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import BrokerError
from protocol.message import MESSAGE_MAGIC, decode_offset_msg_id, decode_record, store_timestamp_pos
from tests.support.broker_process import NO_CHECKS, REPO
from tests.support.faketime import LIBFAKETIME, SKIP_REASON, past_env

pytestmark = pytest.mark.asyncio

SEG = 256 * 1024
FLAGS = ("--segment-size", str(SEG), "--max-message-size", str(16 * 1024))
FILLER = 600        # about five segments of 2 KiB records: the first is older than start-up verifies


async def _fill(b, topic: str = "Filler") -> None:
    async with Producer(b.namesrv, "PG_filler") as producer:
        for _ in range(FILLER // 7):        # a batch stays under --max-message-size
            await producer.send_batch(topic, [bytes(2000)] * 7)


def _open_record(store_dir, phys: int):
    """(the segment holding the record at ``phys``, opened for update; the record decoded)"""
    f = open(os.path.join(store_dir, "commitlog", f"{phys - phys % SEG:020d}"), "r+b")
    f.seek(phys % SEG)
    head = f.read(4)
    f.seek(phys % SEG)
    return f, decode_record(f.read(int.from_bytes(head, "big")))[0]


def _flip_body(store_dir, phys: int, at: int = 0, bit: int = 0x01) -> bytes:
    """Flip ``bit`` of byte ``at`` of the body of the record at ``phys``; returns the body as it was."""
    f, msg = _open_record(store_dir, phys)
    with f:
        where = phys % SEG + 88 + at     # IPv4 hosts: the body starts at byte 88 of the record
        f.seek(where)
        old = f.read(1)
        assert old == msg.body[at:at + 1]
        f.seek(where)
        f.write(bytes([old[0] ^ bit]))
    assert len(os.listdir(os.path.join(store_dir, "commitlog"))) >= 5
    return msg.body


async def _request(addr: str, code: int, fields: dict) -> RemotingCommand:
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        return await conn.request(RemotingCommand.request(code, fields), 5.0)
    finally:
        conn.close()


def _corrupt_count(b, read: str) -> float:
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f'txmq_store_corrupt_records_total{{read="{read}"}}'):
            return float(line.split()[-1])
    return 0.0


async def _pull_all(b, mq: MessageQueue, limit: int = 100, group: str = "CG_corrupt") -> tuple[list[bytes], str | None]:
    """Bodies pulled from offset 0 until the end or an error; the error's text, if any."""
    consumer = PullConsumer(b.namesrv, group)
    await consumer.fetch_queues(mq.topic)
    bodies, offset = [], 0
    try:
        for _ in range(limit):
            try:
                res = await consumer.pull(mq, offset, max_nums=32)
            except BrokerError as exc:
                return bodies, str(exc)
            bodies += [m.body for m in res.messages]
            if res.next_begin_offset >= res.max_offset:
                return bodies, None
            offset = res.next_begin_offset
    finally:
        await consumer.shutdown()
    raise AssertionError("the queue did not end within the bound")


async def test_a_corrupt_body_is_not_pulled_viewed_or_found_by_key(broker_factory, tmp_path):
    b = broker_factory(*FLAGS)
    async with Producer(b.namesrv, "PG_corrupt") as producer:
        await producer.send("Corrupt", b"seed")
        mq = (await producer.routes.publish_queues("Corrupt"))[0]
        before = [await producer.send("Corrupt", b"before-%d" % i, queue=mq) for i in range(3)]
        victim = await producer.send("Corrupt", b"victim-body", keys="K-victim", queue=mq)
        after = [await producer.send("Corrupt", b"after-%d" % i, queue=mq) for i in range(3)]
    await _fill(b)
    assert b.stop() == 0
    phys = decode_offset_msg_id(victim.offset_msg_id)[2]
    _flip_body(tmp_path / "store", phys)

    b = broker_factory(*FLAGS)
    mq = MessageQueue("Corrupt", mq.broker_name, mq.queue_id)
    got, error = await _pull_all(b, mq)
    got = [g for g in got if g != b"seed"]             # (the seed may have gone to this queue)
    assert got == [b"before-%d" % i for i in range(len(before))], got   # up to it, never its flipped bytes
    assert error is not None and "corrupt" in error and f"offset {victim.queue_offset}" in error, error
    assert len(after) == 3

    view = await _request(b.broker, RequestCode.VIEW_MESSAGE_BY_ID, {"offset": phys})
    assert view.code == ResponseCode.SYSTEM_ERROR and "corrupt" in (view.remark or ""), view.remark
    found = await _request(b.broker, RequestCode.QUERY_MESSAGE, {"topic": "Corrupt", "key": "K-victim",
                                                                  "maxNum": 32, "beginTimestamp": 0,
                                                                  "endTimestamp": 2**62})
    assert found.code == ResponseCode.SYSTEM_ERROR and "corrupt" in (found.remark or ""), found.remark
    back = await _request(b.broker, RequestCode.CONSUMER_SEND_MSG_BACK, {"offset": phys, "group": "CG_corrupt",
                                                                          "delayLevel": 0,
                                                                          "originMsgId": victim.msg_id,
                                                                          "originTopic": "Corrupt"})
    assert back.code == ResponseCode.SYSTEM_ERROR and "corrupt" in (back.remark or ""), back.remark
    direct = await _request(b.broker, RequestCode.CONSUME_MESSAGE_DIRECTLY, {     # (mqadmin queryMsgById -d)
        "consumerGroup": "CG_direct", "clientId": "10.0.0.1@1", "msgId": victim.offset_msg_id})
    assert direct.code == ResponseCode.SYSTEM_ERROR and "corrupt" in (direct.remark or ""), direct.remark
    for read in ("pull", "view by id", "query", "send back"):
        assert await asyncio.to_thread(_corrupt_count, b, read) == 1, read
    assert b.stop() == 0
    segment = f"{phys - phys % SEG:020d}"
    assert f"segment {segment} at byte {phys % SEG}" in b.log()


async def test_a_half_whose_body_went_bad_is_not_committed(broker_factory, tmp_path):
    """COMMIT copies the half's bytes to the real topic under a CRC the store recomputes nowhere: the flipped
    byte was delivered as the producer's message. It is refused now, and the transaction stays undecided."""
    # No check before the END: one would find the half corrupt and dead-letter it (the next test's subject),
    # and the END then met "already DEAD". The default immunity (6 s) was shorter than filling, stopping
    # and restarting take on a loaded machine.
    flags = (*FLAGS, "--transaction-timeout-ms", "600000")
    b = broker_factory(*flags)
    listener_states = {"execute": S.UNKNOW, "check": S.UNKNOW}

    class Listener:
        def execute_local_transaction(self, msg, arg):
            return listener_states["execute"]

        async def check_local_transaction(self, msg):
            return listener_states["check"]

    async with TransactionProducer(b.namesrv, "PG_corrupt_tx", Listener()) as producer:
        sent = await producer.send_in_transaction("TxCorrupt", b"pay 100 to alice")
    await _fill(b)
    assert b.stop() == 0
    half = decode_offset_msg_id(sent.send_result.offset_msg_id)[2]
    assert _flip_body(tmp_path / "store", half) == b"pay 100 to alice"

    b = broker_factory(*flags)
    async with TransactionProducer(b.namesrv, "PG_corrupt_tx", Listener()) as producer:
        with pytest.raises(BrokerError, match="corrupt"):
            await producer._end(b.broker, half, sent.send_result.queue_offset, sent.send_result.msg_id,
                                S.COMMIT_MESSAGE, False, None)
    consumer = PullConsumer(b.namesrv, "CG_corrupt_tx")
    try:
        for mq in await consumer.fetch_queues("TxCorrupt"):
            res = await consumer.pull(mq, 0)
            assert res.messages == [], [m.body for m in res.messages]
    finally:
        await consumer.shutdown()
    assert await asyncio.to_thread(_corrupt_count, b, "commit") == 1
    assert b.stop() == 0


async def test_a_scheduled_message_whose_body_went_bad_is_not_delivered(broker_factory, tmp_path):
    """The scheduler re-encodes a due message for its real topic: a flipped byte in its stored body went out
    under a fresh, valid CRC. It is passed over now (counted as dropped: corrupt), the record left in place."""
    # The messages must not fall due before the damage: filling and stopping take 1-6 s on a loaded machine
    # (measured), so a store whose filler ran too long is set aside and the next waits longer. A fast machine
    # makes one attempt.
    for wait_s in (8, 20, 60):
        store = f"store-{wait_s}"
        b = broker_factory(*FLAGS, store=store)
        due = int(time.time() * 1000) + wait_s * 1000
        async with Producer(b.namesrv, "PG_corrupt_delay") as producer:
            sent = await producer.send("DelayCorrupt", b"delayed-body", deliver_at_ms=due)
            on_time = await producer.send("DelayCorrupt", b"sound-body", deliver_at_ms=due)
        await _fill(b)
        assert b.stop() == 0
        if time.time() * 1000 < due - 1000:
            break
    else:
        pytest.fail("the filler took too long three times: the messages were due before the damage")
    _flip_body(tmp_path / store, decode_offset_msg_id(sent.offset_msg_id)[2])
    assert on_time.offset_msg_id

    b = broker_factory(*FLAGS, store=store)
    consumer = PullConsumer(b.namesrv, "CG_corrupt_delay")
    bodies: list[bytes] = []
    try:
        queues = await consumer.fetch_queues("DelayCorrupt")
        offsets = {mq: 0 for mq in queues}
        async with asyncio.timeout(wait_s + 30):
            while b"sound-body" not in bodies:          # the sound one is delivered when due; then both were seen
                for mq in queues:
                    res = await consumer.pull(mq, offsets[mq], suspend_ms=500)
                    offsets[mq] = res.next_begin_offset
                    bodies += [m.body for m in res.messages]
    finally:
        await consumer.shutdown()
    assert bodies == [b"sound-body"], bodies
    assert await asyncio.to_thread(_corrupt_count, b, "scheduled delivery") == 1
    assert b.stop() == 0


class _Unknown:
    """A transaction listener that never decides."""

    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    async def check_local_transaction(self, msg):
        return S.UNKNOW


async def _pending(b) -> int:
    resp = await _request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {})
    return json.loads(resp.body_bytes())["total"]


async def _restarted_with_a_bad_half(broker_factory, tmp_path, group: str, topic: str, body: bytes, check_max: int):
    """A broker restarted on a store whose one undecided half (of ``group``, never checked: NO_CHECKS)
    had a bit of its body flipped while it was down, its checks now due at once, every 30 ms."""
    b = broker_factory(*FLAGS, *NO_CHECKS)
    async with TransactionProducer(b.namesrv, group, _Unknown()) as producer:
        sent = await producer.send_in_transaction(topic, body)
    await _fill(b)
    assert b.stop() == 0
    _flip_body(tmp_path / "store", decode_offset_msg_id(sent.send_result.offset_msg_id)[2])
    return broker_factory(*FLAGS, "--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0",
                          "--transaction-check-max", str(check_max))


async def test_a_half_whose_body_went_bad_is_dead_lettered_without_its_copy(broker_factory, tmp_path):
    """The dead letter re-encoded the half's body into TRANS_CHECK_MAX_TIME_TOPIC under a fresh CRC: the
    flipped byte became a sound-looking message there. The transaction is still dead-lettered (the op record
    says so, and why), but nothing is copied; the damaged half stays where it is."""
    b = await _restarted_with_a_bad_half(broker_factory, tmp_path, "PG_corrupt_dead", "TxCorruptDead",
                                         b"never decided", check_max=2)
    async with TransactionProducer(b.namesrv, "PG_corrupt_dead", _Unknown()):
        async with asyncio.timeout(30):
            while await _pending(b):                    # dead-lettered, never checked (its body is bad)
                await asyncio.sleep(0.05)
    assert await asyncio.to_thread(_corrupt_count, b, "dead letter") == 1
    consumer = PullConsumer(b.namesrv, "CG_corrupt_dead")
    try:
        try:
            queues = await consumer.fetch_queues("TRANS_CHECK_MAX_TIME_TOPIC")
        except BrokerError:                             # never made: nothing was ever dead-lettered by copy
            queues = []
        for mq in queues:
            assert (await consumer.pull(mq, 0)).messages == []
    finally:
        await consumer.shutdown()
    assert b.stop() == 0
    assert "dead letter: the record at commit-log offset" in b.log()


def _dead_letters(b, reason: str) -> float:
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("txmq_transaction_dead_letters_total{") and f'reason="{reason}"' in line)


async def test_a_half_whose_body_went_bad_is_not_sent_in_a_check(broker_factory, tmp_path):
    """A check carries the half's body to the producer, which decides on it (a stock listener reads the body):
    the flipped byte went out as the message the producer sent. No check is sent now, none is spent: the
    transaction is dead-lettered at once with its reason."""
    b = await _restarted_with_a_bad_half(broker_factory, tmp_path, "PG_corrupt_check", "TxCorruptCheck",
                                         b"pay 100 to alice", check_max=15)
    checked = []

    class Listener(_Unknown):
        async def check_local_transaction(self, msg):
            checked.append(msg.body)
            return S.COMMIT_MESSAGE
    async with TransactionProducer(b.namesrv, "PG_corrupt_check", Listener()):
        async with asyncio.timeout(30):
            while await _pending(b) and not checked:
                await asyncio.sleep(0.05)
    assert checked == []
    assert await asyncio.to_thread(_corrupt_count, b, "transaction check") == 1
    assert await asyncio.to_thread(_dead_letters, b, "corrupt-half") == 1
    assert b.stop() == 0
    assert "not checked: its half is corrupt; dead-lettering it" in b.log()

def _op_records(store_dir, topic: str = "RMQ_SYS_TRANS_OP_HALF_TOPIC") -> list[tuple[int, bytes]]:
    """(offset, body) of the op records (or those of another topic) in the first segment."""
    with open(os.path.join(store_dir, "commitlog", f"{0:020d}"), "rb") as f:
        data = f.read(SEG)
    out, pos = [], 0
    while int.from_bytes(data[pos + 4:pos + 8], "big", signed=True) == MESSAGE_MAGIC:
        msg, size = decode_record(data, pos)
        if msg.topic == topic:
            out.append((pos, msg.body))
        pos += size
    return out


@pytest.mark.parametrize("committed", [0, 1])
async def test_an_op_record_whose_body_went_bad_decides_its_own_transaction(broker_factory, tmp_path, committed):
    """An op record's body is the half's queue offset. Rebuilt from the log (no snapshot), a COMMIT op whose
    digit was flipped decided the other transaction: never checked again, its message never reached its topic.
    Passed over instead, the committed one was pending again when an older one was undecided (the half queue's
    progress before it): its producer's COMMIT answer to the next check committed it twice. The op's TXMQ_HALF
    property (outside the body) still names its half, whose own record gives the queue offset."""
    b = broker_factory(*FLAGS, *NO_CHECKS)

    class CommitOne(_Unknown):
        calls = 0

        def execute_local_transaction(self, msg, arg):
            CommitOne.calls += 1
            return S.COMMIT_MESSAGE if CommitOne.calls == committed + 1 else S.UNKNOW

    async with TransactionProducer(b.namesrv, f"PG_corrupt_op{committed}", CommitOne()) as producer:
        sent = [await producer.send_in_transaction("TxCorruptOp", b"tx-%d" % i) for i in range(2)]
    assert [s.send_result.queue_offset for s in sent] == [0, 1]
    await _fill(b)
    assert b.stop() == 0
    [(pos, body)] = _op_records(tmp_path / "store")
    assert body == b"%d" % committed
    _flip_body(tmp_path / "store", pos)                  # "0" <-> "1": the other transaction's queue offset
    os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")    # lost: rebuilt from the op records

    b = broker_factory(*FLAGS, *NO_CHECKS)
    resp = await _request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {})
    pending = {row["commit_log_offset"] for row in json.loads(resp.body_bytes())["pending"]}
    undecided = decode_offset_msg_id(sent[1 - committed].send_result.offset_msg_id)[2]
    assert pending == {undecided}, pending               # still checked; the committed one is not, nor twice
    assert await asyncio.to_thread(_corrupt_count, b, "transaction recovery (RMQ_SYS_TRANS_OP_HALF_TOPIC)") == 1
    assert b.stop() == 0


async def test_a_master_does_not_replicate_a_corrupt_record(broker_factory, tmp_path):
    """A new slave copies the master's old segments: the corrupt record reached it, which refused the chunk with
    a WARNING on its side and reconnected for ever, the master saying nothing of its own damaged disk. The
    master sends what lies before the record, then counts and logs it (segment and byte) and sends no more."""
    master_flags = (*FLAGS, "--broker-role", "ASYNC_MASTER", "--ha-port", "0", "--ha-heartbeat-interval-ms", "500")
    b = broker_factory(*master_flags, store="master")
    async with Producer(b.namesrv, "PG_corrupt_ha") as producer:
        await producer.send("CorruptHa", b"before")
        victim = await producer.send("CorruptHa", b"victim-body")
    await _fill(b)
    assert b.stop() == 0
    phys = decode_offset_msg_id(victim.offset_msg_id)[2]
    _flip_body(tmp_path / "master", phys)

    b = broker_factory(*master_flags, store="master")
    slave = broker_factory(*FLAGS, "--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", b.ha,
                           "--ha-heartbeat-interval-ms", "500", store="slave")
    async with asyncio.timeout(30):
        while not await asyncio.to_thread(_corrupt_count, b, "replication"):
            await asyncio.sleep(0.1)
    assert slave.stop() == 0 and b.stop() == 0
    with open(tmp_path / "slave" / "commitlog" / f"{0:020d}", "rb") as f:
        copied = f.read(SEG)
    assert copied[:phys].rstrip(b"\0") and not copied[phys:].strip(b"\0")     # up to it, nothing from it on
    assert f"replication: the record at commit-log offset {phys} is corrupt" in b.log()


async def test_a_consumer_stopped_at_a_corrupt_record_goes_on_with_the_command_its_error_names(broker_factory,
                                                                                             tmp_path, caplog):
    """A pull at a corrupt record answers SYSTEM_ERROR until the group's offset is moved past it. Its remark said
    only "move the group's offset past it", and the one tool for it, reset-offset, moved every queue of the topic
    to a time: the other queues' messages skipped or consumed again. The remark names a command that moves that
    one queue to the next offset; a live push consumer follows it at once."""
    b = broker_factory(*FLAGS)
    resp = await _request(b.broker, RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic": "CorruptGoOn", "readQueueNums": 1,
                                                                           "writeQueueNums": 1, "perm": 6})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    async with Producer(b.namesrv, "PG_corrupt_go_on") as producer:
        for i in range(2):
            await producer.send("CorruptGoOn", b"before-%d" % i)
        victim = await producer.send("CorruptGoOn", b"victim-body")
        for i in range(2):
            await producer.send("CorruptGoOn", b"after-%d" % i)
    await _fill(b)
    assert b.stop() == 0
    _flip_body(tmp_path / "store", decode_offset_msg_id(victim.offset_msg_id)[2])

    b = broker_factory(*FLAGS)
    seen: list[bytes] = []
    got = asyncio.Event()

    def listener(msg):
        seen.append(msg.body)
        got.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(b.namesrv, "CG_corrupt_go_on", listener, consume_from="first",
                            offset_commit_interval_s=0.2, suspend_ms=1000)
    consumer.subscribe("CorruptGoOn")
    await consumer.start()
    try:
        mq = MessageQueue("CorruptGoOn", "broker-a", 0)
        async with asyncio.timeout(30):
            while len(seen) < 2:
                got.clear()
                await got.wait()
            while await consumer.client.fetch_offset(mq) != 2:     # committed: the group exists on the broker
                await asyncio.sleep(0.05)
            # Stopped there for good: said at WARNING (it was INFO, unseen at an application's usual level).
            while not [r for r in caplog.records if r.levelno >= logging.WARNING and "is corrupt" in r.getMessage()]:
                await asyncio.sleep(0.05)
        _, error = await _pull_all(b, mq, group="CG_corrupt_go_on")
        command = re.search(r"python -m broker admin (reset-offset .*)$", error or "")
        assert command, error
        def admin(*args):
            return subprocess.run([sys.executable, "-m", "broker", "admin", "--broker", b.broker, *args],
                                  cwd=REPO, capture_output=True, text=True, timeout=30)

        done = await asyncio.to_thread(admin, "reset-offset", "CG_corrupt_go_on", "CorruptGoOn", "--timestamp", "now",
                                       "--offset", "3")
        assert done.returncode == 2 and "--offset goes with --queue" in done.stdout, done.stdout + done.stderr
        done = await asyncio.to_thread(admin, *shlex.split(command.group(1)))
        assert done.returncode == 0, done.stdout + done.stderr
        async with asyncio.timeout(30):
            while len(seen) < 4:
                got.clear()
                await got.wait()
        assert seen == [b"before-0", b"before-1", b"after-0", b"after-1"], seen
    finally:
        await consumer.shutdown()
    assert b.stop() == 0


@pytest.mark.skipif(LIBFAKETIME is None, reason=SKIP_REASON)
async def test_a_schedule_progress_record_whose_body_went_bad_marks_no_other_timer_delivered(broker_factory,
                                                                                          tmp_path):
    """Replayed from the log (delayOffset.json lost), a progress record's body says which timers went out: a
    flipped digit there ("timers":[0] read as [1]) marked another, undelivered one as delivered, and it never
    was -- lost without a word. A progress record whose body fails its CRC is passed over (counted, logged):
    at worst a delivery is repeated, never dropped."""
    b = broker_factory(*FLAGS)
    consumer = PullConsumer(b.namesrv, "CG_corrupt_progress")
    try:
        async with Producer(b.namesrv, "PG_corrupt_progress") as producer:
            await producer.send("DelayProgress", b"first", deliver_at_ms=int(time.time() * 1000) + 300)
        bodies: list[bytes] = []
        async with asyncio.timeout(30):
            while b"first" not in bodies:          # delivered: its progress record says "timers":[0]
                for q in await consumer.fetch_queues("DelayProgress"):
                    bodies += [m.body for m in (await consumer.pull(q, 0, suspend_ms=200)).messages]
    finally:
        await consumer.shutdown()
    # Due long after the filler (up to 6 s on a loaded machine; a 15 s timer raced it): it must not go out
    # before the damage. The restarted broker's clock runs past it, so it is due at once then.
    due = int(time.time() * 1000) + 10 * 60 * 1000
    async with Producer(b.namesrv, "PG_corrupt_progress") as producer:
        await producer.send("DelayProgress", b"second", deliver_at_ms=due)      # timer 1
    await _fill(b)
    assert b.stop() == 0
    assert time.time() * 1000 < due - 2000, "the filler took too long: the second was due before the damage"
    [(pos, body)] = [(pos, body) for pos, body in _op_records(tmp_path / "store", "rmq_sys_schedule_progress")
                     if b'"timers":[0]' in body]
    _flip_body(tmp_path / "store", pos, body.index(b'"timers":[0]') + 10)      # "0" -> "1"
    os.unlink(tmp_path / "store" / "config" / "delayOffset.json")

    b = broker_factory(*FLAGS, env=past_env("+20m"))
    consumer = PullConsumer(b.namesrv, "CG_corrupt_progress2")
    bodies = []
    try:
        async with asyncio.timeout(30):
            while b"second" not in bodies:
                for q in await consumer.fetch_queues("DelayProgress"):
                    bodies += [m.body for m in (await consumer.pull(q, 0, suspend_ms=500)).messages]
    finally:
        await consumer.shutdown()
    assert await asyncio.to_thread(_corrupt_count, b, "schedule recovery") == 1
    assert b.stop() == 0


def _age_store_timestamp(store_dir, phys: int, bit: int, born: bool = False) -> tuple[int, int]:
    """Clear the lowest set bit from ``bit`` up of the STORETIMESTAMP (``born``: the BORNTIMESTAMP, byte 40) of the
    record at ``phys`` (outside the body CRC: nothing checks it), making it at least 2^bit ms older; (its time
    before, after). Which bits of a time now are set depends on the day (bit 28 turns every 74.6 hours): the
    lowest set one keeps the damage the same on every day the test runs."""
    f, msg = _open_record(store_dir, phys)
    with f:
        at = phys % SEG + (40 if born else store_timestamp_pos(msg.sys_flag))
        f.seek(at)
        before = int.from_bytes(f.read(8), "big")
        while not before >> bit & 1:
            bit += 1
        f.seek(at)
        f.write((before ^ (1 << bit)).to_bytes(8, "big"))
    assert bit < 63
    return before, before ^ (1 << bit)


async def _apply_halves(b, store_dir, halves: list[int]) -> dict:
    """An expiry plan listing ``halves`` as the nightly job lists open halves past its --retention-hours (their
    store timestamps, read from the segments), and no segment: the broker's answer."""
    now = int(time.time() * 1000)
    plan = {"version": 2, "store_id": open(os.path.join(store_dir, "store_id")).read().strip(), "created_ms": now,
            "now_ms": now, "retention_ms": 72 * 3_600_000, "segments": [],
            "halves": [{"commit_log_offset": h} for h in halves]}
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(RequestCode.TXMQ_APPLY_EXPIRY,
                                                          body=json.dumps(plan).encode()), 30.0)
    finally:
        conn.close()
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    return json.loads(resp.body_bytes())


@pytest.mark.parametrize("bit", [40, 28])       # 34.8 years; 74.6 hours or more, past transaction_retention_hours
async def test_a_half_whose_store_time_went_bad_is_not_expired_young(broker_factory, tmp_path, bit):
    """A half's STORETIMESTAMP is outside the body CRC: one bit cleared at rest made a half stored a minute ago
    74.6 h (or 34.8 years) old to the restarted broker's index, and the nightly plan, which lists every open half
    past 72 h by that same field, had it dead-lettered `expired` at once: a transaction its producer was about to
    commit taken out unchecked. Its born time (the producer's clock, another field) is that one bit away: the bit
    is put back, and said at ERROR."""
    b = broker_factory(*FLAGS, *NO_CHECKS)
    async with TransactionProducer(b.namesrv, "PG_stamp", _Unknown()) as producer:
        sent = await producer.send_in_transaction("Stamped", b"stamped-half")
    half = decode_offset_msg_id(sent.send_result.offset_msg_id)[2]
    b.kill()
    before, after = _age_store_timestamp(tmp_path / "store", half, bit)
    assert before - after >= 1 << bit          # one bit cleared: made older

    b = broker_factory(*FLAGS, *NO_CHECKS)
    out = await _apply_halves(b, tmp_path / "store", [half])
    assert out["expired"] == [] and [s["commit_log_offset"] for s in out["skipped"]] == [half], out
    assert await _pending(b) == 1
    assert "have a store timestamp one bit" in b.log() and f"the halves at {half}" in b.log()
    assert _dead_letters(b, "expired") == 0


async def test_a_half_whose_born_time_went_bad_keeps_its_store_time(broker_factory, tmp_path):
    """The BORNTIMESTAMP is as far outside the body CRC as the STORETIMESTAMP, and as likely to flip. Read as the
    store time's bit flipped, a born time's bit 28 cleared had the sound store time of a half sent a minute ago
    "put back" 74.6 h into the past: the plan listing it dead-lettered it `expired` at once, unchecked, where
    before the put-back a damaged born time changed nothing. The half stored before it was stored earlier than
    that put-back value could be: the store time is left as it is."""
    b = broker_factory(*FLAGS, *NO_CHECKS)
    async with TransactionProducer(b.namesrv, "PG_born", _Unknown()) as producer:
        await producer.send_in_transaction("Born", b"first-half")
        sent = await producer.send_in_transaction("Born", b"born-half")
    half = decode_offset_msg_id(sent.send_result.offset_msg_id)[2]
    b.kill()
    before, after = _age_store_timestamp(tmp_path / "store", half, 28, born=True)
    assert before - after >= 1 << 28

    b = broker_factory(*FLAGS, *NO_CHECKS)
    out = await _apply_halves(b, tmp_path / "store", [half])
    assert out["expired"] == [] and [s["commit_log_offset"] for s in out["skipped"]] == [half], out
    assert await _pending(b) == 2
    assert _dead_letters(b, "expired") == 0
    assert "have a store timestamp one bit" not in b.log()


async def test_a_resumed_half_whose_store_time_went_bad_keeps_it_put_back(broker_factory, tmp_path):
    """The start puts a half's flipped store-time bit back in its pending index, but the bytes keep it: a resume
    (903) of the transaction, dead-lettered since (its checks spent), read the store time from the log as it is.
    Resumed, the half was 74.6 h old: the reply said an expiry plan would dead-letter it again, and the nightly
    plan, which lists it by that same field, did, at once and unchecked. A resume reads it as the start does."""
    b = broker_factory(*FLAGS, *NO_CHECKS)
    async with TransactionProducer(b.namesrv, "PG_stamp_resume", _Unknown()) as producer:
        sent = await producer.send_in_transaction("StampedResume", b"stamped-half")
    half = decode_offset_msg_id(sent.send_result.offset_msg_id)[2]
    b.kill()
    before, after = _age_store_timestamp(tmp_path / "store", half, 28)
    assert before - after >= 1 << 28

    b = broker_factory(*FLAGS, "--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0",
                       "--transaction-check-max", "1")
    async with TransactionProducer(b.namesrv, "PG_stamp_resume", _Unknown()):
        async with asyncio.timeout(30):
            while await _pending(b):                    # its one check unanswered: dead-lettered max-checks
                await asyncio.sleep(0.05)
    assert "have a store timestamp one bit" in b.log()
    resp = await _request(b.broker, RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": half})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert "past transaction_retention_hours" not in (resp.remark or ""), resp.remark
    out = await _apply_halves(b, tmp_path / "store", [half])
    assert out["expired"] == [] and [s["commit_log_offset"] for s in out["skipped"]] == [half], out
    assert _dead_letters(b, "expired") == 0
    assert b.stop() == 0
