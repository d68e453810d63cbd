"""Loop stalls another client sees while one client queries a key whose index chain is long with another key's.

    python bench/bench_index_collisions.py [COUNT] [REPO]      (e.g. 50000)

"Aa" and "BB" have one Java String.hashCode, so T#Aa and T#BB share every index entry. COUNT messages are sent
with KEYS=BB (32 in flight); then one client (127.0.0.1) asks QUERY_MESSAGE for "Aa" (stored never: every entry
of the chain is another key's) five times in a row, while another client (127.0.0.2) sends, one after another.
Prints each query's time and answer, the other client's worst and p99 SEND during the queries, and the broker's
worst loop lag (txmq_event_loop_lag_max_seconds). REPO: the checkout whose broker runs (a baseline worktree).
The last line is JSON: "ratio" = the other client's p99 SEND during the queries / its p99 of 200 sent just before.
"""
import asyncio, json, os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop_stalls import _OPAQUES, _metric, _send_cmd  # noqa: E402
from protocol.codes import RequestCode as R, ResponseCode as C  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from tests.support.broker_process import BrokerProcess  # noqa: E402
from tests.support.raw_client import RawClient  # noqa: E402


def _keyed(qid):
    cmd = _send_cmd("Collide", qid)
    cmd.ext_fields["properties"] = "KEYS\x01BB\x02"
    return cmd


def _query(key, max_num=32):
    return RemotingCommand(R.QUERY_MESSAGE, opaque=next(_OPAQUES), ext_fields={
        "topic": "Collide", "key": key, "maxNum": str(max_num), "beginTimestamp": "0",
        "endTimestamp": str(2**63 - 1)})


def _p(xs, q):
    return round(1000 * xs[min(len(xs) - 1, int(len(xs) * q))], 1)


async def other_client_sees(b, other, act, timeout=30):
    """What ``other`` (a RawClient of broker ``b``) sees while ``await act()`` runs: it SENDs one after another
    meanwhile. Returns (act's result, the JSON fields the hold benches print: its sends' count, worst and p99 in ms,
    its p99 of 200 sent just before, the broker's worst loop lag then and before, and "ratio" of the two p99s)."""
    quiet = []
    for _ in range(200):
        t0 = time.perf_counter()
        [r] = await other.call(_send_cmd("Existing", 0), 30)
        quiet.append(time.perf_counter() - t0)
    quiet.sort()
    base_lag = _metric(b, "txmq_event_loop_lag_max_seconds")
    done, lat = asyncio.Event(), []

    async def watch():
        while not done.is_set():
            t0 = time.perf_counter()
            [r] = await other.call(_send_cmd("Existing", 0), timeout)
            lat.append(time.perf_counter() - t0)
            assert r.code == C.SUCCESS, r.remark
    watcher = asyncio.create_task(watch())
    try:
        acted = await act()
    finally:
        done.set()
        await watcher
    lat.sort()
    out = {"other_n": len(lat), "other_max_ms": _p(lat, 1), "other_p99_ms": _p(lat, 0.99),
           "quiet_p99_ms": _p(quiet, 0.99),
           "loop_lag_max_ms": round(1000 * _metric(b, "txmq_event_loop_lag_max_seconds"), 1),
           "loop_lag_max_before_ms": round(1000 * base_lag, 1)}
    out["ratio"] = round(out["other_p99_ms"] / out["quiet_p99_ms"], 3) if out["quiet_p99_ms"] else None
    return acted, out


async def main(count, repo):
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", repo=repo and Path(repo)).start()
        try:
            loader = await RawClient.open(b.broker, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")

            async def load(n):
                for i in range(n):
                    [r] = await loader.call(_keyed(i % 4), 30)
                    assert r.code == C.SUCCESS, r.remark
            await asyncio.gather(*(load(count // 32) for _ in range(32)))
            while True:         # the index has caught up: a query for BB finds 32
                [r] = await loader.call(_query("BB"), 60)
                if r.code == C.SUCCESS and r.int_field("indexLastUpdatePhyoffset") > 0:
                    [r2] = await loader.call(_query("BB", 1), 60)
                    if r2.code == C.SUCCESS:
                        break
                await asyncio.sleep(0.2)
            await asyncio.sleep(2)

            async def ask():
                queries = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    [r] = await loader.call(_query("Aa"), 120)
                    queries.append((round(time.perf_counter() - t0, 3), int(r.code), r.remark))
                return queries
            queries, seen = await other_client_sees(b, other, ask)
            out = {"count": count, "queries": queries, **seen}
            print(json.dumps(out))
        finally:
            b.kill()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 50000, sys.argv[2] if len(sys.argv) > 2 else None))
