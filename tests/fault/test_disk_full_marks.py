"""A full disk at the marks and metadata the newer features write beside the store: the write refused by
ENOSPC is said, tried again once there is room, and nothing it vouches for comes back wrong after a restart.

The store runs on its own tiny tmpfs, filled to the last page by a ballast file. Mounting needs root;
elsewhere the tests are skipped and say why.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import types

import pytest

from broker import live_config
from broker.ha.sync import SlaveSync
from broker.kv_config import KvConfig
from broker.processors.kv import put_kv_config
from broker.processors.ops import update_and_create_subscription_group
from broker.processors.query import query_message
from broker.store import MessageStore, PutRequest, StoreConfig
from broker.store.index import IndexService
from broker.store.offsets import ConsumerOffsets
from broker.subscriptions import SubscriptionGroups
from protocol.admin_bodies import encode_consumer_offsets
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.connection import open_connection
from protocol.message import decode_records
from tests.fault.test_transactions_crash import Listener, _listed
from tests.support.broker_process import BrokerProcess
from tests.support.bounded import bounded
from tests.support.tmpfs import tmpfs

CFG = StoreConfig(segment_size=1 << 20, cq_units_per_file=64)


@pytest.fixture
def tiny_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "4m") as mount:
        yield mount


def _fill(path, bound: int = 2048, mode: str = "wb") -> None:
    """Write zeros to ``path`` until the disk is full to the last page (``bound`` pages at most); ``mode="ab"``
    tops an existing ballast up, taking back whatever the disk freed since."""
    with open(path, mode, buffering=0) as f:
        for _ in range(bound):
            try:
                f.write(bytes(4096))
            except OSError:
                return
    raise AssertionError("the disk never filled")


def _req(i: int) -> PutRequest:
    return PutRequest.build("T", bytes([i]) * 200, queue_id=0)


@bounded(30)
async def test_a_topic_deleted_on_a_full_disk_stays_deleted_after_a_restart(tiny_disk, caplog):
    """The deleted-topic mark did not fit; the delete went on (its queue files removed, which freed room) but
    the mark was never tried again: the next start indexed the topic's old records again and served them, with
    only an ERROR from the delete to say it might. Now the mark is written once the queue files are gone."""
    store_dir = str(tiny_disk / "store")
    store = MessageStore(store_dir, CFG)
    await store.open()
    assert all(r.ok for r in [await store.put(_req(i)) for i in range(100)])
    _fill(tiny_disk / "ballast")
    with caplog.at_level(logging.WARNING, logger="txmq.store"):
        assert await store.delete_topic("T") == 1
    assert any("mark written" in r.getMessage() and "No space" in r.getMessage() for r in caplog.records), \
        "the mark was not refused at first: the disk was not full"
    await store.close()
    os.unlink(tiny_disk / "ballast")
    store = MessageStore(store_dir, CFG)
    await store.open()
    try:
        assert ("T", 0) not in store.queues(), "the deleted topic's old records were indexed again"
    finally:
        await store.close()


def _slave_of_a_master_with_cg_stopped(tiny_disk, tmp_path, master_away=lambda: False):
    """A slave's sync, its files in tiny_disk/slave, registered with a master (faked) whose group CG is stopped
    (consumeEnable false): the master answers with no offsets and its groups, refusing the connection while
    master_away() is true. Returns the sync and the slave's directory."""
    master = SubscriptionGroups(str(tmp_path / "master"), clock=lambda: 1)
    master.update({"groupName": "CG", "consumeEnable": False})
    slave_dir = tiny_disk / "slave"
    slave_dir.mkdir()
    sync = SlaveSync(ConsumerOffsets(str(slave_dir)), 10.0)
    sync.subscriptions = SubscriptionGroups(str(slave_dir), clock=lambda: 1)
    sync.on_registered("ns", types.SimpleNamespace(ext_fields={"masterAddr": "127.0.0.1:10911"}))

    async def request(addr, cmd, timeout):
        if master_away():
            raise ConnectionRefusedError("the master is away")
        if cmd.code == RequestCode.GET_ALL_CONSUMER_OFFSET:
            return cmd.response(ResponseCode.SUCCESS, body=encode_consumer_offsets([]))
        return cmd.response(ResponseCode.SUCCESS, body=master.encode())
    sync.pool.request = request
    return sync, slave_dir


