"""The /metrics endpoint: served on a thread, the page collected and formatted on the event loop a slice at a time.

prometheus-client's own server collects and formats on its HTTP thread. That thread and the event loop then take
turns with the GIL for the whole scrape (0.07-0.33 s at 6,000 topics, a MB of text), and each turn handed to the
loop waits for the operating system to run it: another client's heartbeat waited 16-26 ms (3-5 times its usual
p99) while Prometheus scraped. Here the thread only parses the request and writes the bytes (both release the
GIL); the loop runs the collectors and prometheus-client's own encoders, a family at a time and a family of many
series CHUNK series at a time, and lets other work run whenever SLICE_S has passed. The bytes are the encoders'
own (text 0.0.4 or OpenMetrics, as the Accept header chooses), so nothing a scraper reads changes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import gzip
import io
import logging
import socket
import threading
import time
from urllib.parse import parse_qs
from wsgiref.simple_server import make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import (ThreadingWSGIServer, _get_best_family, _SilentHandler, choose_encoder,
                                          gzip_accepted)

from .limits import EveryKey

CHUNK = 256                 # series of one family formatted in one encoder call
SLICE_S = 0.002             # loop time the rendering takes before letting other work run
RENDER_TIMEOUT_S = 30.0     # a page the loop has not finished in this long (stalled, or far too busy): 503, not a hang
READ_TIMEOUT_S = 10.0       # a connection that has not sent its whole request (or taken the page) in this long is closed
MAX_CONNECTIONS = 16        # connections served at once, a thread each; one more closes the one waiting longest
                            # for its request, or, none waiting, is answered 503 and closed
IDLE_BEFORE_CLOSE_S = 0.25  # how long a connection must have waited for its request to be closed for a new one
ROOM_WAIT_S = 2.0           # how long a new connection waits for the thread of the idle one closed for it
_TOO_MANY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
             b"# metrics not rendered: too many connections to /metrics at once\n")
# (text format only: series rendered in a block of their own after the family's, so never split from it)
_APART = ("_created", "_gsum", "_gcount")
log = logging.getLogger("txmq.metrics")


class _Families:
    """What an encoder reads: a registry's collect()."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


async def render(encode, registry, slice_s: float = SLICE_S) -> bytes:
    """``encode(registry)``, byte for byte, run on the loop with a pause to the loop after each ``slice_s``.
    A collector with ``collect_parts`` gives its families in parts (consecutive families of one name), collected
    with the loop running between them; a family of more than CHUNK series is formatted CHUNK at a time."""
    eof = encode(_Families(()))     # what the format ends with (b"# EOF\n" for OpenMetrics)
    cut = len(eof)
    parts = []
    clock = time.perf_counter
    deadline = clock() + slice_s
    last = header = None            # the family the previous part was of, and its header's length
    for family in _families(registry):
        if (family.name, family.type) != last:
            head = copy.copy(family)
            head.samples = []
            text = encode(_Families((head,)))
            header = len(text) - cut
            parts.append(text[:header])
            last = family.name, family.type
        samples = family.samples
        step = len(samples) if any(s.name.endswith(_APART) for s in samples) else CHUNK
        for i in range(0, len(samples), step):
            chunk = copy.copy(family)
            chunk.samples = samples[i:i + step]
            parts.append(encode(_Families((chunk,)))[header:-cut or None])
            if clock() >= deadline:
                await asyncio.sleep(0)
                deadline = clock() + slice_s
    parts.append(eof)
    return b"".join(parts)


