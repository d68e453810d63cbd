"""Messages: the store record (= pull body = check body), properties, message ids, send headers.

Store record (spec 6.1), big-endian, IPv4 hosts (each IPv6 host adds 12 bytes):

    offset  size  field
    0       4     TOTALSIZE              whole record, this field included
    4       4     MAGICCODE              0xDAA320A7 (0xCBD43194 = end-of-segment blank)
    8       4     BODYCRC                zlib.crc32(body) & 0x7FFFFFFF
    12      4     QUEUEID
    16      4     FLAG                   user flag
    20      8     QUEUEOFFSET            logical offset in the consume queue
    28      8     PHYSICALOFFSET         commit-log offset of this record
    36      4     SYSFLAG
    40      8     BORNTIMESTAMP          producer clock, ms
    48      8     BORNHOST               IPv4 + int port (20 bytes if SYSFLAG has BORNHOST_V6)
    56      8     STORETIMESTAMP         broker clock, ms
    64      8     STOREHOST              IPv4 + int port (20 bytes if STOREHOST_V6)
    72      4     RECONSUMETIMES
    76      8     PREPARED TX OFFSET     half record's commit-log offset on committed messages
    84      4+B   BODYLENGTH, BODY
    88+B    1+T   TOPICLENGTH (byte), TOPIC
    89+B+T  2+P   PROPERTIESLENGTH (short), PROPERTIES

Properties string (spec 4.1): ``name\\x01value`` pairs joined by ``\\x02``.

SEND_BATCH_MESSAGE body entry (spec 6.7): TOTALSIZE, MAGIC (0), BODYCRC (0), FLAG,
BODYLENGTH + BODY, PROPERTIESLENGTH + PROPERTIES.
"""
from __future__ import annotations

import functools
import ipaddress
import itertools
import os
import re
import socket
import struct
import time
import weakref
import zlib
from dataclasses import dataclass

from .codes import ResponseCode, SysFlag
from .errors import HeaderError, MessageIllegalError, RecordError

MESSAGE_MAGIC = -626843481      # 0xDAA320A7
BLANK_MAGIC = -875286124        # 0xCBD43194
MAX_TOPIC_LENGTH = 127
MAX_PROPERTIES_LENGTH = 32767

# The record up to and including BODYLENGTH, both hosts IPv4: 88 bytes.
RECORD_HEAD_V4 = struct.Struct(">iiiiiqqiq8sq8siqi")
_PRE_HOSTS = struct.Struct(">iiiiiqqiq")       # 0..47: through BORNTIMESTAMP
_HEAD_V4_HOSTS = struct.Struct(">iiiiiqqiq4siq4siiqi")  # the 88-byte head with each host split into ip, port
_TAIL_FIXED = struct.Struct(">iqi")             # RECONSUMETIMES, PREPARED TX OFFSET, BODYLENGTH
_HOSTS_V6 = SysFlag.BORNHOST_V6 | SysFlag.STOREHOST_V6
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_SIZE_MAGIC = struct.Struct(">ii")
_HOST_V4 = struct.Struct(">4si")
_HOST_V6 = struct.Struct(">16si")
_BATCH_HEAD = struct.Struct(">iiiii")           # size, magic, crc, flag, body length

# Fixed field positions the store patches in place after encoding.
POS_QUEUE_ID = 12
POS_QUEUE_OFFSET = 20
POS_PHYSICAL_OFFSET = 28
POS_SYSFLAG = 36
POS_BORN_HOST = 48

# RocketMQ's TopicValidator characters: the pattern send checks, and as bytes for a stored record's TOPIC (record.py)
TOPIC_CHARS = b"%|_-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
TOPIC_PATTERN = re.compile("[" + re.escape(TOPIC_CHARS.decode()) + "]+")


class Prop:
    """Property keys (MessageConst)."""

    KEYS = "KEYS"
    TAGS = "TAGS"
    WAIT = "WAIT"
    DELAY = "DELAY"
    RETRY_TOPIC = "RETRY_TOPIC"
    REAL_TOPIC = "REAL_TOPIC"
    REAL_QID = "REAL_QID"
    TRAN_MSG = "TRAN_MSG"
    PGROUP = "PGROUP"
    UNIQ_KEY = "UNIQ_KEY"
    ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
    RECONSUME_TIME = "RECONSUME_TIME"
    MAX_RECONSUME_TIMES = "MAX_RECONSUME_TIMES"
    CLUSTER = "CLUSTER"
    TRANSACTION_CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
    CHECK_IMMUNITY_TIME_IN_SECONDS = "CHECK_IMMUNITY_TIME_IN_SECONDS"
    TRAN_PREPARED_QUEUE_OFFSET = "TRAN_PREPARED_QUEUE_OFFSET"
    MIN_OFFSET = "MIN_OFFSET"
    MAX_OFFSET = "MAX_OFFSET"
    CORRELATION_ID = "CORRELATION_ID"       # request-reply: the request a reply answers
    REPLY_TO_CLIENT = "REPLY_TO_CLIENT"     # request-reply: the client id of the requester
    TTL = "TTL"                             # request-reply: how long (ms) the requester waits
    START_DELIVER_TIME = "__STARTDELIVERTIME"   # Aliyun's timer (ali-ons setStartDeliverTime): absolute ms


# Properties asking the broker to hold a message until a time: RocketMQ 5's timers, and the one Aliyun's brokers
# honour and its clients set (ali-ons' setStartDeliverTime; Java producers migrated from Aliyun put it by hand),
# which RocketMQ 4.9.8 ignores, delivering such a message at once.
TIMER_PROPS = ("TIMER_DELIVER_MS", "TIMER_DELAY_SEC", "TIMER_DELAY_MS", Prop.START_DELIVER_TIME)


# ----------------------------------------------------------------- properties
def properties_to_string(props: dict[str, str] | None) -> str:
    if not props:
        return ""
    return "\x02".join(f"{k}\x01{v}" for k, v in props.items() if v is not None)


def separator_in(text: str | None) -> bool:
    """True when ``text`` holds a properties separator (U+0001 or U+0002) or a NUL. A header field the broker
    copies into a property must not: stored, the value would read back as more pairs than were written (a
    later pair of the same name wins), a property smuggled past every check. A NUL is refused in any stored
    properties (nul_in_properties): start-up reads one there as the zeros of a record torn by a crash."""
    return text is not None and ("\x01" in text or "\x02" in text or "\x00" in text)


