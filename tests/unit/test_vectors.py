"""Every frame that real RocketMQ clients sent (shared/vectors/*.jsonl) decodes, with the fields its scenario implies.

The two clients disagree on ext field types: ali-ons (npm) sends JSON numbers
and booleans, the C++ client (PyPI rocketmq 0.4.4) sends strings with
booleans as "0"/"1". The typed accessors and the send-header parser must
read both the same way.

The shared directory is $TXMQ_SHARED_DIR, else ``shared/`` beside the repo
checkout (CI checks shared/ out next to the repo, i.e. <repo>/../shared).
"""
from __future__ import annotations

import json
import os
import random
from collections import defaultdict
from pathlib import Path

import pytest

from protocol.codes import FLAG_ONEWAY, FLAG_RESPONSE, LanguageCode, RequestCode, SerializeType
from protocol.command import RemotingCommand
from protocol.frame import FrameDecoder
from protocol.message import Prop, SendMessageRequestHeader, string_to_properties

REPO_ROOT = Path(__file__).resolve().parents[2]


def shared_dir() -> Path | None:
    env = os.environ.get("TXMQ_SHARED_DIR")
    path = Path(env) if env else REPO_ROOT.parent / "shared"  # an explicit setting is never second-guessed
    return path if (path / "vectors").is_dir() else None


SHARED = shared_dir()
if SHARED is None:
    pytest.skip("client test vectors not found: set TXMQ_SHARED_DIR or check shared/ out beside the repo "
                f"(looked in {os.environ.get('TXMQ_SHARED_DIR') or REPO_ROOT.parent / 'shared'})",
                allow_module_level=True)

VECTOR_FILES = sorted((SHARED / "vectors").glob("*.jsonl"))


def load_vectors() -> list[dict]:
    rows = []
    for path in VECTOR_FILES:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                row["frame"] = bytes.fromhex(row["frame_hex"])
                row["id"] = f"{path.stem}:{lineno}:{row['scenario']}"
                rows.append(row)
    return rows


VECTORS = load_vectors()
IDS = [row["id"] for row in VECTORS]


def test_both_clients_are_present():
    assert {row["client"] for row in VECTORS} >= {"ali-ons", "rocketmq-0.4.4"}
    assert len(VECTORS) >= 150


# --------------------------------------------------------------- per frame
def check_scenario_fields(cmd: RemotingCommand, row: dict) -> None:
    """What this code from this client must carry, read through the typed accessors."""
    code = cmd.code
    if code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
        assert cmd.str_field("topic")
    elif code in (RequestCode.SEND_MESSAGE, RequestCode.SEND_MESSAGE_V2):
        header = SendMessageRequestHeader.from_command(cmd)
        topic_key, group_key = ("b", "a") if code == RequestCode.SEND_MESSAGE_V2 else ("topic", "producerGroup")
        assert header.topic == cmd.ext_fields[topic_key] == "ProbeTopic"
        assert header.producer_group == cmd.ext_fields[group_key]
        assert header.producer_group.startswith("PID_")
        assert cmd.body and header.born_timestamp > 1_600_000_000_000
        assert header.default_topic == "TBW102" and header.default_topic_queue_nums == 4
        assert header.unit_mode is False and header.batch is False
        props = string_to_properties(header.properties)
        assert props[Prop.TAGS]
        if row["scenario"].startswith("txproducer"):
            assert header.sys_flag & 0x4
            assert props[Prop.TRAN_MSG] == "true" and props[Prop.PGROUP] == header.producer_group
    elif code == RequestCode.PULL_MESSAGE:
        assert cmd.str_field("consumerGroup", required=True).startswith("GID_")
        assert cmd.str_field("topic", required=True)
        for key in ("queueId", "queueOffset", "maxMsgNums", "sysFlag", "commitOffset", "suspendTimeoutMillis",
                    "subVersion"):
            assert isinstance(cmd.int_field(key, required=True), int)
        assert cmd.int_field("maxMsgNums") == 32
        assert cmd.int_field("suspendTimeoutMillis") in (15000, 20000)
    elif code in (RequestCode.QUERY_CONSUMER_OFFSET, RequestCode.UPDATE_CONSUMER_OFFSET):
        assert cmd.str_field("consumerGroup", required=True)
        assert cmd.str_field("topic", required=True)
        assert 0 <= cmd.int_field("queueId", required=True) < 16
        if code == RequestCode.UPDATE_CONSUMER_OFFSET:
            assert cmd.int_field("commitOffset", required=True) >= -1
    elif code == RequestCode.GET_MAX_OFFSET:
        assert cmd.str_field("topic", required=True)
        assert cmd.int_field("queueId", required=True) >= 0
    elif code == RequestCode.GET_CONSUMER_LIST_BY_GROUP:
        assert cmd.str_field("consumerGroup", required=True)
    elif code == RequestCode.HEART_BEAT:
        heartbeat = json.loads(cmd.body)
        assert heartbeat["clientID"]
        groups = [g["groupName"] for g in heartbeat.get("consumerDataSet", []) + heartbeat.get("producerDataSet", [])]
        assert groups
    elif code == RequestCode.UNREGISTER_CLIENT:
        assert cmd.str_field("clientID", required=True)
        assert cmd.str_field("producerGroup") or cmd.str_field("consumerGroup")
    elif code == RequestCode.END_TRANSACTION:
        assert cmd.is_oneway
        assert cmd.str_field("producerGroup", required=True)
        assert cmd.int_field("commitOrRollback", required=True) in (0, 8, 12)
        assert cmd.int_field("commitLogOffset", required=True) >= 0
        assert cmd.int_field("tranStateTableOffset", required=True) >= 0
        assert isinstance(cmd.bool_field("fromTransactionCheck"), bool)
        assert len(cmd.str_field("msgId", required=True)) == 32
    else:
        pytest.fail(f"scenario {row['scenario']} sent code {code}, which these tests do not know")


