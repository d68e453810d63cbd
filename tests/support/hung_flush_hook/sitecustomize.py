"""Loaded by a broker process started with ``tests.support.hung_writes.hung_flush_env`` (on its PYTHONPATH): while
the FIFO it names exists, each commit-log flush blocks before its msync in an open() of the FIFO for writing, which
no one reads -- an msync that never returns (a hung disk, a stopped NFS), on the store's own flush thread. No real
one can be made here (no device-mapper to suspend, no FUSE library). Started with ``slow_flush_env``, it is a slow
disk instead: while the flag file it names exists, each flush takes that many seconds more, and then completes.
Started with ``hung_recovery_env``, the store's recovery blocks the same way before it reads the log (a start-up
recovering a big store, held there for as long as the test needs). Started with ``hung_checkpoint_env``, each store
checkpoint (its fsyncs of queue directories, the queue list, the checkpoint file) blocks the same way, on the flush
thread it shares with the commit-log flushes."""
import os
import time

_FIFO = os.environ.get("TXMQ_TEST_HUNG_FLUSH_FIFO")
_SLOW = os.environ.get("TXMQ_TEST_SLOW_FLUSH")     # "<flag file>:<seconds>"
_RECOVERY = os.environ.get("TXMQ_TEST_HUNG_RECOVERY_FIFO")
_CHECKPOINT = os.environ.get("TXMQ_TEST_HUNG_CHECKPOINT_FIFO")
if _FIFO or _SLOW:
    from broker.store import writer

    _flush = writer._flush_ranges
    _flag, _, _seconds = (_SLOW or "").rpartition(":")

    def _hung_or_slow(ranges):
        if _FIFO and os.path.exists(_FIFO):
            os.close(os.open(_FIFO, os.O_WRONLY))
        if _flag and os.path.exists(_flag):
            time.sleep(float(_seconds))
        _flush(ranges)

    writer._flush_ranges = _hung_or_slow


def _held(module, name: str, fifo: str) -> None:
    """``module.name`` made to block in an open() of ``fifo`` for writing, while it exists, before it runs."""
    original = getattr(module, name)

    def held(*args, **kwargs):
        if os.path.exists(fifo):
            os.close(os.open(fifo, os.O_WRONLY))
        return original(*args, **kwargs)

    setattr(module, name, held)


if _RECOVERY or _CHECKPOINT:
    from broker.store import store

    if _RECOVERY:
        _held(store, "recover", _RECOVERY)
    if _CHECKPOINT:
        _held(store, "_checkpoint_job", _CHECKPOINT)
