"""Transactional messages against the real broker: commit, rollback, check-back, failover, lost END,
dead letters and resume. Short check intervals keep every test within seconds."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import ResponseError
from protocol.frame import FrameDecoder
from protocol.message import decode_offset_msg_id
from tests.support.bounded import bounded
from tests.support.broker_process import NO_CHECKS
from tests.support.cluster_process import create_topic, stored_count

pytestmark = pytest.mark.asyncio

FAST = ("--transaction-check-interval-ms", "200", "--transaction-timeout-ms", "300")


class Listener:
    def __init__(self, execute=S.COMMIT_MESSAGE, check=S.COMMIT_MESSAGE, answer_after: asyncio.Event | None = None):
        self.execute = execute
        self.check = check
        self.checked = asyncio.Event()
        self.checks = 0
        self.answer_after = answer_after    # checks are answered only once it is set

    def execute_local_transaction(self, msg, arg):
        return self.execute

    async def check_local_transaction(self, msg):
        self.checks += 1
        self.checked.set()
        if self.answer_after is not None:
            await self.answer_after.wait()
        return self.check


async def _drain(namesrv, topic, expect=None, timeout=10.0, group="CG_tx"):
    """All bodies on a topic; with ``expect``, long-polls until that many arrived (bounded)."""
    consumer = PullConsumer(namesrv, group)
    bodies = []
    try:
        async with asyncio.timeout(timeout):
            queues = await consumer.fetch_queues(topic)
            offsets = {mq: 0 for mq in queues}
            while True:
                for mq in queues:
                    res = await consumer.pull(mq, offsets[mq], max_nums=256)
                    offsets[mq] = res.next_begin_offset
                    bodies += [m.body for m in res.messages]
                if expect is None or len(bodies) >= expect:
                    return bodies
                await consumer.pull(queues[0], offsets[queues[0]], suspend_ms=200)
    finally:
        await consumer.shutdown()


async def _admin(addr, code, fields=None, body=b""):
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        return await conn.request(RemotingCommand.request(code, fields, body), 5.0)
    finally:
        conn.close()


async def test_commit_is_delivered_once_and_rollback_never(broker_factory):
    b = broker_factory(*FAST)
    listener = Listener()
    async with TransactionProducer(b.namesrv, "PG_tx", listener) as producer:
        committed = await producer.send_in_transaction("TxTopic", b"commit-me")
        listener.execute = S.ROLLBACK_MESSAGE
        rolled = await producer.send_in_transaction("TxTopic", b"roll-me-back")
        assert committed.acknowledged and rolled.acknowledged
        # The decision is idempotent: replaying it changes nothing; the opposite is refused.
        _, _, off = decode_offset_msg_id(committed.send_result.offset_msg_id)
        again = await producer._end(b.broker, off, committed.send_result.queue_offset,
                                    committed.send_result.msg_id, S.COMMIT_MESSAGE, False, None)
        assert again is True
        with pytest.raises(Exception, match="first decision wins"):
            await producer._end(b.broker, off, committed.send_result.queue_offset,
                                committed.send_result.msg_id, S.ROLLBACK_MESSAGE, False, None)
    bodies = await _drain(b.namesrv, "TxTopic", expect=1)
    assert bodies == [b"commit-me"]
    listed = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())
    assert listed["total"] == 0


async def test_unknown_then_check_decides(broker_factory):
    b = broker_factory(*FAST)
    # The first check may come 300 ms after the send: a loaded machine may take that long to list, and the
    # check, answered, decided the transaction before the listing that expects it undecided. Held until then.
    listed_once = asyncio.Event()
    listener = Listener(execute=S.UNKNOW, check=S.COMMIT_MESSAGE, answer_after=listed_once)
    async with TransactionProducer(b.namesrv, "PG_unknown", listener) as producer:
        await producer.send_in_transaction("TxUnknown", b"decided-by-check")
        listed = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())
        assert listed["total"] == 1 and listed["pending"][0]["last_answer"] == "UNKNOWN"
        listed_once.set()
        await asyncio.wait_for(listener.checked.wait(), 10)
        bodies = await _drain(b.namesrv, "TxUnknown", expect=1)
        listener.check = S.ROLLBACK_MESSAGE
        listener.checked.clear()
        await producer.send_in_transaction("TxUnknown", b"rolled-back-by-check")
        await asyncio.wait_for(listener.checked.wait(), 10)
    assert bodies == [b"decided-by-check"]
    listed = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())
    async with asyncio.timeout(10):
        while listed["total"]:
            await asyncio.sleep(0.05)
            listed = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())
    assert await _drain(b.namesrv, "TxUnknown") == [b"decided-by-check"]


async def test_another_producer_of_the_group_answers_when_the_sender_died(broker_factory):
    b = broker_factory(*FAST)
    survivor_listener = Listener(check=S.COMMIT_MESSAGE)
    survivor = await TransactionProducer(b.namesrv, "PG_failover", survivor_listener).start()
    dying = await TransactionProducer(b.namesrv, "PG_failover", Listener(execute=S.UNKNOW)).start()
    await dying.send_in_transaction("TxFailover", b"orphan")
    await dying.pool.close()           # the sender is gone before any check
    await asyncio.wait_for(survivor_listener.checked.wait(), 10)
    assert await _drain(b.namesrv, "TxFailover", expect=1) == [b"orphan"]
    await survivor.shutdown()


class DroppingProxy:
    """A TCP proxy that forwards frames and drops the first END_TRANSACTION (a lost oneway)."""

    def __init__(self, target):
        self.target = target
        self.dropped = 0
        self.dropped_one = asyncio.Event()

    async def start(self):
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _client(self, reader, writer):
        host, _, port = self.target.rpartition(":")
        up_r, up_w = await asyncio.open_connection(host, int(port))

        async def pump(src, dst, filtered):
            decoder = FrameDecoder()
            try:
                while data := await src.read(65536):
                    if not filtered:
                        dst.write(data)
                        continue
                    for frame in decoder.feed(data):
                        cmd = RemotingCommand.decode(frame)
                        if cmd.code == RequestCode.END_TRANSACTION and not cmd.is_response and not self.dropped:
                            self.dropped += 1
                            self.dropped_one.set()
                            continue
                        dst.write(frame)
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_w, True), pump(up_r, writer, False), return_exceptions=True)


async def test_a_dropped_end_transaction_is_resolved_by_the_check(broker_factory):
    b = broker_factory(*FAST)
    proxy = DroppingProxy(b.broker)
    proxy_addr = await proxy.start()
    listener = Listener(execute=S.COMMIT_MESSAGE, check=S.COMMIT_MESSAGE)
    producer = TransactionProducer(b.namesrv, "PG_lost", listener, end_retries=0, end_timeout=0.5)
    await producer.start()
    producer.end_acknowledged = False     # send END oneway, as a stock client does
    producer.routes.broker_addr = lambda name: proxy_addr
    await producer.send_in_transaction("TxLost", b"end-was-lost")
    await asyncio.wait_for(proxy.dropped_one.wait(), 10)
    await asyncio.wait_for(listener.checked.wait(), 10)
    assert await _drain(b.namesrv, "TxLost", expect=1) == [b"end-was-lost"]
    assert proxy.dropped == 1
    await producer.shutdown()
    proxy.server.close()


class SlowListener(Listener):
    """Answers each check after longer than the check interval, as a loaded machine's producer does."""

    async def check_local_transaction(self, msg):
        state = await super().check_local_transaction(msg)
        await asyncio.sleep(0.05)
        return state


