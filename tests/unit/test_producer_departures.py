"""ClientRegistry remembers which producer groups an open connection unregistered (UNREGISTER_CLIENT), so a
transaction check is not sent there (tests/integration/test_check_after_unregister.py end to end)."""
from __future__ import annotations

from broker.clients import ClientRegistry


class _Conn:
    """A connection as the registry sees one: open, with a peer and attributes; hashable by identity."""

    is_open = True
    peer = ("127.0.0.1", 1)

    def __init__(self):
        self.attributes = {}


def _conn():
    return _Conn()


def test_a_producer_that_unregistered_has_left_until_it_comes_back():
    clients = ClientRegistry(lambda: 0)
    conn = _conn()
    clients.add_producer("PG", conn, "c1")
    assert not clients.left_group(conn, "PG")
    clients.unregister(conn, "PG", None)
    assert clients.left_group(conn, "PG") and clients.producer_channels("PG") == []
    clients.add_producer("PG", conn, "c1")          # a new producer of the group in the same process
    assert not clients.left_group(conn, "PG")
    clients.unregister(conn, "PG", None)
    clients.connection_closed(conn)                 # forgotten with the connection
    assert not clients.left_group(conn, "PG") and clients._left == {}


def test_unregistering_groups_it_never_joined_records_nothing():
    clients = ClientRegistry(lambda: 0)
    conn = _conn()
    for i in range(1000):                           # a client naming group after group must not grow memory
        clients.unregister(conn, f"PG{i}", None)
    assert clients._left == {}


def test_joining_and_leaving_group_after_group_on_one_connection_stays_bounded():
    """Only a group it was in is recorded, but one connection joining (HEART_BEAT) and leaving
    (UNREGISTER_CLIENT) group after group grew the table for as long as it stayed open."""
    clients = ClientRegistry(lambda: 0)
    conn = _conn()
    for i in range(10_000):          # e.g. a process making a producer per tenant, one connection per broker
        clients.add_producer(f"PG{i}", conn, "c1")
        clients.unregister(conn, f"PG{i}", None)
    assert sum(len(s) for s in clients._left.values()) <= 1024
    assert clients.left_group(conn, "PG9999")       # the latest departures are the ones kept
    clients.add_producer("PG9999", conn, "c1")      # and coming back still clears one
    assert not clients.left_group(conn, "PG9999") and clients.left_group(conn, "PG9998")


def test_a_producer_joining_a_group_is_announced_once_a_connection():
    """on_new_producer (the transaction service's producer_joined: the group's deferred transactions are checked
    at once) is called for a group's first heartbeat on a connection, a reconnection and a return after
    UNREGISTER_CLIENT, not for every heartbeat."""
    clients = ClientRegistry(lambda: 0)
    joined = []
    clients.on_new_producer = joined.append
    first, second = _conn(), _conn()
    for _ in range(3):
        clients.add_producer("PG", first, "c1")
    clients.add_producer("PG2", first, "c1")
    assert joined == ["PG", "PG2"]
    clients.connection_closed(first)
    clients.add_producer("PG", second, "c1")        # the same client, reconnected
    clients.unregister(second, "PG", None)
    clients.add_producer("PG", second, "c1")        # back in the group
    clients.add_producer("PG", second, "c1")
    assert joined == ["PG", "PG2", "PG", "PG"]
