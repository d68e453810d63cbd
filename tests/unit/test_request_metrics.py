"""rocketmq_rpc_latency (and the snapshots' request counts) count every request handled, with the code it
was answered with: a handler that raised was answered by the connection's error reply and not counted at all
when it raised at once, and counted as SYSTEM_ERROR whatever it was answered with when it raised later; a
later handler that answered nothing (a oneway request) was counted as SYSTEM_ERROR."""
from __future__ import annotations

import types

import pytest

from broker.config import BrokerConfig
from broker.server import BrokerServer
from protocol.codes import RequestCode, ResponseCode, request_name
from protocol.command import RemotingCommand
from protocol.errors import HeaderError, RecordError
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


def _raise_header(ctx, conn, cmd):
    raise HeaderError("the header lacks a field")


def _raise_record(ctx, conn, cmd):
    raise RecordError("a damaged record")


def _raise_bug(ctx, conn, cmd):
    raise KeyError("a bug")


async def _later_illegal(ctx, conn, cmd):
    raise RecordError("a damaged record, found later")


async def _later_nothing(ctx, conn, cmd):
    return None         # a oneway request: nothing goes back


@bounded(10)
async def test_requests_are_counted_with_the_code_they_were_answered_with(tmp_path):
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    server.ctx = types.SimpleNamespace(acl=None)
    R = RequestCode
    handle = server._handler({R.GET_CONSUME_STATS: _raise_header, R.SEND_MESSAGE: _raise_record,
                              R.PULL_MESSAGE: _raise_bug, R.QUERY_MESSAGE: _later_illegal,
                              R.END_TRANSACTION: _later_nothing})
    for code in (R.GET_CONSUME_STATS, R.SEND_MESSAGE, R.PULL_MESSAGE):
        with pytest.raises(Exception):          # the connection answers it (RemotingConnection._reply_error)
            handle(None, RemotingCommand.request(code))
    with pytest.raises(RecordError):
        await handle(None, RemotingCommand.request(R.QUERY_MESSAGE))
    assert await handle(None, RemotingCommand.request(R.END_TRANSACTION, oneway=True)) is None

    def counted(code, response_code):
        return server.metrics.registry.get_sample_value(
            "rocketmq_rpc_latency_count", {"request_code": request_name(code), "response_code": str(response_code)})
    assert counted(R.GET_CONSUME_STATS, ResponseCode.SYSTEM_ERROR) == 1
    assert counted(R.SEND_MESSAGE, ResponseCode.MESSAGE_ILLEGAL) == 1
    assert counted(R.PULL_MESSAGE, ResponseCode.SYSTEM_ERROR) == 1
    assert counted(R.QUERY_MESSAGE, ResponseCode.MESSAGE_ILLEGAL) == 1
    assert counted(R.QUERY_MESSAGE, ResponseCode.SYSTEM_ERROR) is None
    assert counted(R.END_TRANSACTION, 0) == 1 and counted(R.END_TRANSACTION, ResponseCode.SYSTEM_ERROR) is None
    snapshot = server.metrics.snapshot(0, [])["requests"]
    assert {name: r["count"] for name, r in snapshot.items()} == {
        request_name(c): 1 for c in (R.GET_CONSUME_STATS, R.SEND_MESSAGE, R.PULL_MESSAGE, R.QUERY_MESSAGE,
                                     R.END_TRANSACTION)}


@bounded(10)
async def test_a_request_cancelled_with_its_connection_is_not_counted_as_an_error(tmp_path):
    """A long-polled pull is cancelled when its client hangs up: nothing is answered, and every consumer
    disconnecting with pulls parked was counted as a SYSTEM_ERROR response (found in review)."""
    import asyncio

    async def parked(ctx, conn, cmd):
        await asyncio.Event().wait()
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    server.ctx = types.SimpleNamespace(acl=None)
    task = server._handler({RequestCode.PULL_MESSAGE: parked})(None, RemotingCommand.request(RequestCode.PULL_MESSAGE))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert server.metrics.registry.get_sample_value("rocketmq_rpc_latency_count", {
        "request_code": request_name(RequestCode.PULL_MESSAGE), "response_code": str(ResponseCode.SYSTEM_ERROR)}) is None
