"""MessageStore: appends, roll-over, reads, statuses, flush modes, retention hooks (tmp dirs, ~1 MiB segments)."""
from __future__ import annotations

import asyncio
import os

import pytest

from broker.store import (DispatchInfo, GetStatus, MessageStore, PutRequest, PutStatus, StoreConfig)
from protocol.codes import SysFlag
from protocol.errors import ConfigError, StoreError
from protocol.message import BLANK_MAGIC, decode_record, java_string_hash, peek_record
from tests.support.bounded import bounded
from tests.support.store_faults import no_descriptor_for

SEG = 1 << 20
CFG = StoreConfig(segment_size=SEG, cq_units_per_file=100, checkpoint_interval_ms=20)




class Clock:
    def __init__(self, now: int = 1_000_000):
        self.now = now

    def __call__(self) -> int:
        return self.now


def req(topic="T", body=b"hello", queue_id=0, tags=None, sys_flag=0, props=None, prepared=0):
    p = dict(props or {})
    if tags:
        p["TAGS"] = tags
    return PutRequest.build(topic, body, queue_id=queue_id, properties=p, sys_flag=sys_flag,
                            prepared_offset=prepared, born_timestamp=123)


async def opened(path, cfg=CFG, clock=None, listeners=()):
    store = MessageStore(str(path), cfg, clock=clock)
    for fn in listeners:
        store.add_dispatch_listener(fn)
    await store.open()
    return store


def decode(view):
    msg, size = decode_record(bytes(view), check_crc=True)
    assert size == len(view)
    return msg


# ------------------------------------------------------------------ appends
@bounded()
async def test_put_assigns_offsets_and_patches_the_record(tmp_path):
    clock = Clock(5_000)
    store = await opened(tmp_path, clock=clock)
    r1 = await store.put(req(body=b"a" * 10, tags="x"))
    clock.now = 6_000
    r2 = await store.put(req(body=b"b" * 10))
    assert r1.ok and r2.ok
    assert (r1.physical_offset, r1.queue_offset, r1.store_timestamp) == (0, 0, 5_000)
    assert (r2.physical_offset, r2.queue_offset, r2.store_timestamp) == (r1.size, 1, 6_000)
    msg = decode(store.get_record(r2.physical_offset))
    assert (msg.physical_offset, msg.queue_offset, msg.store_timestamp, msg.body) == (r1.size, 1, 6_000, b"b" * 10)
    assert store.max_offset("T", 0) == 2 and store.min_offset("T", 0) == 0
    await store.close()


@bounded()
async def test_queue_offsets_are_per_topic_and_queue(tmp_path):
    store = await opened(tmp_path)
    results = await asyncio.gather(*[store.put(req(topic=f"T{i % 2}", queue_id=i % 3)) for i in range(12)])
    seen: dict = {}
    for i, r in enumerate(results):
        key = (f"T{i % 2}", i % 3)
        assert r.queue_offset == seen.get(key, 0)
        seen[key] = r.queue_offset + 1
    for (topic, qid), n in seen.items():
        assert store.max_offset(topic, qid) == n
    await store.close()


@bounded()
async def test_prepared_and_rollback_records_get_no_queue_unit(tmp_path):
    store = await opened(tmp_path)
    half = await store.put(req(sys_flag=SysFlag.TRANSACTION_PREPARED))
    rolled = await store.put(req(sys_flag=SysFlag.TRANSACTION_ROLLBACK))
    committed = await store.put(req(sys_flag=SysFlag.TRANSACTION_COMMIT, prepared=half.physical_offset))
    assert half.ok and rolled.ok and committed.ok
    assert half.queue_offset == -1 and rolled.queue_offset == -1 and committed.queue_offset == 0
    assert decode(store.get_record(half.physical_offset)).queue_offset == 0
    assert store.max_offset("T", 0) == 1
    await store.close()


