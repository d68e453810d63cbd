"""The scheduler's progress: records in the log, and delayOffset.json.

Truth is in the commit log. Every delivery batch ends with one progress record in
rmq_sys_schedule_progress queue 0, written in the SAME all-or-none ``put_many`` as the
messages it delivers, so a crash (kill -9 included) keeps both or neither: a delivery is
never lost nor repeated. The record comes last in the batch, so a torn tail that cut a
batch could only ever repeat a delivery, never lose one.

Progress record body (JSON)::

    {"levels": {"<level>": <next queue offset of SCHEDULE_TOPIC_XXXX queue level-1>, ...},
     "timers": [<rmq_sys_wheel_timer queue offsets delivered by this batch>, ...]}

delayOffset.json (<store>/config), RocketMQ's file with txmq's additions, is a shortcut
for start-up, written every 10 s and at stop (only for progress that is on disk)::

    {"offsetTable": {"<level>": <offset>}, "timerFloor": <every timer below it delivered>,
     "timerDone": [<delivered timer offsets above the floor: a lone offset, [first, last] for a run, or
                    "<chunk's first offset>:<base64 bitmap>" for a chunk of many runs (runs.py)>],
     "progressOffset": <progress records below this queue offset are reflected here>,
     "crc": <CRC-32 of the bytes before it (store/saved.py): a file changed since is replayed from the log>}

Start-up loads it and replays the progress records after ``progressOffset``.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from protocol.admin_bodies import quote_int_keys, split_at_string_literals

from ..store.mapped_file import fsync_dirs, make_dirs
from ..store.saved import check, crc_matches, is_int, save, with_crc
from ..topics import SCHEDULE_PROGRESS_TOPIC
from .runs import OffsetRuns, PastTheLog

log = logging.getLogger("txmq.schedule")

PROGRESS_TOPIC = SCHEDULE_PROGRESS_TOPIC
SNAPSHOT_NAME = "delayOffset.json"
# A slave's copy of its Java master's delay progress (GET_ALL_DELAY_OFFSET, as a Java slave copies it into its own
# delayOffset.json): a Java master writes no progress record in its log, so the copied log alone says nothing was
# delivered. Same shape as delayOffset.json's offsetTable, with a crc; read at every start (recover).
MASTER_COPY_NAME = "slaveMasterDelayOffset.json"


@dataclass
class Progress:
    """How far delivery has gone: per level, and for the timer messages."""

    levels: dict[int, int] = field(default_factory=dict)    # level -> next queue offset to deliver
    timer_floor: int = 0                                     # timer queue offsets below: all delivered
    timer_done: OffsetRuns = field(default_factory=OffsetRuns)  # delivered offsets >= timer_floor, as runs
    progress_offset: int = 0                                 # progress records below this are applied
    # loaded in place of a file naming timers past the log's end (load_snapshot): recovery writes it over at once,
    # or once the log grew past them a start took that file as good
    past_the_log: bool = field(default=False, compare=False, repr=False)

    def apply(self, levels: dict[int, int], timers, floor_steps: int | None = None) -> bool:
        """Take a progress record's levels and timers; True when the floor has further to move (``floor_steps``)."""
        for level, offset in levels.items():
            if offset > self.levels.get(level, 0):
                self.levels[level] = offset
        floor = self.timer_floor
        self.timer_done.update(t for t in timers if t >= floor)
        return self.raise_floor(floor_steps)

    def raise_floor(self, most: int | None = None) -> bool:
        """Move the floor over the delivered offsets just above it, at most ``most`` of them (None: all); True
        when more remain. Bounded for the event loop as it was when a move cost 210 ms a million (SCAN_PER_TURN
        a turn, the next turn at once); a whole chunk of them is one step now. Offsets left in ``timer_done``
        above the floor read as delivered all the same (``timer_delivered``)."""
        done, floor = self.timer_done, self.timer_floor
        end = done.run_end(floor, None if most is None else floor + most)
        if end == floor:
            return False
        done.discard_below(end)
        self.timer_floor = end
        return end in done

    def timer_delivered(self, offset: int) -> bool:
        return offset < self.timer_floor or offset in self.timer_done

    def to_json(self) -> dict:
        return {"offsetTable": {str(k): v for k, v in sorted(self.levels.items())},
                "timerFloor": self.timer_floor, "timerDone": self.timer_done.to_json(),
                "progressOffset": self.progress_offset}

    @classmethod
    def from_json(cls, data: dict, timer_end: int | None = None) -> "Progress":
        """``timer_end``: the timer queue's end; a floor or a delivered timer past it is refused (ValueError)."""
        floor = int(data.get("timerFloor", 0))
        if timer_end is not None and floor > timer_end:
            raise PastTheLog(f"timerFloor {floor} is past the timer queue's end {timer_end} (no timer there is "
                             "written yet: the file was edited, or is not this log's)")
        p = cls({int(k): int(v) for k, v in (data.get("offsetTable") or {}).items()},
                floor, OffsetRuns.from_json(data.get("timerDone"), timer_end),
                int(data.get("progressOffset", 0)))
        p.timer_done.discard_below(p.timer_floor)
        return p


