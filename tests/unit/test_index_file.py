"""The index file (RocketMQ's IndexFile layout) and the index service's catch-up, without a broker."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import struct
import threading
import zlib

import pytest

from broker.store import MessageStore, PutRequest, StoreConfig
from broker.store import index as index_mod
from broker.store.index import IndexService, record_keys
from protocol.errors import StoreError
from broker.store.index_file import ENTRY, ENTRY_SIZE, HEADER, IndexCorrupt, IndexFile, file_size, key_hash
from tests.support.bounded import bounded

SLOTS, ENTRIES = 16, 10


def _new(tmp_path, name="20240101000000000", **kw):
    return IndexFile.create(str(tmp_path / name), SLOTS, ENTRIES, **kw)


def test_key_hash_is_javas_abs_hashcode():
    # "topic#key".hashCode() from Java: values computed with the JDK.
    assert key_hash("a") == 97
    assert key_hash("TopicTest#KEY1") == abs(_java_hash("TopicTest#KEY1"))
    assert key_hash("订单#1") == abs(_java_hash("订单#1"))
    assert key_hash("polygenelubricants") == 0      # hashCode is Integer.MIN_VALUE: abs stays negative -> 0


def _java_hash(s):
    h = 0
    data = s.encode("utf-16-be")
    for (u,) in struct.iter_unpack(">H", data):
        h = (31 * h + u) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def test_layout_is_rocketmqs(tmp_path):
    f = _new(tmp_path)
    assert os.path.getsize(f.path) == 40 + 4 * SLOTS + 20 * ENTRIES == file_size(SLOTS, ENTRIES)
    f.put_many([(5, 1000, 1_700_000_000_000), (21, 2000, 1_700_000_003_500)])
    raw = open(f.path, "rb").read()
    assert HEADER.unpack_from(raw, 0) == (1_700_000_000_000, 1_700_000_003_500, 1000, 2000, 1, 3)
    # both hashes land in slot 5 (21 % 16): the slot holds entry 2, whose PREV is entry 1
    assert struct.unpack_from(">i", raw, 40 + 4 * 5)[0] == 2
    base = 40 + 4 * SLOTS
    assert ENTRY.unpack_from(raw, base + 20 * 1) == (5, 1000, 0, 0)
    assert ENTRY.unpack_from(raw, base + 20 * 2) == (21, 2000, 3, 1)


def test_collisions_follow_the_chain_and_keep_only_their_hash(tmp_path):
    f = _new(tmp_path)
    f.put_many([(3, 100, 1000), (19, 200, 1000), (3, 300, 2000), (35, 400, 2000)])   # all slot 3
    assert f.select(3, 0, 10**13) == [300, 100]
    assert f.select(19, 0, 10**13) == [200]
    assert f.select(35, 0, 10**13) == [400]
    assert f.select(4, 0, 10**13) == []
    assert f.select(3, 0, 10**13, limit=1) == [300]


def test_full_file_takes_no_more(tmp_path):
    f = _new(tmp_path)
    assert f.put_many([(i, i * 10, 1000) for i in range(1, 20)]) == ENTRIES - 1
    assert f.full and f.put_many([(1, 1, 1)]) == 0


def test_reopen_undoes_a_batch_cut_before_its_header(tmp_path):
    f = _new(tmp_path)
    f.put_many([(3, 100, 1000)])
    header = open(f.path, "rb").read(40)
    f.put_many([(3, 200, 1000), (19, 300, 1000)])       # then "crash": the header goes back
    with open(f.path, "r+b") as fh:
        fh.write(header)
    f.close()
    g = IndexFile.open(f.path, SLOTS, ENTRIES)
    assert g.count == 2 and g.select(3, 0, 10**13) == [100] and g.select(19, 0, 10**13) == []
    g.put_many([(3, 400, 1000)])
    assert g.select(3, 0, 10**13) == [400, 100]


def test_damaged_header_is_refused(tmp_path):
    f = _new(tmp_path)
    f.put_many([(3, 100, 1000)])
    with open(f.path, "r+b") as fh:
        fh.seek(36)
        fh.write(struct.pack(">i", ENTRIES + 5))
    with pytest.raises(IndexCorrupt, match="exceeds"):
        IndexFile.open(f.path, SLOTS, ENTRIES)
    with pytest.raises(IndexCorrupt, match="bytes, not"):
        IndexFile.open(f.path, SLOTS * 2, ENTRIES)


# ------------------------------------------------------------------ the service over a real store
async def _store_with(tmp_path, n, *, keys=lambda i: f"k{i} shared", seg=4096 * 4):
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=seg, max_message_size=2048))
    await store.open()
    for i in range(n):
        props = {"KEYS": keys(i), "UNIQ_KEY": f"U{i:04d}"}
        res = await store.put(PutRequest.build("T", b"x" * 100, properties=props))
        assert res.ok
    return store


async def _service(tmp_path, store, **kw):
    kw.setdefault("entries", ENTRIES)
    svc = IndexService(str(tmp_path), segment_size=store.config.segment_size, slots=SLOTS, **kw)
    store.add_dispatch_listener(svc.on_dispatch)
    await svc.open(store.min_physical_offset, store.max_physical_offset)
    return svc


def test_entries_a_full_disk_cuts_short_are_not_counted(tmp_path, monkeypatch):
    """A write that meets a full disk part-way returns the bytes that fit, without an error (write(2)): the
    entries' pwrite was not checked, and a batch cut short was counted whole -- zeroed entries that the slots
    named, their keys lost for good and each slot's older entries cut off behind them. Now the rest is written,
    and the full disk's error raised before the slots or the header say anything."""
    f = _new(tmp_path)
    f.put_many([(3, 100, 1000)])
    real = os.pwrite

    def cut_short(fd, data, at):
        if fd == f.fd and len(data) > ENTRY_SIZE:       # the entries of a batch: the first one fits
            monkeypatch.setattr(os, "pwrite", no_room)
            return real(fd, bytes(data)[:ENTRY_SIZE - 4], at)
        return real(fd, data, at)

    def no_room(fd, data, at):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwrite", cut_short)
    with pytest.raises(OSError) as err:
        f.put_many([(19, 200, 1000), (35, 300, 1000)])      # slot 3, as the first
    monkeypatch.undo()
    assert err.value.errno == errno.ENOSPC
    assert f.count == 2 and f.select(3, 0, 10**13) == [100]
    f.close()
    f = IndexFile.open(f.path, SLOTS, ENTRIES)              # as a resume reads it back
    assert f.count == 2 and f.select(3, 0, 10**13) == [100] and f.select(19, 0, 10**13) == []
    f.close()


async def test_service_catches_up_rolls_files_and_finds_every_key(tmp_path):
    store = await _store_with(tmp_path, 40)          # spans several segments and 3 entries a record
    svc = await _service(tmp_path, store)
    found = (await asyncio.wait_for(svc.query("T", "k7", 64, 0, 2**62), 10)).found
    assert len(found) == 1 and record_keys(store.get_record(found[0]))[3] == "U0007"
    shared = (await svc.query("T", "shared", 64, 0, 2**62)).found
    assert len(shared) == 40 and shared == sorted(shared, reverse=True)
    assert (await svc.query("T", "U0039", 64, 0, 2**62))[0] == [shared[0]]
    assert (await svc.query("Other", "k7", 64, 0, 2**62))[0] == []
    assert len(svc.files) >= 120 // (ENTRIES - 1)
    # live dispatches after open, then a key added across a file boundary
    res = await store.put(PutRequest.build("T", b"y", properties={"KEYS": "late"}))
    assert (await svc.query("T", "late", 64, 0, 2**62))[0] == [res.physical_offset]
    await svc.close()
    await store.close()


def _fd_paths() -> dict[str, str]:
    """This process's descriptors and what each names (from /proc/self/fd; one closed meanwhile left out)."""
    paths = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return paths


def _open_index_files(tmp_path) -> int:
    """Descriptors this process holds on files of ``tmp_path/index``."""
    index_dir = str(tmp_path / "index") + os.sep
    return sum(path.startswith(index_dir) for path in _fd_paths().values())


async def _restarted_with_older_files_parked(tmp_path, monkeypatch, kept=2):
    """(store, service, descriptors it may hold on index files): 40 records over ~14 index files, the service
    started again so the older files' descriptors are closed, OPEN_INDEX_FILES set to ``kept``."""
    monkeypatch.setattr(index_mod, "OPEN_INDEX_FILES", kept)
    store = await _store_with(tmp_path, 40)
    svc = await _service(tmp_path, store)
    await svc.close()
    svc = await _service(tmp_path, store)
    return store, svc, kept + 2     # the file being written and its slot table's mapping (mmap dups it)



@bounded(20)
async def test_a_start_over_many_index_files_holds_few_of_them_open_at_once(tmp_path, monkeypatch):
    """The start read every index file back with its descriptor open and closed the older ones only once all were
    read: ~2,600 open at once over 30 days of retention (one a day at 10k sends/s is ~86 files), and a store of 600
    under a 256 open-files limit failed to start ("[Errno 24] Too many open files" on an index file); a resume reads
    them back the same way beside the files it keeps. Each older file is closed as the next is read."""
    store, svc, held = await _restarted_with_older_files_parked(tmp_path, monkeypatch)
    files = len(svc.files)
    await svc.close()
    seen = []
    real = IndexFile.open

    def counted(*args, **kw):
        seen.append(_open_index_files(tmp_path))
        return real(*args, **kw)
    monkeypatch.setattr(IndexFile, "open", counted)
    svc = await _service(tmp_path, store)
    assert len(seen) == files >= 10
    assert max(seen) <= 1, f"{max(seen)} index descriptors open while reading {files} files back"
    assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 40
    assert _open_index_files(tmp_path) <= held
    await svc.close()
    await store.close()

@bounded(20)
async def test_older_index_files_hold_no_descriptor_beyond_the_ones_last_queried(tmp_path, monkeypatch):
    """Every index file kept its descriptor open for as long as it existed: ~86 files a day at 10k sends/s of two
    keys, ~2,600 descriptors over 30 days of retention, beside the segments and connections under one open-files
    limit. Now the file being written and the OPEN_INDEX_FILES last queried; a query reopens the others."""
    monkeypatch.setattr(index_mod, "OPEN_INDEX_FILES", 2)
    held = 2 + 2        # the two last queried; the file being written and its slot table's mapping (mmap dups it)
    store = await _store_with(tmp_path, 40)
    svc = await _service(tmp_path, store)
    assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 40      # every file read once
    files = len(svc.files)
    assert files >= 10 and _open_index_files(tmp_path) <= held     # (15 for 14 files before)
    await svc.close()
    svc = await _service(tmp_path, store)                                       # a start opens each file once
    assert _open_index_files(tmp_path) == 1
    for i in range(40):
        assert len((await svc.query("T", f"k{i}", 64, 0, 2**62)).found) == 1
        assert _open_index_files(tmp_path) <= held
    assert len(svc.files) == files
    await svc.close()
    assert _open_index_files(tmp_path) == 0
    await store.close()


@bounded(20)
async def test_a_query_that_cannot_open_an_older_index_file_again_is_refused_naming_it(tmp_path):
    """An older file's descriptor is closed (OPEN_INDEX_FILES): one removed under the broker cannot be opened
    again, and the query is answered SYSTEM_ERROR naming it (StoreError) -- not a traceback of the dispatcher."""
    store = await _store_with(tmp_path, 40)
    svc = await _service(tmp_path, store)
    await svc.close()
    svc = await _service(tmp_path, store)
    oldest = svc.files[0]
    assert oldest.parked
    os.unlink(oldest.path)
    with pytest.raises(StoreError, match=oldest.name) as refused:
        await svc.query("T", "k0", 64, 0, 2**62)
    assert "rebuilt from the commit log" in str(refused.value)         # what to do: ask again after it
    assert len((await svc.query("T", "k39", 1, 0, 2**62)).found) == 1         # the thread serves on
    await svc.close()
    await store.close()


