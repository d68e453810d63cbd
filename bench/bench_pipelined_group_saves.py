"""What UPDATE_AND_CREATE_SUBSCRIPTIONGROUPs pipelined on one connection cost a real broker holding many groups:
each update saves the whole subscriptionGroup.json, and saves that each held their own copy of the table at once
grew the broker by a copy an update.

    python bench/bench_pipelined_group_saves.py [--groups 20000] [--updates 100] [--baseline REPO]

The broker starts from a subscriptionGroup.json of GROUPS groups; one client writes UPDATES updates of one group
at once, then waits for every answer. Prints the broker's peak RSS growth over them (VmHWM) and how long the last
answer took. REPO: a checkout whose broker is run the same way after this one's (the baseline: /work/main before
a change). The last line is JSON: the figures and "ratio" = this tree's peak growth / the baseline's.
"""
import argparse, asyncio, itertools, json, os, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from broker.subscriptions import SubscriptionGroups, group_config
from protocol.codes import RequestCode as R, ResponseCode as C
from protocol.command import RemotingCommand
from tests.support.broker_process import BrokerProcess
from tests.support.raw_client import RawClient

_OPAQUES = itertools.count(1 << 24)


def _peak_rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmHWM"))


async def one_broker(repo, args):
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "store" / "config"
        config.mkdir(parents=True)
        groups = SubscriptionGroups(str(config), lambda: 0)
        groups.groups = {f"GID_{i:08d}": group_config(f"GID_{i:08d}") for i in range(args.groups)}
        groups.write(groups.encode())
        with BrokerProcess(config.parent, **({"repo": Path(repo)} if repo else {})) as b:
            client = await RawClient.open(b.broker, "127.0.0.1")
            try:
                before = _peak_rss_mb(b.proc.pid)
                updates = [RemotingCommand(R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, opaque=next(_OPAQUES), body=json.dumps(
                    {"groupName": "GID_00000001", "retryMaxTimes": i % 16}).encode()) for i in range(args.updates)]
                began = time.monotonic()
                client.write(b"".join(cmd.encode() for cmd in updates))
                for cmd in updates:
                    [reply] = await client.reply(cmd.opaque, 300)
                    assert reply.code == C.SUCCESS, reply.remark
                fig = {"peak_rss_growth_mb": _peak_rss_mb(b.proc.pid) - before,
                       "last_answer_s": round(time.monotonic() - began, 2)}
            finally:
                client.close()
    print(f"{repo or 'this tree'}: {fig}", flush=True)
    return fig


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=20_000)
    p.add_argument("--updates", type=int, default=100)
    p.add_argument("--baseline")
    args = p.parse_args()
    ours = await one_broker(None, args)
    base = await one_broker(args.baseline, args) if args.baseline else None
    ratio = round(max(ours["peak_rss_growth_mb"], 1) / max(base["peak_rss_growth_mb"], 1), 3) if base else None
    print(json.dumps({"groups": args.groups, "updates": args.updates, "ours": ours, "baseline": base, "ratio": ratio}))


if __name__ == "__main__":
    asyncio.run(main())
