"""Retention through the real broker process, its clock moved with libfaketime.

A broker living 80 hours in the past writes 1,500 messages and an undecided transaction and a
consumer group commits a little of it; the same store is then served at the real time and gets
1,500 fresh messages. Plans are made from the broker's segment manifest exactly as the Spark
job lists segments (tests/spark covers the job itself), bent into each kind of bad plan, and
applied with `python -m broker admin apply-expiry`. Bad plans remove nothing; the good plan
removes the 80-hour-old sealed segments, dead-letters the half inside first, and the consumer
that was behind them is answered PULL_OFFSET_MOVED and continues from the new minimum.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from consumer import PullConsumer
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from tests.support.broker_process import REPO
from tests.support.faketime import LIBFAKETIME, SKIP_REASON, past_env
from tests.support.hung_writes import slow_flush_env
from tests.support.offsets import drain

pytestmark = pytest.mark.asyncio

H = 3_600_000
N = 1500
FLAGS = ("--segment-size", "262144", "--max-message-size", "16384", "--transaction-timeout-ms", "600000",
         "--transaction-check-interval-ms", "600000")
if LIBFAKETIME is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)
PAST = past_env("-80h")


class Undecided:
    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    def check_local_transaction(self, msg):
        return S.UNKNOW


async def _send(b, prefix: str, n: int) -> None:
    async with Producer(b.namesrv, "PG_flow") as producer:
        for lo in range(0, n, 50):
            await asyncio.gather(*(producer.send("Flow", f"{prefix}-{i}".encode().ljust(1000, b".")) for i in
                                   range(lo, min(n, lo + 50))))


async def _old_traffic(b) -> None:
    async with TransactionProducer(b.namesrv, "PG_tx", Undecided()) as tx:
        await tx.send_in_transaction("Paid", b"undecided-80h")
    await _send(b, "old", N)
    consumer = PullConsumer(b.namesrv, "CG_behind")
    for mq in await consumer.fetch_queues("Flow"):
        await consumer.commit_offset(mq, 3)          # consumed a little, then abandoned
    await consumer.shutdown()


def _run_admin(b, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker", "admin", "--broker", b.broker, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _admin(b, plan: dict, tmp_path, name: str):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(plan))
    out = _run_admin(b, "apply-expiry", str(path))
    return out.returncode, (json.loads(out.stdout) if out.returncode == 0 else out.stderr.strip())


def _plan(store, now_ms: int, *, retention_ms: int = 72 * H, include_active: bool = False) -> dict:
    """Segments listed as `ops.spark expiry` lists them, from the broker's manifest."""
    manifest = json.loads((store / "segments.json").read_text())
    chosen = []
    for e in manifest["segments"]:
        if (not e["sealed"] and not include_active) or (e["sealed"] and e["last_ts"] >= now_ms - retention_ms):
            break
        chosen.append({"name": e["name"], "start_offset": e["start"], "end_offset": e["end"],
                       "first_store_timestamp": e["first_ts"], "last_store_timestamp": e["last_ts"]})
    return {"version": 2, "store_id": manifest["store_id"], "created_ms": now_ms, "now_ms": now_ms,
            "retention_ms": retention_ms, "halves": [], "segments": chosen}


def _segments(store) -> list[str]:
    return sorted(os.listdir(store / "commitlog"))


async def _wait_manifest(store, check, timeout=10.0):
    async with asyncio.timeout(timeout):
        while True:
            try:
                data = json.loads((store / "segments.json").read_text())
                if check(data):
                    return data
            except (OSError, ValueError):
                pass
            await asyncio.sleep(0.1)


