"""Exported numbers compared with what the broker really holds: a metric an operator trusts must not drift
from the state it describes."""
from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumer import PullConsumer
from producer import LocalTransactionState, Producer, TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


class Commit:
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    async def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT_MESSAGE


def _scrape(broker) -> dict:
    text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def _commit(broker, group: str, topic: str, bodies: list[bytes]) -> None:
    async with TransactionProducer(broker.namesrv, group, Commit()) as producer:
        for body in bodies:
            await producer.send_in_transaction(topic, body)


async def test_committed_transactional_messages_count_their_body_bytes(broker_factory):
    """rocketmq_throughput_in counts the body bytes stored on a topic; a committed transaction's message was
    counted with 0 bytes, so a topic fed by transactions showed messages coming in and no bytes at all."""
    broker = broker_factory()
    await _commit(broker, "PG_bytes", "TxBytes", [b"x" * 100, b"y" * 23])
    m = await asyncio.to_thread(_scrape, broker)
    assert m[("rocketmq_messages_in_total", (("topic", "TxBytes"),))] == 2
    assert m[("rocketmq_throughput_in_total", (("topic", "TxBytes"),))] == 123


async def _delete_topic(broker, topic: str) -> None:
    host, _, port = broker.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": topic}), 5.0)
    finally:
        conn.close()
    assert resp.code == ResponseCode.SUCCESS, resp.remark


def _topic_series(m: dict, topic: str) -> dict:
    return {k: v for k, v in m.items() if ("topic", topic) in k[1]}


@bounded(60)
async def test_a_deleted_topic_leaves_the_scrape_and_a_new_one_of_its_name_counts_from_zero(broker_factory):
    """The series of a deleted topic (messages and bytes in, and out per consumer group) stayed in every scrape
    for as long as the broker ran: a broker whose topics come and go (one per tenant, per test run) grew its
    scrape and its memory by every topic it ever had, and a topic made again under the name went on from the
    old counts."""
    broker = broker_factory()
    async with Producer(broker.namesrv, "PG_gone") as producer:
        for i in range(3):
            await producer.send("Gone", b"g%d" % i)
        await producer.send("Kept", b"k")
    async with PullConsumer(broker.namesrv, "CG_gone") as consumer:
        for topic in ("Gone", "Kept"):
            for mq in await consumer.fetch_queues(topic):
                await consumer.pull(mq, 0)
    m = await asyncio.to_thread(_scrape, broker)
    assert m[("rocketmq_messages_in_total", (("topic", "Gone"),))] == 3
    assert m[("rocketmq_messages_out_total", (("consumer_group", "CG_gone"), ("topic", "Gone")))] == 3
    kept = _topic_series(m, "Kept")
    assert len(kept) == 4

    await _delete_topic(broker, "Gone")
    m = await asyncio.to_thread(_scrape, broker)
    assert _topic_series(m, "Gone") == {}
    assert _topic_series(m, "Kept") == kept

    async with Producer(broker.namesrv, "PG_gone") as producer:
        await producer.send("Gone", b"again")
    m = await asyncio.to_thread(_scrape, broker)
    assert m[("rocketmq_messages_in_total", (("topic", "Gone"),))] == 1


async def test_every_exported_family_has_a_row_in_the_readme_metrics_table(broker_factory):
    """An operator reads what a metric means in README's table: ten families were exported with no row there
    (a live scrape's TYPE lines against the table), so an alert on them had nothing to say what they count."""
    broker = broker_factory()
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5).read().decode())
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = "\n".join(line for line in readme.splitlines() if line.startswith("| `"))
    assert len(families) > 40
    assert sorted(f for f in families if f"`{f}`" not in rows) == []


def _group_series(m: dict, group: str) -> dict:
    return {k: v for k, v in m.items() if ("consumer_group", group) in k[1]}


async def _delete_group(broker, group: str, remove_offset: bool) -> None:
    host, _, port = broker.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(RequestCode.DELETE_SUBSCRIPTIONGROUP, {
            "groupName": group, "removeOffset": str(remove_offset).lower()}), 5.0)
    finally:
        conn.close()
    assert resp.code == ResponseCode.SUCCESS, resp.remark