@pytest.mark.parametrize("slow", [False, True], ids=["prompt", "slower-than-the-interval"])
async def test_unanswered_checks_dead_letter_then_resume(broker_factory, slow):
    b = broker_factory("--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0",
                       "--transaction-check-max", "15")
    listener = (SlowListener if slow else Listener)(execute=S.UNKNOW, check=S.UNKNOW)
    async with TransactionProducer(b.namesrv, "PG_dead", listener) as producer:
        # Hostile properties: a check count of its own, a negative immunity (taken as the default, 0 here).
        sent = await producer.send_in_transaction("TxDead", b"never-decided", properties={
            "TRANSACTION_CHECK_TIMES": "999", "CHECK_IMMUNITY_TIME_IN_SECONDS": "-5"})
        async with asyncio.timeout(30):
            while True:
                dlq = await _drain(b.namesrv, "TRANS_CHECK_MAX_TIME_TOPIC", group="CG_dlq")
                if dlq:
                    break
                await asyncio.sleep(0.1)
        assert dlq == [b"never-decided"]
        # The broker's 15 asks: each run by the listener or, arriving while the call for the one before was still
        # in hand (a loaded machine, a 30 ms interval), left to that call (checks_overlapped); the last may still
        # be on its way when the dead letter is seen.
        async with asyncio.timeout(10):
            while listener.checks + producer.checks_overlapped < 15:
                await asyncio.sleep(0.01)
        assert listener.checks + producer.checks_overlapped == 15
        consumer = PullConsumer(b.namesrv, "CG_dlq2")
        mq = (await consumer.fetch_queues("TRANS_CHECK_MAX_TIME_TOPIC"))[0]
        msg = (await consumer.pull(mq, 0)).messages[0]
        await consumer.shutdown()
        assert msg.properties["TXMQ_REASON"] == "max-checks"
        assert msg.properties["REAL_TOPIC"] == "TxDead"
        assert msg.properties["TRANSACTION_CHECK_TIMES"] == "15"       # RocketMQ's, not the producer's 999
        off = int(msg.properties["TXMQ_HALF"])
        listener.check = S.COMMIT_MESSAGE
        listener.checked.clear()
        resumed = await _admin(b.broker, RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": off})
        assert resumed.code == ResponseCode.SUCCESS, resumed.remark
        await asyncio.wait_for(listener.checked.wait(), 10)
        assert await _drain(b.namesrv, "TxDead", expect=1) == [b"never-decided"]
        assert sent.state is S.UNKNOW


class GivingUp(Listener):
    """A listener as RocketMQ users write one: UNKNOW while the local transaction runs, rolled back once the
    broker's TRANSACTION_CHECK_TIMES says it has asked ``after`` times (a missing one read as the first ask)."""

    def __init__(self, after: int):
        super().__init__(execute=S.UNKNOW, check=S.UNKNOW)
        self.after = after
        self.counts: list[str | None] = []

    async def check_local_transaction(self, msg):
        await super().check_local_transaction(msg)
        count = msg.properties.get("TRANSACTION_CHECK_TIMES")
        self.counts.append(count)
        return S.ROLLBACK_MESSAGE if int(count or 1) >= self.after else S.UNKNOW


@pytest.mark.parametrize("own", [None, "999"], ids=["none-of-its-own", "the-producers-own"])
@bounded(60)
async def test_a_check_carries_its_number_as_transaction_check_times(broker_factory, own):
    """RocketMQ 4.9.8's broker puts TRANSACTION_CHECK_TIMES (1 for the first check) on the message it checks, and
    listeners give up on it ("roll back after 3 asks"). txmq's checks carried the half as sent: the listener saw
    no count (or the producer's own), answered UNKNOW to every check, and the transaction was dead-lettered after
    transaction_check_max checks, never rolled back as its producer meant."""
    b = broker_factory("--transaction-check-interval-ms", "100", "--transaction-timeout-ms", "0",
                       "--transaction-check-max", "5")
    listener = GivingUp(after=3)
    async with TransactionProducer(b.namesrv, "PG_give_up", listener) as producer:
        # (the producer's own value is not the broker's count: with it, the listener gave up at the first check)
        props = {} if own is None else {"TRANSACTION_CHECK_TIMES": own}
        sent = (await producer.send_in_transaction("TxGiveUp", b"given up", properties=props)).send_result
        half = decode_offset_msg_id(sent.offset_msg_id)[2]
        async with asyncio.timeout(30):
            while True:
                listed = await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)
                if not json.loads(listed.body_bytes())["pending"]:
                    break
                await asyncio.sleep(0.05)
    # (a check overlapping the call in hand is left to it: counts may skip one, never go back or past 3)
    assert listener.counts and listener.counts[0] == "1" and listener.counts[-1] == "3", listener.counts
    assert listener.counts == sorted(set(listener.counts), key=int), listener.counts
    resolved = await _admin(b.broker, RequestCode.TXMQ_RESOLVE_TRANSACTION,
                            {"commitLogOffset": half, "decision": "rollback"})
    assert "already ROLLBACK" in resolved.remark, resolved.remark       # rolled back by the listener, not dead
    assert await _drain(b.namesrv, "TRANS_CHECK_MAX_TIME_TOPIC", group="CG_dlq_give_up") == []


