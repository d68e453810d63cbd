"""A misbehaving producer must not take other producers' transaction checks or decisions.

Raw connections play the producers (hand-made heartbeats and END_TRANSACTION answers), so the test chooses
each one's client id and answer; every wait is for an event (a check arriving, a reply), bounded by the
test's deadline.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from protocol.codes import RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import Prop, SendMessageRequestHeader, decode_offset_msg_id, decode_record, properties_to_string
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

TOPIC = "HostileChecks"
GROUP = "PG_hostile"
COMMIT, ROLLBACK, UNKNOWN = 8, 12, 0
CHECK_MAX = 6


def _heartbeat(client_id: str) -> RemotingCommand:
    body = {"clientID": client_id, "producerDataSet": [{"groupName": GROUP}], "consumerDataSet": []}
    return RemotingCommand.request(RequestCode.HEART_BEAT, None, json.dumps(body).encode())


class Answering:
    """A producer connection's handler: answers every check it is sent with ``state``, once ``ready`` is set."""

    def __init__(self, state: int, ready: asyncio.Event | None = None):
        self.state = state
        self.ready = ready
        self.asked = 0
        self.changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def __call__(self, conn, cmd):
        if cmd.code != RequestCode.CHECK_TRANSACTION_STATE:
            return None
        self.asked += 1
        self.changed.set()
        task = asyncio.get_running_loop().create_task(self._answer(conn, dict(cmd.ext_fields)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return None

    async def _answer(self, conn, fields: dict) -> None:
        if self.ready is not None:
            await self.ready.wait()
        conn.oneway(RemotingCommand.request(RequestCode.END_TRANSACTION, {
            "producerGroup": GROUP, "tranStateTableOffset": fields["tranStateTableOffset"],
            "commitLogOffset": fields["commitLogOffset"], "commitOrRollback": str(self.state),
            "fromTransactionCheck": "true", "msgId": fields["msgId"]}))


async def _until(*conditions) -> None:
    """Until one of ``conditions`` ((handler, predicate) pairs) holds, woken by the handlers' checks."""
    while not any(pred(h) for h, pred in conditions):
        waits = [asyncio.ensure_future(h.changed.wait()) for h, _ in conditions]
        for h, _ in conditions:
            h.changed.clear()
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()


@bounded(90)
async def test_a_producer_reusing_the_senders_client_id_does_not_take_every_check_of_its_halves(broker_factory):
    """The sender's connection closed and it came back on a new one; meanwhile another live producer had
    registered under the same client id (a second container whose process id is 1 too, or a hostile one).
    Checks went to the first of them to register, every time: it answered UNKNOWN (it never began the
    transaction), which kept it "the sender", and the transaction was checked to its limit and dead-lettered
    while the instance that had committed it was never asked. Now each producer claiming the sender's id is
    asked in turn, and the transaction is committed."""
    b = broker_factory("--transaction-check-interval-ms", "500", "--transaction-timeout-ms", "1000",
                       "--transaction-check-max", str(CHECK_MAX))
    host, _, port = b.broker.rpartition(":")
    same_id = "10.0.0.7@1"
    registered = asyncio.Event()        # the real sender is back: only then does the hostile one answer
    hostile_answers, real_answers = Answering(UNKNOWN, registered), Answering(COMMIT)
    sender = await open_connection(host, int(port))
    hostile = await open_connection(host, int(port), hostile_answers)
    real = None
    try:
        created = await sender.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert created.code == ResponseCode.SUCCESS, created.remark
        assert (await sender.request(_heartbeat(same_id), 5)).code == ResponseCode.SUCCESS
        h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                     properties=properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: GROUP}))
        sent = await sender.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False),
                                                            b"order 1"), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        sender.close()                  # its process restarts ...
        assert (await hostile.request(_heartbeat(same_id), 5)).code == ResponseCode.SUCCESS
        real = await open_connection(host, int(port), real_answers)      # ... and is back, under its id
        assert (await real.request(_heartbeat(same_id), 5)).code == ResponseCode.SUCCESS
        registered.set()
        await _until((real_answers, lambda a: a.asked >= 1), (hostile_answers, lambda a: a.asked >= CHECK_MAX))
        assert real_answers.asked >= 1, \
            f"the hostile producer was asked all {hostile_answers.asked} checks; the sender none\n{b.log()}"
        pulled = await real.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "CG_reader", "topic": TOPIC, "queueId": 0, "queueOffset": 0, "maxMsgNums": 1,
            "sysFlag": 2 | 4, "commitOffset": 0, "suspendTimeoutMillis": 20000, "subscription": "*",
            "subVersion": 0, "expressionType": "TAG"}), 25)       # long-polls until the commit is stored
        assert pulled.code == ResponseCode.SUCCESS, pulled.remark
    finally:
        for conn in (sender, hostile, real):
            if conn is not None:
                conn.close()


