"""`admin apply-expiry` sends a plan of many halves in parts: a slice of its halves a request, each with the plan's
header, then its segments alone (the broker judges a plan's halves before its segments)."""
from __future__ import annotations

import json

from broker.admin import PART_BYTES, plan_parts

HEADER = {"version": 2, "store_id": "s", "created_ms": 1, "retention_ms": 2, "now_ms": 3}


def _plan(n_halves: int) -> dict:
    return {**HEADER, "halves": [{"commit_log_offset": i} for i in range(n_halves)],
            "segments": [{"name": "0" * 20}], "report": {"segments": 1}}


def _parts_of_4() -> list[dict]:
    """A plan of 5 halves in 4 parts, each with its place as the admin sends it."""
    return [{**p, "part": n, "parts": 4} for n, p in enumerate(plan_parts(_plan(5), 2), 1)]


async def _send_part(ctx, conn, part, code=None):
    """TXMQ_APPLY_EXPIRY of ``part`` on ``conn``, to the broker's processor; its reply must be ``code`` (SUCCESS)."""
    from broker.processors.transaction import apply_expiry
    from protocol.codes import RequestCode, ResponseCode
    from protocol.command import RemotingCommand

    cmd = RemotingCommand.request(RequestCode.TXMQ_APPLY_EXPIRY, body=json.dumps(part).encode())
    assert (await apply_expiry(ctx, conn, cmd)).code == (ResponseCode.SUCCESS if code is None else code)


def _warned(caplog) -> list[str]:
    """The WARNING (and worse) lines said since the last call."""
    import logging

    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    return lines


def test_a_plan_within_a_slice_is_sent_as_it_is():
    plan = _plan(3)
    assert plan_parts(plan, 3) == [plan]
    assert plan_parts([1, 2], 1) == [[1, 2]] and plan_parts({"halves": "x"}, 1) == [{"halves": "x"}]


def test_a_plan_over_a_slice_is_its_halves_in_order_then_its_segments():
    parts = plan_parts(_plan(5), 2)
    assert [[h["commit_log_offset"] for h in p["halves"]] for p in parts] == [[0, 1], [2, 3], [4], []]
    assert [p["segments"] for p in parts] == [[], [], [], [{"name": "0" * 20}]]
    assert all({k: p[k] for k in HEADER} == HEADER and "report" not in p for p in parts)


def test_a_part_is_bounded_in_bytes_whatever_its_halves_carry():
    """A half's uniq_key is what its producer put in its properties (up to 32,767 bytes, six JSON bytes a character
    not in ASCII): 1,000 of them were a part over the 16 MiB frame a broker reads, never sent."""
    plan = {**HEADER, "halves": [{"commit_log_offset": i, "uniq_key": "é" * 6000} for i in range(1200)],
            "segments": [{"name": "0" * 20}]}
    parts = plan_parts(plan)
    assert all(len(json.dumps(p).encode()) <= PART_BYTES for p in parts)
    assert [h for p in parts for h in p["halves"]] == plan["halves"] and parts[-1]["segments"] == plan["segments"]
    small = _plan(2500)         # halves of a few bytes: a thousand a part, as before
    assert [len(p["halves"]) for p in plan_parts(small)] == [1000, 1000, 500, 0]


def test_apply_expiry_fails_when_a_listed_half_is_still_undecided(tmp_path, monkeypatch, capsys):
    """The store refused a half's dead letter (a full disk): listed under "skipped", the admin exited 0 and a
    nightly unit reported success with the half not expired. Halves only decided meanwhile are no failure."""
    import asyncio

    from broker import admin

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(2)))
    replies = {
        "meanwhile": {"expired": [0], "skipped": [{"commit_log_offset": 1, "why": "already decided or unknown"}]},
        "refused": {"expired": [0], "skipped": [{"commit_log_offset": 1, "undecided": True,
                                                 "why": "store refused the decision: SERVICE_NOT_AVAILABLE"}]},
    }
    codes = {}
    for name, reply in replies.items():
        async def fake(addr, plan, timeout, credentials, halves_a_request, reply=reply):
            await asyncio.sleep(0)
            return {**reply, "segments_removed": [], "segments_kept": [], "segments_gone": []}, None
        monkeypatch.setattr(admin, "_apply_plan", fake)
        codes[name] = admin.main(["apply-expiry", str(path)])
        codes[name, "err"] = capsys.readouterr().err
    assert codes["meanwhile"] == 0 and codes["refused"] == 1, codes
    assert "1 listed half not expired, still undecided" in codes["refused", "err"], codes
    assert "store refused the decision: SERVICE_NOT_AVAILABLE" in codes["refused", "err"]
    assert "apply the plan again" in codes["refused", "err"]