@bounded(90)
async def test_the_check_count_a_check_carries_goes_on_after_a_crash(broker_factory):
    """The check records keep the count across a kill -9: the restarted broker's next check is the third, not a
    first again (a listener giving up at 3 would wait 3 more asks each crash), and the limit counts both lives."""
    flags = ("--transaction-check-interval-ms", "100", "--transaction-timeout-ms", "0",
             "--transaction-check-max", "4")
    b = broker_factory(*flags)
    before = GivingUp(after=99)
    async with TransactionProducer(b.namesrv, "PG_count_kept", before) as producer:
        await producer.send_in_transaction("TxCountKept", b"outlives a crash")
        async with asyncio.timeout(30):
            while len(before.counts) < 2:
                before.checked.clear()
                await before.checked.wait()
        b.kill()            # after two acknowledged checks (their records written before they were sent)
    seen = len(before.counts)
    b.start()
    after = GivingUp(after=99)
    async with TransactionProducer(b.namesrv, "PG_count_kept", after) as producer:
        async with asyncio.timeout(30):
            while not await _drain(b.namesrv, "TRANS_CHECK_MAX_TIME_TOPIC", group="CG_dlq_kept"):
                await asyncio.sleep(0.05)
    counts = before.counts + after.counts
    assert counts[:seen] == [str(n) for n in range(1, seen + 1)], counts
    # Restarted: numbered on from the last check recorded (at least every one answered before the crash), never
    # past the limit, which the dead letter ended.
    assert after.counts and int(after.counts[0]) > seen and after.counts[-1] == "4", counts
    assert after.counts == sorted(set(after.counts), key=int), counts


