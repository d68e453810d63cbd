"""The whole-table admin codes at a large history, on the master's loop: GET_ALL_TOPIC_CONFIG (21) and
GET_ALL_SUBSCRIPTIONGROUP_CONFIG (201), asked by every slave at each sync, are encoded a slice at a time (another
client gets turns of the loop between two), the body byte for byte what the whole table's encoding was; 201 and
INVOKE_BROKER_TO_RESET_OFFSET (222) find a group's offsets by the offsets' per-group index, never a walk of every
offset. Loop time is measured in bench/bench_admin_tables.py; here the turns another client was given are counted.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import types

import pytest

from broker.processors import admin as admin_proc
from broker.processors import ops
from broker.store.offsets import ConsumerOffsets
from broker.subscriptions import GROUP_SLICE, SubscriptionGroups
from broker.topics import TopicConfig
from protocol.codes import Perm, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from tests.support.bounded import bounded, other_client
from tests.support.loop_turns import turns_before_hand_off


def _offsets(tmp_path, groups: int) -> ConsumerOffsets:
    """A table of ``groups`` groups' offsets, each on 2 topics x 3 queues, that no code may walk whole."""
    offsets = ConsumerOffsets(str(tmp_path))
    for g in range(groups):
        for t in range(2):
            for q in range(3):
                offsets.commit(f"CG{g}", f"T{g + t}", q, q)

    def walked():
        raise AssertionError("every offset walked")
    offsets.items = walked
    return offsets


@bounded(60)
async def test_all_topic_configs_are_encoded_with_the_loop_running_between_slices():
    """In one go, 50,000 topics held the master's loop 117-280 ms at each slave's sync."""
    n = 3 * admin_proc.TOPIC_SLICE + 5
    topics = {f"T{i}": TopicConfig(f"T{i}", 8, 4 + i % 3, Perm.READ_WRITE if i % 2 else Perm.READ, order=i % 5 == 0)
              for i in range(n)}
    topics["odd \"name\" é"] = TopicConfig("odd \"name\" é")
    version = types.SimpleNamespace(counter=7, timestamp=1_700_000_000_000)
    ctx = types.SimpleNamespace(topics=types.SimpleNamespace(topics=topics, data_version=version))
    async with other_client() as turns:
        reply = await admin_proc.get_all_topic_config(ctx, None,
                                                      RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG))
    whole = {"dataVersion": {"counter": 7, "timestamp": 1_700_000_000_000}, "topicConfigTable": {
        name: {"topicName": tc.name, "readQueueNums": tc.read_queue_nums, "writeQueueNums": tc.write_queue_nums,
               "perm": tc.perm, "topicFilterType": tc.filter_type, "topicSysFlag": tc.sys_flag, "order": tc.order}
        for name, tc in topics.items()}}
    assert (reply.code, reply.body_bytes()) == (ResponseCode.SUCCESS, json.dumps(whole).encode())
    assert turns[0] >= 3, turns[0]      # the loop ran between every two slices


@bounded(60)
async def test_a_topic_deleted_while_the_table_is_encoded_is_left_out():
    topics = {f"T{i}": TopicConfig(f"T{i}") for i in range(2 * admin_proc.TOPIC_SLICE + 1)}
    ctx = types.SimpleNamespace(topics=types.SimpleNamespace(
        topics=topics, data_version=types.SimpleNamespace(counter=1, timestamp=2)))
    answer = admin_proc.get_all_topic_config(ctx, None, RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG))
    answer.send(None)       # the first slice encoded, then the loop's turn: a deletion
    del topics[f"T{2 * admin_proc.TOPIC_SLICE}"]
    with pytest.raises(StopIteration) as done:
        while True:
            answer.send(None)
    table = json.loads(done.value.value.body_bytes())["topicConfigTable"]
    assert sorted(table) == sorted(topics)


