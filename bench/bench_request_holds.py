"""How long one large request holds a real broker's loop: LOCK_BATCH_MQ / UNLOCK_BATCH_MQ of a frame's worth of
queues, and SEND_BATCH_MESSAGE of many tiny messages (4,096 by default; at most max_batch_messages, max_message_size / 64).

    python bench/bench_request_holds.py [--queues 250000] [--batch 4096] [--baseline REPO]

One client (127.0.0.1) sends each request three times, one after another; another (127.0.0.2) sends a SEND every
10 ms meanwhile. Prints, per request, its answer times, the other client's worst SEND and the broker's worst loop
lag over it (the rise of txmq_event_loop_lag_max_seconds, or its value). REPO: a checkout whose broker is run the
same way after this one's (the baseline: /work/main before a change). The last line is JSON: the figures and
"ratio" = this tree's worst loop lag over the LOCK and UNLOCK requests / the baseline's (null without one).
"""
import argparse, asyncio, itertools, json, os, sys, tempfile, time, urllib.request
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from protocol.codes import RequestCode as R, ResponseCode as C
from protocol.command import RemotingCommand
from protocol.message import encode_batch
from tests.support.broker_process import BrokerProcess
from tests.support.raw_client import RawClient

_OPAQUES = itertools.count(1 << 24)


def _send(topic, body=b"p", code=R.SEND_MESSAGE, batch=False):
    return RemotingCommand(code, opaque=next(_OPAQUES), body=body, ext_fields={
        "producerGroup": "PG_holds", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "8",
        "queueId": "0", "sysFlag": "0", "bornTimestamp": "0", "flag": "0", "properties": "",
        "batch": "true" if batch else "false"})


def _lag(b):
    text = urllib.request.urlopen(f"http://{b.metrics}/metrics").read().decode()
    return [float(l.split()[-1]) for l in text.splitlines() if l.startswith("txmq_event_loop_lag_max_seconds ")][0]


async def _probe(other, lat, stop):
    while not stop.is_set():
        t0 = time.perf_counter()
        [r] = await other.call(_send("TProbe"), 60)
        assert r.code == C.SUCCESS, r.remark
        lat.append(time.perf_counter() - t0)
        await asyncio.sleep(0.01)


async def one_broker(repo, args):
    fig = {}
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", repo=repo and Path(repo)).start()
        try:
            big = await RawClient.open(b.broker, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")
            [r] = await big.call(RemotingCommand(R.UPDATE_AND_CREATE_TOPIC, opaque=next(_OPAQUES), ext_fields={
                "topic": "TBig", "readQueueNums": "1024", "writeQueueNums": "1024", "perm": "6"}), 30)
            assert r.code == C.SUCCESS, r.remark
            for topic in ("TProbe", "TBig"):
                [r] = await other.call(_send(topic), 30)
                assert r.code == C.SUCCESS, r.remark
            mqs = [{"topic": "TBig", "brokerName": "broker-a", "queueId": i % 1024} for i in range(args.queues)]
            locks = json.dumps({"consumerGroup": "G", "clientId": "c", "mqSet": mqs}).encode()
            tiny = encode_batch([(0, b"x", "")] * args.batch)
            cases = {"LOCK_BATCH_MQ": lambda: RemotingCommand(R.LOCK_BATCH_MQ, opaque=next(_OPAQUES), body=locks),
                     "UNLOCK_BATCH_MQ": lambda: RemotingCommand(R.UNLOCK_BATCH_MQ, opaque=next(_OPAQUES), body=locks),
                     "SEND_BATCH_MESSAGE": lambda: _send("TBig", tiny, R.SEND_BATCH_MESSAGE, True)}
            for name, make in cases.items():
                lag0, lat, stop = _lag(b), [], asyncio.Event()
                probe = asyncio.create_task(_probe(other, lat, stop))
                answers = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    [r] = await big.call(make(), 120)
                    answers.append(round((time.perf_counter() - t0) * 1000, 1))
                    assert r.code == C.SUCCESS, r.remark
                stop.set()
                await probe
                lag = _lag(b)
                fig[name] = {"answer_ms": answers, "other_send_worst_ms": round(max(lat) * 1000, 1),
                             "loop_lag_worst_ms": round(lag * 1000, 1) if lag > lag0 else f"<= {round(lag0 * 1000, 1)}"}
                print(f"{repo or 'this tree'}: {name}: {fig[name]}", flush=True)
            big.close()
            other.close()
        finally:
            b.stop()
    return fig


def _worst_lock_lag(fig):
    return max(float(str(fig[n]["loop_lag_worst_ms"]).lstrip("<= ")) for n in ("LOCK_BATCH_MQ", "UNLOCK_BATCH_MQ"))


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--queues", type=int, default=250_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--baseline")
    args = ap.parse_args()
    out = {"queues": args.queues, "batch": args.batch, "this": await one_broker(None, args)}
    if args.baseline:
        out["baseline"] = await one_broker(args.baseline, args)
    out["ratio"] = round(_worst_lock_lag(out["this"]) / _worst_lock_lag(out["baseline"]), 3) if args.baseline else None
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
