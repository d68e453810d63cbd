"""A broker whose config writes hang (a stopped NFS, a stuck FUSE): the hang is real, as in
test_hung_catalogue_stop.py -- the table's .tmp copy is a FIFO no one reads, so the save's open() blocks for ever."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import urllib.request

import pytest

from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import request

pytestmark = pytest.mark.asyncio


async def _gauge(broker, name: str) -> float | None:
    def scrape() -> str:
        with urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5) as page:
            return page.read().decode()
    lines = [x for x in (await asyncio.to_thread(scrape)).splitlines() if x.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else None


@bounded(150)
async def test_a_hung_offsets_save_is_said_answered_and_the_stop_still_ends(tmp_path):
    """The offsets save hung with nothing said (no log, no gauge), an admin's move (a commit by no consumer of the
    group, saved before its reply) was never answered, and the stop's last save ran ON the loop: blocked behind
    the same write, the process never ended after SIGTERM (then a supervisor's SIGKILL). Now past the bound (30 s)
    the gauge and an ERROR say it, the move is answered SYSTEM_ERROR "not saved" (the next at once), and the stop
    gives its last save up after the bound, with an ERROR, and ends."""
    broker = BrokerProcess(tmp_path / "store", "--flush-consumer-offset-interval-ms", "200").start()
    fifo = tmp_path / "store" / "config" / "consumerOffset.json.tmp"
    move = {"consumerGroup": "CG_hung_offsets", "topic": "TBW102", "queueId": "0", "commitOffset": "0"}
    try:
        os.mkfifo(fifo)
        first = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, move, timeout=60)
        assert first.code == C.SYSTEM_ERROR and "not saved" in first.remark, (first.code, first.remark)
        assert "has not ended in 30 s" in first.remark, first.remark
        assert await _gauge(broker, "txmq_consumer_offsets_write_hung") == 1, broker.log()
        assert "consumer offsets: a write has not ended in 30 s" in broker.log(), broker.log()
        again = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, {**move, "commitOffset": "1"}, timeout=5)
        assert again.code == C.SYSTEM_ERROR and "not saved" in again.remark, (again.code, again.remark)
        broker.proc.send_signal(signal.SIGTERM)
        try:
            code = broker.proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the broker did not end within 60 s of SIGTERM behind a hung offsets save\n{broker.log()}")
        assert code == 0, broker.log()
        assert "consumer offsets not persisted at close: a write has not ended" in broker.log(), broker.log()
    finally:
        with contextlib.suppress(OSError):      # a reader lets a writer still blocked in open() go on
            fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            os.close(fd)
        broker.kill()


@bounded(90)
async def test_sigterm_behind_a_hung_subscription_groups_write_ends_the_process(tmp_path):
    """A subscriptionGroup.json write (asyncio.to_thread: the loop's default executor) that hangs: the broker
    logged "stopped" and never ended, the loop's close joining the stuck ThreadPoolExecutor worker (then the
    interpreter's exit would have). The default executor's threads are daemons joined at most 10 s: the process
    ends, saying which thread it left."""
    broker = BrokerProcess(tmp_path / "store").start()
    fifo = tmp_path / "store" / "config" / "subscriptionGroup.json.tmp"
    conn = None
    try:
        os.mkfifo(fifo)
        conn = await open_connection("127.0.0.1", broker.broker_port)
        update = conn.start_request(RemotingCommand.request(R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {}, json.dumps(
            {"groupName": "CG_hung_groups", "consumeEnable": True}).encode()), 60)
        update.add_done_callback(lambda f: f.cancelled() or f.exception())     # (cut by the stop: not asserted)
        for _ in range(200):            # its save is under way (and hangs) once the update is logged
            if "subscription group CG_hung_groups updated" in broker.log():
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the group update never came\n{broker.log()}")
        broker.proc.send_signal(signal.SIGTERM)
        try:
            code = broker.proc.wait(45)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the broker did not end within 45 s of SIGTERM behind a hung subscription groups "
                        f"write\n{broker.log()}")
        assert code == 0, broker.log()
        assert re.search(r"1 thread\(s\) still blocked 10 s after the stop \(txmq-io-\d+", broker.log()), broker.log()
    finally:
        if conn is not None:
            conn.close()
        with contextlib.suppress(OSError):      # a reader lets a writer still blocked in open() go on
            fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            os.close(fd)
        broker.kill()
