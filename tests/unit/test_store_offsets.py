"""ConsumerOffsets: commits survive restarts; the file is replaced atomically."""
from __future__ import annotations

import asyncio
import errno
import json
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.metrics import BrokerMetrics
from broker.store import ConsumerOffsets
from broker.store.disk import DiskMonitor
from protocol.errors import StoreError
from tests.support.bounded import bounded




@bounded(10)
async def test_commit_get_and_persist_on_close(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path))
    await offsets.open()
    assert offsets.get("g", "T", 0) is None
    offsets.commit("g", "T", 0, 5)
    offsets.commit("g", "T", 3, 7)
    offsets.commit("h", "T", 0, 1)
    assert offsets.get("g", "T", 0) == 5
    await offsets.close()
    with open(tmp_path / "config" / "consumerOffset.json") as f:
        assert json.load(f) == {"T@g": {"0": 5, "3": 7}, "T@h": {"0": 1}}
    again = ConsumerOffsets(str(tmp_path))
    assert again.get("g", "T", 3) == 7 and again.get("h", "T", 0) == 1
    assert sorted(again.items()) == [(("g", "T", 0), 5), (("g", "T", 3), 7), (("h", "T", 0), 1)]


@bounded(10)
async def test_a_dirty_table_is_persisted_in_the_background(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=0.01)
    await offsets.open()
    offsets.commit("g", "T", 1, 42)
    path = tmp_path / "config" / "consumerOffset.json"
    while not path.exists():
        await asyncio.sleep(0.01)
    assert ConsumerOffsets(str(tmp_path)).get("g", "T", 1) == 42
    await offsets.close()


def test_persist_leaves_no_temporary_file_and_remove_group(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("g", "T", 0, 1)
    offsets.commit("old", "T", 0, 1)
    offsets.remove_group("old")
    offsets.persist()
    assert os.listdir(tmp_path / "config") == ["consumerOffset.json"]
    assert ConsumerOffsets(str(tmp_path)).items() == [(("g", "T", 0), 1)]


def test_a_damaged_file_is_a_clear_error(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "consumerOffset.json").write_text("{not json")
    with pytest.raises(StoreError, match="consumerOffset.json"):
        ConsumerOffsets(str(tmp_path))


@pytest.mark.parametrize("entries", [{"T@g": {"0": 3, "x": 1}}, {"nogroup": {"0": 1}}, {"U@g": {"1": "7"}},
                                     {"U@g": {"1": -1}}, {"U@g": {"1": True}}, {"U@g": [7]}])
def test_a_table_with_a_malformed_entry_is_read_from_the_previous_copy(tmp_path, caplog, entries):
    """A malformed entry was skipped with a WARNING: its group started over on those queues by its consume-from
    policy (mass redelivery, or a skip), and the next save made that for good. The file is as damaged as a torn
    one: the previous copy is read instead, and without one start-up stops naming the entry."""
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("g", "T", 0, 3)
    offsets.commit("g", "U", 1, 7)
    offsets.persist()
    offsets.persist()                                   # the same table as the previous copy
    path = tmp_path / "config" / "consumerOffset.json"
    path.write_text(json.dumps({"T@g": {"0": 3}, **entries}))
    with caplog.at_level("ERROR", logger="txmq.store"):
        assert sorted(ConsumerOffsets(str(tmp_path)).items()) == [(("g", "T", 0), 3), (("g", "U", 1), 7)]
    assert any("previous copy" in r.getMessage() for r in caplog.records)
    path.write_text(json.dumps({"T@g": {"0": 3}, **entries}))         # moved aside: damaged again, no copy
    (tmp_path / "config" / "consumerOffset.json.bak").unlink()
    with pytest.raises(StoreError, match="nor its previous copy"):
        ConsumerOffsets(str(tmp_path))


@bounded(30)
async def test_offsets_past_a_queue_a_cut_log_shortened_are_lowered_at_start(tmp_path):
    """A log cut at start-up (truncate_corrupt_tail here; a torn tail after a power loss alike) leaves a queue
    shorter than a group's committed offset. That offset must come down to the queue's end: left as it was,
    the consumer resumed there and silently skipped the new messages that refilled the offsets below it."""
    from broker.config import BrokerConfig
    from broker.server import BrokerServer
    from broker.store import MessageStore, PutRequest, StoreConfig

    store_dir = tmp_path / "store"
    store = MessageStore(str(store_dir), StoreConfig(segment_size=1 << 20))
    await store.open()
    results = [await store.put(PutRequest.build("T", b"x" * 100, queue_id=0)) for _ in range(10)]
    await store.close()
    offsets = ConsumerOffsets(str(store_dir))
    offsets.commit("g", "T", 0, 10)
    offsets.commit("h", "T", 0, 5)
    offsets.persist()
    with open(store_dir / "commitlog" / f"{0:020d}", "r+b") as f:     # damage record 7 of 10: cut from there
        f.seek(results[7].physical_offset + 4)
        f.write(b"\0\0\0\0")
    server = BrokerServer(BrokerConfig(store_dir=str(store_dir), port=0, namesrv_port=0, metrics_port=-1,
                                       segment_size=1 << 20, max_message_size=64 * 1024,
                                       truncate_corrupt_tail=True))
    await server.start()
    try:
        assert server.ctx.store.max_offset("T", 0) == 7
        assert server.ctx.offsets.get("g", "T", 0) == 7      # was 10: offsets 7..9 are the next messages'
        assert server.ctx.offsets.get("h", "T", 0) == 5
    finally:
        await server.stop()


@pytest.mark.parametrize("damage", ["torn", "missing"])
def test_a_table_damaged_or_lost_after_its_save_is_read_from_the_previous_copy(tmp_path, caplog, damage):
    """Only the one table was kept: a damaged one stopped start-up with nothing to fall back on, and a lost one
    started every group over by its consume-from policy, without a word (skipping what it had not consumed)."""
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("g", "T", 0, 5)
    offsets.persist()
    offsets.commit("g", "T", 0, 9)
    offsets.commit("g", "T", 1, 3)
    offsets.persist()
    path = tmp_path / "config" / "consumerOffset.json"
    assert json.loads((tmp_path / "config" / "consumerOffset.json.bak").read_text()) == {"T@g": {"0": 5}}
    if damage == "torn":
        path.write_bytes(path.read_bytes()[:12])
    else:
        path.unlink()
    with caplog.at_level("ERROR", logger="txmq.store"):
        again = ConsumerOffsets(str(tmp_path))
    assert again.items() == [(("g", "T", 0), 5)]          # one save older: redeliveries, never a skip
    assert any("previous copy" in r.getMessage() for r in caplog.records)
    again.persist()                                         # and saving goes on from there
    assert ConsumerOffsets(str(tmp_path)).items() == [(("g", "T", 0), 5)]
    (tmp_path / "config" / "consumerOffset.json.bak").write_text("{")
    path.write_text("[")
    with pytest.raises(StoreError, match="nor its previous copy"):
        ConsumerOffsets(str(tmp_path))


def test_rocketmqs_own_offset_table_wrapper_is_read(tmp_path):
    """RocketMQ's {"offsetTable": {...}}: the expiry job read it, the broker skipped "offsetTable" as a malformed
    entry (WARNING) and started every group over by its consume-from policy."""
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "consumerOffset.json").write_text(json.dumps({"offsetTable": {"T@g": {"0": 5, "1": 9}}}))
    assert sorted(ConsumerOffsets(str(tmp_path)).items()) == [(("g", "T", 0), 5), (("g", "T", 1), 9)]


def test_a_group_name_ending_in_the_separator_is_not_damage(tmp_path):
    """UPDATE_CONSUMER_OFFSET takes any group name; one ending in "@" is saved as "T@odd@", which the loader read as
    an empty group and so as damage: every start went back to the previous copy (every group's newer offsets
    lost), and once both copies held it the broker did not start. The key reads back as it was written."""
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("CG", "T", 0, 2)
    offsets.commit("odd@", "T", 0, 1)
    offsets.persist()
    offsets.persist()                                   # the previous copy holds it too
    again = ConsumerOffsets(str(tmp_path))
    assert again.get("CG", "T", 0) == 2
    assert again.get("odd@", "T", 0) == 1
    again.persist()
    assert json.loads((tmp_path / "config" / "consumerOffset.json").read_text())["T@odd@"] == {"0": 1}


def test_every_reader_of_the_offsets_table_splits_its_keys_at_the_first_separator(tmp_path):
    """A topic name holds no "@" and a group name may: "T@a@b" is group "a@b" of topic T for the broker's loader,
    a slave's copy (protocol.admin_bodies) and the expiry job alike, or one of them reads another group's offset."""
    from ops.spark.expiry import read_consumer_offsets
    from protocol.admin_bodies import split_offset_key

    assert split_offset_key("T@a@b") == ("T", "a@b")
    assert split_offset_key("T@odd@") == ("T", "odd@")
    assert split_offset_key("T@") == ("T", "")
    assert split_offset_key("@G") is None and split_offset_key("NoGroup") is None
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "consumerOffset.json").write_text(json.dumps({"T@a@b": {"0": 4}, "T@odd@": {"0": 3}}))
    assert read_consumer_offsets(str(tmp_path)) == {"T": {"a@b": {0: 4}, "odd@": {0: 3}}}
    assert sorted(ConsumerOffsets(str(tmp_path)).items()) == [(("a@b", "T", 0), 4), (("odd@", "T", 0), 3)]


