"""One log record, one line: control characters a client put in a name are escaped where they land in a message.

Group, topic and client names are the clients' to choose, and log lines quote them. A consumer group named
"G\\n2026-11-28 00:00:00,000 ERROR txmq.store: ..." wrote a second line looking like the store's own ERROR, for
any grep, alert or log shipper to take as one. A record's message is written with its control characters
escaped (\\n, \\x1b, \\x85, \\u2028: all a terminal or str.splitlines takes as a line break or a command); a
traceback logged with it (log.exception) is still written as the lines it is, but the exception's own message
(and notes), written after it and as likely to quote a name, are escaped too.
"""
from __future__ import annotations

import logging
import re
import sys
import traceback

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# C0 but the tab, DEL, C1 (NEL \x85, CSI \x9b), and the Unicode line and paragraph separators
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def _escaped(match: re.Match) -> str:
    char = match.group()
    code = ord(char)
    return {"\n": "\\n", "\r": "\\r"}.get(char) or (f"\\x{code:02x}" if code <= 0xff else f"\\u{code:04x}")


def escape(text: str) -> str:
    return _CONTROL.sub(_escaped, text)


class OneLineFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape(super().formatMessage(record))

    def formatException(self, ei) -> str:
        if ei[1] is None:
            return super().formatException(ei)
        top = traceback.TracebackException(ei[0], ei[1], ei[2])
        todo, seen = [top], set()
        while todo:                             # the exception, its cause/context chain and a group's members
            te = todo.pop()
            if te is None or id(te) in seen:
                continue
            seen.add(id(te))
            if isinstance(getattr(te, "_str", None), str):      # (3.11-3.13: the message format_exception_only writes)
                te._str = escape(te._str)
            if getattr(te, "__notes__", None):
                te.__notes__ = [escape(str(note)) for note in te.__notes__]
            todo += [te.__cause__, te.__context__, *(getattr(te, "exceptions", None) or ())]
        text = "".join(top.format())
        return text[:-1] if text.endswith("\n") else text


def configure(level) -> None:
    """The broker's, the name server's and the cluster supervisor's logging: to stderr, one line a record."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
