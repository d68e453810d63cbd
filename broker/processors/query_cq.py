"""QUERY_CONSUME_QUEUE (321), mqadmin queryCq: the raw units of one consume queue, for looking at the store.

Request header (QueryConsumeQueueRequestHeader): topic, queueId, index, count, consumerGroup (optional).
Reply (QueryConsumeQueueResponseBody, keys as fastjson sorts them)::

    {"filterData":..,"maxQueueIndex":N,"minQueueIndex":N,
     "queueData":[{"eval":false,"physicOffset":N,"physicSize":N,"tagsCode":N},..],"subscriptionData":{..}}

filterData and subscriptionData only when a group is named: its subscription to the topic, or
"G@T is not online!". ``eval`` is RocketMQ's filter verdict on consume-queue extension units, which
txmq does not write (nor RocketMQ by default): always false. An unknown queue is SYSTEM_ERROR
"Q@T is not exist!" as RocketMQ. An index with no unit is answered with the bounds and no queueData
(RocketMQ answers no body at all there, which the tool fails to decode). A count past
MAX_UNITS is refused by name: RocketMQ stops at the end of the queue's file, up to 300,000 units.
"""
from __future__ import annotations

import json

from protocol.admin_bodies import dump
from protocol.codes import ResponseCode

from ..clients import is_tag_type
from .ops import subscription_data

MAX_UNITS = 1024        # one request's units (the tool asks 10 by default): a ~90 KB reply at most


def query_consume_queue(ctx, conn, cmd):
    topic = cmd.str_field("topic", required=True)
    queue_id = cmd.int_field("queueId", required=True)
    index = cmd.int_field("index", required=True)
    count = cmd.int_field("count", required=True)
    group = cmd.str_field("consumerGroup")
    if not 0 <= count <= MAX_UNITS:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"count {count} is not within 0..{MAX_UNITS}, the units "
                            f"one QUERY_CONSUME_QUEUE reads on this broker: ask again from a later index")
    units = ctx.store.queue_units(topic, queue_id, index, count)
    if units is None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"{queue_id}@{topic} is not exist!")
    body = {"maxQueueIndex": ctx.store.max_offset(topic, queue_id),
            "minQueueIndex": ctx.store.min_offset(topic, queue_id)}
    if group is not None:
        consumers = ctx.clients.consumers.get(group)
        sub = consumers.subscriptions.get(topic) if consumers is not None else None
        if sub is None:
            body["filterData"] = f"{group}@{topic} is not online!"
        else:
            body["subscriptionData"] = subscription_data(topic, sub)
            body["filterData"] = _filter_data(group, topic, sub)
    remark = None
    if units or count == 0:
        body["queueData"] = [{"eval": False, "physicOffset": phys, "physicSize": size, "tagsCode": tag}
                             for phys, size, tag in units]
    else:
        remark = f"Index {index} of {queue_id}@{topic} is not exist!"
    return cmd.response(ResponseCode.SUCCESS, remark, body=dump(body).encode())


def _filter_data(group: str, topic: str, sub) -> str:
    """JSON.toJSONString(ConsumerFilterData, true): none for a TAG subscription ("null"), the expression of an
    SQL92 one (pretty-printed with tabs, as fastjson)."""
    if is_tag_type(sub.expression_type):
        return "null"
    return json.dumps({"consumerGroup": group, "expression": sub.sub_string, "expressionType": sub.expression_type,
                       "topic": topic}, indent="\t", ensure_ascii=False)
