"""One log record, one line: control characters a client put in a name are escaped where they land in a message.

Group, topic and client names are the clients' to choose, and log lines quote them. A consumer group named
"G\\n2026-11-28 00:00:00,000 ERROR txmq.store: ..." wrote a second line looking like the store's own ERROR, for
any grep, alert or log shipper to take as one. A record's message is written with its control characters
escapes (\\n, \\x1b); a traceback logged with it (log.exception) is still written as the lines it is.
"""
from __future__ import annotations

import logging
import re
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _escaped(match: re.Match) -> str:
    char = match.group()
    return {"\n": "\\n", "\r": "\\r"}.get(char) or f"\\x{ord(char):02x}"


class OneLineFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        return _CONTROL.sub(_escaped, super().formatMessage(record))


def configure(level) -> None:
    """The broker's, the name server's and the cluster supervisor's logging: to stderr, one line a record."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
