"""RemotingConnection: one RocketMQ remoting connection over asyncio, for both ends.

The broker server and the Python clients share it. It frames bytes with
FrameDecoder, matches responses to requests by opaque, runs a handler for
incoming requests (the broker's processors, or a client's CHECK_TRANSACTION_STATE
listener), and applies the limits a server facing unknown clients needs:

* in-flight limit: at most ``max_in_flight`` requests being handled at once;
  past it the connection stops reading until handlers catch up. A request parked by its
  handler (``park``: a long-polling pull waiting for a message) does not count, up to
  ``max_in_flight * 4`` of them;
* back-pressure: while the peer is not reading our responses (the transport's
  write buffer is over its high-water mark) we stop reading its requests, and
  a peer whose unread backlog passes ``max_write_buffer`` is disconnected;
* a shared ``WriteBudget`` caps what all of a server's connections hold unsent together: past
  it, the connections holding the most are closed, largest first (one peer that does not read
  may hold ``max_write_buffer``; a hundred of them must not hold a hundred times that);
  a shared ``ReadBudget`` does the same for frames received in part (one may declare 16 MiB and
  never finish), closing those unfinished longest first;
* a malformed frame is answered with an error where its opaque can be found,
  then the connection closes (the stream cannot be re-synchronised);
* fairness: one read handles at most ``FRAMES_PER_TURN`` frames; the rest wait for the next
  loop iteration (reading paused meanwhile), so fifty connections that each pipeline hundreds
  of cheap requests cannot hold the loop for a second while one good client waits. A client's
  connections (ConnectionPool) take ``CLIENT_FRAMES_PER_TURN``: they read answers to their own
  requests, and a burst of 64 answers handled in one turn is answered by one write, not four.

A request's timeout is not a timer of its own: each connection keeps one timer, armed at its
earliest deadline, that expires every request past its deadline when it fires.

Outgoing frames produced in one event-loop iteration are written with one
``writelines`` call, so 64 pipelined responses cost one send syscall, not 64.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import random
import re
import socket
import struct
from typing import Awaitable, Callable, Optional, Union

try:                # Linux: bytes a socket's kernel send queue holds that its peer has not acknowledged
    from fcntl import ioctl
    from termios import TIOCOUTQ
except ImportError:     # pragma: no cover - not Linux: only the transport's own buffer is seen
    ioctl = TIOCOUTQ = None

from .codes import FLAG_ONEWAY, FLAG_RESPONSE, ResponseCode, request_name
from .command import RemotingCommand
from .errors import (ConnectionClosedError, HeaderTooLargeError, MessageIllegalError, ProtocolError,
                     RequestTimeoutError)
from .frame import MAX_FRAME_SIZE, FrameDecoder

log = logging.getLogger("txmq.connection")

# A handler answers at once (a command or None), or later: a coroutine, or a Task it made itself.
HandlerResult = Union[RemotingCommand, None, Awaitable[Optional[RemotingCommand]]]
Handler = Callable[["RemotingConnection", RemotingCommand], HandlerResult]

_opaques = itertools.count(1)
FRAMES_PER_TURN = 16
TURN_HEADER_BYTES = 64 * 1024   # header bytes read before reading pauses to the loop's next iteration (_spend)
CLIENT_FRAMES_PER_TURN = 1024
_NEVER = float("inf")


class _Deferred:
    """What a handler returns when it will answer later itself: it called ``conn.hold()`` and will call
    ``conn.release()`` and ``conn.send(reply)`` (a store completion does, with no future or Task between)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFERRED"


DEFERRED = _Deferred()


