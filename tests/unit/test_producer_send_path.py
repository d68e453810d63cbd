"""The producer's cheap send path writes what the generic one wrote: the templated JSON header is byte for
byte RemotingCommand's encoding of the same send header, the properties string is the one
message_properties + properties_to_string gave, UNIQ_KEYs keep RocketMQ's layout, and a connection's one
timeout timer still fails each request at its own deadline."""
from __future__ import annotations

import asyncio
import re
import struct

import pytest

from producer import Producer
from producer.producer import _SendCommand, _SendTemplate
from producer.routes import MessageQueue
from protocol.codes import FLAG_ONEWAY, RequestCode
from protocol.command import RemotingCommand
from protocol.connection import CLIENT_FRAMES_PER_TURN, FRAMES_PER_TURN, ConnectionPool, RemotingConnection
from protocol.errors import RequestTimeoutError
from protocol.message import Prop, SendMessageRequestHeader, UniqIdGenerator, properties_to_string
from protocol.route import BrokerData, QueueData, TopicRouteData


def _generic(code, group, topic, qid, sys_flag, flag, batch, born, props, body) -> RemotingCommand:
    fields = SendMessageRequestHeader(producer_group=group, topic=topic, default_topic="TBW102",
                                      default_topic_queue_nums=4, queue_id=qid, sys_flag=sys_flag,
                                      born_timestamp=born, flag=flag, properties=props,
                                      batch=batch).to_ext_fields(v2=code != RequestCode.SEND_MESSAGE)
    return RemotingCommand.request(code, fields, body)


@pytest.mark.parametrize("code", [RequestCode.SEND_MESSAGE_V2, RequestCode.SEND_MESSAGE, RequestCode.SEND_BATCH_MESSAGE])
@pytest.mark.parametrize("sys_flag,flag,batch", [(0, 0, False), (4, 7, False), (0, 0, True)])
@pytest.mark.parametrize("group,topic,props", [
    ("PG", "T", "UNIQ_KEY\x01AB\x02WAIT\x01true"),
    ('P"G\\', "T_x-1", ""),
    ("grüppe", "Tö", "TAGS\x01t\u00e9\x02KEYS\x01a \"b\"\x02\x1f\x01\u2028"),
])
def test_the_template_writes_the_generic_header_byte_for_byte(code, sys_flag, flag, batch, group, topic, props):
    body = b"body"
    for cmd_flag, opaque in ((0, 1), (FLAG_ONEWAY, 0x7FFFFFFF)):
        tpl = _SendTemplate(code, group, topic, 3, sys_flag, flag, batch)
        fast = _SendCommand(code, tpl, 1_764_000_000_123, props, body)
        slow = _generic(code, group, topic, 3, sys_flag, flag, batch, 1_764_000_000_123, props, body)
        fast.opaque = slow.opaque = opaque
        fast.flag = slow.flag = cmd_flag
        assert fast.encode() == slow.encode()
        assert RemotingCommand.decode(fast.encode()).ext_fields == slow.ext_fields
        # read (a signer, a test): the same dict in the same order, and the generic encoder from then on
        assert list(fast.ext_fields.items()) == list(slow.ext_fields.items())
        fast.ext_fields["extra"] = slow.ext_fields["extra"] = "1"
        assert fast.encode() == slow.encode()
        fast.serialize_type = slow.serialize_type = 1
        assert fast.encode() == slow.encode()


class _Captured(Exception):
    pass


