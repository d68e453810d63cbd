"""``python -m broker admin``: operate a running broker.

    python -m broker admin list [--group G] [--limit N] [--after Q] [--json]
    python -m broker admin commit OFFSET | rollback OFFSET | resume OFFSET
    python -m broker admin apply-expiry PLAN.json [--slice N]
    python -m broker admin query-key TOPIC KEY | show-msg ID | consumer-progress GROUP
    python -m broker admin reset-offset GROUP TOPIC (--timestamp T | --queue Q --offset N)
    python -m broker admin topic-status TOPIC | broker-status

The last six find messages and operate consumers (broker/admin_ops.py; ``--json`` on each).

OFFSET is the half message's commit-log offset (the ``commit_log_offset``
column of ``list``). ``list`` answers a page, oldest stored first; when more
follow, its last line names the ``--after Q`` of the next page (Q: the half-queue
offset of the page's last row). Every action is logged by the broker with the caller's
address. The broker address comes from --broker or BROKER_ADMIN_ADDR
(default 127.0.0.1:10911; an IPv6 host as [::1]:10911). A broker with an ACL file needs an admin account's
credentials: --access-key/--secret-key or BROKER_ADMIN_ACCESS_KEY/BROKER_ADMIN_SECRET_KEY.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import math
import os
import sys
import time

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import BrokerError, RequestTimeoutError
from protocol.logline import escape
from protocol.plan_stream import PlanChanged, PlanFile
from protocol.signature import Credentials

from . import admin_ops
from .processors.transaction import LISTED_MAX
from .retention import PlanRefused, check_plan_lists


async def _connect(addr: str, credentials):
    """A connection to the broker at ``addr``: host:port, an IPv6 host bare (::1:10911) or in brackets ([::1]:10911,
    which was looked up as a host name "[::1]" and never reached)."""
    host, _, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return await open_connection(host, int(port), sign=credentials.sign if credentials else None)


async def _call(addr: str, cmd: RemotingCommand, timeout: float, credentials=None) -> RemotingCommand:
    conn = await _connect(addr, credentials)
    try:
        return await conn.request(cmd, timeout)
    finally:
        conn.close()


async def _run_ops(addr: str, args, timeout: float, credentials=None) -> int:
    """One connection for the several requests an operations command may make."""
    conn = await _connect(addr, credentials)
    try:
        return await admin_ops.run(args, lambda cmd: conn.request(cmd, timeout))
    finally:
        conn.close()


PLAN_SLICE = 1000       # listed halves a request: ~1 ms each to dead-letter, a flush each (more on a slow disk)
PART_BYTES = 4 * 1024 * 1024     # and at most this much JSON a request: well within the 16 MiB frame a broker reads
HALF_S = 0.025          # a part's answer is waited for --timeout and this a listed half: generous now that the broker
                        # dead-letters them 32 (or 4 MiB) to a flush; kept for a disk slower than any flush we saw
PROGRESS_S = 10.0       # a plan applied in many requests says how far it got at most this often


def plan_parts(plan, halves_a_request: int = PLAN_SLICE) -> list:
    """The requests an expiry plan is applied in: itself when it lists at most ``halves_a_request`` halves (or is
    not a plan the broker would take: it says why), else its header with a slice of its halves each, in order,
    and its segments alone last (the broker applies a plan's halves before its segments, as here).

    Sent whole, a plan of 90,000 halves was a frame over the 16 MiB a broker reads (not sent: expired never), and
    one of 15,000 outlasted the 10 s --timeout while the broker dead-lettered them one by one (exit 1, "no
    response", the broker applying it all the same, its summary lost). Each part is judged on its own: a listed
    half is dead-lettered once whatever part it is in, and the segments are judged after every half."""
    if isinstance(plan, PlanFile):
        return _FileParts(plan, halves_a_request)
    halves = plan.get("halves") if isinstance(plan, dict) else None
    if not isinstance(halves, list) or (len(halves) <= halves_a_request
                                        and len(json.dumps(plan).encode()) <= PART_BYTES):
        return [plan]
    header, room = _part_header(plan)
    parts = [{**header, "halves": s, "segments": []} for s in _slices(halves, halves_a_request, room)]
    return parts + [{**header, "halves": [], "segments": plan.get("segments") or []}]


def _part_header(plan: dict) -> tuple[dict, int]:
    """What each part carries of the plan but its lists, and the bytes left in a part for its halves."""
    header = {k: v for k, v in plan.items() if k not in ("halves", "segments", "report")}
    # Bounded in bytes too: a half carries its producer's uniq_key, group and topic (up to 32,767 bytes of
    # properties, six JSON bytes a character not in ASCII), so 1,000 of them were up to 196 MB, never sent.
    # (and room for the "part" and "parts" each part is sent with)
    return header, PART_BYTES - len(json.dumps({**header, "halves": [], "segments": [], "part": 10**12,
                                                "parts": 10**12}).encode())


class _FileParts:
    """plan_parts of a plan read from its file (PlanFile): its halves cut into parts as _read_plan scanned them (or,
    scanned for another slice or head, on a read to count them), then read again and handed out a part at a time
    as they are sent, never all in memory. (Cut on a read of their own, 1M halves took 37 s in three reads.)"""

    def __init__(self, plan: PlanFile, halves_a_request: int):
        self.plan = plan
        self.header, self.room = _part_header(plan.head)
        cut = getattr(plan, "cut", None)
        if cut is not None and cut[:2] == (halves_a_request, self.room):
            self.lengths = cut[2]
        else:
            self.lengths = [len(s) for s in _slices(plan.halves(), halves_a_request, self.room)]
        self.n = len(self.lengths) + 1

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        halves = self.plan.halves()
        for n in self.lengths:
            yield {**self.header, "halves": list(itertools.islice(halves, n)), "segments": []}
        for _ in halves:        # (none: read to its end, where a plan written over meanwhile is PlanChanged)
            pass
        yield {**self.header, "halves": [], "segments": self.plan.head.get("segments") or []}


def _slices(halves, count: int, room: int):
    """``halves`` (an iterable) in order, ``count`` a slice, each slice's JSON within ``room`` bytes (a half over it
    alone)."""
    it = iter(halves)
    while chunk := list(itertools.islice(it, count)):
        start = 0
        for n in _cut(chunk, room):
            yield chunk[start:start + n]
            start += n


def _cut(chunk: list, room: int) -> list[int]:
    """The lengths of the slices ``chunk`` is sent in, each one's JSON within ``room`` bytes. It is measured whole
    (one encoding, ~0.5 s per 100,000 halves) and half by half only when over."""
    if len(json.dumps(chunk).encode()) <= room:
        return [len(chunk)]
    lengths, start, size = [], 0, 2
    for j, half in enumerate(chunk):
        n = len(json.dumps(half).encode()) + 2          # (", " before it)
        if j > start and size + n > room:
            lengths.append(j - start)
            start, size = j, 2
        size += n
    return lengths + [len(chunk) - start]


async def _apply_plan(addr: str, plan, timeout: float, credentials, halves_a_request: int) -> tuple[dict, str | None]:
    """Apply ``plan`` part by part on one connection; (the replies merged, why it stopped or None)."""
    parts = plan_parts(plan, halves_a_request)
    merged: dict = {"expired": [], "skipped": []}
    conn = await _connect(addr, credentials)
    said = time.monotonic()
    try:
        for n, part in enumerate(_read_on(parts), 1):
            if isinstance(part, PlanChanged):
                done = (f"parts 1 to {n - 1} of {len(parts)} were applied (their halves' summary above), the others "
                        "not sent" if n > 1 else "no part was sent")
                return merged, (f"plan changed while it was sent, stopped: {part}; {done}; applying the plan again is "
                                "safe, what was done is skipped")
            if len(parts) > 1:      # (the broker says the plan at its first part and its last, not at each)
                part = {**part, "part": n, "parts": len(parts)}
            cmd = RemotingCommand.request(RequestCode.TXMQ_APPLY_EXPIRY, body=json.dumps(part).encode())
            try:
                resp = await conn.request(cmd, timeout + HALF_S * _listed(part))
            except (BrokerError, OSError) as exc:
                why = f"broker {addr}: {exc}"
                if n == 1 and isinstance(exc, RequestTimeoutError):     # (a later part's _stopped says it)
                    why += ("\nthe plan was sent and may have been applied: applying it again is safe, what was done "
                            "is skipped (a longer --timeout waits for its answer)")
                return merged, _stopped(n, parts, why)
            if resp.code != ResponseCode.SUCCESS:
                return merged, _stopped(n, parts, admin_ops.refused(resp))
            reply = json.loads(resp.body_bytes())
            for key in ("expired", "skipped"):
                merged[key].extend(reply.pop(key))
            if len(parts) > 1 and n < len(parts):   # (a halves part: its empty segment lists are not the plan's)
                for key in ("segments_removed", "segments_kept", "segments_gone"):
                    reply.pop(key, None)
            merged.update(reply)
            if len(parts) > 1 and (n == len(parts) or time.monotonic() - said >= PROGRESS_S):
                said = time.monotonic()
                print(f"applied {n} of {len(parts)} parts: {len(merged['expired'])} halves expired, "
                      f"{len(merged['skipped'])} skipped", file=sys.stderr)
    finally:
        conn.close()
    return merged, None


def _read_on(parts):
    """``parts``, a big plan's PlanChanged (written over in place while its parts are read) the last of them."""
    try:
        yield from parts
    except PlanChanged as exc:
        yield exc


def _undecided(skipped: list) -> int:
    """1, said on stderr, when a listed half was not expired and is still undecided (the broker could not write its
    dead letter: a full disk, an I/O error); 0 when every one skipped was decided meanwhile or is young."""
    left = [s for s in skipped if isinstance(s, dict) and s.get("undecided")]
    if not left:
        return 0
    print(f"{len(left)} listed {'half' if len(left) == 1 else 'halves'} not expired, still undecided: the broker could "
          f"not dead-letter {'it' if len(left) == 1 else 'them'} (the first, at {left[0].get('commit_log_offset')}: "
          f"{left[0].get('why')}); free the store's disk or fix what its log says, then apply the plan again (what "
          "was done is skipped)", file=sys.stderr)
    return 1


def _listed(part) -> int:
    halves = part.get("halves") if isinstance(part, dict) else None
    return len(halves) if isinstance(halves, list) else 0


def _stopped(n: int, parts: list, why: str) -> str:
    if n == 1:
        return why
    return (f"{why}\nstopped at part {n} of {len(parts)}: parts 1 to {n - 1} were applied (their halves' summary "
            "above) and this one may still be; applying the plan again is safe, what was done is skipped")


def _table(rows: list[dict]) -> str:
    if not rows:
        return "no undecided transactions"
    cols = ["commit_log_offset", "group", "topic", "age_ms", "checks", "owner", "last_answer", "uniq_key"]
    cells = [{c: escape(str(r.get(c, ""))) for c in cols} for r in rows]   # (groups and keys: the clients' names)
    widths = {c: max(len(c), *(len(r[c]) for r in cells)) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols)]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in cols) for r in cells]
    return "\n".join(lines)


