"""ClientRegistry's per-address group cap (max_groups_per_host): every way a membership ends gives its room back,
or an address whose clients came and went would be refused for good (tests/integration/test_hostile_caps.py end
to end)."""
from __future__ import annotations

import json

from broker.clients import ClientRegistry
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand


class _Conn:
    is_open = True

    def __init__(self, host="10.0.0.1"):
        self.peer = (host, 1)
        self.attributes = {}


def _beat(clients, conn, *consumers, producers=()):
    body = {"clientID": "c", "producerDataSet": [{"groupName": g} for g in producers],
            "consumerDataSet": [{"groupName": g, "subscriptionDataSet": [{"topic": "T", "subString": "*"}]}
                                for g in consumers]}
    return clients.heartbeat(conn, RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))


def test_every_departure_gives_the_room_back():
    now = [0]
    clients = ClientRegistry(lambda: now[0], max_groups_per_host=2)
    a, b = _Conn(), _Conn()
    assert _beat(clients, a, "C1", producers=["P1"])[1] == 0
    assert _beat(clients, b, "C2")[1] == 1                      # the address is full: b joins nothing
    assert _beat(clients, a, "C1", producers=["P1"])[1] == 0   # renewals are never refused
    assert _beat(clients, _Conn("10.0.0.2"), "C2")[1] == 0      # another address has its own room
    clients.unregister(a, "P1", None)                           # UNREGISTER_CLIENT
    assert _beat(clients, b, "C2")[1] == 0
    clients.connection_closed(b)                                # a closed connection
    assert _beat(clients, b, "C3")[1] == 0
    now[0] = 200_000
    clients.expire(120_000)                                     # a silent one
    assert _beat(clients, a, "C4", "C5")[1] == 0
    assert _beat(clients, a, "C6")[1] == 1


def test_a_group_past_max_subscription_bytes_is_not_joined_but_a_member_stays_one():
    clients = ClientRegistry(lambda: 0, max_subscription_bytes=100)
    conn = _Conn()
    assert _beat(clients, conn, "G") == (["G"], 0, [], [])
    body = {"consumerDataSet": [{"groupName": "G", "subscriptionDataSet": [
        {"topic": f"Topic{i}", "subString": "*"} for i in range(50)]}]}
    changed, _, oversized, _ = clients.heartbeat(conn, RemotingCommand.request(R.HEART_BEAT,
                                                                            body=json.dumps(body).encode()))
    assert (changed, oversized) == ([], ["G"])
    assert clients.consumer_ids("G") == ["c"] and list(clients.consumers["G"].subscriptions) == ["T"]


def test_a_half_message_sender_joins_its_group_under_the_same_cap():
    """The transaction service joins a half's sender to its producer group (add_producer): made-up group names
    sent as halves must not grow the table past max_groups_per_host, and a member is still renewed."""
    clients = ClientRegistry(lambda: 0, max_groups_per_host=1)
    conn = _Conn()
    assert clients.add_producer("P1", conn, "c") is True
    assert clients.add_producer("P2", conn, "c") is False
    assert set(clients.producers) == {"P1"} and clients._groups_by_host == {"10.0.0.1": 1}
    assert clients.add_producer("P1", conn, "c") is True        # a renewal at the cap


def _tagged(group: str, tags: list) -> dict:
    return {"groupName": group, "subscriptionDataSet": [{"topic": "T", "subString": "a", "tagsSet": tags}]}


def test_a_group_naming_more_tags_than_its_limit_holds_is_refused_before_they_are_typed():
    """A 15 MB heartbeat of one group of 3 million tags held the loop 3.3 s (typed one by one, then weighed,
    only to be refused for max_subscription_bytes). Each tag is at least a byte of it, so a group naming more
    than that is refused untyped: a bad tag far in is never reached, the heartbeat is not failed for it."""
    clients = ClientRegistry(lambda: 0, max_subscription_bytes=1000)
    conn = _Conn()
    body = {"clientID": "c", "consumerDataSet": [_tagged("G", ["a"] * 1500 + [["not", "a", "tag"]]),
                                                 _tagged("H", ["a"] * 10)]}
    changed, _, oversized, _ = clients.heartbeat(conn, RemotingCommand.request(R.HEART_BEAT,
                                                                            body=json.dumps(body).encode()))
    assert (changed, oversized) == (["H"], ["G"])
    # and empty tags weigh a byte each: 1000 of them do not slip under the limit as nothing
    body = {"clientID": "c", "consumerDataSet": [_tagged("E", [""] * 1001)]}
    assert clients.heartbeat(conn, RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))[2] == ["E"]


