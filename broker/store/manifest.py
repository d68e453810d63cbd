"""The store's identity and its segment manifest: what a retention plan is checked against.

``<store>/store_id``        one line, a UUID written when the store is created. A plan carries
                            the id of the store it was made from; a broker applies only its own.
``<store>/segments.json``   one entry per commit-log segment, oldest first, written by the broker:

    {"store_id": str, "written_ms": int,
     "segments": [{"name": "<20 digits>", "start": int, "end": int, "records": int,
                   "first_ts": int, "last_ts": int, "sealed": bool}],
     "removed": {the same entry, of the newest segment removed} | absent}

``removed`` is what the log no longer has: the entry of the last segment retention removed (it
ends where the oldest segment left starts). The rollup reads its ``last_ts`` to tell the days
whose records went with it (cut) from those that lie wholly in the segments left (whole); without
it, the day of the oldest record left must count as cut. Carried over across restarts.

``end`` is the commit-log offset after the segment's last record, ``first_ts`` / ``last_ts``
the smallest and largest store timestamps in it (-1 when it holds no record). A sealed
segment never changes, so its entry is computed once, from the bytes (read through a mapping
of its own, off the event loop), and carried over; the active segment's entry is the broker's
view at ``written_ms`` and only grows. The Spark jobs read this file to pick the segments a
date can be in; the broker reads nothing back from it but its own sealed entries.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import uuid
from dataclasses import dataclass

from protocol.message import MESSAGE_MAGIC, peek_record
from protocol.record import MIN_RECORD_SIZE, store_timestamp_at

from .mapped_file import fsync_dir

log = logging.getLogger("txmq.store")

STORE_ID_FILE = "store_id"
NUL_FREE_FILE = "nul_free_from"     # commit-log offset from which every record's topic and properties hold no NUL
MANIFEST_FILE = "segments.json"
# commit-log offset where a copy of an older broker's record with a NUL was being written, not yet vouched for
NUL_COPY_FILE = "nul_copy_from"
CORRUPT_KEPT_FILE = "corrupt_kept"  # log offsets of damaged records kept in place (keep_corrupt_records)


@dataclass(frozen=True, slots=True)
class SegmentFacts:
    name: str
    start: int
    end: int             # offset after the last record
    records: int
    first_ts: int        # -1: no record
    last_ts: int
    sealed: bool


def _write_atomically(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def load_or_create_store_id(store_dir: str) -> str:
    """The store's id; a new one is written when the store has none (a new store, or one made before ids)."""
    path = os.path.join(store_dir, STORE_ID_FILE)
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        return str(uuid.UUID(text))
    except FileNotFoundError:
        pass
    except (ValueError, UnicodeDecodeError):
        # Not replaced here: the id ties expiry plans and the transaction snapshot to this store, and an operator
        # may have a copy of it (a plan names it). Nothing is lost by a new one, which the hint says.
        raise ValueError(f"{path} does not hold a store id (a UUID); it was damaged or written by hand: put the "
                         f"store's id back (expiry plans name it), or remove the file to have a new one written "
                         f"(the transaction snapshot is then rebuilt from the log, and plans made before are "
                         f"refused)") from None
    new = str(uuid.uuid4())
    _write_atomically(path, (new + "\n").encode())
    return new


def read_nul_free_from(store_dir: str) -> int | None:
    """The commit-log offset from which this store's records were written by a broker that refuses NUL in
    topic and properties (so a NUL there is damage: recovery cuts it, reads refuse it), or None when no such
    broker opened the store yet. Records before it are an older broker's: RocketMQ stores a NUL in a user
    property value, and read as damage those acknowledged messages were cut at start-up or refused on every
    read (a queue stuck at them). It moves on past a slave's copy of its master's such records (before the
    chunk is written), and past a copy of one this broker writes at the log's end (MessageStore.copying: once
    the copy is flushed, before it is readable or acknowledged)."""
    try:
        with open(os.path.join(store_dir, NUL_FREE_FILE), encoding="ascii") as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        # damaged: the whole log is taken as an older broker's (the checks it gets are the old ones, no loss)
        return None


def write_nul_free_from(store_dir: str, offset: int) -> None:
    _write_atomically(os.path.join(store_dir, NUL_FREE_FILE), f"{offset}\n".encode())


def read_corrupt_kept(store_dir: str) -> frozenset[int]:
    """Log offsets of damaged records a start with keep_corrupt_records kept in place (one a line): later starts
    keep them again without the flag. Unreadable, it is empty (the start then refuses them again, saying why)."""
    try:
        with open(os.path.join(store_dir, CORRUPT_KEPT_FILE), encoding="ascii") as f:
            return frozenset(int(line) for line in f.read().split())
    except FileNotFoundError:
        return frozenset()
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        log.error("%s is unreadable (%s): the damaged records it named are refused again at this start",
                  os.path.join(store_dir, CORRUPT_KEPT_FILE), exc)
        return frozenset()


