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


@contextlib.contextmanager
def ext4(mount: Path, image: Path, size: str = "64M"):
    """An ext4 file system on a loop device, mounted at ``mount`` with errors=remount-ro (a common default): yields
    ``turn_read_only``, which makes the kernel take it for damaged (ext4's trigger_fs_error) so that it remounts it
    read-only under whatever has files open on it, as after a real I/O error. ``repair()`` on the returned object
    (after every process let go of its files): umount, fsck, mount read-write again."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None or shutil.which("losetup") is None:
        pytest.skip("an ext4 file system on a loop device needs root and e2fsprogs (CI runs as root)")
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    disk = _Ext4(mount, image)
    done = disk.mount()
    if done.returncode != 0:
        image.unlink()
        pytest.skip(f"cannot mount an ext4 loop device here: {done.stderr.strip() or done.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        image.unlink(missing_ok=True)


class _Ext4:
    def __init__(self, mount: Path, image: Path):
        self.mount_point, self.image = mount, image

    def mount(self) -> subprocess.CompletedProcess:
        return subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(self.image), str(self.mount_point)],
                              capture_output=True, text=True)

    def turn_read_only(self) -> None:
        source = subprocess.run(["findmnt", "-no", "SOURCE", str(self.mount_point)], capture_output=True, text=True)
        trigger = Path("/sys/fs/ext4") / source.stdout.strip().rsplit("/", 1)[-1] / "trigger_fs_error"
        if not trigger.exists():
            pytest.skip(f"this kernel has no {trigger}: cannot make ext4 remount itself read-only")
        trigger.write_text("txmq test: an I/O error\n")

    def repair(self) -> None:
        subprocess.run(["umount", str(self.mount_point)], check=True)
        subprocess.run(["e2fsck", "-f", "-y", str(self.image)], capture_output=True)   # exit 1: errors fixed
        done = self.mount()
        assert done.returncode == 0, done.stderr
