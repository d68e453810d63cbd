"""Background tasks that are never silent, and the event loop's lag measured from inside.

``Supervisor.spawn`` runs a background coroutine; if it raises, the crash is logged with its
traceback, counted in ``txmq_background_task_crashes_total{task}`` and the task restarted after
a short pause. A task that keeps crashing (``max_crashes`` within ``window_s``) is beyond
restarting: the supervisor calls ``on_fatal`` and the broker exits non-zero.

``LoopLag`` wakes every ``interval`` seconds and measures how late it woke: that lateness is
time the loop spent on something else without yielding. The gauge holds the worst lag of the
last second, or, read while the loop is stuck, how long it has been stuck so far (a scrape runs
on its own thread); ``worst`` the worst since start (tests and the soak read it from /metrics).
"""
from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("txmq.supervise")


class Supervisor:
    def __init__(self, metrics, on_fatal, *, max_crashes: int = 5, window_s: float = 60.0, pause_s: float = 1.0):
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.max_crashes = max_crashes
        self.window_s = window_s
        self.pause_s = pause_s
        self.tasks: list[asyncio.Task] = []

    def spawn(self, name: str, factory) -> asyncio.Task:
        """Run ``factory()`` (a coroutine function) under supervision until it returns or is cancelled."""
        task = asyncio.get_running_loop().create_task(self._run(name, factory), name=name)
        self.tasks.append(task)
        return task

    async def _run(self, name: str, factory) -> None:
        crashes: list[float] = []
        while True:
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a background task must not die unseen
                now = time.monotonic()
                crashes = [t for t in crashes if now - t < self.window_s] + [now]
                self.metrics.task_crashes.labels(name).inc()
                log.exception("background task %s crashed (%d in %.0f s)", name, len(crashes), self.window_s)
                if len(crashes) >= self.max_crashes:
                    log.critical("background task %s keeps crashing; stopping the broker", name)
                    self.on_fatal(f"background task {name} crashed {len(crashes)} times")
                    return
            await asyncio.sleep(self.pause_s)

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


class LoopLag:
    def __init__(self, gauge, worst_gauge=None, *, interval: float = 0.02, window_s: float = 1.0):
        self.gauge = gauge
        self.worst_gauge = worst_gauge
        self.interval = interval
        self.window = max(1, int(window_s / interval))
        self.worst = 0.0
        self._recent: list[float] = []
        self._window_worst = 0.0
        self._due: float | None = None      # perf_counter() by which run() should have woken
        gauge.set_function(self.current)

    async def run(self) -> None:
        """Measure until cancelled. A timer callback, not a task that sleeps: it runs 1/interval times a
        second for the broker's whole life, and a task's wake-up (a future, a timer and a step each time)
        was most of an idle broker's CPU."""
        loop = asyncio.get_running_loop()
        clock = time.perf_counter
        interval = self.interval
        failed = loop.create_future()       # record() raised: the supervisor sees it as a crash
        handle = None

        def tick() -> None:
            nonlocal handle
            try:
                self.record(max(0.0, clock() - self._due))
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting task, never lost
                failed.set_exception(exc)
                return
            self._due = clock() + interval
            handle = loop.call_later(interval, tick)

        self._due = clock() + interval
        handle = loop.call_later(interval, tick)
        try:
            await failed
        finally:
            handle.cancel()
            self._due = None        # stopped (the broker is stopping): not a stall

    def current(self) -> float:
        """The gauge at a scrape: the worst of the window, or the stall under way when longer (a stuck loop
        records nothing, and the window alone would show the lag from before the stall)."""
        due = self._due
        stuck = time.perf_counter() - due if due is not None else 0.0
        return max(self._window_worst, stuck)

    def record(self, lag: float) -> None:
        if lag >= 0.1:
            log.warning("event loop stalled for %.0f ms", lag * 1000)
        recent = self._recent
        recent.append(lag)
        if len(recent) > self.window:
            del recent[0]
        self._window_worst = max(recent)
        if lag > self.worst:
            self.worst = lag
            if self.worst_gauge is not None:
                self.worst_gauge.set(lag)
