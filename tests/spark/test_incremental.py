"""`rollup --date D` reads only the segments that can hold D (the broker's manifest), and its tables
equal those of a rollup of the whole store; a file no task can read is one line naming path and host.

Store (UTC, D1..D3 = 2024-03-09..11, 4 KiB segments so each day spans several):
  every hour of the three days: 3 x Orders
  D1 23:00  half pg-a "evening"      -> COMMIT at D2 01:00 (crosses midnight: latency 2 h)
  D1 12:00  half pg-b "long"         -> ROLLBACK at D3 02:00
  D2 10:00  half pg-a "open"         -> never decided
  D2 12:00  half pg-a "dead"         -> DEAD (max-checks) D2 13:00, RESUME D3 09:00, COMMIT D3 10:00
"""
from __future__ import annotations

import os
import shutil

import pytest

from protocol.errors import StoreError
from tests.spark.storegen import StoreBuilder

pytestmark = pytest.mark.spark

H = 3_600_000
D1, D2, D3 = 1709942400000, 1710028800000, 1710115200000
DATES = ("2024-03-09", "2024-03-10", "2024-03-11")


def build(d: str) -> dict:
    with StoreBuilder(d, segment_size=4096) as b:
        late = {}
        for hour in range(72):
            now = D1 + hour * H
            for i in range(3):
                b.at(now + i).send("Orders", b"o" * 150, queue_id=i)
            if now == D1 + 12 * H:
                late["long"] = b.at(now + 10).half("pg-b", "Ship")
            if now == D1 + 23 * H:
                late["evening"] = b.at(now + 10).half("pg-a", "Pay")
            if now == D2 + H:
                b.at(now + 10).commit(late["evening"])
            if now == D2 + 10 * H:
                b.at(now + 10).half("pg-a", "Pay")
            if now == D2 + 12 * H:
                late["dead"] = b.at(now + 10).half("pg-a", "Pay")
            if now == D2 + 13 * H:
                b.at(now + 10).dead(late["dead"], "max-checks")
            if now == D3 + 2 * H:
                b.at(now + 10).rollback(late["long"])
            if now == D3 + 9 * H:
                b.at(now + 10).resume(late["dead"])
            if now == D3 + 10 * H:
                b.at(now + 10).commit(late["dead"])
    return late


def table(spark, out, name, date):
    df = spark.read.parquet(os.path.join(out, name)).where(f"date = '{date}'").drop("date")
    return sorted((tuple(sorted(r.asDict().items())) for r in df.collect()), key=repr)


def test_one_day_reads_its_segments_only_and_matches_the_whole_store(spark, tmp_path):
    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    build(store)
    whole = run_rollup(spark, store, out)
    assert whole["dates"] == list(DATES) and not whole["incremental"]
    expected = {(t, d): table(spark, out, t, d) for t in ("traffic", "transactions") for d in DATES[1:]}
    assert any(r for r in expected[("transactions", "2024-03-10")])
    for d in DATES[1:]:
        shutil.rmtree(os.path.join(out, "traffic", f"date={d}"))     # prove the rows are rewritten
        one = run_rollup(spark, store, out, date=d)
        assert one["incremental"], one
        assert one["segments_read"] < one["segments"] and one["bytes_read"] < 0.6 * whole["bytes_read"], one
        for t in ("traffic", "transactions"):
            assert table(spark, out, t, d) == expected[(t, d)], (t, d)


def test_without_the_previous_day_the_whole_store_is_read(spark, tmp_path):
    from ops.spark.rollup import run_rollup

    store = str(tmp_path / "store")
    build(store)
    first = run_rollup(spark, store, str(tmp_path / "fresh"), date="2024-03-10")
    assert not first["incremental"] and first["segments_read"] == first["segments"]


def test_a_segment_no_task_can_read_is_one_line_naming_path_and_host(spark, tmp_path):
    from ops.spark.rollup import run_rollup
    from ops.spark import segments as seg

    store = str(tmp_path / "store")
    build(store)
    victim = seg.list_segments(store)[2].path
    os.unlink(victim)
    os.mkdir(victim)               # listed by the driver, unreadable where the task opens it
    with pytest.raises(StoreError) as err:
        run_rollup(spark, store, str(tmp_path / "out"), date="2024-03-10")
    text = str(err.value)
    assert "\n" not in text and f"cannot read {victim} on host " in text and "Is a directory" in text


