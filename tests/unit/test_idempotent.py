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

    ledger = SqliteIdempotency(str(tmp_path / "ledger.db"))
    clock = [1_000_000.0]
    monkeypatch.setattr(idem.time, "time", lambda: clock[0])
    for i in range(25):
        assert ledger.run_once(_message(f"old-{i}"), lambda m, db: None)
    clock[0] += 3600
    assert ledger.run_once(_message("new"), lambda m, db: None)
    clock[0] += 1800
    assert ledger.forget_older_than(3000, chunk=10) == 25          # three chunks: 10, 10, 5
    assert ledger.db.execute("SELECT key FROM txmq_consumed").fetchall() == [("new",)]
    assert not ledger.run_once(_message("new"), lambda m, db: None)
    assert ledger.run_once(_message("old-3"), lambda m, db: None)
    assert ledger.forget_older_than(3000) == 0
    with pytest.raises(ValueError):
        ledger.forget_older_than(0)



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
