"""Clients follow route changes: on a routing error (the broker cannot be reached) the next attempt asks
the name server again, and the producer refreshes cached routes in the background. A stand-in name
server moves broker "b" from a dead address to a live one."""
from __future__ import annotations

import asyncio
import socket

import pytest

from consumer import PullConsumer
from producer import Producer
from protocol.codes import RequestCode, ResponseCode
from protocol.connection import DEFERRED, RemotingConnection
from protocol.errors import ClientClosedError, ConnectionClosedError
from protocol.message import encode_record, offset_msg_id, pack_host
from protocol.route import BrokerData, QueueData, TopicRouteData, encode_route
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


def _dead_addr() -> str:
    with socket.socket() as s:            # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Cluster:
    """Name server and the live broker in one handler; ``broker_addr`` is what the route says."""

    def __init__(self):
        self.broker_addr = _dead_addr()
        self.broker_name = "b"
        self.live_addr = ""
        self.route_requests = 0
        self.sends = 0
        self.silent = False

    def handle(self, conn, cmd):
        if cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
            self.route_requests += 1
            route = TopicRouteData([QueueData(self.broker_name, 1, 1, 6)],
                                   [BrokerData("c", self.broker_name, {0: self.broker_addr})])
            return cmd.response(ResponseCode.SUCCESS, body=encode_route(route, strict=True))
        if cmd.code in (RequestCode.HEART_BEAT, RequestCode.UNREGISTER_CLIENT):
            return cmd.response(ResponseCode.SUCCESS)
        if cmd.code == RequestCode.SEND_MESSAGE_V2:
            self.sends += 1
            if self.silent:
                return DEFERRED         # taken, never answered: a broker stuck on its disk
            return cmd.response(ResponseCode.SUCCESS, None, {
                "msgId": offset_msg_id(pack_host("127.0.0.1", 1), 100), "queueId": 0, "queueOffset": self.sends - 1})
        if cmd.code == RequestCode.PULL_MESSAGE:
            body = encode_record(topic=b"T", body=b"hello", queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                                 born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                                 properties=b"")
            return cmd.response(ResponseCode.SUCCESS, None, {"nextBeginOffset": 1, "minOffset": 0, "maxOffset": 1},
                                body=body)
        return cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED)


@pytest.fixture
async def cluster():
    c = Cluster()
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(c.handle), "127.0.0.1", 0)
    c.live_addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield c
    server.close()


async def test_a_send_that_cannot_reach_its_broker_refreshes_the_route_and_succeeds(cluster):
    async with asyncio.timeout(10):
        async with Producer(cluster.live_addr, "PG", send_timeout=1.0, retries=2) as producer:
            await producer.routes.route("T")                  # cached: broker b at a dead address
            cluster.broker_addr = cluster.live_addr           # the name server now says where b went
            result = await producer.send("T", b"x")
    assert result.queue.broker_name == "b" and cluster.sends == 1


async def test_the_producer_refreshes_cached_routes_in_the_background(cluster):
    async with asyncio.timeout(10):
        async with Producer(cluster.live_addr, "PG", route_refresh_interval_s=0.05) as producer:
            await producer.routes.route("T")
            assert producer.routes.broker_addr("b") != cluster.live_addr
            cluster.broker_addr = cluster.live_addr
            while producer.routes.broker_addr("b") != cluster.live_addr:
                await asyncio.sleep(0.02)
            assert cluster.sends == 0                         # learned without a send failing first


async def test_pull_resolves_routes_itself_and_refetches_after_a_routing_error(cluster):
    async with asyncio.timeout(10):
        async with PullConsumer(cluster.live_addr, "CG", timeout=1.0) as consumer:
            mq = (await consumer.fetch_queues("T"))[0]
            with pytest.raises(ConnectionClosedError):
                await consumer.pull(mq, 0)                    # route says: a dead address
            cluster.broker_addr = cluster.live_addr
            before = cluster.route_requests
            res = await consumer.pull(mq, 0)                  # no fetch_queues by hand: it asks again itself
            assert [m.body for m in res.messages] == [b"hello"] and cluster.route_requests == before + 1
            fresh = PullConsumer(cluster.live_addr, "CG2", timeout=1.0)
            try:                                              # a queue from elsewhere: its route is fetched on use
                assert [m.body for m in (await fresh.pull(mq, 0)).messages] == [b"hello"]
            finally:
                await fresh.shutdown()


