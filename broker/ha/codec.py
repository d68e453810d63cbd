"""The HA wire format, RocketMQ 4.x's (store/ha/HAService.java, HAConnection.java): two one-way streams.

Slave -> master: its max commit-log offset, nothing else, on connecting, after each transfer it
has stored, and every heartbeat interval:

    offset  size  field
    0       8     max physical offset of the slave's log (big-endian signed)

Master -> slave: transfers, starting where the slave said its log ends:

    offset  size  field
    0       8     physical offset of the first body byte in the master's log
    8       4     body size (0: a heartbeat, nothing to send)
    12      size  body: the master's commit-log bytes from that offset, as they are

Sans-IO: the decoders are fed bytes as they arrive, in any cuts, and hand out whole values.
"""
from __future__ import annotations

import struct

HEADER = struct.Struct(">qi")
OFFSET = struct.Struct(">q")
MAX_BODY = 64 * 1024 * 1024     # a transfer is haTransferBatchSize or one record (<= 4 MiB + headers)


class HAProtocolError(ValueError):
    """The peer sent something the HA protocol does not allow; the connection is closed."""


def encode_transfer(phys: int, body=b"") -> bytes:
    """The 12-byte header of a transfer of ``body`` (send the body after it)."""
    return HEADER.pack(phys, len(body))


def encode_offset(offset: int) -> bytes:
    return OFFSET.pack(offset)


class TransferDecoder:
    """Slave side: bytes from the master in, (physical offset, body) out; a heartbeat has an empty body."""

    def __init__(self, max_body: int = MAX_BODY):
        self._buf = bytearray()
        self._max = max_body

    def feed(self, data) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= HEADER.size:
            phys, size = HEADER.unpack_from(buf, pos)
            if phys < 0 or size < 0 or size > self._max:
                raise HAProtocolError(f"transfer header says offset {phys}, {size} bytes")
            end = pos + HEADER.size + size
            if len(buf) < end:
                break
            out.append((phys, bytes(buf[pos + HEADER.size:end])))
            pos = end
        if pos:
            del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


class OffsetDecoder:
    """Master side: bytes from a slave in, its reported offsets out (a value cut in two waits for the rest)."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data) -> list[int]:
        buf = self._buf
        buf += data
        whole = len(buf) - len(buf) % OFFSET.size
        out = [OFFSET.unpack_from(buf, p)[0] for p in range(0, whole, OFFSET.size)]
        del buf[:whole]
        for value in out:
            if value < 0:
                raise HAProtocolError(f"slave reported offset {value}")
        return out
