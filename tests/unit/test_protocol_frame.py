"""FrameDecoder: frames come out whole whatever the split; bad lengths fail fast and for good.

Split-point tests in the manner of h11's test_io: the same bytes fed whole,
one byte at a time, and cut at every position must give the same frames.
"""
from __future__ import annotations

import asyncio
import struct

import pytest

from protocol.codes import RequestCode, SerializeType
from protocol.command import RemotingCommand
from protocol.connection import RemotingConnection, _unread_fields, open_connection
from protocol.errors import FrameError, HeaderError, HeaderTooLargeError, ProtocolError
from protocol.frame import MAX_FRAME_SIZE, MAX_HEADER_SIZE, FrameDecoder, check_prefix, encode_frame
from tests.support.bounded import bounded


def frame_a() -> bytes:
    return RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, {"a": "G", "b": "T"}, b"hello", opaque=1).encode()


def frame_b() -> bytes:
    cmd = RemotingCommand.request(RequestCode.HEART_BEAT, None, b'{"clientID":"x"}', opaque=2,
                                  serialize_type=SerializeType.ROCKETMQ)
    return cmd.encode()


def empty_frame() -> bytes:
    return encode_frame(b"", b"")  # length 4: header word only


def feed_all(decoder: FrameDecoder, chunks) -> list[bytes]:
    frames = []
    for chunk in chunks:
        frames += decoder.feed(chunk)
    return frames


# ------------------------------------------------------------------ layout
def test_encode_frame_layout():
    frame = encode_frame(b"HDR", b"body", serialize_type=1)
    length, word = struct.unpack_from(">iI", frame)
    assert length == 4 + 3 + 4 == len(frame) - 4
    assert word >> 24 == 1 and word & 0xFFFFFF == 3
    assert frame[8:] == b"HDRbody"


def test_spec_worked_example_prefix():
    # spec 1.1: a 95-byte JSON header and no body -> 00 00 00 63 | 00 00 00 5F.
    assert encode_frame(b"x" * 95)[:8] == bytes.fromhex("00000063 0000005F")


# ---------------------------------------------------------------- splitting
def test_whole_and_one_byte_at_a_time():
    stream = frame_a() + frame_b() + empty_frame()
    expected = [frame_a(), frame_b(), empty_frame()]
    assert FrameDecoder().feed(stream) == expected
    decoder = FrameDecoder()
    assert feed_all(decoder, (stream[i:i + 1] for i in range(len(stream)))) == expected
    assert decoder.buffered == 0


@pytest.mark.parametrize("stream", [frame_a() + frame_b(), frame_b() + empty_frame() + frame_a()],
                         ids=["a+b", "b+empty+a"])
def test_every_split_point(stream):
    expected = FrameDecoder().feed(stream)
    for i in range(len(stream) + 1):
        decoder = FrameDecoder()
        assert feed_all(decoder, [stream[:i], stream[i:]]) == expected, i
        assert decoder.buffered == 0


def test_frames_either_side_of_the_view_cut_come_out_whole_whatever_the_reads():
    """A frame under _VIEW_CUT is sliced from the read buffer, one at or past it copied through a view: pipelined,
    in reads split anywhere (seeded), each comes out whole and the buffer empties."""
    import random
    from protocol.frame import _VIEW_CUT
    rng = random.Random(7)
    frames = [encode_frame(b"h" * 3, bytes([n % 251]) * (n - 11))
              for n in (16, _VIEW_CUT - 1, _VIEW_CUT, _VIEW_CUT + 1, 300, 200_000, _VIEW_CUT, 17)]
    assert [len(f) for f in frames][1:4] == [_VIEW_CUT - 1, _VIEW_CUT, _VIEW_CUT + 1]
    stream = b"".join(frames)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12)))
        decoder = FrameDecoder()
        assert feed_all(decoder, [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]) == frames
        assert decoder.buffered == 0


def test_every_pair_of_split_points_for_a_small_frame():
    stream = empty_frame() + encode_frame(b"h", b"b")
    expected = [empty_frame(), encode_frame(b"h", b"b")]
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1):
            assert feed_all(FrameDecoder(), [stream[:i], stream[i:j], stream[j:]]) == expected, (i, j)


@pytest.mark.parametrize("partial", range(1, 20))
def test_trailing_partial_bytes_stay_buffered(partial):
    tail = frame_a()[:partial]
    decoder = FrameDecoder()
    assert decoder.feed(frame_b() + frame_a() + tail) == [frame_b(), frame_a()]
    assert decoder.buffered == partial
    assert decoder.feed(frame_a()[partial:]) == [frame_a()]
    assert decoder.buffered == 0