def _big_plan(n_halves: int) -> dict:
    """Halves as the nightly job lists them (~190 JSON bytes each)."""
    return {**HEADER, "halves": [{"commit_log_offset": i * 300, "queue_offset": i, "producer_group": f"pg-{i % 7}",
                                  "topic": "orders", "store_timestamp": 1_700_000_000_000 + i,
                                  "uniq_key": "7F0000010B6418B4AAC2%012X" % i} for i in range(n_halves)],
            "segments": [{"name": "0" * 20}], "report": {"segments": 1}}


def _apply_counting(monkeypatch, path, *argv):
    """admin.main(apply-expiry path), its parts made and looked at but not sent: (exit code, what was seen: the
    parts' halves' commit-log offsets (every 1,000th: the test's own memory), their segments, the peak memory
    traced while it ran)."""
    import asyncio
    import tracemalloc

    from broker import admin

    seen: dict = {"offsets": [], "segments": [], "sizes": []}

    async def fake(addr, plan, timeout, credentials, halves_a_request):
        parts = admin.plan_parts(plan, halves_a_request)
        for part in parts:
            seen["n"] = seen.get("n", 0) + len(part["halves"])
            seen["offsets"] += [h["commit_log_offset"] for h in part["halves"][::1000]]
            seen["segments"] += part["segments"]
            seen["sizes"].append(len(json.dumps(part).encode()))
            assert "report" not in part and {k: part[k] for k in HEADER} == HEADER
        seen["parts"] = len(parts)
        await asyncio.sleep(0)
        return {"expired": [], "skipped": []}, None

    monkeypatch.setattr(admin, "_apply_plan", fake)
    tracemalloc.start()
    try:
        code = admin.main(["apply-expiry", str(path), *argv])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return code, seen, peak


def test_a_big_plan_is_applied_without_holding_its_halves(tmp_path, monkeypatch):
    """`json.load` of the plan held every half: 1,000,000 listed halves (a 191 MB file) took 972 MB of the admin's
    memory, 10,000,000 some 10 GB. Read as it is sent, the halves of a part or two are held at a time."""
    plan = _big_plan(40_000)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    size = path.stat().st_size
    code, seen, peak = _apply_counting(monkeypatch, path)
    assert code == 0
    assert seen["n"] == 40_000 and seen["offsets"] == [h["commit_log_offset"] for h in plan["halves"][::1000]]
    assert seen["segments"] == plan["segments"] and seen["parts"] == 41
    assert peak < size / 2, (peak, size)


def test_a_big_plan_read_from_its_file_is_parted_as_the_plan_itself(tmp_path, monkeypatch):
    """The parts of a plan read from its file are those of the plan loaded whole (bounded in bytes the same way)."""
    from broker import admin

    monkeypatch.setattr(admin, "PART_BYTES", 64 * 1024)
    plan = _big_plan(900)
    for i in range(0, 900, 97):
        plan["halves"][i]["uniq_key"] = "é" * (i * 20)          # some halves big, one over a part alone
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan, ensure_ascii=False), encoding="utf-8")
    read = admin._read_plan(str(path))
    try:
        assert list(admin.plan_parts(read, 50)) == admin.plan_parts(plan, 50)
        assert len(admin.plan_parts(read, 50)) == len(admin.plan_parts(plan, 50))
    finally:
        read.close()