@pytest.mark.parametrize("row", VECTORS, ids=IDS)
def test_frame_decodes_with_scenario_fields(row):
    frame = row["frame"]
    decoder = FrameDecoder()
    assert decoder.feed(frame) == [frame]
    assert decoder.buffered == 0
    cmd = RemotingCommand.decode(frame)
    assert cmd.serialize_type == SerializeType.JSON
    assert not cmd.is_response
    if row["scenario"] != "hang-silent":  # hang probes come from the capture harness, not the client
        assert cmd.language == {"ali-ons": LanguageCode.JAVA, "rocketmq-0.4.4": LanguageCode.CPP}[row["client"]]
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in cmd.ext_fields.items())
    check_scenario_fields(cmd, row)


@pytest.mark.parametrize("row", VECTORS, ids=IDS)
@pytest.mark.parametrize("serialize_type", [SerializeType.JSON, SerializeType.ROCKETMQ])
def test_reencoded_frame_decodes_to_the_same_fields(row, serialize_type):
    cmd = RemotingCommand.decode(row["frame"])
    cmd.serialize_type = serialize_type
    again = RemotingCommand.decode(cmd.encode())
    assert again.serialize_type == serialize_type
    assert (again.code, again.language, again.version, again.opaque, again.flag, again.ext_fields, again.body) == \
        (cmd.code, cmd.language, cmd.version, cmd.opaque, cmd.flag, cmd.ext_fields, cmd.body)
    # JSON keeps "" remarks; the binary header cannot tell "" from none (Java: null).
    assert (again.remark or None) == (cmd.remark or None)
    check_scenario_fields(again, row)


@pytest.mark.parametrize("row", VECTORS, ids=IDS)
@pytest.mark.parametrize("serialize_type", [SerializeType.JSON, SerializeType.ROCKETMQ])
def test_response_mirrors_request(row, serialize_type):
    request = RemotingCommand.decode(row["frame"])
    request.serialize_type = serialize_type
    request = RemotingCommand.decode(request.encode())
    reply = RemotingCommand.decode(request.response(ext_fields={"offset": 3}).encode())
    assert reply.serialize_type == serialize_type
    assert reply.opaque == request.opaque
    assert reply.flag & FLAG_RESPONSE and not reply.flag & FLAG_ONEWAY
    assert reply.is_response and reply.ext_fields == {"offset": "3"}