async def test_a_oneway_commit_that_cannot_reach_its_broker_refetches_the_route_as_an_answered_one(cluster):
    """A push consumer's commit rounds go oneway (as a Java consumer's persistAll). An answered commit that could not
    reach its broker (a master killed) had the next call fetch the route again, which names the slave while the
    master is gone; the oneway one went on to the dead address, commit after commit, until a pull or the route's
    age happened to refetch it: a round's offsets lost, the slave's copy (what a consumer failing over starts from)
    as old as the master's last sync."""
    committed = []
    handle = cluster.handle

    def recording(conn, cmd):
        if cmd.code == RequestCode.UPDATE_CONSUMER_OFFSET:
            committed.append(int(cmd.ext_fields["commitOffset"]))
            return None
        return handle(conn, cmd)
    cluster.handle = recording
    async with asyncio.timeout(10):
        async with PullConsumer(cluster.live_addr, "CG", timeout=1.0) as consumer:
            mq = (await consumer.fetch_queues("T"))[0]
            with pytest.raises(ConnectionClosedError):
                await consumer.commit_offset(mq, 5, oneway=True)     # route says: a dead address
            cluster.broker_addr = cluster.live_addr                    # the name server names where it went
            await consumer.commit_offset(mq, 6, oneway=True)
            while not committed:
                await asyncio.sleep(0.01)
    assert committed == [6]


async def test_a_route_the_name_server_forgets_for_a_moment_keeps_the_heartbeat_going(cluster):
    """A name server answers TOPIC_NOT_EXIST while the topic's broker is away (it unregistered on a clean
    stop, or the name server restarted and brokers have not registered again yet). The background refresh
    must keep the route it had, as the Java client does: dropped, the producer knows no broker, heartbeats
    stop, and the broker forgets the producer after its channel expiry -- a transaction producer is then
    never asked about its undecided transactions. Nothing is logged above INFO and nothing fails."""
    forgets = False
    handle = cluster.handle
    heartbeats = []

    def flaky(conn, cmd):
        if cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC and forgets:
            return cmd.response(ResponseCode.TOPIC_NOT_EXIST, "No topic route info in name server")
        if cmd.code == RequestCode.HEART_BEAT:
            heartbeats.append(cmd)
        return handle(conn, cmd)

    cluster.handle = flaky
    cluster.broker_addr = cluster.live_addr
    async with asyncio.timeout(10):
        async with Producer(cluster.live_addr, "PG", route_refresh_interval_s=3600) as producer:
            await producer.send("T", b"x")
            forgets = True
            await producer.routes.refresh_all()               # the broker is away: the name server forgot it
            forgets = False                                   # back
            del heartbeats[:]
            await producer.heartbeat()
            assert len(heartbeats) == 1                       # the producer still announces itself
            assert producer.routes.broker_addr("b") == cluster.live_addr


async def test_shutdown_flushes_sends_gathered_while_it_waits_for_a_batch_in_flight(cluster):
    """shutdown() flushes the accumulator: it ships what is gathered and waits for the batches in flight. A
    send gathered meanwhile started a new batch, left to its linger timer; shutdown returned with it still
    queued, closed the pool, and the send failed later (before the pool stayed closed: it was sent after
    the shutdown, on a connection nobody closed). A send begun once shutdown has is refused now
    (ClientClosedError): nothing is gathered while the flush waits, and what was gathered before is sent."""
    release = asyncio.Event()
    arrived = asyncio.Event()
    batches = []
    handle = cluster.handle

    async def answer_later(cmd):
        arrived.set()
        await release.wait()
        batches.append(cmd)
        return cmd.response(ResponseCode.SUCCESS, None, {"msgId": ",".join(["0" * 32] * 2), "queueId": 0,
                                                          "queueOffset": len(batches)})

    def held(conn, cmd):
        if cmd.code == RequestCode.SEND_BATCH_MESSAGE:
            return answer_later(cmd)
        return handle(conn, cmd)

    cluster.handle = held
    cluster.broker_addr = cluster.live_addr
    async with asyncio.timeout(10):
        producer = await Producer(cluster.live_addr, "PG", batch_size=2, linger_ms=3000).start()
        await producer.routes.route("T")
        first = [asyncio.ensure_future(producer.send("T", body)) for body in (b"a", b"b")]   # a full batch
        await arrived.wait()
        stopping = asyncio.ensure_future(producer.shutdown())
        await asyncio.sleep(0)                                 # flushing: waiting for the batch in flight
        # Begun once shutdown has: refused, nothing gathered (ClientClosedError), where it was gathered and sent
        # before -- an application still sending then kept shutdown flushing for good.
        with pytest.raises(ClientClosedError):
            await producer.send("T", b"c")
        assert not producer._accumulator._pending
        release.set()
        await stopping
        assert all(f.result() for f in first) and len(batches) == 1


