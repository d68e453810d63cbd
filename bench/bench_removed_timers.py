"""Loop cost of ScheduleService._removed_timers over a removed segment of N delivered timers behind one held (and
every other timer delivered).

    PYTHONPATH=. python bench/bench_removed_timers.py
"""
import time
from types import SimpleNamespace
from broker.schedule.service import ScheduleService
from broker.schedule.progress import Progress

def run(n, every):
    svc = ScheduleService.__new__(ScheduleService)
    p = svc.progress = Progress()
    if every == 1:
        p.timer_done.add_run(1, n)
    else:
        p.timer_done.update(range(1, n, every))
    svc._timers_indexed = n + 10
    svc._timers_min_seen = 0
    svc.ctx = SimpleNamespace(store=SimpleNamespace(min_offset=lambda t, q: n))
    svc._dropped = lambda *a: None
    svc._removed = []
    turns, worst, total = 0, 0.0, 0.0
    while True:
        svc._more = False
        t = time.perf_counter()
        svc._removed_timers()
        d = time.perf_counter() - t
        worst, total, turns = max(worst, d), total + d, turns + 1
        svc._timers_min_seen = svc._timers_min_next     # as the batch's written (lost ones passed over)
        if svc._timers_min_seen >= n:
            break
    print(f"n={n} every={every}: {turns} turns, worst turn {worst*1e3:.2f} ms, total {total*1e3:.1f} ms")

for n, every in ((1_000_001, 1), (1_000_001, 2)):
    run(n, every)
