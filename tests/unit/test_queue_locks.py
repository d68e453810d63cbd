"""LOCK_BATCH_MQ / UNLOCK_BATCH_MQ on a broker clock we drive: a queue lock is exclusive within a group,
renewed by its holder, and free for another consumer only after queue_lock_max_live_ms (RocketMQ's 60 s)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from broker.clients import ClientRegistry
from broker.config import BrokerConfig
from broker.processors.client import lock_batch_mq, unlock_batch_mq
from broker.topics import TopicConfig
from protocol.codes import RequestCode as R
from protocol.command import RemotingCommand
from protocol.errors import HeaderError
from tests.support.bounded import other_client

MQ = {"topic": "Orders", "brokerName": "broker-a", "queueId": 0}
_TOPICS = SimpleNamespace(topics={"Orders": TopicConfig("Orders", 4, 4)})


def _ctx():
    clock = SimpleNamespace(now=1_000_000)
    ctx = SimpleNamespace(config=BrokerConfig(), clock=lambda: clock.now, topics=_TOPICS,
                          limits=SimpleNamespace(refused=lambda reason, warning=None: None))
    ctx.clients = ClientRegistry(ctx.clock)
    return ctx, clock


def _call(handler, ctx, client_id, group="CG", mqs=(MQ,)):
    body = json.dumps({"consumerGroup": group, "clientId": client_id, "mqSet": list(mqs)}).encode()
    resp = handler(ctx, None, RemotingCommand.request(R.LOCK_BATCH_MQ, body=body))
    return json.loads(resp.body_bytes() or b"{}").get("lockOKMQSet")


def test_a_lock_is_exclusive_until_it_has_gone_unrenewed_for_60_s():
    ctx, clock = _ctx()
    assert ctx.config.queue_lock_max_live_ms == 60000
    assert _call(lock_batch_mq, ctx, "A") == [MQ]
    clock.now += 59_999
    assert _call(lock_batch_mq, ctx, "B") == []               # A may still be consuming
    assert _call(lock_batch_mq, ctx, "A") == [MQ]             # A renews: the 60 s start again
    clock.now += 60_000
    assert _call(lock_batch_mq, ctx, "B") == []
    clock.now += 1
    assert _call(lock_batch_mq, ctx, "B") == [MQ]             # A went quiet (crashed): B takes over
    assert _call(lock_batch_mq, ctx, "A") == []


def test_locks_are_per_group_and_only_the_holder_unlocks():
    ctx, clock = _ctx()
    assert _call(lock_batch_mq, ctx, "A") == [MQ]
    assert _call(lock_batch_mq, ctx, "B", group="OTHER") == [MQ]   # another group reads the queue on its own
    _call(unlock_batch_mq, ctx, "B")                               # B does not hold CG's lock: nothing changes
    assert _call(lock_batch_mq, ctx, "B") == []
    _call(unlock_batch_mq, ctx, "A")
    assert _call(lock_batch_mq, ctx, "B") == [MQ]                  # freed at once, no wait for expiry


def test_a_wall_clock_step_neither_frees_nor_pins_a_lock():
    """Locks were timed with the broker's wall clock: stepped forward, another consumer took a queue its holder
    was consuming (two consumers of one orderly queue); stepped back, a crashed holder's queue stayed locked
    until the clock caught up. They are timed with the client registry's monotonic clock."""
    from broker.context import monotonic_ms
    wall = SimpleNamespace(now=1_700_000_000_000)
    mono = SimpleNamespace(now=5_000)
    ctx = SimpleNamespace(config=BrokerConfig(), clock=lambda: wall.now, topics=_TOPICS)
    ctx.clients = ClientRegistry(lambda: mono.now)
    assert _call(lock_batch_mq, ctx, "A") == [MQ]
    wall.now += 3_600_000                                     # NTP steps the wall clock an hour ahead
    assert _call(lock_batch_mq, ctx, "B") == []
    wall.now -= 7_200_000                                     # ... and two hours back; A has crashed
    mono.now += 60_001
    assert _call(lock_batch_mq, ctx, "B") == [MQ]
    import time
    assert abs(monotonic_ms() - time.monotonic() * 1000) < 1000


