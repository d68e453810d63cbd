"""The struct codecs agree with the construct declarations in protocol/schema.py, both directions.

For random valid values: struct-encode -> construct-parse gives the same fields,
construct-build -> struct-decode gives the same fields, and where the layout
is deterministic the bytes are identical. Both sides reject every truncation.
"""
from __future__ import annotations

import json
import struct

import construct as c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import schema
from protocol.codes import LanguageCode, SerializeType
from protocol.command import RemotingCommand
from protocol.errors import ProtocolError
from protocol.frame import FrameDecoder, encode_frame
from protocol.message import (
    decode_batch, decode_offset_msg_id, decode_record, encode_batch, encode_record, offset_msg_id,
    properties_to_string, string_to_properties, unpack_host,
)

AGREE = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Rejections the oracle may give: construct's own errors, or json's for a JSON header.
ORACLE_REJECTS = (c.ConstructError, ValueError)

int16 = st.integers(-2 ** 15, 2 ** 15 - 1)
int32 = st.integers(-2 ** 31, 2 ** 31 - 1)
int64 = st.integers(-2 ** 63, 2 ** 63 - 1)
texts = st.text(max_size=20)
nonempty = st.text(min_size=1, max_size=20)
bodies = st.binary(max_size=300)


# ----------------------------------------------------------------- commands
@st.composite
def commands(draw, serialize_type):
    binary = serialize_type == SerializeType.ROCKETMQ
    return RemotingCommand(
        draw(int16),
        language=draw(st.integers(0, 255) if binary else st.sampled_from(list(LanguageCode))),
        version=draw(int16), opaque=draw(int32), flag=draw(int32),
        # The binary header cannot tell "" from no remark (Java decodes length 0 as null).
        remark=draw(st.none() | (nonempty if binary else texts)),
        ext_fields=draw(st.dictionaries(texts, texts, max_size=6)),
        body=draw(bodies), serialize_type=serialize_type)


def fields(cmd: RemotingCommand) -> tuple:
    return (cmd.code, cmd.language, cmd.version, cmd.opaque, cmd.flag, cmd.remark or None,
            list(cmd.ext_fields.items()), cmd.body_bytes(), cmd.serialize_type)


def oracle_fields(parsed: dict) -> tuple:
    h = parsed["header"]
    if parsed["serialize_type"] == SerializeType.ROCKETMQ:
        return (h.code, h.language, h.version, h.opaque, h.flag, h.remark or None,
                [(e.key, e.value) for e in h.ext], parsed["body"], 1)
    return (h["code"], LanguageCode[h["language"]], h["version"], h["opaque"], h["flag"], h.get("remark") or None,
            list(h.get("extFields", {}).items()), parsed["body"], 0)


@AGREE
@given(cmd=commands(SerializeType.ROCKETMQ) | commands(SerializeType.JSON))
def test_struct_encoded_command_parses_in_construct(cmd):
    frame = cmd.encode()
    assert oracle_fields(schema.parse_command(frame)) == fields(cmd)
    prefix = schema.FramePrefix.parse(frame)
    assert prefix.length == len(frame) - 4 and prefix.serialize_type == cmd.serialize_type


@AGREE
@given(cmd=commands(SerializeType.ROCKETMQ))
def test_construct_built_rocketmq_command_decodes_with_struct(cmd):
    header = {"code": cmd.code, "language": cmd.language, "version": cmd.version, "opaque": cmd.opaque,
              "flag": cmd.flag, "remark": cmd.remark or "",
              "ext": [{"key": k, "value": v} for k, v in cmd.ext_fields.items()]}
    built = schema.build_command(1, header, cmd.body)
    assert built == cmd.encode()  # one layout, one byte string
    assert fields(RemotingCommand.decode(built)) == fields(cmd)


json_ext_values = st.one_of(texts, st.integers(-2 ** 63, 2 ** 63 - 1), st.booleans(), st.none())


@AGREE
@given(cmd=commands(SerializeType.JSON), raw_ext=st.dictionaries(texts, json_ext_values, max_size=6))
def test_construct_built_json_command_decodes_with_struct(cmd, raw_ext):
    # Clients send ext values as JSON strings, numbers and booleans (ali-ons); nulls are dropped.
    header = {"code": cmd.code, "language": LanguageCode(cmd.language).name, "version": cmd.version,
              "opaque": cmd.opaque, "flag": cmd.flag, "extFields": raw_ext}
    if cmd.remark is not None:
        header["remark"] = cmd.remark
    decoded = RemotingCommand.decode(schema.build_command(0, header, cmd.body))
    text = {True: "true", False: "false"}
    expected_ext = [(k, text.get(v, str(v)) if not isinstance(v, str) else v)
                    for k, v in raw_ext.items() if v is not None]
    assert fields(decoded)[:6] == fields(cmd)[:6]
    assert list(decoded.ext_fields.items()) == expected_ext
    assert decoded.body == cmd.body


