"""Retention judged by the broker (broker/retention.py) on a real store, time driven through its clock.

The store is written 80 hours in the past, then fresh messages are written now; plans are made
the way the Spark job makes them (from the store's own segment facts) and then bent into each
kind of bad plan. A bad plan removes nothing; a good one removes exactly the old sealed segments.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import threading

import pytest

from broker.clients import ClientRegistry
from broker.config import BrokerConfig
from broker.context import BrokerContext, aged_clock
from broker.metrics import BrokerMetrics
from broker.retention import PlanRefused, Retention
from broker.store import ConsumerOffsets, GetStatus, MessageStore, PutRequest, StoreConfig
from broker.store import store as store_module
from broker.topics import TopicManager
from broker.transaction import TransactionService
from broker.transaction.service import DEAD_LETTER_BATCH
from protocol.message import decode_record
from protocol.txlog import DEAD
from tests.support.bounded import bounded
from tests.unit.test_review_transactions import Clock, add_half


def dead_lettered(ctx, half_offset: int) -> bool:
    """The half's copy is in TRANS_CHECK_MAX_TIME_TOPIC (its own segment may be gone, with its decision)."""
    got = ctx.store.get_messages("TRANS_CHECK_MAX_TIME_TOPIC", 0, 0, 64, 1 << 20)
    return any(decode_record(b)[0].properties.get("TXMQ_HALF") == str(half_offset) for b in got.buffers)

pytestmark = pytest.mark.asyncio

H = 3_600_000
T0 = 1_800_000_000_000
SEG = 64 * 1024
BODY = b"m" * 900          # ~1 KiB records: ~60 a segment


async def make(tmp_path, clock, store_config=None, **cfg):
    config = BrokerConfig(store_dir=str(tmp_path), transaction_check_interval_ms=1000,
                          transaction_timeout_ms=1000, **cfg)
    store = MessageStore(str(tmp_path / "s"), store_config or StoreConfig(segment_size=SEG), clock=clock)
    topics = TopicManager(str(tmp_path / "config"), auto_create=True, default_queue_nums=4, cluster="c", broker="b")
    ctx = BrokerContext(config, store, None, topics, ClientRegistry(clock), BrokerMetrics(), clock=clock)
    ctx.set_address("127.0.0.1", 10911)
    ctx.tx = TransactionService(ctx)
    store.add_dispatch_listener(ctx.tx.on_dispatch)
    await store.open()
    ctx.offsets = ConsumerOffsets(str(tmp_path / "s"))
    await ctx.tx.recover()
    return ctx


async def send(ctx, n, topic="Flow"):
    results = [await ctx.store.put(PutRequest.build(topic, BODY)) for _ in range(n)]
    assert all(r.ok for r in results)
    return results


@pytest.fixture
async def world(tmp_path):
    """A half and 200 messages written 80 h ago, then 150 fresh messages (the last ones in the active segment)."""
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    half = await add_half(ctx, b"undecided-80h")
    old = await send(ctx, 200)
    clock.now = T0
    fresh = await send(ctx, 150)
    yield ctx, clock, half, old, fresh
    await ctx.store.close()


async def spark_like_plan(ctx, now_ms, retention_ms=72 * H) -> dict:
    """What `python -m ops.spark expiry` lists: the run of sealed segments from the oldest whose newest
    record is older than now_ms - retention_ms, with the identity it saw."""
    chosen = []
    for f in await ctx.store.segment_facts():
        if not f.sealed or f.last_ts >= now_ms - retention_ms:
            break
        chosen.append({"name": f.name, "start_offset": f.start, "end_offset": f.end,
                       "first_store_timestamp": f.first_ts, "last_store_timestamp": f.last_ts})
    return {"version": 2, "store_id": ctx.store.store_id, "created_ms": now_ms, "now_ms": now_ms,
            "retention_ms": retention_ms, "halves": [], "segments": chosen}


def names(ctx):
    return [s.name for s in ctx.store.segments()]


def readable(ctx, results):
    return sum(ctx.store.get_record(r.physical_offset) is not None for r in results)


SLAVE = dict(broker_role="SLAVE", broker_id=1, ha_master_addr="127.0.0.1:1")


def lost(ctx):
    """The undecided halves this start said it lost with their removed segments."""
    return ctx.metrics.transactions_lost.labels("segment-removed")._value.get()


async def a_slave_100h_after_its_master_wrote_a_half(tmp_path, clock, *, replica_only):
    """The master writes an undecided half and 80 messages at T0 and stops; the store is started again as a slave
    100 h later, its segments all expired (set replica-only, as replication does, if ``replica_only``)."""
    ctx = await make(tmp_path, clock)
    half = await add_half(ctx, b"undecided on the master")
    await send(ctx, 80)
    await ctx.store.close()
    clock.now = T0 + 100 * H
    ctx = await make(tmp_path, clock, **SLAVE)
    if replica_only:
        ctx.store.set_replica_only()
    return ctx, half


async def assert_promoted_quietly(tmp_path, clock, caplog):
    """A start as the master says (ERROR) and counts no lost half."""
    caplog.clear()
    ctx = await make(tmp_path, clock)
    try:
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
        assert lost(ctx) == 0
    finally:
        await ctx.store.close()


@contextlib.asynccontextmanager
async def _reopened(tmp_path, cfg, clock):
    """The store at tmp_path/s opened again (a restart), closed after."""
    store = MessageStore(str(tmp_path / "s"), cfg, clock=clock)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


@bounded(30)
async def test_store_id_and_manifest_survive_a_restart(tmp_path):
    clock = Clock(T0)
    ctx = await make(tmp_path, clock)
    sid = ctx.store.store_id
    await send(ctx, 100)
    facts = await ctx.store.segment_facts()
    await ctx.store.close()
    manifest = json.loads((tmp_path / "s" / "segments.json").read_text())
    assert manifest["store_id"] == sid and [e["name"] for e in manifest["segments"]] == [f.name for f in facts]
    assert manifest["segments"][0]["first_ts"] == T0 and manifest["segments"][0]["sealed"]
    ctx = await make(tmp_path, clock)
    try:
        assert ctx.store.store_id == sid
        assert [dataclasses.astuple(f) for f in await ctx.store.segment_facts()][:-1] == \
            [dataclasses.astuple(f) for f in facts][:-1]
    finally:
        await ctx.store.close()


@bounded(30)
async def test_the_manifest_names_the_newest_removed_segment_across_a_restart(tmp_path):
    """segments.json's "removed": the entry of the last segment removed, which ends where the log now
    starts. The rollup reads its last_ts to tell a day whose records went with it from one that lies
    wholly in the segments left (a quiet weekend after the segment filled)."""
    clock = Clock(T0)
    ctx = await make(tmp_path, clock)
    await send(ctx, 150)
    facts = await ctx.store.segment_facts()
    await ctx.store.remove_segment(facts[0].name, "plan")
    await ctx.store.remove_segment(facts[1].name, "plan")
    manifest = json.loads((tmp_path / "s" / "segments.json").read_text())
    assert manifest["removed"] == dataclasses.asdict(facts[1])
    assert manifest["segments"][0]["start"] == facts[1].start + SEG
    await ctx.store.close()
    ctx = await make(tmp_path, clock)
    try:
        await send(ctx, 100)                     # a roll rewrites the manifest: the entry stays
        manifest = json.loads((tmp_path / "s" / "segments.json").read_text())
        assert manifest["removed"] == dataclasses.asdict(facts[1])
    finally:
        await ctx.store.close()


@pytest.mark.parametrize("restart", [False, True])
@bounded(30)
async def test_the_manifest_dates_the_active_segment_by_its_oldest_record_after_a_clock_step_back(tmp_path, restart):
    """The wall clock stepped back across midnight while the active segment was written: its first record is of
    day D+1, later ones of D. Its manifest entry said first_ts = the first record's, so `rollup --date D` (which
    reads the segments that can hold D by the manifest) left it out, and D's records in it went uncounted."""
    from ops.spark.manifest import segments_for_window
    from ops.spark.segments import list_segments

    day = T0 - T0 % (24 * H)                  # D+1 00:00
    clock = Clock(day + 5 * 60_000)
    ctx = await make(tmp_path, clock)
    await send(ctx, 3)                         # D+1 00:05
    clock.now = day - 5 * 60_000
    await send(ctx, 3)                         # D 23:55: NTP stepped the clock back
    if restart:
        await ctx.store.close()
        ctx = await make(tmp_path, clock)
    try:
        await ctx.store.refresh_manifest()     # what the checkpoint loop does every turn
        store = str(tmp_path / "s")
        segs = list_segments(store)
        assert len(segs) == 1 and segs[0].active
        assert segments_for_window(segs, store, day - 24 * H, day) == segs
        assert (await ctx.store.segment_facts())[-1].first_ts == day - 5 * 60_000
    finally:
        await ctx.store.close()


@bounded(30)
async def test_a_good_plan_removes_the_old_segments_and_dead_letters_the_half_inside_first(world):
    ctx, clock, half, old, fresh = world
    before = names(ctx)
    plan = await spark_like_plan(ctx, clock.now)
    assert plan["segments"], "the 80-hour-old data filled no whole segment"
    summary = await Retention(ctx).apply_plan(plan)
    assert summary["segments_removed"] == [s["name"] for s in plan["segments"]]
    assert summary["segments_kept"] == []
    assert names(ctx) == before[len(plan["segments"]):]
    assert readable(ctx, fresh) == len(fresh)
    assert dead_lettered(ctx, half.half_offset) and half.half_offset not in ctx.tx.pending
    got = ctx.store.get_messages("TRANS_CHECK_MAX_TIME_TOPIC", 0, 0, 8, 1 << 20)
    letters = [decode_record(b)[0] for b in got.buffers]
    assert [(m.body, m.properties["TXMQ_REASON"]) for m in letters] == [(b"undecided-80h", "expired")]
    removed = ctx.metrics.segments_removed.labels("plan")._value.get()
    assert removed == len(plan["segments"])
    again = await Retention(ctx).apply_plan(plan)             # applying twice changes nothing
    assert again["segments_removed"] == [] and names(ctx) == before[len(plan["segments"]):]


@bounded(30)
async def test_a_plan_applied_again_after_an_apply_killed_midway_removes_the_rest(world):
    """An apply killed -9 after its first segment went (or that segment removed since by the cleaner): applied again,
    the gone segment was "kept, not in this store" and held back every later listed one as "an older listed segment
    is kept", so nothing more went until the next night's plan, while the reply said each was kept."""
    ctx, clock, half, old, fresh = world
    before = names(ctx)
    plan = await spark_like_plan(ctx, clock.now)
    listed = [s["name"] for s in plan["segments"]]
    assert len(listed) >= 2, "the 80-hour-old data filled fewer than two segments"
    first = await Retention(ctx).apply_plan(dict(plan, segments=plan["segments"][:1]))   # all the killed one did
    assert first["segments_removed"] == listed[:1]
    again = await Retention(ctx).apply_plan(plan)
    assert again["segments_removed"] == listed[1:] and again["segments_kept"] == []
    assert again["segments_gone"] == listed[:1]
    assert names(ctx) == before[len(listed):] and readable(ctx, fresh) == len(fresh)
    third = await Retention(ctx).apply_plan(plan)             # applying twice changes nothing, and says so
    assert (third["segments_removed"], third["segments_kept"], third["segments_gone"]) == ([], [], listed)


@bounded(30)
async def test_a_future_plan_is_refused_whole(world):
    ctx, clock, half, old, fresh = world
    before = names(ctx)
    plan = await spark_like_plan(ctx, clock.now + 100 * H)      # `--now-ms <now + 100 h>`
    assert len(plan["segments"]) == len(before) - 1             # it lists every sealed segment, fresh ones too
    with pytest.raises(PlanRefused, match="ahead of this broker's clock"):
        await Retention(ctx).apply_plan(plan)
    assert names(ctx) == before and readable(ctx, old + fresh) == len(old + fresh)
    assert half.half_offset in ctx.tx.pending


