"""Publish a rollup's date partitions so that a run killed at any moment loses no date of the history.

Spark's dynamic partition overwrite commits a job by deleting each date partition it replaces and
then renaming the new one in (HadoopMapReduceCommitProtocol.commitJob, per partition): a run killed
between the two left the date with no partition at all, every broker's rows of it gone. Here:

1. stage: each table's new partitions are written under ``<out>/.txmq-publish/new/<table>/`` (a
   name beginning with "." is hidden from Spark and pyarrow readers), each with a marker file
   ``.txmq-run-<run>`` naming the run;
2. commit: one journal, ``<out>/.txmq-publish/journal.json`` (written under a temporary name and
   renamed), lists every (table, date) to replace or remove; from here on the run is done in effect;
3. swap: each partition goes in. On a local file system one atomic exchange (Linux renameat2
   RENAME_EXCHANGE): a reader sees the old partition or the new one, never none. Elsewhere (or
   where the file system cannot exchange) the old one is moved aside first, then the new one in;
4. ``.txmq-publish`` is deleted.

Every step can be repeated. recover() (each rollup calls it under the --out lock before it reads
anything there) finishes a journal it finds, partition by partition: a partition holding the
run's marker is in, one still staged is swapped in. With no journal nothing was published: the
staged files are dropped.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import uuid

log = logging.getLogger("ops.spark")

DIR = ".txmq-publish"
RENAME_EXCHANGE = 2         # linux/fs.h


class PublishError(RuntimeError):
    """The journal and the partitions on disk disagree: someone else changed --out mid-publish."""


class Publisher:
    """One run's publish into out_dir: stage(table) gives the path to write a table's partitions to;
    commit() journals and swaps them all in."""

    def __init__(self, spark, out_dir: str):
        jvm = spark.sparkContext._jvm
        self._Path = jvm.org.apache.hadoop.fs.Path
        self._jvm = jvm
        root = self._Path(f"{out_dir.rstrip('/')}/{DIR}")
        self.fs = root.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        self.root = self.fs.makeQualified(root)
        self.out = self.root.getParent()
        self.run = uuid.uuid4().hex

    def _p(self, *parts: str):
        return self._Path(self.root, "/".join(parts))

    def _final(self, table: str, date: str):
        return self._Path(self.out, f"{table}/date={date}")

    # --- one run ---------------------------------------------------------------------------------

    def stage(self, table: str) -> str:
        """Where to write this table's new partitions (a fresh directory)."""
        self.fs.create(self._p(f"run-{self.run}"), True).close()    # commit() checks it is still there
        return str(self._p("new", table))

    def check_tables(self, tables) -> None:
        """check_tables() for this --out (a local one)."""
        out = _local(self.out)
        if out is not None:
            check_tables(out, tables)

    def commit(self, owned: dict[str, set[str]]) -> dict[str, set[str]]:
        """Swap in, for each table, every staged date partition, and remove the partitions of the
        owned dates that now have no rows; return {table: dates swapped in}."""
        journal = {"run": self.run, "tables": {}}
        self.check_tables(owned)                # before the journal: nothing is published
        if not self.fs.exists(self._p(f"run-{self.run}")):
            # Gone: another run's recover() dropped them as a killed run's, and a date "with no rows
            # any more" would be every date of the run, removed.
            raise PublishError(f"this run's staged partitions under {self.root} are gone: another rollup "
                               "into the same --out dropped them (runs into one --out must not overlap)")
        for table, dates in owned.items():
            staged = self._staged_dates(table)
            for d in staged:                 # the marker that says "this partition is in" after the swap
                self.fs.create(self._Path(self._p("new", table, f"date={d}"), f".txmq-run-{self.run}"), True).close()
            journal["tables"][table] = {"replace": sorted(staged), "remove": sorted(set(dates) - staged)}
        _sync_tree(self._p("new"))          # the new partitions on disk before the journal says "publish"
        self._write_journal(journal)
        self._finish(journal)
        return {t: set(v["replace"]) for t, v in journal["tables"].items()}

    def _staged_dates(self, table: str) -> set[str]:
        where = self._p("new", table)
        if not self.fs.exists(where):
            return set()
        names = [s.getPath().getName() for s in self.fs.listStatus(where) if s.isDirectory()]
        return {n[len("date="):] for n in names if n.startswith("date=")}

    def _write_journal(self, journal: dict) -> None:
        tmp, path = self._p("journal.json.tmp"), self._p("journal.json")
        data = json.dumps(journal).encode()
        local = _local(tmp)
        if local is not None:   # Hadoop's local file system ignores hsync (its checksummed stream cannot sync)
            with open(local, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            out = self.fs.create(tmp, True)
            try:
                out.write(bytearray(data))
                out.hsync()
            finally:
                out.close()
        _rename(self.fs, tmp, path)
        _sync_dir(self.root)    # the journal's name on disk before any partition moves

    # --- finishing (this run's, or a killed run's) -----------------------------------------------

    def pending(self) -> bool:
        """Whether a run left a publish (or its staged files) here."""
        return bool(self.fs.exists(self.root))

    def recover(self) -> bool:
        """Finish a publish a killed run left (True), or drop its staged files; False if none."""
        if not self.fs.exists(self.root):
            return False
        path = self._p("journal.json")
        if not self.fs.exists(path):
            log.warning("rollup: dropping %s: a run was killed before it published anything", self.root)
            self.fs.delete(self.root, True)
            return False
        stream = self.fs.open(path)
        try:
            journal = json.loads(self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
        finally:
            stream.close()
        log.warning("rollup: a run was killed while it published its partitions into %s: finishing it",
                    self.out)
        self._finish(journal)
        return True

    def _finish(self, journal: dict) -> None:
        run = journal["run"]
        for table, todo in journal["tables"].items():
            for d in todo["replace"]:
                self._swap_in(table, d, run)
            for d in todo["remove"]:
                final = self._final(table, d)
                if self.fs.exists(final):
                    self._aside(final, self._p("old", table, f"date={d}"))
            _sync_dir(self._Path(self.out, table))      # the swaps on disk before the journal goes
        self.fs.delete(self.root, True)

    def _swap_in(self, table: str, date: str, run: str) -> None:
        final, new = self._final(table, date), self._p("new", table, f"date={date}")
        if self.fs.exists(self._Path(final, f".txmq-run-{run}")):
            return                                          # swapped in before the kill
        if not self.fs.exists(new):
            raise PublishError(f"{final}: the journal of run {run} lists it, but its new partition {new} is "
                               "gone and it is not in place: something else changed the directory")
        if not self.fs.exists(final):                       # first write of the date, or moved aside
            self.fs.mkdirs(final.getParent())
            _rename(self.fs, new, final)
        elif not _exchange(self.fs, new, final):
            self._aside(final, self._p("old", table, f"date={date}"))
            _rename(self.fs, new, final)

    def _aside(self, final, old) -> None:
        if self.fs.exists(old):
            raise PublishError(f"{old} exists already: cannot move {final} aside")
        self.fs.mkdirs(old.getParent())
        _rename(self.fs, final, old)


def check_tables(out_dir: str, tables) -> None:
    """Refuse (PublishError) tables of a local ``out_dir`` whose directory is on another file system than
    its staging area (a table linked to another disk, or mounted on its own: see _place). A rename across
    file systems or mounts fails, and Hadoop's local file system then copies, file by file: readers saw the
    old partition half deleted and the new one half copied, and a run killed after the copy of the new
    partition's run marker left it half copied for good (the next run took the marker for a finished swap)."""
    staging = os.path.join(out_dir, DIR)
    here = _checked_place(staging)
    for table in tables:
        where = os.path.join(out_dir, table)
        if _checked_place(where) != here:
            raise PublishError(f"{where} is on another file system than {staging}: its partitions cannot be "
                               "swapped in atomically; keep every table on --out's file system (link or mount "
                               "--out itself, not a table in it)")


def _checked_place(local: str) -> tuple[int, str | None]:
    """_place(), a stat it cannot make (a directory this user may not search: PermissionError) refused in one
    line naming the path, not a traceback."""
    try:
        return _place(local)
    except OSError as exc:
        raise PublishError(f"cannot check where {exc.filename or local} lives (to publish {local}): "
                           f"{exc.strerror or exc}") from None


def _rename(fs, src, dst) -> None:
    """Hadoop's rename reports failure as False; a publish step that fails must stop the run."""
    if not fs.rename(src, dst):
        raise OSError(f"cannot rename {src} to {dst}")


def _local(path) -> str | None:
    uri = path.toUri()
    return uri.getPath() if uri.getScheme() == "file" else None


def _place(local: str) -> tuple[int, str | None]:
    """Where a local path lives for rename(2): (its device, the mount point it is under), for its nearest
    ancestor that exists (links followed). The device alone missed a bind mount of the same disk (docker -v,
    mount --bind): one device number, yet Linux renames across mounts with EXDEV, and Hadoop copied."""
    while True:
        try:
            dev = os.stat(local).st_dev
            break
        except FileNotFoundError:
            parent = os.path.dirname(os.path.abspath(local))
            if parent == os.path.abspath(local):
                raise
            local = parent
    real = os.path.realpath(local)
    points = _mount_points()
    if points is None:          # no /proc (not Linux): the device has to do
        return dev, None
    under = [m for m in points if real == m or real.startswith(m.rstrip("/") + "/")]
    return dev, max(under, key=len, default=None)


def _mount_points() -> list[str] | None:
    """The mount points of this process's mount namespace (/proc/self/mountinfo's fifth field), or None."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    except OSError:
        return None
    octal = re.compile(r"\\([0-7]{3})")      # a space in a mount point is written \040
    return [octal.sub(lambda m: chr(int(m.group(1), 8)), line.split(" ")[4]) for line in lines if line.count(" ") >= 4]


def _fsync(local: str) -> None:
    fd = os.open(local, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_dir(path) -> None:
    """fsync a local directory (its entries: renames into and out of it); elsewhere nothing to do."""
    local = _local(path)
    if local is not None and os.path.isdir(local):
        _fsync(local)


def _sync_tree(path) -> None:
    """fsync every file and directory under a local path: Spark's Parquet writer syncs nothing."""
    local = _local(path)
    for where, _, files in os.walk(local) if local is not None else ():
        for name in files:
            _fsync(os.path.join(where, name))
        _fsync(where)


_libc = None


def _exchange(fs, a, b) -> bool:
    """Swap directories a and b in one step (local file systems on Linux); False where that is not
    possible, and nothing changed."""
    global _libc
    if a.toUri().getScheme() != "file" or b.toUri().getScheme() != "file":
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:                                          # not glibc 2.28+
        return False
    at_fdcwd = -100
    res = fn(at_fdcwd, os.fsencode(a.toUri().getPath()), at_fdcwd, os.fsencode(b.toUri().getPath()),
             RENAME_EXCHANGE)
    if res == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.ENOTSUP):
        return False                                       # this file system cannot: rename twice
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")
