"""BrokerRegistrar: topic changes register at once, including those made during the first registration."""
from __future__ import annotations

import asyncio
import types

from broker.registration import BrokerRegistrar
from broker.topics import TopicConfig, TopicManager
from protocol.codes import RequestCode, ResponseCode
from protocol.errors import ConnectionClosedError
from tests.support.bounded import bounded


@bounded(20)
async def test_a_topic_made_during_the_first_registration_registers_without_waiting_a_period(tmp_path):
    topics = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=4, cluster="C", broker="B")
    config = types.SimpleNamespace(register_period_ms=600_000, register_timeout_ms=3000, register_compressed=False,
                                   broker_name="B", cluster_name="C", broker_id=0)
    ctx = types.SimpleNamespace(config=config, topics=topics, broker_addr="127.0.0.1:10911",
                                topic_perm=lambda perm: perm)       # BrokerContext's, read-write
    registrar = BrokerRegistrar(ctx, ["127.0.0.1:9876"], ha_server_addr="127.0.0.1:10912")
    bodies, first_sent, go_on, second = [], asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def request(addr, cmd, timeout):
        bodies.append(cmd.body_bytes())
        if len(bodies) == 1:
            first_sent.set()
            await go_on.wait()          # the name server is slow to answer the first one
        else:
            second.set()
        return cmd.response(ResponseCode.SUCCESS)
    registrar.pool.request = request
    first = asyncio.ensure_future(registrar.register_all())
    await first_sent.wait()
    topics.create(TopicConfig("MadeMeanwhile", 4, 4))     # a client's first send, while the broker registers
    go_on.set()
    assert await first == 1
    registrar.start()
    try:
        await asyncio.wait_for(second.wait(), 10)       # the period is 10 minutes
    finally:
        await registrar.stop()
    assert b"MadeMeanwhile" not in bodies[0] and b"MadeMeanwhile" in bodies[1]


@bounded(20)
async def test_a_name_server_that_never_answers_holds_up_no_other(tmp_path):
    """Two name servers, one taking registrations and never answering: a round waited for both, so every
    topic made after the first waited the hung one's register_timeout_ms before the healthy name server
    heard of it (here the hang has no end: it never heard). Nor is the hung one sent a registration a round
    while its last is unanswered: they piled up on it."""
    topics = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=4, cluster="C", broker="B")
    config = types.SimpleNamespace(register_period_ms=600_000, register_timeout_ms=3000, register_compressed=False,
                                   broker_name="B", cluster_name="C", broker_id=0)
    ctx = types.SimpleNamespace(config=config, topics=topics, broker_addr="127.0.0.1:10911")
    registrar = BrokerRegistrar(ctx, ["10.0.0.1:9876", "127.0.0.1:9876"], ha_server_addr="127.0.0.1:10912")
    healthy, hung, heard = [], [], asyncio.Event()

    async def request(addr, cmd, timeout):
        if addr.startswith("10."):
            if cmd.code != RequestCode.REGISTER_BROKER:      # stop()'s UNREGISTER_BROKER
                raise ConnectionClosedError(f"connection to {addr} closed")
            hung.append(cmd)
            await asyncio.Event().wait()        # taken, never answered
        healthy.append(cmd.body_bytes())
        heard.set()
        return cmd.response(ResponseCode.SUCCESS)
    registrar.pool.request = request
    registrar.start()
    try:
        for n in range(3):
            heard.clear()
            topics.create(TopicConfig(f"Made{n}", 4, 4))
            await heard.wait()
            assert f"Made{n}".encode() in healthy[-1]
        assert len(hung) == 1
    finally:
        await registrar.stop()


@bounded(20)
async def test_a_name_server_that_hangs_at_start_holds_up_no_topic_made_meanwhile(tmp_path):
    """The broker's first registration (before its ready line) waited for every name server, a hung one for
    register_timeout_ms, and the loop that registers topic changes only started after it: a topic made
    meanwhile (a client's first send, the broker already listening) reached the healthy name server only
    once the hung one timed out."""
    topics = TopicManager(str(tmp_path), auto_create=True, default_queue_nums=4, cluster="C", broker="B")
    config = types.SimpleNamespace(register_period_ms=600_000, register_timeout_ms=600_000,
                                   register_compressed=False, broker_name="B", cluster_name="C", broker_id=0)
    ctx = types.SimpleNamespace(config=config, topics=topics, broker_addr="127.0.0.1:10911")
    registrar = BrokerRegistrar(ctx, ["10.0.0.1:9876", "127.0.0.1:9876"], ha_server_addr="127.0.0.1:10912")
    healthy, first_heard, heard = [], asyncio.Event(), asyncio.Event()

    async def request(addr, cmd, timeout):
        if addr.startswith("10."):
            if cmd.code != RequestCode.REGISTER_BROKER:
                raise ConnectionClosedError(f"connection to {addr} closed")
            await asyncio.Event().wait()        # taken, never answered (here, within the test)
        healthy.append(cmd.body_bytes())
        (heard if len(healthy) > 1 else first_heard).set()
        return cmd.response(ResponseCode.SUCCESS)
    registrar.pool.request = request
    first = asyncio.ensure_future(registrar.register_first())     # what the broker's start awaits
    try:
        await first_heard.wait()
        topics.create(TopicConfig("MadeMeanwhile", 4, 4))
        await heard.wait()
        assert b"MadeMeanwhile" in healthy[-1] and not first.done()
    finally:
        first.cancel()
        await registrar.stop()
