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
        while not first_started.is_set():     # the first save under way (polled, bounded by the test)
            await asyncio.sleep(0.01)
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
async def test_sends_to_a_topic_made_moments_ago_wait_for_the_write_that_holds_it(tmp_path, monkeypatch):
    """made_durable: one gate for every send to a new topic, done only once topics.json holds the topic (a kill
    before that restored it from the store's queues, one where it had four); none once it is written."""
    tm = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=4, cluster="C", broker="B")
    tm.start_background(asyncio.get_running_loop())
    tm._write_scheduled = True      # no 100 ms batch: the gate's own write is the one held
    writes, first_started, release = _held_saves(monkeypatch, topics_module)
    try:
        tm.create(TopicConfig("Made", 4, 4))
        gate = tm.made_durable("Made")
        assert gate is not None and tm.made_durable("Made") is gate
        while not first_started.is_set():     # its write under way (polled, bounded by the test)
            await asyncio.sleep(0.01)
        assert not gate.done() and not (tmp_path / "topics.json").exists()
        release.set()
        await gate
        saved = {t["name"]: t for t in json.loads((tmp_path / "topics.json").read_text())["topics"]}
        assert saved["Made"]["write_queue_nums"] == 4
        assert tm.made_durable("Made") is None and tm.unsaved == {}
        tm.create(TopicConfig("Later", 1, 1))       # written by another write first: nothing to wait for
        await tm.saved()
        assert tm.made_durable("Later") is None and len(writes) == 2
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
        while not first_started.is_set():     # the first save under way (polled, bounded by the test)
            await asyncio.sleep(0.01)
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


def _counted_saves(monkeypatch, module) -> list:
    real_save, writes = module.save, []

    def save(path, data):
        writes.append(data)
        real_save(path, data)
    monkeypatch.setattr(module, "save", save)
    return writes


@bounded(20)
async def test_an_offsets_save_with_nothing_changed_writes_nothing(tmp_path, monkeypatch):
    """A reset that moves no offset, or a deleted topic no group consumed, forced a write of the whole table (100,000
    offsets: over a second of a core), and any client may send those codes without an ACL, back to back."""
    offsets = ConsumerOffsets(str(tmp_path))
    writes = _counted_saves(monkeypatch, offsets_module)
    offsets.commit("G", "T", 0, 5)
    await offsets.saved()
    assert len(writes) == 1
    offsets.commit("G", "T", 0, 5)      # the same offset: no change
    offsets.remove_topic("Other")       # nothing of it
    for _ in range(3):
        await offsets.saved()
    assert len(writes) == 1
    offsets.commit("G", "T", 0, 6)
    await offsets.saved()
    assert len(writes) == 2 and ConsumerOffsets(str(tmp_path)).get("G", "T", 0) == 6
    offsets.remove_group("G")
    await offsets.saved()
    assert len(writes) == 3 and not ConsumerOffsets(str(tmp_path)).has("G", "T", 0)


@bounded(20)
async def test_a_failed_offsets_save_is_written_by_the_next_caller(tmp_path, monkeypatch):
    """Nothing changed since, but the last write failed: ``saved`` writes again rather than say it is saved."""
    offsets = ConsumerOffsets(str(tmp_path))
    real_save, failing = offsets_module.save, [True]

    def save(path, data):
        if failing[0]:
            raise OSError(28, "No space left on device")
        real_save(path, data)
    monkeypatch.setattr(offsets_module, "save", save)
    offsets.commit("G", "T", 0, 7)
    with pytest.raises(OSError):
        await offsets.saved()
    failing[0] = False
    await offsets.saved()
    assert ConsumerOffsets(str(tmp_path)).get("G", "T", 0) == 7


@bounded(20)
async def test_a_topic_set_as_it_is_writes_no_catalogue(tmp_path, monkeypatch):
    """UPDATE_AND_CREATE_TOPIC repeating a topic's settings marked the catalogue changed, and each such request
    waited for a whole-catalogue write of its own: a client repeating one (no ACL needed) kept the config thread
    writing without pause. Routes still get a new data version, as RocketMQ registers them again."""
    tm = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=4, cluster="C", broker="B")
    tm.start_background(asyncio.get_running_loop())
    writes = _counted_saves(monkeypatch, topics_module)
    try:
        tm.create(TopicConfig("T", 4, 4, perm=6))
        await tm.saved()
        assert len(writes) == 1
        version = tm.data_version.counter
        for _ in range(3):
            tm.create(TopicConfig("T", 4, 4, perm=6))
            await tm.saved()
        assert len(writes) == 1 and tm.data_version.counter == version + 3
        tm.create(TopicConfig("T", 4, 4, perm=4))       # a change: written
        await tm.saved()
        assert len(writes) == 2 and '"perm": 4' in (tmp_path / "topics.json").read_text()
    finally:
        await tm.close()
