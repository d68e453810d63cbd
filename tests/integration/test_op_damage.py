"""Op records whose properties went bad on disk, in a segment older than the start-up scan verifies.

An op record's properties (TAGS, TXMQ_HALF, TXMQ_OP) are under no CRC, and crash recovery cuts only what lies past
the checkpoint: a page zeroed there, or a flipped byte, stays. Rebuilt from the log (the snapshot lost), start-up
passed such an op over without a word, and its transaction came back undecided behind an older undecided one (the
half queue's progress): a committed one was checked again, and its producer's COMMIT answer delivered it twice; a
rolled-back one could be committed. Now the rest of the store says what it was (the decision table, the committed
message written just before it), and a decision nothing else records is dead-lettered, never checked as undecided.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode
from protocol.errors import BrokerError
from protocol.message import decode_offset_msg_id, decode_record
from protocol.record import record_properties
from tests.integration.test_corrupt_records import (FLAGS, SEG, _corrupt_count, _dead_letters, _fill, _op_records,
                                                    _pull_all, _request, _Unknown)
from tests.support.bounded import bounded
from tests.support.broker_process import NO_CHECKS
from tests.support.cluster_process import create_topic
from tests.support.faketime import LIBFAKETIME, past_env

pytestmark = pytest.mark.asyncio

READ = "transaction recovery (RMQ_SYS_TRANS_OP_HALF_TOPIC)"


def _damage_properties(store_dir, pos: int, how: str) -> None:
    """Zero the properties of the record at ``pos`` of the first segment (a zeroed page), flip one bit of its
    TXMQ_OP value, or one of its body length (the record can no longer be decoded: nothing in it names its half)."""
    path = os.path.join(store_dir, "commitlog", f"{0:020d}")
    with open(path, "r+b") as f:
        f.seek(pos)
        size = int.from_bytes(f.read(4), "big")
        f.seek(pos)
        record = f.read(size)
        props = bytes(record_properties(record))
        start = pos + size - len(props)
        if how == "length":
            f.seek(pos + 84)        # BODYLEN (IPv4 hosts)
            f.write(bytes([record[84] ^ 0x80]))
            return
        if how == "zeroed":
            f.seek(start)
            f.write(bytes(len(props)))
        else:
            at = props.index(b"TXMQ_OP\x01") + len(b"TXMQ_OP\x01")
            f.seek(start + at)
            f.write(bytes([props[at] ^ 0x01]))
    assert decode_record(open(path, "rb").read(SEG), pos)[0].properties.get("TXMQ_OP") in (None, "BOMMIT", "SOLLBACK")


async def _bodies(b, topic: str, group: str) -> list[bytes]:
    """Every body of ``topic``'s queues (none if it was never made)."""
    consumer = PullConsumer(b.namesrv, group)
    try:
        queues = await consumer.fetch_queues(topic)
    except BrokerError:
        return []
    finally:
        await consumer.shutdown()
    bodies = []
    for mq in queues:
        got, error = await _pull_all(b, mq, group=group)
        assert error is None
        bodies += got
    return bodies


async def _pending(b) -> set[int]:
    resp = await _request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {})
    return {row["commit_log_offset"] for row in json.loads(resp.body_bytes())["pending"]}


