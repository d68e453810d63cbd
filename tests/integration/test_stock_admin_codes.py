"""Request codes mqadmin 4.9.8 sends that txmq answered REQUEST_CODE_NOT_SUPPORTED: each is sent here as the
stock tool frames it, to the real broker or name server over TCP, and the answer read as the Java tool reads
it (docs/compatibility.md has the whole table)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request

import pytest

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from producer import Producer
from protocol.admin_bodies import decode_mq_table
from protocol.codes import LanguageCode, ResponseCode
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import decode_records
from tests.support.bounded import bounded
from tests.support.cluster_process import NamesrvProcess, cluster_flags, request, route, wait_for_route

pytestmark = pytest.mark.asyncio


async def _connect(addr: str):
    host, _, port = addr.rpartition(":")
    return await open_connection(host, int(port))


def _java_heartbeat(client_id: str, *groups: str) -> RemotingCommand:
    """A 4.9.8 producer's HEART_BEAT: its groups and the client's inner producer, no consumers."""
    body = {"clientID": client_id, "consumerDataSet": [],
            "producerDataSet": [{"groupName": g} for g in (*groups, "CLIENT_INNER_PRODUCER")]}
    return RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode(), language=LanguageCode.JAVA)


@bounded(60)
async def test_producer_connection_lists_the_groups_live_producers(broker):
    """mqadmin producerConnection: GET_PRODUCER_CONNECTION_LIST {producerGroup} answered a ProducerConnection,
    {"connectionSet":[Connection]}; it was REQUEST_CODE_NOT_SUPPORTED and the command failed."""
    one, two = await _connect(broker.broker), await _connect(broker.broker)
    try:
        for conn, cid in ((one, "10.0.0.1@111"), (two, "10.0.0.2@222")):
            assert (await conn.request(_java_heartbeat(cid, "PG_conn"), 5.0)).code == ResponseCode.SUCCESS
        resp = await request(broker.broker, R.GET_PRODUCER_CONNECTION_LIST, {"producerGroup": "PG_conn"})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        body = json.loads(resp.body_bytes())
        assert list(body) == ["connectionSet"]
        rows = body["connectionSet"]
        assert [(c["clientId"], c["language"], c["version"]) for c in rows] == [
            ("10.0.0.1@111", "JAVA", 409), ("10.0.0.2@222", "JAVA", 409)]
        assert {c["clientAddr"] for c in rows} == {f"127.0.0.1:{c.transport.get_extra_info('sockname')[1]}"
                                                   for c in (one, two)}
        assert all(list(c) == ["clientAddr", "clientId", "language", "version"] for c in rows)   # fastjson order
    finally:
        one.close()
        two.close()
    unknown = await request(broker.broker, R.GET_PRODUCER_CONNECTION_LIST, {"producerGroup": "PG_nobody"})
    assert (unknown.code, unknown.remark) == (ResponseCode.SYSTEM_ERROR, "the producer group[PG_nobody] not exist")


def _delete_in_namesrv(topic: str, cluster: str | None = "DefaultCluster") -> tuple[int, dict]:
    """mqadmin deleteTopic's DELETE_TOPIC_IN_NAMESRV header (clusterName absent when the tool gives none)."""
    return R.DELETE_TOPIC_IN_NAMESRV, {"topic": topic, **({"clusterName": cluster} if cluster is not None else {})}


@bounded(60)
async def test_delete_topic_in_the_stand_alone_name_server_takes_it_out_of_the_routes(tmp_path, broker_factory):
    """mqadmin deleteTopic ends with DELETE_TOPIC_IN_NAMESRV to every name server: answered
    REQUEST_CODE_NOT_SUPPORTED, the command failed after the brokers had deleted the topic. RocketMQ drops the
    topic's queues of the named cluster's brokers (of every broker when no cluster is named) at once; the
    broker here registers only once a minute, so only the name server's delete can take the route away."""
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    try:
        b = broker_factory(*cluster_flags(namesrv.addr, "broker-a", 60_000))
        for topic in ("Doomed", "Spared", "Kept"):
            assert (await request(b.broker, R.UPDATE_AND_CREATE_TOPIC, {
                "topic": topic, "readQueueNums": 2, "writeQueueNums": 2, "perm": 6})).code == ResponseCode.SUCCESS
            await wait_for_route(namesrv.addr, topic, {"broker-a"})
        other = await request(namesrv.addr, *_delete_in_namesrv("Spared", "OtherCluster"))
        assert other.code == ResponseCode.SUCCESS, other.remark
        assert await route(namesrv.addr, "Spared") is not None      # not a broker of that cluster
        for topic, cluster in (("Doomed", "DefaultCluster"), ("Spared", None)):
            done = await request(namesrv.addr, *_delete_in_namesrv(topic, cluster))
            assert done.code == ResponseCode.SUCCESS, done.remark
            assert await route(namesrv.addr, topic) is None
        assert await route(namesrv.addr, "Kept") is not None
        listed = json.loads((await request(namesrv.addr, R.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)).body_bytes())
        assert {"Doomed", "Spared"}.isdisjoint(listed["topicList"]) and "Kept" in listed["topicList"]
        missing = await request(namesrv.addr, R.DELETE_TOPIC_IN_NAMESRV, {"clusterName": "DefaultCluster"})
        assert missing.code != ResponseCode.SUCCESS and "topic" in missing.remark
    finally:
        namesrv.kill()


@bounded(60)
async def test_delete_topic_in_the_brokers_own_name_server_follows_the_broker(broker):
    """The broker's own name server routes the broker's topics: after DELETE_TOPIC_IN_BROKER the name server
    step is SUCCESS (mqadmin deleteTopic succeeds); a topic the broker still holds is refused saying so."""
    for topic in ("Doomed", "Held"):
        assert (await request(broker.broker, R.UPDATE_AND_CREATE_TOPIC, {
            "topic": topic, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6})).code == ResponseCode.SUCCESS
    assert (await request(broker.broker, R.DELETE_TOPIC_IN_BROKER, {"topic": "Doomed"})).code == ResponseCode.SUCCESS
    done = await request(broker.namesrv, *_delete_in_namesrv("Doomed"))
    assert done.code == ResponseCode.SUCCESS, done.remark
    assert await route(broker.namesrv, "Doomed") is None
    held = await request(broker.namesrv, *_delete_in_namesrv("Held", None))
    assert held.code == ResponseCode.SYSTEM_ERROR and "DELETE_TOPIC_IN_BROKER" in held.remark
    assert await route(broker.namesrv, "Held") is not None
    elsewhere = await request(broker.namesrv, *_delete_in_namesrv("Held", "OtherCluster"))
    assert elsewhere.code == ResponseCode.SUCCESS, elsewhere.remark


def _cluster_list_in_out(table: dict) -> tuple[float, float]:
    """What mqadmin clusterList does with a broker's runtime table: the first of putTps and getTransferedTps,
    split on spaces and parsed as doubles (a missing key was a NullPointerException printed for each broker)."""
    return float(table["putTps"].split(" ")[0]), float(table["getTransferedTps"].split(" ")[0])


@bounded(60)
async def test_runtime_info_has_the_rates_cluster_list_reads(broker):
    table = json.loads((await request(broker.broker, R.GET_BROKER_RUNTIME_INFO)).body_bytes())["table"]
    assert all(len(table[k].split(" ")) == 3 for k in ("putTps", "getTransferedTps"))
    assert _cluster_list_in_out(table) == (0.0, 0.0)
    async with Producer(broker.namesrv, "PG_tps") as producer:
        for i in range(20):
            await producer.send("Tps", f"m{i}".encode())
    put_tps = 0.0
    for _ in range(100):                    # the broker samples its totals once a second
        table = json.loads((await request(broker.broker, R.GET_BROKER_RUNTIME_INFO)).body_bytes())["table"]
        put_tps, _get_tps = _cluster_list_in_out(table)
        if put_tps > 0:
            break
        await asyncio.sleep(0.1)
    # 20 messages over sample gaps of a second by the loop's timer, which uvloop may fire early by time.monotonic
    # (a CI run read 20.0009): libuv's clock is in whole ms, and where the kernel's coarse clock ticks every ms
    # libuv reads that one, a tick behind: up to 2 ms in all. The rate is 20 / gap: 0.5% covers it.
    assert 0 < put_tps <= 20 * 1.005, {k: table[k] for k in ("putTps", "getTransferedTps", "msgPutTotalTodayNow")}


# A 4.9.8 consumer's ConsumerRunningInfo as fastjson writes it: a map keyed by MessageQueue objects (not JSON),
# passed through untouched.
_RUNNING_INFO = (b'{"jstack":"","mqTable":{{"brokerName":"broker-a","queueId":0,"topic":"Orders"}:{"cachedMsgCount":0,'
                 b'"commitOffset":12,"droped":false,"locked":false}},"properties":{"PROP_CONSUME_TYPE":'
                 b'"CONSUME_PASSIVELY","PROP_CLIENT_VERSION":"V4_9_8"},"statusTable":{},"subscriptionSet":'
                 b'[{"classFilterMode":false,"codeSet":[],"expressionType":"TAG","subString":"*","subVersion":1,'
                 b'"tagsSet":[],"topic":"Orders"}]}')


def _consumer_heartbeat(client_id: str, group: str) -> RemotingCommand:
    body = {"clientID": client_id, "producerDataSet": [],
            "consumerDataSet": [{"groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                                 "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False,
                                 "subscriptionDataSet": [{"topic": "Orders", "subString": "*", "subVersion": 1}]}]}
    return RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode(), language=LanguageCode.JAVA)


