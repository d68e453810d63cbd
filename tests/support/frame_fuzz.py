"""A seeded mutation fuzzer for a real broker, seeded by real clients' frames (bench/fuzz_broker.py runs it long;
tests/integration/test_hostile_fuzz.py runs it short).

Every broker-bound frame in the shared vectors (ali-ons, rocketmq-client-cpp), and one frame for each request
code the broker serves that they never send, mutated: extFields values (huge, past the header cap, negative, past
64 bits, non-ASCII, NUL, system topics), keys dropped, typed JSON values where text belongs, either header serialization, header bytes
flipped past the opaque and flag, bodies truncated, grown, re-encoded (UTF-16) or flipped, the same opaque twice.
Then stateful clients: HEART_BEAT, PULL (held), UNREGISTER_CLIENT, LOCK_BATCH_MQ, UPDATE_CONSUMER_OFFSET, halves and
END_TRANSACTION (of a half, twice, of none, of another group's) pipelined on one connection, which is then closed,
aborted or left open. Findings: a request left unanswered, SYSTEM_ERROR naming an exception (a handler raised), a
canary SEND refused, the broker's death, a half stored twice.
"""
from __future__ import annotations

import collections
import json
import os
import random
import re
import struct
import time
from pathlib import Path

from broker.processors import broker_table
from protocol.codes import FLAG_ONEWAY
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.command import RemotingCommand
from protocol.frame import MAX_HEADER_SIZE
from protocol.message import decode_offset_msg_id, decode_records
from tests.support.raw_client import RawClient

# As tests/integration/test_vectors_broker.py finds them: $TXMQ_SHARED_DIR, or shared/ beside the checkout.
VECTORS = Path(os.environ.get("TXMQ_SHARED_DIR", Path(__file__).resolve().parents[3] / "shared")) / "vectors"
VALUES = ["", "-1", "-2147483649", "2147483648", "9223372036854775808", "-9223372036854775809", "9" * 400,
          "1e3", " 7", "0x1f", "\x00", "a\x00b", "\u00e9\u4e2d", "\ud7ff", "A" * 70_000, "%RETRY%G", "%DLQ%G",
          "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC", "SCHEDULE_TOPIC_XXXX", "TBW102", "true",
          "false", "null", "*", "a||b", "[]", "{}", "\x01\x02", "../x", "0", "1", "2", "3", "8", "12", "16", "64",
          "H" * (MAX_HEADER_SIZE + 1)]       # a header past the cap: refused unread (MESSAGE_ILLEGAL), read on
JSON_VALUES = [None, True, -1, 2 ** 64, 1.5, [], {}, {"a": [1]}, "x" * 5000]


def load_vectors(folder: Path) -> list[bytes]:
    frames = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["to"] == "broker":
                frames.append(bytes.fromhex(row["frame_hex"]))
    return frames


def seeds(vectors: list[bytes]) -> list[RemotingCommand]:
    out = [RemotingCommand.decode(f) for f in vectors]
    known = {c.code for c in out}
    out += [RemotingCommand(code, ext_fields={"topic": "FuzzT", "consumerGroup": "CG_f", "queueId": "0"})
            for code in broker_table() if code not in known]
    return out


def mutate(cmd: RemotingCommand, rnd: random.Random, opaque: int) -> tuple[bytes, bool]:
    ext = dict(cmd.ext_fields or {})
    body = cmd.body_bytes()
    for _ in range(rnd.randint(1, 4)):
        roll = rnd.random()
        keys = list(ext) or ["topic"]
        if roll < 0.45:
            ext[rnd.choice(keys)] = rnd.choice(VALUES)
        elif roll < 0.55:
            ext.pop(rnd.choice(keys), None)
        elif roll < 0.65:
            body = body[:rnd.randint(0, len(body))]
        elif roll < 0.7:
            body = body + rnd.randbytes(rnd.randint(1, 4096))
        elif roll < 0.75:
            body = body.decode("latin-1").encode("utf-16")
        elif roll < 0.85 and body:
            b = bytearray(body)
            for _ in range(rnd.randint(1, 8)):
                b[rnd.randrange(len(b))] = rnd.randrange(256)
            body = bytes(b)
        else:
            ext[rnd.choice(keys)] = rnd.choice(VALUES)
    flag = FLAG_ONEWAY if rnd.random() < 0.05 else 0
    stype = rnd.choice([0, 1])
    if stype == 0 and rnd.random() < 0.2:         # typed JSON ext values, as ali-ons sends
        raw = dict(ext)
        for k in rnd.sample(list(raw), min(2, len(raw))):
            raw[k] = rnd.choice(JSON_VALUES)
        header = json.dumps({"code": cmd.code, "flag": flag, "language": "JAVA", "opaque": opaque,
                             "version": 409, "extFields": raw}).encode()
        return struct.pack(">ii", 4 + len(header) + len(body), len(header)) + header + body, not flag
    out = RemotingCommand(cmd.code, opaque=opaque, flag=flag, ext_fields=ext, body=body, serialize_type=stype)
    frame = bytearray(out.encode())
    if rnd.random() < 0.15:     # header bytes flipped past the opaque (code, language, version, flag, ext lengths)
        hlen = int.from_bytes(frame[5:8], "big")
        for _ in range(rnd.randint(1, 3)):
            at = 8 + rnd.randrange(max(hlen, 1))
            if stype == 1 and 13 <= at < 21:
                continue                                # keep the opaque and flag: the reply awaited
            frame[at] = rnd.randrange(256)
        if stype == 0:
            return bytes(frame), False                  # a JSON header may lose its opaque: reply not awaited
    return bytes(frame), not flag


