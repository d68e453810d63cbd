"""Every RocketMQ byte layout txmq speaks, declared once in construct: the spec and the test oracle.

This module is documentation that runs. It is NEVER used on bytes from a
socket or a disk: the hot-path codecs (frame.py, command.py, message.py) are
written on precompiled ``struct.Struct`` with explicit bounds checks, and
tests/unit/test_protocol_oracle.py holds them to these declarations in both
directions (struct-encode -> construct-parse, construct-build -> struct-decode).
The declarations are interpreted, never ``.compile()``d: compiled construct
skips length checks, which is exactly what an oracle must not do.

All integers are big-endian (Java ByteBuffer). Layouts (spec sections in brackets):

    Frame [1.1]             length (int) = 4 + H + B | serialize type (byte) | H (24-bit) | header | body
    RocketMQHeader [1.4]    code (short) language (byte) version (short) opaque (int) flag (int)
                            remark (int-prefixed UTF-8) | ext block (int-prefixed):
                            entries of key (short-prefixed UTF-8), value (int-prefixed UTF-8)
    JsonHeader [1.3]        the header bytes as UTF-8 JSON text (parsed with the stdlib json module)
    StoreRecord [6.1]       see the table in message.py; hosts are 8 bytes (IPv4 + port), or 20
                            (IPv6 + port) when sysFlag has 0x10 (born host) / 0x20 (store host)
    BlankMarker [7.1]       end-of-segment: TOTALSIZE = bytes left, MAGIC 0xCBD43194
    BatchEntry [6.7]        SEND_BATCH_MESSAGE body entry; BatchBody = entries to the end
    ConsumeQueueUnit [7.3]  commit-log offset (long), size (int), tag code (long): 20 bytes
    OffsetMsgId [6.5]       store-host IP (4 or 16 bytes) + port (int) + commit-log offset (long)

Two things are deliberately left to the callers: BODYCRC is a plain field (the
CRC covers the body, which comes later in the stream, so construct cannot
check it while parsing), and the properties string stays text (its
``name\\x01value\\x02`` grammar is not a byte layout).
"""
from __future__ import annotations

import json

import construct as c
from construct import this

from .frame import MAX_FRAME_SIZE
from .message import BLANK_MAGIC, MESSAGE_MAGIC

# ---------------------------------------------------------------- frame [1.1]
# The 8-byte prefix: the header word is one byte of serialize type over a
# 24-bit header length (Java: ``type << 24 | headerLength``).
_LENGTH = "length" / c.Rebuild(c.Int32sb, lambda ctx: 4 + len(ctx.header) + len(ctx.body))
_SERIALIZE_TYPE = "serialize_type" / c.Default(c.Int8ub, 0)
_HEADER_LENGTH = "header_length" / c.Rebuild(c.Int24ub, c.len_(this.header))

FramePrefix = c.Struct(_LENGTH, _SERIALIZE_TYPE, _HEADER_LENGTH)

Frame = c.Struct(
    _LENGTH,
    _SERIALIZE_TYPE,
    _HEADER_LENGTH,
    c.Check((this.length >= 4) & (this.length <= MAX_FRAME_SIZE) & (this.header_length <= this.length - 4)),
    "header" / c.Bytes(this.header_length),
    "body" / c.Bytes(this.length - 4 - this.header_length),
)

# A buffer holding exactly one frame (what FrameDecoder hands out).
WholeFrame = c.FocusedSeq("frame", "frame" / Frame, c.Terminated)

# ------------------------------------------------------ ROCKETMQ header [1.4]
ExtEntry = c.Struct(
    "key" / c.PascalString(c.Int16sb, "utf8"),
    "value" / c.PascalString(c.Int32sb, "utf8"),
)

RocketMQHeader = c.Struct(
    "code" / c.Int16sb,
    "language" / c.Int8ub,
    "version" / c.Int16sb,
    "opaque" / c.Int32sb,
    "flag" / c.Int32sb,
    "remark" / c.PascalString(c.Int32sb, "utf8"),   # length 0 = no remark (Java: null)
    # The ext block must be filled exactly by whole entries.
    "ext" / c.Prefixed(c.Int32sb, c.FocusedSeq("entries", "entries" / c.GreedyRange(ExtEntry), c.Terminated)),
    c.Terminated,
)

# ---------------------------------------------------------- JSON header [1.3]
JsonHeader = c.ExprAdapter(
    c.GreedyBytes,
    decoder=lambda raw, ctx: json.loads(raw.decode("utf-8")),
    encoder=lambda obj, ctx: json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
)

HEADERS = {0: JsonHeader, 1: RocketMQHeader}


def parse_command(data: bytes) -> dict:
    """One whole frame -> {serialize_type, header (dict for JSON, Container for ROCKETMQ), body}."""
    frame = WholeFrame.parse(data)
    header_schema = HEADERS.get(frame.serialize_type)
    if header_schema is None:
        raise c.ValidationError(f"unknown serialize type {frame.serialize_type}")
    return {"serialize_type": frame.serialize_type, "header": header_schema.parse(frame.header), "body": frame.body}


