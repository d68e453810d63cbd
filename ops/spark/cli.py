"""`python -m ops.spark`: rollup, expiry, validate-plan. Logs one line per step on stderr."""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import json
import logging
import os
import re
import sys
import tempfile

from protocol.logline import OneLineFormatter
from protocol.errors import StoreError

from .load import DEFAULT_CHUNK_BYTES
from .plan import PlanError, plan_target, validate_plan_file
from .publish import PublishError, check_tables
from .segments import require_store


def _date(text: str) -> str:
    try:
        return dt.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date like 2024-03-10") from None


def _spark_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store-dir", action="append", default=[],
                   help="a broker's store directory (read only); repeat it for several brokers")
    p.add_argument("--store-root", default=None,
                   help="every store directly under this directory (python -m broker cluster's --store-root)")
    p.add_argument("--master", default=None,
                   help="Spark master (default: spark-submit's, else local[*])")
    p.add_argument("--shuffle-partitions", type=int, default=None, help="spark.sql.shuffle.partitions")
    p.add_argument("--conf", action="append", default=[], type=_conf, metavar="KEY=VALUE", help="extra Spark setting")
    p.add_argument("--skip-damaged", action="store_true",
                   help="leave a damaged segment tail out (and report it) instead of failing")
    p.add_argument("--check-crc", action="store_true", help="also verify every body CRC (slower)")
    p.add_argument("--chunk-mb", type=int, default=DEFAULT_CHUNK_BYTES >> 20,
                   help="split segments into tasks of about this many MiB (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no Spark console progress bar (a line at INFO each minute on the running stages instead)")


# Settings the jobs' results rest on. Under another session time zone every hour and day window (UTC
# milliseconds) was labelled with that zone's date: the hours before midnight there fell out of the date
# they were computed for, and its tables lost them without a word.
FIXED_CONF = {"spark.sql.session.timeZone": "UTC", "spark.sql.sources.partitionOverwriteMode": "dynamic"}


# The session time zone's other names for UTC (java.time.ZoneId's: region IDs and zero offsets, with or without
# a UTC/GMT/UT prefix): the same windows and dates: refusing them broke set-ups that were right.
_UTC_REGIONS = {"UTC", "GMT", "UT", "Z", "UCT", "Universal", "Zulu", "Greenwich", "GMT0"}
_UTC_REGIONS |= {f"Etc/{name}" for name in _UTC_REGIONS | {"GMT+0", "GMT-0"}}
_ZERO_OFFSET = re.compile(r"(?:UTC|GMT|UT)?[+-]0{1,2}(?::?00(?::?00)?)?")


def _same_value(key: str, value: str) -> bool:
    value = value.strip()
    if key == "spark.sql.session.timeZone":
        return value in _UTC_REGIONS or _ZERO_OFFSET.fullmatch(value) is not None
    return value.lower() == FIXED_CONF[key]     # Spark takes the overwrite mode in any case


