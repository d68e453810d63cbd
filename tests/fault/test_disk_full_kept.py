"""A full disk at the store's corrupt_kept file (keep_corrupt_records): the record is kept all the same, the
file written once there is room, and a restart without the flag keeps it again.

The store runs on its own small tmpfs, filled to the last page by a ballast file. Mounting needs root;
elsewhere the test is skipped and says why.
"""
from __future__ import annotations

import os

import pytest

from broker.store.manifest import CORRUPT_KEPT_FILE
from tests.fault.test_disk_full_marks import _fill, _logged
from tests.integration.test_torn_mid_log import FLAGS, PLAIN, _delivered, _flip, _kept_now, _load, _newest, _records
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.tmpfs import tmpfs

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


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
        # As a broker that ran on the full disk left it: no next segment reserved ahead, whose removal at the
        # start (it holds nothing) would give the start room.
        for name in os.listdir(store / "commitlog"):
            if not _records(store / "commitlog" / name):
                os.unlink(store / "commitlog" / name)
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