def test_a_big_plan_is_read_twice_its_parts_cut_as_it_is_checked(tmp_path, monkeypatch):
    """A big plan was read three times (checked, its parts counted, then sent) and each part encoded to be measured
    twice: 1M halves took 37 s before a broker saw any. It is cut into parts as it is checked and read once more as
    it is sent (22 s); the parts are those of the plan loaded whole, whatever the slice, and those of a plan whose
    fields follow its halves (their room not known as the halves were cut) too."""
    from broker import admin
    from protocol import plan_stream

    monkeypatch.setattr(admin, "PART_BYTES", 64 * 1024)
    reads = []
    real = plan_stream.PlanFile.halves
    monkeypatch.setattr(plan_stream.PlanFile, "halves", lambda self: reads.append(1) or real(self))
    plan = _big_plan(900)
    for i in range(0, 900, 97):
        plan["halves"][i]["uniq_key"] = "é" * (i * 20)          # some halves big, one over a part alone
    path = tmp_path / "plan.json"
    for text in (json.dumps(plan), json.dumps({"halves": plan["halves"], **{k: v for k, v in plan.items()
                                                                           if k != "halves"}})):
        path.write_text(text)
        for count in (50, 1000):
            read = admin._read_plan(str(path), count)
            try:
                parts = admin.plan_parts(read, count)
                got = list(parts)
            finally:
                read.close()
            assert len(reads) == (2 if text.startswith('{"halves"') else 1), (count, len(reads))
            assert got == admin.plan_parts(plan, count) and len(parts) == len(got)
            reads.clear()
    code, seen, _ = _apply_counting(monkeypatch, path, "--slice", "70")
    assert code == 0 and seen["n"] == 900 and len(reads) == 2       # (its fields last: counted on a read of its own)
    reads.clear()
    path.write_text(json.dumps(plan))
    code, seen, _ = _apply_counting(monkeypatch, path, "--slice", "70")
    assert code == 0 and seen["n"] == 900 and len(reads) == 1 and seen["parts"] == len(admin.plan_parts(plan, 70))


