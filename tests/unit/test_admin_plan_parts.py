"""`admin apply-expiry` sends a plan of many halves in parts: a slice of its halves a request, each with the plan's
header, then its segments alone (the broker judges a plan's halves before its segments)."""
from __future__ import annotations

import json

from broker.admin import PART_BYTES, plan_parts

HEADER = {"version": 2, "store_id": "s", "created_ms": 1, "retention_ms": 2, "now_ms": 3}


def _plan(n_halves: int) -> dict:
    return {**HEADER, "halves": [{"commit_log_offset": i} for i in range(n_halves)],
            "segments": [{"name": "0" * 20}], "report": {"segments": 1}}


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
