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
