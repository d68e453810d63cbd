"""Broker codes of mqadmin 4.9.8 that txmq answered incompletely or REQUEST_CODE_NOT_SUPPORTED, each sent as the
stock tool frames it over TCP to the real broker, the answer read as the Java tool reads it
(docs/compatibility.md)."""
from __future__ import annotations

import json

import pytest

from protocol.codes import ResponseCode
from protocol.codes import RequestCode as R
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
