"""VIEW_BROKER_STATS_DATA (315): a counter's minute, hour and day (mqadmin statsAll, exportMetrics).

Request header (ViewBrokerStatsDataRequestHeader): statsName, statsKey. txmq keeps the two counters the
tools ask for: TOPIC_PUT_NUMS <topic> (messages stored) and GROUP_GET_NUMS <topic>@<group> (messages
pulled); any other name or an uncounted key is SYSTEM_ERROR "The stats <N> <K> not exist", as RocketMQ
answers a key it never counted. statsAll swallowed the REQUEST_CODE_NOT_SUPPORTED this was and printed
every rate and day's count as 0. Reply (BrokerStatsData, fastjson's order)::

    {"statsDay":{"avgpt":0.0,"sum":N,"tps":X},"statsHour":{..},"statsMinute":{..}}

``avgpt`` (RocketMQ: messages per put request) is not kept: 0.0; no tool reads it.
"""
from __future__ import annotations

import json

from protocol.codes import ResponseCode


def view_broker_stats_data(ctx, conn, cmd):
    name = cmd.str_field("statsName", required=True)
    key = cmd.str_field("statsKey", required=True)
    windows = ctx.metrics.stats_windows(name, key)
    if windows is None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"The stats <{name}> <{key}> not exist")
    body = {window: {"avgpt": 0.0, "sum": count, "tps": float(tps)} for window, (count, tps) in sorted(windows.items())}
    return cmd.response(ResponseCode.SUCCESS, body=json.dumps(body, separators=(",", ":")).encode())
