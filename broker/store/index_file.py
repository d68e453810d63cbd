"""One index file: RocketMQ's IndexFile layout, hash slots and linked entries, read and written with pread/pwrite.

``<store_dir>/index/<yyyyMMddHHmmssSSS>`` (the creation time, as RocketMQ names them), big-endian:

    offset                  size          field
    0                       8             BEGIN TIMESTAMP   store time of the first entry (ms)
    8                       8             END TIMESTAMP     store time of the last entry (never below BEGIN or
                                                              an earlier batch's: see put_many)
    16                      8             BEGIN PHYOFFSET   commit-log offset of the first entry's record
    24                      8             END PHYOFFSET     commit-log offset of the last entry's record
    32                      4             HASH SLOT COUNT   slots in use
    36                      4             INDEX COUNT       next entry number; entries are 1..COUNT-1 (0 is unused)
    40                      4 * SLOTS     SLOT[i]           newest entry whose key hash % SLOTS == i (0: none)
    40 + 4*SLOTS            20 * ENTRIES  ENTRY[n]:
                                            0  4  KEY HASH   abs(Java String.hashCode("topic#key")), 0 for MIN_VALUE
                                            4  8  PHYOFFSET  the record's commit-log offset
                                            12 4  TIME DIFF  (store time - BEGIN TIMESTAMP) / 1000, seconds
                                            16 4  PREV       the entry this one replaced in its slot (0: none)

SLOTS and ENTRIES are RocketMQ's maxHashSlotNum (5,000,000) and maxIndexNum (20,000,000) by
default: a 420,000,040-byte sparse file, of which only the touched pages take disk space.

Unlike RocketMQ, the file is not mapped: a pwrite that meets a full disk fails with ENOSPC,
where a store into an unbacked mapped page would kill the process with SIGBUS. Each batch is
written in a fixed order -- its entries, then the slots, then the header -- so a process
killed mid-batch leaves entries past INDEX COUNT and slots that may point at them.
``open`` undoes exactly that: walking the entries past COUNT from the newest down, a slot
that names one is set back to the entry's PREV (the value it replaced), and the entries are
zeroed. The file is then the one its header describes, and the records of the lost batch
are indexed again from the commit log (index.py). A header that cannot be right (size,
counts, offsets) is reported as IndexCorrupt; the caller rebuilds.
"""
from __future__ import annotations

import errno
import itertools
import mmap
import operator
import os
import struct

HEADER = struct.Struct(">qqqqii")
HEADER_SIZE = 40
SLOT = struct.Struct(">i")
ENTRY = struct.Struct(">iqii")
ENTRY_SIZE = 20
MAX_BATCH = 1024            # entries per header update: bounds what open() may have to undo
_INT_MAX = 0x7FFFFFFF
_SECOND = 1000              # an entry's TIME DIFF is in seconds
TIME = operator.itemgetter(2)     # an entry's (key hash, offset, store time): its store time
# How far an entry's store time may be below the newest before it in its file (index.py starts a new file for one
# further below: the clock stepped back). A key's walk, newest first, reads on this far below its range: it stopped
# at the first entry older than the range, and missed the entries stored in it before the clock stepped back.
BACK_STEP_MS = 60_000


def _pwrite_all(fd: int, data, at: int, path: str) -> None:
    """pwrite all of ``data``. A full disk part-way returns the bytes that fit, with no error (write(2)): a
    batch cut short was counted whole, its entries zeros the slots named (keys lost, and each slot's older
    entries cut off behind them). The rest is written, and the error that stopped it raised."""
    view = memoryview(data)
    done = os.pwrite(fd, view, at)
    while done < len(view):
        n = os.pwrite(fd, view[done:], at + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, f"index entries written {done} of {len(view)} bytes", path)
        done += n


class IndexCorrupt(Exception):
    """The file cannot be the index it claims to be; the text says why."""


_M32 = 0xFFFFFFFF
_POW_CHUNK = 64
_POW_MAX = 1024
_POW = [1]                  # 31**k mod 2**32, k <= _POW_MAX
for _ in range(_POW_MAX):
    _POW.append(_POW[-1] * 31 & _M32)
