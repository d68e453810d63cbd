"""Store records (IPv4 and IPv6 hosts), batches, properties, message ids, tag hashes and the send header."""
from __future__ import annotations

import struct
import time
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codes import RequestCode, SysFlag
from protocol.command import RemotingCommand
from protocol.errors import HeaderError, RecordError
from protocol.message import (
    BLANK_MAGIC, MESSAGE_MAGIC, POS_PHYSICAL_OFFSET, POS_QUEUE_OFFSET, POS_SYSFLAG, MessageExt, Prop,
    SendMessageRequestHeader, UniqIdGenerator, decode_batch, decode_offset_msg_id, decode_record, decode_records,
    encode_batch, encode_record, java_string_hash, offset_msg_id, pack_host, peek_record, properties_to_string,
    record_size, store_timestamp_pos, string_to_properties, tags_code, unpack_host, validate_topic,
)

V4 = pack_host("10.0.0.5", 40000)
V6 = pack_host("2001:db8::1", 10911)
STORE_V4 = pack_host("127.0.0.1", 10911)


def make(born=V4, store=STORE_V4, **overrides) -> bytearray:
    fields = dict(topic=b"T", body=b"hello", queue_id=3, flag=-1, sys_flag=SysFlag.TRANSACTION_COMMIT,
                  born_timestamp=1_700_000_000_000, born_host=born, store_host=store,
                  properties=b"TAGS\x01TagA\x02KEYS\x01k1 k2\x02UNIQ_KEY\x01ABC",
                  queue_offset=7, physical_offset=4096, store_timestamp=1_700_000_000_500, reconsume_times=2,
                  prepared_offset=1024)
    fields.update(overrides)
    return encode_record(**fields)


# ------------------------------------------------------------------ records
@pytest.mark.parametrize("born, store, size", [(V4, STORE_V4, 0), (V6, STORE_V4, 12), (V4, V6, 12), (V6, V6, 24)],
                         ids=["v4-v4", "v6-born", "v6-store", "v6-v6"])
def test_record_round_trip_with_host_variants(born, store, size):
    raw = make(born, store)
    props = b"TAGS\x01TagA\x02KEYS\x01k1 k2\x02UNIQ_KEY\x01ABC"
    assert len(raw) == 91 + 5 + 1 + len(props) + size == record_size(5, 1, len(props), decode_record(raw)[0].sys_flag)
    msg, total = decode_record(raw, check_crc=True)
    assert total == len(raw) == msg.store_size
    assert (msg.topic, msg.body, msg.queue_id, msg.flag, msg.queue_offset, msg.physical_offset) == \
        ("T", b"hello", 3, -1, 7, 4096)
    assert (msg.born_timestamp, msg.store_timestamp, msg.reconsume_times, msg.prepared_offset) == \
        (1_700_000_000_000, 1_700_000_000_500, 2, 1024)
    assert msg.born_host == unpack_host(born) and msg.store_host == unpack_host(store)
    assert bool(msg.sys_flag & SysFlag.BORNHOST_V6) == (born is V6)
    assert bool(msg.sys_flag & SysFlag.STOREHOST_V6) == (store is V6)
    assert SysFlag.transaction_type(msg.sys_flag) == SysFlag.TRANSACTION_COMMIT
    assert msg.properties == {"TAGS": "TagA", "KEYS": "k1 k2", "UNIQ_KEY": "ABC"}
    assert msg.tags == "TagA" and msg.keys == "k1 k2" and msg.msg_id == "ABC"
    assert msg.body_crc == zlib.crc32(b"hello") & 0x7FFFFFFF
    assert bytes(msg.encode()) == bytes(raw)


def test_record_layout_fixed_positions():
    raw = make()
    assert struct.unpack_from(">ii", raw) == (len(raw), MESSAGE_MAGIC)
    assert MESSAGE_MAGIC & 0xFFFFFFFF == 0xDAA320A7 and BLANK_MAGIC & 0xFFFFFFFF == 0xCBD43194
    assert struct.unpack_from(">q", raw, POS_QUEUE_OFFSET)[0] == 7
    assert struct.unpack_from(">q", raw, POS_PHYSICAL_OFFSET)[0] == 4096
    assert struct.unpack_from(">i", raw, POS_SYSFLAG)[0] == SysFlag.TRANSACTION_COMMIT
    assert struct.unpack_from(">q", raw, store_timestamp_pos(0))[0] == 1_700_000_000_500


