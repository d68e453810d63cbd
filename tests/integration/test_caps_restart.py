"""Per-address caps across a restart: what one address made is counted again at start-up, so a client at
max_topics_per_host, max_queues_per_host or max_offsets_per_host cannot make as many again after every restart
(one it waits for, or causes)."""
from __future__ import annotations

import itertools
import json

import pytest

from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.command import RemotingCommand
from tests.support.bounded import bounded
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio

_OPAQUES = itertools.count(1 << 24)
HOSTILE = "127.0.0.2"


async def _one(addr: str, host: str, code: int, fields: dict, body: bytes = b"") -> RemotingCommand:
    client = await RawClient.open(addr, host)
    try:
        [reply] = await client.call(RemotingCommand(code, opaque=next(_OPAQUES), body=body, ext_fields=fields), 10)
        return reply
    finally:
        client.close()


async def _send(addr: str, host: str, topic: str) -> RemotingCommand:
    return await _one(addr, host, R.SEND_MESSAGE, {
        "producerGroup": "PG_caps", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "1",
        "queueId": "0", "sysFlag": "0", "bornTimestamp": "0", "flag": "0", "properties": ""}, b"m")


async def _update_topic(addr: str, host: str, topic: str, queues: int) -> RemotingCommand:
    return await _one(addr, host, R.UPDATE_AND_CREATE_TOPIC, {
        "topic": topic, "readQueueNums": str(queues), "writeQueueNums": str(queues), "perm": "6"})


async def _commit(addr: str, host: str, group: str) -> RemotingCommand:
    return await _one(addr, host, R.UPDATE_CONSUMER_OFFSET, {
        "consumerGroup": group, "topic": "Offsets", "queueId": "0", "commitOffset": "0"})


@bounded(90)
async def test_topics_and_queues_an_address_made_still_count_after_a_restart(broker_factory):
    """The topics and queues one address made were counted in memory only: after a restart it started from zero,
    and made max_topics_per_host more, again and again. Saved with each topic in the catalogue, they count again:
    after a restart the address is still at its limits, its deleted topic still gives its room back, and another
    address still makes its own."""
    flags = ("--max-topics-per-host", "3", "--max-queues-per-host", "8", "--max-auto-create-topics-per-s", "1000")
    broker = broker_factory(*flags)
    codes = [(await _send(broker.broker, HOSTILE, f"Hostile{i}")).code for i in range(2)]
    codes.append((await _update_topic(broker.broker, HOSTILE, "HostileWide", 4)).code)
    assert codes == [C.SUCCESS] * 3
    assert (await _send(broker.broker, HOSTILE, "Hostile3")).code == C.NO_PERMISSION
    assert broker.stop() == 0

    broker = broker_factory(*flags)
    refused = await _send(broker.broker, HOSTILE, "Hostile3")
    assert refused.code == C.NO_PERMISSION and "max_topics_per_host=3" in refused.remark, refused.remark
    # its 6 queues (1 + 1 + 4) are its own still: 2 + 7 would be past 8
    grown = await _update_topic(broker.broker, HOSTILE, "HostileWide", 7)
    assert grown.code == C.NO_PERMISSION and "max_queues_per_host=8" in grown.remark, grown.remark
    assert (await _update_topic(broker.broker, HOSTILE, "HostileWide", 6)).code == C.SUCCESS
    assert (await _send(broker.broker, "127.0.0.3", "Other0")).code == C.SUCCESS
    deleted = await _one(broker.broker, "127.0.0.1", R.DELETE_TOPIC_IN_BROKER, {"topic": "Hostile0"})
    assert deleted.code == C.SUCCESS, deleted.remark
    assert broker.stop() == 0

    broker = broker_factory(*flags)
    assert (await _send(broker.broker, HOSTILE, "Hostile3")).code == C.SUCCESS     # Hostile0's room
    assert (await _send(broker.broker, HOSTILE, "Hostile4")).code == C.NO_PERMISSION