def _families(registry):
    """``registry.collect()``, with the parts of the collectors that give parts (see render). For a
    RestrictedRegistry (name[]) its own walk, in its order, each part restricted as it restricts a family."""
    names = getattr(registry, "_name_set", None)
    whole = registry if names is None else getattr(registry, "_registry", None)
    collectors = getattr(whole, "_collector_to_names", None)
    if collectors is None or getattr(whole, "_target_info", None):
        yield from registry.collect()
        return
    if names is None:
        with whole._lock:
            collectors = list(collectors)
        for collector in collectors:
            yield from getattr(collector, "collect_parts", collector.collect)()
        return
    chosen = set(whole._collectors_without_names)       # (built as RestrictedRegistry.collect builds it: same order)
    with whole._lock:
        for name in names:
            if name != "target_info" and name in whole._names_to_collectors:
                chosen.add(whole._names_to_collectors[name])
    for collector in chosen:
        for family in getattr(collector, "collect_parts", collector.collect)():
            family = family._restricted_metric(names)
            if family:
                yield family


class _TooSlow(TimeoutError):
    """A request not whole by its deadline."""


class _Deadline(io.RawIOBase):
    """A socket's bytes, each recv waiting no later than ``deadline`` (time.monotonic())."""

    def __init__(self, sock, deadline: float):
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _TooSlow("the request was not whole by its deadline")
        if left != float("inf"):
            self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        except TimeoutError:
            if self.deadline - time.monotonic() <= 0:
                raise _TooSlow("the request was not whole by its deadline") from None
            raise


