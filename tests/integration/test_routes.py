"""Our clients under route edges, against a real name server and broker: a name server that is slow or
stuck must not cost every send or pull a round trip or a timeout. A CountingNamesrv (tests/support) stands
between the clients (and, where said, the broker's registrations) and a real stand-alone name server, counts
the route lookups and can leave requests unanswered."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket

import pytest

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from producer import Producer
from protocol.codes import RequestCode, ResponseCode
from protocol.route import NameServers
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import NamesrvProcess, cluster_flags, create_topic, request, wait_for_route
from tests.support.namesrv_proxy import CountingNamesrv

pytestmark = pytest.mark.asyncio


@pytest.fixture
def namesrv(tmp_path):
    ns = NamesrvProcess(tmp_path / "namesrv.log").start()
    yield ns
    ns.kill()


@pytest.fixture
async def proxy(namesrv):
    p = await CountingNamesrv(namesrv.addr).start()
    yield p
    await p.close()


@pytest.fixture
async def proxy_of():
    """CountingNamesrv in front of any name server (a broker's embedded one)."""
    started = []

    async def make(upstream: str) -> CountingNamesrv:
        started.append(await CountingNamesrv(upstream).start())
        return started[-1]
    yield make
    for p in started:
        await p.close()


@pytest.fixture
def broker_via(tmp_path):
    """A broker registering with ``addr`` (every second) as broker-a."""
    started = []

    def make(addr: str) -> BrokerProcess:
        b = BrokerProcess(tmp_path / "store", *cluster_flags(addr, "broker-a", 1000)).start()
        started.append(b)
        return b
    yield make
    for b in started:
        b.kill()


@bounded(40)
async def test_sends_to_a_topic_not_registered_yet_ask_the_name_server_once(proxy, broker_via):
    """A topic the broker creates on its first send is unknown to the name server until the broker's
    registration reaches it. Each send asked for its route meanwhile (a round trip each, a timeout each while
    the name server is stuck); as the Java client, the producer takes TBW102's route for it, once a period.
    The broker's registrations are held back after the first, so the window stays open however fast it is."""
    broker = broker_via(proxy.addr)
    await wait_for_route(proxy.addr, "TBW102", {"broker-a"})
    proxy.stall.add(RequestCode.REGISTER_BROKER)          # the name server learns no new topic from now
    async with Producer(proxy.addr, "PG_auto", route_refresh_interval_s=3600) as producer:
        results = [await producer.send("AutoMade", b"m%d" % i) for i in range(20)]
    assert proxy.route_requests["AutoMade"] == 1, proxy.route_requests
    assert {r.queue.broker_name for r in results} == {"broker-a"}
    assert len({r.queue.queue_id for r in results}) == 4          # defaultTopicQueueNums, round robin
    assert broker.proc.poll() is None


@bounded(30)
async def test_a_stale_route_serves_sends_while_the_name_server_is_stuck(proxy, broker_via):
    """A route past its ttl was fetched on the send path: with the name server taking requests and never
    answering, each send waited for its lookup (send_timeout each, here far beyond the test's bound). It must
    serve on while one fetch runs in the background."""
    broker = broker_via(proxy.addr)
    await wait_for_route(proxy.addr, "TBW102", {"broker-a"})
    await create_topic(broker.broker, "Stale", 2)
    await wait_for_route(proxy.addr, "Stale", {"broker-a"})
    async with Producer(proxy.addr, "PG_stale", send_timeout=60, route_refresh_interval_s=0.001) as producer:
        await producer.send("Stale", b"first")                 # the route is cached, and stale at once
        proxy.stall.add(RequestCode.GET_ROUTEINFO_BY_TOPIC)
        before = proxy.route_requests["Stale"]
        for i in range(1000):                                   # until a send finds the route stale (soon)
            await producer.send("Stale", b"a%d" % i)
            if proxy.route_requests["Stale"] > before:
                break
        for i in range(10):
            await producer.send("Stale", b"m%d" % i)
        asked = proxy.route_requests["Stale"] - before
        assert proxy.unanswered >= 1                           # a refresh was asked and is still unanswered
        producer.send_timeout = 1.0                            # shutdown settles within it
    assert asked == 1, proxy.route_requests                    # one fetch in flight at a time, not one a send


@bounded(30)
async def test_pulls_of_a_known_queue_never_wait_for_a_stuck_name_server(proxy, broker_via):
    """A pull whose route was past its ttl fetched it first and waited: a name server that takes requests and
    never answers cost each pull its whole timeout (here far beyond the test's bound), and a failed fetch left
    the route stale, so the next pull paid again. Pulls of a queue whose broker is known go on; one fetch runs."""
    broker = broker_via(proxy.addr)
    await wait_for_route(proxy.addr, "TBW102", {"broker-a"})
    await create_topic(broker.broker, "Pulled", 1)
    await wait_for_route(proxy.addr, "Pulled", {"broker-a"})
    async with Producer(proxy.addr, "PG_pulled") as producer:
        for i in range(5):
            await producer.send("Pulled", b"m%d" % i)
    consumer = PullConsumer(proxy.addr, "CG_pulled", timeout=60, route_ttl_s=0.0)   # every route stale at once
    try:
        mq = (await consumer.fetch_queues("Pulled"))[0]
        proxy.stall.add(RequestCode.GET_ROUTEINFO_BY_TOPIC)
        offset, bodies = 0, []
        for _ in range(5):
            res = await consumer.pull(mq, offset, max_nums=1)
            bodies += [m.body for m in res.messages]
            offset = res.next_begin_offset
        assert bodies == [b"m%d" % i for i in range(5)]
        assert proxy.unanswered == 1                           # the one refresh, still waiting
        assert await consumer.max_offset(mq) == 5
    finally:
        consumer.timeout = 1.0
        await consumer.shutdown()


@bounded(30)
async def test_a_blackholed_first_name_server_is_passed_and_said_once(proxy, broker_via, caplog):
    """Two name servers, the first a socket that listens and never accepts (the kernel completes the handshake,
    nobody reads): the first lookup pays one timeout there and the second answers; later lookups start at the
    second, and the dead one is logged once, not per lookup."""
    broker = broker_via(proxy.addr)
    await wait_for_route(proxy.addr, "TBW102", {"broker-a"})
    await create_topic(broker.broker, "Twice", 1)
    await wait_for_route(proxy.addr, "Twice", {"broker-a"})
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        dead = f"127.0.0.1:{hole.getsockname()[1]}"
        caplog.set_level(logging.WARNING, logger="txmq.namesrv_client")
        consumer = PullConsumer(f"{dead};{proxy.addr}", "CG_twice", timeout=0.5)
        consumer.namesrv_addrs = NameServers([dead, proxy.addr], first=0)     # not at random: the dead one first
        try:
            for _ in range(5):
                assert len(await consumer.fetch_queues("Twice")) == 1
        finally:
            await consumer.shutdown()
    said = [r for r in caplog.records if dead in r.getMessage()]
    assert len(said) == 1 and "did not answer" in said[0].getMessage(), [r.getMessage() for r in said]
    assert proxy.route_requests["Twice"] >= 5


@bounded(90)
async def test_a_consumer_joins_and_gets_its_share_while_one_broker_hangs(namesrv, tmp_path):
    """A broker that stops answering (here SIGSTOP: its sockets take requests, nothing answers) stays in the
    routes until the name server expires it (2 minutes). A push consumer's start raised on that broker's
    heartbeat, and every rebalance asked only the first broker of the topic for the group's consumers: a
    consumer joining the group then could not start at all, and had it started it got no queue, while the
    first kept every one. The group must share the queues of the broker that answers. (A new group's start
    under a stand-alone name server also raised TOPIC_NOT_EXIST for its %RETRY% topic, not created yet.)"""
    brokers = [BrokerProcess(tmp_path / name, *cluster_flags(namesrv.addr, name, 1000)).start()
               for name in ("broker-a", "broker-b")]
    consumers = []
    try:
        for b in brokers:
            await create_topic(b.broker, "Split", 2)
        await wait_for_route(namesrv.addr, "Split", {"broker-a", "broker-b"})

        def consumer() -> PushConsumer:
            c = PushConsumer(namesrv.addr, "CG_split", lambda msg: ConsumeStatus.CONSUME_SUCCESS,
                             rebalance_interval_s=0.2, suspend_ms=500)
            c.client.timeout = 1.0
            c.subscribe("Split")
            consumers.append(c)
            return c

        first = await consumer().start()
        brokers[0].proc.send_signal(signal.SIGSTOP)            # broker-a: first in the route, answers nothing
        second = await consumer().start()
        queues = set(await second.client.fetch_queues("Split"))

        def split() -> bool:        # two each (allocate averagely), together all four
            mine = {q for q in second._owned if q.topic == "Split"}
            theirs = {q for q in first._owned if q.topic == "Split"}
            return len(mine) == len(theirs) == 2 and mine | theirs == queues
        for _ in range(400):            # rebalances every 0.2 s, each waiting out broker-a's 1 s timeouts
            if split():
                break
            await asyncio.sleep(0.1)
        assert split(), (first._owned, second._owned)
    finally:
        brokers[0].proc.send_signal(signal.SIGCONT)
        for c in consumers:
            c.client.timeout = 0.5
            await c.shutdown()
        for b in brokers:
            b.kill()


@bounded(60)
async def test_a_push_consumer_by_sql_starts_while_one_broker_hangs(namesrv, tmp_path):
    """The start passed over a hanging broker's heartbeat, but an SQL92 subscription is first checked by every
    broker (CHECK_CLIENT_CONFIG): the hung one's timeout failed the start all the same. The brokers that
    answer accept the expression; the one that hangs is passed over as the heartbeat's is."""
    from consumer import MessageSelector
    brokers = [BrokerProcess(tmp_path / name, *cluster_flags(namesrv.addr, name, 1000),
                             "--enable-property-filter", "true").start() for name in ("broker-a", "broker-b")]
    consumer = None
    try:
        for b in brokers:
            await create_topic(b.broker, "BySql", 2)
        await wait_for_route(namesrv.addr, "BySql", {"broker-a", "broker-b"})
        brokers[0].proc.send_signal(signal.SIGSTOP)            # broker-a takes requests and answers nothing
        consumer = PushConsumer(namesrv.addr, "CG_by_sql", lambda msg: ConsumeStatus.CONSUME_SUCCESS,
                                suspend_ms=500)
        consumer.client.timeout = 1.0
        consumer.subscribe("BySql", MessageSelector.by_sql("a > 1"))
        await consumer.start()
        assert any(q.broker_name == "broker-b" for q in consumer._owned), consumer._owned
    finally:
        brokers[0].proc.send_signal(signal.SIGCONT)
        if consumer is not None:
            consumer.client.timeout = 0.5
            await consumer.shutdown()
        for b in brokers:
            b.kill()


@bounded(40)
async def test_a_topic_no_broker_creates_fails_loudly_and_is_not_kept(tmp_path, proxy_of):
    """With auto-creation off, a send to a topic nobody made goes to TBW102's brokers and is refused. It must
    raise TOPIC_NOT_EXIST, and not leave TBW102's route cached under that name: kept, every topic ever
    mistyped was asked of the name server each refresh period for good (one lookup each, a route each in
    memory), as main never did."""
    from protocol.errors import TopicNotExistError
    broker = BrokerProcess(tmp_path / "store", "--auto-create-topic", "false").start()
    try:
        proxy = await proxy_of(broker.namesrv)
        async with Producer(proxy.addr, "PG_never", route_refresh_interval_s=3600) as producer:
            for n in range(3):
                with pytest.raises(TopicNotExistError):
                    await producer.send(f"NeverMade{n}", b"x")
            asked = sum(proxy.route_requests[f"NeverMade{n}"] for n in range(3))
            await producer.routes.refresh_all()                # what the background refresh does each period
            assert sum(proxy.route_requests[f"NeverMade{n}"] for n in range(3)) == asked, proxy.route_requests
            await create_topic(broker.broker, "NeverMade0", 4)  # made after all: the next send finds it
            assert (await producer.send("NeverMade0", b"y")).queue.topic == "NeverMade0"
    finally:
        broker.kill()


@bounded(40)
async def test_a_topic_refused_by_the_topic_cap_fails_loudly_and_is_not_kept(tmp_path, proxy_of):
    """Past max_topics_per_host the broker refuses a new topic NO_PERMISSION, not TOPIC_NOT_EXIST. The producer
    must raise that refusal (naming the cap), and not keep TBW102's route cached under the refused name: kept,
    each refused name was asked of the name server every refresh period for good, as a mistyped one was."""
    from protocol.errors import NoPermissionError
    broker = BrokerProcess(tmp_path / "store", "--max-topics-per-host", "1",
                           "--max-auto-create-topics-per-s", "1000").start()
    try:
        proxy = await proxy_of(broker.namesrv)
        async with Producer(proxy.addr, "PG_capped", route_refresh_interval_s=3600) as producer:
            assert (await producer.send("CapMade", b"x")).queue.topic == "CapMade"   # the host's one topic
            for n in range(3):
                with pytest.raises(NoPermissionError, match="max_topics_per_host=1"):
                    await producer.send(f"CapRefused{n}", b"x")
            asked = sum(proxy.route_requests[f"CapRefused{n}"] for n in range(3))
            await producer.routes.refresh_all()                # what the background refresh does each period
            assert sum(proxy.route_requests[f"CapRefused{n}"] for n in range(3)) == asked, proxy.route_requests
            assert (await producer.send("CapMade", b"y")).queue.topic == "CapMade"    # its own route is kept
    finally:
        broker.kill()


@bounded(60)
async def test_routes_of_deleted_topics_are_forgotten_not_refreshed_for_good(tmp_path, proxy_of):
    """A long-lived producer that sent to topics deleted since (a topic per tenant, per day, per test run) kept
    each one's route for good, as the Java client keeps its topicPublishInfoTable: in memory, and asked of the name
    server every refresh period, each answered TOPIC_NOT_EXIST (N lookups a period, growing with months of
    history). A route the name servers have not known for ``route_forget_after_s`` on end is forgotten; a live
    topic's is kept, and a send to a forgotten name asks again."""
    n = 40
    broker = BrokerProcess(tmp_path / "store", "--max-auto-create-topics-per-s", "1000").start()
    try:
        proxy = await proxy_of(broker.namesrv)
        async with Producer(proxy.addr, "PG_churn", route_refresh_interval_s=3600,
                            route_forget_after_s=0.0) as producer:
            for i in range(n):
                await create_topic(broker.broker, f"Churn{i}", 1)
                assert (await producer.send(f"Churn{i}", b"x")).queue.topic == f"Churn{i}"
            await create_topic(broker.broker, "Kept", 1)
            assert (await producer.send("Kept", b"x")).queue.topic == "Kept"
            for i in range(n):
                deleted = await request(broker.broker, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": f"Churn{i}"})
                assert deleted.code == ResponseCode.SUCCESS, deleted.remark
            churned = [f"Churn{i}" for i in range(n)]
            for _ in range(3):                      # what the background refresh does each period
                asked = sum(proxy.route_requests[t] for t in churned)
                await producer.routes.refresh_all()
            assert sum(proxy.route_requests[t] for t in churned) == asked, "forgotten routes are asked no more"
            assert not set(churned) & set(producer.routes._routes)
            assert producer.routes.forgotten == n
            assert (await producer.send("Kept", b"y")).queue.topic == "Kept"     # a live topic's route is kept
            await create_topic(broker.broker, "Churn0", 1)                       # made again: found again
            assert (await producer.send("Churn0", b"z")).queue.topic == "Churn0"
    finally:
        broker.kill()
