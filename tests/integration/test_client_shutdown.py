"""Our clients' shutdown against the real broker: a push consumer lets the listener call in hand finish
(within shutdown_grace_s), commits what was consumed and leaves the rest to the next consumer; an orderly
one keeps its queue locked until then; unlocking asks every broker even when one is down; a transaction
producer answers the check in hand before it closes and takes no new one.

Each topic here has one queue, so its messages are consumed strictly in order and "the next consumer
starts exactly after the message in hand" is a plain list comparison."""
from __future__ import annotations

import asyncio
import json
import logging
import signal

import pytest

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode
from protocol.errors import BrokerError, ClientClosedError
from tests.support.broker_process import BrokerProcess
from tests.support.bounded import bounded
from tests.support.cluster_process import (NamesrvProcess, cluster_flags, create_topic, request, stored_count,
                                           wait_for_route)
from tests.support.delays import FAST

pytestmark = pytest.mark.asyncio
BODIES = [f"m{i}".encode() for i in range(10)]


async def _one_queue_topic(broker, topic: str) -> str:
    await create_topic(broker.broker, topic, 1)
    async with Producer(broker.namesrv, "PG_shutdown") as producer:
        for body in BODIES:
            await producer.send(topic, body)
    return topic


async def _committed(namesrv: str, group: str, topic: str) -> int | None:
    """``group``'s committed offset of ``topic``'s one queue."""
    probe = PullConsumer(namesrv, group)
    try:
        return await probe.fetch_offset((await probe.fetch_queues(topic))[0])
    finally:
        await probe.shutdown()


async def _blocked_then_shutdown(consumer: PushConsumer, entered: asyncio.Event, during=None) -> float:
    """Start ``consumer``, wait until its listener holds a message, start shutdown, run ``during()``
    while shutdown waits, and return how long shutdown took."""
    loop = asyncio.get_running_loop()
    await consumer.start()
    await entered.wait()
    began = loop.time()
    stopping = loop.create_task(consumer.shutdown())
    while not consumer.shutting_down:     # its first step (stop pulling, pick the loops to wait for) is done
        await asyncio.sleep(0)
    if during is not None:
        await during()
    await stopping
    return loop.time() - began


async def _next_consumer_gets(namesrv: str, group: str, topic: str, count: int, **options) -> list:
    """What a fresh consumer of ``group`` is given, once it has been given ``count`` messages."""
    got = []
    enough = asyncio.Event()

    def listener(msg):
        got.append(msg)
        if len(got) >= count:
            enough.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(namesrv, group, listener, consume_from="first", suspend_ms=300, **options)
    consumer.subscribe(topic)
    async with consumer:
        await enough.wait()
    return got


async def test_shutdown_lets_the_message_in_hand_finish_commits_it_and_leaves_the_rest(broker_factory):
    broker = broker_factory(*FAST)
    topic = await _one_queue_topic(broker, "Graceful")
    entered, release = asyncio.Event(), asyncio.Event()
    finished = []

    async def listener(msg):
        entered.set()
        await release.wait()
        finished.append(msg.body)
        return ConsumeStatus.CONSUME_SUCCESS

    first = PushConsumer(broker.namesrv, "CG_grace", listener, consume_from="first", suspend_ms=300,
                         shutdown_grace_s=10)
    first.subscribe("Graceful")

    async def released():
        assert not finished
        release.set()

    async with asyncio.timeout(30):
        await _blocked_then_shutdown(first, entered, released)
        assert finished == [b"m0"]                  # not cancelled mid-way, and nothing after it taken
        assert await _committed(broker.namesrv, "CG_grace", topic) == 1
        rest = await _next_consumer_gets(broker.namesrv, "CG_grace", "Graceful", 9)
    assert [m.body for m in rest] == BODIES[1:]     # m0 not again, none lost


async def test_a_message_failed_during_shutdown_is_handed_back_not_lost(broker_factory):
    broker = broker_factory(*FAST)                  # retries come back after 100s of ms
    topic = await _one_queue_topic(broker, "GracefulRetry")
    entered, release = asyncio.Event(), asyncio.Event()

    async def listener(msg):
        entered.set()
        await release.wait()
        return ConsumeStatus.RECONSUME_LATER

    first = PushConsumer(broker.namesrv, "CG_grace_retry", listener, consume_from="first", suspend_ms=300,
                         shutdown_grace_s=10)
    first.subscribe("GracefulRetry")

    async def released():
        release.set()

    async with asyncio.timeout(30):
        await _blocked_then_shutdown(first, entered, released)
        assert await _committed(broker.namesrv, "CG_grace_retry", topic) == 1    # handed back: the queue moves on
        rest = await _next_consumer_gets(broker.namesrv, "CG_grace_retry", "GracefulRetry", 10)
    assert [m.body for m in rest if m.reconsume_times == 0] == BODIES[1:]
    assert [(m.body, m.reconsume_times) for m in rest if m.reconsume_times] == [(b"m0", 1)]


