"""SqliteIdempotency marks a message consumed only when its handler's writes are committed with the mark."""
from __future__ import annotations

import sqlite3

import pytest

from consumer import SqliteIdempotency
from protocol.message import MessageExt, decode_record, encode_record, pack_host


def _message(key: str) -> MessageExt:
    record = encode_record(topic=b"T", body=b"x", queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                           born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                           properties=f"UNIQ_KEY\x01{key}\x02".encode())
    return decode_record(record)[0]


def test_a_commit_that_fails_leaves_no_transaction_open(tmp_path):
    """COMMIT can fail (SQLITE_BUSY while a reader holds the database, a full disk), and SQLite then
    keeps the transaction open: every later run_once failed at BEGIN ("cannot start a transaction
    within a transaction"), so every later message was retried until it went to the dead-letter
    queue. The failed run is rolled back and the message runs again on its redelivery."""
    path = str(tmp_path / "ledger.db")
    ledger = SqliteIdempotency(path)
    ledger.db.execute("PRAGMA busy_timeout = 10")
    ledger.db.execute("CREATE TABLE applied (body TEXT)")
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT COUNT(*) FROM applied").fetchone()      # a reader holds the database

    def apply(msg, db):
        db.execute("INSERT INTO applied VALUES ('a')")
    msg = _message("K1")
    with pytest.raises(sqlite3.OperationalError):
        ledger.run_once(msg, apply)
    reader.execute("COMMIT")
    assert ledger.run_once(msg, apply)                  # redelivered: runs, as it was never consumed
    assert not ledger.run_once(msg, apply)
    assert ledger.db.execute("SELECT COUNT(*) FROM applied").fetchone()[0] == 1
    reader.close()
    ledger.close()


def test_an_async_handler_is_refused_not_marked_consumed(tmp_path):
    """run_once calls its handler synchronously. An ``async def`` handler (natural next to an async
    listener) returned a coroutine that never ran, and the message was marked consumed: its
    redelivery was skipped and its effect never happened."""
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    ran = []

    async def apply(msg, db):
        ran.append(msg)
    msg = _message("K2")
    with pytest.raises(TypeError):
        ledger.run_once(msg, apply)
    assert ledger.run_once(msg, lambda m, db: ran.append(m))
    assert ran == [msg]
    ledger.close()


def test_a_retry_copy_of_a_message_without_uniq_key_has_the_original_key(tmp_path):
    """Stock clients set UNIQ_KEY, but a message may come without one (a raw or older client); its key was
    its offset id, and a retry copy (a new record in %RETRY%<group>) has another: the handler ran again."""
    from consumer.idempotent import message_key

    def stored(props: str, offset: int) -> MessageExt:
        record = encode_record(topic=b"T", body=b"x", queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                               born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                               properties=props.encode(), physical_offset=offset)
        return decode_record(record)[0]
    first = stored("", 4096)
    retry = stored(f"ORIGIN_MESSAGE_ID\x01{first.msg_id}\x02RETRY_TOPIC\x01T\x02", 81920)
    assert first.offset_msg_id != retry.offset_msg_id
    assert message_key(retry) == message_key(first)
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    ran = []
    assert ledger.run_once(first, lambda msg, db: ran.append(msg))
    assert not ledger.run_once(retry, lambda msg, db: ran.append(msg))
    assert ran == [first]