@bounded(30)
async def test_a_plan_of_another_store_or_an_old_format_is_refused_whole(world):
    ctx, clock, *_ = world
    before = names(ctx)
    plan = await spark_like_plan(ctx, clock.now)
    for bad, match in ((dict(plan, store_id="5c0ffee0-0000-4000-8000-000000000000"), "is for store"),
                       ({k: v for k, v in plan.items() if k != "store_id"}, "is for store None"),
                       (dict(plan, version=1), "version 1")):
        with pytest.raises(PlanRefused, match=match):
            await Retention(ctx).apply_plan(bad)
    assert names(ctx) == before


@bounded(30)
async def test_a_plan_trusting_its_own_short_retention_removes_nothing_young(world):
    ctx, clock, half, old, fresh = world
    plan = await spark_like_plan(ctx, clock.now + 30_000, retention_ms=1)    # in the skew; all sealed look old
    summary = await Retention(ctx).apply_plan(plan)
    young = {k["name"]: k["why"] for k in summary["segments_kept"]}
    assert young and all("not older than the retention" in w or "older listed segment" in w for w in young.values())
    assert readable(ctx, fresh) == len(fresh)
    kept_names = set(names(ctx))
    assert all(n in kept_names for n in young)


@bounded(30)
async def test_a_stale_plan_keeps_the_segment_that_was_active_and_has_grown(world):
    ctx, clock, half, old, fresh = world
    facts = await ctx.store.segment_facts()
    active = facts[-1]
    # A plan made while the now-active segment was active (and listed by a buggy or doctored
    # planner), applied after it has grown and sealed, with everything in it "old" by then.
    stale = {"version": 2, "store_id": ctx.store.store_id, "now_ms": clock.now, "retention_ms": 72 * H,
             "halves": [], "segments": [{"name": f.name, "start_offset": f.start, "end_offset": f.end,
                                         "last_store_timestamp": f.last_ts} for f in facts]}
    await send(ctx, 80)                                   # it grows and seals; a new segment is active
    clock.now += 100 * H
    summary = await Retention(ctx).apply_plan(stale)
    kept = {k["name"]: k["why"] for k in summary["segments_kept"]}
    assert "changed since the plan" in kept[active.name]
    assert active.name in names(ctx)
    assert summary["segments_removed"] == [f.name for f in facts[:-1]]    # those are what the plan saw, and old


@bounded(30)
async def test_the_active_segment_is_never_removed(world):
    ctx, clock, *_ = world
    clock.now += 1000 * H
    f = (await ctx.store.segment_facts())[-1]
    plan = {"version": 2, "store_id": ctx.store.store_id, "now_ms": clock.now, "retention_ms": 72 * H,
            "halves": [], "segments": [{"name": f.name, "start_offset": f.start, "end_offset": f.end,
                                        "last_store_timestamp": f.last_ts}]}
    summary = await Retention(ctx).apply_plan(plan)
    assert summary["segments_kept"] == [{"name": f.name, "why": "it is the active segment"}]


@bounded(30)
async def test_a_consumer_behind_a_removed_segment_is_moved_to_the_new_minimum(world):
    ctx, clock, half, old, fresh = world
    await Retention(ctx).apply_plan(await spark_like_plan(ctx, clock.now))
    got = ctx.store.get_messages("Flow", 0, 0, 32, 1 << 20)
    assert got.status is GetStatus.OFFSET_TOO_SMALL          # the pull processor answers PULL_OFFSET_MOVED
    lo = got.next_begin_offset
    assert lo == ctx.store.min_offset("Flow", 0) > 0
    nxt = ctx.store.get_messages("Flow", 0, lo, 32, 1 << 20)
    assert nxt.status is GetStatus.FOUND and decode_record(nxt.buffers[0])[0].body == BODY


@bounded(30)
async def test_keeping_unconsumed_data_is_an_opt_in_with_a_size_cap(tmp_path):
    for cap, expect_removed in ((10 << 20, False), (SEG, True)):       # within the cap: kept; over it: goes
        clock = Clock(T0 - 80 * H)
        ctx = await make(tmp_path / str(cap), clock, retain_unconsumed_max_bytes=cap)
        try:
            await send(ctx, 150)
            clock.now = T0
            await send(ctx, 10)
            ctx.offsets.commit("CG_slow", "Flow", 0, 3)
            summary = await Retention(ctx).apply_plan(await spark_like_plan(ctx, clock.now))
            assert bool(summary["segments_removed"]) is expect_removed, summary
            if not expect_removed:
                assert "CG_slow" in summary["segments_kept"][0]["why"]
        finally:
            await ctx.store.close()


@bounded(30)
async def test_disk_pressure_cleans_expired_then_forces_the_oldest_never_the_active(world):
    ctx, clock, half, old, fresh = world
    usage = [0.5]
    r = Retention(ctx, usage=lambda: usage[0])
    before = names(ctx)
    assert await r.clean_once() == []                          # below the clean ratio: nothing
    plan = await spark_like_plan(ctx, clock.now)
    usage[0] = 0.80                                            # clean: the expired ones, at once
    removed = await r.clean_once()
    assert [n for n, _ in removed] == [s["name"] for s in plan["segments"]]
    assert {why for _, why in removed} == {"expired"}
    assert dead_lettered(ctx, half.half_offset)        # dead-lettered before its segment went
    young = names(ctx)
    assert await r.clean_once() == []                          # the rest is young: kept at 0.80

    fresh_half = await add_half(ctx, b"young-undecided")
    assert fresh_half.half_offset >= ctx.store.segments()[-1].start_offset
    usage[0] = 0.90                                            # force: oldest first, even young ones
    removed = await r.clean_once()
    assert [n for n, _ in removed] == young[:-1] and {w for _, w in removed} == {"pressure"}
    assert names(ctx) == young[-1:]                           # never the active one
    assert fresh_half.half_offset in ctx.tx.pending            # it lives in the active segment
    m = ctx.metrics.segments_removed
    assert m.labels("expired")._value.get() == len(plan["segments"])
    assert m.labels("pressure")._value.get() == len(young) - 1
    assert len(before) == len(plan["segments"]) + len(young)


@bounded(30)
async def test_a_clock_stepped_days_ahead_expires_only_what_the_time_passed_made_old(world, caplog):
    """Ages are the wall clock's bounded by the time that passed since the start (context.aged_clock). Judged
    by the wall clock alone, a step 100 h ahead with the disk above its clean ratio removed every sealed segment,
    fresh messages with them, and dead-lettered a half stored a moment before as `expired`; a plan made at the
    stepped time did the same."""
    ctx, clock, half, old, fresh = world
    ticks = Clock(0)                                   # the monotonic clock: no time passes in this test
    ctx.aged = aged_clock(clock, ticks)
    young_half = await add_half(ctx, b"young-undecided")
    young = await send(ctx, 100)                       # seals the young half's segment
    expired = await spark_like_plan(ctx, clock.now)
    clock.now += 100 * H                               # stepped ahead, not a second passed
    r = Retention(ctx, usage=lambda: 0.80)
    removed = await r.clean_once()
    assert [n for n, _ in removed] == [s["name"] for s in expired["segments"]]   # the 80-hour-old ones alone
    assert dead_lettered(ctx, half.half_offset)
    assert young_half.half_offset in ctx.tx.pending and not dead_lettered(ctx, young_half.half_offset)
    assert readable(ctx, fresh + young) == len(fresh + young)
    summary = await r.apply_plan(await spark_like_plan(ctx, clock.now))    # every sealed segment, by the step
    assert summary["segments_removed"] == [] and summary["segments_kept"]
    assert young_half.half_offset in ctx.tx.pending and readable(ctx, fresh + young) == len(fresh + young)
    said = [m for m in caplog.messages if "ahead of the time that passed since the broker started" in m]
    assert len(said) == 1 and "360000 s ahead" in said[0], said           # once a step, not once a pass
    ticks.now += 73 * H                                # the broker's own 73 h: the young ones are old now
    clock.now += 73 * H
    assert await r.clean_once() and dead_lettered(ctx, young_half.half_offset)


@bounded(30)
async def test_forced_removal_dead_letters_a_young_undecided_half_with_its_reason(tmp_path):
    clock = Clock(T0)
    ctx = await make(tmp_path, clock)
    try:
        half = await add_half(ctx, b"young")
        await send(ctx, 80)
        r = Retention(ctx, usage=lambda: 0.95)
        removed = await r.clean_once()
        assert removed and removed[0][1] == "pressure"
        got = ctx.store.get_messages("TRANS_CHECK_MAX_TIME_TOPIC", 0, 0, 8, 1 << 20)
        assert [decode_record(b)[0].properties["TXMQ_REASON"] for b in got.buffers] == ["disk-pressure"]
        assert half.half_offset not in ctx.tx.pending
    finally:
        await ctx.store.close()


@bounded(30)
async def test_a_slave_removes_segments_with_halves_in_them_without_writing(tmp_path):
    """A slave's store takes no writes of its own, so dead-lettering a half first -- what keeps a master's
    half from vanishing with its segment -- failed there and kept the segment: the slave's disk filled. Its
    master dead-letters the half (the copy replicates); the slave removes the segment as it stands."""
    clock = Clock(T0)
    ctx = await make(tmp_path, clock)
    ctx.config = dataclasses.replace(ctx.config, broker_role="SLAVE", broker_id=1, ha_master_addr="127.0.0.1:1")
    try:
        half = await add_half(ctx, b"undecided on the master")
        await send(ctx, 80)
        ctx.store.set_replica_only()                            # from here on, a slave's store
        before = names(ctx)
        removed = await Retention(ctx, usage=lambda: 0.95).clean_once()
        assert [n for n, _ in removed] == before[:-1] and {w for _, w in removed} == {"pressure"}
        assert not ctx.store.get_messages("TRANS_CHECK_MAX_TIME_TOPIC", 0, 0, 8, 1 << 20).buffers   # wrote nothing
        assert half.half_offset < ctx.store.min_physical_offset
    finally:
        await ctx.store.close()


@pytest.mark.parametrize("slave_restarts", [0, 1])
@bounded(30)
async def test_a_promoted_slave_says_which_undecided_halves_its_removed_segments_took(tmp_path, caplog,
                                                                                       slave_restarts):
    """A slave removes expired segments without dead-lettering the halves in them: its master does. Promoted
    before its master did (the master lost), it recovered without them and said nothing -- an undecided
    transaction gone without a dead letter, a log line or a count. It is said and counted, once; a restart
    as a slave in between (which dropped them from its snapshot) keeps quiet and keeps them in mind."""
    clock = Clock(T0)
    ctx, half = await a_slave_100h_after_its_master_wrote_a_half(tmp_path, clock, replica_only=True)
    try:
        assert half.half_offset in ctx.tx.pending                        # its start-up index: the master's half
        removed = await Retention(ctx, usage=lambda: 0.95).clean_once()
        assert removed and half.half_offset < ctx.store.min_physical_offset
        await ctx.tx.stop()
    finally:
        await ctx.store.close()
    for _ in range(slave_restarts):
        caplog.clear()
        ctx = await make(tmp_path, clock, **SLAVE)
        try:
            assert half.half_offset not in ctx.tx.pending and not [r for r in caplog.records if r.levelname == "ERROR"]
            await ctx.tx.stop()
        finally:
            await ctx.store.close()
    caplog.clear()
    ctx = await make(tmp_path, clock)                                     # restarted as the master
    try:
        assert half.half_offset not in ctx.tx.pending
        said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "lost" in r.getMessage()]
        assert len(said) == 1 and f"{half.half_offset}" in said[0] and "slave" in said[0], said
        assert lost(ctx) == 1
        await ctx.tx.stop()                                               # its snapshot: without the half
    finally:
        await ctx.store.close()
    await assert_promoted_quietly(tmp_path, clock, caplog)               # said once: the next start is quiet


