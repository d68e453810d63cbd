"""What closing a connection costs ClientRegistry: the groups of that connection, not every group. With 20,000
groups a close walked them all (about 9 ms on the loop), and a reconnect storm of 1,000 clients stalled every
connection for seconds. Counted as the group tables touched, not timed."""
from __future__ import annotations

from broker.clients import ClientRegistry
from tests.unit.test_client_caps import _beat, _Conn


class _Touched(dict):
    """A group's {connection: channel} that counts every look at it."""
    looks = 0

    def _look(self):
        type(self).looks += 1

    def pop(self, *a):
        self._look()
        return super().pop(*a)

    def get(self, *a):
        self._look()
        return super().get(*a)

    def __len__(self):
        self._look()
        return super().__len__()

    def __contains__(self, key):
        self._look()
        return super().__contains__(key)

    def __iter__(self):
        self._look()
        return super().__iter__()


def test_closing_a_connection_touches_only_its_own_groups():
    clients = ClientRegistry(lambda: 0)
    crowd = _Conn("10.0.0.9")
    _beat(clients, crowd, *(f"C{i}" for i in range(2000)), producers=[f"P{i}" for i in range(2000)])
    mine = _Conn()
    _beat(clients, mine, "C0", "Mine", producers=["P0", "PMine"])
    for name, channels in clients.producers.items():
        clients.producers[name] = _Touched(channels)
    for group in clients.consumers.values():
        group.channels = _Touched(group.channels)
    _Touched.looks = 0
    assert sorted(clients.connection_closed(mine)) == ["C0", "Mine"]
    assert _Touched.looks <= 4 * 4                     # its 4 groups, a few looks each; not 4,002 groups
    assert "Mine" not in clients.consumers and "PMine" not in clients.producers     # emptied: forgotten
    assert clients.consumer_ids("C0") == ["c"] and len(clients.producer_channels("P0")) == 1
    assert clients._groups_by_host == {"10.0.0.9": 4000}
    assert clients.connection_closed(mine) == []       # a second close finds nothing


def test_every_way_out_of_a_group_keeps_the_index_right():
    """Leaving by UNREGISTER_CLIENT or by expiry, then closing, leaves no group behind and no count."""
    now = [0]
    clients = ClientRegistry(lambda: now[0])
    a, b = _Conn(), _Conn("10.0.0.2")
    _beat(clients, a, "C1", "C2", producers=["P1", "P2"])
    _beat(clients, b, "C1", producers=["P1"])
    clients.unregister(a, "P1", "C1")
    assert clients.connection_closed(a) == ["C2"]
    assert set(clients.consumers) == {"C1"} and set(clients.producers) == {"P1"}
    now[0] = 200_000
    assert clients.expire(120_000) == ["C1"]
    assert clients.connection_closed(b) == []
    assert (clients.consumers, clients.producers, clients._groups_by_host) == ({}, {}, {})


def test_a_producer_expired_on_an_open_connection_has_left_its_group_and_is_told():
    """Dropped for silence while its connection stays open (its process's consumer heartbeats on it): taken as an
    UNREGISTER_CLIENT, so its checks in flight go to the group's others at once (on_producer_left); one whose
    connection closed is not (the close loses its checks); and a heartbeat naming the group again brings it back."""
    now = [0]
    clients = ClientRegistry(lambda: now[0])
    told = []
    clients.on_producer_left = lambda conn, group: told.append((conn, group))
    open_, closed = _Conn(), _Conn("10.0.0.2")
    _beat(clients, open_, "C1", producers=["P1"])
    _beat(clients, closed, producers=["P1"])
    now[0] = 100_000
    _beat(clients, open_, "C1")                         # its consumer only
    closed.is_open = False
    now[0] = 200_000
    clients.expire(120_000)
    assert told == [(open_, frozenset({"P1"}))] and clients.left_group(open_, "P1") and not clients.left_group(closed, "P1")
    _beat(clients, open_, "C1", producers=["P1"])
    assert not clients.left_group(open_, "P1") and len(clients.producer_channels("P1")) == 1


def test_a_producer_no_heartbeat_named_is_not_taken_as_having_left_when_expired():
    """One that joined by its half sends alone (a pre-4.5.1 Java client's VIP channel: its heartbeats go to the
    broker port) is dropped for silence, but has not left: its process answers a check on it."""
    now = [0]
    clients = ClientRegistry(lambda: now[0])
    told = []
    clients.on_producer_left = lambda conn, group: told.append((conn, group))
    vip = _Conn()
    assert clients.add_producer("P1", vip, "10.0.0.1:5000")     # (as a half send joins it)
    now[0] = 200_000
    clients.expire(120_000)
    assert told == [] and not clients.left_group(vip, "P1") and clients.producer_channels("P1") == []


def test_a_connection_dropped_from_many_groups_at_once_is_told_once_with_them_all():
    """One expiry pass dropping a connection from many producer groups (max_groups_per_host allows 10,000 a host)
    tells the transaction service once for the connection, with every group: told group by group, each call walked
    all the checks the connection held, 10,000 groups x 10,000 checks in flight on one pass of the event loop (36 s
    measured on a loaded host, every client stalled)."""
    now = [0]
    clients = ClientRegistry(lambda: now[0])
    told = []
    clients.on_producer_left = lambda conn, groups: told.append((conn, groups))
    conn = _Conn()
    _beat(clients, conn, "C1", producers=["P1", "P2", "P3"])
    now[0] = 100_000
    _beat(clients, conn, "C1")                          # its consumer only
    now[0] = 200_000
    clients.expire(120_000)
    assert told == [(conn, frozenset({"P1", "P2", "P3"}))]