@bounded(60)
async def test_consumer_running_info_is_asked_of_the_consumer_and_its_answer_passed_back(broker):
    """mqadmin consumerStatus / consumerProgress -s: GET_CONSUMER_RUNNING_INFO to the broker, which asks the
    named consumer (ClientRemotingProcessor) with the same fields and passes its answer back as it came. It was
    REQUEST_CODE_NOT_SUPPORTED, so consumerStatus failed and consumerProgress -s showed no client addresses."""
    asked = []

    def java_consumer(conn, cmd):
        asked.append(cmd)
        if cmd.code == R.GET_CONSUMER_RUNNING_INFO:
            return cmd.response(ResponseCode.SUCCESS, body=_RUNNING_INFO)
        return None

    host, _, port = broker.broker.rpartition(":")
    consumer = await open_connection(host, int(port), java_consumer)
    try:
        hb = await consumer.request(_consumer_heartbeat("10.0.0.9@999", "CG_status"), 5.0)
        assert hb.code == ResponseCode.SUCCESS, hb.remark
        fields = {"consumerGroup": "CG_status", "clientId": "10.0.0.9@999", "jstackEnable": "false"}
        resp = await request(broker.broker, R.GET_CONSUMER_RUNNING_INFO, fields)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        assert resp.body_bytes() == _RUNNING_INFO
        [call] = [c for c in asked if c.code == R.GET_CONSUMER_RUNNING_INFO]
        assert call.ext_fields == fields and not call.is_oneway
        other = await request(broker.broker, R.GET_CONSUMER_RUNNING_INFO,
                              {"consumerGroup": "CG_status", "clientId": "10.0.0.9@998", "jstackEnable": "false"})
        assert (other.code, other.remark) == (ResponseCode.SYSTEM_ERROR,
                                              "The Consumer <CG_status> <10.0.0.9@998> not online")
    finally:
        consumer.close()


ORDER = "ORDER_TOPIC_CONFIG"     # NamesrvUtil.NAMESPACE_ORDER_TOPIC_CONFIG: mqadmin updateOrderConf, updateTopic -o


async def _kv_round(addr: str) -> None:
    """What mqadmin updateTopic -o true / updateOrderConf / updateKvConfig / deleteKvConfig send, in order."""
    first = await request(addr, R.GET_KV_CONFIG, {"namespace": ORDER, "key": "Ordered"})
    assert (first.code, first.remark) == (ResponseCode.QUERY_NOT_FOUND,
                                          "No config item, Namespace: ORDER_TOPIC_CONFIG Key: Ordered")
    for key, value in (("Ordered", "broker-a:4"), ("Ordered", "broker-a:8;broker-b:8"), ("Other", "broker-a:2")):
        put = await request(addr, R.PUT_KV_CONFIG, {"namespace": ORDER, "key": key, "value": value})
        assert put.code == ResponseCode.SUCCESS, put.remark
    got = await request(addr, R.GET_KV_CONFIG, {"namespace": ORDER, "key": "Ordered"})
    assert (got.code, got.ext_fields.get("value")) == (ResponseCode.SUCCESS, "broker-a:8;broker-b:8")
    listed = await request(addr, R.GET_KVLIST_BY_NAMESPACE, {"namespace": ORDER})
    assert listed.code == ResponseCode.SUCCESS and json.loads(listed.body_bytes()) == {
        "table": {"Ordered": "broker-a:8;broker-b:8", "Other": "broker-a:2"}}
    gone = await request(addr, R.DELETE_KV_CONFIG, {"namespace": ORDER, "key": "Other"})
    assert gone.code == ResponseCode.SUCCESS, gone.remark
    assert (await request(addr, R.GET_KV_CONFIG, {"namespace": ORDER, "key": "Other"})).code == \
        ResponseCode.QUERY_NOT_FOUND
    none = await request(addr, R.GET_KVLIST_BY_NAMESPACE, {"namespace": "NOBODY"})
    assert (none.code, none.remark) == (ResponseCode.QUERY_NOT_FOUND, "No config item, Namespace: NOBODY")
    bad = await request(addr, R.PUT_KV_CONFIG, {"namespace": ORDER, "key": "NoValue"})
    assert bad.code != ResponseCode.SUCCESS and "value" in bad.remark
    assert (await request(addr, R.GET_KV_CONFIG, {"namespace": ORDER, "key": "NoValue"})).code == \
        ResponseCode.QUERY_NOT_FOUND


async def _kept(addr: str) -> None:
    got = await request(addr, R.GET_KV_CONFIG, {"namespace": ORDER, "key": "Ordered"})
    assert (got.code, got.ext_fields.get("value")) == (ResponseCode.SUCCESS, "broker-a:8;broker-b:8"), got.remark
    assert (await request(addr, R.GET_KV_CONFIG, {"namespace": ORDER, "key": "Other"})).code == \
        ResponseCode.QUERY_NOT_FOUND


@bounded(90)
async def test_kv_config_in_the_brokers_own_name_server_is_kept_across_a_restart(broker_factory):
    """PUT/GET/DELETE_KV_CONFIG and GET_KVLIST_BY_NAMESPACE were REQUEST_CODE_NOT_SUPPORTED: updateKvConfig and
    deleteKvConfig failed, and updateTopic -o true failed after making the topic. Kept in
    <store>/config/kvConfig.json, as RocketMQ keeps kvConfig.json."""
    b = broker_factory()
    await _kv_round(b.namesrv)
    assert b.stop() == 0
    await _kept(broker_factory().namesrv)


@bounded(90)
async def test_kv_config_in_the_stand_alone_name_server_survives_a_kill(tmp_path):
    path = tmp_path / "ns" / "kvConfig.json"
    namesrv = NamesrvProcess(tmp_path / "namesrv.log", "--kv-config-path", str(path)).start()
    try:
        await _kv_round(namesrv.addr)
    finally:
        namesrv.kill()                  # answered means written: nothing waits for a clean stop
    assert json.loads(path.read_text()) == {"configTable": {ORDER: {"Ordered": "broker-a:8;broker-b:8"}}}
    again = NamesrvProcess(tmp_path / "namesrv2.log", "--kv-config-path", str(path)).start()
    try:
        await _kept(again.addr)
    finally:
        again.kill()


def _java_properties(text: str) -> dict[str, str]:
    """java.util.Properties.load for what MixAll.properties2String writes: key=value lines."""
    return dict(line.split("=", 1) for line in text.splitlines() if line and line[0] not in "#!")


@bounded(60)
async def test_broker_config_is_the_properties_text_get_broker_config_prints(broker_factory):
    """mqadmin getBrokerConfig / exportConfigs: GET_BROKER_CONFIG answered REQUEST_CODE_NOT_SUPPORTED. RocketMQ
    answers Properties text and its data version in the ``version`` field; RocketMQ's names for the settings
    that mean the same, then txmq's own as txmq.<name>."""
    b = broker_factory("--broker-name", "broker-x", "--flush", "async", "--file-reserved-hours", "48")
    resp = await request(b.broker, R.GET_BROKER_CONFIG)
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    version = json.loads(resp.ext_fields["version"])
    assert list(version) == ["counter", "timestamp"] and version["counter"] == 0 and version["timestamp"] > 0
    props = _java_properties(resp.body_bytes().decode("utf-8"))
    assert {k: props[k] for k in ("brokerName", "brokerClusterName", "brokerId", "listenPort", "flushDiskType",
                                  "fileReservedTime", "autoCreateTopicEnable")} == {
        "brokerName": "broker-x", "brokerClusterName": "DefaultCluster", "brokerId": "0",
        "listenPort": b.broker.rpartition(":")[2], "flushDiskType": "ASYNC_FLUSH", "fileReservedTime": "48",
        "autoCreateTopicEnable": "true"}
    assert (props["txmq.flush"], props["txmq.broker_name"]) == ("async", "broker-x")
    # mqadmin exportConfigs copies these with Properties.setProperty, which throws a NullPointerException for
    # each one missing (ExportConfigsCommand.needBrokerProprties)
    exported = ("brokerClusterName", "brokerId", "brokerName", "brokerRole", "fileReservedTime", "filterServerNums",
                "flushDiskType", "maxMessageSize", "messageDelayLevel", "msgTraceTopicName", "slaveReadEnable",
                "traceOn", "traceTopicEnable", "useTLS", "autoCreateTopicEnable", "autoCreateSubscriptionGroup")
    assert [k for k in exported if k not in props] == []
    assert (props["msgTraceTopicName"], props["autoCreateSubscriptionGroup"]) == ("RMQ_SYS_TRACE_TOPIC", "true")


@bounded(60)
async def test_consume_message_directly_hands_the_stored_message_to_the_named_consumer(broker):
    """mqadmin queryMsgById -g G -d C (the dashboard's resend): CONSUME_MESSAGE_DIRECTLY answered
    REQUEST_CODE_NOT_SUPPORTED. RocketMQ passes the stored record of the offset id to that consumer, fields
    plus brokerName, and its ConsumeMessageDirectlyResult back."""
    async with Producer(broker.namesrv, "PG_direct") as producer:
        sent = await producer.send("Orders", b"resend me", tags="created", keys="order-7")
    result = b'{"autoCommit":true,"consumeResult":"CR_SUCCESS","order":false,"remark":"","spentTimeMills":2}'
    asked = []

    def java_consumer(conn, cmd):
        if cmd.code == R.CONSUME_MESSAGE_DIRECTLY:
            asked.append(cmd)
            return cmd.response(ResponseCode.SUCCESS, body=result)
        return None

    host, _, port = broker.broker.rpartition(":")
    consumer = await open_connection(host, int(port), java_consumer)
    try:
        assert (await consumer.request(_consumer_heartbeat("10.0.0.9@777", "CG_direct"), 5.0)).code == 0
        fields = {"consumerGroup": "CG_direct", "clientId": "10.0.0.9@777", "msgId": sent.offset_msg_id}
        resp = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, fields)
        assert (resp.code, resp.body_bytes()) == (ResponseCode.SUCCESS, result), resp.remark
        [call] = asked
        assert call.ext_fields == {**fields, "brokerName": "broker-a"}
        [msg] = decode_records(call.body_bytes())
        assert (msg.topic, msg.body, msg.tags, msg.offset_msg_id) == ("Orders", b"resend me", "created",
                                                                       sent.offset_msg_id)
        missing = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY,
                                {**fields, "msgId": sent.offset_msg_id[:-4] + "FFFF"})
        assert missing.code == ResponseCode.SYSTEM_ERROR and "can not find message" in missing.remark
        bad = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, {**fields, "msgId": "not-an-id"})
        assert bad.code != ResponseCode.SUCCESS and "not-an-id" in bad.remark and len(asked) == 1
    finally:
        consumer.close()


