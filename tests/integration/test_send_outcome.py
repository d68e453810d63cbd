"""A send whose answer is lost: the broker stored the message, the connection died before its reply came.

The broker advertises 127.0.0.2 (the whole of 127/8 is loopback), where a proxy in the test forwards to it on
the same port; the proxy cuts both sides on the first reply it is armed for and then refuses connections, as a
broker killed right after storing would. The producer's error must say the message may be stored, and under
which msg_id, whatever its later attempts met: "cannot connect" read as "not sent", and the caller sent it again
under a new id no consumer could dedupe.
"""
from __future__ import annotations

import asyncio

import pytest

from producer import Producer
from protocol.errors import MaybeStoredError
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import (NamesrvProcess, cluster_flags, create_topic, stored_count,
                                           wait_for_route)

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


@bounded(40)
async def test_answer_lost_after_store_says_maybe_stored(broker_factory):
    broker = broker_factory("--advertised-host", "127.0.0.2")
    # what the broker prints is its advertised address: the proxy's (and 127.0.0.2 for its name server too)
    direct = f"127.0.0.1:{broker.broker_port}"
    namesrv = "127.0.0.1:" + broker.namesrv.rsplit(":", 1)[1]
    await create_topic(direct, "Lost", 1)
    cutter = await ReplyCutter(broker.broker_port).start()
    producer = await Producer(namesrv, "lost-answer", retries=2, send_timeout=10).start()
    try:
        await producer.send("Lost", b"warm-up")             # route cached, connection through the proxy open
        assert await stored_count(direct, "Lost", 1) == 1
        cutter.armed = True
        with pytest.raises(MaybeStoredError) as info:
            await producer.send("Lost", b"stored, answer lost", properties={"UNIQ_KEY": "LOST-1"})
        assert cutter.cut.is_set()
        assert info.value.msg_id == "LOST-1"
        assert "may have been stored" in str(info.value)
        assert await stored_count(direct, "Lost", 1) == 2      # it was
    finally:
        cutter.close()
        await producer.shutdown()


@bounded(40)
async def test_batched_sends_whose_answer_is_lost_each_say_maybe_stored(broker_factory):
    """One batch request for three sends (linger_ms): each send's error names its own message."""
    broker = broker_factory("--advertised-host", "127.0.0.2")
    direct = f"127.0.0.1:{broker.broker_port}"
    namesrv = "127.0.0.1:" + broker.namesrv.rsplit(":", 1)[1]
    await create_topic(direct, "LostBatch", 1)
    cutter = await ReplyCutter(broker.broker_port).start()
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
        assert all(k in str(o) for k, o in zip(keys, outcomes))
        assert await stored_count(direct, "LostBatch", 1) == 6      # they were
    finally:
        cutter.close()
        await producer.shutdown()


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
