"""The VIP channel: RocketMQ brokers serve their port again on port - 2 (NettyServerConfig's fastListenPort), and
Java clients before 4.5.1 send there by default (ClientConfig.vipChannelEnabled "true" up to rocketmq-all-4.4.0,
"false" from 4.5.1; MixAll.brokerVIPChannel takes 2 off the routed port). txmq served only the port: such a
producer's every send was a refused connection."""
from __future__ import annotations

import socket

import pytest

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import ConnectionClosedError
from protocol.message import decode_records
from tests.support.bounded import bounded
from tests.support.prometheus import free_port

pytestmark = pytest.mark.asyncio


def _port_with_vip_free() -> int:
    """A free port P on 127.0.0.1 with P - 2 free as well."""
    for _ in range(50):
        port = free_port()
        if port <= 2:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port - 2))
            except OSError:
                continue
        return port
    pytest.fail("no free port P with P - 2 free in 50 tries")


async def _send(port: int, body: bytes):
    """A Java 4.4 producer's send, to the VIP channel its client derives from the routed port."""
    conn = await open_connection("127.0.0.1", port)
    try:
        return await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, {
            "a": "PG_vip", "b": "VipT", "c": "TBW102", "d": 1, "e": 0, "f": 0, "g": 0, "h": 0,
            "i": "WAIT\x01true\x02", "j": 0}, body), 5)
    finally:
        conn.close()


@bounded(60)
async def test_a_send_on_the_vip_channel_port_minus_2_is_stored_and_pulled_on_the_port(broker_factory):
    port = _port_with_vip_free()
    broker = broker_factory("--port", str(port))
    assert broker.broker_port == port
    reply = await _send(port - 2, b"via vip")
    assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
    conn = await open_connection("127.0.0.1", port)
    try:
        pulled = await conn.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "CG_vip", "topic": "VipT", "queueId": 0, "queueOffset": 0, "maxMsgNums": 32,
            "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": "*", "subVersion": 0}), 5)
        assert pulled.code == ResponseCode.SUCCESS, (pulled.code, pulled.remark)
        assert [m.body for m in decode_records(pulled.body_bytes())] == [b"via vip"]
    finally:
        conn.close()


@bounded(60)
async def test_a_taken_vip_port_is_said_and_the_broker_serves_its_port(broker_factory):
    port = _port_with_vip_free()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port - 2))
        taken.listen()
        broker = broker_factory("--port", str(port))
        assert (await _send(port, b"main")).code == ResponseCode.SUCCESS
        assert f"no VIP channel on port {port - 2}" in broker.log()


@bounded(60)
async def test_the_vip_channel_can_be_turned_off(broker_factory):
    port = _port_with_vip_free()
    broker_factory("--port", str(port), "--vip-channel", "false")
    assert (await _send(port, b"main")).code == ResponseCode.SUCCESS
    with pytest.raises(ConnectionClosedError, match="cannot connect"):
        await _send(port - 2, b"no vip")


@bounded(60)
async def test_a_masters_ha_port_at_port_minus_2_is_not_taken_by_the_vip_channel(broker_factory):
    """The VIP listener bound port - 2 before the master's HA listener bound --ha-port: a master given its port - 2
    as HA port (which started before the VIP channel) failed to start, "address already in use". The VIP channel
    yields a port the broker's own configuration gives another listener, said at WARNING."""
    port = _port_with_vip_free()
    master = broker_factory("--port", str(port), "--broker-role", "ASYNC_MASTER", "--ha-port", str(port - 2))
    assert master.ha.endswith(f":{port - 2}"), master.ha
    assert (await _send(port, b"main")).code == ResponseCode.SUCCESS
    assert f"no VIP channel on port {port - 2}" in master.log()


@bounded(90)
async def test_a_broker_restarted_on_its_port_serves_the_vip_channel_again(broker_factory):
    """Stopped (SIGTERM) or killed (SIGKILL), a broker leaves port - 2 free with its port: restarted there (as the
    fault tests restart brokers) it serves the VIP channel again, no warning, with a connection still open on it at
    the stop."""
    port = _port_with_vip_free()
    for end in ("stop", "kill"):
        broker = broker_factory("--port", str(port), store=end)
        held = await open_connection("127.0.0.1", port - 2)
        try:
            getattr(broker, end)()
            again = broker_factory("--port", str(port), store=end)
            assert "no VIP channel" not in again.log()
            assert (await _send(port - 2, end.encode())).code == ResponseCode.SUCCESS
            again.stop()
        finally:
            held.close()
