"""The offset watermark a SYNC_MASTER's sends wait on: group commit for the slave's acknowledgement.

RocketMQ's GroupTransferService: each stored message asks "has a slave reported an offset at or past
my end?" and waits up to slaveTimeout. Here every waiting send is one entry (end offset, deadline,
future) -- no task, no timer of its own: ``advance`` (a slave's report) resolves every entry the new
watermark covers in one pass, and ONE timer, armed for the earliest deadline, resolves the overdue
ones. Futures resolve True (the slave has it) or False (timed out: FLUSH_SLAVE_TIMEOUT).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from typing import Callable


class OffsetWatermark:
    def __init__(self, timeout_s: float, *, clock: Callable[[], float] | None = None, use_timer: bool = True):
        """``clock``: seconds, monotonic (the loop's by default). ``use_timer`` False: the caller calls
        ``expire`` itself (tests drive the clock)."""
        self.timeout_s = timeout_s
        self.acked = 0                      # the highest offset a slave has reported (never goes back)
        self._clock = clock
        self._use_timer = use_timer
        self._by_offset: list = []          # heap of (offset, seq, future)
        self._by_deadline: deque = deque()  # (deadline, future), in arrival order = deadline order
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    @property
    def waiting(self) -> int:
        return sum(1 for _d, f in self._by_deadline if not f.done())

    def wait(self, offset: int) -> asyncio.Future:
        """A future that is True once ``advance`` reaches ``offset``, False after the timeout."""
        fut = asyncio.get_running_loop().create_future()
        if offset <= self.acked:
            fut.set_result(True)
            return fut
        deadline = self._now() + self.timeout_s
        heapq.heappush(self._by_offset, (offset, next(self._seq), fut))
        self._by_deadline.append((deadline, fut))
        if self._use_timer and self._timer is None:
            self._arm(deadline)
        return fut

    def advance(self, offset: int) -> int:
        """A slave reported ``offset``: resolve everything at or below it; returns how many."""
        if offset <= self.acked:
            return 0
        self.acked = offset
        heap = self._by_offset
        n = 0
        while heap and heap[0][0] <= offset:
            fut = heapq.heappop(heap)[2]
            if not fut.done():
                fut.set_result(True)
                n += 1
        return n

    def reset(self, offset: int) -> None:
        """The slave that confirmed up to ``acked`` is gone: from now on only ``offset`` counts (waiters
        already resolved stay resolved; the rest wait for a report past their end)."""
        self.acked = min(self.acked, offset)

    def expire(self, now: float | None = None) -> int:
        """Resolve the entries whose deadline has passed as timed out; returns how many."""
        now = self._now() if now is None else now
        q = self._by_deadline
        n = 0
        while q and (q[0][1].done() or q[0][0] <= now):
            _deadline, fut = q.popleft()
            if not fut.done():
                fut.set_result(False)
                n += 1
        if not q:
            self._by_offset.clear()         # every entry left there is resolved
        return n

    def fail_all(self) -> None:
        """Shutting down: every waiter times out now."""
        for _d, fut in self._by_deadline:
            if not fut.done():
                fut.set_result(False)
        self._by_deadline.clear()
        self._by_offset.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------ the one timer
    def _arm(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + max(0.0, deadline - self._now()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.expire()
        q = self._by_deadline
        while q and q[0][1].done():
            q.popleft()
        if q:
            self._arm(q[0][0])
