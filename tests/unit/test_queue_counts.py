"""What the topic catalogue counts for max_queues and max_queues_per_host, and the start-up check of the limits."""
from __future__ import annotations

import json
import resource

import pytest

from broker.server import connections_limits_hold, effective_max_queues
from broker.topics import TopicConfig, TopicManager


def _manager(path) -> TopicManager:
    return TopicManager(str(path), auto_create=True, default_queue_nums=8, cluster="C", broker="B")


def test_a_topic_counts_for_the_most_queues_it_had_charged_to_who_gave_them(tmp_path):
    tm = _manager(tmp_path)
    system = tm.queue_total
    assert system == sum(tc.queue_count for tc in tm.topics.values())
    tm.create(TopicConfig("T", 16, 4), "10.0.0.1")
    assert tm.queues_counted("T") == (16, "10.0.0.1") and tm.queue_total == system + 16
    tm.create(TopicConfig("T", 2, 2), "10.0.0.2")           # smaller: its files stay, nothing moves
    assert tm.queues_counted("T") == (16, "10.0.0.1")
    tm.create(TopicConfig("T", 20, 20), "10.0.0.2")         # more: all of them the asker's
    assert tm.queues_of("10.0.0.1") == 0 and tm.queues_of("10.0.0.2") == 20
    tm.create(TopicConfig("T", 24, 24))                     # an operator's (ACL): charged to nobody
    assert tm.queues_counted("T") == (24, None) and tm.queues_of("10.0.0.2") == 0
    tm.for_send("%RETRY%G", None, 8, "10.0.0.3")
    assert tm.queues_of("10.0.0.3") == 1 and tm.queue_total == system + 25
    tm.delete("T")
    tm.delete("%RETRY%G")
    assert tm.queue_total == system and tm.queues_of("10.0.0.3") == 0


def test_restored_topics_count_in_the_total(tmp_path):
    tm = _manager(tmp_path)
    system = tm.queue_total
    tm.adopt([("Lost", 5)])
    tm.queue_appeared("Lost", 9)
    assert tm.queues_counted("Lost") == (10, None) and tm.queue_total == system + 10