def nul_in_properties(text: str | None) -> str | None:
    """Why properties holding a NUL cannot be stored, or None. Segments are zero-filled before they are
    written, so start-up takes a NUL in a record's properties for a page a crash never wrote and cuts the
    record (protocol.record.check_tail_fields). Stock clients write none (MessageDecoder joins name U+0001
    value pairs with U+0002); one only comes from a user property value holding U+0000."""
    if text is None or "\x00" not in text:
        return None
    return "the message properties hold a NUL character (U+0000), which cannot be stored"


def string_to_properties(text: str | None) -> dict[str, str]:
    """Parse a properties string the way Java does: keep pairs with a non-empty name and value."""
    props: dict[str, str] = {}
    if not text:
        return props
    for piece in text.split("\x02"):
        name, sep, value = piece.partition("\x01")
        if sep and name and value:
            props[name] = value
    return props


def _find_property(text: str, name: str) -> int:
    """Index of the pair named ``name`` in a properties string, or -1 (a name starts the string or follows U+0002)."""
    key = name + "\x01"
    i = text.find(key)
    while i > 0 and text[i - 1] != "\x02":
        i = text.find(key, i + 1)
    return i


def property_bytes(props, pair, sep=b"\x02"):
    """The value of the last pair ``pair`` (U+0002 NAME U+0001) with a non-empty value in U+0002 + a record's
    properties, or None: what string_to_properties(...).get(NAME) gives, as Java's string2messageProperties (a
    later pair overwrites, one with no value is none), without building the dict. The separators are ASCII, so
    splitting the bytes then decoding a value is decoding then splitting. A str too, with ``sep`` "\\x02"."""
    end = len(props)
    k = len(pair)
    while True:
        i = props.rfind(pair, 0, end)
        if i < 0:
            return None
        j = props.find(sep, i + k)
        if j < 0:
            j = len(props)
        if j > i + k:
            return props[i + k:j]
        end = i             # an empty value is no pair: an earlier one stands


def property_value(text: str, name: str) -> str | None:
    """The value of ``name`` in a properties string as a consumer reads it, without parsing the rest."""
    return property_bytes("\x02" + text, f"\x02{name}\x01", "\x02")


def drop_property(text: str, name: str) -> str:
    """The properties string without its first pair named ``name``."""
    i = _find_property(text, name)
    if i < 0:
        return text
    end = text.find("\x02", i)
    return text[:i] + ("" if end < 0 else text[end + 1:])


def properties_appender(extra: dict[str, str]):
    """A function ``text -> text + the pairs of extra that text does not name``, for many texts in a row.

    ``text`` is kept byte for byte, so a batch entry's own properties (its UNIQ_KEY, KEYS, TAGS) are stored
    exactly as its producer wrote them, followed by the batch-level ones (RocketMQ's batch encoder appends
    them the same way). The common case, an entry naming none of them, costs a substring test per name.
    """
    names = [(k, k + "\x01") for k in extra]
    tail = properties_to_string(extra)

    def append(text: str) -> str:
        if any(key in text for _, key in names):
            missing = {k: extra[k] for k, _ in names if _find_property(text, k) < 0}
            if not missing:
                return text
            more = properties_to_string(missing)
        else:
            more = tail
        if not text or not more:
            return text or more
        return text + more if text.endswith("\x02") else text + "\x02" + more

    return append


@functools.lru_cache(maxsize=4096)
def java_string_hash(text: str) -> int:
    """Java String.hashCode: 31*h + UTF-16 unit, signed 32-bit. The consume-queue tag code."""
    h = 0
    for unit in _utf16_units(text):
        h = (31 * h + unit) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


JAVA_TRIMMED = "".join(map(chr, range(0x21)))       # String.trim's: every char up to and including the space


def java_trim(text: str) -> str:
    """Java's String.trim: the chars up to U+0020 taken off both ends, and only those. str.strip takes others
    (U+3000, U+00A0, U+2003, U+001C..U+001F, U+0085) and leaves some (U+0000..U+0008, U+000E..U+001B)."""
    return text.strip(JAVA_TRIMMED)


def _utf16_units(text: str):
    if text.isascii():
        return text.encode("ascii")
    data = text.encode("utf-16-be", "surrogatepass")
    return struct.unpack(f">{len(data) // 2}H", data)


def tags_code(props: dict[str, str]) -> int:
    tags = props.get(Prop.TAGS)
    return java_string_hash(tags) if tags else 0


def validate_topic(topic: str | None) -> str | None:
    """None if the topic name is acceptable, else why not (RocketMQ's TopicValidator rules)."""
    if not topic:
        return "the topic name is blank"
    if len(topic) > MAX_TOPIC_LENGTH:
        return f"the topic name is {len(topic)} characters, longer than {MAX_TOPIC_LENGTH}"
    if not TOPIC_PATTERN.fullmatch(topic):
        return f"the topic name {topic!r} contains characters outside [%|a-zA-Z0-9_-]"
    return None


MAX_GROUP_LENGTH = 255          # Validators.CHARACTER_MAX_LENGTH: stock clients refuse a longer group at start
MAX_CLIENT_ID_LENGTH = 1024     # "<ip>@<instanceName>[@<unitName>]": a stock client's is far shorter


def validate_group(group: str | None, what: str = "group") -> str | None:
    """None if a producer or consumer group name may be kept, else why not: past MAX_GROUP_LENGTH, or not
    UTF-8 text (a lone surrogate, which JSON can spell "\ud800").

    The broker keeps group names (memberships, queue locks, offsets, halves' PGROUP) as clients give them, each
    table capped by count only: names of megabytes grew the broker by gigabytes; and one that is not UTF-8 made
    everything that writes it out fail (the /metrics page answered 500 while such a group was joined). Its
    characters are not checked otherwise: stock clients allow only [%|a-zA-Z0-9_-] (TopicValidator), others
    are not known to."""
    if group is None:
        return None
    if len(group) > MAX_GROUP_LENGTH:
        return f"{what} name is {len(group)} characters, longer than {MAX_GROUP_LENGTH}"
    if not text_encodes(group):
        return f"{what} name {group!r} is not UTF-8 text (it holds a lone surrogate)"
    return None


