"""Request codes mqadmin 4.9.8 sends that txmq answered REQUEST_CODE_NOT_SUPPORTED: each is sent here as the
stock tool frames it, to the real broker or name server over TCP, and the answer read as the Java tool reads
it (docs/compatibility.md has the whole table)."""
from __future__ import annotations

import json

import pytest

from protocol.codes import LanguageCode, ResponseCode
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand
from protocol.connection import open_connection
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
