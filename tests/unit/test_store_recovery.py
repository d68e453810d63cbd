"""Recovery: torn tails are cut and reported, mid-log damage stops start-up, consume queues follow the log."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.store import GetStatus, MessageStore, PutRequest, PutResult, StoreConfig
from broker.store.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from broker.store.manifest import NUL_FREE_FILE, read_corrupt_kept, read_nul_free_from, write_corrupt_kept, write_nul_free_from
from broker.store.recovery import BadRecord, parse_record
from protocol.errors import CorruptRecordError, StoreError
from protocol.message import decode_record, encode_record, pack_host, properties_to_string
from tests.support.bounded import bounded
from tests.support.store_faults import image_each_flush, no_descriptor_for

SEG = 1 << 20
CFG = StoreConfig(segment_size=SEG, cq_units_per_file=64)
CUT = StoreConfig(segment_size=SEG, cq_units_per_file=64, truncate_corrupt_tail=True)




def req(i: int, size: int = 2000, queue_id: int = 0) -> PutRequest:
    return PutRequest.build("T", bytes([i % 251]) * size, queue_id=queue_id, properties={"TAGS": f"t{i % 3}"})


async def fill(path, n: int, size: int = 2000, cfg=CFG, queues: int = 1):
    store = MessageStore(str(path), cfg)
    await store.open()
    results = await asyncio.gather(*[store.put(req(i, size, i % queues)) for i in range(n)])
    assert all(r.ok for r in results)
    await store.close()
    return results


async def reopen(path, cfg=CFG) -> MessageStore:
    store = MessageStore(str(path), cfg)
    await store.open()
    return store


def seg_path(path, start: int) -> str:
    return os.path.join(path, "commitlog", f"{start:020d}")


def patch(path, physical_offset: int, data: bytes) -> None:
    start = physical_offset - physical_offset % SEG
    with open(seg_path(path, start), "r+b") as f:
        f.seek(physical_offset - start)
        f.write(data)


def flip(path, physical_offset: int) -> None:
    start = physical_offset - physical_offset % SEG
    with open(seg_path(path, start), "r+b") as f:
        f.seek(physical_offset - start)
        b = f.read(1)
        f.seek(physical_offset - start)
        f.write(bytes([b[0] ^ 0x5A]))


def crashed_at(path, offset: int) -> None:
    """The checkpoint a crash leaves: it vouches only for what was flushed before ``offset`` (a clean close's
    would vouch for the bytes the test then damages, and damage below the checkpoint is no torn tail)."""
    write_checkpoint(str(path), Checkpoint(offset, 0))


def assert_readable(store: MessageStore, results) -> None:
    for r in results:
        msg, _ = decode_record(bytes(store.get_record(r.physical_offset)), check_crc=True)
        assert msg.queue_offset == r.queue_offset


# ------------------------------------------------------------ torn tails
@bounded(20)
async def test_flipped_last_record_is_cut_and_reported(tmp_path, caplog):
    results = await fill(tmp_path, 50)
    last = results[-1]
    flip(tmp_path, last.physical_offset + last.size - 500)      # inside the body: CRC
    crashed_at(tmp_path, last.physical_offset)
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path)
    cut = store.report.truncations
    assert len(cut) == 1 and cut[0].segment == f"{0:020d}" and cut[0].position == last.physical_offset
    assert cut[0].length == last.size and "CRC" in cut[0].reason
    assert any("torn tail" in r.getMessage() and str(last.physical_offset) in r.getMessage() for r in caplog.records)
    assert store.max_offset("T", 0) == 49 and store.get_record(last.physical_offset) is None
    assert_readable(store, results[:-1])
    again = await store.put(req(99))
    assert again.physical_offset == last.physical_offset and again.queue_offset == 49
    await store.close()
    store = await reopen(tmp_path)          # the cut is permanent: nothing to cut the second time
    assert store.report.truncations == [] and store.max_offset("T", 0) == 50
    await store.close()


@pytest.mark.parametrize("zeroed", ["properties", "topic"])
@bounded(20)
async def test_a_record_torn_after_its_body_is_cut(tmp_path, caplog, zeroed):
    # Head and body on disk, the page with its topic or properties lost: the body CRC passes. Kept, it was
    # delivered with its TAGS (or topic) read as NULs.
    results = await fill(tmp_path, 50)
    last = results[-1]
    end = last.physical_offset + last.size
    props = len("TAGS\x01t2")
    if zeroed == "properties":          # from their middle on; their length stays
        patch(tmp_path, end - props // 2, bytes(props // 2))
    else:                               # topic "T": its one byte; its length and the properties stay
        patch(tmp_path, end - props - 3, b"\0")
    crashed_at(tmp_path, last.physical_offset)
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path)
    cut = store.report.truncations
    why = {"properties": "properties hold a NUL byte", "topic": "topic: the topic name '\\x00'"}[zeroed]
    assert [c.position for c in cut] == [last.physical_offset] and cut[0].reason.startswith(why), cut
    assert any("torn tail" in r.getMessage() and why in r.getMessage() for r in caplog.records)
    assert store.max_offset("T", 0) == 49 and store.get_record(last.physical_offset) is None
    assert_readable(store, results[:-1])
    await store.close()


@bounded(20)
async def test_properties_checks_leave_what_the_checkpoint_vouches_for(tmp_path):
    # A NUL in stored properties: refused by today's send path, possible in a log an older broker wrote.
    # Below the checkpoint nothing is torn, so such a record is kept there; past it, it reads as torn.
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    odd = PutRequest.build("T", b"x" * 100, properties={"TAGS": "a", "k": "v\x00w"})
    results = [await store.put(req(0)), await store.put(odd), await store.put(req(1))]
    await store.close()
    store = await reopen(tmp_path)
    assert store.report.truncations == [] and store.max_offset("T", 0) == 3
    await store.close()
    crashed_at(tmp_path, results[1].physical_offset)
    with pytest.raises(StoreError, match="NUL"):       # a valid record after it: damage, not a torn tail
        await reopen(tmp_path)


async def _older_store(path) -> PutResult:
    """A store an older broker wrote: a record with a NUL in a property value, one after it, no nul_free_from
    file. The older record's PutResult."""
    store = MessageStore(str(path), CFG)
    await store.open()
    odd = await store.put(PutRequest.build("T", b"x" * 100, properties={"TAGS": "a", "k": "v\x00w"}))
    await store.put(req(0))
    await store.close()
    os.unlink(os.path.join(path, NUL_FREE_FILE))
    return odd


@bounded(20)
async def test_a_copy_of_an_older_brokers_nul_moves_the_mark_past_it_before_its_bytes(tmp_path, monkeypatch):
    # A commit, a delivery or a retry copies an older broker's record with its NUL to the log's end, past
    # nul_free_from: cut as torn by the next start after a crash, or the start refused with records after it.
    # The mark goes past the copy first, fsynced before any byte of the copy is written.
    odd = await _older_store(tmp_path)
    store = await reopen(tmp_path)
    marks = []

    def write_mark(store_dir, offset):          # with what the segment held then, and the copy's queue
        with open(seg_path(tmp_path, 0), "rb") as f:
            marks.append((offset, f.read(), store.max_offset("C", 0)))
        write_nul_free_from(store_dir, offset)

    monkeypatch.setattr("broker.store.store.write_nul_free_from", write_mark)
    copy = store.copying(odd.physical_offset, PutRequest.build("C", b"x" * 100, properties={"k": "v\x00w"}))
    plain = store.copying(odd.physical_offset + odd.size, req(1))       # no NUL: nothing to move
    assert (await store.put(req(4))).ok     # a batch written between the copy's making and its put
    # queued around the copy in one drain: written before it, and after it, in their own batches
    results = await asyncio.gather(*[store.put(r) for r in (req(2), copy, plain, req(3))])
    assert all(r.ok for r in results)
    c = results[1]
    [(mark, held, indexed)] = marks
    # the copy's bytes flushed first (until the mark is on disk a crash cuts the copy as torn), neither
    # readable nor acknowledged before the mark
    assert mark == c.physical_offset + c.size and held[c.physical_offset:mark] != bytes(c.size)
    assert indexed == 0
    assert read_nul_free_from(str(tmp_path)) == c.physical_offset + c.size
    await store.close()
    crashed_at(tmp_path, c.physical_offset)     # the crash came before a checkpoint covered the copy
    store = await reopen(tmp_path)
    assert store.report.truncations == [] and store.max_offset("C", 0) == 1
    assert decode_record(bytes(store.verified_record(c.physical_offset, "test")))[0].properties["k"] == "v\x00w"
    assert_readable(store, results)
    await store.close()


@pytest.mark.parametrize("flush", ["async", "sync"])
@bounded(20)
async def test_the_mark_moves_for_a_copy_only_once_what_is_before_the_copy_is_flushed(tmp_path, monkeypatch,
                                                                                    flush):
    # Past the old mark, this broker's records not yet flushed are what a crash may tear; cut at the next start
    # by their NUL check. Moved past them for the copy before they were flushed, the mark took that check away:
    # a record torn after its body (zeroed properties, a sound body CRC) was kept. They are flushed first.
    odd = await _older_store(tmp_path)
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=64, flush=flush, flush_interval_ms=3_600_000)
    store = await reopen(tmp_path, cfg)
    clog, seen = store._log, []

    def write_mark(store_dir, offset):
        seen.append((offset, clog.flushed, clog.written))
        write_nul_free_from(store_dir, offset)

    monkeypatch.setattr("broker.store.store.write_nul_free_from", write_mark)
    if flush == "async":
        mine = [await store.put(req(5))]        # acknowledged unflushed (async flush: an hour from now)
    else:
        gate = asyncio.Event()                  # held in its flush until the copy is queued behind it
        flush_ranges = __import__("broker.store.writer", fromlist=["_flush_ranges"])._flush_ranges
        loop = asyncio.get_running_loop()

        def held(ranges):
            asyncio.run_coroutine_threadsafe(gate.wait(), loop).result()
            flush_ranges(ranges)

        monkeypatch.setattr("broker.store.writer._flush_ranges", held)
        mine = [store.put(req(5))]
        while not store._writer._flushing:      # the writer took it and its flush is in flight
            await asyncio.sleep(0)
    copy = store.copying(odd.physical_offset, PutRequest.build("C", b"x" * 100, properties={"k": "v\x00w"}))
    put = store.put(copy)
    if flush == "sync":
        while store._writer._queue:             # drained: the copy waits for the flush, not the reverse
            await asyncio.sleep(0)
        gate.set()
        mine = [await mine[0]]
    c = await put
    assert c.ok and mine[0].ok
    [(mark, flushed, written)] = seen
    assert mark == written == c.physical_offset + c.size
    assert flushed == c.physical_offset     # all before the copy durable when the mark moved
    await store.close()


@bounded(20)
async def test_a_copy_a_crash_tore_before_it_was_flushed_is_cut_not_kept(tmp_path, monkeypatch):
    # The mark moved past the copy before its bytes were flushed: a crash that lost the page of its properties'
    # tail (header and body on disk, so its body CRC holds) found it before the mark, where only the body CRC
    # is checked: kept, never acknowledged, its properties zeros (a commit's copy was then committed again:
    # the consumer got it twice, once damaged). Until its flush returns the copy's NUL still reads as torn.
    odd = await _older_store(tmp_path)
    store = await reopen(tmp_path)
    before = await store.put(req(5))
    images = image_each_flush(monkeypatch, tmp_path)     # the disk as a crash before each flush returns may leave it
    c = await store.put(store.copying(odd.physical_offset,
                                      PutRequest.build("C", b"x" * 100, properties={"k": "v\x00w"})))
    assert c.ok
    await store.close()
    img = next(i for i in images if (i / "commitlog" / f"{0:020d}").read_bytes()[c.physical_offset + 4:][:4]
               == b"\xda\xa3\x20\xa7")          # the first image holding the copy (its magic): its own flush
    patch(img, c.physical_offset + c.size - 3, b"\0\0\0")      # the page of its properties' tail lost
    crashed_at(img, c.physical_offset)
    store = await reopen(img)
    assert [t.position for t in store.report.truncations] == [c.physical_offset]
    assert store.max_offset("C", 0) == 0
    assert_readable(store, [before])
    await store.close()


