"""Orderly consumption across a consumer's death, and broadcasting, against the real broker.

Orderly: two orderly consumers of one group share a topic's queues through the broker's queue locks.
The first runs in its own process, hangs after 60 messages and is killed with SIGKILL while it
holds its locks; its queues pass to the second only once the broker's lock expires
(queue_lock_max_live_ms, shortened here), and every queue is still consumed in order with no gap.
Broadcasting: every consumer of the group gets every message and keeps its offsets in a local file.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections import defaultdict

import pytest

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from producer import Producer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from tests.support.bounded import bounded
from tests.support.broker_process import REPO

pytestmark = pytest.mark.asyncio

LOCK_TTL_MS = 3000
QUEUES, PER_QUEUE = 4, 60


async def _send_sequences(namesrv: str, topic: str) -> None:
    async with Producer(namesrv, "PG_orderly") as producer:
        queues = await producer.routes.publish_queues(topic)
        assert len(queues) == QUEUES
        for seq in range(PER_QUEUE):
            await asyncio.gather(*(producer.send(topic, f"{q.queue_id}:{seq}".encode(), queue=q) for q in queues))


async def _lines(proc, sink: list, events: dict):
    """Read the child's lines into ``sink``; set ``events[n]`` once n messages were consumed."""
    while line := await proc.stdout.readline():
        sink.append(line.decode().split())
        consumed = sum(1 for p in sink if p[0] == "C")
        for n, ev in events.items():
            if consumed >= n:
                ev.set()


async def test_a_killed_orderly_consumers_queues_move_after_the_lock_expires_in_order(broker_factory):
    broker = broker_factory("--queue-lock-max-live-ms", str(LOCK_TTL_MS))
    topic, group = "Orders", "CG_orderly"
    await _send_sequences(broker.namesrv, topic)

    first_out: list[list[str]] = []
    stalled = asyncio.Event()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.orderly_consumer", broker.namesrv, group, topic, "60",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    reader = asyncio.get_running_loop().create_task(_lines(proc, first_out, {60: stalled}))

    second: dict[int, list[int]] = defaultdict(list)
    second_times: dict[int, float] = {}
    done = asyncio.Event()
    killed_at = None

    def listener(msg):
        q, seq = map(int, msg.body.decode().split(":"))
        second[q].append(seq)
        second_times.setdefault(q, time.monotonic())
        if all(second[i] and second[i][-1] == PER_QUEUE - 1 for i in range(QUEUES)):
            done.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(broker.namesrv, group, listener, orderly=True, consume_from="first", suspend_ms=500,
                            lock_interval_s=0.5, lock_expire_s=1.5, lock_retry_s=0.2,
                            offset_commit_interval_s=0.2, rebalance_interval_s=1.0)
    consumer.subscribe(topic)
    try:
        async with asyncio.timeout(60):
            await stalled.wait()                          # the first consumer holds every queue and hangs
            assert max(int(p[1]) for p in first_out if p[0] == "LOCKED") >= QUEUES   # and its %RETRY% queue
            await consumer.start()                        # the group splits: the first gives half up
            def mine():
                return {mq.queue_id for mq in consumer.locked_queues if mq.topic == topic}
            while len(mine()) < QUEUES // 2:
                await asyncio.sleep(0.05)
            held_by_first = set(range(QUEUES)) - mine()
            assert len(held_by_first) == QUEUES // 2
            proc.send_signal(signal.SIGKILL)              # dies holding the rest: no unlock is ever sent
            await proc.wait()
            killed_at = time.monotonic()
            await done.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        reader.cancel()
        await consumer.shutdown()

    first: dict[int, list[int]] = defaultdict(list)
    for parts in first_out:
        if parts[0] == "C":
            q, seq = map(int, parts[2].split(":"))
            first[int(parts[1])].append(seq)
    for q in range(QUEUES):
        assert first[q] == sorted(first[q]) and len(set(first[q])) == len(first[q]), f"queue {q} out of order"
        got = second[q]
        assert got == list(range(got[0], PER_QUEUE)), f"queue {q}: the second consumer skipped or reordered {got}"
        # No gap at the hand-over: the second starts at or before the first one's next message.
        assert got[0] <= (first[q][-1] + 1 if first[q] else 0)
    # The dead consumer's queues were taken only after the broker's lock had expired.
    waits = [second_times[q] - killed_at for q in held_by_first]
    assert min(waits) > 0
    print(f"hand-over after kill: {min(waits):.2f}-{max(waits):.2f} s (lock max live {LOCK_TTL_MS} ms)")


