"""Rollups over weeks of history: a re-run never replaces rows it cannot compute again.

* Retention removes segments (72 h) and the broker removes metric snapshot files (7 days), so a
  store holds a few whole days, one day cut at its start, and maybe snapshot files of days whose
  records are gone. A whole-store rollup (no --date: a backfill) must leave the rows the nightly
  runs wrote for those days as they are, not replace them with what is left of the day.
* Brokers rolled up one at a time into one --out (each broker host runs its own nightly job):
  each run replaces its own broker's rows of the date, never another broker's.

Store (UTC, D1..D3 = 2024-03-09..11, 4 KiB segments): every hour 3 x Orders; every sixth hour a
pg-a half committed 10 ms later; D2 20:00 a pg-a half never decided. Snapshot files for D0..D3.
"""
from __future__ import annotations

import csv
import json
import os

import pytest

from tests.spark.storegen import StoreBuilder

pytestmark = pytest.mark.spark

H = 3_600_000
D0, D1, D2, D3 = 1709856000000, 1709942400000, 1710028800000, 1710115200000
DATES = ("2024-03-09", "2024-03-10", "2024-03-11")
TABLES = ("traffic", "transactions", "consumer_lag", "broker")


def build(d: str) -> None:
    with StoreBuilder(d, segment_size=4096) as b:
        for hour in range(72):
            now = D1 + hour * H
            for i in range(3):
                b.at(now + i).send("Orders", b"o" * 150, queue_id=i)
            if hour % 6 == 0:
                b.at(now + 20).commit(b.at(now + 10).half("pg-a", "Pay"))
            if now == D2 + 20 * H:
                b.at(now + 30).half("pg-a", "Pay")
    os.makedirs(os.path.join(d, "metrics"), exist_ok=True)
    for day, start in zip(("2024-03-08",) + DATES, (D0, D1, D2, D3)):
        with open(os.path.join(d, "metrics", f"{day}.jsonl"), "w") as f:
            for k in range(3):
                f.write(json.dumps({"ts": start + k * 8 * H, "connections": 2 + k, "consumer_lag": [
                    {"group": "cg1", "topic": "Orders", "queue_id": 0, "lag": 10 * k}]}) + "\n")


def remove_older_than(store: str, cutoff: int) -> None:
    """What retention does: remove the oldest sealed segments whose newest record is older than cutoff."""
    with StoreBuilder(store, segment_size=4096) as b:
        loop, st = b.log.loop, b.log.store
        while True:
            oldest = loop.run_until_complete(st.segment_facts())[0]
            if oldest.last_ts >= cutoff:
                break
            loop.run_until_complete(st.remove_segment(oldest.name, "plan"))


def rows(spark, out, name, date, broker=None):
    # Schemas merged: a table's history may begin with partitions written before the broker column.
    df = spark.read.option("mergeSchema", "true").parquet(os.path.join(out, name)).where(f"date = '{date}'").drop("date")
    if broker is not None:
        df = df.where(df.broker == broker)
    return sorted((tuple(sorted(r.asDict().items())) for r in df.collect()), key=repr)


def test_a_whole_store_rerun_keeps_the_rows_of_days_retention_cut(spark, tmp_path):
    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    build(store)
    for d in DATES:                                   # the nightly runs, while the store was whole
        run_rollup(spark, store, out, date=d)
    nightly = {(t, d): rows(spark, out, t, d) for t in TABLES for d in DATES}
    assert nightly[("traffic", DATES[0])] and nightly[("traffic", DATES[1])]

    remove_older_than(store, D2 + 6 * H)              # D1 is gone, D2 lost its first hours
    summary = run_rollup(spark, store, out)           # a backfill: every date the store has
    for t in TABLES:
        for d in DATES:
            assert rows(spark, out, t, d) == nightly[(t, d)], (t, d)
    left = {(x["date"], x["table"]) for x in summary["left_as_is"]}
    assert {(d, t) for d in DATES[:2] for t in ("traffic", "transactions")} <= left
    assert summary["dates"][-1] == DATES[2]


def test_brokers_rolled_up_one_at_a_time_into_one_out_keep_each_others_rows(spark, tmp_path):
    from ops.spark.rollup import run_rollup

    out = str(tmp_path / "out")
    stores = [str(tmp_path / name) for name in ("broker-a", "broker-b")]
    for s in stores:
        build(s)
    for d in DATES:                    # each broker host runs its own nightly job
        for s in stores:
            summary = run_rollup(spark, s, out, date=d)
            assert summary["incremental"] == (d != DATES[0]), (s, d, summary)
    for t in TABLES:
        for d in DATES:
            a, b = rows(spark, out, t, d, "broker-a"), rows(spark, out, t, d, "broker-b")
            strip = lambda rs: [tuple(kv for kv in r if kv[0] not in ("broker", "store_id")) for r in rs]  # noqa: E731
            assert a and strip(a) == strip(b), (t, d)       # the same content (another store id): the same rows
    with open(summary["reports"][1]) as f:                  # the last run's report: both brokers
        day = {r["broker"]: r for r in csv.DictReader(f) if r["window"] == "day"}
    assert set(day) == {"*", "broker-a", "broker-b"}
    assert int(day["*"]["messages"]) == 2 * int(day["broker-a"]["messages"]) > 0