def test_forget_older_than_drops_only_old_keys(tmp_path, monkeypatch):
    """The keys table grew by one row a message for as long as a consumer ran, months on end.
    forget_older_than deletes the keys consumed before the cutoff, in chunks, and only those: a
    recent message is still skipped on redelivery, a forgotten one runs again."""
    import consumer.idempotent as idem

    clock = [1_000_000.0]
    monkeypatch.setattr(idem.time, "time", lambda: clock[0])
    monkeypatch.setattr(idem, "_elapsed_s", lambda: clock[0] - 1_000_000.0)   # time passes: no step
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    for i in range(25):
        assert ledger.run_once(_message(f"old-{i}"), lambda m, db: None)
    clock[0] += 3600
    assert ledger.run_once(_message("new"), lambda m, db: None)
    clock[0] += 1800
    assert ledger.forget_older_than(3000, chunk=10) == 25          # three chunks: 10, 10, 5
    assert ledger.db.execute("SELECT key FROM txmq_consumed").fetchall() == [("T\x01new",)]
    assert not ledger.run_once(_message("new"), lambda m, db: None)
    assert ledger.run_once(_message("old-3"), lambda m, db: None)
    assert ledger.forget_older_than(3000) == 0
    with pytest.raises(ValueError):
        ledger.forget_older_than(0)



def test_a_wall_clock_stepped_days_ahead_forgets_no_key_before_its_time(tmp_path, monkeypatch, caplog):
    """consumed_ms is the wall clock's, and forget_older_than judged ages by it alone: stepped four days ahead
    (a VM's host, a bad NTP source), forget_older_than(72 h) deleted every key, 30 of 30 consumed a minute
    before, and their redeliveries (a rebalance, a retry) ran again. Ages are bounded by the time that passed
    since the table was opened: nothing is forgotten by the step, said once; the keys go once 72 h have passed."""
    import consumer.idempotent as idem

    wall, elapsed = [1_000_000.0], [50.0]
    monkeypatch.setattr(idem.time, "time", lambda: wall[0])
    monkeypatch.setattr(idem, "_elapsed_s", lambda: elapsed[0], raising=False)
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    for i in range(30):
        assert ledger.run_once(_message(f"m-{i}"), lambda m, db: None)
    wall[0] += 60 + 4 * 86400           # a minute passes; the clock steps four days ahead
    elapsed[0] += 60
    with caplog.at_level("WARNING", logger="txmq.consumer.idempotent"):
        assert ledger.forget_older_than(72 * 3600) == 0
        assert ledger.forget_older_than(72 * 3600) == 0
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1, "said once a step"
    assert "forget_older_than judges ages by the latter" in caplog.records[0].message
    assert not ledger.run_once(_message("m-7"), lambda m, db: None), "a redelivery is still skipped"
    wall[0] += 72 * 3600
    elapsed[0] += 72 * 3600             # the retention has passed by the time that passed as well
    assert ledger.forget_older_than(72 * 3600) == 30


def test_a_wall_clock_stepped_ahead_forgets_no_key_in_a_process_opened_after_the_step(tmp_path, monkeypatch):
    """The bound on ages was the time passed since *this object* opened the table: a process opening it after a
    step (the consumer restarted, or a cron job that opens the table only to call forget_older_than) took the
    stepped wall clock as its start, and forget_older_than(72 h) deleted 30 of 30 keys consumed a minute
    before. The reference is kept in the database for the host's boot (CLOCK_BOOTTIME is one clock for every
    process of a boot): a process opened after the step forgets nothing by it either."""
    import consumer.idempotent as idem

    wall, elapsed = [1_000_000.0], [50.0]
    monkeypatch.setattr(idem.time, "time", lambda: wall[0])
    monkeypatch.setattr(idem, "_elapsed_s", lambda: elapsed[0])
    monkeypatch.setattr(idem, "_boot_id", lambda: "boot-1")
    path = str(tmp_path / "ledger.db")
    ledger = SqliteIdempotency(path)
    for i in range(30):
        assert ledger.run_once(_message(f"m-{i}"), lambda m, db: None)
    ledger.close()
    wall[0] += 60 + 4 * 86400           # a minute passes; the clock steps four days ahead
    elapsed[0] += 60
    cron = SqliteIdempotency(path)      # opened after the step
    try:
        assert cron.forget_older_than(72 * 3600) == 0, "keys consumed a minute ago forgotten"
        assert not cron.run_once(_message("m-7"), lambda m, db: None), "a redelivery is still skipped"
        wall[0] += 72 * 3600
        elapsed[0] += 72 * 3600
        assert cron.forget_older_than(72 * 3600) == 30
    finally:
        cron.close()
    monkeypatch.setattr(idem, "_boot_id", lambda: "boot-2")    # rebooted: a new reference, the old one dropped
    elapsed[0] = 5.0
    again = SqliteIdempotency(path)
    try:
        assert again.db.execute("SELECT boot FROM txmq_consumed_clock").fetchall() == [("boot-2",)]
    finally:
        again.close()


