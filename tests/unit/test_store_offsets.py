"""ConsumerOffsets: commits survive restarts; the file is replaced atomically."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from broker.store import ConsumerOffsets
from protocol.errors import StoreError
from tests.support.bounded import bounded




@bounded(10)
async def test_commit_get_and_persist_on_close(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path))
    await offsets.open()
    assert offsets.get("g", "T", 0) is None
    offsets.commit("g", "T", 0, 5)
    offsets.commit("g", "T", 3, 7)
    offsets.commit("h", "T", 0, 1)
    assert offsets.get("g", "T", 0) == 5
    await offsets.close()
    with open(tmp_path / "config" / "consumerOffset.json") as f:
        assert json.load(f) == {"T@g": {"0": 5, "3": 7}, "T@h": {"0": 1}}
    again = ConsumerOffsets(str(tmp_path))
    assert again.get("g", "T", 3) == 7 and again.get("h", "T", 0) == 1
    assert sorted(again.items()) == [(("g", "T", 0), 5), (("g", "T", 3), 7), (("h", "T", 0), 1)]


@bounded(10)
async def test_a_dirty_table_is_persisted_in_the_background(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=0.01)
    await offsets.open()
    offsets.commit("g", "T", 1, 42)
    path = tmp_path / "config" / "consumerOffset.json"
    while not path.exists():
        await asyncio.sleep(0.01)
    assert ConsumerOffsets(str(tmp_path)).get("g", "T", 1) == 42
    await offsets.close()


def test_persist_leaves_no_temporary_file_and_remove_group(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("g", "T", 0, 1)
    offsets.commit("old", "T", 0, 1)
    offsets.remove_group("old")
    offsets.persist()
    assert os.listdir(tmp_path / "config") == ["consumerOffset.json"]
    assert ConsumerOffsets(str(tmp_path)).items() == [(("g", "T", 0), 1)]


def test_a_damaged_file_is_a_clear_error(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "consumerOffset.json").write_text("{not json")
    with pytest.raises(StoreError, match="consumerOffset.json"):
        ConsumerOffsets(str(tmp_path))


def test_malformed_entries_are_skipped(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "consumerOffset.json").write_text(
        json.dumps({"T@g": {"0": 3, "x": 1}, "nogroup": {"0": 1}, "U@g": {"1": "7"}}))
    offsets = ConsumerOffsets(str(tmp_path))
    assert sorted(offsets.items()) == [(("g", "T", 0), 3), (("g", "U", 1), 7)]
