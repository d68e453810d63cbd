"""TopicManager.saved and ConsumerOffsets.saved: an operator's change is on disk before it is answered, and
callers at once share the writes (group commit) rather than queue one whole-file write each."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from broker import topics as topics_module
from broker.store import offsets as offsets_module
from broker.store.offsets import ConsumerOffsets
from broker.topics import TopicConfig, TopicManager
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

BURST = 50


def _held_saves(monkeypatch, module):
    """``module``'s saves recorded, the first held until ``release`` is set (the burst then waits behind it)."""
    real_save, writes, first_started, release = module.save, [], threading.Event(), threading.Event()

    def save(path, data):
        writes.append(data)
        first_started.set()
        assert release.wait(10)
        real_save(path, data)
    monkeypatch.setattr(module, "save", save)
    return writes, first_started, release


@bounded(20)
async def test_a_burst_of_changes_shares_its_catalogue_writes(tmp_path, monkeypatch):
    tm = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=4, cluster="C", broker="B")
    tm.start_background(asyncio.get_running_loop())
    tm._write_scheduled = True      # no 100 ms batch: on a slow machine it would write too, between the two
    writes, first_started, release = _held_saves(monkeypatch, topics_module)
    try:
        tm.create(TopicConfig("T0", 1, 1))
        first = asyncio.ensure_future(tm.saved())
        await asyncio.to_thread(first_started.wait, 10)
        waiters = []
        for i in range(1, BURST):
            tm.create(TopicConfig(f"T{i}", 1, 1))
            waiters.append(asyncio.ensure_future(tm.saved()))
        release.set()
        await asyncio.gather(first, *waiters)
        assert len(writes) == 2         # the one running, then one with every change made meanwhile
        saved = {t["name"] for t in json.loads((tmp_path / "topics.json").read_text())["topics"]}
        assert {f"T{i}" for i in range(BURST)} <= saved
    finally:
        release.set()
        await tm.close()


@bounded(20)
async def test_a_burst_of_offset_resets_shares_its_writes(tmp_path, monkeypatch):
    offsets = ConsumerOffsets(str(tmp_path))
    writes, first_started, release = _held_saves(monkeypatch, offsets_module)
    try:
        offsets.commit("G", "T", 0, 0)
        first = asyncio.ensure_future(offsets.saved())
        await asyncio.to_thread(first_started.wait, 10)
        waiters = []
        for i in range(1, BURST):
            offsets.commit("G", "T", i, i)
            waiters.append(asyncio.ensure_future(offsets.saved()))
        release.set()
        await asyncio.gather(first, *waiters)
        assert len(writes) == 2
        assert ConsumerOffsets(str(tmp_path)).get("G", "T", BURST - 1) == BURST - 1
    finally:
        release.set()
