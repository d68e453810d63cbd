"""Name-server role: routes for topics this broker serves (spec 3.1, 3.19).

txmq is its own name server: every route points at this broker, id 0 (master).
"""
from __future__ import annotations

import json

from protocol.codes import ResponseCode
from protocol.message import validate_topic
from protocol.route import BrokerData, QueueData, TopicRouteData, encode_cluster_info, encode_route, strict_json_for

from ..ha import broker_id_of
from ..topics import RETRY_PREFIX, TopicConfig


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
        tc = TopicConfig(topic, 1, 1)
    if tc is None:
        return cmd.response(ResponseCode.TOPIC_NOT_EXIST,
                            f"No topic route info in name server for the topic: {topic}")
    route = TopicRouteData([QueueData(ctx.config.broker_name, tc.read_queue_nums, tc.write_queue_nums, tc.perm,
                                      tc.sys_flag)], [_broker_data(ctx)])
    strict = strict_json_for(cmd.version, cmd.bool_field("acceptStandardJsonOnly"))
    return cmd.response(ResponseCode.SUCCESS, body=encode_route(route, strict=strict))


def get_broker_cluster_info(ctx, conn, cmd):
    return cmd.response(ResponseCode.SUCCESS, body=encode_cluster_info([_broker_data(ctx)],
                                                                        strict=strict_json_for(cmd.version)))


def get_all_topic_list(ctx, conn, cmd):
    return cmd.response(ResponseCode.SUCCESS, body=json.dumps({"topicList": sorted(ctx.topics.topics)}).encode())


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
