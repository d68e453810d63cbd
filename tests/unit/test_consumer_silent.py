"""Consumer-side failures that used to be silent: each test drives the client with a stand-in for the
broker (no sockets) and shows the message reaching the listener, or the queue staying consumed."""
from __future__ import annotations

import asyncio
import json
import zlib

import pytest

from consumer import ConsumeStatus, MessageQueue, PullConsumer, PushConsumer
from protocol.codes import RequestCode, ResponseCode, SysFlag
from protocol.errors import ConnectionClosedError, error_for_code
from protocol.message import decode_record, encode_record, pack_host
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


def _record(body: bytes, sys_flag: int = 0, queue_offset: int = 0) -> bytearray:
    return encode_record(topic=b"T", body=body, queue_id=0, flag=0, sys_flag=sys_flag, born_timestamp=1,
                         born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                         properties=b"TAGS\x01a\x02", queue_offset=queue_offset)


@bounded(10)
async def test_a_body_its_producer_compressed_reaches_the_consumer_as_sent():
    """Java and Go producers zlib-compress bodies over 4 KiB and set sysFlag COMPRESSED; the broker stores
    and serves them compressed (as RocketMQ does), so the consumer must inflate them, as RocketMQ's
    client does. The listener was handed the zlib bytes, with nothing said."""
    sent = b"order line " * 1000
    body = _record(zlib.compress(sent), SysFlag.COMPRESSED) + _record(b"small", 0, 1)
    client = PullConsumer("127.0.0.1:1", "G")

    async def request(mq, cmd, timeout):
        return cmd.response(ResponseCode.SUCCESS, None, {"nextBeginOffset": 2, "minOffset": 0, "maxOffset": 2},
                            body=bytes(body))
    client._request = request
    try:
        res = await client.pull(MessageQueue("T", "b", 0), 0)
    finally:
        await client.shutdown()
    assert [m.body for m in res.messages] == [sent, b"small"]


def _push_consumer(**kw) -> PushConsumer:
    consumer = PushConsumer("127.0.0.1:1", "G", lambda msg: ConsumeStatus.CONSUME_SUCCESS, **kw)
    consumer.subscribe("T")
    return consumer


async def _stop(consumer: PushConsumer) -> None:
    """End the stand-in pull loops and the client (what shutdown would, without committing anything)."""
    for task in consumer._loops.values():
        task.cancel()
    await asyncio.gather(*consumer._loops.values(), return_exceptions=True)
    await consumer.client.shutdown()


def _stand_in_queues(consumer: PushConsumer, routes: dict, ids: list | None = None) -> None:
    """``routes``: topic -> its queues now (changed by the test); pull loops that only wait."""
    async def fetch_queues(topic):
        return list(routes.get(topic, []))

    async def consumer_ids(mq):
        return [consumer.client.client_id] if ids is None else list(ids)

    async def pull_loop(mq):
        await asyncio.Event().wait()
    consumer.client.fetch_queues = fetch_queues
    consumer.client.consumer_ids = consumer_ids
    consumer._pull_loop = pull_loop


@bounded(10)
async def test_a_dropped_queue_whose_offset_cannot_be_committed_does_not_stop_the_rebalance(caplog):
    """Broker "gone" left the route: its queue is dropped, and its last offset cannot be committed
    there. That commit's error ended the rebalance, so the queue given to this consumer instead got no
    pull loop (and each later rebalance ended the same way while another queue of "gone" was left)."""
    consumer = _push_consumer()
    gone, new = MessageQueue("T", "gone", 0), MessageQueue("T", "live", 0)
    routes = {"T": [gone]}
    _stand_in_queues(consumer, routes)

    async def write(mq, offset):
        raise ConnectionClosedError(f"cannot connect to {mq.broker_name}")
    consumer.offset_store.write = write
    try:
        await consumer.rebalance()
        consumer._offsets[gone] = 5              # consumed since the last commit
        routes["T"] = [new]
        await consumer.rebalance()
        assert set(consumer._loops) == {new}
    finally:
        await _stop(consumer)
    assert "could not commit" in caplog.text


