"""A broker that cannot start says why in one line and exits 1: no traceback, not even from stopping."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.support.broker_process import REPO, BrokerProcess


def _start(store, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker", "--host", "127.0.0.1", "--namesrv-port", "0",
                           "--metrics-port", "0", "--store-dir", str(store), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def _one_line(done: subprocess.CompletedProcess, reason: str) -> None:
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(lines) == 1 and reason in lines[0], done.stderr
    assert not [line for line in done.stderr.splitlines() if " ERROR " in line], done.stderr
    assert "LISTENING" not in done.stdout


def test_a_taken_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        _one_line(_start(tmp_path / "s", "--port", str(taken.getsockname()[1])), "address already in use")


def test_a_store_in_use_by_another_broker(tmp_path):
    with BrokerProcess(tmp_path / "s"):
        # the store is opened after the listeners are bound: this is the stop() path that used to
        # end in AttributeError from the transaction service's progress save
        _one_line(_start(tmp_path / "s", "--port", "0"), "in use by another process")


@pytest.mark.parametrize("flags, reason", [(("--disk-refuse-ratio", "1.5"), "disk_refuse_ratio"),
                                          (("--flush-interval-ms", "0"), "flush_interval_ms")])
def test_bad_configuration(tmp_path, flags, reason):
    _one_line(_start(tmp_path / "s", "--port", "0", *flags), reason)


@pytest.mark.parametrize("name", ["topics.json", "subscriptionGroup.json", "brokerConfig.json"])
def test_a_catalogue_that_cannot_be_read_nor_its_previous_copy(tmp_path, name):
    """topics.json and subscriptionGroup.json were ignored with an ERROR and the broker served with the
    defaults (every topic's queues and permissions, every group's settings), which its next save made final.
    brokerConfig.json the same: started read-write, a broker out of service for maintenance took writes again."""
    config = tmp_path / "s" / "config"
    config.mkdir(parents=True)
    (config / name).write_bytes(b'{"torn')
    (config / (name + ".bak")).write_bytes(bytes(64))
    _one_line(_start(tmp_path / "s", "--port", "0"), f"{config / name} cannot be read")


def test_a_damaged_store_id_says_what_to_do(tmp_path):
    """It said the file was damaged, not that removing it is safe (a new id; the snapshot is rebuilt)."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "store_id").write_bytes(bytes(37))
    _one_line(_start(tmp_path / "s", "--port", "0"), "remove the file to have a new one written")
