"""Producer(batch_size, linger_ms): concurrent sends leave as SEND_BATCH_MESSAGE, each keeps its own identity."""
from __future__ import annotations

import asyncio

import pytest

from consumer import PullConsumer
from producer import Producer, SendStatus
from protocol.message import Prop

pytestmark = pytest.mark.asyncio


async def _pull_all(namesrv: str, topic: str, expect: int) -> list:
    consumer = PullConsumer(namesrv, f"CG_{topic}")
    got = []
    try:
        for mq in await consumer.fetch_queues(topic):
            offset = 0
            while True:
                res = await consumer.pull(mq, offset, max_nums=64)
                if not res.messages:
                    break
                got += res.messages
                offset = res.next_begin_offset
    finally:
        await consumer.shutdown()
    assert len(got) == expect
    return got


async def test_gathered_sends_are_separate_messages_with_their_own_results(broker):
    async with asyncio.timeout(30):
        async with Producer(broker.namesrv, "PG_linger", batch_size=16, linger_ms=50) as producer:
            await producer.send("Lingered", b"warm-up")           # creates the topic
            results = await asyncio.gather(*(
                producer.send("Lingered", f"m{i}".encode(), tags=f"t{i % 3}", keys=f"order-{i}",
                              properties={"trace": str(i)}) for i in range(40)))
        got = await _pull_all(broker.namesrv, "Lingered", 41)
    assert all(r.status is SendStatus.SEND_OK for r in results)
    assert len({r.msg_id for r in results}) == 40                   # a UNIQ_KEY each
    assert len({r.offset_msg_id for r in results}) == 40            # a record each
    assert len({(r.queue.queue_id, r.queue_offset) for r in results}) == 40
    by_body = {m.body: m for m in got}
    for i, r in enumerate(results):
        m = by_body[f"m{i}".encode()]                               # not an encoded batch blob
        assert m.properties[Prop.UNIQ_KEY] == r.msg_id
        assert m.properties[Prop.KEYS] == f"order-{i}"
        assert m.properties[Prop.TAGS] == f"t{i % 3}"
        assert m.properties["trace"] == str(i)
        assert (m.queue_id, m.queue_offset) == (r.queue.queue_id, r.queue_offset)
        assert m.offset_msg_id == r.offset_msg_id


async def test_shutdown_sends_what_is_still_lingering(broker):
    async with asyncio.timeout(30):
        producer = await Producer(broker.namesrv, "PG_linger2", batch_size=1000, linger_ms=60_000).start()
        pending = [asyncio.ensure_future(producer.send("Lingered2", f"m{i}".encode())) for i in range(6)]
        await asyncio.wait(pending, timeout=0.5)                     # they linger: nobody fills the batch ...
        assert not any(p.done() for p in pending)
        await producer.shutdown()                                    # ... until shutdown sends it
        assert all(p.result().status is SendStatus.SEND_OK for p in pending)
        await _pull_all(broker.namesrv, "Lingered2", 6)


async def test_one_message_the_broker_refuses_fails_alone_not_its_whole_batch(broker):
    """Sends gathered into one batch are strangers to each other: the broker refuses a batch for what one entry
    holds (here properties past RocketMQ's 32767 bytes), and every other send in it failed with that error."""
    from protocol.errors import MessageIllegalError
    async with asyncio.timeout(30):
        async with Producer(broker.namesrv, "PG_alone", batch_size=16, linger_ms=50) as producer:
            await producer.send("Strangers", b"warm-up")
            sends = [producer.send("Strangers", f"ok{i}".encode()) for i in range(3)]
            sends.insert(1, producer.send("Strangers", b"bad", properties={"note": "x" * 40000}))
            results = await asyncio.gather(*sends, return_exceptions=True)
        got = await _pull_all(broker.namesrv, "Strangers", 4)
    assert isinstance(results[1], MessageIllegalError), results[1]
    assert [r.status for i, r in enumerate(results) if i != 1] == [SendStatus.SEND_OK] * 3
    assert sorted(m.body for m in got) == [b"ok0", b"ok1", b"ok2", b"warm-up"]


