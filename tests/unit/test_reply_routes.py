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


def test_remembered_requests_are_forgotten_oldest_first_from_a_table_that_drops_its_first_in_constant_time():
    """Every send of a request (request-reply) is remembered on the event loop. At the cap (65,536 requests a client
    can keep there for an hour each) the oldest was dropped from the front of a plain dict, whose iteration skips
    every entry deleted since its last resize: each send scanned tens of thousands of dead slots (measured 56-170 us
    a send and growing, against about 2 us below the cap). An OrderedDict drops its first entry in constant time.
    Asserted by what the table is, not by timing it: a timed assertion means something else on a slower machine."""
    from collections import OrderedDict

    clients = ClientRegistry(lambda: 0)
    conn = _Conn()
    cap = clients_module._REQUESTS_MAX
    for i in range(cap + 10):
        clients.requested(conn, _request(f"{i:036d}", ttl=str(3600 * 1000)))
    assert type(clients._requests) is OrderedDict
    assert len(clients._requests) == cap
    assert next(iter(clients._requests)) == f"{10:036d}"      # the ten oldest went, in order
