"""The guards without sockets: ACL parsing, addresses, signature and permissions; limits; supervision."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from broker.acl import AclTable, PlainAcl, address_matcher, parse_perm
from broker.config import BrokerConfig
from broker.limits import BUSY_REMARK, Limits
from broker.metrics import BrokerMetrics
from broker.supervise import LoopLag, Supervisor
from broker.transaction.check import Policy
from broker.transaction.core import TransactionCore
from broker.transaction.core import Tx as CoreTx
from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import ConfigError
from protocol.signature import Credentials, signature, signed_content
from tests.support.bounded import bounded

APP = Credentials("appuser", "app-secret")
TABLE = {
    "globalWhiteRemoteAddresses": ["10.10.103.*"],
    "accounts": [
        {"accessKey": "appuser", "secretKey": "app-secret", "defaultTopicPerm": "DENY", "defaultGroupPerm": "SUB",
         "topicPerms": ["Orders=PUB|SUB", "Audit=SUB"], "groupPerms": ["Banned=DENY"]},
        {"accessKey": "rootuser", "secretKey": "root-secret", "admin": True, "whiteRemoteAddress": "192.168.1.1-20"},
    ],
}


def _signed(code, fields, creds=APP, body=b""):
    cmd = RemotingCommand.request(code, fields, body)
    creds.sign(cmd)
    return cmd


def test_signature_is_hmac_sha1_over_sorted_values_then_body():
    # The exact content AclClientRPCHook signs: values sorted by key, Signature left out, then the body.
    fields = {"b": "T", "AccessKey": "ak", "a": "G"}
    assert signed_content(fields, b"BODY") == b"akGTBODY"
    # Computed independently with node: crypto.createHmac("sha1", "secret").update("akGTBODY").digest("base64")
    assert signature(b"akGTBODY", "secret") == "yGHIMOl4s4+Q5yUucs+7red/vXg="


@pytest.mark.parametrize("spec,host,ok", [
    ("*", "1.2.3.4", True), ("", "127.0.0.1", False), ("192.168.*.*", "192.168.9.9", True),
    ("192.168.*.*", "192.169.9.9", False), ("192.168.1.1-20", "192.168.1.20", True),
    ("192.168.1.1-20", "192.168.1.21", False), ("10.0.0.{1,5}", "10.0.0.5", True), ("10.0.0.{1,5}", "10.0.0.2", False),
    ("1.1.1.1,2.2.2.2", "2.2.2.2", True),
])
def test_remote_address_patterns(spec, host, ok):
    assert address_matcher(spec)(host) is ok


def test_bad_files_are_config_errors():
    with pytest.raises(ConfigError):
        AclTable.parse({"accounts": [{"accessKey": "short", "secretKey": "x"}]})
    with pytest.raises(ConfigError):
        AclTable.parse({"accounts": [{"accessKey": "appuser", "secretKey": "app-secret", "topicPerms": ["nope"]}]})
    with pytest.raises(ConfigError):
        address_matcher("300.not.an.address")
    assert parse_perm("PUB|SUB") == 12 and parse_perm("whatever") == 1


def test_check_follows_rocketmq_order_and_remarks():
    t = AclTable.parse(TABLE)
    send = lambda topic, creds=APP: _signed(R.SEND_MESSAGE_V2, {"a": "PG", "b": topic}, creds, b"x")  # noqa: E731
    assert t.check(send("Orders"), "127.0.0.1") is None
    assert t.check(send("Other"), "127.0.0.1") == "No default permission for topic:Other"
    assert t.check(send("Audit"), "127.0.0.1") == "No default permission for topic:Audit"
    assert t.check(RemotingCommand.request(R.SEND_MESSAGE_V2, {"b": "Orders"}), "10.10.103.7") is None  # global white
    assert t.check(RemotingCommand.request(R.SEND_MESSAGE_V2, {"b": "Orders"}), "127.0.0.1") == \
        "No accessKey is configured"
    assert t.check(send("Orders", Credentials("stranger", "secret")), "127.0.0.1") == "No acl config for stranger"
    tampered = send("Orders")
    tampered.ext_fields["b"] = "Other"
    assert t.check(tampered, "127.0.0.1") == "Check signature failed for accessKey=appuser"
    pull = _signed(R.PULL_MESSAGE, {"topic": "Orders", "consumerGroup": "Banned"})
    assert t.check(pull, "127.0.0.1") == "No default permission for group:Banned"
    create = _signed(R.UPDATE_AND_CREATE_TOPIC, {"topic": "X"})
    assert t.check(create, "127.0.0.1") == "Need admin permission for request code=17, but accessKey=appuser is not"
    root = Credentials("rootuser", "root-secret")
    assert t.check(_signed(R.TXMQ_APPLY_EXPIRY, {}, root, b"{}"), "127.0.0.1") is None
    assert t.check(RemotingCommand.request(R.TXMQ_APPLY_EXPIRY, {"AccessKey": "rootuser"}), "192.168.1.3") is None


def test_heartbeat_resources_come_from_the_body():
    t = AclTable.parse(TABLE)
    body = b'{"clientID":"c","consumerDataSet":[{"groupName":"G1","subscriptionDataSet":[{"topic":"Other"}]}]}'
    assert t.check(_signed(R.HEART_BEAT, {}, body=body), "127.0.0.1") == "No default permission for topic:Other"


def test_a_send_is_checked_against_the_topic_the_broker_reads_from_its_header():
    """SEND_MESSAGE_V2 and SEND_BATCH_MESSAGE carry the V2 header ("b" the topic), but the broker also takes
    the V1 field names under those codes (SendMessageRequestHeader.from_command). The ACL must check the
    topic the broker will write to, whichever header carried it: a V1 header under code 310 or 320 named
    no topic for the ACL, and a DENY account could write to any topic."""
    from protocol.message import SendMessageRequestHeader

    t = AclTable.parse(TABLE)
    v1 = {"producerGroup": "PG", "topic": "Other", "defaultTopic": "TBW102", "defaultTopicQueueNums": 4,
          "queueId": 0, "sysFlag": 0, "bornTimestamp": 1, "flag": 0, "properties": "", "reconsumeTimes": 0}
    for code in (R.SEND_MESSAGE, R.SEND_MESSAGE_V2, R.SEND_BATCH_MESSAGE):
        cmd = _signed(code, dict(v1), body=b"x")
        assert SendMessageRequestHeader.from_command(cmd).topic == "Other"
        assert t.check(cmd, "127.0.0.1") == "No default permission for topic:Other", code
        allowed_cmd = _signed(code, dict(v1, topic="Orders"), body=b"x")
        assert t.check(allowed_cmd, "127.0.0.1") is None, code

def test_reload_keeps_the_old_table_when_the_new_file_is_bad(tmp_path):
    path = tmp_path / "plain_acl.yml"
    path.write_text("accounts:\n  - accessKey: appuser\n    secretKey: app-secret\n")
    acl = PlainAcl(str(path))
    assert not acl.reload_if_changed()
    path.write_text("accounts: [ {accessKey: x")
    os.utime(path, ns=(1, 1))
    assert not acl.reload_if_changed() and "appuser" in acl.table.accounts
    path.write_text("accounts:\n  - accessKey: other1\n    secretKey: other-secret\n")
    os.utime(path, ns=(2, 2))
    assert acl.reload_if_changed() and set(acl.table.accounts) == {"other1"}


def test_an_empty_acl_file_is_refused_not_taken_for_no_accounts(tmp_path):
    """RocketMQ refuses a plain_acl.yml with no data ("file is not data"). Taken as a table with no accounts,
    an empty file -- the moment a `cat new.yml > plain_acl.yml` has truncated it, a copy gone wrong, a file of
    comments -- refused every request ("No acl config for ...") until the next good reload."""
    path = tmp_path / "plain_acl.yml"
    path.write_text("accounts:\n  - accessKey: appuser\n    secretKey: app-secret\n")
    acl = PlainAcl(str(path))
    for n, text in enumerate(("", "# nothing yet\n", "\n")):
        path.write_text(text)
        os.utime(path, ns=(10 + n, 10 + n))
        assert not acl.reload_if_changed() and "appuser" in acl.table.accounts, repr(text)
    with pytest.raises(ConfigError, match="no data"):
        PlainAcl(str(path))

class _Conn:
    def __init__(self, host="127.0.0.1"):
        self.peer = (host, 1)
        self.attributes = {}


class _Topics:
    def __init__(self, n, created_by=None):
        self.topics = dict.fromkeys(range(n))
        self._created_by = created_by or {}

    def created_by(self, client):
        return self._created_by.get(client, 0)

    def room_for(self, client, limit):
        return self.created_by(client) < limit

    queue_total = 0     # queues: nothing counted (test_queue_caps.py holds those limits to the real broker)

    def queues_counted(self, topic):
        return 0, None

    def queues_of(self, client):
        return 0


def test_topic_limits_name_the_limit():
    now = [0.0]
    lim = Limits(BrokerConfig(max_topics=5, max_auto_create_topics_per_s=2), BrokerMetrics(), monotonic=lambda: now[0])
    cmd = RemotingCommand.request(R.SEND_MESSAGE_V2, {})
    full = lim.may_auto_create(_Conn(), cmd, _Topics(5), "T")
    assert full.code == ResponseCode.NO_PERMISSION and "max_topics=5" in full.remark
    a, b = _Conn(), _Conn()                     # two connections, one client address: one budget
    assert lim.may_auto_create(a, cmd, _Topics(1), "T1") is None
    assert lim.may_auto_create(b, cmd, _Topics(1), "T2") is None
    busy = lim.may_auto_create(a, cmd, _Topics(1), "T3")
    assert busy.code == ResponseCode.SYSTEM_BUSY and "max_auto_create_topics_per_s=2" in busy.remark
    assert lim.may_auto_create(_Conn("10.0.0.9"), cmd, _Topics(1), "T4") is None
    now[0] += 0.5
    assert lim.may_auto_create(a, cmd, _Topics(1), "T3") is None


def test_a_clients_topics_are_capped_by_its_address_and_ipv6_by_its_64():
    lim = Limits(BrokerConfig(max_topics=100, max_topics_per_host=3), BrokerMetrics())
    cmd = RemotingCommand.request(R.SEND_MESSAGE_V2, {})
    topics = _Topics(10, {"10.0.0.1": 3, "2001:db8::/64": 3})
    held = lim.may_auto_create(_Conn("10.0.0.1"), cmd, topics, "T")
    assert held.code == ResponseCode.NO_PERMISSION and "max_topics_per_host=3" in held.remark
    assert lim.may_auto_create(_Conn("2001:db8::77"), cmd, topics, "T").code == ResponseCode.NO_PERMISSION
    assert lim.may_auto_create(_Conn("10.0.0.2"), cmd, topics, "T") is None
    assert lim.may_create(_Conn("10.0.0.1"), cmd, topics, "T", per_host=False) is None      # an operator's (ACL)


def test_the_catalogue_counts_the_topics_each_client_created_until_they_go(tmp_path):
    from broker.topics import TopicConfig, TopicManager
    topics = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=1, cluster="C", broker="B")
    topics.for_send("A1", None, 1, "10.0.0.1")
    topics.ensure("%DLQ%G", creator="10.0.0.1")
    topics.create(TopicConfig("A1", 2, 2), "10.0.0.2")          # a change of a topic there is: still 10.0.0.1's
    topics.create(TopicConfig("Ops", 1, 1))                     # no client's (an operator's, under an ACL)
    assert (topics.created_by("10.0.0.1"), topics.created_by("10.0.0.2")) == (2, 0)
    topics.delete("A1")
    topics.delete("Ops")
    assert topics.created_by("10.0.0.1") == 1


async def test_writer_busy_until_queued_bytes_drain():
    lim = Limits(BrokerConfig(max_writer_queued_bytes=100), BrokerMetrics())
    cmd = RemotingCommand.request(R.SEND_MESSAGE_V2, {})
    assert lim.busy(cmd, 500) is None           # an empty queue always takes one (a big message is not starved)
    fut = asyncio.get_running_loop().create_future()
    lim.track(fut, 500)
    busy = lim.busy(cmd, 1)
    assert busy.code == ResponseCode.SYSTEM_BUSY and busy.remark.startswith(BUSY_REMARK)
    fut.set_result(None)
    await asyncio.sleep(0)
    assert lim.queued_bytes == 0 and lim.busy(cmd, 1) is None


def test_undecided_per_group():
    class Tx:
        core = TransactionCore(Policy(1000, 1000, 3, 72 * 3600_000), {}.get)
        storing_groups: dict = {}
    lim = Limits(BrokerConfig(max_undecided_per_group=2), BrokerMetrics())
    cmd = RemotingCommand.request(R.SEND_MESSAGE_V2, {})
    assert lim.may_prepare(cmd, Tx, "G") is None and lim.may_prepare(cmd, Tx, "G") is None
    refused = lim.may_prepare(cmd, Tx, "G")
    assert refused.code == ResponseCode.SYSTEM_BUSY and "max_undecided_per_group=2" in refused.remark
    assert lim.may_prepare(cmd, Tx, "H") is None


def test_undecided_per_group_counts_the_index_without_walking_it():
    """The counts are the index's own, kept as it changes: the limit walked the whole undecided index once a
    second while halves arrived (90 ms on the event loop at 500k undecided)."""
    class WalkRefused(dict):
        def values(self):
            raise AssertionError("the undecided index was walked")
        items = keys = __iter__ = values

    core = TransactionCore(Policy(1000, 1000, 3, 72 * 3600_000), {}.get)
    core.pending = WalkRefused()

    class Tx:
        storing_groups: dict = {}
    Tx.core, Tx.pending = core, core.pending
    for off in range(3):
        core.add(CoreTx(off, off, "G", "T", f"U{off}", 0))
    core.add(CoreTx(9, 9, "H", "T", "U9", 0))
    now = [0.0]
    lim = Limits(BrokerConfig(max_undecided_per_group=3), BrokerMetrics(), monotonic=lambda: now[0])
    cmd = RemotingCommand.request(R.SEND_MESSAGE_V2, {})
    assert lim.may_prepare(cmd, Tx, "G").code == ResponseCode.SYSTEM_BUSY       # 3 undecided: at the limit
    assert lim.may_prepare(cmd, Tx, "H") is None
    for off in (0, 1):                      # two decided: room again once the counts are next read
        core.withdraw(off)
    now[0] = 1.0
    assert lim.may_prepare(cmd, Tx, "G") is None and lim.may_prepare(cmd, Tx, "G") is None
    assert lim.may_prepare(cmd, Tx, "G").code == ResponseCode.SYSTEM_BUSY
    assert core.per_group == {"G": 1, "H": 1}


async def test_supervisor_restarts_then_gives_up():
    metrics = BrokerMetrics()
    fatal = []
    runs = []

    async def crashes():
        runs.append(1)
        raise ValueError("boom")

    sup = Supervisor(metrics, fatal.append, max_crashes=3, pause_s=0)
    async with asyncio.timeout(5):
        await sup.spawn("t", crashes)
    assert len(runs) == 3 and fatal and "t crashed 3 times" in fatal[0]
    assert metrics.task_crashes.labels("t")._value.get() == 3


def test_loop_lag_gauge_holds_the_worst_of_the_window():
    metrics = BrokerMetrics()
    lag = LoopLag(metrics.loop_lag, metrics.loop_lag_worst, interval=0.25, window_s=1.0)
    for value in (0.001, 0.3, 0.002, 0.001, 0.001, 0.001):
        lag.record(value)
    assert metrics.registry.get_sample_value("txmq_event_loop_lag_seconds") == 0.002 and lag.worst == 0.3


def test_exposure_warning_only_beyond_loopback_without_acl():
    from broker.server import exposure_warning
    assert exposure_warning(BrokerConfig(host="127.0.0.1")) is None
    assert exposure_warning(BrokerConfig(host="0.0.0.0", acl_file="plain_acl.yml")) is None
    assert "WITHOUT an ACL file" in exposure_warning(BrokerConfig(host="0.0.0.0"))



def test_an_acl_does_not_hide_an_open_ha_port():
    """The HA port answers no ACL (nor does RocketMQ's): whoever connects and reports 0 is sent the whole
    commit log -- every topic's messages -- and a SYNC_MASTER counts its reports as a slave's. With an ACL
    file the broker said nothing of it, as if the ACL covered the broker."""
    from broker.server import exposure_warning
    acl = dict(acl_file="plain_acl.yml")
    warning = exposure_warning(BrokerConfig(host="0.0.0.0", ha_port=0, **acl))
    assert warning is not None and "HA port" in warning and "ACL does not cover" in warning
    assert exposure_warning(BrokerConfig(host="0.0.0.0", broker_role="SYNC_MASTER", ha_port=10912, **acl))
    assert exposure_warning(BrokerConfig(host="127.0.0.1", ha_port=0, **acl)) is None
    assert exposure_warning(BrokerConfig(host="0.0.0.0", **acl)) is None              # no HA listener
    assert exposure_warning(BrokerConfig(host="0.0.0.0", broker_role="SLAVE", broker_id=1, ha_port=0,
                                         ha_master_addr="h:1", **acl)) is None         # a slave listens for none

async def test_topic_flood_writes_the_catalogue_in_batches_off_the_loop(tmp_path, monkeypatch):
    import threading

    from broker.topics import TopicConfig, TopicManager
    tm = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=8, cluster="C", broker="B")
    writes = []
    real = tm._write
    monkeypatch.setattr(tm, "_write", lambda topics: (writes.append((threading.current_thread().name, len(topics))),
                                                      real(topics)))
    tm.start_background(asyncio.get_running_loop())
    for i in range(500):
        tm.create(TopicConfig(f"T{i}", 8, 8))
    assert writes == []                             # nothing written on the loop, per topic
    async with asyncio.timeout(5):
        while not writes:
            await asyncio.sleep(0.02)
    await tm.close()
    assert len(writes) <= 3 and all(name.startswith("txmq-topics") for name, _ in writes)
    again = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=8, cluster="C", broker="B")
    assert all(f"T{i}" in again.topics for i in range(500))


async def test_a_failed_catalogue_write_is_retried_without_another_topic_change(tmp_path, monkeypatch, caplog):
    """A topics.json write that failed (a full disk) used to wait for the next topic change, which may never come:
    a topic created then was lost at the next restart if it had no messages yet."""
    import errno

    from broker.topics import TopicConfig, TopicManager
    tm = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=8, cluster="C", broker="B")
    tm.retry_write_s = 0.01
    real, calls, written = tm._write, [], asyncio.Event()

    def write(topics):
        calls.append(len(topics))
        if len(calls) <= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(topics)
        written.set()
    monkeypatch.setattr(tm, "_write", write)
    tm.start_background(asyncio.get_running_loop())
    tm.create(TopicConfig("Orders", 6, 6))
    async with asyncio.timeout(10):
        await written.wait()
    await tm.close()
    assert len(calls) == 4                          # three failures, then the retry that worked; close had nothing
    assert caplog.text.count("not written, retrying") == 1 and "written again" in caplog.text
    again = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=8, cluster="C", broker="B")
    assert again.get("Orders") == TopicConfig("Orders", 6, 6)


@bounded(10)
async def test_loop_lag_gauge_shows_a_stall_while_it_lasts():
    """The lag gauge was set only when the measuring task woke: while the loop was stuck it kept showing
    the lag from before the stall (about 0), so a scrape during a stall of any length said all was well
    and the alert on it could not fire until the stall had ended."""
    import threading
    metrics = BrokerMetrics()
    lag = LoopLag(metrics.loop_lag, metrics.loop_lag_worst, interval=0.02, window_s=1.0)
    task = asyncio.get_running_loop().create_task(lag.run())
    try:
        while not lag._recent:          # it measured once: it is running
            await asyncio.sleep(0.01)
        seen = []
        stalled = threading.Event()
        reader = threading.Thread(target=lambda: (stalled.wait(5), time.sleep(0.5), seen.append(
            metrics.registry.get_sample_value("txmq_event_loop_lag_seconds"))))
        reader.start()
        stalled.set()
        time.sleep(0.8)                 # a blocking call on the loop: nothing on it runs meanwhile
        reader.join(5)
        assert seen and seen[0] >= 0.4, seen
    finally:
        task.cancel()


def test_trace_topic_enable_makes_the_trace_topic_only_when_missing(tmp_path):
    """As RocketMQ's traceTopicEnable: RMQ_SYS_TRACE_TOPIC with one queue, written to the catalogue like any
    topic. One there already (auto-created from TBW102 with more queues) keeps its queues."""
    from broker.topics import TRACE_TOPIC, TopicConfig, TopicManager
    kw = dict(auto_create=False, default_queue_nums=8, cluster="C", broker="B")
    assert TRACE_TOPIC not in TopicManager(str(tmp_path / "off"), **kw).topics
    made = TopicManager(str(tmp_path / "on"), trace_topic=True, **kw).topics[TRACE_TOPIC]
    assert (made.read_queue_nums, made.write_queue_nums, made.perm) == (1, 1, 6)
    assert TRACE_TOPIC in TopicManager(str(tmp_path / "on"), **kw).topics        # kept when turned off
    older = TopicManager(str(tmp_path / "old"), **kw)
    older.create(TopicConfig(TRACE_TOPIC, 8, 8))
    assert TopicManager(str(tmp_path / "old"), trace_topic=True, **kw).topics[TRACE_TOPIC].write_queue_nums == 8


def test_a_client_at_its_topic_limit_gets_room_from_its_own_retry_topics_that_may_go(tmp_path):
    from broker.topics import TopicManager
    topics = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=1, cluster="C", broker="B")
    topics.retry_reclaimable = lambda name: name != "%RETRY%G_live"
    for name, client in (("%RETRY%G_gone", "10.0.0.1"), ("%RETRY%G_live", "10.0.0.1"),
                         ("%RETRY%G_other", "10.0.0.2"), ("Plain", "10.0.0.1")):
        topics.ensure(name, creator=client)
    assert topics.room_for("10.0.0.1", 4)                   # under it: nothing swept
    assert "%RETRY%G_gone" in topics.topics
    assert topics.room_for("10.0.0.1", 3)                   # at it: its own gone group's topic goes
    assert set(topics.topics) >= {"%RETRY%G_live", "%RETRY%G_other", "Plain"}
    assert "%RETRY%G_gone" not in topics.topics
    assert not topics.room_for("10.0.0.1", 2)               # nothing more of its may go (and swept once a second)


def test_every_key_says_a_key_once_an_interval_and_keeps_no_more_than_max_keys():
    """A line about a name a client gives (a group, a topic) is said at most once an interval per name; the
    table of names said is cleared when full, so a client naming new groups without end cannot grow it."""
    from broker.limits import EveryKey
    now = [100.0]
    said = EveryKey(60.0, max_keys=3, clock=lambda: now[0])
    assert [said.due(k) for k in ("a", "a", "b")] == [True, False, True]
    now[0] += 59.9
    assert not said.due("a")
    now[0] += 0.1
    assert said.due("a")
    assert said.due("c") and said.due("d")      # a fourth key: the table was full, cleared first
    assert len(said.said) <= 3


def test_every_key_with_a_total_says_at_most_that_many_keys_an_interval():
    """``total``: new keys (made-up groups a client names at no cost) were a line each; at most ``total`` are said
    an interval, ``full`` saying why the rest were not (a summary line), and a key held back is said once the
    interval is over, before the keys said in the last: those came first again in the next interval (a pass in the
    same order) and took its ``total`` each time, the others never said (``rotate``, for keys that recur)."""
    from broker.limits import EveryKey
    now = [100.0]
    plain = EveryKey(60.0, clock=lambda: now[0], total=2)
    assert [plain.due(k) for k in ("a", "b", "c", "d")] == [True, True, False, False] and plain.full()
    now[0] += 60.0      # keys said once (one transaction each) hold no room in the next interval
    assert not plain.full() and plain.due("c") and plain.due("e") and plain.full()
    now[0] = 100.0
    said = EveryKey(60.0, clock=lambda: now[0], total=2, rotate=True)
    assert [said.due(k) for k in ("a", "b", "c", "d")] == [True, True, False, False]
    assert said.full()
    now[0] += 60.0
    assert [said.due(k) for k in ("a", "b", "c", "d")] == [False, False, True, True]
    assert said.full()
    now[0] += 60.0
    assert [said.due(k) for k in ("a", "b", "c", "d")] == [True, True, False, False]
    now[0] += 60.0      # c and d held back do not come back: they hold their room for that interval alone
    assert [said.due(k) for k in ("e", "f")] == [False, False]
    assert said.full()  # (refused for that room, not for a key said lately: its caller sums them up)
    now[0] += 60.0
    assert not said.full() and [said.due(k) for k in ("a", "e", "f")] == [False, True, True] and said.full()
    now[0] += 60.0
    assert said.due("a") and not said.full()
    assert not EveryKey(60.0).full()


@bounded(30)
async def test_undecided_per_group_counts_the_halves_still_being_stored_when_it_reads_the_counts(tmp_path):
    """Halves accepted and still in the store's writer queue are not in the pending index yet: the counts read
    from it once a second replaced the ones kept since, and a group past its limit was let in again for as many
    halves as the writer had queued (the limit that bounds what one group can grow the index to)."""
    from types import SimpleNamespace

    from protocol.message import Prop
    from tests.unit.test_review_transactions import Clock, make_service

    ctx = await make_service(tmp_path, Clock(), max_undecided_per_group=2)
    tx = ctx.tx
    now = [0.0]
    lim = Limits(ctx.config, BrokerMetrics(), monotonic=lambda: now[0])
    queued = []
    put = ctx.store.put
    ctx.store.put = lambda req, then=None: queued.append((req, then))      # a slow writer: not stored yet

    class Conn:
        peer = ("127.0.0.1", 1)
        is_open = True
        attributes: dict = {}
        answers: list = []

        def hold(self):
            pass

        def release(self):
            pass

        def answer(self, cmd, reply):
            self.answers.append(reply.code)

    conn = Conn()
    h = SimpleNamespace(topic="T", flag=0, sys_flag=0, born_timestamp=0, reconsume_times=0, producer_group="PG")
    try:
        for i in range(2):
            cmd = RemotingCommand.request(R.SEND_MESSAGE_V2, {}, b"%d" % i)
            assert lim.may_prepare(cmd, tx, "PG") is None
            tx.prepare(conn, cmd, h, 0, {Prop.PGROUP: "PG", Prop.UNIQ_KEY: f"U{i}"}, b"\0" * 8)
        assert len(queued) == 2 and not tx.pending
        now[0] = 1.0                        # the counts are read again, both halves still queued
        refused = lim.may_prepare(RemotingCommand.request(R.SEND_MESSAGE_V2, {}), tx, "PG")
        assert refused is not None and refused.code == ResponseCode.SYSTEM_BUSY
        for req, then in queued:            # stored: counted by the index from now on, not twice
            then.set_result(await put(req))
        assert conn.answers == [ResponseCode.SUCCESS] * 2 and len(tx.pending) == 2
        now[0] = 2.0
        refused = lim.may_prepare(RemotingCommand.request(R.SEND_MESSAGE_V2, {}), tx, "PG")
        assert refused is not None and refused.code == ResponseCode.SYSTEM_BUSY
        assert lim.may_prepare(RemotingCommand.request(R.SEND_MESSAGE_V2, {}), tx, "PH") is None
        assert tx.storing_groups == {}
    finally:
        await ctx.store._store.close()
