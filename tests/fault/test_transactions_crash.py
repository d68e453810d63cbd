"""Transactions across a broker killed by SIGKILL and started again on the same store and ports.

Each crash is paced by progress: the broker is killed once N halves (or decisions) were acknowledged,
never after a sleep. The snapshot interval is an hour, so whatever the crash loses of the in-memory
index only the log can give back; check intervals are long, so "asked once" means the same on a fast
machine as on a slow one. Waits are for events (a check arriving) or for the broker's admin view to say
so, each bounded by the test's deadline.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import urllib.request

import pytest

from broker.store.checkpoint import read_checkpoint
from broker.store.manifest import NUL_FREE_FILE
from broker.store.mapped_file import last_nonzero
from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import LanguageCode, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import ResponseError
from protocol.message import decode_offset_msg_id
from tests.support.bounded import bounded
from tests.support.cluster_process import request

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

GROUP = "PG_crash"
TOPIC = "TxCrash"
HALVES = 12
# No snapshot between the halves and the crash; after its first check a transaction waits a minute.
FLAGS = ("--transaction-snapshot-interval-s", "3600", "--transaction-check-interval-ms", "60000")


def _fixed(b, *flags: str) -> tuple[str, ...]:
    """The flags that start a broker again on ``b``'s ports (so clients find it where it was)."""
    return ("--port", str(b.broker_port), "--namesrv-port", b.namesrv.rsplit(":", 1)[1], *flags)


class Listener:
    """Leaves every local transaction undecided; records the checks it is asked and answers ``answer``."""

    def __init__(self, answer: S = S.COMMIT_MESSAGE):
        self.answer = answer
        self.asked: list[bytes] = []
        self.changed = asyncio.Event()

    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    def check_local_transaction(self, msg):
        self.asked.append(msg.body)
        self.changed.set()
        return self.answer

    async def until_asked(self, n: int) -> None:
        while len(self.asked) < n:
            self.changed.clear()
            await self.changed.wait()


async def _listed(b) -> dict:
    """`python -m broker admin list`: {"pending": rows, "total": n, "dead_lettered": n}."""
    return json.loads((await request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 10000})).body_bytes())


async def _metric(b, name: str, label: str = "", group: str = GROUP) -> float:
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode())
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'producer_group="{group}"' in line and label in line)


def _in_doubt(listed: dict) -> set[tuple]:
    """What the admin view says of each undecided transaction that a crash must not change."""
    return {(row["commit_log_offset"], row["queue_offset"], row["uniq_key"], row["checks"], row["group"],
             row["topic"]) for row in listed["pending"]}


async def _until_dead_lettered(b, n: int) -> None:
    """Until the broker has dead-lettered ``n`` transactions (no event says so but its admin view)."""
    while (await _listed(b))["dead_lettered"] < n:
        await asyncio.sleep(0.05)


@bounded(120)
async def test_halves_never_checked_before_a_crash_are_checked_with_their_sender_after_it(broker_factory):
    """The sender of a half lived in the snapshot and in check records only: halves stored since the last
    snapshot and never checked lost it in a kill -9, and their first check after the restart went to any
    producer of the group (counted as rerouted, "sender-unknown")."""
    # Never due before the crash however slow the machine (a check would name the sender in its record); due at
    # once after it, and answered only once the admin view was read (a check or a decision may come first).
    b = broker_factory(*FLAGS, "--transaction-timeout-ms", str(3600 * 1000))
    answer = asyncio.Event()

    class Held(Listener):
        async def check_local_transaction(self, msg):
            got = super().check_local_transaction(msg)
            await answer.wait()
            return got

    listener = Held()
    producer = TransactionProducer(b.namesrv, GROUP, listener, instance_name="sender", retries=0)
    await producer.start()
    try:
        for i in range(HALVES):
            assert (await producer.send_in_transaction(TOPIC, f"order {i}".encode())).state is S.UNKNOW
        assert listener.asked == [], "checked before the crash: the test would not mean what it says"
        before = _in_doubt(await _listed(b))
        b.kill()                    # after HALVES acknowledged halves, before any snapshot or check names them
        b = await asyncio.to_thread(broker_factory, *_fixed(b, *FLAGS, "--transaction-timeout-ms", "0"))
        listed = await _listed(b)
        assert listed["total"] == HALVES        # the admin view, as before (but its checks: one may be out now)
        assert {row[:3] + row[4:] for row in _in_doubt(listed)} == {row[:3] + row[4:] for row in before}
        assert {row["owner"].removesuffix(" (gone)") for row in listed["pending"]} == {producer.client_id}
        answer.set()
        await listener.until_asked(HALVES)      # the sender alone reconnects: every check is its own
        while (await _listed(b))["total"]:      # the answers are being written
            await asyncio.sleep(0.05)
        assert await _metric(b, "txmq_transaction_checks_rerouted_total") == 0
        assert await _metric(b, "txmq_transaction_checks_total") == HALVES
    finally:
        await producer.shutdown()


