"""A record torn after its body: header and body CRC intact, topic or properties zero-filled.

BODYCRC covers the body only. Segments are preallocated with zeros and written through the
mapping, so after a crash the pages of an unacknowledged record reach disk in any order: the
last record can keep a valid head and body while its topic or properties read as zeros. A real
broker stores a few messages and stops; the last record is damaged that way and the checkpoint
removed (a crash comes before the checkpoint covers what it tears); a broker starts on it.

Recovery must cut that record like any torn tail: the consumer gets the messages before it,
each with its properties as sent, and never the damaged one; a torn half is not left pending.
"""
from __future__ import annotations

import asyncio
import json
import os
import struct

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState, Producer, SendStatus, TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import MESSAGE_MAGIC, Prop, decode_offset_msg_id
from protocol.record import RECORD_HEAD, read_index_fields
from tests.support.bounded import bounded
from tests.fault.test_disk_full import _metric
from tests.fault.test_transactions_kill import Ledger
from tests.support.broker_process import BrokerProcess

pytestmark = [pytest.mark.asyncio]

TOPIC = "TornTail"
SENT = 4
SEGMENT = 1 << 30       # the broker's default segment_size: the tests' logs are all in the first segment


def _last_record(store) -> tuple[str, int, int]:
    """(segment path, position, size) of the last record of the commit log."""
    folder = store / "commitlog"
    last = None
    for name in sorted(os.listdir(folder)):
        data = (folder / name).read_bytes()
        pos = 0
        while pos + 8 <= len(data):
            size, magic = struct.unpack_from(">ii", data, pos)
            if magic != MESSAGE_MAGIC:
                break
            last = (str(folder / name), pos, size)
            pos += size
    return last


def _zero(path: str, lo: int, hi: int) -> None:
    with open(path, "r+b") as f:
        f.seek(lo)
        f.write(bytes(hi - lo))


def _tear(store, how: str) -> None:
    """Zero part of the last record after its body, as a crash that lost those pages would."""
    path, pos, size = _last_record(store)
    with open(path, "rb") as f:
        f.seek(pos)
        rec = f.read(size)
    sys_flag = RECORD_HEAD.unpack_from(rec, 0)[-1]
    _ts, _p, topic, (props_at, props_len) = read_index_fields(rec, 0, size, sys_flag)
    topic_at = props_at - 2 - len(topic)
    if how == "properties cut in the middle":
        _zero(path, pos + props_at + props_len // 2, pos + size)
    elif how == "properties all zeros":
        _zero(path, pos + props_at, pos + size)
    elif how == "topic zeros":
        _zero(path, pos + topic_at, pos + topic_at + len(topic))
    os.unlink(store / "checkpoint")


async def _delivered(namesrv: str) -> list:
    consumer = PullConsumer(namesrv, "CG_torn")
    out = []
    try:
        for mq in await consumer.fetch_queues(TOPIC):
            offset = 0
            while True:
                res = await consumer.pull(mq, offset, max_nums=64)
                out += res.messages
                if res.next_begin_offset == offset or not res.messages:
                    break
                offset = res.next_begin_offset
    finally:
        await consumer.shutdown()
    return out


@pytest.mark.parametrize("how", ["properties cut in the middle", "properties all zeros", "topic zeros"])
@bounded(60)
async def test_a_record_torn_after_its_body_is_cut_not_delivered(tmp_path, how):
    store = tmp_path / "store"
    broker = BrokerProcess(store).start()
    sent = {}
    try:
        producer = Producer(broker.namesrv, "PG_torn", retries=0)
        await producer.start()
        try:
            for i in range(SENT):
                body = f"torn-{i}".encode()
                res = await producer.send(TOPIC, body, tags="TagA", keys=f"key-{i}")
                sent[body] = res.msg_id
        finally:
            await producer.shutdown()
    finally:
        assert broker.stop() == 0
    _tear(store, how)

    broker = BrokerProcess(store).start()
    try:
        got = await _delivered(broker.namesrv)
        cuts = _metric(broker.metrics, "txmq_store_tail_truncations_total")
    finally:
        broker.kill()
    log = broker.log()
    seen = [(bytes(m.body), m.topic, m.properties.get(Prop.UNIQ_KEY), m.tags, m.keys) for m in got]
    kept = [(b, TOPIC, sent[b], "TagA", f"key-{i}") for i, b in enumerate(sent) if i < SENT - 1]
    assert sorted(seen) == sorted(kept), log
    assert "torn tail" in log and cuts == 1, log


async def _pending_rows(addr: str) -> list[dict]:
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 100}), 5)
        return json.loads(resp.body_bytes())["pending"]
    finally:
        conn.close()


