"""TransactionProducer: half message, local transaction, decision; answers the broker's checks.

The flow is RocketMQ's (spec 8.1): send the half message (sysFlag PREPARED,
TRAN_MSG=true, PGROUP); only if it is stored, run the listener's local
transaction; then END_TRANSACTION with its outcome. Against txmq the END is a
request that the broker acknowledges, retried until it is, so a lost END does
not wait for a check. A broker that never answers END (Apache RocketMQ answers
nothing for UNKNOWN, and older ones nothing at all) is detected on the first
timeout, and from then on END goes oneway, as the Java client sends it.
"""
from __future__ import annotations

import asyncio
import enum
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from protocol.codes import RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand
from protocol.errors import ConnectionClosedError, RequestTimeoutError, error_for_code
from protocol.message import MessageExt, Prop, decode_offset_msg_id, decode_record

from .producer import Producer, SendResult, SendStatus

log = logging.getLogger("txmq.producer")


class LocalTransactionState(enum.Enum):
    COMMIT_MESSAGE = SysFlag.TRANSACTION_COMMIT
    ROLLBACK_MESSAGE = SysFlag.TRANSACTION_ROLLBACK
    UNKNOW = SysFlag.TRANSACTION_NOT_TYPE


class TransactionListener(Protocol):
    def execute_local_transaction(self, msg: MessageExt, arg: Any): ...

    def check_local_transaction(self, msg: MessageExt): ...


@dataclass(slots=True)
class TransactionSendResult:
    send_result: SendResult
    state: LocalTransactionState
    acknowledged: bool          # the broker confirmed it recorded the decision


async def _call(fn, *args):
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def _state(value) -> LocalTransactionState:
    if isinstance(value, LocalTransactionState):
        return value
    return LocalTransactionState.UNKNOW


class TransactionProducer(Producer):
    def __init__(self, namesrv_addr: str, group: str, listener: TransactionListener, *,
                 end_retries: int = 5, end_timeout: float = 3.0, **kwargs):
        super().__init__(namesrv_addr, group, **kwargs)
        self.listener = listener
        self.end_retries = end_retries
        self.end_timeout = end_timeout
        self.end_acknowledged: bool | None = None     # None until a broker has shown which it does
        self._check_tasks: set[asyncio.Task] = set()

    async def send_in_transaction(self, topic: str, body: bytes, arg: Any = None, *, tags: str | None = None,
                                  keys=None, properties: dict | None = None) -> TransactionSendResult:
        props = self.message_properties(tags, keys, properties)
        props.pop(Prop.DELAY, None)
        props[Prop.TRAN_MSG] = "true"
        props[Prop.PGROUP] = self.group
        result = await self._send(RequestCode.SEND_MESSAGE_V2, topic, body, props, None,
                                  sys_flag=SysFlag.TRANSACTION_PREPARED)
        msg = MessageExt(topic, body, queue_id=result.queue.queue_id, properties=props)
        if result.status is not SendStatus.SEND_OK:
            state = LocalTransactionState.ROLLBACK_MESSAGE      # stored but not safely: never run the transaction
            remark = None
        else:
            remark = None
            try:
                state = _state(await _call(self.listener.execute_local_transaction, msg, arg))
            except Exception as exc:  # noqa: BLE001 - an exception is UNKNOW, as in the Java client
                log.warning("local transaction of %s raised: %s", result.msg_id, exc)
                state = LocalTransactionState.UNKNOW
                remark = f"executeLocalTransactionBranch exception: {exc}"
        _, _, half_offset = decode_offset_msg_id(result.offset_msg_id)
        addr = self._addr(result.queue)
        acked = await self._end(addr, half_offset, result.queue_offset, result.msg_id, state, False, remark)
        return TransactionSendResult(result, state, acked)

    async def _end(self, addr: str, half_offset: int, table_offset: int, msg_id: str,
                   state: LocalTransactionState, from_check: bool, remark: str | None) -> bool:
        fields = {"producerGroup": self.group, "tranStateTableOffset": table_offset,
                  "commitLogOffset": half_offset, "commitOrRollback": state.value,
                  "fromTransactionCheck": from_check, "msgId": msg_id, "transactionId": msg_id}
        if self.end_acknowledged is False:
            await self.pool.oneway(addr, RemotingCommand.request(RequestCode.END_TRANSACTION, fields, remark=remark))
            return False
        delay = 0.05
        for attempt in range(self.end_retries + 1):
            cmd = RemotingCommand.request(RequestCode.END_TRANSACTION, fields, remark=remark)
            try:
                resp = await self.pool.request(addr, cmd, self.end_timeout)
            except RequestTimeoutError:
                if self.end_acknowledged is None:
                    log.info("broker %s does not acknowledge END_TRANSACTION: sending it oneway from now on", addr)
                    self.end_acknowledged = False
                    await self.pool.oneway(addr, RemotingCommand.request(RequestCode.END_TRANSACTION, fields,
                                                                         remark=remark))
                    return False
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            except ConnectionClosedError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if resp.code == ResponseCode.SUCCESS:
                self.end_acknowledged = True
                return True
            error = error_for_code(resp.code, resp.remark)
            if resp.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED:
                self.end_acknowledged = False
                return False
            raise error
        log.warning("END_TRANSACTION for %s not acknowledged after %d attempts; the broker will check back",
                    msg_id, self.end_retries + 1)
        return False

    # ------------------------------------------------------ broker's checks
    def _on_request(self, conn, cmd):
        if cmd.code != RequestCode.CHECK_TRANSACTION_STATE:
            return super()._on_request(conn, cmd)
        task = asyncio.get_running_loop().create_task(self._answer_check(conn, cmd))
        self._check_tasks.add(task)
        task.add_done_callback(self._check_tasks.discard)
        return None

    async def _answer_check(self, conn, cmd) -> None:
        try:
            msg, _ = decode_record(cmd.body_bytes())
        except Exception as exc:  # noqa: BLE001 - a check we cannot read is left for the next one
            log.warning("unreadable CHECK_TRANSACTION_STATE: %s", exc)
            return
        group = msg.properties.get(Prop.PGROUP)
        if group and group != self.group:
            return
        remark = None
        try:
            state = _state(await _call(self.listener.check_local_transaction, msg))
        except Exception as exc:  # noqa: BLE001
            state = LocalTransactionState.UNKNOW
            remark = f"checkLocalTransactionState Exception: {exc}"
        addr = f"{conn.peer[0]}:{conn.peer[1]}"
        msg_id = msg.properties.get(Prop.UNIQ_KEY) or cmd.str_field("msgId", "")
        try:
            await self._end(addr, cmd.int_field("commitLogOffset", 0), cmd.int_field("tranStateTableOffset", 0),
                            msg_id, state, True, remark)
        except Exception as exc:  # noqa: BLE001 - the broker will ask again
            log.info("answer to check of %s failed: %s", msg_id, exc)