def test_the_offsets_a_client_made_are_counted_until_they_go(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("A", "T", 0, 1, "10.0.0.1")
    offsets.commit("A", "T", 0, 2, "10.0.0.2")           # moved by another: still 10.0.0.1's
    offsets.commit("B", "T", 0, 1, "10.0.0.1")
    offsets.commit("B", "U", 0, 1, "10.0.0.1")
    offsets.commit("C", "T", 0, 1)                       # no client's (an admin reset, a slave's copy)
    assert (offsets.made_by("10.0.0.1"), offsets.made_by("10.0.0.2")) == (3, 0)
    offsets.remove_group("A")
    offsets.remove_topic("U")
    offsets.remove_group("C")
    assert offsets.made_by("10.0.0.1") == 1 and offsets.has("B", "T", 0) and not offsets.has("A", "T", 0)


def test_a_forgotten_queue_leaves_its_groups_other_queues_and_gives_its_makers_room_back(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("A", "T", 0, 5, "10.0.0.1")
    offsets.commit("A", "T", 1, 6, "10.0.0.1")
    offsets.commit("A", "U", 0, 7, "10.0.0.1")
    offsets.forget("A", "T", 0)
    offsets.forget("A", "T", 9)                          # none there: nothing changes
    assert offsets.of("A", "T") == {1: 6} and offsets.made_by("10.0.0.1") == 2
    offsets.forget("A", "T", 1)
    assert offsets.of("A", "T") == {} and offsets.topics_of("A") == ["U"] and not offsets.holds("A", "T")
    assert offsets.groups_of("T") == set() and offsets.made_by("10.0.0.1") == 1


def test_who_made_each_offset_is_saved_and_counted_again(tmp_path):
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.commit("g", "T", 0, 5, "10.0.0.1")
    offsets.commit("g", "T", 1, 5, "10.0.0.1")
    offsets.commit("odd@", "T", 0, 1, "10.0.0.2")
    offsets.commit("slave", "T", 0, 1)                      # a copy or the broker's own: nobody's
    offsets.commit("gone", "T", 0, 1, "10.0.0.2")
    offsets.remove_group("gone")
    offsets.persist()
    raw = json.loads((tmp_path / "config" / "consumerOffset.json").read_text())
    assert raw["offsetTable"]["T@g"] == {"0": 5, "1": 5}     # RocketMQ's wrapper: older versions read it
    assert raw["makers"] == {"10.0.0.1": {"T@g": [0, 1]}, "10.0.0.2": {"T@odd@": [0]}}
    again = ConsumerOffsets(str(tmp_path))
    assert again.made_by("10.0.0.1") == 2 and again.made_by("10.0.0.2") == 1
    again.remove_group("g")
    assert again.made_by("10.0.0.1") == 0 and again.get("slave", "T", 0) == 1
    slave = ConsumerOffsets(str(tmp_path), per_host=False)  # its offsets are its master's: counted for nobody
    assert slave.made_by("10.0.0.2") == 0 and slave.get("odd@", "T", 0) == 1


def test_an_older_file_is_read_with_its_offsets_made_by_nobody(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "consumerOffset.json").write_text(json.dumps({"T@g": {"0": 5}}))
    offsets = ConsumerOffsets(str(tmp_path))
    assert offsets.get("g", "T", 0) == 5 and offsets.made_by("") == 0
    offsets.persist()                                       # nothing made by anyone: the plain table, as before
    assert json.loads((tmp_path / "config" / "consumerOffset.json").read_text()) == {"T@g": {"0": 5}}


@pytest.mark.parametrize("makers", [[], {"10.0.0.1": []}, {"10.0.0.1": {"T@g": [True]}}, {"10.0.0.1": {"x": [0]}}])
def test_malformed_makers_make_the_file_damaged(tmp_path, makers):
    from broker.store.offsets import _parse_table
    with pytest.raises(ValueError):
        _parse_table({"offsetTable": {"T@g": {"0": 5}}, "makers": makers})


@bounded(10)
async def test_a_background_save_still_encoding_at_close_never_writes_its_older_table_last(tmp_path, monkeypatch):
    """The background save encodes its copy on a thread, then writes; close() cancels it (the thread runs on) and
    writes the newest table itself (on that thread, behind it: a write that hung must not block the loop). Taking the write lock only to write, the thread's older table was written after
    close's: the file ended one save older (a group deleted meanwhile back, its offsets' makers gone)."""
    import threading

    from broker.store import offsets as offsets_mod
    encoding, release, finished = threading.Event(), threading.Event(), threading.Event()
    real_encode = offsets_mod._encode

    def held_encode(*snapshot):
        if not encoding.is_set():           # the background save's, not close's
            encoding.set()
            assert release.wait(5)
        return real_encode(*snapshot)

    monkeypatch.setattr(offsets_mod, "_encode", held_encode)
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=0.001)
    real_save = offsets._encode_and_write

    def save_then_say(*args):
        try:
            return real_save(*args)
        finally:
            finished.set()

    offsets._encode_and_write = save_then_say
    loop = asyncio.get_running_loop()
    await offsets.open()
    offsets.commit("g", "T", 0, 1, "10.0.0.1")
    assert await loop.run_in_executor(None, encoding.wait, 5)          # the background save holds {0: 1}
    offsets.commit("g", "T", 0, 2)
    offsets.commit("h", "T", 0, 3, "10.0.0.2")
    closing = asyncio.ensure_future(offsets.close())                  # writes {0: 2} and h, on the same thread
    release.set()
    await closing
    assert await loop.run_in_executor(None, finished.wait, 5)          # the older save is done (or skipped)
    again = ConsumerOffsets(str(tmp_path))
    assert again.get("g", "T", 0) == 2 and again.get("h", "T", 0) == 3 and again.made_by("10.0.0.2") == 1


def test_the_offsets_file_is_encoded_without_one_sort_of_the_whole_table(tmp_path, monkeypatch):
    """The encode runs on a thread so the loop goes on; but a sort of the whole table is one C call holding the
    GIL (40-100 ms for 100,000 offsets), the loop stopped for all of it. json's sort_keys orders the file anyway:
    the bytes are the same without it."""
    from broker.store import offsets as offsets_mod
    table = {(f"g{g}", f"T{t}", q): g * 100 + q for g in range(12) for t in range(3) for q in (0, 2, 10, 11)}
    makers = {key: f"10.0.0.{key[2]}" for key in table if key[0] != "g3"}
    expected_plain = {f"T{t}@g{g}": {str(q): g * 100 + q for q in (0, 2, 10, 11)} for g in range(12) for t in range(3)}
    whole = []

    def spy(items, *args, **kwargs):
        items = list(items)
        whole.append(len(items) >= len(table))
        return sorted(items, *args, **kwargs)

    monkeypatch.setattr(offsets_mod, "sorted", spy, raising=False)
    shuffled = dict(reversed(list(table.items())))
    body = offsets_mod._encode(shuffled, makers)
    assert not any(whole)
    assert body == offsets_mod._encode(table, dict(reversed(list(makers.items()))))     # order-free bytes
    assert json.loads(body)["offsetTable"] == expected_plain
    assert json.loads(offsets_mod._encode(shuffled, {})) == expected_plain
    text = body.decode()
    assert text.index('"T0@g0"') < text.index('"T0@g1"') < text.index('"T1@g0"')   # sorted as ever


def test_the_makers_read_at_start_are_held_once_and_not_at_all_on_a_slave(tmp_path):
    """The makers read from the file stayed on the loaded table as well: a second copy on a master for good, and
    on a slave (which counts none) 100,000 of them held and never read."""
    import tracemalloc
    plain, made = tmp_path / "plain", tmp_path / "made"
    for d, client in ((plain, None), (made, "10.0.0.1")):
        offsets = ConsumerOffsets(str(d))
        for g in range(2000):
            offsets.commit(f"group-{g}", "Topic", g % 4, g, client)
        offsets.persist()

    def held(d, per_host):
        tracemalloc.start()
        try:
            offsets = ConsumerOffsets(str(d), per_host=per_host)
            size = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert len(offsets.items()) == 2000
        return size

    base = held(plain, False)
    per_entry = (held(made, True) - base) / 2000        # a master holds each maker once: its entry and key
    assert held(made, False) - base < 2000 * 20         # a slave holds none (under 20 bytes an offset: noise)
    assert per_entry < 250


class _ReadsCounted(dict):
    """A table that counts the offsets read out of it (a copy of it reads each one)."""
    reads = 0

    def __iter__(self):     # (so that dict(table) reads through __getitem__, not its C fast path)
        return super().__iter__()

    def __getitem__(self, key):
        self.reads += 1
        return super().__getitem__(key)


@bounded(10)
async def test_a_save_takes_only_the_offsets_changed_since_the_last_one(tmp_path):
    """Each background save copied the whole table on the loop (11-55 ms at 100,000 offsets, every 5 s, however
    few had changed); it now brings the last save's copy up to date with the offsets changed since. What each
    save writes is still the table as it is then: changes, removals, and who made each offset."""
    from broker.store import offsets as offsets_mod
    offsets = ConsumerOffsets(str(tmp_path))
    offsets._table = _ReadsCounted()
    for q in range(200):
        offsets.commit("g", "T", q, q, "10.0.0.1")
    offsets.commit("h", "U", 0, 1, "10.0.0.2")
    loop = asyncio.get_running_loop()

    async def save():
        offsets._table.reads = 0
        taken = offsets._snapshot()         # as _persist_loop takes it, on the loop
        reads = offsets._table.reads
        await loop.run_in_executor(None, offsets._encode_and_write, taken, *offsets._take_save())
        saved = ConsumerOffsets(str(tmp_path))
        assert sorted(saved.items()) == sorted(offsets.items())
        assert saved._maker == offsets._maker
        return reads

    await save()                            # the first save copies it all
    offsets.commit("g", "T", 7, 70)
    offsets.commit("g", "T", 8, 8)          # unchanged: not a change
    offsets.commit("k", "T", 0, 5, "10.0.0.3")
    assert await save() == 2
    offsets.remove_group("k")
    offsets.remove_group("h")
    offsets.commit("h", "U", 0, 9, "10.0.0.4")       # made again, by another client
    assert await save() == 1                # h read again; k is gone, not read
    assert offsets_mod.ConsumerOffsets(str(tmp_path)).made_by("10.0.0.4") == 1
    assert await save() == 0                # nothing changed: nothing read
    for q in range(100):
        offsets.commit("g", "T", q, 1000 + q)
    offsets.remove_topic("U")
    assert await save() == len(offsets.items())      # most of it changed: a whole copy is the cheaper


def test_a_groups_topics_follow_its_commits_removals_and_a_restart(tmp_path):
    """topics_of(group), what GET_CONSUME_STATS of one group reads, kept as offsets come and go."""
    offsets = ConsumerOffsets(str(tmp_path))
    for q in range(4):
        offsets.commit("g", "T", q, 5)
        offsets.commit("g", "U", q, 5)
        offsets.commit("h", "T", q, 5)
    offsets.commit("g", "T", 0, 9)                      # moved, not new
    assert offsets.topics_of("g") == ["T", "U"] and offsets.topics_of("h") == ["T"]
    offsets.remove_topic("U")
    assert offsets.topics_of("g") == ["T"]
    offsets.persist()
    again = ConsumerOffsets(str(tmp_path))
    assert again.topics_of("g") == ["T"] and again.topics_of("h") == ["T"]
    again.remove_group("g")
    assert again.topics_of("g") == [] and again.topics_of("h") == ["T"] and "g" not in again._topics
    again.commit("g", "V", 3, 1)
    assert again.topics_of("g") == ["V"]


def _gone_groups_and_live(tmp_path) -> ConsumerOffsets:
    """1,000 groups long gone, 4 offsets each on 50 topics, and group "live" at 2 on T7 queue 1."""
    offsets = ConsumerOffsets(str(tmp_path))
    for g in range(1000):
        for q in range(4):
            offsets.commit(f"gone-{g}", f"T{g % 50}", q, 3)
    offsets.commit("live", "T7", 1, 2)
    return offsets


def test_consume_stats_of_one_group_does_not_walk_every_groups_offsets(tmp_path):
    """Groups that went away keep their offsets (as RocketMQ's, until deleteSubGroup). GET_CONSUME_STATS of one
    group found its topics in a walk of every offset: 1,000 groups of 160 offsets made each ask ~60 ms of the
    loop, and mqadmin consumerProgress (or a dashboard) asks every group in turn: O(groups x offsets)."""
    from types import SimpleNamespace

    from broker.clients import ClientRegistry
    from broker.processors.ops import get_consume_stats
    from protocol.admin_bodies import decode_mq_table
    from protocol.codes import RequestCode, ResponseCode
    from protocol.command import RemotingCommand

    offsets = _gone_groups_and_live(tmp_path)
    offsets.commit("live", "T9", 0, 1)
    walks = []
    items = offsets.items
    offsets.items = lambda: walks.append(1) or items()
    ctx = SimpleNamespace(
        offsets=offsets, clients=ClientRegistry(clock=lambda: 0), config=SimpleNamespace(broker_name="b"),
        topics=SimpleNamespace(get=lambda t: SimpleNamespace(read_queue_nums=2)),
        metrics=SimpleNamespace(consume_tps=lambda g, t: 0.0),
        store=SimpleNamespace(max_offset=lambda t, q: 10, store_time_of=lambda t, q, o: 1_000))
    cmd = RemotingCommand.request(RequestCode.GET_CONSUME_STATS, {"consumerGroup": "live"})
    reply = asyncio.run(get_consume_stats(ctx, None, cmd))
    assert reply.code == ResponseCode.SUCCESS
    assert walks == []
    _, rows = decode_mq_table(reply.body_bytes())
    assert {mq: row["consumerOffset"] for mq, row in rows.items()} == {
        ("T7", "b", 0): 0, ("T7", "b", 1): 2, ("T9", "b", 0): 1, ("T9", "b", 1): 0}


def test_which_groups_consume_a_topic_is_answered_without_walking_every_offset(tmp_path):
    """QUERY_TOPIC_CONSUME_BY_WHO found a topic's groups in a walk of every offset of every group, and mqadmin
    topicList -c and statsAll ask it of every topic in turn (a message's track asks it per message): O(topics x
    offsets) of the loop, the shape GET_CONSUME_STATS of one group had. The groups of a topic are kept as its
    offsets come and go, a restart and the removal of a group or a topic included."""
    import json
    from types import SimpleNamespace

    from broker.processors.ops import query_topic_consume_by_who
    from protocol.codes import RequestCode, ResponseCode
    from protocol.command import RemotingCommand

    offsets = _gone_groups_and_live(tmp_path)
    offsets.commit("live", "U", 0, 1)
    ctx = SimpleNamespace(offsets=offsets, clients=SimpleNamespace(consumers={
        "online": SimpleNamespace(subscriptions={"T7": None}), "other": SimpleNamespace(subscriptions={"U": None})}))

    def who(topic):
        walks = []
        items = ctx.offsets.items
        ctx.offsets.items = lambda: walks.append(1) or items()
        try:
            cmd = RemotingCommand.request(RequestCode.QUERY_TOPIC_CONSUME_BY_WHO, {"topic": topic})
            reply = query_topic_consume_by_who(ctx, None, cmd)
        finally:
            del ctx.offsets.items
        assert reply.code == ResponseCode.SUCCESS and walks == [], f"{len(walks)} walks of every offset"
        return json.loads(reply.body_bytes())["groupList"]

    assert who("T7") == sorted(["live", "online"] + [f"gone-{g}" for g in range(7, 1000, 50)])
    assert who("U") == ["live", "other"]
    offsets.remove_group("gone-7")
    offsets.remove_topic("U")
    offsets.commit("late", "T7", 0, 1)
    assert who("U") == ["other"] and "gone-7" not in who("T7") and "late" in who("T7")
    offsets.persist()
    ctx.offsets = offsets = ConsumerOffsets(str(tmp_path))
    assert who("T8") == sorted(f"gone-{g}" for g in range(8, 1000, 50)) and "late" in who("T7")


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["commit", "commit", "group", "topic", "fit", "restart"]),
                          st.sampled_from(["g", "h", "odd@"]), st.sampled_from(["T", "U"]), st.integers(0, 2),
                          st.integers(0, 5)), max_size=40))
