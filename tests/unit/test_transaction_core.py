"""The transaction rules (broker/transaction/core.py): tables of event sequences, and random sequences.

The core has no I/O and no clock: each test plays the shell, performing the actions it returns.
"""
from __future__ import annotations


from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.transaction.check import Policy
from broker.transaction.core import (
    BUSY,
    COMMIT,
    DEAD,
    ROLLBACK,
    UNCHECKABLE,
    UNKNOWN,
    Origin,
    Reply,
    SendCheck,
    TransactionCore,
    Tx,
    Wait,
    Write,
)
from protocol.codes import ResponseCode

INTERVAL, IMMUNITY, MAX_CHECKS = 1_000, 6_000, 3
POLICY = Policy(check_interval_ms=INTERVAL, timeout_ms=IMMUNITY, check_max=MAX_CHECKS, retention_ms=72 * 3600_000)


class Shell:
    """What service.py does with the core's actions, with records counted instead of written."""

    def __init__(self):
        self.decisions: dict[int, str] = {}
        self.core = TransactionCore(POLICY, self.decisions.get)
        self.now = 1_000_000
        self.producer = True
        self.writing: list[Write] = []
        self.delivered: dict[int, int] = {}
        self.rolled_back: set[int] = set()
        self.checks_sent: list[int] = []

    def half(self, off: int, immunity_s: str | None = None, group: str = "PG") -> Tx:
        tx = Tx(off, off, group, "T", f"U{off}", self.now)
        self.core.add(tx, immunity_s=immunity_s)
        return tx

    def end(self, off: int, op: str, origin=Origin.PRODUCER, group: str | None = "PG"):
        action = self.core.end(off, op, origin=origin, group=group, queue_offset=None)
        if isinstance(action, Write):
            self.writing.append(action)
        return action

    def finish(self, action: Write, ok: bool = True) -> None:
        self.writing.remove(action)
        if ok:
            tx = action.tx
            if action.op == COMMIT:
                self.delivered[tx.half_offset] = self.delivered.get(tx.half_offset, 0) + 1
            elif action.op == ROLLBACK:
                self.rolled_back.add(tx.half_offset)
            self.decisions[tx.half_offset] = action.op
        self.core.written(action.tx, ok)
        if not ok and action.op == DEAD:
            self.core.dead_letter_failed(action.tx, self.now)

    CAP = 2     # checks one producer may have unanswered (transaction_check_in_flight_max)

    def _channel_for(self, tx):
        if not self.producer:
            return None
        if self.producer == "busy" or self.core.in_flight("conn") >= self.CAP:
            return BUSY
        return "conn"

    def _room_for(self, group: str) -> int | None:
        if not self.producer:
            return None     # nobody here: the parked are deferred, as the service's _room_for
        if self.producer is not True:
            return 0
        return max(0, self.CAP - self.core.in_flight("conn"))

    def tick(self, ms: int, check_record_ok: bool = True) -> list:
        self.now += ms
        actions, _ = self.core.due(self.now, self._channel_for, self._room_for)
        for a in actions:
            if isinstance(a, SendCheck):
                if self.core.check_written(a.tx, self.now, check_record_ok):
                    self.core.check_sent(a.tx)
                    self.checks_sent.append(a.tx.half_offset)
            else:
                self.writing.append(a)
        return actions


# ------------------------------------------------------------ tables of sequences
def test_first_decision_wins_and_a_repeat_is_acknowledged():
    s = Shell()
    s.half(1)
    w = s.end(1, COMMIT)
    assert isinstance(w, Write) and w.op == COMMIT
    assert isinstance(s.end(1, ROLLBACK), Wait)               # while the commit is being written
    s.finish(w)
    assert s.end(1, COMMIT) == Reply(ResponseCode.SUCCESS, "already COMMIT; nothing changed", "duplicate")
    refused = s.end(1, ROLLBACK)
    assert refused.code == ResponseCode.TRANSACTION_FAILED and refused.event == "conflict"
    assert s.delivered == {1: 1} and not s.rolled_back


def test_a_failed_write_leaves_it_pending_and_checked_again():
    s = Shell()
    s.half(1)
    w = s.end(1, COMMIT)
    s.finish(w, ok=False)
    assert 1 in s.core.pending and s.core.pending[1].deciding is None
    s.tick(IMMUNITY)
    assert s.checks_sent == [1]


def test_a_producers_commit_of_a_dead_letter_is_told_apart_from_other_conflicts():
    """Its producer committed after the dead letter: its message waits on the dead-letter topic (the service
    counts and says it, with the resume it needs). An admin's resolve, or a rollback, is a plain conflict."""
    s = Shell()
    s.half(1)
    s.finish(s.end(1, DEAD, origin=Origin.MAX_CHECKS, group=None))
    for origin in (Origin.PRODUCER, Origin.CHECK):
        late = s.end(1, COMMIT, origin=origin)
        assert (late.code, late.event) == (ResponseCode.TRANSACTION_FAILED, "commit-after-dead")
        assert "admin resume 1" in late.remark
    assert s.end(1, COMMIT, origin=Origin.ADMIN, group=None).event == "conflict"
    assert s.end(1, ROLLBACK).event == "conflict"
    assert s.decisions[1] == DEAD and 1 not in s.core.pending


