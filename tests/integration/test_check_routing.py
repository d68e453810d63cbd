"""Whom a transaction check goes to: the producer instance that sent the half first, across a broker
restart too; and a check whose connection closes unanswered goes to a live producer at once.

Check intervals are long (a minute) so that "asked again well before the interval" means the same on a
slow machine; every wait is for an event (a check arriving, a metric moving), bounded by the test's deadline.
"""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import LanguageCode, RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import Prop, SendMessageRequestHeader, decode_offset_msg_id, decode_record, properties_to_string
from protocol.txlog import P_OWNER
from tests.support.bounded import bounded
from tests.support.cluster_process import request

pytestmark = pytest.mark.asyncio

GROUP = "PG_routing"
TOPIC = "Routing"
LONG = ("--transaction-check-interval-ms", "60000")


class Checked:
    """A raw connection's handler, as a stock Java producer's: records the checks it is sent (never answers)."""

    def __init__(self, changed: asyncio.Event):
        self.asked: list[str] = []
        self.changed = changed

    def __call__(self, conn, cmd):
        if cmd.code == RequestCode.CHECK_TRANSACTION_STATE:
            self.asked.append(cmd.ext_fields["commitLogOffset"])
            self.changed.set()
        return None


async def _raw(b, handler, client_id: str | None = None):
    """A connection to the broker; with ``client_id``, registered as a producer of GROUP by a heartbeat."""
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port), handler)
    if client_id is not None:
        await _beat(conn, client_id)
    return conn


async def _beat(conn, client_id: str) -> None:
    body = {"clientID": client_id, "producerDataSet": [{"groupName": GROUP}], "consumerDataSet": []}
    beat = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, None, json.dumps(body).encode()), 5)
    assert beat.code == ResponseCode.SUCCESS, beat.remark


class Listener:
    """Leaves its local transactions undecided; records the checks it is asked, answers them when ``answers``."""

    def __init__(self, answers: bool = True, changed: asyncio.Event | None = None):
        self.answers = answers
        self.asked: list[bytes] = []
        self.changed = changed or asyncio.Event()       # may be shared: any of several listeners asked
        self.never = asyncio.Event()

    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    async def check_local_transaction(self, msg):
        self.asked.append(msg.body)
        self.changed.set()
        if not self.answers:
            await self.never.wait()     # hung: the check is never answered on this connection
        return S.COMMIT_MESSAGE

    async def until_asked(self, n: int, *others: "Listener") -> None:
        """Until this listener (and ``others``, sharing its event) were asked ``n`` checks in all."""
        while len(self.asked) + sum(len(o.asked) for o in others) < n:
            self.changed.clear()
            await self.changed.wait()


def _producer(b, instance: str, listener: Listener) -> TransactionProducer:
    return TransactionProducer(b.namesrv, GROUP, listener, instance_name=instance, shutdown_grace_s=0)


async def _die(producer: TransactionProducer) -> None:
    """The producer's process dies: its connections close, and nothing more is sent (no UNREGISTER_CLIENT)."""
    for task in (producer._heartbeat_task, producer._route_task):
        task.cancel()
    await producer.pool.close()


async def _list(b) -> list[dict]:
    """The undecided transactions, as `python -m broker admin list` shows them."""
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        listed = await conn.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, None), 5)
    finally:
        conn.close()
    return json.loads(listed.body_bytes())["pending"]


async def _metric(b, name: str, label: str = "") -> float:
    """The value of ``name`` for GROUP (summed over its other labels, or only those with ``label``)."""
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode())
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'producer_group="{GROUP}"' in line and label in line)


# No check is due in the restart tests (an immunity of an hour): whom a check asks after a restart is the same
# lookup `admin list` shows, so the list says whether the sender was kept; which connection the checks then go
# to, both producers back before anything is due, is in tests/unit/test_transaction_snapshot.py (its clock
# says when, so it means the same on any machine).
NEVER_DUE = LONG + ("--transaction-timeout-ms", str(3600 * 1000))


def _owners(listed: list[dict]) -> set[str]:
    return {row["owner"] for row in listed}


