"""ConnectionGate: what one remote address may hold, and that a connection whose peer went away without a word
(its host down, a NAT or firewall that dropped the flow: no FIN, no RST) gives its room back."""
from __future__ import annotations

import logging

import pytest

from broker.limits import ConnectionGate


class _Conn:
    def __init__(self, port: int, host: str = "10.0.0.1"):
        self.peer = (host, port)
        self.quiet_ticks = 0
        self.reading_paused = False
        self.handling = False
        self.aborted = False
        self.writing_paused = False     # the peer left more than the high-water mark unread
        self.unread = 0                 # what unread_bytes() says
        self.quiet_unsent = 0
        self.budget = None
        self.unfinished_bytes = 0       # of a request frame not yet whole
        self.frame_ticks = 0
        self.on_refuse = None

    def unread_bytes(self):
        return self.unread

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


def test_a_connection_we_stopped_reading_or_still_answer_is_not_quiet():
    gate = ConnectionGate(10, 2, logging.getLogger("test"), "broker listener")
    paused, waiting = _Conn(1), _Conn(2)
    paused.reading_paused = True                # its peer may be sending: the broker is not reading it
    waiting.handling = True                     # its peer waits for an answer (a long request, a parked pull)
    gate.admit(paused)
    gate.admit(waiting)
    for _ in range(10):
        assert gate.close_quiet(3) == 0
    assert not paused.aborted and not waiting.aborted


class _Transport:
    def __init__(self, port: int):
        self.port = port
        self.aborted = False

    def get_extra_info(self, name):
        return {"peername": ("10.0.0.1", self.port), "sockname": ("10.0.0.9", 10911)}.get(name)

    def set_write_buffer_limits(self, high):
        pass

    def abort(self):
        self.aborted = True

    def is_closing(self):
        return self.aborted


async def test_a_connection_refused_on_accept_costs_no_walk_of_the_client_tables(tmp_path):
    """A connection closed on accept (past max_connections_per_host) was never let in, so it is in no group; its
    close still walked every producer and consumer group (9 ms with 20,000 groups), so one client retrying
    connections past its cap, the cheapest thing it can do, kept the event loop busy for everyone."""
    from types import SimpleNamespace

    from broker.config import BrokerConfig
    from broker.server import BrokerServer

    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), max_connections_per_host=1))
    walks = []
    server.ctx = SimpleNamespace(holds=None, tx=None,
                                 clients=SimpleNamespace(connection_closed=lambda c: walks.append(c) or []))
    admitted, refused = server._connection("broker", {}), server._connection("broker", {})
    admitted.connection_made(_Transport(1))
    refused.connection_made(_Transport(2))
    assert refused.transport.aborted and not admitted.transport.aborted
    refused.connection_lost(None)
    assert walks == []
    admitted.connection_lost(None)
    assert walks == [admitted]


async def test_the_name_server_walks_no_route_table_for_a_connection_refused_on_accept():
    from broker.namesrv.config import NamesrvConfig
    from broker.namesrv.server import NameServer

    ns = NameServer(NamesrvConfig(max_connections_per_host=1))
    walks = []
    ns.ctx.table.connection_closed = lambda c: walks.append(c) or []
    admitted, refused = ns._connection(), ns._connection()
    admitted.connection_made(_Transport(1))
    refused.connection_made(_Transport(2))
    refused.connection_lost(None)
    assert walks == []
    admitted.connection_lost(None)
    assert walks == [admitted]


async def test_one_close_step_raising_does_not_skip_the_others(tmp_path):
    """A close runs the parked pulls', the transactions' and the client tables' steps: one raising skipped those
    after it (a dead connection left in its groups, holding its per-host cap and rebalance share), and the
    exception went into the event loop's connection_lost."""
    from types import SimpleNamespace

    from broker.config import BrokerConfig
    from broker.server import BrokerServer

    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path)))
    ran = []

    def boom(conn):
        ran.append("holds")
        raise RuntimeError("a bug in one step")

    def tx_closed(conn):
        ran.append("tx")
        raise RuntimeError("another")

    server.ctx = SimpleNamespace(holds=SimpleNamespace(connection_closed=boom),
                                 tx=SimpleNamespace(connection_closed=tx_closed),
                                 clients=SimpleNamespace(connection_closed=lambda c: ran.append("clients") or []))
    conn = server._connection("broker", {})
    conn.connection_made(_Transport(1))
    conn.connection_lost(None)
    assert ran == ["holds", "tx", "clients"]


