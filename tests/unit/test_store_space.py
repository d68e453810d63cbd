"""A full disk is a refusal, never a crash or a stop for good.

Space is taken away by making the reserver's zero-writes fail with ENOSPC past a byte limit
(or segment creation fail), exactly where a real full disk makes them fail. Each test checks
that the refused write left no byte behind, that the store stayed writable, and that writes
resume, in place, once "space" is back. The watermark half (DiskMonitor) runs on a fake statvfs.
"""
from __future__ import annotations

import asyncio
import errno
import os
import threading

import pytest

from broker.store import MessageStore, PutRequest, PutStatus, StoreConfig
from broker.store import disk as disk_mod
from broker.store import reserve
from broker.store.commit_log import Segment
from broker.store.disk import HYSTERESIS, MOUNTS_CHECK_S, PROBE_INTERVAL_S, DiskMonitor, _mounted_read_only
from tests.support.bounded import bounded

SEG = 1 << 20
SIZES = [300, 500, 700, 900]            # record bodies of the batch under test


def req(size: int, topic: str = "T") -> PutRequest:
    return PutRequest.build(topic, b"x" * size)


class Budget:
    """Zero-writes past ``limit`` (a byte offset in every segment) fail with ENOSPC, like a full disk."""

    def __init__(self, monkeypatch, limit: int | None = None):
        self.limit = limit
        real = reserve.write_zeros

        def limited(fd, lo, hi, path):
            if self.limit is not None and hi > self.limit:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, lo, hi, path)
        monkeypatch.setattr(reserve, "write_zeros", limited)


def remark_is_disk_full(result) -> bool:
    return result.status is PutStatus.SERVICE_NOT_AVAILABLE and "disk is full" in result.remark


# ---------------------------------------------------------------------- batches: all or none
def _split_points() -> list[int]:
    """Reservation limits, relative to the batch's first byte: before, inside and at the end of every record,
    inside the end marker's 8 bytes, and the first limit that fits."""
    records = [len(req(n).record) for n in SIZES]
    points, at = [8, 9], 0       # below 8 the first record's own end-marker room does not fit
    for n in records:
        points += [at + n // 2, at + n - 1, at + n, at + n + 1]
        at += n
    points += [at + 4, at + 7, at + 8]
    return sorted(set(points))


@pytest.mark.parametrize("split", _split_points())
@bounded()
async def test_a_batch_is_reserved_whole_at_every_split_point(tmp_path, monkeypatch, split):
    base = len(req(1000).record)
    budget = Budget(monkeypatch, limit=base + split)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    first = await store.put(req(1000))
    assert first.ok and first.physical_offset + first.size == base
    total = sum(len(req(n).record) for n in SIZES)
    results = await store.put_many([req(n) for n in SIZES])
    fits = split >= total + 8                   # the batch and the end marker after it
    if fits:
        assert all(r.ok for r in results)
        assert [r.physical_offset for r in results][0] == base
    else:
        assert all(remark_is_disk_full(r) for r in results), results
        assert store.max_physical_offset == base and store.max_offset("T", 0) == 1
        assert store.writable
        budget.limit = None                     # space is back: the same batch goes in whole, in place
        again = await store.put_many([req(n) for n in SIZES])
        assert all(r.ok for r in again) and again[0].physical_offset == base
    await store.close()
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()                          # the log holds the first record and one whole batch
    assert store.max_offset("T", 0) == 1 + len(SIZES)
    assert store.max_physical_offset == base + total
    await store.close()


@bounded()
async def test_a_batch_that_needs_the_next_segment_is_refused_whole_when_it_cannot_be_made(tmp_path, monkeypatch):
    failing = {"on": False}
    real_create = Segment.create.__func__

    def create(cls, *args, **kwargs):
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_create(cls, *args, **kwargs)
    monkeypatch.setattr(Segment, "create", classmethod(create))
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=64 * 1024))
    await store.open()
    failing["on"] = True
    results, stored = [], 0
    while not results or results[-1].ok:        # fill the first segment until a batch must roll
        stored += len(results)
        results = await store.put_many([req(2000), req(2000)])
        assert len(store.segments()) == 1
    assert all(remark_is_disk_full(r) for r in results)
    assert store.writable and store.max_offset("T", 0) == stored
    assert store.max_physical_offset + 2 * len(req(2000).record) + 8 > 64 * 1024   # it really had to roll
    failing["on"] = False
    again = await store.put_many([req(2000), req(2000)])
    assert all(r.ok for r in again) and again[0].physical_offset == 64 * 1024
    assert len(store.segments()) == 2
    await store.close()


