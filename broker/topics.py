"""Topic configurations: system topics, auto-creation, persistence (RocketMQ's TopicConfigManager).

Topics live in <store>/config/topics.json, written atomically on change, so a
topic created by a send survives a restart with its queue count. Once the broker
serves, writes leave the event loop: a change marks the catalogue dirty and one
write (serialise, fsync, rename) runs on a config thread at most every 100 ms for
all the changes since -- a flood of new topics costs one write per batch, not a
rewrite of the whole file per topic on the loop. A send to a topic made moments
ago is stored only once it is written (``made_durable``): restored from the
store, a topic has only the queues that hold messages. A crash before the write loses
no message: ``adopt`` restores any topic the store holds queues for, and
``queue_appeared`` one whose first queue comes later (a half committed, a delayed
message delivered after the restart). An operator's change (UPDATE_AND_CREATE_TOPIC,
DELETE_TOPIC_IN_BROKER) is answered only once it is written (``saved``), as RocketMQ's
ConfigManager.persist: restored from the store, a topic has the default settings, not
the queues and perm the operator set, and a deleted one comes back.

Each topic a client made is saved with its maker ("creator": its limits.client_key, at most a /64's 43
characters) and, when another client gave it more queues since, the client its queues are charged to
("queues_by"; null: an operator). Start-up counts them again: max_topics_per_host and max_queues_per_host
hold across restarts, where counts kept in memory only let one address make its limit again after every
restart. A catalogue written before ("creators_recorded" missing) charges its topics to no client, said once.
So are the makers of %RETRY% topics reclaimed lately ("reclaimed": [[topic, maker, unix ms], ...], see _reclaim):
a delayed retry delivered after a restart makes its topic again charged to its maker, as before one.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from functools import partial

from protocol.admin_bodies import json_members
from protocol.codes import Perm
from protocol.registration import DataVersion
from protocol.txlog import DEAD_TOPIC as TRANS_DLQ_TOPIC
from protocol.txlog import HALF_TOPIC, OP_TOPIC

from .limits import count_down
from .store.saved import DaemonThreads, check, is_int, load_saved, retrieved, save

log = logging.getLogger("txmq.topics")

AUTO_CREATE_TOPIC = "TBW102"
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
# HALF_TOPIC, OP_TOPIC, TRANS_DLQ_TOPIC: the transaction topics, named in protocol/txlog.py
TIMER_TOPIC = "rmq_sys_wheel_timer"                     # RocketMQ 5's timer messages
SCHEDULE_PROGRESS_TOPIC = "rmq_sys_schedule_progress"   # txmq: the scheduler's progress records
RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"

# Producers may not send to these (spec 3.4 step 3).
NO_SEND_TOPICS = frozenset({SCHEDULE_TOPIC, HALF_TOPIC, OP_TOPIC, TRANS_DLQ_TOPIC, "SELF_TEST_TOPIC",
                            "OFFSET_MOVED_EVENT", TIMER_TOPIC, SCHEDULE_PROGRESS_TOPIC})
TRACE_TOPIC = "RMQ_SYS_TRACE_TOPIC"      # message traces of clients with tracing on (trace_topic_enable)
SYSTEM_TOPICS = NO_SEND_TOPICS | {AUTO_CREATE_TOPIC, "BenchmarkTest", TRACE_TOPIC}


_RECLAIM_EVERY_S = 1.0          # at most one sweep for reclaimable %RETRY% topics a second
# A reclaimed %RETRY% topic's maker is kept this long, and for at most so many topics (the oldest go first): a
# send-back's delayed retry, still in SCHEDULE_TOPIC_XXXX when its topic went, makes it again when delivered
# (queue_appeared), charged to that maker. The longest delay level is 2 h.
_RECLAIMED_KEEP_S = 3 * 3600.0
_RECLAIMED_MAX = 65536
# Of those, the newest saved with the catalogue (its "reclaimed"): all 65,536 made every catalogue write about 6 MB
# (and 25 ms on the loop to copy), and one client heartbeating groups it drops reaches them in minutes.
_RECLAIMED_SAVED = 4096


class TopicLimitError(ValueError):
    """A topic was not created because a configured limit was reached; the text names it."""


def reply_topic(cluster: str) -> str:
    """"<cluster>_REPLY_TOPIC" (MixAll.REPLY_TOPIC_POSTFIX): request-reply's replies (processors/reply.py)."""
    return f"{cluster}_REPLY_TOPIC"


SYSTEM_TOPIC_PREFIX = "rmq_sys_"        # TopicValidator.SYSTEM_TOPIC_PREFIX: RocketMQ's own topics


def is_system_topic(topic: str) -> bool:
    return topic in SYSTEM_TOPICS or topic.startswith(SYSTEM_TOPIC_PREFIX)


@dataclass
class TopicConfig:
    name: str
    read_queue_nums: int = 16
    write_queue_nums: int = 16
    perm: int = Perm.READ_WRITE
    filter_type: str = "SINGLE_TAG"
    sys_flag: int = 0
    order: bool = False

    @property
    def queue_count(self) -> int:
        return max(self.read_queue_nums, self.write_queue_nums)


def readable_queue(topics: dict[str, TopicConfig], topic: str, qid: int) -> tuple[int, int]:
    """(the queue a message for ``topic`` queue ``qid`` is written to, the queue count that moved it or 0).
    ``qid``, unless the topic no longer reads it: its queues cut (updateTopic -r 4 -w 4 on a topic of 8) while
    the message waited -- in SCHEDULE_TOPIC_XXXX (a delay, a timer, a retry) or as a transaction's half until
    its COMMIT -- where RocketMQ 4.9.8 writes REAL_QID, a queue no consumer reads, nothing said. Then
    ``qid`` modulo the topic's read queue count (a retry topic's: the smaller of its read and write counts, as
    one past its retryQueueNums gets no more retries). A topic not there (or reading none) is left as it is: a
    retry's is made again with the queues it needs (TopicManager.queue_appeared)."""
    tc = topics.get(topic)
    if tc is None:
        return qid, 0
    if qid < tc.read_queue_nums and qid < tc.write_queue_nums:     # (every COMMIT but a cut topic's: no prefix test)
        return qid, 0
    queues = (min(tc.read_queue_nums, tc.write_queue_nums) if topic.startswith(RETRY_PREFIX)
              else tc.read_queue_nums)
    if queues <= 0 or qid < queues:
        return qid, 0
    return qid % queues, queues