async def test_plans_judged_by_the_broker_on_a_store_written_80_hours_ago(broker_factory, tmp_path):
    store = tmp_path / "store"
    past = broker_factory(*FLAGS, env=PAST)
    await _old_traffic(past)
    assert past.stop() == 0
    old_segments = _segments(store)

    b = broker_factory(*FLAGS)
    now = int(time.time() * 1000)
    await _send(b, "fresh", N)
    await _wait_manifest(store, lambda m: len(m["segments"]) == len(_segments(store)))
    before = _segments(store)
    manifest = json.loads((store / "segments.json").read_text())
    old = [e["name"] for e in manifest["segments"] if e["sealed"] and e["last_ts"] < now - 72 * H]
    assert len(old) >= 4 and set(old) < set(old_segments)

    results = {}
    results["future (--now-ms now+100h)"] = _admin(b, _plan(store, now + 100 * H), tmp_path, "future")
    other = dict(_plan(store, now), store_id="5c0ffee0-0000-4000-8000-000000000000")
    results["another store's id"] = _admin(b, other, tmp_path, "other")
    results["version 1 (no store id)"] = _admin(b, dict(_plan(store, now), version=1), tmp_path, "v1")
    short = _plan(store, now + 30_000, retention_ms=1)        # every sealed segment looks old to it
    short["segments"] = [s for s in short["segments"] if s["name"] not in old]
    results["its own 1 ms retention"] = _admin(b, short, tmp_path, "short")
    grown = _plan(store, now + 100 * H, include_active=True)
    grown["now_ms"] = now
    grown["segments"] = grown["segments"][-1:]                 # the active segment, as it is now
    await _send(b, "later", 300)                               # ... which then grows and seals
    results["segment grown since the plan"] = _admin(b, grown, tmp_path, "grown")
    for kind, (rc, reply) in results.items():
        removed = reply["segments_removed"] if rc == 0 else []
        assert removed == [], (kind, reply)
    assert results["future (--now-ms now+100h)"][0] == 1 and "ahead of this broker's clock" in \
        results["future (--now-ms now+100h)"][1]
    assert "is for store" in results["another store's id"][1]
    assert "version 1" in results["version 1 (no store id)"][1]
    assert "changed since the plan" in results["segment grown since the plan"][1]["segments_kept"][0]["why"]
    assert "not older than the retention" in results["its own 1 ms retention"][1]["segments_kept"][0]["why"]
    assert _segments(store)[:len(before)] == before

    rc, good = _admin(b, _plan(store, now), tmp_path, "good")
    assert rc == 0 and good["segments_removed"] == old and good["segments_kept"] == []
    assert not set(old) & set(_segments(store))
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5)
                                   .read().decode())
    assert f'txmq_store_segments_removed_total{{reason="plan"}} {float(len(old))}' in text

    statuses, moved, bodies = await drain(b.namesrv, "CG_behind", "Flow")
    assert moved >= 1                                          # PULL_OFFSET_MOVED, then on from the minimum
    fresh = [x for x in bodies if x.startswith(b"fresh-")]
    assert len(fresh) == N and len({x for x in bodies if x.startswith(b"later-")}) == 300
    async with PullConsumer(b.namesrv, "CG_dead") as dl:
        (mq,) = await dl.fetch_queues("TRANS_CHECK_MAX_TIME_TOPIC")
        letters = (await dl.pull(mq, 0, max_nums=8)).messages
    assert [(m.body, m.properties["TXMQ_REASON"]) for m in letters] == [(b"undecided-80h", "expired")]
    print("\nRETENTION " + json.dumps({
        "old_segments": len(old), "segments_before": len(before), "bad_plans_removed": {
            k: (v[1]["segments_removed"] if v[0] == 0 else f"refused: {v[1][:90]}") for k, v in results.items()},
        "good_plan_removed": good["segments_removed"], "fresh_messages_readable": len(fresh)}))


async def _restarted_with_a_half(broker_factory, store, *, sealed: bool = True):
    """A broker started on the traffic of 80 h ago (_old_traffic): (it, now in ms, its one open half, a plan of
    its store). ``sealed``: once its manifest names a sealed segment."""
    past = broker_factory(*FLAGS, env=PAST)
    await _old_traffic(past)
    assert past.stop() == 0
    b = broker_factory(*FLAGS)
    now = int(time.time() * 1000)
    if sealed:
        await _wait_manifest(store, lambda m: any(e["sealed"] for e in m["segments"]))
    (half,) = json.loads(_run_admin(b, "list", "--json").stdout)["pending"]
    return b, now, half, _plan(store, now)


