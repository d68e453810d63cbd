"""How long one frame of a huge command header holds a real broker's loop: a JSON header of 12.5 MB (900,000 made-up
extFields; a frame's worth) parsed whole on the loop before anything refused it, where no stock client's header
comes near 256 KiB (protocol.frame.MAX_HEADER_SIZE).

    python bench/bench_header_holds.py [--fields 900000] [--baseline REPO]

One client (127.0.0.1) sends such a frame three times, one after another; another (127.0.0.2) sends a SEND every
10 ms meanwhile (bench_request_holds' probe). Prints the answer times, the other client's worst SEND and the
broker's worst loop lag over them (the rise of txmq_event_loop_lag_max_seconds, or its value). REPO: a checkout whose
broker is run the same way after this one's (the baseline: /work/main before a change). The last line is JSON: the
figures and "ratio" = this tree's worst loop lag / the baseline's (null without one).
"""
import argparse, asyncio, json, os, struct, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_request_holds import _lag, _probe, _send
from protocol.codes import ResponseCode as C
from tests.support.broker_process import BrokerProcess
from tests.support.raw_client import RawClient


def _huge_header_frame(fields: int, opaque: int) -> bytes:
    """A SEND_MESSAGE frame whose JSON header holds ``fields`` made-up extFields, the fields fastjson writes after
    them where it writes them."""
    header = json.dumps({"code": 10, "extFields": {f"k{i}": "v" for i in range(fields)}, "flag": 0,
                         "language": "JAVA", "opaque": opaque, "serializeTypeCurrentRPC": "JSON", "version": 395},
                        separators=(",", ":")).encode()
    return struct.pack(">ii", 4 + len(header), len(header)) + header


async def one_broker(repo, args):
    frames = [(opaque, _huge_header_frame(args.fields, opaque)) for opaque in (1 << 25, (1 << 25) + 1, (1 << 25) + 2)]
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", repo=repo and Path(repo)).start()
        try:
            big = await RawClient.open(b.broker, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")
            [r] = await other.call(_send("TProbe"), 30)
            assert r.code == C.SUCCESS, r.remark
            lag0, lat, stop = _lag(b), [], asyncio.Event()
            probe = asyncio.create_task(_probe(other, lat, stop))
            answers, remark = [], None
            for opaque, frame in frames:
                t0 = time.perf_counter()
                [r] = await big.call_raw(frame, opaque, 120)
                answers.append(round((time.perf_counter() - t0) * 1000, 1))
                assert r.code != C.SUCCESS
                remark = r.remark
            stop.set()
            await probe
            lag = _lag(b)
            fig = {"header_bytes": len(frames[0][1]) - 8, "answer_ms": answers, "remark": remark[:120],
                   "other_send_worst_ms": round(max(lat) * 1000, 1),
                   "loop_lag_worst_ms": round(lag * 1000, 1) if lag > lag0 else f"<= {round(lag0 * 1000, 1)}"}
            print(f"{repo or 'this tree'}: {fig}", flush=True)
            big.close()
            other.close()
        finally:
            b.stop()
    return fig


def _worst_lag(fig):
    return float(str(fig["loop_lag_worst_ms"]).lstrip("<= "))


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fields", type=int, default=900_000)
    ap.add_argument("--baseline")
    args = ap.parse_args()
    out = {"fields": args.fields, "this": await one_broker(None, args)}
    if args.baseline:
        out["baseline"] = await one_broker(args.baseline, args)
    out["ratio"] = round(_worst_lag(out["this"]) / _worst_lag(out["baseline"]), 3) if args.baseline else None
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
