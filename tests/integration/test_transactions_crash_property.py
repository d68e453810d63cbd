"""Property: a seeded random transaction workload, SIGKILLed after N acknowledged operations, loses, repeats and
re-asks nothing that was acknowledged.

Each transaction draws a fate: decided by its END (commit or rollback), decided by its check (the local
transaction says UNKNOW, the check-back commits or rolls back), decided by an operator (admin resolve), or never
decided (every check answers UNKNOW). The broker is killed after several drawn numbers of acknowledged operations
(a half's SEND_OK, an END's or an admin resolve's SUCCESS): progress, not the clock. Snapshots are frequent, so
kills fall before, between and after them; checks are due at once, so a kill can fall between a check's record and
its answer. The invariants, against what was acknowledged:

- a transaction whose decision was acknowledged is never checked again by a broker started after it;
- after one more kill, a broker that checks nothing lists as undecided every acknowledged never-decided half and
  no acknowledged decision, its rocketmq_half_messages gauge says the same number, and it dead-lettered nothing;
- once checks have settled the rest, the undecided are exactly the acknowledged never-decided halves, and the
  real topic holds each committed transaction once and no rolled-back one. That broker starts with no decision
  table and no snapshot, from the log alone (as a slave's promotion or a damaged table does): the table, kept
  in shared memory, outlives a SIGKILL and hid a decision whose op record was never written or never replayed.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import time
import urllib.request

import pytest

from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.errors import BrokerError
from protocol.message import decode_offset_msg_id
from protocol.txlog import DEAD_TOPIC
from tests.fault.test_transactions_crash import _fixed, _listed
from tests.fault.test_transactions_kill import _delivered
from tests.support.bounded import bounded
from tests.support.broker_process import NO_CHECKS
from tests.support.cluster_process import request

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

TOPIC = "TxProp"
GROUP = "PG_prop"
CONCURRENCY = 8
FATES = ["commit", "rollback", "check-commit", "check-rollback", "admin-commit", "admin-rollback", "undecided"]
# Checks due at once and often, snapshots frequent.
CHECKING = ("--transaction-check-interval-ms", "150", "--transaction-timeout-ms", "0",
            "--transaction-snapshot-interval-s", "0.3")


class Ledger:
    """The truth: each transaction's fate, what its local transaction did, and which decisions were acknowledged
    (and by which broker generation)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.fate: dict[bytes, str] = {}
        self.executed: dict[bytes, S] = {}
        self.key: dict[bytes, str] = {}             # body -> uniq key, once its half was acknowledged
        self.half_at: dict[bytes, int] = {}         # body -> the half's commit-log offset
        self.decided: dict[bytes, int] = {}         # body -> generation in which its decision was acknowledged
        self.failed: set[bytes] = set()             # bodies whose half's send raised: their transaction never ran
        self.resumed: set[bytes] = set()            # dead-lettered, then resumed by an operator: checks now commit
        self.asked: list[tuple[bytes, int]] = []    # (body, generation) of every check
        self.generation = 0

    def final(self, body: bytes) -> S:
        fate = self.fate[body]
        if fate.endswith("commit") or fate == "resumed":
            return S.COMMIT_MESSAGE
        return S.UNKNOW if fate == "undecided" else S.ROLLBACK_MESSAGE

    def execute_local_transaction(self, msg, arg):
        fate = self.fate[msg.body]
        self.executed[msg.body] = self.final(msg.body)
        return self.final(msg.body) if fate in ("commit", "rollback") else S.UNKNOW

    def check_local_transaction(self, msg):
        self.asked.append((msg.body, self.generation))
        if msg.body not in self.executed:       # not run yet (SEND_OK on its way), or never (the send failed)
            return S.ROLLBACK_MESSAGE if msg.body in self.failed else S.UNKNOW
        if self.fate[msg.body] == "resumed" and msg.body not in self.resumed:
            return S.UNKNOW             # until dead-lettered and resumed: the producer that was down is back
        return S.UNKNOW if self.fate[msg.body].startswith("admin") else self.executed[msg.body]


async def _gauge(b, name: str) -> float:
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode())
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


async def _admin(addr: str, code: int, half_at: int, **fields: str) -> bool:
    """An operator's commit, rollback (902) or resume (903); True once the broker says it is done."""
    try:
        resp = await request(addr, code, {"commitLogOffset": str(half_at), **fields})
    except (BrokerError, OSError):
        return False
    return resp.code == ResponseCode.SUCCESS


