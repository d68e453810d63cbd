"""What a consumer group has committed against what its queues hold, read over TCP as a client would."""
from __future__ import annotations

from consumer import PullConsumer
from consumer.pull_consumer import MessageQueue, PullStatus


async def queues_behind(namesrv: str, group: str, topic: str) -> list[tuple[int, int | None, int]]:
    """(queue id, committed, end) of every queue of ``topic`` whose ``group`` offset is behind its end."""
    probe = PullConsumer(namesrv, group)
    try:
        behind = []
        for mq in await probe.fetch_queues(topic):
            mq = MessageQueue(mq.topic, mq.broker_name, mq.queue_id)
            committed, end = await probe.fetch_offset(mq), await probe.max_offset(mq)
            if committed is None or committed < end:
                behind.append((mq.queue_id, committed, end))
        return behind
    finally:
        await probe.shutdown()


async def drain(namesrv: str, group: str, topic: str) -> tuple[list[PullStatus], int, list[bytes]]:
    """Pull every queue of ``topic`` from ``group``'s committed offset (0 when none) to its end: the statuses met,
    how many pulls were moved on (PULL_OFFSET_MOVED: to the queue's first offset, past the one asked), the bodies."""
    consumer = PullConsumer(namesrv, group)
    statuses, bodies, moved = [], [], 0
    try:
        for mq in await consumer.fetch_queues(topic):
            offset = await consumer.fetch_offset(mq) or 0
            for _ in range(200):
                res = await consumer.pull(mq, offset, max_nums=32)
                statuses.append(res.status)
                if res.status is PullStatus.OFFSET_ILLEGAL:
                    moved += 1
                    assert res.next_begin_offset == res.min_offset > offset
                elif res.status is PullStatus.NO_NEW_MSG:
                    break
                bodies += [m.body for m in res.messages]
                offset = res.next_begin_offset
    finally:
        await consumer.shutdown()
    return statuses, moved, bodies
