"""Read-only access to commit-log segments: find them, split them, decode them into rows.

Pure Python (protocol.message only), so the same functions run on the driver, inside
Spark's Python workers, and in the single-process benchmark baseline.

Where the written data of a segment ends (spec 7.1):

    at byte p            meaning
    TOTALSIZE, MESSAGE   a record: decode it, go on at p + TOTALSIZE
    size, BLANK_MAGIC    end-of-segment marker: the segment is sealed, nothing follows
    zeros to file end    end of written data in the active segment; in a sealed one (the
                         broker always ends those with the marker) damage: records were lost
    end of the file      the same: a sealed segment cut short is damage
    anything else        damage: a torn or corrupt record. The scan names the file and p.

A record whose magic is right but which does not decode (length past the file, fields that
do not add up, optionally a bad body CRC) is damage too. In the active (last) segment a
record can be caught half-copied by the broker's writer, so damage there is re-read a few
times before it is believed.

Rows: transaction records become one row each; everything else is summed per chunk
(traffic per hour / topic / producer group, and first / last store time, count and
highest queue offset per topic / queue), which keeps the Python-to-JVM hand-over small.

Splitting: a Spark task per segment walks record boundaries with peek_record (8 bytes a
record, about 0.7 us each, so ~0.7 s per GiB of 1 KiB messages against ~11 us a record to
decode) and cuts it into chunks of about ``chunk_bytes`` that start on a record; the chunks
are then spread over every core. The driver only lists file names. The walk stops at the
first thing that is not a plausible record and leaves the rest to the last chunk, whose
decoder reports it precisely.

A file that cannot be opened or read where a task runs becomes an ``err`` row naming the
path and the host (a store path missing on one worker of a cluster), never a task failure.
"""
from __future__ import annotations

import mmap
import os
import re
import socket
import time
from dataclasses import dataclass, replace

from protocol.codes import SysFlag
from protocol.errors import ProtocolError, StoreError
from protocol.message import BLANK_MAGIC, MESSAGE_MAGIC, Prop, body_crc, decode_record, peek_record
from protocol.txlog import DEAD_TOPIC, HALF_TOPIC, OP_TOPIC, P_CHECKS, P_HALF, P_OP, P_REASON

SEGMENT_NAME = re.compile(r"\d{20}")
_NONZERO = re.compile(rb"[^\x00]")
ACTIVE_REREADS = 5
ACTIVE_REREAD_DELAY_S = 0.05

# Transaction bookkeeping topics (protocol/txlog.py, docs/design.md "Transaction records"):
# their records are emitted one row each. Every other record is only counted, per chunk, in
# two partial aggregates, so the JVM receives a few rows per chunk instead of one per plain
# message.
ROW_TOPICS = frozenset((HALF_TOPIC, OP_TOPIC, DEAD_TOPIC))
# Not user traffic. SCHEDULE_TOPIC_XXXX holds delayed messages before they reach their real
# topic, so counting it would count them twice; so does rmq_sys_wheel_timer for timer messages.
# The transaction topics, the trace topic and rmq_sys_* (RocketMQ's prefix: the timer topic, the
# scheduler's progress records) are the broker's own. RMQ_SYS_ is no prefix of RocketMQ's (nor the
# broker's): a client's topic named RMQ_SYS_Orders is a user topic, and its traffic was left out.
SYSTEM_TOPICS = frozenset((DEAD_TOPIC, "SCHEDULE_TOPIC_XXXX", HALF_TOPIC, OP_TOPIC, "RMQ_SYS_TRACE_TOPIC"))
SYSTEM_PREFIXES = ("rmq_sys_",)
NO_GROUP = "-"
HOUR_MS = 3_600_000
_INDEXED = (SysFlag.TRANSACTION_NOT_TYPE, SysFlag.TRANSACTION_COMMIT)