async def test_sends_skip_a_broker_whose_route_names_no_master(cluster):
    """Broker "b"'s master is gone and its slave still registered: the route keeps b's queues, with only
    the slave's address (brokerId 1). A slave takes no sends, so the Java client publishes to no queue of a
    broker without a master. Ours kept b's queues and sent to the master address an older route had given
    -- a dead one -- so a send landing there failed or, with retries, cost a failed connect (a connect
    timeout on a host that is down) before going elsewhere."""
    routes = []
    handle = cluster.handle

    def two_brokers(conn, cmd):
        if cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
            routes.append(cmd)
            b_addrs = {0: _dead_addr()} if len(routes) == 1 else {1: _dead_addr()}   # then: master gone
            route = TopicRouteData([QueueData("a", 2, 2, 6), QueueData("b", 2, 2, 6)],
                                   [BrokerData("c", "a", {0: cluster.live_addr}), BrokerData("c", "b", b_addrs)])
            return cmd.response(ResponseCode.SUCCESS, body=encode_route(route, strict=True))
        return handle(conn, cmd)

    cluster.handle = two_brokers
    async with asyncio.timeout(10):
        async with Producer(cluster.live_addr, "PG", retries=0) as producer:
            await producer.routes.route("T")                  # b had a master then
            await producer.routes.refresh_all()               # now only its slave
            results = [await producer.send("T", b"x") for _ in range(8)]
    assert {r.queue.broker_name for r in results} == {"a"} and cluster.sends == 8


async def test_route_fetches_start_at_the_name_server_that_answered_last():
    """A first name server that is down (its host gone: each connect ends at the connect timeout) was asked
    first on every route fetch, so each cost a connect timeout before the second name server answered."""
    from producer.routes import RouteCache
    from protocol.errors import RequestTimeoutError
    route = encode_route(TopicRouteData([QueueData("b", 1, 1, 6)], [BrokerData("c", "b", {0: "127.0.0.1:9"})]),
                         strict=True)
    asked = []

    class Pool:
        async def request(self, addr, cmd, timeout):
            asked.append(addr)
            if addr == "10.255.0.1:9876":
                raise RequestTimeoutError("connecting to 10.255.0.1:9876 timed out after 3 s")
            return cmd.response(ResponseCode.SUCCESS, body=route)

        async def close(self):
            pass
    routes = RouteCache(Pool(), ["10.255.0.1:9876", "127.0.0.1:9876"])
    consumer = PullConsumer("10.255.0.1:9876;127.0.0.1:9876", "G")
    consumer.pool = Pool()
    for servers in (routes.namesrv_addrs, consumer.namesrv_addrs):     # each starts at one picked at random
        servers.answered("10.255.0.1:9876")                            # here: at the one that is down
    try:
        for _ in range(3):
            await routes.fetch("T")
        assert asked == ["10.255.0.1:9876", "127.0.0.1:9876", "127.0.0.1:9876", "127.0.0.1:9876"]
        asked.clear()
        for _ in range(3):
            await consumer.fetch_queues("T")
        assert asked == ["10.255.0.1:9876", "127.0.0.1:9876", "127.0.0.1:9876", "127.0.0.1:9876"]
    finally:
        await consumer.shutdown()


