"""HA units: the frame codec (fed in any cuts), the offset watermark (a driven clock), and the store's replica
path (a master store's chunks copied into a slave store: same bytes, same queues, across segment rolls)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random

import pytest

from broker.ha.codec import (HEADER, HAProtocolError, OffsetDecoder, TransferDecoder, encode_offset,
                             encode_transfer)
from broker.ha.waiter import OffsetWatermark
from broker.store import GetStatus, MessageStore, PutRequest, PutStatus, StoreConfig
from tests.support.bounded import bounded

SEG = 64 * 1024
CFG = StoreConfig(segment_size=SEG, cq_units_per_file=100, checkpoint_interval_ms=20)


# ------------------------------------------------------------------ codec
def _cuts(data: bytes, rng: random.Random):
    pos = 0
    while pos < len(data):
        step = rng.randint(1, 13)
        yield data[pos:pos + step]
        pos += step


def test_transfer_frames_survive_any_split():
    frames = [(0, b""), (12345, b"x" * 100), (1 << 40, b"abc"), (7, b"")]
    wire = b"".join(encode_transfer(p, b) + b for p, b in frames)
    assert encode_transfer(5, b"ab") == HEADER.pack(5, 2) == (5).to_bytes(8, "big") + (2).to_bytes(4, "big")
    for seed in range(20):
        dec = TransferDecoder()
        got = [f for cut in _cuts(wire, random.Random(seed)) for f in dec.feed(cut)]
        assert got == frames and dec.buffered == 0


def test_transfer_decoder_refuses_nonsense_headers():
    with pytest.raises(HAProtocolError):
        TransferDecoder().feed(HEADER.pack(-1, 0))
    with pytest.raises(HAProtocolError):
        TransferDecoder(max_body=10).feed(HEADER.pack(0, 11))


def test_offset_reports_in_any_split():
    wire = b"".join(encode_offset(v) for v in (0, 1, 1 << 33, 42))
    assert encode_offset(1) == b"\0" * 7 + b"\1"
    for seed in range(20):
        dec = OffsetDecoder()
        assert [v for cut in _cuts(wire, random.Random(seed)) for v in dec.feed(cut)] == [0, 1, 1 << 33, 42]
    with pytest.raises(HAProtocolError):
        OffsetDecoder().feed(encode_offset(-5))


# ------------------------------------------------------------------ watermark
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@bounded()
async def test_watermark_resolves_every_waiter_it_covers_in_one_advance():
    w = OffsetWatermark(3.0, clock=Clock(), use_timer=False)
    futs = [w.wait(end) for end in (10, 20, 30, 40)]
    assert w.advance(25) == 2
    assert [f.done() for f in futs] == [True, True, False, False]
    assert all(f.result() is True for f in futs[:2])
    assert w.advance(20) == 0 and w.acked == 25          # never goes back
    assert w.wait(25).result() is True                    # already covered: resolved at once
    w.advance(40)
    assert all(f.result() is True for f in futs)


@bounded()
async def test_watermark_times_out_by_the_clock():
    clock = Clock()
    w = OffsetWatermark(3.0, clock=clock, use_timer=False)
    a = w.wait(10)
    clock.now += 2.0
    b = w.wait(20)
    clock.now += 1.5                                     # a is 3.5 s old, b 1.5 s
    assert w.expire() == 1
    assert a.result() is False and not b.done()
    w.advance(20)
    assert b.result() is True
    clock.now += 10
    assert w.expire() == 0 and w.waiting == 0


@bounded()
async def test_watermark_timer_fires_on_the_loop():
    w = OffsetWatermark(0.05)
    fut = w.wait(1)
    assert await asyncio.wait_for(fut, 10) is False
    w.fail_all()


# ------------------------------------------------------------------ store replica path
def _req(i: int, size: int = 3000) -> PutRequest:
    return PutRequest.build(f"T{i % 3}", os.urandom(size), queue_id=i % 2, properties={"TAGS": f"t{i % 4}"},
                            born_timestamp=123)


async def _copy(master: MessageStore, slave: MessageStore, start: int, batch: int = 8000) -> int:
    """What an HA link does, without the socket: chunks from the master, appended by the slave."""
    nxt = start
    last = None
    while True:
        chunk = master.replica_chunk(nxt, batch)
        if chunk is None:
            break
        fut, nxt = slave.append_replica(nxt, bytes(chunk))
        chunk.release()
        last = fut
    if last is not None:
        assert (await last).ok
    return nxt


def _files(store_dir) -> dict[str, bytes]:
    d = os.path.join(store_dir, "commitlog")
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@bounded(30)
async def test_slave_store_is_a_byte_copy_across_segment_rolls(tmp_path):
    master = MessageStore(str(tmp_path / "m"), CFG)
    slave = MessageStore(str(tmp_path / "s"), CFG)
    seen = []
    slave.add_dispatch_listener(seen.append)
    await master.open()
    await slave.open()
    slave.set_replica_only()
    try:
        for i in range(60):                          # ~180 KB: three segment rolls
            assert (await master.put(_req(i))).ok
        end = await _copy(master, slave, 0)
        assert end == slave.max_physical_offset == master.max_physical_offset > 2 * SEG
        for key in master.queues():
            assert slave.max_offset(*key) == master.max_offset(*key)
            got_m = master.get_messages(*key, 0, 100, 1 << 20)
            got_s = slave.get_messages(*key, 0, 100, 1 << 20)
            assert [bytes(b) for b in got_s.buffers] == [bytes(b) for b in got_m.buffers]
        assert len(seen) == 60 and not any(info.recovering for info in seen)
        assert (await slave.put(_req(0))).status is PutStatus.SERVICE_NOT_AVAILABLE   # a slave takes no puts
        with pytest.raises(ValueError, match="whole record"):
            slave.append_replica(master.max_physical_offset, bytes(100))
    finally:
        await master.close()
        await slave.close()
    assert _files(tmp_path / "m") == _files(tmp_path / "s")


@bounded(30)
async def test_slave_store_refuses_a_chunk_for_another_offset_and_resumes_after_restart(tmp_path):
    master = MessageStore(str(tmp_path / "m"), CFG)
    await master.open()
    for i in range(10):
        await master.put(_req(i, 500))
    slave = MessageStore(str(tmp_path / "s"), CFG)
    await slave.open()
    slave.set_replica_only()
    half = await _copy(master, slave, 0, batch=2000)
    first = master.replica_chunk(0, 2000)
    fut, _ = slave.append_replica(0, bytes(first))          # the log already holds offset 0
    first.release()
    res = await fut
    assert res.status is PutStatus.MESSAGE_ILLEGAL and "ends at" in res.remark
    await slave.close()
    for i in range(10, 20):
        await master.put(_req(i, 500))
    slave = MessageStore(str(tmp_path / "s"), CFG)       # restart: recovery, then on from its own end
    await slave.open()
    slave.set_replica_only()
    assert slave.max_physical_offset == half
    await _copy(master, slave, half)
    assert slave.max_physical_offset == master.max_physical_offset
    await master.close()
    await slave.close()
    assert _files(tmp_path / "m") == _files(tmp_path / "s")


@bounded(30)
async def test_empty_slave_starts_its_log_where_the_masters_starts(tmp_path):
    master = MessageStore(str(tmp_path / "m"), CFG)
    await master.open()
    for i in range(30):
        await master.put(_req(i))
    first = master.segments()[0].name
    await master.remove_segment(first, "test")
    start = master.min_physical_offset
    assert start == SEG
    slave = MessageStore(str(tmp_path / "s"), CFG)
    await slave.open()
    slave.set_replica_only()
    assert slave.is_empty
    await slave.rebase_empty(start)
    assert slave.min_physical_offset == slave.max_physical_offset == start
    await _copy(master, slave, start)
    assert slave.max_physical_offset == master.max_physical_offset
    await master.close()
    await slave.close()
    assert _files(tmp_path / "m") == _files(tmp_path / "s")
    reopened = MessageStore(str(tmp_path / "s"), CFG)
    await reopened.open()
    assert reopened.min_physical_offset == start and reopened.max_physical_offset == master.max_physical_offset
    await reopened.close()


@bounded(30)
async def test_a_crash_while_an_empty_slave_is_rebased_leaves_a_store_that_starts(tmp_path, monkeypatch):
    """Killed between making the new first segment and removing the old empty one, a slave left both files:
    recovery then refused to start (a segment missing from the middle of the log)."""
    from broker.store.commit_log import CommitLog

    def killed(self, new):
        raise RuntimeError("killed here")

    slave = MessageStore(str(tmp_path), CFG)
    await slave.open()
    slave.set_replica_only()
    monkeypatch.setattr(CommitLog, "rebase", killed)
    with pytest.raises(RuntimeError, match="killed here"):
        await slave.rebase_empty(3 * SEG)
    await slave.close()
    monkeypatch.undo()
    again = MessageStore(str(tmp_path), CFG)
    await again.open()
    try:
        assert again.is_empty or (again.min_physical_offset == again.max_physical_offset == 3 * SEG)
        await again.rebase_empty(3 * SEG)
        assert again.min_physical_offset == again.max_physical_offset == 3 * SEG
    finally:
        await again.close()


@bounded(30)
async def test_a_slave_begun_past_zero_keeps_the_masters_queue_offsets(tmp_path):
    """A slave whose log begins where retention trimmed its master's: each queue's first record has a queue
    offset past 0, and the slave's queue must hold it there, as the master's does (it went in at 0, so a
    consumer reading the slave got the master's unit 4 as its unit 0 and found nothing at 4)."""
    master = MessageStore(str(tmp_path / "m"), CFG)
    await master.open()
    for i in range(30):
        await master.put(_req(i))
    await master.remove_segment(master.segments()[0].name, "test")
    slave = MessageStore(str(tmp_path / "s"), CFG)
    await slave.open()
    slave.set_replica_only()
    await slave.rebase_empty(master.min_physical_offset)
    await _copy(master, slave, master.min_physical_offset)

    def same_queues(store):
        for key in master.queues():
            lo, hi = master.min_offset(*key), master.max_offset(*key)
            assert lo > 0 and (store.min_offset(*key), store.max_offset(*key)) == (lo, hi)
            got_m, got_s = master.get_messages(*key, lo, 100, 1 << 20), store.get_messages(*key, lo, 100, 1 << 20)
            assert got_s.status is got_m.status is GetStatus.FOUND
            assert [bytes(b) for b in got_s.buffers] == [bytes(b) for b in got_m.buffers]

    try:
        same_queues(slave)
        await slave.close()
        slave = MessageStore(str(tmp_path / "s"), CFG)
        await slave.open()
        same_queues(slave)
        # the units before each queue's first are pre-blank, not zeros a restart would take for lost ones
        assert slave.report.queues_rebuilt == [] and slave.damaged_queues() == {}
    finally:
        await master.close()
        await slave.close()


@bounded()
async def test_watermark_reset_forgets_a_gone_slaves_confirmations():
    w = OffsetWatermark(3.0, clock=Clock(), use_timer=False)
    w.advance(100)
    w.reset(0)                       # that slave left; a new one has confirmed nothing yet
    fut = w.wait(50)
    assert not fut.done()
    w.advance(50)
    assert fut.result() is True


async def test_a_slave_ahead_of_its_master_is_dropped_not_counted():
    """A slave whose log is longer than the master's (the master cut a torn tail at recovery, or its store
    was replaced) must not confirm anything: its report would acknowledge sends no slave holds."""
    from types import SimpleNamespace

    from broker.ha.codec import encode_offset
    from broker.ha.master import HAMaster
    from protocol.codes import ResponseCode

    store = SimpleNamespace(max_physical_offset=1000, min_physical_offset=0, replica_chunk=lambda *a: None)
    config = SimpleNamespace(broker_role="SYNC_MASTER", ha_transfer_batch_size=32 * 1024,
                             ha_heartbeat_interval_ms=60_000, ha_housekeeping_interval_ms=60_000,
                             ha_slave_fallbehind_max=1 << 28, ha_slave_timeout_ms=3000)
    master = HAMaster(store, config)
    server = await asyncio.start_server(master.serve, "127.0.0.1", 0)
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
            writer.write(encode_offset(50_000))                   # "I hold 50,000 bytes" of a 1,000-byte log
            await writer.drain()
            assert await reader.read() == b""                     # the master closes the connection ...
            writer.close()
            while master.links:
                await asyncio.sleep(0.01)
        assert master.acked < 1200                                # ... and counted nothing of it
        assert master.confirm(1200) == ResponseCode.SLAVE_NOT_AVAILABLE
    finally:
        server.close()
        master.close()


async def test_a_slave_whose_log_end_is_no_record_boundary_here_is_dropped_not_counted():
    """A slave's first report is where its log ends. If that is not where a record of this master's log
    begins, the two logs differ (the master's store was replaced, or rebuilt from another copy, and has
    grown past the slave's end): the slave holds other bytes. It was counted first -- a send waiting at
    that moment was answered SUCCESS -- and only then did the sender fail, logged as a warning about a record
    boundary. It is dropped before its report counts, and the log says the slave diverged."""
    import logging
    from types import SimpleNamespace

    from broker.ha.codec import encode_offset
    from broker.ha.master import HAMaster
    from protocol.codes import ResponseCode

    def replica_chunk(phys, limit):
        if phys == 600:
            raise ValueError("offset 600 of its segment is not a record boundary")
        return None

    store = SimpleNamespace(max_physical_offset=1000, min_physical_offset=0, replica_chunk=replica_chunk)
    config = SimpleNamespace(broker_role="SYNC_MASTER", ha_transfer_batch_size=32 * 1024,
                             ha_heartbeat_interval_ms=60_000, ha_housekeeping_interval_ms=60_000,
                             ha_slave_fallbehind_max=1 << 28, ha_slave_timeout_ms=300)
    master = HAMaster(store, config)
    server = await asyncio.start_server(master.serve, "127.0.0.1", 0)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("txmq.ha").addHandler(handler)
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
            while not master.links:
                await asyncio.sleep(0.01)
            waiting = master.confirm(500)                           # a send stored up to 500 waits
            writer.write(encode_offset(600))                        # "my log ends at 600"
            await writer.drain()
            assert await reader.read() == b""                       # dropped ...
            writer.close()
            assert await waiting == ResponseCode.FLUSH_SLAVE_TIMEOUT  # ... and it confirmed nothing
        assert master.acked < 500
        assert any(r.levelno >= logging.ERROR and "diverged" in r.getMessage() for r in records)
    finally:
        logging.getLogger("txmq.ha").removeHandler(handler)
        server.close()
        master.close()


async def test_a_master_at_a_corrupt_record_keeps_the_link_with_heartbeats_and_reads_it_no_more():
    """A record failing its CRC stopped the sender and closed the link: the slave reconnected every second
    (RECONNECT_S), a WARNING on each side each time, for ever. The link stays, heartbeats at the record."""
    from types import SimpleNamespace

    from broker.ha.codec import TransferDecoder, encode_offset
    from broker.ha.master import HAMaster
    from protocol.errors import CorruptRecordError

    reads = []

    def replica_chunk(phys, limit):
        reads.append(phys)
        if phys == 100:
            raise CorruptRecordError(100)
        return memoryview(bytearray(100))          # (the records before it)

    store = SimpleNamespace(max_physical_offset=1000, min_physical_offset=0, replica_chunk=replica_chunk)
    master = HAMaster(store, _ha_config("ASYNC_MASTER"))
    server = await asyncio.start_server(master.serve, "127.0.0.1", 0)
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
            writer.write(encode_offset(0))                          # a new slave
            await writer.drain()
            decoder, got = TransferDecoder(), []
            while len(got) < 4:
                data = await reader.read(4096)
                assert data, f"the master closed the link after {got}"
                got += decoder.feed(data)
            assert got[0] == (0, bytes(100)) and got[1:4] == [(100, b"")] * 3, got
            assert reads == [0, 100]                                # not read again at each heartbeat
            writer.close()
    finally:
        server.close()
        master.close()


@bounded(30)
async def test_a_master_streams_across_its_segment_rolls_on_one_connection(tmp_path):
    """After an end marker the master went on at the marker's offset + 8, inside the sealed segment's blank
    tail: 'not a record boundary', the link dropped (a WARNING), and the slave came back a second later. On a
    SYNC_MASTER every send in that second was answered SLAVE_NOT_AVAILABLE -- at each segment roll."""
    from broker.ha.master import HAMaster
    from broker.ha.slave import HASlave

    m_store = MessageStore(str(tmp_path / "m"), CFG)
    s_store = MessageStore(str(tmp_path / "s"), CFG)
    await m_store.open()
    await s_store.open()
    s_store.set_replica_only()
    master = HAMaster(m_store, _ha_config("SYNC_MASTER"))
    m_store.add_dispatch_listener(master.on_dispatch)
    server = await asyncio.start_server(master.serve, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    slave = HASlave(s_store, _ha_config("SLAVE", f"{host}:{port}"), lambda: asyncio.open_connection(host, port))
    task = asyncio.ensure_future(slave.run())
    try:
        while not any(link.request_offset >= 0 for link in master.links):     # connected and reported
            await asyncio.sleep(0.01)
        verdicts = []
        for i in range(70):                                  # ~210 KB: three rolls, each send confirmed
            res = await m_store.put(_req(i))
            verdicts.append(await master.confirm_async(res.physical_offset + res.size))
        assert m_store.max_physical_offset > 3 * SEG
        assert set(verdicts) == {0}, verdicts                # SUCCESS, every one
        assert master.connections_total == 1 and slave.sessions == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()
        master.close()
        await m_store.close()
        await s_store.close()
    assert _files(tmp_path / "m") == _files(tmp_path / "s")


# ------------------------------------------------------------------ a slave checks the master's log is its own
def _ha_config(role: str, addr: str = ""):
    from types import SimpleNamespace
    return SimpleNamespace(broker_role=role, ha_master_addr=addr, ha_transfer_batch_size=8000,
                           ha_heartbeat_interval_ms=50, ha_housekeeping_interval_ms=5000,
                           ha_slave_fallbehind_max=1 << 28, ha_slave_timeout_ms=300)

@contextlib.asynccontextmanager
async def _slave_of(store, master):
    """An HASlave of ``store`` following ``master`` (an asyncio server callback on 127.0.0.1:0), stopped after."""
    from broker.ha.slave import HASlave
    server = await asyncio.start_server(master, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    slave = HASlave(store, _ha_config("SLAVE", f"{host}:{port}"), lambda: asyncio.open_connection(host, port))
    task = asyncio.ensure_future(slave.run())
    try:
        yield slave
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()



async def _follow(master_store: MessageStore, slave_store: MessageStore, until, timeout: float = 10.0):
    """HAMaster over ``master_store`` and HASlave over ``slave_store`` on loopback, until ``until(slave,
    master)`` holds; returns (slave, master) stopped."""
    from broker.ha.master import HAMaster
    from broker.ha.slave import HASlave

    master = HAMaster(master_store, _ha_config("SYNC_MASTER"))
    master_store.add_dispatch_listener(master.on_dispatch)
    server = await asyncio.start_server(master.serve, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    slave = HASlave(slave_store, _ha_config("SLAVE", f"{host}:{port}"), lambda: asyncio.open_connection(host, port))
    task = asyncio.ensure_future(slave.run())
    try:
        async with asyncio.timeout(timeout):
            while not until(slave, master):
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()
        master.close()
    return slave, master


async def _copy_first_segment(master: MessageStore, slave: MessageStore) -> None:
    """``slave`` (empty) given ``master``'s first segment as replication would, up to its end marker: its log ends
    where the master's second segment begins."""
    nxt = 0
    while nxt % SEG or nxt == 0:
        chunk = master.replica_chunk(nxt, 8000)
        fut, nxt = slave.append_replica(nxt, bytes(chunk))
        chunk.release()
    assert (await fut).ok


async def _stores(tmp_path, *names):
    stores = [MessageStore(str(tmp_path / n), CFG) for n in names]
    for s in stores:
        await s.open()
    return stores


@bounded(30)
async def test_a_slave_refuses_a_master_with_other_records_at_the_same_offsets(tmp_path):
    """Two logs of equal-sized records have record boundaries at the same offsets: the master's boundary check
    passed a slave of another log, which then appended the master's records after its own. The slave compares
    its newest record with the master's copy first and appends nothing."""
    a, b, s = await _stores(tmp_path, "a", "b", "s")
    s.set_replica_only()
    try:
        for i in range(10):
            await a.put(_req(i, 500))
        for i in range(25):
            await b.put(_req(i, 500))                       # same sizes, other bytes
        end = await _copy(a, s, 0)
        queues = {key: s.max_offset(*key) for key in s.queues()}
        slave, master = await _follow(b, s, lambda sl, m: sl.diverged is not None)
        assert "other bytes" in slave.diverged
        assert s.max_physical_offset == end and {k: s.max_offset(*k) for k in s.queues()} == queues
        assert master.acked < end                           # it confirmed nothing of b's log past its start
    finally:
        for st in (a, b, s):
            await st.close()


@bounded(30)
async def test_a_slave_refuses_a_master_whose_log_ends_before_its_own(tmp_path):
    """A master that comes back with a shorter log (it lost a tail the slave had received) and nothing new:
    the slave holds a record the master does not; it says so instead of waiting silently for more."""
    a, short, s = await _stores(tmp_path, "a", "short", "s")
    short.set_replica_only()
    s.set_replica_only()
    try:
        for i in range(10):
            await a.put(_req(i, 500))
        end = await _copy(a, s, 0)
        last = s.last_indexed_record()
        nxt = 0
        while nxt < last:                                   # the same log, without its last record
            chunk = a.replica_chunk(nxt, 1)
            fut, nxt = short.append_replica(nxt, bytes(chunk))
            chunk.release()
        assert (await fut).ok and short.max_physical_offset == last
        slave, _master = await _follow(short, s, lambda sl, m: sl.diverged is not None)
        assert "ends at offset" in slave.diverged and s.max_physical_offset == end
    finally:
        for st in (a, short, s):
            await st.close()


@bounded(30)
async def test_a_slave_of_the_same_log_resumes_after_comparing_even_at_a_segment_start(tmp_path):
    """The comparison passes for the master's own log, also when the slave's log ends where a segment begins
    (its newest record is in the sealed segment before, then the end marker), and it goes on to a byte copy."""
    a, s = await _stores(tmp_path, "a", "s")
    s.set_replica_only()
    try:
        for i in range(30):
            await a.put(_req(i))                            # ~90 KB: one roll
        await _copy_first_segment(a, s)
        assert s.max_physical_offset == SEG and s.last_indexed_record() < SEG
        for i in range(30, 40):
            await a.put(_req(i))
        want = a.max_physical_offset
        slave, master = await _follow(a, s, lambda sl, m: m.acked >= want)
        assert slave.diverged is None and s.max_physical_offset == want
    finally:
        await a.close()
        await s.close()
    assert _files(tmp_path / "a") == _files(tmp_path / "s")


@pytest.mark.parametrize("copied", [True, False], ids=["a-segment-copied", "rebased-empty"])
@bounded(30)
async def test_a_slave_ending_at_a_segment_start_its_master_removed_says_it_cannot_catch_up(tmp_path, caplog, copied):
    """A slave whose log ends where a segment begins (its newest record, then the end marker) and whose master's
    retention removed that segment and the next while it was away: the master refuses its first report (the newest
    record) and then its end too. It went round for ever -- two sessions from its newest record, one from its end,
    a WARNING each 'following on offsets alone' -- and txmq_ha_slave_cannot_catch_up stayed 0, so no alert told
    that it copies nothing. Now the refusals of the later start count too: it says it cannot catch up. So does a
    new slave begun at the master's first segment start (rebased, still empty) when that segment is removed: with
    no record to compare, its refusals at its log end were not counted at all."""
    from broker.ha.master import HAMaster
    a, s = await _stores(tmp_path, "a", "s")
    s.set_replica_only()
    try:
        for i in range(30):
            await a.put(_req(i))                            # ~90 KB: one roll
        if copied:
            await _copy_first_segment(a, s)
        else:
            await s.rebase_empty(SEG)
        assert s.max_physical_offset == SEG
        i = 30
        while a.max_physical_offset < 2 * SEG + 10_000:     # the master rolls again while the slave is away...
            await a.put(_req(i))
            i += 1
        for _ in range(2):                                  # ...and its retention removes both sealed segments
            await a.remove_segment(a.segments()[0].name, "test")
        assert a.min_physical_offset == 2 * SEG
        master = HAMaster(a, _ha_config("ASYNC_MASTER"))
        a.add_dispatch_listener(master.on_dispatch)
        caplog.set_level(logging.WARNING, "txmq.ha")
        async with _slave_of(s, master.serve) as slave:
            while slave.cannot_catch_up is None:
                assert slave.sessions <= 10, "still going round, saying nothing"
                await asyncio.sleep(0.05)
            sessions = slave.sessions
            while slave.sessions < sessions + 2:            # it goes on trying, saying no more
                await asyncio.sleep(0.05)
        master.close()
        assert s.max_physical_offset == SEG                 # nothing appended after a gap
        said = [r.getMessage() for r in caplog.records if r.name == "txmq.ha"]
        assert sum("cannot catch up by itself" in m for m in said) == 1, said
        assert sum("following on offsets alone" in m for m in said) <= 1, said
    finally:
        await a.close()
        await s.close()


@bounded(30)
async def test_a_slave_refused_once_at_the_next_segment_start_by_chance_still_catches_up(tmp_path, caplog):
    """A slave whose log ends at a segment start, its newest record's segment removed by the master's retention:
    refused twice at that record, it asks from its log end, which the master still holds. One session there
    closed before a transfer by chance (the master restarting, a network blip) made it say it cannot catch up
    and ask from the removed record for ever after, never from its log end again: it copied nothing, for good."""
    from broker.ha.master import HAMaster
    from broker.ha.slave import REFUSED_MAX
    a, s = await _stores(tmp_path, "a", "s")
    s.set_replica_only()
    try:
        for i in range(30):
            await a.put(_req(i))                            # ~90 KB: one roll
        await _copy_first_segment(a, s)
        assert s.max_physical_offset == SEG
        for i in range(30, 40):
            await a.put(_req(i))
        await a.remove_segment(a.segments()[0].name, "test")     # the newest record's segment goes, not the next
        assert a.min_physical_offset == SEG
        want = a.max_physical_offset
        master = HAMaster(a, _ha_config("ASYNC_MASTER"))
        a.add_dispatch_listener(master.on_dispatch)
        sessions = []

        async def serve(reader, writer):
            sessions.append(1)
            if len(sessions) == REFUSED_MAX + 1:            # its first session from SEG, cut before a transfer
                writer.close()
                return
            await master.serve(reader, writer)

        caplog.set_level(logging.WARNING, "txmq.ha")
        async with _slave_of(s, serve) as slave:
            while master.acked < want:
                assert slave.sessions <= 8, slave.cannot_catch_up
                await asyncio.sleep(0.05)
        master.close()
        assert s.max_physical_offset == want and slave.cannot_catch_up is None
    finally:
        await a.close()
        await s.close()


@bounded(30)
async def test_a_slave_whose_disk_stalls_stops_reading_instead_of_queueing_everything(monkeypatch):
    """The slave hands each transfer to its store's writer and reads on at once (the writer's group commit
    flushes them together). With the writer stalled -- a disk that blocks on writeback -- it read on all the
    same: every byte the master sent was queued in memory, a whole backlog's worth on a catch-up. Past
    PENDING_MAX bytes not yet stored it stops reading the socket, so TCP holds the master back."""
    from types import SimpleNamespace

    import broker.ha.slave as slave_mod
    from broker.ha.codec import encode_transfer

    monkeypatch.setattr(slave_mod, "PENDING_MAX", 4 << 20)
    frame, frames = 1 << 20, 64
    held: list[asyncio.Future] = []

    def append_replica(phys, body):
        fut = asyncio.get_running_loop().create_future()      # stored when the test says so
        held.append(fut)
        store.max_physical_offset = phys + len(body)
        return fut, phys + len(body)
    store = SimpleNamespace(max_physical_offset=0, min_physical_offset=0, is_empty=False,
                            last_indexed_record=lambda: None, append_replica=append_replica,
                            disk=SimpleNamespace(refusing=False))

    async def master(reader, writer):
        body = bytes(frame)
        for i in range(frames):
            writer.write(encode_transfer(i * frame, body) + body)
            await writer.drain()
        await reader.read()
    async with _slave_of(store, master) as slave:
        while not slave.paused and len(held) < frames:
            await asyncio.sleep(0.01)
        assert slave.paused and len(held) * frame <= (4 << 20) + 2 * frame, len(held)
        ok = SimpleNamespace(ok=True)
        while len(held) < frames or not all(f.done() for f in held):   # the disk is back: all of it arrives
            for f in held:
                if not f.done():
                    f.set_result(ok)
            await asyncio.sleep(0.01)
        assert store.max_physical_offset == frames * frame


@bounded(30)
async def test_a_slave_queue_starts_again_where_the_masters_did_after_a_delete(tmp_path):
    """Deleted and made again, a topic's queue starts at 0 on the master; the slave appended the copied units at
    its queue's end, serving the deleted messages at the new ones' offsets. Copied across batches (the slave had
    the old run) and in one (it had not), and after the slave's restart, its queue is the master's."""
    master = MessageStore(str(tmp_path / "m"), CFG)
    await master.open()
    slaves = [MessageStore(str(tmp_path / name), CFG) for name in ("s1", "s2")]
    for s in slaves:
        await s.open()
        s.set_replica_only()

    def bodies(store):
        got = store.get_messages("T", 0, 0, 100, 1 << 20)
        return [bytes(b) for b in got.buffers]

    try:
        for i in range(3):
            await master.put(PutRequest.build("T", f"old{i}".encode(), queue_id=0))
        mid = await _copy(master, slaves[0], 0)
        await master.delete_topic("T")
        for i in range(2):
            await master.put(PutRequest.build("T", f"new{i}".encode(), queue_id=0))
        await _copy(master, slaves[0], mid)
        await _copy(master, slaves[1], 0)
        want = bodies(master)
        assert len(want) == 2
        for s in slaves:
            assert (s.min_offset("T", 0), s.max_offset("T", 0)) == (0, 2)
            assert bodies(s) == want
    finally:
        await master.close()
        for s in slaves:
            await s.close()
    again = MessageStore(str(tmp_path / "s1"), CFG)
    await again.open()
    try:
        assert bodies(again) == want
    finally:
        await again.close()


@bounded(30)
async def test_a_slave_keeps_a_topic_made_again_after_the_log_end_its_delete_was_decided_at(tmp_path):
    """Slave sync asks the master's topic table; the master deleted the topic before answering and made it again
    (a send) after, its new first record copied before the answer was applied: the slave's delete, made from the
    table, marked the queue deleted over that live record, and the next one started the queue past it -- a
    consumer failed over to the slave never saw it. ``written_from`` (the slave's log end when it asked) keeps a
    topic with a record copied since; asked again with a later end, it goes."""
    master = MessageStore(str(tmp_path / "m"), CFG)
    await master.open()
    slave = MessageStore(str(tmp_path / "s"), CFG)
    await slave.open()
    slave.set_replica_only()
    try:
        for i in range(3):
            await master.put(PutRequest.build("T", f"old{i}".encode(), queue_id=0))
        mid = await _copy(master, slave, 0)
        asked_at = slave.max_physical_offset      # the table asked for here: the master deletes T, answers
        await master.delete_topic("T")
        await master.put(PutRequest.build("T", b"new0", queue_id=0))
        await _copy(master, slave, mid)             # ... and the new record is copied before the answer lands
        assert await slave.delete_topic("T", written_from=asked_at) == -1
        got = slave.get_messages("T", 0, 0, 100, 1 << 20)
        assert [bytes(b) for b in got.buffers] == [bytes(b) for b in master.get_messages("T", 0, 0, 100,
                                                                                          1 << 20).buffers]
        assert slave.max_offset("T", 0) == 1
        assert await slave.delete_topic("T", written_from=slave.max_physical_offset) == 1
        assert slave.max_offset("T", 0) == 0
    finally:
        await master.close()
        await slave.close()


def test_what_the_master_said_of_slaves_below_its_log_start_stays_bounded():
    """Anyone reaching the HA port may report a new offset below the log start each connection: each (host,
    offset) was remembered for ever as said."""
    from types import SimpleNamespace

    from broker.ha.master import BEHIND_SAID_MAX, HAMaster, SlaveLink

    store = SimpleNamespace(max_physical_offset=1 << 20, min_physical_offset=1 << 20)
    master = HAMaster(store, _ha_config("ASYNC_MASTER"))
    for offset in range(1, 3 * BEHIND_SAID_MAX):
        link = SlaveLink("10.0.0.9:40000")
        link.request_offset = offset
        master._say_behind(link, master._behind(link, offset))
    assert len(master._behind_said) <= BEHIND_SAID_MAX
    assert master.behind_total == 3 * BEHIND_SAID_MAX - 1


@bounded(10)
async def test_slaves_refused_at_their_first_report_are_said_once_a_host_and_offset(caplog):
    """The first report is checked before it is recorded as the link's start: keyed by that, every slave of a
    host refused there was (host, -1), and a second one (another store on the host, or the same slave rebuilt and
    overtaken again further on) was only a DEBUG line."""
    import logging
    from types import SimpleNamespace

    from broker.ha.master import HAMaster, SlaveBehindError, SlaveLink

    store = SimpleNamespace(max_physical_offset=4 << 20, min_physical_offset=2 << 20)
    master = HAMaster(store, _ha_config("ASYNC_MASTER"))

    async def first_report(port: int, offset: int) -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(encode_offset(offset))
        link = SlaveLink(f"10.0.0.9:{port}")
        with pytest.raises(SlaveBehindError) as err:
            await master._read(link, reader)
        master._say_behind(link, err.value)

    with caplog.at_level(logging.DEBUG, logger="txmq.ha"):
        await first_report(40000, 1 << 20)
        await first_report(40001, 1 << 20)          # the same slave again: not said again
        await first_report(40002, (1 << 20) + 512)  # another offset of that host: said
    said = [r for r in caplog.records if r.levelno == logging.ERROR and "cannot catch up" in r.getMessage()]
    assert [str((1 << 20) + 512) in r.getMessage() for r in said] == [False, True], [r.getMessage() for r in said]
    assert master.behind_total == 3


@bounded(30)
async def test_a_slave_whose_disk_refuses_writes_stays_connected_and_following_holding_the_master_back(caplog):
    """A slave whose disk is at its refuse mark copies nothing; it stopped connecting to its master at all, so it
    no longer followed: its SlaveSync (which copies only while following) took no consumer offsets, topics or
    groups, and learnt no new log start of its master's -- the slave's cleaner removes an expired segment only
    up to there, so with nothing new to copy it could not free the room it waits for (a slave whose master had
    nothing new was connected and following before). Now it connects and follows, and holds the master's bytes
    back (it stops reading) until its disk has room: no session is lost, nothing appended meanwhile, and the
    held transfer is appended once the disk has room."""
    from types import SimpleNamespace

    from broker.ha.codec import encode_transfer

    appended: list[tuple[int, int]] = []

    def append_replica(phys, body):
        appended.append((phys, len(body)))
        store.max_physical_offset = phys + len(body)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(SimpleNamespace(ok=True))
        return fut, phys + len(body)
    disk = SimpleNamespace(refusing=True, ratio=0.95, free_bytes=1 << 20, resume_ratio=0.89)
    disk.still_refusing = lambda: disk.refusing
    disk.fullness = lambda: "95.0% full (1.0 MiB free of 20.0 MiB)"
    store = SimpleNamespace(max_physical_offset=0, min_physical_offset=0, is_empty=False,
                            last_indexed_record=lambda: None, append_replica=append_replica, disk=disk)
    send = asyncio.Event()

    async def master(reader, writer):
        writer.write(encode_transfer(0, b""))           # a heartbeat: nothing new to copy
        await writer.drain()
        await send.wait()
        writer.write(encode_transfer(0, b"x" * 100) + b"x" * 100)
        await writer.drain()
        await reader.read()
    async with _slave_of(store, master) as slave:
        while not slave.following:
            await asyncio.sleep(0.01)
        send.set()
        while not slave.disk_full:
            await asyncio.sleep(0.01)
        assert appended == [] and slave.following and slave.sessions == 1
        disk.refusing = False
        while not appended:
            await asyncio.sleep(0.01)
        assert appended == [(0, 100)] and slave.sessions == 1 and not slave.disk_full
    assert caplog.text.count("paused: this slave's disk is") == 1, caplog.text
    assert caplog.text.count("resumes: this slave's disk has room again") == 1, caplog.text


@bounded(30)
async def test_a_slave_whose_store_stopped_holds_the_master_back_said_once_not_a_reconnect_a_second(caplog,
                                                                                                   monkeypatch):
    """A slave whose store stopped accepting writes (an I/O error; its file system turned read-only) had each
    transfer refused SERVICE_NOT_AVAILABLE with no reason: the session failed, the slave reconnected every
    second (RECONNECT_S) for ever, a WARNING a second on the slave (3,600 an hour) and the master reading and
    sending its log tail again each time. Now it says so at ERROR once and holds the master back on one
    session, appending nothing, until a restart."""
    import logging
    from types import SimpleNamespace

    from broker.ha.codec import encode_transfer

    appended: list[tuple[int, int]] = []

    def append_replica(phys, body):         # what a stopped store answers
        appended.append((phys, len(body)))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(SimpleNamespace(ok=False, remark="", status=SimpleNamespace(name="SERVICE_NOT_AVAILABLE")))
        return fut, phys + len(body)
    disk = SimpleNamespace(refusing=False, still_refusing=lambda: False)
    store = SimpleNamespace(max_physical_offset=0, min_physical_offset=0, is_empty=False, disk=disk,
                            last_indexed_record=lambda: None, append_replica=append_replica,
                            failure="writing to the commit log failed: [Errno 30] Read-only file system")

    async def master(reader, writer):
        writer.write(encode_transfer(0, b"x" * 100) + b"x" * 100)
        await writer.drain()
        await reader.read()
    monkeypatch.setattr("broker.ha.slave.RECONNECT_S", 0.02)     # a reconnect, were there one, within the test
    with caplog.at_level(logging.WARNING, logger="txmq.ha"):
        async with _slave_of(store, master) as slave:
            async with asyncio.timeout(10):     # until it says it, or reconnects
                while "NOT replicating" not in caplog.text and slave.sessions < 2:
                    await asyncio.sleep(0.01)
            for _ in range(25):             # then 0.25 s (12 reconnect pauses): said, and still on its one session
                if slave.sessions >= 2:
                    break
                await asyncio.sleep(0.01)
            assert appended == [] and slave.sessions == 1, (appended, slave.sessions, caplog.text)
    said = [r for r in caplog.records if "NOT replicating" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR, caplog.text
    assert "Read-only file system" in said[0].getMessage() and "restart" in said[0].getMessage()
    assert "reconnecting" not in caplog.text, caplog.text


@bounded(30)
async def test_an_empty_slave_of_an_idle_master_restarting_twice_is_not_said_unable_to_catch_up(tmp_path, caplog):
    """An empty slave, caught up with an idle master (nothing to send: its first transfer is the heartbeat, 5 s on; 3 s here, the
    slave's housekeeping being 5 s),
    whose master restarts twice in a row a second or so into each session: each session closed before a transfer
    counted as a refusal of its log end, and at the second one it said it cannot catch up (ERROR,
    txmq_ha_slave_cannot_catch_up 1, the critical alert without a for:) though the master accepted its report
    every time. A master now sends a heartbeat as soon as it accepts a slave's first report: only a session the
    master closes on that report, before anything at all, is a refusal."""
    from types import SimpleNamespace

    from broker.ha.master import HAMaster
    from broker.ha.slave import REFUSED_MAX
    a, s = await _stores(tmp_path, "a", "s")
    s.set_replica_only()
    try:
        master = HAMaster(a, SimpleNamespace(**{**vars(_ha_config("ASYNC_MASTER")), "ha_heartbeat_interval_ms": 3000}))
        a.add_dispatch_listener(master.on_dispatch)
        slave = None
        restarts = []

        async def serve(reader, writer):
            if len(restarts) == REFUSED_MAX:
                return await master.serve(reader, writer)
            task = asyncio.ensure_future(master.serve(reader, writer))
            loop = asyncio.get_running_loop()
            until = None
            while until is None or loop.time() < until:     # the master "restarts" 0.5 s after it accepted
                if until is None and any(link.request_offset >= 0 for link in master.links):
                    until = loop.time() + 0.5
                await asyncio.sleep(0.01)
            restarts.append(slave._received)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            writer.transport.abort()

        caplog.set_level(logging.WARNING, "txmq.ha")
        async with _slave_of(s, serve) as slave:
            while slave.sessions <= REFUSED_MAX or not slave.connected:
                await asyncio.sleep(0.01)
            while master.acked < 0 or not slave._received:
                await asyncio.sleep(0.01)
            assert slave.cannot_catch_up is None, slave.cannot_catch_up
        master.close()
        said = [r.getMessage() for r in caplog.records if r.name == "txmq.ha"]
        assert not any("cannot catch up" in m for m in said), said
    finally:
        await a.close()
        await s.close()