@bounded(90)
async def test_after_a_restart_the_sender_is_known_and_found_when_it_reconnects(broker_factory):
    b = broker_factory(*NEVER_DUE)
    async with _producer(b, "sender", Listener()) as sender:
        for i in range(4):
            sent = await sender.send_in_transaction(TOPIC, f"order {i}".encode())
            assert sent.state is S.UNKNOW
        client_id = sender.client_id
    assert b.stop() == 0
    b = broker_factory(*NEVER_DUE)
    assert _owners(await _list(b)) == {f"{client_id} (gone)"}     # kept across the restart, not here yet
    async with _producer(b, "other", Listener()), _producer(b, "sender", Listener()) as sender:
        assert sender.client_id == client_id
        listed = await _list(b)
        assert len(listed) == 4 and _owners(listed) == {client_id}, listed      # here, as a check finds it


@bounded(90)
async def test_after_a_restart_the_sender_is_the_one_whose_heartbeat_came_after_its_halves(broker_factory):
    """A stock Java producer sends its first halves before its first heartbeat (it learns the broker from the
    route, and heartbeats on its 30 s timer): the half is taken under the connection's address, and the client
    id the heartbeat then gave that connection is the one the sender comes back with."""
    b = broker_factory(*NEVER_DUE)
    conn = await _raw(b, Checked(asyncio.Event()))
    try:
        made = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert made.code == ResponseCode.SUCCESS, made.remark
        for i in range(4):
            h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                         properties=properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: GROUP}))
            sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False),
                                                              f"order {i}".encode()), 5)
            assert sent.code == ResponseCode.SUCCESS, sent.remark
        await _beat(conn, "10.0.0.7@4242")         # its first heartbeat, after its halves
    finally:
        conn.close()
    assert b.stop() == 0
    b = broker_factory(*NEVER_DUE)
    assert _owners(await _list(b)) == {"10.0.0.7@4242 (gone)"}
    other = await _raw(b, Checked(asyncio.Event()), "10.0.0.8@99")
    sender = await _raw(b, Checked(asyncio.Event()), "10.0.0.7@4242")
    try:
        listed = await _list(b)
        assert len(listed) == 4 and _owners(listed) == {"10.0.0.7@4242"}, listed
    finally:
        other.close()
        sender.close()


@bounded(90)
async def test_a_shared_connection_keeps_the_first_id_its_heartbeat_gave_for_every_group_across_a_kill(
        broker_factory):
    """A Java process shares one connection between all its producers: its halves of two groups come before its
    first heartbeat, which names both groups and the instance. Those halves are that instance's, and stay so when
    a later heartbeat on the same connection gives another id (each half keeps the id its connection had when it
    came, or the first one given after): named by the connection's name of the moment, every half it had ever
    sent went to the new id. Killed after the second heartbeat, the broker still knows each sender."""
    other = GROUP + "_2"
    b = broker_factory(*NEVER_DUE, "--transaction-snapshot-interval-s", "3600")
    conn = await _raw(b, Checked(asyncio.Event()))

    async def half(group: str, key: str) -> None:
        h = SendMessageRequestHeader(group, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                     properties=properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: group,
                                                                      Prop.UNIQ_KEY: key}))
        sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, h.to_ext_fields(v2=True),
                                                          key.encode(), language=LanguageCode.JAVA), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark

    async def beat(client_id: str) -> None:
        body = {"clientID": client_id, "producerDataSet": [{"groupName": GROUP}, {"groupName": other}],
                "consumerDataSet": []}
        beat = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, None, json.dumps(body).encode(),
                                                          language=LanguageCode.JAVA), 5)
        assert beat.code == ResponseCode.SUCCESS, beat.remark

    try:
        made = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert made.code == ResponseCode.SUCCESS, made.remark
        await half(GROUP, "before-first-group")
        await half(other, "before-second-group")
        await beat("10.0.0.7@4242")
        await half(GROUP, "after")
        await beat("10.0.0.7@renamed")
        await half(other, "renamed")
        expected = {"before-first-group": "10.0.0.7@4242", "before-second-group": "10.0.0.7@4242",
                    "after": "10.0.0.7@4242", "renamed": "10.0.0.7@renamed"}
        assert _by_key(await _list(b)) == expected
    finally:
        conn.close()
    b.kill()
    b = await asyncio.to_thread(broker_factory, *NEVER_DUE)      # the same store
    assert _by_key(await _list(b)) == {body: f"{owner} (gone)" for body, owner in expected.items()}


def _by_key(listed: list[dict]) -> dict[str, str]:
    """{half's UNIQ_KEY: the owner the admin view shows}."""
    return {row["uniq_key"]: row["owner"] for row in listed}


