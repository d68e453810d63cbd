"""Operating the broker: metric snapshots on disk, the admin command line, clean shutdown."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from tests.support.bounded import bounded
from tests.support.broker_process import REPO

pytestmark = pytest.mark.asyncio


async def test_metric_snapshots_are_appended_for_the_rollups(broker_factory, tmp_path):
    b = broker_factory("--metrics-snapshot-interval-s", "0.2")
    async with Producer(b.namesrv, "PG_snap") as producer:
        await producer.send("Snap", b"x")
    folder = tmp_path / "store" / "metrics"
    async with asyncio.timeout(10):
        while not (folder.exists() and any(
                "SEND_MESSAGE_V2" in line for f in folder.glob("*.jsonl") for line in f.read_text().splitlines())):
            await asyncio.sleep(0.1)
    lines = [json.loads(line) for f in folder.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert all({"ts", "connections", "consumer_lag", "requests"} <= set(s) for s in lines)
    sends = [s["requests"]["SEND_MESSAGE_V2"] for s in lines if "SEND_MESSAGE_V2" in s["requests"]]
    assert sends[0]["count"] >= 1 and sends[0]["p99_ms"] >= sends[0]["p50_ms"] >= 0


async def test_old_metric_snapshot_files_are_removed_not_kept_for_good(broker_factory, tmp_path):
    """One snapshot file a day was appended under <store>/metrics and none was ever removed: months of them on
    the store's disk, whose pressure cleaning removes commit-log segments (messages) and never these. Files of
    dates more than metrics_snapshot_retention_days (here 7) before today go; others in the folder stay."""
    folder = tmp_path / "store" / "metrics"
    folder.mkdir(parents=True)
    now = time.time()
    day = lambda days_ago: time.strftime("%Y-%m-%d", time.gmtime(now - days_ago * 86400))  # noqa: E731
    old = [folder / "2020-01-01.jsonl", folder / f"{day(8)}.jsonl", folder / f"{day(30)}.jsonl"]
    kept = [folder / f"{day(7)}.jsonl", folder / f"{day(1)}.jsonl", folder / "2020-13-45.jsonl",
            folder / "notes.txt"]
    for path in old + kept:
        path.write_text('{"ts": 0}\n')
    broker_factory("--metrics-snapshot-interval-s", "0.05")
    async with asyncio.timeout(10):
        while any(p.exists() for p in old):
            await asyncio.sleep(0.05)
    assert all(p.exists() for p in kept[1:])
    # Past UTC midnight since ``now``, the broker's today is the test's tomorrow: day(7) is then 8 days old.
    assert kept[0].exists() or int(time.time() // 86400) != int(now // 86400)
    assert (folder / f"{day(0)}.jsonl").exists() or (folder / f"{day(-1)}.jsonl").exists()


def _admin(b, *args):
    return _admin_at(b.broker, *args)


def _admin_at(addr: str, *args):
    return subprocess.run([sys.executable, "-m", "broker", "admin", "--broker", addr, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=30)


class Unknown:
    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    def check_local_transaction(self, msg):
        return S.UNKNOW


async def test_admin_cli_lists_and_resolves(broker_factory):
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
    async with TransactionProducer(b.namesrv, "PG_cli", Unknown()) as producer:
        await producer.send_in_transaction("TxCli", b"in doubt")
        listed = await asyncio.to_thread(_admin, b, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)["pending"]
        assert [(r["group"], r["topic"], r["last_answer"]) for r in rows] == [("PG_cli", "TxCli", "UNKNOWN")]
        table = await asyncio.to_thread(_admin, b, "list")
        assert "PG_cli" in table.stdout and "1 undecided" in table.stdout
        done = await asyncio.to_thread(_admin, b, "rollback", str(rows[0]["commit_log_offset"]))
        assert done.returncode == 0, done.stderr
        again = await asyncio.to_thread(_admin, b, "commit", str(rows[0]["commit_log_offset"]))
        assert again.returncode == 1 and "first decision wins" in again.stderr
        missing = await asyncio.to_thread(_admin, b, "resume", "123456789")
        assert missing.returncode == 1 and "not dead-lettered" in missing.stderr
    assert "forces ROLLBACK" in b.log()


@bounded(120)
async def test_admin_commit_of_an_offset_not_a_half_says_what_is_there_and_changes_nothing(broker_factory):
    """`admin commit OFFSET` of a plain message's offset, of one inside a record, past the log's end or negative was
    refused "Find prepared transaction message failed" alone, whatever was wrong, and the broker's log said only
    "admin forces COMMIT of the transaction at OFFSET", read as done. The refusal says what lies at the offset, the
    log says it was refused, and the undecided half is left as it was."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
    async with Producer(b.namesrv, "PG_plain_off") as producer:
        plain = await producer.send("PlainOff", b"plain")
    async with TransactionProducer(b.namesrv, "PG_not_half", Unknown()) as producer:
        await producer.send_in_transaction("TxNotHalf", b"in doubt")
        before = json.loads((await asyncio.to_thread(_admin, b, "list", "--json")).stdout)["pending"]
        half = before[0]["commit_log_offset"]
        plain_off = int(plain.offset_msg_id[-16:], 16)
        cases = {plain_off: "is a message of topic PlainOff, not a transaction's half",
                 half + 1: f"no message starts at offset {half + 1}",
                 10**12: f"{10**12} is past the commit log's end",
                 -5: "-5 is not a commit-log offset"}
        for off, said in cases.items():
            for action in ("commit", "rollback"):
                done = await asyncio.to_thread(_admin, b, action, str(off))
                assert done.returncode == 1 and said in done.stderr and "nothing changed" in done.stderr, done.stderr
        after = json.loads((await asyncio.to_thread(_admin, b, "list", "--json")).stdout)["pending"]
        assert [(r["commit_log_offset"], r["uniq_key"]) for r in after] == [(half, before[0]["uniq_key"])]
    assert f"COMMIT of the transaction at {plain_off} refused" in b.log()
    assert f"ROLLBACK of the transaction at {10**12} refused" in b.log()
    resumed = await asyncio.to_thread(_admin, b, "resume", str(plain_off))
    assert resumed.returncode == 1 and f"resume of the transaction at {plain_off} refused" in b.log(), resumed.stderr


