"""A full disk at the store's corrupt_kept file (keep_corrupt_records): the record is kept all the same, the
file written once there is room, and a restart without the flag keeps it again.

The store runs on its own small tmpfs, filled to the last page by a ballast file. Mounting needs root;
elsewhere the test is skipped and says why.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from broker.store import MessageStore
from broker.store.manifest import CORRUPT_KEPT_FILE
from tests.fault.test_disk_full_marks import CFG, _fill, _logged, _req
from tests.integration.test_torn_mid_log import FLAGS, PLAIN, _delivered, _flip, _kept_now, _load, _newest, _records
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
            os.unlink(store / "ballast")
            await _logged(b, f"{CORRUPT_KEPT_FILE} written again")
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
        store = MessageStore(str(store_dir), CFG)
        await store.open()
        assert all(r.ok for r in [await store.put(_req(i)) for i in range(20)])
        await store.close()
        _no_segment_reserved(store_dir)
        kept_file = store_dir / CORRUPT_KEPT_FILE
        # one kept record in the log (its first), one past its end (as one a start cut the log below leaves): the
        # file rewritten holds a line, which takes a page (an empty one would not)
        kept_file.write_text(f"0\n{1 << 40}\n")
        _fill(disk / "ballast")
        store = MessageStore(str(store_dir), CFG)
        await store.open()
        try:
            assert store.kept_corrupt == 1
            os.unlink(disk / "ballast")
            while kept_file.read_text().split() != ["0"]:   # the disk loop's next turn (half a second)
                await asyncio.sleep(0.05)
        finally:
            await store.close()