@bounded(90)
async def test_a_check_whose_connection_closes_unanswered_is_asked_again_of_a_live_producer_at_once(
        broker_factory):
    b = broker_factory(*LONG, "--transaction-timeout-ms", "1000")
    hung, other = Listener(answers=False), Listener()
    async with _producer(b, "other", other):
        sender = await _producer(b, "sender", hung).start()
        try:
            await sender.send_in_transaction(TOPIC, b"order 1")
            await hung.until_asked(1)               # the first check goes to the sender
            await _die(sender)
            # Asked again of the live producer within seconds, not after the minute's interval.
            await asyncio.wait_for(other.until_asked(1), 20)
        finally:
            hung.never.set()
        assert other.asked == [b"order 1"]
        assert await _metric(b, "txmq_transaction_checks_lost_total") == 1
        assert await _metric(b, "txmq_transaction_checks_total") == 2      # both count against the max
        assert await _metric(b, "txmq_transaction_checks_rerouted_total", 'reason="sender-gone"') == 1

@bounded(90)
async def test_a_sender_at_its_check_cap_is_passed_over_for_another_producer_and_that_is_counted(broker_factory):
    """Liveness over affinity: a sender with its cap of checks unanswered does not hold up the group's other
    transactions while another producer could answer them; each such check says why it went elsewhere."""
    b = broker_factory(*LONG, "--transaction-timeout-ms", "1000", "--transaction-check-in-flight-max", "1")
    hung, other = Listener(answers=False), Listener()
    async with _producer(b, "other", other):
        sender = await _producer(b, "sender", hung).start()
        try:
            await sender.send_in_transaction(TOPIC, b"order 1")
            await hung.until_asked(1)               # the sender holds its one check slot, unanswered
            await sender.send_in_transaction(TOPIC, b"order 2")
            await other.until_asked(1)
        finally:
            hung.never.set()
            await sender.shutdown()
        assert hung.asked == [b"order 1"] and other.asked == [b"order 2"]
        assert await _metric(b, 'txmq_transaction_checks_rerouted_total', 'reason="sender-busy"') == 1



class Unknowing(Listener):
    """Answers every check UNKNOW: checked to the limit, its transactions are dead-lettered."""

    async def check_local_transaction(self, msg):
        await super().check_local_transaction(msg)
        return S.UNKNOW


@bounded(90)
async def test_a_resumed_dead_letter_is_asked_of_its_sender(broker_factory):
    """A dead-lettered transaction resumed by an operator (`admin resume`) was rebuilt from its half alone, which
    did not name its sender: its next check went to any producer of the group, counted "sender-unknown"."""
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "300",
                       "--transaction-check-max", "1")
    sender = Unknowing()
    async with _producer(b, "sender", sender) as producer:
        sent = await producer.send_in_transaction(TOPIC, b"order 1")
        await sender.until_asked(1)
        while True:         # unanswered past its one check: dead-lettered (no event says so but the admin view)
            listed = await request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 1})
            if json.loads(listed.body_bytes())["dead_lettered"]:
                break
            await asyncio.sleep(0.05)
        resumed = await request(b.broker, RequestCode.TXMQ_RESUME_TRANSACTION,
                                 {"commitLogOffset": decode_offset_msg_id(sent.send_result.offset_msg_id)[2]})
        assert resumed.code == ResponseCode.SUCCESS, resumed.remark
        await sender.until_asked(2)                 # asked again at once: resumed, it is due
        assert await _metric(b, "txmq_transaction_checks_total") == 2
        assert await _metric(b, "txmq_transaction_checks_rerouted_total") == 0


