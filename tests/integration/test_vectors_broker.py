"""Every frame captured from real third-party clients (../shared/vectors) gets the reply a RocketMQ
broker or name server would give: same opaque, response flag, JSON header (what those clients read),
and a code from the set RocketMQ answers that request with."""
from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path

import pytest

from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.command import RemotingCommand
from protocol.frame import FrameDecoder

pytestmark = pytest.mark.asyncio

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("TXMQ_SHARED_DIR", REPO.parent / "shared"))
VECTORS = sorted((SHARED / "vectors").glob("*.jsonl"))

EXPECTED = {
    R.GET_ROUTEINFO_BY_TOPIC: {C.SUCCESS, C.TOPIC_NOT_EXIST},
    R.SEND_MESSAGE: {C.SUCCESS}, R.SEND_MESSAGE_V2: {C.SUCCESS},
    R.HEART_BEAT: {C.SUCCESS}, R.UNREGISTER_CLIENT: {C.SUCCESS},
    R.GET_CONSUMER_LIST_BY_GROUP: {C.SUCCESS, C.SYSTEM_ERROR},
    R.QUERY_CONSUMER_OFFSET: {C.SUCCESS, C.QUERY_NOT_FOUND},
    R.UPDATE_CONSUMER_OFFSET: {C.SUCCESS, C.TOPIC_NOT_EXIST}, R.GET_MAX_OFFSET: {C.SUCCESS},
    R.PULL_MESSAGE: {C.SUCCESS, C.PULL_NOT_FOUND, C.PULL_RETRY_IMMEDIATELY, C.PULL_OFFSET_MOVED,
                     C.SUBSCRIPTION_NOT_EXIST, C.TOPIC_NOT_EXIST},
}


def _scenarios():
    out = {}
    for path in VECTORS:
        for line in path.read_text().splitlines():
            v = json.loads(line)
            out.setdefault((v["client"], v["scenario"]), []).append(v)
    return out


@pytest.mark.skipif(not VECTORS, reason=f"no vectors under {SHARED}/vectors (set TXMQ_SHARED_DIR)")
async def test_every_vector_frame_gets_a_rocketmq_reply(broker_factory):
    b = broker_factory("--max-suspend-ms", "100")
    replies = 0
    seen_codes = set()
    for (client, scenario), frames in sorted(_scenarios().items()):
        conns = {}
        try:
            for v in frames:
                addr = b.namesrv if v["to"] == "namesrv" else b.broker
                key = (v["to"], v["conn"])
                if key not in conns:
                    host, _, port = addr.rpartition(":")
                    conns[key] = (*await asyncio.open_connection(host, int(port)), FrameDecoder())
                reader, writer, decoder = conns[key]
                frame = bytes.fromhex(v["frame_hex"])
                req = RemotingCommand.decode(frame)
                writer.write(frame)
                if req.is_oneway:
                    continue
                async with asyncio.timeout(10):
                    got = []
                    while not got:      # skip what the broker asks on its own (NOTIFY_CONSUMER_IDS_CHANGED)
                        got = [f for f in decoder.feed(await reader.read(65536))
                               if RemotingCommand.decode(f).is_response]
                assert len(got) == 1
                assert struct.unpack(">I", got[0][4:8])[0] >> 24 == 0, "clients here read JSON headers only"
                reply = RemotingCommand.decode(got[0])
                where = f"{client}/{scenario} code {req.code}"
                assert reply.is_response and reply.opaque == req.opaque, where
                # The stub that captured these gave %RETRY% topics more queues than a broker does (1):
                # a real broker refuses such a queue id with SYSTEM_ERROR, and so do we.
                illegal_queue = reply.code == C.SYSTEM_ERROR and "illegal" in (reply.remark or "")
                assert reply.code in EXPECTED[req.code] or illegal_queue, f"{where}: {reply.code} {reply.remark}"
                if req.code in (R.SEND_MESSAGE, R.SEND_MESSAGE_V2):
                    assert {"msgId", "queueId", "queueOffset", "MSG_REGION", "TRACE_ON"} <= set(reply.ext_fields)
                if req.code == R.PULL_MESSAGE and reply.code in (0, 19, 20, 21):
                    assert {"nextBeginOffset", "minOffset", "maxOffset", "suggestWhichBrokerId"} <= set(reply.ext_fields)
                replies += 1
                seen_codes.add(req.code)
        finally:
            for _, writer, _ in conns.values():
                writer.close()
    assert replies > 100
    assert seen_codes == set(EXPECTED) - set()
