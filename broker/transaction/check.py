"""The check policy's arithmetic (immunity, interval, back-off) and the timer that runs due checks.

The rules that use them are in core.py.

RocketMQ re-reads the half queue every round and re-writes every half it
checks. txmq keeps the undecided ones in memory ordered by their next check
time, so a pass touches only what is due and writes a 150-byte check record,
never the payload.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from broker.javanum import java_int
from protocol.connection import wait_within

log = logging.getLogger("txmq.transaction")

# Consecutive unanswered checks stretch the interval 2x, 4x, then stay at 4x, so
# a hung producer is not stormed, while a producer that answers is asked on time.
MAX_BACKOFF = 4
# The least immunity a half's CHECK_IMMUNITY_TIME_IN_SECONDS gives (0 is the only value below it): taken as it is,
# "0" had the first check sent ~15 ms after the half was stored, while its producer's local transaction still ran,
# and a listener that found no row yet answered ROLLBACK before the COMMIT came (the message lost). RocketMQ 4.9.8
# checks a half at its next pass at the earliest (transactionCheckInterval). The broker's own
# transaction_timeout_ms, when lower, is the floor instead: an operator's choice, not a producer's.
IMMUNITY_FLOOR_MS = 1000


@dataclass(frozen=True)
class Policy:
    check_interval_ms: int
    timeout_ms: int             # default immunity
    check_max: int
    retention_ms: int


def next_check_after_check(policy: Policy, now: int, unanswered: int) -> int:
    return now + policy.check_interval_ms * min(2 ** max(unanswered, 0), MAX_BACKOFF)


def first_check_time(policy: Policy, store_ts: int, immunity_s: str | None) -> int:
    """Immunity: CHECK_IMMUNITY_TIME_IN_SECONDS when Long.parseLong reads it (RocketMQ's getLong) as non-negative,
    else the default; never past the retention (the half is expired by then; a 321-digit value made the check
    timer's delay overflow). Read by int(), " 600" and "1_000" (which RocketMQ's broker takes for no value: the
    default) held a half's first check back 10 and 16 minutes instead of the default's 6 s. Never below
    IMMUNITY_FLOOR_MS (or the default, when that is lower)."""
    immunity = policy.timeout_ms
    if immunity_s:
        value = java_int(immunity_s, 64)
        if isinstance(value, int) and value >= 0:
            immunity = max(value * 1000, min(IMMUNITY_FLOOR_MS, policy.timeout_ms))
    return store_ts + min(immunity, max(policy.retention_ms, policy.timeout_ms))


class CheckTimer:
    """Runs ``run_due(now)`` when the earliest transaction is due, or when woken."""

    def __init__(self, service, clock, max_sleep_s: float = 1.0):
        self.service = service
        self.clock = clock
        self.max_sleep_s = max_sleep_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="txmq-check-timer")

    def wake(self) -> None:
        self._wake.set()

    def woken(self) -> bool:
        """Woken since the running pass began: the timer starts another as soon as it ends (never, when the timer
        is not running: a caller that runs passes itself has them run to their end)."""
        return self._task is not None and self._wake.is_set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def _delay(self, due: int | None) -> float:
        """Seconds until ``due`` (ms), at most max_sleep_s. Compared as ints first: a due time far enough
        ahead overflows a float, and an exception here, outside the pass's guard, ended the timer task:
        no transaction was checked or dead-lettered again, and nothing said so."""
        if due is None:
            return self.max_sleep_s
        ms = due - self.clock()
        if ms >= self.max_sleep_s * 1000:
            return self.max_sleep_s
        return max(0.0, ms / 1000)

    async def _run(self) -> None:
        while True:
            # Cleared before the pass, not after: a wake() while it runs (a producer joining, an answer freeing a
            # slot) then starts another pass at once instead of being lost until max_sleep_s.
            self._wake.clear()
            try:
                await self.service.run_due(self.clock())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the timer must survive a bad pass
                log.exception("transaction check pass failed")
                # Counted where the alert looks (txmq_background_task_crashes_total): a pass failing every
                # time stops all checks and dead letters, which a log line alone would not make seen.
                self.service.ctx.metrics.task_crashes.labels("txmq-check-timer").inc()
            delay = self._delay(self.service.next_due())
            try:
                await wait_within(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass
