"""What a segment removal costs once the store holds months of history: thousands of segments and queues.

Counted in work done (units read, Python calls made), never timed: a removal's cost must not grow with
the history it leaves behind, or a retention pass over months of segments blocks the event loop.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import types

from broker.store import MessageStore, PutRequest, StoreConfig
from broker.store.consume_queue import ConsumeQueue
from broker.store.manifest import SegmentFacts, read_manifest, write_manifest
from tests.support.loop_turns import turns_while

QUEUES = 40
PER_QUEUE = 64


async def test_removing_a_segment_reads_one_unit_of_each_queue_it_does_not_touch(tmp_path, monkeypatch):
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=8192, max_message_size=8000))
    await store.open()
    first = await store.put(PutRequest.build("Old", b"o" * 7500))      # alone in the first segment
    assert first.ok
    for n in range(PER_QUEUE):
        res = await store.put_many([PutRequest.build(f"T{q}", b"x" * 20) for q in range(QUEUES)])
        assert all(r.ok for r in res)
    oldest = store.segments()[0]
    assert store.queue_unit("T0", 0, 0)[0] >= store.segments()[1].start_offset

    reads = []
    unit = ConsumeQueue.unit
    monkeypatch.setattr(ConsumeQueue, "unit", lambda self, off: reads.append(self.topic) or unit(self, off))
    await store.remove_segment(oldest.name, "test")
    # the queues the removal leaves alone: one read each, however long they are (the search read log2 of them)
    assert len([t for t in reads if t != "Old"]) <= QUEUES, len(reads)
    assert store.min_offset("Old", 0) == 1                   # ... and the one it emptied moved on
    for q in range(QUEUES):
        assert store.min_offset(f"T{q}", 0) == 0 and store.get_messages(f"T{q}", 0, 0, 1, 1 << 20).buffers
    await store.close()


def test_the_manifest_of_thousands_of_segments_is_written_in_a_few_calls_each(tmp_path):
    facts = [SegmentFacts(f"{i * 4096:020d}", i * 4096, i * 4096 + 4000, 7, 1_700_000_000_000 + i,
                          1_700_000_000_500 + i, i < 1999) for i in range(2000)]
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"
    sys.setprofile(count)
    try:
        write_manifest(str(tmp_path), "id-1", 5, facts, facts[0])
    finally:
        sys.setprofile(None)
    # asdict() recursed per field and indent= took json's pure-Python encoder: ~30 calls an entry
    assert calls < 4 * len(facts), calls
    expect = [{"name": f.name, "start": f.start, "end": f.end, "records": f.records, "first_ts": f.first_ts,
               "last_ts": f.last_ts, "sealed": f.sealed} for f in facts]
    assert read_manifest(str(tmp_path)) == {"store_id": "id-1", "written_ms": 5, "segments": expect,
                                            "removed": expect[0]}
    write_manifest(str(tmp_path), 'odd "id"', 6, [])
    assert json.loads((tmp_path / "segments.json").read_text()) == {"store_id": 'odd "id"', "written_ms": 6,
                                                                     "segments": []}


async def _server_with_offsets(tmp_path, n):
    """A broker (in process) with ``n`` consumer offsets, a few of them behind."""
    from broker.config import BrokerConfig
    from broker.server import BrokerServer

    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path / "s"), port=0, namesrv_port=0, metrics_port=-1,
                                       metrics_snapshot_interval_s=0))
    await server.start()
    ctx = server.ctx
    for q in range(4):
        res = await ctx.store.put_many([PutRequest.build("T", b"x", queue_id=q) for _ in range(5)])
        assert all(r.ok for r in res)
    for i in range(n):
        ctx.offsets.commit(f"g{i % 7}", "T" if i % 2 else "U", i, i % 3)     # distinct keys: n offsets
    return server


async def test_the_lag_of_many_consumer_offsets_is_summed_in_slices_the_loop_runs_between(tmp_path):
    # Months of consumer groups: tens of thousands of offsets. Summed in one go every second, they held the
    # loop for as long as that took; the gauge loop now yields between slices, and sums the same.
    from broker import server as server_mod

    server = await _server_with_offsets(tmp_path, 3 * server_mod.LAG_SLICE + 5)
    try:
        totals, turns = await turns_while(server._lag_in_slices(server.ctx.offsets.items()))
        assert turns >= 3                                        # a turn between each two of the 4 slices
        assert [sorted(rows) for rows in totals] == [sorted(rows) for rows in server._lag_by_group_topic()]
        assert sum(lag for _k, lag in totals[0]) > 0
    finally:
        await server.stop()


async def test_a_metric_snapshot_of_many_consumer_offsets_is_built_in_slices_and_written_off_the_loop(
        tmp_path, monkeypatch):
    # The minute snapshot (on by default) holds a row per consumer offset: built, encoded and appended in
    # one go, 32,000 of them held the loop 60-115 ms (found in review: the probe ran with snapshots off).
    from broker import metrics as metrics_mod
    from broker import server as server_mod

    server = await _server_with_offsets(tmp_path, 3 * server_mod.LAG_SLICE + 5)
    loop_thread, encoded = threading.get_ident(), []
    dumps = json.dumps

    def recording(obj, **kw):
        encoded.append((threading.get_ident(), len(obj) if isinstance(obj, list) else 0))
        return dumps(obj, **kw)
    monkeypatch.setattr(metrics_mod, "json", types.SimpleNamespace(dumps=recording))
    try:
        path, turns = await turns_while(server.write_snapshot(str(tmp_path / "s")))
        assert turns >= 3
        assert encoded and all(t != loop_thread and n <= metrics_mod._ROWS_A_CALL for t, n in encoded)
        monkeypatch.undo()
        with open(path) as f:
            rows = json.loads(f.readlines()[-1])["consumer_lag"]
        assert sorted((r["group"], r["topic"], r["queue_id"], r["lag"]) for r in rows) == sorted(server._lag())
    finally:
        await server.stop()


async def test_a_segment_whose_file_an_operator_deleted_is_still_removed(tmp_path):
    """The removal unlinks the segment's file before it leaves the log (an unlink that fails keeps it in): one
    already gone (an operator's rm under disk pressure) must not fail every retention pass from then on."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=8192, max_message_size=8000))
    await store.open()
    for _ in range(3):
        assert (await store.put(PutRequest.build("Old", b"o" * 7500))).ok
    oldest = store.segments()[0]
    os.unlink(os.path.join(store._log.directory, oldest.name))
    await store.remove_segment(oldest.name, "test")
    assert store.segments()[0].name != oldest.name and store.min_offset("Old", 0) == 1
    await store.close()
