"""The stand-alone name server's pure parts: the REGISTER_BROKER body both ways, the route table, the handlers."""
from __future__ import annotations

import json
import struct
import zlib

import pytest

from broker.namesrv.processors import NamesrvContext, namesrv_table
from broker.namesrv.table import RouteTable
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import HeaderError
from protocol.registration import (DataVersion, RegisterBrokerBody, RegisteredTopic, body_crc32,
                                   decode_register_body, encode_register_body, register_header)
from protocol.route import decode_route

T1 = RegisteredTopic("TopicA", 4, 4, 6)
SYS = RegisteredTopic("TBW102", 8, 8, 7, sys_flag=0)


def body(*topics, counter=1, ts=1700000000000) -> RegisterBrokerBody:
    return RegisterBrokerBody({t.name: t for t in topics}, DataVersion(ts, counter), [])


# ----------------------------------------------------------------- the body
def test_plain_body_is_what_fastjson_writes():
    got = encode_register_body(body(T1, counter=3, ts=17))
    assert got == (b'{"filterServerList":[],"topicConfigSerializeWrapper":{"dataVersion":{"counter":3,'
                   b'"timestamp":17},"topicConfigTable":{"TopicA":{"order":false,"perm":6,"readQueueNums":4,'
                   b'"topicFilterType":"SINGLE_TAG","topicName":"TopicA","topicSysFlag":0,"writeQueueNums":4}}}}')


def test_plain_body_round_trips_every_field():
    b = body(T1, RegisteredTopic("Ordered", 2, 3, 4, "MULTI_TAG", 1, True), counter=9)
    assert decode_register_body(encode_register_body(b)) == b


def _java_compressed(version_json: bytes, topic_lines: list[bytes], filters: bytes) -> bytes:
    """The compressed form built from RegisterBrokerBody.encode(true)'s description, independently."""
    out = struct.pack(">i", len(version_json)) + version_json + struct.pack(">i", len(topic_lines))
    for line in topic_lines:
        out += struct.pack(">i", len(line)) + line
    out += struct.pack(">i", len(filters)) + filters
    return zlib.compress(out, 9)


def test_compressed_body_decodes_the_java_layout():
    data = _java_compressed(b'{"counter":5,"timestamp":42}', [b"TopicA 4 4 6 SINGLE_TAG", b"TBW102 8 8 7 SINGLE_TAG"],
                            b"[]")
    got = decode_register_body(data, compressed=True)
    assert got == body(T1, SYS, counter=5, ts=42)


def test_compressed_body_round_trips_and_drops_what_java_drops():
    b = body(T1, RegisteredTopic("Ordered", 2, 3, 4, "SINGLE_TAG", 1, True), counter=2)
    got = decode_register_body(encode_register_body(b, compressed=True), compressed=True)
    assert got.data_version == b.data_version
    assert got.topics["TopicA"] == T1
    assert got.topics["Ordered"] == RegisteredTopic("Ordered", 2, 3, 4)      # sys flag and order are not sent


@pytest.mark.parametrize("data, compressed", [
    (b"{not json", False),
    (b'{"topicConfigSerializeWrapper":{"topicConfigTable":{"T":{"readQueueNums":"x"}}}}', False),
    (b"\x78\x9c garbage", True),
    (zlib.compress(struct.pack(">i", 100) + b"{}"), True),
    (_java_compressed(b'{"counter":1,"timestamp":1}', [b"only three fields"], b"[]"), True),
    (zlib.compress(struct.pack(">i", 2) + b"{}" + struct.pack(">i", -1)), True),
])
def test_malformed_bodies_raise_header_errors(data, compressed):
    with pytest.raises(HeaderError):
        decode_register_body(data, compressed=compressed)