@bounded(60)
async def test_a_half_near_the_properties_limit_is_dead_lettered_with_its_senders_mark_left_off(broker_factory):
    """The sender's mark fits the half, but its dead letter adds TXMQ_REASON, TXMQ_HALF and
    TRANSACTION_CHECK_TIMES to the half's properties: with the mark past 32767 bytes it could not be encoded, and
    the transaction was retried (a traceback each interval) and never dead-lettered, where without the mark it
    was. The mark is left off a dead letter that has no room for it."""
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "300",
                       "--transaction-check-max", "1")
    changed = asyncio.Event()
    conn = await _raw(b, Checked(changed), "10.0.0.7@4242")
    try:
        made = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert made.code == ResponseCode.SUCCESS, made.remark
        sent_props = {Prop.TRAN_MSG: "true", Prop.PGROUP: GROUP, "fill": ""}
        stored = {**sent_props, Prop.CLUSTER: "DefaultCluster", Prop.REAL_TOPIC: TOPIC, Prop.REAL_QID: "0"}
        mark = len("\x02TXMQ_OWNER\x0110.0.0.7@4242")
        extras = len("\x02TXMQ_REASON\x01max-checks\x02TXMQ_HALF\x01999999999\x02TRANSACTION_CHECK_TIMES\x011")
        fill = 32767 - extras - len(properties_to_string(stored).encode())      # unmarked, its dead letter fits
        assert fill > 0 and mark < extras
        sent_props["fill"] = "y" * fill
        h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                     properties=properties_to_string(sent_props))
        sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False),
                                                          b"order 1"), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        viewed = await conn.request(RemotingCommand.request(RequestCode.VIEW_MESSAGE_BY_ID, {
            "offset": decode_offset_msg_id(sent.ext_fields["msgId"])[2]}), 5)
        half = decode_record(viewed.body_bytes())[0]
        assert half.properties["TXMQ_OWNER"] == "10.0.0.7@4242"      # the mark fitted the half
        while True:         # checked once, unanswered: dead-lettered (no event says so but the admin view)
            listed = await request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 1})
            if json.loads(listed.body_bytes())["dead_lettered"]:
                break
            assert "could not dead-letter" not in b.log() and "not dead-lettered" not in b.log(), b.log()[-2000:]
            await asyncio.sleep(0.05)
        assert "no dead letter copied" not in b.log()       # the dead letter is there, without the mark
    finally:
        conn.close()


@bounded(60)
async def test_the_senders_mark_reaches_neither_its_producers_check_nor_a_consumer(broker_factory):
    """The half names its sender (TXMQ_OWNER), which is the broker's: a check shows the producer the message it
    sent, and the committed message, delivered at once or after its delay level, carries the producer's
    properties as sent."""
    b = broker_factory(*LONG, "--transaction-timeout-ms", "300")
    seen: list[dict] = []

    class Seeing(Listener):
        async def check_local_transaction(self, msg):
            seen.append(dict(msg.properties))
            return await super().check_local_transaction(msg)

    class Committing(Seeing):
        def execute_local_transaction(self, msg, arg):
            return S.COMMIT_MESSAGE if arg == "now" else S.UNKNOW

    listener = Committing()
    async with _producer(b, "sender", listener) as producer:
        await producer.send_in_transaction(TOPIC, b"checked", properties={"k": "v"})
        # (a stock producer clears DELAY off a transactional message; a RocketMQ 5 timer it sends as it is)
        await producer.send_in_transaction(TOPIC, b"delayed", "now", properties={"k": "v", "TIMER_DELAY_MS": "300"})
        await listener.until_asked(1)
        consumer = PullConsumer(b.namesrv, "CG_marks")
        got: dict[bytes, dict] = {}
        try:
            while len(got) < 2:             # the delayed one comes after its timer
                for mq in await consumer.fetch_queues(TOPIC):
                    res = await consumer.pull(mq, 0, max_nums=64)
                    got.update((m.body, dict(m.properties)) for m in res.messages)
                await asyncio.sleep(0.05)
        finally:
            await consumer.shutdown()
    assert seen and all(P_OWNER not in props and props["k"] == "v" for props in seen), seen
    assert all(P_OWNER not in props and props["k"] == "v" for props in got.values()), got


