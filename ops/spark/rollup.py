"""The nightly rollup: hourly and daily metrics as Parquet partitioned by date, plus a report.

Tables under --out (each partitioned by date=YYYY-MM-DD, windows in UTC; grain is "hour"
or "day", window_start the window's first instant):

    traffic        topic, topic_kind (normal/retry/dlq), producer_group: messages, bytes, body_bytes
                   (records on user topics, committed transactional messages included)
    transactions   producer_group ("*" = all): halves, commits, rollbacks, checks, dead_letters(+ by
                   reason), undecided_at_end, decided, latency_p50/p95/p99/max_ms (exact)
    consumer_lag   consumer_group: snapshots, lag_max, lag_avg (lag summed over the group's queues)
    broker         snapshots, connections_max, connections_avg

Every table also has a ``broker`` column and a ``store_id`` one (the store's id, see previous_stores): the
rollup reads one store or several (one per broker of
a cluster, ``--store-dir A --store-dir B`` or ``--store-root``), computes each store's rows on their
own (a store's commit-log offsets mean nothing in another) and writes them together, so one run
gives one set of tables and one report across the brokers. A store's broker is its directory's name
(``python -m broker cluster`` names each store after its broker).

Re-running a date replaces that date's rows of the brokers read and nothing else (dynamic
partition overwrite, other brokers' rows carried over; a date that now has no rows in a table
loses its old ones). A date a store no longer holds whole (retention removed the segments it
began in, or its snapshot files are gone) keeps its rows: see _StoreRollup.owned.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import logging
import os
import re
import time
import urllib.parse

from protocol.txlog import COMMIT, OPS

from . import segments as seg_mod
from .load import DEFAULT_CHUNK_BYTES, half_offsets_by_queue, load_snapshots, read_halves, scan_store
from .manifest import read_store_id, removed_before, segments_for_window
from .publish import Publisher
from .snapshots import snapshot_files
from .transactions import ALL_GROUPS, classify, half_summary, op_damage

log = logging.getLogger("ops.spark")

HOUR = 3_600_000
DAY = 86_400_000
TX_METRICS = ("halves", "commits", "rollbacks", "checks", "dead_letters", "dead_letters_expired",
              "dead_letters_max_checks")
DEAD_REASONS = {"expired": "dead_letters_expired", "max-checks": "dead_letters_max_checks"}
KEYS = ["date", "grain", "window_ms"]


def _F():
    from pyspark.sql import functions as F
    return F


def _windows(df, ts: str):
    """One row per (hour, day) window the timestamp falls in, with date and window_ms."""
    F = _F()
    grains = F.array(
        F.struct(F.lit("hour").alias("grain"), (F.floor(F.col(ts) / HOUR) * HOUR).cast("long").alias("w")),
        F.struct(F.lit("day").alias("grain"), (F.floor(F.col(ts) / DAY) * DAY).cast("long").alias("w")))
    return (df.withColumn("_w", F.explode(grains))
            .withColumn("grain", F.col("_w.grain")).withColumn("window_ms", F.col("_w.w")).drop("_w")
            .withColumn("date", F.date_format(F.expr("timestamp_millis(window_ms)"), "yyyy-MM-dd")))


def _all_groups(df, column: str = "producer_group"):
    F = _F()
    return df.withColumn(column, F.explode(F.array(F.col(column), F.lit(ALL_GROUPS))))


def _finish(df):
    F = _F()
    return df.withColumn("window_start", F.expr("timestamp_millis(window_ms)"))


def traffic_table(parts, dates):
    """From the scan's per-chunk traffic partials (store_ts = hour start)."""
    F = _F()
    topic = F.col("topic")
    topic_kind = (F.when(topic.startswith("%RETRY%"), "retry").when(topic.startswith("%DLQ%"), "dlq")
                  .otherwise("normal"))
    return _finish(_windows(parts, "store_ts").where(F.col("date").isin(dates))
                   .groupBy(*KEYS, "topic", topic_kind.alias("topic_kind"),
                            F.col("pgroup").alias("producer_group"))
                   .agg(F.sum("n").alias("messages"), F.sum("bytes").alias("bytes"),
                        F.sum("body_bytes").alias("body_bytes")))


def _undecided(spark, per_hour, groups, dates):
    """Undecided at each window's end = sum of the +1 / -1 events of every hour before it."""
    F = _F()
    grid_rows = []
    for d in dates:
        day = int(dt.datetime.fromisoformat(d).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)
        grid_rows.append((d, "day", day, day + DAY))
        grid_rows += [(d, "hour", day + k * HOUR, day + (k + 1) * HOUR) for k in range(24)]
    grid = spark.createDataFrame(grid_rows, "date string, grain string, window_ms long, window_end long")
    return (grid.crossJoin(groups).alias("g")
            .join(per_hour.alias("e"), (F.col("g.producer_group") == F.col("e.producer_group"))
                  & (F.col("e.bucket") < F.col("g.window_end")), "left")
            .groupBy(*[F.col("g." + k) for k in KEYS], F.col("g.producer_group"))
            .agg(F.coalesce(F.sum("e.delta"), F.lit(0)).cast("long").alias("undecided_at_end")))


