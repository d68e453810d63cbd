"""ConsumerOffsets: committed consumer positions, durable across restarts.

``<store_dir>/config/consumerOffset.json``:

    {"<topic>@<group>": {"<queueId>": <offset>, ...}, ...}

Commits only touch memory and mark the table dirty; a task persists a dirty table every
``persist_interval_s`` (--flush-consumer-offset-interval-ms; consumers commit every 5 s,
changed or not, so a kill -9 that loses the last few seconds costs at most a few
redeliveries, never a lost message) and
``close`` persists once more. Each write goes to a temporary file that is fsync'ed and
renamed over the old one, then the directory is fsync'ed: a crash leaves the old table
or the new one, never a torn file. The table replaced is kept as ``consumerOffset.json.bak``
(hard-linked, then renamed): a table damaged or lost later (a disk, a hand) is read from that
copy, logged at ERROR, instead of stopping start-up or, worse, starting every group over.
At start-up the broker lowers offsets past the end of a queue that recovery cut short (``fit``).

Who made each offset (max_offsets_per_host) is saved with the table, so the cap holds across restarts: then the
file is RocketMQ's own wrapper with one more key, which older versions and ops/spark read past,

    {"offsetTable": {...as above...}, "makers": {"<client key>": {"<topic>@<group>": [<queueId>, ...]}}}

A file without "makers" (written before, or by a slave, which counts nothing) charges its offsets to no client.
A master's queues whose offset was forgotten (``forget``), listed to slaves at -1, are saved with it too, oldest first,

    {"offsetTable": {...}, "forgotten": [["<topic>", "<group>", <queueId>], ...]}

so a restart does not bring a forgotten offset back on a slave that had not copied the -1 yet. The groups deleted
(DELETE_SUBSCRIPTIONGROUP) with their offsets kept, whose lag is left out until they come again, are saved with it,

    {"offsetTable": {...}, "deleted": ["<group>", ...]}

else a restart forgot the deletes and brought their lag series back (an alert on a group an operator removed). Once a consumer's
first offset of a queue has been written to the first offsets' journal (offset_journal.py), on a slave too, the
wrapper says the newest line of it the table holds, ``"firsts": <seq>``: a start reads only the lines after it.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
import time
from functools import partial

from protocol.admin_bodies import split_offset_key

from .mapped_file import fsync_dirs, make_dirs
from .offset_journal import FirstsJournal
from .saved import DaemonThreads, check, is_int, load_saved, retrieved, save

log = logging.getLogger("txmq.store")

FILE_NAME = "consumerOffset.json"
# A save an admin move starts (``saved(paced=True)``) begins only once the saver has rested this many times the last
# save's duration since it ended: saves started by moves keep the save thread at most 1 / (1 + REST_FACTOR) busy,
# whatever the clients do, and a tool moving queue after queue waits about (1 + REST_FACTOR) saves a move.
REST_FACTOR = 3
# The most of that rest one stock admin command waits (``saved(max_rest=)``): DELETE_TOPIC_IN_BROKER,
# DELETE_SUBSCRIPTIONGROUP with removeOffset and INVOKE_BROKER_TO_RESET_OFFSET. A stock mqadmin times out after 5 s
# (DefaultMQAdminExt) and then skips its next steps (deleteTopic never deletes the topic from the name server,
# deleteSubGroup never deletes its %RETRY%/%DLQ% topics), and one right after another waited the whole rest (100,000
# offsets: 2.3-5.1 s, a save 0.6-1.2 s). A client looping over them keeps the saver at most S / (S + 1 s) busy (S its
# save; a quarter while 3 S < 1 s). A tool's answered moves (UPDATE_CONSUMER_OFFSET, one per queue) wait the whole rest.
ADMIN_REST_MAX_S = 1.0
# A save's write (after its encode: _check_hung) that has not ended in this long is taken as hung (a stopped NFS, a stuck FUSE): said once at ERROR and by
# ``write_hung`` (txmq_consumer_offsets_write_hung) until it ends; callers of ``saved`` are answered OSError instead of
# waiting for it, and the stop gives its last save up HUNG_CLOSE_WAIT_S after. Above a big table's save on a loaded host
# (200,000 offsets: 14 s seen), not a stuck one.
WRITE_HUNG_S = 30.0
# The most a stop waits for its last save when no write was seen hung (a big table on a slow disk).
CLOSE_WAIT_S = 120.0
# The most it waits once one is said hung (at its start or while it waits): the last save is queued behind that
# write on the saves' one thread and starts only once it ends, which a hung disk gives no reason to expect. Waiting
# ``write_hung_s`` more (30 s) made a stop with config/ hung take ~45 s of systemd's and compose's 60 s.
HUNG_CLOSE_WAIT_S = 2.0


# Queues whose offset was forgotten (``forget``) listed to slaves at -1 (``forgotten``), as a Java master lists the
# -1 it keeps, so each slave forgets its copy too: the newest this many, each until it is committed again. Saved with
# the table (a master's): kept in memory only, one forgotten less than a slave's sync interval (10 s) before the master
# stopped was listed by nothing after its restart, and the slave (putAll) kept the old offset for good.
FORGOTTEN_KEPT = 10_000

FIT_SAID = 10       # offsets lowered at a start said one a line; the rest are summed up in one


def _why_lowered(end: int) -> str:
    if end == 0:
        return ("the queue holds nothing here: its files removed and not rebuilt, its topic deleted, "
                "or the log cut below its first message")
    return "the log was cut after it was committed"


class ConsumerOffsets:
    def __init__(self, store_dir: str, *, persist_interval_s: float = 5.0, per_host: bool = True,
                 clock=time.monotonic, sleep=asyncio.sleep):
        self.clock, self.sleep = clock, sleep
        self.path = os.path.join(store_dir, "config", FILE_NAME)
        self.persist_interval_s = persist_interval_s
        self._table: dict[tuple[str, str, int], int] = {}
        # Which client made each offset (commit's ``client``), and how many each made: max_offsets_per_host.
        # Saved with the table ("makers") and counted again at start-up. Not on a slave (``per_host`` False):
        # its offsets are its master's copies, and it counts and enforces nothing.
        self.per_host = per_host
        self._maker: dict[tuple[str, str, int], str] = {}
        self._made_by: dict[str, int] = {}
        # group -> its topics -> the queue ids of each it holds an offset on: a group's topics without a walk of
        # every offset (GET_CONSUME_STATS of one group walked all of them: mqadmin consumerProgress, asking each
        # group in turn, was O(groups x offsets), and groups that went away months ago keep their offsets), and
        # its offsets, or a topic's, for remove_groups and remove_topic (each walked all 100,000: 15-50 ms of loop).
        self._topics: dict[str, dict[str, list[int]]] = {}
        # topic -> the groups holding an offset on it, changed only as a (group, topic) pair comes or goes in
        # _topics: QUERY_TOPIC_CONSUME_BY_WHO walked every offset, and topicList -c and statsAll ask every topic.
        self._groups: dict[str, set[str]] = {}
        self._forgotten: dict[tuple[str, str, int], None] = {}     # oldest first: FORGOTTEN_KEPT
        # Groups deleted with their offsets kept (metrics.deleted_groups is this set: their lag left out until they
        # come again), saved with the table ("deleted"), the names holding an offset at the save.
        self.deleted: set[str] = set()
        # A consumer's first offsets of queues, each on disk before its answer (commit_first) without a whole save
        self._firsts = FirstsJournal(self.path)
        self._dirty = False
        # What the last background save took (the table, the makers), and the keys changed since: the next one
        # brings that copy up to date with just those keys (_snapshot). None: the next takes a whole copy.
        self._copy: tuple[dict, dict] | None = None
        self._changed: set[tuple[str, str, int]] = set()
        self._task: asyncio.Task | None = None
        self._write_lock = threading.Lock()     # a cancelled background write may still be running
        # Each save is numbered when its table is taken (on the loop); the write of an older one than the newest
        # written is skipped. A cancelled background save still encoding on its thread when close() wrote the
        # newest table took the lock after it, and the file ended one save older.
        self._saves_taken = 0
        self._saves_written = 0
        self._saving: asyncio.Future | None = None     # the write ``saved`` callers wait for
        self._next_write: asyncio.Future | None = None  # any write's end (or hurry): what a paced save waits for
        self._paced: asyncio.Future | None = None       # the save moves wait for: it starts when the rest ends
        self._writing = 0           # writes in flight (the loop's, ``saved``'s)
        self._last_end = float("-inf")  # when the last write ended (``clock``), and what it took: the rest after it
        self._last_took = 0.0
        self._failing = False       # the last save (the loop's or ``saved``'s) was refused: _save_failed
        self._hurry = False         # stopping: a paced save starts at once, without its rest (hurry)
        # The saves' own thread, a daemon (saved.DaemonThreads), made at the first: on the default executor a write
        # that hung kept the interpreter's exit joining its worker, the process never ending.
        self._thread: DaemonThreads | None = None
        self.write_hung_s = WRITE_HUNG_S
        self.hung_close_wait_s = HUNG_CLOSE_WAIT_S
        self.write_hung = False     # a write has run past write_hung_s and not ended yet (_write_off_loop)
        self._io_began: float | None = None   # time.monotonic() the saves' thread began writing (not encoding)
        # Changes made (commit, _remove) and the count the newest file holds: ``saved`` with nothing new writes
        # nothing (a reset that moves no offset, a deleted topic no group consumed). Each forced a whole-table
        # write (100,000 offsets: 1-1.5 s of a core, the loop slowed with it), asked by any client without ACL.
        self._changes = 0
        self._saved_changes = 0
        self._load()

    def _load(self) -> None:
        # The previous save is a few seconds older at most (a few redeliveries), where no table at all would
        # start every group over by its consume-from policy -- skipping what it had not consumed.
        table = load_saved(self.path, _parse_table, "consumer offsets file", log,
                           fallback_cost="at most one save older: groups may see a few messages again",
                           reset_hint=f"move both and {os.path.basename(self._firsts.path)} away to start every group "
                                      "over by its consume-from policy")
        self._table = table or {}
        for key in self._table:
            self._index(key)
        if table is not None:
            self._load_extras(table)
        firsts = self._firsts.load(0 if table is None else table.firsts)
        for _seq, group, topic, queue_id, offset, client in firsts:
            self.commit(group, topic, queue_id, offset, client)      # (dirty: the next save holds them)
        if firsts:
            log.info("consumer offsets: %d first offset(s) of queues committed after the last save read back from "
                     "%s", len(firsts), self._firsts.path)

    def _load_extras(self, table: "_Table") -> None:
        # taken off the table, not left on it as a second copy for good (on a slave, the only one, never read)
        makers, table.makers = table.makers, {}
        forgotten, table.forgotten = table.forgotten, []
        deleted, table.deleted = table.deleted, []
        self.deleted.update(group for group in deleted if group in self._topics)
        if self.per_host:
            self._forgotten = dict.fromkeys(forgotten[-FORGOTTEN_KEPT:])
            self._maker = makers
            for client in makers.values():
                self._made_by[client] = self._made_by.get(client, 0) + 1

    # ------------------------------------------------------------------ API
    def get(self, group: str, topic: str, queue_id: int) -> int | None:
        return self._table.get((group, topic, queue_id))

    def commit(self, group: str, topic: str, queue_id: int, offset: int, client: str | None = None) -> None:
        """Keep ``offset``; ``client``: who commits it (a new offset is counted as that client's, ``made_by``)."""
        key = (group, topic, queue_id)
        was = self._table.get(key)
        if was != offset:
            if was is None:         # a new offset (none is None)
                self._index(key)
                self._forgotten.pop(key, None)
                if client is not None and self.per_host:
                    self._maker[key] = client
                    self._made_by[client] = self._made_by.get(client, 0) + 1
            self._table[key] = offset
            self._changed.add(key)
            self._dirty = True
            self._changes += 1

    def commit_first(self, group: str, topic: str, queue_id: int, offset: int, client: str | None):
        """``commit`` a group's first offset of a queue and return once it is on disk: a line appended to the first
        offsets' journal, shared by every first commit meanwhile (one fsync), not a save of the whole table (which
        cost a pull consumer committing new queue after queue a paced save each: 150 ms a commit at 10,000 offsets,
        past a client's 3 s timeout at 100,000). OSError when it cannot be (ETIMEDOUT past ``write_hung_s``).
        Committed and numbered at once (a save's snapshot holds every line numbered before it); the wait is
        the awaitable returned."""
        self.commit(group, topic, queue_id, offset, client)
        return self._first_written(self._firsts.add(group, topic, queue_id, offset, client))

    async def _first_written(self, line: asyncio.Future) -> None:
        if self.write_hung:
            raise OSError(errno.ETIMEDOUT, f"a consumer offsets write has not ended in {self.write_hung_s:g} s "
                                           "(a hung disk or a stopped network file system?)")
        try:
            await asyncio.wait_for(asyncio.shield(line), self.write_hung_s)
        except TimeoutError:
            exc = OSError(errno.ETIMEDOUT, f"the first offsets' journal {self._firsts.path} has not been written in "
                                           f"{self.write_hung_s:g} s (a hung disk or a stopped network file system?)")
            self._save_failed(exc)
            raise exc from None
        except OSError as exc:
            self._save_failed(exc)
            raise

    def of(self, group: str, topic: str) -> dict[int, int]:
        """``group``'s offsets on ``topic`` by queue id (O(its queues))."""
        return {q: self._table[(group, topic, q)] for q in self._topics.get(group, {}).get(topic, ())}

    def forget(self, group: str, topic: str, queue_id: int) -> None:
        """No offset for the queue any more (a negative commit: RocketMQ keeps it, read back as none)."""
        key = (group, topic, queue_id)
        if key in self._table:
            self._remove([key])
            self._forgotten[key] = None
            if len(self._forgotten) > FORGOTTEN_KEPT:
                del self._forgotten[next(iter(self._forgotten))]

    def forgotten(self) -> list[tuple[str, str, int]]:
        """The queues ``forget`` took the offset of (the newest FORGOTTEN_KEPT), not committed since: listed to
        slaves at -1 (GET_ALL_CONSUMER_OFFSET), as a Java master lists the -1 it keeps."""
        return list(self._forgotten)

    def has(self, group: str, topic: str, queue_id: int) -> bool:
        return (group, topic, queue_id) in self._table

    def made_by(self, client: str) -> int:
        """How many of the offsets there are ``client`` made."""
        return self._made_by.get(client, 0)

    def topics_of(self, group: str) -> list[str]:
        """The topics ``group`` holds an offset on, sorted (O(its topics), not a walk of every offset)."""
        return sorted(self._topics.get(group, ()))

    def groups(self):
        """The groups holding an offset (a view; O(1), not a walk of every offset)."""
        return self._topics.keys()

    def holds(self, group: str, topic: str) -> bool:
        """Whether ``group`` holds an offset on ``topic`` (O(1))."""
        return topic in self._topics.get(group, ())

    def groups_of(self, topic: str) -> set[str]:
        """The groups holding an offset on ``topic`` (a copy; O(those groups), not a walk of every offset)."""
        return set(self._groups.get(topic, ()))

    def _index(self, key: tuple[str, str, int]) -> None:
        group, topic = key[0], key[1]
        topics = self._topics.setdefault(group, {})
        qids = topics.get(topic)
        if qids is None:
            topics[topic] = [key[2]]
            self._groups.setdefault(topic, set()).add(group)
        else:
            qids.append(key[2])

    def remove_group(self, group: str) -> None:
        self.remove_groups({group})

    def remove_groups(self, groups: set[str]) -> None:
        """Every offset of these groups: O(their offsets), not a walk of the table."""
        self._remove([(g, t, q) for g in groups for t, qids in self._topics.get(g, {}).items() for q in qids])
        self._unlist_forgotten(lambda key: key[0] in groups)

    def remove_topic(self, topic: str) -> None:
        self._remove([(g, topic, q) for g in self._groups.get(topic, ()) for q in self._topics[g][topic]])
        self._unlist_forgotten(lambda key: key[1] == topic)

    def mark_deleted(self, group: str) -> bool:
        """``group`` deleted with its offsets kept: its lag left out until it comes again, across restarts (saved
        with the table; ``saved`` writes it). False when it holds no offset (nothing kept to leave out)."""
        if group not in self._topics:
            self.deleted.discard(group)
            return False
        self.deleted.add(group)
        self._dirty = True
        self._changes += 1
        return True

    def kept_deleted(self) -> list[str]:
        """The groups deleted with their offsets kept that hold offsets still (saved with the table, and listed to
        slaves with it: GET_ALL_CONSUMER_OFFSET's "deleted"); a name whose offsets went since is not."""
        topics = self._topics
        return [group for group in self.deleted if group in topics]

    def take_deleted(self, groups) -> None:
        """A slave: its master's groups deleted with their offsets kept (GET_ALL_CONSUMER_OFFSET's "deleted"; none
        from a Java master), in place of its own, saved with its copy. Not copied, a slave promoted (started as the
        master on its store) exported every such group's lag again, lag alerts firing for groups an operator had
        deleted. The same set (metrics.deleted_groups is it), changed in place."""
        named = {group for group in groups if group in self._topics}
        if named != self.deleted:
            self.deleted.clear()
            self.deleted.update(named)
            self._dirty = True
            self._changes += 1

    def _unlist_forgotten(self, gone) -> None:
        """Forgotten queues of a topic or group removed are no longer listed to slaves at -1, as a Java master's
        cleanOffsetByTopic and removeOffset take the -1 it keeps: listed on, a Java slave (putAll) took the deleted
        topic's or group's entries back into its table at every sync (FORGOTTEN_KEPT at most: a short walk)."""
        if self._forgotten:
            gone = [key for key in self._forgotten if gone(key)]
            for key in gone:
                del self._forgotten[key]
            if gone:                # (saved with the table: a restart listed them again)
                self._dirty = True
                self._changes += 1

    def _remove(self, keys) -> None:
        for key in keys:
            del self._table[key]
            topics = self._topics[key[0]]
            qids = topics[key[1]]
            if len(qids) > 1:
                qids.remove(key[2])
            else:
                if len(topics) > 1:
                    del topics[key[1]]
                else:
                    del self._topics[key[0]]
                groups = self._groups[key[1]]
                groups.discard(key[0])
                if not groups:
                    del self._groups[key[1]]
            self._changed.add(key)
            self._dirty = True
            self._changes += 1
            client = self._maker.pop(key, None)
            if client is not None:
                left = self._made_by[client] - 1
                if left > 0:
                    self._made_by[client] = left
                else:
                    del self._made_by[client]

    def count(self) -> int:
        """How many (group, topic, queue id) offsets are held."""
        return len(self._table)

    def items(self):
        """((group, topic, queue id), offset) pairs."""
        return list(self._table.items())

    def fit(self, max_offset) -> list[tuple[tuple[str, str, int], int, int]]:
        """Lower every offset past its queue's end (``max_offset(topic, queue id)``) to that end; returns
        ((group, topic, queue id), was, now) for each one lowered.

        At start-up, after recovery: a log cut short (a torn tail after a power loss, or
        truncate_corrupt_tail) leaves queues shorter than what consumers had committed, and the new
        messages that refill those offsets would be skipped by a consumer resuming from its old offset.
        """
        lowered = []
        for (group, topic, qid), offset in self._table.items():
            end = max_offset(topic, qid)
            if offset > end:
                lowered.append(((group, topic, qid), offset, end))
        for n, (key, was, end) in enumerate(lowered):
            self.commit(*key, end)
            # (the first few said each, the rest summed up: a store whose queues were not all rebuilt lowered
            # thousands at one start, a line each)
            log.log(logging.WARNING if n < FIT_SAID else logging.DEBUG,
                    "consumer offsets: %s of %s queue %d was %d, past the queue's end %d (%s); it is now %d",
                    key[0], key[1], key[2], was, end, _why_lowered(end), end)
        if len(lowered) > FIT_SAID:
            empty = sum(1 for _k, _w, end in lowered if end == 0)
            log.warning("consumer offsets: %d consumer offsets lowered to their queue's end (%d shown above): "
                        "%d to 0 (%s), %d to a shorter queue (%s)", len(lowered), FIT_SAID, empty,
                        _why_lowered(0), len(lowered) - empty, _why_lowered(1))
        return lowered

    # ------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Start persisting a dirty table every ``persist_interval_s``."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._persist_loop(), name="txmq-offsets")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._copy = None       # a cancelled save's thread may still be encoding that copy: never changed again
        # On the saves' thread, behind any write still running there, and bounded: run here on the loop, behind a
        # write that hung (a stopped NFS) the stop blocked the loop for good and SIGTERM never ended the process.
        self._dirty = False
        last = asyncio.ensure_future(self._write_off_loop(
            (dict(self._table), dict(self._maker), *self._extras()), *self._take_save()))
        last.add_done_callback(retrieved)
        try:
            await self._last_save(last)
        except TimeoutError as exc:
            log.error("consumer offsets not persisted at close: a write has not ended in %s (a hung disk or a "
                      "stopped network file system?); stopping without it (consumers resume from the last saved "
                      "offsets and may see messages again)", exc)
        except OSError as exc:  # a full disk must not turn a clean stop into a crash; consumers re-read
            self._dirty = True
            log.error("consumer offsets not persisted at close: %s (consumers resume from the last saved "
                      "offsets and may see messages again)", exc)
            self._wrote(exc)
        else:
            self._wrote()
        finally:
            self._firsts.close()
            if self._thread is not None:
                self._thread.shutdown(wait=False)
                self._thread = None

    async def _last_save(self, last: asyncio.Future) -> None:
        """Wait for the stop's ``last`` save CLOSE_WAIT_S at most, ``hung_close_wait_s`` once a write is said hung
        (at the stop's start or while it waits: a bound chosen once at the start had a stop begun a moment before a
        stuck write was said hung wait the long one, and one begun while it hung give the last save, behind it,
        the short bound whole after it ended); TimeoutError when given up."""
        loop = asyncio.get_running_loop()
        longest = deadline = loop.time() + CLOSE_WAIT_S
        hung = False
        while not last.done():
            if self.write_hung != hung:     # said hung; or the write that hung ended: the last save may run its time
                hung = self.write_hung
                deadline = min(longest, loop.time() + self.hung_close_wait_s) if hung else longest
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"{self.write_hung_s:g} s, nor in {self.hung_close_wait_s:g} s more of the stop"
                                   if hung else f"{CLOSE_WAIT_S:g} s")
            waits = [last, self._write_end()]   # (``_hung`` ends one; a write's end sets the next)
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        last.result()       # (raises a failed save's)

    async def _persist_loop(self) -> None:
        while True:
            await asyncio.sleep(self.persist_interval_s)
            if self._dirty:
                self._dirty = False
                try:
                    # taken here, encoded and written on a thread: 100,000 offsets with their makers take
                    # about 350 ms to encode, which held the loop that long
                    await self._write_off_loop(self._snapshot(), *self._take_save())
                except Exception as exc:  # noqa: BLE001 - a bug too: ending the loop would stop every later save
                    self._dirty = True
                    self._save_failed(exc)
                    self._wrote(exc)
                    continue
                self._save_worked()
                self._wrote()

    def _save_failed(self, exc: BaseException) -> None:
        """Said once per outage (a full disk), not every few seconds, whichever save (the loop's, ``saved``'s) met
        it: a ``saved`` that wrote once the disk had room ended the run unsaid when only the loop kept it (nothing
        left to write, it never saw the end), and the next outage was then not said at all."""
        if not self._failing:
            log.error("consumer offsets not persisted (retrying): %s", exc, exc_info=not isinstance(exc, OSError))
        self._failing = True

    def _save_worked(self) -> None:
        if self._failing:
            log.warning("consumer offsets persisted again")
            self._failing = False

    def _wrote(self, exc: BaseException | None = None) -> None:
        """A write (the loop's or ``saved``'s) ended: wake a paced save waiting for it, which looks again."""
        waiting, self._next_write = self._next_write, None
        if waiting is not None and not waiting.done():
            if exc is None:
                waiting.set_result(None)
            else:
                waiting.set_exception(exc)

    def hurry(self) -> None:
        """A stop: paced saves, the one waiting and any later, start at once, without their rest. A stop gives
        requests in flight 5 s, then closes their connections: moves waiting longer were saved at close but never
        answered, the tool not knowing whether they were made."""
        self._hurry = True
        self._wrote()

    def saving(self) -> asyncio.Future | None:
        """A future that ends with the next step of the saves under way (a write, ``saved``'s save, a paced one);
        None when none is. A stop waits on it past its grace for requests waiting on those saves."""
        under_way = [f for f in (self._saving, self._paced, self._firsts.in_flight()) if f is not None and not f.done()]
        if self._writing:
            under_way.append(self._write_end())
        return asyncio.ensure_future(asyncio.wait(under_way, return_when=asyncio.FIRST_COMPLETED)) \
            if under_way else None

    async def saved(self, *, paced: bool = False, max_rest: float | None = None) -> float:
        """Write the table now, off the loop, and return once it is on disk; OSError when it cannot be (the
        background save retries). For the operators' codes, which move offsets on purpose and answer SUCCESS: a
        reset (INVOKE_BROKER_TO_RESET_OFFSET) or a removal left to the next periodic save was undone by a kill
        within ``persist_interval_s`` -- the group back where it was, its replay lost or its skip redelivered.

        ``paced`` (an admin's move, reset or removal, which any client may loop over): the save starts only once
        the saver has rested REST_FACTOR times the last save's duration since it ended (a save in flight first
        ends), shared by every paced caller queued by then. A save each, back to back, had one client looping over
        moves keep the save thread busy without rest (100,000 offsets: 1.0-1.5 s a save); a count of moves per
        address instead held a tool moving queue after queue to one move a flush interval however cheap the save.
        Returns the seconds the rest held this caller's save back (0.0: none). ``max_rest``: this caller waits the
        rest at most that long, then starts a save (ADMIN_REST_MAX_S: a reply a stock client times out on).

        Nothing changed since the newest save written: nothing to write, it returns at once. Callers at once
        share the writes (group commit): a burst of resets costs two encodings of the table (100,000
        offsets: about 350 ms each), not one each, queued."""
        wanted = self._changes
        began, held = self.clock(), False
        until = None if max_rest is None else began + max_rest
        while self._saved_changes < wanted:
            if self.write_hung:     # (``_hung`` wakes the callers waiting on it)
                raise OSError(errno.ETIMEDOUT, f"a consumer offsets write has not ended in {self.write_hung_s:g} s "
                                               "(a hung disk or a stopped network file system?)")
            if paced and not self._hurry and (until is None or self.clock() < until):
                if self._paced is None:
                    self._paced = asyncio.ensure_future(self._paced_save())
                    self._paced.add_done_callback(retrieved)
                # The paced save, or any write that holds this caller's change first: with the rest longer than
                # the flush interval, a periodic save ends inside each rest, and the paced one waits on while
                # later moves keep coming; the moves a periodic save held waited with it for good.
                paced_save = self._paced
                while not paced_save.done() and self._saved_changes < wanted and not self.write_hung:
                    nap = None if until is None else asyncio.ensure_future(self.sleep(max(until - self.clock(), 0)))
                    try:
                        await asyncio.wait([paced_save, self._write_end()] + ([nap] if nap else []),
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        if nap is not None:
                            nap.cancel()
                    if until is not None and self.clock() >= until:
                        break       # (then a save of its own, below, the paced one left to its waiters)
                held = held or not paced_save.done() or paced_save.result() > 0     # (raises a failed save's)
                continue
            saving = self._save_started()
            await asyncio.wait([saving, self._write_end()], return_when=asyncio.FIRST_COMPLETED)
            if saving.done():
                saving.result()     # (raises a failed save's)
        return self.clock() - began if held else 0.0

    def _save_started(self) -> asyncio.Future:
        """The save ``saved`` shares: the one in flight, else a new one."""
        if self._saving is None:
            self._saving = asyncio.ensure_future(self._save_now())
            self._saving.add_done_callback(retrieved)
        return self._saving

    async def _paced_save(self) -> float:
        """Wait for the write in flight to end and the rest after it (REST_FACTOR times what it took), then save
        what every paced caller queued by then changed; the seconds waited. A write ending meanwhile (the periodic
        save) starts the rest again after it, and may hold every change (then nothing is written)."""
        began, held = self.clock(), False
        while not self._hurry and self._saved_changes < self._changes:
            if self._writing:
                held = True
                await asyncio.wait([self._write_end()])
                continue
            rest = self._last_end + REST_FACTOR * self._last_took - self.clock()
            if rest <= 0:
                break
            held = True
            nap = asyncio.ensure_future(self.sleep(rest))
            try:
                await asyncio.wait([nap, self._write_end()], return_when=asyncio.FIRST_COMPLETED)
            finally:
                nap.cancel()
        self._paced = None      # (callers from now on wait for the next rest: this save's table is taken at once)
        waited = self.clock() - began if held else 0.0
        if self._saved_changes < self._changes:
            await asyncio.shield(self._save_started())
        return waited

    def _write_end(self) -> asyncio.Future:
        if self._next_write is None:
            self._next_write = asyncio.get_running_loop().create_future()
            self._next_write.add_done_callback(retrieved)
        return self._next_write

    async def _write_off_loop(self, snapshot: tuple, number: int, changes: int) -> None:
        """Encode and write ``snapshot`` on the saves' thread, timed: the rest a paced save waits for follows it.
        One that has not ended in ``write_hung_s`` sets ``write_hung`` until it ends, said at ERROR: a save that
        hung was said by nothing, commits answered and never saved, admin moves never answered."""
        if self._thread is None:
            self._thread = DaemonThreads("txmq-offsets")
        loop = asyncio.get_running_loop()
        began = self.clock()    # (before the thread may start it: read after, a write's time could be counted 0)
        write = loop.run_in_executor(self._thread, self._encode_and_write, snapshot, number, changes)
        self._writing += 1
        timer: list = []
        self._check_hung(write, timer)
        # Ended when the thread's write ends, not when this wait is cancelled (the stop cancels the periodic save):
        # the gauge went to 0 and the stop waited its long bound while the write still hung.
        write.add_done_callback(partial(self._write_ended, began, timer))
        await asyncio.shield(write)

    def _check_hung(self, write: asyncio.Future, timer: list) -> None:
        """``_hung`` once the write (from ``_io_began``) has run ``write_hung_s``; checked again until then. Not the
        encode before it, nor the wait behind another save: CPU, slow on a big table and a loaded host, never hung
        (200,000 offsets: 4 s of 4.1), and timed with it a 500,000-offset save was said hung, its admin moves
        answered SYSTEM_ERROR and a stop then gave its last save up after the hung bound, the commits since lost."""
        if write.done():
            return
        began = self._io_began
        left = min(self.write_hung_s, 1.0) if began is None else began + self.write_hung_s - time.monotonic()
        if left > 0:
            timer[:] = [asyncio.get_running_loop().call_later(left, self._check_hung, write, timer)]
        else:
            self._hung()

    def _write_ended(self, began: float, timer: list, write: asyncio.Future) -> None:
        retrieved(write)            # (its waiter's to raise; none when cancelled)
        for handle in timer:
            handle.cancel()
        self._writing -= 1
        self._last_end = self.clock()
        self._last_took = self._last_end - began
        if self.write_hung and not self._writing:
            self.write_hung = False
            log.warning("consumer offsets: the write that hung has ended, after %.1f s", self._last_took)

    def _hung(self) -> None:
        if not self.write_hung:
            self.write_hung = True
            log.error("consumer offsets: a write has not ended in %g s (a hung disk or a stopped network file "
                      "system?): commits are held in memory only, admin moves are answered SYSTEM_ERROR, and a "
                      "stop gives the last save up (txmq_consumer_offsets_write_hung)", self.write_hung_s)
        self._wrote()               # callers of ``saved`` waiting for a write's end: answered now

    async def _save_now(self) -> None:
        self._dirty = False
        snapshot = dict(self._table), dict(self._maker), *self._extras()
        try:
            await self._write_off_loop(snapshot, *self._take_save())
        except OSError as exc:
            self._dirty = True
            self._save_failed(exc)
            self._wrote(exc)
            raise
        finally:
            self._saving = None
        self._save_worked()
        self._wrote()

    def _extras(self) -> tuple[list[tuple[str, str, int]], int, list[str]]:
        """What a save holds besides the table and its makers: the forgotten queues (a copy, oldest first: a
        master's; a slave lists none to anyone), the newest line of the first offsets' journal the table holds
        (every one numbered so far: each was committed in memory first), and the deleted groups that hold offsets
        (a name whose offsets went since is not kept)."""
        return list(self._forgotten) if self.per_host else [], self._firsts.seq, self.kept_deleted()

    def _snapshot(self) -> tuple[dict, dict, list, int, list[str]]:
        """On the loop: the table and its makers as they are now, for a save on a thread. The copy the last save
        took, brought up to date with the keys changed since: a whole copy each save held the loop 11-55 ms at
        100,000 offsets, however few had changed (1,000 changed: 0.3 ms). Only _persist_loop takes it, one save at
        a time (``saved`` takes a copy of its own), so the copy is never changed while a thread encodes it. With more than a sixteenth of the table changed, a whole copy is the
        cheaper (one C call; key by key, 100,000 changed took 300-600 ms)."""
        if self._copy is None or len(self._changed) > len(self._table) // 16:
            self._changed.clear()
            self._copy = dict(self._table), dict(self._maker)
            return (*self._copy, *self._extras())
        table, maker = self._table, self._maker
        saved_table, saved_maker = self._copy
        for key in self._changed:
            if key in table:
                saved_table[key] = table[key]
            else:
                saved_table.pop(key, None)
            client = maker.get(key)
            if client is not None:
                saved_maker[key] = client
            else:
                saved_maker.pop(key, None)
        self._changed.clear()
        return (*self._copy, *self._extras())

    def persist(self) -> None:
        """Write the table now (blocking)."""
        self._dirty = False
        try:
            snapshot = self._table, self._maker, *self._extras()
            self._write(_encode(*snapshot), *self._take_save())
        except OSError:
            self._dirty = True
            raise
        self._firsts.trim(snapshot[3])

    def _take_save(self) -> tuple[int, int]:
        """On the loop, with the table it saves: this save's number and the changes it holds (``_write``)."""
        self._saves_taken += 1
        return self._saves_taken, self._changes

    def _encode_and_write(self, snapshot: tuple, number: int, changes: int) -> None:
        data = _encode(*snapshot)
        self._io_began = time.monotonic()       # a hang is timed from here (_check_hung): an encode is only slow
        try:
            self._write(data, number, changes)
            # The journal's lines this table holds. Watched for a hang as the write: behind the journal's lock, an
            # append that hung (a stopped NFS) held it for good, said by nothing, callers of ``saved`` unanswered.
            self._firsts.trim(snapshot[3])
        finally:
            self._io_began = None

    def _write(self, data: bytes, number: int, changes: int) -> None:
        with self._write_lock:
            if number < self._saves_written:
                return          # a newer table is in the file already: this one is older
            self._write_locked(data)
            self._saves_written = number
            self._saved_changes = max(self._saved_changes, changes)

    def _write_locked(self, data: bytes) -> None:
        fsync_dirs(make_dirs(os.path.dirname(self.path)))
        save(self.path, data)       # the table being replaced becomes the previous copy (see _load)


def _encode(table: dict, maker: dict, forgotten=(), firsts: int = 0, deleted=()) -> bytes:
    # Not sorted first: sort_keys orders every level as written anyway, and sorting the whole table (100,000
    # (group, topic, queue) keys: 40-100 ms) is one C call that holds the GIL, the loop stopped for all of it
    # though this runs on a thread.
    out: dict[str, dict[str, int]] = {}
    for (group, topic, qid), offset in table.items():
        out.setdefault(f"{topic}@{group}", {})[str(qid)] = offset
    if not maker and not forgotten and not firsts and not deleted:  # nothing to say (RocketMQ's plain table)
        return json.dumps(out, indent=1, sort_keys=True).encode()
    makers: dict[str, dict[str, list[int]]] = {}
    for (group, topic, qid), client in maker.items():      # (keys sorted by dumps; queue ids as made)
        makers.setdefault(client, {}).setdefault(f"{topic}@{group}", []).append(qid)
    wrapper = {"offsetTable": out, "makers": makers}
    if forgotten:       # (oldest first: a list, which dumps keeps in order)
        wrapper["forgotten"] = [[topic, group, qid] for group, topic, qid in forgotten]
    if firsts:
        wrapper["firsts"] = firsts
    if deleted:
        wrapper["deleted"] = sorted(deleted)
    return json.dumps(wrapper, indent=1, sort_keys=True).encode()


class _Table(dict):
    """(group, topic, queue id) -> offset, ``makers``: (group, topic, queue id) -> the client that made it,
    ``forgotten``: the (group, topic, queue id) forgotten, oldest first, and ``firsts``: the newest line of the
    first offsets' journal the table holds (offset_journal.py)."""

    def __init__(self):
        super().__init__()
        self.makers: dict[tuple[str, str, int], str] = {}
        self.forgotten: list[tuple[str, str, int]] = []
        self.firsts = 0
        self.deleted: list[str] = []


def _parse_table(raw) -> _Table:
    """The table of a file's JSON; ValueError for any entry that is not "<topic>@<group>": {"<qid>": offset}.

    One bad entry makes the whole file suspect (a hand or a disk changed it): skipping just that entry would
    start its group over on those queues without a word."""
    check(isinstance(raw, dict), "not a JSON object")
    makers, forgotten, firsts, deleted = {}, [], 0, []
    if isinstance(raw.get("offsetTable"), dict):    # RocketMQ's wrapper, as ops/spark/expiry.py reads it too
        makers, forgotten, firsts = raw.get("makers", {}), raw.get("forgotten", []), raw.get("firsts", 0)
        deleted = raw.get("deleted", [])
        raw = raw["offsetTable"]
    check(is_int(firsts) and firsts >= 0, f"firsts = {firsts!r}")
    check(isinstance(deleted, list) and all(isinstance(g, str) for g in deleted), f"deleted = {deleted!r}")
    table = _Table()
    table.firsts = firsts
    table.deleted = deleted
    for key, queues in raw.items():
        # (a group name may hold "@", even end in it -- names are not checked: "T@odd@" is group "odd@" of T;
        # refused, one client's name sent every start to the older copy)
        split = split_offset_key(key)
        check(split is not None and isinstance(queues, dict), f"malformed entry {key!r}")
        topic, group = split
        for qid, offset in queues.items():
            check(qid.isdigit() and is_int(offset) and offset >= 0, f"{key} queue {qid!r} = {offset!r}")
            table[(group, topic, int(qid))] = offset
    check(isinstance(makers, dict), f"makers = {makers!r}")
    for client, keys in makers.items():
        check(isinstance(keys, dict), f"makers of {client!r} = {keys!r}")
        for key, qids in keys.items():
            split = split_offset_key(key)
            check(split is not None and isinstance(qids, list) and all(is_int(q) for q in qids),
                  f"makers of {client!r}: {key!r} = {qids!r}")
            for qid in qids:
                if (split[1], split[0], qid) in table:      # (one no longer in the table is nobody's)
                    table.makers[(split[1], split[0], qid)] = client
    check(isinstance(forgotten, list), f"forgotten = {forgotten!r}")
    for entry in forgotten:
        check(isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[1], str)
              and is_int(entry[2]), f"forgotten entry {entry!r}")
        key = (entry[1], entry[0], entry[2])
        if key not in table:        # (committed again since: not forgotten)
            table.forgotten.append(key)
    return table
