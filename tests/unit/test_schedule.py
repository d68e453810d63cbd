"""Delay levels, timer times and the scheduler, driven by a fake clock over a real store in a tmp dir."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from broker.config import BrokerConfig
from broker.metrics import BrokerMetrics
from broker.schedule import (DEFAULT_DELAY_LEVELS, PROGRESS_TOPIC, SCHEDULE_TOPIC, TIMER_TOPIC, DelayLevels,
                             ScheduleService, diverted_request, parse_delay_levels)
from broker.schedule.progress import Progress, decode_progress
from broker.store import MessageStore, PutRequest, StoreConfig
from protocol.codes import SysFlag
from protocol.errors import ConfigError
from protocol.message import decode_record, encode_record, pack_host, properties_to_string
from tests.support.bounded import bounded

HOST = pack_host("127.0.0.1", 10911)


# ------------------------------------------------------------------ levels
def test_the_default_levels_are_rocketmqs_eighteen():
    delays = parse_delay_levels(DEFAULT_DELAY_LEVELS)
    assert len(delays) == 18
    assert delays[:4] == (1000, 5000, 10000, 30000)
    assert delays[4] == 60_000 and delays[15] == 30 * 60_000 and delays[-1] == 2 * 3_600_000


def test_levels_take_every_unit_and_ms_for_tests():
    assert parse_delay_levels("300ms 1s 2m 1h 1d") == (300, 1000, 120_000, 3_600_000, 86_400_000)
    assert parse_delay_levels("  5s   10s ") == (5000, 10000)


@pytest.mark.parametrize("text, where", [("", "no delay levels"), ("1s 5x", "level 2 '5x'"),
                                         ("s", "level 1"), ("1.5s", "level 1"), ("-1s", "level 1"),
                                         ("10", "level 1")])
def test_a_bad_level_string_says_which_entry(text, where):
    with pytest.raises(ValueError, match=where):
        parse_delay_levels(text)


def test_the_broker_refuses_to_start_with_bad_levels():
    with pytest.raises(ConfigError, match="message_delay_level"):
        BrokerConfig(message_delay_level="1s 5 10s")
    assert BrokerConfig(message_delay_level="100ms 200ms").message_delay_level == "100ms 200ms"


def test_due_time_is_store_time_plus_the_levels_delay_clamped_to_the_last_level():
    lv = DelayLevels("1s 5s 10s")
    assert lv.deliver_at(1, 10_000) == 11_000
    assert lv.deliver_at(2, 10_000) == 15_000
    assert lv.deliver_at(99, 10_000) == 20_000          # clamped to level 3
    assert lv.deliver_at(0, 10_000) == 11_000           # RocketMQ's 1 s for a level it does not know


def test_a_due_time_beyond_the_whole_delay_is_corrected_to_now():
    # The clock went back (or the table shrank): RocketMQ's correctDeliverTimestamp delivers at once.
    assert DelayLevels.corrected(15_000, now=10_000, delay_ms=5_000) == 15_000
    assert DelayLevels.corrected(15_001, now=10_000, delay_ms=5_000) == 10_000


def test_a_delayed_message_is_rewritten_into_the_schedule_topic():
    lv = DelayLevels(DEFAULT_DELAY_LEVELS)
    props = {"DELAY": "2", "TAGS": "t"}
    d = lv.divert("Orders", 3, props, 0, now=1000)
    assert d == (SCHEDULE_TOPIC, 1, 5000, 0)
    assert props == {"DELAY": "2", "TAGS": "t", "REAL_TOPIC": "Orders", "REAL_QID": "3"}
    props = {"DELAY": "40"}
    d = lv.divert("Orders", 0, props, 0, now=1000)
    assert (d.queue_id, props["DELAY"]) == (17, "18")   # clamped to the max level, as CommitLog does
    assert lv.divert("Orders", 0, {"DELAY": "0"}, 0, now=1000) is None
    assert "is not a whole number" in lv.divert("Orders", 0, {"DELAY": "x"}, 0, now=1000)    # RocketMQ: parseInt throws
    committed = SysFlag.with_transaction_type(0, SysFlag.TRANSACTION_COMMIT)
    assert lv.divert("Orders", 0, {"DELAY": "1"}, committed, now=1000).topic == SCHEDULE_TOPIC
    prepared = SysFlag.with_transaction_type(0, SysFlag.TRANSACTION_PREPARED)
    assert lv.divert("Orders", 0, {"DELAY": "1"}, prepared, now=1000) is None   # a half waits only once committed


def test_timer_properties_give_an_exact_delivery_time():
    lv = DelayLevels(DEFAULT_DELAY_LEVELS, timer_max_delay_ms=3_600_000)
    now = 1_000_000
    for props, due in (({"TIMER_DELIVER_MS": str(now + 2500)}, now + 2500),
                       ({"TIMER_DELAY_SEC": "3"}, now + 3000),
                       ({"TIMER_DELAY_MS": "700"}, now + 700),
                       ({"TIMER_DELAY_SEC": "2", "TIMER_DELAY_MS": "1", "TIMER_DELIVER_MS": "5"}, now + 2000)):
        d = lv.divert("T", 1, props, 0, now)
        assert d == (TIMER_TOPIC, 0, -1, due)
        assert props["TIMER_OUT_MS"] == str(due) and props["REAL_TOPIC"] == "T" and props["REAL_QID"] == "1"
    assert lv.divert("T", 0, {"TIMER_DELIVER_MS": str(now - 1)}, 0, now) is None        # past: at once
    assert "not a whole number" in lv.divert("T", 0, {"TIMER_DELAY_SEC": "soon"}, 0, now)
    assert "beyond the 3600 s maximum" in lv.divert("T", 0, {"TIMER_DELAY_SEC": "3601"}, 0, now)
    props = {"DELAY": "1", "TIMER_DELAY_SEC": "60"}
    assert lv.divert("T", 0, props, 0, now).topic == SCHEDULE_TOPIC     # a level wins; timer props dropped
    assert "TIMER_DELAY_SEC" not in props


def test_aliyuns_start_deliver_time_is_a_timer_after_rocketmq_5s():
    """__STARTDELIVERTIME (ali-ons' setStartDeliverTime, absolute ms) was no timer: delivered at once."""
    lv = DelayLevels(DEFAULT_DELAY_LEVELS, timer_max_delay_ms=3_600_000)
    now = 1_000_000
    props = {"__STARTDELIVERTIME": str(now + 1500)}
    assert lv.divert("T", 2, props, 0, now) == (TIMER_TOPIC, 0, -1, now + 1500)
    assert props["TIMER_OUT_MS"] == str(now + 1500) and props["REAL_TOPIC"] == "T" and props["REAL_QID"] == "2"
    both = {"__STARTDELIVERTIME": str(now + 9000), "TIMER_DELIVER_MS": str(now + 700)}
    assert lv.divert("T", 0, both, 0, now) == (TIMER_TOPIC, 0, -1, now + 700)      # RocketMQ 5's wins
    assert lv.divert("T", 0, {"__STARTDELIVERTIME": str(now - 1)}, 0, now) is None   # past: at once
    assert "__STARTDELIVERTIME='soon' is not a whole number" in lv.divert("T", 0, {"__STARTDELIVERTIME": "soon"}, 0, now)
    assert "beyond the 3600 s maximum" in lv.divert("T", 0, {"__STARTDELIVERTIME": str(now + 3_601_000)}, 0, now)
    props = {"DELAY": "1", "__STARTDELIVERTIME": str(now + 60_000)}
    assert lv.divert("T", 0, props, 0, now).topic == SCHEDULE_TOPIC and "__STARTDELIVERTIME" not in props
    # gone by: a delivered message's mark, kept on its retry (a send-back's or a resend's DELAY), as RocketMQ's
    props = {"DELAY": "3", "__STARTDELIVERTIME": str(now), "TIMER_DELAY_SEC": "5"}
    assert lv.divert("T", 0, props, 0, now).topic == SCHEDULE_TOPIC
    assert props["__STARTDELIVERTIME"] == str(now) and "TIMER_DELAY_SEC" not in props
    props = {"DELAY": "3", "__STARTDELIVERTIME": "0" * 5000 + "1"}
    assert lv.divert("T", 0, props, 0, now).topic == SCHEDULE_TOPIC and props["__STARTDELIVERTIME"] == "0" * 5000 + "1"


def test_a_delay_that_integer_parseint_refuses_is_refused():
    lv = DelayLevels(DEFAULT_DELAY_LEVELS)
    for delay in ("2.5", "soon", "1e3", "", " ", " 3", "3 ", "1_000", "0x10", "3\n"):
        assert lv.divert("T", 0, {"DELAY": delay}, 0, 1000) == \
            f"delay level illegal: DELAY={delay!r} is not a whole number"
    for delay in ("2147483648", "-2147483649"):
        assert lv.divert("T", 0, {"DELAY": delay}, 0, 1000) == \
            f"delay level illegal: DELAY={delay!r} is past Java's int range"
    # past int()'s 4,300 digits: its ValueError escaped divert (the send answered SYSTEM_ERROR "ValueError"), not
    # refused as Java's range; leading zeros are no size to parseInt
    for delay in ("9" * 5000, "-" + "9" * 5000):
        assert lv.divert("T", 0, {"DELAY": delay}, 0, 1000) == \
            f"delay level illegal: DELAY={delay!r} is past Java's int range"
    assert lv.divert("T", 0, {"DELAY": "+" + "0" * 5000 + "3"}, 0, 1000).queue_id == 2
    assert lv.divert("T", 0, {"DELAY": "-1"}, 0, 1000) is None       # RocketMQ: level <= 0 is no delay
    assert lv.divert("T", 0, {"DELAY": "-2147483648"}, 0, 1000) is None
    assert lv.divert("T", 0, {"DELAY": "2147483647"}, 0, 1000).queue_id == 17     # the last level
    assert lv.divert("T", 0, {"DELAY": "+2"}, 0, 1000).queue_id == 1               # parseInt takes a "+"
    assert lv.divert("T", 0, {"DELAY": "\uff12"}, 0, 1000).queue_id == 1           # and any Unicode digit


def test_a_timer_that_long_parselong_refuses_is_refused():
    lv = DelayLevels(DEFAULT_DELAY_LEVELS, timer_max_delay_ms=3_600_000)
    for key in ("TIMER_DELAY_SEC", "TIMER_DELAY_MS", "TIMER_DELIVER_MS", "__STARTDELIVERTIME"):
        for value in ("", " 5", "1_000"):
            assert lv.divert("T", 0, {key: value}, 0, 1000) == \
                f"timer message illegal: {key}={value!r} is not a whole number"
        assert lv.divert("T", 0, {key: str(1 << 63)}, 0, 1000) == \
            f"timer message illegal: {key}={str(1 << 63)!r} is past Java's long range"
        assert lv.divert("T", 0, {key: "7" * 5000}, 0, 1000) == \
            f"timer message illegal: {key}={'7' * 5000!r} is past Java's long range"


def test_a_half_stored_before_the_delay_checks_is_committed_at_once_not_lost():
    """A half an older broker stored with DELAY='x' (now refused at the half) or a __STARTDELIVERTIME past
    timer_max_delay_s (then no timer at all), committed after the upgrade: its refusal means "no delay", so the
    commit writes it to its topic at once (None) rather than nowhere; a __STARTDELIVERTIME in range waits."""
    lv = DelayLevels(DEFAULT_DELAY_LEVELS, timer_max_delay_ms=60_000)
    now = 1_000_000

    def half(props):
        record = encode_record(topic=b"RMQ_SYS_TRANS_HALF_TOPIC", body=b"b", queue_id=0, flag=0,
                               sys_flag=SysFlag.TRANSACTION_PREPARED, born_timestamp=now, born_host=HOST,
                               store_host=HOST, properties=properties_to_string(props).encode())
        return decode_record(record)[0]

    base = {"TRAN_MSG": "true", "PGROUP": "PG", "REAL_TOPIC": "T", "REAL_QID": "1"}
    for old in ({"DELAY": "x"}, {"__STARTDELIVERTIME": str(now + 61_000)}, {"__STARTDELIVERTIME": "soon"}):
        assert diverted_request(lv, half({**base, **old}), "T", 1, 4242, HOST, now) is None, old
    waits = diverted_request(lv, half({**base, "__STARTDELIVERTIME": str(now + 5000)}), "T", 1, 4242, HOST, now)
    assert (waits.topic, waits.tags_code) == (TIMER_TOPIC, now + 5000)


def test_rebuilt_consume_queue_units_carry_the_delivery_time():
    lv = DelayLevels("1s 5s")
    assert lv.consume_queue_tag(SCHEDULE_TOPIC, {"DELAY": "2"}, 7_000) == 12_000
    assert lv.consume_queue_tag(TIMER_TOPIC, {"TIMER_OUT_MS": "99"}, 7_000) == 99
    assert lv.consume_queue_tag("Orders", {"DELAY": "2"}, 7_000) is None


def test_progress_merges_levels_and_folds_delivered_timers_into_a_floor():
    p = Progress()
    p.apply({1: 5, 2: 3}, [2, 0])
    p.apply({1: 4}, [1, 5])                      # an older level offset never moves progress back
    assert p.levels == {1: 5, 2: 3}
    assert (p.timer_floor, set(p.timer_done)) == (3, {5})
    assert p.timer_delivered(1) and p.timer_delivered(5) and not p.timer_delivered(3)
    assert Progress.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert decode_progress(b"not json") is None


# ------------------------------------------------------------------ the scheduler, on a fake clock
class Clock:
    def __init__(self, now: int):
        self.now = now

    def __call__(self) -> int:
        return self.now


async def _service(path, clock, levels="1s 5s 10s", monotonic=None, role=None, **store_config):
    """``monotonic``: the clock that times timers; by default ``clock`` (one clock that never steps: a test
    then passes the same time twice to run_due). ``role``: the broker's (config.broker_role), when it matters."""
    store = MessageStore(str(path), StoreConfig(segment_size=1 << 20, cq_units_per_file=100, **store_config),
                         clock=clock, tag_rule=DelayLevels(levels).consume_queue_tag)
    ctx = SimpleNamespace(store=store, clock=clock, monotonic=monotonic or clock, metrics=BrokerMetrics(),
                          store_host=HOST, topics=SimpleNamespace(topics={}))
    if role is not None:
        ctx.config = SimpleNamespace(broker_role=role)
    svc = ScheduleService(ctx, DelayLevels(levels))
    store.add_dispatch_listener(svc.on_dispatch)
    await store.open()
    await svc.recover()
    return svc


async def _schedule(svc, topic, body, props, now):
    d = svc.levels.divert(topic, 0, props, 0, now)
    record = encode_record(topic=d.topic.encode(), body=body, queue_id=d.queue_id, flag=0, sys_flag=0,
                           born_timestamp=now, born_host=HOST, store_host=HOST,
                           properties=properties_to_string(props).encode())
    result = await svc.ctx.store.put(PutRequest(record, d.topic, d.queue_id, d.tags_code, 0, d.delay_ms))
    assert result.ok
    return result


def _delivered(store, topic):
    out = []
    for offset in range(store.max_offset(topic, 0)):
        unit = store.queue_unit(topic, 0, offset)
        out.append(decode_record(store.get_record(unit[0]))[0])
    return out


@bounded()
async def test_a_level_message_is_delivered_when_due_and_not_before(tmp_path):
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    stored = await _schedule(svc, "Orders", b"two", {"DELAY": "2", "TAGS": "a"}, clock.now)
    store = svc.ctx.store
    assert store.queue_unit(SCHEDULE_TOPIC, 1, 0)[2] == 105_000     # tagsCode: its delivery time
    assert await svc.run_due(104_999, 104_999) == 0 and svc.next_due == 105_000
    assert _delivered(store, "Orders") == []
    clock.now = 105_000
    assert await svc.run_due(105_000, 105_000) == 1
    [msg] = _delivered(store, "Orders")
    assert msg.body == b"two" and msg.tags == "a" and "DELAY" not in msg.properties
    assert msg.properties["REAL_TOPIC"] == "Orders" and msg.physical_offset != stored.physical_offset
    assert store.queue_unit("Orders", 0, 0)[2] != 105_000             # an ordinary unit: the TAGS hash
    assert dict(svc.waiting()) == {"2": 0, "timer": 0}
    await svc.stop()
    await store.close()
    assert json.load(open(os.path.join(tmp_path, "config", "delayOffset.json")))["offsetTable"]["2"] == 1


@bounded()
async def test_timers_leave_in_time_order_and_no_delivery_repeats_after_a_restart(tmp_path):
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    for body, at in ((b"late", 103_000), (b"early", 101_000), (b"mid", 102_000)):
        await _schedule(svc, "T", body, {"TIMER_DELIVER_MS": str(at)}, clock.now)
    await _schedule(svc, "T", b"level", {"DELAY": "1"}, clock.now)
    assert await svc.run_due(101_000, 101_000) == 2                   # "early" and the 1 s level message
    assert await svc.run_due(102_500, 102_500) == 1
    assert [m.body for m in _delivered(svc.ctx.store, "T")] == [b"level", b"early", b"mid"]
    # No stop, no delayOffset.json: as after kill -9, the progress records alone say what went.
    await svc.ctx.store.close()
    svc2 = await _service(tmp_path, clock)
    assert svc2.progress.levels[1] == 1 and dict(svc2.waiting())["timer"] == 1
    assert await svc2.run_due(102_999, 102_999) == 0
    assert await svc2.run_due(103_000, 103_000) == 1
    assert [m.body for m in _delivered(svc2.ctx.store, "T")] == [b"level", b"early", b"mid", b"late"]
    assert svc2.ctx.store.max_offset(PROGRESS_TOPIC, 0) == 3
    await svc2.ctx.store.close()


@bounded()
async def test_after_a_log_cut_the_snapshot_ahead_of_it_is_not_trusted(tmp_path):
    """truncate_corrupt_tail cut the log at a timer message, and with it the delivery batch after it; the
    delayOffset.json written before still said every timer below 3 was delivered. The one whose delivery was
    cut was never delivered again, nor were the new timers stored at the offsets the cut freed."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock, truncate_corrupt_tail=True)
    timers = [await _schedule(svc, "T", body, {"TIMER_DELIVER_MS": "101000"}, clock.now) for body in (b"a", b"b", b"c")]
    assert await svc.run_due(101_000, 101_000) == 3
    await svc.stop()                                        # delayOffset.json: timers below 3 delivered
    await svc.ctx.store.close()
    with open(os.path.join(tmp_path, "commitlog", f"{0:020d}"), "r+b") as f:
        f.seek(timers[1].physical_offset + 4)               # damage b: the log is cut there
        f.write(b"\0\0\0\0")
    svc = await _service(tmp_path, clock, truncate_corrupt_tail=True)
    assert await svc.run_due(101_000, 101_000) == 1                  # a: its delivery was cut with the rest
    for body in (b"x", b"y"):                               # at timer queue offsets 1 and 2 again
        await _schedule(svc, "T", body, {"TIMER_DELIVER_MS": "200000"}, clock.now)
    await svc.ctx.store.close()                             # killed: no stop, no new delayOffset.json
    svc = await _service(tmp_path, clock, truncate_corrupt_tail=True)
    try:
        assert await svc.run_due(200_000, 200_000) == 2
        assert [m.body for m in _delivered(svc.ctx.store, "T")] == [b"a", b"x", b"y"]
    finally:
        await svc.ctx.store.close()


@bounded()
async def test_a_full_disk_holds_deliveries_back_and_loses_none(tmp_path):
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    await _schedule(svc, "T", b"a", {"DELAY": "1"}, clock.now)
    await _schedule(svc, "T", b"b", {"TIMER_DELAY_MS": "500"}, clock.now)
    disk = svc.ctx.store.disk
    disk.refusing, disk.still_refusing, disk.refuse = True, lambda: True, lambda: "the broker's disk is full"
    assert await svc.run_due(102_000, 102_000) == -1
    assert await svc.run_due(103_000, 103_000) == -1
    assert _delivered(svc.ctx.store, "T") == [] and dict(svc.waiting()) == {"1": 1, "timer": 1}
    disk.refusing = False
    assert await svc.run_due(104_000, 104_000) == 2
    assert await svc.run_due(105_000, 105_000) == 0
    assert sorted(m.body for m in _delivered(svc.ctx.store, "T")) == [b"a", b"b"]
    await svc.ctx.store.close()


async def _put_undeliverable(svc) -> None:
    """A level-1 message whose destination is a system topic nothing may be delivered to."""
    props = {"DELAY": "1", "REAL_TOPIC": "RMQ_SYS_TRANS_HALF_TOPIC", "REAL_QID": "0"}
    record = encode_record(topic=SCHEDULE_TOPIC.encode(), body=b"x", queue_id=0, flag=0, sys_flag=0,
                           born_timestamp=0, born_host=HOST, store_host=HOST,
                           properties=properties_to_string(props).encode())
    assert (await svc.ctx.store.put(PutRequest(record, SCHEDULE_TOPIC, 0, 0, 0, 1000))).ok


@bounded()
async def test_an_undeliverable_message_is_passed_over_with_progress_kept(tmp_path):
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    await _put_undeliverable(svc)
    await _schedule(svc, "T", b"fine", {"DELAY": "1"}, clock.now)
    assert await svc.run_due(101_000, 101_000) == 2
    assert [m.body for m in _delivered(svc.ctx.store, "T")] == [b"fine"]
    assert svc.ctx.store.max_offset("RMQ_SYS_TRANS_HALF_TOPIC", 0) == 0
    assert svc.ctx.metrics.registry.get_sample_value("txmq_schedule_dropped_total", {"reason": "no_destination"}) == 1
    await svc.ctx.store.close()


@bounded()
async def test_a_message_passed_over_is_counted_once_while_the_disk_refuses_its_batch(tmp_path):
    """txmq_schedule_dropped_total was counted when a batch was gathered, not when the scheduler moved past:
    while the disk refused the batch it was gathered again every second, and one undeliverable message was
    counted (and logged as dropped) once a second for as long as the disk stayed full."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    await _put_undeliverable(svc)
    await _schedule(svc, "T", b"fine", {"DELAY": "1"}, clock.now)
    disk = svc.ctx.store.disk
    disk.refusing, disk.still_refusing, disk.refuse = True, lambda: True, lambda: "the broker's disk is full"

    def dropped():
        return svc.ctx.metrics.registry.get_sample_value("txmq_schedule_dropped_total", {"reason": "no_destination"})
    for now in (101_000, 102_000, 103_000):
        assert await svc.run_due(now, now) == -1
    assert not dropped()                    # nothing passed over yet: the same batch is tried again
    disk.refusing = False
    assert await svc.run_due(104_000, 104_000) == 2
    assert dropped() == 1
    await svc.ctx.store.close()


@bounded()
async def test_a_batch_the_full_disk_refuses_is_said_once_and_its_delivery_again(tmp_path, caplog):
    """A batch the store refused (a full disk) is tried again every second, and each try was a WARNING: a disk full
    for an hour logged 3,600 lines. Said once when deliveries begin to wait, and once when they go on."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    await _schedule(svc, "T", b"late", {"DELAY": "1"}, clock.now)
    disk = svc.ctx.store.disk
    disk.refusing, disk.still_refusing, disk.refuse = True, lambda: True, lambda: "the broker's disk is full"
    with caplog.at_level(logging.WARNING, logger="txmq.schedule"):
        for now in (101_000, 102_000, 103_000):
            assert await svc.run_due(now, now) == -1
        disk.refusing = False
        assert await svc.run_due(104_000, 104_000) == 1
    said = [r.getMessage() for r in caplog.records if r.name == "txmq.schedule"]
    assert len(said) == 2 and "refused" in said[0] and "delivering again" in said[1], said
    assert [m.body for m in _delivered(svc.ctx.store, "T")] == [b"late"]
    await svc.ctx.store.close()


@bounded()
async def test_a_damaged_record_is_passed_over_loudly_and_delivery_goes_on(tmp_path, caplog):
    """A record whose header passes the log's checks but which does not decode (here: a body length past
    its end) made every pass raise, so every delayed and timer message behind it waited for good."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    bad = await _schedule(svc, "T", b"damaged", {"DELAY": "1"}, clock.now)
    await _schedule(svc, "T", b"fine", {"DELAY": "1"}, clock.now)
    await _schedule(svc, "T", b"timer", {"TIMER_DELIVER_MS": "100500"}, clock.now)
    seg, pos = store._log.locate(bad.physical_offset)
    os.pwrite(seg.fd, (0x7FFF_FFFF).to_bytes(4, "big"), pos + 84)       # BODYLEN, as a bit flip might leave it
    assert store.get_record(bad.physical_offset) is not None            # the log's own checks pass
    assert await svc.run_due(101_000, 101_000) == 3
    assert [m.body for m in _delivered(store, "T")] == [b"fine", b"timer"]
    # (its body no longer checks against its CRC: passed over as corrupt, before any decoding)
    assert svc.ctx.metrics.registry.get_sample_value("txmq_schedule_dropped_total", {"reason": "corrupt"}) == 1
    assert f"the record at commit-log offset {bad.physical_offset} is corrupt" in caplog.text
    assert store.corrupt == {"scheduled delivery": 1}
    assert await svc.run_due(102_000, 102_000) == 0
    await store.close()


