"""Messages and consumer offsets survive a clean stop and a SIGKILL."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import urllib.request

import pytest

from consumer import PullConsumer
from consumer.pull_consumer import MessageQueue
from producer import Producer
from protocol.errors import BrokerError
from tests.support.broker_process import BrokerProcess
from tests.support.hung_writes import hung_recovery_env, unblock

pytestmark = pytest.mark.asyncio


async def _send(broker, n):
    async with Producer(broker.namesrv, "PG_restart") as producer:
        await producer.send("Durable", b"seed")
        mq = (await producer.routes.publish_queues("Durable"))[0]
        for i in range(n):
            await producer.send("Durable", f"m{i}".encode(), queue=mq)
    return MessageQueue("Durable", mq.broker_name, mq.queue_id)


async def _bodies(broker, mq):
    consumer = PullConsumer(broker.namesrv, "CG_restart")
    await consumer.fetch_queues("Durable")
    res = await consumer.pull(mq, 0, max_nums=1000)
    offset = await consumer.fetch_offset(mq)
    await consumer.shutdown()
    return [m.body for m in res.messages], offset


async def _wait_offset_persisted(store_dir, group, expected, timeout=15.0):
    path = store_dir / "config" / "consumerOffset.json"
    async with asyncio.timeout(timeout):
        while True:
            try:
                data = json.loads(path.read_text())
                if expected in str(data) and group in str(data):
                    return
            except (OSError, ValueError):
                pass
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("crash", [False, True], ids=["clean-stop", "sigkill"])
async def test_messages_and_offsets_survive(broker_factory, tmp_path, crash):
    b = broker_factory()
    mq = await _send(b, 50)
    consumer = PullConsumer(b.namesrv, "CG_restart")
    await consumer.fetch_queues("Durable")
    await consumer.commit_offset(mq, 42)
    await consumer.shutdown()
    if crash:
        await _wait_offset_persisted(tmp_path / "store", "CG_restart", "42")
        b.kill()
    else:
        assert b.stop() == 0
    b2 = broker_factory()
    bodies, offset = await _bodies(b2, mq)
    assert [f"m{i}".encode() for i in range(50)] == [x for x in bodies if x != b"seed"]
    assert offset == 42


# Small segments and queue files, so the queue has old files whose records lie before the segments recovery
# re-verifies (the last 3): only the queue files speak for those records.
SMALL_STORE = ("--segment-size", str(256 * 1024), "--max-message-size", "65536", "--cq-units-per-file", "64")


async def _pull_all(b, mq) -> tuple[list[bytes], Exception | None]:
    """Pull the queue from 0 to its end: the bodies, and the error that stopped it, if one did."""
    consumer = PullConsumer(b.namesrv, "CG_zeroed")
    await consumer.fetch_queues("Zeroed")
    queue = MessageQueue("Zeroed", mq.broker_name, mq.queue_id)
    got, offset = [], 0
    try:
        async with asyncio.timeout(30):
            for _ in range(200):                                # bounded: 1201 messages at 32 a pull
                res = await consumer.pull(queue, offset, max_nums=32)
                got += [m.body for m in res.messages]
                if res.next_begin_offset >= res.max_offset:
                    break
                assert res.next_begin_offset > offset, res
                offset = res.next_begin_offset
    except BrokerError as exc:
        return got, exc
    finally:
        await consumer.shutdown()
    return got, None


async def test_units_zeroed_mid_way_through_an_old_queue_file_stop_pulls_until_a_restart_rebuilds(
        broker_factory, tmp_path):
    """A zeroed range (a lost page, a bad disk) in an old consume-queue file, valid units after it. The file
    was flushed before the last checkpoint, so start-up does not read it through; the first pull that meets
    the zeros gets SYSTEM_ERROR naming the queue and offset (ERROR in the log, a gauge), never the messages
    after them instead; the queue is marked, and the next start rebuilds it from the commit log and serves
    every message in order. Before: the pull took the zeroed units for a removed segment and skipped them
    without a word."""
    b = broker_factory(*SMALL_STORE)
    bodies = [f"m{i:04d}".encode() + b"." * 1000 for i in range(1200)]
    async with Producer(b.namesrv, "PG_zeroed") as producer:
        await producer.send("Zeroed", b"seed")          # creates the topic; it may land in another queue
        mq = (await producer.routes.publish_queues("Zeroed"))[0]
        for k in range(0, len(bodies), 50):
            await producer.send_batch("Zeroed", bodies[k:k + 50], queue=mq)
    assert b.stop() == 0
    store = tmp_path / "store"
    assert len(os.listdir(store / "commitlog")) >= 5            # the zeroed units' records are not re-verified
    qdir = store / "consumequeue" / "Zeroed" / str(mq.queue_id)
    files = sorted(os.listdir(qdir))
    assert len(files) >= 10
    with open(qdir / files[1], "r+b") as f:                     # an old file, not the last
        f.seek(6 * 20)
        f.write(bytes(20 * 20))                                 # units 6..25 of the file, valid units after

    b2 = broker_factory(*SMALL_STORE)
    got, error = await _pull_all(b2, mq)
    damaged_at = int(files[1]) // 20 + 6
    assert error is not None and f"damaged at offset {damaged_at}" in str(error), error
    assert [x for x in got if x != b"seed"] == bodies[:len([x for x in got if x != b"seed"])]    # nothing skipped
    assert len(got) <= damaged_at
    metrics = urllib.request.urlopen(f"http://{b2.metrics}/metrics", timeout=5).read().decode()
    assert "txmq_store_consume_queues_damaged 1.0" in metrics
    assert b2.stop() == 0
    log_text = (tmp_path / "store-broker.log").read_text(errors="replace")
    assert f"zeroed unit at queue offset {damaged_at}, file {files[1]}" in log_text

    b3 = broker_factory(*SMALL_STORE)
    got, error = await _pull_all(b3, mq)
    assert error is None and [x for x in got if x != b"seed"] == bodies
    metrics = urllib.request.urlopen(f"http://{b3.metrics}/metrics", timeout=5).read().decode()
    assert "txmq_store_consume_queues_rebuilt_total 1.0" in metrics
    assert "txmq_store_consume_queues_damaged 0.0" in metrics


async def test_a_queue_directory_removed_as_the_damage_error_advises_is_rebuilt_from_the_whole_log(
        broker_factory, tmp_path):
    """A consume queue's directory removed while the broker is stopped (what a start refused over a damaged queue
    file advises: "delete ... to rebuild it from the commit log"), its records all in segments older than those a
    start verifies past the checkpoint: the start scanned from the checkpoint, found none of them, and served the
    queue as empty (0 of 1,200 messages, no error, no log line). The store's queue list names it now: rebuilt."""
    b = broker_factory(*SMALL_STORE)
    bodies = [f"m{i:04d}".encode() + b"." * 1000 for i in range(1200)]
    async with Producer(b.namesrv, "PG_zeroed") as producer:
        await producer.send("Zeroed", b"seed")
        mq = (await producer.routes.publish_queues("Zeroed"))[0]
        for k in range(0, len(bodies), 50):
            await producer.send_batch("Zeroed", bodies[k:k + 50], queue=mq)
        for k in range(0, 1200, 50):        # a newer topic fills the segments a start verifies
            await producer.send_batch("Newer", [b"n" * 1000] * 50)
    assert b.stop() == 0
    store = tmp_path / "store"
    assert len(os.listdir(store / "commitlog")) >= 9
    shutil.rmtree(store / "consumequeue" / "Zeroed" / str(mq.queue_id))

    b2 = broker_factory(*SMALL_STORE)
    got, error = await _pull_all(b2, mq)
    assert error is None and [x for x in got if x != b"seed"] == bodies
    metrics = urllib.request.urlopen(f"http://{b2.metrics}/metrics", timeout=5).read().decode()
    assert "txmq_store_consume_queues_rebuilt_total 1.0" in metrics
    assert b2.stop() == 0
    log_text = (tmp_path / "store-broker.log").read_text(errors="replace")
    assert f"consume queues Zeroed-{mq.queue_id} (1 in all, named by queues) are missing" in log_text


