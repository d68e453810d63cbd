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
