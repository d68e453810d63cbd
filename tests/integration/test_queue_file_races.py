"""Requests that meet a new queue while its first file is being made on the store's queue-file thread (a send to
it came first): they wait for the file, as the send does, instead of being refused."""
from __future__ import annotations

import itertools

import pytest

from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.codes import SysFlag
from protocol.command import RemotingCommand
from protocol.message import Prop, decode_offset_msg_id, properties_to_string
from tests.support.bounded import bounded
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio

_OPAQUES = itertools.count(1 << 24)


def _send(topic: str, qid: int, body: bytes, sys_flag: int = 0, props: str = "") -> RemotingCommand:
    return RemotingCommand(R.SEND_MESSAGE, opaque=next(_OPAQUES), body=body, ext_fields={
        "producerGroup": "PG_races", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "4",
        "queueId": str(qid), "sysFlag": str(sys_flag), "bornTimestamp": "0", "flag": "0", "properties": props})



async def _in_one_read(client: RawClient, first: RemotingCommand, second: RemotingCommand):
    """Writes both requests at once (one read: handled in one turn of the broker's loop); returns their answers."""
    client.write(first.encode() + second.encode())
    [a] = await client.reply(first.opaque, 10)
    [b] = await client.reply(second.opaque, 10)
    return a, b


async def _max_offset(client: RawClient, topic: str, qid: int) -> int:
    [m] = await client.call(RemotingCommand(R.GET_MAX_OFFSET, opaque=next(_OPAQUES), ext_fields={
        "topic": topic, "queueId": str(qid)}), 10)
    return m.int_field("offset", 0)


@bounded(60)
async def test_a_commit_into_a_queue_whose_file_a_send_is_making_waits_for_it_and_is_written(broker):
    """A half for queue Fresh-1, then, in one read, a plain send to Fresh-1 (its first: the file is made off the
    loop) and the half's COMMIT. The commit was refused "try again" (EAGAIN): a stock client's END_TRANSACTION
    is oneway, so the decision was lost until a check asked for it again. Now it waits for the file and is
    written after the send, the queue's offsets 0 and 1."""
    client = await RawClient.open(broker.broker, "127.0.0.1")
    try:
        props = properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: "PG_races"})
        [half] = await client.call(_send("Fresh", 1, b"h", SysFlag.TRANSACTION_PREPARED, props), 10)
        assert half.code == C.SUCCESS, half.remark
        send = _send("Fresh", 1, b"plain")
        end = RemotingCommand(R.END_TRANSACTION, opaque=next(_OPAQUES), ext_fields={
            "producerGroup": "PG_races", "tranStateTableOffset": half.ext_fields["queueOffset"],
            "commitLogOffset": str(decode_offset_msg_id(half.ext_fields["msgId"])[2]), "commitOrRollback": "8",
            "fromTransactionCheck": "false", "msgId": half.ext_fields["msgId"]})
        sent, ended = await _in_one_read(client, send, end)
        assert sent.code == C.SUCCESS, sent.remark
        assert ended.code == C.SUCCESS, (ended.code, ended.remark)
        assert await _max_offset(client, "Fresh", 1) == 2
    finally:
        client.close()


@bounded(60)
async def test_a_send_back_into_a_schedule_queue_whose_file_a_send_is_making_waits_for_it(broker):
    """A delayed send (level 5: its schedule queue's first) and, in the same read, a consumer's send-back with
    delay level 5 (the same schedule queue). The send-back was refused "create mapped file failed ... try again"
    and counted as a queue-file failure; now it waits for the file, as the send does, and both are stored."""
    client = await RawClient.open(broker.broker, "127.0.0.1")
    try:
        [plain] = await client.call(_send("Backed", 0, b"failed"), 10)
        assert plain.code == C.SUCCESS, plain.remark
        delayed = _send("Later", 0, b"later", props=properties_to_string({Prop.DELAY: "5"}))
        back = RemotingCommand(R.CONSUMER_SEND_MSG_BACK, opaque=next(_OPAQUES), ext_fields={
            "offset": str(decode_offset_msg_id(plain.ext_fields["msgId"])[2]), "group": "CG_races",
            "delayLevel": "5", "originMsgId": plain.ext_fields["msgId"], "originTopic": "Backed"})
        sent, backed = await _in_one_read(client, delayed, back)
        assert sent.code == C.SUCCESS, sent.remark
        assert backed.code == C.SUCCESS, (backed.code, backed.remark)
        assert await _max_offset(client, "SCHEDULE_TOPIC_XXXX", 4) == 2
    finally:
        client.close()
