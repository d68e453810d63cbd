"""Operators' bodies as fastjson writes them, the admin CLI's time parsing, and who may call the new codes."""
from __future__ import annotations

import json

import pytest

from broker.acl import AclTable
from broker.admin_ops import parse_time
from broker.subscriptions import SubscriptionGroups, group_config
from protocol.admin_bodies import decode_mq_table, encode_consume_stats, encode_reset_offset, encode_topic_stats
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand
from protocol.errors import HeaderError
from protocol.signature import Credentials


def test_message_queue_keys_are_written_as_objects_like_fastjson():
    assert encode_reset_offset({("T", "broker-a", 1): 7, ("T", "broker-a", 0): 3}) == (
        b'{"offsetTable":{{"brokerName":"broker-a","queueId":0,"topic":"T"}:3,'
        b'{"brokerName":"broker-a","queueId":1,"topic":"T"}:7}}')
    assert encode_consume_stats({("T", "b", 0): (10, 4, 1700000000000)}) == (
        b'{"consumeTps":0.0,"offsetTable":{{"brokerName":"b","queueId":0,"topic":"T"}:'
        b'{"brokerOffset":10,"consumerOffset":4,"lastTimestamp":1700000000000}}}')
    assert encode_topic_stats({("T", "b", 2): (1, 9, 5)}) == (
        b'{"offsetTable":{{"brokerName":"b","queueId":2,"topic":"T"}:'
        b'{"lastUpdateTimestamp":5,"maxOffset":9,"minOffset":1}}}')


def test_message_queue_tables_decode_both_forms():
    body = encode_consume_stats({("T", "b", 0): (10, 4, 0), ("%RETRY%G", "b", 0): (0, 0, 0)})
    obj, table = decode_mq_table(body)
    assert obj["consumeTps"] == 0.0
    assert table[("T", "b", 0)]["consumerOffset"] == 4 and ("%RETRY%G", "b", 0) in table
    quoted = json.dumps({"offsetTable": {json.dumps({"brokerName": "b", "queueId": 3, "topic": "T"}): 8}})
    assert decode_mq_table(quoted.encode())[1] == {("T", "b", 3): 8}
    with pytest.raises(HeaderError):
        decode_mq_table(b'{"offsetTable":{{"queueId":1}:2}}')


def test_parse_time_accepts_ms_iso_rocketmq_and_words():
    assert parse_time("1700000000123") == 1700000000123
    assert parse_time("latest") == -1
    assert parse_time("2024-05-01T10:00:00.250") == parse_time("2024-05-01#10:00:00:250")
    assert abs(parse_time("now") - parse_time(str(parse_time("now")))) < 1000
    with pytest.raises(ValueError, match="--timestamp"):
        parse_time("yesterday")



def test_printed_times_name_their_zone(monkeypatch):
    """consumer-progress, topic-status, show-msg and query-key print times in the local zone of the machine
    running the command, and printed them with no zone: read beside the nightly report (UTC), or on another
    host, a time was off by the zones' difference with nothing to show it. The offset is printed, and a
    printed time given back to --timestamp is the same instant."""
    import time
    from broker.admin_ops import when
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert when(1700000000123) == "2023-11-15 07:13:20.123+09:00"
        assert parse_time(when(1700000000123).replace(" ", "T")) == 1700000000123
        assert when(0) == "-"
    finally:
        monkeypatch.undo()
        time.tzset()

def test_a_timestamp_in_seconds_is_refused_not_read_as_1970():
    """reset-offset --timestamp 1700000000 (seconds) used to reset the group to the start of every queue."""
    with pytest.raises(ValueError, match="looks like seconds since the epoch; give milliseconds \\(1700000000000\\)"):
        parse_time("1700000000")
    assert parse_time("0") == 0                     # the earliest offsets, said on purpose


def test_an_expiry_now_in_seconds_is_refused(capsys):
    """`ops.spark expiry --now-ms <seconds>` used to write an empty plan (nothing is old in 1970) and exit 0."""
    from ops.spark.cli import build_parser
    args = ["expiry", "--store-dir", "s", "--out", "p.json", "--now-ms"]
    assert build_parser().parse_args(args + ["1710028800000"]).now_ms == 1710028800000
    with pytest.raises(SystemExit):
        build_parser().parse_args(args + ["1710028800"])
    assert "looks like seconds since the epoch" in capsys.readouterr().err


def test_subscription_group_defaults_and_persistence(tmp_path):
    groups = SubscriptionGroups(str(tmp_path), lambda: 42)
    assert group_config("G") == {"brokerId": 0, "consumeBroadcastEnable": True, "consumeEnable": True,
                                 "consumeFromMinEnable": True, "groupName": "G",
                                 "notifyConsumerIdsChangedEnable": True, "retryMaxTimes": 16, "retryQueueNums": 1,
                                 "whichBrokerWhenConsumeSlowly": 1}
    groups.update({"groupName": "G", "consumeEnable": "false", "retryMaxTimes": 2, "unknown": 1})
    with pytest.raises(ValueError):
        groups.update({"consumeEnable": False})
    groups.write(groups.encode())
    again = SubscriptionGroups(str(tmp_path), lambda: 43)
    assert not again.consume_enabled("G") and again.consume_enabled("Other") and again.counter == 1
    table = json.loads(again.encode(["Seen"]))["subscriptionGroupTable"]
    assert table["Seen"]["consumeEnable"] and "TOOLS_CONSUMER" in table and table["G"]["retryMaxTimes"] == 2
    # MixAll.CID_SYS_RMQ_TRANS is "CID_RMQ_SYS_TRANS": the constant's value was listed by the constant's name
    assert "CID_RMQ_SYS_TRANS" in table and "CID_SYS_RMQ_TRANS" not in table


