"""protocol/record.py, the in-place field readers the store's scans use, held to the full codec (decode_record)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import RecordError
from protocol.message import decode_record, encode_record, pack_host, properties_to_string, string_to_properties
from protocol.record import MESSAGE_MAGIC_BYTES, MIN_RECORD_SIZE, RECORD_HEAD, read_index_fields, store_timestamp_at

hosts = st.sampled_from([("127.0.0.1", 10911), ("10.1.2.3", 1), ("::1", 7), ("2001:db8::5", 65535)])


@settings(max_examples=200, deadline=None)
@given(topic=st.from_regex(r"[A-Za-z0-9_%|-]{1,127}", fullmatch=True), body=st.binary(max_size=2000),
       props=st.dictionaries(st.text("abcXYZ", min_size=1, max_size=5), st.text("xyz01é", min_size=1, max_size=9),
                             max_size=4),
       born=hosts, store=hosts, pos=st.integers(0, 300), sys_flag=st.sampled_from([0, 4, 8, 12, 1]))
def test_readers_agree_with_the_codec(topic, body, props, born, store, pos, sys_flag):
    rec = encode_record(topic=topic.encode(), body=body, queue_id=3, flag=1, sys_flag=sys_flag, born_timestamp=5,
                        born_host=pack_host(*born), store_host=pack_host(*store),
                        properties=properties_to_string(props).encode(), queue_offset=9, physical_offset=4096 + pos,
                        store_timestamp=77, prepared_offset=12)
    buf = bytearray(pos) + rec + bytearray(16)
    msg, total = decode_record(buf, pos, check_crc=True)
    size, magic, crc, qid, flag, qoff, phys, flags = RECORD_HEAD.unpack_from(buf, pos)
    assert (size, crc, qid, flag, qoff, phys, flags) == (total, msg.body_crc, msg.queue_id, msg.flag,
                                                          msg.queue_offset, msg.physical_offset, msg.sys_flag)
    assert buf[pos + 4:pos + 8] == MESSAGE_MAGIC_BYTES and size >= MIN_RECORD_SIZE
    ts, prepared, got_topic, (lo, n) = read_index_fields(buf, pos, size, flags, crc)
    assert (ts, prepared, got_topic) == (msg.store_timestamp, msg.prepared_offset, msg.topic)
    assert string_to_properties(buf[lo:lo + n].decode()) == msg.properties and lo + n == pos + size
    assert store_timestamp_at(buf, pos) == 77
    assert store_timestamp_at(memoryview(buf)[pos:pos + size], 0) == 77      # a record as the store hands it out
    body_at = pos + size - len(rec) + 72 + len(pack_host(*born)) + len(pack_host(*store))
    for at, mask in [(body_at - 1, 0x80), (body_at + len(body), 0x80)]:          # body length, topic length
        buf[at] ^= mask
        with pytest.raises(RecordError):
            read_index_fields(buf, pos, size, flags, crc)
        buf[at] ^= mask
    if body:
        buf[body_at] ^= 0x41
        with pytest.raises(RecordError, match="body CRC mismatch"):
            read_index_fields(buf, pos, size, flags, crc)
        read_index_fields(buf, pos, size, flags, None)          # no CRC asked: the rest still adds up
        buf[body_at] ^= 0x41


def test_lengths_that_do_not_add_up_are_named():
    rec = encode_record(topic=b"T", body=b"abc", queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                        born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2), properties=b"")
    size = len(rec)
    with pytest.raises(RecordError, match="properties length 0 does not end the record"):
        read_index_fields(rec + b"\0", 0, size + 1, 0)
    bad = bytearray(rec)
    bad[size - 3] = 0xFF               # the one-byte topic ("T", before the 2-byte properties length): not UTF-8
    with pytest.raises(RecordError, match="topic is not UTF-8"):
        read_index_fields(bad, 0, size, 0)
