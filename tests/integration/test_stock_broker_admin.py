"""Broker codes of mqadmin 4.9.8 that txmq answered incompletely or REQUEST_CODE_NOT_SUPPORTED, each sent as the
stock tool frames it over TCP to the real broker, the answer read as the Java tool reads it
(docs/compatibility.md)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from consumer import PullConsumer
from producer import MessageQueue, Producer
from protocol.codes import LanguageCode, Perm, ResponseCode
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import NoPermissionError
from protocol.message import decode_offset_msg_id, java_string_hash
from tests.support.bounded import bounded
from tests.support.cluster_process import NamesrvProcess, cluster_flags, request, route, wait_for_route

pytestmark = pytest.mark.asyncio


async def _topic_config_wrapper(addr: str) -> dict:
    resp = await request(addr, R.GET_ALL_TOPIC_CONFIG)
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    return json.loads(resp.body_bytes())


@bounded(60)
async def test_all_topic_config_carries_the_data_version_a_slave_assigns(broker):
    """TopicConfigSerializeWrapper: a Java slave's SlaveSynchronize compares and assigns dataVersion (a
    NullPointerException each sync when it was missing) and re-reads the table when it moved."""
    before = await _topic_config_wrapper(broker.broker)
    assert list(before) == ["dataVersion", "topicConfigTable"]
    assert list(before["dataVersion"]) == ["counter", "timestamp"]
    resp = await request(broker.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Versioned", "readQueueNums": 1,
                                                                     "writeQueueNums": 1, "perm": 6})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    after = await _topic_config_wrapper(broker.broker)
    assert "Versioned" in after["topicConfigTable"] and after["dataVersion"] != before["dataVersion"]


def _query_cq(topic: str, queue_id: int, index: int, count: int = 10, group: str | None = None) -> tuple:
    """mqadmin queryCq's QUERY_CONSUME_QUEUE header (consumerGroup only with -g)."""
    return R.QUERY_CONSUME_QUEUE, {"topic": topic, "queueId": queue_id, "index": index, "count": count,
                                   **({"consumerGroup": group} if group is not None else {})}


def _tag_heartbeat(group: str, topic: str, tag: str) -> RemotingCommand:
    body = {"clientID": "10.0.0.9@cq", "producerDataSet": [],
            "consumerDataSet": [{"groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                                 "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False,
                                 "subscriptionDataSet": [{"topic": topic, "subString": tag, "subVersion": 7,
                                                          "tagsSet": [tag], "codeSet": [java_string_hash(tag)]}]}]}
    return RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode(), language=LanguageCode.JAVA)


