"""What the topic catalogue counts for max_queues and max_queues_per_host, and the start-up check of the limits."""
from __future__ import annotations

import resource

from broker.server import effective_max_queues
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


def test_max_queues_unset_is_never_more_than_with_no_limit_known():
    """A huge open-files limit with no vm.max_map_count to read (not Linux) gave a default of 2**61: no cap at all.
    It is what no known limit gives, at most; a value set is kept as it is."""
    unbounded, _ = effective_max_queues(0, resource.RLIM_INFINITY, None)
    assert effective_max_queues(0, 1 << 62, None) == (unbounded, None)
    assert effective_max_queues(0, 1 << 62, 1 << 40) == (unbounded, None)
    assert effective_max_queues(1 << 30, 1 << 62, None) == (1 << 30, None)
