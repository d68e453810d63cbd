"""A large HEART_BEAT is registered a slice of groups at a time (processors/client.py): all of it when its
connection stays, none of it after its connection closed meanwhile (its groups were left at the close), and the
per-address turn it took is given back either way (tests/integration/test_hostile_storms.py end to end)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from broker.clients import ClientRegistry
from broker.config import BrokerConfig
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
    return SimpleNamespace(clients=ClientRegistry(lambda: 0), subscriptions=None, tx=None, heartbeat_turns={},
                           config=BrokerConfig())


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


def _small(group: str, version: int = 1, topic: str = "T") -> RemotingCommand:
    body = {"clientID": "c", "consumerDataSet": [
        {"groupName": group, "subscriptionDataSet": [{"topic": topic, "subString": "*", "subVersion": version}]}]}
    return RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode())


def _one_large_group(group: str = "G_big") -> RemotingCommand:
    """Over 64 KiB with a single group (a long tag expression): sliced, yet no slice boundary inside it."""
    tags = " || ".join(f"tag{i}" for i in range(9000))
    body = {"clientID": "c", "consumerDataSet": [
        {"groupName": group, "subscriptionDataSet": [{"topic": "T", "subString": tags}]}]}
    cmd = RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode())
    assert cmd.body_length() > 64 * 1024
    return cmd


def _unregister(group: str) -> RemotingCommand:
    return RemotingCommand.request(R.UNREGISTER_CLIENT, {"clientID": "c", "consumerGroup": group})


def test_a_connection_closed_while_its_heartbeat_waited_for_its_turn_registers_nothing():
    """The check for a closed connection came only after a slice: a large heartbeat with fewer groups than a slice
    (one long subscription), waiting behind another heartbeat from its address while its connection closed, was
    registered in full when its turn came -- on a connection whose groups had been left already."""
    async def run():
        ctx = _ctx()
        first, second = _Conn(), _Conn()            # one address
        ahead = asyncio.ensure_future(heart_beat(ctx, first, _large()))
        behind = asyncio.ensure_future(heart_beat(ctx, second, _one_large_group()))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not ahead.done() and not behind.done()
        second.is_open = False
        ctx.clients.connection_closed(second)
        await ahead
        assert await behind is None
        assert _groups_of(ctx.clients, second) == 0 and "G_big" not in ctx.clients.consumers
    asyncio.run(run())


def test_an_unregister_after_a_large_heartbeat_is_not_undone_by_it():
    """A large heartbeat ran as a task while the requests after it on its connection were handled at once: an
    UNREGISTER_CLIENT of one of its groups sent right after it was handled first (nothing to leave yet), and the
    heartbeat then joined the group -- a consumer that had left stayed listed (its queues assigned to it, unread)
    until channel_expire_ms."""
    async def run():
        from broker.processors.client import unregister_client
        ctx, conn = _ctx(), _Conn()
        beat = heart_beat(ctx, conn, _large())
        left = unregister_client(ctx, conn, _unregister("G7"))
        beat = await beat if not isinstance(beat, RemotingCommand) else beat
        left = await left if not isinstance(left, RemotingCommand) else left
        assert beat.code == ResponseCode.SUCCESS and left.code == ResponseCode.SUCCESS
        assert ctx.clients.consumer_ids("G7") == [] and ctx.clients.consumer_ids("G8") == ["c"]
    asyncio.run(run())


def test_a_heartbeat_after_a_large_one_on_its_connection_is_not_overwritten_by_it():
    """A small heartbeat right after a large one was registered before it; the large one (older) then set the
    group's subscriptions back to what it said."""
    async def run():
        ctx, conn = _ctx(), _Conn()
        body = {"clientID": "c", "consumerDataSet": [
            {"groupName": f"G{i}", "subscriptionDataSet": [{"topic": "OLD", "subString": "*", "subVersion": 1}]}
            for i in range(2000)]}
        older = heart_beat(ctx, conn, RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode()))
        newer = heart_beat(ctx, conn, _small("G3", version=1, topic="NEW"))
        for r in (older, newer):
            assert (await r if not isinstance(r, RemotingCommand) else r).code == ResponseCode.SUCCESS
        assert set(ctx.clients.consumers["G3"].subscriptions) == {"NEW"}
    asyncio.run(run())


def test_large_heartbeats_pipelined_on_a_connection_stop_its_reading_until_done():
    """Each large heartbeat waited for its address's turn holding its frame (up to 16 MiB), and a connection could
    have max_in_flight (256) of them waiting: gigabytes for one client. One queued behind another now stops the
    connection being read until they are done; a single one (a stock client's) leaves it read."""
    class _Paused(_Conn):
        def __init__(self):
            super().__init__()
            self.paused = set()

        def pause_reading(self, reason):
            self.paused.add(reason)

        def resume_reading(self, reason):
            self.paused.discard(reason)

    async def run():
        ctx, conn = _ctx(), _Paused()
        first = heart_beat(ctx, conn, _large())
        assert conn.paused == set()                 # alone: its sends and pulls are still read
        second = heart_beat(ctx, conn, _large())
        assert conn.paused                          # queued behind: nothing more is read meanwhile
        for r in (first, second):
            assert (await r).code == ResponseCode.SUCCESS
        await asyncio.sleep(0)
        assert conn.paused == set() and "registration_turn" not in conn.attributes
    asyncio.run(run())