@bounded(30)
async def test_a_promoted_slave_is_quiet_about_a_removed_half_its_master_dead_lettered(tmp_path, caplog):
    """The master's dead letter of a half (its op record copied to the slave) after the slave removed the half's
    segment and restarted: the promotion has nothing to say."""
    clock = Clock(T0)
    ctx, half = await a_slave_100h_after_its_master_wrote_a_half(tmp_path, clock, replica_only=False)
    try:
        assert await Retention(ctx, usage=lambda: 0.95).clean_once()
        await ctx.tx.stop()
    finally:
        await ctx.store.close()
    ctx = await make(tmp_path, clock, **SLAVE)
    try:
        op = ctx.tx.records.decision(DEAD, half.half_offset, half.queue_offset, reason="expired")
        assert (await ctx.store.put(op)).ok                             # as the copy of its master's log writes it
        await ctx.tx.stop()
    finally:
        await ctx.store.close()
    await assert_promoted_quietly(tmp_path, clock, caplog)


@bounded(30)
async def test_a_plan_is_refused_whole_by_a_slave(tmp_path):
    """A plan made from a slave's store (Spark run there to spare the master) names the slave's store id, and the
    slave took it: its halves "skipped" (its store refuses the dead letters), its segments removed -- the reply
    a success, while the master, whose halves they are, was never told. Refused whole, nothing changed."""
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    try:
        half = await add_half(ctx, b"undecided on the master")
        await send(ctx, 80)
        clock.now = T0
        ctx.config = dataclasses.replace(ctx.config, broker_role="SLAVE", broker_id=1, ha_master_addr="127.0.0.1:1")
        ctx.store.set_replica_only()
        before = names(ctx)
        plan = await spark_like_plan(ctx, clock.now)
        plan["halves"] = [{"commit_log_offset": half.half_offset, "queue_offset": half.queue_offset,
                           "producer_group": "PG", "topic": "T", "store_timestamp": T0 - 80 * H, "uniq_key": None}]
        assert plan["segments"]
        with pytest.raises(PlanRefused, match="SLAVE"):
            await Retention(ctx).apply_plan(plan)
        assert names(ctx) == before and half.half_offset in ctx.tx.pending
    finally:
        await ctx.store.close()


@bounded(30)
async def test_forced_cleaning_works_while_the_disk_refuses_writes(tmp_path):
    """Above disk_refuse_ratio every client write is refused; the dead-letter records that must precede a
    forced removal are what frees the disk, so they are not, or a full disk could never clean itself."""
    clock = Clock(T0)
    ctx = await make(tmp_path, clock)
    try:
        half = await add_half(ctx, b"young")
        await send(ctx, 80)
        full = [True]

        def statvfs(path):      # 95% used while full, 50% once a segment is gone
            used = 95 if full[0] else 50
            return os.statvfs_result((4096, 4096, 100, 100 - used, 100 - used, 0, 0, 0, 0, 255))
        disk = ctx.store.disk
        disk._statvfs = statvfs
        assert disk.probe() and disk.ratio == pytest.approx(0.95)
        refused = await ctx.store.put(PutRequest.build("Flow", BODY))
        assert not refused.ok                                   # clients are refused ...
        r = Retention(ctx)                                      # ... and the cleaner reads the same monitor
        before = names(ctx)
        removed = await r.clean_once()
        assert removed and {why for _, why in removed} == {"pressure"}, removed
        assert names(ctx) == before[-1:]
        assert dead_lettered(ctx, half.half_offset)      # dead-lettered although writes were refused
        full[0] = False
        assert not disk.probe() and (await ctx.store.put(PutRequest.build("Flow", BODY))).ok
    finally:
        await ctx.store.close()


@bounded(30)
async def test_the_check_timer_never_expires_a_half_by_age_the_plan_does_it_once(world):
    ctx, clock, half, old, fresh = world          # the half is 80 hours old by the broker's clock
    await ctx.tx.run_due(clock.now)                # a check pass (start-up runs one at once)
    assert half.half_offset in ctx.tx.pending and ctx.tx.dead_count == 0
    plan = await spark_like_plan(ctx, clock.now)
    plan["halves"] = [{"commit_log_offset": half.half_offset}]
    first = await Retention(ctx).apply_plan(plan)
    assert first["expired"] == [half.half_offset]
    second = await Retention(ctx).apply_plan(plan)
    assert second["expired"] == [] and second["skipped"][0]["why"] == "already decided or unknown"
    got = ctx.store.get_messages("TRANS_CHECK_MAX_TIME_TOPIC", 0, 0, 8, 1 << 20)
    assert len(got.buffers) == 1                  # dead-lettered once


@bounded(30)
async def test_malformed_plans_are_refused_without_a_change(world):
    ctx, clock, *_ = world
    before = names(ctx)
    good = await spark_like_plan(ctx, clock.now)
    for bad in (["not", "an", "object"], dict(good, segments="all"), dict(good, segments=["00000000000000000000"]),
                dict(good, halves=[7]), dict(good, now_ms="now")):
        with pytest.raises(PlanRefused):
            await Retention(ctx).apply_plan(bad)
    weird = dict(good, halves=[{"commit_log_offset": [1]}, {"commit_log_offset": "x"}])
    summary = await Retention(ctx).apply_plan(dict(weird, segments=[]))
    assert summary["expired"] == [] and len(summary["skipped"]) == 2 and names(ctx) == before


@bounded(20)
async def test_a_cleaning_pass_that_raises_is_counted_and_the_next_pass_runs(tmp_path):
    """The cleaner survives a pass that raises (a bug) and says so where the alert looks: a cleaner
    failing every pass, logged only, would let the disk fill unnoticed."""
    import asyncio
    ctx = await make(tmp_path, Clock(T0), disk_clean_interval_s=0.01)
    retention = Retention(ctx)
    second = asyncio.Event()
    calls = []

    async def clean_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the cleaner")
        second.set()
        return []
    retention.clean_once = clean_once
    retention.start()
    try:
        await second.wait()
    finally:
        await retention.stop()
        await ctx.store.close()
    assert ctx.metrics.task_crashes.labels("txmq-retention")._value.get() == 1


@bounded(30)
async def test_a_young_undecided_half_keeps_its_expired_segment_visibly_until_disk_pressure(tmp_path, caplog):
    """--transaction-retention-hours (200) above --file-reserved-hours (72): the cleaner keeps the
    expired segment holding a half 80 h old, and every segment after it. It said nothing: the disk sat
    above disk_clean_ratio with expired segments and no line in the log why. It says so once a
    segment; disk pressure still removes it."""
    import logging

    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock, transaction_retention_hours=200)
    try:
        half = await add_half(ctx, b"undecided-80h")
        await send(ctx, 200)
        clock.now = T0
        await send(ctx, 150)
        usage = [0.80]
        r = Retention(ctx, usage=lambda: usage[0])
        first = names(ctx)[0]
        with caplog.at_level(logging.WARNING, logger="txmq.retention"):
            assert await r.clean_once() == [] and await r.clean_once() == []
        said = [rec.getMessage() for rec in caplog.records if "transaction_retention_hours" in rec.getMessage()]
        assert len(said) == 1 and first in said[0] and str(half.half_offset) in said[0], said
        assert half.half_offset in ctx.tx.pending
        usage[0] = 0.90
        removed = await r.clean_once()
        assert removed[0] == (first, "pressure")
        assert half.half_offset not in ctx.tx.pending and dead_lettered(ctx, half.half_offset)
    finally:
        await ctx.store.close()


@bounded(30)
async def test_an_end_for_a_half_whose_segment_retention_removed_is_refused_and_counted(world):
    """Its decision went with its segment: a very late END (a stock client's oneway one, never answered) gets
    "Find prepared transaction message failed", never a delivery, and is counted under end-half-removed (was
    end-no-half, which an END naming an offset no half was stored at is counted under); before the
    segment goes, the expired transaction refuses a COMMIT as the first decision (DEAD) wins, counted and said with
    the resume that would deliver it."""
    ctx, clock, half, old, fresh = world
    plan = await spark_like_plan(ctx, clock.now)
    done, failed = await ctx.tx.dead_letter([half.half_offset], "expired")
    assert done == [half.half_offset] and failed == []
    code, remark = ctx.tx.end(half.half_offset, "COMMIT", group="PG", table_offset=half.queue_offset,
                              from_check=False)
    assert (code, remark) == (4, "transaction already DEAD (dead-lettered); COMMIT refused: its message is on the "
                                 f"dead-letter topic, `admin resume {half.half_offset}` checks it again")
    assert ctx.metrics.child(ctx.metrics.commits_after_dead, "PG")._value.get() == 1   # its producer committed
    await Retention(ctx).apply_plan(plan)
    assert ctx.store.get_record(half.half_offset) is None
    removed, no_half = ctx.metrics.refused.labels("end-half-removed"), ctx.metrics.refused.labels("end-no-half")
    for state in ("COMMIT", "ROLLBACK"):
        code, remark = ctx.tx.end(half.half_offset, state, group="PG", table_offset=half.queue_offset,
                                  from_check=True)
        assert (code, remark) == (1, "Find prepared transaction message failed")
    # below the log's first offset: told apart from an END naming an offset no half was ever stored at
    assert (removed._value.get(), no_half._value.get()) == (2, 0)
    past_end = ctx.store.max_physical_offset + 1000
    assert ctx.tx.end(past_end, "COMMIT", group="PG", table_offset=0, from_check=False)[0] == 1
    assert (removed._value.get(), no_half._value.get()) == (2, 1)
    assert ctx.store.get_messages("T", 0, 0, 8, 1 << 20).buffers == []      # never committed


@bounded(30)
async def test_an_oldest_segment_stamped_ahead_of_the_clock_is_said_once_not_kept_silently(tmp_path, caplog):
    """Segments go oldest first, so one whose newest record is stamped ahead of the broker's clock (written while
    the clock was ahead; it was stepped back since) kept itself and every expired segment after it while the disk
    sat above disk_clean_ratio, and nothing said why. Said once a segment; disk pressure still removes it."""
    import logging

    clock = Clock(T0 + H)                           # the clock is an hour ahead ...
    ctx = await make(tmp_path, clock)
    try:
        await send(ctx, 65)                         # the first segment, whole
        clock.now = T0 - 80 * H                     # ... then stepped back; the rest expires normally
        await send(ctx, 200)
        clock.now = T0
        await send(ctx, 150)
        first = names(ctx)[0]
        facts = await ctx.store.segment_facts()
        assert facts[0].last_ts > T0 and facts[1].last_ts < T0 - 72 * H
        usage = [0.80]
        r = Retention(ctx, usage=lambda: usage[0])
        with caplog.at_level(logging.WARNING, logger="txmq.retention"):
            assert await r.clean_once() == [] and await r.clean_once() == []
        said = [rec.getMessage() for rec in caplog.records if "cannot expire" in rec.getMessage()]
        assert len(said) == 1 and first in said[0] and f"{H} ms ahead of the broker's clock" in said[0], said
        usage[0] = 0.90
        removed = await r.clean_once()
        assert removed[0] == (first, "pressure")
        assert names(ctx)[0] != first
    finally:
        await ctx.store.close()


