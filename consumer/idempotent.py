"""Effectively-once consumption on top of at-least-once delivery.

A message may arrive more than once (a retry after a lost acknowledgement, a producer that
resent after a timeout, a rebalance). Each message carries a key that survives all of these:
UNIQ_KEY, the producer's id for it (kept through retries). ``SqliteIdempotency.run_once`` runs
the handler and records the key in ONE local SQLite transaction, so the handler's own writes
and the "done" mark commit together or not at all: a redelivered message finds its key and is
skipped. Keep the business data in the same database for this guarantee; with another store,
do the same there (a unique key inserted in the same transaction as the side effect).

A key counts within its message's topic: a message forwarded from one topic to another with its
properties keeps its UNIQ_KEY (producers keep one they are given), and is a new message there. The
table knows nothing of consumer groups: two groups that must each handle every message need a
table each (``table=``), or the second skips what the first did.

The keys table grows by one row a message for as long as the consumer runs; ``forget_older_than``
drops the keys of messages consumed long enough ago that no copy of them can still arrive.

``run_once`` blocks its caller while it waits for the database's write lock (up to ``busy_timeout_s``,
30 s, when another process is committing). From an async listener that is the consumer's whole event
loop: heartbeats, lock renewals and the pulls of every other queue stop with it. ``run_once_async``
does the same work in a worker thread of its own, on a connection of its own (a sqlite3 connection
belongs to the thread that opened it), and the loop goes on meanwhile.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from protocol.message import MessageExt, Prop

log = logging.getLogger("txmq.consumer.idempotent")
_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)
STEP_SAID_S = 60.0      # a wall clock ahead of the time passed by more than this (again) is said


def _elapsed_s() -> float:
    """Seconds of a clock never stepped that counts a suspended host's sleep (CLOCK_BOOTTIME; else monotonic)."""
    return time.monotonic() if _BOOTTIME is None else time.clock_gettime(_BOOTTIME)


def _boot_id() -> str | None:
    """This boot of the host (Linux's boot_id): CLOCK_BOOTTIME readings of every process of one boot compare;
    None where there is none (then the reference is this object's own)."""
    if _BOOTTIME is None:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def message_key(msg: MessageExt) -> str:
    """The key that identifies a message across redeliveries: UNIQ_KEY, else the offset id of the message as
    first stored. A retry copy is a new record with its own offset id; the broker names the first one in
    ORIGIN_MESSAGE_ID (without that, a message sent with no UNIQ_KEY ran once more per retry)."""
    props = msg.properties
    return props.get(Prop.UNIQ_KEY) or props.get(Prop.ORIGIN_MESSAGE_ID) or msg.offset_msg_id


def _stored_keys(msg: MessageExt) -> tuple[str, str]:
    """(the key run_once records, "<topic>\x01<message_key>"; the key alone, as recorded before keys had their topic).

    Joined by \x01, which no property value (UNIQ_KEY, ORIGIN_MESSAGE_ID, RETRY_TOPIC) nor offset id holds: the key
    alone, looked up as an old one, can never be a scoped one. Joined by ":", a UNIQ_KEY "Payments:42" in Orders
    was taken for Payments' message 42 and skipped.

    The topic is the one the message was sent to: a retry or dead-letter copy (%RETRY%<group>, %DLQ%<group>)
    names it in RETRY_TOPIC, which a message forwarded from a retry still carries, its own topic not."""
    topic = msg.topic
    if topic.startswith(("%RETRY%", "%DLQ%")):
        topic = msg.properties.get(Prop.RETRY_TOPIC) or topic
    key = message_key(msg)
    return f"{topic}\x01{key}", key


def _refusing_transaction_control(ended: list[str]):
    """An SQLite authorizer that refuses BEGIN, COMMIT and ROLLBACK (SAVEPOINTs pass), noting each in ``ended``.

    A handler that committed (``with db:`` does on exit) committed the key with what it had written so far:
    failing after, its redelivery was skipped and the rest of its effect never happened. One that rolled back
    dropped the key and wrote on in autocommit: its redelivery ran it again."""
    def authorize(action, arg1, *_):
        if action == sqlite3.SQLITE_TRANSACTION:
            ended.append(arg1)
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK
    return authorize


def _ended_by(handler, what: str) -> sqlite3.ProgrammingError:
    return sqlite3.ProgrammingError(
        f"run_once handler {handler!r} must not commit or roll back (it tried {what}): its writes and the message's "
        "key commit together when it returns, and roll back together when it raises. Use no `with db:`, commit(), "
        "rollback(), executescript() (it commits first) or BEGIN/COMMIT/ROLLBACK in it (SAVEPOINTs are fine); nothing "
        "of this run was kept")


