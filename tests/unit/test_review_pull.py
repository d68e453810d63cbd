"""Review regressions for long polling (PULL_MESSAGE with the suspend flag)."""
from __future__ import annotations

import asyncio

import pytest

from broker.longpoll import PullHoldService
from broker.clients import build_subscription
from broker.processors.pull import handle_pull
from broker.store import PutRequest, consume_queue
from protocol.codes import PullSysFlag, RequestCode, ResponseCode
from protocol.command import RemotingCommand
from tests.support.bounded import bounded
from tests.support.store_faults import no_descriptor_for
from tests.unit.test_review_transactions import Clock, make_service

pytestmark = pytest.mark.asyncio


async def make_ctx(tmp_path):
    ctx = await make_service(tmp_path, Clock())
    ctx.holds = PullHoldService()
    ctx.holds.attach(ctx.store._store)
    ctx.topics.ensure("PT", 4)
    return ctx


def pull_cmd(queue_id, offset, suspend_ms=10000, max_nums=32):
    return RemotingCommand.request(RequestCode.PULL_MESSAGE, {
        "consumerGroup": "CG", "topic": "PT", "queueId": queue_id, "queueOffset": offset, "maxMsgNums": max_nums,
        "sysFlag": PullSysFlag.SUSPEND | PullSysFlag.SUBSCRIPTION, "commitOffset": 0,
        "suspendTimeoutMillis": suspend_ms, "subscription": "*", "subVersion": 0})


async def put(ctx, queue_id, body=b"m"):
    result = await ctx.store.put(PutRequest.build("PT", body, queue_id=queue_id))
    assert result.ok


@bounded(20)
async def test_pull_on_a_queue_never_written_is_held_until_a_message_arrives(tmp_path):
    # RocketMQ holds every PULL_NOT_FOUND with the suspend flag; answering at once makes a stock
    # push consumer re-pull at once, spinning on every empty queue of the topic.
    ctx = await make_ctx(tmp_path)
    try:
        await put(ctx, 0)                       # the topic has data, queue 3 never had any
        result = handle_pull(ctx, None, pull_cmd(3, 0))
        assert not isinstance(result, RemotingCommand), f"not held: {result.code} {result.remark}"
        held = asyncio.ensure_future(result)
        await asyncio.sleep(0)                  # let the pull park
        await put(ctx, 3, b"late")
        reply = await asyncio.wait_for(held, 5)
        assert reply.code == ResponseCode.SUCCESS
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_pull_parked_on_units_waiting_in_memory_is_woken_when_they_land(tmp_path, monkeypatch):
    """A delivery (scheduled, retry, commit) to a queue whose file cannot be opened yet (out of descriptors; or no
    disk space for its units) is stored and dispatched, its unit kept in memory until the store's disk loop writes
    it. The dispatch woke nobody that could read it: the consumer's next pull found nothing and was parked, and
    when the unit landed nothing woke it -- it slept its whole suspend time (a push consumer's 15 s) with the
    message readable."""
    ctx = await make_ctx(tmp_path)
    try:
        real = no_descriptor_for(monkeypatch, "PT")
        await put(ctx, 2, b"waited")                        # stored; its unit waits for a file
        assert ctx.store.max_offset("PT", 2) == 0
        result = handle_pull(ctx, None, pull_cmd(2, 0))     # nothing readable: parked for 10 s
        assert not isinstance(result, RemotingCommand), f"not held: {result.code} {result.remark}"
        held = asyncio.ensure_future(result)
        await asyncio.sleep(0)                  # let the pull park
        assert ctx.holds.parked == 1
        monkeypatch.setattr(consume_queue.MappedFile, "create", real)     # descriptors back: the disk loop writes it
        reply = await asyncio.wait_for(held, 5)     # the disk loop retries every 0.5 s; the hold is 10 s
        assert reply.code == ResponseCode.SUCCESS and ctx.store.max_offset("PT", 2) == 1
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_message_stored_before_the_parked_pull_registers_wakes_it(tmp_path):
    ctx = await make_ctx(tmp_path)
    try:
        await put(ctx, 0)
        result = handle_pull(ctx, None, pull_cmd(0, 1))     # nothing at offset 1 yet: parked
        assert not isinstance(result, RemotingCommand)
        await put(ctx, 0, b"raced")            # lands after the read, before the wait registers
        reply = await asyncio.wait_for(result, 3)   # must not sit out the 10 s hold
        assert reply.code == ResponseCode.SUCCESS
    finally:
        await ctx.store._store.close()