def test_a_half_whose_segment_retention_removed_leaves_the_undecided_count_when_dead_lettered(spark, tmp_path):
    """The nightly order: D1 is rolled up while the half is undecided; on D2 the expiry dead-letters it
    and removes its segment. D2's incremental rollup must count the dead letter, as the broker has no
    undecided transaction left."""
    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    with StoreBuilder(store, segment_size=4096) as b:
        half = b.at(D1 + H).half("pg-x", "Pay")
        for hour in range(26):
            for i in range(3):
                b.at(D1 + hour * H + i + 20).send("Orders", b"o" * 150, queue_id=i)
    run_rollup(spark, store, out, date="2024-03-09")
    day = [r for r in table(spark, out, "transactions", "2024-03-09")
           if dict(r)["grain"] == "day" and dict(r)["producer_group"] == "pg-x"]
    assert [dict(r)["undecided_at_end"] for r in day] == [1]

    with StoreBuilder(store, segment_size=4096) as b:       # the broker's expiry on D2 at 01:15
        b.at(D2 + H + 15 * 60_000).dead(half, "expired")
        store_ = b.log.store
        while store_.min_physical_offset <= half.offset:
            oldest = b.log.loop.run_until_complete(store_.segment_facts())[0]
            b.log.loop.run_until_complete(store_.remove_segment(oldest.name, "plan"))
        for i in range(3):
            b.at(D2 + 2 * H + i).send("Orders", b"o" * 150, queue_id=i)
    one = run_rollup(spark, store, out, date="2024-03-10")
    assert one["incremental"], one
    rows = {dict(r)["producer_group"]: dict(r) for r in table(spark, out, "transactions", "2024-03-10")
            if dict(r)["grain"] == "day"}
    assert rows["pg-x"]["dead_letters"] == 1 and rows["pg-x"]["dead_letters_expired"] == 1
    assert (rows["pg-x"]["undecided_at_end"], rows["*"]["undecided_at_end"]) == (0, 0)


def test_a_damaged_half_read_for_a_decision_of_the_day_fails_clearly_or_is_reported(spark, tmp_path):
    """The one record an incremental run reads outside the day's segments is checked like the rest:
    a damaged one is an error, or a reported skip, never a decision silently left out."""
    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    long = build(store)["long"]                        # stored D1 12:00, rolled back D3 02:00
    run_rollup(spark, store, out)
    path = os.path.join(store, "commitlog", f"{long.offset // 4096 * 4096:020d}")
    with open(path, "r+b") as f:                       # TOPICLENGTH now runs past the record
        f.seek(long.offset % 4096 + 88 + len(long.body))
        f.write(b"\x7f")
    with pytest.raises(StoreError) as err:
        run_rollup(spark, store, out, date="2024-03-11")
    assert f"{path} at byte {long.offset % 4096}" in str(err.value)
    summary = run_rollup(spark, store, out, date="2024-03-11", skip_damaged=True)
    assert summary["incremental"] and [(d["file"], d["position"]) for d in summary["damage"]] == [
        (path, long.offset % 4096)]


def test_a_previous_day_rewritten_while_a_run_reads_the_store_is_counted_on_from_its_new_rows(spark, tmp_path,
                                                                                             monkeypatch):
    """An incremental run read D-1's undecided count before it took --out's lock. Another run that rewrote
    D-1 meanwhile (here: D-1's old rows were wrong, as after a run of D-1 before the day was over) left D's
    count resting on the old rows, and every later night's built on D's: wrong for good, nothing said.
    Two runs, one inside the other: D3's starts and reads the stale D2, then a run of D2 publishes the
    right rows, then D3's goes on."""
    import ops.spark.rollup as rollup_mod

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    build(store)
    rollup_mod.run_rollup(spark, store, out)
    want = table(spark, out, "transactions", DATES[2])
    stale = spark.read.parquet(os.path.join(out, "transactions")).where(f"date = '{DATES[1]}'").drop("date")
    part = os.path.join(out, "transactions", f"date={DATES[1]}")
    (stale.withColumn("undecided_at_end", stale["undecided_at_end"] + 5).write.parquet(part + ".stale"))
    shutil.rmtree(part)
    os.rename(part + ".stale", part)

    real, nested = rollup_mod.previous_undecided, []

    def read_then_overlap(spark_, out_dir, date, broker=None):
        rows = real(spark_, out_dir, date, broker)
        if date == DATES[2] and not nested:
            nested.append(rollup_mod.run_rollup(spark, store, out, date=DATES[1]))     # the overlapping run
        return rows
    monkeypatch.setattr(rollup_mod, "previous_undecided", read_then_overlap)
    third = rollup_mod.run_rollup(spark, store, out, date=DATES[2])
    assert third["incremental"] and nested[0]["incremental"]
    assert table(spark, out, "transactions", DATES[2]) == want