@bounded(60)
async def test_a_half_whose_properties_leave_its_dead_letter_no_room_is_dead_lettered_all_the_same(broker_factory):
    """A half of 32767 bytes of properties is stored; its dead letter, with TXMQ_REASON, TXMQ_HALF and the check
    count added, could not be encoded (RecordError): the transaction was retried every interval and never
    dead-lettered (and an expiry raised out of retention's pass). It is dead-lettered by its op record alone."""
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "300",
                       "--transaction-check-max", "1")
    conn = await _raw(b, Checked(asyncio.Event()))      # no heartbeat: no mark, the half is full without it
    try:
        made = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert made.code == ResponseCode.SUCCESS, made.remark
        sent_props = {Prop.TRAN_MSG: "true", Prop.PGROUP: GROUP, "fill": ""}
        stored = {**sent_props, Prop.CLUSTER: "DefaultCluster", Prop.REAL_TOPIC: TOPIC, Prop.REAL_QID: "0"}
        sent_props["fill"] = "y" * (32767 - len(properties_to_string(stored).encode()))
        h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                     properties=properties_to_string(sent_props))
        sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False),
                                                          b"order 1"), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        while True:         # checked once, unanswered: dead-lettered (no event says so but the admin view)
            listed = await request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 1})
            if json.loads(listed.body_bytes())["dead_lettered"]:
                break
            assert "could not dead-letter" not in b.log() and "not dead-lettered" not in b.log(), b.log()[-2000:]
            await asyncio.sleep(0.05)
        assert json.loads(listed.body_bytes())["total"] == 0
        assert "no dead letter copied" in b.log()
    finally:
        conn.close()


async def _asked_of_its_sender_before_its_first_heartbeat(b, uniq: str, resume) -> None:
    """A stock Java producer's half sent before its first heartbeat (no TXMQ_OWNER on it; a sender record names
    it after), checked once, answered UNKNOW: dead-lettered; ``resume(b, offset)`` gets it checked again, which must ask
    its sender alone (a second producer of the group is there) and count no reroute. The sender answers UNKNOW: one
    that never answers is known silent, and its checks go to the others first."""
    changed = asyncio.Event()
    sender, other = Answering(changed), Checked(changed)
    conn = await _raw(b, sender)                    # no heartbeat yet: the half names no sender
    peer = await _raw(b, other, "10.0.0.9@other")
    try:
        made = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert made.code == ResponseCode.SUCCESS, made.remark
        h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                     properties=properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: GROUP,
                                                                      Prop.UNIQ_KEY: uniq}))
        sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False),
                                                          b"order 1"), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        offset = decode_offset_msg_id(sent.ext_fields["msgId"])[2]
        await _beat(conn, "10.0.0.7@sender")        # named now: its sender record is written before the answer
        while len(sender.asked) + len(other.asked) < 1:
            changed.clear()
            await changed.wait()
        assert sender.asked == [str(offset)] and other.asked == []     # its sender, as the record named it
        await resume(b, offset)
        while len(sender.asked) + len(other.asked) < 2:     # asked again at once: resumed, it is due
            changed.clear()
            await changed.wait()
        assert sender.asked == [str(offset)] * 2 and other.asked == []
        assert await _metric(b, "txmq_transaction_checks_rerouted_total") == 0
        assert _owners(await _list(b)) == {"10.0.0.7@sender"}
    finally:
        conn.close()
        peer.close()


@bounded(90)
async def test_a_resumed_dead_letter_sent_before_its_first_heartbeat_is_asked_of_its_sender(broker_factory):
    """A stock Java producer sends its first halves before its first heartbeat: the half carries no TXMQ_OWNER,
    its sender is named after (a sender record). Dead-lettered and resumed by an operator, the transaction was
    rebuilt from its half alone: its checks went to the group's producers in turn ("sender-unknown"), another
    instance asked about a transaction it never began. The dead letter keeps the sender, and the resume finds it."""
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "300",
                       "--transaction-check-max", "1")

    async def resume(b, offset):
        while True:         # unanswered past its one check: dead-lettered (no event says so but the admin view)
            listed = await request(b.broker, RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 1})
            if json.loads(listed.body_bytes())["dead_lettered"]:
                break
            await asyncio.sleep(0.05)
        resumed = await request(b.broker, RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": offset})
        assert resumed.code == ResponseCode.SUCCESS, resumed.remark
    await _asked_of_its_sender_before_its_first_heartbeat(b, "C0A80001000012345678", resume)


@bounded(90)
async def test_a_stock_admins_resume_of_a_dead_letter_keeps_its_sender_with_the_message_index_off(broker_factory):
    """RESUME_CHECK_HALF_MESSAGE (323) names the dead letter itself, and the dead letter names the sender: the
    resume looked the dead letter up again through the message index, so with --message-index-enable false a
    stock producer's half sent before its first heartbeat came back sender-unknown, its checks asked the group's
    producers in turn (another instance asked about a transaction it never began)."""
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "300",
                       "--transaction-check-max", "1", "--message-index-enable", "false")

    async def resume(b, offset):
        consumer = PullConsumer(b.namesrv, "CG_dead_owner")
        try:
            dead = []
            while not dead:     # unanswered past its one check: dead-lettered
                for mq in await consumer.fetch_queues("TRANS_CHECK_MAX_TIME_TOPIC"):
                    dead += (await consumer.pull(mq, 0)).messages
                if not dead:
                    await asyncio.sleep(0.05)
        finally:
            await consumer.shutdown()
        assert dead[0].properties[P_OWNER] == "10.0.0.7@sender"
        resumed = await request(b.broker, RequestCode.RESUME_CHECK_HALF_MESSAGE, {"msgId": dead[0].offset_msg_id})
        assert resumed.code == ResponseCode.SUCCESS, resumed.remark
    await _asked_of_its_sender_before_its_first_heartbeat(b, "C0A80001000012345679", resume)


