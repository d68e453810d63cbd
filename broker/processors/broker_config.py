"""GET_BROKER_CONFIG (26): mqadmin getBrokerConfig, exportConfigs, the dashboard's broker config view.

RocketMQ answers its configuration as Properties text, ``key=value`` a line (MixAll.properties2String), with
the configuration's data version as the ``version`` field. txmq writes RocketMQ's name for each setting that
means the same thing, then every setting of its own as ``txmq.<name>`` (what ``python -m broker --help``
lists), so the tool shows the whole configuration. Settings are fixed at start: the version stays
{"counter":0,"timestamp":<start>}, and UPDATE_BROKER_CONFIG (25) is not supported.
"""
from __future__ import annotations

import dataclasses

from protocol.admin_bodies import dump
from protocol.codes import ResponseCode


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
        "haListenPort": c.ha_port, "haMasterAddress": c.ha_master_addr, "slaveReadEnable": c.slave_read_enable,
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
    version = dump({"counter": 0, "timestamp": ctx.started_ms})
    return cmd.response(ResponseCode.SUCCESS, ext_fields={"version": version}, body=properties_text(ctx).encode())
