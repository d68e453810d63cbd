"""Requests a stand-alone name server answers (RocketMQ's DefaultRequestProcessor, the 4.x subset).

Handlers are ``(ctx, conn, cmd)`` like the broker's, with a NamesrvContext:
the route table and the clock. Codes without a handler are answered
REQUEST_CODE_NOT_SUPPORTED by the server.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from protocol.codes import RequestCode as R
from protocol.codes import ResponseCode
from protocol.errors import HeaderError
from protocol.registration import DataVersion, body_crc32, decode_register_body
from protocol.route import encode_cluster_info, encode_route, encode_topic_list, strict_json_for

from ..kv_config import KvConfig
from ..limits import peer_host
from ..processors import kv_table
from .table import RouteTable

log = logging.getLogger(__name__)


@dataclass
class NamesrvContext:
    table: RouteTable
    clock: object                   # () -> ms of a monotonic clock (broker expiry)
    kv: KvConfig | None = None      # the KV config (processors/kv.py); the server always gives one


def register_broker(ctx: NamesrvContext, conn, cmd):
    crc = cmd.int_field("bodyCrc32", 0)
    body = cmd.body_bytes()
    if crc != 0 and body_crc32(body) != crc:
        return cmd.response(ResponseCode.SYSTEM_ERROR, "crc32 not match")
    try:
        registration = decode_register_body(body, compressed=cmd.bool_field("compressed"))
    except HeaderError as exc:
        # A broker's registration is oneway: refused, it only says so here, and the broker's routes expire.
        log.warning("registration of broker %s (%s) refused: %s", cmd.ext_fields.get("brokerName", "?"),
                    cmd.ext_fields.get("brokerAddr", "?"), exc)
        raise
    broker_id = cmd.int_field("brokerId", required=True)
    if broker_id < 0:
        raise HeaderError(f"brokerId={broker_id} is negative")
    addr = cmd.str_field("brokerAddr", required=True)
    if not ctx.table.room_for(addr, conn):
        host, now = peer_host(conn), ctx.clock()
        if now - ctx.table.refusal_logged_ms >= 10_000:
            ctx.table.refusal_logged_ms = now
            log.warning("registration of broker address %.200s from %s refused: its connections hold %d addresses, "
                        "the limit (max_broker_addresses_per_host; logged at most every 10 s)", addr, host,
                        ctx.table.max_addresses_per_host)
        return cmd.response(ResponseCode.SYSTEM_BUSY,
                            f"broker address {addr} not registered: the connections from {host} hold "
                            f"{ctx.table.max_addresses_per_host} addresses, the limit (max_broker_addresses_per_host)")
    result = ctx.table.register(
        cluster=cmd.str_field("clusterName", required=True), broker_addr=addr,
        broker_name=cmd.str_field("brokerName", required=True), broker_id=broker_id,
        ha_server_addr=cmd.str_field("haServerAddr", ""), body=registration, conn=conn, now_ms=ctx.clock())
    return cmd.response(ResponseCode.SUCCESS, ext_fields={"masterAddr": result.master_addr,
                                                          "haServerAddr": result.ha_server_addr})


def unregister_broker(ctx: NamesrvContext, conn, cmd):
    ctx.table.unregister(cluster=cmd.str_field("clusterName", ""), broker_addr=cmd.str_field("brokerAddr", required=True),
                         broker_name=cmd.str_field("brokerName", required=True),
                         broker_id=cmd.int_field("brokerId", required=True))
    return cmd.response(ResponseCode.SUCCESS)


def delete_topic(ctx: NamesrvContext, conn, cmd):
    """DELETE_TOPIC_IN_NAMESRV (216), mqadmin deleteTopic's last step after each master deleted it."""
    topic = cmd.str_field("topic", required=True)
    cluster = cmd.str_field("clusterName", "")
    left = ctx.table.delete_topic(topic, cluster)
    log.warning("topic %s deleted from the routes of %s by %s:%s (%d brokers)", topic,
                f"cluster {cluster}" if cluster else "every cluster", *conn.peer, left)
    return cmd.response(ResponseCode.SUCCESS)