_WEIGHTS = tuple(tuple(reversed(_POW[:n])) for n in range(_POW_CHUNK + 1))    # [n]: 31**(n-1) .. 31**0
_mul = operator.mul


def java_hash(units) -> int:
    """Java's String.hashCode over UTF-16 code units (ints, or bytes when every unit is ASCII), as an
    unsigned 32-bit value: sum(u[i] * 31**(n-1-i)) mod 2**32, a chunk of up to 64 units per step in C
    (sum of map) instead of a Python step per unit (1.87 -> 1.25 us for a 43-character key)."""
    n = len(units)
    if n <= _POW_CHUNK:
        return sum(map(_mul, units, _WEIGHTS[n])) & _M32
    h = 0
    for i in range(0, n, _POW_CHUNK):
        part = units[i:i + _POW_CHUNK]
        h = (h * _POW[len(part)] + sum(map(_mul, part, _WEIGHTS[len(part)]))) & _M32
    return h


def string_hash(text: str) -> int:
    """String.hashCode of ``text`` (UTF-16 code units, surrogate pairs as two), unsigned 32-bit."""
    if text.isascii():
        return java_hash(text.encode("ascii"))
    data = text.encode("utf-16-be", "surrogatepass")
    return java_hash(struct.unpack(f">{len(data) // 2}H", data))


def extend_hash(h: int, units) -> int:
    """hashCode(a + b) from h = hashCode(a) (unsigned) and b's units: h * 31**len(b) + hashCode(b)."""
    return (h * pow31(len(units)) + java_hash(units)) & _M32


def pow31(n: int) -> int:
    """31**n mod 2**32."""
    return _POW[n] if n < len(_POW) else pow(31, n, 1 << 32)


def index_hash(h: int) -> int:
    """IndexFile.indexKeyHashMethod of an unsigned hashCode: abs of the int, Integer.MIN_VALUE -> 0."""
    if h & 0x80000000:
        return (0x100000000 - h) & _INT_MAX
    return h


def key_hash(key: str) -> int:
    """IndexFile.indexKeyHashMethod: abs(String.hashCode), with Integer.MIN_VALUE mapped to 0."""
    return index_hash(string_hash(key))


_TAIL = 12          # a key's last characters, hashed each time; what precedes them is cached
_W_TAIL = _WEIGHTS[_TAIL]
_HEADS_MAX = 4096   # cached heads before the cache starts over
_TOPICS_MAX = 4096


class KeyHasher:
    """abs(String.hashCode("topic#key")) of the keys of stored records, from their bytes.

    hashCode(a + b) = hashCode(a) * 31**len(b) + hashCode(b) (mod 2**32), so the ``topic#`` part is
    hashed once per topic, and a long key's head (all but its last 12 characters: a UNIQ_KEY's
    producer address, pid and class-loader parts, the same for every message of a producer) once
    per head; only the tail is hashed per key. An ASCII key's bytes are its UTF-16 code units;
    any other key is decoded and hashed by its code units (as Java does)."""

    def __init__(self):
        self.topics: dict[bytes, int] = {}
        self.heads: dict[bytes, int] = {}      # head -> hashCode(head) * 31**_TAIL

    def topic(self, raw: bytes) -> int:
        """The unsigned hashCode of ``topic#`` for a record's topic bytes (UTF-8, decoded as record_keys does)."""
        got = self.topics.get(raw)
        if got is None:
            if len(self.topics) >= _TOPICS_MAX:
                self.topics.clear()
            got = self.topics[raw] = string_hash(raw.decode("utf-8", "replace") + "#")
        return got

    def key(self, th: int, key: bytes) -> int:
        """The index hash of ``topic#key``, th the topic's from topic(); ``key`` as stored (UTF-8)."""
        n = len(key)
        if _TAIL + 4 < n <= _POW_MAX and key.isascii():
            head = key[:-_TAIL]
            hh = self.heads.get(head)
            if hh is None:
                if len(self.heads) >= _HEADS_MAX:
                    self.heads.clear()
                hh = self.heads[head] = java_hash(head) * _POW[_TAIL] & _M32
            h = (th * _POW[n] + hh + sum(map(_mul, key[-_TAIL:], _W_TAIL))) & _M32
        elif n <= _POW_CHUNK and key.isascii():
            h = (th * _POW[n] + sum(map(_mul, key, _WEIGHTS[n]))) & _M32
        elif key.isascii():
            h = extend_hash(th, key)
        else:
            data = key.decode("utf-8", "replace").encode("utf-16-be", "surrogatepass")
            h = extend_hash(th, struct.unpack(f">{len(data) // 2}H", data))
        return (0x100000000 - h) & _INT_MAX if h & 0x80000000 else h


