"""The one exception tree of txmq (ARCHITECTURE section 4).

    BrokerError
     +-- ProtocolError            malformed bytes; .response_code says what to answer
     |    +-- FrameError          framing: bad length, oversized frame, header past its frame
     |    +-- HeaderError         a header that does not parse, or a field of the wrong type
     |    +-- RecordError         a store record or batch body that does not parse
     +-- ResponseError            the peer answered with a non-success code; one subclass a code
     +-- RequestTimeoutError      no answer in time (also a TimeoutError)
     |    +-- MaybeStoredError    a send failed after an attempt that reached the broker got no answer
     |         +-- MaybeStoredClosedError   ... and its last attempt met a closed connection (also a
     |                                      ConnectionClosedError, what such a send raised before)
     +-- ConnectionClosedError    the connection went away with requests pending
     |    +-- ClientClosedError   the client is shutting down (or shut down): the request was not sent
     +-- StoreError               a segment file is damaged or unwritable (never on the wire)
     |    +-- CorruptRecordError  a stored record whose body no longer matches its BODYCRC
     +-- ConfigError              a setting is wrong (also a ValueError)

Expected outcomes (a send that was flushed late, a pull that found nothing) are
values, not exceptions.
"""
from __future__ import annotations

from .codes import ResponseCode


class BrokerError(Exception):
    """Root of every error txmq raises on purpose."""


class ProtocolError(BrokerError):
    """Bytes that do not follow the protocol. The peer is told with ``response_code``."""

    response_code: int = ResponseCode.SYSTEM_ERROR

    def __init__(self, message: str, *, response_code: int | None = None):
        super().__init__(message)
        if response_code is not None:
            self.response_code = response_code


class FrameError(ProtocolError):
    """The length prefix or header-length word cannot be right."""


class HeaderError(ProtocolError):
    """A command header (JSON or ROCKETMQ binary) or one of its fields is malformed."""


class HeaderTooLargeError(HeaderError):
    """A header longer than MAX_HEADER_SIZE: refused from its length, not parsed (as RocketMQ refuses a send's
    properties past Short.MAX_VALUE characters: MESSAGE_ILLEGAL)."""

    response_code = ResponseCode.MESSAGE_ILLEGAL


class RecordError(ProtocolError):
    """A store record or a batch body is malformed."""

    response_code = ResponseCode.MESSAGE_ILLEGAL


class ResponseError(BrokerError):
    """The peer answered a request with a non-success code."""

    code: int = ResponseCode.SYSTEM_ERROR
    retriable: bool = False

    def __init__(self, remark: str | None = None, *, code: int | None = None):
        if code is not None:
            self.code = code
        self.remark = remark or ""
        name = _code_name(self.code)
        super().__init__(f"{name} ({self.code}): {self.remark}" if self.remark else f"{name} ({self.code})")


def _code_name(code: int) -> str:
    try:
        return ResponseCode(code).name
    except ValueError:
        return "UNKNOWN_RESPONSE_CODE"


_BY_CODE: dict[int, type[ResponseError]] = {}


def _response_error(name: str, code: int, retriable: bool) -> type[ResponseError]:
    cls = type(name, (ResponseError,), {"code": code, "retriable": retriable, "__doc__": f"Response code {code}."})
    cls.__module__ = __name__
    _BY_CODE[code] = cls
    return cls


# Retriable follows the Java producer's retry set (spec 2.2): another queue or a
# later attempt can succeed.
SystemError_ = _response_error("SystemErrorResponse", ResponseCode.SYSTEM_ERROR, True)
SystemBusyError = _response_error("SystemBusyError", ResponseCode.SYSTEM_BUSY, True)
RequestCodeNotSupportedError = _response_error(
    "RequestCodeNotSupportedError", ResponseCode.REQUEST_CODE_NOT_SUPPORTED, False)
FlushDiskTimeoutError = _response_error("FlushDiskTimeoutError", ResponseCode.FLUSH_DISK_TIMEOUT, False)
MessageIllegalError = _response_error("MessageIllegalError", ResponseCode.MESSAGE_ILLEGAL, False)
ServiceNotAvailableError = _response_error("ServiceNotAvailableError", ResponseCode.SERVICE_NOT_AVAILABLE, True)
NoPermissionError = _response_error("NoPermissionError", ResponseCode.NO_PERMISSION, True)
TopicNotExistError = _response_error("TopicNotExistError", ResponseCode.TOPIC_NOT_EXIST, True)
QueryNotFoundError = _response_error("QueryNotFoundError", ResponseCode.QUERY_NOT_FOUND, False)
SubscriptionNotExistError = _response_error(
    "SubscriptionNotExistError", ResponseCode.SUBSCRIPTION_NOT_EXIST, True)
SubscriptionGroupNotExistError = _response_error(
    "SubscriptionGroupNotExistError", ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST, False)
FlowControlError = _response_error("FlowControlError", ResponseCode.FLOW_CONTROL, True)


def error_for_code(code: int, remark: str | None = None) -> ResponseError:
    """The ResponseError instance for a response code (unknown codes keep their number)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return ResponseError(remark, code=code)
    return cls(remark)


class RequestTimeoutError(BrokerError, TimeoutError):
    """A request got no response within its timeout."""


class MaybeStoredError(RequestTimeoutError):
    """A send failed, but one of its attempts was sent and got no answer (the connection closed under it, or
    time ran out): the broker may have stored the message, under ``msg_id`` (its UNIQ_KEY; a batch's are
    comma-joined). Whatever the later attempts met is its ``__cause__``: a refusal or "cannot connect" from
    them says nothing of the attempt that went unanswered, so sending again should keep ``msg_id`` or dedupe."""

    def __init__(self, message: str, *, msg_id: str = ""):
        super().__init__(message)
        self.msg_id = msg_id


class ConnectionClosedError(BrokerError):
    """The connection closed while a request was waiting or before it was sent."""


class ClientClosedError(ConnectionClosedError):
    """The client's shutdown has begun (or ended): a send begun now is refused, not sent. A ConnectionClosedError,
    what a send after shutdown raised before (its connections closed)."""


class MaybeStoredClosedError(MaybeStoredError, ConnectionClosedError):
    """A MaybeStoredError whose last attempt met a closed connection ("cannot connect", closed under it):
    such a send raised ConnectionClosedError before, and a caller catching that still catches it."""


class StoreError(BrokerError):
    """A segment file is damaged or cannot be written. Never crosses the wire."""

    def __init__(self, message: str, *, segment: str | None = None, position: int | None = None):
        where = ""
        if segment is not None:
            where = f" [segment {segment}" + (f" at byte {position}" if position is not None else "") + "]"
        super().__init__(message + where)
        self.segment = segment
        self.position = position


class CorruptRecordError(StoreError):
    """A record read from the commit log fails its body CRC (bits flipped on the disk since it was written), or
    its topic or properties, which no CRC covers, are damaged (a page zeroed, a topic byte flipped:
    protocol.record.record_intact).

    Raised by the reads that copy a record elsewhere (a commit, a retry, a dead letter, a scheduled delivery):
    copied, the damage would be re-encoded under a fresh, valid CRC and pass for sound from then on."""

    def __init__(self, offset: int, *, segment: str | None = None, position: int | None = None):
        super().__init__(f"the record at commit-log offset {offset} is corrupt: its body no longer matches its "
                         "BODYCRC, its topic is no topic name, or its properties are zeroed", segment=segment,
                         position=position)
        self.offset = offset


class ConfigError(BrokerError, ValueError):
    """A configuration value is invalid."""