@bounded()
async def test_roll_over_writes_an_end_marker_and_reads_cross_segments(tmp_path):
    store = await opened(tmp_path)
    body = os.urandom(3000)
    results = await asyncio.gather(*[store.put(req(body=body, queue_id=0)) for _ in range(1200)])
    assert all(r.ok for r in results)
    segs = store.segments()
    assert len(segs) >= 3
    assert [s.start_offset for s in segs] == [i * SEG for i in range(len(segs))]
    assert all(s.sealed for s in segs[:-1]) and not segs[-1].sealed
    for s in segs[:-1]:
        with open(s.path, "rb") as f:
            data = f.read()
        size, magic = peek_record(data, s.written)
        assert magic == BLANK_MAGIC and size == SEG - s.written
    for r in results:       # no record straddles a segment
        assert r.physical_offset // SEG == (r.physical_offset + r.size - 1) // SEG
    offset, seen = 0, 0
    while True:
        got = store.get_messages("T", 0, offset, 32, 1 << 30)
        if got.status is not GetStatus.FOUND:
            assert got.status is GetStatus.OFFSET_OVERFLOW_ONE
            break
        for view in got.buffers:
            msg = decode(view)
            assert msg.queue_offset == seen and msg.body == body
            seen += 1
        offset = got.next_begin_offset
    assert seen == 1200
    await store.close()


@bounded()
async def test_put_many_is_contiguous_and_stays_in_one_segment(tmp_path):
    store = await opened(tmp_path)
    filler = await asyncio.gather(*[store.put(req(body=b"f" * 1000)) for _ in range(950)])
    assert filler[-1].physical_offset < SEG      # the active segment is nearly full
    batch = [req(topic="A", body=b"x" * 20_000), req(topic="B", body=b"y" * 20_000)]
    results = await store.put_many(batch)
    assert [r.status for r in results] == [PutStatus.PUT_OK] * 2
    assert results[1].physical_offset == results[0].physical_offset + results[0].size
    assert results[0].physical_offset // SEG == results[1].physical_offset // SEG
    assert await store.put_many([]) == []
    await store.close()


@bounded()
async def test_put_many_rejects_all_if_one_is_illegal(tmp_path):
    store = await opened(tmp_path)
    bad = req()
    bad.record[4] ^= 0xFF       # magic
    results = await store.put_many([req(), bad])
    assert [r.status for r in results] == [PutStatus.MESSAGE_ILLEGAL] * 2
    assert store.max_offset("T", 0) == 0
    await store.close()


@bounded()
async def test_oversized_and_malformed_records_are_illegal(tmp_path):
    cfg = StoreConfig(segment_size=SEG, max_message_size=4096)
    store = await opened(tmp_path, cfg)
    assert (await store.put(req(body=b"x" * 5000))).status is PutStatus.MESSAGE_ILLEGAL
    huge = await opened(tmp_path / "b", StoreConfig(segment_size=SEG))   # limit = segment size - 8
    assert (await huge.put(req(body=b"x" * SEG))).status is PutStatus.MESSAGE_ILLEGAL
    short = req()
    short.record = short.record[:50]
    wrong_size = req()
    wrong_size.record[3] ^= 1
    wrong_queue = req(queue_id=1)
    wrong_queue.queue_id = 2
    bad_topic = req(topic="bad/topic")
    for r in (short, wrong_size, wrong_queue, bad_topic):
        assert (await store.put(r)).status is PutStatus.MESSAGE_ILLEGAL
    assert (await store.put(req(body=b"x" * 3000))).ok
    assert store.max_offset("T", 0) == 1
    await store.close()
    await huge.close()


@bounded()
async def test_put_accepts_bytes_records(tmp_path):
    store = await opened(tmp_path)
    r = req()
    r.record = bytes(r.record)
    res = await store.put(r)
    assert res.ok and decode(store.get_record(res.physical_offset)).body == b"hello"
    await store.close()