@bounded(10)
async def test_a_slaves_copy_of_the_groups_refused_by_a_full_disk_is_saved_once_there_is_room(tiny_disk, tmp_path):
    """The slave took its master's subscription groups but could not write them: the next copy was the same (no
    change, no write), so the file stayed the old one for good -- a slave restarted while its master was away
    read the stale groups (a group stopped with consumeEnable false consumed again) -- and the next sync said
    the copies worked again. Now the write is tried at each sync until it is done."""
    sync, slave_dir = _slave_of_a_master_with_cg_stopped(tiny_disk, tmp_path)
    try:
        _fill(tiny_disk / "ballast")
        refused = await sync.sync_once()
        assert SubscriptionGroups(str(slave_dir), clock=lambda: 1).consume_enabled("CG"), \
            "the groups' file was written on a full disk"
        os.unlink(tiny_disk / "ballast")
        again = await sync.sync_once()
    finally:
        await sync.close()
        await sync.subscriptions.close()        # (its retry of the refused save: ended, as the broker's stop does)
    assert not SubscriptionGroups(str(slave_dir), clock=lambda: 1).consume_enabled("CG"), \
        "the slave's groups file kept the stale copy once there was room"
    assert (refused, again) == (False, True)        # a copy not saved is no sync done


@bounded(10)
async def test_a_slaves_copy_of_the_groups_refused_by_a_full_disk_is_saved_while_its_master_is_away(tiny_disk,
                                                                                                   tmp_path):
    """Written again only at each sync, the copy waited for the master: a master away once the disk had room
    (the case the copy is for) left the file stale, and a slave stopped then read the stale groups at its next
    start (a group stopped with consumeEnable false consumed again). It is retried as any refused save: every
    5 s by itself, and once more at stop."""
    away = False
    sync, slave_dir = _slave_of_a_master_with_cg_stopped(tiny_disk, tmp_path, master_away=lambda: away)
    subs = sync.subscriptions
    try:
        _fill(tiny_disk / "ballast")
        assert not await sync.sync_once()
        away = True
        os.unlink(tiny_disk / "ballast")
        assert not await sync.sync_once()
    finally:
        await sync.close()
        await subs.close()          # the broker stops (server.stop closes the subscription groups)
    assert not SubscriptionGroups(str(slave_dir), clock=lambda: 1).consume_enabled("CG"), \
        "the slave stopped with its groups file stale"


class _Said(logging.Handler):
    """An event set when a record saying ``words`` is logged."""

    def __init__(self, words: str):
        super().__init__()
        self.words, self.event = words, asyncio.Event()

    def emit(self, record):
        if self.words in record.getMessage():
            self.event.set()


def _set_group(disk):
    """A group stopped (consumeEnable false): (table, a context, its handler and request, whether the file says
    so, the table's logger)."""
    subs = SubscriptionGroups(str(disk / "config"), clock=lambda: 1)
    cmd = RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
                                  body=json.dumps({"groupName": "CG", "consumeEnable": False}).encode())
    saved = lambda: not SubscriptionGroups(str(disk / "config"), clock=lambda: 1).consume_enabled("CG")  # noqa: E731
    return subs, types.SimpleNamespace(subscriptions=subs, topics=types.SimpleNamespace(topics={}), acl=None,
                                       limits=types.SimpleNamespace(may_add_group=lambda *_: None),
                                       config=types.SimpleNamespace(broker_role="ASYNC_MASTER")), \
        update_and_create_subscription_group, cmd, saved, logging.getLogger("txmq.subscriptions")


