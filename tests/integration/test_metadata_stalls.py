"""Metadata writes that stall on a slow or hung disk (the store checkpoint's fsyncs) while clients send: a stall
there must not hold the sends. The hang is real: the checkpoint blocks in an open() of a FIFO no one reads, as on a
stopped NFS, on the flush thread it shares with commit-log flushes (hung_flush_hook/sitecustomize.py)."""
from __future__ import annotations

import os

import pytest

from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from tests.support.bounded import bounded
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import request
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