def test_the_client_key_of_an_ipv6_peer_is_its_64():
    """Every per-host cap is counted under client_key: an IPv6 client holds a /64 (RFC 6177) and can pick a
    source address per connection from it, so keyed by address it got round every cap."""
    from broker.limits import client_key

    assert client_key("10.1.2.3") == "10.1.2.3"
    assert client_key("::ffff:10.1.2.3") == "10.1.2.3"           # a dual-stack listener's IPv4 peer
    assert client_key("::1") == "::1"
    assert client_key("2001:db8:1:2:aaaa::5") == client_key("2001:DB8:1:2::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::5") == "2001:db8:1:3::/64"
    # link-local addresses share one /64 (fe80::) on every link: each host is its own client
    assert client_key("fe80::1%eth0") != client_key("fe80::2%eth0")
    assert client_key("") == "" and client_key("not-an-address") == "not-an-address"


def test_addresses_from_one_ipv6_64_share_one_hosts_connections():
    gate = ConnectionGate(100, 2, logging.getLogger("test"), "broker listener")
    first = [_Conn(1, "2001:db8:1:2::1"), _Conn(2, "2001:db8:1:2::2")]
    assert [gate.admit(c) for c in first] == [None, None]
    assert gate.admit(_Conn(3, "2001:db8:1:2:ffff::3")) == "max_connections_per_host"
    assert gate.admit(_Conn(4, "2001:db8:1:3::1")) is None          # the next /64: another client
    gate.release(first[0])
    assert gate.admit(_Conn(5, "2001:db8:1:2::5")) is None


def test_the_ipv6_prefix_a_client_is_counted_by_is_the_operators(tmp_path):
    """Keyed by their /64 only, the IPv6 hosts of one data-centre or cloud subnet (an AWS VPC subnet is one /64:
    every instance and EKS pod in it) shared one host's room in every per-host cap -- 2000 connections for the
    whole subnet, 64 broker addresses at a name server for every broker on the LAN -- with no way to say
    otherwise. ipv6_client_prefix (broker and name server) sets the prefix; 128 counts each address."""
    from broker.config import BrokerConfig
    from protocol.errors import ConfigError
    from broker.limits import client_key
    from broker.namesrv.config import NamesrvConfig
    from broker.namesrv.server import NameServer
    from broker.server import BrokerServer

    try:
        BrokerServer(BrokerConfig(store_dir=str(tmp_path / "store"), ipv6_client_prefix=128))
        assert client_key("2001:db8:1:2::1") == "2001:db8:1:2::1" != client_key("2001:db8:1:2::2")
        gate = ConnectionGate(100, 1, logging.getLogger("test"), "broker listener")
        assert [gate.admit(_Conn(i, f"2001:db8:1:2::{i}")) for i in (1, 2)] == [None, None]
        NameServer(NamesrvConfig(kv_config_path=str(tmp_path / "kv.json"), ipv6_client_prefix=56))
        assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:ff::1") == "2001:db8:1::/56"
        assert client_key("::1") == "::1" and client_key("::ffff:10.0.0.1") == "10.0.0.1"
        for bad in (0, 129):
            with pytest.raises(ConfigError):
                BrokerConfig(ipv6_client_prefix=bad)
            with pytest.raises(ConfigError):
                NamesrvConfig(ipv6_client_prefix=bad)
    finally:
        BrokerServer(BrokerConfig(store_dir=str(tmp_path / "store")))       # the default again: a /64
    assert client_key("2001:db8:1:2::1") == "2001:db8:1:2::/64"


def test_ipv4_clients_seen_through_a_nat64_translator_are_each_their_own():
    """An IPv6-only broker behind a stateless translator (SIIT-DC, RFC 7755) sees each IPv4 client as
    64:ff9b::<its IPv4 address> (RFC 6052). Keyed by /64, every IPv4 client on the internet was one client:
    2000 connections, 512 topics, 100,000 offsets for all of them together. Each is keyed as its IPv4 address."""
    from broker.limits import client_key

    assert client_key("64:ff9b::10.0.0.1") == client_key("10.0.0.1") == "10.0.0.1"
    assert client_key("64:ff9b::10.0.0.2") == "10.0.0.2"
    gate = ConnectionGate(100, 1, logging.getLogger("test"), "broker listener")
    assert [gate.admit(_Conn(i, f"64:ff9b::10.0.0.{i}")) for i in (1, 2)] == [None, None]
    assert gate.admit(_Conn(3, "64:ff9b::10.0.0.1")) == "max_connections_per_host"


