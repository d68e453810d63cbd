"""A small synchronous facade over the asyncio clients, for scripts and REPLs.

Each object runs its async client on a private event loop in a daemon thread; every coroutine method
becomes a blocking call that returns its result or raises its exception (after ``timeout`` seconds,
``TimeoutError``). Use them as context managers::

    from txmq.sync import Producer, PullConsumer

    with Producer("127.0.0.1:9876", "PG_script") as producer:
        result = producer.send("Orders", b"order #1", tags="created")

    with PullConsumer("127.0.0.1:9876", "CG_script") as consumer:
        for mq in consumer.fetch_queues("Orders"):
            print(consumer.pull(mq, 0).messages)

Producers are started when created; a ``PushConsumer`` is started by ``start()`` after
``subscribe()``, and its listener runs on the facade's thread. Not for use inside a running event
loop (use the async clients there).
"""
from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Callable

__all__ = ["Producer", "TransactionProducer", "PullConsumer", "PushConsumer"]


class _LoopThread:
    """An event loop running forever in a daemon thread; ``run`` blocks on one coroutine in it."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:       # TimeoutError, KeyboardInterrupt: the call is over for the caller, so it ends
            fut.cancel()            # (left running, a send that timed out here could still be stored later)
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class _Blocking:
    """Wraps one async client: coroutine methods block, everything else passes through."""

    _factory: Callable[..., Any]
    _autostart = True

    def __init__(self, *args: Any, timeout: float | None = 60.0, **kwargs: Any):
        self._timeout = timeout
        self._thread = _LoopThread(f"txmq-sync-{type(self).__name__}")
        self._closed = False

        async def create():                   # built on its loop: it may make futures and tasks there
            client = self._factory(*args, **kwargs)
            if self._autostart and hasattr(client, "start"):
                await client.start()
            return client

        try:
            self._client = self._thread.run(create(), timeout)
        except BaseException:
            self._thread.close()
            raise

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._thread.run(attr(*args, **kwargs), self._timeout)

        blocking.__name__ = name
        blocking.__doc__ = attr.__doc__
        return blocking

    def close(self) -> None:
        """Shut the client down and stop its thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._thread.run(self._client.shutdown(), self._timeout)
        finally:
            self._thread.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _async(module: str, name: str) -> Callable[..., Any]:
    def make(*args: Any, **kwargs: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(f"txmq.{module}"), name)(*args, **kwargs)
    return make


class Producer(_Blocking):
    """``txmq.producer.Producer``, blocking: ``send``, ``send_batch``, ``send_oneway`` return when done."""

    _factory = staticmethod(_async("producer", "Producer"))


class TransactionProducer(_Blocking):
    """``txmq.producer.TransactionProducer``, blocking; the listener runs on the facade's thread."""

    _factory = staticmethod(_async("producer", "TransactionProducer"))


class PullConsumer(_Blocking):
    """``txmq.consumer.PullConsumer``, blocking: ``fetch_queues``, ``pull``, ``commit_offset``, ..."""

    _factory = staticmethod(_async("consumer", "PullConsumer"))


class PushConsumer(_Blocking):
    """``txmq.consumer.PushConsumer``: ``subscribe(...)`` then ``start()``; ``close()`` stops it."""

    _factory = staticmethod(_async("consumer", "PushConsumer"))
    _autostart = False
