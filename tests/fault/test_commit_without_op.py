"""A crash between a committed message and its op record (they share one writer batch, but a torn
batch can keep the first) must not make the broker check and commit the transaction a second time.

A child process writes a half message and its committed message, but no op record, then is killed
before any checkpoint covers them. The broker started on that store finds the commit in the replayed
tail, rewrites the missing op record, and never delivers the message twice, across restarts too."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from consumer import PullConsumer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from tests.support.broker_process import REPO

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

CHILD = r"""
import asyncio, os, sys
from broker.store import MessageStore, StoreConfig
from broker.transaction.records import RecordFactory
from protocol.message import UniqIdGenerator, pack_host, tags_code

async def main(store_dir):
    store = MessageStore(store_dir, StoreConfig(segment_size=1 << 20, checkpoint_interval_ms=600000))
    await store.open()
    rf = RecordFactory(pack_host("127.0.0.1", 10911), UniqIdGenerator(), lambda: 1)
    props = {"TAGS": "t", "UNIQ_KEY": "ABCDEF", "TRAN_MSG": "true", "PGROUP": "PG_torn", "WAIT": "true"}
    half = await store.put(rf.half(body=b"paid once", real_topic="Torn", real_qid=0, flag=0, sys_flag=4,
                                   born_timestamp=1, born_host=pack_host("127.0.0.1", 5), props=props))
    view = store.get_record(half.physical_offset)
    await store.put(rf.committed(view, half.physical_offset, "Torn", 0, tags_code(props)))  # the op is lost
    print("written", flush=True)
    os.kill(os.getpid(), 9)

asyncio.run(main(sys.argv[1]))
"""


async def _pending(addr) -> int:
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS), 5)
        return json.loads(resp.body_bytes())["total"]
    finally:
        conn.close()


async def _bodies(namesrv):
    consumer = PullConsumer(namesrv, "CG_torn")
    bodies = []
    for mq in await consumer.fetch_queues("Torn"):
        bodies += [m.body for m in (await consumer.pull(mq, 0, max_nums=10)).messages]
    await consumer.shutdown()
    return bodies


async def test_commit_whose_op_was_lost_is_not_committed_again(broker_factory, tmp_path):
    store = tmp_path / "store"
    child = subprocess.run([sys.executable, "-c", CHILD, str(store)], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
    assert "written" in child.stdout and child.returncode == -9, child.stderr
    flags = ("--transaction-check-interval-ms", "50", "--transaction-timeout-ms", "0")
    b = broker_factory(*flags)
    assert await _pending(b.broker) == 0
    assert "lost its op record; rewritten" in b.log()
    assert await _bodies(b.namesrv) == [b"paid once"]
    await _first_decision_stands(b.broker)
    assert b.stop() == 0
    b2 = broker_factory(*flags)
    assert await _pending(b2.broker) == 0
    assert await _bodies(b2.namesrv) == [b"paid once"]
    await _first_decision_stands(b2.broker)


async def _first_decision_stands(addr) -> None:
    """The commit the crash left without its op is the transaction's first decision: a late ROLLBACK (a producer
    retrying, a check answered late) is refused, a repeated COMMIT acknowledged and changes nothing."""
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        for state, code, remark in ((12, ResponseCode.TRANSACTION_FAILED, "transaction already COMMIT"),
                                    (8, ResponseCode.SUCCESS, "already COMMIT")):
            end = await conn.request(RemotingCommand.request(RequestCode.END_TRANSACTION, {
                "producerGroup": "PG_torn", "tranStateTableOffset": 0, "commitLogOffset": 0,
                "commitOrRollback": state, "fromTransactionCheck": "false"}), 5)
            assert (end.code, end.remark.startswith(remark)) == (code, True), end.remark
    finally:
        conn.close()


DEAD_CHILD = r"""
import asyncio, os, sys
from broker.store import MessageStore, StoreConfig
from broker.transaction.records import RecordFactory
from protocol.message import UniqIdGenerator, decode_record, pack_host

async def main(store_dir):
    store = MessageStore(store_dir, StoreConfig(segment_size=1 << 20, checkpoint_interval_ms=600000))
    await store.open()
    rf = RecordFactory(pack_host("127.0.0.1", 10911), UniqIdGenerator(), lambda: 1)
    props = {"TAGS": "t", "UNIQ_KEY": "FEDCBA", "TRAN_MSG": "true", "PGROUP": "PG_torn", "WAIT": "true"}
    half = await store.put(rf.half(body=b"given up once", real_topic="Torn", real_qid=0, flag=0, sys_flag=4,
                                   born_timestamp=1, born_host=pack_host("127.0.0.1", 5), props=props))
    msg = decode_record(store.get_record(half.physical_offset))[0]
    await store.put(rf.dead_letter(msg, half.physical_offset, "max-checks"))     # its DEAD op is lost
    print("written", flush=True)
    os.kill(os.getpid(), 9)

