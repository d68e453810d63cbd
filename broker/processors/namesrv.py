"""Name-server role: routes for topics this broker serves (spec 3.1, 3.19).

txmq is its own name server: every route points at this broker, id 0 (master).
mqadmin wipeWritePerm (205) takes write permission out of every route it answers,
on the name-server port and the broker port alike, until addWritePerm (327) or a
restart (as a RocketMQ broker's restart registers it afresh). The broker itself
still takes sends: as in RocketMQ, only routes change, and producers go elsewhere.
"""
from __future__ import annotations

import json
import logging

from protocol.codes import Perm, ResponseCode
from protocol.message import validate_topic
from protocol.route import (BrokerData, QueueData, TopicRouteData, encode_cluster_info, encode_route, encode_topic_list,
                            strict_json_for)

from ..ha import broker_id_of
from ..subscriptions import retry_queues
from ..topics import RETRY_PREFIX, TopicConfig

log = logging.getLogger("txmq.namesrv")


def _broker_data(ctx) -> BrokerData:
    # A SLAVE lists itself under id 1 (ha.broker_id_of), as RocketMQ routes a slave.
    return BrokerData(ctx.config.cluster_name, ctx.config.broker_name, {broker_id_of(ctx.config): ctx.broker_addr})


def get_route_info(ctx, conn, cmd):
    topic = cmd.str_field("topic", required=True)
    tc = ctx.topics.get(topic)
    if tc is None and topic.startswith(RETRY_PREFIX) and validate_topic(topic) is None:
        # A consumer group's retry topic, asked for before the group's first heartbeat creates it: routed as it
        # will be, but not created here. This port takes no credentials, and every name asked for became a
        # persistent topic, until max_retry_groups refused the groups that really heartbeat.
        queues = retry_queues(ctx.subscriptions, topic[len(RETRY_PREFIX):])
        tc = TopicConfig(topic, queues, queues)
    if tc is None:
        return cmd.response(ResponseCode.TOPIC_NOT_EXIST,
                            f"No topic route info in name server for the topic: {topic}")
    perm = ctx.topic_perm(tc.perm)
    if ctx.routes_write_wiped:
        perm &= ~Perm.WRITE
    route = TopicRouteData([QueueData(ctx.config.broker_name, tc.read_queue_nums, tc.write_queue_nums, perm,
                                      tc.sys_flag)], [_broker_data(ctx)])
    strict = strict_json_for(cmd.version, cmd.bool_field("acceptStandardJsonOnly"))
    return cmd.response(ResponseCode.SUCCESS, body=encode_route(route, strict=strict))


def get_broker_cluster_info(ctx, conn, cmd):
    return cmd.response(ResponseCode.SUCCESS, body=encode_cluster_info([_broker_data(ctx)],
                                                                        strict=strict_json_for(cmd.version)))


def get_all_topic_list(ctx, conn, cmd):
    return cmd.response(ResponseCode.SUCCESS, body=json.dumps({"topicList": sorted(ctx.topics.topics)}).encode())


def get_topics_by_cluster(ctx, conn, cmd):
    """GET_TOPICS_BY_CLUSTER (224): this broker's topics when the cluster is its own, else none."""
    cluster = cmd.str_field("cluster", required=True)
    topics = ctx.topics.topics if cluster == ctx.config.cluster_name else ()
    return cmd.response(ResponseCode.SUCCESS, body=encode_topic_list(topics))


def get_system_topic_list_from_ns(ctx, conn, cmd):
    """GET_SYSTEM_TOPIC_LIST_FROM_NS (304): cluster and broker name, and the broker's address, which the Java
    admin asks next for its system topics (305, below)."""
    return cmd.response(ResponseCode.SUCCESS, body=encode_topic_list(
        {ctx.config.cluster_name, ctx.config.broker_name}, ctx.broker_addr))


def get_system_topic_list_from_broker(ctx, conn, cmd):
    """GET_SYSTEM_TOPIC_LIST_FROM_BROKER (305), on the broker port."""
    return cmd.response(ResponseCode.SUCCESS, body=encode_topic_list(ctx.topics.system_topics()))


def _write_perm(ctx, conn, cmd, wiped: bool, count_key: str):
    name = cmd.str_field("brokerName", required=True)
    if name != ctx.config.broker_name:
        return cmd.response(ResponseCode.SUCCESS, ext_fields={count_key: 0})    # as RocketMQ: a name it lacks
    ctx.routes_write_wiped = wiped
    count = len(ctx.topics.topics)
    log.warning("write permission of the routes of broker %s %s by %s:%s (%d topics)", name,
                "wiped" if wiped else "given back", *conn.peer, count)
    return cmd.response(ResponseCode.SUCCESS, ext_fields={count_key: count})


def wipe_write_perm(ctx, conn, cmd):
    """WIPE_WRITE_PERM_OF_BROKER (205), mqadmin wipeWritePerm."""
    return _write_perm(ctx, conn, cmd, True, "wipeTopicCount")


def add_write_perm(ctx, conn, cmd):
    """ADD_WRITE_PERM_OF_BROKER (327), mqadmin addWritePerm."""
    return _write_perm(ctx, conn, cmd, False, "addTopicCount")


def delete_topic_in_namesrv(ctx, conn, cmd):
    """DELETE_TOPIC_IN_NAMESRV (216), mqadmin deleteTopic's last step. This name server routes its broker's own
    topics, so after DELETE_TOPIC_IN_BROKER there is nothing left to do; a topic the broker still holds cannot
    leave its routes here, and saying SUCCESS would leave it routed unnoticed."""
    topic = cmd.str_field("topic", required=True)
    cluster = cmd.str_field("clusterName", "")
    if ctx.topics.get(topic) is not None and cluster in ("", ctx.config.cluster_name):
        return cmd.response(ResponseCode.SYSTEM_ERROR,
                            f"topic[{topic}] is still held by broker {ctx.config.broker_name}, whose routes this "
                            f"name server serves: delete it in the broker first (DELETE_TOPIC_IN_BROKER)")
    return cmd.response(ResponseCode.SUCCESS)


def register_broker(ctx, conn, cmd):
    # Other brokers cannot join a txmq name server: it routes only to its own broker.
    return cmd.response(ResponseCode.SYSTEM_ERROR, "txmq's name server serves only its own broker")
