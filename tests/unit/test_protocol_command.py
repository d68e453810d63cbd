"""RemotingCommand: JSON and ROCKETMQ headers both ways, what real clients send, typed ext fields, replies."""
from __future__ import annotations

import json
import struct

import pytest

from protocol.codes import FLAG_ONEWAY, FLAG_RESPONSE, VERSION_4_9_8, LanguageCode, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import HeaderError, ProtocolError
from protocol.frame import encode_frame

JSON, ROCKETMQ = 0, 1


def sample(serialize_type: int, remark: str | None = "é☃ remark 𝄞") -> RemotingCommand:
    return RemotingCommand(RequestCode.SEND_MESSAGE_V2, language=LanguageCode.GO, version=317, opaque=-7,
                           flag=FLAG_ONEWAY, remark=remark,
                           ext_fields={"a": "PID", "b": "Topic", "i": "TAGS\x01A\x02KEYS\x01k é", "": ""},
                           body=b"\x00\xffbody", serialize_type=serialize_type)


def same(a: RemotingCommand, b: RemotingCommand) -> None:
    assert (a.code, a.language, a.version, a.opaque, a.flag, a.remark, a.ext_fields, a.body_bytes(),
            a.serialize_type) == \
        (b.code, b.language, b.version, b.opaque, b.flag, b.remark, b.ext_fields, b.body_bytes(), b.serialize_type)


def json_frame(obj, body: bytes = b"") -> bytes:
    return encode_frame(json.dumps(obj).encode(), body, JSON)


# --------------------------------------------------------------- round trips
@pytest.mark.parametrize("serialize_type", [JSON, ROCKETMQ])
@pytest.mark.parametrize("remark", ["é☃ remark 𝄞", None])
def test_round_trip(serialize_type, remark):
    cmd = sample(serialize_type, remark)
    same(RemotingCommand.decode(cmd.encode()), cmd)


def test_json_empty_remark_survives_and_binary_reads_it_as_none():
    cmd = sample(JSON, "")
    assert RemotingCommand.decode(cmd.encode()).remark == ""
    cmd.serialize_type = ROCKETMQ
    assert RemotingCommand.decode(cmd.encode()).remark is None  # Java: length 0 decodes to null


def test_json_header_looks_like_fastjson():
    cmd = RemotingCommand.request(RequestCode.PULL_MESSAGE, {"queueId": 3, "topic": "T", "skip": None,
                                                             "commit": True}, opaque=9)
    header = cmd.encode_header()
    obj = json.loads(header)
    assert list(obj) == sorted(obj)  # fastjson SortField: receivers must not care, but Java writes it so
    assert obj["extFields"] == {"queueId": "3", "topic": "T", "commit": "true"}  # strings only, nulls dropped
    assert obj["language"] == "PYTHON" and obj["serializeTypeCurrentRPC"] == "JSON"
    assert obj["flag"] == 0 and obj["opaque"] == 9 and obj["version"] == VERSION_4_9_8
    assert "remark" not in obj
    assert b" " not in header


def test_json_without_ext_fields_omits_the_key():
    header = json.loads(RemotingCommand.request(RequestCode.HEART_BEAT).encode_header())
    assert "extFields" not in header


def test_rocketmq_header_layout():
    cmd = RemotingCommand(5, language=3, version=409, opaque=-1, flag=1, remark="r", ext_fields={"k": "vv"},
                          serialize_type=ROCKETMQ)
    header = cmd.encode_header()
    assert struct.unpack_from(">hBhiii", header) == (5, 3, 409, -1, 1, 1)
    assert header[17:18] == b"r"
    assert struct.unpack_from(">i", header, 18) == (2 + 1 + 4 + 2,)
    assert header[22:] == b"\x00\x01k\x00\x00\x00\x02vv"
    frame = cmd.encode()
    assert struct.unpack_from(">I", frame, 4)[0] == (1 << 24) | len(header)


def test_encode_parts_keep_body_buffers_uncopied():
    parts = [b"abc", bytearray(b"de"), memoryview(b"fgh")]
    cmd = RemotingCommand(1, body=parts, flag=FLAG_RESPONSE)
    out = cmd.encode_parts()
    assert out[1] is parts[0] and out[2] is parts[1] and out[3] is parts[2]
    assert cmd.body_length() == 8
    decoded = RemotingCommand.decode(cmd.encode())
    assert decoded.body == b"abcdefgh"
    assert RemotingCommand(1, body=b"").encode_parts()[1:] == []


