"""Who is connected: producer and consumer groups, subscriptions, liveness (RocketMQ's client managers).

A channel is one client connection in one group. Channels come from
HEART_BEAT, and, unlike RocketMQ, also from a transactional send: a producer
that has sent a half message can be asked about it even before its first
heartbeat (ali-ons sends none for 30 s). A closed connection leaves every
group at once; a silent one after ``channel_expire_ms``.
"""
from __future__ import annotations

import json
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from protocol.codes import LanguageCode, RequestCode
from protocol.command import RemotingCommand
from protocol.errors import HeaderError
from protocol.message import (JAVA_TRIMMED, MAX_CLIENT_ID_LENGTH, Prop, java_string_hash, text_encodes,
                              validate_group)

from .limits import EveryKey, count_down, peer_host
from .sql92 import MAX_LENGTH as MAX_EXPRESSION_LENGTH
from .sql92 import Selector, SelectorError, compile_cached
from .topics import RETRY_PREFIX

log = logging.getLogger("txmq.clients")
# Groups a heartbeat registers (or checks) between two turns of the loop: a heartbeat may name 10,000 groups
# (max_groups_per_host; 2 MB), 0.3 s of work that held every other client when done in one go.
HEARTBEAT_SLICE = 500
# ... or fewer, when they hold this many subscriptions, tags and codes between them: a group may name hundreds of
# thousands (a 15 MB heartbeat of one group of 3 million tags held the loop 3.3 s, slices or not). At 20,000 a
# slice of a stock client's 4 MB heartbeat (25,000 subscriptions) held it 0.56-0.9 s on a loaded host; 0.12-0.19 s.
HEARTBEAT_SLICE_ITEMS = 2_000
NOTICE_GAP_S = 0.5      # a consumer group's NOTIFY_CONSUMER_IDS_CHANGED: the least time between two


@dataclass
class Channel:
    conn: object                     # protocol.connection.RemotingConnection
    client_id: str
    language: int = 0
    version: int = 0
    last_seen_ms: int = 0
    seq: int = 0                     # the order its connection joined the group in (producers: ClientRegistry._joins)
    # a consumer's: the topics its last heartbeat subscribed to; None when it named none (a pull consumer, which
    # may pull and commit any topic). See ClientRegistry.reads_elsewhere.
    topics: frozenset | None = None
    # a consumer's: its last heartbeat's messageModel was BROADCASTING (it never reads %RETRY%<group>)
    broadcasting: bool = False

    @property
    def alive(self) -> bool:
        return getattr(self.conn, "is_open", False)


@dataclass
class Subscription:
    topic: str
    sub_string: str = "*"
    tags: frozenset = frozenset()
    codes: frozenset = frozenset()
    sub_version: int = 0
    expression_type: str = "TAG"
    selector: Selector | None = None     # SQL92: the parsed expression (RocketMQ's ConsumerFilterData)
    filter_error: str | None = None      # not a TAG subscription, and why it has no selector
    text_bytes: int = 0                  # its heartbeat entry's text, as max_subscription_bytes counts it

    @property
    def matches_all(self) -> bool:
        return self.sub_string in ("", "*") or not self.codes

    def tag_filter(self):
        """A predicate on consume-queue tag codes, or None for everything."""
        if self.matches_all:
            return None
        codes = self.codes
        return lambda code: code in codes


def is_tag_type(expression_type: str | None) -> bool:
    """ExpressionType.isTagType: no type at all is TAG too."""
    return expression_type in (None, "", "TAG")


def build_subscription(topic: str, expression: str | None, sub_version: int = 0,
                       expression_type: str = "TAG") -> Subscription:
    """A TAG subscription from an expression like 'TagA || TagB' (FilterAPI.buildSubscriptionData); an SQL92 one
    with its parsed selector, or with ``filter_error`` saying why it does not parse (as any other type)."""
    if not is_tag_type(expression_type):
        try:
            if expression_type != "SQL92":
                raise SelectorError(f"expression type {expression_type} is not supported (TAG or SQL92)")
            return Subscription(topic, expression, sub_version=sub_version, expression_type=expression_type,
                                selector=compile_cached(expression))
        except SelectorError as exc:
            return Subscription(topic, expression, sub_version=sub_version, expression_type=expression_type,
                                filter_error=str(exc))
    # FilterAPI.buildSubscriptionData: "*" and "" alone are every message; " * " is the tag "*" (its hash 42).
    if expression is None or expression in ("", "*"):
        return Subscription(topic, "*", sub_version=sub_version, expression_type=expression_type)
    if len(expression) > MAX_EXPRESSION_LENGTH:
        # As an SQL92 one (sql92.MAX_LENGTH): a pull carrying its expression has it parsed and every tag hashed
        # (a Python loop a character) on the loop, at every pull. 200 pulls of a 253 KiB one, pipelined, held
        # the loop 14.8 s and another client's request up to 4.8 s, where the same headers without it took
        # 0.25 s. A stock push consumer's heartbeat gives its tags and codes, not this.
        return Subscription(topic, expression, sub_version=sub_version, expression_type=expression_type,
                            filter_error=f"the TAG expression is {len(expression)} characters long, more than "
                                         f"{MAX_EXPRESSION_LENGTH}")
    # Each tag as Java's trim leaves it (str.strip also took U+3000, U+00A0: a tag's own end, its hash another's).
    # Inline, spaces first (every lite pull builds this): the control chars only when an end still has one.
    tags = []
    for tag in expression.split("||"):
        tag = tag.strip(" ")
        if tag and (tag[0] < " " or tag[-1] < " "):
            tag = tag.strip(JAVA_TRIMMED)
        if tag:
            tags.append(tag)
    if not tags:
        # "||" is FilterAPI's "subString split error" (SUBSCRIPTION_PARSE_FAILED); " " or " || " parse there to no
        # tag, which 4.9.8's broker then matches no message with, each pull's offset moved past them unsaid. Ours
        # took either as "*" and gave every message. Both are refused (handle_pull) and nothing is passed over.
        return Subscription(topic, expression, sub_version=sub_version, expression_type=expression_type,
                            filter_error=f"the TAG expression {expression[:200]!r} names no tag")
    tags = frozenset(tags)
    return Subscription(topic, expression, tags, frozenset(java_string_hash(t) for t in tags), sub_version,
                        expression_type)