class TopicManager:
    def __init__(self, config_dir: str, *, auto_create: bool, default_queue_nums: int, cluster: str, broker: str,
                 max_retry_groups: int = 1 << 30, trace_topic: bool = False, per_host: bool = True):
        self.path = os.path.join(config_dir, "topics.json")
        self.auto_create = auto_create
        self.max_retry_groups = max_retry_groups
        # False on a slave: its topics follow its master's (topic_follower), made for no client, and no per-host
        # cap is counted or enforced there; creators read from the catalogue are not kept.
        self.per_host = per_host
        self._loop = None                   # set by start_background: writes then go to _pool
        self._pool: DaemonThreads | None = None
        self._write_scheduled = False
        self._dirty = False                 # changed since the last catalogue write that succeeded
        self._changes = 0                   # changes made (_persist); a snapshot carries the count it holds
        self._saved_changes = 0             # the count of the newest catalogue on disk (``saved``)
        self._saving: asyncio.Future | None = None     # the write ``saved`` callers wait for
        self._write_failing = False         # the last write failed: it is retried every retry_write_s
        self.retry_write_s = 5.0
        # How long a send to a new topic waits for the catalogue write that holds it: one that HANGS (a stopped NFS,
        # a stuck FUSE) held every new topic's sends and send-backs with no answer for as long, each one's frame
        # kept. Under a stock producer's 3 s send timeout; past it they go on unsaved, as when a write fails.
        self.write_wait_s = 2.0
        self.write_hung = False             # a write has run past write_wait_s and not ended yet
        self._writes = 0                    # writes handed to the config thread and not ended (_start_write)
        self._batch_deferred = False        # _write_batch came while one was under way: it runs once they end
        self._last_write = None
        # Topics made since the catalogue was last written, each with the change count that made it, or, once a
        # send to it waits (``made_durable``), the future it waits on. Empty nearly always: a send looks at it.
        self.unsaved: dict[str, int | asyncio.Future] = {}
        self._waiting: dict[asyncio.Future, list] = {}     # each gate's sends (``when_durable``), in order
        self._regrown: dict[str, int] = {}     # topic -> the change that grew it while its gate's write ran (grow)
        self.topics: dict[str, TopicConfig] = {}
        self._restored: set[str] = set()    # topics the store's queues made again (adopt, queue_appeared)
        # Who made each topic a client made (limits.client_key), and how many each holds: max_topics_per_host.
        # Saved with the topic in the catalogue and counted again at start-up.
        self._creator: dict[str, str] = {}
        self._created_by: dict[str, int] = {}
        # The consume queues each topic counts for (max_queues, max_queues_per_host): the most it was given since
        # it was made -- a topic made smaller keeps the consume queues it had, as RocketMQ's does, until deleted --
        # and the client they are charged to: who made the topic, or who last gave it more queues
        # (UPDATE_AND_CREATE_TOPIC). Saved as _creator is; queue_total counts every topic's.
        self._queues: dict[str, int] = {}
        self.queue_total = 0
        self._queue_owner: dict[str, str] = {}
        self._queues_by: dict[str, int] = {}
        # Set by the server: may this %RETRY% topic go when max_retry_groups is reached (its group gone, nothing
        # in it)? Swept at most once a _RECLAIM_EVERY_S, so a client at the cap cannot make every heartbeat a scan.
        self.retry_reclaimable = None
        self._reclaimed_at = -_RECLAIM_EVERY_S
        self._host_swept_at: dict[str, float] = {}     # the same, for a client at max_topics_per_host (room_for)
        self._reclaimed: dict[str, tuple[str, float]] = {}  # %RETRY% topic reclaimed -> (its maker, when)
        # Name servers re-read the topic table when this changes; on_change (the registrar) registers at once.
        self.data_version = DataVersion(int(time.time() * 1000), 0)
        self.on_change = None
        self._system = {
            AUTO_CREATE_TOPIC: TopicConfig(AUTO_CREATE_TOPIC, default_queue_nums, default_queue_nums,
                                           Perm.INHERIT | Perm.READ_WRITE if auto_create else Perm.READ_WRITE),
            HALF_TOPIC: TopicConfig(HALF_TOPIC, 1, 1),
            OP_TOPIC: TopicConfig(OP_TOPIC, 1, 1),
            TRANS_DLQ_TOPIC: TopicConfig(TRANS_DLQ_TOPIC, 1, 1),
            SCHEDULE_TOPIC: TopicConfig(SCHEDULE_TOPIC, 18, 18),
            TIMER_TOPIC: TopicConfig(TIMER_TOPIC, 1, 1),
            SCHEDULE_PROGRESS_TOPIC: TopicConfig(SCHEDULE_PROGRESS_TOPIC, 1, 1),
            "SELF_TEST_TOPIC": TopicConfig("SELF_TEST_TOPIC", 1, 1),
            "OFFSET_MOVED_EVENT": TopicConfig("OFFSET_MOVED_EVENT", 1, 1),
            cluster: TopicConfig(cluster, 16, 16, Perm.INHERIT | Perm.READ_WRITE),
            # Where repliers send replies to request messages (their CLUSTER property names it): it must have a
            # route before any reply is sent, as RocketMQ's TopicConfigManager makes it.
            reply_topic(cluster): TopicConfig(reply_topic(cluster), 1, 1),
            broker: TopicConfig(broker, 1, 1, Perm.INHERIT | Perm.READ_WRITE),
        }
        os.makedirs(config_dir, exist_ok=True)
        self._load()
        for name, tc in self._system.items():
            self.topics.setdefault(name, tc)
        self.topics[AUTO_CREATE_TOPIC] = self._system[AUTO_CREATE_TOPIC]
        for tc in self.topics.values():
            self._count_queues(tc.name, tc.queue_count)
        self._charge_saved()
        # As RocketMQ's TopicConfigManager with traceTopicEnable, but only when missing and then kept in the
        # catalogue like any topic: one made before (auto-created with more queues) keeps its queues, and
        # turning the option off later does not take the traces already stored out of the routes.
        if trace_topic and TRACE_TOPIC not in self.topics:
            self.create(TopicConfig(TRACE_TOPIC, 1, 1))

    def _load(self) -> None:
        # The previous save: without it the next write of the catalogue would replace the damaged (or lost) one
        # for good, every topic's settings (queues, permissions, order) back to the defaults.
        topics = self._saved = load_saved(self.path, _parse_catalogue, "topics catalogue", log,
                            fallback_cost="at most one save older: a topic made or changed since is restored "
                                          "from the store with default settings, or made again on use",
                            reset_hint="move both away to start with default settings (topics with messages "
                                       "are restored from the store; set the others again with updateTopic)")
        for tc in topics or ():
            self.topics[tc.name] = tc
        # Made again from the store's queues, kept so across restarts: a delayed message for a higher queue
        # may come after one (queue_appeared grows them, never a config set by hand or by a send).
        self._restored.update(getattr(topics, "restored", ()))

    def _charge_saved(self) -> None:
        """Count again what each client made, as the catalogue says (``_load``)."""
        saved, self._saved = self._saved, None
        if saved is None or not self.per_host:
            return
        now, wall = time.monotonic(), time.time()
        for name, maker, at in saved.reclaimed:         # oldest first, as _reclaim keeps them
            age = wall - at / 1000
            if name not in self.topics and age < _RECLAIMED_KEEP_S:
                self._reclaimed[name] = (maker, now - max(0.0, age))    # (a clock set back: as if just now)
        for name, creator in saved.creators.items():
            if name in self.topics and name not in self._system:
                self._creator[name] = creator
                self._created_by[creator] = self._created_by.get(creator, 0) + 1
        for name in self.topics:
            owner = saved.queue_owners.get(name, self._creator.get(name))
            if owner is not None and name not in self._system:
                self._own_queues(name, owner)
        if not saved.creators_recorded:
            mine = sum(1 for name in self.topics if name not in self._system)
            if mine:
                log.warning("topics catalogue %s was written before topics' creators were recorded: its %d topics "
                            "are charged to no client (max_topics_per_host and max_queues_per_host count the "
                            "topics made from now on; an older version or a slave wrote it)", self.path, mine)

    def start_background(self, loop) -> None:
        """From now on, catalogue writes are batched on a config thread, off ``loop``."""
        self._loop = loop
        self._pool = DaemonThreads("txmq-topics")

    async def close(self) -> None:
        """Write what is pending and stop the config thread."""
        if self._pool is None:
            return
        loop, self._loop = self._loop, None
        pool, self._pool = self._pool, None
        # On the config thread, after any write still running there: skipped when nothing changed. Bounded: behind
        # a write that hangs (a stopped NFS) the stop waited for ever, and what closes after the topics (the
        # subscription groups, the consumer offsets) was never saved. Given up, the catalogue is as its last
        # write left it: a topic without messages made since is lost, the others restored from the store.
        bound = self.write_wait_s if (self.write_hung or self._writes) else 5 * self.write_wait_s
        last = loop.run_in_executor(pool, self._write_if_dirty, self._snapshot())
        last.add_done_callback(retrieved)
        try:
            await asyncio.wait_for(asyncio.shield(last), bound)
        except TimeoutError:
            log.error("topics catalogue %s not written at stop: a write has not ended in %g s (a hung disk or a "
                      "stopped network file system?); stopping without it (topics with messages are restored "
                      "from the store at start-up, one without messages made since is lost)", self.path, bound)
        except OSError as exc:          # a full disk must not turn a clean stop into a crash
            log.error("topics catalogue %s not written at stop (topics are restored from the store at "
                      "start-up): %s", self.path, exc)
        finally:
            pool.shutdown(wait=False)

    def _persist(self) -> None:
        self._dirty = True
        self._changes += 1
        self.data_version = DataVersion(int(time.time() * 1000), self.data_version.counter + 1)
        if self.on_change is not None:
            self.on_change()
        if self._loop is None:
            self._write(self._snapshot())
        elif not self._write_scheduled:
            self._write_scheduled = True
            self._loop.call_later(0.1, self._write_batch)

    async def saved(self) -> None:
        """``_saved_all``, bounded: OSError (ETIMEDOUT) once a write has run ``write_wait_s`` without ending, at
        once while one hangs (``write_hung``). For the operators' codes and a slave's sync: behind a write that
        hung (a stopped NFS) an UPDATE_AND_CREATE_TOPIC or DELETE_TOPIC_IN_BROKER was never answered, and every
        later one waited on the same write, each held with its connection; a slave's topic sync stopped for good,
        said by nothing. They are answered SYSTEM_ERROR "not saved" instead (as the groups' and offsets' codes), the
        change kept in memory and written with the next write that ends."""
        if self.write_hung:
            raise self._hung_error()
        try:
            await self._saved_within()
        except TimeoutError:
            raise self._hung_error() from None

    def _hung_error(self) -> OSError:
        return OSError(errno.ETIMEDOUT, f"a write of {self.path} has not ended in {self.write_wait_s:g} s (a hung "
                                        "disk or a stopped network file system?)")

    async def _saved_all(self) -> None:
        """Return once every change made so far is in the catalogue on disk (written now, on the config thread,
        unless a write since did it); OSError when it cannot be. For the operators' codes: UPDATE_AND_CREATE_TOPIC
        and DELETE_TOPIC_IN_BROKER answered SUCCESS while the batched write was still up to 100 ms away, and a
        broker killed then came back with the topic's old settings, a new topic missing (made again by the next
        send with the default queues and perm), or a deleted topic back.

        Callers at once share the writes (group commit): one running, the next starts when it ends, with every
        change made meanwhile -- a burst of N updates costs two writes, not N queued each with its snapshot."""
        wanted = self._changes
        while self._pool is not None and self._saved_changes < wanted:
            if self._saving is None:
                self._saving = asyncio.ensure_future(self._save_now())
                self._saving.add_done_callback(retrieved)  # (its failure is logged by _written)
            await asyncio.shield(self._saving)

    async def _save_now(self) -> None:
        try:
            await self._start_write()     # failed: logged once and retried, as a batch's (_written)
        finally:
            self._saving = None

    def made_durable(self, topic: str) -> asyncio.Future | None:
        """None when ``topic`` was not made (nor grown: ``grow``) since the catalogue was last written; else a future
        done once it is written (at once, on the config thread, as ``saved``), the same for every send to the topic
        until then.

        For the sends that make a topic (processors/send.py; a slave's sync waits with ``saved``): answered SEND_OK while
        the batched write was still up to 100 ms away, a broker killed then came back with the topic restored from
        the store's queues -- one queue when only queue 0 held a message, where clients held a route of four, and
        each send to queues 1-3 was refused SYSTEM_ERROR "queueId illegal" for good. Such sends wait before they
        are stored (``when_durable``), so they keep their order: they run in the order they came, in the step
        the topic leaves ``unsaved``, before any later send is looked at. Only the first sends to a
        new topic wait, and they share the coalesced writes (a flood of new topics: one write at a time)."""
        held = self.unsaved.get(topic)
        if held is None or held.__class__ is not int:
            return held
        if held <= self._saved_changes or self._pool is None or self.write_hung:
            del self.unsaved[topic]     # written meanwhile, or a write hangs (``_saved_within``): nothing to wait for
            return None
        gate = self._loop.create_future()
        self.unsaved[topic] = gate
        asyncio.ensure_future(self._saved_within()).add_done_callback(partial(self._topic_saved, topic, gate))
        return gate

    async def _saved_within(self) -> None:
        """``_saved_all``, given up (TimeoutError) after ``write_wait_s``: the write goes on, the sends waiting for it
        do not (``_topic_saved``), nor do those to topics made while it hangs (``made_durable``)."""
        saving = asyncio.ensure_future(self._saved_all())
        saving.add_done_callback(retrieved)
        try:
            await asyncio.wait_for(asyncio.shield(saving), self.write_wait_s)
        except TimeoutError:
            if not saving.done():
                self._hung()
            raise

    def _start_write(self) -> asyncio.Future:
        """A catalogue write of the topics as they are now, on the config thread. One that has not ended in
        ``write_wait_s`` sets ``write_hung`` whoever waits for it: set only by a send that waited, the gauge read 0
        under a write hung by a heartbeat's or an operator's change."""
        fut = self._loop.run_in_executor(self._pool, self._write, self._snapshot())
        self._writes += 1
        timer = self._loop.call_later(self.write_wait_s, lambda: fut.done() or self._hung())
        fut.add_done_callback(lambda f: (timer.cancel(), self._written(f)))
        return fut

    def _hung(self) -> None:
        if not self.write_hung:
            self.write_hung = True      # until no write is under way (``_written``)
            log.error("topics catalogue %s: a write has not ended in %g s (a hung disk or a stopped network "
                      "file system?): sends to new topics go on without waiting for it (a topic without "
                      "messages and a topic's settings are lost if the broker stops before it is written)",
                      self.path, self.write_wait_s)

    def when_durable(self, topic: str, run) -> bool:
        """False when ``topic`` has nothing to wait for (``made_durable``); else ``run()`` is called once it is
        written, after the sends that waited before it, in the very step the topic leaves ``unsaved``.

        Not a callback of the gate: those run a loop turn after it is done, and a send read in between (the
        next frame of the same connection) found the topic gone from ``unsaved`` and was stored ahead of the
        sends that had waited -- an async or orderly producer's messages swapped in their queue."""
        gate = self.made_durable(topic)
        if gate is None:
            return False
        self._waiting.setdefault(gate, []).append(run)
        return True

    def _topic_saved(self, topic: str, gate: asyncio.Future, saving: asyncio.Future) -> None:
        # A write that failed was logged (``_written``) and is retried: the sends go on, their messages restored
        # from the store's queues should the broker stop before the catalogue is written, as before.
        retrieved(saving)
        if (self._regrown.get(topic, 0) > self._saved_changes and self._pool is not None
                and not saving.cancelled() and saving.exception() is None):
            # grown after the snapshot this write took: the gate (its sends in order) waits for the next write
            asyncio.ensure_future(self._saved_within()).add_done_callback(partial(self._topic_saved, topic, gate))
            return
        self._regrown.pop(topic, None)
        if self.unsaved.get(topic) is gate:
            del self.unsaved[topic]
        if not gate.done():
            gate.set_result(None)
        for run in self._waiting.pop(gate, ()):     # now, in order: no later send can come between
            try:
                run()
            except Exception:  # noqa: BLE001 - a bug in one send must not strand the others
                log.exception("a send waiting for topic %s to be written failed", topic)

    def _forget_saved(self) -> None:
        """Drop from ``unsaved`` the topics a catalogue write just took that no send waits on."""
        done = self._saved_changes
        for name in [n for n, held in self.unsaved.items() if held.__class__ is int and held <= done]:
            del self.unsaved[name]

    def _write_batch(self) -> None:
        self._write_scheduled = False
        if self._pool is None or self._saved_changes >= self._changes:     # (``saved`` wrote them already)
            return
        if self._writes:
            # After the write under way, with every change made meanwhile: queued behind a write that hangs, one
            # every 100 ms of changes piled up on the config thread, each with its copy of the topic list.
            self._batch_deferred = True
            return
        self._start_write()

    def _written(self, fut) -> None:
        self._writes -= 1
        if fut.cancelled() and self._loop is None:
            # the loop's end cancelled a write a stop gave up (``close``): still under way on the config thread,
            # not ended, not written
            return
        if self.write_hung and not self._writes:
            self.write_hung = False
            log.warning("topics catalogue %s: the write that hung has ended", self.path)
        exc = None if fut.cancelled() else fut.exception()
        if exc is None:
            if self.unsaved:
                self._forget_saved()
            if self._batch_deferred and not self._writes:
                self._batch_deferred = False
                if self._loop is not None and not self._write_scheduled:
                    self._write_scheduled = True
                    self._loop.call_soon(self._write_batch)
            if self._write_failing:
                self._write_failing = False
                log.warning("topics catalogue %s written again", self.path)
            return
        self._batch_deferred = False    # the retry below writes them
        if not self._write_failing:     # once per failure run: each retry would say the same
            self._write_failing = True
            log.error("topics catalogue %s not written, retrying every %g s (a topic without messages and a "
                      "topic's settings are lost if the broker stops before it is; topics with messages are "
                      "restored from the store at start-up): %s", self.path, self.retry_write_s, exc)
        # Not only at the next topic change, which may never come: a full disk usually frees up.
        if self._loop is not None and not self._write_scheduled:
            self._write_scheduled = True
            self._loop.call_later(self.retry_write_s, self._write_batch)

    def _snapshot(self) -> tuple:
        """On the loop: what a catalogue write needs. TopicConfigs are replaced, never mutated, and the creator
        tables are copied, so the write, on the config thread, sees one consistent state."""
        now, wall = time.monotonic(), time.time()
        reclaimed = []
        for name, (maker, when) in reversed(self._reclaimed.items()):     # newest first; kept oldest first
            if len(reclaimed) >= _RECLAIMED_SAVED or now - when >= _RECLAIMED_KEEP_S:
                break
            reclaimed.append([name, maker, int((wall - (now - when)) * 1000)])
        reclaimed.reverse()
        return list(self.topics.values()), dict(self._creator), dict(self._queue_owner), reclaimed, self._changes

    def _write_if_dirty(self, snapshot: tuple) -> None:
        if self._dirty:
            self._write(snapshot)

    def _write(self, snapshot: tuple) -> None:
        self._dirty = False             # a change made while this write runs sets it again
        topics, creators, owners, reclaimed, changes = snapshot
        restored = self._restored       # membership only, from this thread: the loop may change it meanwhile
        catalogue = {"topics": [_entry(t, t.name in restored, creators.get(t.name), owners.get(t.name))
                                for t in topics if t.name not in self._system]}
        if self.per_host:   # a slave records none: promoted, it says so at start rather than charge all to no one
            catalogue = {"creators_recorded": True, **catalogue}
        if reclaimed:
            catalogue["reclaimed"] = reclaimed
        body = json.dumps(catalogue, indent=1)
        try:
            save(self.path, body.encode())  # (its directory synced too: the rename is durable)
            self._saved_changes = max(self._saved_changes, changes)
        except OSError:     # (save removed its cut-short .tmp)
            self._dirty = True
            raise

    def retry_groups(self) -> int:
        return sum(1 for name in self.topics if name.startswith(RETRY_PREFIX))

    def routes_changed(self) -> None:
        """Something routes carry changed without a topic changing (the broker permission): a new data version,
        so name servers read the table again, and a registration now."""
        self.data_version = DataVersion(int(time.time() * 1000), self.data_version.counter + 1)
        if self.on_change is not None:
            self.on_change()

    def system_topics(self) -> list[str]:
        """The system topics held (GET_SYSTEM_TOPIC_LIST_FROM_BROKER): those made at start, cluster and broker
        names among them, and any other system name in the catalogue (the trace topic)."""
        return sorted(n for n in self.topics if n in self._system or is_system_topic(n))

    def get(self, topic: str) -> TopicConfig | None:
        return self.topics.get(topic)

    def created_by(self, client: str) -> int:
        """How many of the topics there are ``client`` (a limits.client_key) created."""
        return self._created_by.get(client, 0)

    def queues_of(self, client: str) -> int:
        """How many consume queues the topics charged to ``client`` (a limits.client_key) count for."""
        return self._queues_by.get(client, 0)

    def queues_counted(self, topic: str) -> tuple[int, str | None]:
        """(the queues ``topic`` counts for, the client they are charged to); (0, None) for no such topic."""
        return self._queues.get(topic, 0), self._queue_owner.get(topic)

    def room_for(self, client: str, limit: int) -> bool:
        """Whether ``client`` created fewer than ``limit`` of the topics there are; at it, its own %RETRY% topics
        that may go (``retry_reclaimable``: group gone, nothing in it) are forgotten first, at most one sweep a
        _RECLAIM_EVERY_S for each client. Else a host whose consumer groups come and go was held at its limit by
        the retry topics of groups long gone, every new group of its left without one, while max_retry_groups,
        far from reached, never swept."""
        if not self.per_host or self._created_by.get(client, 0) < limit:
            return True
        self.reclaim_retry_of(client, f"max_topics_per_host={limit}")
        return self._created_by.get(client, 0) < limit

    def reclaim_retry_of(self, client: str, why: str) -> bool:
        """Forget ``client``'s own %RETRY% topics that may go (``retry_reclaimable``), at most one sweep a
        _RECLAIM_EVERY_S for each client: it is at a limit (``why``, logged) of its own. True if any went."""
        now = time.monotonic()
        if self.retry_reclaimable is None or now - self._host_swept_at.get(client, -_RECLAIM_EVERY_S) < _RECLAIM_EVERY_S:
            return False
        if len(self._host_swept_at) >= 4096:      # forget clients not swept for a while: they lose nothing
            self._host_swept_at = {h: t for h, t in self._host_swept_at.items() if now - t < _RECLAIM_EVERY_S}
        self._host_swept_at[client] = now
        gone = [name for name, maker in self._creator.items()
                if maker == client and name.startswith(RETRY_PREFIX) and self.retry_reclaimable(name)]
        for name in gone:
            self._reclaim(name, now)
        if gone:
            self._persist()
            log.warning("client %s at %s: %d of its empty %%RETRY%% topics of groups with no "
                        "consumer forgotten (e.g. %s)", client, why, len(gone), gone[0])
        return bool(gone)

    def reclaim_retry(self, why: str) -> bool:
        """Forget every %RETRY% topic that may go (``retry_reclaimable``), at most one sweep a _RECLAIM_EVERY_S
        (shared with max_retry_groups'): the broker is at a limit (``why``, logged). True if any went."""
        now = time.monotonic()
        if self.retry_reclaimable is None or now - self._reclaimed_at < _RECLAIM_EVERY_S:
            return False
        self._reclaimed_at = now
        gone = [name for name in self.topics if name.startswith(RETRY_PREFIX) and self.retry_reclaimable(name)]
        for name in gone:
            self._reclaim(name, now)
        if gone:
            self._persist()
            log.warning("%s reached: %d empty %%RETRY%% topics of groups with no consumer forgotten (e.g. %s)",
                        why, len(gone), gone[0])
        return bool(gone)

    def create(self, tc: TopicConfig, creator: str | None = None, *, copied: bool = False) -> TopicConfig:
        """Make or replace ``tc``; ``creator``: the client making it (a new topic is counted as its own).
        ``copied``: (slave) its master's (``follow``): the master held the limits, and the caller says in one line
        what it copied (8,000 topics were 8,000 INFO lines at a slave's first sync)."""
        if not self.per_host:
            creator = None
        new = tc.name not in self.topics
        if not new and self.topics[tc.name] == tc and tc.name not in self._restored:
            # As it is: routes registered again (RocketMQ's registerIncrementBrokerData), nothing to write. Marked
            # changed, each such UPDATE_AND_CREATE_TOPIC (any client's, without an ACL) waited for a whole-catalogue
            # write of its own (``saved``; 8,000 topics: about 0.7 s of a core): a loop of them, writes without end.
            self.routes_changed()
            return self.topics[tc.name]
        if tc.name.startswith(RETRY_PREFIX) and new and not copied:
            if self.retry_groups() >= self.max_retry_groups and not self._reclaim_retry_topics():
                raise TopicLimitError(f"retry topic {tc.name} not created: {self.max_retry_groups} %RETRY% "
                                      f"groups exist, the limit (max_retry_groups)")
        if new:
            self._reclaimed.pop(tc.name, None)
            if creator is not None:
                self._charge(tc.name, creator)
        elif tc.queue_count > self._queues.get(tc.name, 0):
            self._own_queues(tc.name, creator)      # who gives it more queues holds them all (None: an operator)
        self.topics[tc.name] = tc
        self._count_queues(tc.name, tc.queue_count)
        self._restored.discard(tc.name)     # set by hand (or by a send) now: queue_appeared leaves it alone
        self._persist()
        if new and self._loop is not None:
            self.unsaved[tc.name] = self._changes
        if not copied:
            log.info("topic %s: %d read / %d write queues, perm %d", tc.name, tc.read_queue_nums,
                     tc.write_queue_nums, tc.perm)
        return tc

    def _reclaim_retry_topics(self) -> bool:
        """At max_retry_groups: forget the %RETRY% topics ``retry_reclaimable`` allows; True if there is room now.

        Without it the cap was reclaimed only by deleting groups by hand: a client that heartbeat made-up group
        names once (or a thousand short-lived test groups) left every later consumer group with no retry topic
        for good, its failed messages refused NO_PERMISSION. A topic that holds no message has nothing to lose,
        and its group makes it again with its next heartbeat."""
        self.reclaim_retry(f"max_retry_groups={self.max_retry_groups}")
        return self.retry_groups() < self.max_retry_groups

    def for_send(self, topic: str, default_topic: str | None, default_queue_nums: int,
                 creator: str | None = None) -> TopicConfig | None:
        """The topic's config, creating it from its template as RocketMQ does; None: TOPIC_NOT_EXIST."""
        tc = self.topics.get(topic)
        if tc is not None:
            return tc
        tc = self.auto_config(topic, default_topic, default_queue_nums)
        return None if tc is None else self.create(tc, creator)

    def auto_config(self, topic: str, default_topic: str | None, default_queue_nums: int) -> TopicConfig | None:
        """The config a send to the unknown ``topic`` would create it with (not made yet); None: none may be."""
        if topic.startswith(RETRY_PREFIX) or topic.startswith(DLQ_PREFIX):
            return TopicConfig(topic, 1, 1)
        template = self.topics.get(default_topic or AUTO_CREATE_TOPIC)
        if template is None or not template.perm & Perm.INHERIT:
            return None
        nums = max(1, min(default_queue_nums, template.write_queue_nums))
        return TopicConfig(topic, nums, nums, template.perm & ~Perm.INHERIT, template.filter_type)

    def adopt(self, queues: list[tuple[str, int]]) -> list[str]:
        """Topics the store holds queues for but the config lost (a crash before it was written,
        a deleted topics.json): serve them again rather than hide their messages. Every topic counts for the
        queues the store holds (max_queues): one made smaller before a restart still has their files."""
        found: dict[str, int] = {}
        for topic, qid in queues:
            found[topic] = max(found.get(topic, 0), qid + 1)
        adopted = [t for t in found if t not in self.topics]
        for topic, queues in found.items():     # a topic made smaller keeps its queues' files: it counts for them
            if topic in self.topics:
                self._count_queues(topic, queues)
        for topic in adopted:
            self._restore(topic, found[topic], "restored from the store")
        if adopted:
            self._persist()
        return adopted

    def queue_appeared(self, topic: str, queue_id: int) -> None:
        """A new record made a consume queue that did not exist (the store's ``on_new_queue``).

        ``adopt`` restores at start-up only the topics with queues on disk. A topic that held nothing yet but
        messages waiting to be delivered -- halves whose REAL_TOPIC it is, scheduled messages -- had none, and
        when a crash came before the catalogue was written its config was gone: their commit or delivery, later,
        put acknowledged messages in a queue consumers were answered TOPIC_NOT_EXIST for. Such a topic is made
        again here, read-write, with the queues the store shows (registered at once, as any new topic), and a
        topic made so (here or by ``adopt``) grows to a queue id found later. A topic an operator deleted lost
        its queues with it: only a new message for it, as a send would, makes it again."""
        tc = self.topics.get(topic)
        if tc is None:
            self._restore(topic, queue_id + 1, "made again for a new message in its consume queue")
            reclaimed = self._reclaimed.pop(topic, None)
            if reclaimed is not None and time.monotonic() - reclaimed[1] < _RECLAIMED_KEEP_S:
                # a %RETRY% topic forgotten as idle while a delayed retry was on its way: its maker's again (even
                # past its limit: the message is stored), as it would be had it never been forgotten
                self._charge(topic, reclaimed[0])
        elif topic in self._restored and queue_id >= tc.queue_count:
            self.topics[topic] = TopicConfig(topic, queue_id + 1, queue_id + 1)
            self._count_queues(topic, queue_id + 1)
            log.warning("topic %s (restored from the store) grown from %d to %d queues for a message in queue %d",
                        topic, tc.queue_count, queue_id + 1, queue_id)
        else:
            return
        self._persist()

    def _restore(self, topic: str, queues: int, how: str) -> None:
        self.topics[topic] = TopicConfig(topic, queues, queues)
        self._count_queues(topic, queues)
        self._restored.add(topic)
        log.warning("topic %s was missing from %s; %s with %d queues, perm read-write", topic, self.path, how,
                    queues)

    def _reclaim(self, topic: str, now: float) -> None:
        """Forget an idle %RETRY% topic (room_for, _reclaim_retry_topics), keeping who made it: "idle" means nothing
        stored in it, and a delayed retry sent back before may still be on its way. Delivered, it makes the topic
        again (queue_appeared), charged to that maker: else a host at max_topics_per_host sending back with a
        delay under group after group had each sweep give its room back while every topic came back, and filled
        max_topics alone."""
        creator = self._creator.get(topic)
        self._forget(topic)
        if creator is None:
            return
        kept = self._reclaimed
        kept[topic] = (creator, now)
        while kept:
            oldest, (_, when) = next(iter(kept.items()))
            if len(kept) <= _RECLAIMED_MAX and now - when < _RECLAIMED_KEEP_S:
                break
            del kept[oldest]

    def _charge(self, topic: str, creator: str) -> None:
        self._creator[topic] = creator
        self._created_by[creator] = self._created_by.get(creator, 0) + 1
        self._own_queues(topic, creator)

    def _count_queues(self, topic: str, queues: int) -> None:
        """``topic`` has ``queues`` queues now: it counts for them if that is more than it did."""
        grown = queues - self._queues.get(topic, 0)
        if grown <= 0:
            return
        self._queues[topic] = queues
        self.queue_total += grown
        owner = self._queue_owner.get(topic)
        if owner is not None:
            self._queues_by[owner] += grown

    def _own_queues(self, topic: str, client: str | None) -> None:
        """Charge the queues ``topic`` counts for to ``client`` (None: to nobody) instead of their owner."""
        n = self._queues.get(topic, 0)
        owner = self._queue_owner.pop(topic, None)
        if owner is not None:
            _take(self._queues_by, owner, n)
        if client is not None:
            self._queue_owner[topic] = client
            self._queues_by[client] = self._queues_by.get(client, 0) + n

    def _forget(self, topic: str) -> TopicConfig | None:
        self._restored.discard(topic)
        creator = self._creator.pop(topic, None)
        if creator is not None:
            count_down(self._created_by, creator)
        self._own_queues(topic, None)
        self.queue_total -= self._queues.pop(topic, 0)
        return self.topics.pop(topic, None)

    def delete(self, topic: str) -> bool:
        """Forget a topic's config (DELETE_TOPIC_IN_BROKER); False when it had none."""
        self._reclaimed.pop(topic, None)
        if self._forget(topic) is None:
            return False
        self._persist()
        log.warning("topic %s deleted", topic)
        return True

    def follow(self, table: dict[str, TopicConfig]) -> tuple[list[str], list[str]]:
        """(Slave) take its master's topics (GET_ALL_TOPIC_CONFIG, ``parse_topic_table``) for its own, as RocketMQ's
        SlaveSynchronize does: each topic's queues, perm and order become the master's. Returns (set, gone): the
        topics set here, and those the master no longer has, which the caller deletes as the master did
        (config and queues). System topics are each broker's own making, neither set nor deleted (none can be
        deleted on the master; a Java master's BenchmarkTest has 1,024 queues)."""
        changed = [tc for name, tc in table.items() if not self._own(name) and self.topics.get(name) != tc]
        for tc in changed:
            # its master's limits, not this broker's: a master at max_retry_groups that forgot an idle %RETRY%
            # topic and made another had the slave (still holding the old one) refuse the new one at every sync
            self.create(tc, copied=True)
        gone = [name for name in self.topics if name not in table and not self._own(name)]
        return [tc.name for tc in changed], gone

    def _own(self, name: str) -> bool:
        """A topic this broker makes for itself (its system topics, the cluster's and its own name among them)."""
        return name in self._system or is_system_topic(name)

    def ensure(self, topic: str, queues: int = 1, creator: str | None = None) -> TopicConfig:
        tc = self.topics.get(topic)
        return tc if tc is not None else self.create(TopicConfig(topic, queues, queues), creator)

    def grow(self, topic: str, queues: int, client: str | None) -> TopicConfig | None:
        """At least ``queues`` read and write queues for ``topic`` if it exists (None if not), never fewer: a
        %RETRY% topic made before its group's retryQueueNums was raised (or by a version that ignored it) kept
        its one queue for good. Shrunk, the messages in the queues cut off would never be read again.
        ``client`` (a limits.client_key; None: an operator) is charged all its queues if they grow, as
        ``queue_room`` checked it for: grown with no one named, they were charged to nobody, the maker given its
        room back, and one address heartbeating group after group set to -q 1024 made queues past its limit."""
        tc = self.topics.get(topic)
        if tc is None or (tc.read_queue_nums >= queues and tc.write_queue_nums >= queues):
            return tc
        tc = self.create(TopicConfig(topic, max(tc.read_queue_nums, queues), max(tc.write_queue_nums, queues),
                                     tc.perm, tc.filter_type, tc.sys_flag, tc.order), client)
        # Grown, it waits for its write as a new topic does (``made_durable``): a send-back that grew it picked a
        # queue past the count on disk, and killed before the batched write, the broker came back with the old
        # count while the retry, waiting in SCHEDULE_TOPIC_XXXX, went to a queue no consumer was given.
        if self._loop is not None:
            if self.unsaved.get(topic).__class__ is not asyncio.Future:
                self.unsaved[topic] = self._changes
            else:
                # Its gate's write may have taken its snapshot already: the gate waits for this change too
                # (_topic_saved). Handed that gate as it was, a send-back that grew it here was answered once the
                # topic's making was written, 1 queue of 4 on disk, its retry bound for queue 3.
                self._regrown[topic] = self._changes
        return tc


