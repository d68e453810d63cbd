"""The per-group check schedules (broker/transaction/core.py) under seeded random operation sequences.

A group dropped from the schedule has its transactions never checked again: a silent stall until a restart.
Many groups, every event the core has (halves, recovered halves, decisions that are written or refused,
expiry, slices of 1-4 due entries with the turn carried between them, producers here / gone / at their cap,
answers freeing slots, joins, closed connections, dead letters and their resume), _next rebuilt at nearly every
push or seldom (_NEXT_SLACK -36 to 24: at 0 alone a rebuild later in the same slice restored a group an earlier
one had lost, and the sequences passed with due() holding _next in a local). After every event: each undecided
transaction is on its group's schedule or parked, its group is in the turn or waits on _next no later than its
next check, and next_due() is no later than the earliest scheduled check (else the timer sleeps past it); a group
with parked transactions and room is offered it at the next pass (listed as such, or its producers changed unsaid
since every group was last offered room).
"""
from __future__ import annotations

import random

from broker.transaction.check import IMMUNITY_FLOOR_MS, Policy
from broker.transaction.core import BUSY, COMMIT, DEAD, UNKNOWN, Origin, SendCheck, TransactionCore, Tx, Write

INTERVAL, IMMUNITY, MAX_CHECKS = 1_000, 6_000, 3
POLICY = Policy(check_interval_ms=INTERVAL, timeout_ms=IMMUNITY, check_max=MAX_CHECKS, retention_ms=72 * 3600_000)
CAP = 2


def add_due(core: TransactionCore, tx: Tx, now: int) -> None:
    """Index ``tx`` due at ``now``: its immunity 0 (the floor, IMMUNITY_FLOOR_MS), stored that long before."""
    core.add(tx, immunity_s="0", stored_at=now - IMMUNITY_FLOOR_MS)


OPS = ["half", "recovered", "decide", "expire", "tick", "answer", "producer", "joined", "closed", "resume", "finish",
       "next_due", "time", "churn"]
MIXES = [
    [2, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 0],        # a bit of everything
    [4, 1, 4, 0, 5, 0, 1, 0, 0, 0, 0, 0, 0, 0],        # backlogs due at once, decided between short slices
    [3, 1, 2, 1, 4, 2, 2, 1, 2, 1, 2, 1, 0, 0],        # producers coming, going and at their cap
    [3, 0, 4, 0, 6, 0, 3, 0, 0, 0, 1, 0, 1, 0],        # backlogs of groups nobody can be asked about (deferred)
    # decisions under older undecided ones, many at a time: the heaps swept of them inside check passes
    [2, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 3],
    [3, 0, 3, 0, 5, 1, 2, 0, 1, 0, 1, 0, 1, 4],
]


