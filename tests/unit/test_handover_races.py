"""PushConsumer hand-over races on the event loop, without a broker: a queue given away by one rebalance
and taken back by another while its old pull loop still has a message in hand."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from consumer import ConsumeStatus, PushConsumer
from consumer.pull_consumer import MessageQueue, PullResult, PullStatus
from protocol.message import MessageExt
from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import ConnectionClosedError
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


@bounded(20)
async def test_a_queue_taken_back_during_its_hand_over_is_consumed_again_once_the_hand_over_ends():
    """``rebalance()`` is public: one called while the loop's own waits on a hand-over can take the queue
    back. Its pull loop was started at once and, the queue still leaving, ended before its first pull,
    left in ``_loops`` as a finished task that no later rebalance replaced: the queue stopped for good."""
    mq = MessageQueue("T", "b", 0)
    pulls = []
    consumer, ids, in_hand, release = _holding_its_message(handover_grace_s=10)
    me = ids[0]
    stored = {mq: 0}            # the broker's committed offsets
    _fake_broker(consumer, mq, ids=ids, pull={0: 1}, pulls=pulls, start_offset=stored, write=stored)
    first = None
    try:
        await consumer.rebalance()
        await in_hand.wait()
        ids[:] = ["!", me]                  # "!" sorts first: it gets the queue
        first = asyncio.get_running_loop().create_task(consumer.rebalance())
        while mq not in consumer._leaving:
            await asyncio.sleep(0)
        ids[:] = [me]
        await consumer.rebalance()          # taken back while m0 is still in hand
        release.set()
        await first
        for _ in range(100):
            if pulls[-1:] == [1]:
                break
            await asyncio.sleep(0.01)
        assert mq in consumer._loops and not consumer._loops[mq].done(), "the queue taken back has no pull loop"
        assert pulls == [0, 1], "the queue taken back is not pulled again after its hand-over, from its commit"
    finally:
        release.set()
        if first is not None:
            await asyncio.gather(first, return_exceptions=True)
        await consumer.shutdown()


@bounded(20)
async def test_a_message_that_could_not_be_handed_back_is_not_given_to_the_listener_again_once_halted():
    """RECONSUME_LATER, and the broker does not take the message back: it is retried here after
    local_retry_delay_s. A hand-over or shutdown that began meanwhile leaves it uncommitted for the next
    consumer; the listener was called on it once more first (a new call after "no new message")."""
    from protocol.errors import ConnectionClosedError
    mq = MessageQueue("T", "b", 0)
    calls = []

    def listener(msg):
        calls.append(msg.body)
        return ConsumeStatus.RECONSUME_LATER

    consumer = PushConsumer("127.0.0.1:1", "G", listener, local_retry_delay_s=0.3, shutdown_grace_s=10)
    handed_back = asyncio.Event()

    async def send_back(q, msg, **kw):
        handed_back.set()
        raise ConnectionClosedError("the broker went away")

    writes = []
    _fake_broker(consumer, mq, send_back=send_back, pull={0: 1}, start_offset=0, write=writes)
    consumer._owned = {mq}
    consumer._start_loop(mq)
    await handed_back.wait()            # the listener said later, the hand-back failed: waiting to retry
    await consumer.shutdown()
    assert calls == [b"m0"], "the listener was called again after shutdown began"
    assert writes == [0], "m0 was committed though not consumed"


@bounded(20)
async def test_an_orderly_queue_being_handed_over_keeps_its_lock_renewed_while_its_message_is_in_hand():
    """The lock renewal asked only for the owned queues: a hand-over (handover_grace_s) longer than the
    broker's lock life (60 s) let the next owner lock and consume the queue while the old owner's message
    was still in hand, out of order."""
    mq = MessageQueue("T", "b", 0)
    consumer, ids, in_hand, release = _holding_its_message(orderly=True, handover_grace_s=10)
    me = ids[0]
    asked, unlocked = [], []

    async def lock_queues(mqs):
        asked.append(set(mqs))
        return set(mqs)
    _fake_broker(consumer, mq, ids=ids, lock_queues=lock_queues, unlock_queues=unlocked, pull={0: 1}, start_offset=0,
                 write=_discard)
    handing = None
    try:
        await consumer.rebalance()
        await in_hand.wait()
        ids[:] = ["!", me]
        handing = asyncio.get_running_loop().create_task(consumer.rebalance())
        while mq not in consumer._leaving:
            await asyncio.sleep(0)
        asked.clear()
        await consumer._lock_owned()        # a turn of the lock loop during the hand-over
        assert any(mq in s for s in asked), "the lock of the queue whose message is in hand was not renewed"
        assert unlocked == []
        release.set()
        await handing
        assert unlocked == [mq] and mq not in consumer._locks     # released once its message was done
    finally:
        release.set()
        if handing is not None:
            await asyncio.gather(handing, return_exceptions=True)
        await consumer.shutdown()


@bounded(20)
async def test_a_lock_granted_for_a_queue_given_away_meanwhile_is_released_not_kept():
    """The lock loop asks for the owned queues' locks; a rebalance that gives one away (and unlocks it)
    while that request is out got the lock back here, held for nobody: its next owner waited until this
    consumer's next rebalance or the broker's expiry."""
    mq, kept = MessageQueue("T", "b", 0), MessageQueue("T", "b", 1)
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, orderly=True)
    consumer._owned = {mq, kept}
    unlocked = []

    async def lock_queues(mqs):
        consumer._owned = {kept}            # the rebalance ran meanwhile
        return set(mqs)
    _fake_broker(consumer, mq, lock_queues=lock_queues, unlock_queues=unlocked)
    try:
        await consumer._lock_owned()
        assert mq not in consumer._locks and kept in consumer._locks
        assert unlocked == [mq]
    finally:
        await consumer.client.shutdown()


@bounded(20)
async def test_a_listener_raising_cancelled_error_does_not_stop_its_queue_for_good():
    """A listener that awaits something cancelled elsewhere (a task it gathers, a shared future) raises
    CancelledError though nothing cancelled the pull loop. It went through ``_listen`` (which catches
    Exception only) and ended the pull loop as cancelled: ``_crashed`` ignores cancelled tasks, the done
    task stayed in ``_loops`` and no rebalance replaced it. The queue, still owned, was never consumed
    again, and nothing was logged. It is a failed listener call (RECONSUME_LATER), as any other raise."""
    mq = MessageQueue("T", "b", 0)
    calls, sent_back, pulls = [], [], []

    async def listener(msg):
        calls.append(msg.body)
        if len(calls) == 1:
            gone = asyncio.get_running_loop().create_future()
            gone.cancel()                   # e.g. a request another task gave up
            await gone
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer("127.0.0.1:1", "G", listener, shutdown_grace_s=1)

    async def pull(q, offset, **kw):
        pulls.append(offset)
        if offset < 2:
            return PullResult(PullStatus.FOUND, offset + 1, 0, 2,
                              [MessageExt("T", b"m%d" % offset, queue_offset=offset)])
        await asyncio.Event().wait()

    async def send_back(q, msg, **kw):
        sent_back.append(msg.body)
    _fake_broker(consumer, mq, pull=pull, send_back=send_back, start_offset=0, write=_discard)
    consumer._owned = {mq}
    consumer._start_loop(mq)
    try:
        for _ in range(200):
            if pulls[-1:] == [2]:
                break
            await asyncio.sleep(0.01)
        assert not consumer._loops[mq].done(), "the pull loop ended: the queue is owned but never consumed"
        assert sent_back == [b"m0"] and calls == [b"m0", b"m1"] and pulls == [0, 1, 2]
    finally:
        await consumer.shutdown()


@bounded(20)
async def test_a_pull_loop_ended_cancelled_by_no_one_is_restarted_by_the_next_rebalance():
    """Whatever ends a registered pull loop (a CancelledError from below it), the queue is not left with
    a finished task in ``_loops``: it is dropped, counted, and a rebalance is asked for."""
    mq = MessageQueue("T", "b", 0)
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS)

    async def pull(q, offset, **kw):
        raise asyncio.CancelledError()      # not a cancel of the loop's task
    _fake_broker(consumer, mq, pull=pull, start_offset=0)
    consumer._owned = {mq}
    consumer._start_loop(mq)
    try:
        task = consumer._loops[mq]
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        assert mq not in consumer._loops and consumer._rebalance_now.is_set() and consumer.crashes == 1
    finally:
        await consumer.shutdown()


@bounded(20)
async def test_a_rebalance_during_an_offset_reset_does_not_start_the_queue_from_its_old_offset():
    """``reset_offsets`` stops the topic's pull loops, writes the new offsets, then starts them again. A
    rebalance in between saw the queue owned with no loop and started one at once, which read the old
    stored offset: the reset was silently undone (its loop's commits wrote the old position back)."""
    mq = MessageQueue("T", "b", 0)
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS)
    consumer.subscribe("T")
    me = consumer.client.client_id
    stored = {mq: 5}
    pulls = []
    writing, go_on = asyncio.Event(), asyncio.Event()

    async def write(q, offset):
        writing.set()
        await go_on.wait()              # the broker answers slowly
        stored[q] = offset
    _fake_broker(consumer, mq, ids=[me], pull={}, pulls=pulls, start_offset=stored, write=write)
    reset = None
    try:
        await consumer.rebalance()
        while pulls != [5]:
            await asyncio.sleep(0)
        reset = asyncio.get_running_loop().create_task(consumer.reset_offsets("T", {mq: 1}))
        await writing.wait()
        await consumer.rebalance()      # the rebalance loop's turn, while the reset is written
        await asyncio.sleep(0.05)
        go_on.set()
        await reset
        for _ in range(100):
            if len(pulls) > 1:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert pulls == [5, 1], "the queue was not pulled from its reset offset (only)"
        assert consumer._offsets[mq] == 1
    finally:
        go_on.set()
        if reset is not None:
            await asyncio.gather(reset, return_exceptions=True)
        await consumer.shutdown()


