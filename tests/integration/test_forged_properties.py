"""Whole property keys (and the sysFlag bits that go with them) a client can forge, sent as a stock client would.

A RocketMQ client sends properties as free text and a sysFlag of its choosing; the broker reads several of them
back from the stored record (TRAN_MSG, DELAY, REAL_TOPIC, PGROUP, ...). These tests send the combinations a
careless or hostile client can, and hold the broker to an answer that is either what was asked or a refusal:
never SEND_OK for a message no consumer can ever read.
"""
from __future__ import annotations

import contextlib
import time

import pytest

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import decode_offset_msg_id, decode_records
from tests.support.bounded import bounded
from tests.support.delays import FAST

pytestmark = pytest.mark.asyncio

PREPARED, COMMIT, ROLLBACK = 0x4, 0x8, 0xC


def _hostport(addr):
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _send(topic: str, properties: str, body: bytes, sys_flag: int = 0, reconsume: int = 0,
          code: int = RequestCode.SEND_MESSAGE_V2) -> RemotingCommand:
    return RemotingCommand.request(code, {
        "a": "PG_forge", "b": topic, "c": "TBW102", "d": 4, "e": 0, "f": sys_flag, "g": int(time.time() * 1000),
        "h": 0, "i": properties, "j": reconsume}, body)


@contextlib.asynccontextmanager
async def _connected(broker):
    """A connection to the broker, closed when the test is done with it."""
    conn = await open_connection(*_hostport(broker.broker))
    try:
        yield conn
    finally:
        conn.close()


async def _commit(conn, half) -> RemotingCommand:
    """The producer's END_TRANSACTION committing `half` (its SEND answer), as a stock client sends it."""
    return await conn.request(RemotingCommand.request(RequestCode.END_TRANSACTION, {
        "producerGroup": "PG_forge", "tranStateTableOffset": half.ext_fields["queueOffset"],
        "commitLogOffset": decode_offset_msg_id(half.ext_fields["msgId"])[2], "commitOrRollback": COMMIT,
        "fromTransactionCheck": "false", "msgId": half.ext_fields["msgId"]}), 5)


async def _max_offset(conn, topic: str, qid: int = 0) -> int:
    reply = await conn.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": topic, "queueId": qid}), 5)
    return int(reply.ext_fields.get("offset", 0)) if reply.code == ResponseCode.SUCCESS else 0


async def _pull(conn, group: str, topic: str, qid: int = 0):
    reply = await conn.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
        "consumerGroup": group, "topic": topic, "queueId": qid, "queueOffset": 0, "maxMsgNums": 8,
        "sysFlag": 4, "commitOffset": 0, "suspendTimeoutMillis": 0, "subscription": "*", "subVersion": 0}), 5)
    return decode_records(reply.body_bytes()) if reply.code == ResponseCode.SUCCESS else []


@bounded(30)
async def test_a_plain_send_typed_as_a_transaction_record_is_refused(broker):
    """A SEND whose sysFlag says PREPARED (or ROLLBACK) but whose TRAN_MSG is not true is no half: it was stored on
    its topic as it came, answered SEND_OK, and given no consume-queue unit (as RocketMQ gives none to those
    types) -- a message acknowledged that no consumer could ever pull. One typed COMMIT passed for a committed
    transaction's message (prepared offset 0: the store's first half, when start-up replays it after a crash
    and it repeats that half's UNIQ_KEY and body). A reply's stored copy the same. Now refused, saying why."""
    async with _connected(broker) as conn:
        for flag in (PREPARED, COMMIT, ROLLBACK):
            reply = await conn.request(_send("ReplyTyped", "UNIQ_KEY\x01r1", b"typed", sys_flag=flag,
                                             code=RequestCode.SEND_REPLY_MESSAGE_V2), 5)
            assert reply.code == ResponseCode.MESSAGE_ILLEGAL, (flag, reply.code, reply.remark)
            for props in ("UNIQ_KEY\x01p1", "UNIQ_KEY\x01p2\x02TRAN_MSG\x01false"):
                reply = await conn.request(_send("ForgedType", props, b"typed", sys_flag=flag), 5)
                assert reply.code == ResponseCode.MESSAGE_ILLEGAL, (flag, props, reply.code, reply.remark)
                assert "sysFlag" in reply.remark and "TRAN_MSG" in reply.remark, reply.remark
        assert await _max_offset(conn, "ReplyTyped") == 0
        ok = await conn.request(_send("ForgedType", "UNIQ_KEY\x01p3", b"plain"), 5)
        assert ok.code == ResponseCode.SUCCESS, ok.remark
        assert [m.body for m in await _pull(conn, "CG_forge", "ForgedType")] == [b"plain"]