# Every output row is a tuple in this column order; "row" says which columns it uses:
#   rec  one transaction record: segment .. half_qo (an op record's body: the half's queue offset, under
#        the body CRC where TXMQ_HALF is under none; None when it is not a number or fails its CRC)
#   msg  user traffic of a chunk: topic, pgroup, store_ts = hour start, n, bytes, body_bytes
#   seg  a chunk's records of one (topic, queue) with no gap in their queue offsets: store_ts = first, ts_max,
#        n, qo_max (highest queue offset of records that consume queues index; None if none); a gap (a kept
#        record) starts another
#   dmg  damage: segment, offset, size = bytes skipped to the segment's end, damage = reason
#   kept a damaged record the broker kept in place (--keep-corrupt-records, store file corrupt_kept): segment,
#        offset, size = its length, damage = why it does not decode (or "" when it does); it is stepped over
#   end  where a segment's data ends (its last chunk): segment, offset = the end, size = bytes
#        of data in the segment
#   err  the file could not be read where the task ran: segment, damage = the one-line reason
# msg and seg rows carry offset = the chunk's first offset, so a damaged tail (whose chunks
# start after the damage) can be left out by offset alone.
ROW_FIELDS = (
    "row", "segment", "offset", "size", "topic", "queue_id", "queue_offset", "tx_type", "store_ts",
    "prepared_offset", "pgroup", "real_topic", "uniq_key", "tags", "txmq_op", "txmq_half", "txmq_reason",
    "txmq_checks", "half_qo", "n", "bytes", "body_bytes", "ts_max", "qo_max", "damage",
)
_TAIL = (None,) * 6


def is_traffic(topic: str, tx_type: int) -> bool:
    """User traffic: not a system topic, and a record a consume queue indexes (NOT / COMMIT)."""
    return (tx_type in _INDEXED and not topic.startswith(SYSTEM_PREFIXES) and topic not in SYSTEM_TOPICS)


def producer_group(props: dict, tx_type: int) -> str:
    """The producer group a traffic record is counted for: a committed transaction's message (COMMIT type: only
    the broker writes it) names it in PGROUP, checked against the sender's group when its half came. Any other
    record's PGROUP is whatever its client wrote there -- a plain message naming another team's group, or a retry
    carrying its source's: counted as that group's traffic. NO_GROUP for them, as for plain messages."""
    if tx_type != SysFlag.TRANSACTION_COMMIT:
        return NO_GROUP
    return props.get(Prop.PGROUP) or NO_GROUP


@dataclass(frozen=True, slots=True)
class Segment:
    name: str
    path: str
    base: int           # commit-log offset of byte 0
    size: int           # file size in bytes
    active: bool        # still being written: the newest segment, or the one before its unwritten spare
    kept: frozenset = frozenset()   # byte positions of damaged records the broker kept in place (corrupt_kept)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Records of one segment that start in [start, end); ``last`` chunks run to the data's end."""

    segment: Segment
    start: int
    end: int
    last: bool


def require_store(store_dir: str) -> None:
    """Refuse a path that is not a broker's store, in one line a person can act on.

    A store is a directory holding ``commitlog/`` or ``store_id`` (the broker creates both when it
    opens one). Without this check a typo in ``--store-dir`` reads as an empty store: a quiet night.
    """
    if not os.path.exists(store_dir):
        raise StoreError(f"store directory {store_dir} does not exist (check --store-dir)")
    if not os.path.isdir(store_dir):
        raise StoreError(f"{store_dir} is not a directory: --store-dir names the broker's store directory")
    if not (os.path.isdir(os.path.join(store_dir, "commitlog"))
            or os.path.isfile(os.path.join(store_dir, "store_id"))):
        raise StoreError(f"{store_dir} holds no txmq store (no commitlog/ and no store_id): "
                         "point --store-dir at the broker's --store-dir")


CORRUPT_KEPT_FILE = "corrupt_kept"  # the broker's (broker/store/manifest.py); not imported: that pulls in the store


def read_corrupt_kept(store_dir: str) -> frozenset[int]:
    """Commit-log offsets of the damaged records a broker started with --keep-corrupt-records kept in place, one a
    line. It serves none of them and reads past them; the jobs do the same. A file that cannot be read is an error:
    read as damage, such a record would stop the job or, skipped, drop every record after it in its segment."""
    path = os.path.join(store_dir, CORRUPT_KEPT_FILE)
    try:
        with open(path, encoding="ascii") as f:
            return frozenset(int(line) for line in f.read().split())
    except FileNotFoundError:
        return frozenset()
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path} (the damaged records the broker kept in place) cannot be read: {exc}") from None


