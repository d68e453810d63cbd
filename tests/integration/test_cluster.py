"""Two brokers under one stand-alone name server, real processes on loopback.

Registration and routes, a stock client (ali-ons) spreading sends over both
brokers, kill -9 of one broker while sends go on (stock and ours), and the
killed broker checking its undecided transaction when it comes back. Brokers
register every second and the name server expires them after 3 s, so a
failover is seen in test time (defaults: 30 s / 120 s).
"""
from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest

from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import (NamesrvProcess, cluster_flags, create_topic, request, route,
                                           route_brokers, stored_count, wait_for_route)

pytestmark = pytest.mark.asyncio
JS = Path(__file__).parent / "js"
EXPIRE_MS = 3000
PERIOD_MS = 1000


def _node_ready() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed (scripts/test.sh installs it)"
    if not (JS / "node_modules" / "ali-ons").is_dir():
        return "ali-ons is not installed: run `npm ci` in tests/integration/js"
    return None


needs_node = pytest.mark.skipif(_node_ready() is not None, reason=_node_ready() or "")


@pytest.fixture
def cluster(tmp_path):
    """start(): a name server and brokers broker-a, broker-b registered with it; stopped at the end."""
    started = []

    class Cluster:
        namesrv: NamesrvProcess
        brokers: dict[str, BrokerProcess] = {}

        def start(self, *broker_flags: str, names=("broker-a", "broker-b")):
            self.namesrv = NamesrvProcess(tmp_path / "namesrv.log", "--broker-expire-ms", str(EXPIRE_MS),
                                          "--scan-interval-ms", "200").start()
            started.append(self.namesrv)
            for name in names:
                self.start_broker(name, *broker_flags)
            return self

        def start_broker(self, name: str, *flags: str, store: str = "") -> BrokerProcess:
            """A broker registered as ``name``, its store (and its key in ``brokers``) ``store`` or its name."""
            b = BrokerProcess(tmp_path / (store or name), *cluster_flags(self.namesrv.addr, name, PERIOD_MS), *flags)
            started.append(b)
            self.brokers[store or name] = b.start()
            return b

        def logs(self) -> str:
            return "\n".join([self.namesrv.log()] + [b.log() for b in self.brokers.values()])

    yield Cluster()
    for p in reversed(started):
        p.kill()


@bounded(60)
async def test_brokers_register_and_routes_merge_them(cluster):
    c = cluster.start()
    assert c.namesrv.addr and all(b.namesrv == c.namesrv.addr for b in c.brokers.values())
    assert await route_brokers(c.namesrv.addr, "TBW102") == {"broker-a", "broker-b"}
    for b in c.brokers.values():
        await create_topic(b.broker, "Both", 4)
    await wait_for_route(c.namesrv.addr, "Both", {"broker-a", "broker-b"})
    r = await route(c.namesrv.addr, "Both")
    assert {bd.broker_name: bd.broker_addrs for bd in r.broker_datas} == {
        name: {0: b.broker} for name, b in c.brokers.items()}
    info = json.loads((await request(c.namesrv.addr, RequestCode.GET_BROKER_CLUSTER_INFO)).body_bytes())
    assert info["clusterAddrTable"] == {"DefaultCluster": ["broker-a", "broker-b"]}
    # A clean stop unregisters at once: its queues leave before any expiry could.
    assert c.brokers["broker-b"].stop() == 0
    assert await route_brokers(c.namesrv.addr, "Both") == {"broker-a"}


