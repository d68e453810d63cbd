"""Decision-table files are made on a thread ahead of the first decision that needs them, never by both."""
from __future__ import annotations

import os
import threading

from broker.transaction.decisions import DecisionTable
from broker.transaction.records import COMMIT, ROLLBACK


def test_the_file_of_a_new_half_and_the_next_past_half_way_are_wanted_once(tmp_path):
    t = DecisionTable(str(tmp_path), file_entries=8)
    assert t.wants(0) == 0              # its own file is missing
    assert t.wants(1) is None           # already being made
    t.adopt(0, t.make(0))
    assert t.wants(3) is None           # below half way of file 0
    assert t.wants(4) == 8              # past half way: the next file
    assert t.wants(7) is None
    t.adopt(8, t.make(8))
    assert t.wants(5) is None
    assert sorted(os.listdir(tmp_path)) == [f"{0:020d}", f"{8:020d}"]


def test_a_decision_finds_the_file_made_ahead_and_does_not_make_it_on_the_loop(tmp_path, monkeypatch):
    t = DecisionTable(str(tmp_path), file_entries=8)
    base = t.wants(2)
    made = []
    th = threading.Thread(target=lambda: made.append(t.make(base)))
    th.start()
    th.join(10)
    t.adopt(base, made[0])

    def no_open(_base):
        raise AssertionError("the decision made its file on the loop")
    monkeypatch.setattr(t, "_open", no_open)
    t.set(2, COMMIT)
    assert t.get(2) == COMMIT
    monkeypatch.undo()
    t.close()
    assert DecisionTable(str(tmp_path), file_entries=8).get(2) == COMMIT    # on disk, in the linked file


def test_the_loop_making_the_same_file_first_wins_and_loses_nothing(tmp_path):
    t = DecisionTable(str(tmp_path), file_entries=8)
    base = t.wants(1)
    t.set(1, ROLLBACK)                  # the decision came before the thread: _open on the loop
    assert t.make(base) is None         # the thread sees the file and leaves it alone
    t.adopt(base, None)
    t.set(3, COMMIT)
    t.close()
    again = DecisionTable(str(tmp_path), file_entries=8)
    assert (again.get(1), again.get(3)) == (ROLLBACK, COMMIT)
    assert os.listdir(tmp_path) == [f"{0:020d}"]


def test_a_file_linked_by_the_thread_after_the_loop_opened_its_own_map_is_dropped_not_swapped(tmp_path):
    t = DecisionTable(str(tmp_path), file_entries=8)
    base = t.wants(0)
    made = t.make(base)                 # linked and mapped by the thread...
    t.set(0, COMMIT)                    # ...but the loop got there first and opened the same file
    t.adopt(base, made)                 # the extra map is closed; both maps were of one file
    assert made.closed
    t.set(1, ROLLBACK)
    t.close()
    again = DecisionTable(str(tmp_path), file_entries=8)
    assert (again.get(0), again.get(1)) == (COMMIT, ROLLBACK)


def test_a_leftover_file_of_a_stopped_make_is_removed_at_start(tmp_path):
    leftover = tmp_path / (f"{8:020d}" + ".ahead")
    leftover.write_bytes(b"\0" * 8)
    t = DecisionTable(str(tmp_path), file_entries=8)
    assert not leftover.exists() and t.file_count == 0


def test_a_failed_make_leaves_no_file_and_the_decision_still_lands(tmp_path, monkeypatch):
    t = DecisionTable(str(tmp_path), file_entries=8)
    base = t.wants(0)

    def enospc(fd, off, n):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "pwrite", enospc)
    try:
        t.make(base)
        raise AssertionError("make did not fail")
    except OSError:
        pass
    monkeypatch.undo()
    t.adopt(base, None)
    assert os.listdir(tmp_path) == []
    t.set(0, COMMIT)                    # the fallback on the loop
    assert t.get(0) == COMMIT
    assert t.wants(5) == 8              # and the next file is wanted again later


def test_a_failed_open_on_the_loop_never_unlinks_the_file_the_thread_linked_meanwhile(tmp_path, monkeypatch):
    # _open decided "I create it" from os.path.exists, then opened the name: if the thread linked its
    # file in between and the map then failed (ENOMEM, max_map_count), _open unlinked the thread's
    # file. adopt() then kept the thread's map of the unlinked inode: decisions written there were
    # gone at the next start.
    import broker.transaction.decisions as decisions
    t = DecisionTable(str(tmp_path), file_entries=8)
    base = t.wants(0)
    path = os.path.join(str(tmp_path), f"{base:020d}")
    made = t.make(base)                                     # the thread linked and mapped it...
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if p == path else real_exists(p))  # ...after the check

    class NoMap:
        @staticmethod
        def mmap(fd, n):
            raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(decisions, "mmap", NoMap)
    t.set(0, COMMIT)                                        # the loop's map fails: the entry waits in memory
    assert t.get(0) == COMMIT and t.waiting == 1
    monkeypatch.undo()
    assert os.path.exists(path)                             # the thread's file is still there
    t.adopt(base, made)                                     # and taken: the waiting entry lands in it
    assert t.waiting == 0
    t.close()
    assert DecisionTable(str(tmp_path), file_entries=8).get(0) == COMMIT
