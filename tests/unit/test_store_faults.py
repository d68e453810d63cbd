"""I/O failures: a failed msync stops the store; it says so with a status, acknowledges nothing it did not
write and flush, and accepts nothing more. (A full disk is not such a failure: test_store_space.py.)"""
from __future__ import annotations

import asyncio
import errno
import os
import time

import pytest

from broker.store import MessageStore, PutRequest, PutStatus, StoreConfig
from broker.store import writer
from tests.support.bounded import bounded

SEG = 1 << 20




def req(size: int = 1000) -> PutRequest:
    return PutRequest.build("T", b"x" * size)


@bounded()
async def test_a_failed_msync_stops_the_store_and_acknowledges_nothing(tmp_path, monkeypatch):
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    good = await store.put(req())
    assert good.ok

    def broken(ranges):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(writer, "_flush_ranges", broken)
    results = await asyncio.gather(*[store.put(req()) for _ in range(20)])
    assert {r.status for r in results} == {PutStatus.SERVICE_NOT_AVAILABLE}
    assert not store.writable and "msync failed" in store.failure
    assert store.max_physical_offset == good.physical_offset + good.size     # nothing unflushed became readable
    assert store.max_offset("T", 0) == 1
    assert (await store.put(req())).status is PutStatus.SERVICE_NOT_AVAILABLE
    assert (await store.put_many([req(), req()]))[0].status is PutStatus.SERVICE_NOT_AVAILABLE
    monkeypatch.undo()
    await store.close()
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()                      # a restart recovers; the unacknowledged records may remain
    assert store.writable and store.max_offset("T", 0) >= 1
    await store.close()


