"""TransactionProducer against a stand-in broker that, like Apache RocketMQ for oneway-minded ENDs,
never answers END_TRANSACTION: the producer notices once and sends END oneway from then on."""
from __future__ import annotations

import asyncio

import pytest

from producer import LocalTransactionState as S
from producer import TransactionProducer
from protocol.codes import RequestCode, ResponseCode
from protocol.connection import RemotingConnection
from protocol.errors import ConnectionClosedError, RequestTimeoutError
from protocol.message import offset_msg_id, pack_host
from protocol.route import BrokerData, QueueData, TopicRouteData, encode_route

pytestmark = pytest.mark.asyncio


class SilentEndBroker:
    def __init__(self):
        self.ends = []
        self.sends = 0
        self.got_end = asyncio.Event()
        self.addr = ""
        self.answer_end = False
        self.refuse_end: list[int] = []         # codes the next END requests are answered with

    def handle(self, conn, cmd):
        if cmd.code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
            route = TopicRouteData([QueueData("b", 1, 1, 6)], [BrokerData("c", "b", {0: self.addr})])
            return cmd.response(ResponseCode.SUCCESS, body=encode_route(route, strict=True))
        if cmd.code in (RequestCode.HEART_BEAT, RequestCode.UNREGISTER_CLIENT):
            return cmd.response(ResponseCode.SUCCESS)
        if cmd.code == RequestCode.SEND_MESSAGE_V2:
            self.sends += 1
            return cmd.response(ResponseCode.SUCCESS, None, {
                "msgId": offset_msg_id(pack_host("127.0.0.1", 1), 999 + self.sends), "queueId": 0,
                "queueOffset": self.sends - 1, "MSG_REGION": "r", "TRACE_ON": "true"})
        if cmd.code == RequestCode.END_TRANSACTION:
            self.ends.append(cmd)
            self.got_end.set()
            if self.refuse_end and not cmd.is_oneway:
                return cmd.response(self.refuse_end.pop(0), "refused for now")
            return cmd.response(ResponseCode.SUCCESS) if self.answer_end and not cmd.is_oneway else None
        return cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED)


class Commit:
    def execute_local_transaction(self, msg, arg):
        return S.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        return S.COMMIT_MESSAGE


async def test_falls_back_to_oneway_when_end_is_never_acknowledged():
    fake = SilentEndBroker()
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    producer = TransactionProducer(fake.addr, "PG", Commit(), end_timeout=0.3)
    async with asyncio.timeout(10):
        await producer.start()
        first = await producer.send_in_transaction("T", b"one")
        second = await producer.send_in_transaction("T", b"two")
        while len(fake.ends) < 3:
            fake.got_end.clear()
            await fake.got_end.wait()
        await producer.shutdown()
    server.close()
    assert producer.end_acknowledged is False
    assert not first.acknowledged and not second.acknowledged
    # the first END went as a request (timed out), then oneway for it and for every later one
    assert [e.is_oneway for e in fake.ends] == [False, True, True]
    assert {e.ext_fields["commitOrRollback"] for e in fake.ends} == {"8"}
    assert [e.int_field("commitLogOffset") for e in fake.ends] == [1000, 1000, 1001]


async def test_oneway_ends_are_reprobed_and_acknowledgement_comes_back():
    """One END timeout is not forever: after end_probe_interval_s (a driven clock) an END goes as a
    request again, and once the broker answers it, ENDs are acknowledged requests again."""
    fake = SilentEndBroker()
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    now = [1000.0]
    producer = TransactionProducer(fake.addr, "PG", Commit(), end_timeout=0.3, end_probe_interval_s=60,
                                   clock=lambda: now[0])
    results = []
    async with asyncio.timeout(10):
        await producer.start()
        results.append(await producer.send_in_transaction("T", b"times out"))    # request, then oneway
        now[0] += 30
        results.append(await producer.send_in_transaction("T", b"oneway"))
        fake.answer_end = True
        now[0] += 29
        results.append(await producer.send_in_transaction("T", b"still oneway: 59 s after the timeout"))
        now[0] += 1
        results.append(await producer.send_in_transaction("T", b"probe, answered"))
        results.append(await producer.send_in_transaction("T", b"acknowledged"))
        while len(fake.ends) < 6:
            fake.got_end.clear()
            await fake.got_end.wait()
        await producer.shutdown()
    server.close()
    assert [e.is_oneway for e in fake.ends] == [False, True, True, True, False, False]
    assert [r.acknowledged for r in results] == [False, False, False, True, True]
    assert producer.end_acknowledged is True


