"""Admin bodies a 4.x broker writes with fastjson, and their readers.

fastjson quirks kept here (clients and mqadmin parse what Java writes):

* keys sorted, compact, doubles with a fraction (``0.0``);
* a map keyed by MessageQueue is written with the key as a JSON object -- not JSON, but what
  ``ConsumeStats``, ``TopicStatsTable`` and ``ResetOffsetBody`` look like on the wire::

      {"offsetTable":{{"brokerName":"broker-a","queueId":0,"topic":"T"}:12}}

  ``decode_mq_table`` reads that form (and a quoted-key form, for other writers).
"""
from __future__ import annotations

import heapq
import json
import re
from itertools import islice

from .errors import HeaderError

MQ = tuple[str, str, int]       # (topic, broker name, queue id)


def dump(value) -> str:
    """fastjson's compact, key-sorted JSON."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def mq_json(mq: MQ) -> str:
    topic, broker, qid = mq
    return f'{{"brokerName":{dump(broker)},"queueId":{int(qid)},"topic":{dump(topic)}}}'


def _mq_map(rows) -> str:
    return "{" + ",".join(f"{mq_json(mq)}:{value}" for mq, value in rows) + "}"


def encode_reset_offset(offsets: dict[MQ, int]) -> bytes:
    """ResetOffsetBody: {"offsetTable":{MessageQueue: offset}}."""
    return ('{"offsetTable":' + _mq_map(sorted(offsets.items())) + "}").encode()


def encode_consume_stats(rows: dict[MQ, tuple[int, int, int]], tps: float = 0.0) -> bytes:
    """ConsumeStats: {"consumeTps":d,"offsetTable":{MessageQueue: OffsetWrapper}}; rows hold
    (broker offset, consumer offset, last timestamp)."""
    return (consume_stats_head(tps) + consume_stats_members(rows, sorted(rows)) + "}}").encode()


def encode_consumer_running_info(properties: dict[str, str], subscriptions: list[dict], queues: dict[MQ, dict],
                                 jstack: str | None = None) -> bytes:
    """ConsumerRunningInfo as fastjson writes it: {"jstack" (when asked), "mqTable":{MessageQueue:
    ProcessQueueInfo}, "properties", "statusTable":{topic: ConsumeStatus}, "subscriptionSet":[SubscriptionData]}, the
    queues in MessageQueue's order and the subscriptions in SubscriptionData's (topic@subString), as the TreeMap and
    TreeSet a Java consumer fills. The statusTable is left empty: a txmq consumer measures no pull/consume rates."""
    subs = sorted(subscriptions, key=lambda s: f"{s['topic']}@{s['subString']}")
    head = f'{{"jstack":{dump(jstack)},' if jstack is not None else "{"
    return (f'{head}"mqTable":{_mq_map((mq, dump(info)) for mq, info in sorted(queues.items()))},'
            f'"properties":{dump(properties)},"statusTable":{{}},"subscriptionSet":{dump(subs)}}}').encode()


# encode_consume_stats in parts, for a caller that writes the members a slice at a time (broker.slices.
# members_in_slices): head, the members of each slice of the sorted queues, joined by ",", then "}}".
def consume_stats_head(tps: float) -> str:
    return f'{{"consumeTps":{float(tps)!r},"offsetTable":{{'


def consume_stats_members(rows: dict[MQ, tuple[int, int, int]], mqs) -> str:
    return _mq_map((mq, '{"brokerOffset":%d,"consumerOffset":%d,"lastTimestamp":%d}' % rows[mq]) for mq in mqs)[1:-1]


def encode_topic_stats(rows: dict[MQ, tuple[int, int, int]]) -> bytes:
    """TopicStatsTable: {"offsetTable":{MessageQueue: TopicOffset}}; rows hold (min, max, last update)."""
    table = _mq_map((mq, f'{{"lastUpdateTimestamp":{t},"maxOffset":{hi},"minOffset":{lo}}}')
                    for mq, (lo, hi, t) in sorted(rows.items()))
    return f'{{"offsetTable":{table}}}'.encode()


def encode_client_consumer_status(offsets: dict[MQ, int]) -> bytes:
    """One consumer's GetConsumerStatusBody, its answer to GET_CONSUMER_STATUS_FROM_CLIENT:
    {"consumerTable":{},"messageQueueTable":{MessageQueue: offset}}."""
    return ('{"consumerTable":{},"messageQueueTable":' + _mq_map(sorted(offsets.items())) + "}").encode()


def consumer_status_steps(by_client: dict[str, dict[MQ, int]], per_step: int = 2048):
    """GetConsumerStatusBody: {"consumerTable":{clientId:{MessageQueue: offset}},"messageQueueTable":{}}, written
    ``per_step`` queues at a time: a generator that yields (a step, for broker.slices.in_steps) between two and
    returns the body. (At once, a consumer that answered 290,000 queues held the event loop 1.3 s.)"""
    clients = []
    for cid, offsets in sorted(by_client.items()):
        rows, parts = (yield from sorted_steps(list(offsets.items()), per_step)), []
        for i in range(0, len(rows), per_step):
            yield
            parts.append(_mq_map(rows[i:i + per_step])[1:-1])
        clients.append(f"{dump(cid)}:{{{','.join(parts)}}}")
    return f'{{"consumerTable":{{{",".join(clients)}}},"messageQueueTable":{{}}}}'.encode()


def sorted_steps(items: list, per_step: int = 2048):
    """``items`` sorted, a generator that yields (a step, for broker.slices.in_steps) between slices of the work
    and returns the sorted list: runs of ``per_step`` sorted one a step, then merged ``per_step`` at a time. (A
    stock consumer's table comes in HashMap order: one sort of 250,000 queues held a loaded loop 3.6-4.7 s.)"""
    runs = []
    for i in range(0, len(items), per_step):
        if i:
            yield
        runs.append(sorted(items[i:i + per_step]))
    if len(runs) <= 1:
        return runs[0] if runs else []
    if all(a[-1] <= b[0] for a, b in zip(runs, runs[1:])):      # (items in order already: no merge)
        return [item for run in runs for item in run]
    merged, out = heapq.merge(*runs), []
    while True:
        yield
        part = list(islice(merged, per_step))
        if not part:
            return out
        out += part


_OBJECT_KEY = re.compile(r'([{,])\s*(\{[^{}]*\})\s*:')


def decode_mq_table(body: bytes, field: str = "offsetTable") -> tuple[dict, dict[MQ, object]]:
    """(the whole object, {(topic, broker, queue id): value}) from a body with a MessageQueue-keyed map."""
    try:
        text = body.decode("utf-8")
        obj = json.loads(_OBJECT_KEY.sub(lambda m: m.group(1) + json.dumps(m.group(2)) + ":", text))
        table = {}
        for key, value in (obj.get(field) or {}).items():
            mq = json.loads(key)
            table[(mq["topic"], mq["brokerName"], int(mq["queueId"]))] = value
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise HeaderError(f"{field} body does not parse: {exc}") from None
    return obj, table


_SPACE = re.compile(r"[ \t\n\r]*")
_SCALAR = json.JSONDecoder()
# (a queue id as JSON writes a number: "01" is not one, and decode_mq_table refuses it)
_MQ_KEY = re.compile(r'\{"brokerName":"([^"\\\x00-\x1f]*)","queueId":(-?(?:0|[1-9]\d{0,9})),'
                     r'"topic":"([^"\\\x00-\x1f]*)"\}')
_FLAT_KEY = re.compile(r"\{[^{}]*\}")       # any other object key, as decode_mq_table's _OBJECT_KEY takes it


def mq_table_steps(body: bytes, field: str, value=lambda item: item, per_step: int = 2048):
    """decode_mq_table's table, ``{(topic, broker, queue id): value(item)}`` of ``body``'s map ``field`` (names
    as fastjson reads them into MessageQueue's Strings: a number from an odd client becomes its text), read a
    token at a time: a generator that yields (a step, for broker.slices.in_steps) every ``per_step`` keys and
    values, and returns the table; an object key other than fastjson's MessageQueue is kept as its text, read
    only if it keys ``field``, as decode_mq_table does. For a body from a peer the broker waits on (a consumer's
    GET_CONSUMER_STATUS_FROM_CLIENT answer, up to a frame's 16 MiB): decode_mq_table held the event loop 2.5 s
    on 15 MB. Scalars are read by json's own scanner, a key as fastjson writes a MessageQueue by one match; any
    other object key as its text, a quoted one as JSON; a malformed body is a HeaderError, as
    decode_mq_table's."""
    count = 0
    space, scalar, mq_key, flat_key = _SPACE.match, _SCALAR.raw_decode, _MQ_KEY.match, _FLAT_KEY.match

    def container(pos):         # text[pos] opens an object or array -> (its value, end)
        nonlocal count
        closer, items = ("}", {}) if text[pos] == "{" else ("]", [])
        pos = space(text, pos + 1).end()
        if text[pos:pos + 1] == closer:
            return items, pos + 1
        while True:
            count += 1
            if count % per_step == 0:
                yield
            if closer == "}":
                m = mq_key(text, pos)
                if m is not None:
                    key, pos = (m[3], m[1], int(m[2])), m.end()
                elif text[pos:pos + 1] == "{":
                    # its text, read as JSON only if it keys ``field`` (decode_mq_table's way: an object key
                    # elsewhere, such as a consumerTable's, is not read, so it neither parses nor needs a queueId)
                    m = flat_key(text, pos)
                    if m is None:
                        raise ValueError(f"an object key holding an object at {pos}")
                    key, pos = m[0], m.end()
                else:
                    key, pos = scalar(text, pos)
                    if not isinstance(key, str):
                        raise ValueError(f"a key that is neither a string nor an object before {pos}")
                pos = space(text, pos).end()
                if text[pos:pos + 1] != ":":
                    raise ValueError(f"':' expected at {pos}")
                pos = space(text, pos + 1).end()
            item, pos = (yield from container(pos)) if text[pos:pos + 1] in ("{", "[") else scalar(text, pos)
            if closer == "}":
                items[key] = item
            else:
                items.append(item)
            pos = space(text, pos).end()
            sep = text[pos:pos + 1]
            if sep == closer:
                return items, pos + 1
            if sep != ",":
                raise ValueError(f"',' or {closer!r} expected at {pos}")
            pos = space(text, pos + 1).end()

    try:
        text = body.decode("utf-8")
        start = space(text, 0).end()
        if text[start:start + 1] != "{":
            raise ValueError("not a JSON object")
        obj, end = yield from container(start)
        if space(text, end).end() != len(text):
            raise ValueError(f"extra data after the JSON object at {end}")
        table = {}
        for key, item in (obj.get(field) or {}).items():
            if isinstance(key, str):
                mq = json.loads(key)
                key = (mq["topic"], mq["brokerName"], mq["queueId"])
            topic, broker, qid = key
            table[str(topic), str(broker), int(qid)] = value(item)
            count += 1
            if count % per_step == 0:
                yield
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise HeaderError(f"{field} body does not parse: {exc}") from None
    return table


def split_offset_key(key: str) -> tuple[str, str] | None:
    """(topic, group) of a consumer offsets key "<topic>@<group>" (consumerOffset.json, GET_ALL_CONSUMER_OFFSET),
    or None when it is not one.

    Split at the first "@", as RocketMQ's ConsumerOffsetManager splits it: a topic name holds no "@" (TopicValidator
    allows ``[%|a-zA-Z0-9_-]``, and every way a topic is made here checks it), while a group name may hold any
    character -- stock clients check theirs, the broker does not. Split at the last one, the offsets of group
    "G@" or "a@b" were read back as another group's of another topic."""
    topic, sep, group = key.partition("@")
    return (topic, group) if sep and topic else None


def encode_consumer_offsets(table) -> bytes:
    """ConsumerOffsetManager's JSON, as GET_ALL_CONSUMER_OFFSET answers it (a slave copies it from its
    master): ``{"offsetTable":{"<topic>@<group>":{<queueId>:<offset>}}}`` -- fastjson writes the integer keys
    bare. ``table``: ((group, topic, queue id), offset) pairs."""
    by_key: dict[str, list[tuple[int, int]]] = {}
    key_consumer_offsets(table, by_key)
    return consumer_offsets_body([consumer_offset_entries(sorted(by_key.items()))])


# The three steps of encode_consumer_offsets, for a caller that takes them a slice at a time (the broker: 100,000
# offsets in one go held its event loop a tenth of a second, at every slave's sync).
def key_consumer_offsets(table, by_key: dict) -> None:
    """Add ``table``'s ((group, topic, queue id), offset) pairs to ``by_key``: "<topic>@<group>" -> [(queue id,
    offset)]."""
    for (group, topic, qid), offset in table:
        by_key.setdefault(f"{topic}@{group}", []).append((int(qid), int(offset)))


def consumer_offset_entries(keyed) -> str:
    """The offsetTable entries of (key, [(queue id, offset)]) pairs, in their order."""
    return ",".join(f"{dump(key)}:{{" + ",".join(f"{q}:{o}" for q, o in sorted(rows)) + "}" for key, rows in keyed)


def consumer_offsets_body(entries: list[str], deleted=()) -> bytes:
    """The body of the offsetTable ``entries`` (consumer_offset_entries' strings, in order; empty ones skipped).
    ``deleted``: a txmq master's groups deleted with their offsets kept (their lag left out), listed after the
    table as ``"deleted"`` (a Java slave's fastjson reads past a member it has no field for, as an older txmq
    slave's offset_table_members does)."""
    tail = f',"deleted":{json.dumps(sorted(deleted))}' if deleted else ""
    return ('{"offsetTable":{' + ",".join(e for e in entries if e) + "}" + tail + "}").encode()


# A whole string literal (kept as it is: names are the client's text, and one holding ``,5:`` must not be rewritten
# into a body that no longer parses), and, outside them, a bare integer key.
_STRING_LITERAL = re.compile(r'("(?:[^"\\]|\\.)*")')
_BARE_INT_KEY = re.compile(r'([{,])\s*(-?\d+)\s*:')
_BAD_BODY = (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError)


def split_at_string_literals(text: str) -> list[str]:
    """``text`` as [outside, literal, outside, ..., outside]: the pieces quote_int_keys quotes are the even ones."""
    return _STRING_LITERAL.split(text)


def string_literal_pieces(text: str):
    """split_at_string_literals(text), a piece at a time: a caller taking them a slice at a time is not held for
    the whole body's split (20-30 ms at 100,000 offsets)."""
    pos = 0
    for m in _STRING_LITERAL.finditer(text):
        yield text[pos:m.start()]
        yield m.group()
        pos = m.end()
    yield text[pos:]


def quote_int_keys(outside: str) -> str:
    """A piece of a body outside its string literals with its bare integer keys quoted (fastjson writes them bare)."""
    return _BARE_INT_KEY.sub(_quote_int_key, outside)


def _quote_int_key(m: re.Match) -> str:
    return f'{m.group(1)}"{m.group(2)}":'


def decode_consumer_offsets(body: bytes) -> dict[tuple[str, str, int], int]:
    """{(group, topic, queue id): offset} from a GET_ALL_CONSUMER_OFFSET body (bare or quoted queue ids)."""
    try:
        pieces = split_at_string_literals(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise HeaderError(f"consumer offsets body is not usable: {exc}") from None
    pieces[::2] = map(quote_int_keys, pieces[::2])
    out: dict = {}
    add_offset_entries(offset_table_members(pieces), out)
    return out


# decode_consumer_offsets in steps, for a caller that takes them a slice at a time (a slave: 100,000 offsets in one
# go held its event loop 0.4-1.7 s at each sync): split_at_string_literals, quote_int_keys, then these.
def offset_table_members(pieces: list[str], others: dict | None = None):
    """The members of the offsetTable of a GET_ALL_CONSUMER_OFFSET body's ``pieces`` (their ids quoted), as JSON
    reads them: ("<topic>@<group>", {queue id: offset}), one at a time, so a caller takes them a slice at a time.
    Read whole (json.loads), 100,000 offsets held a slave's loop 80-140 ms in one call at each sync. The body's
    other members are read and left (put in ``others`` when given: a txmq master's "deleted"). A body that is not
    JSON raises HeaderError when the reading reaches the fault (after the members before it: the caller takes
    nothing until the end)."""
    try:
        for inside, key, value in json_members("".join(pieces), "offsetTable"):
            if inside:
                yield key, value
            elif others is not None:
                others[key] = value
    except _BAD_BODY as exc:
        raise HeaderError(f"consumer offsets body is not usable: {exc}") from None


def json_members(text: str, table: str):
    """The JSON object ``text`` read a member at a time, as json.loads reads it whole: (False, key, value) for
    each of its members but ``table``, (True, key, value) for each member of the object ``table`` is, in the
    body's order. ValueError (or KeyError: no ``table``) when the reading reaches a fault."""
    decode = _DECODER.raw_decode
    found, (pos, more) = False, _opened(text, 0)
    while more:
        key, pos = _member_key(text, pos)
        if key != table:
            value, pos = decode(text, pos)
            yield False, key, value
        elif found:
            raise ValueError(f"a second {table}")
        else:
            found, (pos, inner) = True, _opened(text, pos)
            while inner:
                name, pos = _member_key(text, pos)
                value, pos = decode(text, pos)
                yield True, name, value
                pos, inner = _after_member(text, pos)
        pos, more = _after_member(text, pos)
    if not found:
        raise KeyError(table)
    if _WS.match(text, pos).end() != len(text):
        raise ValueError(f"extra data at {pos}")


_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _opened(text: str, pos: int) -> tuple[int, bool]:
    """Past the ``{`` of the object at ``pos`` (and its blanks): (there, whether a member follows)."""
    pos = _WS.match(text, pos).end()
    if not text.startswith("{", pos):
        raise ValueError(f"expected an object at {pos}")
    pos = _WS.match(text, pos + 1).end()
    return (pos + 1, False) if text.startswith("}", pos) else (pos, True)


def _member_key(text: str, pos: int) -> tuple[str, int]:
    """A member's key at ``pos`` and the start of its value."""
    key, pos = _DECODER.raw_decode(text, pos)
    pos = _WS.match(text, pos).end()
    if not isinstance(key, str) or not text.startswith(":", pos):
        raise ValueError(f"expected a member at {pos}")
    return key, _WS.match(text, pos + 1).end()


def _after_member(text: str, pos: int) -> tuple[int, bool]:
    """Past the ``,`` after a member (and the blanks): (there, True); or past its object's ``}``: (there, False)."""
    pos = _WS.match(text, pos).end()
    if text.startswith(",", pos):
        return _WS.match(text, pos + 1).end(), True
    if text.startswith("}", pos):
        return pos + 1, False
    raise ValueError(f"expected , or }} at {pos}")


def add_offset_entries(entries, out: dict) -> None:
    """Add an offsetTable's (key, {queue id: offset}) ``entries`` to ``out``: {(group, topic, queue id): offset}."""
    try:
        for key, queues in entries:
            # read as the store's loader reads consumerOffset.json (broker/store/offsets.py): a group name
            # may hold "@" (names are not checked) and even end in it ("T@odd@").
            split = split_offset_key(key)
            if split is None:
                raise ValueError(f"offset key {key!r} is not <topic>@<group>")
            topic, group = split
            for qid, offset in queues.items():
                out[(group, topic, int(qid))] = int(offset)
    except _BAD_BODY as exc:
        raise HeaderError(f"consumer offsets body is not usable: {exc}") from None
