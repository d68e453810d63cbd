"""Master-slave replication (RocketMQ HA) with real broker processes on loopback.

* A SYNC_MASTER acknowledges N sends (SEND_OK), is killed with SIGKILL right after the N-th, and a
  PullConsumer pointed at the slave reads all N; the slave's commit log equals the master's, byte for
  byte, over the acknowledged range.
* A SYNC_MASTER with no slave answers SLAVE_NOT_AVAILABLE, and has stored the message.
* A slave that is killed and restarted catches up from its own log end.
* A slave refuses sends and END_TRANSACTION as RocketMQ does.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
from pathlib import Path

import pytest

from consumer import PullConsumer
from consumer.pull_consumer import MessageQueue, PullStatus
from producer import Producer
from producer.producer import SendStatus
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import ConnectionPool
from protocol.errors import RequestTimeoutError, TopicNotExistError
from protocol.message import SendMessageRequestHeader, decode_offset_msg_id, peek_record

pytestmark = pytest.mark.asyncio

TOPIC = "Replicated"
SEGMENT = "0" * 20


def _master(broker_factory, role="SYNC_MASTER", **kw):
    return broker_factory("--broker-role", role, "--ha-port", "0", "--ha-heartbeat-interval-ms", "500",
                          store="master", **kw)


def _slave(broker_factory, master, store="slave"):
    return broker_factory("--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                          "--ha-heartbeat-interval-ms", "500", store=store)


async def _until_replicating(producer: Producer, timeout: float = 20.0) -> MessageQueue:
    """Send seeds until one comes back SEND_OK: the slave is connected and confirming. Returns the queue."""
    async with asyncio.timeout(timeout):
        while True:
            res = await producer.send(TOPIC, b"seed")
            if res.status is SendStatus.SEND_OK:
                return res.queue
            await asyncio.sleep(0.1)


async def _fetch_queues_once_routed(consumer: PullConsumer, topic: str) -> None:
    """The name server routes a topic once a broker has registered it: an auto-created topic (or one a slave got
    with the replicated records) comes with the broker's next registration, on a loaded machine not at once.
    Bounded by the caller's timeout."""
    while True:
        try:
            await consumer.fetch_queues(topic)
            return
        except TopicNotExistError:
            await asyncio.sleep(0.1)


async def _until_slave_has_offset(slave, group: str, mq: MessageQueue, offset: int, sound=lambda: True) -> None:
    """Ask the slave for ``group``'s offset of ``mq`` until it answers ``offset`` (copied from its master within
    a few sync intervals; bounded by the caller's timeout). ``sound()`` is asserted before each ask (a slow
    answer may go)."""
    query = RemotingCommand.request(RequestCode.QUERY_CONSUMER_OFFSET, {
        "consumerGroup": group, "topic": TOPIC, "queueId": mq.queue_id})
    pool = ConnectionPool()
    try:
        while True:
            assert sound(), slave.log()
            resp = await pool.request(slave.broker, query, 3.0)
            if resp.code == ResponseCode.SUCCESS and resp.int_field("offset") == offset:
                return
            await asyncio.sleep(0.1)
    finally:
        await pool.close()


SMALL_EXPIRING = ("--segment-size", str(1 << 20), "--max-message-size", str(64 * 1024),
                  "--file-reserved-hours", "0.0003", "--disk-clean-interval-s", "0.2", "--disk-refuse-ratio", "1.0")
CLEANS = ("--disk-clean-ratio", "0.0001", "--disk-force-clean-ratio", "0.9999")


def _expiring_master_slave(tmp_path, name: str, started: list, master_cleans=CLEANS, namesrv_flags=()):
    """A stand-alone name server, an ASYNC_MASTER (cleaning as ``master_cleans`` says) and its SLAVE under broker
    name ``name``, both with SMALL_EXPIRING segments, the slave cleaning; each process goes on ``started`` as it
    starts (the caller kills them)."""
    from tests.support.broker_process import BrokerProcess
    from tests.support.cluster_process import NamesrvProcess, cluster_flags

    ns = NamesrvProcess(tmp_path / "namesrv.log", *namesrv_flags).start()
    started.append(ns)
    master = BrokerProcess(tmp_path / "master", *cluster_flags(ns.addr, name, 500), "--broker-role", "ASYNC_MASTER",
                           "--ha-port", "0", *SMALL_EXPIRING, *master_cleans).start()
    started.append(master)
    slave = BrokerProcess(tmp_path / "slave", *cluster_flags(ns.addr, name, 500), "--broker-role", "SLAVE",
                          "--broker-id", "1", "--ha-master-addr", master.ha, "--slave-sync-interval-ms", "200",
                          *SMALL_EXPIRING, *CLEANS).start()
    started.append(slave)
    return ns, master, slave


async def _pull_all(namesrv: str, mq: MessageQueue, want: int, timeout: float = 20.0) -> list[bytes]:
    """Everything in ``mq`` from offset 0, waiting (long polls) until there are ``want`` messages."""
    async with PullConsumer(namesrv, "CG_replica") as consumer:
        bodies: list[bytes] = []
        async with asyncio.timeout(timeout):
            await _fetch_queues_once_routed(consumer, mq.topic)
            while len(bodies) < want:
                res = await consumer.pull(mq, len(bodies), max_nums=256, suspend_ms=1000)
                bodies += [m.body for m in res.messages]
        return bodies


def _log_bytes(store: Path, end: int) -> bytes:
    with open(store / "commitlog" / SEGMENT, "rb") as f:
        return f.read(end)


def _record_end(store: Path, phys: int) -> int:
    with open(store / "commitlog" / SEGMENT, "rb") as f:
        f.seek(phys)
        size, _magic = peek_record(f.read(8))
    return phys + size


async def test_slave_holds_every_message_its_sync_master_acknowledged(broker_factory, tmp_path):
    master = _master(broker_factory)
    assert master.ha, "a master with --ha-port prints ha=HOST:PORT on its LISTENING line"
    slave = _slave(broker_factory, master)
    n = 300
    async with Producer(master.namesrv, "PG_replica") as producer:
        mq = await _until_replicating(producer)
        seeds = (await producer.send(TOPIC, b"last-seed", queue=mq)).queue_offset
        acked = []
        for start in range(0, n, 30):           # 30 in flight at a time: many sends on one watermark
            results = await asyncio.gather(*(producer.send(TOPIC, f"m{i}".encode(), queue=mq)
                                             for i in range(start, start + 30)))
            assert [r.status for r in results] == [SendStatus.SEND_OK] * 30
            acked += results
    master.kill()                                # right after the N-th acknowledgement
    bodies = await _pull_all(slave.namesrv, mq, seeds + 1 + n)
    assert bodies[seeds + 1:] == [f"m{i}".encode() for i in range(n)]
    last = max(decode_offset_msg_id(r.offset_msg_id)[2] for r in acked)     # (host, port, offset)
    end = _record_end(tmp_path / "master", last)
    assert _log_bytes(tmp_path / "slave", end) == _log_bytes(tmp_path / "master", end)


async def test_sync_master_without_slave_answers_slave_not_available(broker_factory):
    master = _master(broker_factory)
    async with Producer(master.namesrv, "PG_alone") as producer:
        res = await producer.send(TOPIC, b"kept anyway")
        assert res.status is SendStatus.SLAVE_NOT_AVAILABLE
        assert res.offset_msg_id and res.queue_offset >= 0     # the header is filled as for SEND_OK
        mq = res.queue
    assert await _pull_all(master.namesrv, mq, res.queue_offset + 1) == [b"kept anyway"]


async def test_restarted_slave_catches_up_from_its_own_end(broker_factory, tmp_path):
    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    async with Producer(master.namesrv, "PG_catchup") as producer:
        first = await producer.send(TOPIC, b"m0")
        mq = first.queue
        for i in range(1, 50):
            await producer.send(TOPIC, f"m{i}".encode(), queue=mq)
        assert await _pull_all(slave.namesrv, mq, 50) == [f"m{i}".encode() for i in range(50)]
        slave.kill()
        for i in range(50, 120):
            res = await producer.send(TOPIC, f"m{i}".encode(), queue=mq)
            assert res.status is SendStatus.SEND_OK          # an ASYNC_MASTER does not wait for a slave
    slave2 = _slave(broker_factory, master)
    assert await _pull_all(slave2.namesrv, mq, 120) == [f"m{i}".encode() for i in range(120)]
    resumed = [int(x) for x in re.findall(r"following master \S+ from offset (\d+)", slave2.log())]
    assert len(resumed) >= 2 and resumed[0] == 0 and resumed[-1] > 0     # the restart asked from its own end
    end = _record_end(tmp_path / "master", decode_offset_msg_id(res.offset_msg_id)[2])
    assert _log_bytes(tmp_path / "slave", end) == _log_bytes(tmp_path / "master", end)


async def test_slave_refuses_writes(broker_factory):
    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    pool = ConnectionPool()
    try:
        h = SendMessageRequestHeader("PG", TOPIC, queue_id=0, properties="")
        resp = await pool.request(slave.broker, RemotingCommand.request(RequestCode.SEND_MESSAGE,
                                                                        h.to_ext_fields(v2=False), b"no"))
        assert resp.code == ResponseCode.SERVICE_NOT_AVAILABLE
        assert "messages are put to the slave" in resp.remark
        end = RemotingCommand.request(RequestCode.END_TRANSACTION, {
            "producerGroup": "PG", "tranStateTableOffset": "0", "commitLogOffset": "0",
            "commitOrRollback": "8", "msgId": "x"})
        assert (await pool.request(slave.broker, end)).code == ResponseCode.SLAVE_NOT_AVAILABLE
        # A stock admin's resumeCheckHalfMessage (323) writes as txmq's resume (903) does: refused at the door
        # alike. It ran its processor: the slave's start-up index answered "not dead-lettered (unknown)" or, for a
        # dead letter it knew, made it pending there before its store refused the record.
        for code, fields in ((RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": "0"}),
                             (RequestCode.RESUME_CHECK_HALF_MESSAGE, {"msgId": "7F00000100002A9F" + "0" * 16})):
            resp = await pool.request(slave.broker, RemotingCommand.request(code, fields))
            assert (resp.code, "this broker's role is SLAVE" in resp.remark) == \
                (ResponseCode.SERVICE_NOT_AVAILABLE, True), (code, resp.remark)
    finally:
        await pool.close()


def _scrape(metrics_addr: str) -> dict[str, float]:
    import urllib.request
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("txmq_ha_")}


async def test_sync_master_answers_flush_slave_timeout_when_the_slave_stalls(broker_factory):
    master = broker_factory("--broker-role", "SYNC_MASTER", "--ha-port", "0", "--ha-slave-timeout-ms", "300",
                            store="master")
    slave = _slave(broker_factory, master)
    async with Producer(master.namesrv, "PG_stall") as producer:
        mq = await _until_replicating(producer)
        gauges = await asyncio.to_thread(_scrape, master.metrics)
        assert gauges["txmq_ha_slave_connected"] == 1
        slave.proc.send_signal(signal.SIGSTOP)      # connected, but confirming nothing
        try:
            res = await producer.send(TOPIC, b"unconfirmed", queue=mq)
            assert res.status is SendStatus.FLUSH_SLAVE_TIMEOUT and res.queue_offset >= 0
            gauges = await asyncio.to_thread(_scrape, master.metrics)
            assert gauges["txmq_ha_slave_connected"] == 1 and gauges["txmq_ha_slave_lag_bytes"] > 0
        finally:
            slave.proc.send_signal(signal.SIGCONT)
        async with asyncio.timeout(20):             # resumed: it confirms again, and catches up
            while (await producer.send(TOPIC, b"again", queue=mq)).status is not SendStatus.SEND_OK:
                await asyncio.sleep(0.1)
    assert (await asyncio.to_thread(_scrape, master.metrics))["txmq_ha_slave_lag_bytes"] == 0
    assert b"unconfirmed" in await _pull_all(slave.namesrv, mq, res.queue_offset + 1)


def _name_server_master_slave(tmp_path, name: str, started: list, *slave_flags: str, master_flags=(),
                              slave_ha=lambda master_ha: master_ha):
    """A stand-alone name server, a SYNC_MASTER and its SLAVE registered under broker name ``name``; each
    process goes on ``started`` as it starts (the caller kills them). The master's, then the slave's, are
    ``master_flags`` and ``slave_flags``; the slave follows the HA address ``slave_ha`` gives for the master's."""
    from tests.support.broker_process import BrokerProcess
    from tests.support.cluster_process import NamesrvProcess, cluster_flags

    ns = NamesrvProcess(tmp_path / "namesrv.log", "--broker-expire-ms", "3000", "--scan-interval-ms", "200").start()
    started.append(ns)
    master = BrokerProcess(tmp_path / "master", *cluster_flags(ns.addr, name, 1000), "--broker-role", "SYNC_MASTER",
                           "--ha-port", "0", "--ha-heartbeat-interval-ms", "500", *master_flags).start()
    started.append(master)
    slave = BrokerProcess(tmp_path / "slave", *cluster_flags(ns.addr, name, 1000), "--broker-role", "SLAVE",
                          "--broker-id", "1", "--ha-master-addr", slave_ha(master.ha),
                          "--ha-heartbeat-interval-ms", "500", *slave_flags).start()
    started.append(slave)
    return ns, master, slave


async def test_through_a_name_server_consumers_fail_over_to_the_slave(tmp_path):
    """Master and slave register with one stand-alone name server under one broker name (ids 0 and 1);
    a stock-style consumer finds the master in the routes, and when it dies (kill -9 after the N-th
    acknowledged send) the routes keep the slave, from which the consumer reads all N."""
    from tests.support.cluster_process import route

    started = []
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-r", started)
        n = 100
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_ns_replica") as producer:
                mq = await _until_replicating(producer)
                seeds = (await producer.send(TOPIC, b"last-seed", queue=mq)).queue_offset
                for start in range(0, n, 20):
                    results = await asyncio.gather(*(producer.send(TOPIC, f"n{i}".encode(), queue=mq)
                                                     for i in range(start, start + 20)))
                    assert [r.status for r in results] == [SendStatus.SEND_OK] * 20
            addrs = (await route(ns.addr, TOPIC)).broker_datas[0].broker_addrs
            assert addrs == {0: master.broker, 1: slave.broker}, addrs
            master.kill()
            while 0 in (await route(ns.addr, TOPIC)).broker_datas[0].broker_addrs:
                await asyncio.sleep(0.1)        # dropped when its connection closed (bounded by the timeout)
            bodies = await _pull_all(ns.addr, mq, seeds + 1 + n)
        assert bodies[seeds + 1:] == [f"n{i}".encode() for i in range(n)]
    finally:
        for p in reversed(started):
            p.kill()


