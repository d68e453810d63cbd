"""The expiry plan on a real local SparkSession over a store written by broker.store.

Applying a plan against a running broker (dead letters with reason `expired`, segments
removed, applying twice changes nothing) is tested by the broker's engineer with
`python -m broker admin apply-expiry`; here the plan itself is checked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from broker.store import ConsumerOffsets
from ops.spark import validate_plan
from tests.spark.storegen import StoreBuilder

pytestmark = pytest.mark.spark

H = 3_600_000
M = 60_000
NOW = 1710028800000 + 100 * H
CUTOFF = NOW - 72 * H
SEG = 8192


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("expiry") / "store")
    s = {}
    with StoreBuilder(d, segment_size=SEG) as b:
        for i in range(40):
            b.at(NOW - 100 * H + i).send("Orders")
        h = b.at(NOW - 99 * H).half("pg-a", "Pay")
        b.at(NOW - 99 * H + 1000).commit(h)                    # decided: never listed
        h = b.at(NOW - 98 * H).half("pg-a", "Pay")
        b.at(NOW - 98 * H + 1000).dead(h, "max-checks")        # closed by DEAD: not listed
        s["resumed"] = b.at(NOW - 97 * H).half("pg-b", "Ship")
        b.at(NOW - 97 * H + 1000).dead(s["resumed"], "max-checks")
        b.at(NOW - 97 * H + 2000).resume(s["resumed"])         # open again: listed
        for i in range(40):
            b.at(NOW - 80 * H + i).send("Orders")
        s["expired"] = b.at(NOW - 72 * H - M).half("pg-a", "Pay")      # 72h01m: listed
        s["exact"] = b.at(NOW - 72 * H).half("pg-a", "Pay")            # exactly 72h: kept
        s["young"] = b.at(NOW - 72 * H + M).half("pg-a", "Pay")        # 71h59m: kept
        for i in range(40):
            b.at(NOW - 71 * H + i).send("Orders")
        for i in range(5):
            b.at(NOW - H + i).send("Orders")
        s["written"] = list(b.written)
    s["dir"] = d
    return s


def set_offsets(store_dir, entries):
    path = os.path.join(store_dir, "config", "consumerOffset.json")
    if os.path.exists(path):
        os.unlink(path)
    offsets = ConsumerOffsets(store_dir)
    for group, topic, qid, offset in entries:
        offsets.commit(group, topic, qid, offset)
    offsets.persist()


def expected_segments(written, blocked_topic_queue_offsets=None):
    """Hand rule: oldest sealed segments while every record is older than the cutoff."""
    segs = sorted({w.offset // SEG for w in written})
    out = []
    for s in segs[:-1]:
        recs = [w for w in written if w.offset // SEG == s]
        if max(w.store_ts for w in recs) >= CUTOFF:
            break
        out.append({"name": f"{s * SEG:020d}", "start_offset": s * SEG,
                    "end_offset": max(w.offset + w.size for w in recs),
                    "first_store_timestamp": min(w.store_ts for w in recs),
                    "last_store_timestamp": max(w.store_ts for w in recs), "records": len(recs)})
    return out


def test_plan_lists_old_undecided_halves_and_old_segments_with_the_store_id(spark, store, tmp_path):
    from ops.spark.manifest import read_store_id

    from ops.spark.expiry import build_plan, run_expiry

    set_offsets(store["dir"], [("cg1", "Orders", 0, 200), ("cg2", "Orders", 0, 200)])
    path = str(tmp_path / "plan.json")
    written = run_expiry(spark, store["dir"], path, now_ms=NOW)
    plan = validate_plan(path)
    assert written == {**{k: v for k, v in plan.items() if k != "halves"}, "halves_listed": len(plan["halves"])}
    assert (plan["version"], plan["now_ms"], plan["retention_ms"]) == (2, NOW, 72 * H)
    assert plan["store_id"] == read_store_id(store["dir"]) and len(plan["store_id"]) == 36
    r, e = store["resumed"], store["expired"]
    assert plan["halves"] == [
        {"commit_log_offset": r.offset, "queue_offset": r.queue_offset, "producer_group": "pg-b", "topic": "Ship",
         "store_timestamp": NOW - 97 * H, "uniq_key": r.props["UNIQ_KEY"]},
        {"commit_log_offset": e.offset, "queue_offset": e.queue_offset, "producer_group": "pg-a", "topic": "Pay",
         "store_timestamp": NOW - 72 * H - M, "uniq_key": e.props["UNIQ_KEY"]}]
    want = expected_segments(store["written"])
    assert len(want) >= 2 and plan["segments"] == want
    assert plan["report"]["unconsumed"] == []
    going = sum(1 for w in store["written"] if w.topic == "Orders" and w.offset < len(want) * SEG)
    assert {t["topic"]: t["messages"] for t in plan["report"]["messages_by_topic"]}["Orders"] == going
    listed = {s["name"] for s in plan["segments"]}
    for half in ("exact", "young"):
        assert f"{store[half].offset // SEG * SEG:020d}" not in listed
    run_expiry(spark, store["dir"], str(tmp_path / "again.json"), now_ms=NOW)
    again = validate_plan(str(tmp_path / "again.json"))
    assert (again["halves"], again["segments"]) == (plan["halves"], plan["segments"])
    assert build_plan(spark, store["dir"], retention_ms=72 * H, now_ms=NOW)["halves"] == plan["halves"]


def test_the_72_hour_boundary(spark, store, tmp_path):
    from ops.spark.expiry import build_plan

    set_offsets(store["dir"], [])
    offsets = {h["commit_log_offset"] for h in build_plan(spark, store["dir"], retention_ms=72 * H,
                                                           now_ms=NOW)["halves"]}
    assert store["expired"].offset in offsets                     # 72h01m old
    assert store["exact"].offset not in offsets                   # exactly 72h: not strictly older
    assert store["young"].offset not in offsets                   # 71h59m old
    two_min_later = {h["commit_log_offset"] for h in build_plan(spark, store["dir"], retention_ms=72 * H,
                                                                now_ms=NOW + 2 * M)["halves"]}
    assert {store["exact"].offset, store["young"].offset} <= two_min_later


def test_unconsumed_records_go_too_and_the_report_says_whose(spark, store):
    """RocketMQ's retention: consumed or not. An abandoned group holds nothing back; the report names it."""
    from ops.spark.expiry import build_plan

    set_offsets(store["dir"], [("cg1", "Orders", 0, 200), ("slow", "Orders", 0, 5)])
    plan = build_plan(spark, store["dir"], retention_ms=72 * H, now_ms=NOW)
    want = expected_segments(store["written"])
    assert plan["segments"] == want
    going = [w for w in store["written"] if w.topic == "Orders" and w.offset < len(want) * SEG]
    assert plan["report"]["unconsumed"] == [
        {"topic": "Orders", "group": "slow", "messages": sum(1 for w in going if w.queue_offset >= 5)}]