async def test_a_listener_past_the_grace_period_is_cancelled_and_its_message_comes_again(broker_factory):
    broker = broker_factory()
    topic = await _one_queue_topic(broker, "Ungraceful")
    entered = asyncio.Event()
    cancelled = []

    async def listener(msg):
        entered.set()
        try:
            await asyncio.Event().wait()            # never returns
        except asyncio.CancelledError:
            cancelled.append(msg.body)
            raise

    first = PushConsumer(broker.namesrv, "CG_ungraceful", listener, consume_from="first", suspend_ms=300,
                         shutdown_grace_s=0.3)
    first.subscribe("Ungraceful")
    async with asyncio.timeout(30):
        took = await _blocked_then_shutdown(first, entered)
        assert cancelled == [b"m0"]
        # not cancelled before the grace (a bound below, which load cannot break); that it returned at all, not
        # waiting for the listener that never returns, is the timeout's bound (was also "< 5 s": a timed bound)
        assert took >= 0.3, took
        assert await _committed(broker.namesrv, "CG_ungraceful", topic) in (None, 0)
        rest = await _next_consumer_gets(broker.namesrv, "CG_ungraceful", "Ungraceful", 10)
    assert [m.body for m in rest] == BODIES


async def test_an_orderly_consumer_keeps_its_lock_until_the_message_in_hand_is_done(broker_factory):
    broker = broker_factory()
    topic = await _one_queue_topic(broker, "OrderlyGrace")
    entered, release = asyncio.Event(), asyncio.Event()
    finished = []

    async def listener(msg):
        entered.set()
        await release.wait()
        finished.append(msg.body)
        return ConsumeStatus.CONSUME_SUCCESS

    first = PushConsumer(broker.namesrv, "CG_orderly_grace", listener, orderly=True, consume_from="first",
                         suspend_ms=300, shutdown_grace_s=10)
    first.subscribe("OrderlyGrace")
    rival = PullConsumer(broker.namesrv, "CG_orderly_grace")
    queue = (await rival.fetch_queues("OrderlyGrace"))[0]

    async def rival_refused_then_release():
        assert await rival.lock_queues([queue]) == set()     # still held while m0 is in hand
        release.set()

    try:
        async with asyncio.timeout(30):
            await _blocked_then_shutdown(first, entered, rival_refused_then_release)
            assert finished == [b"m0"]
            assert await _committed(broker.namesrv, "CG_orderly_grace", topic) == 1
            assert await rival.lock_queues([queue]) == {queue}   # released at shutdown, not left to expire
            await rival.unlock_queues([queue])
            rest = await _next_consumer_gets(broker.namesrv, "CG_orderly_grace", "OrderlyGrace", 9, orderly=True)
    finally:
        await rival.shutdown()
    assert [m.body for m in rest] == BODIES[1:]


async def test_an_orderly_message_failed_during_shutdown_is_left_in_place_for_the_next_owner(broker_factory):
    broker = broker_factory()
    topic = await _one_queue_topic(broker, "OrderlyFailed")
    entered, release = asyncio.Event(), asyncio.Event()
    calls = []

    async def listener(msg):
        calls.append(msg.body)
        entered.set()
        await release.wait()
        return ConsumeStatus.RECONSUME_LATER

    first = PushConsumer(broker.namesrv, "CG_orderly_failed", listener, orderly=True, consume_from="first",
                         suspend_ms=300, suspend_s=0.2, shutdown_grace_s=10)
    first.subscribe("OrderlyFailed")

    async def released():
        release.set()

    async with asyncio.timeout(30):
        await _blocked_then_shutdown(first, entered, released)
        # Not retried here until the grace period ends, nor skipped: the next owner retries it, in order.
        assert calls == [b"m0"]
        assert await _committed(broker.namesrv, "CG_orderly_failed", topic) in (None, 0)
        rest = await _next_consumer_gets(broker.namesrv, "CG_orderly_failed", "OrderlyFailed", 10, orderly=True)
    assert [m.body for m in rest] == BODIES