@bounded(20)
async def test_a_crash_in_the_flush_of_a_list_holding_an_older_nul_copy_leaves_a_store_that_starts(tmp_path,
                                                                                                  monkeypatch):
    # A commit (the copy, then its op record), a dead letter and a scheduled batch (deliveries, then progress)
    # are lists. Had the mark waited for the list's flush, a crash before it left the copy's NUL past the mark
    # with a sound record after it: damage in the middle of the log, and the next start refused.
    odd = await _older_store(tmp_path)
    store = await reopen(tmp_path)
    images = image_each_flush(monkeypatch, tmp_path)     # the disk as a crash before each flush returns may leave it
    copy = store.copying(odd.physical_offset, PutRequest.build("C", b"x" * 100, properties={"k": "v\x00w"}))
    c, op = await store.put_many([copy, req(6)])
    assert c.ok and op.ok
    await store.close()
    img = next(i for i in images if (i / "commitlog" / f"{0:020d}").read_bytes()[c.physical_offset + 4:][:4]
               == b"\xda\xa3\x20\xa7")          # the list's own flush, before it returned
    crashed_at(img, c.physical_offset)
    store = await reopen(img)                   # starts: the list, never acknowledged, is cut whole
    assert [t.position for t in store.report.truncations] == [c.physical_offset]
    assert store.max_offset("C", 0) == 0 and store.max_offset("T", 0) == 2      # (the older broker's two)
    await store.close()
    store = await reopen(tmp_path)              # no crash: the mark vouches for it
    assert store.report.truncations == [] and store.max_offset("C", 0) == 1 and store.max_offset("T", 0) == 3
    await store.close()


@bounded(30)
async def test_a_crash_before_the_mark_of_a_copy_that_rolled_to_a_new_segment_cuts_it_there(tmp_path, monkeypatch):
    # Written down where the log ended, the copy landed at the next segment's start (the rest of the old one
    # sealed): the cut goes back to that end, the new segment with it, and the store writes on from there.
    odd = await _older_store(tmp_path)
    store = await reopen(tmp_path)
    filler = []
    while SEG - store._log.written % SEG > 4000:
        filler.append(await store.put(req(len(filler), 1800)))
    images = image_each_flush(monkeypatch, tmp_path)     # the disk as a crash before each flush returns may leave it
    end = store._log.written
    copy = store.copying(odd.physical_offset, PutRequest.build("C", b"x" * 2000, properties={"k": "v\x00w"}))
    c, op = await store.put_many([copy, req(99, 2000)])
    assert c.ok and c.physical_offset == SEG
    await store.close()
    img = next(i for i in images if os.path.exists(seg_path(i, SEG))
               and open(seg_path(i, SEG), "rb").read(8)[4:] == b"\xda\xa3\x20\xa7")
    crashed_at(img, end)
    store = await reopen(img)
    assert [t.position for t in store.report.truncations] == [end % SEG]
    assert store._log.written == end and store.max_offset("C", 0) == 0
    assert_readable(store, filler)
    again = await store.put(req(100))
    assert again.ok
    await store.close()
    store = await reopen(img)
    assert store.report.truncations == []
    assert_readable(store, filler + [again])
    await store.close()


@bounded(20)
async def test_an_older_nul_copy_refused_leaves_no_cut_for_what_is_written_where_it_would_have_been(tmp_path):
    # Where the copy begins is written down before its bytes; refused (here too large), it was never written,
    # and records written there next, acknowledged, must not be cut with it at the next start.
    odd = await _older_store(tmp_path)
    store = await reopen(tmp_path)
    big = store.copying(odd.physical_offset,
                        PutRequest.build("C", b"x" * (SEG + 100), properties={"k": "v\x00w"}))
    assert not (await store.put(big)).ok
    after = await store.put(req(7))
    assert after.ok
    await store.close()
    crashed_at(tmp_path, after.physical_offset)
    store = await reopen(tmp_path)
    assert store.report.truncations == [] and store.max_offset("T", 0) == 3
    assert_readable(store, [after])
    await store.close()


@pytest.mark.parametrize("flush", ["sync", "async"])
@bounded(20)
async def test_a_mark_that_cannot_be_written_past_a_copy_in_the_log_stops_the_store(tmp_path, monkeypatch, flush):
    # The copy's bytes are in the log past the mark: acknowledged, or with records written after it, its NUL
    # read as damage in the middle of the log at the next start. Refused, never readable, and nothing more
    # written; the next start cuts it.
    odd = await _older_store(tmp_path)
    store = await reopen(tmp_path, StoreConfig(segment_size=SEG, cq_units_per_file=64, flush=flush))
    before = await store.put(req(5))

    def no_room(store_dir, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("broker.store.store.write_nul_free_from", no_room)
    copy = store.copying(odd.physical_offset, PutRequest.build("C", b"x" * 100, properties={"k": "v\x00w"}))
    c, after = await asyncio.gather(store.put(copy), store.put(req(6)))
    assert not c.ok and not after.ok and store.max_offset("C", 0) == 0
    assert store._log.readable == before.physical_offset + before.size
    assert not (await store.put(req(7))).ok
    await store.close()
    monkeypatch.undo()
    store = await reopen(tmp_path)
    assert [t.position for t in store.report.truncations] == [before.physical_offset + before.size]
    assert_readable(store, [before])
    await store.close()


@bounded(30)
async def test_a_slave_moves_its_mark_for_its_masters_nul_only_once_what_is_before_it_is_flushed(tmp_path,
                                                                                                monkeypatch):
    # The slave side of the same rule: the master's chunk holding a NUL record (an older broker's, or this
    # broker's copy of one) moved the slave's mark on the loop, before the chunk was queued, past the slave's
    # own chunks not yet flushed: a crash then kept one torn after its body. It also fsynced on the loop.
    odd = await _older_store(tmp_path / "m")
    master = await reopen(tmp_path / "m")
    plain = await master.put(req(5))
    copy = await master.put(master.copying(odd.physical_offset,
                                           PutRequest.build("C", b"x" * 100, properties={"k": "v\x00w"})))
    assert copy.ok
    slave = MessageStore(str(tmp_path / "s"), StoreConfig(segment_size=SEG, cq_units_per_file=64, flush="async",
                                                          flush_interval_ms=3_600_000))
    await slave.open()
    slave.set_replica_only()
    clog, seen = slave._log, []

    def write_mark(store_dir, offset):
        if store_dir == slave.store_dir:
            seen.append((offset, clog.flushed, threading.current_thread() is threading.main_thread()))
        write_nul_free_from(store_dir, offset)

    monkeypatch.setattr("broker.store.store.write_nul_free_from", write_mark)
    at = 0
    for end in (plain.physical_offset, copy.physical_offset, copy.physical_offset + copy.size):
        chunk = master.replica_chunk(at, end - at)          # [older records], [this broker's], [the copy]
        fut, at = slave.append_replica(at, bytes(chunk))
        chunk.release()
        assert (await fut).ok and at == end
    assert [(mark, flushed) for mark, flushed, _ in seen] == [
        (odd.physical_offset + odd.size, 0), (copy.physical_offset + copy.size, copy.physical_offset)]
    assert not any(on_loop for _, _, on_loop in seen)
    await slave.close()
    await master.close()


@bounded(20)
async def test_a_mark_a_crash_left_past_the_logs_end_comes_back_to_it(tmp_path):
    # The mark was moved for a copy and the crash came before the copy was written: left past the end, the
    # records written there next (this broker's) were not checked for a torn page, and one was kept torn.
    results = await fill(tmp_path, 3)
    end = results[-1].physical_offset + results[-1].size
    write_nul_free_from(str(tmp_path), end + 10_000)
    store = await reopen(tmp_path)
    assert read_nul_free_from(str(tmp_path)) == end
    last = await store.put(req(3))
    await store.close()
    patch(tmp_path, last.physical_offset + last.size - 2, b"\0\0")      # its TAGS value's page lost
    crashed_at(tmp_path, last.physical_offset)
    store = await reopen(tmp_path)
    assert [t.position for t in store.report.truncations] == [last.physical_offset]
    await store.close()


@bounded(20)
async def test_garbage_after_the_last_record_is_zeroed(tmp_path):
    results = await fill(tmp_path, 10)
    end = results[-1].physical_offset + results[-1].size
    noise = bytes(b or 1 for b in os.urandom(700))     # no zero last byte: 1 run in 256 then measured 703
    patch(tmp_path, end, b"\x00\x00\x01\x00" + noise)      # a half-written header and noise
    store = await reopen(tmp_path)
    assert [(t.position, t.length) for t in store.report.truncations] == [(end, 704)]
    assert store.max_offset("T", 0) == 10
    await store.close()
    with open(seg_path(tmp_path, 0), "rb") as f:
        f.seek(end)
        assert f.read(704) == bytes(704)


@bounded(20)
async def test_zero_filled_tail_is_just_the_end(tmp_path):
    results = await fill(tmp_path, 20)
    os.unlink(tmp_path / "checkpoint")              # as if the last writes never reached the disk
    cut_from = results[-3].physical_offset
    patch(tmp_path, cut_from, bytes(results[-1].physical_offset + results[-1].size - cut_from))
    store = await reopen(tmp_path)
    assert store.report.truncations == []
    assert store.report.end_offset == cut_from
    assert store.report.cq_units_dropped == 3       # units of the vanished records
    assert store.max_offset("T", 0) == 17
    got = store.get_messages("T", 0, 16, 32, 1 << 20)
    assert got.message_count == 1 and got.next_begin_offset == 17
    await store.close()


@bounded(20)
async def test_truncated_last_segment_file_is_extended_and_its_torn_record_cut(tmp_path, caplog):
    results = await fill(tmp_path, 700)
    last_seg = max(r.physical_offset for r in results) // SEG * SEG
    in_last = [r for r in results if r.physical_offset >= last_seg]
    victim = in_last[len(in_last) // 2]
    os.truncate(seg_path(tmp_path, last_seg), victim.physical_offset - last_seg + 100)
    crashed_at(tmp_path, victim.physical_offset)
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path)
    assert os.path.getsize(seg_path(tmp_path, last_seg)) == SEG
    assert any("short" in r.getMessage() for r in caplog.records)
    assert [t.position for t in store.report.truncations] == [victim.physical_offset - last_seg]
    assert store.max_offset("T", 0) == victim.queue_offset
    assert_readable(store, [r for r in results if r.queue_offset < victim.queue_offset])
    await store.close()


@bounded(20)
async def test_torn_first_record_of_a_new_segment(tmp_path):
    results = await fill(tmp_path, 600)
    first_in_last = min((r for r in results if r.physical_offset >= SEG), key=lambda r: r.physical_offset)
    flip(tmp_path, first_in_last.physical_offset + 200)
    later = [r for r in results if r.physical_offset > first_in_last.physical_offset]
    for r in later:                                  # nothing after the torn record reached the disk
        patch(tmp_path, r.physical_offset, bytes(r.size))
    crashed_at(tmp_path, first_in_last.physical_offset)
    store = await reopen(tmp_path)
    assert [(t.segment, t.position) for t in store.report.truncations] == [(f"{SEG:020d}", 0)]
    assert store.max_offset("T", 0) == first_in_last.queue_offset
    await store.close()


@bounded(20)
async def test_an_empty_segment_after_a_crash_mid_roll_is_removed(tmp_path):
    await fill(tmp_path, 100)                        # all in segment 0
    with open(seg_path(tmp_path, SEG), "wb") as f:   # created, but the end marker never written
        f.truncate(SEG)
    store = await reopen(tmp_path)
    assert store.report.removed_segments == [f"{SEG:020d}"] and store.report.truncations == []
    assert len(store.segments()) == 1 and store.max_offset("T", 0) == 100
    assert (await store.put(req(1))).physical_offset < SEG
    await store.close()


# --------------------------------------------------------- mid-log damage
@bounded(20)
async def test_damage_in_the_middle_stops_start_up(tmp_path, caplog):
    results = await fill(tmp_path, 60)
    bad = results[30]
    flip(tmp_path, bad.physical_offset + 150)
    with pytest.raises(StoreError) as err:
        await reopen(tmp_path)
    assert err.value.segment == f"{0:020d}" and err.value.position == bad.physical_offset
    assert "truncate_corrupt_tail=True" in str(err.value) and "CRC" in str(err.value)
    with caplog.at_level(logging.ERROR, logger="txmq.store"):
        store = await reopen(tmp_path, CUT)
    assert any("truncate_corrupt_tail" in r.getMessage() for r in caplog.records)
    assert store.max_offset("T", 0) == 30
    assert_readable(store, results[:30])
    assert store.get_record(results[40].physical_offset) is None
    assert (await store.put(req(5))).queue_offset == 30
    await store.close()


@bounded(20)
async def test_damage_in_an_older_segment_stops_start_up(tmp_path):
    results = await fill(tmp_path, 900)
    bad = results[100]
    patch(tmp_path, bad.physical_offset + 4, b"\x00\x00\x00\x00")     # magic gone
    with pytest.raises(StoreError) as err:
        await reopen(tmp_path)
    assert err.value.segment == f"{0:020d}" and err.value.position == bad.physical_offset
    store = await reopen(tmp_path, CUT)
    assert len(store.segments()) == 1 and not os.path.exists(seg_path(tmp_path, SEG))
    assert store.max_offset("T", 0) == 100
    await store.close()


@bounded(20)
async def test_zeros_in_the_middle_are_damage_too(tmp_path):
    results = await fill(tmp_path, 40)
    hole = results[10]
    patch(tmp_path, hole.physical_offset, bytes(hole.size))
    with pytest.raises(StoreError) as err:
        await reopen(tmp_path)
    assert err.value.position == hole.physical_offset


@bounded(20)
async def test_a_short_segment_before_the_last_is_damage(tmp_path):
    results = await fill(tmp_path, 700)
    os.truncate(seg_path(tmp_path, 0), 5000)
    with pytest.raises(StoreError) as err:
        await reopen(tmp_path)
    assert err.value.segment == f"{0:020d}" and err.value.position == 5000
    store = await reopen(tmp_path, CUT)
    survivors = [r for r in results if r.physical_offset + r.size <= 5000]
    assert store.max_offset("T", 0) == len(survivors)
    assert_readable(store, survivors)
    await store.close()


@bounded(20)
async def test_damage_before_the_verify_window_is_not_scanned_but_never_served(tmp_path):
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=64, recovery_verify_segments=1)
    results = await fill(tmp_path, 900, cfg=cfg)
    bad = results[5]
    patch(tmp_path, bad.physical_offset + 4, b"\x00\x00\x00\x00")
    store = await reopen(tmp_path, cfg)                  # clean checkpoint: only the last segment is verified
    assert store.get_record(bad.physical_offset) is None
    got = store.get_messages("T", 0, 5, 1, 1 << 20)
    # its segment is in the log: damage, not removal (which would skip the intact records after it)
    assert got.status is GetStatus.QUEUE_DAMAGED and got.message_count == 0 and got.next_begin_offset == 5
    await store.close()


