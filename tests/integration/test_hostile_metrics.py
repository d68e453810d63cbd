"""What one client's made-up names do to the Prometheus scrape: every series there is kept by the broker,
read by each scrape and stored by Prometheus, so a name a client invents must not add one without bound."""
from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.metrics import OTHER, BrokerMetrics
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import SendMessageRequestHeader
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

LAG = "rocketmq_consumer_lag_messages"


def _scrape(broker) -> tuple[dict, dict]:
    """(the lag series by labels, txmq_metric_series_folded by metric) of one scrape."""
    text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=10).read().decode()
    lag, folded = {}, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == LAG:
                lag[(s.labels["consumer_group"], s.labels["topic"])] = s.value
            elif s.name == "txmq_metric_series_folded":
                folded[s.labels["metric"]] = s.value
    return lag, folded


def _snapshot_lines(broker) -> list[bytes]:
    """The last snapshot file's whole lines. Not its last line as read: the broker appends a line of up to 4 MB a
    second here, and a read during the append sees its first part only (a JSON error, seen under load)."""
    files = sorted((Path(broker.store_dir) / "metrics").glob("*.jsonl"))
    text = files[-1].read_bytes() if files else b""
    return text[:text.rfind(b"\n") + 1].splitlines()


def _last_snapshot_lag(broker) -> list[dict]:
    lines = _snapshot_lines(broker)
    return json.loads(lines[-1])["consumer_lag"] if lines else []


async def _connect(broker):
    host, _, port = broker.broker.rpartition(":")
    return await open_connection(host, int(port), max_in_flight=1 << 16)


async def _send(conn, n: int) -> None:
    """n messages to topic Folded (one queue), by producer group PG_fold."""
    fields = SendMessageRequestHeader("PG_fold", "Folded", default_topic_queue_nums=1).to_ext_fields()
    for _ in range(n):
        sent = await conn.request(RemotingCommand.request(RequestCode.SEND_MESSAGE_V2, fields, b"m"), 10)
        assert sent.code == ResponseCode.SUCCESS


async def _commit(conn, group: str, offset: int, timeout: float = 30) -> int:
    """The response code of ``group``'s commit of ``offset`` on Folded's queue."""
    return (await conn.request(RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET, {
        "consumerGroup": group, "topic": "Folded", "queueId": 0, "commitOffset": offset}), timeout)).code


async def _commit_all(conn, groups, offset: int) -> set:
    """Each group's commit of ``offset``, oneway as every stock consumer's are (persistAll): answered, a commit
    from a connection that is no consumer of the group is an admin's move and waits for the offsets' save, one
    save after another for 50,000 made-up groups. The response code of the last group's commit again, answered
    (it changes nothing: not waited for), once the broker has handled the others before it: a wait for all of
    them, not one request's answer (4-9 s for 50,050 on an idle machine, and past the 30 s of one request's
    deadline twice under the load of other suites on two cores): up to 90 s, inside the tests' 120."""
    last = None
    for last in groups:
        conn.oneway(RemotingCommand.request(RequestCode.UPDATE_CONSUMER_OFFSET, {
            "consumerGroup": last, "topic": "Folded", "queueId": 0, "commitOffset": offset}))
    return {await _commit(conn, last, offset, timeout=90)}


async def _long_named_groups_lag_1_each(broker, n: int) -> None:
    """One message on Folded, then n made-up groups commit offset 0: names of 255 characters (6 digits and 249
    emoji, 4 bytes of UTF-8 and 12 of JSON escapes each)."""
    conn = await _connect(broker)
    try:
        await _send(conn, 1)
        codes = await _commit_all(conn, (f"{i:06d}" + "\U0001F600" * 249 for i in range(n)), 0)
        assert codes == {ResponseCode.SUCCESS}
    finally:
        conn.close()


async def _scrape_when_lag_is(broker, total) -> tuple[dict, dict]:
    """A scrape (as _scrape) once the lags on Folded and _other sum to ``total`` (the gauges sum a large offset
    table in slices), or the last of 200 tries."""
    loop = asyncio.get_running_loop()
    for _ in range(200):
        lag, folded = await loop.run_in_executor(None, _scrape, broker)
        if sum(v for k, v in lag.items() if k[1] in ("Folded", OTHER)) == total:
            break
        await asyncio.sleep(0.1)
    return lag, folded