@bounded(120)
async def test_checks_counted_before_a_crash_are_not_given_again_after_it(broker_factory):
    """A transaction checked twice of its three before a kill -9 is checked at most once more after the restart,
    then dead-lettered: the count is in the check records, not only in the snapshot the crash made stale."""
    flags = (*FLAGS[:2], "--transaction-check-interval-ms", "500", "--transaction-timeout-ms", "500",
             "--transaction-check-max", "3")
    b = broker_factory(*flags)
    listener = Listener(answer=S.UNKNOW)
    producer = TransactionProducer(b.namesrv, GROUP, listener, instance_name="sender", retries=0)
    await producer.start()
    try:
        await producer.send_in_transaction(TOPIC, b"in doubt")
        await listener.until_asked(2)       # two checks written (each before it is sent) and answered
        b.kill()
        before = len(listener.asked)        # 2, or 3 when the third was sent before the kill landed
        b = await asyncio.to_thread(broker_factory, *_fixed(b, *flags))
        await _until_dead_lettered(b, 1)
        assert len(listener.asked) <= 3, f"{before} checks before the crash, {len(listener.asked) - before} after"
        assert (await _listed(b))["total"] == 0
    finally:
        await producer.shutdown()


@bounded(120)
async def test_an_end_for_a_half_dead_lettered_after_a_restart_is_refused_saying_so(broker_factory):
    """The producer's local transaction outlives the broker's crash; meanwhile the restarted broker checks the
    half to its limit and dead-letters it. The producer's COMMIT then is refused, and says why: never taken
    as done, never delivered."""
    flags = (*FLAGS[:2], "--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "300",
             "--transaction-check-max", "1")
    b = broker_factory(*flags)
    stored, decided = asyncio.Event(), asyncio.Event()

    class Slow(Listener):
        async def execute_local_transaction(self, msg, arg):
            stored.set()
            await decided.wait()
            return S.COMMIT_MESSAGE

    listener = Slow(answer=S.UNKNOW)
    producer = TransactionProducer(b.namesrv, GROUP, listener, instance_name="sender", retries=0)
    await producer.start()
    try:
        sending = asyncio.ensure_future(producer.send_in_transaction(TOPIC, b"late"))
        await stored.wait()                 # the half is acknowledged: its local transaction runs
        b.kill()
        b = await asyncio.to_thread(broker_factory, *_fixed(b, *flags))
        await _until_dead_lettered(b, 1)
        decided.set()
        with pytest.raises(ResponseError) as refused:
            await sending
        assert refused.value.code == ResponseCode.TRANSACTION_FAILED
        assert "DEAD" in str(refused.value) and "COMMIT refused" in str(refused.value), str(refused.value)
        assert (await _listed(b))["dead_lettered"] == 1
    finally:
        decided.set()
        await producer.shutdown()


@pytest.mark.parametrize("rebuild", [False, True], ids=["", "consumequeue-rebuilt"])
@bounded(120)
async def test_a_restart_does_not_spend_a_check_before_the_interval_since_the_last(broker_factory, rebuild):
    """Checked once, a transaction is checked again an interval later, restarts or not: recovered due at once (and
    deferred until its producer came back, then due at once), each kill -9 spent a check, 4 in 15 s at a 60 s
    interval, and a broker in a crash loop dead-lettered a transaction whose local transaction was still running
    after check_max restarts, not check_max intervals. Its last check is known by its check record's time (the
    first restart, no snapshot since) and by the snapshot's (the second: a clean stop writes one). So too on starts
    that rebuild every consume queue from the whole log (consumequeue/ removed): the op queue rebuilt, the check
    record's store time is found again."""
    flags = (*FLAGS, "--transaction-timeout-ms", "500")     # an interval of 60 s: no check is due for the test
    b = broker_factory(*flags)
    listener = Listener(answer=S.UNKNOW)
    producer = TransactionProducer(b.namesrv, GROUP, listener, instance_name="sender", retries=0)
    await producer.start()
    try:
        await producer.send_in_transaction(TOPIC, b"in doubt")
        await listener.until_asked(1)
        if rebuild:
            await _checkpointed(b)      # (a log with no checkpoint is scanned whole anyway: no rebuild)
        for crash in (True, False):
            b.kill() if crash else b.stop()
            said = len(b.log_path.read_text())
            if rebuild:
                shutil.rmtree(b.store_dir / "consumequeue")
            b = await asyncio.to_thread(broker_factory, *_fixed(b, *flags))
            assert rebuild == ("rebuilt from the whole log" in b.log_path.read_text()[said:])
            # The producer is back once it heartbeats: a check due at once goes out then (its deferral ends).
            assert await producer.heartbeat()
            (row,) = (await _listed(b))["pending"]
            assert row["owner"] == producer.client_id, row
            assert row["checks"] == 1 and row["next_check_in_ms"] > 30_000, row
        assert len(listener.asked) == 1, f"{len(listener.asked) - 1} checks spent by two restarts"
    finally:
        await producer.shutdown()