class _Conn:
    def __init__(self, is_open=True):
        self.attributes = {}
        self.is_open = is_open

    def park(self):
        return False


@bounded(20)
async def test_a_closed_connections_parked_pull_is_released_and_not_answered(tmp_path):
    # Held on, a parked pull outlived its connection for its whole suspend time, outside the connection's
    # in-flight limit: parking pulls and hanging up, over and over, held any number of them.
    ctx = await make_ctx(tmp_path)
    try:
        conn = _Conn()
        held = asyncio.ensure_future(handle_pull(ctx, conn, pull_cmd(3, 0)))
        await asyncio.sleep(0)                  # let the pull park
        assert ctx.holds.parked == 1
        ctx.holds.connection_closed(conn)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(held, 3)
        assert ctx.holds.parked == 0
        # pulls read in the same turn as the close run after it: they must not park at all
        late = handle_pull(ctx, _Conn(is_open=False), pull_cmd(3, 0))
        assert await asyncio.wait_for(late, 3) is None and ctx.holds.parked == 0
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_sql92_pull_is_refused_not_read_as_a_tag(tmp_path):
    # The broker filters by tag only. A pull asking for SQL92 had its expression taken for a tag name that no
    # message carries: every message skipped (nextBeginOffset moved past it) and none delivered, without a
    # word. RocketMQ without enablePropertyFilter answers SYSTEM_ERROR; so do we, for the pull's own
    # subscription and for one a heartbeat registered.
    ctx = await make_ctx(tmp_path)
    try:
        await put(ctx, 0)
        cmd = pull_cmd(0, 0)
        cmd.ext_fields.update({"subscription": "a > 5", "expressionType": "SQL92"})
        reply = handle_pull(ctx, None, cmd)
        assert reply.code == ResponseCode.SYSTEM_ERROR and "SQL92" in reply.remark, (reply.code, reply.ext_fields)
        ctx.clients.subscription = lambda group, topic: build_subscription(topic, "a > 5", 0, "SQL92")
        cmd = pull_cmd(0, 0)
        cmd.ext_fields["sysFlag"] = str(PullSysFlag.SUSPEND)        # no subscription in the pull: the heartbeat's
        reply = handle_pull(ctx, None, cmd)
        assert reply.code == ResponseCode.SYSTEM_ERROR and "SQL92" in reply.remark, (reply.code, reply.ext_fields)
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_one_filtered_pull_scans_no_more_than_its_bytes_could_return(tmp_path):
    # A pull scanned max(800, maxMsgNums) consume-queue units in one go, on the loop: with a tag no message
    # has and maxMsgNums 2**31-1, a whole 300,000-unit file per request (tens of ms each, 16 requests a turn),
    # every other client waiting. Past what max_bytes could return (records of 91 bytes and more), more units
    # change nothing but that wait.
    ctx = await make_ctx(tmp_path)
    try:
        n = 4000
        results = await ctx.store.put_many([PutRequest.build("PT", b"m", queue_id=0, properties={"TAGS": "T"})
                                            for _ in range(n)])
        assert all(r.ok for r in results)
        cmd = pull_cmd(0, 0)
        cmd.ext_fields.update({"subscription": "NoSuchTag", "maxMsgNums": str(2**31 - 1), "sysFlag": "4"})
        reply = handle_pull(ctx, None, cmd)
        scanned = int(reply.ext_fields["nextBeginOffset"])
        assert reply.code == ResponseCode.PULL_RETRY_IMMEDIATELY and 0 < scanned <= 256 * 1024 // 91 + 1, scanned
        cmd = pull_cmd(0, 0)
        cmd.ext_fields.update({"maxMsgNums": str(2**31 - 1), "sysFlag": "4"})      # unfiltered: as many as fit
        reply = handle_pull(ctx, None, cmd)
        assert reply.code == ResponseCode.SUCCESS and int(reply.ext_fields["nextBeginOffset"]) > 2000
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_pull_newer_than_the_stored_subscription_is_refused_not_filtered_by_the_old_one(tmp_path):
    # Without the subscription flag (the Java push consumer's default) the broker filters with what the group's
    # heartbeat stored. A pull whose subVersion is newer (the subscription changed, the heartbeat saying so not
    # here yet) was filtered by the old tags: messages only the new one wants were skipped past, never delivered.
    # RocketMQ answers SUBSCRIPTION_NOT_LATEST and the client pulls again later.
    ctx = await make_ctx(tmp_path)
    try:
        assert (await ctx.store.put(PutRequest.build("PT", b"b", queue_id=0, properties={"TAGS": "TagB"}))).ok
        ctx.clients.subscription = lambda group, topic: build_subscription(topic, "TagA", 100)
        cmd = pull_cmd(0, 0)
        cmd.ext_fields.update({"sysFlag": "0", "subscription": "TagA || TagB", "subVersion": "200"})
        reply = handle_pull(ctx, None, cmd)
        assert reply.code == ResponseCode.SUBSCRIPTION_NOT_LATEST, (reply.code, reply.ext_fields)
        cmd.ext_fields["subVersion"] = "100"        # the same version (or 0, as Go sends): the stored one is used
        assert handle_pull(ctx, None, cmd).code == ResponseCode.PULL_RETRY_IMMEDIATELY
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_a_pull_for_zero_messages_gets_one(tmp_path):
    """maxMsgNums=0 was read as 32. RocketMQ 4.9.8's DefaultMessageStore.getMessage takes the first message
    (isTheBatchFull is false while the batch is empty) and stops at the next (0 <= 1 messages): one message,
    nextBeginOffset one further, whether answered at once or after the pull was held."""
    from protocol.message import decode_records
    ctx = await make_ctx(tmp_path)
    try:
        for i in range(5):
            await put(ctx, 0, b"m%d" % i)
        reply = handle_pull(ctx, None, pull_cmd(0, 0, max_nums=0))
        assert reply.code == ResponseCode.SUCCESS
        assert [m.body for m in decode_records(reply.body_bytes())] == [b"m0"]
        assert reply.int_field("nextBeginOffset") == 1
        held = handle_pull(ctx, None, pull_cmd(0, 5, max_nums=0))     # nothing at 5 yet: parked
        assert not isinstance(held, RemotingCommand)
        held = asyncio.ensure_future(held)
        await asyncio.sleep(0)
        await put(ctx, 0, b"m5")
        await put(ctx, 0, b"m6")
        woken = await asyncio.wait_for(held, 5)
        assert woken.code == ResponseCode.SUCCESS and woken.int_field("nextBeginOffset") == 6
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_pull_of_a_queue_with_messages_but_no_topic_config_says_so_in_the_log(tmp_path, caplog):
    """TOPIC_NOT_EXIST is the answer RocketMQ gives; the operator must learn that messages wait behind it."""
    ctx = await make_ctx(tmp_path)
    try:
        await put(ctx, 1)
        await put(ctx, 1)
        ctx.topics.topics.pop("PT")         # the config lost, the queue kept (a slave, or a bug)
        with caplog.at_level("ERROR", logger="txmq.pull"):
            for _ in range(3):
                assert handle_pull(ctx, None, pull_cmd(1, 0)).code == ResponseCode.TOPIC_NOT_EXIST
            assert handle_pull(ctx, None, pull_cmd(2, 0)).code == ResponseCode.TOPIC_NOT_EXIST   # empty queue
        said = [r.getMessage() for r in caplog.records if r.name == "txmq.pull"]
        assert len(said) == 1, said         # once a minute a topic, not once a pull
        assert "PT queue 1" in said[0] and "holds 2 messages" in said[0]
    finally:
        await ctx.store._store.close()


@bounded(20)
async def test_pull_of_a_queue_whose_messages_all_expired_and_no_topic_config_logs_no_error(tmp_path, caplog,
                                                                                            monkeypatch):
    """A queue retention emptied (min offset = max offset) holds no message: an ERROR saying "holds 0 messages"
    sent an operator after nothing."""
    ctx = await make_ctx(tmp_path)
    try:
        await put(ctx, 1)
        await put(ctx, 1)
        ctx.topics.topics.pop("PT")
        monkeypatch.setattr(ctx.store, "min_offset", lambda topic, qid: ctx.store.max_offset(topic, qid))
        import broker.processors.pull as pull_module
        monkeypatch.setattr(pull_module._unconfigured, "said", {})    # PT said by another test: not held back
        with caplog.at_level("ERROR", logger="txmq.pull"):
            assert handle_pull(ctx, None, pull_cmd(1, 0)).code == ResponseCode.TOPIC_NOT_EXIST
        assert [r.getMessage() for r in caplog.records if r.name == "txmq.pull"] == []
    finally:
        await ctx.store._store.close()
