"""Parked pulls (RocketMQ's PullRequestHoldService), woken by the store's dispatch, not by polling.

A pull that finds nothing new and may be suspended waits here under
(topic, queue id) until a message lands in that queue at or past the offset it
asked for, or its hold time ends. The store calls ``on_dispatch`` for every
stored record, after it is readable.
"""
from __future__ import annotations

import asyncio

from .limits import peer_host

_PARKED = "parked_pulls"        # a connection's attribute: the futures its parked pulls wait on


class PullHoldService:
    def __init__(self, max_per_host: int = 1 << 30):
        # Parked pulls of the connections from one remote address, at most max_per_host: each costs some 5.6 KB
        # (a task, its frames, a timer), and each connection may park max_in_flight * 4, so one client opening
        # connections could hold gigabytes.
        self.max_per_host = max_per_host
        self._by_host: dict[str, int] = {}
        self._waiters: dict[tuple[str, int], list[tuple[int, asyncio.Future]]] = {}

    @property
    def parked(self) -> int:
        return sum(len(w) for w in list(self._waiters.values()))   # list(): read from the scrape thread

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
        entry = (offset, fut)
        self._waiters.setdefault(key, []).append(entry)
        parked = None if conn is None else conn.attributes.setdefault(_PARKED, set())
        if parked is not None:
            parked.add(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if host is not None:
                left = self._by_host[host] - 1
                if left:
                    self._by_host[host] = left
                else:
                    del self._by_host[host]
            if parked is not None:
                parked.discard(fut)
            waiters = self._waiters.get(key)
            if waiters is not None:
                try:
                    waiters.remove(entry)
                except ValueError:
                    pass
                if not waiters:
                    del self._waiters[key]

    @staticmethod
    def connection_closed(conn) -> None:
        """End the pulls ``conn`` has parked: nobody is left to read their answers. Held on, they outlived the
        connection for their whole suspend time, outside its in-flight limit: a client parking pulls and
        hanging up, again and again, could hold any number of them."""
        for fut in conn.attributes.pop(_PARKED, ()):
            fut.cancel()

    def on_dispatch(self, info) -> None:
        waiters = self._waiters.get((info.topic, info.queue_id))
        if not waiters:
            return
        for offset, fut in waiters:
            if info.queue_offset >= offset and not fut.done():
                fut.set_result(None)

    def wake_all(self) -> None:
        for waiters in self._waiters.values():
            for _, fut in waiters:
                if not fut.done():
                    fut.set_result(None)
