"""The parts of ops/spark that need no JVM: segment scanning, snapshot parsing, plan validation."""
from __future__ import annotations

import json
import os
import re

import pytest

from ops.spark import PlanError, validate_plan
from ops.spark import segments as seg
from ops.spark.plan import MAX_PROBLEMS, validate_plan_file, write_plan, write_plan_streaming
from ops.spark.snapshots import parse_line
from tests.spark.storegen import StoreBuilder

N = seg.ROW_FIELDS.index("n")       # a partial row's record count

T0 = 1710028800000
H = 3_600_000


def _store(tmp_path, n=120, segment_size=8192):
    """Plain messages, and every 10th a half message (a "rec" row)."""
    d = str(tmp_path / "store")
    with StoreBuilder(d, segment_size=segment_size) as b:
        for i in range(n):
            b.at(T0 + i * 60_000)
            if i % 10 == 9:
                b.half("pg", "Pay")
            else:
                b.send("Orders", b"m%03d" % i * 20, queue_id=i % 3)
        written = list(b.written)
    return d, written


def _rows(chunks):
    return [r for c in chunks for r in seg.decode_chunk(c)]


def _totals(rows):
    """What the rows say, independent of how the log was cut into chunks."""
    rec = sorted(r[2] for r in rows if r[0] == "rec")
    traffic, queues = {}, {}
    for r in rows:
        f = dict(zip(seg.ROW_FIELDS, r))
        if f["row"] == "msg":
            t = traffic.setdefault((f["store_ts"], f["topic"], f["pgroup"]), [0, 0, 0])
            t[0] += f["n"]
            t[1] += f["bytes"]
            t[2] += f["body_bytes"]
        elif f["row"] == "seg":
            q = queues.setdefault((f["segment"], f["topic"], f["queue_id"]), [0, 1 << 62, 0, -1])
            q[0] += f["n"]
            q[1] = min(q[1], f["store_ts"])
            q[2] = max(q[2], f["ts_max"])
            q[3] = max(q[3], f["qo_max"] if f["qo_max"] is not None else -1)
    return rec, traffic, queues


def test_rows_account_for_every_record_however_the_log_is_cut(tmp_path):
    d, written = _store(tmp_path)
    segments = seg.list_segments(d)
    assert len(segments) > 3 and segments[-1].active and not segments[0].active
    whole = _rows(seg.plan_chunks(d, 1 << 40)[1])
    _, small = seg.plan_chunks(d, 1000)
    assert len(small) > 2 * len(segments)
    assert _totals(_rows(small)) == _totals(whole)
    rec, traffic, queues = _totals(whole)
    assert rec == [w.offset for w in written if w.topic == "RMQ_SYS_TRANS_HALF_TOPIC"]
    plain = [w for w in written if w.topic == "Orders"]
    assert sum(t[0] for t in traffic.values()) == len(plain)
    assert sum(t[1] for t in traffic.values()) == sum(w.size for w in plain)
    assert sum(q[0] for q in queues.values()) == len(written)
    first = min(w.store_ts for w in written if w.offset < 8192)
    assert min(q[1] for k, q in queues.items() if k[0] == segments[0].name) == first
    assert max(q[3] for k, q in queues.items() if k[1] == "Orders") == max(w.queue_offset for w in plain)
    # half messages are indexed in the half topic's queue 0
    assert max(q[3] for k, q in queues.items() if k[1] == "RMQ_SYS_TRANS_HALF_TOPIC") == len(rec) - 1


def _corrupt(path, pos, data):
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(data)