def transactions_table(spark, s, dates, since: int | None = None, baseline: list | None = None):
    """From half_summary() rows (cached by the caller: three aggregates read them).

    Incremental (``since`` = the day's first instant): undecided_at_end counts from
    ``baseline`` [(producer_group, undecided at since)] plus the events at or after since,
    so nothing before the day needs to be read."""
    F = _F()
    ev = F.struct
    reason_metric = F.create_map(*[F.lit(x) for kv in DEAD_REASONS.items() for x in kv])
    # A dead letter counts for its own group (it carries its half's PGROUP): its TXMQ_HALF is under no CRC, and a
    # flipped digit there files it under another half, of another group perhaps.
    own = F.col("group")
    fact = lambda ts, metric, group=own: ev(ts.alias("ts"), metric.alias("metric"), group.alias("group"))  # noqa: E731
    facts = s.select(F.explode(F.concat(
        F.when(F.col("h").isNotNull(), F.array(fact(F.col("h.ts"), F.lit("halves")))).otherwise(F.array()),
        F.when(F.col("decision").isNotNull(), F.array(fact(F.col("decision.ts"), F.when(
            F.col("decision.outcome") == COMMIT, "commits").otherwise("rollbacks"))))
        .otherwise(F.array()),
        F.transform("checks", lambda t: fact(t, F.lit("checks"))),
        F.transform("deads", lambda d: fact(d["ts"], F.lit("dead_letters"), F.coalesce(d["group"], own))),
        F.transform(F.filter("deads", lambda d: reason_metric[d["reason"]].isNotNull()),
                    lambda d: fact(d["ts"], reason_metric[d["reason"]], F.coalesce(d["group"], own))),
    )).alias("e")).select(F.col("e.group").alias("producer_group"), "e.ts", "e.metric")
    counts = (_windows(_all_groups(facts), "ts").where(F.col("date").isin(dates))
              .groupBy(*KEYS, "producer_group").pivot("metric", list(TX_METRICS)).count())

    decided = s.where(F.col("h").isNotNull() & F.col("decision").isNotNull())
    latency = (_windows(_all_groups(decided.select(
        F.col("group").alias("producer_group"), F.col("decision.ts").alias("dec_ts"),
        (F.col("decision.ts") - F.col("h.ts")).alias("latency"))), "dec_ts")
        .where(F.col("date").isin(dates))
        .groupBy(*KEYS, "producer_group")
        .agg(F.count(F.lit(1)).alias("decided"),
             F.expr("percentile(latency, array(0.5, 0.95, 0.99))").alias("p"),
             F.max("latency").alias("latency_max_ms"))
        .select(*KEYS, "producer_group", "decided", F.col("p")[0].alias("latency_p50_ms"),
                F.col("p")[1].alias("latency_p95_ms"), F.col("p")[2].alias("latency_p99_ms"), "latency_max_ms"))

    # +1 at the half, -1 at its decision, -1 / +1 at DEAD / RESUME ops before the decision. A half whose
    # segment retention removed (after dead-lettering it) has only its ops left: over the whole store it
    # counts for nothing, but an incremental run's baseline counted it undecided, so its ops still count.
    known = F.col("h").isNotNull()
    events = (s if since is not None else s.where(known)).select(
        F.col("group").alias("producer_group"), F.explode(F.concat(
            F.when(known, F.array(ev(F.col("h.ts").alias("ts"), F.lit(1).alias("delta")))).otherwise(F.array()),
            F.when(F.col("decision").isNotNull(), F.array(ev(F.col("decision.ts").alias("ts"),
                                                             F.lit(-1).alias("delta")))).otherwise(F.array()),
            F.transform("toggles", lambda t: ev(t["ts"].alias("ts"), t["delta"].alias("delta"))),
        )).alias("e"))
    if since is not None:
        events = events.where(F.col("e.ts") >= since)
    per_hour = (_all_groups(events).groupBy("producer_group", (F.floor(F.col("e.ts") / HOUR) * HOUR).alias("bucket"))
                .agg(F.sum("e.delta").alias("delta")))
    groups = (s.select(F.col("group").alias("producer_group"))
              .unionByName(spark.createDataFrame([(ALL_GROUPS,)], "producer_group string")).distinct())
    if since is not None:
        start = spark.createDataFrame([(g, since - HOUR, int(n)) for g, n in baseline or []],
                                      "producer_group string, bucket long, delta long")
        per_hour = per_hour.unionByName(start)
        groups = groups.unionByName(start.select("producer_group")).distinct()
    table = (_undecided(spark, per_hour, groups, dates)
             .join(counts, KEYS + ["producer_group"], "left")
             .join(latency, KEYS + ["producer_group"], "left")
             .fillna(0, subset=list(TX_METRICS) + ["decided"]))
    busy = F.lit(False)
    for c in TX_METRICS + ("undecided_at_end",):
        busy = busy | (F.col(c) != 0)
    return _finish(table.where((F.col("producer_group") == ALL_GROUPS) | busy))