def test_expired_locks_are_forgotten_not_kept_for_good():
    """An expired lock was only ever replaced, never removed: every lock of an orderly consumer that crashed,
    of a group that went away or of a queue no longer there stayed in memory for as long as the broker ran.
    They go once expired (nothing changes for anyone: an expired lock is free either way), by the next lock
    request at most once a lifetime, and by the housekeeping."""
    ctx, clock = _ctx()
    ttl = ctx.config.queue_lock_max_live_ms
    for i in range(200):                                      # orderly consumers come, lock and crash
        assert _call(lock_batch_mq, ctx, f"client-{i}", group=f"CG{i}") == [MQ]
    assert len(ctx.clients.locks) == 200
    clock.now += ttl // 2
    assert _call(lock_batch_mq, ctx, "live", group="CG-live") == [MQ]
    assert len(ctx.clients.locks) == 201                      # none has expired yet: all kept
    clock.now += ttl // 2 + 1
    assert _call(lock_batch_mq, ctx, "live", group="CG-live") == [MQ]
    assert set(ctx.clients.locks) == {("CG-live", "Orders", 0)}
    assert _call(lock_batch_mq, ctx, "B", group="CG7") == [MQ]     # the crashed holder's queue is free
    clock.now += ttl + 1
    assert ctx.clients.expire_locks(ttl) == 2                 # the housekeeping's sweep
    assert ctx.clients.locks == {}


def test_the_housekeeping_sweep_keeps_live_locks():
    ctx, clock = _ctx()
    ttl = ctx.config.queue_lock_max_live_ms
    assert _call(lock_batch_mq, ctx, "A") == [MQ]
    clock.now += ttl
    assert ctx.clients.expire_locks(ttl) == 0                 # exactly the lifetime: still A's
    assert _call(lock_batch_mq, ctx, "B") == []


def test_past_the_total_cap_new_locks_are_refused_renewals_are_not_and_expired_ones_make_room():
    """Groups cost nothing and a lock is kept 60 s, so clients rotating group names grew the table without
    bound. Past max_queue_locks a new lock is left out of lockOKMQSet (a stock orderly consumer treats the queue
    as not locked and asks again later); a lock held is still renewed, and expired locks are swept to make room."""
    import dataclasses
    ctx, clock = _ctx()
    ctx.config = dataclasses.replace(ctx.config, max_queue_locks=10, max_queue_locks_per_connection=1000)
    mqs = [dict(MQ, queueId=q) for q in range(4)]
    for i in range(2):
        assert _call(lock_batch_mq, ctx, "A", group=f"G{i}", mqs=mqs) == mqs
    assert _call(lock_batch_mq, ctx, "A", group="G2", mqs=mqs) == mqs[:2]       # 8 + 2 = the cap
    assert _call(lock_batch_mq, ctx, "B", group="G3", mqs=mqs) == []
    assert len(ctx.clients.locks) == 10
    clock.now += 30_000
    assert _call(lock_batch_mq, ctx, "A", group="G0", mqs=mqs) == mqs           # renewals go on
    clock.now += 30_001                                                         # G1, G2 expired; G0 not
    assert _call(lock_batch_mq, ctx, "B", group="G3", mqs=mqs) == mqs
    assert len(ctx.clients.locks) == 8


def test_one_connection_holds_at_most_its_share_and_unlocking_gives_it_back():
    import dataclasses
    ctx, clock = _ctx()
    ctx.config = dataclasses.replace(ctx.config, max_queue_locks=100, max_queue_locks_per_connection=3)
    mqs = [dict(MQ, queueId=q) for q in range(4)]
    conn_a, conn_b = object(), object()

    def call(conn, client_id, group, qs, handler=lock_batch_mq):
        body = json.dumps({"consumerGroup": group, "clientId": client_id, "mqSet": qs}).encode()
        resp = handler(ctx, conn, RemotingCommand.request(R.LOCK_BATCH_MQ, body=body))
        return json.loads(resp.body_bytes() or b"{}").get("lockOKMQSet")
    assert call(conn_a, "A", "G", mqs) == mqs[:3]
    assert call(conn_a, "A2", "H", mqs) == []                  # another client id on the same connection
    assert call(conn_b, "B", "H", mqs) == mqs[:3]              # another connection has its own share
    assert call(conn_a, "A", "G", mqs[:3]) == mqs[:3]          # renewals are not new locks
    call(conn_a, "A", "G", mqs[:1], unlock_batch_mq)
    assert call(conn_a, "A", "G", mqs[3:]) == mqs[3:]          # the unlocked one's room is taken again