async def test_corrupt_file_is_rebuilt_with_a_clear_log_line(tmp_path, caplog):
    store = await _store_with(tmp_path, 12)
    svc = await _service(tmp_path, store)
    assert len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 12
    names = [f.name for f in svc.files]
    await svc.close()
    with open(os.path.join(tmp_path, "index", names[1]), "r+b") as fh:
        fh.truncate(100)
    caplog.set_level(logging.ERROR, "txmq.index")
    svc = await _service(tmp_path, store)
    assert len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 12
    assert any(f"index file {names[1]} is damaged" in r.getMessage() and "rebuilding" in r.getMessage()
               for r in caplog.records)
    await svc.close()
    await store.close()


async def test_unindexed_topics_get_no_entry_live_or_caught_up(tmp_path):
    # The transaction op topic's records are never looked up by key (RocketMQ's op messages have no UNIQ_KEY):
    # the broker gives it as unindexed; a record of it written before the service opened (catch-up from the
    # log) or after (live dispatch) gets no entry, and the records around it keep theirs.
    store = await _store_with(tmp_path, 3)
    await store.put(PutRequest.build("OPS", b"1", properties={"KEYS": "op", "UNIQ_KEY": "OP1"}))
    svc = await _service(tmp_path, store, unindexed=("OPS",))
    await store.put(PutRequest.build("OPS", b"2", properties={"KEYS": "op", "UNIQ_KEY": "OP2"}))
    late = await store.put(PutRequest.build("T", b"y", properties={"KEYS": "op", "UNIQ_KEY": "U9"}))
    for key in ("OP1", "OP2", "op"):
        assert (await svc.query("OPS", key, 64, 0, 2**62))[0] == []
    assert (await svc.query("T", "op", 64, 0, 2**62))[0] == [late.physical_offset]
    assert len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 3
    assert sum(f.count - 1 for f in svc.files) == 3 * 3 + 2      # no entry for either op record
    await svc.close()
    await store.close()


async def test_expire_removes_files_below_the_log(tmp_path):
    store = await _store_with(tmp_path, 30)
    svc = await _service(tmp_path, store)
    await svc.query("T", "x", 1, 0, 1)
    first = svc.files[0]
    assert await svc.expire(first.end_phy) == []
    gone = await svc.expire(first.end_phy + 1)
    assert gone[0] == first.name and not os.path.exists(first.path)
    await svc.expire(2**62)
    assert len(svc.files) == 1             # never the last file
    await svc.close()
    await store.close()


@bounded(30)
async def test_a_key_behind_many_newer_entries_of_a_colliding_key_is_found(tmp_path):
    """"Aa" and "BB" have one String.hashCode, so T#Aa and T#BB share every index entry chain. The query took
    2 * maxNum + 16 entries of the hash per file and dropped the other key's: one message of Aa behind 100 of BB
    was answered as absent (0 of 1), where RocketMQ's client would at least have had BB's to filter. Now every
    entry of the hash is read until maxNum records of the key are found."""
    assert key_hash("T#Aa") == key_hash("T#BB")
    store = await _store_with(tmp_path, 1, keys=lambda i: "Aa")
    for _ in range(100):
        assert (await store.put(PutRequest.build("T", b"b", properties={"KEYS": "BB"}))).ok
    svc = IndexService(str(tmp_path), segment_size=store.config.segment_size, slots=SLOTS, entries=1000)
    store.add_dispatch_listener(svc.on_dispatch)
    await svc.open(store.min_physical_offset, store.max_physical_offset)
    try:
        found = (await svc.query("T", "Aa", 32, 0, 2**62)).found
        assert len(svc.files) == 1 and [record_keys(store.get_record(p))[4] for p in found] == [["Aa"]]
        assert len((await svc.query("T", "BB", 32, 0, 2**62))[0]) == 32
    finally:
        await svc.close()
        await store.close()


@bounded(30)
async def test_a_query_reads_at_most_max_checks_records_of_its_hash_and_says_so(tmp_path):
    """A query read every record of its hash until it had maxNum of its key: 50,000 of "BB" held the index
    thread 0.8-1.4 s for a query of "Aa" (never stored), no record indexed meanwhile, and the broker's other
    clients 3x slower at p99. Now it reads max_checks of them at most, answers what it found and says it stopped
    (cut, counted once per query); a key found within the bound is not cut."""
    store = await _store_with(tmp_path, 1, keys=lambda i: "Aa")
    for _ in range(30):
        assert (await store.put(PutRequest.build("T", b"b", properties={"KEYS": "BB"}))).ok
    svc = IndexService(str(tmp_path), segment_size=store.config.segment_size, slots=SLOTS, entries=1000)
    store.add_dispatch_listener(svc.on_dispatch)
    await svc.open(store.min_physical_offset, store.max_physical_offset)
    svc.max_checks = 20
    try:
        behind = await svc.query("T", "Aa", 32, 0, 2**62)    # the one Aa is behind 30 BB
        assert (behind.found, behind.cut, svc.queries_cut) == ([], True, 1)
        bb = await svc.query("T", "BB", 8, 0, 2**62)
        assert (len(bb.found), bb.cut, svc.queries_cut) == (8, False, 1)
        some = await svc.query("T", "BB", 32, 0, 2**62)      # 20 read, 20 found, 10 left unread
        assert (len(some.found), some.cut, svc.queries_cut) == (20, True, 2)
        svc.max_checks = 31
        whole = await svc.query("T", "Aa", 32, 0, 2**62)
        assert (len(whole.found), whole.cut, svc.queries_cut) == (1, False, 2)
    finally:
        await svc.close()
        await store.close()


@bounded(30)
async def test_a_query_reads_a_bounded_number_of_entries_of_its_slot_whatever_their_hash(tmp_path):
    """max_checks counted the records of the key's own hash read; the entries of other hashes in its slot (slots
    are hash % 5,000,000: any client can fill one) and those newer than endTimestamp were walked uncounted, one
    pread each: 100,000 of them held the index thread 0.66-0.81 s a query, a million some 7 s. Now a query reads at
    most max_reads entries in all, and says it stopped as when max_checks is reached."""
    assert key_hash("T#Y3") % SLOTS == key_hash("T#X") % SLOTS and key_hash("T#Y3") != key_hash("T#X")
    store = await _store_with(tmp_path, 61, keys=lambda i: "Y3" if i == 0 else "X")
    svc = IndexService(str(tmp_path), segment_size=store.config.segment_size, slots=SLOTS, entries=1000)
    store.add_dispatch_listener(svc.on_dispatch)
    await svc.open(store.min_physical_offset, store.max_physical_offset)
    svc.max_reads = 40
    try:
        behind = await svc.query("T", "Y3", 32, 0, 2**62)       # behind 60 X of its slot, none of its hash
        assert (behind.found, behind.cut, svc.queries_cut) == ([], True, 1)
        x = await svc.query("T", "X", 8, 0, 2**62)
        assert (len(x.found), x.cut, svc.queries_cut) == (8, False, 1)
        svc.max_reads = 200
        whole = await svc.query("T", "Y3", 32, 0, 2**62)
        assert (len(whole.found), whole.cut, svc.queries_cut) == (1, False, 1)
    finally:
        await svc.close()
        await store.close()


@bounded(30)
async def test_a_time_range_is_answered_to_the_millisecond_both_ends_inclusive(tmp_path):
    """An entry holds its store time in whole seconds from its file's first: a message stored 300 ms after the
    file's first was taken as stored with it. Asked for exactly its store time it was answered NOT FOUND (0 of 1),
    and a range that ended before it returned it all the same. Now each record's own store time is checked."""
    base = 1_700_000_000_000
    now = [base]
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048),
                         clock=lambda: now[0])
    await store.open()
    at = []
    for now[0] in (base, base + 300, base + 1_700):
        at.append((await store.put(PutRequest.build("T", b"x", properties={"KEYS": "k"}))).physical_offset)
    svc = await _service(tmp_path, store)
    try:
        for begin, end, want in ((base + 300, base + 300, [at[1]]), (base, base + 299, [at[0]]),
                                 (base + 1, base + 1_699, [at[1]]), (base + 301, base + 1_700, [at[2]]),
                                 (base, base + 1_700, at[::-1]), (base + 1_701, base + 5_000, [])):
            assert (await svc.query("T", "k", 64, begin, end))[0] == want, (begin - base, end - base)
    finally:
        await svc.close()
        await store.close()


@bounded(30)
async def test_a_wall_clock_stepped_back_leaves_an_index_file_the_next_start_keeps(tmp_path, caplog):
    """Store times are the wall clock's: stepped back (NTP) after a file's first entry, the next entry set the
    file's END TIMESTAMP below its BEGIN TIMESTAMP, and every start after it took the file for damaged (ERROR),
    removed it with every newer file and indexed their part of the log again. The header now keeps the newest
    store time it saw."""
    base = 1_700_000_000_000
    now = [base + 5_000]
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048),
                         clock=lambda: now[0])
    await store.open()
    svc = await _service(tmp_path, store)
    at = []
    try:
        for now[0], key in ((base + 5_000, "before"), (base, "after")):
            at.append((await store.put(PutRequest.build("T", b"x", properties={"KEYS": key}))).physical_offset)
            assert (await svc.query("T", key, 64, 0, 2**62))[0] == [at[-1]]
    finally:
        await svc.close()
    svc = await _service(tmp_path, store)
    try:
        assert svc.rebuilt == [] and "damaged" not in caplog.text
        assert [(await svc.query("T", key, 64, 0, 2**62))[0] for key in ("before", "after")] == [[at[0]], [at[1]]]
    finally:
        await svc.close()
        await store.close()


async def test_a_failed_write_stops_indexing_until_a_restart_catches_up(tmp_path, monkeypatch):
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    await svc.query("T", "x", 1, 0, 1)
    real = IndexFile.put_many

    def no_space(self, items):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(IndexFile, "put_many", no_space)
    lost = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
    assert (await svc.query("T", "lost", 64, 0, 2**62))[0] == [] and "No space" in svc.failed
    monkeypatch.setattr(IndexFile, "put_many", real)
    await store.put(PutRequest.build("T", b"z", properties={"KEYS": "after"}))
    await svc.close()
    svc = await _service(tmp_path, store)
    assert (await svc.query("T", "lost", 64, 0, 2**62))[0] == [lost.physical_offset]
    assert len((await svc.query("T", "after", 64, 0, 2**62))[0]) == 1
    await svc.close()
    await store.close()


