"""A start on a big store says how far it has got: consume queues loaded, segments recovered."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import threading

import pytest

from broker.store import MessageStore, PutRequest, StoreConfig
from broker.store import progress
from tests.support.bounded import bounded

CFG = StoreConfig(segment_size=64 * 1024, cq_units_per_file=64)
TOPICS = ("TA", "TB", "TC")


def _said(caplog, pattern: str) -> list[tuple[int, int]]:
    return [(int(m[1]), int(m[2])) for r in caplog.records if (m := re.search(pattern, r.getMessage()))]


@bounded(60)
async def test_a_start_says_how_many_queues_it_loaded_and_how_far_the_log_scan_has_got(tmp_path, caplog, monkeypatch):
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    reqs = [PutRequest.build(TOPICS[i % 3], b"x" * 2000, queue_id=i % 2) for i in range(120)]
    assert all(r.ok for r in await asyncio.gather(*[store.put(r) for r in reqs]))
    await store.close()
    os.remove(tmp_path / "checkpoint")          # no checkpoint: the whole log is scanned
    segments = len(os.listdir(tmp_path / "commitlog"))
    assert segments >= 4

    monkeypatch.setattr(progress, "EVERY_S", 0.0)       # every step said (its pace is the clock's)
    caplog.set_level(logging.INFO, logger="txmq.store")
    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    await store.close()

    assert report.records_scanned == 120
    assert _said(caplog, r"loading consume queues: (\d+) of (\d+) topics") == [(n, 3) for n in range(3)]
    assert _said(caplog, r"loaded (\d+) consume queues of (\d+) topics") == [(6, 3)]
    assert _said(caplog, r"recovering the commit log from offset 0: (\d+) of (\d+) segments") == [
        (n, segments) for n in range(segments)]


def test_progress_is_said_at_most_every_every_s(caplog):
    now = [0.0]
    caplog.set_level(logging.INFO, logger="txmq.store")
    p = progress.Progress("scanning", 13, "things", clock=lambda: now[0])
    for done in range(13):
        now[0] = float(done)
        p.step(done)
    assert [r.getMessage() for r in caplog.records] == ["scanning: 5 of 13 things (38%)",
                                                        "scanning: 10 of 13 things (76%)"]


@bounded(60)
async def test_transaction_recovery_from_the_whole_log_says_how_far_it_has_read(tmp_path, caplog, monkeypatch):
    from broker.transaction.records import COMMIT
    from tests.unit.test_review_transactions import Clock, add_half, make_service
    clock = Clock()
    ctx = await make_service(tmp_path, clock)
    halves = [await add_half(ctx, f"h{i}".encode()) for i in range(600)]
    for p in halves[:300]:
        await ctx.tx.decide(p.half_offset, COMMIT, group="PG")
    await ctx.store._store.close()            # a crash: no snapshot written
    os.remove(os.path.join(ctx.store.store_dir, "transactions", "snapshot.json"))

    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="txmq.transaction")
    ctx2 = await make_service(tmp_path, clock)
    try:
        assert len(ctx2.tx.pending) == 300 and "from the whole log" in caplog.text
        assert _said(caplog, r"reading RMQ_SYS_TRANS_HALF_TOPIC from queue offset 0: (\d+) of (\d+) records") == [
            (0, 600), (256, 600), (512, 600)]
        assert _said(caplog, r"reading RMQ_SYS_TRANS_OP_HALF_TOPIC from queue offset 0: (\d+) of (\d+) records") == [
            (0, 300), (256, 300)]
    finally:
        await ctx2.store._store.close()


@bounded(60)
async def test_a_store_whose_consume_queues_are_all_gone_rebuilds_them_from_the_whole_log(tmp_path, caplog):
    """consumequeue/ removed (RocketMQ's way to have them rebuilt, a restore without it) under a checkpoint:
    recovery scanned only past the checkpoint, so only queues with a record there came back; every other
    message was unreachable, its groups' offsets lowered to 0, without a word (2 of 1,565 queues, 22,354 of
    162,002 messages on a store of 397 segments)."""
    await _old_and_new(tmp_path)
    shutil.rmtree(tmp_path / "consumequeue")

    caplog.set_level(logging.WARNING, logger="txmq.store")
    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    try:
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == [30, 30, 100, 100]
        assert report.scanned_from == 0
        assert "consumequeue/ holds no queue" in caplog.text
    finally:
        await store.close()
    assert not (tmp_path / "checkpoint.rebuild").exists()
    caplog.clear()
    store = MessageStore(str(tmp_path), CFG)       # the next start is from the checkpoint the rebuild's stop wrote
    report = await store.open()
    try:
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == [30, 30, 100, 100]
        assert report.scanned_from > 0 and "consumequeue/ holds no queue" not in caplog.text
    finally:
        await store.close()


async def _old_and_new(tmp_path) -> None:
    """A closed store of two topics, OLD's records all below the segments a start verifies past the checkpoint."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    for topic, n in (("OLD", 60), ("NEW", 200)):
        assert all(r.ok for r in await asyncio.gather(*[
            store.put(PutRequest.build(topic, b"x" * 2000, queue_id=i % 2)) for i in range(n)]))
    await store.close()
    assert len(os.listdir(tmp_path / "commitlog")) > CFG.recovery_verify_segments + 2


