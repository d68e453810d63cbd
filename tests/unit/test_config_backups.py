"""The broker's JSON catalogues keep their previous save: a file damaged or lost later is read from it.

Without the copy, a damaged topics.json or subscriptionGroup.json was ignored (ERROR) and the next write
replaced it for good: every topic's settings, every other group's config, back to the defaults.
"""
from __future__ import annotations

import json
import logging

import pytest

from broker.subscriptions import SubscriptionGroups
from broker.topics import TopicConfig, TopicManager
from protocol.codes import Perm
from tests.support.bounded import bounded


def _topics(path) -> TopicManager:
    return TopicManager(str(path), auto_create=True, default_queue_nums=4, cluster="C", broker="B")


def _damage(path, how: str) -> None:
    if how == "torn":
        path.write_bytes(path.read_bytes()[:20])
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["torn", "missing"])
def test_a_damaged_or_lost_topics_catalogue_is_read_from_its_previous_save(tmp_path, caplog, how):
    tm = _topics(tmp_path)
    tm.create(TopicConfig("Orders", 16, 16, perm=4))        # read-only, 16 queues: not the defaults
    tm.create(TopicConfig("Later", 2, 2))
    assert json.loads((tmp_path / "topics.json.bak").read_text())["topics"][-1]["name"] == "Orders"
    _damage(tmp_path / "topics.json", how)
    with caplog.at_level(logging.ERROR, logger="txmq.topics"):
        again = _topics(tmp_path)
    assert again.get("Orders") == TopicConfig("Orders", 16, 16, perm=4)
    assert again.get("Later") is None                         # one save older
    assert any("previous copy" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", ["torn", "missing"])
def test_a_damaged_or_lost_subscription_groups_file_is_read_from_its_previous_save(tmp_path, caplog, how):
    subs = SubscriptionGroups(str(tmp_path), clock=lambda: 1)
    subs.update({"groupName": "G1", "consumeEnable": False, "retryMaxTimes": 3})
    subs.write(subs.encode(), subs.counter)
    subs.update({"groupName": "G2", "retryMaxTimes": 5})
    subs.write(subs.encode(), subs.counter)
    _damage(tmp_path / "subscriptionGroup.json", how)
    with caplog.at_level(logging.ERROR, logger="txmq.subscriptions"):
        again = SubscriptionGroups(str(tmp_path), clock=lambda: 2)
    assert not again.consume_enabled("G1") and again.retry_max_times("G1") == 3
    assert again.retry_max_times("G2") is None               # one save older
    assert any("previous copy" in r.getMessage() for r in caplog.records)


def test_a_new_store_has_no_catalogue_and_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.ERROR):
        _topics(tmp_path)
        SubscriptionGroups(str(tmp_path), clock=lambda: 1)
    assert not caplog.records


def test_the_previous_save_is_kept_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    """The copy was a hard link renamed into place; on a file system without them (EPERM, EOPNOTSUPP) every
    save of topics.json, subscriptionGroup.json and consumerOffset.json failed."""
    import errno
    import os

    def no_links(src, dst, *a, **kw):
        raise OSError(errno.EPERM, "Operation not permitted", dst)
    monkeypatch.setattr(os, "link", no_links)
    tm = _topics(tmp_path)
    tm.create(TopicConfig("Orders", 16, 16, perm=4))
    tm.create(TopicConfig("Later", 2, 2))
    assert [t["name"] for t in json.loads((tmp_path / "topics.json").read_text())["topics"]][-2:] == ["Orders",
                                                                                                      "Later"]
    assert json.loads((tmp_path / "topics.json.bak").read_text())["topics"][-1]["name"] == "Orders"
    assert not (tmp_path / "topics.json.bak.tmp").exists()