@bounded(20)
@pytest.mark.parametrize("method, error, entries, said", [
    ("put_many", errno.ENOSPC, ENTRIES, "once the disk has room"),
    # (a new index file every 3 entries, not opened: the process out of descriptors)
    ("create", errno.EMFILE, 4, "by itself once the error passes (tried again every"),
], ids=["full-disk", "no-descriptor"])
async def test_indexing_a_full_disk_stopped_resumes_once_there_is_room(tmp_path, monkeypatch, caplog, method, error,
                                                                       entries, said):
    """A full disk stopped indexing until the next restart: every message stored from then on was missing from
    queries by key (mqadmin queryMsgByKey, a transaction's lookup by UNIQ_KEY) for as long as the broker ran.
    Now the index is read back and caught up from the log once a write fits again, without a restart; while the
    disk stays full the attempts fail without another word. Any other OSError of the index -- a new index file not
    opened while the process was out of descriptors (EMFILE), a slot table not mapped (ENOMEM at vm.max_map_count),
    an I/O error that passed -- still stopped it until the next restart (txmq_index_failed 1, the alert firing for
    good): it is now tried again as a full disk's is."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store, entries=entries)
    svc.resume_every_s = 0          # at each wake-up of the index thread (the default paces it by 10 s)
    await svc.query("T", "x", 1, 0, 1)
    real = getattr(IndexFile, method)

    def refused(*args, **kw):
        raise OSError(error, os.strerror(error))
    monkeypatch.setattr(IndexFile, method, refused)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        lost = [await store.put(PutRequest.build("T", b"z", properties={"KEYS": f"lost{i}"})) for i in range(3)]
        for _ in range(3):          # each query a turn of the index thread: a resume tried, and failing
            assert (await svc.query("T", "lost2", 64, 0, 2**62))[0] == []
    assert svc.stopped
    stops = [r.getMessage() for r in caplog.records if "indexing stops here" in r.getMessage()]
    assert len(stops) == 1 and said in stops[0], stops      # once, not once per attempt
    monkeypatch.setattr(IndexFile, method, real)
    await _found_after_the_resume(svc, store, lost)


async def _found_after_the_resume(svc, store, lost):
    """Once the fault is gone: the keys of ``lost`` (lost0, lost1, ...) and of a record stored now are found, the
    index no longer stopped, nothing indexed twice; the service and the store closed."""
    after = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "after"}))     # wakes the index thread
    for _ in range(10):             # the resume's catch-up is queued behind a query already waiting
        if (await svc.query("T", "after", 64, 0, 2**62))[0]:
            break
    assert not svc.stopped
    for i, res in enumerate(lost):
        assert (await svc.query("T", f"lost{i}", 64, 0, 2**62))[0] == [res.physical_offset]
    assert (await svc.query("T", "after", 64, 0, 2**62))[0] == [after.physical_offset]
    assert len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 3        # nothing indexed twice
    await svc.close()
    await store.close()


@bounded(20)
async def test_a_resume_on_a_file_system_turned_read_only_does_not_take_the_index_files_for_damaged(
        tmp_path, monkeypatch, caplog):
    """A full disk stopped indexing, then the file system turned read-only (ext4 errors=remount-ro): the resume
    read the files back, each open failed EROFS, and it was said as "index file ... is damaged: removing it and
    rebuilding" with the file and every newer one unlinked (seen on a real ext4: three ERRORs, the removal failing
    only because the disk was read-only; an EMFILE at that moment would have deleted every index file). An error
    that says nothing of the file stops indexing (tried again, as any OSError), said once, and leaves the files as
    they are."""
    store = await _store_with(tmp_path, 12)
    svc = await _service(tmp_path, store)
    assert len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 12
    names = sorted(os.listdir(os.path.join(tmp_path, "index")))
    svc.resume_every_s = 0

    def no_space(self, items):
        raise OSError(errno.ENOSPC, "No space left on device")

    def read_only(*args, **kw):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(IndexFile, "put_many", no_space)
    monkeypatch.setattr(IndexFile, "open", read_only)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
        for _ in range(4):          # each query a turn of the index thread: the resume tried
            await svc.query("T", "lost", 64, 0, 2**62)
    said = [r.getMessage() for r in caplog.records]
    assert not any("damaged" in m for m in said), said
    assert set(names) <= set(os.listdir(os.path.join(tmp_path, "index")))      # none removed
    assert sum("indexing stops here" in m for m in said) == 2, said     # the full disk, then the read-only one
    assert "tried again every" in said[-1] and "Read-only file system" in said[-1], said
    assert svc.stopped
    await svc.close()
    await store.close()


@bounded(20)
async def test_a_resume_on_a_file_system_turned_read_only_keeps_answering_from_the_index_files(tmp_path, monkeypatch):
    """A write of the index refused on a file system turned read-only (a batch, or the progress save 10 s later) and
    the resume closed every index file before reading them back: each open (O_RDWR) failed EROFS, and from then on
    every query by key answered nothing (QUERY_NOT_FOUND, a late COMMIT's dead-letter lookup "not looked up ... to
    offset 0") for the rest of the run, though the files were all there to read. A resume that cannot read them back
    keeps the ones it had, answering from them, and says searched as far as before."""
    store = await _store_with(tmp_path, 12)
    svc = await _service(tmp_path, store)
    svc.resume_every_s = 0
    assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 12

    def read_only(*args, **kw):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(IndexFile, "put_many", read_only)
    monkeypatch.setattr(IndexFile, "open", read_only)
    lost = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
    for _ in range(4):              # each query a turn of the index thread: the resume tried, and failing
        answer = await svc.query("T", "shared", 64, 0, 2**62)
    assert svc.stopped and svc.failed and "Read-only" in svc.failed
    assert len(answer.found) == 12 and answer.behind == lost.physical_offset, answer
    await svc.close()
    await store.close()


@bounded(20)
async def test_a_damaged_index_file_a_read_only_file_system_keeps_is_said_once(tmp_path, monkeypatch, caplog):
    """A resume on a file system turned read-only that found an index file damaged: "is damaged: removing it" and
    "could not remove index file" (EROFS) at ERROR, then the catch-up's write refused again -- and the next resume
    found the same file, said both again: two ERRORs every 10 s for as long as the disk stayed read-only. Said once
    a failure run, as the write errors are."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store, entries=4)       # (a new file every 3 entries)
    svc.resume_every_s = 0
    await svc.query("T", "x", 1, 0, 1)
    damaged = svc.files[-1].path
    real_open, real_unlink = IndexFile.open, os.unlink

    def read_only(*args, **kw):
        raise OSError(errno.EROFS, "Read-only file system")

    def opened(path, *args, **kw):
        if path == damaged:
            raise IndexCorrupt("header cut short")
        return real_open(path, *args, **kw)

    def unlink(path, *args, **kw):
        if os.path.dirname(str(path)) == str(tmp_path / "index"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_unlink(path, *args, **kw)
    monkeypatch.setattr(IndexFile, "put_many", read_only)
    monkeypatch.setattr(IndexFile, "create", read_only)
    monkeypatch.setattr(IndexFile, "open", opened)
    monkeypatch.setattr(os, "unlink", unlink)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
        for _ in range(6):          # each query a turn of the index thread: resumes, their catch-ups refused
            await svc.query("T", "x", 1, 0, 1)
    monkeypatch.setattr(os, "unlink", real_unlink)
    said = [r.getMessage() for r in caplog.records]
    assert svc.stopped and os.path.exists(damaged)
    assert sum("is damaged" in m for m in said) == 1, said
    assert sum("could not remove index file" in m for m in said) == 1, said
    await svc.close()
    await store.close()


@bounded(20)
async def test_an_index_file_not_opened_for_lack_of_descriptors_is_not_taken_for_damaged(tmp_path, monkeypatch):
    """An index file a start (or a resume) could not open because the process was out of descriptors (EMFILE) was
    taken for damaged: removed with every newer file, ERROR "is damaged", all of it rebuilt from the log. The error
    is raised now (a start fails saying the open-files limit; a resume is tried again), the files kept."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    await svc.query("T", "x", 1, 0, 1)
    await svc.close()
    names = sorted(os.listdir(tmp_path / "index"))
    real = IndexFile.open

    def no_descriptor(*args, **kw):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(IndexFile, "open", no_descriptor)
    with pytest.raises(OSError, match="Too many open files"):
        await _service(tmp_path, store)
    assert sorted(os.listdir(tmp_path / "index")) == names
    monkeypatch.setattr(IndexFile, "open", real)
    svc = await _service(tmp_path, store)
    assert svc.rebuilt == [] and len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 3
    await svc.close()
    await store.close()




@bounded(20)
@pytest.mark.parametrize("error, then", [(errno.EIO, "passes"), (errno.EACCES, "passes"), (errno.EIO, "removed")])
async def test_an_index_file_a_start_cannot_read_is_kept_not_taken_for_damaged(tmp_path, monkeypatch, caplog, error,
                                                                               then):
    """An I/O error reading an index file's header at start-up (a flaky disk's transient EIO), or a file the broker
    may not open (EACCES: a broker run once as root left it root's), was taken for damage: that file and every newer
    one unlinked ("is damaged ... removing it and the N newer files") and all their entries re-read from the commit
    log, a full rebuild for an error that passes. Only a file that cannot be the index (IndexCorrupt) is damage now:
    the start answers from the files before it, indexing stopped (said once, naming the file and what to do if the
    error stays), removes nothing, and reads them all once the error passes -- nothing rebuilt."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store, entries=3)        # (a new file every 2 entries)
    await svc.query("T", "x", 1, 0, 1)
    await svc.close()
    names = sorted(os.listdir(tmp_path / "index"))
    files = [n for n in names if n != "progress"]
    assert len(files) >= 3
    unreadable = str(tmp_path / "index" / files[1])
    real = IndexFile._load

    def failing(self):
        if self.path == unreadable:
            raise OSError(error, os.strerror(error), self.path)
        return real(self)
    monkeypatch.setattr(IndexFile, "_load", failing)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        svc = await _service(tmp_path, store, entries=3)
        svc.resume_every_s = 0
        for _ in range(3):          # each query a turn of the index thread: a resume tried, and failing
            answer = await svc.query("T", "shared", 64, 0, 2**62)
    said = [r.getMessage() for r in caplog.records]
    assert not any("damaged" in m for m in said), said
    advice = f"remove that file, the {len(files) - 2} newer ones and progress from {tmp_path / 'index'}"
    assert len(said) == 1 and said[0].startswith(f"index: index file {files[1]} could not be read (") and \
        advice in said[0] and "[Errno" not in said[0], said
    assert svc.stopped and [f.name for f in svc.files] == files[:1]
    assert answer.behind == svc.files[0].end_phy and len(answer.found) < 3, answer
    assert sorted(os.listdir(tmp_path / "index")) == names
    monkeypatch.setattr(IndexFile, "_load", real)
    if then == "removed":           # the error stays: the operator does what the ERROR says, the broker running
        for name in files[1:] + ["progress"]:
            os.unlink(tmp_path / "index" / name)
        names = files[:1]
    keyed = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "shared"}))
    for _ in range(10):             # the resume's catch-up is queued behind a query already waiting
        answer = await svc.query("T", "shared", 64, 0, 2**62)
        if answer.behind is None:
            break
    assert not svc.stopped and svc.rebuilt == [] and len(answer.found) == 4 and keyed.physical_offset in answer.found
    assert set(names) <= set(os.listdir(tmp_path / "index"))
    assert len({phy for i in range(3) for phy in (await svc.query("T", f"k{i}", 64, 0, 2**62)).found}) == 3
    await svc.close()
    await store.close()