def test_damage_names_position_and_stops_the_segment(tmp_path):
    d, written = _store(tmp_path)
    segments = seg.list_segments(d)
    victim = [w for w in written if w.offset // 8192 == 1][3]
    pos = victim.offset - segments[1].base
    # TOPICLENGTH (just after the body) now runs past the record
    _corrupt(segments[1].path, pos + 88 + len(victim.body), b"\x7f")
    rows = _rows(seg.plan_chunks(d, 1 << 40)[1])
    damage = [r for r in rows if r[0] == "dmg"]
    assert len(damage) == 1
    assert damage[0][1] == segments[1].name and damage[0][2] == victim.offset
    assert damage[0][3] == segments[1].size - pos
    assert f"record at {pos}" in damage[0][-1]
    counted = sum(r[N] for r in rows if r[0] == "seg")
    lost = [w for w in written if w.offset // 8192 == 1 and w.offset >= victim.offset]
    assert counted == len(written) - len(lost)


def test_zeros_end_the_data_but_garbage_after_them_is_damage(tmp_path, monkeypatch):
    d, written = _store(tmp_path, n=10, segment_size=1 << 20)
    (active,) = seg.list_segments(d)
    end = written[-1].offset + written[-1].size
    rows = list(seg.decode_chunk(seg.split_segment(active, 1 << 40)[0]))
    assert sum(r[N] for r in rows if r[0] == "seg") == 10 and not [r for r in rows if r[0] == "dmg"]
    _corrupt(active.path, end + 500, b"\x01")
    monkeypatch.setattr(seg, "ACTIVE_REREADS", 1)
    rows = list(seg.decode_chunk(seg.split_segment(active, 1 << 40)[0]))
    assert rows[-1][0] == "dmg" and rows[-1][2] == end
    assert f"non-zero bytes follow at {end + 500}" in rows[-1][-1]


def test_snapshot_lines_tolerate_missing_keys():
    assert parse_line("nope") == [("bad",) + (None,) * 7]
    assert parse_line('{"connections": 3}')[0][0] == "bad"
    assert parse_line("  ") == []
    line = json.dumps({"ts": 5, "connections": 2, "consumer_lag": [
        {"group": "g", "topic": "T", "queue_id": 1, "lag": 4}, {"group": 7, "lag": 1}]})
    assert parse_line(line + "\n", 9) == [("snap", 5, 2, None, None, None, None, 9),
                                          ("lag", 5, None, "g", "T", 1, 4, 9), ("incomplete",) + (None,) * 7]
    assert [r[0] for r in parse_line('{"ts": 9, "connections": 1, "consumer_lag": []}')] == ["snap"]


def _seg(name, first, last, end=100):
    return {"name": name, "start_offset": int(name), "end_offset": int(name) + end,
            "first_store_timestamp": first, "last_store_timestamp": last}


def _plan(**over):
    now, ret = 1_000 * H, 72 * H
    plan = {"version": 2, "store_id": "0b0e5a9c-3f0e-4d7e-9a51-0d6c1a2b3c4d", "created_ms": now,
            "retention_ms": ret, "now_ms": now,
            "halves": [{"commit_log_offset": 10, "queue_offset": 0, "producer_group": "g", "topic": "T",
                        "store_timestamp": now - ret - 1, "uniq_key": "U"}],
            "segments": [_seg("0" * 20, 1, now - ret - 1)]}
    plan.update(over)
    return plan


def test_validate_plan_accepts_a_good_plan_from_file_text_or_dict(tmp_path):
    path = str(tmp_path / "plan.json")
    write_plan(_plan(), path)
    assert validate_plan(path)["halves"][0]["commit_log_offset"] == 10
    with open(path) as f:
        assert validate_plan(f.read())["segments"][0]["name"] == "0" * 20
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".plan-")]


