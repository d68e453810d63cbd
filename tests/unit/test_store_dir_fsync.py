"""New store files get their directory entry fsynced once, before anything relies on them.

A file (or directory) created but never synced into its parent can vanish at a power loss with every byte
in it, however well its own bytes were flushed. Consume-queue files used to be made without it (``durable_name
=False``): the checkpoint then said their units were durable, recovery trusted them, and a queue whose file
name was lost began late or had a hole. Same for index files (the saved progress skips their entries) and
decision-table files (the transaction snapshot relies on their bytes).

Each directory fsync here is recorded (path, thread) through the helpers the store calls; the real fsync
still runs.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest

import broker.store.checkpoint as checkpoint_mod
import broker.store.index as index_mod
import broker.store.mapped_file as mapped_file_mod
import broker.store.store as store_mod
import broker.transaction.decisions as decisions_mod
import broker.transaction.recovery as tx_recovery_mod
from broker.store import MessageStore, PutRequest, StoreConfig
from broker.store.index import IndexService
from broker.transaction.decisions import DecisionTable
from broker.transaction.records import COMMIT
from tests.support.bounded import bounded

CFG = StoreConfig(segment_size=1 << 20, cq_units_per_file=64, checkpoint_interval_ms=60_000)


@pytest.fixture
def synced(monkeypatch):
    """[(event, path, thread name)]: "dir" for each directory fsync, "checkpoint" for each checkpoint written."""
    events: list[tuple[str, str, str]] = []
    real_fsync_dir, real_write_checkpoint = mapped_file_mod.fsync_dir, store_mod.write_checkpoint

    def fsync_dir(path):
        events.append(("dir", os.path.abspath(path), threading.current_thread().name))
        real_fsync_dir(path)

    def write_checkpoint(store_dir, point):
        real_write_checkpoint(store_dir, point)
        events.append(("checkpoint", store_dir, threading.current_thread().name))

    for mod in (mapped_file_mod, store_mod, checkpoint_mod, index_mod, decisions_mod, tx_recovery_mod):
        monkeypatch.setattr(mod, "fsync_dir", fsync_dir, raising=False)     # (the fix added some of these)
    monkeypatch.setattr(store_mod, "write_checkpoint", write_checkpoint)
    return events


def req(topic: str, queue_id: int, i: int) -> PutRequest:
    return PutRequest.build(topic, b"m%d" % i, queue_id=queue_id)


def dir_syncs(events, root) -> list[str]:
    return [os.path.relpath(p, root) for kind, p, _ in events if kind == "dir" and p.startswith(root)]


@bounded(20)
async def test_each_new_queue_file_and_directory_is_synced_once_before_the_checkpoint(tmp_path, synced):
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    opened = len(synced)
    assert {os.path.abspath(tmp_path.parent), os.path.abspath(tmp_path)} <= {p for _, p, _ in synced[:opened]}
    results = await asyncio.gather(*[store.put(req("T", 0, i)) for i in range(200)],       # 4 files of 64
                                   *[store.put(req("T", 1, i)) for i in range(10)],
                                   *[store.put(req("U", 0, i)) for i in range(5)])
    assert all(r.ok for r in results)
    assert dir_syncs(synced, str(tmp_path / "consumequeue")) == []     # nothing on the loop, nothing per put
    await store.close()

    cq_root = str(tmp_path / "consumequeue")
    last_checkpoint = max(i for i, e in enumerate(synced) if e[0] == "checkpoint")
    before = [e for e in synced[:last_checkpoint] if e[0] == "dir" and e[1].startswith(cq_root)]
    done = dir_syncs(before, cq_root)
    # every directory that gained an entry: the root (two topics), each topic (its queues), each queue (its files)
    assert set(done) == {".", "T", "U", "T/0", "T/1", "U/0"}
    assert done.index(".") < done.index("T") < done.index("T/0")          # parents first
    assert all(thread != threading.main_thread().name for _, _, thread in before)  # the I/O thread, not the loop
    files = sum(len(os.listdir(tmp_path / "consumequeue" / q)) for q in ("T/0", "T/1", "U/0"))
    assert files == 6 and len(done) <= files + 3       # at most once a new file or directory, never per unit

    synced.clear()                      # more units into files that exist: no directory fsync at all
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert all(r.ok for r in await asyncio.gather(*[store.put(req("T", 0, i)) for i in range(200, 250)]))
    await store.close()
    assert dir_syncs(synced, cq_root) == []


@bounded(20)
async def test_a_queue_directory_removed_before_its_checkpoint_does_not_stop_checkpoints(tmp_path, synced):
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert (await store.put(req("Gone", 0, 0))).ok
    assert await store.delete_topic("Gone") == 1        # its directory was never synced and no longer exists
    assert (await store.put(req("T", 0, 0))).ok
    await store.close()
    assert synced[-1][0] == "checkpoint"
    assert "T/0" in dir_syncs(synced, str(tmp_path / "consumequeue"))


@bounded(20)
async def test_each_new_index_file_is_synced_into_its_directory(tmp_path, synced):
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=1 << 20))
    await store.open()
    svc = IndexService(str(tmp_path), segment_size=1 << 20, slots=16, entries=10)
    store.add_dispatch_listener(svc.on_dispatch)
    await svc.open(store.min_physical_offset, store.max_physical_offset)
    for i in range(40):     # 2 entries a record (UNIQ_KEY, one KEYS word): several files of 9
        assert (await store.put(PutRequest.build("T", b"x", properties={"KEYS": f"k{i}", "UNIQ_KEY": f"U{i}"}))).ok
    await svc.query("T", "k0", 1, 0, 2 ** 62)           # the index thread has taken every record
    files = len(svc.files)
    await svc.close()
    await store.close()
    index_syncs = dir_syncs(synced, str(tmp_path / "index"))
    assert files >= 5 and index_syncs.count(".") == files


def test_decision_files_are_synced_into_their_directory_before_a_snapshot_relies_on_them(tmp_path, synced):
    t = DecisionTable(str(tmp_path / "tx" / "decisions"), file_entries=8)
    assert dir_syncs(synced, str(tmp_path)) == [".", "tx"]     # the new directories, at start-up
    synced.clear()
    t.set(0, COMMIT)                    # made on the loop: no fsync here, the next snapshot syncs it
    assert synced == [] and t.files_made == 1 and t.files_synced == 0
    made = t.make(8)                    # made ahead on a thread: synced there
    t.adopt(8, made)
    assert dir_syncs(synced, str(tmp_path)) == ["tx/decisions"]
    synced.clear()
    tx_recovery_mod._write_files(str(tmp_path / "tx"), t.dirty(), tx_recovery_mod.encode_snapshot({"v": 1}, []),
                                 t.directory)
    assert dir_syncs(synced, str(tmp_path)) == ["tx/decisions", "tx"]     # the files' names, then the snapshot's
    assert json.loads((tmp_path / "tx" / "snapshot.json").read_text()).get("v") == 1
    t.close()


@bounded(30)
async def test_a_deleted_topics_mark_goes_only_once_the_segment_removal_below_it_is_synced(tmp_path, synced,
                                                                                          monkeypatch):
    """A deleted topic's mark hides its records still in the log from recovery. Retention removes it with the
    segment that held them: unlinked before that segment's unlink was synced into commitlog/, a power loss could
    keep the mark's removal and bring the segment back, and the next start indexed the deleted topic's records
    again (served to consumers of a topic made again under the name)."""
    real_unlink = os.unlink

    def unlink(path, *a, **kw):
        if os.path.basename(path) == "deleted":
            synced.append(("mark", os.path.abspath(path), threading.current_thread().name))
        real_unlink(path, *a, **kw)

    monkeypatch.setattr(store_mod.os, "unlink", unlink)
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    try:
        assert (await store.put(req("Gone", 0, 0))).ok
        assert await store.delete_topic("Gone") == 1
        assert (tmp_path / "consumequeue" / "Gone" / "deleted").exists()
        body = b"x" * 4000
        while len(await store.segment_facts()) < 2:
            assert (await store.put(PutRequest.build("Filler", body, queue_id=0))).ok
        await store._checkpoint()       # (the segment flushed: removable)
        synced.clear()
        await store.remove_segment((await store.segment_facts())[0].name, "plan")
        assert not (tmp_path / "consumequeue" / "Gone").exists()
        commitlog = os.path.abspath(tmp_path / "commitlog")
        order = [kind for kind, path, _ in synced if kind == "mark" or path == commitlog]
        assert order[:2] == ["dir", "mark"], order
    finally:
        await store.close()
