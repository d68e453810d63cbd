"""GET_BROKER_CONFIG (26): mqadmin getBrokerConfig, exportConfigs, the dashboard's broker config view.

RocketMQ answers its configuration as Properties text, ``key=value`` a line (MixAll.properties2String), with
the configuration's data version as the ``version`` field. txmq writes RocketMQ's name for each setting that
means the same thing, then every setting of its own as ``txmq.<name>`` (what ``python -m broker --help``
lists), so the tool shows the whole configuration. The version is {"counter":N,"timestamp":<start>}, N the
changes UPDATE_BROKER_CONFIG made.

UPDATE_BROKER_CONFIG (25), mqadmin updateBrokerConfig: the body is Properties text. txmq's settings are
flags fixed at start, except RocketMQ's ``brokerPermission`` (6 read-write, 4 read-only, 2 write-only, 0
neither), which takes a broker out of service for maintenance: routes and registrations carry each
topic's perm masked by it (a new data version: name servers re-read it at once), and new messages or
pulls it forbids are refused NO_PERMISSION (processors/disk_guard.py, pull.py). It is saved before it is
answered or applied (broker/live_config.py, as RocketMQ writes it to its configuration file) and read again at
start-up, so a broker out of service stays out through a crash. A request naming any other key is refused, saying
which, and changes nothing: RocketMQ would apply it live, and saying SUCCESS for a setting that does not
change would leave the operator believing it did.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from protocol.admin_bodies import dump
from protocol.codes import ResponseCode

from .. import live_config
from ..live_config import PERMISSIONS

log = logging.getLogger("txmq.admin")


def _rocketmq_names(ctx) -> dict[str, object]:
    c = ctx.config
    return {
        "brokerClusterName": c.cluster_name, "brokerName": c.broker_name, "brokerId": c.broker_id,
        "brokerRole": c.broker_role, "brokerIP1": ctx.broker_addr.rpartition(":")[0],
        "listenPort": ctx.broker_addr.rpartition(":")[2], "namesrvAddr": c.namesrv_addr, "regionId": c.region_id,
        "storePathRootDir": c.store_dir, "flushDiskType": "SYNC_FLUSH" if c.flush == "sync" else "ASYNC_FLUSH",
        "flushIntervalCommitLog": c.flush_interval_ms, "mappedFileSizeCommitLog": c.segment_size,
        "mappedFileSizeConsumeQueue": c.cq_units_per_file * 20, "maxMessageSize": c.max_message_size,
        "autoCreateTopicEnable": c.auto_create_topic, "defaultTopicQueueNums": c.default_topic_queue_nums,
        "traceTopicEnable": c.trace_topic_enable, "enablePropertyFilter": c.enable_property_filter,
        "longPollingEnable": c.long_polling, "shortPollingTimeMills": c.short_polling_ms,
        "accessMessageInMemoryMaxRatio": c.access_message_in_memory_max_ratio,
        "messageDelayLevel": c.message_delay_level, "transactionCheckInterval": c.transaction_check_interval_ms,
        "transactionTimeOut": c.transaction_timeout_ms, "transactionCheckMax": c.transaction_check_max,
        "fileReservedTime": c.file_reserved_hours, "diskMaxUsedSpaceRatio": round(c.disk_clean_ratio * 100),
        "messageIndexEnable": c.message_index_enable, "maxHashSlotNum": c.index_hash_slots,
        "maxIndexNum": c.index_max_entries, "registerNameServerPeriod": c.register_period_ms,
        "registerBrokerTimeoutMills": c.register_timeout_ms, "compressedRegister": c.register_compressed,
        "brokerPermission": ctx.broker_permission, "haListenPort": c.ha_port, "haMasterAddress": c.ha_master_addr, "slaveReadEnable": c.slave_read_enable,
        "aclEnable": bool(c.acl_file),
        # what txmq does without a setting; mqadmin exportConfigs fails (NullPointerException) on any missing
        "autoCreateSubscriptionGroup": True, "msgTraceTopicName": "RMQ_SYS_TRACE_TOPIC", "filterServerNums": 0,
        "traceOn": False, "useTLS": False,
    }


def _text(value) -> str:
    """A value as Java's String.valueOf writes it (true, 72, 72.5)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def properties_text(ctx) -> str:
    lines = {**_rocketmq_names(ctx),
             **{f"txmq.{f.name}": getattr(ctx.config, f.name) for f in dataclasses.fields(ctx.config)}}
    # Properties.load would read a line break inside a value as the end of it
    return "".join(f"{k}={_text(v)}\n" for k, v in lines.items() if "\n" not in _text(v))


def get_broker_config(ctx, conn, cmd):
    version = dump({"counter": ctx.config_version, "timestamp": ctx.started_ms})
    return cmd.response(ResponseCode.SUCCESS, ext_fields={"version": version}, body=properties_text(ctx).encode())


def parse_properties(text: str) -> dict[str, str]:
    """Properties text as MixAll.properties2String writes it: ``key=value`` (or ``key:value``) a line; blank
    lines and ``#`` / ``!`` comments skipped."""
    props = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#!":
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=len(line))
        props[line[:cut].strip()] = line[cut + 1:].strip()
    return props


async def update_broker_config(ctx, conn, cmd):
    try:
        props = parse_properties(cmd.body_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"the body is not UTF-8 Properties text: {exc}")
    fixed = sorted(k for k in props if k != "brokerPermission")
    if fixed:
        named = ", ".join(k[:100] for k in fixed[:5]) + (f" and {len(fixed) - 5} more" if len(fixed) > 5 else "")
        return cmd.response(ResponseCode.SYSTEM_ERROR,
                            f"not changed: {named}: txmq's settings are flags fixed at start (see getBrokerConfig's "
                            "txmq.* keys); only brokerPermission changes live. Nothing was changed.")
    if "brokerPermission" not in props:
        return cmd.response(ResponseCode.SUCCESS)       # an empty body, as RocketMQ: nothing to change
    value = props["brokerPermission"]
    perm = int(value) if value.lstrip("-").isdigit() and len(value) < 12 else None
    if perm not in PERMISSIONS:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"brokerPermission={value[:100]} is not one of 6 "
                            "(read-write), 4 (read-only), 2 (write-only), 0. Nothing was changed.")
    async with ctx.config_lock:     # two changes at once: the one saved last is the one in force
        if perm == ctx.broker_permission:
            return cmd.response(ResponseCode.SUCCESS)
        try:
            await asyncio.to_thread(live_config.write, os.path.join(ctx.config.store_dir, "config"),
                                    {"brokerPermission": perm})
        except OSError as exc:
            return cmd.response(ResponseCode.SYSTEM_ERROR, f"brokerPermission={perm} could not be saved, so it "
                                f"would not survive a restart: {exc}. Nothing was changed.")
        log.warning("broker permission %s -> %s (%d -> %d), by %s:%s; saved, kept across restarts",
                    PERMISSIONS[ctx.broker_permission], PERMISSIONS[perm], ctx.broker_permission, perm, *conn.peer)
        ctx.broker_permission = perm
        ctx.config_version += 1
        ctx.topics.routes_changed()
    return cmd.response(ResponseCode.SUCCESS)
