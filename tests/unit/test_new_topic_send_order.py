"""Sends to a topic made moments ago wait for topics.json to hold it (TopicManager.made_durable), and are stored
in the order they came -- those that came while the write ran, and those read just as it ended.

In-process, over TCP: the catalogue write is held by a threading.Event, and the frame "read just as it ended" is
handed to the broker's connection (data_received, as the transport does) in the loop turn that ends the wait --
the turn where, before the fix, the topic had left the waiting table and the waiting sends had not run yet.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading

import pytest

from broker import topics as topics_module
from broker.config import BrokerConfig
from broker.server import BrokerServer
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.command import RemotingCommand
from tests.support.bounded import bounded
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio

_OPAQUES = itertools.count(1 << 24)


def _send(topic: str, body: bytes) -> RemotingCommand:
    return RemotingCommand(R.SEND_MESSAGE, opaque=next(_OPAQUES), body=body, ext_fields={
        "producerGroup": "PG_order", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "4",
        "queueId": "0", "sysFlag": "0", "bornTimestamp": "0", "flag": "0", "properties": ""})


def _held_saves(monkeypatch, then=None):
    """topics.json writes held until ``release`` is set; ``started`` once the first is under way; ``then(data)``
    after each is written."""
    real_save, started, release = topics_module.save, threading.Event(), threading.Event()

    def save(path, data):
        started.set()
        assert release.wait(10)
        real_save(path, data)
        if then is not None:
            then(data)
    monkeypatch.setattr(topics_module, "save", save)
    return started, release


@contextlib.asynccontextmanager
async def _broker(tmp_path, monkeypatch, connect=True):
    """A broker on ``tmp_path`` and (``connect``) a RawClient to it; ``hold(then=None)`` is ``_held_saves`` whose
    writes are released at the end, before the client is closed and the broker stopped."""
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    await server.start()
    client, releases = None, []

    def hold(then=None):
        started, release = _held_saves(monkeypatch, then)
        releases.append(release)
        return started, release
    try:
        if connect:
            client = await RawClient.open(server.addresses["broker"], "127.0.0.1")
        yield server, client, hold
    finally:
        for release in releases:
            release.set()
        if client is not None:
            client.close()
        await server.stop()


@bounded(30)
async def test_a_send_read_as_the_new_topics_write_ends_is_stored_after_the_sends_that_waited(tmp_path, monkeypatch):
    """One connection pipelines sends to a new topic (an async producer, or an orderly one's queue): the first
    waits for the catalogue write; the next frame is read in the loop turn the write's end is handled in. It was
    stored first -- the topic already out of the waiting table, the waiting sends' callbacks one turn later --
    and took queue offset 0 ahead of a message sent before it."""
    async with _broker(tmp_path, monkeypatch) as (server, client, hold):
        [made] = await client.call(_send("Existing", b"x"), 10)        # the connection is there, its first file too
        assert made.code == C.SUCCESS, made.remark
        started, release = hold()
        [conn] = list(server.connections["broker"])
        tm = server.ctx.topics
        first, second = _send("Ordered", b"first"), _send("Ordered", b"second")
        real_topic_saved = tm._topic_saved

        def saved_then_read(*args):
            real_topic_saved(*args)
            conn.data_received(second.encode())     # the next frame, read in this very turn
        monkeypatch.setattr(tm, "_topic_saved", saved_then_read)

        client.write(first.encode())
        while not started.is_set():             # the catalogue write under way (polled, bounded by the test)
            await asyncio.sleep(0.01)
        release.set()
        [a] = await client.reply(first.opaque, 10)
        [b] = await client.reply(second.opaque, 10)
        assert (a.code, b.code) == (C.SUCCESS, C.SUCCESS), (a.remark, b.remark)
        assert (a.ext_fields["queueOffset"], b.ext_fields["queueOffset"]) == ("0", "1")


@bounded(30)
async def test_a_reply_that_makes_a_topic_is_stored_only_once_topics_json_holds_it(tmp_path, monkeypatch):
    """SEND_REPLY_MESSAGE makes its topic as a send does (_check_topic: TBW102, the queues it asks for), and stores
    its copy. It did not wait for the catalogue write: killed then, the broker restored the topic with the one
    queue holding the copy, where the topic was made with four -- the bug the sends' wait fixed, on this path."""
    from protocol.message import Prop, properties_to_string
    async with _broker(tmp_path, monkeypatch) as (server, client, hold):
        events = []

        def written(data):
            if b"ReplyMade" in data:
                events.append("written")
        _started, release = hold(written)
        store, tm = server.ctx.store, server.ctx.topics
        real_put, real_made_durable = store.put, tm.made_durable
        waits = asyncio.Event()

        def put(req, *a, **kw):
            if req.topic == "ReplyMade":
                events.append("stored")
            return real_put(req, *a, **kw)

        def made_durable(topic):
            gate = real_made_durable(topic)
            if topic == "ReplyMade" and gate is not None:
                waits.set()
            return gate
        monkeypatch.setattr(store, "put", put)
        monkeypatch.setattr(tm, "made_durable", made_durable)

        reply = _send("ReplyMade", b"reply")
        reply.code = R.SEND_REPLY_MESSAGE
        reply.ext_fields["properties"] = properties_to_string({Prop.REPLY_TO_CLIENT: "127.0.0.1@gone",
                                                               "CORRELATION_ID": "c1"})
        replied = asyncio.ensure_future(client.call(reply, 10))
        waiting = asyncio.ensure_future(waits.wait())
        await asyncio.wait({replied, waiting}, return_when=asyncio.FIRST_COMPLETED)    # answered, or it waits
        waiting.cancel()
        release.set()
        [answer] = await replied
        assert answer.code == C.SYSTEM_ERROR    # (no requester to push it to: its copy is stored all the same)
        assert events == ["written", "stored"]


@bounded(30)
async def test_sends_to_a_new_topic_go_ahead_when_topics_json_cannot_be_written(tmp_path, monkeypatch):
    """A full disk: the catalogue write fails (logged, retried); the sends that waited for it are stored and
    answered, in order, rather than held until the disk frees up."""
    import errno
    async with _broker(tmp_path, monkeypatch) as (server, client, _hold):

        def full(path, data):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(topics_module, "save", full)
        sends = [_send("Full", b"%d" % i) for i in range(3)]
        for send in sends:
            client.write(send.encode())
        answers = [(await client.reply(send.opaque, 10))[0] for send in sends]
        assert [a.code for a in answers] == [C.SUCCESS] * 3, [a.remark for a in answers]
        assert [a.ext_fields["queueOffset"] for a in answers] == ["0", "1", "2"]


def _send_back(offset: int, group: str) -> RemotingCommand:
    return RemotingCommand(R.CONSUMER_SEND_MSG_BACK, opaque=next(_OPAQUES), ext_fields={
        "offset": str(offset), "group": group, "delayLevel": "0", "maxReconsumeTimes": "16"})


@bounded(30)
async def test_a_send_back_waiting_for_its_new_retry_topic_holds_no_other_and_goes_ahead_on_a_full_disk(
        tmp_path, monkeypatch):
    """A send-back that made %RETRY%<group> waits for topics.json (made_durable); one of a group whose topic is
    written does not wait behind it, and on a full disk (the write failing) the waiting one is stored and answered
    SUCCESS -- its retry, delivered, makes the topic again should the broker stop before the write -- rather than
    held until the disk frees up."""
    import errno
    async with _broker(tmp_path, monkeypatch) as (server, client, _hold):
        sent = _send("Failing", b"m")
        client.write(sent.encode())
        [reply] = await client.reply(sent.opaque, 10)
        assert reply.code == C.SUCCESS, reply.remark
        offset = int(reply.ext_fields["msgId"][-16:], 16)
        old = _send_back(offset, "CG_written")
        client.write(old.encode())
        assert (await client.reply(old.opaque, 10))[0].code == C.SUCCESS
        await server.ctx.topics.saved()

        started, release = _held_saves(monkeypatch)
        new, old = _send_back(offset, "CG_new"), _send_back(offset, "CG_written")
        client.write(new.encode())
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        client.write(old.encode())
        assert (await client.reply(old.opaque, 10))[0].code == C.SUCCESS    # while CG_new's write is held
        assert new.opaque not in client.replies                             # which CG_new's answer waits for

        def full(path, data):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(topics_module, "save", full)
        release.set()       # the held write goes on (real_save); a second new topic meets the full disk
        assert (await client.reply(new.opaque, 10))[0].code == C.SUCCESS
        full_new = _send_back(offset, "CG_full")
        client.write(full_new.encode())
        [reply] = await client.reply(full_new.opaque, 10)
        assert reply.code == C.SUCCESS, reply.remark
        assert "%RETRY%CG_full" in server.ctx.topics.topics



@bounded(30)
async def test_a_topic_grown_while_its_write_is_under_way_waits_for_the_write_of_its_new_count(tmp_path, monkeypatch):
    """A send-back that grows %RETRY%<group> waits for topics.json to hold the new count (made_durable). One that
    grew it while the write of the topic's making (or an earlier growth) was under way, its snapshot taken, was
    handed that write's gate: answered SUCCESS when it ended, its retry bound for a queue past the count on disk
    until the batched write 100 ms on -- a kill -9 between brought the topic back with 1 queue of 4, the retry
    waiting in SCHEDULE_TOPIC_XXXX for a queue no consumer is given (what the grow's wait was for)."""
    import json

    from broker.topics import TopicConfig
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    await server.start()
    topics, topic = server.ctx.topics, "%RETRY%CG_race"

    def on_disk():
        with open(topics.path, encoding="utf-8") as f:
            return [t["write_queue_nums"] for t in json.load(f)["topics"] if t["name"] == topic]
    try:
        started, release = _held_saves(monkeypatch)
        topics.create(TopicConfig(topic, 1, 1), "127.0.0.1")      # made, as a send-back makes it
        made = topics.made_durable(topic)                           # that send-back's wait: its write begins
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        topics.grow(topic, 4, "127.0.0.1")                          # another send-back grows it meanwhile
        grown = topics.made_durable(topic)                          # and waits for...
        release.set()
        await made
        await grown
        assert on_disk() == [4], "a send-back that grew it would be answered with 1 queue on disk"
    finally:
        await server.stop()


@bounded(30)
async def test_sends_and_send_backs_to_new_topics_go_ahead_while_the_catalogue_write_hangs(tmp_path, monkeypatch):
    """A topics.json write that HANGS (a stopped NFS, a stuck FUSE; not one that fails): every send to a new topic,
    and every send-back that made a retry topic, waited for it with no answer (none within 10 s here), each frame
    held. Past write_wait_s they are stored and answered as when the write fails, in order; sends to topics made
    while it hangs do not wait; ``write_hung`` (the txmq_topics_catalogue_write_hung gauge) says so until it ends."""
    async with _broker(tmp_path, monkeypatch) as (server, client, hold):
        sent = _send("Before", b"m")
        client.write(sent.encode())
        [reply] = await client.reply(sent.opaque, 10)
        assert reply.code == C.SUCCESS, reply.remark
        offset = int(reply.ext_fields["msgId"][-16:], 16)
        await server.ctx.topics.saved()
        tm = server.ctx.topics
        tm.write_wait_s = 0.5
        started, release = hold()
        sends = [_send("Hung", b"%d" % i) for i in range(3)]
        for send in sends:
            client.write(send.encode())
        answers = [(await client.reply(send.opaque, 10))[0] for send in sends]
        assert [a.code for a in answers] == [C.SUCCESS] * 3, [a.remark for a in answers]
        assert [a.ext_fields["queueOffset"] for a in answers] == ["0", "1", "2"]
        assert started.is_set() and not release.is_set() and tm.write_hung
        later, back = _send("MadeWhileHung", b"x"), _send_back(offset, "CG_hung")
        client.write(later.encode())
        client.write(back.encode())
        assert (await client.reply(later.opaque, 10))[0].code == C.SUCCESS
        assert (await client.reply(back.opaque, 10))[0].code == C.SUCCESS
        assert "%RETRY%CG_hung" in tm.topics and tm.write_hung
        release.set()       # the write ends: the next one holds every topic made meanwhile
        async with asyncio.timeout(10):
            await tm._saved_all()     # (``saved`` answers at once while write_hung is still set)
        assert not tm.write_hung
        written = (tmp_path / "config" / "topics.json").read_text()
        assert all(f'"{name}"' in written for name in ("Hung", "MadeWhileHung", "%RETRY%CG_hung"))


@bounded(30)
async def test_a_hung_catalogue_write_is_seen_without_a_send_and_piles_up_no_writes(tmp_path, monkeypatch):
    """The gauge (``write_hung``) was set only by a send that waited for the hung write: topics made by heartbeats
    or retry topics (``ensure``) left it 0 however long the write hung, the alert silent. And each 100 ms batch of
    changes meanwhile queued another write on the config thread, each with its copy of the topic list: unbounded
    for as long as the write hangs. One write waits behind the hung one now, holding every change made meanwhile."""
    async with _broker(tmp_path, monkeypatch, connect=False) as (server, _client, hold):
        tm = server.ctx.topics
        await tm.saved()
        tm.write_wait_s = 0.3
        started, release = hold()
        tm.ensure("MadeByHeartbeat0")
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, started.wait, 5)
        async with asyncio.timeout(5):      # (it was never set: this timed out)
            while not tm.write_hung:
                await asyncio.sleep(0.05)
        for i in range(1, 8):     # a change each batch interval (``_write_batch``, as its timer calls it)
            tm.ensure(f"MadeByHeartbeat{i}")
            tm._write_batch()
        assert tm._pool._work_queue.qsize() <= 1, f"{tm._pool._work_queue.qsize()} writes queued behind the hung one"
        release.set()
        async with asyncio.timeout(10):
            await tm._saved_all()
        assert not tm.write_hung
        written = (tmp_path / "config" / "topics.json").read_text()
        assert all(f'"MadeByHeartbeat{i}"' in written for i in range(8))