def test_a_compressed_body_inflating_past_the_limit_is_refused_without_inflating_it():
    """One unauthenticated REGISTER_BROKER of 1 MB deflated zeros inflated to 1 GB in one zlib.decompress: the
    name server peaked at 2 GB and answered nothing else for 13 s; the largest frame (16 MiB) asked for 16 GB."""
    import tracemalloc

    bomb = zlib.compress(b"\0" * (256 << 20), 9)      # 255 KB
    tracemalloc.start()
    try:
        with pytest.raises(HeaderError, match="inflates past"):
            decode_register_body(bomb, compressed=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 << 20         # the inflated limit, about twice over (zlib joins its blocks)
    from protocol.registration import MAX_INFLATED_REGISTER_BODY
    # the limit itself is taken: a body exactly that large inflates (and then fails on its content)
    with pytest.raises(HeaderError, match="does not parse|runs past|topics"):
        decode_register_body(zlib.compress(b"\0" * MAX_INFLATED_REGISTER_BODY), compressed=True)
    with pytest.raises(HeaderError, match="cut short"):
        decode_register_body(zlib.compress(b"x" * 1000)[:-8], compressed=True)


def test_crc_is_java_masked_crc32():
    assert body_crc32(b"hello") == zlib.crc32(b"hello") & 0x7FFFFFFF
    assert body_crc32(b"") == 0 and body_crc32(None) == 0
    h = register_header(broker_name="b", broker_addr="1.2.3.4:5", cluster_name="c", ha_server_addr="1.2.3.4:6",
                        broker_id=0, compressed=False, body=b"hello")
    assert h["bodyCrc32"] == str(zlib.crc32(b"hello") & 0x7FFFFFFF) and h["compressed"] == "false"


# ------------------------------------------------------------ route table
def reg(table, name, addr, *topics, bid=0, counter=1, conn=None, now=0, cluster="C"):
    return table.register(cluster=cluster, broker_addr=addr, broker_name=name, broker_id=bid,
                          ha_server_addr=addr + "1", body=body(*topics, counter=counter), conn=conn, now_ms=now)


def test_route_merges_the_queues_of_every_broker_holding_the_topic():
    t = RouteTable()
    reg(t, "b", "h:2", RegisteredTopic("TopicA", 8, 8, 6))
    reg(t, "a", "h:1", T1, SYS)
    route = t.route("TopicA")
    assert [(q.broker_name, q.write_queue_nums) for q in route.queue_datas] == [("a", 4), ("b", 8)]
    assert [(b.broker_name, b.broker_addrs) for b in route.broker_datas] == [("a", {0: "h:1"}), ("b", {0: "h:2"})]
    assert [b.broker_name for b in t.route("TBW102").broker_datas] == ["a"]
    assert t.route("Nope") is None
    assert t.clusters == {"C": {"a", "b"}}


def test_a_new_data_version_replaces_the_brokers_topics_and_the_same_one_does_not():
    t = RouteTable()
    reg(t, "a", "h:1", T1, SYS, counter=1)
    reg(t, "a", "h:1", SYS, counter=1)              # same version: the table is not re-read (RocketMQ)
    assert t.route("TopicA") is not None
    reg(t, "a", "h:1", SYS, counter=2)              # TopicA deleted on the broker
    assert t.route("TopicA") is None and t.route("TBW102") is not None


def test_silent_brokers_expire_on_the_clock_and_take_their_queues():
    t = RouteTable(expire_ms=3000)
    reg(t, "a", "h:1", T1, now=0)
    reg(t, "b", "h:2", T1, now=0)
    reg(t, "b", "h:2", T1, now=2500)                # b keeps registering
    assert t.expire(3000) == []
    assert t.expire(3001) == ["h:1"]
    assert [q.broker_name for q in t.route("TopicA").queue_datas] == ["b"]
    assert "a" not in t.brokers and t.clusters == {"C": {"b"}}


def test_a_closed_connection_removes_its_broker_at_once():
    t = RouteTable()
    conn_a, conn_b = object(), object()
    reg(t, "a", "h:1", T1, conn=conn_a)
    reg(t, "b", "h:2", T1, conn=conn_b)
    assert t.connection_closed(conn_a) == ["h:1"]
    assert [b.broker_name for b in t.route("TopicA").broker_datas] == ["b"]
    assert t.connection_closed(object()) == []


def test_unregister_and_a_restart_at_a_new_address():
    t = RouteTable()
    reg(t, "a", "h:1", T1)
    reg(t, "a", "h:9", T1)                          # restarted on another port, same name
    assert t.route("TopicA").broker_datas[0].broker_addrs == {0: "h:9"} and "h:1" not in t.live
    assert t.unregister(cluster="C", broker_addr="h:9", broker_name="a", broker_id=0)
    assert t.route("TopicA") is None and t.brokers == {} and t.clusters == {}


def test_two_live_brokers_taking_one_name_and_id_from_each_other_are_said(caplog):
    """Two masters left at one broker name (or two slaves given one id) took the id from each other at every
    registration, the routes flipping between them, and nothing said it."""
    t = RouteTable()
    caplog.set_level("WARNING", logger="txmq.namesrv")
    reg(t, "a", "h:1", T1, conn="c1")
    reg(t, "a", "h:2", T1, conn="c2", now=1)            # a restart elsewhere looks the same so far: not said
    assert t.id_clashes == 0 and not caplog.records
    reg(t, "a", "h:1", T1, conn="c1", now=2)            # taken back: two brokers
    assert t.id_clashes == 1
    [rec] = caplog.records
    assert "h:2 and h:1 both register as C a id 0" in rec.getMessage() and "--broker-name" in rec.getMessage()
    for now in range(3, 10):                            # flipping on: counted, said again only after 10 minutes
        reg(t, "a", "h:2" if now % 2 else "h:1", T1, conn="c2" if now % 2 else "c1", now=now)
    assert t.id_clashes == 8 and len(caplog.records) == 1
    for i, now in enumerate(range(30_000, 630_001, 30_000)):   # each registering every 30 s
        reg(t, "a", "h:1" if i % 2 == 0 else "h:2", T1, conn="c1" if i % 2 == 0 else "c2", now=now)
    assert len(caplog.records) == 2 and "29 such registrations" in caplog.records[1].getMessage()
    reg(t, "a", "h:3", T1, bid=1, conn="c3")            # slaves too
    reg(t, "a", "h:4", T1, bid=1, conn="c4")
    reg(t, "a", "h:3", T1, bid=1, conn="c3")
    assert "a slave" in caplog.records[-1].getMessage() and t.id_clashes == 30
    t.expire(10 ** 9)
    assert t.taken == {}


def test_ids_taken_and_dropped_leave_nothing_behind():
    """A client keeping a name registered (id 0) while its two addresses took id after id from each other, each
    once, then moved on: every such id was kept in ``taken`` while the name lived, growing without bound."""
    t = RouteTable()
    reg(t, "a", "h:0", T1, conn="c0")
    for bid in range(1, 1001):
        reg(t, "a", "h:1", T1, bid=bid, conn="c1", now=bid)
        reg(t, "a", "h:2", T1, bid=bid, conn="c2", now=bid)     # takes it from h:1, live
    assert len(t.taken) <= 1 and t.brokers["a"].broker_addrs == {0: "h:0", 1000: "h:2"}
    assert t.unregister(cluster="C", broker_addr="h:2", broker_name="a", broker_id=1000)
    assert t.taken == {}


def test_a_restart_at_a_new_address_before_the_old_connection_closed_is_not_said(caplog):
    t = RouteTable()
    caplog.set_level("WARNING", logger="txmq.namesrv")
    reg(t, "a", "h:1", T1, conn="old")
    reg(t, "a", "h:9", T1, conn="new")
    reg(t, "a", "h:9", T1, conn="new", now=30_000)
    assert t.id_clashes == 0 and not caplog.records
    assert t.route("TopicA").broker_datas[0].broker_addrs == {0: "h:9"}


def test_three_live_brokers_taking_one_name_in_turn_are_said(caplog):
    """Three masters all left at the default broker name, registering in turn: each took the name from the one that
    had just taken it from another, never back from its own taker -- and nothing was said however long it went on."""
    t = RouteTable()
    caplog.set_level("WARNING", logger="txmq.namesrv")
    for now in range(0, 30):
        reg(t, "a", f"h:{now % 3 + 1}", T1, conn=f"c{now % 3 + 1}", now=now * 10_000)
    assert t.id_clashes == 27                            # each take from the 4th on
    [rec] = caplog.records
    assert "both register as C a id 0" in rec.getMessage()


def test_a_broker_moved_back_to_the_address_it_left_long_ago_is_not_said(caplog):
    """A master moved from h:1 to h:2 (blue/green: h:1's connection still open as h:2 registered) and, an hour later,
    back to h:1 (h:2 still registered as h:1 registers): two restarts, no two live brokers at once -- said as a
    clash, a false alarm at every such switch-back."""
    t = RouteTable()
    caplog.set_level("WARNING", logger="txmq.namesrv")
    reg(t, "a", "h:1", T1, conn="c1")
    reg(t, "a", "h:2", T1, conn="c2", now=1_000)
    assert t.connection_closed("c1") == []              # h:1 stopped (no longer routed: nothing to remove)
    for now in range(31_000, 3_600_000, 30_000):
        reg(t, "a", "h:2", T1, conn="c2", now=now)
    reg(t, "a", "h:1", T1, conn="c1b", now=3_600_000)
    assert t.id_clashes == 0 and not caplog.records
    assert t.route("TopicA").broker_datas[0].broker_addrs == {0: "h:1"}


def _perms(table, topic):
    return {q.broker_name: q.perm for q in table.route(topic).queue_datas}


def test_a_wiped_write_perm_holds_through_new_registrations_until_given_back_or_the_broker_goes():
    t = RouteTable(expire_ms=3000)
    reg(t, "a", "h:1", T1, RegisteredTopic("ReadOnly", 4, 4, 4), counter=1)
    reg(t, "b", "h:2", T1)
    assert t.wipe_write_perm("a") == 2
    assert _perms(t, "TopicA") == {"a": 4, "b": 6}
    reg(t, "a", "h:1", T1, RegisteredTopic("ReadOnly", 4, 4, 4), RegisteredTopic("New", 1, 1, 6), counter=2)
    assert _perms(t, "TopicA") == {"a": 4, "b": 6} and _perms(t, "New") == {"a": 4}     # a new data version: still wiped
    assert t.add_write_perm("a") == 3
    assert _perms(t, "TopicA") == {"a": 6, "b": 6} and _perms(t, "ReadOnly") == {"a": 4}   # read-only stays so
    assert t.wipe_write_perm("nobody") == 0 and t.write_wiped == set()             # an unknown name is not kept
    t.wipe_write_perm("a")
    reg(t, "b", "h:2", T1, now=2500)
    t.expire(3001)                                   # a's name leaves the table: the next a starts writable
    assert t.write_wiped == set()
    reg(t, "a", "h:3", T1, now=3002)
    assert _perms(t, "TopicA") == {"a": 6, "b": 6}


def test_a_restarted_master_registers_afresh_though_its_slave_kept_the_name():
    """The docs (and RocketMQ: a first registration rewrites the broker's queue data) say a restart registers a
    wiped broker afresh. With its slave still registered the name never left the table, so a master restarted
    after maintenance stayed out of every write route until someone remembered addWritePerm."""
    t = RouteTable(expire_ms=3000)
    reg(t, "a", "h:1", T1)
    reg(t, "a", "h:2", T1, bid=1)
    t.wipe_write_perm("a")
    reg(t, "a", "h:1", T1, now=1000)                 # the live master registering again: still wiped
    assert _perms(t, "TopicA") == {"a": 4}
    reg(t, "a", "h:2", T1, bid=1, now=2500)
    t.expire(4001)                                   # the master stops; its slave keeps the name
    assert "a" in t.brokers and _perms(t, "TopicA") == {"a": 4}
    reg(t, "a", "h:1", T1, now=4002)                 # restarted: writable again
    assert _perms(t, "TopicA") == {"a": 6}


def test_topics_by_cluster_and_the_system_list():
    t = RouteTable()
    reg(t, "a", "h:1", T1, SYS, cluster="C")
    reg(t, "x", "h:5", RegisteredTopic("Other", 1, 1, 6), cluster="D")
    assert t.topics_of_cluster("C") == ["TBW102", "TopicA"] and t.topics_of_cluster("D") == ["Other"]
    assert t.topics_of_cluster("nope") == []
    assert t.system_topic_list() == (["C", "D", "a", "x"], "h:1")
    assert RouteTable().system_topic_list() == ([], None)


def test_slaves_join_the_broker_data_and_learn_their_master():
    t = RouteTable()
    result = reg(t, "a", "h:2", T1, bid=1)          # slave first: no master yet
    assert result.master_addr is None
    assert t.route("TopicA") is None                # a slave's topics do not make routes
    reg(t, "a", "h:1", T1)
    result = reg(t, "a", "h:2", T1, bid=1)
    assert (result.master_addr, result.ha_server_addr) == ("h:1", "h:11")
    assert t.route("TopicA").broker_datas[0].broker_addrs == {0: "h:1", 1: "h:2"}
    t.connection_closed(None)                       # no-op
    t.expire(10 ** 9)
    assert t.brokers == {}


# ---------------------------------------------------------------- handlers
class _Clock:
    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now


def _register_cmd(name, addr, *topics, crc=None, compressed=False, counter=1):
    data = encode_register_body(body(*topics, counter=counter), compressed=compressed)
    fields = register_header(broker_name=name, broker_addr=addr, cluster_name="C", ha_server_addr="",
                             broker_id=0, compressed=compressed, body=data)
    if crc is not None:
        fields["bodyCrc32"] = str(crc)
    return RemotingCommand.request(R.REGISTER_BROKER, fields, data)


def _call(ctx, cmd, conn=None):
    return namesrv_table()[cmd.code](ctx, conn, cmd)


def test_handlers_register_route_and_refuse_a_bad_crc():
    ctx = NamesrvContext(RouteTable(), _Clock())
    assert _call(ctx, _register_cmd("a", "h:1", T1)).code == ResponseCode.SUCCESS
    assert _call(ctx, _register_cmd("b", "h:2", T1, compressed=True)).code == ResponseCode.SUCCESS
    bad = _call(ctx, _register_cmd("c", "h:3", T1, crc=12345))
    assert (bad.code, bad.remark) == (ResponseCode.SYSTEM_ERROR, "crc32 not match") and "c" not in ctx.table.brokers

    old = RemotingCommand.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "TopicA"}, version=317)
    resp = _call(ctx, old)
    assert b'"brokerAddrs":{0:"h:1"}' in resp.body and b'"brokerAddrs":{0:"h:2"}' in resp.body
    assert [q.broker_name for q in decode_route(resp.body).queue_datas] == ["a", "b"]
    missing = _call(ctx, RemotingCommand.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "Nope"}))
    assert missing.code == ResponseCode.TOPIC_NOT_EXIST

    info = json.loads(_call(ctx, RemotingCommand.request(R.GET_BROKER_CLUSTER_INFO)).body)
    assert info["clusterAddrTable"] == {"C": ["a", "b"]}
    assert info["brokerAddrTable"]["b"]["brokerAddrs"] == {"0": "h:2"}
    topics = json.loads(_call(ctx, RemotingCommand.request(R.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)).body)
    assert topics == {"topicList": ["TopicA"]}

    unreg = RemotingCommand.request(R.UNREGISTER_BROKER, {"brokerName": "a", "brokerAddr": "h:1",
                                                          "clusterName": "C", "brokerId": "0"})
    assert _call(ctx, unreg).code == ResponseCode.SUCCESS
    assert [b.broker_name for b in ctx.table.route("TopicA").broker_datas] == ["b"]


