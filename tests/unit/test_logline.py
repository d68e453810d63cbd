"""protocol/logline.py: a record's message is one line whatever its arguments hold; its traceback stays lines."""
from __future__ import annotations

import logging

from protocol.logline import FORMAT, OneLineFormatter


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
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: bad\\nvalue"


def test_a_client_name_in_a_logged_exception_cannot_forge_a_line():
    """log.exception writes the exception's message after the traceback: a group name in it ("no offset for
    group G\\n<timestamp> ERROR ...") wrote a line of its own there. Its message is escaped; the frame lines and
    a chained exception's stay lines."""
    forged = "2026-01-01 00:00:00,000 ERROR txmq.store: FORGED"
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ValueError(f"no offset for group G\n{forged}") from inner
    except ValueError:
        import sys
        text = _format("answering %s failed", 14, exc_info=sys.exc_info())
    lines = text.split("\n")
    assert not [line for line in lines if line.startswith(forged[:20])], lines
    assert lines[-1] == f"ValueError: no offset for group G\\n{forged}"
    assert "KeyError: 'inner'" in lines and lines.count("Traceback (most recent call last):") == 2
    assert [line for line in lines if line.startswith('  File "')]


def test_characters_str_splitlines_and_terminals_break_lines_on_are_escaped_and_other_non_ascii_kept():
    """str.splitlines (and log tools built on it) end a line at NEL and the Unicode line and paragraph
    separators too, and a terminal takes C1 controls (\\x9b is CSI): a name holding them split or rewrote a
    record as "\\n" did. Printable non-ASCII names stay as they are."""
    line = _format("group %s joined", "G\x85A\u2028B\u2029C\x9b2K\x0b\x0c\x1c Grüße 订单 🚀")
    assert len(line.splitlines()) == 1, line.splitlines()
    assert line.endswith("group G\\x85A\\u2028B\\u2029C\\x9b2K\\x0b\\x0c\\x1c Grüße 订单 🚀 joined")


def test_the_spark_jobs_log_cannot_be_forged_by_a_group_name(capsys, monkeypatch):
    """python -m ops.spark logs the consumer groups it read from the store (expiry: "group %s has not consumed
    ..."): a group named "G\\nexpiry: ..." wrote a line of its own there, as in the broker's log."""
    from ops.spark import cli
    spark_log = logging.getLogger("ops.spark")
    monkeypatch.setattr(spark_log, "handlers", [])
    monkeypatch.setattr(spark_log, "propagate", spark_log.propagate)
    monkeypatch.setattr(spark_log, "level", spark_log.level)
    cli._setup_logging()
    spark_log.warning("expiry: group %s has not consumed %d of them on topic %s",
                      "G\nexpiry: wrote /tmp/plan.json", 3, "T")
    err = capsys.readouterr().err
    assert err == "expiry: group G\\nexpiry: wrote /tmp/plan.json has not consumed 3 of them on topic T\n"


def test_the_admin_pending_table_shows_a_producer_groups_control_characters_escaped():
    """`python -m broker admin pending` prints the undecided halves' producer groups and keys, both the clients'
    to choose: a group "PG\\n<a row>" printed a row of its own, and "\\x1b[2J" cleared the operator's terminal."""
    from broker.admin import _table
    rows = [{"commit_log_offset": 1, "group": "PG\n999  FORGED\x1b[2J", "topic": "T", "age_ms": 5, "checks": 0,
             "owner": "", "last_answer": "", "uniq_key": "K\u2028X"}]
    out = _table(rows).splitlines()
    assert len(out) == 2, out
    assert "PG\\n999  FORGED\\x1b[2J" in out[1] and "K\\u2028X" in out[1]
