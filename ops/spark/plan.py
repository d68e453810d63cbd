"""The expiry plan: its JSON format, writing it, and validating it (pure Python, no Spark).

`validate-plan` and write_plan() check a plan before it is written or applied, so a plan
that is malformed, from another version, or that would expire anything not strictly older
than its own retention is refused as a whole. The broker trusts none of it: it checks the
store id, its own clock and each segment's identity again (broker/retention.py). Format
(docs/ops-spark.md):

    {"version": 2, "store_id": "<uuid>", "created_ms": int, "retention_ms": int, "now_ms": int,
     "halves":   [{"commit_log_offset": int, "queue_offset": int, "producer_group": str,
                   "topic": str, "store_timestamp": int, "uniq_key": str | null}],
     "segments": [{"name": "<20 digits>", "start_offset": int, "end_offset": int,
                   "first_store_timestamp": int, "last_store_timestamp": int, "records": int}],
     "report":   {"segments": int, "messages_by_topic": [{"topic", "messages"}],
                  "unconsumed": [{"topic", "group", "messages"}]}}

Readers ignore keys they do not know; a change that readers must understand bumps version.
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets

PLAN_VERSION = 2           # 2: store_id and each segment's identity (start, end, newest timestamp)
_SEGMENT_NAME = re.compile(r"\d{20}")
_HALF_KEYS = {"commit_log_offset": int, "queue_offset": int, "producer_group": str, "topic": str,
              "store_timestamp": int, "uniq_key": (str, type(None))}


class PlanError(ValueError):
    """The plan file cannot be applied; the message lists every problem found."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_type(v, kind) -> bool:
    if kind is int:
        return _is_int(v)
    return isinstance(v, kind)


def _half_problems(where: str, h, cutoff: int) -> list[str]:
    """What is wrong with one listed half (not whether another lists it too)."""
    if not isinstance(h, dict):
        return [f"{where} is not an object"]
    bad = [k for k, kind in _HALF_KEYS.items() if k not in h or not _check_type(h[k], kind)]
    if bad:
        return [f"{where}: missing or mistyped {', '.join(bad)}"]
    problems = []
    if h["commit_log_offset"] < 0 or h["queue_offset"] < 0:
        problems.append(f"{where}: offsets must not be negative")
    if not h["store_timestamp"] < cutoff:
        problems.append(f"{where}: store_timestamp {h['store_timestamp']} is not older than the "
                        f"retention (cutoff {cutoff})")
    return problems


MAX_PROBLEMS = 20         # said of a plan refused; the others counted ("and N more")


class _Problems:
    """What is wrong with a plan: the first MAX_PROBLEMS kept, the others counted. A plan of 1M halves all wrong (a
    plan made with another retention) was refused in one stderr line of ~100 MB, each problem kept until then."""

    def __init__(self):
        self.first: list[str] = []
        self.more = 0

    def add(self, problems) -> None:
        for p in problems:
            if len(self.first) < MAX_PROBLEMS:
                self.first.append(p)
            else:
                self.more += 1

    def __bool__(self) -> bool:
        return bool(self.first)

    def error(self) -> PlanError:
        more = f"; and {self.more} more problem{'' if self.more == 1 else 's'}" if self.more else ""
        return PlanError("; ".join(self.first) + more)


def validate_plan(source) -> dict:
    """Check a plan (a path, JSON text/bytes, or an already parsed dict); return it as a dict.

    Raises PlanError naming the problems found (the first MAX_PROBLEMS, the others counted). A valid plan expires
    only halves and segments whose store timestamps are strictly older than now_ms - retention_ms. (A file checked
    without holding its halves: validate_plan_file.)
    """
    if isinstance(source, dict):
        plan = source
    else:
        try:
            if isinstance(source, bytes) or (isinstance(source, str) and source.lstrip().startswith("{")):
                plan = json.loads(source)
            else:
                with open(source, "rb") as f:
                    plan = json.load(f)
        except (OSError, ValueError) as exc:
            raise PlanError(f"cannot read the expiry plan: {exc}") from None
        except RecursionError:      # (as validate_plan_file's reader says it)
            raise PlanError("cannot read the expiry plan: a value nested too deep to read") from None
    cutoff = _head_cutoff(plan)
    problems = _Problems()
    halves = plan.get("halves")
    if not isinstance(halves, list):
        problems.add(["halves must be a list"])
        halves = []
    for i, h in enumerate(halves):
        problems.add(_half_problems(f"halves[{i}]", h, cutoff))
    problems.add(_listed_twice(halves))
    problems.add(_segment_problems(plan.get("segments"), cutoff))
    if problems:
        raise problems.error()
    return plan


