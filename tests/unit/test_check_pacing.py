"""A check storm (tens of thousands of transactions due at once, e.g. a restart after the producers died) is
paced: a pass yields to the event loop between slices, and a producer connection is sent no more checks
than it has left unanswered up to transaction_check_in_flight_max, nor any while it does not read; the
transactions waiting for room spend no check."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from broker.transaction.core import UNKNOWN
from tests.support.bounded import bounded
from tests.unit.test_review_transactions import Clock, add_half, make_service



class Producer:
    """A producer connection as the check pass sees it: records the checks sent to it."""

    def __init__(self, name="P1"):
        self.peer = ("127.0.0.1", 7)
        self.attributes = {"client_id": name}
        self.is_open = True
        self.writing_paused = False
        self.checks = []

    def oneway(self, cmd):
        self.checks.append(cmd)


async def storm(tmp_path, n, **cfg):
    clock = Clock()
    ctx = await make_service(tmp_path, clock, **cfg)
    txs = [await add_half(ctx, b"%d" % i) for i in range(n)]
    clock.now = max(t.next_check for t in txs) + 1
    return ctx, clock, txs


def spent(txs) -> int:
    return sum(1 for t in txs if t.checks)


@bounded(60)
async def test_a_producer_gets_at_most_its_cap_of_unanswered_checks_and_the_rest_spend_none(tmp_path):
    ctx, clock, txs = await storm(tmp_path, 300, transaction_check_in_flight_max=40)
    tx = ctx.tx
    producer = Producer()
    ctx.clients.add_producer("PG", producer, "P1")
    try:
        await tx.run_due(clock.now)
        assert len(producer.checks) == 40 and spent(txs) == 40
        await tx.run_due(clock.now)                 # nothing answered: nothing more goes, nothing is spent
        assert len(producer.checks) == 40 and spent(txs) == 40
        # Answers free slots: as many more go on the next pass.
        asked = [t for t in txs if t.checks]
        for t in asked[:10]:
            code, _ = tx.end(t.half_offset, UNKNOWN, group="PG", table_offset=t.queue_offset, from_check=True)
            assert code == 0
        await tx.run_due(clock.now)
        assert len(producer.checks) == 50 and spent(txs) == 50
        # A second producer of the group has room of its own.
        other = Producer("P2")
        ctx.clients.add_producer("PG", other, "P2")
        await tx.run_due(clock.now)
        assert len(other.checks) == 40 and spent(txs) == 90
        assert all(t.half_offset in tx.pending for t in txs)
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_a_producer_that_does_not_read_is_sent_no_checks(tmp_path):
    ctx, clock, txs = await storm(tmp_path, 20)
    tx = ctx.tx
    stuck = Producer()
    stuck.writing_paused = True                     # the unread-reply cap would close it, every check lost
    ctx.clients.add_producer("PG", stuck, "P1")
    try:
        for _ in range(3):
            await tx.run_due(clock.now)
            clock.now += ctx.config.transaction_check_interval_ms * 4
        assert stuck.checks == [] and spent(txs) == 0
        stuck.writing_paused = False                # it reads again: the waiting transactions are checked
        await tx.run_due(clock.now)
        assert len(stuck.checks) == 20 and spent(txs) == 20
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_a_check_pass_yields_to_the_event_loop_between_slices(tmp_path):
    n = 3 * ctx_slice() + 10
    ctx, clock, txs = await storm(tmp_path, n)
    tx = ctx.tx
    producer = Producer()
    ctx.clients.add_producer("PG", producer, "P1")
    seen = []
    stop = False

    async def ticker():
        while not stop:
            seen.append(len(producer.checks))
            await asyncio.sleep(0)

    ticking = asyncio.ensure_future(ticker())
    try:
        await asyncio.sleep(0)
        await tx.run_due(clock.now)
        seen.append(len(producer.checks))
        stop = True
        await ticking
        assert len(producer.checks) == n
        # No stretch of the pass without a turn of the loop sent more than one slice of checks.
        jumps = [b - a for a, b in zip(seen, seen[1:])]
        assert max(jumps) <= ctx_slice(), jumps
    finally:
        stop = True
        await ctx.store._store.close()


def ctx_slice() -> int:
    from broker.transaction.service import TransactionService
    return getattr(TransactionService, "CHECK_SLICE", 256)


@bounded(60)
async def test_the_sender_reconnected_is_asked_first_by_its_client_id(tmp_path):
    """The half's connection closed and its producer came back on a new one (same client id): the checks go
    to it, not to whichever producer of the group is next in turn."""
    ctx, clock, txs = await storm(tmp_path, 6)
    tx = ctx.tx
    other, back = Producer("P-other"), Producer("127.0.0.1:1")   # add_half's sender is 127.0.0.1:1, now closed
    ctx.clients.add_producer("PG", back, "127.0.0.1:1")
    ctx.clients.add_producer("PG", other, "P-other")
    try:
        await tx.run_due(clock.now)
        assert len(back.checks) == 6 and other.checks == []
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_after_an_unanswered_check_the_sender_is_not_asked_first(tmp_path):
    """A sender hung with its connection open does not answer: the next checks go to the group's others in
    turn, not to it every time until the transaction is dead-lettered."""
    ctx, clock, txs = await storm(tmp_path, 1, transaction_check_max=3)
    tx = ctx.tx
    hung, healthy = Producer("127.0.0.1:1"), Producer("P-healthy")
    txs[0].owner = hung
    ctx.clients.add_producer("PG", hung, "127.0.0.1:1")
    ctx.clients.add_producer("PG", healthy, "P-healthy")
    try:
        for _ in range(3):
            await tx.run_due(clock.now)
            clock.now = txs[0].next_check + 1
        assert len(hung.checks) + len(healthy.checks) == 3
        assert healthy.checks, "every check went to the hung sender"
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_one_slice_queues_no_more_check_bytes_to_a_producer_than_a_quarter_of_its_unread_cap(tmp_path):
    """Checks carry the message: 256 checks of 1 MB messages queued to one producer in one slice were 196 MB
    unread at once, and the unread-reply cap (64 MB) closed a producer that reads, every check lost though
    counted. A slice queues at most a quarter of max_write_buffer to a connection; the rest wait, unspent."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock, max_write_buffer=1 << 20)
    tx = ctx.tx
    txs = [await add_big(ctx, i, 100_000) for i in range(30)]
    clock.now = max(t.next_check for t in txs) + 1
    producer = Producer()
    ctx.clients.add_producer("PG", producer, "P1")
    try:
        await tx.run_due(clock.now)
        sent = sum(len(c.body_bytes()) for c in producer.checks)
        assert 0 < sent <= (1 << 20) // 4 + 101_000, sent
        assert spent(txs) == len(producer.checks)
        for _ in range(30):                         # the producer took them: the rest follow, pass by pass
            if len(producer.checks) == 30:
                break
            await tx.run_due(clock.now)
        assert len(producer.checks) == 30 and spent(txs) == 30
    finally:
        await ctx.store._store.close()