@bounded(30)
async def test_a_slave_removes_an_expired_segment_only_once_its_master_has(tmp_path, caplog):
    """A slave never dead-letters the undecided halves in a segment (its master does, then removes it): removed by
    the slave first, and the slave promoted before its master decided them, they were gone without a word. The
    slave keeps every expired segment its master still holds, says so once, and disk pressure still forces it."""
    import logging

    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    ctx.config = dataclasses.replace(ctx.config, broker_role="SLAVE", broker_id=1, ha_master_addr="127.0.0.1:1")
    try:
        await send(ctx, 200)
        clock.now = T0
        await send(ctx, 150)
        ctx.store.set_replica_only()
        facts = await ctx.store.segment_facts()
        assert len(facts) >= 3
        usage = [0.80]
        r = Retention(ctx, usage=lambda: usage[0])
        with caplog.at_level(logging.WARNING, logger="txmq.retention"):
            assert await r.clean_once() == [] and await r.clean_once() == []       # its master's log start unknown
        said = [rec.getMessage() for rec in caplog.records if "its master still holds it" in rec.getMessage()]
        assert len(said) == 1 and facts[0].name in said[0], said
        removed_to = [facts[1].start]           # the master removed the first segment
        r.master_removed_to = lambda _end: removed_to[0]
        assert await r.clean_once() == [(facts[0].name, "expired")]
        usage[0] = 0.90                                         # disk pressure forces it out, saying so
        with caplog.at_level(logging.ERROR, logger="txmq.retention"):
            assert (await r.clean_once())[0][0] == facts[1].name
        assert any("lost to this slave promoted" in rec.getMessage() for rec in caplog.records)
    finally:
        await ctx.store.close()


@pytest.mark.parametrize("slave_restarts", [0, 1])
@bounded(30)
async def test_a_promoted_slave_is_quiet_about_a_half_decided_by_an_op_its_cleaner_removed_too(tmp_path, caplog,
                                                                                                slave_restarts):
    """A slave writes its transaction snapshot at start only: the halves undecided then stay in it, and the next
    start replays the op records after it. A slave up longer than the retention removed the segments of the
    halves undecided at its start *and* of the master's decisions of them (a commit seconds later): the next
    start found neither, and took each for an undecided half lost -- an ERROR and the critical alert at the
    promotion of every long-running slave, for transactions committed days ago (and, across slave restarts,
    their offsets kept in its snapshot for good). Without the op records after its snapshot, a start cannot
    tell: it says so (WARNING) and counts nothing."""
    from protocol.txlog import COMMIT
    clock = Clock(T0)
    ctx = await make(tmp_path, clock)
    half = await add_half(ctx, b"committed on the master seconds later")
    await ctx.tx.stop()
    await ctx.store.close()
    ctx = await make(tmp_path, clock, **SLAVE)         # its start-up snapshot: the half undecided
    try:
        assert half.half_offset in ctx.tx.pending
        op = ctx.tx.records.decision(COMMIT, half.half_offset, half.queue_offset)
        assert (await ctx.store.put(op)).ok                 # the master's commit, as the copy of its log writes it
        await send(ctx, 80)
        clock.now = T0 + 100 * H
        assert await Retention(ctx, usage=lambda: 0.95).clean_once()
        assert op is not None and ctx.store.min_offset("RMQ_SYS_TRANS_OP_HALF_TOPIC", 0) > 0   # the commit went too
        await ctx.tx.stop()
    finally:
        await ctx.store.close()
    for _ in range(slave_restarts):
        ctx = await make(tmp_path, clock, **SLAVE)
        try:
            assert ctx.tx.removed_undecided == []           # nothing kept that no op can ever clear
            await ctx.tx.stop()
        finally:
            await ctx.store.close()
    caplog.clear()
    ctx = await make(tmp_path, clock)                        # promoted
    try:
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
        assert lost(ctx) == 0
        assert half.half_offset not in ctx.tx.pending
    finally:
        await ctx.store.close()


@pytest.mark.parametrize("slave_restarts", [0, 1])
@pytest.mark.parametrize("decided", [False, True])
@bounded(30)
async def test_a_promoted_slave_says_the_undecided_halves_copied_after_its_start_that_its_cleaner_removed(
        tmp_path, caplog, decided, slave_restarts):
    """A slave's snapshot is its start's: a half copied from its master later is in none, and the next start scans
    the halves from the snapshot's floor. Its cleaner removed the segment of such a half (undecided: its master
    had not dead-lettered it) and the start that promoted it began the scan past them -- the half gone without
    a word, the case of most halves of a slave up for days. Each half queue offset between the floor and the
    log's first half without a decision is said and counted (kept by a slave's restart); one its master decided,
    the op copied after the removed segment, is not."""
    from protocol.message import Prop
    from protocol.txlog import COMMIT
    clock = Clock(T0)
    ctx = await make(tmp_path, clock, **SLAVE)          # its start-up snapshot: no half
    try:
        props = {Prop.UNIQ_KEY: "U-copied", Prop.PGROUP: "PG", Prop.TRAN_MSG: "true"}
        req = ctx.tx.records.half(body=b"copied after the start", real_topic="T", real_qid=0, flag=0, sys_flag=0,
                                  born_timestamp=T0, born_host=ctx.store_host, props=props)
        put = await ctx.store.put(req)                      # as the copy of its master's log writes it
        assert put.ok
        await send(ctx, 80)
        if decided:                                         # the master's commit, in a segment the slave keeps
            assert (await ctx.store.put(ctx.tx.records.decision(COMMIT, put.physical_offset, 0))).ok
        clock.now = T0 + 100 * H
        assert await Retention(ctx, usage=lambda: 0.95).clean_once()
        assert put.physical_offset < ctx.store.min_physical_offset
        await ctx.tx.stop()
    finally:
        await ctx.store.close()
    for _ in range(slave_restarts):
        caplog.clear()
        ctx = await make(tmp_path, clock, **SLAVE)
        try:
            assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
            assert ctx.tx.removed_undecided_queue == ([] if decided else [0])
            await ctx.tx.stop()
        finally:
            await ctx.store.close()
    caplog.clear()
    ctx = await make(tmp_path, clock)                        # promoted
    try:
        said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "lost" in r.getMessage()]
        assert len(said) == (0 if decided else 1), caplog.text
        assert lost(ctx) == (0 if decided else 1)
    finally:
        await ctx.store.close()


@bounded(30)
async def test_a_promoted_slave_killed_before_its_first_snapshot_does_not_say_the_lost_halves_again(tmp_path,
                                                                                                   caplog):
    """The start that promoted a slave said and counted its lost halves, but the snapshot that still named them
    (the slave's) was replaced only by the master's first periodic one or its stop: killed before either, each
    start said and counted them again, the critical alert firing anew for the same halves."""
    clock = Clock(T0)
    ctx, half = await a_slave_100h_after_its_master_wrote_a_half(tmp_path, clock, replica_only=True)
    try:
        assert await Retention(ctx, usage=lambda: 0.95).clean_once()
        assert half.half_offset < ctx.store.min_physical_offset
        await ctx.tx.stop()
    finally:
        await ctx.store.close()
    ctx = await make(tmp_path, clock)                                     # promoted: said once
    try:
        assert lost(ctx) == 1
    finally:
        await ctx.store.close()                                           # killed: no tx.stop, no periodic snapshot
    await assert_promoted_quietly(tmp_path, clock, caplog)


@bounded(60)
async def test_halves_that_cannot_be_dead_lettered_do_not_each_walk_the_undecided_index(tmp_path, caplog):
    """A segment whose undecided halves could not be dead-lettered (the store refusing writes: an I/O error
    stopped it, or no block is left for the records) is kept. Which of them were still undecided was asked of
    the whole index once per half that failed: K halves under P undecided held the event loop K x P (2,000 under
    200,000: 40-50 s a pass, again at every cleaning interval)."""
    from tests.unit.test_check_pass_cost import CountingIndex
    from tests.unit.test_review_transactions import GatedStore
    clock = Clock(T0)
    ctx = await make(tmp_path, clock)
    try:
        halves = [await add_half(ctx, b"h%d" % i) for i in range(40)]
        await send(ctx, 80)
        oldest = names(ctx)[0]
        assert all(h.half_offset < ctx.store.segments()[1].start_offset for h in halves)
        store = ctx.store = GatedStore(ctx.store)
        store.gate, store.fail = asyncio.Event(), True      # every write refused
        store.gate.set()
        index = CountingIndex(ctx.tx.pending)
        ctx.tx.pending = ctx.tx.core.pending = index
        CountingIndex.scans = 0
        removed = await Retention(ctx, usage=lambda: 0.95).clean_once()
        assert removed == [] and names(ctx)[0] == oldest               # kept: its halves are still undecided
        assert all(h.half_offset in index for h in halves)
        assert "could not be dead-lettered" in caplog.text
        assert CountingIndex.scans <= 1, f"{CountingIndex.scans} walks of the undecided index for one segment"
    finally:
        await ctx.store.close()


@bounded(60)
async def test_a_cleaning_pass_finds_each_segments_undecided_halves_without_walking_the_index(tmp_path):
    """Each segment removed asked which undecided halves it held of the whole index, twice (expired: are any young;
    then which to dead-letter first): 20-30 ms of the loop a walk at 500k undecided, for each of the thousands of
    segments a pass over months of history removes. The halves are found by half-queue offset, and every one
    inside is still dead-lettered before its segment goes; those after it stay undecided."""
    from tests.unit.test_check_pass_cost import CountingIndex
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    try:
        old = []
        for i in range(4):              # a half in each of the first segments, ~60 records a segment
            old.append(await add_half(ctx, b"old-%d" % i))
            await send(ctx, 70)
        clock.now = T0
        young = await add_half(ctx, b"young")
        await send(ctx, 70)
        index = CountingIndex(ctx.tx.pending)
        ctx.tx.pending = ctx.tx.core.pending = index
        CountingIndex.scans = 0
        removed = await Retention(ctx, usage=lambda: 0.80).clean_once()
        assert len(removed) >= 4 and {why for _, why in removed} == {"expired"}
        assert all(dead_lettered(ctx, h.half_offset) and h.half_offset not in index for h in old)
        assert young.half_offset in index and not dead_lettered(ctx, young.half_offset)
        assert CountingIndex.scans == 0, f"{CountingIndex.scans} walks of the undecided index"
    finally:
        await ctx.store.close()


@bounded(5)
async def test_the_age_clock_counts_the_time_a_suspended_host_slept_but_not_a_step(monkeypatch):
    """aged_clock bounds the wall clock by the time that passed since the start. CLOCK_MONOTONIC stops while a
    host (a laptop, a VM's guest) is suspended: after a 10 h sleep, with the wall clock put right on resume, ages
    were judged 10 h short for the rest of the run, and every further sleep added to it (segments and undecided
    halves kept that much longer, the disk filling towards forced removal). CLOCK_BOOTTIME counts the sleep; a
    step ahead while awake is still not counted."""
    import time

    import broker.context as context

    if not hasattr(time, "CLOCK_BOOTTIME"):
        pytest.skip("no CLOCK_BOOTTIME here: the monotonic clock is used")
    host = {"wall": 1_700_000_000.0, "mono": 500.0, "boot": 700.0}
    real_gettime = time.clock_gettime
    monkeypatch.setattr(time, "time", lambda: host["wall"])
    monkeypatch.setattr(time, "monotonic", lambda: host["mono"])
    monkeypatch.setattr(time, "clock_gettime", lambda cid: host["boot"] if cid == time.CLOCK_BOOTTIME
                        else host["mono"] if cid == time.CLOCK_MONOTONIC else real_gettime(cid))
    aged = context.aged_clock()
    start = aged()
    host["wall"] += 36_000; host["boot"] += 36_000         # noqa: E702 - suspended 10 h: the monotonic clock stood
    assert aged() == start + 36_000_000, "the sleep was not counted"
    host["wall"] += 4 * 86_400; host["boot"] += 1; host["mono"] += 1     # noqa: E702 - stepped 4 days ahead, awake
    assert aged() == start + 36_001_000


@bounded(30)
async def test_a_clock_stepped_ahead_again_after_it_was_put_back_is_said_again(world, caplog):
    """The step warning is said once a step. It remembered the largest lead it had said, not the lead now: a clock
    put back, then stepped ahead again by as much (a flapping NTP source, a VM migrated twice), was not said the
    second time, though retention again kept everything that much longer."""
    ctx, clock, *_ = world
    ticks = Clock(0)
    ctx.aged = aged_clock(clock, ticks)
    r = Retention(ctx, usage=lambda: 0.0)

    def said():
        return [m for m in caplog.messages if "ahead of the time that passed since the broker started" in m]

    for _ in range(2):
        clock.now += 100 * H
        r.now(); r.now()                                 # noqa: E702 - once a step, not once a pass
        clock.now -= 100 * H                             # put back
        r.now()
    assert len(said()) == 2, said()