def file_size(slots: int, entries: int) -> int:
    return HEADER_SIZE + 4 * slots + ENTRY_SIZE * entries


class WalkBudget:
    """Index entries a query may still read (IndexFile.walk), over all its files, and whether it ran out."""
    __slots__ = ("reads", "cut")

    def __init__(self, reads: int):
        self.reads, self.cut = reads, False


class IndexFile:
    def __init__(self, path: str, fd: int, slots: int, entries: int, room_ratio: float = 1.0, headroom: int = 0):
        self.path = path
        self.room_ratio = room_ratio    # the slot table is allocated only if the disk stays below this full ...
        self.headroom = headroom        # ... with this many bytes more (the commit log's next segment) in it
        self.name = os.path.basename(path)
        self.fd = fd
        self._parked = False                # fd closed by park(): reopened (read-only) by the next read
        self.read_only = False              # could be opened read-only only (EACCES: root's): searched, never written
        self.slots = slots
        self.entries = entries
        self.begin_ts = self.end_ts = self.begin_phy = self.end_phy = 0
        self.slot_count = 0
        self.count = 1
        self._entry_base = HEADER_SIZE + 4 * slots
        self._mem: mmap.mmap | None = None  # header and slot table of the file being written, mapped

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, path: str, slots: int, entries: int, end_phy: int = 0, end_ts: int = 0,
               room_ratio: float = 1.0, headroom: int = 0) -> "IndexFile":
        """A new sparse file; like RocketMQ, it starts where the previous file ended."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, file_size(slots, entries))
            f = cls(path, fd, slots, entries, room_ratio, headroom)
            if end_phy > 0:
                f.begin_phy = f.end_phy = end_phy
            if end_ts > 0:
                f.begin_ts = f.end_ts = end_ts
            f._write_header()
        except BaseException:
            os.close(fd)
            raise
        return f

    @classmethod
    def open(cls, path: str, slots: int, entries: int, room_ratio: float = 1.0, headroom: int = 0) -> "IndexFile":
        """Load and check a file; undo a batch a crash cut short. IndexCorrupt when it cannot be right."""
        read_only = False
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError:
            # Readable, not writable (a broker once run as root left it root's, mode 0644): taken for unreadable,
            # indexing stopped for good. Read-only it is searched as before and never written (``full``: the next
            # entry goes to a new file). Raised if it cannot be read either.
            fd, read_only = os.open(path, os.O_RDONLY | os.O_CLOEXEC), True
        try:
            f = cls(path, fd, slots, entries, room_ratio, headroom)
            f.read_only = read_only
            f._load()
            f.undo_unfinished()
        except BaseException:
            os.close(fd)
            raise
        return f

    def close(self) -> None:
        self._parked = False
        self.release_slots()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def park(self) -> None:
        """Close the descriptor of a file no longer written (its header is held here); a read opens it again.
        Open for as long as each file existed, one descriptor a file: ~86 files a day at 10k sends/s of two keys,
        ~2,600 over 30 days of retention, beside the segments' and the connections' under one open-files limit."""
        if self.fd >= 0:                # (fd closed: its slot table was released with it)
            self.close()
            self._parked = True

    @property
    def parked(self) -> bool:
        return self._parked

    def reopen(self) -> int:
        """The descriptor, opened again (read-only) if park() closed it."""
        if self._parked:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            self._parked = False
        return self.fd

    def remove(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def sync(self) -> None:
        os.fsync(self.fd)

    def _load(self) -> None:
        expected = file_size(self.slots, self.entries)
        size = os.fstat(self.fd).st_size
        if size != expected:
            raise IndexCorrupt(f"{size} bytes, not {expected} for {self.slots} slots and {self.entries} entries "
                               "(were index_hash_slots / index_max_entries changed?)")
        raw = os.pread(self.fd, HEADER_SIZE, 0)
        if len(raw) != HEADER_SIZE:
            raise IndexCorrupt("header cut short")
        (self.begin_ts, self.end_ts, self.begin_phy, self.end_phy, self.slot_count, count) = HEADER.unpack(raw)
        self.count = max(count, 1)
        why = None
        if count > self.entries:
            why = f"index count {count} exceeds the file's {self.entries} entries"
        elif not 0 <= self.slot_count <= min(self.slots, max(self.count - 1, 0)):
            why = f"hash slot count {self.slot_count} is impossible with {self.count - 1} entries"
        elif self.begin_phy < 0 or self.end_phy < self.begin_phy:
            why = f"offsets {self.begin_phy}..{self.end_phy} are not a range"
        elif self.begin_ts < 0:
            why = f"begin timestamp {self.begin_ts} is negative"
        elif self.end_ts < self.begin_ts:
            # The version before wrote the last entry's store time, below the begin after a clock stepped back:
            # not damage. Its end is taken from the last entry (whole seconds from the begin: to the second's end).
            last = os.pread(self.fd, ENTRY_SIZE, self._entry_base + (self.count - 1) * ENTRY_SIZE)
            diff = ENTRY.unpack(last)[2] if self.count > 1 and len(last) == ENTRY_SIZE else 0
            self.end_ts = self.begin_ts + max(diff, 0) * _SECOND + _SECOND - 1
        if why:
            raise IndexCorrupt(why)

    def undo_unfinished(self) -> int:
        """Roll back entries written past COUNT by a batch that never reached its header; returns how many."""
        lo = self.count
        n = min(MAX_BATCH, self.entries - lo)
        if n <= 0:
            return 0
        raw = os.pread(self.fd, n * ENTRY_SIZE, self._entry_base + lo * ENTRY_SIZE)
        written = [i for i in range(len(raw) // ENTRY_SIZE) if any(raw[i * ENTRY_SIZE:(i + 1) * ENTRY_SIZE])]
        if not written:
            return 0
        if self.read_only:      # (its descriptor would refuse the writes: EBADF, said as nothing of the kind)
            raise PermissionError(errno.EACCES, "opened read-only, it holds entries a crash left unfinished to undo",
                                  self.path)
        for i in reversed(range(written[-1] + 1)):
            h, _phy, _td, prev = ENTRY.unpack_from(raw, i * ENTRY_SIZE)
            slot = h % self.slots
            if self._slot(slot) == lo + i:
                self._set_slot(slot, prev)
        os.pwrite(self.fd, bytes((written[-1] + 1) * ENTRY_SIZE), self._entry_base + lo * ENTRY_SIZE)
        return len(written)

    # ------------------------------------------------------------ writes
    @property
    def full(self) -> bool:
        return self.count >= self.entries or self.read_only

    @property
    def room(self) -> int:
        return 0 if self.read_only else max(0, self.entries - self.count)

    def put_many(self, items: list[tuple[int, int, int]]) -> int:
        """Add (key hash, commit-log offset, store time) entries, in order, as far as the file has room
        (at most MAX_BATCH); returns how many were added. Blocking: the index thread's work."""
        n = min(len(items), self.room, MAX_BATCH)
        if n <= 0:
            return 0
        self.cache_slots()
        mem, nslots = self._mem, self.slots
        read_slot, write_slot, pack = SLOT.unpack_from, SLOT.pack_into, ENTRY.pack_into
        slots: dict[int, int] = {}
        out = bytearray(n * ENTRY_SIZE)
        count = first = self.count
        begin_ts, slot_count = self.begin_ts, self.slot_count
        if count <= 1:                  # the file's first entry fixes its begin (RocketMQ sets it just after)
            self.begin_phy, begin_ts = items[0][1], items[0][2]
        at, newest = 0, items[0][2]
        for i in range(n):
            h, phy, ts = items[i]
            if ts > newest:
                newest = ts
            slot = h % nslots
            value = slots.get(slot)
            if value is None:
                value = read_slot(mem, HEADER_SIZE + 4 * slot)[0]
                if value <= 0 or value >= first:    # invalid, or left by a batch a crash cut short
                    value = 0
                    slot_count += 1
            if begin_ts > 0:
                diff = (ts - begin_ts) // 1000
                if diff < 0:
                    diff = 0
                elif diff > _INT_MAX:
                    diff = _INT_MAX
            else:
                diff = 0
            pack(out, at, h, phy, diff, value)
            at += ENTRY_SIZE
            slots[slot] = count
            count += 1
        _pwrite_all(self.fd, out, self._entry_base + first * ENTRY_SIZE, self.path)
        for slot, value in slots.items():
            write_slot(mem, HEADER_SIZE + 4 * slot, value)
        last = items[n - 1]
        # The newest of the batch (a batch's last record may be one stored after the clock stepped back: END set to
        # it, a query for the ones before found the file out of its range), never below the begin or the end it
        # had: one stepped back made END < BEGIN, a header every later start took for damage (all files rebuilt).
        end_ts = max(newest, begin_ts if first <= 1 else self.end_ts)
        self.count, self.begin_ts, self.end_phy, self.end_ts = count, begin_ts, last[1], end_ts
        self.slot_count = slot_count
        self._write_header()
        return n

    def _write_header(self) -> None:
        fields = (self.begin_ts, self.end_ts, self.begin_phy, self.end_phy, self.slot_count, self.count)
        if self._mem is not None:
            HEADER.pack_into(self._mem, 0, *fields)
        else:
            os.pwrite(self.fd, HEADER.pack(*fields), 0)

    def _slot(self, slot: int) -> int:
        if self._mem is not None:
            return SLOT.unpack_from(self._mem, HEADER_SIZE + 4 * slot)[0]
        return SLOT.unpack(os.pread(self.reopen(), 4, HEADER_SIZE + 4 * slot))[0]

    def _set_slot(self, slot: int, value: int) -> None:
        if self._mem is not None:
            SLOT.pack_into(self._mem, HEADER_SIZE + 4 * slot, value)
        else:
            os.pwrite(self.fd, SLOT.pack(value), HEADER_SIZE + 4 * slot)

    def tail_hashes(self, phy: int, look_back: int = 256) -> set[int]:
        """Key hashes of the newest entries that point at the record at ``phy`` (what of it is indexed)."""
        n = min(self.count - 1, look_back)
        if n <= 0:
            return set()
        first = self.count - n
        raw = os.pread(self.reopen(), n * ENTRY_SIZE, self._entry_base + first * ENTRY_SIZE)
        out = set()
        for i in range(len(raw) // ENTRY_SIZE):
            h, p, _diff, _prev = ENTRY.unpack_from(raw, i * ENTRY_SIZE)
            if p == phy:
                out.add(h)
        return out

    def cache_slots(self) -> None:
        """Map the slot table of the file being written, its blocks allocated first.

        A pread and a pwrite per key were two system calls, and two GIL hand-offs, per key indexed: a
        third of the broker's CPU per send. Stores into the mapping cost neither; the blocks are
        allocated before it is mapped, so a full disk is ENOSPC here (the index stops, loudly), never a
        SIGBUS later. ``sync`` (fsync) makes the mapped slots durable with the rest of the file."""
        if self._mem is not None:
            return
        self._check_room()
        os.posix_fallocate(self.fd, 0, self._entry_base)
        self._mem = mmap.mmap(self.fd, self._entry_base)

    def _check_room(self) -> None:
        """ENOSPC, allocating nothing, when the slot table's blocks not yet allocated would take the disk to
        ``room_ratio`` (the lower of the store's refuse and force-clean ratios): 20 MB at once took a 48 MiB
        disk from 50% to 92%, and the store
        refused every send for the table of its derived index. Indexing stops as on a full disk and resumes once
        there is room (index.py). The room is counted with ``headroom`` more used: a table that took the disk to
        just below the ratio (84.9%) left none for the commit log, whose next segment (made at the next start)
        took it to 93% and retention removed two young segments of acknowledged messages."""
        if self.room_ratio >= 1.0:
            return
        need = self._entry_base - os.fstat(self.fd).st_blocks * 512     # (what is allocated of the file: enough)
        if need <= 0:
            return
        st = os.fstatvfs(self.fd)
        used, avail = (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_bavail * st.f_frsize
        total = used + avail
        if total <= 0 or used + need + self.headroom >= self.room_ratio * total:
            raise OSError(errno.ENOSPC, f"the index's slot table needs {need / 2**20:.1f} MiB, which would take the "
                          f"disk from {used / max(total, 1):.0%} to {(used + need) / max(total, 1):.0%} full, "
                          f"{(used + need + self.headroom) / max(total, 1):.0%} with the commit log's next segment, "
                          f"past {self.room_ratio:.0%} (the lower of disk_refuse_ratio and disk_force_clean_ratio): "
                          "not allocated, the room left to the commit log", self.path)

    def release_slots(self) -> None:
        if self._mem is not None:
            self._mem.close()
            self._mem = None

    # ------------------------------------------------------------ reads
    def time_matched(self, begin: int, end: int) -> bool:
        """IndexFile.isTimeMatched."""
        b, e = self.begin_ts, self.end_ts
        return (begin < b and end > e) or b <= begin <= e or b <= end <= e

    def select(self, h: int, begin: int, end: int, limit: int = 1 << 30) -> list[int]:
        """Commit-log offsets of the entries with key hash ``h`` that may have been stored in [begin, end],
        newest first (IndexFile.selectPhyOffset), at most ``limit``. An entry holds its store time in whole
        seconds from the file's BEGIN TIMESTAMP, so one stored up to 999 ms either side of the range may be
        included, and so are entries of other keys with the same hash: the caller checks each record's key
        and store time."""
        return list(itertools.islice(self.walk(h, begin, end), limit))

    def walk(self, h: int, begin: int, end: int, budget: "WalkBudget | None" = None):
        """select's offsets one at a time, as far as the caller reads: a caller that checks each record's
        key reads on past the other keys of the hash (a cap counted in entries returned, not in matches,
        answered a key NOT FOUND behind 80 newer entries of a key whose hashCode equals its own). With a
        ``budget``, each entry read (of any hash, in the range or not) spends one of its reads; spent, the walk
        stops with ``budget.cut`` set."""
        count = self.count
        at = self._slot(h % self.slots)
        if at <= 0 or at >= count or count <= 1:
            return
        seen = 0
        while seen < count:
            if budget is not None:
                if budget.reads <= 0:
                    budget.cut = True
                    return
                budget.reads -= 1
            seen += 1
            raw = os.pread(self.reopen(), ENTRY_SIZE, self._entry_base + at * ENTRY_SIZE)
            if len(raw) != ENTRY_SIZE:
                return
            hr, phy, diff, prev = ENTRY.unpack(raw)
            if diff < 0:
                return
            t = self.begin_ts + diff * 1000         # the record was stored in [t, t + 999]
            if hr == h and t <= end and t + _SECOND > begin:
                yield phy
            if prev <= 0 or prev >= count or prev == at or t + _SECOND + BACK_STEP_MS <= begin:
                return
            at = prev

    def __repr__(self) -> str:
        return (f"IndexFile({self.name}, entries 1..{self.count - 1}, offsets {self.begin_phy}..{self.end_phy}, "
                f"times {self.begin_ts}..{self.end_ts})")
