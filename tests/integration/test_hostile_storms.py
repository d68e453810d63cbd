"""One member of a consumer group that changes what it says at every heartbeat: the group's other consumers
must not pay for each change (every NOTIFY_CONSUMER_IDS_CHANGED starts a rebalance in each of them)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.clients import NOTICE_GAP_S
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


def _heartbeat(client_id: str, topic: str, version: int) -> RemotingCommand:
    return RemotingCommand.request(RequestCode.HEART_BEAT, body=json.dumps({
        "clientID": client_id, "producerDataSet": [], "consumerDataSet": [
            {"groupName": "CG_storm", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
             "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET",
             "subscriptionDataSet": [{"topic": topic, "subString": "*", "subVersion": version}]}]}).encode())


def _merged(broker) -> float:
    text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "txmq_consumer_notices_merged_total")


@bounded(60)
async def test_a_member_flipping_its_subscription_does_not_storm_the_group(broker):
    """Each heartbeat that changed a group's subscriptions sent NOTIFY_CONSUMER_IDS_CHANGED to every consumer of
    the group: one member pipelining heartbeats that flip its topic sent each of 100 consumers 5,000 notices in
    4.5 s (500,000, 160 ms of loop lag for every other client), and each notice makes a stock consumer rebalance.
    Now a group is told at most once per NOTICE_GAP_S (a change in a gap: once at its end), each change merged
    so counted in txmq_consumer_notices_merged_total."""
    host, _, port = broker.broker.rpartition(":")
    beats, members = 2000, 3
    notices = [0] * members
    told = [asyncio.Event() for _ in range(members)]

    def member_handler(i):
        def handle(conn, cmd):
            if cmd.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
                notices[i] += 1
                told[i].set()
        return handle
    conns = [await open_connection(host, int(port), member_handler(i)) for i in range(members)]
    hostile = await open_connection(host, int(port), max_in_flight=1 << 16)
    try:
        for i, conn in enumerate(conns):
            assert (await conn.request(_heartbeat(f"member{i}", "T", 1), 10)).code == ResponseCode.SUCCESS
        merged_before = _merged(broker)
        room = asyncio.Semaphore(256)

        async def beat(k: int) -> int:
            async with room:
                return (await hostile.request(_heartbeat("hostile", "U" if k % 2 else "T", k), 30)).code
        loop = asyncio.get_running_loop()
        started = loop.time()
        codes = await asyncio.gather(*(beat(k) for k in range(beats)))
        elapsed = loop.time() - started
        assert set(codes) == {ResponseCode.SUCCESS}
        for event in told:
            event.clear()
        # one change more: told to every member at once, or at the end of the gap it falls in -- never lost
        assert (await hostile.request(_heartbeat("hostile", "T", beats), 10)).code == ResponseCode.SUCCESS
        for event in told:
            await event.wait()
    finally:
        hostile.close()
        for conn in conns:
            conn.close()
    # one notice when a gap opens and one at its end, for the gaps the flood spanned (and the one its start
    # fell in): whatever the machine's speed, not one a heartbeat
    bound = 2 * (elapsed / NOTICE_GAP_S + 2)
    assert all(1 <= n <= bound for n in notices), (notices, bound)
    assert _merged(broker) - merged_before >= beats - max(notices)


def _many_groups(n: int) -> RemotingCommand:
    return RemotingCommand.request(RequestCode.HEART_BEAT, body=json.dumps({
        "clientID": "many", "producerDataSet": [], "consumerDataSet": [
            {"groupName": f"CG_many{i}", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
             "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET",
             "subscriptionDataSet": [{"topic": "T", "subString": "*", "subVersion": 1}]} for i in range(n)]}).encode())


@bounded(90)
async def test_heartbeats_naming_thousands_of_groups_let_other_clients_in(broker):
    """A heartbeat naming 9,000 groups (2 MB; under max_groups_per_host) was registered in one go, 0.3 s of the
    loop, and a client sending them back to back held every other client's requests up to 1.2 s (several such
    heartbeats handled in one turn). It is registered a slice of groups at a time now, other clients served
    between slices, and still all of it."""
    host, _, port = broker.broker.rpartition(":")
    beats, groups = 8, 9000
    hostile = await open_connection(host, int(port), max_in_flight=1 << 16)
    probe = await open_connection(host, int(port))
    try:
        flood = asyncio.gather(*(hostile.request(_many_groups(groups), 60) for _ in range(beats)))
        rounds = 0
        while not flood.done():     # round trips of another client while the flood is handled
            reply = await probe.request(RemotingCommand.request(RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                                                                {"consumerGroup": "CG_many0"}), 30)
            rounds += 1
        assert {r.code for r in await flood} == {ResponseCode.SUCCESS}
        listed = await probe.request(RemotingCommand.request(RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                                                             {"consumerGroup": f"CG_many{groups - 1}"}), 10)
    finally:
        hostile.close()
        probe.close()
    assert reply.code in (ResponseCode.SUCCESS, ResponseCode.SYSTEM_ERROR)
    assert json.loads(listed.body_bytes()) == {"consumerIdList": ["many"]}
    # Other clients are served between the slices (test_heartbeat_slices shows the turns; bench_loop_stalls-style
    # figures are for bench/): here, that a sliced flood still registers every group and the probe is answered
    # throughout. A bound on the probe's worst wait would be a clock; a count of its round trips does not tell
    # slices from reads (112 without slices, 276 with, as the 16 MB arrive in many reads).
    assert rounds >= 1


@bounded(60)
async def test_an_unregister_pipelined_after_a_large_heartbeat_leaves_the_group(broker):
    """A heartbeat over 64 KiB is handled as a task; the UNREGISTER_CLIENT sent right after it on the same
    connection was handled first (nothing to leave yet) and the heartbeat then joined the group: the client that
    left stayed listed, given queues it never reads, until channel_expire_ms."""
    host, _, port = broker.broker.rpartition(":")
    client = await open_connection(host, int(port))
    probe = await open_connection(host, int(port))
    try:
        beat = asyncio.ensure_future(client.request(_many_groups(600), 30))
        left = asyncio.ensure_future(client.request(RemotingCommand.request(
            RequestCode.UNREGISTER_CLIENT, {"clientID": "many", "consumerGroup": "CG_many7"}), 30))
        assert (await beat).code == ResponseCode.SUCCESS and (await left).code == ResponseCode.SUCCESS
        gone, kept = [await probe.request(RemotingCommand.request(
            RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": g}), 10) for g in ("CG_many7", "CG_many8")]
    finally:
        client.close()
        probe.close()
    assert json.loads(kept.body_bytes()) == {"consumerIdList": ["many"]}
    assert gone.code == ResponseCode.SYSTEM_ERROR, gone.body_bytes()