@bounded(40)
async def test_a_stop_behind_a_hung_catalogue_write_ends_and_saves_the_rest(tmp_path, monkeypatch):
    """rstock2 let sends go on past a hung topics.json write, but a stop still queued the catalogue's last write
    on the config thread behind it: ``stop`` never returned while the write hung (a stopped NFS: for ever), and the
    parts closed after the topics -- subscription groups, KV config, consumer offsets -- were never saved: offsets
    committed since the last periodic save lost, consumers re-reading them after the restart. The stop gives the
    catalogue up after write_wait_s (topics are restored from the store at start-up) and closes the rest."""
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    await server.start()
    release = threading.Event()
    stopped = False
    try:
        tm = server.ctx.topics
        await tm.saved()
        tm.write_wait_s = 0.3
        started, release = _held_saves(monkeypatch)
        tm.ensure("MadeBeforeStop")
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, started.wait, 5)
        server.ctx.offsets.commit("CG_stop", "T", 0, 42)
        try:
            async with asyncio.timeout(8):      # (it never returned: timed out here)
                await server.stop()
        except TimeoutError:
            pytest.fail("stop did not return while a topics.json write hung")
        stopped = True
        saved = (tmp_path / "config" / "consumerOffset.json").read_text()
        assert "CG_stop" in saved, "consumer offsets not saved at a stop behind a hung catalogue write"
    finally:
        release.set()
        if not stopped:
            await server.stop()