@bounded(60)
async def test_a_power_loss_before_the_rebuilt_queues_are_checkpointed_rebuilds_them_again(tmp_path):
    """The start that rebuilds every queue from the whole log left the old checkpoint on disk until its first
    checkpoint: a power loss in between lost the new queue directories not yet fsynced (OLD's here) while the
    old checkpoint still vouched for everything below it, so the next start scanned from it and OLD, with no
    record past it, came back empty (0 of 30 per queue) with consumequeue/ no longer empty to say so."""
    await _old_and_new(tmp_path)
    shutil.rmtree(tmp_path / "consumequeue")
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    # the disk as a power loss right after that start leaves it: the checkpoint as it is now, OLD's new
    # directory entry (fsynced only by the first checkpoint) gone
    left = {name: (tmp_path / name).read_bytes() for name in ("checkpoint", "checkpoint.rebuild")
            if (tmp_path / name).exists()}
    await store.close()
    for name in ("checkpoint", "checkpoint.rebuild"):
        if name in left:
            (tmp_path / name).write_bytes(left[name])
        elif (tmp_path / name).exists():
            os.remove(tmp_path / name)
    shutil.rmtree(tmp_path / "consumequeue" / "OLD")

    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    try:
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == [30, 30, 100, 100]
    finally:
        await store.close()


@bounded(60)
async def test_a_consumequeue_holding_no_queue_but_empty_topic_dirs_is_rebuilt_from_the_whole_log_too(tmp_path, caplog):
    """The rebuild was taken only for a consumequeue/ with no entry at all: its queues removed but the topics'
    directories kept (``rm -rf consumequeue/*/*``, a restore that made them), or a stray file beside them, and the
    start scanned from the checkpoint as before: OLD came back empty (0 of 30 a queue) without a word."""
    await _old_and_new(tmp_path)
    for topic in ("OLD", "NEW"):
        shutil.rmtree(tmp_path / "consumequeue" / topic)
        os.mkdir(tmp_path / "consumequeue" / topic)
    (tmp_path / "consumequeue" / ".DS_Store").write_bytes(b"")

    caplog.set_level(logging.WARNING, logger="txmq.store")
    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    try:
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == [30, 30, 100, 100]
        assert report.scanned_from == 0 and "consumequeue/ holds no queue" in caplog.text
    finally:
        await store.close()


@bounded(60)
async def test_a_store_whose_topics_were_all_deleted_starts_from_its_checkpoint(tmp_path, caplog):
    """Its consumequeue/ holds the deleted topics' marks and no queue: nothing to rebuild, no whole-log scan."""
    await _old_and_new(tmp_path)
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    for topic in ("OLD", "NEW"):
        await store.delete_topic(topic)
    await store.close()

    caplog.set_level(logging.WARNING, logger="txmq.store")
    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    try:
        assert report.scanned_from > 0 and "consumequeue/ holds no queue" not in caplog.text
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == [0, 0, 0, 0]
    finally:
        await store.close()