async def test_a_stock_admins_resume_check_half_message_checks_a_dead_letter_again(broker_factory):
    """RESUME_CHECK_HALF_MESSAGE (323) as DefaultMQAdminExt.resumeCheckHalfMessage sends it: the offset message id
    of the dead letter (or of the half). It was REQUEST_CODE_NOT_SUPPORTED: a stock tool could not get a
    dead-lettered transaction checked again."""
    b = broker_factory("--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0",
                       "--transaction-check-max", "2")
    listener = Listener(execute=S.UNKNOW, check=S.UNKNOW)
    async with TransactionProducer(b.namesrv, "PG_resume", listener) as producer:
        plain = await producer.send("TxPlain", b"no transaction")
        sent = await producer.send_in_transaction("TxResumed", b"checked again")
        consumer = PullConsumer(b.namesrv, "CG_dlq_resume")
        try:
            async with asyncio.timeout(30):
                while not await _drain(b.namesrv, "TRANS_CHECK_MAX_TIME_TOPIC", group="CG_dlq_wait"):
                    await asyncio.sleep(0.05)
            mq = (await consumer.fetch_queues("TRANS_CHECK_MAX_TIME_TOPIC"))[0]
            dead = (await consumer.pull(mq, 0)).messages[0]
        finally:
            await consumer.shutdown()
        dead_half = int(dead.properties["TXMQ_HALF"])
        refused = await _admin(b.broker, RequestCode.RESUME_CHECK_HALF_MESSAGE, {"msgId": plain.offset_msg_id})
        assert refused.code == ResponseCode.SYSTEM_ERROR and "TxPlain" in refused.remark, refused.remark
        nowhere = await _admin(b.broker, RequestCode.RESUME_CHECK_HALF_MESSAGE,
                               {"msgId": plain.offset_msg_id[:-16] + "7" * 16})
        assert nowhere.code == ResponseCode.SYSTEM_ERROR and "can not find message" in nowhere.remark
        listener.check = S.COMMIT_MESSAGE
        resumed = await _admin(b.broker, RequestCode.RESUME_CHECK_HALF_MESSAGE, {"msgId": dead.offset_msg_id})
        assert resumed.code == ResponseCode.SUCCESS, resumed.remark
        # (a check answered after the dead letter, had one been late, is not taken: the first decision wins)
        assert await _drain(b.namesrv, "TxResumed", expect=1) == [b"checked again"]
        # Decided now, by its dead letter's id and by its half's: neither checked again nor delivered again
        for again in (dead.offset_msg_id, sent.send_result.offset_msg_id):
            refused = await _admin(b.broker, RequestCode.RESUME_CHECK_HALF_MESSAGE, {"msgId": again})
            assert (refused.code, refused.remark) == (ResponseCode.SYSTEM_ERROR, f"transaction at {dead_half} is "
                                                      "not dead-lettered (it is COMMIT)")
    assert await _drain(b.namesrv, "TxResumed") == [b"checked again"]
    # A half still undecided is refused as what it is, not as "unknown". On a broker of its own that checks
    # nothing: on the one above (a check every 30 ms, two at most) it was dead-lettered while its producer was
    # still connected on a slow machine (CI: two checks in 110 ms), and the 323 then resumed it.
    quiet = broker_factory(*NO_CHECKS, store="quiet")
    async with TransactionProducer(quiet.namesrv, "PG_undecided", Listener(execute=S.UNKNOW, check=S.UNKNOW)) as p:
        undecided = (await p.send_in_transaction("TxResumed", b"undecided")).send_result
    refused = await _admin(quiet.broker, RequestCode.RESUME_CHECK_HALF_MESSAGE, {"msgId": undecided.offset_msg_id})
    assert (refused.code, refused.remark) == (ResponseCode.SYSTEM_ERROR, f"transaction at "
                                              f"{decode_offset_msg_id(undecided.offset_msg_id)[2]} is not "
                                              "dead-lettered (it is undecided: pending its checks)")


