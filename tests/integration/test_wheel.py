"""The wheel: it builds, installs in a clean virtual environment (no checkout on its path), puts only
``txmq`` into site-packages, and its console scripts run: a broker started with ``txmq-broker`` takes
a message from the installed client."""
from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
import venv

import pytest

from tests.support.broker_process import REPO

pytestmark = pytest.mark.slow

_OFFLINE = re.compile(r"No matching distribution|Could not find a version|NewConnectionError|"
                      r"Temporary failure in name resolution|Network is unreachable")

CLIENT = """
import asyncio, sys
import txmq
from txmq import Producer, PullConsumer

async def main(namesrv):
    async with Producer(namesrv, "PG_wheel") as producer:
        sent = await producer.send("WheelTopic", b"from the wheel")
    consumer = PullConsumer(namesrv, "CG_wheel")
    try:
        await consumer.fetch_queues("WheelTopic")
        res = await consumer.pull(sent.queue, sent.queue_offset, max_nums=1)
        print(res.messages[0].body.decode(), txmq.__version__)
    finally:
        await consumer.shutdown()

asyncio.run(asyncio.wait_for(main(sys.argv[1]), 30))
"""


def _run(*args, cwd, timeout=300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _listening_line(proc: subprocess.Popen, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline, buf = time.monotonic() + timeout, b""
    while b"\n" not in buf and time.monotonic() < deadline:
        if not sel.select(max(0.0, deadline - time.monotonic())):
            break
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        buf += chunk
    sel.close()
    return buf.decode(errors="replace")


def test_wheel_installs_in_a_clean_venv_and_its_scripts_run(tmp_path):
    import protocol

    t0 = time.monotonic()
    dist = tmp_path / "dist"
    built = _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(REPO), cwd=tmp_path)
    if built.returncode and _OFFLINE.search(built.stderr):
        pytest.skip(f"no package index reachable to build the wheel: {built.stderr.strip().splitlines()[-1]}")
    assert built.returncode == 0, built.stderr[-3000:]
    wheels = list(dist.glob("txmq-*.whl"))
    assert [w.name for w in wheels] == [f"txmq-{protocol.__version__}-py3-none-any.whl"]

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    bin_dir = env_dir / "bin"
    installed = _run(str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                     str(wheels[0]), cwd=tmp_path)
    if installed.returncode and _OFFLINE.search(installed.stderr):
        pytest.skip(f"no package index reachable for txmq's dependencies: {installed.stderr.strip().splitlines()[-1]}")
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    work = tmp_path / "elsewhere"           # not the checkout: only the installed package can be imported
    work.mkdir()

    version = _run(str(bin_dir / "txmq-broker"), "--version", cwd=work, env=env)
    assert version.returncode == 0 and version.stdout.strip() == f"txmq {protocol.__version__}", version
    for script in ("txmq-admin", "txmq-spark"):
        helped = _run(str(bin_dir / script), "--help", cwd=work, env=env)
        assert helped.returncode == 0 and "usage:" in helped.stdout, (script, helped.stderr)
    refused = _run(str(bin_dir / "txmq-spark"), "rollup", "--store-dir", str(work / "nope"), "--out", str(work / "o"),
                   cwd=work, env=env)
    assert refused.returncode == 2 and "does not exist" in refused.stderr

    # only txmq is installed: the generic names stay free for the user's own packages
    names = _run(str(bin_dir / "python"), "-c",
                 "import importlib.util as u, txmq, txmq.broker.server, txmq.ops.spark.session;"
                 "print([n for n in ('protocol', 'broker', 'producer', 'consumer', 'ops') if u.find_spec(n)])",
                 cwd=work, env=env)
    assert names.returncode == 0 and names.stdout.strip() == "[]", names.stderr

    # the Spark jobs ship the installed code to executors under its installed names (a stand-in
    # SparkContext records the file), and that zip alone imports on a Python without txmq
    shipped = _run(str(bin_dir / "python"), "-c",
                   "import shutil, types, txmq.ops.spark.session as s\n"
                   "class SC:\n    def addPyFile(self, p): shutil.copy(p, 'shipped.zip')\n"
                   "s.ship_code(types.SimpleNamespace(sparkContext=SC()))", cwd=work, env=env)
    assert shipped.returncode == 0, shipped.stderr
    zip_path = str(work / "shipped.zip")
    import zipfile

    names = set(zipfile.ZipFile(zip_path).namelist())
    assert {"txmq/__init__.py", "txmq/protocol/message.py", "txmq/ops/spark/segments.py",
            "txmq/ops/spark/log4j2.properties"} <= names and not any(n.startswith("txmq/broker/") for n in names)
    alone = _run(sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {zip_path!r});"
                 "import txmq.ops.spark.segments as s; print(s.__file__)", cwd=work, env=env)
    assert alone.returncode == 0 and alone.stdout.startswith(zip_path), alone.stderr

    broker = subprocess.Popen([str(bin_dir / "txmq-broker"), "--port", "0", "--namesrv-port", "0", "--metrics-port",
                               "-1", "--store-dir", str(work / "store")], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=open(tmp_path / "broker.log", "wb"))
    try:
        line = _listening_line(broker, 30)
        m = re.search(r"namesrv=(\S+)", line)
        assert m, f"{line!r}\n{(tmp_path / 'broker.log').read_text()[-3000:]}"
        client = _run(str(bin_dir / "python"), "-c", CLIENT, m.group(1), cwd=work, env=env, timeout=60)
        assert client.returncode == 0, client.stderr[-3000:]
        assert client.stdout.strip() == f"from the wheel {protocol.__version__}"
    finally:
        broker.send_signal(signal.SIGTERM)
        try:
            assert broker.wait(30) == 0
        finally:
            if broker.poll() is None:
                broker.kill()
    print(f"\nwheel build + clean venv install + run: {time.monotonic() - t0:.1f} s")
