"""Request-reply (RocketMQ 4.6+) against the real broker: a reply sent with SEND_REPLY_MESSAGE(_V2) reaches the
requesting producer's connection as PUSH_REPLY_MESSAGE_TO_CLIENT, and a reply that can reach nobody is refused
with RocketMQ's SYSTEM_ERROR remark. Before, 324/325 were not supported at all and "<cluster>_REPLY_TOPIC" had
no route, so every stock client's ``producer.request()`` timed out."""
from __future__ import annotations

import asyncio
import json

import pytest

from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.connection import open_connection
from protocol.message import SendMessageRequestHeader, decode_records, properties_to_string, string_to_properties
from protocol.route import decode_route
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

REPLY_TOPIC = "DefaultCluster_REPLY_TOPIC"
REQUESTER = "127.0.0.1@requester"


def _host_port(addr):
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _send(code, topic, props, body, v2):
    header = SendMessageRequestHeader(producer_group="PG_replier", topic=topic, queue_id=-1,
                                      properties=properties_to_string(props), born_timestamp=1_700_000_000_000)
    return RemotingCommand.request(code, header.to_ext_fields(v2=v2), body)


async def _requester(broker, handler):
    """A connection answering pushes with ``handler``, registered (heartbeat) as the producer REQUESTER."""
    conn = await open_connection(*_host_port(broker.broker), handler)
    beat = {"clientID": REQUESTER, "producerDataSet": [{"groupName": "PG_requester"}], "consumerDataSet": []}
    resp = await conn.request(RemotingCommand.request(RequestCode.HEART_BEAT, body=json.dumps(beat).encode()), 5)
    assert resp.code == ResponseCode.SUCCESS, resp.remark
    return conn


@bounded(30)
async def test_a_reply_is_pushed_to_the_requester_and_stored(broker):
    pushed: asyncio.Queue = asyncio.Queue()
    answer = {"code": ResponseCode.SUCCESS}

    def requester_handler(conn, cmd):
        pushed.put_nowait(cmd)
        return cmd.response(answer["code"], None if answer["code"] == ResponseCode.SUCCESS else "refused")

    requester = await _requester(broker, requester_handler)
    replier = await open_connection(*_host_port(broker.broker))
    try:
        # The replier's producer needs the reply topic's route before anything was ever sent to it.
        route = await replier.request(RemotingCommand.request(RequestCode.GET_ROUTEINFO_BY_TOPIC,
                                                              {"topic": REPLY_TOPIC}), 5)
        assert route.code == ResponseCode.SUCCESS, route.remark
        assert [q.write_queue_nums for q in decode_route(route.body_bytes()).queue_datas] == [1]

        request_props = {"CORRELATION_ID": "corr-1", "REPLY_TO_CLIENT": REQUESTER, "TTL": "3000"}
        sent = await requester.request(_send(RequestCode.SEND_MESSAGE_V2, "Orders", request_props, b"ask", True), 5)
        assert sent.code == ResponseCode.SUCCESS, sent.remark
        view = await replier.request(RemotingCommand.request(RequestCode.VIEW_MESSAGE_BY_ID, {
            "offset": int(sent.ext_fields["msgId"][-16:], 16)}), 5)
        request_msg = decode_records(view.body_bytes())[0]
        assert request_msg.properties["CLUSTER"] == "DefaultCluster"     # what the replier derives the topic from

        reply_props = {"CORRELATION_ID": "corr-1", "REPLY_TO_CLIENT": REQUESTER, "TTL": "3000", "MSG_TYPE": "reply",
                       "CLUSTER": "DefaultCluster"}
        for code, v2 in ((RequestCode.SEND_REPLY_MESSAGE_V2, True), (RequestCode.SEND_REPLY_MESSAGE, False)):
            resp = await replier.request(_send(code, REPLY_TOPIC, reply_props, b"answer", v2), 5)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            push = await asyncio.wait_for(pushed.get(), 5)
            assert push.code == RequestCode.PUSH_REPLY_MESSAGE_TO_CLIENT and push.body_bytes() == b"answer"
            f = push.ext_fields
            assert (f["topic"], f["producerGroup"], f["bornTimestamp"]) == (REPLY_TOPIC, "PG_replier",
                                                                            "1700000000000")
            props = string_to_properties(f["properties"])
            assert props["CORRELATION_ID"] == "corr-1" and props["MSG_TYPE"] == "reply"
            assert int(props["PUSH_REPLY_TIME"]) > 0 and int(f["storeTimestamp"]) > 0
            assert f["bornHost"].startswith("/127.0.0.1:") and f["storeHost"].startswith("/")
            assert {"defaultTopic", "defaultTopicQueueNums", "queueId", "sysFlag", "flag"} <= set(f)
            assert resp.ext_fields["queueId"] == "0" and resp.ext_fields["msgId"] != "0"

        # Replies that can reach nobody are refused, not answered as sent.
        refusals = []
        for props in ({**reply_props, "REPLY_TO_CLIENT": "127.0.0.1@gone"},
                      {k: v for k, v in reply_props.items() if k != "REPLY_TO_CLIENT"}):
            resp = await replier.request(_send(RequestCode.SEND_REPLY_MESSAGE_V2, REPLY_TOPIC, props, b"x", True), 5)
            refusals.append((resp.code, resp.remark))
        answer["code"] = ResponseCode.SYSTEM_ERROR
        resp = await replier.request(_send(RequestCode.SEND_REPLY_MESSAGE_V2, REPLY_TOPIC, reply_props, b"y", True), 5)
        refusals.append((resp.code, resp.remark))
        assert (await asyncio.wait_for(pushed.get(), 5)).body_bytes() == b"y"
        assert refusals == [
            (ResponseCode.SYSTEM_ERROR, "push reply message fail, channel of <127.0.0.1@gone> not found."),
            (ResponseCode.SYSTEM_ERROR, "reply message properties[REPLY_TO_CLIENT] is null"),
            (ResponseCode.SYSTEM_ERROR, f"push reply message to {REQUESTER}fail."),
        ]
        # Every reply is kept in the reply topic as well (RocketMQ's storeReplyMessageEnable).
        stored = await replier.request(RemotingCommand.request(RequestCode.GET_MAX_OFFSET,
                                                               {"topic": REPLY_TOPIC, "queueId": 0}), 5)
        assert stored.int_field("offset") == 5
    finally:
        requester.close()
        replier.close()