def _set_kv(disk):
    """An order config set (updateOrderConf): as _set_group."""
    path = str(disk / "config" / "kvConfig.json")
    kv = KvConfig(path)
    cmd = RemotingCommand.request(RequestCode.PUT_KV_CONFIG, ext_fields={
        "namespace": "ORDER_TOPIC_CONFIG", "key": "Orders", "value": "broker-a:8"})
    saved = lambda: KvConfig(path).get("ORDER_TOPIC_CONFIG", "Orders") == "broker-a:8"  # noqa: E731
    return kv, types.SimpleNamespace(kv=kv), put_kv_config, cmd, saved, logging.getLogger("txmq.kvconfig")


@bounded(20)
@pytest.mark.parametrize("change", [_set_group, _set_kv], ids=["subscription-group", "kv-config"])
async def test_a_config_change_on_a_full_disk_is_saved_once_there_is_room(tiny_disk, caplog, change):
    """updateSubGroup or updateKvConfig on a full disk was answered SYSTEM_ERROR "... but not saved" (for a group
    with nothing in the broker's log), and the change lived only in memory until some later change was saved: a
    restart in between undid it (a group stopped with consumeEnable false consumed again). Now the failure is
    logged and the file written again once there is room."""
    (tiny_disk / "config").mkdir()
    table, ctx, handler, cmd, saved, said_by = change(tiny_disk)
    table.retry_write_s = 0.01
    said = _Said("written again")
    said_by.addHandler(said)
    try:
        _fill(tiny_disk / "ballast")
        with caplog.at_level(logging.ERROR, logger=said_by.name):
            resp = await handler(ctx, types.SimpleNamespace(peer=("127.0.0.1", 50000)), cmd)
        assert resp.code == ResponseCode.SYSTEM_ERROR and "not saved" in resp.remark
        assert not saved(), "written on a full disk"
        assert any("not written" in r.getMessage() and "No space" in r.getMessage() for r in caplog.records)
        os.unlink(tiny_disk / "ballast")
        await said.event.wait()
    finally:
        said_by.removeHandler(said)
        await table.close()
    assert saved()


async def _request(broker, code, fields=None, body=b""):
    host, _, port = broker.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    try:
        return await conn.request(RemotingCommand.request(code, fields, body), 5.0)
    finally:
        conn.close()


async def _logged(broker, words: str) -> None:
    """Until the broker's log says ``words`` (it is another process: its log is the event to wait for). Polled for
    progress, bounded by the test alone (a count of polls is a clock a loaded machine can outlast); a broker that
    exited is said at once, with its log."""
    while words not in broker.log():
        if broker.proc.poll() is not None:
            raise AssertionError(f"the broker never logged {words!r}:\n{broker.log()}")
        await asyncio.sleep(0.05)


@pytest.mark.slow
@bounded(90)
async def test_a_broker_saves_a_group_set_on_a_full_disk_and_a_kill_does_not_undo_it(tmp_path):
    """A real broker, its store on a full tmpfs: updateSubGroup is refused saving (SYSTEM_ERROR), the space comes
    back, the broker writes the file by itself (no restart, no other change), and a kill -9 then a start keep the
    group stopped (consumeEnable false: its pulls refused NO_PERMISSION)."""
    flags = ("--segment-size", str(4 << 20), "--max-message-size", str(256 << 10), "--metrics-snapshot-interval-s", "0")
    with tmpfs(tmp_path / "disk", "48m") as store:
        broker = BrokerProcess(store, *flags).start()
        try:
            _fill(store / "ballast", bound=48 * 256)
            resp = await _request(broker, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP,
                                  body=json.dumps({"groupName": "CG_off", "consumeEnable": False}).encode())
            assert resp.code == ResponseCode.SYSTEM_ERROR and "not saved" in resp.remark, resp.remark
            os.unlink(store / "ballast")
            # (its own line: "checkpoint written again" and the like may come first, the groups not yet written)
            await _logged(broker, "subscriptionGroup.json written again")
            broker.kill()
            broker = BrokerProcess(store, *flags).start()
            pull = await _request(broker, RequestCode.PULL_MESSAGE, {
                "consumerGroup": "CG_off", "topic": "Any", "queueId": 0, "queueOffset": 0, "maxMsgNums": 1,
                "sysFlag": 0, "commitOffset": 0, "suspendTimeoutMillis": 0, "subVersion": 0})
            assert pull.code == ResponseCode.NO_PERMISSION, (pull.code, pull.remark)
        finally:
            broker.stop()