def test_a_plan_nested_too_deep_to_read_is_refused_not_a_traceback(tmp_path, monkeypatch, capsys):
    """A half nested 100,000 lists deep: json.load (a small plan) and the big plan's reader raised RecursionError, a
    traceback, not "cannot read plan", exit 2. Neither is sent."""
    from broker import admin

    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "plan.json"
    for pad in (0, 5 * 1024 * 1024):            # (read whole, and read value by value: over PART_BYTES)
        path.write_text(json.dumps({**HEADER, "report": "x" * pad, "halves": []})[:-2] + deep + "]}")
        monkeypatch.setattr(admin, "open_connection", None)     # (never reached)
        assert admin.main(["apply-expiry", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"cannot read plan {path}: " in err and "nested too deep" in err, err


def test_a_big_plan_that_is_not_one_is_refused_before_any_part_is_sent(tmp_path, monkeypatch):
    from broker import admin

    monkeypatch.setattr(admin, "PART_BYTES", 1024)
    plan = _big_plan(50)
    cases = {"a half not an object": {**plan, "halves": plan["halves"] + [7]},
             "segments not a list": {**plan, "segments": "x"},
             "cut short": json.dumps(plan)[:-40],
             "extra data": json.dumps(plan) + "{}",
             "not an object": json.dumps(plan["halves"])}
    for name, body in cases.items():
        path = tmp_path / "plan.json"
        path.write_text(body if isinstance(body, str) else json.dumps(body))
        code, seen, _ = _apply_counting(monkeypatch, path)
        assert code == 2 and seen["offsets"] == [] and "parts" not in seen, name


def _parts_both_ways(monkeypatch, tmp_path, text: str, chunks) -> dict:
    """The parts of the plan ``text`` read as a big plan (value by value, ``chunks`` characters a read) and loaded
    whole (json.load): {chunk: (what json.load gave, what the reader gave)} where they differ."""
    from broker import admin
    from protocol import plan_stream
    from broker.retention import PlanRefused

    def outcome(read):
        try:
            plan = read()
            return list(admin.plan_parts(plan, 3))
        except PlanRefused as exc:
            return ("refused", str(exc))
        except ValueError:
            return ("not JSON",)

    def whole():
        plan = json.loads(text.encode())          # (as the admin loads a small plan: bytes, a BOM skipped)
        if isinstance(plan, dict):
            admin.check_plan_lists(plan)
        return plan

    path = tmp_path / "plan.json"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setattr(admin, "PART_BYTES", 200)            # (the file is over it: read value by value)
    assert path.stat().st_size > 200
    expected, differ = outcome(whole), {}
    opened = []

    def streamed():
        opened.append(admin._read_plan(str(path)))
        return opened[-1]

    for chunk in chunks:
        monkeypatch.setattr(plan_stream, "CHUNK", chunk)
        got = outcome(streamed)
        while opened:
            if isinstance(opened[-1], plan_stream.PlanFile):
                opened[-1].close()
            opened.pop()
        if got != expected:
            differ[chunk] = (expected, got)
    return differ


def test_a_big_plan_is_parted_as_json_load_reads_it_whatever_the_reads_cut_it(tmp_path, monkeypatch):
    """A value cut by a read (a number after its '.' or 'e', a string in its escapes) is the value json.load reads;
    of keys given twice the last counts (json.load's); a plan as ops.spark expiry writes it gives the same parts."""
    import random
    import tempfile

    from ops.spark.plan import write_plan

    rnd = random.Random(7)
    halves = [{"commit_log_offset": i * 317, "queue_offset": i, "producer_group": "pg\\\"é😀"[: i % 6],
               "topic": "orders", "store_timestamp": 1_700_000_000_000 + i,
               "uniq_key": None if i % 5 == 0 else "k\u2028\"\\/\ud7ff😀%d" % i} for i in range(12)]
    with tempfile.TemporaryDirectory() as d:
        write_plan({**HEADER, "retention_ms": 1000, "now_ms": 1_800_000_000_000, "halves": halves,
                    "segments": [{"name": "0" * 20, "start_offset": 0, "end_offset": 99, "records": 9,
                                  "first_store_timestamp": 1, "last_store_timestamp": 2}],
                    "report": {"segments": 1, "unconsumed": []}}, f"{d}/plan.json")
        with open(f"{d}/plan.json", encoding="utf-8") as fh:
            written = fh.read()
    h = json.dumps(halves)
    plans = {
        "as ops.spark expiry writes it": written,
        "numbers with fractions and exponents": '{"version": 2, "store_id": "s", "rate": 12.5e2, "x": [1.25, 3E+7, '
                                                '-0.5e-3], "halves": %s, "now_ms": 17.75, "segments": []}' % h,
        "white space everywhere, halves last": '\ufeff \n{\r\n"segments"\t:\n[ ] ,"store_id" : "s" , "halves" :\n[ '
                                               + ' ,\n '.join(json.dumps(x) for x in halves) + ' ]\n}\n\t',
        "halves twice": '{"store_id": "s", "halves": [{"commit_log_offset": -1}, 7], "halves": %s, "segments": []}' % h,
        "halves twice, the last not a list": '{"store_id": "s", "halves": %s, "halves": null, "segments": []}' % h,
        "halves twice, the first not a list": '{"store_id": "s", "halves": 3, "halves": %s, "segments": []}' % h,
        "halves twice, the last not objects": '{"store_id": "s", "halves": %s, "halves": [1, 2, 3, 4]}' % h,
    }
    for name, text in plans.items():
        chunks = sorted({1, 2, 3, 5, 64 * 1024, *(rnd.randint(1, 200) for _ in range(40))})
        assert _parts_both_ways(monkeypatch, tmp_path, text, chunks) == {}, name


def test_a_broker_address_without_a_port_is_said_so(tmp_path, capsys):
    """`--broker 127.0.0.1:abc apply-expiry` said the plan "changed while it was sent ... the parts sent were
    applied" (its int(port) ValueError taken for a plan read again); the other actions a traceback."""
    from broker import admin

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(2)))
    for addr in ("127.0.0.1:abc", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000"):
        for argv in (["apply-expiry", str(path)], ["list"]):
            assert admin.main(["--broker", addr, *argv]) == 2, (addr, argv)
            err = capsys.readouterr().err
            assert f"--broker {addr}: give the broker's address as host:port" in err and "changed" not in err, err


def test_a_big_plan_wrong_near_its_start_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    """A JSON error was taken for a value cut by the read: the reader read on, to the end of the file, before it
    said so (a 18 MB plan with ',,' in its second half: 50 MB; a 1.9 GB one of 10,000,000 halves, the OOM killer)."""
    plan = _big_plan(40_000)
    good = json.dumps(plan)
    for name, text in {"a comma twice": good.replace('"queue_offset": 1,', '"queue_offset": 1,,', 1),
                       "a line break in a string": good.replace('"pg-1"', '"pg\n-1"', 1),
                       "a key not a string": good.replace('"queue_offset": 2,', 'queue_offset: 2,', 1)}.items():
        path = tmp_path / "plan.json"
        path.write_text(text)
        code, seen, peak = _apply_counting(monkeypatch, path)
        assert code == 2 and "parts" not in seen, name
        assert peak < len(text) / 10, (name, peak, len(text))


def _sent_to_a_fake_broker(monkeypatch, capsys, path, on_part) -> tuple[int, list, str, str]:
    """admin.main(apply-expiry path) against a connection answering each part with its halves expired, after
    ``on_part(parts sent so far)``: (exit code, the parts sent, stdout, stderr)."""
    import types

    from broker import admin
    from protocol.codes import ResponseCode

    bodies: list = []

    class Conn:
        async def request(self, cmd, timeout):
            part = json.loads(cmd.body_bytes())
            bodies.append(part)
            on_part(len(bodies))
            reply = {"expired": [h["commit_log_offset"] for h in part["halves"]], "skipped": []}
            return types.SimpleNamespace(code=ResponseCode.SUCCESS, remark="", body_bytes=lambda: json.dumps(reply))

        def close(self):
            pass

    async def connect(host, port, sign=None):
        return Conn()

    monkeypatch.setattr(admin, "open_connection", connect)
    code = admin.main(["apply-expiry", str(path)])
    out, err = capsys.readouterr()
    return code, bodies, out, err


def test_a_big_plan_written_over_while_it_is_sent_stops_it_saying_what_was_done(tmp_path, monkeypatch, capsys):
    """A plan written over in place (not renamed over) after its second part was sent. By one as long, other halves
    at other offsets: its next parts were read from the new file (JSON all through) and sent, exit 0. Written on (a
    byte appended): every part but the last sent, then "changed" said, not the halves the parts expired (dead
    letters now, skipped by the next apply as already decided). Now the next read stops it, the summary said."""
    from broker import admin

    monkeypatch.setattr(admin, "PART_BYTES", 64 * 1024)
    plan = _big_plan(5000)
    other = json.dumps({**plan, "halves": [{**h, "commit_log_offset": h["commit_log_offset"] + 1}
                                           for h in plan["halves"]]})
    for name, mode, text in (("written over", "r+", other), ("written on", "a", " ")):
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(plan))
        assert len(other) == path.stat().st_size

        def change(n):
            if n == 2:
                with open(path, mode) as fh:
                    fh.write(text)

        code, bodies, out, err = _sent_to_a_fake_broker(monkeypatch, capsys, path, change)
        assert code == 1 and "changed while it was sent" in err and "applying the plan again is safe" in err, err
        assert 2 <= len(bodies) <= 3 and "were applied" in err, (name, len(bodies), err)
        sent = [h["commit_log_offset"] for p in bodies for h in p["halves"]]
        assert json.loads(out)["expired"] == sent == [h["commit_log_offset"] for h in plan["halves"][:len(sent)]]


