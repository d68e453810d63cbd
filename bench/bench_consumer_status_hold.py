"""Loop stalls another client sees while mqadmin getConsumerStatus (INVOKE_BROKER_TO_GET_CONSUMER_STATUS, 223)
asks a group whose one consumer answers a GetConsumerStatusBody of QUEUES queues (250,000: 15 MB, near a frame's
16 MiB).

    python bench/bench_consumer_status_hold.py [QUEUES] [BASELINE_REPO]

A stand-in Java consumer (a heartbeat, then GET_CONSUMER_STATUS_FROM_CLIENT answered from a body built once)
joins group G; one client (127.0.0.1) asks the status three times in a row while another (127.0.0.2) sends, one
after another (bench_index_collisions.other_client_sees). Prints, per broker (this tree's, then BASELINE_REPO's
run the same way), each answer's time, the other client's worst and p99 SEND and the broker's worst loop lag.
The last line is JSON: "ratio" = this tree's worst loop lag / the baseline's (null without one).
"""
import asyncio, json, os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_index_collisions import other_client_sees  # noqa: E402
from bench_loop_stalls import _OPAQUES  # noqa: E402
from protocol.codes import LanguageCode, RequestCode as R, ResponseCode as C  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from protocol.connection import open_connection  # noqa: E402
from tests.support.broker_process import BrokerProcess  # noqa: E402
from tests.support.raw_client import RawClient  # noqa: E402


def _status_body(queues):
    table = ",".join(f'{{"brokerName":"broker-a","queueId":{q},"topic":"T"}}:{q}' for q in range(queues))
    return f'{{"consumerTable":{{}},"messageQueueTable":{{{table}}}}}'.encode()


async def one_broker(repo, body):
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", repo=repo and Path(repo)).start()
        try:
            host, _, port = b.broker.rpartition(":")
            consumer = await open_connection(host, int(port), lambda conn, cmd: cmd.response(C.SUCCESS, body=body)
                                             if cmd.code == R.GET_CONSUMER_STATUS_FROM_CLIENT else None)
            beat = {"clientID": "10.0.0.1@1", "producerDataSet": [], "consumerDataSet": [{
                "groupName": "G", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False,
                "subscriptionDataSet": [{"topic": "T", "subString": "*", "subVersion": 1}]}]}
            r = await consumer.request(RemotingCommand.request(R.HEART_BEAT, body=json.dumps(beat).encode(),
                                                               language=LanguageCode.JAVA), 10)
            assert r.code == C.SUCCESS, r.remark
            asker = await RawClient.open(b.broker, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")

            async def ask():
                answers = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    [r] = await asker.call(RemotingCommand(R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS, opaque=next(
                        _OPAQUES), ext_fields={"topic": "T", "group": "G"}), 120)
                    assert r.code == C.SUCCESS and len(r.body_bytes()) > len(body) // 2, (r.remark, r.body_bytes()[:200])
                    answers.append(round(time.perf_counter() - t0, 3))
                return answers
            answers, seen = await other_client_sees(b, other, ask, timeout=120)
            out = {"broker": str(repo or "this tree"), "answer_s": answers, **seen}
            print(json.dumps(out), flush=True)
            for c in (consumer, asker, other):
                c.close()
            return out
        finally:
            b.kill()


async def main(queues, baseline):
    body = _status_body(queues)
    ours = await one_broker(None, body)
    base = await one_broker(baseline, body) if baseline else None
    print(json.dumps({"queues": queues, "body_bytes": len(body), "loop_lag_max_ms": ours["loop_lag_max_ms"],
                      "baseline_loop_lag_max_ms": base and base["loop_lag_max_ms"],
                      "other_max_ms": ours["other_max_ms"], "baseline_other_max_ms": base and base["other_max_ms"],
                      "ratio": round(ours["loop_lag_max_ms"] / base["loop_lag_max_ms"], 3) if base else None}))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 250_000, sys.argv[2] if len(sys.argv) > 2 else None))
