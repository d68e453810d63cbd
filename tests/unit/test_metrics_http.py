"""The /metrics exposition rendered on the event loop (broker/metrics_http.py): the same bytes as prometheus-client's
encoders, in slices the loop's other work runs between."""
import asyncio

import pytest
from prometheus_client.exposition import choose_encoder

from broker.metrics import _PART as PART, BrokerMetrics
from broker.metrics_http import CHUNK, render
from tests.support.bounded import bounded

# Prometheus 2.x's Accept header (OpenMetrics first), the plain default, and the text format with UTF-8 names.
ACCEPTS = [None, "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
           "text/plain;version=0.0.4;q=0.5,*/*;q=0.1", "text/plain;version=1.0.0;escaping=allow-utf-8"]


def _busy_metrics(topics=3 * CHUNK + 7, groups=2 * CHUNK + 1):
    m = BrokerMetrics()
    for i in range(topics):
        m.count_in(f"T{i}", i, 10 * i)
    for i in range(groups):
        m.count_out(f"T{i}", f"G{i}", 1, 10)
    lag = [((f"G{i}", f"T{i}"), i) for i in range(groups)]
    m.add_gauge_collector("rocketmq_consumer_lag_messages", "Lag.", ["consumer_group", "topic"], lambda: lag)
    m.add_gauge_collector("txmq_odd", 'Escapes: \\ "quoted"\nnew line.', ["l"],
                          lambda: [(('a"b\\c\nd',), 1.5), (("é🙂",), float("inf")), (("nan",), float("nan"))])
    for code in range(CHUNK // 16 + 2):            # a histogram family of more than CHUNK series
        m.rpc_latency.labels(f"R{code}", "0").observe(0.003 * code)
    m.flush_latency.observe(0.2)
    m.refused.labels("acl").inc(3)
    m.add_folded_collector()
    return m


@pytest.mark.parametrize("accept", ACCEPTS)
@bounded(60)
async def test_the_loop_rendering_is_prometheus_clients_bytes_for_every_format(accept):
    m = _busy_metrics()
    encode, _type = choose_encoder(accept)
    encode(m.registry)          # (txmq_metric_series_folded reads what the collectors before it counted last time)
    assert await render(encode, m.registry, slice_s=0) == encode(m.registry)
    restricted = m.registry.restricted_registry(["rocketmq_messages_in_total", "txmq_odd", "rocketmq_rpc_latency_count",
                                                 "rocketmq_consumer_lag_messages", "txmq_metric_series_folded"])
    assert await render(encode, restricted, slice_s=0) == encode(restricted)


async def _render_counting_ticks(registry, seen=None):
    """Render ``registry`` (slices of no time) while another task counts its turns; returns the turns."""
    encode, _type = choose_encoder(None)
    ticks = 0
    stop = asyncio.Event()

    async def other_client():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)
    other = asyncio.ensure_future(other_client())
    await asyncio.sleep(0)
    try:
        text = await render(encode, registry, slice_s=0)
    finally:
        stop.set()
        await other
    return ticks, text


@bounded(60)
async def test_a_large_scrape_lets_the_loop_run_between_its_slices():
    """Formatted in one go on prometheus-client's thread, 6,000 topics held the loop 16-26 ms a heartbeat."""
    m = _busy_metrics(topics=20 * CHUNK)
    ticks, _text = await _render_counting_ticks(m.registry)
    assert ticks > 2 * 20, ticks        # (the two families of 20 chunks each, and every other family, at least)


