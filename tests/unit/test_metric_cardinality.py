"""Label values a client chooses (consumer and producer group names) cannot grow the exposition without
bound: a client pulling or sending halves under a new group name each time made new series for good --
thousands of series per scrape, and as many cached children in the broker's memory. Past ``max_series``
label sets of one metric the rest are counted under ``_other`` (totals stay exact), until label sets that have
not moved for an hour give their places up."""
from __future__ import annotations

import logging

from broker.metrics import OTHER, BrokerMetrics


def _series(m: BrokerMetrics, name: str) -> dict:
    return {tuple(sorted(s.labels.items())): s.value for family in m.registry.collect() for s in family.samples
            if s.name == name}


def test_invented_group_names_fold_into_other_past_the_limit(caplog):
    m = BrokerMetrics()
    m.max_series = 3
    with caplog.at_level(logging.WARNING, logger="txmq.metrics"):
        for i in range(50):
            m.count_out("T", f"CG_invented_{i}", 2, 20)
            m.child(m.half_in, f"PG_invented_{i}").inc()
            m.child(m.finish_latency, f"PG_invented_{i}").observe(0.5)
    out = _series(m, "rocketmq_messages_out_total")
    assert len(out) == 4 and sum(out.values()) == 100
    assert out[(("consumer_group", OTHER), ("topic", OTHER))] == 94
    half = _series(m, "txmq_half_messages_total")
    assert len(half) == 4 and sum(half.values()) == 50
    assert len(_series(m, "rocketmq_finish_message_latency_count")) == 4
    assert len(m._children) == 4 * (3 + 1) and len(m._pulled) == 3     # four metrics; no rate past the limit
    assert sum("rocketmq_messages_out" in r.getMessage() for r in caplog.records) == 1     # said once


def test_groups_that_stopped_pulling_make_room_for_the_rates_of_new_ones():
    """consumeTps is kept for max_series (topic, group) pairs; the first ones ever seen held every place for good,
    so on a broker whose groups come and go, every group after them read a rate of 0 however fast it consumed.
    A pair that pulled nothing for a minute (rate 0 either way) gives its place up."""
    m = BrokerMetrics()
    m.max_series = 3
    for i in range(3):
        m.count_out("T", f"CG_old{i}", 10, 100, now=1000.0)
    m.count_out("T", "CG_new", 10, 100, now=1005.0)
    assert m.consume_tps("CG_new", "T", now=1005.0) == 0.0           # all three still count: no room
    assert m.consume_tps("CG_old0", "T", now=1005.0) > 0
    m.count_out("T", "CG_old0", 10, 100, now=1059.0)                  # one old group goes on pulling
    m.count_out("T", "CG_new", 60, 100, now=1065.0)                   # a minute on: two have stopped
    assert m.consume_tps("CG_new", "T", now=1065.0) == 60 / 55
    assert set(m._pulled) == {("T", "CG_old0"), ("T", "CG_new")}
    assert m.consume_tps("CG_old0", "T", now=1065.0) == 10 / 55


def test_a_deleted_topic_gives_its_series_back():
    m = BrokerMetrics()
    m.max_series = 2
    m.count_in("Gone", 1, 10)
    m.count_out("Gone", "CG1", 1, 10)
    m.count_out("Gone", "CG2", 1, 10)
    m.count_out("Kept", "CG1", 1, 10)                                 # past the limit: under _other
    m.forget_topic("Gone")
    assert not [k for k in _series(m, "rocketmq_messages_out_total") if ("topic", "Gone") in k]
    assert "Gone" not in m._in and not [p for p in m._pulled if p[0] == "Gone"]
    m.count_out("Kept", "CG2", 1, 10)                                 # the room it held is free again
    assert _series(m, "rocketmq_messages_out_total")[(("consumer_group", "CG2"), ("topic", "Kept"))] == 1


