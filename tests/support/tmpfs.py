"""A small tmpfs for full-disk tests: mounted at DIR for the test, unmounted after; the test is skipped,
saying why, where mounting needs root it does not have (CI runs as root)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(mount: Path, size: str, inodes: int | None = None):
    """Mount a tmpfs of ``size`` (mount's -o size=, e.g. "48m", "64k") at ``mount`` (made if missing); ``inodes``:
    at most that many files and directories on it (-o nr_inodes=)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (f",nr_inodes={inodes}" if inodes else ""),
                           "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