@bounded()
async def test_a_failed_msync_in_async_mode_says_how_much_it_acknowledged_and_never_flushed(tmp_path, monkeypatch,
                                                                                        caplog):
    """Before: "store stops accepting writes: msync failed: ..." and no word of the messages already acknowledged
    (flush async) that no flush took to the disk: 200 sends acknowledged, the file system turned read-only
    (ext4 errors=remount-ro), none of them there after fsck and a restart, and nothing had said so."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG, flush="async", flush_interval_ms=3_600_000))
    await store.open()

    def broken(ranges):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(writer, "_flush_ranges", broken)
    acked = [await store.put(req()) for _ in range(5)]
    assert all(r.ok for r in acked)
    end = acked[-1].physical_offset + acked[-1].size
    await store.close()                     # its last flush fails
    said = [r.getMessage() for r in caplog.records if "store stops accepting writes" in r.getMessage()]
    assert len(said) == 1, said
    assert f"{end} bytes of the log, offsets 0 to {end}, were acknowledged (flush async) and never flushed" in said[0]
    assert "turned read-only" in said[0] and "restart the broker" in said[0]


@bounded()
async def test_put_before_open_and_after_close(tmp_path):
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    assert (await store.put(req())).status is PutStatus.SERVICE_NOT_AVAILABLE
    await store.open()
    await store.close()
    assert (await store.put(req())).status is PutStatus.SERVICE_NOT_AVAILABLE
    await store.close()                     # closing twice is harmless


@bounded()
async def test_every_acknowledged_byte_was_inside_a_flushed_range(tmp_path, monkeypatch):
    """kill -9 keeps the page cache, so only this shows that sync mode msyncs what it acknowledges."""
    flushed: list[tuple[int, int]] = []
    real = writer._flush_ranges

    def recording(ranges):
        real(ranges)
        flushed.extend((seg.start + lo, seg.start + hi) for seg, lo, hi in ranges)
    monkeypatch.setattr(writer, "_flush_ranges", recording)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    results = await asyncio.gather(*[store.put(req(3000 + i % 500)) for i in range(900)])   # ~3 segments
    results += [r for batch in await asyncio.gather(*[store.put_many([req(), req(20_000)]) for _ in range(20)])
                for r in batch]
    covered = sorted(flushed)
    merged = [list(covered[0])]
    for lo, hi in covered[1:]:
        if lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    for r in results:
        assert r.ok
        assert any(lo <= r.physical_offset and r.physical_offset + r.size <= hi for lo, hi in merged), r
    for seg in store.segments()[:-1]:                   # end markers too
        end_marker = seg.start_offset + seg.written
        assert any(lo <= end_marker and end_marker + 8 <= hi for lo, hi in merged)
    await store.close()


def _gated_flushes(monkeypatch):
    """Make the first flush wait for a gate while later ones run: (started_first, released, calls)."""
    import threading
    real = writer._flush_ranges
    first_started, gate = threading.Event(), threading.Event()
    calls = []

    def gated(ranges):
        calls.append(ranges)
        if len(calls) == 1:
            first_started.set()
            assert gate.wait(10), "the test never opened the gate"
            raise_ = getattr(gated, "fail_first", None)
            if raise_:
                raise OSError(errno.EIO, "Input/output error")
        real(ranges)
    monkeypatch.setattr(writer, "_flush_ranges", gated)
    return first_started, gate, calls, gated


async def _second_flush_finished(store, calls) -> None:
    """Wait (bounded) until the writer has two flushes in flight and the second one has returned."""
    w = store._writer
    for _ in range(100_000):
        fl = w._flushing
        if len(calls) >= 2 and len(fl) == 2 and fl[1][0].done():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"no second flush finished: {len(calls)} calls, {len(w._flushing)} in flight")


@bounded()
async def test_pipelined_flushes_acknowledge_in_log_order(tmp_path, monkeypatch):
    """Two group commits are in flight at once (one per flush thread); a later one that returns first waits
    for the earlier: nothing is acknowledged, or readable, before everything before it is flushed."""
    first_started, gate, calls, _ = _gated_flushes(monkeypatch)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    store._writer.second_flush_after = 0        # the second batch does not wait for the first flush at all
    a = store.put(req())
    await asyncio.to_thread(first_started.wait, 10)
    b = store.put(req())
    await _second_flush_finished(store, calls)
    await asyncio.sleep(0)                  # the writer's turn after the second flush's wake-up
    assert not a.done() and not b.done()
    assert store.max_offset("T", 0) == 0    # the second batch is flushed, but not readable before the first
    gate.set()
    ra, rb = await a, await b
    assert ra.ok and rb.ok
    assert rb.physical_offset == ra.physical_offset + ra.size
    assert store.max_offset("T", 0) == 2
    await store.close()


@bounded()
async def test_a_failed_flush_refuses_the_later_flush_in_flight_too(tmp_path, monkeypatch):
    """The second flush succeeded, but it comes after bytes whose state on disk is unknown: refused too."""
    first_started, gate, calls, gated = _gated_flushes(monkeypatch)
    gated.fail_first = True
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    store._writer.second_flush_after = 0        # the second batch does not wait for the first flush at all
    a = store.put(req())
    await asyncio.to_thread(first_started.wait, 10)
    b = store.put(req())
    await _second_flush_finished(store, calls)
    gate.set()
    ra, rb = await a, await b
    assert ra.status is PutStatus.SERVICE_NOT_AVAILABLE and rb.status is PutStatus.SERVICE_NOT_AVAILABLE
    assert not store.writable and "msync failed" in store.failure
    assert store.max_offset("T", 0) == 0
    assert (await store.put(req())).status is PutStatus.SERVICE_NOT_AVAILABLE
    await store.close()


@bounded()
async def test_a_failed_write_stops_the_store_and_acknowledges_nothing(tmp_path, monkeypatch):
    """Records go into segments with pwritev: an I/O error there (not a SIGBUS any more) refuses the batch
    and stops the store, like a failed msync."""
    from broker.store import commit_log
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    good = await store.put(req())
    assert good.ok

    def broken(seg, at, bufs):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(commit_log, "_pwrite_all", broken)
    results = await asyncio.gather(*[store.put(req()) for _ in range(5)])
    assert {r.status for r in results} == {PutStatus.SERVICE_NOT_AVAILABLE}
    assert not store.writable
    assert store.max_offset("T", 0) == 1
    assert (await store.put(req())).status is PutStatus.SERVICE_NOT_AVAILABLE
    monkeypatch.undo()
    await store.close()
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    assert store.max_offset("T", 0) == 1 and (await store.put(req())).ok
    await store.close()


@bounded()
async def test_a_flush_that_returns_after_a_later_one_failed_is_not_acknowledged(tmp_path, monkeypatch):
    """Linux reports a file's writeback error to one msync of that open file, whichever range it asked for:
    if the second flush reports the EIO of a page in the first one's range, the first returns 0 (found in
    review). Flushes in flight together are judged together: neither batch is acknowledged."""
    import threading
    real = writer._flush_ranges
    first_started, gate = threading.Event(), threading.Event()
    calls = []

    def flush(ranges):
        calls.append(ranges)
        if len(calls) == 1:             # flush 1: its msync is in the kernel ...
            first_started.set()
            assert gate.wait(10)
            return real(ranges)         # ... and returns 0: the EIO of its page went to flush 2's check
        raise OSError(errno.EIO, "Input/output error")     # flush 2 (same file) reports that EIO
    monkeypatch.setattr(writer, "_flush_ranges", flush)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=1 << 20))
    await store.open()
    store._writer.second_flush_after = 0
    try:
        a = store.put(req())
        await asyncio.to_thread(first_started.wait, 10)
        b = store.put(req())
        w = store._writer
        for _ in range(100_000):
            if len(calls) >= 2 and len(w._flushing) == 2 and w._flushing[1][0].done():
                break
            await asyncio.sleep(0)
        assert w._flushing[1][0].exception() is not None
        gate.set()
        ra, rb = await a, await b
        assert not rb.ok
        assert not ra.ok, ("batch 1 acknowledged although a concurrent msync of the same file reported EIO "
                           "(Linux reports a file's writeback error to one fsync/msync per open file)")
    finally:
        gate.set()
        await store.close()


@pytest.mark.parametrize("flush", ["sync", "async"])
@bounded()
async def test_a_failing_completion_stops_the_writer_and_answers_every_put(tmp_path, flush):
    """A bug while flushed records are made readable (here: the consume-queue step raises) stops the
    writer loudly. Every put waiting on it is answered SERVICE_NOT_AVAILABLE, those of the batch being
    completed included, and nothing more is accepted: none may wait forever for an answer."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG, flush=flush))
    await store.open()
    assert (await store.put(req())).ok
    real = store._writer.on_commit

    def failing(units, infos):
        raise RuntimeError("a bug in the completion")
    store._writer.on_commit = failing
    results = await asyncio.gather(*[store.put(req()) for _ in range(20)])
    assert {r.status for r in results} == {PutStatus.SERVICE_NOT_AVAILABLE}
    assert not store.writable and "a bug in the completion" in store.failure
    assert (await store.put(req())).status is PutStatus.SERVICE_NOT_AVAILABLE
    store._writer.on_commit = real
    await store.close()