@bounded(90)
async def test_offsets_an_address_made_still_count_after_a_restart(broker_factory):
    """max_offsets_per_host counted the offsets one address made since the broker started: a restart gave it
    its room again. Saved with the offsets, they count again; one it has is still moved."""
    broker = broker_factory("--max-offsets-per-host", "2")
    assert (await _send(broker.broker, "127.0.0.1", "Offsets")).code == C.SUCCESS
    assert [(await _commit(broker.broker, HOSTILE, f"CG{i}")).code for i in range(2)] == [C.SUCCESS] * 2
    assert broker.stop() == 0

    broker = broker_factory("--max-offsets-per-host", "2")
    refused = await _commit(broker.broker, HOSTILE, "CG2")
    assert refused.code != C.SUCCESS and "max_offsets_per_host=2" in refused.remark, refused.remark
    assert (await _commit(broker.broker, HOSTILE, "CG0")).code == C.SUCCESS
    assert (await _commit(broker.broker, "127.0.0.3", "CG_other")).code == C.SUCCESS


@bounded(60)
async def test_a_catalogue_and_offsets_of_an_older_version_are_read_and_charged_to_no_one(broker_factory,
                                                                                        tmp_path):
    """A store from before creators and makers were saved starts and serves its topics and offsets; what they
    hold is no address's (said once), and every address makes up to its limits from there."""
    config = tmp_path / "store" / "config"
    config.mkdir(parents=True)
    (config / "topics.json").write_text(json.dumps({"topics": [
        {"name": f"Old{i}", "read_queue_nums": 1, "write_queue_nums": 1, "perm": 6} for i in range(3)]}))
    (config / "consumerOffset.json").write_text(json.dumps({"Old0@CG_old": {"0": 0}}))
    broker = broker_factory("--max-topics-per-host", "2", "--max-offsets-per-host", "1")
    assert (await _send(broker.broker, HOSTILE, "Old0")).code == C.SUCCESS
    assert [(await _send(broker.broker, HOSTILE, f"New{i}")).code for i in range(3)] == [
        C.SUCCESS, C.SUCCESS, C.NO_PERMISSION]
    offset = await _one(broker.broker, HOSTILE, R.QUERY_CONSUMER_OFFSET,
                        {"consumerGroup": "CG_old", "topic": "Old0", "queueId": "0"})
    assert offset.code == C.SUCCESS and offset.ext_fields["offset"] == "0"
    assert broker.log().count("written before topics' creators were recorded: its 3 topics") == 1


def _heartbeat(*groups: str) -> bytes:
    return json.dumps({"clientID": "hostile", "producerDataSet": [], "consumerDataSet": [
        {"groupName": g, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
         "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET",
         "subscriptionDataSet": [{"topic": "T", "subString": "*", "subVersion": 1}]} for g in groups]}).encode()


@bounded(60)
async def test_a_slave_counts_and_refuses_nothing_per_address(broker_factory):
    """A slave's topics follow its master's: it keeps no per-address count, so none refuses there -- the
    retry topics of one address's groups are all made -- and it saves no maker for a later start to count."""
    master = broker_factory("--broker-role", "ASYNC_MASTER", "--ha-port", "0", store="master")
    slave = broker_factory("--broker-role", "SLAVE", "--broker-id", "1", "--ha-master-addr", master.ha,
                           "--max-topics-per-host", "1", store="slave")
    reply = await _one(slave.broker, HOSTILE, R.HEART_BEAT, {}, _heartbeat("G1", "G2", "G3"))
    assert reply.code == C.SUCCESS
    table = json.loads((await _one(slave.broker, HOSTILE, R.GET_ALL_TOPIC_CONFIG, {})).body_bytes())
    assert {"%RETRY%G1", "%RETRY%G2", "%RETRY%G3"} <= set(table["topicConfigTable"])
    assert "max_topics_per_host" not in slave.log()
    assert slave.stop() == 0
    saved = json.loads((slave.store_dir / "config" / "topics.json").read_text())
    assert not [t for t in saved["topics"] if "creator" in t]