def test_max_queues_unset_is_what_the_limits_hold_and_set_is_kept_and_warned_about_past_them():
    # unset (0): the limits decide, nothing to warn about, whatever the machine
    assert effective_max_queues(0, 20000, 65530) == ((20000 - 4096) // 2, None)
    assert effective_max_queues(0, 1 << 20, 65530) == (65530 - 4096, None)
    assert effective_max_queues(0, 1024, 65530) == ((1024 - 256) // 2, None)     # a small limit: a small headroom
    assert effective_max_queues(0, resource.RLIM_INFINITY, None)[1] is None
    # set: kept; warned about, naming the limit short, only past what the limits hold
    assert effective_max_queues(1000, 1 << 20, 65530) == (1000, None)
    kept, short = effective_max_queues(30000, 20000, 65530)
    assert kept == 30000 and "open-files limit 20000 holds about 7952" in short and "max_map_count" not in short
    kept, short = effective_max_queues(70000, 1 << 20, 65530)
    assert kept == 70000 and "vm.max_map_count=65530" in short and "open-files" not in short
    assert effective_max_queues(70000, resource.RLIM_INFINITY, None) == (70000, None)


def test_connections_get_half_the_headroom_max_queues_leaves_and_never_the_store_s_descriptors():
    # derived max_queues leaves a quarter of a small limit: half of that is the connections'
    assert connections_limits_hold(256, effective_max_queues(0, 256, 65530)[0]) == 32
    assert connections_limits_hold(20000, effective_max_queues(0, 20000, 65530)[0]) == 3072
    # vm.max_map_count binds the queues: the connections have the rest of the limit
    assert connections_limits_hold(1 << 20, 65530 - 4096) == (1 << 20) - 2 * (65530 - 4096) - 1024
    assert connections_limits_hold(160, 30000) == 16      # a max_queues past the limit: a few, never none
    assert connections_limits_hold(resource.RLIM_INFINITY, 100) is None


def test_who_made_each_topic_and_holds_its_queues_is_counted_again_after_a_restart(tmp_path):
    tm = _manager(tmp_path)
    tm.create(TopicConfig("Mine", 4, 4), "10.0.0.1")
    tm.create(TopicConfig("Grown", 2, 2), "10.0.0.1")
    tm.create(TopicConfig("Grown", 6, 6), "10.0.0.2")       # more queues: the asker's
    tm.create(TopicConfig("Ops", 1, 1), "10.0.0.1")
    tm.create(TopicConfig("Ops", 3, 3))                     # an operator's: charged to nobody
    tm.create(TopicConfig("Operator", 5, 5))
    tm.for_send("%RETRY%G", None, 8, "10.0.0.3")
    tm.delete("%RETRY%G")
    before = [(c, tm.created_by(c), tm.queues_of(c)) for c in ("10.0.0.1", "10.0.0.2", "10.0.0.3")]
    assert before == [("10.0.0.1", 3, 4), ("10.0.0.2", 0, 6), ("10.0.0.3", 0, 0)]
    again = _manager(tmp_path)
    assert [(c, again.created_by(c), again.queues_of(c)) for c in ("10.0.0.1", "10.0.0.2", "10.0.0.3")] == before
    assert again.queues_counted("Ops") == (3, None) and again.queues_counted("Operator") == (5, None)
    assert again.queue_total == tm.queue_total
    # the catalogue says only what is not the default: a creator, and who holds the queues when another does
    entries = {t["name"]: t for t in json.loads((tmp_path / "topics.json").read_text())["topics"]}
    assert entries["Mine"]["creator"] == "10.0.0.1" and "queues_by" not in entries["Mine"]
    assert entries["Grown"]["queues_by"] == "10.0.0.2" and entries["Ops"]["queues_by"] is None
    assert "creator" not in entries["Operator"] and "queues_by" not in entries["Operator"]


def test_a_slave_neither_counts_nor_refuses_per_host(tmp_path):
    tm = _manager(tmp_path)
    tm.create(TopicConfig("Mine", 4, 4), "10.0.0.1")
    slave = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=8, cluster="C", broker="B",
                         per_host=False)
    assert slave.created_by("10.0.0.1") == 0 and slave.queues_of("10.0.0.1") == 0
    slave.create(TopicConfig("More", 1, 1), "10.0.0.1")
    assert slave.created_by("10.0.0.1") == 0 and slave.room_for("10.0.0.1", 0)


def test_a_catalogue_with_a_malformed_creator_is_damaged(tmp_path):
    from broker.topics import _parse_catalogue
    for bad in ({"creator": 7}, {"creator": None}, {"creator": "x" * 129}, {"queues_by": 1}):
        with pytest.raises(ValueError):
            _parse_catalogue({"topics": [{"name": "T", **bad}]})


def test_a_reclaimed_retry_topic_made_again_after_a_restart_is_still_its_makers(tmp_path):
    tm = _manager(tmp_path)
    tm.retry_reclaimable = lambda name: True
    tm.for_send("%RETRY%G", None, 8, "10.0.0.3")
    assert tm.reclaim_retry_of("10.0.0.3", "a test") and tm.created_by("10.0.0.3") == 0
    again = _manager(tmp_path)
    again.queue_appeared("%RETRY%G", 0)         # its delayed retry, delivered after the restart
    assert again.created_by("10.0.0.3") == 1 and again.queues_of("10.0.0.3") == 1


def test_max_queues_unset_is_never_more_than_with_no_limit_known():
    """A huge open-files limit with no vm.max_map_count to read (not Linux) gave a default of 2**61: no cap at all.
    It is what no known limit gives, at most; a value set is kept as it is."""
    unbounded, _ = effective_max_queues(0, resource.RLIM_INFINITY, None)
    assert effective_max_queues(0, 1 << 62, None) == (unbounded, None)
    assert effective_max_queues(0, 1 << 62, 1 << 40) == (unbounded, None)
    assert effective_max_queues(1 << 30, 1 << 62, None) == (1 << 30, None)


def test_a_catalogue_a_slave_wrote_does_not_say_its_creators_were_recorded(tmp_path, caplog):
    """A slave records no creators; writing "creators_recorded" anyway, a broker demoted to slave and promoted
    again (or a slave promoted) started with every topic charged to no one and said nothing."""
    tm = _manager(tmp_path)
    tm.create(TopicConfig("Mine", 4, 4), "10.0.0.1")
    slave = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=8, cluster="C", broker="B",
                         per_host=False)
    slave.create(TopicConfig("Followed", 1, 1))             # its master's topics, followed: the catalogue rewritten
    with caplog.at_level("WARNING", logger="txmq.topics"):
        promoted = _manager(tmp_path)
    assert promoted.created_by("10.0.0.1") == 0
    assert "written before topics' creators were recorded: its 2 topics" in caplog.text
    promoted.create(TopicConfig("Again", 1, 1), "10.0.0.1")   # a master's catalogue records them again
    caplog.clear()
    with caplog.at_level("WARNING", logger="txmq.topics"):
        assert _manager(tmp_path).created_by("10.0.0.1") == 1
    assert "creators were recorded" not in caplog.text


def test_the_catalogue_saves_the_newest_reclaimed_retry_makers_only_and_none_past_their_time(tmp_path):
    """Every reclaimed %RETRY% topic kept in memory (65,536 at most, 3 h each) was written with every catalogue
    write: about 6 MB a write at the bound, and those past 3 h, of no use, until the next reclaim."""
    import time as time_mod

    from broker import topics as topics_mod
    kept = getattr(topics_mod, "_RECLAIMED_SAVED", 4096)
    tm = _manager(tmp_path)
    now = time_mod.monotonic()
    tm._reclaimed["%RETRY%old"] = ("10.0.0.9", now - topics_mod._RECLAIMED_KEEP_S - 1)     # past its time
    for i in range(kept + 10):
        tm._reclaimed[f"%RETRY%g{i}"] = ("10.0.0.1", now)
    tm.create(TopicConfig("Mine", 1, 1), "10.0.0.1")       # a catalogue write
    saved = json.loads((tmp_path / "topics.json").read_text())["reclaimed"]
    assert len(saved) == kept
    assert saved[0][0] == "%RETRY%g10" and saved[-1][0] == f"%RETRY%g{kept + 9}"
    again = _manager(tmp_path)
    again.queue_appeared(f"%RETRY%g{kept + 9}", 0)     # the newest: still its maker's
    assert again.created_by("10.0.0.1") == 2


def test_no_room_for_a_default_topic_says_every_new_topic_is_refused_only_when_none_fits():
    """Start-up's NO NEW TOPICS error: with room for fewer queues than the default topic's, a smaller topic (a
    stock producer's auto-created one has 4) is still made, so "every new topic will be refused" was false."""
    from broker.server import no_room_for_topics
    none = no_room_for_topics(51, 48, 8, 128, 65530)
    assert "every new topic and every topic given more queues will be refused" in none
    assert "raise it to" in none
    some = no_room_for_topics(51, 55, 8, 148, 65530)
    assert some.startswith("NO NEW TOPICS: ") and "every new topic" not in some
    assert "past 4 more queues in all" in some and "default 8 queues" in some
