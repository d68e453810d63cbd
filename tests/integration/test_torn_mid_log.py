"""A record damaged in the middle of the log the start-up scan verifies, intact records after it.

A power loss that tore one page of the active segment and kept the later ones, or a bit flipped at rest in one
of the newest segments: the broker refused to start, and the only way on it named, --truncate-corrupt-tail,
discarded every acknowledged message after the damage. When where the damaged record ends is sure (its head
sound, an intact record right after it), --keep-corrupt-records loses only that record: it stays in place, a
pull stops at it (naming the reset-offset that moves past it), and everything after it is served. A restart
without the flag keeps it again (the store remembers it).

The fuzz test sends plain messages and transactions (committed, rolled back, one left undecided), is killed
(-9) once every send is acknowledged, gets one byte flipped at a seeded random place in a record of the newest
segment, and is started again: it either starts or says file, byte and both flags; started, every acknowledged
message but the damaged record's is delivered once, nothing rolled back is delivered, and no decided
transaction is undecided again (it would be checked, and a COMMIT answer delivered it twice).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import urllib.request

import pytest

from broker.store.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from consumer import PullConsumer
from consumer.pull_consumer import MessageQueue
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.errors import BrokerError
from protocol.message import MESSAGE_MAGIC, decode_offset_msg_id, decode_record
from tests.integration.test_corrupt_records import _corrupt_count, _request
from tests.support.bounded import bounded
from tests.support.broker_process import NO_CHECKS, BrokerProcess

pytestmark = pytest.mark.asyncio

SEG = 64 * 1024
FLAGS = ("--segment-size", str(SEG), "--max-message-size", str(16 * 1024), *NO_CHECKS)
PLAIN, TXS = 60, 12


def _records(path) -> list[tuple[int, int, str, bytes]]:
    """(position, size, topic, body) of every record of the segment at ``path``."""
    data = open(path, "rb").read()
    out, pos = [], 0
    while pos + 8 <= len(data) and int.from_bytes(data[pos + 4:pos + 8], "big", signed=True) == MESSAGE_MAGIC:
        msg, size = decode_record(data, pos)
        out.append((pos, size, msg.topic, msg.body))
        pos += size
    return out


def _newest(store_dir) -> str:
    """The newest commit-log segment holding data (the next one may be made and still empty)."""
    logdir = os.path.join(store_dir, "commitlog")
    return max((os.path.join(logdir, n) for n in os.listdir(logdir)), key=lambda p: (bool(_records(p)), p))


def _flip(path: str, at: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ bit]))


def _kept_count(b, name: str = "txmq_store_corrupt_records_kept_total") -> float:
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _kept_now(b) -> float:
    """The gauge of kept damaged records still in the log (TxmqCorruptRecordsKept)."""
    return _kept_count(b, "txmq_store_kept_corrupt_records")


async def _load(b) -> tuple[list[bytes], list[bytes], int]:
    """Plain messages to one queue, transactions (odd ones committed, even ones rolled back) after an undecided
    one: the bodies of the plain and the committed ones, and the undecided half's log offset."""
    async with Producer(b.namesrv, "PG_torn") as producer:
        for i in range(PLAIN):
            await producer.send("TornPlain", b"plain-%03d" % i + bytes(600))

    class Decides:
        def execute_local_transaction(self, msg, arg):
            return arg

        async def check_local_transaction(self, msg):
            return S.UNKNOW

    async with TransactionProducer(b.namesrv, "PG_torn_tx", Decides()) as producer:
        undecided = await producer.send_in_transaction("TornTx", b"tx-undecided", S.UNKNOW)
        for i in range(TXS):
            await producer.send_in_transaction("TornTx", b"tx-%03d" % i + bytes(300),
                                               S.COMMIT_MESSAGE if i % 2 else S.ROLLBACK_MESSAGE)
    plain = [b"plain-%03d" % i for i in range(PLAIN)]
    committed = [b"tx-%03d" % i for i in range(TXS) if i % 2]
    return plain, committed, decode_offset_msg_id(undecided.send_result.offset_msg_id)[2]


async def _delivered(b, topic: str) -> tuple[list[bytes], list[str]]:
    """Every body of ``topic`` (its first 10 bytes) from offset 0 of each queue, moving past a corrupt record
    as the reset-offset its error names would; and those errors."""
    consumer = PullConsumer(b.namesrv, "CG_torn")
    bodies, errors = [], []
    try:
        queues = await consumer.fetch_queues(topic)
        for q in queues:
            mq, offset = MessageQueue(topic, q.broker_name, q.queue_id), 0
            for _ in range(PLAIN + TXS + 8):
                try:
                    res = await consumer.pull(mq, offset, max_nums=32)
                except BrokerError as exc:
                    errors.append(str(exc))
                    offset += 1
                    continue
                bodies += [m.body[:10].rstrip(b"\0") for m in res.messages]
                if res.next_begin_offset >= res.max_offset:
                    break
                offset = res.next_begin_offset
    finally:
        await consumer.shutdown()
    return bodies, errors


