"""The admin list against a real broker holding N undecided transactions: what another client sees meanwhile.

    python bench/bench_admin_list_live.py N     (e.g. 100000)

A producer that never answers sends N halves (checks 10 minutes away); then a plain SEND every 10 ms probes the
loop while the admin lists (limit 1,000, then 10^9), a few times each: prints each list's answer time and body size
and the worst probe SEND during the lists. The last line is JSON: the figures and "ratio" = the worst probe SEND
during the limit-1,000 lists / the worst of the probes sent for 1 s before any list (the same run's baseline).
"""
import asyncio, json, os, shutil, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.probe_sends import probe_sends
from tests.support.broker_process import BrokerProcess
from producer import TransactionProducer, Producer, LocalTransactionState as S
from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import BrokerError


class Never:
    def execute_local_transaction(self, m, a):
        return S.UNKNOW

    async def check_local_transaction(self, m):
        await asyncio.Event().wait()


async def main(n):
    d = tempfile.mkdtemp(prefix="admin-list")
    b = BrokerProcess(os.path.join(d, "store"), "--transaction-timeout-ms", "600000",
                      "--transaction-check-interval-ms", "600000", "--max-undecided-per-group", str(max(n, 100000))).start()
    p = await TransactionProducer(b.namesrv, "PG_big", Never(), end_retries=0).start()
    sem = asyncio.Semaphore(512)

    async def one():
        async with sem:
            await p.send_in_transaction("TBig", b"x" * 100)
    await asyncio.gather(*(one() for _ in range(n)))
    probe = await Producer(b.namesrv, "PG_probe", send_timeout=30).start()
    await probe.send("TProbe", b"warm")
    host, _, port = b.broker.rpartition(":")
    admin = await open_connection(host, int(port))
    fig = {"n": n}
    for limit in (None, 1000, 10**9):       # None: no list, the probes' baseline
        lat, stop = [], asyncio.Event()
        task = asyncio.create_task(probe_sends(probe, lat, stop))
        answers = []
        if limit is None:
            await asyncio.sleep(1)          # (the baseline's probes are sent for a fixed second)
        for _ in range(5 if limit else 0):
            t = time.perf_counter()
            try:
                resp = await admin.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS,
                                                                   {"limit": limit}), 60)
                size = len(resp.body or b"")
            except BrokerError as exc:      # (before the cap: a frame past 16 MB, the connection closed)
                size = f"unreadable: {type(exc).__name__}"
                admin = await open_connection(host, int(port))
            answers.append((round((time.perf_counter() - t) * 1000, 1), size))
        stop.set()
        await task
        print(f"n={n} limit={limit}: answers (ms, body bytes) {answers}; worst probe SEND meanwhile "
              f"{[round(x * 1000, 1) for x in sorted(lat)[-3:]]} ms of {len(lat)}", flush=True)
        fig[f"limit_{limit}"] = {"answers": answers, "probe_worst_ms": round(max(lat) * 1000, 1), "probe_n": len(lat)}
    admin.close()
    await probe.shutdown()
    await p.shutdown()
    b.stop()
    shutil.rmtree(d)
    fig["ratio"] = round(fig["limit_1000"]["probe_worst_ms"] / fig["limit_None"]["probe_worst_ms"], 3) \
        if fig["limit_None"]["probe_worst_ms"] else None
    print(json.dumps(fig), flush=True)


asyncio.run(main(int(sys.argv[1])))
