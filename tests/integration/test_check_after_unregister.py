"""A transaction check goes to a producer still in the half's group, as RocketMQ's ProducerManager picks it.

A Java process shares one connection per broker (its MQClientInstance) between all its producers and
consumers: a TransactionMQProducer shut down sends UNREGISTER_CLIENT for its group and the connection stays
open for the rest. The Java client answers a check only for a group it still has a producer of (else it logs
"pick producer by group failed" and says nothing), so a check sent there is never answered, while another
producer of the group, which could answer it, is never asked: the committed transaction was checked until
transaction_check_max and then dead-lettered, never delivered.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from protocol.codes import RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import Prop, SendMessageRequestHeader, properties_to_string
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

TOPIC = "CheckAfterLeave"
GROUP = "PG_leaves"
COMMIT = 8


def _heartbeat(client_id: str, producer_groups=(), consumer_groups=()):
    body = {"clientID": client_id, "producerDataSet": [{"groupName": g} for g in producer_groups],
            "consumerDataSet": [{"groupName": g, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                                 "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False,
                                 "subscriptionDataSet": [{"topic": "Elsewhere", "subString": "*", "tagsSet": [],
                                                          "codeSet": [], "subVersion": 1,
                                                          "classFilterMode": False}]}
                                for g in consumer_groups]}
    return RemotingCommand.request(RequestCode.HEART_BEAT, None, json.dumps(body).encode())


class Checked:
    """A client connection's handler: records the checks it is sent, and commits them when ``answers``."""

    def __init__(self, answers: bool):
        self.answers = answers
        self.checks = []
        self.asked = asyncio.Event()
        # Set to the UNREGISTER_CLIENT request's future: frames are handled in the order they came, so a check
        # handled once it is done was sent after the broker had taken the unregistration.
        self.left: asyncio.Future | None = None
        self.checks_after_leaving = []
        self.asked_after_leaving = asyncio.Event()

    def __call__(self, conn, cmd):
        if cmd.code != RequestCode.CHECK_TRANSACTION_STATE:
            return None
        self.checks.append(dict(cmd.ext_fields))
        self.asked.set()
        if self.left is not None and self.left.done():
            self.checks_after_leaving.append(dict(cmd.ext_fields))
            self.asked_after_leaving.set()
        if self.answers:
            conn.oneway(RemotingCommand.request(RequestCode.END_TRANSACTION, {
                "producerGroup": GROUP, "tranStateTableOffset": cmd.ext_fields["tranStateTableOffset"],
                "commitLogOffset": cmd.ext_fields["commitLogOffset"], "commitOrRollback": str(COMMIT),
                "fromTransactionCheck": "true", "msgId": cmd.ext_fields["msgId"],
                "transactionId": cmd.ext_fields.get("transactionId", "")}))
        return None


async def _a_half_from(leaver) -> None:
    """The topic, the leaver's heartbeat as a producer of GROUP (and a consumer of its process), and its half."""
    created = await leaver.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
        "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
    assert created.code == ResponseCode.SUCCESS, created.remark
    assert (await leaver.request(_heartbeat("leaver", [GROUP], ["CG_same_process"]), 5)).code == 0
    h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                 properties=properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: GROUP}))
    sent = await leaver.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False),
                                                        b"order 1"), 5)
    assert sent.code == ResponseCode.SUCCESS, sent.remark


async def _committed_is_pulled(stayer) -> None:
    pulled = await stayer.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
        "consumerGroup": "CG_reader", "topic": TOPIC, "queueId": 0, "queueOffset": 0, "maxMsgNums": 1,
        "sysFlag": 2 | 4, "commitOffset": 0, "suspendTimeoutMillis": 20000, "subscription": "*",
        "subVersion": 0, "expressionType": "TAG"}), 25)       # long-polls until the commit is stored
    assert pulled.code == ResponseCode.SUCCESS, pulled.remark