def test_query_data_version_says_whether_the_table_changed_and_counts_as_heard_from():
    clock = _Clock()
    ctx = NamesrvContext(RouteTable(expire_ms=1000), clock)
    _call(ctx, _register_cmd("a", "h:1", T1, counter=4))
    q = lambda counter: RemotingCommand.request(  # noqa: E731
        R.QUERY_DATA_VERSION, {"brokerAddr": "h:1", "brokerName": "a", "clusterName": "C", "brokerId": "0"},
        f'{{"counter":{counter},"timestamp":1700000000000}}'.encode())
    clock.now = 900
    assert _call(ctx, q(4)).ext_fields["changed"] == "false"
    clock.now = 1500
    assert ctx.table.expire(clock.now) == []        # the query at 900 refreshed it
    assert _call(ctx, q(5)).ext_fields["changed"] == "true"


def test_a_malformed_register_body_is_a_header_error():
    ctx = NamesrvContext(RouteTable(), _Clock())
    cmd = RemotingCommand.request(R.REGISTER_BROKER, {"brokerName": "a", "brokerAddr": "h:1", "clusterName": "C",
                                                      "haServerAddr": "", "brokerId": "0"}, b"{oops")
    with pytest.raises(HeaderError):
        _call(ctx, cmd)
    assert ctx.table.brokers == {}


def test_a_wall_clock_step_does_not_expire_the_brokers(monkeypatch):
    """Expiry was timed with the wall clock: stepped forward by more than broker_expire_ms (NTP after a drift,
    a VM resumed), it dropped every live broker at the next scan and every route went empty."""
    import time

    from broker.namesrv.config import NamesrvConfig
    from broker.namesrv.server import NameServer
    server = NameServer(NamesrvConfig(port=0, broker_expire_ms=120_000))
    reg(server.ctx.table, "b", "h:1", T1, now=server.ctx.clock())
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    monkeypatch.setattr(time, "time_ns", lambda: int((real() + 3600) * 1e9))
    assert server.scan() == []
    assert server.ctx.table.route("TopicA") is not None