async def test_send_timeout_bounds_the_whole_send_retries_included(cluster):
    """A broker that takes sends and never answers: each attempt waited a whole send_timeout, so a send with
    retries=2 took three of them (9 s with the default 3 s) although send_timeout is the send's."""
    from protocol.errors import RequestTimeoutError
    cluster.broker_addr = cluster.live_addr
    cluster.silent = True
    async with asyncio.timeout(10):
        async with Producer(cluster.live_addr, "PG_deadline", send_timeout=0.3, retries=2) as producer:
            with pytest.raises(RequestTimeoutError, match=r"timed out after 0.3 s and 1 attempt"):
                await producer.send("T", b"x")
    assert cluster.sends == 1


async def test_a_walk_over_the_name_servers_asks_each_once_whatever_another_lookup_learns():
    """Concurrent route lookups: one learning that B answered moved another's walk along, which then skipped B."""
    from protocol.route import NameServers
    servers = NameServers(["A:1", "B:1", "C:1"], first=0)
    walk = iter(servers)
    assert next(walk) == "A:1"
    servers.answered("B:1")
    assert list(walk) == ["B:1", "C:1"]
    assert list(servers) == ["B:1", "C:1", "A:1"]


async def test_a_heartbeat_the_broker_refuses_is_a_failed_one(cluster, caplog):
    """A broker may refuse a heartbeat (SYSTEM_BUSY past max_groups_per_host: the group is not joined). The
    producer took any answer for success: heartbeat() said True, nothing was logged and no beat came sooner,
    so a transaction producer left out of its group was never told why it was not checked."""
    def busy(conn, cmd):
        if cmd.code == RequestCode.HEART_BEAT:
            return cmd.response(ResponseCode.SYSTEM_BUSY, "3 groups not joined: ... (max_groups_per_host)")
        return Cluster.handle(cluster, conn, cmd)

    cluster.handle = busy
    cluster.broker_addr = cluster.live_addr
    async with asyncio.timeout(10):
        async with Producer(cluster.live_addr, "PG", route_refresh_interval_s=3600) as producer:
            await producer.routes.route("T")
            assert await producer.heartbeat() is False
    assert "max_groups_per_host" in caplog.text


async def test_clients_start_at_a_name_server_picked_at_random():
    """Every client started its walk at the first name server: that one alone carried a cluster's lookups
    while the others idled. RocketMQ's client starts at a random one."""
    from protocol.route import NameServers
    addrs = ["A:1", "B:1", "C:1"]
    firsts = {next(iter(NameServers(addrs))) for _ in range(100)}   # all three: 1 - 3 * (2/3)**100 certain
    assert firsts == set(addrs)
    assert sorted(NameServers(addrs)) == addrs and list(NameServers([])) == []


async def test_a_name_server_that_fails_is_said_once_a_minute_and_when_it_is_back(caplog):
    """Neither client said a name server failed (the consumer not at all, the producer per topic and route);
    one down for an hour must be said, and not once per lookup."""
    import logging
    from protocol.route import NameServers
    now = [1000.0]
    caplog.set_level(logging.INFO, logger="txmq.namesrv_client")
    servers = NameServers(["A:1", "B:1"], first=0)
    servers.clock = lambda: now[0]
    for _ in range(5):
        servers.failed("A:1", TimeoutError("no answer in 3 s"))
    now[0] += NameServers.LOG_EVERY_S
    servers.failed("A:1", TimeoutError("no answer in 3 s"))
    servers.answered("A:1")
    servers.answered("A:1")
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "WARNING", "INFO"], said
    assert "A:1 did not answer: no answer in 3 s; asking the next one" in said[0][1]
    assert said[2][1] == "name server A:1 answers again"


async def test_a_broker_no_route_names_any_more_is_heartbeaten_no_more(cluster):
    """A consumer kept every broker it ever heard of: one retired (or renamed) was sent each heartbeat, every
    rebalance, for good, each failing (a connect timeout each with its host gone), and the heartbeat as a
    whole raised. As RocketMQ's cleanOfflineBroker, a broker that no route names is forgotten."""
    async with asyncio.timeout(10):
        async with PullConsumer(cluster.live_addr, "CG", timeout=1.0) as consumer:
            await consumer.fetch_queues("T")                  # broker b, at a dead address
            with pytest.raises(ConnectionClosedError):
                await consumer.heartbeat()
            cluster.broker_name, cluster.broker_addr = "b2", cluster.live_addr     # b retired, b2 serves T
            await consumer.fetch_queues("T")
            await consumer.heartbeat()                        # b is not asked any more