async def _thirty_sent(ns, group: str, prefix: str):
    """The queue a producer of ``group`` found replicating, once 30 messages (``prefix`` and a count) are sent to it."""
    async with Producer(ns.addr, group) as producer:
        mq = await _until_replicating(producer)
        for i in range(30):
            await producer.send(TOPIC, f"{prefix}{i}".encode(), queue=mq)
    return mq


async def test_consumers_that_fail_over_to_the_slave_go_on_from_their_committed_offset(tmp_path):
    """The log carries messages, not consumer offsets: a slave answered a failed-over consumer's offset query
    from its own empty table (0 here: every message again; past retention, the end: the rest never
    delivered). It copies its master's offsets (GET_ALL_CONSUMER_OFFSET), as RocketMQ's slave does."""
    from tests.support.cluster_process import route

    started = []
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-o", started, "--slave-sync-interval-ms", "200")
        async with asyncio.timeout(60):
            mq = await _thirty_sent(ns, "PG_offsets", "o")
            async with PullConsumer(ns.addr, "CG_failover") as consumer:
                await _fetch_queues_once_routed(consumer, TOPIC)
                await consumer.commit_offset(mq, 17)            # to the master, while it is there
                assert await consumer.fetch_offset(mq) == 17
            await _until_slave_has_offset(slave, "CG_failover", mq, 17)
            # (its name server names the master it follows: no mismatch said)
            assert (await asyncio.to_thread(_scrape, slave.metrics))["txmq_ha_slave_master_mismatch"] == 0
            master.kill()
            while 0 in (await route(ns.addr, TOPIC)).broker_datas[0].broker_addrs:
                await asyncio.sleep(0.1)
            async with PullConsumer(ns.addr, "CG_failover") as consumer:
                await consumer.fetch_queues(TOPIC)
                assert await consumer.fetch_offset(mq) == 17    # from the slave now
    finally:
        for p in reversed(started):
            p.kill()


async def test_a_group_deleted_with_its_offsets_on_the_master_loses_them_on_the_slave_too(tmp_path):
    """mqadmin deleteSubGroup -r removes a group's offsets on the master; the slave's copy (putAll) kept them for
    good, so a consumer of the group made again that failed over to the slave (or to it promoted) resumed from the
    deleted offset (17 here) where the master answered 0 (a young queue: from its start). The next sync removes
    them on the slave too; another group's stay."""
    started = []
    pool = ConnectionPool()
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-dg", started, "--slave-sync-interval-ms", "200",
                                                       "--slave-group-forget-ms", "1000")
        async with asyncio.timeout(60):
            mq = await _thirty_sent(ns, "PG_deleted_group", "g")
            for group, offset in (("CG_deleted", 17), ("CG_kept", 5)):
                async with PullConsumer(ns.addr, group) as consumer:
                    await _fetch_queues_once_routed(consumer, TOPIC)
                    await consumer.commit_offset(mq, offset)
                await _until_slave_has_offset(slave, group, mq, offset)
            gone = await pool.request(master.broker, RemotingCommand.request(
                RequestCode.DELETE_SUBSCRIPTIONGROUP, {"groupName": "CG_deleted", "removeOffset": "true"}), 3.0)
            assert gone.code == ResponseCode.SUCCESS, gone.remark
            await _until_slave_has_offset(slave, "CG_deleted", mq, 0)     # as the master answers now
            await _until_slave_has_offset(slave, "CG_kept", mq, 5)
        assert "consumer offsets of 1 group(s) removed as master" in slave.log()
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def _commit(pool, broker, group: str, qid: int, offset: int) -> None:
    """UPDATE_CONSUMER_OFFSET of ``group`` on TOPIC's queue ``qid``, answered SUCCESS (a client that is no consumer
    of the group: saved before it)."""
    reply = await pool.request(broker.broker, RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET, {
        "consumerGroup": group, "topic": TOPIC, "queueId": qid, "commitOffset": offset}), 3.0)
    assert reply.code == ResponseCode.SUCCESS, reply.remark


async def test_a_queues_offset_forgotten_on_the_master_is_forgotten_on_the_slave_too(tmp_path):
    """UPDATE_CONSUMER_OFFSET -1 forgets a queue's offset on the master (as 4.9.8 reads the -1 it keeps); the slave's
    copy (putAll) kept the old one (17) while the group held other offsets, so a consumer failing over to the slave
    (or to it promoted) went on from 17 where the master answered 0 (a young queue: from its start), skipping what
    the client had asked to read again. The master lists the queue at -1, as a Java master does, and the slave
    forgets its copy."""
    started = []
    pool = ConnectionPool()

    def commit(qid: int, offset: int):
        return _commit(pool, master, "CG_forgot", qid, offset)

    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-fq", started, "--slave-sync-interval-ms", "200")
        async with asyncio.timeout(60):
            mq = await _thirty_sent(ns, "PG_forgot", "f")
            other = MessageQueue(mq.topic, mq.broker_name, 1 if mq.queue_id == 0 else 0)
            await commit(other.queue_id, 5)
            await commit(mq.queue_id, 17)
            await _until_slave_has_offset(slave, "CG_forgot", mq, 17)
            await commit(mq.queue_id, -1)
            await _until_slave_has_offset(slave, "CG_forgot", mq, 0)      # as the master answers now
            await _until_slave_has_offset(slave, "CG_forgot", other, 5)
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def test_a_queue_forgotten_just_before_the_masters_kill_is_still_forgotten_on_the_slave(tmp_path):
    """The queues a master lists at -1 for its slaves to forget were kept in its memory only: a queue forgotten
    while the slave was away (or less than a sync interval before the master went), then the master killed -9 and
    back, was listed by nothing, and the slave (putAll) kept the old offset (17) for good where the master answered
    0: a consumer failing over to it skipped what the client had asked to read again. They are saved with the
    offsets now: after the restart the master lists it at -1 again and the slave forgets its copy."""
    from tests.support.broker_process import BrokerProcess
    from tests.support.cluster_process import cluster_flags

    started = []
    pool = ConnectionPool()
    group = "CG_forgot_kill"

    def commit(broker, qid: int, offset: int):
        return _commit(pool, broker, group, qid, offset)

    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-fk", started, "--slave-sync-interval-ms", "200")
        async with asyncio.timeout(90):
            mq = await _thirty_sent(ns, "PG_forgot_kill", "k")
            other = MessageQueue(mq.topic, mq.broker_name, 1 if mq.queue_id == 0 else 0)
            await commit(master, other.queue_id, 5)
            await commit(master, mq.queue_id, 17)
            await _until_slave_has_offset(slave, group, mq, 17)
            await _until_slave_has_offset(slave, group, other, 5)
            assert slave.stop() == 0, slave.log()
            await commit(master, mq.queue_id, -1)          # no consumer of the group: on disk before SUCCESS
            master.kill()
            master = BrokerProcess(tmp_path / "master", *master.flags).start()
            started.append(master)
            slave = BrokerProcess(tmp_path / "slave", *cluster_flags(ns.addr, "broker-fk", 1000), "--broker-role",
                                  "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                                  "--ha-heartbeat-interval-ms", "500", "--slave-sync-interval-ms", "200").start()
            started.append(slave)
            await commit(master, other.queue_id, 6)        # the slave's first copy after the restart holds it
            await _until_slave_has_offset(slave, group, other, 6)
            reply = await pool.request(slave.broker, RemotingCommand.request(RequestCode.QUERY_CONSUMER_OFFSET, {
                "consumerGroup": group, "topic": TOPIC, "queueId": mq.queue_id}), 3.0)
            assert (reply.code, reply.int_field("offset")) == (ResponseCode.SUCCESS, 0), reply.remark
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def test_a_group_deleted_on_the_master_while_its_slave_is_down_goes_from_the_slave_after_its_restart(tmp_path):
    """The groups the master's answers named were known in the slave's memory only: a group deleted with its
    offsets on the master while the slave was down (or restarted while the slave timed its absence) was, to the
    restarted slave, one only it ever had, kept as RocketMQ's putAll keeps those -- for good (17 here, where the
    master answers 0), and the slave promoted resumed the group made again from it. The named groups are saved
    with the slave's offsets now; after the restart the master's answers must miss it for --slave-group-forget-ms
    again (not removed at once), then it goes."""
    from tests.support.broker_process import BrokerProcess

    started = []
    pool = ConnectionPool()
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-dr", started, "--slave-sync-interval-ms", "200",
                                                       "--slave-group-forget-ms", "1000")
        async with asyncio.timeout(90):
            mq = await _thirty_sent(ns, "PG_deleted_down", "d")
            for group, offset in (("CG_deleted", 17), ("CG_kept", 5)):
                async with PullConsumer(ns.addr, group) as consumer:
                    await _fetch_queues_once_routed(consumer, TOPIC)
                    await consumer.commit_offset(mq, offset)
                await _until_slave_has_offset(slave, group, mq, offset)
            assert slave.stop() == 0, slave.log()       # its offsets saved: both groups' there at the restart
            gone = await pool.request(master.broker, RemotingCommand.request(
                RequestCode.DELETE_SUBSCRIPTIONGROUP, {"groupName": "CG_deleted", "removeOffset": "true"}), 3.0)
            assert gone.code == ResponseCode.SUCCESS, gone.remark
            slave = BrokerProcess(tmp_path / "slave", *slave.flags).start()
            started.append(slave)
            await _until_slave_has_offset(slave, "CG_kept", mq, 5)
            await _until_slave_has_offset(slave, "CG_deleted", mq, 0)     # as the master answers now
        assert "consumer offsets of 1 group(s) removed as master" in slave.log()
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def test_a_new_group_a_master_killed_9_comes_back_without_keeps_its_offsets_on_the_slave(tmp_path):
    """The real thing behind the unit test of --slave-group-forget-ms: a master killed -9 within its offset flush
    interval of a new group's first commit comes back (same store, same addresses) without the group, until its
    consumers commit again. With answers every 200 ms the slave removed the group's offset at the restarted
    master's second answer, saved; a consumer failing over meanwhile started the group over. Five answers of the
    restarted master without it (each seen by the slave: another group's new offset copied) remove nothing."""
    from tests.support.broker_process import BrokerProcess
    from tests.support.prometheus import free_port

    started = []
    pool = ConnectionPool()
    fixed = ("--port", str(free_port()), "--ha-port", str(free_port()), "--flush-consumer-offset-interval-ms", "600000")
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-k9", started, "--slave-sync-interval-ms", "200",
                                                       master_flags=fixed)
        async with asyncio.timeout(90):
            async with Producer(ns.addr, "PG_k9") as producer:
                mq = await _until_replicating(producer)
            async with PullConsumer(ns.addr, "CG_new") as consumer:
                await _fetch_queues_once_routed(consumer, TOPIC)
                await consumer.pull(mq, 0, max_nums=1, suspend_ms=0)
                # a Java consumer's persistAll (oneway): not saved at once (an answered first offset would be)
                await consumer.commit_offset(mq, 1, oneway=True)
            await _until_slave_has_offset(slave, "CG_new", mq, 1)
            master.kill()
            master = BrokerProcess(tmp_path / "master", *master.flags).start()
            started.append(master)
            query = RemotingCommand.request(RequestCode.QUERY_CONSUMER_OFFSET, {
                "consumerGroup": "CG_new", "topic": TOPIC, "queueId": mq.queue_id})
            table = await pool.request(master.broker, RemotingCommand.request(RequestCode.GET_ALL_CONSUMER_OFFSET), 3.0)
            assert b"CG_new" not in table.body_bytes()     # lost by the kill: the master's answers miss the group
            for answer in range(5):       # the restarted master's answers, each one the slave took
                commit = RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET, {
                    "consumerGroup": "CG_other", "topic": TOPIC, "queueId": mq.queue_id, "commitOffset": answer})
                assert (await pool.request(master.broker, commit, 3.0)).code == ResponseCode.SUCCESS
                await _until_slave_has_offset(slave, "CG_other", mq, answer)
            resp = await pool.request(slave.broker, query, 3.0)
        assert (resp.code, resp.int_field("offset") if resp.code == ResponseCode.SUCCESS else None) == \
            (ResponseCode.SUCCESS, 1), slave.log()
        assert "removed as master" not in slave.log()
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def test_a_slave_does_not_list_transactions_it_does_not_follow(broker_factory):
    """A slave rebuilds its undecided-transaction index once, at start-up, and never follows its master's
    halves and decisions after that (it runs no checks). Its TXMQ_LIST_TRANSACTIONS answered SUCCESS with
    that start-up list -- here none, while the master holds one undecided transaction -- and its runtime
    info counted the same. It refuses the list and says where to ask."""
    from producer import LocalTransactionState, TransactionProducer

    class Unknown:
        def execute_local_transaction(self, msg, arg):
            return LocalTransactionState.UNKNOW

        async def check_local_transaction(self, msg):
            return LocalTransactionState.UNKNOW

    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    pool = ConnectionPool()
    try:
        async with TransactionProducer(master.namesrv, "PG_slave_tx", Unknown()) as producer:
            await producer.send_in_transaction(TOPIC, b"undecided")

        async def call(b, code):
            return await pool.request(b.broker, RemotingCommand.request(code), 5.0)
        listed = await call(master, RequestCode.TXMQ_LIST_TRANSACTIONS)
        assert json.loads(listed.body_bytes())["total"] == 1

        async def log_end(b):
            info = await call(b, RequestCode.GET_BROKER_RUNTIME_INFO)
            return int(json.loads(info.body_bytes())["table"]["commitLogMaxOffset"])
        async with asyncio.timeout(20):
            while await log_end(slave) < await log_end(master):     # the half is on the slave too
                await asyncio.sleep(0.05)
        on_slave = await call(slave, RequestCode.TXMQ_LIST_TRANSACTIONS)
        assert on_slave.code != ResponseCode.SUCCESS, on_slave.body_bytes()
        assert "SLAVE" in on_slave.remark and "master" in on_slave.remark
        info = json.loads((await call(slave, RequestCode.GET_BROKER_RUNTIME_INFO)).body_bytes())["table"]
        assert "txmqUndecidedTransactions" not in info
    finally:
        await pool.close()