@pytest.mark.parametrize("kwargs", [
    {}, {"tags": "TagA"}, {"keys": "k1"}, {"keys": ["k1", "k2"]}, {"tags": "t", "keys": ["a"]},
    {"delay_level": 3}, {"deliver_at_ms": 1_800_000_000_000}, {"tags": "t", "delay_level": 2, "deliver_at_ms": 5},
    {"properties": {"a": "1"}, "tags": "t"}, {"properties": {Prop.UNIQ_KEY: "MINE", "x": "y"}},
    {"properties": {"TAGS": "old", "b": "2"}, "tags": "new", "delay_level": 1},
    {"tags": "", "keys": []},
])
@pytest.mark.parametrize("batching", [False, True])
async def test_the_properties_string_is_the_one_the_dict_path_gave(kwargs, batching):
    producer = Producer("127.0.0.1:1", "PG", batch_size=8 if batching else 1)
    producer.uniq_ids.next = lambda: "0A0B0C0D"
    seen = []

    async def send_text(code, topic, body, props, uniq, queue, **kw):
        seen.append((props, uniq))
        raise _Captured

    def add(topic, body, props, uniq):
        seen.append((props, uniq))
        raise _Captured

    producer._send_text = send_text
    if producer._accumulator is not None:
        producer._accumulator.add = add
    with pytest.raises(_Captured):
        await producer.send("T", b"x", **kwargs)
    # what the previous code built: message_properties, DELAY / TIMER_DELIVER_MS set on the dict, WAIT dropped
    # from a batch entry (a send with a delay or a timer is never batched)
    props = producer.message_properties(kwargs.get("tags"), kwargs.get("keys"), kwargs.get("properties"))
    if kwargs.get("delay_level"):
        props[Prop.DELAY] = str(kwargs["delay_level"])
    if kwargs.get("deliver_at_ms") is not None:
        props["TIMER_DELIVER_MS"] = str(kwargs["deliver_at_ms"])
    waits = Prop.DELAY in props or "TIMER_DELIVER_MS" in props
    if batching and not waits:
        props.pop(Prop.WAIT)
    assert seen == [(properties_to_string(props), props[Prop.UNIQ_KEY])]


async def test_a_batching_producer_sends_a_message_with_aliyuns_start_deliver_time_alone():
    """The broker holds __STARTDELIVERTIME as a timer and refuses a batch holding one: gathered into a batch, it
    would have had every message sent with it refused."""
    producer = Producer("127.0.0.1:1", "PG", batch_size=8)
    went = []

    async def send_text(code, topic, body, props, uniq, queue, **kw):
        went.append("alone")
        raise _Captured

    def add(topic, body, props, uniq):
        went.append("batched")
        raise _Captured

    producer._send_text, producer._accumulator.add = send_text, add
    for props in ({"__STARTDELIVERTIME": "1800000000000"}, {"x": "1"}):
        with pytest.raises(_Captured):
            await producer.send("T", b"x", properties=props)
    assert went == ["alone", "batched"]


def test_uniq_keys_keep_rocketmqs_layout_and_are_unique():
    gen = UniqIdGenerator("10.1.2.3")
    ids = [gen.next() for _ in range(50_000)]
    assert len(set(ids)) == len(ids)
    prefix = gen._prefix.hex().upper()
    assert prefix.startswith("0A010203")
    for uid in ids[:100]:
        assert re.fullmatch(r"[0-9A-F]{32}", uid) and uid.startswith(prefix)
    # the tail is pack(">IH", ms since the month began, counter): consecutive ids count up by one
    counters = [struct.unpack(">IH", bytes.fromhex(uid[20:]))[1] for uid in ids[:3]]
    assert [(c - counters[0]) & 0xFFFF for c in counters] == [0, 1, 2]


class _VirtualClock:
    """The connection's loop, but for time: ``time()`` reads a clock the test moves, and ``call_at`` timers
    run only when the test moves it past them. On the real clock a loaded machine stalling 0.45 s made every
    deadline due in one sweep, and the requests failed in the order they were sent, not their deadlines."""

    class Timer:
        def __init__(self, when, callback, args):
            self.when, self.callback, self.args, self.cancelled = when, callback, args, False

        def cancel(self):
            self.cancelled = True

    def __init__(self, loop):
        self.loop, self.now, self.timers = loop, 0.0, []

    def __getattr__(self, name):
        return getattr(self.loop, name)

    def time(self) -> float:
        return self.now

    def call_at(self, when, callback, *args):
        timer = self.Timer(when, callback, args)
        self.timers.append(timer)
        return timer

    def armed(self) -> list[float]:
        return [t.when for t in self.timers if not t.cancelled]

    def advance(self, to: float) -> None:
        self.now = to
        while due := [t for t in self.timers if not t.cancelled and t.when <= to]:
            for timer in due:
                self.timers.remove(timer)
                timer.callback(*timer.args)