# ------------------------------------------------------------------------ single writes
@bounded()
async def test_a_full_disk_while_reserving_refuses_that_write_and_resumes(tmp_path, monkeypatch):
    budget = Budget(monkeypatch, limit=200_000)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=64 << 20))
    await store.open()
    results = [await store.put(req(50_000)) for _ in range(6)]
    ok = [r for r in results if r.ok]
    assert len(ok) == 3 and all(remark_is_disk_full(r) for r in results[3:])
    assert ok[-1].physical_offset + ok[-1].size + 8 <= 200_000      # never wrote past the reserved space
    small = await store.put(req(100))                               # a smaller write still fits
    assert small.ok and store.writable and store.failure is None
    budget.limit = None
    assert all(r.ok for r in [await store.put(req(50_000)) for _ in range(3)])
    await store.close()


@bounded()
async def test_a_full_disk_at_roll_over_refuses_and_the_next_segment_comes_later(tmp_path, monkeypatch):
    failing = {"on": False}
    real_create = Segment.create.__func__

    def create(cls, *args, **kwargs):
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_create(cls, *args, **kwargs)
    monkeypatch.setattr(Segment, "create", classmethod(create))
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()                          # a fresh store's first segment is made at start-up
    failing["on"] = True
    results = [await store.put(req(5000)) for _ in range(250)]
    statuses = [r.status for r in results]
    first_bad = statuses.index(PutStatus.SERVICE_NOT_AVAILABLE)
    assert set(statuses[:first_bad]) == {PutStatus.PUT_OK}
    assert all(remark_is_disk_full(r) for r in results[first_bad:])
    assert store.writable and store.failure is None
    for r in results[:first_bad]:
        assert store.get_record(r.physical_offset) is not None
    failing["on"] = False
    later = await store.put(req(5000))
    assert later.ok and later.physical_offset == SEG
    await store.close()
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    assert store.max_offset("T", 0) == first_bad + 1 and (await store.put(req(5000))).ok
    await store.close()


@bounded()
async def test_a_consume_queue_without_space_catches_up_and_holds_the_checkpoint(tmp_path, monkeypatch):
    from broker.store import mapped_file
    full = {"on": False}
    real = os.posix_fallocate

    def fallocate(fd, off, n):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, off, n)
    monkeypatch.setattr(mapped_file.os, "posix_fallocate", fallocate)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG, cq_units_per_file=100_000))
    await store.open()
    assert (await store.put(req(10, "A"))).ok
    full["on"] = True                           # a new queue cannot get its first file
    got = await store.put(req(10, "B"))
    assert got.ok and store.writable            # durable in the log; its unit waits in memory
    assert store.max_offset("B", 0) == 0
    full["on"] = False
    assert (await store.put(req(10, "B"))).ok   # the next write brings the waiting unit along
    assert store.max_offset("B", 0) == 2
    assert store.get_messages("B", 0, 0, 10, 1 << 20).buffers
    await store.close()


# ------------------------------------------------------------------------- the watermark
class FakeFs:
    def __init__(self, ratio: float):
        self.ratio = ratio

    def __call__(self, path):
        total = 1_000_000
        used = int(total * self.ratio)
        return os.statvfs_result((4096, 4096, total, total - used, total - used, 0, 0, 0, 0, 255))


def test_the_watermark_refuses_at_the_ratio_and_resumes_below_it_less_the_hysteresis():
    fs = FakeFs(0.5)
    changes = []
    disk = DiskMonitor("/store", 0.90, statvfs=fs)
    disk.on_change.append(changes.append)
    assert disk.probe() is False and disk.ratio == pytest.approx(0.5)
    fs.ratio = 0.90
    assert disk.probe() is True
    fs.ratio = 0.90 - HYSTERESIS / 2            # under the ratio but inside the hysteresis: still refusing
    assert disk.probe() is True
    fs.ratio = 0.90 - HYSTERESIS - 0.001
    assert disk.probe() is False
    assert changes == [True, False]             # one notice per change
    fs.ratio = 0.95
    disk.probe()
    assert "disk is full" in disk.remark() and "95.0% used" in disk.remark() and "at 90%" in disk.remark()