# ------------------------------------------------------ what clients send
def test_ali_ons_style_typed_ext_values_become_text():
    frame = json_frame({"code": 310, "language": "JAVA", "opaque": 2, "flag": 0, "version": 121,
                        "extFields": {"d": 4, "k": False, "m": True, "g": 1795269231362, "x": None, "f": 4.0}})
    cmd = RemotingCommand.decode(frame)
    assert cmd.ext_fields == {"d": "4", "k": "false", "m": "true", "g": "1795269231362", "f": "4"}
    assert cmd.language == LanguageCode.JAVA and cmd.version == 121


@pytest.mark.parametrize("language, expected", [
    ("JAVA", LanguageCode.JAVA), ("CPP", LanguageCode.CPP), ("go", LanguageCode.GO), (" PYTHON ", 3),
    ("NEWLANG", LanguageCode.OTHER), (9, LanguageCode.GO), ("9", 9), (None, LanguageCode.JAVA),
    (256 + 1, 1),
])
def test_json_language_names_and_numbers(language, expected):
    cmd = RemotingCommand.decode(json_frame({"code": 34, "language": language}))
    assert cmd.language == expected


def test_json_defaults_for_missing_keys():
    cmd = RemotingCommand.decode(json_frame({"code": 105}))
    assert (cmd.flag, cmd.opaque, cmd.version, cmd.remark, cmd.ext_fields) == (0, 0, 0, None, {})
    assert not cmd.is_response


def test_json_numbers_as_strings_and_unknown_keys():
    cmd = RemotingCommand.decode(json_frame({"code": "310", "opaque": "5", "flag": "2", "whatever": [1]}))
    assert (cmd.code, cmd.opaque, cmd.flag) == (310, 5, 2)
    assert cmd.is_oneway


def test_cpp_header_with_trailing_newline_decodes():
    header = b'{"code":34,"extFields":{"AccessKey":""},"flag":0,"language":"CPP","opaque":0,"remark":"","version":63}\n'
    cmd = RemotingCommand.decode(encode_frame(header))
    assert cmd.language == LanguageCode.CPP and cmd.remark == "" and cmd.ext_fields == {"AccessKey": ""}


@pytest.mark.parametrize("header", [
    b"", b"{", b"[]", b"null", b'"code"', b"\xff\xfe", b'{"flag":0}',
    b'{"code":1.5}', b'{"code":true}', b'{"code":40000}', b'{"code":"ten"}', b'{"code":1,"opaque":4294967296}',
    b'{"code":1,"language":[]}', b'{"code":1,"language":"\xc2\xb2"}', b'{"code":1,"remark":7}',
    b'{"code":1,"extFields":[]}', b'{"code":1,"extFields":{"a":{"b":"c"}}}', b'{"code":1,"extFields":{"a":[1]}}',
    b'{"code":1,"remark":"\\udc00"}', b'{"code":1,"extFields":{"\\ud800x":"v"}}',
])
def test_bad_json_headers_are_header_errors(header):
    with pytest.raises(HeaderError):
        RemotingCommand.decode(encode_frame(header))


def _binary_header(remark_len_field=None, ext_len_field=None, entries=b"\x00\x01k\x00\x00\x00\x01v", remark=b""):
    fixed = struct.pack(">hBhiii", 34, 0, 409, 7, 0, len(remark) if remark_len_field is None else remark_len_field)
    ext_len = len(entries) if ext_len_field is None else ext_len_field
    return fixed + remark + struct.pack(">i", ext_len) + entries


