"""An expiry plan made by the Spark job from a running broker's store, applied through that broker:
expired transactions land in the dead-letter topic with reason `expired`, the younger undecided one is
untouched, old sealed segments are removed by the store (the broker agreeing by its own clock), and
applying a plan twice changes nothing."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from tests.integration.conftest import broker_factory  # noqa: F401 - the real-broker fixture
from tests.support.broker_process import REPO
from tests.support.faketime import LIBFAKETIME, SKIP_REASON, past_env

RETENTION_H = 0.0006                      # 2.16 s: the 72 hours of production, shrunk
RETENTION_MS = int(RETENTION_H * 3600 * 1000)


class Undecided:
    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    def check_local_transaction(self, msg):
        return S.UNKNOW


def _admin(b, *args) -> dict:
    out = subprocess.run([sys.executable, "-m", "broker", "admin", "--broker", b.broker, *args], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


async def _fill(b):
    async with TransactionProducer(b.namesrv, "PG_expiry", Undecided()) as tx:
        for i in range(2):
            await tx.send_in_transaction("Expiring", f"old-{i}".encode())
    async with Producer(b.namesrv, "PG_flow") as producer:
        for i in range(600):
            await producer.send("Flow", b"f" * 1024)
    consumer = PullConsumer(b.namesrv, "CG_flow")
    for mq in await consumer.fetch_queues("Flow"):
        await consumer.commit_offset(mq, await consumer.max_offset(mq))
    await consumer.shutdown()


async def _young(b):
    async with TransactionProducer(b.namesrv, "PG_expiry", Undecided()) as tx:
        await tx.send_in_transaction("Expiring", b"young")


async def _dead_letters(b):
    consumer = PullConsumer(b.namesrv, "CG_dead")
    mq = (await consumer.fetch_queues("TRANS_CHECK_MAX_TIME_TOPIC"))[0]
    msgs = (await consumer.pull(mq, 0, max_nums=32)).messages
    await consumer.shutdown()
    return msgs


# Whatever the host's disk: above the clean ratio (75%; CI's disk at 80% with old test directories) the cleaner
# removed the expired segments before the plan could name them, and the plan failed reading them.
ROOMY_DISK = ("--disk-clean-ratio", "0.97", "--disk-force-clean-ratio", "0.98", "--disk-refuse-ratio", "0.99")


def _wait_persisted(path, check, timeout=20.0):
    """Until the broker's periodic offset persistence has written what ``check`` looks for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check(json.loads(path.read_text())):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{path} never showed the expected offsets")


FLAGS = ("--segment-size", "262144", "--max-message-size", "16384",
         "--transaction-retention-hours", str(RETENTION_H), "--file-reserved-hours", str(RETENTION_H),
         "--transaction-timeout-ms", "600000", "--transaction-check-interval-ms", "600000", *ROOMY_DISK)


def _planned(spark, broker_factory, tmp_path):  # noqa: F811
    """A broker with 2 expired undecided halves and 600 consumed messages past the retention, 1 young undecided
    half, and the Spark job's plan for its store (written to plan1.json)."""
    from ops.spark.expiry import build_plan
    from ops.spark.plan import write_plan

    store = tmp_path / "store"
    b = broker_factory(*FLAGS)
    asyncio.run(_fill(b))
    # (the table is wrapped as RocketMQ's {"offsetTable": ...} once the file also saves who made each offset)
    _wait_persisted(store / "config" / "consumerOffset.json",
                    lambda o: any(k.endswith("@CG_flow") for k in o.get("offsetTable", o)))
    time.sleep(RETENTION_MS / 1000 + 0.3)     # the subject of the test: age past the retention
    young_ms = int(time.time() * 1000)
    asyncio.run(_young(b))

    plan = build_plan(spark, str(store), retention_ms=RETENTION_MS, now_ms=young_ms + 200)
    assert sorted(h["uniq_key"] != "" for h in plan["halves"]) == [True, True]
    assert {h["producer_group"] for h in plan["halves"]} == {"PG_expiry"}
    assert plan["segments"], "the old traffic filled no sealed segment"
    write_plan(plan, str(tmp_path / "plan1.json"))
    return b, plan, store