@bounded(20)
async def test_shutdown_unlocks_an_owned_queue_whose_lock_request_it_cut():
    """Shutdown cancels the lock loop (or a rebalance) while its LOCK_BATCH_MQ is out: the broker may grant
    a queue this consumer did not hold yet, and the answer, cut, never reached ``_locks``. Shutdown
    unlocked only ``_locks``, so that queue stayed locked for nobody: its next owner waited for the
    broker's expiry (60 s). Shutdown unlocks every owned queue too (an unlock of another's is a no-op)."""
    mq = MessageQueue("T", "b", 0)
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, orderly=True)
    consumer._owned = {mq}
    broker_locks, asked = set(), asyncio.Event()

    async def lock_queues(mqs):
        broker_locks.update(mqs)        # granted on the broker; the answer is slow
        asked.set()
        await asyncio.Event().wait()

    async def unlock_queues(mqs):
        broker_locks.difference_update(mqs)
    _fake_broker(consumer, mq, lock_queues=lock_queues, unlock_queues=unlock_queues, write=_discard)
    consumer._lock_task = asyncio.get_running_loop().create_task(consumer._lock_owned())
    consumer._tasks = [consumer._lock_task]
    await asyncio.wait_for(asked.wait(), 5)
    await consumer.shutdown()
    assert broker_locks == set(), "a queue locked on the broker by the cut request was left locked"