def _status_body(offsets: dict[int, int]) -> bytes:
    """A 4.9.8 consumer's GetConsumerStatusBody answer to GET_CONSUMER_STATUS_FROM_CLIENT, as fastjson writes it."""
    table = ",".join(f'{{"brokerName":"broker-a","queueId":{q},"topic":"Orders"}}:{o}' for q, o in offsets.items())
    return f'{{"consumerTable":{{}},"messageQueueTable":{{{table}}}}}'.encode()


@bounded(60)
async def test_get_consumer_status_asks_each_consumer_of_the_group(broker):
    """mqadmin getConsumerStatus: INVOKE_BROKER_TO_GET_CONSUMER_STATUS answered REQUEST_CODE_NOT_SUPPORTED.
    RocketMQ asks each consumer of the group (GET_CONSUMER_STATUS_FROM_CLIENT) and answers the offsets of those
    that answered, by client id; one that cannot answer is left out."""
    asked: dict[str, list] = {}

    def java_consumer(client_id: str, offsets: dict[int, int] | None):
        def handle(conn, cmd):
            if cmd.code != R.GET_CONSUMER_STATUS_FROM_CLIENT:
                return None
            asked.setdefault(client_id, []).append(cmd.ext_fields)
            if offsets is None:
                return cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED, "not supported")
            return cmd.response(ResponseCode.SUCCESS, body=_status_body(offsets))
        return handle

    host, _, port = broker.broker.rpartition(":")
    clients = {"10.0.0.1@1": {0: 5, 1: 7}, "10.0.0.2@2": {2: 9}, "10.0.0.3@3": None}
    conns = [await open_connection(host, int(port), java_consumer(cid, o)) for cid, o in clients.items()]
    try:
        for conn, cid in zip(conns, clients):
            assert (await conn.request(_consumer_heartbeat(cid, "CG_st"), 5.0)).code == ResponseCode.SUCCESS

        async def status(**extra):
            resp = await request(broker.broker, R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS,
                                 {"topic": "Orders", "group": "CG_st", **extra})
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            obj, _ = decode_mq_table(resp.body_bytes(), "messageQueueTable")
            assert list(obj) == ["consumerTable", "messageQueueTable"] and obj["messageQueueTable"] == {}
            return {cid: {json.loads(k)["queueId"]: v for k, v in t.items()} for cid, t in obj["consumerTable"].items()}

        assert await status() == {"10.0.0.1@1": {0: 5, 1: 7}, "10.0.0.2@2": {2: 9}}
        assert all(fields == [{"topic": "Orders", "group": "CG_st"}] for fields in asked.values()) and len(asked) == 3
        assert await status(clientAddr="10.0.0.2@2") == {"10.0.0.2@2": {2: 9}}
        assert len(asked["10.0.0.2@2"]) == 2 and len(asked["10.0.0.1@1"]) == 1
        nobody = await request(broker.broker, R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS,
                               {"topic": "Orders", "group": "CG_no"})
        assert (nobody.code, nobody.remark) == (ResponseCode.SYSTEM_ERROR,
                                                "No Any Consumer online in the consumer group: [CG_no]")
    finally:
        for conn in conns:
            conn.close()


@bounded(60)
async def test_requests_waiting_for_consumers_are_limited_and_end_when_the_consumer_goes(broker):
    """Each forwarded request waits up to 10 s for the consumer, holding its request (a 309: a copy of a stored
    message, up to 4 MiB): without a limit, a consumer that never answered and admins asking again and again
    held memory without bound. Past MAX_FORWARDING waiting, SYSTEM_BUSY at once (counted); the consumer's connection
    closing answers the waiting ones at once, not after their 10 s."""
    from broker.processors.forward import MAX_FORWARDING

    asked, all_asked = [], asyncio.Event()

    def silent_consumer(conn, cmd):
        if cmd.code == R.GET_CONSUMER_RUNNING_INFO:
            asked.append(cmd)
            if len(asked) == MAX_FORWARDING:
                all_asked.set()
        return None                     # never answers

    host, _, port = broker.broker.rpartition(":")
    consumer = await open_connection(host, int(port), silent_consumer)
    admin = await _connect(broker.broker)
    try:
        assert (await consumer.request(_consumer_heartbeat("10.0.0.9@555", "CG_silent"), 5.0)).code == 0

        def ask():
            return admin.request(RemotingCommand.request(R.GET_CONSUMER_RUNNING_INFO, {
                "consumerGroup": "CG_silent", "clientId": "10.0.0.9@555", "jstackEnable": "false"}), 20.0)

        waiting = [asyncio.ensure_future(ask()) for _ in range(MAX_FORWARDING)]
        await asyncio.wait_for(all_asked.wait(), 10)
        busy = await asyncio.wait_for(ask(), 5)
        assert busy.code == ResponseCode.SYSTEM_BUSY and "waiting for consumers" in busy.remark
        assert len(asked) == MAX_FORWARDING and not any(w.done() for w in waiting)
        scraped = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode())
        assert 'txmq_requests_refused_total{reason="forwarding"} 1.0' in scraped.splitlines()      # (counted)
        consumer.close()
        answers = await asyncio.wait_for(asyncio.gather(*waiting), 5)
        assert {a.code for a in answers} == {ResponseCode.SYSTEM_ERROR}
        assert all("invoke consumer <CG_silent> <10.0.0.9@555>" in a.remark for a in answers)
    finally:
        consumer.close()
        admin.close()


@bounded(60)
async def test_get_consumer_status_survives_a_consumer_answering_odd_queues(broker):
    """A consumer's answer is its own text: one naming a queue's topic as a number (fastjson reads it as the
    string) made the whole answer SYSTEM_ERROR (the queues did not sort), the other consumers' offsets lost."""
    odd = b'{"messageQueueTable":{{"brokerName":"broker-a","queueId":0,"topic":5}:3,' \
          b'{"brokerName":"broker-a","queueId":1,"topic":"Orders"}:4}}'

    def consumer(body):
        def handle(conn, cmd):
            if cmd.code == R.GET_CONSUMER_STATUS_FROM_CLIENT:
                return cmd.response(ResponseCode.SUCCESS, body=body)
            return None
        return handle

    host, _, port = broker.broker.rpartition(":")
    clients = {"10.0.0.1@1": _status_body({0: 5}), "10.0.0.2@2": odd}
    conns = [await open_connection(host, int(port), consumer(body)) for body in clients.values()]
    try:
        for conn, cid in zip(conns, clients):
            assert (await conn.request(_consumer_heartbeat(cid, "CG_odd"), 5.0)).code == ResponseCode.SUCCESS
        resp = await request(broker.broker, R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS,
                             {"topic": "Orders", "group": "CG_odd"})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        obj, _ = decode_mq_table(resp.body_bytes(), "messageQueueTable")
        assert {cid: sorted((json.loads(k)["topic"], v) for k, v in t.items())
                for cid, t in obj["consumerTable"].items()} == {"10.0.0.1@1": [("Orders", 5)],
                                                               "10.0.0.2@2": [("5", 3), ("Orders", 4)]}
    finally:
        for conn in conns:
            conn.close()


@bounded(60)
async def test_a_consumer_whose_status_does_not_read_is_logged_at_most_every_10_s(broker):
    """A consumer answering GET_CONSUMER_STATUS_FROM_CLIENT with a body that does not read is left out of the
    answer and logged, as RocketMQ does; but a WARNING each time: one such consumer and a client asking in a loop
    wrote 200 lines for 200 asks. Said at most every 10 s now; each ask still answered without it."""
    def handle(conn, cmd):
        if cmd.code == R.GET_CONSUMER_STATUS_FROM_CLIENT:
            return cmd.response(ResponseCode.SUCCESS, body=b'{"messageQueueTable":' + b"[" * 200)
        return None

    host, _, port = broker.broker.rpartition(":")
    consumer = await open_connection(host, int(port), handle)
    admin = await _connect(broker.broker)
    asks = 200
    try:
        assert (await consumer.request(_consumer_heartbeat("10.0.0.3@3", "CG_garbled"), 5.0)).code == 0
        for _ in range(asks):
            resp = await admin.request(RemotingCommand.request(R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS, {
                "topic": "Orders", "group": "CG_garbled"}), 5.0)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            assert decode_mq_table(resp.body_bytes(), "messageQueueTable")[0]["consumerTable"] == {}
    finally:
        consumer.close()
        admin.close()
    said = broker.log_path.read_text(errors="replace").count("[get-consumer-status] consumer 10.0.0.3@3")
    assert said == 1, f"{said} lines for {asks} asks"

@bounded(60)
async def test_a_txmq_consumer_says_at_once_what_it_does_not_serve(broker):
    """txmq's own consumer left requests it does not serve unanswered: the broker passing an operator's request on
    waited its 10 s (the tool's own 5 s first), holding a forwarded request's place. A pull consumer handed a
    message directly (CONSUME_MESSAGE_DIRECTLY: a Java pull consumer fails it too) answers
    REQUEST_CODE_NOT_SUPPORTED, passed back at once."""
    async with Producer(broker.namesrv, "PG_txmq_consumer") as producer:
        sent = await producer.send("Orders", b"x")
    async with PullConsumer(broker.namesrv, "CG_txmq") as consumer:
        await consumer.subscribe("Orders")
        direct = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, {
            "consumerGroup": "CG_txmq", "clientId": consumer.client_id, "msgId": sent.offset_msg_id})   # (5 s)
        assert direct.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED, direct.remark