@bounded(30)
@pytest.mark.parametrize("slots", [64, 65], ids=["entries-start-a-page", "an-entry-across-a-page"])
async def test_the_index_a_full_disk_stopped_catches_up_by_itself_once_there_is_room(tmp_path, slots):
    """The message index on a real full disk (its own tmpfs; the log beside it has room): its entry pages cannot
    be allocated, indexing stops (txmq_index_failed) and, once the ballast goes, resumes and finds the keys of
    every message stored meanwhile, without a restart.

    With 65 slots an entry lies across a page boundary: the disk full, its write is cut short (pwrite returns
    the bytes that fit, no error), and the entry was counted all the same -- its key lost for good, and the
    older keys of its slot behind it (the chain runs through it)."""
    store_dir = str(tmp_path / "store")
    store = MessageStore(store_dir, CFG)
    await store.open()
    with tmpfs(tmp_path / "store" / "index", "1m") as disk:
        svc = IndexService(store_dir, segment_size=CFG.segment_size, slots=slots, entries=200_000)
        svc.resume_every_s = 3600       # no resume while the disk is full: the failure stays to be seen
        store.add_dispatch_listener(svc.on_dispatch)
        await svc.open(store.min_physical_offset, store.max_physical_offset)
        try:
            assert (await store.put(PutRequest.build("T", b"z", properties={"KEYS": "first"}))).ok
            await svc.query("T", "first", 1, 0, 2**62)        # its file made
            _fill(disk / "ballast", bound=256)
            stored = []
            for i in range(2000):       # a bound: an entry page (204 entries) fills in a few hundred sends
                stored.append(await store.put(PutRequest.build("T", b"z", properties={"KEYS": f"k{i}"})))
                await svc.query("T", "first", 1, 0, 2**62)    # a turn of the index thread
                if svc.failed is not None:
                    break
            assert svc.failed is not None and "No space" in svc.failed, "the index never met the full disk"
            os.unlink(disk / "ballast")
            svc.resume_every_s = 0      # at the next turn of the index thread (the default paces it by 10 s)
            stored.append(await store.put(PutRequest.build("T", b"z", properties={"KEYS": "after"})))
            for _ in range(10):         # each query a turn of the index thread: the resume, then its catch-up
                if (await svc.query("T", "after", 64, 0, 2**62))[0]:
                    break
            assert svc.failed is None
            for i, res in enumerate(stored[:-1]):
                assert (await svc.query("T", f"k{i}", 64, 0, 2**62))[0] == [res.physical_offset]
        finally:
            await svc.close()
            await store.close()


