"""Producer: plain RocketMQ 4.x sends over asyncio (SEND_MESSAGE_V2, SEND_BATCH_MESSAGE, oneway).

Nothing here is txmq-specific: it works against an Apache RocketMQ broker too.
A send picks a queue round robin, retries retriable failures (another queue,
another broker when there is one) up to ``retries`` times, and heartbeats its
group to every broker it knows every ``heartbeat_interval_s``. With
``batch_size`` > 1, plain sends to a topic are gathered for up to ``linger_ms``
and leave as one SEND_BATCH_MESSAGE (accumulator.py); each send still resolves
to its own message's result.

The send path is the client's hot loop (one call per message), so it builds no properties dict,
header object or ext-fields dict for a plain send: the properties string is written directly, and
the JSON header comes from a per-(topic, queue) template pre-encoded around the fields that change
per message (bornTimestamp, properties, opaque), byte for byte what RemotingCommand would write.
"""
from __future__ import annotations

import asyncio
import enum
import functools
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

from protocol.codes import VERSION_4_9_8, LanguageCode, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import ConnectionPool, jittered, wait_within
from protocol.errors import (ClientClosedError, ConnectionClosedError, MaybeStoredClosedError, MaybeStoredError,
                             RequestTimeoutError, ResponseError, TopicNotExistError, error_for_code)
from protocol.message import (TIMER_PROPS, Prop, SendMessageRequestHeader, UniqIdGenerator, encode_batch,
                              properties_to_string, separator_in)
from protocol.signature import Credentials

from .accumulator import Accumulator
from .routes import FORGET_AFTER_S, MessageQueue, RouteCache

log = logging.getLogger("txmq.producer")
_TIMER_PROPS = frozenset(TIMER_PROPS)       # RocketMQ 5 timers, Aliyun's __STARTDELIVERTIME
_esc = json.encoder.encode_basestring           # the escaper RemotingCommand's JSON header writer uses
_STORED = (ResponseCode.SUCCESS, ResponseCode.FLUSH_DISK_TIMEOUT, ResponseCode.SLAVE_NOT_AVAILABLE,
           ResponseCode.FLUSH_SLAVE_TIMEOUT)


class SendStatus(enum.Enum):
    """How a send ended on the broker (RocketMQ's SendStatus); anything else raises."""

    SEND_OK = 0
    FLUSH_DISK_TIMEOUT = 10
    SLAVE_NOT_AVAILABLE = 11
    FLUSH_SLAVE_TIMEOUT = 12


@dataclass(slots=True)
class SendResult:
    """A stored message: its status, ids, the queue it went to and its offset there."""

    status: SendStatus
    msg_id: str                 # UNIQ_KEY (what Java calls msgId)
    offset_msg_id: str          # the broker's id of the stored record (encodes its commit-log offset)
    queue: MessageQueue
    queue_offset: int
    transaction_id: str | None = None
    broker_addr: str = ""       # the address that stored it: a transaction's END goes back there


_STATUS = {s.value: s for s in SendStatus}      # SendStatus(code) is an Enum call: ~0.5 us a send


class _SendTemplate:
    """The JSON header of the sends to one queue with one code and flags, pre-encoded around what changes
    per message: bornTimestamp, properties (escaped per message), the command's flag and opaque."""

    __slots__ = ("fields", "born_key", "props_key", "head", "mid", "tail")

    def __init__(self, code: int, group: str, topic: str, queue_id: int, sys_flag: int, flag: int, batch: bool):
        v2 = code != RequestCode.SEND_MESSAGE
        self.fields = SendMessageRequestHeader(
            producer_group=group, topic=topic, default_topic="TBW102", default_topic_queue_nums=4,
            queue_id=queue_id, sys_flag=sys_flag, born_timestamp=0, flag=flag, properties="",
            batch=batch).to_ext_fields(v2=v2)
        self.born_key, self.props_key = ("g", "i") if v2 else ("bornTimestamp", "properties")
        pairs = [_esc(k) + ":" + _esc(v) for k, v in self.fields.items()]
        keys = list(self.fields)
        b, p = keys.index(self.born_key), keys.index(self.props_key)     # b < p: to_ext_fields' order
        self.head = '{"code":%d,"extFields":{%s%s:"' % (code, "".join(x + "," for x in pairs[:b]), _esc(self.born_key))
        self.mid = '",%s%s:' % ("".join(x + "," for x in pairs[b + 1:p]), _esc(self.props_key))
        self.tail = '%s},"flag":' % "".join("," + x for x in pairs[p + 1:])