async def add_big(ctx, i: int, size: int):
    """add_half with a ``size``-byte body (add_half puts the body in the message id)."""
    from protocol.message import Prop
    tx = ctx.tx
    props = {Prop.UNIQ_KEY: f"BIG{i}", Prop.PGROUP: "PG", Prop.TRAN_MSG: "true"}
    req = tx.records.half(body=b"x" * size, real_topic="T", real_qid=0, flag=0, sys_flag=0,
                          born_timestamp=ctx.clock(), born_host=ctx.store_host, props=props)
    conn = Producer("127.0.0.1:1")
    conn.is_open = False

    class Cmd:
        language = version = serialize_type = 0
        opaque = 1
        body = b"x" * size

    await tx._prepare(conn, Cmd(), req, "PG", "T", 0, props, conn.attributes.get("client_id"))
    return max(tx.pending.values(), key=lambda p: p.half_offset)


async def test_hostile_check_immunity_values():
    """CHECK_IMMUNITY_TIME_IN_SECONDS as a producer may set it: negative or non-numeric is the default;
    huge is capped at the retention (the half expires by then), so no due time overflows a float; past a long's
    range, or with a space or "_", it is not a number (Long.parseLong), the default."""
    from broker.transaction.check import CheckTimer, Policy, first_check_time
    policy = Policy(check_interval_ms=60_000, timeout_ms=6_000, check_max=15, retention_ms=72 * 3600_000)
    assert first_check_time(policy, 1_000, "-5") == 7_000
    assert first_check_time(policy, 1_000, "abc") == 7_000
    assert first_check_time(policy, 1_000, "1.5") == 7_000
    assert first_check_time(policy, 1_000, "9" * 5000) == 7_000          # past int()'s digit limit
    assert first_check_time(policy, 1_000, "30") == 31_000
    assert first_check_time(policy, 1_000, str(1 << 62)) == 1_000 + policy.retention_ms
    # what Long.parseLong (RocketMQ's getLong) refuses is no value: the default, as there
    for refused in ("1" + "0" * 320, " 600", "600 ", "1_000"):
        assert first_check_time(policy, 1_000, refused) == 7_000, refused
    # 0 is a second (IMMUNITY_FLOOR_MS): checked ~15 ms after its store, a local transaction still running had its
    # listener answer ROLLBACK before its COMMIT; the broker's own lower timeout is the floor instead
    assert first_check_time(policy, 1_000, "0") == 2_000 and first_check_time(policy, 1_000, "2") == 3_000
    assert first_check_time(dataclasses.replace(policy, timeout_ms=300), 1_000, "0") == 1_300
    assert first_check_time(dataclasses.replace(policy, timeout_ms=0), 1_000, "0") == 1_000
    timer = CheckTimer(service=None, clock=lambda: 0, max_sleep_s=1.0)
    assert timer._delay(10 ** 400) == 1.0 and timer._delay(None) == 1.0
    assert timer._delay(250) == 0.25 and timer._delay(-5) == 0.0