class SqliteIdempotency:
    """Run a handler once per message: its key and the handler's writes commit in one SQLite
    transaction in the database at ``path`` (the key table is ``table``)."""

    def __init__(self, path: str, table: str = "txmq_consumed", *, busy_timeout_s: float = 30.0):
        """``busy_timeout_s``: how long a call waits for another connection's lock on the database before
        sqlite3.OperationalError "database is locked" (sqlite3's own default, 5 s, was too short for
        several consumer processes sharing one database under load: a restarting one failed to open it)."""
        if not table.isidentifier():
            raise ValueError(f"table name {table!r} is not an identifier")
        self.table = table
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.db = self._connect()
        self.db.execute(f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, consumed_ms INTEGER NOT NULL)")
        self.db.execute(f"CREATE INDEX IF NOT EXISTS {table}_by_time ON {table} (consumed_ms)")
        # run_once_async's worker: one thread, so its connection (opened there, on first use) is only ever
        # used there. One is enough: every run takes the database's one write lock (BEGIN IMMEDIATE) anyway.
        self._worker: ThreadPoolExecutor | None = None
        self._worker_db: sqlite3.Connection | None = None
        self._worker_guard = threading.Lock()
        self._closed = False
        # Ages (forget_older_than) are judged by the wall clock, as consumed_ms is stamped, but never further
        # ahead of its reading at the open than the time that passed since: judged by the wall clock alone, a step
        # days ahead (a VM's host, a bad NTP source) made every key "days old", and the next forget deleted them
        # all, keys of messages consumed a minute before; their redeliveries then ran again.
        # The reference is kept in the database for the host's boot: one taken at each open made a process opened
        # after a step (the consumer restarted, a cron job opening the table only to forget) judge by the stepped
        # clock, and forget every key. A step before the boot's first open, or across a reboot, is not seen.
        self._opened = self._reference()
        self._ahead_said = 0.0

    def _reference(self) -> tuple[float, float]:
        """(wall clock, _elapsed_s()) read together at the first open of the table in this boot of the host."""
        here, boot = (time.time(), _elapsed_s()), _boot_id()
        if boot is None:
            return here
        clock = f"{self.table}_clock"
        try:
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {clock} (boot TEXT PRIMARY KEY, wall REAL NOT NULL, "
                            "elapsed REAL NOT NULL)")
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.execute(f"DELETE FROM {clock} WHERE boot != ?", (boot,))     # a boot before: not comparable
                self.db.execute(f"INSERT OR IGNORE INTO {clock} (boot, wall, elapsed) VALUES (?, ?, ?)", (boot, *here))
                wall, elapsed = self.db.execute(f"SELECT wall, elapsed FROM {clock} WHERE boot = ?",
                                                (boot,)).fetchone()
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != sqlite3.SQLITE_READONLY:
                raise
            # A database this process may not write (a read-only file or mount, an audit's reader) opened before
            # the clock table; it forgets nothing. This boot's reference if there is one, else this open's.
            try:
                row = self.db.execute(f"SELECT wall, elapsed FROM {clock} WHERE boot = ?", (boot,)).fetchone()
            except sqlite3.OperationalError:        # no clock table (one an older release wrote)
                row = None
            return here if row is None else tuple(row)
        return wall, elapsed

    def _age_now(self) -> float:
        """The wall clock to judge ages by: bounded by the time passed since the open; a step ahead said once."""
        wall, (wall0, elapsed0) = time.time(), self._opened
        now = min(wall, wall0 + _elapsed_s() - elapsed0)
        ahead = wall - now
        if ahead - self._ahead_said > STEP_SAID_S:
            log.warning("the wall clock is %d s ahead of the time that passed since the keys table was opened (stepped "
                        "ahead): forget_older_than judges ages by the latter, so no key is forgotten by the step; "
                        "until the host boots again keys are kept that much longer", ahead)
            self._ahead_said = ahead
        elif ahead < self._ahead_said - STEP_SAID_S:
            self._ahead_said = max(ahead, 0.0)    # put back: the next step ahead is said again
        return now

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, isolation_level=None, timeout=self.busy_timeout_s)

    def run_once(self, msg: MessageExt, handler: Callable[[MessageExt, sqlite3.Connection], None]) -> bool:
        """Run ``handler(msg, db)`` unless this message was consumed before; True if it ran.

        ``handler`` is a plain function: its writes must be done when it returns, and it leaves the transaction
        to run_once (a commit, a rollback or ``with db:`` in it raises sqlite3.ProgrammingError and nothing of
        the run is kept; SAVEPOINTs are fine). This blocks the calling
        thread while the database is locked (up to ``busy_timeout_s``): from an event loop, use
        ``run_once_async``."""
        return self._run(self.db, msg, _stored_keys(msg), handler, None)

    async def run_once_async(self, msg: MessageExt,
                             handler: Callable[[MessageExt, sqlite3.Connection], None]) -> bool:
        """``run_once`` without blocking the event loop: the lock wait, ``handler(msg, db)`` and the commit run
        in this object's worker thread, on its own connection (``db`` is that connection, not ``self.db``).
        Calls run one at a time, in the order made. ``handler`` is still a plain function, and runs in that
        thread.

        Cancelled (a consumer's consume timeout, hand-over or shutdown), the call returns at once; in the
        worker, a run that has not got the write lock yet is dropped there (the message's redelivery runs
        it), and one whose handler has begun commits or rolls back as a whole, its key with its writes: a
        redelivery then finds the key, or runs it. Either way its effect happens once."""
        if self.path in ("", ":memory:"):   # the worker's connection would open another, empty, database
            raise ValueError("run_once_async needs a database file: each connection to :memory: is a new one")
        keys = _stored_keys(msg)    # here: the message's properties are parsed on first read, not thread-safe
        dropped = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(self._executor(), self._run_in_worker, msg, keys,
                                                            handler, dropped)
        try:
            return await future
        except asyncio.CancelledError:
            dropped.set()
            raise

    def _executor(self) -> ThreadPoolExecutor:
        with self._worker_guard:
            if self._closed:        # else a new worker would open the database again behind close()
                raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="txmq-idempotency")
            return self._worker

    def _run_in_worker(self, msg: MessageExt, keys: tuple[str, str], handler, dropped: threading.Event) -> bool:
        if dropped.is_set():
            return False
        if self._worker_db is None:
            self._worker_db = self._connect()
        return self._run(self._worker_db, msg, keys, handler, dropped)

    def _run(self, db: sqlite3.Connection, msg: MessageExt, keys: tuple[str, str], handler,
             dropped: threading.Event | None) -> bool:
        key, unscoped = keys
        db.execute("BEGIN IMMEDIATE")
        try:
            if dropped is not None and dropped.is_set():    # its caller went while this waited for the lock
                db.execute("ROLLBACK")
                return False
            if db.execute(f"SELECT 1 FROM {self.table} WHERE key = ?", (unscoped,)).fetchone() is not None:
                db.execute("ROLLBACK")      # consumed before keys had their topic (an upgrade's redelivery)
                return False
            try:
                db.execute(f"INSERT INTO {self.table} (key, consumed_ms) VALUES (?, ?)",
                           (key, int(time.time() * 1000)))
            except sqlite3.IntegrityError:
                db.execute("ROLLBACK")
                return False
            ended: list[str] = []       # what the handler tried: its transaction is not its own to end
            db.set_authorizer(_refusing_transaction_control(ended))
            try:
                result = handler(msg, db)
            except Exception as exc:
                if ended:               # whatever it raised after that, that is what went wrong
                    raise _ended_by(handler, ended[0]) from exc
                raise
            finally:
                db.set_authorizer(None)
            if ended:                   # it swallowed the refusal: its writes are not what it meant
                raise _ended_by(handler, ended[0])
            if inspect.isawaitable(result):     # its writes have not happened: it must not be marked done
                if inspect.iscoroutine(result):
                    result.close()
                raise TypeError(f"run_once needs a plain function; {handler!r} returned an awaitable")
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:       # a COMMIT that failed (busy, disk full) leaves it open
                db.execute("ROLLBACK")
            raise
        return True

    def forget_older_than(self, seconds: float, *, chunk: int = 10_000) -> int:
        """Delete the keys of messages consumed more than ``seconds`` ago; the number deleted.

        A message whose key is forgotten runs again if a copy of it still arrives, so keep at least
        as long as the broker can deliver one: its file retention (72 hours by default) covers
        retries (the 16th waits 2 hours), dead letters resent by an operator and offsets reset to
        an earlier time. Deletes ``chunk`` rows a transaction so that run_once, on this or another
        connection, waits at most one chunk."""
        if not seconds > 0:
            raise ValueError(f"seconds={seconds!r}: keep the keys of some past, or nothing is idempotent")
        cutoff = int((self._age_now() - seconds) * 1000)
        deleted = 0
        while True:
            n = self.db.execute(f"DELETE FROM {self.table} WHERE rowid IN (SELECT rowid FROM {self.table} "
                                f"WHERE consumed_ms < ? LIMIT ?)", (cutoff, chunk)).rowcount
            deleted += n
            if n < chunk:
                return deleted

    def close(self) -> None:
        """Close the database: this thread's connection and the worker's (waiting for a ``run_once_async``
        run in hand there, up to ``busy_timeout_s`` if the database is locked; ``aclose`` waits without
        blocking the event loop)."""
        with self._worker_guard:
            worker, self._worker, self._closed = self._worker, None, True
        if worker is not None:
            worker.submit(self._close_worker_db)
            worker.shutdown(wait=True)
        self.db.close()

    async def aclose(self) -> None:
        """``close`` from an event loop: the worker's run in hand is waited for without blocking the loop."""
        with self._worker_guard:
            worker, self._worker, self._closed = self._worker, None, True
        try:
            if worker is not None:
                closed = asyncio.get_running_loop().run_in_executor(worker, self._close_worker_db)
                worker.shutdown(wait=False)     # its thread ends once the close, queued last, has run
                await asyncio.shield(closed)    # cancelled, this returns; the close still runs there
        finally:
            self.db.close()

    def _close_worker_db(self) -> None:
        if self._worker_db is not None:
            self._worker_db.close()
            self._worker_db = None
