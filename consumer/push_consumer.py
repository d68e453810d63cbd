"""PushConsumer: RocketMQ's clustering push consumer over PullConsumer — rebalance, long-poll loops,
retries through the broker, periodic offset commits. At-least-once; see consumer/idempotent.py for once.

Each subscribed topic, and the group's %RETRY% topic, is split among the group's live consumers
(allocate_averagely over GET_CONSUMER_LIST_BY_GROUP, redone every ``rebalance_interval_s`` and when
the broker says the group changed). Each owned queue has one pull loop. A message whose listener
returns RECONSUME_LATER (or raises) goes back to the broker (CONSUMER_SEND_MSG_BACK), which
redelivers it through %RETRY%<group> and, after ``max_reconsume_times``, parks it in %DLQ%<group>.
If the broker cannot copy it (its record gone), the message as pulled is sent there instead
(PullConsumer.send_back); if the broker cannot take it back at all, it is retried here: a queue
never moves past a message that was neither consumed nor handed back.

Two RocketMQ modes beyond the default:
- ``orderly=True`` (MessageListenerOrderly): a queue is consumed only while this consumer holds the
  broker's lock on it (LOCK_BATCH_MQ, renewed every ``lock_interval_s``; trusted locally for
  ``lock_expire_s``, RocketMQ's 20 s and 30 s), one message at a time, and a failed message is retried
  here in place after ``suspend_s`` (handing it back would let later messages overtake it) until
  ``max_reconsume_times``, then goes to %DLQ%<group>. A crashed consumer's locks expire on the broker
  (queue_lock_max_live_ms, 60 s) and its queues move to the others.
- ``message_model="BROADCASTING"``: every consumer of the group reads every queue and keeps its own
  offsets in a local file (consumer/offset_store.py); a failed message is retried here and, after
  ``max_reconsume_times``, logged as dropped and counted (RocketMQ drops it at once).
"""
from __future__ import annotations

import asyncio
import enum
import inspect
import json
import logging
import time
from typing import Any, Callable

from protocol.admin_bodies import encode_consumer_running_info
from protocol.codes import ResponseCode
from protocol.connection import finish_within, jittered, wait_within
from protocol.errors import (BrokerError, ConnectionClosedError, ProtocolError, RequestTimeoutError, ResponseError,
                             TopicNotExistError)
from protocol.message import MAX_INFLATED_BODY, MessageExt, Prop
from protocol.signature import Credentials

from .offset_store import DEFAULT_DIR, BrokerOffsetStore, LocalOffsetStore
from .pull_consumer import (DEFAULT_MAX_RECONSUME_TIMES, MessageQueue, MessageSelector, PullConsumer, PullStatus,
                            as_selector, thread_stacks)
from .rebalance import allocate_averagely

_JAVA_INT_MAX = (1 << 31) - 1   # an orderly consumer's maxReconsumeTimes -1: retried in place for good


def _is_power_of_ten(n: int) -> bool:
    """1, 10, 100, ...: when a count that grows for good is said again."""
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1

# A heartbeat that could not reach a broker (it is down, or restarting) is tried again after this, doubling up to
# _BEAT_RETRY_MAX_S (never past rebalance_interval_s), as the producer's; and a beat a lost connection asks for comes
# no sooner than this after the last, so connections that keep breaking never make a reconnect storm.
_BEAT_RETRY_S = 0.5
_BEAT_RETRY_MAX_S = 4.0
# listener calls of messages handed directly (CONSUME_MESSAGE_DIRECTLY) at once; a Java consumer runs them on its
# clientCallbackExecutorThreads (as many as the cores)
MAX_DIRECT_AT_ONCE = 16
# characters of what a listener raised kept (CR_THROW_EXCEPTION's remark, the log): a whole str() of 17 MiB made a
# 309's answer a frame past the 16 MiB the broker reads, and the broker closed the connection, the pulls with it
MAX_RAISED_REMARK = 4096

log = logging.getLogger("txmq.consumer")


def _raised(exc: BaseException) -> str:
    """What a listener raised, as RemotingHelper.exceptionSimpleDesc names it (its type and message), at most
    MAX_RAISED_REMARK characters with how many there were; an exception whose str() itself raises is named by its
    type and what that raised, never raising again out of the listener's call (the pull loop's too)."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception as again:  # noqa: BLE001 - a listener's exception may do anything in __str__
        return f"{type(exc).__name__} (its str() raised {type(again).__name__})"
    if len(text) <= MAX_RAISED_REMARK:
        return text
    return f"{text[:MAX_RAISED_REMARK]}... ({len(text)} characters)"


class _LockLost(Exception):
    """An orderly queue's lock lapsed while a message waited to be retried."""


class _Stopping(Exception):
    """Shutdown began while a message waited to be retried or handed back: it is left unconsumed
    (its offset is not committed), for whoever consumes the queue next."""


class ConsumeStatus(enum.Enum):
    """A listener's verdict: consumed, or hand the message back for a later retry."""

    CONSUME_SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"


# consume_from -> the consumeFromWhere a heartbeat says (ConsumeFromWhere's names)
_CONSUME_FROM = {"first": "CONSUME_FROM_FIRST_OFFSET", "last": "CONSUME_FROM_LAST_OFFSET",
                 "timestamp": "CONSUME_FROM_TIMESTAMP"}


