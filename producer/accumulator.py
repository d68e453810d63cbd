"""Client-side batching: sends to one topic wait up to ``linger_ms`` and leave as one SEND_BATCH_MESSAGE.

Kafka's producer idea (``linger.ms``, ``batch.size``) on RocketMQ's batch request: every
message keeps its own properties and UNIQ_KEY inside the batch body, the broker stores each
as its own record, and each caller's ``send`` resolves to that message's own result (its
offset message id and queue offset), so batching changes throughput, not what a send returns.

A batch leaves when it holds ``batch_size`` messages or ``max_batch_bytes`` of bodies, or
``linger_ms`` after its first message arrived, whichever comes first. A failed batch fails
every send in it with the same error (the broker stores a batch all or none).
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

from protocol.codes import RequestCode
from protocol.message import Prop, encode_batch, properties_to_string

if TYPE_CHECKING:
    from .producer import Producer, SendResult

_BATCH_PROPS = {Prop.WAIT: "true"}


class _Pending:
    __slots__ = ("entries", "futures", "nbytes", "timer")

    def __init__(self):
        self.entries: list[tuple[int, bytes, str]] = []
        self.futures: list[asyncio.Future] = []
        self.nbytes = 0
        self.timer: asyncio.Handle | None = None


class Accumulator:
    def __init__(self, producer: "Producer", linger_ms: float, batch_size: int, max_batch_bytes: int):
        if batch_size < 1 or linger_ms < 0 or max_batch_bytes < 1:
            raise ValueError("batch_size and max_batch_bytes must be positive and linger_ms not negative")
        self._producer = producer
        self._linger = linger_ms / 1000
        self._batch_size = batch_size
        self._max_bytes = max_batch_bytes
        self._pending: dict[str, _Pending] = {}     # topic -> the batch being filled
        self._in_flight: set[asyncio.Task] = set()

    def add(self, topic: str, body: bytes, props: dict) -> asyncio.Future:
        """Queue one message; the future resolves to its own SendResult."""
        loop = asyncio.get_running_loop()
        batch = self._pending.get(topic)
        if batch is not None and batch.nbytes + len(body) > self._max_bytes:
            self._ship(topic)
            batch = None
        if batch is None:
            batch = self._pending[topic] = _Pending()
            # linger 0 still gathers what is sent in the same loop tick: one request for all of it
            batch.timer = (loop.call_later(self._linger, self._ship, topic) if self._linger > 0
                           else loop.call_soon(self._ship, topic))
        props = {k: v for k, v in props.items() if k != Prop.WAIT}
        batch.entries.append((0, body, properties_to_string(props)))
        fut = loop.create_future()
        batch.futures.append(fut)
        batch.nbytes += len(body)
        if len(batch.entries) >= self._batch_size:
            self._ship(topic)
        return fut

    async def flush(self) -> None:
        """Send everything queued now and wait until every batch in flight has its answer."""
        for topic in list(self._pending):
            self._ship(topic)
        while self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)

    def _ship(self, topic: str) -> None:
        batch = self._pending.pop(topic, None)
        if batch is None:
            return
        if batch.timer is not None:
            batch.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._send(topic, batch))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _send(self, topic: str, batch: _Pending) -> None:
        try:
            result = await self._producer._send(RequestCode.SEND_BATCH_MESSAGE, topic, encode_batch(batch.entries),
                                                _BATCH_PROPS, None, batch=True)
        except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
            for fut in batch.futures:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for fut, single in zip(batch.futures, split_result(result, batch.entries)):
            if not fut.done():
                fut.set_result(single)


def split_result(result: "SendResult", entries: list[tuple[int, bytes, str]]) -> list["SendResult"]:
    """One SendResult per message of a batch: the broker answers comma-joined ids and the first queue offset."""
    ids = result.offset_msg_id.split(",")
    if len(ids) != len(entries):
        ids = [result.offset_msg_id] * len(entries)
    out = []
    for i, ((_, _, props_text), offset_id) in enumerate(zip(entries, ids)):
        uniq = _uniq_key(props_text)
        qoff = result.queue_offset + i if result.queue_offset >= 0 else -1
        out.append(replace(result, msg_id=uniq, offset_msg_id=offset_id, queue_offset=qoff))
    return out


def _uniq_key(props_text: str) -> str:
    for pair in props_text.split("\x02"):
        name, _, value = pair.partition("\x01")
        if name == Prop.UNIQ_KEY:
            return value
    return ""