def build_command(serialize_type: int, header, body: bytes = b"") -> bytes:
    """The inverse of parse_command: ``header`` is a JSON object or a RocketMQHeader dict."""
    header_bytes = HEADERS[serialize_type].build(header)
    return Frame.build({"serialize_type": serialize_type, "header": header_bytes, "body": body})


# --------------------------------------------------------- store record [6.1]
SYSFLAG_BORNHOST_V6 = 0x10
SYSFLAG_STOREHOST_V6 = 0x20

HostV4 = c.Struct("ip" / c.Bytes(4), "port" / c.Int32sb)
HostV6 = c.Struct("ip" / c.Bytes(16), "port" / c.Int32sb)


def _record_size(ctx) -> int:
    size = 91 + len(ctx.body) + len(ctx.topic.encode("utf-8")) + len(ctx.properties.encode("utf-8"))
    if ctx.sys_flag & SYSFLAG_BORNHOST_V6:
        size += 12
    if ctx.sys_flag & SYSFLAG_STOREHOST_V6:
        size += 12
    return size


StoreRecord = c.Struct(
    "_start" / c.Tell,
    "total_size" / c.Rebuild(c.Int32sb, _record_size),
    "magic" / c.Const(MESSAGE_MAGIC, c.Int32sb),
    "body_crc" / c.Int32sb,                    # zlib.crc32(body) & 0x7FFFFFFF, set by the broker
    "queue_id" / c.Int32sb,
    "flag" / c.Int32sb,
    "queue_offset" / c.Int64sb,
    "physical_offset" / c.Int64sb,
    "sys_flag" / c.Int32sb,
    "born_timestamp" / c.Int64sb,
    "born_host" / c.IfThenElse(this.sys_flag & SYSFLAG_BORNHOST_V6, HostV6, HostV4),
    "store_timestamp" / c.Int64sb,
    "store_host" / c.IfThenElse(this.sys_flag & SYSFLAG_STOREHOST_V6, HostV6, HostV4),
    "reconsume_times" / c.Int32sb,
    "prepared_offset" / c.Int64sb,
    "body" / c.Prefixed(c.Int32sb, c.GreedyBytes),
    "topic" / c.PascalString(c.Int8sb, "utf8"),       # signed byte: at most 127 bytes
    "properties" / c.PascalString(c.Int16sb, "utf8"),  # signed short: at most 32767 bytes
    "_end" / c.Tell,
    c.Check(this.total_size == this._end - this._start),
)

# A pull / query response body: records back to back, to the last byte.
RecordRun = c.FocusedSeq("records", "records" / c.GreedyRange(StoreRecord), c.Terminated)

BlankMarker = c.Struct(
    "total_size" / c.Int32sb,
    "magic" / c.Const(BLANK_MAGIC, c.Int32sb),
)

# ---------------------------------------------------------- batch entry [6.7]
BatchEntry = c.Struct(
    "_start" / c.Tell,
    "total_size" / c.Rebuild(c.Int32sb, lambda ctx: 22 + len(ctx.body) + len(ctx.properties.encode("utf-8"))),
    "magic" / c.Default(c.Int32sb, 0),      # the client writes 0; the broker ignores it
    "body_crc" / c.Default(c.Int32sb, 0),   # likewise
    "flag" / c.Int32sb,
    "body" / c.Prefixed(c.Int32sb, c.GreedyBytes),
    "properties" / c.PascalString(c.Int16sb, "utf8"),
    "_end" / c.Tell,
    c.Check(this.total_size == this._end - this._start),
)

BatchBody = c.FocusedSeq("entries", "entries" / c.GreedyRange(BatchEntry), c.Terminated)

# ---------------------------------------------------- consume-queue unit [7.3]
ConsumeQueueUnit = c.Struct(
    "physical_offset" / c.Int64sb,   # commit-log offset of the record
    "size" / c.Int32sb,              # record TOTALSIZE
    "tags_code" / c.Int64sb,         # Java hash of TAGS, sign-extended (delivery time for SCHEDULE_TOPIC_XXXX)
)
CQ_UNIT_SIZE = ConsumeQueueUnit.sizeof()

# ------------------------------------------------------ offset message id [6.5]
# The id's bytes; on the wire they are upper-case hex (32 chars IPv4, 56 IPv6).
OffsetMsgId = c.Select(
    c.Struct("ip" / c.Bytes(4), "port" / c.Int32sb, "physical_offset" / c.Int64sb, c.Terminated),
    c.Struct("ip" / c.Bytes(16), "port" / c.Int32sb, "physical_offset" / c.Int64sb, c.Terminated),
)


def parse_offset_msg_id(text: str):
    """The OffsetMsgId fields of a hex id; only 32- or 56-character ids are ids at all."""
    if len(text) not in (32, 56):
        raise c.ValidationError(f"offset message id of {len(text)} characters")
    return OffsetMsgId.parse(bytes.fromhex(text))
