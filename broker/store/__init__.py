"""Storage: the commit log (single writer, group commit), consume queues, recovery, consumer offsets.

The contract is docs/design.md; byte layouts are at the top of each module.
"""
from .config import StoreConfig
from .disk import DiskMonitor
from .offsets import ConsumerOffsets
from .results import (DispatchInfo, GetResult, GetStatus, PutRequest, PutResult, PutStatus, RecoveryReport,
                      SegmentInfo, Truncation)
from .store import MessageStore

__all__ = ["MessageStore", "StoreConfig", "DiskMonitor", "PutRequest", "PutResult", "PutStatus", "GetResult", "GetStatus",
           "DispatchInfo", "SegmentInfo", "ConsumerOffsets", "RecoveryReport", "Truncation"]