def test_unknown_is_recorded_and_the_check_schedule_stands():
    s = Shell()
    s.half(1)
    r = s.end(1, UNKNOWN)
    assert r.code == ResponseCode.SUCCESS and r.event == "unknown"
    assert s.tick(IMMUNITY - 1) == []                          # immunity: not before 6 s
    assert s.tick(1) and s.checks_sent == [1]


def test_per_message_immunity_overrides_the_default():
    s = Shell()
    s.half(1, immunity_s="2")
    s.half(2, immunity_s="not a number")
    s.tick(2_000 - 1)
    assert s.checks_sent == []
    s.tick(1)
    assert s.checks_sent == [1]                                # 2 s, its own
    s.tick(IMMUNITY - 2_000 - 1)
    assert 2 not in s.checks_sent
    s.tick(1)
    assert s.checks_sent.count(2) == 1                         # 6 s, the default


def test_unanswered_checks_back_off_then_max_checks_dead_letters_with_the_reason():
    s = Shell()
    s.half(1)
    s.tick(IMMUNITY)
    times = [s.now]                                            # when each check went out
    while not s.writing:
        s.tick(100)
        if len(s.checks_sent) > len(times):
            times.append(s.now)
    # The interval, then 2x, then 4x while the checks go unanswered; then the dead letter.
    assert [b - a for a, b in zip(times, times[1:])] == [INTERVAL, 2 * INTERVAL]
    assert s.now - times[-1] == 4 * INTERVAL
    assert len(s.checks_sent) == MAX_CHECKS
    (w,) = s.writing
    assert w.op == DEAD and w.reason == "max-checks"
    s.finish(w)
    assert s.decisions[1] == DEAD and 1 not in s.core.pending


def test_an_answered_check_resets_the_back_off():
    s = Shell()
    s.half(1)
    s.tick(IMMUNITY)
    assert s.end(1, UNKNOWN, origin=Origin.CHECK).event == "unknown"
    assert s.core.pending[1].unanswered == 0 and not s.core.pending[1].awaiting
    s.tick(INTERVAL)
    assert s.checks_sent == [1, 1]


def test_no_producer_defers_without_spending_a_check():
    s = Shell()
    s.half(1)
    s.producer = False
    for _ in range(10 * MAX_CHECKS):
        s.tick(INTERVAL)
    assert s.checks_sent == [] and not s.writing and s.core.pending[1].checks == 0
    s.producer = True
    s.tick(INTERVAL)
    assert s.checks_sent == [1]


def test_a_producer_joining_its_group_makes_the_deferred_due_at_once():
    """Deferred for want of a producer, a transaction waited a whole interval even once one had joined (after a
    restart: up to 60 s). A producer joining its group makes that group's deferred transactions due now: one
    check each, none before its immunity, other groups' untouched; joining again spends nothing more."""
    s = Shell()
    s.half(1)
    s.half(2)
    s.half(3, group="OTHER")
    s.producer = False
    s.tick(IMMUNITY)
    s.half(4, immunity_s="60")                  # not due yet: a join must not check it early
    s.half(5)                                   # nor this one, within the default immunity
    assert {tx.half_offset for tx in s.core.pending.values() if tx.deferred} == {1, 2, 3}
    assert s.core.deferred_count() == 3
    s.producer = True
    s.tick(1)
    assert s.checks_sent == []                  # before: deferred an interval, producer or not
    assert s.core.producer_joined("PG", s.now) is True
    s.tick(0)
    assert sorted(s.checks_sent) == [1, 2]
    assert [s.core.pending[o].checks for o in (1, 2, 3, 4, 5)] == [1, 1, 0, 0, 0]
    assert s.core.pending[4].next_check == s.now - 1 + 60_000 and s.core.pending[5].next_check == s.now - 1 + IMMUNITY
    assert s.core.producer_joined("PG", s.now) is False     # nothing deferred left: no second check
    s.tick(INTERVAL - 1)
    assert sorted(s.checks_sent) == [1, 2]
    s.end(1, UNKNOWN, origin=Origin.CHECK)     # (the Shell's one producer answers for every group: free its slots)
    s.end(2, UNKNOWN, origin=Origin.CHECK)
    assert s.core.producer_joined("OTHER", s.now) is True
    s.tick(0)
    assert sorted(s.checks_sent) == [1, 2, 3]
    assert s.core.deferred_count() == 0