class RemotingConnection(asyncio.Protocol):
    def __init__(self, handler: Handler | None = None, *, max_frame_size: int = MAX_FRAME_SIZE,
                 max_in_flight: int = 1024, max_write_buffer: int = 64 * 1024 * 1024,
                 on_open: Callable[["RemotingConnection"], bool] | None = None,
                 on_close: Callable[["RemotingConnection"], None] | None = None,
                 sign: Callable[[RemotingCommand], None] | None = None, frames_per_turn: int = FRAMES_PER_TURN,
                 client: bool = False, budget: "WriteBudget | None" = None,
                 read_budget: "ReadBudget | None" = None, on_reject: Callable[[], None] | None = None,
                 on_refuse: Callable[[str], None] | None = None):
        self.handler = handler
        self.budget = budget                # shared with the server's other connections (WriteBudget)
        self.read_budget = read_budget      # likewise (ReadBudget)
        # A client's connection reads on while its writes are backed up: what it reads are mostly answers, and
        # its server stops reading requests while answers wait unread, so pausing would stall both for good.
        self.client = client
        self.frames_per_turn = frames_per_turn
        self.sign = sign                    # signs each request we send (credentials for a broker's ACL)
        self.on_open = on_open
        self.max_in_flight = max_in_flight
        self.max_write_buffer = max_write_buffer
        self.on_close = on_close
        self.on_reject = on_reject          # called once a connection is closed for malformed input (a metric)
        self.on_refuse = on_refuse          # called with a reason when a request is refused here (header-size)
        self.transport: asyncio.Transport | None = None
        self.peer: tuple[str, int] = ("", 0)
        self.local: tuple[str, int] = ("", 0)
        self.closed = asyncio.Event()
        self.attributes: dict = {}          # per-connection state owned by the handler side
        self.quiet_ticks = 0                # a server's housekeeping turns since the peer last sent a byte
        self.quiet_unsent = 0               # unread_bytes() at the last such turn (has the peer taken any since?)
        self.frame_ticks = 0                # such turns the frame now arriving has stayed unfinished (close_quiet)
        self._decoder = FrameDecoder(max_frame_size)
        # opaque -> (future, deadline, request code, timeout); insertion order is the order requests left
        self._pending: dict[int, tuple[asyncio.Future, float, int, float]] = {}
        self._sweep: asyncio.TimerHandle | None = None    # the one timeout timer, armed at self._sweep_at
        self._sweep_at = _NEVER
        self._tasks: set[asyncio.Task] = set()
        self._held = 0                      # requests answered later by their handler (DEFERRED)
        self._parked = 0                    # requests waiting for an event, not for work (park)
        self._release_waiters: list[asyncio.Future] = []
        self._out: list = []
        self._backlog: list = []            # frames read but not yet handled (fairness, see above)
        self._flush_scheduled = False
        self._reading_paused_for: set[str] = set()
        self._writing_paused = False
        self._turn_waiting = False          # a backlog waits for the peer to read (see _next_turn)
        self._drain_waiters: list[asyncio.Future] = []
        self._loop = asyncio.get_event_loop()

    # ------------------------------------------------------------ lifecycle
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.peer = (peer[0], peer[1]) if peer else ("", 0)
        self.local = (local[0], local[1]) if local else ("", 0)
        transport.set_write_buffer_limits(high=4 * 1024 * 1024)
        if self.on_open is not None and not self.on_open(self):
            transport.abort()

    def connection_lost(self, exc) -> None:
        self.transport = None
        error = ConnectionClosedError(f"connection to {self.peer[0]}:{self.peer[1]} closed"
                                      + (f": {exc}" if exc else ""))
        for fut, *_ in self._pending.values():
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep, self._sweep_at = None, _NEVER
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._drain_waiters.clear()
        self._out.clear()
        if self.budget is not None:
            self.budget.report(self, 0)
        if self.read_budget is not None:
            self.read_budget.report(self, 0)
        self.closed.set()
        if self.on_close is not None:
            self.on_close(self)

    @property
    def in_flight(self) -> list[asyncio.Future]:
        """The requests this connection is handling now: its Tasks, and a future done once no request
        answered later by its handler (DEFERRED) is held any more."""
        pending = list(self._tasks)
        if self._held:
            fut = self._loop.create_future()
            self._release_waiters.append(fut)
            pending.append(fut)
        return pending

    @property
    def unfinished_bytes(self) -> int:
        """Bytes received of a frame not yet whole (ReadBudget)."""
        return self._decoder.buffered

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -------------------------------------------------------------- reading
    def data_received(self, data: bytes) -> None:
        self.quiet_ticks = 0
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:
            self._rejected("closing %s:%s: %s", exc)
            self.close()
            return
        if self.read_budget is not None:
            # (a dict look-up when nothing changed; with frames completed, what is left is of a frame begun since)
            self.read_budget.report(self, self._decoder.buffered, frames)
        if frames:
            self.frame_ticks = 0            # what is left unfinished (if anything) began in this read
            self._spend()
        if self._backlog:                   # a turn is already scheduled: these wait behind it
            self._backlog.extend(frames)
            return
        self._handle_frames(frames)

    def _spend(self) -> None:
        """Pause reading until the loop's next iteration once TURN_HEADER_BYTES of headers were read. A read's
        frames are handled FRAMES_PER_TURN at a time, but libuv calls data_received up to 32 times for one
        readable event: a connection pipelining 256 KiB headers of made-up fields (14-30 ms each to parse) held
        the loop for seconds an iteration, and another client's requests waited 1.0-2.3 s each (10-90 ms now)."""
        if self._decoder.header_bytes > TURN_HEADER_BYTES and "headers" not in self._reading_paused_for:
            self.pause_reading("headers")
            self._loop.call_soon(self._headers_spent)

    def _headers_spent(self) -> None:
        self._decoder.header_bytes = 0     # (the decoder adds up the header lengths it unpacks)
        self.resume_reading("headers")

    def _handle_frames(self, frames: list) -> None:
        per_turn = self.frames_per_turn
        if len(frames) > per_turn:
            self._backlog = frames[per_turn:]
            frames = frames[:per_turn]
            self.pause_reading("turn")
            self._loop.call_soon(self._next_turn)
        for frame in frames:
            try:
                cmd = RemotingCommand.decode(frame)
            except HeaderTooLargeError as exc:
                self._refuse_unread(frame, exc)     # the frame is whole: the next is read as before
                continue
            except ProtocolError as exc:
                self._backlog = []
                self._reject_frame(frame, exc)
                return
            if cmd.flag & FLAG_RESPONSE:
                entry = self._pending.pop(cmd.opaque, None)
                if entry is not None and not entry[0].done():
                    entry[0].set_result(cmd)
                continue
            self._dispatch(cmd)
        if not self._backlog and self._decoder.error is not None:
            self._rejected("closing %s:%s after its last good frame: %s", self._decoder.error)
            self.close()

    def _next_turn(self) -> None:
        if self._writing_paused and not self.client:
            # Its peer is not reading: the frames already read wait too, until it does (resume_writing). Handled
            # meanwhile, one read's worth of small requests asking for large answers (thousands of them in 256 KiB)
            # grew the unread responses far past the point where reading stopped.
            self._turn_waiting = True
            return
        frames, self._backlog = self._backlog, []
        if self.transport is None or self.transport.is_closing():
            return
        try:
            self._handle_frames(frames)
        except Exception:  # noqa: BLE001 - a bug: every expected failure is answered in _dispatch
            # What the transport does when data_received raises (the first turn of a read): give up on the
            # connection, so its client learns at once. Raised from this loop callback instead, it reached
            # only the loop's log and left reading paused for good -- every later request silently unanswered.
            log.exception("closing %s:%s: handling its frames failed", self.peer[0], self.peer[1])
            self._backlog = []
            self.close()        # what was answered before it still goes out
            return
        if not self._backlog:
            self.resume_reading("turn")

    def _reject_frame(self, frame: bytes, exc: ProtocolError) -> None:
        """Answer a frame we cannot decode when its opaque is findable, then close."""
        self._rejected("malformed frame from %s:%s: %s", exc)
        opaque = _best_effort_opaque(frame)
        if opaque is not None:
            reply = RemotingCommand(exc.response_code, opaque=opaque, flag=FLAG_RESPONSE, remark=str(exc))
            self.send(reply)
        self.close()

    def _rejected(self, what: str, exc: BaseException) -> None:
        """A connection closed for malformed input: counted (on_reject), and logged at most every
        REFUSAL_LOG_GAP_S with how many were not. A line each, a client reconnecting in a loop to send one bad frame
        wrote a WARNING per connection (250 lines and 32 KiB a second from one loopback client), without end."""
        if self.on_reject is not None:
            self.on_reject()
        unlogged = _gate(_rejections_logged, "malformed", self._loop.time())
        if unlogged is not None:
            log.warning(what + " (logged at most every %d s%s)", self.peer[0], self.peer[1], _clipped(exc),
                        REFUSAL_LOG_GAP_S, f"; {unlogged} more connections closed for malformed input since the "
                        "last line" if unlogged else "")

    def _refuse_unread(self, frame: bytes, exc: ProtocolError) -> None:
        """Refuse a frame whose header is not parsed (HeaderTooLargeError): answered, when its opaque is found
        without parsing it (_unread_fields) and it is a request answered, logged as any header refused; a response
        fails its request with the refusal."""
        if self.on_refuse is not None:
            self.on_refuse("header-size")   # as every guard's refusal; the connection is kept: no rejected frame
        code, opaque, flag = _unread_fields(frame)
        if flag & FLAG_RESPONSE and opaque is not None:
            # (a response: its request fails now with the refusal, not at its timeout as if none had come)
            entry = self._pending.pop(opaque, None)
            if entry is not None and not entry[0].done():
                entry[0].set_exception(exc)
        if opaque is None or flag & FLAG_RESPONSE:
            flag |= FLAG_ONEWAY         # nothing to answer: no opaque to answer with, or a response
        # (answered in the request's serialization, as every reply: a ROCKETMQ request's refusal was JSON)
        self._reply_error(RemotingCommand(code, opaque=opaque or 0, flag=flag,
                                          serialize_type=1 if frame[4] == 1 else 0), exc)

    def _dispatch(self, cmd: RemotingCommand) -> None:
        if self.handler is None:
            if not cmd.flag & FLAG_ONEWAY:
                self.send(cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                       f" request type {cmd.code} not supported"))
            return
        # Every failure becomes an error reply: the handler's, and a bug in what it returned (a reply that
        # does not encode, something that is not awaitable). Let out, it would skip the rest of this read's
        # frames; in a later turn (_next_turn) it would also leave reading paused for good, every later
        # request waiting for its client's timeout.
        try:
            result = self.handler(self, cmd)
            if result is None or result is DEFERRED:
                return
            if isinstance(result, RemotingCommand):
                self.answer(cmd, result)
                return
            task = result if isinstance(result, asyncio.Future) else self._loop.create_task(result)
        except Exception as exc:  # noqa: BLE001
            self._reply_error(cmd, exc)
            return
        self._tasks.add(task)
        task.add_done_callback(lambda t, c=cmd: self._handler_done(t, c))
        if self._busy() >= self.max_in_flight:
            self.pause_reading("in-flight")

    def _busy(self) -> int:
        return len(self._tasks) + self._held - self._parked

    def park(self) -> bool:
        """The handler of a request is about to wait for an event, not to work: a long-polling pull, held until
        a message arrives. Until ``unpark`` it does not count towards ``max_in_flight`` (a push consumer keeps
        one pull parked per queue; counted, more than max_in_flight queues stopped every other request on its
        connection for a suspend time). False, and it goes on counting, past ``max_in_flight * 4`` parked."""
        if self._parked >= self.max_in_flight * 4:
            return False
        self._parked += 1
        if self._reading_paused_for and self._busy() <= self.max_in_flight // 2:
            self.resume_reading("in-flight")
        return True

    def unpark(self) -> None:
        self._parked -= 1
        if self._busy() >= self.max_in_flight:
            self.pause_reading("in-flight")

    def hold(self) -> None:
        """A request whose handler answers later (it returns DEFERRED): counted in flight until release()."""
        self._held += 1
        if self._busy() >= self.max_in_flight:
            self.pause_reading("in-flight")

    def release(self) -> None:
        self._held -= 1
        if not self._held and self._release_waiters:
            for waiter in self._release_waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._release_waiters.clear()
        if self._reading_paused_for and self._busy() <= self.max_in_flight // 2:
            self.resume_reading("in-flight")

    def _handler_done(self, task: asyncio.Task, cmd: RemotingCommand) -> None:
        self._tasks.discard(task)
        if self._busy() <= self.max_in_flight // 2:
            self.resume_reading("in-flight")
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._reply_error(cmd, exc)
            return
        self.answer(cmd, task.result())

    def answer(self, cmd: RemotingCommand, reply: RemotingCommand | None) -> None:
        """Send ``reply`` to the request ``cmd`` (nothing for None, nor to a oneway request). A reply that cannot
        be encoded (a bug) is answered SYSTEM_ERROR: left to raise, it would reach only the loop's log, and the
        client would wait for its timeout."""
        if reply is None or cmd.flag & FLAG_ONEWAY:
            return
        try:
            self.send(reply)        # encodes before it queues anything: a failure leaves no partial frame
        except Exception as exc:  # noqa: BLE001
            self._reply_error(cmd, exc)

    def _reply_error(self, cmd: RemotingCommand, exc: BaseException) -> None:
        if isinstance(exc, ProtocolError):
            code = exc.response_code
            _log_refusal(self._loop.time(), cmd, self.peer, exc)
        else:
            code = ResponseCode.SYSTEM_ERROR
            log.error("%s from %s:%s failed", request_name(cmd.code), self.peer[0], self.peer[1],
                      exc_info=(type(exc), exc, exc.__traceback__))
        if not cmd.flag & FLAG_ONEWAY and self.is_open:
            self.send(cmd.response(code, f"{type(exc).__name__}: {exc}" if code == ResponseCode.SYSTEM_ERROR
                                   and not isinstance(exc, ProtocolError) else str(exc)))

    def pause_reading(self, reason: str) -> None:
        if not self._reading_paused_for and self.transport is not None:
            self.transport.pause_reading()
        self._reading_paused_for.add(reason)

    def resume_reading(self, reason: str) -> None:
        if reason in self._reading_paused_for:
            self._reading_paused_for.discard(reason)
            if not self._reading_paused_for and self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    # -------------------------------------------------------------- writing
    def send(self, cmd: RemotingCommand) -> None:
        """Queue a frame; frames queued in one loop iteration go out in one write."""
        if self.transport is None:
            return
        self._queue(cmd.encode_parts())

    def _send_request(self, cmd: RemotingCommand) -> None:
        """Queue a request (or oneway) frame; one longer than a peer reads (``max_frame_size``, RocketMQ's
        frameMaxLength, 16 MiB) raises MessageIllegalError and is not sent. Sent, the peer closed the connection
        on it, and every request in flight there failed with it: one 17 MiB send beside 100 small ones failed
        them all as maybe stored, and their retries, reset again by its own, stored 50 of them three times each."""
        parts = cmd.encode_parts()
        # the whole frame, its 4-byte length field included, as a stock broker's NettyDecoder counts it
        # (LengthFieldBasedFrameDecoder: field + 4 > 16 MiB is too long; the field alone let 16 MiB + 4 through)
        # (a send: header and body, summed without a call)
        length = len(parts[0]) + len(parts[1]) if len(parts) == 2 else sum(map(len, parts))
        if length > self._decoder.max_frame_size:
            raise MessageIllegalError(f"request {request_name(cmd.code)} is a frame of {length} bytes, over the "
                                      f"{self._decoder.max_frame_size} a broker reads: not sent")
        self._queue(parts)

    def _queue(self, parts: list) -> None:
        self._out.extend(parts)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._out or self.transport is None:
            return
        out, self._out = self._out, []
        self.transport.writelines(out)
        unsent = self.unsent_bytes
        if self._writing_paused and unsent > self.max_write_buffer:
            log.warning("closing %s:%s: %d bytes of responses unread (max_write_buffer=%d)", self.peer[0],
                        self.peer[1], unsent, self.max_write_buffer)
            if self.budget is not None:
                self.budget.closed_for("max_write_buffer")
            self.transport.abort()
            unsent = 0
        if self.budget is not None:
            self.budget.report(self, unsent)

    @property
    def unsent_bytes(self) -> int:
        """Reply bytes queued here that the peer has not taken yet (0 once closed)."""
        t = self.transport
        return 0 if t is None or t.is_closing() else t.get_write_buffer_size()

    def unread_bytes(self) -> int:
        """What the peer has not read: unsent_bytes and the kernel's send queue (megabytes on loopback; a reader
        taking a few KB a second drains only this for a long while, the transport's buffer not at all)."""
        unsent = self.unsent_bytes
        sock = None if self.transport is None else self.transport.get_extra_info("socket")
        if sock is None or ioctl is None:
            return unsent
        try:
            return unsent + struct.unpack("i", ioctl(sock.fileno(), TIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError):    # closed meanwhile
            return unsent

    @property
    def reading_paused(self) -> bool:
        """This side stopped reading the peer (back-pressure): whatever it sent is not seen."""
        return bool(self._reading_paused_for)

    @property
    def handling(self) -> bool:
        """A request of the peer is being handled (a parked pull included): it waits for an answer."""
        return bool(self._tasks) or self._held > 0

    @property
    def writing_paused(self) -> bool:
        """The peer left more than the high-water mark unread, and has not caught up since."""
        return self._writing_paused

    def pause_writing(self) -> None:
        # The peer is not reading; stop taking its requests until it does (a server's side only).
        self._writing_paused = True
        if not self.client:
            self.pause_reading("write-buffer")
        # (no budget report here: this runs inside the transport's write, and _flush reports right after it)

    def resume_writing(self) -> None:
        self._writing_paused = False
        self.resume_reading("write-buffer")
        if self._turn_waiting:
            self._turn_waiting = False
            self._loop.call_soon(self._next_turn)
        if self.budget is not None:
            self.budget.report(self, self.unsent_bytes)
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    async def drain(self) -> None:
        if self._writing_paused and self.transport is not None:
            waiter = self._loop.create_future()
            self._drain_waiters.append(waiter)
            await waiter

    # ------------------------------------------------------------- requests
    async def request(self, cmd: RemotingCommand, timeout: float = 3.0) -> RemotingCommand:
        """Send a request and wait for its response (RequestTimeoutError after ``timeout`` s)."""
        fut = self.start_request(cmd, timeout)
        opaque = cmd.opaque
        try:
            return await fut
        finally:
            self._pending.pop(opaque, None)

    def start_request(self, cmd: RemotingCommand, timeout: float = 3.0) -> asyncio.Future:
        """Send a request now; the future resolves to its response, or fails with RequestTimeoutError after
        ``timeout`` s or ConnectionClosedError. For callers that await it without a coroutine of their own."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionClosedError(f"connection to {self.peer[0]}:{self.peer[1]} is closed")
        opaque = cmd.opaque = next(_opaques) & 0x7FFFFFFF
        cmd.flag &= ~(FLAG_RESPONSE | FLAG_ONEWAY)
        fut = self._loop.create_future()
        # No timer per request (nor asyncio.wait_for, a Task per request): the connection's sweep expires it.
        deadline = self._loop.time() + timeout
        self._pending[opaque] = (fut, deadline, cmd.code, timeout)
        if deadline < self._sweep_at:
            self._arm_sweep(deadline)
        try:
            if self.sign is not None:
                self.sign(cmd)
            self._send_request(cmd)
        except BaseException:   # not sent (a body that is not bytes): raised here, not left to time out unawaited
            del self._pending[opaque]
            raise
        return fut

    def _arm_sweep(self, when: float) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep_at = when
        self._sweep = self._loop.call_at(when, self._expire_due)

    def _expire_due(self) -> None:
        """The timeout timer: fail every request past its deadline, forget abandoned ones, re-arm."""
        self._sweep, self._sweep_at = None, _NEVER
        now = self._loop.time() + 0.001     # the loop's clock and timers tick in ms: due within one is due
        due, earliest = [], _NEVER
        for opaque, (fut, deadline, _, _) in self._pending.items():
            if deadline <= now or fut.done():
                due.append(opaque)
            elif deadline < earliest:
                earliest = deadline
        for opaque in due:
            fut, _, code, timeout = self._pending.pop(opaque)
            _expire(fut, code, self.peer, timeout)
        if earliest != _NEVER and self.transport is not None:
            self._arm_sweep(earliest)

    def oneway(self, cmd: RemotingCommand) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionClosedError(f"connection to {self.peer[0]}:{self.peer[1]} is closed")
        cmd.opaque = next(_opaques) & 0x7FFFFFFF
        cmd.flag = (cmd.flag | FLAG_ONEWAY) & ~FLAG_RESPONSE
        if self.sign is not None:
            self.sign(cmd)
        self._send_request(cmd)


class _SharedBudget:
    """What all of a server's connections hold of one kind, together, against ``cap`` bytes.

    Each connection reports what it holds when that may have changed and when it closes (0). Past the cap the
    sizes are read afresh (``_measure``: a buffer may have drained since its last report), and only if they are
    still over it are connections closed, in ``_shed_order``, until the total is back under the cap: each is
    logged (``_say``) and counted (``on_close(reason)``, ``closed_for``)."""

    reason = ""

    def __init__(self, cap: int, on_close: Callable[[str], None] | None = None, owner: str = "broker"):
        self.cap = cap
        self.owner = owner                  # whose limit the log line names ("broker", "name server")
        self.total = 0
        self.on_close = on_close
        self._held: dict[RemotingConnection, int] = {}

    def report(self, conn: RemotingConnection, held: int) -> None:
        before = self._held.get(conn, 0)
        if held == before:
            return
        if held:
            self._held[conn] = held
        else:
            del self._held[conn]
        self.total += held - before
        if self.total > self.cap:
            self._shed()

    def closed_for(self, reason: str) -> None:
        if self.on_close is not None:
            self.on_close(reason)

    def _shed(self) -> None:
        held = self._held
        for conn in list(held):             # what each holds now: some drained since they last reported
            now = self._measure(conn)
            if now:
                held[conn] = now
            else:
                del held[conn]
        self.total = sum(held.values())
        if self.total <= self.cap:
            return
        for conn, size in self._in_shed_order(held):
            if self.total <= self.cap:
                break
            self._say(conn, size)
            del held[conn]
            self.total -= size
            self.closed_for(self.reason)
            conn.abort()

    def _measure(self, conn: RemotingConnection) -> int:
        raise NotImplementedError

    def _in_shed_order(self, held: dict) -> list:
        return sorted(held.items(), key=self._shed_order, reverse=True)

    def _shed_order(self, item) -> tuple:
        return (item[1],)                   # the largest first

    def _say(self, conn: RemotingConnection, size: int) -> None:
        raise NotImplementedError


class WriteBudget(_SharedBudget):
    """Unsent response bytes. Each connection reports its transport's unsent bytes when it writes, when writing
    resumes and when it closes. Those whose peer stopped reading (writing paused) are closed before the others,
    the largest first: a peer that reads its replies holds little for long, so it is the last to go, and one
    that never reads cannot make the server's memory grow past the cap (a connection may hold up to
    ``max_write_buffer`` alone; a hundred of them held a hundred times that, until the process was killed)."""

    reason = "max_total_write_buffer"

    def _measure(self, conn: RemotingConnection) -> int:
        return conn.unsent_bytes

    def _shed_order(self, item) -> tuple:
        return (item[0].writing_paused, item[1])

    def _say(self, conn: RemotingConnection, size: int) -> None:
        log.warning("closing %s:%s: %d bytes of responses unread, the most of any connection, while all "
                    "connections hold %d, over the %s's limit (max_total_write_buffer=%d)",
                    conn.peer[0], conn.peer[1], size, self.total, self.owner, self.cap)


class ReadBudget(_SharedBudget):
    """Bytes of request frames received but not yet whole. A frame may declare up to max_frame_size (16 MiB) and
    arrive as slowly as its peer likes: forty connections each holding 15 MiB of a frame never finished kept
    600 MB, logged nothing, and max_connections_per_host lets one address open thousands (the process was killed
    for its memory, every client with it). The connections whose frame has been unfinished longest are closed
    first: a sender at full speed finishes its frame in milliseconds, one that stalls holds its bytes as long as it
    likes. (Closed largest first, six connections idling on 1 MiB each got a 4 MiB request sent at full speed
    closed instead, as soon as its frame in progress was the largest: idle holders kept every large request out.)
    ``_held`` is in that order: a connection enters it at the first byte of a frame, and goes to its back when a
    frame completed and another has begun (``fresh``)."""

    reason = "max_total_read_buffer"

    def report(self, conn: RemotingConnection, held: int, fresh=False) -> None:
        """``fresh``: true (the frames a read completed, passed as they are: no bool() on every read) when what is
        held now is of a frame begun since the last report."""
        before = self._held.get(conn, 0)
        if held == before and not (fresh and held):     # (a read ending on a frame's end: nothing to move)
            return
        if before and (fresh or not held):
            del self._held[conn]            # (re-inserted below: a frame begun since goes to the back)
        if held:
            self._held[conn] = held         # a frame still arriving keeps its place: unfinished since it began
        self.total += held - before
        if self.total > self.cap:
            self._shed()

    def _in_shed_order(self, held: dict) -> list:
        return list(held.items())           # the frame unfinished longest first

    def _measure(self, conn: RemotingConnection) -> int:
        return conn.unfinished_bytes

    def _say(self, conn: RemotingConnection, size: int) -> None:
        log.warning("closing %s:%s: %d bytes of a request frame not yet whole, the one unfinished longest, while "
                    "all connections hold %d such bytes, over the %s's limit (max_total_read_buffer=%d)",
                    conn.peer[0], conn.peer[1], size, self.total, self.owner, self.cap)


def _expire(fut: asyncio.Future, code: int, peer: tuple, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(RequestTimeoutError(f"{request_name(code)} to {peer[0]}:{peer[1]} "
                                              f"got no response in {timeout:.3g} s"))


# A JSON header's code, flag and opaque found by their names (a stock client writes them as numbers at the top
# level; a name of extFields is followed by a string, and one in a string is escaped): in a header too large to parse.
_UNREAD_FIELD = {name: re.compile(rb'"%s"\s*:\s*(-?\d{1,11})[\s,}]' % name.encode())
                 for name in ("code", "flag", "opaque")}


def _unread_fields(frame: bytes) -> tuple[int, int | None, int]:
    """(code, opaque or None, flag) of a frame whose header is not parsed, found without parsing it: at their
    fixed places in a ROCKETMQ header, by their names in a JSON one (a few scans at memchr speed: 15 MB in ms)."""
    header_len = int.from_bytes(frame[5:8], "big")
    if frame[4] == 1:           # SerializeType.ROCKETMQ: code (2), language (1), version (2), opaque (4), flag (4)
        if header_len < 13:
            return 0, None, 0
        return (int.from_bytes(frame[8:10], "big", signed=True), int.from_bytes(frame[13:17], "big", signed=True),
                int.from_bytes(frame[17:21], "big", signed=True))
    header = memoryview(frame)[8:8 + header_len]
    found = {}
    for name, pattern in _UNREAD_FIELD.items():
        # (fastjson writes code first and flag and opaque after extFields, the bulk: their ends are looked at first)
        match = (pattern.search(header, 0, 4096) or pattern.search(header, max(0, header_len - 4096))
                 or pattern.search(header))
        value = int(match.group(1)) if match else None
        found[name] = value if value is not None and -(1 << 31) <= value < (1 << 31) else None
    return found["code"] or 0, found["opaque"], found["flag"] or 0


def _best_effort_opaque(frame: bytes) -> int | None:
    """The opaque of a frame whose header failed validation, if a JSON header still parses; None also for a
    oneway request or a response (by its flag), which are never answered: their peer awaits nothing there."""
    try:
        header_len = int.from_bytes(frame[4:8], "big") & 0xFFFFFF
        obj = json.loads(bytes(frame[8:8 + header_len]))
        if not isinstance(obj, dict):
            return None
        opaque, flag = obj.get("opaque"), obj.get("flag")
        if isinstance(flag, str) and flag.strip().lstrip("-").isdigit():
            flag = int(flag)
        if isinstance(flag, int) and flag & (FLAG_ONEWAY | FLAG_RESPONSE):
            return None
        if isinstance(opaque, int) and not isinstance(opaque, bool) and -(1 << 31) <= opaque < (1 << 31):
            return opaque
    except (ValueError, UnicodeDecodeError, RecursionError):
        pass
    return None


async def open_connection(host: str, port: int, handler: Handler | None = None, *, timeout: float = 3.0,
                          **kwargs) -> RemotingConnection:
    loop = asyncio.get_running_loop()
    try:
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: RemotingConnection(handler, client=True, **kwargs), host, port), timeout)
    except asyncio.TimeoutError:
        raise RequestTimeoutError(f"connecting to {host}:{port} timed out after {timeout:.3g} s") from None
    except OSError as exc:
        raise ConnectionClosedError(f"cannot connect to {host}:{port}: {exc}") from None
    return conn


class ConnectionPool:
    """One connection per "host:port", opened on first use and re-opened after it closes.

    The clients use it for name-server and broker traffic; ``handler`` answers
    requests the server sends (CHECK_TRANSACTION_STATE, NOTIFY_CONSUMER_IDS_CHANGED).
    """

    def __init__(self, handler: Handler | None = None, *, connect_timeout: float = 3.0,
                 sign: Callable[[RemotingCommand], None] | None = None):
        self.handler = handler
        self.sign = sign
        self.connect_timeout = connect_timeout
        self._conns: dict[str, RemotingConnection] = {}
        # addr -> the connect under way: every caller waiting for that connection shares it, so each fails
        # within one connect timeout when the peer cannot be reached (queued on a lock, each made its own
        # attempt after the one before it had timed out: the n-th waited n connect timeouts)
        self._connecting: dict[str, asyncio.Task] = {}
        self._closed = False
        # on_lost(addr): a connection this pool opened closed, other than by close(): the peer went away, or the
        # connection was closed on a malformed frame, the address's current one or one already replaced (see _lost)
        self.on_lost: Callable[[str], None] | None = None

    async def get(self, addr: str) -> RemotingConnection:
        if self._closed:        # a late send, check answer or heartbeat must not reopen what close() closed
            raise ConnectionClosedError(f"connection pool is closed: not connecting to {addr}")
        conn = self._conns.get(addr)
        if conn is not None and conn.is_open:
            return conn
        connecting = self._connecting.get(addr)
        if connecting is None:
            connecting = self._connecting[addr] = asyncio.get_running_loop().create_task(self._connect(addr))
            connecting.add_done_callback(functools.partial(self._connect_done, addr))
        return await asyncio.shield(connecting)       # one caller cancelled does not cancel the others' connect

    def _connect_done(self, addr: str, task: asyncio.Task) -> None:
        if self._connecting.get(addr) is task:
            del self._connecting[addr]
        if not task.cancelled():
            task.exception()    # retrieved: when every waiter was cancelled, its failure is no loop error

    async def _connect(self, addr: str) -> RemotingConnection:
        host, _, port = addr.rpartition(":")
        conn = await open_connection(host, int(port), self.handler, timeout=self.connect_timeout,
                                     sign=self.sign, frames_per_turn=CLIENT_FRAMES_PER_TURN,
                                     on_close=functools.partial(self._lost, addr))
        if self._closed:
            conn.abort()
            raise ConnectionClosedError(f"connection pool closed while connecting to {addr}")
        # Closed connections go when another is made: kept, a client long in service held one for every broker
        # address it ever used (brokers that moved, were replaced or scaled in), each with its read buffer.
        for gone in [a for a, c in self._conns.items() if not c.is_open]:
            del self._conns[gone]
        self._conns[addr] = conn
        return conn

    def _lost(self, addr: str, conn: RemotingConnection) -> None:
        # Every connection's, the address's current one or not: one closed by us (a malformed frame) ends only once
        # its write buffer drains, and a new one may be made meanwhile, but its peer drops what it knew of this
        # client over it (a broker: the consumer's or producer's channel) only then, and learns it again only from
        # a heartbeat. on_lost tells a replaced one by ``cached(addr)``: the newer connection, open.
        if not self._closed and self.on_lost is not None:
            self.on_lost(addr)

    @property
    def closed(self) -> bool:
        """close() was called: the pool opens no connection any more."""
        return self._closed

    def cached(self, addr: str) -> RemotingConnection | None:
        """The open connection to ``addr``, or None (then ``get`` opens one): a send's fast path."""
        conn = self._conns.get(addr)
        return conn if conn is not None and conn.is_open else None

    async def request(self, addr: str, cmd: RemotingCommand, timeout: float = 3.0) -> RemotingCommand:
        conn = await self.get(addr)
        return await conn.request(cmd, timeout)

    async def oneway(self, addr: str, cmd: RemotingCommand) -> None:
        conn = await self.get(addr)
        conn.oneway(cmd)

    def connections(self) -> list[RemotingConnection]:
        return [c for c in self._conns.values() if c.is_open]

    async def settle(self, timeout: float) -> None:
        """Wait, up to ``timeout`` s, for the answers to every request in flight now (a client's shutdown:
        closed under them, requests the peer carried out were reported failed)."""
        waiting = [fut for conn in self._conns.values() for fut, *_ in conn._pending.values() if not fut.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout)

    async def close(self) -> None:
        """Close every connection; the pool opens none after this (``get`` raises ConnectionClosedError)."""
        self._closed = True
        conns = list(self._conns.values())
        self._conns.clear()
        for conn in conns:
            conn.close()
        for conn in conns:
            try:
                await asyncio.wait_for(conn.closed.wait(), 1.0)
            except asyncio.TimeoutError:
                conn.abort()


