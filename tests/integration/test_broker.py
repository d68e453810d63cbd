"""The real broker over TCP: sends, pulls, routes, offsets, limits, metrics."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumer import PullConsumer, PullStatus
from consumer.pull_consumer import MessageQueue
from producer import Producer, SendStatus
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import MessageIllegalError, NoPermissionError
from protocol.message import SendMessageRequestHeader, decode_records
from protocol.route import decode_route
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


async def _conn(addr):
    host, _, port = addr.rpartition(":")
    return await open_connection(host, int(port))


async def _request(addr, code, fields=None, body=b"", version=409, timeout=5.0):
    conn = await _conn(addr)
    try:
        cmd = RemotingCommand.request(code, fields, body, version=version)
        return await conn.request(cmd, timeout)
    finally:
        conn.close()


async def test_send_then_pull_round_trip(broker):
    async with Producer(broker.namesrv, "PG_basic") as producer:
        results = [await producer.send("Orders", f"order-{i}".encode(), tags="TagA" if i % 2 else "TagB",
                                       keys=f"k{i}") for i in range(20)]
    assert all(r.status is SendStatus.SEND_OK for r in results)
    assert len({r.offset_msg_id for r in results}) == 20
    async with asyncio.timeout(20):
        consumer = PullConsumer(broker.namesrv, "CG_basic")
        queues = await consumer.fetch_queues("Orders")
        bodies, tagged = [], []
        for mq in queues:
            res = await consumer.pull(mq, 0, max_nums=64)
            bodies += [m.body for m in res.messages]
            res = await consumer.pull(mq, 0, max_nums=64, expression="TagA")
            tagged += [m.body for m in res.messages]
        await consumer.shutdown()
    assert sorted(bodies) == sorted(f"order-{i}".encode() for i in range(20))
    assert sorted(tagged) == sorted(f"order-{i}".encode() for i in range(1, 20, 2))


async def test_batch_send_gets_consecutive_offsets(broker):
    async with Producer(broker.namesrv, "PG_batch") as producer:
        mq = (await producer.routes.publish_queues("TBW102"))[0]
        await producer.send("Batched", b"warm-up")
        queues = await producer.routes.publish_queues("Batched")
        result = await producer.send_batch("Batched", [b"a", b"b", b"c"], queue=queues[0])
    assert mq.topic == "TBW102"
    ids = result.offset_msg_id.split(",")
    assert len(ids) == 3
    uniq = result.msg_id.split(",")     # the Java client's batch msgId: the messages' UNIQ_KEYs
    assert len(set(uniq)) == 3
    consumer = PullConsumer(broker.namesrv, "CG_batch")
    await consumer.fetch_queues("Batched")
    res = await consumer.pull(MessageQueue("Batched", queues[0].broker_name, queues[0].queue_id),
                              result.queue_offset, max_nums=10)
    assert [m.body for m in res.messages][:3] == [b"a", b"b", b"c"]
    assert [m.queue_offset for m in res.messages][:3] == [result.queue_offset + i for i in range(3)]
    assert [m.msg_id for m in res.messages][:3] == uniq
    await consumer.shutdown()


async def test_route_json_follows_the_client_version(broker):
    old = await _request(broker.namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}, version=121)
    new = await _request(broker.namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}, version=409)
    assert old.code == new.code == ResponseCode.SUCCESS
    assert b'{0:"' in old.body_bytes()
    assert b'{"0":"' in new.body_bytes()
    json.loads(new.body_bytes())
    route = decode_route(old.body_bytes())
    assert route.broker_datas[0].broker_addrs[0] == broker.broker
    missing = await _request(broker.namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "NoSuchTopic"})
    assert missing.code == ResponseCode.TOPIC_NOT_EXIST
    retry = await _request(broker.namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "%RETRY%G1"})
    assert retry.code == ResponseCode.SUCCESS
    # ... routed before its group's first heartbeat, not created by an (unauthenticated) route query
    topics = await _request(broker.namesrv, RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)
    assert "%RETRY%G1" not in json.loads(topics.body_bytes())["topicList"]


async def test_bad_requests_get_rocketmq_codes(broker):
    unknown = await _request(broker.broker, 9999)
    assert unknown.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED
    async with Producer(broker.namesrv, "PG_bad", retries=0) as producer:
        await producer.send("Fine", b"x")
        queues = await producer.routes.publish_queues("Fine")
        with pytest.raises(NoPermissionError):
            await producer.send("RMQ_SYS_TRANS_HALF_TOPIC", b"x", queue=queues[0].__class__(
                "RMQ_SYS_TRANS_HALF_TOPIC", queues[0].broker_name, 0))
        with pytest.raises(MessageIllegalError):
            await producer.send("Fine", b"x" * (4 * 1024 * 1024 + 1), queue=queues[0])
    hostile = {"a": "PG", "b": "../../etc/passwd", "c": "TBW102", "d": "4", "e": "0", "f": "0", "g": "0", "h": "0"}
    resp = await _request(broker.broker, RequestCode.SEND_MESSAGE_V2, hostile, b"x")
    assert resp.code == ResponseCode.SYSTEM_ERROR and "topic" in resp.remark
    missing_field = await _request(broker.broker, RequestCode.SEND_MESSAGE_V2, {"a": "PG"}, b"x")
    assert missing_field.code == ResponseCode.SYSTEM_ERROR
    bad_int = await _request(broker.broker, RequestCode.PULL_MESSAGE, {
        "consumerGroup": "G", "topic": "Fine", "queueId": "zero", "queueOffset": "0"})
    assert bad_int.code == ResponseCode.SYSTEM_ERROR and "queueId" in bad_int.remark


async def test_long_poll_is_woken_by_a_send(broker):
    consumer = PullConsumer(broker.namesrv, "CG_poll")
    async with Producer(broker.namesrv, "PG_poll") as producer:
        await producer.send("Polled", b"first")
        queues = await producer.routes.publish_queues("Polled")
        mq = queues[0]
        await consumer.fetch_queues("Polled")
        cmq = MessageQueue("Polled", mq.broker_name, mq.queue_id)
        start = (await consumer.pull(cmq, 0, max_nums=100)).next_begin_offset
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        pull = asyncio.ensure_future(consumer.pull(cmq, start, suspend_ms=15000))
        await asyncio.sleep(0)          # let the pull leave before the send
        done, _ = await asyncio.wait({pull}, timeout=0.3)
        assert not done, "an empty pull with the suspend flag must be held"
        await producer.send("Polled", b"wake", queue=mq)
        res = await asyncio.wait_for(pull, 10)
        assert res.status is PullStatus.FOUND and res.messages[0].body == b"wake"
        assert loop.time() - t0 < 10
        timed = await consumer.pull(cmq, res.next_begin_offset, suspend_ms=300)
        assert timed.status is PullStatus.NO_NEW_MSG
    await consumer.shutdown()


async def test_offsets_and_queue_bounds(broker):
    async with Producer(broker.namesrv, "PG_off") as producer:
        await producer.send("Offsets", b"0")
        mq = (await producer.routes.publish_queues("Offsets"))[0]
        for i in range(5):
            await producer.send("Offsets", str(i).encode(), queue=mq)
    consumer = PullConsumer(broker.namesrv, "CG_off")
    await consumer.fetch_queues("Offsets")
    cmq = MessageQueue("Offsets", mq.broker_name, mq.queue_id)
    top = await consumer.max_offset(cmq)
    assert top >= 5
    assert await consumer.min_offset(cmq) == 0
    assert await consumer.fetch_offset(cmq) == 0       # young queue: start at the beginning, as RocketMQ
    await consumer.commit_offset(cmq, 3)
    assert await consumer.fetch_offset(cmq) == 3
    assert await consumer.search_offset(cmq, 0) == 0
    await consumer.shutdown()


async def test_metrics_scrape(broker):
    async with Producer(broker.namesrv, "PG_metrics") as producer:
        for _ in range(3):
            await producer.send("Metered", b"m")
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    sent = [s for s in families["rocketmq_messages_in"].samples
            if s.name == "rocketmq_messages_in_total" and s.labels.get("topic") == "Metered"]
    assert sent and sent[0].value == 3
    assert "rocketmq_rpc_latency" in families
    assert "txmq_open_connections" in families
    assert "rocketmq_half_messages" in families
    flushes = [s for s in families["txmq_store_flush_latency_seconds"].samples if s.name.endswith("_count")]
    appends = [s for s in families["txmq_store_append_latency_seconds"].samples if s.name.endswith("_count")]
    assert flushes[0].value >= 1 and appends[0].value >= 3
    lag = families["rocketmq_consumer_lag_messages"]
    assert families["rocketmq_storage_size"].samples[0].value > 0 and lag is not None
    producers = {s.labels["producer_group"]: s.value for s in families["rocketmq_producer_connections"].samples}
    assert producers.get("PG_metrics") == 1


async def test_heartbeat_and_consumer_list(broker):
    consumer = PullConsumer(broker.namesrv, "CG_hb")
    async with Producer(broker.namesrv, "PG_hb") as producer:
        await producer.send("HB", b"x")
    await consumer.subscribe("HB", "*")
    resp = await _request(broker.broker, RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": "CG_hb"})
    assert resp.code == ResponseCode.SUCCESS
    assert consumer.client_id in json.loads(resp.body_bytes())["consumerIdList"]
    await consumer.shutdown()
    none = await _request(broker.broker, RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": "CG_none"})
    assert none.code == ResponseCode.SYSTEM_ERROR


async def _pull_suggestion(broker, group: str, offset: int) -> tuple[int, int]:
    """A stock push consumer's pull of Work queue 0 (its subscription carried): (code, suggestWhichBrokerId)."""
    resp = await _request(broker.broker, RequestCode.PULL_MESSAGE, {
        "consumerGroup": group, "topic": "Work", "queueId": 0, "queueOffset": offset, "maxMsgNums": 32,
        "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": "*", "subVersion": 1,
        "expressionType": "TAG"})
    return resp.code, resp.int_field("suggestWhichBrokerId")