def _waiting(metrics_addr: str) -> dict[str, float]:
    """txmq_schedule_messages_waiting by level, as a broker exports it."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    return {s.labels["level"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "txmq_schedule_messages_waiting"}


def _config_write_hung(metrics_addr: str) -> dict[str, float]:
    """txmq_config_write_hung by file, as a broker exports it."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    return {s.labels["file"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "txmq_config_write_hung"}


async def test_a_slave_gauges_its_copy_of_a_java_masters_delay_progress_and_a_master_does_not(broker_factory):
    """The server's wiring of SlaveSync.write_hung (unit-tested alone): every slave exports
    txmq_config_write_hung{file="slaveMasterDelayOffset.json"}, 0 while no write of it hangs; a master has none."""
    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    assert (await asyncio.to_thread(_config_write_hung, slave.metrics)).get("slaveMasterDelayOffset.json") == 0
    assert "slaveMasterDelayOffset.json" not in await asyncio.to_thread(_config_write_hung, master.metrics)


async def test_a_slave_does_not_export_deliveries_it_does_not_make(broker_factory):
    """A slave delivers no delayed or timer message (its master does, and the deliveries replicate). Its
    txmq_schedule_messages_waiting counted every delayed message ever replicated to it as waiting (its level
    progress is the one it had at start-up) and every replicated timer message too, for good: a cluster sum
    showed the master's backlog, and then messages delivered long ago, as waiting."""
    import time
    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    pool = ConnectionPool()
    try:
        async with Producer(master.namesrv, "PG_slave_sched") as producer:
            for i in range(3):
                await producer.send(TOPIC, f"delayed {i}".encode(), delay_level=1)
            for i in range(2):
                await producer.send(TOPIC, f"timer {i}".encode(), deliver_at_ms=int(time.time() * 1000) + 500)

        async def log_end(b):
            info = await pool.request(b.broker, RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO), 5.0)
            return int(json.loads(info.body_bytes())["table"]["commitLogMaxOffset"])
        async with asyncio.timeout(20):
            while any((await asyncio.to_thread(_waiting, master.metrics)).values()):    # delivered...
                await asyncio.sleep(0.1)
            while await log_end(slave) < await log_end(master):                         # ...and replicated
                await asyncio.sleep(0.05)
        assert not any((await asyncio.to_thread(_waiting, slave.metrics)).values())
    finally:
        await pool.close()


async def test_slave_never_moves_a_consumer_offset_it_is_behind(broker_factory):
    """A consumer that fails over to a slave behind its master (ASYNC_MASTER, or a slave just started) asks
    for offsets the slave does not have yet. RocketMQ's slave answers PULL_RETRY_IMMEDIATELY with the offset
    as asked and suggests the master (offsetCheckInSlave=false); answered PULL_OFFSET_MOVED with the slave's
    end, a stock consumer moved its committed offset back there and consumed everything after it again."""
    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    async with Producer(master.namesrv, "PG_ahead") as producer:
        first = await producer.send(TOPIC, b"m0")
        mq = first.queue
        for i in range(1, 5):
            await producer.send(TOPIC, f"m{i}".encode(), queue=mq)
    assert len(await _pull_all(slave.namesrv, mq, 5)) == 5      # the slave has the 5 messages
    pool = ConnectionPool()
    try:
        async def pull(addr, offset):
            return await pool.request(addr, RemotingCommand.request(RequestCode.PULL_MESSAGE, {
                "consumerGroup": "CG_ahead", "topic": TOPIC, "queueId": mq.queue_id, "queueOffset": offset,
                "maxMsgNums": 32, "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0,
                "subscription": "*", "subVersion": 0, "expressionType": "TAG"}))

        ahead = await pull(slave.broker, 9)     # the master had stored (and the consumer consumed) up to 9
        assert (ahead.code, ahead.int_field("nextBeginOffset"), ahead.int_field("suggestWhichBrokerId")) == (
            ResponseCode.PULL_RETRY_IMMEDIATELY, 9, 0), ahead.remark
        at_end = await pull(slave.broker, 5)
        assert (at_end.code, at_end.int_field("nextBeginOffset")) == (ResponseCode.PULL_NOT_FOUND, 5)
        found = await pull(slave.broker, 3)
        assert (found.code, found.int_field("nextBeginOffset")) == (ResponseCode.SUCCESS, 5)
        # a master corrects the offset, as before
        moved = await pull(master.broker, 9)
        assert (moved.code, moved.int_field("nextBeginOffset")) == (ResponseCode.PULL_OFFSET_MOVED, 5)
    finally:
        await pool.close()
    async with PullConsumer(slave.namesrv, "CG_ahead") as consumer:    # drain stops there, it does not spin
        await consumer.fetch_queues(TOPIC)
        results = [r async for r in consumer.drain(mq, 9)]
    assert [(r.status, r.next_begin_offset) for r in results] == [(PullStatus.NO_MATCHED_MSG, 9)]


async def _queue_max(addr: str, mq: MessageQueue) -> int:
    pool = ConnectionPool()
    try:
        resp = await pool.request(addr, RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {
            "topic": mq.topic, "queueId": mq.queue_id}), 5.0)
        return resp.int_field("offset", 0) if resp.code == ResponseCode.SUCCESS else 0
    finally:
        await pool.close()


async def test_a_slave_refuses_a_master_whose_log_is_not_the_one_it_copied(broker_factory, tmp_path):
    """The master is killed and comes back at the same HA address with another log (its store lost or
    replaced; a master that lost an unflushed tail and took new sends is the same case from that offset on).
    Once the new log is longer than the slave's and has a record boundary where the slave's ends -- equal
    record sizes make that certain -- the master's only check passed: the slave appended the new master's
    records after its own old ones, a log neither broker ever had, and the SYNC_MASTER acknowledged sends
    on the strength of it. A failed-over consumer read the old master's messages at the new one's offsets.
    The slave compares its own last record with the master's copy before it appends anything."""
    import shutil
    from tests.support.prometheus import free_port

    ha_port = str(free_port())

    def master_at_that_port():
        return broker_factory("--broker-role", "SYNC_MASTER", "--ha-port", ha_port, "--ha-heartbeat-interval-ms",
                              "500", store="master")
    master = master_at_that_port()
    slave = _slave(broker_factory, master)
    n = 30
    async with Producer(master.namesrv, "PG_diverge") as producer:
        mq = await _until_replicating(producer)
        for i in range(n):
            assert (await producer.send(TOPIC, b"a%03d" % i, queue=mq)).status is SendStatus.SEND_OK
    copied = await _queue_max(slave.broker, mq)
    master.kill()
    shutil.rmtree(tmp_path / "master")
    master = master_at_that_port()
    statuses = []
    async with Producer(master.namesrv, "PG_diverge") as producer:
        for i in range(2 * copied + 10):        # same sizes: its log passes the slave's end at a record boundary
            try:
                statuses.append((await producer.send(TOPIC, b"b%03d" % i, queue=mq)).status)
            except RequestTimeoutError:
                # A send stored while the slave is connected to compare its newest record waits for it (up to
                # the slave-flush timeout, as RocketMQ's), past this client's 3 s: not acknowledged either. The
                # first send makes its queue's file off the event loop, and the loop accepts the slave meanwhile.
                statuses.append(None)
        async with asyncio.timeout(30):         # the slave tries every second: it refuses, or it follows
            while "diverged" not in slave.log() and await _queue_max(slave.broker, mq) == copied:
                await asyncio.sleep(0.1)
        assert await _queue_max(slave.broker, mq) == copied, "the slave appended another master's log to its own"
        assert re.search(r"ERROR.*diverged", slave.log()), slave.log()
        later = await producer.send(TOPIC, b"after", queue=mq)
        assert later.status is SendStatus.SLAVE_NOT_AVAILABLE      # no slave holds what came before it
    assert SendStatus.SEND_OK not in statuses


async def _log_end(addr: str) -> int:
    pool = ConnectionPool()
    try:
        info = await pool.request(addr, RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO), 5.0)
        return int(json.loads(info.body_bytes())["table"]["commitLogMaxOffset"])
    finally:
        await pool.close()


class _HAProxy:
    """Between a slave and its master's HA port, on 127.0.0.1: ``_down`` relays the master's bytes to the slave
    and ``_up`` the slave's reports to the master (as they come, unless a subclass says otherwise)."""

    def __init__(self, target: str):
        self.target = target
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def _conn(self, reader, writer):
        host, _, port = self.target.rpartition(":")
        m_reader, m_writer = await asyncio.open_connection(host, int(port))
        self.tasks += [asyncio.ensure_future(self._up(reader, m_writer)),
                       asyncio.ensure_future(self._down(m_reader, writer))]

    async def _up(self, reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _down(self, reader, writer):
        raise NotImplementedError

    async def close(self):
        self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class _HoldingProxy(_HAProxy):
    """Between a slave and its master's HA port: relays the master's bytes up to ``limit`` (cutting a frame
    where it falls), then holds the rest; ``held`` is set at that point."""

    def __init__(self, target: str, limit: int):
        super().__init__(target)
        self.limit = limit
        self.relayed = 0
        self.held = asyncio.Event()

    async def _down(self, reader, writer):
        while data := await reader.read(65536):
            data = data[:max(0, self.limit - self.relayed)]
            self.relayed += len(data)
            if data:
                writer.write(data)
                await writer.drain()
            if self.relayed >= self.limit:
                self.held.set()
                await asyncio.Event().wait()        # the rest never comes (the slave is killed meanwhile)
        writer.close()


async def test_a_slave_killed_while_catching_up_resumes_with_every_record_once(broker_factory, tmp_path):
    """A slave SIGKILLed in the middle of a catch-up (half of a 3 MB backlog over small segments copied) and
    restarted on the same store: it resumes from its own end, and ends with the master's log byte for byte and
    every queue's messages once each, in order, at the master's offsets."""
    small = ("--segment-size", str(1 << 20), "--max-message-size", str(64 * 1024), "--cq-units-per-file", "100")
    master = broker_factory("--broker-role", "ASYNC_MASTER", "--ha-port", "0", *small, store="master")
    queues, per_queue = 4, 700
    sent: dict[int, list[bytes]] = {q: [] for q in range(queues)}
    async with Producer(master.namesrv, "PG_resume") as producer:
        mq = (await producer.send(TOPIC, b"x" * 1000)).queue
        sent[mq.queue_id].append(b"x" * 1000)
        for i in range(0, per_queue, 50):
            batch = [(q, b"%d-%05d-" % (q, j) + b"y" * 990) for q in range(queues) for j in range(i, i + 50)]
            await asyncio.gather(*(producer.send(TOPIC, body, queue=MessageQueue(TOPIC, mq.broker_name, q))
                                   for q, body in batch))
            for q, body in batch:
                sent[q].append(body)
    end = await _log_end(master.broker)
    assert end > 2 * (1 << 20)

    def slave_flags(addr):
        return ("--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", addr, *small)
    proxy = _HoldingProxy(master.ha, end // 2 + 777)       # cuts a frame somewhere past the middle
    slave = broker_factory(*slave_flags(await proxy.start()), store="slave")
    try:
        async with asyncio.timeout(30):
            await proxy.held.wait()
            while await _log_end(slave.broker) == 0:       # it has stored some of what it got
                await asyncio.sleep(0.01)
        slave.kill()                                       # with a transfer half received
    finally:
        await proxy.close()
    slave = broker_factory(*slave_flags(master.ha), store="slave")
    async with asyncio.timeout(30):
        while await _log_end(slave.broker) < end:
            await asyncio.sleep(0.05)
    resumed = [int(x) for x in re.findall(r"following master \S+ from offset (\d+)", slave.log())]
    assert 0 < resumed[-1] < end, resumed           # killed mid-way, resumed from its own end
    assert "diverged" not in slave.log()
    for q in range(queues):
        mq_q = MessageQueue(TOPIC, mq.broker_name, q)
        got = await _pull_all(slave.namesrv, mq_q, len(sent[q]))
        assert got == sent[q], f"queue {q}: {len(got)} messages, {len(sent[q])} sent"
        assert await _queue_max(slave.broker, mq_q) == len(sent[q])
    slave.stop()
    master.stop()
    m_files = sorted((tmp_path / "master" / "commitlog").iterdir())
    s_files = sorted((tmp_path / "slave" / "commitlog").iterdir())
    assert [f.name for f in m_files] == [f.name for f in s_files]
    for mf, sf in zip(m_files, s_files):
        assert mf.read_bytes() == sf.read_bytes(), mf.name


async def test_a_slave_far_behind_gauges_its_lag_from_the_masters_log_end(tmp_path):
    """A slave copying a backlog (here held at 256 KiB of a 2 MB log by a proxy on its HA link) gauges how far it is
    behind its master's log end. It gauged only the transfers in flight: 0 here, at most the 32 MiB queued to its
    writer for a slave 1 GB behind."""
    limit = 256 * 1024
    proxy = _HoldingProxy("", limit)
    via = await proxy.start()
    started = []
    try:
        def through_proxy(master_ha):
            proxy.target = master_ha
            return via
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-lag", started, "--slave-sync-interval-ms",
                                                      "200", master_flags=("--broker-role", "ASYNC_MASTER"),
                                                      slave_ha=through_proxy)
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_lag") as producer:
                for _ in range(40):
                    results = await asyncio.gather(*(producer.send(TOPIC, b"z" * 1000) for _ in range(50)))
                    assert {r.status for r in results} == {SendStatus.SEND_OK}
            end = await _log_end(master.broker)
            assert end > 8 * limit
            await proxy.held.wait()
            while (await asyncio.to_thread(_scrape, slave.metrics))["txmq_ha_slave_lag_bytes"] < end - limit:
                await asyncio.sleep(0.1)
    finally:
        for p in reversed(started):
            p.kill()
        await proxy.close()


async def test_a_slave_following_another_masters_log_than_its_name_server_names_says_so(tmp_path):
    """A slave registered as broker-x whose --ha-master-addr is another cluster's master (a port mistyped, a config
    copied from another cluster): it copied that master's log and broker-x's master's consumer offsets, topics and
    groups, and nothing said so."""
    from tests.support.broker_process import BrokerProcess

    started = []
    try:
        other = BrokerProcess(tmp_path / "other", "--broker-role", "ASYNC_MASTER", "--ha-port", "0").start()
        started.append(other)
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-x", started, "--slave-sync-interval-ms", "200",
                                                      slave_ha=lambda _own: other.ha)
        async with asyncio.timeout(30):
            while (await asyncio.to_thread(_scrape, slave.metrics)).get("txmq_ha_slave_master_mismatch") != 1:
                await asyncio.sleep(0.1)
        said = [line for line in slave.log().splitlines() if "(--ha-master-addr), but name server" in line]
        assert len(said) == 1 and other.ha in said[0] and master.ha in said[0] and master.broker in said[0], said
        assert (await asyncio.to_thread(_scrape, master.metrics)).get("txmq_ha_slave_master_mismatch") is None
    finally:
        for p in reversed(started):
            p.kill()


