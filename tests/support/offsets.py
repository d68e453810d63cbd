"""What a consumer group has committed against what its queues hold, read over TCP as a client would."""
from __future__ import annotations

from consumer import PullConsumer
from consumer.pull_consumer import MessageQueue


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
