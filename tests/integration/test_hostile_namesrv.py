"""Hostile clients of the stand-alone name server: every request answered once, memory bounded, routes kept."""
from __future__ import annotations

import random
import time
import re
import zlib

import pytest

from protocol.codes import FLAG_ONEWAY
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.command import RemotingCommand
from protocol.registration import (DataVersion, RegisterBrokerBody, RegisteredTopic, encode_register_body,
                                   register_header)
from tests.support.cluster_process import NamesrvProcess
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio


@pytest.fixture
def namesrv(tmp_path):
    ns = NamesrvProcess(tmp_path / "namesrv.log").start()
    yield ns
    ns.stop()


def _peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _register(opaque: int, topic: str = "RouteMe", *, body: bytes | None = None, compressed: bool = False,
              **fields) -> RemotingCommand:
    if body is None:
        body = encode_register_body(RegisterBrokerBody({topic: RegisteredTopic(topic, 4, 4, 6)},
                                                       DataVersion(int(time.time() * 1000), 1), []),
                                    compressed=compressed)
    ext = register_header(broker_name="b1", broker_addr="127.0.0.1:10911", cluster_name="C1",
                          ha_server_addr="127.0.0.1:10912", broker_id=0, compressed=compressed, body=body)
    ext.update(fields)
    return RemotingCommand(R.REGISTER_BROKER, opaque=opaque, ext_fields=ext, body=body)


async def _route_code(client: RawClient, opaque: int, topic: str = "RouteMe") -> int:
    """GET_ROUTEINFO_BY_TOPIC's code, asked on the registering connection (a broker whose connection
    closes leaves the routes, as in RocketMQ)."""
    got = await client.call(RemotingCommand(R.GET_ROUTEINFO_BY_TOPIC, opaque=opaque, ext_fields={"topic": topic}), 10)
    assert got and len(got) == 1, got
    return got[0].code


def _deflated_zeros(n: int) -> bytes:
    z = zlib.compressobj(9)
    chunk = b"\0" * (1 << 20)
    return b"".join([z.compress(chunk) for _ in range(n >> 20)] + [z.flush()])


async def test_a_compressed_registration_that_inflates_to_gigabytes_is_refused_within_bounds(namesrv):
    """REGISTER_BROKER's compressed body was inflated whole: 256 KB of deflated zeros from anyone who reaches
    the port took the name server's memory past 512 MB and its loop for seconds (1 MB: 2 GB and 13 s;
    the largest frame, 16 MiB, asks for 16 GB)."""
    client = await RawClient.open(namesrv.addr)
    try:
        before = _peak_rss_kb(namesrv.proc.pid)
        got = await client.call(_register(1, body=_deflated_zeros(256 << 20), compressed=True), 20)
        assert got and len(got) == 1 and got[0].code == C.SYSTEM_ERROR, got
        assert "inflates past" in got[0].remark
        # a real broker registers oneway and never sees that reply: the name server's log must say it
        assert re.search(r"WARNING.*registration of broker .* refused: compressed register body inflates past",
                         namesrv.log()), namesrv.log()[-2000:]
        assert _peak_rss_kb(namesrv.proc.pid) - before < 150_000
        ok = await client.call(_register(2, compressed=True), 10)
        assert ok and ok[0].code == C.SUCCESS, ok
        assert await _route_code(client, 3) == C.SUCCESS
    finally:
        client.close()


_HOSTILE = ["", "abc", "-1", "2147483648", "9223372036854775808", " 1", "1.5", "true", "\x01\x02", "A" * 300,
            "../..", "0", "%RETRY%x", "é"]
_FIELDS = ["brokerName", "brokerAddr", "clusterName", "haServerAddr", "brokerId", "compressed", "bodyCrc32",
           "topic", "acceptStandardJsonOnly"]
_CODES = [R.REGISTER_BROKER, R.UNREGISTER_BROKER, R.QUERY_DATA_VERSION, R.GET_ROUTEINFO_BY_TOPIC,
          R.GET_BROKER_CLUSTER_INFO, R.GET_ALL_TOPIC_LIST_FROM_NAMESERVER, R.GET_KV_CONFIG, 9999]
_BODIES = [b"", b"{}", b"[]", b"null", b"\x78\x9c\x00", b'{"topicConfigSerializeWrapper":{"topicConfigTable":'
           b'{"T":{"readQueueNums":"x"}}}}', b'{"topicConfigSerializeWrapper":[]}', bytes(range(40))]


