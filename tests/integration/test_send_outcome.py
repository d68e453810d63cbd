"""A send whose answer is lost: the broker stored the message, the connection died before its reply came.

The broker advertises 127.0.0.2 (the whole of 127/8 is loopback), where a proxy in the test forwards to it on
the same port; the proxy cuts both sides on the first reply it is armed for and then refuses connections, as a
broker killed right after storing would. The producer's error must say the message may be stored, and under
which msg_id, whatever its later attempts met: "cannot connect" read as "not sent", and the caller sent it again
under a new id no consumer could dedupe.
"""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from producer import Producer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import ConnectionClosedError, MaybeStoredError
from protocol.registration import (DataVersion, RegisterBrokerBody, RegisteredTopic, encode_register_body,
                                   register_header)
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import (NamesrvProcess, cluster_flags, create_topic, stored_count,
                                           wait_for_route)
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio


class ReplyCutter:
    """Forwards 127.0.0.2:port to 127.0.0.1:port; once ``armed``, the first bytes back from the broker are
    dropped with both connections, and the listener closes (later connects are refused)."""

    def __init__(self, port: int):
        self.port = port
        self.armed = False
        self.cut = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> "ReplyCutter":
        self._server = await asyncio.start_server(self._serve, "127.0.0.2", self.port)
        return self

    async def _serve(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, up_writer]
        await asyncio.gather(self._pipe(reader, up_writer, back=False), self._pipe(up_reader, writer, back=True),
                             return_exceptions=True)

    async def _pipe(self, reader, writer, *, back: bool) -> None:
        while data := await reader.read(65536):
            if back and self.armed:
                self.close()
                self.cut.set()
                return
            writer.write(data)
        writer.close()

    def close(self) -> None:
        self._server.close()
        for w in self._writers:
            w.transport.abort()


async def _behind_a_cutter(broker_factory, topic: str) -> tuple[str, str, ReplyCutter]:
    """A broker advertising 127.0.0.2, where a ReplyCutter forwards to it, with a one-queue ``topic``: the
    broker's direct address, its name server's, and the cutter."""
    broker = broker_factory("--advertised-host", "127.0.0.2")
    # what the broker prints is its advertised address: the proxy's (and 127.0.0.2 for its name server too)
    direct = f"127.0.0.1:{broker.broker_port}"
    await create_topic(direct, topic, 1)
    return direct, "127.0.0.1:" + broker.namesrv.rsplit(":", 1)[1], await ReplyCutter(broker.broker_port).start()


@bounded(40)
async def test_answer_lost_after_store_says_maybe_stored(broker_factory):
    direct, namesrv, cutter = await _behind_a_cutter(broker_factory, "Lost")
    producer = await Producer(namesrv, "lost-answer", retries=2, send_timeout=10).start()
    try:
        await producer.send("Lost", b"warm-up")             # route cached, connection through the proxy open
        assert await stored_count(direct, "Lost", 1) == 1
        cutter.armed = True
        with pytest.raises(MaybeStoredError) as info:
            await producer.send("Lost", b"stored, answer lost", properties={"UNIQ_KEY": "LOST-1"})
        assert cutter.cut.is_set()
        assert info.value.msg_id == "LOST-1"
        # its retries met "cannot connect", raised as ConnectionClosedError before: caught as that still
        assert isinstance(info.value, ConnectionClosedError)
        assert "may have been stored" in str(info.value)
        assert await stored_count(direct, "Lost", 1) == 2      # it was
    finally:
        cutter.close()
        await producer.shutdown()


@bounded(40)
async def test_batched_sends_whose_answer_is_lost_each_say_maybe_stored(broker_factory):
    """One batch request for three sends (linger_ms): each send's error names its own message."""
    direct, namesrv, cutter = await _behind_a_cutter(broker_factory, "LostBatch")
    producer = await Producer(namesrv, "lost-batch", retries=2, send_timeout=10, batch_size=3, linger_ms=5000).start()
    try:
        await asyncio.gather(*(producer.send("LostBatch", b"warm-up %d" % i) for i in range(3)))
        assert await stored_count(direct, "LostBatch", 1) == 3
        cutter.armed = True
        keys = ["LOST-B0", "LOST-B1", "LOST-B2"]
        outcomes = await asyncio.gather(*(producer.send("LostBatch", k.encode(), properties={"UNIQ_KEY": k})
                                          for k in keys), return_exceptions=True)
        assert cutter.cut.is_set()
        assert all(isinstance(o, MaybeStoredError) for o in outcomes), outcomes
        assert [o.msg_id for o in outcomes] == keys
        assert all(isinstance(o, ConnectionClosedError) for o in outcomes), outcomes
        assert all(k in str(o) for k, o in zip(keys, outcomes))
        assert await stored_count(direct, "LostBatch", 1) == 6      # they were
    finally:
        cutter.close()
        await producer.shutdown()


