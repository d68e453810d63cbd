"""A damaged record a broker started with --keep-corrupt-records kept in place (store file corrupt_kept): the jobs
step over exactly it, as the broker does, and read the rest of its segment. Before, the scan read it as damage: the
job stopped at it (exit 2), or with --skip-damaged left out every record after it in its segment."""
from __future__ import annotations

import os

import pytest

from tests.spark.storegen import StoreBuilder
from tests.spark.test_expiry import set_offsets

pytestmark = pytest.mark.spark

H = 3_600_000
NOW = 1710028800000 + 100 * H
SEG = 16 * 1024
N = 40
LATER = 1      # a young message too long for the rest of their segment: theirs is sealed, and goes


def _kept_store(d: str):
    """N Orders messages and one undecided half after them, then LATER young ones in the next segment; record
    N // 2's body damaged, kept by the real broker."""
    from tests.support.broker_process import NO_CHECKS, BrokerProcess

    with StoreBuilder(d, segment_size=SEG) as b:
        b.at(NOW - 90 * H)
        sent = [b.send("Orders", f"order-{i:04d}".encode() * 8) for i in range(N)]
        half = b.half("pg-a", "Pay")
        later = [b.at(NOW - H).send("Later", b"y" * (SEG // 2)) for _ in range(LATER)]
    assert later[0].offset == SEG
    victim = sent[N // 2]
    path = os.path.join(d, "commitlog", f"{0:020d}")
    with open(path, "r+b") as f:
        data = f.read(victim.offset + victim.size)
        at = data.index(f"order-{N // 2:04d}".encode(), victim.offset)
        f.seek(at)
        f.write(b"O")                           # its body CRC fails; its head and every record after it sound
    with BrokerProcess(d, "--segment-size", str(SEG), "--max-message-size", str(SEG // 2 + 1024), *NO_CHECKS, "--keep-corrupt-records"):
        pass
    with open(os.path.join(d, "corrupt_kept")) as f:
        assert f.read().split() == [str(victim.offset)]
    return victim, half


@pytest.mark.parametrize("check_crc", [False, True])
def test_the_jobs_step_over_a_kept_record_and_read_the_rest_of_its_segment(spark, tmp_path, check_crc):
    from ops.spark.expiry import build_plan
    from ops.spark.load import scan_store

    d = str(tmp_path / "store")
    victim, half = _kept_store(d)
    # --skip-damaged: before, the rest of the segment (N // 2 - 1 messages and the half) was left out unsaid
    scan = scan_store(spark, d, job="test", check_crc=check_crc, skip_damaged=True)
    try:
        orders = scan.traffic.where("topic = 'Orders'").groupBy().sum("n").first()[0]
        assert (scan.record_count, orders) == (N - 1 + 1 + LATER, N - 1)   # all but the kept one, the half, later
        assert scan.damage == []
        assert [(k["offset"], k["skipped_bytes"]) for k in scan.kept] == [(victim.offset, victim.size)]
    finally:
        scan.release()
    set_offsets(d, [("behind", "Orders", 0, 10), ("past", "Orders", 0, N // 2 + 5)])
    plan = build_plan(spark, d, retention_ms=72 * H, now_ms=NOW, check_crc=check_crc)   # without: no stop at it
    assert [h["commit_log_offset"] for h in plan["halves"]] == [half.offset]   # the half after it is read
    assert [k["offset"] for k in plan["report"]["kept_corrupt"]] == [victim.offset]
    # The kept record is no message that goes: a group behind it has N - 10 - 1 unconsumed, not N - 10 (the report
    # took the queue's offsets in the segment as one unbroken run, the kept one's among them)
    assert plan["report"]["messages_by_topic"] == [{"topic": "Orders", "messages": N - 1}]
    assert plan["report"]["unconsumed"] == [{"topic": "Orders", "group": "behind", "messages": N - 10 - 1},
                                            {"topic": "Orders", "group": "past", "messages": N - (N // 2 + 5)}]


def _damaged_half_decided_later(d: str):
    """A half in the first segment, its body CRC failing (head and every record after it sound), and its ROLLBACK
    in the next segment (the day's): an incremental rollup reads the half alone (read_halves)."""
    with StoreBuilder(d, segment_size=SEG) as b:
        b.at(NOW - 90 * H)
        half = b.half("pg-a", "Pay", b"half-body " * 8)
        for i in range(N):
            b.send("Orders", f"order-{i:04d}".encode() * 8)
        later = b.at(NOW - H).send("Later", b"y" * (SEG // 2))
        b.put_many([b.op_spec(half, "ROLLBACK")])       # its decision, in the day's segment
    assert later.offset == SEG
    path = os.path.join(d, "commitlog", f"{0:020d}")
    with open(path, "r+b") as f:
        data = f.read(half.offset + half.size)
        f.seek(data.index(b"half-body", half.offset))
        f.write(b"H")
    return half


def test_a_kept_half_read_outside_the_scanned_segments_is_left_out_as_the_scan_leaves_it(spark, tmp_path):
    """An incremental rollup reads one by one the halves decided in its day's segments that lie in older ones
    (read_halves). It read them without their CRC and without the store's corrupt_kept: a half the broker kept in
    place, damaged, came back as a sound record (1 of 1 in the test), its decision counted, where the whole scan
    steps over it and leaves it out; one whose properties did not decode stopped the job. It is left out now, and
    listed with the scan's kept records, said at WARNING."""
    from tests.support.broker_process import NO_CHECKS, BrokerProcess

    from ops.spark.load import read_halves, scan_store

    d = str(tmp_path / "store")
    half = _damaged_half_decided_later(d)
    with BrokerProcess(d, "--segment-size", str(SEG), "--max-message-size", str(SEG // 2 + 1024), *NO_CHECKS,
                       "--keep-corrupt-records"):
        pass
    with open(os.path.join(d, "corrupt_kept")) as f:
        assert f.read().split() == [str(half.offset)]
    whole = scan_store(spark, d, job="test")
    try:
        assert whole.records.where(f"offset = {half.offset}").count() == 0     # the whole scan steps over it
        assert [k["offset"] for k in whole.kept] == [half.offset]
    finally:
        whole.release()
    scan = scan_store(spark, d, job="test", select=lambda segs: segs[1:])    # the day's segment only
    try:
        got = read_halves(spark, scan, [half.offset])
        assert (got.count() if got is not None else 0) == 0, "the kept half read as sound"
        assert [(k["offset"], k["skipped_bytes"]) for k in scan.kept] == [(half.offset, half.size)]
        assert scan.damage == []
    finally:
        scan.release()


def test_a_half_read_outside_the_scanned_segments_is_crc_checked_when_the_scan_is(spark, tmp_path):
    """read_halves read every half without its CRC whatever the job's --check-crc: a half whose body CRC fails
    (not kept by the broker) was the whole scan's damage (the job stopped, or --skip-damaged left it out) but
    came back sound to an incremental rollup, and its decision was counted (1 of 1). It is read as its scan was:
    damage, left out with skip_damaged and listed in scan.damage."""
    from ops.spark.load import read_halves, scan_store
    from protocol.errors import StoreError

    d = str(tmp_path / "store")
    half = _damaged_half_decided_later(d)
    with pytest.raises(StoreError):
        scan_store(spark, d, job="test", check_crc=True).release()     # the whole scan: damage
    scan = scan_store(spark, d, job="test", check_crc=True, select=lambda segs: segs[1:])
    try:
        with pytest.raises(StoreError):
            read_halves(spark, scan, [half.offset])
        got = read_halves(spark, scan, [half.offset], skip_damaged=True)
        assert (got.count() if got is not None else 0) == 0, "the damaged half read as sound"
        assert [d["offset"] for d in scan.damage] == [half.offset]
    finally:
        scan.release()