def test_a_join_leaves_the_deferred_index_clean_and_wakes_for_parked_ones():
    s = Shell()
    for off in range(1, 6):
        s.half(off)
    s.producer = False
    s.tick(IMMUNITY)
    assert s.core.deferred_count() == 5
    s.finish(s.end(1, COMMIT))                  # decided while deferred: it leaves the index
    action = s.end(2, ROLLBACK)                 # being decided when the producer joins: stays deferred
    assert s.core.deferred_count() == 4
    s.producer = True
    assert s.core.producer_joined("PG", s.now) is True
    s.tick(0)
    assert sorted(s.checks_sent) == [3, 4]      # CAP 2: 5 is parked, not sent past the cap
    assert s.core.deferred_count() == 1 and s.core.pending[2].deferred
    s.finish(action, ok=False)                  # the write failed: pending, deferred, woken by the next join
    assert s.core.producer_joined("PG", s.now) is True
    s.tick(0)
    assert s.core.parked() == 2 and s.core.deferred_count() == 0
    assert s.core.producer_joined("PG", s.now) is True      # parked ones: a pass gives them the new room
    s.end(3, UNKNOWN, origin=Origin.CHECK)
    s.tick(0)
    assert sorted(s.checks_sent) == [3, 4, 5]
    assert [s.core.pending[o].checks for o in (2, 3, 4, 5)] == [0, 1, 1, 1]


def test_a_join_costs_o1_and_the_woken_go_back_a_slice_at_a_time():
    """50000 deferred transactions of a group: the join itself moves none of them; each check pass slice puts
    back on the schedule (and takes) at most ``limit`` of them, as it takes due ones."""
    s = Shell()
    for off in range(600):
        s.half(off)
    s.producer = False
    s.tick(IMMUNITY)
    schedule = {off: tx.next_check for off, tx in s.core.pending.items()}
    assert s.core.producer_joined("PG", s.now) is True
    assert {off: tx.next_check for off, tx in s.core.pending.items()} == schedule
    assert s.core.next_due() == s.now           # the timer runs a pass at once
    seen = []
    for _ in range(10):                         # bounded: 600 / 256 slices, and one to find nothing left
        actions, deferred = s.core.due(s.now, lambda tx: "conn", limit=256)
        assert len(actions) <= 256 and not deferred
        for a in actions:
            s.core.check_written(a.tx, s.now, True)
            seen.append(a.tx.half_offset)
        if s.core.next_due() > s.now:
            break
    assert sorted(seen) == list(range(600)) and all(tx.checks == 1 for tx in s.core.pending.values())
    assert s.core.deferred_count() == 0 and s.core.next_due() == s.now + INTERVAL


def test_wrong_group_or_table_offset_is_refused_but_admin_is_not_asked_for_them():
    s = Shell()
    s.half(1)
    assert s.end(1, COMMIT, group="OTHER").remark == "The producer group wrong"
    bad = s.core.end(1, COMMIT, origin=Origin.PRODUCER, group="PG", queue_offset=99)
    assert bad.remark == "The transaction state table offset wrong"
    assert isinstance(s.end(1, ROLLBACK, origin=Origin.ADMIN, group=None), Write)


def test_a_decided_half_is_held_to_the_same_group_and_table_offset_checks():
    """RocketMQ checks the half whatever became of it: another group's END of a decided transaction was
    acknowledged ("already COMMIT") or told the decision, where it must be refused like an undecided one's."""
    s = Shell()
    s.core.half_of = {1: ("PG", 1)}.get
    s.half(1)
    s.finish(s.end(1, COMMIT))
    assert s.end(1, COMMIT).code == ResponseCode.SUCCESS                        # the owner's repeat
    for op in (COMMIT, ROLLBACK, UNKNOWN):
        r = s.end(1, op, group="OTHER")
        assert (r.code, r.remark) == (ResponseCode.SYSTEM_ERROR, "The producer group wrong")
    bad = s.core.end(1, COMMIT, origin=Origin.PRODUCER, group="PG", queue_offset=99)
    assert bad.remark == "The transaction state table offset wrong"
    assert s.core.end(1, COMMIT, origin=Origin.ADMIN, group=None).code == ResponseCode.SUCCESS
    assert s.delivered == {1: 1}


def test_resume_reopens_only_a_dead_letter_with_checks_reset():
    s = Shell()
    s.half(1)
    s.half(2)
    s.finish(s.end(1, DEAD, origin=Origin.EXPIRY))
    s.finish(s.end(2, COMMIT))
    assert s.core.resume(Tx(2, 2, "PG", "T", "U2", 0), s.now) == "transaction at 2 is not dead-lettered (it is COMMIT)"
    assert s.core.resume(Tx(3, 3, "PG", "T", "U3", 0), s.now) == "transaction at 3 is not dead-lettered (unknown)"
    tx = Tx(1, 1, "PG", "T", "U1", 0, checks=7)
    assert s.core.resume(tx, s.now) is None and tx.checks == 0
    assert "already pending" in s.core.resume(Tx(1, 1, "PG", "T", "U1", 0), s.now)
    s.tick(0)
    assert s.checks_sent == [1]                                # due at once


def test_a_half_is_aged_by_when_the_schedules_clock_says_it_was_stored():
    """The oldest-half age gauge reads oldest_by_group by the schedule's (monotonic) clock: a half added or
    resumed with its stored_at is aged from it, never from its store time (the wall clock's: against the
    monotonic now, a wall-clock step aged it by the step; a resumed half was as old as the host's uptime)."""
    s = Shell()
    wall = 1_700_000_000_000
    s.core.add(Tx(1, 1, "PG", "T", "U1", wall), stored_at=4_000)
    assert s.core.oldest_by_group() == {"PG": 4_000}
    s.finish(s.end(1, DEAD, origin=Origin.EXPIRY))
    assert s.core.oldest_by_group() == {}
    assert s.core.resume(Tx(1, 1, "PG", "T", "U1", wall), s.now, stored_at=3_000) is None
    assert s.core.oldest_by_group() == {"PG": 3_000}


