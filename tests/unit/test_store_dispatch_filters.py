"""Dispatch listeners that want only recovery replays, or only some topics, are called for nothing else."""
from __future__ import annotations

import asyncio
import os

from broker.store import MessageStore, PutRequest, StoreConfig
from broker.store.checkpoint import FILE_NAME


def _listeners(store, seen):
    store.add_dispatch_listener(lambda i: seen["all"].append((i.topic, i.recovering)))
    store.add_dispatch_listener(lambda i: seen["replays"].append((i.topic, i.recovering)), live=False)
    store.add_dispatch_listener(lambda i: seen["S"].append((i.topic, i.recovering)), topics=("S", "S2"))


async def test_live_and_topic_filters_and_every_listener_sees_replays(tmp_path):
    seen = {"all": [], "replays": [], "S": []}
    store = MessageStore(str(tmp_path), StoreConfig())
    _listeners(store, seen)
    await store.open()
    for topic in ("T", "S", "T", "S2"):
        assert (await asyncio.wait_for(store.put(PutRequest.build(topic, b"x")), 10)).ok
    results = await asyncio.wait_for(store.put_many([PutRequest.build("S", b"y"), PutRequest.build("T", b"z")]), 10)
    assert all(r.ok for r in results)
    assert seen["all"] == [(t, False) for t in ("T", "S", "T", "S2", "S", "T")]
    assert seen["replays"] == []
    assert seen["S"] == [("S", False), ("S2", False), ("S", False)]
    await store.close()

    # Recovery replays (the checkpoint gone: the whole log is replayed) reach every listener, filtered or not.
    os.remove(os.path.join(str(tmp_path), FILE_NAME))
    seen = {"all": [], "replays": [], "S": []}
    store = MessageStore(str(tmp_path), StoreConfig())
    _listeners(store, seen)
    await store.open()
    assert len(seen["all"]) == 6 and all(rec for _, rec in seen["all"])
    assert seen["replays"] == seen["all"]
    assert seen["S"] == seen["all"]
    await store.close()