async def test_end_goes_to_the_broker_that_stored_the_half_even_when_the_route_moves():
    """A route refreshed between the half and END (the broker name now at another address) must not
    send END elsewhere: only the broker that stored the half can decide it."""
    first, second = SilentEndBroker(), SilentEndBroker()
    first.answer_end = second.answer_end = True
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(lambda f=f: RemotingConnection(f.handle), "127.0.0.1", 0)
               for f in (first, second)]
    for fake, server in zip((first, second), servers):
        fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    class MovesTheRoute:
        def execute_local_transaction(self, msg, arg):
            producer.routes._addrs["b"] = second.addr       # what a route refresh would do
            return S.COMMIT_MESSAGE

        def check_local_transaction(self, msg):
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(first.addr, "PG", MovesTheRoute(), end_timeout=2)
    async with asyncio.timeout(10):
        await producer.start()
        result = await producer.send_in_transaction("T", b"one")
        await producer.shutdown()
    for server in servers:
        server.close()
    assert result.acknowledged and result.send_result.broker_addr == first.addr
    assert len(first.ends) == 1 and second.ends == [] and second.sends == 0


async def test_a_connect_timeout_before_end_is_retried_not_taken_for_a_broker_that_never_answers_end():
    """The connection drops between the half and END, and connecting again times out once (a SYN lost, a
    full accept backlog). That is not the broker leaving END unanswered: END is retried as a request and
    acknowledged. Taken for one, END went oneway unacknowledged, and so did every END of the producer, to
    every broker, for end_probe_interval_s."""
    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    class DropsTheConnection:
        def execute_local_transaction(self, msg, arg):
            for conn in producer.pool.connections():
                conn.abort()
            get = producer.pool.get

            async def times_out_once(addr):
                producer.pool.get = get
                raise RequestTimeoutError(f"connecting to {addr} timed out after 3 s")
            producer.pool.get = times_out_once
            return S.COMMIT_MESSAGE

        def check_local_transaction(self, msg):
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(fake.addr, "PG", DropsTheConnection(), end_timeout=2)
    async with asyncio.timeout(10):
        await producer.start()
        result = await producer.send_in_transaction("T", b"one")
        await producer.shutdown()
    server.close()
    assert result.acknowledged and producer.end_acknowledged is True
    assert [e.is_oneway for e in fake.ends] == [False]



async def test_producers_whose_ends_failed_together_retry_them_apart(monkeypatch):
    """Producers whose ENDs all failed at one instant (their broker restarted) backed off alike, 0.05 s doubling,
    and retried in the same ticks, every attempt: their ENDs arrived at the broker coming back as one burst each
    round. Each pause is spread over its second half now (``jittered``, as the heartbeats' are); never longer."""
    from protocol import connection as connection_module
    retries, loops = 3, 6

    class Spread:
        """Each round's draws the same whatever order the producers wake in (a seeded Random's were dealt out
        by wake order, which a loaded machine shuffles: the spans came out too close now and then)."""
        drawn = 0

        def uniform(self, a, b):
            Spread.drawn += 1
            return a + (b - a) * (Spread.drawn % loops) / loops
    monkeypatch.setattr(connection_module, "random", Spread())
    attempts: list[list[float]] = [[] for _ in range(loops)]

    async def ends_failing(i):
        producer = TransactionProducer("127.0.0.1:1", f"PG_apart{i}", Commit(), end_retries=retries)

        async def broker_down(addr):
            attempts[i].append(asyncio.get_running_loop().time())
            raise ConnectionClosedError(f"{addr} is restarting")
        producer.pool.get = broker_down
        try:
            return await producer._end("127.0.0.1:1", 0, 0, "AB", S.COMMIT_MESSAGE, False, None)
        finally:
            await producer.pool.close()
    async with asyncio.timeout(10):
        acked = await asyncio.gather(*(ends_failing(i) for i in range(loops)))
    assert acked == [False] * loops and all(len(a) == retries + 1 for a in attempts), attempts
    spans = [a[-1] - a[0] for a in attempts]
    back_off = 0.05 + 0.1 + 0.2
    assert all(back_off - 0.2 / 2 - 0.005 <= span < back_off + 2 for span in spans), spans   # never later
    assert max(spans) - min(spans) > 0.04, spans    # the last waits drawn 0.1 * 5/6 apart; alike, within 2 ms

