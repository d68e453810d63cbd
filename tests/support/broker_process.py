"""The real broker as a child process on 127.0.0.1, ports chosen by the OS, for integration tests."""
from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"LISTENING broker=(\S+) namesrv=(\S+) metrics=(\S+)")
# Flags for a broker on which no check decides (or records a check of) a transaction while the test looks, however
# slow the machine. A long check interval alone does not say it: a half's first check is due when its immunity
# (--transaction-timeout-ms, 6 s by default) runs out, and a loaded machine took longer than that to send and fill.
NO_CHECKS = ("--transaction-check-interval-ms", "60000", "--transaction-timeout-ms", "3600000")


class BrokerProcess:
    def __init__(self, store_dir, *flags: str, env: dict | None = None, preexec_fn=None, repo: Path | None = None,
                 prefix: tuple[str, ...] = ()):
        self.store_dir = Path(store_dir)
        self.prefix = prefix                # a command the broker runs under (e.g. unshare: PID 1 of its namespace)
        self.preexec_fn = preexec_fn        # run in the child before the broker (e.g. resource limits)
        self.repo = repo or REPO            # the checkout whose broker runs (a bench's baseline: another worktree)
        self.flags = list(flags)
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.broker = self.namesrv = self.metrics = ""
        self.log_path = self.store_dir.parent / f"{self.store_dir.name}-broker.log"

    def start(self, timeout: float = 30.0) -> "BrokerProcess":
        self.launch()
        line = self._read_line(timeout)
        m = _LISTENING.search(line)
        if not m:
            self.kill()
            raise RuntimeError(f"broker did not start: {line!r}\n{self.log()}")
        self.broker, self.namesrv, self.metrics = m.groups()
        ha = re.search(r" ha=(\S+)", line)
        self.ha = ha.group(1) if ha else ""          # a master's HA listener (--ha-port)
        return self

    def launch(self) -> subprocess.Popen:
        """The process started, not waited for (start waits for its ready line)."""
        self.store_dir.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "broker", "--host", "127.0.0.1", "--port", "0", "--namesrv-port", "0",
             "--metrics-port", "0", "--store-dir", str(self.store_dir), *self.flags],
            cwd=self.repo, stdout=subprocess.PIPE, stderr=log, env=env, preexec_fn=self.preexec_fn)
        log.close()
        return self.proc

    def _read_line(self, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < deadline:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                break
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            if b"\n" in buf:
                break
        sel.close()
        return buf.decode(errors="replace").strip()

    @property
    def broker_port(self) -> int:
        return int(self.broker.rsplit(":", 1)[1])

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait: the broker's clean shutdown."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: the crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