async def _pull_waiting(conn, group: str, topic: str, qid: int = 0):
    """The queue's messages, the broker holding the pull (long polling) until one arrives: awaited, not polled."""
    reply = await conn.request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
        "consumerGroup": group, "topic": topic, "queueId": qid, "queueOffset": 0, "maxMsgNums": 8,
        "sysFlag": 4 | 2, "commitOffset": 0, "suspendTimeoutMillis": 15000, "subscription": "*", "subVersion": 0}), 20)
    return decode_records(reply.body_bytes()) if reply.code == ResponseCode.SUCCESS else []


# What a consumer before RocketMQ 4.6.1 sends when CONSUMER_SEND_MSG_BACK fails: the failed message to its group's
# %RETRY% topic with every property it had -- a committed transaction's TRAN_MSG=true and PGROUP among them, so its
# producer also types it PREPARED -- a reconsume count and a delay level. RocketMQ stores it as a plain retry.
_OLD_FALLBACK = "TRAN_MSG\x01true\x02PGROUP\x01PG_orig\x02UNIQ_KEY\x01{}\x02DELAY\x01{}"


@bounded(40)
async def test_an_old_clients_fallback_retry_of_a_transactional_message_is_delivered(broker_factory):
    """A fallback retry typed PREPARED was stored PREPARED: the delay it asked for skipped (only NOT and COMMIT
    types wait) and no consume-queue unit given -- SEND_OK, and the retry was never consumed again."""
    broker = broker_factory(*FAST)
    async with _connected(broker) as conn:
        for flag in (0, PREPARED):
            topic = f"%RETRY%CG_old{flag}"
            reply = await conn.request(_send(topic, _OLD_FALLBACK.format(f"r{flag}", 1), b"again", sys_flag=flag,
                                             reconsume=1), 5)
            assert reply.code == ResponseCode.SUCCESS, (flag, reply.code, reply.remark)
            [msg] = await _pull_waiting(conn, f"CG_old{flag}", topic)      # after delay level 1 (100 ms here)
            assert (msg.body, msg.properties["UNIQ_KEY"], msg.sys_flag & 0xC) == (b"again", f"r{flag}", 0)
            # a plain retry, as a send-back's copy and a 4.6.1+ client's fallback (which clears it): kept, the
            # retry redriven with its properties through a stock producer (typed PREPARED by it) was a half
            assert "TRAN_MSG" not in msg.properties, msg.properties
        assert await _max_offset(conn, "RMQ_SYS_TRANS_HALF_TOPIC") == 0


@bounded(30)
async def test_an_old_clients_fallback_retry_out_of_retries_is_a_dead_letter_not_a_half(broker):
    """Out of retries, the broker set the retry's DELAY to 0 for its dead letter and then judged TRAN_MSG by that:
    no delay, so a half -- for %RETRY%<group>, not the dead-letter topic. Sent by a producer of another group
    than the message's PGROUP it was refused (MESSAGE_ILLEGAL, the failed message in no dead-letter queue); of
    the same group it became a transaction the broker checked with producers that never began it."""
    async with _connected(broker) as conn:
        for flag in (0, PREPARED):
            for i, props in enumerate((_OLD_FALLBACK, _OLD_FALLBACK.replace("PG_orig", "PG_forge"))):
                group = f"CG_dead{flag}{i}"
                reply = await conn.request(_send(f"%RETRY%{group}", props.format(f"d{flag}{i}", 19), b"last",
                                                 sys_flag=flag, reconsume=16), 5)
                assert reply.code == ResponseCode.SUCCESS, (flag, i, reply.code, reply.remark)
                [msg] = await _pull(conn, group, f"%DLQ%{group}")
                assert (msg.body, msg.properties["UNIQ_KEY"], msg.sys_flag & 0xC) == (b"last", f"d{flag}{i}", 0)
                assert "TRAN_MSG" not in msg.properties, msg.properties     # a redrive of it: no half
        assert await _max_offset(conn, "RMQ_SYS_TRANS_HALF_TOPIC") == 0


