"""PullHoldService: a stored message costs O(the pulls it wakes), not O(every pull parked on its queue).

Counted, not timed: every future the service makes counts the calls made on it (done(), ==), and so does
every offset a pull parks at (comparisons): what looking at one parked pull costs, whatever the table is. A queue with 40,000 parked pulls (one address may park
20,000; several may park on one popular queue) stalled the loop for a second a message: each message
visited every waiter, and each woken waiter walked the list to take itself out.
"""
from __future__ import annotations

import asyncio

import pytest

from broker.longpoll import PullHoldService
from broker.store.results import DispatchInfo
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio

N = 4000


class _CountingFuture(asyncio.Future):
    calls = 0

    def done(self):
        _CountingFuture.calls += 1
        return super().done()

    def __eq__(self, other):
        _CountingFuture.calls += 1
        return self is other

    __hash__ = asyncio.Future.__hash__


class _Offset(int):
    """A parked pull's offset that counts its comparisons."""

    def _counted(op):
        def compare(self, other):
            _CountingFuture.calls += 1
            return op(int(self), int(other))
        return compare

    __eq__ = _counted(int.__eq__)
    __ne__ = _counted(int.__ne__)
    __lt__ = _counted(int.__lt__)
    __le__ = _counted(int.__le__)
    __gt__ = _counted(int.__gt__)
    __ge__ = _counted(int.__ge__)
    __hash__ = int.__hash__


@pytest.fixture
async def counted(monkeypatch):
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "create_future", lambda: _CountingFuture(loop=loop))
    _CountingFuture.calls = 0
    return _CountingFuture


def _stored(offset: int, topic: str = "T", queue_id: int = 0) -> DispatchInfo:
    return DispatchInfo(topic, queue_id, offset, 0, 0, 0, 0, 0, 0, False)


async def _park(holds, offsets) -> list[asyncio.Task]:
    tasks = [asyncio.ensure_future(holds.wait("T", 0, _Offset(offset), 60)) for offset in offsets]
    await asyncio.sleep(0)          # one turn: every task runs to its await (parked)
    assert holds.parked == len(tasks)
    return tasks


@bounded(30)
async def test_a_message_before_every_waiters_offset_visits_none_of_them(counted):
    holds = PullHoldService()
    tasks = await _park(holds, [100] * N)
    counted.calls = 0
    for offset in range(50, 100):   # a batch of messages, none at a parked offset
        holds.on_dispatch(_stored(offset))
    assert counted.calls <= 50, f"{counted.calls} calls on parked pulls for 50 messages that wake none"
    holds.on_dispatch(_stored(100))
    assert all(await asyncio.gather(*tasks))
    assert holds.parked == 0


@bounded(30)
async def test_waking_half_a_queues_waiters_costs_what_it_wakes(counted):
    holds = PullHoldService()
    tasks = await _park(holds, [100, 101] * (N // 2))     # consumers at two offsets, interleaved
    woken = tasks[0::2]
    counted.calls = 0
    holds.on_dispatch(_stored(100))
    assert all(await asyncio.gather(*woken))               # each woken pull taken out of the table
    assert counted.calls <= 10 * len(woken), f"{counted.calls} calls to wake {len(woken)} pulls"
    assert holds.parked == N // 2
    holds.on_dispatch(_stored(101))
    assert all(await asyncio.gather(*tasks[1::2]))
    assert holds.parked == 0 and not holds._waiters


@bounded(30)
async def test_pulls_ending_in_any_order_cost_one_step_each(counted):
    holds = PullHoldService()
    tasks = await _park(holds, [7] * N)
    counted.calls = 0
    for task in reversed(tasks):     # their connections closed, newest first
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert counted.calls <= 10 * N, f"{counted.calls} calls to end {N} pulls"
    assert holds.parked == 0 and not holds._waiters