async def _send(conn, body: bytes, transactional: bool = True):
    props = {Prop.PGROUP: GROUP, **({Prop.TRAN_MSG: "true"} if transactional else {})}
    h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, properties=properties_to_string(props),
                                 sys_flag=SysFlag.TRANSACTION_PREPARED if transactional else 0)
    sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False), body), 5)
    assert sent.code == ResponseCode.SUCCESS, sent.remark
    return decode_offset_msg_id(sent.ext_fields["msgId"])[2], int(sent.ext_fields["queueOffset"])


async def _end(conn, offset, table_offset, state: int = COMMIT, group: str = GROUP, from_check: bool = False):
    reply = await conn.request(RemotingCommand.request(RequestCode.END_TRANSACTION, {
        "producerGroup": group, "tranStateTableOffset": str(table_offset), "commitLogOffset": str(offset),
        "commitOrRollback": str(state), "fromTransactionCheck": str(from_check).lower(), "msgId": "not-its-id"}), 5)
    return reply.code, reply.remark


@bounded(60)
async def test_an_end_naming_no_half_is_refused_decides_nothing_and_is_counted(broker_factory):
    """An END whose commitLogOffset is not a half's (a normal message's, a committed message's, an op record's,
    past the log's end, negative, inside a half) is refused as RocketMQ refuses it, and decides nothing. It was
    only logged: a stock client sends END oneway and is never answered, so a producer ending transactions it
    cannot have (its decisions lost) showed on no dashboard. Now counted,
    txmq_requests_refused_total{reason="end-no-half"}."""
    b = broker_factory()
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        created = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert created.code == ResponseCode.SUCCESS, created.remark
        committed, committed_q = await _send(conn, b"committed")
        pending, pending_q = await _send(conn, b"pending")
        normal, _ = await _send(conn, b"normal", transactional=False)
        assert (await _end(conn, committed, committed_q))[0] == ResponseCode.SUCCESS
        stored = await conn.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": TOPIC,
                                                                                         "queueId": 0}), 5)
        assert stored.ext_fields["offset"] == "2"            # the normal message and the committed one
        no_half = "Find prepared transaction message failed"
        for offset in (normal, pending + 1, 1 << 40, -1):
            assert await _end(conn, offset, pending_q) == (ResponseCode.SYSTEM_ERROR, no_half), offset
        # the right half named with another's table offset, or by another group: not its half
        assert await _end(conn, pending, committed_q) == (ResponseCode.SYSTEM_ERROR,
                                                          "The transaction state table offset wrong")
        assert await _end(conn, pending, pending_q, group="PG_other", from_check=True) == (
            ResponseCode.SYSTEM_ERROR, "The producer group wrong")
        listed = await conn.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, None), 5)
        assert [row["commit_log_offset"] for row in json.loads(listed.body_bytes())["pending"]] == [pending]
        stored = await conn.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": TOPIC,
                                                                                         "queueId": 0}), 5)
        assert stored.ext_fields["offset"] == "2"            # nothing more was committed
    finally:
        conn.close()
    import urllib.request
    scraped = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode())
    assert 'txmq_requests_refused_total{reason="end-no-half"} 4.0' in scraped
    assert 'txmq_requests_refused_total{reason="end-not-its-half"} 2.0' in scraped