async def _pending(b) -> set[int]:
    resp = await _request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {})
    return {row["commit_log_offset"] for row in json.loads(resp.body_bytes())["pending"]}


def _checkpoint_below(store_dir, phys: int) -> None:
    """The checkpoint as a kill -9 before its next turn (every second) leaves it: below ``phys``. A start judged a
    record's TOPIC and properties (outside the body CRC) only past the checkpoint; a test of that damage which
    took whatever the checkpoint held passed only when the kill came within a second of the record's write (a
    loaded host's slower sends: its first start's pulls met no corrupt record). Below it they are judged too now
    (test_a_flipped_topic_or_properties_byte_below_the_checkpoint_is_not_lost_silently)."""
    point = read_checkpoint(str(store_dir))
    if point is not None and point.flushed_offset > phys:
        write_checkpoint(str(store_dir), point._replace(flushed_offset=phys))


async def _a_plain_record_mid_log(broker_factory, tmp_path) -> tuple[list[bytes], str, int, bytes, int]:
    """_load a broker, kill it: the plain bodies, and the newest segment's path with the position, body and queue
    id of the middle plain record in it."""
    b = broker_factory(*FLAGS)
    plain, _, _ = await _load(b)
    b.kill()
    path = _newest(tmp_path / "store")
    pos, _size, _topic, body = [r for r in _records(path) if r[2] == "TornPlain"][PLAIN // 2]
    return plain, path, pos, body, int.from_bytes(open(path, "rb").read()[pos + 12:pos + 16], "big")


def _refused(store_dir, *flags) -> str:
    """Start a broker that must refuse: its log."""
    b = BrokerProcess(store_dir, *FLAGS, *flags)
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            b.start()
        assert b.proc.wait(30) == 1
    finally:
        b.kill()
    return b.log()


@bounded(120)
async def test_a_damaged_record_with_intact_ones_after_it_loses_only_itself(broker_factory, tmp_path):
    store = tmp_path / "store"
    b = broker_factory(*FLAGS)
    plain, committed, undecided = await _load(b)
    b.kill()                                    # every send above was acknowledged
    path = _newest(store)
    records = _records(path)
    pos, size, topic, body = next(r for r in records[len(records) // 2:] if r[2] == "TornPlain")
    _flip(path, pos + 88 + 300, 0x10)           # a byte of its body (IPv4 hosts: from byte 88): its CRC fails

    text = _refused(store)
    name = os.path.basename(path)
    assert f"segment {name} byte {pos} (file {path}" in text, text
    assert "--keep-corrupt-records" in text and "--truncate-corrupt-tail" in text, text

    b = broker_factory(*FLAGS, "--keep-corrupt-records")
    got, errors = await _delivered(b, "TornPlain")
    lost = body[:10].rstrip(b"\0")
    assert sorted(got) == [p for p in plain if p != lost], f"{len(got)} of {len(plain) - 1}"
    assert len(errors) == 1 and "corrupt" in errors[0], errors
    assert _kept_count(b) == 1
    assert await _pending(b) == {undecided}
    assert b.stop() == 0
    assert f"keep_corrupt_records: commit log segment {name} byte {pos}" in b.log()

    b = broker_factory(*FLAGS)                  # remembered: no flag needed again, the same served
    again, errors = await _delivered(b, "TornPlain")
    assert sorted(again) == sorted(got) and len(errors) == 1
    tx, errors = await _delivered(b, "TornTx")
    assert sorted(tx) == committed and not errors
    assert _corrupt_count(b, "pull") >= 1
    assert b.stop() == 0


@pytest.mark.parametrize("seed", range(20, 28))   # 20 an op record, 23 a head, 25 a QUEUEID, 26 a body
@bounded(150)
async def test_fuzz_a_flipped_byte_in_the_newest_segment(broker_factory, tmp_path, seed):
    rng = random.Random(seed)
    store = tmp_path / "store"
    b = broker_factory(*FLAGS)
    plain, committed, undecided = await _load(b)
    b.kill()
    path = _newest(store)
    records = _records(path)
    pos, size, topic, body = rng.choice(records[:-1])       # one with an intact record after it
    _flip(path, pos + rng.randrange(size), 1 << rng.randrange(8))

    flags: tuple[str, ...] = ()
    try:
        b = broker_factory(*FLAGS)
    except RuntimeError as exc:
        text = str(exc)
        assert f"byte {pos}" in text and os.path.basename(path) in text and "--truncate-corrupt-tail" in text, text
        if "--keep-corrupt-records" not in text:
            return                  # its head is damaged: where it ends is unknown; the operator is told so
        flags = ("--keep-corrupt-records",)
        b = broker_factory(*FLAGS, *flags)
    kept = _kept_count(b)
    got, errors = await _delivered(b, "TornPlain")
    lost = body[:10].rstrip(b"\0") if topic == "TornPlain" and kept else None
    assert len(got) == len(set(got)), "a message delivered twice"
    assert sorted(got) == [p for p in plain if p != lost], f"seed {seed}: {len(got)} of {len(plain)}; {errors}"
    assert len(errors) == (1 if lost else 0), errors
    tx, errors = await _delivered(b, "TornTx")
    lost = body[:10].rstrip(b"\0") if topic == "TornTx" and kept else None
    assert len(tx) == len(set(tx)) and set(tx) <= set(committed), tx       # none rolled back, none twice
    assert sorted(tx) == [c for c in committed if c != lost], (tx, errors)
    assert len(errors) == (1 if lost else 0), errors
    assert await _pending(b) <= {undecided}          # no decided transaction undecided again (checked again)
    assert b.stop() == 0


@bounded(120)
async def test_a_kept_record_whose_topic_byte_was_flipped_stays_in_its_queue(broker_factory, tmp_path):
    """A bit flipped in a record's TOPIC (outside the body CRC: 'TornPlain' read 'T/rnPlain') fails the start's
    check, and --keep-corrupt-records kept it, filed under the damaged name: its own queue was one short there, and
    every later record of that queue had its QUEUEOFFSET rewritten one down on disk (ERROR 'its header is damaged'
    for each intact record), so a group whose offset lay past it skipped one more message, and no pull of the
    queue met the kept record (no RECORD_CORRUPT: lost without a word). It stays in its own queue now."""
    plain, path, pos, body, qid = await _a_plain_record_mid_log(broker_factory, tmp_path)
    _flip(path, pos + 88 + len(body) + 1 + 1, 0x40)        # its topic's 'o' -> '/' (IPv4 hosts)
    _checkpoint_below(tmp_path / "store", int(os.path.basename(path)) + pos)

    b = broker_factory(*FLAGS, "--keep-corrupt-records")
    got, errors = await _delivered(b, "TornPlain")
    lost = body[:10].rstrip(b"\0")
    assert sorted(got) == [p for p in plain if p != lost], f"{len(got)} of {len(plain) - 1}; {errors}"
    assert len(errors) == 1 and "corrupt" in errors[0], errors
    assert _kept_count(b) == 1
    assert b.stop() == 0
    text = b.log()
    assert "its header is damaged; rewritten" not in text, [x for x in text.splitlines() if "rewritten" in x][:3]
    assert f"a pull of TornPlain-{qid} stops at offset" in text, text

    b = broker_factory(*FLAGS)                  # remembered: filed the same again
    again, errors = await _delivered(b, "TornPlain")
    assert sorted(again) == sorted(got) and len(errors) == 1, errors
    assert b.stop() == 0


@pytest.mark.parametrize("to", ["missing", "sibling"])
@bounded(90)
async def test_a_record_whose_queue_id_was_flipped_stays_in_its_queue(broker_factory, tmp_path, to):
    """QUEUEID is outside the body CRC. Flipped to a queue its topic does not have, the start filed the message
    there, where no consumer pulls: lost without a word. Flipped to a sibling queue, the record was taken for a
    damaged QUEUEOFFSET there and rewritten to follow it (the sibling delivered it; its own queue lost it, and every
    later record of both had its offset rewritten). Now the field is rewritten to the queue missing that offset."""
    plain, path, pos, body, qid = await _a_plain_record_mid_log(broker_factory, tmp_path)
    with open(path, "r+b") as f:
        f.seek(pos + 12)
        f.write((qid ^ (8 if to == "missing" else 1)).to_bytes(4, "big"))

    b = broker_factory(*FLAGS)
    got, errors = await _delivered(b, "TornPlain")
    assert sorted(got) == plain and not errors, f"{len(got)} of {len(plain)}"
    by_queue = {}
    consumer = PullConsumer(b.namesrv, "CG_torn_q")
    try:
        for q in await consumer.fetch_queues("TornPlain"):
            res = await consumer.pull(MessageQueue("TornPlain", q.broker_name, q.queue_id), 0, max_nums=32)
            by_queue[q.queue_id] = [(m.queue_offset, m.body[:9]) for m in res.messages]
    finally:
        await consumer.shutdown()
    assert all([o for o, _ in got] == list(range(len(got))) for got in by_queue.values()), by_queue
    assert body[:9] in [b for _, b in by_queue[qid]], f"{body[:9]} is not in its queue {qid}: {by_queue}"
    assert b.stop() == 0
    assert f"a record of TornPlain says queue {qid ^ (8 if to == 'missing' else 1)}" in b.log()


@pytest.mark.parametrize("damage", ["body", "topic"])
@bounded(180)
async def test_a_slave_of_a_master_that_kept_a_damaged_record_copies_the_log_after_it(broker_factory, tmp_path,
                                                                                      damage):
    """The kept record stays in the master's log: a slave that has not copied it yet must get past it, not be
    refused it for ever (its log end stuck there, a SYNC_MASTER's every later send FLUSH_SLAVE_TIMEOUT).
    One whose TOPIC alone is damaged (outside the CRC) the slave took at once as sound, filed under the damaged name:
    its own queue there one short, the record served by no pull, never stopped at."""
    from tests.integration.test_replication import _fetch_queues_once_routed, _log_end
    ha = ("--broker-role", "ASYNC_MASTER", "--ha-port", "0", "--ha-heartbeat-interval-ms", "500")
    b = broker_factory(*FLAGS, *ha, store="master")
    await _load(b)
    b.kill()
    path = _newest(tmp_path / "master")
    records = _records(path)
    pos, _size, _topic, body = next(r for r in records[len(records) // 2:] if r[2] == "TornPlain")
    _flip(path, pos + 88 + (300 if damage == "body" else len(body) + 2), 0x10 if damage == "body" else 0x40)
    _checkpoint_below(tmp_path / "master", int(os.path.basename(path)) + pos)
    master = broker_factory(*FLAGS, *ha, "--keep-corrupt-records", store="master")
    end = await _log_end(master.broker)
    slave = broker_factory(*FLAGS, "--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                           "--ha-heartbeat-interval-ms", "500", store="slave")
    async with asyncio.timeout(60):     # a refused chunk costs a 1 s reconnect; 30 s ran out on a loaded machine
        while await _log_end(slave.broker) < end:
            await asyncio.sleep(0.1)
    for restart in (False, True):       # as copied; restarted (without the flag it keeps it as its master does)
        if restart:
            slave.kill()
            slave = broker_factory(*FLAGS, "--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr",
                                   master.ha, "--ha-heartbeat-interval-ms", "500", store="slave")
        route = PullConsumer(slave.namesrv, "CG_route")
        try:
            async with asyncio.timeout(30):
                await _fetch_queues_once_routed(route, "TornPlain")
        finally:
            await route.shutdown()
        got, errors = await _delivered(slave, "TornPlain")
        assert len(got) == PLAIN - 1 and len(errors) == 1 and "corrupt" in errors[0], (restart, len(got), errors)
        assert _kept_now(slave) == 1, restart       # counted as copied, not only from the slave's next start


@bounded(180)
async def test_a_kept_record_older_than_the_segments_a_start_verifies_is_still_counted(broker_factory, tmp_path):
    """The start-up scan verifies only the newest segments (recovery_verify_segments, 3): a kept record older than
    them is kept again from corrupt_kept unseen, and txmq_store_corrupt_records_kept_total, counting what a start's
    scan kept, stayed 0 after that restart: TxmqCorruptRecordsKept went quiet while every pull of the queue still
    stopped at the record. The gauge of records kept now holds it."""
    plain, path, pos, body, _qid = await _a_plain_record_mid_log(broker_factory, tmp_path)
    _flip(path, pos + 88 + 300, 0x10)
    b = broker_factory(*FLAGS, "--keep-corrupt-records")
    assert _kept_count(b) == 1 and _kept_now(b) == 1
    async with Producer(b.namesrv, "PG_torn") as producer:     # 6 newer segments (64 KiB each)
        for i in range(400):
            await producer.send("TornFiller", b"f" * 1000)
    assert b.stop() == 0
    segments = sorted(os.listdir(tmp_path / "store" / "commitlog"))
    assert segments.index(os.path.basename(path)) < len(segments) - 4, segments

    b = broker_factory(*FLAGS)
    got, errors = await _delivered(b, "TornPlain")
    assert len(got) == PLAIN - 1 and len(errors) == 1 and "corrupt" in errors[0], (len(got), errors)
    assert _kept_now(b) == 1, "the kept record a pull stops at is counted nowhere"
    assert b.stop() == 0


@pytest.mark.parametrize("topic", ["TornPlain", "TornTx"])      # type NOT made PREPARED; COMMIT made ROLLBACK
@bounded(120)
async def test_a_record_whose_transaction_type_bit_flipped_is_still_served(broker_factory, tmp_path, topic):
    """SYSFLAG is outside the body CRC. Its bit 0x4 flipped (a plain message read as PREPARED, a committed one as
    ROLLBACK: types that get no consume-queue unit), the start after a kill -9 dropped the record's unit and
    rewrote the QUEUEOFFSET of every later record of its queue one down in the log: 59 of 60 plain messages
    served, no pull error, only ERRORs calling the intact records' headers damaged. Those types are stored with
    QUEUEOFFSET 0; one carrying its queue's next offset is read with the bit put back."""
    b = broker_factory(*FLAGS)
    plain, committed, _ = await _load(b)
    b.kill()
    path = _newest(tmp_path / "store")
    mine = [r for r in _records(path) if r[2] == topic]
    pos = mine[len(mine) // 2][0]
    _flip(path, pos + 39, 0x04)                 # SYSFLAG: bytes 36-39 of the record

    b = broker_factory(*FLAGS)
    got, errors = await _delivered(b, topic)
    assert sorted(got) == (plain if topic == "TornPlain" else committed) and not errors, (len(got), errors)
    assert f"byte {pos}: a record of {topic}-" in b.log() and "its header is damaged" not in b.log()
    assert b.stop() == 0


@bounded(150)
async def test_a_kept_record_the_log_was_cut_below_leaves_the_count_and_refuses_no_new_record(broker_factory,
                                                                                              tmp_path):
    """A start with --truncate-corrupt-tail that cut the log below a kept record (a record before it damaged
    since) left its offset in corrupt_kept: the gauge still counted a record no longer in the log, and the new
    message the log was written on with at that same offset was refused to every pull (RECORD_CORRUPT) and
    dropped by the Spark jobs, a sound, acknowledged message lost. Only the records below the log's end stay."""
    plain, path, pos, body, _qid = await _a_plain_record_mid_log(broker_factory, tmp_path)
    _flip(path, pos + 88 + 300, 0x10)
    b = broker_factory(*FLAGS, "--keep-corrupt-records")
    assert _kept_now(b) == 1
    assert b.stop() == 0
    before = [r for r in _records(path) if r[2] == "TornPlain"]
    prev = before[[r[0] for r in before].index(pos) - 1]
    assert prev[0] + prev[1] == pos                 # the plain record right before the kept one
    _flip(path, prev[0] + 88 + 300, 0x10)

    b = broker_factory(*FLAGS, "--truncate-corrupt-tail")
    kept_after_cut = _kept_now(b)
    async with Producer(b.namesrv, "PG_torn") as producer:        # the same sizes: the second lands on it
        for i in range(2):
            await producer.send("TornPlain", b"again-%03d" % i + bytes(600))
    assert [r[0] for r in _records(path) if r[3].startswith(b"again-")] == [prev[0], pos]
    view = await _request(b.broker, RequestCode.VIEW_MESSAGE_BY_ID, {"offset": int(path.rsplit("/", 1)[1]) + pos})
    assert view.code == ResponseCode.SUCCESS, view.remark      # (a half there: its COMMIT refused, corrupt)
    assert kept_after_cut == 0, "a kept record the log was cut below is counted"
    assert b.stop() == 0


@bounded(120)
async def test_a_slave_copying_a_record_whose_transaction_type_bit_flipped_serves_it(broker_factory, tmp_path):
    """The master's start reads the record with the bit put back, but its bytes keep the flipped bit: a slave
    copying them (a new one, or one catching up) gave the record no unit, a blank at its offset, and served 59 of
    60 without a word. The same QUEUEOFFSET rule: a type stored with no unit never carries a non-zero one."""
    from tests.integration.test_replication import _fetch_queues_once_routed, _log_end
    ha = ("--broker-role", "ASYNC_MASTER", "--ha-port", "0", "--ha-heartbeat-interval-ms", "500")
    b = broker_factory(*FLAGS, *ha, store="master")
    plain, _, _ = await _load(b)
    b.kill()
    path = _newest(tmp_path / "master")
    mine = [r for r in _records(path) if r[2] == "TornPlain"]
    _flip(path, mine[len(mine) // 2][0] + 39, 0x04)
    master = broker_factory(*FLAGS, *ha, store="master")
    end = await _log_end(master.broker)
    slave = broker_factory(*FLAGS, "--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                           "--ha-heartbeat-interval-ms", "500", store="slave")
    async with asyncio.timeout(30):
        while await _log_end(slave.broker) < end:
            await asyncio.sleep(0.1)
        route = PullConsumer(slave.namesrv, "CG_route")
        try:
            await _fetch_queues_once_routed(route, "TornPlain")
        finally:
            await route.shutdown()
    got, errors = await _delivered(slave, "TornPlain")
    assert sorted(got) == plain and not errors, (len(got), errors)
    assert "the bit 0x4 is damaged" in slave.log()


def _timers_delivered(b) -> float:
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("txmq_schedule_delivered_total{") and 'level="timer"' in line)


@pytest.mark.parametrize("kind", ["plain", "committed"])     # NOT made PREPARED; COMMIT made ROLLBACK
@bounded(120)
async def test_a_timer_whose_transaction_type_bit_flipped_is_delivered_as_served(broker_factory, tmp_path, kind):
    """A message waiting in the timer topic (__STARTDELIVERTIME) whose SYSFLAG bit 0x4 flipped at rest: the start
    reads it with the bit put back and gives it its timer-queue unit, so the scheduler delivers it; but the
    delivery copied the record's SYSFLAG as stored, PREPARED or ROLLBACK, types the store gives no unit: the
    message was written to its topic and served to no one, counted delivered, unsaid (1 of 2 pulled)."""
    import time
    b = broker_factory(*FLAGS)
    at = int(time.time() * 1000) + 3000
    props = {"__STARTDELIVERTIME": str(at)}
    if kind == "plain":
        async with Producer(b.namesrv, "PG_torn_timer") as producer:
            for i in range(2):
                await producer.send("TornTimer", b"timer-%03d" % i, properties=props)
    else:
        class Commits:
            def execute_local_transaction(self, msg, arg):
                return S.COMMIT_MESSAGE

            async def check_local_transaction(self, msg):
                return S.COMMIT_MESSAGE

        async with TransactionProducer(b.namesrv, "PG_torn_timer", Commits()) as producer:
            for i in range(2):
                await producer.send_in_transaction("TornTimer", b"timer-%03d" % i, properties=props)
    b.kill()
    assert time.time() * 1000 < at, "too slow: the timers were due before the damage"
    path = _newest(tmp_path / "store")
    timers = [r for r in _records(path) if r[2] == "rmq_sys_wheel_timer"]
    assert len(timers) == 2, timers
    _flip(path, timers[1][0] + 39, 0x04)        # the second: its queue's next offset is 1, not 0

    b = broker_factory(*FLAGS)
    async with asyncio.timeout(30):
        while _timers_delivered(b) < 2:
            await asyncio.sleep(0.1)
    got, errors = await _delivered(b, "TornTimer")
    assert sorted(got) == [b"timer-000", b"timer-001"] and not errors, (got, errors)
    assert b.stop() == 0


@bounded(120)
async def test_a_served_record_whose_transaction_type_bit_flipped_can_be_sent_back(broker_factory, tmp_path):
    """The start serves a plain record whose bit 0x4 flipped (read PREPARED) with the bit put back, but a consumer
    that failed it and handed it back (CONSUMER_SEND_MSG_BACK) was refused MESSAGE_ILLEGAL "a record of topic
    TornPlain, which no consumer is given" (counted send-back-unconsumable): the send-back read the type from the
    log as stored. One the store gives a unit, and serves, is a consumer's to hand back."""
    b = broker_factory(*FLAGS)
    await _load(b)
    b.kill()
    path = _newest(tmp_path / "store")
    mine = [r for r in _records(path) if r[2] == "TornPlain"]
    pos = mine[len(mine) // 2][0]
    _flip(path, pos + 39, 0x04)

    b = broker_factory(*FLAGS)
    got, errors = await _delivered(b, "TornPlain")
    assert len(got) == PLAIN and not errors
    phys = int(os.path.basename(path)) + pos
    resp = await _request(b.broker, RequestCode.CONSUMER_SEND_MSG_BACK, {
        "offset": phys, "group": "CG_torn", "delayLevel": 0, "originMsgId": "", "originTopic": "TornPlain",
        "maxReconsumeTimes": 16})
    assert resp.code == ResponseCode.SUCCESS, (resp.code, resp.remark)
    assert b.stop() == 0


def _checkpoint_above(store_dir, path: str) -> int:
    """The checkpoint as a broker left running a second longer leaves it: past every record of ``path`` (the
    newest segment). Its flushed offset."""
    data = open(path, "rb").read()
    end = int(os.path.basename(path)) + len(data.rstrip(b"\0"))
    point = read_checkpoint(str(store_dir)) or Checkpoint(0, 0)
    write_checkpoint(str(store_dir), point._replace(flushed_offset=max(point.flushed_offset, end)))
    return end


@bounded(120)
async def test_a_flipped_topic_byte_below_the_checkpoint_is_not_lost_silently(broker_factory, tmp_path):
    """TOPIC lies outside the body CRC, and a start judged it only past the checkpoint: a byte flipped at rest
    below it ('TornPlain' read 'T/rnPlain') was read as sound. The message was filed under the damaged name, where
    no consumer pulls: 59 of 60 served, no RECORD_CORRUPT, no count, and every later record of its queue had its
    QUEUEOFFSET rewritten one down on disk (7 ERRORs 'its header is damaged; rewritten'). Now a start refuses it,
    naming it, as past the checkpoint, and --keep-corrupt-records keeps it in its own queue."""
    plain, path, pos, body, qid = await _a_plain_record_mid_log(broker_factory, tmp_path)
    _flip(path, pos + 88 + len(body) + 1 + 1, 0x40)        # its topic's 'o' -> '/' (IPv4 hosts)
    assert _checkpoint_above(tmp_path / "store", path) > int(os.path.basename(path)) + pos

    text = _refused(tmp_path / "store")
    assert f"segment {os.path.basename(path)} byte {pos}" in text and "--keep-corrupt-records" in text, text

    b = broker_factory(*FLAGS, "--keep-corrupt-records")
    got, errors = await _delivered(b, "TornPlain")
    lost = body[:10].rstrip(b"\0")
    assert sorted(got) == [p for p in plain if p != lost], f"{len(got)} of {len(plain) - 1}; {errors}"
    assert len(errors) == 1 and "corrupt" in errors[0], errors
    assert _kept_count(b) == 1
    assert b.stop() == 0
    text = b.log()
    assert "its header is damaged; rewritten" not in text, [x for x in text.splitlines() if "rewritten" in x][:3]
    assert f"a pull of TornPlain-{qid} stops at offset" in text, text



@bounded(240)
async def test_a_flipped_topic_byte_in_a_segment_the_start_does_not_verify_is_refused_not_served(broker_factory,
                                                                                                  tmp_path):
    """A start verifies only the newest segments; reads of older ones check each record (record_intact) for a
    body CRC and zeroed bytes, not for a TOPIC byte flipped at rest ('TornPlain' read 'T/rnPlain'): the pull served
    it under a topic no one sent, counted nowhere, and a slave refused the master's chunk holding it, reconnecting
    with a WARNING every second for ever. Now the read refuses it as a flipped body bit: RECORD_CORRUPT, counted,
    and the master says so instead of sending it."""
    from tests.integration.test_replication import _log_end
    ha = ("--broker-role", "ASYNC_MASTER", "--ha-port", "0", "--ha-heartbeat-interval-ms", "500")
    plain, path, pos, body, qid = await _a_plain_record_mid_log(broker_factory, tmp_path)
    b = broker_factory(*FLAGS)
    async with Producer(b.namesrv, "PG_torn") as producer:     # 6 newer segments (64 KiB each)
        for i in range(400):
            await producer.send("TornFiller", b"f" * 1000)
    assert b.stop() == 0
    segments = sorted(os.listdir(tmp_path / "store" / "commitlog"))
    assert segments.index(os.path.basename(path)) < len(segments) - 4, segments
    _flip(path, pos + 88 + len(body) + 1 + 1, 0x40)        # its topic's 'o' -> '/' (IPv4 hosts)

    b = broker_factory(*FLAGS, *ha)
    got, errors = await _delivered(b, "TornPlain")
    lost = body[:10].rstrip(b"\0")
    assert sorted(got) == [p for p in plain if p != lost], f"{len(got)} of {len(plain) - 1}; {errors}"
    assert len(errors) == 1 and "corrupt" in errors[0], errors
    assert _corrupt_count(b, "pull") == 1
    slave = broker_factory(*FLAGS, "--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", b.ha,
                           "--ha-heartbeat-interval-ms", "500", store="slave")
    phys = int(os.path.basename(path)) + pos
    async with asyncio.timeout(60):
        while await _log_end(slave.broker) < phys:
            await asyncio.sleep(0.1)
    async with asyncio.timeout(60):         # said once, by the master, whose disk holds the damage
        while f"replication stops at offset {phys}, a corrupt record" not in b.log():
            await asyncio.sleep(0.1)
    assert await _log_end(slave.broker) == phys
    assert not [x for x in slave.log().splitlines() if "txmq.ha" in x and "WARNING" in x], slave.log()[-2000:]
    assert b.stop() == 0 and slave.stop() == 0


@bounded(240)
async def test_a_slave_stopped_at_a_flipped_topic_in_an_old_segment_gets_past_it_by_the_documented_way(
        broker_factory, tmp_path):
    """A master refuses to replicate a record of a segment its start does not verify whose TOPIC byte flipped at
    rest, and no flag made its start look there: the slave stayed at that offset until retention removed the
    segment. docs/operations.md's way out: stop the master, remove its checkpoint (the start then verifies the
    whole log), start it with --keep-corrupt-records: the record is kept, sent to the slave alone, and the slave
    copies on past it."""
    from tests.integration.test_replication import _log_end
    ha = ("--broker-role", "ASYNC_MASTER", "--ha-port", "0", "--ha-heartbeat-interval-ms", "500")
    _plain, path, pos, body, _qid = await _a_plain_record_mid_log(broker_factory, tmp_path)
    b = broker_factory(*FLAGS)
    async with Producer(b.namesrv, "PG_torn") as producer:     # 6 newer segments (64 KiB each)
        for i in range(400):
            await producer.send("TornFiller", b"f" * 1000)
    assert b.stop() == 0
    _flip(path, pos + 88 + len(body) + 1 + 1, 0x40)        # its topic's 'o' -> '/' (IPv4 hosts)
    phys = int(os.path.basename(path)) + pos

    b = broker_factory(*FLAGS, *ha)
    slave = broker_factory(*FLAGS, "--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", b.ha,
                           "--ha-heartbeat-interval-ms", "500", store="slave")
    async with asyncio.timeout(60):
        while f"replication stops at offset {phys}, a corrupt record" not in b.log():
            await asyncio.sleep(0.1)
        # said when its reader reaches the record: the bytes before it may still be on their way to the slave
        while await _log_end(slave.broker) < phys:
            await asyncio.sleep(0.1)
    assert await _log_end(slave.broker) == phys
    end = await _log_end(b.broker)
    assert b.stop() == 0 and slave.stop() == 0

    os.remove(tmp_path / "store" / "checkpoint")
    b = broker_factory(*FLAGS, *ha, "--keep-corrupt-records")
    assert _kept_count(b) == 1
    slave = broker_factory(*FLAGS, "--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", b.ha,
                           "--ha-heartbeat-interval-ms", "500", store="slave")
    async with asyncio.timeout(60):
        while await _log_end(slave.broker) < end:
            await asyncio.sleep(0.1)
    assert b.stop() == 0 and slave.stop() == 0


@bounded(240)
async def test_a_flipped_topic_byte_in_an_old_segment_is_refused_by_a_rebuilt_queue(broker_factory, tmp_path):
    """A queue whose files were lost is rebuilt from the whole log, old segments too, where the start judges no
    TOPIC: a record whose TOPIC byte flipped at rest there was taken for another queue's, the next record of its
    queue for damage ('its header is damaged; rewritten' on disk, each later one down), the message skipped
    without a word. Now the rebuild files it where its queue misses it, and a pull stops at it (RECORD_CORRUPT)."""
    plain, path, pos, body, qid = await _a_plain_record_mid_log(broker_factory, tmp_path)
    b = broker_factory(*FLAGS)
    async with Producer(b.namesrv, "PG_torn") as producer:     # 6 newer segments (64 KiB each)
        for i in range(400):
            await producer.send("TornFiller", b"f" * 1000)
        # one of its queue in the verified range: the scan finds the queue's units missing, and rebuilds it
        await producer.send("TornPlain", b"plain-late", queue=MessageQueue("TornPlain", "broker-a", qid))
    assert b.stop() == 0
    segments = sorted(os.listdir(tmp_path / "store" / "commitlog"))
    assert segments.index(os.path.basename(path)) < len(segments) - 4, segments
    _flip(path, pos + 88 + len(body) + 1 + 1, 0x40)        # its topic's 'o' -> '/' (IPv4 hosts)
    shutil.rmtree(tmp_path / "store" / "consumequeue" / "TornPlain" / str(qid))

    b = broker_factory(*FLAGS)
    got, errors = await _delivered(b, "TornPlain")
    lost = body[:10].rstrip(b"\0")
    assert sorted(got) == sorted([p for p in plain if p != lost] + [b"plain-late"]), f"{len(got)} of {len(plain) - 1}; {errors}"
    assert len(errors) == 1 and "corrupt" in errors[0], errors
    assert b.stop() == 0
    text = b.log()
    assert "its header is damaged; rewritten" not in text, [x for x in text.splitlines() if "rewritten" in x][:3]
