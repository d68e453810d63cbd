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
    assert _beat(clients, conn, "G") == (["G"], 0, [])
    body = {"consumerDataSet": [{"groupName": "G", "subscriptionDataSet": [
        {"topic": f"Topic{i}", "subString": "*"} for i in range(50)]}]}
    changed, _, oversized = clients.heartbeat(conn, RemotingCommand.request(R.HEART_BEAT,
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
