"""Our clients' shutdown against the real broker: unlocking asks every broker even when one is down."""
from __future__ import annotations

import asyncio

import pytest

from consumer import PullConsumer
from protocol.errors import BrokerError
from tests.support.broker_process import BrokerProcess
from tests.support.cluster_process import NamesrvProcess, cluster_flags, create_topic, wait_for_route

pytestmark = pytest.mark.asyncio


async def test_unlock_asks_every_broker_when_one_is_down(tmp_path):
    namesrv = NamesrvProcess(tmp_path / "namesrv.log").start()
    brokers = {name: BrokerProcess(tmp_path / name, *cluster_flags(namesrv.addr, name, 1000)).start()
               for name in ("broker-a", "broker-b")}
    holder = PullConsumer(namesrv.addr, "CG_unlock")
    rival = PullConsumer(namesrv.addr, "CG_unlock")
    try:
        async with asyncio.timeout(30):
            for b in brokers.values():
                await create_topic(b.broker, "Locked", 1)
            await wait_for_route(namesrv.addr, "Locked", set(brokers))
            queues = {q.broker_name: q for q in await holder.fetch_queues("Locked")}
            assert await holder.lock_queues(queues.values()) == set(queues.values())
            brokers["broker-b"].kill()
            with pytest.raises(BrokerError):      # broker-b's failure is reported...
                await holder.unlock_queues([queues["broker-b"], queues["broker-a"]])
            # ...and broker-a, asked after it, released its queue all the same
            assert await rival.lock_queues([queues["broker-a"]]) == {queues["broker-a"]}
    finally:
        await holder.shutdown()
        await rival.shutdown()
        for p in [*brokers.values(), namesrv]:
            p.kill()