def _poke(store_dir, phys: int, at: int, value: bytes) -> None:
    """Write ``value`` over byte ``at`` on of the record at ``phys`` (first segment), the broker running: its
    mapped pages see it at once."""
    with open(store_dir / "commitlog" / f"{0:020d}", "r+b") as f:
        f.seek(phys + at)
        f.write(value)


@bounded(120)
async def test_admin_commit_of_a_damaged_record_or_an_unreadable_half_is_refused_as_such(broker_factory):
    """`admin commit` of a record whose layout is damaged past its header (body length 2^31-1) raised the record's
    decode error out of the refusal: answered "refused (13): record at 0: body length ..." with no "nothing
    changed" and no "refused" line in the log. And an undecided half whose record no longer reads (its magic
    damaged) was refused "no message starts at offset N; nothing changed (`admin list` names the undecided
    halves)" while `admin list` named N: the operator was sent back to the offset he had given. Its rollback,
    which reads no record, decides it."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
    async with Producer(b.namesrv, "PG_damaged") as producer:
        plain = await producer.send("Damaged", b"plain")
    async with TransactionProducer(b.namesrv, "PG_unreadable", Unknown()) as producer:
        await producer.send_in_transaction("TxUnreadable", b"in doubt")
        half = json.loads((await asyncio.to_thread(_admin, b, "list", "--json")).stdout)["pending"][0]
        half = half["commit_log_offset"]
        plain_off = int(plain.offset_msg_id[-16:], 16)
        _poke(b.store_dir, plain_off, 84, (2**31 - 1).to_bytes(4, "big"))       # IPv4 hosts: BODYLEN at 84
        _poke(b.store_dir, half, 4, bytes(4))       # MAGICCODE
        done = await asyncio.to_thread(_admin, b, "commit", str(plain_off))
        assert done.returncode == 1 and f"the record at {plain_off} does not decode" in done.stderr, done.stderr
        assert "nothing changed" in done.stderr, done.stderr
        assert f"COMMIT of the transaction at {plain_off} refused" in b.log()
        done = await asyncio.to_thread(_admin, b, "commit", str(half))
        assert done.returncode == 1 and f"the half at {half} is undecided but its record does not read" in \
            done.stderr and "admin list" not in done.stderr and f"rollback {half}" in done.stderr, done.stderr
        listed = json.loads((await asyncio.to_thread(_admin, b, "list", "--json")).stdout)["pending"]
        assert [r["commit_log_offset"] for r in listed] == [half]
        rolled = await asyncio.to_thread(_admin, b, "rollback", str(half))
        assert rolled.returncode == 0, rolled.stderr
        assert json.loads((await asyncio.to_thread(_admin, b, "list", "--json")).stdout)["pending"] == []


@bounded(90)
async def test_admin_pointed_at_a_name_server_says_it_is_not_a_txmq_broker(broker_factory, tmp_path):
    """`admin --broker` given the name server's port (or a stock RocketMQ broker's) said "refused (3): request type
    901 not supported" alone. It says the server is not a txmq broker and which address to give, whatever the
    command, and exits 1."""
    b = broker_factory()
    plan = tmp_path / "plan.json"
    plan.write_text('{"halves": [], "segments": []}')
    for argv in (["list"], ["commit", "5"], ["resume", "5"], ["broker-status"], ["apply-expiry", str(plan)]):
        done = await asyncio.to_thread(_admin_at, b.namesrv, *argv)
        assert done.returncode == 1 and "not a txmq broker" in done.stderr, (argv, done.stderr)


@bounded(90)
async def test_admin_reaches_a_broker_by_a_bracketed_ipv6_address(broker_factory):
    """`admin --broker [::1]:PORT`, the usual way to write an IPv6 address with a port, looked "[::1]" up as a host
    name: "Name or service not known", the broker never reached. Brackets are taken off."""
    b = broker_factory("--host", "::1")
    for addr in (f"[::1]:{b.broker_port}", f"::1:{b.broker_port}"):
        done = await asyncio.to_thread(_admin_at, addr, "list")
        assert done.returncode == 0 and "0 undecided" in done.stdout, (addr, done.stderr)


@bounded(90)
async def test_admin_refuses_a_timeout_that_is_not_a_positive_time_and_sends_nothing(broker_factory):
    """`admin --timeout 0 commit OFFSET` sent the commit and did not wait for its answer: the transaction committed
    while the command said "got no response" and exited 1 (and nan or inf waited for ever). Such a timeout is bad
    input: exit 2, nothing sent, the half still undecided."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
    async with TransactionProducer(b.namesrv, "PG_timeout", Unknown()) as producer:
        await producer.send_in_transaction("TxTimeout", b"in doubt")
        rows = json.loads((await asyncio.to_thread(_admin, b, "list", "--json")).stdout)["pending"]
        half = str(rows[0]["commit_log_offset"])
        for timeout in ("0", "-1", "nan", "inf"):
            done = await asyncio.to_thread(_admin, b, "--timeout", timeout, "commit", half)
            assert done.returncode == 2 and "nothing was sent" in done.stderr, (timeout, done.returncode, done.stderr)
        still = json.loads((await asyncio.to_thread(_admin, b, "list", "--json")).stdout)["pending"]
        assert [r["commit_log_offset"] for r in still] == [rows[0]["commit_log_offset"]]


