"""StoreConfig: every knob of the storage layer, with its default and the reason for it."""
from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ConfigError

FLUSH_MODES = ("sync", "async")


@dataclass(frozen=True)
class StoreConfig:
    # 1 GiB, RocketMQ's mappedFileSizeCommitLog: segment files stay interchangeable with
    # RocketMQ tooling and the expiry job drops data in big, cheap steps. Tests use ~1 MiB
    # to exercise roll-over. All segments of a store share one size (offset -> segment is a division).
    segment_size: int = 1 << 30

    # 300 000 units of 20 bytes = 6 000 000-byte files, RocketMQ's mappedFileSizeConsumeQueue.
    cq_units_per_file: int = 300_000

    # "sync" (default): a put resolves only after its batch is msync'ed (group commit), because a
    # transactional broker must not acknowledge a half or a decision it can lose on power failure.
    # "async": a put resolves once copied into the mmap; a timer flushes (RocketMQ's ASYNC_FLUSH).
    flush: str = "sync"

    # 500 ms, RocketMQ's flushIntervalCommitLog: in async mode, how long data may sit unflushed.
    flush_interval_ms: int = 500

    # 4 MiB, RocketMQ's maxMessageSize (whole record). A record must also fit a segment with its
    # 8-byte end marker, so the effective limit is min(max_message_size, segment_size - 8).
    max_message_size: int = 4 << 20

    # False: a damaged record with valid data after it stops start-up (StoreError) rather than
    # silently discarding acknowledged messages. True is the operator's explicit "cut the log at the
    # first bad record and everything after it" (logged at ERROR with what was removed).
    truncate_corrupt_tail: bool = False
    # True: such a record, when its extent is sure (head sound, a valid record right after it), is kept in
    # place and lost alone (logged at ERROR; a pull stops at it), the log after it recovered and served.
    keep_corrupt_records: bool = False

    # 1000 ms, RocketMQ's flushConsumeQueue interval: how often consume queues are flushed and the
    # checkpoint advanced. Bounds how much of the log recovery must re-scan after a crash.
    checkpoint_interval_ms: int = 1000

    # 3, as RocketMQ recovers from the third-last file: even after a clean shutdown the last N
    # segments are re-verified (magic, layout, CRC) so damage there is found at start-up, not by a
    # consumer. 0 verifies only from the checkpoint's segment on.
    recovery_verify_segments: int = 3

    # False: reads (pulls) check the body CRC of the records start-up did not verify (the segments before the
    # ones recovery scanned), where bits flipped at rest go unseen otherwise, and that their topic and
    # properties (no CRC covers them) hold no zeroed bytes; the rest were verified at start-up or written by
    # this process. True checks every record a pull serves: about 1.4 us a 1 KiB message (0.8 the CRC, 0.6 the
    # topic and properties), broker CPU 5.5 -> 6.2 us per message consumed (bench_consume, 100k x 1 KiB). Reads that copy a record (a commit, a
    # retry, a dead letter, a scheduled delivery) and lookups by id or key always check.
    verify_all_reads: bool = False

    # True: reserve segment blocks with posix_fallocate when a segment is created. A full disk then
    # fails the roll with a clear status instead of a SIGBUS on the first write to a sparse page.
    preallocate: bool = True

    # 0.90, RocketMQ's diskSpaceWarningLevelRatio: at or above this fraction of the store's file
    # system in use, writes are refused (SERVICE_NOT_AVAILABLE) before any file is touched, and
    # resume by themselves once usage is back under it (less disk.HYSTERESIS). The space above is
    # what lets reads, checkpoints and consume queues go on, and start-up work, on a "full" disk.
    disk_refuse_ratio: float = 0.90

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"StoreConfig: {what}")

        for name in ("segment_size", "cq_units_per_file", "flush_interval_ms", "max_message_size",
                     "checkpoint_interval_ms", "recovery_verify_segments"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool), f"{name}={value!r} is not an integer")
        need(self.segment_size >= 4096, f"segment_size={self.segment_size} is below 4096 bytes")
        need(self.segment_size % 8 == 0, f"segment_size={self.segment_size} is not a multiple of 8")
        need(self.cq_units_per_file >= 1, f"cq_units_per_file={self.cq_units_per_file} must be at least 1")
        need(self.flush in FLUSH_MODES, f"flush={self.flush!r} must be one of {FLUSH_MODES}")
        need(self.flush_interval_ms >= 1, f"flush_interval_ms={self.flush_interval_ms} must be at least 1")
        need(self.max_message_size >= 91,
             f"max_message_size={self.max_message_size} is below the 91-byte minimum record")
        need(self.checkpoint_interval_ms >= 1,
             f"checkpoint_interval_ms={self.checkpoint_interval_ms} must be at least 1")
        need(self.recovery_verify_segments >= 0,
             f"recovery_verify_segments={self.recovery_verify_segments} must not be negative")
        need(isinstance(self.truncate_corrupt_tail, bool), "truncate_corrupt_tail must be a bool")
        need(isinstance(self.keep_corrupt_records, bool), "keep_corrupt_records must be a bool")
        need(isinstance(self.preallocate, bool), "preallocate must be a bool")
        need(isinstance(self.disk_refuse_ratio, (int, float)) and 0.0 < self.disk_refuse_ratio <= 1.0,
             f"disk_refuse_ratio={self.disk_refuse_ratio!r} must be in (0, 1]")

    @property
    def record_limit(self) -> int:
        """The largest record the writer accepts."""
        return min(self.max_message_size, self.segment_size - 8)

    @property
    def cq_file_size(self) -> int:
        return self.cq_units_per_file * 20