class _Conn:
    def __init__(self, host: str, port: int):
        self.peer = (host, port)
        self.attributes = {}


def test_a_client_back_on_a_new_connection_renews_its_locks_at_max_queue_locks_per_host():
    """A client that reconnects (a network blip, its broker connection reset) renews its queue locks over the
    new connection: the address holds no more locks than before. Refused for max_queue_locks_per_host as if
    new, every orderly consumer of an address at the cap lost its queues until the old locks expired (60 s,
    consumption stopped) whenever its connection dropped."""
    clients = ClientRegistry(lambda: 0)
    old, new = _Conn("10.0.0.1", 1), _Conn("10.0.0.1", 2)
    caps = dict(now=0, max_live_ms=60_000, max_total=100, max_per_conn=100, max_per_host=2)
    assert clients.lock_queue(("CG", "Orders", 0), "A", old, **caps) is None
    assert clients.lock_queue(("CG", "Orders", 1), "A", old, **caps) is None
    assert clients.lock_queue(("CG", "Orders", 2), "B", new, **caps) == "max_queue_locks_per_host"
    for qid in (0, 1):                                      # A, reconnected, renews what it holds
        assert clients.lock_queue(("CG", "Orders", qid), "A", new, **caps) is None
    assert clients.lock_queue(("CG", "Orders", 2), "B", new, **caps) == "max_queue_locks_per_host"
    assert clients.lock_queue(("CG", "Orders", 2), "B", _Conn("10.0.0.2", 1), **caps) is None


def _large_call(handler, ctx, conn, client_id, mqs):
    body = json.dumps({"consumerGroup": "CG", "clientId": client_id, "mqSet": mqs}).encode()
    return handler(ctx, conn, RemotingCommand.request(R.LOCK_BATCH_MQ, body=body))


def test_a_large_lock_batch_is_read_and_locked_between_turns_and_answers_each_queue_once():
    """A LOCK_BATCH_MQ of a frame's worth of queues (15 MB, 250,000) was parsed and locked in one go: the loop held
    4.7 s (UNLOCK_BATCH_MQ 2.8 s), every other client's request waiting, and the answer listed each queue as often
    as asked (15 MB back for 1,024 queues; RocketMQ's mqSet is a Set). Both are done a slice of LOCK_SLICE queues
    at a time now, the loop running between, and each queue is locked and answered once."""
    big = TopicConfig("Big", 64, 64)
    mqs = [{"topic": "Big", "brokerName": "broker-a", "queueId": i % 64} for i in range(40_000)]

    async def run():
        ctx, _clock = _ctx()
        ctx.topics = SimpleNamespace(topics={"Big": big})
        conn = _Conn("10.0.0.1", 1)
        async with other_client() as turns:
            resp = await _large_call(lock_batch_mq, ctx, conn, "A", mqs)
        assert turns[0] >= 10                   # the loop turned between its slices (2,048 queues each)
        granted = json.loads(resp.body_bytes())["lockOKMQSet"]
        assert granted == mqs[:64] and len(ctx.clients.locks) == 64
        async with other_client() as turns:
            resp = await _large_call(unlock_batch_mq, ctx, conn, "A", mqs)
        assert resp.code == 0 and turns[0] >= 10 and ctx.clients.locks == {}
    asyncio.run(run())


def _lock_answer(body: str, pad: int):
    """The lock granted for ``body`` (as text, after ``pad`` spaces: past 64 KiB it is read a piece at a time)."""
    ctx, _clock = _ctx()
    cmd = RemotingCommand.request(R.LOCK_BATCH_MQ, body=(" " * pad + body).encode())

    async def run():
        result = lock_batch_mq(ctx, _Conn("10.0.0.1", 1), cmd)
        return result if isinstance(result, RemotingCommand) else await result
    return json.loads(asyncio.run(run()).body_bytes())["lockOKMQSet"]


