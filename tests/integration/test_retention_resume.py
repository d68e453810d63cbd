"""A resume (903, a stock admin's 323) of a transaction whose half is already past transaction_retention_hours.

A broker living 80 hours in the past dead-letters an unanswered transaction (its check count spent). Served at the
real time, its half is past transaction_retention_hours. Resumed, the transaction was pending again only until the
next expiry plan (which lists every open half that old), or the cleaning pass over disk_clean_ratio that removes
its segment once past file_reserved_hours, dead-lettered it again as `expired` and removed its half -- the
operator's resume taken back unsaid. Both resumes now say so up front (the reply and a WARNING), but go on: the
resumed transaction is checked at once, and a producer that is back decides it before either pass comes.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from consumer import PullConsumer
from consumer.pull_consumer import PullStatus
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.message import decode_offset_msg_id
from tests.integration.test_retention_process import _admin as _apply_plan
from tests.integration.test_corrupt_records import _dead_letters as _counted
from tests.integration.test_retention_process import Undecided, _plan
from tests.integration.test_transactions import FAST, Listener, _admin, _drain
from tests.support.broker_process import REPO
from tests.support.faketime import LIBFAKETIME, SKIP_REASON, past_env

pytestmark = pytest.mark.asyncio

if LIBFAKETIME is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)
SMALL = ("--segment-size", "262144", "--max-message-size", "16384")
NEVER_CLEANS = ("--disk-clean-ratio", "0.9998", "--disk-force-clean-ratio", "0.9999")
DEAD_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"


async def _dead_letters(b, group: str, expect: int = 0) -> list:
    """The dead letters stored, from the queue's first (a removed segment moves it); with ``expect``, pulled until
    that many are (bounded)."""
    async with PullConsumer(b.namesrv, group) as consumer:
        async with asyncio.timeout(30):
            while True:
                (mq,) = await consumer.fetch_queues(DEAD_TOPIC)
                letters, offset = [], 0
                while (res := await consumer.pull(mq, offset, max_nums=32)).status is not PullStatus.NO_NEW_MSG:
                    letters += res.messages
                    offset = res.next_begin_offset
                if len(letters) >= expect:
                    return letters
                await consumer.pull(mq, offset, suspend_ms=200)


async def _dead_lettered_80h_ago(broker_factory, *, seal: bool):
    """(half offset, dead letter) of a transaction a broker living 80 hours ago dead-lettered (its one check
    unanswered); ``seal``: the segment the half is in is then filled and sealed."""
    past = broker_factory(*SMALL, "--transaction-check-interval-ms", "30", "--transaction-timeout-ms", "0",
                          "--transaction-check-max", "1", env=past_env("-80h"))
    async with TransactionProducer(past.namesrv, "PG_old", Undecided()) as producer:
        sent = (await producer.send_in_transaction("Paid", b"dead-80h")).send_result
        (dead,) = await _dead_letters(past, "CG_wait", expect=1)
    if seal:
        async with Producer(past.namesrv, "PG_fill") as filler:
            await asyncio.gather(*(filler.send("Fill", b"f" * 1000) for _ in range(300)))
    assert past.stop() == 0
    half = decode_offset_msg_id(sent.offset_msg_id)[2]
    assert (int(dead.properties["TXMQ_HALF"]), dead.properties["TXMQ_REASON"]) == (half, "max-checks")
    return half, dead


async def _resumed_saying_so(b, half: int, dead, *, stock: bool) -> str:
    """`admin resume` (903) or a stock 323 by the dead letter's id: resumed, the reply and a WARNING saying what
    would dead-letter it again; the reply."""
    if stock:
        resp = await _admin(b.broker, RequestCode.RESUME_CHECK_HALF_MESSAGE, {"msgId": dead.offset_msg_id})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        reply = resp.remark
    else:
        cli = subprocess.run([sys.executable, "-m", "broker", "admin", "--broker", b.broker, "resume", str(half)],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        reply = cli.stdout.strip()
    assert reply.startswith("resumed: pending again with its check count reset; its half, stored 80.0 h ago")
    assert "past transaction_retention_hours (72 h): undecided by then" in reply and "again as expired" in reply
    listed = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 10})).body)
    assert (listed["total"], listed["dead_lettered"]) == (1, 0), listed
    assert f"resume of the transaction at {half}: its half, stored" in b.log()
    return reply


async def test_a_resume_the_next_cleaning_pass_would_undo_says_so(broker_factory, tmp_path):
    """The half in a sealed segment past file_reserved_hours, kept while the disk is below disk_clean_ratio; its
    producer still does not answer. The resume says the cleaning pass (or a plan) would dead-letter it again."""
    half, dead = await _dead_lettered_80h_ago(broker_factory, seal=True)
    b = broker_factory(*SMALL, *NEVER_CLEANS)
    reply = await _resumed_saying_so(b, half, dead, stock=False)
    assert "the next cleaning pass (every 5 s) with the disk above disk_clean_ratio (99.98%)" in reply

    # The segment then goes (here by a plan; the cleaner does the same over the clean ratio): still undecided, it
    # is dead-lettered again as expired, as the resume said.
    rc, out = _apply_plan(b, _plan(tmp_path / "store", int(time.time() * 1000)), tmp_path, "plan")
    assert rc == 0 and out["segments_removed"] and out["segments_kept"] == [], out
    assert await asyncio.to_thread(_counted, b, "expired") == 1


async def test_a_resume_the_nightly_plan_would_undo_says_so(broker_factory, tmp_path):
    """The half 80 hours old in the segment still being written: no segment expires, but the nightly plan lists
    every open half past transaction_retention_hours (ops/spark/expiry.py), a resumed one too."""
    half, dead = await _dead_lettered_80h_ago(broker_factory, seal=False)
    b = broker_factory(*SMALL, *NEVER_CLEANS)
    reply = await _resumed_saying_so(b, half, dead, stock=True)
    assert "an expiry plan listing it (the nightly one lists the open halves older than its --retention-hours) would" in reply and "cleaning pass" not in reply
    plan = dict(_plan(tmp_path / "store", int(time.time() * 1000)), halves=[{"commit_log_offset": half}])
    rc, out = _apply_plan(b, plan, tmp_path, "plan")
    assert rc == 0 and out["expired"] == [half] and out["segments_removed"] == [], out
    assert [(m.body, m.properties["TXMQ_REASON"]) for m in await _dead_letters(b, "CG_after", expect=2)] == \
        [(b"dead-80h", "max-checks"), (b"dead-80h", "expired")]


async def test_a_resume_its_producer_commits_at_the_first_check_is_not_refused(broker_factory):
    """The common resume: the producer that could not answer is back. The resumed transaction is checked at once
    (its half is long past the transaction timeout), answered, decided: nothing left for a plan or a cleaning pass
    to undo. Refused for its half's age alone, the operator was left to decide it by hand from the dead letter."""
    half, dead = await _dead_lettered_80h_ago(broker_factory, seal=False)
    b = broker_factory(*SMALL, *NEVER_CLEANS, *FAST)
    listener = Listener(check=S.COMMIT_MESSAGE)
    async with TransactionProducer(b.namesrv, "PG_old", listener):
        stock = await _admin(b.broker, RequestCode.RESUME_CHECK_HALF_MESSAGE, {"msgId": dead.offset_msg_id})
        assert stock.code == ResponseCode.SUCCESS, stock.remark
        assert await _drain(b.namesrv, "Paid", expect=1, timeout=30) == [b"dead-80h"]
    assert f"resume of the transaction at {half}: its half, stored 80.0 h ago" in b.log()    # said, not refused