def test_a_previous_save_copy_a_full_disk_cuts_short_leaves_no_partial_file_behind(tmp_path, monkeypatch):
    """Where there are no hard links the previous save is a copy (topics.json.bak.tmp, then renamed): a full disk
    cut it short and it stayed, a partial copy of the whole table holding the pages that were free, while the
    save's own .tmp was removed (saved.write_synced). Now the copy goes too, and so does the one a catalogue
    written again from its .bak at start makes."""
    import errno
    import os
    import shutil

    from broker.store import saved

    def no_links(src, dst, *a, **kw):
        raise OSError(errno.EPERM, "Operation not permitted", dst)

    def full(src, dst, *a, **kw):
        with open(src, "rb") as f, open(dst, "wb") as out:
            out.write(f.read(10))
        raise OSError(errno.ENOSPC, "No space left on device", dst)
    tm = _topics(tmp_path)
    tm.create(TopicConfig("Orders", 16, 16, perm=4))
    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(OSError, match="No space left"):
        saved.save(str(tmp_path / "topics.json"), b"{}")
    with pytest.raises(OSError, match="No space left"):
        saved._copy_durably(str(tmp_path / "topics.json"), str(tmp_path / "again.json"))
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".tmp")) == []

# Every way a catalogue was seen damaged: each is read from the previous save, none resets the catalogue.
DAMAGE = {
    "zero-length": lambda p: p.write_bytes(b""),
    "zeros": lambda p: p.write_bytes(bytes(4096)),
    "garbage": lambda p: p.write_bytes(b"\xff\xfe not json"),
    "a list": lambda p: p.write_text("[]"),
    "wrong types": lambda p: p.write_text(json.dumps({"topics": [{"name": "Orders", "read_queue_nums": "16"}],
                                                      "subscriptionGroupTable": {"G1": "off"}})),
    "a directory": lambda p: (p.unlink(), p.mkdir()),
}


def _saved_twice_topics(path) -> None:
    tm = _topics(path)
    tm.create(TopicConfig("Orders", 16, 16, perm=4))
    tm._write(tm._snapshot())                   # the previous copy holds Orders too


def _saved_twice_subscriptions(path) -> None:
    subs = SubscriptionGroups(str(path), clock=lambda: 1)
    subs.update({"groupName": "G1", "consumeEnable": False, "retryMaxTimes": 3})
    subs.write(subs.encode(), subs.counter)
    subs.write(subs.encode(), subs.counter)


DAMAGE["negative queues"] = lambda p: p.write_text(json.dumps({"topics": [{"name": "Orders", "read_queue_nums": -16}]}))


@pytest.mark.parametrize("how", ["a list", "wrong types", "negative queues"])   # the others were read from the copy
def test_a_topics_catalogue_damaged_any_way_is_read_from_its_previous_save(tmp_path, caplog, how):
    """A catalogue that was JSON but not a table ("[]") was ignored without trying the previous save, and an
    entry of the wrong types was taken as it was (a crash on first use) or skipped: the topic's settings gone."""
    _saved_twice_topics(tmp_path)
    DAMAGE[how](tmp_path / "topics.json")
    with caplog.at_level(logging.ERROR, logger="txmq.topics"):
        assert _topics(tmp_path).get("Orders") == TopicConfig("Orders", 16, 16, perm=4)
    assert any("previous copy" in r.getMessage() for r in caplog.records)


DAMAGE["a word for a flag"] = lambda p: p.write_text(json.dumps(
    {"subscriptionGroupTable": {"G1": {"groupName": "G1", "consumeEnable": "yes", "retryMaxTimes": 3}}}))


