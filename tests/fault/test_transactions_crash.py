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
import struct
import urllib.request

import pytest

from broker.store.manifest import NUL_FREE_FILE
from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode, ResponseCode
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


async def _metric(b, name: str, label: str = "") -> float:
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode())
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'producer_group="{GROUP}"' in line and label in line)


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
