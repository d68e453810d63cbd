"""Java's Integer.parseInt / Long.parseLong, for the values a stock client's broker reads so: DELAY and timer
properties (schedule.levels), a selector's String compared with a number (sql92). One copy: sql92's own skipped only
ASCII zeros past 20 digits, where parseInt (and this) skip any Character.digit zero."""
from __future__ import annotations

import re
import unicodedata

_JAVA_INT = re.compile(r"[+-]?\d+")     # a sign, Unicode digits (Character.digit); no spaces, no "_"
_RANGE = {32: (-(1 << 31), 1 << 31), 64: (-(1 << 63), 1 << 63)}


def java_int(text: str, bits: int) -> int | str:
    """``text`` read as Java's Integer.parseInt (``bits`` 32) or Long.parseLong (64) reads it, or why it throws.
    Python's int() also takes " 3", "1_000" and any size: a value RocketMQ refuses was taken."""
    if not (text.isascii() and text.isdigit()) and not _JAVA_INT.fullmatch(text):     # the first: the usual case
        return "is not a whole number"
    if len(text) > 20:
        # int() refuses past 4,300 digits (a ValueError out of a send or a pull: SYSTEM_ERROR); no long has over 19
        # but leading zeros, which parseInt skips (any Unicode zero: \d)
        sign = text[0] if text[0] in "+-" else ""
        digits = text[len(sign):]
        if not digits.isascii():
            digits = "".join(str(unicodedata.decimal(c)) for c in digits)
        text = sign + (digits.lstrip("0") or "0")
        if len(text) > 20:
            return f"is past Java's {'int' if bits == 32 else 'long'} range"
    value = int(text)
    low, high = _RANGE[bits]
    if low <= value < high:
        return value
    return f"is past Java's {'int' if bits == 32 else 'long'} range"