@bounded()
async def test_due_messages_larger_together_than_a_segment_are_delivered_in_several_batches(tmp_path):
    """One batch is written all or none, and the store refuses one larger than a segment: a batch of two
    600 KiB messages in 1 MiB segments was refused every second, and everything delayed stalled behind it."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    bodies = [bytes([65 + i]) * (600 * 1024) for i in range(3)]
    for body in bodies:
        await _schedule(svc, "Big", body, {"DELAY": "1"}, clock.now)
    clock.now = 101_000
    moved = []
    for _ in range(5):
        n = await svc.run_due(clock.now, clock.now)
        assert n >= 0, "the store refused the batch"
        if n == 0:
            break
        moved.append(n)
    assert moved == [1, 1, 1]
    assert [m.body for m in _delivered(store, "Big")] == bodies
    await svc.stop()
    await store.close()


@bounded()
async def test_a_pass_that_raises_is_logged_counted_and_the_loop_goes_on(tmp_path, caplog, monkeypatch):
    import asyncio

    import broker.schedule.service as service_mod
    monkeypatch.setattr(service_mod, "REFUSED_RETRY_S", 0.01)
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    real, calls = svc.run_due, []

    async def flaky(now, mono):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("a record that does not decode")
        return await real(now, mono)
    svc.run_due = flaky
    await _schedule(svc, "Orders", b"later", {"DELAY": "1"}, clock.now)
    clock.now = 101_000
    svc.start()
    try:
        while not _delivered(svc.ctx.store, "Orders"):
            await asyncio.sleep(0.01)
    finally:
        await svc.stop()
        await svc.ctx.store.close()
    assert "schedule pass failed" in caplog.text and len(calls) >= 2
    assert svc.ctx.metrics.task_crashes.labels("txmq-schedule")._value.get() == 1


@bounded()
async def test_a_timer_is_not_delivered_early_when_the_clock_goes_back_and_is_put_right(tmp_path):
    """The wall clock steps back an hour, then NTP puts it right. A timer of an hour stored just before
    goes an hour after it was stored, not at once (moved an hour earlier at the step back, the correction
    found it due)."""
    clock, mono = Clock(10_000_000), Clock(50_000)     # the monotonic clock never steps
    svc = await _service(tmp_path, clock, monotonic=mono)
    await _schedule(svc, "T", b"hour", {"TIMER_DELAY_SEC": "3600"}, clock.now)
    clock.now -= 3_600_000
    mono.now += 1000
    assert await svc.run_due(clock.now, mono.now) == 0
    clock.now += 3_600_000 + 1000
    mono.now += 1000
    assert await svc.run_due(clock.now, mono.now) == 0       # 2 s into its hour
    clock.now += 3_600_000 - 2000
    mono.now += 3_600_000 - 2000
    assert await svc.run_due(clock.now, mono.now) == 1
    await svc.ctx.store.close()


class SteppedWall:
    """The real wall clock plus an offset a test steps, as NTP does; the monotonic clock stays real."""

    def __init__(self):
        self.offset = 0

    def __call__(self) -> int:
        return int(time.time() * 1000) + self.offset


@pytest.mark.parametrize("props", [{"TIMER_DELAY_MS": "50"}, {"DELAY": "1"}], ids=["timer", "level"])
@bounded(20)
async def test_a_short_wait_stored_after_a_forward_step_wakes_the_sleeping_loop(tmp_path, monkeypatch, props):
    """The loop's sleep deadline was kept by the wall clock, and a new message woke it only when due before
    that deadline. After a step forward every new message's delivery time lies past it: a 50 ms timer (or a
    100 ms level) waited out the whole sleep (up to MAX_SLEEP_S, 1 s), late and nothing said. The sleep is
    made 60 s here, so a message that does not wake the loop fails the test's bound, however slow the host."""
    import asyncio

    import broker.schedule.service as service_mod
    from broker.context import monotonic_ms
    monkeypatch.setattr(service_mod, "MAX_SLEEP_S", 60.0)
    wall = SteppedWall()
    svc = await _service(tmp_path, wall, levels="100ms 5s", monotonic=monotonic_ms)
    svc.start()
    try:
        while svc._sleep_until is None:             # the loop found nothing due and went to sleep
            await asyncio.sleep(0)
        wall.offset += 3_600_000
        await _schedule(svc, "T", b"soon", props, wall())
        async with asyncio.timeout(10):
            while not _delivered(svc.ctx.store, "T"):
                await asyncio.sleep(0.01)
    finally:
        await svc.stop()
        await svc.ctx.store.close()


