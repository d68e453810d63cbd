"""A large HEART_BEAT is registered a slice of groups at a time (processors/client.py): all of it when its
connection stays, none of it after its connection closed meanwhile (its groups were left at the close), and the
per-address turn it took is given back either way (tests/integration/test_hostile_storms.py end to end)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from broker.clients import ClientRegistry
from broker.processors.client import heart_beat
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from tests.unit.test_client_caps import _Conn


def _large(n: int = 2000) -> RemotingCommand:
    body = {"clientID": "c", "consumerDataSet": [
        {"groupName": f"G{i}", "subscriptionDataSet": [{"topic": "T", "subString": "*"}]} for i in range(n)]}
    return RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode())


def _ctx():
    return SimpleNamespace(clients=ClientRegistry(lambda: 0), subscriptions=None, tx=None, heartbeat_turns={})


def _groups_of(clients, conn) -> int:
    return sum(conn in g.channels for g in clients.consumers.values())


def test_a_large_heartbeat_registers_every_group_between_turns():
    async def run():
        ctx, conn = _ctx(), _Conn()
        task = asyncio.ensure_future(heart_beat(ctx, conn, _large()))
        await asyncio.sleep(0)
        turns = 1
        while not task.done():                  # other work gets in between its slices
            await asyncio.sleep(0)
            turns += 1
        assert task.result().code == ResponseCode.SUCCESS
        assert turns > 4 and _groups_of(ctx.clients, conn) == 2000 and ctx.heartbeat_turns == {}
    asyncio.run(run())


def test_a_connection_closed_during_its_heartbeat_registers_nothing_after():
    async def run():
        ctx, conn = _ctx(), _Conn()
        task = asyncio.ensure_future(heart_beat(ctx, conn, _large()))
        for _ in range(3):
            await asyncio.sleep(0)
        conn.is_open = False                        # closed mid-way: the server leaves its groups at once
        ctx.clients.connection_closed(conn)
        assert await task is None
        assert _groups_of(ctx.clients, conn) == 0 and ctx.heartbeat_turns == {}
    asyncio.run(run())
