"""ClientRegistry.reads_elsewhere: which topics' lag a consumer group's progress (GET_CONSUME_STATS) and the
rocketmq_consumer_lag_messages gauge leave out while the group is online. The group's subscription table follows
each member's latest heartbeat (RocketMQ's ConsumerGroupInfo.updateSubscription: last one wins, and an empty one
keeps what was there), so asking it alone hid a topic that one online member does read, every other heartbeat or
for good: the alert on that backlog (TxmqConsumerLagGrowing, `for: 15m`) was reset or never fired."""
from __future__ import annotations

import json

from broker.clients import ClientRegistry
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand
from tests.unit.test_client_caps import _Conn


def _beat(clients, conn, group, *topics):
    """A heartbeat of one consumer of ``group`` subscribing to ``topics`` (none: a stock DefaultMQPullConsumer
    without registerTopics, or a DefaultLitePullConsumer in assign mode)."""
    body = {"clientID": f"c{id(conn)}", "consumerDataSet": [{"groupName": group, "subscriptionDataSet": [
        {"topic": t, "subString": "*"} for t in topics]}]}
    clients.heartbeat(conn, RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))


def test_a_topic_one_online_member_reads_is_not_left_out_whichever_member_beat_last():
    """Two members subscribing to different topics (a rolling deploy moving the group from T to U, or a
    misconfigured member): T's queues given to the U member are read by nobody, a real backlog. Whichever
    heartbeat came last, T and U both count; once the T member is gone, T is left out."""
    clients = ClientRegistry(lambda: 0)
    a, b = _Conn(), _Conn()
    _beat(clients, a, "G", "T", "%RETRY%G")
    _beat(clients, b, "G", "U", "%RETRY%G")
    for _ in range(2):
        assert not clients.reads_elsewhere("G", "T") and not clients.reads_elsewhere("G", "U")
        _beat(clients, a, "G", "T", "%RETRY%G")
        assert not clients.reads_elsewhere("G", "T") and not clients.reads_elsewhere("G", "U")
        _beat(clients, b, "G", "U", "%RETRY%G")
    assert clients.reads_elsewhere("G", "Old")              # nobody reads it
    clients.connection_closed(a)
    assert clients.reads_elsewhere("G", "T") and not clients.reads_elsewhere("G", "U")


def test_a_member_that_names_no_subscription_may_read_any_topic():
    """A pull consumer heartbeats no subscription and pulls (and commits) whatever topics it is told. With a push
    member that left, the group's table kept that member's topics (an empty heartbeat changes nothing): the pull
    member's topics were left out for as long as it stayed online. With a push member still there, likewise."""
    clients = ClientRegistry(lambda: 0)
    push, pull = _Conn(), _Conn()
    _beat(clients, push, "G", "T", "%RETRY%G")
    _beat(clients, pull, "G")
    assert not clients.reads_elsewhere("G", "Pulled")
    clients.connection_closed(push)
    assert not clients.reads_elsewhere("G", "Pulled") and not clients.reads_elsewhere("G", "T")
    _beat(clients, pull, "G")
    assert not clients.reads_elsewhere("G", "Pulled")
    assert not clients.reads_elsewhere("Nobody", "T")       # a group with nobody online: every topic counts


def test_the_groups_own_retry_topic_counts_whatever_its_members_name():
    """A pull consumer names only its topics (stock DefaultMQPullConsumer and DefaultLitePullConsumer too) yet may
    pull and commit %RETRY%<group>: that lag counts; another group's retry topic does not."""
    clients = ClientRegistry(lambda: 0)
    _beat(clients, _Conn(), "G", "T")
    assert not clients.reads_elsewhere("G", "%RETRY%G") and not clients.reads_elsewhere("G", "T")
    assert clients.reads_elsewhere("G", "%RETRY%H")


def test_deleted_groups_are_looked_at_in_the_lag_walk_once_a_group_not_all_at_each_call(tmp_path):
    """A group deleted with its offsets kept (deleteSubGroup without -r) is left out of the lag until it is known
    again. _lag_counted walked every deleted name at each call, the gauge loop's every second and each scrape's:
    100,000 such groups (one client's max_offsets_per_host, each deleted without removeOffset) held the loop some
    40-55 ms every second, unsliced, for as long as the broker ran. Each is looked at in the lag's own walk
    (sliced), once a group; a group known again (a consumer connected) is counted and its name dropped."""
    import types

    from broker.config import BrokerConfig
    from broker.server import BrokerServer
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    clients = ClientRegistry(lambda: 0)
    server.ctx = types.SimpleNamespace(clients=clients, subscriptions=types.SimpleNamespace(groups={}),
                                       offsets=types.SimpleNamespace(groups=lambda: {f"G{i}": {} for i in range(4)}))
    looked: list[str] = []
    known = server._known_group
    server._known_group = lambda g: looked.append(g) or known(g)
    server.metrics.deleted_groups |= {f"G{i}" for i in range(10_000)}
    counted = server._lag_counted()
    assert looked == []                                     # nothing walked at the call
    _beat(clients, _Conn(), "G1", "T")                      # G1 back: a consumer of it connected
    assert not counted("G0", "T") and not counted("G0", "T")
    assert counted("G1", "T")
    assert looked == ["G0", "G1"]                           # once a group
    assert "G1" not in server.metrics.deleted_groups and "G0" in server.metrics.deleted_groups
    clients.connection_closed(next(iter(clients.consumers["G1"].channels)))
    assert server._lag_counted()("G1", "T")                 # its consumer gone again: still counted