def test_gates_sharing_descriptors_refuse_past_their_total_together_and_admit_again_on_release():
    """The broker's listeners each had their own max_connections (10,000), far past an open-files limit of 256:
    idle connections took every descriptor the store needed. Held together, past the total one more is refused
    (reason "open-files") whichever listener it comes to, and a release gives its room to any of them."""
    log = logging.getLogger("test")
    broker, namesrv = ConnectionGate(100, 100, log, "broker"), ConnectionGate(100, 100, log, "namesrv")
    ConnectionGate.share_descriptors([broker, namesrv], 3)
    first = _Conn(1)
    assert [broker.admit(first), broker.admit(_Conn(2)), namesrv.admit(_Conn(3))] == [None, None, None]
    assert broker.admit(_Conn(4)) == "open-files"
    assert namesrv.admit(_Conn(5)) == "open-files"
    broker.release(first)
    assert namesrv.admit(_Conn(6)) is None


def test_a_peer_that_reads_none_of_its_responses_is_closed_after_the_expiry_and_one_reading_slowly_is_kept():
    """A peer that stopped reading paused the broker's reading of it, and a connection paused was never quiet: a
    frozen client kept its connection, and its unread responses, for good. Now only one whose peer takes some of
    them each turn is kept."""
    gate = ConnectionGate(10, 10, logging.getLogger("test"), "broker listener")
    frozen, slow = _Conn(1), _Conn(2)
    for conn in (frozen, slow):
        conn.reading_paused = conn.writing_paused = True
        conn.unread = 6_000_000
        assert gate.admit(conn) is None
    for _ in range(3):
        slow.unread -= 4096
        assert gate.close_quiet(3) == 0
    slow.unread -= 4096
    assert gate.close_quiet(3) == 1
    assert frozen.aborted and not slow.aborted


def test_a_flood_on_one_listener_sharing_descriptors_leaves_the_others_their_own_share():
    """The name-server port is unauthenticated: idle connections to it took the whole shared total and the broker
    and HA listeners refused everyone. Each keeps max_together // (2 * gates) that the others cannot take."""
    log = logging.getLogger("test")
    broker, namesrv, ha = (ConnectionGate(100, 100, log, name) for name in ("broker", "namesrv", "ha"))
    ConnectionGate.share_descriptors([broker, namesrv, ha], 30)
    flood = [namesrv.admit(_Conn(i)) for i in range(40)]
    assert flood.count(None) == 30 - 2 * 5 and flood[-1] == "open-files"
    assert [broker.admit(_Conn(100 + i)) for i in range(6)] == [None] * 5 + ["open-files"]
    assert [ha.admit(_Conn(200 + i)) for i in range(6)] == [None] * 5 + ["open-files"]


def test_close_quiet_asks_the_kernel_nothing_about_connections_whose_peer_keeps_up():
    """unread_bytes() is an ioctl (TIOCOUTQ), ~10 us here: asked of every connection with a request in hand (each
    consumer's parked pulls), 10,000 consumers stalled the loop ~100 ms every housekeeping turn, for nothing: only
    a connection whose peer left more than the high-water mark unread (writing paused) can be one that reads none."""
    gate = ConnectionGate(100, 100, logging.getLogger("test"), "broker listener")
    asked = []
    conns = [_Conn(i) for i in range(50)]
    for conn in conns:
        conn.handling = True
        conn.unread_bytes = lambda conn=conn: asked.append(conn) or 0
        assert gate.admit(conn) is None
    for _ in range(5):
        assert gate.close_quiet(3) == 0
    assert asked == []