@bounded(20)
async def test_a_given_up_call_ending_late_leaves_the_queues_new_loop_alone():
    """A listener that swallows its hand-over's cancel is given up on after abandon_after_s, and the queue
    may come back to this consumer while that call still runs: a new loop then holds the same message.
    When the given-up call ends at last, its loop must change nothing: not the offset, and not the new
    loop's "message in hand" mark (dropped, shutdown cancelled the new loop's call at once instead of
    giving it shutdown_grace_s)."""
    calls, cancelled_second = [], []
    first_in, second_in = asyncio.Event(), asyncio.Event()
    release_first, release_second = asyncio.Event(), asyncio.Event()

    async def listener(msg):
        calls.append(msg.body)
        if len(calls) == 1:
            first_in.set()
            for _ in range(100):        # swallows every cancel until released
                try:
                    await release_first.wait()
                    break
                except asyncio.CancelledError:
                    pass
            return ConsumeStatus.CONSUME_SUCCESS
        second_in.set()
        try:
            await release_second.wait()
        except asyncio.CancelledError:
            cancelled_second.append(msg.body)
            raise
        return ConsumeStatus.CONSUME_SUCCESS

    consumer, mq, stored, _, ids = _one_queue(listener, {0: 1}, handover_grace_s=0.1, abandon_after_s=0.1,
                                             shutdown_grace_s=10)
    me = ids[0]
    try:
        await consumer.rebalance()
        await first_in.wait()
        given_up = consumer._loops[mq]
        ids[:] = ["!", me]
        await consumer.rebalance()          # handed over: the call ignores its cancel and is given up on
        assert given_up in consumer._abandoned and not given_up.done()
        assert stored[mq] == 0
        ids[:] = [me]
        await consumer.rebalance()          # taken back: a new loop, m0 again
        await second_in.wait()
        release_first.set()
        await given_up                      # the given-up call ends, its loop after it
        assert stored[mq] == 0 and consumer._offsets[mq] == 0
        assert mq in consumer._consuming, "the new loop's message in hand is no longer marked"
        stopping = asyncio.get_running_loop().create_task(consumer.shutdown())
        while not consumer.shutting_down:
            await asyncio.sleep(0)
        release_second.set()
        await stopping
        assert cancelled_second == [] and calls == [b"m0", b"m0"]
        assert stored[mq] == 1
    finally:
        release_first.set()
        release_second.set()
        if not consumer.shutting_down:
            await consumer.shutdown()


@bounded(20)
async def test_a_failed_hand_over_is_counted_once(caplog):
    """A hand-over that raises something other than BrokerError (here its offset commit) is logged and counted
    by its task's callback; the rebalance that waited for it raised the same exception again, and the
    rebalance loop counted it a second time as a failed turn."""
    mq = MessageQueue("T", "b", 0)
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, rebalance_interval_s=60)
    consumer.subscribe("T")
    me = consumer.client.client_id
    ids = [me]
    turns = asyncio.Queue()

    async def heartbeat():
        pass

    async def write(q, offset):
        raise ValueError("a bug in the offset store")
    _fake_broker(consumer, mq, ids=ids, pull={}, start_offset=0, write=write)

    real_rebalance = consumer.rebalance

    async def rebalance():
        try:
            await real_rebalance()
        finally:
            turns.put_nowait(None)
    consumer._heartbeat, consumer.rebalance = heartbeat, rebalance
    task = None
    try:
        await real_rebalance()
        assert mq in consumer._loops
        consumer._offsets[mq] = 5           # consumed up to 5: the hand-over commits it
        task = asyncio.get_running_loop().create_task(consumer._rebalance_loop())
        ids[:] = ["!", me]                  # "!" sorts first: it gets the queue
        consumer._request_rebalance()
        await asyncio.wait_for(turns.get(), 5)
        assert not consumer._handovers and mq not in consumer._loops and mq not in consumer._leaving
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        consumer._offsets.clear()
        await consumer.shutdown()
    assert consumer.crashes == 1, caplog.text
    assert "rebalance of G failed" not in caplog.text and "a bug in the offset store" in caplog.text