@bounded(30)
async def test_a_clock_stepped_ahead_is_said_at_the_next_pass_with_the_disk_below_its_clean_ratio(world, caplog):
    """The step warning was said only by a pass that found the disk above disk_clean_ratio: a step days ahead on a
    quiet disk was said days later, when the disk filled and the operator asked why nothing expired, if ever."""
    ctx, clock, *_ = world
    ctx.aged = aged_clock(clock, Clock(0))
    r = Retention(ctx, usage=lambda: 0.0)
    clock.now += 100 * H
    assert await r.clean_once() == []
    assert [m for m in caplog.messages if "ahead of the time that passed since the broker started" in m]


@bounded(30)
async def test_a_resume_of_a_dead_letter_whose_half_retention_removed_says_so(world):
    """A resume (903, or a stock admin's 323 naming the dead letter) of a transaction whose half went with its
    segment was refused as "not dead-lettered (unknown)": it is dead-lettered, its dead letter in hand, and the
    broker knows why it cannot be checked again -- its half is gone with the log before the oldest kept offset."""
    from broker.transaction import DecisionError
    ctx, clock, half, old, fresh = world
    await Retention(ctx).apply_plan(await spark_like_plan(ctx, clock.now))
    assert dead_lettered(ctx, half.half_offset) and ctx.store.get_record(half.half_offset) is None
    with pytest.raises(DecisionError) as refused:
        await ctx.tx.resume(half.half_offset)
    remark = refused.value.remark
    assert "unknown" not in remark and "removed" in remark, remark
    assert str(ctx.store.min_physical_offset) in remark, remark


@bounded(30)
async def test_a_resume_while_a_pass_dead_letters_a_segments_halves_leaves_no_pending_half_removed(tmp_path):
    """Retention takes a segment's undecided halves (TransactionCore.between) once, dead-letters them a decision at
    a time -- the loop runs between -- then removes the segment. A dead-lettered transaction in it resumed
    meanwhile (903, a stock admin's 323) was pending again but in no list: its half went with the segment, a
    transaction undecided for ever that no check could reach (its half gone) and no later pass dead-letters."""
    from broker.transaction import DecisionError
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    try:
        dead = await add_half(ctx, b"dead-80h")
        undecided = await add_half(ctx, b"undecided-80h")
        await send(ctx, 200)
        clock.now = T0
        await send(ctx, 150)
        done, _ = await ctx.tx.dead_letter([dead.half_offset], "max-checks")
        assert done == [dead.half_offset]
        tx, real = ctx.tx, ctx.tx.dead_letter
        said = []

        async def resumed_meanwhile(offsets, reason):
            if list(offsets) == [undecided.half_offset]:    # the segment's halves, taken: at work on them
                try:            # the operator's resume lands meanwhile
                    said.append(await tx.resume(dead.half_offset))
                except DecisionError as exc:
                    said.append(exc.remark)
            return await real(offsets, reason)
        tx.dead_letter = resumed_meanwhile
        await Retention(ctx).apply_plan(await spark_like_plan(ctx, clock.now))
        assert undecided.half_offset not in tx.pending
        lost = [off for off in tx.pending if ctx.store.get_record(off) is None]
        assert lost == [], (lost, said)
        assert len(said) == 1 and "retention is removing" in said[0], said
        with pytest.raises(DecisionError) as after:         # and once it is gone, said as gone
            await tx.resume(dead.half_offset)
        assert "removed with its commit-log segment" in after.value.remark
    finally:
        await ctx.store.close()


@bounded(30)
async def test_what_a_resume_is_told_names_the_plan_that_lists_its_half_not_every_plan(tmp_path):
    """--transaction-retention-hours 24 below the nightly plan's --retention-hours (72 by default, one retention
    for segments and halves: ops/spark/expiry.py): a half 30 h old is in no default plan, nor in an expired
    segment. A resume of it was told "the next expiry plan would dead-letter it again": the nightly one would not,
    for 42 hours more."""
    clock = Clock(T0 - 30 * H)
    ctx = await make(tmp_path, clock, transaction_retention_hours=24)
    try:
        half = await add_half(ctx, b"undecided-30h")
        clock.now = T0
        said = await Retention(ctx).undoes_resume(half.half_offset, T0 - 30 * H)
        assert "the next expiry plan" not in said, said
        assert "an expiry plan listing it (the nightly one lists the open halves older than its --retention-hours)" \
            in said, said
        assert await Retention(ctx).undoes_resume(half.half_offset, T0 - 20 * H) is None
    finally:
        await ctx.store.close()


@bounded(30)
async def test_a_listed_half_is_expired_only_if_it_is_the_half_the_plan_saw(world):
    """The plan names a half by its offset and says its store time and uniq key; the segments it lists are checked
    against what the store holds (start, end, newest), the halves were not. A store restored from a backup with the
    same store id, written on since, holds another half at that offset: it was dead-lettered as `expired` on the
    plan's word about another message. Skipped now, with a count and a reason; a plan without the fields (a
    hand-made one) is judged by offset and age as before."""
    ctx, clock, half, old, fresh = world          # the half is 80 hours old by the broker's clock
    tx = ctx.tx.pending[half.half_offset]
    plan = await spark_like_plan(ctx, clock.now)
    plan["segments"] = []
    listed = {"commit_log_offset": half.half_offset, "store_timestamp": tx.store_ts, "uniq_key": tx.uniq_key}
    for other in ({"store_timestamp": tx.store_ts - 3}, {"uniq_key": tx.uniq_key + "X"}):
        summary = await Retention(ctx).apply_plan(dict(plan, halves=[dict(listed, **other)]))
        assert summary["expired"] == [] and half.half_offset in ctx.tx.pending
        assert [s["commit_log_offset"] for s in summary["skipped"]] == [half.half_offset]
        assert "not the half the plan saw" in summary["skipped"][0]["why"]
    # One bit apart is its own record's flipped store time, read with the bit put back: the same half.
    flipped = dict(listed, store_timestamp=tx.store_ts ^ 1 << 40)
    summary = await Retention(ctx).apply_plan(dict(plan, halves=[flipped]))
    assert summary["expired"] == [half.half_offset] and dead_lettered(ctx, half.half_offset)


@bounded(60)
async def test_a_segments_many_undecided_halves_are_dead_lettered_in_a_few_flushes(tmp_path, monkeypatch):
    """Retention dead-letters every undecided half of a segment before it removes it, and a plan its listed halves.
    A decision at a time, each waited for, was one sync flush per half: 300 halves were 300 flushes (an expired
    segment of 100,000 abandoned transactions, 100,000 flushes in a row on the retention pass, 5-10 ms each on a
    disk). Decisions queued together share a group commit as sends do."""
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    try:
        halves = [await add_half(ctx, f"abandoned-{n}".encode()) for n in range(300)]
        clock.now = T0
        flushes = []
        start = type(ctx.store._writer)._start_flush
        monkeypatch.setattr(type(ctx.store._writer), "_start_flush", lambda self: flushes.append(1) or start(self))
        offsets = [h.half_offset for h in halves]
        done, failed = await ctx.tx.dead_letter(offsets, "expired")
        assert sorted(done) == offsets and failed == []
        assert not set(offsets) & set(ctx.tx.pending)
        assert ctx.store.max_offset("TRANS_CHECK_MAX_TIME_TOPIC", 0) == len(offsets)
        assert dead_lettered(ctx, offsets[0])
        assert len(flushes) <= 30, len(flushes)
    finally:
        await ctx.store.close()


@bounded(60)
async def test_a_segments_many_expired_halves_are_said_in_one_line_with_a_sample(tmp_path, caplog):
    """Each dead letter was a WARNING line of its own: an expired segment of 100,000 abandoned transactions wrote
    100,000 lines (about 20 MB of log, and the loop held formatting them) beside the one line retention says for the
    segment. A dead_letter() call says one WARNING: how many, their groups and topics, and the first few named."""
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    try:
        halves = [await add_half(ctx, f"abandoned-{n}".encode()) for n in range(100)]
        clock.now = T0
        caplog.clear()
        done, failed = await ctx.tx.dead_letter([h.half_offset for h in halves], "expired")
        assert len(done) == 100 and failed == []
        lines = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
        assert len(lines) == 1, lines[:3]
        assert lines[0].startswith("100 transactions dead-lettered: expired"), lines[0]
        named = [h for h in halves if f"half {h.half_offset})" in lines[0]]
        assert named and named[0] is halves[0] and len(named) == 5, lines[0]
        assert f"{halves[0].uniq_key} (group {halves[0].group}, topic {halves[0].topic}" in lines[0]
        assert "95 more" in lines[0] and "txmq_transaction_dead_letters_total" in lines[0]
        # one alone is said as before
        caplog.clear()
        one = await add_half(ctx, b"alone")
        clock.now += 80 * H
        await ctx.tx.dead_letter([one.half_offset], "expired")
        assert [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()] == [
            f"transaction {one.uniq_key} (group {one.group}, topic {one.topic}, half {one.half_offset}) dead-lettered:"
            f" expired after {one.checks} checks"]
    finally:
        await ctx.store.close()


async def with_expired_halves(tmp_path, n: int):
    """A store with ``n`` undecided halves past transaction_retention_hours: (ctx, their Pendings)."""
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    try:
        halves = [await add_half(ctx, f"abandoned-{i:03d}".encode()) for i in range(n)]
    except BaseException:
        await ctx.store.close()
        raise
    clock.now = T0
    return ctx, halves


@bounded(60)
async def test_a_commit_arriving_while_a_batch_of_dead_letters_is_queued_is_decided_once(tmp_path):
    """The first decision wins with dead letters queued 32 together: a COMMIT for a half whose dead letter is queued
    (claimed, not yet written) waits for it and is refused as committed after its dead letter; one for a half of
    the next batch, not yet claimed, is written, and retention reports that half not dead-lettered. No half is
    both, none is neither."""
    from broker.transaction.records import COMMIT
    ctx, halves = await with_expired_halves(tmp_path, 64)
    tx = ctx.tx
    try:
        queued, late = halves[5], halves[40]
        put_many, answers, puts = ctx.store.put_many, [], []

        def first_put(reqs, reclaim=False, then=None):
            puts.append(1)
            if len(puts) == 32:     # the first batch handed to the writer, none written: both ENDs come in now
                for p in (queued, late):
                    answer = tx.end(p.half_offset, COMMIT, group=p.group, table_offset=p.queue_offset,
                                    from_check=False)     # awaited at once, as the processor's request task does
                    answers.append(answer if isinstance(answer, tuple) else asyncio.ensure_future(answer))
            return put_many(reqs, reclaim, then)
        ctx.store.put_many = first_put
        done, failed = await tx.dead_letter([h.half_offset for h in halves], "expired")
        del ctx.store.put_many
        assert len(answers) == 2
        got = [a if isinstance(a, tuple) else await a for a in answers]
        assert got[0][0] != 0 and got[1] == (0, COMMIT), got
        assert tx.decision_of(queued.half_offset) == DEAD and tx.decision_of(late.half_offset) == COMMIT
        assert [f["commit_log_offset"] for f in failed] == [late.half_offset]
        assert sorted(done) == sorted(h.half_offset for h in halves if h is not late)
        assert ctx.store.max_offset("TRANS_CHECK_MAX_TIME_TOPIC", 0) == 63 and ctx.store.max_offset("T", 0) == 1
        assert not tx.pending and not tx._deciding
    finally:
        await ctx.store.close()


