"""What the broker writes about its store, read by the jobs: its id and the segment manifest.

``<store>/store_id`` and ``<store>/segments.json`` are written by broker/store/manifest.py
(the layout is documented there); this module only reads them, with the protocol package
as its only dependency, like the rest of ops/spark.

``segments_for_window`` is what makes ``rollup --date D`` incremental: a segment can hold a
record stored in [lo, hi) unless the manifest proves otherwise, so a segment absent from the
manifest (just rolled, or a store from before manifests) or still active (its newest record
keeps moving) is always read when it might overlap.
"""
from __future__ import annotations

import json
import logging
import os
import uuid

log = logging.getLogger("ops.spark")


def read_store_id(store_dir: str) -> str | None:
    try:
        with open(os.path.join(store_dir, "store_id"), encoding="ascii") as f:
            return str(uuid.UUID(f.read().strip()))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def read_manifest(store_dir: str) -> dict[str, dict]:
    """{segment name: entry} from segments.json; {} when absent or unreadable."""
    path = os.path.join(store_dir, "segments.json")
    try:
        with open(path, "rb") as f:
            data = json.load(f)
        entries = data["segments"]
        return {str(e["name"]): e for e in entries if isinstance(e, dict) and "name" in e}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("cannot use %s (%s): every segment will be read", path, exc)
        return {}


def removed_before(store_dir: str, first) -> dict | None:
    """The manifest's entry of the removed segment that ended where segment ``first`` (the oldest
    left, an ops.spark.segments.Segment) begins: {"last_ts": newest store time it held, ...}; None
    when the manifest does not say (a broker from before "removed", or not the segment just before)."""
    path = os.path.join(store_dir, "segments.json")
    try:
        with open(path, "rb") as f:
            e = json.load(f).get("removed")
        start, end, last = int(e["start"]), int(e["end"]), int(e["last_ts"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if last < 0 or not start < first.base or end > first.base or first.base - start > max(first.size, 1):
        return None
    return {"name": e.get("name"), "start": start, "end": end, "last_ts": last}


def can_hold(entry: dict | None, lo: int, hi: int) -> bool:
    """Whether a segment with this manifest entry may hold a record stored in [lo, hi)."""
    if entry is None:
        return True
    try:
        first, last, sealed = int(entry["first_ts"]), int(entry["last_ts"]), bool(entry["sealed"])
    except (KeyError, TypeError, ValueError):
        return True
    if first < 0:
        return not sealed          # an empty sealed segment holds nothing; an empty active one may soon
    if first >= hi:
        return False
    return not sealed or last >= lo


def segments_for_window(segments: list, store_dir: str, lo: int, hi: int) -> list:
    """The segments (ops.spark.segments.Segment) that can hold a record stored in [lo, hi)."""
    manifest = read_manifest(store_dir)
    if not manifest:
        log.info("no segment manifest in %s: reading every segment", store_dir)
        return list(segments)
    return [s for s in segments if can_hold(manifest.get(s.name), lo, hi)]