def test_a_read_only_mount_is_seen_by_its_flag_or_by_the_mount_table_and_said_once(tmp_path, caplog):
    """Linux 6.x ext4 with errors=remount-ro, after an I/O error, fails every write EROFS while statvfs still says
    read-write: only /proc/self/mountinfo's "emergency_ro" tells. Before, nothing watched for it: an idle broker
    said nothing, and a busy one's refusals were said as a bare SERVICE_NOT_AVAILABLE."""
    flag, table = [0], [False]
    clock = [0.0]

    def statvfs(path):
        return os.statvfs_result((4096, 4096, 1_000_000, 900_000, 900_000, 0, 0, 0, flag[0], 255))
    disk = DiskMonitor("/store", 0.90, statvfs=statvfs, clock=lambda: clock[0],
                       mounted_read_only=lambda path, dev: table[0])

    def tick():                         # a turn of the store's disk loop (the table read on a worker thread there)
        if disk.mounts_due():
            disk.read_mounts()
        return disk.probe()
    assert tick() is False and disk.read_only is False
    table[0] = True                     # the mount table is read at most every MOUNTS_CHECK_S
    tick()
    assert disk.read_only is False
    clock[0] += MOUNTS_CHECK_S
    for _ in range(3):
        tick()
        clock[0] += PROBE_INTERVAL_S
    assert disk.read_only is True and disk.refusing is False    # not a full disk
    table[0] = False
    clock[0] += MOUNTS_CHECK_S
    tick()
    assert disk.read_only is False
    flag[0] = os.ST_RDONLY              # mount -o remount,ro: the flag says it at once
    tick()
    assert disk.read_only is True
    said = [r for r in caplog.records if "is read-only now" in r.getMessage()]
    assert len(said) == 2 and all(r.levelname == "ERROR" for r in said)