class _SendCommand(RemotingCommand):
    """A send request whose JSON header is written from a template. ``ext_fields`` is built only when read
    (signing, repr, tests); once built, or with anything the template does not cover, the generic encoder runs."""

    __slots__ = ("_tpl", "_born", "_props", "_ext")

    def __init__(self, code: int, tpl: _SendTemplate, born: int, props: str, body: bytes):
        self.code = code
        self.language = LanguageCode.PYTHON
        self.version = VERSION_4_9_8
        self.opaque = 0
        self.flag = 0
        self.remark = None
        self.body = body
        self.serialize_type = 0                     # SerializeType.JSON
        self._tpl = tpl
        self._born = born
        self._props = props
        self._ext = None

    @property
    def ext_fields(self) -> dict[str, str]:
        if self._ext is None:
            ext = dict(self._tpl.fields)
            ext[self._tpl.born_key] = str(self._born)
            ext[self._tpl.props_key] = self._props
            self._ext = ext
        return self._ext

    @ext_fields.setter
    def ext_fields(self, value: dict[str, str]) -> None:
        self._ext = value

    def _encode_json_header(self) -> bytes:
        if (self._ext is not None or self.remark is not None or self.language != LanguageCode.PYTHON
                or self.version != VERSION_4_9_8):
            return RemotingCommand._encode_json_header(self)
        t = self._tpl
        return (f'{t.head}{self._born}{t.mid}{_esc(self._props)}{t.tail}{self.flag},"language":"PYTHON",'
                f'"opaque":{self.opaque},"serializeTypeCurrentRPC":"JSON","version":{VERSION_4_9_8}}}').encode()


def _accepted(method):
    """A send entry point: refused (ClientClosedError, nothing sent) once shutdown has begun; accepted before, it
    is counted until it returns, and shutdown waits for it. Only requests in flight were waited for: a send still
    looking its topic's route up (a topic's first sends) went on once shutdown had closed the routes or the
    connections, and failed (CancelledError, a send stored but reported failed)."""
    @functools.wraps(method)
    async def counted(self, *args, **kwargs):
        if self._stopping:
            raise ClientClosedError(f"producer {self.group} is shutting down: send refused, not sent")
        self._sending += 1
        try:
            return await method(self, *args, **kwargs)
        finally:
            self._sending -= 1
            if not self._sending and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)
            self._sends_moved_on()
    return counted


def _client_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# A send attempt needs at least this long; the loop's timers fire to the millisecond.
_MIN_ATTEMPT_S = 0.005
# A broker that could not be connected to (refused, or its host gone: connects hang) is passed over by sends for
# this long while another broker has queues (the Java client's isolation of a broker it cannot reach).
_UNREACHABLE_S = 5.0
# Heartbeats: the first retry after a failed one (doubling up to _BEAT_RETRY_MAX_S), and the least time between two
# beats, so connections that keep breaking (a failed beat can lose one) never make a reconnect storm.
_BEAT_RETRY_S = 0.5
# The back-off while beats fail stops here: the failures are counted over all brokers, so one broker down for
# good would otherwise hold another one's beat, after its restart, back by up to heartbeat_interval_s.
_BEAT_RETRY_MAX_S = 4.0