def write_corrupt_kept(store_dir: str, offsets) -> None:
    _write_atomically(os.path.join(store_dir, CORRUPT_KEPT_FILE), "".join(f"{o}\n" for o in sorted(offsets)).encode())


def read_nul_copy_from(store_dir: str) -> int | None:
    """Where the writer began a copy of an older broker's record with a NUL (MessageStore.copying), or None.
    Written before the copy's bytes, everything below it flushed; it counts only while it is not below
    nul_free_from (the mark, moved past the copy once it is flushed, vouches for it): a crash came between,
    and everything from it on was never acknowledged (nothing is written after such a copy before its mark),
    so recovery cuts the log there. Kept, the copy's NUL past the mark read as damage, the start refused
    when a record of the same write followed it."""
    try:
        with open(os.path.join(store_dir, NUL_COPY_FILE), encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def write_nul_copy_from(store_dir: str, offset: int) -> None:
    _write_atomically(os.path.join(store_dir, NUL_COPY_FILE), f"{offset}\n".encode())


def summarize_file(path: str, start: int) -> tuple[int, int, int, int]:
    """(end offset, records, first_ts, last_ts) of a segment file, hopping over record headers.

    Maps the file itself, read-only: the store may unmap or remove its own mapping meanwhile.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < MIN_RECORD_SIZE:
            return start, 0, -1, -1
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pos, n, first, last = 0, 0, -1, -1
        limit = size - 8
        while pos + MIN_RECORD_SIZE <= limit:
            length, magic = peek_record(mm, pos)
            if magic != MESSAGE_MAGIC or length < MIN_RECORD_SIZE or pos + length > limit:
                break
            ts = store_timestamp_at(mm, pos)
            if first < 0 or ts < first:
                first = ts
            if ts > last:
                last = ts
            n += 1
            pos += length
        return start + pos, n, first, last
    finally:
        mm.close()


def read_manifest(store_dir: str) -> dict:
    """The manifest as written ({} when absent or unreadable: callers then read every segment)."""
    try:
        with open(os.path.join(store_dir, MANIFEST_FILE), "rb") as f:
            data = json.load(f)
        return data if isinstance(data, dict) and isinstance(data.get("segments"), list) else {}
    except (OSError, ValueError):
        return {}


def write_manifest(store_dir: str, store_id: str, now_ms: int, facts: list[SegmentFacts],
                   removed: SegmentFacts | None = None) -> None:
    # One entry a line, each encoded by json's C encoder: asdict() and indent= (which takes the pure-Python
    # encoder) cost 35 us an entry, 137 ms a write for 3,914 segments. The manifest is rewritten after every
    # removal, on the I/O thread but holding the GIL: a retention pass over months of segments stalled the
    # event loop for 300 ms at a time, and cost O(segments^2).
    lines = [f'{{"store_id": {json.dumps(store_id)}, "written_ms": {json.dumps(now_ms)}, "segments": [']
    lines.append(",\n".join(map(_entry, facts)))
    lines.append("]" if removed is None else "], \"removed\": " + _entry(removed))
    lines.append("}\n")
    _write_atomically(os.path.join(store_dir, MANIFEST_FILE), "\n".join(lines).encode())


_ENTRY = ('{{"name": {}, "start": {:d}, "end": {:d}, "records": {:d}, "first_ts": {:d}, "last_ts": {:d}, '
          '"sealed": {}}}')


def _entry(f: SegmentFacts) -> str:
    return _ENTRY.format(json.dumps(f.name), f.start, f.end, f.records, f.first_ts, f.last_ts,
                         "true" if f.sealed else "false")


def _sealed_facts(e) -> SegmentFacts:
    """A manifest entry read back (as sealed); KeyError, TypeError, ValueError or AttributeError if it is none."""
    return SegmentFacts(str(e["name"]), int(e["start"]), int(e["end"]), int(e["records"]),
                        int(e["first_ts"]), int(e["last_ts"]), True)


def removed_from_disk(store_dir: str) -> SegmentFacts | None:
    """The manifest's entry of the newest removed segment (None when it has none)."""
    try:
        return _sealed_facts(read_manifest(store_dir).get("removed"))
    except (KeyError, TypeError, ValueError):
        return None


def sealed_from_disk(store_dir: str) -> dict[str, SegmentFacts]:
    """Sealed entries of the manifest on disk, to carry over across restarts."""
    out = {}
    for e in read_manifest(store_dir).get("segments", []):
        try:
            if e.get("sealed"):
                f = _sealed_facts(e)
                out[f.name] = f
        except (KeyError, TypeError, ValueError, AttributeError):    # not an entry: the bytes say it again
            continue
    return out
