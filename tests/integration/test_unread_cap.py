"""Clients that send but never read: the broker's memory for their unread responses is capped as a whole.

Each connection may hold up to max_write_buffer (64 MiB) of responses its peer has not read; without a cap
on the total, a hundred such clients held 6.4 GiB and the broker was killed for its memory, down for
everyone. Here several never-reading sockets each pipeline thousands of GET_ALL_TOPIC_CONFIG (70 bytes
asking for about 25 KB) against a broker with a small --max-total-write-buffer, while a normal producer
keeps sending and must get every answer; the broker's peak RSS (VmHWM) must stay within the cap and some
slack, and the connections closed for it are counted.
"""
from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producer import Producer, SendStatus
from protocol.codes import RequestCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.codes import ResponseCode
from protocol.registration import DataVersion, RegisterBrokerBody, RegisteredTopic, encode_register_body, register_header
from tests.support.bounded import bounded
from tests.support.cluster_process import NamesrvProcess
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio

MiB = 1024 * 1024
CAP = 16 * MiB
NEVER_READERS = 8
REQUESTS_EACH = 4000        # ~280 KB of requests; answered in full, ~100 MB of responses each


def _memory_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
        return out


def _metrics(addr: str) -> dict[tuple, float]:
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def _catalogue(conn) -> None:
    """A catalogue whose listing (GET_ALL_TOPIC_CONFIG) is ~25 KB: each 70-byte request asks for that much."""
    for i in range(100):
        reply = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {
            "topic": f"Catalogue_{i:03d}_" + "x" * 100, "readQueueNums": 4, "writeQueueNums": 4,
            "perm": 6}), 5)
        assert reply.code == ResponseCode.SUCCESS, reply.remark


