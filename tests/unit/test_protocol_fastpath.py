"""Fast paths against the checked code they shortcut: same value, or the same error, for random input.

SendMessageRequestHeader.from_command tries a straight-line pass first and falls back to the
table-driven ``_from_command_checked``; RemotingCommand's JSON header decode has a fast path for the
exact shapes real clients send. Each is compared here with its reference on seeded random input
(bounded counts, deterministic).
"""
from __future__ import annotations

import json
import random

import pytest

from protocol.codes import RequestCode
from protocol.command import RemotingCommand, _decode_json_fast
from protocol.message import _SEND_FIELDS, SendMessageRequestHeader

_STR_VALUES = ["", "PID_x", "orders", " ", "TBW102", "\u00e9t\u00e9", "TAGS\x01a\x02KEYS\x01k\x02"]
_INT_VALUES = ["", "0", "4", "-1", "2147483647", "2147483648", "-2147483648", "-2147483649", " 7 ", "+3", "1_000",
               "9223372036854775807", "9223372036854775808", "-9223372036854775808", "x", "1.5", "\u0663", "0x10",
               "1700000000123"]
_BOOL_VALUES = ["", "true", "false", "1", "0", "TRUE", " true ", "False", "yes", "2"]
_ODD_VALUES = [0, 1, True, False, 3.7, None, [], {}]  # only a hand-made command can hold these


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # the same type and message, or it is a different error
        return ("error", type(exc).__name__, str(exc))


def _random_ext(rng: random.Random, v2: bool, odd: bool) -> dict:
    ext = {}
    for long, short, kind, _required, _default in _SEND_FIELDS:
        if rng.random() < 0.12:
            continue  # absent
        pool = _STR_VALUES if kind == "s" else _BOOL_VALUES if kind == "b" else _INT_VALUES
        value = rng.choice(_ODD_VALUES) if odd and rng.random() < 0.1 else rng.choice(pool)
        if rng.random() < 0.6:  # mostly well formed, so both passes are exercised
            value = {"s": "v", "b": "false"}.get(kind, "5") if kind in ("s", "b") else str(rng.randrange(-5, 50))
        ext[short if v2 else long] = value
    if rng.random() < 0.05:
        ext["zz"] = "extra"
    return ext


@pytest.mark.parametrize("odd", [False, True])
def test_send_header_fast_path_equals_checked_pass(odd):
    rng = random.Random(1515 + odd)
    fast_taken = 0
    for _ in range(6000):
        code = rng.choice([RequestCode.SEND_MESSAGE, RequestCode.SEND_MESSAGE_V2, RequestCode.SEND_BATCH_MESSAGE])
        v2 = code != RequestCode.SEND_MESSAGE and rng.random() < 0.9
        ext = _random_ext(rng, v2, odd)
        cmd = RemotingCommand(code, ext_fields=ext)
        is_v2 = code in (RequestCode.SEND_MESSAGE_V2, RequestCode.SEND_BATCH_MESSAGE) and "b" in ext
        got = _outcome(lambda: SendMessageRequestHeader.from_command(cmd))
        want = _outcome(lambda: SendMessageRequestHeader._from_command_checked(ext, is_v2))
        assert got == want, ext
        fast_taken += got[0] == "ok"
    assert fast_taken > 500  # the fast pass really ran on well-formed headers


def test_send_header_fast_path_on_real_producer_fields():
    ext = {"a": "PID_orders", "b": "orders", "c": "TBW102", "d": "4", "e": "2", "f": "4", "g": "1700000000123",
           "h": "0", "i": "TAGS\x01TagA\x02", "j": "0", "k": "false", "m": "false", "n": "broker-a"}
    cmd = RemotingCommand(RequestCode.SEND_MESSAGE_V2, ext_fields=ext)
    header = SendMessageRequestHeader.from_command(cmd)
    assert header == SendMessageRequestHeader._from_command_checked(ext, True)
    assert (header.queue_id, header.sys_flag, header.born_timestamp, header.bname) == (2, 4, 1700000000123, "broker-a")


_JSON_KEYS = ["code", "language", "version", "opaque", "flag", "remark", "extFields", "serializeTypeCurrentRPC"]
_JSON_VALUES = [0, 10, 310, -1, 32767, 32768, -32769, 2147483647, 2147483648, -2147483649, "310", " 5", "x", None,
                True, False, 1.0, 2.5, "JAVA", "CPP", "cpp", "PYTHON", "OTHER", "12", "", [], {}, {"a": "b"},
                "\udc80", "\ud834\udd1e", "caf\u00e9", "a\x01b"]
