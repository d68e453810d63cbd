"""Parse the broker's per-minute metric snapshots (<store>/metrics/<YYYY-MM-DD>.jsonl). Pure Python.

One JSON object per line:

    {"ts": <ms>, "connections": <int>,
     "consumer_lag": [{"group": str, "topic": str, "queue_id": int, "lag": int}],
     "requests": {"<REQUEST_NAME>": {"count": int, "p50_ms": float, "p99_ms": float}}}

A line that is not a JSON object with an integer "ts" is *bad* (it cannot be placed in a
window) and is only counted. A line with "ts" but a missing or malformed "connections" or
"consumer_lag" (or lag entries without group / integer lag) is *incomplete*: what is there
is used, and the line is counted. "requests" is not rolled up (see docs/ops-spark.md).

Each snap and lag row carries the id of the line it came from ("line", unique in a read: the Spark
partition's index and the line's number in it): a line read twice (a file restored with `cat old >> new`)
is one snapshot, and load.load_snapshots keeps one line a ts by it.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import time

# Row kinds: one "snap" per usable line, one "lag" per usable lag entry, plus counters.
SNAPSHOT_FIELDS = ("kind", "ts", "connections", "group", "topic", "queue_id", "lag", "line")
_FILE = re.compile(r"(\d{4}-\d{2}-\d{2})\.jsonl")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(line: str, line_id: int | None = None) -> list[tuple]:
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
    rows = [("snap", ts, connections, None, None, None, None, line_id)]
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
        rows.append(("lag", ts, None, entry["group"], topic, qid, entry["lag"], line_id))
    if incomplete:
        rows.append(("incomplete",) + blank)
    return rows


def parse_lines(index: int, lines):
    """mapPartitionsWithIndex body over text lines: each line's id is the partition's index and its number."""
    for n, line in enumerate(lines):
        yield from parse_line(line, (index << 32) | n)


# A file modified this recently may be the one the broker is appending to now (a line every
# metrics_snapshot_interval_s, written in a few calls): only its newline-ended part is read.
LIVE_S = 120.0


def whole_part(path: str, *, now: float | None = None) -> int | None:
    """For a file the broker may be appending to (modified in the last LIVE_S seconds), the length of its
    newline-ended part, the bytes a reader may take; None for a file no longer written, read whole (an
    unterminated last line there is one a kill -9 tore: a bad line)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 0
    if (time.time() if now is None else now) - st.st_mtime > LIVE_S:
        return None
    size = st.st_size
    with open(path, "rb") as f:
        pos = size
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                return start + nl + 1
            pos = start
    return 0


def read_lines(items):
    """mapPartitions body over (path, length): the text lines of each file's first length bytes (a file
    that grows while read is read no further than the driver saw it end with a newline)."""
    for path, length in items:
        with open(path, "rb") as f:
            left = length
            while left > 0:
                line = f.readline(left)
                if not line:
                    break
                left -= len(line)
                yield line.decode("utf-8", "replace")


def snapshot_files(store_dir: str, dates: list[str] | None = None) -> list[str]:
    """The snapshot files to read. For given dates, the neighbouring days' files too (each line is
    filtered by its ts; the broker names a file by its lines' UTC date, and the day after the date
    rolled up is often the file it is appending to: see whole_part)."""
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