@bounded(60)
@pytest.mark.parametrize("remove_offset", [False, True], ids=["offsets-kept", "offsets-removed"])
async def test_a_deleted_group_leaves_every_family_of_the_scrape_until_it_comes_back(broker_factory, remove_offset):
    """DELETE_SUBSCRIPTIONGROUP without removeOffset (mqadmin deleteSubGroup without -r; RocketMQ keeps the offsets
    then) dropped the group's delivery series but left rocketmq_consumer_lag_messages, computed from the offsets
    kept: the deleted group's lag stayed in every scrape for as long as the broker ran, growing with each send, and
    a lag alert on it fired for good for a group the operator had deleted. Gone from the next scrape now, in every
    family; back (from its kept offset) once a consumer of the group comes again."""
    broker = broker_factory()
    async with Producer(broker.namesrv, "PG_lag_gone") as producer:
        for i in range(4):
            await producer.send("LagGone", b"m%d" % i)
    async with PullConsumer(broker.namesrv, "CG_lag_gone") as consumer:
        mqs = [mq for mq in await consumer.fetch_queues("LagGone")]
        read = 0
        for mq in mqs:
            result = await consumer.pull(mq, 0)
            found = len(result.messages or [])
            if found and not read:      # one queue read and committed; the rest committed at 0: lag 4 - found
                await consumer.commit_offset(mq, result.next_begin_offset)
                read = found
            else:
                await consumer.commit_offset(mq, 0)
    m = await asyncio.to_thread(_scrape, broker)
    lag = ("rocketmq_consumer_lag_messages", (("consumer_group", "CG_lag_gone"), ("topic", "LagGone")))
    assert m[lag] == 4 - read
    assert m[("rocketmq_messages_out_total", (("consumer_group", "CG_lag_gone"), ("topic", "LagGone")))] == 4
    await _delete_group(broker, "CG_lag_gone", remove_offset)
    m = await asyncio.to_thread(_scrape, broker)
    assert _group_series(m, "CG_lag_gone") == {}
    async with Producer(broker.namesrv, "PG_lag_gone") as producer:     # still gone after more sends
        await producer.send("LagGone", b"after")
    m = await asyncio.to_thread(_scrape, broker)
    assert _group_series(m, "CG_lag_gone") == {}

    async with PullConsumer(broker.namesrv, "CG_lag_gone") as consumer:     # the group comes again
        await consumer.subscribe("LagGone")
        m = await asyncio.to_thread(_scrape, broker)
        if remove_offset:
            assert lag not in m
        else:
            assert m[lag] == 5 - read
    m = await asyncio.to_thread(_scrape, broker)            # its consumer gone again: its lag stays
    assert (lag in m) is not remove_offset


async def _three_sent_none_read(broker, topic: str, group: str) -> list:
    """Three messages sent to ``topic``, ``group`` committed at 0 on each of its queues (a lag of 3); the queues."""
    async with Producer(broker.namesrv, "PG_" + group) as producer:
        for i in range(3):
            await producer.send(topic, b"m%d" % i)
    async with PullConsumer(broker.namesrv, group) as consumer:
        mqs = await consumer.fetch_queues(topic)
        for mq in mqs:
            await consumer.commit_offset(mq, 0)
    return mqs


@bounded(60)
async def test_a_deleted_group_committing_again_without_a_heartbeat_has_its_lag_back(broker_factory):
    """A group deleted with its offsets kept stayed out of the lag until a consumer of it connected or
    updateSubGroup made it again: one whose client only commits (UPDATE_CONSUMER_OFFSET, no heartbeat, as before
    the delete, when its lag was exported) had its lag hidden for as long as the broker ran, growing unseen. A
    commit of the group is it in use again: its lag is back from the next scrape."""
    broker = broker_factory()
    mqs = await _three_sent_none_read(broker, "LagBack", "CG_lag_back")
    lag = ("rocketmq_consumer_lag_messages", (("consumer_group", "CG_lag_back"), ("topic", "LagBack")))
    assert (await asyncio.to_thread(_scrape, broker))[lag] == 3
    await _delete_group(broker, "CG_lag_back", False)
    assert lag not in await asyncio.to_thread(_scrape, broker)
    async with PullConsumer(broker.namesrv, "CG_lag_back") as consumer:     # commits again, no heartbeat
        for mq in mqs:
            await consumer.commit_offset(mq, 0)
    async with Producer(broker.namesrv, "PG_CG_lag_back") as producer:
        await producer.send("LagBack", b"after")
    assert (await asyncio.to_thread(_scrape, broker))[lag] == 4


@bounded(90)
async def test_a_group_deleted_with_its_offsets_kept_stays_out_of_the_lag_after_a_kill(broker_factory):
    """A group deleted without removeOffset (mqadmin deleteSubGroup without -r) left the lag only until the broker
    restarted: the deletes were kept in memory alone, so a restart (a kill -9 too) brought every such group's lag
    series back from its kept offsets, growing with each send, and a lag alert fired again for groups the
    operator had deleted. The delete is saved with the offsets before it is answered: still out after a kill -9,
    its offsets still there (its lag back, from them, once a consumer of it comes again)."""
    broker = broker_factory()
    mqs = await _three_sent_none_read(broker, "LagKill", "CG_lag_kill")
    async with PullConsumer(broker.namesrv, "CG_lag_saver") as consumer:
        await consumer.commit_offset(mqs[0], 0)
    lag = ("rocketmq_consumer_lag_messages", (("consumer_group", "CG_lag_kill"), ("topic", "LagKill")))
    assert (await asyncio.to_thread(_scrape, broker))[lag] == 3
    # another group's offsets removed: answered once the table, CG_lag_kill's offsets in it, is on disk
    await _delete_group(broker, "CG_lag_saver", True)
    await _delete_group(broker, "CG_lag_kill", False)
    assert lag not in await asyncio.to_thread(_scrape, broker)
    broker.kill()

    broker = broker_factory()       # the same store
    async with Producer(broker.namesrv, "PG_CG_lag_kill") as producer:
        await producer.send("LagKill", b"after")
    m = await asyncio.to_thread(_scrape, broker)
    assert _group_series(m, "CG_lag_kill") == {}
    async with PullConsumer(broker.namesrv, "CG_lag_kill") as consumer:     # the group comes again
        await consumer.subscribe("LagKill")
        assert (await asyncio.to_thread(_scrape, broker))[lag] == 4