def consumer_lag_table(snap_rows, dates):
    F = _F()
    per_snapshot = (snap_rows.where(F.col("kind") == "lag").groupBy("ts", "group")
                    .agg(F.sum("lag").alias("lag")))
    return _finish(_windows(per_snapshot, "ts").where(F.col("date").isin(dates))
                   .groupBy(*KEYS, F.col("group").alias("consumer_group"))
                   .agg(F.count(F.lit(1)).alias("snapshots"), F.max("lag").alias("lag_max"),
                        F.avg("lag").alias("lag_avg")))


def broker_table(snap_rows, dates):
    F = _F()
    return _finish(_windows(snap_rows.where(F.col("kind") == "snap"), "ts").where(F.col("date").isin(dates))
                   .groupBy(*KEYS)
                   .agg(F.count(F.lit(1)).alias("snapshots"), F.max("connections").alias("connections_max"),
                        F.avg("connections").alias("connections_avg")))


def _dates_present(scan, snaps) -> list[str]:
    """Every UTC date with a record (first / last store time of each partial) or a snapshot."""
    F = _F()
    stamps = (scan.rows.select(F.explode(F.array("store_ts", "ts_max")).alias("ts"))
              .unionByName(snaps.rows.where("kind = 'snap'").select("ts")).where(F.col("ts").isNotNull()))
    return sorted(r[0] for r in stamps.select(F.date_format(F.expr("timestamp_millis(ts)"), "yyyy-MM-dd"))
                  .distinct().collect())


def _read_dates(spark, path: str, dates) -> object | None:
    """The date partitions of table ``path`` for these dates (those that exist), or None.

    Only those partitions are listed and read, and their schemas merged: without a schema, Spark
    takes a table's from one file of all its partitions, and months of history can begin with
    partitions written before the broker column. Read whole, such a table had no broker column:
    another broker's rows of a date were not kept when it was rewritten, and a broker's previous
    day summed every broker's undecided count."""
    from pyspark.sql.utils import AnalysisException

    jvm = spark.sparkContext._jvm
    fs = jvm.org.apache.hadoop.fs.Path(path).getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    parts = [f"{path}/date={d}" for d in sorted(set(dates))]
    parts = [p for p in parts if fs.exists(jvm.org.apache.hadoop.fs.Path(p))]
    if not parts:
        return None
    try:
        return spark.read.option("basePath", path).option("mergeSchema", "true").parquet(*parts)
    except AnalysisException:           # partitions without a data file (hold no rows)
        return None


def _kept_rows(spark, path: str, df, dates: list[str], owned: dict[str, set[str]]) -> list:
    """The rows already under path for these dates that this run does not replace: another broker's,
    or a date a broker's store no longer holds whole. Collected (aggregates: a few thousand rows a
    broker and day), so the overwrite does not read the files it replaces. Rows written before the
    broker column (one store's) have no broker: a date rewritten replaces them whole."""
    F = _F()
    old = _read_dates(spark, path, dates)
    if old is None or "broker" not in old.columns:
        return []
    old = old.withColumn("date", F.col("date").cast("string")).where(~_owned_cond(owned) & F.col("broker").isNotNull())
    cols = [F.col(f.name).cast(f.dataType) if f.name in old.columns else F.lit(None).cast(f.dataType).alias(f.name)
            for f in df.schema.fields]
    return old.select(*cols).collect()


def _owned_cond(owned: dict[str, set[str]]):
    F = _F()
    cond = F.lit(False)
    for broker, ds in owned.items():
        if ds:
            cond = cond | ((F.col("broker") == broker) & F.col("date").cast("string").isin(sorted(ds)))
    return cond


def write_partitions(spark, df, staged: str, owned: dict[str, set[str]], kept: list):
    """Write df (this run's rows: only the broker and date pairs in owned, see _owned_cond) plus the
    ``kept`` rows of those dates (_kept_rows) as partitions under ``staged`` (a Publisher's staging
    directory: nothing under --out changes until its commit); return (how many rows are this run's,
    every row the dates' partitions will hold). Spark's dynamic overwrite replaces a whole date
    partition, and a run that covers one broker of several, or a date a store holds only part of,
    must not take the other rows with it."""
    if not any(owned.values()):
        return 0, df
    full = df if not kept else df.unionByName(spark.createDataFrame(kept, df.schema))
    full.write.mode("overwrite").partitionBy("date").parquet(staged)
    return df.count(), full         # df is cached, and the write filled the cache: no new scan


def previous_undecided(spark, out_dir: str, date: str, broker: str | None = None) -> list | None:
    """[(producer_group, undecided_at_end)] of the day before ``date`` as rolled up under out_dir for
    ``broker`` (tables written before the broker column: every row), or None when that day has not
    been rolled up there."""
    F = _F()
    prev = (dt.date.fromisoformat(date) - dt.timedelta(days=1)).isoformat()
    df = _read_dates(spark, os.path.join(out_dir, "transactions"), [prev])
    if df is None:
        return None
    where = F.col("grain") == "day"
    if broker is not None and "broker" in df.columns:
        where = where & (F.col("broker") == broker)
    rows = df.where(where).select("producer_group", "undecided_at_end").collect()
    return [(r["producer_group"], r["undecided_at_end"] or 0) for r in rows] or None