@bounded(30)
async def test_the_index_slot_table_never_takes_the_room_the_store_is_refused_writes_without(tmp_path):
    """The index allocates a file's whole slot table (4 bytes a slot: 20 MB by default) at its first entry. On a
    disk at 62% it took a quarter of the disk at once (to 93%): the store, above its refuse ratio (0.90), refused every
    send for an index table of its derived data. Now the table is allocated only when the disk stays below the
    refuse ratio with it; otherwise indexing stops as on a full disk (said, txmq_index_failed) and resumes, with
    no key lost, once there is room."""
    with tmpfs(tmp_path / "disk", "16m") as disk:
        store_dir = str(disk / "store")
        store = MessageStore(store_dir, CFG)
        await store.open()
        svc = IndexService(store_dir, segment_size=CFG.segment_size, slots=1 << 20, entries=200_000,
                           refuse_ratio=store.disk.refuse_ratio)
        svc.resume_every_s = 3600       # no resume while the disk is full: the failure stays to be seen
        store.add_dispatch_listener(svc.on_dispatch)
        await svc.open(store.min_physical_offset, store.max_physical_offset)
        try:
            st = os.statvfs(disk)
            total = st.f_blocks * st.f_frsize
            (disk / "ballast").write_bytes(bytes(int(0.62 * total) - (st.f_blocks - st.f_bfree) * st.f_frsize))
            first = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "first"}))
            assert first.ok
            await svc.query("T", "first", 1, 0, 2**62)        # the index's first entry: its slot table
            store.disk.probe()
            assert store.disk.ratio < store.disk.refuse_ratio, f"the index took the disk to {store.disk.ratio:.0%}"
            second = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "second"}))
            assert second.ok, "a send refused for the index's slot table"
            assert svc.stopped and "slot table" in svc.failed
            os.unlink(disk / "ballast")
            svc.resume_every_s = 0
            for _ in range(10):         # each query a turn of the index thread: the resume, then its catch-up
                if (await svc.query("T", "second", 64, 0, 2**62))[0]:
                    break
            assert not svc.stopped
            for key, res in (("first", first), ("second", second)):
                assert (await svc.query("T", key, 64, 0, 2**62))[0] == [res.physical_offset]
        finally:
            await svc.close()
            await store.close()


@bounded(20)
async def test_a_refused_groups_save_leaves_no_partial_file_holding_the_room_a_broker_permission_needs(tiny_disk):
    """The groups' file (its save retried, retried_save.py) and brokerConfig.json (written before SUCCESS, never
    retried) share the config directory's disk. A groups' save a nearly full disk cut short left its partial
    ``.tmp`` there, holding every page that was free: the next updateBrokerConfig brokerPermission, a few bytes,
    was refused ("Nothing was changed") on a disk with room for it, and so was every other save of the directory
    until the groups' file fitted."""
    config = tiny_disk / "config"
    config.mkdir()
    subs = SubscriptionGroups(str(config), clock=lambda: 1)
    for i in range(2000):           # a table of several hundred KiB, more than the room left below
        subs.update({"groupName": f"CG_{i:04d}", "retryMaxTimes": 3})
    room = tiny_disk / "room"
    room.write_bytes(bytes(64 * 1024))
    _fill(tiny_disk / "ballast")
    os.unlink(room)                 # 64 KiB free: a few bytes fit, the groups' table does not
    try:
        with pytest.raises(OSError):
            await subs.save()
        left = [p.name for p in config.iterdir() if p.name.endswith(".tmp")]
        assert left == [], f"a refused save left {left} on the disk"
        live_config.write(str(config), {"brokerPermission": 4})     # (OSError without the fix: No space left)
    finally:
        subs._retry.cancel()        # (not close(): its last try would write the table once the test is over)
        subs._retry = None
    assert live_config.load(str(config)) == {"brokerPermission": 4}


