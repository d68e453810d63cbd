"""A broker settles its heap after recovery (broker/heap.py): the undecided transactions it recovered are out of
the full collections' walk before the first request, and every full collection after is timed in /metrics."""
from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from protocol.codes import RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import Prop, SendMessageRequestHeader, properties_to_string
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

GROUP, TOPIC, HALVES = "PG_heap", "T_heap", 300


def _metrics(b) -> str:
    with urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=10) as page:
        return page.read().decode()


async def _send_halves(b, n: int) -> None:
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        h = SendMessageRequestHeader(GROUP, TOPIC, queue_id=0, sys_flag=SysFlag.TRANSACTION_PREPARED,
                                     properties=properties_to_string({Prop.TRAN_MSG: "true", Prop.PGROUP: GROUP}))
        for start in range(0, n, 50):
            sent = await asyncio.gather(*(conn.request(RemotingCommand.request(
                RequestCode.SEND_MESSAGE, h.to_ext_fields(v2=False), b"half %d" % i), 10)
                for i in range(start, min(n, start + 50))))
            assert all(r.code == ResponseCode.SUCCESS for r in sent), [r.remark for r in sent]
    finally:
        conn.close()


@bounded(90)
async def test_the_recovered_undecided_index_is_settled_before_serving(broker_factory):
    b = broker_factory("--transaction-timeout-ms", "3600000")       # no checks: the halves stay undecided
    await _send_halves(b, HALVES)
    assert b.stop() == 0

    b = broker_factory("--transaction-timeout-ms", "3600000")       # the same store: recovery indexes them again
    settled = re.findall(r"heap settled \(start-up\): (\d+) objects frozen .*?, (\d+) table entries", b.log())
    assert len(settled) == 2, b.log()       # one log for both starts: one settle each
    frozen, entries = map(int, settled[-1])
    assert entries >= HALVES and frozen >= HALVES
    page = _metrics(b)
    assert re.search(r"^txmq_heap_settles_total 1\.0$", page, re.M), page
    assert re.search(r"^txmq_gc_full_collection_seconds_count \d", page, re.M), page