@bounded(60)
async def test_zeroed_properties_before_the_verify_window_are_never_served(tmp_path):
    # No CRC covers the properties: a page of them zeroed at rest in an older segment (which start-up does not
    # verify) was served as it lay, the message's TAGS read as NULs.
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=64, recovery_verify_segments=1)
    results = await fill(tmp_path, 900, cfg=cfg)
    bad = results[5]
    patch(tmp_path, bad.physical_offset + bad.size - 3, bytes(3))
    store = await reopen(tmp_path, cfg)
    assert store.get_messages("T", 0, 4, 1, 1 << 20).status is GetStatus.FOUND
    got = store.get_messages("T", 0, 5, 8, 1 << 20)
    assert got.status is GetStatus.RECORD_CORRUPT and got.message_count == 0 and got.next_begin_offset == 5
    got = store.get_messages("T", 0, 3, 8, 1 << 20)      # served up to it, never past it
    assert got.status is GetStatus.FOUND and got.message_count == 2 and got.next_begin_offset == 5
    with pytest.raises(CorruptRecordError, match="zeroed"):
        store.verified_record(bad.physical_offset, "test")
    assert store.corrupt == {"pull": 1, "test": 1}
    await store.close()


@bounded(60)
async def test_a_crash_while_cut_segments_are_removed_leaves_no_gap(tmp_path, monkeypatch):
    """Killed after removing the first of the segments after a cut, the store kept the later ones, and the
    next start refused the log as one with a segment missing from the middle (truncate_corrupt_tail or not)."""
    from broker.store.commit_log import Segment

    results = await fill(tmp_path, 2000, cfg=CUT)            # five segments
    bad = results[1000]                                      # in the third: the verified ones are cut there
    patch(tmp_path, bad.physical_offset + 4, b"\0\0\0\0")
    real, removed = Segment.remove, []

    def killed_after_one(self):
        if removed:
            raise KeyboardInterrupt("killed")
        removed.append(self.name)
        return real(self)

    monkeypatch.setattr(Segment, "remove", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        await reopen(tmp_path, CUT)
    monkeypatch.undo()
    store = await reopen(tmp_path, CUT)
    assert store.max_physical_offset == bad.physical_offset
    assert len(store.segments()) == 3
    await store.close()


# --------------------------------------------------------- checkpoint / CQ
@bounded(20)
async def test_a_damaged_checkpoint_means_a_full_scan(tmp_path, caplog):
    await fill(tmp_path, 700)
    with open(tmp_path / "checkpoint", "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path)
    assert any("checkpoint" in r.getMessage() for r in caplog.records)
    assert store.report.scanned_from == 0 and store.report.records_scanned == 700
    assert store.max_offset("T", 0) == 700
    await store.close()


@bounded(20)
async def test_consume_queues_are_rebuilt_when_deleted(tmp_path):
    results = await fill(tmp_path, 600, queues=3)
    shutil.rmtree(tmp_path / "consumequeue")
    store = await reopen(tmp_path)
    assert store.report.cq_units_appended == 600
    for qid in range(3):
        assert store.max_offset("T", qid) == 200
    for r in results[::37]:
        qid = results.index(r) % 3
        got = store.get_messages("T", qid, r.queue_offset, 1, 1 << 20)
        assert decode_record(bytes(got.buffers[0]))[0].physical_offset == r.physical_offset
    await store.close()


@bounded(20)
async def test_a_whole_consumequeue_rebuild_names_every_queue_it_rebuilt(tmp_path):
    """consumequeue/ removed whole: every queue is rebuilt from the whole log, as one queue's directory removed
    is; the one was counted (txmq_store_consume_queues_rebuilt_total, fed by the report), the whole by no metric,
    a WARNING alone. A rebuild begun again (a crash before its first checkpoint) names them too; a start after
    that checkpoint, none."""
    await fill(tmp_path, 60, queues=3)
    shutil.rmtree(tmp_path / "consumequeue")
    store = await reopen(tmp_path)
    assert store.report.queues_rebuilt == ["T-0", "T-1", "T-2"]
    await store.close()
    store = await reopen(tmp_path)                  # checkpointed: nothing rebuilt at the next start
    assert store.report.queues_rebuilt == []
    await store.close()
    # as a crash before the rebuild's first checkpoint leaves the store
    shutil.rmtree(tmp_path / "consumequeue")
    os.replace(tmp_path / "checkpoint", tmp_path / "checkpoint.rebuild")
    store = await reopen(tmp_path)
    assert store.report.queues_rebuilt == ["T-0", "T-1", "T-2"]
    assert all(store.max_offset("T", q) == 20 for q in range(3))
    await store.close()


@bounded(20)
async def test_the_start_up_report_of_a_whole_rebuild_names_a_few_queues_and_counts_the_rest(tmp_path):
    """The report is said at INFO (`store open: ...`) at every start: with every queue of a whole consumequeue/
    rebuild in it, a broker of 10,000 queues said a line of 10,000 names (about 150 KB). Said: the first few and how
    many; the report's list keeps them all (the metric counts them)."""
    await fill(tmp_path, 80, size=200, queues=40)
    shutil.rmtree(tmp_path / "consumequeue")
    store = await reopen(tmp_path)
    try:
        assert len(store.report.queues_rebuilt) == 40
        said = str(store.report)
        assert said.count("'T-") == 10 and "40 in all" in said, said
        assert f"end_offset={store.report.end_offset}" in said
    finally:
        await store.close()


@bounded(20)
async def test_queue_units_beyond_the_log_are_dropped_and_wrong_ones_rewritten(tmp_path):
    results = await fill(tmp_path, 30)
    os.unlink(tmp_path / "checkpoint")
    cq_file = tmp_path / "consumequeue" / "T" / "0" / f"{0:020d}"
    with open(cq_file, "r+b") as f:
        f.seek(20 * 5)
        f.write(b"\x00" * 8 + b"\x00\x00\x00\x05" + b"\x00" * 8)     # unit 5 points at the wrong record
        f.seek(20 * 30)
        f.write((10 ** 9).to_bytes(8, "big") + b"\x00\x00\x04\x00" + b"\x00" * 8)   # a unit past the log
    store = await reopen(tmp_path)
    assert store.max_offset("T", 0) == 30
    for r in results:
        got = store.get_messages("T", 0, r.queue_offset, 1, 1 << 20)
        assert decode_record(bytes(got.buffers[0]))[0].physical_offset == r.physical_offset
    await store.close()


# Queue files before the last one that lost units, with only the last segment verified: their records are not
# scanned, so the damage is found when the files load, and the queue is rebuilt from the whole log (a zeroed,
# cut or missing file used to be served as it was: consumers skipped the units, or found the queue began late).
LAST_ONLY = StoreConfig(segment_size=SEG, cq_units_per_file=64, recovery_verify_segments=1)


def _zero_file(path):
    with open(path, "r+b") as f:
        f.write(bytes(64 * 20))


def _cut_file(path):
    with open(path, "r+b") as f:
        f.truncate(20 * 10)


def read_queue(store, qid: int = 0) -> list[int]:
    seen, off = [], store.min_offset("T", qid)
    while off < store.max_offset("T", qid):
        got = store.get_messages("T", qid, off, 32, 1 << 20)
        assert got.status is GetStatus.FOUND, (off, got.status)
        seen += [decode_record(bytes(b))[0].physical_offset for b in got.buffers]
        off = got.next_begin_offset
    return seen


@pytest.mark.parametrize("damage", [_zero_file, _cut_file, os.unlink], ids=["zeroed", "cut", "deleted"])
@bounded(30)
async def test_a_damaged_queue_file_before_the_verified_range_is_rebuilt(tmp_path, caplog, damage):
    results = await fill(tmp_path, 900, cfg=LAST_ONLY)      # two segments; queue files of 64 units
    damage(tmp_path / "consumequeue" / "T" / "0" / f"{64 * 20:020d}")
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path, LAST_ONLY)
    assert store.report.scanned_from == SEG
    assert any("rebuilding the queue" in r.getMessage() for r in caplog.records)
    assert store.min_offset("T", 0) == 0 and store.max_offset("T", 0) == 900
    assert read_queue(store) == [r.physical_offset for r in results]
    await store.close()


@bounded(30)
async def test_a_rebuilt_queue_whose_records_are_gone_keeps_its_offsets(tmp_path):
    store = await reopen(tmp_path, LAST_ONLY)
    assert all(r.ok for r in await asyncio.gather(*[store.put(req(i, 2000, 1)) for i in range(130)]))
    assert all(r.ok for r in await asyncio.gather(*[store.put(req(i, 2000, 0)) for i in range(900)]))
    await store.remove_segment(store.segments()[0].name, "test")    # every record of queue 1 goes
    await store.close()
    with open(tmp_path / "consumequeue" / "T" / "1" / f"{0:020d}", "wb") as f:
        f.write(b"\1" * 64 * 20)                            # a stale file that does not precede the others
    store = await reopen(tmp_path, LAST_ONLY)
    assert store.max_offset("T", 1) == 130                  # rebuilt empty, its offsets are not handed out again
    assert (await store.put(req(0, 100, 1))).queue_offset == 130
    await store.close()


@bounded(20)
async def test_a_unit_torn_after_its_size_gets_its_tag_back(tmp_path):
    """A crash in the copy of a unit can leave its offset and size but not its tag: recovery took the unit as
    right, and the message was filtered out of its tag's subscriptions from then on."""
    await fill(tmp_path, 30)
    store = await reopen(tmp_path)
    want = store.queue_unit("T", 0, 29)
    await store.close()
    assert want[2] != 0
    with open(tmp_path / "consumequeue" / "T" / "0" / f"{0:020d}", "r+b") as f:
        f.seek(20 * 29 + 12)
        f.write(bytes(8))
    store = await reopen(tmp_path)
    assert store.queue_unit("T", 0, 29) == want
    await store.close()


@bounded(20)
async def test_consume_queue_files_roll(tmp_path):
    results = await fill(tmp_path, 200, size=100)        # 64 units a file -> 4 files
    files = sorted(os.listdir(tmp_path / "consumequeue" / "T" / "0"))
    assert files == [f"{i * 64 * 20:020d}" for i in range(4)]
    store = await reopen(tmp_path)
    assert store.max_offset("T", 0) == 200
    got = store.get_messages("T", 0, 60, 32, 1 << 20)
    assert got.message_count == 4 and got.next_begin_offset == 64     # a read stops at its file's end
    assert_readable(store, results)
    await store.close()


# ------------------------------------------------------------ the key index
@bounded(30)
async def test_records_written_where_a_cut_log_ended_are_indexed(tmp_path):
    """The index had entries up to a record the recovery then cut off; it took everything below its newest
    entry as indexed, so the new records written over the cut range were never indexed (QUERY_MESSAGE by key
    or message id found nothing)."""
    from broker.store.index import IndexService

    cfg = StoreConfig(segment_size=SEG, max_message_size=2048, truncate_corrupt_tail=True)

    async def open_both():
        store = MessageStore(str(tmp_path), cfg)
        index = IndexService(str(tmp_path), segment_size=SEG, slots=16, entries=1000)
        store.add_dispatch_listener(index.on_dispatch)
        await store.open()
        await index.open(store.min_physical_offset, store.max_physical_offset)
        return store, index

    def put(store, key):
        return store.put(PutRequest.build("T", b"x" * 50, properties={"KEYS": key}))

    store, index = await open_both()
    old = [await put(store, f"old{i}") for i in range(10)]
    assert (await index.query("T", "old9", 8, 0, 2**62))[0] == [old[9].physical_offset]
    await index.close()
    await store.close()
    patch(tmp_path, old[3].physical_offset + 4, b"\0\0\0\0")   # damage record 3: cut there
    store, index = await open_both()
    try:
        assert store.max_physical_offset == old[3].physical_offset
        new = [await put(store, f"new{i}") for i in range(10)]
        for i, r in enumerate(new):
            assert (await index.query("T", f"new{i}", 8, 0, 2**62))[0] == [r.physical_offset]
        assert (await index.query("T", "old9", 8, 0, 2**62))[0] == []
        assert (await index.query("T", "old2", 8, 0, 2**62))[0] == [old[2].physical_offset]
    finally:
        await index.close()
        await store.close()


# ----------------------------------------------------------- record parser
hosts = st.sampled_from([("127.0.0.1", 10911), ("10.1.2.3", 1), ("::1", 7), ("2001:db8::5", 65535)])


class FakeSegment:
    """What parse_record reads of a segment, in memory."""

    def __init__(self, start: int, size: int):
        self.start, self.size = start, size
        self.reserved = size            # no holes
        self.mm = bytearray(size)
        self.view = memoryview(self.mm)


@settings(max_examples=200, deadline=None)
@given(topic=st.from_regex(r"[A-Za-z0-9_%|-]{1,127}", fullmatch=True), body=st.binary(max_size=3000),
       props=st.dictionaries(st.text("abcXYZ", min_size=1, max_size=5), st.text("xyz01é", min_size=1, max_size=9),
                             max_size=4),
       born=hosts, store=hosts, pos=st.integers(0, 4000), sys_flag=st.sampled_from([0, 4, 8, 12, 1]))
def test_recovery_parser_agrees_with_the_codec(topic, body, props, born, store, pos, sys_flag):
    seg = FakeSegment(8192 * 4, 16384)
    born_host, store_host = pack_host(*born), pack_host(*store)
    rec = encode_record(topic=topic.encode(), body=body, queue_id=3, flag=1, sys_flag=sys_flag,
                        born_timestamp=5, born_host=born_host, store_host=store_host,
                        properties=properties_to_string(props).encode(), queue_offset=9,
                        physical_offset=seg.start + pos, store_timestamp=77, prepared_offset=12)
    if pos + len(rec) + 8 > seg.size:
        return
    seg.mm[pos:pos + len(rec)] = rec
    size, qid, qoff, flag, ts, prepared, got_topic, _ = parse_record(seg, pos)
    msg, total = decode_record(seg.mm, pos, check_crc=True)
    assert (size, qid, qoff, flag, ts, prepared, got_topic) == (
        total, msg.queue_id, msg.queue_offset, msg.sys_flag, msg.store_timestamp, msg.prepared_offset, msg.topic)
    body_at = 72 + len(born_host) + len(store_host)
    damage = [(0, 0x41), (4, 0x41), (29, 0x41), (body_at + len(body), 0x80)]   # size, magic, offset, topic length
    if body:
        damage.append((body_at + len(body) // 2, 0x41))                          # body: CRC
    for at, mask in damage:
        seg.mm[pos + at] ^= mask
        with pytest.raises(BadRecord):
            parse_record(seg, pos)
        seg.mm[pos + at] ^= mask


# A range of units zeroed in the middle of an old queue file (a lost page), valid units after it. Load took the
# file's length from its last non-zero byte, so the zeros were served: a pull there found no record, took the
# segment as removed and skipped the rest of it, without a word.
def _zero_units(path, lo: int, hi: int) -> None:
    with open(path, "r+b") as f:
        f.seek(lo * 20)
        f.write(bytes((hi - lo) * 20))


@bounded(30)
async def test_units_zeroed_mid_file_with_no_checkpoint_are_found_at_start_up(tmp_path, caplog):
    """No checkpoint vouches for the file (a crash before the first one, or it was lost): start-up reads it
    through, finds the zeros and repairs them from the log before anyone reads there."""
    results = await fill(tmp_path, 900, cfg=LAST_ONLY)      # two segments; queue files of 64 units
    os.unlink(tmp_path / "checkpoint")
    _zero_units(tmp_path / "consumequeue" / "T" / "0" / f"{64 * 20:020d}", 6, 17)    # queue offsets 70..80
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path, LAST_ONLY)
    assert any(f"zeroed unit 70 (file {64 * 20:020d} byte {6 * 20})" in r.getMessage() for r in caplog.records)
    assert store.min_offset("T", 0) == 0 and store.max_offset("T", 0) == 900
    assert read_queue(store) == [r.physical_offset for r in results]
    assert store.damaged_queues() == {}
    await store.close()


@bounded(30)
async def test_units_zeroed_in_a_checkpointed_file_stop_reads_and_the_next_start_rebuilds(tmp_path, caplog):
    """A file the checkpoint vouches for (flushed whole before it) cannot hold a crash's hole, so start-up does
    not read it through: start-up time must not grow with the history kept. Zeros there anyway (a disk, a
    hand) are found by the first read that meets them: it stops there with QUEUE_DAMAGED instead of skipping
    (the pull answers an error), says so once at ERROR, marks the queue, and the next start rebuilds it."""
    results = await fill(tmp_path, 900, cfg=LAST_ONLY)
    qdir = tmp_path / "consumequeue" / "T" / "0"
    _zero_units(qdir / f"{64 * 20:020d}", 6, 17)            # queue offsets 70..80, records in segment 0
    store = await reopen(tmp_path, LAST_ONLY)
    assert store.report.queues_rebuilt == []                # not read through at start-up
    got = store.get_messages("T", 0, 64, 32, 1 << 20)
    assert got.status is GetStatus.FOUND and got.next_begin_offset == 70 and len(got.buffers) == 6
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        for _ in range(2):
            got = store.get_messages("T", 0, 70, 32, 1 << 20)
            assert got.status is GetStatus.QUEUE_DAMAGED and got.next_begin_offset == 70 and not got.buffers
    assert [r.getMessage() for r in caplog.records if "zeroed unit at queue offset 70" in r.getMessage()] \
        and len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1    # said once
    assert store.damaged_queues() == {("T", 0): 70}
    assert store.queue_unit("T", 0, 75) is None             # the schedule service's read stops there too
    await store.close()                                     # the mark is written on the I/O thread, in order
    assert (qdir / "DAMAGED").read_text() == f"queue offset 70, file {64 * 20:020d}\n"
    store = await reopen(tmp_path, LAST_ONLY)
    assert store.report.queues_rebuilt == ["T-0"]
    assert read_queue(store) == [r.physical_offset for r in results]
    assert not (qdir / "DAMAGED").exists() and store.damaged_queues() == {}
    await store.close()


@bounded(30)
async def test_units_zeroed_mid_file_in_the_verified_range_are_rewritten(tmp_path, caplog):
    results = await fill(tmp_path, 900, cfg=LAST_ONLY)
    late = next(r for r in results if r.physical_offset >= SEG).queue_offset      # first record of segment 1
    lo = late + 64 - late % 64 + 3                          # inside a later file, not the last one
    _zero_units(tmp_path / "consumequeue" / "T" / "0" / f"{(lo - lo % 64) * 20:020d}", lo % 64, lo % 64 + 5)
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path, LAST_ONLY)
    assert store.report.queues_rebuilt == []                # the scan had the records: no whole-log pass
    assert any(f"unit {lo} does not match the log" in r.getMessage() for r in caplog.records)
    assert read_queue(store) == [r.physical_offset for r in results]
    await store.close()


@bounded(30)
async def test_units_zeroed_in_the_last_file_before_the_verified_range_rebuild_the_queue(tmp_path):
    results = await fill(tmp_path, 900, cfg=StoreConfig(segment_size=SEG, cq_units_per_file=1000,
                                                        recovery_verify_segments=1))
    _zero_units(tmp_path / "consumequeue" / "T" / "0" / f"{0:020d}", 100, 120)
    store = await reopen(tmp_path, StoreConfig(segment_size=SEG, cq_units_per_file=1000, recovery_verify_segments=1))
    assert store.report.queues_rebuilt == ["T-0"]
    assert read_queue(store) == [r.physical_offset for r in results]
    await store.close()


@bounded(30)
async def test_start_up_reads_only_the_unvouched_tail_of_a_queues_last_file(tmp_path, monkeypatch):
    """The last file of every queue was read whole at start-up (up to 6 MB a queue, a thousand queues 6 GB):
    only the part written since the checkpoint can hold a crash's hole."""
    import broker.store.consume_queue as cqmod
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=200_000)            # one big last file
    await fill(tmp_path, 900, cfg=cfg)
    reads = []
    real = cqmod._first_zeroed_unit
    monkeypatch.setattr(cqmod, "_first_zeroed_unit", lambda fd, end, start=0: reads.append((start, end)) or
                        real(fd, end, start))
    # 900 units are 18,000 bytes, well under one real chunk (1 MiB): with it, reading the whole file read one
    # chunk too, and no assertion on the chunks could tell the two apart. Chunks of 50 units can.
    monkeypatch.setattr(cqmod, "_SCAN", 50 * 20)
    store = await reopen(tmp_path, cfg)
    await store.close()
    assert reads == [(900 * 20 - cqmod._SCAN, 900 * 20)]     # the last chunk: the close's checkpoint vouches
    os.unlink(tmp_path / "checkpoint")                      # nothing vouched: the whole file is read
    reads.clear()
    store = await reopen(tmp_path, cfg)
    await store.close()
    assert reads == [(0, 900 * 20)]


