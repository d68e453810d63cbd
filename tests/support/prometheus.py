"""A real Prometheus (the Debian ``prometheus`` package) on 127.0.0.1 for tests, and its HTTP API.

``find_prometheus()`` returns the paths of ``prometheus`` and ``promtool``, installing the package
with apt-get when running as root on a machine that has apt (scripts/test.sh installs it too), or
a sentence saying why it cannot: the caller skips with it.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

_INSTALL_TRIED: list[str] = []


def find_prometheus() -> tuple[str, str] | str:
    """(prometheus, promtool), or why they are not available."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    if all(found):
        return found  # type: ignore[return-value]
    if not _INSTALL_TRIED:
        _INSTALL_TRIED.append(_install())
    found = shutil.which("prometheus"), shutil.which("promtool")
    if all(found):
        return found  # type: ignore[return-value]
    return f"the Debian `prometheus` package is not installed and could not be: {_INSTALL_TRIED[0]}"


def _install() -> str:
    if not shutil.which("apt-get"):
        return "no apt-get on this machine (install Prometheus 2.x so `prometheus` and `promtool` are on PATH)"
    if os.geteuid() != 0:
        return "not root, so apt-get cannot install it (run: sudo apt-get install -y prometheus)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
    for attempt in range(2):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return "apt-get install prometheus took over 300 s"
        if done.returncode == 0:
            return "installed"
        if attempt == 0:        # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
    return f"apt-get install prometheus failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"


def free_port() -> int:
    """A port free on 127.0.0.1 now (Prometheus cannot report a port 0 it was given)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusProcess:
    """``prometheus`` with a generated config scraping ``targets`` every second, rules from ``rule_files``."""

    def __init__(self, binary: str, workdir: Path, targets: list[str], rule_files: list[str], *,
                 job: str = "txmq", interval: str = "1s"):
        self.binary = binary
        self.workdir = Path(workdir)
        self.targets = targets
        self.rule_files = rule_files
        self.job = job
        self.interval = interval
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.log_path = self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "PrometheusProcess":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = {"global": {"scrape_interval": self.interval, "evaluation_interval": self.interval,
                             "scrape_timeout": self.interval},
                  "rule_files": self.rule_files,
                  "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": self.targets}]}]}
        path = self.workdir / "prometheus.yml"
        path.write_text(json.dumps(config))       # JSON is YAML
        for attempt in range(3):                  # the free port may be taken in between: try another
            self.port = free_port()
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=log, cwd=self.workdir)
            log.close()
            if self._wait_ready(timeout):
                return self
            self.stop()
        raise RuntimeError(f"prometheus did not become ready:\n{self.log()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)        # no event to await from another process: a bounded poll
        return False

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; returns the whole JSON answer (status, data or error)."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:      # 400/422 carry the error as JSON
            return json.load(exc)

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