@bounded(60)
async def test_a_half_torn_after_its_body_is_cut_not_left_pending(tmp_path):
    # The half's PGROUP, REAL_TOPIC and UNIQ_KEY are in its properties: kept torn, it came back pending with
    # group "" and was deferred for ever (no producer of group "" to ask).
    store = tmp_path / "store"
    flags = ("--transaction-check-interval-ms", "600000", "--transaction-timeout-ms", "600000")
    ledger = Ledger(seed=1)
    broker = BrokerProcess(store, *flags).start()
    try:
        tx = TransactionProducer(broker.namesrv, "PG_torn_tx", ledger, retries=0)
        await tx.start()
        try:
            for body in (b"half-0", b"half-1"):
                ledger.plan[body] = "unknown-commit"
                await tx.send_in_transaction("TornTx", body)
        finally:
            await tx.shutdown()
        before = await _pending_rows(broker.broker)
    finally:
        assert broker.stop() == 0
    assert len(before) == 2
    _tear(store, "properties cut in the middle")        # the second half: the log's last record

    broker = BrokerProcess(store, *flags).start()
    try:
        after = await _pending_rows(broker.broker)
    finally:
        broker.kill()
    first = min(before, key=lambda r: r["commit_log_offset"])
    assert [(r["group"], r["uniq_key"]) for r in after] == [("PG_torn_tx", first["uniq_key"])], after


@bounded(60)
async def test_a_check_record_naming_a_client_id_with_a_nul_survives_a_restart_past_the_checkpoint(tmp_path):
    # The broker writes the half's sender's client id into each check op record (TXMQ_OWNER). A client names
    # itself (a heartbeat's clientID is JSON, "\u0000" is a NUL): written with a NUL, the acknowledged check
    # record read as torn at the next start past the checkpoint, and with the commit after it the broker
    # refused to start ("damaged in the middle").
    store = tmp_path / "store"
    flags = ("--transaction-check-interval-ms", "200", "--transaction-timeout-ms", "500")
    ledger = Ledger(seed=1)
    broker = BrokerProcess(store, *flags).start()
    try:
        tx = TransactionProducer(broker.namesrv, "PG_torn_owner", ledger, retries=0, instance_name="nul\x00id")
        await tx.start()
        try:
            ledger.plan[b"checked"] = "unknown-commit"      # undecided at first: decided by the check
            await tx.send_in_transaction("TornOwner", b"checked")
            while await _pending_rows(broker.broker):
                await asyncio.sleep(0.05)       # polling a condition; @bounded caps it
        finally:
            await tx.shutdown()
    finally:
        assert broker.stop() == 0
    os.unlink(store / "checkpoint")     # a crash before the checkpoint covered them

    broker = BrokerProcess(store, *flags).start()
    try:
        cuts = _metric(broker.metrics, "txmq_store_tail_truncations_total")
        pending = await _pending_rows(broker.broker)
    finally:
        broker.kill()
    assert cuts == 0 and pending == [], broker.log()


