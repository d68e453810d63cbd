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


async def _saved_while_changed_between_slices(monkeypatch, module, encoder: str, table, change) -> list:
    """``table`` saved while, in its first save's encoding (``module.encoder``, patched: that save has taken its
    table, not encoded it yet), ``change()`` is made and a second save asked for; the counters written, in order."""
    written = _counting_writes(table)
    late: list = []
    real = getattr(module, encoder)

    async def changed_meanwhile(*args, **kwargs):
        if not late:
            change()
            late.append(asyncio.ensure_future(table.save()))
        return await real(*args, **kwargs)
    monkeypatch.setattr(module, encoder, changed_meanwhile)
    await table.save()
    await late[0]
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


@bounded(20)
async def test_a_group_changed_while_a_save_encodes_its_slices_is_saved_again(tmp_path, monkeypatch):
    """A save encodes the table a slice of groups at a time, of the table as it was when it began: a group changed
    between two slices is not in it, so that change's save must not take it for its own (it would answer SUCCESS
    for a change a restart undoes)."""
    import broker.subscriptions as subscriptions
    groups = SubscriptionGroups(str(tmp_path), lambda: 0)
    for i in range(4 * subscriptions.GROUP_SLICE):
        groups.groups[f"CG_{i:05d}"] = subscriptions.group_config(f"CG_{i:05d}")
    groups.update({"groupName": "CG_00000", "retryMaxTimes": 1})
    written = await _saved_while_changed_between_slices(
        monkeypatch, subscriptions, "members_in_slices", groups,
        lambda: groups.update({"groupName": "CG_late", "retryMaxTimes": 7}))
    assert written == [groups.counter - 1, groups.counter], written
    on_disk = SubscriptionGroups(str(tmp_path), lambda: 0).groups
    assert on_disk["CG_late"]["retryMaxTimes"] == 7


@bounded(20)
async def test_a_key_set_while_a_kv_save_encodes_its_slices_is_saved_again(tmp_path, monkeypatch):
    """The KV table's save reads it frozen, a slice of keys at a time: a key set meanwhile is not in that save, so
    its own save writes the table again."""
    import broker.kv_config as kv_config
    kv = KvConfig(str(tmp_path / "kvConfig.json"))
    for i in range(4 * kv_config.KEY_SLICE):
        kv.put("NS", f"k{i}", "v")
    written = await _saved_while_changed_between_slices(monkeypatch, kv_config, "dump_in_slices", kv,
                                                        lambda: kv.put("NS", "late", "1"))
    assert written == [kv.counter - 1, kv.counter], written
    assert json.loads((tmp_path / "kvConfig.json").read_text())["configTable"]["NS"]["late"] == "1"


@bounded(20)
async def test_saves_waiting_behind_a_failed_write_each_get_the_failure_until_one_is_written(tmp_path):
    """Saves asked for while one runs share the next: when writes fail (a full disk) every one of them is told so,
    none SUCCESS for a change that is not on disk; once a write works, those still waiting share it."""
    import errno
    groups = SubscriptionGroups(str(tmp_path), lambda: 0)
    groups.retry_write_s = 3600                 # (the background retry kept out of the way)
    real, failures = groups.write, [3]

    def full_disk(data, counter=None):
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real(data, counter)
    groups.write = full_disk
    saves = []
    for i in range(10):
        groups.update({"groupName": f"CG_{i}", "retryMaxTimes": 3})
        saves.append(asyncio.ensure_future(groups.save()))
    results = await asyncio.gather(*saves, return_exceptions=True)
    failed = [r for r in results if isinstance(r, OSError)]
    assert len(failed) == 3 and results[3:] == [None] * 7, results
    assert {f"CG_{i}" for i in range(10)} <= set(SubscriptionGroups(str(tmp_path), lambda: 0).groups)
    await groups.close()


@bounded(20)
async def test_saves_waiting_behind_a_hung_write_are_all_refused(tmp_path):
    """A write that hangs: the save running it is refused after write_wait_s, and every one waiting behind it at once
    (write_hung), none answered SUCCESS, none waiting write_wait_s again."""
    import threading
    groups = SubscriptionGroups(str(tmp_path), lambda: 0)
    groups.write_wait_s, groups.retry_write_s = 0.3, 3600
    real, release, writes = groups.write, threading.Event(), []

    def hung(data, counter=None):
        writes.append(counter)
        release.wait(10)
        real(data, counter)
    groups.write = hung
    saves = []
    for i in range(5):
        groups.update({"groupName": f"CG_{i}"})
        saves.append(asyncio.ensure_future(groups.save()))
    results = await asyncio.gather(*saves, return_exceptions=True)
    started = len(writes)
    release.set()
    assert all(isinstance(r, OSError) for r in results), results
    # one write started and waited for, not one each (each waited write_wait_s for a write of its own, stuck
    # behind the hung one); was a wall-clock bound (< 5 x write_wait_s = 1.5 s), flaky on a loaded host
    assert started == 1, writes
    assert groups.write_hung
    groups._retry.cancel()