@bounded(60)
async def test_slave_read_suggests_the_broker_ids_the_group_names(broker_factory):
    """With slaveReadEnable, RocketMQ's pull reply suggests the group's whichBrokerWhenConsumeSlowly to a
    consumer far behind the log end and the group's brokerId to any other; the stock consumer pulls from that
    broker id next. The broker suggested the defaults (1 and 0) whatever the group said: a group kept on the
    master (whichBrokerWhenConsumeSlowly 0) was sent to the slave when it fell behind, one set to read from its
    slave (brokerId 1) was kept on the master."""
    for ratio, field in (("0", "whichBrokerWhenConsumeSlowly"), ("100", "brokerId")):
        # ratio 0: every message counts as far behind (on disk); 100: none does
        broker = broker_factory("--slave-read-enable", "--access-message-in-memory-max-ratio", ratio, store=field)
        header = SendMessageRequestHeader(producer_group="PG_slave_read", topic="Work", queue_id=0)
        resp = await _request(broker.broker, RequestCode.SEND_MESSAGE, header.to_ext_fields(v2=False), b"read me")
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        default, configured = f"CG_{field}_default", f"CG_{field}_set"
        value = 0 if field == "whichBrokerWhenConsumeSlowly" else 1
        resp = await _request(broker.broker, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
                              json.dumps({"groupName": configured, field: value}).encode())
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        assert await _pull_suggestion(broker, default, 0) == (ResponseCode.SUCCESS, 1 - value), field
        assert await _pull_suggestion(broker, configured, 0) == (ResponseCode.SUCCESS, value), field
        if field == "brokerId":     # also when nothing is found: RocketMQ suggests it on every pull reply
            assert await _pull_suggestion(broker, configured, 1) == (ResponseCode.PULL_NOT_FOUND, value)