async def test_a_plan_over_a_frame_is_applied_in_parts_its_halves_first(broker_factory, tmp_path):
    """A plan listing 90,000 halves (a producer group that died with its transactions open, or a plan the halves of
    which were decided since) is 17 MiB, over the 16 MiB frame a broker reads: sent whole, it was refused by the
    admin's own connection ("not sent", exit 1) and nothing expired, night after night. Sent a slice of halves a
    request, its segments last, the broker's half is dead-lettered, each stale one skipped, the segments removed."""
    store = tmp_path / "store"
    b, now, half, plan = await _restarted_with_a_half(broker_factory, store)
    assert plan["segments"]
    end = json.loads((store / "segments.json").read_text())["segments"][-1]["end"]
    stale = [{"commit_log_offset": end + 1000 + i, "queue_offset": i, "producer_group": "PG_tx", "topic": "Paid",
              "store_timestamp": now - 80 * H, "uniq_key": f"{i:032X}"} for i in range(90_000)]
    plan["halves"] = stale[:45_000] + [{"commit_log_offset": half["commit_log_offset"]}] + stale[45_000:]
    path = tmp_path / "big.json"
    path.write_text(json.dumps(plan, indent=1))
    assert path.stat().st_size > 16 * 1024 * 1024

    out = await asyncio.to_thread(_run_admin, b, "apply-expiry", str(path))
    assert out.returncode == 0, out.stderr[-500:]
    reply = json.loads(out.stdout)
    assert reply["expired"] == [half["commit_log_offset"]]
    assert len(reply["skipped"]) == 90_000
    assert {s["why"] for s in reply["skipped"]} == {"already decided or unknown"}
    assert reply["segments_removed"] == [s["name"] for s in plan["segments"]] and reply["segments_kept"] == []
    assert "applied 92 of 92 parts: 1 halves expired, 90000 skipped" in out.stderr
    # Said at its first part and its last, with every part's totals: not twice a part (184 WARNINGs).
    log = b.log_path.read_text()
    assert log.count("applies an expiry plan") == 1 and "applies an expiry plan in 92 parts (the first)" in log
    assert log.count("expiry plan applied") == 1
    assert (f"expiry plan applied in 92 parts: 1 halves expired, 90000 skipped (0 still undecided: not dead-lettered)"
            f", {len(plan['segments'])} segments removed, 0 kept, 0 gone before") in log
    async with PullConsumer(b.namesrv, "CG_dead") as dl:
        (mq,) = await dl.fetch_queues("TRANS_CHECK_MAX_TIME_TOPIC")
        letters = (await dl.pull(mq, 0, max_nums=8)).messages
    assert [(m.body, m.properties["TXMQ_REASON"]) for m in letters] == [(b"undecided-80h", "expired")]

    again = await asyncio.to_thread(_run_admin, b, "apply-expiry", str(path))     # a re-run: nothing twice
    reply = json.loads(again.stdout)
    assert again.returncode == 0 and reply["expired"] == [] and len(reply["skipped"]) == 90_001
    assert reply["segments_removed"] == [] and reply["segments_gone"] == [s["name"] for s in plan["segments"]]


async def test_a_plan_of_halves_with_long_keys_is_sent_in_parts_within_a_frame(broker_factory, tmp_path):
    """Parts counted in halves alone were not bounded in bytes: a half's uniq_key (or group, or topic) is what its
    producer put in the properties, up to 32,767 bytes, and a key not in ASCII is written six bytes a character in
    the JSON sent. 1,200 halves with 6,000-character keys: 1,000 of them, one part, were 36 MB, "not sent", exit 1,
    nothing applied, night after night."""
    store = tmp_path / "store"
    b = broker_factory(*FLAGS)
    manifest = await _wait_manifest(store, lambda m: bool(m.get("store_id")))
    now = int(time.time() * 1000)
    halves = [{"commit_log_offset": 10**12 + i, "queue_offset": i, "producer_group": "PG_tx", "topic": "Paid",
               "store_timestamp": now - 80 * H, "uniq_key": f"{i:06d}" + "é" * 6000} for i in range(1200)]
    plan = {"version": 2, "store_id": manifest["store_id"], "created_ms": now, "now_ms": now, "retention_ms": 72 * H,
            "halves": halves, "segments": []}
    path = tmp_path / "long.json"
    path.write_text(json.dumps(plan, ensure_ascii=False))

    out = await asyncio.to_thread(_run_admin, b, "apply-expiry", str(path))
    assert out.returncode == 0, out.stderr[-500:]
    reply = json.loads(out.stdout)
    assert reply["expired"] == [] and [s["commit_log_offset"] for s in reply["skipped"]] == [h["commit_log_offset"]
                                                                                             for h in halves]


async def test_a_plan_with_a_bad_entry_past_the_first_part_changes_nothing(broker_factory, tmp_path):
    """The broker refuses a plan whole, nothing changed, when its halves are not all objects; sent in parts, only the
    part holding the bad entry was refused: the halves of the parts before it were dead-lettered already (exit 1,
    "parts 1 to 1 were applied"), a plan the broker calls malformed half applied."""
    store = tmp_path / "store"
    b, now, half, plan = await _restarted_with_a_half(broker_factory, store, sealed=False)
    plan["halves"] = [{"commit_log_offset": half["commit_log_offset"]}] + [{"commit_log_offset": -i} for i in
                                                                            range(1, 1001)] + ["not a half"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plan))

    out = await asyncio.to_thread(_run_admin, b, "apply-expiry", str(path))
    assert out.returncode == 2 and "halves must be a list of objects" in out.stderr, (out.returncode, out.stderr)
    pending = json.loads(_run_admin(b, "list", "--json").stdout)["pending"]
    assert [p["commit_log_offset"] for p in pending] == [half["commit_log_offset"]]
    assert _segments(store) == sorted(s["name"] for s in json.loads((store / "segments.json").read_text())["segments"])