def test_a_plan_written_a_half_at_a_time_reads_as_one_written_whole_and_a_bad_half_writes_nothing(tmp_path):
    """The expiry job's driver writes the halves as it reads them (write_plan_streaming): each is checked as
    validate_plan checks it, and one that fails (or comes out of order: a duplicate would pass unseen) leaves the
    plan that was there as it was, and no temporary file."""
    plan = _plan()
    halves = [{**plan["halves"][0], "commit_log_offset": 10 + i, "uniq_key": f"U{i}é"} for i in range(5)]
    path = tmp_path / "plan.json"
    assert write_plan_streaming(plan, iter(halves), str(path)) == 5
    assert validate_plan(str(path)) == {**plan, "halves": halves}
    assert list(validate_plan(str(path))) == list(plan)             # the keys in the format's order
    assert write_plan_streaming(plan, iter([]), str(path)) == 0 and validate_plan(str(path))["halves"] == []
    write_plan_streaming(plan, iter(halves), str(path))
    before = path.read_bytes()
    young = {**halves[0], "commit_log_offset": 99, "store_timestamp": plan["now_ms"]}
    for bad, message in ((halves + [young], "halves[5]: store_timestamp"),
                         (halves[:3] + halves[2:], "halves[3]: commit_log_offset 12 is not past the one before"),
                         (halves[:2] + [7], "halves[2] is not an object")):
        with pytest.raises(PlanError, match=re.escape(message)):
            write_plan_streaming(plan, iter(bad), str(path))
        assert path.read_bytes() == before
    with pytest.raises(PlanError, match="segments are not listed oldest first"):
        write_plan_streaming(_plan(segments=[_seg("1".zfill(20), 1, 2), _seg("0" * 20, 1, 2)]), iter(halves),
                             str(path))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["plan.json"]