asyncio.run(main(sys.argv[1]))
"""


async def _listed(addr) -> dict:
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS), 5)
        return json.loads(resp.body_bytes())
    finally:
        conn.close()


async def _dead_letters(namesrv):
    consumer = PullConsumer(namesrv, "CG_torn_dead")
    (mq,) = await consumer.fetch_queues("TRANS_CHECK_MAX_TIME_TOPIC")
    bodies = [m.body for m in (await consumer.pull(mq, 0, max_nums=10)).messages]
    await consumer.shutdown()
    return bodies


async def test_a_dead_letter_whose_op_was_lost_is_not_pending_again(broker_factory, tmp_path):
    """The same torn batch for a dead letter (the copy in TRANS_CHECK_MAX_TIME_TOPIC, then its DEAD op): the
    transaction came back pending with its dead letter already out, to be dead-lettered a second time, or
    committed by a later answer though its first recorded outcome was the dead letter."""
    store = tmp_path / "store"
    child = subprocess.run([sys.executable, "-c", DEAD_CHILD, str(store)], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert "written" in child.stdout and child.returncode == -9, child.stderr
    b = broker_factory("--transaction-check-interval-ms", "50", "--transaction-timeout-ms", "0")
    listed = await _listed(b.broker)
    assert (listed["total"], listed["dead_lettered"]) == (0, 1), listed
    assert "lost its op record; rewritten" in b.log()
    assert await _dead_letters(b.namesrv) == [b"given up once"]
    assert b.stop() == 0
    b2 = broker_factory("--transaction-check-interval-ms", "50", "--transaction-timeout-ms", "0")
    listed = await _listed(b2.broker)
    assert (listed["total"], listed["dead_lettered"]) == (0, 1), listed


WRONG_HALF_CHILD = DEAD_CHILD.replace('''    msg = decode_record(store.get_record(half.physical_offset))[0]
    await store.put(rf.dead_letter(msg, half.physical_offset, "max-checks"))''', '''    props = dict(props, UNIQ_KEY="ABCDEF")
    other = await store.put(rf.half(body=b"still open", real_topic="Torn", real_qid=0, flag=0, sys_flag=4,
                                    born_timestamp=1, born_host=pack_host("127.0.0.1", 5), props=props))
    msg = decode_record(store.get_record(other.physical_offset))[0]
    # the second half's dead letter, its TXMQ_HALF naming the first (a digit of it flipped)
    await store.put(rf.dead_letter(msg, half.physical_offset, "max-checks"))''')


async def test_a_torn_dead_letter_naming_another_half_does_not_end_that_one(broker_factory, tmp_path):
    """The dead letter that ends the log names its half by TXMQ_HALF, under no CRC: the op the repair wrote for the
    half it named ended another transaction, still undecided, without a word. The half must be the letter's own
    (its UNIQ_KEY and body); else no op is written, and it is said."""
    assert "rf.dead_letter(msg, half.physical_offset" in WRONG_HALF_CHILD and "still open" in WRONG_HALF_CHILD
    store = tmp_path / "store"
    child = subprocess.run([sys.executable, "-c", WRONG_HALF_CHILD, str(store)], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert "written" in child.stdout and child.returncode == -9, child.stderr
    b = broker_factory("--transaction-check-interval-ms", "60000")
    listed = await _listed(b.broker)
    assert (listed["total"], listed["dead_lettered"]) == (2, 0), listed
    assert b.stop() == 0
    assert "names no half of its own (TXMQ_HALF 0)" in b.log()


ROCKETMQ_OP_CHILD = r"""
import asyncio, sys
from broker.store import MessageStore, PutRequest, StoreConfig
from broker.transaction.records import RecordFactory
from protocol.message import UniqIdGenerator, encode_record, pack_host

async def main(store_dir):
    store = MessageStore(store_dir, StoreConfig(segment_size=1 << 20))
    await store.open()
    host = pack_host("127.0.0.1", 10911)
    rf = RecordFactory(host, UniqIdGenerator(), lambda: 1)
    for i in range(2):
        props = {"TAGS": "t", "UNIQ_KEY": "ABCDEF%d" % i, "TRAN_MSG": "true", "PGROUP": "PG_rmq", "WAIT": "true"}
        await store.put(rf.half(body=b"open %d" % i, real_topic="Rmq", real_qid=0, flag=0, sys_flag=4,
                                born_timestamp=1, born_host=pack_host("127.0.0.1", 5), props=props))
    # The op record a RocketMQ 4.x broker writes (TransactionalMessageBridge.addRemoveTagInTransactionOp): tag d,
    # the half's queue offset as its body, WAIT; no TXMQ_* property.
    op = encode_record(topic=b"RMQ_SYS_TRANS_OP_HALF_TOPIC", body=b"1", queue_id=0, flag=0, sys_flag=0,
                       born_timestamp=1, born_host=host, store_host=host, properties=b"WAIT\x01true\x02TAGS\x01d")
    await store.put(PutRequest(op, "RMQ_SYS_TRANS_OP_HALF_TOPIC", 0, 100, 0))
    await store.close()
    print("written", flush=True)