@pytest.mark.parametrize("flush", ["sync", "async"])
@bounded()
async def test_a_failing_copy_stops_the_writer_and_answers_every_put(tmp_path, flush):
    """A bug while a drained batch is copied into the log (here: append raises something not an OSError)
    stops the writer. The batch had left the queue and was in no waiting list yet, so the crash clean-up
    missed it: its puts waited forever. Every one is answered SERVICE_NOT_AVAILABLE."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG, flush=flush))
    await store.open()
    assert (await store.put(req())).ok
    clog = store._writer.clog
    real = clog.append

    def failing(entries, i, done, units, infos):
        real(entries[:1], i, done, units, infos)      # the first one copied, then the bug
        raise RuntimeError("a bug in the copy")
    clog.append = failing
    results = await asyncio.gather(*[store.put(req()) for _ in range(20)])
    assert {r.status for r in results} == {PutStatus.SERVICE_NOT_AVAILABLE}
    assert not store.writable and "a bug in the copy" in store.failure
    del clog.append
    await store.close()


@bounded()
async def test_a_failing_final_checkpoint_still_releases_the_store(tmp_path, monkeypatch):
    """close() used to raise before stopping its threads and unlocking the directory when the checkpoint failed
    with anything but an OSError: the same process could not open the store again."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    assert (await store.put(req())).status is PutStatus.PUT_OK

    async def broken_checkpoint():
        raise RuntimeError("a bug in the checkpoint")
    monkeypatch.setattr(store, "_checkpoint", broken_checkpoint)
    with pytest.raises(RuntimeError, match="a bug in the checkpoint"):
        await store.close()
    assert not store._io._thread.is_alive() and not store._reserve_io._thread.is_alive()
    again = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await again.open()              # the lock was released: the store opens, with what was acknowledged
    try:
        assert again.max_physical_offset > 0
    finally:
        await again.close()


