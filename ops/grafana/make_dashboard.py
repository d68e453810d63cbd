"""Writes ops/grafana/txmq-dashboard.json: ``python ops/grafana/make_dashboard.py``.

The dashboard is generated so each panel is one line here (title, unit, queries) and the JSON
stays consistent (ids, grid, datasource). tests/integration/test_prometheus.py evaluates every
query below against a real Prometheus scraping a real broker, and checks the JSON file is what
this script writes. Importable into Grafana 9+; ``$datasource`` picks the Prometheus data source
and ``$instance`` one or more brokers (``label_values(txmq_build_info, instance)``).
"""
from __future__ import annotations

import json
import os
import sys

UID = "txmq-broker"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance"'                # every query is filtered by the instance variable
RATE = "$__rate_interval"
APP = 'consumer_group!~"CID_RMQ_SYS_.*|TOOLS_CONSUMER"'    # the broker's own groups are not consumers


def q(expr: str, legend: str = "") -> dict:
    return {"expr": expr, "legend": legend}


def quantiles(metric: str, match: str, by: str = "") -> list[dict]:
    """p50 and p99 of a histogram over $__rate_interval, summed across instances (by ``by``)."""
    labels = f"le{', ' + by if by else ''}"
    out = []
    for p in ("0.5", "0.99"):
        name = f"p{int(float(p) * 100)}"
        legend = f"{name} {{{{{by}}}}}" if by else name
        out.append(q(f"histogram_quantile({p}, sum by ({labels}) (rate({metric}_bucket{{{match}}}[{RATE}])))", legend))
    return out