def test_spec_size_example():
    # spec 6.1: body "hello", topic "T", 20 bytes of properties -> TOTALSIZE 117.
    assert len(make(properties=b"p" * 20)) == 117


@pytest.mark.parametrize("born", [V4, V6], ids=["v4", "v6"])
def test_store_patches_offsets_and_time_in_place(born):
    raw = make(born, queue_offset=0, physical_offset=0, store_timestamp=0)
    sys_flag = decode_record(raw)[0].sys_flag
    struct.pack_into(">q", raw, POS_QUEUE_OFFSET, 99)
    struct.pack_into(">q", raw, POS_PHYSICAL_OFFSET, 1 << 40)
    struct.pack_into(">q", raw, store_timestamp_pos(sys_flag), 123456)
    msg, _ = decode_record(raw, check_crc=True)
    assert (msg.queue_offset, msg.physical_offset, msg.store_timestamp) == (99, 1 << 40, 123456)
    assert msg.offset_msg_id == offset_msg_id(STORE_V4, 1 << 40)


def test_record_run_and_offsets_inside_a_buffer():
    a, b = make(), make(V6, V6, body=b"", properties=b"")
    run = bytes(a + b)
    assert [m.store_size for m in decode_records(run)] == [len(a), len(b)]
    msg, size = decode_record(memoryview(b"junk" + run), 4 + len(a))
    assert size == len(b) and msg.body == b"" and msg.properties == {}
    assert decode_records(b"") == []


def test_empty_and_maximum_fields():
    raw = make(topic=b"x" * 127, body=b"", properties=b"a\x01" + b"b" * 32765)
    msg, _ = decode_record(raw)
    assert msg.topic == "x" * 127 and len(msg.properties["a"]) == 32765
    with pytest.raises(RecordError):
        make(topic=b"x" * 128)
    with pytest.raises(RecordError):
        make(properties=b"p" * 32768)


def test_crc_is_checked_only_when_asked():
    raw = make(crc=12345)
    assert decode_record(raw)[0].body_crc == 12345
    with pytest.raises(RecordError, match="CRC"):
        decode_record(raw, check_crc=True)


def _patched(fmt: str, pos: int, value) -> bytearray:
    raw = make()
    struct.pack_into(fmt, raw, pos, value)
    return raw


@pytest.mark.parametrize("raw", [
    bytes(make())[:90], bytes(make())[:-1],
    _patched(">i", 4, BLANK_MAGIC), _patched(">i", 4, 0),                     # not a message record
    _patched(">i", 0, 90), _patched(">i", 0, 10_000), _patched(">i", 0, -1),  # TOTALSIZE
    _patched(">i", 84, -1), _patched(">i", 84, 6), _patched(">i", 84, 1 << 30),  # BODYLENGTH
    _patched(">b", 93, -1), _patched(">B", 93, 60),                           # TOPICLENGTH
    _patched(">h", 95, -1), _patched(">h", 95, 1),                            # PROPERTIESLENGTH
    _patched(">i", 36, SysFlag.BORNHOST_V6),                                  # host size no longer fits
    _patched(">B", 94, 0xFF),                                                 # topic not UTF-8
    _patched(">B", 97, 0xC0),                                                 # properties not UTF-8
], ids=lambda raw: f"{len(raw)}B")
def test_malformed_records_are_record_errors(raw):
    with pytest.raises(RecordError):
        decode_record(bytes(raw))


@pytest.mark.parametrize("raw", [
    bytes(make())[:90], bytes(make())[:-1], _patched(">i", 4, BLANK_MAGIC), _patched(">i", 0, 90),
    _patched(">i", 84, -1), _patched(">i", 84, 6), _patched(">B", 93, 60), _patched(">h", 95, 1),
    _patched(">i", 36, SysFlag.BORNHOST_V6), _patched(">B", 94, 0xFF), _patched(">B", 97, 0xC0),
], ids=lambda raw: f"{len(raw)}B")
def test_malformed_records_in_a_run_are_decode_records_errors_too(raw):
    good = bytes(make())
    with pytest.raises(RecordError) as fast:
        decode_records(good + bytes(raw))
    with pytest.raises(RecordError) as slow:
        decode_record(good + bytes(raw), len(good))
    assert str(fast.value) == str(slow.value)