@bounded()
async def test_async_flush_mode(tmp_path):
    cfg = StoreConfig(segment_size=SEG, flush="async", flush_interval_ms=10, checkpoint_interval_ms=10)
    store = await opened(tmp_path, cfg)
    results = await asyncio.gather(*[store.put(req(body=b"z" * 100)) for _ in range(500)])
    assert all(r.ok for r in results)
    assert store.get_record(results[-1].physical_offset) is not None   # readable before any flush
    end = results[-1].physical_offset + results[-1].size
    while store.flushed_offset < end:       # the timer flushes without further puts
        await asyncio.sleep(0.005)
    await store.close()
    store = await opened(tmp_path, cfg)
    assert store.max_offset("T", 0) == 500
    await store.close()


@bounded()
async def test_sync_flush_makes_data_durable_before_the_put_resolves(tmp_path):
    store = await opened(tmp_path)
    res = await store.put(req())
    assert store.flushed_offset >= res.physical_offset + res.size
    assert store.max_physical_offset >= res.physical_offset + res.size
    await store.close()


@bounded()
async def test_reopen_reads_everything_back(tmp_path):
    clock = Clock()
    store = await opened(tmp_path, clock=clock)
    sent = []
    for i in range(300):
        clock.now += 1
        sent.append((await store.put(req(body=os.urandom(2000), queue_id=i % 2, tags=f"t{i % 3}"))))
    await store.close()
    store = await opened(tmp_path, clock=clock)
    for i, r in enumerate(sent):
        msg = decode(store.get_record(r.physical_offset))
        assert msg.queue_offset == r.queue_offset and msg.queue_id == i % 2 and msg.tags == f"t{i % 3}"
    assert store.max_offset("T", 0) == 150 and store.max_offset("T", 1) == 150
    r = await store.put(req(queue_id=1))
    assert r.queue_offset == 150 and r.physical_offset == sent[-1].physical_offset + sent[-1].size
    await store.close()


@bounded()
async def test_closed_store_refuses_puts_and_a_second_open_of_the_dir_fails(tmp_path):
    store = await opened(tmp_path)
    with pytest.raises(StoreError, match="in use"):
        await opened(tmp_path)
    await store.close()
    assert not store.writable


# -------------------------------------------------------------------- reads
@bounded()
async def test_get_messages_statuses(tmp_path):
    store = await opened(tmp_path)
    got = store.get_messages("NOPE", 0, 0, 32, 1 << 20)
    assert (got.status, got.next_begin_offset, got.min_offset, got.max_offset) == (
        GetStatus.NO_MATCHED_LOGIC_QUEUE, 0, 0, 0)
    for _ in range(10):
        await store.put(req())
    cases = {
        0: (GetStatus.FOUND, 10),
        10: (GetStatus.OFFSET_OVERFLOW_ONE, 10),
        11: (GetStatus.OFFSET_OVERFLOW_BADLY, 10),
        -1: (GetStatus.OFFSET_TOO_SMALL, 0),
    }
    for offset, (status, nxt) in cases.items():
        got = store.get_messages("T", 0, offset, 32, 1 << 20)
        assert (got.status, got.next_begin_offset, got.min_offset, got.max_offset) == (status, nxt, 0, 10)
    await store.close()


@bounded()
async def test_batch_limits_and_the_first_record_always_fits(tmp_path):
    store = await opened(tmp_path)
    results = [await store.put(req(body=b"x" * 1000)) for _ in range(20)]
    size = results[0].size
    got = store.get_messages("T", 0, 0, 5, 1 << 20)
    assert got.message_count == 5 and got.next_begin_offset == 5
    got = store.get_messages("T", 0, 3, 32, size * 3 + 10)
    assert got.message_count == 3 and got.next_begin_offset == 6 and got.buffer_total_size == 3 * size
    got = store.get_messages("T", 0, 0, 32, 1)
    assert got.message_count == 1 and got.status is GetStatus.FOUND
    assert all(isinstance(b, memoryview) for b in got.buffers)
    await store.close()


