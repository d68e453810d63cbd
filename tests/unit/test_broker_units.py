"""Pure parts of the broker and clients: check policy, config and CLI, route JSON, allocation, subscriptions."""
from __future__ import annotations

import pytest

from broker.cli import config_from
from broker.clients import build_subscription
from broker.config import BrokerConfig
from broker.transaction.check import Policy, first_check_time, next_check_after_check
from consumer.rebalance import allocate_averagely
from consumer.pull_consumer import MessageQueue
from protocol.errors import ConfigError
from protocol.message import java_string_hash
from protocol.route import BrokerData, QueueData, TopicRouteData, decode_route, encode_route

P = Policy(check_interval_ms=60000, timeout_ms=6000, check_max=15, retention_ms=72 * 3600 * 1000)


def test_check_decisions():
    from broker.transaction.core import SendCheck, TransactionCore, Tx, Write

    def due(now, checks=0, has_producer=True, store_ts=0):
        core = TransactionCore(P, lambda off: None)
        tx = Tx(1, 0, "PG", "T", "U", store_ts, checks=checks)
        core.add(tx)
        actions, deferred = core.due(now, lambda t: "conn" if has_producer else None)
        return ([type(a) for a in actions], [t.half_offset for t in deferred])

    assert due(6_000) == ([SendCheck], [])
    assert due(5_999) == ([], [])
    assert due(10_000, has_producer=False) == ([], [1])
    assert due(10_000, checks=15) == ([Write], [])
    assert due(10_000, checks=14) == ([SendCheck], [])
    over = 72 * 3600 * 1000 + 1          # age alone never dead-letters here: the plan expires it
    assert due(over + 6_000, store_ts=over - 72 * 3600 * 1000 - 10) == ([SendCheck], [])


def test_immunity_and_backoff():
    assert first_check_time(P, 1000, None) == 7000
    assert first_check_time(P, 1000, "30") == 31000
    assert first_check_time(P, 1000, "-1") == 7000
    assert first_check_time(P, 1000, "soon") == 7000
    assert [next_check_after_check(P, 0, n) for n in range(5)] == [60000, 120000, 240000, 240000, 240000]


def test_config_from_flags_and_environment():
    c = config_from(["--port", "0", "--store-dir", "/tmp/x"], {"BROKER_PORT": "5", "BROKER_FLUSH": "async",
                                                                 "BROKER_AUTO_CREATE_TOPIC": "false"})
    assert (c.port, c.store_dir, c.flush, c.auto_create_topic) == (0, "/tmp/x", "async", False)
    with pytest.raises(ConfigError):
        config_from([], {"BROKER_NAMESRV_PORT": "seventy"})
    with pytest.raises(ConfigError):
        BrokerConfig(flush="sometimes")
    with pytest.raises(ConfigError):
        BrokerConfig(port=70000)
    with pytest.raises(ConfigError):
        BrokerConfig(disk_clean_ratio=0.86)                 # above the force ratio
    with pytest.raises(ConfigError):
        BrokerConfig(gil_switch_interval_ms=0)
    for ttl in (0, -1):         # a lock lapsed as granted: every orderly consumer of a group got every queue
        with pytest.raises(ConfigError, match="queue_lock_max_live_ms"):
            BrokerConfig(queue_lock_max_live_ms=ttl)
    assert config_from(["--gil-switch-interval-ms", "0.5"], {}).gil_switch_interval_ms == 0.5
    assert BrokerConfig(host="0.0.0.0").public_host == "127.0.0.1"


def test_route_json_round_trip_both_forms():
    route = TopicRouteData([QueueData("b", 4, 4, 6)], [BrokerData("C", "b", {0: "127.0.0.1:10911", 1: "h:2"})])
    for strict in (False, True):
        assert decode_route(encode_route(route, strict=strict)) == route