async def test_a_batch_the_broker_refuses_as_a_whole_is_sent_again_message_by_message(broker):
    """With max_batch_bytes above the broker's message size limit (4 MiB), two 3 MiB sends gathered together made
    a batch the broker refuses (MESSAGE_ILLEGAL), and both failed although each alone is fine."""
    body = b"y" * (3 << 20)
    async with asyncio.timeout(60):
        async with Producer(broker.namesrv, "PG_big", batch_size=4, linger_ms=50, max_batch_bytes=8 << 20,
                            send_timeout=20) as producer:
            await producer.send("BigOnes", b"warm-up")
            results = await asyncio.gather(producer.send("BigOnes", body), producer.send("BigOnes", body))
        got = await _pull_all(broker.namesrv, "BigOnes", 3)
    assert [r.status for r in results] == [SendStatus.SEND_OK] * 2
    assert sorted(len(m.body) for m in got) == [7, 3 << 20, 3 << 20]


async def test_a_message_whose_properties_cannot_be_encoded_fails_alone_not_its_whole_batch(broker):
    """A property holding a lone surrogate (a file name decoded with surrogateescape) cannot be written as UTF-8:
    sent alone it fails its own send, but in a batch the body's encoding failed, and every send gathered with it
    was failed with its UnicodeEncodeError, though nothing of theirs was at fault."""
    async with asyncio.timeout(30):
        async with Producer(broker.namesrv, "PG_surrogate", batch_size=16, linger_ms=50) as producer:
            await producer.send("Surrogates", b"warm-up")
            sends = [producer.send("Surrogates", f"ok{i}".encode()) for i in range(3)]
            sends.insert(1, producer.send("Surrogates", b"bad", properties={"file": "report-\udcff.csv"}))
            results = await asyncio.gather(*sends, return_exceptions=True)
        got = await _pull_all(broker.namesrv, "Surrogates", 4)
    assert isinstance(results[1], UnicodeEncodeError), results[1]
    assert [r.status for i, r in enumerate(results) if i != 1] == [SendStatus.SEND_OK] * 3
    assert sorted(m.body for m in got) == [b"ok0", b"ok1", b"ok2", b"warm-up"]


async def test_a_cancelled_shutdown_leaves_the_batched_sends_in_flight_to_their_answers(broker):
    """shutdown() waits for the batches in flight. Cancelled meanwhile (an application's own deadline on its
    shutdown), it cancelled them too, and the sends gathered in them were never resolved: their callers waited
    for ever. The batches go on to their answers, as sends without batching do."""
    import os
    import signal
    async with asyncio.timeout(60):
        producer = await Producer(broker.namesrv, "PG_cancelled", batch_size=4, send_timeout=20).start()
        try:
            await producer.send("Cancelled", b"warm-up")
            os.kill(broker.proc.pid, signal.SIGSTOP)        # the broker answers slowly: the batch stays in flight
            try:
                send = asyncio.ensure_future(producer.send("Cancelled", b"in flight"))
                while not producer._accumulator._in_flight:
                    await asyncio.sleep(0)
                stopping = asyncio.ensure_future(producer.shutdown())
                await asyncio.sleep(0)                      # shutdown waits for the batch in flight ...
                stopping.cancel()                           # ... and is cancelled there
                await asyncio.gather(stopping, return_exceptions=True)
            finally:
                os.kill(broker.proc.pid, signal.SIGCONT)
            result = await send                             # answered once the broker reads again
            assert result.status is SendStatus.SEND_OK
        finally:
            await producer.shutdown()
    await _pull_all(broker.namesrv, "Cancelled", 2)


async def test_a_batch_is_bounded_by_its_properties_not_only_its_bodies(broker):
    """max_batch_bytes counted the bodies alone: 150 sends of 100 bytes with 30,000 bytes of properties each made one
    batch of 4.5 MB, which the broker refuses (past its 4 MiB max_message_size), and every send went again alone.
    The entries' whole size counts: batches of at most 1 MiB (34 such sends), each stored as one run of its queue."""
    props = {"k": "p" * 30_000}
    async with asyncio.timeout(60):
        async with Producer(broker.namesrv, "PG_propsize", batch_size=1000, linger_ms=200,
                            send_timeout=20) as producer:
            await producer.send("PropSized", b"warm-up")
            results = await asyncio.gather(*(producer.send("PropSized", b"b" * 100, properties=props)
                                             for _ in range(150)))
        await _pull_all(broker.namesrv, "PropSized", 151)
    # a batch is stored as one run of consecutive offsets in one queue: count the runs of the sends, in order
    runs = [1]
    for before, r in zip(results, results[1:]):
        if r.queue == before.queue and r.queue_offset == before.queue_offset + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    per_batch = (1 << 20) // (22 + 100 + 30_004)
    assert max(runs) <= per_batch, runs
    assert len(runs) <= -(-150 // per_batch) + 1, runs      # gathered, not sent one by one