@bounded(60)
async def test_a_batch_whose_answer_is_lost_is_sent_again_under_its_own_keys_and_consumed_once(broker_factory,
                                                                                                 tmp_path):
    """send_batch's MaybeStoredError names its messages' UNIQ_KEYs, and the docs say to send again under them: but
    send_batch took no keys, so the batch could only go again under new ones, and a consumer deduping by UNIQ_KEY
    (SqliteIdempotency) ran each of its messages twice. ``uniq_keys`` sends it again under its own."""
    from consumer import PullConsumer, SqliteIdempotency
    direct, namesrv, cutter = await _behind_a_cutter(broker_factory, "LostSendBatch")
    producer = await Producer(namesrv, "lost-send-batch", retries=2, send_timeout=10).start()
    try:
        await producer.send("LostSendBatch", b"warm-up")
        cutter.armed = True
        bodies = [b"order-1", b"order-2", b"order-3"]
        with pytest.raises(MaybeStoredError) as info:
            await producer.send_batch("LostSendBatch", bodies)
        assert await stored_count(direct, "LostSendBatch", 1) == 4      # stored, its answer lost
        cutter = await ReplyCutter(cutter.port).start()                 # the way to the broker is back
        result = await producer.send_batch("LostSendBatch", bodies, uniq_keys=info.value.msg_id.split(","))
        assert result.msg_id == info.value.msg_id
        assert await stored_count(direct, "LostSendBatch", 1) == 7
        with pytest.raises(ValueError):
            await producer.send_batch("LostSendBatch", bodies, uniq_keys=["only-one"])
        consumer = PullConsumer(namesrv, "CG_lost_send_batch")
        try:
            (mq,) = await consumer.fetch_queues("LostSendBatch")
            copies = (await consumer.pull(mq, 1, max_nums=32)).messages
        finally:
            await consumer.shutdown()
    finally:
        cutter.close()
        await producer.shutdown()
    assert [m.body for m in copies] == bodies * 2
    ran: list[bytes] = []
    done = SqliteIdempotency(str(tmp_path / "ledger.db"))
    try:
        for msg in copies:
            done.run_once(msg, lambda m, db: ran.append(m.body))
    finally:
        done.close()
    assert ran == bodies                # each once, the copies skipped


@pytest.mark.parametrize("batch_size", [1, 8])
@bounded(30)
async def test_a_str_body_fails_its_own_send_not_the_others(broker, batch_size):
    """A str body (not bytes) was found out only when the connection wrote the frames of the loop turn: every
    request queued with it was dropped unsent, the connection left open, and each waited out send_timeout (a
    batch failed every send gathered with it). It is refused at once, alone."""
    async with Producer(broker.namesrv, "bad-body", batch_size=batch_size, linger_ms=50, send_timeout=8) as producer:
        ok1, bad, ok2 = await asyncio.gather(producer.send("BadBody", b"ok1"), producer.send("BadBody", "a str"),
                                             producer.send("BadBody", b"ok2"), return_exceptions=True)
        assert isinstance(bad, TypeError), bad
        assert ok1.queue_offset >= 0 and ok2.queue_offset >= 0, (ok1, ok2)


@bounded(40)
async def test_sends_go_on_with_the_known_route_while_the_name_server_is_down(tmp_path):
    """The name server gone, a route past its ttl was fetched again by every send, which failed with "cannot
    connect to" the name server although its broker was up; and a route refresh that failed kept nothing
    fresher. As in the Java client, the route known last serves until a name server answers again."""
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    broker = BrokerProcess(tmp_path / "broker-a", *cluster_flags(namesrv.addr, "broker-a", 1000)).start()
    producer = None
    try:
        await create_topic(broker.broker, "NoNamesrv", 1)
        await wait_for_route(namesrv.addr, "NoNamesrv", {"broker-a"})
        producer = await Producer(namesrv.addr, "PG_no_namesrv", route_refresh_interval_s=0.2).start()
        await producer.send("NoNamesrv", b"before")
        namesrv.kill()
        while producer.routes.cached_publish_queues("NoNamesrv") is not None:    # the route is past its ttl
            await asyncio.sleep(0.05)
        for i in range(3):
            result = await producer.send("NoNamesrv", b"during %d" % i)
            assert result.queue.broker_name == "broker-a"
        assert await stored_count(broker.broker, "NoNamesrv", 1) == 4
    finally:
        if producer is not None:
            await producer.shutdown()
        broker.kill()
        namesrv.kill()