def test_allocate_averagely_matches_rocketmq():
    queues = [MessageQueue("T", "b", i) for i in range(8)]
    parts = [allocate_averagely(queues, ["c1", "c2", "c3"], me) for me in ("c1", "c2", "c3")]
    assert [[q.queue_id for q in p] for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert allocate_averagely(queues, ["c1"], "c9") == []
    many = [allocate_averagely(queues[:2], ["a", "b", "c"], me) for me in "abc"]
    assert [len(p) for p in many] == [1, 1, 0]


def test_tag_subscription_filters_by_java_hash():
    sub = build_subscription("T", "TagA || TagB ")
    f = sub.tag_filter()
    assert f(java_string_hash("TagA")) and f(java_string_hash("TagB")) and not f(java_string_hash("TagC"))
    assert build_subscription("T", "*").tag_filter() is None


@pytest.mark.parametrize("expression", [
    "TagA", " TagA || TagB ", "TagA\u3000", "\u00a0B\u00a0", " \u0010B\u0010 ||", "\t\x00 C \x1f\n", " \x7f ",
    "a ||  || \x01", "\x85x\x85", " \x1fy \x1f ", "z\u2003 || \x00", "\U0001F600 ",
])
def test_tag_subscription_tags_are_java_trimmed(expression):
    """build_subscription's inline trim (spaces first, the control chars only when an end has one) gives each tag
    as java_trim does (FilterAPI: split on "||", String.trim, no empty tag), and its code the Java hash of that."""
    from protocol.message import java_trim
    want = frozenset(t for t in map(java_trim, expression.split("||")) if t)
    sub = build_subscription("T", expression)
    assert (sub.tags, sub.codes) == (want, frozenset(map(java_string_hash, want)))


def test_loop_histogram_exposes_what_prometheus_clients_histogram_does():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from broker.metrics import LoopHistogram
    buckets = (0.0005, 0.001, 0.01, 1.0)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    h = Histogram("lat", "doc", ["code"], buckets=buckets, registry=theirs)
    mine = LoopHistogram("lat", "doc", ["code"], buckets, ours)
    for v, code in [(0.0005, "0"), (0.0004, "0"), (0.002, "1"), (5.0, "0"), (1.0, "1"), (0.01, "0")]:
        h.labels(code).observe(v)
        mine.labels(code).observe(v)

    def lines(registry):
        return sorted(line for line in generate_latest(registry).decode().splitlines()
                      if line.startswith("lat_") and "_created" not in line)
    assert lines(ours) == lines(theirs)


def test_a_master_must_be_broker_id_0():
    """Name servers take a broker name's queues only from its id 0 (RocketMQ's MASTER_ID; RocketMQ's broker
    forces a master's id to 0). A master started with --broker-id 1 registered as a slave of nobody: every
    registration answered SUCCESS and none of its topics was ever routed (clients: TOPIC_NOT_EXIST). It is
    refused at start-up, as a SLAVE with id 0 is."""
    from broker.namesrv.table import RouteTable
    from protocol.registration import DataVersion, RegisterBrokerBody, RegisteredTopic

    table = RouteTable()
    table.register(cluster="C", broker_addr="h:1", broker_name="b", broker_id=1, ha_server_addr="",
                   body=RegisterBrokerBody({"T": RegisteredTopic("T", 4, 4, 6)}, DataVersion(1, 1), []), conn=None,
                   now_ms=0)
    assert table.route("T") is None                         # what such a master's clients were told
    for role in ("ASYNC_MASTER", "SYNC_MASTER"):
        with pytest.raises(ConfigError, match="broker_id"):
            BrokerConfig(broker_role=role, broker_id=1, ha_port=0)
    assert BrokerConfig(broker_role="SYNC_MASTER", ha_port=0).broker_id == 0
    assert BrokerConfig(broker_role="SLAVE", broker_id=2, ha_master_addr="h:1").broker_id == 2


def test_a_cluster_with_ports_closer_than_3_serves_no_vip_channel():
    """Each broker serves its port - 2 as well (--vip-channel): with --port-step 1 or 2 that is another broker's
    port, and whichever bound it second failed to start. Such a cluster's brokers serve none; a flag given after
    -- still wins."""
    from broker.cluster import ClusterSupervisor, build_parser

    def argv(*flags):
        args = build_parser().parse_args(["--store-root", "/nowhere", "--brokers", "3", *flags])
        return ClusterSupervisor(args, python="python")._broker_child(2, "127.0.0.1:9876").argv

    def vip(argv):
        return [argv[i + 1] for i, f in enumerate(argv) if f == "--vip-channel"]

    assert vip(argv()) == []
    assert vip(argv("--port-step", "3")) == []
    assert vip(argv("--port-step", "2")) == ["false"]
    assert vip(argv("--port-step", "1", "--", "--vip-channel", "true")) == ["false", "true"]




def _parsers():
    from broker import admin, cli, cluster
    from broker.namesrv.config import NamesrvConfig
    from ops.spark import cli as spark
    return {"broker": cli.build_parser(), "namesrv": cli.build_parser(NamesrvConfig, "NAMESRV_"),
            "admin": admin.build_parser(), "cluster": cluster.build_parser(), "spark": spark.build_parser()}



@pytest.mark.parametrize("command, prefix, whole", [
    ("broker", ["--max-undecided-per", "8"], ["--max-undecided-per-group", "8"]),
    ("broker", ["--stor", "/tmp/x"], ["--store-dir", "/tmp/x"]), ("namesrv", ["--po", "0"], ["--port", "0"]),
    ("admin", ["--brok=127.0.0.1:1", "list"], ["--broker=127.0.0.1:1", "list"]),
    ("admin", ["list", "--lim", "1"], ["list", "--limit", "1"]),
    ("cluster", ["--store-root", "/nowhere", "--brok", "3"], ["--store-root", "/nowhere", "--brokers", "3"]),
    # txmq-spark writes the expiry plans retention's dead letters come from: `--retention 1` was --retention-hours
    ("spark", ["expiry", "--out", "p.json", "--retention", "1"], ["expiry", "--out", "p.json", "--retention-hours", "1"]),
    ("spark", ["expiry", "--out", "p.json", "--now", "1700000000000"],
     ["expiry", "--out", "p.json", "--now-ms", "1700000000000"])])
def test_a_prefix_of_a_flag_is_refused_not_taken_for_the_flag(command, prefix, whole, capsys):
    """argparse took a prefix of a flag for the flag: `--max-undecided 8`, given to a broker before that flag
    existed, set --max-undecided-per-group to 8 (every group limited to 8 undecided transactions) without a
    word, and any flag added later under a shorter name silently changes what an old command line meant. Every
    txmq command line (broker, namesrv, admin and its actions, cluster, txmq-spark and its commands) takes whole
    flag names only."""
    parser = _parsers()[command]
    parser.parse_args(whole)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(prefix)
    given = next(a for a in prefix if a.startswith("--") and a not in whole)
    assert exc.value.code == 2 and f"unrecognized arguments: {given}" in capsys.readouterr().err