_PROPS_TEXT = st.lists(st.tuples(st.sampled_from(["", "TAGS", "KEYS", "UNIQ_KEY", "a\x01b", "é"]),
                                 st.sampled_from(["", "v", "x\x01y", "TagA", "ü"]),
                                 st.sampled_from(["\x01", "", "\x01\x01"])), max_size=5)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_PROPS_TEXT, st.booleans(), st.booleans(), st.sampled_from([b"T", b"Topic_%RETRY%g", "é".encode()]),
                          st.binary(max_size=40)), max_size=6), st.booleans())
def test_decode_records_is_decode_record_at_each_record(records, trailing):
    # decode_records' inline path (IPv4 hosts, split properties) gives what decode_record gives,
    # properties with Java's trailing separator, empty names or values and duplicates included.
    run, expected = bytearray(), []
    for i, (pairs, born6, store6, topic, body) in enumerate(records):
        text = "\x02".join(n + sep + v for n, v, sep in pairs) + ("\x02" if trailing and pairs else "")
        raw = make(V6 if born6 else V4, V6 if store6 else pack_host(f"10.0.0.{i}", 10911 + i % 2), topic=topic,
                   body=body, properties=text.encode(), queue_offset=i, physical_offset=len(run))
        expected.append(decode_record(raw)[0])
        run += raw
    assert decode_records(bytes(run)) == expected
    assert decode_records(memoryview(run)) == expected
    assert all(m.properties == string_to_properties(properties_to_string(m.properties)) for m in expected)


def test_peek_record_reads_size_and_magic():
    assert peek_record(struct.pack(">ii", 64, BLANK_MAGIC)) == (64, BLANK_MAGIC)
    raw = make()
    assert peek_record(b"xx" + raw, 2) == (len(raw), MESSAGE_MAGIC)
    with pytest.raises(RecordError):
        peek_record(b"\x00" * 7)
    with pytest.raises(RecordError):
        peek_record(raw, -1)
    with pytest.raises(RecordError):
        decode_record(raw, -1)


# ---------------------------------------------------------------- batches
def test_batch_round_trip_and_layout():
    entries = [(0, b"one", "UNIQ_KEY\x01A\x02TAGS\x01x"), (-5, b"", ""), (1, b"\x00" * 300, "é\x01ü")]
    raw = encode_batch(entries)
    assert decode_batch(raw) == entries
    size, magic, crc, flag, body_len = struct.unpack_from(">iiiii", raw)
    assert (size, magic, crc, flag, body_len) == (20 + 3 + 2 + len("UNIQ_KEY\x01A\x02TAGS\x01x"), 0, 0, 0, 3)
    assert decode_batch(b"") == []


@pytest.mark.parametrize("raw", [
    encode_batch([(0, b"x", "")])[:-1], encode_batch([(0, b"x", "")])[:21],
    struct.pack(">iiiii", 21, 0, 0, 0, 0) + b"\x00\x00",   # size below the minimum
    struct.pack(">iiiii", 99, 0, 0, 0, 0) + b"\x00\x00",   # size past the end
    struct.pack(">iiiii", 22, 0, 0, 0, -1) + b"\x00\x00",  # negative body length
    struct.pack(">iiiii", 22, 0, 0, 0, 1) + b"\x00\x00",   # body runs past the entry
    struct.pack(">iiiii", 23, 0, 0, 0, 0) + b"\x00\x02\xff",  # properties length disagrees with size
    struct.pack(">iiiii", 23, 0, 0, 0, 0) + b"\x00\x01\xff",  # properties not UTF-8
])
def test_malformed_batches_are_record_errors(raw):
    with pytest.raises(RecordError):
        decode_batch(raw)


# ------------------------------------------------------------- properties
def test_properties_round_trip_and_java_parsing_rules():
    props = {"TAGS": "A", "KEYS": "k1 k2", "é": "ü"}
    text = properties_to_string(props)
    assert text == "TAGS\x01A\x02KEYS\x01k1 k2\x02é\x01ü"  # no trailing separator
    assert string_to_properties(text) == props
    assert properties_to_string({"a": "1", "b": None}) == "a\x011"
    assert properties_to_string(None) == "" == properties_to_string({})
    # Java keeps a piece only with a non-empty name and value; the value may hold U+0001.
    assert string_to_properties("a\x011\x02\x02=\x01\x02\x01v\x02b\x01x\x01y\x02c\x02") == {"a": "1", "b": "x\x01y"}
    assert string_to_properties("") == {} == string_to_properties(None)


