"""A probe client's SEND while the real broker holds a large undecided index, main's broker against this one.

    python bench/bench_gc_broker.py [UNDECIDED=500000] [CHURN=100000] [BASE=/work/main]

For each of BASE's checkout and this one, in the same run: a broker process is given UNDECIDED halves (128 in flight,
no END: they stay undecided, the check far off) and restarted on the same store, so recovery loads them as a
restart does. Then one client (127.0.0.1) runs CHURN transactions (a half, then END_TRANSACTION commit, 32 in
flight), while another (127.0.0.2) sends one message at a time. Prints per broker the probe's p50 / p99 / worst
SEND, the broker's worst loop lag (txmq_event_loop_lag_max_seconds) and, where the broker times them
(txmq_gc_full_collection_seconds), its full collections' count and total; and the broker's anonymous RSS (RssAnon: not
the mapped files) after the load and after the churn. Last line JSON: both, and "ratio" = this one's worst probe SEND / main's (ours over the baseline: below 1 is better; "p99_ratio" the same).
"""
import asyncio, itertools, json, os, re, sys, tempfile, time, urllib.request
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from protocol.codes import RequestCode as R, ResponseCode as C, SysFlag
from protocol.command import RemotingCommand
from protocol.message import Prop, decode_offset_msg_id, properties_to_string
from tests.support.broker_process import BrokerProcess
from tests.support.raw_client import RawClient

_OPAQUES = itertools.count(1 << 24)
_HALF_PROPS = properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: "PG_gc"})
FLAGS = ("--transaction-timeout-ms", "86400000", "--transaction-check-interval-ms", "3600000",
         "--max-undecided-per-group", "10000000")


def _send(topic, half=False):
    return RemotingCommand(R.SEND_MESSAGE, opaque=next(_OPAQUES), body=b"m" * 100, ext_fields={
        "producerGroup": "PG_gc", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "4",
        "queueId": "0", "sysFlag": str(SysFlag.TRANSACTION_PREPARED if half else 0), "bornTimestamp": "0",
        "flag": "0", "properties": _HALF_PROPS if half else ""})


def _commit(reply):
    msg_id = reply.ext_fields["msgId"]
    return RemotingCommand(R.END_TRANSACTION, opaque=next(_OPAQUES), ext_fields={
        "producerGroup": "PG_gc", "tranStateTableOffset": reply.ext_fields["queueOffset"],
        "commitLogOffset": str(decode_offset_msg_id(msg_id)[2]), "commitOrRollback": "8",
        "fromTransactionCheck": "false", "msgId": msg_id, "transactionId": msg_id})


def _metrics(b):
    return urllib.request.urlopen(f"http://{b.metrics}/metrics").read().decode()


def _metric(text, name):
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _rss_mib(b):
    """The broker's anonymous resident memory: the heap, without the mapped segments' pages it touched."""
    with open(f"/proc/{b.proc.pid}/status") as f:
        kib = [int(line.split()[1]) for line in f if line.startswith("RssAnon:")][0]
    return round(kib / 1024, 1)


async def _in_flight(n, width, one):
    it = iter(range(n))

    async def lane():
        for i in it:
            await one(i)
    await asyncio.gather(*(lane() for _ in range(width)))


async def measure(repo, undecided, churn):
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", *FLAGS, repo=repo).start()
        try:
            loader = await RawClient.open(b.broker, "127.0.0.1")

            async def half(_):
                [r] = await loader.call(_send("T_gc", half=True), 60)
                assert r.code == C.SUCCESS, r.remark
            t0 = time.perf_counter()
            await _in_flight(undecided, 128, half)
            load_s = time.perf_counter() - t0
            loader.close()
            assert b.stop() == 0
            b = BrokerProcess(Path(d) / "store", *FLAGS, repo=repo).start(timeout=300)
            rss_loaded = _rss_mib(b)
            before = _metrics(b)
            churner = await RawClient.open(b.broker, "127.0.0.1")
            probe = await RawClient.open(b.broker, "127.0.0.2")
            done, lat = asyncio.Event(), []

            async def watch():
                while not done.is_set():
                    t0 = time.perf_counter()
                    [r] = await probe.call(_send("T_probe"), 60)
                    lat.append(time.perf_counter() - t0)
                    assert r.code == C.SUCCESS, r.remark

            async def tx(_):
                [r] = await churner.call(_send("T_gc", half=True), 60)
                assert r.code == C.SUCCESS, r.remark
                [e] = await churner.call(_commit(r), 60)
                assert e.code == C.SUCCESS, e.remark
            watcher = asyncio.create_task(watch())
            t0 = time.perf_counter()
            await _in_flight(churn, 32, tx)
            churn_s = time.perf_counter() - t0
            done.set()
            await watcher
            after = _metrics(b)
            lat.sort()
            gc_n = _metric(after, "txmq_gc_full_collection_seconds_count")
            gc_s = _metric(after, "txmq_gc_full_collection_seconds_sum")
            gc_n0 = _metric(before, "txmq_gc_full_collection_seconds_count") or 0
            gc_s0 = _metric(before, "txmq_gc_full_collection_seconds_sum") or 0
            return {"repo": str(repo), "undecided": undecided, "churn": churn, "load_s": round(load_s, 1),
                    "churn_s": round(churn_s, 1), "probe_n": len(lat),
                    "send_p50_ms": round(1000 * lat[len(lat) // 2], 1),
                    "send_p99_ms": round(1000 * lat[int(len(lat) * .99)], 1), "send_max_ms": round(1000 * lat[-1], 1),
                    "loop_lag_max_ms": round(1000 * _metric(after, "txmq_event_loop_lag_max_seconds"), 1),
                    "gc_full_n": None if gc_n is None else int(gc_n - gc_n0),
                    "gc_full_total_ms": None if gc_s is None else round(1000 * (gc_s - gc_s0), 1),
                    "rss_mib_loaded": rss_loaded, "rss_mib_after_churn": _rss_mib(b)}
        finally:
            b.kill()


async def main(undecided, churn, base):
    runs = {}
    for name, repo in (("main", Path(base)), ("this", Path(__file__).resolve().parents[1])):
        runs[name] = await measure(repo, undecided, churn)
        print(name, json.dumps(runs[name]), flush=True)
    m, t = runs["main"], runs["this"]
    print(json.dumps({"main": m, "this": t, "ratio": round(t["send_max_ms"] / m["send_max_ms"], 2),
                      "p99_ratio": round(t["send_p99_ms"] / m["send_p99_ms"], 2)}))


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(int(a[0]) if a else 500_000, int(a[1]) if len(a) > 1 else 100_000,
                     a[2] if len(a) > 2 else "/work/main"))