@bounded(20)
async def test_a_damaged_index_file_below_the_logs_first_offset_says_what_is_not_rebuilt(tmp_path, caplog):
    """A damaged index file whose records retention had partly removed: its entries were said rebuilt "from the
    commit log from offset 0", while the catch-up began at the log's first offset and the entries of the records
    below it were gone for good (no query could find them: each match's record is read back). Said as it is."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    first = (await svc.query("T", "k1", 64, 0, 2**62)).found
    await svc.close()
    path = svc.files[0].path
    with open(path, "r+b") as fh:                   # an index count past the file's entries
        fh.seek(36)
        fh.write(struct.pack(">i", ENTRIES + 5))
    svc = IndexService(str(tmp_path), segment_size=store.config.segment_size, slots=SLOTS, entries=ENTRIES)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        await svc.open(first[0], store.max_physical_offset)     # (as if retention removed the first record)
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and f"from offset {first[0]} (not those of records below" in said[0], said
    assert (await svc.query("T", "k1", 64, 0, 2**62)).found == first
    await svc.close()
    await store.close()

@bounded(20)
async def test_an_index_file_a_resume_cannot_read_is_kept_and_read_once_the_error_passes(tmp_path, monkeypatch,
                                                                                         caplog):
    """A write error stopped indexing, and the resume met an EIO reading an index file back: the file and every
    newer one were unlinked as damaged and rebuilt. The files are kept now, answering as before; the resume is tried
    again (said once) and reads them once the error passes."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store, entries=3)
    svc.resume_every_s = 0
    await svc.query("T", "x", 1, 0, 1)
    names = sorted(os.listdir(tmp_path / "index"))
    real_put, real_load = IndexFile.put_many, IndexFile._load

    def no_space(self, items):
        raise OSError(errno.ENOSPC, "No space left on device")

    def failing(self):
        raise OSError(errno.EIO, "Input/output error", self.path)
    monkeypatch.setattr(IndexFile, "put_many", no_space)
    monkeypatch.setattr(IndexFile, "_load", failing)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        lost = [await store.put(PutRequest.build("T", b"z", properties={"KEYS": f"lost{i}"})) for i in range(2)]
        for _ in range(4):          # each query a turn of the index thread: the resume tried, and failing
            assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 3
    said = [r.getMessage() for r in caplog.records]
    assert not any("damaged" in m for m in said), said
    assert set(names) <= set(os.listdir(tmp_path / "index"))
    assert sum("Input/output error" in m for m in said) == 1, said
    monkeypatch.setattr(IndexFile, "put_many", real_put)
    monkeypatch.setattr(IndexFile, "_load", real_load)
    await _found_after_the_resume(svc, store, lost)
@bounded(20)
async def test_an_index_directory_removed_while_the_broker_runs_is_rebuilt(tmp_path, monkeypatch):
    """index/ removed under a running broker (an operator's cleanup): the entries went on into the unlinked file
    until its progress save (index/progress.tmp) failed ENOENT, which stopped indexing until the next restart --
    every key stored before and after missing from queries. The save's error is now tried again like any
    OSError: the directory made again, and the index rebuilt from the commit log."""
    monkeypatch.setattr(index_mod, "PROGRESS_EVERY_S", 0)     # a progress save at each turn of the thread
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    svc.resume_every_s = 0
    await svc.query("T", "x", 1, 0, 1)
    shutil.rmtree(tmp_path / "index")
    after = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "after"}))
    for _ in range(10):             # turns of the index thread: the save refused, the resume, its catch-up
        if len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 3 and not svc.stopped:
            break
    assert not svc.stopped and (tmp_path / "index").is_dir()
    assert (await svc.query("T", "after", 64, 0, 2**62))[0] == [after.physical_offset]
    assert len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 3
    await svc.close()
    await store.close()


@bounded(20)
async def test_the_index_files_removed_but_not_their_directory_are_rebuilt(tmp_path, monkeypatch):
    """``rm index/*`` under a running broker (the directory kept): the entries went on into the unlinked files and
    the next progress save wrote a new progress file that said them indexed, no error; the next start found no file
    and that progress and started from it -- every key stored before it missing from queries by key for good."""
    monkeypatch.setattr(index_mod, "PROGRESS_EVERY_S", 0)     # a progress save at each turn of the thread
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    svc.resume_every_s = 0
    await svc.query("T", "x", 1, 0, 1)
    for name in os.listdir(tmp_path / "index"):
        os.unlink(tmp_path / "index" / name)
    after = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "after"}))
    for _ in range(10):             # turns of the index thread: a save, a resume, its catch-up
        await svc.query("T", "x", 1, 0, 1)
    await svc.close()
    svc = await _service(tmp_path, store)
    for _ in range(10):             # the start's catch-up
        if not svc.partial:
            break
        await svc.query("T", "x", 1, 0, 1)
    assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 3
    assert (await svc.query("T", "after", 64, 0, 2**62)).found == [after.physical_offset]
    await svc.close()
    await store.close()