CATCH_UP_DAYS = 31      # how far back a run with --date looks for the last day rolled up, to roll up those missed


def missed_days(spark, out_dir: str, day: dt.date, broker: str) -> list[str]:
    """The days between the newest day of ``broker`` rolled up under out_dir within CATCH_UP_DAYS before ``day``
    and ``day`` (both excluded): nights the nightly run missed (a host down over a weekend: the timer runs once
    at boot, for yesterday). [] when none is rolled up there (a first run, or a gap longer than that)."""
    back = [(day - dt.timedelta(days=k)).isoformat() for k in range(2, CATCH_UP_DAYS + 1)]
    last = _newest_day(spark, out_dir, back, broker)
    if last is None:
        _said_older(spark, out_dir, day, broker)
        return []
    start = dt.date.fromisoformat(last) + dt.timedelta(days=1)
    return [(start + dt.timedelta(days=k)).isoformat() for k in range((day - start).days)]


def _newest_day(spark, out_dir: str, dates, broker: str) -> str | None:
    """The newest of these dates with day rows of ``broker`` in out_dir's transactions table (None: none)."""
    F = _F()
    df = _read_dates(spark, os.path.join(out_dir, "transactions"), dates)
    if df is None:
        return None
    if "broker" in df.columns:
        df = df.where(F.col("broker") == broker)
    last = df.where(F.col("grain") == "day").agg(F.max("date")).first()[0]
    return None if last is None else str(last)


def _said_older(spark, out_dir: str, day: dt.date, broker: str) -> None:
    """A WARNING when ``broker``'s newest day under out_dir lies before the catch-up window: the days since are
    rolled up by no run with --date (read only then: the window's partitions held none of its rows)."""
    path = os.path.join(out_dir, "transactions")
    jvm = spark.sparkContext._jvm
    where = jvm.org.apache.hadoop.fs.Path(path)
    fs = where.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    if not fs.exists(where):
        return
    edge = (day - dt.timedelta(days=CATCH_UP_DAYS)).isoformat()
    names = [st.getPath().getName() for st in fs.listStatus(where) if st.isDirectory()]
    older = [n[len("date="):] for n in names if n.startswith("date=") and n[len("date="):] < edge]
    last = _newest_day(spark, out_dir, older, broker) if older else None
    if last is None:
        return
    first, end = dt.date.fromisoformat(last) + dt.timedelta(days=1), day - dt.timedelta(days=1)
    n = (end - first).days + 1
    log.warning("rollup: the newest day of %s rolled up under %s is %s, more than %d days before %s: the %d %s "
                "%s to %s are not rolled up by this run (nightly runs missed for longer than it looks back); roll "
                "them up with a run without --date (every day the store holds), or with --date for each, oldest "
                "first", broker, out_dir, last, CATCH_UP_DAYS, day, n, "day" if n == 1 else "days", first, end)


def previous_stores(spark, out_dir: str, date: str, broker: str) -> set[str]:
    """The ids of the stores the day before ``date``'s transactions rows of ``broker`` were rolled up from
    (rows written before the store_id column, or from a store without an id: none)."""
    F = _F()
    prev = (dt.date.fromisoformat(date) - dt.timedelta(days=1)).isoformat()
    df = _read_dates(spark, os.path.join(out_dir, "transactions"), [prev])
    if df is None or "store_id" not in df.columns or "broker" not in df.columns:
        return set()
    rows = (df.where((F.col("broker") == broker) & F.col("store_id").isNotNull())
            .select("store_id").distinct().collect())
    return {r["store_id"] for r in rows}


def store_brokers(store_dirs) -> list[tuple[str, str]]:
    """[(broker, store dir)] from one directory or several; the broker is the directory's name,
    which must differ between stores."""
    dirs = [store_dirs] if isinstance(store_dirs, (str, os.PathLike)) else list(store_dirs)
    pairs = [(os.path.basename(os.path.normpath(str(d))) or str(d), str(d)) for d in dirs]
    names = [b for b, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"store directories must have different names (the broker column): {names}")
    return pairs


def _decided_elsewhere(records) -> list[int]:
    """Halves whose ops / check records / dead letters were read but which were not. An op whose properties are
    damaged (bad_op) with a whole decision word too: whether it is that decision depends on its half's offset
    agreeing with its TXMQ_HALF (transactions._by_body), and without the half a one-day run held back what the
    whole-store run counted. (Other bad_ops decide nothing either way: their suspect TXMQ_HALF is not read.)"""
    F = _F()
    kind = F.col("kind")
    have = records.where(kind == "half").select(F.col("offset").alias("half"))
    said = (kind == "bad_op") & F.col("txmq_op").isin(*OPS)
    named = (records.where((kind.isin("op", "check", "dead") | said) & F.col("txmq_half").isNotNull())
             .select(F.col("txmq_half").alias("half")).distinct())
    return [r[0] for r in named.join(have, "half", "left_anti").collect()]