async def test_a_live_orderly_consumers_lock_is_refused_to_another_until_it_expires(broker_factory):
    broker = broker_factory("--queue-lock-max-live-ms", str(LOCK_TTL_MS))
    async with Producer(broker.namesrv, "PG_lock") as producer:
        await producer.send("Locked", b"x")
    a, b = PullConsumer(broker.namesrv, "CG_lock"), PullConsumer(broker.namesrv, "CG_lock")
    try:
        queues = await a.fetch_queues("Locked")
        await b.fetch_queues("Locked")
        assert await a.lock_queues(queues) == set(queues)
        assert await b.lock_queues(queues) == set()               # held, and not expired
        assert await a.lock_queues(queues[:1]) == set(queues[:1])  # the holder renews
        await a.unlock_queues(queues[1:])
        assert await b.lock_queues(queues) == set(queues[1:])     # released ones are free at once
    finally:
        await a.shutdown()
        await b.shutdown()


@pytest.mark.parametrize("ttl", ["0", "-1"])
async def test_a_lock_life_of_zero_or_less_is_refused_at_start_not_a_lock_granted_to_everyone(broker_factory, ttl):
    """--queue-lock-max-live-ms 0 (or -1) was taken: every lock lapsed the moment it was granted, and two consumers
    of one group asking for the same 4 queues were both granted all 4 (both consumed each queue at once, out of
    order, with nothing said). Now the broker does not start, and says which setting and why."""
    with pytest.raises(RuntimeError) as refused:
        broker_factory("--queue-lock-max-live-ms", ttl)
    assert f"queue_lock_max_live_ms={ttl} must be positive" in str(refused.value)


async def test_a_lock_life_below_what_clients_trust_a_lock_is_warned_at_start(broker_factory):
    """A lock lapsing before the 30 s a stock orderly consumer trusts it is granted to another consumer while its
    holder still consumes the queue: legal (tests shorten it), but said at start, naming the setting."""
    broker = broker_factory("--queue-lock-max-live-ms", str(LOCK_TTL_MS))
    assert f"queue_lock_max_live_ms={LOCK_TTL_MS} is below the 30000 ms" in broker.log()
    quiet = broker_factory(store="quiet")
    assert "queue_lock_max_live_ms" not in quiet.log()


