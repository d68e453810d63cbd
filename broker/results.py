"""Store outcomes as RocketMQ responses (spec 3.4 step 10), and the send response on its fast path."""
from __future__ import annotations

from functools import lru_cache

from protocol.codes import FLAG_RESPONSE, ResponseCode, SerializeType
from protocol.command import RemotingCommand
from protocol.frame import PREFIX as _PREFIX

from .store import PutStatus

_CODES = {
    PutStatus.PUT_OK: ResponseCode.SUCCESS,
    PutStatus.MESSAGE_ILLEGAL: ResponseCode.MESSAGE_ILLEGAL,
    PutStatus.SERVICE_NOT_AVAILABLE: ResponseCode.SERVICE_NOT_AVAILABLE,
}


def response_code(result) -> int:
    return _CODES.get(result.status, ResponseCode.SYSTEM_ERROR)


def put_failure_response(cmd, result):
    return cmd.response(response_code(result), result.remark or f"store refused the message: {result.status.name}")


def send_ok(ctx, cmd, msg_id: str, qid: int, queue_offset: int, code: int = ResponseCode.SUCCESS):
    """SUCCESS with the fields every client reads (the Java client dereferences MSG_REGION and TRACE_ON).

    ``code``: a stored message's other answers fill the same header (spec 3.4 item 10): SLAVE_NOT_AVAILABLE
    and FLUSH_SLAVE_TIMEOUT from a SYNC_MASTER."""
    if cmd.serialize_type == SerializeType.JSON and "," not in msg_id and code == ResponseCode.SUCCESS:
        return _SendOk(_send_ok_template(ctx.config.region_id) % (msg_id, qid, queue_offset, cmd.opaque))
    return RemotingCommand(code, opaque=cmd.opaque, flag=FLAG_RESPONSE, ext_fields={
        "msgId": msg_id, "queueId": str(qid), "queueOffset": str(queue_offset),
        "MSG_REGION": ctx.config.region_id, "TRACE_ON": "true"}, serialize_type=cmd.serialize_type)


@lru_cache(maxsize=4)
def _send_ok_template(region: str) -> str:
    # The JSON RemotingCommand.encode writes for this response, with the four values as holes:
    # a single send answers with the same bytes but for an hex id and three numbers.
    probe = RemotingCommand(ResponseCode.SUCCESS, opaque=-7777777, flag=FLAG_RESPONSE, ext_fields={
        "msgId": "MSGIDHOLE", "queueId": "-8888888", "queueOffset": "-9999999", "MSG_REGION": region,
        "TRACE_ON": "true"}).encode_header().decode()
    return (probe.replace("%", "%%").replace("MSGIDHOLE", "%s").replace("-8888888", "%d")
            .replace("-9999999", "%d").replace("-7777777", "%d"))


class _SendOk:
    """A send response whose JSON header is already text: all the connection needs is encode_parts."""

    __slots__ = ("header",)
    code = ResponseCode.SUCCESS

    def __init__(self, header: str):
        self.header = header.encode()

    def encode_parts(self) -> list:
        header = self.header
        return [_PREFIX.pack(4 + len(header), len(header)) + header]