def test_a_probe_never_reads_the_mount_table_and_an_unreadable_one_is_said_once(caplog):
    """probe() runs on the event loop (every 0.5 s, and on a send's path while the disk refuses): it read
    /proc/self/mountinfo every 5 s there, ~1 us of CPU a mount (measured: 11 ms for 10k mounts, a Kubernetes
    node's order), an event-loop stall. It reads statvfs only; the table is read_mounts()', off the loop. An
    unreadable table (no /proc in a container) was taken for "writable" without a word."""
    clock, reads = [0.0], []

    def table(path, dev=None):
        reads.append(path)
        raise PermissionError(errno.EACCES, "Permission denied")
    disk = DiskMonitor("/store", 0.90, statvfs=lambda p: os.statvfs_result((4096, 4096, 100, 5, 5, 0, 0, 0, 0, 255)),
                       clock=lambda: clock[0], mounted_read_only=table)
    for _ in range(20):
        disk.probe()
        disk.still_refusing()           # 95% used: refusing, a send's re-probe
        clock[0] += MOUNTS_CHECK_S
    assert reads == [] and disk.refusing
    for _ in range(3):
        disk.read_mounts()
    assert len(reads) == 3 and disk.read_only is False
    said = [r for r in caplog.records if "cannot read /proc/self/mountinfo" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", said


@bounded(20)
async def test_the_store_reads_the_mount_table_on_a_worker_thread(tmp_path, monkeypatch):
    """The store's disk loop reads the mount table off the event loop (it was read in probe(), on the loop)."""
    monkeypatch.setattr(disk_mod, "MOUNTS_CHECK_S", 0.0)      # due at every turn of the disk loop
    loop, threads, read = asyncio.get_running_loop(), [], asyncio.Event()

    def table(path, dev=None):
        threads.append(threading.get_ident())
        loop.call_soon_threadsafe(read.set)
        return False
    monkeypatch.setattr(disk_mod, "_mounted_read_only", table)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    await store.open()
    try:
        opened = len(threads)           # open reads it once itself, before the disk loop runs
        for _ in range(10):             # (a wake-up may be the open's own read, set late)
            if len(threads) > opened:
                break
            read.clear()
            await read.wait()
        assert len(threads) > opened and threads[-1] != threading.get_ident(), "the mount table was read on the event loop's thread"
    finally:
        await store.close()


MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
40 22 7:0 / /data/store\\040one rw,relatime shared:9 - ext4 /dev/loop0 rw,errors=remount-ro,emergency_ro
41 22 7:1 / /data/other ro,relatime - ext4 /dev/loop1 rw
42 22 0:50 / /data/other rw,relatime - tmpfs tmpfs rw,size=1024k
"""


@pytest.mark.parametrize("path, read_only", [("/data/store one/config", True), ("/data/store", False),
                                             ("/data/other/x", False), ("/srv", False)])
def test_the_mount_table_names_the_store_s_mount_read_only(monkeypatch, tmp_path, path, read_only):
    """The longest mount point holding the path, the last mounted on top; "ro" or "emergency_ro" in its mount or
    super-block options; a space in a mount point is \\040 there."""
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO)
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(table if p == "/proc/self/mountinfo" else p,
                                                                       *a, **k))
    monkeypatch.setattr(os.path, "realpath", lambda p: p)
    assert _mounted_read_only(path) is read_only


def test_the_mount_table_names_the_store_s_own_mount_under_one_mounted_over_it(monkeypatch, tmp_path):
    """A file system mounted over the store's mount point after the start (a tmpfs at /data/store by a careless
    script) is last in the table, on top: it was taken for the store's, rw, while the store's own ext4, which the
    broker's open files still write to, had turned emergency_ro: TxmqStoreReadOnly never fired. Its device
    (st_dev, read once at the first reading) picks the store's; with none of the table's its own, the path."""
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO + "50 40 0:51 / /data/store\\040one rw,relatime - tmpfs tmpfs rw\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(table if p == "/proc/self/mountinfo" else p,
                                                                       *a, **k))
    monkeypatch.setattr(os.path, "realpath", lambda p: p)
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (os.stat_result((0o40755, 2, os.makedev(7, 0)) + (0,) * 7)
                                                         if p == "/data/store one" else real_stat(p, *a, **k)))
    # the monitor as the broker runs it (its own table reader): the store's ext4 under the tmpfs is emergency_ro
    monitor = DiskMonitor("/data/store one", statvfs=lambda p: os.statvfs_result((4096, 4096, 100, 50, 50, 0, 0, 0,
                                                                                   0, 255)))
    monitor.read_mounts()
    monitor.probe()
    assert monitor.read_only is True
    assert _mounted_read_only("/data/store one/config", os.makedev(7, 0)) is True
    assert _mounted_read_only("/data/store one/config", os.makedev(0, 51)) is False
    assert _mounted_read_only("/data/store one/config", os.makedev(9, 9)) is False     # none its own: the top one
    assert _mounted_read_only("/data/store one/config") is False
    asked = []
    disk = DiskMonitor(str(tmp_path), mounted_read_only=lambda path, dev: asked.append(dev) or False)
    disk.read_mounts()
    disk.read_mounts()
    assert asked == [os.stat(tmp_path).st_dev] * 2


def test_out_of_inodes_the_watermark_refuses_with_the_blocks_mostly_free():
    """Inodes (df -i) at the ratio refuse as blocks do, and say so; the blocks' ratio, what retention cleans by,
    stays the blocks'. Before, a file system out of inodes at 36% of its blocks refused nothing ahead: every new
    file (a segment, a queue's file, each save's .tmp) failed ENOSPC, the refusals said a full disk with 40 MiB
    free, and txmq_store_writes_refused stayed 0. A file system with no fixed number of inodes (f_files 0) is
    judged by its blocks alone."""
    inodes = [0.5]

    def statvfs(path):
        total, used = 1_000_000, 360_000
        files = 10_000
        ffree = files - int(files * inodes[0])
        return os.statvfs_result((4096, 4096, total, total - used, total - used, files, ffree, ffree, 0, 255))
    disk = DiskMonitor("/store", 0.90, statvfs=statvfs)
    assert disk.probe() is False and disk.inode_ratio == pytest.approx(0.5) and disk.ratio == pytest.approx(0.36)
    inodes[0] = 0.95
    assert disk.probe() is True and disk.ratio == pytest.approx(0.36)
    assert "inodes 95.0% used (df -i)" in disk.remark() and "36.0% used" in disk.remark()
    inodes[0] = 0.90 - HYSTERESIS / 2
    assert disk.probe() is True
    inodes[0] = 0.2
    assert disk.probe() is False
    assert "inodes" not in disk.remark()            # named only when they are the fuller


def test_while_refusing_a_write_re_measures_a_stale_probe_only():
    fs, now = FakeFs(0.95), [100.0]
    calls = []

    def statvfs(path):
        calls.append(now[0])
        return fs(path)
    disk = DiskMonitor("/store", 0.90, statvfs=statvfs, clock=lambda: now[0])
    assert disk.probe() and len(calls) == 1
    assert disk.still_refusing() and len(calls) == 1        # fresh: no second statvfs
    fs.ratio = 0.5
    now[0] += 0.049
    assert disk.still_refusing() and len(calls) == 1
    now[0] += 0.001                                         # RECHECK_S old: measured again, and resumed
    assert not disk.still_refusing() and len(calls) == 2


@bounded()
async def test_over_the_watermark_puts_are_refused_before_the_log_and_reads_go_on(tmp_path):
    fs = FakeFs(0.5)
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=SEG))
    store.disk._statvfs = fs
    await store.open()
    stored = await store.put(req(100))
    fs.ratio = 0.97
    store.disk.probe()
    refused = await store.put(req(100))
    batch = await store.put_many([req(100), req(100)])
    assert remark_is_disk_full(refused) and all(remark_is_disk_full(r) for r in batch)
    assert "97.0% used" in refused.remark and store.disk.refusals == 2
    assert store.max_physical_offset == stored.physical_offset + stored.size
    assert store.get_messages("T", 0, 0, 10, 1 << 20).buffers          # reads are not refused
    fs.ratio = 0.5
    store.disk.probe()
    assert (await store.put(req(100))).ok
    await store.close()


@bounded()
async def test_without_preallocation_a_segment_that_cannot_be_made_is_a_refusal(tmp_path, monkeypatch):
    failing = {"on": False}
    real_create = Segment.create.__func__

    def create(cls, *args, **kwargs):
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_create(cls, *args, **kwargs)
    monkeypatch.setattr(Segment, "create", classmethod(create))
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=64 * 1024, preallocate=False))
    await store.open()
    failing["on"] = True
    results = [await store.put(req(5000)) for _ in range(20)]
    assert results[0].ok and remark_is_disk_full(results[-1]) and store.writable
    failing["on"] = False
    assert (await store.put(req(5000))).physical_offset == 64 * 1024
    await store.close()


@pytest.mark.parametrize("files, ffree", [(0, 0), (5_000, 2**64 - 1), (2**64 - 1, 2**64 - 1), (100, 150)])
def test_a_file_system_with_no_fixed_number_of_inodes_reads_zero_and_refuses_nothing_for_them(files, ffree):
    """Not every file system counts inodes: btrfs and vfat say 0 of 0, CephFS its objects beside a free count of -1
    (2**64 - 1), a Windows or FUSE one -1 of -1, an NFS server whatever it likes. Before, CephFS read
    txmq_store_disk_inode_usage_ratio -3.7e15 (used = files - 2**64 + 1, over files): a gauge and a dashboard of
    nonsense. Such a count is no number of inodes: 0, and the blocks alone decide."""
    def statvfs(path):
        return os.statvfs_result((4096, 4096, 1_000_000, 640_000, 640_000, files, ffree, ffree, 0, 255))
    disk = DiskMonitor("/store", 0.90, statvfs=statvfs)
    assert disk.probe() is False and disk.inode_ratio == 0.0 and disk.ratio == pytest.approx(0.36)
    assert "inodes" not in disk.remark() and "inodes" not in disk.fullness()


def test_a_probe_while_the_mount_table_is_read_does_not_count_the_reading_not_yet_in():
    """read_mounts runs on a worker thread while the loop may probe (a send's re-probe while refusing): that probe
    must not count a table reading (Retention's EROFS pause ends on the count) with the old word in read_only."""
    table = [False]
    disk = DiskMonitor("/store", 0.90, statvfs=lambda p: os.statvfs_result((4096, 4096, 100, 50, 50, 0, 0, 0, 0, 255)),
                       mounted_read_only=lambda path, dev: (disk.probe(), table[0])[1])   # a probe mid-reading
    disk.read_mounts()
    disk.probe()
    assert disk.table_readings == 1 and disk.read_only is False
    table[0] = True
    disk.read_mounts()
    assert disk.table_readings == 1             # the probe mid-reading took nothing from it
    disk.probe()
    assert disk.table_readings == 2 and disk.read_only is True