# Java enums by ordinal: rocketmq-client-cpp 1.x sends them as numbers ("messageModel":0 is BROADCASTING), as
# fastjson reads them. Taken as they came, 0 fell back to the defaults: a C++ broadcasting consumer was listed
# as CLUSTERING and a C++ pull consumer as CONSUME_PASSIVELY (GET_CONSUMER_CONNECTION_LIST).
_CONSUME_TYPES = ("CONSUME_ACTIVELY", "CONSUME_PASSIVELY")
_MESSAGE_MODELS = ("BROADCASTING", "CLUSTERING")
_CONSUME_FROM = ("CONSUME_FROM_LAST_OFFSET", "CONSUME_FROM_LAST_OFFSET_AND_FROM_MIN_WHEN_BOOT_FIRST",
                 "CONSUME_FROM_MIN_OFFSET", "CONSUME_FROM_MAX_OFFSET", "CONSUME_FROM_FIRST_OFFSET",
                 "CONSUME_FROM_TIMESTAMP")


def _enum(value, names: tuple, default: str) -> str:
    """A heartbeat's enum field: its name, or its ordinal as a number (or a numeric string); else ``default``."""
    if value is None or value == "" or isinstance(value, bool):
        return default
    if isinstance(value, str) and not value.lstrip("-").isdigit():
        return value
    try:
        ordinal = int(value)
    except (ValueError, TypeError, OverflowError):
        return default
    return names[ordinal] if 0 <= ordinal < len(names) else default


# Producer groups remembered as left (UNREGISTER_CLIENT) per open connection.
_LEFT_MAX = 1024

# Requests (request-reply) remembered with the connection each came on, the newest this many, each until the time
# its requester waits (TTL, at most _REQUEST_TTL_MAX_MS) is over; correlation ids longer than _CORRELATION_MAX (a
# stock client's is a UUID) are not remembered: a client sets them, in properties of up to 32 KiB.
_REQUESTS_MAX = 65536
_REQUEST_TTL_MAX_MS = 3600 * 1000
_REQUEST_TTL_DEFAULT_MS = 3000          # a Java producer's request() default timeout
_CORRELATION_MAX = 128


@dataclass
class ConsumerGroup:
    name: str
    channels: dict = field(default_factory=dict)        # conn -> Channel
    subscriptions: dict = field(default_factory=dict)   # topic -> Subscription
    consume_type: str = "CONSUME_PASSIVELY"
    message_model: str = "CLUSTERING"
    consume_from_where: str = "CONSUME_FROM_LAST_OFFSET"
    # the remote address whose heartbeat last set the subscriptions, charged their text (_subscription_bytes)
    # under max_subscription_bytes_per_host until another's sets them or nobody is in the group
    sub_host: str | None = None
    sub_bytes: int = 0


class _Slices:
    """When heartbeat work should let the loop run: before a group once HEARTBEAT_SLICE groups, or
    HEARTBEAT_SLICE_ITEMS of their subscriptions, tags and codes, were done since the last time."""
    __slots__ = ("groups", "items")

    def __init__(self):
        self.groups = self.items = 0

    def due(self, items: int) -> bool:
        self.groups += 1
        self.items += items
        if self.groups < HEARTBEAT_SLICE and self.items < HEARTBEAT_SLICE_ITEMS:
            return False
        self.groups, self.items = 1, items
        return True


# ... and an expression (subString) this many characters an item: an SQL92 one is parsed when registered, a TAG one
# split into tags and hashed, some 1 us a character. Counted one item whatever it held, a 3.9 MB heartbeat of 240
# SQL92 expressions of 16,300 characters was one slice: 4.4 s on the loop in one go.
EXPRESSION_CHARS_PER_ITEM = 64


def _raw_items(consumer: dict, limit: int) -> int:
    """The subscriptions, tags and codes a consumer entry names, and its expressions' characters by
    EXPRESSION_CHARS_PER_ITEM, untyped, or ``limit`` + 1 once past ``limit``: each is at least a byte of
    _subscription_bytes, so an entry past max_subscription_bytes by this count is refused without typing its parts
    (3 million tags took a second to type and weigh, only to be refused)."""
    subs = consumer.get("subscriptionDataSet")
    if not isinstance(subs, list):
        return 0
    items = len(subs)
    for s in subs:
        if items > limit:
            break
        if isinstance(s, dict):
            items += sum(len(v) for v in (s.get("tagsSet"), s.get("codeSet")) if isinstance(v, list))
            expression = s.get("subString")
            if isinstance(expression, str):
                items += len(expression) // EXPRESSION_CHARS_PER_ITEM
    return min(items, limit + 1)


def typed_heartbeat(data) -> tuple[str | None, list[str], list[dict]]:
    """(clientID, producer groups, consumer entries) of a HEART_BEAT body, typed as RocketMQ's HeartbeatData
    (fastjson) types them: a number or boolean where a name belongs is its text, a subVersion or code may be
    a numeric string; a list or object there, or a group name or clientID past its length (validate_group),
    fails the whole heartbeat (HeaderError) before anything is registered. Untyped, a group named by the number 7 was registered as the int 7: the metrics page answered
    HTTP 500 and group listings failed for as long as that connection stayed. Entries that are not objects,
    or name no group, are passed over as before."""
    return _run(typed_heartbeat_steps(data))