@bounded(60)
async def test_a_txmq_pull_consumer_answers_running_info_and_status_as_a_java_one(broker):
    """mqadmin consumerStatus (307) and getConsumerStatus (223, passed on as 221) on a group of txmq pull
    consumers: each answered REQUEST_CODE_NOT_SUPPORTED, so consumerStatus failed and getConsumerStatus left the
    consumer out. Answered as DefaultMQPullConsumerImpl: its properties (CONSUME_ACTIVELY) and subscriptions, no
    queue; its offsets of the topic, the last it committed."""
    async with Producer(broker.namesrv, "PG_pull_status") as producer:
        await producer.send("Orders", b"x")
    async with PullConsumer(broker.namesrv, "CG_pull_status") as consumer:
        await consumer.subscribe("Orders", "TagA || TagB")
        mqs = await consumer.fetch_queues("Orders")
        await consumer.commit_offset(mqs[0], 1)
        await consumer.commit_offset(mqs[-1], 0, oneway=True)
        fields = {"consumerGroup": "CG_pull_status", "clientId": consumer.client_id, "jstackEnable": "false"}
        info = await request(broker.broker, R.GET_CONSUMER_RUNNING_INFO, fields)
        assert (info.code, info.remark) == (ResponseCode.SUCCESS, None)
        obj, table = decode_mq_table(info.body_bytes(), "mqTable")
        assert list(obj) == ["mqTable", "properties", "statusTable", "subscriptionSet"] and table == {}
        props = obj["properties"]
        assert (props["PROP_CONSUME_TYPE"], props["consumerGroup"]) == ("CONSUME_ACTIVELY", "CG_pull_status")
        assert props["PROP_NAMESERVER_ADDR"] == broker.namesrv + ";" and int(props["PROP_CONSUMER_START_TIMESTAMP"])
        [sub] = obj["subscriptionSet"]
        assert (sub["topic"], sub["tagsSet"]) == ("Orders", ["TagA", "TagB"])
        other = await request(broker.broker, R.GET_CONSUMER_RUNNING_INFO, {**fields, "consumerGroup": "CG_other"})
        assert other.code == ResponseCode.SYSTEM_ERROR
        status = await request(broker.broker, R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS,
                               {"topic": "Orders", "group": "CG_pull_status"})
        assert status.code == ResponseCode.SUCCESS, status.remark
        obj, _ = decode_mq_table(status.body_bytes(), "messageQueueTable")
        [(cid, offsets)] = obj["consumerTable"].items()
        assert cid == consumer.client_id
        committed = {(mqs[0].topic, mqs[0].queue_id): 1, (mqs[-1].topic, mqs[-1].queue_id): 0}
        assert {(json.loads(k)["topic"], json.loads(k)["queueId"]): v for k, v in offsets.items()} == committed


@bounded(60)
async def test_kv_config_holds_at_most_its_limit(broker):
    """Anyone reaching a name server may PUT_KV_CONFIG, and each change rewrites the whole file: a few 16 MiB
    values filled the broker's store disk (its name server keeps the file there), each change writing them all
    again. A change past the limit is refused and changes nothing; smaller ones go on."""
    from broker.kv_config import MAX_BYTES
    from protocol.frame import MAX_HEADER_SIZE

    # (in values a header carries: one past MAX_HEADER_SIZE is refused unread)
    parts = -(-MAX_BYTES // (MAX_HEADER_SIZE // 2))
    value = "x" * (MAX_BYTES // parts)
    for i in range(parts - 1):
        assert (await request(broker.namesrv, R.PUT_KV_CONFIG,
                              {"namespace": ORDER, "key": f"A{i}", "value": value})).code == ResponseCode.SUCCESS
    past = await request(broker.namesrv, R.PUT_KV_CONFIG,
                         {"namespace": ORDER, "key": "B", "value": value + "y" * 4096})
    assert past.code == ResponseCode.SYSTEM_ERROR and "more than" in past.remark, past.remark
    assert (await request(broker.namesrv, R.GET_KV_CONFIG, {"namespace": ORDER, "key": "B"})).code == \
        ResponseCode.QUERY_NOT_FOUND
    assert (await request(broker.namesrv, R.PUT_KV_CONFIG,     # replacing a value frees its room
                          {"namespace": ORDER, "key": "A0", "value": "broker-a:8"})).code == ResponseCode.SUCCESS
    assert (await request(broker.namesrv, R.PUT_KV_CONFIG,
                          {"namespace": ORDER, "key": "B", "value": value + "y" * 4096})).code == ResponseCode.SUCCESS


@bounded(60)
async def test_a_full_kv_namespace_is_listed_and_saved_whole_over_tcp(broker_factory, tmp_path):
    """A namespace of many short keys is listed, and saved at a PUT, a slice of keys at a time (encoded whole, a full
    table held the loop about a second each time: bench/bench_config_holds.py): the answer and the file must still be
    the whole table, sorted, as before."""
    from broker.kv_config import KEY_SLICE
    from protocol.admin_bodies import dump

    keys = 5 * KEY_SLICE + 7
    table = {f"T{i * 7919 % keys}é": f"broker-a:{i % 16}" for i in range(keys)}       # (in no sorted order)
    (tmp_path / "store" / "config").mkdir(parents=True)
    (tmp_path / "store" / "config" / "kvConfig.json").write_text(
        json.dumps({"configTable": {ORDER: table, "other": {"k": "v"}}}), encoding="utf-8")
    b = broker_factory()
    listed = await request(b.namesrv, R.GET_KVLIST_BY_NAMESPACE, {"namespace": ORDER})
    assert listed.code == ResponseCode.SUCCESS and listed.body_bytes() == dump({"table": table}).encode()
    put = await request(b.namesrv, R.PUT_KV_CONFIG, {"namespace": ORDER, "key": "New", "value": "broker-b:4"})
    assert put.code == ResponseCode.SUCCESS, put.remark
    table["New"] = "broker-b:4"
    saved = (tmp_path / "store" / "config" / "kvConfig.json").read_bytes()
    assert saved == dump({"configTable": {ORDER: table, "other": {"k": "v"}}}).encode()


@bounded(60)
async def test_the_kept_group_table_answer_follows_consumers_and_offsets_over_tcp(broker):
    """The master gives its last whole GET_ALL_SUBSCRIPTIONGROUP_CONFIG again while the table and the known groups
    are unchanged; the body also lists groups known only from a consumer's heartbeat or an offset commit, so a
    slave asking after either must see it (found a reviewer's worry: a cache on dataVersion alone would not)."""
    conn = await _connect(broker.broker)
    try:
        async def table() -> dict:
            answer = await conn.request(RemotingCommand.request(R.GET_ALL_SUBSCRIPTIONGROUP_CONFIG), 10)
            assert answer.code == ResponseCode.SUCCESS, answer.remark
            return json.loads(answer.body_bytes())

        first = await table()
        assert await table() == first and "CG_hb_only" not in first["subscriptionGroupTable"]
        assert (await conn.request(_consumer_heartbeat("10.0.0.9@1", "CG_hb_only"), 10)).code == ResponseCode.SUCCESS
        after_heartbeat = await table()
        assert "CG_hb_only" in after_heartbeat["subscriptionGroupTable"]
        assert after_heartbeat["dataVersion"] == first["dataVersion"]     # (no config changed: only known groups)
        assert (await conn.request(RemotingCommand.request(R.UPDATE_AND_CREATE_TOPIC, {
            "topic": "Orders", "defaultTopic": "TBW102", "readQueueNums": 1, "writeQueueNums": 1, "perm": 6,
            "topicFilterType": "SINGLE_TAG", "topicSysFlag": 0, "order": "false"}), 10)).code == ResponseCode.SUCCESS
        committed = await conn.request(RemotingCommand.request(R.UPDATE_CONSUMER_OFFSET, {
            "consumerGroup": "CG_offset_only", "topic": "Orders", "queueId": 0, "commitOffset": 0}), 10)
        assert committed.code == ResponseCode.SUCCESS, committed.remark
        assert "CG_offset_only" in (await table())["subscriptionGroupTable"]
    finally:
        conn.close()


@bounded(30)
async def test_consume_time_span_gives_each_queues_times_and_how_far_behind_the_group_is(broker):
    """QUERY_CONSUME_TIME_SPAN (303; DefaultMQAdminExt.queryConsumeTimeSpan) was REQUEST_CODE_NOT_SUPPORTED.
    Answered as AdminBrokerProcessor.queryConsumeTimeSpan (rocketmq-all-4.9.8, lines 1093-1147): per write queue
    the first and last messages' store times, the last consumed one's (the first's with no offset) and now minus
    the next one's; a group with no offset is behind from the queue's first message (4.9.8: now + 1 ms)."""
    conn = await _connect(broker.broker)
    try:
        for i in range(3):
            reply = await conn.request(RemotingCommand.request(R.SEND_MESSAGE_V2, {
                "a": "PG_span", "b": "SpanT", "c": "TBW102", "d": 1, "e": 0, "f": 0, "g": 0, "h": 0,
                "i": "", "j": 0}, f"m{i}".encode()), 5)
            assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
        reply = await conn.request(RemotingCommand.request(R.PULL_MESSAGE, {
            "consumerGroup": "CG_span", "topic": "SpanT", "queueId": 0, "queueOffset": 0, "maxMsgNums": 32,
            "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": "*", "subVersion": 0}), 5)
        stored = [m.store_timestamp for m in decode_records(reply.body_bytes())]
        assert len(stored) == 3
        reply = await conn.request(RemotingCommand.request(R.UPDATE_CONSUMER_OFFSET, {
            "consumerGroup": "CG_span", "topic": "SpanT", "queueId": 0, "commitOffset": 1}), 5)
        assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)

        async def span(group: str) -> dict:
            reply = await conn.request(RemotingCommand.request(R.QUERY_CONSUME_TIME_SPAN,
                                                               {"topic": "SpanT", "group": group}), 5)
            assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
            (one,) = json.loads(reply.body_bytes())["consumeTimeSpanSet"]
            assert one["messageQueue"]["queueId"] == 0 and one["messageQueue"]["topic"] == "SpanT"
            assert (one["minTimeStamp"], one["maxTimeStamp"]) == (stored[0], stored[2])
            return one

        one = await span("CG_span")
        assert one["consumeTimeStamp"] == stored[0]
        assert 0 <= one["delayTime"] < 60_000       # now minus the store time of message 1, the next to consume
        none = await span("CG_never")
        assert none["consumeTimeStamp"] == stored[0]
        # behind from message 0, asked after the other: not less than the first answer plus 0's lead over 1
        assert one["delayTime"] + (stored[1] - stored[0]) <= none["delayTime"] < 60_000
        reply = await conn.request(RemotingCommand.request(R.QUERY_CONSUME_TIME_SPAN,
                                                           {"topic": "NoSuchSpanT", "group": "CG_span"}), 5)
        assert reply.code == ResponseCode.TOPIC_NOT_EXIST, (reply.code, reply.remark)
    finally:
        conn.close()


@bounded(30)
async def test_consume_time_span_of_an_empty_queue_is_no_times_and_not_behind(broker):
    """A queue never written has no store times (-1, as 4.9.8's getMessageStoreTimeStamp) and nothing to be behind
    on (delayTime 0; 4.9.8 says now + 1 ms there too, the store time of offset -1 being -1)."""
    assert (await request(broker.broker, R.UPDATE_AND_CREATE_TOPIC, {
        "topic": "SpanEmptyT", "readQueueNums": 2, "writeQueueNums": 2, "perm": 6})).code == ResponseCode.SUCCESS
    reply = await request(broker.broker, R.QUERY_CONSUME_TIME_SPAN, {"topic": "SpanEmptyT", "group": "CG_none"})
    assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
    spans = json.loads(reply.body_bytes())["consumeTimeSpanSet"]
    assert sorted(s["messageQueue"]["queueId"] for s in spans) == [0, 1]
    for s in spans:
        assert (s["minTimeStamp"], s["maxTimeStamp"], s["consumeTimeStamp"], s["delayTime"]) == (-1, -1, -1, 0), s


def _saved_offsets(broker) -> dict:
    """config/consumerOffset.json's offsetTable (the key is left out with no offset)."""
    return json.loads((broker.store_dir / "config" / "consumerOffset.json").read_text()).get("offsetTable", {})


async def _send_to_queue(conn, topic: str, qid: int, n: int) -> None:
    for i in range(n):
        reply = await conn.request(RemotingCommand.request(R.SEND_MESSAGE_V2, {
            "a": "PG_offsets", "b": topic, "c": "TBW102", "d": 4, "e": qid, "f": 0, "g": 0, "h": 0,
            "i": "", "j": 0}, f"m{i}".encode()), 5)
        assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)


