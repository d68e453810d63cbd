"""A broker started on a store whose small metadata files were damaged between two runs: what they held is
recovered (from the log, with a WARNING naming the file), never reset without a word."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from producer import LocalTransactionState as S
from producer import Producer
from producer import TransactionProducer
from protocol.codes import RequestCode
from protocol.message import decode_offset_msg_id
from tests.integration.test_transactions import Listener, _admin

pytestmark = pytest.mark.asyncio

QUIET = ("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")


@pytest.mark.parametrize("damage", ["zero-length", "torn", "garbage", "deleted"])
async def test_a_damaged_decision_file_is_rebuilt_from_the_op_queue(broker_factory, damage):
    """A decision file of the wrong size was resized silently (holes read as undecided), one of stray bytes was
    read as it was, and a deleted one was not missed: the decisions in it were gone while the snapshot vouched
    for them, so a repeated END or an admin action on those transactions was answered "not found" and the
    opposite decision was not refused."""
    b = broker_factory(*QUIET)
    async with TransactionProducer(b.namesrv, "PG_tables", Listener(execute=S.COMMIT_MESSAGE)) as producer:
        for i in range(3):                  # the last one's byte is past what the damage leaves
            committed = await producer.send_in_transaction("TxTables", b"committed %d" % i)
    assert committed.acknowledged
    _, _, half = decode_offset_msg_id(committed.send_result.offset_msg_id)
    assert b.stop() == 0
    path = b.store_dir / "transactions" / "decisions" / f"{0:020d}"
    assert path.read_bytes()[:3] == b"\x01\x01\x01"                           # COMMIT, on disk
    if damage == "zero-length":
        path.write_bytes(b"")
    elif damage == "torn":
        path.write_bytes(path.read_bytes()[:1])
    elif damage == "garbage":
        path.write_bytes(b"\x01" + b"\xff" * (path.stat().st_size - 1))
    else:
        path.unlink()
    b.start()
    async with TransactionProducer(b.namesrv, "PG_tables", Listener()) as producer:
        async with asyncio.timeout(20):
            with pytest.raises(Exception, match="already COMMIT.*first decision wins"):
                await producer._end(b.broker, half, committed.send_result.queue_offset,
                                    committed.send_result.msg_id, S.ROLLBACK_MESSAGE, False, None)
    log = b.log()
    assert "decision table is rebuilt from the op queue" in log and str(path) in log
    assert path.stat().st_size == 1 << 20


async def _stopped_with_one_undecided(b, group):
    """(snapshot.json's path, its JSON) once ``b`` stopped holding one undecided transaction of ``group``."""
    async with TransactionProducer(b.namesrv, group, Listener(execute=S.UNKNOW)) as producer:
        await producer.send_in_transaction("Tx" + group, b"undecided")
    assert b.stop() == 0
    path = b.store_dir / "transactions" / "snapshot.json"
    snap = json.loads(path.read_text())
    assert len(snap["pending"]) == 1
    return path, snap


async def _pending_groups(b) -> list[str]:
    listed = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())
    return [row["group"] for row in listed["pending"]]


@pytest.mark.parametrize("pending", ["x", [[1, 2]], [["0", 0, 0]], None])
async def test_a_snapshot_with_a_malformed_pending_list_is_rebuilt_from_the_log(broker_factory, pending):
    """A snapshot.json whose pending list had the wrong shape stopped start-up with "not enough values to
    unpack" (or "'NoneType' is not iterable"), naming no file: it is as unusable as one that is not JSON."""
    b = broker_factory(*QUIET)
    path, snap = await _stopped_with_one_undecided(b, "PG_snap")
    path.write_text(json.dumps({**snap, "pending": pending}))
    b.start()
    assert await _pending_groups(b) == ["PG_snap"]
    assert "pending list is malformed" in b.log()


@pytest.mark.parametrize("key", ["\u00b2", "1" * 5000])
async def test_a_snapshot_with_a_hostile_checked_time_starts_and_keeps_the_well_formed_ones(broker_factory, key):
    """The snapshot's "checked" ({wall ms: [half offsets]}) took any key str.isdigit() accepts: a superscript
    digit, or 5,000 digits (past int()'s limit), raised ValueError out of recovery and the broker did not start
    (a snapshot without a "crc" key, an older txmq's, is read unchecked). Such a key is left out, as any other
    malformed entry; a well-formed one still puts the next check an interval after it."""
    b = broker_factory(*QUIET)
    path, snap = await _stopped_with_one_undecided(b, "PG_checked")
    ((off, q, _checks),) = snap["pending"]
    snap.pop("crc", None)
    now_ms = time.time_ns() // 1_000_000
    path.write_text(json.dumps({**snap, "pending": [[off, q, 1]], "checked": {key: [off], str(now_ms): [off]}}))
    b.start()
    listed = json.loads((await _admin(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)).body_bytes())
    (row,) = listed["pending"]
    assert row["group"] == "PG_checked" and row["checks"] == 1, row
    assert row["next_check_in_ms"] > 30_000, row                # the well-formed entry: an interval after it


async def test_a_segment_manifest_with_entries_that_are_not_objects_is_recomputed(broker_factory):
    """segments.json is derived from the segments' bytes, but an entry that was not an object stopped start-up
    with "'int' object has no attribute 'get'", naming no file."""
    b = broker_factory()
    assert b.stop() == 0
    (b.store_dir / "segments.json").write_text(json.dumps({"segments": [1, "x", None], "removed": [2]}))
    b.start()
    assert b.stop() == 0
    assert [e["name"] for e in json.loads((b.store_dir / "segments.json").read_text())["segments"]] == [
        f"{0:020d}"]                                                        # written again at stop, whole


async def test_a_snapshot_changed_after_it_was_written_is_rebuilt_from_the_log(broker_factory):
    """A snapshot.json left valid JSON by its damage (a flipped digit; here a pending entry gone) was believed: the
    undecided transaction it no longer named was never checked nor delivered. Its checksum now refuses it."""
    b = broker_factory(*QUIET)
    path, snap = await _stopped_with_one_undecided(b, "PG_crc")
    path.write_text(json.dumps({**snap, "pending": []}, separators=(",", ":")))
    b.start()
    assert await _pending_groups(b) == ["PG_crc"]
    assert "checksum does not match" in b.log()


async def test_a_delay_offset_file_changed_after_it_was_written_is_replayed_from_the_log(broker_factory):
    """delayOffset.json left valid JSON by its damage (a flipped digit raising a level's offset) was believed:
    the delayed messages below the new offset were skipped, never delivered. Its checksum now refuses it."""
    b = broker_factory()
    async with Producer(b.namesrv, "PG_delay") as producer:
        await producer.send("DelayDamage", b"in two hours", delay_level=18)
    assert b.stop() == 0
    path = b.store_dir / "config" / "delayOffset.json"
    saved = json.loads(path.read_text())
    assert saved["offsetTable"]["18"] == 0
    saved["offsetTable"]["18"] = 1
    path.write_text(json.dumps(saved, separators=(",", ":")))
    b.start()
    assert b.stop() == 0
    log = b.log()
    assert "1 level messages" in log.rsplit("schedule recovered:", 1)[1].split("\n")[0]     # still waiting
    assert "checksum does not match" in log