def test_the_group_and_topic_indexes_are_what_a_walk_of_the_offsets_finds(ops):
    """topics_of and groups_of, kept as offsets are made, moved, lowered, removed and read back at a restart."""
    with tempfile.TemporaryDirectory() as d:
        offsets = ConsumerOffsets(d)
        for op, group, topic, qid, value in ops:
            if op == "commit":
                offsets.commit(group, topic, qid, value, "c")
            elif op == "group":
                offsets.remove_group(group)
            elif op == "topic":
                offsets.remove_topic(topic)
            elif op == "fit":
                offsets.fit(lambda _t, _q: value)
            else:
                offsets.persist()
                offsets = ConsumerOffsets(d)
            table = [k for k, _o in offsets.items()]
            for g in ("g", "h", "odd@"):
                assert offsets.topics_of(g) == sorted({t for (gg, t, _q) in table if gg == g})
            for t in ("T", "U"):
                assert offsets.groups_of(t) == {g for (g, tt, _q) in table if tt == t}


@bounded(10)
async def test_only_a_move_by_a_client_that_is_no_consumer_of_the_group_waits_for_the_save(tmp_path):
    """UPDATE_CONSUMER_OFFSET moving an offset, back or forward or to a group with none, from a connection with no
    heartbeat for the group (an admin tool: resetOffsetByTimeOld, skipAccumulatedMessage's fallback,
    cloneGroupOffset) is answered once the file holds it; a consumer's own commits either way, a oneway commit
    (a Java consumer's persistAll: no reply to wait for), and a tool's that moves nothing, are answered at once
    and saved periodically, as before."""
    from types import SimpleNamespace

    from broker.clients import ConsumerGroup
    from broker.processors.offsets import update_consumer_offset
    from protocol.codes import RequestCode, ResponseCode
    from protocol.command import RemotingCommand

    offsets = ConsumerOffsets(str(tmp_path))
    await offsets.open()
    offsets.commit("CG", "T", 0, 10)
    class Conn:
        peer = ("127.0.0.1", 1)

    member, tool = Conn(), Conn()
    ctx = SimpleNamespace(offsets=offsets, topics=SimpleNamespace(get=lambda t: SimpleNamespace(queue_count=1)),
                          limits=SimpleNamespace(may_commit=lambda *a: None),
                          clients=SimpleNamespace(consumers={"CG": ConsumerGroup("CG", channels={member: object()})}),
                          config=SimpleNamespace(broker_role="ASYNC_MASTER"), metrics=BrokerMetrics(),
                          store=SimpleNamespace(disk=DiskMonitor(str(tmp_path), statvfs=lambda _p: disk)))
    file = tmp_path / "config" / "consumerOffset.json"
    disk = SimpleNamespace(f_blocks=1000, f_bfree=900, f_bavail=900, f_frsize=4096, f_files=400, f_ffree=300,
                           f_favail=300)

    def commit(conn, offset, oneway=False):
        return update_consumer_offset(ctx, conn, RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET, {
            "consumerGroup": "CG", "topic": "T", "queueId": 0, "commitOffset": offset}, oneway=oneway))

    for conn, offset in ((member, 8), (member, 9), (member, 3), (tool, 3)):   # a consumer's either way; no move
        assert commit(conn, offset).code == ResponseCode.SUCCESS and not file.exists()
    # A Java consumer's persistAll, oneway (nobody told SUCCESS), on a connection not heartbeated on yet
    assert commit(tool, 4, oneway=True).code == ResponseCode.SUCCESS and not file.exists()
    for offset in (1, 5):                                           # a tool's back, then forward
        reply = commit(tool, offset)
        assert asyncio.iscoroutine(reply)
        assert (await reply).code == ResponseCode.SUCCESS
        assert json.loads(file.read_text())["T@CG"] == {"0": offset}

    def full(*_a):
        raise OSError(28, "No space left on device")
    offsets._write = full                                           # the save fails: the tool is told so
    reply = await commit(tool, 0)
    assert reply.code == ResponseCode.SYSTEM_ERROR and "moved back from 5 to 0 but the consumer offsets are not saved" in (
        reply.remark or ""), reply.remark
    assert json.loads(file.read_text())["T@CG"] == {"0": 5}
    assert "[Errno 28]" in reply.remark and "disk is full" not in reply.remark, reply.remark   # (not full: as is)
    # Out of inodes (every save's .tmp takes one), its blocks 10% used: measured at once and said as a full disk
    disk.f_ffree = disk.f_favail = 0
    reply = await commit(tool, 1)
    assert reply.code == ResponseCode.SYSTEM_ERROR and "moved forward from 0 to 1 but the consumer offsets are not " \
        "saved" in reply.remark and "the broker's disk is full [" in reply.remark and "inodes 100.0% used (df -i)" \
        in reply.remark, reply.remark
    assert ctx.store.disk.refusing
    del offsets._write
    await offsets.close()


