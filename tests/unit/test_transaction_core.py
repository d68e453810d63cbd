"""The transaction rules (broker/transaction/core.py): tables of event sequences, and random sequences.

The core has no I/O and no clock: each test plays the shell, performing the actions it returns.
"""
from __future__ import annotations

import heapq

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.transaction.check import Policy
from broker.transaction.core import (
    BUSY,
    COMMIT,
    DEAD,
    ROLLBACK,
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
        if self.producer == "busy" or self.core.in_flight.get("conn", 0) >= self.CAP:
            return BUSY
        return "conn"

    def _room_for(self, group: str) -> int | None:
        if not self.producer:
            return None     # nobody here: the parked are deferred, as the service's _room_for
        if self.producer is not True:
            return 0
        return max(0, self.CAP - self.core.in_flight.get("conn", 0))

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
), max_size=60)


def _scheduled(core: TransactionCore, tx: Tx) -> bool:
    """On the check schedule, or parked until its producers have room for its check."""
    return (tx.next_check, tx.half_offset) in core._heap or (tx.parked and tx in core._parked.get(tx.group, ()))


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
        elif kind == "resume" and s.decisions.get(event[1]) == DEAD:
            if s.core.resume(Tx(event[1], event[1], "PG", "T", "U", s.now), s.now) is None:
                del s.decisions[event[1]]
        # Safety: one delivery at most, never a delivered rollback, never two writes at once.
        assert all(n == 1 for n in s.delivered.values())
        assert not s.rolled_back & set(s.delivered)
        writing = [w.tx.half_offset for w in s.writing]
        assert len(writing) == len(set(writing))
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
    heapq.heapify(s.core._heap)