def test_groups_gone_for_an_hour_give_their_series_up_to_new_ones():
    """Past max_series the first names ever seen held every place for good: a broker whose producer groups come
    and go (named after their host, new with each deployment) counted every later group's transactions under
    _other after months, unseen. Label sets unchanged for idle_s give their places up; moving ones stay."""
    m = BrokerMetrics()
    clock = [1000.0]
    m.monotonic = lambda: clock[0]
    m.max_series = 3
    for i in range(3):
        m.child(m.commits, f"PG_pod{i}").inc()
        m.child(m.finish_latency, f"PG_pod{i}").observe(0.0)
    m.child(m.commits, "PG_new").inc()                  # at the limit, nothing idle for an hour yet
    m.child(m.finish_latency, "PG_new").observe(1.0)
    assert _series(m, "rocketmq_commit_messages_total")[(("producer_group", OTHER),)] == 1
    clock[0] += 1800
    m.child(m.commits, "PG_pod0").inc()                 # pod0 lives on; pods 1 and 2 are gone
    m.child(m.finish_latency, "PG_pod0").observe(0.0)   # (a histogram whose sum does not move still moves)
    m.child(m.commits, "PG_new").inc()                  # half an hour: still no room
    clock[0] += 1800
    m.child(m.commits, "PG_new").inc()
    m.child(m.finish_latency, "PG_new").observe(1.0)
    commits = _series(m, "rocketmq_commit_messages_total")
    assert commits == {(("producer_group", "PG_pod0"),): 2, (("producer_group", OTHER),): 2,
                       (("producer_group", "PG_new"),): 1}
    latency = _series(m, "rocketmq_finish_message_latency_count")
    assert latency == {(("producer_group", "PG_pod0"),): 2, (("producer_group", OTHER),): 1,
                       (("producer_group", "PG_new"),): 1}
    assert len(m._children) == 2 * 3 and m._made[id(m.commits)] == 2


def test_names_invented_per_request_stay_bounded_hour_after_hour():
    m = BrokerMetrics()
    clock = [0.0]
    m.monotonic = lambda: clock[0]
    m.max_series = 100
    for hour in range(5):
        for i in range(1000):
            m.child(m.half_in, f"PG_{hour}_{i}").inc()
        clock[0] += m.idle_s
        assert len(_series(m, "txmq_half_messages_total")) <= 101
        assert _series(m, "txmq_half_messages_total")[(("producer_group", OTHER),)] >= 900
    assert len(m._children) <= 101


def test_a_snapshot_encoded_in_slices_reads_back_as_the_snapshot():
    """metrics._encode joins consumer_lag from slices by hand: what it writes must parse to the snapshot
    itself, past a slice boundary and with or without other keys beside the rows."""
    import json

    from broker import metrics as metrics_mod

    n = 2 * metrics_mod._ROWS_A_CALL + 3
    rows = [{"group": f"g{i}", "topic": "T", "queue_id": i % 4, "lag": i} for i in range(n)]
    for snapshot in ({"ts": 1, "connections": 2, "consumer_lag": rows}, {"consumer_lag": rows},
                     {"ts": 1, "consumer_lag": rows[:metrics_mod._ROWS_A_CALL]}, {"ts": 1, "consumer_lag": []}):
        line = metrics_mod._encode(snapshot)
        assert "\n" not in line and json.loads(line) == snapshot


def test_deleting_made_up_groups_keeps_no_name_and_a_group_holding_offsets_one(tmp_path):
    """deleted_groups holds the groups deleted with their offsets kept (their lag left out until they come back).
    Every deleted name went in, the ones holding no offset (made-up names: any client may delete 100,000 a minute,
    answered SUCCESS) dropped only by a walk of them all. A name holding no offset is not kept at all."""
    import asyncio
    import types

    from broker.processors.ops import delete_subscription_group
    from broker.store import ConsumerOffsets
    from protocol.codes import RequestCode
    from protocol.command import RemotingCommand

    m = BrokerMetrics()
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("CG_real", "T", 0, 1)
    m.deleted_groups = offsets.deleted      # as the server has it
    ctx = types.SimpleNamespace(config=types.SimpleNamespace(broker_role="ASYNC_MASTER"), metrics=m,
                                subscriptions=types.SimpleNamespace(delete=lambda g: False), offsets=offsets,
                                limits=types.SimpleNamespace(warn=lambda reason, line: warned.append(reason)))
    warned = []

    async def deletes():
        for group in [f"CG_made_up{i}" for i in range(1000)] + ["CG_real"]:
            reply = await delete_subscription_group(ctx, None, RemotingCommand.request(
                RequestCode.DELETE_SUBSCRIPTIONGROUP, {"groupName": group, "removeOffset": "false"}))
            assert reply.code == 0, reply.remark
    asyncio.run(deletes())
    assert m.deleted_groups == {"CG_real"}
    assert warned == ["group-delete-nothing"] * 1000      # (Limits.warn says them at most every 10 s)


