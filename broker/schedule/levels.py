"""Delay levels and timer times: the pure part of scheduling (no I/O, no clock of its own).

RocketMQ 4.x (ScheduleMessageService.parseDelayLevel): ``message_delay_level`` is a
space-separated list, level n (from 1) is the n-th entry, each a number and a unit
``s`` ``m`` ``h`` ``d``; txmq also accepts ``ms`` (for tests that must not sleep).
A message with DELAY = n > 0 is stored in SCHEDULE_TOPIC_XXXX queue n-1 (n clamped to
the last level, as CommitLog.asyncPutMessage does), with REAL_TOPIC / REAL_QID naming
where it goes; its consume-queue tagsCode is its delivery time, store time + delay.

RocketMQ 5 timer messages (HookUtils.transformTimerMessage): TIMER_DELAY_SEC, else
TIMER_DELAY_MS (both from now), else TIMER_DELIVER_MS (absolute ms) give the delivery
time, and Aliyun's __STARTDELIVERTIME (absolute ms, as ali-ons' setStartDeliverTime sets it) after them;
a value that does not parse, or a time more than ``timer_max_delay_ms`` ahead,
is refused; a time already past is sent at once; a DELAY level wins over them (they
are dropped). A timer message is stored in rmq_sys_wheel_timer queue 0 with
TIMER_OUT_MS = its delivery time, which is also its tagsCode.
"""
from __future__ import annotations

from typing import NamedTuple

from protocol.codes import SysFlag
from protocol.message import TIMER_PROPS, Prop

from ..javanum import java_int
from ..topics import SCHEDULE_TOPIC, TIMER_TOPIC

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
TIMER_DELIVER_MS = "TIMER_DELIVER_MS"
TIMER_DELAY_SEC = "TIMER_DELAY_SEC"
TIMER_DELAY_MS = "TIMER_DELAY_MS"
TIMER_OUT_MS = "TIMER_OUT_MS"

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_delay_levels(text: str) -> tuple[int, ...]:
    """``"1s 5s 2m"`` -> (1000, 5000, 120000): the delay of level n is element n-1. ValueError names the
    bad entry."""
    out = []
    for entry in text.split():
        unit = "ms" if entry.endswith("ms") else entry[-1:]
        number = entry[:-len(unit)]
        if unit not in _UNITS_MS or not number.isdigit():
            raise ValueError(f"delay level {len(out) + 1} {entry!r}: write a whole number and a unit "
                             f"(ms, s, m, h, d), as in '1s 5s 10s 30s 1m'")
        out.append(int(number) * _UNITS_MS[unit])
    if not out:
        raise ValueError("no delay levels: give at least one, as in '1s 5s 10s 30s 1m'")
    return tuple(out)


class Diverted(NamedTuple):
    """Where a message that must wait is stored instead of its topic."""

    topic: str              # SCHEDULE_TOPIC or TIMER_TOPIC
    queue_id: int
    delay_ms: int           # level messages: store time + this is the delivery time; -1 for timers
    tags_code: int          # timers: the delivery time; level messages: 0 (the store fills it in)