def _keys(bodies, ledger: Ledger) -> set[str]:
    """The uniq keys of those acknowledged. A dead letter may be of a transaction that has none: its half was stored
    (SEND_OK) but its END, retried across a kill, was refused TRANSACTION_FAILED because its checks had meanwhile
    reached the limit and dead-lettered it; send_in_transaction raised, so the ledger counts it failed."""
    return {ledger.key[body] for body in bodies if body in ledger.key}


def _dead_now(dead: list[bytes], delivered: list[bytes], ledger: Ledger, pending: set[str]) -> set[bytes]:
    """The transactions dead-lettered now, by their dead letters: a resumed one is again only if not delivered
    or pending since (a check limit reached while the END of its check crossed a kill), with a second letter."""
    again = ledger.resumed - set(delivered) - {body for body in ledger.resumed if ledger.key[body] in pending}
    assert all(dead.count(body) >= 2 for body in again), "an acknowledged resume undone by a kill"
    return (set(dead) - ledger.resumed) | again


# (seed, transaction_check_max): with 3, every never-decided transaction is dead-lettered on the way.
@pytest.mark.parametrize("seed, check_max", [(20261128, 100000), (7, 100000), (4242, 3)])
@bounded(110)
async def test_kills_after_acknowledged_operations_lose_repeat_and_reask_nothing(broker_factory, seed, check_max):
    rng = random.Random(seed)
    total = 90
    fates = FATES if check_max > 3 else [*(f for f in FATES if not f.startswith("admin")), "resumed"]
    # (a dead-letter run gives a check-decided transaction its immunity, so its 3 checks outlast a SEND_OK's way)
    flags = (*CHECKING, "--transaction-check-max", str(check_max),
             *(("--transaction-timeout-ms", "1000") if check_max <= 3 else ()))
    kill_at = sorted(rng.sample(range(10, total), 3))       # acknowledged operations before each kill
    ledger = Ledger(rng)
    b = broker_factory(*flags)
    brokers = [b]
    producer = TransactionProducer(b.namesrv, GROUP, ledger, end_retries=6, end_timeout=2.0, retries=0)
    await producer.start()
    acked = 0
    started = 0
    up = asyncio.Event()
    up.set()
    progress = asyncio.Event()

    def ack(body: bytes | None = None) -> None:
        nonlocal acked
        acked += 1
        if body is not None:
            ledger.decided.setdefault(body, ledger.generation)
        progress.set()

    async def admin(body: bytes) -> None:
        """Resolve it, or resume it once it is dead-lettered (refused till then), until acknowledged."""
        fate = ledger.fate[body]
        code, fields = ((RequestCode.TXMQ_RESUME_TRANSACTION, {}) if fate == "resumed" else
                        (RequestCode.TXMQ_RESOLVE_TRANSACTION, {"decision": fate.removeprefix("admin-")}))
        while not await _admin(brokers[-1].broker, code, ledger.half_at[body], **fields):
            await up.wait()
            await asyncio.sleep(0.05)
        if fate == "resumed":
            ledger.resumed.add(body)
            ack()
        else:
            ack(body)

    async def worker() -> None:
        nonlocal started
        while started < total:
            body = f"tx-{seed}-{started}".encode()
            started += 1
            ledger.fate[body] = rng.choice(fates)
            try:
                res = await producer.send_in_transaction(TOPIC, body)
            except (BrokerError, OSError):
                ledger.failed.add(body)
                await up.wait()                 # never retried: its half may be stored, and checks settle it
                continue
            ledger.key[body] = res.send_result.msg_id
            ledger.half_at[body] = decode_offset_msg_id(res.send_result.offset_msg_id)[2]
            ack()
            if res.state in (S.COMMIT_MESSAGE, S.ROLLBACK_MESSAGE) and res.acknowledged:
                ack(body)
            elif ledger.fate[body].startswith("admin") or ledger.fate[body] == "resumed":
                await admin(body)

    async def killer() -> None:
        for n in kill_at:
            while acked < n and not done.is_set():
                progress.clear()
                await progress.wait()
            if done.is_set():
                return
            up.clear()
            brokers[-1].kill()
            brokers.append(await asyncio.to_thread(broker_factory, *_fixed(b, *flags)))
            ledger.generation += 1
            up.set()

    done = asyncio.Event()
    killing = asyncio.create_task(killer())
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    done.set()
    progress.set()
    await killing

    # One more kill, then a broker that checks nothing and that no END reaches (the producer is gone, ENDs it was
    # retrying with it): its undecided index is what the log says, unsettled.
    await producer.shutdown()
    # The live broker's gauge and list agree. With the producer gone only a check limit still decides (it
    # dead-letters with no producer to ask), and only downwards: the list read between two equal gauges.
    while True:
        gauge = await _gauge(brokers[-1], "rocketmq_half_messages")
        live = (await _listed(brokers[-1]))["total"]
        if await _gauge(brokers[-1], "rocketmq_half_messages") == gauge:
            break
    assert gauge == live, "the half-message gauge disagrees with the list"
    brokers[-1].kill()
    quiet = await asyncio.to_thread(broker_factory, *_fixed(b, *NO_CHECKS))
    ledger.generation += 1
    listed = await _listed(quiet)
    pending = {row["uniq_key"] for row in listed["pending"]}
    dead = await _delivered(quiet.namesrv, DEAD_TOPIC)
    never = {body for body in ledger.key if ledger.fate[body] == "undecided"}
    resumed = {body for body in ledger.key if ledger.fate[body] == "resumed"}
    # (a resume whose reply a kill cut off is asked again: refused till its transaction is dead-lettered again)
    twice = {d for d in dead if dead.count(d) > 1} - resumed
    assert not twice, f"dead-lettered twice: {sorted(twice)}"
    assert listed["dead_lettered"] == len(_dead_now(dead, await _delivered(quiet.namesrv, TOPIC), ledger, pending))
    assert _keys(never, ledger) <= pending | _keys(dead, ledger), "acknowledged undecided halves lost from the index"
    # (an unacknowledged decision may lose to the check limit: its checks went on while its END was on its way)
    assert not set(dead) & set(ledger.decided), f"acknowledged decisions dead-lettered: {set(dead) & set(ledger.decided)}"
    decided = _keys(ledger.decided, ledger)
    assert not pending & decided, f"acknowledged decisions undone by a kill: {sorted(pending & decided)}"
    assert listed["total"] == len(pending) == await _gauge(quiet, "rocketmq_half_messages")
    reasked = [(body, g) for body, g in ledger.asked if body in ledger.decided and g > ledger.decided[body]]
    assert not reasked, f"decided transactions checked again after a restart: {reasked[:5]}"

    # Checks settle what the kills left unanswered; the never-decided stay (or are dead-lettered), nothing else.
    # The decisions as the log alone says them: the table and the snapshot gone.
    quiet.kill()
    shutil.rmtree(b.store_dir / "transactions")
    last = await asyncio.to_thread(broker_factory, *_fixed(b, *flags))
    ledger.generation += 1
    producer = TransactionProducer(last.namesrv, GROUP, ledger, retries=0)     # the group's producer, back
    await producer.start()
    stays = set() if check_max <= 3 else _keys(never, ledger)
    while {row["uniq_key"] for row in (await _listed(last))["pending"]} != stays:
        await asyncio.sleep(0.1)
    await producer.shutdown()
    delivered = await _delivered(last.namesrv, TOPIC)
    dead = await _delivered(last.namesrv, DEAD_TOPIC)
    dead_now = _dead_now(dead, delivered, ledger, set())
    committed = {body for body in ledger.executed if ledger.final(body) is S.COMMIT_MESSAGE} - dead_now
    assert sorted(delivered) == sorted(committed), (
        f"twice: {sorted({d for d in delivered if delivered.count(d) > 1})}, "
        f"lost: {sorted(committed - set(delivered))}, not committed: {sorted(set(delivered) - committed)}")
    assert set(dead) >= (set() if stays else never | resumed) and not set(dead) & set(ledger.decided)
    assert not dead or not stays, f"dead-lettered with no check limit to reach: {sorted(dead)}"
    assert not {d for d in dead if dead.count(d) > 1} - resumed, f"dead-lettered twice: {sorted(dead)}"
    reasked = [(body, g) for body, g in ledger.asked if body in ledger.decided and g > ledger.decided[body]]
    assert not reasked, f"decided transactions checked again by a broker rebuilt from the log: {reasked[:5]}"
    listed = await _listed(last)
    assert listed["dead_lettered"] == len(dead_now)
    assert listed["total"] == len(stays) == await _gauge(last, "rocketmq_half_messages")
    print(f"seed {seed}: {total} transactions, kills after {kill_at} acknowledged operations (of {acked}), "
          f"{len(committed)} committed, {len(never)} never decided, {len(dead)} dead-lettered, "
          f"{len(ledger.asked)} checks")


