"""The rollup on a real local SparkSession, over a store written by broker.store.

Scenario (UTC; D1 = 2024-03-09, D2 = 2024-03-10, D3 = 2024-03-11), all numbers by hand:

  D1 10:00   2 x Orders
  D1 00:30   half pg-b/Ship "old"            -> dead letter `expired` at D2 05:00
  D1 23:59:59 half pg-a/Pay "late"           -> COMMIT at D2 00:00:00.500 (latency 1500)
  D2 00:00   5 x Orders
  D2 01:00   3 x Orders, 2 x %RETRY%cg1, 1 x %DLQ%cg1
  D2 01:00+10k s  halves h0..h9 pg-a/Pay, decided after LAT[k] ms: even k COMMIT, odd k ROLLBACK
  D2 02:00   half pg-a h10: named by its sender's heartbeat at 02:00:30 (no check), checks at 02:01, 02:02,
            dead letter `max-checks` at 02:03
  D2 03:00   half pg-a h11: never decided
  D2 04:00   half pg-b/Ship, COMMIT after 250 ms
  D2 05:00   4 x Audit (1000-byte bodies); the D1 half goes to the dead letters (`expired`)
  D2 06:00   half pg-b/Ship: DEAD 06:10 (max-checks), RESUME 06:20, COMMIT 06:30
  D3 00:05   1 x Orders
"""
from __future__ import annotations

import json
import os
import shutil
from html.parser import HTMLParser

import pytest

from protocol.errors import StoreError
from tests.spark.storegen import StoreBuilder

pytestmark = pytest.mark.spark

H = 3_600_000
D1, D2, D3 = 1709942400000, 1710028800000, 1710115200000
LAT = [120, 340, 560, 780, 1000, 1500, 2250, 3000, 5000, 9000]