async def finish_within(tasks, grace_s: float) -> list:
    """Give ``tasks`` up to ``grace_s`` seconds to finish, then cancel those still running (at once when
    ``grace_s`` <= 0): the clients' shutdowns and hand-overs. Returns the ones cancelled; the caller still
    gathers them."""
    late = list(tasks)
    if late and grace_s > 0:
        _, pending = await asyncio.wait(late, timeout=grace_s)
        late = [t for t in late if t in pending]
    for task in late:
        task.cancel()
    return late


# A request refused for its header (a field not a number, one missing): logged at most every REFUSAL_LOG_GAP_S a request
# code, with how many went unlogged since. A line each, 300 oneway ENDs of commitOrRollback=COMMIT wrote 300 lines, as
# many as a client cared to send, each quoting the field's value whole (up to a frame, 16 MiB): now cut to
# REFUSAL_LOG_CHARS.
REFUSAL_LOG_GAP_S = 10.0
REFUSAL_LOG_CHARS = 512
_refusals_logged: dict[str, list] = {}      # request name ("other" for unknown codes) -> [when logged, unlogged since]
_rejections_logged: dict[str, list] = {}    # connections closed for malformed input: "malformed" -> the same


def _gate(logged: dict[str, list], key: str, now: float) -> int | None:
    """None while ``key`` was logged less than REFUSAL_LOG_GAP_S ago (counted unlogged), else how many went unlogged
    since its last line (the caller logs now)."""
    seen = logged.get(key)
    if seen is not None and now - seen[0] < REFUSAL_LOG_GAP_S:
        seen[1] += 1
        return None
    logged[key] = [now, 0]
    return seen[1] if seen is not None else 0