def test_the_previous_day_of_another_store_under_the_same_name_is_not_counted_on(spark, tmp_path, caplog):
    """D1 is rolled up from one store; by D2 the directory holds another (a store restored from another broker's
    backup, a mixed-up mount), whose log neither starts at offset 0 nor begins on D2. D2's run counted on from the
    first store's undecided count: a transaction of the old store undecided for good in every later day's rows,
    nothing said. The rows carry their store's id (<store>/store_id); another store's day is not counted on."""
    from ops.spark.rollup import run_rollup

    out, store = str(tmp_path / "out"), str(tmp_path / "a" / "store")
    other = str(tmp_path / "b" / "store")
    with StoreBuilder(store, segment_size=4096) as b:
        b.at(D1 + H).half("pg-x", "Pay")
        for hour in range(30):
            b.at(D1 + hour * H + 20).send("Orders", b"o" * 150)
    with StoreBuilder(other, segment_size=4096) as b:
        for hour in range(30):
            b.at(D1 + hour * H + 20).send("Orders", b"o" * 150)
    run_rollup(spark, store, out, date="2024-03-09")
    day1 = [dict(r) for r in table(spark, out, "transactions", "2024-03-09") if dict(r)["grain"] == "day"]
    assert {r["producer_group"]: r["undecided_at_end"] for r in day1} == {"pg-x": 1, "*": 1}
    os.rename(store, store + "-before")
    os.rename(other, store)             # the same name: the same broker column
    one = run_rollup(spark, store, out, date="2024-03-10")
    assert not one["incremental"], one
    assert any("another store" in r.getMessage() for r in caplog.records)
    day2 = [dict(r) for r in table(spark, out, "transactions", "2024-03-10") if dict(r)["grain"] == "day"]
    assert {r["producer_group"]: r["undecided_at_end"] for r in day2} == {"*": 0}


def test_a_previous_day_rewritten_from_another_store_while_a_run_reads_is_not_counted_on(spark, tmp_path,
                                                                                        monkeypatch):
    """The store check is made before --out's lock, with the first read of D-1's count; the count is read again
    under the lock (another run may have rewritten D-1 meanwhile), the store not. A run of another store under
    the same name (a mixed-up mount) that rewrote D-1 in between: its undecided count was taken as this store's,
    for D and every later day. Refused, as a D-1 that went meanwhile is: run it again."""
    import ops.spark.rollup as rollup_mod

    out, store = str(tmp_path / "out"), str(tmp_path / "a" / "store")
    other = str(tmp_path / "b" / "store")
    with StoreBuilder(store, segment_size=4096) as b:
        for hour in range(30):
            b.at(D1 + hour * H + 20).send("Orders", b"o" * 150)
    with StoreBuilder(other, segment_size=4096) as b:
        b.at(D1 + H).half("pg-x", "Pay")
        for hour in range(30):
            b.at(D1 + hour * H + 20).send("Orders", b"o" * 150)
    rollup_mod.run_rollup(spark, store, out, date="2024-03-09")

    real, nested = rollup_mod.previous_stores, []

    def read_then_overlap(spark_, out_dir, date, broker):
        ids = real(spark_, out_dir, date, broker)
        if date == "2024-03-10" and not nested:         # after the first check: the other store's run
            nested.append(rollup_mod.run_rollup(spark, other, out, date="2024-03-09"))
        return ids
    monkeypatch.setattr(rollup_mod, "previous_stores", read_then_overlap)
    with pytest.raises(ValueError, match="another store"):
        rollup_mod.run_rollup(spark, store, out, date="2024-03-10")
    assert nested