class DelayLevels:
    """The level table and the rules that send a message to wait."""

    def __init__(self, text: str, timer_max_delay_ms: int = 3 * 86_400_000, retention_ms: int | None = None):
        self.delays_ms = parse_delay_levels(text)
        self.timer_max_delay_ms = timer_max_delay_ms
        self.timer_limit = "timer_max_delay_s"
        # A waiting message's record must outlive its wait: retention removes a segment whose newest record is
        # older than file_reserved_hours, waiting messages in it or not. A timer accepted for later than that was
        # SEND_OK and then, with the disk above disk_clean_ratio, removed before its time.
        if retention_ms is not None and retention_ms < timer_max_delay_ms:
            self.timer_max_delay_ms = retention_ms
            self.timer_limit = "file_reserved_hours: retention would remove it before its time"

    @property
    def max_level(self) -> int:
        return len(self.delays_ms)

    def clamp(self, level: int) -> int:
        return min(level, self.max_level)

    def delay_ms(self, level: int) -> int:
        """The delay of ``level`` (clamped to the table; RocketMQ's 1 s for a level it does not know)."""
        if level < 1:
            return 1000
        return self.delays_ms[self.clamp(level) - 1]

    def deliver_at(self, level: int, store_ts: int) -> int:
        """ScheduleMessageService.computeDeliverTimestamp."""
        return store_ts + self.delay_ms(level)

    @staticmethod
    def corrected(deliver_ms: int, now: int, delay_ms: int) -> int:
        """RocketMQ's correctDeliverTimestamp: a time further ahead than the level's whole delay (the clock
        went back, or the table shrank) means deliver now."""
        return now if deliver_ms > now + delay_ms else deliver_ms

    def divert(self, topic: str, queue_id: int, props: dict, sys_flag: int, now: int) -> Diverted | str | None:
        """Rewrite ``props`` (in place) for a message that must wait, and say where it goes; None: it
        goes to ``topic`` now; a string: why it is refused (MESSAGE_ILLEGAL).

        Only NOT and COMMIT transaction types wait (a half waits only once committed). A DELAY that
        Integer.parseInt does not take (empty, spaces, past Java's int range) is refused."""
        if Prop.DELAY not in props and props.keys().isdisjoint(TIMER_PROPS):
            return None         # the common case, first: nothing asks to wait
        if SysFlag.transaction_type(sys_flag) not in (SysFlag.TRANSACTION_NOT_TYPE, SysFlag.TRANSACTION_COMMIT):
            return None
        level = 0
        if Prop.DELAY in props:
            # RocketMQ's getDelayTimeLevel (Integer.parseInt) throws on it and the send fails; taken as no delay
            # (or " 3" as 3, "9999999999" as the last level), the message was SEND_OK.
            level = java_int(props[Prop.DELAY], 32)
            if isinstance(level, str):
                return f"delay level illegal: DELAY={props[Prop.DELAY]!r} {level}"
        if level > 0:
            mark = props.get(Prop.START_DELIVER_TIME)
            for key in TIMER_PROPS:
                props.pop(key, None)
            at = None if mark is None else java_int(mark, 64)
            if at.__class__ is int and at <= now:
                # A time gone by asks nothing: a delivered message's (ali-ons' getStartDeliverTime()), kept on
                # its retry (send-back, or a stock consumer's resend with DELAY), as RocketMQ copies it.
                props[Prop.START_DELIVER_TIME] = mark
            level = self.clamp(level)
            props[Prop.DELAY] = str(level)
            props[Prop.REAL_TOPIC] = topic
            props[Prop.REAL_QID] = str(queue_id)
            return Diverted(SCHEDULE_TOPIC, level - 1, self.delays_ms[level - 1], 0)
        # (A TIMER_OUT_MS already there is no reason to skip: RocketMQ 5 re-puts a due message with its asks, and
        # skips on that mark; the scheduler here delivers it without them. A client's is a delivered message's
        # mark, forwarded with its properties and a new delay: taken as leaving the wheel, it was delivered at once.)
        if not any(key in props for key in TIMER_PROPS):
            return None
        deliver_ms = self.timer_deliver_ms(props, now)
        if isinstance(deliver_ms, str):
            return deliver_ms
        if deliver_ms <= now:
            return None
        props[TIMER_OUT_MS] = str(deliver_ms)
        props[Prop.REAL_TOPIC] = topic
        props[Prop.REAL_QID] = str(queue_id)
        return Diverted(TIMER_TOPIC, 0, -1, deliver_ms)

    def timer_deliver_ms(self, props: dict, now: int) -> int | str:
        """The absolute delivery time a timer message asks for, or why it is refused."""
        deliver_ms = now
        for key, scale, relative in TIMER_ASKS:
            if key in props:
                value = java_int(props[key], 64)       # RocketMQ 5's Long.parseLong
                if isinstance(value, str):
                    return f"timer message illegal: {key}={props[key]!r} {value}"
                deliver_ms = now + value * scale if relative else value
                break
        if deliver_ms - now > self.timer_max_delay_ms:
            return (f"timer message illegal: delivery in {(deliver_ms - now) // 1000} s is beyond the "
                    f"{self.timer_max_delay_ms // 1000} s maximum ({self.timer_limit})")
        return deliver_ms

    def consume_queue_tag(self, topic: str, props: dict, store_ts: int) -> int | None:
        """The tagsCode of a waiting message's consume-queue unit (its delivery time), for units rebuilt
        from the log; None for every other topic."""
        if topic == SCHEDULE_TOPIC:
            level = _int(props.get(Prop.DELAY))
            return self.deliver_at(level, store_ts) if level is not None and level > 0 else None
        if topic == TIMER_TOPIC:
            return _int(props.get(TIMER_OUT_MS))
        return None


# The timer properties in the order a single send reads them (the first there wins): key, ms per unit, from now.
TIMER_ASKS = ((TIMER_DELAY_SEC, 1000, True), (TIMER_DELAY_MS, 1, True), (TIMER_DELIVER_MS, 1, False),
              (Prop.START_DELIVER_TIME, 1, False))


def timer_waits(value_of, now: int) -> str | None:
    """The timer value (``value_of(key)``; empty or None: not there) that makes a message wait, or one Long.parseLong
    refuses, judged as ``timer_deliver_ms`` does (the first there, in TIMER_ASKS order), else None. For the batch
    checks: a time gone by asks nothing -- a delivered message keeps its __STARTDELIVERTIME, and forwarded in a
    batch it was refused where alone it is stored at once."""
    for key, scale, relative in TIMER_ASKS:
        value = value_of(key)
        if value:
            at = java_int(value, 64)
            return value if isinstance(at, str) or (at * scale if relative else at - now) > 0 else None
    return None


def _int(text: str | None) -> int | None:
    value = None if text is None else java_int(text, 64)
    return None if isinstance(value, str) else value