@bounded(60)
async def test_query_consume_queue_shows_the_stored_units(broker):
    """mqadmin queryCq: QUERY_CONSUME_QUEUE was REQUEST_CODE_NOT_SUPPORTED. Each unit names its record's
    commit-log offset (the one the send's offsetMsgId carries), size and tag hash; numbered from the index."""
    async with Producer(broker.namesrv, "PG_cq") as producer:
        queue = MessageQueue("Cq", "broker-a", 1)
        sent = [await producer.send("Cq", b"x" * (10 + i), tags=f"T{i % 2}", queue=queue) for i in range(5)]
    resp = await request(broker.broker, *_query_cq("Cq", 1, 1, 3))
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    body = json.loads(resp.body_bytes())
    assert list(body) == ["maxQueueIndex", "minQueueIndex", "queueData"]
    assert (body["maxQueueIndex"], body["minQueueIndex"]) == (5, 0)
    assert [list(u) for u in body["queueData"]] == [["eval", "physicOffset", "physicSize", "tagsCode"]] * 3
    assert [u["physicOffset"] for u in body["queueData"]] == [decode_offset_msg_id(r.offset_msg_id)[2]
                                                              for r in sent[1:4]]
    assert [u["tagsCode"] for u in body["queueData"]] == [java_string_hash(f"T{i % 2}") for i in range(1, 4)]
    assert all(u["physicSize"] > 10 and u["eval"] is False for u in body["queueData"])
    tail = json.loads((await request(broker.broker, *_query_cq("Cq", 1, 3, 10))).body_bytes())
    assert [u["physicOffset"] for u in tail["queueData"]] == [u["physicOffset"] for u in body["queueData"][2:]] + [
        decode_offset_msg_id(sent[4].offset_msg_id)[2]]

    offline = json.loads((await request(broker.broker, *_query_cq("Cq", 1, 0, 1, "CG_away"))).body_bytes())
    assert offline["filterData"] == "CG_away@Cq is not online!" and "subscriptionData" not in offline
    conn = await open_connection("127.0.0.1", int(broker.broker.rpartition(":")[2]))
    try:
        assert (await conn.request(_tag_heartbeat("CG_cq", "Cq", "T1"), 5.0)).code == ResponseCode.SUCCESS
        online = json.loads((await request(broker.broker, *_query_cq("Cq", 1, 0, 1, "CG_cq"))).body_bytes())
    finally:
        conn.close()
    assert list(online) == ["filterData", "maxQueueIndex", "minQueueIndex", "queueData", "subscriptionData"]
    assert online["filterData"] == "null"
    assert (online["subscriptionData"]["subString"], online["subscriptionData"]["subVersion"]) == ("T1", 7)

    past = await request(broker.broker, *_query_cq("Cq", 1, 5))
    assert (past.code, past.remark) == (ResponseCode.SUCCESS, "Index 5 of 1@Cq is not exist!")
    assert json.loads(past.body_bytes()) == {"maxQueueIndex": 5, "minQueueIndex": 0}   # the tool prints the bounds
    unknown = await request(broker.broker, *_query_cq("Cq", 77, 0))
    assert (unknown.code, unknown.remark) == (ResponseCode.SYSTEM_ERROR, "77@Cq is not exist!")
    greedy = await request(broker.broker, *_query_cq("Cq", 1, 0, 1 << 30))
    assert greedy.code == ResponseCode.SYSTEM_ERROR and "1024" in greedy.remark


async def _stats(addr: str, name: str, key: str) -> RemotingCommand:
    """DefaultMQAdminExt.viewBrokerStatsData: VIEW_BROKER_STATS_DATA {statsName, statsKey}."""
    return await request(addr, R.VIEW_BROKER_STATS_DATA, {"statsName": name, "statsKey": key})


def _stats_all_columns(resp: RemotingCommand) -> tuple[float, int]:
    """What statsAll prints of a BrokerStatsData: the minute's tps, and compute24HourSum (the day's sum, else the
    hour's, else the minute's)."""
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    body = json.loads(resp.body_bytes())
    assert list(body) == ["statsDay", "statsHour", "statsMinute"]
    assert all(list(item) == ["avgpt", "sum", "tps"] for item in body.values())
    day_sum = next((body[w]["sum"] for w in ("statsDay", "statsHour", "statsMinute") if body[w]["sum"]), 0)
    return body["statsMinute"]["tps"], day_sum


@bounded(60)
async def test_broker_stats_data_gives_stats_all_its_rates_and_day_counts(broker):
    """mqadmin statsAll asks VIEW_BROKER_STATS_DATA for each topic (TOPIC_PUT_NUMS) and topic@group
    (GROUP_GET_NUMS) and swallows any failure: with REQUEST_CODE_NOT_SUPPORTED it printed every rate and every
    day's count as 0. A broker this young has every window reaching back past the sends."""
    async with Producer(broker.namesrv, "PG_stats") as producer:
        for i in range(7):
            await producer.send("Stats", b"s%d" % i, queue=MessageQueue("Stats", "broker-a", 0))
    async with PullConsumer(broker.namesrv, "CG_stats") as consumer:
        got = await consumer.pull(MessageQueue("Stats", "broker-a", 0), 0, max_nums=5)
        assert len(got.messages) == 5
    in_tps, in_today = _stats_all_columns(await _stats(broker.broker, "TOPIC_PUT_NUMS", "Stats"))
    out_tps, out_today = _stats_all_columns(await _stats(broker.broker, "GROUP_GET_NUMS", "Stats@CG_stats"))
    assert (in_today, out_today) == (7, 5) and in_tps > 0 and out_tps > 0
    for name, key in (("TOPIC_PUT_NUMS", "NeverSent"), ("GROUP_GET_NUMS", "Stats@CG_none"),
                      ("GROUP_GET_NUMS", "Stats"), ("QUEUE_PUT_NUMS", "Stats")):
        unknown = await _stats(broker.broker, name, key)
        assert (unknown.code, unknown.remark) == (ResponseCode.SYSTEM_ERROR, f"The stats <{name}> <{key}> not exist")