_WIRE_FIELDS = {"readQueueNums": "read_queue_nums", "writeQueueNums": "write_queue_nums", "perm": "perm",
                "topicFilterType": "filter_type", "topicSysFlag": "sys_flag", "order": "order"}


def parse_topic_table(body: bytes, known=None) -> tuple[tuple, dict[str, TopicConfig] | None]:
    """A GET_ALL_TOPIC_CONFIG body (TopicConfigSerializeWrapper, txmq's or a Java broker's): (its dataVersion as
    (timestamp, counter), its topics; None when the version is ``known``, a full one: 8,000 topics cost 140 ms
    to read beyond the JSON's 30). ValueError for a body of the wrong shape: a slave taking part of it would
    delete the topics it left out. ``read_topic_table`` in one go."""
    reader = read_topic_table(body, known)
    while True:
        try:
            next(reader)
        except StopIteration as done:
            return done.value


# Topics read between two of read_topic_table's steps.
TOPIC_READ_STEP = 512


def read_topic_table(body: bytes, known=None):
    """parse_topic_table a step at a time (a generator: it yields between two steps, and returns what that
    returns): the slave reads its master's table on its loop, the loop running between two steps. Read whole in a
    thread, 50,000 topics (7.7 MB) held the loop all the same, 300-800 ms at every sync (json.loads keeps the GIL
    for the whole call), unchanged tables too: the version, first in txmq's and a Java master's bodies, is now
    known before the table is read."""
    version, table, read = {}, {}, 0
    try:
        for inside, name, entry in json_members(body.decode("utf-8"), "topicConfigTable"):
            if not inside:
                if name == "dataVersion":
                    version = entry or {}
                    check(isinstance(version, dict), f"dataVersion = {version!r}")
                    if version_taken(version, known):      # (before the table: nothing of it read)
                        return known, None
                continue
            check(isinstance(entry, dict) and name != "", f"malformed topic entry {name!r}: {entry!r}")
            fields = {ours: entry[wire] for wire, ours in _WIRE_FIELDS.items() if entry.get(wire) is not None}
            for key, value in fields.items():
                check(_FIELD_TYPES[key](value), f"topic {name}: {key} = {value!r}")
            table[name] = TopicConfig(name, **fields)
            read += 1
            if read % TOPIC_READ_STEP == 0:
                yield
    except (KeyError, UnicodeDecodeError) as exc:
        raise ValueError(f'not {{"topicConfigTable": {{...}}}}: {exc}') from None
    if version_taken(version, known):
        return known, None
    return (version.get("timestamp"), version.get("counter")), table


