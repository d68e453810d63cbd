"""OffsetRuns: a set of queue offsets, held as bitmap chunks and written as runs.

The delivered timers above the timer floor (progress.py). One undelivered timer holds the floor back for up to
timer_max_delay_s (3 days) while every timer after it is delivered; as a set of ints that was 32 MB of memory a
million, a 6.9 MB delayOffset.json, sorted and written whole every 10 s.

In memory: the offsets cut into chunks of CHUNK; a chunk with some offsets held is a bitmap (CHUNK / 8 bytes),
a chunk with all of them is the shared FULL marker, a chunk with none is absent. A partial chunk costs its 512
bytes however few it holds (its other offsets are timers waiting, each a heap entry), a full chunk a dict entry:
a million delivered in the order they were sent is 245 entries. Every operation is O(1) in what is held, but
``discard_below`` (the chunks it passes) and the JSON (off the loop).

In delayOffset.json (``to_json`` / ``from_json``) a run is ``[first, last]`` (both held), a lone offset the
bare number, so an old file's ``timerDone`` (every offset, bare) loads as it is; a chunk cut into more than BUSY
runs is ``"<its first offset>:<base64 of its bitmap>"`` (at most 700 bytes for 4,096 offsets: every other timer
delivered, listed, was 7.4 MB a million, slower to write and read than the old set's list). A broker older than
runs refuses both (its int() of a list or of that string): it replays the progress records instead.
"""
from __future__ import annotations

from base64 import b64decode, b64encode
from collections import deque
from itertools import compress, repeat
from operator import sub