# ---------------------------------------------------------------- streams
def connections() -> dict[tuple, bytes]:
    streams: dict[tuple, list[bytes]] = defaultdict(list)
    for row in VECTORS:
        streams[(row["client"], row["scenario"], row["to"], row["conn"])].append(row["frame"])
    return {key: b"".join(frames) for key, frames in streams.items()}


@pytest.mark.parametrize("seed", range(3))
def test_connection_streams_split_anywhere(seed):
    rng = random.Random(seed)
    for key, stream in connections().items():
        decoder = FrameDecoder()
        frames = []
        pos = 0
        while pos < len(stream):
            step = rng.choice((1, 2, 3, 7, 64, 1000))
            frames += decoder.feed(stream[pos:pos + step])
            pos += step
        assert b"".join(frames) == stream, key
        assert decoder.buffered == 0
        opaques = [RemotingCommand.decode(f).opaque for f in frames]
        assert len(set(opaques)) == len(opaques), key  # opaques are unique per connection (not always in order)


# ----------------------------------------------------- client differences
def _first(client: str, code: int, scenario_prefix: str = "") -> RemotingCommand:
    for row in VECTORS:
        if row["client"] == client and row["scenario"].startswith(scenario_prefix):
            cmd = RemotingCommand.decode(row["frame"])
            if cmd.code == code:
                return cmd
    pytest.fail(f"no {client} frame with code {code}")


def test_ali_ons_json_numbers_and_booleans_read_as_typed_fields():
    send = _first("ali-ons", RequestCode.SEND_MESSAGE_V2, "producer")
    raw = json.loads(send.encode_header())["extFields"]
    assert raw["d"] == "4" and raw["k"] == "false"  # stored as text, the form we send on
    assert send.int_field("d") == 4 and send.int_field("e") == 2 and send.int_field("g") > 0
    assert send.bool_field("k") is False and send.bool_field("k", default=True) is False
    header = SendMessageRequestHeader.from_command(send)
    assert (header.queue_id, header.sys_flag, header.flag, header.reconsume_times, header.unit_mode) == \
        (2, 0, 0, 0, False)
    pull = _first("ali-ons", RequestCode.PULL_MESSAGE)
    assert pull.int_field("commitOffset") == -1 and pull.int_field("sysFlag") == 6
    assert pull.int_field("subVersion") == 1795269232509


def test_cpp_client_string_booleans_read_as_typed_fields():
    send = _first("rocketmq-0.4.4", RequestCode.SEND_MESSAGE)
    assert send.ext_fields["batch"] == "0" and send.ext_fields["unitMode"] == "0"
    assert send.bool_field("batch") is False and send.bool_field("unitMode", default=True) is False
    header = SendMessageRequestHeader.from_command(send)
    assert header.batch is False and header.unit_mode is False
    assert header.topic == "ProbeTopic" and header.producer_group == "PID_probe_capture"
    assert header.default_topic_queue_nums == 4  # a JSON number in the C++ client's otherwise-string header
    for key in ("AccessKey", "Signature", "OnsChannel"):
        assert key in send.ext_fields
    assert send.str_field("AccessKey") is None  # "" counts as absent
    flipped = RemotingCommand(send.code, ext_fields={**send.ext_fields, "batch": "1", "unitMode": "1"})
    assert SendMessageRequestHeader.from_command(flipped).batch is True
    assert flipped.bool_field("unitMode") is True


def test_end_transaction_fields_both_ways():
    seen = set()
    for row in VECTORS:
        cmd = RemotingCommand.decode(row["frame"])
        if cmd.code != RequestCode.END_TRANSACTION:
            continue
        seen.add((cmd.int_field("commitOrRollback"), cmd.bool_field("fromTransactionCheck")))
        assert cmd.ext_fields["fromTransactionCheck"] in ("true", "false")
        assert cmd.str_field("transactionId") == cmd.str_field("msgId")
    assert {(8, False), (12, False), (0, False), (8, True)} <= seen


def test_first_opaque_per_client():
    # C++ counts from 0, ali-ons from 1: a response must echo whatever arrived, 0 included.
    firsts = defaultdict(list)
    for row in VECTORS:
        if row["scenario"] != "hang-silent":
            firsts[row["client"]].append(RemotingCommand.decode(row["frame"]).opaque)
    assert min(firsts["rocketmq-0.4.4"]) == 0
    assert min(firsts["ali-ons"]) == 1
