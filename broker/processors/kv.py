"""The name server's KV config requests (RocketMQ's DefaultRequestProcessor), for both name servers: ``ctx.kv``
is a broker.kv_config.KvConfig.

PUT_KV_CONFIG (100) {namespace, key, value}, DELETE_KV_CONFIG (102) {namespace, key}: SUCCESS once the file is
written (SYSTEM_ERROR saying so when it cannot be). GET_KV_CONFIG (101) {namespace, key}: SUCCESS with the
``value`` field, or QUERY_NOT_FOUND "No config item, Namespace: N Key: K". GET_KVLIST_BY_NAMESPACE (219)
{namespace}: a KVTable body {"table":{key: value}}, or QUERY_NOT_FOUND "No config item, Namespace: N".
"""
from __future__ import annotations

import logging

from protocol.codes import ResponseCode

from ..kv_config import MAX_BYTES, dump_in_slices

log = logging.getLogger("txmq.kvconfig")


async def put_kv_config(ctx, conn, cmd):
    namespace, key = cmd.str_field("namespace", required=True), cmd.str_field("key", required=True)
    value = cmd.str_field("value", required=True)
    if not ctx.kv.put(namespace, key, value):
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"{namespace} {key} not set: the KV config would hold more "
                                                       f"than {MAX_BYTES} bytes of keys and values")
    log.info("KV config %s %s = %.200s, by %s:%s", namespace, key, value, *conn.peer)
    return await _saved(ctx, cmd, f"{namespace} {key} set")


async def delete_kv_config(ctx, conn, cmd):
    namespace, key = cmd.str_field("namespace", required=True), cmd.str_field("key", required=True)
    if not ctx.kv.delete(namespace, key):
        return cmd.response(ResponseCode.SUCCESS)            # RocketMQ: nothing to delete is not an error
    log.info("KV config %s %s deleted by %s:%s", namespace, key, *conn.peer)
    return await _saved(ctx, cmd, f"{namespace} {key} deleted")


def get_kv_config(ctx, conn, cmd):
    namespace, key = cmd.str_field("namespace", required=True), cmd.str_field("key", required=True)
    value = ctx.kv.get(namespace, key)
    if value is None:
        return cmd.response(ResponseCode.QUERY_NOT_FOUND, f"No config item, Namespace: {namespace} Key: {key}")
    return cmd.response(ResponseCode.SUCCESS, ext_fields={"value": value})


async def get_kvlist_by_namespace(ctx, conn, cmd):
    namespace = cmd.str_field("namespace", required=True)
    if not ctx.kv.table.get(namespace):
        return cmd.response(ResponseCode.QUERY_NOT_FOUND, f"No config item, Namespace: {namespace}")
    # (a slice of keys a turn of the loop: kv_config.KEY_SLICE; the namespace as it was when the answer began)
    with ctx.kv.frozen(namespace) as table:
        body = await dump_in_slices({"table": table[namespace]}, conn)
    return cmd.response(ResponseCode.SUCCESS, body=body.encode())


async def _saved(ctx, cmd, done: str):
    try:
        await ctx.kv.save()     # (a failure is logged, and the save retried until it is done)
    except OSError as exc:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"{done} but not saved (retried until it is): {exc}")
    return cmd.response(ResponseCode.SUCCESS)