# ---------------------------------------------------------------- tag hash
def reference_java_hash(text: str) -> int:
    """String.hashCode over UTF-16 code units, surrogate pairs computed by hand."""
    h = 0
    for ch in text:
        cp = ord(ch)
        units = [cp] if cp < 0x10000 else [0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF)]
        for unit in units:
            h = (h * 31 + unit) % (1 << 32)
    return h - (1 << 32) if h >= 1 << 31 else h


@pytest.mark.parametrize("text, expected", [
    ("TagA", 2598919), ("d", 100), ("", 0), ("hello", 99162322),
    ("polygenelubricants", -2 ** 31),  # Integer.MIN_VALUE: the sign wraps like Java's
    ("\U0001f600", 31 * 0xD83D + 0xDE00), ("é", 0xE9),
])
def test_java_string_hash_known_values(text, expected):
    assert java_string_hash(text) == expected == reference_java_hash(text)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(st.text(max_size=40))
def test_java_string_hash_matches_utf16_reference(text):
    value = java_string_hash(text)
    assert value == reference_java_hash(text)
    assert -2 ** 31 <= value < 2 ** 31


def test_tags_code():
    assert tags_code({Prop.TAGS: "TagA"}) == 2598919
    assert tags_code({}) == 0 == tags_code({Prop.TAGS: ""})


# --------------------------------------------------------------- message ids
def test_offset_msg_id_spec_example_and_round_trip():
    assert offset_msg_id(pack_host("127.0.0.1", 10911), 0) == "7F00000100002A9F0000000000000000"
    assert decode_offset_msg_id("7F00000100002A9F0000000000000000") == ("127.0.0.1", 10911, 0)
    assert decode_offset_msg_id("7f00000100002a9f00000000000003e8") == ("127.0.0.1", 10911, 1000)  # Go: either case
    v6 = offset_msg_id(V6, 2 ** 63 - 1)
    assert len(v6) == 56 and v6 == v6.upper()
    assert decode_offset_msg_id(v6) == ("2001:db8::1", 10911, 2 ** 63 - 1)


@pytest.mark.parametrize("text", ["", "7F", "7F00000100002A9F000000000000000", "7F00000100002A9F00000000000000000",
                                  "ZZ00000100002A9F0000000000000000", "7F00000100002A9F00000000000000é0", None, 42])
def test_bad_offset_msg_ids_are_header_errors(text):
    with pytest.raises(HeaderError):
        decode_offset_msg_id(text)


def test_hosts():
    assert pack_host("::ffff:10.0.0.1", 1) == pack_host("10.0.0.1", 1)  # v4-mapped stays 8 bytes
    assert len(pack_host("10.0.0.1", 1)) == 8 and len(pack_host("::1", 1)) == 20
    assert unpack_host(pack_host("fe80::2", 65535)) == ("fe80::2", 65535)


