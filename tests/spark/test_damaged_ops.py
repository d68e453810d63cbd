"""Op records with damaged properties (zeroed or flipped at rest) in the expiry plan: the Spark side reads them as
the broker's recovery does (broker/transaction/salvage.py): the body (the half's queue offset, under the body CRC)
names the half, a whole TXMQ_OP agreeing with it is that decision, and an op that cannot be read leaves its half
unsettled, never listed for expiry."""
from __future__ import annotations

import os
import shutil

import pytest

from protocol.message import Prop
from tests.spark.storegen import StoreBuilder

pytestmark = pytest.mark.spark

H = 3_600_000
NOW = 1710028800000 + 100 * H
RETENTION = 72 * H


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("damaged_ops") / "store"))


def build(d: str) -> dict:
    """The store, written by the broker's own store writer; {name: its half (Stored)} and "dir"."""
    s = {}
    with StoreBuilder(d, segment_size=1 << 20) as b:
        b.at(NOW - 90 * H)
        for name in ("committed", "open", "garbled", "tags_flipped", "check_flipped", "rocketmq", "zeroed"):
            s[name] = b.half("pg-a", "Pay")
        b.at(NOW - 89 * H)
        real, op = b.commit_specs(s["committed"])
        op[3]["TXMQ_HALF"] = str(s["open"].offset)         # a digit flipped: names the open half
        b.put_many([real, op])
        op = b.op_spec(s["garbled"], "ROLLBACK")
        op[3].pop(Prop.TAGS)
        op[3]["TXMQ_OP"] = "ROLLBXCK"                      # no word of ours: the Spark side cannot tell
        b.put_many([op])
        op = b.op_spec(s["tags_flipped"], "ROLLBACK")
        op[3][Prop.TAGS] = "e"                             # its decision word and TXMQ_HALF whole: a ROLLBACK
        b.put_many([op])
        check = b.check_specs(s["check_flipped"], 1)[0]
        check[3][Prop.TAGS] = "b"                          # a check attempt all the same: nothing decided
        b.put_many([check])
        op = b.op_spec(s["zeroed"], "COMMIT")              # its properties zeroed: no TAGS, no TXMQ_*
        b.put_many([op[:3] + ({"\x00" * 40: "\x00" * 40},) + op[4:]])
        s["other_group"] = b.half("pg-b", "Ship")
        letter, op = b.dead_specs(s["other_group"], "max-checks")
        letter[3]["TXMQ_HALF"] = str(s["open"].offset)     # a digit flipped: files it under pg-a's open half
        b.put_many([letter, op])
        # RocketMQ's own op record (a slave of a RocketMQ master): no TXMQ_* property, left out as before
        b.put_many([("RMQ_SYS_TRANS_OP_HALF_TOPIC", str(s["rocketmq"].queue_offset).encode(), 0,
                     {Prop.TAGS: "d", Prop.WAIT: "false"}, 0, 0)])
        b.at(NOW - H).send("Orders")
    s["dir"] = d
    return s


def _two_days_of_orders(b: StoreBuilder):
    """Hour by hour from 2024-03-09 00:00 for 48 hours, three 150-byte sends to Orders (so that 4 KiB segments
    roll within a day); yields (hour, its start) after each hour's sends, for the test to store its own records."""
    d1 = NOW - 124 * H                                      # 2024-03-09 00:00
    for hour in range(48):
        now = d1 + hour * H
        for i in range(3):
            b.at(now + i).send("Orders", b"o" * 150, queue_id=i)
        yield hour, now


def _day_rows(spark, out: str, date: str) -> list:
    """The rollup's transactions rows of `date` (without the date column), sorted."""
    df = spark.read.parquet(os.path.join(out, "transactions")).where(f"date = '{date}'").drop("date")
    return sorted((tuple(sorted(r.asDict().items())) for r in df.collect()), key=repr)


def _rerun_one_day(spark, store: str, out: str, date: str) -> dict:
    """Removes `date`'s transactions partition and rolls that day up again (`rollup --date`), checking the run
    was incremental, reading fewer segments than the store holds; returns the run's summary."""
    from ops.spark.rollup import run_rollup
    shutil.rmtree(os.path.join(out, "transactions", f"date={date}"))
    one = run_rollup(spark, store, out, date=date)
    assert one["incremental"] and one["segments_read"] < one["segments"], one
    return one


