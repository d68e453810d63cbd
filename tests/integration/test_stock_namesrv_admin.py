"""Name-server codes of the 4.9.8 admin API that txmq answered REQUEST_CODE_NOT_SUPPORTED: GET_TOPICS_BY_CLUSTER
(224), GET_SYSTEM_TOPIC_LIST_FROM_NS (304, then 305 to the broker it names) and mqadmin wipeWritePerm /
addWritePerm (205 / 327). Each is sent as MQClientAPIImpl frames it, over TCP to the real processes, and the
answer read as the Java client reads it (docs/compatibility.md)."""
from __future__ import annotations

import json

import pytest

from producer import Producer
from protocol.codes import Perm, ResponseCode
from protocol.codes import RequestCode as R
from protocol.errors import NoPermissionError
from tests.support.bounded import bounded
from tests.support.cluster_process import NamesrvProcess, cluster_flags, request, route, wait_for_route

pytestmark = pytest.mark.asyncio


async def _topic_list(addr: str, code: int, fields: dict | None = None) -> dict:
    """A TopicList answer as TopicList.decode reads it; the keys in fastjson's order, brokerAddr when set."""
    resp = await request(addr, code, fields)
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    body = json.loads(resp.body_bytes())
    assert list(body) in (["topicList"], ["brokerAddr", "topicList"])
    return body


async def _perm_call(addr: str, code: int, broker_name: str) -> int:
    """wipeWritePermOfBroker / addWritePermOfBroker: {brokerName}; SUCCESS with the count in a @CFNotNull
    header field, which decodeCommandCustomHeader requires present and an Integer."""
    resp = await request(addr, code, {"brokerName": broker_name})
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    key = "wipeTopicCount" if code == R.WIPE_WRITE_PERM_OF_BROKER else "addTopicCount"
    return int(resp.ext_fields[key])


async def _perms(namesrv: str, topic: str) -> dict[str, int]:
    return {qd.broker_name: qd.perm for qd in (await route(namesrv, topic)).queue_datas}


async def _create(broker: str, topic: str, perm: int = 6) -> None:
    resp = await request(broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": topic, "readQueueNums": 2,
                                                             "writeQueueNums": 2, "perm": perm})
    assert resp.code == ResponseCode.SUCCESS, resp.remark


async def _system_topics_of(body: dict) -> set[str]:
    """What MQClientAPIImpl.getSystemTopicList does with 304's answer: a non-empty list with a brokerAddr, so
    GET_SYSTEM_TOPIC_LIST_FROM_BROKER (305) to that broker, whose topics are added (its failure throws)."""
    assert body["topicList"] and body["brokerAddr"]
    from_broker = await _topic_list(body["brokerAddr"], R.GET_SYSTEM_TOPIC_LIST_FROM_BROKER)
    return set(body["topicList"]) | set(from_broker["topicList"])


@bounded(90)
async def test_stand_alone_name_server_wipes_and_gives_back_a_brokers_write_perm(tmp_path, broker_factory):
    """wipeWritePerm takes broker-a out of every write route, producers send to broker-b only, a topic made on
    broker-a meanwhile (a registration with a new data version) stays unwritable, and addWritePerm gives back
    what the broker registered: a read-only topic stays read-only (RocketMQ's add makes it read-write)."""
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    try:
        a = broker_factory(*cluster_flags(namesrv.addr, "broker-a", 60_000), store="a")
        b = broker_factory(*cluster_flags(namesrv.addr, "broker-b", 60_000), store="b")
        for broker in (a, b):
            await _create(broker.broker, "Maint")
        await _create(a.broker, "ReadOnlyA", perm=Perm.READ)
        await wait_for_route(namesrv.addr, "Maint", {"broker-a", "broker-b"})
        await wait_for_route(namesrv.addr, "ReadOnlyA", {"broker-a"})

        wiped = await _perm_call(namesrv.addr, R.WIPE_WRITE_PERM_OF_BROKER, "broker-a")
        listed_a = [t for t in (await _topic_list(namesrv.addr, R.GET_TOPICS_BY_CLUSTER,
                                                   {"cluster": "DefaultCluster"}))["topicList"]
                    if "broker-a" in await _perms(namesrv.addr, t)]
        assert wiped == len(listed_a) and wiped >= 2
        assert await _perms(namesrv.addr, "Maint") == {"broker-a": Perm.READ, "broker-b": Perm.READ_WRITE}
        async with Producer(namesrv.addr, "PG_wiped", send_timeout=3.0) as producer:
            results = [await producer.send("Maint", b"m%d" % i) for i in range(12)]
            assert {r.queue.broker_name for r in results} == {"broker-b"}

        await _create(a.broker, "MadeWhileWiped")
        await wait_for_route(namesrv.addr, "MadeWhileWiped", {"broker-a"})
        assert await _perms(namesrv.addr, "MadeWhileWiped") == {"broker-a": Perm.READ}
        assert (await _perms(namesrv.addr, "Maint"))["broker-a"] == Perm.READ
        async with Producer(namesrv.addr, "PG_wiped_only", send_timeout=3.0, retries=0) as producer:
            with pytest.raises(NoPermissionError):
                await producer.send("MadeWhileWiped", b"nowhere to write")

        assert await _perm_call(namesrv.addr, R.ADD_WRITE_PERM_OF_BROKER, "broker-a") == wiped + 1
        assert await _perms(namesrv.addr, "Maint") == {"broker-a": Perm.READ_WRITE, "broker-b": Perm.READ_WRITE}
        assert await _perms(namesrv.addr, "ReadOnlyA") == {"broker-a": Perm.READ}
        async with Producer(namesrv.addr, "PG_back", send_timeout=3.0) as producer:
            results = [await producer.send("Maint", b"m%d" % i) for i in range(12)]
            assert {r.queue.broker_name for r in results} == {"broker-a", "broker-b"}
        assert await _perm_call(namesrv.addr, R.WIPE_WRITE_PERM_OF_BROKER, "broker-zz") == 0
    finally:
        namesrv.kill()