@bounded(90)
async def test_producers_that_leave_checks_unanswered_are_asked_only_when_no_other_has_room(broker_factory):
    """Three of a group's four producers hung with their connections open (never answering a check): round-robin
    asked them as often as the one that answers, each check they took waiting a (doubled) interval before
    another producer was asked; 20 transactions took ~60 checks of the hung ones (25 of 50 hung: the last
    decided after 46 s). A producer that left a check unanswered is now passed over while another has room:
    past the first round, a hung one takes a check only before its own first unanswered one comes due."""
    n = 20
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "1500",
                       "--transaction-check-max", "1000")
    changed = asyncio.Event()
    hung = [Checked(changed) for _ in range(3)]
    conns = [await _raw(b, handler, f"127.0.0.1@hung-{i}") for i, handler in enumerate(hung)]
    good = Listener(changed=changed)
    try:
        async with _producer(b, "good", good):
            sender = await _producer(b, "sender", Listener()).start()
            for i in range(n):
                await sender.send_in_transaction(TOPIC, b"order %d" % i)
            await _die(sender)                      # its transactions are asked of the group's other producers
            while len(set(good.asked)) < n:
                changed.clear()
                await changed.wait()
            assert sorted(set(good.asked)) == sorted(b"order %d" % i for i in range(n))
            asked_hung = sum(len(h.asked) for h in hung)
            # the first round: 3 of every 4 to a hung producer; then each at most one more before it is known silent
            assert asked_hung <= n + len(hung), asked_hung
            assert await _metric(b, "txmq_transaction_producers_silent_total") == len(hung)
            said = [line for line in b.log().splitlines() if "left a transaction check unanswered" in line]
            assert sorted(line.split()[line.split().index("producer") + 1] for line in said) == \
                [f"127.0.0.1@hung-{i}" for i in range(3)], said
    finally:
        for conn in conns:
            conn.close()


class Answering(Checked):
    """A raw producer connection that answers its checks UNKNOW, oneway with fromTransactionCheck as a stock Java
    producer does: at once, or (``late``) only when ``answer_held`` is called."""

    def __init__(self, changed: asyncio.Event, late: bool = False):
        super().__init__(changed)
        self.late = late
        self.held: list[tuple[object, dict]] = []

    def __call__(self, conn, cmd):
        if cmd.code == RequestCode.CHECK_TRANSACTION_STATE:
            self.held.append((conn, dict(cmd.ext_fields)))
            if not self.late:
                self.answer_held()
        return super().__call__(conn, cmd)

    def answer_held(self) -> None:
        for conn, fields in self.held:
            conn.oneway(RemotingCommand.request(RequestCode.END_TRANSACTION, {
                "producerGroup": GROUP, "tranStateTableOffset": fields["tranStateTableOffset"],
                "commitLogOffset": fields["commitLogOffset"], "commitOrRollback": "0",
                "fromTransactionCheck": "true", "msgId": fields["msgId"],
                "transactionId": fields.get("transactionId", "")}))
        self.held.clear()