@pytest.mark.slow
@bounded(120)
async def test_a_transaction_snapshot_a_full_disk_refused_leaves_no_partial_file_behind(tmp_path):
    """A real broker holding 4,000 undecided transactions is stopped with 64 KiB free on its tmpfs: its snapshot
    (about 100 KiB) does not fit. The partial snapshot.json.tmp was left there holding the last free pages for good
    (61,440 bytes, 0 free after the stop; nothing removed it until a later snapshot fitted). Now it is gone and
    the room with it; once the ballast goes, the next start still lists every transaction and its stop writes
    the snapshot whole.

    No transaction may be checked meanwhile, however slow the machine: checked, the listener's answer decided it
    (a check interval alone did not stop it: the first check is due at the immunity, 6 s after the half, and a
    loaded machine took longer than that to send 4,000), and fewer undecided made both the listing short (3,600
    of 4,000, each missing one a COMMIT op record, not a loss) and the snapshot small enough to fit (no "not
    written at stop"). The immunity is an hour, the listener answers UNKNOW, and the count is taken before the
    stop too, so a check that slipped in says so there."""
    flags = ("--segment-size", str(4 << 20), "--max-message-size", str(256 << 10), "--metrics-snapshot-interval-s", "0",
             "--transaction-snapshot-interval-s", "3600", "--transaction-check-interval-ms", "600000",
             "--transaction-timeout-ms", "3600000")
    halves = 4000
    with tmpfs(tmp_path / "disk", "48m") as store:
        broker = BrokerProcess(store, *flags).start()
        try:
            # (a send's 3 s default timed out on a loaded machine, 200 in flight: MaybeStoredError, not the subject)
            producer = TransactionProducer(broker.namesrv, "PG_snap", Listener(S.UNKNOW), send_timeout=30.0)
            await producer.start()
            for first in range(0, halves, 200):
                await asyncio.gather(*(producer.send_in_transaction("TxSnap", b"%d" % n)
                                       for n in range(first, first + 200)))
            await producer.shutdown()
            assert (await _listed(broker))["total"] == halves, "a transaction was decided before the stop"
            await _indexed(broker)
            _fill(store / "ballast", bound=48 * 256)
            os.truncate(store / "ballast", os.path.getsize(store / "ballast") - (64 << 10))
            assert broker.stop() == 0
            assert "transaction snapshot not written at stop" in broker.log()
            assert not (store / "transactions" / "snapshot.json.tmp").exists()
            # (the partial file took every free page, 0 left; the stop's own small writes -- the checkpoint, the
            # config files, the queue list if its first write comes after the ballast -- take a page each)
            assert _free(store) >= 32 << 10, _free(store)

            os.unlink(store / "ballast")
            broker = BrokerProcess(store, *flags).start()
            assert (await _listed(broker))["total"] == halves
            assert broker.stop() == 0
            snapshot = json.loads((store / "transactions" / "snapshot.json").read_bytes())
            assert len(snapshot["pending"]) == halves
            broker = BrokerProcess(store, *flags).start()
            assert (await _listed(broker))["total"] == halves
        finally:
            broker.stop()