async def canary(broker, n: int) -> bool:
    client = await RawClient.open(broker.broker)
    try:
        got = await client.call(RemotingCommand(R.SEND_MESSAGE_V2, opaque=1, body=b"canary", ext_fields={
            "a": "PG_canary", "b": "FuzzCanary", "c": "TBW102", "d": "4", "e": "0", "f": "0",
            "g": str(int(time.time() * 1000)), "h": "0", "i": f"UNIQ_KEY\x01C{n}"}), 10)
        return bool(got) and got[0].code == C.SUCCESS
    finally:
        client.close()


def _heartbeat(group: str, client_id: str, topic: str) -> bytes:
    return json.dumps({"clientID": client_id, "producerDataSet": [{"groupName": "PG_seq"}], "consumerDataSet": [{
        "groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
        "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False, "subscriptionDataSet": [{
            "topic": topic, "subString": "*", "subVersion": 1, "tagsSet": [], "codeSet": [], "classFilterMode": False,
            "expressionType": "TAG"}]}]}).encode()


def sequence_step(rnd: random.Random, opaque: int, halves: list) -> tuple[RemotingCommand, str]:
    """One step of a stateful client: join, pull (held), leave, send a half, END one (or END before any half)."""
    group, topic = rnd.choice(["CG_s1", "CG_s2"]), rnd.choice(["SeqT", "%RETRY%CG_s1"])
    kind = rnd.choice(["heartbeat", "pull", "unregister", "half", "end", "end", "lock", "offset"])
    if kind == "heartbeat":
        return RemotingCommand(R.HEART_BEAT, opaque=opaque, body=_heartbeat(group, f"c{rnd.randrange(3)}", topic)), kind
    if kind == "pull":
        return RemotingCommand(R.PULL_MESSAGE, opaque=opaque, ext_fields={
            "consumerGroup": group, "topic": topic, "queueId": str(rnd.randrange(-1, 5)),
            "queueOffset": rnd.choice(["0", "1", "-1", "100000"]), "maxMsgNums": "32", "sysFlag": rnd.choice("0246"),
            "commitOffset": rnd.choice(["0", "-1", "5"]), "suspendTimeoutMillis": rnd.choice(["0", "100", "15000"]),
            "subscription": "*", "subVersion": "1"}), kind
    if kind == "unregister":
        return RemotingCommand(R.UNREGISTER_CLIENT, opaque=opaque, ext_fields={
            "clientID": f"c{rnd.randrange(3)}", "consumerGroup": group, "producerGroup": "PG_seq"}), kind
    if kind == "lock":
        return RemotingCommand(R.LOCK_BATCH_MQ, opaque=opaque, body=json.dumps({
            "consumerGroup": group, "clientId": f"c{rnd.randrange(3)}",
            "mqSet": [{"topic": "SeqT", "brokerName": "broker-a", "queueId": rnd.randrange(4)}]}).encode()), kind
    if kind == "offset":
        return RemotingCommand(R.UPDATE_CONSUMER_OFFSET, opaque=opaque, ext_fields={
            "consumerGroup": group, "topic": "SeqT", "queueId": str(rnd.randrange(4)),
            "commitOffset": rnd.choice(["0", "1", "-1"])}), kind
    if kind == "half" or not halves:
        props = f"UNIQ_KEY\x01S{rnd.getrandbits(64):016X}\x02TRAN_MSG\x01true\x02PGROUP\x01PG_seq"
        return RemotingCommand(R.SEND_MESSAGE_V2, opaque=opaque, body=b"half", ext_fields={
            "a": "PG_seq", "b": "SeqT", "c": "TBW102", "d": "4", "e": str(rnd.randrange(4)), "f": "4",
            "g": str(int(time.time() * 1000)), "h": "0", "i": props}), "half"
    queue_offset, log_offset = rnd.choice(halves) if rnd.random() < 0.8 else (rnd.randrange(9), rnd.randrange(9999))
    return RemotingCommand(R.END_TRANSACTION, opaque=opaque, ext_fields={
        "producerGroup": rnd.choice(["PG_seq", "PG_seq", "PG_other"]), "tranStateTableOffset": str(queue_offset),
        "commitLogOffset": str(log_offset), "commitOrRollback": rnd.choice(["8", "8", "12", "0"]),
        "fromTransactionCheck": rnd.choice(["false", "true"])}), kind


