"""Queue allocation among the consumers of a group (RocketMQ's AllocateMessageQueueAveragely). Pure."""
from __future__ import annotations


def allocate_averagely(queues: list, consumer_ids: list[str], me: str) -> list:
    """The contiguous slice of the sorted queues that ``me`` owns; nothing if ``me`` is not listed."""
    ids = sorted(consumer_ids)
    if me not in ids or not queues:
        return []
    queues = sorted(queues, key=lambda q: (q.topic, q.broker_name, q.queue_id))
    index, n, count = ids.index(me), len(ids), len(queues)
    mod = count % n
    size = count // n + 1 if index < mod else count // n
    if count <= n:
        size = 1 if index < count else 0
    start = index * size if index < mod else index * size + mod
    return [queues[(start + i) % count] for i in range(size)]