def list_segments(store_dir: str) -> list[Segment]:
    """The commit-log segments of a store, oldest first; the newest (or the one before its spare) is active."""
    if not os.path.isdir(store_dir):
        raise StoreError(f"store directory {store_dir} does not exist on host {socket.gethostname()} (the driver)")
    directory = os.path.join(store_dir, "commitlog")
    try:
        names = sorted(n for n in os.listdir(directory) if SEGMENT_NAME.fullmatch(n))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StoreError(read_error(directory, exc) + " (the driver)") from None
    names.sort(key=int)
    kept = read_corrupt_kept(store_dir)
    out = []
    for i, name in enumerate(names):
        path = os.path.join(directory, name)
        base, size = int(name), os.path.getsize(path)
        out.append(Segment(name, path, base, size, i == len(names) - 1,
                           frozenset(o - base for o in kept if base <= o < base + size)))
    # The broker creates the next segment before it needs it (broker/store/reserve.py): until that
    # spare holds a record, the segment before it is the one being written, with no end marker yet.
    if len(out) > 1 and _unwritten(out[-1]):
        out[-2] = replace(out[-2], active=True)
    return out


def _unwritten(seg: Segment) -> bool:
    try:
        with open(seg.path, "rb") as f:
            return not any(f.read(8))
    except OSError:
        return False


def _open(path: str):
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_error(path: str, exc: OSError) -> str:
    return f"cannot read {path} on host {socket.gethostname()}: {exc.strerror or exc}"


def error_row(seg: Segment, reason: str) -> tuple:
    return ("err", seg.name, seg.base) + (None,) * (len(ROW_FIELDS) - 4) + (reason,)


def split_segment(seg: Segment, chunk_bytes: int) -> list[Chunk]:
    """Cut a segment into chunks of about chunk_bytes, each starting on a record boundary.

    An unreadable file is one chunk, whose decoder then reports why."""
    if seg.size <= chunk_bytes:
        return [Chunk(seg, 0, seg.size, True)]
    try:
        mm = _open(seg.path)
    except OSError:
        return [Chunk(seg, 0, seg.size, True)]
    if mm is None:
        return [Chunk(seg, 0, 0, True)]
    chunks = []
    try:
        start = pos = 0
        limit = len(mm) - 8
        while pos <= limit:
            size, magic = peek_record(mm, pos)
            if size < 91 or pos + size > len(mm) or (magic != MESSAGE_MAGIC and pos not in seg.kept):
                break
            pos += size
            if pos - start >= chunk_bytes:
                chunks.append(Chunk(seg, start, pos, False))
                start = pos
    finally:
        mm.close()
    chunks.append(Chunk(seg, start, seg.size, True))
    return chunks


def _int(text):
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _record_row(seg: Segment, pos: int, msg, size: int, tx_type: int) -> tuple:
    p = msg.properties
    return ("rec", seg.name, seg.base + pos, size, msg.topic, msg.queue_id, msg.queue_offset, tx_type,
            msg.store_timestamp, msg.prepared_offset, p.get(Prop.PGROUP), p.get(Prop.REAL_TOPIC),
            p.get(Prop.UNIQ_KEY), p.get(Prop.TAGS), p.get(P_OP), _int(p.get(P_HALF)),
            p.get(P_REASON), _int(p.get(P_CHECKS)), _op_body(msg) if msg.topic == OP_TOPIC else None) + _TAIL


def _op_body(msg) -> int | None:
    # Under the CRC only when the CRC holds: without --check-crc nothing else checks it, and a digit flipped here
    # would take a decision from its half and give it to another. Failing, it names no half (the broker's
    # recovery empties such a body and goes by TXMQ_HALF). An op body is a few bytes: the check costs nothing.
    if body_crc(msg.body) != msg.body_crc:
        return None
    try:
        text = msg.body.decode("ascii")
    except UnicodeDecodeError:
        return None
    return int(text) if text.isdigit() else None


