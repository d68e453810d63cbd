"""A full disk at the store's corrupt_kept file (keep_corrupt_records): the record is kept all the same, the
file written once there is room, and a restart without the flag keeps it again.

The store runs on its own small tmpfs, filled to the last page by a ballast file. Mounting needs root;
elsewhere the test is skipped and says why.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from dataclasses import replace

import pytest

from broker.store import MessageStore
from broker.store.checkpoint import read_checkpoint, write_checkpoint
from broker.store.manifest import CORRUPT_KEPT_FILE, read_corrupt_kept
from tests.fault.test_disk_full_marks import CFG, _fill, _logged, _req
from tests.integration.test_torn_mid_log import (FLAGS, PLAIN, _delivered, _flip, _kept_count, _kept_now, _load,
                                                 _newest, _records)
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.tmpfs import tmpfs

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


def _no_segment_reserved(store) -> None:
    """As a broker that ran on the full disk leaves its store: no next segment reserved ahead, whose removal at the
    start (it holds nothing) would give the start room."""
    for name in os.listdir(store / "commitlog"):
        if not _records(store / "commitlog" / name):
            os.unlink(store / "commitlog" / name)


async def _twenty_written(store_dir) -> int:
    """Twenty records put in a store at ``store_dir``, closed, left as a broker on the full disk leaves it; the log's
    end they reach."""
    store = MessageStore(str(store_dir), CFG)
    await store.open()
    assert all(r.ok for r in [await store.put(_req(i)) for i in range(20)])
    end = store.max_physical_offset
    await store.close()
    _no_segment_reserved(store_dir)
    return end


@contextlib.asynccontextmanager
async def _opened(store_dir, cfg=CFG):
    """The store at ``store_dir`` opened with ``cfg``, closed at the end."""
    store = MessageStore(str(store_dir), cfg)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@bounded(150)
async def test_a_record_kept_on_a_full_disk_is_remembered_once_there_is_room(tmp_path):
    """A start with --keep-corrupt-records on a full disk could not write corrupt_kept and refused to start (the
    ENOSPC of a few bytes of bookkeeping), where a full disk otherwise starts, serves reads and refuses writes. It
    starts now, keeps the record (a pull stops at it), says the file is not written, writes it by itself once there
    is room (no restart), and a kill -9 then a start without the flag keep the record again: every other message
    served."""
    with tmpfs(tmp_path / "disk", "48m") as store:     # (the broker's log beside it, on a disk with room)
        b = BrokerProcess(store, *FLAGS).start()
        try:
            plain, _, _ = await _load(b)
        finally:
            b.kill()
        path = _newest(store)
        pos, _size, _topic, body = [r for r in _records(path) if r[2] == "TornPlain"][PLAIN // 2]
        _flip(path, pos + 88 + 300, 0x10)       # a byte of its body (IPv4 hosts: from byte 88): its CRC fails
        lost = body[:10].rstrip(b"\0")
        _no_segment_reserved(store)
        kept_file = store / CORRUPT_KEPT_FILE
        _fill(store / "ballast", bound=48 * 256)

        b = BrokerProcess(store, *FLAGS, "--keep-corrupt-records").start()
        try:
            assert _kept_now(b) == 1
            got, errors = await _delivered(b, "TornPlain")
            assert sorted(got) == [p for p in plain if p != lost] and len(errors) == 1, (len(got), errors)
            await _logged(b, f"{CORRUPT_KEPT_FILE} not written")
            assert not kept_file.exists()
            # the ERROR is said once: the gauge holds while a restart without the flag would refuse the record
            assert _kept_count(b, "txmq_store_corrupt_kept_unwritten") == 1
            os.unlink(store / "ballast")
            await _logged(b, f"{CORRUPT_KEPT_FILE} written again")
            assert _kept_count(b, "txmq_store_corrupt_kept_unwritten") == 0
            assert kept_file.read_text().split() == [str(int(os.path.basename(path)) + pos)]
        finally:
            b.kill()

        b = BrokerProcess(store, *FLAGS).start()        # remembered: no flag needed
        try:
            assert _kept_now(b) == 1
            again, errors = await _delivered(b, "TornPlain")
            assert sorted(again) == sorted(got) and len(errors) == 1, (len(again), errors)
        finally:
            b.stop()


@bounded(60)
async def test_a_start_on_a_full_disk_drops_a_kept_record_no_longer_in_the_log_once_there_is_room(tmp_path):
    """corrupt_kept naming a record no longer in the log (its segment removed while the disk was full, whose rewrite
    was refused and left to the next start; or the log cut below it): that start, on the still full disk, failed
    with ENOSPC rewriting the file without it. It starts now, counts the kept record still in the log, and rewrites
    the file without the other once there is room."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        store_dir = disk / "store"
        await _twenty_written(store_dir)
        kept_file = store_dir / CORRUPT_KEPT_FILE
        # one kept record in the log (its first), one past its end (as one a start cut the log below leaves): the
        # file rewritten holds a line, which takes a page (an empty one would not)
        kept_file.write_text(f"0\n{1 << 40}\n")
        _fill(disk / "ballast")
        async with _opened(store_dir) as store:
            assert store.kept_corrupt == 1
            os.unlink(disk / "ballast")
            # (the file removed meanwhile, it naming an offset past the log's end: see the test below)
            while not kept_file.exists() or kept_file.read_text().split() != ["0"]:   # the disk loop's next turn
                await asyncio.sleep(0.05)


