"""Store outcomes as RocketMQ response codes (spec 3.4 step 10)."""
from __future__ import annotations

from protocol.codes import ResponseCode

from .store import PutStatus

_CODES = {
    PutStatus.PUT_OK: ResponseCode.SUCCESS,
    PutStatus.MESSAGE_ILLEGAL: ResponseCode.MESSAGE_ILLEGAL,
    PutStatus.SERVICE_NOT_AVAILABLE: ResponseCode.SERVICE_NOT_AVAILABLE,
}


def response_code(result) -> int:
    return _CODES.get(result.status, ResponseCode.SYSTEM_ERROR)


def put_failure_response(cmd, result):
    return cmd.response(response_code(result), f"store refused the message: {result.status.name}")