def typed_heartbeat_steps(data, max_subscription_bytes: int = 1 << 62):
    """typed_heartbeat as a generator: it yields between slices of consumer entries (_Slices: a caller on the loop
    lets other clients in there) and returns what typed_heartbeat does. An entry naming more subscriptions, tags
    and codes than ``max_subscription_bytes`` is left untyped, its subscriptionDataSet None: it is refused."""
    if not isinstance(data, dict):
        raise HeaderError("heartbeat body is not a JSON object")
    producers = [_text(p.get("groupName"), "producer groupName") for p in _objects(data, "producerDataSet")]
    consumers = []
    slices = _Slices()
    for c in _objects(data, "consumerDataSet"):
        items = _raw_items(c, max_subscription_bytes)
        if slices.due(items):
            yield
        entry = {key: _text(c.get(key), key) for key in ("groupName", "consumeType", "messageModel",
                                                          "consumeFromWhere")}
        if not entry["groupName"]:
            continue
        entry["items"] = items
        if items > max_subscription_bytes:
            entry["subscriptionDataSet"] = None
            consumers.append(entry)
            continue
        entry["subscriptionDataSet"] = [{
            "topic": _text(s.get("topic"), "subscription topic"),
            "subString": _text(s.get("subString"), "subString"),
            "expressionType": _text(s.get("expressionType"), "expressionType"),
            "subVersion": _integer(s.get("subVersion"), "subVersion"),
            "tagsSet": [_text(t, "tag") for t in _list(s.get("tagsSet"), "tagsSet")],
            "codeSet": [_integer(n, "code") for n in _list(s.get("codeSet"), "codeSet")],
        } for s in _objects(c, "subscriptionDataSet")]
        consumers.append(entry)
    client_id = _text(data.get("clientID"), "clientID")
    if client_id is not None and len(client_id) > MAX_CLIENT_ID_LENGTH:
        raise HeaderError(f"heartbeat clientID is {len(client_id)} characters, longer than {MAX_CLIENT_ID_LENGTH}")
    if client_id is not None and not text_encodes(client_id):
        raise HeaderError(f"heartbeat clientID {client_id!r} is not UTF-8 text (it holds a lone surrogate)")
    for n, group in enumerate(producers + [c["groupName"] for c in consumers], 1):
        if not n % HEARTBEAT_SLICE:
            yield
        why = validate_group(group)
        if why is not None:
            raise HeaderError(f"heartbeat {why}")
    return client_id, [g for g in producers if g], consumers


def _run(steps):
    """What a generator of steps returns, run through at once."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


def _subscription_bytes(consumer: dict) -> int:
    """The text a typed consumer entry's subscriptions hold (codes at 8 bytes, each subscription and tag at least
    one: _raw_items): what the group would keep. An entry left untyped for its size is past any limit."""
    subs = consumer["subscriptionDataSet"]
    if subs is None:
        return 1 << 62
    return sum(map(_entry_bytes, subs))


def _entry_bytes(s: dict) -> int:
    return (max(1, len(s["topic"] or "") + len(s["subString"] or "") + len(s["expressionType"] or ""))
            + sum(max(1, len(t or "")) for t in s["tagsSet"]) + 8 * len(s["codeSet"]))


def _held_bytes(group) -> int:
    """The text ``group``'s subscriptions hold, as their heartbeats weighed it."""
    return sum(s.text_bytes for s in group.subscriptions.values())


def _kept_bytes(group, consumer: dict, size: int) -> int:
    """``size``, the text of a typed consumer entry's subscriptions, with each one ``group`` keeps in its place for
    its newer subVersion (_register_consumer) weighed as kept: charged the heartbeat's text, one address set a
    group's expressions big at a far-future subVersion, sent them "*" at subVersion 1 (kept big, charged 5 bytes)
    and went on to the next group, none of it within max_subscription_bytes_per_host. A kept one weighs what the
    heartbeat that set it did (Subscription.text_bytes)."""
    kept = group.subscriptions if group is not None else None
    if not kept or not consumer["subscriptionDataSet"]:
        return size
    if not any(s["topic"] for s in consumer["subscriptionDataSet"]):
        return _held_bytes(group)       # kept as they are, all of them (_register_consumer)
    for s in consumer["subscriptionDataSet"]:
        old = kept.get(s["topic"]) if s["topic"] else None
        if old is not None and old.sub_version > (s["subVersion"] or 0):
            size += old.text_bytes - _entry_bytes(s)
    return size


