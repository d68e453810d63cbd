"""The rollup reads the neighbouring days' snapshot files too, one of them the file the broker is appending to
right now: a last line still being written is not a bad line (it is read whole by the next run), but a line a
kill -9 tore in a file no longer written is."""
from __future__ import annotations

import json
import os
import time


def _line(ts: int, lag: int) -> str:
    return json.dumps({"ts": ts, "connections": 1,
                       "consumer_lag": [{"group": "cg", "topic": "T", "queue_id": 0, "lag": lag}]}) + "\n"


def test_a_line_being_appended_is_not_bad_but_an_old_torn_one_is(spark, tmp_path):
    from ops.spark.load import load_snapshots

    d = tmp_path / "metrics"
    d.mkdir()
    day = 1710028800000          # 2024-03-10 00:00 UTC
    old = d / "2024-03-09.jsonl"
    old.write_text(_line(day - 60_000, 1) + '{"ts": 17100287')     # torn by a kill -9, never ended
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    live = d / "2024-03-10.jsonl"
    live.write_text(_line(day, 2) + _line(day + 60_000, 3) + '{"ts": 1710028920000, "connec')   # being appended
    snaps = load_snapshots(spark, str(tmp_path), ["2024-03-10"], job="test")
    try:
        assert (snaps.files, snaps.lines, snaps.bad_lines) == (2, 3, 1)
    finally:
        snaps.release()


def test_a_snapshot_line_read_twice_counts_once(spark, tmp_path, caplog):
    """A metrics file with its lines twice (restored from a backup with `cat old >> new`, rsync --append over a
    copy): each group's lag is summed over its queues per snapshot, so a minute listed twice read as one snapshot
    of twice the lag (lag_max 2x, the day's max 3 -> 6) and twice the snapshots. One line a ts counts, and the
    dropped ones are counted and said."""
    import logging

    from ops.spark.load import load_snapshots
    from ops.spark.rollup import broker_table, consumer_lag_table

    d = tmp_path / "metrics"
    d.mkdir()
    day = 1710028800000          # 2024-03-10 00:00 UTC
    lines = _line(day, 2) + _line(day + 60_000, 3)
    (d / "2024-03-10.jsonl").write_text(lines + lines)
    an_hour_ago = time.time() - 3600
    os.utime(d / "2024-03-10.jsonl", (an_hour_ago, an_hour_ago))
    with caplog.at_level(logging.WARNING, logger="ops.spark"):
        snaps = load_snapshots(spark, str(tmp_path), ["2024-03-10"], job="test")
    try:
        lag = {r["grain"]: r for r in consumer_lag_table(snaps.rows, ["2024-03-10"]).collect()}
        broker = {r["grain"]: r for r in broker_table(snaps.rows, ["2024-03-10"]).collect()}
        assert (lag["day"]["snapshots"], lag["day"]["lag_max"], lag["day"]["lag_avg"]) == (2, 3, 2.5)
        assert (broker["day"]["snapshots"], broker["day"]["connections_max"]) == (2, 1)
        assert (snaps.lines, snaps.duplicate_lines) == (2, 2)
        assert "2 snapshot lines repeat the ts of another" in caplog.text
    finally:
        snaps.release()


def _joins(df) -> str:
    """The join strategies of df's physical plan (before adaptive execution changes it)."""
    plan = df._jdf.queryExecution().executedPlan().toString()
    return " ".join(sorted({w for w in ("BroadcastHashJoin", "SortMergeJoin", "ShuffledHashJoin") if w in plan}))


def test_the_one_line_a_ts_table_is_broadcast_only_while_it_is_small(spark, tmp_path):
    """The (ts, line) table of the lines kept is one row a snapshot line of every file read: a rollup without
    --date reads every retained day, and with metrics_snapshot_retention_days = 0 and a short
    metrics_snapshot_interval_s that is tens of millions of rows. A broadcast hint collected it whole on the
    driver (spark.driver.memory) whatever its size; Spark chooses now: a broadcast under
    spark.sql.autoBroadcastJoinThreshold (the nightly run's few thousand rows), a shuffle join above it."""
    from ops.spark.load import load_snapshots

    d = tmp_path / "metrics"
    d.mkdir()
    day = 1710028800000          # 2024-03-10 00:00 UTC
    (d / "2024-03-10.jsonl").write_text(_line(day, 2) + _line(day + 60_000, 3) + _line(day, 2))
    an_hour_ago = time.time() - 3600
    os.utime(d / "2024-03-10.jsonl", (an_hour_ago, an_hour_ago))
    small = load_snapshots(spark, str(tmp_path), ["2024-03-10"], job="test")
    try:
        assert _joins(small.rows) == "BroadcastHashJoin"
        assert (small.rows.count(), small.duplicate_lines) == (4, 1)
    finally:
        small.release()
    spark.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")      # as a table above the threshold is
    try:
        big = load_snapshots(spark, str(tmp_path), ["2024-03-10"], job="test")
        try:
            assert _joins(big.rows) == "SortMergeJoin"
            assert (big.rows.count(), big.duplicate_lines) == (4, 1)
        finally:
            big.release()
    finally:
        spark.conf.unset("spark.sql.autoBroadcastJoinThreshold")


def test_snapshot_lines_stamped_in_seconds_are_said_not_dropped_silently(spark, tmp_path, caplog):
    """A metrics file whose "ts" is in seconds (a converter's, a backfill's; the broker writes milliseconds): each
    line fell on 1970-01-20, a rollup --date of the file's day had no broker or lag row of it, one INFO line
    ("read 2 snapshot lines") and exit 0. Now they are counted apart, not rolled up (no 1970 partition), and said
    in a WARNING."""
    import logging

    from ops.spark.load import load_snapshots
    from ops.spark.rollup import broker_table

    d = tmp_path / "metrics"
    d.mkdir()
    day = 1710028800000          # 2024-03-10 00:00 UTC
    (d / "2024-03-10.jsonl").write_text(_line(day // 1000, 2) + _line(day // 1000 + 60, 3) + _line(day, 4))
    an_hour_ago = time.time() - 3600
    os.utime(d / "2024-03-10.jsonl", (an_hour_ago, an_hour_ago))
    with caplog.at_level(logging.WARNING, logger="ops.spark"):
        snaps = load_snapshots(spark, str(tmp_path), None, job="test")
    try:
        assert "2 snapshot lines are stamped before 2001-09-09" in caplog.text and "seconds" in caplog.text
        assert (snaps.lines, snaps.early_lines) == (1, 2)
        assert {r["date"] for r in broker_table(snaps.rows, ["1970-01-20", "2024-03-10"]).collect()} == {"2024-03-10"}
    finally:
        snaps.release()