async def test_a_stalled_link_is_dropped_with_a_log_line_that_says_why(broker_factory):
    """Either side drops an HA link silent for the housekeeping interval. The master logged 'slave HOST:PORT: '
    and nothing else (str() of a TimeoutError is empty), the slave '... stopped: TimeoutError'."""
    master = broker_factory("--broker-role", "ASYNC_MASTER", "--ha-port", "0", "--ha-heartbeat-interval-ms", "200",
                            "--ha-housekeeping-interval-ms", "1000", store="master")
    slave = broker_factory("--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                           "--ha-heartbeat-interval-ms", "200", "--ha-housekeeping-interval-ms", "1000", store="slave")
    async with Producer(master.namesrv, "PG_stall_log") as producer:
        mq = (await producer.send(TOPIC, b"m0")).queue
    assert await _pull_all(slave.namesrv, mq, 1) == [b"m0"]        # following

    async def until_logged(proc, pattern):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not re.search(pattern, proc.log()):
            assert loop.time() < deadline, f"no {pattern!r} in:\n{proc.log()[-1500:]}"
            await asyncio.sleep(0.05)

    slave.proc.send_signal(signal.SIGSTOP)           # reports nothing
    try:
        await until_logged(master, r"slave \S+ dropped: no offset report for 1 s")
    finally:
        slave.proc.send_signal(signal.SIGCONT)
    master.proc.send_signal(signal.SIGSTOP)          # sends nothing, not even a heartbeat
    try:
        await until_logged(slave, r"replication from \S+ stopped: nothing from the master for 1 s")
    finally:
        master.proc.send_signal(signal.SIGCONT)


async def test_a_slave_removes_expired_segments_under_disk_pressure_as_its_master_does(tmp_path):
    """A slave ran no retention at all: the master's disk stayed under its clean ratio while the slave kept every
    segment, until at the refuse ratio it took no more of its master's bytes (replication stopped, a SYNC_MASTER
    answered SLAVE_NOT_AVAILABLE). Here every disk is 'above the clean ratio' and segments expire in about a
    second: the slave removes its expired sealed segments once its master has (never dead-letters halves: its
    master does; it learns the master's log start from the master broker the name server names)."""
    from tests.support.cluster_process import route

    started = []
    try:
        ns, master, slave = _expiring_master_slave(tmp_path, "broker-c", started, namesrv_flags=(
            "--broker-expire-ms", "3000", "--scan-interval-ms", "200"))
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_slave_retention") as producer:
                mq = (await producer.send(TOPIC, b"z" * 1000)).queue
                for i in range(0, 3000, 100):
                    await asyncio.gather(*(producer.send(TOPIC, b"z" * 1000, queue=mq) for _ in range(100)))
            end = await _log_end(master.broker)
            assert end > 2 * (1 << 20)
            while await _min_offset(master.broker) < 2 * (1 << 20):    # the master removed its sealed segments ...
                await asyncio.sleep(0.1)
            while await _log_end(slave.broker) < end or await _min_offset(slave.broker) < 2 * (1 << 20):
                await asyncio.sleep(0.1)                                # ... and the slave after it
            async with Producer(ns.addr, "PG_slave_retention") as producer:
                last = await producer.send(TOPIC, b"after", queue=mq)
            while await _log_end(slave.broker) < await _log_end(master.broker):
                await asyncio.sleep(0.05)
            master.kill()
            while 0 in (await route(ns.addr, TOPIC)).broker_datas[0].broker_addrs:
                await asyncio.sleep(0.1)        # dropped when its connection closed: consumers read the slave
            async with PullConsumer(ns.addr, "CG_slave_retention") as consumer:
                await _fetch_queues_once_routed(consumer, TOPIC)
                while not (res := await consumer.pull(mq, last.queue_offset, suspend_ms=1000)).messages:
                    pass                                        # and it follows on (bounded by the timeout)
                assert res.messages[0].body == b"after"
    finally:
        for p in reversed(started):
            p.kill()


async def test_a_master_killed_and_restarted_on_its_own_store_is_followed_again(broker_factory, tmp_path):
    """The common case the check above must let through: the master SIGKILLed right after the N-th
    acknowledged send and started again on its own store, at its HA address. The slave, which never stopped,
    finds the master's copy of its newest record equal to its own and follows on: sends are SEND_OK again and
    the two logs are equal byte for byte."""
    from tests.support.prometheus import free_port

    ha_port = str(free_port())

    def master_on_its_store():
        return broker_factory("--broker-role", "SYNC_MASTER", "--ha-port", ha_port, "--ha-heartbeat-interval-ms",
                              "500", store="master")
    master = master_on_its_store()
    slave = _slave(broker_factory, master)
    async with Producer(master.namesrv, "PG_restart") as producer:
        mq = await _until_replicating(producer)
        for i in range(30):
            assert (await producer.send(TOPIC, b"a%03d" % i, queue=mq)).status is SendStatus.SEND_OK
    master.kill()
    master = master_on_its_store()
    async with Producer(master.namesrv, "PG_restart") as producer:
        await _until_replicating(producer)
        for i in range(30):
            res = await producer.send(TOPIC, b"b%03d" % i, queue=mq)
            assert res.status is SendStatus.SEND_OK
    assert "diverged" not in slave.log()
    assert re.search(r"holds this slave's log up to its end \d+: following", slave.log())
    end = _record_end(tmp_path / "master", decode_offset_msg_id(res.offset_msg_id)[2])
    assert _log_bytes(tmp_path / "slave", end) == _log_bytes(tmp_path / "master", end)


async def test_consumers_failed_over_to_the_slave_see_committed_messages_only(broker_factory):
    """Halves, committed, rolled back and undecided, replicate with everything else; after the SYNC_MASTER is
    killed, a consumer of the real topic on the slave reads exactly the committed ones (the halves stay in
    the half topic, a rollback writes no real message)."""
    from producer import LocalTransactionState as S
    from producer import TransactionProducer

    class Listener:
        def execute_local_transaction(self, msg, arg):
            return {b"commit": S.COMMIT_MESSAGE, b"rollback": S.ROLLBACK_MESSAGE}.get(msg.body[:-1], S.UNKNOW)

        async def check_local_transaction(self, msg):
            return S.UNKNOW

    master = _master(broker_factory)
    slave = _slave(broker_factory, master)
    listener = Listener()
    async with Producer(master.namesrv, "PG_tx_seed") as producer:
        await _until_replicating(producer)
    async with TransactionProducer(master.namesrv, "PG_tx_failover", listener) as producer:
        sent = [await producer.send_in_transaction("TxFailover", b"%s%d" % (kind, i))
                for i in range(3) for kind in (b"commit", b"rollback", b"undecided")]
        assert all(r.send_result.status is SendStatus.SEND_OK for r in sent)
        async with Producer(master.namesrv, "PG_tx_seed") as plain:     # after every END: on the slave too
            while (await plain.send(TOPIC, b"fence")).status is not SendStatus.SEND_OK:
                pass
        master.kill()
        got = []
        async with PullConsumer(slave.namesrv, "CG_tx_failover") as consumer, asyncio.timeout(20):
            while True:
                try:
                    queues = await consumer.fetch_queues("TxFailover")
                    break
                except TopicNotExistError:
                    await asyncio.sleep(0.1)
            for mq in queues:
                got += [m.body for m in (await consumer.pull(mq, 0, max_nums=64)).messages]
        assert sorted(got) == [b"commit0", b"commit1", b"commit2"]


class _FrameProxy(_HAProxy):
    """Between a slave and its master's HA port: relays the master's transfer frames whole while they end at or
    before the log offset ``stop``, then holds every later byte of that connection (the slave's reports pass)."""

    def __init__(self, target: str, stop: int):
        super().__init__(target)
        self.stop = stop

    async def _down(self, reader, writer):
        import struct
        header = struct.Struct(">qi")
        try:
            while True:
                head = await reader.readexactly(header.size)
                phys, size = header.unpack(head)
                body = await reader.readexactly(size)
                if phys + size > self.stop:
                    await asyncio.Event().wait()        # held: this link delivers nothing more
                writer.write(head + body)
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()


async def _min_offset(addr: str) -> int:
    pool = ConnectionPool()
    try:
        info = await pool.request(addr, RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO), 5.0)
        return int(json.loads(info.body_bytes())["table"]["commitLogMinOffset"])
    finally:
        await pool.close()


async def test_a_slave_whose_newest_record_the_master_removed_by_retention_resumes(broker_factory, tmp_path):
    """A routine restart: the slave is stopped with its log ending exactly at a segment start (it has the master's
    end marker, not yet the record after it), and while it is down the master's retention removes that sealed
    segment. The slave's end is still in the master's log -- before the divergence check it resumed from there --
    but its newest record is not: it reported that record's start, the master answered 'cannot catch up (start it
    afresh)', and the slave asked the same again every second, for good. It must resume, and copy the rest."""
    seg = 1 << 20
    small = ("--segment-size", str(seg), "--max-message-size", str(64 * 1024))
    retention = ("--disk-clean-ratio", "0.0001", "--disk-force-clean-ratio", "0.9999", "--disk-refuse-ratio", "1.0",
                 "--file-reserved-hours", "0.0008", "--disk-clean-interval-s", "0.2")
    master = broker_factory("--broker-role", "ASYNC_MASTER", "--ha-port", "0", *small, *retention, store="master")
    proxy = _FrameProxy(master.ha, seg)         # the slave gets segment 0 and its end marker, nothing after
    slave_flags = ("--broker-role", "SLAVE", "--broker-id", "1", *small)
    slave = broker_factory(*slave_flags, "--ha-master-addr", await proxy.start(), store="slave")
    try:
        async with Producer(master.namesrv, "PG_retained") as producer:
            mq = (await producer.send(TOPIC, b"r" * 1000)).queue
            while await _log_end(master.broker) <= seg:     # into segment 1: segment 0 sealed
                await asyncio.gather(*(producer.send(TOPIC, b"r" * 1000, queue=mq) for _ in range(100)))
        async with asyncio.timeout(20):
            while await _log_end(slave.broker) < seg:
                await asyncio.sleep(0.05)
        assert await _log_end(slave.broker) == seg          # the marker is its last bytes
        slave.stop()                                        # a clean shutdown
    finally:
        await proxy.close()
    async with asyncio.timeout(30):                         # the master's retention removes segment 0
        while await _min_offset(master.broker) < seg:
            await asyncio.sleep(0.1)
    async with Producer(master.namesrv, "PG_retained") as producer:
        later = [await producer.send(TOPIC, b"later%d" % i, queue=mq) for i in range(5)]
    end = await _log_end(master.broker)
    slave = broker_factory(*slave_flags, "--ha-master-addr", master.ha, store="slave")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while await _log_end(slave.broker) < end:
        assert loop.time() < deadline, f"the slave did not resume:\n{slave.log()[-3000:]}\n---\n{master.log()[-1500:]}"
        await asyncio.sleep(0.1)
    bodies = await _pull_all(slave.namesrv, mq, later[-1].queue_offset + 1)
    assert bodies[later[0].queue_offset:] == [b"later%d" % i for i in range(5)]
    assert "diverged" not in slave.log()
    assert re.search(r"WARNING.*nothing is left to compare, following on offsets alone", slave.log()), slave.log()


async def test_a_diverged_slaves_comparison_start_acknowledges_no_send(broker_factory, tmp_path):
    """Two slaves. B copied 30 messages, then the master came back on another (empty) store; A is a new slave
    of it, connected but stalled. Sends wait for a slave. B's first report is no longer its log end but the start
    of its newest record (where the comparison begins) -- below the master's end once it took as many sends, and
    a record boundary there with equal sizes -- and the master counted it: the sends waiting below it were
    answered SEND_OK although no slave holds them (B holds other records there, A nothing). A comparison start
    acknowledges nothing; only a report past it does."""
    import shutil
    from tests.support.prometheus import free_port

    ha_port = str(free_port())

    def master_at_that_port():
        return broker_factory("--broker-role", "SYNC_MASTER", "--ha-port", ha_port, "--ha-heartbeat-interval-ms",
                              "500", "--ha-slave-timeout-ms", "3000", store="master")
    master = master_at_that_port()
    slave_b = _slave(broker_factory, master, store="slave_b")
    n = 30
    async with Producer(master.namesrv, "PG_diverge2") as producer:
        mq = await _until_replicating(producer)
        for i in range(n):
            assert (await producer.send(TOPIC, b"a%03d" % i, queue=mq)).status is SendStatus.SEND_OK
    copied = await _queue_max(slave_b.broker, mq)
    master.kill()
    shutil.rmtree(tmp_path / "master")
    master = master_at_that_port()
    slave_a = _slave(broker_factory, master, store="slave_a")
    async with Producer(master.namesrv, "PG_diverge2", send_timeout=10.0, retries=0) as producer:
        await _until_replicating(producer)          # A follows (B is refused: its log is past the master's end)
        slave_a.proc.send_signal(signal.SIGSTOP)    # connected, confirming nothing
        try:
            results = await asyncio.gather(*(producer.send(TOPIC, b"b%03d" % i, queue=mq)
                                             for i in range(2 * copied + 10)))
        finally:
            slave_a.proc.send_signal(signal.SIGCONT)
    statuses = [r.status for r in results]
    assert SendStatus.SEND_OK not in statuses, (statuses, master.log()[-2000:])


