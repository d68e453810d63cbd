"""A producer that left its group (UNREGISTER_CLIENT) is not asked about the group's halves: neither on the
connection it left on, nor after it reconnects with the same client id without joining the group again (the
sender found by its client id is one registered in the group)."""
from __future__ import annotations

import pytest

from tests.support.bounded import bounded
from tests.unit.test_check_pacing import Producer, storm


@pytest.mark.asyncio
@bounded(60)
async def test_a_sender_that_left_and_reconnected_without_joining_again_is_not_asked(tmp_path):
    ctx, clock, txs = await storm(tmp_path, 3)
    tx = ctx.tx
    first = Producer("127.0.0.1:1")
    for t in txs:
        t.owner = first
    ctx.clients.add_producer("PG", first, "127.0.0.1:1")
    other = Producer("P-other")
    ctx.clients.add_producer("PG", other, "P-other")
    ctx.clients.unregister(first, "PG", None)        # its producer shut down; the process stays connected
    first.is_open = False
    ctx.clients.connection_closed(first)
    back = Producer("127.0.0.1:1")                   # same process, new connection, other producer groups only
    ctx.clients.add_producer("PG_other", back, "127.0.0.1:1")
    try:
        await tx.run_due(clock.now)
        assert back.checks == [] and first.checks == [] and len(other.checks) == 3
        clock.now = max(t.next_check for t in txs) + 1
        await tx.run_due(clock.now)                  # after unanswered checks too
        assert back.checks == [] and first.checks == []
    finally:
        await ctx.store._store.close()


@pytest.mark.asyncio
@bounded(60)
async def test_a_sender_that_left_on_an_open_connection_is_not_asked_when_alone(tmp_path):
    ctx, clock, txs = await storm(tmp_path, 2)
    tx = ctx.tx
    first = Producer("127.0.0.1:1")
    for t in txs:
        t.owner = first
    ctx.clients.add_producer("PG", first, "127.0.0.1:1")
    ctx.clients.unregister(first, "PG", None)
    try:
        await tx.run_due(clock.now)
        assert first.checks == [] and all(not t.checks for t in txs)
    finally:
        await ctx.store._store.close()


@pytest.mark.asyncio
@bounded(60)
async def test_a_producer_that_leaves_while_its_check_record_is_written_is_not_sent_it(tmp_path):
    """UNREGISTER_CLIENT arriving while a check's record is being written (the check chosen for that connection,
    not sent yet): producer_left only gave the slot back, then the check went out on the open connection to a
    producer that had left (the Java client drops it) and waited a whole interval, as before the unregistration
    was taken as losing the group's checks. A closed connection's send fails and is asked again at once; so now."""
    ctx, clock, (t,) = await storm(tmp_path, 1)
    tx = ctx.tx
    leaver, other = Producer("127.0.0.1:1"), Producer("P-other")
    t.owner = leaver
    ctx.clients.add_producer("PG", leaver, "127.0.0.1:1")
    put_many = ctx.store.put_many

    async def unregistered_meanwhile(*args, **kwargs):
        ctx.store.put_many = put_many
        ctx.clients.unregister(leaver, "PG", None)          # as processors/client.py's UNREGISTER_CLIENT
        assert ctx.clients.left_group(leaver, "PG")
        tx.producer_left(leaver, "PG")
        ctx.clients.add_producer("PG", other, "P-other")
        return await put_many(*args, **kwargs)
    ctx.store.put_many = unregistered_meanwhile
    try:
        await tx.run_due(clock.now)
        if not other.checks:
            await tx.run_due(clock.now)                      # (the same pass, or the next at the same time)
        assert leaver.checks == [] and len(other.checks) == 1, (len(leaver.checks), t.next_check - clock.now)
        assert t.checks == 2 and ctx.metrics.checks_lost.labels("PG")._value.get() == 1
    finally:
        await ctx.store._store.close()