@bounded()
async def test_delay_offset_json_is_synced_into_its_directory_after_its_rename(tmp_path, monkeypatch):
    """delayOffset.json was renamed into place with its directory never synced: a power cut could leave the
    old one (or none), and progress records retention has since removed are not there to replay. Written
    now with the catalogues' saved.save: the directory is synced once the new file is in place."""
    import broker.store.saved as saved_mod
    synced = []
    real = saved_mod.fsync_dir

    def fsync_dir(path):
        with open(os.path.join(path, "delayOffset.json")) as f:         # in place when its name is synced
            synced.append((os.path.abspath(path), json.loads(f.read())["offsetTable"]["1"]))
        real(path)
    monkeypatch.setattr(saved_mod, "fsync_dir", fsync_dir)
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    await _schedule(svc, "Orders", b"one", {"DELAY": "1"}, clock.now)
    assert await svc.run_due(101_000, 101_000) == 1
    await svc.stop()
    await svc.ctx.store.close()
    assert (os.path.abspath(tmp_path / "config"), 1) in synced


@bounded()
async def test_an_older_nul_delivery_left_for_the_next_batch_leaves_no_copy_counted(tmp_path):
    # A delivery copying an older broker's record with a NUL is counted for the writer (each batch is then
    # scanned for it) until the writer writes it. Built, then left for the next batch (over the batch's bytes),
    # it was counted again when built anew: the count never came back to 0, and every batch after it, of every
    # producer, paid the scan for good.
    from broker.store.manifest import NUL_FREE_FILE
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    await _schedule(svc, "Big", b"A" * (400 * 1024), {"DELAY": "1"}, clock.now)
    await _schedule(svc, "Big", b"B" * (400 * 1024), {"DELAY": "1", "k": "v\x00w"}, clock.now)
    await svc.stop()
    await svc.ctx.store.close()
    os.unlink(os.path.join(tmp_path, NUL_FREE_FILE))        # an older broker wrote them
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    clock.now = 101_000
    assert await svc.run_due(clock.now, clock.now) == 1     # A; B waits for the next batch
    assert await svc.run_due(clock.now, clock.now) == 1
    assert [m.properties.get("k") for m in _delivered(store, "Big")] == [None, "v\x00w"]
    assert not store._writer.nul_copies
    await svc.stop()
    await store.close()