async def _indexed(broker) -> None:
    """Until the broker's index holds every record acknowledged so far: a query is taken by its index thread only
    after every record dispatched before it (index.py). Entries it had still to write took the room a test left
    free after filling the disk: 4,000 halves' entries, the thread behind by a few hundred on a loaded machine,
    used 20 KiB of it at the stop (45,056 bytes free where 57,344 are on an idle one)."""
    resp = await _request(broker, RequestCode.QUERY_MESSAGE, {
        "topic": "TxSnap", "key": "none", "maxNum": 1, "beginTimestamp": 0, "endTimestamp": 2**63 - 1})
    assert resp.code in (ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND), (resp.code, resp.remark)


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@bounded(30)
async def test_the_index_slot_table_leaves_the_commit_log_its_next_segment_below_the_force_clean_ratio(tmp_path):
    """The slot table was allocated whenever the disk stayed below the force-clean ratio (0.85) with it, to the last
    byte: in test_a_full_disk_is_refused_survived_and_resumed a restart's index took its 48 MiB disk to 84%, the
    commit log's next segment took it to 93% and retention removed the two oldest segments (433 acknowledged
    messages, none expired) for a table of derived data. The table now leaves the next segment room below the
    ratio; otherwise indexing stops as on a full disk and resumes once there is room."""
    with tmpfs(tmp_path / "disk", "16m") as disk:
        store_dir = str(disk / "store")
        store = MessageStore(store_dir, CFG)
        await store.open()
        svc = IndexService(store_dir, segment_size=CFG.segment_size, slots=1 << 20, entries=200_000,
                           refuse_ratio=0.85)
        svc.resume_every_s = 3600       # no resume meanwhile: the refusal stays to be seen
        store.add_dispatch_listener(svc.on_dispatch)
        await svc.open(store.min_physical_offset, store.max_physical_offset)
        try:
            assert (await store.put(PutRequest.build("T", b"z"))).ok     # the log's first segment, no key
            st = os.statvfs(disk)
            total = st.f_blocks * st.f_frsize
            table = 4 << 20                 # 1 << 20 slots: a quarter of the disk; a segment is a sixteenth
            (disk / "ballast").write_bytes(bytes(int(0.82 * total) - table - (st.f_blocks - st.f_bfree) * st.f_frsize))
            first = await store.put(PutRequest.build("T", b"z", properties={"KEYS": "first"}))
            assert first.ok
            await svc.query("T", "first", 1, 0, 2**62)        # the index's first entry: its slot table
            segments = len(os.listdir(os.path.join(store_dir, "commitlog")))
            for _ in range(64):             # into the log's next segment: a bound, the roll is what ends it
                assert (await store.put(PutRequest.build("T", bytes(200 << 10)))).ok
                if len(os.listdir(os.path.join(store_dir, "commitlog"))) > segments:
                    break
            else:
                raise AssertionError("the commit log never rolled")
            store.disk.probe()
            assert store.disk.ratio < 0.85, f"the index's table and the next segment took the disk to " \
                                            f"{store.disk.ratio:.0%}: retention would remove young segments"
            assert svc.stopped and "next segment" in svc.failed
            # A query by key meanwhile misses the newest messages: the answer says so, not "not found" alone
            # (QUERY_NOT_FOUND "maybe time range not correct", and `admin query-key` said "0 message(s)").
            cmd = RemotingCommand.request(RequestCode.QUERY_MESSAGE, {
                "topic": "T", "key": "first", "maxNum": 32, "beginTimestamp": 0, "endTimestamp": 2**62})
            resp = await query_message(types.SimpleNamespace(index=svc, store=store), None, cmd)
            assert resp.code == ResponseCode.QUERY_NOT_FOUND, (resp.code, resp.remark)
            assert "indexing is stopped" in (resp.remark or "") and str(svc.covered) in resp.remark, resp.remark
        finally:
            await svc.close()
            await store.close()


@pytest.mark.slow
@bounded(90)
async def test_a_slave_whose_disk_is_full_pauses_replication_once_and_resumes_by_itself(tmp_path):
    """A slave on a full tmpfs refused its master's bytes at each session's first transfer and reconnected every
    second for as long as the disk stayed full: a WARNING and two INFO lines a second on the slave, three on the
    master, the master sending its tail again each time. Now it says once that it pauses, holds the master back
    on the link it keeps until there is room, and then says once that it resumes and copies everything the master
    took meanwhile."""
    from tests.integration.test_replication import _log_end

    flags = ("--segment-size", str(4 << 20), "--max-message-size", str(256 << 10), "--metrics-snapshot-interval-s", "0")
    master = BrokerProcess(tmp_path / "master", *flags, "--broker-role", "ASYNC_MASTER", "--ha-port", "0").start()
    try:
        with tmpfs(tmp_path / "disk", "48m") as store:
            slave = BrokerProcess(store, *flags, "--broker-role", "SLAVE", "--broker-id", "1",
                                  "--ha-master-addr", master.ha).start()
            try:
                producer = Producer(master.namesrv, "PG_full_slave")
                await producer.start()
                await producer.send("FullSlave", b"before")
                # The disk stays full until the test frees it: each turn takes back what the slave freed (its
                # index thread's slot table allocation, racing the first fill and undone by its ENOSPC, gave back
                # 6 MiB on a slow CI run; the pressure cleaner frees a segment) so usage never sits below the
                # refusal ratio with the slave appending into the room.
                top_up = functools.partial(_fill, store / "ballast", bound=48 * 256, mode="ab")
                top_up()
                # Sends until the slave has said it paused, or has stopped three sessions (reconnecting for ever)
                while "paused: this slave's disk is" not in slave.log() and slave.log().count(" stopped: ") < 3:
                    assert slave.proc.poll() is None, slave.log()
                    await producer.send("FullSlave", b"x" * 10_000)
                    top_up()
                    await asyncio.sleep(0.05)
                assert slave.log().count(" stopped: ") <= 1, slave.log()     # a transfer queued as it filled
                for _ in range(100):      # the master goes on taking sends while the slave waits
                    await producer.send("FullSlave", b"x" * 10_000)
                    top_up()
                sessions = master.log().count(" connected")
                os.unlink(store / "ballast")
                await _logged(slave, "resumes: this slave's disk has room again")
                end = await _log_end(master.broker)
                while await _log_end(slave.broker) < end:
                    await asyncio.sleep(0.05)
                await producer.shutdown()
                assert slave.log().count(" stopped: ") <= 1, slave.log()
                assert slave.log().count("paused: this slave's disk is") == 1, slave.log()
                assert slave.log().count("resumes: this slave's disk has room again") == 1, slave.log()
                assert sessions <= 2, master.log()  # the first, and the one the refusal ended
            finally:
                slave.stop()
    finally:
        master.stop()


