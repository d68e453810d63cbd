"""An expiry plan read from its file without holding its halves: the admin's ``apply-expiry`` of a big plan.

``json.load`` of a plan listing 1,000,000 halves (a 191 MB file) took 972 MB of the admin's memory, 10,000,000
halves some 10 GB (the host's OOM killer, nothing applied). Here the file's top-level object is read value by value,
the members of its "halves" list one at a time: a first pass checks them, then the admin reads them again from the
same open file (from its start) to count the parts and once more to hand them out a part at a time. A plan is
written whole by one rename, so the file open is the one checked; one written over in place meanwhile is
PlanChanged. The values are those json.load gives, whatever the reads cut (of a key given twice, the last).
"""
from __future__ import annotations

import json
import os

CHUNK = 64 * 1024         # read at a time (a value longer than it: the buffer grows to hold it)

_decoder = json.JSONDecoder()
_WS = " \t\n\r"
_CUT = 16               # characters from its end within which an error may be the buffer cutting a value
_LISTED = object()      # (scan: the value of a "halves" that is a list, its members counted, not kept)


class _Reader:
    """JSON values read one at a time from a text file, the buffer holding about one value (and a chunk)."""

    def __init__(self, fh, check=None):
        self.fh, self.buf, self.pos, self.eof, self.check = fh, "", 0, False, check
        self.done = 0           # characters before buf, for error positions

    def _fill(self) -> None:
        if self.check is not None:
            self.check()
        more = self.fh.read(max(CHUNK, len(self.buf) - self.pos))
        self.done += self.pos
        self.buf, self.pos = self.buf[self.pos:] + more, 0
        self.eof = not more

    def peek(self) -> str:
        """The next character not white space ('' at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.buf) or self.eof:
                return self.buf[self.pos:self.pos + 1]
            self._fill()

    def take(self, allowed: str) -> str:
        ch = self.peek()
        if not ch or ch not in allowed:
            raise ValueError(f"expected {' or '.join(repr(c) for c in allowed)} at character {self.done + self.pos}, "
                             f"found {ch or 'the end of the file'!r}")
        self.pos += 1
        return ch

    def value(self):
        self.peek()
        while True:
            try:
                val, end = _decoder.raw_decode(self.buf, self.pos)
            except RecursionError:      # (a value of lists or objects thousands deep: a traceback, not an answer)
                raise ValueError(f"a value nested too deep to read at character {self.done + self.pos}") from None
            except json.JSONDecodeError as exc:
                # Read on only when the value may be cut by the buffer's end: an error elsewhere is in the file (a
                # big plan wrong near its start was read whole into the buffer first, 2.7 times its size).
                if self.eof or not (exc.pos >= len(self.buf) - _CUT or exc.msg.startswith("Unterminated string")):
                    raise ValueError(f"{exc.msg} at character {self.done + exc.pos}") from None
                self._fill()
                continue
            if len(self.buf) - end < 3 and not self.eof:
                # A number may go on in the next chunk: "1." or "1e+" read as 1, the rest left as not JSON.
                self._fill()
                continue
            self.pos = end
            return val

    def members(self, on_list):
        """The top-level object's (key, value) pairs; a value that is a list is given to ``on_list(key, items)``
        (``items`` yields its members one at a time; what it returns is the value)."""
        self.take("{")
        if self.peek() == "}":
            self.pos += 1
        else:
            while True:
                key = self.value()
                if not isinstance(key, str):
                    raise ValueError(f"a key is not a string at character {self.done + self.pos}")
                self.take(":")
                if self.peek() == "[" and on_list is not None:
                    yield key, on_list(key, self._items())
                else:
                    yield key, self.value()
                if self.take(",}") == "}":
                    break
        if self.peek():
            raise ValueError(f"extra data at character {self.done + self.pos}")

    def _items(self):
        self.take("[")
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            yield self.value()
            if self.take(",]") == "]":
                return


class PlanChanged(ValueError):
    """The plan file read again is not the one first read: written over in place (not renamed over) meanwhile."""


def _drain(items) -> None:
    for _ in items:
        pass


class PlanFile:
    """A plan file: ``scan()`` reads it once, the halves replaced by their count; ``halves()`` reads them again.
    Of a key given twice the last counts, as json.load's (the halves of an earlier "halves" are read, not sent)."""

    def __init__(self, path: str):
        self.path = path
        self.fh = open(path, encoding="utf-8-sig")       # (as json.load finds it)

    def close(self) -> None:
        self.fh.close()

    def _stat(self) -> tuple:
        st = os.fstat(self.fh.fileno())
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def scan(self, on_halves=None) -> dict:
        """The plan's top-level object, its "halves" (when a list) left out: ``self.count`` of them, each an object
        or ``self.not_object`` set (the admin refuses the plan as the broker would). ``on_halves()``, when given,
        is called as a "halves" list begins (``self.head`` then holds the members before it) and returns the
        function each of its members is given to (a plan with "halves" twice: the last list is the plan's, as
        json.load's; each list's call starts afresh). Raises ValueError."""
        self.count, self.not_object, self.listed, self._nth = 0, False, False, 0
        lists = 0

        def on_list(key, items):
            nonlocal lists
            if key != "halves":
                return list(items)
            lists += 1
            count, not_object = 0, False
            each = on_halves() if on_halves is not None else None
            for half in items:
                count += 1
                not_object = not_object or not isinstance(half, dict)
                if each is not None:
                    each(half)
            self.count, self.not_object, self._nth = count, not_object, lists
            return _LISTED

        self.fh.seek(0)
        self.stat = self._stat()
        self.head = {}
        for key, value in _Reader(self.fh).members(on_list):
            self.head[key] = value
        self.listed = self.head.get("halves") is _LISTED
        if self.listed:
            self.head["halves"] = None
        return self.head

    def halves(self):
        """The plan's halves again, one at a time, in order. Raises PlanChanged when the file is not the one
        scanned (its size or times another, before any read, its halves' count another, or no longer JSON)."""
        self.fh.seek(0)
        found, lists, count = [], 0, 0

        def on_list(key, items):
            nonlocal lists
            if key == "halves":
                lists += 1
                if lists == self._nth:
                    found.append(items)
                    return None
            _drain(items)
            return None

        try:
            for _ in _Reader(self.fh, self._same).members(on_list):
                while found:
                    for half in found.pop():
                        count += 1
                        yield half
        except PlanChanged:
            raise
        except ValueError as exc:
            raise PlanChanged(f"no longer JSON ({exc})") from None
        self._same()
        if count != self.count:
            raise PlanChanged(f"{count} halves read again, {self.count} first")

    def _same(self) -> None:
        """(Before each read of the file again.)"""
        if self._stat() != self.stat:
            raise PlanChanged("its size or modification time is not what it was when first read")