@bounded()
async def test_a_job_handed_to_a_stopped_io_thread_fails_instead_of_waiting_forever():
    io = writer.IoThread("test-io")
    assert await io.submit(lambda x: x + 1, 1) == 2
    io.stop()
    woken = asyncio.Event()
    fut = io.submit(lambda: 1, then=woken.set)
    with pytest.raises(Exception, match="test-io is stopped"):
        await fut
    await woken.wait()              # the caller's wake-up runs too, as after a job that ran


def _stalled_writes(monkeypatch, fds) -> list:
    """pwritev / pwrite into any of ``fds`` write nothing and report nothing (os.pwrite may return 0);
    other files write normally. Past 100 such calls it raises instead: the loop that retries would spin for
    ever, and the test must end to fail."""
    calls = []
    real_pwrite, real_pwritev = os.pwrite, os.pwritev

    def stalled(real):
        def write(fd, data, at):
            if fd not in fds:
                return real(fd, data, at)
            calls.append(at)
            if len(calls) > 100:
                raise AssertionError("a write that wrote nothing was retried 100 times")
            return 0
        return write
    monkeypatch.setattr(os, "pwrite", stalled(real_pwrite))
    monkeypatch.setattr(os, "pwritev", stalled(real_pwritev))
    return calls


@bounded()
async def test_a_write_that_writes_nothing_stops_the_store_and_names_the_segment(tmp_path, monkeypatch):
    """os.pwrite may return 0 without an error; the copy loop retried it for ever, with the loop held. Now
    it is an I/O error like any other, naming the segment, and the store stops."""
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    good = await store.put(req())
    assert good.ok
    seg = store._log.segments[-1]
    calls = _stalled_writes(monkeypatch, {seg.fd})
    result = await store.put(req())
    assert result.status is PutStatus.SERVICE_NOT_AVAILABLE
    assert len(calls) <= 2
    assert not store.writable and seg.path in store.failure and "wrote 0 bytes" in store.failure
    monkeypatch.undo()
    await store.close()


def test_zeros_that_write_nothing_raise_naming_the_file(tmp_path, monkeypatch):
    from broker.store.reserve import write_zeros
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        calls = _stalled_writes(monkeypatch, {fd})
        with pytest.raises(OSError) as err:
            write_zeros(fd, 0, 4096, path)
        assert err.value.errno == errno.EIO and err.value.filename == path and len(calls) == 1
    finally:
        monkeypatch.undo()
        os.close(fd)


def test_a_metrics_snapshot_line_that_writes_nothing_raises_naming_the_file(tmp_path, monkeypatch):
    """The same loop outside the store: the metrics snapshot's append (on a worker thread) sliced its line by what
    os.write returned, and a 0 spun that thread for ever, every later snapshot waiting behind it."""
    from broker.metrics import append_snapshot
    calls = []
    real_write = os.write

    def write(fd, data):
        calls.append(fd)
        if len(calls) > 100:
            raise AssertionError("a write that wrote nothing was retried 100 times")
        return 0
    monkeypatch.setattr(os, "write", write)
    try:
        with pytest.raises(OSError) as err:
            append_snapshot(str(tmp_path), {"ts": 1_700_000_000_000, "connections": 1})
    finally:
        monkeypatch.setattr(os, "write", real_write)
    assert err.value.errno == errno.EIO and err.value.filename.endswith(".jsonl") and len(calls) == 1
    assert os.path.getsize(err.value.filename) == 0         # and nothing torn left for the next line


def test_a_snapshot_appended_after_a_torn_line_is_a_line_of_its_own(tmp_path):
    """A broker killed (kill -9, power) while appending a snapshot line leaves its first part with no newline; the
    next start's first snapshot was appended to it, and the two read as one bad line (ops/spark drops it): the
    first whole snapshot after the crash was lost with the torn one."""
    import json
    from broker.metrics import append_snapshot
    path = append_snapshot(str(tmp_path), {"ts": 1_700_000_000_000, "connections": 1})
    with open(path, "ab") as f:
        f.write(b'{"ts":1700000001000,"connections":1,"consumer_la')        # killed mid-append
    append_snapshot(str(tmp_path), {"ts": 1_700_000_002_000, "connections": 2})
    lines = open(path, "rb").read().split(b"\n")
    assert lines[-1] == b"" and json.loads(lines[-2])["connections"] == 2, lines
    assert len(lines) == 4 and json.loads(lines[0])["connections"] == 1