@pytest.fixture(scope="module")
def plan(spark, store):
    from ops.spark.expiry import build_plan

    return build_plan(spark, store["dir"], retention_ms=RETENTION, now_ms=NOW)


def test_the_body_names_the_half_a_decision_op_decided(plan, store):
    listed = {h["commit_log_offset"] for h in plan["halves"]}
    assert store["committed"].offset not in listed          # committed: its op's TXMQ_HALF lied
    assert store["open"].offset in listed                   # undecided: no op of its own
    assert plan["report"]["damaged_ops"]["misnamed"] == 1


def test_an_op_that_cannot_be_read_holds_its_half_back_and_is_reported(plan, store):
    listed = {h["commit_log_offset"] for h in plan["halves"]}
    assert store["garbled"].offset not in listed
    assert store["zeroed"].offset not in listed
    assert plan["report"]["damaged_ops"]["unsettled_halves"] == [store["garbled"].offset, store["zeroed"].offset]
    assert plan["report"]["damaged_ops"]["unreadable"] == 4     # garbled, tags_flipped, check_flipped, zeroed
    assert plan["report"]["damaged_ops"]["unplaced"] == 0


def test_halves_held_back_are_counted_and_only_the_first_named(spark, store, monkeypatch, caplog):
    """Every half an unreadable op may have decided was collected on the driver and named in the plan's report: a
    damaged run of op records (one a half) put them all there, without bound. The report names the first
    UNSETTLED_LISTED and counts them all; the ERROR line says the count."""
    import logging

    from ops.spark import expiry

    monkeypatch.setattr(expiry, "UNSETTLED_LISTED", 1)
    with caplog.at_level(logging.ERROR, logger="ops.spark"):
        got = expiry.build_plan(spark, store["dir"], retention_ms=RETENTION, now_ms=NOW)
    assert got["report"]["damaged_ops"]["unsettled_halves"] == [store["garbled"].offset]
    assert got["report"]["damaged_ops"]["unsettled"] == 2
    listed = {h["commit_log_offset"] for h in got["halves"]}
    assert store["open"].offset in listed                   # (the plan made, and the unnamed held back all the same:)
    assert not listed & {store["garbled"].offset, store["zeroed"].offset}
    assert any("expiry: 2 half message(s) older than the retention are not listed" in r.getMessage()
               and "the report names the first 1" in r.getMessage() for r in caplog.records)


def test_whole_words_are_read_as_the_broker_reads_them(plan, store):
    listed = {h["commit_log_offset"] for h in plan["halves"]}
    assert store["tags_flipped"].offset not in listed       # its own TXMQ_OP: ROLLBACK
    assert store["check_flipped"].offset in listed          # a check decides nothing
    assert store["rocketmq"].offset in listed               # RocketMQ's op: not txmq's decision


def test_the_plan_agrees_with_the_brokers_recovery_before_and_after_it(spark, tmp_path):
    """The broker started on the same store: its undecided transactions are what the plan lists (the unsettled
    one it dead-letters, `op-unreadable`); on the store it leaves behind, nothing is unsettled any more."""
    import json
    import subprocess
    import sys

    from ops.spark.expiry import build_plan
    from tests.support.broker_process import BrokerProcess

    s = build(str(tmp_path / "store"))
    before = build_plan(spark, s["dir"], retention_ms=RETENTION, now_ms=NOW)
    with BrokerProcess(s["dir"]) as b:      # stopped cleanly on the way out
        out = subprocess.run([sys.executable, "-m", "broker", "admin", "--broker", b.broker, "list", "--json"],
                             capture_output=True, text=True, timeout=60, check=True)
    undecided = {row["commit_log_offset"] for row in json.loads(out.stdout)["pending"]}
    assert {h["commit_log_offset"] for h in before["halves"]} == undecided
    assert before["report"]["damaged_ops"]["unsettled_halves"] == [s["garbled"].offset, s["zeroed"].offset]
    assert s["garbled"].offset not in undecided and s["zeroed"].offset not in undecided

    after = build_plan(spark, s["dir"], retention_ms=RETENTION, now_ms=NOW)
    assert {h["commit_log_offset"] for h in after["halves"]} == undecided
    assert after["report"]["damaged_ops"]["unsettled_halves"] == []