@bounded(60)
async def test_a_new_group_starts_from_zero_only_while_the_queues_first_message_is_in_memory(broker_factory):
    """QUERY_CONSUMER_OFFSET for a queue the group never consumed: 0 only while the queue's first message is within
    access_message_in_memory_max_ratio of RAM from the log's end (RocketMQ's checkInDiskByConsumeOffset), else
    QUERY_NOT_FOUND, so a stock client starts at the end (CONSUME_FROM_LAST_OFFSET) or at its timestamp
    (CONSUME_FROM_TIMESTAMP). It was 0 for any queue retention had not trimmed: a new group replayed the whole
    log and its timestamp was never asked for. Ratio 0 here: every stored message counts as on disk."""
    disk = broker_factory("--access-message-in-memory-max-ratio", "0", store="on-disk")
    memory = broker_factory(store="in-memory")          # the default 40% of RAM: a few bytes are in memory
    for b in (disk, memory):
        host, _, port = b.broker.rpartition(":")
        conn = await open_connection(host, int(port))
        try:
            create = RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
                "topic": "Young", "readQueueNums": 2, "writeQueueNums": 2, "perm": 6})
            assert (await conn.request(create, 5)).code == ResponseCode.SUCCESS
            header = SendMessageRequestHeader(producer_group="PG", topic="Young", queue_id=0)
            sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE,
                                                              header.to_ext_fields(v2=False), b"m"), 5)
            assert sent.code == ResponseCode.SUCCESS, sent.remark
            answers = []
            for qid in (0, 1):
                resp = await conn.request(RemotingCommand.request(RequestCode.QUERY_CONSUMER_OFFSET, {
                    "consumerGroup": "CG_new", "topic": "Young", "queueId": qid}), 5)
                answers.append((resp.code, resp.ext_fields.get("offset")))
        finally:
            conn.close()
        if b is disk:
            assert answers == [(ResponseCode.QUERY_NOT_FOUND, None), (ResponseCode.SUCCESS, "0")]   # q1 is empty
        else:
            assert answers == [(ResponseCode.SUCCESS, "0"), (ResponseCode.SUCCESS, "0")]


