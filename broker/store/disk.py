"""How full the store's file system is, and whether writes are refused for it (RocketMQ's disk watermark).

RocketMQ never lets a broker write its disk to 100%: above ``diskSpaceWarningLevelRatio``
(0.90) every put is answered SERVICE_NOT_AVAILABLE, "the broker's disk is full [...]", and
writes resume by themselves once usage falls again. ``DiskMonitor`` is that state:

* ``ratio`` is df's "Use%" of the file system holding the store, as a fraction:
  used / (used + available to us), so blocks reserved for root count as full;
* ``refusing`` turns on at ``ratio >= refuse_ratio`` and off only below
  ``refuse_ratio - HYSTERESIS``, so a store hovering at the mark does not flap;
* ``probe()`` is one statvfs (a couple of microseconds): the store calls it every
  ``PROBE_INTERVAL_S`` from its housekeeping task, after every reservation of space (what
  fills the disk), and at once when one fails with ENOSPC, so a disk filled between probes
  is refused from the next write on; while refusing, ``still_refusing()`` re-probes for a
  write at most every ``RECHECK_S``, so writes resume as soon as a client tries again;
* every change of state is logged once, and ``on_change`` listeners hear it (metrics;
  the retention helper's pressure cleaning reads ``ratio`` the same way).

Reads never look at this: pulls, admin reads and metrics work on a full disk.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

log = logging.getLogger("txmq.store")

HYSTERESIS = 0.01           # resume below refuse_ratio - 1 point: one point of a 48 MiB disk is ~0.5 MiB
PROBE_INTERVAL_S = 0.5      # well inside the 2 s in which writes must resume once space is back
RECHECK_S = 0.05            # while refusing, a write request re-probes when the last probe is older


class DiskMonitor:
    def __init__(self, path: str, refuse_ratio: float = 0.90, *,
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
                 clock: Callable[[], float] = time.monotonic):
        if not 0.0 < refuse_ratio <= 1.0:
            raise ValueError(f"refuse_ratio={refuse_ratio} must be in (0, 1]")
        self.path = path
        self.refuse_ratio = refuse_ratio
        self.resume_ratio = refuse_ratio - HYSTERESIS
        self.ratio = 0.0
        self.free_bytes = 0
        self.total_bytes = 0
        self.refusing = False
        self.refusals = 0           # write requests refused while ``refusing`` (a counter for metrics)
        self.on_change: list[Callable[[bool], None]] = []
        self._statvfs = statvfs
        self._clock = clock
        self._probed_at = float("-inf")

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
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        avail = st.f_bavail * st.f_frsize
        self.free_bytes = avail
        self.total_bytes = used + avail
        self.ratio = used / self.total_bytes if self.total_bytes > 0 else 1.0
        if self.refusing:
            if self.ratio < self.resume_ratio:
                self._set(False)
        elif self.ratio >= self.refuse_ratio:
            self._set(True)
        return self.refusing

    def _set(self, refusing: bool) -> None:
        self.refusing = refusing
        if refusing:
            log.warning("disk of the store %s is %.1f%% full (%s free), at or above disk_refuse_ratio %.0f%%: "
                        "refusing writes until it is below %.0f%%", self.path, self.ratio * 100,
                        human_bytes(self.free_bytes), self.refuse_ratio * 100, self.resume_ratio * 100)
        else:
            log.warning("disk of the store %s is %.1f%% full (%s free), below %.0f%%: accepting writes again",
                        self.path, self.ratio * 100, human_bytes(self.free_bytes), self.resume_ratio * 100)
        for fn in self.on_change:
            try:
                fn(refusing)
            except Exception:
                log.exception("disk state listener %r failed", fn)

    def remark(self, why: str = "") -> str:
        """What a refused client reads: RocketMQ's opening words, then how full and where the line is."""
        return (f"service not available now: the broker's disk is full [{why + '; ' if why else ''}"
                f"{self.ratio * 100:.1f}% used, {human_bytes(self.free_bytes)} free of "
                f"{human_bytes(self.total_bytes)}; writes are refused at {self.refuse_ratio * 100:.0f}% "
                f"and resume below {self.resume_ratio * 100:.0f}%]")

    def refuse(self, why: str = "") -> str:
        """Count one refused write request and return its remark."""
        self.refusals += 1
        return self.remark(why)

    def describe(self) -> str:
        """One line for a start-up failure: the store, its free space."""
        self.probe()
        return (f"store {self.path}: {human_bytes(self.free_bytes)} free of {human_bytes(self.total_bytes)} "
                f"({self.ratio * 100:.1f}% used)")


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