@bounded(60)
async def test_check_skips_a_connection_that_unregistered_the_group(broker_factory):
    # The immunity (2 s) may end before the leaver unregisters on a loaded machine: a check it is sent while
    # still a producer of the group is right, and unanswered; only checks after its unregistration count
    # against the broker. The default check_max (15, ~5.8 s of back-off) outlasts such a stall.
    b = broker_factory("--transaction-check-interval-ms", "100", "--transaction-timeout-ms", "2000")
    host, _, port = b.broker.rpartition(":")
    gone, other = Checked(answers=False), Checked(answers=True)
    leaver = await open_connection(host, int(port), gone)
    stayer = await open_connection(host, int(port), other)
    try:
        await _a_half_from(leaver)      # the producer about to shut down: its local transaction undecided
        # TransactionMQProducer.shutdown(): UNREGISTER_CLIENT for its group; the process's consumer keeps the
        # connection open and heartbeating, without the producer group.
        gone.left = leaver.start_request(RemotingCommand.request(RequestCode.UNREGISTER_CLIENT, {
            "clientID": "leaver", "producerGroup": GROUP}), 5)
        left = await gone.left
        assert left.code == ResponseCode.SUCCESS
        assert (await leaver.request(_heartbeat("leaver", [], ["CG_same_process"]), 5)).code == 0
        # another producer of the group, which can answer the check
        assert (await stayer.request(_heartbeat("stayer", [GROUP]), 5)).code == 0
        # the first check after the unregistration goes to one of the two connections (the test's deadline
        # bounds the wait)
        await asyncio.wait([asyncio.ensure_future(gone.asked_after_leaving.wait()),
                            asyncio.ensure_future(other.asked.wait())], return_when=asyncio.FIRST_COMPLETED)
        assert gone.checks_after_leaving == [], \
            f"checked a connection whose producer had unregistered the group:\n{b.log()}"
        await _committed_is_pulled(stayer)
    finally:
        leaver.close()
        stayer.close()


