"""protocol/txlog.py: the transaction records' one vocabulary, as the broker writes it and ops/spark reads it.

* Each record kind (half, decision op for every decision, check attempt, dead letter) is
  built by the broker's RecordFactory, decoded as a store record, and read back through
  txlog (parse_op, parse_dead_letter) and through the Spark scan (ops/spark/segments
  rows): what goes in comes out, with the consume-queue tag code Java would compute.
* ops/ holds no literal copy of any name txlog declares (checked on the source with ast,
  docstrings excepted), and txlog imports nothing of the broker.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from broker.transaction import records
from broker.transaction.records import RecordFactory
from ops.spark.segments import ROW_FIELDS, Chunk, Segment, decode_chunk
from protocol import txlog
from protocol.codes import SysFlag
from protocol.message import MessageExt, Prop, UniqIdGenerator, decode_record, java_string_hash, pack_host

REPO = Path(__file__).resolve().parents[2]
HOST = pack_host("127.0.0.1", 10911)
NOW = 1_700_000_000_000


def factory() -> RecordFactory:
    return RecordFactory(HOST, UniqIdGenerator(), lambda: NOW)


def stored(req) -> MessageExt:
    """The record as the store would hold it (the writer's patches are not needed to read it back)."""
    msg, size = decode_record(bytes(req.record), check_crc=True)
    assert size == len(req.record)
    return msg


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("op, reason", [(txlog.COMMIT, None), (txlog.ROLLBACK, None), (txlog.DEAD, "expired"),
                                        (txlog.RESUME, None), (txlog.DEAD, "max-checks")])
def test_decision_op_round_trip(op, reason):
    req = factory().decision(op, 123_456_789, 42, reason)
    assert (req.topic, req.queue_id) == (txlog.OP_TOPIC, 0)
    assert req.tags_code == java_string_hash(txlog.OP_TAG_DECISION) == 100
    msg = stored(req)
    assert msg.topic == txlog.OP_TOPIC and msg.body == b"42"
    assert msg.properties[Prop.TAGS] == txlog.OP_TAG_DECISION and msg.properties[Prop.WAIT] == "false"
    got = txlog.parse_op(msg)
    assert got == txlog.OpRecord(txlog.OP_TAG_DECISION, 123_456_789, 42, op, 0, reason, msg.store_timestamp)


@pytest.mark.parametrize("attempt", [1, 2, 15])
def test_check_op_round_trip(attempt):
    req = factory().check(987, 3, attempt)
    assert req.tags_code == java_string_hash(txlog.OP_TAG_CHECK) == 99
    got = txlog.parse_op(stored(req))
    assert (got.tag, got.half_offset, got.half_queue_offset, got.op, got.checks, got.reason) == (
        txlog.OP_TAG_CHECK, 987, 3, None, attempt, None)


def test_half_and_dead_letter_round_trip():
    f = factory()
    props = {Prop.PGROUP: "PG", Prop.TAGS: "TagA", Prop.UNIQ_KEY: "U1", Prop.TRAN_MSG: "true"}
    half_req = f.half(body=b"payload", real_topic="Orders", real_qid=3, flag=5, sys_flag=SysFlag.TRANSACTION_PREPARED,
                      born_timestamp=NOW - 5, born_host=pack_host("10.0.0.9", 4000), props=dict(props))
    half = stored(half_req)
    assert (half.topic, half.queue_id, half_req.topic) == (txlog.HALF_TOPIC, 0, txlog.HALF_TOPIC)
    assert half.properties[Prop.REAL_TOPIC] == "Orders" and half.properties[Prop.REAL_QID] == "3"
    dead_req = f.dead_letter(half, 4096, "max-checks")
    assert (dead_req.topic, dead_req.queue_id) == (txlog.DEAD_TOPIC, 0)
    dead = stored(dead_req)
    assert dead.body == b"payload" and dead.born_host == ("10.0.0.9", 4000)
    assert txlog.parse_dead_letter(dead) == (4096, "max-checks")
    assert {k: dead.properties[k] for k in props} == props      # the half's properties are kept
    assert txlog.parse_op(dead) is None                         # not an op: its TAGS is the user's


def test_foreign_and_damaged_ops_are_not_ours():
    ours = stored(factory().decision(txlog.COMMIT, 10, 1))
    rocketmq = MessageExt(txlog.OP_TOPIC, b"1", properties={Prop.TAGS: "d"})      # RocketMQ's op: no TXMQ_HALF
    assert txlog.parse_op(rocketmq) is None
    for body, props in ((b"x1", {}), (b"1", {txlog.P_HALF: "ten"}), (b"1", {txlog.P_CHECKS: "many"})):
        bad = MessageExt(txlog.OP_TOPIC, body, properties={**ours.properties, **props})
        assert txlog.parse_op(bad) is None
    assert txlog.parse_dead_letter(MessageExt(txlog.DEAD_TOPIC, b"", properties={})) is None


def test_builders_refuse_words_outside_the_vocabulary():
    with pytest.raises(ValueError):
        txlog.op_properties("x", 1, "U")
    with pytest.raises(ValueError):
        txlog.decision_extra("MAYBE")


def test_spark_scan_reads_what_the_broker_writes(tmp_path):
    """The broker's records, laid out as a segment, come out of ops/spark's decoder with every txlog field."""
    f = factory()
    reqs = [f.decision(txlog.COMMIT, 111, 7), f.decision(txlog.DEAD, 222, 8, "expired"), f.check(333, 9, 4)]
    half = stored(f.half(body=b"b", real_topic="T", real_qid=0, flag=0, sys_flag=0, born_timestamp=NOW,
                         born_host=HOST, props={Prop.PGROUP: "PG"}))
    reqs.append(f.dead_letter(half, 444, "max-checks"))
    data = bytearray()
    for req in reqs:
        record = bytearray(req.record)
        record[28:36] = len(data).to_bytes(8, "big")        # PHYSICALOFFSET, as the writer patches it
        data += record
    path = tmp_path / ("0" * 20)
    path.write_bytes(bytes(data) + bytes(64))
    seg = Segment(path.name, str(path), 0, path.stat().st_size, False)
    rows = [dict(zip(ROW_FIELDS, r)) for r in decode_chunk(Chunk(seg, 0, seg.size, True)) if r[0] == "rec"]
    got = [(r["topic"], r["tags"], r["txmq_op"], r["txmq_half"], r["txmq_reason"], r["txmq_checks"]) for r in rows]
    assert got == [(txlog.OP_TOPIC, txlog.OP_TAG_DECISION, txlog.COMMIT, 111, None, None),
                   (txlog.OP_TOPIC, txlog.OP_TAG_DECISION, txlog.DEAD, 222, "expired", None),
                   (txlog.OP_TOPIC, txlog.OP_TAG_CHECK, None, 333, None, 4),
                   (txlog.DEAD_TOPIC, None, None, 444, "max-checks", None)]


def test_records_module_re_exports_the_vocabulary():
    """broker/transaction/service.py imports these from records; they are txlog's own objects."""
    for name in ("COMMIT", "ROLLBACK", "DEAD", "RESUME", "OP_TAG_DECISION", "OP_TAG_CHECK", "P_OP", "P_HALF",
                 "P_CHECKS", "P_REASON", "OpRecord", "parse_op"):
        assert getattr(records, name) is getattr(txlog, name)


# ------------------------------------------------------------------ one copy
def vocabulary() -> set[str]:
    return set(txlog.TOPICS) | set(txlog.PROPERTIES) | set(txlog.OPS) | set(txlog.OP_TAG_CODES)


def literal_copies(source: str, words: set[str]) -> list[tuple[int, str]]:
    """(line, text) of string constants, docstrings excepted, that are or contain a vocabulary word
    (one-letter words -- the tags -- only when the constant is exactly that letter)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
            if text in words or any(len(w) > 1 and w in text for w in words):
                found.append((node.lineno, text))
    return found


def test_ops_holds_no_copy_of_the_vocabulary():
    words = vocabulary()
    copies = []
    for path in sorted((REPO / "ops").rglob("*.py")):
        copies += [(path.relative_to(REPO).as_posix(), line, text)
                   for line, text in literal_copies(path.read_text(encoding="utf-8"), words)]
    assert copies == [], "ops names txlog's words itself; import them from protocol.txlog"


def test_the_checker_finds_copies():
    words = vocabulary()
    src = '"""RMQ_SYS_TRANS_HALF_TOPIC in a docstring is fine."""\nA = "RMQ_SYS_TRANS_OP_HALF_TOPIC"\n' \
          'def f(p):\n    """TXMQ_OP"""\n    return p.get("TXMQ_HALF"), p == "d", p.isin("DEAD"), "dead", "c-d"\n'
    assert literal_copies(src, words) == [(2, "RMQ_SYS_TRANS_OP_HALF_TOPIC"), (5, "TXMQ_HALF"), (5, "d"), (5, "DEAD")]


def test_txlog_imports_only_protocol():
    tree = ast.parse((REPO / "protocol" / "txlog.py").read_text(encoding="utf-8"))
    modules = [n.module if isinstance(n, ast.ImportFrom) and not n.level else "." + (n.module or "")
               for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert all(m.startswith(".") or m in ("__future__", "dataclasses") for m in modules), modules


@pytest.mark.parametrize("owner, written", [
    ("10.0.0.7@4242", "10.0.0.7@4242"),
    ("", None),
    ("x" * (txlog.OWNER_MAX + 1), None),                       # too long: its sender is only not known
    (f"evil\x02{txlog.P_CHECKS}\x01999", None),                # a separator would write a property of its choosing
    ("evil\x01", None),
    ("\ud800", None),                                          # a lone surrogate does not encode: nor would the record
    ("10.0.0.7@caf\u00e9", "10.0.0.7@caf\u00e9"),
])
def test_a_check_op_carries_its_senders_client_id_only_when_it_is_a_plain_value(owner, written):
    got = txlog.parse_op(stored(factory().check(987, 3, 2, owner)))
    assert (got.checks, got.owner) == (2, written)


def test_a_sender_record_names_the_sender_and_counts_as_no_check_attempt():
    got = txlog.parse_op(stored(factory().sender(987, 3, "10.0.0.7@4242")))
    assert (got.tag, got.half_offset, got.half_queue_offset, got.op, got.checks, got.owner) == (
        txlog.OP_TAG_CHECK, 987, 3, None, 0, "10.0.0.7@4242")
    with pytest.raises(ValueError):         # the caller keeps such a name in memory only
        factory().sender(987, 3, f"evil\x02{txlog.P_CHECKS}\x01999")


@pytest.mark.parametrize("owner, written", [
    ("10.0.0.7@4242", "10.0.0.7@4242"),
    (None, None),                                              # no heartbeat named its connection yet
    ("x" * (txlog.OWNER_MAX + 1), None),
    (f"evil\x02{Prop.REAL_TOPIC}\x01Other", None),             # a separator would write a property of its choosing
    ("\ud800", None),
    ("10.0.0.7@caf\u00e9", "10.0.0.7@caf\u00e9"),
])
def test_a_half_carries_its_senders_client_id_and_its_committed_message_does_not(owner, written):
    """A crash cannot lose the sender of a half stored since the last snapshot: the half names it (the last
    property). The committed message is the half without it, its properties as the producer sent them; a
    TXMQ_OWNER the producer sent itself never stands for the sender."""
    f = factory()
    sent = {Prop.PGROUP: "PG", Prop.TAGS: "TagA", Prop.UNIQ_KEY: "U1", txlog.P_OWNER: "someone@else"}
    half = stored(f.half(body=b"payload", real_topic="Orders", real_qid=3, flag=0,
                         sys_flag=SysFlag.TRANSACTION_PREPARED, born_timestamp=NOW, born_host=HOST, props=dict(sent),
                         owner=owner))
    assert half.properties.get(txlog.P_OWNER) == written
    if written is not None:
        assert list(half.properties)[-1] == txlog.P_OWNER
    committed = stored(f.committed(half.encode(), 4096, "Orders", 3, 0))
    expected = {k: v for k, v in sent.items() if k != txlog.P_OWNER}
    assert committed.properties == {**expected, Prop.REAL_TOPIC: "Orders", Prop.REAL_QID: "3"}
    assert (committed.topic, committed.body, committed.prepared_offset) == ("Orders", b"payload", 4096)
    dead = stored(f.dead_letter(half, 4096, "max-checks"))
    assert dead.properties.get(txlog.P_OWNER) == written       # a dead letter shows who sent it


def test_retopic_record_drops_only_a_last_property_of_that_name():
    from protocol.message import retopic_record
    def moved(props: dict) -> dict:
        rec = MessageExt(txlog.HALF_TOPIC, b"b", properties=props).encode()
        return decode_record(retopic_record(rec, topic=b"T", queue_id=0, transaction_type=8, prepared_offset=1,
                                            drop_last=txlog.P_OWNER.encode()))[0].properties
    assert moved({"A": "1", txlog.P_OWNER: "x@1"}) == {"A": "1"}
    assert moved({txlog.P_OWNER: "x@1", "A": "1"}) == {txlog.P_OWNER: "x@1", "A": "1"}     # not last: kept
    assert moved({"A": "1", txlog.P_OWNER + "2": "x"}) == {"A": "1", txlog.P_OWNER + "2": "x"}
    assert moved({txlog.P_OWNER: "x@1"}) == {txlog.P_OWNER: "x@1"}         # alone: no pair before it to cut at


def test_a_half_whose_properties_leave_no_room_for_its_senders_id_is_stored_without_it():
    """The mark must never cost a producer its send: a half whose properties fit the record without it (32767
    bytes) is stored, unmarked (its sender is only not known after a crash), not refused as MESSAGE_ILLEGAL."""
    from protocol.message import MAX_PROPERTIES_LENGTH
    f = factory()

    def half(fill: int):
        return stored(f.half(body=b"b", real_topic="Orders", real_qid=0, flag=0, sys_flag=0, born_timestamp=NOW,
                             born_host=HOST, props={"big": "y" * fill}, owner="10.0.0.7@4242"))

    base = len(f"big\x01\x02{Prop.REAL_TOPIC}\x01Orders\x02{Prop.REAL_QID}\x010".encode())
    room = MAX_PROPERTIES_LENGTH - base
    assert half(room).properties.get(txlog.P_OWNER) is None
    mark = len(f"\x02{txlog.P_OWNER}\x0110.0.0.7@4242")
    assert half(room - mark).properties[txlog.P_OWNER] == "10.0.0.7@4242"     # exactly 32767 bytes with it
    assert half(room - mark + 1).properties.get(txlog.P_OWNER) is None         # one byte more: stored without it


@pytest.mark.parametrize("sent, taken", [
    ("10.0.0.7@4242", "10.0.0.7@4242"),
    ("x" * 30000, ""),                          # ~30 KB held by every such pending transaction, and shown by admin
    (f"a\x01{Prop.REAL_TOPIC}", ""),            # a value may hold \x01: never a client id a heartbeat gives
])
def test_a_half_stored_before_its_sender_was_marked_names_a_sender_only_when_a_client_id_could_be(sent, taken):
    """A half stored before the broker marked its sender kept a TXMQ_OWNER its producer sent, of any size (up
    to the properties' 32767 bytes): read after the upgrade, it was taken as the sender's client id whatever it
    was, where the broker keeps none that a check record could not carry (plain_owner)."""
    from broker.transaction.core import tx_from_half
    props = {Prop.PGROUP: "PG", Prop.REAL_TOPIC: "Orders", Prop.REAL_QID: "0", txlog.P_OWNER: sent}
    old = MessageExt(txlog.HALF_TOPIC, b"b", properties=props).encode()
    assert tx_from_half(decode_record(old)[0]).owner_id == taken