def _conf(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    key = key.strip()
    if key in FIXED_CONF and not _same_value(key, value):
        raise argparse.ArgumentTypeError(f"{key} must stay {FIXED_CONF[key]}: every window and date partition "
                                         "is computed in UTC")
    return key, value


def _epoch_ms(text: str) -> int:
    ms = int(text)
    if ms < 100_000_000_000:    # as ms that is before 1973: nothing would be old enough, and the plan empty
        raise argparse.ArgumentTypeError(f"{text} looks like seconds since the epoch, not milliseconds "
                                         f"({ms * 1000})")
    return ms


def build_parser() -> argparse.ArgumentParser:
    # whole flag names only, its commands' too, as the broker's (broker/cli.py): `--retention 24` was taken for
    # --retention-hours, and a flag added later under a shorter name would change what an old cron line meant
    parser = argparse.ArgumentParser(prog="python -m ops.spark", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    r = sub.add_parser("rollup", help="hourly/daily metrics as Parquet + an HTML/CSV report")
    _spark_args(r)
    r.add_argument("--out", required=True, help="output directory (Parquet tables and report/)")
    r.add_argument("--date", type=_date, default=None,
                   help="UTC date to roll up (default: every date in the store)")
    r.add_argument("--report-dir", default=None, help="where the report goes (default OUT/report)")
    e = sub.add_parser("expiry", help="write the expiry plan (undecided halves, removable segments)")
    _spark_args(e)
    e.add_argument("--out", required=True, help="plan file to write (JSON)")
    e.add_argument("--retention-hours", type=float, default=72.0)
    e.add_argument("--now-ms", type=_epoch_ms, default=None, help="the time to plan for, ms since the epoch "
                   "(default: now)")
    v = sub.add_parser("validate-plan", help="check a plan file (exit 0 when valid)")
    v.add_argument("plan")
    return parser


def store_dirs(dirs: list[str], root: str | None) -> list[str]:
    """--store-dir values, plus every store directly under --store-root (sorted); at least one."""
    found = list(dirs)
    if root is not None:
        if not os.path.isdir(root):
            raise StoreError(f"store root {root} is not a directory (check --store-root)")
        found += [os.path.join(root, name) for name in sorted(os.listdir(root))
                  if os.path.isdir(os.path.join(root, name, "commitlog"))
                  or os.path.exists(os.path.join(root, name, "store_id"))]
        if len(found) == len(dirs):
            raise StoreError(f"store root {root} holds no store (no subdirectory with commitlog/ or store_id)")
    if not found:
        raise StoreError("give --store-dir (once per broker) or --store-root")
    return found


def require_writable(directory: str, what: str) -> None:
    """Refuse, before any work, an output directory that cannot be made or written on this host.

    Only local paths (and file: URIs) are checked (a Hadoop URI such as hdfs:// is Spark's to reach). Without this a
    bad --out failed when the results were written, after the whole store was decoded, in hundreds of
    lines of Java stack traces."""
    from .rollup import _local_path      # file:///x and file:/x (how Hadoop prints a local path) are /x

    path = _local_path(directory)
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".txmq-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StoreError(f"cannot write {what} {directory}: {exc.strerror or exc}") from None


def spark_failure(exc: BaseException) -> str | None:
    """One line for an error raised by Spark (the innermost Java cause), or None if it is not Spark's."""
    java = getattr(exc, "java_exception", None)          # py4j.protocol.Py4JJavaError
    if java is not None:
        try:
            while java.getCause() is not None:
                java = java.getCause()
            lines = [x.strip() for x in str(java.toString()).splitlines() if x.strip()]
            # A Python worker's error is its whole traceback: its first line and the exception, last.
            return "Spark failed: " + (lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}")
        except Exception:  # noqa: BLE001 - the JVM may be gone; fall back to the Python text
            pass
    if type(exc).__module__.startswith(("pyspark", "py4j")):
        return f"Spark failed: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}"
    return None


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(message)s"))     # (group and topic names read from the store)
    log = logging.getLogger("ops.spark")
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging()
    log = logging.getLogger("ops.spark")
    if args.command == "validate-plan":
        try:
            plan = validate_plan_file(args.plan)
        except PlanError as exc:
            print(f"validate-plan: {exc}", file=sys.stderr)
            return 1
        print(json.dumps({"valid": True, "halves": plan["halves"], "segments": len(plan["segments"])}))
        return 0

    try:        # before a JVM starts: a wrong path costs a second, not a Spark session
        stores = store_dirs(args.store_dir, args.store_root)
        for store in stores:
            require_store(store)
    except StoreError as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "expiry" and len(stores) != 1:
        print("expiry: plans are per broker: give one --store-dir (run it once per store)", file=sys.stderr)
        return 2
    try:
        if args.command == "rollup":
            require_writable(args.out, "--out")
            from .rollup import TABLES, _local_path

            if _local_path(args.out) is not None:
                check_tables(_local_path(args.out), TABLES)
            if args.report_dir is not None:
                require_writable(args.report_dir, "--report-dir")
        else:
            require_writable(os.path.dirname(plan_target(args.out)), "the plan's directory")
    except (StoreError, PublishError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 2

    from .session import build_session, progress_log

    conf = dict(args.conf)
    spark = build_session(args.master, app_name=f"txmq-{args.command}", shuffle_partitions=args.shuffle_partitions,
                          progress=not args.no_progress, conf=conf)
    scan = {"skip_damaged": args.skip_damaged, "check_crc": args.check_crc, "chunk_bytes": args.chunk_mb << 20}
    progress = contextlib.ExitStack()
    if args.no_progress:        # no console bar: a line a minute on how far the running stages got instead
        progress.enter_context(progress_log(spark, args.command))
    try:
        if args.command == "rollup":
            from .rollup import run_rollup

            summary = run_rollup(spark, stores, args.out, date=args.date, report_dir=args.report_dir,
                                 **scan)
            print(json.dumps({k: summary[k] for k in ("dates", "records", "rows", "reports", "incremental",
                                                      "segments_read", "segments", "bytes_read",
                                                      "brokers", "left_as_is")}))
        else:
            from .expiry import run_expiry

            plan = run_expiry(spark, stores[0], args.out, retention_hours=args.retention_hours,
                              now_ms=args.now_ms, **scan)
            print(json.dumps({"plan": args.out, "store_id": plan["store_id"], "halves": plan["halves_listed"],
                              "segments": len(plan["segments"]), "report": plan["report"]}))
        return 0
    except (StoreError, ValueError, OSError, PublishError) as exc:    # OSError: a plan or report not written
        text = str(exc)
        log.error("%s", text if text.startswith(f"{args.command}:") else f"{args.command}: {text}")
        return 2
    except Exception as exc:
        text = spark_failure(exc)
        if text is None:
            raise
        log.error("%s: %s", args.command, text)
        return 2
    finally:
        progress.close()
        spark.stop()