async def _commit(conn, group: str, topic: str, qid: int, offset: int) -> None:
    reply = await conn.request(RemotingCommand.request(R.UPDATE_CONSUMER_OFFSET, {
        "consumerGroup": group, "topic": topic, "queueId": qid, "commitOffset": offset}), 5)
    assert (reply.code, reply.remark) == (ResponseCode.SUCCESS, None)


@bounded(30)
async def test_a_negative_committed_offset_forgets_the_queues_offset_as_4_9_8_reads_it(broker):
    """UPDATE_CONSUMER_OFFSET with commitOffset -1 was answered SUCCESS and stored nothing: the group went on from
    the offset the client had just taken away (3, read back after the SUCCESS). RocketMQ 4.9.8 keeps the -1
    (ConsumerOffsetManager.commitOffset) and reads it back as no offset: QUERY_CONSUMER_OFFSET answers as for a
    group that never committed (0 while the queue's first message is in memory). The forgetting of a client that
    is no consumer of the group (an admin tool) is on disk before SUCCESS, as its moves are."""
    conn = await _connect(broker.broker)
    try:
        await _send_to_queue(conn, "NegT", 0, 4)

        async def stored() -> int:
            reply = await conn.request(RemotingCommand.request(R.QUERY_CONSUMER_OFFSET, {
                "consumerGroup": "CG_neg", "topic": "NegT", "queueId": 0}), 5)
            assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
            return int(reply.ext_fields["offset"])

        await _commit(conn, "CG_neg", "NegT", 0, 3)
        assert await stored() == 3
        assert _saved_offsets(broker).get("NegT@CG_neg") == {"0": 3}
        await _commit(conn, "CG_neg", "NegT", 0, -1)
        assert await stored() == 0          # as a group that never committed: the queue read from its start
        assert "NegT@CG_neg" not in _saved_offsets(broker)     # on disk at SUCCESS
        await _commit(conn, "CG_neg", "NegT", 0, -1)            # nothing to forget: nothing changes
        await _commit(conn, "CG_neg", "NegT", 0, 2)
        assert await stored() == 2
    finally:
        conn.close()


@bounded(30)
async def test_clone_group_offset_makes_the_destinations_offsets_the_sources_as_4_9_8(broker):
    """CLONE_GROUP_OFFSET (314, DefaultMQAdminExt.cloneGroupOffset) was REQUEST_CODE_NOT_SUPPORTED. Answered as
    4.9.8's AdminBrokerProcessor: the destination's offsets on the topic become the source's (its queue the source
    has none on dropped), on disk before SUCCESS; a topic none of the source's online members subscribes to is
    left out unless offline; no topic: every topic the source holds offsets on (4.9.8 clones the topic "null")."""
    conn = await _connect(broker.broker)

    async def clone(src: str, dest: str, topic: str | None, offline: bool = False) -> RemotingCommand:
        fields = {"srcGroup": src, "destGroup": dest, "offline": offline, **({"topic": topic} if topic else {})}
        return await conn.request(RemotingCommand.request(R.CLONE_GROUP_OFFSET, fields), 5)

    try:
        for topic in ("CloneT", "Clone2T"):
            await _send_to_queue(conn, topic, 0, 4)
            await _commit(conn, "CG_src", topic, 0, 3)
            await _commit(conn, "CG_src", topic, 1, 0)
        await _commit(conn, "CG_dest", "CloneT", 0, 1)
        await _commit(conn, "CG_dest", "CloneT", 2, 0)
        reply = await clone("CG_src", "CG_dest", "CloneT")
        assert (reply.code, reply.remark) == (ResponseCode.SUCCESS, None)
        saved = _saved_offsets(broker)
        assert saved["CloneT@CG_dest"] == {"0": 3, "1": 0}         # queue 2 dropped, as cloneOffset's put
        assert "Clone2T@CG_dest" not in saved
        reply = await clone("CG_src", "CG_all", None)
        assert (reply.code, reply.remark) == (ResponseCode.SUCCESS, None)
        saved = _saved_offsets(broker)
        assert saved["CloneT@CG_all"] == saved["Clone2T@CG_all"] == {"0": 3, "1": 0}
        nothing = await clone("CG_nobody", "CG_none", "CloneT")     # SUCCESS as 4.9.8, said in the remark
        assert nothing.code == ResponseCode.SUCCESS and "holds none on topic CloneT" in nothing.remark
        assert not any(k.endswith("@CG_none") for k in _saved_offsets(broker))
        member = await _connect(broker.broker)          # CG_src online, subscribed to Orders only
        try:
            beat = await member.request(_consumer_heartbeat("10.0.0.9@9", "CG_src"), 5)
            assert beat.code == ResponseCode.SUCCESS
            online = await clone("CG_src", "CG_online", "CloneT")
            assert online.code == ResponseCode.SUCCESS and "subscribes to" in online.remark
            assert "CloneT@CG_online" not in _saved_offsets(broker)
            reply = await clone("CG_src", "CG_online", "CloneT", offline=True)
            assert (reply.code, reply.remark) == (ResponseCode.SUCCESS, None)
            assert _saved_offsets(broker)["CloneT@CG_online"] == {"0": 3, "1": 0}
        finally:
            member.close()
    finally:
        conn.close()


@bounded(30)
async def test_a_clone_past_max_offsets_is_refused_saying_how_far_it_went(broker_factory):
    """A clone making offsets past --max-offsets is SYSTEM_ERROR naming the limit and what was cloned, not SUCCESS
    for a destination half made."""
    broker = broker_factory("--max-offsets", "4")     # (the broker holds one of its own)
    conn = await _connect(broker.broker)
    try:
        await _send_to_queue(conn, "CloneT", 0, 1)
        await _commit(conn, "CG_src", "CloneT", 0, 1)
        await _commit(conn, "CG_src", "CloneT", 1, 0)
        reply = await conn.request(RemotingCommand.request(R.CLONE_GROUP_OFFSET, {
            "srcGroup": "CG_src", "destGroup": "CG_dest", "topic": "CloneT", "offline": True}), 5)
        assert reply.code == ResponseCode.SYSTEM_ERROR
        assert "max_offsets=4" in reply.remark and "CloneT's in part" in reply.remark, reply.remark
        assert _saved_offsets(broker).get("CloneT@CG_dest") == {"0": 1}, (reply.remark, _saved_offsets(broker))
    finally:
        conn.close()


@bounded(60)
async def test_a_clone_of_many_offsets_is_said_in_a_line_of_bounded_length(broker):
    """Each clone was said at WARNING with every offset it cloned in the line ("CloneT {0: 3, 1: 3, ...}"): 512
    queues made a line of some 6,000 characters, 100,000 offsets one of some megabytes, at every clone a client
    asks. The line says how many offsets on how many topics, naming a few."""
    conn = await _connect(broker.broker)
    try:
        assert (await conn.request(RemotingCommand.request(R.UPDATE_AND_CREATE_TOPIC, {
            "topic": "WideT", "defaultTopic": "TBW102", "readQueueNums": 512, "writeQueueNums": 512, "perm": 6,
            "topicFilterType": "SINGLE_TAG", "topicSysFlag": 0, "order": "false"}), 10)).code == ResponseCode.SUCCESS
        await asyncio.gather(*(_commit(conn, "CG_wide", "WideT", q, q + 1000) for q in range(512)))
        reply = await conn.request(RemotingCommand.request(R.CLONE_GROUP_OFFSET, {
            "srcGroup": "CG_wide", "destGroup": "CG_wide_copy", "topic": "WideT", "offline": True}), 10)
        assert (reply.code, reply.remark) == (ResponseCode.SUCCESS, None)
        assert _saved_offsets(broker)["WideT@CG_wide_copy"] == {str(q): q + 1000 for q in range(512)}
    finally:
        conn.close()
    said = [line for line in broker.log_path.read_text().splitlines() if "[clone-group-offset]" in line]
    assert len(said) == 1 and "512 offsets" in said[0] and len(said[0]) < 1000, (len(said[0]), said[0][:300])


