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