@bounded(60)
async def test_a_commit_after_the_dead_letter_is_counted_and_said_with_the_resume_it_needs(broker_factory):
    """A producer whose local transaction outlasted its checks commits after the broker dead-lettered it (RocketMQ
    4.9.8 delivers such a late COMMIT; txmq's first decision wins): its message sits on the dead-letter topic, and
    the refusal (oneway for a stock client: nobody hears it) was counted among all conflicts and said in one line
    a 10 s for all of them, so which dead letters to resume was known to nobody. Counted apart now, and said with
    its half offset and the resume that delivers it."""
    b = broker_factory("--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0",
                       "--transaction-check-max", "1")
    async with TransactionProducer(b.namesrv, "PG_late", Listener(execute=S.UNKNOW, check=S.UNKNOW)) as producer:
        sent = (await producer.send_in_transaction("TxLate", b"committed late")).send_result
    half = decode_offset_msg_id(sent.offset_msg_id)[2]
    async with asyncio.timeout(30):
        while not await _drain(b.namesrv, "TRANS_CHECK_MAX_TIME_TOPIC", group="CG_dlq_late"):
            await asyncio.sleep(0.05)
    end = {"producerGroup": "PG_late", "tranStateTableOffset": sent.queue_offset, "commitLogOffset": half,
           "commitOrRollback": "8", "fromTransactionCheck": "false", "msgId": sent.msg_id}
    late = await _admin(b.broker, RequestCode.END_TRANSACTION, end)
    assert late.code == ResponseCode.TRANSACTION_FAILED and f"admin resume {half}" in late.remark, late.remark
    assert await _counted(b, "txmq_transaction_commits_after_dead_letter_total", "PG_late") == 1
    assert "group PG_late committed a transaction already dead-lettered" in b.log()
    assert f"admin resume {half}" in b.log()
    rolled = await _admin(b.broker, RequestCode.END_TRANSACTION, {**end, "commitOrRollback": "12"})
    assert rolled.code == ResponseCode.TRANSACTION_FAILED       # a rollback of it is a plain conflict: no loss
    assert await _counted(b, "txmq_transaction_commits_after_dead_letter_total", "PG_late") == 1


async def test_admin_force_commit(broker_factory):
    b = broker_factory(*NO_CHECKS)      # no check decides it first (its COMMIT made the admin's a no-op)
    async with TransactionProducer(b.namesrv, "PG_admin", Listener(execute=S.UNKNOW, check=S.UNKNOW)) as producer:
        await producer.send_in_transaction("TxAdmin", b"forced")
    listed = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())
    row = listed["pending"][0]
    assert row["group"] == "PG_admin" and row["topic"] == "TxAdmin" and row["owner"].endswith("(gone)")
    forced = await _admin(b.broker, RequestCode.TXMQ_RESOLVE_TRANSACTION,
                          {"commitLogOffset": row["commit_log_offset"], "decision": "commit"})
    assert forced.code == ResponseCode.SUCCESS
    assert await _drain(b.namesrv, "TxAdmin", expect=1) == [b"forced"]