async def test_broadcasting_consumers_each_get_every_message_and_keep_their_own_offsets(broker, tmp_path):
    topic, group = "News", "CG_broadcast"
    async with Producer(broker.namesrv, "PG_broadcast") as producer:
        for i in range(40):
            await producer.send(topic, f"n{i}".encode())

    class Seen(list):
        """Bodies consumed, and a way to wait until there are n of them."""
        def __init__(self):
            super().__init__()
            self.grew = asyncio.Condition()

        async def reach(self, n: int) -> None:
            async with self.grew:
                await self.grew.wait_for(lambda: len(self) >= n)

    def make(name: str, seen: Seen):
        async def listener(msg):
            seen.append(msg.body.decode())
            async with seen.grew:
                seen.grew.notify_all()
            return ConsumeStatus.CONSUME_SUCCESS
        c = PushConsumer(broker.namesrv, group, listener, message_model="BROADCASTING", instance_name=name,
                         offset_store_dir=str(tmp_path / "offsets"), consume_from="first", suspend_ms=500)
        c.subscribe(topic)
        return c

    seen_a, seen_b = Seen(), Seen()
    a, b = make("a", seen_a), make("b", seen_b)
    async with asyncio.timeout(30):
        await a.start()
        await b.start()
        await asyncio.gather(seen_a.reach(40), seen_b.reach(40))
        await a.shutdown()
        assert sorted(seen_a) == sorted(seen_b) == sorted(f"n{i}" for i in range(40))
        assert list((tmp_path / "offsets").glob("*@a/CG_broadcast/offsets.json"))

        async with Producer(broker.namesrv, "PG_broadcast") as producer:
            for i in range(40, 50):
                await producer.send(topic, f"n{i}".encode())
        again = Seen()
        a2 = make("a", again)                                   # the same instance starts where it stopped
        await a2.start()
        await asyncio.gather(again.reach(10), seen_b.reach(50))
        await a2.shutdown()
        await b.shutdown()
    assert sorted(again) == sorted(f"n{i}" for i in range(40, 50))
    assert sorted(seen_b) == sorted(f"n{i}" for i in range(50))
    # Each consumer's progress is its own file: both read all 50 messages of the topic's queues.
    for name in ("a", "b"):
        (path,) = (tmp_path / "offsets").glob(f"*@{name}/{group}/offsets.json")
        table = json.loads(path.read_text())["offsetTable"]
        assert sum(v for k, v in table.items() if k.startswith(f"{topic}@")) == 50


async def test_an_unknown_message_model_is_refused_at_once():
    with pytest.raises(ValueError, match="BROADCASTING"):
        PushConsumer("127.0.0.1:1", "CG_x", lambda m: ConsumeStatus.CONSUME_SUCCESS, message_model="broadcast")


@pytest.mark.parametrize("options, named", [
    (dict(lock_interval_s=0), "lock_interval_s=0"), (dict(lock_interval_s=-1), "lock_interval_s=-1"),
    (dict(lock_retry_s=0), "lock_retry_s=0"), (dict(lock_expire_s=0), "lock_expire_s=0"),
    (dict(lock_interval_s=30, lock_expire_s=30), "must be below lock_expire_s"),
])
async def test_lock_periods_that_spin_or_lapse_between_renewals_are_refused_at_once(options, named):
    """lock_interval_s=0 was taken: the lock loop asked with no pause, 3,856 LOCK_BATCH_MQ in 2 s from one consumer
    of one queue; an interval at or past lock_expire_s let each lock lapse here before its renewal."""
    with pytest.raises(ValueError, match=named):
        PushConsumer("127.0.0.1:1", "CG_x", lambda m: ConsumeStatus.CONSUME_SUCCESS, orderly=True, **options)


@pytest.mark.parametrize("suspend_s", [0, -1, float("nan")])
@pytest.mark.parametrize("model", ["CLUSTERING", "BROADCASTING"])
async def test_a_suspend_of_zero_or_less_is_refused_at_once_not_a_failing_message_retried_in_a_spin(suspend_s, model):
    """suspend_s=0 was taken: an orderly (or broadcasting) message its listener failed was retried in place with no
    pause, 135,036 listener calls in 1 s on one queue with max_reconsume_times=-1, for good (RocketMQ's orderly
    consumer waits at least 10 ms, ConsumeMessageOrderlyService.submitConsumeRequestLater)."""
    with pytest.raises(ValueError, match=f"suspend_s={suspend_s!r}: more than 0 seconds"):
        PushConsumer("127.0.0.1:1", "CG_x", lambda m: ConsumeStatus.CONSUME_SUCCESS, orderly=model == "CLUSTERING",
                     message_model=model, suspend_s=suspend_s)