@pytest.mark.parametrize("restricted", [False, True])
@bounded(60)
async def test_a_collector_of_many_series_is_collected_with_the_loop_running_between_its_parts(restricted):
    """Collected whole on the loop, 6,000 topics' or 10,000 groups' series held it 30-230 ms a family. A scrape
    with name[] (a RestrictedRegistry) was collected whole, with no part."""
    m = BrokerMetrics()
    rows = [((f"G{i}",), i) for i in range(4 * PART)]
    m.add_gauge_collector("txmq_many", "Many.", ["group"], lambda: rows)
    [collector] = [c for c, names in m.registry._collector_to_names.items() if "txmq_many" in names]
    whole_parts, turns = collector.collect_parts, {"n": 0}
    parts = []                  # the other task's turns when each part was made

    def recorded():
        for part in whole_parts():
            parts.append(turns["n"])
            yield part
    collector.collect_parts = recorded

    async def count():
        while True:
            turns["n"] += 1
            await asyncio.sleep(0)
    counting = asyncio.ensure_future(count())
    try:
        _ticks, text = await _render_counting_ticks(m.registry.restricted_registry(["txmq_many"]) if restricted
                                                    else m.registry)
    finally:
        counting.cancel()
    assert len(parts) == 4 and parts == sorted(set(parts)), parts     # the loop ran between each two parts
    assert text.count(b"txmq_many{") == 4 * PART and text.count(b"# TYPE txmq_many ") == 1
    assert [f.name for f in m.registry.collect()].count("txmq_many") == 1      # collect() gives it whole


async def _refused_503(url, caplog, says=b"not rendered"):
    """A GET of ``url`` answered 503 with ``says`` in its body, and the 503 logged."""
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(urllib.request.urlopen, url, timeout=10)
    assert refused.value.code == 503 and says in refused.value.read()
    assert "answered 503" in caplog.text


@bounded(60)
async def test_a_scrape_with_no_loop_to_render_it_is_a_503_and_one_with_a_loop_the_page(caplog):
    import urllib.request
    from broker.metrics_http import start_metrics_server
    m = _busy_metrics(topics=3, groups=2)
    loop = None
    httpd = start_metrics_server(0, "127.0.0.1", m.registry, lambda: loop)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    try:
        await _refused_503(url, caplog)
        loop = asyncio.get_running_loop()
        page = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
        assert b'rocketmq_messages_in_total{topic="T2"} 2.0' in page
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_delivery_counters_of_many_groups_come_in_parts_of_the_same_series():
    """rocketmq_messages_out and its kind have a series a (topic, group): up to 10,000, collected whole before."""
    m = _busy_metrics(topics=1, groups=2 * PART + 1)
    for counter in (m.messages_out, m.bytes_out, m.pulls_moved_past):
        parts = list(counter.collect_parts())
        [whole] = counter.collect()
        assert [len(p.samples) for p in parts] == ([PART, PART, 1] if counter is not m.pulls_moved_past else [0])
        assert [s for p in parts for s in p.samples] == whole.samples


class _CancelledMidScrape:
    """A collector during whose collection the render's task is cancelled, as asyncio.run's (uvloop.run's) teardown
    cancels every task left when the broker has stopped with a scrape under way."""

    def collect(self):
        asyncio.current_task().cancel()
        return []

    collect_parts = collect


@bounded(60)
async def test_a_scrape_whose_rendering_is_cancelled_by_a_stopping_broker_is_a_503_not_a_500(caplog, capfd):
    """Its concurrent future raised concurrent.futures.CancelledError, which the 503 path did not catch: wsgiref
    answered 500 and wrote the traceback to the broker's stderr."""
    from prometheus_client import CollectorRegistry
    from broker.metrics_http import start_metrics_server
    registry = CollectorRegistry()
    registry.register(_CancelledMidScrape())
    loop = asyncio.get_running_loop()
    httpd = start_metrics_server(0, "127.0.0.1", registry, lambda: loop)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    try:
        await _refused_503(url, caplog)
        assert "Traceback" not in capfd.readouterr().err
    finally:
        httpd.shutdown()
        httpd.server_close()


def _idle_connections(port, n):
    import socket
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


@bounded(60)
async def test_a_client_that_connects_and_never_sends_is_dropped_after_the_read_timeout(monkeypatch, capfd):
    """Each connection has a thread of its own: one that never sends held it for ever (a port scanner, a
    half-open scraper), and enough of them a thread each without end."""
    import broker.metrics_http as mh
    monkeypatch.setattr(mh, "READ_TIMEOUT_S", 0.5, raising=False)
    loop = asyncio.get_running_loop()
    httpd = mh.start_metrics_server(0, "127.0.0.1", _busy_metrics(topics=3, groups=2).registry, lambda: loop)
    try:
        (idle,) = _idle_connections(httpd.server_address[1], 1)
        with idle:
            assert await asyncio.to_thread(idle.recv, 1) == b""      # closed by the broker (10 s: socket.timeout)
        assert "Traceback" not in capfd.readouterr().err
    finally:
        httpd.shutdown()
        httpd.server_close()