def test_many_frames_through_buffer_compaction():
    frame = encode_frame(b"{}", b"x" * 1000)
    stream = frame * 300 + frame[:500]
    decoder = FrameDecoder()
    frames = feed_all(decoder, (stream[i:i + 70_001] for i in range(0, len(stream), 70_001)))
    assert frames == [frame] * 300
    assert decoder.buffered == 500


def test_feeding_nothing_is_harmless():
    decoder = FrameDecoder()
    assert decoder.feed(b"") == []
    assert decoder.feed(frame_a()[:3]) == []
    assert decoder.feed(b"") == []
    assert decoder.feed(frame_a()[3:]) == [frame_a()]


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("length", [-1, 0, 3, -2 ** 31])
def test_length_below_four_is_a_frame_error(length):
    with pytest.raises(FrameError, match="below"):
        FrameDecoder().feed(struct.pack(">iI", length, 0))


@pytest.mark.parametrize("length", [MAX_FRAME_SIZE + 1, 2 ** 31 - 1])
def test_oversized_length_is_a_frame_error(length):
    with pytest.raises(FrameError, match="exceeds"):
        FrameDecoder().feed(struct.pack(">iI", length, 0))


def test_frame_at_the_maximum_is_accepted_and_one_more_byte_is_not():
    decoder = FrameDecoder(max_frame_size=100)
    frame = encode_frame(b"h" * 10, b"b" * 86)  # length field 100
    assert decoder.feed(frame) == [frame]
    with pytest.raises(FrameError):
        FrameDecoder(max_frame_size=100).feed(encode_frame(b"h" * 10, b"b" * 87))


def test_oversized_frame_detected_as_soon_as_its_length_arrives():
    decoder = FrameDecoder(max_frame_size=1024)
    prefix = struct.pack(">i", 1025)
    for i in range(3):
        assert decoder.feed(prefix[i:i + 1]) == []
    with pytest.raises(FrameError):
        decoder.feed(prefix[3:])  # the 4th byte: no header word, no body needed to know


def test_bad_length_after_a_good_frame_detected_at_once():
    # The good frame before the bad length is a real request: it is handed out, and the
    # error is known in the same feed, so the connection can close right after it.
    dec = FrameDecoder()
    assert dec.feed(frame_a() + struct.pack(">i", 2)) == [frame_a()]
    assert isinstance(dec.error, FrameError)
    with pytest.raises(FrameError):
        dec.feed(b"")


def test_header_length_past_the_frame_is_a_frame_error():
    bad = struct.pack(">iI", 10, 7) + b"x" * 6  # 6 bytes follow the header word, header claims 7
    with pytest.raises(FrameError, match="header length"):
        FrameDecoder().feed(bad)
    with pytest.raises(FrameError):
        RemotingCommand.decode(bad)


def test_header_length_uses_only_the_low_24_bits():
    header = b"{}"
    frame = struct.pack(">iI", 4 + len(header), (0x01 << 24) | len(header)) + header
    assert FrameDecoder().feed(frame) == [frame]
    assert check_prefix(6, 0xFF000002, MAX_FRAME_SIZE) == 2


def test_decoder_stays_failed():
    decoder = FrameDecoder()
    with pytest.raises(FrameError) as first:
        decoder.feed(struct.pack(">i", 1))
    for follow_up in (frame_a(), b"", b"\x00" * 8):
        with pytest.raises(FrameError) as again:
            decoder.feed(follow_up)
        assert again.value is first.value


def test_frame_errors_are_protocol_errors_with_a_response_code():
    with pytest.raises(ProtocolError) as info:
        FrameDecoder().feed(struct.pack(">iI", 2, 0))
    assert isinstance(info.value, FrameError)
    assert isinstance(info.value.response_code, int)


# ------------------------------------------------ RemotingCommand.decode framing
@pytest.mark.parametrize("cut", [0, 1, 4, 7])
def test_decode_needs_the_eight_byte_prefix(cut):
    with pytest.raises(FrameError):
        RemotingCommand.decode(frame_a()[:cut])


def test_decode_needs_exactly_one_frame():
    with pytest.raises(FrameError, match="length field"):
        RemotingCommand.decode(frame_a()[:-1])
    with pytest.raises(FrameError, match="length field"):
        RemotingCommand.decode(frame_a() + b"\x00")


