"""The admin list (TXMQ_LIST_TRANSACTIONS) at a large backlog: the oldest read off the age heaps, the answer capped.

An operator lists in-doubt transactions during an incident, when there are most of them: the list sorted the
whole undecided index on the loop (90-105 ms at 500k), and any limit was obeyed (limit=10**9 at 500k: 3.5 s
and a 118 MB body, past the 16 MB a client reads). Work is counted here (age-heap entries examined), not timed.
"""
from __future__ import annotations

import asyncio
import json
import random
import types

import pytest

from broker.processors import transaction as processor
from broker.transaction.check import Policy
from broker.transaction.core import TransactionCore, Tx
from broker.transaction.service import TransactionService
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import HeaderError
from tests.support.bounded import bounded, other_client

POLICY = Policy(check_interval_ms=60_000, timeout_ms=6_000, check_max=15, retention_ms=72 * 3600_000)
GROUPS = ("PG0", "PG1", "PG2", "PG3")


def _service(n: int, decided_every: int = 0):
    """A stub service on a real core holding ``n`` undecided of GROUPS, stored in a shuffled order."""
    core = TransactionCore(POLICY, lambda off: None)
    stamps = list(range(n))
    random.Random(7).shuffle(stamps)
    for off, ts in enumerate(stamps):
        core.add(Tx(off * 100, off, GROUPS[off % len(GROUPS)], "T", f"U{off}", 1_000_000 + ts, owner_id="c@1"))
    if decided_every:       # decided since: their age-heap entries stay behind until they reach a top
        for off in range(0, n, decided_every):
            core.withdraw(off * 100)
    clients = types.SimpleNamespace(producer_channels=lambda group: [], left_group=lambda conn, group: False)
    ctx = types.SimpleNamespace(clock=lambda: 2_000_000, monotonic=lambda: 0, clients=clients,
                                config=types.SimpleNamespace(broker_role="ASYNC_MASTER"))
    svc = types.SimpleNamespace(ctx=ctx, core=core, pending=core.pending, dead_count=0)
    svc._sender = types.MethodType(TransactionService._sender, svc)
    svc.describe = types.MethodType(TransactionService.describe, svc)
    ctx.tx = svc
    return ctx, core


def _list(ctx, **fields):
    resp = processor.list_transactions(ctx, None, RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, fields))
    assert resp.code == ResponseCode.SUCCESS
    return json.loads(resp.body_bytes())


@pytest.mark.parametrize("group", [None, "PG2"])
def test_the_oldest_are_read_off_the_age_heaps_not_a_sort_of_the_index(group, monkeypatch):
    monkeypatch.setattr(processor, "LISTED_MAX", 10_000)      # to list them all below
    ctx, core = _service(8_000, decided_every=7)
    resumed = core.pending[300]         # indexed again (a resume): on its age heap twice, listed once
    core.withdraw(300)
    core.add(resumed)
    want = sorted((t for t in core.pending.values() if group in (None, t.group)), key=lambda t: t.store_ts)
    listed = _list(ctx, group=group, limit=25)
    assert [r["commit_log_offset"] for r in listed["pending"]] == [t.half_offset for t in want[:25]]
    assert (listed["total"], listed["more"], listed["limit"]) == (len(want), len(want) - 25, 25)
    # 25 listed, and the entries of decided transactions older than the 25th (1 in 7): never the 8,000.
    assert core.examined <= 25 * 2 + 10, core.examined
    everything = _list(ctx, group=group, limit=len(want))
    assert [r["commit_log_offset"] for r in everything["pending"]] == [t.half_offset for t in want]
    assert everything["more"] == 0


def test_a_huge_limit_is_capped_and_the_rest_is_counted(monkeypatch):
    monkeypatch.setattr(processor, "LISTED_MAX", 40)
    ctx, core = _service(1_000)
    listed = _list(ctx, limit=10**9)
    assert (len(listed["pending"]), listed["total"], listed["more"], listed["limit"]) == (40, 1_000, 960, 40)
    assert core.examined == 40
    assert _list(ctx, group="PG1", limit=0) == {"pending": [], "total": 250, "more": 250, "limit": 0,
                                                "dead_lettered": 0}
    assert _list(ctx, group="nobody", limit=5)["total"] == 0