class Model:
    def __init__(self, rng: random.Random, groups: int, slack: int, weights: list[int], sweep: tuple[int, int] = (64, 1024)):
        self.rng = rng
        self.weights = weights
        self.decisions: dict[int, str] = {}
        self.core = TransactionCore(POLICY, self.decisions.get)
        self.core._NEXT_SLACK = slack      # 0: rebuilt at every chance, which also heals a loss at once
        # small: the schedule and age heaps swept of decided entries (a slice a push) inside nearly every pass
        self.core._SWEEP, self.core._SCHED_SLACK = sweep
        self.core._AGE_SLACK = sweep[1]
        self.groups = [f"G{i}" for i in range(groups)]
        self.producer = {g: True for g in self.groups}      # True, False (gone), "busy" (every slot held)
        self.now = 1_000_000
        self.next_off = 0
        self.writing: list[Write] = []      # decisions being written (their transactions DECIDING)
        self.claimed: set[int] = set()      # of those, the dead letters due() claimed (off the schedule meanwhile)
        self.dead: dict[int, str] = {}      # dead-lettered: offset -> group (for resume)
        self.unnotified: set[str] = set()   # groups whose producers changed unsaid since every group was offered room

    def channel_for(self, tx):
        state = self.producer[tx.group]
        if not state:
            return None
        conn = "conn-" + tx.group
        if state == "busy" or self.core.in_flight(conn, tx.group) >= CAP:
            return BUSY
        return conn

    def room_for(self, group):
        state = self.producer[group]
        if not state:
            return None
        if state == "busy":
            return 0
        return max(0, CAP - self.core.in_flight("conn-" + group, group))

    def finish(self, w: Write, ok: bool) -> None:
        self.writing.remove(w)
        tx = w.tx
        if ok:
            self.decisions[tx.half_offset] = w.op
            if w.op == DEAD:
                self.dead[tx.half_offset] = tx.group
        self.core.written(tx, ok)
        if not ok and tx.half_offset in self.claimed:
            self.core.dead_letter_failed(tx, self.now)
        self.claimed.discard(tx.half_offset)

    def step(self) -> None:
        rng, core = self.rng, self.core
        pending = list(core.pending.values())
        op = rng.choices(OPS, self.weights)[0]
        group = rng.choice(self.groups)
        if op in ("half", "recovered"):
            self.next_off += 1
            tx = Tx(self.next_off, self.next_off, group, "T", f"U{self.next_off}", self.now - rng.choice([0, IMMUNITY]))
            if op == "half":
                core.add(tx, immunity_s=rng.choice([None, "0", str(rng.randrange(10))]))   # some ahead of the rest
            else:
                core.add(tx, self.now)          # recovery: due no earlier than now
        elif op in ("decide", "expire") and pending:
            waiting = [tx for tx in pending if tx.group in core._turning and tx.next_check <= self.now]
            # often one whose group waits in the turn for it: the group's next check is ahead when its turn comes
            tx = rng.choice(waiting if waiting and rng.random() < 0.5 else pending)
            action = core.end(tx.half_offset, COMMIT if op == "decide" else DEAD,
                              origin=Origin.ADMIN if op == "decide" else Origin.EXPIRY, reason="expired")
            if isinstance(action, Write):
                self.writing.append(action)
                if rng.random() < 0.7:
                    self.finish(action, rng.random() < 0.7)
        elif op == "churn":
            # halves stored and decided at once (written or not), under whatever is older and undecided
            for _ in range(rng.choice([1, 5, 20, 60])):
                self.next_off += 1
                tx = Tx(self.next_off, self.next_off, group, "T", f"U{self.next_off}", self.now)
                core.add(tx, immunity_s=rng.choice([None, "0"]))
                action = core.end(tx.half_offset, COMMIT, origin=Origin.ADMIN)
                if isinstance(action, Write):
                    self.writing.append(action)
                    if rng.random() < 0.9:
                        self.finish(action, rng.random() < 0.95)
        elif op == "finish" and self.writing:
            self.finish(rng.choice(self.writing), rng.random() < 0.6)
        elif op == "time":
            self.now += rng.choice([1, 500, INTERVAL, IMMUNITY])
        elif op == "tick":
            self.now += rng.choice([0, 0, 0, 1, 500, INTERVAL, IMMUNITY, 4 * INTERVAL])
            offered = core._all_offered
            actions, _ = core.due(self.now, self.channel_for, self.room_for if rng.random() < 0.5 else None,
                                  limit=rng.choice([1, 2, 3, 4]))
            if core._all_offered != offered:
                self.unnotified.clear()
            for a in actions:
                if isinstance(a, SendCheck):
                    if core.check_written(a.tx, self.now, rng.random() < 0.9):
                        if rng.random() < 0.9:
                            core.check_sent(a.tx)
                        else:
                            core.check_not_sent(a.tx, self.now if rng.random() < 0.5 else None)
                else:
                    self.writing.append(a)
                    self.claimed.add(a.tx.half_offset)
                    if rng.random() < 0.7:
                        self.finish(a, rng.random() < 0.7)
        elif op == "answer" and pending:
            tx = rng.choice(pending)
            core.end(tx.half_offset, UNKNOWN, origin=Origin.CHECK, group=tx.group)
        elif op == "producer":
            self.producer[group] = rng.choice([True, True, False, "busy"])
            if rng.random() < 0.5:
                core.room_changed(group)        # said: a producer joined, a connection closed
            else:
                self.unnotified.add(group)      # unsaid: a producer reading again, leaving the group
        elif op == "joined":
            core.producer_joined(group, self.now)
        elif op == "closed":
            core.channel_closed("conn-" + group, self.now)
        elif op == "resume" and self.dead:
            off = rng.choice(sorted(self.dead))
            g = self.dead.pop(off)
            if core.resume(Tx(off, off, g, "T", f"U{off}", self.now), self.now) is None:
                del self.decisions[off]
        elif op == "next_due":
            core.next_due()

    def check(self) -> None:
        core = self.core
        earliest = None
        for tx in list(core.pending.values()):
            if tx.half_offset in self.claimed or tx.parked:
                continue        # a dead letter being written (put back if it fails), or waiting for a slot
            off = tx.half_offset
            assert (tx.next_check, off) in core._sched.get(tx.group, ()), f"{off} of {tx.group} off its schedule"
            top = core._top(tx.group)
            assert top is not None and top <= tx.next_check
            assert tx.group in core._turning or any(g == tx.group and w <= top for w, g in core._next), (
                f"group {tx.group} (next check {top}) neither in the turn nor on _next: never served again")
            earliest = tx.next_check if earliest is None else min(earliest, tx.next_check)
        for heaps in (core._sched, core._by_age):
            for group, heap in heaps.items():
                assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), f"{group}'s heap broken"
        assert core._by_age_entries == sum(map(len, core._by_age.values()))
        for tx in core.pending.values():
            assert (tx.stored_at, tx.half_offset) in core._by_age.get(tx.group, ()), f"{tx.half_offset} aged out"
        due = core.next_due()
        if earliest is not None:
            assert due is not None and due <= earliest, f"next_due {due} after the earliest check {earliest}"
        assert set(core._turn) == core._turning and len(core._turn) == len(core._turning)
        for group, queue in core._parked.items():
            if any(tx.parked and core.pending.get(tx.half_offset) is tx for tx in queue):
                # Room there now is offered at the next pass: the group is listed, or every group will be
                assert self.room_for(group) == 0 or group in core._roomy or group in self.unnotified, (
                    f"group {group} has room {self.room_for(group)} and parked checks, not offered it")

    def drain(self) -> None:
        """Producers here that answer, writes that succeed: every transaction is decided in the end."""
        for g in self.groups:
            self.producer[g] = True
        for w in list(self.writing):
            self.finish(w, True)
        for _ in range(2_000):
            if not self.core.pending:
                return
            self.now += 4 * INTERVAL
            actions, _ = self.core.due(self.now, self.channel_for, self.room_for, limit=4)
            for a in actions:
                if isinstance(a, SendCheck):
                    if self.core.check_written(a.tx, self.now, True):
                        self.core.check_sent(a.tx)
                        self.core.end(a.tx.half_offset, UNKNOWN, origin=Origin.CHECK, group=a.tx.group)
                else:
                    self.writing.append(a)
                    self.claimed.add(a.tx.half_offset)
                    self.finish(a, True)
        assert not self.core.pending, f"never decided: {sorted(self.core.pending)}"