@pytest.mark.parametrize("how", ["wrong types", "a word for a flag"])
def test_a_subscription_groups_file_damaged_any_way_is_read_from_its_previous_save(tmp_path, caplog, how):
    _saved_twice_subscriptions(tmp_path)
    DAMAGE[how](tmp_path / "subscriptionGroup.json")
    with caplog.at_level(logging.ERROR, logger="txmq.subscriptions"):
        again = SubscriptionGroups(str(tmp_path), clock=lambda: 2)
    assert not again.consume_enabled("G1") and again.retry_max_times("G1") == 3
    assert any("previous copy" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", ["topics.json", "subscriptionGroup.json"])
@pytest.mark.parametrize("bak", ["damaged", "missing"])
def test_a_catalogue_damaged_with_no_good_previous_save_stops_start_up(tmp_path, name, bak):
    """The broker went on with the defaults (an ERROR in the log): a read-only or ordered topic writable and
    unordered again, a stopped group consuming again -- and the next save made it for good."""
    from protocol.errors import StoreError
    _saved_twice_topics(tmp_path)
    _saved_twice_subscriptions(tmp_path)
    DAMAGE["garbage"](tmp_path / name)
    if bak == "damaged":
        DAMAGE["zeros"](tmp_path / (name + ".bak"))
    else:
        (tmp_path / (name + ".bak")).unlink()
    with pytest.raises(StoreError, match=rf"{name} cannot be read .* nor its previous copy .*: move both away"):
        _topics(tmp_path)
        SubscriptionGroups(str(tmp_path), clock=lambda: 2)


def test_a_damaged_catalogue_is_moved_aside_so_the_next_save_keeps_the_good_copy(tmp_path, monkeypatch):
    """After a start from the previous copy, the next save made the damaged file the previous copy (keep_previous
    links the file it replaces): a crash before its rename left no readable copy, and the broker would not start."""
    import os
    _saved_twice_topics(tmp_path)
    good = (tmp_path / "topics.json.bak").read_bytes()
    DAMAGE["garbage"](tmp_path / "topics.json")
    tm = _topics(tmp_path)
    assert (tmp_path / "topics.json.damaged").read_bytes() == b"\xff\xfe not json"
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("crash before the rename")))
    with pytest.raises(OSError):
        tm.create(TopicConfig("After", 1, 1))
    monkeypatch.undo()
    assert (tmp_path / "topics.json.bak").read_bytes() == good
    assert _topics(tmp_path).get("Orders") == TopicConfig("Orders", 16, 16, perm=4)


def test_an_update_with_a_word_for_a_flag_is_refused_not_read_as_false():
    """UPDATE_AND_CREATE_SUBSCRIPTIONGROUP with consumeEnable "yes" stopped the group's consumption."""
    from broker.subscriptions import group_config
    assert group_config("G", {"consumeEnable": " TRUE "})["consumeEnable"] is True
    with pytest.raises(ValueError, match="consumeEnable = 'yes'"):
        group_config("G", {"consumeEnable": "yes"})


@pytest.mark.parametrize("how", ["garbage", "missing"])
def test_a_catalogue_read_from_its_previous_save_is_written_again_at_once(tmp_path, caplog, how):
    """It stayed damaged (or missing) until the next topic change, days away maybe: every start said so again,
    and the previous copy was the only good one meanwhile."""
    _saved_twice_topics(tmp_path)
    if how == "missing":
        (tmp_path / "topics.json").unlink()
    else:
        DAMAGE[how](tmp_path / "topics.json")
    _topics(tmp_path)
    assert (tmp_path / "topics.json").read_bytes() == (tmp_path / "topics.json.bak").read_bytes()
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert _topics(tmp_path).get("Orders") == TopicConfig("Orders", 16, 16, perm=4)
    assert not caplog.records


def test_a_queue_of_a_topic_without_config_makes_it_again_and_grows_only_what_it_made(tmp_path):
    """topics.queue_appeared: the store's new queue of a topic the catalogue lost (a kill before its write)."""
    tm = _topics(tmp_path)
    tm.queue_appeared("Lost", 0)
    assert (tm.get("Lost").read_queue_nums, tm.get("Lost").perm) == (1, Perm.READ_WRITE)
    tm.queue_appeared("Lost", 3)            # a later half's REAL_QID: grown, or queue 3 is never pulled
    assert tm.get("Lost").read_queue_nums == tm.get("Lost").write_queue_nums == 4
    tm.create(TopicConfig("Lost", 2, 2))    # an operator's settings win from then on
    tm.queue_appeared("Lost", 5)
    assert tm.get("Lost").read_queue_nums == 2
    tm.create(TopicConfig("Shrunk", 2, 2))
    tm.queue_appeared("Shrunk", 3)          # a configured topic is never changed by it
    assert tm.get("Shrunk").read_queue_nums == 2