def encode_progress(levels: dict[int, int], timers: list[int]) -> bytes:
    return json.dumps({"levels": {str(k): v for k, v in levels.items()}, "timers": timers},
                      separators=(",", ":")).encode()


def decode_progress(body: bytes) -> tuple[dict[int, int], list[int]] | None:
    """(levels, timers) of a progress record; None (logged) for a body that is not one."""
    try:
        data = json.loads(body)
        return {int(k): int(v) for k, v in data.get("levels", {}).items()}, [int(t) for t in data.get("timers", [])]
    except (ValueError, TypeError, AttributeError) as exc:
        log.error("ignoring a malformed schedule progress record: %s", exc)
        return None


def load_snapshot(config_dir: str, timer_end: int | None = None) -> Progress:
    """The progress delayOffset.json holds, or none (the progress records replayed) when it cannot be read, its crc
    does not match, or it names timer offsets at or past ``timer_end`` (the timer queue's end: Progress.from_json)."""
    path = os.path.join(config_dir, SNAPSHOT_NAME)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        data = json.loads(raw)
        # A flipped digit leaves valid JSON: a level's offset set higher would skip its waiting messages for good.
        if isinstance(data, dict) and "crc" in data and not crc_matches(raw, data["crc"]):
            raise ValueError("its checksum does not match: it was changed after it was written")
        return Progress.from_json(data, timer_end)
    except FileNotFoundError:
        return Progress()
    except PastTheLog as exc:
        log.error("ignoring unreadable %s (%s): progress is replayed from the log, the file written over", path, exc)
        return Progress(past_the_log=True)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.error("ignoring unreadable %s (%s): progress is replayed from the log", path, exc)
        return Progress()


def decode_delay_offsets(body: bytes) -> dict[int, int]:
    """{level: offset} of a GET_ALL_DELAY_OFFSET body or a delayOffset.json, Java's (fastjson's bare level keys) or
    ours; ValueError for anything else (a level or an offset that is no whole number, a negative one)."""
    pieces = split_at_string_literals(body.decode("utf-8"))
    pieces[::2] = map(quote_int_keys, pieces[::2])
    table = json.loads("".join(pieces))
    check(isinstance(table, dict) and isinstance(table.get("offsetTable"), dict), "no offsetTable object")
    levels = {}
    for level, offset in table["offsetTable"].items():
        check(level.isdigit() and is_int(offset) and offset >= 0, f"level {level!r}: offset {offset!r}")
        levels[int(level)] = offset
    return levels


def read_master_copy(config_dir: str) -> dict[int, int]:
    """The delay levels' progress a slave last copied from a Java master (MASTER_COPY_NAME), {} when none; a
    file that cannot be read is said at ERROR (its levels are then the log's alone)."""
    path = os.path.join(config_dir, MASTER_COPY_NAME)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        data = json.loads(raw)
        check(isinstance(data, dict) and "crc" in data and crc_matches(raw, data["crc"]),
              "its checksum does not match: it was changed after it was written")
        return decode_delay_offsets(raw)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError) as exc:
        log.error("ignoring unreadable %s (%s): the delay progress its Java master had is not known here, and "
                  "messages it delivered may be delivered again", path, exc)
        return {}


def write_master_copy(config_dir: str, levels: dict[int, int]) -> None:
    """Blocking: off the loop."""
    fsync_dirs(make_dirs(config_dir))
    save(os.path.join(config_dir, MASTER_COPY_NAME), with_crc(json.dumps(
        {"offsetTable": {str(k): v for k, v in sorted(levels.items())}}, separators=(",", ":")).encode()))


def drop_master_copy(config_dir: str) -> bool:
    """Blocking: off the loop. Remove MASTER_COPY_NAME (and its .bak); whether there was one."""
    removed = False
    for name in (MASTER_COPY_NAME, MASTER_COPY_NAME + ".bak"):
        try:
            os.remove(os.path.join(config_dir, name))
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        fsync_dirs([config_dir])
    return removed


def write_snapshot(config_dir: str, data: "dict | Progress") -> None:
    """Write delayOffset.json with the catalogues' save (temp file synced, the previous one kept as
    delayOffset.json.bak as RocketMQ keeps it, rename, directory synced). Runs off the event loop; a ``Progress``
    (a copy the loop no longer changes) is made into its JSON here too."""
    if isinstance(data, Progress):
        data = data.to_json()
    save(os.path.join(config_dir, SNAPSHOT_NAME), with_crc(json.dumps(data, separators=(",", ":")).encode()))