def test_a_plan_written_through_a_symlink_replaces_the_file_it_points_to(tmp_path):
    """The plan's path may be a link to where `admin apply-expiry` reads it (a shared mount). The temporary
    file was made beside the link and renamed over it: the link became a plain file, and the file it
    pointed to kept the first night's plan for good, every later night's halves never expired, nothing said."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "plan.json").write_text("{}")
    link = tmp_path / "plan.json"
    link.symlink_to(shared / "plan.json")
    write_plan(_plan(), str(link))
    assert link.is_symlink()
    assert validate_plan(str(shared / "plan.json"))["halves"][0]["commit_log_offset"] == 10
    assert sorted(os.listdir(tmp_path)) == ["plan.json", "shared"] and os.listdir(shared) == ["plan.json"]


def test_a_plan_that_is_a_mount_point_of_its_own_is_a_clear_error(tmp_path, monkeypatch):
    """A plan file bind-mounted on its own cannot be replaced by a rename (EBUSY): the error says why and
    what to mount instead, and no temporary file is left beside it."""
    import errno

    def busy(src, dst):
        raise OSError(errno.EBUSY, "Device or resource busy")
    monkeypatch.setattr(os, "replace", busy)
    with pytest.raises(OSError, match="plan.json in one rename .* mount the directory it is in instead"):
        write_plan(_plan(), str(tmp_path / "plan.json"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("change, message", [
    ({"version": 1}, "version"),
    ({"store_id": None}, "store_id"),
    ({"now_ms": "soon"}, "now_ms"),
    ({"retention_ms": 0}, "positive"),
    ({"halves": [{"commit_log_offset": 1}]}, "missing or mistyped"),
    ({"halves": [{"commit_log_offset": 1, "queue_offset": 0, "producer_group": "g", "topic": "T",
                  "store_timestamp": 1000 * H - 72 * H, "uniq_key": None}]}, "not older than the retention"),
    ({"segments": [{"name": "12", "first_store_timestamp": 1, "last_store_timestamp": 2}]}, "20-digit"),
    ({"segments": [_seg("1" * 20, 1, 2), _seg("0" * 20, 1, 2)]}, "oldest first"),
    ({"segments": [_seg("0" * 20, 1, 1000 * H)]}, "not all older"),
    ({"segments": [{"name": "0" * 20, "first_store_timestamp": 1, "last_store_timestamp": 2}]}, "must be integers"),
    ({"segments": [dict(_seg("0" * 20, 1, 2), start_offset=5)]}, "do not fit"),
])
def test_validate_plan_refuses_bad_plans(change, message, tmp_path):
    with pytest.raises(PlanError, match=message):
        validate_plan(_plan(**change))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(**change)))
    with pytest.raises(PlanError, match=message):       # (read from its file a half at a time: the same)
        validate_plan_file(str(path))


def _many_halves(plan, n, **over):
    return [{**plan["halves"][0], "commit_log_offset": 10 + i, "uniq_key": f"U{i:08d}", **over} for i in range(n)]


def test_validate_plan_of_a_big_plan_file_holds_none_of_its_halves(tmp_path, capsys):
    """`ops.spark validate-plan` json.load-ed the plan: 880 MB of memory for 1M halves (a 170 MB plan), 10M past
    what a host has. It reads the halves one at a time now; its answer is the same."""
    import tracemalloc

    from ops.spark.cli import main

    plan = _plan()
    path = str(tmp_path / "plan.json")
    write_plan(plan, path)
    assert main(["validate-plan", path]) == 0       # (what it imports, imported before memory is traced)
    capsys.readouterr()
    assert write_plan_streaming(plan, iter(_many_halves(plan, 20_000)), path) == 20_000
    size = os.path.getsize(path)
    assert size > 2_500_000
    tracemalloc.start()
    try:
        assert main(["validate-plan", path]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert json.loads(capsys.readouterr().out) == {"valid": True, "halves": 20_000, "segments": 1}
    assert peak < size / 4, (peak, size)            # (json.load of it: some 5 times its size)


def test_a_plan_with_many_bad_halves_is_refused_naming_the_first_and_counting_the_others(tmp_path):
    """A plan made with another retention (every half young by this one) was refused naming each half: one
    stderr line of ~100 bytes a half (100 MB for 1M halves), every one held until then."""
    plan = _plan()
    halves = _many_halves(plan, 1_000, store_timestamp=plan["now_ms"])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan, "halves": halves}))
    for check in (lambda: validate_plan({**plan, "halves": halves}), lambda: validate_plan_file(str(path))):
        with pytest.raises(PlanError) as err:
            check()
        said = str(err.value)
        assert said.count("store_timestamp") == MAX_PROBLEMS and "halves[0]: store_timestamp" in said
        assert said.endswith(f"; and {1_000 - MAX_PROBLEMS} more problems")


def test_a_plan_file_out_of_order_cut_short_or_with_its_fields_last_is_checked_as_a_whole_one(tmp_path):
    """validate_plan_file finds a half listed twice without a set of them all when they come in order (as the expiry
    job writes them) and with one when not; a plan whose fields follow its halves (written by hand) is checked all
    the same; one cut short is refused."""
    plan = _plan()
    halves = _many_halves(plan, 5)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan, "halves": halves[3:] + halves}))
    with pytest.raises(PlanError, match=re.escape("halves[5]: commit_log_offset 13 is listed twice; halves[6]: "
                                                  "commit_log_offset 14 is listed twice")):
        validate_plan_file(str(path))
    path.write_text(json.dumps({**plan, "halves": halves[::-1]}))
    assert validate_plan_file(str(path))["halves"] == 5
    last = {"halves": halves[::-1] + [{**halves[0], "commit_log_offset": 1, "store_timestamp": plan["now_ms"]}],
            **{k: v for k, v in plan.items() if k != "halves"}}
    path.write_text(json.dumps(last))
    with pytest.raises(PlanError, match=r"^halves\[5\]: store_timestamp"):
        validate_plan_file(str(path))
    write_plan_streaming(plan, iter(halves), str(path))
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(PlanError, match="cannot read the expiry plan"):
        validate_plan_file(str(path))
    with pytest.raises(PlanError, match="cannot read the expiry plan"):
        validate_plan_file(str(tmp_path / "missing.json"))


def test_a_plan_file_whose_retention_is_given_again_after_its_halves_is_checked_by_the_last(tmp_path):
    """Of a key given twice the last counts (json.load's, the broker's): validate_plan_file checked the halves
    against the cutoff of the fields before them, so a plan whose now_ms or retention_ms is given again after its
    halves was found valid with every half young by its own cutoff (and one old by it refused)."""
    plan = _plan()
    head = {k: v for k, v in plan.items() if k != "segments"}
    path = tmp_path / "plan.json"
    for late in (f'"now_ms": {plan["now_ms"] - plan["retention_ms"]}',       # (its half young by either)
                 f'"retention_ms": {plan["retention_ms"] + 2}'):
        path.write_text(json.dumps(head)[:-1] + f', "segments": [], {late}}}')
        with pytest.raises(PlanError, match=r"halves\[0\]: store_timestamp"):
            validate_plan(str(path))
        with pytest.raises(PlanError, match=r"halves\[0\]: store_timestamp"):
            validate_plan_file(str(path))
    # and the other way: the fields before the halves would refuse them, the last ones take them
    early = {**head, "retention_ms": plan["retention_ms"] * 2}
    path.write_text(json.dumps(early)[:-1] + f', "segments": [], "retention_ms": {plan["retention_ms"]}}}')
    assert validate_plan(str(path))["retention_ms"] == plan["retention_ms"]
    assert validate_plan_file(str(path))["halves"] == 1


def test_validate_plan_refuses_unreadable_input(tmp_path):
    with pytest.raises(PlanError, match="cannot read"):
        validate_plan(str(tmp_path / "missing.json"))
    with pytest.raises(PlanError, match="cannot read"):
        validate_plan(b"{not json")


def test_a_plan_nested_too_deep_to_read_is_refused_not_a_traceback(tmp_path):
    """A half nested 100,000 lists deep (a plan written by hand, or damaged) made json.load and the plan's reader
    raise RecursionError: `validate-plan` ended in a traceback, not "cannot read the expiry plan", exit 1."""
    from ops.spark.cli import main

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(halves=[]))[:-1].replace('"halves": []', '"halves": [' + "[" * 100_000
                                                              + "]" * 100_000 + "]") + "}")
    for check in (validate_plan, validate_plan_file):
        with pytest.raises(PlanError, match="cannot read the expiry plan: .*nested too deep"):
            check(str(path))
    assert main(["validate-plan", str(path)]) == 1


def test_the_last_chunk_says_where_the_data_ends_and_an_unreadable_file_is_an_err_row(tmp_path):
    d, written = _store(tmp_path)
    segments = seg.list_segments(d)
    ends = {r[1]: r[2] for r in _rows(seg.plan_chunks(d, 1000)[1]) if r[0] == "end"}
    for s in segments:
        mine = [w for w in written if s.base <= w.offset < s.base + s.size]
        assert ends[s.name] == max(w.offset + w.size for w in mine)
    os.unlink(segments[1].path)
    rows = list(seg.decode_chunk(seg.Chunk(segments[1], 0, segments[1].size, True)))
    assert [r[0] for r in rows] == ["err"]
    assert f"cannot read {segments[1].path} on host " in rows[0][-1] and "No such file" in rows[0][-1]


def test_the_manifest_picks_the_segments_a_day_can_be_in(tmp_path):
    from ops.spark.manifest import can_hold, segments_for_window

    assert can_hold(None, 0, 10)                                        # unknown: read it
    assert can_hold({"first_ts": 5, "last_ts": 20, "sealed": True}, 0, 10)
    assert not can_hold({"first_ts": 10, "last_ts": 20, "sealed": True}, 0, 10)
    assert not can_hold({"first_ts": 1, "last_ts": 4, "sealed": True}, 5, 10)
    assert can_hold({"first_ts": 1, "last_ts": 4, "sealed": False}, 5, 10)      # active: still growing
    assert not can_hold({"first_ts": -1, "last_ts": -1, "sealed": True}, 5, 10)
    d, written = _store(tmp_path)                                   # 2 h of records, one a minute
    segments = seg.list_segments(d)
    hour2 = segments_for_window(segments, d, T0 + H, T0 + 2 * H)
    assert segments[0] not in hour2 and segments[-1] in hour2
    assert {w.offset // 8192 for w in written if w.store_ts >= T0 + H} == {int(s.name) // 8192 for s in hour2}
    os.unlink(os.path.join(d, "segments.json"))
    assert segments_for_window(segments, d, T0 + H, T0 + 2 * H) == segments


def test_a_missing_store_is_one_line_naming_it(tmp_path):
    from protocol.errors import StoreError

    with pytest.raises(StoreError, match=r"store directory .*nowhere does not exist on host \S+"):
        seg.list_segments(str(tmp_path / "nowhere"))


def test_a_sealed_segment_cut_short_or_zeroed_after_a_record_is_damage_not_fewer_rows(tmp_path):
    """A sealed segment's data ends at its end marker; a file that stops at a record boundary
    before it (a copy cut short, a tail zeroed) has lost records, which must not look like a
    quiet hour."""
    d, written = _store(tmp_path)
    segments = seg.list_segments(d)
    cut, zeroed = ([w for w in written if w.offset // 8192 == k][3] for k in (1, 2))
    os.truncate(segments[1].path, cut.offset - segments[1].base)     # the file stops at a record boundary
    with open(segments[2].path, "r+b") as f:                          # zeros from a record on
        f.seek(zeroed.offset - segments[2].base)
        f.write(bytes(segments[2].base + 8192 - zeroed.offset))
    rows = _rows(seg.plan_chunks(d, 1 << 40)[1])
    damage = {r[1]: r for r in rows if r[0] == "dmg"}
    assert set(damage) == {segments[1].name, segments[2].name}
    assert [damage[s.name][2] for s in segments[1:3]] == [cut.offset, zeroed.offset]
    assert all("end marker" in damage[s.name][-1] for s in segments[1:3])


def test_the_segment_before_the_brokers_unwritten_spare_is_still_the_active_one(tmp_path):
    """The broker creates the next segment before it needs it (store/reserve.py): until that
    spare holds a record, the segment before it is being written and has no end marker yet."""
    d, written = _store(tmp_path)
    segments = seg.list_segments(d)
    spare = os.path.join(d, "commitlog", f"{segments[-1].base + 8192:020d}")
    with open(spare, "wb") as f:
        f.truncate(8192)
    listed = seg.list_segments(d)
    assert [s.active for s in listed] == [False] * (len(segments) - 1) + [True, True]
    rows = _rows(seg.plan_chunks(d, 1 << 40)[1])
    assert not [r for r in rows if r[0] == "dmg"]
    assert sum(r[N] for r in rows if r[0] == "seg") == len(written)


def test_timer_messages_and_scheduler_progress_are_not_counted_as_traffic(tmp_path):
    """A timer message waits on rmq_sys_wheel_timer and is counted when delivered to its real topic
    (as SCHEDULE_TOPIC_XXXX's delayed messages are); the scheduler's progress records are nobody's
    traffic. RocketMQ 5 names its system topics rmq_sys_*."""
    d = str(tmp_path / "store")
    with StoreBuilder(d) as b:
        b.at(T0).send("rmq_sys_wheel_timer", b"later", props={"TIMER_DELAY_SEC": "60", "REAL_TOPIC": "Orders",
                                                               "REAL_QID": "0"})
        b.at(T0 + 1).send("rmq_sys_schedule_progress", b"{}")
        b.at(T0 + 60_000).send("Orders", b"later")            # the same message, delivered
    rows = [dict(zip(seg.ROW_FIELDS, r)) for r in _rows(seg.plan_chunks(d, 1 << 40)[1])]
    assert {(r["topic"], r["n"]) for r in rows if r["row"] == "msg"} == {("Orders", 1)}


@pytest.mark.parametrize("conf, message", [("spark.sql.session.timeZone=America/New_York", "must stay UTC"),
                                           ("spark.sql.sources.partitionOverwriteMode=static", "must stay dynamic"),
                                           ("spark.executor.memory", "is not KEY=VALUE")])
def test_a_conf_the_results_rest_on_is_refused_before_spark_starts(tmp_path, capsys, conf, message):
    """--conf spark.sql.session.timeZone=America/New_York was taken: every window (UTC milliseconds) was
    labelled with New York's date, so the five hours before UTC midnight fell out of the date they were
    computed for and its tables lost them, nothing said. A --conf without "=" was a traceback."""
    from ops.spark import cli

    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["rollup", "--store-dir", str(tmp_path), "--out", str(tmp_path / "o"),
                                       "--conf", conf])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    args = cli.build_parser().parse_args(["expiry", "--store-dir", str(tmp_path), "--out", str(tmp_path / "p"),
                                          "--conf", "spark.sql.session.timeZone=UTC", "--conf", "a.b=c=d"])
    assert dict(args.conf) == {"spark.sql.session.timeZone": "UTC", "a.b": "c=d"}


@pytest.mark.parametrize("conf", ["spark.sql.session.timeZone=Etc/UTC", "spark.sql.session.timeZone=Z",
                                  "spark.sql.session.timeZone=+00:00", "spark.sql.session.timeZone=GMT",
                                  "spark.sql.session.timeZone=UTC+0", "spark.sql.session.timeZone=Etc/GMT+0",
                                  "spark.sql.sources.partitionOverwriteMode=DYNAMIC"])
def test_a_conf_that_names_the_same_setting_otherwise_is_taken(tmp_path, conf):
    """UTC under another of its names (Etc/UTC, Z, +00:00, GMT) labels every window with the same date, and
    Spark takes the overwrite mode in any case: refusing them broke set-ups that were right."""
    from ops.spark import cli

    args = cli.build_parser().parse_args(["rollup", "--store-dir", str(tmp_path), "--out", str(tmp_path / "o"),
                                          "--conf", conf])
    assert dict(args.conf) == dict([conf.split("=", 1)])


@pytest.mark.parametrize("zone", ["UTC+1", "+01:00", "Europe/London", "Etc/GMT+1", "utcx"])
def test_a_time_zone_that_only_looks_like_utc_is_still_refused(tmp_path, capsys, zone):
    from ops.spark import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["rollup", "--store-dir", str(tmp_path), "--out", str(tmp_path / "o"),
                                       "--conf", f"spark.sql.session.timeZone={zone}"])
    assert "must stay UTC" in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_a_plan_is_readable_as_the_umask_allows_for_apply_expiry_run_as_another_user(tmp_path, umask):
    """The plan was made by mkstemp, mode 0600 whatever the umask: `admin apply-expiry` run as the broker's
    user could not read it. Now 0644 less the umask, as the rollup's reports are made."""
    old = os.umask(umask)
    try:
        write_plan(_plan(), str(tmp_path / "plan.json"))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "plan.json").st_mode & 0o777 == 0o644 & ~umask
    assert os.listdir(tmp_path) == ["plan.json"]