def test_a_big_plan_sent_whole_to_a_broker_is_its_parts_in_order(tmp_path, monkeypatch, capsys):
    from broker import admin

    monkeypatch.setattr(admin, "PART_BYTES", 64 * 1024)
    plan = _big_plan(5000)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    code, bodies, out, err = _sent_to_a_fake_broker(monkeypatch, capsys, path, lambda n: None)
    assert code == 0 and len(bodies) == 16, (code, len(bodies), err)
    # each with its place, for the broker's log (the plan said at its first part and its last, not at each)
    assert bodies == [{**p, "part": n, "parts": 16} for n, p in enumerate(admin.plan_parts(plan), 1)]
    assert all(len(json.dumps(p).encode()) <= admin.PART_BYTES for p in bodies)
    assert json.loads(out)["expired"] == [h["commit_log_offset"] for h in plan["halves"]]


async def test_the_broker_says_a_plan_in_parts_at_its_first_part_and_its_last_with_the_totals(caplog):
    """Two WARNINGs a part were 20,000 for a plan of 10M halves. A part with no first part before it on its connection
    (an admin's own sequence, or a client's) is said as a plan of its own: applying halves is never said at DEBUG
    alone."""
    import logging
    from types import SimpleNamespace

    class Retention:
        async def apply_plan(self, plan, *, say=True):
            self.said = say
            return {"expired": [h["commit_log_offset"] for h in plan["halves"]], "skipped": [{"undecided": True}],
                    "segments_removed": [s["name"] for s in plan["segments"]], "segments_kept": [],
                    "segments_gone": []}

    class Conn:
        peer = ("127.0.0.1", 5000)

    ctx = SimpleNamespace(retention=Retention())
    parts = _parts_of_4()

    async def send(conn, part):
        await _send_part(ctx, conn, part)

    def said():
        return _warned(caplog)

    caplog.set_level(logging.DEBUG, "txmq")
    conn = Conn()
    for part in parts:
        await send(conn, part)
    assert said() == ["admin 127.0.0.1:5000 applies an expiry plan in 4 parts (the first): 2 halves, 0 segments",
                      "expiry plan applied in 4 parts: 5 halves expired, 4 skipped (4 still undecided: not "
                      "dead-lettered), 1 segments removed, 0 kept, 0 gone before"]
    other = Conn()
    await send(other, parts[2])                 # no first part on this connection
    assert said() == ["admin 127.0.0.1:5000 applies an expiry plan: 1 halves, 0 segments"] and ctx.retention.said
    await send(other, parts[3])
    assert said() == ["admin 127.0.0.1:5000 applies an expiry plan: 0 halves, 1 segments"] and ctx.retention.said


