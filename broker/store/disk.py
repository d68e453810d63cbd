"""How full the store's file system is, and whether writes are refused for it (RocketMQ's disk watermark).

RocketMQ never lets a broker write its disk to 100%: above ``diskSpaceWarningLevelRatio``
(0.90) every put is answered SERVICE_NOT_AVAILABLE, "the broker's disk is full [...]", and
writes resume by themselves once usage falls again. ``DiskMonitor`` is that state:

* ``ratio`` is df's "Use%" of the file system holding the store, as a fraction:
  used / (used + available to us), so blocks reserved for root count as full;
  ``inode_ratio`` is df -i's "IUse%" the same way (0 where the file system has no fixed
  number of inodes, as btrfs);
* ``refusing`` turns on when either is at or above ``refuse_ratio`` and off only once both are
  below ``refuse_ratio - HYSTERESIS``, so a store hovering at the mark does not flap. Inodes
  too (RocketMQ looks at blocks only): out of them, every new file fails ENOSPC -- a segment,
  a queue's file, each save's .tmp (checkpoint, offsets, topics) -- with the blocks' ratio
  low, the refusals said as a full disk with most of it free and no alert firing;
* ``probe()`` is one statvfs (a couple of microseconds): the store calls it every
  ``PROBE_INTERVAL_S`` from its housekeeping task, after every reservation of space (what
  fills the disk), and at once when one fails with ENOSPC, so a disk filled between probes
  is refused from the next write on; while refusing, ``still_refusing()`` re-probes for a
  write at most every ``RECHECK_S``, so writes resume as soon as a client tries again;
* ``read_only``: the file system is mounted read-only (statvfs's ST_RDONLY, or the mount table that
  ``read_mounts()`` reads off the event loop every ``MOUNTS_CHECK_S``), as ext4 with
  errors=remount-ro leaves it after an I/O error: the first write then fails EROFS and stops
  the store until a restart (CommitLog.fail); this says it, at ERROR once and in a gauge, for
  an idle broker too, whose next send would be the first to find out;
* every change of state is logged once, and ``on_change`` listeners hear it (metrics;
  the retention helper's pressure cleaning reads ``ratio`` the same way).

Reads never look at this: pulls, admin reads and metrics work on a full disk.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable

log = logging.getLogger("txmq.store")

HYSTERESIS = 0.01           # resume below refuse_ratio - 1 point: one point of a 48 MiB disk is ~0.5 MiB
MOUNTS_CHECK_S = 5.0        # /proc/self/mountinfo is read this often, on a worker thread (~1 us of CPU a mount)
PROBE_INTERVAL_S = 0.5      # well inside the 2 s in which writes must resume once space is back
RECHECK_S = 0.05            # while refusing, a write request re-probes when the last probe is older


class DiskMonitor:
    def __init__(self, path: str, refuse_ratio: float = 0.90, *,
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
                 clock: Callable[[], float] = time.monotonic,
                 mounted_read_only: Callable[[str, int | None], bool] | None = None):
        if not 0.0 < refuse_ratio <= 1.0:
            raise ValueError(f"refuse_ratio={refuse_ratio} must be in (0, 1]")
        self.path = path
        self.refuse_ratio = refuse_ratio
        self.resume_ratio = refuse_ratio - HYSTERESIS
        self.ratio = 0.0
        self.inode_ratio = 0.0
        self.free_bytes = 0
        self.total_bytes = 0
        self.refusing = False
        self.read_only = False      # the file system is mounted read-only (statvfs ST_RDONLY): no write can succeed
        self.refusals = 0           # write requests refused while ``refusing`` (a counter for metrics)
        self.on_change: list[Callable[[bool], None]] = []
        self._statvfs = statvfs
        self._clock = clock
        self._probed_at = float("-inf")
        self._mounts_read_at = float("-inf")
        self._table_read_only = False   # the mount table's word at its last reading (read_mounts)
        self._table_unread = False      # said once: the table could not be read
        self._mounted_read_only = mounted_read_only or _mounted_read_only
        self._dev: int | None = None    # the store's file system (st_dev) at the first reading: the one it writes to
        self._table_fresh = False       # read_mounts read the table since the last probe
        self.table_readings = 0         # probes that took a fresh mount-table reading into read_only

    def mounts_due(self) -> bool:
        """Whether the mount table is due a reading (every ``MOUNTS_CHECK_S``)."""
        return self._clock() - self._mounts_read_at >= MOUNTS_CHECK_S

    def read_mounts(self) -> None:
        """Read the mount table (blocking: a worker thread's; on a host of 10k mounts it is ~10 ms of CPU, an
        event-loop stall every 5 s on the loop); the next ``probe()`` says what it found."""
        self._mounts_read_at = self._clock()
        if self._dev is None:
            # once: a file system mounted over the store's directory later hides the one its open files are on
            with contextlib.suppress(OSError):      # (the path alone then, as before)
                self._dev = os.stat(self.path).st_dev
        try:
            self._table_read_only = self._mounted_read_only(self.path, self._dev)
        except OSError as exc:
            if not self._table_unread:
                self._table_unread = True
                log.warning("cannot read /proc/self/mountinfo (%s): a store file system that turns read-only without "
                            "statvfs saying so (Linux 6.x ext4 emergency_ro) is seen only when a write fails", exc)
        # (once the reading is in: a probe on the loop meanwhile, a send's while refusing, took the old word for it)
        self._table_fresh = True

    def still_refusing(self) -> bool:
        """For a write while ``refusing``: measure again if the last probe is stale; returns ``refusing``."""
        if self._clock() - self._probed_at >= RECHECK_S:
            self.probe()
        return self.refusing

    def probe(self) -> bool:
        """Measure now; returns ``refusing``. A failing statvfs keeps the last state (and says so)."""
        self._probed_at = self._clock()
        try:
            st = self._statvfs(self.path)
        except OSError as exc:
            log.warning("cannot measure the disk of %s: %s", self.path, exc)
            return self.refusing
        # (a test's stand-in may have no flags). The mount table's word is read_mounts' last: never read here,
        # on the event loop and (while refusing) a send's path
        read_only = bool(getattr(st, "f_flag", 0) & os.ST_RDONLY) or self._table_read_only
        if read_only != self.read_only:
            self.read_only = read_only
            if read_only:
                log.error("the store's file system %s is read-only now (the kernel remounts it so after an I/O "
                          "error, as ext4 errors=remount-ro does; or an operator did): every write of the store fails "
                          "and is refused. See dmesg, repair it (umount, fsck) and restart the broker", self.path)
            else:
                log.warning("the store's file system %s is writable again", self.path)
        if self._table_fresh:           # read_only has the table's word now (Retention's pause after an EROFS waits it)
            self._table_fresh = False
            self.table_readings += 1
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        avail = st.f_bavail * st.f_frsize
        self.free_bytes = avail
        self.total_bytes = used + avail
        self.ratio = used / self.total_bytes if self.total_bytes > 0 else 1.0
        # No fixed number (0 of 0: btrfs, vfat; CephFS's free count -1, 2**64 - 1): more free than in all is none.
        inodes_used = st.f_files - st.f_ffree
        inodes = inodes_used + st.f_favail
        self.inode_ratio = inodes_used / inodes if 0 < st.f_files and st.f_ffree <= st.f_files and inodes > 0 else 0.0
        full = max(self.ratio, self.inode_ratio)
        if self.refusing:
            if full < self.resume_ratio:
                self._set(False)
        elif full >= self.refuse_ratio:
            self._set(True)
        return self.refusing

    def _set(self, refusing: bool) -> None:
        self.refusing = refusing
        if refusing:
            log.warning("disk of the store %s is %s, at or above disk_refuse_ratio %.0f%%: refusing writes until it "
                        "is below %.0f%%", self.path, self.fullness(), self.refuse_ratio * 100,
                        self.resume_ratio * 100)
        else:
            log.warning("disk of the store %s is %s, below %.0f%%: accepting writes again",
                        self.path, self.fullness(), self.resume_ratio * 100)
        for fn in self.on_change:
            try:
                fn(refusing)
            except Exception:
                log.exception("disk state listener %r failed", fn)

    def fullness(self) -> str:
        """How full, as df says it; the inodes too once they are the fuller (df -i). The log's and a refused
        client's words alike."""
        text = f"{self.ratio * 100:.1f}% used ({human_bytes(self.free_bytes)} free of {human_bytes(self.total_bytes)})"
        if self.inode_ratio > self.ratio:
            text += f"; inodes {self.inode_ratio * 100:.1f}% used (df -i): every file takes one"
        return text

    def remark(self, why: str = "") -> str:
        """What a refused client reads: RocketMQ's opening words, then how full and where the line is."""
        return (f"service not available now: the broker's disk is full [{why + '; ' if why else ''}"
                f"{self.fullness()}; writes are refused at {self.refuse_ratio * 100:.0f}% "
                f"and resume below {self.resume_ratio * 100:.0f}%]")

    def refuse(self, why: str = "") -> str:
        """Count one refused write request and return its remark."""
        self.refusals += 1
        return self.remark(why)

    def describe(self) -> str:
        """One line for a start-up failure: the store, its free space."""
        self.probe()
        return f"store {self.path}: {self.fullness()}"


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def _mounted_read_only(path: str, dev: int | None = None) -> bool:
    """Whether the mount holding ``path`` is read-only by /proc/self/mountinfo: its mount or super-block options
    "ro", or ext4's "emergency_ro". Linux 6.x ext4 with errors=remount-ro marks itself emergency_ro after an I/O
    error and fails every write EROFS while statvfs still says read-write (no ST_RDONLY). OSError where unreadable.

    ``dev``: the store's file system (st_dev), when known: only its mounts are looked at (a file system mounted
    over the store's mount point since is on top in the table, and not the one the store writes to); the table's
    every mount when none is its (btrfs subvolumes' st_dev is not the table's)."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        rows = [(fields, fields.index("-")) for fields in (line.split() for line in f.read().splitlines())
                if "-" in fields]
    rows = [(fields, sep) for fields, sep in rows if sep >= 6 and len(fields) >= sep + 4]
    if dev is not None:
        ours = [(fields, sep) for fields, sep in rows if fields[2] == f"{os.major(dev)}:{os.minor(dev)}"]
        rows = ours or rows
    path = os.path.realpath(path)
    best, read_only = -1, False
    for fields, sep in rows:
        point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= best:
            best = len(point)        # the last of equal length is the one on top
            options = set(fields[5].split(",")) | set(fields[sep + 3].split(","))
            read_only = "ro" in options or "emergency_ro" in options
    return read_only