@bounded(20)
async def test_an_index_file_a_failing_disk_cannot_stat_is_not_taken_for_removed(tmp_path, monkeypatch, caplog):
    """The progress save looks for index files removed under it (``rm index/*``) by path: os.path.exists, False for
    ANY error of stat(2) -- EIO from a failing disk, EACCES. A file that was there was taken for removed, and the
    resume unlinked every index file and the progress and rebuilt the whole index from the commit log (WARNING "its
    files were removed under the running broker"). Only ENOENT says a file is gone; another error stops indexing,
    tried again as any OSError, the files kept."""
    monkeypatch.setattr(index_mod, "PROGRESS_EVERY_S", 0)     # a progress save at each turn of the thread
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    svc.resume_every_s = 0
    await svc.query("T", "x", 1, 0, 1)
    index_dir = str(tmp_path / "index")
    names = sorted(n for n in os.listdir(index_dir) if n.isdigit())
    real_stat = os.stat

    def failing_disk(path, *args, **kw):
        if isinstance(path, str) and os.path.dirname(path) == index_dir and os.path.basename(path).isdigit():
            raise OSError(errno.EIO, "Input/output error", path)
        return real_stat(path, *args, **kw)
    monkeypatch.setattr(os, "stat", failing_disk)
    with caplog.at_level(logging.WARNING, logger="txmq.index"):
        lost = [await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost0"}))]
        for _ in range(4):          # turns of the index thread: saves, resumes
            await svc.query("T", "x", 1, 0, 1)
    monkeypatch.setattr(os, "stat", real_stat)
    said = [r.getMessage() for r in caplog.records]
    assert not any("removed under the running broker" in m for m in said), said
    assert set(names) <= set(os.listdir(index_dir))      # none removed
    assert sum("indexing stops here" in m and "Input/output error" in m for m in said) == 1, said
    await _found_after_the_resume(svc, store, lost)


@bounded(20)
async def test_index_files_removed_while_stopped_with_the_progress_left_are_rebuilt(tmp_path):
    """The index files removed while the broker was stopped, ``progress`` left (``rm index/2*``): the start found no
    file, took the progress, and indexed nothing before it -- every key stored until then not found, for good."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    await svc.query("T", "x", 1, 0, 1)
    await svc.close()
    for name in os.listdir(tmp_path / "index"):
        if name.isdigit():
            os.unlink(tmp_path / "index" / name)
    assert os.listdir(tmp_path / "index") == [index_mod.PROGRESS_FILE]
    svc = await _service(tmp_path, store)
    assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 3
    await svc.close()
    await store.close()


@bounded(20)
async def test_a_log_of_records_without_keys_is_not_read_again_at_every_start(tmp_path):
    """Records with no KEYS and no UNIQ_KEY (raw sends, a client that sets none) need no entry, so no index file
    was ever made; a start that found no file took it for ``rm index/*``, ignored the progress and re-read the whole
    commit log -- at every start (232,000 bytes of 2,000 such sends on a real broker, each restart). A progress
    saved with no file says so; the index files removed with the progress left are still rebuilt (test above)."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048))
    await store.open()
    for _ in range(3):
        assert (await store.put(PutRequest.build("T", b"x" * 100))).ok
    svc = await _service(tmp_path, store)
    await svc.query("T", "x", 1, 0, 1)          # after the start's catch-up
    await svc.close()
    assert [n for n in os.listdir(tmp_path / "index") if n.isdigit()] == []
    svc = await _service(tmp_path, store)
    assert svc.covered == store.max_physical_offset     # nothing to catch up
    keyed = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "later"}))
    assert (await svc.query("T", "later", 64, 0, 2**62)).found == [keyed.physical_offset]
    await svc.close()
    await store.close()


@bounded(20)
async def test_a_progress_file_of_the_earlier_format_is_still_read(tmp_path):
    """The progress as txmq wrote it before it said whether a file was held (a value and its crc32): still taken."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    await svc.query("T", "x", 1, 0, 1)
    await svc.close()
    raw = struct.pack(">q", store.max_physical_offset)
    (tmp_path / "index" / index_mod.PROGRESS_FILE).write_bytes(raw + struct.pack(">I", zlib.crc32(raw)))
    assert svc._read_progress() == (store.max_physical_offset, False, None)
    await store.close()


class _Said(logging.Handler):
    """An asyncio event set (from any thread) when a record saying ``words`` is logged."""

    def __init__(self, words: str):
        super().__init__()
        self.words, self.event, self.loop = words, asyncio.Event(), asyncio.get_running_loop()

    def emit(self, record):
        if self.words in record.getMessage():
            self.loop.call_soon_threadsafe(self.event.set)


@bounded(20)
async def test_a_full_disk_at_the_progress_file_is_not_caught_up_and_stopped_again_every_interval(
        tmp_path, monkeypatch, caplog):
    """The progress file is a write too: a full disk refused it, a resume (which writes nothing when there is
    nothing to catch up) said "caught up ... again" and ended the failure run, and the next progress save
    failed again with a new ERROR and traceback -- an ERROR and a WARNING every 10 s for as long as the disk
    stayed full, and txmq_index_failed flapping. A resume ends the run only once its progress is written."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    await svc.query("T", "x", 1, 0, 1)          # caught up
    monkeypatch.setattr(index_mod, "PROGRESS_EVERY_S", 0)     # a progress save at each turn of the thread
    svc.resume_every_s = 0
    real_open = open

    def full(path, *args, **kw):
        if str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kw)
    monkeypatch.setattr(index_mod, "open", full, raising=False)
    with caplog.at_level(logging.INFO, logger="txmq.index"):
        lost = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
        for _ in range(6):          # turns of the index thread: progress saves refused, resumes tried
            await svc.query("T", "lost", 64, 0, 2**62)
    said = [r.getMessage() for r in caplog.records]
    assert sum("indexing stops here" in m for m in said) == 1, said
    assert not any("caught up" in m or "catching up" in m for m in said), said     # not a line per attempt
    assert svc.stopped             # txmq_index_failed: 1 throughout, not 0 while each resume is tried
    monkeypatch.setattr(index_mod, "open", real_open, raising=False)
    back = _Said("caught up with the commit log again")
    logging.getLogger("txmq.index").addHandler(back)
    try:
        while not back.event.is_set():     # each query a turn: the resume, then its catch-up and progress
            await svc.query("T", "lost", 64, 0, 2**62)
    finally:
        logging.getLogger("txmq.index").removeHandler(back)
    assert not svc.stopped
    assert (await svc.query("T", "lost", 64, 0, 2**62))[0] == [lost.physical_offset]
    await svc.close()
    await store.close()


@bounded(20)
async def test_an_idle_broker_resumes_indexing_without_a_send_or_a_query(tmp_path, monkeypatch):
    """The resume was tried only when the index thread woke (a send or a query): on a broker quiet once the
    disk had room, the index stayed stopped (txmq_index_failed 1, the alert firing) and the first query by key
    was answered from the stale index, the catch-up queued behind it. Now the thread wakes by itself."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    svc.resume_every_s = 0.05           # (the thread's wait is set when it starts waiting)
    await svc.query("T", "x", 1, 0, 1)
    real = IndexFile.put_many

    def no_space(self, items):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(IndexFile, "put_many", no_space)
    lost = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
    assert (await svc.query("T", "lost", 64, 0, 2**62))[0] == [] and svc.stopped
    back = _Said("caught up with the commit log again")
    logging.getLogger("txmq.index").addHandler(back)
    monkeypatch.setattr(IndexFile, "put_many", real)
    try:
        await back.event.wait()         # nothing sent, nothing asked
    finally:
        logging.getLogger("txmq.index").removeHandler(back)
    assert svc.failed is None
    assert (await svc.query("T", "lost", 64, 0, 2**62))[0] == [lost.physical_offset]
    await svc.close()
    await store.close()


@bounded(20)
async def test_two_errors_in_turn_while_resuming_are_each_said_once(tmp_path, monkeypatch, caplog):
    """Each resume that met another errno than the one before was said again, traceback and all: a disk failing
    ENOSPC and EIO in turn logged an ERROR at every attempt (40 in 40 attempts; 8,640 a day at 10 s). Each kind is
    said once a failure run."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    svc.resume_every_s = 0
    await svc.query("T", "x", 1, 0, 1)
    calls = []

    def in_turn(self, items):
        calls.append(items)
        raise OSError((errno.ENOSPC, errno.EIO)[len(calls) % 2], "write failed")
    monkeypatch.setattr(IndexFile, "put_many", in_turn)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
        for _ in range(12):         # each a turn of the index thread: a resume, its catch-up failing
            await svc.query("T", "lost", 64, 0, 2**62)
    said = [r.getMessage() for r in caplog.records if "indexing stops here" in r.getMessage()]
    assert len(calls) >= 6 and len(said) == 2, (len(calls), said)
    await svc.close()
    await store.close()


def _no_space(self, items):
    raise OSError(errno.ENOSPC, "No space left on device")


async def _stopped_by_a_full_disk(tmp_path, monkeypatch, **kw):
    """A service over 3 records, put_many failing ENOSPC from now on, and the put result of a record of key "lost"
    (its indexing fails: stopped)."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store, **kw)
    await svc.query("T", "x", 1, 0, 1)
    monkeypatch.setattr(IndexFile, "put_many", _no_space)
    return store, svc, await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))


@bounded(20)
async def test_a_resume_due_after_the_index_closed_does_not_open_its_files_again(tmp_path, monkeypatch):
    """close() runs the thread's last job, then stops the thread: a resume due in between (the clock wakes the
    thread now) read the files back after they were closed -- descriptors no one closes -- and wrote the progress
    file after the store had stopped."""
    store, svc, _ = await _stopped_by_a_full_disk(tmp_path, monkeypatch)
    await svc.query("T", "lost", 64, 0, 2**62)
    assert svc.failed is not None
    monkeypatch.undo()
    await svc._submit(svc._shutdown)        # close()'s last job; the thread runs on until its stop
    svc.resume_every_s = 0
    loop, turned = asyncio.get_running_loop(), asyncio.Event()
    svc._q.put(lambda: loop.call_soon_threadsafe(turned.set))      # a turn of the thread, a resume due
    await turned.wait()
    assert svc.files and all(f.fd == -1 for f in svc.files)
    svc._q.put(None)
    await loop.run_in_executor(None, svc._thread.join)
    await store.close()


@bounded(20)
async def test_a_stopped_index_says_the_offset_of_the_first_record_it_did_not_write(tmp_path, monkeypatch):
    """``covered`` went past each record of a batch before its entries were written: a batch whose write failed
    stopped indexing with ``covered`` past it, so a query's ``behind`` (the remark's "messages stored from
    commit-log offset N on are not searched") and txmq_index_behind_bytes left out the very records lost."""
    store, svc, lost = await _stopped_by_a_full_disk(tmp_path, monkeypatch)
    answer = await svc.query("T", "lost", 64, 0, 2**62)
    assert svc.stopped and answer.found == []
    assert answer.behind == lost.physical_offset and svc.covered == lost.physical_offset, (answer, lost)
    await svc.close()
    await store.close()


@bounded(20)
async def test_a_resume_that_could_not_open_every_file_says_it_did_not_search_past_those_it_did(tmp_path, monkeypatch):
    """A resume that met EMFILE opening the index's files (raised, not taken for damaged) kept the first ones only,
    yet ``covered`` still said the whole log before it was searched: a key in a file not opened was QUERY_NOT_FOUND
    with a remark naming an offset past it. (Then it said searched to the end of the files it opened, the others
    closed and not searched; now it keeps every file it had open until it reads them all back, and is found.)"""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store, entries=4)       # (a new file every 3 entries)
    svc.resume_every_s = 0
    await svc.query("T", "x", 1, 0, 1)
    assert len(svc.files) > 2
    k2_at = (await svc.query("T", "k2", 64, 0, 2**62)).found[0]     # (in the third file)
    real_put, real_open = IndexFile.put_many, IndexFile.open
    opened = []

    def second_refused(*args, **kw):
        if opened:
            raise OSError(errno.EMFILE, "Too many open files")
        opened.append(args)
        return real_open(*args, **kw)
    monkeypatch.setattr(IndexFile, "put_many", _no_space)
    await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
    await svc.query("T", "x", 1, 0, 1)          # (a resume before it, its catch-up queued: failing after it)
    monkeypatch.setattr(IndexFile, "open", second_refused)
    answer = await svc.query("T", "k2", 64, 0, 2**62)       # (a resume before it: one file opened of them all)
    assert opened and svc.stopped and len(svc.files) > 2
    assert answer.found == [k2_at] and answer.behind is not None and answer.behind > k2_at, (answer, k2_at)
    monkeypatch.setattr(IndexFile, "open", real_open)
    monkeypatch.setattr(IndexFile, "put_many", real_put)
    for _ in range(10):
        if not svc.stopped:
            break
        await svc.query("T", "x", 1, 0, 1)
    assert len((await svc.query("T", "k2", 64, 0, 2**62)).found) == 1
    await svc.close()
    await store.close()


@bounded(20)
async def test_index_files_expire_could_not_remove_are_said(tmp_path, monkeypatch, caplog):
    """The store's removal listener drops the future ``expire`` returns: an index file whose removal failed (EACCES,
    EIO, a read-only remount) was left on disk, out of the index's list, with nothing said but asyncio's "Future
    exception was never retrieved" at some later collection, if ever."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store, entries=4)       # (a new file every 3 entries: more than one file)
    await svc.query("T", "x", 1, 0, 1)
    assert len(svc.files) > 1

    def refused(self):
        raise OSError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(IndexFile, "remove", refused)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        with pytest.raises(OSError):
            await svc.expire(store.max_physical_offset)
        await svc.query("T", "x", 1, 0, 1)      # (the done callback has run)
    said = [r.getMessage() for r in caplog.records if r.name == "txmq.index" and r.levelno >= logging.ERROR]
    assert len(said) == 1 and "not removed" in said[0] and "Permission denied" in said[0], said
    await svc.close()
    await store.close()


@bounded(20)
async def test_another_error_while_resuming_from_a_full_disk_is_said(tmp_path, monkeypatch, caplog):
    """The failure run is said once; a resume that then met another error (EIO) said nothing, and the log still
    promised a resume "once the disk has room". It is said, and tried again too (any OSError is)."""
    store = await _store_with(tmp_path, 3)
    svc = await _service(tmp_path, store)
    svc.resume_every_s = 0
    await svc.query("T", "x", 1, 0, 1)
    errors = iter([errno.ENOSPC] + [errno.EIO] * 100)

    def broken(self, items):
        raise OSError(next(errors), "write failed")
    monkeypatch.setattr(IndexFile, "put_many", broken)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
        for _ in range(4):          # the full disk's failure, then resumes: one meets EIO
            await svc.query("T", "lost", 64, 0, 2**62)
    said = [r.getMessage() for r in caplog.records if "indexing stops here" in r.getMessage()]
    assert len(said) == 2 and "once the disk has room" in said[0] and "once the error passes" in said[1], said
    assert svc.stopped and svc._resumable
    await svc.close()
    await store.close()


async def test_a_record_whose_keys_a_crash_split_gets_the_rest_at_the_next_start(tmp_path, monkeypatch):
    """A record's keys can span two header updates (MAX_BATCH entries each, or a full file): a crash
    between them left its first keys indexed and the next start skipped the whole record as done."""
    import broker.store.index_file as index_file_mod
    store = await _store_with(tmp_path, 2)
    svc = await _service(tmp_path, store)
    await svc.query("T", "x", 1, 0, 1)                   # caught up
    monkeypatch.setattr(index_file_mod, "MAX_BATCH", 2)  # this record's 5 entries take 3 header updates
    real, calls = IndexFile.put_many, []

    def crash_after_first(self, items):
        calls.append(len(items))
        if len(calls) > 1:
            raise OSError(5, "simulated crash between two batches")
        return real(self, items)
    monkeypatch.setattr(IndexFile, "put_many", crash_after_first)
    split = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "a b c d", "UNIQ_KEY": "USPLIT"}))
    await svc.query("T", "x", 1, 0, 1)                   # the index thread has been through it
    assert svc.failed
    monkeypatch.setattr(IndexFile, "put_many", real)
    await svc.close()

    svc = await _service(tmp_path, store)
    for key in ("USPLIT", "a", "b", "c", "d"):
        assert (await svc.query("T", key, 64, 0, 2**62))[0] == [split.physical_offset], key
    await svc.close()
    await store.close()


def _reference_hashes(raw):
    topic, ts, sys_flag, uniq, keys = record_keys(raw)
    if sys_flag & 0xC == 0xC:
        return []
    return [(key_hash(f"{topic}#{k}"), 7, ts) for k in ([uniq] if uniq else []) + keys]


@pytest.mark.parametrize("topic, props, sys_flag, hosts", [
    (b"T", b"KEYS\x01k1 k2\x02UNIQ_KEY\x017F0000010C3418B4AAC2000000000001", 0, 8),
    (b"TopicTest", b"UNIQ_KEY\x01" + b"A" * 70 + b"\x02KEYS\x01" + b"x" * 1500 + b"  y ", 0, 8),
    (b"T", b"KEYS\x01first\x02KEYS\x01\x02KEYS\x01last one\x02KEYS\x01\x02X\x01y", 0, 20),
    (b"T", b"XKEYS\x01no\x02UNIQ_KEY\x01\x02KEYS\x01a\x01b\x02\x02\x01\x02KEYS", 0x4, 20),
    ("订单".encode(), "KEYS\x01订单-1 \U0001F600 plain-ascii-key-longer-than-16\x02UNIQ_KEY\x01u".encode(), 0, 8),
    (b"T\xff", b"KEYS\x01bad\xe2 \xe2\x82x \xff\xfe\x02UNIQ_KEY\x01\xed\xa0\x80", 0, 8),
    (b"T", b"", 0, 8),
    (b"T", b"KEYS\x01rolled back", 0xC, 8),
])
def test_collect_gives_what_record_keys_and_key_hash_give(tmp_path, topic, props, sys_flag, hosts):
    """The index thread reads keys straight from a record's bytes and hashes them by parts (topic# once,
    a long key's head once); the entries must be those of the plain parse and Java's hashCode."""
    from protocol.message import encode_record
    raw = bytes(encode_record(topic=topic, body=b"body", queue_id=0, flag=0, sys_flag=sys_flag,
                              born_timestamp=1, born_host=b"\0" * hosts, store_host=b"\1" * hosts,
                              properties=props, store_timestamp=1_700_000_000_123))
    svc = IndexService(str(tmp_path), segment_size=1 << 20)
    for _ in range(2):                  # the second time from the caches
        items = []
        svc._collect(items, b"pad" + raw, 3, 7)
        assert items == _reference_hashes(raw)


def test_key_hash_parts_agree_with_javas_hashcode():
    from broker.store.index_file import extend_hash, string_hash
    for text in ["", "a", "x" * 63, "y" * 64, "z" * 65, "w" * 2000, "订单#1", "\U0001F600" * 40,
                 "polygenelubricants"]:
        java = _java_hash(text)
        assert key_hash(text) == (0 if java == -2**31 else abs(java))
        for cut in (0, 1, len(text) // 2, len(text)):
            head, tail = text[:cut], text[cut:]
            units = struct.unpack(f">{len(tail.encode('utf-16-be', 'surrogatepass')) // 2}H",
                                  tail.encode("utf-16-be", "surrogatepass"))
            assert extend_hash(string_hash(head), units) == _java_hash(text) & 0xFFFFFFFF


async def test_the_index_thread_keeps_a_bounded_number_of_segments_open(tmp_path, monkeypatch):
    # Months of small segments: the catch-up and queries read every one of them. A descriptor kept per
    # segment ever read added one per segment to the store's own until the broker ran out of them.
    monkeypatch.setattr(index_mod, "OPEN_SEGMENTS", 4)
    store = await _store_with(tmp_path, 300, seg=4096)      # ~20 segments, every one read by the catch-up
    assert len(store.segments()) > 3 * 4
    svc = await _service(tmp_path, store)
    shared = (await asyncio.wait_for(svc.query("T", "shared", 64, 0, 2**62), 10)).found
    assert len(shared) == 64                                 # as many as a query answers, from 4+ segments
    assert len(svc._fds) <= 4
    opened = set(os.listdir(f"/proc/{os.getpid()}/fd"))
    res = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "late"}))
    assert (await asyncio.wait_for(svc.query("T", "late", 64, 0, 2**62), 10))[0] == [res.physical_offset]
    # (less the index files' own, which a query opens again: OPEN_INDEX_FILES)
    index_dir = str(tmp_path / "index") + os.sep
    assert len({fd for fd, path in _fd_paths().items() if fd not in opened and not path.startswith(index_dir)}) <= 4
    await svc.close()
    await store.close()


async def test_a_query_during_the_catch_up_is_answered_from_what_is_indexed_so_far(tmp_path, monkeypatch, caplog):
    # Months of history took the catch-up 17 s, and a query queued behind all of it (past a client's 3 s
    # timeout). Like RocketMQ's queryOffset while the reput catches up, it is answered from what is indexed,
    # with the offset the index reaches (indexLastUpdatePhyoffset) saying how far that is. Nothing else said the
    # answer was partial (a key stored past it was QUERY_NOT_FOUND "can not find message"): it now carries the
    # offset from which it did not search (``behind``, the remark's), and the catch-up's end is said.
    monkeypatch.setattr(index_mod, "CATCH_UP_SLICE", 2048)
    store = await _store_with(tmp_path, 300, seg=4096)
    end = store.max_physical_offset
    queued, scan = threading.Event(), IndexService._scan

    def after_the_query_is_queued(self, *args):
        queued.wait(10)
        return scan(self, *args)
    monkeypatch.setattr(IndexService, "_scan", after_the_query_is_queued)
    caplog.set_level(logging.INFO, "txmq.index")
    svc = await _service(tmp_path, store)
    first = svc.query("T", "k0", 64, 0, 2**62)
    queued.set()
    found, _, last_phy, _, behind = await asyncio.wait_for(first, 10)
    assert last_phy < end // 4 and len(found) == 1      # answered a slice into the catch-up
    assert behind is not None and last_phy < behind < end // 4, behind
    late = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "late"}))   # dispatched meanwhile
    for _ in range(end // 2048 + 2):                   # each query waits for at most one slice
        if last_phy >= late.physical_offset:            # the late record is indexed after the catch-up
            break
        last_phy = (await asyncio.wait_for(svc.query("T", "k299", 64, 0, 2**62), 10)).last_phy
    assert last_phy >= late.physical_offset
    assert len((await svc.query("T", "k299", 64, 0, 2**62))[0]) == 1
    assert len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 64
    caught_up = await asyncio.wait_for(svc.query("T", "late", 64, 0, 2**62), 10)
    assert caught_up.found == [late.physical_offset] and caught_up.behind is None, caught_up
    await svc.close()
    await store.close()
    assert sum("caught up with the commit log (" in r.getMessage() for r in caplog.records) == 1, caplog.text


async def test_a_stop_during_the_catch_up_ends_it_and_the_next_start_finishes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "CATCH_UP_SLICE", 512)
    store = await _store_with(tmp_path, 300, seg=4096)
    svc = await _service(tmp_path, store)
    await asyncio.wait_for(svc.close(), 10)            # slices still queued: they see the index closed
    svc = await _service(tmp_path, store)
    for _ in range(store.max_physical_offset // 512 + 2):     # a query waits for at most one slice
        found = (await asyncio.wait_for(svc.query("T", "k299", 64, 0, 2**62), 10))[0]
        if found:
            break
    assert len(found) == 1 and len((await svc.query("T", "shared", 64, 0, 2**62))[0]) == 64
    await svc.close()
    await store.close()


@pytest.mark.parametrize("field, value", [(4, b"\0\0\0\0"), (0, struct.pack(">i", 0x7FFFFF00))],
                         ids=["magic", "size"])
async def test_catch_up_indexes_the_sound_records_after_a_damaged_one(tmp_path, caplog, field, value):
    """The catch-up stopped at a record whose head was damaged (a WARNING, and every later record of the range
    left out of the index: queries by key found nothing); a size past the segment re-read the record for ever.
    It goes on from the next record now, and says where at ERROR."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048))
    await store.open()
    put = [await store.put(PutRequest.build("T", b"x" * 100, properties={"KEYS": f"k{i} shared"}))
           for i in range(100)]
    bad = put[5].physical_offset
    seg = store.config.segment_size
    assert put[-1].physical_offset >= seg            # the damage is mid-range: sound records follow it
    with open(os.path.join(tmp_path, "commitlog", f"{bad - bad % seg:020d}"), "r+b") as fh:
        fh.seek(bad % seg + field)
        fh.write(value)
    caplog.set_level(logging.WARNING, "txmq.index")
    svc = await _service(tmp_path, store)               # no index yet: it catches up over the whole log
    found = (await asyncio.wait_for(svc.query("T", "shared", 64, 0, 2**62), 10)).found
    more = (await asyncio.wait_for(svc.query("T", "k99", 64, 0, 2**62), 10)).found
    assert more == [put[99].physical_offset] and bad not in found and len(found) == 64
    assert (await svc.query("T", "k6", 64, 0, 2**62))[0] == [put[6].physical_offset]
    assert any(r.levelno == logging.ERROR and "byte" in r.getMessage() and "indexing on from byte" in r.getMessage()
               for r in caplog.records)
    await svc.close()
    await store.close()


async def test_catch_up_ends_at_a_segment_file_cut_inside_a_record(tmp_path, caplog):
    """A segment file that ends inside a record (cut short by damage, not preallocated any more): the catch-up
    re-read that record from the same place for ever (the index thread spinning, every query waiting). It
    indexes what lies before the cut, says where it stopped at ERROR, and goes on with the next segment."""
    store = await _store_with(tmp_path, 100)
    seg = store.config.segment_size
    lo, hi = store.min_physical_offset, store.max_physical_offset
    await store.close()
    assert hi > seg                                   # a second segment follows the cut one
    path = os.path.join(tmp_path, "commitlog", f"{0:020d}")
    cut_at = 2 * 4096 + 17                            # inside some record of the first segment
    os.truncate(path, cut_at)
    caplog.set_level(logging.WARNING, "txmq.index")
    svc = IndexService(str(tmp_path), segment_size=seg, slots=SLOTS, entries=ENTRIES)
    await svc.open(lo, hi)
    last = (await asyncio.wait_for(svc.query("T", "k99", 64, 0, 2**62), 10)).found     # in the next segment
    first = (await asyncio.wait_for(svc.query("T", "k0", 64, 0, 2**62), 10)).found     # before the cut
    assert len(last) == 1 and len(first) == 1
    assert any(r.levelno == logging.ERROR and "ends inside the record" in r.getMessage() for r in caplog.records)
    await svc.close()


def test_an_index_file_an_earlier_version_wrote_while_the_clock_stepped_back_is_kept(tmp_path):
    """The version before kept END TIMESTAMP = the last entry's store time: a clock stepped back left it below
    BEGIN TIMESTAMP in files already on disk, and the fix for new headers still read those as damaged: the first
    start after the upgrade removed each with every newer file and indexed their part of the log again (ERROR).
    Such a header is read as ending with its last entry (to the end of its second); its entries are found."""
    base = 1_700_000_000_000
    f = _new(tmp_path)
    f.put_many([(key_hash("T#a"), 100, base + 5_000), (key_hash("T#b"), 200, base + 6_000)])
    f.end_ts = base     # what the earlier version wrote for a last entry stored after a step back
    f._write_header()
    f.close()
    g = IndexFile.open(f.path, SLOTS, ENTRIES)
    try:
        assert (g.begin_ts, g.end_ts, g.count) == (base + 5_000, base + 6_999, 3)
        assert g.select(key_hash("T#b"), 0, 2**62) == [200]
    finally:
        g.close()


@bounded(30)
async def test_a_committed_record_whose_type_bit_flipped_is_indexed_when_the_index_reads_the_log(tmp_path):
    """SYSFLAG is outside the body CRC: a committed message's bit 0x4 flipped at rest reads ROLLBACK, which the
    index leaves out (RocketMQ's too). The store serves it (the start reads one carrying a non-zero QUEUEOFFSET, as
    ROLLBACK never does, with the bit put back), but an index reading the log for it (catching up after a crash,
    or rebuilt) left it out: a query by its key or message id answered NOT FOUND for a message consumers get."""
    from protocol.codes import SysFlag
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048))
    await store.open()
    for i in range(3):
        assert (await store.put(PutRequest.build("T", b"x" * 100, properties={"KEYS": f"p{i}"}))).ok
    res = await store.put(PutRequest.build("T", b"c" * 100, properties={"KEYS": "C"},
                                           sys_flag=SysFlag.TRANSACTION_COMMIT))
    assert res.ok and res.queue_offset == 3
    assert (await store.put(PutRequest.build("T", b"x" * 100, properties={"KEYS": "after"}))).ok
    await store.close()
    seg = os.path.join(tmp_path, "commitlog", f"{0:020d}")
    with open(seg, "r+b") as f:
        f.seek(res.physical_offset + 39)
        b = f.read(1)
        f.seek(res.physical_offset + 39)
        f.write(bytes([b[0] ^ 0x04]))           # COMMIT (0x8) reads ROLLBACK (0xC)

    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048))
    await store.open()
    got = store.get_messages("T", 0, 3, 1, 1 << 20)
    assert len(got.buffers) == 1                # served, the bit put back
    svc = IndexService(str(tmp_path), segment_size=store.config.segment_size, slots=SLOTS, entries=1000)
    store.add_dispatch_listener(svc.on_dispatch)
    await svc.open(store.min_physical_offset, store.max_physical_offset)    # no index yet: read from the log
    try:
        assert (await svc.query("T", "after", 8, 0, 2**62)).found   # caught up past it
        assert (await svc.query("T", "C", 8, 0, 2**62)).found == [res.physical_offset]
    finally:
        await svc.close()
        await store.close()


@bounded(30)
async def test_a_clock_stepped_forward_and_back_leaves_later_messages_found_by_a_time_window(tmp_path, caplog):
    """A clock jumped a day ahead (a send then started a file beginning a day ahead) and stepped back: every later
    entry's time was clamped to that file's begin, and a query by key with a window of a minute around a message
    stored an hour later found none of it (the all-time query found it). A record stored before the file being
    written begins now starts a new file (once per BACK_ROLL_EVERY_S: a flapping clock makes no file per step),
    and a query reads on past a file that begins before its window while an older file may still match."""
    base, hour, minute = 1_700_000_000_000, 3_600_000, 60_000
    now = [base]
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048),
                         clock=lambda: now[0])
    await store.open()
    svc = await _service(tmp_path, store, clock=lambda: now[0])
    sent = {}
    try:
        for now[0], key in ((base, "a"), (base + 24 * hour + 5_000, "ahead"), (base + hour, "back"),
                            (base + 2 * hour, "later"), (base + hour - 10_000, "flap")):
            sent[key] = (now[0], (await store.put(PutRequest.build("T", b"x", properties={"KEYS": key}))).physical_offset)
            assert (await svc.query("T", key, 64, 0, 2**62))[0] == [sent[key][1]]
        for key, (ts, phy) in sent.items():
            assert (await svc.query("T", key, 64, ts - minute, ts + minute))[0] == [phy], key
        assert len(svc.files) == 3, svc.files       # "flap" (1 h 10 s below "later"): within the guard, no fourth file
        assert "stepped back" in caplog.text
        now[0] = base + hour // 2       # stepped back again at once: no file per step, the entry clamped (said)
        phy = (await store.put(PutRequest.build("T", b"x", properties={"KEYS": "again"}))).physical_offset
        assert (await svc.query("T", "again", 64, 0, 2**62))[0] == [phy]
        assert len(svc.files) == 3 and "again within" in caplog.text
    finally:
        await svc.close()
    svc = await _service(tmp_path, store, clock=lambda: now[0])    # a start keeps the files, out of time order
    try:
        assert svc.rebuilt == [] and len(svc.files) == 3
        for key, (ts, phy) in sent.items():
            assert (await svc.query("T", key, 64, ts - minute, ts + minute))[0] == [phy], key
    finally:
        await svc.close()
        await store.close()


@bounded(30)
async def test_records_indexed_in_one_batch_go_to_the_file_of_their_time(tmp_path):
    """The file was chosen by a batch's first record: a batch across the clock's step back (records gathered for
    lag_ms, or a catch-up's slice of up to 1,024 entries) put the records after the step in the file begun a day
    ahead, clamped to its begin (a +-1 min query found none of them), and a catch-up over days of the log put
    them all in one file (no period roll within a batch). Each batch is cut where a record leaves its file's time."""
    base, hour, minute, day = 1_700_000_000_000, 3_600_000, 60_000, 86_400_000
    now = [base]
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048),
                         clock=lambda: now[0])
    await store.open()
    sent = {}

    async def put(key):
        sent[key] = (now[0], (await store.put(PutRequest.build("T", b"x", properties={"KEYS": key}))).physical_offset)

    for now[0], key in ((base, "d0"), (base + day, "d1"), (base + 2 * day, "d2")):
        await put(key)
    svc = await _service(tmp_path, store, clock=lambda: now[0], lag_ms=60_000.0)    # caught up in one batch
    try:
        assert (await svc.query("T", "d2", 64, 0, 2**62))[0] == [sent["d2"][1]]
        assert len(svc.files) == 3, svc.files
        for now[0], key in ((base + 3 * day, "ahead"), (base + 3 * day + 5_000, "same-batch"),
                            (base + 2 * day + hour, "back")):
            await put(key)          # gathered for lag_ms: the query below takes them in one batch
        assert (await svc.query("T", "back", 64, 0, 2**62))[0] == [sent["back"][1]]
        for key, (ts, phy) in sent.items():
            assert (await svc.query("T", key, 64, ts - minute, ts + minute))[0] == [phy], key
    finally:
        await svc.close()
        await store.close()


@pytest.mark.parametrize("batched", [False, True])
@bounded(30)
async def test_a_key_stored_before_a_step_back_within_a_file_is_found_by_its_time_window(tmp_path, batched):
    """A clock stepped back an hour, still after the file's begin: the entries after the step are older than the
    ones before it, and the walk of a key's entries (newest first) stopped at the first one older than the window,
    so a +-5 s query for a message with the same key stored just before the step found none of it. A step back of
    over BACK_STEP_MS below the file's newest entry starts a new file; the walk reads on BACK_STEP_MS below its window."""
    base, hour, minute = 1_700_000_000_000, 3_600_000, 60_000
    now = [base]
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048),
                         clock=lambda: now[0])
    await store.open()
    # batched: the records gathered for lag_ms, indexed in one batch at the first query (_fitting cuts it)
    svc = await _service(tmp_path, store, clock=lambda: now[0], **({"lag_ms": 60_000.0} if batched else {}))
    sent = []
    try:
        # an hour back (a new file), then 40 s back within a file (under BACK_STEP_MS: the walk reads on past it)
        for now[0] in (base, base + 2 * hour, base + hour, base + hour + minute, base + hour + 2 * minute,
                       base + hour + minute + 20_000):
            phy = (await store.put(PutRequest.build("T", b"x", properties={"KEYS": "order-1"}))).physical_offset
            sent.append((now[0], phy))
            if not batched:
                assert phy in (await svc.query("T", "order-1", 64, 0, 2**62))[0]
        for ts, phy in sent:
            assert (await svc.query("T", "order-1", 64, ts - 5_000, ts + 5_000))[0] == [phy], (ts - base, svc.files)
        assert len(svc.files) == 2, svc.files
    finally:
        await svc.close()
        await store.close()


@bounded(30)
async def test_each_batch_sets_end_timestamp_to_the_newest_store_time_it_writes(tmp_path, monkeypatch):
    """A batch's newest store time is its file's END TIMESTAMP, found in put_many's loop (it was scanned again after
    it, on top of _fitting's list of the times); a one-entry batch is not cut at all (_writable chose the file for
    it). A batch whose last record is not its newest (stored 1 s back) still ends at its newest."""
    base = 1_700_000_000_000
    now = [base]
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048),
                         clock=lambda: now[0])
    await store.open()
    real, calls = IndexFile.put_many, []

    def spy(self, items):
        n = real(self, items)
        calls.append((n, max(t for _, _, t in items[:n]) - base, self.end_ts - base))
        return n
    monkeypatch.setattr(IndexFile, "put_many", spy)
    svc = await _service(tmp_path, store, clock=lambda: now[0], lag_ms=60_000.0)   # indexed at each query
    try:
        for i in range(3):          # one entry a record, indexed one at a time
            now[0] = base + 1_000 * i
            await store.put(PutRequest.build("T", b"x", properties={"UNIQ_KEY": f"U{i}"}))
            assert (await svc.query("T", f"U{i}", 1, 0, 2**62))[0]
        now[0] = base + 10_000      # a record of three entries, then one stored 1 s before it: one batch of four
        await store.put(PutRequest.build("T", b"x", properties={"UNIQ_KEY": "U3", "KEYS": "a b"}))
        now[0] = base + 9_000
        await store.put(PutRequest.build("T", b"x", properties={"UNIQ_KEY": "U4"}))
        assert (await svc.query("T", "U4", 1, 0, 2**62))[0]
    finally:
        await svc.close()
        await store.close()
    assert calls == [(1, 0, 0), (1, 1_000, 1_000), (1, 2_000, 2_000), (4, 10_000, 10_000)], calls


@bounded(30)
async def test_a_batch_cut_to_one_entry_by_a_nearly_full_file_indexes_the_rest_once_each_in_its_time(tmp_path):
    """A batch meeting a file with room for one entry is cut to that one without a look at its times (a one-entry
    cut needs none: _writable chose the file for it); the rest, the next record stepped back over BACK_STEP_MS
    among them, go on to a new file, each once and found by a +-5 s window around its store time."""
    base, minute = 1_700_000_000_000, 60_000
    now = [base]
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048),
                         clock=lambda: now[0])
    await store.open()
    svc = await _service(tmp_path, store, clock=lambda: now[0], lag_ms=60_000.0)
    sent = {}

    async def put(key):
        sent[key] = (now[0], (await store.put(PutRequest.build("T", b"x", properties={"KEYS": key}))).physical_offset)

    try:
        for i in range(ENTRIES - 2):        # one entry a record, each indexed on its own: room for one left
            now[0] = base + 1_000 * i
            await put(f"k{i}")
            assert (await svc.query("T", f"k{i}", 64, 0, 2**62))[0] == [sent[f"k{i}"][1]]
        assert [f.room for f in svc.files] == [1], [(f.count, f.room) for f in svc.files]
        for now[0], key in ((base + 10_000, "last-in"), (base + 10_000 - 2 * minute, "back"),
                            (base + 11_000, "after")):
            await put(key)          # gathered for lag_ms: the query below takes them in one batch
        assert (await svc.query("T", "after", 64, 0, 2**62))[0] == [sent["after"][1]]
        assert [f.count - 1 for f in svc.files] == [ENTRIES - 1, 2], [(f.count, f.end_ts - base) for f in svc.files]
        for key, (ts, phy) in sent.items():
            assert (await svc.query("T", key, 64, 0, 2**62))[0] == [phy], key
            assert (await svc.query("T", key, 64, ts - 5_000, ts + 5_000))[0] == [phy], key
        assert svc.files[0].end_ts == base + 10_000 and svc.files[1].begin_ts == base + 10_000 - 2 * minute
    finally:
        await svc.close()
        await store.close()


@bounded(20)
async def test_older_index_files_a_failing_resume_keeps_stay_within_the_ones_last_queried(tmp_path, monkeypatch):
    """A resume that cannot read the index files back (a file system turned read-only) keeps the ones it had; it
    forgot which older ones a query had opened again, and kept their descriptors open untracked: on a disk read-only
    for hours, a resume every 10 s and queries of time windows between, each file they read stayed open."""
    store, svc, held = await _restarted_with_older_files_parked(tmp_path, monkeypatch)
    svc.resume_every_s = 0

    def read_only(*args, **kw):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(IndexFile, "put_many", read_only)
    monkeypatch.setattr(IndexFile, "open", read_only)
    await store.put(PutRequest.build("T", b"z", properties={"KEYS": "lost"}))
    assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 40     # two older files left open
    for _ in range(3):              # queries of a window no file is in (1 ms): resumes tried, no file read
        await svc.query("T", "shared", 64, 1, 1)
    open_older = {f.name for f in svc.files[:-1] if not f.parked}
    assert open_older and open_older <= {f.name for f in svc._queried}, "open older files the LRU forgot"
    most = 0
    for i in range(40):             # each query a turn of the index thread: the resume tried, and failing
        assert len((await svc.query("T", f"k{i}", 64, 0, 2**62)).found) == 1
        most = max(most, _open_index_files(tmp_path))
    assert svc.stopped and "Read-only" in svc.failed
    assert most <= held, f"{most} index descriptors open"
    await svc.close()
    assert _open_index_files(tmp_path) == 0
    await store.close()


@bounded(20)
async def test_index_files_made_after_a_progress_saved_with_none_and_then_removed_are_rebuilt(tmp_path):
    """A progress saved with no index file lets a start that finds none take it; once a keyed record made a file,
    the next save must clear that flag, or ``rm index/*`` then would be taken for "never needed one" and the keyed
    records before the progress never found again."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048))
    await store.open()
    assert (await store.put(PutRequest.build("T", b"x" * 100))).ok
    svc = await _service(tmp_path, store)
    await svc.close()                   # saved with no file
    svc = await _service(tmp_path, store)
    keyed = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "kept"}))
    for _ in range(3):
        assert (await store.put(PutRequest.build("T", b"y" * 100))).ok
    assert (await svc.query("T", "kept", 64, 0, 2**62)).found == [keyed.physical_offset]
    await svc.close()                   # saved past the keyed record, a file held
    assert svc._read_progress() == (store.max_physical_offset, False, None)
    for name in os.listdir(tmp_path / "index"):
        if name.isdigit():
            os.unlink(tmp_path / "index" / name)
    svc = await _service(tmp_path, store)
    assert (await svc.query("T", "kept", 64, 0, 2**62)).found == [keyed.physical_offset]
    await svc.close()
    await store.close()


@bounded(20)
async def test_a_damaged_progress_with_no_index_file_is_caught_up_from_the_start(tmp_path):
    """A 13-byte progress torn (a byte cut) or of a wrong crc is not taken: a start with no index file reads the
    log from its start (nothing skipped on a flag it cannot trust)."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048))
    await store.open()
    assert (await store.put(PutRequest.build("T", b"x" * 100))).ok
    svc = await _service(tmp_path, store)
    await svc.close()
    path = tmp_path / "index" / index_mod.PROGRESS_FILE
    raw = path.read_bytes()
    assert len(raw) == 13 and svc._read_progress() == (store.max_physical_offset, True, None)
    for bad in (raw[:12], raw[:8] + b"\x02" + raw[9:], raw[:-1] + bytes([raw[-1] ^ 1])):
        path.write_bytes(bad)
        assert svc._read_progress() [:2] == (0, False)
    await store.close()



@bounded(20)
@pytest.mark.parametrize("fault", ["torn", "checksum", "EIO"])
async def test_a_progress_not_taken_is_said_with_where_the_catch_up_starts(tmp_path, monkeypatch, caplog, fault):
    """A damaged ``index/progress`` (torn, a wrong checksum) or one that could not be read (EIO) was ignored without a
    word: a log of records without keys (no index file to go by) was re-read from its start, 3 records' bytes here
    and the whole log on a real one, before a save wrote the progress again -- a slow start nobody
    could explain. It is said at WARNING, once, with the offset the catch-up starts from."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=4096 * 4, max_message_size=2048))
    await store.open()
    for _ in range(3):
        assert (await store.put(PutRequest.build("T", b"x" * 100))).ok
    svc = await _service(tmp_path, store)
    await svc.close()
    path = tmp_path / "index" / index_mod.PROGRESS_FILE
    raw = path.read_bytes()
    if fault == "torn":
        path.write_bytes(raw[:7])
    elif fault == "checksum":
        path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    else:
        real_open = open

        def failing(file, *args, **kw):
            if str(file) == str(path):
                raise OSError(errno.EIO, "Input/output error", str(file))
            return real_open(file, *args, **kw)
        monkeypatch.setattr("builtins.open", failing)
    with caplog.at_level(logging.WARNING, logger="txmq.index"):
        svc = await _service(tmp_path, store)
    monkeypatch.undo()
    said = [r.getMessage() for r in caplog.records if "progress" in r.getMessage()]
    assert svc.covered == 0 and len(said) == 1, said
    assert str(path) in said[0] and "from offset 0" in said[0] and \
        f"catching up {store.max_physical_offset} bytes" in said[0], said
    assert ("Input/output error" if fault == "EIO" else "damaged") in said[0], said
    keyed = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "later"}))
    assert (await svc.query("T", "later", 64, 0, 2**62)).found == [keyed.physical_offset]
    await svc.close()
    await store.close()

@bounded(20)
async def test_a_query_across_more_older_files_than_are_kept_holds_no_more_of_them_open(tmp_path, monkeypatch):
    """A query of a window that holds every file (a stock client's queryMsgByKey: 0 to Long.MAX_VALUE; a late
    COMMIT's dead-letter lookup) opened every older file again and closed the ones past OPEN_INDEX_FILES only at its
    end: ~2,600 descriptors at once over 30 days of retention, past a 1,024 open-files limit (EMFILE: the query
    refused, and the connections accepted meanwhile too). Each file past the ones kept is closed as the next opens."""
    store, svc, held = await _restarted_with_older_files_parked(tmp_path, monkeypatch)
    seen = []
    walk = IndexFile.walk

    def counted(self, *args):
        seen.append(_open_index_files(tmp_path))
        return walk(self, *args)
    monkeypatch.setattr(IndexFile, "walk", counted)
    assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 40
    assert len(seen) == len(svc.files) >= 10
    assert max(seen) <= held, f"{max(seen)} index descriptors open at once in one query"
    await svc.close()
    await store.close()


@bounded(20)
async def test_a_query_out_of_descriptors_for_an_older_index_file_says_to_raise_the_limit(tmp_path, monkeypatch):
    """An older file reopened at the process's open-files limit (EMFILE): the query is refused naming the file and
    what to do about it, not only the errno."""
    store, svc, _held = await _restarted_with_older_files_parked(tmp_path, monkeypatch, kept=16)
    real = os.open

    def out_of_descriptors(path, *args, **kw):
        if str(path).startswith(str(tmp_path / "index")):
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, *args, **kw)
    monkeypatch.setattr(os, "open", out_of_descriptors)
    with pytest.raises(StoreError, match=f"{svc.files[0].name}.*open-files limit|LimitNOFILE"):
        await svc.query("T", "k0", 64, 0, 2**62)
    monkeypatch.setattr(os, "open", real)
    assert len((await svc.query("T", "k0", 64, 0, 2**62)).found) == 1      # the limit passed: answered again
    await svc.close()
    await store.close()


@bounded(20)
@pytest.mark.parametrize("refused", ["all", "newest"])
async def test_an_index_file_that_can_be_read_but_not_written_is_searched_and_not_written(tmp_path, monkeypatch,
                                                                                           caplog, refused):
    """A broker once run as root left its index files root's, mode 0644: readable, but not openable read-write
    (EACCES at O_RDWR). Taken for unreadable, the start stopped indexing for good -- queries by key answered from
    the files before the first such file (none of them here), every send after missing, until an operator removed
    the files and the index was rebuilt. Such a file is read (O_RDONLY): searched as before, never written; new
    entries go to a new file after it; said once at WARNING with what to do."""
    store = await _store_with(tmp_path, 5)
    svc = await _service(tmp_path, store, entries=3)
    await svc.query("T", "x", 1, 0, 1)
    await svc.close()
    files = sorted(n for n in os.listdir(tmp_path / "index") if n.isdigit())
    denied = {str(tmp_path / "index" / n) for n in (files if refused == "all" else files[-1:])}
    real_open = os.open

    def root_owned(path, flags, *args, **kw):
        if str(path) in denied and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kw)
    monkeypatch.setattr(os, "open", root_owned)
    with caplog.at_level(logging.WARNING, logger="txmq.index"):
        svc = await _service(tmp_path, store, entries=3)
        assert not svc.stopped and [f.name for f in svc.files] == files
        assert len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 5
        later = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "later"}))
        for _ in range(10):
            answer = await svc.query("T", "later", 64, 0, 2**62)
            if answer.found:
                break
        assert answer.found == [later.physical_offset] and not svc.stopped
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "read-only" in said[0] and files[-1] in said[0] and "chown" in said[0], said
    assert set(files) < set(os.listdir(tmp_path / "index"))     # nothing removed, a new file written
    await svc.close()
    svc = await _service(tmp_path, store, entries=3)
    assert not svc.stopped and len((await svc.query("T", "shared", 64, 0, 2**62)).found) == 5
    assert (await svc.query("T", "later", 64, 0, 2**62)).found == [later.physical_offset]
    await svc.close()
    await store.close()


@bounded(20)
@pytest.mark.parametrize("when", ["resume", "start"])
async def test_an_unreadable_index_file_whose_entries_all_expired_stops_indexing_no_more(tmp_path, monkeypatch,
                                                                                        caplog, when):
    """An index file a start could not read (EIO: a bad sector) is kept and indexing stopped until it can be read.
    Once retention has removed every record its entries point to (the log's first offset past where the next file
    begins), nothing in it can answer a query: it was kept all the same, and indexing stayed stopped for good (the
    resume read it again every 10 s and failed), every message stored since unfound by key. It is passed over now,
    said once, and removed when it can be."""
    store = await _store_with(tmp_path, 6)
    svc = await _service(tmp_path, store, entries=3)        # (a new file every 2 entries)
    past = (await svc.query("T", "k3", 64, 0, 2**62)).found[0]
    await svc.close()
    files = sorted(n for n in os.listdir(tmp_path / "index") if n != "progress")
    assert len(files) >= 4
    unreadable = str(tmp_path / "index" / files[0])
    real = IndexFile._load

    def failing(self):
        if self.path == unreadable:
            raise OSError(errno.EIO, os.strerror(errno.EIO), self.path)
        return real(self)
    monkeypatch.setattr(IndexFile, "_load", failing)
    with open(tmp_path / "index" / files[1], "rb") as fh:
        assert HEADER.unpack(fh.read(HEADER.size))[2] < past       # the next file begins below it
    svc = IndexService(str(tmp_path), segment_size=store.config.segment_size, slots=SLOTS, entries=3)
    store.add_dispatch_listener(svc.on_dispatch)
    svc.resume_every_s = 0
    with caplog.at_level(logging.WARNING, logger="txmq.index"):
        if when == "start":
            await svc.open(past, store.max_physical_offset)             # (retention removed the records before)
        else:
            await svc.open(store.min_physical_offset, store.max_physical_offset)
            assert svc.stopped
            await svc.expire(past)                                      # the removal listener
        keyed = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "late"}))
        for _ in range(10):     # each query a turn of the index thread: the resume, then its catch-up
            answer = await svc.query("T", "late", 64, 0, 2**62)
            if answer.behind is None:
                break
    assert not svc.stopped and answer.found == [keyed.physical_offset], (svc.failed, answer)
    assert not os.path.exists(unreadable)
    said = [r.getMessage() for r in caplog.records if files[0] in r.getMessage() and "below" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    await svc.close()
    await store.close()


@bounded(20)
async def test_index_files_expire_cannot_remove_are_said_once_and_tried_again(tmp_path, monkeypatch, caplog):
    """Index files retention's removals expire, in a directory the file system would not unlink in (EACCES,
    EPERM: chattr +i, as the segments' and queues' of disk9): each removal that expired one said another ERROR, and
    the file, out of the index's list, stayed on disk until a restart loaded it again. Said once a failure run now,
    and tried again at each later expiry (as the queue files a removal leaves are)."""
    store = await _store_with(tmp_path, 6)
    svc = await _service(tmp_path, store, entries=3)       # (a new file every 2 entries)
    await svc.query("T", "x", 1, 0, 1)
    files = list(svc.files)
    assert len(files) >= 4
    real_unlink, index_dir = os.unlink, str(tmp_path / "index")

    def refused(path, *a, **k):
        if os.path.dirname(os.fspath(path)) == index_dir:
            raise OSError(errno.EACCES, "Permission denied", path)
        return real_unlink(path, *a, **k)
    monkeypatch.setattr(os, "unlink", refused)
    with caplog.at_level(logging.ERROR, logger="txmq.index"):
        with pytest.raises(OSError):
            await svc.expire(files[0].end_phy + 1)
        await svc.expire(files[1].end_phy + 1)              # a later removal: refused again, quiet
        await svc.query("T", "x", 1, 0, 1)                  # (the done callbacks have run)
    said = [r.getMessage() for r in caplog.records if r.name == "txmq.index" and r.levelno >= logging.ERROR]
    assert len(said) == 1 and "not removed" in said[0] and "Permission denied" in said[0], said
    expired = [f for f in files if f.end_phy <= files[1].end_phy]
    assert all(os.path.exists(f.path) for f in expired) and svc.files == files[len(expired):]
    monkeypatch.undo()                                      # made removable: the next expiry takes them
    assert await svc.expire(files[1].end_phy + 1) == [f.name for f in expired]
    assert not any(os.path.exists(f.path) for f in expired)
    await svc.close()
    await store.close()