async def test_a_group_name_ending_in_the_separator_does_not_stop_the_slaves_offset_copy(tmp_path):
    """Group names are not checked: one ending in "@" is keyed "<topic>@<group>@" in the master's table. The
    slave read that key as damage and refused the master's whole body, every interval: it copied no group's
    offsets at all (said once in its log), and after a fail-over every group went back to its consume-from
    setting. The key is read as the store's loader reads it (split at its first "@"), and the copy goes on."""
    started = []
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-at", started, "--slave-sync-interval-ms", "200")
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_at") as producer:
                mq = await _until_replicating(producer)
            for group, offset in (("CG_odd@", 1), ("CG_plain", 17)):
                async with PullConsumer(ns.addr, group) as consumer:
                    await _fetch_queues_once_routed(consumer, TOPIC)
                    await consumer.commit_offset(mq, offset)
            await _until_slave_has_offset(slave, "CG_plain", mq, 17,
                                          lambda: "body is not usable" not in slave.log())
    finally:
        for p in reversed(started):
            p.kill()


async def test_one_address_cannot_take_every_ha_connection(broker_factory):
    """The client listeners hold one address to max_connections_per_host; the HA listener took any number, each
    connection a link the master streams its log to. Past the cap a connection is now closed on accept."""
    from broker.ha.codec import HEADER, encode_offset

    master = broker_factory("--broker-role", "ASYNC_MASTER", "--ha-port", "0", "--ha-heartbeat-interval-ms", "200",
                            "--max-connections-per-host", "2")
    host, _, port = master.ha.rpartition(":")
    streams = []
    try:
        async with asyncio.timeout(20):
            for _ in range(3):
                streams.append(await asyncio.open_connection(host, int(port)))
            answers = []
            for reader, writer in streams:
                writer.write(encode_offset(0))          # a new slave: from the start
                try:
                    answers.append(len(await reader.readexactly(HEADER.size)))
                except asyncio.IncompleteReadError as exc:
                    answers.append(len(exc.partial))
                except ConnectionResetError:            # closed with our report unread
                    answers.append(0)
        assert answers == [HEADER.size, HEADER.size, 0], answers      # the third: closed on accept
    finally:
        for _reader, writer in streams:
            writer.close()
    assert "ha listener: refusing" in master.log()


async def test_a_slave_copies_its_masters_subscription_groups_so_its_pulls_suggest_what_the_group_says(tmp_path):
    """With slaveReadEnable a pull reply suggests the group's brokerId (whichBrokerWhenConsumeSlowly when far
    behind), from the group's config, and the stock consumer pulls from that broker id next. The config is set
    on the master (updateSubGroup); the slave kept only its own, empty table, so a group set to read from the
    slave (brokerId 1) was sent there by the master and straight back by the slave (0, the default), every pull.
    The slave copies its master's groups (GET_ALL_SUBSCRIPTIONGROUP_CONFIG), as RocketMQ's SlaveSynchronize."""
    started = []
    pool = ConnectionPool()
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-sg", started, "--slave-sync-interval-ms",
                                                      "200", "--slave-read-enable")
        group = "CG_reads_the_slave"
        resp = await pool.request(master.broker, RemotingCommand.request(
            RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
            body=json.dumps({"groupName": group, "brokerId": 1}).encode()), 5.0)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_slave_groups") as producer:
                mq = await _until_replicating(producer)
            listed = RemotingCommand.request(RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)
            while True:     # copied within a few sync intervals (bounded by the timeout)
                table = json.loads((await pool.request(slave.broker, listed, 3.0)).body_bytes())
                if table["subscriptionGroupTable"].get(group, {}).get("brokerId") == 1:
                    break
                await asyncio.sleep(0.1)
            pull = RemotingCommand.request(RequestCode.PULL_MESSAGE, {
                "consumerGroup": group, "topic": TOPIC, "queueId": mq.queue_id, "queueOffset": 0, "maxMsgNums": 1,
                "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": "*", "subVersion": 1,
                "expressionType": "TAG"})
            resp = await pool.request(slave.broker, pull, 5.0)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        assert resp.int_field("suggestWhichBrokerId") == 1
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


def _refused(metrics_addr: str, reason: str) -> float:
    import urllib.request
    scraped = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    line = f'txmq_requests_refused_total{{reason="{reason}"}} '
    return sum(float(x[len(line):]) for x in scraped.splitlines() if x.startswith(line))


async def test_a_slave_given_its_masters_groups_neither_grows_nor_refuses_retry_topics(tmp_path):
    """The slave copies its master's groups (retryQueueNums with them), and consumers heartbeat to it too. Its
    queues are its master's, made by the records it copies, and a heartbeat there makes no file: its queue limits
    are not the heartbeat's to meet. Weighed against them, a group set to -q 8 on the master was refused on the
    slave (counted, logged) and got no retry topic there, its failed-over consumers' pulls of it TOPIC_NOT_EXIST."""
    started = []
    pool = ConnectionPool()
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-sq", started, "--slave-sync-interval-ms",
                                                      "200", "--max-queues-per-host", "4")
        group = "CG_slave_retry_queues"
        resp = await pool.request(master.broker, RemotingCommand.request(
            RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
            body=json.dumps({"groupName": group, "retryQueueNums": 8}).encode()), 5.0)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        async with asyncio.timeout(60):
            listed = RemotingCommand.request(RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)
            while True:     # copied within a few sync intervals (bounded by the timeout)
                table = json.loads((await pool.request(slave.broker, listed, 3.0)).body_bytes())
                if table["subscriptionGroupTable"].get(group, {}).get("retryQueueNums") == 8:
                    break
                await asyncio.sleep(0.1)
            beat = RemotingCommand.request(RequestCode.HEART_BEAT, body=json.dumps({
                "clientID": "127.0.0.1@slave", "producerDataSet": [], "consumerDataSet": [{
                    "groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                    "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False,
                    "subscriptionDataSet": []}]}).encode())
            resp = await pool.request(slave.broker, beat, 5.0)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            resp = await pool.request(slave.broker, RemotingCommand.request(     # an operator's, on the slave:
                RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},                # refused, as 4.9.8's validateSlave
                body=json.dumps({"groupName": group, "retryQueueNums": 16}).encode()), 5.0)
            assert resp.code == ResponseCode.SYSTEM_ERROR and "from slave broker" in resp.remark, resp.remark
            configs = RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG)
            table = json.loads((await pool.request(slave.broker, configs, 5.0)).body_bytes())["topicConfigTable"]
        assert f"%RETRY%{group}" in table
        assert await asyncio.to_thread(_refused, slave.metrics, "queue-host-limit") == 0
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def _topic_table(pool: ConnectionPool, addr: str) -> dict:
    resp = await pool.request(addr, RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG), 5.0)
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    return json.loads(resp.body_bytes())["topicConfigTable"]


async def _until_slave_topics(pool: ConnectionPool, slave, done) -> dict:
    """The slave's topic table once ``done(table)`` (copied within a few sync intervals; bounded by the caller)."""
    while True:
        table = await _topic_table(pool, slave.broker)
        if done(table):
            return table
        await asyncio.sleep(0.1)


async def test_a_slave_takes_its_masters_topic_configs_and_deletes(tmp_path):
    """The log names only the queues that hold records. A topic an operator made on the master with 16 queues,
    read-only and ordered was unknown to the slave (no record yet): a consumer failed over to it was answered
    TOPIC_NOT_EXIST, and a topic made by its records had the queues they reached, read-write. A topic deleted on
    the master lived on in the slave, its old messages served, restored at a restart (the slave restarted as the
    master: the topic back). The slave copies its master's table (GET_ALL_TOPIC_CONFIG), deletes with it, as
    RocketMQ's SlaveSynchronize."""
    from tests.support.broker_process import BrokerProcess

    started = []
    pool = ConnectionPool()
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-tc", started, "--slave-sync-interval-ms", "200")
        for topic, queues, perm, order in (("Ops16", 16, 4, "true"), ("Gone", 4, 6, "false")):
            resp = await pool.request(master.broker, RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
                "topic": topic, "readQueueNums": queues, "writeQueueNums": queues, "perm": perm, "order": order}),
                5.0)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_topic_copies") as producer:
                await _until_replicating(producer)
                for qid in range(4):
                    gone = await producer.send("Gone", b"old", queue=MessageQueue("Gone", "broker-tc", qid))
                    assert gone.status is SendStatus.SEND_OK
            table = await _until_slave_topics(pool, slave, lambda t: "Ops16" in t)
            assert (table["Ops16"]["readQueueNums"], table["Ops16"]["writeQueueNums"], table["Ops16"]["perm"],
                    table["Ops16"]["order"]) == (16, 16, 4, True)
            resp = await pool.request(master.broker, RemotingCommand.request(RequestCode.DELETE_TOPIC_IN_BROKER,
                                                                             {"topic": "Gone"}), 5.0)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            await _until_slave_topics(pool, slave, lambda t: "Gone" not in t)
            stats = RemotingCommand.request(RequestCode.GET_TOPIC_STATS_INFO, {"topic": "Gone"})
            assert (await pool.request(slave.broker, stats, 5.0)).code == ResponseCode.TOPIC_NOT_EXIST
            slave.stop()
            # the slave restarted alone (its master away): neither the delete nor the copies undone
            again = BrokerProcess(tmp_path / "slave", "--broker-role", "SLAVE", "--broker-id", "1",
                                  "--ha-master-addr", "127.0.0.1:1").start()
            started.append(again)
            table = await _topic_table(pool, again.broker)
            assert "Gone" not in table
            assert (table["Ops16"]["readQueueNums"], table["Ops16"]["perm"]) == (16, 4)
            assert (await pool.request(again.broker, stats, 5.0)).code == ResponseCode.TOPIC_NOT_EXIST
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def _one_queue_topic_of_three(pool: ConnectionPool, master, producer: Producer, topic: str) -> MessageQueue:
    """``topic`` made on ``master`` with one queue once the slave confirms (SYNC_MASTER), and old0-old2 sent to it:
    its queue."""
    await _until_replicating(producer)
    create = RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
        "topic": topic, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6})
    assert (await pool.request(master.broker, create, 5.0)).code == ResponseCode.SUCCESS
    mq = MessageQueue(topic, (await producer.send(TOPIC, b"seed")).queue.broker_name, 0)
    for i in range(3):
        assert (await producer.send(topic, f"old{i}".encode(), queue=mq)).status is SendStatus.SEND_OK
    return mq


async def test_a_topic_deleted_and_made_again_on_the_master_starts_again_on_the_slave(broker_factory):
    """Deleted on the master, a topic made again starts its queues at offset 0 there. The slave indexed the copied
    records at the end of its own queue: the new message at offset 3 there, and a consumer failed over to it at
    offset 0 was served the deleted messages, at every offset a few behind. Its queue now starts again where the
    master's did (as the slave's own restart rebuilds it from the log). No name server here: the slave copies no
    configs, only the log says what happened."""
    from protocol.message import decode_records

    master = _master(broker_factory)
    slave = _slave(broker_factory, master)
    pool = ConnectionPool()
    topic = "Remade"
    create = RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
        "topic": topic, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6})
    mq = MessageQueue(topic, "broker-a", 0)
    try:
        async with asyncio.timeout(60), Producer(master.namesrv, "PG_remade") as producer:
            mq = await _one_queue_topic_of_three(pool, master, producer, topic)
            resp = await pool.request(master.broker, RemotingCommand.request(RequestCode.DELETE_TOPIC_IN_BROKER,
                                                                             {"topic": topic}), 5.0)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            assert (await pool.request(master.broker, create, 5.0)).code == ResponseCode.SUCCESS
            res = await producer.send(topic, b"new0", queue=mq)
            assert (res.status, res.queue_offset) == (SendStatus.SEND_OK, 0)    # on the slave too: SYNC_MASTER
            answers = []
            for broker in (master, slave):
                resp = await pool.request(broker.broker, RemotingCommand.request(RequestCode.PULL_MESSAGE, {
                    "consumerGroup": "CG_remade", "topic": topic, "queueId": 0, "queueOffset": 0, "maxMsgNums": 8,
                    "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": "*",
                    "subVersion": 1, "expressionType": "TAG"}), 5.0)
                assert resp.code == ResponseCode.SUCCESS, resp.remark
                answers.append([m.body for m in decode_records(resp.body_bytes())])
        assert answers == [[b"new0"], [b"new0"]]
    finally:
        await pool.close()


async def test_a_master_answers_get_all_delay_offset_as_a_java_slave_asks_it(broker_factory):
    """A Java slave's SlaveSynchronize asks GET_ALL_DELAY_OFFSET every sync and writes the body to its
    delayOffset.json. Answered REQUEST_CODE_NOT_SUPPORTED, it kept none, and restarted as the master it delivered
    every delayed message in its log again. The master answers RocketMQ's {"offsetTable": {level: offset}}: the
    next SCHEDULE_TOPIC_XXXX queue offset per level, after the deliveries made; its slave says to ask the master."""
    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    ask = RemotingCommand.request(RequestCode.GET_ALL_DELAY_OFFSET)
    pool = ConnectionPool()
    try:
        async with asyncio.timeout(60):
            async with Producer(master.namesrv, "PG_delay_offsets") as producer:
                mq = None
                for i in range(3):
                    res = await producer.send("DelayedCopy", f"d{i}".encode(), delay_level=1, queue=mq)
                    assert res.status is SendStatus.SEND_OK
                    mq = res.queue
            max_offset = RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": "DelayedCopy",
                                                                              "queueId": mq.queue_id})
            while (await pool.request(master.broker, max_offset, 5.0)).int_field("offset", 0) < 3:
                await asyncio.sleep(0.1)        # delivered (the 1 s level; bounded by the timeout)
            resp = await pool.request(master.broker, ask, 5.0)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            table = json.loads(resp.body_bytes())["offsetTable"]
            assert table.pop("1") == 3 and set(table.values()) <= {0}      # the other levels: nothing delivered
            resp = await pool.request(slave.broker, ask, 5.0)
            assert resp.code == ResponseCode.SYSTEM_ERROR and "ask its master" in resp.remark
    finally:
        await pool.close()