@bounded(20)
async def test_a_loop_given_up_on_while_handing_its_message_back_moves_no_offset_and_calls_no_listener():
    """The listener swallows its hand-over's cancel and returns RECONSUME_LATER at once; the loop then hands
    the message back (CONSUMER_SEND_MSG_BACK), which takes longer than abandon_after_s (a slow broker), and
    the loop is given up on there, not in a listener call. The queue comes back meanwhile, a new loop
    consumes it from the committed offset. When the send-back returns at last, the given-up loop set the
    queue's offset past its batch's first message over the new loop's, and went on to the rest of its
    batch: a listener call on m1 from a loop no longer the queue's, alongside the new loop's."""
    calls = []
    first_in, second_in, sent_back = asyncio.Event(), asyncio.Event(), asyncio.Event()
    release_send_back, release_rest = asyncio.Event(), asyncio.Event()

    async def listener(msg):
        calls.append(msg.body)
        if len(calls) == 1:
            first_in.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:      # swallowed: returns its verdict instead
                return ConsumeStatus.RECONSUME_LATER
        second_in.set()
        await release_rest.wait()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer, mq, stored, _, ids = _one_queue(listener, {0: 2}, handover_grace_s=0.1, abandon_after_s=0.1)
    me = ids[0]

    async def send_back(q, msg, **kw):
        sent_back.set()
        await release_send_back.wait()
    consumer.client.send_back = send_back
    try:
        await consumer.rebalance()
        await first_in.wait()
        given_up = consumer._loops[mq]
        ids[:] = ["!", me]
        await consumer.rebalance()          # handed over: the call returns, its send-back hangs: given up on
        assert sent_back.is_set() and given_up in consumer._abandoned and not given_up.done()
        assert stored[mq] == 0
        ids[:] = [me]
        await consumer.rebalance()          # taken back: a new loop, m0 again
        await second_in.wait()
        new_loop = consumer._loops[mq]
        release_send_back.set()             # the given-up loop's send-back returns
        await asyncio.wait([given_up], timeout=10)     # done at once; gone on, it never is
        assert given_up.done(), "the given-up loop went on after its send-back"
        assert calls == [b"m0", b"m0"], "the given-up loop called the listener on the rest of its batch"
        assert consumer._offsets[mq] == 0, "the given-up loop moved the new loop's offset"
        assert mq in consumer._consuming and consumer._loops[mq] is new_loop
    finally:
        release_send_back.set()
        release_rest.set()
        await consumer.shutdown()


def _fake_broker(consumer, mq, *, ids=None, pull=None, pulls=None, start_offset=None, write=None,
                 lock_queues=None, unlock_queues=None, send_back=None):
    """Fakes the broker calls of ``consumer`` that are given, the others left as they are. ``ids`` is the group
    (a list the test changes: put "!" first to give the queue away) and ``mq`` the one queue of topic T.
    ``pull`` is the pull, or a dict of batches: a pull at an offset in it finds that many messages from there
    (bodies m<offset>), any other waits for ever (a long poll with nothing new); pulled offsets land in ``pulls``.
    ``start_offset`` is a number, or the dict of committed offsets. ``write`` is the offset commit, or a dict
    (the committed offsets) or list it lands in. ``unlock_queues`` is the unlock, or a list the queues land in."""
    client = consumer.client
    if ids is not None:
        async def fetch_queues(topic):
            return [mq] if topic == "T" else []

        async def consumer_ids(q):
            return list(ids)
        client.fetch_queues, client.consumer_ids = fetch_queues, consumer_ids
    if isinstance(pull, dict):
        batches = pull

        async def pull(q, offset, **kw):
            if pulls is not None:
                pulls.append(offset)
            if offset in batches:
                n = batches[offset]
                return PullResult(PullStatus.FOUND, offset + n, 0, offset + n,
                                  [MessageExt("T", b"m%d" % o, queue_offset=o) for o in range(offset, offset + n)])
            await asyncio.Event().wait()
    if pull is not None:
        client.pull = pull
    if isinstance(start_offset, dict):
        committed = start_offset

        async def start_offset(q):
            return committed[q]
    elif start_offset is not None:
        first = start_offset

        async def start_offset(q):
            return first
    if start_offset is not None:
        consumer._start_offset = start_offset
    if isinstance(write, dict):
        write = _store_in(write)
    elif isinstance(write, list):
        write = _append_to(write)
    if write is not None:
        consumer.offset_store.write = write
    if lock_queues is not None:
        client.lock_queues = lock_queues
    if isinstance(unlock_queues, list):
        unlocked = unlock_queues

        async def unlock_queues(mqs):
            unlocked.extend(mqs)
    if unlock_queues is not None:
        client.unlock_queues = unlock_queues
    if send_back is not None:
        client.send_back = send_back


