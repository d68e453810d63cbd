"""A stand-alone name server as a child process, and small helpers for tests with several brokers."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.route import TopicRouteData, decode_route

from .broker_process import REPO, BrokerProcess

_LISTENING = re.compile(r"LISTENING namesrv=(\S+)")


class NamesrvProcess(BrokerProcess):
    """``python -m broker namesrv`` on 127.0.0.1, port chosen by the OS; stop/kill/log as a broker's. Its KV
    config is kept beside its log, never in the user's home (a ``--kv-config-path`` flag given wins)."""

    def __init__(self, log_path: Path, *flags: str):
        self.log_path = Path(log_path)
        self.flags = list(flags)
        self.proc: subprocess.Popen | None = None
        self.addr = ""

    def start(self, timeout: float = 30.0) -> "NamesrvProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "broker", "namesrv", "--host", "127.0.0.1",
                                          "--port", "0", "--kv-config-path", str(self.log_path.with_suffix(".kv.json")),
                                          *self.flags], cwd=REPO, stdout=subprocess.PIPE,
                                         stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = self._read_line(timeout)
        m = _LISTENING.search(line)
        if not m:
            self.kill()
            raise RuntimeError(f"name server did not start: {line!r}\n{self.log()}")
        self.addr = m.group(1)
        return self


def cluster_flags(namesrv: str, name: str, period_ms: int = 1000) -> list[str]:
    """Flags that make a BrokerProcess register with ``namesrv`` as ``name``, every ``period_ms``."""
    return ["--namesrv-addr", namesrv, "--broker-name", name, "--register-period-ms", str(period_ms)]


async def request(addr: str, code: int, fields: dict | None = None, body: bytes = b"", *,
                  timeout: float = 5.0) -> RemotingCommand:
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        return await conn.request(RemotingCommand.request(code, fields, body), timeout)
    finally:
        conn.close()


async def route(namesrv: str, topic: str) -> TopicRouteData | None:
    resp = await request(namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
    if resp.code == ResponseCode.TOPIC_NOT_EXIST:
        return None
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    return decode_route(resp.body_bytes())


async def route_brokers(namesrv: str, topic: str) -> set[str]:
    r = await route(namesrv, topic)
    return set() if r is None else {q.broker_name for q in r.queue_datas}


async def wait_for_route(namesrv: str, topic: str, brokers: set[str], timeout: float = 15.0) -> float:
    """Poll the name server until ``topic``'s route names exactly ``brokers``; seconds it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        if await route_brokers(namesrv, topic) == brokers:
            return loop.time() - start
        if loop.time() - start > timeout:
            raise AssertionError(f"route of {topic} is {await route_brokers(namesrv, topic)}, not {brokers}, "
                                 f"after {timeout} s")
        await asyncio.sleep(0.05)


async def create_topic(broker_addr: str, topic: str, queues: int) -> None:
    resp = await request(broker_addr, RequestCode.UPDATE_AND_CREATE_TOPIC, {
        "topic": topic, "readQueueNums": queues, "writeQueueNums": queues, "perm": 6})
    assert resp.code == ResponseCode.SUCCESS, resp.remark


async def stored_count(broker_addr: str, topic: str, queues: int) -> int:
    """Messages ``topic`` holds on one broker: the sum of its queues' max offsets."""
    total = 0
    for qid in range(queues):
        resp = await request(broker_addr, RequestCode.GET_MAX_OFFSET, {"topic": topic, "queueId": qid})
        assert resp.code == ResponseCode.SUCCESS, resp.remark
        total += resp.int_field("offset", 0)
    return total