@bounded(10)
async def test_an_admin_move_on_a_slave_says_its_master_copy_replaces_it(tmp_path, caplog):
    """A stock tool reaches a slave with its UPDATE_CONSUMER_OFFSET only while the master is gone (cloneGroupOffset's
    selectBrokerAddr, a route with no master): saved there before SUCCESS, but the slave's next copy from its master
    takes the master's offset for that queue (putAll: the master's value wins), and the move is undone unsaid.
    The WARNING said only "saved before the reply", as on a master."""
    from types import SimpleNamespace

    from broker.processors.offsets import update_consumer_offset
    from protocol.codes import RequestCode, ResponseCode
    from protocol.command import RemotingCommand

    offsets = ConsumerOffsets(str(tmp_path))
    await offsets.open()
    offsets.commit("CG_slave_move", "T", 0, 2)

    class Conn:
        peer = ("127.0.0.1", 1)

    ctx = SimpleNamespace(offsets=offsets, topics=SimpleNamespace(get=lambda t: SimpleNamespace(queue_count=1)),
                          limits=SimpleNamespace(may_commit=lambda *a: None), clients=SimpleNamespace(consumers={}),
                          config=SimpleNamespace(broker_role="SLAVE"), metrics=BrokerMetrics())
    with caplog.at_level("WARNING", logger="txmq.offsets"):
        reply = await update_consumer_offset(ctx, Conn(), RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET, {
            "consumerGroup": "CG_slave_move", "topic": "T", "queueId": 0, "commitOffset": 6}))
    assert reply.code == ResponseCode.SUCCESS
    said = [r.getMessage() for r in caplog.records if "CG_slave_move" in r.getMessage()]
    assert said and "master" in said[0], said
    await offsets.close()


@bounded(20)
async def test_a_second_full_disk_after_a_rewind_saved_the_table_is_said_again(tmp_path, caplog):
    """A full disk's run of refused saves is said once (ERROR) and its end once (WARNING). A rewind's save
    (offsets_saved: ``saved()``) that wrote the table once the disk had room ended the run unsaid: the periodic
    loop, nothing left to write, never saw it end, and the next full disk, days later, was not said at all."""
    import errno
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=0.01)
    full = [True]
    real = offsets._write_locked

    def write(data):
        if full[0]:
            offsets.persist_interval_s = 3600   # the loop's next turn is not in this test's time
            raise OSError(errno.ENOSPC, "No space left on device")
        real(data)

    offsets._write_locked = write
    await offsets.open()
    try:
        offsets.commit("G", "T", 0, 42)
        while "consumer offsets not persisted" not in caplog.text:     # the periodic save refused
            await asyncio.sleep(0.001)
        full[0] = False
        offsets.commit("G", "T", 0, 7)      # an admin's rewind, saved before its SUCCESS
        await offsets.saved()
        assert ConsumerOffsets(str(tmp_path)).get("G", "T", 0) == 7
        assert "consumer offsets persisted again" in caplog.text
        full[0] = True                      # full again, later: the next rewind's save is refused
        offsets.commit("G", "T", 0, 5)
        with pytest.raises(OSError):
            await offsets.saved()
        assert caplog.text.count("consumer offsets not persisted") == 2
    finally:
        full[0] = False
        await offsets.close()


class _SaveClock:
    """ConsumerOffsets' clock and sleep, moved by the test: each write takes ``took`` seconds of it, each sleep its
    length at once; ``saves`` the (start, end) of each write. ``held``: sleeps do not end (a stop's hurry)."""

    def __init__(self, took: float):
        self.now, self.took, self.saves, self.held = 0.0, took, [], False
        self.napping = asyncio.Event()      # set when a held sleep begins: the paced save is resting

    async def nap_begun(self) -> None:
        await asyncio.wait_for(self.napping.wait(), 5)
        self.napping.clear()

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if self.held:
            self.napping.set()
            await asyncio.Event().wait()
        self.now += seconds
        await asyncio.sleep(0)

    def offsets(self, path) -> ConsumerOffsets:
        offsets = ConsumerOffsets(str(path), persist_interval_s=3600, clock=self, sleep=self.sleep)
        write = offsets._encode_and_write

        def timed(*a):
            self.saves.append((self.now, self.now + self.took))
            self.now += self.took
            write(*a)
        offsets._encode_and_write = timed
        return offsets


@bounded(30)
async def test_a_flood_of_paced_saves_keeps_the_saver_resting_three_times_each_save(tmp_path):
    """Admin moves (``saved(paced=True)``) from 64 clients at once, each moving again as soon as it is answered, for
    200 s of a table that takes 1 s to save: each save starts only once the saver has rested REST_FACTOR times the
    last one since it ended, shared by every move queued by then, so the saver is busy at most a quarter of the
    time; each move is on disk when it returns."""
    from broker.store.offsets import REST_FACTOR
    clock = _SaveClock(1.0)
    offsets = clock.offsets(tmp_path)
    await offsets.open()
    answered = []

    async def client(c: int):
        n = 0
        while clock.now < 200:
            n += 1
            offsets.commit(f"CG{c}", "T", 0, n)
            await offsets.saved(paced=True)
            assert offsets._saved_changes >= offsets._changes - 64
            answered.append(clock.now)
    await asyncio.gather(*(client(c) for c in range(64)))
    saves = list(clock.saves)       # (not the stop's last save: it rests for no one)
    await offsets.close()
    starts = [s for s, _e in saves]
    assert all(b[0] >= a[1] + REST_FACTOR * clock.took for a, b in zip(saves, saves[1:])), saves
    busy = sum(e - s for s, e in saves if s < 200)
    assert 0.2 * 200 <= busy <= 200 / (1 + REST_FACTOR) + clock.took, (busy, starts[:10])
    assert len(answered) >= 64 * (len(starts) - 2)      # every move queued in a rest shares its save