@bounded(60)
async def test_stand_alone_name_server_lists_topics_by_cluster_and_system_topics(tmp_path, broker_factory):
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    try:
        a = broker_factory(*cluster_flags(namesrv.addr, "broker-a", 60_000), store="a")
        await _create(a.broker, "InCluster")
        await wait_for_route(namesrv.addr, "InCluster", {"broker-a"})
        ours = await _topic_list(namesrv.addr, R.GET_TOPICS_BY_CLUSTER, {"cluster": "DefaultCluster"})
        assert {"InCluster", "TBW102", "broker-a", "DefaultCluster"} <= set(ours["topicList"])
        assert ours == await _topic_list(namesrv.addr, R.GET_TOPICS_BY_CLUSTER, {"cluster": "DefaultCluster"})
        assert (await _topic_list(namesrv.addr, R.GET_TOPICS_BY_CLUSTER, {"cluster": "Elsewhere"})) == {
            "topicList": []}
        missing = await request(namesrv.addr, R.GET_TOPICS_BY_CLUSTER)
        assert missing.code != ResponseCode.SUCCESS and "cluster" in missing.remark

        body = await _topic_list(namesrv.addr, R.GET_SYSTEM_TOPIC_LIST_FROM_NS)
        assert set(body["topicList"]) == {"DefaultCluster", "broker-a"} and body["brokerAddr"] == a.broker
        system = await _system_topics_of(body)
        assert {"TBW102", "RMQ_SYS_TRANS_HALF_TOPIC", "SCHEDULE_TOPIC_XXXX", "DefaultCluster_REPLY_TOPIC"} <= system
        assert "InCluster" not in system
    finally:
        namesrv.kill()


@bounded(60)
async def test_brokers_own_name_server_answers_the_admin_codes(broker):
    """The broker's own name server: 224 and 304 about its one broker, and wipeWritePerm / addWritePerm on the
    routes it answers on both ports; our producer then has no queue to write to, and has them back after."""
    await _create(broker.broker, "Own")
    ours = await _topic_list(broker.namesrv, R.GET_TOPICS_BY_CLUSTER, {"cluster": "DefaultCluster"})
    assert {"Own", "TBW102"} <= set(ours["topicList"])
    assert (await _topic_list(broker.namesrv, R.GET_TOPICS_BY_CLUSTER, {"cluster": "Elsewhere"}))["topicList"] == []
    body = await _topic_list(broker.namesrv, R.GET_SYSTEM_TOPIC_LIST_FROM_NS)
    assert set(body["topicList"]) == {"DefaultCluster", "broker-a"} and body["brokerAddr"] == broker.broker
    assert {"TBW102", "RMQ_SYS_TRANS_OP_HALF_TOPIC"} <= await _system_topics_of(body)

    assert await _perm_call(broker.namesrv, R.WIPE_WRITE_PERM_OF_BROKER, "broker-zz") == 0
    assert (await _perms(broker.namesrv, "Own"))["broker-a"] == Perm.READ_WRITE
    assert await _perm_call(broker.namesrv, R.WIPE_WRITE_PERM_OF_BROKER, "broker-a") == len(ours["topicList"])
    for addr in (broker.namesrv, broker.broker):
        assert await _perms(addr, "Own") == {"broker-a": Perm.READ}
    async with Producer(broker.namesrv, "PG_own_wiped", send_timeout=3.0, retries=0) as producer:
        with pytest.raises(NoPermissionError):
            await producer.send("Own", b"nowhere to write")
    assert await _perm_call(broker.namesrv, R.ADD_WRITE_PERM_OF_BROKER, "broker-a") >= 1
    assert await _perms(broker.namesrv, "Own") == {"broker-a": Perm.READ_WRITE}
    async with Producer(broker.namesrv, "PG_own_back", send_timeout=3.0) as producer:
        assert (await producer.send("Own", b"written")).queue.broker_name == "broker-a"