async def test_a_late_commit_of_a_half_retention_removed_names_its_dead_letter(broker_factory, tmp_path):
    """A half left undecided 80 hours ago, its segment then removed by an expiry plan: expired, it is dead-lettered
    first. Its producer's late COMMIT was refused "Find prepared transaction message failed" (a stock client's END
    is oneway: nobody hears that), counted end-half-removed among ENDs naming anything below the log, and nothing
    said the committed message was sitting on TRANS_CHECK_MAX_TIME_TOPIC. Its dead letter, found by the END's
    transaction id and matched by the half offset it carries, is now named in an ERROR (how to deliver it too),
    counted with the commits after a dead letter (alert TxmqCommitAfterDeadLetter)."""
    past = broker_factory(*SMALL, "--transaction-timeout-ms", str(3600 * 1000), env=past_env("-80h"))
    async with TransactionProducer(past.namesrv, "PG_old", Undecided()) as producer:
        sent = (await producer.send_in_transaction("Paid", b"late-80h")).send_result
    async with Producer(past.namesrv, "PG_fill") as filler:
        await asyncio.gather(*(filler.send("Fill", b"f" * 1000) for _ in range(300)))
    assert past.stop() == 0
    half = decode_offset_msg_id(sent.offset_msg_id)[2]

    b = broker_factory(*SMALL, *NEVER_CLEANS)
    rc, out = _apply_plan(b, _plan(tmp_path / "store", int(time.time() * 1000)), tmp_path, "plan")
    assert rc == 0 and out["segments_removed"], out
    (dead,) = await _dead_letters(b, "CG_late", expect=1)
    assert (int(dead.properties["TXMQ_HALF"]), dead.properties["TXMQ_REASON"]) == (half, "expired")

    def end(half_offset: int) -> dict:
        return {"producerGroup": "PG_old", "tranStateTableOffset": sent.queue_offset, "commitLogOffset": half_offset,
                "commitOrRollback": "8", "fromTransactionCheck": "false", "msgId": sent.msg_id,
                "transactionId": sent.msg_id}
    resp = await _admin(b.broker, RequestCode.END_TRANSACTION, end(half))
    assert resp.code == ResponseCode.TRANSACTION_FAILED, resp.remark
    assert dead.offset_msg_id in resp.remark and "Paid" in resp.remark, resp.remark
    said = [line for line in b.log().splitlines() if "committed a transaction already dead-lettered" in line]
    assert len(said) == 1 and dead.offset_msg_id in said[0] and str(half) in said[0], said
    # The same id naming another removed offset is not its dead letter: refused as before, nothing named.
    other = await _admin(b.broker, RequestCode.END_TRANSACTION, end(half + 1))
    assert (other.code, other.remark) == (ResponseCode.SYSTEM_ERROR, "Find prepared transaction message failed")
    metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read())
    assert 'txmq_transaction_commits_after_dead_letter_total{producer_group="PG_old"} 1.0' in metrics.decode()
    assert 'txmq_requests_refused_total{reason="end-half-removed"} 2.0' in metrics.decode()