@bounded()
async def test_a_flush_that_does_not_return_is_seen_while_it_hangs(tmp_path, monkeypatch):
    """An msync that never returns (a hung disk) held every sync put unanswered, and nothing showed it: the
    flush-latency histogram is observed only when a flush ends. flush_age_s (txmq_store_flush_in_flight_seconds)
    is its age while it runs, 0.0 once none is in flight."""
    first_started, gate, _calls, _ = _gated_flushes(monkeypatch)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    try:
        assert store.flush_age_s() == 0.0
        put = store.put(req())
        await asyncio.to_thread(first_started.wait, 10)
        first = store.flush_age_s()
        await asyncio.to_thread(time.sleep, 0.05)        # (time passing is what is measured)
        assert store.flush_age_s() >= first + 0.05 and not put.done()
        gate.set()
        assert (await put).ok
        assert store.flush_age_s() == 0.0
    finally:
        gate.set()
        await store.close()


def test_a_hung_flush_is_said_once_and_its_end_once(tmp_path, caplog):
    import types

    from broker.config import BrokerConfig
    from broker.server import FLUSH_HUNG_S, BrokerServer
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    age = [FLUSH_HUNG_S + 1]
    server.ctx = types.SimpleNamespace(store=types.SimpleNamespace(flush_age_s=lambda: age[0],
                                                                   slowest_flush_s=lambda: 0.0))
    assert server._flush_age() == FLUSH_HUNG_S + 1
    server._flush_age()
    assert caplog.text.count("has not returned in") == 1
    age[0] = 0.0
    server._flush_age()
    server._flush_age()
    assert caplog.text.count("commit-log flushes return again") == 1


def test_a_disk_whose_flushes_each_take_12_s_is_said_slow_once_not_hung_at_every_flush(tmp_path, caplog):
    """Flushes that each took 12 s, and returned, were each said at ERROR as a hung disk (past FLUSH_HUNG_S) and
    back at WARNING, with nothing saying how long they took: measured with a broker on such a disk, an ERROR pair
    every 12 s. The first is said (nothing yet says the disk is only slow), and its end with how long it ran; the
    next ones as slow are not, a wait longer than twice the slowest is."""
    import types

    from broker.config import BrokerConfig
    from broker.server import BrokerServer
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    age, slowest = [0.0], [0.0]
    server.ctx = types.SimpleNamespace(store=types.SimpleNamespace(flush_age_s=lambda: age[0],
                                                                   slowest_flush_s=lambda: slowest[0]))
    for _flush in range(5):         # each sampled every second by the gauge loop: 1 s .. 12 s, then returned
        for second in range(1, 13):
            age[0] = float(second)
            server._flush_age()
        age[0], slowest[0] = 0.0, 12.0
        server._flush_age()
    assert caplog.text.count("has not returned in") == 1, caplog.text
    assert caplog.text.count("commit-log flushes return again, after 12 s or more: the disk is slow") == 1
    for second in range(1, 26):     # a flush past twice the slowest: said, hung or not
        age[0] = float(second)
        server._flush_age()
    assert caplog.text.count("has not returned in 25 s") == 1, caplog.text


@pytest.mark.parametrize("slowest, said", [
    (0.0, "has not returned in 11 s (a hung disk"),    # no flush ever that slow: hung
    (20.0, "the store's disk is slow, not hung (its flushes return, the slowest in 20.0 s)"),
    # in flight longer than any flush has returned (11 s, the slowest 6 s): not known to be only slow
    (6.0, "the store's disk is slow or hung (a flush or a write on its I/O thread has run 11 s, the slowest to "
          "return in the last 5 minutes 6.0 s)")])