def test_the_rollup_counts_decisions_as_the_broker_reads_them_and_reports_the_damage(spark, store, tmp_path):
    import os

    from ops.spark.rollup import run_rollup

    out = str(tmp_path / "out")
    summary = run_rollup(spark, store["dir"], out, date="2024-03-10")
    assert summary["damaged_ops"] == {"misnamed": 1, "unreadable": 4, "unplaced": 0, "unsettled": 2}
    day = [r for r in spark.read.parquet(os.path.join(out, "transactions")).collect()
           if r["producer_group"] == "pg-a" and r["grain"] == "day"]
    assert len(day) == 1
    assert (day[0]["halves"], day[0]["commits"], day[0]["rollbacks"], day[0]["checks"]) == (7, 1, 1, 0)
    # open, check_flipped, rocketmq (as the broker), and garbled, zeroed until the broker's next start settles them
    assert day[0]["undecided_at_end"] == 5
    assert day[0]["dead_letters"] == 0
    pgb = [r for r in spark.read.parquet(os.path.join(out, "transactions")).collect()
           if r["producer_group"] == "pg-b" and r["grain"] == "day"]
    assert (pgb[0]["halves"], pgb[0]["dead_letters"], pgb[0]["undecided_at_end"]) == (1, 1, 0)
    with open(summary["reports"][0], encoding="utf-8") as f:
        html = f.read()
    assert "Damaged op records: 1 named another half" in html


def test_an_op_body_that_fails_its_crc_names_no_half_and_its_txmq_half_stands(spark, tmp_path):
    """The body is under the CRC only when the CRC is checked: the jobs read no body's bytes otherwise. A digit
    flipped in an op's body must not take the decision away from its half and give it to another (the broker's
    recovery empties a body that fails its CRC and goes by TXMQ_HALF)."""
    from ops.spark.expiry import build_plan

    d = str(tmp_path / "store")
    with StoreBuilder(d, segment_size=1 << 20) as b:
        b.at(NOW - 90 * H)
        halves = [b.half("pg-a", "Pay") for _ in range(8)]
        committed, other = halves[3], halves[7]
        b.at(NOW - 89 * H)
        op = b.commit(committed)[1]
        b.at(NOW - H).send("Orders")
    path = f"{d}/commitlog/{0:020d}"
    with open(path, "r+b") as f:
        f.seek(op.offset)
        rec = f.read(op.size)
        at = rec.index(b"\x00\x00\x00\x01" + str(committed.queue_offset).encode()) + 4
        f.seek(op.offset + at)
        f.write(str(other.queue_offset).encode())          # the body now names the other half; its CRC does not
    plan = build_plan(spark, d, retention_ms=RETENTION, now_ms=NOW)
    listed = {h["commit_log_offset"] for h in plan["halves"]}
    assert committed.offset not in listed
    assert other.offset in listed
    assert plan["report"]["damaged_ops"]["misnamed"] == 0


def test_a_decision_op_with_a_flipped_tags_across_midnight_counts_in_a_one_day_run_as_in_the_whole_store(
        spark, tmp_path):
    """`rollup --date D` reads one record for each half decided on D but stored in a segment it does not read: a
    decision op whose TAGS was flipped (its TXMQ_OP and TXMQ_HALF whole) is that decision in a whole-store run, and
    must be in the one-day run too (its half read, so its TXMQ_HALF can be seen to agree with its body)."""
    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    with StoreBuilder(store, segment_size=4096) as b:
        for hour, now in _two_days_of_orders(b):
            if hour == 18:
                late = b.at(now + 10).half("pg-a", "Pay")
            if hour == 25:
                op = b.op_spec(late, "ROLLBACK")
                op[3][Prop.TAGS] = "e"
                b.at(now + 10).put_many([op])

    whole = run_rollup(spark, store, out)
    expected = _day_rows(spark, out, "2024-03-10")
    assert [r for r in spark.read.parquet(os.path.join(out, "transactions")).where("date = '2024-03-10'").collect()
            if r["grain"] == "day" and r["producer_group"] == "pg-a"][0]["rollbacks"] == 1
    assert whole["damaged_ops"]["unsettled"] == 0
    one = _rerun_one_day(spark, store, out, "2024-03-10")
    assert _day_rows(spark, out, "2024-03-10") == expected
    assert one["damaged_ops"]["unsettled"] == 0