def validate_plan_file(path: str) -> dict:
    """validate_plan() of the plan file at ``path`` without holding its halves (`ops.spark validate-plan`): the
    plan's top-level object with "halves" replaced by how many it lists. json.load of a plan of 1M halves (a 170 MB
    file) took 880 MB. Its halves are read one at a time; a plan whose halves come in increasing commit log offset
    (as the expiry job writes them) needs no set of them to find one listed twice, any other is read again with one.
    Raises PlanError as validate_plan() does (a file written over in place while it is read again: PlanError)."""
    from protocol.plan_stream import PlanFile     # (pure Python: shared with the broker's admin)

    problems, state = _Problems(), {}

    def on_halves():        # (a plan with "halves" twice: the last is the plan's, as json.load's)
        nonlocal problems
        problems = _Problems()
        try:        # (the plan's fields before its halves, as the expiry job writes them)
            cutoff = _head_cutoff(plan.head)
        except PlanError:
            cutoff = None   # (not yet read, or wrong: said once the whole head is read, the halves checked after)
        state.update(i=0, last=None, sorted=True, cutoff=cutoff)
        return each if cutoff is not None else None

    def each(h):
        i, state["i"] = state["i"], state["i"] + 1
        problems.add(_half_problems(f"halves[{i}]", h, state["cutoff"]))
        if isinstance(h, dict) and _is_int(h.get("commit_log_offset")):
            if state["last"] is not None and h["commit_log_offset"] <= state["last"]:
                state["sorted"] = False
            state["last"] = h["commit_log_offset"]

    try:
        plan = PlanFile(path)
    except OSError as exc:
        raise PlanError(f"cannot read the expiry plan: {exc}") from None
    try:
        head = plan.scan(on_halves)
        cutoff = _head_cutoff(head)
        if not plan.listed:
            problems = _Problems()          # (of a "halves" list a later "halves" replaced)
            problems.add(["halves must be a list"])
        elif state["cutoff"] != cutoff:
            # (its fields after its halves, or given again after them, of a key given twice the last counting: a
            # plan written by hand. Checked by the fields before them, a plan whose now_ms was given again after
            # its halves passed with every half young by its own cutoff.)
            problems = _Problems()
            state.update(i=0, last=None, sorted=True, cutoff=cutoff)
            for h in plan.halves():
                each(h)
        if plan.listed and not state["sorted"]:
            problems.add(_listed_twice(plan.halves()))
        problems.add(_segment_problems(head.get("segments"), cutoff))
    except ValueError as exc:               # (not JSON, cut short, not UTF-8, written over: PlanChanged)
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"cannot read the expiry plan: {exc}") from None
    finally:
        plan.close()
    if problems:
        raise problems.error()
    return {**head, "halves": plan.count if plan.listed else head.get("halves")}


def _listed_twice(halves):
    """The halves (an iterable) whose commit_log_offset one before them has."""
    seen = set()
    for i, h in enumerate(halves):
        if isinstance(h, dict) and _is_int(h.get("commit_log_offset")):
            if h["commit_log_offset"] in seen:
                yield f"halves[{i}]: commit_log_offset {h['commit_log_offset']} is listed twice"
            seen.add(h["commit_log_offset"])


def _head_cutoff(plan) -> int:
    """now_ms - retention_ms of a plan whose fields but its lists are right; PlanError naming what is not."""
    if not isinstance(plan, dict):
        raise PlanError("the expiry plan is not a JSON object")
    if plan.get("version") != PLAN_VERSION:
        raise PlanError(f"expiry plan version {plan.get('version')!r} is not {PLAN_VERSION}")
    problems: list[str] = []
    if not isinstance(plan.get("store_id"), str) or not plan["store_id"]:
        problems.append("store_id must name the store the plan was made from")
    for key in ("created_ms", "retention_ms", "now_ms"):
        if not _is_int(plan.get(key)) or plan[key] < 0:
            problems.append(f"{key} must be a non-negative integer, not {plan.get(key)!r}")
    if _is_int(plan.get("retention_ms")) and plan["retention_ms"] <= 0:
        problems.append("retention_ms must be positive")
    if problems:
        raise PlanError("; ".join(problems))
    return plan["now_ms"] - plan["retention_ms"]


