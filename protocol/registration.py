"""REGISTER_BROKER (103) / UNREGISTER_BROKER (104): what a RocketMQ 4.9.x broker sends its name servers.

Request header (RegisterBrokerRequestHeader, all strings on the wire):

| key            | meaning                                                            |
|----------------|--------------------------------------------------------------------|
| brokerName     | the broker set (master and slaves share it)                        |
| brokerAddr     | ``ip:port`` clients reach the broker at                            |
| clusterName    | the cluster                                                        |
| haServerAddr   | ``ip:port`` of the master's HA listener                            |
| brokerId       | 0 master, 1+ slave                                                 |
| compressed     | ``true``: the body is the deflated form below                      |
| bodyCrc32      | CRC32 of the body bytes masked to 31 bits; 0: not checked          |

UNREGISTER_BROKER carries brokerName, brokerAddr, clusterName, brokerId and no body.

Body, plain form: RegisterBrokerBody as fastjson writes it (keys sorted)::

    {"filterServerList":[],"topicConfigSerializeWrapper":{"dataVersion":{"counter":N,"timestamp":MS},
     "topicConfigTable":{"<topic>":{"order":false,"perm":6,"readQueueNums":4,"topicFilterType":"SINGLE_TAG",
     "topicName":"<topic>","topicSysFlag":0,"writeQueueNums":4},...}}}

Body, compressed form: zlib (Deflater, best compression) of a run of big-endian
int32-length-prefixed chunks:

| chunk                         | content                                                    |
|-------------------------------|------------------------------------------------------------|
| len + DataVersion JSON        | ``{"counter":N,"timestamp":MS}``                           |
| int32 topic count             | no length prefix                                           |
| per topic: len + text         | ``name readQueueNums writeQueueNums perm topicFilterType`` |
| len + filter-server JSON list | ``[]``                                                     |

The compressed form loses ``topicSysFlag`` and ``order`` (TopicConfig.encode
writes five fields); decoding gives them their defaults, as Java does.

Response: SUCCESS with header ``masterAddr`` and ``haServerAddr`` (set only for
a slave whose master is registered), body the name server's ORDER_TOPIC_CONFIG
key-value table or none; a body whose CRC does not match is answered
SYSTEM_ERROR ``crc32 not match``.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field

from .errors import HeaderError

_INT = struct.Struct(">i")
# The compressed form's largest inflated size: twice the largest frame (what the JSON form may be), some
# 200,000 topics. Inflated whole and unbounded, 1 MB of deflated zeros from anyone who reaches the port
# became 1 GB (2 GB at the peak, 13 s with the loop blocked); the largest frame asked for 16 GB.
MAX_INFLATED_REGISTER_BODY = 32 * 1024 * 1024
DEFAULT_FILTER_TYPE = "SINGLE_TAG"


@dataclass(frozen=True, slots=True)
class RegisteredTopic:
    """One TopicConfig as a broker announces it."""

    name: str
    read_queue_nums: int
    write_queue_nums: int
    perm: int
    filter_type: str = DEFAULT_FILTER_TYPE
    sys_flag: int = 0
    order: bool = False


@dataclass(frozen=True, slots=True)
class DataVersion:
    """The version of a broker's topic table: name servers re-read the table only when it changes."""

    timestamp: int = 0
    counter: int = 0


@dataclass(slots=True)
class RegisterBrokerBody:
    topics: dict[str, RegisteredTopic] = field(default_factory=dict)
    data_version: DataVersion = field(default_factory=DataVersion)
    filter_servers: list[str] = field(default_factory=list)


def body_crc32(body: bytes | None) -> int:
    """UtilAll.crc32: zlib CRC32 masked to 31 bits (so it is never negative); 0 for no body."""
    return zlib.crc32(body) & 0x7FFFFFFF if body else 0


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _version_json(v: DataVersion) -> str:
    return f'{{"counter":{v.counter},"timestamp":{v.timestamp}}}'


def _topic_json(t: RegisteredTopic) -> str:
    return (f'{{"order":{"true" if t.order else "false"},"perm":{t.perm},"readQueueNums":{t.read_queue_nums},'
            f'"topicFilterType":{_dump(t.filter_type)},"topicName":{_dump(t.name)},"topicSysFlag":{t.sys_flag},'
            f'"writeQueueNums":{t.write_queue_nums}}}')


def encode_register_body(body: RegisterBrokerBody, *, compressed: bool = False) -> bytes:
    """The body bytes a 4.9.x broker sends (``compressed``: its ``compressedRegister`` form)."""
    if compressed:
        return _encode_compressed(body)
    table = ",".join(f"{_dump(name)}:{_topic_json(t)}" for name, t in sorted(body.topics.items()))
    return (f'{{"filterServerList":{_dump(body.filter_servers)},"topicConfigSerializeWrapper":'
            f'{{"dataVersion":{_version_json(body.data_version)},"topicConfigTable":{{{table}}}}}}}').encode()