@pytest.mark.parametrize("pad", [0, 70_000])
def test_a_lock_body_read_a_piece_at_a_time_is_taken_and_refused_as_json_loads_would(pad):
    """The large body's reader (each mqSet element on its own) takes and refuses what json.loads did."""
    good = ' { "clientId" : "A" , "mqSet" : [ {"topic": "Orders", "brokerName": "b", "queueId": 1} , ' \
           '{"topic": "Orders", "brokerName": "b", "queueId": 1}, {"queueId": 2, "topic": "Orders"} ] ,' \
           ' "consumerGroup": "CG", "x": {"mqSet": [1]} } '
    assert _lock_answer(good, pad) == [{"topic": "Orders", "brokerName": "b", "queueId": 1},
                                       {"queueId": 2, "topic": "Orders"}]
    assert _lock_answer('{"consumerGroup":"CG","clientId":"A","mqSet":[]}', pad) == []
    for bad in ('{"consumerGroup":"CG","clientId":"A","mqSet":[1]}', '{"consumerGroup":"CG","clientId":"A"',
                '{"consumerGroup":"CG","clientId":"A","mqSet":[{"queueId":true}]}', '[1]', '{"a":1}',
                '{"consumerGroup":"CG","clientId":"A","mqSet":[{}]} x', '{"consumerGroup":"CG" "clientId":"A"}',
                '{"consumerGroup":"CG","clientId":"A","mqSet":[{},]}', '{1:2}',
                '{"consumerGroup":"CG","clientId":"A","mqSet":7}'):
        with pytest.raises(HeaderError):
            _lock_answer(bad, pad)


def test_a_large_lock_batch_whose_connection_closed_takes_no_more_locks():
    """A lock batch still waiting for its turn, or between two slices, when its connection closes: its answer can
    never reach the client, which then does not know it holds the queues, and every other consumer of the group
    was kept off them for queue_lock_max_live_ms (60 s). Sliced, that window is the seconds a frame's worth of
    queues takes, and max_in_flight such requests queue behind one another: it stops at the next slice now."""
    big = TopicConfig("Big", 4096, 4096)
    mqs = [{"topic": "Big", "brokerName": "broker-a", "queueId": i % 4096} for i in range(40_000)]

    async def run():
        ctx, _clock = _ctx()
        ctx.topics = SimpleNamespace(topics={"Big": big})
        conn = _Conn("10.0.0.1", 1)
        conn.closed = asyncio.Event()
        first = _large_call(lock_batch_mq, ctx, conn, "A", mqs)
        behind = _large_call(lock_batch_mq, ctx, conn, "A", mqs[:10])     # pipelined: waits for its turn
        conn.closed.set()                   # the client went away with both read, neither answered
        assert await first is None and await behind is None
        assert len(ctx.clients.locks) == 0
    asyncio.run(run())


def test_two_clients_large_lock_batches_of_the_same_queues_interleaved_never_both_get_a_queue():
    """Sliced, two clients' lock batches of the same queues run side by side (RocketMQ's take each whole under
    one lock): a queue may go to either, never to both, and each lock is its holder's."""
    big = TopicConfig("Big", 8192, 8192)
    mqs = [{"topic": "Big", "brokerName": "broker-a", "queueId": i} for i in range(8192)]

    async def run():
        ctx, _clock = _ctx()
        ctx.topics = SimpleNamespace(topics={"Big": big})
        a, b = await asyncio.gather(_large_call(lock_batch_mq, ctx, _Conn("10.0.0.1", 1), "A", mqs),
                                    _large_call(lock_batch_mq, ctx, _Conn("10.0.0.2", 1), "B", mqs[::-1]))
        got = {c: {m["queueId"] for m in json.loads(r.body_bytes())["lockOKMQSet"]} for c, r in (("A", a), ("B", b))}
        assert not got["A"] & got["B"] and len(got["A"] | got["B"]) == 8192
        assert all(ctx.clients.locks[("CG", "Big", q)][0] == c for c, qs in got.items() for q in qs)
    asyncio.run(run())


