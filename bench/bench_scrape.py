"""What a Prometheus scrape of a broker with many topics costs another client.

    python bench/bench_scrape.py TOPICS [SCRAPES] [REPO]     (e.g. 6000 3)

One client (127.0.0.1) makes TOPICS topics of one queue by sending one message to each (so each has its labelled
series). Another client (127.0.0.2) sends a HEARTBEAT and a SEND to a queue that exists, one after the other: 200
pairs with no scrape (the baseline), then all the while SCRAPES scrapes of /metrics run one after the other on a
thread. Prints the scrapes' sizes and times, the other client's worst and p99 during them, and "ratio" = its p99
HEARTBEAT during the scrapes / its p99 HEARTBEAT of the baseline (the same run's). REPO: the checkout whose broker
runs (a baseline worktree). SPY=1 records a py-spy profile of the broker during the scrapes to /tmp/scrape.txt.
"""
import asyncio, json, os, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_loop_stalls import _heartbeat, _send_cmd
from protocol.codes import ResponseCode as C
from tests.support.broker_process import BrokerProcess
from tests.support.raw_client import RawClient


def _pct(xs, q):
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(len(xs) * q))], 1)


async def main(topics, scrapes, repo):
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", "--max-topics", str(topics + 100), "--max-topics-per-host", "100000",
                          "--max-queues-per-host", "100000", "--max-auto-create-topics-per-s", "100000",
                          repo=repo and Path(repo)).start()
        try:
            maker = await RawClient.open(b.broker, "127.0.0.1")

            async def make(ts):         # auto-created by the send, one queue each
                for t in ts:
                    cmd = _send_cmd(f"T{t}", 0)
                    cmd.ext_fields["defaultTopicQueueNums"] = "1"
                    [r] = await maker.call(cmd, 30)
                    assert r.code == C.SUCCESS, r.remark
            await asyncio.gather(*(make(range(i, topics, 16)) for i in range(16)))
            other = await RawClient.open(b.broker, "127.0.0.2")     # after: an idle connection is closed
            [r] = await other.call(_send_cmd("Existing", 0), 10)
            assert r.code == C.SUCCESS, r.remark

            async def pairs(lat, until):
                while not until():
                    for kind, cmd in (("hb", _heartbeat()), ("send", _send_cmd("Existing", 0))):
                        t0 = time.perf_counter()
                        [r] = await other.call(cmd, 30)
                        lat[kind].append(time.perf_counter() - t0)
                        assert r.code == C.SUCCESS, r.remark

            quiet = {"hb": [], "send": []}
            await pairs(quiet, lambda: len(quiet["hb"]) >= 200)
            spy = None
            if os.environ.get("SPY"):
                spy = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-o",
                                        "/tmp/scrape.txt", "-f", "raw", "-p", str(b.proc.pid), "-r", "500",
                                        "--threads"])
            took, sizes = [], []

            def scrape_all():
                for _ in range(scrapes):
                    t0 = time.perf_counter()
                    sizes.append(len(urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=60).read()))
                    took.append(time.perf_counter() - t0)
            during = {"hb": [], "send": []}
            scraping = asyncio.ensure_future(asyncio.to_thread(scrape_all))
            await pairs(during, scraping.done)
            await scraping
            if spy:
                spy.send_signal(__import__("signal").SIGINT)
                spy.wait()
            out = {"topics": topics, "scrape_kb": round(sizes[-1] / 1000), "scrape_s": [round(t, 3) for t in took],
                   "hb_n": len(during["hb"]), "hb_max_ms": _pct(during["hb"], 1), "hb_p99_ms": _pct(during["hb"], .99),
                   "send_max_ms": _pct(during["send"], 1), "send_p99_ms": _pct(during["send"], .99),
                   "quiet_hb_p99_ms": _pct(quiet["hb"], .99), "quiet_send_p99_ms": _pct(quiet["send"], .99)}
            out["ratio"] = round(out["hb_p99_ms"] / out["quiet_hb_p99_ms"], 2) if out["quiet_hb_p99_ms"] else None
            print(json.dumps(out))
        finally:
            b.kill()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3,
                     sys.argv[3] if len(sys.argv) > 3 else None))