async def _sent_and_stopped(store, prefix: str, count: int = SENT) -> list:
    """A broker on ``store`` takes ``count`` messages (``prefix``-i, tag TagA, key-i) and stops cleanly;
    their send results."""
    broker = BrokerProcess(store).start()
    try:
        producer = Producer(broker.namesrv, "PG_torn", retries=0)
        await producer.start()
        try:
            return [await producer.send(TOPIC, f"{prefix}-{i}".encode(), tags="TagA", keys=f"key-{i}")
                    for i in range(count)]
        finally:
            await producer.shutdown()
    finally:
        assert broker.stop() == 0


def _older_brokers_nul(store, at: int | None = None) -> None:
    """Make the record at log offset ``at`` (the last record if None) one an older txmq stored (it took a NUL
    in a property value, as RocketMQ does): its KEYS value's last character becomes a NUL (no CRC covers it),
    and the store loses the nul_free_from file, which no older broker wrote."""
    if at is None:
        path, pos, size = _last_record(store)
    else:
        path, pos = str(store / "commitlog" / f"{at - at % SEGMENT:020d}"), at % SEGMENT
        with open(path, "rb") as f:
            f.seek(pos)
            size = struct.unpack(">i", f.read(4))[0]
    with open(path, "rb") as f:
        f.seek(pos)
        rec = f.read(size)
    sys_flag = RECORD_HEAD.unpack_from(rec, 0)[-1]
    _ts, _p, _topic, (props_at, props_len) = read_index_fields(rec, 0, size, sys_flag)
    at = rec.index(b"KEYS\x01", props_at, props_at + props_len) + 5
    at = rec.index(b"\x02", at) - 1 if b"\x02" in rec[at:props_at + props_len] else props_at + props_len - 1
    _zero(path, pos + at, pos + at + 1)
    (store / "nul_free_from").unlink(missing_ok=True)


@pytest.mark.parametrize("crashed", [False, True])
@bounded(60)
async def test_a_nul_an_older_broker_stored_in_properties_is_delivered_after_the_upgrade(tmp_path, crashed):
    # Older txmq stored a NUL in a property value (RocketMQ does). Read as a torn page, that acknowledged
    # message was refused on every verified read (RECORD_CORRUPT: the queue stuck at it) and, after a crash
    # of the older broker (its checkpoint behind it), cut at the upgraded broker's start.
    store = tmp_path / "store"
    await _sent_and_stopped(store, "old")
    _older_brokers_nul(store)
    if crashed:
        os.unlink(store / "checkpoint")

    broker = BrokerProcess(store, "--verify-all-reads").start()
    try:
        got = await _delivered(broker.namesrv)
        cuts = _metric(broker.metrics, "txmq_store_tail_truncations_total")
    finally:
        broker.kill()
    assert sorted(bytes(m.body) for m in got) == [f"old-{i}".encode() for i in range(SENT)], broker.log()
    assert cuts == 0, broker.log()