@pytest.mark.slow
@bounded(90)
async def test_the_index_slot_table_never_takes_the_disk_to_the_ratio_that_removes_young_segments(tmp_path):
    """A real broker: the slot table was allocated whenever the disk stayed below disk_refuse_ratio (0.90) with it,
    but at disk_force_clean_ratio (0.85) retention removes the oldest segments whatever their age (undecided halves
    dead-lettered first). A disk at 70% took a new index file's table (17% of it) to 87%, and retention removed the
    segment holding a message stored a moment before: its QUERY_MESSAGE answered NOT FOUND, for derived data. The
    table is now allocated only below the lower of the two ratios; otherwise indexing stops as on a full disk."""
    flags = ("--segment-size", str(1 << 20), "--max-message-size", str(256 << 10), "--metrics-snapshot-interval-s",
             "0", "--index-hash-slots", "700000", "--index-max-entries", "64", "--disk-clean-interval-s", "0.1")
    with tmpfs(tmp_path / "disk", "16m") as store:
        broker = BrokerProcess(store, *flags).start()
        producer = await Producer(broker.namesrv, "PG_room", send_timeout=10.0).start()
        try:
            old = await producer.send("T", b"old", keys="old")      # the first index file and its table, disk near empty
            for _ in range(7):          # (incompressible) into the log's second segment: the first may go
                await producer.send("T", os.urandom(200 << 10))
            st = os.statvfs(store)
            used, total = (st.f_blocks - st.f_bfree) * st.f_frsize, (st.f_blocks - st.f_bfree + st.f_bavail) * st.f_frsize
            (store / "ballast").write_bytes(bytes(int(0.70 * total) - used))    # 70% + a 2.8 MB table: 86.7%
            begun = broker.log().count("; new file ")
            for i in range(2000):       # until a new index file begins (64 entries a file): a bound, not a clock
                await producer.send("T", b"new", keys=f"new-{i}")
                if broker.log().count("; new file ") > begun:
                    break
            while "slot table needs" not in broker.log() and "removing segment" not in broker.log():
                if broker.proc.poll() is not None:
                    raise AssertionError(f"the broker exited:\n{broker.log()}")
                await asyncio.sleep(0.05)       # another process: its log is the event to wait for
            assert "removing segment" not in broker.log(), "retention removed a young segment for the index's table"
            resp = await _request(broker, RequestCode.QUERY_MESSAGE, {
                "topic": "T", "key": "old", "maxNum": 32, "beginTimestamp": 0, "endTimestamp": 2**63 - 1})
            assert resp.code == ResponseCode.SUCCESS, (resp.code, resp.remark)
            assert [m.msg_id for m in decode_records(resp.body_bytes())] == [old.msg_id]
        finally:
            await producer.shutdown()
            broker.stop()