def _holding_its_message(**options):
    """A PushConsumer of group G subscribed to T, alone in its group ``ids`` (put "!" first to give the queue
    away), whose listener holds each message until ``release`` is set; ``in_hand`` is set once it has one."""
    release, in_hand = asyncio.Event(), asyncio.Event()

    async def listener(msg):
        in_hand.set()
        await release.wait()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer("127.0.0.1:1", "G", listener, **options)
    consumer.subscribe("T")
    return consumer, [consumer.client.client_id], in_hand, release


def _store_in(stored):
    """An offset commit that lands in ``stored`` by queue."""
    async def write(q, offset):
        stored[q] = offset
    return write


def _append_to(writes):
    """An offset commit appended to ``writes``."""
    async def write(q, offset):
        writes.append(offset)
    return write


async def _discard(q, offset):
    """An offset commit that goes nowhere."""


async def _grant(mqs):
    """A lock request the broker grants in full."""
    return set(mqs)


def _one_queue(listener, batches: dict[int, int], **options):
    """A PushConsumer of group G owning queue T/0 with its broker faked: a pull at an offset in ``batches``
    finds that many messages from there (bodies m<offset>), any other waits for ever (a long poll with nothing
    new); committed offsets land in ``stored``, pulled offsets in ``pulls``, and ``ids`` is the group
    (this consumer alone at first: put "!" first to give the queue away)."""
    mq = MessageQueue("T", "b", 0)
    options.setdefault("shutdown_grace_s", 0)
    consumer = PushConsumer("127.0.0.1:1", "G", listener, **options)
    consumer.subscribe("T")
    stored, pulls, ids = {mq: 0}, [], [consumer.client.client_id]
    _fake_broker(consumer, mq, ids=ids, pull=batches, pulls=pulls, start_offset=stored, write=stored)
    return consumer, mq, stored, pulls, ids


@bounded(20)
async def test_an_offset_reset_gives_up_a_listener_that_ignores_its_cancel(caplog):
    """RESET_CONSUMER_CLIENT_OFFSET cancels the topic's pull loops and waited for them without a limit: a
    listener that swallows its cancel held the reset for ever -- the new offsets never written, the queue
    never consumed again (kept out of rebalances while it resets). It is given up on after abandon_after_s,
    as shutdown and hand-overs do; the reset completes, and the call's late end moves no offset."""
    calls, entered, release = [], asyncio.Event(), asyncio.Event()

    async def listener(msg):
        calls.append(msg.body)
        if len(calls) == 1:
            entered.set()
            for _ in range(100):
                try:
                    await release.wait()
                    break
                except asyncio.CancelledError:
                    pass
            return ConsumeStatus.CONSUME_SUCCESS
        await asyncio.Event().wait()

    consumer, mq, stored, pulls, _ = _one_queue(listener, {0: 2, 5: 2}, abandon_after_s=0.2)
    try:
        await consumer.rebalance()
        await entered.wait()
        old = consumer._loops[mq]
        await asyncio.wait_for(consumer.reset_offsets("T", {mq: 5}), 3)
        assert stored[mq] == 5 and old in consumer._abandoned
        assert any(r.levelno >= logging.ERROR and "abandon_after_s" in r.getMessage() for r in caplog.records)
        while calls != [b"m0", b"m5"]:          # the queue is consumed again, from the new offset
            await asyncio.sleep(0.01)
        release.set()
        await old
        assert consumer._offsets[mq] == 5 and stored[mq] == 5, "the given-up call moved the reset offset"
        assert calls == [b"m0", b"m5"]
    finally:
        release.set()
        await consumer.shutdown()


@bounded(20)
async def test_a_loop_an_offset_reset_cancels_takes_no_further_message():
    """A listener swallows the reset's cancel and returns at once: its loop went on with the rest of its batch
    (m1, the old position) and then pulled on from there, while the reset waited for it to end."""
    calls, entered = [], asyncio.Event()

    async def listener(msg):
        calls.append(msg.body)
        if len(calls) == 1:
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                return ConsumeStatus.CONSUME_SUCCESS
        return ConsumeStatus.CONSUME_SUCCESS

    consumer, mq, stored, pulls, _ = _one_queue(listener, {0: 2, 5: 2}, abandon_after_s=1)
    try:
        await consumer.rebalance()
        await entered.wait()
        await asyncio.wait_for(consumer.reset_offsets("T", {mq: 5}), 3)
        while consumer._offsets.get(mq) != 7:
            await asyncio.sleep(0.01)
        assert calls == [b"m0", b"m5", b"m6"], "the cancelled loop consumed on from the old offset"
        assert pulls == [0, 5, 7]
    finally:
        await consumer.shutdown()


