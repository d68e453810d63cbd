"""An operator's change answered SUCCESS must survive a SIGKILL that comes right after the reply.

Each test makes one change over TCP as mqadmin frames it, kills the broker (-9) as soon as SUCCESS is read --
paced by the reply, not by the clock -- starts it again on the same store and reads the state back. RocketMQ
4.9.8 persists topic and subscription configs (ConfigManager.persist) and its configuration file
(BrokerController.updateBrokerConfig) before it answers; txmq answered topic changes before their batched
write (up to 100 ms later), offset resets before the periodic offsets save (5 s), and kept brokerPermission in
memory only: the broker came back with the old state and nothing said. A change that cannot be saved is
answered SYSTEM_ERROR saying so; subscription groups and forced decisions were durable already (kept here
as guards).
"""
from __future__ import annotations

import asyncio
import json

import pytest

from protocol.admin_bodies import decode_consumer_offsets
from protocol.codes import Perm, ResponseCode
from protocol.codes import RequestCode as R
from tests.support.bounded import bounded
from tests.support.cluster_process import request

pytestmark = [pytest.mark.asyncio]


async def _ok(addr: str, code: int, fields: dict | None = None, body: bytes = b""):
    resp = await request(addr, code, fields, body)
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    return resp


async def _topics(addr: str) -> dict:
    return json.loads((await _ok(addr, R.GET_ALL_TOPIC_CONFIG)).body_bytes())["topicConfigTable"]


async def _offsets(addr: str) -> dict:
    return decode_consumer_offsets((await _ok(addr, R.GET_ALL_CONSUMER_OFFSET)).body_bytes())


def _send(topic: str, body: bytes) -> tuple:
    return R.SEND_MESSAGE, {"producerGroup": "PG_admin_kill", "topic": topic, "defaultTopic": "TBW102",
                            "defaultTopicQueueNums": 1, "queueId": 0, "sysFlag": 0, "bornTimestamp": 0, "flag": 0,
                            "properties": ""}, body


async def _restart_after_kill(broker_factory, b, *flags: str):
    b.kill()
    return await asyncio.to_thread(broker_factory, *flags)


@bounded(90)
async def test_topic_settings_survive_a_kill_right_after_success(broker_factory, tmp_path):
    """A new topic with 16 read-only ordered queues, and an existing one made read-only: after the kill both were
    back as before (the new one missing, made again by the next send with the default queues, read-write)."""
    b = broker_factory()
    await _ok(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Kept", "readQueueNums": 2, "writeQueueNums": 2,
                                                    "perm": Perm.READ_WRITE})
    b = await _restart_after_kill(broker_factory, b)      # "Kept" as it was before the operator's change
    await _ok(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Made", "readQueueNums": 16, "writeQueueNums": 16,
                                                    "perm": Perm.READ, "order": "true"})
    await _ok(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Kept", "readQueueNums": 4, "writeQueueNums": 4,
                                                    "perm": Perm.READ})
    catalogue = (tmp_path / "store" / "config" / "topics.json").read_text()
    assert '"Made"' in catalogue        # on disk when SUCCESS is read, on any machine
    b = await _restart_after_kill(broker_factory, b)
    table = await _topics(b.broker)
    made = table["Made"]
    assert (made["readQueueNums"], made["writeQueueNums"], made["perm"], made["order"]) == (16, 16, Perm.READ, True)
    assert (table["Kept"]["readQueueNums"], table["Kept"]["perm"]) == (4, Perm.READ)


