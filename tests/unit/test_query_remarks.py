"""QUERY_MESSAGE's remarks: what the index's answer leaves out is said, whatever else the reply says."""
from __future__ import annotations

from types import SimpleNamespace

from broker.processors.query import query_message
from broker.store.index import QueryResult
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import CorruptRecordError
from tests.support.bounded import bounded


class _Index:
    max_checks, max_reads = 4096, 16384
    stopped, covered = False, 0

    async def query(self, topic, key, max_num, begin, end):
        return QueryResult([1000], 0, 0, True)       # one match (a kept damaged record), and more left unread


class _Store:
    def verified_record(self, phy, read):
        raise CorruptRecordError(phy)


@bounded(10)
async def test_a_cut_search_whose_matches_are_all_corrupt_says_it_stopped():
    """A query the index cut at max_checks/max_reads (other keys of its hash or slot) whose only match found is a
    damaged record (one kept in place: --keep-corrupt-records) was answered SYSTEM_ERROR naming the corrupt match
    alone: the remark that the search stopped, older (sound) matches unanswered, was dropped, and `admin
    query-key` said the key's one message is corrupt."""
    ctx = SimpleNamespace(index=_Index(), store=_Store())
    cmd = RemotingCommand.request(RequestCode.QUERY_MESSAGE, {"topic": "T", "key": "K", "maxNum": 32,
                                                              "beginTimestamp": 0, "endTimestamp": 1 << 62})
    resp = await query_message(ctx, None, cmd)
    assert resp.code == ResponseCode.SYSTEM_ERROR and "corrupt" in resp.remark, resp.remark
    assert "the search stopped" in resp.remark, resp.remark


class _CatchingUp(_Index):
    async def query(self, topic, key, max_num, begin, end):
        return QueryResult([], 0, 0, False, 4096)     # nothing found in what is indexed: the log from 4096 unsearched


@bounded(10)
async def test_a_query_answered_while_the_index_catches_up_says_what_it_did_not_search():
    """A query answered while the index catches up with the commit log (a start after index/ was lost or its files
    found damaged) was QUERY_NOT_FOUND "can not find message" for a key stored past what was indexed: `admin
    query-key` said 0 messages, mqadmin queryMsgByKey nothing. The remark says the index is catching up and from
    which offset it did not search."""
    ctx = SimpleNamespace(index=_CatchingUp(), store=_Store())
    cmd = RemotingCommand.request(RequestCode.QUERY_MESSAGE, {"topic": "T", "key": "K", "maxNum": 32,
                                                              "beginTimestamp": 0, "endTimestamp": 1 << 62})
    resp = await query_message(ctx, None, cmd)
    assert resp.code == ResponseCode.QUERY_NOT_FOUND, resp.remark
    assert "catching up" in resp.remark and "offset 4096" in resp.remark, resp.remark
