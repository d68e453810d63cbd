"""txmq.sync: the blocking facade against a real broker, called from plain (non-async) code."""
from __future__ import annotations

import threading

import pytest

from consumer import ConsumeStatus
from producer import LocalTransactionState as S
from protocol.errors import ResponseError
from txmq import sync


class Commit:
    def execute_local_transaction(self, msg, arg):
        return S.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        return S.COMMIT_MESSAGE


def test_scripts_send_pull_and_commit_transactions_without_asyncio(broker):
    with sync.Producer(broker.namesrv, "PG_sync", timeout=20) as producer:
        sent = producer.send("SyncTopic", b"plain", tags="a")
        with pytest.raises(ResponseError):          # the broker's refusal arrives as the exception
            producer.send("bad topic name!", b"x")
    with sync.TransactionProducer(broker.namesrv, "PG_sync_tx", Commit(), timeout=20) as tx:
        done = tx.send_in_transaction("SyncTopic", b"committed")
        assert done.acknowledged and done.state is S.COMMIT_MESSAGE
    with sync.PullConsumer(broker.namesrv, "CG_sync", timeout=20) as consumer:
        bodies = []
        for mq in consumer.fetch_queues("SyncTopic"):
            bodies += [m.body for m in consumer.pull(mq, 0, max_nums=32).messages]
        assert sorted(bodies) == [b"committed", b"plain"] and sent.status.name == "SEND_OK"

    got = threading.Event()
    seen = []

    def on_message(msg):
        seen.append(msg.body)
        if len(seen) == 2:
            got.set()
        return ConsumeStatus.CONSUME_SUCCESS

    push = sync.PushConsumer(broker.namesrv, "CG_sync_push", on_message, consume_from="first", timeout=20)
    try:
        push.subscribe("SyncTopic", "*")
        push.start()
        assert got.wait(20) and sorted(seen) == [b"committed", b"plain"]
    finally:
        push.close()
