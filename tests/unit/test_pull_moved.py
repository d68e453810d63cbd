"""The broker's account of consumers moved past messages retention removed (PULL_OFFSET_MOVED)."""
from __future__ import annotations

from types import SimpleNamespace

from broker.metrics import BrokerMetrics
from broker.processors import pull


def test_moves_of_names_a_client_makes_up_are_counted_but_not_each_logged(caplog, monkeypatch):
    """Each move is logged once a minute for a queue of a group; a client pulling under a new group name each
    time at an offset retention removed had one WARNING line a request, as many a minute as it sent. Past a
    bound a minute the moves are still counted (txmq_pull_offset_moved_messages_total), and one line says the
    rest are not logged."""
    monkeypatch.setattr(pull, "_moved_to", {})
    monkeypatch.setattr(pull, "_moved", pull.EveryKey(60.0))
    monkeypatch.setattr(pull, "_moved_lines", {"since": float("-inf"), "n": 0})
    ctx = SimpleNamespace(offsets=SimpleNamespace(get=lambda *key: 5), metrics=BrokerMetrics())
    with caplog.at_level("WARNING", logger="txmq.pull"):
        for i in range(2000):
            pull._moved_past_removed(ctx, f"G{i}", "T", 0, 5, 100)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == pull.MOVED_LINES_A_MINUTE + 1, len(lines)
    assert "not logged" in lines[-1]
    counted = sum(s.value for m in ctx.metrics.registry.collect() if m.name == "txmq_pull_offset_moved_messages"
                  for s in m.samples if s.name.endswith("_total"))
    assert counted == 2000 * 95


def test_a_deleted_topics_move_marks_go_whatever_its_groups_are_named(monkeypatch):
    """Group names are not checked for characters (only stock clients keep to [%|a-zA-Z0-9_-]): a mark of a group
    whose name holds the key's separator must go with its topic too."""
    monkeypatch.setattr(pull, "_moved_to", {})
    monkeypatch.setattr(pull, "_moved", pull.EveryKey(60.0))
    ctx = SimpleNamespace(offsets=SimpleNamespace(get=lambda *key: 5), metrics=BrokerMetrics())
    for group in ("CG", "odd\0name"):
        pull._moved_past_removed(ctx, group, "T", 0, 5, 100)
    pull._moved_past_removed(ctx, "CG", "Kept", 0, 5, 100)
    pull.forget_moves("T")
    assert list(pull._moved_to) == ["CG\0Kept\0" + "0"]
