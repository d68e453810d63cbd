"""Parse the broker's per-minute metric snapshots (<store>/metrics/<YYYY-MM-DD>.jsonl). Pure Python.

One JSON object per line:

    {"ts": <ms>, "connections": <int>,
     "consumer_lag": [{"group": str, "topic": str, "queue_id": int, "lag": int}],
     "requests": {"<REQUEST_NAME>": {"count": int, "p50_ms": float, "p99_ms": float}}}

A line that is not a JSON object with an integer "ts" is *bad* (it cannot be placed in a
window) and is only counted. A line with "ts" but a missing or malformed "connections" or
"consumer_lag" (or lag entries without group / integer lag) is *incomplete*: what is there
is used, and the line is counted. "requests" is not rolled up (see docs/ops-spark.md).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re

# Row kinds: one "snap" per usable line, one "lag" per usable lag entry, plus counters.
SNAPSHOT_FIELDS = ("kind", "ts", "connections", "group", "topic", "queue_id", "lag")
_FILE = re.compile(r"(\d{4}-\d{2}-\d{2})\.jsonl")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(line: str) -> list[tuple]:
    """Rows for one line: [("bad", ...)] or a "snap" row, "lag" rows, maybe an "incomplete" row."""
    blank = (None,) * (len(SNAPSHOT_FIELDS) - 1)
    line = line.strip()
    if not line:
        return []
    try:
        obj = json.loads(line)
    except ValueError:
        return [("bad",) + blank]
    if not isinstance(obj, dict) or not _is_int(obj.get("ts")):
        return [("bad",) + blank]
    ts = obj["ts"]
    incomplete = False
    connections = obj.get("connections")
    if not _is_int(connections):
        connections, incomplete = None, True
    rows = [("snap", ts, connections, None, None, None, None)]
    lag = obj.get("consumer_lag")
    if not isinstance(lag, list):
        lag, incomplete = [], True
    for entry in lag:
        if (not isinstance(entry, dict) or not isinstance(entry.get("group"), str)
                or not _is_int(entry.get("lag"))):
            incomplete = True
            continue
        topic = entry.get("topic") if isinstance(entry.get("topic"), str) else None
        qid = entry.get("queue_id") if _is_int(entry.get("queue_id")) else None
        rows.append(("lag", ts, None, entry["group"], topic, qid, entry["lag"]))
    if incomplete:
        rows.append(("incomplete",) + blank)
    return rows


def parse_lines(lines):
    """mapPartitions body over text lines."""
    for line in lines:
        yield from parse_line(line)


def snapshot_files(store_dir: str, dates: list[str] | None = None) -> list[str]:
    """The snapshot files to read. For given dates, the neighbouring days' files too: a file
    named by the broker's local date can hold the first or last hours of a UTC day."""
    directory = os.path.join(store_dir, "metrics")
    try:
        names = sorted(n for n in os.listdir(directory) if _FILE.fullmatch(n))
    except FileNotFoundError:
        return []
    if dates is not None:
        wanted = set()
        for d in dates:
            day = dt.date.fromisoformat(d)
            wanted.update(str(day + dt.timedelta(days=k)) for k in (-1, 0, 1))
        names = [n for n in names if _FILE.fullmatch(n).group(1) in wanted]
    return [os.path.join(directory, n) for n in names]
