"""A quiet weekend: a segment fills on Friday, nothing is stored Saturday and Sunday, traffic again
on Monday (the first record of the next segment). Every day must get its traffic and transactions
rows from the nightly runs: Saturday and Sunday none of traffic but their transactions rows
(undecided carried over), Monday its traffic.

Store (UTC, 4 KiB segments): Thu 2024-03-07 hourly 3 x Orders and a pg-a half at 10:00 never
decided; Fri 2024-03-08 hourly 3 x Orders, then Orders until the segment is full; Mon 2024-03-11
from 08:00 hourly 3 x Orders; Tue 2024-03-12 from 08:00 hourly 3 x Orders.
"""
from __future__ import annotations

import os

import pytest

from tests.spark.storegen import StoreBuilder
from tests.spark.test_history import remove_older_than

pytestmark = pytest.mark.spark

H = 3_600_000
DAY = 24 * H
THU = 1709769600000
FRI, SAT, SUN, MON, TUE = (THU + k * DAY for k in range(1, 6))
DATES = ("2024-03-07", "2024-03-08", "2024-03-09", "2024-03-10", "2024-03-11", "2024-03-12")
SEG = 4096


def build(d: str) -> int:
    """Returns the commit-log offset of Monday's first record (a segment's first byte)."""
    with StoreBuilder(d, segment_size=SEG) as b:
        for hour in range(24):
            for i in range(3):
                b.at(THU + hour * H + i).send("Orders", b"o" * 150, queue_id=i)
            if hour == 10:
                b.at(THU + hour * H + 10).half("pg-a", "Pay")
        for hour in range(24):
            for i in range(3):
                last = b.at(FRI + hour * H + i).send("Orders", b"o" * 150, queue_id=i)
        k = 0
        while SEG - (last.offset + last.size) % SEG >= last.size + 8:   # fill Friday's segment
            last = b.at(FRI + 23 * H + 100 + k).send("Orders", b"o" * 150)
            k += 1
        first_monday = None
        for day in (MON, TUE):
            for hour in range(8, 24):
                for i in range(3):
                    s = b.at(day + hour * H + i).send("Orders", b"o" * 150, queue_id=i)
                    first_monday = first_monday if first_monday is not None else s.offset
    return first_monday


def day_rows(spark, out, name, date):
    df = spark.read.parquet(os.path.join(out, name)).where(f"date = '{date}' and grain = 'day'")
    return [r.asDict() for r in df.collect()]