def test_restored_locks_are_renewed_by_their_holder_taken_over_by_its_connection_and_lapse_for_others(tmp_path):
    """Locks saved by a previous run (queue_locks.LockFile) are held again at start as renewed then: another
    client is refused until they lapse, the holder renews them on its new connection (the restored entry counts
    against no address once taken over), and a damaged file starts with none (said at ERROR)."""
    from broker.queue_locks import LockFile
    saved = ClientRegistry(lambda: 0)
    caps = dict(max_live_ms=60_000, max_total=100, max_per_conn=100, max_per_host=1)
    assert saved.lock_queue(("CG", "Orders", 0), "A", _Conn("10.0.0.1", 1), now=0, **caps) is None
    lock_file = LockFile(str(tmp_path), saved)
    asyncio.run(lock_file.save())

    clock = SimpleNamespace(now=5_000_000)
    clients = ClientRegistry(lambda: clock.now)
    assert LockFile(str(tmp_path), clients).load() == 1
    conn = _Conn("10.0.0.1", 7)
    assert clients.lock_queue(("CG", "Orders", 0), "B", _Conn("10.0.0.2", 1), now=clock.now + 34_000, **caps) == "held"
    assert clients.lock_queue(("CG", "Orders", 0), "A", conn, now=clock.now + 34_000, **caps) is None
    assert clients._locks_by_host == {"10.0.0.1": 1}       # (max_per_host 1: not refused for the restored entry)
    assert clients.lock_queue(("CG", "Orders", 0), "B", _Conn("10.0.0.2", 1), now=clock.now + 90_000, **caps) == "held"
    assert clients.lock_queue(("CG", "Orders", 0), "B", _Conn("10.0.0.2", 1), now=clock.now + 95_000, **caps) is None

    (tmp_path / "queueLocks.json").write_text('{"locks": [["CG", "Orders", "zero", "A"]]}')
    assert LockFile(str(tmp_path), ClientRegistry(lambda: 0)).load() == 0


def test_a_restored_lock_nobody_renews_lapses_35_s_after_the_start_not_60(tmp_path):
    """A lock held again at start was given the whole queue_lock_max_live_ms (60 s), as if renewed then. Its holder
    trusts it 30 s after its last renewal (rocketmq.client.rebalance.lockMaxLiveTime), which came before the stop:
    a holder gone during the restart kept its queue from the rest of its group 25 s longer than anyone could still
    be consuming it. It lives 35 s now, unless renewed; a shorter queue_lock_max_live_ms is not lengthened."""
    from broker.queue_locks import LockFile
    saved = ClientRegistry(lambda: 0)
    caps = dict(max_live_ms=60_000, max_total=100, max_per_conn=100, max_per_host=100)
    assert saved.lock_queue(("CG", "Orders", 0), "gone", _Conn("10.0.0.1", 1), now=0, **caps) is None
    asyncio.run(LockFile(str(tmp_path), saved, max_live_ms=60_000).save())

    clients = ClientRegistry(lambda: 1_000_000)
    assert LockFile(str(tmp_path), clients, max_live_ms=60_000).load() == 1
    other = _Conn("10.0.0.3", 1)
    assert clients.lock_queue(("CG", "Orders", 0), "other", other, now=1_035_000, **caps) == "held"
    assert clients.lock_queue(("CG", "Orders", 0), "other", other, now=1_035_001, **caps) is None

    short = dict(caps, max_live_ms=20_000)
    clients = ClientRegistry(lambda: 1_000_000)
    assert LockFile(str(tmp_path), clients, max_live_ms=20_000).load() == 1
    assert clients.lock_queue(("CG", "Orders", 0), "other", other, now=1_020_000, **short) == "held"
    assert clients.lock_queue(("CG", "Orders", 0), "other", other, now=1_020_001, **short) is None


