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
