"""Loop stalls another client sees while one client asks CHECK_CLIENT_CONFIG (46) of long SQL92 expressions.

    python bench/bench_sql92_hold.py [DASHES] [COUNT] [REPO]      (e.g. 16000 3)

One client (127.0.0.1) sends COUNT CHECK_CLIENT_CONFIG requests, each after the last's reply, each naming
``a<i> = ----...1`` (DASHES minus signs, a different property each so no cache answers); another (127.0.0.2)
sends, one after another. A "--" starts a comment only when a line break follows; the lexer looked for one to
the end of the text at every "-". Prints each request's time and answer, the other client's worst and p99 SEND
meanwhile and the broker's worst loop lag. REPO: the checkout whose broker runs (a baseline worktree).
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


def _check(i, dashes):
    body = {"clientId": "c@1", "group": "CG", "subscriptionData": {
        "topic": "T", "expressionType": "SQL92", "subString": f"a{i} = " + "-" * dashes + "1"}}
    return RemotingCommand(R.CHECK_CLIENT_CONFIG, opaque=next(_OPAQUES), body=json.dumps(body).encode())


async def main(dashes, count, repo):
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", "--enable-property-filter", "true", repo=repo and Path(repo)).start()
        try:
            asker = await RawClient.open(b.broker, "127.0.0.1")
            other = await RawClient.open(b.broker, "127.0.0.2")

            async def check():
                asked = []
                for i in range(count):
                    t0 = time.perf_counter()
                    [r] = await asker.call(_check(i, dashes), 120)
                    asked.append((round(time.perf_counter() - t0, 3), int(r.code), (r.remark or "")[:80]))
                return asked
            asked, seen = await other_client_sees(b, other, check, timeout=60)
            out = {"dashes": dashes, "checks": asked, **seen}
            print(json.dumps(out))
        finally:
            b.kill()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 16000, int(sys.argv[2]) if len(sys.argv) > 2 else 3,
                     sys.argv[3] if len(sys.argv) > 3 else None))
