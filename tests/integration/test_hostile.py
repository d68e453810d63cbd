"""Hostile clients: the broker answers what it can, closes what it must, and keeps serving everyone else."""
from __future__ import annotations

import asyncio
import os
import struct

import pytest

from producer import Producer, SendStatus
from protocol.codes import PullSysFlag, RequestCode, ResponseCode
from protocol.command import RemotingCommand

pytestmark = pytest.mark.asyncio


def _hostport(addr):
    host, _, port = addr.rpartition(":")
    return host, int(port)


async def _still_serves(broker):
    async with Producer(broker.namesrv, "PG_alive", retries=0) as producer:
        result = await asyncio.wait_for(producer.send("Alive", b"still here"), 10)
    assert result.status is SendStatus.SEND_OK


async def _closed_by_peer(reader, timeout=10.0) -> bytes:
    """Everything the broker sends until it closes the connection."""
    data = b""
    async with asyncio.timeout(timeout):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def test_random_bytes_close_the_connection(broker):
    reader, writer = await asyncio.open_connection(*_hostport(broker.broker))
    writer.write(os.urandom(4096))
    await _closed_by_peer(reader)
    writer.close()
    await _still_serves(broker)


async def test_frame_claiming_2_gib_is_refused_at_once(broker):
    reader, writer = await asyncio.open_connection(*_hostport(broker.broker))
    writer.write(struct.pack(">i", 0x7FFFFFF0) + b"\x00\x00\x00\x10")
    await _closed_by_peer(reader)
    writer.close()
    await _still_serves(broker)


async def test_malformed_header_with_findable_opaque_gets_an_error_reply(broker):
    reader, writer = await asyncio.open_connection(*_hostport(broker.broker))
    header = b'{"code":10,"opaque":77,"flag":0,"extFields":["not","a","map"]}'
    writer.write(struct.pack(">ii", 4 + len(header), len(header)) + header)
    data = await _closed_by_peer(reader)
    writer.close()
    reply = RemotingCommand.decode(data)
    assert reply.opaque == 77 and reply.is_response and reply.code == ResponseCode.SYSTEM_ERROR
    assert "extFields" in reply.remark


async def test_half_a_frame_then_silence_does_not_block_others(broker):
    _, writer = await asyncio.open_connection(*_hostport(broker.broker))
    frame = RemotingCommand.request(RequestCode.HEART_BEAT, body=b"{}").encode()
    writer.write(frame[: len(frame) // 2])
    await writer.drain()
    await _still_serves(broker)
    writer.close()


async def test_a_thousand_idle_connections(broker):
    writers = []
    try:
        for _ in range(1000):
            _, w = await asyncio.open_connection(*_hostport(broker.broker))
            writers.append(w)
        await _still_serves(broker)
    finally:
        for w in writers:
            w.close()


async def test_a_client_that_never_reads(broker):
    """Pipelined requests whose responses are never read: the broker stops reading, or drops it, and lives."""
    reader, writer = await asyncio.open_connection(*_hostport(broker.broker))
    frame = RemotingCommand.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}).encode()
    async with asyncio.timeout(20):
        for _ in range(200):
            writer.write(frame * 500)
            try:
                await asyncio.wait_for(writer.drain(), 0.2)
            except (asyncio.TimeoutError, ConnectionError):
                break   # the broker stopped reading us: back-pressure works
    await _still_serves(broker)
    writer.transport.abort()


def _parked_pulls(metrics_addr) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families["txmq_parked_pulls"].samples[0].value