@bounded(90)
async def test_a_slave_keeps_its_masters_record_with_a_nul_across_a_crash(tmp_path):
    # A slave copies its master's bytes, whatever they hold: a record an older txmq (or a RocketMQ) master
    # stored with a NUL in a property value was read by the slave's next start, past its checkpoint, as torn,
    # and with records after it the slave refused to start ("damaged in the middle").
    master_store, slave_store = tmp_path / "master", tmp_path / "slave"
    await _sent_and_stopped(master_store, "old")
    _older_brokers_nul(master_store)

    master = BrokerProcess(master_store, "--broker-role", "SYNC_MASTER", "--ha-port", "0",
                           "--ha-heartbeat-interval-ms", "500").start()
    slave_flags = ("--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                   "--ha-heartbeat-interval-ms", "500")
    slave = BrokerProcess(slave_store, *slave_flags).start()
    try:
        producer = Producer(master.namesrv, "PG_torn", retries=0)
        await producer.start()
        try:
            while (await producer.send(TOPIC, b"after")).status is not SendStatus.SEND_OK:
                await asyncio.sleep(0.1)    # until the slave confirms: it then holds the whole log
        finally:
            await producer.shutdown()
        slave.kill()
        (slave_store / "checkpoint").unlink(missing_ok=True)    # the crash came before its checkpoint
        slave = BrokerProcess(slave_store, *slave_flags).start()
        cuts = _metric(slave.metrics, "txmq_store_tail_truncations_total")
    finally:
        slave.kill()
        master.kill()
    assert cuts == 0, slave.log()


def _nul_records_from(store, lo: int) -> list[tuple[int, str]]:
    """(offset, topic) of the commit-log records at or after ``lo`` whose properties hold a NUL."""
    out = []
    for name in sorted(os.listdir(store / "commitlog")):
        data = (store / "commitlog" / name).read_bytes()
        pos = 0
        while pos + 8 <= len(data):
            size, magic = struct.unpack_from(">ii", data, pos)
            if magic != MESSAGE_MAGIC:
                break
            sys_flag = RECORD_HEAD.unpack_from(data, pos)[-1]
            _ts, _p, topic, (at, n) = read_index_fields(data, pos, size, sys_flag)
            if int(name) + pos >= lo and b"\x00" in data[at:at + n]:
                out.append((int(name) + pos, topic))
            pos += size
    return out


async def _request(addr: str, code: int, fields: dict) -> RemotingCommand:
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        return await conn.request(RemotingCommand.request(code, fields), 5)
    finally:
        conn.close()


def _killed_before_its_checkpoint(broker: BrokerProcess) -> None:
    """SIGKILL, and the checkpoint gone: the crash came before a checkpoint covered what was just written, so
    the next start judges those records as a torn tail may be."""
    broker.kill()
    (broker.store_dir / "checkpoint").unlink(missing_ok=True)


def _copies_past_the_mark(store) -> list[tuple[int, str]]:
    """The records with a NUL in their properties at or past the store's nul_free_from (read as torn there)."""
    return _nul_records_from(store, int((store / "nul_free_from").read_text()))


async def _consumed(namesrv: str, topic: str, group: str = "CG_torn") -> list:
    consumer = PullConsumer(namesrv, group)
    out = []
    try:
        for mq in await consumer.fetch_queues(topic):
            res = await consumer.pull(mq, 0, max_nums=64)
            out += res.messages
    finally:
        await consumer.shutdown()
    return out


@bounded(90)
async def test_a_send_back_copies_an_older_brokers_nul_and_it_survives_a_crash(tmp_path):
    # A consumer sends back a message an older broker stored with a NUL in a property value: its dead letter (a
    # copy at the log's end) was refused, as past nul_free_from the NUL reads as torn at the next start after a
    # crash (cut if last, the start refused if anything follows); the consumer was told to consume it again, for
    # ever. Now the mark moves past the copy before it is written: acknowledged, it survives a kill -9.
    store = tmp_path / "store"
    [res] = await _sent_and_stopped(store, "old", 1)
    _older_brokers_nul(store)
    offset = decode_offset_msg_id(res.offset_msg_id)[2]

    broker = BrokerProcess(store).start()
    try:
        resp = await _request(broker.broker, RequestCode.CONSUMER_SEND_MSG_BACK, {
            "offset": offset, "group": "CG_torn", "delayLevel": 0, "originMsgId": res.msg_id,
            "originTopic": TOPIC, "maxReconsumeTimes": 0})      # no retries left: to %DLQ%CG_torn at once
    finally:
        _killed_before_its_checkpoint(broker)
    assert resp.code == ResponseCode.SUCCESS, (resp.remark, broker.log())
    assert _copies_past_the_mark(store) == [], broker.log()

    broker = BrokerProcess(store).start()
    try:
        got = await _consumed(broker.namesrv, "%DLQ%CG_torn")
        cuts = _metric(broker.metrics, "txmq_store_tail_truncations_total")
    finally:
        broker.kill()
    assert cuts == 0, broker.log()
    assert [(bytes(m.body), m.properties.get("KEYS")) for m in got] == [(b"old-0", "key-\x00")], broker.log()


async def _older_half(store, delay_ms: int = 0) -> tuple[int, dict]:
    """A half an older broker on ``store`` took (its KEYS value ending in a NUL) and left undecided, the
    broker stopped: (its log offset, the END_TRANSACTION fields that commit it)."""
    broker = BrokerProcess(store, "--transaction-timeout-ms", str(3600 * 1000)).start()
    try:
        producer = TransactionProducer(broker.namesrv, "PG_torn", _Undecided(), retries=0)
        await producer.start()
        try:
            props = {"TIMER_DELAY_MS": str(delay_ms)} if delay_ms else None     # (a client drops DELAY of a half)
            sent = await producer.send_in_transaction(TOPIC, b"old-half", keys="key-0", properties=props)
        finally:
            await producer.shutdown()
    finally:
        assert broker.stop() == 0
    offset = decode_offset_msg_id(sent.send_result.offset_msg_id)[2]
    _older_brokers_nul(store, offset)
    return offset, {"producerGroup": "PG_torn", "tranStateTableOffset": str(sent.send_result.queue_offset),
                    "commitLogOffset": str(offset), "commitOrRollback": "8", "fromTransactionCheck": "false",
                    "msgId": sent.send_result.msg_id, "transactionId": sent.send_result.msg_id}


class _Undecided:
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.UNKNOW

    def check_local_transaction(self, msg):
        return LocalTransactionState.UNKNOW


@bounded(90)
async def test_a_half_an_older_broker_stored_with_a_nul_is_committed_and_survives_a_crash(tmp_path):
    # After the upgrade, the COMMIT of a half an older broker stored with a NUL in a property value was refused
    # (the copy, past nul_free_from, would read as torn after a crash): checked, then dead-lettered, the
    # producer's COMMIT lost. Now it is committed, and the committed message survives a kill -9 right after.
    store = tmp_path / "store"
    _offset, commit = await _older_half(store)
    flags = ("--transaction-timeout-ms", str(3600 * 1000))
    broker = BrokerProcess(store, *flags).start()
    try:
        resp = await _request(broker.broker, RequestCode.END_TRANSACTION, commit)
    finally:
        _killed_before_its_checkpoint(broker)
    assert resp.code == ResponseCode.SUCCESS, (resp.remark, broker.log())
    assert _copies_past_the_mark(store) == [], broker.log()

    broker = BrokerProcess(store, *flags).start()
    try:
        got = await _consumed(broker.namesrv, TOPIC)
        cuts = _metric(broker.metrics, "txmq_store_tail_truncations_total")
        pending = await _pending_rows(broker.broker)
    finally:
        broker.kill()
    assert cuts == 0 and pending == [], broker.log()
    assert [(bytes(m.body), m.properties.get("KEYS")) for m in got] == [(b"old-half", "key-\x00")], broker.log()


@bounded(90)
async def test_a_delayed_half_an_older_broker_stored_with_a_nul_is_delivered_and_survives_a_crash(tmp_path):
    # A delayed transaction's COMMIT copies the half to the timer topic, and its delivery copies that again to
    # the real topic: both copies carry the older broker's NUL, and both must stay behind nul_free_from.
    store = tmp_path / "store"
    _offset, commit = await _older_half(store, delay_ms=1)
    flags = ("--transaction-timeout-ms", str(3600 * 1000))
    broker = BrokerProcess(store, *flags).start()
    try:
        resp = await _request(broker.broker, RequestCode.END_TRANSACTION, commit)
        assert resp.code == ResponseCode.SUCCESS, (resp.remark, broker.log())
        while not await _consumed(broker.namesrv, TOPIC):      # until delivered (a millisecond after the commit)
            await asyncio.sleep(0.05)
    finally:
        _killed_before_its_checkpoint(broker)
    assert _copies_past_the_mark(store) == [], broker.log()

    broker = BrokerProcess(store, *flags).start()
    try:
        got = await _consumed(broker.namesrv, TOPIC)
        cuts = _metric(broker.metrics, "txmq_store_tail_truncations_total")
    finally:
        broker.kill()
    assert cuts == 0, broker.log()
    assert [(bytes(m.body), m.properties.get("KEYS")) for m in got] == [(b"old-half", "key-\x00")], broker.log()


@bounded(90)
async def test_a_half_an_older_broker_stored_with_a_nul_is_dead_lettered_whole_and_survives_a_crash(tmp_path):
    # Checked to its limit, such a half was dead-lettered as the op record alone ("the half is corrupt, no dead
    # letter copied"): the message was nowhere an operator looks. Now its dead letter is copied, NUL and all.
    store = tmp_path / "store"
    await _older_half(store)
    flags = ("--transaction-check-interval-ms", "200", "--transaction-timeout-ms", "200",
             "--transaction-check-max", "1")
    broker = BrokerProcess(store, *flags).start()
    try:
        producer = TransactionProducer(broker.namesrv, "PG_torn", _Undecided(), retries=0)
        await producer.start()
        try:
            while True:         # polling the broker's own count; @bounded caps it
                listed = await _request(broker.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 100})
                if json.loads(listed.body_bytes())["dead_lettered"]:
                    break
                await asyncio.sleep(0.05)
        finally:
            await producer.shutdown()
    finally:
        _killed_before_its_checkpoint(broker)
    assert _copies_past_the_mark(store) == [], broker.log()

    broker = BrokerProcess(store, *flags).start()
    try:
        got = await _consumed(broker.namesrv, "TRANS_CHECK_MAX_TIME_TOPIC")
        cuts = _metric(broker.metrics, "txmq_store_tail_truncations_total")
    finally:
        broker.kill()
    assert cuts == 0, broker.log()
    assert [(bytes(m.body), m.properties.get("KEYS")) for m in got] == [(b"old-half", "key-\x00")], broker.log()


