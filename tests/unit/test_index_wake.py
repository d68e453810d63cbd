"""The index thread's deque hand-off must not lose a wake-up (broker/store/index.py on_dispatch / _main; found in review)."""
from __future__ import annotations

import asyncio
import collections
import threading

import pytest

from broker.store import MessageStore, PutRequest, StoreConfig
from broker.store.index import IndexService
from tests.support.bounded import bounded


class GatedDeque(collections.deque):
    """popleft pauses once (after _main took len(pending)), as a GIL switch to the loop thread would."""

    def __init__(self):
        super().__init__()
        self.armed = False
        self.arrived = threading.Event()
        self.go = threading.Event()

    def popleft(self):
        if self.armed:
            self.armed = False
            self.arrived.set()
            self.go.wait(5)
        return super().popleft()


@bounded(30)
async def test_a_dispatch_during_the_take_is_indexed_without_a_query(tmp_path):
    store = MessageStore(str(tmp_path), StoreConfig(segment_size=1 << 20, max_message_size=2048))
    await store.open()
    svc = IndexService(str(tmp_path), segment_size=1 << 20, slots=16, entries=1000)
    gated = svc._pending = GatedDeque()
    store.add_dispatch_listener(svc.on_dispatch)
    await svc.open(store.min_physical_offset, store.max_physical_offset)
    try:
        gated.armed = True
        a = await store.put(PutRequest.build("T", b"a", properties={"KEYS": "ka"}))
        # the index thread has read len(pending) == 1 and is about to popleft: the loop dispatches b now
        assert await asyncio.get_running_loop().run_in_executor(None, gated.arrived.wait, 5)
        b = await store.put(PutRequest.build("T", b"b", properties={"KEYS": "kb"}))
        gated.go.set()
        assert a.ok and b.ok
        for _ in range(500):            # up to 5 s (500 times the 10 ms lag); no query: it would drain the deque
            if svc.covered >= b.physical_offset + b.size:
                break
            await asyncio.sleep(0.01)
        assert svc.covered >= b.physical_offset + b.size, (
            f"b never indexed: covered={svc.covered}, still pending={list(svc._pending)}")
    finally:
        gated.go.set()
        await svc.close()
        await store.close()


@bounded(30)
async def test_a_query_after_close_is_refused_not_left_waiting(tmp_path):
    """A QUERY_MESSAGE arriving while the broker stops used to queue a job behind the thread's stop: never run."""
    svc = IndexService(str(tmp_path), segment_size=1 << 20, slots=16, entries=1000)
    await svc.open(0, 0)
    assert (await svc.query("T", "k", 8, 0, 2**62))[0] == []
    await svc.close()
    with pytest.raises(Exception, match="the message index is closed"):
        await svc.query("T", "k", 8, 0, 2**62)


async def _held_index(tmp_path, monkeypatch) -> tuple[IndexService, threading.Event]:
    """An index (STALLED_S 0.5) whose thread is held by a job that waits for the returned event (a progress save's
    write on a hung disk)."""
    from broker.store import index as index_mod
    monkeypatch.setattr(index_mod, "STALLED_S", 0.5, raising=False)
    svc = IndexService(str(tmp_path), segment_size=1 << 20, slots=16, entries=1000)
    await svc.open(0, 0)
    held, go = threading.Event(), threading.Event()
    svc._q.put(lambda: (held.set(), go.wait(20)))
    assert await asyncio.to_thread(held.wait, 5)
    return svc, go


@bounded(30)
async def test_a_query_behind_a_held_index_thread_is_answered_store_error_once_it_is_seen_held(tmp_path, monkeypatch):
    """A query by key queued behind a job that does not return on the index thread (its progress save's write on a
    hung disk) waited for ever, answered by nothing. Once a no-op queued there has waited STALLED_S it raises
    StoreError (QUERY_MESSAGE's SYSTEM_ERROR), and stalled_s says how long; when the thread comes through, 0."""
    from protocol.errors import StoreError

    svc, go = await _held_index(tmp_path, monkeypatch)
    try:
        with pytest.raises(StoreError, match="the message index's thread has not come through"):
            await asyncio.wait_for(svc.query("T", "k", 32, 0, 2**62), 10)
        assert svc.stalled_s() > 0.5
        go.set()
        while svc.stalled_s() > 0:          # the probe comes through: the next one queued, 0 meanwhile
            await asyncio.sleep(0.01)
        assert (await asyncio.wait_for(svc.query("T", "k", 32, 0, 2**62), 5)).found == []
    finally:
        go.set()
        await svc.close()


@bounded(30)
async def test_a_busy_index_thread_that_comes_through_job_after_job_is_not_said_held(tmp_path, monkeypatch):
    """A backlog of quick jobs is not a hang. stalled_s timed a no-op queued behind every job already there: 20
    queries by key of 0.2 s each (a cold disk, a burst of queryMsgByKey) held the probe 4 s, so with STALLED_S at
    0.5 the queries still queued were answered SYSTEM_ERROR "has not come through" (and a broker said a hung disk,
    alert TxmqIndexStalled) while the thread answered one every 0.2 s. Only a job that has itself run past
    STALLED_S is a held thread."""
    import time

    from broker.store import index as index_mod
    monkeypatch.setattr(index_mod, "STALLED_S", 0.5, raising=False)
    svc = IndexService(str(tmp_path), segment_size=1 << 20, slots=16, entries=1000)
    await svc.open(0, 0)
    real = svc._query

    def slow_query(*args):
        time.sleep(0.2)
        return real(*args)
    monkeypatch.setattr(svc, "_query", slow_query)
    try:
        answers = await asyncio.wait_for(asyncio.gather(
            *(svc.query("T", f"k{i}", 32, 0, 2**62) for i in range(20)), return_exceptions=True), 20)
        failed = [a for a in answers if isinstance(a, BaseException)]
        assert not failed, f"{len(failed)} of 20 answered {failed[0]!r}"
        assert svc.stalled_s() < 0.5
    finally:
        await svc.close()


@bounded(30)
async def test_a_query_while_the_index_thread_is_seen_held_is_refused_without_queueing_behind_it(tmp_path,
                                                                                                 monkeypatch):
    """Once the thread is seen held, each further query by key still queued a job behind the hang and waited its
    first poll (1 s) to be refused: the jobs of refused queries (a client retrying every 3 s for an hour of a
    stopped NFS: thousands) piled up on the thread's queue, each run for nobody once it came through. Refused at
    once now, nothing queued."""
    from protocol.errors import StoreError

    svc, go = await _held_index(tmp_path, monkeypatch)
    try:
        with pytest.raises(StoreError):                     # the first: waits until the thread is seen held
            await asyncio.wait_for(svc.query("T", "k", 32, 0, 2**62), 10)
        queued = svc._q.qsize()
        for _ in range(50):
            asking = asyncio.ensure_future(svc.query("T", "k", 32, 0, 2**62))
            await asyncio.sleep(0)                          # (one turn: no poll's 1 s)
            assert asking.done(), "a query behind a thread seen held waited"
            with pytest.raises(StoreError, match="has not come through"):
                asking.result()
        assert svc._q.qsize() == queued
    finally:
        go.set()
        await svc.close()