def nightly(spark, store, out, dates=DATES, retention=72 * H):
    """Each date's nightly run half an hour after its end, retention applied just before."""
    from ops.spark.rollup import run_rollup

    got = {}
    for d in dates:
        k = DATES.index(d)
        remove_older_than(store, THU + (k + 1) * DAY + H // 2 - retention)
        got[d] = run_rollup(spark, store, out, date=d)
    return got


def totals(spark, out, date):
    written = os.path.isdir(os.path.join(out, "traffic", f"date={date}"))
    traffic = day_rows(spark, out, "traffic", date) if written else []
    tx = {r["producer_group"]: r["undecided_at_end"] for r in day_rows(spark, out, "transactions", date)}
    return sum(r["messages"] for r in traffic), tx


def test_nightly_runs_over_a_quiet_weekend_write_every_day(spark, tmp_path):
    """Retention removes Friday's segment on Monday night, before Monday's run: Monday counted as cut
    (the day of the oldest record left) and its traffic and transactions rows were never written; the
    next night found no Monday row and read the whole store, where the half of Thursday is gone."""
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    assert build(store) % SEG == 0
    runs = nightly(spark, store, out)
    assert all(not s["left_as_is"] for s in runs.values()), {d: s["left_as_is"] for d, s in runs.items()}
    assert all(s["incremental"] for d, s in runs.items() if d != DATES[0])
    want = {DATES[0]: 72, DATES[1]: None, DATES[2]: 0, DATES[3]: 0, DATES[4]: 48, DATES[5]: 48}
    for d in DATES:
        messages, tx = totals(spark, out, d)
        assert tx == {"*": 1, "pg-a": 1}, (d, tx)          # Thursday's half, undecided every night
        if want[d] is not None:
            assert messages == want[d], d


def test_a_whole_store_run_rolls_up_the_quiet_days_too(spark, tmp_path):
    """A backfill into an empty --out: the weekend has no record, but it gets its transactions rows
    (the undecided count carried over) and its report, like a nightly run of the day."""
    import csv

    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    build(store)
    summary = run_rollup(spark, store, out)
    assert summary["dates"] == list(DATES) and not summary["left_as_is"]
    for d in DATES:
        assert totals(spark, out, d)[1] == {"*": 1, "pg-a": 1}, d
    assert totals(spark, out, DATES[2])[0] == 0
    with open(os.path.join(out, "report", f"txmq-{DATES[2]}.csv")) as f:
        day = [r for r in csv.DictReader(f) if r["window"] == "day"]
    assert day and all(int(r["messages"]) == 0 for r in day)


def test_after_fridays_segment_is_removed_monday_is_whole_unless_the_manifest_cannot_say(spark, tmp_path):
    """The manifest's "removed" entry (the newest segment retention removed) shows Friday's segment
    held nothing of Monday: a backfill rewrites Monday and leaves Friday as the nightly run wrote it.
    A manifest without that entry (a broker from before it) cannot show it: Monday stays as it is."""
    import json

    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    build(store)
    nightly(spark, store, out, DATES[:2])
    friday = totals(spark, out, DATES[1])
    remove_older_than(store, MON)                     # everything up to Friday's last segment
    with open(os.path.join(store, "segments.json")) as f:
        assert json.load(f)["removed"]["last_ts"] < SAT
    summary = run_rollup(spark, store, out)
    left = {(x["date"], x["table"]) for x in summary["left_as_is"]}
    assert left == set(), left
    assert summary["dates"] == list(DATES[4:])
    assert totals(spark, out, DATES[1]) == friday
    assert totals(spark, out, DATES[4])[0] == 48

    with open(os.path.join(store, "segments.json")) as f:
        manifest = json.load(f)
    del manifest["removed"]
    with open(os.path.join(store, "segments.json"), "w") as f:
        json.dump(manifest, f)
    summary = run_rollup(spark, store, out)
    left = {(x["date"], x["table"]) for x in summary["left_as_is"]}
    assert left == {(DATES[4], "traffic"), (DATES[4], "transactions")}, left


def test_a_nightly_run_after_missed_nights_rolls_up_the_days_missed_too(spark, tmp_path):
    """The host was down Friday and Saturday nights (the timer runs once at boot, for yesterday): Sunday's run
    found no Saturday row and rolled up Sunday alone, Friday and Saturday out of the tables and reports for good,
    nothing said but an INFO line. The days since the last one rolled up are rolled up with it."""
    from ops.spark.rollup import run_rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    build(store)
    run_rollup(spark, store, out, date=DATES[0])
    summary = run_rollup(spark, store, out, date=DATES[3])
    assert summary["dates"] == list(DATES[1:4]) and not summary["left_as_is"]
    assert sorted(os.listdir(os.path.join(out, "transactions"))) == [f"date={d}" for d in DATES[:4]]
    assert totals(spark, out, DATES[1])[0] > 72                 # Friday's hourly 72 and its segment's fill
    for d in DATES[1:4]:
        assert totals(spark, out, d)[1] == {"*": 1, "pg-a": 1}, d
        assert os.path.exists(os.path.join(out, "report", f"txmq-{d}.csv")), d
    again = run_rollup(spark, store, out, date=DATES[4])       # and the next night is incremental again
    assert again["dates"] == [DATES[4]] and again["incremental"]


def test_a_gap_longer_than_the_catch_up_window_is_said_at_warning(spark, tmp_path, monkeypatch, caplog):
    """Missed nights beyond CATCH_UP_DAYS (a host down for weeks) were found by no look-back: the run rolled up D
    alone, said only in the INFO line a first run gets, the days between left out of the tables for good. Said at
    WARNING with the newest day rolled up and how to roll up the rest (the window made 2 days here)."""
    import logging

    from ops.spark import rollup

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    build(store)
    rollup.run_rollup(spark, store, out, date=DATES[0])
    monkeypatch.setattr(rollup, "CATCH_UP_DAYS", 2)
    with caplog.at_level(logging.WARNING, logger="ops.spark"):
        summary = rollup.run_rollup(spark, store, out, date=DATES[4])
    assert summary["dates"] == [DATES[4]]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and DATES[0] in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert f"{DATES[1]} to {DATES[3]}" in said[0] and "3 days" in said[0] and "without --date" in said[0], said
