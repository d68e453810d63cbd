"""broker.kv_config.KvConfig: RocketMQ's kvConfig.json, written whole, its previous copy used when it is damaged."""
from __future__ import annotations

import json
import logging

import pytest

from broker.kv_config import KvConfig
from protocol.errors import StoreError


def _saved(kv: KvConfig) -> None:
    kv.write(kv.encode(), kv.counter)


def test_a_damaged_file_is_read_from_its_previous_copy_and_said(tmp_path, caplog):
    path = str(tmp_path / "kvConfig.json")
    kv = KvConfig(path)
    kv.put("ORDER_TOPIC_CONFIG", "T", "broker-a:4")
    _saved(kv)
    kv.put("ns", "k", "v")
    _saved(kv)
    assert json.loads(open(path).read()) == {"configTable": {"ORDER_TOPIC_CONFIG": {"T": "broker-a:4"},
                                                             "ns": {"k": "v"}}}
    with open(path, "w") as fh:
        fh.write('{"configTable":{"ns":')        # torn
    with caplog.at_level(logging.ERROR, logger="txmq.kvconfig"):
        again = KvConfig(path)
    assert again.table == {"ORDER_TOPIC_CONFIG": {"T": "broker-a:4"}}      # the save before the last
    assert "using its previous copy" in caplog.text


def test_an_older_table_written_after_a_newer_one_is_skipped(tmp_path):
    kv = KvConfig(str(tmp_path / "kvConfig.json"))
    kv.put("ns", "a", "1")
    old = (kv.encode(), kv.counter)
    kv.put("ns", "b", "2")
    _saved(kv)
    kv.write(*old)                              # a slower thread with the older table finishes last
    assert KvConfig(kv.path).table == {"ns": {"a": "1", "b": "2"}}
    assert kv.delete("ns", "a") and not kv.delete("ns", "a") and not kv.delete("nobody", "a")
    kv.delete("ns", "b")
    assert kv.table == {}                       # an empty namespace goes, as its last key does


def test_neither_file_readable_stops_start_up_naming_both(tmp_path):
    """Starting with an empty table would drop every key without a word, and the next change make that for good."""
    path = tmp_path / "kvConfig.json"
    path.write_text('{"configTable":{"ns":["not", "an", "object"]}}')
    (tmp_path / "kvConfig.json.bak").write_text("")
    with pytest.raises(StoreError, match="kvConfig.json.bak"):
        KvConfig(str(path))


def test_a_deleted_value_frees_its_room(tmp_path):
    from broker.kv_config import MAX_BYTES
    kv = KvConfig(str(tmp_path / "kvConfig.json"))
    big = "x" * (MAX_BYTES - 10)
    assert kv.put("N", "a", big) and not kv.put("N", "b", big) and kv.get("N", "b") is None
    assert kv.delete("N", "a") and kv.put("N", "b", big)
    _saved(kv)
    assert KvConfig(kv.path).size == kv.size                # counted again when read at start