@bounded(30)
async def test_a_failed_checkpoint_leaves_its_queue_ranges_to_the_next_one(tmp_path, monkeypatch):
    """A checkpoint job that failed had taken its queues' dirty ranges: the next one flushed only newer ranges
    and then vouched for the older ones, never flushed, and start-up trusts what a checkpoint vouches for."""
    import broker.store.store as storemod
    store = await reopen(tmp_path, CFG)
    try:
        for i in range(10):
            await store.put(req(i))
        calls = []
        real = storemod._checkpoint_job

        def job(ranges, *args):
            calls.append([(mf.name, lo, hi) for mf, lo, hi in ranges])
            if len(calls) == 1:
                raise OSError("EIO")
            return real(ranges, *args)
        monkeypatch.setattr(storemod, "_checkpoint_job", job)
        with pytest.raises(OSError):
            await store._checkpoint()
        await store.put(req(10))
        await store._checkpoint()
        assert calls[0] and set(calls[0]) <= set(calls[1])
    finally:
        await store.close()


@bounded(30)
async def test_a_checkpoint_failing_turn_after_turn_keeps_one_range_per_queue_file(tmp_path, monkeypatch):
    """Each failed checkpoint handed its ranges to the next one as they were: while it kept failing (a bad block
    under one queue file), every turn added each active queue's range again, so the list (and the msyncs each
    attempt made) grew for as long as the broker ran. Merged per file, what the next one flushes still covers
    every range a failed one took."""
    import broker.store.store as storemod
    store = await reopen(tmp_path, CFG)
    try:
        calls = []
        real = storemod._checkpoint_job

        def job(ranges, *args):
            calls.append([(mf.name, lo, hi) for mf, lo, hi in ranges])
            if len(calls) <= 20:
                raise OSError("EIO")
            return real(ranges, *args)
        monkeypatch.setattr(storemod, "_checkpoint_job", job)
        for i in range(20):                     # 20 turns, each with new units in the queue's one file
            await store.put(req(i))
            with pytest.raises(OSError):
                await store._checkpoint()
        assert len(store._ranges_to_retry) == 1, store._ranges_to_retry
        await store.put(req(20))
        await store._checkpoint()
        assert store._ranges_to_retry == []
        last = calls[-1]
        for name, lo, hi in (r for failed in calls[:-1] for r in failed):
            assert any(n == name and a <= lo and hi <= b for n, a, b in last), (name, lo, hi, last)
    finally:
        await store.close()