async def test_fuzzed_requests_each_get_one_reply_and_the_routes_stay(namesrv):
    """Seeded: each hostile request (any code, fields of the wrong type, any body, oneway or not, either
    header serialization) gets exactly one reply with its opaque (none when oneway), and a registered
    broker's route is still served after them."""
    rnd = random.Random(20261126)
    owner = await RawClient.open(namesrv.addr)       # registers, and stays open: its broker stays routed
    ok = await owner.call(_register(1), 10)
    assert ok and ok[0].code == C.SUCCESS
    client = await RawClient.open(namesrv.addr)
    try:
        for opaque in range(100, 400):
            code = rnd.choice(_CODES)
            cmd = _register(opaque) if code == R.REGISTER_BROKER else RemotingCommand(code, opaque=opaque)
            for _ in range(rnd.randint(1, 3)):
                cmd.ext_fields[rnd.choice(_FIELDS)] = rnd.choice(_HOSTILE)
            if rnd.random() < 0.5:
                cmd.body = rnd.choice(_BODIES)
            cmd.flag = FLAG_ONEWAY if rnd.random() < 0.15 else 0
            cmd.serialize_type = 1 if rnd.random() < 0.3 else 0
            if cmd.ext_fields.get("brokerAddr") == "127.0.0.1:10911":
                cmd.ext_fields["brokerAddr"] = "127.0.0.1:1"     # the route under test is not the target
            if client.closed.is_set():
                client = await RawClient.open(namesrv.addr)
            got = await client.call(cmd, 0.3 if cmd.is_oneway else 5)
            if cmd.is_oneway:
                assert not got, (cmd, got)
            else:
                assert got is not None and len(got) == 1, (cmd, got)
                assert got[0].is_response and got[0].serialize_type == cmd.serialize_type
        assert await _route_code(owner, 9) == C.SUCCESS
    finally:
        client.close()
        owner.close()


async def test_one_address_registers_at_most_max_broker_addresses_per_host(tmp_path):
    """Anyone may register any broker address with its topic table, and each stayed while its connection did:
    one connection registering address after address grew the routes (and every scan and close of them)
    without bound. Past max_broker_addresses_per_host a new address is refused SYSTEM_BUSY naming the limit;
    the addresses held re-register as ever, and another host registers its own."""
    ns = NamesrvProcess(tmp_path / "namesrv.log", "--max-broker-addresses-per-host", "3").start()
    hostile = await RawClient.open(ns.addr, "127.0.0.1")
    other = await RawClient.open(ns.addr, "127.0.0.2")
    try:
        codes = []
        for i in range(5):
            [reply] = await hostile.call(_register(10 + i, brokerName=f"b{i}", brokerAddr=f"10.0.0.{i}:10911"), 10)
            codes.append(reply.code)
        assert codes == [C.SUCCESS] * 3 + [C.SYSTEM_BUSY] * 2
        assert "max_broker_addresses_per_host" in reply.remark
        [again] = await hostile.call(_register(20, brokerName="b0", brokerAddr="10.0.0.0:10911"), 10)
        assert again.code == C.SUCCESS
        [theirs] = await other.call(_register(30, "Theirs", brokerName="b9", brokerAddr="10.0.1.9:10911"), 10)
        assert theirs.code == C.SUCCESS
        assert await _route_code(other, 31, "Theirs") == C.SUCCESS
    finally:
        hostile.close()
        other.close()
        ns.stop()


async def test_connections_whose_peer_went_away_silently_are_closed(tmp_path):
    """A peer gone without a FIN kept its connection, and its address's share of max_connections_per_host, for
    good: an address refused for ever after enough such incidents. The name server closes a connection that
    sent nothing for broker_expire_ms (a broker registers every 30 s, a client asks for routes every 30 s)."""
    ns = NamesrvProcess(tmp_path / "namesrv.log", "--max-connections-per-host", "2", "--broker-expire-ms", "400",
                        "--scan-interval-ms", "100").start()
    try:
        await RawClient.open_silent_until_closed(ns.addr, 2, "127.0.0.1")
        back = await RawClient.open(ns.addr, "127.0.0.1")
        try:
            assert await _route_code(back, 1, "Nobody") == C.TOPIC_NOT_EXIST      # answered: let in
        finally:
            back.close()
    finally:
        ns.stop()
    assert "sent nothing for 400 ms" in ns.log()
