"""The broker host's wall clock stepped (NTP, a VM resumed) while the broker runs.

libfaketime reads the broker's clock offset from a file on every call (FAKETIME_TIMESTAMP_FILE with
FAKETIME_NO_CACHE), so a test steps the running broker's wall clock by rewriting it; its monotonic clock
(asyncio's timers) stays real. Steps are taken after progress (a half stored, a check answered), never
after a sleep; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from tests.support.cluster_process import request
from tests.integration.test_query_ops import _query_key
from tests.support.faketime import LIBFAKETIME, SKIP_REASON, stepped_env

pytestmark = pytest.mark.asyncio

if LIBFAKETIME is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)


class Checked:
    """Answers UNKNOW to everything; counts checks and lets a test wait for the n-th."""

    def __init__(self):
        self.checks = 0
        self.first_at: float | None = None      # monotonic, in this process
        self._more = asyncio.Event()

    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    async def check_local_transaction(self, msg):
        self.checks += 1
        if self.first_at is None:
            self.first_at = time.monotonic()
        self._more.set()
        return S.UNKNOW

    async def wait_for(self, n: int, within_s: float) -> None:
        async with asyncio.timeout(within_s):
            while self.checks < n:
                self._more.clear()
                await self._more.wait()


IMMUNITY_S = 1.5
FLAGS = ("--transaction-check-interval-ms", "500", "--transaction-timeout-ms", str(int(IMMUNITY_S * 1000)))


@pytest.mark.parametrize("steps", [("-1h", "-2h"), ("+1h", "+2h")], ids=["back", "forward"])
async def test_checks_keep_their_pace_when_the_wall_clock_steps(broker_factory, tmp_path, steps):
    """Checks are timed by the broker's monotonic clock. Timed by the wall clock, a step back of an hour
    left every undecided transaction unchecked for that hour, saying nothing; a step forward checked
    them at once, before their immunity ended (a producer still running its local transaction may
    answer ROLLBACK)."""
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    b = broker_factory(*FLAGS, env=stepped_env(offset))
    listener = Checked()
    async with TransactionProducer(b.namesrv, "PG_clock", listener) as producer:
        sending = time.monotonic()
        await producer.send_in_transaction("TxClock", b"in doubt")
        offset.write_text(steps[0] + "\n")         # stepped before the first check is due
        await listener.wait_for(1, 15)
        assert listener.first_at - sending >= IMMUNITY_S - 0.05, "checked before its immunity ended"
        offset.write_text(steps[1] + "\n")         # and again between checks
        await listener.wait_for(3, 15)



def _scraped(b, name: str, label: str, value: str) -> float | None:
    """The sample ``name`` whose ``label`` is ``value``, scraped over HTTP (None: no such series)."""
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get(label) == value:
                return s.value
    return None


def _oldest_half_age(b, group: str) -> float | None:
    """txmq_half_message_oldest_age_seconds of ``group``, scraped (None: absent)."""
    return _scraped(b, "txmq_half_message_oldest_age_seconds", "producer_group", group)


@pytest.mark.parametrize("step", ["-1h", "+1h"], ids=["back", "forward"])
async def test_the_oldest_half_age_counts_the_time_that_passed_not_the_step(broker_factory, tmp_path, step):
    """txmq_half_message_oldest_age_seconds (alerted on above 600 s) was the wall clock's now minus the half's
    store time. Stepped back an hour, it said 0 s for that hour, however long the transaction had been stuck:
    the alert silent. Stepped forward an hour, a half stored a second before was an hour old: a page for
    nothing. It counts the time that passed since the half was stored, by the check schedule's clock."""
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    b = broker_factory("--transaction-timeout-ms", "600000", "--transaction-check-interval-ms", "600000",
                       env=stepped_env(offset))
    async with TransactionProducer(b.namesrv, "PG_clock", Checked()) as producer:
        sending = time.monotonic()
        await producer.send_in_transaction("TxClock", b"in doubt")
        offset.write_text(step + "\n")
        async with asyncio.timeout(20):     # the gauges are refreshed once a second: polled
            while (age := await asyncio.to_thread(_oldest_half_age, b, "PG_clock")) is None or age < 2:
                await asyncio.sleep(0.2)
        assert age <= time.monotonic() - sending + 1, f"{age} s old after {time.monotonic() - sending:.1f} s"