class Producer:
    """Sends messages to the brokers that serve a topic (RocketMQ's DefaultMQProducer).

    ``namesrv_addr``: name servers, ``;``-separated. ``group``: the producer group. A send times out
    after ``send_timeout`` seconds and retriable failures are retried ``retries`` times on another
    queue. ``heartbeat_interval_s``: how often the group is announced to every known broker;
    ``route_refresh_interval_s``: how often cached routes are fetched again; ``route_forget_after_s`` (an hour;
    None: never): how long a cached route whose topic no name server knows is kept (asked again each period) before
    it is forgotten. ``batch_size`` > 1
    gathers plain sends for up to ``linger_ms`` into one batch of at most ``max_batch_bytes``.
    ``credentials`` sign every request (ACL). Use it as ``async with Producer(...) as producer``.
    """

    def __init__(self, namesrv_addr: str, group: str, *, send_timeout: float = 3.0, retries: int = 2,
                 heartbeat_interval_s: float = 30.0, instance_name: str | None = None,
                 batch_size: int = 1, linger_ms: float = 0.0, max_batch_bytes: int = 1 << 20,
                 credentials: Credentials | None = None, route_refresh_interval_s: float = 30.0,
                 route_forget_after_s: float | None = FORGET_AFTER_S):
        self.group = group
        self.route_refresh_interval_s = route_refresh_interval_s
        self.send_timeout = send_timeout
        self.retries = retries
        self.heartbeat_interval_s = heartbeat_interval_s
        ip = _client_ip()
        self.client_id = f"{ip}@{instance_name or f'{os.getpid()}#{time.monotonic_ns()}'}"
        self.pool = ConnectionPool(self._on_request, sign=credentials.sign if credentials else None)
        self.routes = RouteCache(self.pool, [a.strip() for a in namesrv_addr.split(";") if a.strip()],
                                 ttl_s=route_refresh_interval_s, timeout=send_timeout,
                                 forget_after_s=route_forget_after_s)
        self.uniq_ids = UniqIdGenerator(ip)
        self._heartbeat_task: asyncio.Task | None = None
        # Set when a connection breaks: a restarted broker knows this group again only from a heartbeat (or a
        # half message), and until then cannot ask it about its undecided transactions.
        self._beat_now = asyncio.Event()
        self.pool.on_lost = lambda addr: self._beat_now.set()
        self._route_task: asyncio.Task | None = None
        self._started = False
        # shutdown has begun: sends begun now are refused (ClientClosedError). Taken, an application still sending
        # kept the batches filling, and shutdown, flushing them until none was left, never returned.
        self._stopping = False
        self._sending = 0                                   # sends accepted (see _accepted) and not returned yet
        self._idle: asyncio.Future | None = None            # shutdown's wait for _sending to reach 0
        # Resolved (and dropped) when a send ends, for a TransactionProducer's shutdown: see _wait_for_sends
        self._sends_moved: asyncio.Future | None = None
        self._accumulator = Accumulator(self, linger_ms, batch_size, max_batch_bytes) if batch_size > 1 else None
        self._templates: dict[tuple, _SendTemplate] = {}     # (code, topic, queue id, sys_flag, flag, batch)
        self._unreachable: dict[str, tuple[str, float]] = {}   # broker name -> (its address, passed over until)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> "Producer":
        """Learn a broker, announce the group, start the heartbeat and route refresh; returns self."""
        # Learn a broker now (TBW102) so the first heartbeat registers the group at once.
        try:
            await self.routes.route("TBW102")
        except (ResponseError, RequestTimeoutError, ConnectionClosedError) as exc:
            log.warning("name server lookup of TBW102 failed: %s", exc)
        await self.heartbeat()
        loop = asyncio.get_running_loop()
        self._heartbeat_task = loop.create_task(self._heartbeat_loop())
        self._route_task = loop.create_task(self._route_loop())
        self._started = True
        return self

    async def __aenter__(self) -> "Producer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def shutting_down(self) -> bool:
        """True once ``shutdown`` has begun: new sends are refused (``ClientClosedError``); a
        ``TransactionProducer`` takes no more of the broker's checks either."""
        return self._stopping

    async def shutdown(self) -> None:
        """Refuse new sends, flush batched ones, let the sends in flight have their answers (each within its
        send_timeout), stop the background tasks, unregister from the brokers, close."""
        self._stopping = True
        if self._accumulator is not None:
            await self._accumulator.flush()
        if self._sending:       # accepted before, not yet a request in flight (its route being looked up)
            if self._idle is None or self._idle.done():     # a second shutdown meanwhile waits for the same
                self._idle = asyncio.get_running_loop().create_future()
            await self._wait_for_sends(self._idle)
        await self.pool.settle(self.send_timeout)
        for task in (self._heartbeat_task, self._route_task):
            if task is not None:
                task.cancel()
        self.routes.close()
        for addr in self.routes.all_broker_addrs():
            try:
                await self.pool.request(addr, RemotingCommand.request(RequestCode.UNREGISTER_CLIENT, {
                    "clientID": self.client_id, "producerGroup": self.group}), 1.0)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        await self.pool.close()

    async def _wait_for_sends(self, idle: asyncio.Future) -> None:
        """shutdown's wait for the sends accepted before it: until ``idle`` (each is bounded by send_timeout)."""
        await asyncio.shield(idle)

    def _sends_moved_on(self) -> None:
        """A send ended (or, in a TransactionProducer, entered its local transaction): a shutdown waiting past its
        grace looks again (TransactionProducer._wait_for_sends)."""
        if self._sends_moved is not None:
            self._sends_moved.set_result(None)
            self._sends_moved = None

    def _heartbeat_body(self) -> bytes:
        return json.dumps({"clientID": self.client_id, "consumerDataSet": [],
                           "producerDataSet": [{"groupName": self.group}]}).encode()

    async def heartbeat(self) -> bool:
        """Announce the group to every known broker now; True if every one accepted it (failures and
        refusals, such as SYSTEM_BUSY past a broker's max_groups_per_host, are logged; the next beat retries)."""
        ok = True
        for addr in self.routes.all_broker_addrs():
            try:
                resp = await self.pool.request(addr, RemotingCommand.request(RequestCode.HEART_BEAT,
                                                                             body=self._heartbeat_body()), 3.0)
            except Exception as exc:  # noqa: BLE001 - the next beat retries
                log.info("heartbeat to %s failed: %s", addr, exc)
                ok = False
                continue
            if resp.code != ResponseCode.SUCCESS:     # e.g. SYSTEM_BUSY past a broker's max_groups_per_host
                log.warning("heartbeat to %s refused: code %d %s", addr, resp.code, resp.remark)
                ok = False
        return ok

    async def _heartbeat_loop(self) -> None:
        """A beat every heartbeat_interval_s; one soon (0.5 s at most after the last) when a connection breaks,
        and while beats fail, one after a back-off from 0.5 s doubling up to 4 s (each spread at random over its
        second half, ``jittered``: clients that failed together retry apart): a broker restarted
        knows this group (and can check its undecided transactions) within about a second of being back, not
        up to 30 s later."""
        retry: float | None = None
        while True:
            if retry is None:
                try:
                    await wait_within(self._beat_now.wait(), self.heartbeat_interval_s)
                except asyncio.TimeoutError:
                    pass
            else:       # a broker that fails beats is not tried sooner, connections lost meanwhile or not
                await asyncio.sleep(jittered(retry))
            self._beat_now.clear()
            if await self.heartbeat():
                retry = None
                await asyncio.sleep(min(_BEAT_RETRY_S, self.heartbeat_interval_s))
            else:
                retry = min(self.heartbeat_interval_s, _BEAT_RETRY_MAX_S, _BEAT_RETRY_S if retry is None else retry * 2)

    async def _route_loop(self) -> None:
        """Fetch every cached route again each period: failovers and new brokers are seen without a
        send having to fail first (and off the send path)."""
        while True:
            await asyncio.sleep(self.route_refresh_interval_s)
            await self.routes.refresh_all()

    def _on_request(self, conn, cmd):
        return None if cmd.is_oneway else cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                                      f"producer does not serve request {cmd.code}")

    # ---------------------------------------------------------------- sends
    def message_properties(self, tags: str | None = None, keys: str | list[str] | None = None,
                           properties: dict[str, str] | None = None) -> dict[str, str]:
        """The properties a message is sent with: yours, TAGS, KEYS (space-joined), a new UNIQ_KEY, WAIT."""
        props = dict(properties or {})
        if tags:
            props[Prop.TAGS] = tags
        if keys:
            props[Prop.KEYS] = keys if isinstance(keys, str) else " ".join(keys)
        props.setdefault(Prop.UNIQ_KEY, self.uniq_ids.next())
        props.setdefault(Prop.WAIT, "true")
        return props

    def _command(self, code: int, mq: MessageQueue, props: str, body: bytes, sys_flag: int = 0, flag: int = 0,
                 batch: bool = False) -> RemotingCommand:
        """The send request to ``mq``, its header from the template of (code, topic, queue, flags)."""
        key = (code, mq.topic, mq.queue_id, sys_flag, flag, batch)
        tpl = self._templates.get(key)
        if tpl is None:
            if len(self._templates) >= 4096:
                self._templates.clear()
            tpl = self._templates[key] = _SendTemplate(code, self.group, mq.topic, mq.queue_id, sys_flag, flag, batch)
        return _SendCommand(code, tpl, int(time.time() * 1000), props, body)

    async def send(self, topic: str, body: bytes, *, tags: str | None = None, keys: str | list[str] | None = None,
                   properties: dict[str, str] | None = None, queue: MessageQueue | None = None,
                   flag: int = 0, delay_level: int = 0, deliver_at_ms: int | None = None) -> SendResult:
        """Send one message and wait until the broker stored it.

        ``tags`` (one tag consumers filter on), ``keys`` (searchable keys), ``properties`` (user
        properties). ``queue`` pins the queue (no retry elsewhere). ``delay_level`` n > 0: delivered
        after the broker's n-th delay level (1 s, 5 s, 10 s, ... by default); ``deliver_at_ms``:
        delivered at that wall-clock time (RocketMQ 5's TIMER_DELIVER_MS, up to the broker's
        timer_max_delay_s ahead). A refusal raises the ``ResponseError`` of its code; timeouts raise
        ``RequestTimeoutError``; a send begun once ``shutdown`` has, ``ClientClosedError``.
        """
        # what _accepted does, written out: this is the hot path, and the wrapper's extra coroutine cost ~0.5 us
        if self._stopping:
            raise ClientClosedError(f"producer {self.group} is shutting down: send refused, not sent")
        self._sending += 1
        try:
            if properties:
                props = self.message_properties(tags, keys, properties)
                if delay_level:
                    props[Prop.DELAY] = str(delay_level)
                if deliver_at_ms is not None:
                    props["TIMER_DELIVER_MS"] = str(deliver_at_ms)
                waits = Prop.DELAY in props or not props.keys().isdisjoint(_TIMER_PROPS)
                uniq = props.get(Prop.UNIQ_KEY, "")
                if self._accumulator is not None and queue is None and flag == 0 and not waits:
                    return await self._accumulator.add(
                        topic, body, properties_to_string({k: v for k, v in props.items() if k != Prop.WAIT}), uniq)
                return await self._send_text(RequestCode.SEND_MESSAGE_V2, topic, body, properties_to_string(props),
                                             uniq, queue, flag=flag)
            # No user properties: the string message_properties + properties_to_string would give, written directly
            # (TAGS, KEYS, UNIQ_KEY, WAIT, then DELAY and TIMER_DELIVER_MS).
            uniq = self.uniq_ids.next()
            text = "UNIQ_KEY\x01" + uniq
            if keys:
                text = "KEYS\x01" + (keys if isinstance(keys, str) else " ".join(keys)) + "\x02" + text
            if tags:
                text = "TAGS\x01" + tags + "\x02" + text
            if (self._accumulator is not None and queue is None and flag == 0 and not delay_level
                    and deliver_at_ms is None):
                return await self._accumulator.add(topic, body, text, uniq)      # a batch entry carries no WAIT
            text += "\x02WAIT\x01true"
            if delay_level:
                text += "\x02DELAY\x01" + str(delay_level)
            if deliver_at_ms is not None:
                text += "\x02TIMER_DELIVER_MS\x01" + str(deliver_at_ms)
            return await self._send_text(RequestCode.SEND_MESSAGE_V2, topic, body, text, uniq, queue, flag=flag)
        finally:
            self._sending -= 1
            if not self._sending and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)
            self._sends_moved_on()

    @_accepted
    async def send_batch(self, topic: str, bodies: list[bytes], *, tags: str | None = None,
                         queue: MessageQueue | None = None, uniq_keys: list[str] | None = None) -> SendResult:
        """Send ``bodies`` as one SEND_BATCH_MESSAGE to one queue; stored together, in order.

        ``uniq_keys``: the messages' UNIQ_KEYs, one a body (new ones by default). A batch whose send raised
        MaybeStoredError is sent again under its own (``exc.msg_id.split(",")``), so that a consumer can tell the
        copies apart from new messages; without them the batch could only be sent again under new keys, each
        message then consumed twice whatever the consumer dedupes by."""
        if uniq_keys is not None and (len(uniq_keys) != len(bodies) or not all(
                type(k) is str and k and "," not in k and not separator_in(k) for k in uniq_keys)):
            # (a separator stored the key as more pairs, a property smuggled into the batch, and the msg_id returned
            # was no key a consumer sees)
            raise ValueError(f"uniq_keys: one str key a body ({len(bodies)}), none empty or holding ',' (the batch's "
                             f"msg_id joins them with it), U+0001, U+0002 or NUL (properties separators); "
                             f"got {uniq_keys!r:.200}")
        entries, uniqs = [], []
        for i, body in enumerate(bodies):
            props = self.message_properties(tags, properties=None if uniq_keys is None
                                            else {Prop.UNIQ_KEY: uniq_keys[i]})
            props.pop(Prop.WAIT, None)
            uniqs.append(props[Prop.UNIQ_KEY])
            entries.append((0, body, properties_to_string(props)))
        # msg_id: the messages' UNIQ_KEYs, comma-joined, as the Java client's batch SendResult says it
        return await self._send_text(RequestCode.SEND_BATCH_MESSAGE, topic, encode_batch(entries), "WAIT\x01true",
                                     ",".join(uniqs), queue, batch=True)

    @_accepted
    async def send_oneway(self, topic: str, body: bytes, *, tags: str | None = None,
                          keys: str | list[str] | None = None, properties: dict[str, str] | None = None) -> None:
        """Send without waiting for the broker (no result, no retry: it may be lost)."""
        props = self.message_properties(tags, keys, properties)
        queues = await self.routes.publish_queues(topic)
        mq = self.routes.select(queues)
        cmd = self._command(RequestCode.SEND_MESSAGE_V2, mq, properties_to_string(props), body)
        await self.pool.oneway(self._addr(mq), cmd)

    def _addr(self, mq: MessageQueue) -> str:
        addr = self.routes.broker_addr(mq.broker_name)
        if addr is None:
            raise error_for_code(ResponseCode.TOPIC_NOT_EXIST, f"no address for broker {mq.broker_name}")
        return addr

    async def _connect(self, addr: str, limit: float):
        """The pool's connection to ``addr``, waited for ``limit`` s at most (the connect goes on for others)."""
        try:
            return await wait_within(self.pool.get(addr), limit)
        except TimeoutError as exc:
            if isinstance(exc, RequestTimeoutError):
                raise
            raise RequestTimeoutError(f"connecting to {addr}: no connection within {limit:.3g} s") from None

    def _passed_over(self) -> set[str]:
        """Brokers whose connect failed lately, at the address the route still gives them."""
        now = time.monotonic()
        for name, (addr, until) in list(self._unreachable.items()):
            if until <= now or self.routes.broker_addr(name) != addr:
                del self._unreachable[name]
        return set(self._unreachable)

    @_accepted
    async def _send(self, code, topic, body, props, queue, *, sys_flag=0, flag=0, batch=False) -> SendResult:
        """Send with properties given as a dict (the transaction producer's half)."""
        return await self._send_text(code, topic, body, properties_to_string(props), props.get(Prop.UNIQ_KEY, ""),
                                     queue, sys_flag=sys_flag, flag=flag, batch=batch)

    async def _send_text(self, code, topic, body, props: str, uniq: str, queue, *, sys_flag=0, flag=0,
                         batch=False) -> SendResult:
        """Send with the properties string ``props`` (whose UNIQ_KEY is ``uniq``), retrying elsewhere.

        An attempt sent and not answered (its connection closed, or time ran out) may have been stored: if no
        later attempt succeeds, the send raises MaybeStoredError, whatever those attempts met (a broker killed
        just after storing leaves "cannot connect" and "no route" to its retries, which read as "not sent")."""
        avoid = None
        refresh = False                 # after a routing error the next attempt asks the name server
        last_error: Exception | None = None
        unanswered: Exception | None = None     # the first attempt sent and not answered
        routes = self.routes
        timeout = self.send_timeout
        started = time.monotonic()
        try:
            for attempt in range(self.retries + 1):
                if attempt:     # send_timeout bounds the whole send, retries included (as the Java client's)
                    timeout = self.send_timeout - (time.monotonic() - started)
                    if timeout < _MIN_ATTEMPT_S:    # (a timer may fire a little early: less is no attempt)
                        raise RequestTimeoutError(f"send to {topic} timed out after {self.send_timeout:g} s and "
                                                  f"{attempt} attempt(s); the last failed with: {last_error}") from last_error
                if queue is not None:
                    mq = queue
                    if refresh:
                        await routes.publish_queues(topic, refresh=True)
                else:
                    queues = None if refresh else routes.cached_publish_queues(topic)
                    if queues is None:
                        queues = await routes.publish_queues(topic, refresh=refresh)
                    mq = routes.select(queues, avoid, self._passed_over() if self._unreachable else ())
                cmd = self._command(code, mq, props, body, sys_flag, flag, batch)
                addr = sent = None
                try:
                    addr = self._addr(mq)
                    # a connect that hangs (the host gone) leaves half the time to an attempt elsewhere
                    conn = self.pool.cached(addr) or await self._connect(
                        addr, timeout if attempt == self.retries else timeout / 2)
                    # the connection's future, awaited here: no coroutine per layer, no timer per request
                    sent = conn.start_request(cmd, timeout)
                    resp = await sent
                except (RequestTimeoutError, ConnectionClosedError, TopicNotExistError) as exc:
                    if sent is not None:
                        unanswered = unanswered or exc
                    elif addr is not None and not isinstance(exc, TopicNotExistError):
                        self._unreachable[mq.broker_name] = (addr, time.monotonic() + _UNREACHABLE_S)
                    last_error = exc
                    avoid = mq.broker_name
                    refresh = True
                    continue
                if resp.code in _STORED:
                    if self._unreachable:
                        self._unreachable.pop(mq.broker_name, None)
                    ext = resp.ext_fields
                    return SendResult(_STATUS[resp.code], uniq, ext.get("msgId") or "",
                                      MessageQueue(topic, mq.broker_name, resp.int_field("queueId", mq.queue_id)),
                                      resp.int_field("queueOffset", -1), ext.get("transactionId") or None, addr)
                error = error_for_code(resp.code, resp.remark)
                if not error.retriable or queue is not None:
                    if resp.code == ResponseCode.TOPIC_NOT_EXIST:
                        self.routes.forget(topic)       # the route was wrong: the next send asks again
                    raise error
                last_error = error
                avoid = mq.broker_name
                refresh = True
            assert last_error is not None
            raise last_error
        except Exception as exc:
            if isinstance(exc.__cause__ if isinstance(exc, RequestTimeoutError) else exc, TopicNotExistError):
                # a topic no broker has: its route (TBW102's, taken for a topic not created yet) is not kept,
                # else every name ever mistyped was refreshed from the name server each period for good
                self.routes.forget(topic)
            else:
                # TBW102's route taken for a topic not created yet, and the send failed: refused past
                # max_topics_per_host (NO_PERMISSION), no writable queue (write perm wiped, read-only brokers).
                # Kept, refresh_all asked the name server for that name each period for good.
                self.routes.forget_default(topic)
            if unanswered is None:
                raise
            maybe = f"the message may have been stored, as {uniq or 'its UNIQ_KEY'}"
            if exc is unanswered or exc.__cause__ is unanswered:    # the last attempt's, or the deadline after it
                text = f"{exc if exc.__cause__ is unanswered else f'send to {topic}: {exc}'}: {maybe}"
            else:
                text = (f"send to {topic} failed, but an attempt sent got no answer ({unanswered}): {maybe}; "
                        f"the last attempt failed with: {exc}")
            # what the last attempt met was raised before: a caller catching a closed connection still catches it
            cls = MaybeStoredClosedError if isinstance(exc, ConnectionClosedError) else MaybeStoredError
            raise cls(text, msg_id=uniq) from exc