class DeadLettersQueued:
    """The bytes of dead letters handed to the store's writer and not yet written, at most (``most``)."""

    def __init__(self, store):
        self.now = self.most = 0
        self._put_many = put_many = store.put_many
        probe = self

        class Then:
            def __init__(self, then, size):
                self.then, self.size = then, size

            def done(self):
                return self.then.done()

            def set_result(self, results):
                probe.now -= self.size
                self.then.set_result(results)

        def counting(reqs, reclaim=False, then=None):
            size = sum(len(req.record) for req in reqs if req.topic == "TRANS_CHECK_MAX_TIME_TOPIC")
            if size and then is not None:
                probe.now += size
                probe.most = max(probe.most, probe.now)
                then = Then(then, size)
            return put_many(reqs, reclaim, then)
        store.put_many = counting


@bounded(60)
async def test_large_expired_halves_are_dead_lettered_a_few_bytes_at_a_time(tmp_path, monkeypatch):
    """Dead letters queued 32 together hold each half's copy in memory until written: 32 halves of max_message_size
    (4 MiB) were 130 MiB at once (measured: 37 MiB for 32 of 1 MiB, 3 MiB one at a time). A batch ends at
    DEAD_LETTER_BATCH_BYTES of halves too (here 50 KiB; halves of 20 KiB, their properties naming the body: 3 at a
    time)."""
    import broker.transaction.service as service
    monkeypatch.setattr(service, "DEAD_LETTER_BATCH_BYTES", 50 * 1024, raising=False)
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    try:
        halves = [await add_half(ctx, bytes([65 + n]) * 10 * 1024) for n in range(10)]
        clock.now = T0
        queued = DeadLettersQueued(ctx.store)
        done, failed = await ctx.tx.dead_letter([h.half_offset for h in halves], "expired")
        assert len(done) == 10 and failed == [] and queued.now == 0
        assert 2 * 20 * 1024 < queued.most < 4 * 20 * 1024, queued.most
    finally:
        await ctx.store.close()


@bounded(60)
async def test_a_half_dead_lettered_by_its_check_limit_during_an_expiry_is_said_with_its_own_reason(tmp_path, caplog):
    """A check pass dead-letters a half for max-checks while retention's dead_letter() is dead-lettering it (and
    others) as expired: the check pass claimed it first and its dead letter says max-checks; said among retention's
    expired ones, the line named the wrong reason."""
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    tx = ctx.tx
    try:
        halves = [await add_half(ctx, f"abandoned-{n}".encode()) for n in range(3)]
        checked = halves[0]
        checked.checks = tx.policy.check_max
        clock.now = T0
        caplog.clear()
        await asyncio.gather(tx.run_due(tx.next_due()), tx.dead_letter([h.half_offset for h in halves], "expired"))
        assert not tx.pending
        said = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
        mine = [m for m in said if f"half {checked.half_offset})" in m]
        assert len(mine) == 1 and "max-checks" in mine[0], said
        assert any(m.startswith("2 transactions dead-lettered: expired") for m in said), said
    finally:
        await ctx.store.close()


@bounded(60)
async def test_a_dead_letter_call_cancelled_mid_batch_leaves_each_half_written_or_pending_and_said_once(
        tmp_path, caplog):
    """A stop cancels retention's pass while a batch of dead letters is queued: the queued ones are still written
    (by the writer, whoever waits), counted and said once each; those of batches not begun stay undecided; no claim
    is left behind for a later decision to wait on for ever."""
    ctx, halves = await with_expired_halves(tmp_path, 64)
    tx = ctx.tx
    try:
        put_many, puts = ctx.store.put_many, []
        caplog.clear()
        task = asyncio.ensure_future(tx.dead_letter([h.half_offset for h in halves], "expired"))

        def cancelling(reqs, reclaim=False, then=None):
            puts.append(1)
            if len(puts) == DEAD_LETTER_BATCH:
                task.cancel()
            return put_many(reqs, reclaim, then)
        ctx.store.put_many = cancelling
        with pytest.raises(asyncio.CancelledError):
            await task
        del ctx.store.put_many
        await asyncio.gather(*tx._deciding.values())       # the writer settles what was queued
        assert not tx._deciding and not tx._said_together
        dead = [h for h in halves if tx.decision_of(h.half_offset) == DEAD]
        assert dead == halves[:DEAD_LETTER_BATCH] and set(tx.pending) == {h.half_offset for h in halves[DEAD_LETTER_BATCH:]}
        assert not [p for p in tx.pending.values() if p.deciding]
        assert ctx.store.max_offset("TRANS_CHECK_MAX_TIME_TOPIC", 0) == DEAD_LETTER_BATCH
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert all(text.count(f"half {h.half_offset})") == 1 for h in dead), text[:2000]
        assert not any(f"half {h.half_offset})" in text for h in halves[DEAD_LETTER_BATCH:])
    finally:
        await ctx.store.close()


@bounded(30)
async def test_a_listed_half_the_store_refused_to_dead_letter_is_said_still_undecided(world):
    """A plan's half whose dead letter the store refused (a full disk, an I/O error) was listed under "skipped" with
    the store's remark, alike to one decided meanwhile: `admin apply-expiry` exited 0 and the nightly unit reported
    success while the half stayed undecided. Its entry says it is still undecided; one decided meanwhile does not."""
    from tests.unit.test_review_transactions import GatedStore
    ctx, clock, half, old, fresh = world
    other = await add_half(ctx, b"decided-meanwhile")
    await ctx.tx.decide(other.half_offset, "ROLLBACK")
    plan = dict(await spark_like_plan(ctx, clock.now), segments=[],
                halves=[{"commit_log_offset": half.half_offset}, {"commit_log_offset": other.half_offset}])
    real = ctx.store
    store = ctx.store = GatedStore(real)
    store.gate, store.fail = asyncio.Event(), True          # every write refused
    store.gate.set()
    try:
        summary = await Retention(ctx).apply_plan(plan)
    finally:
        ctx.store = real
    skipped = {s["commit_log_offset"]: s for s in summary["skipped"]}
    assert summary["expired"] == [] and set(skipped) == {half.half_offset, other.half_offset}
    assert skipped[half.half_offset].get("undecided") is True and half.half_offset in ctx.tx.pending
    assert "undecided" not in skipped[other.half_offset]


def _removals_fail_read_only(store) -> list:
    """Has the store's every segment removal fail EROFS, as unlinking on a read-only file system does: the list of
    the segments it was asked to remove."""
    tried = []

    async def read_only_remove(name, reason=""):
        tried.append(name)
        raise OSError(errno.EROFS, "Read-only file system")
    store.remove_segment = read_only_remove
    return tried


@bounded(30)
async def test_a_read_only_store_pauses_the_cleaner_said_once_not_an_error_every_pass(world, caplog):
    """On a store whose file system turned read-only, above disk_clean_ratio with an expired segment, every pass
    (each disk_clean_interval_s, 5 s) tried to remove it: a WARNING "removing segment" and the ERROR of its
    failure (EROFS unlinking it), forever. The cleaner is now paused, said once, and goes on once it can write."""
    ctx, *_ = world
    store = ctx.store
    real_remove, tried = store.remove_segment, _removals_fail_read_only(store)
    store.disk.read_only = True                     # what the probe reads from statvfs / the mount table
    r = Retention(ctx, usage=lambda: 0.9)
    before = names(ctx)
    for _ in range(3):
        assert await r.clean_once() == []
    assert tried == [] and names(ctx) == before
    paused = [rec for rec in caplog.records if "retention paused" in rec.getMessage()]
    assert len(paused) == 1 and "read-only" in paused[0].getMessage(), caplog.text
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"], caplog.text
    store.remove_segment, store.disk.read_only = real_remove, False     # repaired
    removed = await r.clean_once()
    assert removed and removed[0] == (before[0], "expired"), removed


@bounded(30)
async def test_a_removal_that_meets_a_read_only_file_system_first_pauses_the_cleaner(world, caplog):
    """ext4's emergency_ro is seen in the mount table only (read every 5 s): a pass in between tried the removal,
    met EROFS, and the next pass tried the next segment (measured on an ext4 loop device, a pass every 2 s: an
    ERROR a pass, one segment after another). The first EROFS pauses the cleaner until the disk monitor has seen
    the file system read-only, which then decides. Said in one line, the ERROR naming the pause and what to do (a
    WARNING "retention paused" followed it, saying the same again)."""
    ctx, *_ = world
    store = ctx.store
    real_remove, tried = store.remove_segment, _removals_fail_read_only(store)
    r = Retention(ctx, usage=lambda: 0.8)
    before = names(ctx)
    for _ in range(3):
        assert await r.clean_once() == []
    assert tried == before[:1], tried
    errors = [rec for rec in caplog.records if rec.levelname == "ERROR"]
    assert len(errors) == 1 and "read-only" in errors[0].getMessage(), caplog.text
    assert "retention paused" in errors[0].getMessage() and "dmesg" in errors[0].getMessage(), caplog.text
    assert sum("retention paused" in rec.getMessage() for rec in caplog.records) == 1, caplog.text
    store.disk.read_only = True                     # the monitor sees it
    assert await r.clean_once() == [] and tried == before[:1]
    store.remove_segment, store.disk.read_only = real_remove, False     # repaired
    removed = await r.clean_once()
    assert removed and removed[0] == (before[0], "expired"), removed


@bounded(30)
async def test_a_removal_meeting_erofs_the_disk_monitor_never_sees_is_tried_again_after_its_next_reading(world, caplog):
    """A bind mount or an overlay: the removal met EROFS but statvfs and the mount table both say read-write, so the
    disk monitor never sets read_only. The pause waited for it: retention stopped for as long as the broker ran, and
    a disk writable again (remounted rw) filled up with nothing removed and nothing said. The pause lasts until the
    monitor's next mount-table reading; then the cleaner tries again (said once, not an ERROR a pass)."""
    ctx, *_ = world
    store = ctx.store
    real_remove, tried = store.remove_segment, _removals_fail_read_only(store)
    store.disk._mounted_read_only = lambda path, dev=None: False      # the table says rw, as statvfs does

    def monitor_reads():                # a turn of the store's disk loop that read the mount table
        store.disk.read_mounts()
        store.disk.probe()
    r = Retention(ctx, usage=lambda: 0.8)
    before = names(ctx)
    assert await r.clean_once() == [] and await r.clean_once() == []
    assert tried == before[:1], tried                     # paused until the monitor has looked
    for turn in range(3):
        monitor_reads()
        assert await r.clean_once() == []
        assert tried == before[:1] * (turn + 2), tried    # tried again once after each reading, not paused forever
    assert store.disk.read_only is False
    errors = [rec for rec in caplog.records if rec.levelname == "ERROR"]
    assert len(errors) == 1 and "read-only" in errors[0].getMessage(), caplog.text
    unseen = [rec for rec in caplog.records if "does not see" in rec.getMessage()]
    assert len(unseen) == 1 and unseen[0].levelname == "WARNING", caplog.text
    store.remove_segment = real_remove                    # remounted rw
    monitor_reads()
    removed = await r.clean_once()
    assert removed and removed[0] == (before[0], "expired"), removed


@bounded(30)
async def test_a_segment_whose_file_cannot_be_unlinked_stays_in_the_running_log(world, monkeypatch, caplog):
    """A removal whose segment file cannot be unlinked (EACCES: an immutable file, a directory's permissions; EIO)
    took the segment out of the running log first: its records unreadable, the log's start past it, its files on
    disk (the space not freed, so the next pass removed the next segment the same way, one a pass, every 5 s: the
    whole log but the active segment unreadable until a restart brought it back). The unlink comes first now: a
    segment that cannot be is kept, readable, and the pass says so."""
    ctx, _clock, _half, old, _fresh = world
    store = ctx.store
    log_dir = os.path.realpath(store._log.directory)
    _segment_unlinks_fail(monkeypatch, store, errno.EACCES)
    r = Retention(ctx, usage=lambda: 0.9)
    before, start = names(ctx), store.min_physical_offset
    assert len(before) >= 3, before
    for _ in range(3):                      # three passes of the cleaner's loop
        with contextlib.suppress(OSError):
            await r.clean_once()
    assert names(ctx) == before and store.min_physical_offset == start
    assert readable(ctx, old) == len(old)
    monkeypatch.undo()                                             # repaired
    removed = await r.clean_once()
    assert removed and removed[0][0] == before[0], removed
    assert not os.path.exists(os.path.join(log_dir, before[0]))


