"""TransactionProducer: half message, local transaction, decision; answers the broker's checks.

The flow is RocketMQ's (spec 8.1): send the half message (sysFlag PREPARED,
TRAN_MSG=true, PGROUP); only if it is stored, run the listener's local
transaction; then END_TRANSACTION with its outcome. Against txmq the END is a
request that the broker acknowledges, retried until it is, so a lost END does
not wait for a check. A broker that never answers END (Apache RocketMQ answers
nothing for UNKNOWN, and older ones nothing at all) is detected on the first
timeout, and END goes oneway, as the Java client sends it; every
``end_probe_interval_s`` one END is sent as a request again, so a timeout that
was only a slow moment (or a broker upgraded meanwhile) does not cost the
acknowledgement for the rest of the producer's life.
"""
from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from protocol.codes import LanguageCode, RequestCode, ResponseCode, SysFlag
from protocol.command import RemotingCommand, _field_text
from protocol.connection import finish_within, jittered
from protocol.errors import ConnectionClosedError, HeaderError, RequestTimeoutError, ResponseError, error_for_code
from protocol.message import MessageExt, Prop, decode_offset_msg_id, decode_record

from .producer import Producer, SendResult, SendStatus, _accepted

log = logging.getLogger("txmq.producer")


class LocalTransactionState(enum.Enum):
    """A local transaction's outcome (RocketMQ's spelling, UNKNOW included): the decision sent."""

    COMMIT_MESSAGE = SysFlag.TRANSACTION_COMMIT
    ROLLBACK_MESSAGE = SysFlag.TRANSACTION_ROLLBACK
    UNKNOW = SysFlag.TRANSACTION_NOT_TYPE


class TransactionListener(Protocol):
    """Your side of a transaction. Either method may be a plain function or a coroutine function;
    anything but a ``LocalTransactionState`` (or an exception) counts as ``UNKNOW``."""

    def execute_local_transaction(self, msg: MessageExt, arg: Any) -> "LocalTransactionState | Awaitable[LocalTransactionState]":
        """Run the local transaction for ``msg`` (its half message is stored) and say how it ended."""

    def check_local_transaction(self, msg: MessageExt) -> "LocalTransactionState | Awaitable[LocalTransactionState]":
        """The broker asks about an undecided transaction: look up its outcome (e.g. by ``msg.keys``)."""


@dataclass(slots=True)
class TransactionSendResult:
    """What ``send_in_transaction`` did: the half message's send result, the decision sent, and
    whether the broker acknowledged recording it (False: sent oneway, or not acknowledged; the
    broker's check-back then settles it)."""

    send_result: SendResult
    state: LocalTransactionState
    acknowledged: bool
    end_error: ResponseError | None = None      # the broker refused the decision outright (it checks back)


async def _call(fn, *args):
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


_STATE_TEXT = {s: _field_text(s.value) for s in LocalTransactionState}    # commitOrRollback, as sent
# END refusals that pass (disk over its watermark, the writer's queue full): the transaction stays pending on
# the broker, so END is retried as a lost one is, and past the retries the check-back settles it
_REFUSED_FOR_NOW = (ResponseCode.SERVICE_NOT_AVAILABLE, ResponseCode.SYSTEM_BUSY)


def _end_command(fields: dict[str, str], remark: str | None) -> RemotingCommand:
    """END_TRANSACTION with ``fields`` already text: what RemotingCommand.request makes, without its pass
    over the fields."""
    return RemotingCommand(RequestCode.END_TRANSACTION, language=LanguageCode.PYTHON, remark=remark,
                           ext_fields=dict(fields))


# A listener's answer that is no LocalTransactionState, and an ask past max_checks_at_once, are said at most this
# often (with how many went unsaid)
STATE_SAID_EVERY_S = 60.0
# Checks (check_local_transaction calls) one producer runs at once by default: a stock Java producer's
# checkRequestHoldMax (2000), past which it drops the broker's asks
MAX_CHECKS_AT_ONCE = 2000


