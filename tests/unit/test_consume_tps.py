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


def test_store_tps_are_rocketmqs_three_rates_from_the_sampled_totals():
    """putTps / getTransferedTps of GET_BROKER_RUNTIME_INFO: '10 s rate, minute rate, 10 minute rate', each
    over what was sampled when the broker is younger; mqadmin clusterList parses the first as a double."""
    m = BrokerMetrics()
    assert m.store_tps() == ("0.0 0.0 0.0", "0.0 0.0 0.0")
    for second in range(0, 31):                     # 30 s of 10 puts and 4 gets a second
        m.sample_totals(now=1000.0 + second)
        m.count_in("T", 10, 100)
        m.count_out("T", "G", 4, 40)
    m.sample_totals(now=1031.0)
    puts, gets = m.store_tps()
    assert [float(r) for r in puts.split(" ")] == [10.0, 10.0, 10.0]
    assert [float(r) for r in gets.split(" ")] == [4.0, 4.0, 4.0]
    for second in range(32, 42):                    # then 10 quiet seconds: the 10 s rate falls to 0 first
        m.sample_totals(now=1000.0 + second)
    assert [float(r) for r in m.store_tps()[0].split(" ")] == [0.0, pytest.approx(310 / 41), pytest.approx(310 / 41)]
    m.forget_topic("T")                             # a deleted topic's counts go; the totals do not
    m.sample_totals(now=1042.0)
    assert float(m.store_tps()[0].split(" ")[1]) == pytest.approx(310 / 42)
