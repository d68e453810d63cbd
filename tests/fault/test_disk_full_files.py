"""A full disk at the store's small files: what a refused write leaves behind must not spoil the next one.

Each test fills a tiny tmpfs to the last page, lets one write of the file under test fail with
ENOSPC, frees the space and checks that the next write lands whole and readable. Mounting needs
root; elsewhere the tests are skipped and say why.
"""
from __future__ import annotations

import os

import pytest

from broker.metrics import append_snapshot
from ops.spark.snapshots import parse_line
from tests.support.tmpfs import tmpfs


@pytest.fixture
def tiny_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as mount:
        yield mount


def _fill(path) -> None:
    """Write zeros to ``path`` until the disk is full (a bound: the disk is 1 MiB)."""
    with open(path, "wb", buffering=0) as f:
        for _ in range(1024):
            try:
                f.write(bytes(4096))
            except OSError:
                return
    raise AssertionError("the disk never filled")


def _snapshot(ts: int) -> dict:
    return {"ts": ts, "connections": 1, "requests": {},
            "consumer_lag": [{"group": "G" * 40, "topic": "T", "queue_id": q, "lag": q} for q in range(24)]}


def test_a_snapshot_line_cut_by_a_full_disk_does_not_swallow_the_next_one(tiny_disk):
    """The line that did not fit was left torn in the file, and the next snapshot was appended to it: one bad
    line, and ops/spark dropped the good snapshot with the torn one."""
    store = str(tiny_disk / "store")
    path = append_snapshot(store, _snapshot(1_700_000_000_000))
    _fill(tiny_disk / "ballast")
    refused = 0
    for i in range(1, 100):         # the page the first line began holds a few more; the next line fails
        try:
            append_snapshot(store, _snapshot(1_700_000_000_000 + i))
        except OSError:
            refused = i
            break
    assert refused, "no snapshot was refused on a full disk"
    os.unlink(tiny_disk / "ballast")
    append_snapshot(store, _snapshot(1_700_000_000_999))
    with open(path, encoding="utf-8") as f:
        kinds = [parse_line(line)[0] for line in f.read().splitlines()]
    assert [k[0] for k in kinds] == ["snap"] * (refused + 1)
    assert kinds[-1][1] == 1_700_000_000_999