@pytest.mark.parametrize("decided, how, table", [
    ("commit", "zeroed", True),         # the decision table says COMMIT
    ("commit", "zeroed", False),        # the committed message written just before the op says so
    ("commit", "flipped", False),
    ("commit-timer", "zeroed", False),  # committed to wait an hour: its message is in the timer topic
    # Committed to wait until a wall-clock time (Aliyun's __STARTDELIVERTIME, as TIMER_DELIVER_MS) that has gone by
    # when the broker starts again: its message is still in the timer topic, due at once.
    pytest.param("commit-at", "zeroed", False,
                 marks=pytest.mark.skipif(LIBFAKETIME is None, reason="libfaketime is not installed")),
    ("rollback", "zeroed", True),       # the decision table says ROLLBACK
    ("rollback", "flipped", False),     # nothing else says it: dead-lettered, not checked
    ("commit", "length", False),        # names no half: the committed message that ends where it begins does
    ("rollback", "length", True),       # names no half: the undecided one the decision table has as ROLLBACK
])
@bounded(90)
async def test_an_op_record_whose_properties_went_bad_is_not_taken_for_undecided(broker_factory, tmp_path, decided,
                                                                                 how, table):
    group, topic = f"PG_opzero_{decided.replace('-', '_')}", "TxOpZero"
    b = broker_factory(*FLAGS, *NO_CHECKS)

    class Second(_Unknown):     # the first transaction stays undecided (the half queue's progress stays before it)
        calls = 0

        def execute_local_transaction(self, msg, arg):
            Second.calls += 1
            if Second.calls == 1:
                return S.UNKNOW
            return S.COMMIT_MESSAGE if decided.startswith("commit") else S.ROLLBACK_MESSAGE

    waits = {"TIMER_DELAY_SEC": "3600"} if decided == "commit-timer" else None
    if decided == "commit-at":
        waits = {"__STARTDELIVERTIME": str(int(time.time() * 1000) + 3_600_000)}
    async with TransactionProducer(b.namesrv, group, Second()) as producer:
        sent = [await producer.send_in_transaction(topic, b"tx-%d" % i, properties=waits) for i in range(2)]
    undecided, decided_at = (decode_offset_msg_id(s.send_result.offset_msg_id)[2] for s in sent)
    await _fill(b)
    assert b.stop() == 0
    [(pos, body)] = _op_records(tmp_path / "store")
    assert body == b"1"
    _damage_properties(tmp_path / "store", pos, how)
    os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")    # lost: rebuilt from the op records
    if not table:
        shutil.rmtree(tmp_path / "store" / "transactions" / "decisions")

    # Checks due at once: a committed transaction taken for undecided would be asked, and committed again.
    b = broker_factory(*FLAGS, "--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0",
                       env=past_env("+2h") if decided == "commit-at" else None)    # (two hours on: it is due)
    assert await _pending(b) == {undecided}

    class AnswersCommit(_Unknown):
        asked: list[bytes] = []

        async def check_local_transaction(self, msg):
            AnswersCommit.asked.append(msg.body)
            return S.UNKNOW if msg.body == b"tx-0" else S.COMMIT_MESSAGE

    async with TransactionProducer(b.namesrv, group, AnswersCommit()):
        async with asyncio.timeout(30):
            while AnswersCommit.asked.count(b"tx-0") < 3:   # three checks of the undecided one: a pass went by
                await asyncio.sleep(0.03)
    assert b"tx-1" not in AnswersCommit.asked
    if decided == "commit-at":      # delivered from the timer topic, once
        async with asyncio.timeout(30):
            while not await _bodies(b, topic, "CG_opzero"):
                await asyncio.sleep(0.05)
    assert await _bodies(b, topic, "CG_opzero") == ([b"tx-1"] if decided in ("commit", "commit-at") else [])
    assert await asyncio.to_thread(_corrupt_count, b, READ) == 1
    dead = decided == "rollback" and not table
    assert await asyncio.to_thread(_dead_letters, b, "op-unreadable") == (1 if dead else 0)
    if dead:
        assert await _bodies(b, "TRANS_CHECK_MAX_TIME_TOPIC", "CG_opzero_dead") == [b"tx-1"]
    assert b.stop() == 0
    log = b.log()
    if how == "length":     # the undecided transactions were matched against what the store holds
        assert f"the transaction at {decided_at} " in log
    else:
        assert f"the op record at commit-log offset {pos} (half {decided_at}) cannot be read" in log
    if not dead:
        assert ("the decision table" if table else "its committed message") in log

    # The decision was written again as a sound op record: the next rebuild reads it, and no check follows.
    os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")
    b = broker_factory(*FLAGS, *NO_CHECKS)
    assert await _pending(b) == {undecided}
    assert b.stop() == 0
    if how != "length":
        assert f"commit-log offset {pos} (half {decided_at}) cannot be read (its properties are damaged); a later " \
               f"op record of its half ({'DEAD' if dead else decided.split('-')[0].upper()}) stands" in b.log()


