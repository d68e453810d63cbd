"""The rollup across several brokers' stores: one set of tables with a broker column, one report."""
from __future__ import annotations

import csv
import os

import pytest

from ops.spark.cli import store_dirs
from protocol.errors import StoreError
from tests.spark.test_rollup import build_store, read, write_snapshots


@pytest.fixture(scope="module")
def two(tmp_path_factory, spark):
    from ops.spark.rollup import run_rollup

    base = tmp_path_factory.mktemp("cluster-rollup")
    root = base / "stores"
    for name in ("broker-a", "broker-b"):
        build_store(str(root / name))
        write_snapshots(str(root / name))
    single = run_rollup(spark, str(root / "broker-a"), str(base / "single"), date="2024-03-10")
    stores = store_dirs([], str(root))
    summary = run_rollup(spark, stores, str(base / "out"), date="2024-03-10")
    return {"out": str(base / "out"), "single": str(base / "single"), "summary": summary, "single_summary": single}


def test_store_root_finds_every_store_and_refuses_an_empty_one(tmp_path, two):
    (tmp_path / "not-a-store").mkdir()
    with pytest.raises(StoreError, match="holds no store"):
        store_dirs([], str(tmp_path))
    with pytest.raises(StoreError, match="--store-dir"):
        store_dirs([], None)


def test_tables_carry_the_broker_and_each_brokers_rows_are_its_own(spark, two):
    assert two["summary"]["brokers"] == ["broker-a", "broker-b"]
    assert two["summary"]["records"] == 2 * two["single_summary"]["records"]
    for table in ("traffic", "transactions", "consumer_lag", "broker"):
        single = read(spark, two["single"], table)
        rows = read(spark, two["out"], table)
        assert {r["broker"] for r in rows} == {"broker-a", "broker-b"}, table
        for name in ("broker-a", "broker-b"):     # the same store content (another store id): the same rows
            own = lambda r: {k: v for k, v in r.items() if k not in ("broker", "store_id")}  # noqa: E731
            mine = [own(r) for r in rows if r["broker"] == name]
            theirs = [own(r) for r in single]
            key = lambda r: sorted((k, str(v)) for k, v in r.items())  # noqa: E731
            assert sorted(mine, key=key) == sorted(theirs, key=key), (table, name)


def test_one_report_sums_the_brokers_and_lists_each(two):
    (html_path, csv_path) = two["summary"]["reports"]
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[-1] == "broker"
    assert len(rows) == 3 * 25               # across the brokers, then each broker: 24 hours and the day
    day = {r["broker"]: r for r in rows if r["window"] == "day"}
    assert set(day) == {"*", "broker-a", "broker-b"}
    for col in ("messages", "halves", "commits", "rollbacks"):
        assert int(day["*"][col]) == int(day["broker-a"][col]) + int(day["broker-b"][col]) > 0
    assert day["*"]["latency_max_ms"] == day["broker-a"]["latency_max_ms"]
    with open(html_path, encoding="utf-8") as f:
        page = f.read()
    assert "<h2>Brokers</h2>" in page and "broker-a" in page and "broker-b" in page
    assert os.path.dirname(html_path) == os.path.join(two["out"], "report")