def test_a_stop_with_nothing_changed_since_the_last_save_writes_no_lock_file(tmp_path, monkeypatch):
    """Every stop wrote queueLocks.json, a broker no orderly consumer ever used included: on a full disk its 4 KiB
    block was taken from the room the stop's other writes had (the transaction snapshot's full-disk test saw 45,056
    bytes free where 49,152 were left). A stop writes it only when a holder changed since the last save or load."""
    import broker.queue_locks as queue_locks
    writes = []
    real_write = queue_locks._write
    monkeypatch.setattr(queue_locks, "_write", lambda *args: (writes.append(args[0]), real_write(*args)))
    clients = ClientRegistry(lambda: 0)
    lock_file = queue_locks.LockFile(str(tmp_path), clients)
    assert lock_file.load() == 0
    asyncio.run(lock_file.close())
    assert writes == [] and not (tmp_path / queue_locks.FILE_NAME).exists()

    caps = dict(max_live_ms=60_000, max_total=100, max_per_conn=100, max_per_host=100)
    assert clients.lock_queue(("CG", "Orders", 0), "A", _Conn("10.0.0.1", 1), now=0, **caps) is None
    asyncio.run(lock_file.close())                  # a holder changed: written
    assert len(writes) == 1

    restarted = ClientRegistry(lambda: 0)
    lock_file = queue_locks.LockFile(str(tmp_path), restarted)
    assert lock_file.load() == 1
    asyncio.run(lock_file.close())                  # nothing changed since the load: not written again
    assert len(writes) == 1


def test_a_lock_lapsed_when_saved_is_not_held_again_after_a_restart(tmp_path):
    """The file was written from the whole lock table, lapsed locks not yet swept (the housekeeping sweeps every
    10 s) included, and each is held again at start as renewed then: a stop in that gap gave the queue of an
    orderly consumer gone for over a minute to no other consumer for another queue_lock_max_live_ms."""
    from broker.queue_locks import LockFile
    clock = SimpleNamespace(now=0)
    saved = ClientRegistry(lambda: clock.now)
    caps = dict(max_live_ms=60_000, max_total=100, max_per_conn=100, max_per_host=100)
    assert saved.lock_queue(("CG", "Orders", 0), "gone", _Conn("10.0.0.1", 1), now=0, **caps) is None
    clock.now = 30_000
    assert saved.lock_queue(("CG", "Orders", 1), "alive", _Conn("10.0.0.2", 1), now=clock.now, **caps) is None
    clock.now = 61_000                          # "gone"'s lock lapsed a second ago, not swept yet
    asyncio.run(LockFile(str(tmp_path), saved, max_live_ms=60_000).save())

    clients = ClientRegistry(lambda: 7)
    assert LockFile(str(tmp_path), clients, max_live_ms=60_000).load() == 1
    assert clients.lock_queue(("CG", "Orders", 0), "other", _Conn("10.0.0.3", 1), now=8, **caps) is None
    assert clients.lock_queue(("CG", "Orders", 1), "other", _Conn("10.0.0.3", 1), now=8, **caps) == "held"


def test_the_lock_file_is_encoded_a_bounded_slice_at_a_time(tmp_path, monkeypatch):
    """The save ran in a thread "off the loop", but as one json.dumps of every lock: one C call that holds the GIL
    throughout, so the loop stood still as long (200,000 locks: 0.5-0.8 s, every second while holders change).
    Encoded a slice at a time, the thread gives the GIL back between slices; the file reads the same."""
    import json as json_module

    import broker.queue_locks as queue_locks
    longest = []
    real_dumps = json_module.dumps

    def dumps(obj, *args, **kwargs):
        longest.append(len(obj["locks"]) if isinstance(obj, dict) else len(obj))
        return real_dumps(obj, *args, **kwargs)
    monkeypatch.setattr(queue_locks.json, "dumps", dumps)
    clients = ClientRegistry(lambda: 0)
    clients.locks = {("CG", "Many", q): (f"c{q % 7}", 0, None) for q in range(10_000)}
    asyncio.run(queue_locks.LockFile(str(tmp_path), clients).save())
    assert longest and max(longest) <= 4096, max(longest)
    saved = json_module.loads((tmp_path / "queueLocks.json").read_text())
    assert saved == {"locks": [["CG", "Many", q, f"c{q % 7}"] for q in range(10_000)]}