def _unmatched_bodies(records) -> list[int]:
    """Half queue offsets named by op bodies (transactions._by_body) whose half the records read do not hold."""
    F = _F()
    have = records.where((F.col("kind") == "half") & (F.col("queue_id") == 0)).select(F.col("queue_offset").alias("q"))
    # (sender records too: whether one is misnamed is told by its body's half, as the whole-store run tells it)
    named = (records.where(F.col("kind").isin("op", "check", "sender", "bad_op") & F.col("half_qo").isNotNull())
             .select(F.col("half_qo").alias("q")).distinct())
    return [r[0] for r in named.join(have, "q", "left_anti").collect()]


def run_rollup(spark, store_dir, out_dir: str, *, date: str | None = None, skip_damaged: bool = False,
               check_crc: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               report_dir: str | None = None) -> dict:
    """Roll up one UTC date (or, without date, every date found in the stores) into out_dir.

    ``store_dir``: one store directory, or several (one per broker). With a date whose previous
    day is already rolled up under out_dir, only the segments that can hold the date (by each
    broker's segment manifest) are read, plus the few halves decided that day but stored before
    it; otherwise the whole store is read once.
    """
    from . import report as report_mod

    started = time.monotonic()
    day = dt.date.fromisoformat(date) if date is not None else None   # ValueError before any work
    publisher = Publisher(spark, out_dir)
    publisher.check_tables(TABLES)          # a table on another file system: refused before any work
    if publisher.pending():                 # a run killed while it published: finish that before reading
        with _out_lock(out_dir):            # --out (a run that fails creates no --out: checked first)
            publisher.recover()
    stores = store_brokers(store_dir)
    parts = []
    tables: dict = {}
    try:
        for broker, path in stores:
            parts.append(_StoreRollup(spark, broker, path, out_dir, day, skip_damaged=skip_damaged,
                                      check_crc=check_crc, chunk_bytes=chunk_bytes))
        summary = _summary(parts, date)
        dates = summary["dates"]
        if not dates:
            log.info("rollup: the store has no records and no snapshots; nothing to write")
            return summary
        # Which (broker, date) rows each table replaces: a date a store no longer holds whole keeps
        # the rows written while it did (see _StoreRollup.owned).
        owned = {name: {p.broker: p.owned(name, dates) for p in parts} for name in TABLES}
        for p in parts:
            for name in TABLES:
                for d in sorted(set(p.wanted() or dates) - owned[name][p.broker]):
                    summary["left_as_is"].append({"broker": p.broker, "date": d, "table": name,
                                                  "why": p.not_whole(name, d)})
        for d in dates:
            left = [x for x in summary["left_as_is"] if x["date"] == d]
            for why in sorted({x["why"] for x in left}):
                log.warning("rollup: %s: %s rows of %s left as they are under %s: %s", d,
                            ", ".join(sorted({f"{x['table']}/{x['broker']}" for x in left if x["why"] == why})),
                            d, out_dir, why)
        dates = summary["dates"] = [d for d in dates if any(d in o for t in owned.values() for o in t.values())]
        if not dates:
            log.warning("rollup: nothing to write: no date is whole in the store any more")
            return summary
        written = {name: set().union(*o.values()) for name, o in owned.items()}    # each table's dates replaced
        # Each table's rows of another broker are read, then written back with this run's: two runs
        # into one --out at once would each write back the other's old rows (a lost update).
        with _out_lock(out_dir):
            publisher.recover()             # one another run killed since the check above left
            for p in parts:
                p.recheck_baseline(out_dir)
            queries = {name: _union([p.query(name, dates) for p in parts]) for name in TABLES}
            report_tables, old_brokers = {}, set()
            for name, df in queries.items():
                t0 = time.monotonic()
                tables[name] = df = df.drop("window_ms").where(_owned_cond(owned[name])).cache()
                # One read of what --out holds for the run's dates and this run does not replace: the
                # rows written back with this run's, and those of a date this table's rows are left
                # as they are for (the store no longer holds the day whole), which the report shows.
                old = _kept_rows(spark, os.path.join(out_dir, name), df, dates, owned[name])
                kept = [r for r in old if r["date"] in written[name]]
                rest = [r for r in old if r["date"] not in written[name]]
                summary["rows"][name], report_tables[name] = write_partitions(
                    spark, df, publisher.stage(name), owned[name], kept)
                if rest:
                    report_tables[name] = report_tables[name].unionByName(spark.createDataFrame(rest, df.schema))
                if name in LOG_TABLES:
                    old_brokers |= {r["broker"] for r in old}
                log.info("rollup: wrote %s (%d rows for %s) in %.1f s", name, summary["rows"][name],
                         ", ".join(dates) if len(dates) <= 3 else f"{len(dates)} dates", time.monotonic() - t0)
            t0 = time.monotonic()
            publisher.commit(written)
            log.info("rollup: published the partitions of %s in %.1f s", ", ".join(TABLES), time.monotonic() - t0)
            t0 = time.monotonic()
            report_dir = report_dir or os.path.join(_local_form(out_dir), "report")
            # Every broker the report's rows hold: this run's, and those of the rows read back above.
            everyone = sorted(old_brokers | set(summary["brokers"]))
            summary["reports"] = report_mod.write_reports(report_dir, dates, report_tables,
                                                          {**summary, "brokers": everyone})
            log.info("rollup: wrote %d report files to %s in %.1f s", len(summary["reports"]), report_dir,
                     time.monotonic() - t0)
        log.info("rollup: done in %.1f s", time.monotonic() - started)
        return summary
    finally:
        for df in tables.values():
            df.unpersist()
        for p in parts:
            p.release()