async def _counted(b, metric: str, group: str) -> float:
    """The counter ``metric`` (labelled by producer group alone) of ``group``, scraped."""
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics",
                                                                  timeout=5).read().decode())
    lines = [line for line in text.splitlines() if line.startswith(f'{metric}{{producer_group="{group}"}}')]
    return float(lines[0].split()[-1]) if lines else 0.0


async def _deferred(b, group: str) -> float:
    """txmq_transaction_checks_deferred_total of ``group``: checks due with no producer of it to ask."""
    return await _counted(b, "txmq_transaction_checks_deferred_total", group)


async def test_no_live_producer_defers_checks_without_spending_them(broker_factory):
    b = broker_factory("--transaction-check-interval-ms", "50", "--transaction-timeout-ms", "0")
    gone = await TransactionProducer(b.namesrv, "PG_nobody", Listener(execute=S.UNKNOW, check=S.UNKNOW)).start()
    await gone.send_in_transaction("TxNobody", b"waits for a producer")
    await gone.pool.close()

    async def row() -> dict:
        return json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())["pending"][0]

    async with asyncio.timeout(10):      # several check intervals pass with nobody to ask
        while await _deferred(b, "PG_nobody") < 1:
            await asyncio.sleep(0.05)
        spent = (await row())["checks"]  # a check may have gone out before the producer left
        start = await _deferred(b, "PG_nobody")
        while await _deferred(b, "PG_nobody") < start + 5:
            await asyncio.sleep(0.05)
    later = await row()
    assert later["checks"] == spent and later["owner"].endswith("(gone)")
    listener = Listener(check=S.COMMIT_MESSAGE)
    async with TransactionProducer(b.namesrv, "PG_nobody", listener):
        await asyncio.wait_for(listener.checked.wait(), 10)
        assert await _drain(b.namesrv, "TxNobody", expect=1) == [b"waits for a producer"]


