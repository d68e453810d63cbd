"""Admin requests whose work grows with what a client sent run with the event loop turning between slices of it:
INVOKE_BROKER_TO_GET_CONSUMER_STATUS (223) reads each consumer's answer and writes its own (a consumer's
GetConsumerStatusBody may be a frame's 16 MiB: 290,000 queues, 2.5 s to read, 1.3 s to write, every other client
waiting); GET_CONSUMER_CONNECTION_LIST (203) writes a group's subscription table (some 37,000 topics within
max_subscription_bytes_per_group: 0.6 s); GET_CONSUME_STATS (208) reads and writes every queue of each topic a
group holds an offset on."""
from __future__ import annotations

import asyncio

import json
from types import SimpleNamespace

import pytest

from broker.processors import forward, ops
from protocol.admin_bodies import decode_mq_table, dump, encode_consume_stats, mq_table_steps
from protocol.codes import RequestCode as R, ResponseCode as C
from protocol.command import RemotingCommand
from protocol.errors import HeaderError
from tests.support.bounded import bounded, other_client


def _status_body(queues: int) -> bytes:
    """A 4.9.8 consumer's GetConsumerStatusBody of ``queues`` queues of T, as fastjson writes it."""
    table = ",".join(f'{{"brokerName":"broker-a","queueId":{q},"topic":"T"}}:{q * 3}' for q in range(queues))
    return f'{{"consumerTable":{{}},"messageQueueTable":{{{table}}}}}'.encode()


def _read(body: bytes, field: str = "messageQueueTable"):
    steps, yields = mq_table_steps(body, field), 0
    try:
        while True:
            next(steps)
            yields += 1
    except StopIteration as done:
        return done.value, yields


@bounded(120)
async def test_a_consumers_status_of_many_queues_is_read_and_answered_with_the_loop_running():
    """One consumer answering 100,000 queues: its answer was read, and the broker's written, in one go each (the
    other client got 0 turns); now a slice of 2,048 queues at a time, the answer the same."""
    queues = 100_000

    class Consumer:
        async def request(self, request, timeout):
            assert request.code == R.GET_CONSUMER_STATUS_FROM_CLIENT and request.ext_fields["topic"] == "T"
            return request.response(C.SUCCESS, body=_status_body(queues))

    channel = SimpleNamespace(alive=True, client_id="10.0.0.1@1", conn=Consumer())
    ctx = SimpleNamespace(forwarding=0, clients=SimpleNamespace(consumers={"G": SimpleNamespace(channels={1: channel})}))
    cmd = RemotingCommand.request(R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS, {"topic": "T", "group": "G"})
    async with other_client() as turns:
        resp = await forward.invoke_broker_to_get_consumer_status(ctx, None, cmd)
    assert resp.code == C.SUCCESS, resp.remark
    obj, _ = decode_mq_table(resp.body_bytes(), "messageQueueTable")
    [(client, table)] = obj["consumerTable"].items()
    assert client == "10.0.0.1@1" and len(table) == queues
    assert {json.loads(k)["queueId"]: v for k, v in table.items()} == {q: q * 3 for q in range(queues)}
    assert turns[0] >= 2 * queues // 2048, turns[0]          # reading and writing, a turn a slice each


