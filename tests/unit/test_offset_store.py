"""LocalOffsetStore (broadcasting consumers): progress survives a restart, and a damaged file costs
re-reading, never a crash."""
from __future__ import annotations

import asyncio
import logging

from consumer.offset_store import LocalOffsetStore
from consumer.pull_consumer import MessageQueue

MQ = MessageQueue("News", "broker-a", 3)


def test_offsets_are_saved_atomically_and_read_back(tmp_path):
    store = LocalOffsetStore(tmp_path, "10.0.0.1@DEFAULT", "CG")
    asyncio.run(store.write(MQ, 42))
    assert not store.path.exists()                     # memory only until flushed
    asyncio.run(store.flush())
    assert store.path == tmp_path / "10.0.0.1@DEFAULT" / "CG" / "offsets.json"
    assert not store.path.with_suffix(".tmp").exists()
    assert asyncio.run(LocalOffsetStore(tmp_path, "10.0.0.1@DEFAULT", "CG").read(MQ)) == 42
    assert asyncio.run(LocalOffsetStore(tmp_path, "10.0.0.2@DEFAULT", "CG").read(MQ)) is None


def test_a_damaged_offsets_file_is_reported_and_consumption_starts_over(tmp_path, caplog):
    store = LocalOffsetStore(tmp_path, "c@DEFAULT", "CG")
    store.path.parent.mkdir(parents=True)
    store.path.write_text('{"offsetTable": {"News@broker-a@3": ')
    with caplog.at_level(logging.ERROR, logger="txmq.consumer"):
        fresh = LocalOffsetStore(tmp_path, "c@DEFAULT", "CG")
    assert asyncio.run(fresh.read(MQ)) is None
    assert "unreadable" in caplog.text


def test_a_hostile_client_id_stays_inside_the_directory(tmp_path):
    for client_id, group in (("../../etc/x", "CG"), ("c", ".."), ("..", "../../g")):
        store = LocalOffsetStore(tmp_path, client_id, group)
        parts = store.path.relative_to(tmp_path).parts
        assert len(parts) == 3 and ".." not in parts and "." not in parts