class Undecided:
    """Every local transaction and check says UNKNOW; records the checks asked, by broker generation."""

    def __init__(self):
        self.generation = 0
        self.asked: list[tuple[bytes, int]] = []
        self.checked = asyncio.Event()

    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    def check_local_transaction(self, msg):
        self.asked.append((msg.body, self.generation))
        self.checked.set()
        return S.UNKNOW


@bounded(60)
async def test_an_expiry_plan_killed_midway_then_applied_again_dead_letters_each_expired_half_once(broker_factory):
    """The expiry (transaction_retention_hours, made small) of an apply-expiry plan, killed after its first dead
    letter and applied again: each undecided half is dead-lettered once, as expired, none is checked again by a
    broker started after its expiry was acknowledged (its table gone: from the log alone), a committed one the
    plan lists is skipped, and an END COMMIT after the expiry is refused and delivers nothing."""
    flags = (*CHECKING, "--transaction-check-max", "100000", "--transaction-retention-hours", "0.0005")    # 1.8 s
    b = broker_factory(*flags)
    listener = Undecided()
    producer = TransactionProducer(b.namesrv, GROUP, listener, retries=0)
    await producer.start()
    halves: dict[int, bytes] = {}
    for i in range(30):
        res = (await producer.send_in_transaction(TOPIC, f"exp-{i}".encode())).send_result
        halves[decode_offset_msg_id(res.offset_msg_id)[2]] = f"exp-{i}".encode()
    committed = {}
    for i in range(3):
        res = await producer.send_in_transaction(TOPIC, f"kept-{i}".encode())
        assert res.state is S.UNKNOW
        half = decode_offset_msg_id(res.send_result.offset_msg_id)[2]
        assert await _admin(b.broker, RequestCode.TXMQ_RESOLVE_TRANSACTION, half, decision="commit")
        committed[half] = f"kept-{i}".encode()
    # (expiry is about age: the last half past the retention by the broker's own record of its store time)
    youngest = min(row["age_ms"] for row in (await _listed(b))["pending"])
    await asyncio.sleep(max(0, 1800 + 300 - youngest) / 1000)
    store_id = json.loads((b.store_dir / "segments.json").read_text())["store_id"]
    now = int(time.time() * 1000)
    plan = json.dumps({"version": 2, "store_id": store_id, "created_ms": now, "now_ms": now, "retention_ms": 0,
                       "segments": [], "halves": [{"commit_log_offset": off} for off in [*halves, *committed]]})

    # Killed once its first dead letter is stored: the plan's reply never comes.
    applying = asyncio.create_task(request(b.broker, RequestCode.TXMQ_APPLY_EXPIRY, body=plan.encode()))
    while not (await _listed(b))["dead_lettered"] and not applying.done():     # (a round trip a poll)
        pass
    b.kill()
    with contextlib.suppress(BrokerError, OSError):
        await applying
    again = await asyncio.to_thread(broker_factory, *_fixed(b, *flags))
    listener.generation += 1
    before = (await _listed(again))["dead_lettered"]        # (expired by the first application, before its kill)
    resp = await request(again.broker, RequestCode.TXMQ_APPLY_EXPIRY, body=plan.encode())
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    applied = json.loads(resp.body_bytes())
    skipped = {row["commit_log_offset"] for row in applied["skipped"]}
    assert set(applied["expired"]) | skipped == {*halves, *committed} and set(committed) <= skipped
    acknowledged = listener.generation
    assert (await _listed(again))["total"] == 0 == await _gauge(again, "rocketmq_half_messages")

    # After an acknowledged expiry: killed, its decisions read from the log alone.
    again.kill()
    shutil.rmtree(b.store_dir / "transactions")
    last = await asyncio.to_thread(broker_factory, *_fixed(b, *flags))
    listener.generation += 1
    listener.checked.clear()
    await producer.send_in_transaction(TOPIC, b"after")         # checked at once: the check timer has run
    while ("after", listener.generation) not in {(body.decode(), g) for body, g in listener.asked}:
        listener.checked.clear()
        await listener.checked.wait()
    expired_at = next(iter(halves))
    resp = await request(last.broker, RequestCode.END_TRANSACTION, {
        "producerGroup": GROUP, "tranStateTableOffset": "0", "commitLogOffset": str(expired_at),
        "commitOrRollback": "8", "fromTransactionCheck": "false"})
    assert resp.code == ResponseCode.TRANSACTION_FAILED, resp.remark
    await producer.shutdown()
    listed = await _listed(last)
    dead = await _delivered(last.namesrv, DEAD_TOPIC)
    assert sorted(dead) == sorted(halves.values()), "each expired half dead-lettered once"
    assert listed["total"] == 1 == await _gauge(last, "rocketmq_half_messages")     # "after"
    assert listed["dead_lettered"] == len(halves)
    assert sorted(await _delivered(last.namesrv, TOPIC)) == sorted(committed.values())
    reasked = [(body, g) for body, g in listener.asked if body in set(halves.values()) and g > acknowledged]
    assert not reasked, f"expired transactions checked again: {reasked[:5]}"
    print(f"{before} of {len(halves)} expired before the kill, {len(applied['expired'])} by the plan applied again")