@pytest.mark.parametrize("requester_first", [False, True], ids=["other-registered-first", "requester-first"])
@bounded(30)
async def test_a_reply_goes_to_the_connection_its_request_came_on_when_two_claim_its_client_id(broker,
                                                                                            requester_first):
    """Two live connections give the requester's client id (a Java process with a fixed instanceName started
    twice on one host; the requester back on a new connection while its old one is not yet seen dead). The reply
    went to the first registered: a stock Java client answers SUCCESS to a reply that matches none of its requests
    (it only logs it), so the replier was told the reply was delivered and the requester never had it. RocketMQ
    sends it to the last registered, as wrong the other way round. It goes where its request came from."""
    pushed = {"requester": asyncio.Queue(), "other": asyncio.Queue()}

    def handler(name):
        def handle(conn, cmd):
            pushed[name].put_nowait(cmd)
            return cmd.response(ResponseCode.SUCCESS)      # as a Java client answers any reply, matched or not
        return handle

    conns = {}
    for name in (("requester", "other") if requester_first else ("other", "requester")):
        conns[name] = await _requester(broker, handler(name))
    replier = await open_connection(*_host_port(broker.broker))
    try:
        for i in range(2):
            request_props = {"CORRELATION_ID": f"corr-{i}", "REPLY_TO_CLIENT": REQUESTER, "TTL": "3000"}
            sent = await conns["requester"].request(_send(RequestCode.SEND_MESSAGE_V2, "Orders", request_props,
                                                          b"ask", True), 5)
            assert sent.code == ResponseCode.SUCCESS, sent.remark
            reply_props = {**request_props, "MSG_TYPE": "reply", "CLUSTER": "DefaultCluster"}
            resp = await replier.request(_send(RequestCode.SEND_REPLY_MESSAGE_V2, REPLY_TOPIC, reply_props,
                                               f"answer {i}".encode(), True), 5)
            assert resp.code == ResponseCode.SUCCESS, resp.remark
            # Answered once the push was: it is in one of the queues already.
            assert pushed["other"].empty(), "the reply went to the other connection claiming the requester's id"
            assert pushed["requester"].get_nowait().body_bytes() == f"answer {i}".encode()
    finally:
        for conn in (*conns.values(), replier):
            conn.close()


@bounded(60)
async def test_replies_a_requester_refuses_are_logged_at_most_every_10_s(broker):
    """A requester answering every PUSH_REPLY_MESSAGE_TO_CLIENT with an error (its remark its own choice) had the
    broker log a WARNING a reply, with that remark: a replier and a requester in a loop wrote to the broker's disk
    as fast as they could send (200 replies: 200 lines of 4 KB each). Each reply is still refused to its replier
    (SYSTEM_ERROR), and said at most every 10 s."""
    remark = "r" * 4096

    def requester_handler(conn, cmd):
        return cmd.response(ResponseCode.SYSTEM_ERROR, remark)

    requester = await _requester(broker, requester_handler)
    replier = await open_connection(*_host_port(broker.broker))
    try:
        reply_props = {"CORRELATION_ID": "corr", "REPLY_TO_CLIENT": REQUESTER, "MSG_TYPE": "reply",
                       "CLUSTER": "DefaultCluster"}
        replies = 200
        for _ in range(replies):
            resp = await replier.request(_send(RequestCode.SEND_REPLY_MESSAGE_V2, REPLY_TOPIC, reply_props, b"y",
                                               True), 5)
            assert (resp.code, resp.remark) == (ResponseCode.SYSTEM_ERROR, f"push reply message to {REQUESTER}fail.")
    finally:
        requester.close()
        replier.close()
    said = broker.log_path.read_text(errors="replace").count(f"push reply message to <{REQUESTER}> return fail")
    assert said == 1, f"{said} lines for {replies} refused replies"