@bounded(60)
async def test_halves_are_counted_under_the_half_topic_as_export_metrics_reads_them(broker):
    """mqadmin exportMetrics reads transInTps and transOneDayInNum from TOPIC_PUT_NUMS RMQ_SYS_TRANS_HALF_TOPIC,
    which RocketMQ 4.9.8 counts for every half (its send path counts the message's topic, by then the half
    topic). txmq never counted it: the key was "not exist", and the tool showed no transactional traffic."""
    from producer import LocalTransactionState, TransactionProducer

    class Commit:
        async def execute_local_transaction(self, msg, arg):
            return LocalTransactionState.COMMIT_MESSAGE

        async def check_local_transaction(self, msg):
            return LocalTransactionState.COMMIT_MESSAGE
    async with TransactionProducer(broker.namesrv, "PG_trans_stats", Commit()) as producer:
        for i in range(3):
            await producer.send_in_transaction("TransStats", b"t%d" % i)
    trans_tps, trans_today = _stats_all_columns(await _stats(broker.broker, "TOPIC_PUT_NUMS", "RMQ_SYS_TRANS_HALF_TOPIC"))
    assert trans_today == 3 and trans_tps > 0      # (counted before each half's SEND_OK)


@bounded(60)
async def test_runtime_info_has_the_daily_totals_export_metrics_parses(broker):
    """mqadmin exportMetrics and clusterList -m: Long.parseLong of msgPut/GetTotal{Today,Yesterday}Morning and
    msgPut/GetTotalTodayNow (a missing key is a NumberFormatException: exportMetrics failed for every txmq
    broker)."""
    async with Producer(broker.namesrv, "PG_daily") as producer:
        await producer.send("Daily", b"d")
    resp = await request(broker.broker, R.GET_BROKER_RUNTIME_INFO)
    table = json.loads(resp.body_bytes())["table"]
    for kind in ("Put", "Get"):                         # a local midnight may fall during the test: no exact day
        yesterday, today, now = (int(table[f"msg{kind}Total{when}"])
                                 for when in ("YesterdayMorning", "TodayMorning", "TodayNow"))
        assert 0 <= yesterday <= today <= now
    assert int(table["msgPutTotalTodayNow"]) >= 1 and int(table["msgGetTotalTodayNow"]) == 0


def _update_config(**props) -> tuple:
    """mqadmin updateBrokerConfig -k K -v V: UPDATE_BROKER_CONFIG, no header fields, the Properties text as body
    (MixAll.properties2String: key=value a line)."""
    return R.UPDATE_BROKER_CONFIG, None, "".join(f"{k}={v}\n" for k, v in props.items()).encode()


async def _route_perm(addr: str, topic: str) -> int:
    [qd] = (await route(addr, topic)).queue_datas
    return qd.perm


async def _wait_for_perm(namesrv: str, topic: str, perm: int) -> None:
    """Until the name server routes ``topic`` with ``perm`` (the broker re-registers at once on a change)."""
    for _ in range(300):
        if await _route_perm(namesrv, topic) == perm:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{topic} still routed with perm {await _route_perm(namesrv, topic)}, not {perm}")


