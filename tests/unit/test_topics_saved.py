"""TopicManager.saved: an operator's topic change is on disk before it is answered, and callers at once share
the writes (group commit) rather than queue one whole-catalogue write each."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from broker import topics as topics_module
from broker.topics import TopicConfig, TopicManager
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

BURST = 50


@bounded(20)
async def test_a_burst_of_changes_shares_its_catalogue_writes(tmp_path, monkeypatch):
    tm = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=4, cluster="C", broker="B")
    tm.start_background(asyncio.get_running_loop())
    tm._write_scheduled = True      # no 100 ms batch: on a slow machine it would write too, between the two
    real_save, writes, first_started, release = topics_module.save, [], threading.Event(), threading.Event()

    def save(path, data):           # the first write is held until the whole burst waits behind it
        writes.append(data)
        first_started.set()
        assert release.wait(10)
        real_save(path, data)
    monkeypatch.setattr(topics_module, "save", save)
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