@bounded()
async def test_a_retry_due_in_a_queue_its_retry_topic_no_longer_has_is_delivered_into_one_it_has(tmp_path):
    """A send-back picks one of the group's retryQueueNums queues and the retry waits its backoff in
    SCHEDULE_TOPIC_XXXX. If meanwhile its retry topic was made again with fewer (reclaimed as idle -- nothing is in
    it while its retries wait -- or deleted, and made again by a heartbeat after the group's config was lowered or
    deleted), the retry landed in a queue past the topic's: stored and never read by any consumer, for good (a
    restart did not grow a topic its catalogue holds). It goes into one of the queues the topic has."""
    from broker.topics import TopicConfig
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    svc.ctx.topics.topics["%RETRY%G"] = TopicConfig("%RETRY%G", 1, 1)
    props = {"DELAY": "1"}
    d = svc.levels.divert("%RETRY%G", 3, props, 0, clock.now)     # picked when the topic had 4 queues
    record = encode_record(topic=d.topic.encode(), body=b"in 3", queue_id=d.queue_id, flag=0, sys_flag=0,
                           born_timestamp=clock.now, born_host=HOST, store_host=HOST,
                           properties=properties_to_string(props).encode())
    store = svc.ctx.store
    assert (await store.put(PutRequest(record, d.topic, d.queue_id, d.tags_code, 0, d.delay_ms))).ok
    clock.now = 101_000
    assert await svc.run_due(101_000, 101_000) == 1
    assert [m.body for m in _delivered(store, "%RETRY%G")] == [b"in 3"]
    assert store.max_offset("%RETRY%G", 3) == 0
    await svc.stop()
    await store.close()


@bounded()
async def test_messages_requeued_batch_after_batch_are_said_once_for_their_topic_and_counted(tmp_path, caplog):
    """A topic left reading fewer queues than it writes (a shrink half done) gets delayed messages for the queues
    it no longer reads batch after batch: each batch was a WARNING, for as long as it lasted. Said once for the
    topic and its queue count, every one counted in txmq_requeued_total."""
    from broker.topics import TopicConfig
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    svc.ctx.topics.topics["Cut"] = TopicConfig("Cut", 2, 4)         # reads 2 of the 4 it writes
    store = svc.ctx.store
    caplog.set_level(logging.WARNING, logger="txmq")
    for batch in range(3):
        props = {"DELAY": "1"}
        d = svc.levels.divert("Cut", 3, props, 0, clock.now)
        record = encode_record(topic=d.topic.encode(), body=b"%d" % batch, queue_id=d.queue_id, flag=0,
                               sys_flag=0, born_timestamp=clock.now, born_host=HOST, store_host=HOST,
                               properties=properties_to_string(props).encode())
        assert (await store.put(PutRequest(record, d.topic, d.queue_id, d.tags_code, 0, d.delay_ms))).ok
        clock.now += 1_000
        assert await svc.run_due(clock.now, clock.now) == 1
    assert store.max_offset("Cut", 1) == 3 and store.max_offset("Cut", 3) == 0       # queue 3 mod 2
    assert caplog.text.count("past the 2 it reads now") == 1
    assert svc.ctx.metrics.requeued.labels("Cut")._value.get() == 3
    await svc.stop()
    await store.close()