@bounded(60)
async def test_an_empty_slave_rebased_past_zero_starts_from_its_checkpoint_without_a_rebuild_warning(tmp_path, caplog):
    """Its log begins at the checkpoint, it holds no queue: nothing below the checkpoint to rebuild, yet each start
    said the checkpoint vouched for the log below it and every queue was rebuilt, and removed the checkpoint."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    store.set_replica_only()
    await store.rebase_empty(3 * CFG.segment_size)
    await store.close()

    caplog.set_level(logging.WARNING, logger="txmq.store")
    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    try:
        assert "consumequeue/ holds no queue" not in caplog.text and (tmp_path / "checkpoint").exists()
        assert report.scanned_from == store.min_physical_offset == 3 * CFG.segment_size
    finally:
        await store.close()


@bounded(60)
async def test_a_rebuild_of_consumequeue_still_refuses_a_log_cut_below_the_checkpoint(tmp_path):
    """The rebuild dropped the checkpoint for recovery altogether: a log that ended below it (a restore that lost
    its last segment's tail beside a removed consumequeue/) was taken for a torn tail and cut, acknowledged
    records lost at a start that went on, where the checkpoint's rule refuses it (as with its queues in place)."""
    from protocol.errors import StoreError
    await _old_and_new(tmp_path)
    shutil.rmtree(tmp_path / "consumequeue")
    last = sorted(os.listdir(tmp_path / "commitlog"))[-1]
    os.truncate(tmp_path / "commitlog" / last, 8192)

    for _start in range(2):     # ...and again at the next try (the checkpoint was removed before the refusal)
        store = MessageStore(str(tmp_path), CFG)
        with pytest.raises(StoreError, match="checkpoint"):
            await store.open()


@bounded(60)
async def test_records_sent_during_the_index_catch_up_are_indexed_a_slice_a_job(tmp_path, monkeypatch):
    """Records dispatched while the index thread catches up at start (a removed index/, a long-stopped broker: many
    slices) wait in its deque, then were indexed in one job, however many: ~14 us a record, one of 700,000 (3 min of
    catch-up at 4,000 sends/s) passed STALLED_S, and a legitimate job was gauged as a hung disk
    (txmq_index_stalled_seconds, an ERROR), queries by key refused SYSTEM_ERROR and a stop gave the index up."""
    from broker.store import index as index_mod
    from broker.store.index import IndexService

    monkeypatch.setattr(index_mod, "BACKLOG_SLICE", 100, raising=False)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=1 << 22, max_message_size=2048))
    await store.open()
    svc = IndexService(str(tmp_path), segment_size=1 << 22, slots=1024, entries=10_000)
    batches = []
    index = svc._index
    svc._index = lambda batch: (batches.append(len(batch)), index(batch))
    answered, query = [], svc._query        # (what each query found, and whether it said partial: on the thread)
    svc._query = lambda *a: (r := query(*a), answered.append((bool(r[0]), svc.partial)))[0]
    store.add_dispatch_listener(svc.on_dispatch)
    await svc.open(store.min_physical_offset, store.max_physical_offset)
    try:
        held, go = threading.Event(), threading.Event()
        svc._catching_up = True         # (a catch-up still going: what is dispatched waits)
        svc._q.put(lambda: (held.set(), go.wait(20)))
        assert await asyncio.to_thread(held.wait, 5)
        got = await asyncio.gather(*[store.put(PutRequest.build("T", b"x", properties={"KEYS": f"k{i}"}))
                                     for i in range(1000)])
        last = got[-1]
        svc._q.put(lambda: setattr(svc, "_catching_up", False))     # the catch-up's end
        go.set()
        for _ in range(20):     # each query queued behind the slices left at the time (a query between them)
            found = (await svc.query("T", "k999", 8, 0, 2**62))[0]
            if found:
                break
        assert found == [last.physical_offset]
        assert all(hit or partial for hit, partial in answered), "a prefix of the backlog answered unsaid"
        assert sum(batches) == 1000 and max(batches) <= 100, batches
        assert not svc.partial
    finally:
        go.set()
        await svc.close()
        await store.close()


