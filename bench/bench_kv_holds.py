"""How long a full KV config (kvConfig.json: MAX_BYTES of short keys) holds a real broker's loop at each
PUT_KV_CONFIG (the save encodes the whole table) and GET_KVLIST_BY_NAMESPACE (the answer is the whole namespace).

    python bench/bench_kv_holds.py [--keys 100000] [--asks 10] [--baseline REPO]

The broker starts from a kvConfig.json of KEYS keys (20-byte values) in one namespace. One client (127.0.0.1) sends
ASKS PUT_KV_CONFIG of one key, one after another, then ASKS GET_KVLIST_BY_NAMESPACE; another (127.0.0.2) sends a
SEND every 10 ms meanwhile (bench_request_holds' probe). Prints, per request, its answer times, the other client's
worst SEND and the broker's worst loop lag over it. REPO: a checkout whose broker is run the same way after this
one's (the baseline: /work/main before a change). The last line is JSON: the figures and "ratio" = this tree's
worst loop lag over both requests / the baseline's (null without one).
"""
import argparse, asyncio, itertools, json, os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_request_holds import _lag, _probe, _send
from protocol.codes import RequestCode as R, ResponseCode as C
from protocol.command import RemotingCommand
from tests.support.broker_process import BrokerProcess
from tests.support.raw_client import RawClient

_OPAQUES = itertools.count(1 << 24)
NAMESPACE = "NS_bench"


async def one_broker(repo, args):
    fig = {}
    with tempfile.TemporaryDirectory() as d:
        store = Path(d) / "store"
        (store / "config").mkdir(parents=True)
        table = {f"key-{i * 7919 % args.keys:08d}": "v" * 20 for i in range(args.keys)}     # (not in sorted order)
        (store / "config" / "kvConfig.json").write_text(json.dumps({"configTable": {NAMESPACE: table}}))
        b = BrokerProcess(store, repo=repo and Path(repo)).start()
        try:
            kv = await RawClient.open(b.namesrv, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")
            [r] = await other.call(_send("TProbe"), 30)
            assert r.code == C.SUCCESS, r.remark
            cases = {"PUT_KV_CONFIG": (R.PUT_KV_CONFIG, {"namespace": NAMESPACE, "key": "key-00000000", "value": "w" * 20}),
                     "GET_KVLIST_BY_NAMESPACE": (R.GET_KVLIST_BY_NAMESPACE, {"namespace": NAMESPACE})}
            for name, (code, fields) in cases.items():
                lag0, lat, stop = _lag(b), [], asyncio.Event()
                probe = asyncio.create_task(_probe(other, lat, stop))
                answers = []
                for _ in range(args.asks):
                    t0 = time.perf_counter()
                    [r] = await kv.call(RemotingCommand(code, opaque=next(_OPAQUES), ext_fields=fields), 120)
                    answers.append(round((time.perf_counter() - t0) * 1000, 1))
                    assert r.code == C.SUCCESS, r.remark
                stop.set()
                await probe
                lag = _lag(b)
                lat.sort()
                fig[name] = {"answer_ms_median": sorted(answers)[len(answers) // 2],
                             "other_send_p50_ms": round(lat[len(lat) // 2] * 1000, 1),
                             "other_send_worst_ms": round(lat[-1] * 1000, 1),
                             "loop_lag_worst_ms": round(lag * 1000, 1) if lag > lag0 else f"<= {round(lag0 * 1000, 1)}"}
                print(f"{repo or 'this tree'}: {name}: {fig[name]}", flush=True)
            kv.close()
            other.close()
        finally:
            b.stop()
    return fig


def _worst_lag(fig):
    return max(float(str(f["loop_lag_worst_ms"]).lstrip("<= ")) for f in fig.values())


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--asks", type=int, default=10)
    p.add_argument("--baseline")
    args = p.parse_args()
    ours = await one_broker(None, args)
    base = await one_broker(args.baseline, args) if args.baseline else None
    print(json.dumps({"keys": args.keys, "ours": ours, "baseline": base,
                      "ratio": round(_worst_lag(ours) / _worst_lag(base), 3) if base else None}))


if __name__ == "__main__":
    asyncio.run(main())