def test_no_random_sequence_over_many_groups_drops_a_group_or_a_transaction_from_the_schedule():
    for seed in range(250):
        pick = random.Random(-seed)
        model = Model(random.Random(seed), groups=pick.choice([3, 8, 20]), slack=pick.choice([0, 1, 3, 8, 24, -4, -12, -36]),
                      weights=MIXES[seed % len(MIXES)],
                      sweep=pick.choice([(64, 1024), (1, 0), (2, 0), (3, 1), (8, 4), (1, -2)]))
        for i in range(250):
            model.step()
            try:
                model.check()
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, step {i}: {exc}") from None
        model.drain()


def test_a_group_whose_due_check_was_decided_while_it_waited_its_turn_is_not_lost_when_next_is_rebuilt():
    """The case the random sequences seldom reach (they passed with due() holding _next in a local): group B waits
    in the turn behind A, its due transaction decided meanwhile, so its next check is ahead when its turn comes;
    A's transaction, deferred earlier in the same slice, rebuilt _next (stale entries past 2 a group + slack). B's
    entry went onto the list that was replaced, B was on neither the turn nor _next: never checked again."""
    decisions: dict[int, str] = {}
    core = TransactionCore(POLICY, decisions.get)
    now = 1_000_000
    add_due(core, Tx(1, 1, "A", "T", "a0", now), now)
    add_due(core, Tx(2, 2, "B", "T", "b0", now), now)
    later = Tx(3, 3, "B", "T", "b1", now)
    core.add(later, immunity_s="30")
    assert core.due(now, lambda tx: None, limit=0) == ([], [])      # both found due: the turn is [A, B]
    assert list(core._turn) == ["A", "B"]
    write = core.end(2, COMMIT, origin=Origin.ADMIN)                # B's due one decided while it waits
    decisions[2] = COMMIT
    core.written(write.tx, True)
    limit = 2 * 3 + core._NEXT_SLACK + 1        # entries on _next: one more and the next push rebuilds it
    for i in range(limit):
        core.add(Tx(10 + i, 10 + i, "F", "T", f"f{i}", now), immunity_s=str(1_000 - i))
    assert len(core._next) == limit
    actions, deferred = core.due(now, lambda tx: None, limit=4)     # A deferred (nobody to ask): a rebuild
    assert [tx.half_offset for tx in deferred] == [1]
    asked = []
    core.due(later.next_check, lambda tx: asked.append(tx.half_offset) or BUSY)
    assert 3 in asked, "group B was dropped from the schedule: its transaction is never checked"


