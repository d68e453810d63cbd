"""A config table written whole at each change (subscription groups, the KV config): saves asked for back to back
share one write, and none loses the change it was asked for."""
from __future__ import annotations

import asyncio
import json

from broker.kv_config import KvConfig
from broker.subscriptions import SubscriptionGroups
from tests.support.bounded import bounded


def _counting_writes(table) -> list:
    """Record the counter each write of ``table`` was encoded at (the write itself done as ever)."""
    written: list = []
    write = table.write

    def counted(data, counter=None):
        written.append(counter)
        write(data, counter)
    table.write = counted
    return written


@bounded(20)
async def test_saves_asked_for_back_to_back_share_one_write_and_each_change_is_on_disk(tmp_path):
    """Each save encoded and held its own copy of the whole table, so 100 updates pipelined at 20,000 groups took
    the broker from 50 MB to 787 MB: 100 saves at once now write the table at most twice (the one running when
    they came, the next covering them all), and the file holds the last change."""
    groups = SubscriptionGroups(str(tmp_path), lambda: 0)
    written = _counting_writes(groups)
    saves = []
    for i in range(100):
        groups.update({"groupName": f"CG_{i}", "retryMaxTimes": i % 16})
        saves.append(asyncio.ensure_future(groups.save()))
    await asyncio.gather(*saves)
    assert 1 <= len(written) <= 2, written
    assert written[-1] == groups.counter
    on_disk = SubscriptionGroups(str(tmp_path), lambda: 0).groups
    assert {f"CG_{i}" for i in range(100)} <= set(on_disk) and on_disk["CG_99"]["retryMaxTimes"] == 99 % 16


@bounded(20)
async def test_a_change_made_while_a_save_runs_is_written_by_the_next(tmp_path):
    """A save that began before a change does not answer for it: that change's save writes the table again."""
    kv = KvConfig(str(tmp_path / "kvConfig.json"))
    written = _counting_writes(kv)
    kv.put("NS", "a", "1")
    first = asyncio.ensure_future(kv.save())
    await asyncio.sleep(0)              # the first save under way (encoding, or its write on a thread)
    kv.put("NS", "b", "2")
    await asyncio.gather(first, kv.save())
    assert written == [1, 2]
    assert json.loads((tmp_path / "kvConfig.json").read_text())["configTable"]["NS"] == {"a": "1", "b": "2"}