async def test_the_decision_file_is_made_ahead_of_the_first_decision(broker_factory):
    """A fresh store's first half message has a thread make its decision-table file, so the decision
    finds it instead of making it on the event loop (0.2 ms alone, ~70 ms under a busy disk)."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
    decisions = b.store_dir / "transactions" / "decisions"
    first = decisions / f"{0:020d}"
    listener = Listener(execute=S.UNKNOW)
    async with TransactionProducer(b.namesrv, "PG_ahead", listener) as producer:
        await producer.send_in_transaction("TxAhead", b"undecided")
        def ahead() -> list[str]:
            return [p.name for p in decisions.iterdir() if p.name.endswith(".ahead")]

        # Made on a thread after the half was stored, under a temporary name linked into place and then unlinked:
        # between the two the file is there and so is its temporary name (asserted at once, this failed a CI run).
        async with asyncio.timeout(10):
            while not first.exists() or ahead():
                await asyncio.sleep(0.01)
        assert first.stat().st_size == 1 << 20


async def test_a_producer_is_sent_no_more_unanswered_checks_than_its_cap(broker_factory):
    """100 transactions due at once, one producer whose checks hang: it holds at most
    --transaction-check-in-flight-max (20) unanswered checks, the other transactions spend none meanwhile,
    and once it answers every transaction is decided (the checks go as answers come back)."""
    b = broker_factory("--transaction-check-interval-ms", "200", "--transaction-timeout-ms", "0",
                       "--transaction-check-in-flight-max", "20")
    release = asyncio.Event()
    asked = []

    class Hung(Listener):
        async def check_local_transaction(self, msg):
            asked.append(msg.body)
            self.checked.set()
            await release.wait()
            return S.COMMIT_MESSAGE

    listener = Hung(execute=S.UNKNOW)
    async with TransactionProducer(b.namesrv, "PG_capped", listener, end_timeout=10) as producer:
        await asyncio.gather(*(producer.send_in_transaction("TxCapped", b"%d" % i) for i in range(100)))

        async def rows() -> list[dict]:
            body = (await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"group": "PG_capped"})).body_bytes()
            return json.loads(body)["pending"]

        await asyncio.wait_for(listener.checked.wait(), 10)
        async with asyncio.timeout(10):         # several intervals pass: the hung checks come due again
            while sum(r["checks"] for r in await rows()) < 40:
                await asyncio.sleep(0.05)
        listed = await rows()
        assert len(listed) == 100
        assert sum(1 for r in listed if r["checks"]) <= 20, "checks went out past the producer's cap"
        release.set()
        async with asyncio.timeout(30):
            while await rows():
                await asyncio.sleep(0.1)
    assert sorted(await _drain(b.namesrv, "TxCapped", expect=100, timeout=20)) == sorted(b"%d" % i for i in range(100))


async def test_a_huge_check_immunity_does_not_stop_the_checks_of_others(broker_factory):
    """CHECK_IMMUNITY_TIME_IN_SECONDS of 321 digits parsed as an int (now, as Long.parseLong, none: the default);
    when that transaction was the next one due, the check timer's delay (ms / 1000) overflowed a float, the timer
    task died, and no transaction of any producer was checked or dead-lettered again. The largest long (which
    Long.parseLong reads) is as far past any due time a timer can wait for."""
    b = broker_factory(*FAST)
    listener = Listener(execute=S.UNKNOW, check=S.COMMIT_MESSAGE)
    async with TransactionProducer(b.namesrv, "PG_huge", listener) as producer:
        await producer.send_in_transaction("TxHuge", b"hostile", properties={
            "CHECK_IMMUNITY_TIME_IN_SECONDS": str((1 << 63) - 1)})
        await producer.send_in_transaction("TxHuge", b"ordinary")
        await asyncio.wait_for(listener.checked.wait(), 10)
        assert await _drain(b.namesrv, "TxHuge", expect=1) == [b"ordinary"]


async def test_a_producer_joining_its_group_is_checked_at_once_not_an_interval_later(broker_factory):
    """Halves whose group had no producer when they came due were deferred a whole check interval, producer
    or not: after a restart, or once every producer of the group reconnected, the transactions in doubt waited
    up to --transaction-check-interval-ms (60 s by default; 30 s here) for a producer that had been there
    all along. A producer registering its group makes them due at once."""
    b = broker_factory("--transaction-check-interval-ms", "30000", "--transaction-timeout-ms", "2000")
    # Its checks are never answered: on a machine slower than the 2 s immunity a check may come before it shuts
    # down; answered UNKNOW, it put that transaction 30 s on, never deferred. Unanswered, it is lost when the
    # connection closes, and that transaction is due again at once: deferred, as if no check went to it.
    gone = await TransactionProducer(b.namesrv, "PG_join", Listener(execute=S.UNKNOW, check=S.UNKNOW,
                                                                    answer_after=asyncio.Event()),
                                     shutdown_grace_s=0).start()
    for i in range(3):
        await gone.send_in_transaction("TxJoin", b"%d" % i)
    await gone.shutdown()          # before their immunity ends, or with their checks unanswered

    async with asyncio.timeout(15):      # the pass after the immunity finds nobody to ask: deferred 30 s
        while await _deferred(b, "PG_join") < 3:
            await asyncio.sleep(0.05)
    listener = Listener(check=S.COMMIT_MESSAGE)
    async with TransactionProducer(b.namesrv, "PG_join", listener):
        await asyncio.wait_for(listener.checked.wait(), 5)       # was: ~28 s, the rest of the interval
        assert sorted(await _drain(b.namesrv, "TxJoin", expect=3, timeout=5)) == [b"0", b"1", b"2"]
    rows = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())["pending"]
    assert rows == [] and listener.checks == 3          # one check each: none spent twice


@bounded(30)
async def test_an_end_the_broker_has_already_decided_otherwise_is_raised_not_returned(broker_factory):
    """The local transaction is slow; meanwhile the transaction is decided otherwise (here an END ROLLBACK sent as
    another producer of the group answering a check would: this one leaves asks about a transaction whose local
    transaction it runs to its END, test_a_check_during_its_own_local_transaction_does_not_decide_it). It then
    commits and its END COMMIT is refused (TRANSACTION_FAILED, the first decision wins): the message is rolled
    back for good, no check-back will come. Returned with ``end_error`` beside COMMIT_MESSAGE, it read as a
    committed send."""
    b = broker_factory("--transaction-check-interval-ms", "50", "--transaction-timeout-ms", "600000")
    entered, decided = asyncio.Event(), asyncio.Event()

    class SlowCommit:
        async def execute_local_transaction(self, msg, arg):
            entered.set()
            await decided.wait()             # the broker recorded the other producer's ROLLBACK meanwhile
            return S.COMMIT_MESSAGE

        def check_local_transaction(self, msg):
            return S.ROLLBACK_MESSAGE

    async with TransactionProducer(b.namesrv, "PG_tx_decided", SlowCommit()) as producer:
        sending = asyncio.get_running_loop().create_task(
            producer.send_in_transaction("TxDecided", b"rolled back by the check"))
        await entered.wait()
        body = (await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"group": "PG_tx_decided"})).body_bytes()
        [half] = json.loads(body)["pending"]
        rolled = await _admin(b.broker, RequestCode.END_TRANSACTION, {
            "producerGroup": "PG_tx_decided", "tranStateTableOffset": half["queue_offset"],
            "commitLogOffset": half["commit_log_offset"], "commitOrRollback": "12", "fromTransactionCheck": "true"})
        assert rolled.code == ResponseCode.SUCCESS, rolled.remark
        decided.set()
        with pytest.raises(ResponseError) as info:
            await sending
    assert info.value.code == ResponseCode.TRANSACTION_FAILED
    assert "COMMIT_MESSAGE" in str(info.value) and "no check-back" in str(info.value)


@bounded(60)
async def test_a_half_refused_at_the_brokers_undecided_limit_runs_no_local_transaction(broker_factory):
    """At --max-undecided (every group together) a half is answered SYSTEM_BUSY, nothing stored: the producer must
    raise, naming the limit, and never run its local transaction (a stock Java producer's sendMessageInTransaction
    throws MQClientException: SYSTEM_BUSY is not in its retryResponseCodes). Run, a COMMIT would name no half."""
    b = broker_factory("--max-undecided", "2", "--transaction-timeout-ms", "600000")
    held = Listener(execute=S.UNKNOW)
    refused = Listener()
    ran: list[bytes] = []
    refused.execute_local_transaction = lambda msg, arg: ran.append(msg.body) or S.COMMIT_MESSAGE
    async with TransactionProducer(b.namesrv, "PG_holds_two", held) as holder, \
            TransactionProducer(b.namesrv, "PG_refused", refused) as producer:
        for n in range(2):
            assert (await holder.send_in_transaction("TxTotal", b"held %d" % n)).state is S.UNKNOW
        with pytest.raises(ResponseError) as exc:
            await producer.send_in_transaction("TxTotal", b"never run")
    assert exc.value.code == ResponseCode.SYSTEM_BUSY and "max_undecided=2" in str(exc.value), exc.value
    assert ran == []
    listed = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())
    assert [t["group"] for t in listed["pending"]] == ["PG_holds_two"] * 2, listed


@bounded(60)
async def test_a_commit_for_a_queue_its_topic_no_longer_reads_goes_to_one_it_reads(broker_factory):
    """Halves sent to queues 0..7 of a topic of 8, the topic cut to 4 (updateTopic -r 4 -w 4) before the COMMITs:
    each committed message was written to its half's REAL_QID, as RocketMQ 4.9.8's EndTransactionProcessor does,
    4 of 8 where no consumer reads, nothing said. They go to a queue the topic reads (queue id mod 4), counted in
    txmq_requeued_total{topic} (test_op_damage.py: recovery finds them there)."""
    b = broker_factory(*NO_CHECKS)
    await create_topic(b.broker, "TxCut", 8)
    async with TransactionProducer(b.namesrv, "PG_cut", Listener(execute=S.UNKNOW)) as producer:
        halves = [(await producer.send_in_transaction("TxCut", b"c%d" % i)).send_result for i in range(8)]
        assert {r.queue.queue_id for r in halves} == set(range(8))
        await create_topic(b.broker, "TxCut", 4)
        for r in halves:
            assert await producer._end(b.broker, decode_offset_msg_id(r.offset_msg_id)[2], r.queue_offset,
                                       r.msg_id, S.COMMIT_MESSAGE, False, None) is True
    assert (await stored_count(b.broker, "TxCut", 4), await stored_count(b.broker, "TxCut", 8)) == (8, 8)
    assert sorted(await _drain(b.namesrv, "TxCut", expect=8)) == sorted(b"c%d" % i for i in range(8))
    metrics = urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode()
    assert 'txmq_requeued_total{topic="TxCut"} 4.0' in metrics.splitlines()
    assert b.stop() == 0
    assert b.log().count("past the 4 it reads now") == 1       # one WARNING for the topic, not one a commit