@contextlib.asynccontextmanager
async def _held_in_recovery(tmp_path, prefix: tuple[str, ...] = ()):
    """A broker on tmp_path/store whose start is held in the store's recovery (by a FIFO, as a big store's long
    recovery), its queues loaded: recovery is next, or under way. Killed and released on the way out."""
    fifo = tmp_path / "hold-recovery"
    os.mkfifo(fifo)
    held = BrokerProcess(tmp_path / "store", env=hung_recovery_env(fifo), prefix=prefix)
    before = held.log_path.read_bytes().count(b"consume queues of")     # the first broker's starts
    held.launch()
    try:
        async with asyncio.timeout(30):
            while held.log_path.read_bytes().count(b"consume queues of") == before:
                assert held.proc.poll() is None, held.log()
                await asyncio.sleep(0.05)
        yield held
    finally:
        held.kill()
        unblock(fifo)
        fifo.unlink()


async def test_a_sigterm_while_the_store_recovers_says_so_and_the_next_start_loses_nothing(broker_factory, tmp_path):
    """A supervisor's stop while start-up recovers the store: the process ended at once without a word, exit -15,
    its log's last line the queues loaded, so nobody knew the start had been stopped, not failed or hung. It says so
    now (what it was doing, that the next start recovers again), still ends at once, by the signal; the next start
    serves every message acknowledged before."""
    b = broker_factory()
    mq = await _send(b, 30)
    b.kill()                                                # a crash: the next start has a log to recover
    async with _held_in_recovery(tmp_path) as held:
        held.proc.send_signal(signal.SIGTERM)
        code = held.proc.wait(20)
    assert code == -signal.SIGTERM, held.log()
    said = [line for line in held.log().splitlines() if "SIGTERM during start-up" in line]
    assert len(said) == 1 and "recovering the store" in said[0] and " WARNING " in said[0], held.log()
    assert "Traceback" not in held.log()
    bodies, _ = await _bodies(broker_factory(), mq)
    assert [f"m{i}".encode() for i in range(30)] == [x for x in bodies if x != b"seed"]