def test_uniq_ids_are_32_upper_hex_and_distinct():
    gen = UniqIdGenerator("10.1.2.3")
    ids = [gen.next() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(len(i) == 32 and i == i.upper() and i.startswith("0A010203") for i in ids)
    assert len(UniqIdGenerator("::1").next()) == 56


def test_uniq_ids_stay_distinct_when_the_wall_clock_steps_back(monkeypatch):
    """The id's time field is the wall clock's milliseconds into the month and its counter 16 bits: stepped back
    10 s, a producer that sent 4 messages a millisecond, then 20, gave again 24 of the 200,000 ids it had given
    before (wherever the ids given between a millisecond and its second visit came to a multiple of 65,536): two
    messages with one UNIQ_KEY, the second skipped by an idempotent consumer as a redelivery of the first. A step
    back draws a new per-process hash; the time field stays the wall clock's, also stepped back into the month
    before (a stock admin's queryMsgByUniqueKey reads the store time from it)."""
    import protocol.message as pm

    clock = [time.mktime((2026, 11, 1, 0, 0, 10, 0, 0, -1))]
    monkeypatch.setattr(pm.time, "time", lambda: clock[0])
    gen = UniqIdGenerator("10.1.2.3")

    def run(per_ms: int) -> list[str]:
        start, ids = clock[0], []
        for i in range(10_000):
            clock[0] = start + i / 1000
            ids += [gen.next() for _ in range(per_ms)]
        return ids

    before = run(4)
    clock[0] -= 10.0                # the same ten seconds again
    again = run(20)
    assert len(set(before + again)) == len(before) + len(again), "an id given twice"
    assert again[0][:12] == before[0][:12] and again[0][12:20] != before[0][12:20], "ip, pid; a new hash"
    clock[0] -= 20.0                # into October: ms into its month, not a negative time
    into_october = int(gen.next()[20:28], 16)
    assert into_october == int((clock[0] - time.mktime((2026, 10, 1, 0, 0, 0, 0, 0, -1))) * 1000)


def test_message_ext_msg_id_falls_back_to_offset_id():
    msg = MessageExt("T", b"", store_host=("127.0.0.1", 10911), physical_offset=5)
    assert msg.msg_id == msg.offset_msg_id == "7F00000100002A9F0000000000000005"


@pytest.mark.parametrize("topic, ok", [("T", True), ("%RETRY%G|x_y-z", True), ("", False), (None, False),
                                      ("a" * 127, True), ("a" * 128, False), ("a b", False), ("é", False)])
def test_validate_topic(topic, ok):
    assert (validate_topic(topic) is None) == ok


# -------------------------------------------------------------- send header
def test_send_header_v1_and_v2_round_trip():
    header = SendMessageRequestHeader("PID", "T", queue_id=2, sys_flag=4, born_timestamp=2 ** 40, flag=-3,
                                      properties="TRAN_MSG\x01true", reconsume_times=1, unit_mode=True,
                                      max_reconsume_times=16, batch=False, bname="broker-a")
    for code, v2 in ((RequestCode.SEND_MESSAGE_V2, True), (RequestCode.SEND_MESSAGE, False),
                     (RequestCode.SEND_BATCH_MESSAGE, True)):
        cmd = RemotingCommand.request(code, header.to_ext_fields(v2=v2))
        assert ("b" in cmd.ext_fields) == v2
        assert SendMessageRequestHeader.from_command(RemotingCommand.decode(cmd.encode())) == header


def test_send_header_v2_code_with_long_keys_is_read_too():
    cmd = RemotingCommand(RequestCode.SEND_MESSAGE_V2, ext_fields={
        "producerGroup": "G", "topic": "T", "queueId": "0", "sysFlag": "0", "bornTimestamp": "1", "flag": "0"})
    header = SendMessageRequestHeader.from_command(cmd)
    assert (header.producer_group, header.topic, header.default_topic, header.max_reconsume_times) == \
        ("G", "T", "TBW102", None)


_V2_OK = {"a": "G", "b": "T", "e": "0", "f": "0", "g": "1", "h": "0"}


@pytest.mark.parametrize("change", [
    {"a": ""}, {"b": None}, {"e": "x"}, {"f": "1.5"}, {"g": ""}, {"e": "2147483648"}, {"h": "-2147483649"},
    {"g": "9223372036854775808"}, {"d": "99999999999"}, {"j": "1e3"},
])
def test_send_header_errors(change):
    ext = {k: v for k, v in {**_V2_OK, **change}.items() if v is not None}
    with pytest.raises(HeaderError):
        SendMessageRequestHeader.from_command(RemotingCommand(RequestCode.SEND_MESSAGE_V2, ext_fields=ext))


def test_send_header_java_type_bounds_are_accepted():
    ext = {**_V2_OK, "e": "2147483647", "h": "-2147483648", "g": "9223372036854775807"}
    header = SendMessageRequestHeader.from_command(RemotingCommand(RequestCode.SEND_MESSAGE_V2, ext_fields=ext))
    assert (header.queue_id, header.flag, header.born_timestamp) == (2 ** 31 - 1, -2 ** 31, 2 ** 63 - 1)


@pytest.mark.parametrize("born, store", [(("10.1.2.3", 4), ("127.0.0.1", 10911)), (("::1", 5), ("fe80::1", 6))])
def test_retopic_record_moves_a_record_without_touching_its_payload(born, store):
    from protocol.codes import SysFlag
    from protocol.message import retopic_record
    half = MessageExt("RMQ_SYS_TRANS_HALF_TOPIC", b"payload" * 50, queue_id=0, flag=7, queue_offset=3,
                      physical_offset=999, sys_flag=SysFlag.COMPRESSED, born_timestamp=123, born_host=born,
                      store_timestamp=456, store_host=store, reconsume_times=2,
                      properties={"REAL_TOPIC": "Orders", "REAL_QID": "5", "TAGS": "t"})
    moved, size = decode_record(retopic_record(half.encode(), topic=b"Orders", queue_id=5,
                                               transaction_type=SysFlag.TRANSACTION_COMMIT, prepared_offset=999))
    assert (moved.topic, moved.queue_id, moved.prepared_offset) == ("Orders", 5, 999)
    assert (moved.queue_offset, moved.physical_offset, moved.store_timestamp) == (0, 0, 0)
    assert moved.sys_flag & SysFlag.TRANSACTION_MASK == SysFlag.TRANSACTION_COMMIT
    assert moved.sys_flag & SysFlag.COMPRESSED
    assert (moved.body, moved.flag, moved.born_timestamp, moved.born_host, moved.store_host,
            moved.reconsume_times, moved.properties) == (half.body, 7, 123, half.born_host, half.store_host, 2,
                                                           half.properties)
    with pytest.raises(RecordError):
        retopic_record(half.encode()[:-1], topic=b"x", queue_id=0, transaction_type=8, prepared_offset=0)



@pytest.mark.parametrize("born, store", [(("10.1.2.3", 4), ("127.0.0.1", 10911)), (("::1", 5), ("10.0.0.1", 6)),
                                         (("10.0.0.1", 5), ("fe80::1", 6))])
def test_record_body_length_reads_the_body_length_past_either_host_form(born, store):
    from protocol.message import record_body_length
    for body in (b"", b"x" * 123):
        m = MessageExt("T", body, queue_id=0, flag=0, queue_offset=0, physical_offset=0, sys_flag=0,
                       born_timestamp=1, born_host=born, store_timestamp=2, store_host=store,
                       properties={"TAGS": "t"})
        assert record_body_length(memoryview(m.encode())) == len(body)

# ------------------------------------------------ batch entry properties, without a parse and re-serialise
def test_property_value_finds_whole_names_only():
    from protocol.message import property_value
    text = "MY_TAGS\x01no\x02TAGS\x01yes\x02KEYS\x01k1 k2"
    assert property_value(text, "TAGS") == "yes"
    assert property_value(text, "KEYS") == "k1 k2"                 # the last pair, no trailing separator
    assert property_value(text, "MY_TAGS") == "no"
    assert property_value(text, "AGS") is None
    assert property_value("", "TAGS") is None


def test_drop_property_keeps_the_rest_byte_for_byte():
    from protocol.message import drop_property
    assert drop_property("WAIT\x01true\x02KEYS\x01a\x02", "WAIT") == "KEYS\x01a\x02"
    assert drop_property("KEYS\x01a\x02WAIT\x01true\x02", "WAIT") == "KEYS\x01a\x02"
    assert drop_property("KEYS\x01a\x02WAIT\x01true", "WAIT") == "KEYS\x01a\x02"
    assert drop_property("NOWAIT\x01x\x02", "WAIT") == "NOWAIT\x01x\x02"


def test_appended_batch_properties_let_the_entry_win():
    from protocol.message import properties_appender, string_to_properties

    def add_missing_properties(text, extra):
        return properties_appender(extra)(text)
    entry = "UNIQ_KEY\x01mine\x02KEYS\x01own"
    merged = add_missing_properties(entry, {"KEYS": "batch", "CLUSTER": "C1"})
    assert merged.startswith(entry)
    assert string_to_properties(merged) == {"UNIQ_KEY": "mine", "KEYS": "own", "CLUSTER": "C1"}
    assert add_missing_properties("A\x01b\x02", {"C": "d"}) == "A\x01b\x02C\x01d"
    assert add_missing_properties("", {"C": "d"}) == "C\x01d"
    assert add_missing_properties("C\x01mine", {"C": "d"}) == "C\x01mine"


def test_a_pulled_record_splits_its_properties_on_first_use_and_keeps_them():
    raw = bytes(make(properties=b"TAGS\x01a\x02KEYS\x01k1 k2\x02UNIQ_KEY\x01ID1\x02"))
    (msg,) = decode_records(raw)
    assert msg._props is None and msg._props_text is not None          # nothing split yet
    assert msg.body == b"hello" and msg.topic == "T"                    # the rest is there without it
    assert msg.tags == "a" and msg.keys == "k1 k2" and msg.msg_id == "ID1"
    props = msg.properties
    assert props is msg.properties and msg._props_text is None          # split once, then kept
    msg.properties["EXTRA"] = "1"
    assert msg.properties["EXTRA"] == "1"                               # a change is kept
    msg.properties = {"TAGS": "b"}
    assert msg.tags == "b"
    assert MessageExt("T", b"").properties == {}


def test_message_ext_compares_prints_copies_and_pickles_by_its_fields():
    import copy
    import pickle
    raw = bytes(make(properties=b"TAGS\x01a"))
    (lazy,) = decode_records(raw)
    eager, _ = decode_record(raw)
    assert lazy == eager and lazy != MessageExt("T", b"hello")
    assert repr(lazy) == repr(eager) and "properties={'TAGS': 'a'}" in repr(lazy)
    (lazy2,) = decode_records(raw)
    for clone in (copy.copy(lazy2), copy.deepcopy(lazy2), pickle.loads(pickle.dumps(lazy2))):
        assert clone == eager and clone.properties == {"TAGS": "a"}
    with pytest.raises(TypeError):
        hash(lazy)
    assert lazy.__eq__(object()) is NotImplemented


@settings(max_examples=300, deadline=None)
@given(_PROPS_TEXT, st.booleans())
def test_decode_records_keeps_decode_record_s_property_order(pairs, trailing):
    # Equal dicts are not enough: the order of msg.properties is what properties_to_string writes
    # back (a send-back, MessageExt.encode) and what repr shows. A name repeated after an empty
    # value ("A\x01\x02B\x01b\x02A\x01y") is where a plain dict() of the pairs orders it otherwise.
    text = "\x02".join(n + sep + v for n, v, sep in pairs) + ("\x02" if trailing and pairs else "")
    raw = bytes(make(properties=text.encode()))
    (lazy,) = decode_records(raw)
    eager, _ = decode_record(raw)
    assert list(lazy.properties.items()) == list(eager.properties.items())
    assert repr(lazy) == repr(eager)
    assert lazy.encode() == eager.encode()


def test_decode_records_orders_a_name_repeated_after_an_empty_value_as_decode_record():
    raw = bytes(make(properties=b"A\x01\x02B\x01b\x02A\x01y"))
    (lazy,) = decode_records(raw)
    assert list(lazy.properties) == list(decode_record(raw)[0].properties) == ["B", "A"]


def test_a_pulled_records_properties_read_by_two_threads_at_once_are_never_emptied():
    # Deterministic interleaving: a line trace runs "the other thread's" whole first read of
    # msg.properties just after this read found nothing split yet. The getter then read the text
    # the other read had already cleared, split None into {} and stored it: every later read of the
    # message saw no properties at all (a listener handed to a thread pool, say).
    import sys
    raw = bytes(make(properties=b"TAGS\x01a\x02UNIQ_KEY\x01ID1"))
    (msg,) = decode_records(raw)
    getter = type(msg).properties.fget.__code__
    other = []

    def trace(frame, event, arg):
        if frame.f_code is not getter:
            return None
        def local(frame, event, arg):
            if event == "line" and not other and frame.f_locals.get("props", 0) is None:
                other.append(msg.properties)        # not traced: a trace function's own calls are not
            return local
        return local
    sys.settrace(trace)
    try:
        mine = msg.properties
    finally:
        sys.settrace(None)
    assert other == [{"TAGS": "a", "UNIQ_KEY": "ID1"}]
    assert mine == {"TAGS": "a", "UNIQ_KEY": "ID1"}
    assert msg.properties == {"TAGS": "a", "UNIQ_KEY": "ID1"} and msg.tags == "a"


def test_uniq_ids_of_a_forked_child_differ_from_its_parents():
    """A producer made before a fork (a pre-fork server, multiprocessing's fork start) was copied whole into the
    child: its pid, hash and counter, so parent and child gave the same UNIQ_KEYs in the same millisecond, and an
    idempotent consumer skipped one of the two messages as a redelivery."""
    import os
    gen = UniqIdGenerator("10.1.2.3")
    gen.next()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:        # the child: its next id's prefix and counter, to the parent
        try:
            os.write(w, gen.next().encode())
        finally:
            os._exit(0)
    os.close(w)
    child = os.read(r, 100).decode()
    os.close(r)
    os.waitpid(pid, 0)
    mine = gen.next()
    assert child[:16] != mine[:16], "the child kept its parent's ip/pid/hash prefix"