@pytest.mark.parametrize("step", ["-1h", "+1h"], ids=["back", "forward"])
async def test_the_admin_lists_age_counts_the_time_that_passed_not_the_step(broker_factory, tmp_path, step):
    """`admin list` (TXMQ_LIST_TRANSACTIONS) said each undecided half's age_ms by the wall clock, beside its
    next_check_in_ms by the monotonic one: stepped back an hour, a half just sent was -3,600,000 ms old; forward,
    an hour old, while the oldest-half gauge said a second. Its age is the time passed, as the gauge's."""
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    b = broker_factory("--transaction-timeout-ms", "600000", "--transaction-check-interval-ms", "600000",
                       env=stepped_env(offset))
    async with TransactionProducer(b.namesrv, "PG_clock", Checked()) as producer:
        sending = time.monotonic()
        await producer.send_in_transaction("TxClock", b"in doubt")
        offset.write_text(step + "\n")
        listed = await request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 10})
        [row] = json.loads(listed.body_bytes())["pending"]
        elapsed_ms = (time.monotonic() - sending) * 1000
        assert 0 <= row["age_ms"] <= elapsed_ms + 50, f"{row['age_ms']} ms old after {elapsed_ms:.0f} ms"
        assert abs(row["age_ms"] + row["next_check_in_ms"] - 600_000) <= 50, row


class _StepsThenCommits:
    """Steps the broker's wall clock while its local transaction runs (its half stored), then commits."""

    def __init__(self, offset, step: str):
        self.offset, self.step = offset, step

    async def execute_local_transaction(self, msg, arg):
        self.offset.write_text(self.step + "\n")
        return S.COMMIT_MESSAGE

    async def check_local_transaction(self, msg):
        return S.COMMIT_MESSAGE


def _latency(b, group: str) -> tuple[float, float]:
    """rocketmq_finish_message_latency's (count, sum) for ``group``, scraped."""
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
    found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name.startswith("rocketmq_finish_message_latency_") and s.labels.get("producer_group") == group}
    return found.get("rocketmq_finish_message_latency_count", 0.0), found.get("rocketmq_finish_message_latency_sum", 0.0)


@pytest.mark.parametrize("step", ["-1h", "+1h"], ids=["back", "forward"])
async def test_the_decision_latency_counts_the_time_that_passed_not_the_step(broker_factory, tmp_path, step):
    """rocketmq_finish_message_latency (half to decision) was the wall clock's now minus the half's store time:
    the wall clock stepped forward an hour while a local transaction ran, its commit a second later was observed
    as an hour (the histogram's top bucket, a p99 alert); back, as 0. It counts the time that passed."""
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    b = broker_factory(env=stepped_env(offset))
    async with TransactionProducer(b.namesrv, "PG_latency", _StepsThenCommits(offset, step)) as producer:
        sending = time.monotonic()
        result = await producer.send_in_transaction("TxClock", b"decided")
        elapsed = time.monotonic() - sending
    assert result.acknowledged
    async with asyncio.timeout(10):
        while (seen := await asyncio.to_thread(_latency, b, "PG_latency"))[0] < 1:
            await asyncio.sleep(0.2)
    assert seen[0] == 1 and 0 < seen[1] <= elapsed + 0.05, f"{seen[1]} s to decide, after {elapsed:.2f} s"


async def test_a_half_stored_before_the_clock_went_back_is_checked_after_a_restart(broker_factory, tmp_path):
    """A broker restarted after its clock went back an hour finds halves stored "an hour ahead": they get
    their immunity from now, not the hour's wait until the wall clock reaches their store time again."""
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    b = broker_factory(*FLAGS, env=stepped_env(offset))
    async with TransactionProducer(b.namesrv, "PG_clock", Checked()) as producer:
        await producer.send_in_transaction("TxClock", b"in doubt")
    b.stop()
    offset.write_text("-1h\n")
    b = broker_factory(*FLAGS, env=stepped_env(offset))
    listener = Checked()
    async with TransactionProducer(b.namesrv, "PG_clock", listener):
        await listener.wait_for(1, 15)