@bounded(30)
async def test_a_send_back_cannot_copy_an_undecided_half_or_a_waiting_message_to_consumers(broker):
    """CONSUMER_SEND_MSG_BACK copies whatever record its offset names into %RETRY%<group>. Named a half (the
    producer's SEND_OK gives its offset), the copy -- TRAN_MSG, REAL_TOPIC and all -- was delivered to the group
    before the transaction was decided, and stayed delivered when it was rolled back; named a message still
    waiting in SCHEDULE_TOPIC_XXXX, it was delivered hours early. Refused now, naming the record's topic; a
    message of an ordinary topic is handed back as ever."""
    async with _connected(broker) as conn:
        async def back(offset):
            return await conn.request(RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
                "offset": offset, "group": "CG_peek", "delayLevel": 0, "originMsgId": "",
                "maxReconsumeTimes": 16}), 5)

        half = await conn.request(_send("PeekTx", "TRAN_MSG\x01true\x02PGROUP\x01PG_forge\x02UNIQ_KEY\x01h1",
                                        b"undecided"), 5)
        waiting = await conn.request(_send("PeekLater", "UNIQ_KEY\x01w1\x02DELAY\x0118", b"in two hours"), 5)
        plain = await conn.request(_send("PeekPlain", "UNIQ_KEY\x01p1", b"failed"), 5)
        offsets = []
        for sent in (half, waiting, plain):
            assert sent.code == ResponseCode.SUCCESS, sent.remark
            offsets.append(decode_offset_msg_id(sent.ext_fields["msgId"])[2])
        for offset, topic in zip(offsets, ("RMQ_SYS_TRANS_HALF_TOPIC", "SCHEDULE_TOPIC_XXXX")):
            refused = await back(offset)
            assert refused.code == ResponseCode.MESSAGE_ILLEGAL, (topic, refused.code, refused.remark)
            assert topic in refused.remark, refused.remark
        assert (await back(offsets[2])).code == ResponseCode.SUCCESS
        # the one retry waits in the schedule's level 3 queue (index 2); nothing else was copied there
        assert await _max_offset(conn, "SCHEDULE_TOPIC_XXXX", 2) == 1


@bounded(20)
async def test_a_topic_named_rmq_sys_in_capitals_is_a_users(broker):
    """The broker's system prefix is rmq_sys_, as RocketMQ's; RMQ_SYS_Orders is a user topic made on first send
    (the Spark rollups count its traffic: tests/spark/test_pure.py)."""
    async with _connected(broker) as conn:
        ok = await conn.request(_send("RMQ_SYS_Orders", "UNIQ_KEY\x01s1", b"mine"), 5)
        assert ok.code == ResponseCode.SUCCESS, ok.remark
        refused = await conn.request(_send("rmq_sys_orders", "UNIQ_KEY\x01s2", b"mine"), 5)
        assert refused.code == ResponseCode.NO_PERMISSION, (refused.code, refused.remark)


@bounded(20)
async def test_a_forwarded_timer_message_waits_its_new_time(broker_factory):
    """A timer message is delivered carrying TIMER_OUT_MS (its delivery time, as RocketMQ 5 keeps it). Forwarded
    with its properties and a new delay (``Producer.send(properties=msg.properties, deliver_at_ms=...)``), that
    mark made the broker take it for one leaving the timer wheel: delivered at once, its delay skipped without a
    word. A client's TIMER_OUT_MS no longer skips its timer (the broker's own deliveries drop the TIMER_* asks)."""
    broker = broker_factory("--timer-max-delay-s", "600")
    async with _connected(broker) as conn:
        for ask in ("TIMER_DELAY_SEC\x01300", f"TIMER_DELIVER_MS\x01{int(time.time() * 1000) + 300_000}"):
            reply = await conn.request(_send("TimerForward", f"UNIQ_KEY\x01t1\x02TIMER_OUT_MS\x011700000000000\x02{ask}",
                                             b"later"), 5)
            assert reply.code == ResponseCode.SUCCESS, reply.remark
        assert await _max_offset(conn, "TimerForward") == 0
        assert await _max_offset(conn, "rmq_sys_wheel_timer") == 2