@bounded()
async def test_tag_filter_runs_on_queue_units(tmp_path):
    store = await opened(tmp_path)
    for i in range(10):
        await store.put(req(tags="a" if i % 2 else "b", body=bytes([i])))
    want = java_string_hash("a")
    got = store.get_messages("T", 0, 0, 32, 1 << 20, lambda code: code == want)
    assert [decode(b).body for b in got.buffers] == [bytes([i]) for i in range(1, 10, 2)]
    assert got.next_begin_offset == 10
    got = store.get_messages("T", 0, 0, 32, 1 << 20, lambda code: False)
    assert (got.status, got.next_begin_offset, got.message_count) == (GetStatus.NO_MATCHED_MESSAGE, 10, 0)
    await store.close()


@bounded()
async def test_get_record_survives_bogus_offsets(tmp_path):
    store = await opened(tmp_path)
    results = await asyncio.gather(*[store.put(req(body=b"q" * 5000)) for _ in range(250)])
    seg0 = store.segments()[0]
    bogus = [-1, -(1 << 62), 1, 7, results[0].size - 1, results[3].physical_offset + 13, seg0.written,
             seg0.written + 4, SEG - 8, SEG - 1, store.max_physical_offset, store.max_physical_offset + 1,
             10 * SEG, 1 << 62, 2 ** 80]
    for offset in bogus:
        assert store.get_record(offset) is None, offset
    for r in results[::50]:
        assert decode(store.get_record(r.physical_offset)).physical_offset == r.physical_offset
    await store.close()


@bounded()
async def test_unflushed_records_are_invisible(tmp_path):
    store = await opened(tmp_path)
    fut = store.put(req())
    await asyncio.sleep(0)      # queued or written, not yet flushed
    assert store.get_record(0) is None
    assert store.get_messages("T", 0, 0, 1, 1 << 20).status is GetStatus.NO_MATCHED_LOGIC_QUEUE
    assert (await fut).ok and store.get_record(0) is not None
    await store.close()


@bounded()
async def test_search_offset_by_time(tmp_path):
    clock = Clock()
    store = await opened(tmp_path, clock=clock)
    assert store.search_offset_by_time("T", 0, 5) == 0
    assert store.earliest_store_time("T", 0) == -1
    for ts in (100, 200, 200, 300, 400):
        clock.now = ts
        await store.put(req())
    cases = {200: 1, 100: 0, 400: 4, 50: 0, 10_000: 4, 249: 2, 251: 3, 250: 2, 340: 3, 360: 4}
    for ts, want in cases.items():
        assert store.search_offset_by_time("T", 0, ts) == want, ts
    assert store.earliest_store_time("T", 0) == 100
    await store.close()


@bounded()
async def test_search_offset_by_time_of_a_queue_retention_emptied_is_its_end(tmp_path):
    # Answered 0, below the queue's start: a reset by time (resetOffsetByTime) committed it, and the group showed
    # the queue's whole length as its lag until a consumer pulled and was moved; a new consumer starting from a
    # timestamp was moved too, after a wasted pull. Every message at or after any time would be at the end.
    clock = Clock(1000)
    store = await opened(tmp_path, StoreConfig(segment_size=SEG, cq_units_per_file=100), clock=clock)
    for i in range(400):
        clock.now = 1000 + i
        await store.put(req("Old" if i < 10 else "Other", body=b"r" * 3000))
    await store.remove_segment(store.segments()[0].name)
    assert store.min_offset("Old", 0) == store.max_offset("Old", 0) == 10
    for ts in (0, 1005, 10_000):
        assert store.search_offset_by_time("Old", 0, ts) == 10, ts
    assert store.search_offset_by_time("Never", 0, 1005) == 0
    await store.close()