async def _arrived(namesrv, topic: str, n: int, within_s: float) -> list[bytes]:
    """The bodies on ``topic`` once ``n`` arrived (long-polled, bounded)."""
    consumer = PullConsumer(namesrv, "CG_clock")
    bodies: list[bytes] = []
    try:
        async with asyncio.timeout(within_s):
            queues = await consumer.fetch_queues(topic)
            offsets = {mq: 0 for mq in queues}
            while len(bodies) < n:
                for mq in queues:       # long-polled: each returns at once when it holds more
                    got = await consumer.pull(mq, offsets[mq], suspend_ms=100)
                    offsets[mq] = got.next_begin_offset
                    bodies += [m.body for m in got.messages]
    finally:
        await consumer.shutdown()
    return bodies


async def test_a_timer_message_is_not_held_an_hour_when_the_clock_goes_back(broker_factory, tmp_path):
    """A timer message asks for a wait from its store time (TIMER_DELAY_SEC / _MS) or a wall time
    (TIMER_DELIVER_MS); a wait never outlasts what it asked for counted from now, as RocketMQ's
    correctDeliverTimestamp rules delay levels (a message stored "after now" goes now). Kept by the
    wall clock, a step back of an hour held a 2 s timer for an hour and two seconds, nothing said; also
    across a restart."""
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    b = broker_factory(env=stepped_env(offset))
    async with Producer(b.namesrv, "PG_clock") as producer:
        await producer.send("Timed", b"a", properties={"TIMER_DELAY_SEC": "2"})
        await producer.send("Timed", b"b", properties={"TIMER_DELAY_MS": "2000"})
        offset.write_text("-1h\n")
        assert sorted(await _arrived(b.namesrv, "Timed", 2, 15)) == [b"a", b"b"]
        offset.write_text("+0\n")
        await producer.send("Timed", b"c", properties={"TIMER_DELAY_SEC": "5"})   # still waiting at the stop
    b.stop()
    offset.write_text("-1h\n")
    b = broker_factory(env=stepped_env(offset))
    assert sorted(await _arrived(b.namesrv, "Timed", 3, 20)) == [b"a", b"b", b"c"]


async def test_a_clock_stepped_days_ahead_removes_no_snapshot_file_the_rollup_has_yet_to_read(broker_factory,
                                                                                              tmp_path):
    """Metric snapshot files older than metrics_snapshot_retention_days (7) are removed by the wall clock's
    date. Stepped 30 days ahead for a while (a VM's host, a bad NTP source), the broker wrote one file of that
    future date and removed every file before it -- yesterday's too, which the nightly rollup had yet to read:
    the metric history gone, one INFO line a file. Which files are old is judged by the time that passed
    since the broker started as well, so a step ahead removes nothing."""
    folder = tmp_path / "store" / "metrics"
    folder.mkdir(parents=True)
    now = time.time()
    day = lambda days_ago: time.strftime("%Y-%m-%d", time.gmtime(now - days_ago * 86400))  # noqa: E731
    recent = [folder / f"{day(1)}.jsonl", folder / f"{day(3)}.jsonl"]
    for path in recent:
        path.write_text('{"ts": 0, "connections": 0, "consumer_lag": []}\n')
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    broker_factory("--metrics-snapshot-interval-s", "0.05", env=stepped_env(offset))
    offset.write_text("+30d\n")
    ahead = lambda: [f for f in folder.glob("*.jsonl") if f.stem > day(-20)]  # noqa: E731
    # Two snapshots in the future file: the pass that wrote the first one judged the files by it before the second.
    async with asyncio.timeout(15):
        while not (ahead() and len(ahead()[0].read_text().splitlines()) >= 2):
            await asyncio.sleep(0.05)
    assert [p for p in recent if not p.exists()] == []


RETAINED_S = 10.8       # --file-reserved-hours / --transaction-retention-hours 0.003
EXPIRING = ("--segment-size", "262144", "--max-message-size", "16384", "--disk-clean-ratio", "0.0001",
            "--disk-force-clean-ratio", "0.9999", "--disk-refuse-ratio", "1.0", "--file-reserved-hours", "0.003",
            "--transaction-retention-hours", "0.003", "--disk-clean-interval-s", "0.2",
            "--transaction-timeout-ms", "600000", "--transaction-check-interval-ms", "600000")