def test_resume_of_an_undecided_transaction_says_it_is_undecided():
    """A resume (903, or a stock admin's 323 naming a half) of a transaction never decided was refused as "not
    dead-lettered (unknown)": the broker knows it well, it is pending its checks."""
    s = Shell()
    s.half(4)
    assert s.core.resume(Tx(4, 4, "PG", "T", "U4", 0), s.now) == ("transaction at 4 is not dead-lettered (it is "
                                                                   "undecided: pending its checks)")
    assert 4 in s.core.pending


def test_unknown_half_is_refused():
    s = Shell()
    r = s.end(42, COMMIT)
    assert r.code == ResponseCode.SYSTEM_ERROR and r.remark == "Find prepared transaction message failed"


def test_unknown_for_a_half_that_will_never_be_checked_says_so():
    """UNKNOWN for an unknown, dead-lettered or decided half was answered SUCCESS "UNKNOWN recorded; the broker
    will check back": our producer took that as acknowledged, yet no check would ever come."""
    s = Shell()
    s.half(1)
    s.half(2)
    s.finish(s.end(1, DEAD, origin=Origin.EXPIRY))
    s.finish(s.end(2, COMMIT))
    unknown = s.end(42, UNKNOWN)
    assert unknown.code == ResponseCode.SYSTEM_ERROR and unknown.remark == "Find prepared transaction message failed"
    dead = s.end(1, UNKNOWN)
    assert dead.code == ResponseCode.TRANSACTION_FAILED and "already DEAD" in dead.remark
    assert "check back" not in dead.remark
    committed = s.end(2, UNKNOWN, origin=Origin.CHECK)       # a check answer overtaken by the producer's END
    assert committed.code == ResponseCode.SUCCESS and committed.remark == "already COMMIT; UNKNOWN changes nothing"


def test_a_check_lost_with_its_connection_is_due_at_once_and_still_counted():
    """A check sent on a connection that then closed unanswered waited its whole interval before anyone else
    was asked: it is due at once, counted unanswered (its sender is not asked first again), and every check
    sent counts against the max, as RocketMQ counts them."""
    s = Shell()
    s.half(1)
    s.tick(IMMUNITY)
    tx = s.core.pending[1]
    assert s.checks_sent == [1] and s.core.in_flight("conn") == 1
    s.now += 10
    assert s.core.channel_closed("conn", s.now) == [tx]
    assert s.core.in_flight("conn") == 0 and s.core.next_due() == s.now
    assert s.core.channel_closed("conn", s.now) == []          # nothing held twice
    s.tick(0)
    assert s.checks_sent == [1, 1] and tx.checks == 2 and tx.unanswered == 1


def test_a_group_unregistered_on_an_open_connection_loses_its_checks_there_and_only_its_own():
    """UNREGISTER_CLIENT of one producer group on a connection that stays open: that group's check there is due at
    once (as a closed connection's), counted unanswered; another group's check on the same connection keeps its slot."""
    s = Shell()
    left, stays = s.half(1, group="PG"), s.half(2, group="PG_other")
    s.tick(IMMUNITY)
    assert sorted(s.checks_sent) == [1, 2] and s.core.in_flight("conn") == 2
    s.now += 10
    assert s.core.producer_left("conn", "PG", s.now) == [left]
    assert s.core.in_flight("conn", "PG") == 0 and s.core.in_flight("conn", "PG_other") == 1
    assert left.next_check == s.now and stays.next_check > s.now and stays.check_channel == "conn"
    assert s.core.producer_left("conn", "PG", s.now) == []      # nothing held twice
    s.tick(0)
    assert left.checks == 2 and left.unanswered == 1 and stays.checks == 1


def test_groups_left_together_on_an_open_connection_lose_their_checks_in_one_walk():
    """Dropped from several groups at one expiry (ClientRegistry.expire): their checks on the connection are lost in
    one call, another group's kept."""
    s = Shell()
    s.CAP = 3
    a, b, stays = s.half(1, group="PG_a"), s.half(2, group="PG_b"), s.half(3, group="PG_other")
    s.tick(IMMUNITY)
    assert s.core.in_flight("conn") == 3
    s.now += 10
    assert sorted(s.core.producer_left("conn", frozenset({"PG_a", "PG_b"}), s.now), key=id) == sorted([a, b], key=id)
    assert s.core.in_flight("conn") == 1 and stays.check_channel == "conn"