def test_reset_needs_an_admin_and_reads_need_a_signature():
    t = AclTable.parse({"accounts": [
        {"accessKey": "appuser", "secretKey": "app-secret", "defaultTopicPerm": "SUB", "defaultGroupPerm": "SUB"},
        {"accessKey": "rootuser", "secretKey": "root-secret", "admin": True}]})

    def signed(code, fields, creds):
        cmd = RemotingCommand.request(code, fields)
        creds.sign(cmd)
        return cmd
    app, root = Credentials("appuser", "app-secret"), Credentials("rootuser", "root-secret")
    reset = {"topic": "T", "group": "G", "timestamp": 1, "isForce": True}
    assert t.check(signed(R.INVOKE_BROKER_TO_RESET_OFFSET, reset, app), "127.0.0.1") == \
        "Need admin permission for request code=222, but accessKey=appuser is not"
    assert t.check(signed(R.INVOKE_BROKER_TO_RESET_OFFSET, reset, root), "127.0.0.1") is None
    assert t.check(signed(R.DELETE_TOPIC_IN_BROKER, {"topic": "T"}, app), "127.0.0.1").startswith("Need admin")
    assert t.check(signed(R.GET_CONSUME_STATS, {"consumerGroup": "G"}, app), "127.0.0.1") is None
    assert t.check(RemotingCommand.request(R.GET_CONSUME_STATS, {"consumerGroup": "G"}), "127.0.0.1") == \
        "No accessKey is configured"


async def test_group_updates_whose_writes_finish_out_of_order_are_all_saved(tmp_path, monkeypatch):
    """Each UPDATE_AND_CREATE_SUBSCRIPTIONGROUP writes the whole table on a worker thread. Two updates close
    together wrote on two threads, in whichever order the threads got there: the first update's table (without
    the second group) written last replaced the second's, both were answered SUCCESS, and the second group's
    config was gone at the next start. Saves run one at a time now (the second's after the first's write), and a
    table older than the one on disk is still never written (a failed save's retry may run beside a save)."""
    import asyncio
    from types import SimpleNamespace

    from broker.processors.ops import update_and_create_subscription_group
    from protocol.codes import ResponseCode

    groups = SubscriptionGroups(str(tmp_path), lambda: 42)
    real = SubscriptionGroups.write
    written: list[int] = []

    def write(self, data, *args):
        written.append(json.loads(data)["dataVersion"]["counter"])
        return real(self, data, *args)
    monkeypatch.setattr(SubscriptionGroups, "write", write)
    ctx = SimpleNamespace(subscriptions=groups, topics=SimpleNamespace(topics={}), acl=None,     # (no retry topic to grow)
                          limits=SimpleNamespace(may_add_group=lambda *_: None),
                          config=SimpleNamespace(broker_role="ASYNC_MASTER"))
    conn = SimpleNamespace(peer=("127.0.0.1", 1))

    def update(name):
        body = json.dumps({"groupName": name, "consumeEnable": False}).encode()
        return update_and_create_subscription_group(
            ctx, conn, RemotingCommand.request(R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=body))
    async with asyncio.timeout(20):
        answers = await asyncio.gather(update("First"), update("Second"))
    assert [a.code for a in answers] == [ResponseCode.SUCCESS] * 2
    assert written == sorted(written) and written[-1] == 2, written
    first_table = json.dumps({"dataVersion": {"counter": 1, "timestamp": 42}, "subscriptionGroupTable": {
        "First": {"groupName": "First", "consumeEnable": False}}}).encode()
    groups.write(first_table, 1)                            # overtaken: skipped
    again = SubscriptionGroups(str(tmp_path), lambda: 43)
    assert not again.consume_enabled("First") and not again.consume_enabled("Second")


def test_show_msg_shows_a_compressed_body_as_its_producer_sent_it():
    """Java and Go producers compress bodies over 4 KiB; show-msg printed the zlib bytes as text."""
    import zlib

    from broker.admin_ops import _message
    from protocol.message import decode_record, encode_record, pack_host

    def stored(body: bytes) -> object:
        return decode_record(encode_record(topic=b"T", body=body, queue_id=0, flag=0, sys_flag=1, born_timestamp=1,
                                           born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                                           properties=b""))[0]
    sent = "order line " * 1000
    assert _message(stored(zlib.compress(sent.encode())), True)["body"] == sent
    broken = _message(stored(b"not zlib"), True)
    assert broken["body"] == "not zlib" and "does not inflate" in broken["body_note"]


def test_show_msg_does_not_inflate_a_zip_bomb_whole():
    """show-msg inflated a COMPRESSED body whole: a hostile producer's small body of deflated zeros took the
    operator's admin tool down with it. Past the cap (--max-inflated-body, 16 MiB) it is shown as stored."""
    import tracemalloc
    import zlib

    from broker.admin_ops import _message
    from protocol.message import decode_record, encode_record, pack_host

    z = zlib.compressobj(9)
    bomb = b"".join(z.compress(bytes(1 << 20)) for _ in range(256)) + z.flush()
    m = decode_record(encode_record(topic=b"T", body=bomb, queue_id=0, flag=0, sys_flag=1, born_timestamp=1,
                                    born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                                    properties=b""))[0]
    tracemalloc.start()
    try:
        out = _message(m, True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert "inflates past" in out["body_note"] and out["body_bytes"] == len(bomb)
