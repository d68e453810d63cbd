"""A broker that runs for months sees clients come and go by the thousand: what it keeps per client, per
connection or per lock must go with them, or it grows until the broker falls over weeks later. Here 200
distinct clients (their own ids and ports) heartbeat, lock a queue, park a pull and hang up; the broker's own
views (GET_BROKER_RUNTIME_INFO, the metrics scrape) must come back to where they started."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol.codes import PullSysFlag, ResponseCode
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

CLIENTS = 200
LOCK_TTL_MS = 300


def _scrape(broker) -> dict:
    text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def _connect(broker):
    host, _, port = broker.broker.rpartition(":")
    return await open_connection(host, int(port))


async def _runtime(broker) -> dict:
    conn = await _connect(broker)
    try:
        resp = await conn.request(RemotingCommand.request(R.GET_BROKER_RUNTIME_INFO), 5.0)
    finally:
        conn.close()
    return json.loads(resp.body_bytes())["table"]


def _heartbeat(client_id: str, group: int) -> RemotingCommand:
    body = {"clientID": client_id,
            "producerDataSet": [{"groupName": f"PG_churn{group}"}],
            "consumerDataSet": [{"groupName": f"CG_churn{group}", "consumeType": "CONSUME_PASSIVELY",
                                 "messageModel": "CLUSTERING", "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET",
                                 "subscriptionDataSet": [{"topic": "Churn", "subString": "*", "subVersion": 1}]}]}
    return RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode())


def _lock(client_id: str, group: str, queue: int) -> RemotingCommand:
    body = {"consumerGroup": group, "clientId": client_id,
            "mqSet": [{"topic": "Churn", "brokerName": "broker-a", "queueId": queue}]}
    return RemotingCommand.request(R.LOCK_BATCH_MQ, body=json.dumps(body).encode())


def _parked_pull(group: str) -> RemotingCommand:
    return RemotingCommand.request(R.PULL_MESSAGE, {
        "consumerGroup": group, "topic": "Churn", "queueId": 0, "queueOffset": 0, "maxMsgNums": 1,
        "sysFlag": PullSysFlag.SUSPEND, "commitOffset": 0, "suspendTimeoutMillis": 60_000, "subVersion": 1})


async def _until(predicate, what: str, tries: int = 500):
    """Poll a broker view until ``predicate`` holds: its state changes on its own loop, with no event to await
    from here. Bounded by count (each try is one request or scrape). ``predicate`` returns (done, value)."""
    value = None
    for _ in range(tries):
        done, value = await predicate()
        if done:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}; last seen {value}")


@bounded(120)
async def test_two_hundred_clients_come_and_go_and_leave_nothing_behind(broker_factory):
    b = broker_factory("--queue-lock-max-live-ms", str(LOCK_TTL_MS))
    setup = await _connect(b)
    resp = await setup.request(RemotingCommand.request(R.UPDATE_AND_CREATE_TOPIC, {
        "topic": "Churn", "readQueueNums": 4, "writeQueueNums": 4, "perm": 6}), 5.0)
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    await setup.request(_heartbeat("keeper", 0), 5.0)      # one client stays throughout
    before = await _runtime(b)
    scrape_before = await asyncio.to_thread(_scrape, b)
    assert before["txmqConsumerGroups"] == before["txmqProducerGroups"] == "1"

    conns, pulls = [], []
    for i in range(CLIENTS):
        conn = await _connect(b)
        conns.append(conn)
        client_id = f"10.0.{i // 250}.{i % 250}@churn-{i}"
        group = i % 5                                      # pods of five services, each pod its own client id
        assert (await conn.request(_heartbeat(client_id, group), 5.0)).code == ResponseCode.SUCCESS
        granted = await conn.request(_lock(client_id, f"CG_churn{group}-{i}", i % 4), 5.0)
        assert json.loads(granted.body_bytes())["lockOKMQSet"]
        pulls.append(asyncio.ensure_future(conn.request(_parked_pull(f"CG_churn{group}"), 90.0)))

    async def all_in():
        m = await asyncio.to_thread(_scrape, b)
        return m[("txmq_parked_pulls", ())] == CLIENTS, m
    during = await _until(all_in, f"{CLIENTS} pulls parked")
    assert during[("rocketmq_consumer_connections", (("consumer_group", "CG_churn1"),))] == CLIENTS // 5
    info = await _runtime(b)
    assert info["txmqConsumerGroups"] == info["txmqProducerGroups"] == "5"
    assert int(info["txmqQueueLocks"]) > 0     # (how many: those taken within the last lifetime, on this machine)

    for conn in conns:
        conn.close()
    await asyncio.gather(*pulls, return_exceptions=True)

    async def all_gone():
        m = await asyncio.to_thread(_scrape, b)
        parked, conns = m[("txmq_parked_pulls", ())], m[("txmq_open_connections", (("listener", "broker"),))]
        # (one connection stays: ``setup``; the baseline scrape may still count the runtime query's, closed
        # just before it)
        return parked == 0 and conns == 1, m if parked == 0 and conns == 1 else {"parked": parked,
                                                                                 "connections": conns}
    after = await _until(all_gone, "the clients' connections and pulls gone")
    info = await _runtime(b)
    assert info["txmqConsumerGroups"] == info["txmqProducerGroups"] == "1"
    # Nothing in the scrape names a client or a connection: its series are what they were, except the
    # counters of requests handled.
    added = {key for key in after if key not in scrape_before}
    assert not [k for k in added if any("churn-" in v or "@" in v for _n, v in k[1])], added
    groups = ("rocketmq_consumer_connections", "rocketmq_producer_connections")
    assert {k: v for k, v in after.items() if k[0] in groups} == {k: v for k, v in scrape_before.items()
                                                                  if k[0] in groups}

    # The 200 locks outlive their holders by their lifetime, then go (an expired lock is free anyway).
    await asyncio.sleep(2 * LOCK_TTL_MS / 1000)     # (their lifetime is time: nothing else to wait on)
    assert (await setup.request(_lock("keeper", "CG_churn0", 0), 5.0)).code == ResponseCode.SUCCESS
    assert (await _runtime(b))["txmqQueueLocks"] == "1"
    setup.close()
