"""Store-record fields read in place: what the store's scans need without decoding a record.

The layout is the store record's (protocol/message.py has the table). Recovery reads every
record of the newest segments at start-up, and segment summaries hop over whole segments,
so these readers take the mapping as it is and return plain tuples: no body, properties
or host is copied or decoded. Positions are absolute in ``buf``.

    reader                 reads                                               from
    RECORD_HEAD            TOTALSIZE MAGIC BODYCRC QUEUEID FLAG QUEUEOFFSET    bytes 0..39
                           PHYSICALOFFSET SYSFLAG
    read_index_fields      STORETIMESTAMP, PREPARED TX OFFSET, BODY (its CRC   after the hosts (their lengths
                           optionally), TOPIC, where PROPERTIES lie            follow SYSFLAG's v6 bits)
    check_tail_fields      TOPIC a valid name, PROPERTIES free of NUL bytes    what read_index_fields found
    store_timestamp_at     STORETIMESTAMP                                      56, or 68 after an IPv6 born host
    record_properties      PROPERTIES (then message.property_bytes finds a pair)     after BODY and TOPIC
    body_crc_ok            BODYCRC against the body                            8, and the body after the hosts
    record_intact          body_crc_ok, TOPIC a valid name, no NUL in          as body_crc_ok, then the rest
                           PROPERTIES

The caller judges what the head says (magic, size against its file, offset field against
the record's place); read_index_fields checks that the lengths inside add up to TOTALSIZE
and raises RecordError saying which does not.

BODYCRC covers the body only. Segments are preallocated with zeros and written through a
mapping, so a crash can leave a record whose head and body reached the disk but whose topic
or properties (pages after them) did not: they read as zeros. check_tail_fields catches
that: no topic the broker accepts holds a NUL, and the broker refuses to store properties
holding one (message.separator_in), so a zero-filled range there is never data -- in records
that broker wrote: an older one (or a RocketMQ master a slave copies) stored NULs, and the store
applies these checks only from its ``nul_free_from`` offset on (broker/store/manifest.py).
"""
from __future__ import annotations

import struct
import zlib

from .codes import SysFlag
from .errors import RecordError
from .message import MAX_TOPIC_LENGTH, MESSAGE_MAGIC, POS_BORN_HOST, TOPIC_CHARS, validate_topic

MIN_RECORD_SIZE = 91                        # empty body, topic and properties, IPv4 hosts
MESSAGE_MAGIC_BYTES = struct.pack(">i", MESSAGE_MAGIC)     # what a search for a record start looks for
# RECORD_HEAD.unpack_from(buf, pos): (TOTALSIZE, MAGIC, BODYCRC, QUEUEID, FLAG, QUEUEOFFSET, PHYSICALOFFSET,
# SYSFLAG); a Struct rather than a function, as a scan calls it once per record. The caller makes sure
# the 40 bytes are there (a record is at least MIN_RECORD_SIZE).
RECORD_HEAD = struct.Struct(">iiiiiqqi")
_BORN_V6 = int(SysFlag.BORNHOST_V6)        # module constants: read once per record, class attributes cost more
_STORE_V6 = int(SysFlag.STOREHOST_V6)
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")


def read_index_fields(buf, pos: int, size: int, sys_flag: int, crc: int | None = None):
    """(STORETIMESTAMP, PREPARED TX OFFSET, topic, (properties start, properties length)) of the
    record of ``size`` bytes at pos, whose head says ``sys_flag``.

    With ``crc`` (the head's BODYCRC) the body's CRC is checked too. RecordError says which
    length does not fit; the record's bytes [pos, pos + size) must be readable."""
    p = pos + POS_BORN_HOST + (20 if sys_flag & _BORN_V6 else 8)
    ts = _I64.unpack_from(buf, p)[0]
    p += 8 + (20 if sys_flag & _STORE_V6 else 8) + 4
    prepared = _I64.unpack_from(buf, p)[0]
    body_len = _I32.unpack_from(buf, p + 8)[0]
    p += 12
    end = pos + size
    if body_len < 0 or p + body_len + 3 > end:
        raise RecordError(f"body length {body_len} runs past the record")
    if crc is not None and zlib.crc32(buf[p:p + body_len]) & 0x7FFFFFFF != crc:
        raise RecordError("body CRC mismatch")
    t = p + body_len
    topic_len = buf[t]
    if topic_len > MAX_TOPIC_LENGTH or t + 3 + topic_len > end:
        raise RecordError(f"topic length {topic_len} runs past the record")
    props_len = _I16.unpack_from(buf, t + 1 + topic_len)[0]
    if t + 3 + topic_len + props_len != end:
        raise RecordError(f"properties length {props_len} does not end the record")
    try:
        topic = str(buf[t + 1:t + 1 + topic_len], "utf-8")
    except UnicodeDecodeError:
        raise RecordError("topic is not UTF-8") from None
    return ts, prepared, topic, (t + 3 + topic_len, props_len)