def test_apply_expiry_plan_against_a_running_broker(spark, broker_factory, tmp_path):  # noqa: F811
    b, plan, store = _planned(spark, broker_factory, tmp_path)
    first = _admin(b, "apply-expiry", str(tmp_path / "plan1.json"))
    assert len(first["expired"]) == 2 and first["skipped"] == []
    assert first["segments_removed"] == [s["name"] for s in plan["segments"]], first
    on_disk = {p.name for p in (store / "commitlog").iterdir()}
    assert not on_disk & set(first["segments_removed"])

    dead = asyncio.run(_dead_letters(b))
    assert sorted(m.body for m in dead) == [b"old-0", b"old-1"]
    assert {m.properties["TXMQ_REASON"] for m in dead} == {"expired"}
    pending = _admin(b, "list", "--json")["pending"]
    assert [p["uniq_key"] for p in pending] and len(pending) == 1     # the young one, untouched

    again = _admin(b, "apply-expiry", str(tmp_path / "plan1.json"))
    assert again["expired"] == [] and len(again["skipped"]) == 2 and again["segments_removed"] == []
    assert again["segments_kept"] == [] and again["segments_gone"] == first["segments_removed"], again
    assert len(_admin(b, "list", "--json")["pending"]) == 1


def test_a_plan_applied_again_after_the_broker_was_killed_midway_finishes(spark, broker_factory, tmp_path):  # noqa: F811
    """The real broker killed -9 while it applied the Spark job's plan, once its first listed segment was gone (paced
    by that file leaving the disk, not a sleep), then restarted: the same plan applied again removes every listed
    segment still there and says which had gone before, keeps none, and dead-letters each expired half once."""
    b, plan, store = _planned(spark, broker_factory, tmp_path)
    listed = [s["name"] for s in plan["segments"]]
    assert len(listed) >= 2, plan["segments"]
    first_file = store / "commitlog" / listed[0]
    applying = subprocess.Popen([sys.executable, "-m", "broker", "admin", "--broker", b.broker, "apply-expiry",
                                 str(tmp_path / "plan1.json")], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while first_file.exists():
            assert time.monotonic() < deadline and applying.poll() is None, "the apply ended, its first segment there"
            time.sleep(0.001)
        b.kill()                                # -9, as soon as the first listed segment has left the disk
    finally:
        applying.communicate(timeout=60)
    b = broker_factory(*FLAGS)
    again = _admin(b, "apply-expiry", str(tmp_path / "plan1.json"))
    assert again["segments_kept"] == [], again
    assert again["segments_gone"] + again["segments_removed"] == listed and again["segments_gone"], again
    assert not {p.name for p in (store / "commitlog").iterdir()} & set(listed)
    dead = asyncio.run(_dead_letters(b))
    assert sorted(m.body for m in dead) == [b"old-0", b"old-1"]
    assert len(_admin(b, "list", "--json")["pending"]) == 1               # the young one, untouched
    third = _admin(b, "apply-expiry", str(tmp_path / "plan1.json"))
    assert (third["segments_removed"], third["segments_kept"], third["segments_gone"]) == ([], [], listed), third


@pytest.mark.skipif(LIBFAKETIME is None, reason=SKIP_REASON)
def test_spark_plans_for_a_store_written_80_hours_ago_plus_fresh(spark, broker_factory, tmp_path):  # noqa: F811
    """The issue's scenario end to end: the plan of `ops.spark expiry --now-ms <now + 100 h>` removes
    nothing (it used to delete 1,044 of 1,500 fresh messages); the plan for now removes the old segments."""
    from ops.spark.expiry import build_plan
    from ops.spark.plan import write_plan
    from tests.integration.test_retention_process import FLAGS, N, _old_traffic, _send
    from tests.support.offsets import drain

    store = tmp_path / "store"
    past = broker_factory(*FLAGS, env=past_env("-80h"))
    asyncio.run(_old_traffic(past))
    assert past.stop() == 0
    b = broker_factory(*FLAGS)
    now = int(time.time() * 1000)
    asyncio.run(_send(b, "fresh", N))
    _wait_persisted(store / "segments.json",
                    lambda m: len(m["segments"]) == len(list((store / "commitlog").iterdir())))
    future = build_plan(spark, str(store), retention_ms=72 * 3_600_000, now_ms=now + 100 * 3_600_000)
    assert len(future["halves"]) == 1 and future["segments"]
    write_plan(future, str(tmp_path / "future.json"))
    out = subprocess.run([sys.executable, "-m", "broker", "admin", "--broker", b.broker, "apply-expiry",
                          str(tmp_path / "future.json")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "ahead of this broker's clock" in out.stderr
    good = build_plan(spark, str(store), retention_ms=72 * 3_600_000, now_ms=int(time.time() * 1000))
    assert [u["group"] for u in good["report"]["unconsumed"]] == ["CG_behind"]
    write_plan(good, str(tmp_path / "good.json"))
    applied = _admin(b, "apply-expiry", str(tmp_path / "good.json"))
    assert applied["segments_removed"] == [s["name"] for s in good["segments"]] and applied["segments_removed"]
    assert applied["expired"] == [good["halves"][0]["commit_log_offset"]]
    _, moved, bodies = asyncio.run(drain(b.namesrv, "CG_behind", "Flow"))
    assert moved >= 1 and sum(1 for x in bodies if x.startswith(b"fresh-")) == N
    print(f"\nSPARK-PLANS future plan listed {len(future['segments'])} segments ({len(future['halves'])} half), "
          f"removed 0: {out.stderr.strip()[:120]}; good plan removed {len(applied['segments_removed'])} segments "
          f"and expired {len(applied['expired'])} half; report {good['report']}; fresh readable "
          f"{sum(1 for x in bodies if x.startswith(b'fresh-'))}/{N}")


def test_a_segment_holding_a_half_younger_than_the_brokers_transaction_retention_is_kept(
        spark, broker_factory, tmp_path):  # noqa: F811
    """--transaction-retention-hours longer than --file-reserved-hours: the operator keeps undecided
    transactions longer than the log's retention. The plan's segment holding such a half must stay
    (the half with it, still pending), not be removed after dead-lettering the half as `expired`
    while the same reply skips that half as "younger than the retention"."""
    from ops.spark.expiry import build_plan
    from ops.spark.plan import write_plan

    store = tmp_path / "store"
    b = broker_factory("--segment-size", "262144", "--max-message-size", "16384",
                       "--transaction-retention-hours", "1", "--file-reserved-hours", str(RETENTION_H),
                       "--transaction-timeout-ms", "600000", "--transaction-check-interval-ms", "600000",
                       *ROOMY_DISK)
    asyncio.run(_fill(b))
    time.sleep(RETENTION_MS / 1000 + 0.3)     # the subject: the segments age past the log's retention
    plan = build_plan(spark, str(store), retention_ms=RETENTION_MS, now_ms=int(time.time() * 1000))
    halves = sorted(h["commit_log_offset"] for h in plan["halves"])
    assert len(halves) == 2 and plan["segments"] and plan["segments"][0]["start_offset"] <= halves[0]
    write_plan(plan, str(tmp_path / "plan.json"))
    applied = _admin(b, "apply-expiry", str(tmp_path / "plan.json"))
    assert applied["expired"] == [] and sorted(s["commit_log_offset"] for s in applied["skipped"]) == halves
    assert applied["segments_removed"] == [], applied
    why = applied["segments_kept"][0]["why"]
    assert "younger than transaction_retention_hours" in why, why
    assert len(_admin(b, "list", "--json")["pending"]) == 2
    assert asyncio.run(_dead_letters_or_none(b)) == []


async def _dead_letters_or_none(b):
    from protocol.errors import TopicNotExistError

    try:
        return await _dead_letters(b)
    except TopicNotExistError:
        return []