def test_a_refused_lock_file_save_is_said_once_counted_each_time_and_said_written_again(tmp_path, caplog):
    """(The disk refuses the write: here a directory where its .tmp copy goes.) ERROR once for a run of failures,
    each counted in txmq_queue_lock_saves_failed_total, and not taken for saved: the periodic loop tries again; a
    WARNING when it is written again."""
    import logging

    from broker.metrics import BrokerMetrics
    from broker.queue_locks import LockFile
    clients = ClientRegistry(lambda: 0)
    caps = dict(max_live_ms=60_000, max_total=100, max_per_conn=100, max_per_host=100)
    assert clients.lock_queue(("CG", "Orders", 0), "A", _Conn("10.0.0.1", 1), now=0, **caps) is None
    metrics = BrokerMetrics()
    lock_file = LockFile(str(tmp_path), clients, metrics)
    (tmp_path / "queueLocks.json.tmp").mkdir()

    async def saves(n):
        for _ in range(n):
            await lock_file.save()
    with caplog.at_level(logging.WARNING, logger="txmq.locks"):
        asyncio.run(saves(3))
        assert metrics.queue_lock_saves_failed._value.get() == 3
        assert [r.levelno for r in caplog.records] == [logging.ERROR]
        assert lock_file._saved != clients.lock_holders_changed        # the loop's next turn saves again
        (tmp_path / "queueLocks.json.tmp").rmdir()
        asyncio.run(saves(1))
    assert lock_file._saved == clients.lock_holders_changed
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.WARNING]
    assert json.loads((tmp_path / "queueLocks.json").read_text()) == {"locks": [["CG", "Orders", 0, "A"]]}
    (tmp_path / "queueLocks.json.tmp").mkdir()
    assert clients.lock_queue(("CG", "Orders", 1), "A", _Conn("10.0.0.1", 1), now=0, **caps) is None
    asyncio.run(lock_file.close())          # a stop on a full disk, a lock to save: said, counted, and no crash
    assert metrics.queue_lock_saves_failed._value.get() == 4
    assert "not written at stop" in caplog.records[-1].getMessage()


def test_a_hung_lock_file_write_is_said_once_and_its_end_once(tmp_path, caplog, monkeypatch):
    """(seams C3: stock3's lock file met hungfs's hung writes.) A queueLocks.json write that hangs while the broker
    runs (a stopped NFS) was said by nothing: no line, no gauge, every lock granted from then on unsaved (a restart
    shares those queues between two consumers), where a hung topics.json, consumerOffset.json, subscriptionGroup.json
    or kvConfig.json write is said at ERROR and by a gauge. Past ``write_wait_s``: ERROR once and ``write_hung``
    (txmq_config_write_hung{file="queueLocks.json"}) until it ends, then WARNING."""
    import logging
    import threading

    import broker.queue_locks as queue_locks
    release, entered = threading.Event(), threading.Event()
    real_save = queue_locks.save

    def hanging_save(path, data):
        entered.set()
        assert release.wait(30)
        real_save(path, data)
    monkeypatch.setattr(queue_locks, "save", hanging_save)
    clients = ClientRegistry(lambda: 0)
    caps = dict(max_live_ms=60_000, max_total=100, max_per_conn=100, max_per_host=100)
    assert clients.lock_queue(("CG", "Orders", 0), "A", _Conn("10.0.0.1", 1), now=0, **caps) is None
    lock_file = queue_locks.LockFile(str(tmp_path), clients)
    lock_file.write_wait_s = 0.2

    async def scenario():
        saving = asyncio.create_task(lock_file.save())
        done, _ = await asyncio.wait([saving], timeout=2.0)        # past write_wait_s (0.2 s): said hung
        assert not done and entered.is_set()
        assert lock_file.write_hung
        assert [r.levelno for r in caplog.records] == [logging.ERROR]
        assert "has not ended" in caplog.records[0].getMessage()
        release.set()
        await asyncio.wait_for(saving, 10)
        assert not lock_file.write_hung

    with caplog.at_level(logging.WARNING, logger="txmq.locks"):
        try:
            asyncio.run(scenario())
        finally:
            release.set()
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.WARNING]
    assert "hung has ended" in caplog.records[1].getMessage()
    assert lock_file._saved == clients.lock_holders_changed
    assert json.loads((tmp_path / "queueLocks.json").read_text()) == {"locks": [["CG", "Orders", 0, "A"]]}
