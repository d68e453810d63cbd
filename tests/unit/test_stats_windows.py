"""StatsWindows: the minute / hour / day sums VIEW_BROKER_STATS_DATA answers, on a clock given as a parameter."""
from __future__ import annotations

import time
from datetime import date, datetime, timedelta

from broker.metrics import BrokerMetrics
from broker.stats_windows import StatsWindows


def _sums(w, key, total, now):
    return {name: count for name, (count, _) in w.windows(key, total, now).items()}


def test_counts_before_the_first_snapshot_show_at_once():
    w = StatsWindows(0.0)
    assert w.windows("T", 6, 3.0) == {"statsMinute": (6, 2.0), "statsHour": (6, 2.0), "statsDay": (6, 2.0)}


def test_the_minute_forgets_what_is_older_and_the_day_keeps_it():
    w = StatsWindows(0.0)
    totals = {"T": 0}
    for t in range(10, 130, 10):                # 5 messages in each 10 s
        totals["T"] += 5
        w.snapshot(float(t), lambda: dict(totals))
    # at 120 s the minute's oldest snapshot is the one of 60 s (7 kept): 30 since then, plus 2 not yet sampled
    assert _sums(w, "T", totals["T"] + 2, 125.0) == {"statsMinute": 32, "statsHour": 62, "statsDay": 62}
    assert w.windows("T", 62, 125.0)["statsMinute"][1] == 32 / 65


def test_a_key_missing_from_the_oldest_snapshot_was_0_then():
    w = StatsWindows(0.0)
    w.snapshot(10.0, lambda: {})
    w.snapshot(20.0, lambda: {"New": 4})
    assert _sums(w, "New", 4, 25.0) == {"statsMinute": 4, "statsHour": 4, "statsDay": 4}
    assert w.windows("New", 4, 25.0)["statsMinute"][1] == 4 / 25     # over the window since its oldest snapshot


def test_a_topic_made_again_counts_from_zero():
    w = StatsWindows(0.0)
    w.snapshot(10.0, lambda: {"A": 50})
    assert _sums(w, "A", 3, 11.0) == {"statsMinute": 3, "statsHour": 3, "statsDay": 3}   # deleted, made again
    w.snapshot(20.0, lambda: {"A": 3})
    assert _sums(w, "A", 9, 21.0)["statsMinute"] == 9     # the oldest kept (the start) had it at 0


def test_nothing_is_read_between_snapshots():
    w = StatsWindows(0.0)
    calls = []
    for t in (1.0, 5.0, 9.9):
        w.snapshot(t, lambda: calls.append(t) or {})
    assert calls == []
    w.snapshot(3600.0, lambda: calls.append(3600.0) or {})      # every window due: read once for all
    assert calls == [3600.0]


def test_the_mornings_totals_move_at_each_local_midnight():
    """GET_BROKER_RUNTIME_INFO's msgPut/GetTotal{Yesterday,Today}Morning (RocketMQ's BrokerStats.record at
    midnight): 0 before the first midnight; exportMetrics subtracts yesterday's from today's."""
    m = BrokerMetrics()
    m.count_in("T", 5, 50)
    m.count_out("T", "G", 3, 30)
    today = time.time()
    m.sample_totals(wall=today)
    assert set(m.mornings.values()) == {0}
    m.sample_totals(wall=today + 86400)
    m.count_in("T", 2, 20)
    m.sample_totals(wall=today + 86400 + 1)             # the same day: nothing moves
    assert m.mornings == {"msgPutTotalYesterdayMorning": 0, "msgPutTotalTodayMorning": 5,
                          "msgGetTotalYesterdayMorning": 0, "msgGetTotalTodayMorning": 3}
    m.sample_totals(wall=today + 2 * 86400)
    assert (m.mornings["msgPutTotalYesterdayMorning"], m.mornings["msgPutTotalTodayMorning"]) == (5, 7)