async def _rebuilt_as_a_check_attempt(broker_factory, tmp_path, sent, pos: int) -> None:
    """With the snapshot gone, a start rebuilds from the op queue: the damaged record at ``pos`` is said and
    counted as a check attempt, and ``sent``'s transaction stays undecided, not dead-lettered."""
    os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")
    b = broker_factory(*FLAGS, *NO_CHECKS)
    assert await _pending(b) == {decode_offset_msg_id(sent.send_result.offset_msg_id)[2]}
    assert await asyncio.to_thread(_corrupt_count, b, READ) == 1
    assert await asyncio.to_thread(_dead_letters, b, "op-unreadable") == 0
    assert b.stop() == 0
    assert f"the op record at commit-log offset {pos} (half 0) cannot be read (its properties are damaged); it was " \
           "a check attempt" in b.log()


async def _checked_twice(b, group: str):
    """A transaction of ``group`` left undecided (the producer answers UNKNOW) until it has been checked twice:
    its send result."""
    class Asked(_Unknown):
        checks = 0

        async def check_local_transaction(self, msg):
            Asked.checks += 1
            return S.UNKNOW

    async with TransactionProducer(b.namesrv, group, Asked()) as producer:
        sent = await producer.send_in_transaction("TxOpZero", b"open")
        async with asyncio.timeout(30):
            while Asked.checks < 2:
                await asyncio.sleep(0.03)
    return sent


@bounded(60)
async def test_a_check_record_whose_properties_went_bad_decides_nothing(broker_factory, tmp_path):
    """A check attempt's record unreadable: its consume-queue tag (c) says what it was. Its transaction stays
    undecided, not dead-lettered as an unreadable decision would be; the record is said and counted."""
    b = broker_factory(*FLAGS, "--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0")
    sent = await _checked_twice(b, "PG_opzero_check")
    await _fill(b)
    assert b.stop() == 0
    (pos, body), *_ = _op_records(tmp_path / "store")
    assert body == b"0"
    _damage_properties(tmp_path / "store", pos, "zeroed")
    await _rebuilt_as_a_check_attempt(broker_factory, tmp_path, sent, pos)


@pytest.mark.parametrize("snapshot", [True, False])
@bounded(60)
async def test_a_half_that_cannot_be_decoded_does_not_keep_the_broker_from_starting(broker_factory, tmp_path,
                                                                                    snapshot):
    """A length inside an undecided half damaged at rest: start-up raised RecordError ("cannot start: record at 0:
    body length ... runs past the record"), every transaction with it. The half is said, counted and left out
    (nothing can check or commit it); the others are undecided as before. Read from the snapshot's pending list
    or from the half queue (no snapshot)."""
    b = broker_factory(*FLAGS, *NO_CHECKS)
    async with TransactionProducer(b.namesrv, "PG_opzero_half", _Unknown()) as producer:
        sent = [await producer.send_in_transaction("TxOpZero", b"tx-%d" % i) for i in range(2)]
    halves = [decode_offset_msg_id(s.send_result.offset_msg_id)[2] for s in sent]
    await _fill(b)
    assert b.stop() == 0
    _damage_properties(tmp_path / "store", halves[0], "length")
    if not snapshot:
        os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")

    b = broker_factory(*FLAGS, *NO_CHECKS)
    assert await _pending(b) == {halves[1]}
    assert await asyncio.to_thread(_corrupt_count, b, "transaction recovery (RMQ_SYS_TRANS_HALF_TOPIC)") == 1
    assert b.stop() == 0
    assert f"the record at commit-log offset {halves[0]} (RMQ_SYS_TRANS_HALF_TOPIC) cannot be decoded" in b.log()