@bounded(60)
async def test_broker_consume_stats_lists_every_groups_progress_as_4_9_8(broker):
    """mqadmin brokerConsumeStats sends GET_BROKER_CONSUME_STATS (317) {isOrder}: it was REQUEST_CODE_NOT_SUPPORTED
    and the command failed. Answered as 4.9.8's fetchAllConsumeStatsInBroker: a ConsumeStatsList of each group's
    ConsumeStats per topic it holds offsets on (write queues), a topic its online members do not read left out,
    with isOrder only ordered topics, totalDiff the sum of broker less consumer offsets."""
    conn = await _connect(broker.broker)
    member = await _connect(broker.broker)

    async def stats(order: bool) -> dict[str, list[dict]]:
        """{group: [{(topic, queue id): (broker offset, consumer offset)} of each ConsumeStats]}"""
        reply = await conn.request(RemotingCommand.request(R.GET_BROKER_CONSUME_STATS, {"isOrder": order}), 10)
        assert (reply.code, reply.remark) == (ResponseCode.SUCCESS, None)
        obj, _ = decode_mq_table(reply.body_bytes(), "-")       # (its MessageQueue keys made strings)
        assert list(obj) == ["brokerAddr", "consumeStatsList", "totalDiff"]     # fastjson's order
        assert obj["brokerAddr"] == broker.broker
        groups = {}
        for entry in obj["consumeStatsList"]:
            ((group, per_topic),) = entry.items()
            assert all(list(s) == ["consumeTps", "offsetTable"] for s in per_topic)
            groups[group] = [{(mq["topic"], mq["queueId"]): (w["brokerOffset"], w["consumerOffset"])
                              for mq, w in ((json.loads(k), w) for k, w in s["offsetTable"].items())}
                             for s in per_topic]
        assert obj["totalDiff"] == sum(b - c for stats in groups.values() for t in stats for b, c in t.values())
        return groups

    try:
        for topic, order in (("BcsPlain", "false"), ("BcsOrder", "true"), ("Orders", "false")):
            reply = await conn.request(RemotingCommand.request(R.UPDATE_AND_CREATE_TOPIC, {
                "topic": topic, "readQueueNums": 2, "writeQueueNums": 2, "perm": 6, "order": order}), 5)
            assert reply.code == ResponseCode.SUCCESS, reply.remark
            await _send_to_queue(conn, topic, 0, 4)
        await _commit(conn, "CG_bcs", "BcsPlain", 0, 1)
        await _commit(conn, "CG_bcs", "BcsOrder", 0, 3)
        await _commit(conn, "CG_bcs_online", "BcsPlain", 0, 2)
        await _commit(conn, "CG_bcs_online", "Orders", 0, 4)
        beat = await member.request(_consumer_heartbeat("10.0.0.9@9", "CG_bcs_online"), 5)    # reads Orders only
        assert beat.code == ResponseCode.SUCCESS
        groups = await stats(False)
        assert groups["CG_bcs"] == [{("BcsOrder", 0): (4, 3), ("BcsOrder", 1): (0, 0)},
                                    {("BcsPlain", 0): (4, 1), ("BcsPlain", 1): (0, 0)}]
        assert groups["CG_bcs_online"] == [{("Orders", 0): (4, 4), ("Orders", 1): (0, 0)}]    # BcsPlain left out
        assert groups["TOOLS_CONSUMER"] == []       # every group of the table, one with no offset too
        ordered = await stats(True)
        assert ordered["CG_bcs"] == [{("BcsOrder", 0): (4, 3), ("BcsOrder", 1): (0, 0)}]
        assert ordered["CG_bcs_online"] == []
    finally:
        member.close()
        conn.close()


@contextlib.asynccontextmanager
async def _consumed_by_txmq_push_consumer(broker, group: str):
    """A txmq PushConsumer of ``group`` on Orders, once it consumed the 4 messages sent before it started."""
    async with Producer(broker.namesrv, "PG_" + group) as producer:
        for i in range(4):
            await producer.send("Orders", f"m{i}".encode())
    consumed = asyncio.Event()
    seen = []

    def listener(msg):
        seen.append(msg.body)
        if len(seen) == 4:
            consumed.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(broker.namesrv, group, listener, consume_from="first")
    consumer.subscribe("Orders")
    await consumer.start()
    try:
        await asyncio.wait_for(consumed.wait(), 20)
        yield consumer
    finally:
        await consumer.shutdown()


@bounded(60)
async def test_a_txmq_push_consumer_answers_consumer_running_info_as_a_java_one(broker):
    """mqadmin consumerStatus and consumerProgress -s ask each consumer of the group, through the broker, for its
    ConsumerRunningInfo (307): txmq's push consumer answered REQUEST_CODE_NOT_SUPPORTED, so both commands failed
    on a group of txmq consumers. It answers as DefaultMQPushConsumerImpl.consumerRunningInfo: the properties
    consumerStatus's analysis parses (consume type, orderly, start time), its subscriptions and a ProcessQueueInfo
    of each queue it holds (the queues consumerProgress -s names its clients by); another group SYSTEM_ERROR."""
    async with _consumed_by_txmq_push_consumer(broker, "CG_running") as consumer:
        fields = {"consumerGroup": "CG_running", "clientId": consumer.client.client_id, "jstackEnable": "true"}
        info = await request(broker.broker, R.GET_CONSUMER_RUNNING_INFO, fields)
        assert (info.code, info.remark) == (ResponseCode.SUCCESS, None)
        obj, table = decode_mq_table(info.body_bytes(), "mqTable")
        assert list(obj) == ["jstack", "mqTable", "properties", "statusTable", "subscriptionSet"]   # fastjson's
        assert "MainThread" in obj["jstack"]
        props = obj["properties"]
        assert (props["PROP_CONSUME_TYPE"], props["PROP_CONSUMEORDERLY"]) == ("CONSUME_PASSIVELY", "false")
        started = int(props["PROP_CONSUMER_START_TIMESTAMP"])
        assert props["PROP_NAMESERVER_ADDR"] == broker.namesrv + ";"
        assert {s["topic"] for s in obj["subscriptionSet"]} == {"Orders", "%RETRY%CG_running"}
        assert {(t, q) for t, _b, q in table} == {(mq.topic, mq.queue_id) for mq in consumer._owned}
        orders = {q: v for (t, _b, q), v in table.items() if t == "Orders"}
        assert sum(v["commitOffset"] for v in orders.values()) == 4         # every message consumed
        assert all(started <= min(v["lastPullTimestamp"], v["lastConsumeTimestamp"])
                   for v in orders.values() if v["commitOffset"] > 0)
        assert all(not v["droped"] and not v["locked"] for v in table.values())
        other = await request(broker.broker, R.GET_CONSUMER_RUNNING_INFO, {**fields, "consumerGroup": "CG_other"})
        assert other.code == ResponseCode.SYSTEM_ERROR     # (the broker: not online, or the consumer: not its group)


@contextlib.asynccontextmanager
async def _handed_directly(broker, group: str, listener, ready: asyncio.Event, msg_id: str, **kw):
    """A txmq PushConsumer of ``group`` on Orders, started and ``ready``; yields it and the fields of a
    CONSUME_MESSAGE_DIRECTLY of ``msg_id`` to it."""
    consumer = PushConsumer(broker.namesrv, group, listener, consume_from="first", **kw)
    consumer.subscribe("Orders")
    await consumer.start()
    try:
        await asyncio.wait_for(ready.wait(), 20)
        yield consumer, {"consumerGroup": group, "clientId": consumer.client.client_id, "msgId": msg_id}
    finally:
        await consumer.shutdown()


def _pulled_then_handed(on_direct):
    """A listener consuming the first message its pull loops deliver (``pulled`` set) and b"after" (kept in
    ``consumed``, ``after`` set); every other message -- those handed directly -- given to ``on_direct`` (a
    coroutine function). Returns (listener, pulled, after, consumed)."""
    pulled, after, consumed = asyncio.Event(), asyncio.Event(), []

    async def listener(msg):
        if msg.body == b"after":
            consumed.append(msg.body)
            after.set()
            return ConsumeStatus.CONSUME_SUCCESS
        if not pulled.is_set():                 # (the pull loop's delivery of the first message)
            pulled.set()
            return ConsumeStatus.CONSUME_SUCCESS
        return await on_direct(msg)
    return listener, pulled, after, consumed


@bounded(60)
async def test_a_txmq_push_consumer_consumes_a_message_handed_to_it_directly(broker):
    """mqadmin queryMsgById -g G -d C (the dashboard's resend) has the broker pass the stored message to that
    consumer (CONSUME_MESSAGE_DIRECTLY, 309): txmq's push consumer answered REQUEST_CODE_NOT_SUPPORTED, and the
    resend failed. It hands the message to its listener once more, as a Java push consumer's
    consumeMessageDirectly, and answers a ConsumeMessageDirectlyResult: CR_SUCCESS, or CR_LATER when the
    listener asks for it again (nothing sent back for it: the operator's call, not a delivery)."""
    async with Producer(broker.namesrv, "PG_direct_txmq") as producer:
        sent = await producer.send("Orders", b"resend me", tags="created")
    seen = []
    first = asyncio.Event()

    def listener(msg):
        seen.append((msg.topic, msg.body, msg.tags))
        first.set()
        return ConsumeStatus.CONSUME_SUCCESS if len(seen) < 3 else ConsumeStatus.RECONSUME_LATER

    async with _handed_directly(broker, "CG_direct_txmq", listener, first, sent.offset_msg_id) as (_, fields):
        for expected in ("CR_SUCCESS", "CR_LATER"):
            resp = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, fields)
            assert (resp.code, resp.remark) == (ResponseCode.SUCCESS, None)
            result = json.loads(resp.body_bytes())
            assert list(result) == ["autoCommit", "consumeResult", "order", "spentTimeMills"]    # fastjson's
            assert (result["consumeResult"], result["order"], result["autoCommit"]) == (expected, False, True)
        assert seen == [("Orders", b"resend me", "created")] * 3
        other = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, {**fields, "consumerGroup": "CG_other"})
        assert other.code == ResponseCode.SYSTEM_ERROR and len(seen) == 3