@bounded(20)
async def test_an_orderly_queue_whose_connection_broke_during_its_hand_over_is_still_unlocked_after_it():
    """A lost connection ends the trust in the locks its broker granted (_on_broker_lost), the lock of a queue
    being handed over too. A connection that only broke leaves that lock held on the broker for this client;
    the hand-over unlocked only the queues still in ``_locks``, so it left it held, and the queue's next owner
    waited for the broker's lock expiry (60 s) before it could consume."""
    mq = MessageQueue("T", "b", 0)
    consumer, ids, in_hand, release = _holding_its_message(orderly=True, handover_grace_s=10)
    me = ids[0]
    unlocked = []
    _fake_broker(consumer, mq, ids=ids, lock_queues=_grant, unlock_queues=unlocked, pull={0: 1}, start_offset=0,
                 write=_discard)
    consumer.client.brokers_at = lambda addr: {"b"} if addr == "10.0.0.2:10911" else set()
    handing = None
    try:
        await consumer.rebalance()
        await in_hand.wait()
        ids[:] = ["!", me]
        handing = asyncio.get_running_loop().create_task(consumer.rebalance())
        while mq not in consumer._leaving:
            await asyncio.sleep(0)
        consumer._on_broker_lost("10.0.0.2:10911")      # the connection broke: the broker still holds the lock
        assert mq not in consumer._locks
        release.set()
        await handing
        assert unlocked == [mq], "the lock of the queue handed over was left held on its broker"
    finally:
        release.set()
        if handing is not None:
            await asyncio.gather(handing, return_exceptions=True)
        await consumer.shutdown()


@pytest.mark.parametrize("held", [False, True], ids=["first-lock", "renewal"])
@bounded(10)
async def test_a_lock_granted_over_a_connection_lost_before_the_grant_is_acted_on_is_not_trusted(held):
    """The lock answer and the connection's close read in one loop step: the close's callback
    (_on_broker_lost) ran before the lock request's caller resumed, found no lock (a first one) or dropped
    the old one (a renewal), and then the grant was trusted for lock_expire_s. A restarted broker holds no
    such lock and grants it to the next consumer that asks: both consumed the orderly queue. A grant whose
    broker's connection was lost meanwhile is not trusted now, and the lock is asked for again at once."""
    mq = MessageQueue("T", "b", 0)
    addr = "127.0.0.1:10911"
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, orderly=True)
    consumer.client._brokers["b"] = addr
    consumer._owned = {mq}
    if held:
        consumer._locks[mq] = 0.0

    async def lock_queues(mqs):
        consumer.client.pool.on_lost(addr)     # granted, and the connection closed, before we resume
        return set(mqs)
    consumer.client.lock_queues = lock_queues
    await consumer._lock_owned()
    assert mq not in consumer.locked_queues, "a lock granted over a lost connection is trusted"
    assert consumer._relock_now.is_set()


@bounded(10)
async def test_a_replaced_connections_late_close_beats_and_keeps_the_locks():
    """The late close of a connection already replaced by an open one (closed by us: a malformed frame) is
    reported: the broker dropped the consumer's channel with it, so the consumer beats at once. Its locks, kept by
    the broker by client id, stay trusted: dropped, the locks just granted over the new connection were undone."""
    mq = MessageQueue("T", "b", 0)
    addr = "127.0.0.1:10911"
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, orderly=True)
    consumer.client._brokers["b"] = addr
    consumer._owned = {mq}
    consumer._locks[mq] = time.monotonic()
    newer = object()
    consumer.client.pool.cached = lambda a: newer if a == addr else None
    consumer.client.pool.on_lost(addr)
    assert consumer._beat_now and consumer._rebalance_now.is_set()
    assert mq in consumer.locked_queues and not consumer._relock_now.is_set()
    consumer.client.pool.cached = lambda a: None       # the current connection lost: the locks go
    consumer.client.pool.on_lost(addr)
    assert mq not in consumer.locked_queues and consumer._relock_now.is_set()


async def _no_rebalance():
    pass


def _rebalance_loop(consumer, request, rebalance=_no_rebalance):
    """Starts ``consumer``'s rebalance loop (its heartbeats) with each broker request answered by ``request`` and
    each rebalance turn replaced by ``rebalance`` (by default: nothing)."""
    consumer.client.pool.request = request
    consumer.rebalance = rebalance
    return asyncio.get_running_loop().create_task(consumer._rebalance_loop())


