"""Names a client chooses (topics, groups) and what the broker keeps under them: read back as written, across a
restart, and never one client's name taking another's place."""
from __future__ import annotations

import itertools

import pytest

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

_OPAQUES = itertools.count(1 << 24)     # a RawClient files replies by opaque: one each


def _raw(code: int, fields: dict | None = None, body: bytes = b"") -> RemotingCommand:
    return RemotingCommand.request(code, fields, body, opaque=next(_OPAQUES))


def _hostport(addr):
    host, _, port = addr.rpartition(":")
    return host, int(port)


async def _request(broker, code: int, fields: dict, body: bytes = b""):
    conn = await open_connection(*_hostport(broker.broker))
    try:
        return await conn.request(RemotingCommand.request(code, fields, body), 5)
    finally:
        conn.close()


async def _create_topic(broker, topic: str) -> None:
    reply = await _request(broker, RequestCode.UPDATE_AND_CREATE_TOPIC,
                           {"topic": topic, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6})
    assert reply.code == ResponseCode.SUCCESS, reply.remark


async def _fill(broker, topic: str, n: int) -> None:
    """``n`` messages in queue 0 of ``topic``: offsets past a queue's end are lowered to it at start-up."""
    conn = await open_connection(*_hostport(broker.broker))
    try:
        for _ in range(n):
            reply = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, {
                "producerGroup": "PG_names", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": 1,
                "queueId": 0, "sysFlag": 0, "bornTimestamp": 0, "flag": 0, "properties": ""}, b"m"), 5)
            assert reply.code == ResponseCode.SUCCESS, reply.remark
    finally:
        conn.close()


async def _commit(broker, group: str, topic: str, offset: int) -> None:
    reply = await _request(broker, RequestCode.UPDATE_CONSUMER_OFFSET,
                           {"consumerGroup": group, "topic": topic, "queueId": 0, "commitOffset": offset})
    assert reply.code == ResponseCode.SUCCESS, reply.remark


async def _committed(broker, group: str, topic: str) -> int | None:
    reply = await _request(broker, RequestCode.QUERY_CONSUMER_OFFSET,
                           {"consumerGroup": group, "topic": topic, "queueId": 0})
    return int(reply.ext_fields["offset"]) if reply.code == ResponseCode.SUCCESS else None


@bounded(60)
async def test_offsets_of_groups_with_an_at_sign_read_back_after_a_restart(broker):
    """consumerOffset.json keys an offset "<topic>@<group>" (RocketMQ's ConsumerOffsetManager). The broker checks
    no group name, and the key was split at its last "@": after a restart the offset of group "CG_odd@" was read
    as group "" of topic "Names@CG_odd", and "CG_a@b"'s as group "b" of topic "Names@CG_a" -- both groups back to
    their consume-from policy, without a word. A topic name holds no "@" (it is refused at creation, as RocketMQ's
    TopicValidator refuses it), so the key splits at its first "@"."""
    topic = "Names"
    await _create_topic(broker, topic)
    await _fill(broker, topic, 5)
    groups = {"CG_odd@": 1, "CG_a@b": 2, "@CG_lead": 3, "b": 4, "CG_plain": 5}
    for group, offset in groups.items():
        await _commit(broker, group, topic, offset)
    assert broker.stop() == 0
    broker.start()
    assert {g: await _committed(broker, g, topic) for g in groups} == groups


def _ipv6_loopback() -> str | None:
    """None when this machine can listen on ::1, else why not."""
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        return f"no IPv6 loopback here ({exc}): the per-host caps of IPv6 peers are covered by the unit tests " \
               "of client_key (tests/unit/test_connection_gate.py)"
    return None


