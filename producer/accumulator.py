"""Client-side batching: sends to one topic wait up to ``linger_ms`` and leave as one SEND_BATCH_MESSAGE.

Kafka's producer idea (``linger.ms``, ``batch.size``) on RocketMQ's batch request: every
message keeps its own properties and UNIQ_KEY inside the batch body, the broker stores each
as its own record, and each caller's ``send`` resolves to that message's own result (its
offset message id and queue offset), so batching changes throughput, not what a send returns.

A batch leaves when it holds ``batch_size`` messages or ``max_batch_bytes`` of batch body (each message's body,
properties and 22 bytes of entry head: what the broker's max_message_size, 4 MiB, bounds), or ``linger_ms`` after
its first message arrived, whichever comes first. Bodies alone were counted: 600 sends of 100 bytes with 30 KB of
properties each made one batch of 18 MB, past any broker's limit. A failed batch fails
every send in it with the same error (the broker stores a batch all or none; a MaybeStoredError names each
send's own message id), except a batch
the broker refuses as MESSAGE_ILLEGAL for what one entry holds, or whose body cannot be written for what one
entry holds (properties no UTF-8 can hold): each of its sends goes again
alone, so only the one at fault fails (properties too long for any record are refused at once).
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from protocol.codes import RequestCode
from protocol.errors import MaybeStoredError, MessageIllegalError
from protocol.message import MAX_PROPERTIES_LENGTH, Prop, encode_batch

log = logging.getLogger("txmq.producer")

if TYPE_CHECKING:
    from .producer import Producer, SendResult

_BATCH_PROPS = f"{Prop.WAIT}\x01true"          # the batch request's own properties
_PROPS_CHECK = MAX_PROPERTIES_LENGTH // 4       # shorter strings cannot encode past the limit
_ENTRY_HEAD = 22                                # a batch entry's fixed fields (encode_batch)


class _Pending:
    __slots__ = ("entries", "futures", "uniqs", "nbytes", "timer")

    def __init__(self):
        self.entries: list[tuple[int, bytes, str]] = []
        self.futures: list[asyncio.Future] = []
        self.uniqs: list[str] = []                  # each entry's UNIQ_KEY: its send's msg_id
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

    def add(self, topic: str, body: bytes, props: str, uniq: str) -> asyncio.Future:
        """Queue one message (``props``: its properties string, without WAIT; ``uniq``: its UNIQ_KEY);
        the future resolves to its own SendResult."""
        loop = asyncio.get_running_loop()
        if type(body) is not bytes and not isinstance(body, (bytearray, memoryview)):
            # found out by encode_batch, it failed every send of the batch
            fut = loop.create_future()
            fut.set_exception(TypeError(f"a message body is bytes-like, not {type(body).__name__}"))
            return fut
        if len(props) > _PROPS_CHECK and (n := len(props.encode())) > MAX_PROPERTIES_LENGTH:
            # what a broker answers such a message sent alone (the record's length field is a short), said here:
            # in a batch it would fail the sends gathered with it
            fut = loop.create_future()
            fut.set_exception(MessageIllegalError(f"properties of {n} bytes are longer than {MAX_PROPERTIES_LENGTH}"))
            return fut
        # str.isascii() is a flag read: only properties with other characters are encoded to be measured
        size = _ENTRY_HEAD + len(body) + (len(props) if props.isascii() else len(props.encode(errors="replace")))
        batch = self._pending.get(topic)
        if batch is not None and batch.nbytes + size > self._max_bytes:
            self._ship(topic)
            batch = None
        if batch is None:
            batch = self._pending[topic] = _Pending()
            # linger 0 still gathers what is sent in the same loop tick: one request for all of it
            batch.timer = (loop.call_later(self._linger, self._ship, topic) if self._linger > 0
                           else loop.call_soon(self._ship, topic))
        batch.entries.append((0, body, props))
        batch.uniqs.append(uniq)
        fut = loop.create_future()
        batch.futures.append(fut)
        batch.nbytes += size
        if len(batch.entries) >= self._batch_size:
            self._ship(topic)
        return fut

    async def flush(self) -> None:
        """Send everything queued now and wait until every batch in flight has its answer; what is gathered
        meanwhile is sent too (left to its linger timer, it was still queued when the producer closed)."""
        while self._pending or self._in_flight:
            for topic in list(self._pending):
                self._ship(topic)
            # waited for, not gathered: a flush cancelled (a shutdown under its caller's deadline) cancelled every
            # batch in flight, and the sends gathered in them never had their answer
            if self._in_flight:
                await asyncio.wait(self._in_flight)

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
            body = encode_batch(batch.entries)
        except (UnicodeEncodeError, MessageIllegalError) as exc:
            # One entry's properties (a lone surrogate, which no UTF-8 holds), found for all of them, as the
            # broker's MESSAGE_ILLEGAL below: its own send raises it, alone.
            return await self._each_alone(topic, batch, exc)
        except Exception as exc:  # noqa: BLE001 - raised out of this task, it left every send unresolved
            _fail(batch.futures, exc)
            return
        try:
            result = await self._producer._send_text(RequestCode.SEND_BATCH_MESSAGE, topic, body, _BATCH_PROPS, "",
                                                     None, batch=True)
        except MessageIllegalError as exc:
            # Refused for what one entry holds (its size, a property)
            return await self._each_alone(topic, batch, exc)
        except MaybeStoredError as exc:     # each caller is told its own message's id, to dedupe by
            for fut, uniq in zip(batch.futures, batch.uniqs):
                own = type(exc)(f"{exc} ({uniq} is this one's)", msg_id=uniq)
                own.__cause__ = exc.__cause__
                _fail([fut], own)
            return
        except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
            _fail(batch.futures, exc)
            return
        for fut, single in zip(batch.futures, split_result(result, batch.uniqs)):
            if not fut.done():
                fut.set_result(single)

    async def _each_alone(self, topic: str, batch: _Pending, exc: Exception) -> None:
        """The batch failed with ``exc`` for what one of its entries holds: the sends gathered here are strangers to
        each other, so each goes again alone and only the one at fault fails (with ``exc`` itself if alone)."""
        if len(batch.entries) == 1:
            _fail(batch.futures, exc)
            return
        await asyncio.gather(*(self._send_alone(topic, entry, uniq, fut)
                               for entry, uniq, fut in zip(batch.entries, batch.uniqs, batch.futures)))

    async def _send_alone(self, topic: str, entry: tuple[int, bytes, str], uniq: str, fut: asyncio.Future) -> None:
        _flag, body, props = entry
        try:
            result = await self._producer._send_text(RequestCode.SEND_MESSAGE_V2, topic, body,
                                                     f"{props}\x02{_BATCH_PROPS}" if props else _BATCH_PROPS, uniq, None)
        except Exception as exc:  # noqa: BLE001 - this send's own failure, to its caller
            _fail([fut], exc)
            return
        if not fut.done():
            fut.set_result(result)


def _fail(futures: list[asyncio.Future], exc: BaseException) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_exception(exc)


def split_result(result: "SendResult", uniqs: list[str]) -> list["SendResult"]:
    """One SendResult per message of a batch (``uniqs``: their UNIQ_KEYs, in order): the broker answers
    comma-joined ids and the first queue offset."""
    ids = result.offset_msg_id.split(",")
    if len(ids) != len(uniqs):
        # whose is whose cannot be told: each send's is unknown (""), as when a broker names none, not the whole list
        log.warning("batch of %d messages to %s answered %d id(s) (%r): their sends' offset_msg_id left empty",
                    len(uniqs), result.queue, len(ids), result.offset_msg_id)
        ids = [""] * len(uniqs)
    cls, status, queue, first = type(result), result.status, result.queue, result.queue_offset
    txid, addr = result.transaction_id, result.broker_addr
    # the class called directly: dataclasses.replace costs ~2 us a message
    return [cls(status, uniq, offset_id, queue, first + i if first >= 0 else -1, txid, addr)
            for i, (uniq, offset_id) in enumerate(zip(uniqs, ids))]
