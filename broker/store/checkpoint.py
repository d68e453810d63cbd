"""The checkpoint: how far the commit log is known to be durable, so recovery re-scans only the rest.

``<store_dir>/checkpoint``, 32 bytes, big-endian:

    offset  size  field
    0       4     MAGIC        b"TXCP"
    4       4     VERSION      1
    8       8     FLUSHED      commit-log offset: every byte below is flushed, and so are the
                               consume-queue units of every record below it
    16      8     STORE TIME   store timestamp of the last record below FLUSHED (0 if none)
    24      4     CRC          zlib.crc32 of bytes 0..23
    28      4     RESERVED     0

Written to ``checkpoint.tmp``, fsync'ed, renamed over ``checkpoint``, then the directory is
fsync'ed: a crash leaves either the old or the new checkpoint, never a mix. The CRC still
guards against a file damaged some other way; a bad or missing checkpoint only makes
recovery scan from the first segment, it never loses data.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from typing import NamedTuple

from .mapped_file import fsync_dir
from .saved import write_synced

log = logging.getLogger("txmq.store")

MAGIC = b"TXCP"
VERSION = 1
_LAYOUT = struct.Struct(">4siqqII")
_BODY = struct.Struct(">4siqq")
FILE_NAME = "checkpoint"


class Checkpoint(NamedTuple):
    flushed_offset: int
    store_timestamp: int


def read_checkpoint(store_dir: str, name: str = FILE_NAME) -> Checkpoint | None:
    path = os.path.join(store_dir, name)
    try:
        with open(path, "rb") as f:
            raw = f.read(_LAYOUT.size + 1)
    except FileNotFoundError:
        return None
    if len(raw) != _LAYOUT.size:
        log.warning("checkpoint %s has %d bytes, not %d; recovery scans the whole log", path, len(raw), _LAYOUT.size)
        return None
    magic, version, flushed, ts, crc, _ = _LAYOUT.unpack(raw)
    if magic != MAGIC or version != VERSION or crc != zlib.crc32(raw[:_BODY.size]) or flushed < 0:
        log.warning("checkpoint %s is damaged; recovery scans the whole log", path)
        return None
    return Checkpoint(flushed, ts)


def write_checkpoint(store_dir: str, point: Checkpoint, name: str = FILE_NAME) -> None:
    """Blocking (fsyncs): call it from the flush thread."""
    body = _BODY.pack(MAGIC, VERSION, point.flushed_offset, point.store_timestamp)
    raw = body + struct.pack(">II", zlib.crc32(body), 0)
    _replace(store_dir, name, raw)


QUEUES_FILE = "queues"      # every consume queue, as of the checkpoint (one "topic queue-id" a line)
_QUEUES_HEAD = "txmq queues 1"


def read_queue_list(store_dir: str) -> tuple[set[tuple[str, int]], dict[str, int]] | None:
    """The queues the last checkpoint vouched for, and the deleted topics' marks known when it was written ("topic -
    below" lines); None when there is no list (a store older than it) or it is damaged (said at WARNING: only a
    removed queue directory goes unnoticed then, as before)."""
    path = os.path.join(store_dir, QUEUES_FILE)
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()
        if not lines or lines[0] != _QUEUES_HEAD:
            raise ValueError("no header")
        queues: set[tuple[str, int]] = set()
        marks: dict[str, int] = {}
        for line in lines[1:]:
            parts = line.split(" ")
            if len(parts) == 3 and parts[1] == "-":
                marks[parts[0]] = int(parts[2])
            else:
                topic, qid = parts
                queues.add((topic, int(qid)))
        return queues, marks
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise       # as for the checkpoint: the start stops with the path named (every checkpoint would fail)
    except (OSError, ValueError) as exc:
        log.warning("queue list %s is unreadable (%s): a queue directory removed since the last checkpoint is not "
                    "noticed at this start", path, exc)
        return None


def write_queue_list(store_dir: str, queues, marks: dict[str, int] | None = None) -> None:
    """Blocking (fsyncs), before the checkpoint that vouches for their units: a queue directory found missing at
    the next start while this names it is rebuilt from the whole log, not taken for a queue with no message.
    ``marks``: the deleted topics' marks, so that a start tells a topic made again after its delete (listed with
    the mark: its queue is missing) from a delete the list does not know of yet (its queues went with it)."""
    text = "\n".join([_QUEUES_HEAD] + [f"{topic} {qid}" for topic, qid in sorted(queues)]
                     + [f"{topic} - {below}" for topic, below in sorted((marks or {}).items())]) + "\n"
    _replace(store_dir, QUEUES_FILE, text.encode("ascii"))


def _replace(store_dir: str, name: str, data: bytes) -> None:
    """``name`` in ``store_dir`` replaced by ``data``, synced, then renamed over it (saved.write_synced: a copy a
    full disk cut short is removed, not left holding the pages that were free; a short os.write is not taken for
    a whole one)."""
    path = os.path.join(store_dir, name)
    os.replace(write_synced(path + ".tmp", data), path)
    fsync_dir(store_dir)