def _clipped(exc: BaseException) -> str:
    text = str(exc)
    return f"{text[:REFUSAL_LOG_CHARS]}... ({len(text)} characters)" if len(text) > REFUSAL_LOG_CHARS else text


def _log_refusal(now: float, cmd: RemotingCommand, peer: tuple, exc: BaseException) -> None:
    name = request_name(cmd.code)
    if name.lstrip("-").isdigit():          # a made-up code: one key for them all, so the dict stays bounded
        name = "other"
    unlogged = _gate(_refusals_logged, name, now)
    if unlogged is None:
        return
    log.info("%s from %s:%s refused: %s (logged at most every %d s a request code%s)", request_name(cmd.code),
             peer[0], peer[1], _clipped(exc), REFUSAL_LOG_GAP_S,
             f"; {unlogged} more refused since the last line" if unlogged else "")


def jittered(delay: float) -> float:
    """A back-off of ``delay`` seconds spread at random over its second half. Clients whose broker went down failed
    at one instant and, backing off alike (0.5, 1, 2, 4 s), retried at one instant too: every client of a restarted
    broker reconnected and heartbeat in the same tick, each round. Never longer than ``delay``."""
    return delay * random.uniform(0.5, 1.0)


async def wait_within(aw, timeout: float | None):
    """``await aw`` for at most ``timeout`` seconds (TimeoutError past it), as ``asyncio.wait_for``, but
    never losing a cancellation: on Python 3.11 wait_for returns the result when ``aw`` completes just as
    the waiting task is cancelled, and the cancel is gone. A loop waiting on an event that is set while
    shutdown cancels it then went on for good, and shutdown waited for it for good (a push consumer whose
    rebalance loop kept it in its group, owning queues no one pulled)."""
    async with asyncio.timeout(timeout):
        return await aw