@bounded(60)
async def test_one_topics_removed_consume_queues_are_rebuilt_from_the_whole_log(tmp_path, caplog):
    """One topic's directory under consumequeue/ removed (an operator's way to have its queues rebuilt, a restore
    that missed it), its records all in segments below those a start verifies past the checkpoint: recovery
    scanned from the checkpoint, found none of them and the topic came back empty (0 of 30 a queue), its groups'
    offsets lowered to 0 and nothing said. Only a consumequeue/ with no queue at all was rebuilt."""
    await _old_and_new(tmp_path)
    shutil.rmtree(tmp_path / "consumequeue" / "OLD")

    caplog.set_level(logging.WARNING, logger="txmq.store")
    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    try:
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == [30, 30, 100, 100]
        assert report.queues_rebuilt == ["OLD-0", "OLD-1"] and "consume queues OLD-0, OLD-1 (2 in all" in caplog.text
    finally:
        await store.close()
    caplog.clear()
    store = MessageStore(str(tmp_path), CFG)       # the next start is a usual one, from the checkpoint
    report = await store.open()
    try:
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == [30, 30, 100, 100]
        assert report.scanned_from > 0 and not caplog.records
    finally:
        await store.close()


@bounded(60)
async def test_a_rebuild_whose_log_was_cut_under_truncate_corrupt_tail_and_killed_starts_again(tmp_path):
    """consumequeue/ removed and the log's last segment cut short below the checkpoint: a start with
    --truncate-corrupt-tail took the cut and rebuilt, but left checkpoint.rebuild vouching for the log past its
    new end (only a usual start's checkpoint was moved down to it). Killed before its first checkpoint (a kill -9
    during the long rebuild's start), each later start rebuilt again from checkpoint.rebuild and was refused,
    "acknowledged messages are missing", for the loss the operator had already accepted."""
    from dataclasses import replace
    await _old_and_new(tmp_path)
    shutil.rmtree(tmp_path / "consumequeue")
    last = sorted(os.listdir(tmp_path / "commitlog"))[-1]
    os.truncate(tmp_path / "commitlog" / last, 8192)

    store = MessageStore(str(tmp_path), replace(CFG, truncate_corrupt_tail=True))
    report = await store.open()
    # the disk as a kill -9 before its first checkpoint leaves it: no checkpoint yet, checkpoint.rebuild as it is
    rebuild = (tmp_path / "checkpoint.rebuild").read_bytes()
    kept = [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)]
    await store.close()
    os.remove(tmp_path / "checkpoint")
    (tmp_path / "checkpoint.rebuild").write_bytes(rebuild)

    store = MessageStore(str(tmp_path), CFG)         # without the flag: the cut is behind it
    again = await store.open()
    try:
        assert again.end_offset == report.end_offset and again.scanned_from == 0
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == kept
        assert kept[:2] == [30, 30] and 0 < kept[2] < 100
    finally:
        await store.close()


@bounded(60)
async def test_a_deleted_topic_leaves_the_queue_list_though_no_record_came_after_it(tmp_path, caplog):
    """The queue list is written with a checkpoint; one skipped because the log had not moved left a topic deleted
    with no send after it listed, and once retention had spent its mark, a start took its queues for removed
    directories and rebuilt every queue from the whole log (a slow start, a false WARNING)."""
    await _old_and_new(tmp_path)
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    await store._checkpoint()       # the periodic one, at the log's end: nothing after it moves the log
    await store.delete_topic("OLD")
    await store.close()
    assert "OLD 0" not in (tmp_path / "queues").read_text() and "NEW 0" in (tmp_path / "queues").read_text()
    shutil.rmtree(tmp_path / "consumequeue" / "OLD")        # (its mark spent, as retention leaves it)

    caplog.set_level(logging.WARNING, logger="txmq.store")
    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    try:
        assert report.scanned_from > 0 and not caplog.records
    finally:
        await store.close()