class _SaidEvery:
    """One thing said at most every STATE_SAID_EVERY_S of ``clock``: ``due()`` is None while it is to go unsaid
    (counted), else how many went unsaid since the last said."""

    __slots__ = ("clock", "said_at", "unsaid")

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.said_at: float | None = None
        self.unsaid = 0

    def due(self) -> int | None:
        now = self.clock()
        if self.said_at is not None and now - self.said_at < STATE_SAID_EVERY_S:
            self.unsaid += 1
            return None
        unsaid, self.said_at, self.unsaid = self.unsaid, now, 0
        return unsaid


class _EndBackoff:
    """The pauses between END attempts: 0.05 s doubling up to 1 s, none after the last. Unspread, every producer
    whose ENDs failed at one instant (their broker restarted) retried in the same ticks, 0.05, 0.15, 0.35 s on.
    Each attempt is spread at random over the second half of its unspread wait (``jittered``) and never later than
    unspread: what a pause fell short by is waited at the next. Each pause spread alone shortened the whole
    budget by up to half (3 retries: 0.35 s down to 0.175 s, a broker back at 0.22 s got none of them); now by at
    most half the last pause (0.25 s)."""

    __slots__ = ("delay", "owed")

    def __init__(self) -> None:
        self.delay = 0.05
        self.owed = 0.0

    async def pause(self, attempt: int, retries: int) -> None:
        if attempt < retries:
            spread = jittered(self.delay)
            await asyncio.sleep(self.owed + spread)
            self.owed = self.delay - spread
        self.delay = min(self.delay * 2, 1.0)


