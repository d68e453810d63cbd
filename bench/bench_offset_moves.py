"""Admin offset moves (answered UPDATE_CONSUMER_OFFSET from no consumer of the group) against real brokers: this
tree and a baseline checkout, in the same run.

    .venv/bin/python bench/bench_offset_moves.py --baseline /work/main [--flood-s 20] [--offsets 100000]
                                                 [--moves 600] [--cap-s 90]

flood: a broker started on a consumerOffset.json of --offsets offsets; one client (127.0.0.1) keeps 64 moves of
made-up groups in flight for --flood-s seconds while another (127.0.0.2) moves an offset one at a time: the
table's saves a second (the file's inode changes, polled every 5 ms) and MB written a second (the broker's
/proc write_bytes), and the other client's waits.
sequential: a fresh broker (a small table), one client moving --moves offsets one answered move at a time (as
resetOffsetByTimeOld or cloneGroupOffset do, one a queue): the total time, or, when --cap-s runs out first, the
moves answered by then and the total projected from the pace of the last 20.

Prints a line per figure, then as the LAST line one JSON object with both sides' figures and "ratio" = this tree /
baseline of the sequential run's total time. Not collected by pytest.
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
_SEND = dict(producerGroup="PG_bench", topic="Offsets", defaultTopic="TBW102", defaultTopicQueueNums="4",
             queueId="0", sysFlag="0", bornTimestamp="0", flag="0", properties="")


def _move(group: str, offset: int = 3) -> RemotingCommand:
    return RemotingCommand(R.UPDATE_CONSUMER_OFFSET, opaque=next(_OPAQUES), ext_fields={
        "consumerGroup": group, "topic": "Offsets", "queueId": "0", "commitOffset": str(offset)})


def _written(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes")).split()[1])


async def _open(broker: BrokerProcess, host: str) -> RawClient:
    client = await RawClient.open(broker.broker, host)
    [reply] = await client.call(RemotingCommand(R.SEND_MESSAGE, opaque=next(_OPAQUES), body=b"m", ext_fields=_SEND), 30)
    assert reply.code == C.SUCCESS, reply.remark
    return client


async def flood(repo: Path, seconds: float, offsets: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "store" / "config"
        config.mkdir(parents=True)
        (config / "consumerOffset.json").write_text(json.dumps(
            {f"Big{i // 100}@CG_big{i % 100}": {"0": 0} for i in range(offsets)}))
        b = BrokerProcess(Path(d) / "store", repo=repo).start(timeout=120)
        try:
            hostile, admin = await _open(b, "127.0.0.1"), await _open(b, "127.0.0.2")
            path = config / "consumerOffset.json"
            stop = time.monotonic() + seconds
            sent = answered = 0

            async def one(lane: int):
                nonlocal sent, answered
                n = 0
                while time.monotonic() < stop:
                    n += 1
                    sent += 1
                    [r] = await hostile.call(_move(f"CG_flood{lane}_{n}"), 120)
                    assert r.code == C.SUCCESS, r.remark
                    answered += 1

            waits = []

            async def other():
                n = 0
                while time.monotonic() < stop:
                    n += 1
                    t0 = time.perf_counter()
                    [r] = await admin.call(_move("CG_admin", n), 120)
                    assert r.code == C.SUCCESS, r.remark
                    waits.append(time.perf_counter() - t0)

            saves, inode = 0, os.stat(path).st_ino
            written0, t0 = _written(b.proc.pid), time.monotonic()
            tasks = [asyncio.ensure_future(one(i)) for i in range(64)] + [asyncio.ensure_future(other())]
            while time.monotonic() < stop:
                await asyncio.sleep(0.005)
                now = os.stat(path).st_ino
                if now != inode:
                    saves, inode = saves + 1, now
            elapsed = time.monotonic() - t0
            written = _written(b.proc.pid) - written0
            await asyncio.gather(*tasks)
            hostile.close()
            admin.close()
        finally:
            b.kill()
    return {"saves_per_s": round(saves / elapsed, 2), "mb_written_per_s": round(written / elapsed / 1e6, 2),
            "flood_moves_answered": answered, "other_moves": len(waits),
            "other_wait_mean_s": round(sum(waits) / len(waits), 2), "other_wait_max_s": round(max(waits), 2)}


async def sequential(repo: Path, moves: int, cap: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        b = BrokerProcess(Path(d) / "store", repo=repo).start()
        try:
            tool = await _open(b, "127.0.0.1")
            t0 = time.monotonic()
            times = []
            for i in range(moves):
                if time.monotonic() - t0 > cap:
                    break
                [r] = await tool.call(_move(f"CG_seq{i}"), 120)
                assert r.code == C.SUCCESS, r.remark
                times.append(time.monotonic() - t0)
            tool.close()
        finally:
            b.kill()
    done = len(times)
    total = times[-1]
    if done < moves:        # the pace of the last 20, for the moves left
        total += (moves - done) * (times[-1] - times[-21]) / 20
    return {"moves_answered": done, "total_s": round(total, 2), "projected": done < moves}


async def main(args) -> None:
    sides = {"baseline": Path(args.baseline), "ours": REPO}
    out = {}
    for name, repo in sides.items():
        out[name] = {"flood": await flood(repo, args.flood_s, args.offsets)}
        print(name, "flood", out[name]["flood"], flush=True)
    for name, repo in sides.items():
        out[name]["sequential"] = await sequential(repo, args.moves, args.cap_s)
        print(name, "sequential", out[name]["sequential"], flush=True)
    out["ratio"] = round(out["ours"]["sequential"]["total_s"] / out["baseline"]["sequential"]["total_s"], 4)
    print(json.dumps(out))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", required=True)
    p.add_argument("--flood-s", type=float, default=20)
    p.add_argument("--offsets", type=int, default=100_000)
    p.add_argument("--moves", type=int, default=600)
    p.add_argument("--cap-s", type=float, default=90)
    asyncio.run(main(p.parse_args()))
