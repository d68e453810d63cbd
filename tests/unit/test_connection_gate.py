"""ConnectionGate: what one remote address may hold, and that a connection whose peer went away without a word
(its host down, a NAT or firewall that dropped the flow: no FIN, no RST) gives its room back."""
from __future__ import annotations

import logging

from broker.limits import ConnectionGate


class _Conn:
    def __init__(self, port: int, host: str = "10.0.0.1"):
        self.peer = (host, port)
        self.quiet_ticks = 0
        self.reading_paused = False
        self.aborted = False

    def abort(self):
        self.aborted = True


def test_a_connection_quiet_for_the_expiry_is_closed_and_its_address_gets_its_room_back():
    """Nothing closed a connection whose peer vanished: it held its place, and its address's share of
    max_connections_per_host, for good. Enough of them (clients behind one NAT address across a few network
    incidents) and every new connection from that address was refused, for ever. RocketMQ's broker closes a
    channel idle for 120 s; a stock client heartbeats every 30 s on every connection, so a live one never is."""
    gate = ConnectionGate(10, 2, logging.getLogger("test"), "broker listener")
    dead, live = _Conn(1), _Conn(2)
    assert gate.admit(dead) is None and gate.admit(live) is None
    assert gate.admit(_Conn(3)) == "max_connections_per_host"
    for _ in range(3):
        assert gate.close_quiet(3) == 0
        live.quiet_ticks = 0                    # it sent something since (RemotingConnection.data_received)
    assert gate.close_quiet(3) == 1
    assert dead.aborted and not live.aborted
    gate.release(dead)                          # what its close does
    assert gate.admit(_Conn(3)) is None


def test_a_connection_we_stopped_reading_is_not_quiet():
    gate = ConnectionGate(10, 2, logging.getLogger("test"), "broker listener")
    paused = _Conn(1)
    paused.reading_paused = True                # its peer may be sending: the broker is not reading it
    gate.admit(paused)
    for _ in range(10):
        assert gate.close_quiet(3) == 0
    assert not paused.aborted