def test_the_spark_benchs_pure_python_baseline_counts_every_record(tmp_path):
    """bench/bench_spark.py's baseline sums the partials' record counts by column: a column added to the rows
    (half_qo) must not make it sum another one (it failed on None)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "bench", "bench_spark.py")
    spec = importlib.util.spec_from_file_location("bench_spark_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    d, written = _store(tmp_path, n=30)
    assert bench.pure_python(d)[0] == len(written)


def test_traffic_names_a_producer_group_only_for_committed_transactions(tmp_path):
    """The traffic rollup's producer group was any record's PGROUP: a plain message whose client wrote another
    group's name there (PGROUP is free text to a client), or a retry copy carrying its source's, was counted as
    that group's traffic. Only a committed transaction's message (COMMIT type, written by the broker from a half
    whose PGROUP was its sender's group) names one now."""
    d = str(tmp_path / "store")
    with StoreBuilder(d) as b:
        b.at(T0)
        half = b.half("pg-pay", "Pay")
        b.commit(half)
        b.send("Pay", b"forged", props={"PGROUP": "pg-pay"})
        b.send("%RETRY%cg", b"again", props={"PGROUP": "pg-pay", "RETRY_TOPIC": "Pay"})
    rows = [dict(zip(seg.ROW_FIELDS, r)) for r in _rows(seg.plan_chunks(d, 1 << 40)[1])]
    counted = {}
    for r in rows:
        if r["row"] == "msg":
            counted[(r["topic"], r["pgroup"])] = counted.get((r["topic"], r["pgroup"]), 0) + r["n"]
    assert counted == {("Pay", "pg-pay"): 1, ("Pay", seg.NO_GROUP): 1, ("%RETRY%cg", seg.NO_GROUP): 1}


def test_a_user_topic_named_like_the_transaction_topics_is_traffic(tmp_path):
    """RocketMQ's (and the broker's) system prefix is rmq_sys_; RMQ_SYS_TRANS_HALF_TOPIC and its kin are names of
    their own. A client's topic RMQ_SYS_Orders is made on first send like any other, but the rollup took every
    RMQ_SYS_* topic for the broker's and left its traffic out."""
    d = str(tmp_path / "store")
    with StoreBuilder(d) as b:
        b.at(T0).send("RMQ_SYS_Orders", b"counted")
        b.send("RMQ_SYS_TRACE_TOPIC", b"a trace")
        b.send("rmq_sys_schedule_progress", b"{}")
        b.half("pg", "Pay")
    assert not seg.is_traffic("RMQ_SYS_TRANS_HALF_TOPIC", 0) and not seg.is_traffic("RMQ_SYS_TRANS_OP_HALF_TOPIC", 0)
    rows = [dict(zip(seg.ROW_FIELDS, r)) for r in _rows(seg.plan_chunks(d, 1 << 40)[1])]
    assert {(r["topic"], r["n"]) for r in rows if r["row"] == "msg"} == {("RMQ_SYS_Orders", 1)}


def test_a_report_a_full_disk_cuts_short_leaves_no_partial_tmp_behind(tmp_path, monkeypatch):
    """A daily report's write refused by ENOSPC half-way left txmq-DATE.html.tmp behind, holding the pages that
    were free until a later run for that date fitted. Now the write fails as before and the .tmp goes with it."""
    import builtins
    import errno

    from ops.spark import report as report_mod
    monkeypatch.setattr(report_mod, "collect", lambda tables, dates, summary: {"2026-01-01": {}})
    monkeypatch.setattr(report_mod, "render_html", lambda data: "<html>" + "x" * 100_000)
    monkeypatch.setattr(report_mod, "render_csv", lambda data: "date\n")

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def write(self, text):
            self.fh.write(text[:4096])
            self.fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr(report_mod, "open", lambda *a, **kw: Full(builtins.open(*a, **kw)), raising=False)
    out = tmp_path / "reports"
    with pytest.raises(OSError, match="No space left"):
        report_mod.write_reports(str(out), ["2026-01-01"], {}, {})
    assert os.listdir(out) == []


def test_a_record_whose_transaction_type_bit_flipped_is_counted_as_the_broker_serves_it(tmp_path):
    """SYSFLAG's bit 0x4 is outside the CRC: flipped at rest, the broker's start (and a slave copying it) reads a
    record typed PREPARED/ROLLBACK that carries a non-zero QUEUEOFFSET with the bit put back and serves it, but the
    rollup took the type as read: the message left out of its topic's traffic and its queue's offsets."""
    d = str(tmp_path / "store")
    with StoreBuilder(d) as b:
        b.at(T0)
        for i in range(3):
            b.send("Orders", b"m%d" % i)
        written = list(b.written)
    victim = written[1]
    assert victim.queue_offset == 1
    segment = seg.list_segments(d)[0]
    with open(segment.path, "r+b") as f:
        f.seek(victim.offset - segment.base + 39)
        flag = f.read(1)[0]
        f.seek(victim.offset - segment.base + 39)
        f.write(bytes([flag ^ 0x04]))
    _, traffic, queues = _totals(_rows(seg.plan_chunks(d, 1 << 40)[1]))
    assert sum(t[0] for k, t in traffic.items() if k[1] == "Orders") == 3
    assert [q[3] for k, q in queues.items() if k[1] == "Orders"] == [2]


def test_the_error_line_of_halves_held_back_says_how_many_the_report_names(caplog):
    """The ERROR line said "the report names the first 1000" of 2 halves held back (UNSETTLED_LISTED, whatever the
    report held): it says how many it names, and that they are the first only when some are not named."""
    import logging

    from ops.spark import expiry

    said = {}
    for held in ([5, 9], list(range(expiry.UNSETTLED_LISTED))):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="ops.spark"):
            expiry._say_damaged_ops({"misnamed": 0, "unreadable": 0, "unplaced": 0, "unsettled_halves": held,
                                     "unsettled": len(held) * (1 if len(held) == 2 else 3)})
        said[len(held)] = caplog.records[-1].getMessage()
    assert "(first: 5; the report names them all)" in said[2], said[2]
    n = expiry.UNSETTLED_LISTED
    assert f"expiry: {3 * n} half message(s)" in said[n] and f"the report names the first {n})" in said[n], said[n]