@bounded(60)
async def test_connections_past_the_cap_are_answered_503_at_once_not_given_a_thread(monkeypatch, caplog):
    """A loop blocked for 30 s held a thread a scrape for 30 s, and nothing bounded how many. (Every thread here
    holds a whole request, its page waiting for a loop that does not run: none is closed for a newcomer.)"""
    import threading
    import urllib.error
    import urllib.request
    import broker.metrics_http as mh
    monkeypatch.setattr(mh, "READ_TIMEOUT_S", 30.0)
    monkeypatch.setattr(mh, "RENDER_TIMEOUT_S", 5.0)    # the stalled pages end (503) within the retries below
    loop = asyncio.get_running_loop()
    stalled = asyncio.new_event_loop()      # never run: a page asked of it waits its RENDER_TIMEOUT_S
    held_loop = [stalled]
    httpd = mh.start_metrics_server(0, "127.0.0.1", _busy_metrics(topics=3, groups=2).registry,
                                    lambda: held_loop[0])
    port = httpd.server_address[1]
    url = f"http://127.0.0.1:{port}/metrics"
    before = sum("process_request_thread" in t.name for t in threading.enumerate())
    held = _idle_connections(port, mh.MAX_CONNECTIONS)
    for s in held:
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    await _until(lambda: not httpd.waiting)         # every request read: each thread waits for its page
    held += _idle_connections(port, 5)
    try:
        await _refused_503(url, caplog, b"too many connections")
        serving = [t for t in threading.enumerate() if "process_request_thread" in t.name]
        assert len(serving) - before <= mh.MAX_CONNECTIONS
        for _ in range(5):      # a flood of connections past the cap: one line a minute a host, not one each
            await _refused_503(url, caplog, b"too many connections")
        assert caplog.text.count("served already") == 1, caplog.text
        for s in held:
            s.close()
        held_loop[0] = loop         # the stalled pages end at RENDER_TIMEOUT_S, and their threads
        for _ in range(200):        # their threads see the close and end; a scrape has a thread again
            try:
                page = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
                break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503
                await asyncio.sleep(0.05)
        assert b'rocketmq_messages_in_total{topic="T2"} 2.0' in page
    finally:
        for s in held:
            s.close()
        httpd.shutdown()
        httpd.server_close()
        # (its loop run a moment: the pages' renderings, cancelled, end there, not left unawaited at its close)
        await asyncio.to_thread(stalled.run_until_complete, asyncio.sleep(0.01))
        stalled.close()


def _serving() -> int:
    import threading
    return sum("process_request_thread" in t.name for t in threading.enumerate())


async def _until(done, tries: int = 400) -> None:
    for _ in range(tries):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never came about")


@bounded(60)
async def test_a_connection_closed_for_a_scrape_is_not_served_the_request_line_it_had_begun(monkeypatch):
    """A connection closed to make room for a scrape, that had sent part of its request line ("GET /metrics", no
    line end), read that part at the close as a whole HTTP/0.9 request and was served a page: a render for a dead
    socket, its thread (the one the scrape waited for, ROOM_WAIT_S) held until it was done, a 503 for the scrape
    past that. It ends at once now, nothing rendered; the scrape's is the one page."""
    import urllib.request
    import broker.metrics_http as mh
    monkeypatch.setattr(mh, "READ_TIMEOUT_S", 30.0)
    monkeypatch.setattr(mh, "IDLE_BEFORE_CLOSE_S", 0.0)
    loop = asyncio.get_running_loop()
    pages = []
    httpd = mh.start_metrics_server(0, "127.0.0.1", _busy_metrics(topics=3, groups=2).registry, lambda: loop,
                                    before=lambda: pages.append(1))
    port = httpd.server_address[1]
    before = _serving()
    held = _idle_connections(port, mh.MAX_CONNECTIONS)
    for s in held:
        s.sendall(b"GET /metrics")
    await _until(lambda: _serving() - before == mh.MAX_CONNECTIONS)
    try:
        page = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read())
        assert b'rocketmq_messages_in_total{topic="T2"} 2.0' in page
        assert await asyncio.to_thread(held[0].recv, 1) == b""
        await _until(lambda: _serving() - before == mh.MAX_CONNECTIONS - 1)    # its thread ended
        assert len(pages) == 1, pages
    finally:
        for s in held:
            s.close()
        httpd.shutdown()
        httpd.server_close()