@bounded()
async def test_a_delivery_whose_queue_file_cannot_be_made_waits_in_the_schedule_queue(tmp_path, monkeypatch):
    """Past the open-files limit a delivery into a new queue was stored and its unit waited in memory,
    unreadable, the store's checkpoint standing still until a descriptor came free (a crash then re-read the log
    from the old checkpoint). The queue's file is made first now, as a send's: the batch waits in the schedule
    queue, and goes once the file can be made."""
    from broker.store import consume_queue
    from tests.support.store_faults import no_descriptor_for
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    await _schedule(svc, "Fresh", b"a", {"DELAY": "1"}, clock.now)
    real = no_descriptor_for(monkeypatch, "Fresh")
    assert await svc.run_due(102_000, 102_000) == -1
    assert await svc.run_due(103_000, 103_000) == -1
    assert store.max_offset("Fresh", 0) == 0 and dict(svc.waiting()) == {"1": 1, "timer": 0}
    assert not store._backlogged                    # nothing waits in memory: the checkpoint goes on
    monkeypatch.setattr(consume_queue.MappedFile, "create", real)
    assert await svc.run_due(104_000, 104_000) == 1
    assert [m.body for m in _delivered(store, "Fresh")] == [b"a"]
    await svc.stop()
    await store.close()


@bounded()
async def test_a_timer_whose_queue_file_fails_unexpectedly_is_kept_and_delivered_later(tmp_path, monkeypatch):
    """A due timer is taken off the timer heap before its delivery. The put kept it on any failure ("not taken
    after all"), but the wait for a new queue's file came before that, outside it: a failure there other than an
    OSError (a bug, or the store closing) lost the timer from memory -- never delivered until a restart."""
    from broker.store import consume_queue
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    await _schedule(svc, "Fresh", b"t", {"TIMER_DELIVER_MS": "101000"}, clock.now)
    real = consume_queue.MappedFile.create

    def broken(directory, *a, **kw):
        if os.sep + "Fresh" + os.sep in directory + os.sep:
            raise ValueError("mmap length is greater than file size")
        return real(directory, *a, **kw)

    monkeypatch.setattr(consume_queue.MappedFile, "create", broken)
    with pytest.raises(ValueError):
        await svc.run_due(101_000, 101_000)
    assert dict(svc.waiting())["timer"] == 1
    monkeypatch.setattr(consume_queue.MappedFile, "create", real)
    assert await svc.run_due(101_500, 101_500) == 1
    assert [m.body for m in _delivered(store, "Fresh")] == [b"t"]
    await svc.stop()
    await store.close()


@bounded()
async def test_level_messages_retention_removed_before_delivery_are_counted_as_dropped(tmp_path, caplog):
    """Retention removes a segment whatever waits in it. The level's consume queue moves its minimum with the
    segment, so the scheduler moves past the lost messages as a block, never meeting them one by one: that block
    was logged on every gathering (once a second while the disk refused the batch) and never counted, and
    txmq_schedule_dropped_total{reason="removed"} said 0 while each of them was lost. A timer whose record went
    stayed in the heap until its time, days later. Counted, and said once, when the progress past them is
    written."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    for i in range(3):
        await _schedule(svc, "T", b"lost-%d" % i, {"DELAY": "3"}, clock.now)    # 10 s
    await _schedule(svc, "T", b"lost-timer", {"TIMER_DELIVER_MS": str(clock.now + 86_400_000)}, clock.now)
    while len(store.segments()) < 2:        # seal the segment they are in
        assert (await store.put(PutRequest.build("Filler", b"f" * 100_000))).ok
    kept = await _schedule(svc, "T", b"kept", {"DELAY": "3"}, clock.now)
    await store.remove_segment(store.segments()[0].name, "test")
    assert store.min_offset(SCHEDULE_TOPIC, 2) == 3 and kept.queue_offset == 3

    def removed():
        return svc.ctx.metrics.registry.get_sample_value("txmq_schedule_dropped_total", {"reason": "removed"})
    disk = store.disk
    disk.refusing, disk.still_refusing, disk.refuse = True, lambda: True, lambda: "the broker's disk is full"
    with caplog.at_level("ERROR", logger="txmq.schedule"):
        for now in (110_000, 111_000):
            assert await svc.run_due(now, now) == -1
        assert not removed() and "were removed" not in caplog.text     # nothing moved past yet
        disk.refusing = False
        assert await svc.run_due(112_000, 112_000) == 5
    assert [m.body for m in _delivered(store, "T")] == [b"kept"]
    assert removed() == 4           # the timer too, now: not a day later, at its time
    said = [r.getMessage() for r in caplog.records if "were removed" in r.getMessage()]
    assert said == ["schedule: 4 waiting messages were removed by retention before delivery (level 3 offsets 0..2; "
                    "1 timer(s) at offsets 0..0); moved past them"]
    assert svc.progress.timer_floor == 1            # the timer's offset is done with
    day = 100_000 + 86_400_000
    assert await svc.run_due(day, day) == 0 and not svc._timers      # and at its time it is not counted again
    assert removed() == 4
    await store.close()


@bounded()
async def test_waiting_messages_retention_removed_while_the_broker_was_down_are_counted_and_the_timer_floor_moves(
        tmp_path, caplog):
    """Start-up set each level's offset to its consume queue's minimum and indexed timers from there: messages
    retention removed before their delivery were passed over with no line and no count. And the timer floor stayed
    below the removed timers for good, so every timer delivered after was kept in timerDone (and
    delayOffset.json) for ever. Now: counted as removed, said at ERROR, and the floor moves past them."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    for i in range(3):
        await _schedule(svc, "T", b"lost-%d" % i, {"DELAY": "3"}, clock.now)
    for i in range(2):
        await _schedule(svc, "T", b"lost-timer-%d" % i, {"TIMER_DELIVER_MS": "200000"}, clock.now)
    while len(store.segments()) < 2:
        assert (await store.put(PutRequest.build("Filler", b"f" * 100_000))).ok
    await _schedule(svc, "T", b"kept-timer", {"TIMER_DELIVER_MS": "101000"}, clock.now)
    await svc.stop()                    # delayOffset.json: nothing delivered yet
    await store.remove_segment(store.segments()[0].name, "test")
    await store.close()

    with caplog.at_level("ERROR", logger="txmq.schedule"):
        svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    assert svc.ctx.metrics.registry.get_sample_value("txmq_schedule_dropped_total", {"reason": "removed"}) == 5
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert said == ["schedule recovery: 5 waiting messages were removed by retention before delivery (level 3 "
                    "offsets 0..2; timer offsets 0..1); moved past them"]
    assert svc.progress.timer_floor == 2
    clock.now = 101_000
    assert await svc.run_due(101_000, 101_000) == 1
    assert [m.body for m in _delivered(store, "T")] == [b"kept-timer"]
    assert (svc.progress.timer_floor, len(svc.progress.timer_done)) == (3, 0)     # nothing kept for ever
    await store.close()


