"""Minute, hour and day sums of a counter, RocketMQ's StatsItem snapshots: VIEW_BROKER_STATS_DATA (315).

mqadmin statsAll asks TOPIC_PUT_NUMS <topic> and GROUP_GET_NUMS <topic>@<group> for each topic and prints
the minute's rate and the day's sum; exportMetrics asks the half and schedule topics'. The counters are
the broker's running totals (BrokerMetrics); this keeps snapshots of them, as RocketMQ does:

| window | snapshot every | kept | the window's sum                                  |
|--------|----------------|------|---------------------------------------------------|
| minute | 10 s           | 7    | total now - the oldest kept (at most ~70 s ago)   |
| hour   | 10 min         | 7    | total now - the oldest kept                       |
| day    | 1 h            | 25   | total now - the oldest kept                       |

A key first seen had a total of 0 at the snapshot before (every key is read at every snapshot), so
that is its first snapshot, and a message counted before the first snapshot shows at once (RocketMQ
shows 0 until two snapshots exist). At most ``max_keys`` keys a counter: past it a new key is not
kept and is answered as unknown, the same SYSTEM_ERROR RocketMQ gives a key it never counted.
"""
from __future__ import annotations

from collections import deque

WINDOWS = (("statsMinute", 10.0, 7), ("statsHour", 600.0, 7), ("statsDay", 3600.0, 25))


class StatsWindows:
    def __init__(self, now: float, max_keys: int = 10_000):
        self.max_keys = max_keys
        self._series: dict[object, list[deque]] = {}
        self._taken = [now] * len(WINDOWS)      # when each window's last snapshot was taken
        self._last = now                        # the last snapshot of any window: every key was read then

    def snapshot(self, now: float, read_totals) -> None:
        """Called often (once a second); takes the snapshots that are due of every key in ``read_totals()``
        (called only then: {key: running total}). A key no longer there (its topic or group deleted) is
        forgotten."""
        due = [i for i, (_, every, _) in enumerate(WINDOWS) if now - self._taken[i] >= every]
        if not due:
            return
        totals = read_totals()
        for key in [k for k in self._series if k not in totals]:
            del self._series[key]
        for key, total in totals.items():
            series = self._series.get(key)
            if series is None:
                if len(self._series) >= self.max_keys:
                    continue
                series = self._series[key] = [deque([(self._last, 0)], maxlen=kept) for _, _, kept in WINDOWS]
            for i in due:
                series[i].append((now, total))
        for i in due:
            self._taken[i] = now
        self._last = now

    def windows(self, key, total: int, now: float) -> dict | None:
        """{window name: (sum, per second)} of ``key`` whose running total is ``total`` now; None when the key is
        past max_keys."""
        series = self._series.get(key)
        if series is None and len(self._series) >= self.max_keys:
            return None
        out = {}
        for i, (name, _, _) in enumerate(WINDOWS):
            since, base = series[i][0] if series is not None else (self._last, 0)
            count = total - base
            out[name] = (count, count / (now - since) if now > since else 0.0)
        return out
