"""A listener that swallows the CancelledError of a shutdown or a hand-over and keeps going, against the
real broker. The consumer waited for it for ever after the grace: shutdown() never returned, and an
orderly queue given away stayed locked (its lock renewed while the hand-over waited), so its new owner
never consumed it. Now, when the call ignores its cancel for ``abandon_after_s`` more, the consumer
gives up on it, loudly: the message is not committed (it comes again to the queue's next consumer) and
the shutdown or hand-over completes; what the call does when it ends at last changes no offset."""
from __future__ import annotations

import asyncio
import logging

import pytest

from consumer import ConsumeStatus, PushConsumer
from tests.integration.test_client_shutdown import BODIES, _committed, _next_consumer_gets, _one_queue_topic
from tests.integration.test_rebalance_handover import _New, _Old

pytestmark = pytest.mark.asyncio


class _Stubborn(_Old):
    """_Old whose listener, cancelled, swallows the CancelledError and waits on for ``release``."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.swallowed, self.ended = [], asyncio.Event()

    async def listener(self, msg):
        self.entered.set()
        for _ in range(100):    # every cancel swallowed, until the test lets it return
            try:
                await self.release.wait()
                break
            except asyncio.CancelledError:
                self.swallowed.append(msg.body)
                self.handing_over.set()
        self.finished.append(msg.body)
        self.ended.set()
        return ConsumeStatus.CONSUME_SUCCESS


async def _given_up_call_ends(consumer: PushConsumer, stubborn: _Stubborn) -> None:
    """Let the given-up listener call return, and wait until its pull loop has ended after it."""
    abandoned = list(consumer._abandoned)
    stubborn.release.set()
    await stubborn.ended.wait()
    await asyncio.gather(*abandoned, return_exceptions=True)


async def test_shutdown_gives_up_a_listener_that_ignores_its_cancel(broker_factory, caplog):
    broker = broker_factory()
    topic = await _one_queue_topic(broker, "StubbornStop")
    old = _Stubborn(broker.namesrv, "CG_stubborn_stop", topic, shutdown_grace_s=0.3, abandon_after_s=0.5)
    loop = asyncio.get_running_loop()
    stopping = None
    try:
        async with asyncio.timeout(30):
            await old.consumer.start()
            await old.entered.wait()
            began = loop.time()
            stopping = loop.create_task(old.consumer.shutdown())
            await asyncio.wait_for(asyncio.shield(stopping), 10)      # returned, not waiting for ever
            took = loop.time() - began
            # the grace, then the cancel ignored for abandon_after_s: not given up before them (a bound below, which
            # load cannot break; the upper "< 5 s" was a timed bound, the wait_for above bounds the wait)
            assert took >= 0.8, took
            assert old.swallowed == [b"m0"] and old.finished == []
            assert any(r.levelno >= logging.ERROR and "abandon_after_s" in r.getMessage() for r in caplog.records)
            assert await _committed(broker.namesrv, "CG_stubborn_stop", topic) in (None, 0)
            await _given_up_call_ends(old.consumer, old)
            assert old.finished == [b"m0"]
            assert await _committed(broker.namesrv, "CG_stubborn_stop", topic) in (None, 0)    # not past m0
            assert set(old.commits) <= {0}
            rest = await _next_consumer_gets(broker.namesrv, "CG_stubborn_stop", topic, 10)
            assert [m.body for m in rest] == BODIES     # m0 again, then the rest
    finally:
        old.release.set()
        if stopping is not None:
            await asyncio.wait_for(stopping, 10)


async def test_an_orderly_hand_over_gives_up_a_listener_that_ignores_its_cancel(broker_factory, caplog):
    broker = broker_factory()
    topic = await _one_queue_topic(broker, "StubbornHandover")
    options = dict(orderly=True, lock_retry_s=0.1)
    old = _Stubborn(broker.namesrv, "CG_stubborn_handover", topic, handover_grace_s=0.3, abandon_after_s=0.5,
                    **options)
    new = _New(broker.namesrv, "CG_stubborn_handover", topic, 10, **options)
    try:
        async with asyncio.timeout(30):
            await old.consumer.start()
            await old.entered.wait()
            await new.consumer.start()          # joins: the old consumer gives the queue up
            await new.enough.wait()             # the hand-over ended: committed nothing past m0, unlocked
            assert new.got == BODIES            # m0 again, then the rest, in order
            assert old.swallowed == [b"m0"] and old.finished == []
            assert set(old.commits) <= {0}
            assert any(r.levelno >= logging.ERROR and "abandon_after_s" in r.getMessage()
                       and "orderly: the queue's lock is released" in r.getMessage() for r in caplog.records)
            await _given_up_call_ends(old.consumer, old)
            assert old.finished == [b"m0"] and set(old.commits) <= {0}
            assert not old.consumer._consuming
            # The old consumer shuts down at once: nothing of the given-up call is waited for again.
            await asyncio.wait_for(old.consumer.shutdown(), 5)
            assert set(old.commits) <= {0}
    finally:
        old.release.set()
        await new.consumer.shutdown()
        if not old.consumer.shutting_down:
            await old.consumer.shutdown()
