"""libfaketime for a broker process that lives in the past (scripts/test.sh installs `faketime`)."""
from __future__ import annotations

import glob

LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
                               + glob.glob("/usr/lib/faketime/libfaketime.so.1"))), None)
SKIP_REASON = "libfaketime is not installed (apt-get install faketime; scripts/test.sh does)"


def past_env(offset: str = "-80h") -> dict:
    """Environment for a child process whose wall clock is ``offset`` away; monotonic time stays real
    (asyncio's timers and timeouts keep working)."""
    return {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1"}


def stepped_env(offset_file) -> dict:
    """Environment for a child process whose wall clock is offset by what ``offset_file`` says (``+0``,
    ``-1h``, ``+90m``), read on every call: rewriting the file steps the running process's clock, as NTP
    does; monotonic time stays real."""
    return {"LD_PRELOAD": LIBFAKETIME, "FAKETIME_TIMESTAMP_FILE": str(offset_file),
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}