def _flood(host: str, port: int, frame: bytes) -> socket.socket:
    """A socket that sends REQUESTS_EACH requests and never reads: as much as the kernel takes without waiting
    (a broker that stopped reading leaves the rest unsent)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # before connect: a small window
    sock.connect((host, port))
    sock.setblocking(False)
    data = memoryview(frame * REQUESTS_EACH)
    try:
        while data:
            data = data[sock.send(data):]
    except (BlockingIOError, ConnectionError):
        pass
    return sock


@bounded(120)
async def test_unread_responses_of_many_clients_are_capped_broker_wide(broker_factory):
    b = broker_factory("--max-total-write-buffer", str(CAP))
    host, _, port = b.broker.rpartition(":")
    port = int(port)
    conn = await open_connection(host, port)
    try:
        await _catalogue(conn)
        listing = await conn.request(RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG), 5)
        assert len(listing.body_bytes()) > 20_000
    finally:
        conn.close()
    frame = RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG).encode()

    async with Producer(b.namesrv, "PG_reads", retries=0) as producer:
        async def send(i):
            result = await asyncio.wait_for(producer.send("Readers", f"m{i}".encode()), 10)
            assert result.status is SendStatus.SEND_OK
        for i in range(20):                 # routes known, connection warm
            await send(i)
        before = _memory_kib(b.proc.pid)
        socks = [await asyncio.to_thread(_flood, host, port, frame) for _ in range(NEVER_READERS)]
        try:
            # Paced by the broker's progress: each answer takes at least one loop turn, and each turn handles 16
            # of a connection's requests, so 400 answers later every request read has been handled.
            for i in range(400):
                await send(20 + i)
            after = _memory_kib(b.proc.pid)
            seen = await asyncio.to_thread(_metrics, b.metrics)
        finally:
            for s in socks:
                s.close()
    grew_mib = (after["VmHWM"] - before["VmRSS"]) / 1024
    assert grew_mib < CAP / MiB + 48, f"broker RSS peaked {grew_mib:.0f} MiB above where it was ({before}, {after})"
    assert seen[("txmq_unsent_response_bytes", ())] <= CAP
    closed = seen.get(("txmq_unread_closes_total", (("reason", "max_total_write_buffer"),)), 0)
    assert 1 <= closed < NEVER_READERS, seen      # some are closed, not every one: the rest hold the cap
    assert "over the broker's limit (max_total_write_buffer" in b.log()


@bounded(60)
async def test_a_client_that_stopped_reading_is_not_answered_further(broker):
    """Reading stops when a peer leaves 4 MiB unread, but the requests already read went on being answered, 16 a
    turn: one read of 256 KiB holds ~3700 small requests, so a single client grew its unread responses to
    max_write_buffer (64 MiB) before it was dropped. They now wait until it reads."""
    host, _, port = broker.broker.rpartition(":")
    port = int(port)
    conn = await open_connection(host, port)
    try:
        await _catalogue(conn)
        frame = RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG).encode()
        sock = await asyncio.to_thread(_flood, host, port, frame)
        try:
            for _ in range(400):        # progress: each answer is at least one loop turn (16 requests a turn)
                reply = await conn.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {
                    "topic": "Catalogue_000_" + "x" * 100, "queueId": 0}), 5)
                assert reply.code == ResponseCode.SUCCESS
            seen = await asyncio.to_thread(_metrics, broker.metrics)
        finally:
            sock.close()
    finally:
        conn.close()
    assert not [k for k in seen if k[0] == "txmq_unread_closes_total"], seen    # not dropped: held back
    assert 4 * MiB < seen[("txmq_unsent_response_bytes", ())] < 8 * MiB


@bounded(120)
async def test_unread_replies_of_many_clients_are_capped_across_the_name_server(tmp_path):
    """The stand-alone name server had no cap on the whole: each connection could hold 64 MiB of replies its peer
    did not read. Never-reading sockets pipeline GET_ALL_TOPIC_LIST_FROM_NAMESERVER (about 40 KB each here)
    against a small --max-total-write-buffer while a client that reads keeps asking for routes: it is answered
    every time, the name server's memory stays within the cap and some slack, and some of the never-readers,
    not all, are closed, each with a log line."""
    ns = NamesrvProcess(tmp_path / "namesrv.log", "--max-total-write-buffer", str(CAP)).start()
    try:
        host, _, port = ns.addr.rpartition(":")
        port = int(port)
        topics = {f"Catalogue_{i:03d}_" + "x" * 100: RegisteredTopic(f"Catalogue_{i:03d}_" + "x" * 100, 4, 4, 6)
                  for i in range(300)}
        data = encode_register_body(RegisterBrokerBody(topics, DataVersion(1, 1), []))
        registrant = await open_connection(host, port)      # kept open: a broker whose connection closes leaves
        try:
            reply = await registrant.request(RemotingCommand.request(RequestCode.REGISTER_BROKER, register_header(
                broker_name="broker-a", broker_addr="127.0.0.1:1", cluster_name="C", ha_server_addr="",
                broker_id=0, compressed=False, body=data), data), 5)
            assert reply.code == ResponseCode.SUCCESS, reply.remark
            asking = RemotingCommand.request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)
            listing = await registrant.request(asking, 5)
            assert len(listing.body_bytes()) > 30_000
            frame = asking.encode()
            before = _memory_kib(ns.proc.pid)
            socks = [await asyncio.to_thread(_flood, host, port, frame) for _ in range(NEVER_READERS)]
            try:
                # Paced by the name server's progress: each answer takes at least one loop turn, and each turn
                # handles 16 of a connection's requests, so 400 answers later every request read has been handled.
                for _ in range(400):
                    reply = await registrant.request(RemotingCommand.request(
                        RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "Catalogue_000_" + "x" * 100}), 5)
                    assert reply.code == ResponseCode.SUCCESS, reply.remark
                after = _memory_kib(ns.proc.pid)
            finally:
                for sock in socks:
                    sock.close()
        finally:
            registrant.close()
    finally:
        ns.stop()
    grew_mib = (after["VmHWM"] - before["VmRSS"]) / 1024
    assert grew_mib < CAP / MiB + 48, f"name server RSS peaked {grew_mib:.0f} MiB above where it was ({before}, {after})"
    text = (tmp_path / "namesrv.log").read_text(errors="replace")
    closed = text.count("over the name server's limit (max_total_write_buffer")
    assert 1 <= closed < NEVER_READERS, text[-3000:]


@bounded(60)
async def test_frames_received_in_part_are_capped_broker_wide(broker_factory):
    """A frame may declare up to 16 MiB and arrive as slowly as its sender likes: forty connections each holding
    15 MiB of a frame never finished kept 600 MB in the broker, with no log line or count, and one address may
    open thousands. With --max-total-read-buffer, the connection whose frame is unfinished longest is closed once
    all together pass it (logged, counted); the others finish their frames and are answered."""
    cap = 8 * MiB
    b = broker_factory("--max-total-read-buffer", str(cap))
    senders = [await RawClient.open(b.broker) for _ in range(3)]
    frames = [RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO, body=b"x" * (4 * MiB)) for _ in senders]
    encoded = [f.encode() for f in frames]
    cut = 3 * MiB                   # three of them are 9 MiB not yet whole: past the cap
    try:
        for sender, frame in zip(senders, encoded):
            sender.write(frame[:cut])
            await sender.writer.drain()
        await asyncio.wait([asyncio.ensure_future(s.closed.wait()) for s in senders],
                           return_when=asyncio.FIRST_COMPLETED, timeout=20)
        closed = [s for s in senders if s.closed.is_set()]
        assert len(closed) == 1, b.log()
        for sender, frame, encoded_frame in zip(senders, frames, encoded):
            if sender not in closed:             # the rest of its frame: answered, nothing of it lost
                sender.write(encoded_frame[cut:])
                replies = await sender.reply(frame.opaque, 20)
                assert replies and replies[0].code == ResponseCode.SUCCESS, replies
        seen = await asyncio.to_thread(_metrics, b.metrics)
    finally:
        for sender in senders:
            sender.close()
    assert seen.get(("txmq_requests_refused_total", (("reason", "max_total_read_buffer"),))) == 1, seen
    assert "over the broker's limit (max_total_read_buffer" in b.log()


@bounded(60)
async def test_a_frame_arriving_whole_is_not_closed_for_frames_others_left_unfinished(broker_factory):
    """Past --max-total-read-buffer the connection holding the most unfinished bytes was closed: connections each
    holding 1 MiB of a frame they never finish (6 MiB together, under the cap) got a producer sending one 4 MiB
    request at full speed closed instead of them, as soon as its frame in progress was the largest: an idle
    holder could keep every large request out. The frames left unfinished longest go first."""
    cap = 6 * MiB
    b = broker_factory("--max-total-read-buffer", str(cap))
    stalled = [await RawClient.open(b.broker) for _ in range(6)]
    sender = await RawClient.open(b.broker)
    try:
        for s in stalled:
            s.write(RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO,
                                            body=b"s" * (4 * MiB)).encode()[:MiB])
            await s.writer.drain()
        small = RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO, opaque=1)
        assert (await sender.call(small, 20))[0].code == ResponseCode.SUCCESS
        big = RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO, body=b"x" * (4 * MiB), opaque=2)
        replies = await sender.call(big, 20)
        assert replies and replies[0].code == ResponseCode.SUCCESS, (replies, b.log()[-3000:])
        seen = await asyncio.to_thread(_metrics, b.metrics)
        closed = seen.get(("txmq_requests_refused_total", (("reason", "max_total_read_buffer"),)))
        assert closed and closed >= 1, seen
        assert not sender.closed.is_set()       # (those closed were stalled ones)
    finally:
        sender.close()
        for s in stalled:
            s.close()
    assert b.log().count("over the broker's limit (max_total_read_buffer") == closed


@bounded(60)
async def test_frames_received_in_part_are_capped_across_the_name_server(tmp_path):
    """The stand-alone name server's --max-total-read-buffer (64 MiB), untested before: the connection whose frame
    is unfinished longest is closed, logged, once all together pass it; the others are answered."""
    ns = NamesrvProcess(tmp_path / "namesrv.log", "--max-total-read-buffer", str(4 * MiB)).start()
    senders = [await RawClient.open(ns.addr) for _ in range(3)]
    frames = [RemotingCommand.request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER, body=b"x" * (2 * MiB),
                                      opaque=n) for n in range(len(senders))]
    encoded = [f.encode() for f in frames]
    cut = 3 * MiB // 2              # three of them are 4.5 MiB not yet whole: past the cap
    try:
        for sender, frame in zip(senders, encoded):
            sender.write(frame[:cut])
            await sender.writer.drain()
        await asyncio.wait_for(senders[0].closed.wait(), 20)      # the first begun
        for sender, frame, whole in zip(senders[1:], frames[1:], encoded[1:]):
            sender.write(whole[cut:])
            replies = await sender.reply(frame.opaque, 20)
            assert replies and replies[0].code == ResponseCode.SUCCESS, (replies, ns.log()[-3000:])
    finally:
        for sender in senders:
            sender.close()
        ns.stop()
    assert ns.log().count("over the name server's limit (max_total_read_buffer=4194304)") == 1, ns.log()[-3000:]


def _read_some(sock: socket.socket) -> int:
    """What a slow reader takes in one go: at most 4 KiB (0 when nothing came)."""
    try:
        return len(sock.recv(4096))
    except BlockingIOError:
        return 0


@bounded(60)
async def test_a_client_that_reads_none_of_its_responses_is_closed_after_the_channel_expiry_and_a_slow_one_kept(
        broker_factory):
    """A peer that stopped reading (a frozen client: SIGSTOP, a hung process or VM) paused the broker's reading of
    it, and a connection whose reading is paused was never quiet: it stayed open for good, 6 MB of answers unread
    in the broker's memory (up to max_write_buffer) and its address's room held, still open 8 s past a 1 s
    channel expiry, nothing said. RocketMQ closes a channel that neither reads nor completes a write for 120 s.
    Now one whose peer read nothing for the expiry is closed (txmq_unread_closes_total{reason=
    "channel_expire_ms"}); one that reads slowly is kept."""
    b = broker_factory("--channel-expire-ms", "1000")
    host, _, port = b.broker.rpartition(":")
    port = int(port)
    conn = await open_connection(host, port)
    try:
        await _catalogue(conn)
    finally:
        conn.close()
    frame = RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG).encode()
    frozen, slow = [await asyncio.to_thread(_flood, host, port, frame) for _ in range(2)]
    reason = ("txmq_unread_closes_total", (("reason", "channel_expire_ms"),))
    try:
        taken, seen = 0, {}
        for _ in range(600):        # 30 s at most; the frozen one goes after the 1 s expiry and a few 0.25 s ticks
            taken += _read_some(slow)
            seen = await asyncio.to_thread(_metrics, b.metrics)
            if seen.get(reason):
                break
            await asyncio.sleep(0.05)
        assert seen.get(reason) == 1, seen
        for _ in range(60):         # three expiries more of reading slowly: it is kept
            taken += _read_some(slow)
            await asyncio.sleep(0.05)
        seen = await asyncio.to_thread(_metrics, b.metrics)
    finally:
        frozen.close()
        slow.close()
    assert seen[reason] == 1 and seen[("txmq_open_connections", (("listener", "broker"),))] == 1, seen
    assert taken > 0