@bounded(60)
async def test_a_group_config_number_a_java_client_cannot_read_is_refused(broker_factory):
    """brokerId and whichBrokerWhenConsumeSlowly are Java longs, retryMaxTimes and retryQueueNums ints, in every
    RocketMQ client and tool. Any JSON number was taken: with slaveReadEnable the group's brokerId is now in every
    pull reply to it (suggestWhichBrokerId), and one past a long made each reply fail to decode in the stock
    consumer, which then pulled nothing. Refused as RocketMQ's broker refuses a body it cannot read."""
    broker = broker_factory("--slave-read-enable")
    for field, value in (("brokerId", 1 << 63), ("whichBrokerWhenConsumeSlowly", -(1 << 63) - 1),
                         ("retryQueueNums", 1 << 31), ("retryMaxTimes", -(1 << 31) - 1)):
        resp = await _request(broker.broker, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
                              json.dumps({"groupName": "CG_out_of_range", field: value}).encode())
        assert resp.code == ResponseCode.SYSTEM_ERROR, (field, resp.remark)
        assert field in resp.remark
    resp = await _request(broker.broker, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
                          json.dumps({"groupName": "CG_out_of_range", "brokerId": (1 << 63) - 1}).encode())
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    # A file saved before the range was checked: loaded as it is (its other groups kept), the id not suggested.
    assert broker.stop() == 0
    path = broker.store_dir / "config" / "subscriptionGroup.json"
    saved = json.loads(path.read_text())
    saved["subscriptionGroupTable"]["CG_out_of_range"]["brokerId"] = 1 << 64
    path.write_text(json.dumps(saved))
    broker.start()
    header = SendMessageRequestHeader(producer_group="PG_out_of_range", topic="Work", queue_id=0)
    resp = await _request(broker.broker, RequestCode.SEND_MESSAGE, header.to_ext_fields(v2=False), b"read me")
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    assert await _pull_suggestion(broker, "CG_out_of_range", 0) == (ResponseCode.SUCCESS, 0)