@pytest.mark.parametrize("code", [ResponseCode.SERVICE_NOT_AVAILABLE, ResponseCode.SYSTEM_BUSY])
async def test_an_end_refused_for_now_is_retried_and_never_reported_as_a_failed_send(code):
    """The broker refuses END for a moment (disk over its watermark: SERVICE_NOT_AVAILABLE; its writer
    queue full: SYSTEM_BUSY); the transaction stays pending there. END is retried like a lost one, and
    when the refusals outlast the retries send_in_transaction still returns, unacknowledged (the check-back
    settles it). It raised the refusal instead: the caller saw a failed send for a half that is stored and a
    local transaction that has run -- and retrying the send runs the local transaction again."""
    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    runs = []

    class Counts(Commit):
        def execute_local_transaction(self, msg, arg):
            runs.append(msg)
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(fake.addr, "PG", Counts(), end_timeout=2, end_retries=3)
    async with asyncio.timeout(10):
        await producer.start()
        fake.refuse_end = [code, code]
        first = await producer.send_in_transaction("T", b"refused twice, then acknowledged")
        assert first.acknowledged and len(fake.ends) == 3
        fake.refuse_end = [code] * 4
        second = await producer.send_in_transaction("T", b"refused past the retries")
        assert not second.acknowledged and second.state is S.COMMIT_MESSAGE and len(fake.ends) == 7
        await producer.shutdown()
    server.close()
    assert len(runs) == 2 and producer.end_acknowledged is True


@pytest.mark.parametrize("code", [ResponseCode.SYSTEM_ERROR, ResponseCode.NO_PERMISSION])
async def test_an_end_refused_for_good_is_returned_with_its_refusal_not_raised(code):
    """A broker that refuses END outright (its store could not record the decision: SYSTEM_ERROR; an ACL:
    NO_PERMISSION). send_in_transaction raised the refusal, after the half was stored and the local
    transaction had run: a caller could not tell whether its transaction ran, and retrying ran it again. It
    returns, unacknowledged, with the decision taken and the refusal (``end_error``), as the Java client
    returns and logs; a WARNING says it."""
    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    producer = TransactionProducer(fake.addr, "PG", Commit(), end_timeout=2, end_retries=3)
    async with asyncio.timeout(10):
        await producer.start()
        fake.refuse_end = [code]
        result = await producer.send_in_transaction("T", b"refused for good")
        await producer.shutdown()
    server.close()
    assert not result.acknowledged and result.state is S.COMMIT_MESSAGE
    assert result.end_error is not None and result.end_error.code == code and len(fake.ends) == 1


