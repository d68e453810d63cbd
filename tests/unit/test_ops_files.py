"""The operator's files parse and hang together: the Grafana dashboard (as generated, with a Prometheus
datasource variable), the alert rules, systemd units and the compose file (every path they name exists)."""
from __future__ import annotations

import configparser
import json
import re
import runpy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
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


def test_every_alert_is_in_the_operations_guide_with_its_severity():
    """docs/operations.md's alert table is what an operator reads to know what pages them: an alert added to
    alerts.yml without its row (TxmqTransactionsLost, critical) was one they learnt of when it fired."""
    rules = [r for g in yaml.safe_load((OPS / "prometheus" / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| (Txmq\w+) \|.*\| (warning|critical) \|$",
                                             (REPO / "docs" / "operations.md").read_text(), re.M)}
    assert {r["alert"]: r["labels"]["severity"] for r in rules} == rows


# ------------------------------------------------------------------ systemd, cron, compose
SYSTEMD = OPS / "systemd"


def _unit(path) -> dict[str, list[tuple[str, str]]]:
    """A unit file as {section: [(key, value), ...]} (keys may repeat, e.g. ExecStart in a oneshot)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def _get(section: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in section if k == key]


def _console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [x.strip() for x in cfg["options.entry_points"]["console_scripts"].splitlines() if x.strip()]
    return dict(tuple(part.strip() for part in x.split("=", 1)) for x in lines)


def _job_argv(command: str) -> list[str]:
    """The argv of a txmq job in a unit or crontab line, with shell expansions given sample values."""
    command = command.replace("$${TXMQ_SPARK_MASTER:-local[*]}", "local[*]").replace("\\%", "%")
    command = re.sub(r"\$\(date [^)]*\)", "2024-03-10", command)
    argv = shlex.split(command)
    return argv[1:] if argv[0] == "exec" else argv


def _check_job(argv: list[str]) -> None:
    """The command is one of our console scripts and its arguments parse with that script's parser."""
    scripts = _console_scripts()
    name = argv[0].rsplit("/", 1)[-1]
    assert name in scripts, f"{name} is not a console script of setup.cfg"
    if name == "txmq-spark":
        from ops.spark.cli import build_parser

        args = build_parser().parse_args(argv[1:])
        assert args.store_dir == ["/var/lib/txmq/store"]      # repeatable: one per broker
    elif name == "txmq-admin":
        assert argv[1:][-2:][0] == "apply-expiry" and argv[-1] == "/var/lib/txmq/plans/expiry.json"


def test_systemd_units_name_real_commands_and_every_timer_its_service():
    units = {p.name: _unit(p) for p in SYSTEMD.iterdir() if p.suffix in (".service", ".timer")}
    assert set(units) == {"txmq.service", "txmq-rollup.service", "txmq-rollup.timer", "txmq-expiry.service",
                          "txmq-expiry.timer"}
    broker = units["txmq.service"]
    assert _get(broker["Service"], "ExecStart") == ["/opt/txmq/bin/txmq-broker"]
    assert _get(broker["Install"], "WantedBy") == ["multi-user.target"]
    env_file = _get(broker["Service"], "EnvironmentFile")[0].lstrip("-")
    assert env_file == "/etc/txmq/txmq.env" and (SYSTEMD / "txmq.env").exists()
    from broker.config import BrokerConfig

    fields = {f.upper() for f in BrokerConfig.__dataclass_fields__}
    for line in (SYSTEMD / "txmq.env").read_text().splitlines():
        if line.startswith("BROKER_") and not line.startswith("BROKER_ADMIN_"):
            assert line.split("=")[0][len("BROKER_"):] in fields, line
    jobs = 0
    for name in ("txmq-rollup", "txmq-expiry"):
        timer = units[f"{name}.timer"]["Timer"]
        assert _get(timer, "Unit") == [f"{name}.service"] and _get(timer, "OnCalendar")
        assert _get(timer, "Persistent") == ["true"]
        service = units[f"{name}.service"]["Service"]
        assert _get(service, "Type") == ["oneshot"]
        for command in _get(service, "ExecStart"):
            if command.startswith("/bin/sh -c "):
                command = shlex.split(command)[2]
            _check_job(_job_argv(command))
            jobs += 1
    assert jobs == 3        # rollup; expiry plan, then its application by the broker


def test_systemd_analyze_verify_finds_nothing_but_the_missing_install():
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze on this machine")
    files = sorted(str(p) for p in SYSTEMD.iterdir() if p.suffix in (".service", ".timer"))
    done = subprocess.run(["systemd-analyze", "verify", *files], capture_output=True, text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines()
                if line.strip() and "/opt/txmq/bin/" not in line]      # txmq is not installed here
    assert not problems, problems


def test_cron_example_runs_the_same_jobs():
    lines = [x for x in (OPS / "cron" / "txmq.cron").read_text().splitlines() if x and not x.startswith("#")
             and "=" not in x.split()[0]]
    assert len(lines) == 2
    for line in lines:
        fields = line.split(None, 6)
        assert fields[5] == "txmq"
        for command in re.split(r"\s*&&\s*", fields[6]):
            argv = _job_argv(command.split(">>")[0])
            if argv[0] != "mkdir":
                _check_job(argv)


def test_compose_mounts_exist_and_wire_prometheus_and_grafana():
    compose_path = OPS / "compose.yml"
    compose = yaml.safe_load(compose_path.read_text())
    services = compose["services"]
    assert set(services) == {"txmq", "prometheus", "grafana"}
    build = services["txmq"]["build"]
    assert (OPS / build["context"] / build["dockerfile"]).is_file()
    mounted: dict[str, dict[str, str]] = {}
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                host = (OPS / source).resolve()
                assert host.exists(), f"{name}: {source} does not exist"
                mounted.setdefault(name, {})[target] = str(host)
            else:
                assert source in compose["volumes"], f"{name}: named volume {source} is not declared"
    # Prometheus: its config is mounted, and every rule file it names is mounted beside it
    prom = mounted["prometheus"]
    config_target = next(a.split("=", 1)[1] for a in services["prometheus"]["command"] if a.startswith("--config"))
    config = yaml.safe_load(open(prom[config_target]))
    for rule_file in config["rule_files"]:
        assert str(Path(config_target).parent / rule_file) in prom, rule_file
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    metrics_port = services["txmq"]["ports"][2].rsplit(":", 1)[1]
    assert targets == [f"txmq:{metrics_port}"] and config["scrape_configs"][0]["job_name"] == "txmq"
    # Grafana: the provider's folder receives the dashboard; the data source is the Prometheus service
    graf = mounted["grafana"]
    prov_dir = graf["/etc/grafana/provisioning/dashboards"]
    provider = yaml.safe_load(open(Path(prov_dir) / "txmq.yml"))["providers"][0]
    dashboards = [t for t in graf if t.startswith(provider["options"]["path"] + "/")]
    assert dashboards and all(graf[t].endswith("txmq-dashboard.json") for t in dashboards)
    ds = yaml.safe_load(open(Path(graf["/etc/grafana/provisioning/datasources"]) / "txmq.yml"))["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert services["txmq"]["environment"]["BROKER_HOST"] == "0.0.0.0"