def _segment_problems(segments, cutoff: int) -> list[str]:
    if not isinstance(segments, list):
        return ["segments must be a list"]
    problems, names = [], []
    for i, s in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(s, dict):
            problems.append(f"{where} is not an object")
            continue
        name = s.get("name")
        if not isinstance(name, str) or not _SEGMENT_NAME.fullmatch(name):
            problems.append(f"{where}: name {name!r} is not a 20-digit segment name")
            continue
        first, last = s.get("first_store_timestamp"), s.get("last_store_timestamp")
        start, end = s.get("start_offset"), s.get("end_offset")
        if not all(_is_int(v) for v in (first, last, start, end)):
            problems.append(f"{where}: start_offset, end_offset, first/last_store_timestamp must be integers")
            continue
        if start != int(name) or end < start:
            problems.append(f"{where}: offsets {start}..{end} do not fit segment {name}")
        if first > last or not last < cutoff:
            problems.append(f"{where}: store timestamps {first}..{last} are not all older than the "
                            f"retention (cutoff {cutoff})")
        names.append(name)
    if len(set(names)) != len(names):
        problems.append("a segment is listed twice")
    if names != sorted(names):
        problems.append("segments are not listed oldest first")
    return problems


def plan_target(path: str) -> str:
    """The file a plan written to ``path`` replaces: a symlink's target (replacing the link would leave the file
    it points to, where the broker's side may read it, with an old plan for good)."""
    return os.path.realpath(path)


def _create_beside(directory: str) -> tuple[int, str]:
    """A new temporary file in ``directory``, mode 0644 less the umask, as a plain open() would make it.
    mkstemp's 0600 went with the rename: `admin apply-expiry`, run as the broker's user, could not read
    the plan. A plan holds offsets and names, nothing secret."""
    for _ in range(100):
        tmp = os.path.join(directory, f".plan-{secrets.token_hex(6)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name for the plan", directory)


def write_plan(plan: dict, path: str) -> None:
    """Write atomically (temp file beside the file it replaces, synced, renamed, directory synced) so the
    broker never reads half a plan. Raises OSError naming the path when the rename cannot be atomic."""
    validate_plan(plan)

    def dump(f):
        json.dump(plan, f, indent=1, sort_keys=False)
        f.write("\n")
    _replace_atomically(path, dump)


def write_plan_streaming(plan: dict, halves, path: str) -> int:
    """write_plan() of ``plan`` with its "halves" taken from the iterable ``halves``, one at a time and never all
    held: the expiry job's driver reads them a partition at a time (1M halves collected took 850 MB of it, 10M
    more than a driver has). Each half is checked as validate_plan() checks it; they must come in increasing
    commit_log_offset (so none is listed twice without a set of them all). A half that fails leaves no file
    written (PlanError). The file reads as write_plan()'s would, one half a line. Returns how many were written.
    """
    head = {k: v for k, v in plan.items() if k != "halves"}
    validate_plan({**head, "halves": []})
    cutoff = plan["now_ms"] - plan["retention_ms"]
    keys = list(head)
    keys.insert(keys.index("segments") if "segments" in keys else len(keys), "halves")   # the format's order
    count = 0

    def write_halves(f):
        nonlocal count
        last = None
        for h in halves:
            where = f"halves[{count}]"
            problems = _half_problems(where, h, cutoff)
            if not problems and last is not None and h["commit_log_offset"] <= last:
                problems.append(f"{where}: commit_log_offset {h['commit_log_offset']} is not past the one before "
                                f"it ({last}): halves must come in increasing commit log offset")
            if problems:
                raise PlanError("; ".join(problems))
            last = h["commit_log_offset"]
            f.write(("\n  " if count == 0 else ",\n  ") + json.dumps(h))
            count += 1
        f.write("\n ]")

    def dump(f):
        for i, key in enumerate(keys):
            f.write(("{\n " if i == 0 else ",\n ") + json.dumps(key) + ": ")
            if key == "halves":
                f.write("[")
                write_halves(f)
            else:
                f.write(json.dumps(head[key], indent=1))
        f.write("\n}\n")
    _replace_atomically(path, dump)
    return count


def _replace_atomically(path: str, dump) -> None:
    """``dump(f)`` writes the file that replaces ``path`` (temp file beside it, synced, renamed, directory
    synced); nothing is replaced when it raises."""
    target = plan_target(path)
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = _create_beside(directory)
    try:
        with os.fdopen(fd, "w") as f:
            dump(f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.replace(tmp, target)
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.EXDEV):
                raise
            # A file bind-mounted on its own (docker -v plan.json:...) cannot be replaced by a rename, and a
            # copy over it could be read half written: the directory must be the mount.
            raise OSError(exc.errno, f"cannot replace the plan {target} in one rename ({exc.strerror}): it is a "
                          "mount point of its own; mount the directory it is in instead") from None
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