async def test_sigterm_exits_zero_and_keeps_what_was_acknowledged(broker_factory):
    b = broker_factory("--flush", "async", "--flush-interval-ms", "60000")
    async with Producer(b.namesrv, "PG_term") as producer:
        results = [await producer.send("Term", f"{i}".encode()) for i in range(20)]
    assert b.stop() == 0
    b2 = broker_factory()
    from consumer import PullConsumer
    consumer = PullConsumer(b2.namesrv, "CG_term")
    got = []
    for mq in await consumer.fetch_queues("Term"):
        got += [m.body for m in (await consumer.pull(mq, 0, max_nums=100)).messages]
    await consumer.shutdown()
    assert sorted(got, key=int) == [f"{i}".encode() for i in range(20)] and len(results) == 20


@bounded(90)
async def test_admin_list_says_how_many_it_did_not_list(broker_factory):
    """A list cut at its limit said only the total: the oldest rows, read as all of them, hid the newest in doubt.
    It says how many more there are, and a limit of any size is capped (a 10**9 one built a body no client reads)."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
    async with TransactionProducer(b.namesrv, "PG_more", Unknown()) as producer:
        sent = [await producer.send_in_transaction("TxMore", f"{i}".encode()) for i in range(3)]
        listed = await asyncio.to_thread(_admin, b, "list", "--limit", "1", "--json")
        assert listed.returncode == 0, listed.stderr
        data = json.loads(listed.stdout)
        assert (data["total"], data["more"], data["limit"]) == (3, 2, 1)
        assert [r["uniq_key"] for r in data["pending"]] == [sent[0].send_result.msg_id]     # the oldest
        table = await asyncio.to_thread(_admin, b, "list", "--limit", "1")
        assert "3 undecided" in table.stdout and "2 more not listed" in table.stdout, table.stdout
        huge = json.loads((await asyncio.to_thread(_admin, b, "list", "--limit", str(10**9), "--json")).stdout)
        assert (len(huge["pending"]), huge["more"], huge["limit"]) == (3, 0, 2_000)
        refused = await asyncio.to_thread(_admin, b, "list", "--limit", "-1")
        assert refused.returncode == 1 and "limit=-1" in refused.stderr, refused.stderr


@bounded(90)
async def test_admin_decision_whose_answer_is_not_waited_for_says_it_may_be_done(broker_factory, tmp_path):
    """`--timeout 0` was refused, but `--timeout 1e-9` (or any answer slower than --timeout: a slow fsync) did what
    0 did: the commit sent, "got no response in 1e-09 s", exit 1, read as not done though the broker may have
    committed it. A commit, rollback or resume (or a plan) that timed out says it may have been done and how to
    tell."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
    async with TransactionProducer(b.namesrv, "PG_unwaited", Unknown()) as producer:
        await producer.send_in_transaction("TxUnwaited", b"in doubt")
        half = json.loads((await asyncio.to_thread(_admin, b, "list", "--json")).stdout)["pending"][0]
        for action in ("commit", "rollback", "resume"):
            done = await asyncio.to_thread(_admin, b, "--timeout", "1e-9", action, str(half["commit_log_offset"]))
            assert done.returncode == 1 and "got no response" in done.stderr, done.stderr
            assert "may have been done" in done.stderr and "admin list" in done.stderr, done.stderr
    plan = tmp_path / "plan.json"
    plan.write_text('{"halves": [], "segments": []}')
    done = await asyncio.to_thread(_admin, b, "--timeout", "1e-9", "apply-expiry", str(plan))
    assert done.returncode == 1 and "may have been applied" in done.stderr, done.stderr


