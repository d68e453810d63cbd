"""A full disk at the marks and metadata the newer features write beside the store: the write refused by
ENOSPC is said, tried again once there is room, and nothing it vouches for comes back wrong after a restart.

The store runs on its own tiny tmpfs, filled to the last page by a ballast file. Mounting needs root;
elsewhere the tests are skipped and say why.
"""
from __future__ import annotations

import logging
import os

import pytest

from broker.store import MessageStore, PutRequest, StoreConfig
from tests.support.bounded import bounded
from tests.support.tmpfs import tmpfs

CFG = StoreConfig(segment_size=1 << 20, cq_units_per_file=64)


@pytest.fixture
def tiny_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "4m") as mount:
        yield mount


def _fill(path) -> None:
    """Write zeros to ``path`` until the disk is full to the last page (a bound: the disk is 4 MiB)."""
    with open(path, "wb", buffering=0) as f:
        for _ in range(1024):
            try:
                f.write(bytes(4096))
            except OSError:
                return
    raise AssertionError("the disk never filled")


def _req(i: int) -> PutRequest:
    return PutRequest.build("T", bytes([i]) * 200, queue_id=0)


@bounded(30)
async def test_a_topic_deleted_on_a_full_disk_stays_deleted_after_a_restart(tiny_disk, caplog):
    """The deleted-topic mark did not fit; the delete went on (its queue files removed, which freed room) but
    the mark was never tried again: the next start indexed the topic's old records again and served them, with
    only an ERROR from the delete to say it might. Now the mark is written once the queue files are gone."""
    store_dir = str(tiny_disk / "store")
    store = MessageStore(store_dir, CFG)
    await store.open()
    assert all(r.ok for r in [await store.put(_req(i)) for i in range(100)])
    _fill(tiny_disk / "ballast")
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        assert await store.delete_topic("T") == 1
    assert any("mark written" in r.getMessage() and "No space" in r.getMessage() for r in caplog.records), \
        "the mark was not refused at first: the disk was not full"
    await store.close()
    os.unlink(tiny_disk / "ballast")
    store = MessageStore(store_dir, CFG)
    await store.open()
    try:
        assert ("T", 0) not in store.queues(), "the deleted topic's old records were indexed again"
    finally:
        await store.close()