@bounded(10)
async def test_a_broker_out_of_reach_is_beaten_again_when_another_refuses_the_heartbeat():
    """Two brokers: the connection to one is lost (it restarts), the other refuses the heartbeat (SYSTEM_BUSY past
    max_groups_per_host, an ACL). The heartbeat raised the refusal, which hides the broker out of reach, and the
    loop treated it as heard: the restarting broker was beaten again only at the next rebalance (120 s here),
    listing the group without this consumer meanwhile. It is retried after the back-off now."""
    down, busy = "127.0.0.1:10911", "127.0.0.1:10921"
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, rebalance_interval_s=120)
    consumer.client._brokers.update({"a": down, "b": busy})
    tries = []
    second = asyncio.Event()

    async def request(addr, cmd, timeout=3.0):
        if addr == down:
            tries.append(addr)
            if len(tries) >= 2:
                second.set()
            raise ConnectionClosedError(f"cannot connect to {addr}")
        return RemotingCommand(ResponseCode.SYSTEM_BUSY, remark="too many groups", flag=1)
    loop = _rebalance_loop(consumer, request)
    try:
        consumer._on_connection_lost(down)
        await second.wait()
        assert consumer.beats_failed >= 1
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


@bounded(10)
async def test_a_heartbeat_retry_beats_only_the_brokers_the_last_beat_did_not_reach():
    """One broker of two down: each retry (every few seconds, for as long as it stays down) beat the healthy one
    too, in every consumer of the process: several times its usual heartbeat load. A retry beats only the
    brokers not reached; a connection lost again beats them all."""
    down, up = "127.0.0.1:10911", "127.0.0.1:10921"
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, rebalance_interval_s=120)
    consumer.client._brokers.update({"a": down, "b": up})
    beaten = {down: 0, up: 0}
    third = asyncio.Event()

    async def request(addr, cmd, timeout=3.0):
        beaten[addr] += 1
        if addr == down:
            if beaten[down] >= 3:
                third.set()
            raise ConnectionClosedError(f"cannot connect to {addr}")
        return RemotingCommand(ResponseCode.SUCCESS, flag=1)
    loop = _rebalance_loop(consumer, request)
    try:
        consumer._on_connection_lost(down)
        await third.wait()          # the beat the loss asked for, and two retries
        assert beaten[up] == 1, beaten
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


@bounded(10)
async def test_a_group_change_told_during_a_heartbeat_retry_that_also_lost_a_connection_still_rebalances():
    """A broker that accepts and then drops each connection keeps the heartbeat retrying, each failed beat losing
    a connection. A NOTIFY_CONSUMER_IDS_CHANGED from a healthy broker arriving meanwhile set the same flag as the
    lost connection, and the retry read the pair as a loss alone: no rebalance until rebalance_interval_s (120 s
    here). The broker tells a group at most once per 0.5 s, the changes within together: that one notice was
    all there was, and the consumer kept queues the group's new member was given."""
    down, up = "127.0.0.1:10911", "127.0.0.1:10921"
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, rebalance_interval_s=120)
    consumer.client._brokers.update({"a": down, "b": up})
    beats = 0
    rebalanced = asyncio.Event()

    async def request(addr, cmd, timeout=3.0):
        nonlocal beats
        if addr == down:
            beats += 1
            if beats == 2:          # the first retry: the group changed, and the connection it made was dropped
                consumer._request_rebalance()
                consumer._on_connection_lost(down)
            raise ConnectionClosedError(f"cannot connect to {addr}")
        return RemotingCommand(ResponseCode.SUCCESS, flag=1)

    async def rebalance():
        if beats >= 2:
            rebalanced.set()
    loop = _rebalance_loop(consumer, request, rebalance)
    try:
        consumer._on_connection_lost(down)
        await rebalanced.wait()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


@bounded(10)
async def test_a_refused_heartbeat_with_a_broker_out_of_reach_is_warned_once_not_twice(caplog):
    """One broker refuses the beat, another cannot be reached: the refusal was said at WARNING as a failed beat,
    and then again at WARNING as the outage's first failed beat (`...; retrying`): two lines for one failure, where
    the outage is to have one WARNING."""
    down, busy = "127.0.0.1:10911", "127.0.0.1:10921"
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, rebalance_interval_s=120)
    consumer.client._brokers.update({"a": down, "b": busy})
    second = asyncio.Event()
    tries = 0

    async def request(addr, cmd, timeout=3.0):
        nonlocal tries
        if addr == down:
            tries += 1
            if tries >= 2:
                second.set()
            raise ConnectionClosedError(f"cannot connect to {addr}")
        return RemotingCommand(ResponseCode.SYSTEM_BUSY, remark="too many groups", flag=1)
    loop = _rebalance_loop(consumer, request)
    try:
        with caplog.at_level(logging.DEBUG, logger="txmq.consumer"):
            consumer._on_connection_lost(down)
            await second.wait()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    warned = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING and r.getMessage().startswith("heartbeat of G failed")]
    assert len(warned) == 1, warned