_EXT_VALUES = ["", "v", "0", "true", "\x01\x02", "caf\u00e9", "\ud800", "\ud834\udd1e", 5, 1.5, True, None, [], {}]


def _random_json_header(rng: random.Random) -> bytes:
    obj = {}
    keys = _JSON_KEYS[:]
    rng.shuffle(keys)
    for key in keys:
        if rng.random() < 0.3:
            continue
        if key == "extFields" and rng.random() < 0.8:
            obj[key] = {rng.choice(["a", "b", "msgId", "q\u00fc", "\udc00", ""]) + str(i):
                        rng.choice(_EXT_VALUES) if rng.random() < 0.3 else rng.choice(["v", "12", "TAGS\x01x\x02"])
                        for i in range(rng.randrange(0, 6))}
        elif key in ("code", "version", "opaque", "flag") and rng.random() < 0.7:
            obj[key] = rng.randrange(-40000, 40000)
        elif key == "language" and rng.random() < 0.6:
            obj[key] = rng.choice(["JAVA", "CPP", "PYTHON", "GO"])
        else:
            obj[key] = rng.choice(_JSON_VALUES)
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))
    roll = rng.random()
    if roll < 0.04:
        text = " " + text
    elif roll < 0.08:
        text = text + " \n"
    elif roll < 0.12:
        text = text + "x"
    elif roll < 0.16:
        text = text[:rng.randrange(len(text) + 1)]
    elif roll < 0.18:
        text = "[" + text + "]"
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written as itself, not escaped: bytes no encoder makes
        raw = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.03:
        raw = raw[:5] + b"\xff" + raw[5:]
    return raw


def _command_view(cmd):
    return (cmd.code, type(cmd.code), cmd.language, type(cmd.language), cmd.version, cmd.opaque, cmd.flag,
            cmd.remark, list(cmd.ext_fields.items()))


def _json_frame(header: bytes, body: bytes = b"b") -> bytes:
    return (4 + len(header) + len(body)).to_bytes(4, "big") + len(header).to_bytes(4, "big") + header + body


def test_json_header_fast_path_equals_checked_decode():
    rng = random.Random(15)
    fast = 0
    for _ in range(8000):
        header = _random_json_header(rng)
        got = _outcome(lambda: _command_view(RemotingCommand.decode(_json_frame(header))))
        want = _outcome(lambda: _command_view(RemotingCommand._decode_json_header(header)))
        assert got == want, header
        fast += _outcome(lambda: _decode_json_fast(RemotingCommand, header)) != ("ok", None)
    assert fast > 300  # the fast path itself decided that many


def test_json_header_fast_path_on_real_client_frames():
    """Every real client frame: the fast decode equals the checked one, and so do the send headers."""
    from tests.unit.test_vectors import VECTORS  # skips this test if the vectors are not there
    sends = 0
    for row in VECTORS:
        frame = row["frame"]
        header = frame[8:8 + (int.from_bytes(frame[4:8], "big") & 0xFFFFFF)]
        cmd = RemotingCommand.decode(frame)
        if frame[4] == 0:
            assert _command_view(cmd) == _command_view(RemotingCommand._decode_json_header(header)), row["id"]
        if cmd.code in (RequestCode.SEND_MESSAGE, RequestCode.SEND_MESSAGE_V2, RequestCode.SEND_BATCH_MESSAGE):
            v2 = cmd.code != RequestCode.SEND_MESSAGE and "b" in cmd.ext_fields
            got = _outcome(lambda: SendMessageRequestHeader.from_command(cmd))
            assert got == _outcome(lambda: SendMessageRequestHeader._from_command_checked(cmd.ext_fields, v2))
            sends += got[0] == "ok"
    assert sends > 0


@pytest.mark.parametrize("odd", [float("inf"), float("-inf"), float("nan")])
def test_send_header_fast_path_gives_the_checked_error_for_an_earlier_field_before_a_float_infinity(odd):
    # The straight-line pass checks ranges last; int(inf) raised OverflowError out of it before the
    # checked pass could report the earlier field (hand-made commands only: decoded ones hold text).
    ext = {"producerGroup": "g", "topic": "t", "defaultTopicQueueNums": "2200000000", "queueId": odd,
           "sysFlag": "0", "bornTimestamp": "17", "flag": "0"}
    cmd = RemotingCommand(RequestCode.SEND_MESSAGE, ext_fields=ext)
    want = _outcome(lambda: SendMessageRequestHeader._from_command_checked(ext, False))
    assert want[:2] == ("error", "HeaderError")
    assert _outcome(lambda: SendMessageRequestHeader.from_command(cmd)) == want
