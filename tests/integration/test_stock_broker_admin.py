"""Broker codes of mqadmin 4.9.8 that txmq answered incompletely or REQUEST_CODE_NOT_SUPPORTED, each sent as the
stock tool frames it over TCP to the real broker, the answer read as the Java tool reads it
(docs/compatibility.md)."""
from __future__ import annotations

import json

import pytest

from producer import MessageQueue, Producer
from protocol.codes import LanguageCode, ResponseCode
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import decode_offset_msg_id, java_string_hash
from tests.support.bounded import bounded
from tests.support.cluster_process import request

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