def check_tail_fields(buf, topic: str, span: tuple[int, int]) -> None:
    """RecordError unless ``topic`` (as read_index_fields gave it) is a name the broker accepts and the
    properties at ``span`` hold no NUL byte: what a record torn after its body (those pages lost, read as
    zeros) fails and every record the broker writes passes."""
    why = validate_topic(topic)
    if why is not None:
        raise RecordError(f"topic: {why}")
    lo, n = span
    at = bytes(buf[lo:lo + n]).find(b"\x00")
    if at >= 0:
        raise RecordError(f"properties hold a NUL byte at {at} of {n}")


def store_timestamp_at(buf, pos: int) -> int:
    """STORETIMESTAMP of the record at pos (its SYSFLAG says where the field lies)."""
    sys_flag = _I32.unpack_from(buf, pos + 36)[0]
    return _I64.unpack_from(buf, pos + (68 if sys_flag & _BORN_V6 else 56))[0]


def record_properties(buf):
    """The PROPERTIES bytes of the whole record ``buf`` (a slice of a stored record), not copied. The record
    was checked when stored; a damaged one raises struct.error or IndexError."""
    sys_flag = _I32.unpack_from(buf, 36)[0]
    p = 84 + (12 if sys_flag & _BORN_V6 else 0) + (12 if sys_flag & _STORE_V6 else 0)
    p += 4 + _I32.unpack_from(buf, p)[0]
    p += 1 + buf[p]
    return buf[p + 2:p + 2 + _I16.unpack_from(buf, p)[0]]


def body_crc_ok(buf, pos: int = 0, size: int | None = None) -> bool:
    """The body of the record at ``pos`` (``size`` bytes, TOTALSIZE if not given) still matches its BODYCRC.

    The reads of the store's older segments (which start-up does not verify) call this before serving or
    copying a record; False also when the body length runs past the record."""
    p, body_len, end = _body_at(buf, pos, size)
    if body_len < 0 or p + body_len > end:
        return False
    return zlib.crc32(buf[p:p + body_len]) & 0x7FFFFFFF == _I32.unpack_from(buf, pos + 8)[0]


def _body_at(buf, pos: int, size: int | None) -> tuple[int, int, int]:
    """Where the body of the record at ``pos`` starts, its BODYLENGTH, and where the record ends."""
    if size is None:
        size = _I32.unpack_from(buf, pos)[0]
    sys_flag = _I32.unpack_from(buf, pos + 36)[0]
    p = pos + 84 + (12 if sys_flag & _BORN_V6 else 0) + (12 if sys_flag & _STORE_V6 else 0)
    return p + 4, _I32.unpack_from(buf, p)[0], pos + size


def record_intact(buf, pos: int = 0, size: int | None = None) -> bool:
    """body_crc_ok, and the lengths after the body end the record, the topic is a name the broker accepts
    (validate_topic) and the properties hold no NUL: a page of them zeroed at rest, or a byte of the topic
    flipped ('TornPlain' read 'T/rnPlain': served under a name no one sent, and a slave refused its chunk for
    ever), is refused as a flipped body bit is.

    What the reads of unverified segments call (MessageStore.verified_record, pulls, replication): one copy
    of the topic and properties, a match and a search, about 0.6 us on top of the CRC's 0.8 us (1 KiB body)."""
    p, body_len, end = _body_at(buf, pos, size)
    if body_len < 0 or p + body_len + 3 > end:
        return False
    if zlib.crc32(buf[p:p + body_len]) & 0x7FFFFFFF != _I32.unpack_from(buf, pos + 8)[0]:
        return False
    tail = bytes(buf[p + body_len:end])     # TOPICLENGTH, TOPIC, PROPERTIESLENGTH, PROPERTIES: one copy
    t = tail[0] + 1                         # where PROPERTIESLENGTH starts
    if t == 1 or t + 2 > len(tail) or t + 2 + _I16.unpack_from(tail, t)[0] != len(tail):
        return False
    return t <= MAX_TOPIC_LENGTH + 1 and not tail[1:t].translate(None, TOPIC_CHARS) \
        and tail.find(b"\x00", t + 2) < 0
