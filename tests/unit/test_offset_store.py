"""LocalOffsetStore (broadcasting consumers): progress survives a restart, and a damaged file costs
re-reading, never a crash."""
from __future__ import annotations

import asyncio
import logging

from consumer.offset_store import LocalOffsetStore
from consumer.pull_consumer import MessageQueue

MQ = MessageQueue("News", "broker-a", 3)


def test_offsets_are_saved_atomically_and_read_back(tmp_path):
    store = LocalOffsetStore(tmp_path, "10.0.0.1@DEFAULT", "CG")
    asyncio.run(store.write(MQ, 42))
    assert not store.path.exists()                     # memory only until flushed
    asyncio.run(store.flush())
    assert store.path == tmp_path / "10.0.0.1@DEFAULT" / "CG" / "offsets.json"
    assert not store.path.with_suffix(".tmp").exists()
    assert asyncio.run(LocalOffsetStore(tmp_path, "10.0.0.1@DEFAULT", "CG").read(MQ)) == 42
    assert asyncio.run(LocalOffsetStore(tmp_path, "10.0.0.2@DEFAULT", "CG").read(MQ)) is None


def test_a_damaged_offsets_file_is_reported_and_consumption_starts_over(tmp_path, caplog):
    store = LocalOffsetStore(tmp_path, "c@DEFAULT", "CG")
    store.path.parent.mkdir(parents=True)
    store.path.write_text('{"offsetTable": {"News@broker-a@3": ')
    with caplog.at_level(logging.ERROR, logger="txmq.consumer"):
        fresh = LocalOffsetStore(tmp_path, "c@DEFAULT", "CG")
    assert asyncio.run(fresh.read(MQ)) is None
    assert "unreadable" in caplog.text


def test_a_hostile_client_id_stays_inside_the_directory(tmp_path):
    for client_id, group in (("../../etc/x", "CG"), ("c", ".."), ("..", "../../g")):
        store = LocalOffsetStore(tmp_path, client_id, group)
        parts = store.path.relative_to(tmp_path).parts
        assert len(parts) == 3 and ".." not in parts and "." not in parts


def test_a_save_cancelled_at_shutdown_and_the_final_one_do_not_tear_the_file(tmp_path, monkeypatch):
    """Shutdown cancels the commit loop, possibly in the middle of a flush whose thread goes on writing
    the temporary file, then flushes again. The two threads wrote the same temporary file at once: the
    older, shorter text landed over the start of the newer one, the next start found the file unreadable
    and consumed from the default position again (skipping what arrived meanwhile, from "last")."""
    import threading

    store = LocalOffsetStore(tmp_path, "c@DEFAULT", "CG")
    entered, release, written = threading.Event(), threading.Event(), threading.Event()
    real_open = open
    opened = []

    class HeldFile:                          # the first save's file: its write waits for ``release``
        def __init__(self, f):
            self.f = f

        def write(self, text):
            entered.set()
            release.wait(10)
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
            written.set()

    def open_(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        opened.append(path)
        return HeldFile(f) if len(opened) == 1 else f
    monkeypatch.setattr("consumer.offset_store.open", open_, raising=False)

    async def run():
        await store.write(MQ, 1)
        first = asyncio.get_running_loop().create_task(store.flush())     # the commit loop's flush
        await asyncio.to_thread(entered.wait, 10)
        first.cancel()                                                     # shutdown cancels it
        await asyncio.gather(first, return_exceptions=True)
        await store.write(MQ, 123456789)
        final = asyncio.get_running_loop().create_task(store.flush())     # shutdown's own flush
        await asyncio.wait({final}, timeout=1.0)    # unheld, it is done long before; held, it waits
        release.set()
        await asyncio.wait_for(final, 10)
        await asyncio.to_thread(written.wait, 10)
    asyncio.run(run())
    assert asyncio.run(LocalOffsetStore(tmp_path, "c@DEFAULT", "CG").read(MQ)) == 123456789