@bounded()
async def test_messages_retention_removed_at_a_level_the_restart_no_longer_has_are_counted_and_said(tmp_path, caplog):
    """Messages waiting at a level a restart's shorter message_delay_level dropped are read at its last level (the
    delay-level fix), but only a level still holding some was: one whose waiting messages retention had all removed
    while the broker was down was left out, so they were neither counted in txmq_schedule_dropped_total{reason=
    "removed"} nor said, as a configured level's are (3 lost at level 3, restarted with 2 levels: 0, no line)."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    for i in range(3):
        await _schedule(svc, "T", b"lost-%d" % i, {"DELAY": "3"}, clock.now)
    while len(store.segments()) < 2:
        assert (await store.put(PutRequest.build("Filler", b"f" * 100_000))).ok
    await svc.stop()
    await store.remove_segment(store.segments()[0].name, "test")
    await store.close()

    with caplog.at_level("WARNING", logger="txmq.schedule"):
        svc = await _service(tmp_path, clock, levels="1s 5s")
    assert svc.ctx.metrics.registry.get_sample_value("txmq_schedule_dropped_total", {"reason": "removed"}) == 3
    said = [r.getMessage() for r in caplog.records if r.name == "txmq.schedule"]
    assert said == ["schedule recovery: 3 waiting messages were removed by retention before delivery (level 3 "
                    "offsets 0..2); moved past them"]       # (none waits there: no line that some do)
    assert dict(svc.waiting()).get("3", 0) == 0
    await svc.stop()
    await svc.ctx.store.close()


@bounded()
async def test_removed_timers_are_passed_over_a_bounded_number_a_progress_record(tmp_path, monkeypatch):
    """Each removed timer is named in the progress record of the batch that passes over it; a million of them in
    one record would be refused as too large, every second, and all delivery would stall behind it."""
    import broker.schedule.service as service_module
    monkeypatch.setattr(service_module, "LOST_PER_BATCH", 2)
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    for i in range(3):
        await _schedule(svc, "T", b"lost-timer-%d" % i, {"TIMER_DELIVER_MS": str(clock.now + 86_400_000)}, clock.now)
    while len(store.segments()) < 2:
        assert (await store.put(PutRequest.build("Filler", b"f" * 100_000))).ok
    await store.remove_segment(store.segments()[0].name, "test")
    assert await svc.run_due(101_000, 101_000) == 2
    assert await svc.run_due(101_000, 101_000) == 1
    assert await svc.run_due(101_000, 101_000) == 0
    records = [decode_progress(m.body) for m in _delivered(store, PROGRESS_TOPIC)]
    assert [timers for _, timers in records] == [[0, 1], [2]]
    assert svc.progress.timer_floor == 3
    assert svc.ctx.metrics.registry.get_sample_value("txmq_schedule_dropped_total", {"reason": "removed"}) == 3
    await store.close()


@bounded()
async def test_a_slave_does_not_count_or_say_as_lost_what_its_own_retention_removed(tmp_path, caplog):
    """A slave's retention runs on its own disk: it may remove segments its master keeps, and the master delivers
    their waiting messages (a slave delivers nothing). At a slave's start-up they were counted in
    txmq_schedule_dropped_total{reason="removed"} and said at ERROR as lost: an alert on the pair for messages that
    were not lost (and counted twice when the master did lose them: the master counts its own)."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    for i in range(3):
        await _schedule(svc, "T", b"waiting-%d" % i, {"DELAY": "3"}, clock.now)
    await _schedule(svc, "T", b"waiting-timer", {"TIMER_DELIVER_MS": "200000"}, clock.now)
    while len(store.segments()) < 2:
        assert (await store.put(PutRequest.build("Filler", b"f" * 100_000))).ok
    await svc.stop()
    await store.remove_segment(store.segments()[0].name, "test")      # the slave's own disk pressure
    await store.close()

    with caplog.at_level("WARNING", logger="txmq.schedule"):
        svc = await _service(tmp_path, clock, role="SLAVE")
    assert not svc.ctx.metrics.registry.get_sample_value("txmq_schedule_dropped_total", {"reason": "removed"})
    assert "removed by retention" not in caplog.text
    await svc.ctx.store.close()


@bounded()
async def test_removed_timers_leave_the_waiting_count_when_passed_over_not_at_their_time(tmp_path):
    """Timers retention removed are passed over and counted at once, but their heap entries stay until their
    time: txmq_schedule_waiting{level="timer"} went on counting them as waiting for up to timer_max_delay_s (3
    days) after they were said lost. And one already due when it was found removed was popped from the heap and
    then written off again, kept in memory for good."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    await _schedule(svc, "T", b"lost-due", {"TIMER_DELIVER_MS": str(clock.now + 1_000)}, clock.now)
    await _schedule(svc, "T", b"lost-later", {"TIMER_DELIVER_MS": str(clock.now + 86_400_000)}, clock.now)
    while len(store.segments()) < 2:
        assert (await store.put(PutRequest.build("Filler", b"f" * 100_000))).ok
    await _schedule(svc, "T", b"kept", {"TIMER_DELIVER_MS": str(clock.now + 86_400_000)}, clock.now)
    await store.remove_segment(store.segments()[0].name, "test")
    assert await svc.run_due(102_000, 102_000) == 2
    assert dict(svc.waiting())["timer"] == 1            # the kept one only
    day = 100_000 + 86_400_000
    assert await svc.run_due(day, day) == 1
    assert [m.body for m in _delivered(store, "T")] == [b"kept"]
    assert dict(svc.waiting())["timer"] == 0
    assert not svc._written_off                         # nothing kept for good
    await store.close()


@bounded()
async def test_a_removed_segment_of_delivered_timers_is_gone_over_a_bounded_step_a_turn(tmp_path, monkeypatch):
    """One undelivered timer holds the floor back while every timer after it is delivered (kept in timerDone).
    Retention removes their segment: the scan for removed timers went over every offset the segment held in one
    turn on the event loop (74 ms a million; again every second while the disk refused the batch), and the batch
    passing over the one lost timer moved the floor over all the delivered ones in one step (210 ms a million).
    Now SCAN_PER_TURN offsets a turn, the next turn at once, with the same outcome."""
    import broker.schedule.service as service_module
    monkeypatch.setattr(service_module, "SCAN_PER_TURN", 4)
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    await _schedule(svc, "T", b"held", {"TIMER_DELIVER_MS": str(clock.now + 86_400_000)}, clock.now)
    for i in range(20):
        await _schedule(svc, "T", b"due-%d" % i, {"TIMER_DELIVER_MS": str(clock.now + 1_000)}, clock.now)
    assert await svc.run_due(101_000, 101_000) == 20
    assert (svc.progress.timer_floor, len(svc.progress.timer_done)) == (0, 20)     # held back by offset 0
    while len(store.segments()) < 2:
        assert (await store.put(PutRequest.build("Filler", b"f" * 100_000))).ok
    await store.remove_segment(store.segments()[0].name, "test")

    looked = []
    delivered = svc.progress.timer_delivered
    monkeypatch.setattr(svc.progress, "timer_delivered", lambda q: looked.append(q) or delivered(q))
    disk = store.disk
    disk.refusing, disk.still_refusing, disk.refuse = True, lambda: True, lambda: "the broker's disk is full"
    for _ in range(3):          # refused: looked over again each time, a bounded step each time
        looked.clear()
        assert await svc.run_due(102_000, 102_000) == -1
        assert len(looked) <= 4
    disk.refusing = False
    floors, turns = [], 0
    while svc.progress.timer_floor < 21:
        looked.clear()
        before = svc.progress.timer_floor
        moved = await svc.run_due(102_000, 102_000)
        assert len(looked) <= 4 and svc.progress.timer_floor - before <= 8     # this turn's step and the batch's
        if svc.progress.timer_floor < 21:       # the next step at once (_run goes on at once after a batch)
            assert moved > 0 or svc.next_due == 102_000
        floors.append(svc.progress.timer_floor)
        turns += 1
        assert turns < 20
    assert len(svc.progress.timer_done) == 0
    assert svc.ctx.metrics.registry.get_sample_value("txmq_schedule_dropped_total", {"reason": "removed"}) == 1
    last = store.queue_unit(PROGRESS_TOPIC, 0, store.max_offset(PROGRESS_TOPIC, 0) - 1)
    assert decode_progress(decode_record(store.get_record(last[0]))[0].body)[1] == [0]     # passed over, once
    await store.close()


@bounded()
async def test_delay_offset_json_is_sorted_and_encoded_off_the_event_loop(tmp_path, monkeypatch):
    """One undelivered timer holds the floor back while every timer after it is delivered: they are kept in
    timerDone until it goes (up to timer_max_delay_s). The snapshot every 10 s sorted them and took the repr of
    the whole table as its change key on the loop, 164 ms a million. The loop copies the progress; the sort and
    the JSON are made on a worker thread, and what it writes is the progress as it was."""
    import threading
    from broker.schedule.progress import Progress
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    await _schedule(svc, "T", b"held", {"TIMER_DELIVER_MS": str(clock.now + 86_400_000)}, clock.now)
    for i in range(3):
        await _schedule(svc, "T", b"due-%d" % i, {"TIMER_DELIVER_MS": str(clock.now + 1_000)}, clock.now)
    assert await svc.run_due(101_000, 101_000) == 3
    made_on = []
    to_json = Progress.to_json
    monkeypatch.setattr(Progress, "to_json", lambda self: made_on.append(threading.get_ident()) or to_json(self))
    await svc.snapshot()
    assert made_on and threading.get_ident() not in made_on
    monkeypatch.undo()
    with open(os.path.join(svc.config_dir, "delayOffset.json"), "rb") as fh:
        saved = json.loads(fh.read())
    assert (saved["timerFloor"], saved["timerDone"]) == (0, [[1, 3]])      # a run, [first, last]
    made_on.clear()
    await svc.snapshot()            # unchanged: not written again
    assert not made_on
    await svc.ctx.store.close()


# ------------------------------------------------------------------ delivered timers as runs
@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3 * 4096), st.integers(0, 5000)), max_size=40),
       st.integers(0, 4 * 4096))
def test_offset_runs_hold_what_a_set_holds(ops, bound):
    """OffsetRuns against a set of ints: adds (one offset, a run, or every other offset: a chunk of many runs,
    written as its bitmap; touching, overlapping, inside others), the floor's discard, membership, count, and the
    delayOffset.json round trip; a copy taken half way is not changed by what follows."""
    from broker.schedule.runs import OffsetRuns
    runs, model = OffsetRuns(), set()
    for i, (kind, start, length) in enumerate(ops):
        if i == len(ops) // 2:
            half, half_model = runs.copy(), sorted(model)
        if kind == 0:
            runs.add(start)
            model.add(start)
        elif kind == 1:
            runs.add_run(start, start + length)
            model.update(range(start, start + length))
        else:
            runs.update(range(start, start + length, 2))
            model.update(range(start, start + length, 2))
    if ops:
        runs.discard_below(bound // 2)
        model = {q for q in model if q >= bound // 2}
        assert list(half) == half_model and len(half) == len(half_model)
    assert list(runs) == sorted(model) and len(runs) == len(model)
    assert all((q in runs) == (q in model) for q in range(0, 4 * 4096 + 5000))
    assert all(runs.run_end(q) == next(e for e in range(q, 9 * 4096) if e not in model) for q in (0, bound))
    pieces = list(runs.iter_runs())
    assert all(e < s for (_, e), (s, _) in zip(pieces, pieces[1:]))     # in order, never touching
    assert OffsetRuns.from_json(json.loads(json.dumps(runs.to_json()))) == runs
    assert runs.discard_below(bound) == sum(1 for q in model if q < bound)
    assert list(runs) == sorted(q for q in model if q >= bound) and len(runs) == len(list(runs))


@bounded()
async def test_timers_delivered_behind_one_held_back_are_kept_as_runs_not_one_by_one(tmp_path):
    """One undelivered timer (up to timer_max_delay_s, 3 days) held the floor back while every timer after it was
    delivered: each was kept in a set (60 MB a million) and written to delayOffset.json one by one (9 MB a million,
    all of it again every 10 s). Timers falling due in the order they were sent are one run: one entry in memory
    and in the file, whatever the count; a restart reads the same progress back and delivers none of them again."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    await _schedule(svc, "T", b"held", {"TIMER_DELIVER_MS": str(clock.now + 86_400_000)}, clock.now)
    for i in range(600):
        await _schedule(svc, "T", b"due-%d" % i, {"TIMER_DELIVER_MS": str(clock.now + 1_000)}, clock.now)
    while await svc.run_due(101_000, 101_000) > 0:
        pass
    assert len(_delivered(svc.ctx.store, "T")) == 600
    done = svc.progress.timer_done
    assert (svc.progress.timer_floor, len(done), list(done.iter_runs())) == (0, 600, [(1, 601)])
    assert 0 not in done and all(q in done for q in (1, 300, 600)) and 601 not in done
    await svc.snapshot()
    path = os.path.join(svc.config_dir, "delayOffset.json")
    with open(path, "rb") as fh:
        saved = json.loads(fh.read())
    assert saved["timerDone"] == [[1, 600]]
    await svc.ctx.store.close()
    again = await _service(tmp_path, clock)     # from the file: the held timer waits, the rest stay delivered
    assert (again.progress.timer_floor, set(again.progress.timer_done)) == (0, set(range(1, 601)))
    assert [entry[1] for entry in again._timers] == [0] and dict(again.waiting())["timer"] == 1
    assert await again.run_due(102_000, 102_000) == 0
    await again.ctx.store.close()


