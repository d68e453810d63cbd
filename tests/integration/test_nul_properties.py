"""A NUL in the properties of a message is refused (MESSAGE_ILLEGAL) and nothing is stored.

Segments are zero-filled before they are written, so start-up reads a NUL in a record's properties as
a page a crash never wrote and cuts the record (tests/fault/test_torn_properties.py). Stored, an
acknowledged message holding one would be lost at the next crash, or stop the next start-up.
"""
from __future__ import annotations

import pytest

from protocol.codes import RequestCode, ResponseCode
from protocol.message import encode_batch
from tests.integration.test_batch_flag import _entries, _props, _pull_all, _send, _v1_fields
from tests.support.bounded import bounded

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("where", ["message", "batch header", "batch entry", "reply"])
@bounded(30)
async def test_properties_holding_a_nul_are_refused(broker, where):
    topic = "NulProps" + where.replace(" ", "")
    bad = _props(KEYS="a\x00b", TAGS="T")
    if where == "message":
        code, fields, body = RequestCode.SEND_MESSAGE, _v1_fields(topic, 0, bad), b"x"
    elif where == "reply":
        code, fields, body = RequestCode.SEND_REPLY_MESSAGE, _v1_fields(topic, 0, bad), b"x"
    else:
        entries = _entries(3, "nul")
        if where == "batch entry":
            entries[1] = (0, b"y", bad)
        header = bad if where == "batch header" else _props(WAIT="true")
        code, fields, body = RequestCode.SEND_BATCH_MESSAGE, _v1_fields(topic, 0, header, batch="true"), \
            encode_batch(entries)
    reply = await _send(broker, code, fields, body)
    assert reply.code == ResponseCode.MESSAGE_ILLEGAL and "NUL" in reply.remark, (reply.code, reply.remark)
    good = await _send(broker, RequestCode.SEND_MESSAGE, _v1_fields(topic, 0, _props(KEYS="ab")), b"ok")
    assert good.code == ResponseCode.SUCCESS, good.remark
    assert [m.body for m in await _pull_all(broker, topic, 0, "CG_nul")] == [b"ok"]