SHIFT = 12
CHUNK = 1 << SHIFT              # offsets a chunk (a bitmap of 512 bytes)
FULL = b"\xff" * (CHUNK // 8)   # the marker of a chunk with every offset held (compared by identity)
BUSY = 64                       # a chunk cut into more runs is written as its bitmap (684 characters of base64)
SPARSE = 64                     # a chunk of at most this many runs has them found one by one (_spans)


class OffsetRuns:
    __slots__ = ("_chunks", "_counts", "_count", "_base", "_owned")

    def __init__(self):
        self._chunks: dict[int, bytearray | bytes] = {}    # chunk index -> its bitmap, or FULL
        self._counts: dict[int, int] = {}                   # offsets held in each bitmap chunk (not FULL ones)
        self._count = 0
        self._base = 0                  # no chunk below this index is held (discard_below)
        self._owned: set[int] = set()   # bitmap chunks made since the last copy(): the others are shared, copied
        #                                 before they are changed (copy-on-write: the loop's copy is the dict's)

    def add(self, offset: int) -> None:
        self.update((offset,))

    def update(self, offsets) -> None:
        """Hold each of ``offsets`` (a delivery batch's: one pass, names bound once)."""
        chunks, counts, owned = self._chunks, self._counts, self._owned
        added = 0
        for offset in offsets:
            idx = offset >> SHIFT
            chunk = chunks.get(idx)
            if chunk is FULL:
                continue
            if chunk is None:
                chunk = chunks[idx] = bytearray(CHUNK >> 3)
                counts[idx] = 0
                owned.add(idx)
                if idx < self._base:
                    self._base = idx
            bit = offset & (CHUNK - 1)
            byte, mask = bit >> 3, 1 << (bit & 7)
            if chunk[byte] & mask:
                continue
            if idx not in owned:        # shared with a copy (a snapshot being written): copied first
                chunk = chunks[idx] = bytearray(chunk)
                owned.add(idx)
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

    def missing(self, start: int, end: int, most: int) -> list[int]:
        """The offsets in [start, end) not held, in order, at most ``most``: a chunk at a time (a full one passed
        in one look), not an offset at a time."""
        chunks, out = self._chunks, []
        offset = start
        while offset < end and len(out) < most:
            idx = offset >> SHIFT
            base = idx << SHIFT
            stop = min(end, base + CHUNK)
            chunk = chunks.get(idx)
            if chunk is None:
                out.extend(range(offset, min(stop, offset + most - len(out))))
            elif chunk is not FULL:
                value = ~int.from_bytes(chunk, "little") & ((1 << (stop - base)) - 1) & ~((1 << (offset - base)) - 1)
                if value:
                    found = (_positions if value.bit_count() > SPARSE else _set_bits)(value, base)
                    out.extend(found[:most - len(out)])
            offset = stop
        return out

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
                chunks[top] = bytearray(   # a new one: the old may be shared with a copy
                    (int.from_bytes(chunk, "little") & ~((1 << bit) - 1)).to_bytes(CHUNK // 8, "little"))
                self._owned.add(top)
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
        starts, lasts = self._spans()
        for start, last in zip(starts, lasts):
            yield start, last + 1

    def _spans(self, idxs: list[int] | None = None) -> tuple[list[int], list[int]]:
        """The first and the last offset of each run (in the chunks ``idxs``, sorted; None: all), in order, as two
        lists. A chunk of more than SPARSE runs by C loops over its 4,096 bits (format, translate, compress: a
        byte at a time in Python was 5 times the old set's sort, every other offset held); one of fewer a run at a
        time (int bit operations), so a few delivered among thousands waiting cost what is held, not the span."""
        chunks = self._chunks
        if idxs is None:
            idxs = sorted(chunks)
        firsts: list[int] = []
        lasts: list[int] = []
        lone_only = True        # every run one offset: one list for both (to_json: taken as it is)
        for idx in idxs:
            chunk, base = chunks[idx], idx * CHUNK
            if chunk is FULL:
                s, e = [base], [base + CHUNK - 1]
            else:
                value = int.from_bytes(chunk, "little")
                first_bits, last_bits = value & ~(value << 1), value & ~(value >> 1)    # a held bit after / before
                find = _positions if first_bits.bit_count() > SPARSE else _set_bits        # one not held
                s = find(first_bits, base)
                e = s if last_bits == first_bits else find(last_bits, base)             # (all lone)
                if not s:
                    continue
            lone_only = lone_only and e is s
            if lasts and s[0] == lasts[-1] + 1:     # the run goes on over the chunk boundary
                lone_only = False
                lasts[-1] = e[0]
                firsts.extend(s[1:])
                lasts.extend(e[1:])
            else:
                firsts.extend(s)
                lasts.extend(e)
        return (firsts, firsts) if lone_only else (firsts, lasts)

    def __iter__(self):
        for start, end in self.iter_runs():
            yield from range(start, end)

    def __eq__(self, other) -> bool:
        if not isinstance(other, OffsetRuns):
            return NotImplemented
        return list(self.iter_runs()) == list(other.iter_runs())

    def copy(self) -> "OffsetRuns":
        """A copy that shares the bitmaps: each side copies one before it changes it (a dict's copy on the loop;
        copying every 512-byte bitmap was 103 ms for 73k chunks, 20 times main's list of the offsets)."""
        new = OffsetRuns()
        new._chunks, new._counts = dict(self._chunks), dict(self._counts)
        new._count, new._base = self._count, self._base
        self._owned = set()
        return new

    def to_json(self) -> list:
        """Runs and lone offsets, in order; a chunk cut into more than BUSY runs as its bitmap instead."""
        chunks, out, plain = self._chunks, [], []
        for idx in sorted(chunks):
            chunk = chunks[idx]
            if chunk is not FULL:
                value = int.from_bytes(chunk, "little")
                if (value & ~(value << 1)).bit_count() > BUSY:
                    if plain:
                        out += self._items(plain)
                        plain = []
                    out.append(f"{idx * CHUNK}:{b64encode(chunk).decode()}")
                    continue
            plain.append(idx)
        if plain:
            out += self._items(plain)
        return out

    def _items(self, idxs: list[int]) -> list:
        firsts, lasts = self._spans(idxs)
        if firsts is lasts:
            return firsts
        return [f if f == last else [f, last] for f, last in zip(firsts, lasts)]

    @classmethod
    def from_json(cls, items, limit: int | None = None) -> "OffsetRuns":
        """``to_json``'s list, or an old file's list of offsets. ValueError/TypeError for anything else, and for an
        offset at or past ``limit`` (the timer queue's end, None: unchecked). A file without its crc (edited by hand)
        is taken as it reads: a run [0, 10**15] held start-up for ever in ``add_run`` (a step a chunk), and an
        offset past the end marked a timer not written yet as delivered, skipped when it came."""
        new = cls()
        if items is None:
            return new
        if not isinstance(items, list):
            raise TypeError(f"timerDone is a {type(items).__name__}, not a list")
        short: list[tuple[int, int]] = []
        try:
            sum(items)      # all numbers (an old file, or the worst case: no runs): taken as they are, C loops
            lone = items
        except TypeError:   # runs among them
            lone = [t for t in items if type(t) is int]
            for item in items:
                if type(item) is int:
                    continue
                if isinstance(item, list):
                    if len(item) != 2 or int(item[1]) < int(item[0]) or int(item[0]) < 0:
                        raise ValueError(f"timerDone run {item!r} is not [first, last]")
                    first, end = int(item[0]), int(item[1]) + 1
                    _within(end - 1, limit, item)
                    if end - first >= 2 * CHUNK:
                        new.add_run(first, end)         # whole chunks: FULL markers
                    else:
                        short.append((first, end))
                elif isinstance(item, str):
                    new._set_bitmap(item, limit)
                else:
                    lone.append(int(item))
        if lone:
            _within(max(lone), limit, max(lone))
        new._set_many(lone, short)
        return new

    def _set_bitmap(self, item: str, limit: int | None = None) -> None:
        """``"<first>:<base64 of the chunk's bitmap>"``: ``first`` a chunk's first offset."""
        first, colon, data = item.partition(":")
        first = int(first)
        bitmap = b64decode(data, validate=True)
        if not colon or first < 0 or first % CHUNK or len(bitmap) != CHUNK // 8:
            raise ValueError(f"timerDone bitmap {item[:40]!r} is not <chunk's first offset>:<{CHUNK // 8} bytes>")
        value = int.from_bytes(bitmap, "little")
        if value:
            _within(first + value.bit_length() - 1, limit, f"{item[:40]}...")
        self._or_chunk(first >> SHIFT, value)

    def _or_chunk(self, idx: int, piece: int) -> None:
        """Hold the set bits of ``piece`` (a chunk's bitmap as an int) in chunk ``idx``."""
        chunks, counts = self._chunks, self._counts
        old = chunks.get(idx)
        if not piece or old is FULL:
            return
        if old is not None:
            piece |= int.from_bytes(old, "little")
        held = piece.bit_count()
        self._count += held - counts.get(idx, 0)
        if held == CHUNK:
            chunks[idx] = FULL
            counts.pop(idx, None)
        else:
            chunks[idx] = bytearray(piece.to_bytes(CHUNK // 8, "little"))
            counts[idx] = held
            self._owned.add(idx)
        self._base = min(self._base, idx)

    def _set_many(self, lone: list[int], short: list[tuple[int, int]]) -> None:
        """Hold the offsets ``lone`` and the runs ``short`` ([start, end), each under 2 chunks): as 0/1 bytes set by
        C loops (map, slices), made into bitmaps by int(); one by one (``update``) when they are too sparse for
        that to be bounded (16 bytes of flags per item)."""
        if not lone and not short:
            return
        least = min(lone, default=None)
        if least is not None and least < 0:
            raise ValueError(f"timerDone offset {least!r} is negative")
        lo = min(least if least is not None else 1 << 62, min((s for s, _ in short), default=1 << 62)) >> SHIFT
        hi = max(max(lone, default=-1), max((e - 1 for _, e in short), default=-1)) >> SHIFT
        span = (hi - lo + 1) * CHUNK
        if span > 16 * (len(lone) + len(short)) + 16 * CHUNK:
            self.update(lone)
            for start, end in short:
                self.add_run(start, end)
            return
        base = lo * CHUNK
        flags = bytearray(span)
        deque(map(flags.__setitem__, map(sub, lone, repeat(base)), repeat(1)), maxlen=0)
        for start, end in short:
            flags[start - base:end - base] = b"\x01" * (end - start)
        value = int(flags[::-1].translate(_FROM_01), 2)
        bitmap = value.to_bytes(span // 8, "little")
        size = CHUNK // 8
        for k in range(hi - lo + 1):
            self._or_chunk(lo + k, int.from_bytes(bitmap[k * size:(k + 1) * size], "little"))

    def __repr__(self) -> str:
        return f"OffsetRuns({self.to_json()!r})"


class PastTheLog(ValueError):
    """delayOffset.json names a timer offset the timer queue does not reach (yet): see ``from_json``."""


def _within(last: int, limit: int | None, item) -> None:
    """PastTheLog when the offset ``last`` (of ``item``) is at or past ``limit``."""
    if limit is not None and last >= limit:
        raise PastTheLog(f"timerDone {item!r} goes past the timer queue's end {limit} (no timer there is written "
                         "yet: the file was edited, or is not this log's)")


_CHUNK_BITS = "0%db" % CHUNK
_TO_01 = bytes.maketrans(b"01", b"\x00\x01")
_FROM_01 = bytes.maketrans(b"\x00\x01", b"01")


def _positions(value: int, base: int) -> list[int]:
    """``base + i`` for each set bit ``i`` of ``value`` (a chunk's bitmap), in order: C loops over its bits."""
    flags = format(value, _CHUNK_BITS)[::-1].encode().translate(_TO_01)
    return list(compress(range(base, base + CHUNK), flags))


def _set_bits(value: int, base: int) -> list[int]:
    """The same, a set bit at a time: for a few."""
    out = []
    while value:
        low = value & -value
        out.append(base + low.bit_length() - 1)
        value ^= low
    return out