def test_a_heartbeat_of_groups_holding_many_tags_lets_the_loop_run_between_them():
    """Slices were counted in groups alone (500): four groups of 15,000 tags each were typed and registered in
    one go. They are cut by the tags they hold too (HEARTBEAT_SLICE_ITEMS)."""
    clients = ClientRegistry(lambda: 0)
    groups = 4
    body = {"clientID": "c", "consumerDataSet": [_tagged(f"G{i}", [f"t{n}" for n in range(15_000)])
                                                 for i in range(groups)]}
    yields = _yields_registering(clients, body, groups)
    assert yields >= 2 * (groups - 1), yields        # between the groups, typing and registering


def test_a_heartbeat_of_groups_of_many_topics_lets_the_loop_run_every_2000_subscriptions():
    """A stock client's 4 MB heartbeat (250 groups of 100 topics: 25,000 subscriptions) was typed and registered
    in slices of 20,000 subscriptions, each holding the loop 0.56-0.9 s on a loaded host (0.12-0.19 s now); every
    other client waited that long. Forty groups of 500 topics now let the loop run every 2,000 (four groups)."""
    groups = 40
    body = {"clientID": "c", "consumerDataSet": [{"groupName": f"G{i}", "subscriptionDataSet": [
        {"topic": f"T{i}_{n}", "subString": "*", "subVersion": 1} for n in range(500)]} for i in range(groups)]}
    yields = _yields_registering(ClientRegistry(lambda: 0), body, groups)
    assert yields >= 2 * (groups // 4 - 1), yields


def _yields_registering(clients, body, groups) -> int:
    """How often registering ``body`` (naming G0..G<groups-1>, each joined) let the loop run."""
    steps = clients.heartbeat_steps(_Conn(), RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))
    yields = 0
    try:
        while True:
            next(steps)
            yields += 1
    except StopIteration as done:
        changed, refused, oversized, _ = done.value
    assert sorted(changed) == sorted(f"G{i}" for i in range(groups)) and not refused and not oversized
    return yields


def test_renew_keeps_a_connection_in_every_group_it_is_in_past_the_idle_time():
    """A heartbeat past max_heartbeat_bytes is not read (processors/client.py): its connection's groups are renewed
    from what the registry holds, so a client whose heartbeat grew past the limit is not dropped from them."""
    now = [0]
    clients = ClientRegistry(lambda: now[0])
    conn, other = _Conn(), _Conn("10.0.0.2")
    _beat(clients, conn, "C1", "C2", producers=["P1"])
    _beat(clients, other, "C1")
    now[0] = 100_000
    assert clients.renew(conn) == 3 and clients.renew(_Conn("10.0.0.3")) == 0
    now[0] = 200_000
    assert clients.expire(120_000) == ["C1"]                    # the other connection's membership, not conn's
    assert clients.consumer_ids("C1") == clients.consumer_ids("C2") == ["c"] and len(clients.producer_channels("P1")) == 1


def test_a_heartbeat_of_long_sql92_expressions_lets_the_loop_run_between_its_groups():
    """A subscription counted one item whatever its expression held: a 3.9 MB heartbeat (within max_heartbeat_bytes)
    of 16 groups, each 15 SQL92 expressions of 16,300 characters (within max_subscription_bytes_per_group), was 240
    items, one slice: parsing them held the loop 4.4 s in one go (runs of minus signs; string literals, as here, are
    quicker to parse). An expression counts its characters now (one item every 64, as a TAG subscription's
    subString, split into tags), so each group is a slice of its own."""
    groups = 16
    body = {"clientID": "c", "consumerDataSet": [{"groupName": f"G{i}", "subscriptionDataSet": [
        {"topic": f"T{n}", "subString": f"a{i}x{n} = '" + "-" * 16_300 + "'", "expressionType": "SQL92"}
        for n in range(15)]} for i in range(groups)]}
    yields = _yields_registering(ClientRegistry(lambda: 0, max_subscription_bytes=256 * 1024), body, groups)
    assert yields >= 2 * (groups - 1), yields


def _subscribed(clients, conn, group: str, topics: int):
    body = {"clientID": "c", "consumerDataSet": [{"groupName": group, "subscriptionDataSet": [
        {"topic": f"T{i:04d}", "subString": "*"} for i in range(topics)]}]}     # 6 bytes a subscription
    return clients.heartbeat(conn, RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))