def test_the_sliced_reading_of_a_message_queue_table_reads_what_decode_mq_table_reads():
    """Every form decode_mq_table reads (object keys in any order and spacing, quoted keys, other members, nested
    values) gives the same table; what it refuses is a HeaderError too."""
    mq = '{"brokerName":"b","queueId":1,"topic":"T"}'
    for body, field in [
            (_status_body(3), "messageQueueTable"),
            (b' { "offsetTable" : { {"topic":"T","brokerName":"x","queueId":"2"} : 4 } } ', "offsetTable"),
            (json.dumps({"offsetTable": {mq: 8}}).encode(), "offsetTable"),
            (('{"consumerTable":{"c":{%s:[1,{"a":2.5}]}},"messageQueueTable":{{"brokerName":"b\\u0041",'
              '"queueId":1,"topic":"T"}:{"x":null,"y":[true,"s"]}}}' % mq).encode(), "messageQueueTable"),
            (b'{}', "offsetTable"), (b'{"offsetTable":null}', "offsetTable"), (b'{"offsetTable":{}}', "offsetTable")]:
        assert _read(body, field)[0] == decode_mq_table(body, field)[1], body
    assert _read(_status_body(10_000))[1] >= 2 * 10_000 // 2048         # each entry counts, read and tabled
    for bad in [b'{"a":1', b'{"a":1}x', b'[1]', b'{"messageQueueTable":{{"topic":"T"}:1}}', b'\xff', b'{1:2}',
                b'', b'{"a" 1}', b'{"a":[1 2]}', b'{"messageQueueTable":{%s:1 %s:2}}' % (mq.encode(), mq.encode()),
                b'{"messageQueueTable":{"' + b'9' * 5000 + b'":1}}']:
        with pytest.raises(HeaderError):
            decode_mq_table(bad, "messageQueueTable")
        with pytest.raises(HeaderError):
            _read(bad)
    with pytest.raises(HeaderError):            # (decode_mq_table's json.loads: a RecursionError)
        _read(b'{"a":' + b'[' * 100_000)


