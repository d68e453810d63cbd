"""A half whose QUEUEOFFSET (commit-log header, outside the body CRC) went bad at rest, in a segment older than the
start verifies: what became of its transaction is read by the half-queue offset the consume queue files it at,
never by the damaged field, which names another transaction's entry in the decision table."""
from __future__ import annotations

import asyncio
import os

import pytest

from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.message import decode_offset_msg_id
from protocol.txlog import HALF_TOPIC
from tests.integration.test_corrupt_records import (FLAGS, SEG, _corrupt_count, _fill, _open_record, _pending, _request,
                                                    _Unknown)
from tests.integration.test_transactions import _drain
from tests.support.bounded import bounded
from tests.support.broker_process import NO_CHECKS

pytestmark = pytest.mark.asyncio

DEAD_FAST = ("--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0", "--transaction-check-max", "1")


class _CommitFirst(_Unknown):
    """Commits the first transaction it runs, leaves the others undecided."""

    def __init__(self):
        self.ran = 0

    def execute_local_transaction(self, msg, arg):
        self.ran += 1
        return S.COMMIT_MESSAGE if self.ran == 1 else S.UNKNOW


def _set_queue_offset(store_dir, phys: int, value: int) -> int:
    """Write ``value`` into the QUEUEOFFSET (byte 20) of the record at ``phys``; returns what it was."""
    f, _msg = _open_record(store_dir, phys)
    with f:
        f.seek(phys % SEG + 20)
        before = int.from_bytes(f.read(8), "big")
        f.seek(phys % SEG + 20)
        f.write(value.to_bytes(8, "big"))
    return before


@bounded(90)
async def test_a_committed_half_whose_queue_offset_names_a_dead_letter_is_not_resumed(broker_factory, tmp_path):
    """Committed half A (half-queue offset 0) had its QUEUEOFFSET read 1, the offset of B, dead-lettered. The
    resume (903) of A read the decision table at 1: "DEAD", so A was made pending again and checked, and its
    producer's COMMIT delivered it a second time; B's entry was cleared to undecided with nobody checking it.
    A is COMMIT, and said so; B resumes as ever."""
    b = broker_factory(*FLAGS, *DEAD_FAST)
    async with TransactionProducer(b.namesrv, "PG_misnumbered", _CommitFirst()) as producer:
        committed = await producer.send_in_transaction("TxMisnumbered", b"A")
        dead = await producer.send_in_transaction("TxMisnumbered", b"B")
        async with asyncio.timeout(30):
            while await _pending(b):            # B's one check unanswered: dead-lettered max-checks
                await asyncio.sleep(0.05)
    half_a = decode_offset_msg_id(committed.send_result.offset_msg_id)[2]
    half_b = decode_offset_msg_id(dead.send_result.offset_msg_id)[2]
    await _fill(b)                              # A and B in the first segment: older than the start verifies
    assert b.stop() == 0
    assert _set_queue_offset(tmp_path / "store", half_a, 1) == 0

    b = broker_factory(*FLAGS, *NO_CHECKS)
    resp = await _request(b.broker, RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": half_a})
    assert resp.code == ResponseCode.SYSTEM_ERROR and "COMMIT" in (resp.remark or ""), (resp.code, resp.remark)
    assert await _pending(b) == 0
    assert f"the half at commit-log offset {half_a} says queue offset 1, but the half queue files it at 0" in b.log()
    assert _corrupt_count(b, "transaction half lookup") == 1
    resp = await _request(b.broker, RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": half_b})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert await _pending(b) == 1
    assert b.stop() == 0


# its start reads it from the transaction snapshot; from the log (the snapshot lost)
@pytest.mark.parametrize("snapshot_lost", [False, True])
@bounded(90)
async def test_an_undecided_half_whose_queue_offset_names_a_committed_one_is_still_checked(broker_factory, tmp_path,
                                                                                          snapshot_lost):
    """Undecided half B (half-queue offset 1) had its QUEUEOFFSET read 0, committed A's: the start took B for
    decided (the table's entry 0 says COMMIT) and left it out of the pending index, listed nowhere, never checked
    nor expired: a transaction lost without a word. It is pending, under its own entry, and its commit lands."""
    b = broker_factory(*FLAGS, *NO_CHECKS)
    async with TransactionProducer(b.namesrv, "PG_misnumbered", _CommitFirst()) as producer:
        await producer.send_in_transaction("TxMisnumbered", b"A")
        undecided = await producer.send_in_transaction("TxMisnumbered", b"B")
    half_b = decode_offset_msg_id(undecided.send_result.offset_msg_id)[2]
    await _fill(b)
    assert b.stop() == 0
    if snapshot_lost:
        os.unlink(tmp_path / "store" / "transactions" / "snapshot.json")
    assert _set_queue_offset(tmp_path / "store", half_b, 0) == 1

    b = broker_factory(*FLAGS, *NO_CHECKS)
    assert await _pending(b) == 1
    assert _corrupt_count(b, "transaction half lookup") == 1
    resp = await _request(b.broker, RequestCode.TXMQ_RESOLVE_TRANSACTION,
                          {"commitLogOffset": half_b, "decision": "COMMIT"})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert await _pending(b) == 0
    assert sorted(await _drain(b.namesrv, "TxMisnumbered", expect=2)) == [b"A", b"B"]
    assert b.stop() == 0


@bounded(90)
async def test_a_dead_letter_whose_half_queue_unit_was_zeroed_still_resumes(broker_factory, tmp_path):
    """A zeroed half-queue unit (a consume-queue page lost at rest) names no half, but the half is sound in the log
    and its QUEUEOFFSET names that very unit, or past the queue's end when the start took the zeroed tail for it:
    nothing disagrees. Taken for "no unit names it", the resume of dead-lettered C, whose unit (the queue's last) was
    zeroed, answered 'not dead-lettered (unknown): no half message is stored there' (its END or an admin decision
    of it were refused the same way)."""
    zeroed = 2
    b = broker_factory(*FLAGS, *DEAD_FAST)
    async with TransactionProducer(b.namesrv, "PG_misnumbered", _CommitFirst()) as producer:
        sent = [await producer.send_in_transaction("TxMisnumbered", body) for body in (b"A", b"B", b"C")]
        async with asyncio.timeout(30):
            while await _pending(b):            # B's and C's one check unanswered: dead-lettered max-checks
                await asyncio.sleep(0.05)
    halves = [decode_offset_msg_id(s.send_result.offset_msg_id)[2] for s in sent]
    await _fill(b)
    assert b.stop() == 0
    qdir = tmp_path / "store" / "consumequeue" / HALF_TOPIC / "0"
    with open(qdir / sorted(os.listdir(qdir))[0], "r+b") as f:
        f.seek(zeroed * 20)
        f.write(bytes(20))

    b = broker_factory(*FLAGS, *NO_CHECKS)
    resp = await _request(b.broker, RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": halves[zeroed]})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert await _pending(b) == 1
    resp = await _request(b.broker, RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": halves[0]})
    assert resp.code == ResponseCode.SYSTEM_ERROR and "COMMIT" in (resp.remark or ""), (resp.code, resp.remark)
    assert _corrupt_count(b, "transaction half lookup") == 0      # nothing disagreed: no damage said of the log
    assert b.stop() == 0