def damage_row(seg: Segment, pos: int, reason: str) -> tuple:
    return ("dmg", seg.name, seg.base + pos, seg.size - pos) + (None,) * (len(ROW_FIELDS) - 5) + (reason,)


def _partials(seg: Segment, chunk_offset: int, traffic: dict, queues: list):
    for (hour, topic, group), (n, size, body) in traffic.items():
        yield ("msg", seg.name, chunk_offset, None, topic, None, None, None, hour, None, group) + (None,) * 8 + (
            n, size, body, None, None, None)
    for (topic, qid), (n, first, last, qo_max) in queues:
        yield ("seg", seg.name, chunk_offset, None, topic, qid, None, None, first) + (None,) * 10 + (
            n, None, None, last, qo_max, None)


def _step(mm, pos: int, check_crc: bool):
    """What is at pos: ('rec', msg, size) | ('marker' | 'end', None, 0) | ('damage', reason, 0)."""
    end = len(mm)
    if end - pos < 8:
        return "end", None, 0
    size, magic = peek_record(mm, pos)
    if magic == BLANK_MAGIC:
        return "marker", None, 0
    if magic == MESSAGE_MAGIC:
        try:
            msg, size = decode_record(mm, pos, check_crc=check_crc)
            return "rec", msg, size
        except ProtocolError as exc:
            return "damage", str(exc), 0
    nonzero = _NONZERO.search(mm, pos)
    if nonzero is None:
        return "end", None, 0
    return "damage", (f"record at {pos} has TOTALSIZE {size} and magic {magic & 0xFFFFFFFF:#010x}, "
                      f"and non-zero bytes follow at {nonzero.start()}"), 0


def decode_chunk(chunk: Chunk, check_crc: bool = False):
    """Rows for one chunk: rec rows as records are met, then its msg / seg partials, then a
    dmg row if the chunk ends in damage."""
    seg = chunk.segment
    try:
        mm = _open(seg.path)
    except OSError as exc:
        yield error_row(seg, read_error(seg.path, exc))
        return
    if mm is None:
        if chunk.last:
            yield _end_row(seg, 0)
            if not seg.active:
                yield _unsealed(seg, 0)
        return
    traffic: dict = {}
    queues: dict = {}       # (topic, queue id) -> [n, first ts, last ts, qo_max] of its current run of offsets
    runs: list = []         # the runs a gap ended: ((topic, queue id), [n, first ts, last ts, qo_max])
    damage = None
    kind = None
    kept = seg.kept
    try:
        pos = chunk.start
        while pos < chunk.end:
            row = _kept_row(mm, seg, pos, check_crc) if kept and pos in kept else None
            if row is not None:
                # The broker kept this damaged record in place and serves none of it: step over it, not stop.
                yield row
                pos += row[3]
                continue
            kind, what, size = _step(mm, pos, check_crc)
            rereads = ACTIVE_REREADS if seg.active else 0
            while kind == "damage" and rereads:
                # The broker's writer may be copying this very record; look again shortly.
                time.sleep(ACTIVE_REREAD_DELAY_S)
                rereads -= 1
                kind, what, size = _step(mm, pos, check_crc)
            if kind in ("end", "marker"):
                break
            if kind == "damage":
                damage = damage_row(seg, pos, what)
                break
            msg = what
            topic, ts, tx_type = msg.topic, msg.store_timestamp, msg.sys_flag & SysFlag.TRANSACTION_MASK
            if SysFlag.type_bit_flipped(tx_type, msg.queue_offset):
                tx_type ^= 0x4      # put back as the broker's start and its slaves do (the message served, so counted)
            if topic in ROW_TOPICS:
                yield _record_row(seg, pos, msg, size, tx_type)
            elif is_traffic(topic, tx_type):
                key = (ts - ts % HOUR_MS, topic, producer_group(msg.properties, tx_type))
                t = traffic.get(key)
                if t is None:
                    traffic[key] = [1, size, len(msg.body)]
                else:
                    t[0] += 1
                    t[1] += size
                    t[2] += len(msg.body)
            qkey = (topic, msg.queue_id)
            q = queues.get(qkey)
            qo = msg.queue_offset if tx_type in _INDEXED else None
            if q is not None and qo is not None and q[3] is not None and qo != q[3] + 1:
                # A gap in the queue's offsets (a kept record stepped over above): the run before it is a partial
                # of its own, so each holds qo_max - n + 1 .. qo_max, as the expiry report counts them.
                runs.append((qkey, q))
                q = None
            if q is None:
                queues[qkey] = [1, ts, ts, qo]
            else:
                q[0] += 1
                if ts < q[1]:
                    q[1] = ts
                if ts > q[2]:
                    q[2] = ts
                if qo is not None:
                    q[3] = qo
            pos += size
    finally:
        mm.close()
    yield from _partials(seg, seg.base + chunk.start, traffic, [*runs, *queues.items()])
    if chunk.last:
        yield _end_row(seg, pos)
        if damage is None and kind != "marker" and not seg.active:
            damage = _unsealed(seg, pos)
    if damage:
        yield damage


