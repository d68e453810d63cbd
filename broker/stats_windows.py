"""Minute, hour and day sums of counters, RocketMQ's StatsItem snapshots: VIEW_BROKER_STATS_DATA (315).

mqadmin statsAll asks TOPIC_PUT_NUMS <topic> and GROUP_GET_NUMS <topic>@<group> for each topic and prints
the minute's rate and the day's sum; exportMetrics asks the half and schedule topics'. The counters are
the broker's running totals (BrokerMetrics, {key: total}); this keeps snapshots of the whole table, as
RocketMQ keeps them of each item:

| window | snapshot every | kept | a key's sum                                          |
|--------|----------------|------|------------------------------------------------------|
| minute | 10 s           | 7    | its total now - its total in the oldest kept (~70 s) |
| hour   | 10 min         | 7    | the same over the hour's                             |
| day    | 1 h            | 25   | the same over the day's                              |

A snapshot is the table copied whole, once per snapshot (dict() of the pairs; one comprehension over the
topics' counts), never a loop appending to per-key series (at 10,000 topics that held the event loop ~0.8 s
each 10 s; the copy is ~1 ms). A key missing from a snapshot was 0 then; before the first snapshot the start
counts as one with every key at 0, so what was counted shows at once (RocketMQ shows 0 until two snapshots
exist). ``forget`` takes a key out of every kept snapshot when it stops being counted (a topic deleted, an
idle pair given up), so counted again it is not measured against its old total; a total below a snapshot's
still counts from 0. Memory: at most 39 snapshots of tables that BrokerMetrics bounds (topics; max_series
pairs).
"""
from __future__ import annotations

from collections import deque

WINDOWS = (("statsMinute", 10.0, 7), ("statsHour", 600.0, 7), ("statsDay", 3600.0, 25))


class StatsWindows:
    def __init__(self, now: float):
        self._rings = [deque([(now, {})], maxlen=kept) for _, _, kept in WINDOWS]

    def snapshot(self, now: float, read_totals) -> None:
        """Called often (once a second); when a window's snapshot is due, ``read_totals()`` ({key: running
        total}, a fresh dict the caller no longer changes) is kept as it."""
        totals = None
        for ring, (_, every, _) in zip(self._rings, WINDOWS):
            if now - ring[-1][0] >= every:
                if totals is None:
                    totals = read_totals()
                ring.append((now, totals))

    def forget(self, keys) -> None:
        """``keys`` stopped being counted (a topic deleted, a pair given up): out of every kept snapshot, so a
        key counted again from 0 is not measured against its old total. A snapshot may sit in several rings."""
        keys = list(keys)
        if not keys:
            return
        for snap in {id(totals): totals for ring in self._rings for _, totals in ring}.values():
            for key in keys:
                snap.pop(key, None)

    def windows(self, key, total: int, now: float) -> dict:
        """{window name: (sum, per second)} of ``key``, whose running total is ``total`` now."""
        out = {}
        for ring, (name, _, _) in zip(self._rings, WINDOWS):
            since, totals = ring[0]
            base = totals.get(key, 0)
            count = total - base if total >= base else total
            out[name] = (count, count / (now - since) if now > since else 0.0)
        return out
