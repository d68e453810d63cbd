"""DELETE_TOPIC_IN_BROKER in a loop against real brokers: this tree and a baseline checkout, in the same run.

    .venv/bin/python bench/bench_topic_deletes.py --baseline /work/main [--seconds 20] [--offsets 100000] [--lanes 16]

A broker started on a consumerOffset.json of --offsets offsets; one client (127.0.0.1) runs --lanes loops of
UPDATE_AND_CREATE_TOPIC, a oneway UPDATE_CONSUMER_OFFSET on it, then DELETE_TOPIC_IN_BROKER (whose SUCCESS waits
for the offsets table on disk) for --seconds: the offsets table's saves a second (the file's inode changes, polled
every 5 ms), MB the broker wrote a second (/proc write_bytes), and the deletes answered.

Prints a line per side, then as the LAST line one JSON object with both sides' figures and "ratio" = this tree /
baseline of the saves a second. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from protocol.codes import RequestCode as R, ResponseCode as C  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from tests.support.broker_process import BrokerProcess  # noqa: E402
from tests.support.raw_client import RawClient  # noqa: E402

_OPAQUES = itertools.count(1 << 24)


def _written(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes")).split()[1])


async def loop_deletes(repo: Path, seconds: float, offsets: int, lanes: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "store" / "config"
        config.mkdir(parents=True)
        (config / "consumerOffset.json").write_text(json.dumps(
            {f"Big{i // 100}@CG_big{i % 100}": {"0": 0} for i in range(offsets)}))
        b = BrokerProcess(Path(d) / "store", repo=repo).start(timeout=120)
        try:
            client = await RawClient.open(b.broker, "127.0.0.1")
            path = config / "consumerOffset.json"
            stop = time.monotonic() + seconds
            deleted = 0

            async def lane(n: int):
                nonlocal deleted
                i = 0
                while time.monotonic() < stop:
                    i += 1
                    topic = f"Gone{n}_{i}"
                    [r] = await client.call(RemotingCommand.request(R.UPDATE_AND_CREATE_TOPIC, {
                        "topic": topic, "readQueueNums": "1", "writeQueueNums": "1", "perm": "6"},
                        opaque=next(_OPAQUES)), 120)
                    assert r.code == C.SUCCESS, r.remark
                    client.write(RemotingCommand.request(R.UPDATE_CONSUMER_OFFSET, {
                        "consumerGroup": "CG_gone", "topic": topic, "queueId": "0", "commitOffset": "3"},
                        oneway=True, opaque=next(_OPAQUES)).encode())
                    [r] = await client.call(RemotingCommand.request(R.DELETE_TOPIC_IN_BROKER, {"topic": topic},
                                                                    opaque=next(_OPAQUES)), 120)
                    assert r.code == C.SUCCESS, r.remark
                    deleted += 1

            saves, inode = 0, os.stat(path).st_ino
            written0, t0 = _written(b.proc.pid), time.monotonic()
            tasks = [asyncio.ensure_future(lane(n)) for n in range(lanes)]
            while time.monotonic() < stop:
                await asyncio.sleep(0.005)
                now = os.stat(path).st_ino
                if now != inode:
                    saves, inode = saves + 1, now
            elapsed = time.monotonic() - t0
            written = _written(b.proc.pid) - written0
            await asyncio.gather(*tasks)
            client.close()
        finally:
            b.kill()
    return {"saves_per_s": round(saves / elapsed, 2), "mb_written_per_s": round(written / elapsed / 1e6, 2),
            "deletes_answered": deleted}


async def main(args) -> None:
    out = {}
    for name, repo in {"baseline": Path(args.baseline), "ours": REPO}.items():
        out[name] = await loop_deletes(repo, args.seconds, args.offsets, args.lanes)
        print(name, out[name], flush=True)
    out["ratio"] = round(out["ours"]["saves_per_s"] / out["baseline"]["saves_per_s"], 4)
    print(json.dumps(out))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", required=True)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--offsets", type=int, default=100_000)
    p.add_argument("--lanes", type=int, default=16)
    asyncio.run(main(p.parse_args()))