def _read_plan(path: str, halves_a_request: int = PLAN_SLICE):
    """The plan as a dict when it is small (a part's bytes at most), else a PlanFile scanned (its halves read as
    they are sent), cut into parts of ``halves_a_request`` halves as it is scanned. Raises OSError, ValueError (not
    JSON) or PlanRefused: what the broker would refuse in one part only, the parts before it applied."""
    if os.path.getsize(path) <= PART_BYTES:
        with open(path, "rb") as fh:
            try:
                plan = json.load(fh)
            except RecursionError:      # (as PlanFile's reader says it)
                raise ValueError("a value nested too deep to read") from None
        if isinstance(plan, dict):
            check_plan_lists(plan)
        return plan
    plan = PlanFile(path)
    cut: dict = {}

    def on_halves():        # (the parts cut as the halves are scanned: not read again to count them)
        cut.update(room=_part_header(plan.head)[1], chunk=[], lengths=[])
        return each

    def each(half):
        cut["chunk"].append(half)
        if len(cut["chunk"]) == halves_a_request:
            cut["lengths"] += _cut(cut["chunk"], cut["room"])
            cut["chunk"].clear()

    try:
        plan.scan(on_halves)    # (a file not a JSON object: ValueError, "expected '{'")
        if cut:
            if cut["chunk"]:
                cut["lengths"] += _cut(cut["chunk"], cut["room"])
            # (the room of the members before the halves: the plan's own unless some follow them, then cut again)
            plan.cut = (halves_a_request, cut["room"], cut["lengths"])
        check_plan_lists(plan.head)         # (its halves, when a list, as None: checked by the scan)
        if plan.not_object:
            raise PlanRefused("halves must be a list of objects")
        if not plan.listed:
            return plan.head
    except BaseException:
        plan.close()
        raise
    return plan