@bounded(10)
async def test_a_broker_gone_for_good_does_not_stop_heartbeats_or_rebalancing(caplog):
    """A broker the client once knew stays in its table after it left every route. The heartbeat went
    to each known broker and raised at the first that did not answer: the brokers after it never heard
    from this consumer again (they expire it and give its queues to the others), and the rebalance
    after the heartbeat never ran, turn after turn."""
    consumer = _push_consumer(rebalance_interval_s=0.01)
    consumer.client._brokers = {"gone": "gone:1", "live": "live:1"}
    heard = []

    async def request(addr, cmd, timeout):
        if addr == "gone:1":
            raise ConnectionClosedError("cannot connect to gone:1")
        heard.append(addr)
        return cmd.response(ResponseCode.SUCCESS)
    consumer.client.pool.request = request
    rebalanced = asyncio.Event()

    async def rebalance():
        rebalanced.set()
    consumer.rebalance = rebalance
    task = asyncio.get_running_loop().create_task(consumer._rebalance_loop())
    try:
        await asyncio.wait_for(rebalanced.wait(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        consumer.client._brokers.clear()
        await consumer.client.shutdown()
    assert "live:1" in heard and "gone:1" in caplog.text


@bounded(10)
async def test_an_orderly_consumer_keeps_the_locks_of_the_brokers_that_answer(caplog):
    """Orderly: the owned queues were locked in one call over all their brokers, which raised at the
    first broker that did not answer, so the locks the others granted were never taken: every queue,
    on every broker, stopped being consumed while one broker could not be reached."""
    consumer = _push_consumer(orderly=True)
    gone, live = MessageQueue("T", "gone", 0), MessageQueue("T", "live", 0)
    consumer._owned = {gone, live}

    async def request(mq, cmd, timeout):
        if mq.broker_name == "gone":
            raise ConnectionClosedError("cannot connect to gone")
        body = {"lockOKMQSet": [{"topic": "T", "brokerName": "live", "queueId": 0}]}
        return cmd.response(ResponseCode.SUCCESS, body=json.dumps(body).encode())
    consumer.client._request = request
    try:
        with pytest.raises(ConnectionClosedError):     # still said (the lock loop logs it)
            await consumer._lock_owned()
    finally:
        await consumer.client.shutdown()
    assert consumer.locked_queues == {live}


@bounded(10)
async def test_a_consumer_list_the_broker_cannot_give_leaves_the_queues_as_they_are(caplog):
    """GET_CONSUMER_LIST_BY_GROUP answers SYSTEM_ERROR "no consumer for this group" while the broker does
    not know the group (it restarted since the heartbeats), and the client made that an empty list: every
    consumer gave up every queue of the topic, without a word, until the next rebalance. RocketMQ leaves
    the topic's queues as they are when it gets no list (RebalanceImpl: "get consumer id list failed")."""
    consumer = _push_consumer()
    queues = [MessageQueue("T", "b", 0), MessageQueue("T", "b", 1)]
    ids = [consumer.client.client_id]
    _stand_in_queues(consumer, {"T": queues}, ids)
    try:
        await consumer.rebalance()
        assert set(consumer._loops) == set(queues)
        ids.clear()
        await consumer.rebalance()
        assert set(consumer._loops) == set(queues)
    finally:
        await _stop(consumer)
    assert "no consumer list" in caplog.text


@bounded(10)
async def test_offsets_that_cannot_be_committed_at_shutdown_are_logged(caplog):
    """Shutdown commits what was consumed; a commit that failed there was passed over without a word, and
    the messages consumed since the last commit came again at the next start for no visible reason."""
    consumer = _push_consumer()
    mq = MessageQueue("T", "b", 0)
    consumer._owned = {mq}
    consumer._offsets[mq] = 9

    async def write(q, offset):
        raise ConnectionClosedError("cannot connect to b")
    consumer.offset_store.write = write
    await consumer.shutdown()
    assert "offset 9 of" in caplog.text


@bounded(10)
async def test_a_retried_message_retried_here_still_shows_its_own_topic():
    """A message from %RETRY%<group> is shown under the topic it was sent to. When handing it back failed
    and it was tried again here, the listener saw %RETRY%<group> instead: a listener that dispatches on
    the topic did not recognise it (and may well have acknowledged it unhandled)."""
    consumer = _push_consumer(local_retry_delay_s=0)
    record = encode_record(topic=b"%RETRY%G", body=b"x", queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                           born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                           properties=b"RETRY_TOPIC\x01T\x02")
    msg = decode_record(record)[0]
    seen = []

    def listener(m):
        seen.append(m.topic)
        return ConsumeStatus.CONSUME_SUCCESS if len(seen) == 2 else ConsumeStatus.RECONSUME_LATER
    consumer.listener = listener

    async def send_back(mq, m, **kw):
        raise ConnectionClosedError("cannot connect to b")
    consumer.client.send_back = send_back
    try:
        await consumer._consume(MessageQueue("%RETRY%G", "b", 0), msg)
    finally:
        await consumer.client.shutdown()
    assert seen == ["T", "T"]


@bounded(10)
async def test_a_topic_whose_route_cannot_be_had_does_not_stop_the_others_rebalancing(caplog):
    """One subscribed topic the name server does not know (deleted, or not created yet) made every
    rebalance raise before any change: the group's other topics were never rebalanced again, so a
    consumer that joined got nothing and the queues of one that left were consumed by nobody.
    RocketMQ rebalances the other topics ("the topic not exist")."""
    consumer = _push_consumer()
    consumer.subscribe("U")
    t0, t1 = MessageQueue("T", "b", 0), MessageQueue("T", "b", 1)
    routes = {"T": [t0, t1]}
    _stand_in_queues(consumer, routes)
    fetch = consumer.client.fetch_queues

    async def fetch_queues(topic):
        if topic == "U":
            raise error_for_code(ResponseCode.TOPIC_NOT_EXIST, "No topic route info in name server for the topic: U")
        return await fetch(topic)
    consumer.client.fetch_queues = fetch_queues
    try:
        await consumer.rebalance()
        assert set(consumer._loops) == {t0, t1}
    finally:
        await _stop(consumer)
    assert "No topic route info" in caplog.text


@bounded(10)
async def test_shutdown_does_not_commit_a_queue_given_away_over_its_new_owner():
    """A queue given away whose hand-over commit failed kept its old offset here, and shutdown wrote it:
    the new owner's progress was undone and what it had consumed since came again."""
    consumer = _push_consumer()
    kept, given = MessageQueue("T", "b", 0), MessageQueue("T", "b", 1)
    consumer._owned = {kept}
    consumer._offsets.update({kept: 5, given: 3})
    written = {}

    async def write(mq, offset):
        written[mq] = offset
    consumer.offset_store.write = write
    await consumer.shutdown()
    assert written == {kept: 5}


@bounded(10)
async def test_the_pull_loops_stopped_for_an_offset_reset_start_again_when_storing_it_fails():
    """RESET_CONSUMER_CLIENT_OFFSET stops the topic's pull loops, stores the new offsets and starts the
    loops again. A store that raised ended it in between: the topic's queues had no pull loop until
    the next rebalance noticed (20 s by default)."""
    consumer = _push_consumer()
    q0, q1 = MessageQueue("T", "b", 0), MessageQueue("T", "b", 1)
    _stand_in_queues(consumer, {"T": [q0, q1]})

    async def write(mq, offset):
        raise ConnectionClosedError("cannot connect to b")
    consumer.offset_store.write = write
    try:
        await consumer.rebalance()
        with pytest.raises(ConnectionClosedError):      # still raised: the task's failure is logged
            await consumer.reset_offsets("T", {q0: 0, q1: 0})
        assert set(consumer._loops) == {q0, q1}
    finally:
        await _stop(consumer)


@bounded(10)
async def test_an_offset_reset_cut_short_by_shutdown_starts_no_pull_loop_after_it():
    """Shutdown cancels an offset reset under way; the reset's clean-up started the topic's pull loops
    again, after shutdown had gathered the loops it stops, so they pulled on with the client closed."""
    consumer = _push_consumer()
    q0 = MessageQueue("T", "b", 0)
    _stand_in_queues(consumer, {"T": [q0]})
    writing = asyncio.Event()

    async def write(mq, offset):
        if not writing.is_set():        # the reset's store hangs; shutdown's own commit goes through
            writing.set()
            await asyncio.Event().wait()
    consumer.offset_store.write = write
    await consumer.rebalance()
    consumer._on_reset_offset("T", {q0: 0})
    await writing.wait()
    await consumer.shutdown()
    assert consumer._loops == {}
    assert not [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("pull_loop")]


@bounded(10)
async def test_a_listener_that_returns_no_status_is_told_about(caplog):
    """A listener that forgets to return CONSUME_SUCCESS (None) has every message retried and then
    dead-lettered; that was done without a word. RocketMQ logs "consumeMessage return null"."""
    consumer = _push_consumer()
    consumer.listener = lambda m: None
    msg = decode_record(_record(b"x"))[0]
    try:
        assert await consumer._listen(msg) is ConsumeStatus.RECONSUME_LATER
    finally:
        await consumer.client.shutdown()
    assert "returned None" in caplog.text


@bounded(10)
async def test_a_listener_that_never_returns_is_timed_out_and_its_message_retried(caplog):
    """An async listener stuck on a call that never returns held its queue for good, with nothing said
    (RocketMQ's consumeTimeout, 15 min by default, gives such a message back for a retry)."""
    consumer = _push_consumer(consume_timeout_s=0.05)
    cancelled = asyncio.Event()

    async def stuck(msg):
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
    consumer.listener = stuck
    msg = decode_record(_record(b"x"))[0]
    try:
        assert await consumer._listen(msg) is ConsumeStatus.RECONSUME_LATER
    finally:
        await consumer.client.shutdown()
    assert cancelled.is_set()
    assert "still running" in caplog.text and "consume_timeout_s" in caplog.text


@bounded(10)
async def test_a_listener_raising_its_own_timeout_is_not_reported_as_running_too_long(caplog):
    """A listener's own TimeoutError (a request it made timed out) is a failure like any other, not the consume
    timeout: it was logged as "still running after 900 s"."""
    consumer = _push_consumer()

    async def times_out(msg):
        raise TimeoutError("the database did not answer")
    consumer.listener = times_out
    try:
        assert await consumer._listen(decode_record(_record(b"x"))[0]) is ConsumeStatus.RECONSUME_LATER
    finally:
        await consumer.client.shutdown()
    assert "listener failed" in caplog.text and "still running" not in caplog.text


@bounded(10)
async def test_offset_reset_tasks_are_not_kept_once_done_and_none_starts_during_shutdown():
    """Each RESET_CONSUMER_CLIENT_OFFSET added a task to the consumer's list for good (an operator's resets
    over months), and one arriving during shutdown made a task nobody waited for."""
    consumer = _push_consumer()
    q0 = MessageQueue("T", "b", 0)
    _stand_in_queues(consumer, {"T": [q0]})

    async def write(mq, offset):
        pass
    consumer.offset_store.write = write
    try:
        await consumer.rebalance()
        before = list(consumer._tasks)
        for _ in range(3):
            consumer._on_reset_offset("T", {q0: 0})
        resets = [t for t in consumer._tasks if t not in before]
        await asyncio.gather(*resets)
        await asyncio.sleep(0)                          # their done-callbacks run
        assert consumer._tasks == before
        consumer._stopping = True                       # what shutdown sets first
        consumer._on_reset_offset("T", {q0: 0})         # after shutdown began: not applied, no task
        assert consumer._tasks == before
    finally:
        await _stop(consumer)


def _bomb(inflated_mib: int) -> bytes:
    """A zlib body of ``inflated_mib`` MiB of zeros, built a MiB at a time (about 1 KiB per MiB compressed)."""
    z = zlib.compressobj(9)
    zero = bytes(1 << 20)
    return b"".join(z.compress(zero) for _ in range(inflated_mib)) + z.flush()


@bounded(60)
async def test_a_compressed_body_that_inflates_past_the_cap_is_given_as_stored_not_inflated_whole():
    """A zip bomb: a hostile producer stores a small body marked COMPRESSED that inflates to gigabytes, and
    every consumer of the topic inflated it whole (zlib.decompress) and died. Stock producers compress only
    bodies that already passed their 4 MiB maxMessageSize check, so inflation is capped (16 MiB by default,
    ``max_inflated_body``); a body over it reaches the listener as stored, COMPRESSED still set, with an error
    logged, and the messages around it are inflated as usual."""
    import tracemalloc
    bomb = _bomb(256)
    sent = b"order line " * 1000
    body = (_record(bomb, SysFlag.COMPRESSED) + _record(zlib.compress(sent), SysFlag.COMPRESSED, 1))
    client = PullConsumer("127.0.0.1:1", "G")

    async def request(mq, cmd, timeout):
        return cmd.response(ResponseCode.SUCCESS, None, {"nextBeginOffset": 2, "minOffset": 0, "maxOffset": 2},
                            body=bytes(body))
    client._request = request
    tracemalloc.start()
    try:
        res = await client.pull(MessageQueue("T", "b", 0), 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        await client.shutdown()
    assert peak < 64 << 20, peak
    bombed, fine = res.messages
    assert bombed.body == bomb and bombed.sys_flag & SysFlag.COMPRESSED
    assert fine.body == sent and not fine.sys_flag & SysFlag.COMPRESSED    # inflated: the flag says so


async def test_inflate_takes_a_body_exactly_at_the_cap_and_refuses_one_byte_more():
    from protocol.message import inflate
    limit = 1 << 20

    def msg(raw: bytes):
        return decode_record(_record(zlib.compress(raw), SysFlag.COMPRESSED))[0]
    at = msg(b"x" * limit)
    assert inflate(at, limit) is None and at.body == b"x" * limit
    over = msg(b"x" * (limit + 1))
    why = inflate(over, limit)
    assert "inflates past" in why and over.body == zlib.compress(b"x" * (limit + 1))
    assert over.sys_flag & SysFlag.COMPRESSED
    cut = msg(b"abc" * 1000)
    cut.body = cut.body[:-6]
    assert "does not inflate" in inflate(cut, limit) and cut.sys_flag & SysFlag.COMPRESSED   # left as stored
    with pytest.raises(ValueError):
        PullConsumer("127.0.0.1:1", "G", max_inflated_body=0)


@pytest.mark.parametrize("call", ["max_offset", "min_offset", "search_offset"])
@bounded(10)
async def test_an_offset_query_refused_raises_not_zero(call):
    """GET_MAX_OFFSET (and min, and by timestamp) answered with an error read as offset 0: a push consumer
    told to start a new queue from its last offset started from its first (every message again), with
    nothing said. The Java client raises MQBrokerException, and its rebalance tries the queue again later."""
    client = PullConsumer("127.0.0.1:1", "G")

    async def request(mq, cmd, timeout):
        return cmd.response(ResponseCode.SYSTEM_BUSY, "[PCBUSY_CLEAN_QUEUE] broker busy")
    client._request = request
    mq = MessageQueue("T", "b", 0)
    try:
        with pytest.raises(error_for_code(ResponseCode.SYSTEM_BUSY).__class__):
            await (client.search_offset(mq, 1) if call == "search_offset" else getattr(client, call)(mq))
    finally:
        await client.shutdown()


@bounded(10)
async def test_a_pull_whose_answer_does_not_decode_is_said_at_each_retry(caplog):
    """A pull answered with a record that does not decode is pulled again at the same offset, for good: the
    queue is consumed by nobody. It was logged at INFO (as a lost connection), so nothing showed the stall."""
    consumer = _push_consumer()
    consumer.pull_retry_delay_s = 0
    mq = MessageQueue("T", "b", 0)
    pulls = []
    twice = asyncio.Event()

    async def read(q):
        return 5
    consumer.offset_store.read = read

    async def pull(q, offset, **kw):
        pulls.append(offset)
        if len(pulls) == 2:
            twice.set()
        return await client_pull(q, offset, **kw)
    client_pull = consumer.client.pull

    async def request(q, cmd, timeout):
        return cmd.response(ResponseCode.SUCCESS, None, {"nextBeginOffset": 6, "minOffset": 0, "maxOffset": 6},
                            body=bytes(_record(b"x"))[:-3])
    consumer.client._request = request
    consumer.client.pull = pull
    caplog.set_level("INFO", logger="txmq.consumer")
    loop = asyncio.create_task(consumer._pull_loop(mq))
    try:
        await twice.wait()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await consumer.client.shutdown()
    assert pulls[:2] == [5, 5]
    said = [r for r in caplog.records if "pull of" in r.getMessage()]
    assert said and all(r.levelname == "WARNING" for r in said), [(r.levelname, r.getMessage()) for r in said]


@pytest.mark.parametrize("stored_late", ["FLUSH_DISK_TIMEOUT", "FLUSH_SLAVE_TIMEOUT", "SLAVE_NOT_AVAILABLE"])
@bounded(10)
async def test_a_send_back_stored_but_not_yet_flushed_or_replicated_is_not_sent_a_second_time(stored_late):
    """RocketMQ's broker answers CONSUMER_SEND_MSG_BACK with SYSTEM_ERROR and the put's status as remark when
    the retry copy was stored but its flush (SYNC_FLUSH) or its slave (SYNC_MASTER) was late. send_back took
    every refusal for "not copied" and sent the message to %RETRY%<group> itself: two copies, the message
    delivered twice more. That copy exists: nothing more is sent."""
    client = PullConsumer("127.0.0.1:1", "G")
    asked = []

    async def request(mq, cmd, timeout):
        asked.append(cmd.code)
        return cmd.response(ResponseCode.SYSTEM_ERROR, stored_late)
    client._request = request
    msg = decode_record(_record(b"failed"))[0]
    try:
        await client.send_back(MessageQueue("T", "b", 0), msg)
    finally:
        await client.shutdown()
    assert asked == [RequestCode.CONSUMER_SEND_MSG_BACK]


@bounded(10)
async def test_max_reconsume_times_minus_one_is_rocketmqs_default_not_straight_to_the_dead_letter_queue():
    """RocketMQ's push consumer takes maxReconsumeTimes -1 (its own default) as 16 retries, and as
    Integer.MAX_VALUE when orderly; it never sends -1. Ours sent -1 in CONSUMER_SEND_MSG_BACK, and a broker
    (RocketMQ's or ours) reads that as no retries left: every failed message went to %DLQ%<group> at once."""
    consumer = _push_consumer(max_reconsume_times=-1)
    orderly = _push_consumer(max_reconsume_times=-1, orderly=True)
    headers = []

    async def request(mq, cmd, timeout):
        headers.append(cmd.ext_fields["maxReconsumeTimes"])
        return cmd.response(ResponseCode.SUCCESS, None)
    consumer.client._request = request
    consumer.listener = lambda m: ConsumeStatus.RECONSUME_LATER if not headers else ConsumeStatus.CONSUME_SUCCESS
    msg = decode_record(_record(b"failed"))[0]
    try:
        await consumer._consume(MessageQueue("T", "b", 0), msg)
        await consumer.client.send_back(MessageQueue("T", "b", 0), msg, max_reconsume_times=-1)
    finally:
        await consumer.client.shutdown()
        await orderly.client.shutdown()
    assert [int(h) for h in headers] == [16, 16]
    assert consumer.max_reconsume_times == 16 and orderly.max_reconsume_times == (1 << 31) - 1
    with pytest.raises(ValueError, match="max_reconsume_times"):
        PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, max_reconsume_times=-2)


@bounded(10)
async def test_send_back_refuses_max_reconsume_times_below_minus_one_as_the_push_consumer_does():
    """The changelog's "-1 means RocketMQ's default ... below -1 is a ValueError" named send_back too, but only
    PushConsumer checked: send_back sent -2 in CONSUMER_SEND_MSG_BACK (and in the own resend's header), which a
    broker reads as no retries left, dead-lettering the message at once without a word."""
    client = PullConsumer("127.0.0.1:1", "G")
    asked = []

    async def request(mq, cmd, timeout):
        asked.append(cmd.code)
        return cmd.response(ResponseCode.SUCCESS, None)
    client._request = request
    msg = decode_record(_record(b"failed"))[0]
    try:
        with pytest.raises(ValueError, match="max_reconsume_times"):
            await client.send_back(MessageQueue("T", "b", 0), msg, max_reconsume_times=-2)
    finally:
        await client.shutdown()
    assert asked == []


@pytest.mark.parametrize("stamp", ["20000101000000", 1795875285074.61, True, -1, 1 << 63])
async def test_consume_timestamp_ms_that_is_no_millisecond_count_is_refused_when_made(stamp):
    """consume_timestamp_ms went into SEARCH_OFFSET_BY_TIMESTAMP as given. Java's consumeTimestamp string
    ("20000101000000", meaning everything since 2000), which a consumer ported from Java passes, was read by the
    broker as milliseconds (the year 2607): every new queue started at its last message, 4 of 5 passed over,
    nothing said. A float (time.time() * 1000) was refused by the broker at each first pull, the queue never
    consumed, a WARNING every 3 s. Refused when the consumer is made now, naming the form."""
    with pytest.raises(ValueError, match="consume_timestamp_ms=.*milliseconds since the epoch"):
        PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, consume_from="timestamp",
                     consume_timestamp_ms=stamp)