@bounded(60)
async def test_an_ipv6_client_is_held_to_the_per_host_caps(broker_factory):
    """IPv6 peers are keyed by client_key (their /64; ::1 as itself): one on ::1 is held to
    max_connections_per_host like any host, and what it sends is stored and answered (its born host an IPv6 one)."""
    why = _ipv6_loopback()
    if why is not None:
        pytest.skip(why)
    broker = broker_factory("--host", "::1", "--max-connections-per-host", "3")
    assert broker.broker.startswith("::1:")
    from tests.support.raw_client import RawClient
    clients = [await RawClient.open(broker.broker) for _ in range(5)]
    try:
        served = []
        for c in clients:           # each answered, or closed on accept: the broker has seen every one
            reply = await c.call(_raw(RequestCode.GET_BROKER_RUNTIME_INFO), 10)
            assert reply != [], "neither answered nor closed"
            if reply is not None:
                served.append(c)
        assert len(served) == 3
        [created] = await served[0].call(_raw(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": "Names6", "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 10)
        assert created.code == ResponseCode.SUCCESS, created.remark
        [sent] = await served[0].call(_raw(RequestCode.SEND_MESSAGE, {
            "producerGroup": "PG_names", "topic": "Names6", "defaultTopic": "TBW102", "defaultTopicQueueNums": 1,
            "queueId": 0, "sysFlag": 0, "bornTimestamp": 0, "flag": 0, "properties": ""}, b"m"), 10)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
    finally:
        for c in clients:
            c.close()
    assert "max_connections_per_host" in broker.log() and "from ::1" in broker.log()


@bounded(60)
async def test_group_names_past_255_characters_are_not_kept(broker):
    """Group names were kept as given, each table capped by count only (max_groups_per_host, max_queue_locks, ...):
    forty heartbeats from one connection, each naming a 4 MiB producer group, grew the broker by 176 MB, and
    10,000 of them could take 40 GB. A name past 255 characters (RocketMQ's Validators.CHARACTER_MAX_LENGTH;
    a stock client refuses it at start) is now refused wherever the broker would keep it."""
    import json

    from protocol.admin_bodies import decode_consumer_offsets

    await _create_topic(broker, "Groups")
    await _fill(broker, "Groups", 1)
    long, longest = "G" * 256, "G" * 255

    def heartbeat(group: str) -> bytes:
        return json.dumps({"clientID": "names", "producerDataSet": [{"groupName": group}], "consumerDataSet": [
            {"groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
             "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "subscriptionDataSet": []}]}).encode()

    conn = await open_connection(*_hostport(broker.broker))
    try:
        async def ask(code, fields, body=b""):
            return await conn.request(RemotingCommand.request(code, fields, body), 5)
        refused = await ask(RequestCode.HEART_BEAT, {}, heartbeat(long))
        assert refused.code != ResponseCode.SUCCESS and "longer than 255" in refused.remark
        assert (await ask(RequestCode.HEART_BEAT, {}, heartbeat(longest))).code == ResponseCode.SUCCESS
        listed = {g: (await ask(RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": g})).code
                  for g in (long, longest)}
        assert listed == {long: ResponseCode.SYSTEM_ERROR, longest: ResponseCode.SUCCESS}
        for group in (long, longest):
            await ask(RequestCode.UPDATE_CONSUMER_OFFSET,
                      {"consumerGroup": group, "topic": "Groups", "queueId": 0, "commitOffset": 1})
        mq = [{"topic": "Groups", "brokerName": "broker-a", "queueId": 0}]
        locked = await ask(RequestCode.LOCK_BATCH_MQ, {},
                           json.dumps({"consumerGroup": long, "clientId": "names", "mqSet": mq}).encode())
        assert locked.code != ResponseCode.SUCCESS and "longer than 255" in locked.remark
        pulled = await ask(RequestCode.PULL_MESSAGE, {
            "consumerGroup": long, "topic": "Groups", "queueId": 0, "queueOffset": 0, "maxMsgNums": 1,
            "sysFlag": 1 | 4, "commitOffset": 1, "suspendTimeoutMillis": 0, "subscription": "*", "subVersion": 0,
            "expressionType": "TAG"})
        assert pulled.code == ResponseCode.SYSTEM_ERROR and "longer than 255" in pulled.remark
        half = await ask(RequestCode.SEND_MESSAGE, {
            "producerGroup": long, "topic": "Groups", "defaultTopic": "TBW102", "defaultTopicQueueNums": 1,
            "queueId": 0, "sysFlag": 4, "bornTimestamp": 0, "flag": 0, "properties": "TRAN_MSG\x01true\x02"}, b"h")
        assert half.code == ResponseCode.MESSAGE_ILLEGAL and "longer than 255" in half.remark
        everything = await ask(RequestCode.GET_ALL_CONSUMER_OFFSET, {})
        stored = {g for g, t, _ in decode_consumer_offsets(everything.body_bytes()) if t == "Groups"}
        assert stored == {longest}
    finally:
        conn.close()


@bounded(60)
async def test_a_client_cannot_commit_the_brokers_own_transaction_progress(broker):
    """The broker keeps how far its half queue is settled as the offset of group CID_RMQ_SYS_TRANS (RocketMQ's
    name) on RMQ_SYS_TRANS_HALF_TOPIC, and a start-up without a usable transaction snapshot reads the halves
    from there. Any client could commit that offset (UPDATE_CONSUMER_OFFSET, or a pull's commitOffset): moved
    past undecided halves, a restart never saw them again -- never checked, never decided, without a word."""
    from protocol.admin_bodies import decode_consumer_offsets

    key = ("CID_RMQ_SYS_TRANS", "RMQ_SYS_TRANS_HALF_TOPIC", 0)
    conn = await open_connection(*_hostport(broker.broker))
    try:
        async def ask(code, fields):
            return await conn.request(RemotingCommand.request(code, fields), 5)
        before = decode_consumer_offsets((await ask(RequestCode.GET_ALL_CONSUMER_OFFSET, {})).body_bytes()).get(key)
        committed = await ask(RequestCode.UPDATE_CONSUMER_OFFSET, {
            "consumerGroup": key[0], "topic": key[1], "queueId": 0, "commitOffset": 1 << 40})
        assert committed.code == ResponseCode.NO_PERMISSION and "the broker's own" in committed.remark
        await ask(RequestCode.PULL_MESSAGE, {                   # answered as any pull; its commit is not kept
            "consumerGroup": key[0], "topic": key[1], "queueId": 0, "queueOffset": 0, "maxMsgNums": 1,
            "sysFlag": 1 | 4, "commitOffset": 1 << 40, "suspendTimeoutMillis": 0, "subscription": "*",
            "subVersion": 0, "expressionType": "TAG"})
        after = decode_consumer_offsets((await ask(RequestCode.GET_ALL_CONSUMER_OFFSET, {})).body_bytes()).get(key)
    finally:
        conn.close()
    assert after == before != 1 << 40


@bounded(60)
async def test_a_group_name_that_is_not_utf8_is_refused_and_metrics_still_answer(broker):
    """JSON may spell a lone surrogate ("\\ud800"), which no UTF-8 text holds. Request headers holding one were
    refused already; a heartbeat's group names were not: the group was joined, and the /metrics page, which
    labels producers and consumers by group, answered HTTP 500 to every scrape while it stayed -- every broker
    metric gone for one client's name. Such a group name is refused where one is kept (heartbeats, locks)."""
    import asyncio
    import json
    import urllib.request

    from tests.support.raw_client import RawClient

    def heartbeat(group: str) -> bytes:
        return json.dumps({"clientID": "names", "producerDataSet": [{"groupName": "P" + group}], "consumerDataSet": [
            {"groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
             "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "subscriptionDataSet": []}]}).encode()    # escaped

    def scrape() -> tuple[int, bytes]:
        with urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=10) as page:
            return page.status, page.read()

    client = await RawClient.open(broker.broker)
    try:
        [beat] = await client.call(_raw(RequestCode.HEART_BEAT, {}, heartbeat("G\ud800")), 10)
        assert beat.code != ResponseCode.SUCCESS and "UTF-8" in beat.remark
        body = json.dumps({"consumerGroup": "G\ud800", "clientId": "names",
                           "mqSet": [{"topic": "TBW102", "brokerName": "broker-a", "queueId": 0}]}).encode()
        [locked] = await client.call(_raw(RequestCode.LOCK_BATCH_MQ, {}, body), 10)
        assert locked.code != ResponseCode.SUCCESS and "UTF-8" in locked.remark
        [ok] = await client.call(_raw(RequestCode.HEART_BEAT, {}, heartbeat("G_fine")), 10)
        assert ok.code == ResponseCode.SUCCESS
        status, page = await asyncio.to_thread(scrape)      # while its groups are joined: they go when it closes
    finally:
        client.close()
    assert status == 200 and b'group="G_fine"' in page


@bounded(60)
async def test_a_send_cannot_plant_a_topic_in_the_system_namespace(broker):
    """A send auto-created any topic its name allowed, "rmq_sys_..." too -- the prefix RocketMQ keeps for its
    system topics, which DELETE_TOPIC_IN_BROKER refuses, as RocketMQ's does. So a client could plant topics
    nobody could delete: each held a place of max_topics for good (only an offline edit of topics.json took
    it back). A topic of that prefix the broker does not have is now refused, NO_PERMISSION saying why."""
    client = await open_connection(*_hostport(broker.broker))
    try:
        async def ask(code, fields, body=b""):
            return await client.request(RemotingCommand.request(code, fields, body), 5)
        sent = await ask(RequestCode.SEND_MESSAGE, {
            "producerGroup": "PG_names", "topic": "rmq_sys_planted", "defaultTopic": "TBW102",
            "defaultTopicQueueNums": 1, "queueId": 0, "sysFlag": 0, "bornTimestamp": 0, "flag": 0,
            "properties": ""}, b"m")
        assert sent.code == ResponseCode.NO_PERMISSION and "rmq_sys_" in sent.remark
        table = (await ask(RequestCode.GET_ALL_TOPIC_CONFIG, {})).body_bytes()
    finally:
        client.close()
    assert b"rmq_sys_planted" not in table


@bounded(60)
async def test_an_offset_reset_cannot_move_the_brokers_own_transaction_progress(broker):
    """UPDATE_CONSUMER_OFFSET and a pull's commitOffset no longer move CID_RMQ_SYS_TRANS's offset on the half
    queue; INVOKE_BROKER_TO_RESET_OFFSET (mqadmin resetOffsetByTime, which this port takes from anyone without an
    ACL) still did: reset to the end (timestamp -1, forced), the progress passed an undecided half, which a
    start-up without a usable snapshot then never read -- never checked, never decided."""
    from protocol.admin_bodies import decode_consumer_offsets

    key = ("CID_RMQ_SYS_TRANS", "RMQ_SYS_TRANS_HALF_TOPIC", 0)
    await _create_topic(broker, "Progress")
    half = await _request(broker, RequestCode.SEND_MESSAGE, {
        "producerGroup": "PG_progress", "topic": "Progress", "defaultTopic": "TBW102", "defaultTopicQueueNums": 1,
        "queueId": 0, "sysFlag": 4, "bornTimestamp": 0, "flag": 0, "properties": "TRAN_MSG\x01true\x02"}, b"h")
    assert half.code == ResponseCode.SUCCESS, half.remark
    assert broker.stop() == 0           # the progress is written at stop: the half's, 0
    broker.start()

    async def progress():
        reply = await _request(broker, RequestCode.GET_ALL_CONSUMER_OFFSET, {})
        return decode_consumer_offsets(reply.body_bytes()).get(key)
    assert await progress() == 0
    reset = await _request(broker, RequestCode.INVOKE_BROKER_TO_RESET_OFFSET, {
        "topic": key[1], "group": key[0], "timestamp": -1, "isForce": True})
    assert reset.code == ResponseCode.NO_PERMISSION and "the broker's own" in reset.remark
    assert await progress() == 0


@bounded(60)
async def test_subscription_group_configs_refuse_names_no_heartbeat_may_use(broker):
    """UPDATE_AND_CREATE_SUBSCRIPTIONGROUP kept any groupName: one of megabytes (the count-only caps again), or
    one that is not UTF-8 (JSON's "\\ud800"), which made every write of subscriptionGroup.json fail -- this
    request's, and every later one's for any group, and every GET_ALL_SUBSCRIPTIONGROUP_CONFIG (a slave's copy,
    mqadmin's listing) -- for as long as the broker ran. Such a name is refused as a heartbeat's is."""
    import json

    def config(name: str) -> bytes:
        return json.dumps({"groupName": name, "consumeEnable": True}).encode()     # ensure_ascii: "\ud800"

    for bad, why in (("G\ud800", "UTF-8"), ("G" * 256, "longer than 255")):
        refused = await _request(broker, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {}, config(bad))
        assert refused.code == ResponseCode.SYSTEM_ERROR and why in refused.remark, refused.remark
    fine = await _request(broker, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {}, config("CG_fine"))
    assert fine.code == ResponseCode.SUCCESS, fine.remark
    listed = await _request(broker, RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG, {})
    assert listed.code == ResponseCode.SUCCESS, listed.remark
    table = json.loads(listed.body_bytes())["subscriptionGroupTable"]
    assert "CG_fine" in table and not [g for g in table if g.startswith("GG") or "\ud800" in g]