@AGREE
@given(cmd=commands(SerializeType.ROCKETMQ) | commands(SerializeType.JSON), data=st.data())
def test_both_reject_truncated_commands(cmd, data):
    frame = cmd.encode()
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(ProtocolError):
        RemotingCommand.decode(frame[:cut])
    with pytest.raises(ORACLE_REJECTS):
        schema.parse_command(frame[:cut])
    # A header cut short inside a frame that is itself consistent.
    header_length = struct.unpack_from(">I", frame, 4)[0] & 0xFFFFFF
    header = frame[8:8 + header_length]
    hcut = data.draw(st.integers(0, len(header) - 1))
    reframed = encode_frame(header[:hcut], b"", cmd.serialize_type)
    with pytest.raises(ProtocolError):
        RemotingCommand.decode(reframed)
    with pytest.raises(ORACLE_REJECTS):
        schema.parse_command(reframed)


@AGREE
@given(cmds=st.lists(commands(SerializeType.ROCKETMQ) | commands(SerializeType.JSON), min_size=1, max_size=4))
def test_frame_decoder_cuts_where_construct_does(cmds):
    stream = b"".join(cmd.encode() for cmd in cmds)
    frames = FrameDecoder().feed(stream)
    parsed = c.GreedyRange(schema.Frame).parse(stream)
    assert [schema.Frame.build(f) for f in parsed] == frames


def test_spec_rocketmq_header_example_in_both():
    # spec 1.4: code 34, JAVA, version 409, opaque 7, flag 0, no remark, one entry k -> v.
    expected = bytes.fromhex("0022 00 0199 00000007 00000000 00000000 00000008 0001 6b 00000001 76")
    built = schema.RocketMQHeader.build({"code": 34, "language": 0, "version": 409, "opaque": 7, "flag": 0,
                                         "remark": "", "ext": [{"key": "k", "value": "v"}]})
    cmd = RemotingCommand(34, language=0, version=409, opaque=7, ext_fields={"k": "v"}, serialize_type=1)
    assert built == expected == cmd.encode_header()
    assert struct.unpack_from(">I", cmd.encode(), 4)[0] == 0x0100001D


# ------------------------------------------------------------------ records
hosts_v4 = st.tuples(st.binary(min_size=4, max_size=4), st.integers(0, 65535))
hosts_v6 = st.tuples(st.binary(min_size=16, max_size=16), st.integers(0, 65535))
prop_text = st.text(st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)),
                    min_size=1, max_size=12)
property_strings = st.dictionaries(prop_text, prop_text, max_size=5).map(properties_to_string)
topics = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=127)


@st.composite
def records(draw):
    born, store = draw(hosts_v4 | hosts_v6), draw(hosts_v4 | hosts_v6)
    return dict(
        topic=draw(topics), body=draw(bodies), queue_id=draw(int32), flag=draw(int32),
        sys_flag=draw(int32) & ~0x30, born_timestamp=draw(int64), born_host=born,
        store_host=store, properties=draw(property_strings), queue_offset=draw(int64),
        physical_offset=draw(int64), store_timestamp=draw(int64), reconsume_times=draw(int32),
        prepared_offset=draw(int64), crc=draw(st.integers(0, 2 ** 31 - 1)))


def _packed(host) -> bytes:
    return host[0] + struct.pack(">i", host[1])


def struct_encode(r) -> bytes:
    return bytes(encode_record(**{**r, "topic": r["topic"].encode(), "properties": r["properties"].encode(),
                                  "born_host": _packed(r["born_host"]), "store_host": _packed(r["store_host"])}))


def oracle_value(r) -> dict:
    sys_flag = r["sys_flag"] | (0x10 if len(r["born_host"][0]) == 16 else 0) | \
        (0x20 if len(r["store_host"][0]) == 16 else 0)
    value = {k: v for k, v in r.items() if k != "crc"}
    value.update(body_crc=r["crc"], sys_flag=sys_flag,
                 born_host={"ip": r["born_host"][0], "port": r["born_host"][1]},
                 store_host={"ip": r["store_host"][0], "port": r["store_host"][1]})
    return value