@bounded(60)
async def test_parked_transactions_are_deferred_once_their_group_has_no_producer(tmp_path):
    """Due while their only producer did not read, they were parked (no check spent); then it went away. Parked,
    they were never deferred: no txmq_transaction_checks_deferred (the "nobody can answer" alert stayed
    silent) and off the schedule for good. They are deferred as any due transaction with no producer, and
    checked once one comes back."""
    ctx, clock, txs = await storm(tmp_path, 5, transaction_check_max=1000)
    tx, metrics = ctx.tx, ctx.metrics
    stuck = Producer()
    stuck.writing_paused = True
    ctx.clients.add_producer("PG", stuck, "P1")
    try:
        await tx.run_due(clock.now)
        assert stuck.checks == [] and spent(txs) == 0 and tx.core.parked() == 5
        stuck.is_open = False
        ctx.clients.connection_closed(stuck)
        clock.now += ctx.config.transaction_check_interval_ms
        await tx.run_due(clock.now)
        assert metrics.child(metrics.checks_skipped, "PG")._value.get() == 5
        assert tx.core.parked() == 0 and tx.next_due() is not None and spent(txs) == 0
        back = Producer("P1")
        ctx.clients.add_producer("PG", back, "P1")
        clock.now = tx.next_due()
        await tx.run_due(clock.now)
        assert len(back.checks) == 5 and spent(txs) == 5
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_a_closed_connection_offers_room_to_its_groups_at_the_next_pass(tmp_path):
    """A pass offers room to the groups whose room may have changed, not to every group with parked checks. The
    connection of a group's only producer, not reading (no check slot of it held), closes: the group's parked ones
    are deferred at the next pass, not once every group is offered room again (core._OFFER_ALL_MS)."""
    ctx, clock, txs = await storm(tmp_path, 5, transaction_check_max=1000)
    tx, metrics = ctx.tx, ctx.metrics
    stuck = Producer()
    stuck.writing_paused = True
    ctx.clients.add_producer("PG", stuck, "P1")
    try:
        await tx.run_due(clock.now)
        assert stuck.checks == [] and tx.core.parked() == 5
        stuck.is_open = False
        tx.connection_closed(stuck)             # as server.py closes it: the checks' step, then the groups'
        ctx.clients.connection_closed(stuck)
        clock.now += 1
        await tx.run_due(clock.now)
        assert tx.core.parked() == 0 and metrics.child(metrics.checks_skipped, "PG")._value.get() == 5
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_only_an_answer_that_frees_a_check_slot_wakes_a_check_pass(tmp_path):
    """Every END with fromTransactionCheck woke the check timer while any transaction was parked, and each pass
    reads the whole pending index (the progress floor): a producer repeating one UNKNOWN "answer" for a
    transaction it was never asked about (or another group's) cut the broker's END throughput 8x (23k/s to
    2.8k/s, 50k undecided) and slowed every other request. Only an answer that frees a slot wakes it now."""
    ctx, clock, txs = await storm(tmp_path, 30, transaction_check_in_flight_max=10)
    tx = ctx.tx
    producer = Producer()
    ctx.clients.add_producer("PG", producer, "P1")
    try:
        await tx.run_due(clock.now)
        assert len(producer.checks) == 10 and tx.core.parked() == 20
        woken = []
        tx.timer.wake = lambda: woken.append(True)
        asked = next(t for t in txs if t.checks)
        never = next(t for t in txs if not t.checks)
        for _ in range(100):        # no check of it was sent: nothing is freed
            code, _ = tx.end(never.half_offset, UNKNOWN, group="PG", table_offset=never.queue_offset,
                             from_check=True)
            assert code == 0
        code, _ = tx.end(asked.half_offset, UNKNOWN, group="OTHER", table_offset=asked.queue_offset,
                         from_check=True)
        assert code != 0 and woken == []        # another group's: refused, frees nothing
        for _ in range(3):          # the answer frees its slot once
            tx.end(asked.half_offset, UNKNOWN, group="PG", table_offset=asked.queue_offset, from_check=True)
        assert woken == [True]
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_an_answer_freeing_a_slot_of_a_group_with_nothing_parked_wakes_no_pass(tmp_path):
    """A slot is a group's: an answer of group PG_b frees nothing PG's parked checks can use. It woke the timer,
    and a pass ends when woken: a client of another group answering quickly ended a pass at every slice."""
    ctx, clock, txs = await storm(tmp_path, 30, transaction_check_in_flight_max=10)
    tx = ctx.tx
    other = await add_half(ctx, b"other", group="PG_b")
    clock.now = max(clock.now, other.next_check + 1)
    producer, b = Producer(), Producer("PB")
    ctx.clients.add_producer("PG", producer, "P1")
    ctx.clients.add_producer("PG_b", b, "PB")
    try:
        await tx.run_due(clock.now)
        assert len(producer.checks) == 10 and tx.core.parked() == 20 and len(b.checks) == 1
        woken = []
        tx.timer.wake = lambda: woken.append(True)
        tx.end(other.half_offset, UNKNOWN, group="PG_b", table_offset=other.queue_offset, from_check=True)
        assert other.check_channel is None and woken == []
        asked = next(t for t in txs if t.checks)
        tx.end(asked.half_offset, UNKNOWN, group="PG", table_offset=asked.queue_offset, from_check=True)
        assert woken == [True]
    finally:
        await ctx.store._store.close()


