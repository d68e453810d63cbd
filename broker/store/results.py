"""The values that cross the store's API: requests, results, statuses, dispatch and segment info.

Expected outcomes are values (a PutResult with a status, a GetResult with a status), never
exceptions; only a damaged or unwritable store raises (StoreError).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from protocol.message import encode_record, pack_host, properties_to_string, tags_code


class PutStatus(enum.Enum):
    """RocketMQ's PutMessageStatus names, the subset a single-node store can produce."""

    PUT_OK = "PUT_OK"
    MESSAGE_ILLEGAL = "MESSAGE_ILLEGAL"                  # too big, malformed, bad topic or queue id
    SERVICE_NOT_AVAILABLE = "SERVICE_NOT_AVAILABLE"      # closed, or stopped after an I/O error
    CREATE_MAPPED_FILE_FAILED = "CREATE_MAPPED_FILE_FAILED"  # a new segment could not be made (disk full)


class GetStatus(enum.Enum):
    """RocketMQ's GetMessageStatus (spec 3.7)."""

    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"
    MESSAGE_WAS_REMOVING = "MESSAGE_WAS_REMOVING"
    OFFSET_FOUND_NULL = "OFFSET_FOUND_NULL"
    OFFSET_OVERFLOW_BADLY = "OFFSET_OVERFLOW_BADLY"
    OFFSET_OVERFLOW_ONE = "OFFSET_OVERFLOW_ONE"
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"
    NO_MATCHED_LOGIC_QUEUE = "NO_MATCHED_LOGIC_QUEUE"
    NO_MESSAGE_IN_QUEUE = "NO_MESSAGE_IN_QUEUE"
    # txmq's own: the consume queue holds a zeroed unit here (units lost, their records still in the log); reads
    # stop at it, the next start rebuilds the queue (ConsumeQueue.mark_damaged)
    QUEUE_DAMAGED = "QUEUE_DAMAGED"
    # txmq's own: the record at this offset fails its body CRC (damaged on disk); reads stop at it, counted and
    # logged (MessageStore.corrupt). Nothing rebuilds it: the group is moved past it by hand (admin reset-offset
    # --queue Q --offset N, which the pull's remark spells out).
    RECORD_CORRUPT = "RECORD_CORRUPT"


@dataclass(slots=True, weakref_slot=True)     # (weakly held while an older NUL copy: Writer.nul_copies)
class PutRequest:
    """One record for the writer.

    ``record`` comes from ``protocol.message.encode_record`` with queue offset, physical offset and
    store timestamp zero; the writer patches them IN PLACE (so pass the bytearray; other buffers are
    copied first) and then copies the record into the segment. The record's own SYSFLAG and QUEUEID
    are authoritative; ``sys_flag`` is informational. ``delay_ms`` >= 0 (a delayed message in
    SCHEDULE_TOPIC_XXXX): its consume-queue tagsCode is the store timestamp plus this, its delivery
    time, as in RocketMQ, instead of ``tags_code``. ``older_nul``: a copy of an older broker's record
    whose properties hold a NUL (set by MessageStore.copying, never by hand): the writer moves the store's
    nul_free_from past it once it is flushed, before it is readable or acknowledged.
    """

    record: bytearray
    topic: str
    queue_id: int
    tags_code: int = 0
    sys_flag: int = 0
    delay_ms: int = -1
    older_nul: bool = False

    @classmethod
    def build(cls, topic: str, body: bytes, *, queue_id: int = 0, properties: dict[str, str] | None = None,
              flag: int = 0, sys_flag: int = 0, born_timestamp: int = 0,
              born_host: tuple[str, int] = ("127.0.0.1", 0), store_host: tuple[str, int] = ("127.0.0.1", 10911),
              reconsume_times: int = 0, prepared_offset: int = 0) -> "PutRequest":
        """Encode a record from its parts (tests, tools, broker-made messages)."""
        props = properties or {}
        record = encode_record(
            topic=topic.encode(), body=body, queue_id=queue_id, flag=flag, sys_flag=sys_flag,
            born_timestamp=born_timestamp, born_host=pack_host(*born_host), store_host=pack_host(*store_host),
            properties=properties_to_string(props).encode(), reconsume_times=reconsume_times,
            prepared_offset=prepared_offset)
        return cls(record, topic, queue_id, tags_code(props), sys_flag)


@dataclass(slots=True)
class PutResult:
    status: PutStatus
    physical_offset: int = -1
    size: int = 0
    store_timestamp: int = 0
    queue_offset: int = -1          # -1 when the record got no consume-queue unit (PREPARED / ROLLBACK)
    remark: str = ""                # why, for a refusal a client should read (a full disk)

    @property
    def ok(self) -> bool:
        return self.status is PutStatus.PUT_OK


@dataclass(slots=True)
class GetResult:
    status: GetStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    # Zero-copy slices of the segment mmaps, one whole record each; send with transport.writelines.
    # Holding them delays the unmapping of a removed segment, so release them once written.
    buffers: list[memoryview] = field(default_factory=list)

    @property
    def message_count(self) -> int:
        return len(self.buffers)

    @property
    def buffer_total_size(self) -> int:
        return sum(len(b) for b in self.buffers)


class DispatchInfo(NamedTuple):
    """What listeners learn about each stored record (live: after write/flush, before the put resolves)."""

    topic: str
    queue_id: int
    queue_offset: int               # -1 when the record has no consume-queue unit
    physical_offset: int
    size: int
    tags_code: int
    store_timestamp: int
    sys_flag: int
    prepared_offset: int
    recovering: bool


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    name: str                       # 20-digit start offset, the file name
    path: str
    start_offset: int
    size: int                       # file size (= StoreConfig.segment_size)
    written: int                    # bytes of records in the file (end marker excluded)
    first_store_timestamp: int      # -1 when the segment holds no record
    last_store_timestamp: int       # -1 when the segment holds no record
    sealed: bool                    # no further appends (every segment but the active one)


@dataclass(slots=True)
class Truncation:
    segment: str
    position: int
    length: int
    reason: str


@dataclass(slots=True)
class RecoveryReport:
    checkpoint_offset: int          # flushed offset recorded by the last checkpoint (0 if none)
    scanned_from: int               # physical offset where verification started
    end_offset: int                 # first byte after the last valid record
    records_scanned: int = 0
    truncations: list[Truncation] = field(default_factory=list)
    # damaged records kept in place, the log after them served (keep_corrupt_records; reason names topic and queue)
    corrupt_kept: list[Truncation] = field(default_factory=list)
    removed_segments: list[str] = field(default_factory=list)
    # segments the last run's manifest named before the log's first, gone from disk (a removal a crash cut short)
    gone_segments: list[str] = field(default_factory=list)
    cq_units_appended: int = 0
    cq_units_dropped: int = 0
    queues_rebuilt: list[str] = field(default_factory=list)    # "topic-queue" rebuilt from the whole log
    dispatched: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        """As repr, but a whole consumequeue/ rebuild's queues (every queue: 10,000 names, a 150 KB line in the
        start-up INFO) said as the first 10 and how many."""
        rebuilt = self.queues_rebuilt
        if len(rebuilt) <= 10:
            return repr(self)
        first = f"queues_rebuilt={rebuilt[:10]!r}"
        return repr(replace(self, queues_rebuilt=rebuilt[:10])).replace(first, f"{first} ({len(rebuilt)} in all)")