async def test_unlock_asks_every_broker_when_one_is_down(tmp_path):
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    brokers = {name: BrokerProcess(tmp_path / name, *cluster_flags(namesrv.addr, name, 1000)).start()
               for name in ("broker-a", "broker-b")}
    holder = PullConsumer(namesrv.addr, "CG_unlock")
    rival = PullConsumer(namesrv.addr, "CG_unlock")
    try:
        async with asyncio.timeout(30):
            for b in brokers.values():
                await create_topic(b.broker, "Locked", 1)
            await wait_for_route(namesrv.addr, "Locked", set(brokers))
            queues = {q.broker_name: q for q in await holder.fetch_queues("Locked")}
            assert await holder.lock_queues(queues.values()) == set(queues.values())
            brokers["broker-b"].kill()
            with pytest.raises(BrokerError):      # broker-b's failure is reported...
                await holder.unlock_queues([queues["broker-b"], queues["broker-a"]])
            # ...and broker-a, asked after it, released its queue all the same
            assert await rival.lock_queues([queues["broker-a"]]) == {queues["broker-a"]}
    finally:
        await holder.shutdown()
        await rival.shutdown()
        for p in [*brokers.values(), namesrv]:
            p.kill()


async def test_a_transaction_check_in_hand_is_answered_before_the_producer_closes(broker_factory):
    broker = broker_factory("--transaction-check-interval-ms", "200", "--transaction-timeout-ms", "300")
    entered, release = asyncio.Event(), asyncio.Event()
    calls = []

    class Listener:
        def execute_local_transaction(self, msg, arg):
            return S.UNKNOW

        async def check_local_transaction(self, msg):
            calls.append(msg.body)
            entered.set()
            await release.wait()
            return S.COMMIT_MESSAGE

    async def pending() -> list:
        resp = await request(broker.broker, RequestCode.TXMQ_LIST_TRANSACTIONS)
        return json.loads(resp.body_bytes())["pending"]

    producer = await TransactionProducer(broker.namesrv, "PG_drain", Listener(), shutdown_grace_s=10).start()
    async with asyncio.timeout(30):
        await producer.send_in_transaction("TxDrain", b"answered at shutdown")
        await entered.wait()
        stopping = asyncio.get_running_loop().create_task(producer.shutdown())
        while not producer.shutting_down:
            await asyncio.sleep(0)
        # The broker asks again (the first check is unanswered): that check is not taken.
        while not stopping.done() and (await pending())[0]["checks"] < 2:
            await asyncio.sleep(0.05)
        assert not stopping.done()                  # shutdown waits for the check in hand
        release.set()
        await stopping
        assert calls == [b"answered at shutdown"]
        assert await pending() == []                # the answer reached the broker before the connection closed
        probe = PullConsumer(broker.namesrv, "CG_drain")
        try:
            got = [m.body for q in await probe.fetch_queues("TxDrain") for m in (await probe.pull(q, 0)).messages]
        finally:
            await probe.shutdown()
    assert got == [b"answered at shutdown"]


@bounded(30)
async def test_producer_shutdown_lets_the_sends_in_flight_have_their_answers(broker):
    """Shutdown closed the connections under the sends in flight: the broker stored them, and their callers
    were told "connection closed" or "connection pool is closed", and sent them again. It waits for their
    answers (each bounded by its own send_timeout), then closes."""
    topic = "ShutdownInFlight"
    await create_topic(broker.broker, topic, 1)
    producer = await Producer(broker.namesrv, "PG_shutdown_in_flight").start()
    await producer.send(topic, b"warm-up")            # route and connection in hand: the sends below all leave now
    sends = [asyncio.create_task(producer.send(topic, b"m%d" % i)) for i in range(1000)]
    await sends[0]
    assert not all(s.done() for s in sends), "every send answered already: nothing in flight to test with"
    await producer.shutdown()
    outcomes = await asyncio.gather(*sends, return_exceptions=True)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert not failed, f"{len(failed)} sends failed, e.g. {failed[0]!r}"
    assert await stored_count(broker.broker, topic, 1) == 1001


