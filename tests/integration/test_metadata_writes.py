"""Metadata writes (config tables, the store checkpoint, segments.json): each timed in txmq_metadata_write_seconds,
and one that stalls on a slow or hung disk (the store checkpoint's fsyncs) while clients send must not hold the sends. The hang is real: the checkpoint blocks in an open() of a FIFO no one reads, as on a
stopped NFS, on the flush thread it shares with commit-log flushes (hung_flush_hook/sitecustomize.py)."""
from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.request

import pytest

from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import create_topic, request
from tests.support.hung_writes import gauge_above_0, hung_checkpoint_env, release

pytestmark = pytest.mark.asyncio


async def _send(broker: BrokerProcess, body: bytes, timeout: float = 5.0):
    """SEND_MESSAGE to queue 0 of topic Stalled (created from TBW102 at the first)."""
    return await request(broker.broker, R.SEND_MESSAGE, {
        "producerGroup": "PG_stalled", "topic": "Stalled", "defaultTopic": "TBW102", "defaultTopicQueueNums": "4",
        "queueId": "0", "sysFlag": "0", "bornTimestamp": "0", "flag": "0", "properties": ""}, body, timeout=timeout)


@bounded(120)
async def test_sync_sends_are_answered_while_a_checkpoint_hangs(tmp_path):
    """A checkpoint (fsyncs of new queue directories, the queue list, the checkpoint file) runs on the flush thread,
    and a sync send's flush was queued behind it: on a disk whose fsyncs took 2 s each (strace's fault injection),
    every send was unanswered for the checkpoint's 20 s, a producer's 3 s timeout passing six times; a checkpoint
    that hung held them for ever. The flush goes to the other flush thread, idle: every send is answered at once,
    and the stalled thread is said by txmq_store_io_stalled_seconds."""
    fifo = tmp_path / "checkpoint.fifo"
    broker = BrokerProcess(tmp_path / "store", env=hung_checkpoint_env(fifo)).start()
    try:
        first = await _send(broker, b"before")
        assert first.code == C.SUCCESS, first.remark
        os.mkfifo(fifo)
        second = await _send(broker, b"moves the checkpoint")
        assert second.code == C.SUCCESS, second.remark
        await gauge_above_0(broker, "txmq_store_io_stalled_seconds", "no checkpoint hung on the flush thread")
        codes = [(await _send(broker, b"m%d" % i, timeout=10)).code for i in range(20)]
        assert codes == [C.SUCCESS] * 20, codes
        offsets = await request(broker.broker, R.GET_MAX_OFFSET, {"topic": "Stalled", "queueId": "0"})
        assert offsets.int_field("offset", 0) == 22, broker.log()
    finally:
        release(fifo, broker)


def _write_counts(broker: BrokerProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=5) as page:
        text = page.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^txmq_metadata_write_seconds_count\{file="([^"]+)"\} (\S+)$',
                                                   text, re.M)}


@bounded(60)
async def test_each_metadata_write_is_timed_by_file(tmp_path):
    """Only a write that HUNG was said (past 30 s or a minute): a consumerOffset.json save, a topics.json write or a
    checkpoint taking 4 s each time (fsyncs at 2 s, measured with strace's fault injection: an admin's offset move
    answered in 4.0-4.2 s) showed on no metric, where commit-log flushes had their histogram. Each metadata write
    that ends is observed in txmq_metadata_write_seconds{file}."""
    broker = BrokerProcess(tmp_path / "store").start()
    try:
        await create_topic(broker.broker, "Timed", 2)
        move = await request(broker.broker, R.UPDATE_CONSUMER_OFFSET, {     # no consumer: saved before its answer
            "consumerGroup": "CG_timed", "topic": "Timed", "queueId": "0", "commitOffset": "0"})
        assert move.code == C.SUCCESS, move.remark
        group = await request(broker.broker, R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
                              b'{"groupName":"CG_timed","consumeEnable":true}')
        assert group.code == C.SUCCESS, group.remark
        sent = await _send(broker, b"moves the checkpoint")
        assert sent.code == C.SUCCESS, sent.remark
        wanted = {"consumerOffset.json", "topics.json", "subscriptionGroup.json", "checkpoint"}
        deadline = time.monotonic() + 30
        while True:
            counts = await asyncio.to_thread(_write_counts, broker)
            if wanted <= {file for file, n in counts.items() if n >= 1}:
                break
            assert time.monotonic() < deadline, (counts, broker.log())
            await asyncio.sleep(0.2)    # (the checkpoint is periodic: each second)
    finally:
        broker.kill()
