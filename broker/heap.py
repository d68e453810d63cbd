"""Long-lived tables out of the garbage collector's full passes.

A full (generation 2) collection walks every tracked object and holds the GIL while it does: with 500,000
undecided transactions (one ``Tx`` each, plus the index around them), offsets of many groups and the consume-queue
tables, that is 300-450 ms of a stalled event loop, charged to whichever request's allocation happened to trigger
it (another client's SEND waits that long). Those objects live for minutes to days, and the collector finds
nothing to free among them: reference counting frees a decided transaction the moment it leaves the index.

So once the broker has loaded them (after recovery) and each time the tables have grown a lot since (a burst of
halves), the heap is *settled*: one collection of what is not frozen yet (the cyclic garbage goes first, so none
of it is kept), then ``gc.freeze()`` moves every surviving object to the permanent generation, which no
collection walks. Later full passes walk only what came after. What it costs:

- a frozen object is still freed by reference counting (a decided transaction, a deleted group's offsets): what
  the tables free, the broker frees; ``gc.get_freeze_count()`` goes down with it;
- a *cycle* among frozen objects that becomes garbage later is not collected. The broker's tables hold no such
  cycles (a connection's own cycles are made and dropped with the connection, not in the tables), and settling
  again only after the tables double keeps what a rare one could hold to a fraction of what was loaded.

The growth rule is geometric (settle again when the tracked tables reach ``grow`` times their size at the last
settle, and at least ``min_growth`` more), so the settles' own pauses, each a walk of what is new, add up to a
constant factor of the loading itself and never recur at a steady size.
"""
from __future__ import annotations

import collections
import gc
import logging
import time
from typing import Callable

log = logging.getLogger("txmq.heap")


class HeapSettler:
    """Freezes the heap after a big load; ``size()`` is the count of entries in the broker's big tables."""

    def __init__(self, size: Callable[[], int], *, grow: float = 2.0, min_growth: int = 50_000,
                 on_settled: Callable[[float], None] | None = None):
        self.size = size
        self.grow = grow
        self.min_growth = min_growth
        self.on_settled = on_settled
        self.settled_at: int | None = None      # size() at the last settle; None: never settled
        self.settles = 0
        # Full collections' pauses, in seconds, as gc.callbacks saw them. The callback runs inside whatever
        # allocation triggered the collection, on any thread, perhaps within a metric's lock: it only appends
        # (atomic, no lock), and drain() hands them to the metrics from the event loop.
        self.pauses: collections.deque[float] = collections.deque(maxlen=4096)
        self._started = 0.0

    def _timing(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._started = time.perf_counter()
            else:
                self.pauses.append(time.perf_counter() - self._started)

    def watch(self) -> None:
        """Time every full collection from now on (until close())."""
        if self._timing not in gc.callbacks:
            gc.callbacks.append(self._timing)

    def close(self) -> None:
        """Stop timing, and give back what the settles froze: gc.freeze() is the whole process's, and a process
        that goes on after its broker stopped (the tests, the in-process benches) kept the stopped broker's
        cycles, frozen, until it ended; the next full collection walks (and frees) them again."""
        if self._timing in gc.callbacks:
            gc.callbacks.remove(self._timing)
        if self.settles:
            gc.unfreeze()

    def drain(self) -> list[float]:
        """The full collections' pauses timed since the last drain."""
        out = []
        while self.pauses:
            out.append(self.pauses.popleft())
        return out

    def settle(self, why: str) -> float:
        """Collect what is not frozen, then freeze all that survived; returns the seconds it took."""
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        took = time.perf_counter() - t0
        self.settled_at = self.size()
        self.settles += 1
        log.info("heap settled (%s): %d objects frozen out of the collector's full passes, %d table entries, "
                 "%.0f ms", why, gc.get_freeze_count(), self.settled_at, took * 1000)
        if self.on_settled is not None:
            self.on_settled(took)
        return took

    def maybe_settle(self) -> bool:
        """Settle when the tables grew past ``grow`` times (and ``min_growth`` over) their size at the last settle."""
        n = self.size()
        last = self.settled_at or 0
        if n - last < self.min_growth or n < self.grow * last:
            return False
        self.settle(f"tables grew from {last} to {n} entries")
        return True
