"""A send to a new queue has the queue's file made off the event loop (store.make_queue_file).

Made on the loop, one client's burst of new queues (1,000 topics of 8) held every other connection: each file
waits on the file system's journal, 1-4 ms, and the loop lagged 1.3 s at worst (docs/performance.md, "loop
stalls"). Here a file that takes as long as the test says stands for them: the broker serves another client
while it is being made, and the sends that wait for it are stored in the order they were sent.

In-process (the broker's file creation is held by a threading.Event), over TCP.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import threading

import pytest

from broker.config import BrokerConfig
from broker.server import BrokerServer
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode as C
from protocol.command import RemotingCommand
from tests.support.bounded import bounded
from tests.support.raw_client import RawClient

pytestmark = pytest.mark.asyncio

_OPAQUES = itertools.count(1 << 24)


def _send(topic: str, body: bytes = b"m") -> RemotingCommand:
    return RemotingCommand(R.SEND_MESSAGE, opaque=next(_OPAQUES), body=body, ext_fields={
        "producerGroup": "PG_files", "topic": topic, "defaultTopic": "TBW102", "defaultTopicQueueNums": "1",
        "queueId": "0", "sysFlag": "0", "bornTimestamp": "0", "flag": "0", "properties": ""})


def _heartbeat() -> RemotingCommand:
    return RemotingCommand(R.HEART_BEAT, opaque=next(_OPAQUES), body=json.dumps(
        {"clientID": "other@1", "producerDataSet": [{"groupName": "PG_other"}], "consumerDataSet": []}).encode())


def _held_create(started: threading.Event, release: threading.Event, events: list | None = None):
    """A MappedFile.create for the "Slow" topic's files that says it started, then waits for `release` (10 s at
    most), appending "file made" to `events` when given; other files are made at once."""
    from broker.store import consume_queue
    real = consume_queue.MappedFile.create

    def slow(directory, *a, **kw):
        if os.sep + "Slow" + os.sep in directory + os.sep:
            started.set()
            # on the loop (as before the fix) this held it, every other client's answers with it, until the timeout
            release.wait(10)
            if events is not None:
                events.append("file made")
        return real(directory, *a, **kw)
    return slow


async def _until_set(event: threading.Event) -> None:
    """Until the store's thread sets ``event``, polled, bounded by the test: a thread's wait(10) whose answer went
    unread let a slow machine go on before the file was being made, and the test pass without reaching the bug."""
    while not event.is_set():
        await asyncio.sleep(0.01)


async def _send_while_its_file_is_made(client: RawClient, monkeypatch, slow, started: threading.Event):
    """Has the "Existing" queue's file made (new queues' files are made one after another), then holds new files
    with `slow` and writes a send to "Slow": returns the send once its queue's file is being made."""
    from broker.store import consume_queue
    [made] = await client.call(_send("Existing"), 10)
    assert made.code == C.SUCCESS, made.remark
    monkeypatch.setattr(consume_queue.MappedFile, "create", slow)
    send = _send("Slow")
    client.write(send.encode())
    await _until_set(started)
    return send


@contextlib.asynccontextmanager
async def _broker_and_client(tmp_path, release: threading.Event):
    """A broker on tmp_path and a client of it; at the end the held file is released (so that the stop does not
    wait on it), the client closed and the broker stopped."""
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    await server.start()
    client = None
    try:
        client = await RawClient.open(server.addresses["broker"], "127.0.0.1")
        yield server, client
    finally:
        release.set()
        if client is not None:
            client.close()
        await server.stop()


def _watch_queue_file(monkeypatch, store) -> asyncio.Event:
    """Sets the returned event when the store is asked for a "Slow" queue's file (store.queue_file)."""
    asked = asyncio.Event()
    queue_file = store.queue_file

    def watched(topic, qid):
        if topic == "Slow":
            asked.set()
        return queue_file(topic, qid)

    monkeypatch.setattr(store, "queue_file", watched)
    return asked