@bounded()
async def test_a_stop_waits_for_a_flush_as_slow_as_the_disk_has_been_within_its_budget(tmp_path, caplog, monkeypatch,
                                                                                     slowest, said):
    """A flush in flight 11 s: hung on a disk whose flushes have all returned quicker than FLUSH_HUNG_S, given up at
    once; on one whose flushes have taken 6 s, slow (twice that is its bound), waited for until the stop's budget
    (STOP_BEHIND_THE_LOG_S, 0.5 s here) is spent, then given up saying so, not that the disk hung."""
    import types

    from broker import server as server_mod
    from broker.config import BrokerConfig
    monkeypatch.setattr(server_mod, "STOP_BEHIND_THE_LOG_S", 0.5)
    server = server_mod.BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    server.ctx = types.SimpleNamespace(store=types.SimpleNamespace(
        flush_age_s=lambda: server_mod.FLUSH_HUNG_S + 1, io_stalled_s=lambda: 0.0, slowest_flush_s=lambda: slowest))
    never = asyncio.Event()
    await server._stop_behind_the_log("store", never.wait)
    assert caplog.text.count("stopping without closing the store") == 1, caplog.text
    assert said in caplog.text, caplog.text


@bounded()
async def test_a_delete_whose_caller_is_cancelled_behind_a_flush_neither_runs_nor_fails_the_store(tmp_path,
                                                                                                monkeypatch):
    """A topic delete waits for the writer between batches (Writer.control); its caller cancelled there (a stop
    cancelling the slave's copy or the retention mid-delete, behind a slow flush) cancelled the control's future,
    and the writer, running the delete all the same, set a result on it: InvalidStateError in the writer's loop,
    the log failed, every later send SERVICE_NOT_AVAILABLE until a restart, and the topic half deleted (its config
    and queues gone, the caller's steps after it never run). A control given up before it ran is not run now."""
    first_started, gate, _calls, _ = _gated_flushes(monkeypatch)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    try:
        held = store.put(req())
        assert await asyncio.to_thread(first_started.wait, 10)
        deleting = asyncio.ensure_future(store.delete_topic("T"))
        for _ in range(10_000):
            if store._writer._controls:
                break
            await asyncio.sleep(0)
        assert store._writer._controls, "the delete never queued behind the flush"
        deleting.cancel()
        gate.set()
        assert (await held).status == PutStatus.PUT_OK
        with pytest.raises(asyncio.CancelledError):
            await deleting
        after = await store.put(req())
        assert after.status == PutStatus.PUT_OK, after
        assert store.max_offset("T", 0) == 2        # not deleted: its caller gave up before it ran
    finally:
        await store.close()


@bounded()
async def test_a_slow_flush_long_ago_does_not_make_a_later_hang_look_slow(tmp_path, monkeypatch):
    """The stop's hung bound is twice the slowest flush seen to return (server._hung_after). Kept as the maximum
    over the process's life, one 25 s flush (a disk slow for a minute, hours ago) made the bound 50 s for ever:
    past the stop's whole budget (30 s), so a disk that really hung later was waited for all 30 s, not 10, and
    the stop said it was slow, not hung. Only the recent flushes count (writer.SLOW_FLUSH_WINDOW_S)."""
    import types
    shift = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + shift[0],
                                  monotonic=lambda: time.monotonic() + shift[0])
    monkeypatch.setattr(writer, "time", clock)
    real = writer._flush_ranges
    slow = [True]

    def flush(ranges):
        if slow[0]:
            shift[0] += 25.0        # this flush took 25 s, by the writer's clock
        real(ranges)
    monkeypatch.setattr(writer, "_flush_ranges", flush)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    try:
        assert (await store.put(req())).status == PutStatus.PUT_OK
        assert store.slowest_flush_s() >= 25.0      # just now: the disk is slow
        slow[0] = False
        shift[0] += 3600.0                          # an hour of quick flushes later
        assert (await store.put(req())).status == PutStatus.PUT_OK
        assert store.slowest_flush_s() < 1.0, store.slowest_flush_s()
    finally:
        await store.close()