def test_the_claimants_of_a_senders_id_are_asked_newest_first_then_each_once_a_round():
    """The sender back on a new connection registered last: asked first. Then the others in the order they
    registered, each once a round, also when one joins or leaves between two checks (nobody skipped)."""
    from types import SimpleNamespace

    from broker.transaction.service import _claimant

    def ch(seq, cid="ID"):
        return SimpleNamespace(seq=seq, client_id=cid, conn=f"c{seq}")

    tx = SimpleNamespace(asked_seq=0)
    channels = [ch(1), ch(2, "other"), ch(3), ch(4)]
    order = []
    for _ in range(6):
        picked = _claimant(tx, channels, "ID")
        order.append(picked.seq)
        tx.asked_seq = picked.seq
        if len(order) == 2:
            channels.append(ch(7))      # a claimant joins between two checks: asked in this round
        if len(order) == 3:
            channels.remove(channels[2])    # the one asked (seq 3) leaves: the round goes on from it
    assert order == [4, 1, 3, 4, 7, 1]
    assert _claimant(tx, channels, "nobody") is None


@bounded(60)
async def test_a_group_whose_producers_are_all_at_their_cap_is_parked_without_asking_again_for_each(tmp_path):
    """A hung producer with a backlog of due checks: once its slots are taken, the slice parks the group's other
    due transactions without looking for a producer again for each one (100,000 of them took a second of passes
    to park, while another group's due check waited behind them). Nothing changes in what is sent."""
    ctx, clock, txs = await storm(tmp_path, 300, transaction_check_in_flight_max=40)
    tx = ctx.tx
    hung = Producer()
    ctx.clients.add_producer("PG", hung, "P1")
    looked_up = []
    channels = ctx.clients.producer_channels
    ctx.clients.producer_channels = lambda group: looked_up.append(group) or channels(group)
    try:
        await tx.run_due(clock.now)
        assert len(hung.checks) == 40 and spent(txs) == 40
        assert sum(t.parked for t in txs) == 260
        # Its 40 checks, a look that finds the group full once a slice (answers may come between slices),
        # the pass's look at the room it has: not one for each of the 260 transactions parked.
        slices = -(-300 // tx.CHECK_SLICE)
        assert len(looked_up) <= 40 + slices + 1, len(looked_up)
        # Answers free slots: the next pass sends as many again.
        for t in [t for t in txs if t.checks][:10]:
            code, _ = tx.end(t.half_offset, UNKNOWN, group="PG", table_offset=t.queue_offset, from_check=True)
            assert code == 0
        await tx.run_due(clock.now)
        assert len(hung.checks) == 50 and spent(txs) == 50
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_a_group_with_no_producer_is_deferred_without_looking_again_for_each(tmp_path):
    """The same for a group nobody of which is connected (its producer died): every due transaction is deferred
    and counted as before, with one look for a producer a slice, not one each (they come due again together,
    every check interval, ahead of other groups' checks due after them)."""
    ctx, clock, txs = await storm(tmp_path, 300)
    tx, metrics = ctx.tx, ctx.metrics
    looked_up = []
    channels = ctx.clients.producer_channels
    ctx.clients.producer_channels = lambda group: looked_up.append(group) or channels(group)
    try:
        await tx.run_due(clock.now)
        assert spent(txs) == 0 and all(t.deferred for t in txs)
        assert metrics.child(metrics.checks_skipped, "PG")._value.get() == 300
        slices = -(-300 // tx.CHECK_SLICE)
        assert len(looked_up) <= slices + 1, len(looked_up)      # and the pass's look at the room it has
        # A producer joining makes them due at once, and they are asked.
        producer = Producer()
        ctx.clients.add_producer("PG", producer, "P1")
        tx.producer_joined("PG")
        await tx.run_due(clock.now)
        assert len(producer.checks) == 300 and spent(txs) == 300
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_a_slot_freed_inside_a_slice_is_used_though_the_group_was_found_full_earlier_in_it(tmp_path):
    """A slice frees slots itself: a transaction due again gives back the slot of its unanswered check (core.due,
    _release) before a producer is chosen for it. Found full earlier in the same slice, the group must not be
    parked on that word: the transaction due again was parked with its own slot free, and the producer left
    with nothing in flight until the next pass, where before it was asked again at once."""
    clock = Clock()
    ctx = await make_service(tmp_path, clock, transaction_check_in_flight_max=1)
    tx = ctx.tx
    producer = Producer()
    ctx.clients.add_producer("PG", producer, "P1")
    try:
        first = await add_half(ctx, b"first")
        clock.now += 500
        second = await add_half(ctx, b"second")     # due before the first's unanswered check comes due again
        clock.now = first.next_check
        await tx.run_due(clock.now)
        assert len(producer.checks) == 1 and first.check_channel is producer      # the producer's one slot
        assert first.next_check > second.next_check
        clock.now = first.next_check
        await tx.run_due(clock.now)
        # The second found the producer full; the first, due again, freed the slot and is asked again on it.
        assert second.parked
        assert len(producer.checks) == 2 and first.checks == 2 and first.check_channel is producer
        assert tx.core.in_flight(producer, "PG") == 1
    finally:
        await ctx.store._store.close()


@pytest.mark.parametrize("backlog", [600, 2400])
@pytest.mark.parametrize("big_producer", ["hung", "gone"])
@bounded(120)
async def test_another_groups_due_check_waits_a_bounded_part_of_a_backlog_whatever_its_size(tmp_path, backlog,
                                                                                          big_producer):
    """One group's backlog of due checks (its producer hung at its cap, or gone) and another group's check that
    comes due while the pass is working through it: the innocent check is taken in its group's turn, after at
    most a slice of the backlog (the one under way when it came due) and one more of it, however large the
    backlog. From one schedule, oldest due first, the pass took the whole backlog first, and the check came due
    after the pass's clock, so waited for the next pass."""
    ctx, clock, txs = await storm(tmp_path, backlog, transaction_check_in_flight_max=40)
    tx = ctx.tx
    for t in txs:       # storm's halves are of group PG: the backlog's group
        assert t.group == "PG"
    if big_producer == "hung":
        ctx.clients.add_producer("PG", Producer(), "P1")
    small = await add_half(ctx, b"small", group="PG_small")
    innocent = Producer("P_small")
    ctx.clients.add_producer("PG_small", innocent, "P_small")
    taken = {"PG": 0, "PG_small": 0}
    backlog_taken_before_small = []
    choose = tx._channel_for

    def counting(t):
        if t.group == "PG_small":
            backlog_taken_before_small.append(taken["PG"])
        taken[t.group] += 1
        return choose(t)
    tx._channel_for = counting
    due = tx.core.due
    slices = []

    def first_slice_then_the_innocent_check_comes_due(*args, **kwargs):
        out = due(*args, **kwargs)
        slices.append(len(out[0]) + len(out[1]))
        if len(slices) == 1:
            assert small.next_check > clock.now     # not due when the pass began
            clock.now = small.next_check            # due from the next slice on
        return out
    tx.core.due = first_slice_then_the_innocent_check_comes_due
    try:
        await tx.run_due(clock.now)
        if not innocent.checks:
            await tx.run_due(clock.now)             # (from one schedule: in the next pass)
        assert len(innocent.checks) == 1
        assert len(backlog_taken_before_small) == 1
        assert backlog_taken_before_small[0] <= tx.CHECK_SLICE + 1, (backlog_taken_before_small, backlog)
        assert tx.core.taken == sum(taken.values())     # the core counts every due entry it took, as the test did
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_a_pass_reading_the_clock_each_slice_still_ends_within_an_interval(tmp_path):
    """Each slice of a pass takes what is due by the clock of its start; a pass slower than the check interval
    (a backlog of a group with no producer, its deferred transactions due again an interval on) then always found
    more due, and never ended: the parked transactions of other groups, given room only as a pass begins, waited
    for good. It ends once an interval long; the next pass goes on with the rest."""
    ctx, clock, txs = await storm(tmp_path, 600)
    tx = ctx.tx
    interval = tx.core.policy.check_interval_ms
    due, slices = tx.core.due, []

    def slow_slices(*args, **kwargs):
        slices.append(1)
        assert len(slices) <= 20, "the pass never ends"
        clock.now += interval // 2          # each slice half an interval
        return due(*args, **kwargs)
    tx.core.due = slow_slices
    try:
        await tx.run_due(clock.now)
        assert len(slices) <= 3
        assert tx.next_due() <= clock.now                   # the rest for the next pass, which starts at once
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_a_slot_freed_during_a_long_pass_is_used_before_the_pass_would_have_ended(tmp_path):
    """An answer that frees a check slot wakes the timer; the pass under way (another group's backlog of 3,000 due
    with no producer of theirs here) ends at its next slice, and the next pass gives the parked transaction its
    producer's room. Parked ones are given room only as a pass begins: the pass ran on through the backlog first."""
    ctx, clock, txs = await storm(tmp_path, 3000, transaction_check_in_flight_max=1)
    tx = ctx.tx
    first = await add_half(ctx, b"first", group="PG_a")
    second = await add_half(ctx, b"second", group="PG_a")
    clock.now = max(first.next_check, second.next_check) + 1
    a = Producer("PA")
    ctx.clients.add_producer("PG_a", a, "PA")
    taken = {"PG": 0}
    choose = tx._channel_for

    def counting(t):
        taken[t.group] = taken.get(t.group, 0) + 1
        return choose(t)
    tx._channel_for = counting
    due, slices = tx.core.due, []
    answered = asyncio.Event()
    backlog_taken_at_second_check, second_check = [], asyncio.Event()

    def answer_in_the_second_slice(*args, **kwargs):
        slices.append(1)
        if len(slices) == 2:        # PG_a's first check is out, its second parked: the producer answers
            assert a.checks and second.parked
            asked = first if first.checks else second
            assert tx.end(asked.half_offset, UNKNOWN, group="PG_a", table_offset=asked.queue_offset,
                          from_check=True)[0] == 0
            answered.set()
        return due(*args, **kwargs)
    tx.core.due = answer_in_the_second_slice
    oneway = a.oneway

    def sent(cmd):
        oneway(cmd)
        if len(a.checks) == 2:
            backlog_taken_at_second_check.append(taken["PG"])
            second_check.set()
    a.oneway = sent
    tx.timer.start()
    try:
        await second_check.wait()
        assert answered.is_set()
        assert backlog_taken_at_second_check[0] <= 3 * tx.CHECK_SLICE, backlog_taken_at_second_check
    finally:
        await tx.timer.stop()
        await ctx.store._store.close()


@bounded(60)
async def test_every_group_is_offered_room_once_a_second_also_within_a_long_pass(tmp_path):
    """Parked checks were offered room in a pass's first slice alone. A pass over another group's backlog lasts up
    to a check interval (slices while something is due): what only the once-a-second offer to every group gives
    (a producer reading again) waited for the whole pass, not a second. The clock moves 400 ms a slice here."""
    ctx, clock, txs = await storm(tmp_path, 5, transaction_check_max=1000)
    tx = ctx.tx
    tx.core.policy = dataclasses.replace(tx.core.policy, check_interval_ms=10_000)     # a pass may last 10 s
    tx.CHECK_SLICE = 2
    stuck = Producer()
    stuck.writing_paused = True
    ctx.clients.add_producer("PG", stuck, "P1")
    try:
        await tx.run_due(clock.now)
        assert stuck.checks == [] and tx.core.parked() == 5
        backlog = [await add_half(ctx, b"g%d" % i, group="GONE") for i in range(12)]     # nobody to ask: deferred
        clock.now = max(clock.now, max(t.next_check for t in backlog) + 1)
        tx.core._all_offered = clock.now        # every group was just offered room
        stuck.writing_paused = False            # reading again: nothing says so
        due, slices = tx.core.due, []

        def slice_(*args, **kw):
            slices.append(clock.now)
            out = due(*args, **kw)
            clock.now += 400
            return out
        tx.core.due = slice_
        await tx.run_due(clock.now)
        assert len(slices) >= 4                 # one pass, past a second long
        assert len(stuck.checks) == 5 and tx.core.parked() == 0
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_a_producer_that_answers_late_over_and_over_is_named_once_a_minute_and_counted_each_time(
        tmp_path, caplog):
    """A slow producer (each check answered after it came due again) goes silent and back at every answer: each
    time was a WARNING, one a check pass under a stream of transactions (a simulation of a slow sender: 1,926
    lines in 200 check intervals). Counted each time; named once a minute."""
    ctx, clock, txs = await storm(tmp_path, 5, transaction_check_max=1000)
    tx = ctx.tx
    slow = Producer("SLOW")
    ctx.clients.add_producer("PG", slow, "SLOW")
    rounds = 10                                     # 10 episodes in 20 s: one minute's line
    try:
        caplog.set_level("WARNING", logger="txmq.transaction")
        for _ in range(rounds):
            clock.now = max(t.next_check for t in txs) + 1
            await tx.run_due(clock.now)             # asked
            asked = [t for t in txs if t.check_channel is slow]
            assert len(asked) == len(txs)
            clock.now = max(t.next_check for t in txs) + 1
            await tx.run_due(clock.now)             # due again unanswered: silent
            assert tx.core.unanswered_checks(slow, "PG")
            for t in asked:                         # answered late: no longer silent
                tx.end(t.half_offset, UNKNOWN, group="PG", table_offset=t.queue_offset, from_check=True, conn=slow)
            assert not tx.core.unanswered_checks(slow, "PG")
        metrics = ctx.metrics
        assert metrics.child(metrics.producers_silent, "PG")._value.get() == rounds
        said = [r for r in caplog.records if "left a transaction check unanswered" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        clock.now += 61_000
        await tx.run_due(clock.now)
        clock.now = max(t.next_check for t in txs) + 1
        await tx.run_due(clock.now)                 # a minute later: named again, with the times it went silent
        said = [r.getMessage() for r in caplog.records if "left a transaction check unanswered" in r.getMessage()]
        assert len(said) == 2 and "9 more times" in said[1], said
    finally:
        await ctx.store._store.close()


@bounded(60)
async def test_a_check_slice_lists_a_groups_producers_once_not_once_a_transaction(tmp_path):
    """Each due transaction listed its group's producers again (a list of the live ones, built afresh): 1,000
    producers and 5,000 due transactions held the event loop ~1 s a slice of 250, on main too. Nothing registers
    or closes within a slice: listed once a slice."""
    ctx, clock, txs = await storm(tmp_path, 200, transaction_check_in_flight_max=1000)
    tx = ctx.tx
    producers = [Producer(f"P{i}") for i in range(50)]
    for p in producers:
        ctx.clients.add_producer("PG", p, p.attributes["client_id"])
    listed = []
    listing = ctx.clients.producer_channels
    ctx.clients.producer_channels = lambda group: listed.append(group) or listing(group)
    try:
        await tx.run_due(clock.now)
        assert sum(len(p.checks) for p in producers) == len(txs)
        assert len(listed) <= 3, len(listed)        # a slice's, and the room offered to the parked
    finally:
        await ctx.store._store.close()
