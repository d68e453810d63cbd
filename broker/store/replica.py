"""Replication at the store level: the bytes a master hands out, the chunks a slave appends.

A slave's commit log is a byte-for-byte copy of its master's: the same records at the same
physical offsets, the same end markers at the same positions. So the master hands out runs of
its own segment bytes, and the slave copies them in at the offset they came from; nothing is
re-encoded on either side.

What one chunk is (the master's ``read_chunk``; the slave's ``parse_chunk`` insists on it):

    a run of whole records in one segment    (at least one record, at most ``limit`` bytes
                                              unless the first record alone is larger)
    or one end marker, 8 bytes               (TOTALSIZE = bytes left in the segment, BLANK magic):
                                              the segment is sealed, the next chunk starts at the
                                              next segment's first byte

Whole records keep the slave simple: every chunk it appends is indexable at once (consume-queue
units from each record's own QUEUEOFFSET, dispatch as after a put), with no partial record carried
between frames. RocketMQ cuts its 32 KiB transfers anywhere; the frame layout (ha/codec.py) is the
same, only the cut points differ.
"""
from __future__ import annotations

import logging
import struct
from typing import Callable, NamedTuple

from protocol.codes import SysFlag
from protocol.errors import RecordError
from protocol.message import BLANK_MAGIC, MESSAGE_MAGIC, string_to_properties, tags_code, validate_topic
from protocol.record import MIN_RECORD_SIZE, RECORD_HEAD, read_index_fields

from .results import DispatchInfo

log = logging.getLogger("txmq.store")

_MARKER_SIZE = 8
_SIZE_MAGIC = struct.Struct(">ii")


class ReplicaRecord(NamedTuple):
    """One record of a chunk, as the slave indexes it (positions relative to the chunk)."""

    pos: int
    size: int
    queue_id: int
    queue_offset: int       # -1: no consume-queue unit (PREPARED / ROLLBACK records)
    sys_flag: int
    store_timestamp: int
    prepared_offset: int
    topic: str
    tags_code: int


class ReplicaChunk:
    """What the slave queues for the writer: bytes for ``phys``, their records parsed, or a seal."""

    __slots__ = ("phys", "data", "records", "seal", "end", "nul_end", "older_nul")

    def __init__(self, phys: int, data: bytes, records: list[ReplicaRecord], seal: bool, end: int,
                 nul_end: int = -1):
        self.phys = phys
        self.data = data
        self.records = records
        self.seal = seal
        self.end = end          # the log end after this chunk (after a seal: the next segment's start)
        # where the last record whose properties hold a NUL ends (an older or a Java master stored it; this
        # broker's recovery and reads take a NUL there for damage past the store's nul_free_from), or -1
        self.nul_end = nul_end
        self.older_nul = False  # nul_end past the slave's nul_free_from: the writer moves it (Writer._vouch_first)

    def infos(self) -> list[DispatchInfo]:
        base = self.phys
        return [DispatchInfo(r.topic, r.queue_id, r.queue_offset, base + r.pos, r.size, r.tags_code,
                             r.store_timestamp, r.sys_flag, r.prepared_offset, False) for r in self.records]


