"""consume_tps: a group's messages pulled per second over the last minute (GET_CONSUME_STATS' consumeTps)."""
from __future__ import annotations

import pytest

from broker.metrics import BrokerMetrics


def test_consume_tps_counts_the_last_minute_only():
    m = BrokerMetrics()
    m.count_out("T", "G", 60, 600, now=1000.0)        # slot 100
    m.count_out("T", "G", 30, 300, now=1055.0)        # slot 105
    m.count_out("T", "Other", 7, 70, now=1055.0)
    assert m.consume_tps("G", "T", now=1055.0) == pytest.approx(90 / 55)      # slots 100..105, 55 s of them
    assert m.consume_tps("G", "T", now=1061.0) == pytest.approx(30 / 51)      # slot 100 is over a minute old
    assert m.consume_tps("G", "T", now=1200.0) == 0.0
    assert m.consume_tps("G", "Unpulled", now=1055.0) == 0.0
    for i in range(20):                                 # old slots do not pile up
        m.count_out("T", "G", 1, 1, now=2000.0 + 10 * i)
    assert len(m._pulled[("T", "G")]) <= 7
    assert m.registry.get_sample_value("rocketmq_messages_out_total", {"topic": "T", "consumer_group": "G"}) == 110