def build_store(d: str) -> dict:
    w = {}
    with StoreBuilder(d, segment_size=16 * 1024) as b:
        old = b.at(D1 + H // 2).half("pg-b", "Ship")
        for i in range(2):
            b.at(D1 + 10 * H + i).send("Orders")
        late = b.at(D1 + 24 * H - 1000).half("pg-a", "Pay")
        w["late_commit"] = b.at(D2 + 500).commit(late)
        w["h0"] = [b.at(D2 + i).send("Orders") for i in range(5)]
        w["h1"] = ([b.at(D2 + H + i).send("Orders") for i in range(3)]
                   + [b.at(D2 + H + 5 + i).send("%RETRY%cg1") for i in range(2)]
                   + [b.at(D2 + H + 9).send("%DLQ%cg1")])
        halves = [b.at(D2 + H + 10_000 * k).half("pg-a", "Pay") for k in range(10)]
        w["commits_h1"] = []
        for k, h in enumerate(halves):
            b.at(h.store_ts + LAT[k])
            if k % 2 == 0:
                w["commits_h1"] += b.commit(h)[:1]
            else:
                b.rollback(h)
        h10 = b.at(D2 + 2 * H).half("pg-a", "Pay")
        b.at(D2 + 2 * H + 30_000).sender(h10, "10.0.0.7@4242")      # not a check
        b.at(D2 + 2 * H + 60_000).check(h10, 1)
        b.at(D2 + 2 * H + 120_000).check(h10, 2)
        b.at(D2 + 2 * H + 180_000).dead(h10, "max-checks")
        b.at(D2 + 3 * H).half("pg-a", "Pay")
        h = b.at(D2 + 4 * H).half("pg-b", "Ship")
        w["ship_commit"] = b.at(D2 + 4 * H + 250).commit(h)[:1]
        w["h5"] = [b.at(D2 + 5 * H + i).send("Audit", b"a" * 1000) for i in range(4)]
        b.at(D2 + 5 * H + 10).dead(old, "expired")
        h = b.at(D2 + 6 * H).half("pg-b", "Ship")
        b.at(D2 + 6 * H + 600_000).dead(h, "max-checks")
        b.at(D2 + 6 * H + 1_200_000).resume(h)
        w["resumed_commit"] = b.at(D2 + 6 * H + 1_800_000).commit(h)[:1]
        b.at(D3 + 300_000).send("Orders")
    return w


def write_snapshots(d: str) -> None:
    os.makedirs(os.path.join(d, "metrics"), exist_ok=True)
    lines = [
        {"ts": D2 + 30_000, "connections": 5, "consumer_lag": [
            {"group": "cg1", "topic": "Orders", "queue_id": 0, "lag": 10},
            {"group": "cg1", "topic": "Orders", "queue_id": 1, "lag": 5},
            {"group": "cg2", "topic": "Audit", "queue_id": 0, "lag": 7}],
         "requests": {"SEND_MESSAGE": {"count": 3, "p50_ms": 0.4, "p99_ms": 2.0}}},
        {"ts": D2 + 90_000, "connections": 7, "consumer_lag": [
            {"group": "cg1", "topic": "Orders", "queue_id": 0, "lag": 4},
            {"group": "cg1", "topic": "Orders", "queue_id": 1, "lag": 0}]},
        {"ts": D2 + H + 30_000, "consumer_lag": [
            {"group": "cg1", "topic": "Orders", "queue_id": 0, "lag": 100}, {"group": 5}]},
    ]
    with open(os.path.join(d, "metrics", "2024-03-10.jsonl"), "w") as f:
        for obj in lines:
            f.write(json.dumps(obj) + "\n")
        f.write("not json\n{\"connections\": 3}\n[1, 2]\n")
    with open(os.path.join(d, "metrics", "2024-03-09.jsonl"), "w") as f:
        f.write(json.dumps({"ts": D2 - H, "connections": 1,
                            "consumer_lag": [{"group": "cg1", "topic": "Orders", "queue_id": 0, "lag": 999}]}) + "\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory, spark):
    from ops.spark.rollup import run_rollup

    base = tmp_path_factory.mktemp("rollup")
    store, out = str(base / "store"), str(base / "out")
    written = build_store(store)
    write_snapshots(store)
    summary = run_rollup(spark, store, out, date="2024-03-10")
    return {"store": store, "out": out, "written": written, "summary": summary, "base": base}


def read(spark, out, table, date="2024-03-10", **where):
    from pyspark.sql import functions as F

    # hour / start from Spark (UTC session zone); collected timestamps would be in local time
    df = (spark.read.parquet(os.path.join(out, table)).where(f"date = '{date}'")
          .withColumn("hour", F.hour("window_start"))
          .withColumn("start", F.date_format("window_start", "yyyy-MM-dd'T'HH:mm")))
    rows = [r.asDict() for r in df.collect()]
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def by_hour(rows):
    return {r["hour"]: r for r in rows if r["grain"] == "hour"}


def linear_percentile(values, p):
    """Hand computation: linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    rank = p * (len(s) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def test_transaction_counts_per_hour_and_day(spark, world):
    rows = read(spark, world["out"], "transactions", producer_group="*")
    hours = by_hour(rows)
    assert sorted(hours) == list(range(24))
    expect = {  # hour: (halves, commits, rollbacks, checks, dead_letters, undecided_at_end)
        0: (0, 1, 0, 0, 0, 1), 1: (10, 5, 5, 0, 0, 1), 2: (1, 0, 0, 2, 1, 1), 3: (1, 0, 0, 0, 0, 2),
        4: (1, 1, 0, 0, 0, 2), 5: (0, 0, 0, 0, 1, 1), 6: (1, 1, 0, 0, 1, 1)}
    cols = ("halves", "commits", "rollbacks", "checks", "dead_letters", "undecided_at_end")
    for hour in range(24):
        got = tuple(hours[hour][c] for c in cols)
        assert got == expect.get(hour, (0, 0, 0, 0, 0, 1)), hour
    (day,) = [r for r in rows if r["grain"] == "day"]
    assert tuple(day[c] for c in cols) == (14, 8, 5, 2, 3, 1)
    assert (day["dead_letters_expired"], day["dead_letters_max_checks"]) == (1, 2)
    assert day["start"] == "2024-03-10T00:00"

    pga = {r["grain"] + str(r["hour"]): r for r in read(spark, world["out"], "transactions",
                                                                      producer_group="pg-a")}
    assert (pga["day0"]["halves"], pga["day0"]["commits"], pga["day0"]["rollbacks"]) == (12, 6, 5)
    assert pga["day0"]["undecided_at_end"] == 1
    pgb = read(spark, world["out"], "transactions", producer_group="pg-b", grain="day")[0]
    assert (pgb["halves"], pgb["commits"], pgb["dead_letters"], pgb["undecided_at_end"]) == (2, 2, 2, 0)


def test_decision_latency_percentiles_match_a_hand_computation(spark, world):
    hour1 = by_hour(read(spark, world["out"], "transactions", producer_group="pg-a"))[1]
    # LAT sorted: p50 between 1000 and 1500; p95 rank 8.55 -> 5000 + .55 * 4000; p99 rank 8.91
    assert hour1["decided"] == 10
    assert (hour1["latency_p50_ms"], hour1["latency_p95_ms"], hour1["latency_p99_ms"],
            hour1["latency_max_ms"]) == pytest.approx((1250.0, 7200.0, 8640.0, 9000), abs=1e-6)
    day = read(spark, world["out"], "transactions", producer_group="*", grain="day")[0]
    every = LAT + [1500, 250, 1_800_000]
    assert day["decided"] == len(every)
    for p, col in ((0.5, "latency_p50_ms"), (0.95, "latency_p95_ms"), (0.99, "latency_p99_ms")):
        assert day[col] == pytest.approx(linear_percentile(every, p), abs=1e-9)
    assert day["latency_max_ms"] == 1_800_000


def test_traffic_by_topic_kind_and_group(spark, world):
    w = world["written"]
    rows = read(spark, world["out"], "traffic")
    hours = {}
    for r in rows:
        if r["grain"] == "hour":
            hours[r["hour"]] = hours.get(r["hour"], 0) + r["messages"]
    assert hours == {0: 6, 1: 11, 4: 1, 5: 4, 6: 1}
    day = {(r["topic"], r["topic_kind"], r["producer_group"]): r for r in rows if r["grain"] == "day"}
    assert set(day) == {("Orders", "normal", "-"), ("%RETRY%cg1", "retry", "-"), ("%DLQ%cg1", "dlq", "-"),
                        ("Pay", "normal", "pg-a"), ("Ship", "normal", "pg-b"), ("Audit", "normal", "-")}
    assert day[("Orders", "normal", "-")]["messages"] == 8
    assert day[("Pay", "normal", "pg-a")]["messages"] == 6
    pay = w["late_commit"][:1] + w["commits_h1"]
    assert day[("Pay", "normal", "pg-a")]["bytes"] == sum(s.size for s in pay)
    assert day[("Audit", "normal", "-")]["bytes"] == sum(s.size for s in w["h5"])
    assert day[("Audit", "normal", "-")]["body_bytes"] == 4000


def test_consumer_lag_and_snapshots(spark, world):
    lag = {(r["grain"], r["hour"], r["consumer_group"]): r
           for r in read(spark, world["out"], "consumer_lag")}
    assert set(lag) == {("hour", 0, "cg1"), ("hour", 1, "cg1"), ("hour", 0, "cg2"), ("day", 0, "cg1"),
                        ("day", 0, "cg2")}
    assert (lag[("hour", 0, "cg1")]["snapshots"], lag[("hour", 0, "cg1")]["lag_max"],
            lag[("hour", 0, "cg1")]["lag_avg"]) == (2, 15, 9.5)
    day = lag[("day", 0, "cg1")]
    assert (day["snapshots"], day["lag_max"]) == (3, 100)
    assert day["lag_avg"] == pytest.approx((15 + 4 + 100) / 3)
    assert (lag[("day", 0, "cg2")]["lag_max"], lag[("day", 0, "cg2")]["lag_avg"]) == (7, 7.0)
    broker = {r["grain"]: r for r in read(spark, world["out"], "broker") if r["grain"] == "day"}
    assert (broker["day"]["snapshots"], broker["day"]["connections_max"], broker["day"]["connections_avg"]) == (
        3, 7, 6.0)
    s = world["summary"]
    assert (s["bad_snapshot_lines"], s["incomplete_snapshot_lines"]) == (3, 1)


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.svgs, self.tags, self.text = [], set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag == "svg":
            self.svgs.append(dict(attrs).get("id"))

    def handle_data(self, data):
        self.text.append(data)


def test_report_html_and_csv(world):
    report = os.path.join(world["out"], "report", "txmq-2024-03-10")
    assert world["summary"]["reports"] == [report + ".html", report + ".csv"]
    with open(report + ".html", encoding="utf-8") as f:
        page = f.read()
    parser = _Page()
    parser.feed(page)
    assert parser.svgs == ["throughput", "outcomes", "latency"]
    assert {"rect", "polyline", "circle", "table"} <= parser.tags
    assert "script" not in parser.tags and "link" not in parser.tags
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    text = " ".join(parser.text)
    assert "2024-03-10" in text and "messages in" in text and "pg-a" in text and "cg1" in text
    assert "3 bad lines" in text
    assert "commits 01: 5" in page        # a bar's tooltip
    with open(report + ".csv") as f:
        lines = f.read().splitlines()
    assert lines[0].startswith("date,window,messages,bytes,halves,commits")
    assert len(lines) == 26
    day = dict(zip(lines[0].split(","), lines[-1].split(",")))
    assert (day["window"], day["messages"], day["halves"], day["commits"], day["rollbacks"]) == (
        "day", "23", "14", "8", "5")
    hour1 = dict(zip(lines[0].split(","), lines[2].split(",")))
    assert (hour1["window"], hour1["latency_p50_ms"], hour1["latency_p99_ms"]) == ("01:00", "1250", "8640")


def _partition_files(path):
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = os.stat(full).st_mtime_ns
    return out


def test_rerun_replaces_only_that_date(spark, world, tmp_path):
    from ops.spark.rollup import run_rollup

    out = str(tmp_path / "out")
    shutil.copytree(world["out"], out)                      # holds 2024-03-10
    # a stale partition for a date that has no lag rows must disappear when that date is rolled up
    shutil.copytree(os.path.join(out, "consumer_lag", "date=2024-03-10"),
                    os.path.join(out, "consumer_lag", "date=2024-03-11"))
    run_rollup(spark, world["store"], out, date="2024-03-09")
    run_rollup(spark, world["store"], out, date="2024-03-11")
    assert not os.path.exists(os.path.join(out, "consumer_lag", "date=2024-03-11"))
    assert sum(r["messages"] for r in read(spark, out, "traffic", date="2024-03-11", grain="day")) == 1
    assert sum(r["messages"] for r in read(spark, out, "traffic", date="2024-03-09", grain="day")) == 2
    d1 = read(spark, out, "transactions", date="2024-03-09", producer_group="*", grain="day")
    assert d1[0]["undecided_at_end"] == 2

    before_d1 = {t: _partition_files(os.path.join(out, t, "date=2024-03-09")) for t in ("traffic", "transactions")}
    before_d2 = {t: sorted(map(str, read(spark, out, t))) for t in ("traffic", "transactions", "consumer_lag")}
    d2_files = _partition_files(os.path.join(out, "traffic", "date=2024-03-10"))
    run_rollup(spark, world["store"], out, date="2024-03-10")
    assert _partition_files(os.path.join(out, "traffic", "date=2024-03-10")) != d2_files    # rewritten
    after_d1 = {t: _partition_files(os.path.join(out, t, "date=2024-03-09")) for t in ("traffic", "transactions")}
    assert after_d1 == before_d1                                                          # untouched
    assert {t: sorted(map(str, read(spark, out, t))) for t in before_d2} == before_d2     # same content
    assert sorted(n for n in os.listdir(os.path.join(out, "traffic")) if n.startswith("date=")) == [
        "date=2024-03-09", "date=2024-03-10", "date=2024-03-11"]


def test_empty_store(spark, tmp_path, caplog):
    from ops.spark.rollup import run_rollup

    store = str(tmp_path / "store")
    StoreBuilder(store).close()                  # a store the broker opened and never wrote to
    assert run_rollup(spark, store, str(tmp_path / "all"))["dates"] == []
    summary = run_rollup(spark, store, str(tmp_path / "out"), date="2024-03-10")
    assert summary["records"] == 0
    rows = read(spark, str(tmp_path / "out"), "transactions")
    assert len(rows) == 25 and all(r["halves"] == 0 and r["undecided_at_end"] == 0 for r in rows)
    with open(summary["reports"][1]) as f:
        assert f.read().splitlines()[-1].startswith("2024-03-10,day,0,0,0,0,0,0,0,0,0")
    with pytest.raises(StoreError, match=r"store directory .*missing does not exist on host \S+ \(the driver\)"):
        run_rollup(spark, str(tmp_path / "missing"), str(tmp_path / "out2"), date="2024-03-10")


def test_corrupt_segment_fails_clearly_or_is_skipped(spark, tmp_path):
    from ops.spark import segments as seg
    from ops.spark.rollup import run_rollup

    store = str(tmp_path / "store")
    with StoreBuilder(store, segment_size=8192) as b:
        for i in range(60):
            b.at(D2 + i * 1000).send("Orders", b"x" * 200)
        written = list(b.written)
    segments = seg.list_segments(store)
    victims = [w for w in written if segments[1].base <= w.offset < segments[2].base]
    victim = victims[2]
    pos = victim.offset - segments[1].base
    with open(segments[1].path, "r+b") as f:          # TOPICLENGTH now runs past the record
        f.seek(pos + 88 + len(victim.body))
        f.write(b"\x7f")
    with pytest.raises(StoreError) as err:
        run_rollup(spark, store, str(tmp_path / "out"), date="2024-03-10")
    assert err.value.segment == segments[1].path and err.value.position == pos
    assert f"{segments[1].path} at byte {pos}" in str(err.value) and "--skip-damaged" in str(err.value)
    assert not os.path.exists(tmp_path / "out")

    summary = run_rollup(spark, store, str(tmp_path / "out"), date="2024-03-10", skip_damaged=True)
    (damage,) = summary["damage"]
    assert (damage["file"], damage["position"], damage["skipped_bytes"]) == (
        segments[1].path, pos, segments[1].size - pos)
    lost = len(victims) - 2
    assert summary["records"] == len(written) - lost
    traffic = read(spark, str(tmp_path / "out"), "traffic", grain="day")
    assert traffic[0]["messages"] == len(written) - lost
    with open(summary["reports"][0]) as f:
        assert f"Damaged tail skipped: {segments[1].path} from byte {pos}" in f.read()


def test_without_a_date_every_day_is_rolled_up_and_each_step_logs_a_line(spark, world, tmp_path, caplog):
    from ops.spark.rollup import run_rollup

    with caplog.at_level("INFO", logger="ops.spark"):
        summary = run_rollup(spark, world["store"], str(tmp_path / "out"))
    assert summary["dates"] == ["2024-03-09", "2024-03-10", "2024-03-11"]
    assert len(summary["reports"]) == 6
    day2 = read(spark, str(tmp_path / "out"), "transactions", producer_group="*", grain="day")
    assert (day2[0]["halves"], day2[0]["undecided_at_end"]) == (14, 1)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("rollup: decoded ") and " records from " in line and " segments " in line
               for line in lines)
    for table in ("traffic", "transactions", "consumer_lag", "broker"):
        assert any(line.startswith(f"rollup: wrote {table} ") for line in lines)
    assert any(line.startswith("rollup: done in ") for line in lines)


def test_a_segment_missing_from_the_middle_of_the_log_fails_clearly_or_is_reported(spark, tmp_path):
    """The broker refuses to start on such a log; the jobs must not read it as a quieter day."""
    from ops.spark import segments as seg
    from ops.spark.rollup import run_rollup

    store = str(tmp_path / "store")
    with StoreBuilder(store, segment_size=8192) as b:
        for i in range(60):
            b.at(D2 + i * 1000).send("Orders", b"x" * 200)
        written = list(b.written)
    segments = seg.list_segments(store)
    os.unlink(segments[1].path)
    with pytest.raises(StoreError) as err:
        run_rollup(spark, store, str(tmp_path / "out"), date="2024-03-10")
    assert f"{segments[0].path} at byte 8192" in str(err.value) and "missing" in str(err.value)
    assert not os.path.exists(tmp_path / "out")

    summary = run_rollup(spark, store, str(tmp_path / "out"), date="2024-03-10", skip_damaged=True)
    (damage,) = summary["damage"]
    assert (damage["file"], damage["position"], damage["skipped_bytes"]) == (segments[0].path, 8192, 8192)
    assert summary["records"] == len([w for w in written if not segments[1].base <= w.offset < segments[2].base])