def _kept_row(mm, seg: Segment, pos: int, check_crc: bool) -> tuple | None:
    """The row for a kept damaged record, size = its TOTALSIZE (the broker kept it because that is sure); None when
    no record can end there (the file was changed since): then it is read, and reported, as damage."""
    if len(mm) - pos < 8:
        return None
    size, _ = peek_record(mm, pos)
    if size < 91 or pos + size > len(mm):
        return None
    kind, what, _ = _step(mm, pos, check_crc)
    return ("kept", seg.name, seg.base + pos, size) + (None,) * (len(ROW_FIELDS) - 5) + (
        what if kind == "damage" else "",)


def _unsealed(seg: Segment, pos: int) -> tuple:
    return damage_row(seg, pos, f"sealed segment's data stops at byte {pos} without its end marker: the file "
                                "was cut short or zeroed, and the records after it are lost")


def _end_row(seg: Segment, pos: int) -> tuple:
    return ("end", seg.name, seg.base + pos, pos) + (None,) * (len(ROW_FIELDS) - 4)


def read_records(items, check_crc: bool = False):
    """mapPartitions body for point reads: (Segment, commit-log offset) -> a rec row, a kept row (a damaged
    record the broker kept in place: left out, as the scan leaves it out), a dmg row (no record can be decoded
    there), or an err row."""
    for seg, offset in items:
        try:
            with open(seg.path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            yield error_row(seg, read_error(seg.path, exc))
            continue
        pos = offset - seg.base
        try:
            # Read without its CRC, a kept half came back as sound (a decision counted for it that the whole
            # scan, stepping over it, leaves out), or stopped the job as damage.
            row = _kept_row(mm, seg, pos, True) if pos in seg.kept else None
            if row is not None:
                yield row
                continue
            kind, what, size = _step(mm, pos, check_crc)
            if kind == "rec":
                yield _record_row(seg, pos, what, size, what.sys_flag & SysFlag.TRANSACTION_MASK)
            else:
                yield damage_row(seg, pos, what if kind == "damage" else f"no record at {pos}, where a "
                                 "transaction record says its half is")
        finally:
            mm.close()


def first_store_ts(seg: Segment) -> int | None:
    """Store time of a segment's first record (read on the driver); None when it holds none or cannot be read."""
    try:
        mm = _open(seg.path)
    except OSError:
        return None
    if mm is None:
        return None
    try:
        kind, what, _ = _step(mm, 0, False)
        return what.store_timestamp if kind == "rec" else None
    finally:
        mm.close()


def decode_chunks(chunks, check_crc: bool = False):
    """mapPartitions body: every row of every chunk in the partition."""
    for chunk in chunks:
        yield from decode_chunk(chunk, check_crc)


def plan_chunks(store_dir: str, chunk_bytes: int) -> tuple[list[Segment], list[Chunk]]:
    """Every segment's chunks, split here (one process: tests and the benchmark baseline)."""
    segments = list_segments(store_dir)
    chunks = [c for seg in segments for c in split_segment(seg, chunk_bytes)]
    return segments, chunks