@bounded(60)
async def test_all_subscription_groups_are_read_off_the_index_and_encoded_between_turns(tmp_path):
    """The groups holding offsets were found by a walk of every offset and the table encoded in one go: 90-150 ms
    of the master's loop at 100,000 offsets of 10,000 groups, at each slave's sync."""
    offsets = _offsets(tmp_path / "o", 3 * GROUP_SLICE)
    subs = SubscriptionGroups(str(tmp_path), lambda: 5)
    subs.update({"groupName": "CG3", "retryMaxTimes": 2})
    subs.update({"groupName": "Configured", "consumeEnable": False})
    ctx = types.SimpleNamespace(offsets=offsets, subscriptions=subs,
                                clients=types.SimpleNamespace(consumers={"LiveOnly": object(), "CG1": object()}))
    async with other_client() as turns:
        reply = await ops.get_all_subscription_group(
            ctx, None, RemotingCommand.request(RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG))
    known = sorted({"LiveOnly"} | {f"CG{g}" for g in range(3 * GROUP_SLICE)})
    assert (reply.code, reply.body_bytes()) == (ResponseCode.SUCCESS, subs.encode(known))
    table = json.loads(reply.body_bytes())["subscriptionGroupTable"]
    assert table["CG3"]["retryMaxTimes"] == 2 and table["Configured"]["consumeEnable"] is False
    assert turns[0] >= 3, turns[0]


def test_a_reset_of_a_group_with_no_offset_on_the_topic_is_refused_off_the_index(tmp_path):
    """The check walked every offset (27-33 ms at 100,000) at each reset an admin asked for."""
    offsets = _offsets(tmp_path, 100)
    ctx = types.SimpleNamespace(offsets=offsets, topics=types.SimpleNamespace(get=lambda t: TopicConfig(t)))
    reply = _run(ops.reset_offset(ctx, None, RemotingCommand.request(RequestCode.INVOKE_BROKER_TO_RESET_OFFSET, {
        "topic": "T50", "group": "CG1", "timestamp": -1})))
    assert (reply.code, reply.remark) == (ResponseCode.SYSTEM_ERROR, "THe consumer group <CG1> not exist")


def test_holds_is_whether_a_group_has_an_offset_on_a_topic(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("G", "T", 0, 5)
    offsets.commit("G", "T", 1, 5)
    offsets.commit("G", "U", 0, 5)
    assert offsets.holds("G", "T") and offsets.holds("G", "U") and not offsets.holds("G", "V")
    assert not offsets.holds("H", "T") and sorted(offsets.groups()) == ["G"]
    offsets.remove_topic("T")
    assert not offsets.holds("G", "T") and offsets.holds("G", "U")
    offsets.remove_group("G")
    assert not offsets.holds("G", "U") and list(offsets.groups()) == []


def _run(coro):
    """The answer of a handler's coroutine that does not wait."""
    with pytest.raises(StopIteration) as done:
        coro.send(None)
    return done.value.value


def test_a_change_while_a_table_is_encoded_leaves_the_version_of_its_start(tmp_path):
    """A slave takes a table's dataVersion and skips the tables of that version after: the version of the end of
    an encoding that missed a change made meanwhile (a topic created past its slices) would name a table the
    slave never reads again. The version of its start makes the slave read it again at the next sync."""
    topics = {f"T{i}": TopicConfig(f"T{i}") for i in range(2 * admin_proc.TOPIC_SLICE + 1)}
    version = types.SimpleNamespace(counter=1, timestamp=2)
    ctx = types.SimpleNamespace(topics=types.SimpleNamespace(topics=topics, data_version=version))
    answer = admin_proc.get_all_topic_config(ctx, None, RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG))
    answer.send(None)       # the first slice encoded, then the loop's turn: a topic made
    topics["New"] = TopicConfig("New")
    version.counter, version.timestamp = 2, 3
    body = json.loads(_finish(answer).body_bytes())
    assert body["dataVersion"] == {"counter": 1, "timestamp": 2} and "New" not in body["topicConfigTable"]

    subs = SubscriptionGroups(str(tmp_path), lambda: 5)
    before = (subs.counter, subs.timestamp)
    answer = subs.encode_in_slices([f"CG{g}" for g in range(2 * GROUP_SLICE + 1)])
    answer.send(None)
    subs.update({"groupName": "CG0", "retryMaxTimes": 2})
    assert (subs.counter, subs.timestamp) != before
    body = json.loads(b"".join(_finish(answer)))
    assert (body["dataVersion"]["counter"], body["dataVersion"]["timestamp"]) == before


def _finish(coro):
    """What a handler's coroutine returns, run on from where it was left (no loop: each await is a bare yield)."""
    with pytest.raises(StopIteration) as done:
        while True:
            coro.send(None)
    return done.value.value