async def test_a_oneway_end_that_cannot_be_sent_is_unacknowledged_not_a_failed_send():
    """ENDs go oneway (the broker never answers them: Apache RocketMQ), and the connection drops between the
    half and END with the broker not accepting connections yet. The oneway END is lost as any oneway may be;
    the half is stored and the local transaction has run, so send_in_transaction returns it unacknowledged
    (the check-back settles it), as the Java client does. It raised the connect error instead: a caller
    retrying the send ran its local transaction again."""
    fake = SilentEndBroker()
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    drop = False

    class DropsTheConnection(Commit):
        def execute_local_transaction(self, msg, arg):
            if drop:
                for conn in producer.pool.connections():
                    conn.abort()
                get = producer.pool.get

                async def refused_once(addr):
                    producer.pool.get = get
                    raise ConnectionClosedError(f"cannot connect to {addr}: connection refused")
                producer.pool.get = refused_once
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(fake.addr, "PG", DropsTheConnection(), end_timeout=0.3)
    async with asyncio.timeout(10):
        await producer.start()
        await producer.send_in_transaction("T", b"END times out: oneway from now on")
        assert producer.end_acknowledged is False
        drop = True
        result = await producer.send_in_transaction("T", b"its oneway END cannot be sent")
        await producer.shutdown()
    server.close()
    assert not result.acknowledged and result.state is S.COMMIT_MESSAGE


async def test_shutdown_gives_up_a_check_that_ignores_its_cancel(caplog):
    """shutdown() lets the broker's checks in hand finish for shutdown_grace_s, then cancels them. A
    check_local_transaction that catches that CancelledError and goes on held shutdown for ever. It is given
    up on after abandon_after_s, with an error logged, and shutdown completes: the check is left unanswered
    (the broker asks again), and when it ends at last it sends no END over the closed producer."""
    import logging

    from protocol.command import RemotingCommand
    from protocol.message import encode_record

    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    entered, release, swallowed = asyncio.Event(), asyncio.Event(), []

    class Stubborn(Commit):
        async def check_local_transaction(self, msg):
            entered.set()
            for _ in range(100):
                try:
                    await release.wait()
                    break
                except asyncio.CancelledError:
                    swallowed.append(msg.body)
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(fake.addr, "PG", Stubborn(), end_timeout=2, shutdown_grace_s=0.2,
                                   abandon_after_s=0.3)
    record = encode_record(topic=b"T", body=b"half", queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                           born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                           properties=b"PGROUP\x01PG\x02")
    check = RemotingCommand(RequestCode.CHECK_TRANSACTION_STATE, body=bytes(record),
                            ext_fields={"commitLogOffset": "1000", "tranStateTableOffset": "0", "msgId": "M"})

    class Conn:
        peer = ("127.0.0.1", int(fake.addr.rsplit(":", 1)[1]))
    try:
        async with asyncio.timeout(10):
            await producer.start()
            producer._on_request(Conn(), check)
            await entered.wait()
            began = asyncio.get_running_loop().time()
            stopping = asyncio.get_running_loop().create_task(producer.shutdown())
            done, _ = await asyncio.wait([stopping], timeout=3)
            assert stopping in done, "shutdown waited for a check that ignores its cancel"
            await stopping
            assert 0.4 <= asyncio.get_running_loop().time() - began < 3
            assert swallowed == [b"half"]
            assert any(r.levelno >= logging.ERROR and "abandon_after_s" in r.getMessage() for r in caplog.records)
            tasks = list(producer._check_tasks)
            release.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert fake.ends == [], "the given-up check answered over the producer shut down"
            assert not producer.pool.connections()
    finally:
        release.set()
        server.close()


@pytest.mark.parametrize("msg_id", [None, "", "not-an-offset-id"])
async def test_a_half_stored_with_no_readable_offset_id_is_returned_unacknowledged_not_raised(msg_id, caplog):
    """A broker that stores the half (SEND_OK) but names no offset message id, or one that does not decode: END
    cannot name the half. The HeaderError was raised after the local transaction had run, its outcome sent
    nowhere: a caller could not tell it ran, and retrying ran it again. As the Java client, the result is
    returned unacknowledged, no END sent (the check-back settles it), and a WARNING says why."""
    import logging

    fake = SilentEndBroker()
    fake.answer_end = True
    handle = fake.handle

    def no_offset_id(conn, cmd):
        resp = handle(conn, cmd)
        if cmd.code == RequestCode.SEND_MESSAGE_V2:
            if msg_id is None:
                del resp.ext_fields["msgId"]
            else:
                resp.ext_fields["msgId"] = msg_id
        return resp
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(no_offset_id), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    ran = []

    class Counts(Commit):
        def execute_local_transaction(self, msg, arg):
            ran.append(msg.body)
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(fake.addr, "PG", Counts(), end_timeout=2)
    async with asyncio.timeout(10):
        await producer.start()
        result = await producer.send_in_transaction("T", b"stored, unnamed")
        await producer.shutdown()
    server.close()
    assert ran == [b"stored, unnamed"]
    assert not result.acknowledged and result.state is S.COMMIT_MESSAGE and fake.ends == []
    assert any(r.levelno == logging.WARNING and "END_TRANSACTION" in r.getMessage()
               and result.send_result.msg_id in r.getMessage() for r in caplog.records)