@bounded(60)
async def test_a_message_handed_directly_answers_what_the_listener_did_as_a_java_consumer(broker):
    """mqadmin queryMsgById -g G -d C prints the ConsumeMessageDirectlyResult the consumer answers. A txmq push
    consumer whose listener raised answered CR_LATER with no remark, as though the listener had asked for the
    message again, and one that returned None the same: the operator could not tell a failing listener from a
    refusing one, nor see why. As 4.9.8's consumeMessageDirectly: a raise is CR_THROW_EXCEPTION with what was
    raised as the remark, a None CR_RETURN_NULL."""
    async with Producer(broker.namesrv, "PG_direct_verdict") as producer:
        sent = await producer.send("Orders", b"judge me")
    consumed = asyncio.Event()
    direct = []

    def listener(msg):
        if not consumed.is_set():                      # (the pull loop's delivery: consumed at once)
            consumed.set()
            return ConsumeStatus.CONSUME_SUCCESS
        direct.append(msg.body)
        if len(direct) == 1:
            raise ValueError("no stock for order 42")
        return None

    async with _handed_directly(broker, "CG_direct_verdict", listener, consumed, sent.offset_msg_id) as (_, fields):
        raised = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, fields)
        assert (raised.code, raised.remark) == (ResponseCode.SUCCESS, None)
        result = json.loads(raised.body_bytes())
        assert list(result) == ["autoCommit", "consumeResult", "order", "remark", "spentTimeMills"]   # fastjson's
        assert result["consumeResult"] == "CR_THROW_EXCEPTION", result
        assert result["remark"] == "ValueError: no stock for order 42"
        null = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, fields)
        result = json.loads(null.body_bytes())
        assert (result["consumeResult"], "remark" in result) == ("CR_RETURN_NULL", False), result
        assert direct == [b"judge me"] * 2


@bounded(60)
async def test_what_a_listener_raised_on_a_message_handed_directly_is_bounded_and_never_raises_again(broker):
    """CR_THROW_EXCEPTION's remark was the exception's whole str(): a listener raising with 17 MiB of text (a
    payload dumped into its message) answered a frame past the 16 MiB the broker reads, so the broker closed the
    consumer's connection -- its pulls with it -- and the 309 got no answer; one whose __str__ raised raised again
    out of the listener's call, in the pull loops too. The remark keeps MAX_RAISED_REMARK characters and says how
    many there were, and an unprintable exception is named by its type."""
    from consumer.push_consumer import MAX_RAISED_REMARK

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str for you")

    async with Producer(broker.namesrv, "PG_direct_raised") as producer:
        sent = await producer.send("Orders", b"raise on me")
        direct = []

        async def raising(msg):
            direct.append(msg.body)
            if len(direct) == 1:
                raise ValueError("x" * (17 << 20))
            raise Unprintable()
        listener, first, more, after = _pulled_then_handed(raising)

        async with _handed_directly(broker, "CG_direct_raised", listener, first, sent.offset_msg_id) as (_, fields):
            results = []
            for _ in range(2):
                resp = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, fields, timeout=15)
                assert (resp.code, resp.remark) == (ResponseCode.SUCCESS, None), (resp.code, resp.remark)
                results.append(json.loads(resp.body_bytes()))
            assert [r["consumeResult"] for r in results] == ["CR_THROW_EXCEPTION"] * 2, results
            huge, unprintable = (r["remark"] for r in results)
            assert huge.startswith("ValueError: xxx"), huge[:100]
            assert huge.endswith(f"... ({len('ValueError: ') + (17 << 20)} characters)"), huge[-100:]
            assert len(huge) <= MAX_RAISED_REMARK + 100, len(huge)
            assert unprintable.startswith("Unprintable") and "RuntimeError" in unprintable, unprintable
            await producer.send("Orders", b"after")
            await asyncio.wait_for(more.wait(), 20)    # the consumer's connection and pull loops go on
            assert (direct, after) == ([b"raise on me"] * 2, [b"after"])


@bounded(90)
async def test_messages_handed_directly_to_a_hung_listener_are_bounded_and_consumption_goes_on(broker):
    """Each CONSUME_MESSAGE_DIRECTLY (309) a txmq push consumer took ran its listener call until it returned or
    consume_timeout_s (900 s) passed, however many there were: the broker gives up on each after 10 s, so an
    operator retrying a resend against a hung listener piled calls up, and past 1,024 in hand the consumer's
    connection to the broker stopped reading -- the pulls' answers with it, and the consumer stopped consuming,
    saying nothing. At most MAX_DIRECT_AT_ONCE run at once; one more is answered SYSTEM_BUSY at once, saying
    why, and the pull loops go on consuming."""
    from consumer.push_consumer import MAX_DIRECT_AT_ONCE
    async with Producer(broker.namesrv, "PG_direct_hung") as producer:
        sent = await producer.send("Orders", b"hang on me")
        entered, never, all_in = [], asyncio.Event(), asyncio.Event()

        async def hanging(msg):
            entered.append(msg.body)
            if len(entered) == MAX_DIRECT_AT_ONCE:
                all_in.set()
            await never.wait()                     # a listener that hangs on the messages handed directly
            return ConsumeStatus.CONSUME_SUCCESS
        listener, first, more, consumed = _pulled_then_handed(hanging)

        held = []
        try:
            async with _handed_directly(broker, "CG_direct_hung", listener, first, sent.offset_msg_id,
                                        shutdown_grace_s=0.2, abandon_after_s=1.0) as (_, fields):
                held = [asyncio.create_task(request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, fields, timeout=15))
                        for _ in range(MAX_DIRECT_AT_ONCE)]
                await asyncio.wait_for(all_in.wait(), 20)
                busy = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, fields, timeout=15)
                assert busy.code == ResponseCode.SYSTEM_BUSY, (busy.code, busy.remark)
                assert "still in its listener" in busy.remark and str(MAX_DIRECT_AT_ONCE) in busy.remark, busy.remark
                assert len(entered) == MAX_DIRECT_AT_ONCE      # the refused one never reached the listener
                await producer.send("Orders", b"after")
                await asyncio.wait_for(more.wait(), 20)        # the pull loops go on beside the hung calls
                assert consumed == [b"after"]
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)


@bounded(60)
async def test_a_txmq_push_consumer_tells_its_offsets_to_get_consumer_status(broker):
    """mqadmin getConsumerStatus (223) has the broker ask each consumer for its offsets of the topic (221): txmq's
    push consumer answered REQUEST_CODE_NOT_SUPPORTED and was left out, the tool printing nothing for a group of
    them. It answers its offsets, as a Java push consumer's offset store (cloneOffsetTable)."""
    async with _consumed_by_txmq_push_consumer(broker, "CG_status_txmq") as consumer:
        resp = await request(broker.broker, R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS,
                             {"topic": "Orders", "group": "CG_status_txmq"})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        obj, _ = decode_mq_table(resp.body_bytes(), "messageQueueTable")
        (cid, table), = obj["consumerTable"].items()
        offsets = {json.loads(k)["queueId"]: v for k, v in table.items()}
        assert cid == consumer.client.client_id
        assert set(offsets) == {mq.queue_id for mq in consumer._owned if mq.topic == "Orders"}
        assert sum(offsets.values()) == 4          # every message consumed


@bounded(60)
async def test_broker_consume_stats_past_a_frame_is_refused_naming_what_to_ask_instead(broker_factory):
    """GET_BROKER_CONSUME_STATS (317) gathers every group's progress in one body: 200 groups holding offsets on 100
    topics of 8 queues answered 19.6 MB, past the 16 MiB frame a Java mqadmin (and a txmq client) reads -- the
    tool failed on a frame it could not decode -- and 8 such requests at once took the broker from 90 to 423 MB.
    Past the broker's max_frame_size (RocketMQ's 16 MiB) it stops gathering and answers SYSTEM_ERROR saying so
    and what to ask instead; a body within it is answered as ever."""
    broker = broker_factory("--max-frame-size", "65536")
    conn = await _connect(broker.broker)
    try:
        reply = await conn.request(RemotingCommand.request(R.UPDATE_AND_CREATE_TOPIC, {
            "topic": "BcsWide", "readQueueNums": 256, "writeQueueNums": 256, "perm": 6}), 5)
        assert reply.code == ResponseCode.SUCCESS, reply.remark
        for group in ("CG_wide_a", "CG_wide_b", "CG_wide_c"):       # each 256 rows, some 27 KB of the body
            await _commit(conn, group, "BcsWide", 0, 0)
        reply = await conn.request(RemotingCommand.request(R.GET_BROKER_CONSUME_STATS, {"isOrder": "false"}), 10)
        assert reply.code == ResponseCode.SYSTEM_ERROR, (reply.code, len(reply.body_bytes() or b""))
        assert "max_frame_size" in reply.remark and "consumerProgress" in reply.remark, reply.remark
        assert not reply.body_bytes()
        ordered = await conn.request(RemotingCommand.request(R.GET_BROKER_CONSUME_STATS, {"isOrder": "true"}), 10)
        assert ordered.code == ResponseCode.SUCCESS, ordered.remark     # (no ordered topic: a small body)
        assert json.loads(ordered.body_bytes())["totalDiff"] == 0
    finally:
        conn.close()


@bounded(60)
async def test_a_message_handed_directly_keeps_to_the_push_consumers_shutdown(broker):
    """PushConsumer.shutdown gives a running listener call shutdown_grace_s, then cancels it, and gives no new
    message to the listener once it begins. A message handed to it by CONSUME_MESSAGE_DIRECTLY (309) did neither:
    a listener still on one when shutdown returned kept running (up to consume_timeout_s, 900 s, after the
    consumer was gone), and one handed during the shutdown's grace was given to the listener. Now the first is
    cancelled with the pull loops' calls, and the second refused SYSTEM_ERROR without reaching the listener."""
    async with Producer(broker.namesrv, "PG_direct_stop") as producer:
        sent = await producer.send("Orders", b"hold me")
    consumed, entered, release = asyncio.Event(), asyncio.Event(), asyncio.Event()
    calls, cancelled = [], []

    async def listener(msg):
        calls.append(msg.body)
        if len(calls) == 1:                            # (the pull loop's delivery: consumed at once)
            consumed.set()
            return ConsumeStatus.CONSUME_SUCCESS
        entered.set()
        try:
            await release.wait()                       # never set: held until cancelled
        except asyncio.CancelledError:
            cancelled.append(msg.body)
            raise
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(broker.namesrv, "CG_direct_stop", listener, consume_from="first", shutdown_grace_s=0.5)
    consumer.subscribe("Orders")
    await consumer.start()
    fields = {"consumerGroup": "CG_direct_stop", "clientId": consumer.client.client_id, "msgId": sent.offset_msg_id}
    held = stopping = None
    try:
        await asyncio.wait_for(consumed.wait(), 20)
        held = asyncio.create_task(request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, fields))
        await asyncio.wait_for(entered.wait(), 20)
        stopping = asyncio.create_task(consumer.shutdown())
        for _ in range(100):                           # (shutdown's first step marks it stopping)
            if consumer._stopping:
                break
            await asyncio.sleep(0)
        assert consumer._stopping
        late = await request(broker.broker, R.CONSUME_MESSAGE_DIRECTLY, fields)     # (still in the group)
        await stopping
        assert cancelled == [b"hold me"], (calls, cancelled)      # the held call ended with the consumer
    finally:
        if stopping is None:
            await consumer.shutdown()
        if held is not None:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
    assert late.code == ResponseCode.SYSTEM_ERROR and "shutting down" in late.remark, (late.code, late.remark)
    assert calls == [b"hold me"] * 2        # the pull loop's and the held one: the late one not given