def query_data_version(ctx: NamesrvContext, conn, cmd):
    """QUERY_DATA_VERSION (322): has the broker's topic table changed since it last registered?

    A Java broker with forceRegister=false asks this before registering; an unchanged answer
    counts as being heard from."""
    addr = cmd.str_field("brokerAddr", required=True)
    try:
        obj = json.loads(cmd.body_bytes() or b"{}")
        theirs = DataVersion(int(obj.get("timestamp", 0)), int(obj.get("counter", 0)))
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise HeaderError(f"data version does not parse: {exc}") from None
    live = ctx.table.live.get(addr)
    changed = live is None or live.data_version != theirs
    if not changed:
        live.last_ms = ctx.clock()
    body = b"" if live is None else \
        f'{{"counter":{live.data_version.counter},"timestamp":{live.data_version.timestamp}}}'.encode()
    return cmd.response(ResponseCode.SUCCESS, ext_fields={"changed": "true" if changed else "false"}, body=body)


def get_route_info(ctx: NamesrvContext, conn, cmd):
    topic = cmd.str_field("topic", required=True)
    route = ctx.table.route(topic)
    if route is None:
        return cmd.response(ResponseCode.TOPIC_NOT_EXIST, f"No topic route info in name server for the topic: {topic}")
    strict = strict_json_for(cmd.version, cmd.bool_field("acceptStandardJsonOnly"))
    return cmd.response(ResponseCode.SUCCESS, body=encode_route(route, strict=strict))


def get_broker_cluster_info(ctx: NamesrvContext, conn, cmd):
    return cmd.response(ResponseCode.SUCCESS, body=encode_cluster_info(ctx.table.broker_datas(),
                                                                        strict=strict_json_for(cmd.version)))


def get_all_topic_list(ctx: NamesrvContext, conn, cmd):
    return cmd.response(ResponseCode.SUCCESS, body=json.dumps({"topicList": ctx.table.topic_names()}).encode())


def get_topics_by_cluster(ctx: NamesrvContext, conn, cmd):
    """GET_TOPICS_BY_CLUSTER (224): the topics of one cluster's brokers (the dashboard, the admin API)."""
    return cmd.response(ResponseCode.SUCCESS,
                        body=encode_topic_list(ctx.table.topics_of_cluster(cmd.str_field("cluster", required=True))))


def get_system_topic_list(ctx: NamesrvContext, conn, cmd):
    """GET_SYSTEM_TOPIC_LIST_FROM_NS (304): cluster and broker names, and a broker to ask for the rest."""
    names, addr = ctx.table.system_topic_list()
    return cmd.response(ResponseCode.SUCCESS, body=encode_topic_list(names, addr))


def wipe_write_perm(ctx: NamesrvContext, conn, cmd):
    """WIPE_WRITE_PERM_OF_BROKER (205), mqadmin wipeWritePerm: the broker leaves every write route (producers
    send elsewhere; consumers still read it) until addWritePerm or until it leaves the table."""
    name = cmd.str_field("brokerName", required=True)
    count = ctx.table.wipe_write_perm(name)
    log.warning("write permission of broker %.200s wiped by %s:%s (%d topics)", name, *conn.peer, count)
    return cmd.response(ResponseCode.SUCCESS, ext_fields={"wipeTopicCount": count})


def add_write_perm(ctx: NamesrvContext, conn, cmd):
    """ADD_WRITE_PERM_OF_BROKER (327), mqadmin addWritePerm: the perm the broker registered is routed again."""
    name = cmd.str_field("brokerName", required=True)
    count = ctx.table.add_write_perm(name)
    log.warning("write permission of broker %.200s given back by %s:%s (%d topics)", name, *conn.peer, count)
    return cmd.response(ResponseCode.SUCCESS, ext_fields={"addTopicCount": count})


def namesrv_table() -> dict:
    return {
        R.REGISTER_BROKER: register_broker,
        R.UNREGISTER_BROKER: unregister_broker,
        R.QUERY_DATA_VERSION: query_data_version,
        R.GET_ROUTEINFO_BY_TOPIC: get_route_info,
        R.GET_BROKER_CLUSTER_INFO: get_broker_cluster_info,
        R.GET_ALL_TOPIC_LIST_FROM_NAMESERVER: get_all_topic_list,
        R.DELETE_TOPIC_IN_NAMESRV: delete_topic,
        R.GET_TOPICS_BY_CLUSTER: get_topics_by_cluster,
        R.GET_SYSTEM_TOPIC_LIST_FROM_NS: get_system_topic_list,
        R.WIPE_WRITE_PERM_OF_BROKER: wipe_write_perm,
        R.ADD_WRITE_PERM_OF_BROKER: add_write_perm,
        **kv_table(),
    }