@bounded(30)
async def test_a_slow_disk_stop_leaves_the_offsets_last_save_its_bound_under_60_s(tmp_path, caplog):
    """The store's wait on a slow disk (STOP_BEHIND_THE_LOG_S) came after the grace (5 s) and the queue lock file
    (2 s) and before the consumer offsets' last save, which waits for a write until it is said hung (30 s) and 2 s
    more: 5 + 2 + 30 (+1, the wait's step) + 32 = 70 s, past systemd's and compose's 60 s (TimeoutStopSec): SIGKILL
    before the offsets were saved, consumers sent back to the last periodic save. The budget now runs from the
    stop's start and leaves the offsets' bound: a store part begun once the stop has spent it is given up at once
    (counted from the part's start, it would wait STOP_BEHIND_THE_LOG_S more: 25 s). (Was a part begun 24 s in,
    given up in < 2.5 s of the wall clock against a 1 s budget and a 1 s poll: flaky on a loaded host.)"""
    import types

    from broker import server as server_mod
    from broker.config import BrokerConfig
    from broker.store import offsets
    assert server_mod.STOP_BEHIND_THE_LOG_S + 1 + offsets.WRITE_HUNG_S + offsets.HUNG_CLOSE_WAIT_S <= 58
    server = server_mod.BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    server.ctx = types.SimpleNamespace(store=types.SimpleNamespace(
        flush_age_s=lambda: server_mod.FLUSH_HUNG_S + 1, io_stalled_s=lambda: 0.0, slowest_flush_s=lambda: 20.0))
    # the grace, the lock file, the retention and scheduler spent the budget
    server._stop_began = time.monotonic() - server_mod.STOP_BEHIND_THE_LOG_S - 1.0
    never = asyncio.Event()
    # (a generous bound on the wait, under the 25 s it would wait counting from the part's start)
    await asyncio.wait_for(server._stop_behind_the_log("store", never.wait), server_mod.STOP_BEHIND_THE_LOG_S - 5)
    assert not never.is_set()
    assert "the store's disk is slow, not hung" in caplog.text, caplog.text


def test_a_flush_that_hangs_right_after_a_slow_one_is_said_though_no_sample_saw_none_in_flight(tmp_path, caplog):
    """Under steady SYNC_FLUSH sends the writer starts the next flush the moment the last returns, so the gauge
    loop never samples an age of 0: the first slow flush (12 s) was said at ERROR, its flag never cleared, and a
    flush that then hung for good was never said at all (nor the slow one's end). A sample younger than the last
    is a new wait: the last one ended."""
    import types

    from broker.config import BrokerConfig
    from broker.server import BrokerServer
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    age, slowest = [0.0], [0.0]
    server.ctx = types.SimpleNamespace(store=types.SimpleNamespace(flush_age_s=lambda: age[0],
                                                                   slowest_flush_s=lambda: slowest[0]))
    for second in range(1, 13):     # the first flush: 12 s, said hung past 10 s (nothing slower seen)
        age[0] = float(second)
        server._flush_age()
    slowest[0] = 12.0               # it returned; the next began at once, sampled 0.5 s old
    for _flush in range(3):         # three more of 12 s each, back to back: slow, not said
        for second in range(12):
            age[0] = second + 0.5
            server._flush_age()
    assert caplog.text.count("has not returned in") == 1, caplog.text
    assert caplog.text.count("commit-log flushes return again, after 12 s or more") == 1, caplog.text
    for second in range(60):        # then one that never returns: said past twice the slowest
        age[0] = second + 0.5
        server._flush_age()
    assert caplog.text.count("has not returned in 24 s") == 1, caplog.text
    assert caplog.text.count("has not returned in") == 2, caplog.text


def test_a_hang_after_a_very_slow_flush_is_said_by_the_time_the_alert_fires(tmp_path, caplog):
    """One flush of 100 s that returned set the bound at twice it for 5 minutes: a flush that then hung for good
    was said at ERROR only past 200 s, while TxmqStoreFlushHung (critical, past 30 s) had long fired with nothing
    in the log. A running broker says a wait at ERROR past 30 s at most, as the alert does."""
    import types

    from broker.config import BrokerConfig
    from broker.server import BrokerServer
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    age, slowest = [0.0], [100.0]
    server.ctx = types.SimpleNamespace(store=types.SimpleNamespace(flush_age_s=lambda: age[0],
                                                                   slowest_flush_s=lambda: slowest[0]))
    for second in range(1, 31):     # under the alert's 30 s: slow, as that disk's flushes are
        age[0] = float(second)
        server._flush_age()
    assert "has not returned in" not in caplog.text
    age[0] = 31.0
    server._flush_age()
    assert caplog.text.count("has not returned in 31 s") == 1, caplog.text
    assert server._hung_after() == 200.0        # (a stop's own bound is unchanged)