@bounded(30)
async def test_a_tool_moving_one_queue_at_a_time_waits_a_few_saves_a_move(tmp_path):
    """One move at a time (resetOffsetByTimeOld, cloneGroupOffset over 1,000 queues), the table saved in 2 ms: each
    waits the rest after the last save and its own save, (1 + REST_FACTOR) saves, never the periodic save (an hour
    away here): 200 moves take 1.6 s of the clock, not 200 flush intervals."""
    from broker.store.offsets import REST_FACTOR
    clock = _SaveClock(0.002)
    offsets = clock.offsets(tmp_path)
    await offsets.open()
    for q in range(200):
        began = clock.now
        offsets.commit("CG", "T", q, 5)
        await offsets.saved(paced=True)
        assert clock.now - began <= (1 + REST_FACTOR) * clock.took + 1e-9, q
        assert offsets._saved_changes == offsets._changes
    assert len(clock.saves) == 200 and clock.now <= 200 * (1 + REST_FACTOR) * clock.took + 1e-6
    await offsets.close()


@bounded(10)
async def test_a_paced_save_rests_after_a_periodic_one_which_may_hold_its_move(tmp_path):
    """A move after another save waits the rest; a periodic save ending in the rest starts it again after itself,
    and when it holds the move nothing more is written; a move it holds is answered even while later moves wait
    (with the rest past the flush interval, those a periodic save held waited for good). A save refused is raised to the moves waiting for it
    (SYSTEM_ERROR); a stop (hurry) starts the save they wait for at once."""
    clock = _SaveClock(1.0)
    offsets = clock.offsets(tmp_path)
    offsets.commit("CG", "T", 0, 1)
    await offsets.saved(paced=True)                     # the first: no save before it, no rest
    assert clock.saves == [(0.0, 1.0)]
    offsets.commit("CG", "T", 0, 2)
    clock.held = True                                   # the rest does not end by itself
    moved = asyncio.ensure_future(offsets.saved(paced=True))
    await clock.nap_begun()
    assert not moved.done()
    await offsets._write_off_loop(offsets._snapshot(), *offsets._take_save())     # as the periodic save does
    offsets._wrote()
    assert await asyncio.wait_for(moved, 5) > 0 and len(clock.saves) == 2        # held by the periodic save
    assert json.loads((tmp_path / "config" / "consumerOffset.json").read_text())["T@CG"] == {"0": 2}

    offsets.commit("CG", "T", 0, 3)
    moved = asyncio.ensure_future(offsets.saved(paced=True))
    await clock.nap_begun()
    await offsets._write_off_loop(offsets._snapshot(), *offsets._take_save())     # a periodic save holds it...
    offsets.commit("CG", "U", 0, 1)                     # ...and another move comes meanwhile (a flood)
    later = asyncio.ensure_future(offsets.saved(paced=True))
    await asyncio.sleep(0.05)
    offsets._wrote()
    assert await asyncio.wait_for(moved, 5) > 0         # answered, not held with the later move's rest
    assert not later.done() and len(clock.saves) == 3
    offsets.hurry()                                     # a stop
    await asyncio.wait_for(later, 5)
    assert len(clock.saves) == 4 and json.loads(
        (tmp_path / "config" / "consumerOffset.json").read_text())["U@CG"] == {"0": 1}

    clock.held = False
    offsets._hurry = False

    def full(*_a):
        raise OSError(28, "No space left on device")
    offsets._write = full
    offsets.commit("CG", "T", 0, 4)
    with pytest.raises(OSError):
        await offsets.saved(paced=True)


class _SteppedClock(_SaveClock):
    """A _SaveClock whose sleeps end only when the test moves ``now`` past their end (``advance``); ``naps`` the
    ends of the sleeps under way, ``napped`` set as one begins."""

    def __init__(self, took: float):
        super().__init__(took)
        self.naps: list[float] = []
        self.napped, self._moved = asyncio.Event(), asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        end = self.now + seconds
        self.naps.append(end)
        self.napped.set()
        try:
            while self.now < end:
                await self._moved.wait()
        finally:
            self.naps.remove(end)

    async def naps_begun(self, count: int) -> list[float]:
        async with asyncio.timeout(5):
            while len(self.naps) < count:
                self.napped.clear()
                await self.napped.wait()
        return sorted(self.naps)

    def advance(self, to: float) -> None:
        self.now, moved, self._moved = to, self._moved, asyncio.Event()
        moved.set()


@bounded(10)
async def test_an_admin_commands_save_waits_at_most_admin_rest_max_s_of_the_rest(tmp_path):
    """DELETE_TOPIC_IN_BROKER, DELETE_SUBSCRIPTIONGROUP with removeOffset and INVOKE_BROKER_TO_RESET_OFFSET save
    with ``max_rest=ADMIN_REST_MAX_S``: a stock mqadmin times out after 5 s and skips its next steps, and one right
    after another waited the saver's whole rest (REST_FACTOR saves: 100,000 offsets, 4.3-5.1 s). Here a save takes
    2 s of the test's clock (a rest of 6 s): such a command starts a save of its own once it has waited
    ADMIN_REST_MAX_S, not at the rest's end, and is counted as held (``saved`` > 0: deferred); the paced save left
    behind writes nothing it does not hold. A move without ``max_rest`` (a tool's UPDATE_CONSUMER_OFFSET) still
    waits the whole rest. (Was a wall-clock comparison of the answers' times at 100,000 offsets, flaky under load.)"""
    from broker.store.offsets import ADMIN_REST_MAX_S, REST_FACTOR
    took = 2.0
    assert REST_FACTOR * took > ADMIN_REST_MAX_S          # (else the bound is never reached)
    for bounded_rest in (True, False):
        clock = _SteppedClock(took)
        offsets = clock.offsets(tmp_path / str(bounded_rest))
        kwargs = {"max_rest": ADMIN_REST_MAX_S} if bounded_rest else {}
        offsets.commit("CG", "T", 0, 1)
        await asyncio.wait_for(offsets.saved(paced=True, **kwargs), 5)
        assert clock.saves == [(0.0, took)]                          # the first: no rest before it
        asked = clock.now
        offsets.commit("CG", "T", 0, 2)
        moved = asyncio.ensure_future(offsets.saved(paced=True, **kwargs))
        rest_end = took + REST_FACTOR * took
        if bounded_rest:
            assert await clock.naps_begun(2) == [asked + ADMIN_REST_MAX_S, rest_end]
            clock.advance(asked + ADMIN_REST_MAX_S - 0.001)
            await asyncio.sleep(0.05)
            assert not moved.done() and len(clock.saves) == 1        # the bound not yet reached
            clock.advance(asked + ADMIN_REST_MAX_S)
            rested = await asyncio.wait_for(moved, 5)
            assert clock.saves == [(0.0, took), (asked + ADMIN_REST_MAX_S, asked + ADMIN_REST_MAX_S + took)]
            assert rested > 0                                         # held, so counted (deferred)
            clock.advance(rest_end)                                   # the paced save left behind: nothing to write
            await asyncio.sleep(0.05)
            assert len(clock.saves) == 2
        else:
            assert await clock.naps_begun(1) == [rest_end]
            clock.advance(rest_end - 0.001)
            await asyncio.sleep(0.05)
            assert not moved.done() and len(clock.saves) == 1
            clock.advance(rest_end)
            assert await asyncio.wait_for(moved, 5) > 0
            assert clock.saves == [(0.0, took), (rest_end, rest_end + took)]
        assert json.loads((tmp_path / str(bounded_rest) / "config" / "consumerOffset.json").read_text())[
            "T@CG"] == {"0": 2}
        await offsets.close()


def test_removing_a_group_or_a_topic_does_not_walk_every_offset(tmp_path):
    """remove_groups and remove_topic (DELETE_SUBSCRIPTIONGROUP with cleanOffset, deleteTopic, a retry topic
    reclaimed) walked the whole table on the loop for a few offsets: at 100,000 offsets 15-50 ms each. They take
    the offsets from the group and topic index now."""
    offsets = ConsumerOffsets(str(tmp_path))
    for g in ("A", "B", "C"):
        for t in ("T", "U"):
            for q in range(3):
                offsets.commit(g, t, q, 1, "127.0.0.1")

    class Unwalkable(dict):
        def __iter__(self):
            raise AssertionError("the whole table was walked")
    offsets._table = Unwalkable(offsets._table)
    offsets.remove_group("A")
    offsets.remove_topic("U")
    assert sorted(dict.keys(offsets._table)) == [(g, "T", q) for g in ("B", "C") for q in range(3)]
    assert offsets.topics_of("A") == [] and offsets.groups_of("U") == set() and offsets.made_by("127.0.0.1") == 6


