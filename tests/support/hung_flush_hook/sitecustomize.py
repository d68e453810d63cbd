"""Loaded by a broker process started with ``tests.support.hung_writes.hung_flush_env`` (on its PYTHONPATH): while
the FIFO it names exists, each commit-log flush blocks before its msync in an open() of the FIFO for writing, which
no one reads -- an msync that never returns (a hung disk, a stopped NFS), on the store's own flush thread. No real
one can be made here (no device-mapper to suspend, no FUSE library)."""
import os

_FIFO = os.environ.get("TXMQ_TEST_HUNG_FLUSH_FIFO")
if _FIFO:
    from broker.store import writer

    _flush = writer._flush_ranges

    def _hung_while_the_fifo_exists(ranges):
        if os.path.exists(_FIFO):
            os.close(os.open(_FIFO, os.O_WRONLY))
        _flush(ranges)

    writer._flush_ranges = _hung_while_the_fifo_exists

_SLOW_MS = os.environ.get("TXMQ_TEST_FLUSH_DELAY_MS")
if _SLOW_MS:                    # a slow disk: each commit-log flush takes this long more (an msync of a busy HDD)
    import time

    from broker.store import writer

    _flush_slow = writer._flush_ranges

    def _slow(ranges):
        time.sleep(int(_SLOW_MS) / 1000)
        _flush_slow(ranges)

    writer._flush_ranges = _slow