@bounded(60)
async def test_ends_a_client_repeats_at_will_are_counted_and_logged_at_most_every_10_s(broker_factory):
    """Oneway ENDs of a made-up commitOrRollback, or rolling back a committed half again and again, wrote a WARNING
    of ~400 bytes each (2,000 ENDs: 2,000 lines) and the first were counted nowhere: a client could fill the
    broker's disk with its log. Now each kind is said at most every 10 s, and each END counted."""
    b = broker_factory()
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    repeats = 300
    try:
        created = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert created.code == ResponseCode.SUCCESS, created.remark
        committed, committed_q = await _send(conn, b"committed")
        assert (await _end(conn, committed, committed_q))[0] == ResponseCode.SUCCESS
        for state in (ROLLBACK, 5) * repeats:
            conn.oneway(RemotingCommand.request(RequestCode.END_TRANSACTION, {
                "producerGroup": GROUP, "tranStateTableOffset": str(committed_q), "commitLogOffset": str(committed),
                "commitOrRollback": str(state), "fromTransactionCheck": "false"}, oneway=True))
        # answered after every oneway END before it on this connection (each is handled at once, in order)
        code, remark = await _end(conn, committed, committed_q, state=5)
        assert code == ResponseCode.SYSTEM_ERROR and "commitOrRollback=5" in remark, remark
        stored = await conn.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": TOPIC,
                                                                                         "queueId": 0}), 5)
        assert stored.ext_fields["offset"] == "1"            # the commit, once: nothing rolled back
    finally:
        conn.close()
    import urllib.request
    scraped = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode())
    assert f'txmq_requests_refused_total{{reason="end-bad-state"}} {repeats + 1}.0' in scraped
    assert f'txmq_conflicting_decisions_total{{producer_group="{GROUP}"}} {repeats}.0' in scraped
    log = b.log_path.read_text(errors="replace")
    # one line each kind, or two if the run took longer than 10 s on a loaded machine
    assert 1 <= log.count("END_TRANSACTION refused: commitOrRollback=") <= 2, log[-3000:]
    assert 1 <= log.count("END_TRANSACTION refused: transaction already COMMIT") <= 2, log[-3000:]


@bounded(60)
async def test_ends_whose_fields_are_not_numbers_are_logged_at_most_every_10_s(broker_factory):
    """The second path of the END flood: a commitOrRollback (or an offset) that is not a number is refused before
    the END is read, by the connection's header check, which logged each at INFO (the broker's level): 300 oneway
    ENDs, 300 lines, as many as a client cares to send."""
    b = broker_factory()
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    repeats = 300
    try:
        for n in range(repeats):
            conn.oneway(RemotingCommand.request(RequestCode.END_TRANSACTION, {
                "producerGroup": GROUP, "tranStateTableOffset": "1", "commitLogOffset": "x" if n % 2 else "1",
                "commitOrRollback": "COMMIT", "fromTransactionCheck": "false"}, oneway=True))
        code, remark = await _end(conn, "y", 0)     # answered after every oneway END before it
        assert code != ResponseCode.SUCCESS and "commitLogOffset" in remark, remark
    finally:
        conn.close()
    log = b.log_path.read_text(errors="replace")
    # one line, or two if the run took longer than 10 s on a loaded machine
    assert 1 <= log.count("END_TRANSACTION from ") <= 2, log[-3000:]
    # a commitOrRollback of COMMIT is as made up as 5 (README: not 0, 8 or 12), where the offsets before it are
    # numbers
    import urllib.request
    scraped = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5).read().decode())
    assert f'txmq_requests_refused_total{{reason="end-bad-state"}} {repeats // 2}.0' in scraped


class PerGroup:
    """One connection's handler for a process with producers of two groups: checks of ``hung`` are never
    answered (its listener is stuck), the others are committed."""

    def __init__(self, hung: str):
        self.hung = hung
        self.asked: dict[str, int] = {}
        self.changed = asyncio.Event()

    def __call__(self, conn, cmd):
        if cmd.code != RequestCode.CHECK_TRANSACTION_STATE:
            return None
        group = decode_record(cmd.body)[0].properties[Prop.PGROUP]
        self.asked[group] = self.asked.get(group, 0) + 1
        self.changed.set()
        if group != self.hung:
            conn.oneway(RemotingCommand.request(RequestCode.END_TRANSACTION, {
                "producerGroup": group, "tranStateTableOffset": cmd.ext_fields["tranStateTableOffset"],
                "commitLogOffset": cmd.ext_fields["commitLogOffset"], "commitOrRollback": str(COMMIT),
                "fromTransactionCheck": "true", "msgId": cmd.ext_fields["msgId"]}))
        return None


