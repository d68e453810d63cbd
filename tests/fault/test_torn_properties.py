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
from producer import Producer, SendStatus, TransactionProducer
from protocol.codes import RequestCode
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


def _older_brokers_nul(store) -> None:
    """Make the last record one an older txmq stored (it took a NUL in a property value, as RocketMQ does):
    its KEYS value's last character becomes a NUL (no CRC covers it), and the store loses the nul_free_from
    file, which no older broker wrote."""
    path, pos, size = _last_record(store)
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


@bounded(60)
async def test_a_send_back_does_not_copy_an_older_brokers_nul_past_nul_free_from(tmp_path):
    # Served as it lies, an older broker's record with a NUL in its properties must not be copied to the log's
    # end (a retry, a scheduled delivery, a commit): past nul_free_from it reads as torn at the next start after
    # a crash -- cut if last, the start refused if anything follows.
    store = tmp_path / "store"
    [res] = await _sent_and_stopped(store, "old", 1)
    _older_brokers_nul(store)
    offset = decode_offset_msg_id(res.offset_msg_id)[2]

    broker = BrokerProcess(store).start()
    try:
        nul_free_from = int((store / "nul_free_from").read_text())
        host, _, port = broker.broker.rpartition(":")
        conn = await open_connection(host, int(port))
        try:
            resp = await conn.request(RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
                "offset": offset, "group": "CG_torn", "delayLevel": 0, "originMsgId": res.msg_id,
                "originTopic": TOPIC, "maxReconsumeTimes": 16}), 5)
        finally:
            conn.close()
    finally:
        assert broker.stop() == 0
    assert resp.code != 0               # refused: the consumer consumes it again later
    assert _nul_records_from(store, nul_free_from) == [], broker.log()