async def test_a_hung_check_is_not_started_again_when_a_stock_broker_asks_about_the_half_put_back_elsewhere(caplog):
    """Apache RocketMQ 4.9.8 writes the half again before each check (putBackHalfMsgQueue): every ask names the
    same msgId (its UNIQ_KEY) at a new commitLogOffset. Keyed by that offset, each ask of a stock broker started
    one more call beside the hung one, as before one call per transaction was kept. The call's END names the copy
    the broker asked about last."""
    import logging

    from protocol.command import RemotingCommand
    from protocol.message import encode_record

    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    calls, entered, release = [], asyncio.Event(), asyncio.Event()

    class Hung(Commit):
        async def check_local_transaction(self, msg):
            calls.append(msg.body)
            entered.set()
            await release.wait()
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(fake.addr, "PG", Hung(), end_timeout=2)
    record = encode_record(topic=b"T", body=b"half", queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                           born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                           properties=b"PGROUP\x01PG\x02UNIQ_KEY\x01M\x02")

    def ask(commit_log_offset, msg_id="M"):
        return RemotingCommand(RequestCode.CHECK_TRANSACTION_STATE, body=bytes(record), ext_fields={
            "commitLogOffset": str(commit_log_offset), "tranStateTableOffset": "0", "msgId": msg_id})

    class Conn:
        peer = ("127.0.0.1", int(fake.addr.rsplit(":", 1)[1]))
    try:
        async with asyncio.timeout(10):
            await producer.start()
            producer._on_request(Conn(), ask(1000))
            await entered.wait()                    # the call is in hand, and hangs
            for offset in (1200, 1400):             # the half put back before each ask
                producer._on_request(Conn(), ask(offset))
            assert len(producer._check_tasks) == 1, "an ask about the half put back started another call"
            assert producer.checks_overlapped == 2
            producer._on_request(Conn(), ask(1000, "N"))    # another half where the first was: its own call
            assert len(producer._check_tasks) == 2 and producer.checks_overlapped == 2
            assert sum("still running" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1
            release.set()
            await asyncio.gather(*list(producer._check_tasks))
            assert len(calls) == 2 and len(fake.ends) == 2
            # M's END names the copy asked about last: the one the broker asks about next (answered for the first
            # copy, the last was asked about again and committed again: the message delivered twice)
            assert sorted(e.int_field("commitLogOffset") for e in fake.ends) == [1000, 1400]     # N's, M's
            assert not producer._checking and not producer._overlap_said
            producer._on_request(Conn(), ask(1600))   # the next ask once the call returned runs it again
            await asyncio.gather(*list(producer._check_tasks))
            assert len(calls) == 3
            await producer.shutdown()
    finally:
        release.set()
        server.close()


async def test_shutdown_lets_a_transaction_begun_before_it_send_its_decision():
    """shutdown() waits for the sends begun before it (pushhb), but a transaction's send was counted only while
    its half was sent: shutdown began during the local transaction closed the connections under it, and its
    END (a COMMIT) went nowhere, retried against a closed pool, the transaction left to a check-back no producer
    of the group may be there to answer. It is answered now, and acknowledged; a transaction begun after is
    refused, nothing sent."""
    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    running, go_on = asyncio.Event(), asyncio.Event()

    class Slow(Commit):
        async def execute_local_transaction(self, msg, arg):
            running.set()
            await go_on.wait()
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(fake.addr, "PG", Slow(), end_timeout=2, end_retries=1)
    async with asyncio.timeout(10):
        await producer.start()
        sending = asyncio.get_running_loop().create_task(producer.send_in_transaction("T", b"one"))
        await running.wait()
        stopping = asyncio.get_running_loop().create_task(producer.shutdown())
        while not producer.shutting_down:
            await asyncio.sleep(0)
        with pytest.raises(ConnectionClosedError):
            await producer.send_in_transaction("T", b"after")

        async def parked():         # shutdown waits for the sends begun before it
            while producer._idle is None:
                await asyncio.sleep(0)
        waiting = asyncio.get_running_loop().create_task(parked())
        # not waited for (the bug): shutdown ends, its connections closed, before the local transaction does
        await asyncio.wait([stopping, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        go_on.set()
        result = await sending
        await stopping
    server.close()
    assert result.acknowledged, "the END of a transaction begun before shutdown went nowhere"
    assert [e.ext_fields["commitOrRollback"] for e in fake.ends] == ["8"]
    assert fake.sends == 1


async def test_jittered_end_retries_still_ride_over_the_outage_the_unspread_ones_did(monkeypatch):
    """The jitter shortened every pause by up to half, so the whole retry budget too: 3 retries, unspread, tried
    END again 0.35 s after the first failure; spread, as early as 0.175 s. A broker back 0.22 s after the ENDs
    failed got every END before (the last at 0.35 s) and none now (the producer gave up, the broker checked
    back). Each attempt is spread over the second half of its unspread wait now, never later than unspread: the
    last one lands at least 0.35 - 0.2 / 2 = 0.25 s on. The draws here are all the shortest."""
    import random

    from protocol import connection as connection_module

    class Shortest(random.Random):
        def uniform(self, a, b):
            return a
    monkeypatch.setattr(connection_module, "random", Shortest())
    producer = TransactionProducer("127.0.0.1:1", "PG_budget", Commit(), end_retries=3)
    first: list[float] = []         # each attempt's time

    async def restarting(addr):
        first.append(asyncio.get_running_loop().time())
        raise ConnectionClosedError(f"{addr} is restarting")
    producer.pool.get = restarting
    try:
        async with asyncio.timeout(10):
            await producer._end("127.0.0.1:1", 0, 0, "AB", S.COMMIT_MESSAGE, False, None)
    finally:
        await producer.pool.close()
    assert len(first) == 4 and first[-1] - first[0] >= 0.22, [t - first[0] for t in first]   # back by then


async def test_a_listener_answer_that_is_no_state_is_said_and_counted_not_silently_unknow(caplog):
    """execute_local_transaction with a forgotten return (None) was UNKNOW without a word: with a check listener
    as careless, every check answered UNKNOW too until the broker dead-lettered the transaction, its local
    transaction done and its message never delivered, nothing in the producer's log. Said (at most every
    STATE_SAID_EVERY_S, naming how many went unsaid) and counted in states_not_understood."""
    import logging

    from producer import transaction

    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    now = [0.0]

    class Forgetful(Commit):
        def execute_local_transaction(self, msg, arg):
            return None if arg != "string" else "COMMIT_MESSAGE"

    producer = TransactionProducer(fake.addr, "PG", Forgetful(), clock=lambda: now[0])
    caplog.set_level(logging.WARNING, "txmq.producer")
    async with asyncio.timeout(10):
        await producer.start()
        results = [await producer.send_in_transaction("T", b"a"), await producer.send_in_transaction("T", b"b")]
        now[0] += getattr(transaction, "STATE_SAID_EVERY_S", 60.0)
        results.append(await producer.send_in_transaction("T", b"c", "string"))
        await producer.shutdown()
    server.close()
    assert [r.state for r in results] == [S.UNKNOW] * 3
    said = [r.getMessage() for r in caplog.records if "not a LocalTransactionState" in r.getMessage()]
    assert len(said) == 2, said
    assert "execute_local_transaction returned None" in said[0] and results[0].send_result.msg_id in said[0]
    assert "returned 'COMMIT_MESSAGE'" in said[1] and "1 more such answer(s)" in said[1]
    assert producer.states_not_understood == 3


def _check_ask(msg_id: str, commit_log_offset: int = 1000):
    """A broker's CHECK_TRANSACTION_STATE about the half ``msg_id`` of group PG."""
    from protocol.command import RemotingCommand
    from protocol.message import encode_record
    record = encode_record(topic=b"T", body=b"half", queue_id=0, flag=0, sys_flag=0, born_timestamp=1,
                           born_host=pack_host("127.0.0.1", 1), store_host=pack_host("127.0.0.1", 2),
                           properties=b"PGROUP\x01PG\x02UNIQ_KEY\x01" + msg_id.encode() + b"\x02")
    return RemotingCommand(RequestCode.CHECK_TRANSACTION_STATE, body=bytes(record), ext_fields={
        "commitLogOffset": str(commit_log_offset), "tranStateTableOffset": "0", "msgId": msg_id})


async def test_a_check_answer_that_is_no_state_is_said_and_counted_too(caplog):
    """The check is where a careless answer costs the message: every ask answered UNKNOW until the broker
    dead-lettered the transaction. check_local_transaction's answer is counted and said as the local
    transaction's is (in one count, one rate limit), and the END sent for it is UNKNOW."""
    import logging

    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    class Forgetful(Commit):
        def check_local_transaction(self, msg):
            return None

    producer = TransactionProducer(fake.addr, "PG", Forgetful(), clock=lambda: 0.0)

    class Conn:
        peer = ("127.0.0.1", int(fake.addr.rsplit(":", 1)[1]))
    caplog.set_level(logging.WARNING, "txmq.producer")
    try:
        async with asyncio.timeout(10):
            await producer.start()
            for msg_id in ("M1", "M2"):
                producer._on_request(Conn(), _check_ask(msg_id))
                await asyncio.gather(*list(producer._check_tasks))
            await producer.shutdown()
    finally:
        server.close()
    assert producer.states_not_understood == 2
    said = [r.getMessage() for r in caplog.records if "not a LocalTransactionState" in r.getMessage()]
    assert len(said) == 1 and "check_local_transaction returned None for M1" in said[0], said
    assert sorted((e.ext_fields.get("msgId"), e.ext_fields.get("commitOrRollback")) for e in fake.ends) == [
        ("M1", "0"), ("M2", "0")]       # UNKNOW (TRANSACTION_NOT_TYPE)


@pytest.mark.parametrize("bad", [0, -1, 2.5, None])
async def test_max_checks_at_once_must_be_a_whole_number_of_1_or_more(bad):
    """0 would take no check ever (every transaction of the producer left to dead-lettering), a float or None
    compared oddly with the count in hand: refused at construction, naming the value."""
    with pytest.raises(ValueError, match=f"max_checks_at_once={bad!r}"):
        TransactionProducer("127.0.0.1:1", "PG", Commit(), max_checks_at_once=bad)


async def test_an_ask_about_a_local_transaction_running_here_is_answered_past_max_checks_at_once():
    """An ask about a transaction whose execute_local_transaction runs in this producer is answered UNKNOW at once,
    the listener not called; yet with max_checks_at_once calls in hand (a listener hung on another transaction) it
    was dropped like any other ask: unanswered, the broker takes the producer for silent and asks another of the
    group, whose listener, no outcome recorded yet, answers ROLLBACK (the local transaction then commits, its END
    refused). It is answered, not refused."""
    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    entered, release, hung = asyncio.Event(), asyncio.Event(), asyncio.Event()

    class Slow(Commit):
        async def execute_local_transaction(self, msg, arg):
            entered.set()
            await release.wait()
            return S.COMMIT_MESSAGE

        async def check_local_transaction(self, msg):
            hung.set()
            await asyncio.Event().wait()        # the database down: the one slot held

    producer = TransactionProducer(fake.addr, "PG", Slow(), max_checks_at_once=1, shutdown_grace_s=0,
                                   abandon_after_s=0.1)

    class Conn:
        peer = ("127.0.0.1", int(fake.addr.rsplit(":", 1)[1]))
    try:
        async with asyncio.timeout(10):
            await producer.start()
            sending = asyncio.get_running_loop().create_task(
                producer.send_in_transaction("T", b"order", properties={"UNIQ_KEY": "L"}))
            await entered.wait()
            producer._on_request(Conn(), _check_ask("H", 900))
            await hung.wait()
            producer._on_request(Conn(), _check_ask("L"))
            assert producer.checks_refused == 0, "the ask about the local transaction running here was dropped"
            while not fake.ends:
                await fake.got_end.wait()
            release.set()
            result = await sending
            await producer.shutdown()
    finally:
        server.close()
    assert producer.checks_refused == 0 and producer.checks_during_local == 1
    assert [(e.ext_fields["msgId"], e.ext_fields["commitOrRollback"], e.ext_fields["fromTransactionCheck"])
            for e in fake.ends] == [("L", "0", "true"), ("L", "8", "false")]     # UNKNOW answered, then COMMIT
    assert result.acknowledged


async def test_shutdown_grace_bounds_only_a_local_transaction_not_an_end_being_retried():
    """shutdown_grace_s bounds the wait for a local transaction that hangs; an END refused for now (SYSTEM_BUSY)
    and being retried is bounded by end_retries already. With shutdown_grace_s=0 (checks cancelled at once), a
    shutdown begun between two END attempts closed the pool under the END: the transaction, committed locally and
    begun before shutdown, was left undecided (acknowledged False), where it was sent and acknowledged before
    the grace bounded the sends. It is waited for."""
    fake = SilentEndBroker()
    fake.answer_end = True
    fake.refuse_end = [ResponseCode.SYSTEM_BUSY]
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    producer = TransactionProducer(fake.addr, "PG", Commit(), shutdown_grace_s=0)
    try:
        async with asyncio.timeout(10):
            await producer.start()
            sending = asyncio.get_running_loop().create_task(producer.send_in_transaction("T", b"one"))
            await fake.got_end.wait()           # the first END refused: the next after a pause
            await producer.shutdown()
            result = await sending
    finally:
        server.close()
    assert result.acknowledged and result.state is S.COMMIT_MESSAGE, "the END was cut off by shutdown"
    assert [e.ext_fields["commitOrRollback"] for e in fake.ends] == ["8", "8"]


async def test_two_local_transactions_under_one_uniq_key_both_count_as_running():
    """A UNIQ_KEY the caller gives (properties) may be given twice (a send retried under its idempotency key while
    the first one's local transaction still runs). The local transactions running were kept by key: the first to
    end forgot the other's, and shutdown, counting none in its local transaction, waited for the one that hung
    with no bound (and a check about it went to the listener). Each is counted until it ends."""
    fake = SilentEndBroker()
    fake.answer_end = True
    server = await asyncio.get_running_loop().create_server(lambda: RemotingConnection(fake.handle), "127.0.0.1", 0)
    fake.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    both, release = asyncio.Event(), asyncio.Event()
    entered = []

    class Twice(Commit):
        async def execute_local_transaction(self, msg, arg):
            entered.append(arg)
            if len(entered) == 2:
                both.set()
            await both.wait()
            if arg == "second":
                await release.wait()        # the database down
            return S.COMMIT_MESSAGE

    producer = TransactionProducer(fake.addr, "PG", Twice(), shutdown_grace_s=0.1)
    try:
        async with asyncio.timeout(10):
            await producer.start()
            first, second = (asyncio.get_running_loop().create_task(producer.send_in_transaction(
                "T", b"order", arg, properties={"UNIQ_KEY": "K"})) for arg in ("first", "second"))
            assert (await first).acknowledged
            assert "K" in producer._local, "the second local transaction, still running, was forgotten"
            # bounded by the grace: the old count waited for the hung one until release
            await asyncio.wait_for(producer.shutdown(), 5)
            assert not second.done()
    finally:
        release.set()
        server.close()
    await asyncio.gather(second, return_exceptions=True)