async def test_one_timer_per_connection_still_fails_each_request_at_its_own_deadline():
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: RemotingConnection(lambda conn, cmd: asyncio.Event().wait()),
                                      "127.0.0.1", 0)            # never answers
    pool = ConnectionPool()
    try:
        async with asyncio.timeout(10):
            conn = await pool.get(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
            assert conn.frames_per_turn == CLIENT_FRAMES_PER_TURN and RemotingConnection().frames_per_turn == 16
            assert FRAMES_PER_TURN == 16                          # the broker's fairness limit is unchanged
            clock = conn._loop = _VirtualClock(loop)
            ended: list[tuple[str, float]] = []
            progress = asyncio.Event()

            async def ask(name: str, timeout: float):
                with pytest.raises(RequestTimeoutError, match=r"got no response in"):
                    await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), timeout)
                ended.append((name, clock.time()))
                progress.set()

            async def advance(to: float, expect: list[str]) -> None:
                progress.clear()
                clock.advance(to)
                while len(ended) < len(expect):
                    await progress.wait()
                    progress.clear()
                assert [name for name, _ in ended] == expect

            abandoned = loop.create_task(conn.request(RemotingCommand.request(RequestCode.HEART_BEAT), 0.3))
            await asyncio.sleep(0)
            abandoned.cancel()
            # the long one first: the timer armed for it must be moved earlier for the short one
            asks = [loop.create_task(ask("long", 0.6)), loop.create_task(ask("short", 0.15)),
                    loop.create_task(ask("mid", 0.3))]
            while len(conn._pending) < 3:                          # the three sent (the abandoned one gone)
                await asyncio.sleep(0)
            assert clock.armed() == [0.15]                         # one timer, at the earliest deadline
            await advance(0.149, [])                               # a ms early: the sweep is not due yet
            await advance(0.15, ["short"])
            assert clock.armed() == [0.3]                          # re-armed for the next deadline, not the last
            await advance(0.3, ["short", "mid"])
            assert clock.armed() == [0.6]
            await advance(0.6, ["short", "mid", "long"])
            await asyncio.gather(*asks)
            assert ended == [("short", 0.15), ("mid", 0.3), ("long", 0.6)]    # each at its own deadline
            assert clock.armed() == []
            assert not conn._pending                              # timed out and cancelled requests are gone
    finally:
        await pool.close()
        server.close()


async def test_a_send_to_a_queue_reuses_its_template_and_its_routes_queue_list():
    producer = Producer("127.0.0.1:1", "PG")
    a = producer._command(RequestCode.SEND_MESSAGE_V2, MessageQueue("T", "b", 1), "p", b"")
    b = producer._command(RequestCode.SEND_MESSAGE_V2, MessageQueue("T", "b", 1), "q", b"")
    c = producer._command(RequestCode.SEND_MESSAGE_V2, MessageQueue("T", "b", 2), "q", b"")
    assert a._tpl is b._tpl and c._tpl is not a._tpl

    routes = producer.routes
    answers = [TopicRouteData([QueueData("b", 2, 2, 6)], [BrokerData("c", "b", {0: "127.0.0.1:1"})]),
               TopicRouteData([QueueData("b", 3, 3, 6)], [BrokerData("c", "b", {0: "127.0.0.1:1"})])]

    async def fetch(topic):
        return answers.pop(0)

    routes.fetch = fetch
    assert routes.cached_publish_queues("T") is None                  # nothing fetched yet
    queues = await routes.publish_queues("T")
    assert routes.cached_publish_queues("T") is queues and len(queues) == 2
    routes.forget("T")                                                 # after a routing error: asked again
    assert routes.cached_publish_queues("T") is None
    assert len(await routes.publish_queues("T")) == 3
    routes.ttl_s = 0.0                                                 # a stale route is not served from cache
    assert routes.cached_publish_queues("T") is None


@pytest.mark.parametrize("key", ["k\x02DELAY\x013", "k\x01v", "k\x00", b"k", 7])
async def test_send_batch_refuses_a_uniq_key_that_would_not_come_back_as_itself(key):
    """A UNIQ_KEY holding a properties separator is stored as more pairs (its UNIQ_KEY "k" and a DELAY smuggled
    into the batch), a NUL has the batch refused: the msg_id send_batch returned was no key a consumer sees, and
    deduping by it ran the messages again. Refused before anything is sent, as an empty key or a ',' is, and so
    is a key that is no str (a TypeError from the check, or sent as its repr)."""
    producer = Producer("127.0.0.1:1", "PG")
    sent = []

    async def send_text(*a, **kw):
        sent.append(a)
        raise _Captured

    producer._send_text = send_text
    with pytest.raises(ValueError, match="uniq_keys"):
        await producer.send_batch("T", [b"a", b"b"], uniq_keys=["fine", key])
    assert not sent