def test_a_producer_that_closes_its_connection_in_a_loop_spends_one_extra_check_per_scheduled_one():
    """A re-ask lost with its connection again waits its schedule: a producer that reconnects and closes in a
    loop (or a proxy cutting connections) had each close ask again at once and dead-lettered the transaction,
    all its checks spent, in a moment while the interval was a minute."""
    s = Shell()
    s.half(1)
    s.tick(IMMUNITY)
    tx = s.core.pending[1]
    for _ in range(MAX_CHECKS + 2):
        s.core.channel_closed("conn", s.now)
        s.tick(0)
    assert tx.checks == 2 and tx.half_offset in s.core.pending and not s.writing
    assert tx.next_check > s.now and s.core.in_flight("conn") == 0
    s.tick(tx.next_check - s.now)                                # its schedule: checked as ever
    assert tx.checks == 3
    assert s.core.channel_closed("conn", s.now) == [tx]          # and a scheduled check lost is asked at once
    [dead] = s.tick(0)
    assert isinstance(dead, Write) and dead.op == DEAD and dead.reason == "max-checks"


def test_a_check_not_sent_for_a_closed_connection_is_due_at_once_and_other_failures_an_interval_on():
    s = Shell()
    s.half(1)
    s.half(2)
    s.now += IMMUNITY
    actions, _ = s.core.due(s.now, s._channel_for, s._room_for)
    assert [a.tx.half_offset for a in actions] == [1, 2]
    assert s.core.channel_closed("conn", s.now) == []          # still being written: only the slots go back
    assert s.core.in_flight("conn") == 0
    for a in actions:
        assert s.core.check_written(a.tx, s.now, True)
    s.core.check_not_sent(actions[0].tx, s.now)                 # its channel closed: another producer, now
    s.core.check_not_sent(actions[1].tx)                        # any other failure: not in a loop
    assert actions[0].tx.next_check == s.now and actions[1].tx.next_check == s.now + INTERVAL
    s.tick(0)
    assert s.checks_sent == [1]


# ------------------------------------------------------------ random sequences
OPS = st.sampled_from([COMMIT, ROLLBACK, UNKNOWN, DEAD])
ORIGINS = st.sampled_from([Origin.PRODUCER, Origin.CHECK, Origin.ADMIN, Origin.EXPIRY])
EVENTS = st.lists(st.one_of(
    st.tuples(st.just("half"), st.integers(0, 5)),
    st.tuples(st.just("end"), st.integers(0, 5), OPS, ORIGINS),
    st.tuples(st.just("finish"), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("tick"), st.sampled_from([0, 1, 500, INTERVAL, IMMUNITY, 4 * INTERVAL]), st.booleans()),
    st.tuples(st.just("producer"), st.sampled_from([True, False, "busy"])),
    st.tuples(st.just("resume"), st.integers(0, 5)),
    st.tuples(st.just("joined"),),
    st.tuples(st.just("closed"),),
), max_size=60)


def _scheduled(core: TransactionCore, tx: Tx) -> bool:
    """On the check schedule, or parked until its producers have room for its check."""
    return (tx.next_check, tx.half_offset) in core._sched.get(tx.group, ()) or (tx.parked and tx in core._parked.get(tx.group, ()))


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(EVENTS)
def test_no_sequence_delivers_a_rollback_twice_or_forgets_a_pending_transaction(events):
    s = Shell()
    added: set[int] = set()
    for event in events:
        kind = event[0]
        if kind == "half" and event[1] not in added:
            added.add(event[1])
            s.half(event[1])
        elif kind == "end":
            _, off, op, origin = event
            if op == DEAD and origin is not Origin.EXPIRY:
                continue                                       # only the core and expiry dead-letter
            s.end(off, op, origin=origin, group="PG" if origin in (Origin.PRODUCER, Origin.CHECK) else None)
        elif kind == "finish" and s.writing:
            s.finish(s.writing[event[1] % len(s.writing)], ok=event[2])
        elif kind == "tick":
            s.tick(event[1], check_record_ok=event[2])
        elif kind == "producer":
            s.producer = event[1]
        elif kind == "joined":
            before = {off: (tx.next_check, tx.deferred, tx.checks) for off, tx in s.core.pending.items()}
            s.core.producer_joined("PG", s.now)
            for off, tx in s.core.pending.items():       # a join costs O(1): it moves nothing itself
                assert (tx.next_check, tx.deferred, tx.checks) == before[off]
            woken = {off for off, tx in s.core.pending.items() if tx.deferred}
            before = {off: (tx.next_check, tx.checks) for off, tx in s.core.pending.items()}
            producer, s.producer = s.producer, False     # nobody to ask: what comes due is deferred again
            s.tick(0)
            s.producer = producer
            for off, tx in s.core.pending.items():
                # only a deferred transaction came due (at once: it was due already), and spent no check
                assert tx.checks == before[off][1]
                assert tx.next_check == before[off][0] or off in woken or before[off][0] <= s.now
        elif kind == "closed":                           # the producer's connection closed (and another came)
            for tx in s.core.channel_closed("conn", s.now):
                assert tx.next_check == s.now and tx.check_channel is None
        elif kind == "resume" and s.decisions.get(event[1]) == DEAD:
            if s.core.resume(Tx(event[1], event[1], "PG", "T", "U", s.now), s.now) is None:
                del s.decisions[event[1]]
        # Safety: one delivery at most, never a delivered rollback, never two writes at once.
        assert all(n == 1 for n in s.delivered.values())
        assert not s.rolled_back & set(s.delivered)
        writing = [w.tx.half_offset for w in s.writing]
        assert len(writing) == len(set(writing))
        # The deferred index holds exactly the deferred transactions.
        indexed = [*s.core._deferred.values(), *(entries for _, entries in s.core._waking)]
        assert {(tx.group, tx.half_offset) for tx in s.core.pending.values() if tx.deferred} == {
            (tx.group, off) for entries in indexed for off, tx in entries.items()
            if s.core.pending.get(off) is tx and tx.deferred}
        # Each check slot is held by a transaction whose check went there.
        assert s.core.in_flight("conn") == sum(tx.check_channel == "conn" for tx in s.core.pending.values())
        for group in {tx.group for tx in s.core.pending.values()}:       # and its count per group agrees
            assert s.core.in_flight("conn", group) == sum(tx.check_channel == "conn" and tx.group == group
                                                          for tx in s.core.pending.values())
        assert sum(s.core._held.values()) == s.core.in_flight("conn")
        # The floor a check pass saves: the lowest undecided half's queue offset, kept without a scan.
        assert s.core.lowest_queue_offset() == min((tx.queue_offset for tx in s.core.pending.values()), default=None)
        # And the per-group counts the undecided limit reads.
        assert s.core.per_group == ({"PG": len(s.core.pending)} if s.core.pending else {})
        # Liveness: every undecided transaction is still on the check schedule.
        for tx in s.core.pending.values():
            assert _scheduled(s.core, tx), f"{tx.half_offset} would never be checked again"
            assert tx.half_offset not in s.decisions
    # And in the end: with a producer and writes that succeed, everything is decided or checked.
    s.producer = True
    for w in list(s.writing):
        s.finish(w)
    before = set(s.core.pending)
    for _ in range((MAX_CHECKS + 2) * 4):      # parked ones wait for the slots of those checked first
        s.tick(4 * INTERVAL)
        for w in list(s.writing):
            s.finish(w)
    assert not s.core.pending, f"never decided: {before}"