def test_the_groups_one_address_subscribes_hold_at_most_max_subscription_bytes_per_host():
    """Each group's subscriptions, within max_subscription_bytes, are kept as some 32 times their text: one address
    heartbeating group after group at that limit grew the broker by 8 MB a group, up to max_groups_per_host. The
    groups whose subscriptions an address set are charged to it; a group past what it has left is neither joined
    nor changed, a member renewed; the room comes back when the group goes or another address sets them."""
    now = [0]
    clients = ClientRegistry(lambda: now[0], max_subscription_bytes_per_host=100)
    a, a2, b = _Conn(), _Conn(), _Conn("10.0.0.2")
    assert _subscribed(clients, a, "G1", 10) == (["G1"], 0, [], [])          # 60 bytes
    assert _subscribed(clients, a2, "G2", 10) == ([], 0, [], ["G2"])         # 120 from one address: refused
    assert "G2" not in clients.consumers
    assert _subscribed(clients, b, "G2", 2)[3] == []                          # another address has its own room
    assert _subscribed(clients, a, "G1", 16)[3] == []                         # growing its own within the limit
    assert _subscribed(clients, a, "G1", 17)[3] == ["G1"]                     # past it: kept as it was
    assert len(clients.consumers["G1"].subscriptions) == 16 and clients.consumer_ids("G1") == ["c"]
    assert _subscribed(clients, a, "G1", 2)[3] == []                          # shrinking: always
    assert _subscribed(clients, a2, "G3", 14) == (["G3"], 0, [], [])         # 12 + 84
    clients.connection_closed(a2)                                             # G3 gone: its 84 bytes back
    assert _subscribed(clients, a, "G4", 14)[3] == []
    assert _subscribed(clients, b, "G4", 14)[3] == []                         # b set G4's: a's room back
    assert _subscribed(clients, a, "G5", 14)[3] == []
    assert clients._sub_bytes_by_host == {"10.0.0.1": 12 + 84, "10.0.0.2": 12 + 84}


def _versioned(clients, conn, group: str, expression: str, version: int):
    body = {"clientID": "c", "consumerDataSet": [{"groupName": group, "subscriptionDataSet": [
        {"topic": "T", "subString": expression, "subVersion": version}]}]}
    return clients.heartbeat(conn, RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))


def test_a_subscription_kept_for_its_newer_sub_version_stays_charged_at_what_is_kept():
    """A heartbeat whose subscription is older (subVersion) than the one kept leaves the kept one in place
    (ConsumerGroupInfo.updateSubscription), yet the group was charged the heartbeat's text: one address set a group's
    expression big at a far-future subVersion, then sent it "*" at subVersion 1, charged 5 bytes for the 900 kept,
    and went on to the next group, every one of them within max_subscription_bytes_per_host whatever it held."""
    clients = ClientRegistry(lambda: 0, max_subscription_bytes_per_host=1000)
    a = _Conn()
    big = "||".join(f"tag{i:04d}" for i in range(100))      # 898 characters
    assert _versioned(clients, a, "G1", big, 1 << 60)[3] == []
    assert _versioned(clients, a, "G1", "*", 1)[3] == []      # stale: not refused, the big one kept
    assert clients.consumers["G1"].subscriptions["T"].sub_string == big
    assert _versioned(clients, a, "G2", big, 1 << 60)[3] == ["G2"]
    assert "G2" not in clients.consumers
    assert clients._sub_bytes_by_host["10.0.0.1"] >= len(big)


def test_a_heartbeat_naming_no_topic_leaves_the_group_charged_what_it_keeps():
    """A heartbeat whose subscriptions all name no topic leaves the group's as they were (_register_consumer
    drops a topic only for one that names others), yet the group was charged its few bytes: the kept 898 went
    uncounted, and the address set the next group's as big, and the next."""
    clients = ClientRegistry(lambda: 0, max_subscription_bytes_per_host=1000)
    a = _Conn()
    big = "||".join(f"tag{i:04d}" for i in range(100))
    assert _versioned(clients, a, "G1", big, 1)[3] == []
    body = {"clientID": "c", "consumerDataSet": [{"groupName": "G1", "subscriptionDataSet": [
        {"topic": "", "subString": "*"}]}]}
    assert clients.heartbeat(a, RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))[3] == []
    assert clients.consumers["G1"].subscriptions["T"].sub_string == big
    assert _versioned(clients, a, "G2", big, 1)[3] == ["G2"]


def test_a_group_holds_at_most_max_subscription_bytes_with_the_subscriptions_kept_for_their_sub_version():
    """max_subscription_bytes weighed the heartbeat's text, not what the group would hold: its topics kept for a
    newer subVersion sent again as "*" weighed a few bytes each, and each heartbeat added as much again, the group
    growing past the limit by its size a heartbeat."""
    clients = ClientRegistry(lambda: 0, max_subscription_bytes=1000)
    a = _Conn()
    big = "||".join(f"tag{i:04d}" for i in range(100))      # 898 characters
    assert _versioned(clients, a, "G1", big, 1 << 60)[2] == []
    body = {"clientID": "c", "consumerDataSet": [{"groupName": "G1", "subscriptionDataSet": [
        {"topic": "T", "subString": "*", "subVersion": 1}, {"topic": "U", "subString": big, "subVersion": 1}]}]}
    assert clients.heartbeat(a, RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))[2] == ["G1"]
    assert list(clients.consumers["G1"].subscriptions) == ["T"]