def test_a_topic_made_again_from_its_queues_still_grows_after_a_restart(tmp_path):
    """A topic restored with the queues its messages showed (queue 0) while a delayed message for its queue 5
    waits: that message may come after a restart, and a catalogue read back as an operator's config kept queue
    5 out of the routes -- delivered, never pulled."""
    tm = _topics(tmp_path)
    tm.adopt([("Lost", 0)])
    tm2 = _topics(tmp_path)
    tm2.queue_appeared("Lost", 5)
    assert tm2.get("Lost").read_queue_nums == tm2.get("Lost").write_queue_nums == 6
    tm2.create(TopicConfig("Lost", 2, 2))   # set by hand: read back as such
    _topics(tmp_path).queue_appeared("Lost", 7)
    assert _topics(tmp_path).get("Lost").read_queue_nums == 2


@bounded(20)
async def test_a_hung_subscription_groups_write_is_given_up_and_no_second_one_starts_behind_it(tmp_path, caplog):
    """A write that never returns: save() waited for it for good (the update never answered), and each later save
    and retry stuck one more default-executor thread in the same write. Now save() is OSError after write_wait_s
    (once said, retried), no other write starts while it hangs (``write_hung``: txmq_config_write_hung), the stop's
    last try is no wait, and once it ends the retry writes the newest table."""
    import asyncio
    import threading
    subs = SubscriptionGroups(str(tmp_path), lambda: 1)
    subs.write_wait_s, subs.retry_write_s = 0.1, 0.01
    go, real, calls = threading.Event(), subs.write, []

    def write(data, counter=None):
        calls.append(counter)
        assert go.wait(15)
        real(data, counter)
    subs.write = write
    try:
        subs.update({"groupName": "CG1", "retryMaxTimes": 2})
        with pytest.raises(OSError, match="has not ended in 0.1 s"):
            await subs.save()
        assert subs.write_hung
        subs.update({"groupName": "CG2", "retryMaxTimes": 3})
        with pytest.raises(OSError, match="has not ended"):
            await asyncio.wait_for(subs.save(), 0.05)     # at once: no wait behind the hung write
        await asyncio.sleep(0.1)        # ten retry periods: none starts a write behind the hung one
        assert len(calls) == 1, calls
        assert caplog.text.count("subscription groups file") == 1 and "not written, retrying" in caplog.text
        go.set()
        while subs._retry is not None:  # the hung write ends; the retry writes the newest table
            await asyncio.sleep(0.01)
        assert not subs.write_hung and "the write that hung has ended" in caplog.text
        again = SubscriptionGroups(str(tmp_path), lambda: 1)
        assert again.groups["CG2"]["retryMaxTimes"] == 3
    finally:
        go.set()
        await subs.close()


@bounded(20)
async def test_a_stop_behind_a_hung_subscription_groups_write_does_not_wait_for_it(tmp_path, caplog):
    import asyncio
    import threading
    subs = SubscriptionGroups(str(tmp_path), lambda: 1)
    subs.write_wait_s = 0.1
    go, real = threading.Event(), subs.write
    subs.write = lambda data, counter=None: (go.wait(15), real(data, counter))
    try:
        subs.update({"groupName": "CG1", "retryMaxTimes": 2})
        with pytest.raises(OSError):
            await subs.save()
        await asyncio.wait_for(subs.close(), 1)
        assert "not written at stop" in caplog.text
    finally:
        go.set()


def test_a_metadata_save_is_timed_by_its_file_and_a_failed_one_is_not(tmp_path, monkeypatch):
    """txmq_metadata_write_seconds{file}: each ``save`` that ends is observed with its file's name (a bounded label
    set), on the writing thread; one that fails is not (its error is the caller's to say)."""
    from broker.store import saved
    seen = []
    monkeypatch.setattr(saved, "_on_write", None)
    saved.observe_writes(lambda file, seconds: seen.append((file, seconds)))
    saved.save(str(tmp_path / "topics.json"), b"{}")
    assert [f for f, _ in seen] == ["topics.json"] and seen[0][1] >= 0
    with pytest.raises(OSError):
        saved.save(str(tmp_path / "missing" / "topics.json"), b"{}")
    assert saved.timed("checkpoint", lambda a, b: a + b, 1, 2) == 3
    assert [f for f, _ in seen] == ["topics.json", "checkpoint"]