@bounded(30)
async def test_an_unchanged_group_table_is_not_encoded_again_and_any_change_is(tmp_path, monkeypatch):
    """GET_ALL_SUBSCRIPTIONGROUP_CONFIG: a slave asks every 10 s, and the master encoded the same table each time
    (200-250 ms of CPU at 50,000 groups). The last whole answer is given again while neither the table's version
    nor the known groups changed; any change, or one while it was written, gives a fresh one."""
    from broker import subscriptions
    subs = SubscriptionGroups(str(tmp_path), lambda: 5)
    encoded = []
    real = subscriptions.group_config
    monkeypatch.setattr(subscriptions, "group_config",
                        lambda name, values=None: encoded.append(name) or real(name, values))
    known = {f"CG{g}" for g in range(2 * GROUP_SLICE + 1)}
    first = await subs.encode_in_slices(known)
    asked = len(encoded)
    assert await subs.encode_in_slices(set(known)) is first and len(encoded) == asked
    for change in (lambda: subs.update({"groupName": "CG1", "retryMaxTimes": 2}), lambda: known.add("CGnew"),
                   lambda: subs.delete("CG1"), lambda: known.discard("CG7")):
        change()
        assert b"".join(await subs.encode_in_slices(known)) == subs.encode(known)
    answer = asyncio.ensure_future(subs.encode_in_slices(known))
    await asyncio.sleep(0)
    await asyncio.sleep(0)                  # (its first slice written)
    subs.update({"groupName": "CG2", "retryMaxTimes": 3})
    assert b"".join(await answer) != subs.encode(known)
    assert b"".join(await subs.encode_in_slices(known)) == subs.encode(known)


async def test_a_groups_save_is_encoded_a_slice_at_a_time_as_the_table_was_when_it_began(tmp_path, monkeypatch):
    # Encoded whole on the loop at each UPDATE_AND_CREATE_SUBSCRIPTIONGROUP's save, 50,000 groups held it 0.8-1.6 s
    # a save on a loaded host (bench/bench_config_holds.py), and anyone may send the update back to back. The same
    # bytes now, GROUP_SLICE groups a turn, of the table as it was when the save began.
    groups = SubscriptionGroups(str(tmp_path), lambda: 1000)
    for i in range(6 * GROUP_SLICE + 3):
        groups.update({"groupName": f"G{i * 7919 % 5000}", "retryMaxTimes": i % 16})
    whole, counter = groups.encode(), groups.counter
    data, at, turns = await turns_before_hand_off(
        monkeypatch, groups.save, lambda: groups.update({"groupName": "G-late", "retryMaxTimes": 1}))
    assert (data, at) == (whole, counter)
    assert turns >= 6
    assert "G-late" in groups.groups and "G-late" not in json.loads(data)["subscriptionGroupTable"]


@bounded(60)
async def test_the_least_offsets_of_a_topics_groups_are_read_between_turns(tmp_path):
    """QUERY_CORRECTION_OFFSET (308) read every group's offsets of the topic in one go: some 45 ms of the loop at
    10,000 groups and 100,000 offsets of one topic. It reads CORRECTION_SLICE offsets a turn, off the per-topic
    index (never a walk of every offset), the answer the same: each queue's least offset not below its first,
    the filtered groups left out."""
    offsets = ConsumerOffsets(str(tmp_path))
    groups = 3 * ops.CORRECTION_SLICE // 4 + 1         # 4 queues each: a little over 3 slices of offsets
    for g in range(groups):
        for q in range(4):
            offsets.commit(f"CG{g}", "T", q, 10 + g + q)
    offsets.commit("CGlow", "T", 0, 3)                 # below queue 0's first offset (5): left out
    offsets.commit("CGout", "T", 1, 6)                 # filtered out
    offsets.commit("CGother", "U", 2, 0)               # another topic's

    def walked():
        raise AssertionError("every offset walked")
    offsets.items = walked
    ctx = types.SimpleNamespace(offsets=offsets, store=types.SimpleNamespace(min_offset=lambda t, q: 5))
    async with other_client() as turns:
        reply = ops.query_correction_offset(ctx, None, RemotingCommand.request(
            RequestCode.QUERY_CORRECTION_OFFSET, {"topic": "T", "compareGroup": "CG0", "filterGroups": "CGout"}))
        reply = await reply if inspect.isawaitable(reply) else reply      # (it was a plain function)
    assert reply.code == ResponseCode.SUCCESS, reply.remark
    assert json.loads(reply.body_bytes()) == {"correctionOffsets": {"0": 10, "1": 11, "2": 12, "3": 13}}
    assert turns[0] >= 3, turns[0]