def test_a_refusal_past_max_connections_names_who_holds_them_and_what_to_do(caplog):
    """Past a limit of every address together the line named the holders, but not what to do about them: every
    new client (producers, consumers) is refused until some close."""
    gate = ConnectionGate(5, 4, logging.getLogger("test.gate"), "broker listener")
    for i in range(3):
        assert gate.admit(_Conn(i, "10.0.0.7")) is None
    for i in range(2):
        assert gate.admit(_Conn(i, "10.0.0.8")) is None
    with caplog.at_level(logging.WARNING, logger="test.gate"):
        assert gate.admit(_Conn(9, "10.0.0.9")) == "max_connections"
    [first] = [r.getMessage() for r in caplog.records]
    assert "the addresses holding the most: 10.0.0.7 (3), 10.0.0.8 (2)" in first, first
    assert "--max-connections" in first and "ulimit -n" not in first, first
    # a client's own cap names no one else, and is that client's to hear
    gate = ConnectionGate(50, 2, logging.getLogger("test.gate"), "broker listener")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="test.gate"):
        for i in range(3):
            gate.admit(_Conn(i))
    [line] = [r.getMessage() for r in caplog.records]
    assert "holding the most" not in line and "--max-connections" not in line, line


def test_a_frame_unfinished_for_the_expiry_is_closed_but_not_while_the_broker_itself_stops_reading(caplog):
    """A byte now and then kept a connection from being quiet, so a frame trickled in was held for good. A frame
    unfinished for the expiry is closed (counted, said once); while the broker paused reading the connection (its
    requests in progress past max_in_flight) the frame is not the peer's to finish, and its clock starts again."""
    gate = ConnectionGate(10, 5, logging.getLogger("test"), "broker listener")
    trickler, paused, whole = _Conn(1), _Conn(2), _Conn(3)
    refused = []
    for conn in (trickler, paused, whole):
        assert gate.admit(conn) is None
        conn.on_refuse = refused.append
    trickler.unfinished_bytes = paused.unfinished_bytes = 7
    paused.reading_paused = paused.handling = True
    for _ in range(3):
        trickler.quiet_ticks = paused.quiet_ticks = whole.quiet_ticks = 0   # a byte came in each sweep
        with caplog.at_level(logging.WARNING):
            gate.close_quiet(2)
    assert (trickler.aborted, paused.aborted, whole.aborted) == (True, False, False)
    assert refused == ["unfinished-frame"] and paused.frame_ticks == 0
    said = [r.getMessage() for r in caplog.records if "stayed unfinished" in r.getMessage()]
    assert len(said) == 1 and "10.0.0.1:1" in said[0], said


def test_a_peer_gone_quiet_in_the_middle_of_a_frame_is_closed_as_quiet_not_as_a_trickled_frame(caplog):
    """A peer that vanished part-way through a frame (its host down, the link cut during a large send) sent nothing
    for the expiry: it was counted as txmq_requests_refused_total{reason="unfinished-frame"} and said at WARNING
    as bytes "coming a few at a time", an alert for a hostile client where there was none. It is closed as any
    quiet connection; a frame whose bytes kept trickling in is still closed as unfinished."""
    gate = ConnectionGate(10, 5, logging.getLogger("test"), "broker listener")
    gone, trickler = _Conn(1), _Conn(2)
    refused = []
    for conn in (gone, trickler):
        assert gate.admit(conn) is None
        conn.on_refuse = refused.append
        conn.unfinished_bytes = 7
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            trickler.quiet_ticks = 0                    # a byte came in each sweep; none from the gone one
            gate.close_quiet(2)
    assert (gone.aborted, trickler.aborted) == (True, True)
    assert refused == ["unfinished-frame"]
    said = [r.getMessage() for r in caplog.records if "stayed unfinished" in r.getMessage()]
    assert len(said) == 1 and "10.0.0.1:2" in said[0], said


def test_a_zero_expiry_is_refused_at_start_naming_the_setting():
    """--channel-expire-ms 0 (RocketMQ's serverChannelMaxIdleTimeSeconds=0 turns its idle close off) was taken: the
    sweep's interval came to 0 s and its count of sweeps divided 0 by 0: the housekeeping task (quiet and
    unfinished-frame closes, client expiry) crashed as it began, again at each restart, until its supervisor
    stopped the broker. Refused at start now, as a name server's 0."""
    from broker.config import BrokerConfig
    from broker.namesrv.config import NamesrvConfig
    from protocol.errors import ConfigError
    for make, name in ((BrokerConfig, "channel_expire_ms"), (NamesrvConfig, "broker_expire_ms"),
                       (NamesrvConfig, "scan_interval_ms")):
        with pytest.raises(ConfigError, match=name):
            make(**{name: 0})