def test_a_misnamed_decision_across_midnight_goes_to_its_bodys_half_in_a_one_day_run_as_in_the_whole_store(
        spark, tmp_path):
    """A COMMIT whose TXMQ_HALF names another half (pg-b's) than its body does (pg-a's), both halves stored in
    segments a one-day run does not read: the run finds the body's half through the half queue (its consume
    queue), as the broker does, and counts the decision for pg-a with its latency, as the whole-store run does."""
    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    with StoreBuilder(store, segment_size=4096) as b:
        for hour, now in _two_days_of_orders(b):
            if hour == 10:
                named = b.at(now + 10).half("pg-b", "Pay")
            if hour == 18:
                half = b.at(now + 10).half("pg-a", "Pay")
            if hour == 25:
                real, op = b.commit_specs(half)
                op[3]["TXMQ_HALF"] = str(named.offset)
                b.at(now + 10).put_many([real, op])

    run_rollup(spark, store, out)
    expected = _day_rows(spark, out, "2024-03-10")
    pga = [dict(r) for r in expected if ("grain", "day") in r and ("producer_group", "pg-a") in r]
    assert pga[0]["commits"] == 1 and pga[0]["latency_max_ms"] == 7 * H
    _rerun_one_day(spark, store, out, "2024-03-10")
    assert _day_rows(spark, out, "2024-03-10") == expected


def test_a_sender_record_naming_another_half_is_reported_as_the_broker_counts_it(spark, tmp_path):
    """A sender record (check-tagged, TXMQ_CHECKS=0) is under no CRC either: a digit flipped in its TXMQ_HALF makes
    the broker's recovery take its body's half, count the record corrupt and log it (salvage.misnamed), as for any
    check record. The jobs left sender records out of the body check, so the damaged-ops report said nothing of
    it; nor is it a check of either half."""
    from ops.spark.expiry import build_plan

    d = str(tmp_path / "store")
    with StoreBuilder(d, segment_size=1 << 20) as b:
        b.at(NOW - 90 * H)
        named, other = b.half("pg-a", "Pay"), b.half("pg-a", "Pay")
        spec = b.sender_specs(named, "10.0.0.7@4242")[0]
        spec[3]["TXMQ_HALF"] = str(other.offset)           # a digit flipped: names the other half
        b.put_many([spec])
        b.at(NOW - H).send("Orders")
    plan = build_plan(spark, d, retention_ms=RETENTION, now_ms=NOW)
    assert {h["commit_log_offset"] for h in plan["halves"]} == {named.offset, other.offset}
    assert plan["report"]["damaged_ops"]["misnamed"] == 1
    assert plan["report"]["damaged_ops"]["unreadable"] == 0


def test_a_misnamed_sender_record_across_midnight_is_reported_by_a_one_day_run_as_by_the_whole_store(
        spark, tmp_path):
    """A sender record (TXMQ_CHECKS=0) of a half stored the day before, its TXMQ_HALF naming another half: a
    one-day run reads only the day's segments, and fetched the halves that op and check bodies name, not those
    sender records name, so it could not see the record was misnamed, while the whole-store run (and the broker)
    did."""
    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    with StoreBuilder(store, segment_size=4096) as b:
        for hour, now in _two_days_of_orders(b):
            if hour == 10:
                other = b.at(now + 10).half("pg-b", "Pay")
            if hour == 18:
                half = b.at(now + 10).half("pg-a", "Pay")
            if hour == 25:
                spec = b.sender_specs(half, "10.0.0.7@4242")[0]
                spec[3]["TXMQ_HALF"] = str(other.offset)
                b.at(now + 10).put_many([spec])

    whole = run_rollup(spark, store, out)
    assert whole["damaged_ops"]["misnamed"] == 1
    one = _rerun_one_day(spark, store, out, "2024-03-10")
    assert one["damaged_ops"]["misnamed"] == 1