@bounded(30)
async def test_producer_shutdown_refuses_new_sends_so_it_ends_while_the_app_keeps_sending(broker):
    """A batching producer's shutdown flushed until nothing was gathered or in flight; an application still
    sending (its workers not stopped yet) kept adding to the batches, and shutdown never returned. Sends
    begun once shutdown has begun are refused now (ClientClosedError, nothing sent), those accepted before
    are flushed and answered, and shutdown ends."""
    topic = "ShutdownStillSending"
    await create_topic(broker.broker, topic, 1)
    producer = await Producer(broker.namesrv, "PG_shutdown_sending", batch_size=16, linger_ms=2).start()
    answered, refused = [], []
    going = asyncio.Event()

    async def worker(w: int) -> None:
        i = 0
        while True:
            try:
                await producer.send(topic, b"w%d-%d" % (w, i))
            except ClientClosedError as exc:
                refused.append(exc)
                return
            answered.append(w)
            going.set()
            i += 1

    workers = [asyncio.create_task(worker(w)) for w in range(8)]
    try:
        while len(answered) < 64:        # every worker under way, its sends gathered into batches
            going.clear()
            await going.wait()
        await producer.shutdown()
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
    assert len(refused) == 8 and "shutting down" in str(refused[0])
    with pytest.raises(ClientClosedError):
        await producer.send(topic, b"after")
    # every send answered was stored, and nothing refused was
    assert await stored_count(broker.broker, topic, 1) == len(answered)

@bounded(30)
async def test_an_offset_the_broker_corrects_is_said(broker_factory, caplog):
    """PULL_OFFSET_MOVED (a committed offset past the queue's end, as after a broker lost its tail; or before
    its start, after retention) moved the consumer on, passing messages over, or back, with nothing said. The
    consumer follows the broker, as RocketMQ's does, and says so, with the offsets (a WARNING, as Java's)."""
    broker = broker_factory()
    topic = await _one_queue_topic(broker, "OffsetMoved")
    probe = PullConsumer(broker.namesrv, "CG_moved")
    try:
        await probe.commit_offset((await probe.fetch_queues(topic))[0], 1000)
    finally:
        await probe.shutdown()
    got, arrived = [], asyncio.Event()

    def listener(msg):
        got.append(msg.body)
        arrived.set()
        return ConsumeStatus.CONSUME_SUCCESS

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "offset 1000" in r.getMessage()]

    consumer = PushConsumer(broker.namesrv, "CG_moved", listener, suspend_ms=300)
    consumer.subscribe(topic)
    with caplog.at_level(logging.WARNING, logger="txmq.consumer"):
        async with consumer:
            while not said():           # the first pull, answered PULL_OFFSET_MOVED
                await asyncio.sleep(0.05)
            async with Producer(broker.namesrv, "PG_moved") as producer:
                await producer.send(topic, b"after")
            await arrived.wait()
    assert got == [b"after"]            # on from the broker's end (10), where the next message went
    assert "from 10" in said()[0], said()


@bounded(60)
async def test_shutdown_with_a_broker_that_does_not_answer_waits_one_timeout_not_one_per_queue(broker_factory,
                                                                                               caplog):
    """Shutdown committed its queues one after another: with their broker stopped (a host gone, a broker
    paused) each waited out its own request timeout, so a consumer of 8 queues took 8 timeouts to close. Its
    commits are sent side by side now, all 8 in flight at once (one timeout bounds them), and the queues whose
    broker did not answer are named in one WARNING. (Was a wall-clock bound, shutdown < 5 s against a 1 s
    timeout: flaky under load; the commits in flight together are what makes it one timeout.)"""
    broker = broker_factory()
    await create_topic(broker.broker, "StoppedBroker", 8)
    async with Producer(broker.namesrv, "PG_stopped") as producer:
        for qid in range(8):
            mq = (await producer.routes.publish_queues("StoppedBroker"))[qid]
            await producer.send("StoppedBroker", b"m%d" % qid, queue=mq)
    got, all_in = [], asyncio.Event()

    def listener(msg):
        got.append(msg.queue_id)
        if len(set(got)) == 8:
            all_in.set()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(broker.namesrv, "CG_stopped", listener, consume_from="first", suspend_ms=300)
    consumer.subscribe("StoppedBroker")
    await consumer.start()
    consumer.client.timeout = 1.0
    committing, peak, asked = set(), [], set()
    commit = consumer._commit

    async def counted(mq, *args, **kwargs):
        committing.add(mq)
        asked.add(mq)
        peak.append(len(committing))
        try:
            return await commit(mq, *args, **kwargs)
        finally:
            committing.discard(mq)
    stopped = False
    try:
        await all_in.wait()
        broker.proc.send_signal(signal.SIGSTOP)
        stopped = True
        consumer._commit = counted          # (the shutdown's commits, counted in flight)
        await asyncio.wait_for(consumer.shutdown(), 30)     # (a generous bound on the wait, not a speed)
    finally:
        if stopped:
            broker.proc.send_signal(signal.SIGCONT)
    # every queue (the 8, and the group's retry queue) in flight together: one timeout, not one per queue
    assert {mq.queue_id for mq in asked if mq.topic == "StoppedBroker"} == set(range(8)), asked
    assert max(peak) == len(asked), (peak, asked)
    said = [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "not committed at shutdown, their broker did not answer" in r.getMessage()]
    assert len(said) == 1 and said[0].count(" of MessageQueue(") == len(asked), said