@bounded(10)
async def test_an_orderly_consumers_lock_requests_warn_once_while_their_broker_stays_down(caplog):
    """A lost connection drops the locks its broker granted and asks for them again at once, then every
    lock_retry_s while none is held: each failed ask was a WARNING, one a second for as long as the broker stayed
    down, beside the heartbeat's one WARNING an outage. One WARNING now, the rest DEBUG, INFO once granted again."""
    mq = MessageQueue("T", "b", 0)
    consumer = PushConsumer("127.0.0.1:1", "G", lambda m: ConsumeStatus.CONSUME_SUCCESS, orderly=True,
                            lock_retry_s=0.01)
    consumer._owned = {mq}
    asks = 0
    granted = asyncio.Event()

    async def lock_queues(mqs):
        nonlocal asks
        asks += 1
        if asks < 4:
            raise ConnectionClosedError("cannot connect to 127.0.0.1:10911")
        granted.set()
        return set(mqs)
    consumer.client.lock_queues = lock_queues
    loop = asyncio.get_running_loop().create_task(consumer._lock_loop())
    try:
        with caplog.at_level(logging.DEBUG, logger="txmq.consumer"):
            await granted.wait()
            while mq not in consumer.locked_queues:
                await asyncio.sleep(0)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "lock renewal of G failed" in warned[0], warned
    assert any(r.levelno == logging.INFO and "lock" in r.getMessage() and "again" in r.getMessage()
               for r in caplog.records)


@bounded(20)
async def test_an_offset_reset_of_a_queue_being_handed_over_is_not_undone_by_its_hand_over_commit():
    """An operator's reset reached a consumer while a rebalance was handing one of the queues it names over (its
    message in hand still running): the reset stopped only the pull loops it found (the queue's was the
    hand-over's by then) and stored the new offset, and the hand-over then committed the consumer's own progress
    over it: the queue's next owner went on from there, the reset undone on that queue alone. As RocketMQ's client
    (the reset's offset is the one its hand-over persists), the hand-over commits the reset's offset."""
    mq = MessageQueue("T", "b", 0)
    consumer, ids, in_hand, release = _holding_its_message(handover_grace_s=10)
    me = ids[0]
    stored = []
    _fake_broker(consumer, mq, ids=ids, pull={5: 1}, start_offset=5, write=stored)
    handing = None
    try:
        await consumer.rebalance()
        await in_hand.wait()
        ids[:] = ["!", me]          # the other consumer sorts first: it is given the one queue
        handing = asyncio.get_running_loop().create_task(consumer.rebalance())
        while mq not in consumer._leaving:
            await asyncio.sleep(0)
        await consumer.reset_offsets("T", {mq: 2})
        release.set()
        await handing
        assert stored[-1] == 2, f"the hand-over wrote {stored[-1]} over the reset (writes {stored})"
    finally:
        release.set()
        if handing is not None:
            await asyncio.gather(handing, return_exceptions=True)
        await consumer.shutdown()


@bounded(20)
async def test_a_loop_given_up_on_ending_leaves_the_stall_its_queues_new_loop_shows():
    """stalled_queues is kept by the pull loop retrying a message in place. A loop given up on (its listener call
    ignored its cancel: _abandon) that ended at last, the queue taken back by a new loop meanwhile, removed the
    new loop's entry: a queue still held at a failing message was missing from stalled_queues until its next
    retry (suspend_s later; for good while that retry's call ran). And one given up on that ends with its queue
    not taken back leaves no entry behind for a queue this consumer no longer consumes."""
    mq = MessageQueue("T", "b", 0)

    class Call:
        def __init__(self, fails: int):
            self.fails, self.calls, self.blocked, self.release = fails, 0, asyncio.Event(), asyncio.Event()

    calls: dict[int, Call] = {}

    async def listener(msg):
        call = calls[id(msg)]
        call.calls += 1
        if call.calls > call.fails:     # a call that ignores its cancel, until released
            call.blocked.set()
            await call.release.wait()
        return ConsumeStatus.RECONSUME_LATER

    consumer = PushConsumer("127.0.0.1:1", "G", listener, orderly=True, suspend_s=0.01, max_reconsume_times=-1)
    consumer._locked = lambda q: True
    old_msg, new_msg = (MessageExt("T", b"stuck", queue_offset=0) for _ in range(2))
    calls[id(old_msg)], calls[id(new_msg)] = Call(fails=1), Call(fails=2)
    try:
        old = asyncio.create_task(consumer._consume_in_place(mq, old_msg))
        await calls[id(old_msg)].blocked.wait()
        assert consumer.stalled_queues == {mq: 1}
        consumer._abandon(mq, old)              # its call ignored the hand-over's cancel
        new = asyncio.create_task(consumer._consume_in_place(mq, new_msg))     # the queue taken back
        await calls[id(new_msg)].blocked.wait()
        assert consumer.stalled_queues == {mq: 2}
        calls[id(old_msg)].release.set()        # the old call ends at last: its loop stops, changing nothing
        await asyncio.gather(old, return_exceptions=True)
        assert consumer.stalled_queues == {mq: 2}, "the new loop's stall is gone from stalled_queues"
        consumer._abandon(mq, new)              # given up on too, and the queue not taken back this time
        calls[id(new_msg)].release.set()
        await asyncio.gather(new, return_exceptions=True)
        assert consumer.stalled_queues == {}
    finally:
        for call in calls.values():
            call.release.set()
        await consumer.client.shutdown()