def test_a_negative_limit_is_refused():
    ctx, _ = _service(3)
    with pytest.raises(HeaderError, match="limit=-1"):
        processor.list_transactions(ctx, None, RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS,
                                                                       {"limit": -1}))


def test_decided_transactions_older_than_the_listed_are_not_read_at_each_list():
    """The age heaps dropped the entries of decided transactions only when the metrics were scraped: a broker
    nobody scraped had a list read every one of them, older than what it lists, at each request."""
    ctx, core = _service(5_000)
    for tx in sorted(core.pending.values(), key=lambda t: t.store_ts)[:4_000]:
        core.withdraw(tx.half_offset)
    listed = _list(ctx, limit=10)
    assert (len(listed["pending"]), listed["total"]) == (10, 1_000)
    assert core.examined == 10
    core.examined = 0
    assert len(_list(ctx, group="PG1", limit=10)["pending"]) == 10 and core.examined == 10


def test_decided_transactions_under_an_old_undecided_one_are_not_read_at_each_list():
    """One old transaction stays undecided (its producer gone) while thousands after it are decided, then a backlog
    arrives: the decided ones' entries are under its top, never popped, and short of the rebuild threshold (twice
    the live ones): a list of 10 read every one of them, each request (a sort of the index cost less)."""
    core = TransactionCore(POLICY, lambda off: None)
    core.add(Tx(0, 0, "PG0", "T", "U0", 1_000, owner_id="c@1"))               # stuck
    for off in range(1, 20_001):                                                  # decided since
        core.add(Tx(off * 100, off, "PG0", "T", f"U{off}", 1_000 + off, owner_id="c@1"))
        core.withdraw(off * 100)
    for off in range(20_001, 40_001):                                             # the backlog
        core.add(Tx(off * 100, off, "PG0", "T", f"U{off}", 1_000 + off, owner_id="c@1"))
    want = [0] + [off * 100 for off in range(20_001, 20_010)]
    assert [t.half_offset for t in core.oldest(None, 10)] == want
    assert [t.half_offset for t in core.oldest("PG0", 10)] == want
    assert core.examined <= 2 * 2_000, core.examined


def _page(ctx, **fields):
    """A page of the paged list (the request names "after"): its processor answers from a coroutine."""
    resp = asyncio.run(processor.list_transactions(ctx, None, RemotingCommand.request(
        RequestCode.TXMQ_LIST_TRANSACTIONS, fields)))
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    return json.loads(resp.body_bytes())