# (row title, [(panel title, kind, unit, description, [queries])])
ROWS = [
    ("Traffic", [
        ("Messages in per topic", "timeseries", "msg/s",
         "Messages stored per second (commits count when the real message is written).",
         [q(f"sum by (topic) (rate(rocketmq_messages_in_total{{{SEL}}}[{RATE}]))", "{{topic}}")]),
        ("Messages out per topic and group", "timeseries", "msg/s", "Messages delivered by pulls per second.",
         [q(f"sum by (topic, consumer_group) (rate(rocketmq_messages_out_total{{{SEL}}}[{RATE}]))",
            "{{topic}} → {{consumer_group}}")]),
        ("Bytes in / out", "timeseries", "Bps", "Body bytes stored and record bytes delivered per second.",
         [q(f"sum(rate(rocketmq_throughput_in_total{{{SEL}}}[{RATE}]))", "in"),
          q(f"sum(rate(rocketmq_throughput_out_total{{{SEL}}}[{RATE}]))", "out")]),
    ]),
    ("Consumers", [
        ("Consumer lag per group", "timeseries", "short",
         "Messages stored but not yet consumed (committed offset to the queue's end), per group and topic.",
         [q(f"sum by (consumer_group, topic) (rocketmq_consumer_lag_messages{{{SEL}, {APP}}})",
            "{{consumer_group}} / {{topic}}")]),
        ("Lag trend (per minute)", "timeseries", "short",
         "How fast each group's lag grows (>0) or shrinks (<0); the ConsumerLagGrowing alert's input.",
         [q(f"sum by (consumer_group) (deriv(rocketmq_consumer_lag_messages{{{SEL}, {APP}}}[5m])) * 60",
            "{{consumer_group}}")]),
        ("Connected clients per group", "timeseries", "short", "Live consumer and producer connections by group.",
         [q(f"sum by (consumer_group) (rocketmq_consumer_connections{{{SEL}}})", "consumer {{consumer_group}}"),
          q(f"sum by (producer_group) (rocketmq_producer_connections{{{SEL}}})", "producer {{producer_group}}")]),
    ]),
    ("Latency", [
        ("Send latency", "timeseries", "s", "Broker handling time of SEND_MESSAGE* requests (p50, p99).",
         quantiles("rocketmq_rpc_latency", f'{SEL}, request_code=~"SEND_.*"')),
        ("Pull latency", "timeseries", "s",
         "Broker handling time of PULL_MESSAGE (p50, p99); includes the long-poll hold of pulls that waited.",
         quantiles("rocketmq_rpc_latency", f'{SEL}, request_code="PULL_MESSAGE"')),
        ("Store append and flush", "timeseries", "s",
         "From a put entering the writer queue to its acknowledgement (append), and one flush (p99).",
         [quantiles("txmq_store_append_latency_seconds", SEL)[1] | {"legend": "append p99"},
          quantiles("txmq_store_flush_latency_seconds", SEL)[1] | {"legend": "flush p99"}]),
        ("Error responses", "timeseries", "reqps",
         "Responses with a non-zero code, by request and code (PULL_NOT_FOUND=19 and QUERY_NOT_FOUND=22 are "
         "normal).",
         [q(f'sum by (request_code, response_code) (rate(rocketmq_rpc_latency_count{{{SEL}, response_code!="0"}}'
            f"[{RATE}]))", "{{request_code}} {{response_code}}")]),
    ]),
    ("Transactions", [
        ("Undecided transactions", "timeseries", "short", "Half messages without a decision (the pending index).",
         [q(f"sum by (instance) (rocketmq_half_messages{{{SEL}}})", "{{instance}}")]),
        ("Oldest undecided transaction", "timeseries", "s",
         "Age of the oldest undecided half per producer group (TransactionUndecidedTooLong alert).",
         [q(f"max by (producer_group) (txmq_half_message_oldest_age_seconds{{{SEL}}})", "{{producer_group}}")]),
        ("Commits and rollbacks", "timeseries", "ops", "Decisions per second by producer group.",
         [q(f"sum by (producer_group) (rate(rocketmq_commit_messages_total{{{SEL}}}[{RATE}]))",
            "commit {{producer_group}}"),
          q(f"sum by (producer_group) (rate(rocketmq_rollback_messages_total{{{SEL}}}[{RATE}]))",
            "rollback {{producer_group}}")]),
        ("Checks and their answers", "timeseries", "ops",
         "CHECK_TRANSACTION_STATE sent, and the producers' answers by result.",
         [q(f"sum by (producer_group) (rate(txmq_transaction_checks_total{{{SEL}}}[{RATE}]))",
            "checks {{producer_group}}"),
          q(f"sum by (result) (rate(txmq_transaction_check_answers_total{{{SEL}}}[{RATE}]))", "answer {{result}}")]),
        ("Time to decision", "timeseries", "s", "From half message to commit, rollback or dead letter (p50, p99).",
         quantiles("rocketmq_finish_message_latency", SEL)),
        ("Dead letters by reason", "timeseries", "short",
         "Transactions dead-lettered since the broker started, by reason (max-checks, expired, ...), and "
         "messages consumers gave up on (%DLQ% topics). A step up is a new dead letter (TxmqTransactionDeadLetters).",
         [q(f"sum by (reason) (txmq_transaction_dead_letters_total{{{SEL}}})"
            f' or label_replace(sum(rocketmq_messages_in_total{{{SEL}, topic=~"%DLQ%.*"}}),'
            ' "reason", "consumer-retries-exhausted", "", "")', "{{reason}}")]),
    ]),
    ("Storage", [
        ("Disk use", "timeseries", "percentunit",
         "The store's file system in use (its space, and its inodes: df -i), beside this broker's clean / "
         "force-clean / refuse ratios.",
         [q(f"max by (instance) (txmq_store_disk_usage_ratio{{{SEL}}})", "used {{instance}}"),
          q(f"max by (instance) (txmq_store_disk_inode_usage_ratio{{{SEL}}})", "inodes {{instance}}"),
          q(f"max by (limit) (txmq_store_disk_ratio_limit{{{SEL}}})", "{{limit}}")]),
        ("Writes refused", "stat", "short",
         "1 while sends are refused because the disk is over disk_refuse_ratio (red), else 0.",
         [q(f"max(txmq_store_writes_refused{{{SEL}}})", "refusing")]),
        ("Write refusals", "timeseries", "reqps", "Write requests refused for disk space or inodes per second.",
         [q(f"sum(rate(txmq_store_write_refusals_total{{{SEL}}}[{RATE}]))", "refused")]),
        ("Commit log size", "timeseries", "bytes", "Commit-log bytes on disk (segments are preallocated).",
         [q(f"sum by (instance) (rocketmq_storage_size{{{SEL}}})", "{{instance}}")]),
        ("Metadata writes", "timeseries", "s",
         "p99 of one metadata write by file (consumerOffset.json, topics.json, the checkpoint, ...), synced: a slow "
         "disk shows here before anything hangs (alert TxmqMetadataWriteSlow).",
         [quantiles("txmq_metadata_write_seconds", SEL, by="file")[1]]),
    ]),
    ("Broker", [
        ("Up", "stat", "short", "Prometheus reached the broker's metrics (1) or not (0), and the version it runs.",
         [q(f"up{{{SEL}}} * on (instance) group_left (version) txmq_build_info{{{SEL}}}", "{{instance}} {{version}}")]),
        ("Connections", "timeseries", "short", "Open client connections per listener (broker, namesrv).",
         [q(f"sum by (listener) (txmq_open_connections{{{SEL}}})", "{{listener}}")]),
        ("Event-loop lag", "timeseries", "s",
         "Worst event-loop lag over the last second: what every request waits before it is read.",
         [q(f"max by (instance) (txmq_event_loop_lag_seconds{{{SEL}}})", "{{instance}}")]),
        ("Requests refused by a guard", "timeseries", "reqps",
         "Requests refused by per-client limits, ACL or writer pressure, by reason.",
         [q(f"sum by (reason) (rate(txmq_requests_refused_total{{{SEL}}}[{RATE}]))", "{{reason}}")]),
    ]),
]


