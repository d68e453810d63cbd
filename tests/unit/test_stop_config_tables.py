"""The stop's config tables (topics, subscription groups, KV config, consumer offsets) are closed at once: each
its own file and its own bounded write. One after the other, a config directory that hung (a stopped NFS) made
the stop wait the sum of their bounds (bench/bench_hung_config_stop.py), against systemd's and compose's 60 s."""
from __future__ import annotations

import asyncio

import pytest

from broker.config import BrokerConfig
from broker.server import BrokerServer
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


@bounded(30)
async def test_the_config_tables_are_closed_at_once_not_one_after_the_other(tmp_path):
    server = BrokerServer(BrokerConfig(store_dir=str(tmp_path), port=0, namesrv_port=0, metrics_port=-1))
    await server.start()
    ctx = server.ctx
    tables = {"topics": ctx.topics, "groups": ctx.subscriptions, "kv": ctx.kv, "offsets": ctx.offsets}
    started: set[str] = set()
    all_started = asyncio.Event()
    met: dict[str, bool] = {}

    def closing(name, close):
        async def close_when_all_have_started():
            started.add(name)
            if len(started) == len(tables):
                all_started.set()
            try:        # (a close that waits for one not yet begun: the others never begin)
                await asyncio.wait_for(all_started.wait(), 5)
                met[name] = True
            except TimeoutError:
                met[name] = False
            await close()
        return close_when_all_have_started

    for name, table in tables.items():
        table.close = closing(name, table.close)
    await server.stop()
    assert met == {name: True for name in tables}, (met, started)