def test_cli_expiry_and_validate_plan(store, tmp_path):
    set_offsets(store["dir"], [("cg1", "Orders", 0, 200)])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    path = str(tmp_path / "plan.json")
    proc = subprocess.run([sys.executable, "-m", "ops.spark", "expiry", "--store-dir", store["dir"], "--out", path,
                           "--now-ms", str(NOW), "--retention-hours", "72", "--master", "local[1]",
                           "--no-progress"], capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "expiry: decoded" in proc.stderr and "expiry: 2 undecided half messages" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["halves"] == 2
    ok = subprocess.run([sys.executable, "-m", "ops.spark", "validate-plan", path], capture_output=True, text=True,
                        env=env, cwd=root)
    assert ok.returncode == 0 and json.loads(ok.stdout)["valid"] is True
    with open(path) as f:
        plan = json.load(f)
    plan["halves"][0]["store_timestamp"] = NOW
    with open(path, "w") as f:
        json.dump(plan, f)
    bad = subprocess.run([sys.executable, "-m", "ops.spark", "validate-plan", path], capture_output=True, text=True,
                         env=env, cwd=root)
    assert bad.returncode == 1 and "not older than the retention" in bad.stderr


def test_the_segment_before_the_brokers_unwritten_spare_is_not_listed(spark, store, tmp_path):
    """On a live store the newest file is often the spare the broker made ahead of the roll
    (broker/store/reserve.py); the segment before it is still being written, however old."""
    import shutil

    from ops.spark.expiry import build_plan

    d = str(tmp_path / "store")
    shutil.copytree(store["dir"], d)
    names = sorted(n for n in os.listdir(os.path.join(d, "commitlog")))
    with open(os.path.join(d, "commitlog", f"{int(names[-1]) + SEG:020d}"), "wb") as f:
        f.truncate(SEG)
    plan = build_plan(spark, d, retention_ms=72 * H, now_ms=NOW + 1000 * H)
    assert [s["name"] for s in plan["segments"]] == names[:-1]


def test_the_report_names_a_user_topic_spelled_like_the_transaction_topics(spark, tmp_path):
    """The report left out every RMQ_SYS_* topic as the broker's bookkeeping, so a client's RMQ_SYS_Orders (a user
    topic: the system prefix is rmq_sys_) went unconsumed without a word. Only the transaction queues are left out."""
    from ops.spark.expiry import build_plan

    d = str(tmp_path / "store")
    with StoreBuilder(d, segment_size=SEG) as b:
        for i in range(40):
            b.at(NOW - 100 * H + i).send("RMQ_SYS_Orders")
        b.at(NOW - 100 * H + 50).half("pg-a", "Pay")
        for i in range(40):
            b.at(NOW - H + i).send("Orders")
        written = list(b.written)
    set_offsets(d, [("cg-sys", "RMQ_SYS_Orders", 0, 0)])
    plan = build_plan(spark, d, retention_ms=72 * H, now_ms=NOW)
    going = [w for w in written if w.topic == "RMQ_SYS_Orders" and w.offset < len(plan["segments"]) * SEG]
    assert going
    assert {t["topic"] for t in plan["report"]["messages_by_topic"]} == {"RMQ_SYS_Orders"}
    assert plan["report"]["unconsumed"] == [{"topic": "RMQ_SYS_Orders", "group": "cg-sys", "messages": len(going)}]


@pytest.mark.parametrize("ahead", [720 * H, 5_000])
def test_a_segment_stamped_ahead_of_the_plan_is_said_at_warning_with_what_it_holds_back(spark, tmp_path, ahead):
    """A record stamped a month ahead (the broker's clock was, for a while) kept its segment and every newer one out
    of each night's plan, said in the INFO line a young segment gets: no segment was ever planned again, unheard.
    Seconds ahead (a segment sealed while the plan was begun, the hosts' clocks a little apart) is only young: a
    WARNING that every plan stops there was false, the segment planned once it is past the retention."""
    import logging

    from ops.spark.expiry import build_plan

    d = str(tmp_path / "store")
    with StoreBuilder(d, segment_size=SEG) as b:
        for i in range(40):
            b.at(NOW - 100 * H + i).send("Orders")
        b.at(NOW + ahead).send("Orders")                       # the clock a month ahead, then put back
        for i in range(80):
            b.at(NOW - 90 * H + i).send("Orders")
        for i in range(40):
            b.at(NOW - H + i).send("Orders")
        written = list(b.written)
    seg = next(w for w in written if w.store_ts == NOW + ahead).offset // SEG
    said = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append((record.levelno, record.getMessage()))

    log = logging.getLogger("ops.spark")
    handler, level = Said(level=logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        plan = build_plan(spark, d, retention_ms=72 * H, now_ms=NOW)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert [int(s["name"]) // SEG for s in plan["segments"]] == list(range(seg))
    kept = [(lv, m) for lv, m in said if m.startswith("expiry: keeping segment ")]     # one line a run
    assert len(kept) == 1 and kept[0][1].startswith(f"expiry: keeping segment {seg * SEG:020d}"), said
    if ahead > 3_600_000:
        assert kept[0][0] == logging.WARNING and f"{ahead} ms ahead of the time planned for" in kept[0][1], said
    else:
        assert kept[0][0] == logging.INFO and "not older than the retention" in kept[0][1], said


_SMALL_DRIVER = """
import json, sys
import ops.spark.expiry as expiry
from ops.spark.session import build_session
expiry.HALVES_A_PARTITION = 500
spark = build_session("local[2]", app_name="txmq-tests", shuffle_partitions=2, progress=False,
                      conf={"spark.driver.maxResultSize": "1m"})
try:
    print(json.dumps(expiry.run_expiry(spark, sys.argv[1], sys.argv[2], now_ms=int(sys.argv[3]))["halves_listed"]))
finally:
    spark.stop()
"""


def test_a_plan_bigger_than_what_the_driver_takes_at_once_is_written_a_partition_at_a_time(tmp_path):
    """The plan's halves were collect()ed on the driver: 1M halves took 850 MB of it, and a plan whose halves
    (compressed) pass spark.driver.maxResultSize (1 GiB by default) stopped the job with nothing written. Here a
    driver that takes at most 1 MiB a job writes 4,000 halves (about 2 MiB of them) in partitions of 500."""
    from protocol.message import Prop
    from protocol.txlog import HALF_TOPIC

    d = str(tmp_path / "store")
    with StoreBuilder(d, segment_size=1 << 20) as b:
        halves = []
        for batch in range(8):
            b.at(NOW - 80 * H + batch)
            halves += b.put_many([(HALF_TOPIC, b"tx", 0, {Prop.TRAN_MSG: "true", Prop.PGROUP: "pg", Prop.UNIQ_KEY:
                                   os.urandom(500).hex(), Prop.REAL_TOPIC: "Pay", Prop.REAL_QID: "0"}, 0, 0)
                                  for _ in range(500)])
        b.at(NOW - H).send("Orders")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = str(tmp_path / "plan.json")
    proc = subprocess.run([sys.executable, "-c", _SMALL_DRIVER, d, path, str(NOW)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=root), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == 4000
    plan = validate_plan(path)
    assert [(h["commit_log_offset"], h["uniq_key"]) for h in plan["halves"]] == [
        (h.offset, h.props["UNIQ_KEY"]) for h in halves]


@pytest.mark.parametrize("n", [0, 500, 501])
def test_no_halves_a_partition_of_them_and_one_over_are_each_written_whole_and_in_order(spark, tmp_path, monkeypatch,
                                                                                      n):
    """The halves written a partition at a time: none (one empty partition), exactly a partition, one over (two)."""
    import ops.spark.expiry as expiry
    from protocol.message import Prop
    from protocol.txlog import HALF_TOPIC

    monkeypatch.setattr(expiry, "HALVES_A_PARTITION", 500)
    d = str(tmp_path / "store")
    with StoreBuilder(d, segment_size=1 << 20) as b:
        b.at(NOW - 80 * H)
        halves = b.put_many([(HALF_TOPIC, b"tx", 0, {Prop.TRAN_MSG: "true", Prop.PGROUP: "pg", Prop.UNIQ_KEY: f"{i:032X}",
                                                     Prop.REAL_TOPIC: "Pay", Prop.REAL_QID: "0"}, 0, 0)
                              for i in range(n)])
        b.at(NOW - H).send("Orders")
    path = str(tmp_path / "plan.json")
    assert expiry.run_expiry(spark, d, path, now_ms=NOW)["halves_listed"] == n
    assert [h["commit_log_offset"] for h in validate_plan(path)["halves"]] == [h.offset for h in halves]
    with open(path) as f:
        assert json.load(f)["halves"] == validate_plan(path)["halves"]