TABLES = ("traffic", "transactions", "consumer_lag", "broker")
LOG_TABLES = ("traffic", "transactions")          # from the commit log; the others from metric snapshots


@contextlib.contextmanager
def _out_lock(out_dir: str):
    """Hold --out's lock file (``.txmq-rollup.lock``, flock) while a run writes its tables and report:
    another run into the same local --out (or one on a shared mount) waits. A Hadoop URI (hdfs://,
    s3a://) has no lock: runs into one such --out must not overlap."""
    path = _local_path(out_dir)
    if path is None:
        yield
        return
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, ".txmq-rollup.lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("rollup: another rollup is writing into %s: waiting for it", out_dir)
            t0 = time.monotonic()
            fcntl.flock(f, fcntl.LOCK_EX)
            log.info("rollup: waited %.1f s for the other rollup into %s", time.monotonic() - t0, out_dir)
        except OSError as exc:          # a file system without locks (some NFS set-ups)
            log.warning("rollup: cannot lock %s (%s): runs into it must not overlap", out_dir, exc)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _local_form(out_dir: str) -> str:
    """A file: URI's path (file:/x and file:///x are /x to Spark; the report is written with plain file
    I/O, which would make ./file:/x); any other path or URI as it is."""
    if out_dir[:5].lower() == "file:":
        return urllib.parse.urlsplit(out_dir).path
    return out_dir


def _local_path(out_dir: str) -> str | None:
    """out_dir as a path of this host (see _local_form), or None for a Hadoop URI (hdfs://, s3a://): Spark's."""
    path = _local_form(out_dir)
    return None if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", path) else path


def _union(dfs):
    out = dfs[0]
    for df in dfs[1:]:
        out = out.unionByName(df)
    return out


DAMAGED_OPS = ("misnamed", "unreadable", "unplaced", "unsettled")


def _damaged_ops(broker: str, records, per_half) -> dict:
    """Op records with damaged properties (transactions.py): counted, said at ERROR, and in the summary and the
    report. A half an unreadable op may have decided (unsettled) counts as undecided here until the broker's next
    start settles it and writes its op again."""
    F = _F()
    out = {**op_damage(records),
           "unsettled": per_half.where(F.col("unsettled").isNotNull() & F.col("h").isNotNull()).count()}
    if any(out.values()):
        log.error("rollup: broker %s: %d op record(s) name another half (their half property) than by their body "
                  "(taken for the body's), %d cannot be read (%d naming no half), %d half message(s) counted undecided "
                  "that such an op may have decided; the broker settles them at its next start (see its log)", broker,
                  out["misnamed"], out["unreadable"], out["unplaced"], out["unsettled"])
    return out


def _summary(parts, date: str | None) -> dict:
    """The run's summary: counts summed over the stores, every date any store has."""
    dates = sorted({d for p in parts for d in (p.wanted() if date else p.dates())})
    total = lambda key: sum(p.summary[key] for p in parts)  # noqa: E731
    return {"dates": dates, "records": total("records"), "segments": total("segments"),
            "segments_read": total("segments_read"), "bytes_read": total("bytes_read"),
            "incremental": all(p.summary["incremental"] for p in parts),
            "damage": [d for p in parts for d in p.summary["damage"]],
            "kept_corrupt": [d for p in parts for d in p.summary["kept_corrupt"]],
            "damaged_ops": {k: sum(p.summary["damaged_ops"][k] for p in parts) for k in DAMAGED_OPS},
            "snapshot_lines": total("snapshot_lines"), "bad_snapshot_lines": total("bad_snapshot_lines"),
            "incomplete_snapshot_lines": total("incomplete_snapshot_lines"),
            "duplicate_snapshot_lines": total("duplicate_snapshot_lines"),
            "early_snapshot_lines": total("early_snapshot_lines"),
            "brokers": [p.broker for p in parts], "rows": {}, "reports": [], "left_as_is": []}


