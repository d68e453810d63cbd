"""NOTIFY_CONSUMER_IDS_CHANGED at most once per NOTICE_GAP_S a group: the change that opens a gap is told at
once, those within it once at its end, none lost (tests/integration/test_hostile_storms.py end to end)."""
from __future__ import annotations

import json

from broker.clients import NOTICE_GAP_S, ClientRegistry
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand


class _Conn:
    is_open = True

    def __init__(self, host="10.0.0.1"):
        self.peer = (host, 1)
        self.attributes = {}
        self.notices = 0

    def oneway(self, cmd):
        assert cmd.code == R.NOTIFY_CONSUMER_IDS_CHANGED
        self.notices += 1


def _beat(clients, conn, topic):
    body = {"clientID": f"c{id(conn)}", "consumerDataSet": [
        {"groupName": "G", "subscriptionDataSet": [{"topic": topic, "subString": "*"}]}]}
    for group in clients.heartbeat(conn, RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))[0]:
        clients.notify_ids_changed(group)


def _registry():
    clients = ClientRegistry(lambda: 0)
    timers, merged = [], []
    clients.call_later = lambda delay, fn, *args: timers.append((delay, fn, args))
    clients.on_notice_merged = lambda: merged.append(1)
    return clients, timers, merged


def test_changes_within_a_gap_are_told_once_at_its_end():
    clients, timers, merged = _registry()
    member, flipper = _Conn(), _Conn()
    _beat(clients, member, "T")                             # joins: told at once, a gap opens
    assert member.notices == 1 and [t[0] for t in timers] == [NOTICE_GAP_S]
    for k in range(1000):                                   # a member flipping its subscription every heartbeat
        _beat(clients, flipper, "U" if k % 2 else "T")
    assert member.notices == 1 and len(merged) == 1000      # nothing sent, every change counted
    _delay, fn, args = timers.pop()
    fn(*args)                                               # the gap ends: one notice says it all
    assert (member.notices, flipper.notices) == (2, 1) and len(timers) == 1     # and the next gap opens
    _delay, fn, args = timers.pop()
    fn(*args)                                               # a gap without changes ends silently
    assert member.notices == 2 and not timers
    _beat(clients, flipper, "T")                            # the next change is told at once again
    assert member.notices == 3 and len(merged) == 1000


def test_without_a_loop_every_change_is_told_at_once():
    clients = ClientRegistry(lambda: 0)
    member, flipper = _Conn(), _Conn()
    _beat(clients, member, "T")
    for k in range(10):
        _beat(clients, flipper, "U" if k % 2 else "T")
    assert member.notices == 11