@bounded(30)
async def test_admin_moves_of_many_made_up_groups_are_not_a_warning_each(tmp_path, caplog):
    """An admin move is said at WARNING once a minute a group and topic, in a table of 1,024 keys: a client moving
    offsets of made-up groups (they cost nothing) had every move said, one line each (296 moves: 296 lines). At
    most MOVES_SAID_A_MINUTE of them are said a minute, the rest in one line every 10 s (Limits.warn)."""
    from types import SimpleNamespace

    from broker.config import BrokerConfig
    from broker.limits import Limits
    from broker.metrics import BrokerMetrics
    from broker.processors import offsets as processor
    from protocol.codes import RequestCode, ResponseCode
    from protocol.command import RemotingCommand

    offsets = ConsumerOffsets(str(tmp_path), clock=lambda: 0.0)     # (saves take no time: no rest between)
    await offsets.open()
    limits = Limits(BrokerConfig(), BrokerMetrics())

    class Conn:
        peer = ("127.0.0.1", 1)

    ctx = SimpleNamespace(offsets=offsets, topics=SimpleNamespace(get=lambda t: SimpleNamespace(queue_count=1)),
                          limits=SimpleNamespace(may_commit=lambda *a: None,
                                                 warn=limits.warn),
                          clients=SimpleNamespace(consumers={}), config=SimpleNamespace(broker_role="ASYNC_MASTER"), metrics=BrokerMetrics())
    tool = Conn()
    moves = 300
    with caplog.at_level("WARNING"):
        for i in range(moves):
            reply = await processor.update_consumer_offset(ctx, tool, RemotingCommand.request(
                RequestCode.UPDATE_CONSUMER_OFFSET, {"consumerGroup": f"CG_madeup{i}", "topic": "T", "queueId": 0,
                                                     "commitOffset": 1}))
            assert reply.code == ResponseCode.SUCCESS
    summary = [r for r in caplog.records if "not said one by one" in r.getMessage()]
    one_each = [r for r in caplog.records if "CG_madeup" in r.getMessage() and r not in summary]
    assert len(one_each) <= processor.MOVES_SAID_A_MINUTE < moves, len(one_each)
    assert len(summary) == 1, [r.getMessage() for r in summary]
    await offsets.close()


@bounded(20)
async def test_a_stop_answers_moves_whose_hurried_save_outlasts_its_grace(tmp_path, monkeypatch):
    """A stop gives requests in flight a grace (5 s), then closes their connections. Moves waiting on an offsets save
    the stop hurried, on a large table and a loaded host (200,000 offsets: 14 s), were cut off unanswered though the
    save went on and held them: the tool did not know whether they were made. The stop waits for such a save past
    the grace (the store's close writes it all the same), and only for one under way."""
    from broker.server import BrokerServer

    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    await offsets.open()
    release = __import__("threading").Event()
    write = offsets._encode_and_write
    monkeypatch.setattr(offsets, "_encode_and_write", lambda *a: (release.wait(10), write(*a)))
    server = BrokerServer.__new__(BrokerServer)
    server.ctx = type("Ctx", (), {"offsets": offsets})()
    try:
        offsets.commit("g", "T", 0, 3)
        move = asyncio.ensure_future(offsets.saved(paced=True))
        offsets.hurry()
        _done, left = await asyncio.wait([move], timeout=0.05)      # the grace, gone by with the save on its thread
        assert left == {move}
        stopping = asyncio.ensure_future(server._offset_saves_answered(left))
        await asyncio.sleep(0)
        assert not stopping.done()          # waits for the save under way ...
        release.set()
        await asyncio.wait_for(stopping, 10)
        assert move.done() and move.exception() is None         # ... and the move is answered
        assert ConsumerOffsets(str(tmp_path)).get("g", "T", 0) == 3          # on disk
        stuck = asyncio.get_running_loop().create_future()      # a request waiting on no save: no wait at all
        await asyncio.wait_for(server._offset_saves_answered({stuck}), 0.5)
        assert not stuck.done()
    finally:
        release.set()
        await offsets.close()


async def _hung_offsets(tmp_path, persist_interval_s: float, write_hung_s: float):
    """Offsets opened in ``tmp_path`` whose writes block (a stopped NFS) until the event returned with them is set;
    said hung past ``write_hung_s``."""
    import threading
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=persist_interval_s)
    offsets.write_hung_s = write_hung_s
    go, real = threading.Event(), offsets._write_locked

    def write(data):
        assert go.wait(20)
        real(data)
    offsets._write_locked = write
    await offsets.open()
    return offsets, go


@bounded(20)
async def test_a_hung_save_is_said_and_callers_of_saved_are_answered(tmp_path, caplog):
    """A save that never returns was said by nothing (no log, no ``write_hung``: the gauge), and every caller of
    ``saved`` (an admin's move, answered only once saved) waited for as long. Past ``write_hung_s`` it is said once,
    they get OSError (SYSTEM_ERROR "not saved"), a caller after it at once; its end is said, and saves work again."""
    import errno
    offsets, go = await _hung_offsets(tmp_path, 3600, 0.2)
    try:
        offsets.commit("G", "T", 0, 5)
        with pytest.raises(OSError) as raised:
            await offsets.saved()
        assert raised.value.errno == errno.ETIMEDOUT and "has not ended in 0.2 s" in str(raised.value)
        assert offsets.write_hung
        offsets.commit("G", "T", 0, 6)
        with pytest.raises(OSError):    # at once: not another wait behind the hung write
            await asyncio.wait_for(offsets.saved(), 0.1)
        assert caplog.text.count("consumer offsets: a write has not ended") == 1
        go.set()
        while offsets.write_hung:       # the write that hung ends
            await asyncio.sleep(0.01)
        assert "the write that hung has ended" in caplog.text
        await offsets.saved()
        assert ConsumerOffsets(str(tmp_path)).get("G", "T", 0) == 6
    finally:
        go.set()
        await offsets.close()


@bounded(20)
async def test_a_stop_behind_a_hung_save_gives_it_up_and_ends(tmp_path, caplog):
    """close() wrote the last table ON the loop, behind the hung write's lock: the stop never ended (SIGTERM
    answered by nothing). Now it waits ``write_hung_s`` on the saves' daemon thread, then goes on, with an ERROR."""
    import threading
    offsets, go = await _hung_offsets(tmp_path, 0.01, 0.2)
    try:
        offsets.commit("G", "T", 0, 5)
        while not offsets.write_hung:   # the periodic save hangs
            await asyncio.sleep(0.01)
        await asyncio.wait_for(offsets.close(), 5)
        assert "consumer offsets not persisted at close: a write has not ended in 0.2 s" in caplog.text
        assert all(t.daemon for t in threading.enumerate() if t.name == "txmq-offsets")
    finally:
        go.set()


@bounded(20)
async def test_a_stop_behind_a_write_already_said_hung_waits_its_short_bound_not_write_hung_s_more(tmp_path, caplog):
    """The last save is queued behind the hung write on the saves' one thread: it cannot start before that write
    ends. A stop with the write already said hung (past write_hung_s, 30 s) waited write_hung_s more all the same:
    a stop with config/ hung took ~45 s of systemd's 60. It waits HUNG_CLOSE_WAIT_S (2 s) now."""
    from broker.store.offsets import WRITE_HUNG_S
    offsets, go = await _hung_offsets(tmp_path, 0.01, 0.2)
    try:
        offsets.commit("G", "T", 0, 5)
        while not offsets.write_hung:   # the periodic save hangs, said so
            await asyncio.sleep(0.01)
        offsets.write_hung_s = WRITE_HUNG_S     # (as said in production: after 30 s)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(offsets.close(), 5)
        assert loop.time() - began >= 1.9   # the short bound, waited (the write may end in it)
        assert "consumer offsets not persisted at close: a write has not ended in 30 s, nor in 2 s more" in caplog.text
    finally:
        go.set()


@bounded(20)
async def test_a_write_said_hung_that_ends_in_the_stops_short_bound_still_gets_the_last_save_written(tmp_path,
                                                                                                   caplog):
    """The short bound gives the last save up only while the write ahead of it still hangs: one that ends in it
    lets the last save run its long bound, and the file holds the newest commit (none left in a .tmp)."""
    from broker.store.offsets import WRITE_HUNG_S
    offsets, go = await _hung_offsets(tmp_path, 0.01, 0.2)
    try:
        offsets.commit("G", "T", 0, 5)
        while not offsets.write_hung:   # the periodic save hangs, said so
            await asyncio.sleep(0.01)
        offsets.write_hung_s = WRITE_HUNG_S
        offsets.commit("G", "T", 0, 6)
        closing = asyncio.ensure_future(offsets.close())
        await asyncio.sleep(0)          # the stop waits (its short bound)
        assert not closing.done()
        go.set()                        # the hung write ends, well inside the 2 s
        await asyncio.wait_for(closing, 10)
        assert "not persisted at close" not in caplog.text, caplog.text
        with open(tmp_path / "config" / "consumerOffset.json") as f:
            assert json.load(f) == {"T@G": {"0": 6}}
        assert not [n for n in os.listdir(tmp_path / "config") if n.endswith(".tmp")]
    finally:
        go.set()