@needs_node
@bounded(150)
async def test_ali_ons_sends_land_on_both_brokers_and_are_consumed_from_both(cluster):
    c = cluster.start()
    for b in c.brokers.values():
        await create_topic(b.broker, "AliOnsCluster", 4)
    await wait_for_route(c.namesrv.addr, "AliOnsCluster", {"broker-a", "broker-b"})
    proc = await asyncio.create_subprocess_exec(
        "node", "ali_ons_roundtrip.js", "--namesrv", c.namesrv.addr, "--topic", "AliOnsCluster", "--count", "40",
        "--timeout-ms", "90000", cwd=JS, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert proc.returncode == 0, f"{out.decode()[-2000:]}\n{err.decode()[-2000:]}\n{c.logs()}"
    sends = [line for line in lines if line.get("event") == "send"]
    by_broker = {name: sum(1 for s in sends if s["brokerName"] == name) for name in c.brokers}
    assert by_broker["broker-a"] > 0 and by_broker["broker-b"] > 0 and sum(by_broker.values()) == 40
    for name, b in c.brokers.items():           # what each broker stored is what ali-ons says it sent there
        assert await stored_count(b.broker, "AliOnsCluster", 4) == by_broker[name]
    assert len(lines[-1]["received"]) == 40     # and one consumer read all 40 from both


async def _read_json(stream, timeout: float = 30.0) -> dict:
    while True:
        line = await asyncio.wait_for(stream.readline(), timeout)
        if not line:
            raise AssertionError("the sender ended early")
        if line.startswith(b"{"):
            return json.loads(line)


@needs_node
@bounded(150)
async def test_kill9_of_a_broker_ali_ons_keeps_sending_and_nothing_acknowledged_is_lost(cluster):
    c = cluster.start()
    for b in c.brokers.values():
        await create_topic(b.broker, "Failover", 4)
    await wait_for_route(c.namesrv.addr, "Failover", {"broker-a", "broker-b"})
    proc = await asyncio.create_subprocess_exec(
        "node", "ali_ons_sender.js", "--namesrv", c.namesrv.addr, "--topic", "Failover", "--count", "120",
        "--pause-after", "40", cwd=JS, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        before = []
        while (line := await _read_json(proc.stdout))["event"] != "paused":
            before.append(line)
        assert all(s["ok"] for s in before) and {s["brokerName"] for s in before} == {"broker-a", "broker-b"}
        acked_a = sum(1 for s in before if s["brokerName"] == "broker-a")
        killed = c.brokers["broker-a"]
        killed.kill()
        # dropped by the name server (its connection closed, or at the latest EXPIRE_MS unheard: a generous bound
        # on the wait, far under the 120 s default expiry); was a wall-clock bound (<= 5 s), flaky under load
        await wait_for_route(c.namesrv.addr, "Failover", {"broker-b"}, timeout=30)
        assert f"broker {killed.broker}: " in c.namesrv.log() and "removed from routes" in c.namesrv.log(), \
            c.namesrv.log()
        proc.stdin.write(b"go\n")               # ali-ons still holds the old route: it must fail over itself
        await proc.stdin.drain()
        after = []
        while (line := await _read_json(proc.stdout))["event"] != "done":
            after.append(line)
        await asyncio.wait_for(proc.wait(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert len(after) == 80 and all(s["ok"] for s in after), after
    assert {s["brokerName"] for s in after} == {"broker-b"}
    assert line == {"event": "done", "ok": 120, "failed": 0}
    acked_b = sum(1 for s in before + after if s["brokerName"] == "broker-b")
    assert await stored_count(c.brokers["broker-b"].broker, "Failover", 4) == acked_b
    a = c.start_broker("broker-a")              # the killed broker's store, restarted: nothing acknowledged lost
    assert await stored_count(a.broker, "Failover", 4) == acked_a
    await wait_for_route(c.namesrv.addr, "Failover", {"broker-a", "broker-b"})


@bounded(90)
async def test_our_producer_keeps_sending_through_a_kill9(cluster):
    c = cluster.start()
    for b in c.brokers.values():
        await create_topic(b.broker, "OursFailover", 4)
    await wait_for_route(c.namesrv.addr, "OursFailover", {"broker-a", "broker-b"})
    async with Producer(c.namesrv.addr, "PG_failover", retries=2, send_timeout=3.0) as producer:
        results = [await producer.send("OursFailover", b"before %d" % i) for i in range(20)]
        assert {r.queue.broker_name for r in results} == {"broker-a", "broker-b"}
        c.brokers["broker-b"].kill()
        after = [await producer.send("OursFailover", b"after %d" % i) for i in range(40)]
    assert all(r.queue.broker_name == "broker-a" for r in after)
    acked_a = sum(1 for r in results + after if r.queue.broker_name == "broker-a")
    assert await stored_count(c.brokers["broker-a"].broker, "OursFailover", 4) == acked_a


class UndecidedThenCommit:
    """The local transaction says UNKNOW; the check says COMMIT and records what it was asked.

    With ``returned``, a check that comes before it is set (a loaded machine outlasting the 1 s immunity before
    the broker went down) is held until then and answered UNKNOW, unrecorded: answered COMMIT, it decided the
    transaction before the restart, and the test passed without the returned broker asking anything."""

    def __init__(self, returned: asyncio.Event | None = None):
        self.checked: list[str] = []
        self.checked_event = asyncio.Event()
        self.returned = returned

    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    async def check_local_transaction(self, msg):
        if self.returned is not None and not self.returned.is_set():
            await self.returned.wait()
            return S.UNKNOW
        self.checked.append(msg.body.decode())
        self.checked_event.set()
        return S.COMMIT_MESSAGE


@bounded(120)
async def test_a_killed_brokers_undecided_half_is_checked_when_it_returns(cluster):
    tx_flags = ("--transaction-timeout-ms", "1000", "--transaction-check-interval-ms", "300")
    c = cluster.start(*tx_flags)
    for b in c.brokers.values():
        await create_topic(b.broker, "TxCluster", 2)
    await wait_for_route(c.namesrv.addr, "TxCluster", {"broker-a", "broker-b"})
    returned = asyncio.Event()
    listener = UndecidedThenCommit(returned)
    producer = TransactionProducer(c.namesrv.addr, "PG_tx_cluster", listener, heartbeat_interval_s=0.5,
                                   route_refresh_interval_s=0.5)
    await producer.start()
    try:
        # Halves until one lands on broker-a, then kill -9 it before its first check (immunity 1 s).
        for i in range(8):
            sent = await producer.send_in_transaction("TxCluster", b"tx %d" % i)
            if sent.send_result.queue.broker_name == "broker-a":
                break
        assert sent.send_result.queue.broker_name == "broker-a" and sent.state is S.UNKNOW
        body_on_a = f"tx {i}"
        c.brokers["broker-a"].kill()
        a = c.start_broker("broker-a", *tx_flags)     # same store, new port: it registers, the producer finds it
        returned.set()
        while body_on_a not in listener.checked:
            listener.checked_event.clear()
            await asyncio.wait_for(listener.checked_event.wait(), 30)
        deadline = time.monotonic() + 20
        while await stored_count(a.broker, "TxCluster", 2) < 1:     # the check's COMMIT made it visible
            assert time.monotonic() < deadline, c.logs()
            await asyncio.sleep(0.1)
    finally:
        await producer.shutdown()
    assert await stored_count(a.broker, "TxCluster", 2) == 1


@bounded(90)
async def test_an_idle_producer_is_checked_after_its_only_broker_restarts_cleanly(cluster):
    """A clean stop unregisters the broker, so the name server answers TOPIC_NOT_EXIST for its topics until
    it is back. The producer's route refresh dropped such routes: it then knew no broker, sent no heartbeat
    to the restarted one, and the broker -- with no channel of the group -- never asked it about its
    undecided half. The routes are kept, the heartbeat reaches the broker at its new address, and the
    check comes."""
    tx_flags = ("--transaction-timeout-ms", "1000", "--transaction-check-interval-ms", "300")
    c = cluster.start(*tx_flags, names=("broker-a",))
    await create_topic(c.brokers["broker-a"].broker, "TxAlone", 1)
    await wait_for_route(c.namesrv.addr, "TxAlone", {"broker-a"})
    returned = asyncio.Event()
    listener = UndecidedThenCommit(returned)
    producer = TransactionProducer(c.namesrv.addr, "PG_tx_alone", listener, heartbeat_interval_s=0.3,
                                   route_refresh_interval_s=0.3)
    await producer.start()
    try:
        sent = await producer.send_in_transaction("TxAlone", b"undecided")
        assert sent.state is S.UNKNOW
        c.brokers["broker-a"].stop()                      # SIGTERM: unregisters, before its first check
        await wait_for_route(c.namesrv.addr, "TxAlone", set())
        await producer.routes.refresh_all()               # what the background refresh does meanwhile
        c.start_broker("broker-a", *tx_flags)             # same store, new port
        returned.set()
        await asyncio.wait_for(listener.checked_event.wait(), 30)
        assert listener.checked == ["undecided"]
    finally:
        await producer.shutdown()


@bounded(60)
async def test_a_silent_broker_expires_and_comes_back_when_it_registers_again(cluster):
    """SIGSTOP keeps the broker's connection open but silences it: only the expiry can drop it."""
    import signal
    c = cluster.start()
    b = c.brokers["broker-b"]
    b.proc.send_signal(signal.SIGSTOP)
    try:
        # dropped by the expiry, at EXPIRE_MS unheard (said so by the name server), not by the 120 s default: a
        # generous bound on the wait; was a wall-clock bound (<= 6 s), flaky under load
        await wait_for_route(c.namesrv.addr, "TBW102", {"broker-a"}, timeout=30)
        assert f"broker {b.broker}: not heard from for {EXPIRE_MS} ms, removed from routes" in c.namesrv.log(), \
            c.namesrv.log()
    finally:
        b.proc.send_signal(signal.SIGCONT)
    # The name server closed its connection; the next registration reopens it and the queues return.
    await wait_for_route(c.namesrv.addr, "TBW102", {"broker-a", "broker-b"}, timeout=10)


@bounded(60)
async def test_a_second_master_left_at_the_same_broker_name_is_said_by_the_name_server(cluster):
    """A second master started with the first's --broker-name (the default, broker-a, on a new host): the two took the
    name from each other at every registration and the routes flipped between them, nothing said."""
    c = cluster.start(names=("broker-a",))
    first = c.brokers["broker-a"]
    second = c.start_broker("broker-a", store="second")
    while "both register as" not in c.namesrv.log():    # said once the first takes the name back (bounded)
        await asyncio.sleep(0.1)
    said = next(line for line in c.namesrv.log().splitlines() if "both register as" in line)
    assert {first.broker, second.broker} == set(said.split("brokers ")[1].split(" both")[0].split(" and ")), said
    assert "broker-a id 0 (a master)" in said and "--broker-name" in said


def _children(pid: int) -> dict[str, int]:
    """Child pids of ``pid`` by role (namesrv / broker-i), from /proc."""
    out = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        name = "namesrv" if b"namesrv" in argv[:4] else argv[argv.index(b"--broker-name") + 1].decode()
        out[name] = int(child)
    return out


@bounded(90)
async def test_cluster_supervisor_runs_restarts_and_stops_everything(tmp_path):
    import os
    import signal
    import sys
    from tests.support.broker_process import REPO
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker", "cluster", "--brokers", "2", "--store-root", str(tmp_path / "stores"),
        "--namesrv-port", "0", "--base-port", "0", "--metrics-base-port", "-1", "--register-period-ms", "1000",
        "--broker-expire-ms", "3000", "--restart-delay-s", "0.1", "--", "--flush", "async",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("LISTENING namesrv="), line
        fields = dict(kv.split("=", 1) for kv in line.split()[1:])
        ns, addrs = fields["namesrv"], fields["brokers"].split(";")
        assert await route_brokers(ns, "TBW102") == {"broker-0", "broker-1"}
        assert sorted(os.listdir(tmp_path / "stores")) == ["broker-0", "broker-1"]
        children = _children(proc.pid)
        os.kill(children["broker-1"], signal.SIGKILL)
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().startswith("EXITED broker-1")
        restarted = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert restarted.startswith("RESTARTED broker-1") and f"broker={addrs[1]}" in restarted   # same port
        await wait_for_route(ns, "TBW102", {"broker-0", "broker-1"})
        children = _children(proc.pid)
        assert set(children) == {"namesrv", "broker-0", "broker-1"}
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        for pid in _children_gone(children):
            raise AssertionError(f"child {pid} outlived the supervisor")
    finally:
        if proc.returncode is None:
            proc.kill()


def _children_gone(children: dict[str, int]):
    import os
    for pid in children.values():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        yield pid


@bounded(60)
async def test_a_start_stored_on_a_broker_not_yet_beaten_is_a_consumers_commit_not_an_admin_move(cluster):
    """consume_from="last" stores where a queue the group never committed starts, answered, before its first pull.
    A broker the rebalance loop's last heartbeat did not know (one the topic just spread to: the route that names
    it is fetched by the rebalance after the beat) saw that answered commit on a connection with no heartbeat and
    no pull of the group: it took it for an admin tool's move, said so at WARNING ("no consumer of the group (an
    admin tool ...)") and saved its offsets file before answering, each queue paced by the saver's rest."""
    from consumer import ConsumeStatus, MessageQueue, PushConsumer
    c = cluster.start("--access-message-in-memory-max-ratio", "0")     # no offset: QUERY_NOT_FOUND, not 0
    topic, group = "Spreads", "CG_spreads"
    await create_topic(c.brokers["broker-a"].broker, topic, 2)
    await wait_for_route(c.namesrv.addr, topic, {"broker-a"})
    consumer = PushConsumer(c.namesrv.addr, group, lambda m: ConsumeStatus.CONSUME_SUCCESS, consume_from="last",
                            rebalance_interval_s=3600, offset_commit_interval_s=3600, suspend_ms=300)
    consumer.subscribe(topic)
    async with Producer(c.namesrv.addr, "PG_spreads") as producer, consumer:
        await create_topic(c.brokers["broker-b"].broker, topic, 2)
        await wait_for_route(c.namesrv.addr, topic, {"broker-a", "broker-b"})
        for i in range(2):      # broker-b's queues hold a message "on disk": the group has no offset there
            await producer.send(topic, b"before", queue=MessageQueue(topic, "broker-b", i))
        await consumer.rebalance()      # the rebalance loop's step after a beat that knew broker-a alone
        b_queues = {MessageQueue(topic, "broker-b", i) for i in range(2)}
        assert b_queues <= consumer._owned
        while not all(consumer._committed.get(q) == 1 for q in b_queues):      # the starts stored
            await asyncio.sleep(0.05)
    said = [line for line in c.brokers["broker-b"].log().splitlines() if "no consumer of the group" in line]
    assert not said, f"the consumer's own start taken for an admin's move: {said}"