class Blackhole:
    """An address whose connects hang, as to a host that is gone: a listener that never accepts, its
    backlog full, so the kernel drops further SYNs."""

    def __init__(self):
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self.addr = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._fill = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(self._listener.getsockname())
            self._fill.append(s)

    def close(self) -> None:
        for s in [*self._fill, self._listener]:
            s.close()


@bounded(40)
async def test_a_broker_whose_host_is_gone_does_not_take_the_sends_time(tmp_path):
    """The route names a broker whose host is gone (its connects hang) beside one that is up, until the name
    server expires it (120 s). Round robin sent every other send there first: its connect took the whole
    send_timeout, and the send failed though the other broker was up. A connect with another attempt to
    come is given half the time left, and a broker that could not be reached is passed over for a while."""
    hole = Blackhole()
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    broker = BrokerProcess(tmp_path / "broker-a", *cluster_flags(namesrv.addr, "broker-a", 1000)).start()
    gone = await RawClient.open(namesrv.addr)       # registers broker-gone and keeps it routed while open
    producer = None
    try:
        await create_topic(broker.broker, "Gone", 2)
        body = encode_register_body(RegisterBrokerBody({"Gone": RegisteredTopic("Gone", 2, 2, 6)},
                                                       DataVersion(int(time.time() * 1000), 1), []))
        ext = register_header(broker_name="broker-gone", broker_addr=hole.addr, cluster_name="DefaultCluster",
                              ha_server_addr="", broker_id=0, compressed=False, body=body)
        registered = await gone.call(RemotingCommand(RequestCode.REGISTER_BROKER, opaque=1, ext_fields=ext,
                                                     body=body), 10)
        assert registered and registered[0].code == ResponseCode.SUCCESS, registered
        await wait_for_route(namesrv.addr, "Gone", {"broker-a", "broker-gone"})
        producer = await Producer(namesrv.addr, "PG_gone", send_timeout=3).start()
        results = [await producer.send("Gone", b"m%d" % i) for i in range(6)]
        assert {r.queue.broker_name for r in results} == {"broker-a"}
    finally:
        if producer is not None:
            await producer.shutdown()
        gone.close()
        broker.kill()
        namesrv.kill()
        hole.close()


@bounded(120)
async def test_a_send_past_the_frame_limit_fails_alone_not_the_sends_beside_it(broker_factory):
    """A request frame past 16 MiB (RocketMQ's frameMaxLength) makes the broker close the connection. Sent, a 17 MiB
    body failed as maybe stored with every send in flight beside it: 100 small sends all raised MaybeStoredError,
    and their retries, reset again by its own, stored 50 of them three times each and the other 50 never. It is
    refused before it is sent (MESSAGE_ILLEGAL, as the broker refuses a body past its max_message_size)."""
    from consumer import PullConsumer
    from protocol.errors import MessageIllegalError
    broker = broker_factory()
    async with Producer(broker.namesrv, "PG_frame", send_timeout=20) as producer:
        await producer.send("Framed", b"warm-up")
        small = [asyncio.ensure_future(producer.send("Framed", b"s%d" % i)) for i in range(50)]
        huge = asyncio.ensure_future(producer.send("Framed", b"x" * (17 << 20)))
        small += [asyncio.ensure_future(producer.send("Framed", b"t%d" % i)) for i in range(50)]
        results = await asyncio.gather(huge, *small, return_exceptions=True)
    consumer = PullConsumer(broker.namesrv, "CG_frame")
    bodies = []
    try:
        for mq in await consumer.fetch_queues("Framed"):
            offset = 0
            while (res := await consumer.pull(mq, offset, max_nums=64)).messages:
                bodies += [m.body for m in res.messages]
                offset = res.next_begin_offset
    finally:
        await consumer.shutdown()
    assert type(results[0]) is MessageIllegalError, results[0]
    assert "not sent" in str(results[0])
    failed = [r for r in results[1:] if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    assert sorted(bodies) == sorted([b"warm-up", *(b"s%d" % i for i in range(50)), *(b"t%d" % i for i in range(50))])