@bounded(60)
async def test_an_unreadable_op_after_the_snapshot_takes_the_decision_table_at_its_word(broker_factory, tmp_path):
    """Killed before the next snapshot, the broker replays the op records after the last one; an unreadable one
    among them is said and counted, and the decision table (the killed process's pages) gives its COMMIT."""
    b = broker_factory(*FLAGS, *NO_CHECKS, "--transaction-snapshot-interval-s",
                       "3600")

    class CommitSecond(_Unknown):
        calls = 0

        def execute_local_transaction(self, msg, arg):
            CommitSecond.calls += 1
            return S.UNKNOW if CommitSecond.calls == 1 else S.COMMIT_MESSAGE

    async with TransactionProducer(b.namesrv, "PG_opzero_kill", CommitSecond()) as producer:
        sent = [await producer.send_in_transaction("TxOpZero", b"tx-%d" % i) for i in range(2)]
    undecided, committed = (decode_offset_msg_id(s.send_result.offset_msg_id)[2] for s in sent)
    b.kill()
    [(pos, _)] = _op_records(tmp_path / "store")
    _damage_properties(tmp_path / "store", pos, "flipped")     # no NUL: past the checkpoint, not cut as torn

    b = broker_factory(*FLAGS, *NO_CHECKS)
    assert await _pending(b) == {undecided}
    assert await _bodies(b, "TxOpZero", "CG_opzero_kill") == [b"tx-1"]
    assert await asyncio.to_thread(_corrupt_count, b, READ) == 1
    assert b.stop() == 0
    assert f"the op record at commit-log offset {pos} (half {committed}) cannot be read (its properties are " \
           "damaged); COMMIT, as the decision table says" in b.log()


@bounded(60)
async def test_a_check_record_whose_txmq_half_went_bad_still_counts_for_its_half(broker_factory, tmp_path):
    """TXMQ_HALF is under no CRC, the body (the half's queue offset) under one: a flipped digit gave the check's
    count to no half (or another), so after a rebuild its transaction had a check fewer than it had been sent."""
    b = broker_factory(*FLAGS, "--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0")
    sent = await _checked_twice(b, "PG_opzero_misnamed")
    await _fill(b)
    assert b.stop() == 0
    half = decode_offset_msg_id(sent.send_result.offset_msg_id)[2]
    with open(os.path.join(tmp_path / "store", "commitlog", f"{0:020d}"), "rb") as f:
        data = f.read(SEG)
    records = [(pos, decode_record(data, pos)[0]) for pos, _ in _op_records(tmp_path / "store")]
    pos, last = max(records, key=lambda r: int(r[1].properties["TXMQ_CHECKS"]))
    assert last.properties["TXMQ_HALF"] == str(half) == "0"
    size = int.from_bytes(data[pos:pos + 4], "big")
    props = bytes(record_properties(data[pos:pos + size]))
    at = pos + size - len(props) + props.index(b"TXMQ_HALF\x01") + len(b"TXMQ_HALF\x01")
    with open(os.path.join(tmp_path / "store", "commitlog", f"{0:020d}"), "r+b") as f:
        f.seek(at)
        f.write(b"1")                   # "0" ^ 0x01: a half at commit-log offset 1, which is no record's
    os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")

    b = broker_factory(*FLAGS, *NO_CHECKS)
    resp = await _request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {})
    [row] = json.loads(resp.body_bytes())["pending"]
    assert (row["commit_log_offset"], row["checks"]) == (half, int(last.properties["TXMQ_CHECKS"]))
    assert await asyncio.to_thread(_corrupt_count, b, READ) == 1
    assert b.stop() == 0
    assert f"the op record at commit-log offset {pos} names half 1 in TXMQ_HALF but 0 by its body" in b.log()