async def _snapshot_when_lag_is(broker, total, tries: int = 200) -> list[dict]:
    """The last snapshot's lag rows once those on Folded and _other sum to ``total`` (a snapshot taken after the
    commits: one a second), or the last of ``tries``."""
    loop = asyncio.get_running_loop()
    for _ in range(tries):
        rows = await loop.run_in_executor(None, _last_snapshot_lag, broker)
        if sum(r["lag"] for r in rows if r["topic"] in ("Folded", OTHER)) == total:
            break
        await asyncio.sleep(0.1)
    return rows


@bounded(120)
async def test_made_up_groups_cannot_grow_the_lag_gauge_past_its_limit(broker_factory):
    """The lag gauge had one series per (group, topic) with an offset, and offsets cost a client nothing up to
    max_offsets_per_host (100,000 an address): one client committing offsets for 100,000 made-up groups made
    every scrape 100,000 lines (8 MB, 0.6 s of the broker's CPU), unbounded across addresses, nothing said.
    Past max_series the largest lags keep their names (the real group that lags most is still seen), the rest
    are summed under _other (the total stays exact), counted in txmq_metric_series_folded and logged. The metric
    snapshots' lag rows (one an offset, 4 MB a line, each minute, kept a week) likewise past max_snapshot_lag_rows."""
    broker = broker_factory("--metrics-snapshot-interval-s", "1")
    made_up = BrokerMetrics.max_snapshot_lag_rows + 50
    conn = await _connect(broker)
    try:
        await _send(conn, 3)
        codes = await _commit_all(conn, (f"CG_made_up_{i}" for i in range(made_up)), 2)       # lag 1 each
        assert codes == {ResponseCode.SUCCESS}
        assert await _commit(conn, "CG_real", 0) == ResponseCode.SUCCESS   # lag 3, committed last
    finally:
        conn.close()
    total = made_up * 1 + 3
    lag, folded = await _scrape_when_lag_is(broker, total)
    mine = {k: v for k, v in lag.items() if k[1] in ("Folded", OTHER)}
    assert sum(mine.values()) == total
    assert len(lag) == BrokerMetrics.max_series + 1
    assert lag[("CG_real", "Folded")] == 3
    assert lag[(OTHER, OTHER)] == made_up - (BrokerMetrics.max_series - 1)     # those of lag 1 with no place
    assert folded[LAG] >= made_up + 1 - BrokerMetrics.max_series  # (and any group of lag 0 the broker has)
    assert folded["rocketmq_consumer_connections"] == 0
    assert f"series, more than {BrokerMetrics.max_series} or {BrokerMetrics.max_series_bytes} bytes of labels: the " \
           "smallest" in broker.log()

    cap = BrokerMetrics.max_snapshot_lag_rows
    rows = await _snapshot_when_lag_is(broker, total)
    assert len(rows) == cap + 1
    assert {"group": "CG_real", "topic": "Folded", "queue_id": 0, "lag": 3} in rows
    assert rows[-1] == {"group": OTHER, "topic": OTHER, "queue_id": -1, "lag": made_up - (cap - 1)}
    assert (await asyncio.get_running_loop().run_in_executor(None, _scrape, broker))[1]["snapshot_consumer_lag"] >= made_up + 1 - cap
    assert f"more than {cap} or {BrokerMetrics.max_snapshot_lag_bytes} bytes of names: the smallest lags of" in broker.log()


