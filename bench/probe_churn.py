"""Months of client churn in minutes against the real broker: what it keeps of what is gone.

    python bench/probe_churn.py [--count 1500] [--phases producers,groups,topics,subgroups]

One broker on a fresh store (a temporary directory, removed at the end), then each phase ``--count`` times:

| phase     | one step                                                                                   |
|-----------|--------------------------------------------------------------------------------------------|
| producers | a producer restarted with a new client id (instance name with a PID): heartbeat, one send  |
| groups    | a consumer group that comes and goes: heartbeat (its %RETRY% topic made), pull, commit     |
| topics    | a topic made (UPDATE_AND_CREATE_TOPIC), sent to, an offset committed on it, then deleted   |
| subgroups | UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, a commit, DELETE_SUBSCRIPTIONGROUP with removeOffset   |
| deletes   | the groups phase's group i deleted without removeOffset (deleteSubGroup without -r)        |

After each phase: VmRSS, the /metrics page's bytes and samples (and which families changed), the milliseconds a
step took on average. At the end: the config files' sizes and the seconds a restart took to its LISTENING line.
What a user expects is that nothing but RocketMQ's own keepings (a gone group's offsets and %RETRY% topic, until
deleteSubGroup) grows; read the families and files that changed against that. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from protocol.codes import RequestCode as R  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402
from protocol.connection import open_connection  # noqa: E402
from protocol.message import SendMessageRequestHeader  # noqa: E402
from tests.support.broker_process import BrokerProcess  # noqa: E402


def _families(broker) -> tuple[int, dict[str, int]]:
    text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=10).read().decode()
    return len(text), {f.name: len(f.samples) for f in text_string_to_metric_families(text)}


def _rss_kb(broker) -> int:
    with open(f"/proc/{broker.proc.pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def _heartbeat(client_id: str, producer: str = "", consumer: str = "", topics=()) -> RemotingCommand:
    body = {"clientID": client_id, "producerDataSet": [{"groupName": producer}] if producer else [],
            "consumerDataSet": [{"groupName": consumer, "consumeType": "CONSUME_PASSIVELY",
                                 "messageModel": "CLUSTERING", "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET",
                                 "subscriptionDataSet": [{"topic": t, "subString": "*", "subVersion": 1}
                                                         for t in topics]}] if consumer else []}
    return RemotingCommand.request(R.HEART_BEAT, body=json.dumps(body).encode())


def _send(topic: str) -> RemotingCommand:
    fields = SendMessageRequestHeader("PG_churn", topic, default_topic_queue_nums=4).to_ext_fields()
    return RemotingCommand.request(R.SEND_MESSAGE_V2, fields, b"x" * 50)


def _create(topic: str) -> RemotingCommand:
    return RemotingCommand.request(R.UPDATE_AND_CREATE_TOPIC, {"topic": topic, "readQueueNums": 4,
                                                               "writeQueueNums": 4, "perm": 6})


def _commit(group: str, topic: str, queue_id: int = 0) -> RemotingCommand:
    return RemotingCommand.request(R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": group, "topic": topic,
                                                              "queueId": queue_id, "commitOffset": 1})


async def _ok(conn, cmd: RemotingCommand):
    resp = await conn.request(cmd, 10.0)
    if resp.code != 0:
        raise RuntimeError(f"request {cmd.code} answered {resp.code}: {resp.remark}")
    return resp


async def _connect(broker):
    host, _, port = broker.broker.rpartition(":")
    return await open_connection(host, int(port))


async def _step(broker, admin, phase: str, i: int) -> None:
    if phase == "producers":
        conn = await _connect(broker)
        await _ok(conn, _heartbeat(f"10.0.0.1@{i}#{i * 7919}", producer="PG_churn"))
        await _ok(conn, _send("Churn"))
        conn.close()
    elif phase == "groups":
        conn, group = await _connect(broker), f"CG_churn{i}"
        await _ok(conn, _heartbeat(f"10.0.0.2@{i}", consumer=group, topics=("Churn", f"%RETRY%{group}")))
        await _ok(conn, RemotingCommand.request(R.PULL_MESSAGE, {
            "consumerGroup": group, "topic": "Churn", "queueId": i % 4, "queueOffset": 0, "maxMsgNums": 1,
            "sysFlag": 0, "commitOffset": 0, "suspendTimeoutMillis": 0, "subVersion": 1}))
        await _ok(conn, _commit(group, "Churn", i % 4))
        conn.close()
    elif phase == "topics":
        topic = f"Tmp_churn{i}"      # made by an admin: auto-made, the 10 a second a client may make pace it
        await _ok(admin, _create(topic))
        await _ok(admin, _send(topic))
        await _ok(admin, _commit("CG_keeper", topic))
        await _ok(admin, RemotingCommand.request(R.DELETE_TOPIC_IN_BROKER, {"topic": topic}))
    elif phase == "subgroups":
        group = f"SG_churn{i}"
        await _ok(admin, RemotingCommand.request(R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=json.dumps({
            "groupName": group, "consumeEnable": True, "retryQueueNums": 1, "retryMaxTimes": 16}).encode()))
        await _ok(admin, _commit(group, "Churn"))
        await _ok(admin, RemotingCommand.request(R.DELETE_SUBSCRIPTIONGROUP, {"groupName": group,
                                                                              "removeOffset": "true"}))
    elif phase == "deletes":      # after groups: its gone groups cleaned up, their offsets kept
        await _ok(admin, RemotingCommand.request(R.DELETE_SUBSCRIPTIONGROUP, {"groupName": f"CG_churn{i}",
                                                                              "removeOffset": "false"}))
    else:
        raise SystemExit(f"unknown phase {phase!r}")


async def run(store: Path, count: int, phases: list[str]) -> dict:
    broker = BrokerProcess(store).start()
    out: dict = {"count": count}
    try:
        admin = await _connect(broker)
        await _ok(admin, _create("Churn"))
        for _ in range(20):
            await _ok(admin, _send("Churn"))
        size, families = _families(broker)
        out["start"] = {"rss_kb": _rss_kb(broker), "metrics_bytes": size, "samples": sum(families.values())}
        print("start", out["start"], flush=True)
        for phase in phases:
            began = time.monotonic()
            for i in range(count):
                await _step(broker, admin, phase, i)
            took = time.monotonic() - began
            size, now = _families(broker)
            changed = {name: [families.get(name, 0), n] for name, n in now.items() if n != families.get(name, 0)}
            families = now
            out[phase] = {"rss_kb": _rss_kb(broker), "metrics_bytes": size, "samples": sum(now.values()),
                          "ms_per_step": round(took / count * 1000, 1), "families_changed": changed}
            print(phase, out[phase], flush=True)
        admin.close()
    finally:
        broker.stop()
    out["config_bytes"] = {p.name: p.stat().st_size for p in sorted((store / "config").iterdir())}
    began = time.monotonic()
    again = BrokerProcess(store).start()
    out["restart_s"] = round(time.monotonic() - began, 2)
    out["restart_rss_kb"] = _rss_kb(again)
    again.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1500)
    parser.add_argument("--phases", default="producers,groups,topics,subgroups")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="probe_churn") as tmp:
        result = asyncio.run(run(Path(tmp) / "store", args.count, args.phases.split(",")))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