async def stored_keys(broker, topic: str, queues: int = 4) -> list[str]:
    """The UNIQ_KEY of every message a topic holds, read back from queue 0 on."""
    keys = []
    client = await RawClient.open(broker.broker)
    try:
        for q in range(queues):
            offset = 0
            while True:
                [r] = await client.call(RemotingCommand(R.PULL_MESSAGE, opaque=len(keys) + 1000 * q + offset + 1,
                                                        ext_fields={
                    "consumerGroup": "CG_audit", "topic": topic, "queueId": str(q), "queueOffset": str(offset),
                    "maxMsgNums": "32", "sysFlag": "4", "commitOffset": "0", "suspendTimeoutMillis": "0",
                    "subscription": "*", "subVersion": "0"}), 10)
                if r.code != C.SUCCESS:
                    break
                for msg in decode_records(r.body_bytes()):
                    keys.append(msg.properties.get("UNIQ_KEY"))
                offset = int(r.ext_fields["nextBeginOffset"])
    finally:
        client.close()
    return keys


async def run_sequences(broker, count: int, rnd: random.Random, per_code, findings) -> dict:
    """Stateful clients, several at once: each a few steps on its own connection, pipelined (the same opaque at
    times twice), then closed or left open while the next ones run. No half may be stored twice, however its ENDs
    came (twice, pipelined, from another group, after a rollback)."""
    halves: list[tuple[int, int]] = []
    left_open: list[RawClient] = []
    for n in range(count):
        client = await RawClient.open(broker.broker)
        sent = []
        for k in range(rnd.randint(1, 6)):
            opaque = rnd.choice([k + 1, 1])
            cmd, kind = sequence_step(rnd, opaque, halves)
            per_code[cmd.code] += 1
            client.write(cmd.encode())
            sent.append((opaque, cmd, kind))
        for opaque, cmd, kind in sent:
            got = await client.reply(opaque, 20)
            if got == []:
                findings.append(("no reply in sequence", cmd.code, cmd.ext_fields))
                continue
            for r in got or ():
                if r.code == C.SYSTEM_ERROR and re.match(r"\w+Error\b", r.remark or ""):
                    findings.append(("SYSTEM_ERROR in sequence", cmd.code, r.remark[:200]))
            if not got:
                continue
            if kind == "half" and got[0].code == C.SUCCESS and "msgId" in got[0].ext_fields:
                halves.append((int(got[0].ext_fields["queueOffset"]),
                               decode_offset_msg_id(got[0].ext_fields["msgId"])[2]))
        if rnd.random() < 0.5:
            client.close()
        else:
            left_open.append(client)
    try:
        keys = await stored_keys(broker, "SeqT")
    finally:
        for client in left_open:
            client.close()
    if len(keys) != len(set(keys)):
        findings.append(("a half committed twice", collections.Counter(keys).most_common(3)))
    return {"halves": len(halves), "committed": len(keys)}


async def fuzz(broker, pool: list[RemotingCommand], frames: int, sequences: int, rnd: random.Random) -> dict:
    """Mutated frames one at a time on one connection (a new one when the broker closed it), a canary SEND every
    200; then ``sequences`` stateful clients. {"per_code": Counter, "sequences": {...}, "findings": [...]}: a
    finding is a request left unanswered, a SYSTEM_ERROR naming an exception, a failed canary, the broker's
    death, or a half stored twice."""
    per_code: collections.Counter = collections.Counter()
    findings: list = []
    client = await RawClient.open(broker.broker)
    try:
        for n in range(1, frames + 1):
            seed_cmd = rnd.choice(pool)
            opaque = rnd.choice([n, n, n, 7])          # sometimes the same opaque again
            frame, wants = mutate(seed_cmd, rnd, opaque)
            per_code[seed_cmd.code] += 1
            if client.closed.is_set():
                client = await RawClient.open(broker.broker)
            client.replies.pop(opaque, None)
            if not wants:
                client.write(frame)
            else:
                got = await client.call_raw(frame, opaque, 10)
                if got == []:
                    findings.append(("no reply", seed_cmd.code, frame[:400]))
                elif got and got[0].code == C.SYSTEM_ERROR and re.match(r"\w+Error\b", got[0].remark or ""):
                    findings.append(("SYSTEM_ERROR", seed_cmd.code, got[0].remark[:200], frame[:400]))
            if n % 200 == 0:
                if not await canary(broker, n):
                    findings.append(("canary failed", n))
                if broker.proc.poll() is not None:
                    findings.append(("died", n))
                    return {"per_code": per_code, "sequences": {}, "findings": findings}
    finally:
        client.close()
    seq = await run_sequences(broker, sequences, rnd, per_code, findings)
    if not await canary(broker, frames + 1):
        findings.append(("canary failed", "at the end"))
    return {"per_code": per_code, "sequences": seq, "findings": findings}