@bounded(120)
async def test_made_up_groups_with_larger_lags_cannot_push_the_real_groups_out(broker_factory):
    """The largest lags kept their names, and a made-up group's lag is what its client commits: offsets of 0 on a
    topic with messages made every made-up group lag more than the real ones, and a real group's lag (the one
    its alert reads, TxmqConsumerLagGrowing) went under _other, silently. Groups the broker knows -- a consumer
    connected now, or a subscription group an operator created (its consumers may all be down: then above all)
    -- keep their names before any other."""
    broker = broker_factory("--metrics-snapshot-interval-s", "1")
    made_up = BrokerMetrics.max_snapshot_lag_rows + 50
    conn = await _connect(broker)
    try:
        await _send(conn, 3)
        created = await conn.request(RemotingCommand.request(RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {},
                                                             json.dumps({"groupName": "CG_stored"}).encode()), 10)
        assert created.code == ResponseCode.SUCCESS, created.remark
        beat = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, body=json.dumps({
            "clientID": "real", "consumerDataSet": [{"groupName": "CG_live", "subscriptionDataSet": [
                {"topic": "Folded", "subString": "*"}]}]}).encode()), 10)
        assert beat.code == ResponseCode.SUCCESS
        codes = await _commit_all(conn, (f"CG_made_up_{i}" for i in range(made_up)), 0)       # lag 3 each
        assert codes == {ResponseCode.SUCCESS}
        for group in ("CG_live", "CG_stored"):
            assert await _commit(conn, group, 2) == ResponseCode.SUCCESS   # lag 1: the smallest here
        total = made_up * 3 + 2
        lag, folded = await _scrape_when_lag_is(broker, total)
        rows = await _snapshot_when_lag_is(broker, total)
    finally:
        conn.close()            # (CG_live's consumer is connected until here)
    assert sum(v for k, v in lag.items() if k[1] in ("Folded", OTHER)) == total
    assert len(lag) == BrokerMetrics.max_series + 1
    assert lag[("CG_live", "Folded")] == 1 and lag[("CG_stored", "Folded")] == 1
    assert len(rows) == BrokerMetrics.max_snapshot_lag_rows + 1
    for group in ("CG_live", "CG_stored"):
        assert {"group": group, "topic": "Folded", "queue_id": 0, "lag": 1} in rows


@bounded(120)
async def test_long_made_up_group_names_cannot_grow_a_snapshot_line_past_its_budget(broker_factory):
    """The snapshot rows were capped by count only (50,000), and a group name may be 255 characters: written as
    JSON escapes (\\ud83d\\ude00, 12 bytes one), a row of a made-up name is some 3 KB, so 50,000 of them made each
    minute's line 150 MB on the store's disk (the count cap's own reason: 4 MB lines were too much). Rows are kept
    within max_snapshot_lag_bytes too, the rest summed under _other as for the count."""
    broker = broker_factory("--metrics-snapshot-interval-s", "1")
    per_row = 12 * 255
    made_up = BrokerMetrics.max_snapshot_lag_bytes // per_row + 500       # far fewer than the row cap
    assert made_up < BrokerMetrics.max_snapshot_lag_rows
    await _long_named_groups_lag_1_each(broker, made_up)
    rows = await _snapshot_when_lag_is(broker, made_up, tries=300)
    assert sum(r["lag"] for r in rows if r["topic"] in ("Folded", OTHER)) == made_up
    last = _snapshot_lines(broker)[-1]
    assert len(last) <= BrokerMetrics.max_snapshot_lag_bytes + 4096, len(last)
    assert rows[-1]["group"] == OTHER and rows[-1]["lag"] > 0


def _lag_label_bytes(broker) -> tuple[int, float]:
    """(the bytes of the lag gauge's label values in one scrape, the sum of its values)."""
    text = urllib.request.urlopen(f"http://{broker.metrics}/metrics", timeout=10).read().decode()
    size, total = 0, 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == LAG and s.labels["topic"] in ("Folded", OTHER):
                size += sum(len(v.encode()) for v in s.labels.values())
                total += s.value
    return size, total


@bounded(120)
async def test_long_made_up_group_names_cannot_grow_the_lag_gauge_past_its_budget(broker):
    """The lag gauge's series were capped by count only (10,000), and a group name may be 255 characters (an
    emoji is 4 bytes of UTF-8): 10,000 made-up groups with such names made every scrape 10 MB of labels, which
    Prometheus stores. The named series are kept within max_series_bytes of label values too."""
    per_row = 4 * 249 + 6 + len("Folded")
    made_up = BrokerMetrics.max_series_bytes // per_row + 500           # far fewer than max_series
    assert made_up < BrokerMetrics.max_series
    await _long_named_groups_lag_1_each(broker, made_up)
    loop = asyncio.get_running_loop()
    for _ in range(200):
        size, total = await loop.run_in_executor(None, _lag_label_bytes, broker)
        if total == made_up:
            break
        await asyncio.sleep(0.1)
    assert total == made_up
    assert size <= BrokerMetrics.max_series_bytes, size