def _seconds(text: str) -> float:
    """--timeout: a number of seconds over 0. At 0 or below a request was sent and its answer not waited for: `admin
    commit` committed and said "got no response", exit 1; nan and inf waited for ever."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds") from None
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"{text}: give a number of seconds over 0 (nothing was sent)")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The admin command line: whole flag names only (allow_abbrev=False, its actions' too), as the broker's."""
    parser = argparse.ArgumentParser(prog="python -m broker admin", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", default=os.environ.get("BROKER_ADMIN_ADDR", "127.0.0.1:10911"))
    parser.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for each answer (default "
                        "%(default)s)")
    parser.add_argument("--access-key", default=os.environ.get("BROKER_ADMIN_ACCESS_KEY", ""))
    parser.add_argument("--secret-key", default=os.environ.get("BROKER_ADMIN_SECRET_KEY", ""))
    sub = parser.add_subparsers(dest="action", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    ls = sub.add_parser("list", help="undecided transactions, oldest stored first, a page of at most %d" % LISTED_MAX)
    ls.add_argument("--group")
    ls.add_argument("--limit", type=int, default=1000)
    ls.add_argument("--after", type=int, default=-1, help="the page after half-queue offset Q (the last page's "
                    "last line names it)")
    ls.add_argument("--json", action="store_true")
    for name in ("commit", "rollback", "resume"):
        p = sub.add_parser(name, help=f"{name} the transaction whose half is at OFFSET")
        p.add_argument("offset", type=int)
    ap = sub.add_parser("apply-expiry", help="apply an expiry plan made by `python -m ops.spark expiry`")
    ap.add_argument("plan")
    ap.add_argument("--slice", type=int, default=PLAN_SLICE, metavar="N",
                    help="send the plan's halves N a request (default %(default)s), its segments last")
    admin_ops.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    port = args.broker.rpartition(":")[2]
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        print(f"--broker {args.broker}: give the broker's address as host:port (a port 1-65535)", file=sys.stderr)
        return 2
    credentials = None
    if args.access_key or args.secret_key:
        try:
            credentials = Credentials(args.access_key, args.secret_key)
        except ValueError as exc:
            print(str(exc), file=sys.stderr)
            return 2
    if args.action in admin_ops.COMMANDS:
        try:
            return asyncio.run(_run_ops(args.broker, args, args.timeout, credentials))
        except admin_ops.Refused as exc:
            print(str(exc), file=sys.stderr)
            return 1
        except (BrokerError, OSError) as exc:
            print(f"broker {args.broker}: {exc}", file=sys.stderr)
            return 1

    if args.action == "list":
        cmd = RemotingCommand.request(RequestCode.TXMQ_LIST_TRANSACTIONS, {"group": args.group, "limit": args.limit,
                                                                                 "after": args.after})
    elif args.action in ("commit", "rollback"):
        cmd = RemotingCommand.request(RequestCode.TXMQ_RESOLVE_TRANSACTION,
                                      {"commitLogOffset": args.offset, "decision": args.action})
    elif args.action == "resume":
        cmd = RemotingCommand.request(RequestCode.TXMQ_RESUME_TRANSACTION, {"commitLogOffset": args.offset})
    else:
        if args.slice < 1:
            print(f"--slice {args.slice}: give 1 or more halves a request", file=sys.stderr)
            return 2
        try:
            plan = _read_plan(args.plan, args.slice)
        except (OSError, ValueError) as exc:
            print(f"cannot read plan {args.plan}: {exc}", file=sys.stderr)
            return 2
        except PlanRefused as exc:
            print(f"plan {args.plan} not sent, nothing changed: {exc}", file=sys.stderr)
            return 2
        try:
            summary, stopped = asyncio.run(_apply_plan(args.broker, plan, args.timeout, credentials, args.slice))
        except (BrokerError, OSError) as exc:        # (no connection)
            print(f"broker {args.broker}: {exc}", file=sys.stderr)
            return 1
        except PlanChanged as exc:      # (a big plan read again to count its parts: written over in place meanwhile)
            print(f"plan {args.plan} changed while it was read, not sent, nothing changed: {exc}; apply it again "
                  "once it is written whole", file=sys.stderr)
            return 1
        finally:
            if isinstance(plan, PlanFile):
                plan.close()
        if stopped is None or summary["expired"] or summary["skipped"]:
            print(json.dumps(summary, indent=1))
        if stopped is not None:
            print(stopped, file=sys.stderr)
            return 1
        return _undecided(summary["skipped"])
    try:
        resp = asyncio.run(_call(args.broker, cmd, args.timeout, credentials))
    except (BrokerError, OSError) as exc:
        print(f"broker {args.broker}: {exc}", file=sys.stderr)
        if isinstance(exc, RequestTimeoutError) and args.action != "list":
            # (sent, its answer not waited for: a commit read as failed while the broker had committed it)
            print(f"the {args.action} was sent and may have been done: `admin list` names the half at {args.offset} "
                  "while it is undecided (a longer --timeout waits for the answer)", file=sys.stderr)
        return 1
    if resp.code != ResponseCode.SUCCESS:
        print(admin_ops.refused(resp), file=sys.stderr)
        return 1
    if args.action == "list":
        data = json.loads(resp.body_bytes())
        if args.json:
            print(json.dumps(data, indent=1))
        else:
            print(_table(data["pending"]))
            print(f"{data['total']} undecided, {data['dead_lettered']} dead-lettered")
            if data.get("next_after") is not None:
                more = f"{data['more']} more not listed" if "more" in data else "more follow"
                print(f"{more}: --after {data['next_after']} for the next page")
            elif "next_after" not in data and data.get("more"):     # (a broker that answers no pages)
                print(f"{data['more']} more not listed (the oldest {len(data['pending'])} are: "
                      f"--limit, at most {LISTED_MAX}, or --group to see others)")
    else:
        print(resp.remark or "done")
    return 0
