"""``python -m broker cluster``: one name server and N brokers on this machine, a broker per core.

A txmq broker is one process on one core (one event loop, one writer). To use
N cores, run N brokers, each with its own store, under one name server: stock
clients spread sends over every broker's queues and fail over by themselves.
This supervisor is the one-command way to do that (docs/operations.md says why
it was chosen over a compose file or a systemd template):

* starts ``python -m broker namesrv`` and waits for its LISTENING line;
* starts broker i (0..N-1) as ``python -m broker --broker-name <prefix>-i
  --store-dir <root>/<prefix>-i --namesrv-addr <name server>`` on port
  ``base + i * step`` (or a free port with ``--base-port 0``), plus any flags
  after ``--``, and waits for every LISTENING line;
* prints ``LISTENING namesrv=HOST:PORT brokers=A;B;...`` when all serve;
* restarts a child that exits by itself (a crash, a kill -9) on the same ports
  (a port 0 chosen at first start is kept), after ``--restart-delay-s``,
  doubling up to 30 s while it keeps dying within 10 s of starting;
* on SIGTERM / SIGINT stops the brokers first (each unregisters and closes its
  store cleanly), then the name server, and exits 0.

Children's log lines go to this process's stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field

from protocol import logline
from protocol.connection import wait_within

log = logging.getLogger("txmq.cluster")
_LISTENING = re.compile(rb"LISTENING (.*)")
MAX_BACKOFF_S = 30.0
STABLE_S = 10.0
# "broker" in a checkout, "txmq.broker" in an installed wheel: children run the same code as this process.
MODULE = __package__ or "broker"


@dataclass
class Child:
    """One supervised process: its name, how to start it, and what its LISTENING line said."""

    name: str
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    listening: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m broker cluster", allow_abbrev=False,     # whole flag names only, as the broker's
        description="Run one name server and N txmq brokers on this machine (a broker per core), restart any "
                    "that dies, stop them all on SIGTERM. Flags after `--` go to every broker.")
    p.add_argument("--brokers", type=int, default=os.cpu_count() or 1, help="How many brokers (default: cores).")
    p.add_argument("--store-root", required=True, help="Broker i stores under STORE_ROOT/<prefix>-i.")
    p.add_argument("--host", default="127.0.0.1", help="Bind address of every process (default 127.0.0.1).")
    p.add_argument("--namesrv-port", type=int, default=9876, help="Name-server port; 0 picks one (default 9876).")
    p.add_argument("--base-port", type=int, default=10911,
                   help="Broker i listens on BASE + i * STEP; 0 picks free ports (default 10911).")
    p.add_argument("--port-step", type=int, default=10,
                   help="Port distance between brokers (default 10: RocketMQ puts HA at port+1, VIP at port-2; "
                        "below 3 the brokers serve no VIP channel).")
    p.add_argument("--metrics-base-port", type=int, default=5557,
                   help="Broker i's /metrics on BASE + i; 0 picks free ports; -1 disables (default 5557).")
    p.add_argument("--broker-prefix", default="broker", help="Broker names are PREFIX-0, PREFIX-1, ...")
    p.add_argument("--cluster-name", default="DefaultCluster")
    p.add_argument("--register-period-ms", type=int, default=30000, help="Brokers' registration period.")
    p.add_argument("--broker-expire-ms", type=int, default=120000, help="Name server drops a silent broker after.")
    p.add_argument("--restart-delay-s", type=float, default=1.0, help="Wait before restarting a dead child.")
    p.add_argument("broker_flags", nargs=argparse.REMAINDER, help="-- then flags for every broker.")
    return p


def _port(base: int, i: int, step: int) -> int:
    return 0 if base == 0 else base + i * step


class ClusterSupervisor:
    def __init__(self, args: argparse.Namespace, python: str = sys.executable):
        self.args = args
        self.python = python
        self.namesrv = Child("namesrv", [python, "-m", MODULE, "namesrv", "--host", args.host,
                                         "--port", str(args.namesrv_port),
                                         "--broker-expire-ms", str(args.broker_expire_ms),
                                         "--scan-interval-ms", str(max(100, min(10000, args.broker_expire_ms // 4))),
                                         # the cluster's data stays under its root
                                         "--kv-config-path", os.path.join(args.store_root, "namesrv", "kvConfig.json")])
        self.brokers: list[Child] = []
        self.stopping = asyncio.Event()

    def _broker_child(self, i: int, namesrv_addr: str) -> Child:
        a = self.args
        name = f"{a.broker_prefix}-{i}"
        metrics = -1 if a.metrics_base_port < 0 else (0 if a.metrics_base_port == 0 else a.metrics_base_port + i)
        extra = [f for f in a.broker_flags if f != "--"]
        if a.port_step < 3:     # a broker's VIP channel (its port - 2) would be another's port: the one to bind it
            extra = ["--vip-channel", "false", *extra]      # second failed to start (given after, a flag wins)
        return Child(name, [self.python, "-m", MODULE, "--host", a.host,
                            "--port", str(_port(a.base_port, i, a.port_step)), "--metrics-port", str(metrics),
                            "--store-dir", os.path.join(a.store_root, name), "--broker-name", name,
                            "--cluster-name", a.cluster_name, "--namesrv-addr", namesrv_addr,
                            "--register-period-ms", str(a.register_period_ms), *extra])

    async def _start(self, child: Child, timeout: float = 120.0) -> None:
        child.proc = await asyncio.create_subprocess_exec(*child.argv, stdout=asyncio.subprocess.PIPE,
                                                          stdin=asyncio.subprocess.DEVNULL)
        child.started_at = time.monotonic()
        line = await wait_within(child.proc.stdout.readline(), timeout)
        m = _LISTENING.search(line)
        if not m:
            rc = await child.proc.wait()
            raise RuntimeError(f"{child.name} did not start (exit {rc}): {line.decode(errors='replace').strip()}")
        child.listening = dict(kv.split("=", 1) for kv in m.group(1).decode().split() if "=" in kv)
        self._pin_ports(child)
        log.info("%s listening: %s", child.name, m.group(1).decode())

    def _pin_ports(self, child: Child) -> None:
        """A restart reuses the ports the first start got: clients and message ids keep pointing right."""
        pins = {"--port": child.listening.get("namesrv" if child is self.namesrv else "broker"),
                "--metrics-port": child.listening.get("metrics")}
        for flag, addr in pins.items():
            if addr and ":" in addr and flag in child.argv:
                child.argv[child.argv.index(flag) + 1] = addr.rsplit(":", 1)[1]

    async def start(self) -> str:
        await self._start(self.namesrv)
        ns = self.namesrv.listening["namesrv"]
        self.brokers = [self._broker_child(i, ns) for i in range(self.args.brokers)]
        await asyncio.gather(*(self._start(b) for b in self.brokers))
        return f"LISTENING namesrv={ns} brokers={';'.join(b.listening['broker'] for b in self.brokers)}"

    async def watch(self, child: Child) -> None:
        """Restart ``child`` whenever it exits by itself, until the cluster stops."""
        delay = self.args.restart_delay_s
        while not self.stopping.is_set():
            rc = await child.proc.wait()
            if self.stopping.is_set():
                return
            lived = time.monotonic() - child.started_at
            child.backoff_s = delay if lived >= STABLE_S or not child.backoff_s else min(MAX_BACKOFF_S,
                                                                                          child.backoff_s * 2)
            log.error("%s exited (code %s) after %.1f s; restarting in %.1f s", child.name, rc, lived,
                      child.backoff_s)
            print(f"EXITED {child.name} code={rc}", flush=True)
            try:
                await wait_within(self.stopping.wait(), child.backoff_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self._start(child)
            except Exception as exc:  # noqa: BLE001 - keep trying; the backoff grows
                log.error("%s restart failed: %s", child.name, exc)
                continue
            child.restarts += 1
            print(f"RESTARTED {child.name} {' '.join(f'{k}={v}' for k, v in child.listening.items())}", flush=True)

    async def stop(self, timeout: float = 30.0) -> None:
        """Brokers first (they unregister from the running name server), then the name server."""
        self.stopping.set()
        for group in (self.brokers, [self.namesrv]):
            live = [c.proc for c in group if c.proc is not None and c.proc.returncode is None]
            for proc in live:
                proc.send_signal(signal.SIGTERM)
            for proc in live:
                try:
                    await wait_within(proc.wait(), timeout)
                except asyncio.TimeoutError:
                    log.error("pid %d did not stop in %.0f s: killed", proc.pid, timeout)
                    proc.kill()
                    await proc.wait()


async def supervise(args: argparse.Namespace) -> int:
    sup = ClusterSupervisor(args)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        ready = await sup.start()
    except Exception as exc:  # noqa: BLE001 - one line, then clean up whatever did start
        print(f"txmq-cluster: cannot start: {exc}", file=sys.stderr, flush=True)
        await sup.stop(timeout=10)
        return 1
    print(ready, flush=True)
    watchers = [loop.create_task(sup.watch(c)) for c in (sup.namesrv, *sup.brokers)]
    await stop.wait()
    log.info("signal received: stopping %d brokers and the name server", len(sup.brokers))
    await sup.stop()
    for w in watchers:
        w.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.brokers < 1:
        print("txmq-cluster: cannot start: --brokers must be at least 1", file=sys.stderr)
        return 1
    logline.configure(logging.INFO)
    return asyncio.run(supervise(args))