async def _let_pass(seconds: float, check) -> None:
    """``seconds`` of the loop's time pass (what is measured), ``check()`` true all along."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    while loop.time() < until:
        assert check()
        await asyncio.sleep(0.02)


@bounded(20)
async def test_a_save_slow_to_encode_is_not_taken_as_hung_nor_given_up_at_stop(tmp_path, monkeypatch, caplog):
    """A big table's encode is slow, never hung (CPU: 200,000 offsets 4 s of a loaded 2-core host, most of a save;
    the stop's 14 s): the hung clock counted it, so a 500,000-offset save there was said hung at 30 s (an ERROR,
    a critical alert with no ``for``), admin moves answered SYSTEM_ERROR, and a stop in that window gave its last
    save up after 30 s (the bound for a hung write), the commits since lost. Only the write is timed now."""
    import threading

    from broker.store import offsets as offsets_mod
    real_encode, go, encoding = offsets_mod._encode, threading.Event(), threading.Event()

    def slow_encode(*snapshot):
        if not go.is_set():
            encoding.set()
            assert go.wait(15)
        return real_encode(*snapshot)
    monkeypatch.setattr(offsets_mod, "_encode", slow_encode)
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    offsets.write_hung_s = 0.2
    await offsets.open()
    closing = None
    try:
        offsets.commit("G", "T", 0, 5)
        saving = asyncio.ensure_future(offsets.saved())
        assert await asyncio.to_thread(encoding.wait, 5)
        await _let_pass(3 * offsets.write_hung_s, lambda: not saving.done() and not offsets.write_hung)
        offsets.commit("G", "T", 0, 6)
        closing = asyncio.ensure_future(offsets.close())     # the stop, while that save still encodes
        await _let_pass(3 * offsets.write_hung_s, lambda: not closing.done())
        go.set()
        await saving
        await closing
        assert "has not ended" not in caplog.text and "not persisted" not in caplog.text, caplog.text
        assert ConsumerOffsets(str(tmp_path)).get("G", "T", 0) == 6
    finally:
        go.set()
        if closing is None:
            await offsets.close()


@bounded(20)
async def test_a_stop_begun_before_a_stuck_write_is_said_hung_gives_it_up_once_it_is(tmp_path, caplog):
    """close() chose its bound once, at its start: a SIGTERM while the write was stuck but not yet past
    ``write_hung_s`` waited the long bound (CLOSE_WAIT_S, 120 s; a supervisor's SIGKILL first) though the write was
    said hung meanwhile. Once it is, the stop waits ``write_hung_s`` more, as when it was hung at its start."""
    offsets, go = await _hung_offsets(tmp_path, 0.01, 1.0)
    try:
        offsets.commit("G", "T", 0, 5)
        while offsets._io_began is None:    # the periodic save's write is stuck, not yet said hung
            await asyncio.sleep(0.01)
        assert not offsets.write_hung
        await asyncio.wait_for(offsets.close(), 6)
        assert "consumer offsets not persisted at close: a write has not ended" in caplog.text
    finally:
        go.set()


def test_offsets_lowered_at_start_are_summed_up_with_their_reason_not_said_one_a_line(tmp_path, caplog):
    """A store whose queues were not all rebuilt lowered 2,945 offsets at one start, one WARNING each, every one
    saying "the log was cut" when the queue simply held nothing: a flood that buried the one line that mattered."""
    import logging
    offsets = ConsumerOffsets(str(tmp_path))
    for i in range(300):
        offsets.commit(f"G{i}", "GONE", i % 8, 40, "c")      # a queue that holds nothing here
        offsets.commit(f"G{i}", "CUT", i % 8, 40, "c")       # a queue a cut log left at 25
        offsets.commit(f"G{i}", "FINE", i % 8, 10, "c")
    caplog.set_level(logging.INFO)
    ends = {"GONE": 0, "CUT": 25, "FINE": 30}
    lowered = offsets.fit(lambda t, _q: ends[t])

    assert len(lowered) == 600 and {offsets.get(f"G{i}", t, i % 8) for i in range(300) for t in ("GONE", "CUT")} \
        == {0, 25}
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) <= 11, len(said)
    summary = [m for m in said if "600 consumer offsets" in m]
    assert len(summary) == 1 and "300 to 0" in summary[0] and "300 to a shorter queue" in summary[0]
    assert not any("the log was cut" in m for m in said if "GONE" in m)


def test_a_forgotten_queue_is_listed_until_committed_again_and_the_list_is_bounded(tmp_path, monkeypatch):
    """What GET_ALL_CONSUMER_OFFSET lists at -1 for slaves to forget their copies: a commit takes it off, and a
    client forgetting queue after queue (made-up groups) keeps only the newest FORGOTTEN_KEPT."""
    import broker.store.offsets as store_offsets

    monkeypatch.setattr(store_offsets, "FORGOTTEN_KEPT", 2)
    offsets = ConsumerOffsets(str(tmp_path))
    offsets.forget("A", "T", 0)                         # none there: nothing to list
    assert offsets.forgotten() == []
    for g in "ABC":
        offsets.commit(g, "T", 0, 5)
        offsets.forget(g, "T", 0)
    assert offsets.forgotten() == [("B", "T", 0), ("C", "T", 0)]
    offsets.commit("B", "T", 0, 1)
    assert offsets.forgotten() == [("C", "T", 0)]


def test_a_deleted_topics_or_groups_forgotten_queues_are_no_longer_listed(tmp_path):
    """A topic deleted (its offsets go inside the writer's delete) or a group deleted with removeOffset takes its
    forgotten queues off the list slaves are sent at -1, as a Java master's cleanOffsetByTopic / removeOffset take
    the -1 it keeps: listed on, a Java slave (putAll) got the deleted topic's or group's entries back into its
    table at every sync, a group deleted on the master listed there for good; at most FORGOTTEN_KEPT of them."""
    offsets = ConsumerOffsets(str(tmp_path))
    for group, topic in (("A", "T"), ("A", "U"), ("B", "T"), ("B", "U")):
        offsets.commit(group, topic, 0, 5)
        offsets.forget(group, topic, 0)
    offsets.commit("A", "T", 1, 6)
    offsets.remove_topic("T")
    assert offsets.forgotten() == [("A", "U", 0), ("B", "U", 0)]
    offsets.remove_group("B")
    assert offsets.forgotten() == [("A", "U", 0)]


@bounded(10)
async def test_forgotten_queues_are_saved_with_the_table_and_listed_again_after_a_restart(tmp_path):
    """The queues a master lists to its slaves at -1 were held in memory only: forgotten less than a slave's sync
    interval before the master stopped, they were listed by nothing after its restart, and the slave (putAll) kept
    the old offset for good. Saved with the table now (oldest first, bounded as in memory); one committed again,
    or whose topic is deleted, is not listed after the restart; a slave's file stays RocketMQ's plain table."""
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    await offsets.open()
    for group, topic in (("A", "T"), ("B", "T"), ("A", "GONE"), ("C", "T")):
        offsets.commit(group, topic, 0, 5)
        offsets.forget(group, topic, 0)
    offsets.commit("B", "T", 0, 1)          # committed again: not forgotten any more
    offsets.remove_topic("GONE")
    await offsets.close()
    again = ConsumerOffsets(str(tmp_path))
    assert again.forgotten() == [("A", "T", 0), ("C", "T", 0)] and again.get("B", "T", 0) == 1
    again.remove_group("A")                 # nothing else changes: the removal alone is saved
    await again.saved()
    assert ConsumerOffsets(str(tmp_path)).forgotten() == [("C", "T", 0)]
    slave = ConsumerOffsets(str(tmp_path / "slave"), per_host=False)
    slave.commit("A", "T", 0, 5)
    slave.forget("A", "T", 0)
    slave.commit("A", "T", 1, 5)
    slave.persist()
    assert json.loads((tmp_path / "slave" / "config" / "consumerOffset.json").read_text()) == {"T@A": {"1": 5}}


@pytest.mark.parametrize("forgotten", [{}, [["T", "g"]], [["T", "g", "0"]], [[1, "g", 0]]])
def test_malformed_forgotten_queues_make_the_file_damaged(forgotten):
    from broker.store.offsets import _parse_table
    with pytest.raises(ValueError):
        _parse_table({"offsetTable": {"T@g": {"0": 5}}, "forgotten": forgotten})


@bounded(10)
async def test_groups_deleted_with_their_offsets_kept_are_saved_with_the_table(tmp_path):
    """The groups deleted with their offsets kept (their lag left out until they come again) were held in memory
    only: a restart brought their lag back. Saved with the table now, ``saved`` writing a delete alone; a name
    holding no offset is not kept, nor one whose offsets went since (a topic deleted); a slave's too."""
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    await offsets.open()
    for group, topic in (("A", "T"), ("B", "GONE"), ("C", "T")):
        offsets.commit(group, topic, 0, 5)
    await offsets.saved()
    assert offsets.mark_deleted("A") and offsets.mark_deleted("B") and not offsets.mark_deleted("made-up")
    await offsets.saved()           # nothing else changed: the deletes alone are written
    assert ConsumerOffsets(str(tmp_path)).deleted == {"A", "B"}
    offsets.remove_topic("GONE")
    await offsets.close()
    raw = json.loads((tmp_path / "config" / "consumerOffset.json").read_text())
    assert raw["deleted"] == ["A"] and raw["offsetTable"]["T@A"] == {"0": 5}
    assert ConsumerOffsets(str(tmp_path)).deleted == {"A"}
    slave = ConsumerOffsets(str(tmp_path / "slave"), per_host=False)
    slave.commit("A", "T", 0, 5)
    slave.mark_deleted("A")
    slave.persist()
    assert ConsumerOffsets(str(tmp_path / "slave"), per_host=False).deleted == {"A"}


@pytest.mark.parametrize("deleted", [{}, "A", [1], [["A"]]])
def test_malformed_deleted_groups_make_the_file_damaged(deleted):
    from broker.store.offsets import _parse_table
    with pytest.raises(ValueError):
        _parse_table({"offsetTable": {"T@g": {"0": 5}}, "deleted": deleted})


def _journal_lines(tmp_path) -> list:
    path = tmp_path / "config" / "consumerOffset.json.firsts"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@bounded(10)
async def test_a_first_offset_is_on_disk_before_its_wait_ends_without_a_save_of_the_table(tmp_path):
    """commit_first: a line of the first offsets' journal, one fsync shared by every first commit meanwhile, not
    a save of the whole table (a paced save each: 150 ms a commit at 10,000 offsets, past a client's 3 s timeout at
    100,000). Read back at a start without any save since (a kill -9), with who made it; numbering goes on."""
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    await offsets.open()
    offsets.commit("old", "T", 0, 9)
    offsets.persist()
    table = (tmp_path / "config" / "consumerOffset.json").read_bytes()
    await asyncio.gather(*(offsets.commit_first("g", "T", q, q * 10, "10.0.0.1") for q in range(5)))
    assert (tmp_path / "config" / "consumerOffset.json").read_bytes() == table      # no save of the table
    assert [line[:5] for line in _journal_lines(tmp_path)] == [[q + 1, "T", "g", q, q * 10] for q in range(5)]
    killed = ConsumerOffsets(str(tmp_path))                                          # (no close: as a kill -9)
    assert killed.of("g", "T") == {q: q * 10 for q in range(5)} and killed.get("old", "T", 0) == 9
    assert killed.made_by("10.0.0.1") == 5
    await offsets.close()


@bounded(10)
async def test_a_save_trims_the_lines_it_holds_and_a_start_never_reads_them_back_over_it(tmp_path):
    """A save of the table says the newest journal line it holds ("firsts") and trims those lines off once its
    previous copy holds them too, so the file holds about two save periods of first commits (left, it grew with
    every one for good). A line the table holds is never read back over it: a topic deleted (saved) after its first offset stays deleted, and an offset
    moved on stays moved, even when the trim did not happen (a crash between the save and it)."""
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    await offsets.open()
    await offsets.commit_first("g", "GONE", 0, 5, None)
    await offsets.commit_first("g", "T", 0, 5, None)
    kept = _journal_lines(tmp_path)
    offsets.remove_topic("GONE")
    offsets.commit("g", "T", 0, 8)
    await offsets.saved()
    assert [line[0] for line in _journal_lines(tmp_path)] == [1, 2]     # kept: the previous copy holds neither
    await offsets.commit_first("g", "T", 1, 3, None)
    await offsets.saved()
    assert [line[0] for line in _journal_lines(tmp_path)] == [3]        # numbering goes on; 1, 2 in both copies
    await offsets.close()
    path = tmp_path / "config" / "consumerOffset.json.firsts"
    path.write_text("".join(json.dumps(line) + "\n" for line in kept) + '[4, "T", "g", 2, 7')   # + a cut line
    again = ConsumerOffsets(str(tmp_path))
    assert again.of("g", "T") == {0: 8, 1: 3} and again.of("g", "GONE") == {}
    await again.open()                      # the cut line is gone: a line appended now reads whole
    await again.commit_first("g", "T", 5, 1, None)
    assert [line[:2] for line in _journal_lines(tmp_path)] == [[1, "GONE"], [2, "T"], [4, "T"]]
    assert ConsumerOffsets(str(tmp_path)).of("g", "T") == {0: 8, 1: 3, 5: 1}
    await again.close()
    assert [line[0] for line in _journal_lines(tmp_path)] == [4]    # (the stop's save holds it; its previous copy not)


def test_a_damaged_journal_line_is_skipped_and_said(tmp_path, caplog):
    config = tmp_path / "config"
    config.mkdir()
    (config / "consumerOffset.json.firsts").write_text(
        '[1, "T", "g", 0, 5, null]\nnot json\n[2, "T", "g", 1, 6, null]\n')
    offsets = ConsumerOffsets(str(tmp_path))
    assert offsets.of("g", "T") == {0: 5, 1: 6}
    assert any("do not read (lines 2)" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


@bounded(10)
async def test_a_journal_append_cut_short_by_a_full_disk_is_an_error_and_leaves_no_torn_line(tmp_path, monkeypatch,
                                                                                           caplog):
    """A full disk cuts a write short (os.write returns fewer bytes, no error): the cut line was fsync'ed and its
    first commit answered as on disk, and the next line appended joined it -- neither read back at a start (one
    ERROR "do not read"), both consumers starting over by their consume-from policy. Now a short write is an
    error to its waiters and the file is cut back to its last whole line, so the next append reads whole."""
    from broker.store import offset_journal
    real_write, cut = os.write, []

    def full_disk_write(fd, data):
        if bytes(data[:4]) == b"[2, ":      # (the journal's second line; any other write as it is)
            cut.append(len(data))
            return real_write(fd, data[:len(data) // 2])        # what fitted
        if len(cut) == 1:
            cut.append(len(data))
            raise OSError(errno.ENOSPC, "No space left on device")     # the rest: none
        return real_write(fd, data)

    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    await offsets.open()
    await offsets.commit_first("g", "T", 0, 5, None)
    monkeypatch.setattr(offset_journal.os, "write", full_disk_write)
    with pytest.raises(OSError):
        await offsets.commit_first("g", "T", 1, 6, None)
    await offsets.commit_first("g", "T", 2, 7, None)
    assert len(cut) == 2
    assert [line[:5] for line in _journal_lines(tmp_path)] == [[1, "T", "g", 0, 5], [3, "T", "g", 2, 7]]
    killed = ConsumerOffsets(str(tmp_path))                   # (no close: as a kill -9)
    assert killed.of("g", "T") == {0: 5, 2: 7}
    assert not [r for r in caplog.records if r.levelname == "ERROR" and "do not read" in r.getMessage()]
    await offsets.close()


@bounded(10)
async def test_a_damaged_journal_line_said_at_a_start_is_dropped_by_the_next_save(tmp_path, caplog):
    """A line that does not read, said at ERROR at the start, was kept by every trim: said again at every start for
    good (its offset was never read, and the table holds all the rest), and the file never trimmed empty."""
    config = tmp_path / "config"
    config.mkdir()
    (config / "consumerOffset.json.firsts").write_text('[1, "T", "g", 0, 5, null]\nnot json\n')
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    await offsets.open()
    assert [r for r in caplog.records if r.levelname == "ERROR" and "do not read" in r.getMessage()]
    await offsets.saved()
    await offsets.close()
    caplog.clear()
    assert ConsumerOffsets(str(tmp_path)).of("g", "T") == {0: 5}
    assert not [r for r in caplog.records if r.levelname == "ERROR" and "do not read" in r.getMessage()]
    assert (config / "consumerOffset.json.firsts").read_bytes() == b""


@bounded(10)
async def test_a_save_held_by_a_hung_journal_append_is_said_hung_as_a_hung_write(tmp_path, caplog):
    """A save trims the first offsets' journal after its write, behind the journal's lock: held by an append that
    hung (a stopped NFS), the trim waited for good, outside the time a save is watched for a hang -- never said hung
    (no gauge, no ERROR), every caller of ``saved`` (an admin's move) unanswered though its table was on disk.
    Watched as its write now."""
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    offsets.write_hung_s = 0.2
    await offsets.open()
    await offsets.commit_first("g", "T", 0, 5, None)
    await offsets.saved()                       # (the next save trims that line: both copies hold it)
    offsets._firsts._file_lock.acquire()        # as an append hung on the journal's thread holds it
    try:
        offsets.commit("g", "T", 0, 6)
        await offsets.saved()           # (the table is on disk: answered once the trim behind it is said hung)
        assert offsets.write_hung and "consumer offsets: a write has not ended" in caplog.text
        assert ConsumerOffsets(str(tmp_path)).get("g", "T", 0) == 6
    finally:
        offsets._firsts._file_lock.release()
    while offsets.write_hung:           # the trim goes on once the append ends
        await asyncio.sleep(0.01)
    await offsets.close()


@bounded(10)
async def test_a_first_offset_survives_a_start_from_the_previous_copy_of_a_damaged_table(tmp_path, caplog):
    """A damaged table is read from its previous copy (.bak, one save older: "groups may see a few messages
    again"). Each save trimmed the journal's lines its own table held, so a first offset committed between the two
    saves was in neither file: the group had no offset there and started by its consume-from policy (at the end:
    the messages sent meanwhile passed over). A save trims only the lines the previous copy holds too."""
    offsets = ConsumerOffsets(str(tmp_path), persist_interval_s=3600)
    await offsets.open()
    await offsets.commit_first("g", "T", 0, 5, None)
    await offsets.saved()
    await offsets.commit_first("g", "T", 1, 6, None)
    offsets.commit("g", "T", 0, 7)
    await offsets.saved()
    await offsets.commit_first("g", "T", 2, 8, None)
    (tmp_path / "config" / "consumerOffset.json").write_text("{damaged")          # (no close: as a kill -9)
    again = ConsumerOffsets(str(tmp_path))
    assert again.of("g", "T") == {0: 5, 1: 6, 2: 8}
    await offsets.close()