@bounded(60)
async def test_a_topic_deleted_and_made_again_has_its_removed_queue_rebuilt_from_the_whole_log(tmp_path, caplog):
    """A topic deleted, made again under its name (its mark still hides the old records from a rebuild), then a
    queue directory of it removed as a damage error advises, its records all below the segments a start verifies:
    the start skipped every queue of a topic with a mark as "deleted, not missing", so the queue came back empty
    (0 of 30), said nowhere. The queue list written after the delete names it: it is the topic made again."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert all(r.ok for r in await asyncio.gather(*[
        store.put(PutRequest.build("OLD", b"x" * 2000, queue_id=i % 2)) for i in range(20)]))
    await store.delete_topic("OLD")
    for topic, n in (("OLD", 60), ("NEW", 200)):
        assert all(r.ok for r in await asyncio.gather(*[
            store.put(PutRequest.build(topic, b"x" * 2000, queue_id=i % 2)) for i in range(n)]))
    await store.close()
    assert len(os.listdir(tmp_path / "commitlog")) > CFG.recovery_verify_segments + 2
    assert (tmp_path / "consumequeue" / "OLD" / "deleted").exists()
    shutil.rmtree(tmp_path / "consumequeue" / "OLD" / "0")

    caplog.set_level(logging.WARNING, logger="txmq.store")
    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    try:
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == [30, 30, 100, 100]
        assert report.queues_rebuilt == ["OLD-0"] and "consume queues OLD-0 (1 in all" in caplog.text
    finally:
        await store.close()



@bounded(60)
async def test_a_delete_killed_before_the_next_checkpoint_does_not_rebuild_its_queues(tmp_path, caplog):
    """A topic deleted and the broker killed before the checkpoint that writes the queue list again: the list still
    names the deleted queues, their directories gone with the delete. Not missing: no WARNING, no whole-log scan."""
    await _old_and_new(tmp_path)
    kept = (tmp_path / "queues").read_text()
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    await store.delete_topic("OLD")
    await store.close()
    (tmp_path / "queues").write_text(kept)         # as a kill -9 before the checkpoint leaves it

    caplog.set_level(logging.WARNING, logger="txmq.store")
    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    try:
        assert [store.max_offset(t, q) for t in ("OLD", "NEW") for q in (0, 1)] == [0, 0, 100, 100]
        assert report.scanned_from > 0 and not report.queues_rebuilt and not caplog.records
    finally:
        await store.close()


@bounded(60)
async def test_a_removed_queue_whose_records_retention_took_is_rebuilt_once_not_at_every_start(tmp_path, caplog):
    """A listed queue whose directory is gone is rebuilt from the whole log. One whose every record retention has
    removed (a restore that missed it, an operator's rm) finds nothing there: rebuilt with no file, the queue list
    still named it, and every later start took it for a removed directory again, rebuilding every queue from the
    whole log (a slow start each time, the same WARNING) until the list changed for another reason."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert all(r.ok for r in await asyncio.gather(*[
        store.put(PutRequest.build("GONE", b"x" * 2000, queue_id=0)) for _ in range(10)]))
    assert all(r.ok for r in await asyncio.gather(*[
        store.put(PutRequest.build("NEW", b"x" * 2000, queue_id=i % 2)) for i in range(200)]))
    first = sorted(os.listdir(tmp_path / "commitlog"))[0]
    await store.remove_segment(first, "test")       # every record of GONE went with it
    await store.close()
    shutil.rmtree(tmp_path / "consumequeue" / "GONE")

    store = MessageStore(str(tmp_path), CFG)
    report = await store.open()
    await store.close()
    assert report.queues_rebuilt == ["GONE-0"], report
    caplog.set_level(logging.WARNING, logger="txmq.store")
    caplog.clear()
    store = MessageStore(str(tmp_path), CFG)       # the next start is a usual one, from the checkpoint
    report = await store.open()
    try:
        assert not report.queues_rebuilt, report
        assert "missing from consumequeue" not in caplog.text
    finally:
        await store.close()