@bounded(90)
async def test_one_groups_unanswered_checks_do_not_starve_another_group_on_the_same_connection(broker_factory):
    """A Java process shares one connection between its producers, and each producer queues its own checks
    (checkRequestHoldMax, 2000 a producer). The cap of unanswered checks was the connection's: a group whose
    listener hung held all of it, and another group's transactions on that connection waited for a slot
    for ever (each time the hung group's checks came due again they took the slots back first), never
    checked, never dead-lettered, counted nowhere. The cap is now a connection's per producer group."""
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "1000",
                       "--transaction-check-in-flight-max", "1", "--transaction-check-max", "1000")
    host, _, port = b.broker.rpartition(":")
    handler = PerGroup(hung="PG_stuck")
    conn = await open_connection(host, int(port), handler)
    try:
        created = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert created.code == ResponseCode.SUCCESS, created.remark
        body = {"clientID": "10.0.0.8@app", "consumerDataSet": [],
                "producerDataSet": [{"groupName": "PG_stuck"}, {"groupName": GROUP}]}
        beat = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, None, json.dumps(body).encode()), 5)
        assert beat.code == ResponseCode.SUCCESS, beat.remark
        for group in ("PG_stuck", GROUP):       # the stuck group's half first: it is due first
            h = SendMessageRequestHeader(group, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                         properties=properties_to_string({Prop.TRAN_MSG: "true",
                                                                          Prop.PGROUP: group}))
            sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False),
                                                              group.encode()), 5)
            assert sent.code == ResponseCode.SUCCESS, sent.remark
        # the stuck group asked again and again (its check lost each time it comes due): the other had its turns
        while not handler.asked.get(GROUP) and handler.asked.get("PG_stuck", 0) < 4:
            handler.changed.clear()
            await handler.changed.wait()
        assert handler.asked.get(GROUP), f"{GROUP} was never checked: {handler.asked}\n{b.log()}"
    finally:
        conn.close()


@bounded(90)
async def test_the_sender_back_under_its_id_is_asked_even_when_more_producers_claim_it_than_checks_remain(
        broker_factory):
    """Several producers registered under the sender's client id before its connection closed (containers
    sharing an address with a process id of 1, or hostile ones), then the sender came back on a new connection:
    the newest registration of the id. Asked in the order they registered, one a check, the ones registered
    first took every check left (each answering UNKNOWN) and the transaction was dead-lettered before the
    sender's turn came. The newest claimant is asked first, then the others in turn."""
    b = broker_factory("--transaction-check-interval-ms", "300", "--transaction-timeout-ms", "3000",
                       "--transaction-check-max", "3")
    host, _, port = b.broker.rpartition(":")
    same_id = "10.0.0.9@1"
    hostile = [Answering(UNKNOWN) for _ in range(3)]
    real_answers = Answering(COMMIT)
    conns = []
    try:
        sender = await open_connection(host, int(port))
        conns.append(sender)
        created = await sender.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": TOPIC, "readQueueNums": 1, "writeQueueNums": 1, "perm": 6}), 5)
        assert created.code == ResponseCode.SUCCESS, created.remark
        assert (await sender.request(_heartbeat(same_id), 5)).code == ResponseCode.SUCCESS
        await _send(sender, b"order 2")
        # within the half's immunity (3 s): the claimants register, the sender restarts and is back, last
        for handler in (*hostile, real_answers):
            conn = await open_connection(host, int(port), handler)
            conns.append(conn)
            assert (await conn.request(_heartbeat(same_id), 5)).code == ResponseCode.SUCCESS
            if handler is hostile[-1]:
                sender.close()
        await _until((real_answers, lambda a: a.asked >= 1),
                     *((h, lambda _a: sum(x.asked for x in hostile) >= 3) for h in hostile))
        assert real_answers.asked >= 1, \
            f"the other claimants were asked {[h.asked for h in hostile]}; the sender none\n{b.log()}"
        pulled = await conns[-1].request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "CG_reader", "topic": TOPIC, "queueId": 0, "queueOffset": 0, "maxMsgNums": 1,
            "sysFlag": 2 | 4, "commitOffset": 0, "suspendTimeoutMillis": 20000, "subscription": "*",
            "subVersion": 0, "expressionType": "TAG"}), 25)       # long-polls until the commit is stored
        assert pulled.code == ResponseCode.SUCCESS, pulled.remark
    finally:
        for conn in conns:
            conn.close()
