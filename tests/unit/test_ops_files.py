"""The operator's files parse and hang together: the Grafana dashboard (as generated, with a Prometheus
datasource variable), the alert rules, systemd units and the compose file (every path they name exists)."""
from __future__ import annotations

import json
import runpy

import yaml

from tests.support.broker_process import REPO

OPS = REPO / "ops"


def test_dashboard_json_is_what_the_generator_writes():
    gen = runpy.run_path(str(OPS / "grafana" / "make_dashboard.py"))
    assert (OPS / "grafana" / "txmq-dashboard.json").read_text() == gen["render"](), \
        "run: python ops/grafana/make_dashboard.py"


def test_dashboard_is_importable_into_grafana_9_with_a_datasource_variable():
    d = json.loads((OPS / "grafana" / "txmq-dashboard.json").read_text())
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"]["uid"] == "${datasource}"
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Consumers", "Latency", "Transactions", "Storage", "Broker"]
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24


def test_every_alert_has_severity_summary_and_description():
    rules = [r for g in yaml.safe_load((OPS / "prometheus" / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    assert len(rules) >= 8
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