async def test_a_sigterm_while_the_consumer_offsets_are_read_says_so(broker_factory, tmp_path):
    """A start reads the consumer offsets and the first offsets' journal (config/consumerOffset.json.firsts) after
    the message index, and lowers those past their queue's end: seconds at 500,000 offsets. A SIGTERM there said
    "(opening the message index, ...)", the step before, where nothing was being done. Held here by a FIFO at the
    journal's path (its read waits for a writer)."""
    b = broker_factory()
    await _send(b, 3)
    b.kill()
    fifo = b.store_dir / "config" / "consumerOffset.json.firsts"
    with contextlib.suppress(FileNotFoundError):
        fifo.unlink()
    os.mkfifo(fifo)
    held = BrokerProcess(b.store_dir)
    held.launch()
    writer = None
    try:
        async with asyncio.timeout(30):
            while writer is None:       # the broker opened the FIFO to read it: reading now, until it is closed
                assert held.proc.poll() is None, held.log()
                try:
                    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:         # ENXIO: no reader yet
                    await asyncio.sleep(0.05)
        held.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(held.proc.wait, 20)
    finally:
        if writer is not None:
            os.close(writer)
        held.kill()
    assert code == -signal.SIGTERM, held.log()
    said = [line for line in held.log().splitlines() if "SIGTERM during start-up" in line]
    assert len(said) == 1 and "(reading the consumer offsets," in said[0], said


def _child_of(pid: int) -> int:
    """The one process whose parent is ``pid`` (no /proc/PID/task/TID/children on every kernel)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/status") as f:
                if f"PPid:\t{pid}\n" in f.read():
                    return int(entry)
    raise AssertionError(f"process {pid} has no child")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_during_recovery_ends_a_broker_that_is_pid_1_of_its_container(broker_factory, tmp_path, sig):
    """PID 1 of a container (a Kubernetes command:, docker run --entrypoint txmq-broker: no init before it): the
    kernel drops a signal such a process sends itself while its action is the default. The handler said "ending
    now", and its os.kill ended nothing: the recovery went on, a supervisor's stop waited its grace period out for
    a SIGKILL, and a SIGINT (Ctrl-C: a KeyboardInterrupt before) no longer ended it at all. It ends now, by the
    status a shell gives a death by that signal (128 + its number), as docker shows one."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--fork", "--pid", "true"], capture_output=True).returncode != 0:
        pytest.skip("a PID namespace needs root and unshare (CI runs as root)")
    b = broker_factory()
    await _send(b, 3)
    b.kill()
    async with _held_in_recovery(tmp_path, prefix=("unshare", "--fork", "--pid", "--kill-child")) as held:
        os.kill(_child_of(held.proc.pid), sig)       # unshare forwards nothing: the broker, PID 1 inside
        code = held.proc.wait(20)
    assert code == 128 + sig, held.log()
    said = [line for line in held.log().splitlines() if f"{sig.name} during start-up" in line]
    assert len(said) == 1 and "ending now" in said[0], held.log()


async def test_a_sigterm_while_the_first_registration_waits_stops_the_broker_cleanly(tmp_path):
    """Past its recovery, its listeners serving, a start waits for its first registration (up to
    register_timeout_ms, 6 s, a name server that does not answer): a SIGTERM there ended the process as a crash (exit
    -15, no unregistration, no final checkpoint). Now the broker stops cleanly once that start ends: exit 0."""
    registering = asyncio.Event()

    async def silent(reader, writer):           # a name server that reads and never answers
        registering.set()
        await reader.read()
        writer.close()

    namesrv = await asyncio.start_server(silent, "127.0.0.1", 0)
    b = BrokerProcess(tmp_path / "store", "--namesrv-addr", "127.0.0.1:%d" % namesrv.sockets[0].getsockname()[1])
    b.launch()
    try:
        async with asyncio.timeout(30):
            await registering.wait()
        b.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(b.proc.wait, 30)
    finally:
        b.kill()
        namesrv.close()
    assert code == 0, b.log()
    said = [line for line in b.log().splitlines() if "SIGTERM during start-up" in line]
    assert len(said) == 1 and "stops cleanly once its start ends" in said[0], b.log()
    assert b.log().rstrip().endswith("stopped"), b.log()
