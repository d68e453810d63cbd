"""The plain ACL against the real broker: our clients, the admin CLI, and ali-ons (a stock client that signs).

Accounts: an admin; a producer allowed to publish and subscribe AclTopic only (other topics
DENY, groups SUB). Each refusal must be NO_PERMISSION (16) with RocketMQ's remark.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from consumer import PullConsumer
from producer import Producer
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.errors import ResponseError
from protocol.signature import Credentials
from tests.support.bounded import bounded
from tests.support.broker_process import REPO

pytestmark = pytest.mark.asyncio

ADMIN = Credentials("txmqadmin", "admin-secret")
APP = Credentials("appuser", "app-secret")
JS = Path(__file__).parent / "js"

ACL = """\
globalWhiteRemoteAddresses: []
accounts:
  - accessKey: txmqadmin
    secretKey: admin-secret
    admin: true
  - accessKey: appuser
    secretKey: app-secret
    whiteRemoteAddress: ""
    admin: false
    defaultTopicPerm: DENY
    defaultGroupPerm: SUB
    topicPerms:
      - AclTopic=PUB|SUB
      - TBW102=PUB
{extra}
"""


@pytest.fixture
def acl_broker(broker_factory, tmp_path):
    path = tmp_path / "plain_acl.yml"
    path.write_text(ACL.format(extra=""))
    b = broker_factory("--acl-file", str(path))
    b.acl_path = path
    return b


async def _request(b, code, fields=None, creds=None, body=b""):
    host, _, port = b.broker.rpartition(":")
    conn = await open_connection(host, int(port), sign=creds.sign if creds else None)
    try:
        return await conn.request(RemotingCommand.request(code, fields, body), 5.0)
    finally:
        conn.close()


async def _create(b, topic, creds=ADMIN):
    return await _request(b, RequestCode.UPDATE_AND_CREATE_TOPIC,
                          {"topic": topic, "readQueueNums": 4, "writeQueueNums": 4, "perm": 6}, creds)


async def _send(b, creds, topic, body=b"x"):
    async with Producer(b.namesrv, "PG_acl", credentials=creds, retries=0) as producer:
        return await producer.send(topic, body)


async def test_admin_codes_need_an_admin_account(acl_broker):
    b = acl_broker
    missing = await _create(b, "AclTopic", creds=None)
    assert (missing.code, missing.remark) == (ResponseCode.NO_PERMISSION, "No accessKey is configured")
    app = await _create(b, "AclTopic", creds=APP)
    assert app.code == ResponseCode.NO_PERMISSION
    assert app.remark == "Need admin permission for request code=17, but accessKey=appuser is not"
    listed = await _request(b, RequestCode.TXMQ_LIST_TRANSACTIONS, {"limit": 10}, APP)
    assert listed.code == ResponseCode.NO_PERMISSION and "admin permission" in listed.remark
    # A stock admin's resumeCheckHalfMessage (323) makes a dead letter pending again, as txmq's resume (903)
    no_half = {"msgId": "7F00000100002A9F" + "0" * 16}
    resumed = await _request(b, RequestCode.RESUME_CHECK_HALF_MESSAGE, no_half, APP)
    assert (resumed.code, resumed.remark) == (ResponseCode.NO_PERMISSION, "Need admin permission for request "
                                              "code=323, but accessKey=appuser is not")
    resumed = await _request(b, RequestCode.RESUME_CHECK_HALF_MESSAGE, no_half, ADMIN)
    assert resumed.code == ResponseCode.SYSTEM_ERROR and "can not find message" in resumed.remark
    assert (await _create(b, "AclTopic")).code == ResponseCode.SUCCESS


async def test_producer_credentials_right_wrong_missing_unpermitted(acl_broker):
    b = acl_broker
    for topic in ("AclTopic", "OtherTopic"):
        assert (await _create(b, topic)).code == ResponseCode.SUCCESS
    ok = await _send(b, APP, "AclTopic", b"permitted")
    assert ok.status.name == "SEND_OK"
    cases = {
        "Check signature failed for accessKey=appuser": (Credentials("appuser", "wrong-secret"), "AclTopic"),
        "No acl config for nobody1": (Credentials("nobody1", "whatever"), "AclTopic"),
        "No accessKey is configured": (None, "AclTopic"),
        "No default permission for topic:OtherTopic": (APP, "OtherTopic"),
    }
    for remark, (creds, topic) in cases.items():
        with pytest.raises(ResponseError) as err:
            await _send(b, creds, topic)
        assert err.value.code == ResponseCode.NO_PERMISSION and err.value.remark == remark, (remark, err.value)
    # A consumer that reads with the account's credentials sees the permitted message.
    async with PullConsumer(b.namesrv, "CG_acl", credentials=APP) as consumer:
        bodies = []
        for q in await consumer.fetch_queues("AclTopic"):
            got = await consumer.pull(q, 0)
            bodies += [m.body for m in got.messages]
        assert bodies == [b"permitted"]
    metrics = await asyncio.to_thread(_scrape, b)
    assert 'txmq_requests_refused_total{reason="acl"}' in metrics



async def test_a_v1_header_under_send_v2_is_checked_like_any_send(acl_broker):
    """The broker reads a SEND_MESSAGE_V2 or SEND_BATCH_MESSAGE whose header has V1 names ("topic", not "b");
    the ACL must check that topic too. It did not: a DENY account stored messages in any topic."""
    b = acl_broker
    assert (await _create(b, "OtherTopic")).code == ResponseCode.SUCCESS
    v1 = {"producerGroup": "PG_acl", "topic": "OtherTopic", "defaultTopic": "TBW102", "defaultTopicQueueNums": 4,
          "queueId": 0, "sysFlag": 0, "bornTimestamp": 1, "flag": 0, "properties": "", "reconsumeTimes": 0}
    for code in (RequestCode.SEND_MESSAGE_V2, RequestCode.SEND_MESSAGE):
        resp = await _request(b, code, v1, APP, b"not for appuser")
        assert (resp.code, resp.remark) == (ResponseCode.NO_PERMISSION, "No default permission for topic:OtherTopic")
    stored = await _request(b, RequestCode.GET_MAX_OFFSET, {"topic": "OtherTopic", "queueId": 0}, ADMIN)
    assert stored.code == ResponseCode.SUCCESS and stored.ext_fields["offset"] == "0"

def _scrape(b) -> str:
    import urllib.request
    with urllib.request.urlopen(f"http://{b.metrics}/metrics", timeout=5) as resp:
        return resp.read().decode()


async def test_acl_file_is_reloaded_when_it_changes(acl_broker):
    b = acl_broker
    assert (await _create(b, "LaterTopic")).code == ResponseCode.SUCCESS
    with pytest.raises(ResponseError):
        await _send(b, APP, "LaterTopic")
    text = ACL.format(extra="").replace("      - TBW102=PUB", "      - TBW102=PUB\n      - LaterTopic=PUB")
    tmp = b.acl_path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, b.acl_path)
    async with asyncio.timeout(15):
        while True:
            try:
                await _send(b, APP, "LaterTopic")
                break
            except ResponseError as exc:
                assert exc.code == ResponseCode.NO_PERMISSION
                await asyncio.sleep(0.2)


async def test_admin_cli_takes_credentials(acl_broker):
    b = acl_broker

    def admin(*args, env=None):
        return subprocess.run([sys.executable, "-m", "broker", "admin", "--broker", b.broker, *args],
                              cwd=REPO, capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})})

    refused = await asyncio.to_thread(admin, "list")
    assert refused.returncode == 1 and "No accessKey is configured" in refused.stderr
    ok = await asyncio.to_thread(admin, "list", env={"BROKER_ADMIN_ACCESS_KEY": "txmqadmin",
                                                     "BROKER_ADMIN_SECRET_KEY": "admin-secret"})
    assert ok.returncode == 0 and "no undecided transactions" in ok.stdout, ok.stderr


def _ali_ons(b, topic: str, access: str | None, secret: str | None) -> dict:
    env = {**os.environ}
    env.pop("ONS_ACCESS_KEY", None)
    if access:
        env.update(ONS_ACCESS_KEY=access, ONS_SECRET_KEY=secret or "")
    proc = subprocess.run(["node", "ali_ons_roundtrip.js", "--namesrv", b.namesrv, "--topic", topic, "--count", "3",
                           "--timeout-ms", "30000"], cwd=JS, capture_output=True, text=True, timeout=60, env=env)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {"rc": proc.returncode, "final": lines[-1] if lines else {}, "stderr": proc.stderr}


@pytest.mark.skipif(shutil.which("node") is None or not (JS / "node_modules" / "ali-ons").is_dir(),
                    reason="node and ali-ons are needed (scripts/test.sh installs them)")
async def test_ali_ons_with_credentials(acl_broker):
    b = acl_broker
    for topic in ("AclTopic", "OtherTopic"):
        assert (await _create(b, topic)).code == ResponseCode.SUCCESS
    good = await asyncio.to_thread(_ali_ons, b, "AclTopic", "appuser", "app-secret")
    assert good["rc"] == 0 and good["final"]["ok"], good
    for topic, access, secret, remark in (("AclTopic", "appuser", "wrong-secret", "Check signature failed"),
                                          ("AclTopic", None, None, "No accessKey is configured"),
                                          ("OtherTopic", "appuser", "app-secret", "No default permission")):
        bad = await asyncio.to_thread(_ali_ons, b, topic, access, secret)
        assert bad["rc"] == 1 and bad["final"]["sent"] == 0, bad
        # ali-ons reports only "Send [4] times, still failed"; the broker logs why it refused.
        assert "refused 310 from 127.0.0.1" in b.log() and remark in b.log(), (remark, bad)


async def _request_namesrv(b, code, fields=None, creds=None):
    host, _, port = b.namesrv.rpartition(":")
    conn = await open_connection(host, int(port), sign=creds.sign if creds else None)
    try:
        return await conn.request(RemotingCommand.request(code, fields), 5.0)
    finally:
        conn.close()


async def test_taking_the_broker_out_of_service_needs_an_admin_account(acl_broker):
    """updateBrokerConfig brokerPermission (25, RocketMQ's admin code) on the broker port, and wipeWritePerm /
    addWritePerm (205 / 327) on its own name server's port, which change the same broker's write routes: with an
    ACL file, none is anyone's to send (the name-server port took them unsigned: any host could stop every
    producer of an ACL-protected broker). Routes stay anyone's to read."""
    b = acl_broker
    body = b"brokerPermission=4\n"
    unsigned = await _request(b, RequestCode.UPDATE_BROKER_CONFIG, None, None, body)
    assert (unsigned.code, unsigned.remark) == (ResponseCode.NO_PERMISSION, "No accessKey is configured")
    app = await _request(b, RequestCode.UPDATE_BROKER_CONFIG, None, APP, body)
    assert (app.code, app.remark) == (ResponseCode.NO_PERMISSION,
                                      "Need admin permission for request code=25, but accessKey=appuser is not")
    for code in (RequestCode.WIPE_WRITE_PERM_OF_BROKER, RequestCode.ADD_WRITE_PERM_OF_BROKER):
        refused = await _request_namesrv(b, code, {"brokerName": "broker-a"})
        assert (refused.code, refused.remark) == (ResponseCode.NO_PERMISSION, "No accessKey is configured")
        refused = await _request_namesrv(b, code, {"brokerName": "broker-a"}, APP)
        assert refused.code == ResponseCode.NO_PERMISSION and "admin permission" in refused.remark
    route = await _request_namesrv(b, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"})
    assert route.code == ResponseCode.SUCCESS and json.loads(route.body_bytes())["queueDatas"][0]["perm"] & 2
    wiped = await _request_namesrv(b, RequestCode.WIPE_WRITE_PERM_OF_BROKER, {"brokerName": "broker-a"}, ADMIN)
    assert wiped.code == ResponseCode.SUCCESS, wiped.remark
    route = await _request_namesrv(b, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"})
    assert not json.loads(route.body_bytes())["queueDatas"][0]["perm"] & 2


@bounded(60)
async def test_a_push_consumer_whose_heartbeat_is_refused_does_not_start(acl_broker):
    """A push consumer starts through a broker that is out of reach (it beats again), but a broker that
    answers its heartbeat with a refusal (wrong credentials here) must still fail the start: logged and
    passed over, start returned and the consumer sat with no queue, every rebalance refused in the log."""
    from consumer import PushConsumer
    b = acl_broker
    assert (await _create(b, "AclTopic")).code == ResponseCode.SUCCESS
    refused = PushConsumer(b.namesrv, "CG_acl_push", lambda msg: None,
                           credentials=Credentials("appuser", "wrong-secret"))
    refused.subscribe("AclTopic")
    try:
        with pytest.raises(ResponseError) as err:
            await refused.start()
        assert err.value.code == ResponseCode.NO_PERMISSION, err.value
    finally:
        await refused.shutdown()
