"""Effectively-once consumption on top of at-least-once delivery.

A message may arrive more than once (a retry after a lost acknowledgement, a producer that
resent after a timeout, a rebalance). Each message carries a key that survives all of these:
UNIQ_KEY, the producer's id for it (kept through retries). ``SqliteIdempotency.run_once`` runs
the handler and records the key in ONE local SQLite transaction, so the handler's own writes
and the "done" mark commit together or not at all: a redelivered message finds its key and is
skipped. Keep the business data in the same database for this guarantee; with another store,
do the same there (a unique key inserted in the same transaction as the side effect).

The keys table grows by one row a message for as long as the consumer runs; ``forget_older_than``
drops the keys of messages consumed long enough ago that no copy of them can still arrive.
"""
from __future__ import annotations

import inspect
import sqlite3
import time
from typing import Callable

from protocol.message import MessageExt, Prop


def message_key(msg: MessageExt) -> str:
    """The key that identifies a message across redeliveries: UNIQ_KEY, else the offset id of the message as
    first stored. A retry copy is a new record with its own offset id; the broker names the first one in
    ORIGIN_MESSAGE_ID (without that, a message sent with no UNIQ_KEY ran once more per retry)."""
    props = msg.properties
    return props.get(Prop.UNIQ_KEY) or props.get(Prop.ORIGIN_MESSAGE_ID) or msg.offset_msg_id


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
        self.db = sqlite3.connect(path, isolation_level=None, timeout=busy_timeout_s)
        self.db.execute(f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, consumed_ms INTEGER NOT NULL)")
        self.db.execute(f"CREATE INDEX IF NOT EXISTS {table}_by_time ON {table} (consumed_ms)")

    def run_once(self, msg: MessageExt, handler: Callable[[MessageExt, sqlite3.Connection], None]) -> bool:
        """Run ``handler(msg, db)`` unless this message was consumed before; True if it ran.

        ``handler`` is a plain function: its writes must be done when it returns."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            try:
                db.execute(f"INSERT INTO {self.table} (key, consumed_ms) VALUES (?, ?)",
                           (message_key(msg), int(time.time() * 1000)))
            except sqlite3.IntegrityError:
                db.execute("ROLLBACK")
                return False
            result = handler(msg, db)
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
        cutoff = int((time.time() - seconds) * 1000)
        deleted = 0
        while True:
            n = self.db.execute(f"DELETE FROM {self.table} WHERE rowid IN (SELECT rowid FROM {self.table} "
                                f"WHERE consumed_ms < ? LIMIT ?)", (cutoff, chunk)).rowcount
            deleted += n
            if n < chunk:
                return deleted

    def close(self) -> None:
        """Close the database."""
        self.db.close()