def test_an_old_delay_offset_json_of_lone_timer_offsets_loads_and_one_of_runs_is_refused_by_int(tmp_path):
    """Old files list every delivered timer: read as they are. The new file's runs are lists, which an older
    broker's int() refuses: it says the file is unreadable and replays the progress records, where a new key it
    did not know would have been skipped silently, every timer in it delivered again."""
    from broker.schedule.progress import load_snapshot, write_snapshot
    write_snapshot(str(tmp_path), {"offsetTable": {"1": 4}, "timerFloor": 3, "timerDone": [9, 5, 7, 6, 2],
                                   "progressOffset": 8})
    p = load_snapshot(str(tmp_path))
    assert (p.levels, p.timer_floor, p.progress_offset) == ({1: 4}, 3, 8)
    assert p.timer_done.to_json() == [[5, 7], 9]            # 2, below the floor, is delivered by it already
    with pytest.raises(TypeError):
        [int(t) for t in p.to_json()["timerDone"]]        # what a broker before this change did with the file


@bounded()
async def test_a_timer_with_no_readable_unit_at_start_up_then_removed_leaves_the_waiting_count_right(
        tmp_path, monkeypatch):
    """A timer whose consume-queue unit was unreadable (zeroed) at start-up is not put in the heap. When retention
    then removed it, it was written off like the others (kept to be skipped in the heap, where it never was): the
    set kept it for good and txmq_schedule_messages_waiting{level="timer"} said one fewer than were waiting, below
    zero once the rest went."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    store = svc.ctx.store
    for i in range(2):
        await _schedule(svc, "T", b"lost-%d" % i, {"TIMER_DELIVER_MS": str(clock.now + 86_400_000)}, clock.now)
    while len(store.segments()) < 2:
        assert (await store.put(PutRequest.build("Filler", b"f" * 100_000))).ok
    await _schedule(svc, "T", b"kept", {"TIMER_DELIVER_MS": str(clock.now + 86_400_000)}, clock.now)
    await svc.stop()
    await store.close()

    queue_unit = MessageStore.queue_unit
    monkeypatch.setattr(MessageStore, "queue_unit", lambda self, topic, qid, offset: None
                        if (topic, offset) == (TIMER_TOPIC, 0) else queue_unit(self, topic, qid, offset))
    svc = await _service(tmp_path, clock)           # offset 0's unit reads as zeroed: not indexed
    monkeypatch.undo()
    store = svc.ctx.store
    assert dict(svc.waiting())["timer"] == 2
    await store.remove_segment(store.segments()[0].name, "test")
    assert await svc.run_due(102_000, 102_000) == 2     # both passed over as removed
    assert dict(svc.waiting())["timer"] == 1            # the kept one
    day = 100_000 + 86_400_000
    assert await svc.run_due(day, day) == 1
    assert [m.body for m in _delivered(store, "T")] == [b"kept"]
    assert dict(svc.waiting())["timer"] == 0 and not svc._written_off
    await store.close()


def test_a_sparse_set_of_delivered_timers_costs_what_it_holds_not_the_span_it_covers(monkeypatch):
    """Timers of mixed delays: a short one delivered now and then among thousands still waiting cut every chunk
    into a few runs. Its runs were found over every bit of the span (20 s a save for 300k delivered one in 1,000,
    against main's 0.2 s), and the loop's copy for a snapshot copied every chunk's 512 bytes (103 ms against 5)."""
    import broker.schedule.runs as runs_mod
    from broker.schedule.runs import CHUNK, OffsetRuns
    held = list(range(7, 400 * CHUNK, 1000))
    runs = OffsetRuns()
    runs.update(held)
    scanned = []
    compress = runs_mod.compress
    monkeypatch.setattr(runs_mod, "compress", lambda data, flags: scanned.append(len(flags)) or compress(data, flags))
    assert runs.to_json() == held and list(runs) == held
    assert sum(scanned) <= 8 * len(held)            # not the 1.6 M bits of the span
    snap = runs.copy()
    idx = held[0] // CHUNK
    assert snap._chunks[idx] is runs._chunks[idx]   # shared, not copied: the loop pays a dict's copy
    runs.update([8, 9])
    runs.discard_below(8)
    assert 8 in runs and 7 not in runs and list(snap) == held and 8 not in snap     # changed: copied first
    assert OffsetRuns.from_json(snap.to_json()) == snap


@bounded()
@pytest.mark.parametrize("keep", [0.5, 0.99])
async def test_a_torn_delay_offset_json_of_runs_and_bitmaps_is_replayed_from_the_log(tmp_path, keep, caplog):
    """Every other timer delivered behind held ones: the chunk is written as its bitmap. The file cut short (a
    torn write by hand, a copy cut off) is refused at start-up and the progress records replayed: the held ones
    wait, none delivered is delivered again."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    for i in range(300):
        delay = 86_400_000 if i % 2 == 0 else 1_000
        await _schedule(svc, "T", b"t-%d" % i, {"TIMER_DELIVER_MS": str(clock.now + delay)}, clock.now)
    while await svc.run_due(101_000, 101_000) > 0:
        pass
    await svc.snapshot()
    path = os.path.join(svc.config_dir, "delayOffset.json")
    with open(path, "rb") as fh:
        raw = fh.read()
    assert any(isinstance(item, str) for item in json.loads(raw)["timerDone"])     # a bitmap, not 150 lone ones
    await svc.ctx.store.close()
    with open(path, "wb") as fh:
        fh.write(raw[:int(len(raw) * keep)])
    again = await _service(tmp_path, clock)
    assert "ignoring unreadable" in caplog.text
    assert sorted(entry[1] for entry in again._timers) == list(range(0, 300, 2))
    assert set(again.progress.timer_done) == set(range(1, 300, 2)) and again.progress.timer_floor == 0
    assert await again.run_due(102_000, 102_000) == 0
    assert len(_delivered(again.ctx.store, "T")) == 150
    await again.ctx.store.close()


@bounded()
@pytest.mark.parametrize("done", [[[0, 10 ** 15]], [1, 3, 10 ** 15], ["%d:%s" % (10 ** 15 // 4096 * 4096,
                                                                                 "/" * 682 + "w=")]])
async def test_a_hand_edited_delay_offset_json_naming_timers_past_the_log_is_refused_and_replayed(
        tmp_path, done, caplog):
    """delayOffset.json without its crc (edited by hand) is taken as it reads. A run [0, 10**15] made start-up loop
    over 2.4e11 chunks (hung; the alarm below ends it); a lone offset or a bitmap past the timer queue's end marked
    timers not written yet as delivered, skipped when they come. Refused, said why, the log replayed instead."""
    import signal

    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    for i in range(6):
        delay = 86_400_000 if i % 2 == 0 else 1_000
        await _schedule(svc, "T", b"t-%d" % i, {"TIMER_DELIVER_MS": str(clock.now + delay)}, clock.now)
    assert await svc.run_due(101_000, 101_000) == 3
    await svc.stop()
    await svc.ctx.store.close()
    path = os.path.join(svc.config_dir, "delayOffset.json")
    with open(path) as fh:
        data = json.load(fh)
    del data["crc"]
    data["timerDone"] = done
    with open(path, "w") as fh:
        json.dump(data, fh)

    class Hung(BaseException):      # (not an OSError: load_snapshot would take a TimeoutError as a bad file)
        pass

    def hung(*_):
        raise Hung("start-up still loading delayOffset.json after 5 s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 5)
    try:
        again = await _service(tmp_path, clock)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert "ignoring unreadable" in caplog.text and "past the timer queue's end 6" in caplog.text
    with open(path) as fh:      # written over at once: once the log grew past them, it would have read as good
        assert "crc" in json.load(fh)
    assert sorted(entry[1] for entry in again._timers) == [0, 2, 4]
    assert set(again.progress.timer_done) == {1, 3, 5} and again.progress.timer_floor == 0
    assert await again.run_due(102_000, 102_000) == 0
    await _schedule(again, "T", b"t-6", {"TIMER_DELIVER_MS": str(clock.now + 1_000)}, clock.now)
    assert await again.run_due(103_000, 103_000) == 1      # offset 6, not taken as delivered
    assert len(_delivered(again.ctx.store, "T")) == 4
    await again.ctx.store.close()


@bounded()
async def test_a_removed_segment_of_delivered_timer_runs_is_looked_over_a_chunk_at_a_time(tmp_path, monkeypatch):
    """One timer held back, a million delivered after it (kept as runs: full chunks), their segment removed: the
    scan for removed timers asked each offset in turn whether it was delivered, SCAN_PER_TURN (65,536) a turn, 16
    turns of a few ms for what the runs say in one look a chunk. It finds the held one and passes the million in
    one turn, looking at chunks, not offsets."""
    from broker.schedule.runs import OffsetRuns
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    p, end = svc.progress, 1_000_001
    p.timer_done.add_run(1, end)
    p.timer_done.update([end + 5])              # (one delivered past the removed part: not looked at)
    svc._timers_indexed = end + 10
    min_offset = svc.ctx.store.min_offset
    monkeypatch.setattr(svc.ctx.store, "min_offset",
                        lambda topic, qid: end if topic == TIMER_TOPIC else min_offset(topic, qid))
    looks = []
    contains = OffsetRuns.__contains__
    monkeypatch.setattr(OffsetRuns, "__contains__", lambda self, q: looks.append(q) or contains(self, q))
    assert svc._removed_timers() == [0]
    assert svc._timers_min_next == end and len(looks) < 1000
    await svc.ctx.store.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20_000), st.integers(1, 9_000)), max_size=8),
       st.integers(0, 25_000), st.integers(0, 25_000), st.integers(1, 5_000))
def test_missing_is_the_offsets_a_set_does_not_hold(runs, start, span, most):
    """OffsetRuns.missing (the removed-timer scan) against a set of ints: runs of whole chunks, partial ones."""
    from broker.schedule.runs import OffsetRuns
    held, model = OffsetRuns(), set()
    for first, n in runs:
        held.add_run(first, first + n) if n % 3 else held.update(range(first, first + n, 2))
        model.update(range(first, first + n) if n % 3 else range(first, first + n, 2))
    want = [q for q in range(start, start + span) if q not in model][:most]
    assert held.missing(start, start + span, most) == want


@bounded()
async def test_a_held_batch_says_a_new_reason_but_not_a_growing_batch(tmp_path, caplog):
    """Held deliveries are said once, and again when the reason changes ("a new reason is said too"): the reason
    was told apart by the log line's format alone, so another refusal (another remark from the store) went unsaid
    while the deliveries stayed held; the count of messages waiting is no new reason."""
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    await _schedule(svc, "T", b"late", {"DELAY": "1"}, clock.now)
    disk = svc.ctx.store.disk
    why = ["the broker's disk is full"]
    disk.refusing, disk.still_refusing, disk.refuse = True, lambda: True, lambda: why[0]
    with caplog.at_level(logging.WARNING, logger="txmq.schedule"):
        assert await svc.run_due(101_000, 101_000) == -1
        disk.refusing = False           # (room for one more to wait: the held batch grows, no new reason)
        await _schedule(svc, "T", b"later", {"DELAY": "1"}, 101_000)
        disk.refusing = True
        assert await svc.run_due(102_500, 102_500) == -1
        why[0] = "the store's log cannot be written: EROFS"
        assert await svc.run_due(103_000, 103_000) == -1
        assert await svc.run_due(104_000, 104_000) == -1
    said = [r.getMessage() for r in caplog.records if r.name == "txmq.schedule"]
    assert len(said) == 2 and "disk is full" in said[0] and "EROFS" in said[1], said
    await svc.ctx.store.close()


@bounded()
async def test_a_hung_delay_offset_write_is_not_joined_by_a_second_on_the_same_file(tmp_path, monkeypatch, caplog):
    """A periodic delayOffset.json write that hung (a stopped NFS) was joined by the stop's own write of the same
    file, a second thread on the same .tmp: once the hang cleared the two could leave a file mixing both, and the
    first's end cleared the hung gauge while the second still hung. One write at a time; the stop says it wrote
    nothing (the progress is replayed from the log)."""
    import threading
    from broker.schedule import service as service_mod
    clock = Clock(100_000)
    svc = await _service(tmp_path, clock)
    started, release = [], threading.Event()

    def hangs(config_dir, view):
        started.append(view)
        release.wait(20)
    monkeypatch.setattr(service_mod, "write_snapshot", hangs)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(svc.snapshot(), 0.2)     # (the periodic loop's write, hung)
        with caplog.at_level(logging.ERROR, logger="txmq.schedule"):
            await svc.stop()
        assert len(started) == 1, "a second write of delayOffset.json started beside the hung one"
        assert "not written at stop" in caplog.text and "an earlier write has not ended" in caplog.text
    finally:
        release.set()
        await svc.ctx.store.close()


def test_readable_queue_edges():
    """topics.readable_queue (the schedule's due messages and a transaction's COMMIT): a queue the topic still reads
    is kept; one past its read queues goes to qid mod them (a retry topic's: the smaller of read and write); a
    topic not there, or reading none, is left as it is (moved: 0)."""
    from broker.topics import TopicConfig, readable_queue
    topics = {"T": TopicConfig("T", 4, 8), "%RETRY%g": TopicConfig("%RETRY%g", 4, 2),
              "None": TopicConfig("None", 0, 4)}
    assert readable_queue(topics, "T", 3) == (3, 0)
    assert readable_queue(topics, "T", 5) == (1, 4)        # written to 5 (write 8), but only 0-3 are read
    assert readable_queue(topics, "%RETRY%g", 1) == (1, 0)
    assert readable_queue(topics, "%RETRY%g", 3) == (1, 2)  # past its write queues: as one past retryQueueNums
    assert readable_queue(topics, "Gone", 7) == (7, 0)
    assert readable_queue(topics, "None", 3) == (3, 0)