@bounded(30)
async def test_a_check_in_flight_to_a_producer_that_unregisters_is_asked_again_of_the_group_at_once(broker_factory):
    """A check sent to the half's producer, which then unregisters its group on a connection that stays open (the
    Java client drops a check for a group it has left, answered or not): the check will never be answered. It was
    taken as lost only when it came due again, a whole interval later (60 s here; the test's deadline is 30 s),
    while another producer of the group could have answered at once; a closed connection's check is asked again
    at once (core.channel_closed), and so is this one now (core.producer_left)."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "500")
    host, _, port = b.broker.rpartition(":")
    gone, other = Checked(answers=False), Checked(answers=True)
    leaver = await open_connection(host, int(port), gone)
    stayer = await open_connection(host, int(port), other)
    try:
        await _a_half_from(leaver)
        await gone.asked.wait()         # its first check, to its sender: in flight, unanswered
        left = await leaver.request(RemotingCommand.request(RequestCode.UNREGISTER_CLIENT, {
            "clientID": "leaver", "producerGroup": GROUP}), 5)
        assert left.code == ResponseCode.SUCCESS
        assert (await stayer.request(_heartbeat("stayer", [GROUP]), 5)).code == 0
        await other.asked.wait()        # asked at once (it commits), not an interval later
        assert len(gone.checks) == 1, gone.checks
        await _committed_is_pulled(stayer)
    finally:
        leaver.close()
        stayer.close()


async def _heartbeats_until(done: asyncio.Event, *beats, rounds: int = 100) -> bool:
    """Each of ``beats`` ((connection, heartbeat)) sent every 0.1 s (a client's heartbeat period, shortened, so
    channel_expire_ms closes neither connection) until ``done`` is set; False if it is not within ``rounds``."""
    for _ in range(rounds):
        for conn, beat in beats:
            assert (await conn.request(beat, 5)).code == ResponseCode.SUCCESS
        try:
            await asyncio.wait_for(done.wait(), 0.1)
            return True
        except asyncio.TimeoutError:
            pass
    return False


@bounded(40)
async def test_a_check_in_flight_to_a_producer_dropped_for_silence_is_asked_again_of_the_group_at_once(broker_factory):
    """The half's producer stops heartbeating its group without UNREGISTER_CLIENT (the request lost or timed out at
    its shutdown; a client that drops a producer from its heartbeats), its connection kept open by the process's
    consumer: after channel_expire_ms the registry drops it from the group, as RocketMQ's scan does (which closes
    the channel as well). Its check in flight will never be answered (a Java client drops a check for a group it
    has no producer of) and, the connection open and not marked as having left, it was taken as lost only when it
    came due again, an interval later (60 s here), its sender asked first again then. It is lost at the drop now,
    as at an unregistration: deferred while the group has nobody, asked at once of the producer that joins."""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "500",
                       "--channel-expire-ms", "1500")
    host, _, port = b.broker.rpartition(":")
    gone, other = Checked(answers=False), Checked(answers=True)
    leaver = await open_connection(host, int(port), gone)
    stayer = await open_connection(host, int(port), other)
    consuming = _heartbeat("leaver", [], ["CG_same_process"])   # the process's consumer, its producer not named
    producers = RemotingCommand.request(RequestCode.GET_PRODUCER_CONNECTION_LIST, {"producerGroup": GROUP})
    try:
        await _a_half_from(leaver)
        await gone.asked.wait()         # its first check, to its sender: in flight, unanswered
        dropped = asyncio.Event()

        async def watch() -> None:      # until the registry has dropped the silent producer from its group
            while (await stayer.request(producers, 5)).code != ResponseCode.SYSTEM_ERROR:
                await asyncio.sleep(0.05)
            dropped.set()

        watching = asyncio.ensure_future(watch())
        assert await _heartbeats_until(dropped, (leaver, consuming)), f"never dropped from its group:\n{b.log()}"
        await watching
        assert await _heartbeats_until(other.asked, (leaver, consuming), (stayer, _heartbeat("stayer", [GROUP]))), \
            f"the check lost with the dropped producer was not asked of the group's new one in 10 s:\n{b.log()}"
        assert leaver.is_open and len(gone.checks) == 1, gone.checks
        await _committed_is_pulled(stayer)
    finally:
        leaver.close()
        stayer.close()


@bounded(40)
async def test_a_half_sent_on_a_connection_that_never_heartbeats_is_checked_there_after_its_silence(broker_factory):
    """A Java client before 4.5.1 sends on the VIP channel (port - 2) and heartbeats on the broker port: the
    connection its half came on never names a group in a heartbeat, and is dropped from the group for silence
    channel_expire_ms after its last send. It has not left the group (its process is a producer of it, and answers
    a check on any of its connections), so it is not taken as having left: its half is still checked there first,
    not rerouted to another instance of the group that never heard of the transaction. (Its other requests, the
    process's other sends, keep it open: a connection that sends nothing at all is closed at channel_expire_ms.)"""
    b = broker_factory("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "4000",
                       "--channel-expire-ms", "1500")
    host, _, port = b.broker.rpartition(":")
    sender, other = Checked(answers=True), Checked(answers=False)
    sends = await open_connection(host, int(port), sender)                  # the process's VIP connection
    beats = await open_connection(host, int(port), Checked(answers=True))   # the same process's heartbeats
    instance = await open_connection(host, int(port), other)                # another instance of the group
    producers = RemotingCommand.request(RequestCode.GET_PRODUCER_CONNECTION_LIST, {"producerGroup": GROUP})
    try:
        created = await beats.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert created.code == ResponseCode.SUCCESS, created.remark
        beating = ((beats, _heartbeat("process", [GROUP])), (instance, _heartbeat("instance", [GROUP])),
                   (sends, producers))      # (its other requests: no heartbeat, no half of the group)
        for conn, beat in beating[:2]:
            assert (await conn.request(beat, 5)).code == ResponseCode.SUCCESS
        h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                     properties=properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: GROUP}))
        sent = await sends.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False),
                                                           b"order 1"), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        dropped = asyncio.Event()

        async def watch() -> None:      # until the registry has dropped the silent connection from the group
            while len(json.loads((await beats.request(producers, 5)).body_bytes())["connectionSet"]) != 2:
                await asyncio.sleep(0.05)
            dropped.set()

        watching = asyncio.ensure_future(watch())
        assert await _heartbeats_until(dropped, *beating), f"never dropped from its group:\n{b.log()}"
        await watching
        assert not sender.asked.is_set() and not other.asked.is_set(), "checked before the drop: raise the timeout"
        asked = asyncio.Event()
        for checked in (sender, other):
            checked.asked = asked
        assert await _heartbeats_until(asked, *beating, rounds=150), f"never checked:\n{b.log()}"
        assert (len(sender.checks), len(other.checks)) == (1, 0), "its check went to another instance"
        await _committed_is_pulled(beats)
    finally:
        for conn in (sends, beats, instance):
            conn.close()