async def test_a_part_of_real_halves_on_a_slow_disk_is_waited_for(broker_factory, tmp_path):
    """A part's halves are dead-lettered one after the other, each record flushed (flush = sync) before the next: on
    a disk whose flush takes 12 ms, 1,000 real halves are 12 s, and the admin waited --timeout (10 s) a part
    whatever it held: "no response", exit 1, while the broker went on to dead-letter them all."""
    past = broker_factory(*FLAGS, env=PAST)
    async with TransactionProducer(past.namesrv, "PG_tx", Undecided()) as tx:
        for lo in range(0, 1000, 100):
            await asyncio.gather(*(tx.send_in_transaction("Paid", b"undecided-80h") for _ in range(100)))
    assert past.stop() == 0
    (flag := tmp_path / "slow").touch()
    b = broker_factory(*FLAGS, env=slow_flush_env(flag, 0.012))
    now = int(time.time() * 1000)
    pending = json.loads(_run_admin(b, "list", "--json", "--limit", "2000").stdout)["pending"]
    assert len(pending) == 1000
    plan = _plan(tmp_path / "store", now)
    plan["halves"], plan["segments"] = [{"commit_log_offset": p["commit_log_offset"]} for p in pending], []
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(plan))

    out = await asyncio.to_thread(_run_admin, b, "apply-expiry", str(path))
    assert out.returncode == 0, out.stderr[-500:]
    assert len(json.loads(out.stdout)["expired"]) == 1000


async def test_a_plan_stopped_before_its_segments_part_claims_no_segment_judged(broker_factory, tmp_path):
    """Stopped at its segments part (unanswered within --timeout, here 1e-9 s: the broker still removing them), the
    summary printed was the halves parts' replies merged, each saying "segments_removed": [], "segments_kept": []:
    a plan whose segments were never judged, or were going as it was printed, read as one that removed none."""
    store = tmp_path / "store"
    b, now, half, plan = await _restarted_with_a_half(broker_factory, store)
    assert plan["segments"]
    plan["halves"] = [{"commit_log_offset": half["commit_log_offset"]}] + [{"commit_log_offset": -i} for i in
                                                                            range(1, 1000)]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))

    # (two parts of 500 halves, each waited for 12.5 s: only the segments part has --timeout alone)
    out = await asyncio.to_thread(_run_admin, b, "--timeout", "1e-9", "apply-expiry", str(path), "--slice", "500")
    assert out.returncode == 1 and "stopped at part 3 of 3" in out.stderr, out.stderr[-500:]
    reply = json.loads(out.stdout)
    assert reply["expired"] == [half["commit_log_offset"]] and len(reply["skipped"]) == 999
    assert not {"segments_removed", "segments_kept", "segments_gone"} & set(reply), reply.keys()


async def test_a_plan_in_parts_whose_admin_goes_after_its_first_part_is_said_with_what_it_applied(broker_factory,
                                                                                                 tmp_path):
    """The parts between a plan's first and its last are said at DEBUG: an admin killed (or its connection dropped)
    after its first part left what the parts applied in no WARNING. The broker says the plan cut short when the
    connection closes."""
    from protocol.codes import RequestCode, ResponseCode
    from protocol.command import RemotingCommand
    from protocol.connection import open_connection

    store = tmp_path / "store"
    b = broker_factory(*FLAGS)
    now = int(time.time() * 1000)
    await _wait_manifest(store, lambda m: True)
    plan = {**_plan(store, now), "segments": [], "part": 1, "parts": 3,
            "halves": [{"commit_log_offset": 10**12 + i, "queue_offset": i, "producer_group": "PG_tx", "topic": "Paid",
                        "store_timestamp": now - 80 * H, "uniq_key": f"{i:032X}"} for i in range(3)]}
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port))
    resp = await conn.request(RemotingCommand.request(RequestCode.TXMQ_APPLY_EXPIRY, body=json.dumps(plan).encode()),
                              30)
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    conn.close()
    line = ("cut short: 1 of 3 parts applied, then the connection closed: 0 halves expired, 3 skipped (0 still "
            "undecided: not dead-lettered), 0 segments removed, 0 kept, 0 gone before; apply the plan again to finish it "
            "(what was done is skipped)")
    async with asyncio.timeout(30):
        while line not in b.log_path.read_text():
            await asyncio.sleep(0.1)        # (the broker's log file: nothing to await but its lines)
    assert "applies an expiry plan in 3 parts (the first): 3 halves, 0 segments" in b.log_path.read_text()