@bounded(90)
async def test_a_deleted_topic_stays_deleted_after_a_kill_right_after_success(broker_factory):
    """The catalogue without it was written up to 100 ms after SUCCESS: killed before, the topic was back."""
    b = broker_factory()
    await _ok(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Gone", "readQueueNums": 8, "writeQueueNums": 8})
    await _ok(b.broker, *_send("Gone", b"old"))
    assert b.stop() == 0            # "Gone" in the catalogue, as a topic made long ago
    b.start()
    await _ok(b.broker, *_send("Gone", b"new"))    # (after the last checkpoint: recovery scans it again)
    await _ok(b.broker, R.DELETE_TOPIC_IN_BROKER, {"topic": "Gone"})
    b = await _restart_after_kill(broker_factory, b)
    assert "Gone" not in await _topics(b.broker)


async def _group_at(b, group: str, topic: str, offset: int) -> None:
    """``group`` committed at ``offset`` of ``topic`` queue 0 (holding that many messages), saved by a clean stop."""
    await _ok(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": topic, "readQueueNums": 1, "writeQueueNums": 1})
    for i in range(offset):
        await _ok(b.broker, *_send(topic, f"m{i}".encode()))
    await _ok(b.broker, R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": group, "topic": topic, "queueId": 0,
                                                   "commitOffset": offset})
    assert b.stop() == 0
    b.start()
    assert (await _offsets(b.broker))[(group, topic, 0)] == offset


@bounded(90)
async def test_an_offset_reset_survives_a_kill_right_after_success(broker_factory):
    """mqadmin resetOffsetByTime to replay a queue: answered before the periodic save, the kill put the group back
    at its old offset -- the replay never came."""
    b = broker_factory()
    await _group_at(b, "CG_replay", "Replay", 5)
    await _ok(b.broker, R.INVOKE_BROKER_TO_RESET_OFFSET, {"topic": "Replay", "group": "CG_replay", "timestamp": 0,
                                                          "isForce": "true", "queueId": 0, "offset": 1})
    b = await _restart_after_kill(broker_factory, b)
    assert (await _offsets(b.broker))[("CG_replay", "Replay", 0)] == 1


@bounded(90)
async def test_a_groups_removed_offsets_stay_removed_after_a_kill_right_after_success(broker_factory):
    """mqadmin deleteSubGroup -r (removeOffset): the offsets came back with the restart."""
    b = broker_factory()
    await _group_at(b, "CG_removed", "Removed", 2)
    await _ok(b.broker, R.DELETE_SUBSCRIPTIONGROUP, {"groupName": "CG_removed", "removeOffset": "true"})
    b = await _restart_after_kill(broker_factory, b)
    assert ("CG_removed", "Removed", 0) not in await _offsets(b.broker)



@bounded(90)
async def test_a_read_only_broker_stays_read_only_after_a_kill(broker_factory):
    """mqadmin updateBrokerConfig -k brokerPermission -v 4 for maintenance, then a crash: the broker came back
    read-write, taking sends again, with nothing said. RocketMQ writes it to its config file before it answers."""
    b = broker_factory()
    await _ok(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Maint", "readQueueNums": 1, "writeQueueNums": 1})
    await _ok(b.broker, R.UPDATE_BROKER_CONFIG, None, b"brokerPermission=4\n")
    b = await _restart_after_kill(broker_factory, b)
    config = (await _ok(b.broker, R.GET_BROKER_CONFIG)).body_bytes().decode()
    assert "brokerPermission=4\n" in config
    refused = await request(b.broker, *_send("Maint", b"during maintenance"))
    assert refused.code == ResponseCode.NO_PERMISSION and "sending message is forbidden" in refused.remark
    assert "broker permission read-only (4), as updateBrokerConfig set it before this start" in b.log()

    await _ok(b.broker, R.UPDATE_BROKER_CONFIG, None, b"brokerPermission=6\n")     # maintenance over
    b = await _restart_after_kill(broker_factory, b)
    assert "brokerPermission=6\n" in (await _ok(b.broker, R.GET_BROKER_CONFIG)).body_bytes().decode()
    await _ok(b.broker, *_send("Maint", b"after"))


@bounded(90)
async def test_a_change_that_cannot_be_saved_is_not_answered_success(broker_factory, tmp_path):
    """Each file kept from being written (a directory where its temporary file goes): the reply says what was
    done and what was not saved (the topic's change is in force, its write retried, as a subscription group's), or
    that nothing changed -- never SUCCESS for a change a restart undoes."""
    b = broker_factory()
    await _group_at(b, "CG_unsaved", "Writable", 1)
    config = tmp_path / "store" / "config"
    for name in ("topics.json.tmp", "consumerOffset.json.tmp", "brokerConfig.json.tmp"):
        (config / name).mkdir()
    topic = await request(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Unsaved", "readQueueNums": 4,
                                                                 "writeQueueNums": 4, "perm": Perm.READ})
    assert topic.code == ResponseCode.SYSTEM_ERROR and "topic Unsaved set but not saved" in topic.remark
    reset = await request(b.broker, R.INVOKE_BROKER_TO_RESET_OFFSET, {
        "topic": "Writable", "group": "CG_unsaved", "timestamp": 0, "isForce": "true", "queueId": 0, "offset": 0})
    assert reset.code == ResponseCode.SYSTEM_ERROR and "consumer offsets are not saved" in reset.remark
    perm = await request(b.broker, R.UPDATE_BROKER_CONFIG, None, b"brokerPermission=4\n")
    assert perm.code == ResponseCode.SYSTEM_ERROR and "Nothing was changed" in perm.remark
    assert "brokerPermission=6\n" in (await _ok(b.broker, R.GET_BROKER_CONFIG)).body_bytes().decode()
    await _ok(b.broker, *_send("Writable", b"still writable"))


def _block_mark(topic_dir):
    """Make the deleted mark unwritable in ``topic_dir`` until the link is removed: its temporary file's name
    is a link into a directory that does not exist (the delete's clean-up of the queue files cannot remove a
    link with rmtree, so the second try after it fails too)."""
    blocked = topic_dir / "deleted.tmp"
    blocked.symlink_to(topic_dir / "no-such-directory" / "deleted.tmp")
    return blocked


@bounded(90)
async def test_a_delete_whose_mark_cannot_be_written_says_so(broker_factory, tmp_path):
    """The deleted topic's mark keeps recovery from indexing its old records again; not written (a dangling
    link where its temporary file goes, which the delete's clean-up of the queue files leaves), the delete was answered SUCCESS and only the log said a restart may serve
    the topic again."""
    b = broker_factory()
    await _ok(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Unmarked", "readQueueNums": 1, "writeQueueNums": 1})
    await _ok(b.broker, *_send("Unmarked", b"old"))
    _block_mark(tmp_path / "store" / "consumequeue" / "Unmarked")
    deleted = await request(b.broker, R.DELETE_TOPIC_IN_BROKER, {"topic": "Unmarked"})
    assert deleted.code == ResponseCode.SYSTEM_ERROR
    assert "topic Unmarked deleted, but its mark was not written" in deleted.remark
    assert "Unmarked" not in await _topics(b.broker)        # deleted all the same


def _heartbeat(group: str, topic: str) -> bytes:
    """A 4.9.8 consumer's HEART_BEAT body: its heartbeat makes the group's %RETRY% topic."""
    return json.dumps({"clientID": "127.0.0.1@admin_kill", "producerDataSet": [], "consumerDataSet": [{
        "groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
        "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False, "subscriptionDataSet": [{
            "topic": topic, "subString": "*", "tagsSet": [], "codeSet": [], "subVersion": 1,
            "expressionType": "TAG", "classFilterMode": False}]}]}).encode()