asyncio.run(main(sys.argv[1]))
"""


async def test_an_op_record_txmq_did_not_write_is_not_taken_for_damage(broker_factory, tmp_path):
    """parse_op leaves out an op record without TXMQ_HALF as one txmq did not write (a RocketMQ broker's: tag d and
    the half's queue offset, no TXMQ_* property; a slave follows such a master's log byte for byte). Taken for an
    op whose properties went bad, it was counted as corrupt, said at ERROR at every start, and the transaction it
    names was dead-lettered (op-unreadable): it is passed over as before, its half pending as before."""
    store = tmp_path / "store"
    child = subprocess.run([sys.executable, "-c", ROCKETMQ_OP_CHILD, str(store)], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert "written" in child.stdout and child.returncode == 0, child.stderr
    b = broker_factory("--transaction-check-interval-ms", "60000")
    listed = await _listed(b.broker)
    assert (listed["total"], listed["dead_lettered"]) == (2, 0), listed
    assert b.stop() == 0
    assert "cannot be read" not in b.log() and "op-unreadable" not in b.log()


MISNAMED_LETTER_CHILD = r"""
import asyncio, sys
from broker.store import MessageStore, PutRequest, StoreConfig
from broker.transaction.records import RecordFactory
from protocol.message import UniqIdGenerator, decode_record, encode_record, pack_host

async def main(store_dir):
    store = MessageStore(store_dir, StoreConfig(segment_size=256 * 1024))
    await store.open()
    rf = RecordFactory(pack_host("127.0.0.1", 10911), UniqIdGenerator(), lambda: 1)
    halves = []
    for i in range(2):
        props = {"TAGS": "t", "UNIQ_KEY": "ABCDEF%d" % i, "TRAN_MSG": "true", "PGROUP": "PG_torn", "WAIT": "true"}
        halves.append(await store.put(rf.half(body=b"half %d" % i, real_topic="Torn", real_qid=0, flag=0, sys_flag=4,
                                              born_timestamp=1, born_host=pack_host("127.0.0.1", 5), props=props)))
    first, second = halves
    msg = decode_record(store.get_record(first.physical_offset))[0]
    # The first half's dead letter and DEAD op, one batch; the letter's TXMQ_HALF names the second (a digit flipped).
    letter, op = await store.put_many([rf.dead_letter(msg, second.physical_offset, "max-checks"),
                                       rf.decision("DEAD", first.physical_offset, 0, "max-checks")])
    host = pack_host("127.0.0.1", 5)
    for _ in range(600):    # five segments: the first is older than start-up verifies
        filler = encode_record(topic=b"Filler", body=bytes(2000), queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                               born_host=host, store_host=host, properties=b"")
        await store.put(PutRequest(filler, "Filler", 0, 0, 0))
    await store.close()
    print("written", op.physical_offset, second.physical_offset, flush=True)

asyncio.run(main(sys.argv[1]))
"""


async def test_an_unreadable_op_after_a_dead_letter_naming_another_half_does_not_end_that_one(broker_factory,
                                                                                           tmp_path):
    """An op record that cannot be decoded names no half; the dead letter of its batch (ending where it begins)
    names one by TXMQ_HALF, under no CRC. Taken at its word, a flipped digit there dead-lettered another, undecided
    transaction. As for the torn dead letter's repair, the half must be the letter's own (UNIQ_KEY, body)."""
    store = tmp_path / "store"
    child = subprocess.run([sys.executable, "-c", MISNAMED_LETTER_CHILD, str(store)], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert "written" in child.stdout and child.returncode == 0, child.stderr
    op_at, second = map(int, child.stdout.split()[1:])
    path = store / "commitlog" / f"{0:020d}"
    with open(path, "r+b") as f:       # the op's body length (IPv4 hosts): it can no longer be decoded
        f.seek(op_at + 84)
        byte = f.read(1)[0]
        f.seek(op_at + 84)
        f.write(bytes([byte ^ 0x80]))
    b = broker_factory("--transaction-check-interval-ms", "60000", "--segment-size", str(256 * 1024),
                       "--max-message-size", str(16 * 1024))
    listed = await _listed(b.broker)
    assert second in {row["commit_log_offset"] for row in listed["pending"]}, listed
    assert listed["dead_lettered"] == 0, listed
    assert b.stop() == 0
    assert f"the record at commit-log offset {op_at} (RMQ_SYS_TRANS_OP_HALF_TOPIC) cannot be decoded" in b.log()