@AGREE
@given(r=records())
def test_record_struct_and_construct_agree(r):
    raw = struct_encode(r)
    built = schema.StoreRecord.build(oracle_value(r))
    assert raw == built
    parsed = schema.StoreRecord.parse(raw)
    assert parsed.total_size == len(raw)
    for key, value in oracle_value(r).items():
        assert parsed[key] == value, key
    msg, size = decode_record(built)
    assert size == len(built) == msg.store_size
    assert (msg.topic, msg.body, msg.queue_id, msg.flag, msg.sys_flag, msg.queue_offset, msg.physical_offset,
            msg.born_timestamp, msg.store_timestamp, msg.reconsume_times, msg.prepared_offset, msg.body_crc) == \
        (r["topic"], r["body"], r["queue_id"], r["flag"], parsed.sys_flag, r["queue_offset"],
         r["physical_offset"], r["born_timestamp"], r["store_timestamp"], r["reconsume_times"],
         r["prepared_offset"], r["crc"])
    assert msg.born_host == unpack_host(_packed(r["born_host"]))
    assert msg.store_host == unpack_host(_packed(r["store_host"]))
    assert msg.properties == string_to_properties(r["properties"])


@AGREE
@given(r=records(), data=st.data())
def test_both_reject_truncated_records(r, data):
    raw = struct_encode(r)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(ProtocolError):
        decode_record(raw[:cut])
    with pytest.raises(ORACLE_REJECTS):
        schema.StoreRecord.parse(raw[:cut])


@AGREE
@given(rs=st.lists(records(), min_size=1, max_size=3))
def test_record_run_agrees(rs):
    run = b"".join(struct_encode(r) for r in rs)
    assert [p.total_size for p in schema.RecordRun.parse(run)] == [len(struct_encode(r)) for r in rs]


def test_blank_marker_layout():
    raw = struct.pack(">ii", 4096, -875286124)
    assert schema.BlankMarker.parse(raw).total_size == 4096
    with pytest.raises(c.ConstructError):
        schema.StoreRecord.parse(raw + bytes(100))


# ------------------------------------------------------------------ batches
batch_entries = st.lists(st.tuples(int32, bodies, property_strings), max_size=4)


@AGREE
@given(entries=batch_entries)
def test_batch_struct_and_construct_agree(entries):
    raw = encode_batch(entries)
    built = schema.BatchBody.build([{"flag": f, "body": b, "properties": p} for f, b, p in entries])
    assert raw == built
    assert [(e.flag, e.body, e.properties) for e in schema.BatchBody.parse(raw)] == entries
    assert decode_batch(built) == entries


@AGREE
@given(entries=batch_entries.filter(lambda e: len(encode_batch(e)) > 1), data=st.data())
def test_both_reject_truncated_batches(entries, data):
    raw = encode_batch(entries)
    boundaries = {len(encode_batch(entries[:i])) for i in range(len(entries))}
    cut = data.draw(st.integers(1, len(raw) - 1).filter(lambda n: n not in boundaries))
    with pytest.raises(ProtocolError):
        decode_batch(raw[:cut])
    with pytest.raises(ORACLE_REJECTS):
        schema.BatchBody.parse(raw[:cut])


# ------------------------------------------------------ ids and queue units
@AGREE
@given(host=hosts_v4 | hosts_v6, offset=int64)
def test_offset_msg_id_agrees(host, offset):
    text = offset_msg_id(_packed(host), offset)
    parsed = schema.parse_offset_msg_id(text)
    assert (parsed.ip, parsed.port, parsed.physical_offset) == (host[0], host[1], offset)
    built = schema.OffsetMsgId.build({"ip": host[0], "port": host[1], "physical_offset": offset}).hex()
    assert decode_offset_msg_id(built) == (*unpack_host(_packed(host)), offset)
    assert built.upper() == text
    with pytest.raises(ProtocolError):
        decode_offset_msg_id(text[:-2])
    with pytest.raises(ORACLE_REJECTS):
        schema.parse_offset_msg_id(text[:-2])


@AGREE
@given(offset=int64, size=int32, tags=int64)
def test_consume_queue_unit_is_20_bytes_qiq(offset, size, tags):
    assert schema.CQ_UNIT_SIZE == 20
    raw = struct.pack(">qiq", offset, size, tags)
    assert schema.ConsumeQueueUnit.build({"physical_offset": offset, "size": size, "tags_code": tags}) == raw
    parsed = schema.ConsumeQueueUnit.parse(raw)
    assert (parsed.physical_offset, parsed.size, parsed.tags_code) == (offset, size, tags)


def test_schema_is_interpreted_not_compiled():
    for name in ("Frame", "RocketMQHeader", "StoreRecord", "BatchEntry", "ConsumeQueueUnit"):
        assert not isinstance(getattr(schema, name), c.Compiled), name


def test_json_header_oracle_uses_stdlib_json():
    raw = b'{"code":34,"extFields":{"k":"v"}}'
    assert schema.JsonHeader.parse(raw) == json.loads(raw)
