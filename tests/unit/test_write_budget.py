"""WriteBudget and ReadBudget (protocol/connection.py): which connections go when all of them together hold too much
unread, or too much of frames not yet whole."""
from __future__ import annotations

from protocol.connection import ReadBudget, WriteBudget

MiB = 1024 * 1024


class FakeConn:
    """What the budget reads of a connection: its unsent bytes, whether its peer stopped reading, abort()."""

    def __init__(self, name, unsent, paused):
        self.peer = (name, 1)
        self.unsent_bytes = unsent
        self.writing_paused = paused
        self.aborted = False

    def abort(self):
        self.aborted = True
        self.unsent_bytes = 0


def test_the_largest_holders_that_stopped_reading_go_first_and_only_until_under_the_cap():
    closed = []
    budget = WriteBudget(10 * MiB, on_close=closed.append)
    reader = FakeConn("reader", 4 * MiB, paused=False)      # a slow but reading consumer: biggest, not paused
    small, big = FakeConn("small", 3 * MiB, True), FakeConn("big", 3.5 * MiB, True)    # 10.5 MiB in all
    for c in (reader, small, big):
        budget.report(c, c.unsent_bytes)
    assert [c.peer[0] for c in (reader, small, big) if c.aborted] == ["big"]
    assert closed == ["max_total_write_buffer"] and budget.total == 7 * MiB


def test_buffers_that_drained_since_their_last_report_are_read_afresh_before_anyone_is_closed():
    budget = WriteBudget(10 * MiB)
    drained = FakeConn("drained", 8 * MiB, True)
    budget.report(drained, drained.unsent_bytes)
    drained.unsent_bytes = 0            # its peer read it all; nothing told the budget
    other = FakeConn("other", 5 * MiB, True)
    budget.report(other, other.unsent_bytes)
    assert not other.aborted and not drained.aborted and budget.total == 5 * MiB


def test_a_closed_connection_leaves_the_total():
    budget = WriteBudget(10 * MiB)
    c = FakeConn("c", 6 * MiB, True)
    budget.report(c, c.unsent_bytes)
    budget.report(c, 0)
    assert budget.total == 0
    d = FakeConn("d", 9 * MiB, True)
    budget.report(d, d.unsent_bytes)
    assert not d.aborted


class Partial:
    """What a ReadBudget reads of a connection: the bytes of its frame not yet whole, abort()."""

    def __init__(self, name, unfinished):
        self.peer = (name, 1)
        self.unfinished_bytes = unfinished
        self.aborted = False

    def abort(self):
        self.aborted = True


def test_frames_unfinished_longest_go_first_not_the_largest():
    """Largest first closed a request sent at full speed (its frame in progress the largest) in place of
    connections idling on frames they never finish. A connection that finished a frame and began another goes
    to the back of the line."""
    closed = []
    budget = ReadBudget(10 * MiB, on_close=closed.append)
    idle, streaming = Partial("idle", 3 * MiB), Partial("streaming", 3 * MiB)
    budget.report(streaming, streaming.unfinished_bytes)
    budget.report(idle, idle.unfinished_bytes)
    budget.report(streaming, streaming.unfinished_bytes, fresh=True)    # a frame done; as much of the next
    big = Partial("big", 5 * MiB)                                       # 11 MiB in all
    budget.report(big, big.unfinished_bytes)
    assert [c.peer[0] for c in (idle, streaming, big) if c.aborted] == ["idle"]
    assert closed == ["max_total_read_buffer"] and budget.total == 8 * MiB
    budget.report(big, 0)                       # its frame whole, or its connection closed mid-frame
    budget.report(streaming, 0)
    assert budget.total == 0 and not budget._held


def test_a_frame_still_arriving_keeps_its_place_in_the_line():
    """More bytes of the same frame do not send its connection to the back: each did, so a peer trickling a byte
    of its 4 MiB frame now and then stayed out of the shedding's way for good, and a connection whose frame began
    after it (and was no nearer to whole) went first, against the order the docs give."""
    budget = ReadBudget(10 * MiB)
    trickling, later = Partial("trickling", 4 * MiB), Partial("later", 4 * MiB)
    budget.report(trickling, trickling.unfinished_bytes)
    budget.report(later, later.unfinished_bytes)
    trickling.unfinished_bytes += 1
    budget.report(trickling, trickling.unfinished_bytes)                # one byte more of the same frame
    big = Partial("big", 3 * MiB)
    budget.report(big, big.unfinished_bytes)
    assert [c.peer[0] for c in (trickling, later, big) if c.aborted] == ["trickling"]
