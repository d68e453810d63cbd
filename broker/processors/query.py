"""Message lookup by key: QUERY_MESSAGE (12), by UNIQ_KEY too (the ``_UNIQUE_KEY_QUERY`` ext field).

Request header (QueryMessageRequestHeader): topic, key, maxNum, beginTimestamp, endTimestamp.
Reply: the stored records of the matches concatenated, oldest first (as a pull body), with
indexLastUpdateTimestamp / indexLastUpdatePhyoffset (the index's newest entry) in the header;
QUERY_NOT_FOUND when nothing matches. Unlike RocketMQ, every match is checked against its
record's topic, KEYS, UNIQ_KEY and store time, so a hash collision never returns another key's
message and [beginTimestamp, endTimestamp] is kept to the millisecond, both ends inclusive. A query reads at
most MAX_QUERY_CHECKS (4,096) records of its key's hash and MAX_QUERY_READS (16,384) index entries of any hash:
past that (other keys with the same hashCode or index slot, or the key's own outside the range), the answer is
what was found, and its remark says the search stopped. While indexing is stopped (txmq_index_failed: a full
disk, or a slot table the disk has no room for) or still catching up with the commit log (after a start that lost
or rebuilt the index, or a long stop) the remark says from which commit-log offset messages are not searched,
whatever the code. A query the index's thread has not answered once it is seen held
(txmq_index_stalled_seconds past 10 s: a write there hangs) is answered SYSTEM_ERROR, saying so.
"""
from __future__ import annotations

from protocol.codes import QUERY_NOT_FOUND_REMARK, ResponseCode
from protocol.errors import CorruptRecordError, StoreError

UNIQUE_KEY_QUERY = "_UNIQUE_KEY_QUERY"      # MixAll.UNIQUE_MSG_QUERY_FLAG
DEFAULT_QUERY_MAX_NUM = 32                  # BrokerConfig.defaultQueryMaxNum
_FOREVER = (1 << 63) - 1


async def query_message(ctx, conn, cmd):
    topic = cmd.str_field("topic", required=True)
    key = cmd.str_field("key", required=True)
    max_num = cmd.int_field("maxNum", DEFAULT_QUERY_MAX_NUM)
    begin = cmd.int_field("beginTimestamp", 0)
    end = cmd.int_field("endTimestamp", _FOREVER)
    if cmd.ext_fields.get(UNIQUE_KEY_QUERY) == "true":
        max_num = DEFAULT_QUERY_MAX_NUM
    if ctx.index is None:
        return cmd.response(ResponseCode.SYSTEM_ERROR, "the message index is off on this broker "
                            "(message_index_enable=false)")
    try:
        found, last_ts, last_phy, cut, unsearched = await ctx.index.query(topic, key, max_num, begin, end)
    except StoreError as exc:       # its thread held by a write that hangs (said by the gauge loop), or it stopped
        return cmd.response(ResponseCode.SYSTEM_ERROR, str(exc))
    header = {"indexLastUpdateTimestamp": last_ts, "indexLastUpdatePhyoffset": last_phy}
    stopped = (f"the search stopped after {ctx.index.max_checks} records of the key's hash or {ctx.index.max_reads} "
               "index entries (other keys share its hashCode or its index slot): older matches are not answered; "
               "narrow beginTimestamp/endTimestamp") if cut else None
    # Indexing stopped (a full disk, a slot table refused near disk_force_clean_ratio) or still catching up with the
    # commit log (a start after the index was lost or rebuilt, a long stop): the answer is from what was indexed so
    # far; unsaid, a stored key was answered "can not find message" and `admin query-key` "0 message(s)".
    behind = None
    if unsearched is not None:
        behind = (f"indexing is stopped (txmq_index_failed; see the broker's log): messages stored from commit-log "
                  f"offset {unsearched} on are not searched until it catches up" if ctx.index.stopped else
                  f"the message index is catching up with the commit log (txmq_index_behind_bytes): messages "
                  f"stored from commit-log offset {unsearched} on are not searched yet; ask again")
    views, corrupt = [], 0
    for phy in sorted(found):
        try:
            view = ctx.store.verified_record(phy, "query")
        except CorruptRecordError:      # counted and logged by the store; never served as if sound
            corrupt += 1
            continue
        if view is not None:
            views.append(view)
    if not views and corrupt:
        # (a search cut short says so here too: older matches, sound ones, may be left unread)
        return cmd.response(ResponseCode.SYSTEM_ERROR, "; ".join(filter(None, (
            f"{corrupt} matching message(s) are corrupt on the broker's disk (their bodies fail their CRC; see the "
            "broker's log)", stopped, behind))), header)
    if not views:
        return cmd.response(ResponseCode.QUERY_NOT_FOUND,
                            "; ".join(filter(None, (stopped, behind))) or QUERY_NOT_FOUND_REMARK, header)
    left_out = f"{corrupt} corrupt match(es) left out (see the broker's log)" if corrupt else None
    remark = "; ".join(filter(None, (left_out, stopped, behind))) or None
    return cmd.response(ResponseCode.SUCCESS, remark, header, body=views)