def _segment_unlinks_fail(monkeypatch, store, code: int, after: int = 0) -> None:
    """Has unlinking a file of the store's commit-log directory fail with ``code`` (EACCES: an immutable file, the
    directory's permissions; EIO), once ``after`` of them went."""
    real_unlink, log_dir = os.unlink, os.path.realpath(store._log.directory)
    went = []

    def unlink(path, *a, **k):
        if (os.path.realpath(os.path.dirname(os.fspath(path))) == log_dir and path not in went
                and len(went) >= after):
            raise OSError(code, os.strerror(code), path)
        went.append(path)
        return real_unlink(path, *a, **k)
    monkeypatch.setattr(os, "unlink", unlink)


@bounded(30)
@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO])
async def test_a_segment_that_cannot_be_unlinked_is_said_once_per_failure_run_and_counted(world, monkeypatch, caplog,
                                                                                         code):
    """A segment file the file system would not unlink (EACCES, EIO) is kept, readable; the error was raised out of
    the pass, and the cleaner's loop logged "disk pressure check failed" at ERROR every disk_clean_interval_s (5 s)
    for as long as it lasted, counted nowhere. Now each failed pass is counted, the failure said once with what to
    do, and said again after a removal succeeded."""
    ctx, *_ = world
    store = ctx.store
    _segment_unlinks_fail(monkeypatch, store, code)
    r = Retention(ctx, usage=lambda: 0.9)
    before = names(ctx)
    for _ in range(4):
        assert await r.clean_once() == []
    assert names(ctx) == before
    failed = ctx.metrics.segment_removals_failed.labels("segment", errno.errorcode[code])._value.get()
    assert failed == 4
    errors = [rec.getMessage() for rec in caplog.records if rec.levelname == "ERROR"]
    assert len(errors) == 1 and before[0] in errors[0] and "kept, readable" in errors[0], errors
    assert ("dmesg" if code == errno.EIO else "chattr -i") in errors[0], errors
    assert sum("removing segment" in rec.getMessage() for rec in caplog.records) == 1, caplog.text
    monkeypatch.undo()              # repaired, and failing again after one more went: a new run, said again
    _segment_unlinks_fail(monkeypatch, store, code, after=1)
    assert await r.clean_once() == [(before[0], "expired")]
    assert names(ctx) == before[1:]
    assert sum(rec.levelname == "ERROR" for rec in caplog.records) == 2, caplog.text


@bounded(30)
async def test_a_queue_file_that_cannot_be_unlinked_leaves_the_removal_whole_and_the_next_start_working(tmp_path,
                                                                                                        monkeypatch,
                                                                                                        caplog):
    """A segment removal whose first consume-queue file could not be unlinked (EACCES: an immutable queue directory;
    EIO) raised out of the middle of it: the segment was gone and the queue's minimum past it, but the queue files
    after that one stayed on disk and mapped, the message index was not told, the removal not counted nor said, and
    the pass's ERROR said "disk pressure check failed" only. At the next start the same file, still there, raised out
    of recovery: the broker did not start. Now the removal completes (the file closed and counted, said once) and a
    start passes over a file it cannot remove, said."""
    clock = Clock(T0 - 80 * H)
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=16)
    ctx = await make(tmp_path, clock, cfg)
    old = await send(ctx, 200)
    clock.now = T0
    await send(ctx, 20)
    store = ctx.store
    queue_dir = os.path.join(tmp_path, "s", "consumequeue", "Flow", "0")
    first = sorted(os.listdir(queue_dir))[0]
    real_unlink, refused = os.unlink, []

    def unlink(path, *a, **k):
        if os.path.basename(os.fspath(path)) == first and os.path.dirname(os.fspath(path)) == queue_dir:
            refused.append(path)
            raise OSError(errno.EACCES, "Permission denied", path)
        return real_unlink(path, *a, **k)
    monkeypatch.setattr(os, "unlink", unlink)
    r = Retention(ctx, usage=lambda: 0.8)
    before = names(ctx)
    removed = await r.clean_once()
    assert [n for n, _ in removed] == [n for n in before[:-1]][:len(removed)] and removed, removed
    assert refused and os.path.exists(os.path.join(queue_dir, first))
    in_first = [r_ for r_ in old if r_.physical_offset < SEG]
    kept_files = len(os.listdir(queue_dir)) - len(store._cqs[("Flow", 0)].files)
    assert kept_files >= 1, kept_files         # the refused one and its later ones: no gap on disk
    low = store.min_offset("Flow", 0)
    assert low >= len(in_first)
    got = store.get_messages("Flow", 0, low, 4, 1 << 20)
    assert got.status == GetStatus.FOUND, got.status
    # each removal's files of the queue stayed behind the refused one: counted each, said once
    assert ctx.metrics.segment_removals_failed.labels("queue-file", "EACCES")._value.get() == len(removed)
    errors = [rec.getMessage() for rec in caplog.records if rec.levelname == "ERROR"]
    assert len(errors) == 1 and "consume-queue file" in errors[0] and "chattr -i" in errors[0], errors
    assert sum("removed segment" in rec.getMessage() for rec in caplog.records) == len(removed), caplog.text
    await store.close()

    async with _reopened(tmp_path, cfg, clock) as reopened:     # the file still cannot go
        assert reopened.min_offset("Flow", 0) == low and reopened.report.queues_rebuilt == []
        assert os.path.exists(os.path.join(queue_dir, first))
        assert any("could not be removed" in rec.getMessage() for rec in caplog.records), caplog.text
    monkeypatch.undo()                                              # made mutable again: the next start removes it
    again = MessageStore(str(tmp_path / "s"), cfg, clock=clock)
    await again.open()
    try:
        assert again.min_offset("Flow", 0) == low and not os.path.exists(os.path.join(queue_dir, first))
        assert again.report.queues_rebuilt == [] and sorted(os.listdir(queue_dir))[0] != first
    finally:
        await again.close()


@bounded(30)
async def test_a_plan_whose_segment_cannot_be_unlinked_keeps_it_in_its_reply(world, monkeypatch):
    """A listed segment whose file could not be unlinked (EACCES, EIO) raised out of the plan's apply: the admin got
    SYSTEM_ERROR with the errno alone, no summary of the halves it had dead-lettered already, nothing counted. It is
    kept now, with the reason and what to do in the reply and the log, and counted; every later one waits with it."""
    ctx, clock, half, old, _fresh = world
    before = names(ctx)
    plan = await spark_like_plan(ctx, clock.now)
    assert len(plan["segments"]) >= 2
    _segment_unlinks_fail(monkeypatch, ctx.store, errno.EACCES)
    summary = await Retention(ctx).apply_plan(plan)
    assert summary["segments_removed"] == [] and names(ctx) == before
    kept = summary["segments_kept"]
    assert [k["name"] for k in kept] == [s["name"] for s in plan["segments"]]
    assert "Permission denied" in kept[0]["why"] and "chattr -i" in kept[0]["why"], kept
    assert ctx.metrics.segment_removals_failed.labels("segment", "EACCES")._value.get() == 1
    assert readable(ctx, old) == len(old)


async def _queue_files_refused(tmp_path, monkeypatch, first_only=False):
    """400 messages (200 written 80 h ago) in 16-unit queue files; unlinking a file of Flow-0's queue (its first
    only, or every one) fails EACCES. Returns the context, clock, store config, that directory and the refusing
    unlink."""
    clock = Clock(T0 - 80 * H)
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=16)
    ctx = await make(tmp_path, clock, cfg)
    await send(ctx, 200)
    clock.now = T0
    await send(ctx, 200)
    queue_dir = os.path.join(tmp_path, "s", "consumequeue", "Flow", "0")
    first, real_unlink = sorted(os.listdir(queue_dir))[0], os.unlink

    def unlink(path, *a, **k):
        if os.path.dirname(os.fspath(path)) == queue_dir and (not first_only or os.path.basename(path) == first):
            raise OSError(errno.EACCES, "Permission denied", path)
        return real_unlink(path, *a, **k)
    monkeypatch.setattr(os, "unlink", unlink)
    return ctx, clock, cfg, queue_dir, unlink


@bounded(30)
@pytest.mark.parametrize("still_refused", [False, True])
async def test_a_live_queue_file_lost_next_to_a_removals_leftover_is_still_rebuilt(tmp_path, monkeypatch,
                                                                                 still_refused):
    """A leftover (a queue file a removal could not unlink, wholly below the log's start) and, after it, a queue
    file of the live range lost (a disk, a hand): the gap is real damage. It was taken for the removal's leftovers
    because the file before it is below the log's start: the lost file's units, still in the log, left the queue
    without a word (its minimum moved past them). It is rebuilt from the log, as any gap in the live range is (the
    leftover still not removable: the start goes on, rebuilding)."""
    ctx, clock, cfg, queue_dir, unlink = await _queue_files_refused(tmp_path, monkeypatch, first_only=True)
    store = ctx.store
    first = sorted(os.listdir(queue_dir))[0]
    assert await Retention(ctx, usage=lambda: 0.8).clean_once()
    monkeypatch.undo()
    cq = store._cqs[("Flow", 0)]
    low, high = store.min_offset("Flow", 0), store.max_offset("Flow", 0)
    live_first = cq.files[0].start
    assert os.path.exists(os.path.join(queue_dir, first)) and len(cq.files) >= 2, len(cq.files)
    next_start = cq.files[1].start // 20
    assert low < next_start, (low, next_start)           # the first live file holds units consumers still need
    await store.close()
    os.unlink(os.path.join(queue_dir, f"{live_first:020d}"))        # lost: a disk, a hand
    if still_refused:
        monkeypatch.setattr(os, "unlink", unlink)
    async with _reopened(tmp_path, cfg, clock) as reopened:
        assert reopened.report.queues_rebuilt == ["Flow-0"], reopened.report.queues_rebuilt
        assert (reopened.min_offset("Flow", 0), reopened.max_offset("Flow", 0)) == (low, high)
        got = reopened.get_messages("Flow", 0, low, 4, 1 << 20)
        assert got.status == GetStatus.FOUND and decode_record(got.buffers[0])[0].queue_offset == low, got.status


@bounded(30)
async def test_queue_files_a_removal_left_go_at_a_later_removal_once_they_can(tmp_path, monkeypatch):
    """Queue files a removal could not unlink (an immutable queue directory, made mutable again; EIO gone) stayed on
    disk until a restart: every later removal's files of that queue joined them, for as long as the broker ran. A
    later removal tries them again, oldest first."""
    ctx, clock, cfg, queue_dir, unlink = await _queue_files_refused(tmp_path, monkeypatch)
    store = ctx.store
    level = [0.8]
    r = Retention(ctx, usage=lambda: level[0])
    assert await r.clean_once()
    cq = store._cqs[("Flow", 0)]
    live = {f"{mf.start:020d}" for mf in cq.files}
    left = sorted(set(os.listdir(queue_dir)) - live)
    assert left, os.listdir(queue_dir)
    monkeypatch.undo()                                              # made mutable again, no restart
    level[0] = 0.99                                                 # (force: the expired ones went)
    assert await r.clean_once()
    assert not set(left) & set(os.listdir(queue_dir)), (left, os.listdir(queue_dir))
    assert set(os.listdir(queue_dir)) == {f"{mf.start:020d}" for mf in cq.files}
    await send(ctx, 200)
    monkeypatch.setattr(os, "unlink", unlink)                       # refused again, across a restart
    await store.remove_segment(store._log.segments[0].name)
    assert len(store._log.segments) >= 3
    await store.close()
    async with _reopened(tmp_path, cfg, clock) as reopened:
        cq = reopened._cqs[("Flow", 0)]
        left = sorted(set(os.listdir(queue_dir)) - {f"{mf.start:020d}" for mf in cq.files})
        assert left and reopened.report.queues_rebuilt == [], (left, reopened.report.queues_rebuilt)
        assert reopened.report.gone_segments == [], reopened.report.gone_segments     # (the manifest was written)
        monkeypatch.undo()
        await reopened.remove_segment(reopened._log.segments[0].name)      # no restart: the removal takes them
        assert set(os.listdir(queue_dir)) == {f"{mf.start:020d}" for mf in cq.files}, os.listdir(queue_dir)


