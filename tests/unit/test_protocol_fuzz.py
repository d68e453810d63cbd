"""Fuzz every protocol decoder: hostile bytes only ever raise ProtocolError subclasses, and never hang.

Inputs are either random bytes or valid encodings mutated the way broken
peers and torn files break them: bit flips, truncation, insertion, deletion,
and length fields overwritten with extreme values. A decoder that lets
IndexError, struct.error, UnicodeDecodeError, KeyError, ValueError,
OverflowError or RecursionError escape would take a connection handler or the
recovery scan down with an unexpected error instead of a protocol answer.

Each codec runs 10,000 examples, derandomized. To keep the suite fast on a
small CI box the valid inputs come from a fixed corpus built once, and each
example is one integer that hypothesis draws: a Random seeded with it picks an
input and mutates it, so a failure is replayed with Random(<seed>).
"""
from __future__ import annotations

import contextlib
import json
import random
import signal
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from protocol.errors import HeaderError, ProtocolError
from protocol.frame import MAX_FRAME_SIZE, FrameDecoder, encode_frame
from protocol.message import (
    SendMessageRequestHeader, decode_batch, decode_offset_msg_id, decode_record, decode_records, encode_batch,
    encode_record, offset_msg_id, pack_host,
)

FUZZ = settings(max_examples=10_000, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PER_EXAMPLE_LIMIT_S = 2.0


class Hang(Exception):
    """An example ran past PER_EXAMPLE_LIMIT_S: the decoder is looping."""


@contextlib.contextmanager
def bounded(seconds: float = PER_EXAMPLE_LIMIT_S):
    """Interrupt a decoder that does not return, with SIGALRM (a no-op off the main thread).

    An alarm already armed (an outer bounded(), pytest-timeout's signal method)
    is respected: if it is due first it stays in charge, otherwise it is put
    back, with its remaining time, when this block ends.
    """
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if outer_left and outer_left <= seconds:
        yield
        return

    def on_alarm(signum, frame):
        raise Hang(f"decoder still running after {seconds} s")

    outer_handler = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - started), 0.001),
                             outer_interval)


def only_protocol_errors(fn, *args, **kwargs):
    """Run fn; a ProtocolError is an acceptable answer, anything else fails the test."""
    with bounded():
        try:
            return fn(*args, **kwargs)
        except ProtocolError:
            return None


# ------------------------------------------------------------------ corpus
_rng = random.Random(20240601)

_EXT_V2 = {"a": "PID_fuzz", "b": "FuzzTopic", "c": "TBW102", "d": "4", "e": "1", "f": "4",
           "g": "1700000000000", "h": "0", "i": "TAGS\x01TagA\x02UNIQ_KEY\x017F0000010000\x02TRAN_MSG\x01true",
           "j": "0", "k": "false", "m": "false"}


def _commands():
    yield RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, _EXT_V2, b"x" * 64, opaque=7)
    yield RemotingCommand.request(RequestCode.HEART_BEAT, None, b'{"clientID":"1.2.3.4@1"}', opaque=1)
    yield RemotingCommand.request(RequestCode.END_TRANSACTION, {"producerGroup": "G", "commitLogOffset": 1,
                                                                "commitOrRollback": 8, "fromTransactionCheck": True},
                                  oneway=True, opaque=2 ** 31 - 1)
    resp = RemotingCommand.request(RequestCode.PULL_MESSAGE, {"topic": "T", "queueId": 0}, opaque=3)
    yield resp.response(remark="é ünïcode ☃ 𝄞", ext_fields={"nextBeginOffset": 5})
    yield RemotingCommand(RequestCode.GET_ROUTEINFO_BY_TOPIC, opaque=-5, ext_fields={"": "", "k": "v" * 300})


_COMMANDS = list(_commands())
_JSON_FRAMES = [cmd.encode() for cmd in _COMMANDS]
_BIN_FRAMES = []
for _cmd in _COMMANDS:
    _cmd.serialize_type = 1
    _BIN_FRAMES.append(_cmd.encode())
    _cmd.serialize_type = 0
_JSON_HEADERS = [f[8:8 + (struct.unpack_from(">I", f, 4)[0] & 0xFFFFFF)] for f in _JSON_FRAMES]
_BIN_HEADERS = [f[8:8 + (struct.unpack_from(">I", f, 4)[0] & 0xFFFFFF)] for f in _BIN_FRAMES]