def test_the_mornings_totals_move_once_when_the_wall_clock_steps_back_across_midnight():
    """Stepped back across midnight and forward again (NTP, a VM resumed), the mornings' totals moved at the step
    back and again at the same midnight: yesterday's count (TodayMorning - YesterdayMorning) became the minutes
    between the two, today's lost them. They move at a midnight the clock had not passed before, once."""
    m = BrokerMetrics()
    midnight = datetime.combine(date.today() + timedelta(days=1), datetime.min.time()).timestamp()   # local
    m.sample_totals(wall=midnight + 600)                # 00:10: the day's first sample moves them
    m.count_in("T", 5, 50)
    m.sample_totals(wall=midnight - 3000)               # stepped back an hour: 23:10 the day before
    m.count_in("T", 2, 20)
    m.sample_totals(wall=midnight + 1)                  # the same midnight again
    assert (m.mornings["msgPutTotalYesterdayMorning"], m.mornings["msgPutTotalTodayMorning"]) == (0, 0)
    m.sample_totals(wall=midnight + 2 * 86400)          # the next one (days of 23 or 25 hours too)
    assert (m.mornings["msgPutTotalYesterdayMorning"], m.mornings["msgPutTotalTodayMorning"]) == (0, 7)

def test_the_mornings_totals_move_again_after_a_wall_clock_set_days_ahead_is_corrected():
    """A clock set days ahead (a host booted with a wrong RTC, then NTP) and corrected: moving them only at a date
    later than the last they moved at, they stayed put until the clock reached that date again (a year ahead: a
    year), msgPut/GetTotal*Morning frozen, nothing said. Corrected by more than a day, they move at the next
    midnight; stepped back one day (see above), once."""
    m = BrokerMetrics()
    midnight = datetime.combine(date.today() + timedelta(days=1), datetime.min.time()).timestamp()   # local
    m.sample_totals(wall=midnight + 365 * 86400)        # a year ahead
    m.count_in("T", 5, 50)
    m.sample_totals(wall=midnight - 600)                # corrected: 23:50 today
    m.sample_totals(wall=midnight + 1)                  # the next midnight
    assert (m.mornings["msgPutTotalYesterdayMorning"], m.mornings["msgPutTotalTodayMorning"]) == (0, 5)


def test_groups_gone_for_an_hour_give_their_stats_places_to_new_ones():
    """GROUP_GET_NUMS pairs are held for max_series pairs like the delivery series they mirror. Kept, the first
    max_series pairs ever seen (a client pulling under invented group names, or months of groups named after
    their pods) held every place for good: each later group was "not exist" and statsAll printed it 0."""
    m = BrokerMetrics()
    clock = [1000.0]
    m.monotonic = lambda: clock[0]
    m.max_series = 3
    for i in range(3):
        m.count_out("T", f"CG_invented{i}", 1, 10, now=clock[0])
    m.count_out("T", "CG_late", 1, 10, now=clock[0])               # at the limit, nothing idle yet: not counted
    assert m.stats_windows("GROUP_GET_NUMS", "T@CG_late", now=clock[0]) is None
    clock[0] += m.idle_s
    m.count_out("T", "CG_invented0", 1, 10, now=clock[0])           # this one goes on; the other two are gone
    m.count_out("T", "CG_new", 4, 40, now=clock[0])
    assert m.stats_windows("GROUP_GET_NUMS", "T@CG_new", now=clock[0])["statsMinute"][0] == 4
    assert m.stats_windows("GROUP_GET_NUMS", "T@CG_invented0", now=clock[0])["statsDay"][0] == 2
    assert m.stats_windows("GROUP_GET_NUMS", "T@CG_invented1", now=clock[0]) is None
    assert len(m._got) <= m.max_series


def test_a_topic_or_pair_counted_again_after_being_forgotten_counts_all_of_its_new_messages():
    """A deleted topic's (or a forgotten pair's) old total stayed in the kept snapshots: made again, its new
    messages counted only past that old total ("below it counts from 0" caught only the first few)."""
    m = BrokerMetrics()
    m.count_in("A", 50, 500)
    m.count_out("A", "G", 50, 500)
    later = time.monotonic() + 3600                 # every window takes its snapshot: A at 50, A@G at 50
    m.sample_totals(now=later)
    m.forget_topic("A")
    m.count_in("A", 60, 600)                        # made again: 60 new messages, 60 pulled
    m.count_out("A", "G", 60, 600)
    for step in range(1, 7):                        # the minute's oldest kept snapshot is now the one of 50
        m.sample_totals(now=later + 10 * step)
    for name, key in (("TOPIC_PUT_NUMS", "A"), ("GROUP_GET_NUMS", "A@G")):
        sums = {w: count for w, (count, _) in m.stats_windows(name, key, now=later + 61).items()}
        assert sums == {"statsMinute": 60, "statsHour": 60, "statsDay": 60}, (name, sums)