# --------------------------------------------------------------- dispatch
@bounded()
async def test_dispatch_happens_before_the_put_resolves(tmp_path):
    seen: list[DispatchInfo] = []
    store = await opened(tmp_path, listeners=[seen.append])
    half = await store.put(req(sys_flag=SysFlag.TRANSACTION_PREPARED))
    assert len(seen) == 1 and seen[0].queue_offset == -1
    res = await store.put(req(tags="t", sys_flag=SysFlag.TRANSACTION_COMMIT, prepared=half.physical_offset))
    info = seen[-1]
    assert (info.topic, info.queue_id, info.queue_offset, info.physical_offset, info.size) == (
        "T", 0, 0, res.physical_offset, res.size)
    assert info.tags_code == java_string_hash("t") and info.prepared_offset == half.physical_offset
    assert info.store_timestamp == res.store_timestamp and not info.recovering
    await store.close()


@bounded()
async def test_a_failing_listener_does_not_stop_the_store(tmp_path):
    def boom(info):
        raise RuntimeError("listener bug")
    store = await opened(tmp_path, listeners=[boom])
    assert (await store.put(req())).ok
    await store.close()


@bounded()
async def test_recovery_replays_to_listeners_from_the_checkpoint(tmp_path):
    store = await opened(tmp_path)
    for _ in range(5):
        await store.put(req())
    await store.close()
    seen: list[DispatchInfo] = []
    store = await opened(tmp_path, listeners=[seen.append])
    assert seen == []           # a clean close checkpoints everything
    await store.close()
    os.unlink(tmp_path / "checkpoint")
    store = await opened(tmp_path, listeners=[seen.append])
    assert [i.queue_offset for i in seen] == [0, 1, 2, 3, 4] and all(i.recovering for i in seen)
    await store.close()


# --------------------------------------------------------------- retention
@bounded()
async def test_segments_and_remove_segment(tmp_path):
    clock = Clock(1000)
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=100, flush="async", flush_interval_ms=5)
    store = await opened(tmp_path, cfg, clock=clock)    # async: removal must flush first
    results = []
    for i in range(700):
        clock.now = 1000 + i
        results.append(await store.put(req(body=b"r" * 3000, queue_id=i % 2)))
    segs = store.segments()
    assert len(segs) >= 3
    assert segs[0].first_store_timestamp == 1000
    assert segs[0].last_store_timestamp < segs[1].first_store_timestamp
    assert segs[-1].last_store_timestamp == clock.now
    with pytest.raises(StoreError):
        await store.remove_segment(segs[1].name)          # not the oldest
    with pytest.raises(StoreError):
        await store.remove_segment(segs[-1].name)         # the active one
    held = store.get_messages("T", 0, 0, 4, 1 << 20)      # readers keep views across removal
    await store.remove_segment(segs[0].name)
    assert not os.path.exists(segs[0].path)
    assert bytes(held.buffers[0][:4]) != b""              # still mapped for its holder
    assert store.min_physical_offset == SEG
    assert store.get_record(results[0].physical_offset) is None
    for qid in (0, 1):
        lo = store.min_offset("T", qid)
        assert lo > 0
        got = store.get_messages("T", qid, lo, 1, 1 << 20)
        assert got.status is GetStatus.FOUND and decode(got.buffers[0]).physical_offset >= SEG
        too_small = store.get_messages("T", qid, 0, 1, 1 << 20)
        assert too_small.status is GetStatus.OFFSET_TOO_SMALL and too_small.next_begin_offset == lo
    assert store.earliest_store_time("T", 0) >= segs[1].first_store_timestamp
    del held
    await store.close()
    store = await opened(tmp_path, cfg, clock=clock)          # the removal survives a restart
    assert store.min_physical_offset == SEG and store.min_offset("T", 0) > 0
    await store.close()


# -------------------------------------------------------------------- config
def test_config_validation():
    with pytest.raises(ConfigError):
        StoreConfig(flush="sometimes")
    with pytest.raises(ConfigError):
        StoreConfig(segment_size=100)
    with pytest.raises(ConfigError):
        StoreConfig(cq_units_per_file=0)
    with pytest.raises(ConfigError):
        StoreConfig(max_message_size=10)
    with pytest.raises(ConfigError):
        StoreConfig(flush_interval_ms="5")
    with pytest.raises(ValueError):         # ConfigError is a ValueError
        StoreConfig(recovery_verify_segments=-1)
    assert StoreConfig(segment_size=SEG).record_limit == SEG - 8
    assert StoreConfig().record_limit == 4 << 20