@bounded(60)
async def test_idle_connections_holding_every_thread_make_room_for_a_scrape(monkeypatch, caplog):
    """MAX_CONNECTIONS connections that connect and send nothing (a port scanner, a health check that waits, a
    hostile client reconnecting every READ_TIMEOUT_S) held every thread, and each scrape meanwhile was answered
    503. A new connection past the cap closes the one waiting longest for its request (if it has waited
    IDLE_BEFORE_CLOSE_S): scrapes are served, the idle ones closed oldest first, said once."""
    import select
    import urllib.request
    import broker.metrics_http as mh
    monkeypatch.setattr(mh, "READ_TIMEOUT_S", 30.0)
    loop = asyncio.get_running_loop()
    httpd = mh.start_metrics_server(0, "127.0.0.1", _busy_metrics(topics=3, groups=2).registry, lambda: loop)
    port = httpd.server_address[1]
    url = f"http://127.0.0.1:{port}/metrics"
    before = _serving()
    held = _idle_connections(port, mh.MAX_CONNECTIONS)
    await _until(lambda: _serving() - before == mh.MAX_CONNECTIONS)     # a thread each, every one taken
    try:
        # One connected a moment ago is not closed for a newcomer: a flood of connections must not close a
        # scraper's before its request is read.
        monkeypatch.setattr(mh, "IDLE_BEFORE_CLOSE_S", 30.0)
        await _refused_503(url, caplog, b"too many connections")
        monkeypatch.setattr(mh, "IDLE_BEFORE_CLOSE_S", 0.0)
        with caplog.at_level("WARNING", logger="txmq.metrics"):
            for _ in range(3):
                page = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
                assert b'rocketmq_messages_in_total{topic="T2"} 2.0' in page
        held[0].settimeout(10)      # the one connected first was closed for the first
        assert await asyncio.to_thread(held[0].recv, 1) == b""
        ended, _, _ = select.select(held, [], [], 0)
        closed = [held.index(s) for s in ended]     # oldest first, one for a scrape that found no thread free
        assert closed == list(range(len(closed))) and 1 <= len(closed) <= 3, closed
        assert caplog.text.count("sent no request while all") == 1, caplog.text
    finally:
        for s in held:
            s.close()
        httpd.shutdown()
        httpd.server_close()


@bounded(60)
async def test_a_request_trickled_a_byte_at_a_time_is_dropped_at_the_read_timeout_not_kept(monkeypatch, caplog):
    """The read timeout bounded each recv, not the request: a client sending its request line a byte every half
    timeout held its thread for as long as it liked, and MAX_CONNECTIONS such clients (one host, one process)
    had every scrape answered 503 for good."""
    import socket
    import broker.metrics_http as mh
    monkeypatch.setattr(mh, "READ_TIMEOUT_S", 0.5)
    loop = asyncio.get_running_loop()
    httpd = mh.start_metrics_server(0, "127.0.0.1", _busy_metrics(topics=3, groups=2).registry, lambda: loop)
    request = b"GET /metrics?" + b"a" * 200

    def trickle():
        with socket.create_connection(("127.0.0.1", httpd.server_address[1]), timeout=10) as s:
            for sent in range(len(request)):      # 0.1 s a byte, a fifth of the timeout: 20 s for all of them
                try:
                    s.sendall(request[sent:sent + 1])
                    s.settimeout(0.1)
                    if s.recv(1) == b"":
                        return sent             # closed by the server
                except TimeoutError:
                    continue
                except OSError:
                    return sent
            return None
    try:
        with caplog.at_level("WARNING", logger="txmq.metrics"):
            sent = await asyncio.to_thread(trickle)
        assert sent is not None, "the trickled request was kept to its end"
        assert sent < 30, sent             # the timeout (5 bytes' worth), with room for a busy machine
        assert "not sent whole within" in caplog.text
    finally:
        httpd.shutdown()
        httpd.server_close()