@bounded(30)
async def test_sync_puts_are_flushed_beside_a_metadata_job_held_on_the_first_flush_thread(tmp_path, monkeypatch):
    """The checkpoint, segments.json and the transactions' snapshot run on the first flush thread. A flush queued
    behind one of them held on a slow or hung disk held every sync put (their flushes complete together): 2 s
    fsyncs left producers unanswered for 20 s. Flushes go to a thread with nothing else queued, and a second flush
    in flight waits rather than queue behind the held job: every put is answered while it is still held."""
    import threading
    flush = writer._flush_ranges

    def slow(ranges) -> None:   # a flush in flight while the next batches are copied: each wants a second flush
        time.sleep(0.02)
        flush(ranges)
    monkeypatch.setattr(writer, "_flush_ranges", slow)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    store._writer.second_flush_after = 0        # a batch copied during a flush starts its own at once
    began, gate = threading.Event(), threading.Event()

    def held() -> None:
        began.set()
        gate.wait(30)

    job = store.run_io(held)
    try:
        assert await asyncio.to_thread(began.wait, 10)
        puts = []
        for _ in range(100):        # a put each millisecond: batches written while the one before is being flushed
            puts.append(store.put(req()))
            await asyncio.sleep(0.001)
        done, pending = await asyncio.wait(puts, timeout=10)
        assert not pending, f"{len(pending)} of 100 puts unanswered behind the held job"
        assert all(p.result().ok for p in done)
        assert not job.done()
    finally:
        gate.set()
    await job
    assert store.max_offset("T", 0) == 100
    await store.close()


@bounded()
async def test_a_flush_on_the_second_thread_that_returns_last_holds_the_one_after_it(tmp_path, monkeypatch):
    """The first flush goes to the second thread (the first holds a metadata job), the next to the first thread
    once that job ends, and returns first: nothing is acknowledged or readable before the earlier flush returns."""
    import threading
    first_started, gate, calls, _ = _gated_flushes(monkeypatch)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    w = store._writer
    w.second_flush_after = 0
    held = threading.Event()
    job = store.run_io(held.wait, 10)
    try:
        a = store.put(req())
        assert await asyncio.to_thread(first_started.wait, 10)
        assert w._flushing[0][7] is store._io2       # beside the held job, not behind it
        held.set()
        await job
        b = store.put(req())
        await _second_flush_finished(store, calls)
        assert w._flushing[1][7] is store._io
        await asyncio.sleep(0)                  # the writer's turn after the second flush's wake-up
        assert not a.done() and not b.done()
        assert store.max_offset("T", 0) == 0
    finally:
        held.set()
        gate.set()
    ra, rb = await a, await b
    assert ra.ok and rb.ok and rb.physical_offset == ra.physical_offset + ra.size
    assert store.max_offset("T", 0) == 2
    await store.close()


@bounded()
async def test_puts_are_answered_while_a_segment_removal_waits_behind_a_held_metadata_job(tmp_path):
    """Retention removes the oldest segment in the writer, between batches. Its unlink went to the first flush thread,
    queued behind a checkpoint there: with a metadata job held (a checkpoint's fsyncs on a slow or hung disk) no put
    was copied or flushed until it ended (every put 2.0 s behind a job held 2 s; for ever behind a hung one). The
    unlink goes to the reserve thread, idle then; only the unmapping waits behind the job, outside the writer."""
    import threading
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=1 << 16))
    await store.open()
    for _ in range(150):
        assert (await store.put(req())).ok
    oldest = store.segments()[0].name
    gate = threading.Event()
    job = store.run_io(gate.wait, 30)
    try:
        removal = asyncio.ensure_future(store.remove_segment(oldest, "test"))
        for _ in range(1000):       # the removal has taken the segment out of the log
            if store.segments()[0].name != oldest:
                break
            await asyncio.sleep(0.001)
        assert store.segments()[0].name != oldest, "the removal never left the writer"
        done, _ = await asyncio.wait([asyncio.ensure_future(store.put(req()))], timeout=10)
        assert done and next(iter(done)).result().ok, "a put waited for the removal behind the held job"
        assert not job.done() and not removal.done()    # the unmapping still waits behind it
    finally:
        gate.set()
    await job
    assert (await removal).name == oldest
    assert not os.path.exists(os.path.join(str(tmp_path), "commitlog", oldest))
    await store.close()