@pytest.mark.parametrize("where", ["CONSUME_FROM_TIMESTAMP", "CONSUME_FROM_FIRST_OFFSET", "LAST"])
async def test_an_unknown_consume_from_is_refused_at_once(where):
    """Anything but "first" was "last": a queue with no offset started at its end (its start stored as such),
    while the heartbeat told the brokers CONSUME_FROM_FIRST_OFFSET. Only "first", "last" and "timestamp" are
    taken now, not Java's enum names."""
    with pytest.raises(ValueError, match="first"):
        PushConsumer("127.0.0.1:1", "CG_x", lambda m: ConsumeStatus.CONSUME_SUCCESS, consume_from=where)


def _broadcasting_from_last(broker, tmp_path, group: str, instance: str) -> tuple[PushConsumer, asyncio.Queue]:
    """A BROADCASTING consumer starting at the end, its offsets under tmp_path, no flush round in the test's time;
    and the queue its messages arrive on."""
    got: asyncio.Queue = asyncio.Queue()

    async def listener(msg):
        got.put_nowait(msg)
        return ConsumeStatus.CONSUME_SUCCESS

    return PushConsumer(broker.namesrv, group, listener, message_model="BROADCASTING", instance_name=instance,
                        offset_store_dir=str(tmp_path / "offsets"), consume_from="last", suspend_ms=300,
                        offset_commit_interval_s=3600), got


async def _first_probe(producer, topic: str, got: asyncio.Queue):
    """Probes until one arrives (the test's deadline bounds it): those sent before a queue's loop read its end are
    passed over, as they should be."""
    while True:
        await producer.send(topic, b"probe")
        try:
            return await asyncio.wait_for(got.get(), 0.5)
        except asyncio.TimeoutError:
            continue


@bounded(30)
async def test_a_broadcasting_consumers_start_at_the_end_is_saved_before_its_first_message(broker, tmp_path):
    """consume_from="last": a queue this consumer never read starts at its end, and that start was saved only at the
    first flush of its offsets (offset_commit_interval_s): killed before it, the consumer started again at the end
    of that moment and passed over everything sent meanwhile. The start is in the file before the first message."""
    topic, group = "NewsFromNow", "CG_broadcast_last"
    consumer, got = _broadcasting_from_last(broker, tmp_path, group, "late")
    consumer.subscribe(topic)
    async with Producer(broker.namesrv, "PG_broadcast_last") as producer:
        await producer.send(topic, b"before")          # makes the topic: never this consumer's to read
        await consumer.start()
        try:
            first = await _first_probe(producer, topic, got)
            saved = list((tmp_path / "offsets").glob(f"*@late/{group}/offsets.json"))    # no flush round yet
            assert saved, "no start saved before the first message: killed now, it starts at the end again"
            table = json.loads(saved[0].read_text())["offsetTable"]
            (start,) = [v for k, v in table.items() if k.startswith(f"{topic}@") and k.endswith(f"@{first.queue_id}")]
            assert start <= first.queue_offset, (start, first.queue_offset)
        finally:
            await consumer.shutdown()


@bounded(30)
async def test_a_start_that_cannot_be_saved_is_said_and_consuming_goes_on(broker, tmp_path, caplog):
    """The start anchor's failure path: the offsets file cannot be written (a directory where its temporary file
    goes). Each queue's start is said not stored, at WARNING, and the queue is consumed all the same (the commit
    round tries again)."""
    topic, group = "NewsUnsaved", "CG_broadcast_unsaved"
    consumer, got = _broadcasting_from_last(broker, tmp_path, group, "unsaved")
    consumer.offset_store.path.with_suffix(".tmp").mkdir(parents=True)
    consumer.subscribe(topic)
    async with Producer(broker.namesrv, "PG_broadcast_unsaved") as producer:
        await producer.send(topic, b"before")          # makes the topic
        with caplog.at_level(logging.WARNING, logger="txmq.consumer"):
            await consumer.start()
            try:
                await _first_probe(producer, topic, got)
            finally:
                await consumer.shutdown()
    said = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
    assert said and all(group in line and "Is a directory" in line for line in said), said