def _chunk(data: bytes) -> bytes:
    return _INT.pack(len(data)) + data


def _encode_compressed(body: RegisterBrokerBody) -> bytes:
    parts = [_chunk(_version_json(body.data_version).encode()), _INT.pack(len(body.topics))]
    for t in body.topics.values():
        parts.append(_chunk(f"{t.name} {t.read_queue_nums} {t.write_queue_nums} {t.perm} {t.filter_type}".encode()))
    parts.append(_chunk(_dump(body.filter_servers).encode()))
    return zlib.compress(b"".join(parts), 9)


def decode_register_body(data: bytes | None, *, compressed: bool = False) -> RegisterBrokerBody:
    """Either form back to values; malformed bytes raise HeaderError (the name server answers an error)."""
    if not data:
        return RegisterBrokerBody()
    try:
        return _decode_compressed(data) if compressed else _decode_json(data)
    except HeaderError:
        raise
    except (zlib.error, struct.error, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HeaderError(f"register body does not parse: {exc}") from None


def _version(obj) -> DataVersion:
    obj = obj or {}
    return DataVersion(int(obj.get("timestamp", 0)), int(obj.get("counter", 0)))


def _topic(name: str, obj: dict) -> RegisteredTopic:
    return RegisteredTopic(obj.get("topicName") or name, int(obj.get("readQueueNums", 16)),
                           int(obj.get("writeQueueNums", 16)), int(obj.get("perm", 6)),
                           str(obj.get("topicFilterType") or DEFAULT_FILTER_TYPE), int(obj.get("topicSysFlag", 0)),
                           bool(obj.get("order", False)))


def _decode_json(data: bytes) -> RegisterBrokerBody:
    obj = json.loads(data.decode("utf-8"))
    wrapper = obj.get("topicConfigSerializeWrapper") or {}
    table = wrapper.get("topicConfigTable") or {}
    topics = {}
    for name, tc in table.items():
        t = _topic(name, tc)
        topics[t.name] = t
    return RegisterBrokerBody(topics, _version(wrapper.get("dataVersion")),
                              [str(s) for s in obj.get("filterServerList") or []])


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def int(self) -> int:
        if self.pos + 4 > len(self.data):
            raise HeaderError("register body ends inside a length")
        (n,) = _INT.unpack_from(self.data, self.pos)
        self.pos += 4
        return n

    def chunk(self) -> bytes:
        n = self.int()
        if n < 0 or self.pos + n > len(self.data):
            raise HeaderError(f"register body chunk of {n} bytes runs past the end")
        self.pos += n
        return self.data[self.pos - n:self.pos]


def _inflate(data: bytes) -> bytes:
    inflater = zlib.decompressobj()
    out = inflater.decompress(data, MAX_INFLATED_REGISTER_BODY + 1)
    if len(out) > MAX_INFLATED_REGISTER_BODY:
        raise HeaderError(f"compressed register body inflates past {MAX_INFLATED_REGISTER_BODY} bytes")
    if not inflater.eof:
        raise HeaderError("compressed register body is cut short")
    return out


def _decode_compressed(data: bytes) -> RegisterBrokerBody:
    r = _Reader(_inflate(data))
    version = _version(json.loads(r.chunk().decode("utf-8")))
    count = r.int()
    if count < 0:
        raise HeaderError(f"register body claims {count} topics")
    topics = {}
    for _ in range(count):
        fields = r.chunk().decode("utf-8").split(" ")
        if len(fields) != 5:
            raise HeaderError(f"topic config {' '.join(fields)!r} does not have 5 fields")
        name, read, write, perm, filter_type = fields
        topics[name] = RegisteredTopic(name, int(read), int(write), int(perm), filter_type)
    servers = json.loads(r.chunk().decode("utf-8")) or []
    return RegisterBrokerBody(topics, version, [str(s) for s in servers])


def register_header(*, broker_name: str, broker_addr: str, cluster_name: str, ha_server_addr: str,
                    broker_id: int, compressed: bool, body: bytes) -> dict[str, str]:
    """The ext fields of a REGISTER_BROKER request carrying ``body``."""
    return {"brokerName": broker_name, "brokerAddr": broker_addr, "clusterName": cluster_name,
            "haServerAddr": ha_server_addr, "brokerId": str(broker_id),
            "compressed": "true" if compressed else "false", "bodyCrc32": str(body_crc32(body))}


def unregister_header(*, broker_name: str, broker_addr: str, cluster_name: str, broker_id: int) -> dict[str, str]:
    return {"brokerName": broker_name, "brokerAddr": broker_addr, "clusterName": cluster_name,
            "brokerId": str(broker_id)}
