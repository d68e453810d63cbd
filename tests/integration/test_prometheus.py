"""The operator's kit against a real Prometheus: promtool checks the rules and runs their unit tests,
and a Prometheus on 127.0.0.1 scrapes a real broker under a small workload (sends, a push and a pull
consumer, committed, rolled-back, checked and dead-lettered transactions, refused topic creations),
then every dashboard query returns data and every alert expression evaluates without error.

Skipped, saying why, where the Debian ``prometheus`` package is not installed and cannot be.
"""
from __future__ import annotations

import asyncio
import json
import math
import subprocess
import time

import pytest
import yaml

from consumer import ConsumeStatus, PullConsumer, PushConsumer
from producer import LocalTransactionState as S
from producer import Producer, TransactionProducer
from protocol.message import Prop
from tests.support.broker_process import REPO
from tests.support.prometheus import PrometheusProcess, find_prometheus

DASHBOARD = REPO / "ops" / "grafana" / "txmq-dashboard.json"
ALERTS = REPO / "ops" / "prometheus" / "alerts.yml"
RATE_INTERVAL = "1m"        # what Grafana makes of $__rate_interval with a 15 s scrape interval


@pytest.fixture(scope="module")
def prom_bins():
    found = find_prometheus()
    if isinstance(found, str):
        pytest.skip(found)
    return found


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_rules_and_the_example_config(prom_bins):
    promtool = prom_bins[1]
    rules = _promtool(promtool, "check", "rules", str(ALERTS))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in rules.stdout
    config = _promtool(promtool, "check", "config", "ops/prometheus/prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


def test_promtool_alert_unit_tests_pass(prom_bins):
    done = _promtool(prom_bins[1], "test", "rules", "ops/prometheus/alerts_test.yml")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    # every alert has a unit test
    tested = {t["alertname"] for case in yaml.safe_load((REPO / "ops/prometheus/alerts_test.yml").read_text())["tests"]
              for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in _alert_rules()}


# ------------------------------------------------------------------ the real thing
def _alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def _dashboard_queries(instance: str) -> list[tuple[str, str]]:
    """(panel title, query as Grafana sends it for one broker) for every target of every panel."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL).replace("$instance", instance)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            out.append((panel["title"], expr))
    return out


class Listener:
    """By body: commit, rollback, later (UNKNOW, then COMMIT when checked), stuck (UNKNOW forever: dead
    letter after the broker's maximum checks), parked (UNKNOW, not checked for an hour: stays undecided)."""

    def execute_local_transaction(self, msg, arg):
        kind = msg.body.split(b"-")[0]
        return {b"commit": S.COMMIT_MESSAGE, b"rollback": S.ROLLBACK_MESSAGE}.get(kind, S.UNKNOW)

    def check_local_transaction(self, msg):
        return S.COMMIT_MESSAGE if msg.body == b"later" else S.UNKNOW


async def _wait_for(prom: PrometheusProcess, expr: str, want, timeout: float = 30.0) -> float:
    """Poll an instant query until its single value satisfies ``want`` (bounded)."""
    res: dict = {}
    try:
        async with asyncio.timeout(timeout):
            while True:
                res = await asyncio.to_thread(prom.query, expr)
                values = [float(r["value"][1]) for r in res.get("data", {}).get("result", [])]
                if values and want(values[0]):
                    return values[0]
                await asyncio.sleep(0.25)
    except TimeoutError:
        targets = (await asyncio.to_thread(prom.api, "targets"))["data"]["activeTargets"]
        raise AssertionError(f"{expr}: last answer {res}; targets "
                             f"{[(t['health'], t['lastError']) for t in targets]}\n{prom.log()}") from None


async def _trickle(producer: Producer, tx: TransactionProducer, stop: asyncio.Event) -> None:
    """Keep traffic flowing while the queries run, so every rate and quantile has samples to work on."""
    i = 0
    while not stop.is_set():
        await producer.send("OpsOrders", b"trickle-%d" % i, tags="t")
        await tx.send_in_transaction("OpsTx", b"commit-%d" % i)
        i += 1
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass


async def test_dashboard_queries_return_data_and_alerts_evaluate(prom_bins, broker_factory, tmp_path):
    t0 = time.monotonic()
    b = broker_factory("--transaction-check-interval-ms", "200", "--transaction-timeout-ms", "100",
                       "--transaction-check-max", "2", "--max-auto-create-topics-per-s", "2")
    prom = PrometheusProcess(prom_bins[0], tmp_path / "prometheus", [b.metrics], [str(ALERTS)]).start()
    try:
        await asyncio.wait_for(_workload_and_checks(prom, b), 120)
    finally:
        prom.stop()
    print(f"\nprometheus test: {time.monotonic() - t0:.1f} s")


async def _workload_and_checks(prom: PrometheusProcess, b) -> None:
    inst = b.metrics
    await _wait_for(prom, f'up{{instance="{inst}"}}', lambda v: v == 1)
    received = asyncio.Event()
    seen: list[bytes] = []

    def on_message(msg):
        seen.append(msg.body)
        if len(seen) >= 20:
            received.set()
        return ConsumeStatus.CONSUME_SUCCESS

    stop = asyncio.Event()
    async with Producer(b.namesrv, "PG_ops") as producer, \
            TransactionProducer(b.namesrv, "PG_ops_tx", Listener()) as tx:
        for i in range(20):
            await producer.send("OpsOrders", b"order-%d" % i, tags="created", keys=f"order-{i}")
        push = PushConsumer(b.namesrv, "CG_ops_push", on_message, consume_from="first", suspend_ms=1000)
        push.subscribe("OpsOrders", "*")
        await push.start()
        pull = PullConsumer(b.namesrv, "CG_ops_pull")
        trickle = None
        try:
            await asyncio.wait_for(received.wait(), 20)
            # the pull group reads everything but commits half of each queue: a lag to graph
            for mq in await pull.fetch_queues("OpsOrders"):
                res = await pull.pull(mq, 0, max_nums=64)
                await pull.commit_offset(mq, res.next_begin_offset // 2)
            for body in (b"commit", b"rollback", b"later", b"stuck"):
                await tx.send_in_transaction("OpsTx", body)
            await tx.send_in_transaction("OpsTx", b"parked",
                                         properties={Prop.CHECK_IMMUNITY_TIME_IN_SECONDS: "3600"})
            # topic creation faster than --max-auto-create-topics-per-s: refused by the guard
            burst = await asyncio.gather(*(producer.send(f"OpsBurst{i}", b"x") for i in range(6)),
                                         return_exceptions=True)
            assert any(isinstance(r, Exception) for r in burst), burst
            trickle = asyncio.get_running_loop().create_task(_trickle(producer, tx, stop))
            # Prometheus has seen the dead letter, the checks and the refusals
            await _wait_for(prom, "sum(txmq_transaction_dead_letters_total)", lambda v: v >= 1)
            await _wait_for(prom, 'sum(txmq_transaction_check_answers_total{result="COMMIT"})', lambda v: v >= 1)
            await _wait_for(prom, "sum(txmq_requests_refused_total)", lambda v: v >= 1)
            await _wait_for(prom, "sum(rocketmq_half_messages)", lambda v: v >= 1)
            await _wait_for(prom, "count(txmq_half_message_oldest_age_seconds)", lambda v: v >= 1)
            await _wait_for(prom, 'sum(rocketmq_consumer_lag_messages{consumer_group="CG_ops_pull"})', lambda v: v > 0)
            await _check_dashboard(prom, inst)
            await _check_alerts(prom)
        finally:
            stop.set()
            if trickle is not None:
                await trickle
            await pull.shutdown()
            await push.shutdown()


async def _check_dashboard(prom: PrometheusProcess, inst: str, timeout: float = 30.0) -> None:
    """Every dashboard query succeeds and, once Prometheus holds a few scrapes of the workload (a rate
    needs two samples of a series in its window), returns at least one number that is not NaN."""
    instances = await asyncio.to_thread(prom.api, "label/instance/values", **{"match[]": "txmq_build_info"})
    assert instances["data"] == [inst], instances          # the $instance variable's query
    pending = _dashboard_queries(inst)
    deadline = time.monotonic() + timeout
    while True:
        empty = []
        for title, expr in pending:
            res = await asyncio.to_thread(prom.query, expr)
            assert res["status"] == "success", (title, expr, res.get("error"))
            values = [float(r["value"][1]) for r in res["data"]["result"]]
            if not values or all(math.isnan(v) for v in values):
                empty.append((title, expr))
        if not empty:
            return
        if time.monotonic() > deadline:
            raise AssertionError("dashboard queries without data:\n" + "\n".join(map(str, empty)))
        pending = empty
        await asyncio.sleep(0.5)


async def _check_alerts(prom: PrometheusProcess) -> None:
    for rule in _alert_rules():
        res = await asyncio.to_thread(prom.query, rule["expr"])
        assert res["status"] == "success", (rule["alert"], res)
    # Prometheus itself evaluated every rule, without error, and the workload's dead letter fires
    rules: list = []
    try:
        async with asyncio.timeout(20):
            while True:
                groups = (await asyncio.to_thread(prom.api, "rules"))["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
                if len(rules) == len(_alert_rules()) and all(r["lastEvaluation"] > "2000" for r in rules) \
                        and any(r["name"] == "TxmqTransactionDeadLetters" and r["state"] == "firing" for r in rules):
                    break
                await asyncio.sleep(0.25)
    except TimeoutError:
        raise AssertionError(f"rules not evaluated, or no dead-letter alert: "
                             f"{[(r['name'], r['state'], r['health'], r['lastEvaluation']) for r in rules]}") from None
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = {a["labels"]["alertname"]: a for a in (await asyncio.to_thread(prom.api, "alerts"))["data"]["alerts"]
              if a["state"] == "firing"}
    assert firing["TxmqTransactionDeadLetters"]["labels"]["reason"] == "max-checks"
    assert firing["TxmqTransactionDeadLetters"]["labels"]["producer_group"] == "PG_ops_tx"
    assert "TxmqBrokerDown" not in firing and "TxmqWritesRefused" not in firing
