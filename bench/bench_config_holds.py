"""How long a large config table written whole at each change holds a real broker's loop: a full KV config
(kvConfig.json: MAX_BYTES of short keys) at each PUT_KV_CONFIG (the save encodes the whole table) and
GET_KVLIST_BY_NAMESPACE (the answer is the whole namespace), and many subscription groups
(subscriptionGroup.json) at each UPDATE_AND_CREATE_SUBSCRIPTIONGROUP's save.

    python bench/bench_config_holds.py [--keys 100000] [--groups 50000] [--asks 10] [--baseline REPO]

The broker starts from a kvConfig.json of KEYS keys (20-byte values) in one namespace and a subscriptionGroup.json
of GROUPS groups. One client (127.0.0.1) sends ASKS PUT_KV_CONFIG of one key, one after another, then ASKS
GET_KVLIST_BY_NAMESPACE, then ASKS UPDATE_AND_CREATE_SUBSCRIPTIONGROUP of one group; another (127.0.0.2) sends a
SEND every 10 ms meanwhile (bench_request_holds' probe). Prints, per request, its median answer time, the other
client's median and worst SEND and the broker's worst loop lag over it (txmq_event_loop_lag_seconds, the last
second's worst, read every 0.5 s). REPO: a checkout whose broker is run the same way after this
one's (the baseline: /work/main before a change). The last line is JSON: the figures and "ratio" = this tree's
worst loop lag over the requests / the baseline's (null without one).
"""
import argparse, asyncio, itertools, json, os, sys, tempfile, time, urllib.request
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_request_holds import _probe, _send
from broker.subscriptions import SubscriptionGroups, group_config
from protocol.codes import RequestCode as R, ResponseCode as C
from protocol.command import RemotingCommand
from tests.support.broker_process import BrokerProcess
from tests.support.raw_client import RawClient

_OPAQUES = itertools.count(1 << 24)
NAMESPACE = "NS_bench"


def _lag_last_second(b) -> float:
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics").read().decode()
    return [float(l.split()[-1]) for l in text.splitlines() if l.startswith("txmq_event_loop_lag_seconds ")][0]


async def _lag_sampler(b, worst, stop):
    """The worst of txmq_event_loop_lag_seconds (the last second's worst loop lag) read every 0.5 s until ``stop``."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        worst[0] = max(worst[0], await loop.run_in_executor(None, _lag_last_second, b))
        await asyncio.sleep(0.5)


async def one_broker(repo, args):
    fig = {}
    with tempfile.TemporaryDirectory() as d:
        store = Path(d) / "store"
        (store / "config").mkdir(parents=True)
        table = {f"key-{i * 7919 % args.keys:08d}": "v" * 20 for i in range(args.keys)}     # (not in sorted order)
        (store / "config" / "kvConfig.json").write_text(json.dumps({"configTable": {NAMESPACE: table}}))
        groups = SubscriptionGroups(str(store / "config"), lambda: 0)
        groups.groups = {name: group_config(name, {"retryMaxTimes": 3})
                         for name in (f"GID_{i * 7919 % args.groups:08d}" for i in range(args.groups))}
        groups.write(groups.encode())
        b = BrokerProcess(store, repo=repo and Path(repo)).start()
        try:
            kv = await RawClient.open(b.namesrv, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")
            admin = await RawClient.open(b.broker, "127.0.0.1")
            [r] = await other.call(_send("TProbe"), 30)
            assert r.code == C.SUCCESS, r.remark
            cases = {"PUT_KV_CONFIG": (R.PUT_KV_CONFIG, {"namespace": NAMESPACE, "key": "key-00000000", "value": "w" * 20}),
                     "GET_KVLIST_BY_NAMESPACE": (R.GET_KVLIST_BY_NAMESPACE, {"namespace": NAMESPACE}),
                     "UPDATE_AND_CREATE_SUBSCRIPTIONGROUP": (R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, None)}
            for name, (code, fields) in cases.items():
                lat, stop, lag = [], asyncio.Event(), [0.0]
                probe = asyncio.create_task(_probe(other, lat, stop))
                sampler = asyncio.create_task(_lag_sampler(b, lag, stop))
                answers = []
                for _ in range(args.asks):
                    t0 = time.perf_counter()
                    cmd = RemotingCommand(code, opaque=next(_OPAQUES), ext_fields=fields or {}, body=b"" if fields else
                                          json.dumps({"groupName": "GID_00000000", "retryMaxTimes": 5}).encode())
                    [r] = await (kv if fields else admin).call(cmd, 120)
                    answers.append(round((time.perf_counter() - t0) * 1000, 1))
                    assert r.code == C.SUCCESS, r.remark
                await asyncio.sleep(1.0)        # (the last request's second read too)
                stop.set()
                await probe
                await sampler
                lat.sort()
                fig[name] = {"answer_ms_median": sorted(answers)[len(answers) // 2],
                             "other_send_p50_ms": round(lat[len(lat) // 2] * 1000, 1),
                             "other_send_worst_ms": round(lat[-1] * 1000, 1),
                             "loop_lag_worst_ms": round(lag[0] * 1000, 1)}
                print(f"{repo or 'this tree'}: {name}: {fig[name]}", flush=True)
            kv.close()
            other.close()
            admin.close()
        finally:
            b.stop()
    return fig


def _worst_lag(fig):
    return max(f["loop_lag_worst_ms"] for f in fig.values())


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--groups", type=int, default=50_000)
    p.add_argument("--asks", type=int, default=10)
    p.add_argument("--baseline")
    args = p.parse_args()
    ours = await one_broker(None, args)
    base = await one_broker(args.baseline, args) if args.baseline else None
    print(json.dumps({"keys": args.keys, "groups": args.groups, "ours": ours, "baseline": base,
                      "ratio": round(_worst_lag(ours) / _worst_lag(base), 3) if base else None}))


if __name__ == "__main__":
    asyncio.run(main())