@bounded(20)
async def test_a_heartbeat_refused_by_one_broker_raises_the_refusal_whatever_another_met():
    """A push consumer's start passes over a broker out of reach (a timeout, a closed connection) and raises a
    refusal (wrong credentials, a group limit): the heartbeat must raise the refusal whichever broker it asked
    first, not the timeout it happened to meet before."""
    from protocol.errors import NoPermissionError, RequestTimeoutError

    class Pool:
        async def request(self, addr, cmd, timeout):
            if addr == "hung:1":
                raise RequestTimeoutError("HEART_BEAT to hung:1 timed out")
            return cmd.response(ResponseCode.NO_PERMISSION, "Check signature failed for accessKey=appuser")

        async def close(self):
            pass
    for order in (["hung", "refusing"], ["refusing", "hung"]):
        consumer = PullConsumer("127.0.0.1:9876", "G")
        consumer.pool = Pool()
        consumer._brokers = {name: f"{name}:1" for name in order}
        with pytest.raises(NoPermissionError):
            await consumer.heartbeat()


@bounded(20)
async def test_a_name_server_that_flaps_is_said_twice_a_minute_at_most(caplog):
    """An answer reset the minute: a name server failing every other request (overloaded, dropping half) was
    said failed and back on every flap, two lines per request and topic."""
    import logging
    from protocol.route import NameServers
    now = [1000.0]
    caplog.set_level(logging.INFO, logger="txmq.namesrv_client")
    servers = NameServers(["A:1", "B:1"], first=0)
    servers.clock = lambda: now[0]
    for _ in range(50):
        servers.failed("A:1", TimeoutError("no answer in 3 s"))
        servers.answered("A:1")
        now[0] += 1.0
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    now[0] += NameServers.LOG_EVERY_S
    servers.failed("A:1", TimeoutError("no answer in 3 s"))
    servers.answered("A:1")
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO", "WARNING", "INFO"]


@bounded(20)
async def test_a_name_server_down_is_said_once_not_once_a_topic(caplog):
    """The name server that does not answer is said once a minute (txmq.namesrv_client); the producer said it
    again at WARNING for every cached topic at every refresh: a thousand topics, a thousand lines a period."""
    import logging
    from producer.routes import RouteCache
    from protocol.errors import RequestTimeoutError
    route = encode_route(TopicRouteData([QueueData("b", 1, 1, 6)], [BrokerData("c", "b", {0: "127.0.0.1:9"})]),
                         strict=True)
    down = [False]

    class Pool:
        closed = False

        async def request(self, addr, cmd, timeout):
            if down[0]:
                raise RequestTimeoutError(f"GET_ROUTEINFO_BY_TOPIC to {addr} got no response in 3 s")
            return cmd.response(ResponseCode.SUCCESS, body=route)
    routes = RouteCache(Pool(), ["127.0.0.1:9876"])
    for n in range(20):
        await routes.route(f"T{n}")
    down[0] = True
    caplog.set_level(logging.INFO)
    for _ in range(3):
        await routes.refresh_all()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "127.0.0.1:9876 did not answer" in warned[0], warned
    assert all(routes._routes[f"T{n}"] for n in range(20))             # each route known still serves