class PushConsumer:
    """Subscribe, and the consumer calls ``listener(msg)`` for every message (DefaultMQPushConsumer).

    ``listener`` (plain or async) returns a ``ConsumeStatus``; raising is RECONSUME_LATER.
    ``consume_from``: where a queue the group never consumed starts, ``"first"``, ``"last"`` or ``"timestamp"``
    (CONSUME_FROM_TIMESTAMP: the message the broker finds nearest ``consume_timestamp_ms``, by default half an hour
    before the consumer was made, as RocketMQ's consumeTimestamp);
    ``max_reconsume_times``: retries before %DLQ%<group>; ``orderly`` / ``message_model``: see the
    module's docstring. The intervals (seconds) set rebalancing, offset commits, long-poll time and
    queue locks. ``shutdown_grace_s``: how long shutdown lets listeners already running finish (see
    ``shutdown``); ``handover_grace_s``: the same when a rebalance gives a queue to another consumer (see
    ``rebalance``); ``abandon_after_s``: how long a call cancelled past either grace may still take to end
    before it is given up on (a listener that swallows CancelledError; see ``_abandon``). Use it as
    ``consumer.subscribe(topic)`` then ``async with consumer:`` (or ``await consumer.start()`` ...
    ``await consumer.shutdown()``).
    """

    def __init__(self, namesrv_addr: str, group: str, listener: Callable[[MessageExt], Any], *,
                 consume_from: str = "last", consume_timestamp_ms: int | None = None,
                 max_reconsume_times: int = 16, rebalance_interval_s: float = 20.0, suspend_ms: int = 15000,
                 offset_commit_interval_s: float = 5.0, local_retry_delay_s: float = 1.0,
                 credentials: Credentials | None = None,
                 orderly: bool = False, message_model: str = "CLUSTERING", instance_name: str | None = None,
                 offset_store_dir: str | None = None, lock_interval_s: float = 20.0, lock_expire_s: float = 30.0,
                 lock_retry_s: float = 1.0, suspend_s: float = 1.0, consume_timeout_s: float = 900.0,
                 shutdown_grace_s: float = 5.0, handover_grace_s: float = 5.0, abandon_after_s: float = 5.0,
                 max_inflated_body: int = MAX_INFLATED_BODY):
        for name, grace in (("shutdown_grace_s", shutdown_grace_s), ("handover_grace_s", handover_grace_s)):
            if grace < 0:
                raise ValueError(f"{name}={grace!r}: 0 or more seconds")
        if not abandon_after_s > 0:     # 0 would give up on every call before its cancel was even delivered
            raise ValueError(f"abandon_after_s={abandon_after_s!r}: more than 0 seconds")
        # 0 or less asked for the locks with no pause: 1,900 LOCK_BATCH_MQ a second to each broker from one consumer
        for name, period in (("lock_interval_s", lock_interval_s), ("lock_expire_s", lock_expire_s),
                             ("lock_retry_s", lock_retry_s)):
            if not period > 0:
                raise ValueError(f"{name}={period!r}: more than 0 seconds")
        # 0 or less retried a failed orderly or broadcasting message in place with no pause: 135,036 listener calls
        # a second on one queue, for good with max_reconsume_times=-1 (RocketMQ's orderly consumer waits 10 ms or more)
        if not suspend_s > 0:
            raise ValueError(f"suspend_s={suspend_s!r}: more than 0 seconds (a failed message is retried in place "
                             "after it; RocketMQ's suspendCurrentQueueTimeMillis, 1 s)")
        if lock_interval_s >= lock_expire_s:    # each lock lapsed here before its renewal: the queues stopped each time
            raise ValueError(f"lock_interval_s={lock_interval_s!r} must be below lock_expire_s={lock_expire_s!r}: a "
                             "lock is renewed every lock_interval_s and trusted lock_expire_s after its grant")
        if consume_from not in _CONSUME_FROM:
            # anything else was "last": started at the end and stored so (_anchor), the heartbeat saying FIRST
            raise ValueError(f"consume_from={consume_from!r}: \"first\", \"last\" or \"timestamp\"")
        if consume_timestamp_ms is not None and consume_from != "timestamp":
            raise ValueError(f"consume_timestamp_ms={consume_timestamp_ms!r} is read with consume_from=\"timestamp\" "
                             f"only, not {consume_from!r}")
        if consume_timestamp_ms is not None and (type(consume_timestamp_ms) is not int
                                                 or not 0 <= consume_timestamp_ms < 1 << 63):   # (a Java long)
            # sent as given: Java's "yyyyMMddHHmmss" string was read as milliseconds (centuries ahead, every new
            # queue started at its last message); a float was refused by the broker at every first pull
            raise ValueError(f"consume_timestamp_ms={consume_timestamp_ms!r}: milliseconds since the epoch, an int "
                             "of 0 or more, within a Java long (not Java's \"yyyyMMddHHmmss\" consumeTimestamp string: convert it, "
                             "e.g. int(datetime.strptime(s, \"%Y%m%d%H%M%S\").timestamp() * 1000))")
        if message_model not in ("CLUSTERING", "BROADCASTING"):
            raise ValueError(f"message_model={message_model!r}: CLUSTERING or BROADCASTING")
        self.group = group
        self.listener = listener          # listener(msg) -> ConsumeStatus, plain or async
        self.consume_from = consume_from  # where a queue with no committed offset starts: see _CONSUME_FROM
        # (RocketMQ's consumeTimestamp default: half an hour before the consumer was made, fixed then)
        self.consume_timestamp_ms = (int(time.time() * 1000) - 30 * 60_000 if consume_timestamp_ms is None
                                     else consume_timestamp_ms)
        if max_reconsume_times < -1:
            raise ValueError(f"max_reconsume_times={max_reconsume_times!r}: 0 or more, or -1 for the default")
        # -1 is RocketMQ's "default" (DefaultMQPushConsumer's own default): 16 retries when consumed
        # concurrently, Integer.MAX_VALUE when orderly (ConsumeMessage*Service.getMaxReconsumeTimes). Sent as
        # it was, the broker read -1 as "no retries left" and dead-lettered every failed message at once.
        if max_reconsume_times == -1:
            max_reconsume_times = _JAVA_INT_MAX if orderly else DEFAULT_MAX_RECONSUME_TIMES
        self.max_reconsume_times = max_reconsume_times
        self.rebalance_interval_s = rebalance_interval_s
        self.suspend_ms = suspend_ms
        self.offset_commit_interval_s = offset_commit_interval_s
        self.local_retry_delay_s = local_retry_delay_s
        self.pull_retry_delay_s = 3.0       # after a pull that failed (a broker error, or a bug, logged and counted)
        self.orderly = orderly
        self.message_model = message_model
        self.lock_interval_s = lock_interval_s
        self.lock_expire_s = lock_expire_s
        self.lock_retry_s = lock_retry_s
        self.suspend_s = suspend_s
        # An async listener still running after this is cancelled and its message retried (RocketMQ's
        # consumeTimeout, 15 min): one that never returns would hold its queue, with nothing said.
        self.consume_timeout_s = consume_timeout_s
        # Shutdown waits this long for listeners already running (RocketMQ's awaitTerminationMillisWhenShutdown);
        # 0 cancels them at once, and their messages come again.
        self.shutdown_grace_s = shutdown_grace_s
        # A queue a rebalance gives away waits this long for its listener call in hand (RocketMQ marks the
        # process queue dropped, and waits about 1 s for an orderly one before unlocking); 0 cancels it at once.
        self.handover_grace_s = handover_grace_s
        # A listener call cancelled past either grace that has not ended this long after (it caught the
        # CancelledError and went on) is given up on: waited for, it held shutdown or the hand-over for ever.
        self.abandon_after_s = abandon_after_s
        broadcasting = message_model == "BROADCASTING"
        # A broadcasting consumer's offsets file is found again by its client id, so that id must not
        # change between runs: RocketMQ keeps the instance name "DEFAULT" in this mode.
        self.client = PullConsumer(namesrv_addr, group, credentials=credentials,
                                   instance_name=instance_name or ("DEFAULT" if broadcasting else None),
                                   max_inflated_body=max_inflated_body)
        self.client.on_ids_changed = self._request_rebalance
        self.client.pool.on_lost = self._on_connection_lost
        self.client.on_reset_offset = self._on_reset_offset
        self.client.running_info = self._running_info
        self.client.consume_directly = self._consume_directly
        self.client.consumer_status = lambda topic: {(mq.topic, mq.broker_name, mq.queue_id): offset
                                                     for mq, offset in self._offsets.items() if mq.topic == topic}
        self._started_ms = 0              # wall-clock ms start() was called at (PROP_CONSUMER_START_TIMESTAMP)
        # queue -> wall-clock ms of its last pull answered and of its last message consumed (GET_CONSUMER_RUNNING_INFO)
        self._pulled_ms: dict[MessageQueue, int] = {}
        self._consumed_ms: dict[MessageQueue, int] = {}
        self._direct: set[asyncio.Task] = set()    # listener calls of CONSUME_MESSAGE_DIRECTLY running (shutdown)
        self.offset_store = (LocalOffsetStore(offset_store_dir or DEFAULT_DIR, self.client.client_id, group)
                             if broadcasting else BrokerOffsetStore(self.client))
        self.dropped = 0                  # broadcasting: messages given up after max_reconsume_times (logged)
        # orderly/broadcasting: queue -> (the pull loop retrying its message in place, its retries so far)
        self._held: dict[MessageQueue, tuple[asyncio.Task | None, int]] = {}
        self._owned: set[MessageQueue] = set()
        self._locks: dict[MessageQueue, float] = {}   # orderly: queue -> monotonic time of the last grant
        self._lock_changed = asyncio.Event()
        self._relock_now = asyncio.Event()            # orderly: locks were dropped (_on_broker_lost): ask at once
        # orderly: queues being handed over whose lock _on_broker_lost dropped: a connection that only broke left
        # it held on the broker, still released when the hand-over ends (its next owner need not wait for expiry)
        self._unlock_owed: set[MessageQueue] = set()
        # orderly: broker name -> connections to it lost so far: a lock granted over a connection lost before the
        # grant was acted on (its answer and its close read in one step) is not trusted (_lock_owned)
        self._losses: dict[str, int] = {}
        self.subscriptions: dict[str, str | MessageSelector] = {}
        self._loops: dict[MessageQueue, asyncio.Task] = {}
        self._offsets: dict[MessageQueue, int] = {}
        self._committed: dict[MessageQueue, int] = {}
        # The highest offset known stored for an owned queue (read at a loop's start, committed, reset): only
        # someone moving it back (an operator's reset this consumer was not told of) puts the stored one below.
        self._known_stored: dict[MessageQueue, int] = {}
        self._tasks: list[asyncio.Task] = []
        self._lock_task: asyncio.Task | None = None
        self._consuming: set[MessageQueue] = set()    # queues whose loop has a message in hand
        # Queues a rebalance gave away whose pull loop is finishing its message in hand (RocketMQ's dropped
        # process queue): no new pull, no new message; committed, then unlocked, once it is done.
        self._leaving: dict[MessageQueue, asyncio.Task] = {}
        self._handovers: set[asyncio.Task] = set()
        # Pull loops whose listener call ignored its cancel past abandon_after_s: no longer waited for, and
        # when the call ends at last they return at once, changing no offset (_listen, _pull_loop).
        self._abandoned: set[asyncio.Task] = set()
        # Queues whose loops reset_offsets stopped and starts again once the new offsets are written.
        self._resetting: set[MessageQueue] = set()
        # queues being handed over that an offset reset named -> its offset, what their hand-over commits
        self._reset_leaving: dict[MessageQueue, int] = {}
        self._stopping = False
        self.crashes = 0                  # background loops, or turns of them, that raised (each logged)
        self._rebalance_now = asyncio.Event()
        self._beat_now = False            # a connection was lost: heartbeat (then rebalance) at once
        # a rebalance was asked for (a group change, a loop to restart) rather than only a beat: told apart from a
        # lost connection's beat, which sets _rebalance_now as well
        self._rebalance_asked = False
        self.beats_failed = 0             # heartbeats in a row that could not reach a broker (0: all heard)
        self.locks_failed = 0             # orderly: lock renewals in a row that failed (0: the last succeeded)

    def subscribe(self, topic: str, expression: str | MessageSelector = "*") -> None:
        """Consume ``topic``, only tags in ``expression`` (``"a || b"``; ``"*"`` for all), or what a
        ``MessageSelector.by_sql(...)`` selects (checked with the brokers at start). Before start(). ValueError for
        a tag expression naming no tag (``" "``, ``"||"``): brokers refuse its pulls."""
        as_selector(expression)
        self.subscriptions[topic] = expression

    @property
    def retry_topic(self) -> str:
        """The group's retry topic, %RETRY%<group>."""
        return f"%RETRY%{self.group}"

    @property
    def broadcasting(self) -> bool:
        """True in BROADCASTING mode (every consumer reads every queue)."""
        return self.message_model == "BROADCASTING"

    def _topics(self) -> dict[str, str]:
        # Broadcasting consumers retry locally and never use the group's %RETRY% topic.
        return dict(self.subscriptions) if self.broadcasting else {**self.subscriptions, self.retry_topic: "*"}

    async def start(self) -> "PushConsumer":
        """Announce the group, take this consumer's share of the queues and start consuming; returns self."""
        self._started_ms = int(time.time() * 1000)
        for topic, expression in self._topics().items():
            try:
                await self.client.fetch_queues(topic)
            except TopicNotExistError:
                if topic != self.retry_topic:
                    raise
                # A new group's: its first heartbeat (below) makes the brokers create it, and the rebalance loop
                # finds its route once they register it. Raised, no new group started under a stand-alone name
                # server (txmq's or RocketMQ's; a broker's embedded one routes it before it exists).
                log.info("push consumer %s: %s has no route yet; the first heartbeat creates it", self.group, topic)
            await self.client.check_subscription(topic, expression)     # an SQL92 one the broker refuses: raise
            self.client.subscriptions[topic] = expression
        try:
            await self._heartbeat()
        except (RequestTimeoutError, ConnectionClosedError) as exc:
            # one broker out of reach keeps no consumer from starting (as RocketMQ's); a broker's refusal (wrong
            # credentials, a group limit) still raises: passed over, the consumer started and sat with no queue
            log.warning("heartbeat of %s failed at start: %s; the others heard it, the rebalance loop beats again",
                        self.group, exc)
        await self.rebalance()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._rebalance_loop()), loop.create_task(self._commit_loop())]
        if self.orderly:
            self._lock_task = loop.create_task(self._lock_loop())
            self._tasks.append(self._lock_task)
        for task in self._tasks:
            task.add_done_callback(self._crashed)
        return self

    def _crashed(self, task: asyncio.Task, mq: MessageQueue | None = None) -> None:
        """A background loop that raised is logged, never silent; a crashed pull loop is dropped so
        the next rebalance starts it again."""
        if task.cancelled() or task.exception() is None:
            # Nothing cancels (or ends) a pull loop still registered but shutdown: one that ended so anyway
            # (a CancelledError from below it) left its queue owned, with a finished task no rebalance replaced.
            if mq is not None and self._loops.get(mq) is task and not self._stopping:
                self.crashes += 1
                log.error("push consumer %s: pull loop of %s ended %s; restarted by a rebalance", self.group, mq,
                          "cancelled by no one" if task.cancelled() else "on its own")
                del self._loops[mq]
                self._request_rebalance()
            return
        self.crashes += 1
        exc = task.exception()
        log.error("push consumer %s: %s crashed", self.group, f"pull loop of {mq}" if mq else task.get_coro(),
                  exc_info=(type(exc), exc, exc.__traceback__))
        if mq is not None and self._loops.get(mq) is task:
            del self._loops[mq]
            self._request_rebalance()

    def _turn_failed(self, what: str) -> None:
        """A turn of a periodic loop raised something unexpected: logged with its traceback and counted
        in ``crashes`` as a crashed loop is, while the loop goes on with its next turn."""
        self.crashes += 1
        log.exception("%s of %s failed; trying again next turn", what, self.group)

    async def __aenter__(self) -> "PushConsumer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ------------------------------------------------------------ rebalance
    def _request_rebalance(self) -> None:
        self._rebalance_asked = True
        self._rebalance_now.set()

    def _on_connection_lost(self, addr: str) -> None:
        """A connection to a broker closed: it may have restarted, and then it knows this consumer again only from
        a heartbeat. Waiting for the next rebalance (up to rebalance_interval_s) left the broker listing only the
        other consumers of the group meanwhile: they took this one's queues, and both consumed them."""
        self.client.heard.discard(addr)     # its next answered commit there waits for a beat (_anchor)
        if self._stopping or not self.client.brokers_at(addr):     # a name server's: nothing to announce
            return
        self._beat_now = True
        self._rebalance_now.set()
        # A connection already replaced by an open one to the same address (closed by us, its close ending late):
        # the broker dropped this consumer's channel with it (hence the beat) but not its locks, kept by client id;
        # dropped here, the locks just granted over the new connection were undone for nothing.
        if self.orderly and self.client.pool.cached(addr) is None:
            self._on_broker_lost(addr)

    async def _rebalance_loop(self) -> None:
        """Heartbeat, then rebalance: every rebalance_interval_s, when the group changes, and at once when a
        connection is lost. While a heartbeat cannot reach a broker it is tried again after a back-off (0.5 s
        doubling up to 4 s, each ``jittered``): a broker back on its feet hears this consumer within seconds, not up to
        rebalance_interval_s later. Those retries only beat, one WARNING per outage; the rebalance between them
        waits for a beat that is heard, a group change told meanwhile, or its own time."""
        retry: float | None = None
        last_rebalance = time.monotonic()
        while True:
            if retry is None:
                try:
                    await wait_within(self._rebalance_now.wait(), self.rebalance_interval_s)
                except asyncio.TimeoutError:
                    pass
                asked = True
            else:   # not sooner for a connection lost meanwhile: a broker that accepts and then drops every
                # connection (each failed beat losing one) made a tight loop of connects
                await asyncio.sleep(jittered(retry))
                # a group change asks for a rebalance; a connection lost meanwhile only for the beat this is. Told
                # apart by their own flag: a notice and a loss both in one back-off read as the loss alone, and the
                # notice (one per 0.5 s a group, the changes within it merged: nothing else is coming) was lost
                asked = self._rebalance_asked
            self._rebalance_now.clear()
            self._rebalance_asked = False
            lost, self._beat_now = self._beat_now, False
            # A retry beats only the brokers the last beat did not reach (all of them once a connection is lost
            # again): every consumer of a process beating every healthy broker each few seconds, for as long as
            # one broker stayed down, was five times their usual heartbeat load.
            only = list(self.client.beat_unreached) if retry is not None and not lost else None
            try:
                unreached: BrokerError | None = None
                try:
                    await (self._heartbeat() if only is None else self._heartbeat(only))
                except (RequestTimeoutError, ConnectionClosedError) as exc:
                    unreached = exc
                except BrokerError as exc:     # a broker gone for good stays known: rebalance all the same
                    # A refusal is raised before a broker out of reach: that one (restarting) was left to the next
                    # rebalance, up to rebalance_interval_s, as if no connection had been lost. Backed off as well,
                    # and said there (once an outage): said here too, one failure was two WARNINGs.
                    if self.client.beat_unreached:
                        unreached = exc
                    else:
                        log.log(logging.WARNING if not self.beats_failed else logging.DEBUG,
                                "heartbeat of %s failed: %s", self.group, exc)
                if unreached is None:
                    if self.beats_failed:
                        log.info("heartbeat of %s heard again after %d failed attempt(s)", self.group,
                                 self.beats_failed)
                    self.beats_failed, retry = 0, None
                else:
                    exc = unreached
                    self.beats_failed += 1
                    retry = min(self.rebalance_interval_s, _BEAT_RETRY_MAX_S,
                                _BEAT_RETRY_S if retry is None else retry * 2)
                    # the first of an outage a WARNING, the rest only for the debugging eye: said every retry, a
                    # broker down for an hour wrote a line every few seconds
                    log.log(logging.WARNING if self.beats_failed == 1 else logging.DEBUG,
                            "heartbeat of %s failed: %s; retrying, backing off up to %g s (said again once heard)",
                            self.group, exc, retry)
                # a retry that still reaches no broker changes nothing the last rebalance saw
                if retry is None or asked or time.monotonic() - last_rebalance >= self.rebalance_interval_s:
                    last_rebalance = time.monotonic()
                    await self.rebalance()
            except BrokerError as exc:
                log.warning("rebalance of %s failed: %s", self.group, exc)
            except Exception:  # noqa: BLE001 - ending here would stop rebalancing (and restarting pull loops) for good
                self._turn_failed("rebalance")
            if lost and retry is None:      # connections that keep breaking: at most two beats a second for them
                await asyncio.sleep(min(_BEAT_RETRY_S, self.rebalance_interval_s))

    def _running_info(self, jstack: bool) -> bytes:
        """The ConsumerRunningInfo body a Java push consumer answers GET_CONSUMER_RUNNING_INFO with
        (DefaultMQPushConsumerImpl.consumerRunningInfo): the properties mqadmin consumerStatus reads (consume type,
        orderly, start time), the subscriptions, and a ProcessQueueInfo of each queue this consumer holds. Left
        unanswered (REQUEST_CODE_NOT_SUPPORTED), consumerStatus and consumerProgress -s failed on a txmq consumer."""
        now_wall, now_mono = time.time() * 1000, time.monotonic()
        props = {**self.client.running_props("CONSUME_PASSIVELY", self._started_ms), "messageModel": self.message_model,
                 "consumeFromWhere": _CONSUME_FROM[self.consume_from], "consumeTimestamp": str(self.consume_timestamp_ms),
                 "maxReconsumeTimes": str(self.max_reconsume_times), "PROP_CONSUMEORDERLY": str(self.orderly).lower()}
        subs = [as_selector(e).subscription_data(t, self.client.sub_version)
                for t, e in self.client.subscriptions.items()]
        queues = {}
        for mq in self._owned:
            offset, in_hand = self._offsets.get(mq, -1), mq in self._consuming
            granted = self._locks.get(mq)
            queues[(mq.topic, mq.broker_name, mq.queue_id)] = {
                "cachedMsgCount": int(in_hand), "cachedMsgMaxOffset": offset if in_hand else 0,
                "cachedMsgMinOffset": offset if in_hand else 0, "cachedMsgSizeInMiB": 0, "commitOffset": offset,
                "droped": mq in self._leaving, "lastConsumeTimestamp": self._consumed_ms.get(mq, 0),
                "lastLockTimestamp": 0 if granted is None else int(now_wall - (now_mono - granted) * 1000),
                "lastPullTimestamp": self._pulled_ms.get(mq, 0), "locked": self._locked(mq),
                "transactionMsgCount": 0, "transactionMsgMaxOffset": 0, "transactionMsgMinOffset": 0,
                "tryUnlockTimes": 0}
        return encode_consumer_running_info(props, subs, queues, thread_stacks() if jstack else None)

    async def _consume_directly(self, msg: MessageExt) -> bytes | str | tuple[int, str]:
        """A message an operator hands this consumer (CONSUME_MESSAGE_DIRECTLY) given to the listener once, beside
        the pull loops, as ConsumeMessage{Concurrently,Orderly}Service.consumeMessageDirectly: its offset moves
        nothing and a failure is not sent back. The ConsumeMessageDirectlyResult: CR_SUCCESS; CR_LATER for a
        listener that asked for it again; CR_THROW_EXCEPTION, with what it raised as its remark, for one that raised
        or ran past consume_timeout_s; CR_RETURN_NULL for one that returned None (said in the log, as always).
        At most MAX_DIRECT_AT_ONCE run at once, one more answered SYSTEM_BUSY: the broker gives up on each after
        10 s, the listener's call goes on up to consume_timeout_s, and the connection it came on stops reading
        past 1,024 requests in hand -- the pulls' answers with them, and consumption stalled.
        Shutdown keeps to it as to the pull loops' calls: none begins once it has begun (refused, saying so), and
        one running is given shutdown_grace_s, then cancelled."""
        if self._stopping:
            return f"push consumer {self.group} is shutting down: message {msg.msg_id} not given to its listener"
        if len(self._direct) >= MAX_DIRECT_AT_ONCE:
            log.warning("push consumer %s: message %s handed directly refused: %d earlier ones are still in the "
                        "listener (a listener that hangs?)", self.group, msg.msg_id, len(self._direct))
            return ResponseCode.SYSTEM_BUSY, (
                f"push consumer {self.group}: {len(self._direct)} messages handed directly are still in its "
                f"listener (at most {MAX_DIRECT_AT_ONCE}), try again later")
        self._as_subscribed(msg)
        began = time.monotonic()
        task = asyncio.current_task()
        self._direct.add(task)
        try:
            _status, result, remark = await self._listener_verdict(msg)
        finally:
            self._direct.discard(task)
        body = {"autoCommit": True, "consumeResult": result, "order": self.orderly, "remark": remark,
                "spentTimeMills": int((time.monotonic() - began) * 1000)}
        return json.dumps({k: v for k, v in body.items() if v is not None}, separators=(",", ":")).encode()

    async def _heartbeat(self, only: list[str] | None = None) -> None:
        await self.client.heartbeat("CONSUME_PASSIVELY", _CONSUME_FROM[self.consume_from], self.message_model,
                                    only=only)

    async def rebalance(self) -> None:
        """Recompute this consumer's queues now (also run periodically and when the group changes).

        Queues taken on start at once; a queue given away is handed over (``_hand_over``) and this returns
        once that is done: within ``handover_grace_s``, plus its commit and unlock."""
        owned: set[MessageQueue] = set()
        for topic in self._topics():
            try:
                queues = await self.client.fetch_queues(topic)
                ids = await self._consumer_ids(queues) if queues and not self.broadcasting else None
            except BrokerError as exc:     # as RocketMQ: this topic's queues stay as they are, the others go on
                log.warning("push consumer %s: no route or consumer list for %s (%s); its queues stay as they are",
                            self.group, topic, exc)
                owned.update(q for q in self._owned if q.topic == topic)
                continue
            if not queues:
                continue
            if self.broadcasting:
                owned.update(queues)
                continue
            if not ids:     # the broker knows no consumer of the group (it restarted): as RocketMQ, change nothing
                log.warning("push consumer %s: no consumer list for %s from broker %s; its queues stay as they are",
                            self.group, topic, queues[0].broker_name)
                owned.update(self._owned.intersection(queues))
                continue
            owned.update(allocate_averagely(queues, ids, self.client.client_id))
        self._owned = owned
        leaving = {q: self._loops.pop(q) for q in list(self._loops) if q not in owned}
        handover = None
        if leaving:
            self._leaving.update(leaving)
            handover = asyncio.get_running_loop().create_task(self._hand_over(leaving))
            self._handovers.add(handover)
            handover.add_done_callback(self._handovers.discard)
            handover.add_done_callback(self._crashed)
        if self.orderly:
            # A queue being handed over keeps its lock until its message in hand is done (_hand_over).
            await self._release_locks([q for q in self._locks if q not in owned and q not in self._leaving])
            try:
                await self._lock_owned()
            except BrokerError as exc:     # the queues wait for their locks; the lock loop asks again
                log.warning("push consumer %s could not lock its queues: %s", self.group, exc)
        # A queue taken back while its old loop still finishes its message in hand starts when that hand-over
        # ends (_hand_over): started now, the new loop saw the queue leaving and ended before its first pull.
        # Nor one an offset reset is writing: started now, its loop read the old offset and undid the reset.
        for mq in owned - set(self._loops) - self._leaving.keys() - self._resetting:
            self._start_loop(mq)
        if handover is not None:
            # Shielded: a rebalance cancelled (shutdown) must not cut the commit and unlock half-way. Waited
            # for, so no later rebalance takes a queue back while its old loop still has a message in hand.
            # Its failure is not raised here: the task's own callback (_crashed) logs and counts it, and
            # raised again it was counted a second time by the rebalance loop (_turn_failed).
            await asyncio.wait([handover])

    async def _consumer_ids(self, queues: list[MessageQueue]) -> list[str]:
        """The group's consumers, as the first broker of ``queues`` that answers knows them. Asked of the first
        queue's broker alone, one cut off (in the routes until the name servers expire it, 2 minutes) failed
        every rebalance of the topic: the queues stayed where they were and a consumer joining got none."""
        failed = None
        for mq in {q.broker_name: q for q in queues}.values():
            try:
                ids = await self.client.consumer_ids(mq)
            except BrokerError as exc:
                failed = failed or exc
                continue
            if ids:
                return ids
        if failed is not None:
            raise failed
        return []

    async def _release_locks(self, queues: list[MessageQueue]) -> None:
        """Forget and unlock ``queues``: their next owner need not wait for the locks to expire."""
        for mq in queues:
            self._locks.pop(mq, None)
            self._unlock_owed.discard(mq)
        if queues:
            try:
                await self.client.unlock_queues(queues)
            except Exception:  # noqa: BLE001 - logged broker by broker; those expire on their brokers
                pass

    async def _let_finish(self, loops, grace_s: float, which: str, option: str) -> None:
        """End pull loops: those with nothing in hand (waiting for a pull, a lock or a retry) at once, those
        whose listener call is running after ``grace_s`` (``option``), their messages then not committed."""
        busy = []
        for mq, task in loops:
            if mq in self._consuming:
                busy.append(task)
            else:
                task.cancel()
        late = await finish_within(busy, grace_s)
        if late:
            log.warning("push consumer %s: %d listener call(s)%s still running after %g s (%s): cancelled, their "
                        "messages not committed", self.group, len(late), which, grace_s, option)
            # A listener that catches the CancelledError and goes on would hold us here for ever: bounded.
            _, stuck = await asyncio.wait(late, timeout=self.abandon_after_s)
            for mq, task in loops:
                if task in stuck:
                    self._abandon(mq, task)

    async def _let_direct_finish(self) -> None:
        """Shutdown: the listener calls of CONSUME_MESSAGE_DIRECTLY running given shutdown_grace_s, then cancelled
        (left, one went on up to consume_timeout_s after the consumer was gone), waited for at most
        abandon_after_s more."""
        late = await finish_within(self._direct, self.shutdown_grace_s)
        if late:
            log.warning("push consumer %s: %d listener call(s) of a message handed directly still running after "
                        "%g s (shutdown_grace_s): cancelled", self.group, len(late), self.shutdown_grace_s)
            await asyncio.wait(late, timeout=self.abandon_after_s)

    def _abandon(self, mq: MessageQueue, task: asyncio.Task) -> None:
        """Give up on pull loop ``task`` of ``mq``, whose listener call ignored its cancel: it is no longer
        waited for, its message is not committed (the queue's next consumer gets it, perhaps while this
        call still runs it), and when the call ends at last the loop returns without touching an offset."""
        if task in self._abandoned or task.done():
            return
        self._abandoned.add(task)
        self._consuming.discard(mq)
        task.add_done_callback(self._abandoned.discard)
        log.error("push consumer %s: listener call on %s ignored its cancel for %g s (abandon_after_s): given up "
                  "on, still running; its message is not committed and comes again to the queue's next consumer, "
                  "perhaps while this call still runs it%s. A listener must let CancelledError through.",
                  self.group, mq, self.abandon_after_s,
                  " (orderly: the queue's lock is released all the same, so two calls may run on this queue at "
                  "once, out of order)" if self.orderly else "")

    async def _hand_over(self, leaving: dict[MessageQueue, asyncio.Task]) -> None:
        """Give away queues a rebalance took from this consumer, as shutdown gives up all of them: their
        pull loops fetch nothing more and take no new message (``_halted``); a listener call in hand has
        ``handover_grace_s`` to return and its verdict is acted on; one still running then is cancelled
        and its message, not committed, goes to the next owner. What was consumed is committed, and only
        then is an orderly queue unlocked, so its next owner starts after the message in hand."""
        try:
            await self._let_finish(leaving.items(), self.handover_grace_s, " on queues given away", "handover_grace_s")
            await asyncio.gather(*(t for t in leaving.values() if t not in self._abandoned), return_exceptions=True)
            for mq in leaving:
                reset = self._reset_leaving.pop(mq, None)
                if reset is not None:
                    # An offset reset came meanwhile: committing the progress it was at wrote over the reset, and
                    # the queue's next owner went on from there (RocketMQ's hand-over persists the reset offset)
                    self._offsets[mq] = reset
            # Side by side, as shutdown's (_commit_at_shutdown): a queue given away before the first commit round
            # commits the group's first offset of it, which the broker has on disk before its answer (a journal
            # line now, one fsync shared by those side by side; a paced save of the whole table before: one after
            # another, 63 queues on a broker holding 20,480 offsets took 14.9 s, the rebalance waiting and each
            # queue's new owner redelivering what was consumed here meanwhile).
            results = await asyncio.gather(*(self._commit(mq) for mq in leaving), return_exceptions=True)
            failed = None
            for mq, result in zip(leaving, results):
                if isinstance(result, BrokerError):     # often its broker is what went away
                    log.warning("push consumer %s could not commit the offset of %s it gave up: %s (its next owner "
                                "starts from the last offset committed)", self.group, mq, result)
                elif isinstance(result, BaseException):
                    failed = failed or result
                # Its position is the next owner's now (RocketMQ's removeOffset): kept here, the commit loop, which
                # re-commits every owned queue each round, wrote it over that owner's progress as soon as the
                # queue came back, before its new pull loop had read where to start (an orderly one waits for
                # its lock).
                self._offsets.pop(mq, None)
                self._committed.pop(mq, None)
                self._known_stored.pop(mq, None)
                self._pulled_ms.pop(mq, None)
                self._consumed_ms.pop(mq, None)
            if failed is not None:
                raise failed
            if self.orderly:
                await self._release_locks([q for q in leaving if (q in self._locks or q in self._unlock_owed)
                                           and q not in self._owned])
        finally:
            self._unlock_owed.difference_update(leaving)
            for mq in leaving:
                self._reset_leaving.pop(mq, None)
            for mq, task in leaving.items():
                if self._leaving.get(mq) is task:
                    del self._leaving[mq]
                    if mq in self._owned and mq not in self._loops:     # taken back meanwhile (rebalance)
                        self._start_loop(mq)

    def _halted(self, mq: MessageQueue) -> bool:
        """No new pull and no new message for ``mq``: shutdown began, a rebalance gave it away, an offset reset
        is stopping its loop (one whose listener swallowed the reset's cancel went on from the old offset), or
        the running loop was given up on (``_abandon``), even once the queue is this consumer's again: one given up on after
        its listener call (in a slow send-back) went on to the rest of its batch beside the queue's new loop."""
        return self._stopping or mq in self._leaving or mq in self._resetting or self._given_up()

    def _start_loop(self, mq: MessageQueue) -> None:
        if self._stopping:      # a rebalance or offset reset ending as shutdown cancels it starts nothing new
            return
        task = self._loops[mq] = asyncio.get_running_loop().create_task(self._pull_loop(mq))
        task.add_done_callback(lambda t, q=mq: self._crashed(t, q))

    # ------------------------------------------------------------ offsets reset by an operator
    def _on_reset_offset(self, topic: str, offsets: dict) -> None:
        if self._stopping:      # shutting down: its loops are ending, and no one would wait for this task
            log.warning("push consumer %s: offset reset of %s arrived during shutdown: not applied", self.group,
                        topic)
            return
        task = asyncio.get_running_loop().create_task(self.reset_offsets(topic, offsets))
        task.add_done_callback(self._crashed)
        self._tasks.append(task)
        # an operator's resets over months: not kept once done
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def reset_offsets(self, topic: str, offsets: dict[MessageQueue, int]) -> None:
        """RESET_CONSUMER_CLIENT_OFFSET: stop the pull loops of the queues in ``offsets`` (the message in hand
        is finished or abandoned), store the new offsets, and start the loops again from them. A listener call
        that ignores its cancel is given up on after ``abandon_after_s`` (``_abandon``), as shutdown does.

        Only those queues, as RocketMQ's resetOffset drops only the process queues in the table: the topic's
        others (another broker's, or one a reset without force leaves out, the group having no offset there)
        were stopped too and started again from the stored offset; with none stored, from the queue's end
        (consume_from "last"), past what was pulled and not yet consumed, which was never delivered. A queue being
        handed over (its loop the hand-over's) has the reset's offset committed by its hand-over, not its progress."""
        stopped = [mq for mq in self._loops if mq.topic == topic and mq in offsets]
        tasks = [self._loops.pop(mq) for mq in stopped]
        self._resetting.update(stopped)     # not started by a rebalance meanwhile: they would read the old offsets
        for task in tasks:
            task.cancel()
        try:
            if tasks:   # waited for without a limit, a listener swallowing its cancel held the reset for ever
                _, stuck = await asyncio.wait(tasks, timeout=self.abandon_after_s)
                for mq, task in zip(stopped, tasks):
                    if task in stuck:
                        self._abandon(mq, task)
            for mq, offset in offsets.items():
                mine = mq in self._owned        # another consumer's queue: its position is not ours to keep
                if mine:
                    self._offsets[mq] = offset
                elif mq in self._leaving:       # its hand-over commits this, not the progress it was at
                    self._reset_leaving[mq] = offset
                await self.offset_store.write(mq, offset)
                if mine:
                    self._committed[mq] = self._known_stored[mq] = offset
            log.info("push consumer %s: offsets of %s reset to %s", self.group, topic,
                     {mq.queue_id: o for mq, o in offsets.items()})
        finally:        # stored or not (the failure is logged as the task ends), the queues are consumed again
            self._resetting.difference_update(stopped)
            for mq in stopped:
                if mq in self._owned and mq not in self._loops:
                    self._start_loop(mq)

    # ------------------------------------------------------------ orderly locks
    async def _lock_owned(self) -> None:
        """Lock (or renew) every owned queue, broker by broker; a queue whose lock is refused is not
        consumed until a later attempt succeeds. A broker that does not answer does not keep the
        others' locks from being taken (the locks it gave lapse here after lock_expire_s); its error
        is raised once all were asked."""
        by_broker: dict[str, set[MessageQueue]] = {}
        # And the queues being handed over that still hold theirs: their message in hand is still consumed
        # (RocketMQ's lockAll renews a dropped process queue until it is removed). Not renewed, a hand-over
        # longer than the broker's lock life let the next owner lock the queue while that message ran.
        for mq in (*self._owned, *(q for q in self._leaving if q in self._locks)):
            by_broker.setdefault(mq.broker_name, set()).add(mq)
        failed = None
        for name, queues in by_broker.items():
            losses = self._losses.get(name, 0)
            try:
                granted = await self.client.lock_queues(queues)
            except BrokerError as exc:
                failed = failed or exc
                continue
            if self._losses.get(name, 0) != losses:
                # Its connection closed between the answer and now: _on_broker_lost has already run, and would
                # not see these grants. Trusted, a restarted broker's queues were consumed here for lock_expire_s
                # while it gave their locks to another consumer. Asked for again at once, over a new connection.
                self._relock_now.set()
                continue
            now = time.monotonic()
            stale = []
            for mq in granted:
                if mq in self._owned or (mq in self._leaving and mq in self._locks):
                    self._locks[mq] = now
                else:       # given away, and its lock released, while this was asked: not ours to hold
                    stale.append(mq)
            for mq in queues - granted:
                self._locks.pop(mq, None)     # someone else holds it now: stop at once, as RocketMQ does
            if stale:
                try:        # its next owner need not wait for the lock to expire
                    await self.client.unlock_queues(stale)
                except Exception:  # noqa: BLE001 - logged broker by broker; it expires on its broker
                    pass
        self._lock_changed.set()
        if failed is not None:
            raise failed

    def _on_broker_lost(self, addr: str) -> None:
        """The connection to ``addr`` closed: the locks its broker granted are trusted no longer. A broker that
        restarted holds none, and another consumer of the group it meets first (before this one's next heartbeat)
        takes the queues and is granted their locks; trusted until lock_expire_s, two consumers consumed each of
        those orderly queues at once. They are asked for again at once: a connection that only broke gets them back
        (the broker still holds them for this client), a restarted broker gives them to whoever asks first."""
        names = self.client.brokers_at(addr)
        for name in names:
            self._losses[name] = self._losses.get(name, 0) + 1
        lost = [mq for mq in self._locks if mq.broker_name in names]
        if not lost or self._stopping:
            return
        for mq in lost:
            del self._locks[mq]
            if mq in self._leaving:
                self._unlock_owed.add(mq)
        log.warning("push consumer %s: connection to broker %s lost: the locks of its %d queue(s) are no longer "
                    "trusted (restarted, it holds none); they are consumed again once locked again", self.group,
                    addr, len(lost))
        self._relock_now.set()

    @property
    def stalled_queues(self) -> dict[MessageQueue, int]:
        """Orderly and broadcasting: the queues held at a message the listener keeps failing (retried in place, no
        later message of the queue consumed meanwhile), each with its retries so far."""
        # copied at once first: read from txmq.sync's thread, a loop over the live dict could see it change size
        return {mq: retries for mq, (_, retries) in dict(self._held).items()}

    @property
    def locked_queues(self) -> set[MessageQueue]:
        """Orderly: the owned queues this consumer holds the broker's lock on now."""
        return {q for q in self._owned if self._locked(q)}

    def _locked(self, mq: MessageQueue) -> bool:
        granted = self._locks.get(mq)
        return granted is not None and time.monotonic() - granted <= self.lock_expire_s

    async def _lock_loop(self) -> None:
        while True:
            waiting = any(not self._locked(q) for q in self._owned)
            try:
                await wait_within(self._relock_now.wait(), self.lock_retry_s if waiting else self.lock_interval_s)
            except asyncio.TimeoutError:
                pass
            self._relock_now.clear()
            try:
                await self._lock_owned()
            except BrokerError as exc:
                # one WARNING while they keep failing, as the heartbeat's back-off: a lost connection drops the
                # locks (asked again at once, then every lock_retry_s), and a broker down a minute was 60 lines
                self.locks_failed += 1
                log.log(logging.WARNING if self.locks_failed == 1 else logging.DEBUG,
                        "lock renewal of %s failed: %s%s", self.group, exc,
                        "; said again once it succeeds" if self.locks_failed == 1 else "")
            except Exception:  # noqa: BLE001 - ending here would let every lock lapse: orderly consuming stops
                self._turn_failed("lock renewal")
            else:
                if self.locks_failed:
                    log.info("lock renewal of %s succeeded again after %d failed attempt(s)", self.group,
                             self.locks_failed)
                self.locks_failed = 0

    async def _wait_for_lock(self, mq: MessageQueue) -> None:
        while not self._locked(mq):
            self._lock_changed.clear()
            try:
                await wait_within(self._lock_changed.wait(), self.lock_retry_s)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------ consuming
    async def _start_offset(self, mq: MessageQueue) -> int:
        stored = await self.offset_store.read(mq)
        if stored is not None:
            known = self._known_stored.get(mq)
            self._known_stored[mq] = stored if known is None else max(known, stored)
            return stored
        if mq.topic == self.retry_topic or self.consume_from == "first":
            return 0
        if self.consume_from == "timestamp":
            start = await self.client.search_offset(mq, self.consume_timestamp_ms)
        else:
            start = await self.client.max_offset(mq)
        await self._anchor(mq, start)
        return start

    async def _anchor(self, mq: MessageQueue, offset: int) -> None:
        """Store where a queue the group never committed starts (its end, or consume_timestamp_ms's offset) before
        its first pull. Left to the commit loop, a consumer killed within its first offset_commit_interval_s stored
        nothing: the next one was told no offset again and started at the end of that moment, passing over every
        message sent since the first began, consumed or not (as RocketMQ's consumer still does). Once per such
        queue.

        Answered, on a connection that carried no heartbeat of the group (a broker the rebalance learnt of after
        its loop's beat, a reconnect), the broker took it for an admin tool's move: a WARNING blaming one, and its
        offsets file saved before the answer. That broker hears a heartbeat first."""
        try:
            addr = None if self.broadcasting else await self.client.unheard(mq)
            if addr is not None:
                await self._heartbeat(only=[addr])
            await self.offset_store.write(mq, offset)
            await self.offset_store.flush()
        except (BrokerError, OSError) as exc:     # the commit loop stores it on its next round
            log.warning("push consumer %s: start offset %d of %s not stored (%s): until the next commit round, a "
                        "crash passes over what is sent meanwhile", self.group, offset, mq, exc)
            return
        self._committed[mq] = self._known_stored[mq] = offset

    async def _resume_offset(self, mq: MessageQueue) -> int:
        """Where a loop (re)starts: the stored offset, or the progress this consumer still holds for ``mq`` when
        that is further. Everything before the latter was consumed here; read from the broker alone, an orderly
        queue locked again after its lock lapsed (no one else took it) consumed again what it had consumed
        since the last commit, after later messages. A queue given away and taken back holds none (_hand_over).

        Except when the stored offset is below the one this consumer last committed or read: whoever held the
        queue meanwhile went on from there and only moves it forward, so someone moved it back: an operator's
        reset this consumer was not told of (its connection down, as when its lock lapses; the broker tells live
        consumers only), or a broker that lost commits. That is followed, as before; gone on from here, the
        reset was undone, unsaid."""
        known = self._known_stored.get(mq)
        start = await self._start_offset(mq)
        mine = self._offsets.get(mq)
        if mine is None or start >= mine:
            return start
        if known is not None and start < known:
            log.warning("push consumer %s: the stored offset of %s, %d, is below the %d this consumer committed or "
                        "read (an offset reset it was not told of, or a broker that lost commits): going on from it, "
                        "not from its own progress, %d", self.group, mq, start, known, mine)
            self._known_stored[mq] = start      # what the broker holds now: a later lapse goes on from progress
            return start
        return mine

    async def _pull_loop(self, mq: MessageQueue) -> None:
        expression = self.subscriptions.get(mq.topic, "*")
        offset = None
        behind_since = None             # (offset, since, next warning): the broker says retry, offset unchanged
        while not self._halted(mq):     # _halted includes _given_up
            try:
                if self.orderly and not self._locked(mq):
                    # Whoever held the queue meanwhile may have moved on: start again from the stored offset,
                    # or from this loop's own progress if that is further (see _resume_offset).
                    await self._wait_for_lock(mq)
                    offset = None
                if offset is None:
                    offset = self._offsets[mq] = await self._resume_offset(mq)
                res = await self.client.pull(mq, offset, expression=expression, suspend_ms=self.suspend_ms)
                self._pulled_ms[mq] = int(time.time() * 1000)
                for msg in res.messages:
                    if self._halted(mq):
                        break          # shutdown or given away: the rest of the batch is the next consumer's
                    if self.orderly and not self._locked(mq):
                        break          # the lock lapsed mid-batch: consuming on could race the next owner
                    self._consuming.add(mq)
                    try:
                        await self._consume(mq, msg)
                    finally:
                        # Given up on, this loop's mark was dropped then; a loop started on the queue since
                        # (taken back) may have set its own.
                        if not self._given_up():
                            self._consuming.discard(mq)
                    if self._given_up():
                        # Given up on after its listener call, in the send-back (a slow broker): the queue's
                        # offset is no longer this loop's to move (a loop started since may hold it).
                        return
                    self._offsets[mq] = msg.queue_offset + 1
                    self._consumed_ms[mq] = int(time.time() * 1000)
                else:
                    if res.status is PullStatus.OFFSET_ILLEGAL:
                        self._offset_moved(mq, offset, res)
                    if res.status is not PullStatus.NO_NEW_MSG or res.next_begin_offset != offset:
                        self._offsets[mq] = res.next_begin_offset
                    if res.status is PullStatus.NO_MATCHED_MSG and res.next_begin_offset == offset:
                        # A slave behind its master (the master gone) does not have this offset yet: it says
                        # retry, offset unchanged. Asked again at once, it is asked in a tight loop.
                        behind_since = self._still_behind(mq, offset, behind_since)
                        await asyncio.sleep(self.pull_retry_delay_s)
                        offset = self._offsets[mq]
                        continue
                behind_since = None
                offset = self._offsets[mq]
            except asyncio.CancelledError:
                raise
            except _LockLost:
                offset = None          # the message is retried by whoever holds the queue next
            except _Stopping:
                return
            except BrokerError as exc:
                # The broker's refusal (a corrupt record, a damaged queue), or an answer that does not decode, does
                # not pass by itself, and nothing of the queue is consumed meanwhile: a WARNING each time (Java's
                # client skips what it cannot decode, unsaid); a lost connection or a timeout: INFO.
                log.log(logging.WARNING if isinstance(exc, (ResponseError, ProtocolError)) else logging.INFO,
                        "pull of %s failed: %s; retrying in %.0f s", mq, exc, self.pull_retry_delay_s)
                await asyncio.sleep(self.pull_retry_delay_s)
            except Exception:  # noqa: BLE001 - a bug: ended here, rebalance restarted it at once, in a tight loop
                self._turn_failed(f"pull loop of {mq}")
                offset = self._offsets.get(mq)      # what was consumed stays consumed; the rest is pulled again
                await asyncio.sleep(self.pull_retry_delay_s)

    def _offset_moved(self, mq: MessageQueue, offset: int, res) -> None:
        """PULL_OFFSET_MOVED: the broker has no message at ``offset`` (past its end after it lost a tail, or
        before its start after retention) and names where to go on. Followed, as RocketMQ does, but said: on
        passes messages over, back may deliver some again."""
        moved = res.next_begin_offset - offset
        log.warning("push consumer %s: %s has no message at offset %d (the broker holds %d to %d): going on from "
                    "%d, %s", self.group, mq, offset, res.min_offset, res.max_offset, res.next_begin_offset,
                    f"{moved} message(s) passed over" if moved > 0 else f"{-moved} back")

    def _still_behind(self, mq: MessageQueue, offset: int, since):
        """A queue whose broker keeps saying "retry" at one offset (a slave that has not got it yet, its
        master gone) is consumed by nobody: a WARNING once it has lasted a minute, and every ten after."""
        now = time.monotonic()
        if since is None or since[0] != offset:
            return (offset, now, now + 60.0)
        _, start, warn_at = since
        if now < warn_at:
            return since
        log.warning("push consumer %s: %s has waited %.0f s at offset %d: its broker has not got that message "
                    "yet (a slave behind its master, the master gone?); nothing of the queue is consumed until it "
                    "has", self.group, mq, now - start, offset)
        return (offset, start, now + 600.0)

    def _given_up(self) -> bool:
        """The running pull loop was given up on (``_abandon``): it must change nothing any more."""
        return bool(self._abandoned) and asyncio.current_task() in self._abandoned

    async def _listen(self, msg: MessageExt) -> ConsumeStatus:
        status = (await self._listener_verdict(msg))[0]
        if self._given_up():    # returned at last, long after its cancel: the queue is no longer this loop's
            log.warning("push consumer %s: listener call on %s given up on has ended; its verdict is ignored",
                        self.group, msg.msg_id)
            raise _Stopping()
        return status

    async def _listener_verdict(self, msg: MessageExt) -> tuple[ConsumeStatus, str, str | None]:
        """The listener's call on ``msg``: its status, the CMResult a Java consumer's consumeMessageDirectly names
        it (CR_SUCCESS, CR_LATER, CR_THROW_EXCEPTION for a raise or a call past consume_timeout_s, CR_RETURN_NULL
        for a listener that returned None), and why it failed (the ConsumeMessageDirectlyResult's remark)."""
        deadline = None
        try:
            status = self.listener(msg)
            if inspect.isawaitable(status):
                async with asyncio.timeout(self.consume_timeout_s) as deadline:     # a timer, not a Task, a message
                    status = await status
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():     # shutdown or a hand-over cancels the call: go on ending
                raise
            # Not a cancel of this call: something the listener awaited was cancelled. Let through, it ended the
            # pull loop as cancelled, and its queue stayed owned and unconsumed for good.
            log.warning("listener raised CancelledError on %s (nothing cancelled it): RECONSUME_LATER", msg.msg_id)
            return ConsumeStatus.RECONSUME_LATER, "CR_THROW_EXCEPTION", "CancelledError"
        except Exception as exc:  # noqa: BLE001 - a failing listener is RECONSUME_LATER, as in Java
            if deadline is not None and deadline.expired():     # not the listener's own TimeoutError
                log.warning("listener still running on %s after %g s (consume_timeout_s): cancelled, "
                            "RECONSUME_LATER", msg.msg_id, self.consume_timeout_s)
                return (ConsumeStatus.RECONSUME_LATER, "CR_THROW_EXCEPTION",
                        f"listener still running after {self.consume_timeout_s:g} s (consume_timeout_s): cancelled")
            raised = _raised(exc)
            log.warning("listener failed on %s: %s", msg.msg_id, raised)
            return ConsumeStatus.RECONSUME_LATER, "CR_THROW_EXCEPTION", raised
        if status is ConsumeStatus.CONSUME_SUCCESS:
            return status, "CR_SUCCESS", None
        if status is not ConsumeStatus.RECONSUME_LATER:     # a forgotten return: said, as RocketMQ does
            log.warning("listener returned %r on %s, not a ConsumeStatus: RECONSUME_LATER", status, msg.msg_id)
        return ConsumeStatus.RECONSUME_LATER, "CR_RETURN_NULL" if status is None else "CR_LATER", None

    def _as_subscribed(self, msg: MessageExt) -> None:
        """A retry's topic made the one the user subscribed to (RocketMQ's resetRetryAndNamespace)."""
        if msg.topic == self.retry_topic and Prop.RETRY_TOPIC in msg.properties:
            msg.topic = msg.properties[Prop.RETRY_TOPIC]

    async def _consume(self, mq: MessageQueue, msg: MessageExt) -> None:
        self._as_subscribed(msg)
        if self.orderly or self.broadcasting:
            return await self._consume_in_place(mq, msg)
        while True:
            if await self._listen(msg) is ConsumeStatus.CONSUME_SUCCESS:
                return
            try:
                await self.client.send_back(mq, msg, max_reconsume_times=self.max_reconsume_times)
                return
            except BrokerError as exc:
                self._not_taken(mq, msg, exc, "hand back", "retrying it here")
                await asyncio.sleep(self.local_retry_delay_s)
                if self._halted(mq):    # shutdown or given away meanwhile: no new listener call, as below
                    raise _Stopping()

    async def _consume_in_place(self, mq: MessageQueue, msg: MessageExt) -> None:
        """Orderly and broadcasting: a failed message is retried here, in its place in the queue, every
        ``suspend_s``; after ``max_reconsume_times`` an orderly one goes to %DLQ%<group> and a
        broadcasting one is dropped, loudly. Meanwhile the queue is in stalled_queues and said held (_say_held)."""
        retries = 0
        try:
            while await self._listen(msg) is not ConsumeStatus.CONSUME_SUCCESS:
                if retries >= self.max_reconsume_times:
                    return await self._give_up(mq, msg, retries)
                if self._halted(mq):    # retried in place by whoever consumes the queue next, in its order
                    raise _Stopping()
                retries += 1
                msg.reconsume_times += 1
                self._say_held(mq, msg, retries)
                await asyncio.sleep(self.suspend_s)
                if self._halted(mq):
                    raise _Stopping()
                if self.orderly and not self._locked(mq):
                    raise _LockLost()
        finally:
            # Only its own: a loop given up on (_abandon) ends at last, the queue's new loop perhaps held there
            if self._held.get(mq, (None,))[0] is asyncio.current_task():
                del self._held[mq]

    def _say_held(self, mq: MessageQueue, msg: MessageExt, retries: int) -> None:
        """A queue held at a message retried in place: in stalled_queues, and a WARNING at its 1st retry and its 10th,
        100th, ... An orderly listener answering RECONSUME_LATER (SUSPEND_CURRENT_QUEUE_A_MOMENT) for good, with
        max_reconsume_times left at Integer.MAX_VALUE as RocketMQ's, stalled its queue with not a line said."""
        self._held[mq] = (asyncio.current_task(), retries)
        if not _is_power_of_ten(retries):
            return
        until = (f"or {self.max_reconsume_times} retries pass" if self.max_reconsume_times < _JAVA_INT_MAX
                 else "(max_reconsume_times not set: for good)")
        log.warning("%s consumer %s: queue %d of %s on %s is held at %s (offset %d), retried in place %d time(s): "
                    "nothing after it in the queue is consumed until the listener returns CONSUME_SUCCESS %s; said "
                    "again at the 10th, 100th, ... retry", "orderly" if self.orderly else "broadcasting", self.group,
                    mq.queue_id, mq.topic, mq.broker_name, msg.msg_id, msg.queue_offset, retries, until)

    async def _give_up(self, mq: MessageQueue, msg: MessageExt, retries: int) -> None:
        """A message retried in place max_reconsume_times: an orderly one dead-lettered, a broadcasting one dropped."""
        if self.broadcasting:
            self.dropped += 1
            log.error("broadcasting consumer %s gives up %s of %s after %d retries", self.group,
                      msg.msg_id, mq, retries)
            return
        while True:
            try:     # with the retries counted here, as RocketMQ's orderly consumer sends it
                await self.client.dead_letter(mq, msg, max_reconsume_times=self.max_reconsume_times)
                # said: the queue goes on past it, and nothing else on the consumer's side told a message left out
                log.warning("orderly consumer %s: %s (offset %d of queue %d of %s) failed %d retries in place "
                            "(max_reconsume_times): dead-lettered to %%DLQ%%%s, its queue goes on past it (-1 retries "
                            "for good, as RocketMQ's orderly consumer)", self.group, msg.msg_id, msg.queue_offset,
                            mq.queue_id, mq.topic, retries, self.group)
                return
            except BrokerError as exc:
                self._not_taken(mq, msg, exc, "dead-letter", "retrying")
                await asyncio.sleep(self.local_retry_delay_s)

    def _not_taken(self, mq: MessageQueue, msg: MessageExt, exc: BrokerError, what: str, then: str) -> None:
        """The broker did not take a failed message (``what``: hand back, dead-letter): said; _Stopping when shutting
        down or giving ``mq`` away meanwhile (left uncommitted, it comes again)."""
        if self._halted(mq):
            log.warning("could not %s %s (%s) while shutting down or giving %s away: left uncommitted, it comes again",
                        what, msg.msg_id, exc, mq)
            raise _Stopping() from None
        log.warning("could not %s %s (%s); %s", what, msg.msg_id, exc, then)

    # ------------------------------------------------------------ offsets
    async def _commit(self, mq: MessageQueue, again: bool = False, oneway: bool = False) -> None:
        offset = self._offsets.get(mq)
        if offset is not None and (again or self._committed.get(mq) != offset):
            write = getattr(self.offset_store, "write_oneway", None) if oneway else None
            await (write or self.offset_store.write)(mq, offset)
            self._committed[mq] = self._known_stored[mq] = offset

    async def _recommit(self, queues: list[MessageQueue]) -> None:
        """Commit again the offsets of one broker's ``queues``, changed or not (the commit loop's round): oneway,
        as a Java consumer's persistAll. Answered, a round on a connection the broker had seen no heartbeat or
        pull of the group on yet (a restarted broker) was taken for an admin tool's moves, each commit waiting for
        a save of the broker's offsets (past 256 of an address, its next periodic save), one queue after another.
        Shutdown's and a hand-over's commits stay answered: their failure is said."""
        for mq in queues:
            try:
                await self._commit(mq, again=True, oneway=True)
            except BrokerError as exc:
                log.info("offset commit of %s failed: %s", mq, exc)
            except Exception:  # noqa: BLE001 - ending here would leave every later offset uncommitted
                self._turn_failed(f"offset commit of {mq}")

    async def _commit_at_shutdown(self, queues: list[MessageQueue]) -> None:
        """Commit one broker's ``queues`` at shutdown, side by side. One after another, a broker that did not
        answer cost a request timeout per queue, and one that answers saves a group's first offset of a queue
        before its answer (a consumer stopped before its first commit round commits only first offsets): a paced
        save each, 128 queues on a broker holding 10,240 offsets took 62.6 s to stop. Side by side, they share
        the broker's saves, and one timeout bounds them all."""
        results = await asyncio.gather(*(self._commit(mq, again=True) for mq in queues), return_exceptions=True)
        unanswered, failed = [], None
        for mq, result in zip(queues, results):
            if isinstance(result, (RequestTimeoutError, ConnectionClosedError)):
                unanswered.append(mq)
                failed = failed or result
            elif isinstance(result, BrokerError):
                log.warning("push consumer %s: offset %d of %s not committed at shutdown (%s); what was consumed "
                            "since the last commit comes again", self.group, self._offsets[mq], mq, result)
            elif isinstance(result, BaseException):
                raise result
        if unanswered:
            log.warning("push consumer %s: %s not committed at shutdown, their broker did not answer (%s); what "
                        "was consumed since the last commit comes again", self.group,
                        "; ".join(f"offset {self._offsets[q]} of {q}" for q in unanswered), failed)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.offset_commit_interval_s)
            # Every round, changed or not, as RocketMQ's persistAll: a broker killed before it saved our last
            # commits has forgotten them, and a queue with nothing new would keep the old offset for good, to
            # be consumed again from there by whoever takes it next. Only queues this consumer pulls: one
            # given away belongs to its new owner, whose progress an old offset would undo.
            # Broker by broker, side by side: a broker that does not answer costs a request timeout per queue,
            # and every queue is committed each round now, not only those that moved; one after another, the
            # queues of the brokers that answer waited behind its timeouts, round after round.
            by_broker: dict[str, list[MessageQueue]] = {}
            for mq in list(self._loops):
                by_broker.setdefault(mq.broker_name, []).append(mq)
            await asyncio.gather(*(self._recommit(queues) for queues in by_broker.values()))
            try:
                await self.offset_store.flush()
            except OSError as exc:
                log.warning("offsets of %s not saved: %s", self.group, exc)
            except Exception:  # noqa: BLE001 - as above
                self._turn_failed("offset flush")

    @property
    def shutting_down(self) -> bool:
        """True once ``shutdown`` has begun: no new pulls, no new messages handed to the listener."""
        return self._stopping

    async def shutdown(self) -> None:
        """Stop fetching, let the listener calls running finish, commit, unlock, unregister and close.

        No pull is made and no new message is given to the listener once this begins. A listener
        already running is given up to ``shutdown_grace_s`` to return, and its verdict is acted on
        (consumed: its offset is committed; RECONSUME_LATER: handed back once); one still running then
        is cancelled and its message, like the rest of its batch, is not committed, so the queue's next
        consumer gets it. Then the offsets of what was consumed are committed, an orderly consumer's
        locks are released (only now, so no one else consumes a queue while its message is in hand),
        and the consumer leaves the group.
        """
        self._stopping = True
        others = [t for t in self._tasks if t is not self._lock_task]     # locks held while messages are in hand
        for task in others:
            task.cancel()
        # Queues being handed over are given no longer than shutdown's grace either; their hand-over then
        # commits and unlocks them, and is waited for below.
        loops = [*self._loops.items(), *self._leaving.items()]
        await asyncio.gather(self._let_finish(loops, self.shutdown_grace_s, "", "shutdown_grace_s"),
                             self._let_direct_finish())
        await asyncio.gather(*others, *(task for _, task in loops if task not in self._abandoned),
                             return_exceptions=True)
        self._loops.clear()
        await asyncio.gather(*self._handovers, return_exceptions=True)
        if self._lock_task is not None:
            self._lock_task.cancel()
            await asyncio.gather(self._lock_task, return_exceptions=True)
        # Only the queues still this consumer's: one given away (whose hand-over commit failed) belongs to
        # its new owner, and its old offset written now would undo that owner's progress.
        # Changed or not since the last round: an old owner's late hand-over commit, or a broker restarted
        # since, may have set the group's offset back.
        by_broker: dict[str, list[MessageQueue]] = {}
        for mq in [q for q in self._offsets if q in self._owned]:
            by_broker.setdefault(mq.broker_name, []).append(mq)
        await asyncio.gather(*(self._commit_at_shutdown(queues) for queues in by_broker.values()))
        try:
            await self.offset_store.flush()
        except OSError as exc:
            log.error("offsets of %s not saved at shutdown: %s", self.group, exc)
        # And every owned queue: a lock request cut above (lock loop, rebalance) may have been granted on its
        # broker without reaching _locks; unlocking a queue another consumer holds changes nothing.
        held = {*self._locks, *self._owned} if self.orderly else set()
        if held:
            try:      # the next owner need not wait for the locks to expire
                await self.client.unlock_queues(list(held))
            except Exception as exc:  # noqa: BLE001 - each broker's failure was logged; theirs expire
                log.warning("push consumer %s: some queue locks not released at shutdown (%s); they expire on "
                            "their brokers", self.group, exc)
            self._locks.clear()
        await self.client.shutdown()