@bounded(90)
async def test_a_slave_keeps_its_masters_commit_of_an_older_nul_half_across_a_crash(tmp_path):
    # The master's copy lands behind its own moved mark; the slave, copying the master's bytes, moves its own
    # past it as for any record of its master's holding a NUL (replica.parse_chunk), so its next start after a
    # crash does not read the committed message as torn.
    master_store, slave_store = tmp_path / "master", tmp_path / "slave"
    _offset, commit = await _older_half(master_store)
    master = BrokerProcess(master_store, "--broker-role", "SYNC_MASTER", "--ha-port", "0",
                           "--ha-heartbeat-interval-ms", "500", "--transaction-timeout-ms", str(3600 * 1000)).start()
    slave_flags = ("--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                   "--ha-heartbeat-interval-ms", "500")
    slave = BrokerProcess(slave_store, *slave_flags).start()
    try:
        resp = await _request(master.broker, RequestCode.END_TRANSACTION, commit)
        assert resp.code == ResponseCode.SUCCESS, (resp.remark, master.log())
        producer = Producer(master.namesrv, "PG_torn", retries=0)
        await producer.start()
        try:
            while (await producer.send(TOPIC, b"after")).status is not SendStatus.SEND_OK:
                await asyncio.sleep(0.1)    # until the slave confirms: it then holds the whole log
        finally:
            await producer.shutdown()
        _killed_before_its_checkpoint(slave)
        assert _copies_past_the_mark(slave_store) == [], slave.log()
        slave = BrokerProcess(slave_store, *slave_flags).start()
        cuts = _metric(slave.metrics, "txmq_store_tail_truncations_total")
    finally:
        slave.kill()
        master.kill()
    assert cuts == 0, slave.log()