@bounded()
async def test_a_prepared_queue_with_no_unit_yet_survives_a_restart_and_takes_its_first_record(tmp_path):
    """prepare_queue makes a send's new queue and its file before the record is written: a send refused later
    (or a stop) leaves it empty, which a restart loads as an empty queue, and a record after is its offset 0.
    A queue made already is left as it is."""
    store = await opened(tmp_path)
    store.prepare_queue("New", 3)
    assert ("New", 3) in store.queues() and store.max_offset("New", 3) == 0
    r = await store.put(req(topic="Old"))
    store.prepare_queue("Old", 0)
    assert store.max_offset("Old", 0) == 1
    await store.close()
    store = await opened(tmp_path)
    assert store.max_offset("New", 3) == 0
    r = await store.put(req(topic="New", queue_id=3))
    assert r.ok and r.queue_offset == 0 and store.max_offset("New", 3) == 1
    await store.close()


@bounded()
async def test_a_queue_the_writer_made_without_a_file_is_not_in_queue_index(tmp_path, monkeypatch):
    """The send path calls prepare_queue only for a key not in queue_index. A queue made by the writer itself (a
    schedule or retry delivery, a first half, a commit) whose file could not be opened (EMFILE) is in the store
    with its units waiting in memory: had its key counted as there, every later send to it was acknowledged and
    its message unreadable, the very failure prepare_queue refuses. Only a queue with its file is in the index."""
    import errno
    from broker.store import consume_queue
    store = await opened(tmp_path)
    real = no_descriptor_for(monkeypatch, "Late")
    r = await store.put(req(topic="Late", queue_id=2))      # the writer's own path: no prepare_queue
    assert r.ok and store.max_offset("Late", 2) == 0        # written to the log, its unit waiting
    assert ("Late", 2) not in store.queue_index
    with pytest.raises(OSError) as exc:
        store.prepare_queue("Late", 2)
    assert exc.value.errno == errno.EMFILE
    monkeypatch.setattr(consume_queue.MappedFile, "create", real)
    store.prepare_queue("Late", 2)                          # a descriptor free: its waiting unit written
    assert ("Late", 2) in store.queue_index and store.max_offset("Late", 2) == 1
    assert (await store.put(req(topic="Late", queue_id=2))).ok and store.max_offset("Late", 2) == 2
    await store.close()


