"""Loop stalls another client sees while an admin asks what a consumer's size sets:

* status: mqadmin getConsumerStatus (INVOKE_BROKER_TO_GET_CONSUMER_STATUS, 223) of a group whose one consumer
  answers a GetConsumerStatusBody of QUEUES queues (250,000: 15 MB, near a frame's 16 MiB);
* connections: mqadmin consumerConnection (GET_CONSUMER_CONNECTION_LIST, 203) of a group subscribed to SUBS
  topics (26,000 six-character names: max_subscription_bytes_per_group's 256 KiB);
* stats: mqadmin consumerProgress -g G (GET_CONSUME_STATS, 208) of a group holding an offset on each of TOPICS
  topics of 1,024 queues (6 by default: what max_queues allows on a small machine; every queue of each is a row).

    python bench/bench_admin_holds.py [status|connections|stats] [--queues N] [--subs N] [--topics N] [--baseline REPO]

A stand-in Java consumer (a heartbeat; GET_CONSUMER_STATUS_FROM_CLIENT answered from a body built once) joins
group G; one client (127.0.0.1) asks three times in a row while another (127.0.0.2) sends, one after another
(bench_index_collisions.other_client_sees). Prints, per broker (this tree's, then REPO's run the same way), each
answer's time, the broker's worst loop lag of the second it ends in (txmq_event_loop_lag_seconds; its worst since
start too, which may be the heartbeat's parse), and the other client's worst and p99 SEND (this process reads the
answers too). The last line is JSON: "ratio" = this tree's worst loop lag over the asks / the baseline's (null
without one).
"""
import argparse, asyncio, json, os, random, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_index_collisions import other_client_sees  # noqa: E402
from bench_loop_stalls import _OPAQUES, _metric  # noqa: E402
from protocol.codes import LanguageCode, RequestCode as R, ResponseCode as C  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from protocol.connection import open_connection  # noqa: E402
from tests.support.broker_process import BrokerProcess  # noqa: E402
from tests.support.raw_client import RawClient  # noqa: E402


def _status_body(queues):
    # in HashMap order, as a stock consumer's fastjson writes its table: in order, the broker's sort of it was
    # linear and the bench did not show it (3.6-4.7 s of the loop for 250,000 shuffled queues)
    order = list(range(queues))
    random.Random(queues).shuffle(order)
    table = ",".join(f'{{"brokerName":"broker-a","queueId":{q},"topic":"T"}}:{q}' for q in order)
    return f'{{"consumerTable":{{}},"messageQueueTable":{{{table}}}}}'.encode()


def _heartbeat(topics):
    return json.dumps({"clientID": "10.0.0.1@1", "producerDataSet": [], "consumerDataSet": [{
        "groupName": "G", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
        "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False,
        "subscriptionDataSet": [{"topic": t, "subString": "*", "subVersion": 1, "expressionType": "TAG",
                                 "tagsSet": [], "codeSet": []} for t in topics]}]}).encode()


async def one_broker(repo, args):
    status = _status_body(args.queues) if args.case == "status" else b""
    beat = _heartbeat({"status": ["T"], "connections": [f"T{i:05d}" for i in range(args.subs)],
                       "stats": [f"TC{i}" for i in range(args.topics)]}[args.case])
    if args.case == "stats":
        ask_cmd = lambda: RemotingCommand(R.GET_CONSUME_STATS, opaque=next(_OPAQUES),  # noqa: E731
                                          ext_fields={"consumerGroup": "G"})
    elif args.case == "status":
        ask_cmd = lambda: RemotingCommand(R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS, opaque=next(_OPAQUES),  # noqa: E731
                                          ext_fields={"topic": "T", "group": "G"})
    else:
        ask_cmd = lambda: RemotingCommand(R.GET_CONSUMER_CONNECTION_LIST, opaque=next(_OPAQUES),  # noqa: E731
                                          ext_fields={"consumerGroup": "G"})
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", repo=repo and Path(repo)).start()
        try:
            host, _, port = b.broker.rpartition(":")
            consumer = await open_connection(host, int(port), lambda conn, cmd: cmd.response(C.SUCCESS, body=status)
                                             if cmd.code == R.GET_CONSUMER_STATUS_FROM_CLIENT else None)
            r = await consumer.request(RemotingCommand.request(R.HEART_BEAT, body=beat, language=LanguageCode.JAVA), 60)
            assert r.code == C.SUCCESS, r.remark
            for i in range(args.topics if args.case == "stats" else 0):
                for code, fields in ((R.UPDATE_AND_CREATE_TOPIC, {"topic": f"TC{i}", "readQueueNums": "1024",
                                                                  "writeQueueNums": "1024", "perm": "6"}),
                                     (R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "G", "topic": f"TC{i}",
                                                                 "queueId": "0", "commitOffset": "0"})):
                    r = await consumer.request(RemotingCommand.request(code, fields), 30)
                    assert r.code == C.SUCCESS, r.remark
            for _ in range(100):        # the heartbeat's parse out of the recent lag (at most 20 s)
                if _metric(b, "txmq_event_loop_lag_seconds") < 0.05:
                    break
                await asyncio.sleep(0.2)
            asker = await RawClient.open(b.broker, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")

            async def ask():
                answers, lags = [], []
                for _ in range(3):
                    t0 = time.perf_counter()
                    [r] = await asker.call(ask_cmd(), 120)
                    assert r.code == C.SUCCESS and len(r.body_bytes()) > max(len(status), len(beat)) // 4, r.remark
                    answers.append(round(time.perf_counter() - t0, 3))
                    # (the worst of the last second: the since-start worst may be the heartbeat's own parse)
                    lags.append(round(1000 * _metric(b, "txmq_event_loop_lag_seconds"), 1))
                return answers, lags
            (answers, lags), seen = await other_client_sees(b, other, ask, timeout=120)
            out = {"broker": str(repo or "this tree"), "case": args.case, "answer_s": answers,
                   "loop_lag_last_second_ms": lags, "loop_lag_ask_max_ms": max(lags), **seen}
            print(json.dumps(out), flush=True)
            for c in (consumer, asker, other):
                c.close()
            return out
        finally:
            b.kill()


async def main(args):
    ours = await one_broker(None, args)
    base = await one_broker(args.baseline, args) if args.baseline else None
    print(json.dumps({"case": args.case, "queues": args.queues, "subs": args.subs, "topics": args.topics,
                      "loop_lag_ms": ours["loop_lag_ask_max_ms"], "baseline_loop_lag_ms": base and base["loop_lag_ask_max_ms"],
                      "other_max_ms": ours["other_max_ms"], "baseline_other_max_ms": base and base["other_max_ms"],
                      "ratio": round(ours["loop_lag_ask_max_ms"] / base["loop_lag_ask_max_ms"], 3) if base else None}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("case", nargs="?", choices=("status", "connections", "stats"), default="status")
    p.add_argument("--queues", type=int, default=250_000)
    p.add_argument("--subs", type=int, default=26_000)
    p.add_argument("--topics", type=int, default=6)
    p.add_argument("--baseline")
    asyncio.run(main(p.parse_args()))