async def test_a_plan_in_parts_cut_short_is_said_with_what_its_parts_applied(caplog):
    """The parts between a plan's first and its last were said at DEBUG alone: a plan whose admin died (or whose
    connection dropped) after 50 of 92 parts, a part refused midway, a new plan begun on the connection before the
    last part, or parts that come out of order (pipelined, or its last before the one before it) left what those
    parts applied (halves expired, dead letters written) in no WARNING at all."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from broker.processors import transaction as tp
    from broker.retention import PlanRefused
    from protocol.codes import ResponseCode

    class Retention:
        refuse = False

        gate = None

        async def apply_plan(self, plan, *, say=True):
            if self.refuse:
                raise PlanRefused("store_id is another store's")
            if self.gate is not None:
                self.entered.set()
                await self.gate.wait()
            self.said = say
            return {"expired": [h["commit_log_offset"] for h in plan["halves"]], "skipped": [],
                    "segments_removed": [s["name"] for s in plan["segments"]], "segments_kept": [],
                    "segments_gone": []}

    class Conn:
        peer = ("127.0.0.1", 5001)

        def __init__(self):
            self.closed = asyncio.Event()

    ctx = SimpleNamespace(retention=Retention())
    parts = _parts_of_4()

    async def send(conn, part, code=None):
        await _send_part(ctx, conn, part, code)

    def said():
        return _warned(caplog)

    caplog.set_level(logging.DEBUG, "txmq")
    # the connection closes after 2 of 4 parts
    conn = Conn()
    await send(conn, parts[0])
    await send(conn, parts[1])
    said()
    conn.closed.set()
    await asyncio.wait_for(tp._PLAN_WATCHERS[conn], 5)
    assert said() == ["expiry plan from 127.0.0.1:5001 cut short: 2 of 4 parts applied, then the connection closed: "
                      "4 halves expired, 0 skipped (0 still undecided: not dead-lettered), 0 segments removed, 0 kept, "
                      "0 gone before; apply the plan again to finish it (what was done is skipped)"]
    assert conn not in tp._PLAN_PARTS and conn not in tp._PLAN_WATCHERS
    # a part refused midway
    conn = Conn()
    await send(conn, parts[0])
    said()
    ctx.retention.refuse = True
    await send(conn, parts[1], ResponseCode.SYSTEM_ERROR)
    ctx.retention.refuse = False
    assert said()[:1] == ["expiry plan from 127.0.0.1:5001 cut short: 1 of 4 parts applied, then part 2 was refused: "
                          "2 halves expired, 0 skipped (0 still undecided: not dead-lettered), 0 segments removed, "
                          "0 kept, 0 gone before; apply the plan again to finish it (what was done is skipped)"]
    # a new plan begun before the last part of the one before
    await send(conn, parts[0])
    await send(conn, parts[1])
    said()
    await send(conn, parts[0])
    assert said() == ["expiry plan from 127.0.0.1:5001 cut short: 2 of 4 parts applied, then a new plan began on the "
                      "connection: 4 halves expired, 0 skipped (0 still undecided: not dead-lettered), 0 segments "
                      "removed, 0 kept, 0 gone before; apply the plan again to finish it (what was done is skipped)",
                      "admin 127.0.0.1:5001 applies an expiry plan in 4 parts (the first): 2 halves, 0 segments"]
    # a part out of its place (its last before the one before it) is said as a plan of its own; the others still
    # add up, said when the connection closes
    await send(conn, parts[1])
    await send(conn, parts[3])
    await send(conn, parts[2])
    assert said() == ["admin 127.0.0.1:5001 applies an expiry plan: 0 halves, 1 segments"]
    assert ctx.retention.said is False          # (part 3's; part 4's said by apply_plan itself)
    conn.closed.set()
    await asyncio.wait_for(tp._PLAN_WATCHERS[conn], 5)
    assert said() == ["expiry plan from 127.0.0.1:5001 cut short: 3 of 4 parts applied, then the connection closed: "
                      "5 halves expired, 0 skipped (0 still undecided: not dead-lettered), 0 segments removed, 0 kept, "
                      "0 gone before; apply the plan again to finish it (what was done is skipped)"]
    # the connection closes while a part is applied: the parts before said at once, that part when it is done
    conn = Conn()
    await send(conn, parts[0])
    said()
    ctx.retention.gate, ctx.retention.entered = asyncio.Event(), asyncio.Event()
    second = asyncio.ensure_future(send(conn, parts[1]))
    await asyncio.wait_for(ctx.retention.entered.wait(), 5)
    conn.closed.set()
    await asyncio.wait_for(tp._PLAN_WATCHERS[conn], 5)
    assert said() == ["expiry plan from 127.0.0.1:5001 cut short: 1 of 4 parts applied, then the connection closed: "
                      "2 halves expired, 0 skipped (0 still undecided: not dead-lettered), 0 segments removed, 0 kept, "
                      "0 gone before; apply the plan again to finish it (what was done is skipped)"]
    ctx.retention.gate.set()
    await asyncio.wait_for(second, 5)
    assert said() == ["expiry plan part 2 of 4 applied, its plan cut short before it: 2 halves expired, 0 skipped (0 "
                      "still undecided: not dead-lettered), 0 segments removed, 0 kept, 0 gone before"]
    assert not tp._PLAN_PARTS and not tp._PLAN_WATCHERS


async def test_a_stop_says_a_plan_in_parts_still_open_and_ends_its_watcher(caplog):
    """A plan in parts whose connection had not closed when the broker stopped left its watcher task pending when the
    loop closed, and what its parts applied unsaid: the stop says it and ends the watcher."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from broker.processors import transaction as tp

    class Retention:
        async def apply_plan(self, plan, *, say=True):
            return {"expired": [h["commit_log_offset"] for h in plan["halves"]], "skipped": [],
                    "segments_removed": [], "segments_kept": [], "segments_gone": []}

    class Conn:
        peer = ("127.0.0.1", 5002)

        def __init__(self):
            self.closed = asyncio.Event()           # never set: its close has not come through

    ctx, conn, idle = SimpleNamespace(retention=Retention()), Conn(), Conn()
    caplog.set_level(logging.DEBUG, "txmq")
    await _send_part(ctx, conn, _parts_of_4()[0])
    watcher = tp._PLAN_WATCHERS[conn]
    _warned(caplog)
    await tp.end_plan_watchers([idle, conn])
    assert watcher.done() and conn not in tp._PLAN_WATCHERS and conn not in tp._PLAN_PARTS
    assert _warned(caplog) == ["expiry plan from 127.0.0.1:5002 cut short: 1 of 4 parts applied, then the broker "
                               "stopped: 2 halves expired, 0 skipped (0 still undecided: not dead-lettered), 0 segments "
                               "removed, 0 kept, 0 gone before; apply the plan again to finish it (what was done is "
                               "skipped)"]
