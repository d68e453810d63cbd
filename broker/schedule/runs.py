"""OffsetRuns: a set of queue offsets, held as bitmap chunks and written as runs.

The delivered timers above the timer floor (progress.py). One undelivered timer holds the floor back for up to
timer_max_delay_s (3 days) while every timer after it is delivered; as a set of ints that was 32 MB of memory a
million, a 6.9 MB delayOffset.json, sorted and written whole every 10 s.

In memory: the offsets cut into chunks of CHUNK; a chunk with some offsets held is a bitmap (CHUNK / 8 bytes),
a chunk with all of them is the shared FULL marker, a chunk with none is absent. An offset costs one bit at most
(timers that go in random order: no run to fold), a full chunk a dict entry: a million delivered in the order
they were sent is 245 entries. Every operation is O(1) in what is held, but ``discard_below`` (the chunks it
passes) and the JSON (off the loop).

In delayOffset.json (``to_json`` / ``from_json``) a run is ``[first, last]`` (both held) and a lone offset the
bare number, so an old file's ``timerDone`` (every offset, bare) loads as it is.
"""
from __future__ import annotations

SHIFT = 12
CHUNK = 1 << SHIFT              # offsets a chunk (a bitmap of 512 bytes)
FULL = b"\xff" * (CHUNK // 8)   # the marker of a chunk with every offset held (compared by identity)


class OffsetRuns:
    __slots__ = ("_chunks", "_counts", "_count", "_base")

    def __init__(self):
        self._chunks: dict[int, bytearray | bytes] = {}    # chunk index -> its bitmap, or FULL
        self._counts: dict[int, int] = {}                   # offsets held in each bitmap chunk (not FULL ones)
        self._count = 0
        self._base = 0                  # no chunk below this index is held (discard_below)

    def add(self, offset: int) -> None:
        self.update((offset,))

    def update(self, offsets) -> None:
        """Hold each of ``offsets`` (a delivery batch's: one pass, names bound once)."""
        chunks, counts = self._chunks, self._counts
        added = 0
        for offset in offsets:
            idx = offset >> SHIFT
            chunk = chunks.get(idx)
            if chunk is FULL:
                continue
            if chunk is None:
                chunk = chunks[idx] = bytearray(CHUNK >> 3)
                counts[idx] = 0
                if idx < self._base:
                    self._base = idx
            bit = offset & (CHUNK - 1)
            byte, mask = bit >> 3, 1 << (bit & 7)
            if chunk[byte] & mask:
                continue
            chunk[byte] |= mask
            added += 1
            n = counts[idx] + 1
            if n == CHUNK:
                chunks[idx] = FULL
                del counts[idx]
            else:
                counts[idx] = n
        self._count += added

    def add_run(self, start: int, end: int) -> None:
        """Hold every offset in [start, end): whole chunks at once."""
        while start < end:
            idx = start // CHUNK
            stop = min(end, (idx + 1) * CHUNK)
            if start == idx * CHUNK and stop == start + CHUNK:
                self._count += CHUNK - (CHUNK if self._chunks.get(idx) is FULL else self._counts.pop(idx, 0))
                self._chunks[idx] = FULL
                self._base = min(self._base, idx)
            else:
                self.update(range(start, stop))
            start = stop

    def __contains__(self, offset: int) -> bool:
        idx, bit = divmod(offset, CHUNK)
        chunk = self._chunks.get(idx)
        return chunk is not None and bool(chunk[bit >> 3] & (1 << (bit & 7)))

    def run_end(self, start: int, limit: int | None = None) -> int:
        """The first offset at or after ``start`` not held (at most ``limit``): where the run from it ends."""
        offset = start
        while limit is None or offset < limit:
            idx, bit = divmod(offset, CHUNK)
            chunk = self._chunks.get(idx)
            if chunk is None:
                break
            if chunk is not FULL:
                while bit < CHUNK and chunk[bit >> 3] & (1 << (bit & 7)):
                    bit += 1
                if bit < CHUNK:
                    offset = idx * CHUNK + bit
                    break
            offset = (idx + 1) * CHUNK
        return offset if limit is None else min(offset, limit)

    def discard_below(self, bound: int) -> int:
        """Forget every offset below ``bound``; returns how many were held. Costs the chunks it passes."""
        top, bit = divmod(bound, CHUNK)
        chunks, counts = self._chunks, self._counts
        below = range(self._base, top)
        idxs = below if len(below) <= len(chunks) else [i for i in chunks if i < top]
        gone = 0
        for idx in idxs:
            chunk = chunks.pop(idx, None)
            if chunk is not None:
                gone += CHUNK if chunk is FULL else counts.pop(idx)
        chunk = chunks.get(top)
        if chunk is not None and bit:
            if chunk is FULL:
                chunk = chunks[top] = bytearray(FULL)
                counts[top] = CHUNK
            cut = int.from_bytes(chunk, "little") & ((1 << bit) - 1)
            if cut:
                chunk[:] = (int.from_bytes(chunk, "little") & ~((1 << bit) - 1)).to_bytes(CHUNK // 8, "little")
                n = cut.bit_count()
                gone += n
                counts[top] -= n
                if not counts[top]:
                    del chunks[top], counts[top]
        self._base = max(self._base, top)
        self._count -= gone
        return gone

    def __len__(self) -> int:
        """Offsets held."""
        return self._count

    def iter_runs(self):
        """(start, end) of each run, in order; end exclusive."""
        run_start = run_end = None
        for idx in sorted(self._chunks):
            chunk, base = self._chunks[idx], idx * CHUNK
            if chunk is FULL:
                pieces = ((base, base + CHUNK),)
            else:
                pieces = _bitmap_runs(chunk, base)
            for start, end in pieces:
                if start == run_end:
                    run_end = end
                    continue
                if run_start is not None:
                    yield run_start, run_end
                run_start, run_end = start, end
        if run_start is not None:
            yield run_start, run_end

    def __iter__(self):
        for start, end in self.iter_runs():
            yield from range(start, end)

    def __eq__(self, other) -> bool:
        if not isinstance(other, OffsetRuns):
            return NotImplemented
        return list(self.iter_runs()) == list(other.iter_runs())

    def copy(self) -> "OffsetRuns":
        new = OffsetRuns()
        new._chunks = {i: c if c is FULL else bytearray(c) for i, c in self._chunks.items()}
        new._counts, new._count, new._base = dict(self._counts), self._count, self._base
        return new

    def to_json(self) -> list:
        return [s if e == s + 1 else [s, e - 1] for s, e in self.iter_runs()]

    @classmethod
    def from_json(cls, items) -> "OffsetRuns":
        """``to_json``'s list, or an old file's list of offsets. ValueError/TypeError for anything else."""
        new, lone = cls(), []
        for item in items or ():
            if isinstance(item, list):
                if len(item) != 2 or int(item[1]) < int(item[0]) or int(item[0]) < 0:
                    raise ValueError(f"timerDone run {item!r} is not [first, last]")
                new.add_run(int(item[0]), int(item[1]) + 1)
            elif int(item) < 0:
                raise ValueError(f"timerDone offset {item!r} is negative")
            else:
                lone.append(int(item))
        new.update(lone)
        return new

    def __repr__(self) -> str:
        return f"OffsetRuns({self.to_json()!r})"


def _byte_runs(value: int) -> tuple[tuple[int, int], ...]:
    runs, bit = [], 0
    while bit < 8:
        if value >> bit & 1:
            start = bit
            while bit < 8 and value >> bit & 1:
                bit += 1
            runs.append((start, bit))
        bit += 1
    return tuple(runs)


_BYTE_RUNS = tuple(_byte_runs(v) for v in range(256))      # the runs of set bits in each byte value


def _bitmap_runs(chunk, base: int):
    """(start, end) runs of the set bits of one chunk, offset by ``base``, a byte's at a time (iter_runs joins
    the ones that touch)."""
    pos = base
    for value in chunk:
        if value:
            for start, end in _BYTE_RUNS[value]:
                yield pos + start, pos + end
        pos += 8