def _records():
    hosts = [pack_host("127.0.0.1", 10911), pack_host("::1", 10911), pack_host("2001:db8::7", 1)]
    for i in range(8):
        yield bytes(encode_record(
            topic=_rng.choice([b"T", b"%RETRY%G", b"x" * 127]), body=_rng.randbytes(_rng.choice([0, 5, 300])),
            queue_id=i, flag=_rng.randrange(-2 ** 31, 2 ** 31), sys_flag=_rng.choice([0, 4, 8, 12, 1]),
            born_timestamp=1_700_000_000_000 + i, born_host=_rng.choice(hosts), store_host=_rng.choice(hosts),
            properties=_rng.choice([b"", b"TAGS\x01A\x02KEYS\x01k", "UNIQ_KEY\x01é".encode()]),
            queue_offset=i, physical_offset=i * 1000, store_timestamp=1_700_000_000_123, reconsume_times=i % 3,
            prepared_offset=0))


_RECORDS = list(_records())
_RECORD_RUNS = [b"".join(_RECORDS[:3]), b"".join(_RECORDS[3:])]
_BATCHES = [
    encode_batch([(0, b"one", "UNIQ_KEY\x01A"), (7, b"", ""), (-1, b"\xff" * 40, "TAGS\x01é")]),
    encode_batch([(1, b"x" * 200, "a\x01b\x02c\x01d")]),
]
_MSG_IDS = [offset_msg_id(pack_host("127.0.0.1", 10911), 0),
            offset_msg_id(pack_host("10.1.2.3", 65535), 2 ** 63 - 1),
            offset_msg_id(pack_host("fe80::1", 10911), 123456)]

# ---------------------------------------------------------------- mutation
_EXTREMES_4 = [0, 1, 3, 4, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x00FFFFFF, 0x01FFFFFF, MAX_FRAME_SIZE,
               MAX_FRAME_SIZE + 1, 91, 90, 22, 21]