def text_encodes(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (a str from JSON may hold a lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# --------------------------------------------------------------------- hosts
def pack_host(host: str, port: int) -> bytes:
    """8 bytes for IPv4 (address + int port), 20 for IPv6."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.version == 4:
        return _HOST_V4.pack(addr.packed, port)
    return _HOST_V6.pack(addr.packed, port)


def unpack_host(raw: bytes) -> tuple[str, int]:
    if len(raw) == 8:
        ip, port = _HOST_V4.unpack(raw)
        return socket.inet_ntoa(ip), port   # same text as ipaddress, a tenth of the cost
    ip, port = _HOST_V6.unpack(raw)
    return str(ipaddress.ip_address(ip)), port


# ---------------------------------------------------------------- message ids
def offset_msg_id(store_host: bytes, physical_offset: int) -> str:
    """The 32 (IPv4) or 56 (IPv6) upper-case hex offset id of a stored record (spec 6.5)."""
    return (store_host + _I64.pack(physical_offset)).hex().upper()


def decode_offset_msg_id(msg_id: str) -> tuple[str, int, int]:
    """(host, port, commit-log offset) from an offset message id."""
    try:
        raw = bytes.fromhex(msg_id)
    except (ValueError, TypeError):
        raise HeaderError(f"offset message id {msg_id!r} is not hex") from None
    if len(raw) not in (16, 28):
        raise HeaderError(f"offset message id {msg_id!r} has {len(msg_id)} characters, not 32 or 56")
    host, port = unpack_host(raw[:-8])
    return host, port, _I64.unpack(raw[-8:])[0]


class UniqIdGenerator:
    """UNIQ_KEY ids in the Java client's layout: ip, pid, a per-process hash, ms into the month, counter.

    The time field is the wall clock's (a stock admin's queryMsgByUniqueKey looks the message up from the time
    it reads there), so a clock stepped back makes the generator visit its past milliseconds again, the counter
    (16 bits) at whatever it reached: at 10 ids a millisecond, 10 s again gave about 15 ids it had given before
    (RocketMQ's MessageClientIDSetter too), two messages with one key, and an idempotent consumer skipped the
    second as a redelivery of the first. A step back draws a new per-process hash: what follows differs from
    everything before it."""

    def __init__(self, ip: str = "127.0.0.1"):
        try:
            packed_ip = ipaddress.ip_address(ip).packed
        except ValueError:
            packed_ip = b"\x7f\x00\x00\x01"
        self._ip = packed_ip
        self._host_pid = packed_ip + struct.pack(">H", os.getpid() & 0xFFFF)
        self._new_hash()
        _GENERATORS.add(self)
        self._counter = itertools.count(int.from_bytes(os.urandom(2), "big"))
        self._month_start = 0.0
        self._next_month = 0.0
        self._last = 0.0            # the wall clock's latest reading: one ahead of now is a step back

    def _new_hash(self) -> None:
        self._prefix = self._host_pid + os.urandom(4)
        self._prefix_hex = self._prefix.hex().upper()

    def _forked(self) -> None:
        """In a forked child: its own pid and hash (the parent's copy gave the parent's ids in the same ms)."""
        self._host_pid = self._ip + struct.pack(">H", os.getpid() & 0xFFFF)
        self._new_hash()
        self._counter = itertools.count(int.from_bytes(os.urandom(2), "big"))

    def _roll_month(self, now: float) -> None:
        t = time.localtime(now)
        start = time.mktime((t.tm_year, t.tm_mon, 1, 0, 0, 0, 0, 0, -1))
        year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
        self._month_start = start
        self._next_month = time.mktime((year, month, 1, 0, 0, 0, 0, 0, -1))

    def next(self) -> str:
        now = time.time()
        if now < self._last:        # stepped back: its milliseconds again, with a hash of their own
            self._new_hash()
            if now < self._month_start:
                self._next_month = now      # back into the month before: its start, not a negative time
        self._last = now
        if now >= self._next_month:
            self._roll_month(now)
        # one format: the same 32 hex digits as hex() of prefix + pack(">IH", ms, counter), in a third of the time
        return "%s%08X%04X" % (self._prefix_hex, int((now - self._month_start) * 1000) & 0xFFFFFFFF,
                               next(self._counter) & 0xFFFF)


# Every generator, for a fork: a producer made before one (a pre-fork server, multiprocessing's fork start method)
# was copied whole into the child, pid, hash and counter, and both gave the same UNIQ_KEYs in one millisecond.
_GENERATORS: "weakref.WeakSet[UniqIdGenerator]" = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [gen._forked() for gen in list(_GENERATORS)])


# -------------------------------------------------------------------- records
def body_crc(body) -> int:
    return zlib.crc32(body) & 0x7FFFFFFF


def record_size(body_len: int, topic_len: int, props_len: int, sys_flag: int = 0) -> int:
    size = 91 + body_len + topic_len + props_len
    if sys_flag & SysFlag.BORNHOST_V6:
        size += 12
    if sys_flag & SysFlag.STOREHOST_V6:
        size += 12
    return size


def store_timestamp_pos(sys_flag: int) -> int:
    return 68 if sys_flag & SysFlag.BORNHOST_V6 else 56


def encode_record(*, topic: bytes, body: bytes, queue_id: int, flag: int, sys_flag: int,
                  born_timestamp: int, born_host: bytes, store_host: bytes, properties: bytes,
                  queue_offset: int = 0, physical_offset: int = 0, store_timestamp: int = 0,
                  reconsume_times: int = 0, prepared_offset: int = 0, crc: int | None = None) -> bytearray:
    """One store record. Hosts are packed (pack_host); the v6 sysFlag bits follow their lengths."""
    topic_len = len(topic)
    props_len = len(properties)
    if topic_len > MAX_TOPIC_LENGTH:
        raise RecordError(f"topic of {topic_len} bytes is longer than {MAX_TOPIC_LENGTH}")
    if props_len > MAX_PROPERTIES_LENGTH:
        raise RecordError(f"properties of {props_len} bytes are longer than {MAX_PROPERTIES_LENGTH}")
    sys_flag &= ~(SysFlag.BORNHOST_V6 | SysFlag.STOREHOST_V6)
    if len(born_host) == 20:
        sys_flag |= SysFlag.BORNHOST_V6
    if len(store_host) == 20:
        sys_flag |= SysFlag.STOREHOST_V6
    body_len = len(body)
    total = 91 + body_len + topic_len + props_len + (len(born_host) - 8) + (len(store_host) - 8)
    if crc is None:
        crc = zlib.crc32(body) & 0x7FFFFFFF
    if len(born_host) == 8 and len(store_host) == 8:
        head = RECORD_HEAD_V4.pack(total, MESSAGE_MAGIC, crc, queue_id, flag, queue_offset, physical_offset,
                                   sys_flag, born_timestamp, born_host, store_timestamp, store_host,
                                   reconsume_times, prepared_offset, body_len)
    else:
        head = b"".join((
            _PRE_HOSTS.pack(total, MESSAGE_MAGIC, crc, queue_id, flag, queue_offset, physical_offset, sys_flag,
                            born_timestamp),
            born_host, _I64.pack(store_timestamp), store_host,
            struct.pack(">iqi", reconsume_times, prepared_offset, body_len)))
    out = bytearray(head)
    out += body
    out.append(topic_len)
    out += topic
    out += _I16.pack(props_len)
    out += properties
    return out


_EXT_FIELDS = ("topic", "body", "queue_id", "flag", "queue_offset", "physical_offset", "sys_flag", "born_timestamp",
               "born_host", "store_timestamp", "store_host", "reconsume_times", "prepared_offset", "properties",
               "body_crc", "store_size")


class MessageExt:
    """A decoded store record.

    ``properties`` is a dict; a record decoded by ``decode_records`` keeps its properties' text
    and splits it on first use (a consumer that reads only bodies never pays for the dict).
    Compared, printed and pickled field by field, as the dataclass it was.
    """

    # The fields, with ``properties`` held as the dict (or None) and the text not split yet.
    __slots__ = tuple("_props" if name == "properties" else name for name in _EXT_FIELDS) + ("_props_text",)

    def __init__(self, topic: str, body: bytes, queue_id: int = 0, flag: int = 0, queue_offset: int = 0,
                 physical_offset: int = 0, sys_flag: int = 0, born_timestamp: int = 0,
                 born_host: tuple[str, int] = ("127.0.0.1", 0), store_timestamp: int = 0,
                 store_host: tuple[str, int] = ("127.0.0.1", 0), reconsume_times: int = 0,
                 prepared_offset: int = 0, properties: dict[str, str] | None = None, body_crc: int = 0,
                 store_size: int = 0, properties_text: str | None = None):
        self.topic = topic
        self.body = body
        self.queue_id = queue_id
        self.flag = flag
        self.queue_offset = queue_offset
        self.physical_offset = physical_offset
        self.sys_flag = sys_flag
        self.born_timestamp = born_timestamp
        self.born_host = born_host
        self.store_timestamp = store_timestamp
        self.store_host = store_host
        self.reconsume_times = reconsume_times
        self.prepared_offset = prepared_offset
        self._props = properties if properties is not None or properties_text is not None else {}
        self.body_crc = body_crc
        self.store_size = store_size
        self._props_text = properties_text

    @property
    def properties(self) -> dict[str, str]:
        props = self._props
        if props is None:
            text = self._props_text
            if text is None:    # another thread's first read split it since ours found nothing: take its dict
                return self._props
            props = self._props = string_to_properties(text)
            self._props_text = None
        return props

    @properties.setter
    def properties(self, value: dict[str, str]) -> None:
        self._props = value
        self._props_text = None

    def _fields(self) -> tuple:
        return tuple(getattr(self, name) for name in _EXT_FIELDS)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None

    def __repr__(self) -> str:
        return "MessageExt(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in _EXT_FIELDS) + ")"

    def __getstate__(self):
        return self._fields()

    def __setstate__(self, state) -> None:
        self.__init__(*state)

    @property
    def tags(self) -> str | None:
        return self.properties.get(Prop.TAGS)

    @property
    def keys(self) -> str | None:
        return self.properties.get(Prop.KEYS)

    @property
    def offset_msg_id(self) -> str:
        return offset_msg_id(pack_host(*self.store_host), self.physical_offset)

    @property
    def msg_id(self) -> str:
        """What a Java client calls getMsgId(): UNIQ_KEY, else the offset id."""
        return self.properties.get(Prop.UNIQ_KEY) or self.offset_msg_id

    def encode(self) -> bytearray:
        return encode_record(
            topic=self.topic.encode(), body=self.body, queue_id=self.queue_id, flag=self.flag,
            sys_flag=self.sys_flag, born_timestamp=self.born_timestamp, born_host=pack_host(*self.born_host),
            store_host=pack_host(*self.store_host), properties=properties_to_string(self.properties).encode(),
            queue_offset=self.queue_offset, physical_offset=self.physical_offset,
            store_timestamp=self.store_timestamp, reconsume_times=self.reconsume_times,
            prepared_offset=self.prepared_offset)


def peek_record(buf, pos: int = 0) -> tuple[int, int]:
    """(TOTALSIZE, MAGIC) at pos; RecordError if fewer than 8 bytes remain."""
    if pos < 0 or len(buf) - pos < 8:
        raise RecordError(f"record header at {pos} is cut short")
    return _SIZE_MAGIC.unpack_from(buf, pos)


def decode_record(buf, pos: int = 0, *, check_crc: bool = False) -> tuple[MessageExt, int]:
    """Decode the record at ``pos``; returns (message, TOTALSIZE). Bounds and layout are checked."""
    end = len(buf)
    if pos < 0 or end - pos < 91:
        raise RecordError(f"record at {pos} is cut short: {max(end - pos, 0)} bytes, the minimum is 91")
    # One unpack reads the whole head when both hosts are IPv4 (the usual case);
    # the fields from BORNHOST on are read again below when either is IPv6.
    (total, magic, crc, queue_id, flag, queue_offset, physical_offset, sys_flag, born_ts, born_ip, born_port,
     store_ts, store_ip, store_port, reconsume, prepared, body_len) = _HEAD_V4_HOSTS.unpack_from(buf, pos)
    if magic != MESSAGE_MAGIC:
        raise RecordError(f"record at {pos} has magic {magic & 0xFFFFFFFF:#010x}, not {MESSAGE_MAGIC & 0xFFFFFFFF:#010x}")
    if total < 91 or total > end - pos:
        raise RecordError(f"record at {pos} claims {total} bytes; {end - pos} are available")
    limit = pos + total
    if not sys_flag & _HOSTS_V6:
        born_host = (socket.inet_ntoa(born_ip), born_port)
        store_host = (socket.inet_ntoa(store_ip), store_port)
        p = pos + 88
    else:
        p = pos + 48
        bh_len = 20 if sys_flag & SysFlag.BORNHOST_V6 else 8
        sh_len = 20 if sys_flag & SysFlag.STOREHOST_V6 else 8
        if p + bh_len + 8 + sh_len + 16 > limit:
            raise RecordError(f"record at {pos} is too short for its hosts")
        born_host = unpack_host(bytes(buf[p:p + bh_len]))
        p += bh_len
        (store_ts,) = _I64.unpack_from(buf, p)
        p += 8
        store_host = unpack_host(bytes(buf[p:p + sh_len]))
        p += sh_len
        reconsume, prepared, body_len = _TAIL_FIXED.unpack_from(buf, p)
        p += 16
    if body_len < 0 or p + body_len + 3 > limit:
        raise RecordError(f"record at {pos}: body length {body_len} runs past the record's {total} bytes")
    body = bytes(buf[p:p + body_len])
    p += body_len
    topic_len = buf[p]
    p += 1
    if topic_len > MAX_TOPIC_LENGTH or p + topic_len + 2 > limit:
        raise RecordError(f"record at {pos}: topic length {topic_len} runs past the record")
    try:
        topic = str(buf[p:p + topic_len], "utf-8")
    except UnicodeDecodeError:
        raise RecordError(f"record at {pos}: topic is not UTF-8") from None
    p += topic_len
    (props_len,) = _I16.unpack_from(buf, p)
    p += 2
    if props_len < 0 or p + props_len != limit:
        raise RecordError(f"record at {pos}: properties length {props_len} does not end the record")
    try:
        props = string_to_properties(str(buf[p:p + props_len], "utf-8"))
    except UnicodeDecodeError:
        raise RecordError(f"record at {pos}: properties are not UTF-8") from None
    if check_crc and (zlib.crc32(body) & 0x7FFFFFFF) != crc:
        raise RecordError(f"record at {pos}: body CRC mismatch")
    msg = MessageExt(topic, body, queue_id, flag, queue_offset, physical_offset, sys_flag, born_ts, born_host,
                     store_ts, store_host, reconsume, prepared, props, crc, total)
    return msg, total


def _sys_flag_and_host_extra(buf) -> tuple[int, int]:
    """The record's SYSFLAG, and how far its fields after the hosts move: 12 bytes for each IPv6 host."""
    (sys_flag,) = _I32.unpack_from(buf, POS_SYSFLAG)
    return sys_flag, (12 if sys_flag & SysFlag.BORNHOST_V6 else 0) + (12 if sys_flag & SysFlag.STOREHOST_V6 else 0)


def record_body_length(buf) -> int:
    """BODYLENGTH of the whole record in ``buf`` (at most a few header bytes read, the body not copied)."""
    return _I32.unpack_from(buf, 84 + _sys_flag_and_host_extra(buf)[1])[0]


def retopic_record(buf, *, topic: bytes, queue_id: int, transaction_type: int, prepared_offset: int,
                   drop_last: bytes | None = None) -> bytearray:
    """A copy of one whole stored record moved to another topic and queue.

    Body, flag, born time and host, reconsume times and the properties bytes are kept as
    they are; the transaction type and prepared offset are set; queue offset, physical
    offset and store timestamp are zeroed for the store's writer to fill. This is how a
    committed message is made from its half without decoding and re-encoding it.

    ``drop_last``: a property name; when the properties end with that property (and there is
    another before it), it is left out. The properties are the record's last field, so that
    costs a search of their last pair, not a re-encoding (the broker's own mark on a half).
    """
    n = len(buf)
    total, magic = peek_record(buf, 0)
    if magic != MESSAGE_MAGIC or total != n or n < 91:
        raise RecordError(f"not one whole record: {n} bytes, TOTALSIZE {total}")
    old_sys, extra = _sys_flag_and_host_extra(buf)
    body_len_pos = 84 + extra
    (body_len,) = _I32.unpack_from(buf, body_len_pos)
    body_end = body_len_pos + 4 + body_len
    if body_len < 0 or body_end + 3 > n or len(topic) > MAX_TOPIC_LENGTH:
        raise RecordError("record body or topic runs past the record")
    props_start = body_end + 1 + buf[body_end]
    if props_start + 2 > n:
        raise RecordError("record topic runs past the record")
    out = bytearray(buf[:body_end])
    out.append(len(topic))
    out += topic
    props_at = len(out)             # PROPERTIESLENGTH in ``out``
    out += buf[props_start:n]
    if drop_last is not None:       # searched in the copy made anyway: no second copy of the properties
        cut = out.rfind(b"\x02", props_at + 2)
        if cut >= 0 and out.startswith(drop_last + b"\x01", cut + 1):
            del out[cut:]
            _I16.pack_into(out, props_at, len(out) - props_at - 2)
    _I32.pack_into(out, 0, len(out))
    _I32.pack_into(out, 12, queue_id)
    _I64.pack_into(out, POS_QUEUE_OFFSET, 0)
    _I64.pack_into(out, POS_PHYSICAL_OFFSET, 0)
    _I32.pack_into(out, POS_SYSFLAG, SysFlag.with_transaction_type(old_sys, transaction_type))
    _I64.pack_into(out, store_timestamp_pos(old_sys), 0)
    _I64.pack_into(out, 76 + extra, prepared_offset)
    return out


# The largest body ``inflate`` gives by default. A stock RocketMQ producer (DefaultMQProducerImpl) compresses a
# body only after Validators.checkMessage has held it to maxMessageSize (4 MiB by default), so a body its
# producer compressed inflates to at most that; four times it leaves room for producers configured larger,
# and is the largest frame a broker takes. Past it the body is a zip bomb or a mistake, not a message.
MAX_INFLATED_BODY = 16 * 1024 * 1024


def inflate(msg: MessageExt, max_size: int = MAX_INFLATED_BODY) -> str | None:
    """Give ``msg`` the body its producer sent: Java and Go producers zlib-compress bodies over 4 KiB and set
    sysFlag COMPRESSED, and a broker keeps them so (RocketMQ's client inflates them, MessageDecoder). None
    when done (the COMPRESSED bit is then cleared: the body is no longer compressed) or not compressed; else
    why the body was left as stored, COMPRESSED still set: it does not inflate, or it inflates past
    ``max_size`` bytes. Inflation stops at ``max_size`` + 1 bytes, so a small hostile body
    (a zip bomb: 1 MiB of deflated zeros is 1 GiB) costs at most about that much memory, never its whole."""
    if not msg.sys_flag & SysFlag.COMPRESSED:
        return None
    inflater = zlib.decompressobj()
    try:
        # max_length bounds the output (zlib grows it as it goes); input left over waits in unconsumed_tail
        body = inflater.decompress(msg.body, max_size + 1)
    except zlib.error as exc:
        return f"its body is marked compressed but does not inflate ({exc})"
    if len(body) > max_size:
        return f"its body is marked compressed and inflates past {max_size} bytes (max_inflated_body)"
    if not inflater.eof:        # bytes after the stream's end are ignored, as zlib.decompress did
        return "its body is marked compressed but does not inflate (its zlib stream is cut short)"
    msg.body = body
    msg.sys_flag &= ~SysFlag.COMPRESSED
    return None


def decode_records(buf) -> list[MessageExt]:
    """Every record of a pull / query body, in order.

    The same messages decode_record gives at each record, for less: the usual record (IPv4 hosts,
    UTF-8 topic and properties) is decoded inline, its hosts' tuples and topic string shared with the
    records before it that have the same, its properties' text split only when first asked for; any
    other record, a malformed one included (for its error), goes to decode_record.
    """
    if not isinstance(buf, bytes):
        buf = bytes(buf)
    out = []
    append = out.append
    unpack_head = _HEAD_V4_HOSTS.unpack_from
    unpack_i16 = _I16.unpack_from
    inet_ntoa = socket.inet_ntoa
    born_key = store_key = raw_topic = None
    pos = 0
    end = len(buf)
    while pos < end:
        if end - pos >= 91:
            (total, magic, crc, queue_id, flag, queue_offset, physical_offset, sys_flag, born_ts, born_ip, born_port,
             store_ts, store_ip, store_port, reconsume, prepared, body_len) = unpack_head(buf, pos)
            limit = pos + total
            p = pos + 88 + body_len
            if (magic == MESSAGE_MAGIC and total >= 91 and limit <= end and not sys_flag & _HOSTS_V6
                    and body_len >= 0 and p + 3 <= limit):
                t_end = p + 1 + buf[p]
                if buf[p] <= MAX_TOPIC_LENGTH and t_end + 2 <= limit and unpack_i16(buf, t_end)[0] == limit - t_end - 2:
                    try:
                        if buf[p + 1:t_end] != raw_topic:
                            topic = buf[p + 1:t_end].decode()
                            raw_topic = buf[p + 1:t_end]
                        text = buf[t_end + 2:limit].decode()
                    except UnicodeDecodeError:
                        text = None
                    if text is not None:
                        if born_key != (born_ip, born_port):
                            born_key = (born_ip, born_port)
                            born_host = (inet_ntoa(born_ip), born_port)
                        if store_key != (store_ip, store_port):
                            store_key = (store_ip, store_port)
                            store_host = (inet_ntoa(store_ip), store_port)
                        append(MessageExt(topic, buf[pos + 88:p], queue_id, flag, queue_offset, physical_offset,
                                          sys_flag, born_ts, born_host, store_ts, store_host, reconsume, prepared,
                                          None, crc, total, text))
                        pos = limit
                        continue
        msg, total = decode_record(buf, pos)
        append(msg)
        pos += total
    return out


# --------------------------------------------------------------------- batch
def encode_batch(entries: list[tuple[int, bytes, str]]) -> bytes:
    """SEND_BATCH_MESSAGE body from (flag, body, properties string) entries."""
    out = bytearray()
    for i, (flag, body, props) in enumerate(entries):
        p = props.encode()
        if len(p) > MAX_PROPERTIES_LENGTH:      # the entry's length field is a short: refused, not a struct.error
            raise MessageIllegalError(f"message {i} of the batch not sent: its properties are {len(p)} bytes, "
                                      f"more than {MAX_PROPERTIES_LENGTH}")
        out += _BATCH_HEAD.pack(20 + len(body) + 2 + len(p), 0, 0, flag, len(body))
        out += body
        out += _I16.pack(len(p))
        out += p
    return bytes(out)


def batch_entries_past(buf, limit: int) -> bool:
    """Whether the batch body ``buf`` holds more than ``limit`` entries, read from their TOTALSIZE fields only
    (at most ``limit`` + 1 of them; a body too short to hold ``limit`` + 1 entries is not read at all). A body that
    is not a batch is left to the batch's decoder to refuse."""
    if len(buf) < 22 * (limit + 1):
        return False
    pos, end, n = 0, len(buf), 0
    unpack = _I32.unpack_from
    while pos + 4 <= end:
        n += 1
        if n > limit:
            return True
        size = unpack(buf, pos)[0]
        if size < 22:
            return False
        pos += size
    return False


def decode_batch(buf) -> list[tuple[int, bytes, str]]:
    """(flag, body, properties string) for each entry of a batch body."""
    entries = []
    pos = 0
    end = len(buf)
    while pos < end:
        if end - pos < 22:
            raise RecordError(f"batch entry at {pos} is cut short")
        size, _magic, _crc, flag, body_len = _BATCH_HEAD.unpack_from(buf, pos)
        if size < 22 or pos + size > end:
            raise RecordError(f"batch entry at {pos} claims {size} bytes; {end - pos} are available")
        if body_len < 0 or 20 + body_len + 2 > size:
            raise RecordError(f"batch entry at {pos}: body length {body_len} runs past the entry")
        body = bytes(buf[pos + 20:pos + 20 + body_len])
        (props_len,) = _I16.unpack_from(buf, pos + 20 + body_len)
        if props_len < 0 or 22 + body_len + props_len != size:
            raise RecordError(f"batch entry at {pos}: properties length {props_len} does not end the entry")
        start = pos + 22 + body_len
        try:
            props = bytes(buf[start:start + props_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise RecordError(f"batch entry at {pos}: properties are not UTF-8") from None
        entries.append((flag, body, props))
        pos += size
    return entries


# TIMER_ covers RocketMQ 5's timer names; Aliyun's __STARTDELIVERTIME (one of TIMER_PROPS too) does not contain it.
_BATCH_SLOW_MARKS = (b"DELAY\x01", b"TRAN_MSG\x01", b"TIMER_", Prop.START_DELIVER_TIME.encode() + b"\x01")
_WAIT_KEY = b"WAIT\x01"
_TAGS_KEY = b"TAGS\x01"
_TAGS_PAIR = b"\x02" + _TAGS_KEY
_tag_codes: dict[bytes, int] = {}


def encode_batch_records(buf, *, topic: bytes, queue_id: int, sys_flag: int, born_timestamp: int,
                         born_host: bytes, store_host: bytes, extra: dict[str, str]):
    """The store records of a whole SEND_BATCH_MESSAGE body in one pass, or None for the uncommon batch.

    Returns (records, sizes, tag codes, body bytes): the records back to back in one bytearray, each exactly what
    ``encode_record`` makes of the entry (queue/physical offsets and store timestamp zero) whose properties are
    the entry's own bytes followed by the pairs of ``extra`` (as ``properties_appender(extra)`` appends them),
    and each record's consume-queue tag code (Java hash of its TAGS, 0 without). The properties are not parsed
    or re-joined: an entry is copied as it came.

    None -- the caller then takes the general path (``decode_batch``, the per-entry checks, ``encode_record``),
    which gives the same records or the same error -- when anything is out of the ordinary: a malformed or
    empty body, an entry naming DELAY, TRAN_MSG, TIMER_*, __STARTDELIVERTIME or any name of ``extra``,
    properties that are not ASCII, too long or hold a NUL, IPv6 hosts, a long topic, an empty ``extra``. An
    entry's WAIT pair (a Java producer's every message names it) is dropped as the general path drops it
    (``drop_property``).
    """
    if len(born_host) != 8 or len(store_host) != 8 or len(topic) > MAX_TOPIC_LENGTH or not extra:
        return None
    tail = properties_to_string(extra).encode()
    marks = _BATCH_SLOW_MARKS + tuple(k.encode() + b"\x01" for k in extra)
    sys_flag &= ~(SysFlag.BORNHOST_V6 | SysFlag.STOREHOST_V6)
    topic_part = bytes((len(topic),)) + topic
    fixed = 91 + len(topic)
    head = RECORD_HEAD_V4.pack
    unpack_entry = _BATCH_HEAD.unpack_from
    unpack_i16 = _I16.unpack_from
    pack_i16 = _I16.pack
    crc32 = zlib.crc32
    codes = _tag_codes
    view = memoryview(buf)
    entries = []
    pos = 0
    end = len(buf)
    while pos < end:                    # the entries: checked as decode_batch checks them
        if end - pos < 22:
            return None
        size, _magic, _crc, flag, body_len = unpack_entry(buf, pos)
        if size < 22 or pos + size > end or body_len < 0 or 22 + body_len > size:
            return None
        props_at = pos + 22 + body_len
        (props_len,) = unpack_i16(buf, props_at - 2)
        if props_len < 0 or 22 + body_len + props_len != size:
            return None
        entries.append((flag, pos + 20, body_len, bytes(view[props_at:props_at + props_len])))
        pos += size
    if not entries:
        return None
    every = b"\x00".join([e[3] for e in entries])     # one search per mark for the whole batch
    if not every.isascii() or every.count(b"\x00") >= len(entries):    # a NUL of an entry's own: refused there
        return None
    for mark in marks:
        if mark in every:
            return None
    wait = _WAIT_KEY in every
    parts = []
    extend = parts.extend
    sizes = []
    tags = []
    bodies = 0
    for flag, body_at, body_len, props in entries:
        if wait and _WAIT_KEY in props:     # drop_property(text, "WAIT"): the first pair of that name
            i = props.find(_WAIT_KEY)
            while i > 0 and props[i - 1] != 2:
                i = props.find(_WAIT_KEY, i + 1)
            if i >= 0:
                j = props.find(b"\x02", i)
                props = props[:i] + (b"" if j < 0 else props[j + 1:])
        if not props:
            props = tail
        elif props[-1] == 2:
            props += tail
        else:
            props += b"\x02" + tail
        n = len(props)
        if n > MAX_PROPERTIES_LENGTH:
            return None
        body = view[body_at:body_at + body_len]
        total = fixed + body_len + n
        extend((head(total, MESSAGE_MAGIC, crc32(body) & 0x7FFFFFFF, queue_id, flag, 0, 0, sys_flag,
                      born_timestamp, born_host, 0, store_host, 0, 0, body_len),
                body, topic_part, pack_i16(n), props))
        sizes.append(total)
        bodies += body_len
        # The pair every consumer reads, the last with a value (the first was filtered on): the last one found,
        # when it is a whole pair with a value (but in a hand-built batch, always); else property_bytes finds it.
        i = props.rfind(_TAGS_KEY)
        if i < 0:
            tags.append(0)
            continue
        j = props.find(b"\x02", i + 5)
        value = props[i + 5:] if j < 0 else props[i + 5:j]
        if not value or i and props[i - 1] != 2:
            value = property_bytes(b"\x02" + props, _TAGS_PAIR)
            if value is None:
                tags.append(0)
                continue
        code = codes.get(value)
        if code is None:
            code = java_string_hash(value.decode())
            if len(codes) < 4096:
                codes[value] = code
        tags.append(code)
    out = bytearray().join(parts)
    if not sizes:
        return None
    return out, sizes, tags, bodies


# --------------------------------------------------------------- send header
_V2_KEYS = {"a": "producerGroup", "b": "topic", "c": "defaultTopic", "d": "defaultTopicQueueNums",
            "e": "queueId", "f": "sysFlag", "g": "bornTimestamp", "h": "flag", "i": "properties",
            "j": "reconsumeTimes", "k": "unitMode", "l": "maxReconsumeTimes", "m": "batch", "n": "bname"}
_V1_TO_V2 = {v: k for k, v in _V2_KEYS.items()}


# (V1 key, V2 key, kind: "s" text / "b" boolean / int bits, required, default), in field order.
_SEND_FIELDS = (
    ("producerGroup", "a", "s", True, None), ("topic", "b", "s", True, None),
    ("defaultTopic", "c", "s", False, "TBW102"), ("defaultTopicQueueNums", "d", 32, False, 4),
    ("queueId", "e", 32, True, None), ("sysFlag", "f", 32, True, None), ("bornTimestamp", "g", 64, True, None),
    ("flag", "h", 32, True, None), ("properties", "i", "s", False, ""), ("reconsumeTimes", "j", 32, False, 0),
    ("unitMode", "k", "b", False, False), ("maxReconsumeTimes", "l", 32, False, None),
    ("batch", "m", "b", False, False), ("bname", "n", "s", False, None),
)
_SEND_KEYS_V1 = tuple(f[0] for f in _SEND_FIELDS)
_SEND_KEYS_V2 = tuple(f[1] for f in _SEND_FIELDS)
_I32_LO, _I32_HI, _I64_LO, _I64_HI = -(1 << 31), 1 << 31, -(1 << 63), 1 << 63
_PLAIN_BOOL = {"true": True, "false": False, "1": True, "0": False, "": False, None: False}


def _send_header_fast(cls, ext, keys):
    """SendMessageRequestHeader from ext fields that need no check, or None (or an exception) to say
    "decide with the checked pass": never a value the checked pass would not give. Absent means
    ``None or ""`` there, spelled the same here (a hand-made command may hold non-strings)."""
    a, b, c, d, e, f, g, h, i, j, k, l, m, n = keys
    get = ext.get
    group = get(a)
    topic = get(b)
    if group is None or group == "" or topic is None or topic == "":
        return None
    default_topic = get(c)
    if default_topic is None or default_topic == "":
        default_topic = "TBW102"
    nums = get(d)
    nums = 4 if nums is None or nums == "" else int(nums)
    queue_id = int(ext[e])        # required: a KeyError, or int("")'s ValueError, means "check"
    sys_flag = int(ext[f])
    born = int(ext[g])
    flag = int(ext[h])
    properties = get(i)
    if properties is None:
        properties = ""
    reconsume = get(j)
    reconsume = 0 if reconsume is None or reconsume == "" else int(reconsume)
    unit = _PLAIN_BOOL[get(k)]    # anything but these exact spellings: a KeyError, "check"
    max_reconsume = get(l)
    max_reconsume = None if max_reconsume is None or max_reconsume == "" else int(max_reconsume)
    batch = _PLAIN_BOOL[get(m)]
    bname = get(n)
    if bname == "":
        bname = None
    if not (_I32_LO <= nums < _I32_HI and _I32_LO <= queue_id < _I32_HI and _I32_LO <= sys_flag < _I32_HI
            and _I64_LO <= born < _I64_HI and _I32_LO <= flag < _I32_HI and _I32_LO <= reconsume < _I32_HI
            and (max_reconsume is None or _I32_LO <= max_reconsume < _I32_HI)):
        return None
    return cls(group, topic, default_topic, nums, queue_id, sys_flag, born, flag, properties, reconsume, unit,
               max_reconsume, batch, bname)


@dataclass(slots=True)
class SendMessageRequestHeader:
    """SEND_MESSAGE (long keys) and SEND_MESSAGE_V2 / SEND_BATCH_MESSAGE (one-letter keys)."""

    producer_group: str
    topic: str
    default_topic: str = "TBW102"
    default_topic_queue_nums: int = 4
    queue_id: int = -1
    sys_flag: int = 0
    born_timestamp: int = 0
    flag: int = 0
    properties: str = ""
    reconsume_times: int = 0
    unit_mode: bool = False
    max_reconsume_times: int | None = None
    batch: bool = False
    bname: str | None = None

    @classmethod
    def from_command(cls, cmd) -> "SendMessageRequestHeader":
        # This runs for every message the broker stores. First one straight-line pass that
        # takes the header only if every field is well formed (a real producer's); any doubt
        # (missing, empty, not a number, out of range, an unusual boolean) and the checked
        # table-driven pass below decides, value and error alike.
        ext = cmd.ext_fields
        # SEND_MESSAGE_V2, SEND_BATCH_MESSAGE, SEND_REPLY_MESSAGE_V2
        v2 = (cmd.code == 310 or cmd.code == 320 or cmd.code == 325) and "b" in ext
        try:
            header = _send_header_fast(cls, ext, _SEND_KEYS_V2 if v2 else _SEND_KEYS_V1)
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError):  # int(inf): check
            header = None
        if header is not None:
            return header
        return cls._from_command_checked(ext, v2)

    @classmethod
    def _from_command_checked(cls, ext, v2: bool) -> "SendMessageRequestHeader":
        """The table-driven decode, with every check and its error; from_command's reference."""
        values = []
        append = values.append
        for long, short, kind, required, default in _SEND_FIELDS:
            value = ext.get(short if v2 else long)
            if value is None or value == "":
                if required:
                    raise HeaderError(f"the send header field {long} is missing")
                append(default)
            elif kind == "s":
                append(value)
            elif kind == "b":
                append(value.strip().lower() in ("true", "1"))
            else:
                try:
                    number = int(value)
                except ValueError:
                    raise HeaderError(f"the send header field {long}={value!r} is not an integer") from None
                # Java parses these as Integer / Long; anything wider cannot be stored in a record.
                if not -(1 << (kind - 1)) <= number < (1 << (kind - 1)):
                    raise HeaderError(f"the send header field {long}={value!r} is out of range")
                append(number)
        return cls(*values)

    def to_ext_fields(self, v2: bool = True) -> dict[str, str]:
        fields = {
            "producerGroup": self.producer_group, "topic": self.topic, "defaultTopic": self.default_topic,
            "defaultTopicQueueNums": str(self.default_topic_queue_nums), "queueId": str(self.queue_id),
            "sysFlag": str(self.sys_flag), "bornTimestamp": str(self.born_timestamp), "flag": str(self.flag),
            "properties": self.properties, "reconsumeTimes": str(self.reconsume_times),
            "unitMode": "true" if self.unit_mode else "false", "batch": "true" if self.batch else "false",
        }
        if self.max_reconsume_times is not None:
            fields["maxReconsumeTimes"] = str(self.max_reconsume_times)
        if self.bname:
            fields["bname"] = self.bname
        if v2:
            return {_V1_TO_V2[k]: v for k, v in fields.items()}
        return fields


# The response codes a store outcome maps to (spec 3.4 step 10); here so clients share them.
STORED_NOT_OK_CODES = (ResponseCode.FLUSH_DISK_TIMEOUT, ResponseCode.SLAVE_NOT_AVAILABLE,
                       ResponseCode.FLUSH_SLAVE_TIMEOUT)
