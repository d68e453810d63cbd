"""Where ClientRegistry sends a reply (request-reply): the connection its request came on, else the newest
registration under the requester's client id; and what remembering requests may cost (a count, a time, a length).
The clock is the test's: an expiry means the same on any machine."""
from __future__ import annotations

import gc
import weakref

from broker import clients as clients_module
from broker.clients import ClientRegistry
from tests.unit.test_client_caps import _beat, _Conn


def _request(correlation: str, ttl: str = "3000") -> dict:
    return {"CORRELATION_ID": correlation, "REPLY_TO_CLIENT": "c", "TTL": ttl}


def test_a_reply_goes_to_its_requests_connection_else_to_the_newest_claimant():
    now = [0]
    clients = ClientRegistry(lambda: now[0])
    old, new = _Conn(), _Conn()
    _beat(clients, old, producers=["PG"])
    _beat(clients, new, producers=["PG"])       # both give client id "c"
    clients.requested(old, _request("asked-on-old"))
    assert clients.reply_connection("c", "asked-on-old") is old
    assert clients.reply_connection("c", "never-asked") is new       # RocketMQ's: the last registered
    assert clients.reply_connection("c", None) is new
    assert clients.reply_connection("someone-else", "asked-on-old") is None     # the id must be the request's
    old.is_open = False
    assert clients.reply_connection("c", "asked-on-old") is new      # its connection gone: any claimant left
    now[0] = 3001
    assert "asked-on-old" in clients._requests
    clients.requested(new, _request("later"))                      # expired ones go as new ones come
    assert list(clients._requests) == ["later"]


def test_remembered_requests_are_bounded_in_number_time_and_length(monkeypatch):
    monkeypatch.setattr(clients_module, "_REQUESTS_MAX", 3)
    clients = ClientRegistry(lambda: 0)
    conn = _Conn()
    for i in range(5):
        clients.requested(conn, _request(f"r{i}", ttl="not a number"))
    assert list(clients._requests) == ["r2", "r3", "r4"]
    clients.requested(conn, _request("x" * 129))                    # a client's choice, up to 32 KiB: not kept
    clients.requested(conn, _request("far", ttl=str(10 ** 30)))     # waits at most an hour
    assert "x" * 129 not in clients._requests
    assert clients._requests["far"][1] == clients_module._REQUEST_TTL_MAX_MS


def test_a_remembered_request_does_not_keep_its_connection():
    clients = ClientRegistry(lambda: 0)
    conn = _Conn()
    clients.requested(conn, _request("r", ttl=str(3600 * 1000)))
    gone = weakref.ref(conn)
    del conn
    gc.collect()
    assert gone() is None and clients.reply_connection("c", "r") is None


def test_remembering_a_request_at_the_cap_costs_what_it_costs_below_it():
    """Every send of a request (request-reply) is remembered on the event loop. At the cap (65,536 requests a client
    can keep there for an hour each) the oldest was dropped from the front of a plain dict, whose iteration skips
    every entry deleted since its last resize: each send scanned tens of thousands of dead slots (about 50 us, then
    150 us and on, against 5 us below the cap). A ratio of two timings of the same code in one process: the same on
    a fast machine and a slow one, and the margin wide (the scan grows with the sends past the cap)."""
    import time

    clients = ClientRegistry(lambda: 0)
    conn = _Conn()
    cap, sent = clients_module._REQUESTS_MAX, [0]

    def per_request(count: int) -> float:
        started = time.perf_counter()
        for i in range(sent[0], sent[0] + count):
            clients.requested(conn, _request(f"{i:036d}", ttl=str(3600 * 1000)))
        sent[0] += count
        return (time.perf_counter() - started) / count

    below = min(per_request(5000) for _ in range(4))
    per_request(cap + cap // 2)                     # to the cap, and half as many again past it
    at_cap = min(per_request(5000) for _ in range(4))
    assert len(clients._requests) == cap
    assert at_cap < 4 * below, f"{at_cap * 1e6:.1f} us a request at the cap, {below * 1e6:.1f} us below it"