def _list(value, what: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise HeaderError(f"heartbeat {what} is a {type(value).__name__}, not a list")
    return value


def _objects(data: dict, key: str) -> list[dict]:
    return [v for v in _list(data.get(key), key) if isinstance(v, dict)]


def _text(value, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    raise HeaderError(f"heartbeat {what} is a {type(value).__name__}, not text")


def _integer(value, what: str) -> int:
    if value is None or value == "":
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise HeaderError(f"heartbeat {what}={value!r} is not an integer")
    try:
        number = int(value)
    except ValueError:
        raise HeaderError(f"heartbeat {what}={value!r} is not an integer") from None
    if not -(1 << 63) <= number < (1 << 63):
        raise HeaderError(f"heartbeat {what}={value!r} is out of range")
    return number


class _Restored:
    """The "connection" of a lock restored from a previous run: none (no peer, never open)."""

    peer = None
    is_open = False


RESTORED = _Restored()


class ClientRegistry:
    def __init__(self, clock, max_groups_per_host: int = 1 << 30, max_subscription_bytes: int = 1 << 62,
                 max_subscription_bytes_per_host: int = 1 << 62):
        self.clock = clock
        # A consumer group's subscriptions as a heartbeat gave them (topics, expressions, tags), in bytes of text,
        # at most this: each group kept what its last heartbeat said, so one frame (16 MiB) a group.
        self.max_subscription_bytes = max_subscription_bytes
        # ... and all the groups whose subscriptions one remote address's heartbeats set, at most this: a group's
        # are kept as up to some 40 times their text (256 KiB of 37,000 topics: 10 MB), and one address
        # heartbeating groups at the limit above, up to max_groups_per_host of them, could make the broker keep
        # 80 GB. Each group is charged what it holds (_held_bytes), not what the last heartbeat said.
        self.max_subscription_bytes_per_host = max_subscription_bytes_per_host
        self._sub_bytes_by_host: dict[str, int] = {}
        # Group registrations (a connection in a producer or consumer group) from one remote address, at most
        # max_groups_per_host: group names cost a client nothing, and one connection heartbeating made-up names
        # grew the broker by some 40 MB a second for as long as it went on.
        self.max_groups_per_host = max_groups_per_host
        self._groups_by_host: dict[str, int] = {}
        self.producers: dict[str, dict] = {}      # group -> {conn: Channel}
        self.consumers: dict[str, ConsumerGroup] = {}
        # connection -> the producer / consumer groups it is in: a close costs its own groups, not a walk of every
        # group (20,000 groups: 9 ms a close on the loop, seconds for a reconnect storm)
        self._producing: dict[object, set[str]] = {}
        self._consuming: dict[object, set[str]] = {}
        self.on_new_retry_group = None            # callback(group, first heartbeat, conn) -> makes sure of %RETRY%group
        self.on_new_producer = None               # callback(group): a producer of it registered on a connection
        self.on_stale_subscription = None         # callback(group): a changed subscription kept out (_stale_subscription)
        self._stale_said = EveryKey(60.0, total=10)
        # NOTIFY_CONSUMER_IDS_CHANGED at most once per NOTICE_GAP_S a group (see notify_ids_changed) when set:
        # call_later(seconds, fn, *args) (the loop's); unset (no loop), every change is told at once.
        self.call_later = None
        self.on_notice_merged = None              # callback(): a change told with the notice at its gap's end
        self._told: dict[str, bool] = {}          # group told within NOTICE_GAP_S -> whether a change came since
        # (group, topic, queue id) -> (client id, ms of the last grant, connection it came on). No broker name:
        # every queue here is this broker's, and a name the client wrote must not make one queue many locks.
        self.locks: dict[tuple, tuple[str, int, object]] = {}
        self._locks_by_conn: dict[object, int] = {}   # connection -> locks it holds (max_queue_locks_per_connection)
        self._locks_by_host: dict[str, int] = {}      # remote address -> locks its connections hold (..._per_host)
        # conn -> producer groups it sent UNREGISTER_CLIENT for while staying open (a Java process shares one
        # connection between all its producers and consumers): no longer asked about those groups' halves.
        # In the order they were left (a dict as an ordered set), at most _LEFT_MAX a connection.
        self._left: dict[object, dict[str, None]] = {}
        # callback(conn, frozenset of groups): dropped from them for silence, the connection open (once a connection
        # an expiry: told group by group, each call walked every check the connection held)
        self.on_producer_left = None
        self._locks_swept = clock()
        self.lock_holders_changed = 0             # bumped when a queue's lock holder changes (queue_locks.py saves)
        self._joins = 0                           # producer registrations ever made: each Channel's seq
        # correlation id -> (weak reference to the connection its request came on, ms its requester stops waiting),
        # oldest first. An OrderedDict: the oldest is dropped at each send at the cap, and a plain dict's first key
        # is found by skipping every entry deleted since its last resize (tens of thousands at the cap).
        self._requests: OrderedDict[str, tuple[object, int]] = OrderedDict()

    # ------------------------------------------------------------ heartbeat
    def heartbeat(self, conn, cmd: RemotingCommand) -> tuple[list[str], int, list[str], list[str]]:
        """Register what a HEART_BEAT body says; returns the consumer groups whose membership changed, how
        many groups were not joined for max_groups_per_host (the groups it is in already are renewed all the
        same: a client at the limit keeps what it has), the consumer groups whose subscriptions were past
        max_subscription_bytes, and those whose subscriptions would have put the address past
        max_subscription_bytes_per_host (neither joined nor changed; a member stays one)."""
        return _run(self.heartbeat_steps(conn, cmd))

    def heartbeat_steps(self, conn, cmd: RemotingCommand):
        """heartbeat as a generator that yields after each HEARTBEAT_SLICE groups. A caller that lets the loop run
        there must stop when ``conn`` has closed meanwhile (its groups were left then; registered after, they
        stayed for channel_expire_ms)."""
        try:
            data = json.loads(cmd.body_bytes() or b"{}")
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise HeaderError(f"heartbeat body is not JSON: {exc}") from None
        # all checked before anything registers
        client_id, producers, consumers = yield from typed_heartbeat_steps(data, self.max_subscription_bytes)
        client_id = client_id or f"{conn.peer[0]}@{conn.peer[1]}"
        now = self.clock()
        changed = []
        refused = 0
        oversized = []
        crowded = []        # past max_subscription_bytes_per_host
        host = peer_host(conn)
        for n, group in enumerate(producers, 1):
            if not n % HEARTBEAT_SLICE:
                yield
            if not self.add_producer(group, conn, client_id, cmd.language, cmd.version, now):
                refused += 1
        slices = _Slices()
        for consumer in consumers:
            if slices.due(consumer["items"]):
                yield
            group = self.consumers.get(consumer["groupName"])
            member = group is not None and group.channels.get(conn)
            size = _subscription_bytes(consumer)
            if size <= self.max_subscription_bytes:
                size = _kept_bytes(group, consumer, size)      # what the group will hold, weighed as that
            if size > self.max_subscription_bytes:
                past = oversized
            else:
                past = None if self._subscription_room(host, group, consumer, size) else crowded
            if past is not None:
                past.append(consumer["groupName"])
                if member:
                    member.last_seen_ms = now
                continue
            if not member and not self._room(conn):
                refused += 1
                continue
            if self._register_consumer(conn, client_id, cmd, consumer, now):
                changed.append(consumer["groupName"])
            if consumer["subscriptionDataSet"]:     # (none named: the group keeps its own, charged as they were)
                group = self.consumers[consumer["groupName"]]
                self._charge(group, host, _held_bytes(group))     # what it holds: a topic named twice once
        conn.attributes["client_id"] = client_id
        return changed, refused, oversized, crowded

    def _subscription_room(self, host: str, group, consumer: dict, size: int) -> bool:
        """Whether ``host`` may set ``group``'s subscriptions to ``consumer``'s (``size`` bytes of text) within
        max_subscription_bytes_per_host. One that does not add to what it is charged always may (a host past a
        limit lowered since keeps, renews and shrinks what it has)."""
        if not consumer["subscriptionDataSet"]:
            return True
        mine = group.sub_bytes if group is not None and group.sub_host == host else 0
        if size <= mine:
            return True
        return self._sub_bytes_by_host.get(host, 0) - mine + size <= self.max_subscription_bytes_per_host

    def _charge(self, group, host: str | None, size: int) -> None:
        """Charge ``group``'s subscriptions, ``size`` bytes, to ``host`` (None: to nobody, the group gone)."""
        if group.sub_host is not None:
            left = self._sub_bytes_by_host.get(group.sub_host, 0) - group.sub_bytes
            if left > 0:
                self._sub_bytes_by_host[group.sub_host] = left
            else:
                self._sub_bytes_by_host.pop(group.sub_host, None)
        group.sub_host, group.sub_bytes = host, size
        if host is not None:
            self._sub_bytes_by_host[host] = self._sub_bytes_by_host.get(host, 0) + size

    def renew(self, conn) -> int:
        """Mark every group ``conn`` is in as heard from now (a heartbeat whose body is not read); returns how many."""
        now = self.clock()
        groups = 0
        for name in self._producing.get(conn, ()):
            self.producers[name][conn].last_seen_ms = now
            groups += 1
        for name in self._consuming.get(conn, ()):
            self.consumers[name].channels[conn].last_seen_ms = now
            groups += 1
        return groups

    def _room(self, conn) -> bool:
        return self._groups_by_host.get(peer_host(conn), 0) < self.max_groups_per_host

    def _joined(self, conn, index: dict, group: str) -> None:
        host = peer_host(conn)
        self._groups_by_host[host] = self._groups_by_host.get(host, 0) + 1
        index.setdefault(conn, set()).add(group)

    def _left_group(self, conn, index: dict, group: str) -> None:
        count_down(self._groups_by_host, peer_host(conn))
        groups = index.get(conn)
        if groups is not None:
            groups.discard(group)
            if not groups:
                del index[conn]

    def add_producer(self, group: str, conn, client_id: str, language: int = 0, version: int = 0,
                     now: int | None = None) -> bool:
        """Join ``conn`` to ``group`` or renew it there; False, joining nothing, when it is new to the group and its
        address is at max_groups_per_host. Checked here, not by each caller: a half message's sender joins its
        group too, and one sending halves under made-up group names grew the table past the cap."""
        if conn not in self.producers.get(group, ()) and not self._room(conn):
            return False
        left = self._left.get(conn)
        if left is not None:                # back in the group (a new producer of it on this connection)
            left.pop(group, None)
            if not left:
                del self._left[conn]
        channels = self.producers.setdefault(group, {})
        ch = channels.get(conn)
        if ch is None:
            self._joins += 1
            channels[conn] = Channel(conn, client_id, language, version, now or self.clock(), self._joins)
            self._joined(conn, self._producing, group)
            if self.on_new_producer is not None:    # e.g. its deferred transactions are checked now
                self.on_new_producer(group)
        else:
            ch.last_seen_ms = now or self.clock()
            ch.client_id = client_id
        return True

    def _register_consumer(self, conn, client_id, cmd, data: dict, now: int) -> bool:
        name = data["groupName"]
        group = self.consumers.get(name)
        first = group is None
        if first:
            group = self.consumers[name] = ConsumerGroup(name)
        if self.on_new_retry_group is not None:     # every heartbeat, as RocketMQ: a deleted one comes back
            self.on_new_retry_group(name, first, conn)
        group.consume_type = _enum(data.get("consumeType"), _CONSUME_TYPES, group.consume_type)
        group.message_model = _enum(data.get("messageModel"), _MESSAGE_MODELS, group.message_model)
        group.consume_from_where = _enum(data.get("consumeFromWhere"), _CONSUME_FROM, group.consume_from_where)
        changed = False
        ch = group.channels.get(conn)
        if ch is None:
            group.channels[conn] = Channel(conn, client_id, cmd.language, cmd.version, now)
            self._joined(conn, self._consuming, name)
            changed = True
        else:
            ch.last_seen_ms = now
        topics = set()
        for sub in data.get("subscriptionDataSet") or []:
            if not isinstance(sub, dict) or not sub.get("topic"):
                continue
            topic = sub["topic"]
            topics.add(topic)
            version = int(sub.get("subVersion") or 0)
            old = group.subscriptions.get(topic)
            if old is None:
                changed = True
            elif old.sub_version > version:
                if ((sub.get("subString") or "*"), (sub.get("expressionType") or "TAG")) != (old.sub_string,
                                                                                            old.expression_type):
                    self._stale_subscription(name, client_id, old, sub, version)
                continue
            codes = sub.get("codeSet") or []
            tags = sub.get("tagsSet") or []
            if (codes or tags) and is_tag_type(sub.get("expressionType")):
                kept = Subscription(
                    topic, sub.get("subString") or "*", frozenset(tags),
                    frozenset(int(c) for c in codes) or frozenset(java_string_hash(t) for t in tags), version,
                    sub.get("expressionType") or "TAG")
            else:
                kept = build_subscription(topic, sub.get("subString"), version, sub.get("expressionType") or "TAG")
            kept.text_bytes = _entry_bytes(sub)
            group.subscriptions[topic] = kept
        for topic in list(group.subscriptions):
            if topic not in topics and topics:
                del group.subscriptions[topic]
                changed = True
        group.channels[conn].topics = frozenset(topics) if topics else None
        group.channels[conn].broadcasting = (_enum(data.get("messageModel"), _MESSAGE_MODELS, "CLUSTERING")
                                              == "BROADCASTING")
        return changed

    def _stale_subscription(self, group: str, client_id: str, old: Subscription, sub: dict, version: int) -> None:
        """A heartbeat's changed subscription with a subVersion older than the one kept: kept out, as RocketMQ's
        ConsumerGroupInfo.updateSubscription (the newest wins, so members that differ do not flip it). The version
        is the client's wall clock when it subscribed: a consumer whose clock stepped back (or restarted on a host
        behind the old one's) re-subscribing was kept to the old expression, its pulls without a subscription (a
        stock push consumer's) filtered by it, the messages it now wants passed over unread, nothing said."""
        if self.on_stale_subscription is not None:
            self.on_stale_subscription(group)
        if self._stale_said.due(group):
            log.warning("consumer group %s: client %s subscribes to %s with %r (%s, subVersion %d), older than the "
                        "%r (%s) kept (subVersion %d, %.0f s later): kept, as RocketMQ does; pulls without their "
                        "subscription are filtered by it. Is the client's clock behind? (at most once a minute a "
                        "group)", group, client_id, old.topic, sub.get("subString") or "*",
                        sub.get("expressionType") or "TAG", version, old.sub_string, old.expression_type,
                        old.sub_version, (old.sub_version - version) / 1000)

    # ----------------------------------------------------------- departures
    def unregister(self, conn, producer_group: str | None, consumer_group: str | None) -> list[str]:
        changed = []
        if producer_group:
            # Recorded only when it was in the group: a client naming group after group it never joined must not
            # grow this table.
            gone = self.producers.get(producer_group, {}).pop(conn, None) is not None
            if gone:
                self._left_group(conn, self._producing, producer_group)
            if gone:
                self._mark_left(conn, producer_group)
        if consumer_group:
            group = self.consumers.get(consumer_group)
            if group is not None and group.channels.pop(conn, None) is not None:
                self._left_group(conn, self._consuming, consumer_group)
                changed.append(consumer_group)
        self._prune([producer_group] if producer_group else (), [consumer_group] if consumer_group else ())
        return changed

    def _mark_left(self, conn, group: str) -> bool:
        """``conn`` is no producer of ``group`` any more and stays open: its checks of the group's halves will never
        be answered (left_group). True when it is open (marked)."""
        if not getattr(conn, "is_open", False):
            return False
        left = self._left.setdefault(conn, {})
        left[group] = None
        # Nor may one joining and leaving group after group (a producer made per tenant, on the process's
        # one connection): the oldest departure is forgotten. Its sender may then be asked again, as
        # before departures were kept: once while another producer of the group is registered (after an
        # unanswered check the others are, _channel_for).
        if len(left) > _LEFT_MAX:
            del left[next(iter(left))]
        return True

    def _prune(self, producer_groups=None, consumer_groups=None) -> None:
        """Forget groups nobody is in (these, or all), so clients cycling through group names cannot grow memory."""
        for name in list(self.producers) if producer_groups is None else producer_groups:
            if name in self.producers and not self.producers[name]:
                del self.producers[name]
        for name in list(self.consumers) if consumer_groups is None else consumer_groups:
            group = self.consumers.get(name)
            if group is not None and not group.channels:
                self._charge(group, None, 0)
                del self.consumers[name]

    def connection_closed(self, conn) -> list[str]:
        self._left.pop(conn, None)
        producing = self._producing.pop(conn, set())
        consuming = self._consuming.pop(conn, set())
        for name in producing:
            self.producers[name].pop(conn)
            count_down(self._groups_by_host, peer_host(conn))
        for name in consuming:
            self.consumers[name].channels.pop(conn)
            count_down(self._groups_by_host, peer_host(conn))
        self._prune(producing, consuming)
        return sorted(consuming)

    def expire(self, max_idle_ms: int) -> list[str]:
        cutoff = self.clock() - max_idle_ms
        changed = []
        dropped: dict = {}          # connection still open -> the producer groups it was dropped from
        for name, channels in self.producers.items():
            for conn in [c for c, ch in channels.items() if ch.last_seen_ms < cutoff or not ch.alive]:
                del channels[conn]
                self._left_group(conn, self._producing, name)
                # Its connection open (kept by the process's other clients' heartbeats), as an UNREGISTER_CLIENT
                # that never came: its checks in flight were otherwise taken as lost only an interval later, and
                # it was still asked first (RocketMQ's scan closes the channel; the checks are lost with it).
                # Only a connection a heartbeat named: its heartbeats stopped naming the group. One that never
                # heartbeats joined by its half sends alone (a pre-4.5.1 Java client's VIP channel, port - 2, its
                # heartbeats on the broker port): its silence in the group says nothing of its producer, which
                # answers a check there; marked, its halves' checks went to another instance of the group.
                if getattr(conn, "attributes", {}).get("client_id") is not None and self._mark_left(conn, name):
                    dropped.setdefault(conn, []).append(name)
        for group in self.consumers.values():
            stale = [c for c, ch in group.channels.items() if ch.last_seen_ms < cutoff or not ch.alive]
            for conn in stale:
                del group.channels[conn]
                self._left_group(conn, self._consuming, group.name)
            if stale:
                changed.append(group.name)
        self._prune()
        if dropped:
            first, groups = next(iter(dropped.items()))
            log.info("dropped %d producers not heard from for %d ms whose connections are open (first: group %s "
                     "from %s); their transaction checks in flight are asked of the groups' others",
                     sum(map(len, dropped.values())), max_idle_ms, groups[0], peer_host(first))
            if self.on_producer_left is not None:
                for conn, groups in dropped.items():
                    self.on_producer_left(conn, frozenset(groups))
        return changed

    def expire_locks(self, max_live_ms: int, now: int | None = None) -> int:
        """Forget queue locks not renewed for ``max_live_ms``; returns how many went.

        An expired lock is free already (LOCK_BATCH_MQ grants it to anyone), so forgetting it changes
        no answer; kept, every lock of an orderly consumer that crashed, of a group that is gone or of a
        queue no longer there stayed in memory for good. Run by the housekeeping and, at most once a
        ``max_live_ms``, by a lock request itself (and at most once a second by one that met a cap)."""
        now = self.clock() if now is None else now
        self._locks_swept = now
        stale = [key for key, (_client, ms, _conn) in self.locks.items() if now - ms > max_live_ms]
        for key in stale:
            self._uncount(self.locks.pop(key)[2])
        if stale:
            self.lock_holders_changed += 1
        return len(stale)

    def maybe_expire_locks(self, max_live_ms: int, now: int) -> None:
        if now - self._locks_swept > max_live_ms:
            self.expire_locks(max_live_ms, now)

    def _uncount(self, conn) -> None:
        count_down(self._locks_by_conn, conn)
        count_down(self._locks_by_host, peer_host(conn))

    def lock_queue(self, key: tuple, client_id: str, conn, now: int, max_live_ms: int, max_total: int,
                   max_per_conn: int, max_per_host: int | None = None) -> str | None:
        """Lock (or renew) ``key`` for ``client_id``: None when granted, else why not: "held" (another client
        renewed it within ``max_live_ms``), "max_queue_locks", "max_queue_locks_per_connection" or
        "max_queue_locks_per_host" (a new lock past that cap; a renewal is never refused for one)."""
        if max_per_host is None:
            max_per_host = max_total
        holder = self.locks.get(key)
        if holder is not None and holder[0] != client_id and now - holder[1] <= max_live_ms:
            return "held"
        if holder is None or holder[2] is not conn:
            # A new lock, or one this connection takes over (from an expired holder, or its own client
            # reconnected): it counts against this connection. At a cap, expired locks may be what fills
            # it: sweep (at most once a second) and look again.
            full = self._lock_cap(holder, conn, max_total, max_per_conn, max_per_host)
            if full is not None and now - self._locks_swept > 1000:
                self.expire_locks(max_live_ms, now)
                holder = self.locks.get(key)
                full = self._lock_cap(holder, conn, max_total, max_per_conn, max_per_host)
            if full is not None:
                return full
            if holder is not None:
                self._uncount(holder[2])
            self._locks_by_conn[conn] = self._locks_by_conn.get(conn, 0) + 1
            host = peer_host(conn)
            self._locks_by_host[host] = self._locks_by_host.get(host, 0) + 1
        if holder is None or holder[0] != client_id:
            self.lock_holders_changed += 1
        self.locks[key] = (client_id, now, conn)
        return None

    def _lock_cap(self, holder, conn, max_total: int, max_per_conn: int, max_per_host: int) -> str | None:
        if self._locks_by_conn.get(conn, 0) >= max_per_conn:
            return "max_queue_locks_per_connection"
        # A closed connection's locks count until they expire (they are still held: its client may come back on a
        # new connection, RocketMQ's rule), so without this one address opening connection after connection, or
        # many at once, filled the whole table and every other client's orderly consumers stalled.
        # A lock taken over from a connection of the same address (its client back on a new connection) leaves the
        # address's count as it was: never refused for it.
        host = peer_host(conn)
        if (self._locks_by_host.get(host, 0) >= max_per_host
                and (holder is None or peer_host(holder[2]) != host)):
            return "max_queue_locks_per_host"
        if holder is None and len(self.locks) >= max_total:
            return "max_queue_locks"
        return None

    def unlock_queue(self, key: tuple, client_id: str) -> None:
        holder = self.locks.get(key)
        if holder is not None and holder[0] == client_id:
            del self.locks[key]
            self._uncount(holder[2])
            self.lock_holders_changed += 1

    def lock_table(self) -> dict[tuple, tuple]:
        """A copy of ``locks`` (lapsed ones not yet swept included) to read off the loop: a dict copy makes no
        object per lock (200,000 locks on a loaded host: 0.1 s, where a list of their items took 0.75 s)."""
        return self.locks.copy()

    def restore_locks(self, holders: list[list], granted_ms: int) -> None:
        """Hold the locks a previous run of the broker saved (queue_locks.py), as if last renewed at
        ``granted_ms``: under none of its connections (a holder's renewal, on whatever connection, takes it over)."""
        for group, topic, qid, client_id in holders:
            key = (group, topic, qid)
            if key not in self.locks:
                self.locks[key] = (client_id, granted_ms, RESTORED)
                self._locks_by_conn[RESTORED] = self._locks_by_conn.get(RESTORED, 0) + 1
                self._locks_by_host[""] = self._locks_by_host.get("", 0) + 1

    # -------------------------------------------------------------- queries
    def producer_channels(self, group: str) -> list[Channel]:
        return [ch for ch in self.producers.get(group, {}).values() if ch.alive]

    def producer_groups_of(self, conn) -> frozenset[str]:
        """The producer groups ``conn`` is registered in."""
        return frozenset(self._producing.get(conn, ()))

    def left_group(self, conn, group: str) -> bool:
        """``conn`` unregistered its producer of ``group`` (UNREGISTER_CLIENT) and has not come back to it: it
        cannot answer for the group's transactions any more (the Java client ignores such a check)."""
        left = self._left.get(conn)
        return left is not None and group in left

    def requested(self, conn, props: dict, now: int | None = None) -> None:
        """A request (request-reply: REPLY_TO_CLIENT and CORRELATION_ID) came on ``conn``: its reply is pushed there
        (reply_connection)."""
        correlation = props.get(Prop.CORRELATION_ID)
        if not correlation or len(correlation) > _CORRELATION_MAX:
            return
        now = self.clock() if now is None else now
        try:
            ttl = min(max(int(props.get(Prop.TTL) or _REQUEST_TTL_DEFAULT_MS), 0), _REQUEST_TTL_MAX_MS)
        except ValueError:
            ttl = _REQUEST_TTL_DEFAULT_MS
        requests = self._requests
        requests.pop(correlation, None)         # (sent again: its place is the newest)
        # (weakly: a closed connection is not kept for its requests' TTL, up to an hour)
        requests[correlation] = (weakref.ref(conn), now + ttl)
        while requests:
            first = next(iter(requests))
            if len(requests) <= _REQUESTS_MAX and requests[first][1] >= now:
                break
            requests.popitem(last=False)

    def reply_connection(self, client_id: str, correlation: str | None):
        """Where a reply to ``client_id``'s request ``correlation`` is pushed: the connection the request came on
        while it is open and still gives that client id; else the live producer connection registered last under
        the id, in any group (RocketMQ's ProducerManager.findChannel); None if there is none.

        A client id is only what a heartbeat says: two live connections may give one (a Java process with a fixed
        instanceName started twice on a host, or the requester back on a new connection while its old one is not
        yet seen dead). The reply went to the one registered first; a stock Java client answers SUCCESS to a reply
        matching none of its requests (it only logs it), so the replier was told it was delivered and the requester
        never had it."""
        entry = self._requests.get(correlation) if correlation else None
        if entry is not None:
            conn = entry[0]()
            if getattr(conn, "is_open", False) and conn.attributes.get("client_id") == client_id:
                return conn
        newest = None
        for channels in self.producers.values():
            for ch in channels.values():
                if ch.client_id == client_id and ch.alive and (newest is None or ch.seq > newest.seq):
                    newest = ch
        return None if newest is None else newest.conn

    def consumer_ids(self, group: str) -> list[str]:
        g = self.consumers.get(group)
        return [] if g is None else sorted({ch.client_id for ch in g.channels.values() if ch.alive})

    def reads_elsewhere(self, group: str, topic: str) -> bool:
        """``group`` is online and none of its members reads ``topic``: each subscribes to topics (its last
        heartbeat named some), ``topic`` not among them. Consumer progress (GET_CONSUME_STATS) and the lag gauge
        leave such a topic out, as RocketMQ's getConsumeStats does (findSubscriptionDataCount > 0). Asked per
        member, not of the group's table, which follows whichever heartbeat came last (two members on different
        topics: each one's topic hidden every other heartbeat) and keeps a departed member's topics after an empty
        heartbeat (a pull consumer, which names none: the topics it pulls hidden for good) -- a real backlog hid
        from the lag alert either way."""
        read = self.topics_read(group)
        return read is not None and topic not in read

    def online(self, group: str) -> bool:
        """``group`` has a consumer connection here."""
        g = self.consumers.get(group)
        return g is not None and bool(g.channels)

    def topics_read(self, group: str) -> frozenset | None:
        """The topics ``group``'s online members subscribe to, and always its own %RETRY%<group>; None when any
        topic may be read (nobody online, or a member naming no subscription). A caller asking of many topics asks
        this once a group.

        The retry topic counts whatever the members name: a pull consumer reading its retries (stock
        DefaultMQPullConsumer and DefaultLitePullConsumer, and ours, name only their topics) committed offsets
        there, and its retries piling up unread were left out of the lag, as RocketMQ leaves them out. A group
        that does not read them has no offset there, so no lag to show. Not a BROADCASTING group's: its consumers
        never read it (a stock one drops what it fails), so offsets left there from when it was CLUSTERING showed a
        backlog frozen for good, a lag alert that never cleared (RocketMQ leaves it out: no member subscribes).
        Judged by each member's own model, not the group's (the last heartbeat's): mid-switch, a CLUSTERING member
        still reading the retries had them hidden every time a BROADCASTING member's heartbeat came last."""
        g = self.consumers.get(group)
        if g is None or not g.channels:
            return None
        read = set()
        for ch in g.channels.values():
            if ch.topics is None:
                return None
            read |= ch.topics
            if not ch.broadcasting:
                read.add(RETRY_PREFIX + group)
        return frozenset(read)

    def subscription(self, group: str, topic: str) -> Subscription | None:
        g = self.consumers.get(group)
        return None if g is None else g.subscriptions.get(topic)

    def notify_ids_changed(self, group: str) -> None:
        """Tell ``group``'s consumers its members or subscriptions changed (each rebalances at once): now, or, when
        it was told within the last NOTICE_GAP_S, once at that gap's end for every change since. Told at each
        change, one member flipping its subscription every heartbeat (thousands a second, pipelined) sent each of
        the group's consumers a notice per heartbeat, and each notice started a rebalance (its consumer list asked
        again): 100 consumers, 5,000 heartbeats, 500,000 notices and 160 ms of loop lag for every other client.
        Stock consumers rebalance every 20 s besides; the notice only makes it sooner."""
        if group in self._told:
            self._told[group] = True
            if self.on_notice_merged is not None:
                self.on_notice_merged()
            return
        g = self.consumers.get(group)
        if g is None:
            return
        if self.call_later is not None:
            self._told[group] = False
            self.call_later(NOTICE_GAP_S, self._gap_over, group)
        for ch in list(g.channels.values()):
            if ch.alive:
                try:
                    ch.conn.oneway(RemotingCommand.request(RequestCode.NOTIFY_CONSUMER_IDS_CHANGED,
                                                           {"consumerGroup": group}, language=LanguageCode.JAVA))
                except Exception:  # noqa: BLE001 - a dying channel must not stop the others
                    log.debug("could not notify %s", ch.client_id)

    def _gap_over(self, group: str) -> None:
        if self._told.pop(group, False):
            self.notify_ids_changed(group)