async def test_a_clock_stepped_days_ahead_expires_no_half_or_segment_before_its_time(broker_factory, tmp_path):
    """Retention judges a segment (its newest record) and an undecided half by their store times, the wall
    clock's. Stepped four days ahead while the broker ran (a VM's host, a bad NTP source), with the disk above
    its clean ratio the next pass removed every sealed segment and dead-lettered as `expired` the undecided
    half in it, stored a second before: a transaction lost, not 72 h old by the broker's own account, and
    unread messages with it. Their age is bounded by the time that passed since the start as well: they go
    when the retention has passed by the broker's monotonic clock, not at the step."""
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    b = broker_factory(*EXPIRING, env=stepped_env(offset))
    async with asyncio.timeout(60):
        stored = time.monotonic()
        async with TransactionProducer(b.namesrv, "PG_clock", Checked()) as producer:
            await producer.send_in_transaction("TxClock", b"in doubt")
        async with Producer(b.namesrv, "PG_fill") as producer:    # seals the half's segment
            for _ in range(0, 300, 50):
                await asyncio.gather(*(producer.send("Fill", b"m" * 1000) for _ in range(50)))
        offset.write_text("+4d\n")
        while "undecided halves dead-lettered (expired) before removal" not in b.log():
            await asyncio.sleep(0.1)
    assert time.monotonic() - stored >= RETAINED_S - 0.3, "expired by the step, not by its age"
    assert b.log().count("retention judges ages by the latter") == 1, b.log()[-3000:]


def _kept_older(b, group: str) -> float | None:
    """txmq_subscriptions_kept_older_total of ``group``, scraped (None: no series)."""
    return _scraped(b, "txmq_subscriptions_kept_older_total", "consumer_group", group)


def _beat(group: str, expression: str, version: int) -> RemotingCommand:
    return RemotingCommand.request(RequestCode.HEART_BEAT, body=json.dumps({
        "clientID": "127.0.0.1@kept-older", "producerDataSet": [], "consumerDataSet": [{
            "groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
            "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False, "subscriptionDataSet": [{
                "topic": "TxKeptOlder", "subString": expression, "subVersion": version, "expressionType": "TAG",
                "tagsSet": [expression], "codeSet": []}]}]}).encode())


async def test_a_deleted_groups_kept_older_subscriptions_series_goes_with_its_other_series(broker_factory):
    """DELETE_SUBSCRIPTIONGROUP drops the group's series (metrics.forget_consumer_group: a group gone kept them in
    every scrape for good, and one made again under its name went on from the old counts). The per-group
    txmq_subscriptions_kept_older_total, added beside them, was left out of that: kept after the group went."""
    b = broker_factory()
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        for expression, version in (("A", 2_000_000), ("B", 1_000_000)):     # B's subVersion older: kept out
            reply = await conn.request(_beat("CG_kept_older", expression, version), 5)
            assert reply.code == ResponseCode.SUCCESS, reply.remark
    finally:
        conn.close()
    assert await asyncio.to_thread(_kept_older, b, "CG_kept_older") == 1
    reply = await request(b.broker, RequestCode.DELETE_SUBSCRIPTIONGROUP, {"groupName": "CG_kept_older"})
    assert reply.code == ResponseCode.SUCCESS, reply.remark
    assert await asyncio.to_thread(_kept_older, b, "CG_kept_older") is None


@pytest.mark.parametrize("steps", [("+0", "+24h", "+1h", "+61m"), ("+0", "+2h", "+1h", "+61m")],
                         ids=["a-day-ahead-and-back", "back-within-a-file"])
async def test_a_query_by_key_and_time_finds_each_message_stored_across_clock_steps(broker_factory, tmp_path, steps):
    """The same key sent at each offset of the wall clock: a query by key with a window of +-5 s around each
    message's store time finds it and only it. A day ahead and back: every entry after the step was taken as stored
    at the begin of the file started a day ahead (found by the all-time query only). Back an hour within a file's
    day: the key's walk, newest first, stopped at the entry stored after the step and missed the one before it."""
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    b = broker_factory(env=stepped_env(offset))
    async with Producer(b.namesrv, "PG_clock") as producer:
        for step in steps:
            offset.write_text(step + "\n")
            await producer.send("Keyed", step.encode(), keys="order-1")
    sent = await _query_key(b, "Keyed", "order-1")
    assert sorted(m.body for m in sent) == sorted(s.encode() for s in steps)
    for m in sent:
        got = await _query_key(b, "Keyed", "order-1", m.store_timestamp - 5_000, m.store_timestamp + 5_000)
        assert [g.body for g in got] == [m.body], (m.body, m.store_timestamp, [g.store_timestamp for g in sent])