@bounded(20)
async def test_a_route_refresh_the_name_server_answers_wrongly_is_said(caplog):
    """A pull consumer's background route fetch that failed other than by a name server out of reach (said by
    txmq.namesrv_client) was dropped without a word, the route known serving on: here a body that does not
    decode."""
    import logging
    route = encode_route(TopicRouteData([QueueData("b", 1, 1, 6)], [BrokerData("c", "b", {0: "127.0.0.1:9"})]),
                         strict=True)
    bodies = [route]
    refreshed = asyncio.Event()

    class Pool:
        async def request(self, addr, cmd, timeout):
            if cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
                if len(bodies) > 1:
                    refreshed.set()
                return cmd.response(ResponseCode.SUCCESS, body=bodies[-1])
            return cmd.response(ResponseCode.SUCCESS)

        async def close(self):
            pass
    consumer = PullConsumer("127.0.0.1:9876", "G", route_ttl_s=0.0)
    consumer.pool = Pool()
    caplog.set_level(logging.INFO)
    try:
        mq = (await consumer.fetch_queues("T"))[0]
        bodies.append(b"{not a route")
        assert await consumer._broker_addr(mq) == "127.0.0.1:9"      # stale: fetched in the background
        await refreshed.wait()
        await asyncio.gather(*consumer._fetching.values(), return_exceptions=True)
    finally:
        await consumer.shutdown()
    assert any("route of T" in r.getMessage() and r.levelno >= logging.WARNING for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


@bounded(20)
async def test_a_broker_left_out_of_a_route_still_takes_its_queues_last_offsets():
    """A name server restarted lists a broker again only once that broker registers (up to a period later);
    a rebalance meanwhile drops its queues and hands them over, committing their offsets. Forgotten at once
    (no route names it), the broker was not sent those commits ("no route names broker b"): the messages
    consumed since the last commit were delivered again once it was back. It gets no heartbeat, but the calls
    for its own queues still reach it."""
    listed = [["a", "b"]]
    asked = []

    class Pool:
        async def request(self, addr, cmd, timeout):
            if cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
                names = listed[-1]
                route = TopicRouteData([QueueData(n, 1, 1, 6) for n in names],
                                       [BrokerData("c", n, {0: f"{n}.host:1"}) for n in names])
                return cmd.response(ResponseCode.SUCCESS, body=encode_route(route, strict=True))
            asked.append((cmd.code, addr))
            return cmd.response(ResponseCode.SUCCESS)

        async def close(self):
            pass
    consumer = PullConsumer("127.0.0.1:9876", "G")
    consumer.pool = Pool()
    try:
        on_b = [q for q in await consumer.fetch_queues("T") if q.broker_name == "b"][0]
        listed.append(["a"])                            # the name server, restarted, has heard from a only
        assert on_b not in await consumer.fetch_queues("T")
        await consumer.heartbeat()
        assert (RequestCode.HEART_BEAT, "b.host:1") not in asked
        await consumer.commit_offset(on_b, 7)
        assert (RequestCode.UPDATE_CONSUMER_OFFSET, "b.host:1") in asked, asked
    finally:
        await consumer.shutdown()


class _TBW102Pool:
    """A name server stand-in for RouteCache: TBW102 on brokers a and b with ``perms``; any other topic unknown."""

    closed = False

    def __init__(self):
        self.perms = {"a": 7, "b": 7}

    async def request(self, addr, cmd, timeout):
        if cmd.ext_fields["topic"] != "TBW102":
            return cmd.response(ResponseCode.TOPIC_NOT_EXIST, "No topic route info in name server")
        route = TopicRouteData([QueueData(n, 8, 8, p) for n, p in self.perms.items()],
                               [BrokerData("c", n, {0: f"127.0.0.1:{i + 1}"}) for i, n in enumerate(self.perms)])
        return cmd.response(ResponseCode.SUCCESS, body=encode_route(route, strict=True))


async def test_a_topic_on_tbw102s_route_follows_a_wiped_write_perm_at_the_next_refresh():
    """A topic no name server knows yet is sent on TBW102's route, kept under its name. The background refresh
    kept that copy as it was (the topic is still unknown), so a broker whose write permission was wiped since
    (mqadmin wipeWritePerm, or made read-only) stayed in its sends for as long as the topic was not created:
    operations.md promises producers leave it at their next route refresh."""
    from producer.routes import RouteCache
    async with asyncio.timeout(10):
        pool = _TBW102Pool()
        routes = RouteCache(pool, ["127.0.0.1:9"], ttl_s=3600)
        assert {q.broker_name for q in await routes.publish_queues("New")} == {"a", "b"}
        pool.perms["a"] = 5                 # wiped: read and inherit left
        await routes.refresh_all()          # what the background refresh does each period
        assert {q.broker_name for q in await routes.publish_queues("New")} == {"b"}
        assert {q.broker_name for q in routes.cached_publish_queues("New") or ()} == {"b"}


class _NameServers:
    """Name servers behind a fake connection pool: ``knows(addr)`` says whether the one at ``addr`` has topic T's
    route (raising: it is down); every address asked is in ``asked``."""
    ROUTE = encode_route(TopicRouteData([QueueData("b", 1, 1, 6)], [BrokerData("c", "b", {0: "127.0.0.1:9"})]),
                         strict=True)

    def __init__(self, knows=lambda addr: True):
        self.knows, self.asked = knows, []

    @classmethod
    def known_by(cls, knows):
        """A class whose instances ask ``knows`` (for tests that make their pool by calling it)."""
        return lambda: cls(knows)

    async def request(self, addr, cmd, timeout):
        self.asked.append(addr)
        return cmd.response(ResponseCode.SUCCESS, body=self.ROUTE) if self.knows(addr) else cmd.response(
            ResponseCode.TOPIC_NOT_EXIST, "No topic route info in name server for the topic: T")


@pytest.fixture
def now(monkeypatch):
    """The routes' monotonic clock, set by the test: ``now[0] = t``."""
    from producer import routes as routes_mod
    clock = [1000.0]
    monkeypatch.setattr(routes_mod.time, "monotonic", lambda: clock[0])
    return clock


async def test_a_route_is_forgotten_only_once_no_name_server_has_known_it_for_forget_after_s(now):
    """A cached route answered TOPIC_NOT_EXIST is kept (its only broker may be away, unregistered by a clean
    stop) for ``forget_after_s`` on end, then forgotten; the topic found meanwhile starts the wait afresh."""
    from producer.routes import RouteCache
    from protocol.errors import TopicNotExistError
    answers = []
    Pool = _NameServers.known_by(lambda addr: answers.pop(0))

    async def refresh(routes: RouteCache, known: bool, at: float):
        now[0], answers[:] = at, [known]
        await (routes.refresh_all() if "T" in routes._routes else routes.route("T"))

    routes = RouteCache(Pool(), ["127.0.0.1:9876"], forget_after_s=3600)
    await refresh(routes, True, 1000)
    await refresh(routes, False, 1030)                  # gone from the name server: kept, asked again each period
    await refresh(routes, False, 1030 + 3599)
    assert "T" in routes._routes and routes.forgotten == 0
    await refresh(routes, True, 1030 + 3600)            # back (its broker restarted): the wait starts again
    await refresh(routes, False, 5000)
    await refresh(routes, False, 5000 + 3599)
    assert "T" in routes._routes
    await refresh(routes, False, 5000 + 3600)
    assert "T" not in routes._routes and routes.forgotten == 1
    answers[:] = [False]
    with pytest.raises(TopicNotExistError):     # nothing cached: the next lookup asks the name server
        await routes.route("T")
    never = RouteCache(Pool(), ["127.0.0.1:9876"], forget_after_s=None)
    await refresh(never, True, 0)
    await refresh(never, False, 1)
    await refresh(never, False, 10 ** 9)
    assert "T" in never._routes                 # None: kept for good, as the Java client keeps it


async def test_a_transaction_producer_keeps_the_route_of_a_broker_away_past_forget_after_s(now):
    """A transaction producer's heartbeats are what let a broker check its undecided transactions: a broker
    away (unregistered) past ``route_forget_after_s`` had its routes forgotten, so once back it got no heartbeat
    from the group and its half messages went unchecked until it dead-lettered them (a local transaction
    committed, its message never delivered). A TransactionProducer keeps its routes unless told otherwise."""
    from producer.transaction import TransactionProducer
    answers = []
    Pool = _NameServers.known_by(lambda addr: answers.pop(0))
    for kwargs, kept in (({}, True), ({"route_forget_after_s": 60.0}, False)):
        producer = TransactionProducer("127.0.0.1:9876", "PG_tx", object(), **kwargs)
        routes = producer.routes
        routes.pool = Pool()
        now[0], answers[:] = 1000.0, [True]
        await routes.route("T")
        for at in (1030.0, 1030.0 + 86400):             # the broker away a day
            now[0], answers[:] = at, [False]
            await routes.refresh_all()
        assert ("T" in routes._routes) is kept and ("127.0.0.1:9" in routes.all_broker_addrs()) is kept
        await producer.pool.close()


async def test_a_route_one_name_server_forgot_is_kept_while_another_knows_it(now):
    """A lookup asks the name server that answered last and takes its TOPIC_NOT_EXIST as the answer. One that
    lost the topic's broker (its registrations cut off by a partition, or restarted and not yet registered to)
    made a producer stuck on it forget a live topic's route after ``route_forget_after_s``, though another name
    server knew it: its sends moved to TBW102's brokers or failed. Before forgetting, the others are asked."""
    from producer.routes import RouteCache
    knows = {"127.0.0.1:1": True, "127.0.0.1:2": True}
    pool = _NameServers(knows.__getitem__)
    asked = pool.asked
    routes = RouteCache(pool, list(knows), forget_after_s=3600)
    routes.namesrv_addrs.answered("127.0.0.1:1")       # stuck on the first
    await routes.route("T")
    knows["127.0.0.1:1"] = False                        # the first lost the broker; the second still has it
    for at in (1030.0, 1030.0 + 3600, 1030.0 + 7200):
        now[0] = at
        await routes.refresh_all()
    assert "T" in routes._routes and routes.forgotten == 0
    assert "127.0.0.1:2" in asked
    knows["127.0.0.1:2"] = False                        # known to none now
    asked.clear()
    for at in (9000.0, 9000.0 + 3600):
        now[0] = at
        await routes.refresh_all()
    assert "T" not in routes._routes and routes.forgotten == 1
    assert asked.count("127.0.0.1:2") == 1              # the others asked once, when the route is due to go


async def test_routes_due_to_go_do_not_each_wait_out_a_name_server_that_is_down(now):
    """The others asked before a route goes: one that is down cost each due route a timeout, one after the
    other in the refresh (40 deleted topics, a second name server down: 2 minutes of 3 s timeouts, every other
    route's refresh waiting). One that failed and has not answered since is not asked."""
    from producer.routes import RouteCache
    from protocol.errors import RequestTimeoutError
    known = [True]

    def knows(addr: str) -> bool:
        if addr == "127.0.0.1:2":
            raise RequestTimeoutError("down")
        return known[0]
    pool = _NameServers(knows)
    asked = pool.asked
    routes = RouteCache(pool, ["127.0.0.1:1", "127.0.0.1:2"], forget_after_s=60)
    routes.namesrv_addrs.answered("127.0.0.1:1")
    topics = [f"T{i}" for i in range(5)]
    for t in topics:
        await routes.route(t)
    known[0] = False                                    # all deleted
    for at in (1030.0, 1100.0):
        now[0] = at
        await routes.refresh_all()
    assert not set(topics) & set(routes._routes) and routes.forgotten == 5
    assert asked.count("127.0.0.1:2") == 1, asked


@bounded(10)
async def test_a_heartbeat_of_one_broker_leaves_another_still_unreached():
    """The push consumer beats one broker before a start commit there (_anchor). That beat set beat_unreached to
    its own result: a broker still down looked reached, and the rebalance loop's retries (which beat only
    beat_unreached) stopped until its next round, up to rebalance_interval_s."""
    from protocol.errors import RequestTimeoutError
    up, down = "127.0.0.1:1", "127.0.0.1:2"

    class Pool:
        async def request(self, addr, cmd, timeout):
            if addr == down:
                raise RequestTimeoutError(f"connecting to {down} timed out")
            return cmd.response(ResponseCode.SUCCESS)

        async def close(self):
            pass
    consumer = PullConsumer("127.0.0.1:9876", "G")
    consumer.pool = Pool()
    consumer._brokers.update({"a": up, "b": down})
    try:
        with pytest.raises(RequestTimeoutError):
            await consumer.heartbeat()
        assert consumer.beat_unreached == [down] and consumer.heard == {up}
        await consumer.heartbeat(only=[up])
        assert consumer.beat_unreached == [down]
    finally:
        await consumer.shutdown()
