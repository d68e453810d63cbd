"""Request processors: one module a request family, each handler ``(ctx, conn, cmd)``.

A handler returns a RemotingCommand, None (nothing to send), or an awaitable of
either. ``broker_table`` and ``namesrv_table`` map request codes to handlers;
codes without one are answered REQUEST_CODE_NOT_SUPPORTED, as RocketMQ's admin
processor does.
"""
from __future__ import annotations

from protocol.codes import RequestCode as R

from . import (admin, broker_config, client, forward, kv, namesrv, offsets, ops, pull, query, query_cq, reply, send,
               stats, transaction)
from .disk_guard import guard_writes


def broker_table() -> dict:
    return guard_writes({
        R.SEND_MESSAGE: send.handle_send, R.SEND_MESSAGE_V2: send.handle_send,
        R.SEND_BATCH_MESSAGE: send.handle_batch, R.CONSUMER_SEND_MSG_BACK: send.handle_send_back,
        R.SEND_REPLY_MESSAGE: reply.handle_reply, R.SEND_REPLY_MESSAGE_V2: reply.handle_reply,
        R.PULL_MESSAGE: ops.consume_guard(pull.handle_pull),
        R.QUERY_CONSUMER_OFFSET: offsets.query_consumer_offset,
        R.UPDATE_CONSUMER_OFFSET: offsets.update_consumer_offset,
        R.GET_ALL_CONSUMER_OFFSET: offsets.get_all_consumer_offset,
        R.GET_MAX_OFFSET: offsets.get_max_offset, R.GET_MIN_OFFSET: offsets.get_min_offset,
        R.SEARCH_OFFSET_BY_TIMESTAMP: offsets.search_offset_by_timestamp,
        R.GET_EARLIEST_MSG_STORETIME: offsets.get_earliest_msg_storetime,
        R.HEART_BEAT: client.heart_beat, R.UNREGISTER_CLIENT: client.unregister_client,
        R.GET_CONSUMER_LIST_BY_GROUP: client.get_consumer_list_by_group,
        R.CHECK_CLIENT_CONFIG: client.check_client_config,
        R.LOCK_BATCH_MQ: client.lock_batch_mq, R.UNLOCK_BATCH_MQ: client.unlock_batch_mq,
        R.UPDATE_AND_CREATE_TOPIC: admin.update_and_create_topic,
        R.VIEW_MESSAGE_BY_ID: admin.view_message_by_id,
        R.GET_ALL_TOPIC_CONFIG: admin.get_all_topic_config,
        R.GET_BROKER_CONFIG: broker_config.get_broker_config,
        R.UPDATE_BROKER_CONFIG: broker_config.update_broker_config,
        R.END_TRANSACTION: transaction.end_transaction,
        R.TXMQ_LIST_TRANSACTIONS: transaction.list_transactions,
        R.TXMQ_RESOLVE_TRANSACTION: transaction.resolve_transaction,
        R.TXMQ_RESUME_TRANSACTION: transaction.resume_transaction,
        R.RESUME_CHECK_HALF_MESSAGE: transaction.resume_check_half_message,
        R.TXMQ_APPLY_EXPIRY: transaction.apply_expiry,
        # Query and operations (processors/query.py, processors/ops.py)
        R.QUERY_MESSAGE: query.query_message,
        R.QUERY_CONSUME_QUEUE: query_cq.query_consume_queue,
        R.INVOKE_BROKER_TO_RESET_OFFSET: ops.reset_offset,
        R.CLONE_GROUP_OFFSET: ops.clone_group_offset,
        R.GET_CONSUME_STATS: ops.get_consume_stats,
        R.GET_BROKER_CONSUME_STATS: ops.get_broker_consume_stats,
        R.GET_CONSUMER_CONNECTION_LIST: ops.get_consumer_connection_list,
        R.GET_PRODUCER_CONNECTION_LIST: ops.get_producer_connection_list,
        R.GET_ALL_PRODUCER_INFO: ops.get_all_producer_info,
        R.GET_CONSUMER_RUNNING_INFO: forward.get_consumer_running_info,
        R.CONSUME_MESSAGE_DIRECTLY: forward.consume_message_directly,
        R.INVOKE_BROKER_TO_GET_CONSUMER_STATUS: forward.invoke_broker_to_get_consumer_status,
        R.GET_TOPIC_STATS_INFO: ops.get_topic_stats_info,
        R.GET_BROKER_RUNTIME_INFO: ops.get_broker_runtime_info,
        R.GET_ALL_DELAY_OFFSET: ops.get_all_delay_offset,
        R.VIEW_BROKER_STATS_DATA: stats.view_broker_stats_data,
        R.QUERY_TOPIC_CONSUME_BY_WHO: ops.query_topic_consume_by_who,
        R.QUERY_CONSUME_TIME_SPAN: ops.query_consume_time_span,
        R.QUERY_CORRECTION_OFFSET: ops.query_correction_offset,
        R.GET_ALL_SUBSCRIPTIONGROUP_CONFIG: ops.get_all_subscription_group,
        R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP: ops.update_and_create_subscription_group,
        R.DELETE_SUBSCRIPTIONGROUP: ops.delete_subscription_group,
        R.DELETE_TOPIC_IN_BROKER: ops.delete_topic_in_broker,
        # Stock clients ask the broker for routes too when it is their only address.
        R.GET_ROUTEINFO_BY_TOPIC: namesrv.get_route_info,
        R.GET_BROKER_CLUSTER_INFO: namesrv.get_broker_cluster_info,
        R.GET_SYSTEM_TOPIC_LIST_FROM_BROKER: namesrv.get_system_topic_list_from_broker,
    })


def namesrv_table() -> dict:
    return {
        R.GET_ROUTEINFO_BY_TOPIC: namesrv.get_route_info,
        R.GET_BROKER_CLUSTER_INFO: namesrv.get_broker_cluster_info,
        R.GET_ALL_TOPIC_LIST_FROM_NAMESERVER: namesrv.get_all_topic_list,
        R.REGISTER_BROKER: namesrv.register_broker,
        R.DELETE_TOPIC_IN_NAMESRV: namesrv.delete_topic_in_namesrv,
        R.GET_TOPICS_BY_CLUSTER: namesrv.get_topics_by_cluster,
        R.GET_SYSTEM_TOPIC_LIST_FROM_NS: namesrv.get_system_topic_list_from_ns,
        R.WIPE_WRITE_PERM_OF_BROKER: namesrv.wipe_write_perm,
        R.ADD_WRITE_PERM_OF_BROKER: namesrv.add_write_perm,
        **kv_table(),
    }


def kv_table() -> dict:
    """The KV config codes, answered by both name servers (``ctx.kv``)."""
    return {R.PUT_KV_CONFIG: kv.put_kv_config, R.GET_KV_CONFIG: kv.get_kv_config,
            R.DELETE_KV_CONFIG: kv.delete_kv_config, R.GET_KVLIST_BY_NAMESPACE: kv.get_kvlist_by_namespace}
