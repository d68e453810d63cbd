"""How a batch's one answer becomes each send's SendResult."""
from __future__ import annotations

import logging

from producer.accumulator import split_result
from producer.producer import SendResult, SendStatus
from producer.routes import MessageQueue


def _answer(offset_msg_id: str) -> SendResult:
    return SendResult(SendStatus.SEND_OK, "", offset_msg_id, MessageQueue("T", "b", 0), 7, None, "127.0.0.1:1")


def test_each_send_of_a_batch_gets_its_own_id_and_offset():
    got = split_result(_answer("A,B,C"), ["u0", "u1", "u2"])
    assert [(r.msg_id, r.offset_msg_id, r.queue_offset) for r in got] == [("u0", "A", 7), ("u1", "B", 8),
                                                                          ("u2", "C", 9)]


def test_an_answer_whose_id_count_does_not_match_leaves_each_id_unknown_and_says_so(caplog):
    """Each send was given the whole comma-joined answer as its own id, with nothing said: stored by its caller
    as the message's id, it named no message when looked up."""
    with caplog.at_level(logging.WARNING, logger="txmq.producer"):
        got = split_result(_answer("A,B"), ["u0", "u1", "u2"])
    assert [r.offset_msg_id for r in got] == ["", "", ""]
    assert [r.msg_id for r in got] == ["u0", "u1", "u2"]
    assert "answered 2 id(s)" in caplog.text and "'A,B'" in caplog.text