@bounded(60)
async def test_a_groups_connection_list_of_many_subscriptions_is_written_with_the_loop_running():
    """GET_CONSUMER_CONNECTION_LIST of a group subscribed to 10,000 topics: its subscription table was written in
    one go (the other client got no turn); now 2,000 subscriptions at a time, the body byte for byte as before."""
    topics = 10_000
    subs = {f"T{i:05d}": SimpleNamespace(codes={3, 1}, tags={"b", "a"}, expression_type="TAG", sub_string="a || b",
                                         sub_version=7) for i in reversed(range(topics))}
    channels = {n: SimpleNamespace(conn=SimpleNamespace(peer=(f"10.0.0.{n}", 9)), client_id=f"c{n}", language=0,
                                   version=395) for n in (2, 1)}
    group = SimpleNamespace(channels=channels, subscriptions=subs, consume_from_where="CONSUME_FROM_LAST_OFFSET",
                            consume_type="CONSUME_PASSIVELY", message_model="CLUSTERING")
    ctx = SimpleNamespace(clients=SimpleNamespace(consumers={"G": group}))
    cmd = RemotingCommand.request(R.GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": "G"})
    async with other_client() as turns:
        resp = await ops.get_consumer_connection_list(ctx, None, cmd)
    assert resp.code == C.SUCCESS, resp.remark
    connections = [{"clientAddr": f"10.0.0.{n}:9", "clientId": f"c{n}", "language": "JAVA", "version": 395}
                   for n in (1, 2)]
    table = {t: {"classFilterMode": False, "codeSet": [1, 3], "expressionType": "TAG", "subString": "a || b",
                 "subVersion": 7, "tagsSet": ["a", "b"], "topic": t} for t in subs}
    assert resp.body_bytes() == dump({"connectionSet": connections, "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET",
                                      "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                                      "subscriptionTable": table}).encode()
    assert turns[0] >= topics // 2000 - 1, turns[0]


@bounded(60)
async def test_a_groups_consume_stats_over_many_topics_are_read_and_written_with_the_loop_running():
    """GET_CONSUME_STATS of a group holding offsets on 8 topics of 1,024 queues: 8,192 rows read and written in one
    go (the other client got no turn; 32 such topics held a loaded broker's loop about a second); now 2,048 queues
    at a time, the body byte for byte as before, a topic deleted meanwhile left out."""
    names = [f"T{i}" for i in range(8)]
    topics = {t: SimpleNamespace(read_queue_nums=1024) for t in names}
    offsets = {(t, q): q % 7 for t in names for q in range(0, 1024, 3)}
    ctx = SimpleNamespace(
        topics=topics, config=SimpleNamespace(broker_name="b"),
        offsets=SimpleNamespace(topics_of=lambda g: names + ["Gone"], get=lambda g, t, q: offsets.get((t, q))),
        clients=SimpleNamespace(reads_elsewhere=lambda g, t: False),
        metrics=SimpleNamespace(consume_tps=lambda g, t: 0.5),
        store=SimpleNamespace(max_offset=lambda t, q: q + 10, store_time_of=lambda t, q, o: 1000 * q + o))
    cmd = RemotingCommand.request(R.GET_CONSUME_STATS, {"consumerGroup": "G"})
    async with other_client() as turns:
        resp = await ops.get_consume_stats(ctx, None, cmd)
    assert resp.code == C.SUCCESS, resp.remark
    rows = {(t, "b", q): (q + 10, offsets.get((t, q), 0), 1000 * q + offsets[t, q] - 1 if offsets.get((t, q)) else 0)
            for t in names for q in range(1024)}
    assert resp.body_bytes() == encode_consume_stats(rows, 0.5 * len(names))
    assert turns[0] >= 2 * (len(rows) // 2048 - 1), turns[0]        # reading, then writing


def _random_status_body(rnd) -> bytes:
    """A GetConsumerStatusBody as a consumer may write it: MessageQueue keys (fastjson's form, or reordered, spaced,
    quoted, with an extra member, a queue id as text or with a leading zero, a member missing), unicode and escaped
    names, values of every JSON kind, other members holding object keys of their own."""
    def name():
        return "".join(rnd.choice("aT_0%é中😀\"\\ \n\x01:,") for _ in range(rnd.randint(0, 5)))

    def space():
        return rnd.choice(["", "", " ", "\n\t"])

    def key():
        members = {"topic": name(), "brokerName": name(), "queueId": rnd.choice([0, 7, -1, 10 ** 9, "2"])}
        if rnd.random() < 0.1:
            members["x"] = 1
        if rnd.random() < 0.1:
            del members[rnd.choice(sorted(members))]
        items = sorted(members.items())
        if rnd.random() < 0.3:
            rnd.shuffle(items)
        text = "{" + ",".join(f"{space()}{json.dumps(k)}{space()}:{space()}"
                              f"{'01' if v == 1 and rnd.random() < 0.5 else json.dumps(v, ensure_ascii=rnd.random() < 0.5)}"
                              f"{space()}" for k, v in items) + "}"
        return json.dumps(text) if rnd.random() < 0.15 else text

    def table():
        return "{" + ",".join(f"{space()}{key()}{space()}:{space()}{rnd.choice(['1', '-3', '2.5', 'null', '[1]'])}"
                              for _ in range(rnd.randint(0, 4))) + "}"

    other = rnd.choice(["", '"consumerTable":{},', '"consumerTable":{"c":%s},' % table(), '"a":[1,{"b":null}],'])
    return ("{" + other + '"messageQueueTable":' + table() + "}").encode()


def test_the_sliced_reading_agrees_with_decode_mq_table_on_random_and_damaged_bodies():
    """A property over 20,000 random bodies (a seeded generator: the same each run): what decode_mq_table reads,
    the sliced reader reads, and what it refuses is a HeaderError there too; a body damaged by a character cut or
    added is never read by the sliced reader into anything decode_mq_table would not. (Names hold no braces:
    decode_mq_table's own reading of a MessageQueue key stops at the first.)"""
    import random

    def outcome(read, body):
        try:
            return read(body)
        except HeaderError:
            return "refused"

    def old(body):
        return {(str(t), str(b), int(q)): v for (t, b, q), v in decode_mq_table(body, "messageQueueTable")[1].items()}

    rnd = random.Random(20261127)
    for _ in range(20_000):
        body = _random_status_body(rnd)
        assert outcome(lambda b: _read(b)[0], body) == outcome(old, body), body
        at = rnd.randrange(len(body) + 1)
        damaged = body[:at] + rnd.choice([b"", b"0", b",", b":", b'"', b"{", b"}"]) + body[at + 1:]
        new = outcome(lambda b: _read(b)[0], damaged)
        assert new == "refused" or new == outcome(old, damaged), damaged


def test_a_consumers_status_in_hash_order_is_sorted_a_slice_at_a_time():
    """A stock consumer writes its messageQueueTable in HashMap order, not sorted: the writer's one sort of all
    100,000 queues before its first slice was every comparison in one step (here 4.6 million; 250,000 queues held
    a loaded host's loop 3.6-4.7 s where the same queues in order took 0.08 s). Each step now compares at most a
    few slices' worth, the body as before."""
    import random

    from broker.slices import run_steps
    from protocol.admin_bodies import consumer_status_steps

    compared = [0]

    class Qid(int):             # counts the comparisons a sort of (topic, broker, queue id) keys makes
        def __eq__(self, other):
            compared[0] += 1
            return int.__eq__(self, other)

        def __lt__(self, other):
            compared[0] += 1
            return int.__lt__(self, other)

        __hash__ = int.__hash__

    queues = 100_000
    order = list(range(queues))
    random.Random(7).shuffle(order)
    offsets = {("T", "broker-a", Qid(q)): q * 3 for q in order}
    steps, most = consumer_status_steps({"c": offsets}), 0
    try:
        while True:
            compared[0] = 0
            next(steps)
            most = max(most, compared[0])
    except StopIteration as done:
        body = done.value
    most = max(most, compared[0])
    assert body == run_steps(consumer_status_steps({"c": dict(sorted(offsets.items()))}))
    assert body.startswith(b'{"consumerTable":{"c":{{"brokerName":"broker-a","queueId":0,"topic":"T"}:0,')
    assert most <= 16 * 2048 * 2, most          # a slice's sort, or a slice merged from the runs


@bounded(60)
async def test_all_producer_info_of_many_groups_is_written_with_the_loop_running():
    """GET_ALL_PRODUCER_INFO (328, mqadmin producer) of 10,000 producer groups (what max_groups_per_host lets one
    client's heartbeats make up): every group's ProducerInfo list was written in one go (the other client got no
    turn; 0.7-1.2 s of the loop on this loaded host); now 512 groups at a time, the body byte for byte as before, a
    group gone meanwhile left out."""
    groups = 10_000
    channels = {f"PG_{i:05d}": [SimpleNamespace(client_id=f"10.0.0.1@{i}", language=0, last_seen_ms=i, version=395,
                                                conn=SimpleNamespace(peer=("10.0.0.1", 5000 + i)))]
                for i in reversed(range(groups))}
    ctx = SimpleNamespace(clock=lambda: 1_000_000, clients=SimpleNamespace(
        clock=lambda: 1_000, producers=dict(channels), producer_channels=lambda g: channels.get(g, [])))
    cmd = RemotingCommand.request(R.GET_ALL_PRODUCER_INFO, {})
    async with other_client() as turns:
        answer = ops.get_all_producer_info(ctx, None, cmd)
        del channels["PG_09999"]            # (gone after the ask, before its slice is written)
        resp = await answer
    assert resp.code == C.SUCCESS, resp.remark
    data = {f"PG_{i:05d}": [{"clientId": f"10.0.0.1@{i}", "language": "JAVA", "lastUpdateTimestamp": i + 999_000,
                             "remoteIP": f"/10.0.0.1:{5000 + i}", "version": 395}] for i in range(groups - 1)}
    assert resp.body_bytes() == dump({"data": data}).encode()
    assert turns[0] >= groups // 512 - 1, turns[0]


@bounded(60)
async def test_a_groups_consume_stats_over_many_small_topics_take_a_turn_a_slice_of_queues_not_of_topics():
    """GET_CONSUME_STATS of a group holding offsets on 4,096 topics of one queue each: read two topics a turn, the
    answer waited 2,048 turns of the loop (each as long as every other client's work then: seconds on a busy
    broker, past mqadmin's timeout) for 4,096 rows; a turn every 2,048 queues read and written now."""
    names = [f"T{i:04d}" for i in range(4096)]
    ctx = SimpleNamespace(
        topics={t: SimpleNamespace(read_queue_nums=1) for t in names}, config=SimpleNamespace(broker_name="b"),
        offsets=SimpleNamespace(topics_of=lambda g: names, get=lambda g, t, q: 1),
        clients=SimpleNamespace(reads_elsewhere=lambda g, t: False),
        metrics=SimpleNamespace(consume_tps=lambda g, t: 0.0),
        store=SimpleNamespace(max_offset=lambda t, q: 5, store_time_of=lambda t, q, o: 7))
    cmd = RemotingCommand.request(R.GET_CONSUME_STATS, {"consumerGroup": "G"})
    async with other_client() as turns:
        resp = await ops.get_consume_stats(ctx, None, cmd)
    assert resp.body_bytes() == encode_consume_stats({(t, "b", 0): (5, 1, 7) for t in names})
    assert turns[0] <= 2 * 4096 // 2048 + 4, turns[0]


def _closing_conn():
    """A connection stand-in whose ``closed`` is set after the handler's first turn of the loop (the admin tool
    timed out and went, or a client that pipelined many such asks closed)."""
    conn = SimpleNamespace(closed=asyncio.Event())
    asyncio.get_running_loop().call_soon(conn.closed.set)
    return conn


@bounded(60)
async def test_sliced_answers_stop_once_their_connection_is_gone():
    """GET_ALL_PRODUCER_INFO, GET_CONSUMER_CONNECTION_LIST and GET_CONSUME_STATS written a slice at a time went on
    to the last slice after the asker's connection closed: a client pipelining its 256 asks and closing had the
    broker write 256 whole bodies for nobody (each 10,000 groups' ProducerInfo), the loop's turns spent on them.
    Each stops at the first turn after the close, cancelled as a handler whose connection closed (answered nothing,
    not counted)."""
    asked = [0]
    channels = {f"PG_{i:05d}": [SimpleNamespace(client_id=f"c{i}", language=0, last_seen_ms=i, version=395,
                                                conn=SimpleNamespace(peer=("10.0.0.1", 1)))] for i in range(10_000)}

    def producer_channels(g):
        asked[0] += 1
        return channels.get(g, [])
    ctx = SimpleNamespace(clock=lambda: 0, clients=SimpleNamespace(clock=lambda: 0, producers=dict(channels),
                                                                   producer_channels=producer_channels))
    with pytest.raises(asyncio.CancelledError):
        await ops.get_all_producer_info(ctx, _closing_conn(), RemotingCommand.request(R.GET_ALL_PRODUCER_INFO, {}))
    assert asked[0] <= 2 * ops.PRODUCER_GROUP_SLICE, asked[0]

    subs = {f"T{i:05d}": SimpleNamespace(codes=set(), tags=set(), expression_type="TAG", sub_string="*",
                                         sub_version=1) for i in range(10_000)}
    written = []
    real = ops.subscription_data
    group = SimpleNamespace(channels={1: SimpleNamespace(conn=SimpleNamespace(peer=("h", 1)), client_id="c",
                                                         language=0, version=395)},
                            subscriptions=subs, consume_from_where="W", consume_type="T", message_model="M")
    ops.subscription_data = lambda t, s: written.append(t) or real(t, s)
    try:
        with pytest.raises(asyncio.CancelledError):
            await ops.get_consumer_connection_list(
                SimpleNamespace(clients=SimpleNamespace(consumers={"G": group})), _closing_conn(),
                RemotingCommand.request(R.GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": "G"}))
    finally:
        ops.subscription_data = real
    assert len(written) <= 2 * ops.SUBSCRIPTION_SLICE, len(written)

    names = [f"T{i:04d}" for i in range(4096)]
    read = [0]

    def get(g, t, q):
        read[0] += 1
        return 1
    ctx = SimpleNamespace(
        topics={t: SimpleNamespace(read_queue_nums=4) for t in names}, config=SimpleNamespace(broker_name="b"),
        offsets=SimpleNamespace(topics_of=lambda g: names, get=get),
        clients=SimpleNamespace(reads_elsewhere=lambda g, t: False),
        metrics=SimpleNamespace(consume_tps=lambda g, t: 0.0),
        store=SimpleNamespace(max_offset=lambda t, q: 5, store_time_of=lambda t, q, o: 7))
    with pytest.raises(asyncio.CancelledError):
        await ops.get_consume_stats(ctx, _closing_conn(),
                                    RemotingCommand.request(R.GET_CONSUME_STATS, {"consumerGroup": "G"}))
    assert read[0] <= 2 * ops.CONSUME_STATS_SLICE, read[0]


@bounded(60)
async def test_a_consumers_status_is_not_written_once_the_askers_connection_is_gone():
    """INVOKE_BROKER_TO_GET_CONSUMER_STATUS: the asker gone while its consumer answered 100,000 queues, the
    broker's answer was still sorted and written, a slice a turn, for nobody; it stops at the first turn now."""
    asker = SimpleNamespace(closed=asyncio.Event())

    class Consumer:
        async def request(self, request, timeout):
            asker.closed.set()          # (mqadmin timed out meanwhile and went)
            return request.response(C.SUCCESS, body=_status_body(100_000))

    channel = SimpleNamespace(alive=True, client_id="10.0.0.1@1", conn=Consumer())
    ctx = SimpleNamespace(forwarding=0, clients=SimpleNamespace(consumers={"G": SimpleNamespace(channels={1: channel})}))
    cmd = RemotingCommand.request(R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS, {"topic": "T", "group": "G"})
    with pytest.raises(asyncio.CancelledError):
        await forward.invoke_broker_to_get_consumer_status(ctx, asker, cmd)


@bounded(60)
async def test_a_consumers_status_answer_is_not_read_once_the_askers_connection_is_gone():
    """The consumer's answer (up to a frame's 16 MiB) read a slice a turn went on to its end after the asker went;
    it stops at the first turn after the close now."""
    asker = SimpleNamespace(closed=asyncio.Event())
    read = [0]

    def steps(body, field, value):
        read[0] += 1
        for _ in range(100):
            asker.closed.set()
            read[0] += 1
            yield
        return {}
    real, forward.mq_table_steps = forward.mq_table_steps, steps
    try:
        ch = SimpleNamespace(client_id="c", conn=SimpleNamespace(
            request=lambda request, timeout: _answered(request.response(C.SUCCESS, body=b"{}"))))
        with pytest.raises(asyncio.CancelledError):
            await forward._consumer_status(None, ch, "T", "G", asker)
    finally:
        forward.mq_table_steps = real
    assert read[0] <= 2, read[0]


async def _answered(resp):
    return resp


@bounded(60)
async def test_all_subscription_groups_are_not_written_once_the_askers_connection_is_gone(tmp_path, monkeypatch):
    """GET_ALL_SUBSCRIPTIONGROUP_CONFIG (a slave's sync, or mqadmin) written a slice of groups at a time went on to
    the last slice after its asker's connection closed, as the other sliced answers did (seams B): 50,000 groups,
    11.9 MB, written for nobody each time a client asked and went. It stops at the first turn after the close."""
    from broker import subscriptions
    table = subscriptions.SubscriptionGroups(str(tmp_path), lambda: 0)
    written = []
    real = subscriptions.group_config
    monkeypatch.setattr(subscriptions, "group_config", lambda name, values=None: written.append(name) or real(name))
    ctx = SimpleNamespace(subscriptions=table, clients=SimpleNamespace(consumers={}),
                          offsets=SimpleNamespace(groups=lambda: [f"G{i:05d}" for i in range(20_000)]))
    with pytest.raises(asyncio.CancelledError):
        await ops.get_all_subscription_group(ctx, _closing_conn(),
                                             RemotingCommand.request(R.GET_ALL_SUBSCRIPTIONGROUP_CONFIG, {}))
    assert len(written) <= 2 * subscriptions.GROUP_SLICE, len(written)
