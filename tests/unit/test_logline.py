"""broker/logline.py: a record's message is one line whatever its arguments hold; its traceback stays lines."""
from __future__ import annotations

import logging

from broker.logline import FORMAT, OneLineFormatter


def _format(msg, *args, exc_info=None) -> str:
    record = logging.LogRecord("txmq.t", logging.WARNING, __file__, 1, msg, args, exc_info)
    return OneLineFormatter(FORMAT).format(record)


def test_control_characters_in_a_message_are_escaped():
    line = _format("group %s joined", "G\n2026 ERROR x\r\x00\x1b[2K\x7f\tend")
    assert "\n" not in line and "\r" not in line
    assert line.endswith("group G\\n2026 ERROR x\\r\\x00\\x1b[2K\\x7f\tend joined")   # (a tab is kept)


def test_a_traceback_is_still_written_as_lines():
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        import sys
        line = _format("handling %s failed", "G\nX", exc_info=sys.exc_info())
    head, *rest = line.split("\n")
    assert head.endswith("handling G\\nX failed")
    assert rest[0] == "Traceback (most recent call last):" and rest[-2:] == ["ValueError: bad", "value"]