@pytest.mark.parametrize("batch_size", [1, 16], ids=["plain", "batching"])
@bounded(30)
async def test_producer_shutdown_answers_the_sends_begun_before_it(broker, batch_size):
    """Sends begun before shutdown, still looking their topic's route up when it began (the first sends to a
    topic): not yet requests in flight nor gathered in a batch, shutdown neither flushed nor waited for them.
    They went on once the route came, over a connection shutdown then closed under them (or after it
    closed): failed, or reported failed once stored. Shutdown now waits for every send accepted before it."""
    topic = "ShutdownRouting"
    await create_topic(broker.broker, topic, 1)
    producer = await Producer(broker.namesrv, "PG_shutdown_routing", batch_size=batch_size, linger_ms=2).start()
    sends = [asyncio.create_task(producer.send(topic, b"m%d" % i)) for i in range(20)]
    await asyncio.sleep(0)          # each has begun (accepted) and waits for the route
    assert not any(s.done() for s in sends)
    await producer.shutdown()
    results = await asyncio.gather(*sends, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    assert await stored_count(broker.broker, topic, 1) == 20


@bounded(60)
async def test_a_local_transaction_that_hangs_holds_shutdown_only_for_the_grace(broker_factory, caplog):
    """Shutdown waited for every send_in_transaction begun before it, its local transaction included, with no
    bound and nothing said: an execute_local_transaction awaiting a database that is down held shutdown (and the
    application's exit) for ever, where the checks in hand are given shutdown_grace_s. Local transactions get
    the same grace now, and one still running past it is said; shutdown goes on. Its END cannot be sent once the
    producer is closed: the transaction stays pending and another producer of the group decides it by its check,
    so its message is delivered once."""
    broker = broker_factory("--transaction-check-interval-ms", "200", "--transaction-timeout-ms", "300")
    entered, release = asyncio.Event(), asyncio.Event()

    class Hung:
        async def execute_local_transaction(self, msg, arg):
            entered.set()
            await release.wait()
            return S.COMMIT_MESSAGE

        def check_local_transaction(self, msg):
            return S.COMMIT_MESSAGE

    producer = await TransactionProducer(broker.namesrv, "PG_hung_local", Hung(), shutdown_grace_s=0.5).start()
    sending = asyncio.get_running_loop().create_task(producer.send_in_transaction("TxHungLocal", b"decided once"))
    await entered.wait()
    try:
        # bounded so that the old unbounded wait fails here, not as the whole test's timeout
        await asyncio.wait_for(producer.shutdown(), 20)
    finally:
        release.set()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "local transaction" in
            r.getMessage() and "shutdown_grace_s" in r.getMessage()]
    assert said and "PG_hung_local" in said[0], [r.getMessage() for r in caplog.records]
    result = await sending
    assert result.state is S.COMMIT_MESSAGE and not result.acknowledged
    ended = [r.getMessage() for r in caplog.records if "shut down" in r.getMessage() and
             result.send_result.msg_id in r.getMessage()]
    assert ended, "the END not sent was not said"
    async with TransactionProducer(broker.namesrv, "PG_hung_local", Hung()):
        probe = PullConsumer(broker.namesrv, "CG_hung_local")
        try:
            got = []
            while not got:
                got = [m.body for q in await probe.fetch_queues("TxHungLocal")
                       for m in (await probe.pull(q, 0)).messages]
                await asyncio.sleep(0.05)
        finally:
            await probe.shutdown()
    assert got == [b"decided once"]