_EXTREMES_2 = [0, 1, 0x7FFF, 0x8000, 0xFFFF]
_EXTREMES_8 = [0, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four mutations of data, chosen by rng."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(("flip", "truncate", "insert", "delete", "len4", "len2", "len8", "byte"))
        n = len(data)
        at = rng.randrange(n) if n else 0
        if op == "flip" and n:
            data[at] ^= 1 << rng.randrange(8)
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == "delete":
            del data[at:at + rng.randint(1, 16)]
        elif op == "byte" and n:
            data[at] = rng.choice((0x00, 0x7F, 0x80, 0xFF))
        elif op in ("len4", "len2", "len8") and n:
            size, values = {"len4": (4, _EXTREMES_4), "len2": (2, _EXTREMES_2), "len8": (8, _EXTREMES_8)}[op]
            value = rng.choice(values + [n, n - 1, n + 1])
            # Favour the length-bearing prefixes: frame length / header word, record TOTALSIZE.
            at = rng.choice((0, 4, at))
            data[at:at + size] = (value & ((1 << (8 * size)) - 1)).to_bytes(size, "big")
    return bytes(data)


# One integer draw per example, expanded by a seeded Random, keeps hypothesis'
# per-example cost low enough for 10,000 examples a codec. A failure is
# reported as the seed: Random(seed) replays it.
_seeds = st.integers(0, 2 ** 64 - 1).map(random.Random)


def mutated(corpus):
    return _seeds.map(lambda rng: mutate(rng, rng.choice(corpus)))


def random_bytes(rng: random.Random, max_size: int) -> bytes:
    return rng.randbytes(rng.choice((rng.randrange(16), rng.randrange(max_size + 1))))


def hostile_bytes(rng: random.Random, corpus, max_size: int) -> bytes:
    """Two parts mutated valid input, one part random bytes."""
    return mutate(rng, rng.choice(corpus)) if rng.random() < 2 / 3 else random_bytes(rng, max_size)


def hostile(corpus, max_size=512):
    return _seeds.map(lambda rng: hostile_bytes(rng, corpus, max_size))


# ------------------------------------------------------------------- codecs
def _decode_stream(data: bytes, split: int) -> None:
    decoder = FrameDecoder(max_frame_size=1 << 16)
    frames = []
    try:
        frames += decoder.feed(data[:split])
        frames += decoder.feed(data[split:])
    except ProtocolError:
        # A failed decoder stays failed.
        with pytest.raises(ProtocolError):
            decoder.feed(b"\x00")
    # Frames come out whole and in order: together they are a prefix of the stream.
    assert data.startswith(b"".join(frames))
    for frame in frames:
        only_protocol_errors(_decode_and_reencode, frame)


def _decode_and_reencode(frame: bytes) -> None:
    cmd = RemotingCommand.decode(frame)
    # Whatever decodes must encode again (a reply or log line may echo it) and decode to the same fields.
    again = RemotingCommand.decode(cmd.encode())
    assert (again.code, again.opaque, again.flag, again.ext_fields, again.body) == \
        (cmd.code, cmd.opaque, cmd.flag, cmd.ext_fields, cmd.body)


_FRAME_CORPUS = _JSON_FRAMES + _BIN_FRAMES + [b"".join(_JSON_FRAMES[:3]), b"".join(_BIN_FRAMES[2:])]


@FUZZ
@given(case=_seeds.map(lambda rng: (hostile_bytes(rng, _FRAME_CORPUS, 512), rng.randrange(600))))
def test_fuzz_frame_decoder_and_command(case):
    data, split = case
    with bounded():
        _decode_stream(data, split)
    only_protocol_errors(_decode_and_reencode, data)


_HEADER_KEYS = ("code", "language", "version", "opaque", "flag", "remark", "extFields", "serializeTypeCurrentRPC",
                "other")
_ODD_TEXT = ("", " ", "JAVA", "java", "CPP", "12", "٣", "²", "\x00", "é", "\U0001d11e", "\ud800", "true", "-1")


def random_json(rng: random.Random, depth: int = 0):
    """A JSON value of any type, small, with the awkward cases overrepresented."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice((0, 1, -1, 2 ** 15, 2 ** 31, -2 ** 31 - 1, 2 ** 63, 2 ** 70, rng.randrange(-999, 999)))
    if kind == 3:
        return rng.choice((0.5, 1.0, -0.0, 1e300, float("inf"), float("nan")))
    if kind in (4, 5):
        return rng.choice(_ODD_TEXT) + "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(4)))
    if kind in (6, 7):
        return {rng.choice(_ODD_TEXT + ("b", "i")): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [random_json(rng, depth + 1) for _ in range(rng.randrange(3))]


_VALID_HEADER = {"code": 310, "language": "JAVA", "version": 121, "opaque": 1, "flag": 0, "remark": "",
                 "extFields": {"a": "G", "b": "T", "d": 4, "k": False}}


def random_header_object(rng: random.Random) -> dict:
    """A valid header with up to three keys given random values (so decoding gets past the first check)."""
    obj = json.loads(json.dumps(_VALID_HEADER))
    for key in rng.sample(_HEADER_KEYS, rng.randrange(4)):
        if rng.random() < 0.2:
            obj.pop(key, None)
        elif key == "extFields" and rng.random() < 0.7:
            obj[key][rng.choice(_ODD_TEXT + ("b", "i"))] = random_json(rng, 2)
        else:
            obj[key] = random_json(rng)
    return obj


def random_json_header(rng: random.Random) -> bytes:
    kind = rng.randrange(3)
    if kind == 0:
        return mutate(rng, rng.choice(_JSON_HEADERS))
    if kind == 1:
        return json.dumps(random_header_object(rng)).encode()
    return random_bytes(rng, 256)


@FUZZ
@given(header=_seeds.map(random_json_header))
def test_fuzz_json_header(header):
    frame = encode_frame(header, b"body", 0)
    only_protocol_errors(_decode_and_reencode, frame)
    # The decoder's fast JSON path accepts exactly the documents json.loads accepts.
    try:
        json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        with pytest.raises(HeaderError):
            RemotingCommand.decode(frame)


@FUZZ
@given(header=hostile(_BIN_HEADERS, max_size=128))
def test_fuzz_rocketmq_header(header):
    only_protocol_errors(_decode_and_reencode, encode_frame(header, b"", 1))


def _decode_record_fully(data: bytes) -> None:
    msg, size = decode_record(data, 0, check_crc=True)
    assert 91 <= size <= len(data)
    decode_records(data)


@FUZZ
@given(case=_seeds.map(lambda rng: (hostile_bytes(rng, _RECORDS + _RECORD_RUNS, 512),
                                     rng.choice((0, 0, 0, 1, 91, -1)))))
def test_fuzz_record_decode(case):
    data, pos = case
    only_protocol_errors(_decode_record_fully, data)
    only_protocol_errors(decode_record, memoryview(data), pos)


@FUZZ
@given(data=hostile(_BATCHES, max_size=256))
def test_fuzz_batch_decode(data):
    entries = only_protocol_errors(decode_batch, data)
    if entries is not None:
        # MAGICCODE and BODYCRC are ignored on the way in, so compare after one round trip.
        assert decode_batch(encode_batch(entries)) == entries


_SEND_KEYS = list("abcdefghijklmn") + ["producerGroup", "topic", "defaultTopic", "defaultTopicQueueNums",
                                        "queueId", "sysFlag", "bornTimestamp", "flag", "properties",
                                        "reconsumeTimes", "unitMode", "maxReconsumeTimes", "batch", "bname"]
_FIELD_VALUES = ("", "0", "1", "-1", "true", "false", "TRUE", " 7 ", "2147483647", "2147483648", "-2147483649",
                 "9223372036854775807", "9223372036854775808", "1e3", "0x10", "1_000", "NaN", "١٢", "\x00",
                 "9" * 5000, "T", "PID_x")


_VALID_SEND = ({"a": "G", "b": "T", "e": "1", "f": "0", "g": "1700000000000", "h": "0"},
               {"producerGroup": "G", "topic": "T", "queueId": "1", "sysFlag": "0", "bornTimestamp": "1", "flag": "0"})


def random_send_ext(rng: random.Random) -> dict[str, str]:
    """Mostly a valid V1 or V2 header with a few fields changed, sometimes random keys only."""
    ext = dict(rng.choice(_VALID_SEND)) if rng.random() < 0.8 else {}
    for _ in range(rng.randrange(1, 6)):
        key = rng.choice(_SEND_KEYS) if rng.random() < 0.9 else chr(rng.randrange(0x20, 0x250))
        if rng.random() < 0.8:
            ext[key] = rng.choice(_FIELD_VALUES)
        else:
            ext[key] = str(rng.randrange(-2 ** 65, 2 ** 65))
    return ext


_SEND_CODES = (RequestCode.SEND_MESSAGE, RequestCode.SEND_MESSAGE_V2, RequestCode.SEND_BATCH_MESSAGE)


@FUZZ
@given(case=_seeds.map(lambda rng: (random_send_ext(rng), rng.choice(_SEND_CODES))))
def test_fuzz_send_header_from_command(case):
    ext, code = case
    cmd = RemotingCommand(code, ext_fields=ext)
    header = only_protocol_errors(SendMessageRequestHeader.from_command, cmd)
    if header is not None:
        # What a header accepts must fit the record fields and the Java types it stands for.
        for value in (header.queue_id, header.sys_flag, header.flag, header.default_topic_queue_nums,
                      header.reconsume_times, header.max_reconsume_times or 0):
            assert -2 ** 31 <= value < 2 ** 31
        assert -2 ** 63 <= header.born_timestamp < 2 ** 63
        assert header.producer_group and header.topic


def random_msg_id(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return mutate(rng, rng.choice(_MSG_IDS).encode()).decode("latin-1")
    if kind == 1:
        return "".join(rng.choice("0123456789abcdefABCDEF") for _ in range(rng.choice((31, 32, 33, 55, 56, 57))))
    return "".join(chr(rng.choice((rng.randrange(128), rng.randrange(0x110000)))) for _ in range(rng.randrange(60)))


@FUZZ
@given(text=_seeds.map(random_msg_id))
def test_fuzz_decode_offset_msg_id(text):
    result = only_protocol_errors(decode_offset_msg_id, text)
    if result is not None:
        host, port, offset = result
        assert -2 ** 63 <= offset < 2 ** 63 and -2 ** 31 <= port < 2 ** 31


def test_deeply_nested_json_header_is_a_header_error():
    header = b'{"code":1,"extFields":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(HeaderError):
        RemotingCommand.decode(encode_frame(header))


def test_lone_surrogate_in_json_header_is_refused_not_crashing_a_reply():
    header = json.dumps({"code": 310, "remark": "\ud800", "extFields": {"b": "T"}}).encode()
    with pytest.raises(HeaderError):
        RemotingCommand.decode(encode_frame(header))
    paired = json.dumps({"code": 310, "extFields": {"i": "\U0001d11e"}}).encode()  # escaped surrogate pair
    assert RemotingCommand.decode(encode_frame(paired)).ext_fields == {"i": "\U0001d11e"}


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_hang_guard_interrupts_a_looping_decoder():
    outer = signal.getitimer(signal.ITIMER_REAL)[0]
    with pytest.raises(Hang):
        with bounded(0.05):
            while True:
                pass
    # An alarm armed around the test (pytest-timeout) is still armed afterwards.
    assert bool(signal.getitimer(signal.ITIMER_REAL)[0]) == bool(outer)
