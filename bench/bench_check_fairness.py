"""Check fairness between producer groups: one group's backlog of due checks against another's first check.

    python bench/bench_check_fairness.py N [gone]   (e.g. 100000; 0 for the baseline)

Group PG_big sends N half messages (local transaction UNKNOW); the broker is restarted with immunity 0 and a
3 s check interval, so all N are due at once, and a PG_big producer that never answers connects (it gets its
cap of checks, the rest wait); with ``gone``, no producer of PG_big comes back (all N are deferred, and come
due again each check interval). Then group PG_small sends one half and answers its check at once: prints how
long after its SEND_OK its check came (the innocent group's wait) and the broker's CPU time meanwhile (the
wall time drifts with the machine's load; the CPU time is the work done first), the worst latency of a plain SEND sent
every 10 ms meanwhile (the broker's loop lag as a client sees it), and the broker's loop-lag metric. SPY=1
records a py-spy profile of the restarted broker to /tmp/check_fair_spy.txt. The last line is JSON: the figures
and "ratio" = the worst probe SEND / the median probe SEND of the same run (1: the backlog stalls no one).
"""
import asyncio, sys, time, json, os, shutil, subprocess, tempfile, urllib.request
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.probe_sends import probe_sends
from tests.support.broker_process import BrokerProcess
from producer import TransactionProducer, Producer, LocalTransactionState as S


class Listener:
    def __init__(self, answer):
        self.answer = answer
        self.checked = asyncio.Event()
        self.checks = 0

    def execute_local_transaction(self, m, a):
        return S.UNKNOW

    async def check_local_transaction(self, m):
        self.checks += 1
        self.checked.set()
        if self.answer is None:
            await asyncio.Event().wait()
        return self.answer


def cpu_s(pid):
    """The process's CPU time so far (user + system), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(b, name):
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics").read().decode()
    return [line for line in text.splitlines() if line.startswith(name)]


async def main(n, gone):
    d = tempfile.mkdtemp(prefix="check-fair")
    store = os.path.join(d, "store")
    limit = ("--max-undecided-per-group", str(max(n, 100000)))      # (its default, 100,000, refuses more)
    b = BrokerProcess(store, "--transaction-timeout-ms", "600000", "--transaction-check-interval-ms", "600000",
                      *limit).start()
    p = await TransactionProducer(b.namesrv, "PG_big", Listener(None), end_retries=0).start()
    sem = asyncio.Semaphore(512)

    async def one(i):
        async with sem:
            await p.send_in_transaction("TBig", b"x" * 100)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    print("sent", n, "in", round(time.perf_counter() - t0, 1), "s", flush=True)
    await p.shutdown()
    b.stop()
    b = BrokerProcess(store, "--transaction-timeout-ms", "0", "--transaction-check-interval-ms", "3000", *limit).start()
    probe = await Producer(b.namesrv, "PG_probe", send_timeout=30).start()
    spy = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-p", str(b.proc.pid),
                            "-f", "raw", "-o", "/tmp/check_fair_spy.txt", "-r", "200"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if os.environ.get("SPY") else None
    await probe.send("TSmall", b"warm")         # the topic exists before the clock starts
    hung = Listener(None)
    big = None if gone else await TransactionProducer(b.namesrv, "PG_big", hung, shutdown_grace_s=0).start()
    if n and not gone:
        await asyncio.wait_for(hung.checked.wait(), 60)     # the backlog's pass has begun
    lat, stop = [], asyncio.Event()
    pt = asyncio.create_task(probe_sends(probe, lat, stop))
    innocent = Listener(S.COMMIT_MESSAGE)
    small = await TransactionProducer(b.namesrv, "PG_small", innocent, shutdown_grace_s=0).start()
    t = time.perf_counter()
    await small.send_in_transaction("TSmall", b"y")
    sent, cpu0 = time.perf_counter(), cpu_s(b.proc.pid)
    await asyncio.wait_for(innocent.checked.wait(), 300)
    first, cpu = time.perf_counter() - sent, cpu_s(b.proc.pid) - cpu0
    stop.set()
    await pt
    lat.sort()
    print(json.dumps({"n": n, "small_send_ms": round((sent - t) * 1000, 1), "small_first_check_ms": round(first * 1000, 1),
                      "broker_cpu_ms": round(cpu * 1000),
                      "hung_checks": hung.checks, "probe_n": len(lat),
                      "probe_worst_ms": [round(x * 1000, 1) for x in lat[-3:]],
                      "probe_p50_ms": round(lat[len(lat) // 2] * 1000, 1),
                      "loop_lag": metric(b, "txmq_event_loop_lag_max_seconds"),
                      "ratio": round(lat[-1] / lat[len(lat) // 2], 3)}), flush=True)
    if spy:
        spy.send_signal(2)
        await asyncio.to_thread(spy.wait)
    for c in (small, big, probe):
        if c is not None:
            await c.shutdown()
    b.stop()
    shutil.rmtree(d)


asyncio.run(main(int(sys.argv[1]), sys.argv[2:] == ["gone"]))