@bounded(60)
async def test_tags_with_one_hash_code_reach_the_client_by_code_and_are_told_apart_there(broker):
    """"Aa" and "BB" have one Java hashCode (2112). The broker filters by the consume queue's tag code only, as
    RocketMQ's ExpressionMessageFilter.isMatchedByConsumeQueue: a stock push consumer subscribed to "Aa" (its
    heartbeat's tagsSet and codeSet, a pull without the subscription flag) is given both; its client filters
    again by the tag itself (tagsSet). Ours do the same: each gets only its own tag, not the other's, and no
    message without a tag."""
    async with Producer(broker.namesrv, "PG_hash") as producer:
        await producer.send("HashTags", b"seed", tags="C")
        mq = (await producer.routes.publish_queues("HashTags"))[0]
        for tag in ("Aa", "BB", "Aa", "C", None, "BB"):
            await producer.send("HashTags", (tag or "none").encode(), tags=tag, queue=mq)
    conn = await _conn(broker.broker)
    try:
        beat = {"clientID": "127.0.0.1@hash", "producerDataSet": [], "consumerDataSet": [{
            "groupName": "CG_hash_java", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
            "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "unitMode": False, "subscriptionDataSet": [{
                "classFilterMode": False, "topic": "HashTags", "subString": "Aa", "tagsSet": ["Aa"],
                "codeSet": [2112], "subVersion": 1, "expressionType": "TAG"}]}]}
        resp = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, None, json.dumps(beat).encode()), 5)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        resp = await conn.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "CG_hash_java", "topic": "HashTags", "queueId": mq.queue_id, "queueOffset": 0,
            "maxMsgNums": 32, "sysFlag": 0, "commitOffset": 0, "suspendTimeoutMillis": 0, "subVersion": 1,
            "expressionType": "TAG"}), 5)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        # by code: both tags, neither C (the seed among them) nor the untagged one
        assert [m.body for m in decode_records(resp.body_bytes())] == [b"Aa", b"BB", b"Aa", b"BB"]
    finally:
        conn.close()
    consumer = PullConsumer(broker.namesrv, "CG_hash")
    try:
        cmq = next(q for q in await consumer.fetch_queues("HashTags") if q.queue_id == mq.queue_id)
        for tag in ("Aa", "BB"):
            got = await consumer.pull(cmq, 0, max_nums=32, expression=tag)
            assert [m.body for m in got.messages] == [tag.encode()] * 2, (tag, got)
        both = await consumer.pull(cmq, 0, max_nums=32, expression="BB || C")
        assert sorted(m.body for m in both.messages) == [b"BB", b"BB", b"C", b"seed"]
    finally:
        await consumer.shutdown()


@bounded(60)
async def test_a_changed_subscription_with_an_older_version_is_kept_out_and_said(broker):
    """A heartbeat's subVersion is the client's wall clock when it subscribed; as RocketMQ's updateSubscription,
    a changed subscription with an older one than the group's is kept out (members that differ do not flip it).
    A consumer whose clock went back (or restarted on a host behind) re-subscribing from tag A to B was kept to A,
    its pulls without a subscription (a stock push consumer's) given A's messages, B's passed over unread, nothing
    said. Kept still, now counted (txmq_subscriptions_kept_older_total) and said at WARNING once a minute a group;
    a repeat of the kept expression with an older version (our consumers' heartbeats after a step back) is not."""
    async with Producer(broker.namesrv, "PG_stale") as producer:
        mq = (await producer.routes.publish_queues("StaleSub"))[0]
        for tag in ("A", "B"):
            await producer.send("StaleSub", tag.encode(), tags=tag, queue=mq)
    conn = await _conn(broker.broker)

    async def beat(tag: str, version: int) -> None:
        body = {"clientID": "127.0.0.1@stale", "producerDataSet": [], "consumerDataSet": [{
            "groupName": "CG_stale", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
            "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "unitMode": False, "subscriptionDataSet": [{
                "classFilterMode": False, "topic": "StaleSub", "subString": tag, "tagsSet": [tag],
                "codeSet": [ord(tag)], "subVersion": version, "expressionType": "TAG"}]}]}
        resp = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, None, json.dumps(body).encode()), 5)
        assert resp.code == ResponseCode.SUCCESS, resp.remark

    def kept_older() -> float:
        text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode()
        return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "txmq_subscriptions_kept_older_total" and s.labels == {"consumer_group": "CG_stale"}),
                    0.0)
    try:
        await beat("A", 1_700_000_600_000)
        await beat("A", 1_700_000_000_000)      # the same expression, older: nothing to say
        assert await asyncio.to_thread(kept_older) == 0
        await beat("B", 1_700_000_000_000)      # changed, ten minutes older
        await beat("B", 1_700_000_000_000)
        resp = await conn.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "CG_stale", "topic": "StaleSub", "queueId": mq.queue_id, "queueOffset": 0,
            "maxMsgNums": 32, "sysFlag": 0, "commitOffset": 0, "suspendTimeoutMillis": 0,
            "subVersion": 1_700_000_000_000, "expressionType": "TAG"}), 5)
        assert [m.body for m in decode_records(resp.body_bytes())] == [b"A"]      # kept, as RocketMQ
    finally:
        conn.close()
    assert await asyncio.to_thread(kept_older) == 2
    assert broker.log().count("subscribes to StaleSub with 'B'") == 1, broker.log()[-2000:]