def panel(pid: int, x: int, y: int, w: int, title: str, kind: str, unit: str, desc: str, queries: list) -> dict:
    targets = [{"datasource": DS, "expr": t["expr"], "legendFormat": t["legend"] or "__auto",
                "refId": chr(ord("A") + i), "range": True} for i, t in enumerate(queries)]
    p = {"id": pid, "type": kind, "title": title, "description": desc, "datasource": DS,
         "gridPos": {"h": 8, "w": w, "x": x, "y": y}, "targets": targets,
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}}
    if kind == "stat":
        p["fieldConfig"]["defaults"]["thresholds"] = {"mode": "absolute", "steps": [
            {"color": "green", "value": None}, {"color": "red", "value": 1}]}
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "background", "textMode": "value_and_name"}
    else:
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}
    return p


def dashboard() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        w = 8 if len(row_panels) % 3 == 0 else 24 // min(len(row_panels), 4)    # 3 or 4 panels a line
        for i, spec in enumerate(row_panels):
            x = (i * w) % 24
            if i and x == 0:
                y += 8
            panels.append(panel(pid, x, y, w, *spec))
            pid += 1
        y += 8
    instance = {"name": "instance", "label": "broker", "type": "query", "datasource": DS,
                "definition": "label_values(txmq_build_info, instance)",
                "query": {"query": "label_values(txmq_build_info, instance)", "refId": "instance"},
                "refresh": 2, "multi": True, "includeAll": True, "allValue": ".+",
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}
    datasource = {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                  "current": {}, "hide": 0, "refresh": 1, "regex": ""}
    return {
        "uid": UID, "title": "txmq broker", "tags": ["txmq", "rocketmq"], "timezone": "browser",
        "schemaVersion": 37, "version": 1, "editable": True, "graphTooltip": 1, "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"}, "fiscalYearStartMonth": 0, "liveNow": False,
        "description": "txmq: traffic, consumer lag, latency, transactions, storage, broker health. "
                       "Generated by ops/grafana/make_dashboard.py.",
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [datasource, instance]},
        "links": [], "panels": panels,
        "__inputs": [], "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "9.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"}],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "txmq-dashboard.json")

if __name__ == "__main__":
    with open(PATH, "w", encoding="utf-8") as fh:
        fh.write(render())
    print(f"wrote {PATH}", file=sys.stderr)
