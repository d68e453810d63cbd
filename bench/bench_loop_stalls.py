"""Loop stalls another client sees while one client makes many new queues.

    python bench/bench_loop_stalls.py TOPICS [QUEUES] [REPO]     (e.g. 1000 8)

One client (127.0.0.1) makes TOPICS topics of QUEUES queues (UPDATE_AND_CREATE_TOPIC) and then sends one
message to each queue, 32 in flight: every send makes a consume-queue file. Another client (127.0.0.2) sends a
HEARTBEAT and a SEND to a queue that exists, one after the other, all the while. Prints the burst's time, the
other client's worst and p99 latencies during it, and the broker's worst loop lag (txmq_event_loop_lag_max_seconds).
REPO: the checkout whose broker runs (a baseline worktree). SPY=1 records a py-spy profile to /tmp/loop_stalls.txt.
The last line is JSON: the figures and "ratio" = the other client's p99 SEND during the burst / its p99 SEND of 200
sent just before it (the same run's baseline).
"""
import asyncio, itertools, json, os, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from protocol.codes import RequestCode as R, ResponseCode as C
from protocol.command import RemotingCommand
from tests.support.broker_process import BrokerProcess
from tests.support.raw_client import RawClient

_OPAQUES = itertools.count(1 << 24)


def _send_cmd(topic, qid):
    return RemotingCommand(R.SEND_MESSAGE, opaque=next(_OPAQUES), body=b"m", ext_fields={
        "producerGroup": "PG_burst", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "8",
        "queueId": str(qid), "sysFlag": "0", "bornTimestamp": "0", "flag": "0", "properties": ""})


def _heartbeat():
    body = json.dumps({"clientID": "other@1", "producerDataSet": [{"groupName": "PG_other"}],
                       "consumerDataSet": []}).encode()
    return RemotingCommand(R.HEART_BEAT, opaque=next(_OPAQUES), body=body)


def _metric(b, name):
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics").read().decode()
    return [float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " ")][0]


async def main(topics, queues, repo):
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", "--max-queues-per-host", "8192", "--max-topics-per-host", "100000",
                          "--max-auto-create-topics-per-s", "100000", repo=repo and Path(repo)).start()
        try:
            burst = await RawClient.open(b.broker, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")
            [r] = await other.call(_send_cmd("Existing", 0), 10)
            assert r.code == C.SUCCESS, r.remark
            for t in range(topics):
                [r] = await burst.call(RemotingCommand(R.UPDATE_AND_CREATE_TOPIC, opaque=next(_OPAQUES), ext_fields={
                    "topic": f"T{t}", "readQueueNums": str(queues), "writeQueueNums": str(queues), "perm": "6"}), 30)
                assert r.code == C.SUCCESS, r.remark
            base_lag = _metric(b, "txmq_event_loop_lag_max_seconds")
            quiet = []
            for _ in range(200):
                t0 = time.perf_counter()
                [r] = await other.call(_send_cmd("Existing", 0), 30)
                quiet.append(time.perf_counter() - t0)
                assert r.code == C.SUCCESS, r.remark
            quiet.sort()
            spy = None
            if os.environ.get("SPY"):
                spy = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-o",
                                        "/tmp/loop_stalls.txt", "-f", "raw", "-p", str(b.proc.pid), "-r", "200"])
            done = asyncio.Event()
            lat = {"hb": [], "send": []}

            async def watch():
                while not done.is_set():
                    for kind, cmd in (("hb", _heartbeat()), ("send", _send_cmd("Existing", 0))):
                        t0 = time.perf_counter()
                        [r] = await other.call(cmd, 30)
                        lat[kind].append(time.perf_counter() - t0)
                        assert r.code == C.SUCCESS, r.remark

            async def make(keys):
                for t, q in keys:
                    [r] = await burst.call(_send_cmd(f"T{t}", q), 30)
                    assert r.code == C.SUCCESS, r.remark

            keys = [(t, q) for t in range(topics) for q in range(queues)]
            watcher = asyncio.create_task(watch())
            t0 = time.perf_counter()
            await asyncio.gather(*(make(keys[i::32]) for i in range(32)))
            took = time.perf_counter() - t0
            done.set()
            await watcher
            if spy:
                spy.send_signal(__import__("signal").SIGINT)
                spy.wait()
            out = {"queues": len(keys), "burst_s": round(took, 2),
                   "loop_lag_max_ms": round(1000 * _metric(b, "txmq_event_loop_lag_max_seconds"), 1),
                   "loop_lag_max_before_ms": round(1000 * base_lag, 1)}
            for kind, xs in lat.items():
                xs.sort()
                out[f"{kind}_n"] = len(xs)
                out[f"{kind}_max_ms"] = round(1000 * xs[-1], 1)
                out[f"{kind}_p99_ms"] = round(1000 * xs[int(len(xs) * 0.99)], 1)
                out[f"{kind}_p50_ms"] = round(1000 * xs[len(xs) // 2], 1)
            out["quiet_send_p99_ms"] = round(1000 * quiet[int(len(quiet) * 0.99)], 1)
            out["ratio"] = round(out["send_p99_ms"] / out["quiet_send_p99_ms"], 3) if out["quiet_send_p99_ms"] else None
            print(json.dumps(out))
        finally:
            b.kill()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8,
                     sys.argv[3] if len(sys.argv) > 3 else None))
