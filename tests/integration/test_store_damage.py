"""A broker started on a store damaged by hand: nothing intact is skipped without a word.

The record heads of old segments (older than the start-up scan verifies) are damaged between two
runs of a real broker; a consumer pulling the queue from the start must get every message before
the damage, then an error naming the queue (never the messages after it instead), and after a
restart (which rebuilds the queue) every message but the damaged one.
"""
from __future__ import annotations

import os
import urllib.request

import pytest

from consumer import PullConsumer
from consumer.pull_consumer import MessageQueue
from producer import Producer
from protocol.errors import BrokerError
from protocol.message import MESSAGE_MAGIC, decode_record
from tests.support.broker_process import BrokerProcess

pytestmark = pytest.mark.asyncio

SEG = 256 * 1024
FLAGS = ("--segment-size", str(SEG), "--max-message-size", str(16 * 1024))
N = 600             # about five segments of 2 KiB records: the damaged one is older than the scan verifies


async def _send(b) -> MessageQueue:
    async with Producer(b.namesrv, "PG_damage") as producer:
        await producer.send("Damage", b"seed")
        mq = (await producer.routes.publish_queues("Damage"))[0]
        for i in range(N):
            await producer.send("Damage", f"{i:05d}".encode() + bytes(2000), queue=mq)
    return MessageQueue("Damage", mq.broker_name, mq.queue_id)


async def _drain(b, mq) -> tuple[list[bytes], str | None]:
    """Bodies pulled from offset 0 until the end or an error; the error's text, if any."""
    consumer = PullConsumer(b.namesrv, "CG_damage")
    await consumer.fetch_queues(mq.topic)
    bodies, offset, error = [], 0, None
    try:
        for _ in range(N):                      # a bound: 32 a pull needs far fewer
            try:
                res = await consumer.pull(mq, offset, max_nums=32)
            except BrokerError as exc:
                error = str(exc)
                break
            bodies += [m.body[:5] for m in res.messages]
            if res.next_begin_offset >= res.max_offset:
                break
            offset = res.next_begin_offset
    finally:
        await consumer.shutdown()
    return bodies, error


def _damage_a_record(store_dir, mq) -> bytes:
    """Zero the magic of the 20th record of ``mq`` in the first segment; returns its body's first bytes."""
    path = os.path.join(store_dir, "commitlog", f"{0:020d}")
    with open(path, "r+b") as f:
        data = f.read(SEG)
        pos, seen = 0, 0
        while True:
            size = int.from_bytes(data[pos:pos + 4], "big")
            assert int.from_bytes(data[pos + 4:pos + 8], "big", signed=True) == MESSAGE_MAGIC
            msg, _ = decode_record(data[pos:pos + size])
            if msg.topic == "Damage" and msg.queue_id == mq.queue_id:
                seen += 1
                if seen == 20:
                    f.seek(pos + 4)
                    f.write(bytes(4))
                    return msg.body[:5]
            pos += size


async def test_a_damaged_record_in_an_old_segment_is_reported_and_the_rest_is_served(broker_factory, tmp_path):
    b = broker_factory(*FLAGS)
    mq = await _send(b)
    sent, error = await _drain(b, mq)
    assert error is None and len(sent) == N + 1
    assert b.stop() == 0
    lost = _damage_a_record(tmp_path / "store", mq)
    assert len(os.listdir(tmp_path / "store" / "commitlog")) >= 5

    b = broker_factory(*FLAGS)
    got, error = await _drain(b, mq)
    before = sent[:sent.index(lost)]
    assert got == before, f"{len(got)} served; {len(before)} lie before the damaged record"
    assert error is not None and "damaged" in error
    assert b.stop() == 0

    b = broker_factory(*FLAGS)                  # the queue marked damaged is rebuilt from the log
    got, error = await _drain(b, mq)
    assert error is None and got == [s for s in sent if s != lost]
    assert b.stop() == 0


async def test_a_broker_whose_active_segment_was_deleted_refuses_to_start(broker_factory, tmp_path):
    """Its log then ends at the previous segment's end marker, short of what the checkpoint says was flushed:
    the broker used to start on it without a word, every message of that segment gone and its queue offsets
    handed to the next messages. Now it exits 1 saying why; --truncate-corrupt-tail starts it anyway."""
    b = broker_factory(*FLAGS)
    mq = await _send(b)
    sent, _ = await _drain(b, mq)
    assert b.stop() == 0
    logdir = tmp_path / "store" / "commitlog"
    names = sorted(os.listdir(logdir))
    assert len(names) >= 3
    os.unlink(logdir / names[-1])

    refused = BrokerProcess(tmp_path / "store", *FLAGS)
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            refused.start()
        assert refused.proc.wait(30) == 1
    finally:
        refused.kill()
    text = refused.log()
    assert "cannot start" in text and "checkpoint" in text and names[-1] in text, text

    b = broker_factory(*FLAGS, "--truncate-corrupt-tail")
    got, error = await _drain(b, mq)
    assert error is None and got == sent[:len(got)] and len(got) < len(sent)
    assert b.stop() == 0


async def test_a_broker_whose_consumequeue_was_removed_serves_every_message_again(broker_factory, tmp_path):
    """RocketMQ's way to have queues rebuilt, a restore without consumequeue/: the broker scanned only past the
    checkpoint, the queue's messages in older segments unreachable. Rebuilt from the whole log now; the stop's
    checkpoint ends the rebuild (``checkpoint.rebuild`` removed)."""
    import shutil
    b = broker_factory(*FLAGS)
    async with Producer(b.namesrv, "PG_old") as producer:     # its records all in segments the scan does not verify
        await producer.send("Old", b"seed")
        q = (await producer.routes.publish_queues("Old"))[0]
        for i in range(100):
            await producer.send("Old", f"{i:05d}".encode() + bytes(2000), queue=q)
    old = MessageQueue("Old", q.broker_name, q.queue_id)
    mq = await _send(b)
    sent = {m: (await _drain(b, m))[0] for m in (old, mq)}
    assert len(sent[old]) == 101 and len(sent[mq]) == N + 1
    assert b.stop() == 0
    cq = tmp_path / "store" / "consumequeue"
    queues = [q for t in cq.iterdir() if t.is_dir() for q in t.iterdir() if q.is_dir() and any(q.iterdir())]
    assert len(queues) >= 2
    shutil.rmtree(cq)

    b = broker_factory(*FLAGS)
    for m in (old, mq):
        got, error = await _drain(b, m)
        assert error is None and got == sent[m], f"{m.topic}: {len(got)} of {len(sent[m])} served"
    assert "consumequeue/ holds no queue" in b.log()
    # counted as one queue's directory removed alone is (it was a WARNING alone)
    with urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5) as resp:
        assert f"txmq_store_consume_queues_rebuilt_total {float(len(queues))}" in resp.read().decode()
    assert b.stop() == 0
    assert not os.path.exists(tmp_path / "store" / "checkpoint.rebuild")