@pytest.mark.parametrize("header", [
    b"", _binary_header()[:20], _binary_header(remark_len_field=-1), _binary_header(remark_len_field=100),
    _binary_header(ext_len_field=-1), _binary_header(ext_len_field=5), _binary_header(ext_len_field=100),
    _binary_header(entries=b"\x00"), _binary_header(entries=b"\xff\xff"),                 # key length -1
    _binary_header(entries=b"\x00\x05k\x00\x00\x00\x01v"),                                # key runs past
    _binary_header(entries=b"\x00\x01k\xff\xff\xff\xff"),                                 # value length -1
    _binary_header(entries=b"\x00\x01k\x00\x00\x00\x09v"),                                # value runs past
    _binary_header(entries=b"\x00\x01\xff\x00\x00\x00\x01v"),                             # key not UTF-8
    _binary_header(entries=b"\x00\x01k\x00\x00\x00\x01\xc0"),                             # value not UTF-8
    _binary_header(remark=b"\xed\xa0\x80"),                                               # encoded surrogate
    _binary_header() + b"\x00",                                                           # trailing byte
])
def test_bad_rocketmq_headers_are_header_errors(header):
    with pytest.raises(HeaderError):
        RemotingCommand.decode(encode_frame(header, b"", ROCKETMQ))


def test_good_binary_header_helper_decodes():
    cmd = RemotingCommand.decode(encode_frame(_binary_header(remark=b"hi"), b"B", ROCKETMQ))
    assert (cmd.code, cmd.version, cmd.opaque, cmd.remark, cmd.ext_fields, cmd.body) == \
        (34, 409, 7, "hi", {"k": "v"}, b"B")


# ---------------------------------------------------------------- replies
@pytest.mark.parametrize("serialize_type", [JSON, ROCKETMQ])
def test_response_mirrors_request(serialize_type):
    request = RemotingCommand.decode(sample(serialize_type).encode())
    reply = request.response(ResponseCode.TOPIC_NOT_EXIST, "no route", {"queueOffset": 12}, b"body")
    assert reply.opaque == request.opaque and reply.serialize_type == serialize_type
    assert reply.flag == FLAG_RESPONSE and reply.is_response and not reply.is_oneway
    decoded = RemotingCommand.decode(reply.encode())
    assert (decoded.code, decoded.opaque, decoded.flag, decoded.remark, decoded.ext_fields, decoded.body) == \
        (ResponseCode.TOPIC_NOT_EXIST, -7, FLAG_RESPONSE, "no route", {"queueOffset": "12"}, b"body")
    assert decoded.version == VERSION_4_9_8 and decoded.language == LanguageCode.JAVA


def test_oneway_request_flag():
    cmd = RemotingCommand.request(RequestCode.END_TRANSACTION, {"commitOrRollback": 8}, oneway=True)
    assert cmd.is_oneway and not cmd.is_response and cmd.flag == FLAG_ONEWAY
    assert "oneway" in repr(cmd)


# -------------------------------------------------------- typed ext fields
def test_typed_accessors():
    cmd = RemotingCommand(1, ext_fields={"n": " 42 ", "neg": "-1", "big": "9223372036854775807",
                                         "t": "true", "T": "TRUE", "one": "1", "zero": "0", "f": "false",
                                         "empty": "", "s": "text"})
    assert cmd.int_field("n") == 42 and cmd.int_field("neg") == -1 and cmd.int_field("big") == 2 ** 63 - 1
    assert cmd.int_field("missing") is None and cmd.int_field("missing", 5) == 5 and cmd.int_field("empty", 6) == 6
    assert cmd.bool_field("t") and cmd.bool_field("T") and cmd.bool_field("one")
    assert not cmd.bool_field("zero") and not cmd.bool_field("f")
    assert cmd.bool_field("missing", True) and cmd.bool_field("empty", True)
    assert cmd.str_field("s") == "text" and cmd.str_field("empty") is None and cmd.str_field("empty", "d") == "d"


@pytest.mark.parametrize("call", [
    lambda c: c.int_field("s"), lambda c: c.int_field("huge"), lambda c: c.int_field("float"),
    lambda c: c.int_field("missing", required=True), lambda c: c.str_field("missing", required=True),
    lambda c: c.bool_field("s"), lambda c: c.int_field("empty", required=True),
])
def test_typed_accessor_errors_are_header_errors(call):
    cmd = RemotingCommand(1, ext_fields={"s": "text", "huge": "9223372036854775808", "float": "1.5", "empty": ""})
    with pytest.raises(HeaderError):
        call(cmd)


def test_header_error_is_a_protocol_error_with_system_error_code():
    with pytest.raises(ProtocolError) as info:
        RemotingCommand.decode(encode_frame(b"{"))
    assert info.value.response_code == ResponseCode.SYSTEM_ERROR
