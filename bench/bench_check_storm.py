"""A check storm: N undecided transactions due at once (the broker restarted after its producers died).

    python bench/bench_check_storm.py N SIZE MODE       (e.g. 50000 100 commit; 200 1000000 commit)

Sends N half messages of SIZE bytes (local transaction UNKNOW), stops the broker, starts it again with
immunity 0 and a 3 s check interval, and measures a plain SEND every 10 ms (its latency is the broker's
event-loop lag as a client sees it) while a producer in another process answers the checks: MODE silent
(never), slow (COMMIT after 0.5 s) or commit (at once). Prints the checks received, the worst SEND
latencies, the broker's check metrics and any connection it closed for unread bytes. SPY=1 records a
py-spy profile of the broker to /tmp/check_storm_spy.txt.
"""
import asyncio, sys, time, json, os, shutil, tempfile, subprocess, urllib.request
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.support.broker_process import BrokerProcess
from producer import TransactionProducer, Producer, LocalTransactionState as S

class L:
    """The listener: every local transaction UNKNOW; checks answered as ``mode`` says."""

    def __init__(self, mode):
        self.checks = 0
        self.first = None
        self.mode = mode

    def execute_local_transaction(self, m, a):
        return S.UNKNOW

    async def check_local_transaction(self, m):
        self.checks += 1
        if self.first is None:
            self.first = time.perf_counter()
        if self.mode == "slow":
            await asyncio.sleep(0.5)
            return S.COMMIT_MESSAGE
        if self.mode == "commit":
            return S.COMMIT_MESSAGE
        await asyncio.Event().wait()


async def checker(namesrv, mode, secs):
    l = L(mode)
    producer = await TransactionProducer(namesrv, "PG_storm", l, shutdown_grace_s=0).start()
    t0 = time.perf_counter()
    await asyncio.sleep(secs)
    print(json.dumps({"checks_received": l.checks, "first_after_s": None if l.first is None else round(l.first - t0, 2)}), flush=True)
    assert producer.group == "PG_storm"
    os._exit(0)             # at once: the checks still being answered are of no interest

def metrics(b, words=("check", "lag", "dead")):
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics").read().decode()
    return [l for l in text.splitlines() if any(w in l for w in words) and not l.startswith("#")]

async def main(N, SIZE, mode, secs=15):
    d = tempfile.mkdtemp(prefix="check-storm")
    b = BrokerProcess(os.path.join(d, "store"), "--transaction-timeout-ms", "600000", "--transaction-check-interval-ms", "600000").start()
    p = await TransactionProducer(b.namesrv, "PG_storm", L("x"), end_retries=0).start()
    t0 = time.perf_counter()
    body = b"x" * SIZE
    sem = asyncio.Semaphore(512 if SIZE < 100000 else 16)
    async def one(i):
        async with sem:
            await p.send_in_transaction("TStorm", body)
    await asyncio.gather(*(one(i) for i in range(N)))
    print("sent", N, "in", round(time.perf_counter() - t0, 1), "s", flush=True)
    await p.shutdown()
    b.stop()
    b2 = BrokerProcess(os.path.join(d, "store"), "--transaction-timeout-ms", "0", "--transaction-check-interval-ms", "3000").start()
    probe = await Producer(b2.namesrv, "PG_probe", send_timeout=30).start()
    lat = []
    stop = asyncio.Event()
    async def probing():
        while not stop.is_set():
            t = time.perf_counter()
            await probe.send("TProbe", b"p")
            lat.append((t, time.perf_counter() - t))
            await asyncio.sleep(0.01)
    pt = asyncio.create_task(probing())
    await asyncio.sleep(1.0)
    print("before:", metrics(b2, ("lag_max",)))
    tc = time.perf_counter()
    spy = subprocess.Popen(["py-spy", "record", "-p", str(b2.proc.pid), "-d", "14", "-f", "raw", "-o", "/tmp/check_storm_spy.txt", "-r", "50"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if os.environ.get("SPY") else None
    child = subprocess.Popen([sys.executable, __file__, "checker", b2.namesrv, mode, str(secs)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = await asyncio.to_thread(child.communicate)
    stop.set(); await pt
    if spy: await asyncio.to_thread(spy.wait)
    worst = sorted(lat, key=lambda x: -x[1])[:5]
    print(out[0].decode().strip())
    print(json.dumps({"probe_n": len(lat), "worst_ms": [round(w[1]*1000, 1) for w in worst],
                      "worst_at_s": [round(w[0]-tc, 2) for w in worst]}), flush=True)
    print("\n".join(metrics(b2)))
    await probe.shutdown()
    b2.stop()
    print("".join(l for l in open(b2.log_path) if "closing" in l or "ERROR" in l)[-3000:])
    shutil.rmtree(d)

if sys.argv[1] == "checker":
    asyncio.run(checker(sys.argv[2], sys.argv[3], float(sys.argv[4])))
else:
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
