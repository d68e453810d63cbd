"""Progress of a long start-up step, said in the log.

A broker restarted on a big, old store loads every consume queue and may scan many segments
before it listens; without a word that is a silent minute an operator cannot tell from a hang.
``Progress.step`` logs how far the step has got at most every ``EVERY_S`` (one clock read a
step: call it per file or segment, not per record).
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("txmq.store")

EVERY_S = 5.0


class Progress:
    def __init__(self, what: str, total: int, unit: str, logger: logging.Logger = log, clock=time.monotonic):
        self.what, self.total, self.unit, self.log, self.clock = what, total, unit, logger, clock
        self._next = clock() + EVERY_S

    def step(self, done: int) -> None:
        now = self.clock()
        if now >= self._next:
            self._next = now + EVERY_S
            self.log.info("%s: %d of %d %s (%d%%)", self.what, done, self.total, self.unit,
                     100 * done // max(self.total, 1))