@pytest.mark.parametrize("group", [None, "PG1"])
def test_pages_reach_every_undecided_past_the_oldest_the_list_caps(group, monkeypatch):
    """The list answered the oldest LISTED_MAX alone and no request reached the rest (50,000 in doubt: the newest
    48,000 unseen). Pages by half-queue offset reach all of them, each once, in the order they were stored, even
    as transactions are decided between two pages."""
    monkeypatch.setattr(processor, "LISTED_MAX", 40)
    ctx, core = _service(1_000)
    assert _list(ctx, group=group, limit=10**9)["more"] > 0      # the unpaged list: its cap, and no way past it
    want = [t for t in sorted(core.pending.values(), key=lambda t: t.queue_offset) if group in (None, t.group)]
    seen, after, pages = [], -1, 0
    while after is not None:
        page = _page(ctx, group=group, limit=10**9, after=after)
        assert len(page["pending"]) <= 40 and page["total"] == sum(group in (None, t.group)
                                                                   for t in core.pending.values())
        seen += [r["queue_offset"] for r in page["pending"]]
        after, pages = page["next_after"], pages + 1
        if pages == 3:      # decided between pages: one listed already, one not yet listed
            gone = {want[5].queue_offset, want[200].queue_offset}
            for tx in (want[5], want[200]):
                core.withdraw(tx.half_offset)
            want = [t for t in want if t.queue_offset not in gone]
            seen.remove(want_5 := seen[5])
            assert want_5 in gone
    assert seen == [t.queue_offset for t in want]
    assert pages == -(-len(seen) // 40)


def _rare_among_busy(monkeypatch):
    """A service whose group RARE has 3 undecided (queue offsets 1, 10,001, 20,001) among 20,000 of BUSY's, its
    page walks giving the loop back every 1,000 entries."""
    monkeypatch.setattr(processor, "PAGE_WALK_SLICE", 1_000)
    core = TransactionCore(POLICY, lambda off: None)
    for off in range(20_003):
        core.add(Tx(off * 100, off, "RARE" if off % 10_000 == 1 else "BUSY", "T", f"U{off}", 1_000_000 + off,
                    owner_id="c@1"))
    ctx, _ = _service(0)
    ctx.tx.core, ctx.tx.pending = core, core.pending
    return ctx, core


def test_a_page_of_a_few_among_many_walks_to_them_a_slice_at_a_time(monkeypatch):
    """A group's few undecided behind 20,000 of another group's: the walk to them gives the loop back every
    PAGE_WALK_SLICE entries, not one hold for the whole of it."""
    ctx, core = _rare_among_busy(monkeypatch)
    turns = []
    real_sleep = asyncio.sleep

    async def counted(delay, *a):
        turns.append(delay)
        await real_sleep(delay, *a)

    monkeypatch.setattr(processor.asyncio, "sleep", counted)
    page = _page(ctx, group="RARE", limit=10, after=-1)
    assert [r["queue_offset"] for r in page["pending"]] == [1, 10_001, 20_001]
    assert page["next_after"] is None and page["total"] == 3
    assert len(turns) == 20


def test_a_page_after_a_decided_cursor_starts_past_it():
    ctx, core = _service(100)
    core.withdraw(50 * 100)     # the last row of a page, decided since
    page = _page(ctx, limit=3, after=50)
    assert [r["queue_offset"] for r in page["pending"]] == [51, 52, 53] and page["next_after"] == 53
    assert _page(ctx, limit=0, after=50)["next_after"] is None      # (limit 0: no next page, its cursor never moved)
    assert _page(ctx, limit=5, after=98)["next_after"] is None


@pytest.mark.parametrize("after", [-1, 39_000 * 2_000])
def test_a_page_of_a_sparse_backlog_gives_the_loop_turns_as_it_finds_its_buckets(after, monkeypatch):
    """A sparse backlog (one undecided half in 2,000 of the half queue: a bucket each): a page sorted every bucket
    number past its cursor before its first row, in one hold of the loop (~100 ms at 500,000 undecided, at every
    page; a far cursor's filter alone 20 ms). Each bucket looked at counts as a step of the walk, as another
    group's entry does: 40,000 of them, a turn every PAGE_WALK_SLICE."""
    monkeypatch.setattr(processor, "PAGE_WALK_SLICE", 1_000)
    core = TransactionCore(POLICY, lambda off: None)
    for i in range(40_000):
        core.add(Tx(i * 100, i * 2_000, "PG", "T", f"U{i}", 1_000_000 + i, owner_id="c@1"))
    ctx, _ = _service(0)
    ctx.tx.core, ctx.tx.pending = core, core.pending

    async def page():
        async with other_client() as turns:
            resp = await processor.list_transactions(ctx, None, RemotingCommand.request(
                RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 10, "after": after}))
        return json.loads(resp.body_bytes()), turns[0]

    body, turns = asyncio.run(bounded(30)(page)())
    assert [r["queue_offset"] for r in body["pending"]] == [(after // 2_000 + 1 + i) * 2_000 for i in range(10)]
    assert turns >= 35, f"{turns} turns of the loop while the page looked at 40,000 buckets"


def test_a_row_decided_while_its_page_walks_on_is_not_listed(monkeypatch):
    """A page of a group's few among many others' gives the loop turns between its rows: one found, then decided
    in such a turn, was listed as undecided (an operator's commit of it then refused), though the walk leaves out
    what was decided before it reached it. The next page's cursor is still the last row found."""
    ctx, core = _rare_among_busy(monkeypatch)
    real_sleep = asyncio.sleep

    async def decided_meanwhile(delay, *a):
        core.withdraw(1 * 100)      # the first row, found before this turn
        await real_sleep(delay, *a)

    monkeypatch.setattr(processor.asyncio, "sleep", decided_meanwhile)
    page = _page(ctx, group="RARE", limit=2, after=-1)
    assert [r["queue_offset"] for r in page["pending"]] == [10_001]
    assert page["next_after"] == 10_001