@pytest.mark.parametrize("after", ["check", "rollback"])
@bounded(90)
async def test_an_op_after_a_resume_is_not_taken_for_the_dead_letter_before_it(broker_factory, tmp_path, after):
    """Dead-lettered (max-checks), resumed by the admin, then checked: the record of that check, or of the
    ROLLBACK its answer gave, went bad. The dead letter of the half's first DEAD is still the dead-letter queue's
    last record before that op, but it belongs to a decision the RESUME undid, not to the op's batch: a check
    (its consume-queue tag) decided nothing, and the transaction stays undecided; a ROLLBACK nothing else
    records is dead-lettered as unreadable, as any other (not said to be what that old dead letter shows)."""
    b = broker_factory(*FLAGS, "--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0",
                       "--transaction-check-max", "2")
    async with TransactionProducer(b.namesrv, "PG_opzero_resumed", _Unknown()) as producer:
        sent = await producer.send_in_transaction("TxOpZero", b"resumed")
        async with asyncio.timeout(30):
            while await asyncio.to_thread(_dead_letters, b, "max-checks") < 1:
                await asyncio.sleep(0.03)
    half = decode_offset_msg_id(sent.send_result.offset_msg_id)[2]
    assert b.stop() == 0

    # Checks as often, but never dead-lettered again while this test looks.
    b = broker_factory(*FLAGS, "--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0",
                       "--transaction-check-max", "1000000")
    resumed = await _request(b.broker, RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": half})
    assert resumed.code == 0, resumed.remark

    class Asked(_Unknown):
        checks = 0

        async def check_local_transaction(self, msg):
            Asked.checks += 1
            return S.ROLLBACK_MESSAGE if after == "rollback" else S.UNKNOW

    async with TransactionProducer(b.namesrv, "PG_opzero_resumed", Asked()):
        async with asyncio.timeout(30):
            while not (await _pending(b) == set() if after == "rollback" else Asked.checks >= 1):
                await asyncio.sleep(0.03)
    await _fill(b)
    assert b.stop() == 0
    with open(os.path.join(tmp_path / "store", "commitlog", f"{0:020d}"), "rb") as f:
        data = f.read(SEG)
    ops = [(pos, decode_record(data, pos)[0].properties) for pos, _ in _op_records(tmp_path / "store")]
    resume_at = next(pos for pos, props in ops if props.get("TXMQ_OP") == "RESUME")
    if after == "check":
        pos = next(pos for pos, props in ops if pos > resume_at and props.get("TAGS") == "c")
        _damage_properties(tmp_path / "store", pos, "zeroed")
    else:
        [pos] = [pos for pos, props in ops if props.get("TXMQ_OP") == "ROLLBACK"]
        _damage_properties(tmp_path / "store", pos, "flipped")
        shutil.rmtree(tmp_path / "store" / "transactions" / "decisions")
    os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")

    b = broker_factory(*FLAGS, *NO_CHECKS)
    assert await _pending(b) == ({half} if after == "check" else set())
    assert await asyncio.to_thread(_corrupt_count, b, READ) == 1
    assert await asyncio.to_thread(_dead_letters, b, "op-unreadable") == (1 if after == "rollback" else 0)
    assert b.stop() == 0
    said = "it was a check attempt" if after == "check" else "it decided the transaction, and neither"
    assert f"the op record at commit-log offset {pos} (half {half}) cannot be read (its properties are damaged); " \
           f"{said}" in b.log()


@bounded(60)
async def test_a_check_record_whose_tag_went_bad_decides_nothing(broker_factory, tmp_path):
    """A check attempt's TAGS flipped (c to b) in a segment start-up verifies: recovery rewrites its consume-queue
    unit from the record, tag included, so the unit no longer says c either. Its TXMQ_CHECKS (a decision op never
    has one, a check op always) still says what it was: its transaction stays undecided, not dead-lettered as an
    unreadable decision, where the producer's COMMIT would have been refused."""
    b = broker_factory(*FLAGS, "--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0")
    sent = await _checked_twice(b, "PG_opzero_tag")
    assert b.stop() == 0
    (pos, body), *_ = _op_records(tmp_path / "store")
    assert body == b"0"
    path = os.path.join(tmp_path / "store", "commitlog", f"{0:020d}")
    with open(path, "r+b") as f:
        f.seek(pos)
        size = int.from_bytes(f.read(4), "big")
        f.seek(pos)
        record = f.read(size)
        props = bytes(record_properties(record))
        assert props.startswith(b"TAGS\x01c\x02")
        f.seek(pos + size - len(props) + len(b"TAGS\x01"))
        f.write(b"b")
    await _rebuilt_as_a_check_attempt(broker_factory, tmp_path, sent, pos)


@bounded(60)
async def test_a_rollback_record_whose_tag_went_bad_still_says_rollback(broker_factory, tmp_path):
    """A ROLLBACK op's TAGS flipped (d to e): parse_op cannot take it (no op tag), yet its TXMQ_OP and TXMQ_HALF
    are whole and agree with its body. The decision table and the snapshot lost, nothing else records a ROLLBACK:
    it was dead-lettered (op-unreadable), the rolled-back message copied to the dead-letter topic. What the
    record itself says is read first."""
    b = broker_factory(*FLAGS, *NO_CHECKS)

    class Rollback(_Unknown):
        def execute_local_transaction(self, msg, arg):
            return S.ROLLBACK_MESSAGE

    async with TransactionProducer(b.namesrv, "PG_opzero_rbtag", Rollback()) as producer:
        sent = await producer.send_in_transaction("TxOpZero", b"rolled back")
    await _fill(b)
    assert b.stop() == 0
    [(pos, _)] = _op_records(tmp_path / "store")
    path = os.path.join(tmp_path / "store", "commitlog", f"{0:020d}")
    with open(path, "r+b") as f:
        f.seek(pos)
        size = int.from_bytes(f.read(4), "big")
        f.seek(pos)
        props = bytes(record_properties(f.read(size)))
        assert props.startswith(b"TAGS\x01d\x02") and b"TXMQ_OP\x01ROLLBACK" in props
        f.seek(pos + size - len(props) + len(b"TAGS\x01"))
        f.write(b"e")
    os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")
    shutil.rmtree(tmp_path / "store" / "transactions" / "decisions")

    b = broker_factory(*FLAGS, *NO_CHECKS)
    assert await _pending(b) == set()
    assert await asyncio.to_thread(_corrupt_count, b, READ) == 1
    assert await asyncio.to_thread(_dead_letters, b, "op-unreadable") == 0
    assert await _bodies(b, "TRANS_CHECK_MAX_TIME_TOPIC", "CG_opzero_rbtag") == []
    half = decode_offset_msg_id(sent.send_result.offset_msg_id)[2]
    assert b.stop() == 0
    assert f"the op record at commit-log offset {pos} (half {half}) cannot be read (its properties are damaged); " \
           "ROLLBACK, as its own TXMQ_OP says" in b.log()


@bounded(90)
async def test_an_unreadable_op_of_a_commit_moved_to_a_queue_its_topic_reads_finds_its_committed_message(
        broker_factory, tmp_path):
    """A half sent to queue 6 of 8, its topic cut to 4 before the COMMIT: the committed message is in queue 2 (its
    queue id mod 4), not REAL_QID's 6. Its op record's properties gone bad and the decision table lost, recovery
    looked for it in queue 6 alone, found nothing, and dead-lettered the transaction op-unreadable as well: its
    message delivered and dead-lettered both. It finds it in queue 2, and the transaction stays committed."""
    group, topic = "PG_opcut", "TxOpCut"
    b = broker_factory(*FLAGS, *NO_CHECKS)
    await create_topic(b.broker, topic, 8)
    async with TransactionProducer(b.namesrv, group, _Unknown()) as producer:
        sent = [(await producer.send_in_transaction(topic, b"tx-%d" % i)).send_result for i in range(8)]
        [moved] = [r for r in sent if r.queue.queue_id == 6]
        await create_topic(b.broker, topic, 4)
        assert await producer._end(b.broker, decode_offset_msg_id(moved.offset_msg_id)[2], moved.queue_offset,
                                   moved.msg_id, S.COMMIT_MESSAGE, False, None) is True
    committed = decode_offset_msg_id(moved.offset_msg_id)[2]
    undecided = {decode_offset_msg_id(r.offset_msg_id)[2] for r in sent} - {committed}
    await _fill(b)
    assert b.stop() == 0
    [(pos, _)] = _op_records(tmp_path / "store")
    _damage_properties(tmp_path / "store", pos, "zeroed")
    os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")    # lost: rebuilt from the op records
    shutil.rmtree(tmp_path / "store" / "transactions" / "decisions")

    b = broker_factory(*FLAGS, *NO_CHECKS)
    assert await _pending(b) == undecided
    assert await _bodies(b, topic, "CG_opcut") == [b"tx-%d" % sent.index(moved)]
    assert await asyncio.to_thread(_dead_letters, b, "op-unreadable") == 0
    assert b.stop() == 0
    assert f"the op record at commit-log offset {pos} (half {committed}) cannot be read" in b.log()
    assert "its committed message" in b.log()