def test_storing_a_half_reads_a_few_schedules_not_every_group_with_a_check_due():
    """add() asks next_due() whether the new half is the earliest (to wake the timer). next_due read the top of
    every group in the turn: with 10,000 groups with something due (a restart, their producers hung or gone, a
    pass under way) each half stored cost 10,000 schedule reads, 6 ms on the event loop. Counted, not timed."""
    core = TransactionCore(POLICY, {}.get)
    now, off = 1_000_000, 0
    groups = 2_000
    for g in range(groups):
        for _ in range(2):
            off += 1
            add_due(core, Tx(off, off, f"G{g}", "T", "u", now), now)
    core.due(now, lambda tx: BUSY, limit=256)           # a slice of the pass: every group is in the turn
    assert len(core._turn) == groups
    reads = 0
    top = core._top

    def counted(group):
        nonlocal reads
        reads += 1
        return top(group)
    core._top = counted
    for _ in range(100):
        off += 1
        core.add(Tx(off, off, "NEW", "T", "u", now))
    assert reads <= 100 * 8, f"{reads / 100:.0f} schedules read a half stored"
    assert core.next_due() == now                       # and the groups in the turn are still the earliest


def test_a_freed_slot_offers_room_to_its_group_alone_not_to_every_group_with_parked_checks():
    """Each pass offered room to every group with parked checks, one room_for call each (2 ms a pass with 10,000 of
    them), and an answer that frees a slot ends the pass under way: a client answering quickly had it paid at every
    slice. Only the group whose slot was freed is asked now, and every group once each _OFFER_ALL_MS."""
    decisions: dict[int, str] = {}
    core = TransactionCore(POLICY, decisions.get)
    now, groups = 1_000_000, 2_000
    for g in range(groups):
        for i in range(2):
            off = 2 * g + i + 1
            add_due(core, Tx(off, off, f"G{g}", "T", f"u{off}", now), now)

    def channel_for(tx):
        conn = "conn-" + tx.group
        return BUSY if core.in_flight(conn, tx.group) >= 1 else conn
    asked = []

    def room_for(group):
        asked.append(group)
        return max(0, 1 - core.in_flight("conn-" + group, group))
    actions, _ = core.due(now, channel_for, room_for)       # one check a group, the other parked
    assert len(actions) == groups and core.parked() == groups
    answered = actions[7].tx
    core.end(answered.half_offset, UNKNOWN, origin=Origin.CHECK, group=answered.group)
    asked.clear()
    actions, _ = core.due(now + 1, channel_for, room_for)
    assert asked == [answered.group] and [a.tx.group for a in actions] == [answered.group]
    asked.clear()
    core.due(now + 2, channel_for, room_for)        # nothing freed since
    assert asked == []
    core.due(now + 1 + core._OFFER_ALL_MS, channel_for, room_for)      # and all of them, now and then
    assert len(asked) == groups - 1
