"""encode_batch_records (the one-pass batch encoder) makes exactly the records of the per-entry path."""
from __future__ import annotations

import pytest

from protocol.message import (
    decode_batch,
    drop_property,
    encode_batch,
    encode_batch_records,
    encode_record,
    java_string_hash,
    pack_host,
    properties_appender,
    property_value,
)

BORN = pack_host("10.1.2.3", 40000)
STORE = pack_host("127.0.0.1", 10911)


def per_entry(body: bytes, extra: dict[str, str], topic=b"T", qid=3, sys_flag=0, born_ts=1234567890123):
    append = properties_appender(extra)
    recs, tags = [], []
    for flag, b, text in decode_batch(body):
        text = append(drop_property(text, "WAIT"))      # as _batch_requests_slow: WAIT is not stored
        recs.append(bytes(encode_record(topic=topic, body=b, queue_id=qid, flag=flag, sys_flag=sys_flag,
                                        born_timestamp=born_ts, born_host=BORN, store_host=STORE,
                                        properties=text.encode())))
        t = property_value(text, "TAGS")
        tags.append(java_string_hash(t) if t else 0)
    return recs, tags


def one_pass(body: bytes, extra: dict[str, str], topic=b"T", qid=3, sys_flag=0, born_ts=1234567890123):
    got = encode_batch_records(body, topic=topic, queue_id=qid, sys_flag=sys_flag, born_timestamp=born_ts,
                               born_host=BORN, store_host=STORE, extra=extra)
    if got is None:
        return None
    out, sizes, tags, bodies = got
    recs, at = [], 0
    for n in sizes:
        recs.append(bytes(out[at:at + n]))
        at += n
    assert at == len(out)
    assert bodies == sum(len(b) for _, b, _ in decode_batch(body))
    return recs, tags


@pytest.mark.parametrize("entries, extra", [
    ([(0, b"x" * 100, f"TAGS\x01t{i}\x02KEYS\x01k{i}\x02UNIQ_KEY\x01ABC{i:04X}\x02") for i in range(32)],
     {"CLUSTER": "DefaultCluster"}),
    ([(7, b"", ""), (1, b"y", "KEYS\x01a b"), (2, b"z" * 3, "UNIQ_KEY\x01U\x02")],
     {"CLUSTER": "c", "TAGS": "batchtag"}),                      # TAGS inherited from the batch
    ([(0, b"q", "XTAGS\x01no\x02TAGS\x01yes\x02"), (0, b"r", "TAGS\x01\x02")], {"CLUSTER": "c"}),
    ([(0, b"body", "a\x01b\x02\x02TAGS\x01x")], {"CLUSTER": "c", "PGROUP": "g"}),
    # A stock Java producer's entries: every one names WAIT (Message's constructor sets it), dropped as the
    # per-entry path drops it; a name merely ending in WAIT is kept.
    ([(0, b"x", f"WAIT\x01true\x02UNIQ_KEY\x01{i:032X}\x02") for i in range(8)], {"CLUSTER": "c"}),
    ([(0, b"x", "UNIQ_KEY\x01U\x02WAIT\x01false"), (0, b"y", "WAIT\x01true"), (0, b"z", "")], {"CLUSTER": "c"}),
    ([(0, b"x", "XWAIT\x01v\x02TAGS\x01t\x02WAIT\x01true\x02"), (0, b"y", "XWAIT\x01v")], {"CLUSTER": "c"}),
])
def test_same_records_as_the_per_entry_path(entries, extra):
    body = encode_batch(entries)
    for sys_flag in (0, 1):
        assert one_pass(body, extra, sys_flag=sys_flag) == per_entry(body, extra, sys_flag=sys_flag)


@pytest.mark.parametrize("entries, extra", [
    ([(0, b"x", "DELAY\x013")], {"CLUSTER": "c"}),
    ([(0, b"x", "TRAN_MSG\x01true")], {"CLUSTER": "c"}),
    ([(0, b"x", "TIMER_DELAY_MS\x0110")], {"CLUSTER": "c"}),
    ([(0, b"x", "CLUSTER\x01mine\x02")], {"CLUSTER": "c"}),      # names a batch-level pair itself
    ([(0, b"x", "KEYS\x01\u00e9")], {"CLUSTER": "c"}),            # not ASCII
    ([(0, b"x", "KEYS\x01k")], {}),
    ([], {"CLUSTER": "c"}),
])
def test_the_uncommon_batch_takes_the_general_path(entries, extra):
    assert one_pass(encode_batch(entries), extra) is None


def test_a_stock_java_producers_batch_takes_the_one_pass_path():
    """Every entry of a Java producer's batch names WAIT=true: sent to the per-entry path for it, 4,096 of them
    held the loop some 42 ms in _batch_requests_slow (after 7 ms of this encoder giving up), against 14 ms here."""
    body = encode_batch([(0, b"x", f"WAIT\x01true\x02UNIQ_KEY\x01{i:032X}\x02") for i in range(4096)])
    got = one_pass(body, {"CLUSTER": "c"})
    assert got is not None
    assert got == per_entry(body, {"CLUSTER": "c"})
    assert all(b"WAIT\x01" not in r for r in got[0])


def test_malformed_body_takes_the_general_path():
    body = encode_batch([(0, b"x" * 10, "KEYS\x01k")])
    for bad in (body[:-1], body + b"\x00", body[:21]):
        assert one_pass(bad, {"CLUSTER": "c"}) is None


def test_a_batch_entry_with_properties_past_the_limit_is_refused_clearly():
    """The entry's properties length is a short: past 32767 bytes encode_batch raised struct.error."""
    import pytest

    from protocol.errors import MessageIllegalError
    from protocol.message import encode_batch
    with pytest.raises(MessageIllegalError, match="message 1 of the batch not sent: its properties are 40006 bytes"):
        encode_batch([(0, b"a", "k\x01v"), (0, b"b", "k\x01" + "x" * 40004)])


def test_batch_entries_past_counts_entries_up_to_one_past_the_limit():
    from protocol.message import batch_entries_past     # (here: a file without it still collects)
    assert not batch_entries_past(encode_batch([(0, b"x", "")] * 100), 100)
    assert batch_entries_past(encode_batch([(0, b"x", "")] * 101), 100)
    assert not batch_entries_past(encode_batch([(0, b"x" * 50, "")] * 3), 100)      # too short to hold 101
    assert not batch_entries_past(b"\x00" * 5000, 100)          # not a batch: left to its decoder to refuse