def start_metrics_server(port: int, addr: str, registry, loop_of, before=None):
    """Serve ``registry`` on ``addr``:``port`` (0: any free port) from a daemon thread, rendered on the loop
    ``loop_of()`` returns, after ``before()`` (what is read off the loop) on the thread. Returns the server (its
    server_address; shutdown() and server_close() stop it)."""
    plain = make_wsgi_app(registry)         # OPTIONS, other methods and /favicon.ico: prometheus-client's answers

    def app(environ, start_response):
        if environ["REQUEST_METHOD"] != "GET" or environ["PATH_INFO"] == "/favicon.ico":
            return plain(environ, start_response)
        encode, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
        params = parse_qs(environ.get("QUERY_STRING", ""))
        chosen = registry.restricted_registry(params["name[]"]) if "name[]" in params else registry
        loop = loop_of()
        why = None
        try:
            if loop is None:
                raise RuntimeError("the broker is not running")
            if before is not None:
                before()
            rendering = asyncio.run_coroutine_threadsafe(render(encode, chosen), loop)
            try:
                output = rendering.result(RENDER_TIMEOUT_S)
            finally:
                rendering.cancel()
        except concurrent.futures.CancelledError:     # the broker stopping: its loop cancelled the rendering task
            why = "the broker is stopping"
        except (RuntimeError, TimeoutError) as exc:
            why = str(exc) or f"the event loop did not finish the page in {RENDER_TIMEOUT_S:.0f} s"
        if why is not None:
            log.warning("a /metrics scrape answered 503: %s", why)
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [f"# metrics not rendered: {why}\n".encode()]
        headers = [("Content-Type", content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING")):
            output = gzip.compress(output)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [output]

    class _Handler(_SilentHandler):
        timeout = READ_TIMEOUT_S        # on the socket: a client that never sends is not waited for for ever
        slow = EveryKey(60.0)           # hosts whose requests too slow to arrive were said this minute

        def setup(self):
            # The socket's timeout bounds one recv, not the request: a request line sent a byte every 9 s held a
            # thread (one of MAX_CONNECTIONS) for as long as its sender liked. The request is read against one
            # deadline; the page is written under the socket's timeout again (parse_request).
            super().setup()
            self.rfile.close()          # (the socket's makefile: left open, the socket were never really closed)
            self.rfile = io.BufferedReader(_Deadline(self.connection, time.monotonic() + READ_TIMEOUT_S))

        def parse_request(self):
            if self.server.whole(self.connection):      # its request is read: no longer one to make room from
                return False    # (closed for a newcomer: what it had sent of its request line is no request)
            whole = super().parse_request()
            self.rfile.raw.deadline = float("inf")      # (no body is read: a GET's is ignored)
            self.connection.settimeout(READ_TIMEOUT_S)
            return whole

        def handle(self):
            try:
                super().handle()
            except _TooSlow:
                if self.slow.due(self.client_address[0]):
                    log.warning("a /metrics connection from %s closed: its request not sent whole within %.0f s "
                                "(a client stalled or trickling its request; said once a minute a host)",
                                self.client_address, READ_TIMEOUT_S)
            except OSError as exc:      # TimeoutError, a reset: the client's doing, not a traceback on stderr
                log.debug("/metrics connection from %s dropped: %r", self.client_address, exc)

    class _Server(ThreadingWSGIServer):
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        said = EveryKey(60.0)       # hosts whose refusals were said this minute: a flood of connections, one line
        idle_said = EveryKey(60.0)  # hosts whose idle connections closed for a new one were said this minute

        # Connections given a thread whose request is not whole yet, the longest waiting first
        # (socket -> (host, time.monotonic() accepted))
        waiting: dict = {}
        dropped: set = set()        # of those, closed for a newcomer, their thread not yet at whole()
        waiting_lock = threading.Lock()

        def whole(self, request) -> bool:
            """Forget ``request`` as one waiting for its request; True when it was closed for a newcomer (the part
            of a request line it had sent, read at the close, is not served: a page rendered for a dead socket, and
            the thread the newcomer waits for held until it was done)."""
            with self.waiting_lock:
                self.waiting.pop(request, None)
                if request in self.dropped:
                    self.dropped.discard(request)
                    return True
                return False

        def _make_room(self) -> bool:
            """Close the connection waiting longest for its request to arrive, so a new one is served in its
            place: MAX_CONNECTIONS idle clients reconnecting every READ_TIMEOUT_S (port scanners, health checks
            that connect and wait, a hostile client) had every scrape answered 503 for as long as they went on. A
            scraper sends its request as it connects; one whose request is whole (a page rendering on a slow loop)
            keeps its thread. True once a thread is free (its thread sees the close and ends at once)."""
            with self.waiting_lock:
                if not self.waiting:
                    return False
                oldest = next(iter(self.waiting))
                host, since = self.waiting[oldest]
                if time.monotonic() - since < IDLE_BEFORE_CLOSE_S:
                    return False        # (a flood of connections must not close a scraper's before it is read)
                del self.waiting[oldest]
                self.dropped.add(oldest)
            if self.idle_said.due(host):
                log.warning("a /metrics connection from %s closed: it sent no request while all %d were taken, and "
                            "a new one came (said once a minute a host): a client that connects and waits (a port "
                            "scanner, a health check) holds a thread for up to %.0f s", host, MAX_CONNECTIONS,
                            READ_TIMEOUT_S)
            try:
                oldest.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return self.slots.acquire(timeout=ROOM_WAIT_S)

        def process_request(self, request, client_address):
            # Each connection a thread: a blocked loop holds one a scrape for RENDER_TIMEOUT_S, and idle clients
            # one each until READ_TIMEOUT_S. Past the cap the one waiting longest for its request is closed for it,
            # or, every thread rendering a page, the answer is written here, short and at once.
            if not self.slots.acquire(blocking=False) and not self._make_room():
                if self.said.due(client_address[0]):
                    log.warning("a /metrics connection from %s answered 503: %d served already (said once a minute "
                                "a host)", client_address, MAX_CONNECTIONS)
                try:
                    request.settimeout(1.0)
                    request.sendall(_TOO_MANY)
                except OSError:
                    pass
                self.shutdown_request(request)
                return
            with self.waiting_lock:
                self.waiting[request] = client_address[0], time.monotonic()
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.whole(request)
                self.slots.release()
                raise

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.whole(request)
                self.slots.release()
    _Server.address_family, addr = _get_best_family(addr, port)
    httpd = make_server(addr, port, app, _Server, handler_class=_Handler)
    threading.Thread(target=httpd.serve_forever, name="txmq-metrics-http", daemon=True).start()
    return httpd