class _NoWalk(dict):
    """A series table that counts the walks of it (a delete must find its series without one)."""
    walks = 0

    def __iter__(self):
        _NoWalk.walks += 1
        return super().__iter__()

    def items(self):
        _NoWalk.walks += 1
        return super().items()


def test_a_topic_or_group_delete_finds_its_series_without_a_walk_of_every_series():
    """Each DELETE_TOPIC_IN_BROKER and DELETE_SUBSCRIPTIONGROUP walked every family's series (and every pair's
    rate) on the loop to find the deleted name's: a broker of months of gone groups (10,000 series a family) held
    the loop ~24 ms a delete, each delete slower than the last. Found by name now; what is gone is gone (series,
    rates, GROUP_GET_NUMS) and the index holds nothing of it after."""
    m = BrokerMetrics()
    for i in range(200):
        m.count_out("Churn", f"CG{i}", 1, 10)
        m.child(m.stale_subscriptions, f"CG{i}").inc()
    def index():        # (the series' index by name)
        return {name: set(keys) for name, keys in getattr(m, "_keys_of", {}).items()}
    before = index()
    m.child(m.pulls_moved_past, "Gone", "CG1").inc()
    m.count_out("Gone", "CG1", 2, 20)
    m.count_out("Gone", "CG_gone", 2, 20)
    m.child(m.stale_subscriptions, "CG_gone").inc()
    m._children = _NoWalk(m._children)
    m.forget_topic("Gone")
    m.forget_consumer_group("CG_gone")
    assert _NoWalk.walks == 0
    assert all("Gone" not in key[1] and "CG_gone" not in key[1] for key in m._children)
    assert ("Gone", "CG1") not in m._pulled and ("Gone", "CG1") not in m._got and ("Gone", "CG_gone") not in m._got
    assert m.consume_tps("CG1", "Churn") > 0 and ("Churn", "CG1") in m._got
    assert index() == before
    m.count_out("Gone", "CG1", 1, 10)       # made again: counted from zero
    assert m.child(m.messages_out, "Gone", "CG1")._value.get() == 1


def test_the_series_index_stays_the_series_through_any_mix_of_makes_deletes_and_evictions():
    """The index a topic or group delete finds its series by is kept beside the series and the rates: made with
    them, and emptied on every path that removes them (a delete, an idle series evicted at max_series, a rate
    swept at max_series). A path that forgot it left a gone name's keys in it for good (memory growing with every
    name ever seen), and a delete after went on finding series that were no longer there. Random runs of every
    path, the index compared with one rebuilt from what the series and rates are after each step."""
    import random

    for seed in range(20):
        rnd = random.Random(seed)
        m = BrokerMetrics()
        clock = [1000.0]
        m.monotonic = lambda: clock[0]
        m.max_series = 6
        names = ["T0", "T1", "CG0", "CG1", "CG2", "X"]     # "X" a topic and a group both

        def rebuilt():
            index: dict = {}
            for key in m._children:
                if key[1] != (OTHER,) * len(key[1]):
                    for value in key[1]:
                        index.setdefault(value, set()).add(key)
            for pair in m._pulled:
                for value in pair:
                    index.setdefault(value, set()).add(("pulled", pair))
            return index

        for step in range(400):
            op = rnd.randrange(7)
            topic, group = rnd.choice(names), rnd.choice(names)
            if op <= 1:
                m.count_out(topic, group, 1, 10, now=clock[0])
            elif op == 2:
                m.child(m.pulls_moved_past, topic, group).inc()
            elif op == 3:
                m.child(m.stale_subscriptions, group).inc()
            elif op == 4:
                m.forget_topic(topic)
            elif op == 5:
                m.forget_consumer_group(group)
            else:
                clock[0] += rnd.choice([1, 70, m.idle_s])
            assert m._keys_of == rebuilt(), (seed, step)
            for value, keys in m._keys_of.items():
                assert keys, (seed, step, value)    # (an empty set kept for a name: memory for good)