class _StoreRollup:
    """One broker's store: its scan, snapshots and per-table queries (each with the broker column)."""

    def __init__(self, spark, broker: str, store_dir: str, out_dir: str, day, *, skip_damaged: bool,
                 check_crc: bool, chunk_bytes: int):
        self.spark, self.broker, self.day = spark, broker, day
        self.store_id = read_store_id(store_dir)
        self.scan = self.snaps = self.per_half = None
        date = day.isoformat() if day is not None else None
        self.since = baseline = select = None
        self.missed: list[str] = []
        if day is not None:
            self.since = int(dt.datetime(day.year, day.month, day.day, tzinfo=dt.timezone.utc).timestamp() * 1000)
            baseline = previous_undecided(spark, out_dir, date, broker)
            if baseline is None:
                # Rolled up alone, the days between stayed out of the tables and reports for good, nothing said.
                self.missed = missed_days(spark, out_dir, day, broker)
                if self.missed:
                    log.warning("rollup: %s of %s %s not rolled up under %s (nightly runs missed): rolling %s up "
                                "with %s, from the whole store", ", ".join(self.missed), broker,
                                "is" if len(self.missed) == 1 else "are", out_dir,
                                "it" if len(self.missed) == 1 else "them", date)
                else:
                    log.info("rollup: %s is not rolled up under %s for %s: reading the whole store for %s",
                             day - dt.timedelta(1), out_dir, broker, date)
                self.since = None
            elif self._began_since(store_dir):
                log.warning("rollup: %s's store begins on %s or later (its log starts at offset 0 with no "
                            "record before): the %s rows under %s are another store's (a new or wiped store); "
                            "reading the whole store for %s", broker, date, day - dt.timedelta(1), out_dir, date)
                self.since = baseline = None
            elif self.store_id is not None and (others := previous_stores(spark, out_dir, date, broker) - {
                    self.store_id}):
                # A store whose log neither starts at 0 nor begins on the day (another broker's, restored from a
                # backup, a mixed-up mount): its undecided count would have been the old store's, for good.
                log.warning("rollup: %s's %s rows under %s were rolled up from another store (%s; %s holds store "
                            "%s): not counted on; reading the whole store for %s", broker, day - dt.timedelta(1),
                            out_dir, ", ".join(sorted(others)), store_dir, self.store_id, date)
                self.since = baseline = None
            else:
                since = self.since
                select = lambda segs: segments_for_window(segs, store_dir, since, since + DAY)  # noqa: E731
        self.baseline = baseline
        self.scan = scan = scan_store(spark, store_dir, job="rollup", skip_damaged=skip_damaged,
                                      check_crc=check_crc, chunk_bytes=chunk_bytes, select=select)
        records = classify(scan.records)
        if self.since is not None:
            wanted = _decided_elsewhere(records) + half_offsets_by_queue(store_dir, _unmatched_bodies(records))
            extra = read_halves(spark, scan, wanted, skip_damaged=skip_damaged)
            if extra is not None:
                records = records.unionByName(classify(extra))
        self.per_half = half_summary(records).cache()
        damaged_ops = _damaged_ops(broker, records, self.per_half)
        self.snaps = load_snapshots(spark, store_dir, self.wanted(), job="rollup")
        self.whole_from = self.cut = None
        first = scan.segments[0] if scan.segments else None
        ts = seg_mod.first_store_ts(first) if first is not None else None      # read on the driver
        when = lambda ms: dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)  # noqa: E731
        if first is not None and first.base > 0:
            # Retention removed the segments before this one (or a slave's log began here). A day is cut
            # when a removed segment held records of it: the days up to that of the newest record
            # removed (the manifest's "removed" entry says which). The log is contiguous, so every later
            # day, records or none (a quiet weekend before the segment left), lies in the segments left.
            # Without that entry, the day of the first record left may have begun in them: days from the
            # next on are whole.
            gone = removed_before(store_dir, first)
            if gone is not None:
                self.whole_from = (when(gone["last_ts"]).date() + dt.timedelta(days=1)).isoformat()
                self.cut = (first.base, f"the newest record removed was stored {when(gone['last_ts']).isoformat()}")
            elif ts is not None:
                self.whole_from = (when(ts).date() + dt.timedelta(days=1)).isoformat()
                self.cut = (first.base, f"first record stored {when(ts).isoformat()}")
        self.snapshot_days = {os.path.basename(f)[:-len(".jsonl")] for f in snapshot_files(store_dir)}
        # A log from offset 0 holds everything the store ever had, and nothing before its first record
        # or snapshot file: in a run over several stores, or a --date before it, an earlier day is not
        # this store's to replace (a store wiped and begun anew under the same name: those rows are the
        # old store's). A store holding nothing yet has no first day: it replaces what a run asks.
        self.begins = None
        if first is None or first.base == 0:
            held = sorted(self.snapshot_days)[:1] + ([when(ts).date().isoformat()] if ts is not None else [])
            self.begins = min(held, default=None)
        self.summary = {"records": scan.record_count, "segments": len(scan.segments), "segments_read": len(scan.read),
                        "bytes_read": scan.bytes_read, "incremental": self.since is not None,
                        "damage": [{**d, "broker": broker} for d in scan.damage], "damaged_ops": damaged_ops,
                        "kept_corrupt": [{**d, "broker": broker} for d in scan.kept],
                        "snapshot_lines": self.snaps.lines, "bad_snapshot_lines": self.snaps.bad_lines,
                        "incomplete_snapshot_lines": self.snaps.incomplete_lines,
                        "duplicate_snapshot_lines": self.snaps.duplicate_lines,
                        "early_snapshot_lines": self.snaps.early_lines}

    def recheck_baseline(self, out_dir: str) -> None:
        """Read the previous day's undecided count again, under --out's lock. The first read (it chose the
        segments to read) came before the lock: another run may have rewritten that day since, and this
        day's count, and every later day's built on it, would rest on the old one for good."""
        if self.since is None:
            return
        date = self.day.isoformat()
        now = previous_undecided(self.spark, out_dir, date, self.broker)
        if now is None:
            raise ValueError(f"{self.day - dt.timedelta(1)}'s rows of {self.broker} went from {out_dir} while this "
                             f"run read the store for {date} (another run removed them): run it again")
        if self.store_id is not None and (others := previous_stores(self.spark, out_dir, date, self.broker) - {
                self.store_id}):
            # (the store check __init__ made, again: counted on, the other store's count was this one's for good)
            raise ValueError(f"{self.day - dt.timedelta(1)}'s rows of {self.broker} under {out_dir} were rewritten "
                             f"from another store ({', '.join(sorted(others))}) while this run read store "
                             f"{self.store_id} for {date}: run it again")
        if sorted(now) != sorted(self.baseline):
            log.warning("rollup: %s's undecided count of %s under %s changed while this run read the store "
                        "(another run rewrote that day): %s counts on from the new one", self.day - dt.timedelta(1),
                        self.broker, out_dir, date)
            self.baseline = now

    def _began_since(self, store_dir: str) -> bool:
        """Whether the store began on the day rolled up: its log starts at offset 0 (nothing removed) and
        holds no record before the day. The previous day's rows under --out were then made from
        another store of the same name, and their undecided count is not this store's."""
        segments = seg_mod.list_segments(store_dir)
        if not segments or segments[0].base != 0:
            return not segments
        first = seg_mod.first_store_ts(segments[0])
        return first is None or first >= self.since

    def wanted(self) -> list[str] | None:
        """The dates this store is rolled up for: the run's date and the days missed before it (None: every date)."""
        return None if self.day is None else [*self.missed, self.day.isoformat()]

    def dates(self) -> list[str]:
        """Every date from the store's first record or snapshot to its last: a day with neither in
        between (a quiet weekend) is rolled up too, with no traffic and its undecided count."""
        present = _dates_present(self.scan, self.snaps)
        if not present:
            return present
        lo, hi = dt.date.fromisoformat(present[0]), dt.date.fromisoformat(present[-1])
        return [(lo + dt.timedelta(days=k)).isoformat() for k in range((hi - lo).days + 1)]

    def owned(self, name: str, dates) -> set[str]:
        """The dates whose rows of table ``name`` this store can compute whole, so a run replaces them:
        for the commit-log tables the days after the newest record retention removed (see __init__); for the snapshot
        tables the days from its oldest snapshot file on; never a day before the store began. Other days
        keep what --out holds."""
        dates = [d for d in dates if self.begins is None or d >= self.begins]
        if self.day is not None:            # (another store's missed days: its rows stay as they are)
            dates = [d for d in dates if d in self.wanted()]
        if name in LOG_TABLES:
            return {d for d in dates if self.whole_from is None or d >= self.whole_from}
        if not self.snapshot_days:       # snapshots off (or never kept): nothing to lose, nothing to keep
            return set(dates)
        oldest = min(self.snapshot_days)    # the broker removes the oldest files first
        return {d for d in dates if d >= oldest}

    def not_whole(self, name: str, date: str) -> str:
        if self.begins is not None and date < self.begins:
            return (f"the store holds nothing before {self.begins} (its log starts at offset 0): a new or wiped "
                    "store under this name, or one that had not started; those rows are another store's")
        if name in LOG_TABLES:
            return (f"the store no longer holds the whole day (its log now starts at commit-log offset "
                    f"{self.cut[0]}, {self.cut[1]}: retention removed the segments before)")
        return (f"the store's metric snapshots now begin with {min(self.snapshot_days)}.jsonl (older files "
                "were removed: metrics_snapshot_retention_days)")

    def query(self, name: str, dates):
        if name == "traffic":
            df = traffic_table(self.scan.traffic, dates)
        elif name == "transactions":
            df = transactions_table(self.spark, self.per_half, dates, self.since, self.baseline)
        elif name == "consumer_lag":
            df = consumer_lag_table(self.snaps.rows, dates)
        else:
            df = broker_table(self.snaps.rows, dates)
        F = _F()
        return df.withColumn("broker", F.lit(self.broker)).withColumn("store_id", F.lit(self.store_id).cast("string"))

    def release(self) -> None:
        if self.per_half is not None:
            self.per_half.unpersist()
        if self.scan is not None:
            self.scan.release()
        if self.snaps is not None:
            self.snaps.release()
