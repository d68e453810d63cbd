"""Loop stalls another client sees while one client sends large HEART_BEAT bodies, one after another.

    python bench/bench_heartbeat_hold.py [MB] [COUNT] [REPO]      (e.g. 15 5)

One client (127.0.0.1) sends COUNT heartbeats of about MB megabytes (consumer groups of 100 subscriptions each,
as a stock Java client writes them), each after the last's reply; another (127.0.0.2) sends, one after another.
Prints each heartbeat's time and answer, the other client's worst and p99 SEND meanwhile and the broker's worst
loop lag (txmq_event_loop_lag_max_seconds). REPO: the checkout whose broker runs (a baseline worktree).
The last line is JSON: "ratio" = the other client's p99 SEND meanwhile / its p99 of 200 sent just before.
"""
import asyncio, json, os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_index_collisions import other_client_sees  # noqa: E402
from bench_loop_stalls import _OPAQUES  # noqa: E402
from protocol.codes import RequestCode as R  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from tests.support.broker_process import BrokerProcess  # noqa: E402
from tests.support.raw_client import RawClient  # noqa: E402


def heartbeat_body(megabytes: float) -> bytes:
    """A stock client's heartbeat of about ``megabytes``: groups of 100 subscriptions each (~16 KB a group)."""
    def group(g):
        subs = [{"classFilterMode": False, "topic": f"Topic_{g}_{s}", "subString": "*", "tagsSet": [], "codeSet": [],
                 "subVersion": 1700000000000, "expressionType": "TAG"} for s in range(100)]
        return {"groupName": f"CG_{g}", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False, "subscriptionDataSet": subs}
    groups = max(1, int(megabytes * 1e6 / 15800))
    return json.dumps({"clientID": "big@1", "producerDataSet": [],
                       "consumerDataSet": [group(g) for g in range(groups)]}).encode()


async def main(megabytes, count, repo):
    body = heartbeat_body(megabytes)
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", "--max-topics-per-host", "1000000", "--max-retry-groups", "100000",
                          repo=repo and Path(repo)).start()
        try:
            big = await RawClient.open(b.broker, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")

            async def beat():
                beats = []
                for _ in range(count):
                    t0 = time.perf_counter()
                    [r] = await big.call(RemotingCommand(R.HEART_BEAT, opaque=next(_OPAQUES), body=body), 120)
                    beats.append((round(time.perf_counter() - t0, 3), int(r.code), (r.remark or "")[:120]))
                return beats
            beats, seen = await other_client_sees(b, other, beat)
            out = {"body_bytes": len(body), "heartbeats": beats, **seen}
            print(json.dumps(out))
        finally:
            b.kill()


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1]) if len(sys.argv) > 1 else 15, int(sys.argv[2]) if len(sys.argv) > 2 else 5,
                     sys.argv[3] if len(sys.argv) > 3 else None))