@bounded(120)
async def test_immunity_runs_from_the_store_time_across_a_crash_not_from_the_restart(broker_factory):
    """A half's first check is due its immunity (CHECK_IMMUNITY_TIME_IN_SECONDS, else the timeout) after it was
    stored, before a crash and after it: recovery must not start the immunity again, nor cut it short. The
    admin view says when each is due and how old it is; their sum is the immunity, however long the restart
    took (only the wall and monotonic clocks' few ms of rounding apart)."""
    timeout_ms = 1200 * 1000
    flags = (*FLAGS, "--transaction-timeout-ms", str(timeout_ms))
    b = broker_factory(*flags)
    producer = TransactionProducer(b.namesrv, GROUP, Listener(), instance_name="sender", retries=0)
    await producer.start()
    try:
        await producer.send_in_transaction(TOPIC, b"own immunity",
                                           properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "600"})
        await producer.send_in_transaction(TOPIC, b"the timeout")
        b.kill()
        b = await asyncio.to_thread(broker_factory, *_fixed(b, *flags))
        rows = sorted((await _listed(b))["pending"], key=lambda row: row["commit_log_offset"])
    finally:
        await producer.shutdown()
    assert len(rows) == 2
    for row, immunity_ms in zip(rows, (600 * 1000, timeout_ms)):
        assert row["checks"] == 0
        assert abs(row["age_ms"] + row["next_check_in_ms"] - immunity_ms) <= 50, row


@bounded(120)
async def test_a_half_whose_real_topic_a_crash_tore_is_dead_lettered_not_checked(broker_factory, tmp_path):
    """A tear inside the half's properties (the store checks the body's CRC, not the properties) can leave its
    REAL_TOPIC a prefix of the topic followed by zeros, not an empty one: no producer could be asked about a
    message for that topic, whose commit could go nowhere (a topic name of zeros). It is dead-lettered as a half
    naming no topic is, and its producer never asked.

    Recovery cuts such a record at start-up when it lies past the store's nul_free_from (tests/fault/
    test_torn_properties.py); this is the store an older broker wrote, which has no nul_free_from and whose
    records keep the old checks: the transaction layer is the defence there."""
    flags = (*FLAGS, "--transaction-timeout-ms", str(3600 * 1000))
    b = broker_factory(*flags)
    listener = Listener()
    producer = TransactionProducer(b.namesrv, GROUP, listener, instance_name="sender", retries=0)
    await producer.start()
    try:
        sent = await producer.send_in_transaction(TOPIC, b"torn")
        assert sent.state is S.UNKNOW
        offset = decode_offset_msg_id(sent.send_result.offset_msg_id)[2]
        b.kill()
        with open(tmp_path / "store" / "commitlog" / f"{0:020d}", "r+b") as segment:
            segment.seek(offset)
            record = segment.read(struct.unpack(">i", segment.read(4))[0] - 4)
            at = record.index(b"REAL_TOPIC\x01" + TOPIC.encode()) + len("REAL_TOPIC\x01Tx")
            segment.seek(offset + 4 + at)
            segment.write(bytes(len(record) - at))       # torn: zeros from inside the topic's name on
        (tmp_path / "store" / NUL_FREE_FILE).unlink()   # as an older broker left its store
        b = await asyncio.to_thread(broker_factory, *_fixed(b, *FLAGS, "--transaction-timeout-ms", "0"))
        while (await _listed(b))["dead_lettered"] < 1:
            assert listener.asked == [], "its producer was asked about a half naming no topic"
            await asyncio.sleep(0.05)
        assert listener.asked == []
        assert await _metric(b, "txmq_transaction_dead_letters_total", 'reason="uncheckable-half"') == 1
    finally:
        await producer.shutdown()


# A stock producer's first frames to a broker, as ali-ons 3.12 sent them (shared/vectors/ali-ons.jsonl,
# txproducer-stub; its header values those of a Java TransactionMQProducer): its halves (SEND_MESSAGE_V2, whose
# header names the producer group, not the instance) come before its first HEART_BEAT, which alone names it.
STOCK_GROUP = "PID_probe_capture"
STOCK_ID = "192.0.2.2@30674"
STOCK_BEAT = json.dumps({"clientID": STOCK_ID, "consumerDataSet": [],
                         "producerDataSet": [{"groupName": STOCK_GROUP}]}, separators=(",", ":")).encode()