@bounded(30)
async def test_a_group_set_to_refuse_broadcast_is_not_consumed_by_broadcast(broker):
    """consumeBroadcastEnable=false (UPDATE_AND_CREATE_SUBSCRIPTIONGROUP) refuses the pulls of the group's
    BROADCASTING consumers, as RocketMQ does; it was stored and shown by the admin tools, and changed nothing."""
    host, _, port = broker.broker.rpartition(":")
    conn = await open_connection(host, int(port))

    async def call(code, fields=None, body=b""):
        return await conn.request(RemotingCommand.request(code, fields, body), 5)

    try:
        for group in ("CG_no_broadcast", "CG_clustering"):
            resp = await call(RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
                              body=json.dumps({"groupName": group, "consumeBroadcastEnable": False}).encode())
            assert resp.code == ResponseCode.SUCCESS, resp.remark
        resp = await call(RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic": "News", "readQueueNums": 1,
                                                                "writeQueueNums": 1, "perm": 6})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        sub = {"topic": "News", "subString": "*", "tagsSet": [], "codeSet": [], "subVersion": 1,
               "expressionType": "TAG", "classFilterMode": False}
        body = json.dumps({"clientID": "127.0.0.1@bc", "producerDataSet": [], "consumerDataSet": [
            {"groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": model,
             "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "unitMode": False, "subscriptionDataSet": [sub]}
            for group, model in (("CG_no_broadcast", "BROADCASTING"), ("CG_clustering", "CLUSTERING"))]}).encode()
        assert (await call(RequestCode.HEART_BEAT, body=body)).code == ResponseCode.SUCCESS
        codes = {}
        for group in ("CG_no_broadcast", "CG_clustering"):
            # a Java push consumer's pull: no subscription in it (postSubscriptionWhenPull=false)
            resp = await call(RequestCode.PULL_MESSAGE, {
                "consumerGroup": group, "topic": "News", "queueId": 0, "queueOffset": 0, "maxMsgNums": 32,
                "sysFlag": 0, "commitOffset": 0, "suspendTimeoutMillis": 0, "subVersion": 1})
            codes[group] = (resp.code, resp.remark)
    finally:
        conn.close()
    assert codes["CG_no_broadcast"] == (ResponseCode.NO_PERMISSION,
                                        "the consumer group[CG_no_broadcast] can not consume by broadcast way")
    assert codes["CG_clustering"][0] == ResponseCode.PULL_NOT_FOUND


@bounded(30)
async def test_a_group_set_not_to_be_notified_is_not_told_of_joins_and_leaves(broker):
    """notifyConsumerIdsChangedEnable=false: no NOTIFY_CONSUMER_IDS_CHANGED when a consumer of the group joins
    (HEART_BEAT) or leaves (UNREGISTER_CLIENT), as RocketMQ; it was stored and shown, and every join still
    made the whole group rebalance at once. A group left at the default is told, as before."""
    host, _, port = broker.broker.rpartition(":")
    told = defaultdict(list)

    both_told = asyncio.Event()

    def listener(name):
        def handle(conn, cmd):
            if cmd.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
                told[name].append(cmd.ext_fields.get("consumerGroup"))
                if told["first"].count("CG_told") >= 2:
                    both_told.set()
        return handle

    first = await open_connection(host, int(port), listener("first"))
    second = await open_connection(host, int(port), listener("second"))

    def heartbeat(client_id):
        sub = {"topic": "Quiet", "subString": "*", "tagsSet": [], "codeSet": [], "subVersion": 1,
               "expressionType": "TAG", "classFilterMode": False}
        return RemotingCommand.request(RequestCode.HEART_BEAT, None, json.dumps({
            "clientID": client_id, "producerDataSet": [], "consumerDataSet": [
                {"groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                 "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False, "subscriptionDataSet": [sub]}
                for group in ("CG_quiet", "CG_told")]}).encode())

    try:
        resp = await first.request(RemotingCommand.request(
            RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
            body=json.dumps({"groupName": "CG_quiet", "notifyConsumerIdsChangedEnable": False}).encode()), 5)
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        assert (await first.request(heartbeat("127.0.0.1@first"), 5)).code == ResponseCode.SUCCESS
        assert (await second.request(heartbeat("127.0.0.1@second"), 5)).code == ResponseCode.SUCCESS
        for group in ("CG_quiet", "CG_told"):
            left = await second.request(RemotingCommand.request(RequestCode.UNREGISTER_CLIENT, {
                "clientID": "127.0.0.1@second", "consumerGroup": group}), 5)
            assert left.code == ResponseCode.SUCCESS
        # Its own join is told at once; the second's join and leaving at once too or, when they come within
        # NOTICE_GAP_S of that, together at the gap's end (a fast machine): two notices or three.
        await both_told.wait()
        await first.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": "Quiet", "queueId": 0}), 5)
    finally:
        first.close()
        second.close()
    assert "CG_quiet" not in told["first"] + told["second"]
    assert 2 <= told["first"].count("CG_told") <= 3


@bounded(30)
async def test_enums_sent_as_ordinals_by_the_cpp_client_are_read_as_java_reads_them(broker):
    """rocketmq-client-cpp 1.x heartbeats carry messageModel, consumeType and consumeFromWhere as Java enum
    ordinals (shared/vectors/rocketmq-0.4.4.jsonl). 0 (BROADCASTING, CONSUME_ACTIVELY) was taken as "none":
    a C++ broadcasting pull consumer was listed as a CLUSTERING push consumer, and a group that refuses
    broadcast consumption was consumed by broadcast."""
    host, _, port = broker.broker.rpartition(":")
    conn = await open_connection(host, int(port))

    async def call(code, fields=None, body=b""):
        return await conn.request(RemotingCommand.request(code, fields, body), 5)

    try:
        resp = await call(RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
                          body=json.dumps({"groupName": "GID_cpp", "consumeBroadcastEnable": False}).encode())
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        resp = await call(RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic": "CppNews", "readQueueNums": 1,
                                                                "writeQueueNums": 1, "perm": 6})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        body = json.dumps({"clientID": "22784-127.0.0.1@DEFAULT", "consumerDataSet": [
            {"consumeFromWhere": 4, "consumeType": 0, "groupName": "GID_cpp", "messageModel": 0,
             "subscriptionDataSet": [{"subString": "*", "subVersion": "1795269198281", "topic": "CppNews"}]}]})
        assert (await call(RequestCode.HEART_BEAT, body=body.encode())).code == ResponseCode.SUCCESS
        listed = await call(RequestCode.GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": "GID_cpp"})
        assert listed.code == ResponseCode.SUCCESS, listed.remark
        shown = json.loads(listed.body_bytes())
        assert (shown["messageModel"], shown["consumeType"], shown["consumeFromWhere"]) == (
            "BROADCASTING", "CONSUME_ACTIVELY", "CONSUME_FROM_FIRST_OFFSET")
        pulled = await call(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "GID_cpp", "topic": "CppNews", "queueId": 0, "queueOffset": 0, "maxMsgNums": 32,
            "sysFlag": 0, "commitOffset": 0, "suspendTimeoutMillis": 0, "subVersion": 0})
        assert (pulled.code, pulled.remark) == (ResponseCode.NO_PERMISSION,
                                                "the consumer group[GID_cpp] can not consume by broadcast way")
    finally:
        conn.close()