class TransactionProducer(Producer):
    """A producer of transactional messages: half message, ``listener``'s local transaction, decision.

    ``end_retries`` / ``end_timeout``: how often and how long an END_TRANSACTION request is tried.
    ``end_probe_interval_s``: while ENDs go oneway (the broker did not acknowledge one), how often one is
    sent as a request again to find out whether acknowledgements are back. ``shutdown_grace_s``: how long
    shutdown waits for the broker's checks being answered (see ``shutdown``); ``abandon_after_s``: how long a
    check cancelled past that grace may still take to end before it is given up on (a
    ``check_local_transaction`` that swallows CancelledError). Other keywords: ``Producer``, but
    ``route_forget_after_s`` is None unless given: routes are kept for good, so a broker away for hours still
    gets the group's heartbeats once back, and checks its undecided transactions. ``max_checks_at_once``: how many
    of the broker's checks (``check_local_transaction`` calls) run at once; an ask past them is not taken
    (``checks_refused``, said at most every minute) and the broker asks again later, as a stock Java producer drops
    the asks past its checkRequestHoldMax (2000).
    """

    def __init__(self, namesrv_addr: str, group: str, listener: TransactionListener, *,
                 end_retries: int = 5, end_timeout: float = 3.0, end_probe_interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, shutdown_grace_s: float = 5.0,
                 abandon_after_s: float = 5.0, max_checks_at_once: int = MAX_CHECKS_AT_ONCE, **kwargs: Any):
        if shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s={shutdown_grace_s!r}: 0 or more seconds")
        if not abandon_after_s > 0:     # 0 would give up on every check before its cancel was even delivered
            raise ValueError(f"abandon_after_s={abandon_after_s!r}: more than 0 seconds")
        if not (type(max_checks_at_once) is int and max_checks_at_once > 0):     # 0 would answer no check ever
            raise ValueError(f"max_checks_at_once={max_checks_at_once!r}: a whole number, 1 or more")
        # Its routes kept for good (as the Java client keeps them), unless told otherwise: its heartbeats are what
        # let a broker check its undecided transactions, and a broker away past route_forget_after_s (its routes
        # forgotten, unregistered) got none once back: its half messages unchecked until dead-lettered.
        kwargs.setdefault("route_forget_after_s", None)
        super().__init__(namesrv_addr, group, **kwargs)
        self.listener = listener
        self.end_retries = end_retries
        self.end_timeout = end_timeout
        self.end_probe_interval_s = end_probe_interval_s
        self.end_acknowledged: bool | None = None     # None until a broker has shown which it does
        self._clock = clock
        self._oneway_since = 0.0                      # clock() when ENDs went oneway (or were last probed)
        self._check_tasks: set[asyncio.Task] = set()
        # The check call in hand for each transaction, by (broker address, msgId), or (broker address, half's
        # commit-log offset) for an ask that names no msgId. Not by both: Apache RocketMQ writes the half again
        # before each check (putBackHalfMsgQueue), so each of its asks names a new offset for the same msgId; a
        # broker whose store was replaced asking about another half at the same offset names another msgId. When
        # the broker asks again (each interval while unanswered) the ask is left to that call: each ask of a
        # check_local_transaction that hung (awaiting a database that is down) started one more beside it.
        self._checking: dict[tuple[str, int | str], float] = {}    # -> clock() when its call began
        self._overlap_said: set[tuple[str, int | str]] = set()     # those whose call was said to be still running
        # The last ask left to each call in hand: its END names the half that ask named (Apache RocketMQ's copy
        # written last, the one it asks about next; answered for the first copy, the last was asked about and
        # committed again: the message delivered twice)
        self._last_ask: dict[tuple[str, int | str], RemotingCommand] = {}
        self.checks_overlapped = 0          # asks left to the call in hand for their transaction (said once each)
        # Listener answers that were no LocalTransactionState (a forgotten return: None), taken as UNKNOW. Unsaid, a
        # listener that never returned one left every transaction to checks that never decided it either, until the
        # broker dead-lettered it: the local transaction done, its message never delivered, nothing in this log.
        self.states_not_understood = 0
        self._state_said = _SaidEvery(clock)
        # Checks in hand are bounded: each ask about another transaction started one more call, however many hung
        # (a database down), each holding its decoded half, body and all; a broker that bounds nothing (Apache
        # RocketMQ asks about every undecided half each interval) had the producer hold one for each of them.
        self.max_checks_at_once = max_checks_at_once
        self.checks_refused = 0             # asks not taken: max_checks_at_once calls were running
        self._refused_said = _SaidEvery(clock)
        self.shutdown_grace_s = shutdown_grace_s
        # The transactions whose execute_local_transaction runs here, by msgId (UNIQ_KEY, as the broker's asks name
        # them): -> clock() when each began (a UNIQ_KEY the caller gives may be given twice: by key alone, the first
        # to end forgot the other). A check about one is not run (see _on_request).
        self._local: dict[str, list[float]] = {}
        self.checks_during_local = 0        # asks about a transaction whose local transaction was still running
        self._during_local_said = _SaidEvery(clock)
        # A check cancelled by shutdown that has not ended this long after (it caught the CancelledError and
        # went on) is given up on: waited for, it held shutdown for ever. Its transaction is asked about again.
        self.abandon_after_s = abandon_after_s
        self._abandoned: set[asyncio.Task] = set()      # checks given up on: they send no END when they end

    def _state(self, value, method: str, msg_id: str) -> LocalTransactionState:
        """The listener's answer ``value`` (of ``method``, for ``msg_id``); anything else is UNKNOW, counted and said
        (a WARNING at most every STATE_SAID_EVERY_S, naming how many went unsaid)."""
        if isinstance(value, LocalTransactionState):
            return value
        self.states_not_understood += 1
        unsaid = self._state_said.due()
        if unsaid is not None:
            log.warning("producer %s: %s returned %.100r for %s, not a LocalTransactionState: taken as UNKNOW (the "
                        "broker checks back; a transaction no check decides is dead-lettered, its message never "
                        "delivered)%s", self.group, method, value, msg_id,
                        f"; {unsaid} more such answer(s) since the last said" if unsaid else "")
        return LocalTransactionState.UNKNOW

    # Accepted (and waited for by shutdown) as a whole, not only while its half is sent: shutdown begun during the
    # local transaction closed the connections, and its END went nowhere (the decision left to a check-back that
    # no producer of the group may be there to answer).
    @_accepted
    async def send_in_transaction(self, topic: str, body: bytes, arg: Any = None, *, tags: str | None = None,
                                  keys: str | list[str] | None = None,
                                  properties: dict[str, str] | None = None) -> TransactionSendResult:
        """Send ``body`` as a half message, run the listener's local transaction, send its decision.

        The local transaction runs only when the half message is stored (SEND_OK); an exception in it
        is UNKNOW (the broker checks back later). ``arg`` is passed to the listener as is.
        """
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
            began = self._clock()
            self._local.setdefault(result.msg_id, []).append(began)
            self._sends_moved_on()
            try:
                state = self._state(await _call(self.listener.execute_local_transaction, msg, arg),
                                    "execute_local_transaction", result.msg_id)
            except Exception as exc:  # noqa: BLE001 - an exception is UNKNOW, as in the Java client
                log.warning("local transaction of %s raised: %s", result.msg_id, exc)
                state = LocalTransactionState.UNKNOW
                remark = f"executeLocalTransactionBranch exception: {exc}"
            finally:
                running = self._local[result.msg_id]
                running.remove(began)
                if not running:
                    del self._local[result.msg_id]
        # The broker that stored the half, not whatever the route says now: with several brokers (or a
        # route refreshed meanwhile) only that one holds the half and can decide it.
        addr = result.broker_addr or self._addr(result.queue)
        try:
            _, _, half_offset = decode_offset_msg_id(result.offset_msg_id)
        except HeaderError as exc:
            # END names the half by its commit-log offset. Raised, it read as a failed send after the local
            # transaction had run (a caller retrying ran it again): returned, and said, as the Java client does.
            log.warning("END_TRANSACTION (%s) for %s not sent: broker %s stored the half but %s; the broker will "
                        "check back", state.name, result.msg_id, addr, exc)
            return TransactionSendResult(result, state, False)
        try:
            acked = await self._end(addr, half_offset, result.queue_offset, result.msg_id, state, False, remark)
        except ResponseError as exc:
            if exc.code == ResponseCode.TRANSACTION_FAILED:
                # decided already, the other way (a check answered first) or dead-lettered: no check-back will
                # come, and a result beside the local state would read as done as the local transaction says
                raise error_for_code(exc.code, f"{exc.remark}: the local transaction of {result.msg_id} ran "
                                     f"({state.name}), the broker's decision stands, no check-back will come") from exc
            # Raised, it read as a failed send: the half is stored and the local transaction has run, and a caller
            # retrying ran it again. Returned, and said, as the Java client does; the check-back settles it.
            log.warning("END_TRANSACTION (%s) for %s refused by %s: %s; the broker will check back", state.name,
                        result.msg_id, addr, exc)
            return TransactionSendResult(result, state, False, exc)
        return TransactionSendResult(result, state, acked)

    async def _end(self, addr: str, half_offset: int, table_offset: int, msg_id: str,
                   state: LocalTransactionState, from_check: bool, remark: str | None) -> bool:
        # The header fields as text at once (one dict, no per-field conversion), in request()'s order.
        fields = {"producerGroup": self.group, "tranStateTableOffset": str(table_offset),
                  "commitLogOffset": str(half_offset), "commitOrRollback": _STATE_TEXT[state],
                  "fromTransactionCheck": "true" if from_check else "false"}
        if msg_id is not None:
            fields["msgId"] = fields["transactionId"] = msg_id
        if self.end_acknowledged is False:
            if self._clock() - self._oneway_since < self.end_probe_interval_s:
                return await self._end_oneway(addr, fields, remark, msg_id)
            self.end_acknowledged = None            # probe: this END goes as a request again
            log.info("probing whether broker %s acknowledges END_TRANSACTION again", addr)
        backoff = _EndBackoff()
        for attempt in range(self.end_retries + 1):
            cmd = _end_command(fields, remark)
            try:
                conn = self.pool.cached(addr) or await self.pool.get(addr)
            except (RequestTimeoutError, ConnectionClosedError):
                if self.pool.closed:    # retried, it was refused as many times, the same way
                    log.warning("END_TRANSACTION (%s) for %s not sent: producer %s was shut down meanwhile; the "
                                "broker will check back (with another producer of the group running to answer)",
                                state.name, msg_id, self.group)
                    return False
                # connecting failed or timed out: no END reached the broker, so this says nothing about
                # whether it acknowledges one
                await backoff.pause(attempt, self.end_retries)
                continue
            try:
                # the connection's future, awaited here (as Producer._send_text does): no coroutine per layer
                resp = await conn.start_request(cmd, self.end_timeout)
            except RequestTimeoutError:
                if self.end_acknowledged is not True:     # unknown, or a concurrent END just found out
                    if self.end_acknowledged is None:
                        log.info("broker %s does not acknowledge END_TRANSACTION: sending it oneway for %.0f s",
                                 addr, self.end_probe_interval_s)
                        self.end_acknowledged = False
                        self._oneway_since = self._clock()
                    return await self._end_oneway(addr, fields, remark, msg_id)
                await backoff.pause(attempt, self.end_retries)
                continue
            except ConnectionClosedError:
                await backoff.pause(attempt, self.end_retries)
                continue
            if resp.code == ResponseCode.SUCCESS:
                self.end_acknowledged = True
                return True
            error = error_for_code(resp.code, resp.remark)
            if resp.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED:
                self.end_acknowledged = False
                self._oneway_since = self._clock()
                return False
            if resp.code not in _REFUSED_FOR_NOW:
                raise error
            log.info("END_TRANSACTION for %s refused for now: %s", msg_id, error)
            await backoff.pause(attempt, self.end_retries)
        log.warning("END_TRANSACTION for %s not acknowledged after %d attempts; the broker will check back",
                    msg_id, self.end_retries + 1)
        return False

    async def _end_oneway(self, addr: str, fields: dict[str, str], remark: str | None, msg_id: str) -> bool:
        """END oneway; False (unacknowledged) even when it cannot be sent: like any oneway END it may be lost,
        and the check-back settles the transaction. Raised, it failed a send whose half is stored and whose
        local transaction has run."""
        try:
            await self.pool.oneway(addr, _end_command(fields, remark))
        except (ConnectionClosedError, RequestTimeoutError) as exc:
            log.warning("END_TRANSACTION for %s could not be sent (%s); the broker will check back", msg_id, exc)
        return False

    # ------------------------------------------------------ broker's checks
    def _on_request(self, conn, cmd):
        if cmd.code != RequestCode.CHECK_TRANSACTION_STATE:
            return super()._on_request(conn, cmd)
        if self._stopping:      # oneway, nothing to answer: the broker asks again (this group's other producers)
            log.info("CHECK_TRANSACTION_STATE not taken: producer %s is shutting down", self.group)
            return None
        half_offset = cmd.int_field("commitLogOffset", 0)
        key = (f"{conn.peer[0]}:{conn.peer[1]}", cmd.str_field("msgId", "") or half_offset)
        began = self._checking.get(key)
        if began is not None:
            # left to the call in hand, which answers it; the first ask so is said, the rest only counted
            self._last_ask[key] = cmd
            self.checks_overlapped += 1
            if key not in self._overlap_said:
                self._overlap_said.add(key)
                log.warning("producer %s: check_local_transaction of %s (half at %d on %s) still running after "
                            "%.1f s; the broker's asks again are left to it (checks_overlapped)", self.group,
                            cmd.str_field("msgId", ""), half_offset, key[0], self._clock() - began)
            return None
        # An ask about a transaction whose local transaction runs here is answered at once, without the listener
        # (_asked_during_local): taken past the cap. Refused, it went unanswered, the broker took this producer for
        # silent and asked another of the group, whose listener (no outcome recorded yet) answered ROLLBACK; the
        # local transaction then committed, its END refused TRANSACTION_FAILED. (msgId: the half's UNIQ_KEY, as
        # txmq's and Apache RocketMQ's asks name it.)
        if len(self._checking) >= self.max_checks_at_once and cmd.str_field("msgId", "") not in self._local:
            self.checks_refused += 1
            unsaid = self._refused_said.due()
            if unsaid is not None:
                log.warning("producer %s: CHECK_TRANSACTION_STATE of %s (half at %d on %s) not taken: %d "
                            "check_local_transaction calls are running (max_checks_at_once; one that hangs?); the "
                            "broker asks again later (checks_refused)%s", self.group, cmd.str_field("msgId", ""),
                            half_offset, key[0], len(self._checking),
                            f"; {unsaid} more ask(s) not taken since the last said" if unsaid else "")
            return None
        self._checking[key] = self._clock()
        task = asyncio.get_running_loop().create_task(self._answer_check(conn, cmd, key))
        self._check_tasks.add(task)
        task.add_done_callback(self._check_tasks.discard)
        task.add_done_callback(lambda _t: self._check_ended(key))
        return None

    def _check_ended(self, key: tuple[str, int | str]) -> None:
        del self._checking[key]
        self._overlap_said.discard(key)
        self._last_ask.pop(key, None)

    async def _answer_check(self, conn, cmd, key=None) -> None:
        try:
            msg, _ = decode_record(cmd.body_bytes())
        except Exception as exc:  # noqa: BLE001 - a check we cannot read is left for the next one
            log.warning("unreadable CHECK_TRANSACTION_STATE: %s", exc)
            return
        group = msg.properties.get(Prop.PGROUP)
        if group and group != self.group:
            return
        remark = None
        msg_id = msg.properties.get(Prop.UNIQ_KEY) or cmd.str_field("msgId", "")
        running = self._local.get(msg_id)
        began = running[0] if running else None
        try:
            if began is not None:
                state, remark = LocalTransactionState.UNKNOW, self._asked_during_local(msg_id, began)
            else:
                state = self._state(await _call(self.listener.check_local_transaction, msg),
                                    "check_local_transaction", msg_id)
        except Exception as exc:  # noqa: BLE001 - an exception is UNKNOW, as in the Java client
            # said here as the local transaction's is: in the broker's remark alone, a bug answered UNKNOW at
            # every ask until the transaction was dead-lettered, nothing in this producer's log
            log.warning("check of %s raised %s: %s; answered UNKNOW (the broker asks again)", msg_id,
                        type(exc).__name__, exc)
            state = LocalTransactionState.UNKNOW
            remark = f"checkLocalTransactionState Exception: {exc}"
        if asyncio.current_task() in self._abandoned:   # the producer closed without it: no END on a new connection
            log.warning("producer %s: check of %s given up on at shutdown has ended; left unanswered, the broker "
                        "asks again", self.group, msg_id)
            return
        addr = f"{conn.peer[0]}:{conn.peer[1]}"
        cmd = self._last_ask.pop(key, cmd)      # the half the broker asked about last (see _last_ask)
        try:
            await self._end(addr, cmd.int_field("commitLogOffset", 0), cmd.int_field("tranStateTableOffset", 0),
                            msg_id, state, True, remark)
        except Exception as exc:  # noqa: BLE001 - the broker will ask again
            log.info("answer to check of %s failed: %s", msg_id, exc)

    def _asked_during_local(self, msg_id: str, began: float) -> str:
        """A check about ``msg_id``, whose local transaction (begun at ``began``) runs here still, past the broker's
        immunity: answered UNKNOW without asking check_local_transaction, counted and said; the remark sent. Asked,
        a check that looks the outcome up found none yet, and the usual answer for that (ROLLBACK: no order, no
        message) had the broker roll back a transaction whose local part then committed: the message never
        delivered, the END refused TRANSACTION_FAILED. The END decides it; the broker asks again if none comes."""
        self.checks_during_local += 1
        unsaid = self._during_local_said.due()
        if unsaid is not None:
            log.warning("producer %s: the broker asks about %s while its local transaction still runs here (%.1f s, "
                        "past the broker's check immunity): answered UNKNOW without check_local_transaction, the END "
                        "decides it (checks_during_local; a longer CHECK_IMMUNITY_TIME_IN_SECONDS on the half, or "
                        "the broker's transaction_timeout_ms, avoids the ask)%s", self.group, msg_id,
                        self._clock() - began, f"; {unsaid} more such ask(s) since the last said" if unsaid else "")
        return "the local transaction is still running in the producer"

    async def _wait_for_sends(self, idle: asyncio.Future) -> None:
        """Sends in transaction are waited for by shutdown as long as checks are, ``shutdown_grace_s``, while one is
        in its local transaction: an execute_local_transaction that hung (a database down) held shutdown, and the
        application's exit, for ever, nothing said. Past the grace, the sends in their half or their END (each
        bounded by send_timeout, end_retries) are waited for still: bounding them too, a shutdown with
        ``shutdown_grace_s=0`` between two attempts of an END refused for now closed the pool under it, the
        transaction committed locally and left undecided."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_grace_s
        while not idle.done():
            left = deadline - loop.time()
            # (the sends in their local transaction: each one's start in _local)
            if left <= 0 and self._sending <= sum(map(len, self._local.values())):
                log.warning("producer %s: %d send(s) in transaction still in their local transaction after %g s "
                            "(shutdown_grace_s; execute_local_transaction hung?): shutdown goes on without them; "
                            "their ENDs will not be sent, the broker checks back with the group's other producers",
                            self.group, self._sending, self.shutdown_grace_s)
                return
            if self._sends_moved is None:
                self._sends_moved = loop.create_future()
            await asyncio.wait([idle, self._sends_moved], timeout=left if left > 0 else None)

    async def shutdown(self) -> None:
        """Take no more checks, let those being answered finish (up to ``shutdown_grace_s``), then as
        ``Producer.shutdown``: a check answered meanwhile reaches the broker over a connection still open.
        A check still running after the grace period is cancelled; its transaction is asked about again.
        One that ignores its cancel for ``abandon_after_s`` more is given up on, with an error logged: shutdown
        completes without it, and when it ends at last it sends no answer. ``send_in_transaction`` calls begun
        before are waited for up to ``shutdown_grace_s`` as well (a local transaction that hangs is said, and
        left running: its END is not sent, and the broker checks back)."""
        self._stopping = True
        running = set(self._check_tasks)
        late = await finish_within(running, self.shutdown_grace_s)
        stuck: set[asyncio.Task] = set()
        if late:
            log.warning("producer %s: %d transaction check(s) still running after %g s (shutdown_grace_s): "
                        "cancelled; the broker will ask again", self.group, len(late), self.shutdown_grace_s)
            # A check_local_transaction that catches the CancelledError and goes on held us here for ever: bounded.
            _, stuck = await asyncio.wait(late, timeout=self.abandon_after_s)
            for task in stuck:
                self._abandoned.add(task)
                task.add_done_callback(self._abandoned.discard)
            if stuck:
                log.error("producer %s: %d transaction check(s) ignored their cancel for %g s (abandon_after_s): "
                          "given up on, still running, left unanswered (the broker asks again). "
                          "check_local_transaction must let CancelledError through.", self.group, len(stuck),
                          self.abandon_after_s)
        await asyncio.gather(*(t for t in running if t not in stuck), return_exceptions=True)
        await super().shutdown()