def _stock_half(i: int, uniq_key: str) -> RemotingCommand:
    props = (f"TAGS\x01TagTx\x02KEYS\x01probe-tx-{i}\x02UNIQ_KEY\x01{uniq_key}\x02TRAN_MSG\x01true\x02"
             f"PGROUP\x01{STOCK_GROUP}\x02")
    return RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, {
        "a": STOCK_GROUP, "b": "ProbeTopic", "c": "TBW102", "d": "4", "e": str(i), "f": "4", "g": "1795270104442",
        "h": "0", "i": props, "j": "0", "k": "false"}, f"tx {i} from ali-ons".encode(),
        language=LanguageCode.JAVA, version=121)


class StockProducer:
    """A raw connection that says what the stock producer said, and records the checks it is sent (unanswered)."""

    def __init__(self):
        self.asked: list[str] = []
        self.changed = asyncio.Event()
        self.conn = None

    def __call__(self, conn, cmd):
        if cmd.code == RequestCode.CHECK_TRANSACTION_STATE:
            self.asked.append(cmd.ext_fields["msgId"])
            self.changed.set()
        return None

    async def open(self, b) -> "StockProducer":
        host, _, port = b.broker.rpartition(":")
        self.conn = await open_connection(host, int(port), self)
        return self

    async def call(self, cmd: RemotingCommand) -> None:
        answer = await self.conn.request(cmd, 5)
        assert answer.code == ResponseCode.SUCCESS, answer.remark

    async def beat(self) -> None:
        await self.call(RemotingCommand.request(RequestCode.HEART_BEAT, None, STOCK_BEAT,
                                                language=LanguageCode.JAVA, version=121))

    async def until_asked(self, n: int) -> None:
        while len(self.asked) < n:
            self.changed.clear()
            await self.changed.wait()


@bounded(120)
async def test_halves_sent_before_the_first_heartbeat_are_asked_of_its_instance_after_a_kill(broker_factory):
    """A stock producer's first halves carry no client id (nor can their record name one): the heartbeat after them
    named the connection in memory only, until a snapshot written once something else changed. Killed then, the
    broker sent their checks to any producer of the group ("sender-unknown"), and its admin view showed no sender.
    Now the heartbeat is answered once a sender record names the instance for each of those halves."""
    keys = ["120EDF0120FE1D2C77184939FCCD35F3", "82D70A8D669F67AF893C2E22D68EFDA6", "40F3C00247CDC4B6F798F1619106535A"]
    b = broker_factory(*FLAGS, "--transaction-timeout-ms", str(3600 * 1000))      # never due before the kill
    sender = await StockProducer().open(b)
    try:
        for i, key in enumerate(keys):
            await sender.call(_stock_half(i, key))
        # Before its heartbeat the halves are known by the connection's address only.
        assert {row["owner"] for row in (await _listed(b))["pending"]} == {"%s:%d" % sender.conn.local[:2]}
        await sender.beat()
        assert {row["owner"] for row in (await _listed(b))["pending"]} == {STOCK_ID}
    finally:
        sender.conn.close()
    b.kill()                    # after the heartbeat was answered; no snapshot since the halves, no check
    b = await asyncio.to_thread(broker_factory, *_fixed(b, *FLAGS, "--transaction-timeout-ms", "0"))
    listed = await _listed(b)
    assert listed["total"] == len(keys)
    assert {row["owner"] for row in listed["pending"]} == {f"{STOCK_ID} (gone)"}
    sender = await StockProducer().open(b)     # the same instance on a new connection
    try:
        await sender.beat()
        await sender.until_asked(len(keys))
        assert sorted(sender.asked) == sorted(keys)
        assert {row["owner"] for row in (await _listed(b))["pending"]} == {STOCK_ID}
        assert await _metric(b, "txmq_transaction_checks_rerouted_total", group=STOCK_GROUP) == 0
        assert await _metric(b, "txmq_transaction_checks_total", group=STOCK_GROUP) == len(keys)
    finally:
        sender.conn.close()


async def _checkpointed(b) -> None:
    """Until ``b``'s checkpoint (written each second) covers every record in its commit log."""
    seg = sorted((b.store_dir / "commitlog").iterdir())[0]
    for _ in range(200):
        with open(seg, "rb") as f:
            end = last_nonzero(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        point = read_checkpoint(str(b.store_dir))
        if point is not None and point.flushed_offset >= end > 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no checkpoint covered the log's {end} bytes: {point}")