@bounded(30)
async def test_a_queue_file_lost_in_the_live_range_after_removals_is_rebuilt(tmp_path, monkeypatch):
    """The leftovers rule leaves real damage alone: segments removed whole (the log starting past 0), then a queue
    file in the middle of the live range lost: the queue is rebuilt from the log, its offsets what they were."""
    ctx, clock, cfg, queue_dir, _unlink = await _queue_files_refused(tmp_path, monkeypatch)
    monkeypatch.undo()
    store = ctx.store
    assert await Retention(ctx, usage=lambda: 0.8).clean_once() and store.min_physical_offset > 0
    cq = store._cqs[("Flow", 0)]
    assert len(cq.files) >= 3, len(cq.files)
    low, high, middle = store.min_offset("Flow", 0), store.max_offset("Flow", 0), cq.files[1].start
    await store.close()
    os.unlink(os.path.join(queue_dir, f"{middle:020d}"))
    async with _reopened(tmp_path, cfg, clock) as reopened:
        assert reopened.report.queues_rebuilt == ["Flow-0"], reopened.report.queues_rebuilt
        assert (reopened.min_offset("Flow", 0), reopened.max_offset("Flow", 0)) == (low, high)
        assert reopened.get_messages("Flow", 0, middle // 20, 4, 1 << 20).status == GetStatus.FOUND



async def _aligned_queue_files(tmp_path, monkeypatch):
    """Four segments, each holding one whole 16-unit file of Flow-0 then filler (Other) up to the segment's end (a
    queue file ending with a segment); unlinking Flow-0's first file fails EPERM (chattr +i on that file). Returns
    the context, clock, store config, the queue's directory, that file's name and the refusing unlink."""
    clock = Clock(T0 - 80 * H)
    cfg = StoreConfig(segment_size=SEG, cq_units_per_file=16)
    ctx = await make(tmp_path, clock, cfg)
    store = ctx.store
    for _ in range(4):
        await send(ctx, 16)
        segments = len(store._log.segments)
        for _ in range(100):
            await send(ctx, 1, topic="Other")
            if len(store._log.segments) > segments:
                break
    queue_dir = os.path.join(tmp_path, "s", "consumequeue", "Flow", "0")
    first, real_unlink = sorted(os.listdir(queue_dir))[0], os.unlink

    def unlink(path, *a, **k):
        if os.fspath(path) == os.path.join(queue_dir, first):
            raise OSError(errno.EPERM, "Operation not permitted", path)
        return real_unlink(path, *a, **k)
    monkeypatch.setattr(os, "unlink", unlink)
    return ctx, clock, cfg, queue_dir, first, unlink


@bounded(30)
@pytest.mark.parametrize("restart_refused", [False, True])
async def test_a_later_removal_leaves_no_gap_after_a_refused_queue_file(tmp_path, monkeypatch, restart_refused):
    """A queue file a removal could not unlink (chattr +i on that file, EIO on its inode: the file's error, not its
    directory's) and the next removal: the leftover refused again, that removal's own files of the queue were
    unlinked all the same, a gap on disk between the leftover and the live files. A start took the gap for a live
    file lost when the file after it began at the log's start (a queue file ending with a segment), and rebuilt the
    queue from the log as damaged. The files after a refused leftover wait with it, as its directory's leftovers do."""
    ctx, clock, cfg, queue_dir, first, _unlink = await _aligned_queue_files(tmp_path, monkeypatch)
    store = ctx.store
    for _ in range(2):
        await store.remove_segment(store._log.segments[0].name)
        assert len(store.queue_files_left) == 1, store.queue_files_left     # each removal's: counted, said once
    starts = sorted(int(n) for n in os.listdir(queue_dir))
    assert starts[0] == int(first) and len(starts) >= 3, starts
    assert [b - a for a, b in zip(starts, starts[1:])] == [16 * 20] * (len(starts) - 1), starts    # no gap
    low = store.min_offset("Flow", 0)
    await store.close()
    if not restart_refused:
        monkeypatch.undo()
    async with _reopened(tmp_path, cfg, clock) as reopened:
        assert reopened.report.queues_rebuilt == [], reopened.report.queues_rebuilt
        assert reopened.min_offset("Flow", 0) == low
        assert os.path.exists(os.path.join(queue_dir, first)) == restart_refused


@bounded(30)
async def test_concurrent_removals_keep_the_first_ones_refused_queue_file(tmp_path, monkeypatch):
    """Two removals at once (store.remove_segment has no lock of its own): the second's writer op ran while the
    first's queue-file job was still queued on the flush thread, so it took the leftovers from before the first's
    refusal; the second's result, assigned last, dropped the refused file (not retried until a restart) and the
    second's own file of that queue was unlinked behind it: a gap, the queue rebuilt as damaged at the next start."""
    ctx, clock, cfg, queue_dir, first, _unlink = await _aligned_queue_files(tmp_path, monkeypatch)
    store = ctx.store
    io, release, jobs = store._io, threading.Event(), []
    held = io.submit(release.wait, 10)      # the flush thread busy: both removals' queue-file jobs wait behind it
    real_submit = io.submit

    def submit(fn, *args, **kwargs):
        if fn is store_module._remove_runs:
            jobs.append(fn)
        return real_submit(fn, *args, **kwargs)
    monkeypatch.setattr(io, "submit", submit)
    removals = []
    for seg in store._log.segments[:2]:     # the second begun once the first's writer op has queued its job
        removals.append(asyncio.ensure_future(store.remove_segment(seg.name)))
        for _ in range(1000):
            if len(jobs) == len(removals) or removals[-1].done():
                break
            await asyncio.sleep(0.01)
    assert len(jobs) == 2 and not any(r.done() for r in removals), (jobs, removals)
    release.set()
    await held
    await asyncio.gather(*removals)
    starts = sorted(int(n) for n in os.listdir(queue_dir))
    assert starts[0] == int(first) and len(starts) >= 3, starts
    assert [b - a for a, b in zip(starts, starts[1:])] == [16 * 20] * (len(starts) - 1), starts    # no gap
    assert os.path.join(queue_dir, first) in store._queue_leftovers, store._queue_leftovers
    low = store.min_offset("Flow", 0)
    await store.close()
    async with _reopened(tmp_path, cfg, clock) as reopened:
        assert reopened.report.queues_rebuilt == [], reopened.report.queues_rebuilt
        assert reopened.min_offset("Flow", 0) == low


@bounded(30)
async def test_a_start_leaves_no_gap_after_a_leftover_it_could_not_remove(tmp_path, monkeypatch):
    """A start whose queue held a leftover it could not remove before a gap (an older broker's removals unlinked the
    files after it), then files wholly below the log's start: recovery unlinked those, the gap moved up to the live
    files, and the next start, the file after the gap beginning at the log's start, rebuilt the queue as damaged."""
    ctx, clock, cfg, queue_dir, first, _unlink = await _aligned_queue_files(tmp_path, monkeypatch)
    store = ctx.store
    for _ in range(3):
        await store.remove_segment(store._log.segments[0].name)
    starts = sorted(int(n) for n in os.listdir(queue_dir))
    assert len(starts) == 4, starts         # the refused one, two waiting behind it, the live one
    low = store.min_offset("Flow", 0)
    await store.close()
    os.unlink(os.path.join(queue_dir, f"{starts[1]:020d}"))         # the gap an older broker left
    for _ in range(2):                      # the file still refused at both starts
        async with _reopened(tmp_path, cfg, clock) as reopened:
            assert reopened.report.queues_rebuilt == [], reopened.report.queues_rebuilt
            assert reopened.min_offset("Flow", 0) == low
    assert sorted(int(n) for n in os.listdir(queue_dir)) == [starts[0]] + starts[2:]


@bounded(30)
async def test_a_kept_segments_halves_are_dead_lettered_once_and_its_index_entries_kept(tmp_path, monkeypatch):
    """A segment whose file cannot be unlinked, holding an undecided half: the pass dead-letters the half, then the
    removal is refused and the segment kept. The passes after it, and a restart (transaction recovery reading the
    kept half again), do not dead-letter it again; the removal listeners (the message index's expiry) are not told
    of a removal that did not happen, so queries by key still find the kept segment's messages. A start does not
    take the kept segment for gone (crash1's check); removed by hand after, it is."""
    clock = Clock(T0 - 80 * H)
    ctx = await make(tmp_path, clock)
    half = await add_half(ctx, b"undecided-80h")
    old = await send(ctx, 200)
    clock.now = T0
    await send(ctx, 150)
    told = []
    ctx.store.add_removal_listener(told.append)
    _segment_unlinks_fail(monkeypatch, ctx.store, errno.EACCES)
    before = names(ctx)
    r = Retention(ctx, usage=lambda: 0.9)
    for _ in range(3):
        assert await r.clean_once() == []
    plan = await spark_like_plan(ctx, clock.now)
    assert (await Retention(ctx).apply_plan(plan))["segments_kept"]
    assert names(ctx) == before and told == [] and readable(ctx, old) == len(old)

    def copies():
        got = ctx.store.get_messages("TRANS_CHECK_MAX_TIME_TOPIC", 0, 0, 64, 1 << 20)
        return sum(decode_record(b)[0].properties.get("TXMQ_HALF") == str(half.half_offset) for b in got.buffers)
    assert copies() == 1 and half.half_offset not in ctx.tx.pending
    await ctx.store.close()
    ctx = await make(tmp_path, clock)                               # a restart, the segment still there
    try:
        assert half.half_offset not in ctx.tx.pending and ctx.store.report.gone_segments == []    # not "gone"
        assert await Retention(ctx, usage=lambda: 0.9).clean_once() == []
        assert copies() == 1
    finally:
        await ctx.store.close()
    monkeypatch.undo()
    os.unlink(os.path.join(tmp_path, "s", "commitlog", before[0]))     # an operator's rm: the manifest names it
    ctx = await make(tmp_path, clock)
    try:
        assert ctx.store.report.gone_segments == [before[0]] and copies() == 1
    finally:
        await ctx.store.close()


async def test_an_unreadable_file_before_a_queue_gap_is_taken_for_damage_not_a_failed_start(tmp_path, monkeypatch):
    """The leftovers rule reads the older file's last unit to date it; one that cannot be read (EIO) is not
    dated: the gap is taken as before (the older files unlinked, the queue rebuilt), the start not failed."""
    from broker.store import consume_queue as cq_module
    size = 4 * cq_module.UNIT_SIZE
    directory = tmp_path / "q"
    directory.mkdir()
    for start in (0, 2 * size):
        (directory / f"{start:020d}").write_bytes(cq_module.UNIT.pack(start, 10, 0) * 4)

    def eio(path, *args):
        if os.path.basename(path) == f"{0:020d}":
            raise OSError(errno.EIO, "Input/output error", path)
        return open(path, *args)
    monkeypatch.setattr(cq_module, "open", eio, raising=False)
    cq = cq_module.ConsumeQueue.load(str(directory), "T", 0, size, log_start=1 << 40)
    monkeypatch.undo()
    try:
        assert cq.damaged and not cq.leftovers
        assert sorted(os.listdir(directory)) == [f"{2 * size:020d}"]
    finally:
        cq.close()