def test_a_half_naming_no_group_or_topic_is_dead_lettered_when_due_not_deferred_for_ever():
    """A half whose properties a crash tore (the store's checks cover the body only) can name no producer group
    or real topic: nobody could ever be asked about it, and it was deferred every interval for good, its
    producer's transaction in doubt for ever. Due, it is dead-lettered with its reason instead; no check spent."""
    s = Shell()
    s.half(1, group="")
    torn = Tx(2, 2, "PG", "", "U2", s.now)
    s.core.add(torn)
    s.half(3)
    actions = s.tick(IMMUNITY)
    assert sorted((a.tx.half_offset, a.op, a.reason) for a in actions if isinstance(a, Write)) == [
        (1, DEAD, UNCHECKABLE), (2, DEAD, UNCHECKABLE)]
    assert s.checks_sent == [3] and s.core.deferred_count() == 0
    for action in list(s.writing):
        s.finish(action)
    assert set(s.core.pending) == {3}


def test_groups_with_checks_due_are_served_in_turn_across_calls_however_many_and_whatever_their_backlog():
    """A schedule per producer group: the groups with something due are served one transaction each in turn, the
    turn carried from one call (one slice of a pass) to the next, so a group is reached after at most one
    transaction of each other due group, whatever their backlogs; within a group, oldest due first."""
    s = Shell()
    groups = [f"PG{g}" for g in range(300)]         # more groups than a slice takes
    off = 0
    for size, group in zip([2_000, *([3] * 299)], groups):
        for _ in range(size):
            off += 1
            s.half(off, group=group)
            s.now += 1
    s.now += IMMUNITY
    taken: list[str] = []
    first_taken: dict[str, int] = {}

    def busy(tx):
        first_taken.setdefault(tx.group, len(taken))
        taken.append(tx.group)
        return BUSY
    for _ in range(3):
        s.core.due(s.now, busy, limit=256)
    assert len(taken) == 3 * 256
    assert set(first_taken) == set(groups)                          # every group reached within two slices
    assert all(n < len(groups) for n in first_taken.values())       # after one transaction of each other at most
    assert taken.count("PG0") == 3                                  # its backlog of 2,000: one a turn
    assert s.core.taken == 3 * 256
    assert s.core.parked() == 3 * 256 and s.core.next_due() <= s.now         # the rest still due
    # Within a group, oldest due first.
    parked = list(s.core._parked["PG0"])
    assert [tx.half_offset for tx in parked] == sorted(tx.half_offset for tx in parked) == [1, 2, 3]


GROUP_EVENTS = st.lists(st.one_of(
    st.tuples(st.just("half"), st.integers(0, 11), st.sampled_from(["A", "B", "C"])),
    st.tuples(st.just("decide"), st.integers(0, 11), st.booleans()),
    st.tuples(st.just("tick"), st.sampled_from([0, 1, 500, INTERVAL, IMMUNITY]), st.integers(1, 3)),
    st.tuples(st.just("producer"), st.sampled_from([True, False, "busy"])),
    st.tuples(st.just("answer"), st.integers(0, 11)),
), max_size=80)