class _SyncSpy:
    """Records, in order, each fsync (inode, is a directory) and each queue-file flush (its path)."""

    def __init__(self, monkeypatch):
        import stat
        from broker.store.mapped_file import MappedFile
        self.events = []
        real_fsync, real_flush = os.fsync, MappedFile.flush

        def fsync(fd):
            st = os.fstat(fd)
            self.events.append(("fsync", st.st_ino, stat.S_ISDIR(st.st_mode)))
            return real_fsync(fd)

        def flush(mf, lo, hi):
            self.events.append(("flush", mf.path))
            return real_flush(mf, lo, hi)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(MappedFile, "flush", flush)

    def index(self, event) -> int:
        return self.events.index(event) if event in self.events else -1


@bounded(30)
async def test_the_damage_mark_and_its_removal_reach_the_queue_directory(tmp_path, monkeypatch):
    """Only the DAMAGED mark's presence counts, and a new file's name is durable once its directory is
    synced: the mark's content was fsynced but not its name, so a crash could lose it and the next start
    would not rebuild the queue. Its removal after the rebuild is synced by the checkpoint that flushes the
    rebuilt units, after them (a rebuild that fits in the queue's first file makes no new file whose
    directory entry would have had it synced)."""
    import broker.store.consume_queue as cqmod
    store = MessageStore(str(tmp_path), LAST_ONLY)
    await store.open()
    results = await asyncio.gather(*[store.put(req(i)) for i in range(40)])    # one queue file, 40 units used
    # ...all in segment 0, before the verified range (the last segment), which another topic's records reach
    others = await asyncio.gather(*[store.put(PutRequest.build("U", bytes(2000))) for _ in range(SEG // 2000)])
    assert all(r.ok for r in results + others) and others[-1].physical_offset >= SEG
    await store.close()
    qdir = tmp_path / "consumequeue" / "T" / "0"
    first = str(qdir / f"{0:020d}")
    # Start-up reads a queue's last file back from its end until a chunk begins with a unit the checkpoint
    # vouches for; chunks of 8 units here (1 MiB in production), so units 10..15 are not read through.
    monkeypatch.setattr(cqmod, "_SCAN", 20 * 8)
    _zero_units(first, 10, 16)
    store = await reopen(tmp_path, LAST_ONLY)
    assert store.report.queues_rebuilt == []
    assert store.get_messages("T", 0, 10, 32, 1 << 20).status is GetStatus.QUEUE_DAMAGED
    spy = _SyncSpy(monkeypatch)
    await store.close()                                         # the mark is written on the I/O thread
    mark = os.stat(qdir / "DAMAGED").st_ino
    directory = os.stat(qdir).st_ino
    assert 0 <= spy.index(("fsync", mark, False)) < spy.index(("fsync", directory, True)), spy.events

    spy = _SyncSpy(monkeypatch)
    store = await reopen(tmp_path, LAST_ONLY)
    assert store.report.queues_rebuilt == ["T-0"] and not (qdir / "DAMAGED").exists()
    assert read_queue(store) == [r.physical_offset for r in results]
    await store.close()                                         # its final checkpoint, if no earlier one
    synced = spy.index(("fsync", directory, True))
    assert 0 <= spy.index(("flush", first)) < synced, spy.events


@bounded(30)
async def test_the_damage_mark_is_removed_only_after_the_rebuilt_units_are_flushed(tmp_path, monkeypatch):
    """The mark's removal is a directory change the file system may make durable at any journal commit (another
    file's fsync, the commit log's, forces one), not only when the queue's directory is fsynced: deferring that
    fsync to the checkpoint does not keep the removal from reaching the disk before the rebuilt units, which
    are dirty pages of the mapping until something flushes them (the rebuild zeroed and flushed the file
    first). A power loss then left the queue zeroed and unmarked, the lost units found again only when a read
    met them. So the units appended by the rebuild are flushed before the mark is unlinked."""
    import broker.store.consume_queue as cqmod
    from broker.store.mapped_file import MappedFile
    store = MessageStore(str(tmp_path), LAST_ONLY)
    await store.open()
    results = await asyncio.gather(*[store.put(req(i)) for i in range(40)])
    others = await asyncio.gather(*[store.put(PutRequest.build("U", bytes(2000))) for _ in range(SEG // 2000)])
    assert all(r.ok for r in results + others) and others[-1].physical_offset >= SEG
    await store.close()
    qdir = tmp_path / "consumequeue" / "T" / "0"
    first = str(qdir / f"{0:020d}")
    monkeypatch.setattr(cqmod, "_SCAN", 20 * 8)
    _zero_units(first, 10, 16)
    store = await reopen(tmp_path, LAST_ONLY)
    assert store.get_messages("T", 0, 10, 32, 1 << 20).status is GetStatus.QUEUE_DAMAGED
    await store.close()
    assert (qdir / "DAMAGED").exists()

    events = []
    real_unlink, real_flush, real_append = os.unlink, MappedFile.flush, cqmod.ConsumeQueue.append

    def unlink(path, *a, **kw):
        events.append(("unlink", str(path)))
        return real_unlink(path, *a, **kw)

    def flush(mf, lo, hi):
        events.append(("flush", mf.path))
        return real_flush(mf, lo, hi)

    def append(cq, *a, **kw):
        events.append(("append", cq.directory))
        return real_append(cq, *a, **kw)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(MappedFile, "flush", flush)
    monkeypatch.setattr(cqmod.ConsumeQueue, "append", append)
    store = await reopen(tmp_path, LAST_ONLY)
    try:
        assert store.report.queues_rebuilt == ["T-0"] and not (qdir / "DAMAGED").exists()
        assert read_queue(store) == [r.physical_offset for r in results]
        removed = events.index(("unlink", str(qdir / "DAMAGED")))
        appended = max(i for i, e in enumerate(events[:removed]) if e == ("append", str(qdir)))
        assert ("flush", first) in events[appended:removed], events
    finally:
        await store.close()


async def _drain(store, topic="T", queue_id=0):
    """Every message a consumer would get from the start, and the status that stopped it, if any."""
    got, offset, stop = [], store.min_offset(topic, queue_id), None
    for _ in range(10_000):                     # a bound: the queue is far shorter
        if offset >= store.max_offset(topic, queue_id):
            break
        res = store.get_messages(topic, queue_id, offset, 32, 1 << 20)
        if res.status is GetStatus.QUEUE_DAMAGED:
            stop = (res.status, res.next_begin_offset)
            break
        got += [decode_record(bytes(b))[0].queue_offset for b in res.buffers]
        offset = res.next_begin_offset
    return got, stop


@bounded(30)
@pytest.mark.parametrize("field", ["magic", "size"])
async def test_a_damaged_record_head_in_an_unverified_segment_skips_nothing_after_it(tmp_path, field):
    """A record whose head is damaged in a segment the start-up scan does not verify: reads used to take its
    segment for removed and skip the rest of it (58 intact messages of one pull window went, status FOUND, no
    word). Now reads stop there (QUEUE_DAMAGED, the queue marked), and the rebuild at the next start goes on
    from the next valid record: only the damaged message is missing, every other one is served."""
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=64, recovery_verify_segments=1)
    results = await fill(tmp_path, 900, cfg=cfg)
    bad = results[5]
    patch(tmp_path, bad.physical_offset + (4 if field == "magic" else 0),
          b"\x00\x00\x00\x00" if field == "magic" else (bad.size + 40).to_bytes(4, "big"))
    store = await reopen(tmp_path, cfg)
    got, stop = await _drain(store)
    assert got == [0, 1, 2, 3, 4] and stop == (GetStatus.QUEUE_DAMAGED, 5)
    await store.close()
    store = await reopen(tmp_path, cfg)
    assert store.report.queues_rebuilt == ["T-0"]
    got, stop = await _drain(store)
    assert stop is None and got == [r.queue_offset for r in results if r is not bad]
    assert (await store.put(req(1))).queue_offset == 900
    await store.close()


# ------------------------------------------------- damage below the checkpoint
@bounded(20)
@pytest.mark.parametrize("damage", ["flip", "truncate", "truncate-at-a-record"])
async def test_damage_the_checkpoint_vouches_for_is_no_torn_tail(tmp_path, caplog, damage):
    """Bytes below the checkpoint were flushed before it was written: a crash cannot tear them. A last segment
    cut short (by a copy, a disk, a hand) or a bad last record there used to be cut as a torn tail, with a
    WARNING, the acknowledged messages gone and their queue offsets handed to new messages; cut at a record
    boundary, not even that (zeros: the clean end). Now start-up refuses, as for damage in the middle."""
    results = await fill(tmp_path, 700)
    last_seg = max(r.physical_offset for r in results) // SEG * SEG
    victim = results[-1] if damage == "flip" else [r for r in results if r.physical_offset >= last_seg][50]
    if damage == "flip":                                # the last record: nothing valid after it
        flip(tmp_path, victim.physical_offset + 300)
    else:
        os.truncate(seg_path(tmp_path, last_seg),
                    victim.physical_offset - last_seg + (100 if damage == "truncate" else 0))
    with pytest.raises(StoreError) as err:
        await reopen(tmp_path)
    assert err.value.segment == f"{last_seg:020d}" and err.value.position == victim.physical_offset - last_seg
    assert "checkpoint" in str(err.value) and "truncate_corrupt_tail=True" in str(err.value)
    with caplog.at_level(logging.ERROR, logger="txmq.store"):
        store = await reopen(tmp_path, CUT)             # the operator's choice: start with what is left
    assert any("truncate_corrupt_tail" in r.getMessage() for r in caplog.records)
    assert store.max_offset("T", 0) == victim.queue_offset
    assert_readable(store, [r for r in results if r.queue_offset < victim.queue_offset])
    await store.close()
    store = await reopen(tmp_path)                      # accepted once: the next start needs no flag
    assert store.max_offset("T", 0) == victim.queue_offset
    await store.close()


@bounded(20)
async def test_a_lost_last_segment_or_log_is_refused(tmp_path):
    """The active segment deleted (the log then ends at the previous one's end marker), or every segment gone
    (a wrong or empty mount): start-up used to carry on, without a word, from a log that lacks acknowledged
    messages the checkpoint vouches for; queues were cut to it and their offsets refilled by new messages."""
    results = await fill(tmp_path, 700)
    last_seg = max(r.physical_offset for r in results) // SEG * SEG
    os.unlink(seg_path(tmp_path, last_seg))
    with pytest.raises(StoreError) as err:
        await reopen(tmp_path)
    assert "checkpoint" in str(err.value) and err.value.segment == f"{last_seg:020d}"
    for name in os.listdir(tmp_path / "commitlog"):
        os.unlink(tmp_path / "commitlog" / name)
    with pytest.raises(StoreError) as err:
        await reopen(tmp_path)
    assert "no segment" in str(err.value)
    store = await reopen(tmp_path, CUT)
    assert store.max_offset("T", 0) == 0 and read_checkpoint(str(tmp_path)).flushed_offset == 0
    await store.close()


@bounded(20)
async def test_a_unit_naming_an_offset_past_the_log_stops_reads_instead_of_skipping(tmp_path):
    """A consume-queue unit damaged to name an offset past the log's end was taken for a removed segment: the
    pull skipped every unit after it in its window that named an offset below that one, i.e. all of them."""
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=64, recovery_verify_segments=1)
    results = await fill(tmp_path, 900, cfg=cfg)       # unit 10's record is in the segment start-up does not scan
    with open(os.path.join(tmp_path, "consumequeue", "T", "0", f"{0:020d}"), "r+b") as f:
        f.seek(10 * 20)
        f.write((1 << 40).to_bytes(8, "big"))     # unit 10's commit-log offset
    store = await reopen(tmp_path, cfg)
    got, stop = await _drain(store)
    assert got == list(range(10)) and stop == (GetStatus.QUEUE_DAMAGED, 10)
    await store.close()
    store = await reopen(tmp_path, cfg)             # marked: rebuilt from the log
    got, stop = await _drain(store)
    assert stop is None and got == [r.queue_offset for r in results]
    await store.close()


@bounded(30)
@pytest.mark.parametrize("says", [3, 5000, 700 + (1 << 20)], ids=["down", "up", "high-bit"])
async def test_a_damaged_queue_offset_field_is_repaired_from_the_queues_sequence(tmp_path, caplog, says):
    """The QUEUEOFFSET field is outside the body CRC. Damaged to an offset already used, recovery took the
    unit for the wrong one and the rebuild left the intact record's unit pre-blank (899 of 900 served, only
    WARNINGs); damaged upward, the rebuild padded the queue to it (1 of 900 served) or asked for a consume
    queue that does not fit the disk. Now the field is checked against the queue's previous record,
    repaired and logged at ERROR: every message is served, under its own offset."""
    results = await fill(tmp_path, 900)
    bad = results[700]
    patch(tmp_path, bad.physical_offset + 20, says.to_bytes(8, "big"))
    with caplog.at_level(logging.ERROR, logger="txmq.store"):
        store = await reopen(tmp_path)
    assert any("header is damaged" in r.getMessage() and str(says) in r.getMessage() for r in caplog.records)
    got, stop = await _drain(store)
    assert stop is None and got == [r.queue_offset for r in results]
    assert store.report.queues_rebuilt == []
    assert (await store.put(req(1))).queue_offset == 900
    await store.close()


@bounded(30)
@pytest.mark.parametrize("says", [1, 700 + (1 << 20)], ids=["onto-the-next", "high-bit"])
async def test_a_damaged_queue_offset_of_a_queues_first_record_is_repaired_from_its_unit(tmp_path, caplog, says):
    """A crash with nothing flushed (checkpoint 0) scans the whole log; the first record of a queue has no previous
    one to check its QUEUEOFFSET (outside the body CRC) against. Damaged 0 -> 1, the unit at 1 (the next record's)
    was taken as stale: the queue rewritten from there, the record filed at 0 and 1 (delivered twice) and every later
    intact record's QUEUEOFFSET rewritten one up in the log (a transaction's half then names the next one's entry
    in the decision table). The queue's own unit naming exactly that record says where it is: the field is
    repaired from it, logged at ERROR."""
    results = await fill(tmp_path, 6)
    patch(tmp_path, results[0].physical_offset + 20, says.to_bytes(8, "big"))
    crashed_at(tmp_path, 0)
    with caplog.at_level(logging.ERROR, logger="txmq.store"):
        store = await reopen(tmp_path)
    assert read_queue(store) == [r.physical_offset for r in results]
    assert_readable(store, results)
    assert any("header is damaged" in r.getMessage() and str(says) in r.getMessage() for r in caplog.records)
    assert (await store.put(req(1))).queue_offset == 6
    await store.close()


async def _topic_made_again(path, cfg):
    """An open store whose topic T had 50 records, was deleted and made again with 30 (offsets from 0 anew)."""
    store = MessageStore(str(path), cfg)
    await store.open()
    assert all(r.ok for r in [await store.put(req(i)) for i in range(50)])
    await store.delete_topic("T")
    again = [await store.put(req(i)) for i in range(30)]
    assert [r.queue_offset for r in again] == list(range(30))
    return store, again


@bounded(30)
async def test_a_topic_deleted_and_made_again_restarts_its_offsets_without_a_repair(tmp_path, caplog):
    """The one legitimate break in a queue's sequence of offsets in the log: back to 0 after a delete."""
    store, again = await _topic_made_again(tmp_path, CFG)
    await store.close()
    os.unlink(tmp_path / "checkpoint")                # a full scan meets both runs of the queue
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path)
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]
    got, stop = await _drain(store)
    assert stop is None and got == list(range(30))
    assert_readable(store, again)
    await store.close()


@bounded(30)
async def test_a_queue_rebuild_after_its_topic_was_made_again_rewrites_no_record(tmp_path, caplog):
    """The queue rebuild (damage before the verified range) reads the whole log: the deleted topic's records,
    then the new one's from 0. The new run must replace the old one, as in the start-up scan; its records'
    queue offsets were taken for damage and rewritten in the commit log (1.. became 50..), the rebuilt
    queue serving the deleted topic's messages and the new ones under offsets no producer was told."""
    store, again = await _topic_made_again(tmp_path, LAST_ONLY)
    # other records push both runs of T before the verified range (the last segment)
    others = await asyncio.gather(*[store.put(PutRequest.build("U", bytes(2000))) for _ in range(SEG // 2000)])
    assert all(r.ok for r in others) and others[-1].physical_offset >= SEG
    cq = store._cqs[("T", 0)]
    store._damaged(cq, 5)                            # a pull met damage: the queue is rebuilt at the next start
    await store.close()
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path, LAST_ONLY)
    assert store.report.queues_rebuilt == ["T-0"]
    assert not [r for r in caplog.records if "rewritten" in r.getMessage()]
    assert_readable(store, again)
    assert read_queue(store) == [r.physical_offset for r in again]
    await store.close()


@bounded(30)
async def test_a_queue_offset_damaged_to_zero_is_repaired_not_taken_for_a_new_run(tmp_path, caplog):
    """0 is the one offset the repair let pass (a topic made again). A bit flip that turns 16 into 0 started
    the queue over there: the 23 intact records after it were rewritten in the log to 1..23 and the messages
    before it left the queue (40 became 24). The queue's next record going on with the old run (17) says the
    0 is damage."""
    from protocol.message import POS_QUEUE_OFFSET
    results = await fill(tmp_path, 40)
    patch(tmp_path, results[16].physical_offset + POS_QUEUE_OFFSET, bytes(8))
    os.unlink(tmp_path / "checkpoint")                # a full scan
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path)
    rewritten = [r.getMessage() for r in caplog.records if "rewritten" in r.getMessage()]
    assert len(rewritten) == 1 and "queue offset 0" in rewritten[0] and rewritten[0].endswith("rewritten to 16")
    assert_readable(store, results)
    got, stop = await _drain(store)
    assert stop is None and got == list(range(40))
    await store.close()


@bounded(30)
async def test_a_queue_offset_damaged_to_zero_before_the_verified_range_is_repaired_by_the_rebuild(tmp_path, caplog):
    """The same in the queue rebuild (damage before the verified range): only the damaged record is rewritten."""
    from protocol.message import POS_QUEUE_OFFSET
    store = MessageStore(str(tmp_path), LAST_ONLY)
    await store.open()
    results = [await store.put(req(i)) for i in range(40)]
    others = await asyncio.gather(*[store.put(PutRequest.build("U", bytes(2000))) for _ in range(SEG // 2000)])
    assert all(r.ok for r in results + others) and others[-1].physical_offset >= SEG
    store._damaged(store._cqs[("T", 0)], 5)
    await store.close()
    patch(tmp_path, results[16].physical_offset + POS_QUEUE_OFFSET, bytes(8))
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path, LAST_ONLY)
    assert store.report.queues_rebuilt == ["T-0"]
    assert len([r for r in caplog.records if "rewritten" in r.getMessage()]) == 1
    assert_readable(store, results)
    assert read_queue(store) == [r.physical_offset for r in results]
    await store.close()


def _flip_body(path, physical_offset: int) -> None:
    flip(path, physical_offset + 88)        # the first body byte (IPv4 hosts)


@bounded(30)
async def test_a_body_damaged_before_the_verified_range_is_never_pulled(tmp_path):
    """Start-up checks body CRCs only from the newest segments on: a bit flipped at rest in an older one was
    served to consumers as the message. A pull now stops before it; one that starts at it is RECORD_CORRUPT,
    counted once however often it is asked, and the records after it are there for a consumer moved past it."""
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=64, recovery_verify_segments=1)
    results = await fill(tmp_path, 900, cfg=cfg)
    _flip_body(tmp_path, results[5].physical_offset)
    store = await reopen(tmp_path, cfg)
    assert store.report.scanned_from > results[5].physical_offset
    got = store.get_messages("T", 0, 0, 32, 1 << 20)
    assert got.status is GetStatus.FOUND and got.message_count == 5 and got.next_begin_offset == 5
    for _ in range(3):
        got = store.get_messages("T", 0, 5, 32, 1 << 20)
        assert got.status is GetStatus.RECORD_CORRUPT and got.message_count == 0 and got.next_begin_offset == 5
    assert store.corrupt == {"pull": 1}
    got = store.get_messages("T", 0, 6, 32, 1 << 20)
    assert got.status is GetStatus.FOUND and got.message_count == 32
    with pytest.raises(StoreError, match="corrupt.*segment 00000000000000000000"):
        store.verified_record(results[5].physical_offset, "test")
    assert store.verified_record(results[6].physical_offset, "test") is not None
    await store.close()


@bounded(30)
@pytest.mark.parametrize("verify_all", [False, True])
async def test_verify_all_reads_checks_the_records_start_up_verified_too(tmp_path, verify_all):
    """Records start-up verified (or this process wrote) are served unchecked unless verify_all_reads: the
    CRC costs about 0.7 us a 1 KiB message on the pull path."""
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=64, verify_all_reads=verify_all)
    results = await fill(tmp_path, 10, cfg=cfg)
    store = await reopen(tmp_path, cfg)
    _flip_body(tmp_path, results[3].physical_offset)       # after start-up: through the file, as a disk would
    got = store.get_messages("T", 0, 3, 32, 1 << 20)
    if verify_all:
        assert got.status is GetStatus.RECORD_CORRUPT and store.corrupt == {"pull": 1}
    else:
        assert got.status is GetStatus.FOUND and got.message_count == 7 and store.corrupt == {}
    await store.close()


@pytest.mark.parametrize("checkpoint", ["kept", "lost"])
@bounded(30)
async def test_a_deleted_topic_gets_no_queue_from_its_old_records(tmp_path, checkpoint):
    """Recovery re-indexes the newest segments' records for queues that lack them; a deleted topic's queues
    lack them all, and came back with its old messages (the broker then served the topic again). A checkpoint
    lost too (a full scan, or the queue rebuild from the whole log) must not bring them back either."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert all(r.ok for r in [await store.put(req(i)) for i in range(20)])
    assert await store.delete_topic("T") == 1
    await store.close()
    if checkpoint == "lost":
        os.unlink(tmp_path / "checkpoint")
    store = await reopen(tmp_path)
    assert ("T", 0) not in store.queues()
    assert (await store.put(req(1))).queue_offset == 0       # made again: from 0, beside its mark
    await store.close()
    store = await reopen(tmp_path)
    assert store.queues() == [("T", 0)] and store.max_offset("T", 0) == 1
    await store.close()


@bounded(30)
async def test_a_deleted_topic_whose_mark_cannot_be_written_is_deleted_all_the_same(tmp_path, caplog, monkeypatch):
    import broker.store.store as store_module

    def full(directory, below):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "write_tombstone", full)
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert (await store.put(req(1))).ok
    with caplog.at_level(logging.ERROR, logger="txmq.store"):
        assert await store.delete_topic("T") == 1
    assert store.queues() == []
    assert any("mark not written" in r.getMessage() and "No space" in r.getMessage() for r in caplog.records)
    await store.close()


@bounded(30)
async def test_deleting_a_topic_that_has_no_queue_leaves_nothing_on_disk(tmp_path):
    """DELETE_TOPIC_IN_BROKER may name any topic (without an ACL, anyone may ask): a mark (a directory, a file,
    three fsyncs) for each name that never had a queue filled the disk with made-up names, all read at start."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert await store.delete_topic("NeverHeld") == 0
    await store.close()
    assert not (tmp_path / "consumequeue" / "NeverHeld").exists()


@bounded(30)
async def test_a_mark_above_the_recovered_log_end_hides_no_later_record(tmp_path):
    """A mark whose offset the log no longer reaches (its tail cut at recovery, power lost before the log below
    the mark was flushed): new records of a topic made again land below it, and a second crash that lost their
    units had recovery index none of them -- acknowledged messages gone from their queue."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert all(r.ok for r in [await store.put(req(i)) for i in range(3)])
    assert await store.delete_topic("T") == 1
    end = store.max_physical_offset
    await store.close()
    (tmp_path / "consumequeue" / "T" / "deleted").write_text(str(end + 10 * SEG))    # the log cut below it
    store = await reopen(tmp_path)
    assert (await store.put(req(1))).queue_offset == 0      # T made again
    await store.close()
    shutil.rmtree(tmp_path / "consumequeue" / "T" / "0")     # its units lost by a second crash
    os.unlink(tmp_path / "checkpoint")
    store = await reopen(tmp_path)
    assert store.max_offset("T", 0) == 1
    await store.close()


@pytest.mark.parametrize("killed", ["before any removal", "after the files, before the directories"])
@bounded(30)
async def test_a_delete_cut_short_by_a_kill_does_not_bring_the_topic_back(tmp_path, monkeypatch, killed):
    """delete_topic removed the queues, then wrote the mark: a kill in between left no mark, and recovery
    re-indexed the topic's records (its queues back, old messages and all). And queue files a kill left
    beside the mark were loaded as the topic's queues."""
    import broker.store.store as store_module

    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert all(r.ok for r in [await store.put(req(i)) for i in range(5)])
    qdir = tmp_path / "consumequeue" / "T" / "0"
    kept = tmp_path / "kept"
    shutil.copytree(qdir, kept)

    def kill(*a, **k):
        raise RuntimeError("killed")

    if killed == "after the files, before the directories":
        monkeypatch.setattr(store_module.shutil, "rmtree", kill)
    try:
        assert await store.delete_topic("T") == 1
    except RuntimeError:        # the kill: nothing after it in the delete ran
        assert killed != "before any removal"
    await store.close()
    if killed == "before any removal":
        # the state a kill after the mark, before any removal, leaves: every old queue file still there
        shutil.rmtree(qdir, ignore_errors=True)
        shutil.copytree(kept, qdir)
    monkeypatch.undo()
    os.unlink(tmp_path / "checkpoint")
    store = await reopen(tmp_path)
    assert ("T", 0) not in store.queues()
    await store.close()


@bounded(60)
async def test_a_mark_the_log_no_longer_reaches_below_is_removed_at_open(tmp_path):
    """Once retention removed every segment below a deleted topic's mark, it hides nothing: kept, each topic
    ever deleted left a directory read at every start, for good."""
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert all(r.ok for r in [await store.put(req(i)) for i in range(5)])
    assert await store.delete_topic("T") == 1
    mark = int((tmp_path / "consumequeue" / "T" / "deleted").read_text())
    while store.min_physical_offset < mark:
        if len(store.segments()) < 2:       # roll past the mark, so the segment holding it can go
            assert (await store.put(PutRequest.build("U", b"x" * 2000))).ok
            continue
        await store.remove_segment(store.segments()[0].name, "test")
    await store.close()
    store = await reopen(tmp_path)
    assert not (tmp_path / "consumequeue" / "T").exists()
    await store.close()


@bounded(20)
async def test_a_copy_refused_for_its_queue_file_is_not_kept_by_the_queues_last_error(tmp_path, monkeypatch):
    # A decision builds its records (an older broker's NUL half's copy, counted for the writer by copying) and then
    # makes the new queue's file (prepare_queue). A queue the writer made without its file (EMFILE) raised its
    # stored last_error: re-raised, that exception took the caller's frames into its traceback, and the queue kept
    # it, so the refused copy stayed alive, counted in the writer's nul_copies, and every later batch of every
    # producer was scanned for it (Writer._vouch_first) until a descriptor came free for that queue.
    import errno
    import gc

    odd = await _older_store(tmp_path)
    store = await reopen(tmp_path)
    no_descriptor_for(monkeypatch, "Late")
    assert (await store.put(PutRequest.build("Late", b"y"))).ok     # the writer made the queue, its file not
    assert not store._writer.nul_copies

    def decision():         # as TransactionService._decision_begin: the copy first, then its queue's file
        reqs = [store.copying(odd.physical_offset, PutRequest.build("Late", b"x" * 100, properties={"k": "v\x00w"}))]
        assert store._writer.nul_copies
        for r in reqs:
            store.prepare_queue(r.topic, r.queue_id)

    with pytest.raises(OSError) as refused:
        decision()
    assert refused.value.errno == errno.EMFILE
    del refused
    gc.collect()
    assert not store._writer.nul_copies
    await store.close()


@bounded(20)
async def test_a_cut_at_an_unvouched_copy_is_not_made_again_over_the_log_written_since(tmp_path, monkeypatch):
    # A crash between an older NUL copy's write and its mark: the next start cuts the log where the copy began and
    # removes the file saying where (nul_copy_from), then writes on there. That removal was not synced: a power
    # loss could bring the file back, and the start after it cut there again, taking every record written and
    # acknowledged since (checkpointed too) without a word. The removal is synced before anything is written, and
    # a file below the checkpoint (nothing past an unvouched copy is checkpointed) cuts nothing.
    from broker.store.manifest import NUL_COPY_FILE, read_nul_copy_from
    odd = await _older_store(tmp_path)
    store = await reopen(tmp_path)
    images = image_each_flush(monkeypatch, tmp_path)     # the disk as a crash before each flush returns may leave it
    copy = store.copying(odd.physical_offset, PutRequest.build("C", b"x" * 100, properties={"k": "v\x00w"}))
    c = await store.put(copy)
    assert c.ok
    await store.close()
    monkeypatch.undo()
    img = next(i for i in images if read_nul_copy_from(str(i)) == c.physical_offset
               and (i / "commitlog" / f"{0:020d}").read_bytes()[c.physical_offset + 4:][:4] == b"\xda\xa3\x20\xa7")
    crashed_at(img, c.physical_offset)          # the copy's own flush, before its mark: a crash there
    synced = []
    real_fsync_dir = __import__("broker.store.store", fromlist=["fsync_dir"]).fsync_dir

    def fsync_dir(path):
        synced.append((os.path.realpath(path), os.path.exists(os.path.join(path, NUL_COPY_FILE))))
        real_fsync_dir(path)

    monkeypatch.setattr("broker.store.store.fsync_dir", fsync_dir)
    store = await reopen(img)
    assert [t.position for t in store.report.truncations] == [c.physical_offset]
    assert (os.path.realpath(img), False) in synced, synced      # the file's removal made durable
    after = [await store.put(req(8)) for _ in range(3)]         # written where the copy was, acknowledged
    assert all(r.ok for r in after) and after[0].physical_offset == c.physical_offset
    await store.close()
    with open(img / NUL_COPY_FILE, "w") as f:   # a power loss took the removal back (had it not been synced)
        f.write(f"{c.physical_offset}\n")
    store = await reopen(img)
    assert store.report.truncations == [] and store.max_offset("T", 0) == 5
    assert_readable(store, after)
    await store.close()


@bounded(30)
async def test_a_refused_rebuild_mark_is_written_again_once_it_fits(tmp_path, caplog, monkeypatch):
    """A read that meets zeroed units marks the queue for a rebuild at the next start. A full disk (or no
    descriptor free) that refused the mark was logged and never tried again: the restart an operator made to
    have the queue rebuilt rebuilt nothing, and its reads stopped at the damage again. The store tries again
    (said once, and once more when written) until it is on disk."""
    import builtins
    import errno

    import broker.store.consume_queue as cqmod
    results = await fill(tmp_path, 900, cfg=LAST_ONLY)
    qdir = tmp_path / "consumequeue" / "T" / "0"
    _zero_units(qdir / f"{64 * 20:020d}", 6, 17)            # queue offsets 70..80, records in segment 0
    refusals = []

    def full_disk_open(path, *args, **kwargs):
        if str(path).endswith(cqmod.DAMAGE_MARK) and len(refusals) < 3:
            refusals.append(path)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return builtins.open(path, *args, **kwargs)
    monkeypatch.setattr(cqmod, "open", full_disk_open, raising=False)
    store = await reopen(tmp_path, LAST_ONLY)
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        assert store.get_messages("T", 0, 70, 32, 1 << 20).status is GetStatus.QUEUE_DAMAGED
        # Polled until the write is done (said), bounded by the test: the file exists from its open on, before
        # its line is written and synced; the disk loop tries again each 0.5 s, three refusals first.
        while not any("rebuild mark written again" in r.getMessage() for r in caplog.records):
            await asyncio.sleep(0.05)
        assert (qdir / "DAMAGED").read_text() == f"queue offset 70, file {64 * 20:020d}\n"
    assert len(refusals) == 3
    said = [r.getMessage() for r in caplog.records if "rebuild" in r.getMessage()]
    assert len([m for m in said if "could not mark it for a rebuild" in m]) == 1, said       # said once
    assert len([m for m in said if "rebuild mark written again" in m]) == 1, said
    await store.close()
    store = await reopen(tmp_path, LAST_ONLY)
    assert store.report.queues_rebuilt == ["T-0"]
    assert read_queue(store) == [r.physical_offset for r in results]
    await store.close()


@bounded(30)
async def test_a_refused_rebuild_mark_of_a_deleted_queue_is_not_tried_again(tmp_path, monkeypatch):
    """The queue whose mark a full disk refused is deleted (its topic with it): its mark is no longer wanted.
    Tried again, it failed every 0.5 s for the broker's life (silently: said once already) and, once a topic of
    the same name was made again, landed in the new queue's directory: the next start rebuilt a healthy queue."""
    import builtins
    import errno

    import broker.store.consume_queue as cqmod
    await fill(tmp_path, 900, cfg=LAST_ONLY)
    qdir = tmp_path / "consumequeue" / "T" / "0"
    _zero_units(qdir / f"{64 * 20:020d}", 6, 17)
    full = [True]
    tries = []

    def full_disk_open(path, *args, **kwargs):
        if str(path).endswith(cqmod.DAMAGE_MARK):
            tries.append(full[0])
            if full[0]:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return builtins.open(path, *args, **kwargs)
    monkeypatch.setattr(cqmod, "open", full_disk_open, raising=False)
    store = await reopen(tmp_path, LAST_ONLY)
    probes = [0]
    probe = store.disk.probe

    def counted_probe():
        probes[0] += 1
        return probe()
    monkeypatch.setattr(store.disk, "probe", counted_probe)
    assert store.get_messages("T", 0, 70, 32, 1 << 20).status is GetStatus.QUEUE_DAMAGED
    while len(tries) < 2:           # the first write and one retry, refused
        await asyncio.sleep(0.05)
    assert await store.delete_topic("T") == 1
    assert (await store.put(req(0))).ok             # T made again: a new, healthy queue 0 in the same directory
    full[0] = False
    start = probes[0]
    while probes[0] < start + 3:    # three turns of the disk loop, which tries refused marks again
        await asyncio.sleep(0.05)
    assert not (qdir / "DAMAGED").exists()
    assert False not in tries, "the deleted queue's mark was tried again"
    await store.close()


@bounded(30)
async def test_a_rebuild_mark_still_refused_at_the_stop_is_said(tmp_path, caplog, monkeypatch):
    """The mark is tried once more at the stop; still refused, the next start will not rebuild the queue. The
    only word of it was the first ERROR, which said it would be tried again until written: the stop says so."""
    import builtins
    import errno

    import broker.store.consume_queue as cqmod
    await fill(tmp_path, 900, cfg=LAST_ONLY)
    qdir = tmp_path / "consumequeue" / "T" / "0"
    _zero_units(qdir / f"{64 * 20:020d}", 6, 17)

    def full_disk_open(path, *args, **kwargs):
        if str(path).endswith(cqmod.DAMAGE_MARK):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return builtins.open(path, *args, **kwargs)
    monkeypatch.setattr(cqmod, "open", full_disk_open, raising=False)
    store = await reopen(tmp_path, LAST_ONLY)
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        assert store.get_messages("T", 0, 70, 32, 1 << 20).status is GetStatus.QUEUE_DAMAGED
        await store.close()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [m for m in said if "stopped with its rebuild mark unwritten" in m and str(qdir) in m], said
    assert not (qdir / "DAMAGED").exists()


@bounded(20)
async def test_a_torn_record_before_intact_ones_of_its_write_is_refused_naming_the_file_and_the_way_out(tmp_path):
    """A power loss part-way through the flush of one write (a list: a commit's message and its op record)
    may leave a later page on disk and an earlier one not: a torn record with sound ones after it. Recovery
    cannot tell that from a damaged acknowledged record, and keeping the sound ones is no way out (the op
    without its message: a transaction decided, never delivered). The refusal said acknowledged data lay
    beyond and named a StoreConfig field; it names the file, what the flag discards, and says both causes."""
    store = await reopen(tmp_path)
    before = await store.put(req(0))
    batch = await store.put_many([req(i) for i in range(1, 6)])
    end = batch[-1].physical_offset + batch[-1].size
    await store.close()
    crashed_at(tmp_path, batch[0].physical_offset)
    patch(tmp_path, batch[0].physical_offset + batch[0].size - 3, b"\0\0\0")    # its properties' page lost
    with pytest.raises(StoreError) as err:
        await reopen(tmp_path)
    text = str(err.value)
    assert err.value.position == batch[0].physical_offset
    assert f"(file {seg_path(tmp_path, 0)}; " in text
    assert f"({end - batch[0].physical_offset} bytes to the end of the data)" in text
    assert "may have been acknowledged" in text and "power loss" in text
    assert "--truncate-corrupt-tail" in text
    store = await reopen(tmp_path, CUT)
    assert store.max_offset("T", 0) == 1 and store.max_physical_offset == batch[0].physical_offset
    assert_readable(store, [before])
    await store.close()


@bounded(20)
async def test_a_sealed_segment_cut_short_names_the_brokers_flag(tmp_path):
    """A sealed segment cut short with later ones after it: the refusal told a broker's operator to set
    StoreConfig(truncate_corrupt_tail=True), a name no flag of the broker has, and nothing of
    --keep-corrupt-records, which cannot help there (the lost bytes have no extent to skip)."""
    results = await fill(tmp_path, 700)
    assert max(r.physical_offset for r in results) >= SEG          # a sealed segment and a later one
    os.truncate(seg_path(tmp_path, 0), SEG // 2)
    with pytest.raises(StoreError) as err:
        await reopen(tmp_path)
    text = str(err.value)
    assert "--truncate-corrupt-tail" in text and "StoreConfig(" not in text, text
    assert "--keep-corrupt-records" in text, text                 # said why it is not offered


@bounded(30)
async def test_a_queue_whose_files_were_lost_keeps_its_newest_record_a_sibling_waits_for(tmp_path):
    """Queue 1's consume-queue files lost; the scan (the newest segment only) first meets queue 1 at offset N,
    right after queue 0's record N - 1, the last of queue 0. Queue 0 "misses exactly that offset" and a QUEUEID
    repair from the log sequence alone moved the intact record there: rewritten on disk, delivered from queue 0,
    queue 1 one short. Queue 0 has no record after it, so nothing says the field was damaged."""
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=64, recovery_verify_segments=1)
    n = 700
    store = MessageStore(str(tmp_path), cfg)
    await store.open()
    for i in range(n):                                  # queue 1: 0..n-1, over a segment
        before = await store.put(req(i, queue_id=1))
    for i in range(n):                                  # queue 0: 0..n-1, ending in the newest segment
        assert (await store.put(req(i, queue_id=0))).ok
    last = await store.put(req(n, queue_id=1))          # queue 1's offset n, right after queue 0's last
    assert last.queue_offset == n and last.physical_offset // SEG > before.physical_offset // SEG   # alone there
    await store.close()
    shutil.rmtree(tmp_path / "consumequeue" / "T" / "1")
    store = await reopen(tmp_path, cfg)
    assert (store.max_offset("T", 0), store.max_offset("T", 1)) == (n, n + 1)
    msg, _ = decode_record(bytes(store.get_record(last.physical_offset)), check_crc=True)
    assert msg.queue_id == 1
    await store.close()


@bounded(30)
async def test_a_kept_record_leaves_the_count_and_corrupt_kept_with_its_segment(tmp_path):
    """Retention removing the segment of a record kept in place (keep_corrupt_records) left it in the store's kept
    set and its corrupt_kept file for as long as the broker ran: txmq_store_kept_corrupt_records (the alert) held
    a loss no pull can meet any more, and the file kept every offset ever kept until some later start."""
    config = StoreConfig(segment_size=8192, max_message_size=8000)
    store = MessageStore(str(tmp_path), config)
    await store.open()
    old = await store.put(PutRequest.build("Old", b"o" * 7500))       # alone in the first segment
    for _ in range(3):
        assert (await store.put(PutRequest.build("New", b"n" * 3000))).ok
    await store.close()
    write_corrupt_kept(str(tmp_path), {old.physical_offset})        # as a start keeping it would have written

    store = MessageStore(str(tmp_path), config)
    await store.open()
    assert store.kept_corrupt == 1
    await store.remove_segment(store.segments()[0].name, "test")
    assert store.kept_corrupt == 0
    assert read_corrupt_kept(str(tmp_path)) == frozenset()
    await store.close()


@pytest.mark.parametrize("where", ["verified", "older"])
@bounded(30)
async def test_a_queue_rebuilt_from_the_whole_log_serves_a_record_whose_type_bit_flipped(tmp_path, caplog, where):
    """The start-up scan reads a record typed PREPARED/ROLLBACK (bit 0x4 of SYSFLAG, outside the CRC) that carries
    its queue's next offset with the bit put back; the rebuild of a queue that lost units before the verified range
    (a zeroed, cut or missing queue file) read it as typed: no unit, a blank at its offset, and every later record
    of its queue "damaged", its QUEUEOFFSET rewritten one down in the log: the message lost unsaid."""
    results = await fill(tmp_path, 900, cfg=LAST_ONLY)      # two segments; queue files of 64 units
    victim = results[700 if where == "verified" else 200]
    assert (victim.physical_offset >= SEG) == (where == "verified")
    patch(tmp_path, victim.physical_offset + 39, bytes([0x04]))       # SYSFLAG's low byte: NOT -> PREPARED
    os.unlink(tmp_path / "consumequeue" / "T" / "0" / f"{64 * 20:020d}")
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        store = await reopen(tmp_path, LAST_ONLY)
    assert any("rebuilding the queue" in r.getMessage() for r in caplog.records)
    assert not any("its header is damaged" in r.getMessage() for r in caplog.records)
    assert store.max_offset("T", 0) == 900
    assert read_queue(store) == [r.physical_offset for r in results]
    await store.close()


@bounded(30)
async def test_a_slave_writes_corrupt_kept_for_its_masters_kept_record_through_a_full_disk(tmp_path, monkeypatch):
    """A record failing its body CRC that the master sends twice the same is its own kept in place: the slave
    takes it and names it in corrupt_kept, in append_replica, before the record is in its log (written later, a
    kill -9 between left a slave that refused to start: tests/integration/test_torn_mid_log.py). Refused there (a
    full disk), the OSError dropped the link: the master sent the record again, the slave refused it again, and
    copied nothing more until the disk had room. Now the copy goes on and the disk loop writes the file once there
    is room (txmq_store_corrupt_kept_unwritten meanwhile)."""
    results = await fill(tmp_path / "m", 3)
    master = await reopen(tmp_path / "m")
    sound, damaged, after = results
    chunks = [bytes(master.replica_chunk(r.physical_offset, r.size)) for r in results]
    await master.close()
    bad = bytearray(chunks[1])
    body_at = bad.find(b"\x01" * 2000)
    bad[body_at + 1000] ^= 0xFF
    slave = MessageStore(str(tmp_path / "s"), CFG)
    await slave.open()
    slave.set_replica_only()
    room, seen = [False], []

    def write_kept(store_dir, offsets):
        seen.append((set(offsets), threading.current_thread() is threading.main_thread()))
        if not room[0]:
            raise OSError(28, "No space left on device")
        write_corrupt_kept(store_dir, offsets)

    monkeypatch.setattr("broker.store.store.write_corrupt_kept", write_kept)
    try:
        fut, at = slave.append_replica(0, chunks[0])
        assert (await fut).ok
        with pytest.raises(ValueError):
            slave.append_replica(at, bytes(bad))
        fut, at = slave.append_replica(at, bytes(bad))     # the same again: the master's kept record
        assert (await fut).ok and at == damaged.physical_offset + damaged.size
        fut, at = slave.append_replica(at, chunks[2])      # the copy goes on
        assert (await fut).ok and at == after.physical_offset + after.size
        while not slave.kept_unwritten:                     # refused: said in the gauge (bounded by the test)
            await asyncio.sleep(0.05)
        room[0] = True
        while slave.kept_unwritten or read_corrupt_kept(slave.store_dir) != {damaged.physical_offset}:
            await asyncio.sleep(0.05)
    finally:
        await slave.close()
    assert seen and seen[0][1], seen             # the first try: in append_replica, before the record is copied
    assert not any(on_loop for _, on_loop in seen[1:]), seen    # the retries: the disk loop's, off the loop


@bounded(60)
async def test_segments_removed_in_one_pass_are_not_said_gone_at_the_starts_after(tmp_path, caplog):
    """Removals that finished (each writes segments.json after its unlink) are no segments gone: a kill right after
    any of them, or a stop and two starts after all of them, says nothing, counts nothing, keeps the newest removed."""
    from broker.store.manifest import removed_from_disk, sealed_from_disk
    await fill(tmp_path, 2200)      # four segments of ~520 records, the fourth active
    store = await reopen(tmp_path)
    assert not store.report.gone_segments
    names = [s.name for s in store.segments()[:3]]
    for name in names:
        await store.remove_segment(name, "test")
        # the state a kill now leaves: the manifest no longer names it
        assert name not in sealed_from_disk(str(tmp_path)) and removed_from_disk(str(tmp_path)).name == name
    await store.close()
    for _ in range(2):
        caplog.clear()
        store = await reopen(tmp_path)
        assert store.report.gone_segments == [] and store.min_physical_offset == 3 * SEG
        assert "gone from disk" not in caplog.text
        await store.close()
        assert removed_from_disk(str(tmp_path)).name == names[-1]


@bounded(60)
async def test_segments_gone_with_a_copy_are_said_once_with_the_manifests_counts(tmp_path, caplog):
    """Two oldest segments missed by a copy: both named, their records summed from the manifest's entries (not made
    up: a segment gone has no bytes to count), the newest kept as "removed"; the start after says nothing."""
    from broker.store.manifest import removed_from_disk, sealed_from_disk
    await fill(tmp_path, 2200)
    known = sealed_from_disk(str(tmp_path))
    names = [f"{0:020d}", f"{SEG:020d}"]
    for name in names:
        os.unlink(os.path.join(tmp_path, "commitlog", name))
    store = await reopen(tmp_path)
    assert store.report.gone_segments == names
    records = known[names[0]].records + known[names[1]].records
    assert records > 900 and f"{records} records went with them" in caplog.text
    await store.close()
    assert removed_from_disk(str(tmp_path)).name == names[-1]
    caplog.clear()
    store = await reopen(tmp_path)
    assert store.report.gone_segments == [] and "gone from disk" not in caplog.text
    await store.close()


@bounded(60)
async def test_many_segments_gone_are_said_as_a_span_not_each_name(tmp_path, caplog):
    """A copy that missed months of segments (3,900 named by a manifest: 86 KB of names) made one WARNING line past
    what journald keeps as one line (48 KiB): the count, the first and the last are said, every name in the report."""
    config = StoreConfig(segment_size=8192, max_message_size=8000)
    await fill(tmp_path, 130, size=3000, cfg=config)        # two records a segment: 65 segments
    names = sorted(os.listdir(tmp_path / "commitlog"))[:60]
    for name in names:
        os.unlink(os.path.join(tmp_path, "commitlog", name))
    store = await reopen(tmp_path, config)
    assert store.report.gone_segments == names
    (said,) = [r.getMessage() for r in caplog.records if "gone from disk" in r.getMessage()]
    assert f"60 commit-log segments {names[0]}..{names[-1]}, named by the segment manifest" in said
    assert names[1] not in said and len(said) < 1000
    await store.close()


@bounded(60)
async def test_segments_gone_past_what_an_older_manifest_named_are_said_uncounted(tmp_path, caplog):
    """A copy taken as docs/operations.md says (segments.json first, commitlog/ last) of a store whose retention
    removed two segments meanwhile: its manifest named the first only as sealed. The WARNING said one segment and
    its records went, the log starting two segments later: the second segment and its records said nowhere."""
    import shutil

    from broker.store.manifest import sealed_from_disk
    store = MessageStore(str(tmp_path), CFG)
    await store.open()
    assert all(r.ok for r in await asyncio.gather(*[store.put(req(i)) for i in range(700)]))   # 0 sealed, 1 active
    await store.refresh_manifest(force=True)
    shutil.copy(tmp_path / "segments.json", tmp_path / "segments.copied")
    named = sealed_from_disk(str(tmp_path))
    assert list(named) == [f"{0:020d}"]
    first_ts, last_ts = named[f"{0:020d}"].first_ts, named[f"{0:020d}"].last_ts
    assert all(r.ok for r in await asyncio.gather(*[store.put(req(i)) for i in range(1000)]))  # 1, 2 sealed
    for _ in range(2):
        await store.remove_segment(store.segments()[0].name, "test")
    await store.close()
    os.replace(tmp_path / "segments.copied", tmp_path / "segments.json")
    store = await reopen(tmp_path)
    assert store.report.gone_segments == [f"{0:020d}"] and store.min_physical_offset == 2 * SEG
    (said,) = [r.getMessage() for r in caplog.records if "gone from disk" in r.getMessage()]
    assert (f"records went with them (stored {first_ts}..{last_ts}); more went with the log from {SEG} to "
            f"{2 * SEG}, which the manifest did not name as sealed") in said
    await store.close()
