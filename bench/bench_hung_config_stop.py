"""How long SIGTERM takes to end a broker whose whole config directory hangs (a stopped NFS): each table's .tmp a
FIFO no one reads (tests/support/hung_writes), after a topic update, a group update, an offset move and a queue
lock each hit the hang. systemd's TimeoutStopSec and compose's stop_grace_period are 60 s (then SIGKILL).

    python bench/bench_hung_config_stop.py [--baseline REPO]

Prints, per broker (this tree's, then REPO's run the same way), the seconds from SIGTERM to the exit. The last
line is JSON: "ratio" = this tree's stop time / the baseline's (null without one).
"""
import argparse, asyncio, json, os, signal, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from protocol.codes import RequestCode as R  # noqa: E402
from protocol.errors import RequestTimeoutError  # noqa: E402
from tests.support.broker_process import BrokerProcess  # noqa: E402
from tests.support.cluster_process import request  # noqa: E402
from tests.support.hung_writes import unblock  # noqa: E402

TABLES = ("topics.json", "subscriptionGroup.json", "kvConfig.json", "consumerOffset.json", "queueLocks.json",
          "delayOffset.json")


async def stop_seconds(repo) -> float:
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", repo=repo and Path(repo)).start()
        fifos = [Path(d) / "store" / "config" / f"{name}.tmp" for name in TABLES]
        try:
            for fifo in fifos:
                os.mkfifo(fifo)
            try:    # (an older tree never answers it behind the hung write)
                await request(b.broker, R.UPDATE_AND_CREATE_TOPIC, {"topic": "T1", "readQueueNums": "4",
                                                                    "writeQueueNums": "4", "perm": "6"}, timeout=10)
            except RequestTimeoutError:
                pass
            await request(b.broker, R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {}, json.dumps(
                {"groupName": "G1", "consumeEnable": True}).encode(), timeout=40)
            await request(b.broker, R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "G1", "topic": "T1", "queueId": "0",
                                                               "commitOffset": "0"}, timeout=60)
            await request(b.broker, R.LOCK_BATCH_MQ, {}, json.dumps({"consumerGroup": "G1", "clientId": "127.0.0.1@x",
                          "mqSet": [{"topic": "T1", "brokerName": "broker-a", "queueId": 0}]}).encode(), timeout=10)
            started = time.monotonic()
            b.proc.send_signal(signal.SIGTERM)
            b.proc.wait(300)
            return time.monotonic() - started
        finally:
            for fifo in fifos:
                unblock(fifo)
            b.kill()


async def main(args) -> None:
    ours = await stop_seconds(None)
    print(f"this tree: stop {ours:.1f} s")
    base = await stop_seconds(args.baseline) if args.baseline else None
    if base is not None:
        print(f"baseline {args.baseline}: stop {base:.1f} s")
    print(json.dumps({"stop_s": round(ours, 1), "baseline_stop_s": base and round(base, 1),
                      "ratio": base and round(ours / base, 3)}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--baseline")
    asyncio.run(main(p.parse_args()))