@bounded(90)
async def test_a_slow_producer_that_answers_its_checks_late_is_asked_in_turn_again(broker_factory):
    """A producer that answered its checks after they came due again (slow, not hung): its late answers came while
    the transactions' checks were with another producer, and the core cleared that one's silence instead of the
    slow one's: the slow producer, answering, stayed passed over for good (and was never named silent again)."""
    n = 4
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "1500",
                       "--transaction-check-max", "1000")
    changed = asyncio.Event()
    slow = Answering(changed, late=True)
    conns = [await _raw(b, slow, "127.0.0.1@slow")]
    try:
        sender = await _producer(b, "sender", Listener()).start()
        for i in range(n):
            await sender.send_in_transaction(TOPIC, b"order %d" % i)
        await _die(sender)                          # its transactions are asked of the slow producer alone
        while len(slow.asked) < n:
            changed.clear()
            await changed.wait()
        good = Answering(changed)
        conns.append(await _raw(b, good, "127.0.0.1@good"))
        while len(good.asked) < n:                  # due again unanswered: asked of the producer that answers
            changed.clear()
            await changed.wait()
        assert await _metric(b, "txmq_transaction_producers_silent_total") == 1
        slow.late = False
        slow.answer_held()                          # late, but answered: it is asked in turn again
        before, rounds = len(slow.asked), len(good.asked) + 4 * n
        while len(slow.asked) == before and len(good.asked) < rounds:
            changed.clear()
            await changed.wait()
        assert len(slow.asked) > before, (len(good.asked), len(slow.asked))
    finally:
        for conn in conns:
            conn.close()


@bounded(90)
async def test_a_sender_known_silent_is_not_asked_first_about_its_new_transactions(broker_factory):
    """A sender hung with its connection open (its check listener waiting on a database that is down) left a check
    unanswered: it is known silent. Each transaction it sent afterwards still had its first check sent to it, and
    waited a doubled interval unanswered before the group's producer that answers was asked. The sender is now
    asked first only while it answers: known silent, a new transaction's first check goes to one that answers."""
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "1000",
                       "--transaction-check-max", "1000")
    hung, other = Listener(answers=False), Listener()
    async with _producer(b, "other", other):
        sender = await _producer(b, "sender", hung).start()
        try:
            await sender.send_in_transaction(TOPIC, b"order 1")
            await hung.until_asked(1)               # the first check goes to the sender, which never answers
            await other.until_asked(1)              # due again unanswered: the sender is known silent
            assert await _metric(b, "txmq_transaction_producers_silent_total") == 1
            await sender.send_in_transaction(TOPIC, b"order 2")
            await other.until_asked(2)
        finally:
            hung.never.set()
            await sender.shutdown()
        assert hung.asked == [b"order 1"], hung.asked
        assert other.asked == [b"order 1", b"order 2"], other.asked
        assert await _metric(b, "txmq_transaction_checks_rerouted_total", 'reason="sender-silent"') == 1



async def _send_half(conn, body: bytes) -> str:
    """A half of GROUP sent on the raw connection ``conn``: its commit-log offset, as a check names it."""
    h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                 properties=properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: GROUP}))
    sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False), body), 5)
    assert sent.code == ResponseCode.SUCCESS, sent.remark
    return str(decode_offset_msg_id(sent.ext_fields["msgId"])[2])


@bounded(90)
async def test_a_silent_sender_is_asked_first_when_every_other_producer_is_silent_too(broker_factory):
    """A sender known silent is passed over for a producer that answers. When every other producer of the group is
    silent too, a new transaction's first check went to any of them in turn: another hung instance asked about a
    transaction it never began, where before the sender itself was asked (the one that knows it, if it ever
    answers). With nobody answering, the sender is asked first, as it was."""
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "1000",
                       "--transaction-check-max", "1000")
    changed = asyncio.Event()
    sender, other = Checked(changed), Checked(changed)      # both hung: they record their checks, never answer
    conn = await _raw(b, sender, "10.0.0.7@sender")
    peer = await _raw(b, other, "10.0.0.9@other")
    try:
        made = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert made.code == ResponseCode.SUCCESS, made.remark
        await _send_half(conn, b"order 1")
        while len(sender.asked) + len(other.asked) < 3:     # the sender, then the other, then due again there
            changed.clear()
            await changed.wait()
        assert len(sender.asked) >= 1 and len(other.asked) >= 1, (sender.asked, other.asked)
        assert await _metric(b, "txmq_transaction_producers_silent_total") == 2     # both known silent
        firsts = []
        for i in range(2, 6):
            offset = await _send_half(conn, b"order %d" % i)
            while offset not in sender.asked and offset not in other.asked:
                changed.clear()
                await changed.wait()
            firsts.append("sender" if offset in sender.asked else "other")
        assert firsts == ["sender"] * 4, firsts
    finally:
        conn.close()
        peer.close()