async def _groups(addr: str) -> dict:
    return json.loads((await _ok(addr, R.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)).body_bytes())["subscriptionGroupTable"]


@bounded(90)
async def test_a_groups_settings_and_its_grown_retry_topic_survive_a_kill(broker_factory):
    """updateSubGroup -q 4 grows the group's %RETRY% topic, saved with the group's config before SUCCESS (the
    topic's write was left to the batch: killed, the group said 4 retry queues and its topic had 1); and
    deleteSubGroup stays done."""
    b = broker_factory()
    await _ok(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Stopped", "readQueueNums": 1, "writeQueueNums": 1})
    await _ok(b.broker, R.HEART_BEAT, None, _heartbeat("CG_stopped", "Stopped"))
    assert b.stop() == 0            # %RETRY%CG_stopped saved with 1 queue
    b.start()
    assert (await _topics(b.broker))["%RETRY%CG_stopped"]["readQueueNums"] == 1
    await _ok(b.broker, R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, None, json.dumps(
        {"groupName": "CG_stopped", "consumeEnable": False, "retryQueueNums": 4, "retryMaxTimes": 3}).encode())
    b = await _restart_after_kill(broker_factory, b)
    group = (await _groups(b.broker))["CG_stopped"]
    assert (group["consumeEnable"], group["retryQueueNums"], group["retryMaxTimes"]) == (False, 4, 3)
    assert (await _topics(b.broker))["%RETRY%CG_stopped"]["readQueueNums"] == 4

    await _ok(b.broker, R.DELETE_SUBSCRIPTIONGROUP, {"groupName": "CG_stopped"})
    b = await _restart_after_kill(broker_factory, b)
    assert "CG_stopped" not in await _groups(b.broker)


@bounded(90)
async def test_a_forced_commit_survives_a_kill_right_after_success(broker_factory):
    """txmq-admin commit: its decision is a commit-log record, flushed before the reply (--flush sync), so the
    restart neither checks the transaction again nor loses the message."""
    from producer import LocalTransactionState as S
    from producer import TransactionProducer
    from tests.integration.test_transactions import Listener, _drain

    from tests.support.broker_process import NO_CHECKS as flags     # no check decides it meanwhile

    b = broker_factory(*flags)
    # (and were one sent, its answer decides nothing: COMMIT would have made the admin's commit a no-op)
    async with TransactionProducer(b.namesrv, "PG_forced", Listener(execute=S.UNKNOW, check=S.UNKNOW)) as producer:
        await producer.send_in_transaction("TxForced", b"forced")
    [row] = json.loads((await _ok(b.broker, R.TXMQ_LIST_TRANSACTIONS)).body_bytes())["pending"]
    await _ok(b.broker, R.TXMQ_RESOLVE_TRANSACTION, {"commitLogOffset": row["commit_log_offset"],
                                                     "decision": "commit"})
    b = await _restart_after_kill(broker_factory, b, *flags)
    assert json.loads((await _ok(b.broker, R.TXMQ_LIST_TRANSACTIONS)).body_bytes())["pending"] == []
    assert await _drain(b.namesrv, "TxForced", expect=1) == [b"forced"]


@bounded(90)
async def test_a_delete_said_unmarked_and_asked_again_stays_deleted_after_a_kill(broker_factory, tmp_path):
    """The unmarked delete's reply says to delete the topic again once the disk is writable. Asked again, the
    store found no queue of it (they went with the first delete), wrote no mark and answered SUCCESS: a restart
    indexed the topic's records again and served it, the operator told twice it was gone."""
    b = broker_factory()
    await _ok(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "Twice", "readQueueNums": 1, "writeQueueNums": 1})
    await _ok(b.broker, *_send("Twice", b"old"))
    assert b.stop() == 0
    b.start()
    await _ok(b.broker, *_send("Twice", b"new"))    # (after the last checkpoint: recovery scans it again)
    blocked = _block_mark(tmp_path / "store" / "consumequeue" / "Twice")
    deleted = await request(b.broker, R.DELETE_TOPIC_IN_BROKER, {"topic": "Twice"})
    assert deleted.code == ResponseCode.SYSTEM_ERROR and "delete it again" in deleted.remark
    blocked.unlink()                                # the disk writable again
    await _ok(b.broker, R.DELETE_TOPIC_IN_BROKER, {"topic": "Twice"})
    b = await _restart_after_kill(broker_factory, b)
    assert "Twice" not in await _topics(b.broker)
    assert (await request(b.broker, R.GET_MAX_OFFSET, {"topic": "Twice", "queueId": 0})).ext_fields.get(
        "offset") in (None, "0")