@bounded(90)
async def test_admin_list_of_limit_0_counts_and_names_no_next_page(broker_factory):
    """`admin list --limit 0` (a count) answered no rows and "--after -1 for the next page": the cursor it was given,
    so a script following next_after asked the same empty page for ever. It counts, and names no next page."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
    async with TransactionProducer(b.namesrv, "PG_count", Unknown()) as producer:
        for i in range(2):
            await producer.send_in_transaction("TxCount", f"{i}".encode())
        for after in ("-1", "0"):
            listed = await asyncio.to_thread(_admin, b, "list", "--limit", "0", "--after", after, "--json")
            assert listed.returncode == 0, listed.stderr
            data = json.loads(listed.stdout)
            assert (data["pending"], data["total"], data["next_after"]) == ([], 2, None), data
        table = await asyncio.to_thread(_admin, b, "list", "--limit", "0")
        assert "2 undecided" in table.stdout and "--after" not in table.stdout, table.stdout


@bounded(90)
async def test_admin_list_pages_through_every_undecided(broker_factory):
    """The list answered the oldest 2,000 at most and no option reached the rest: an operator with 50,000 in doubt
    saw the oldest 2,000 alone. Each page's last line names the next one's --after; followed, the pages list every
    undecided transaction once, oldest stored first, one decided between two pages included no more."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
    async with TransactionProducer(b.namesrv, "PG_pages", Unknown()) as producer:
        sent = [(await producer.send_in_transaction("TxPages", f"{i}".encode())).send_result.msg_id
                for i in range(7)]
        seen, argv = [], ["list", "--limit", "2"]
        for page in range(5):
            table = await asyncio.to_thread(_admin, b, *argv)
            assert table.returncode == 0, table.stderr
            data = json.loads((await asyncio.to_thread(_admin, b, *argv, "--json")).stdout)
            seen += [r["uniq_key"] for r in data["pending"]]
            if data["next_after"] is None:
                assert "--after" not in table.stdout, table.stdout
                break
            assert table.stdout.endswith(f"--after {data['next_after']} for the next page\n"), table.stdout
            argv = ["list", "--limit", "2", "--after", str(data["next_after"])]
            if page == 0:
                assert "5 more not listed" in table.stdout, table.stdout
                decided = await asyncio.to_thread(_admin, b, "commit", str(data["pending"][0]["commit_log_offset"]))
                assert decided.returncode == 0, decided.stderr
                sent.remove(seen[0])
            elif page == 1:     # not yet listed: decided, then never listed
                row = json.loads((await asyncio.to_thread(_admin, b, "list", "--json")).stdout)["pending"][-1]
                assert row["uniq_key"] == sent[-1]
                decided = await asyncio.to_thread(_admin, b, "rollback", str(row["commit_log_offset"]))
                assert decided.returncode == 0, decided.stderr
                sent.pop()
        seen.remove(seen[0])    # listed on the first page, then decided
        assert (seen, page) == (sent, 2)
