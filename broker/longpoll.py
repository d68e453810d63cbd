"""Parked pulls (RocketMQ's PullRequestHoldService), woken by the store's dispatch, not by polling.

A pull that finds nothing new and may be suspended waits here under
(topic, queue id) until a message lands in that queue at or past the offset it
asked for, or its hold time ends. The store calls ``on_dispatch`` for every
stored record, after it is readable.
"""
from __future__ import annotations

import asyncio
import heapq

from .limits import count_down, peer_host

_PARKED = "parked_pulls"        # a connection's attribute: the futures its parked pulls wait on


class _Queue:
    """The pulls parked on one (topic, queue id): by the offset they wait for, and those offsets in a heap, so a
    stored message reaches the pulls it wakes without looking at any other (a heap entry whose pulls are gone
    is skipped, and the heap is rebuilt when such entries outnumber the live ones)."""

    __slots__ = ("by_offset", "heap")

    def __init__(self):
        self.by_offset: dict[int, dict[asyncio.Future, None]] = {}
        self.heap: list[int] = []


class PullHoldService:
    def __init__(self, max_per_host: int = 1 << 30):
        # Parked pulls of the connections from one remote address, at most max_per_host: each costs some 5.6 KB
        # (a task, its frames, a timer), and each connection may park max_in_flight * 4, so one client opening
        # connections could hold gigabytes.
        self.max_per_host = max_per_host
        self._by_host: dict[str, int] = {}
        # Waking costs what it wakes: a list of every waiter of a queue, scanned for each message and walked by
        # each woken pull to take itself out, cost O(waiters) a message and O(waiters squared) a wake (40,000
        # pulls on one queue stalled the loop a second a message).
        self._waiters: dict[tuple[str, int], _Queue] = {}
        self.parked = 0

    def attach(self, store) -> None:
        """Be woken by ``store``: for each record stored, and for units that became readable only later."""
        store.add_dispatch_listener(self.on_dispatch)
        store.add_landed_listener(self.on_landed)

    def room(self, conn) -> bool:
        """May a pull of ``conn`` be parked (max_per_host)?"""
        return conn is None or self._by_host.get(peer_host(conn), 0) < self.max_per_host

    async def wait(self, topic: str, queue_id: int, offset: int, timeout_s: float, conn=None) -> bool:
        """True if a message at or past ``offset`` arrived within ``timeout_s``; cancelled if ``conn`` (the
        pull's connection) closes first (``connection_closed``)."""
        host = None if conn is None else peer_host(conn)
        if host is not None:
            self._by_host[host] = self._by_host.get(host, 0) + 1
        fut = asyncio.get_running_loop().create_future()
        key = (topic, queue_id)
        queue = self._waiters.get(key)
        if queue is None:
            queue = self._waiters[key] = _Queue()
        pulls = queue.by_offset.get(offset)
        if pulls is None:
            pulls = queue.by_offset[offset] = {}
            heapq.heappush(queue.heap, offset)
        pulls[fut] = None
        self.parked += 1
        parked = None if conn is None else conn.attributes.setdefault(_PARKED, set())
        if parked is not None:
            parked.add(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.parked -= 1
            if host is not None:
                count_down(self._by_host, host)
            if parked is not None:
                parked.discard(fut)
            self._forget(key, offset, fut)

    def _forget(self, key: tuple[str, int], offset: int, fut: asyncio.Future) -> None:
        """Take a pull that ended without being woken out of its queue (a woken one is out already)."""
        queue = self._waiters.get(key)
        if queue is None:
            return
        pulls = queue.by_offset.get(offset)
        if pulls is None or fut not in pulls:
            return
        del pulls[fut]
        if pulls:
            return
        del queue.by_offset[offset]
        if not queue.by_offset:
            del self._waiters[key]
        elif len(queue.heap) > 2 * len(queue.by_offset) + 8:
            queue.heap = sorted(queue.by_offset)        # a sorted list is a heap

    @staticmethod
    def connection_closed(conn) -> None:
        """End the pulls ``conn`` has parked: nobody is left to read their answers. Held on, they outlived the
        connection for their whole suspend time, outside its in-flight limit: a client parking pulls and
        hanging up, again and again, could hold any number of them."""
        for fut in conn.attributes.pop(_PARKED, ()):
            fut.cancel()

    def on_dispatch(self, info) -> None:
        self._wake((info.topic, info.queue_id), info.queue_offset)

    def on_landed(self, topic: str, queue_id: int, max_offset: int) -> None:
        """The store's landed listener: units dispatched earlier became readable only now (they waited for disk
        space or their queue's file); the pulls parked since, on offsets below ``max_offset``, have them."""
        self._wake((topic, queue_id), max_offset - 1)

    def _wake(self, key: tuple[str, int], queue_offset: int) -> None:
        """Wake the pulls parked on ``key`` at offsets up to ``queue_offset``, now readable."""
        queue = self._waiters.get(key)
        if queue is None:
            return
        heap, by_offset = queue.heap, queue.by_offset
        while heap and heap[0] <= queue_offset:
            for fut in by_offset.pop(heapq.heappop(heap), ()):
                if not fut.done():
                    fut.set_result(None)
        if not by_offset:
            del self._waiters[key]

    def wake_all(self) -> None:
        for queue in list(self._waiters.values()):
            for pulls in queue.by_offset.values():
                for fut in pulls:
                    if not fut.done():
                        fut.set_result(None)