@bounded(30)
async def test_an_orderly_queue_locked_again_after_its_lock_lapsed_goes_on_where_it_was(broker):
    """An orderly consumer whose local lock lapses (renewals failed for lock_expire_s) stops, waits for the
    lock and, once it has it again, reads where to go on. It read only the broker's offset, committed every
    offset_commit_interval_s: with no one else having taken the queue meanwhile, the messages it had consumed
    since the last commit were consumed again, after later ones: old states replayed over newer ones, in a
    consumer that promised order. It goes on from the later of that offset and its own progress: everything
    before its own was consumed (by it), and one further on was consumed by whoever held the queue meanwhile."""
    topic, group = "Steps", "CG_relock"
    async with Producer(broker.namesrv, "PG_relock") as producer:
        [queue, *_] = await producer.routes.publish_queues(topic)
        for step in ("created", "paid", "shipped"):
            await producer.send(topic, step.encode(), queue=queue)
    seen, shipped = [], asyncio.Event()
    consumer = None

    def listener(msg):
        seen.append(msg.body.decode())
        if seen == ["created", "paid"]:     # the renewals failed for lock_expire_s: the lock lapses here
            [mq] = [q for q in consumer._locks if (q.topic, q.queue_id) == (topic, queue.queue_id)]
            consumer._locks[mq] -= consumer.lock_expire_s + 1
        if msg.body == b"shipped" or len(seen) >= 5:
            shipped.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(broker.namesrv, group, listener, orderly=True, consume_from="first",
                            lock_interval_s=0.2, lock_retry_s=0.05, offset_commit_interval_s=600, suspend_ms=500)
    consumer.subscribe(topic)
    async with consumer:
        await shipped.wait()
    assert seen == ["created", "paid", "shipped"], seen