async def test_a_slave_restarted_as_the_master_checks_the_transactions_its_master_left_undecided(broker_factory):
    """4.x promotes a slave by restarting it with another broker role. The slave's index of undecided halves is its
    start-up one (it follows no decisions); its clean stop saved it as a snapshot covering its whole log, and,
    restarted as the master, it listed none of the halves its master had left undecided: never checked, never
    committed, gone without a word. The slave saves none: its next start reads the log it copied."""
    from producer import LocalTransactionState, TransactionProducer

    class Outcomes:
        def execute_local_transaction(self, msg, arg):
            return {b"u": LocalTransactionState.UNKNOW, b"c": LocalTransactionState.COMMIT_MESSAGE,
                    b"r": LocalTransactionState.ROLLBACK_MESSAGE}[msg.body[:1]]

        async def check_local_transaction(self, msg):
            return LocalTransactionState.UNKNOW

    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    pool = ConnectionPool()

    async def call(b, code):
        return await pool.request(b.broker, RemotingCommand.request(code), 5.0)

    async def log_end(b):
        info = await call(b, RequestCode.GET_BROKER_RUNTIME_INFO)
        return int(json.loads(info.body_bytes())["table"]["commitLogMaxOffset"])

    async def undecided(b):
        return sorted(t["uniq_key"] for t in json.loads(
            (await call(b, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())["pending"])
    try:
        async with asyncio.timeout(60):
            async with TransactionProducer(master.namesrv, "PG_promoted_tx", Outcomes()) as producer:
                for body in (b"u1", b"c1", b"r1", b"u2"):
                    await producer.send_in_transaction(TOPIC, body)
            left = await undecided(master)
            assert len(left) == 2
            while await log_end(slave) < await log_end(master):     # every half and decision copied
                await asyncio.sleep(0.05)
            master.kill()
            assert slave.stop() == 0
            promoted = broker_factory("--broker-role", "ASYNC_MASTER", store="slave")
            assert await undecided(promoted) == left
    finally:
        await pool.close()


async def test_a_slave_restarted_as_the_master_spends_no_check_of_what_its_master_checked(broker_factory):
    """A promotion is a restart (4.x): the next check of a transaction is an interval after its last one, known on
    the slave by the check record it copied (its snapshot is its start's, from before the check). Due at once, the
    promotion spent a check of every transaction its master had just checked, once a producer of its group came."""
    from tests.fault.test_transactions_crash import Listener
    from tests.fault.test_transactions_crash import _listed
    from producer import LocalTransactionState, TransactionProducer

    flags = ("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "500")
    master = broker_factory("--broker-role", "ASYNC_MASTER", "--ha-port", "0", "--ha-heartbeat-interval-ms", "500",
                            *flags, store="master")
    slave = _slave(broker_factory, master)
    pool = ConnectionPool()

    async def log_end(b):
        info = await pool.request(b.broker, RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO), 5.0)
        return int(json.loads(info.body_bytes())["table"]["commitLogMaxOffset"])
    listener = Listener(answer=LocalTransactionState.UNKNOW)
    try:
        async with asyncio.timeout(60):
            async with TransactionProducer(master.namesrv, "PG_promoted_checked", listener) as producer:
                await producer.send_in_transaction(TOPIC, b"in doubt")
                await listener.until_asked(1)
                while (await _listed(master))["pending"][0]["checks"] < 1:
                    await asyncio.sleep(0.05)
            while await log_end(slave) < await log_end(master):     # the check record copied
                await asyncio.sleep(0.05)
            master.kill()
            assert slave.stop() == 0
            promoted = broker_factory("--broker-role", "ASYNC_MASTER", *flags, store="slave")
            # A producer of the group here (with none, a transaction due is deferred an interval: no check spent)
            async with TransactionProducer(promoted.namesrv, "PG_promoted_checked", listener) as producer:
                assert await producer.heartbeat()
                (row,) = (await _listed(promoted))["pending"]
                assert row["checks"] == 1 and row["next_check_in_ms"] > 30_000, row
            assert len(listener.asked) == 1, listener.asked
    finally:
        await pool.close()


async def test_a_slave_copies_nothing_from_a_master_whose_log_is_not_the_one_it_copied(tmp_path):
    """The master comes back at its HA address with another store (its own lost): the slave refuses its log and
    keeps its own, for consumers to fail over to. Its sync took the new master's table all the same, empty of the
    old topics, and deleted them here, consume queues and all: the messages it kept unreachable. It copies nothing
    while it does not follow its master's log."""
    import shutil

    from tests.support.broker_process import BrokerProcess
    from tests.support.cluster_process import NamesrvProcess, cluster_flags
    from tests.support.cluster_process import stored_count
    from tests.support.prometheus import free_port

    started = []
    pool = ConnectionPool()
    ha_port = str(free_port())

    def master_process():
        return BrokerProcess(tmp_path / "master", *cluster_flags(ns.addr, "broker-dv", 500), "--broker-role",
                             "ASYNC_MASTER", "--ha-port", ha_port, "--ha-heartbeat-interval-ms", "500").start()
    try:
        ns = NamesrvProcess(tmp_path / "namesrv.log").start()
        started.append(ns)
        master = master_process()
        started.append(master)
        slave = BrokerProcess(tmp_path / "slave", *cluster_flags(ns.addr, "broker-dv", 500), "--broker-role", "SLAVE",
                              "--broker-id", "1", "--ha-master-addr", f"127.0.0.1:{ha_port}",
                              "--ha-heartbeat-interval-ms", "500", "--slave-sync-interval-ms", "200").start()
        started.append(slave)
        resp = await pool.request(master.broker, RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": "Kept", "readQueueNums": 2, "writeQueueNums": 2, "perm": 6}), 5.0)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_kept") as producer:
                for i in range(20):
                    await producer.send("Kept", b"k%02d" % i)
                await producer.send(TOPIC, b"x" * 4000)     # the new master's log will be shorter than this
            end = await _log_end(master.broker)
            while await _log_end(slave.broker) < end:
                await asyncio.sleep(0.05)
            await _until_slave_topics(pool, slave, lambda t: "Kept" in t)
            master.kill()
            shutil.rmtree(tmp_path / "master")
            started.append(master_process())
            while "nothing copied from master" not in slave.log() and "Kept" in await _topic_table(pool, slave.broker):
                await asyncio.sleep(0.1)        # a sync against the new master: refused, or the topics deleted
            assert "Kept" in await _topic_table(pool, slave.broker)
            assert await stored_count(slave.broker, "Kept", 2) == 20
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def test_a_slave_start_saves_the_transaction_index_it_rebuilt(broker_factory):
    """A slave saves no transaction snapshot at its stop (its index follows no decisions). Its start-up wrote one only
    when it had none: every later start (the one promoting it too) replayed every op and half record copied since
    its first start, retention's 72 hours of them. The index a start rebuilt is true as the log is then (nothing is
    copied before recovery ends): saved, the next start replays only what was copied since."""
    from producer import LocalTransactionState, TransactionProducer
    from protocol.txlog import OP_TOPIC

    class Commit:
        def execute_local_transaction(self, msg, arg):
            return LocalTransactionState.COMMIT_MESSAGE

        async def check_local_transaction(self, msg):
            return LocalTransactionState.COMMIT_MESSAGE

    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    pool = ConnectionPool()
    op_end = RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": OP_TOPIC, "queueId": 0})

    def saved_op_offset():
        return json.loads((slave.store_dir / "transactions" / "snapshot.json").read_bytes())["op_offset"]
    try:
        async with asyncio.timeout(60):
            assert saved_op_offset() == 0       # its first start, on an empty store
            async with TransactionProducer(master.namesrv, "PG_slave_snapshot", Commit()) as producer:
                for i in range(3):
                    await producer.send_in_transaction(TOPIC, b"c%d" % i)
            want = (await pool.request(master.broker, op_end, 5.0)).int_field("offset", 0)
            assert want == 3
            while (await pool.request(slave.broker, op_end, 5.0)).int_field("offset", 0) < want:
                await asyncio.sleep(0.05)       # every decision copied (bounded by the timeout)
            assert slave.stop() == 0
            slave = _slave(broker_factory, master)
            assert saved_op_offset() == want
    finally:
        await pool.close()


async def test_a_slave_stopped_by_an_earlier_txmq_rebuilds_its_transaction_index_before_promotion(broker_factory):
    """An earlier txmq slave saved, at its stop, its start-up index as a snapshot covering its whole log, and a
    half floor at the log's end. Upgraded, the slave read that snapshot at each start (and now saves what it
    read): restarted as the master, it listed none of the transactions its master had left undecided. A slave
    start does not use a snapshot without "written_as" (an earlier txmq's), nor the floor: the whole log, once.
    The files are made as that version left them (checked against it: the same loss)."""
    from producer import LocalTransactionState, TransactionProducer
    from protocol.txlog import HALF_TOPIC, OP_TOPIC, PROGRESS_GROUP

    class Undecided:
        def execute_local_transaction(self, msg, arg):
            return LocalTransactionState.UNKNOW

        async def check_local_transaction(self, msg):
            return LocalTransactionState.UNKNOW

    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    pool = ConnectionPool()

    async def call(b, code, fields=None):
        return await pool.request(b.broker, RemotingCommand.request(code, fields), 5.0)

    async def end(b, topic):
        return (await call(b, RequestCode.GET_MAX_OFFSET, {"topic": topic, "queueId": 0})).int_field("offset", 0)

    async def undecided(b):
        return sorted(t["uniq_key"] for t in json.loads(
            (await call(b, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())["pending"])
    try:
        async with asyncio.timeout(60):
            async with TransactionProducer(master.namesrv, "PG_legacy_slave", Undecided()) as producer:
                for body in (b"u1", b"u2"):
                    await producer.send_in_transaction(TOPIC, body)
            left = await undecided(master)
            assert len(left) == 2
            while await end(slave, HALF_TOPIC) < 2:
                await asyncio.sleep(0.05)       # both halves copied (bounded by the timeout)
            ops, halves = await end(slave, OP_TOPIC), await end(slave, HALF_TOPIC)
            assert slave.stop() == 0
            # as the earlier version's stop left them: its start-up index (empty) over the whole log, the floor
            path = slave.store_dir / "transactions" / "snapshot.json"
            snap = json.loads(path.read_bytes())
            for key in ("written_as", "crc"):
                snap.pop(key, None)
            snap.update(op_offset=ops, half_offset=halves, pending=[], owners={})
            path.write_text(json.dumps(snap))
            offsets = slave.store_dir / "config" / "consumerOffset.json"
            table = json.loads(offsets.read_bytes()) if offsets.exists() else {}
            (table["offsetTable"] if "offsetTable" in table else table)[f"{HALF_TOPIC}@{PROGRESS_GROUP}"] = {
                "0": halves}
            offsets.write_text(json.dumps(table))
            again = _slave(broker_factory, master)      # upgraded: started once as the slave
            assert again.stop() == 0
            master.kill()
            promoted = broker_factory("--broker-role", "ASYNC_MASTER", store="slave")
            assert await undecided(promoted) == left
    finally:
        await pool.close()


async def _undecided(pool: ConnectionPool, addr: str) -> list[str]:
    resp = await pool.request(addr, RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS), 5.0)
    return sorted(t["uniq_key"] for t in json.loads(resp.body_bytes())["pending"])


async def test_a_slave_keeps_the_segments_its_master_still_holds_so_promotion_keeps_their_halves(tmp_path):
    """A slave's own cleaner removed expired segments its master still held (the master's disk below its clean
    ratio), undecided halves with them: the master had not dead-lettered them, the slave never does, and the slave
    restarted as the master listed none of them -- gone without a word. The slave now removes a segment only once
    its master has (GET_BROKER_RUNTIME_INFO's commitLogMinOffset, and its log holds what the master had written
    by then: the dead-letter records of the halves), and says why it keeps one."""
    from producer import LocalTransactionState, TransactionProducer
    from tests.support.broker_process import BrokerProcess

    class Undecided:
        def execute_local_transaction(self, msg, arg):
            return LocalTransactionState.UNKNOW

        async def check_local_transaction(self, msg):
            return LocalTransactionState.UNKNOW

    started = []
    pool = ConnectionPool()
    try:
        ns, master, slave = _expiring_master_slave(tmp_path, "broker-p", started, master_cleans=(
            "--disk-clean-ratio", "0.9998", "--disk-force-clean-ratio", "0.9999"))     # the master never cleans
        async with asyncio.timeout(90):
            async with TransactionProducer(ns.addr, "PG_promote_keep", Undecided()) as producer:
                await producer.send_in_transaction(TOPIC, b"undecided")     # in the first segment
            async with Producer(ns.addr, "PG_promote_fill") as producer:
                mq = (await producer.send(TOPIC, b"z" * 1000)).queue
                for _ in range(0, 2500, 100):
                    await asyncio.gather(*(producer.send(TOPIC, b"z" * 1000, queue=mq) for _ in range(100)))
            left = await _undecided(pool, master.broker)
            assert len(left) == 1
            end = await _log_end(master.broker)
            assert end > 2 * (1 << 20)
            while await _log_end(slave.broker) < end:
                await asyncio.sleep(0.05)
            # The slave's cleaner either removes the first segment (the loss) or says it keeps it for its master.
            while "its master still holds it" not in slave.log():
                assert await _min_offset(slave.broker) == 0, \
                    f"the slave removed a segment its master holds:\n{slave.log()[-3000:]}"
                await asyncio.sleep(0.05)
            assert await _min_offset(slave.broker) == 0
            master.kill()
            assert slave.stop() == 0
            promoted = BrokerProcess(tmp_path / "slave", "--broker-role", "ASYNC_MASTER", *SMALL_EXPIRING[:4]).start()
            started.append(promoted)
            assert await _undecided(pool, promoted.broker) == left
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def test_a_promoted_slave_says_which_undecided_halves_its_own_retention_removed(broker_factory):
    """Disk pressure on a slave still removes a segment its master holds (a full disk stops replication), undecided
    halves with it. Restarted as the master, the slave's recovery dropped them without a word: never checked,
    committed or dead-lettered, and nothing said they had been. It now logs an ERROR naming them and counts them
    (txmq_transactions_lost_total{reason="segment-removed"}); the slave's cleaner said at the removal what a
    promotion would lose."""
    import urllib.request

    from producer import LocalTransactionState, TransactionProducer

    class Undecided:
        def execute_local_transaction(self, msg, arg):
            return LocalTransactionState.UNKNOW

        async def check_local_transaction(self, msg):
            return LocalTransactionState.UNKNOW

    master = broker_factory("--broker-role", "ASYNC_MASTER", "--ha-port", "0", *SMALL_EXPIRING,
                            "--disk-clean-ratio", "0.9998", "--disk-force-clean-ratio", "0.9999", store="master")
    slave = broker_factory("--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                           *SMALL_EXPIRING, "--disk-clean-ratio", "0.0001", "--disk-force-clean-ratio", "0.0002",
                           store="slave")
    async with asyncio.timeout(90):
        async with TransactionProducer(master.namesrv, "PG_promote_lost", Undecided()) as producer:
            await producer.send_in_transaction(TOPIC, b"undecided")     # in the first segment
        async with Producer(master.namesrv, "PG_promote_fill") as producer:
            mq = (await producer.send(TOPIC, b"z" * 1000)).queue
            for _ in range(0, 1500, 100):
                await asyncio.gather(*(producer.send(TOPIC, b"z" * 1000, queue=mq) for _ in range(100)))
        end = await _log_end(master.broker)
        assert end > 1 << 20
        while await _log_end(slave.broker) < end or await _min_offset(slave.broker) == 0:
            await asyncio.sleep(0.05)       # copied, and the first segment removed under pressure
        assert "undecided halves in it are lost to this slave promoted" in slave.log()
        master.kill()
        assert slave.stop() == 0
        promoted = broker_factory("--broker-role", "ASYNC_MASTER", *SMALL_EXPIRING[:4], store="slave")
        assert re.search(r"ERROR .*1 undecided half message\(s\) are in commit-log segments removed without a dead "
                         r"letter", promoted.log()), \
            promoted.log()[-3000:]
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{promoted.metrics}/metrics", timeout=5).read().decode())
        assert 'txmq_transactions_lost_total{reason="segment-removed"} 1.0' in text


async def test_a_new_slave_whose_copy_the_masters_retention_overtook_says_it_cannot_catch_up(broker_factory):
    """A new slave still copying the master's oldest segment when the master's retention removed it: the master
    closed each session (a WARNING naming an offset 'not in the log', then an ERROR on every reconnect, every
    second), the slave said only 'the master closed the connection; reconnecting', for ever, and no metric told.
    Now each side says it once at ERROR with what to do (rebuild the slave's store), and counts it: the master's
    txmq_ha_slave_sessions_behind_log_start_total, the slave's txmq_ha_slave_cannot_catch_up. The master's count
    was exported as a gauge, which rate() and increase() must not be used on: a counter now."""
    import urllib.request

    BEHIND = "txmq_ha_slave_sessions_behind_log_start_total"

    def gauges(b) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
        if b is master:
            assert re.search(r"^# TYPE txmq_ha_slave_sessions_behind_log_start(_total)? counter$", text, re.M)
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("txmq_ha_")}

    import time

    from tests.integration.test_retention_process import _admin, _plan, _wait_manifest

    # The master's cleaner removes nothing by itself (disk ratios out of reach): the first segment goes by a plan
    # once the slave is copying it. Cleaned by the 1 s retention instead, it could go before the slave (started
    # late on a loaded machine) copied a byte: the slave then started past it, got nothing, and the test timed out.
    master = broker_factory("--broker-role", "ASYNC_MASTER", "--ha-port", "0", "--ha-heartbeat-interval-ms", "200",
                            *SMALL_EXPIRING, "--disk-clean-ratio", "0.9998", "--disk-force-clean-ratio", "0.9999",
                            store="master")
    async with Producer(master.namesrv, "PG_overtaken") as producer:
        mq = (await producer.send(TOPIC, b"z" * 1000)).queue
        for _ in range(0, 1500, 100):
            await asyncio.gather(*(producer.send(TOPIC, b"z" * 1000, queue=mq) for _ in range(100)))
    proxy = _FrameProxy(master.ha, 1 << 19)      # the slave gets half the first segment, then nothing
    addr = await proxy.start()
    try:
        slave = broker_factory("--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", addr,
                               "--ha-heartbeat-interval-ms", "200", "--ha-housekeeping-interval-ms", "1500",
                               *SMALL_EXPIRING[:4], store="slave")
        async with asyncio.timeout(60):
            while await _log_end(slave.broker) == 0:
                await asyncio.sleep(0.05)
            await _wait_manifest(master.store_dir, lambda m: m["segments"] and m["segments"][0]["sealed"])
            plan = _plan(master.store_dir, int(time.time() * 1000) + 5000, retention_ms=1)
            plan["segments"] = plan["segments"][:1]
            rc, reply = await asyncio.to_thread(_admin, master, plan, master.store_dir.parent, "overtake")
            assert rc == 0 and reply["segments_removed"] == [SEGMENT], reply
            assert await _min_offset(master.broker) == 1 << 20     # the master's retention removed it
            proxy.stop = 1 << 40                                   # later sessions relay everything
            while (await asyncio.to_thread(gauges, slave)).get("txmq_ha_slave_cannot_catch_up") != 1:
                await asyncio.sleep(0.1)
            while (await asyncio.to_thread(gauges, master))[BEHIND] < 4:
                await asyncio.sleep(0.1)
            closed = (await asyncio.to_thread(gauges, master))[BEHIND]
            while (await asyncio.to_thread(gauges, master))[BEHIND] < closed + 3:
                await asyncio.sleep(0.1)        # sessions after the slave said it: not said again each second
        assert slave.log().count("This slave cannot catch up by itself: rebuild its store") == 1
        after = slave.log_path.read_text(errors="replace").split("This slave cannot catch up by itself")[1]
        assert after.count("replication from") <= 1, after[-3000:]
        said = [line for line in master.log().splitlines() if "cannot catch up" in line]
        assert 1 <= len(said) <= 2 and all(" ERROR " in line and "Rebuild the slave's store" in line
                                            for line in said), said
    finally:
        await proxy.close()


async def test_a_slave_promoted_after_its_cleaner_followed_its_master_reports_no_decided_half_as_lost(tmp_path):
    """The other side of naming removed undecided halves at promotion: a slave started once (its snapshot then),
    whose cleaner removed, after its master, segments holding halves and the commits that decided them. Its table
    has no decision for them (the op records went too): they are not 'lost', and recovery must not say so."""
    from producer import LocalTransactionState, TransactionProducer
    from tests.support.broker_process import BrokerProcess

    class Commits:
        def execute_local_transaction(self, msg, arg):
            return LocalTransactionState.COMMIT_MESSAGE

        async def check_local_transaction(self, msg):
            return LocalTransactionState.COMMIT_MESSAGE

    started = []
    try:
        ns, master, slave = _expiring_master_slave(tmp_path, "broker-d", started)
        async with asyncio.timeout(90):
            async with TransactionProducer(ns.addr, "PG_promote_decided", Commits()) as producer:
                for i in range(3):
                    await producer.send_in_transaction(TOPIC, f"committed-{i}".encode())    # first segment
            async with Producer(ns.addr, "PG_promote_fill") as producer:
                mq = (await producer.send(TOPIC, b"z" * 1000)).queue
                for _ in range(0, 1500, 100):
                    await asyncio.gather(*(producer.send(TOPIC, b"z" * 1000, queue=mq) for _ in range(100)))
            end = await _log_end(master.broker)
            while await _log_end(slave.broker) < end or await _min_offset(slave.broker) == 0:
                await asyncio.sleep(0.05)       # copied, and the first segment removed after the master's
            master.kill()
            assert slave.stop() == 0
            promoted = BrokerProcess(tmp_path / "slave", "--broker-role", "ASYNC_MASTER", *SMALL_EXPIRING[:4]).start()
            started.append(promoted)
            assert "removed without a dead letter" not in "\n".join(
                line for line in promoted.log().splitlines() if " ERROR " in line), promoted.log()[-3000:]
    finally:
        for p in reversed(started):
            p.kill()


async def test_a_slave_with_no_name_server_says_at_start_that_its_cleaner_removes_no_expired_segment(broker_factory):
    """It cannot learn its master's log start, so it keeps every expired segment until disk pressure: the first
    word of it came once the disk was past --disk-clean-ratio, then ERRORs at the force ratio."""
    master = _master(broker_factory, role="ASYNC_MASTER")
    slave = _slave(broker_factory, master)
    assert "its cleaner removes no expired segment" in slave.log()
    assert "removes no expired segment" not in master.log()


MASTER_ACL = """\
globalWhiteRemoteAddresses: [{white}]
accounts:
  - accessKey: txmqadmin
    secretKey: admin-secret
    admin: true
"""


async def test_a_slave_whose_copies_its_master_refuses_says_so_in_a_gauge(tmp_path):
    """A master with an ACL that does not whitelist its slave refuses the slave's unsigned GET_ALL_CONSUMER_OFFSET
    (RocketMQ: whitelist the slave). The slave follows the master's log all the same, and the copies' refusal was
    a WARNING once: its metrics (connected 1, lag 0) were a sound slave's for as long as it lasted, and consumers
    failing over to it went on from offsets as old. txmq_ha_slave_sync_age_seconds grows meanwhile (an alert
    fires past 5 minutes) and is back near 0 once the master whitelists the slave."""
    from tests.support.broker_process import BrokerProcess
    from tests.support.cluster_process import NamesrvProcess, cluster_flags

    started = []
    acl = tmp_path / "plain_acl.yml"
    acl.write_text(MASTER_ACL.format(white=""))
    try:
        ns = NamesrvProcess(tmp_path / "namesrv.log").start()
        started.append(ns)
        master = BrokerProcess(tmp_path / "master", *cluster_flags(ns.addr, "broker-acl", 500), "--broker-role",
                               "ASYNC_MASTER", "--ha-port", "0", "--acl-file", str(acl)).start()
        started.append(master)
        slave = BrokerProcess(tmp_path / "slave", *cluster_flags(ns.addr, "broker-acl", 500), "--broker-role",
                              "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                              "--slave-sync-interval-ms", "200").start()
        started.append(slave)
        async with asyncio.timeout(60):
            while True:         # following, its copies refused for 10 sync intervals and more
                gauges = _scrape(slave.metrics)
                if gauges.get("txmq_ha_slave_connected") == 1 and "refused GET_ALL_CONSUMER_OFFSET" in slave.log() \
                        and gauges["txmq_ha_slave_sync_age_seconds"] >= 2.0:
                    break
                await asyncio.sleep(0.2)
            acl.write_text(MASTER_ACL.format(white='"127.0.0.1"'))   # reloaded by the master as it changes
            while _scrape(slave.metrics)["txmq_ha_slave_sync_age_seconds"] >= 1.0:
                await asyncio.sleep(0.2)
        assert "consumer offsets copied from master" in slave.log()
        # the alert's threshold follows the interval (a fixed 5 minutes fired for good past 100 s intervals)
        assert gauges["txmq_ha_slave_sync_interval_seconds"] == 0.2
        assert "txmq_ha_slave_sync_interval_seconds" not in _scrape(master.metrics)
    finally:
        for p in reversed(started):
            p.kill()


async def test_a_slave_refuses_to_delete_a_topic_its_consumers_fail_over_to(broker_factory):
    """DELETE_TOPIC_IN_BROKER sent to a slave removed its consume queues (with the deleted-topic mark) and answered
    SUCCESS; the master kept the topic, its next records were indexed on the slave from their own queue offset on,
    and a consumer failed over to the slave found the queue starting there: every message before the delete, still
    on the master and in the slave's log, never served by the slave again (nor after its restart: the mark). A
    RocketMQ 4.9.8 slave refuses it (validateSlave: "Can't modify topic or subscription group from slave broker");
    so does this one, and its queue stays whole."""
    from protocol.message import decode_records

    master = _master(broker_factory)
    slave = _slave(broker_factory, master)
    pool = ConnectionPool()
    topic = "KeptOnTheSlave"
    try:
        async with asyncio.timeout(60), Producer(master.namesrv, "PG_kept") as producer:
            mq = await _one_queue_topic_of_three(pool, master, producer, topic)
            deleted = await pool.request(slave.broker, RemotingCommand.request(RequestCode.DELETE_TOPIC_IN_BROKER,
                                                                               {"topic": topic}), 5.0)
            res = await producer.send(topic, b"new3", queue=mq)
            assert (res.status, res.queue_offset) == (SendStatus.SEND_OK, 3)    # on the slave too: SYNC_MASTER
            resp = await pool.request(slave.broker, RemotingCommand.request(RequestCode.PULL_MESSAGE, {
                "consumerGroup": "CG_kept", "topic": topic, "queueId": 0, "queueOffset": 0, "maxMsgNums": 8,
                "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": "*",
                "subVersion": 1, "expressionType": "TAG"}), 5.0)
            served = [m.body for m in decode_records(resp.body_bytes())] if resp.code == ResponseCode.SUCCESS else []
        assert (resp.code, served) == (ResponseCode.SUCCESS, [b"old0", b"old1", b"old2", b"new3"]), \
            (resp.code, resp.remark, resp.ext_fields)
        assert deleted.code == ResponseCode.SYSTEM_ERROR and "from slave broker" in deleted.remark, deleted.remark
    finally:
        await pool.close()


async def test_a_slave_refuses_topic_and_group_changes_so_a_failed_over_group_keeps_its_offsets(tmp_path):
    """RocketMQ 4.9.8's slave refuses UPDATE_AND_CREATE_TOPIC (17), UPDATE_AND_CREATE_SUBSCRIPTIONGROUP (200) and
    DELETE_SUBSCRIPTIONGROUP (207) as it does DELETE_TOPIC_IN_BROKER (validateSlave: its topics and groups are its
    master's). This slave took them: with its master away (when an operator reaches for the slave), a
    `deleteSubGroup -r` aimed at it answered SUCCESS and removed the group's copied offsets, so consumers failing
    over to the slave were answered 0 where 17 was (a young queue: from its start, every message again); with the
    master there, its next copy put them back after all. Refused now, with 4.9.8's words, and the offset stays; so
    are a group's and a topic's settings made there (the next copy undid them)."""
    started = []
    pool = ConnectionPool()
    group = "CG_failed_over"
    query = RemotingCommand.request(RequestCode.QUERY_CONSUMER_OFFSET, {"consumerGroup": group, "topic": TOPIC,
                                                                         "queueId": 0})
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-vs", started, "--slave-sync-interval-ms", "200")
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_validate_slave") as producer:
                mq = await _until_replicating(producer)
            query.ext_fields["queueId"] = str(mq.queue_id)
            async with PullConsumer(ns.addr, group) as consumer:
                await _fetch_queues_once_routed(consumer, TOPIC)
                await consumer.commit_offset(mq, 17)            # to the master, while it is there
            await _until_slave_has_offset(slave, group, mq, 17)
            master.kill()
            answers = [await pool.request(slave.broker, request, 5.0) for request in (
                RemotingCommand.request(RequestCode.DELETE_SUBSCRIPTIONGROUP, {"groupName": group,
                                                                               "removeOffset": "true"}),
                RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
                                        body=json.dumps({"groupName": group, "consumeEnable": False}).encode()),
                RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
                    "topic": "MadeOnTheSlave", "readQueueNums": 2, "writeQueueNums": 2, "perm": 6}))]
            offset = await pool.request(slave.broker, query, 5.0)
            topics = await _topic_table(pool, slave.broker)
        assert (offset.code, offset.int_field("offset") if offset.code == ResponseCode.SUCCESS else None) == \
            (ResponseCode.SUCCESS, 17)
        assert [(a.code, a.remark) for a in answers] == [(ResponseCode.SYSTEM_ERROR, "Can't modify topic or "
                                                          "subscription group from slave broker, please execute it "
                                                          "from master broker.")] * 3
        assert "MadeOnTheSlave" not in topics
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