@bounded(60)
async def test_broker_consume_stats_at_once_are_bounded_as_4_9_8s_admin_threads(broker):
    """Each GET_BROKER_CONSUME_STATS (317) holds its body, up to a frame's 16 MiB, until it is sent, and they ran
    all at once: 8 of 19.6 MB took the broker from 90 to 423 MB, and one connection may have 1,024 in flight.
    RocketMQ answers admin codes on 16 threads; txmq works on MAX_BROKER_CONSUME_STATS of them at once and
    answers one past that SYSTEM_BUSY, saying to try again, and counts it (txmq_requests_refused_total, uncounted
    before: an operator's tool refused again and again left no trace on the broker's side)."""
    from broker.processors.ops import MAX_BROKER_CONSUME_STATS
    conn = await _connect(broker.broker)
    try:
        reply = await conn.request(RemotingCommand.request(R.UPDATE_AND_CREATE_TOPIC, {
            "topic": "BcsBusy", "readQueueNums": 1024, "writeQueueNums": 1024, "perm": 6}), 5)
        assert reply.code == ResponseCode.SUCCESS, reply.remark
        for i in range(10):         # 10,240 queues to read: five turns of the loop each
            await _commit(conn, f"CG_busy_{i}", "BcsBusy", 0, 0)
        asked = MAX_BROKER_CONSUME_STATS + 4
        replies = await asyncio.gather(*(conn.request(RemotingCommand.request(
            R.GET_BROKER_CONSUME_STATS, {"isOrder": "false"}), 30) for _ in range(asked)))
        codes = sorted(r.code for r in replies)
        assert codes == [ResponseCode.SUCCESS] * MAX_BROKER_CONSUME_STATS + [ResponseCode.SYSTEM_BUSY] * 4, codes
        busy = next(r for r in replies if r.code == ResponseCode.SYSTEM_BUSY)
        assert "try again" in busy.remark, busy.remark
        scraped = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode())
        assert 'txmq_requests_refused_total{reason="broker-consume-stats"} 4.0' in scraped.splitlines()   # (counted)
        again = await conn.request(RemotingCommand.request(R.GET_BROKER_CONSUME_STATS, {"isOrder": "false"}), 30)
        assert again.code == ResponseCode.SUCCESS         # (each slot given back)
    finally:
        conn.close()


@bounded(30)
async def test_correction_offset_is_the_least_offset_of_the_groups_not_filtered_out(broker):
    """QUERY_CORRECTION_OFFSET (308; MQClientAPIImpl.queryCorrectionOffset) was REQUEST_CODE_NOT_SUPPORTED.
    Answered as AdminBrokerProcessor.queryCorrectionOffset (rocketmq-all-4.9.8, lines 1201-1225): per queue the
    least offset of the groups holding offsets on the topic, those in filterGroups left out; compareGroup changes
    nothing (4.9.8 looks it up with topic and group swapped). The groups filtered out keep their offsets (4.9.8
    removes them from its offset table)."""
    assert (await request(broker.broker, R.UPDATE_AND_CREATE_TOPIC, {
        "topic": "CorrT", "readQueueNums": 3, "writeQueueNums": 3, "perm": 6})).code == ResponseCode.SUCCESS
    conn = await _connect(broker.broker)
    try:
        for qid in (0, 1):
            for i in range(6):
                reply = await conn.request(RemotingCommand.request(R.SEND_MESSAGE_V2, {
                    "a": "PG_corr", "b": "CorrT", "c": "TBW102", "d": 3, "e": qid, "f": 0, "g": 0, "h": 0,
                    "i": "", "j": 0}, f"m{i}".encode()), 5)
                assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
        for group, qid, offset in (("CG_corr_a", 0, 4), ("CG_corr_a", 1, 2), ("CG_corr_b", 0, 3),
                                   ("CG_corr_b", 1, 5), ("CG_corr_slow", 0, 1), ("CG_corr_slow", 1, 1)):
            reply = await conn.request(RemotingCommand.request(R.UPDATE_CONSUMER_OFFSET, {
                "consumerGroup": group, "topic": "CorrT", "queueId": qid, "commitOffset": offset}), 5)
            assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)

        async def correction(fields: dict) -> dict:
            reply = await conn.request(RemotingCommand.request(R.QUERY_CORRECTION_OFFSET, fields), 5)
            assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
            body = json.loads(reply.body_bytes())
            assert list(body) == ["correctionOffsets"]
            return {int(q): o for q, o in body["correctionOffsets"].items()}

        # the client's set of groups to filter out, joined with commas; queue 2 has no offset and is left out
        assert await correction({"topic": "CorrT", "compareGroup": "CG_corr_a",
                                 "filterGroups": "CG_corr_slow,CG_other"}) == {0: 3, 1: 2}
        assert await correction({"topic": "CorrT", "compareGroup": "CG_corr_a"}) == {0: 1, 1: 1}
        assert await correction({"topic": "CorrT", "compareGroup": "CG_corr_a",
                                 "filterGroups": "CG_corr_a,CG_corr_b,CG_corr_slow"}) == {}
        for qid in (0, 1):      # filtered out, still held
            reply = await conn.request(RemotingCommand.request(R.QUERY_CONSUMER_OFFSET, {
                "consumerGroup": "CG_corr_slow", "topic": "CorrT", "queueId": qid}), 5)
            assert (reply.code, reply.ext_fields.get("offset")) == (ResponseCode.SUCCESS, "1"), reply.remark
        assert await correction({"topic": "NoSuchCorrT", "compareGroup": "CG_corr_a"}) == {}
        missing = await conn.request(RemotingCommand.request(R.QUERY_CORRECTION_OFFSET, {"topic": "CorrT"}), 5)
        assert missing.code != ResponseCode.SUCCESS and "compareGroup" in missing.remark, missing.remark
    finally:
        conn.close()


@bounded(60)
async def test_a_pull_consumers_status_is_the_offset_its_broker_holds_after_commits_side_by_side(broker):
    """A pull consumer's 221 answer is the offset it last committed: two commits of one queue side by side (an
    answered one, then a oneway one) reach the broker in that order, and the broker holds the later; the answered
    one's reply comes back after the oneway one is written, so the offset recorded last was the earlier."""
    async with Producer(broker.namesrv, "PG_pull_race") as producer:
        await producer.send("Orders", b"x")
    async with PullConsumer(broker.namesrv, "CG_pull_race") as consumer:
        await consumer.subscribe("Orders")
        mqs = await consumer.fetch_queues("Orders")
        for round_ in range(5):
            await asyncio.gather(consumer.commit_offset(mqs[0], 10 * round_ + 1),
                                 consumer.commit_offset(mqs[0], 10 * round_ + 2, oneway=True))
            held = await consumer.fetch_offset(mqs[0])       # (answered: after the oneway on the connection)
            status = await request(broker.broker, R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS,
                                   {"topic": "Orders", "group": "CG_pull_race"})
            obj, _ = decode_mq_table(status.body_bytes(), "messageQueueTable")
            [(_, offsets)] = obj["consumerTable"].items()
            reported = {json.loads(k)["queueId"]: v for k, v in offsets.items()}
            assert (held, reported) == (10 * round_ + 2, {mqs[0].queue_id: held}), round_


@bounded(60)
async def test_a_pull_consumers_status_holds_the_offsets_it_fetched(broker):
    """A Java pull consumer's fetchConsumeOffset(mq, true) puts the broker's offset in its offset store, so mqadmin
    getConsumerStatus (223, each consumer's 221) shows it before the consumer commits. A txmq PullConsumer kept only
    what it committed: one that had fetched its offsets and was consuming from them answered an empty table. It
    keeps a fetched offset too, until a commit made after the fetch."""
    async with Producer(broker.namesrv, "PG_pull_fetched") as producer:
        await producer.send("Orders", b"x")
    async with PullConsumer(broker.namesrv, "CG_pull_fetched") as consumer:
        await consumer.subscribe("Orders")
        mq = (await consumer.fetch_queues("Orders"))[0]
        moved = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, {      # (another of the group's members)
            "topic": "Orders", "queueId": mq.queue_id, "consumerGroup": "CG_pull_fetched", "commitOffset": 3})
        assert moved.code == ResponseCode.SUCCESS, moved.remark

        async def reported():
            status = await request(broker.broker, R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS,
                                   {"topic": "Orders", "group": "CG_pull_fetched"})
            assert status.code == ResponseCode.SUCCESS, status.remark
            obj, _ = decode_mq_table(status.body_bytes(), "messageQueueTable")
            return {cid: {json.loads(k)["queueId"]: v for k, v in table.items()}
                    for cid, table in obj["consumerTable"].items()}

        assert await consumer.fetch_offset(mq) == 3
        assert await reported() == {consumer.client_id: {mq.queue_id: 3}}
        await consumer.commit_offset(mq, 5)
        assert await reported() == {consumer.client_id: {mq.queue_id: 5}}     # (a commit after the fetch wins)
        assert await consumer.fetch_offset(mq) == 5
        assert await reported() == {consumer.client_id: {mq.queue_id: 5}}