def test_decode_rejects_unknown_serialize_type():
    with pytest.raises(HeaderError, match="serialize type"):
        RemotingCommand.decode(encode_frame(b"{}", serialize_type=2))


def test_decode_accepts_memoryview_and_bytearray():
    frame = frame_a()
    for view in (memoryview(frame), bytearray(frame)):
        cmd = RemotingCommand.decode(view)
        assert cmd.code == RequestCode.SEND_MESSAGE_V2 and cmd.body == b"hello"
        assert isinstance(cmd.body, bytes)


def test_good_frames_before_a_bad_length_in_one_read_are_kept():
    good = RemotingCommand.request(34, body=b"{}").encode()
    dec = FrameDecoder()
    frames = dec.feed(good + good + b"\xff\xff\xff\xff")
    assert frames == [good, good]
    assert isinstance(dec.error, FrameError)
    with pytest.raises(FrameError):
        dec.feed(good)


def test_a_header_past_the_maximum_is_refused_from_its_length_and_its_opaque_found_unparsed():
    """A header past MAX_HEADER_SIZE is refused before it is parsed (12.5 MB of fields held the loop seconds); its
    code, opaque and flag are found without parsing, for its answer: by their names in JSON (not a string of
    extFields named alike), at their places in a ROCKETMQ header."""
    big = {"opaque": "5", "p": "x" * MAX_HEADER_SIZE}
    for stype in (0, 1):
        frame = RemotingCommand(10, opaque=77, flag=2, ext_fields=big, serialize_type=stype).encode()
        with pytest.raises(HeaderTooLargeError):
            RemotingCommand.decode(frame)
        assert _unread_fields(frame) == (10, 77, 2)
    header = b'{"code":10,"extFields":{"a":"\\"opaque\\":9"},"opaque" : 1234}'
    assert _unread_fields(struct.pack(">ii", 4 + len(header), len(header)) + header) == (10, 1234, 0)
    header = b'{"code":10,"extFields":{"opaque":"9"}}'
    assert _unread_fields(struct.pack(">ii", 4 + len(header), len(header)) + header) == (10, None, 0)


@bounded(30)
async def test_a_response_past_the_maximum_fails_its_request_at_once_not_at_its_timeout():
    """A response whose header is past MAX_HEADER_SIZE is not parsed either; its request (the broker's to a
    consumer or a requester, a tool's or a slave's to a broker) failed only at its timeout, RequestTimeoutError "got
    no response", though one came (found in review). It fails at once with the refusal, the connection kept."""
    loop = asyncio.get_running_loop()

    def handler(conn, cmd):
        remark = "r" * MAX_HEADER_SIZE if cmd.code == 1 else "ok"
        return cmd.response(0, remark)

    server = await loop.create_server(lambda: RemotingConnection(handler), "127.0.0.1", 0)
    client = await open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        for stype in (0, 1):
            call = client.request(RemotingCommand.request(1, {}, serialize_type=stype), 600)
            with pytest.raises(HeaderTooLargeError):
                await asyncio.wait_for(call, 20)     # (600 s: the timeout would be the test's bound, not the answer)
            assert not client._pending
        assert (await asyncio.wait_for(client.request(RemotingCommand.request(2, {}), 20), 20)).remark == "ok"
    finally:
        client.close()
        server.close()
        await server.wait_closed()


@bounded(30)
async def test_a_oneway_request_past_the_maximum_is_not_answered_and_the_next_is():
    """A oneway frame past MAX_HEADER_SIZE (an END_TRANSACTION with a huge remark) is refused unanswered: its peer
    awaits nothing, and an answer under its opaque could meet a request of its own. The next request is answered."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: RemotingConnection(lambda conn, cmd: cmd.response(0, "ok")),
                                      "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        for stype in (0, 1):
            huge = RemotingCommand.request(37, {"p": "x" * MAX_HEADER_SIZE}, oneway=True, opaque=41,
                                           serialize_type=stype)
            writer.write(huge.encode() + RemotingCommand.request(38, {}, opaque=42 + stype).encode())
            decoder, frames = FrameDecoder(), []
            while not frames:
                frames = decoder.feed(await reader.read(65536))
            [answer] = [RemotingCommand.decode(f) for f in frames]
            assert (answer.opaque, answer.remark) == (42 + stype, "ok")
    finally:
        writer.close()
        server.close()
        await server.wait_closed()