def _series_of(metrics_addr: str, group: str) -> list[str]:
    import urllib.request
    scraped = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    return [line for line in scraped.splitlines() if f'consumer_group="{group}"' in line and not line.startswith("#")]


async def test_a_group_the_slave_forgets_as_its_master_deleted_it_leaves_the_slaves_delivery_series(tmp_path):
    """A group deleted on the master (deleteSubGroup -r) loses its delivery series there (rocketmq_messages_out,
    rocketmq_throughput_out: forget_consumer_group), and its offsets on the slave once the master's answers have
    missed it for --slave-group-forget-ms. The slave kept the series of its own pulls of the group (failed over, or
    slave_read_enable) for good: in each scrape, and a group made again under the name went on from the old
    counts. The slave forgets them with the offsets, as its master did."""
    started = []
    pool = ConnectionPool()
    group = "CG_read_from_the_slave"
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-fs", started, "--slave-sync-interval-ms", "200",
                                                       "--slave-group-forget-ms", "1000")
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_forgotten_series") as producer:
                mq = await _until_replicating(producer)
                for i in range(3):
                    await producer.send(TOPIC, f"s{i}".encode(), queue=mq)
            async with PullConsumer(ns.addr, group) as consumer:
                await _fetch_queues_once_routed(consumer, TOPIC)
                await consumer.commit_offset(mq, 2)            # to the master
            await _until_slave_has_offset(slave, group, mq, 2)
            resp = await pool.request(slave.broker, RemotingCommand.request(RequestCode.PULL_MESSAGE, {
                "consumerGroup": group, "topic": TOPIC, "queueId": mq.queue_id, "queueOffset": 0, "maxMsgNums": 8,
                "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": "*", "subVersion": 1,
                "expressionType": "TAG"}), 5.0)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            assert await asyncio.to_thread(_series_of, slave.metrics, group)    # the slave's own deliveries
            gone = await pool.request(master.broker, RemotingCommand.request(
                RequestCode.DELETE_SUBSCRIPTIONGROUP, {"groupName": group, "removeOffset": "true"}), 3.0)
            assert gone.code == ResponseCode.SUCCESS, gone.remark
            while "consumer offsets of 1 group(s) removed as master" not in slave.log():
                await asyncio.sleep(0.1)
            series = await asyncio.to_thread(_series_of, slave.metrics, group)
        assert series == []
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def _lag_series(metrics_addr: str, group: str, topic: str) -> float | None:
    """``group``'s rocketmq_consumer_lag_messages in ``topic`` in one scrape, or None without that series."""
    want = f'rocketmq_consumer_lag_messages{{consumer_group="{group}",topic="{topic}"}}'
    found = [line.split()[-1] for line in await asyncio.to_thread(_series_of, metrics_addr, group)
             if line.startswith(want)]
    return float(found[0]) if found else None