@bounded(60)
async def test_a_send_back_of_every_message_a_consumer_is_given_still_works(broker_factory):
    """The refusal above is for records no consumer is given. A stock consumer hands back the commit-log offset
    of the record it pulled: a committed transaction's message (COMMIT-typed, on its topic at once, after a delay
    level or after a timer), a delayed or timer message once delivered, and a retry delivered to %RETRY%<group>.
    Each is a copy on the topic the consumer reads, never the half or the waiting record, and is retried."""
    broker = broker_factory(*FAST)
    async with _connected(broker) as conn:
        async def back(offset):
            return await conn.request(RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
                "offset": offset, "group": "CG_given", "delayLevel": 0, "originMsgId": "",
                "maxReconsumeTimes": 16}), 5)

        waits = ("", "\x02DELAY\x011", "\x02TIMER_DELAY_MS\x01100")
        for i, wait in enumerate(waits):
            sent = await conn.request(_send(f"GivenTx{i}", "TRAN_MSG\x01true\x02PGROUP\x01PG_forge" + wait, b"tx",
                                            sys_flag=PREPARED), 5)
            assert sent.code == ResponseCode.SUCCESS, sent.remark
            end = await _commit(conn, sent)
            assert end.code == ResponseCode.SUCCESS, end.remark
            [msg] = await _pull_waiting(conn, "CG_given", f"GivenTx{i}")
            assert msg.sys_flag & 0xC == COMMIT
            reply = await back(msg.physical_offset)
            assert reply.code == ResponseCode.SUCCESS, (i, reply.remark)
        for i, wait in enumerate(waits[1:]):
            sent = await conn.request(_send(f"Given{i}", "UNIQ_KEY\x01g" + wait, b"later"), 5)
            assert sent.code == ResponseCode.SUCCESS, sent.remark
            [msg] = await _pull_waiting(conn, "CG_given", f"Given{i}")
            reply = await back(msg.physical_offset)
            assert reply.code == ResponseCode.SUCCESS, (i, reply.remark)
        [retry, *_] = await _pull_waiting(conn, "CG_given", "%RETRY%CG_given")      # level 3: 300 ms here
        assert (await back(retry.physical_offset)).code == ResponseCode.SUCCESS


@bounded(30)
async def test_a_typed_reply_or_retry_whose_tran_msg_is_true_is_told_why_it_is_no_half(broker):
    """The refusal said "TRAN_MSG is not true" to a reply or a delayed retry whose TRAN_MSG was true (neither is
    ever a half, RocketMQ's rule for a retry asking a delay): a client's author read it, set TRAN_MSG, and got the
    same answer. It says why the message is no half."""
    async with _connected(broker) as conn:
        reply = await conn.request(_send("ReplyTx", "TRAN_MSG\x01true\x02UNIQ_KEY\x01r1", b"typed", sys_flag=PREPARED,
                                         code=RequestCode.SEND_REPLY_MESSAGE_V2), 5)
        retry = await conn.request(_send("%RETRY%CG_typed", "TRAN_MSG\x01true\x02UNIQ_KEY\x01r2\x02DELAY\x013",
                                         b"typed", sys_flag=COMMIT, reconsume=1), 5)
        for answer, why in ((reply, "a reply is never"), (retry, "a retry asking for a delay")):
            assert answer.code == ResponseCode.MESSAGE_ILLEGAL, (answer.code, answer.remark)
            assert why in answer.remark and "TRAN_MSG is not true" not in answer.remark, answer.remark


@bounded(30)
async def test_a_transactional_retry_out_of_retries_commits_to_the_dead_letter_topic(broker):
    """A half sent to %RETRY%<group> out of retries asking no delay (TRAN_MSG=true, DELAY 0 or none: RocketMQ's
    rule makes it a half, as ali-ons' fallback sends it) is a half of %DLQ%<group> on RocketMQ 4.9.8: the dead
    letter rewrite comes first, and its commit lands in the dead-letter queue. The half kept the %RETRY% topic the
    request named (queue 0, the dead letter's): committed, the message went back to the group's consumers out of
    retries, not to its dead letters."""
    async with _connected(broker) as conn:
        sent = await conn.request(_send("%RETRY%CG_txdead", "TRAN_MSG\x01true\x02PGROUP\x01PG_forge\x02UNIQ_KEY\x01x1",
                                        b"spent", sys_flag=PREPARED, reconsume=16), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        end = await _commit(conn, sent)
        assert end.code == ResponseCode.SUCCESS, end.remark
        [msg] = await _pull_waiting(conn, "CG_txdead", "%DLQ%CG_txdead")
        assert (msg.body, msg.properties["UNIQ_KEY"]) == (b"spent", "x1")
        assert await _max_offset(conn, "%RETRY%CG_txdead") == 0


@bounded(60)
async def test_halves_claiming_another_producer_group_are_refused_without_a_log_line_each(broker):
    """A half whose PGROUP is not its sender's producer group is MESSAGE_ILLEGAL (counted under
    producer-group-mismatch), and each was also a WARNING: one client sending 300 made 300 lines. Said at most
    every 10 s now; every one is refused as before, and counted."""
    async with _connected(broker) as conn:
        sent = [await conn.request(_send("OtherTx", f"TRAN_MSG\x01true\x02PGROUP\x01PG_other\x02UNIQ_KEY\x01m{i}",
                                         b"claimed", sys_flag=PREPARED), 5) for i in range(300)]
    assert {s.code for s in sent} == {ResponseCode.MESSAGE_ILLEGAL}
    said = [line for line in broker.log_path.read_text(errors="replace").splitlines() if "half message from" in line]
    assert 1 <= len(said) <= 2, len(said)