@bounded(60)
async def test_a_stale_kept_offset_past_the_log_end_never_names_a_sound_record_written_there(tmp_path):
    """corrupt_kept naming an offset at or past the log's end (a --truncate-corrupt-tail start cut the log below a
    kept record) is rewritten without it at the start, before the log writes there again. On a full disk that
    rewrite was left to the disk loop (half a second), while a write takes space as soon as it is back (it probes
    again itself): the next record went to that very offset with the file still naming it, and a kill -9 then had
    the next start keep that sound, acknowledged record as damaged (a pull stops at it: the message lost)."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        store_dir = disk / "store"
        end = await _twenty_written(store_dir)
        kept_file = store_dir / CORRUPT_KEPT_FILE
        # as a start that cut the log below a kept record leaves it, beside one kept in the log (its first: the
        # file rewritten then holds a line, which takes a page)
        kept_file.write_text(f"0\n{end}\n")
        _fill(disk / "ballast")
        async with _opened(store_dir) as store:
            assert store.kept_corrupt == 1
            os.unlink(disk / "ballast")
            assert not store.disk.probe()       # (as the next write does itself, 50 ms after the last probe)
            put = await store.put(_req(99))
            assert put.ok and put.physical_offset == end, put
            crashed = tmp_path / "crashed"      # the store as a kill -9 now leaves it
            shutil.copytree(store_dir, crashed, ignore=shutil.ignore_patterns("lock"))
    assert end not in read_corrupt_kept(str(crashed)), "the file still names the sound record's offset"
    async with _opened(crashed) as store:
        got = store.get_messages("T", 0, 20, 1, 1 << 20)
        assert got.message_count == 1, got.status
        got.buffers.clear()


@bounded(60)
async def test_no_checkpoint_passes_a_kept_record_the_corrupt_kept_file_does_not_name(tmp_path):
    """A record whose TOPIC is damaged (outside the body CRC) is judged by a start only past the checkpoint:
    below it, a later start reads it as sound and it is lost without a word, unless corrupt_kept names it. Kept on
    a full disk, the file was left to the disk loop (every half second) while the checkpoint loop wrote its own
    file as soon as there was room: the checkpoint passed the record with the file unwritten, and a kill -9 then
    a start without the flag lost the message silently (not refused, not counted)."""
    cfg = replace(CFG, checkpoint_interval_ms=20, keep_corrupt_records=True)
    with tmpfs(tmp_path / "disk", "4m") as disk:
        store_dir = disk / "store"
        await _twenty_written(store_dir)
        seg = _newest(store_dir)
        pos, _size, _topic, body = _records(seg)[10]
        phys = int(os.path.basename(seg)) + pos
        _flip(seg, pos + 88 + len(body) + 1, 0x40)        # its topic "T" -> "\x14" (IPv4 hosts)
        point = read_checkpoint(str(store_dir))
        write_checkpoint(str(store_dir), point._replace(flushed_offset=phys))    # as a kill -9 before it leaves it
        _fill(disk / "ballast")
        async with _opened(store_dir, cfg) as store:
            assert store.kept_corrupt == 1
            os.unlink(disk / "ballast")
            while read_checkpoint(str(store_dir)).flushed_offset <= phys:    # the checkpoint loop's next turns
                await asyncio.sleep(0.005)
            # the store as a kill -9 now leaves it
            shutil.copytree(store_dir, tmp_path / "crashed", ignore=shutil.ignore_patterns("lock"))
    assert phys in read_corrupt_kept(str(tmp_path / "crashed")), "the checkpoint passed a record the file lacks"
    async with _opened(tmp_path / "crashed") as store:        # without the flag
        assert store.kept_corrupt == 1