def _reachable(core: TransactionCore, group: str) -> bool:
    """A group with something scheduled is in the turn, or waits on _next no later than its next check."""
    top = core._top(group)
    return top is None or group in core._turning or any(g == group and w <= top for w, g in core._next)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(GROUP_EVENTS)
def test_no_sequence_leaves_a_group_off_the_turn_or_a_transaction_unchecked(events):
    """The per-group schedules under random halves of three groups, decisions, slices of 1-3 due entries (the
    turn carried between them), producers here, absent or at their cap, and a _next rebuilt at every chance."""
    s = Shell()
    s.core._NEXT_SLACK = 0
    added: dict[int, Tx] = {}
    for event in events:
        kind = event[0]
        if kind == "half" and event[1] not in added:
            added[event[1]] = s.half(event[1], group=event[2])
        elif kind == "decide" and event[1] in added:
            tx = added[event[1]]
            action = s.end(tx.half_offset, COMMIT, origin=Origin.ADMIN, group=None)
            if isinstance(action, Write):
                s.finish(action, ok=event[2])
        elif kind == "tick":
            s.now += event[1]
            actions, _ = s.core.due(s.now, s._channel_for, s._room_for, limit=event[2])
            for a in actions:
                if isinstance(a, SendCheck) and s.core.check_written(a.tx, s.now, True):
                    s.core.check_sent(a.tx)
                elif isinstance(a, Write):
                    s.writing.append(a)
                    s.finish(a)
        elif kind == "producer":
            s.producer = event[1]
        elif kind == "answer" and event[1] in added:
            tx = added[event[1]]
            s.core.end(tx.half_offset, UNKNOWN, origin=Origin.CHECK, group=tx.group)
        for tx in s.core.pending.values():
            assert tx.deciding is not None or _scheduled(s.core, tx), f"{tx.half_offset} off the schedule"
        for group in "ABC":
            assert _reachable(s.core, group), f"group {group} never served again"
    # And in the end: with a producer that answers, every group's transactions are checked and dead-lettered.
    s.producer = True
    for _ in range(4 * (MAX_CHECKS + 2) * 12):
        s.now += 4 * INTERVAL
        actions, _ = s.core.due(s.now, s._channel_for, s._room_for, limit=3)
        for a in actions:
            if isinstance(a, SendCheck):
                if s.core.check_written(a.tx, s.now, True):
                    s.core.check_sent(a.tx)
                    s.core.end(a.tx.half_offset, UNKNOWN, origin=Origin.CHECK, group=a.tx.group)
            else:
                s.writing.append(a)
                s.finish(a)
        if not s.core.pending:
            break
    assert not s.core.pending, f"never decided: {sorted(s.core.pending)}"


def test_decided_transactions_under_an_older_undecided_one_leave_no_schedule_entries_behind():
    """The check schedule and the age heaps are lazy: a decided transaction's entry stays until it reaches the
    top. Under one older undecided transaction (checked first) it never did before that check, and every decision left a
    (time, offset) pair in both, ~300 B a decided transaction (the broker's RSS grew 100 MiB over 200k) while a
    backlog was pending.
    Compacted once the stale entries outnumber the live ones, they stay within a bound of the pending count."""
    shell = Shell()
    shell.half(0)                               # the old one: undecided, checked first
    decided = 20_000
    for off in range(1, decided + 1):
        shell.now += 1
        shell.half(off)
        shell.finish(shell.end(off, COMMIT))
    core = shell.core
    assert list(core.pending) == [0] and len(shell.delivered) == decided
    sched = sum(len(h) for h in core._sched.values())
    age = sum(len(h) for h in core._by_age.values())
    assert sched <= 2 * len(core.pending) + core._SCHED_SLACK, sched
    assert age <= 2 * len(core.pending) + core._AGE_SLACK, age
    assert core.next_due() == 1_000_000 + IMMUNITY      # the old one is still the first one due
    shell.now = core.next_due()
    [check] = shell.tick(0)
    assert isinstance(check, SendCheck) and check.tx.half_offset == 0
    assert core.compactions > 0
    assert [tx.half_offset for tx in core.oldest(None, 10)] == [0]     # compacted, not duplicated
    assert core.oldest_by_group() == {"PG": 1_000_000}


class _CountedReads(dict):
    """The index's dict, its reads counted: the work a call does on the heaps' entries."""
    reads = 0

    def get(self, key, default=None):
        self.reads += 1
        return super().get(key, default)