@bounded()
async def test_a_queue_waiting_for_its_file_is_said_once_not_at_every_refused_send(tmp_path, monkeypatch, caplog):
    """Units that wait for their queue's file are said once (a WARNING) when they first wait. prepare_queue retries
    them at every send, commit and send-back to that queue, and each failed retry said it again: past the
    open-files limit, a WARNING line a refused request, besides the refusal's own gated one (queue-file-failed)."""
    import logging
    from broker.store import consume_queue
    store = await opened(tmp_path)
    real = no_descriptor_for(monkeypatch, "Late")
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        assert (await store.put(req(topic="Late"))).ok         # the writer's own path: its unit waits
        for _ in range(50):
            with pytest.raises(OSError):
                store.prepare_queue("Late", 0)
        assert (await store.put(req(topic="Late"))).ok         # another unit waiting behind it
    said = [r for r in caplog.records if "wait in memory" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    monkeypatch.setattr(consume_queue.MappedFile, "create", real)
    store.prepare_queue("Late", 0)
    assert store.max_offset("Late", 0) == 2
    await store.close()


@bounded()
async def test_a_queue_directory_left_without_a_file_is_prepared_at_the_next_send(tmp_path):
    """prepare_queue makes a new queue's directory, then its file: an open that fails there (EMFILE, the very
    case it is for) or a crash between the two leaves the directory empty, and a restart loads it as a queue
    with no file and nothing waiting. prepare_queue then raised "has no file" for it on every send, for good:
    that queue refused every message, where the writer used to make its file. It makes the file now."""
    store = await opened(tmp_path)
    await store.close()
    os.makedirs(os.path.join(str(tmp_path), "consumequeue", "Empty", "0"))
    store = await opened(tmp_path)
    store.prepare_queue("Empty", 0)
    assert ("Empty", 0) in store.queue_index
    r = await store.put(req(topic="Empty", queue_id=0))
    assert r.ok and store.max_offset("Empty", 0) == 1
    await store.close()


@bounded()
async def test_a_unit_waiting_for_its_queue_file_is_not_lost_across_a_stop(tmp_path, monkeypatch):
    """The broker's own writes (a delayed or retry delivery) make their queue in the writer: past the open-files
    limit the unit waits in memory. The checkpoint does not pass it, so a stop before a file could be opened
    loses nothing: the next start rebuilds the unit from the log."""
    from broker.store import consume_queue
    store = await opened(tmp_path)
    real = no_descriptor_for(monkeypatch, "Late")
    assert (await store.put(req(topic="Late", queue_id=1))).ok
    assert (await store.put(req(topic="Other"))).ok         # later records: the checkpoint still may not pass it
    assert store.max_offset("Late", 1) == 0
    await store.close()
    monkeypatch.setattr(consume_queue.MappedFile, "create", real)
    store = await opened(tmp_path)
    assert store.max_offset("Late", 1) == 1 and store.max_offset("Other", 0) == 1
    await store.close()


@pytest.mark.parametrize("first", ["writer", "thread"])
@bounded()
async def test_a_queue_the_writer_makes_while_its_file_is_made_off_the_loop_keeps_every_unit(tmp_path, monkeypatch,
                                                                                           first):
    """make_queue_file makes a new queue's first file on a thread; meanwhile the writer may make the same queue
    for a record put without it (a commit, a delivery), and one of the two finds the file there (O_EXCL). The
    writer first: the thread's file is not needed, the callers are told the queue is ready. The thread first: the
    writer's unit waits in memory for a moment, and the thread's file is taken and the unit written into it.
    Either way every unit is in the queue, nothing waits in memory, and the callers go on."""
    import errno
    import threading
    from broker.store import consume_queue
    store = await opened(tmp_path)
    real = consume_queue.MappedFile.create
    made, release = threading.Event(), threading.Event()

    def on_the_thread(directory, *a, **kw):
        if threading.current_thread() is threading.main_thread():
            return real(directory, *a, **kw)
        if first == "writer":
            assert release.wait(5)
            return real(directory, *a, **kw)
        mf = real(directory, *a, **kw)
        made.set()
        assert release.wait(5)
        return mf

    monkeypatch.setattr(consume_queue.MappedFile, "create", on_the_thread)
    told = []
    store.make_queue_file("Both", 1, told.append)
    if first == "thread":
        assert await asyncio.get_running_loop().run_in_executor(None, made.wait, 5)
    r = await store.put(req(topic="Both", queue_id=1))       # the writer's own path: no make_queue_file
    assert r.ok
    assert ("Both", 1) not in store.queue_index and told == []
    if first == "thread":       # a caller that cannot wait (a decision) is told to try again, not "File exists"
        with pytest.raises(OSError) as exc:
            store.prepare_queue("Both", 1)
        assert exc.value.errno == errno.EAGAIN and "being made" in str(exc.value)
    release.set()
    await store.queue_file("Both", 1)                       # after the first (one thread, in order)
    assert told == [None] and ("Both", 1) in store.queue_index
    assert store.max_offset("Both", 1) == 1 and not store._backlogged
    assert (await store.put(req(topic="Both", queue_id=1))).queue_offset == 1
    await store.close()
    store = await opened(tmp_path)
    assert store.max_offset("Both", 1) == 2
    await store.close()