async def _parked_becomes(broker, want, within_s):
    """Poll the (once a second) txmq_parked_pulls gauge until it reads ``want``; its last reading."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        seen = await asyncio.to_thread(_parked_pulls, broker.metrics)
        if seen == want or loop.time() > deadline:
            return seen
        await asyncio.sleep(0.2)


async def test_pulls_parked_by_a_closed_connection_are_released(broker):
    """A client that parks pulls and hangs up, again and again, must not leave them held: each connection may
    have max_in_flight requests, but parked pulls outliving their connection escaped that bound (and the
    connection limit), each held for its whole suspend time with nobody to read its answer."""
    async with Producer(broker.namesrv, "PG_park", retries=0) as producer:
        sent = await asyncio.wait_for(producer.send("Parked", b"one"), 10)
    assert sent.status is SendStatus.SEND_OK
    reader, writer = await asyncio.open_connection(*_hostport(broker.broker))
    for _ in range(50):             # each at the queue's end: held up to 20 s
        writer.write(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "CG_park", "topic": "Parked", "queueId": sent.queue.queue_id,
            "queueOffset": sent.queue_offset + 1,
            "maxMsgNums": 32, "sysFlag": PullSysFlag.SUSPEND | PullSysFlag.SUBSCRIPTION, "commitOffset": 0, "suspendTimeoutMillis": 20000,
            "subscription": "*", "subVersion": 0}).encode())
    await writer.drain()
    assert await _parked_becomes(broker, 50, 10) == 50
    writer.transport.abort()
    assert await _parked_becomes(broker, 0, 6) == 0
    await _still_serves(broker)


async def test_offsets_for_queues_that_do_not_exist_are_refused_not_stored(broker):
    """UPDATE_CONSUMER_OFFSET stored whatever it was given: any topic name, any queue id. One client could grow
    the offset table without bound -- in memory, in consumerOffset.json rewritten every 5 s, in the lag it
    computes every second, in what every slave copies -- all answered SUCCESS."""
    from protocol.admin_bodies import decode_consumer_offsets
    from protocol.connection import open_connection

    async with Producer(broker.namesrv, "PG_offsets", retries=0) as producer:
        sent = await asyncio.wait_for(producer.send("Offsets", b"one"), 10)
    conn = await open_connection(*_hostport(broker.broker))
    try:
        async def commit(topic, qid):
            return await conn.request(RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET, {
                "consumerGroup": "CG_offsets", "topic": topic, "queueId": qid, "commitOffset": 1}), 5)
        assert (await commit("Offsets", sent.queue.queue_id)).code == ResponseCode.SUCCESS
        assert (await commit("NoSuchTopic", 0)).code == ResponseCode.TOPIC_NOT_EXIST
        for qid in (4096, -1):
            assert (await commit("Offsets", qid)).code == ResponseCode.SYSTEM_ERROR
        everything = await conn.request(RemotingCommand.request(RequestCode.GET_ALL_CONSUMER_OFFSET), 5)
    finally:
        conn.close()
    stored = {k for k in decode_consumer_offsets(everything.body_bytes()) if k[0] == "CG_offsets"}
    assert stored == {("CG_offsets", "Offsets", sent.queue.queue_id)}


async def test_send_back_cannot_create_topics_past_the_limits(broker):
    """CONSUMER_SEND_MSG_BACK creates %RETRY%<group> / %DLQ%<group> for whatever group it names. It skipped the
    limits every other topic creation obeys (max_topics, max_auto_create_topics_per_s) and the name check: one
    message's offset and a loop over group names filled the catalogue (then every other client's new topic
    was refused) and stored topics whose names the broker itself cannot write."""
    import json

    from protocol.connection import open_connection
    from protocol.message import decode_offset_msg_id

    async with Producer(broker.namesrv, "PG_back", retries=0) as producer:
        sent = await asyncio.wait_for(producer.send("Back", b"one"), 10)
    offset = decode_offset_msg_id(sent.offset_msg_id)[2]
    conn = await open_connection(*_hostport(broker.broker))
    try:
        async def back(group, level):
            return await conn.request(RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
                "offset": offset, "group": group, "delayLevel": level, "originMsgId": sent.msg_id}), 5)
        bad = await back("not a group/name", -1)
        assert bad.code != ResponseCode.SUCCESS
        loop = asyncio.get_running_loop()
        started = loop.time()
        codes = [(await back(f"CG_flood{i}", -1 if i % 2 else 0)).code for i in range(60)]
        elapsed = loop.time() - started
        table = json.loads((await conn.request(RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG), 5))
                           .body_bytes())["topicConfigTable"]
    finally:
        conn.close()
    assert not [t for t in table if "not a group" in t]
    # 10 topics a second, a burst of 10 (max_auto_create_topics_per_s): the rest are refused, loudly
    assert codes.count(ResponseCode.SUCCESS) <= 10 + 10 * elapsed + 1
    assert set(codes) <= {ResponseCode.SUCCESS, ResponseCode.SYSTEM_BUSY}
    flood = [t for t in table if "CG_flood" in t]
    assert len(flood) == codes.count(ResponseCode.SUCCESS)


async def _sent_back(broker, topic: str, group: str, reconsume_times: int, max_topic: str) -> str:
    """Send one message of ``topic`` with ``reconsume_times`` (a raw V1 send), hand it back as failed by ``group``
    and answer the max offset of ``max_topic`` then."""
    from protocol.connection import open_connection
    from protocol.message import decode_offset_msg_id

    conn = await open_connection(*_hostport(broker.broker))
    try:
        async with Producer(broker.namesrv, f"PG_{topic}", retries=0) as producer:      # the topic, the usual way
            await asyncio.wait_for(producer.send(topic, b"first"), 10)
        sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE, {
            "producerGroup": f"PG_{topic}", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": 4,
            "queueId": 0, "sysFlag": 0, "bornTimestamp": 0, "flag": 0, "properties": "",
            "reconsumeTimes": reconsume_times}, topic.encode()), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        offset = decode_offset_msg_id(sent.ext_fields["msgId"])[2]
        back = await conn.request(RemotingCommand.request(RequestCode.CONSUMER_SEND_MSG_BACK, {
            "offset": offset, "group": group, "delayLevel": 0, "originMsgId": "x"}), 5)
        assert back.code == ResponseCode.SUCCESS, back.remark
        got = await conn.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {"topic": max_topic,
                                                                                       "queueId": 0}), 5)
        return got.ext_fields["offset"]
    finally:
        conn.close()


async def test_a_message_sent_with_the_largest_reconsume_count_still_goes_to_the_dlq(broker):
    """A producer may set reconsumeTimes on any message; at 2**31-1 the send-back's +1 no longer fit the record's
    32-bit field: a consumer group failing that message got SYSTEM_ERROR instead of a dead letter (RocketMQ
    stores it), and a stock client's fallback re-sent it with the count wrapped negative, retrying it at once
    for good."""
    assert await _sent_back(broker, "Poison", "CG_victim", 2**31 - 1, "%DLQ%CG_victim") == "1"


async def test_a_heartbeat_cannot_put_unwritable_retry_topics_in_the_catalogue(broker):
    """A consumer group new to the broker gets %RETRY%<group>; its name came straight from the heartbeat body.
    One client could register names of any length and character -- topics the store refuses to write,
    registered with every name server all the same (1024 groups of 15 KB names make a registration body
    over the 16 MiB frame limit, and the broker drops out of every route)."""
    import json

    from protocol.connection import open_connection

    long_name = "G" * 5000

    def heartbeat(*names):
        return json.dumps({"clientID": "hostile@1", "producerDataSet": [], "consumerDataSet": [
            {"groupName": name, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
             "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False, "subscriptionDataSet": []}
            for name in names]}).encode()
    conn = await open_connection(*_hostport(broker.broker))
    try:
        reply = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, body=heartbeat(
            "not a group/name", "CG_fine")), 5)
        assert reply.code == ResponseCode.SUCCESS
        # a group name past 255 characters refuses the whole heartbeat (test_names.py)
        reply = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, body=heartbeat(long_name)), 5)
        assert reply.code != ResponseCode.SUCCESS and "longer than 255" in reply.remark
        table = json.loads((await conn.request(RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG), 5))
                           .body_bytes())["topicConfigTable"]
    finally:
        conn.close()
    assert "%RETRY%CG_fine" in table
    assert not [t for t in table if "not a group" in t or long_name in t]


async def test_a_message_sent_with_a_negative_reconsume_count_is_retried_with_backoff(broker):
    """With reconsumeTimes -5 from its producer, a failed message's backoff level 3 + reconsumeTimes was -2: no
    delay at all, so each failure stored a copy in %RETRY% for immediate redelivery -- a consumer group failing
    it looped as fast as it could, a new record each turn, billions of times before the count reached the DLQ."""
    # waiting in the schedule, not redelivered at once
    assert await _sent_back(broker, "Negative", "CG_negative", -5, "%RETRY%CG_negative") == "0"


async def test_parked_pulls_past_max_in_flight_do_not_stall_the_connection(broker):
    """A push consumer keeps one pull parked per queue it was given, and shares its connection with its
    heartbeats, offset commits, send-backs and its instance's producer. Counted in flight, more than
    max_in_flight (256) parked pulls stopped the broker reading that connection: every other request on it
    waited for a pull's suspend time to end (15 s for Java), past the client's 3 s timeout."""
    from protocol.connection import open_connection

    async with Producer(broker.namesrv, "PG_many", retries=0) as producer:
        sent = await asyncio.wait_for(producer.send("ManyQueues", b"x"), 10)
    conn = await open_connection(*_hostport(broker.broker))
    try:
        pulls = [conn.start_request(RemotingCommand.request(RequestCode.PULL_MESSAGE, {
            "consumerGroup": "CG_many", "topic": "ManyQueues", "queueId": sent.queue.queue_id,
            "queueOffset": sent.queue_offset + 1, "maxMsgNums": 32,
            "sysFlag": PullSysFlag.SUSPEND | PullSysFlag.SUBSCRIPTION, "commitOffset": 0,
            "suspendTimeoutMillis": 15000, "subscription": "*", "subVersion": 0}), 30) for _ in range(300)]
        assert await _parked_becomes(broker, 300, 10) == 300
        reply = await conn.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET, {
            "topic": "ManyQueues", "queueId": sent.queue.queue_id}), 3)
        assert reply.code == ResponseCode.SUCCESS
    finally:
        conn.close()
    await asyncio.gather(*pulls, return_exceptions=True)


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS:"))


async def _woken_in_full(broker, client, sent, opaques) -> None:
    """Store a message after ``sent`` in its queue: the held pulls ``opaques`` are each woken and answered in full."""
    async with Producer(broker.namesrv, "PG_wake", retries=0) as producer:
        await asyncio.wait_for(producer.send(sent.queue.topic, b"second", queue=sent.queue), 10)
    for opaque in opaques:
        [reply] = await client.reply(opaque, 10)
        assert reply.code == ResponseCode.SUCCESS, reply.remark
        assert reply.int_field("nextBeginOffset") == sent.queue_offset + 2


async def test_held_pulls_keep_neither_their_bodies_nor_made_up_fields(broker):
    """A held pull kept its whole request for its suspend time: a body (never read; a frame may carry 16 MiB) and
    a header of made-up fields (20,000 of them decoded to 1.5 MB). 500 held pulls of a 1 MiB body each grew the
    broker by 500 MB on one connection (which may hold max_in_flight * 4), counted by no limit."""
    from tests.support.raw_client import RawClient

    async with Producer(broker.namesrv, "PG_fat", retries=0) as producer:
        sent = await asyncio.wait_for(producer.send("FatPulls", b"first"), 10)
    fields = {"consumerGroup": "CG_fat", "topic": "FatPulls", "queueId": sent.queue.queue_id,
              "queueOffset": sent.queue_offset + 1, "maxMsgNums": 32,
              "sysFlag": PullSysFlag.SUSPEND | PullSysFlag.SUBSCRIPTION, "commitOffset": 0,
              "suspendTimeoutMillis": 30000, "subscription": "*", "subVersion": 0}
    made_up = {format(i, "x"): "" for i in range(20000)}
    before = _rss_mb(broker.proc.pid)
    client = await RawClient.open(broker.broker)
    try:
        for opaque in range(1, 201):
            fat = (dict(fields), b"x" * (1 << 20)) if opaque % 4 else ({**fields, **made_up}, b"")
            client.write(RemotingCommand(RequestCode.PULL_MESSAGE, opaque=opaque, ext_fields=fat[0],
                                         body=fat[1]).encode())
            await client.writer.drain()
        assert await _parked_becomes(broker, 200, 30) == 200
        grown = _rss_mb(broker.proc.pid) - before
        assert grown < 100, f"200 held pulls grew the broker {grown} MB"      # 235 MB: each its whole request
        await _woken_in_full(broker, client, sent, (1, 4))      # a pull of a body, one of made-up fields
    finally:
        client.close()
    await _still_serves(broker)


async def test_pipelined_headers_of_made_up_fields_do_not_hold_other_clients_behind_them(broker):
    """A read's frames were handled 16 at a time, but libuv calls data_received up to 32 times for one readable
    event: one connection pipelining headers of made-up fields (here 21,000 of them, 250 KB: under the 256 KiB a
    header may have, so parsed, 4-30 ms each) held the loop for up to 32 of them an event, and another client's
    request waited behind 33-67 of them. Counted by the broker, not by when replies reach this process: each
    flooding frame (oneway) commits its own number as an offset, and the other client's QUERY_CONSUMER_OFFSET
    answers how many the broker had handled before it. It is written right behind the flood's first 16 frames
    (4 MB, read at once), before the rest: however late this process then runs, the broker cannot have handled
    more than those before the other request was readable. (Counted as flood replies arriving here, the test was
    a measure of this process's scheduling: its 25,000-field headers were past 256 KiB, each refused unread in
    well under a millisecond, and a busy machine counted 71-90 replies sent before the other request was.)"""
    import json

    from protocol.frame import MAX_HEADER_SIZE, encode_frame
    from tests.support.raw_client import RawClient

    async with Producer(broker.namesrv, "PG_flood", retries=0) as producer:
        sent = await asyncio.wait_for(producer.send("Flooded", b"x"), 10)
    queue = {"consumerGroup": "CG_flood", "topic": "Flooded", "queueId": str(sent.queue.queue_id)}
    fields = {**queue, **{format(i, "x"): "" for i in range(21000)}}
    headers = [json.dumps({"code": RequestCode.UPDATE_CONSUMER_OFFSET, "flag": 2, "language": "JAVA",
                           "opaque": opaque, "version": 395, "extFields": {**fields, "commitOffset": str(opaque)}
                           }).encode() for opaque in range(1, 121)]
    assert max(map(len, headers)) <= MAX_HEADER_SIZE        # parsed, not refused unread from its length
    frames = [encode_frame(header) for header in headers]
    ask = RemotingCommand.request(RequestCode.QUERY_CONSUMER_OFFSET, queue, opaque=1_000_000).encode()
    other = await RawClient.open(broker.broker)
    flood = await RawClient.open(broker.broker)
    try:
        flood.write(b"".join(frames[:16]))
        other.write(ask)
        flood.write(b"".join(frames[16:]))
        [reply] = await other.reply(1_000_000, 60)
        assert reply.code in (ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND), reply.remark
        handled_before = int(reply.ext_fields.get("offset", 0))
        assert handled_before < 12, handled_before      # 2 a run; 33-67 with a read loop's 32 reads unbounded
        flood.write(RemotingCommand.request(RequestCode.QUERY_CONSUMER_OFFSET, queue, opaque=121).encode())
        [last] = await flood.reply(121, 60)     # behind every flooding frame: each was parsed and committed
        assert (last.code, last.ext_fields.get("offset")) == (ResponseCode.SUCCESS, "120"), last.remark
    finally:
        other.close()
        flood.close()


async def test_held_pulls_keep_no_subscription_text_nor_padding_they_never_read(broker):
    """A pull without the SUBSCRIPTION flag (a stock push consumer's) is filtered by the subscription its group's
    heartbeat stored: its own subscription and expressionType fields are never read, neither when it is held nor
    when it runs again. A held pull kept them all the same: 400 held pulls each naming 200 KiB of a made-up
    "subscription" grew the broker some 80 MB (a host may hold 20,000 such pulls: 4 GB), past any TAG limit (16
    KiB), as nothing parsed them. So did a number padded with 200 KiB of spaces (read as the number: int() strips
    them), in a field a held pull keeps."""
    import json

    from tests.support.raw_client import RawClient

    async with Producer(broker.namesrv, "PG_stored", retries=0) as producer:
        sent = await asyncio.wait_for(producer.send("StoredSubs", b"first"), 10)
    client = await RawClient.open(broker.broker)
    try:
        body = {"clientID": "127.0.0.1@stored", "producerDataSet": [], "consumerDataSet": [{
            "groupName": "CG_stored", "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
            "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "unitMode": False, "subscriptionDataSet": [{
                "classFilterMode": False, "topic": "StoredSubs", "subString": "*", "tagsSet": [], "codeSet": [],
                "subVersion": 1, "expressionType": "TAG"}]}]}
        client.write(RemotingCommand(RequestCode.HEART_BEAT, opaque=900_000, body=json.dumps(body).encode()).encode())
        [beat] = await client.reply(900_000, 10)
        assert beat.code == ResponseCode.SUCCESS, beat.remark
        fields = {"consumerGroup": "CG_stored", "topic": "StoredSubs", "queueId": sent.queue.queue_id,
                  "queueOffset": sent.queue_offset + 1, "maxMsgNums": 32, "sysFlag": PullSysFlag.SUSPEND,
                  "commitOffset": 0, "suspendTimeoutMillis": 30000, "subVersion": 1}
        before = _rss_mb(broker.proc.pid)
        for opaque in range(2, 402):
            junk = ({"subscription": f"{opaque:x}" + "s" * 200 * 1024, "expressionType": "TAG"} if opaque % 2
                    else {"maxMsgNums": " " * 200 * 1024 + "32", "queueOffset": f"{sent.queue_offset + 1:>{opaque}}"})
            client.write(RemotingCommand(RequestCode.PULL_MESSAGE, opaque=opaque, ext_fields={**fields, **junk}).encode())
            await client.writer.drain()
        assert await _parked_becomes(broker, 400, 30) == 400
        grown = _rss_mb(broker.proc.pid) - before
        assert grown < 20, f"400 held pulls grew the broker {grown} MB"      # 81 MB: each kept its 200 KiB
        await _woken_in_full(broker, client, sent, (2, 401))    # filtered by the stored "*"; padded numbers read
    finally:
        client.close()
    await _still_serves(broker)