def version_taken(version: dict, known) -> bool:
    """Whether the table of dataVersion ``version`` (a body's) is the one last taken (``known``, its (timestamp,
    counter)): a full version alone."""
    version = (version.get("timestamp"), version.get("counter"))
    return version == known and None not in version


def _take(counts: dict, key, n: int) -> None:
    """``n`` fewer of ``key`` in ``counts``; a key at zero goes."""
    left = counts.get(key, 0) - n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _entry(tc: TopicConfig, restored: bool, creator: str | None, owner: str | None) -> dict:
    """A topic's catalogue entry: its config, and who it is charged to when anyone is (``_parse_catalogue``)."""
    entry = asdict(tc)
    if restored:
        entry["restored"] = True
    if creator is not None:
        entry["creator"] = creator
    if owner != creator:                # only when another client (or an operator, null) gave it more queues
        entry["queues_by"] = owner
    return entry


def _count(v) -> bool:
    return is_int(v) and v >= 0


_FIELD_TYPES = {"read_queue_nums": _count, "write_queue_nums": _count, "perm": is_int, "sys_flag": is_int,
                "filter_type": lambda v: isinstance(v, str), "order": lambda v: isinstance(v, bool)}


def _parse_catalogue(data) -> list[TopicConfig]:
    """The topics of a catalogue's JSON; ValueError for an entry of the wrong shape (skipping it would bring
    the topic back with the defaults). Fields this version does not know are left out."""
    check(isinstance(data, dict) and isinstance(data.get("topics"), list), 'not {"topics": [...]}')
    out = _Catalogue()
    for entry in data["topics"]:
        check(isinstance(entry, dict) and isinstance(entry.get("name"), str) and entry["name"] != "",
              f"malformed topic entry {entry!r}")
        for key, ok in _FIELD_TYPES.items():
            check(key not in entry or ok(entry[key]), f"topic {entry['name']}: {key} = {entry.get(key)!r}")
        out.append(TopicConfig(entry["name"], **{k: entry[k] for k in _FIELD_TYPES if k in entry}))
        if entry.get("restored") is True:
            out.restored.add(entry["name"])
        # who it is charged to (max_topics_per_host, max_queues_per_host): a client key, bounded as a name is
        for key, into in (("creator", out.creators), ("queues_by", out.queue_owners)):
            if key in entry:
                check((entry[key] is None and key == "queues_by") or _client(entry[key]),
                      f"topic {entry['name']}: {key} = {entry[key]!r}")
                into[entry["name"]] = entry[key]
    out.creators_recorded = data.get("creators_recorded") is True
    reclaimed = data.get("reclaimed", [])
    check(isinstance(reclaimed, list), f"reclaimed = {reclaimed!r}")
    for item in reclaimed:
        check(isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and _client(item[1])
              and is_int(item[2]), f"reclaimed entry {item!r}")
    out.reclaimed = [tuple(item) for item in reclaimed[-_RECLAIMED_MAX:]]
    return out


def _client(v) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 128


class _Catalogue(list):
    """The catalogue's topics, and ``restored``: those made again from the store's queues (TopicManager.adopt,
    queue_appeared), saved as "restored": true (a version without it leaves the key out); ``creators`` and
    ``queue_owners``: who each topic and its queues are charged to, where saved ("creator", "queues_by"; an
    older version's catalogue has neither, and no ``creators_recorded``)."""

    def __init__(self):
        super().__init__()
        self.restored: set[str] = set()
        self.creators: dict[str, str] = {}
        self.queue_owners: dict[str, str | None] = {}
        self.creators_recorded = False
        self.reclaimed: list[tuple[str, str, int]] = []        # (topic, maker, unix ms), oldest first