def test_decisions_under_a_backlog_clear_the_lazy_heaps_a_slice_at_a_time_not_in_one_pause():
    """Rebuilt at once when their stale entries outnumbered the live ones, the schedule and the age heaps held the
    loop 470-520 ms at 500k pending (each entry of both read in one call). Swept a slice a push, no half stored and
    decided reads more than a few slices of entries, and the heaps stay within their bound all the same."""
    shell = Shell()
    core = shell.core
    core.pending = _CountedReads()
    backlog = 3 * core._SCHED_SLACK
    for off in range(backlog):                  # older undecided ones: their entries stay on top
        shell.half(off)
    worst = 0
    for off in range(backlog, backlog + 12 * backlog):
        shell.now += 1
        before = core.pending.reads
        shell.half(off)
        shell.finish(shell.end(off, COMMIT))
        worst = max(worst, core.pending.reads - before)
    assert len(core.pending) == backlog and core.compactions > 0
    assert worst <= 2 * core._SWEEP + 16, worst     # a slice of each heap, and the add and end themselves
    bound = 2 * (2 * backlog + core._SCHED_SLACK)   # a sweep ends with no more than those added meanwhile
    assert sum(map(len, core._sched.values())) <= bound
    assert sum(map(len, core._by_age.values())) <= bound
    assert sorted(tx.half_offset for tx in core.oldest(None, backlog + 1)) == list(range(backlog))
    shell.now = core.next_due()
    assert {a.tx.half_offset for a in shell.tick(0)} <= set(range(backlog))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=300), st.lists(st.integers(0, 5000), max_size=300),
       st.integers(0, 250_000), st.integers(0, 250_000))
def test_between_is_the_pending_halves_of_a_log_range_in_log_order(added, decided, lo, hi):
    """Retention asks which undecided halves a segment holds (TransactionCore.between, off the buckets by
    half-queue offset): exactly those whose half offset is in [lo, hi), whatever was decided before."""
    core = TransactionCore(POLICY, {}.get)
    for q in added:         # one half queue: a later queue offset is a later log offset
        core.add(Tx(50 * q + 7, q, "PG", "T", f"U{q}", 1_000))
    for q in decided:
        core.withdraw(50 * q + 7)
    assert [tx.half_offset for tx in core.between(lo, hi)] == sorted(off for off in core.pending if lo <= off < hi)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(["add", "withdraw", "between"]), st.integers(0, 40 * 1024),
                          st.integers(0, 40 * 1024)), max_size=200))
def test_between_keeps_the_floor_and_its_answers_as_halves_come_and_go_over_many_buckets(ops):
    """between() takes the buckets it reads off the floor's lazy heap and puts them back: the floor, and every
    later answer, stay exact whatever came, went or was read before (buckets emptied, refilled, many of them)."""
    core = TransactionCore(POLICY, {}.get)
    for op, q, span in ops:
        if op == "add":
            core.add(Tx(50 * q + 7, q, "PG", "T", f"U{q}", 1_000))
        elif op == "withdraw":
            core.withdraw(50 * q + 7)
        else:
            lo, hi = 50 * q, 50 * (q + span)
            assert [tx.half_offset for tx in core.between(lo, hi)] == sorted(
                off for off in core.pending if lo <= off < hi)
        assert core.lowest_queue_offset() == min((tx.queue_offset for tx in core.pending.values()), default=None)
        assert set(core._by_queue) <= set(core._buckets)


def test_a_channel_that_left_a_check_unanswered_is_silent_until_it_answers_or_leaves():
    """The service asks a silent producer only when no other has room: the core says which (channel, group) left a
    check unanswered since its last answer, once each as newly silent, and forgets it on an answer or a close."""
    s = Shell()
    s.half(1)
    s.half(2, group="PG_other")
    s.tick(IMMUNITY)
    assert s.core.unanswered_checks("conn", "PG") == 0 and s.core.newly_silent == []
    s.tick(INTERVAL)                                    # both due again, unanswered
    assert s.core.unanswered_checks("conn", "PG") == 1 and s.core.unanswered_checks("conn", "PG_other") == 1
    assert sorted(s.core.newly_silent) == [("conn", "PG"), ("conn", "PG_other")]
    s.core.newly_silent.clear()
    s.tick(2 * INTERVAL)
    assert s.core.unanswered_checks("conn", "PG") == 2 and s.core.newly_silent == []     # said once
    s.end(1, UNKNOWN, origin=Origin.CHECK)              # an answer clears its group's, not the other's
    assert s.core.unanswered_checks("conn", "PG") == 0 and s.core.unanswered_checks("conn", "PG_other") == 2
    s.core.channel_closed("conn", s.now)
    assert s.core.silent == {}


def test_a_late_answer_clears_the_silence_of_the_channel_it_came_on_not_of_the_one_asked_since():
    """A slow producer answers a check after it came due again and went to another: the answer clears the slow one's
    silence (it answers), not the other's (which has not)."""
    s = Shell()
    s.half(1)
    s.tick(IMMUNITY)                                    # asked of "conn"
    s._channel_for = lambda tx: "other"
    s.tick(INTERVAL)                                    # due again unanswered: asked of "other"
    s.tick(2 * INTERVAL)                                # and again
    assert (s.core.unanswered_checks("conn", "PG"), s.core.unanswered_checks("other", "PG")) == (1, 1)
    s.core.end(1, UNKNOWN, origin=Origin.CHECK, group="PG", queue_offset=None, channel="conn")     # late
    assert (s.core.unanswered_checks("conn", "PG"), s.core.unanswered_checks("other", "PG")) == (0, 1)
