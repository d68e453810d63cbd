"""broker.kv_config.KvConfig: RocketMQ's kvConfig.json, written whole, its previous copy used when it is damaged."""
from __future__ import annotations

import asyncio
import json
import logging
import types

import pytest

from broker import kv_config
from broker.kv_config import KEY_SLICE, KvConfig
from broker.processors.kv import get_kvlist_by_namespace
from protocol.admin_bodies import dump
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import StoreError
from tests.support.loop_turns import turns_before_hand_off, turns_while


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


def _full_table(kv: KvConfig, keys: int) -> None:
    """``keys`` keys over three namespaces (one of them not ASCII), put in no sorted order."""
    for i in range(keys):
        kv.put(("ORDER_TOPIC_CONFIG", "ns", "é\"ns")[i % 3], f"k-{i * 7919 % keys}\u00e9\n", f"v{i}\"")


async def test_a_large_table_is_saved_encoded_a_slice_of_keys_at_a_time_as_it_was_when_the_save_began(tmp_path,
                                                                                                   monkeypatch):
    # Encoded whole at each PUT_KV_CONFIG's save, a table of MAX_BYTES in short keys (100,000) held the event loop
    # about a second on a loaded host (bench/bench_config_holds.py). The same bytes now, KEY_SLICE keys a turn, of the
    # table as it was when the save began: a change made meanwhile is its own save's.
    kv = KvConfig(str(tmp_path / "kvConfig.json"))
    _full_table(kv, 6 * KEY_SLICE + 5)
    whole, counter = kv.encode(), kv.counter
    data, at, turns = await turns_before_hand_off(monkeypatch, kv.save, lambda: kv.put("ns", "late", "x"))
    assert (data, at) == (whole, counter)
    assert turns >= 6 * 3                # (sorted, merged and written a slice at a time)
    assert json.loads(data) == {"configTable": {ns: {k: v for k, v in kv.table[ns].items() if k != "late"}
                                                for ns in kv.table}}
    assert KvConfig(kv.path).table["ns"].get("late") is None and kv.get("ns", "late") == "x"


async def test_get_kvlist_answers_a_large_namespace_whole_a_slice_of_keys_at_a_time(tmp_path):
    kv = KvConfig(str(tmp_path / "kvConfig.json"))
    _full_table(kv, 9 * KEY_SLICE)
    cmd = RemotingCommand(RequestCode.GET_KVLIST_BY_NAMESPACE, opaque=7, ext_fields={"namespace": "é\"ns"})
    resp, turns = await turns_while(get_kvlist_by_namespace(types.SimpleNamespace(kv=kv), None, cmd))
    assert resp.code == ResponseCode.SUCCESS
    assert resp.body == dump({"table": kv.table["é\"ns"]}).encode()
    assert json.loads(resp.body) == {"table": kv.table["é\"ns"]} and len(kv.table["é\"ns"]) == 3 * KEY_SLICE
    assert turns >= 3


async def test_a_table_of_many_small_namespaces_is_saved_a_slice_at_a_time_too(tmp_path, monkeypatch):
    # The cap counts bytes, not namespaces: 400,000 one-key namespaces fit in MAX_BYTES. Each namespace sorted and
    # written on its own, with no turn of the loop between two (each one's keys fit in one slice), such a table held
    # the loop 21.5 s at one save (the whole encode of before: 1.2 s). Copied whole as the save began, 0.9 s.
    kv = KvConfig(str(tmp_path / "kvConfig.json"))
    for i in range(6 * KEY_SLICE + 5):
        kv.put(f"n{i * 7919 % (6 * KEY_SLICE + 5)}", "k", f"v{i}")
    whole, counter = kv.encode(), kv.counter
    copied = []
    monkeypatch.setattr(kv_config, "dict", lambda *a: (copied.append(1), dict(*a))[1], raising=False)
    data, at, turns = await turns_before_hand_off(monkeypatch, kv.save, lambda: (
        kv.put("n1", "k", "changed"), kv.put("n2", "k2", "added"), kv.delete("n3", "k")))
    assert (data, at) == (whole, counter)
    assert turns >= 6
    assert len(copied) < 100            # (not a copy of each namespace's keys as the save began)
    assert (kv.get("n1", "k"), kv.get("n2", "k2"), kv.get("n3", "k")) == ("changed", "added", None)


async def test_get_kvlist_answers_the_namespace_as_it_began_and_stops_once_its_asker_is_gone(tmp_path):
    kv = KvConfig(str(tmp_path / "kvConfig.json"))
    _full_table(kv, 9 * KEY_SLICE)
    then = dict(kv.table["ns"])
    cmd = RemotingCommand(RequestCode.GET_KVLIST_BY_NAMESPACE, opaque=7, ext_fields={"namespace": "ns"})
    answer = asyncio.ensure_future(get_kvlist_by_namespace(types.SimpleNamespace(kv=kv), None, cmd))
    await asyncio.sleep(0)
    kv.put("ns", "late", "x")
    for key in list(then)[:10]:
        kv.delete("ns", key)
    resp = await asyncio.wait_for(answer, 30)
    assert resp.body == dump({"table": then}).encode() and not kv._readers
    assert "late" in kv.table["ns"] and len(kv.table["ns"]) == len(then) - 9

    conn = types.SimpleNamespace(closed=asyncio.Event())
    answer = asyncio.ensure_future(get_kvlist_by_namespace(types.SimpleNamespace(kv=kv), conn, cmd))
    await asyncio.sleep(0)
    conn.closed.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(answer, 30)
    assert not kv._readers          # (else every later change copied its namespace for a reader long gone)


async def test_a_save_behind_a_hung_write_is_refused_before_the_table_is_encoded(tmp_path, monkeypatch):
    # Behind a write that hangs (a stopped NFS) a save is refused at once, "not saved": the sliced encode ran first,
    # the whole table encoded a slice at a time (a second or more for a full one on a loaded host) for nothing at
    # each change and each 5 s retry, its answer that much later.
    kv = KvConfig(str(tmp_path / "kvConfig.json"))
    _full_table(kv, 3 * KEY_SLICE)
    kv.write_hung, encodes, real = True, [], kv._encoded
    monkeypatch.setattr(kv, "_encoded", lambda: (encodes.append(1), real())[1])
    with pytest.raises(OSError, match="has not ended"):
        await kv.save()
    kv._retry.cancel()
    assert encodes == []
