"""Cut the commit log anywhere in the tail of a mixed transactional workload; recovery stays consistent.

A real broker stores rounds of: a plain send, a committed transaction (half, then the real
message and its op record in ONE batch), a rolled-back one (half, op), and two answered
UNKNOWN (half only). Then, for every record boundary and the middle of every record in the
log's tail, a copy of the store has its commit log zero-filled from that point to the end (a
write torn by a crash; the checkpoint goes too, as the checkpoint never passes what a crash
can tear) and a broker starts on it and settles what is undecided through check-back. Each
time:

* right after start-up, no delivered message belongs to a transaction still pending;
* after check-back, no transaction is delivered twice and no rolled-back one at all;
* everything whose record lies wholly before the cut is still there (sends and commits).
"""
from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess

import pytest

from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import BLANK_MAGIC, MESSAGE_MAGIC, Prop, decode_record
from tests.fault.test_disk_full import _bodies
from tests.fault.test_transactions_kill import Ledger, _pending
from tests.support.broker_process import BrokerProcess

HALF_TOPIC, OP_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC"

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

SEG = 1 << 20
ROUNDS = 6
TAIL = 9                # records at the end of the log whose boundaries and middles are cut
BASE_FLAGS = ("--segment-size", str(SEG), "--max-message-size", "65536", "--metrics-snapshot-interval-s", "0")
# Nothing is checked while the workload runs; after a cut, checks come at once.
WORK_FLAGS = (*BASE_FLAGS, "--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "60000")
SETTLE_FLAGS = (*BASE_FLAGS, "--transaction-check-interval-ms", "100", "--transaction-timeout-ms", "0")
ROUND = [("send", None), ("tx", S.COMMIT_MESSAGE), ("tx", S.ROLLBACK_MESSAGE), ("tx", "unknown-commit"),
         ("tx", "unknown-rollback")]


def _records(store) -> list[tuple[int, int, str, bytes]]:
    """(offset, size, kind, body) of every record in the commit log, in log order."""
    out = []
    folder = store / "commitlog"
    for name in sorted(os.listdir(folder)):
        data = (folder / name).read_bytes()
        pos = 0
        while pos + 8 <= len(data):
            size, magic = struct.unpack_from(">ii", data, pos)
            if magic != MESSAGE_MAGIC:
                assert magic in (0, BLANK_MAGIC)
                break
            msg, _ = decode_record(data, pos)
            kind = {0: "msg", 4: "prepared", 8: "commit", 12: "rollback"}[msg.sys_flag & 0xC]
            if msg.topic == HALF_TOPIC:
                kind = "half"
            elif msg.topic == OP_TOPIC:
                kind = "op"
            out.append((int(name) + pos, size, f"{kind}:{msg.topic}", bytes(msg.body)))
            pos += size
    return out


def _cut(store, at: int) -> None:
    """Zero the commit log from byte ``at`` on, as a crash tearing everything after it would."""
    for name in sorted(os.listdir(store / "commitlog")):
        start = int(name)
        if start + SEG <= at:
            continue
        with open(store / "commitlog" / name, "r+b") as f:
            lo = max(0, at - start)
            f.seek(lo)
            f.write(bytes(SEG - lo))
    os.unlink(store / "checkpoint")


async def _pending_keys(addr: str) -> set[str]:
    host, _, port = addr.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        resp = await conn.request(RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 10000}), 5)
        return {row["uniq_key"] for row in json.loads(resp.body_bytes())["pending"]}
    finally:
        conn.close()


async def _delivered_with_keys(namesrv: str, topic: str) -> list[tuple[bytes, str]]:
    from consumer import PullConsumer
    consumer = PullConsumer(namesrv, "CG_cut")
    out = []
    for mq in await consumer.fetch_queues(topic):
        offset = 0
        while True:
            res = await consumer.pull(mq, offset, max_nums=64)
            out += [(bytes(m.body), m.properties.get(Prop.UNIQ_KEY, "")) for m in res.messages]
            if res.next_begin_offset == offset or not res.messages:
                break
            offset = res.next_begin_offset
    await consumer.shutdown()
    return out


async def test_cutting_the_log_tail_anywhere_keeps_transactions_consistent(tmp_path):
    ledger = Ledger(seed=11)
    base = tmp_path / "base"
    broker = BrokerProcess(base, *WORK_FLAGS).start()
    try:
        sender = Producer(broker.namesrv, "PG_cut_send", retries=0)
        tx = TransactionProducer(broker.namesrv, "PG_cut", ledger, retries=0)
        await sender.start()
        await tx.start()
        async with asyncio.timeout(30):
            for r in range(ROUNDS):
                for i, (what, outcome) in enumerate(ROUND):
                    body = f"r{r}-{i}-{outcome}".encode()
                    if what == "send":
                        await sender.send("CutSend", body)
                    else:
                        ledger.plan[body] = outcome
                        await tx.send_in_transaction("CutTx", body)
        await sender.shutdown()
        await tx.shutdown()
    finally:
        assert broker.stop() == 0
    records = _records(base)
    tail = records[-TAIL:]
    kinds = {kind.split(":")[0] for _, _, kind, _ in tail}
    assert {"msg", "half", "commit", "op"} <= kinds, kinds    # the tail really is mixed
    points = sorted({p for off, size, _, _ in tail for p in (off, off + size // 2)})
    outcomes = []
    for n, at in enumerate(points):
        copy = tmp_path / f"cut{n}"
        subprocess.run(["cp", "-a", "--sparse=always", str(base), str(copy)], check=True)
        _cut(copy, at)
        outcomes.append(await _check_cut(copy, at, records, ledger))
    print("crash points:", "; ".join(outcomes))


async def _check_cut(store, at: int, records, ledger: Ledger) -> str:
    broker = BrokerProcess(store, *SETTLE_FLAGS).start()
    try:
        async with asyncio.timeout(30):
            pending = await _pending_keys(broker.broker)
            early = await _delivered_with_keys(broker.namesrv, "CutTx")
            assert not [body for body, key in early if key in pending], f"cut at {at}: delivered while pending"
            tx = TransactionProducer(broker.namesrv, "PG_cut", ledger, retries=0)
            await tx.start()                        # answers the checks from what the local transactions did
            while await _pending(broker.broker):
                await asyncio.sleep(0.05)
            await tx.shutdown()
            delivered = await _bodies(broker.namesrv, "CutTx")
            sends = await _bodies(broker.namesrv, "CutSend")
    finally:
        broker.kill()
    where = next(((kind, at - off) for off, size, kind, _ in records if off <= at < off + size), ("end", 0))
    assert len(delivered) == len(set(delivered)), f"cut at {at} ({where}): a transaction delivered twice"
    rolled_back = {b for b, s in ledger.executed.items() if s is S.ROLLBACK_MESSAGE}
    assert not set(delivered) & rolled_back, f"cut at {at} ({where}): a rolled-back transaction delivered"
    kept = [(kind, body) for off, size, kind, body in records if off + size <= at]
    assert {b for k, b in kept if k.startswith("commit:")} <= set(delivered), f"cut at {at}: a commit lost"
    assert {b for k, b in kept if k.startswith("msg:CutSend")} == set(sends), f"cut at {at}: sends differ"
    return f"{where[0]}+{where[1]}: {len(delivered)} delivered, {len(pending)} were pending"