@bounded(30)
async def test_another_client_is_served_while_a_new_queues_file_is_made(tmp_path, monkeypatch):
    from broker.store import consume_queue
    started, release, events = threading.Event(), threading.Event(), []
    slow = _held_create(started, release, events)

    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    await server.start()
    burst = other = None
    try:
        addr = server.addresses["broker"]
        burst = await RawClient.open(addr, "127.0.0.1")
        other = await RawClient.open(addr, "127.0.0.2")
        [made] = await other.call(_send("Existing"), 10)     # (new queues' files are made one after another)
        assert made.code == C.SUCCESS, made.remark
        monkeypatch.setattr(consume_queue.MappedFile, "create", slow)      # after the segments are made
        first, second = _send("Slow", b"first"), _send("Slow", b"second")
        burst.write(first.encode())
        burst.write(second.encode())        # pipelined: it waits for the same file, and is stored after the first
        await _until_set(started)
        [beat] = await other.call(_heartbeat(), 10)
        events.append("heartbeat answered")
        [sent] = await other.call(_send("Existing"), 10)
        events.append("other send answered")
        assert beat.code == C.SUCCESS and sent.code == C.SUCCESS, (beat.remark, sent.remark)
        release.set()
        [a] = await burst.reply(first.opaque, 10)
        [b] = await burst.reply(second.opaque, 10)
        assert events == ["heartbeat answered", "other send answered", "file made"]
        assert (a.code, b.code) == (C.SUCCESS, C.SUCCESS), (a.remark, b.remark)
        assert (a.ext_fields["queueOffset"], b.ext_fields["queueOffset"]) == ("0", "1")
        assert server.ctx.store.max_offset("Slow", 0) == 2
    finally:
        release.set()
        for client in (burst, other):
            if client is not None:
                client.close()
        await server.stop()


@bounded(30)
async def test_a_topic_deleted_while_its_new_queues_file_is_made_takes_the_waiting_send_with_it(tmp_path, monkeypatch):
    """A send waits for its new queue's file (made on the queue-file thread) and the topic is deleted meanwhile.
    The delete found no queue to remove, removed the directory the thread was making the file in, and the send
    was then refused (the file's directory gone) -- or, the file made first, the queue was adopted after the
    delete, a live queue of a deleted topic. The delete now waits for the file: the send is stored (accepted
    before the delete), and the delete takes its queue."""
    started, release = threading.Event(), threading.Event()
    slow = _held_create(started, release)

    async with _broker_and_client(tmp_path, release) as (server, client):
        store = server.ctx.store
        send = await _send_while_its_file_is_made(client, monkeypatch, slow, started)
        delete_waits = _watch_queue_file(monkeypatch, store)
        deleting = asyncio.ensure_future(store.delete_topic("Slow"))
        waiting = asyncio.ensure_future(delete_waits.wait())
        await asyncio.wait({deleting, waiting}, return_when=asyncio.FIRST_COMPLETED)   # it ran, or it waits
        waiting.cancel()
        release.set()
        [sent] = await client.reply(send.opaque, 10)
        await deleting
        assert sent.code == C.SUCCESS, sent.remark
        assert ("Slow", 0) not in store._cqs and ("Slow", 0) not in store.queue_index


@bounded(30)
async def test_a_reply_into_a_queue_whose_file_a_send_is_making_waits_for_it_and_is_stored(tmp_path, monkeypatch):
    """A reply (SEND_REPLY_MESSAGE) to a queue whose first file is being made for a send: its copy was not stored,
    prepare_queue saying EAGAIN "try again", counted as a queue-file failure. It waits for the file now."""
    from protocol.message import Prop, properties_to_string
    started, release = threading.Event(), threading.Event()
    slow = _held_create(started, release)

    async with _broker_and_client(tmp_path, release) as (server, client):
        store = server.ctx.store
        send = await _send_while_its_file_is_made(client, monkeypatch, slow, started)
        reply = _send("Slow", b"reply")
        reply.code = R.SEND_REPLY_MESSAGE
        reply.ext_fields["properties"] = properties_to_string({Prop.REPLY_TO_CLIENT: "127.0.0.1@gone",
                                                               "CORRELATION_ID": "c1"})
        reply_waits = _watch_queue_file(monkeypatch, store)
        replied = asyncio.ensure_future(client.call(reply, 10))
        waiting = asyncio.ensure_future(reply_waits.wait())
        await asyncio.wait({replied, waiting}, return_when=asyncio.FIRST_COMPLETED)     # answered, or it waits
        waiting.cancel()
        release.set()
        [sent] = await client.reply(send.opaque, 10)
        [answer] = await replied
        assert sent.code == C.SUCCESS, sent.remark
        assert "not found" in (answer.remark or ""), answer.remark      # nobody to push it to; its copy is kept
        assert store.max_offset("Slow", 0) == 2