def test_a_store_wiped_and_started_anew_does_not_inherit_the_old_stores_undecided_count(spark, tmp_path):
    """The broker's store is wiped (a fresh start, a new disk) and --out kept: the next nightly run
    found the previous day's row of the same broker name and carried its undecided count, from a
    store that no longer exists, into every night after."""
    import shutil

    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    with StoreBuilder(store, segment_size=4096) as b:
        b.at(D1 + H).half("pg-a", "Pay")                  # never decided
        b.at(D1 + 2 * H).send("Orders")
    run_rollup(spark, store, out, date=DATES[0])
    assert [dict(r)["undecided_at_end"] for r in rows(spark, out, "transactions", DATES[0])
            if dict(r)["grain"] == "day" and dict(r)["producer_group"] == "*"] == [1]
    shutil.rmtree(store)
    with StoreBuilder(store, segment_size=4096) as b:   # the new store, from D2 10:00
        b.at(D2 + 10 * H).commit(b.at(D2 + 10 * H).half("pg-a", "Pay"))
    summary = run_rollup(spark, store, out, date=DATES[1])
    day = {dict(r)["producer_group"]: dict(r) for r in rows(spark, out, "transactions", DATES[1])
           if dict(r)["grain"] == "day"}
    assert day["*"]["undecided_at_end"] == 0 and day["pg-a"]["commits"] == 1, day
    assert not summary["incremental"]


def test_a_whole_store_rerun_keeps_the_reports_of_days_retention_cut(spark, tmp_path):
    """The backfill leaves D1's and D2's traffic and transaction rows as they are, but it rewrites
    their reports too (their snapshot rows are still whole): the report must show the rows the
    tables hold, not only those the run wrote (it showed 0 messages for the days retention cut)."""
    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    build(store)
    for d in DATES:
        run_rollup(spark, store, out, date=d)

    def report(d):
        with open(os.path.join(out, "report", f"txmq-{d}.csv")) as f:
            return list(csv.DictReader(f))

    nightly = {d: report(d) for d in DATES}
    assert all(int(r["messages"]) > 0 for d in DATES for r in nightly[d] if r["window"] == "day")
    remove_older_than(store, D2 + 6 * H)
    summary = run_rollup(spark, store, out)
    assert {os.path.join(out, "report", f"txmq-{d}.csv") for d in DATES} <= set(summary["reports"])
    for d in DATES:
        assert report(d) == nightly[d], d


def test_two_brokers_rolled_up_at_once_into_one_out_keep_both(spark, tmp_path, monkeypatch):
    """Each broker host's nightly job starts at the same minute. A run reads the other brokers' rows
    of the date, then writes them back with its own: two runs that both read before either wrote
    each wrote back the other's old rows (none, the first night), and one broker's night was lost."""
    import threading

    from ops.spark import rollup

    out = str(tmp_path / "out")
    stores = [str(tmp_path / name) for name in ("broker-a", "broker-b")]
    for s in stores:
        build(s)
    both_read = threading.Barrier(2, timeout=15)
    real = rollup._kept_rows

    def kept_rows(*a, **k):
        got = real(*a, **k)
        try:
            both_read.wait()            # the two runs read before either writes, when they can
        except threading.BrokenBarrierError:
            pass
        return got

    monkeypatch.setattr(rollup, "_kept_rows", kept_rows)
    errors = []

    def run(s):
        try:
            rollup.run_rollup(spark, s, out, date=DATES[0])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for t in TABLES:
        assert rows(spark, out, t, DATES[0], "broker-a") and rows(spark, out, t, DATES[0], "broker-b"), t


def test_history_written_before_the_broker_column_hides_no_brokers_rows(spark, tmp_path):
    """Months of history begin with partitions written before the broker column. Read whole, a table
    took its schema from one of their files and had no broker column: a broker's run dropped the
    other brokers' rows of its date, and the next night's undecided count summed every broker's."""
    from pyspark.sql import functions as F

    from ops.spark.rollup import run_rollup

    stores = [str(tmp_path / name) for name in ("broker-a", "broker-b")]
    for s in stores:
        build(s)
    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    run_rollup(spark, stores, ref)
    for t in TABLES:                     # a March 1st rolled up by a version without the broker column
        old = spark.read.parquet(os.path.join(ref, t)).where(f"date = '{DATES[0]}' AND broker = 'broker-a'")
        (old.drop("broker").withColumn("date", F.lit("2024-03-01"))
         .write.mode("append").partitionBy("date").parquet(os.path.join(out, t)))
    for d in DATES[:2]:                  # each broker's nightly run
        for s in stores:
            run_rollup(spark, s, out, date=d)
    for t in TABLES:
        for d in DATES[:2]:
            for b in ("broker-a", "broker-b"):
                assert rows(spark, out, t, d, b) == rows(spark, ref, t, d, b) != [], (t, d, b)


def test_a_wiped_store_rolled_up_with_others_leaves_its_older_days_as_they_are(spark, tmp_path):
    """Two brokers rolled up together; broker-b's store is then wiped and begins anew on D3. A
    whole-store run over both covers D1..D3 (broker-a's days): broker-b's new store holds nothing
    before D3, so its D1 and D2 rows, made from the old store, must stay, not become '*' rows at 0."""
    import shutil

    from ops.spark.rollup import run_rollup

    stores = [str(tmp_path / name) for name in ("broker-a", "broker-b")]
    for s in stores:
        build(s)
    out = str(tmp_path / "out")
    run_rollup(spark, stores, out)
    before = {(t, d): rows(spark, out, t, d, "broker-b") for t in TABLES for d in DATES[:2]}
    shutil.rmtree(stores[1])
    with StoreBuilder(stores[1], segment_size=4096) as b:   # the new store, from D3 10:00
        b.at(D3 + 10 * H).commit(b.at(D3 + 10 * H).half("pg-a", "Pay"))
    summary = run_rollup(spark, stores, out)
    for (t, d), want in before.items():
        assert rows(spark, out, t, d, "broker-b") == want != [], (t, d)
    assert {(x["broker"], x["date"]) for x in summary["left_as_is"]} >= {("broker-b", d) for d in DATES[:2]}