async def test_a_slave_counts_no_lag_of_a_group_online_only_on_its_master(tmp_path):
    """A group moved off a topic (its consumers now read another) keeps its offset there: its master leaves that
    topic out of rocketmq_consumer_lag_messages while the group is online, as consumer-progress does. Its slave
    copies the offset, sees none of the group's consumers (they beat the master) and counted every topic: the old
    one's lag (5 here) grew there with every message copied, an alert on the slave alone that never cleared. A
    slave counts the groups online on it only (failed over; a stock consumer, which beats it too): their
    members' topics, as the master's."""
    started = []
    pool = ConnectionPool()
    group = "CG_moved_off"
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-lag", started, "--slave-sync-interval-ms",
                                                      "200")
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_moved_off") as producer, PullConsumer(ns.addr, group) as consumer:
                mq = await _until_replicating(producer)
                await _fetch_queues_once_routed(consumer, TOPIC)
                read = await consumer.max_offset(mq)
                await consumer.commit_offset(mq, read)                    # to the master
                consumer.subscriptions = {"Elsewhere": "*"}             # the group now reads another topic only
                await consumer.heartbeat()
                for i in range(5):
                    assert (await producer.send(TOPIC, b"not for it %d" % i, queue=mq)).status is SendStatus.SEND_OK
                await _until_slave_has_offset(slave, group, mq, read)
                # Online on the slave too (a member naming no topic: it may read any): counted there, so the
                # slave's gauge has the copied offset and messages.
                beat = RemotingCommand.request(RequestCode.HEART_BEAT, body=json.dumps({
                    "clientID": "127.0.0.1@on-slave", "producerDataSet": [], "consumerDataSet": [{
                        "groupName": group, "consumeType": "CONSUME_ACTIVELY", "messageModel": "CLUSTERING",
                        "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "unitMode": False,
                        "subscriptionDataSet": []}]}).encode())
                assert (await pool.request(slave.broker, beat, 5.0)).code == ResponseCode.SUCCESS
                while await _lag_series(slave.metrics, group, TOPIC) != 5:
                    await asyncio.sleep(0.1)
                await pool.close()                                  # gone from the slave, online on the master
                assert await _lag_series(master.metrics, group, TOPIC) is None
                for _ in range(50):     # the slave's gauge is refreshed every second
                    if (lag := await _lag_series(slave.metrics, group, TOPIC)) is None:
                        break
                    await asyncio.sleep(0.1)
                assert lag is None, f"the slave counts a lag of {lag} its master leaves out"
                assert await _lag_series(master.metrics, group, TOPIC) is None
    finally:
        await pool.close()
        for p in reversed(started):
            p.kill()


async def test_a_slave_promoted_from_under_a_java_master_delivers_no_delayed_message_its_master_delivered(
        broker_factory):
    """A Java master keeps its delay progress in delayOffset.json, not in its log (no progress record): a txmq slave
    of one, promoted, took its copied log alone and had every delayed message still in it waiting again (3 here),
    its master's deliveries of them (copied too) made a second time when due. The slave copies the master's
    GET_ALL_DELAY_OFFSET (slaveMasterDelayOffset.json, as tests/unit/test_slave_sync.py shows it written) and
    its start takes it; a level the copy has not seen delivered still waits."""
    from broker.schedule.progress import write_master_copy

    master = _master(broker_factory)
    slave = _slave(broker_factory, master)
    async with asyncio.timeout(60):
        async with Producer(master.namesrv, "PG_java_delays") as producer:
            await _until_replicating(producer)
            for level, n in ((18, 3), (17, 2)):         # 2 h and 1 h: none due while the test runs
                for i in range(n):
                    res = await producer.send(TOPIC, f"l{level}-{i}".encode(), delay_level=level)
                    assert res.status is SendStatus.SEND_OK        # (SYNC_MASTER: the slave has it)
        master.kill()
        assert slave.stop() == 0
        # What the slave copied of a Java master that delivered level 18's three and none of level 17's
        await asyncio.to_thread(write_master_copy, str(slave.store_dir / "config"), {17: 0, 18: 3})
        promoted = broker_factory("--broker-role", "ASYNC_MASTER", store="slave")
        while (waiting := await asyncio.to_thread(_waiting, promoted.metrics)).get("17") != 2:
            await asyncio.sleep(0.1)        # (the gauges refresh every second)
    assert waiting.get("18") == 0, waiting
    assert "delay progress taken from the copy of a Java master's" in promoted.log()


async def test_a_stale_copy_of_a_java_masters_delay_progress_skips_nothing_under_a_txmq_master(broker_factory,
                                                                                             tmp_path):
    """slaveMasterDelayOffset.json is left in config/ from a slave's time under a Java master (level 18 at 3 there).
    Put under a txmq master (its store rebuilt), the slave never wrote or removed it, and every start took it: the
    slave's own levels raised past its new master's three undelivered level-18 messages (saved in its
    delayOffset.json too), promoted it had them as delivered and never delivered them (0 of 3 waiting): lost
    without a word. A slave takes no copy at start (its promotion does), and one whose master is a txmq broker
    removes a copy left there."""
    from broker.schedule.progress import MASTER_COPY_NAME, write_master_copy

    config = tmp_path / "slave" / "config"
    await asyncio.to_thread(write_master_copy, str(config), {18: 3})    # from under a Java master, long ago
    started = []
    try:
        ns, master, slave = _name_server_master_slave(tmp_path, "broker-stale", started, "--slave-sync-interval-ms",
                                                      "200")
        async with asyncio.timeout(60):
            async with Producer(ns.addr, "PG_stale_copy") as producer, \
                    PullConsumer(ns.addr, "CG_stale_copy") as consumer:
                mq = await _until_replicating(producer)
                for level, n in ((18, 3), (17, 2)):         # 2 h and 1 h: none due while the test runs
                    for i in range(n):
                        res = await producer.send(TOPIC, f"l{level}-{i}".encode(), delay_level=level)
                        assert res.status is SendStatus.SEND_OK        # (SYNC_MASTER: the slave has it)
                await _fetch_queues_once_routed(consumer, TOPIC)
                for offset in (1, 2):   # the second copied: a whole sync (log bounds and all) ended after the first
                    await consumer.commit_offset(mq, offset)
                    await _until_slave_has_offset(slave, "CG_stale_copy", mq, offset)
            master.kill()
            assert slave.stop() == 0
            assert not (config / MASTER_COPY_NAME).exists(), "a txmq master's slave kept a Java master's progress"
            promoted = broker_factory("--broker-role", "ASYNC_MASTER", store="slave")
            while (waiting := await asyncio.to_thread(_waiting, promoted.metrics)).get("17") != 2:
                await asyncio.sleep(0.1)        # (the gauges refresh every second)
        assert waiting.get("18") == 3, waiting
    finally:
        for p in reversed(started):
            p.kill()


async def test_a_promoted_slaves_later_start_skips_no_delayed_message_sent_to_it_past_its_java_masters_copy(
        broker_factory):
    """The copy of a Java master's delay progress may be further on than the slave's log (an ASYNC_MASTER's
    slave lags: level 18 at 5 there, 3 here): the promotion caps it at the log's 3. The copy stayed in config/ and
    every later start took it again over the promoted master's own progress: two level-18 messages sent to it
    since (offsets 3 and 4, undelivered) were taken as delivered at its next restart (0 of 2 waiting): lost. Taken,
    the copy goes once the start's delayOffset.json holds it."""
    from broker.schedule.progress import MASTER_COPY_NAME, write_master_copy

    master = _master(broker_factory)
    slave = _slave(broker_factory, master)
    async with asyncio.timeout(60):
        async with Producer(master.namesrv, "PG_java_delays") as producer:
            await _until_replicating(producer)
            for i in range(3):
                assert (await producer.send(TOPIC, b"l18-%d" % i, delay_level=18)).status is SendStatus.SEND_OK
        master.kill()
        assert slave.stop() == 0
        await asyncio.to_thread(write_master_copy, str(slave.store_dir / "config"), {18: 5})
        promoted = broker_factory("--broker-role", "ASYNC_MASTER", store="slave")
        async with Producer(promoted.namesrv, "PG_java_delays") as producer:
            for i in range(2):
                assert (await producer.send(TOPIC, b"new-%d" % i, delay_level=18)).status is SendStatus.SEND_OK
            assert (await producer.send(TOPIC, b"a marker", delay_level=17)).status is SendStatus.SEND_OK
        while (await asyncio.to_thread(_waiting, promoted.metrics)).get("18") != 2:
            await asyncio.sleep(0.1)
        assert promoted.stop() == 0
        assert not (slave.store_dir / "config" / MASTER_COPY_NAME).exists()
        again = broker_factory("--broker-role", "ASYNC_MASTER", store="slave")
        while (waiting := await asyncio.to_thread(_waiting, again.metrics)).get("17") != 1:
            await asyncio.sleep(0.1)        # (the gauges refresh every second)
    assert waiting.get("18") == 2, waiting