@bounded(90)
async def test_update_broker_config_takes_the_broker_out_of_service_and_refuses_other_keys(tmp_path, broker_factory):
    """mqadmin updateBrokerConfig was REQUEST_CODE_NOT_SUPPORTED. brokerPermission changes live: routes (its own
    broker port's and, registered at once, the name server's) carry it and sends or pulls it forbids are
    refused; any other key is refused by name and nothing changes (RocketMQ would apply it live: saying
    SUCCESS for a flag that does not change would lie)."""
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    try:
        b = broker_factory(*cluster_flags(namesrv.addr, "broker-a", 60_000))
        async with Producer(namesrv.addr, "PG_perm") as producer:
            await producer.send("Maint", b"before", queue=MessageQueue("Maint", "broker-a", 0))
        await wait_for_route(namesrv.addr, "Maint", {"broker-a"})

        done = await request(b.broker, *_update_config(brokerPermission=4))
        assert done.code == ResponseCode.SUCCESS, done.remark
        assert await _route_perm(b.broker, "Maint") == Perm.READ
        await _wait_for_perm(namesrv.addr, "Maint", Perm.READ)
        async with Producer(namesrv.addr, "PG_perm_ro", retries=0) as producer:
            with pytest.raises(NoPermissionError):
                await producer.send("Maint", b"routed nowhere")
            with pytest.raises(NoPermissionError, match=r"sending message is forbidden"):   # an old route
                await producer.send("Maint", b"sent anyway", queue=MessageQueue("Maint", "broker-a", 0))
        async with PullConsumer(namesrv.addr, "CG_perm") as consumer:
            got = await consumer.pull(MessageQueue("Maint", "broker-a", 0), 0)
            assert [m.body for m in got.messages] == [b"before"]                             # reads go on
            config = (await request(b.broker, R.GET_BROKER_CONFIG))
            assert "brokerPermission=4\n" in config.body_bytes().decode()
            assert json.loads(config.ext_fields["version"])["counter"] == 1

            for bad, word in ((_update_config(flushDiskType="SYNC_FLUSH", brokerPermission=6), "flushDiskType"),
                              (_update_config(brokerPermission=7), "brokerPermission=7"),
                              (_update_config(brokerPermission="rw"), "brokerPermission=rw")):
                refused = await request(b.broker, *bad)
                assert refused.code == ResponseCode.SYSTEM_ERROR and word in refused.remark
                assert "Nothing was changed" in refused.remark
            assert await _route_perm(b.broker, "Maint") == Perm.READ

            assert (await request(b.broker, *_update_config(brokerPermission=2))).code == ResponseCode.SUCCESS
            with pytest.raises(NoPermissionError, match=r"pulling message is forbidden"):
                await consumer.pull(MessageQueue("Maint", "broker-a", 0), 0)
        assert (await request(b.broker, *_update_config(brokerPermission=6))).code == ResponseCode.SUCCESS
        await _wait_for_perm(namesrv.addr, "Maint", Perm.READ_WRITE)
        async with Producer(namesrv.addr, "PG_perm_back") as producer:
            assert (await producer.send("Maint", b"after")).queue.broker_name == "broker-a"
    finally:
        namesrv.kill()


def _producer_heartbeat(client_id: str, *groups: str) -> RemotingCommand:
    """A 4.9.8 producer's HEART_BEAT: its groups and the client's inner producer, no consumers."""
    body = {"clientID": client_id, "consumerDataSet": [],
            "producerDataSet": [{"groupName": g} for g in (*groups, "CLIENT_INNER_PRODUCER")]}
    return RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode(), language=LanguageCode.JAVA)


@bounded(60)
async def test_all_producer_info_lists_each_groups_live_producers(broker):
    """mqadmin producer -b ADDR: GET_ALL_PRODUCER_INFO was REQUEST_CODE_NOT_SUPPORTED. ProducerTableInfo, each
    ProducerInfo as ProducerManager.getProducerTable writes it (remoteIP as InetSocketAddress.toString)."""
    port = int(broker.broker.rpartition(":")[2])
    one, two = await open_connection("127.0.0.1", port), await open_connection("127.0.0.1", port)
    local = one.transport.get_extra_info("sockname")[1]
    try:
        before = int(time.time() * 1000)
        for conn, cid, groups in ((one, "10.0.0.1@1", ("PG_a", "PG_b")), (two, "10.0.0.2@2", ("PG_a",))):
            assert (await conn.request(_producer_heartbeat(cid, *groups), 5.0)).code == ResponseCode.SUCCESS
        after = int(time.time() * 1000)
        resp = await request(broker.broker, R.GET_ALL_PRODUCER_INFO)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        data = json.loads(resp.body_bytes())["data"]
    finally:
        one.close()
        two.close()
    assert [p["clientId"] for p in data["PG_a"]] == ["10.0.0.1@1", "10.0.0.2@2"]
    assert [p["clientId"] for p in data["PG_b"]] == ["10.0.0.1@1"]
    row = data["PG_a"][0]
    assert list(row) == ["clientId", "language", "lastUpdateTimestamp", "remoteIP", "version"]
    assert (row["language"], row["version"], row["remoteIP"]) == ("JAVA", 409, f"/127.0.0.1:{local}")
    assert before - 1000 <= row["lastUpdateTimestamp"] <= after + 1000     # the wall clock, not the monotonic one
