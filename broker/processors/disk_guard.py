"""Write requests on a full disk: refused at the door, before any file is touched.

Above ``disk_refuse_ratio`` (the store's DiskMonitor says ``refusing``) a request that
would write -- a send, a batch, a half message, an END_TRANSACTION, a send-back, an
operator's resolve or resume (903, a stock admin's 323) -- is answered SERVICE_NOT_AVAILABLE with RocketMQ's words
and how full the disk is, before its processor runs: no topic is auto-created, no record
encoded, nothing queued. A oneway request (stock clients send END_TRANSACTION oneway)
gets no answer, as in RocketMQ; its transaction is checked again later. A SLAVE refuses the same
requests the same way, always (its log is its master's copy). Reads -- pulls,
offsets, routes, admin views, metrics -- never pass through here.

A broker made read-only (updateBrokerConfig brokerPermission=4) refuses new messages (sends, batches,
send-backs) NO_PERMISSION, as RocketMQ's send-back does; the Java producer and txmq's retry NO_PERMISSION
on another broker. RocketMQ's send refuses only order topics so and stores the rest; here none is
stored, so a producer with an old route cannot keep writing to a broker taken out for maintenance.
END_TRANSACTION and replies still pass: they finish what was begun.
"""
from __future__ import annotations

from protocol.codes import Perm, ResponseCode
from protocol.codes import RequestCode as R

WRITES = frozenset({R.SEND_MESSAGE, R.SEND_MESSAGE_V2, R.SEND_BATCH_MESSAGE, R.CONSUMER_SEND_MSG_BACK,
                    R.SEND_REPLY_MESSAGE, R.SEND_REPLY_MESSAGE_V2,
                    R.END_TRANSACTION, R.TXMQ_RESOLVE_TRANSACTION, R.TXMQ_RESUME_TRANSACTION,
                    R.RESUME_CHECK_HALF_MESSAGE})


NEW_MESSAGES = frozenset({R.SEND_MESSAGE, R.SEND_MESSAGE_V2, R.SEND_BATCH_MESSAGE, R.CONSUMER_SEND_MSG_BACK})


def guard_writes(table: dict) -> dict:
    """The table with each write handler wrapped by the disk check (a no-op attribute read when not full)."""
    return {code: _guarded(fn, code in NEW_MESSAGES) if code in WRITES else fn for code, fn in table.items()}


def slave_refusal(ctx, cmd):
    """A SLAVE takes no writes from clients (RocketMQ: the store answers SERVICE_NOT_AVAILABLE to a put, the
    END_TRANSACTION processor SLAVE_NOT_AVAILABLE); a oneway request gets no answer."""
    if cmd.is_oneway:
        return None
    if cmd.code == R.END_TRANSACTION:
        return cmd.response(ResponseCode.SLAVE_NOT_AVAILABLE, "Message store is slave mode, so end transaction "
                                                              "is forbidden.")
    used = ctx.store.disk.ratio * 100 if ctx.store is not None else 0.0
    return cmd.response(ResponseCode.SERVICE_NOT_AVAILABLE,
                        "service not available now. It may be caused by one of the following reasons: the "
                        f"broker's disk is full [CL: {used:5.2f}], messages are put to the slave, message store "
                        "has been shut down, etc. (this broker's role is SLAVE: send to its master)")


def _guarded(fn, new_message: bool):
    def handle(ctx, conn, cmd):
        if ctx.config.broker_role == "SLAVE":
            return slave_refusal(ctx, cmd)
        if new_message and not ctx.broker_permission & Perm.WRITE:
            return None if cmd.is_oneway else cmd.response(
                ResponseCode.NO_PERMISSION,
                f"the broker[{ctx.broker_addr.rpartition(':')[0]}] sending message is forbidden")
        store = ctx.store
        if store is not None and store.disk.refusing and store.disk.still_refusing():
            remark = store.disk.refuse()
            return None if cmd.is_oneway else cmd.response(ResponseCode.SERVICE_NOT_AVAILABLE, remark)
        return fn(ctx, conn, cmd)
    handle.__name__ = handle.__qualname__ = getattr(fn, "__name__", "handle")
    handle.__wrapped__ = fn
    return handle