def parse_chunk(phys: int, data: bytes, seg_size: int, tag_rule: Callable | None = None,
                check_crc: bool = True) -> ReplicaChunk:
    """Check a chunk from the master and parse its records; ValueError says what is wrong with it.
    (``check_crc`` False: a record the master kept damaged, sent the same twice: MessageStore.append_replica; its
    body CRC and its topic name are not judged.)

    Every record is checked as recovery checks it (magic, size, its PHYSICALOFFSET field equal to where
    it will lie, lengths, body CRC), so a damaged transfer never reaches the slave's log.
    """
    pos_in_seg = phys % seg_size
    n = len(data)
    if n == _MARKER_SIZE:
        size, magic = _SIZE_MAGIC.unpack_from(data, 0)
        if magic == BLANK_MAGIC:
            if size != seg_size - pos_in_seg:
                raise ValueError(f"end marker at {phys} says {size} bytes left, the segment has "
                                 f"{seg_size - pos_in_seg} (do master and slave use the same segment_size?)")
            return ReplicaChunk(phys, bytes(data), [], True, phys + size)
    if n == 0:
        raise ValueError(f"empty chunk at {phys}")
    if pos_in_seg + n + _MARKER_SIZE > seg_size:
        raise ValueError(f"chunk of {n} bytes at {phys} does not fit its segment with room for the end marker "
                         "(do master and slave use the same segment_size?)")
    records: list[ReplicaRecord] = []
    pos = 0
    nul_end = -1
    known: set[str] = set()     # topics judged (a chunk is mostly a few topics' records)
    while pos < n:
        if n - pos < MIN_RECORD_SIZE:
            raise ValueError(f"chunk at {phys} ends with {n - pos} bytes, not a whole record")
        size, magic, crc, qid, _flag, qoff, rphys, sys_flag = RECORD_HEAD.unpack_from(data, pos)
        if magic != MESSAGE_MAGIC or size < MIN_RECORD_SIZE or pos + size > n:
            raise ValueError(f"no whole record at {phys + pos} (magic {magic & 0xFFFFFFFF:#x}, size {size})")
        if rphys != phys + pos:
            raise ValueError(f"record at {phys + pos} says its offset is {rphys}")
        try:
            ts, prepared, topic, (plo, plen) = read_index_fields(data, pos, size, sys_flag, crc if check_crc else None)
        except RecordError as exc:
            raise ValueError(f"record at {phys + pos}: {exc}") from None
        # (the TOPIC is outside the CRC: one that is no name is a damaged record, its master's kept one)
        if check_crc and topic not in known and validate_topic(topic) is not None:
            raise ValueError(f"record at {phys + pos}: {validate_topic(topic)}")
        known.add(topic)
        if data.find(b"\x00", plo, plo + plen) >= 0:
            nul_end = phys + pos + size
        if SysFlag.type_bit_flipped(sys_flag, qoff):
            # in the master's log, which its start reads put back (recovery._typed_away); taken as read, the record
            # got no unit here, a blank at its offset
            log.error("record at log offset %d from the master: %s-%d queue offset %d has SYSFLAG %#x, a transaction "
                      "type stored with no queue offset: the bit 0x4 is damaged (outside the body CRC); indexed as "
                      "%#x", phys + pos, topic, qid, qoff, sys_flag, sys_flag ^ 0x4)
            sys_flag ^= 0x4
        unit = not sys_flag & 0x4       # NOT and COMMIT records have a consume-queue unit (spec 7.2)
        records.append(ReplicaRecord(pos, size, qid, qoff if unit else -1, sys_flag, ts, prepared, topic,
                                     tag_of(data[plo:plo + plen], topic, ts, tag_rule) if unit else 0))
        pos += size
    return ReplicaChunk(phys, bytes(data), records, False, phys + n, nul_end)


def chunk_end(phys: int, data) -> int:
    """Where the log goes on after a chunk sent for ``phys``: after an end marker, the next segment's start
    (TOTALSIZE is what the segment had left), else right after its bytes."""
    if len(data) == _MARKER_SIZE:
        size, magic = _SIZE_MAGIC.unpack_from(data, 0)
        if magic == BLANK_MAGIC:
            return phys + size
    return phys + len(data)


def tag_of(props_raw, topic: str = "", ts: int = 0, rule: Callable | None = None) -> int:
    """The consume-queue tagsCode of a record from its properties bytes: its TAGS hash, or what
    ``rule(topic, props, store ts)`` says for the topics it knows (a delayed message's delivery time).
    Recovery and a slave's replica chunks both use it."""
    try:
        props = string_to_properties(bytes(props_raw).decode())
    except UnicodeDecodeError:
        return 0
    if rule is not None:
        special = rule(topic, props, ts)
        if special is not None:
            return special
    return tags_code(props)


def chunk_span(mm, pos: int, seg_size: int, avail: int, limit: int) -> int:
    """(Master) bytes of the chunk starting ``pos`` in a segment mapping, reading at most ``avail`` bytes:
    whole records up to ``limit`` bytes (at least one), or 8 for an end marker; 0 when nothing whole is
    there yet. ValueError when ``pos`` is not a record boundary."""
    size, magic = _SIZE_MAGIC.unpack_from(mm, pos) if pos + 8 <= seg_size else (0, 0)
    if magic == BLANK_MAGIC and size == seg_size - pos:
        return _MARKER_SIZE if avail >= _MARKER_SIZE else 0
    if magic != MESSAGE_MAGIC:
        raise ValueError(f"offset {pos} of its segment is not a record boundary")
    end = pos
    stop = pos + avail
    while end + MIN_RECORD_SIZE <= stop:
        size, magic = _SIZE_MAGIC.unpack_from(mm, end)
        if magic != MESSAGE_MAGIC or end + size > stop:
            break
        if end > pos and end + size - pos > limit:
            break
        end += size
    return end - pos