@pytest.mark.parametrize("known", ["committed", "read"])
@bounded(30)
async def test_an_operators_reset_made_while_the_lock_had_lapsed_is_followed_when_it_is_locked_again(broker, known):
    """An operator resets the group back (admin reset-offset) while this consumer's lock has lapsed, as it does
    when its connection is down, so the broker could not tell it. Locked again, the consumer went on from its own
    progress, further than the reset: the reset was undone, unsaid. A stored offset below the one this consumer
    last committed was moved back by someone else (a queue's other owners only ever move it on from there):
    that one is followed. The offset it knows stored is the one it committed last, or read at its start."""
    topic, group = "StepsReset", "CG_relock_reset"
    async with Producer(broker.namesrv, "PG_relock_reset") as producer:
        [queue, *_] = await producer.routes.publish_queues(topic)
        for step in ("a", "b", "c", "d"):
            await producer.send(topic, step.encode(), queue=queue)
    if known == "read":     # the group stopped after a before: this consumer starts at b and commits nothing
        before = PullConsumer(broker.namesrv, group)
        await before.fetch_queues(topic)
        await before.commit_offset(queue, 1)
        await before.shutdown()
    seen, done = [], asyncio.Event()
    consumer = None

    async def listener(msg):
        seen.append(msg.body.decode())
        [mq] = [q for q in consumer._locks if (q.topic, q.queue_id) == (topic, queue.queue_id)]
        if seen[-2:] == ["b", "c"] and seen.count("c") == 1:
            if known == "committed":
                await consumer._commit(mq)          # a and b: the commit loop's round
                assert consumer._committed[mq] == 2
            conn = await open_connection("127.0.0.1", broker.broker_port)
            try:
                resp = await conn.request(RemotingCommand.request(RequestCode.INVOKE_BROKER_TO_RESET_OFFSET, {
                    "topic": topic, "group": group, "timestamp": 0, "isForce": True, "queueId": queue.queue_id,
                    "offset": 0}), 5)
            finally:
                conn.close()
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            consumer._locks[mq] -= consumer.lock_expire_s + 1      # the lock lapses
        if seen[-1] == "d":
            done.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(broker.namesrv, group, listener, orderly=True, consume_from="first",
                            lock_interval_s=0.2, lock_retry_s=0.05, offset_commit_interval_s=600, suspend_ms=500)
    consumer.client.on_reset_offset = None      # not told: its connection was down when the reset was made
    consumer.subscribe(topic)
    async with consumer:
        await done.wait()
    assert seen == (["a"] if known == "committed" else []) + ["b", "c", "a", "b", "c", "d"], seen