def test_a_locked_database_is_waited_for_up_to_busy_timeout_s(tmp_path):
    """Several consumer processes may share the database: a restarting one found it locked by another's
    commit and failed to open after sqlite3's default 5 s. The wait is ``busy_timeout_s`` (30 s)."""
    import threading
    path = str(tmp_path / "ledger.db")
    SqliteIdempotency(path).close()
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")                   # another process committing: no one may even read
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        SqliteIdempotency(path, busy_timeout_s=0.01)
    threading.Timer(0.2, lambda: holder.execute("ROLLBACK")).start()
    ledger = SqliteIdempotency(path, busy_timeout_s=10)     # waits for the lock instead of failing
    assert ledger.run_once(_message("k"), lambda m, db: None)
    ledger.close()
    holder.close()


class _Traced(SqliteIdempotency):
    """Sets ``waiting`` when a connection starts BEGIN IMMEDIATE: the worker is then waiting for the lock."""

    def __init__(self, *args, **kwargs):
        import threading
        self.waiting = threading.Event()
        super().__init__(*args, **kwargs)

    def _connect(self):
        db = super()._connect()
        db.set_trace_callback(lambda sql: sql == "BEGIN IMMEDIATE" and self.waiting.set())
        return db


async def test_run_once_async_cancelled_while_waiting_for_the_lock_runs_nothing(tmp_path):
    """A consumer cancels a listener call (consume timeout, hand-over, shutdown) and its message comes
    again; the call's run, still waiting in the worker for another connection's lock, must not go on to
    run the handler after its caller has gone: it is dropped, and the redelivery runs it."""
    import asyncio
    path = str(tmp_path / "ledger.db")
    ledger = _Traced(path, busy_timeout_s=20)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    ran = []
    msg = _message("K-cancelled")
    async with asyncio.timeout(20):
        call = asyncio.get_running_loop().create_task(ledger.run_once_async(msg, lambda m, db: ran.append(m)))
        assert await asyncio.to_thread(ledger.waiting.wait, 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        holder.execute("ROLLBACK")
        # Calls run one at a time in order: once this one has run, the cancelled one is over.
        assert await ledger.run_once_async(_message("K-next"), lambda m, db: None)
        assert ran == []
        assert ledger.db.execute("SELECT key FROM txmq_consumed").fetchall() == [("T\x01K-next",)]
        assert await ledger.run_once_async(msg, lambda m, db: ran.append(m))     # the redelivery runs it
        assert not await ledger.run_once_async(msg, lambda m, db: ran.append(m))
    assert ran == [msg]
    holder.close()
    await ledger.aclose()


async def test_run_once_async_cancelled_mid_handler_commits_its_writes_with_its_key(tmp_path):
    """A handler already running when its call is cancelled finishes in the worker; its writes and its key
    commit together, so the message's redelivery is skipped and the effect happened once."""
    import asyncio
    import threading
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    ledger.db.execute("CREATE TABLE applied (body TEXT)")
    inside, go_on = threading.Event(), threading.Event()

    def apply(msg, db):
        db.execute("INSERT INTO applied VALUES ('a')")
        inside.set()
        go_on.wait(10)
    msg = _message("K-mid")
    async with asyncio.timeout(20):
        call = asyncio.get_running_loop().create_task(ledger.run_once_async(msg, apply))
        assert await asyncio.to_thread(inside.wait, 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call      # returns at once, the handler still running
        go_on.set()
        assert not await ledger.run_once_async(msg, apply)      # redelivered: its key is there
    assert ledger.db.execute("SELECT COUNT(*) FROM applied").fetchone()[0] == 1
    await ledger.aclose()


async def test_run_once_async_refuses_an_in_memory_database():
    """The worker's connection to ":memory:" would be another, empty, database."""
    ledger = SqliteIdempotency(":memory:")
    with pytest.raises(ValueError):
        await ledger.run_once_async(_message("k"), lambda m, db: None)
    ledger.close()


def test_close_closes_the_workers_connection_too(tmp_path):
    """close() from plain code after run_once_async ran on a loop: the worker's connection is closed in
    its own thread (sqlite3 refuses another), and the worker thread ends."""
    import asyncio
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    assert asyncio.run(ledger.run_once_async(_message("k"), lambda m, db: None))
    worker_db = ledger._worker_db
    ledger.close()
    assert ledger._worker is None and ledger._worker_db is None
    with pytest.raises(sqlite3.ProgrammingError):
        worker_db.execute("SELECT 1")
    with pytest.raises(sqlite3.ProgrammingError):       # not a new worker opening the database again
        asyncio.run(ledger.run_once_async(_message("k2"), lambda m, db: None))
    assert ledger._worker is None


@pytest.mark.parametrize("ends_it", ["with db", "commit()", "COMMIT", "rollback()", "executescript"])
def test_a_handler_that_ends_the_transaction_is_refused_and_nothing_is_marked(tmp_path, ends_it):
    """The key and the handler's writes commit in one transaction, which run_once opens and closes. A handler
    that closed it itself (``with db:``, the usual sqlite3 idiom, commits on exit) committed the key with what
    it had written so far: when it then failed, its redelivery was skipped and the rest of its effect never
    happened. One that rolled back (a ``with db:`` whose block raised, caught) dropped the key and went on
    writing in autocommit: its redelivery ran it again, a second effect. Now the attempt raises, named, and
    the run is rolled back whole, even if the handler swallows that error."""
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    ledger.db.execute("CREATE TABLE applied (part TEXT)")

    def apply(msg, db):
        db.execute("INSERT INTO applied VALUES ('first')")
        try:
            if ends_it == "with db":
                with db:
                    db.execute("INSERT INTO applied VALUES ('in with')")
            elif ends_it == "commit()":
                db.commit()
            elif ends_it == "COMMIT":
                db.execute("COMMIT")
            elif ends_it == "executescript":
                db.executescript("INSERT INTO applied VALUES ('scripted');")
            else:
                db.rollback()
        except sqlite3.DatabaseError:
            pass                                        # a handler that swallows what went wrong
        db.execute("INSERT INTO applied VALUES ('second')")
        raise RuntimeError("the second half failed")

    msg = _message("K-ends")
    with pytest.raises(sqlite3.ProgrammingError, match="must not commit or roll back"):
        ledger.run_once(msg, apply)
    assert ledger.db.execute("SELECT COUNT(*) FROM applied").fetchone()[0] == 0
    assert ledger.db.execute("SELECT COUNT(*) FROM txmq_consumed").fetchone()[0] == 0
    assert not ledger.db.in_transaction
    # the connection is the caller's again: its own transactions work, and a well-behaved handler runs
    ledger.db.execute("BEGIN")
    ledger.db.execute("COMMIT")
    assert ledger.run_once(msg, lambda m, db: db.execute("SAVEPOINT s") and db.execute("RELEASE s"))
    assert not ledger.run_once(msg, apply)
    ledger.close()


def _in(topic: str, key: str, props: str = "") -> MessageExt:
    record = encode_record(topic=topic.encode(), body=b"x", queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                           born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                           properties=f"UNIQ_KEY\x01{key}\x02{props}".encode())
    return decode_record(record)[0]


def test_a_message_forwarded_to_another_topic_is_not_taken_for_its_source(tmp_path):
    """A producer keeps a UNIQ_KEY it is given (RocketMQ's too), so a message consumed from one topic and sent
    on to another with its properties, the usual way to forward one, arrives there with the same UNIQ_KEY.
    One database for both stages (the business data in one place, as run_once asks) then skipped every
    forwarded message, the handler never run and nothing said. A key is its message's within its topic; a
    retry or dead-letter copy still counts as its original topic's."""
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    ran = []
    assert ledger.run_once(_in("Orders", "K"), lambda m, db: ran.append(m.topic))
    assert ledger.run_once(_in("Enriched", "K"), lambda m, db: ran.append(m.topic))
    assert ran == ["Orders", "Enriched"]
    # retries of either, as pulled from %RETRY%<group>, as a push consumer hands them on, and as dead letters
    for copy in (_in("%RETRY%CG", "K", "RETRY_TOPIC\x01Orders\x02"), _in("Orders", "K", "RETRY_TOPIC\x01Orders\x02"),
                 _in("%DLQ%CG", "K", "RETRY_TOPIC\x01Enriched\x02"),
                 _in("Enriched", "K", "RETRY_TOPIC\x01Orders\x02")):      # forwarded from a retry: still its own
        assert not ledger.run_once(copy, lambda m, db: ran.append(m.topic)), copy.topic
    assert ran == ["Orders", "Enriched"]
    ledger.close()


def test_keys_recorded_before_topics_scoped_them_still_count(tmp_path):
    """Keys were recorded without their topic before: a message consumed then and delivered again after an
    upgrade (a restart redelivers what was consumed since the last offset commit) is still skipped."""
    path = str(tmp_path / "ledger.db")
    ledger = SqliteIdempotency(path)
    ledger.db.execute("INSERT INTO txmq_consumed (key, consumed_ms) VALUES ('K-old', 1)")
    assert not ledger.run_once(_in("Orders", "K-old"), lambda m, db: pytest.fail("ran again"))
    assert ledger.run_once(_in("Orders", "K-new"), lambda m, db: None)
    ledger.close()


def test_a_key_that_reads_like_another_topics_scoped_key_is_not_taken_for_it(tmp_path):
    """Keys recorded before topics scoped them are looked up as they are. Scoped as "<topic>:<key>" at first, a UNIQ_KEY
    "Payments:42" (a producer may set its own, and "<entity>:<id>" is a usual shape) in topic Orders was
    looked up as an old key, found Payments' message 42, and was skipped, its handler never run, unsaid. The
    topic is joined to the key by a character no property value holds."""
    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    ran = []
    assert ledger.run_once(_in("Payments", "42"), lambda m, db: ran.append(m.topic))
    assert ledger.run_once(_in("Orders", "Payments:42"), lambda m, db: ran.append(m.topic))
    assert ran == ["Payments", "Orders"]
    ledger.close()


@pytest.mark.parametrize("clock_row", [False, True], ids=["table-before-the-clock", "clock-of-this-boot"])
def test_a_read_only_database_still_opens(tmp_path, clock_row):
    """An open of a database it may not write (a read-only mount or file, an audit reading the keys) worked before
    the clock table: its CREATE and BEGIN IMMEDIATE then refused the open ("attempt to write a readonly database"),
    also for a table an older release wrote (no clock table yet) -- an upgrade's read-only reader could not start."""
    path = str(tmp_path / "keys.db")
    if clock_row:
        SqliteIdempotency(path).close()
    else:       # as a release before the clock table left it
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE txmq_consumed (key TEXT PRIMARY KEY, consumed_ms INTEGER NOT NULL)")
        db.execute("CREATE INDEX txmq_consumed_by_time ON txmq_consumed (consumed_ms)")
        db.commit()
        db.close()

    class ReadOnly(SqliteIdempotency):
        def _connect(self):
            return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None)

    keys = ReadOnly(path)
    try:
        assert keys.db.execute("SELECT count(*) FROM txmq_consumed").fetchone() == (0,)
    finally:
        keys.close()
