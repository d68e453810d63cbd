"""``python -m broker admin`` commands for finding messages and operating consumers (broker/admin.py parses).

    query-key TOPIC KEY [--max N] [--begin MS] [--end MS]   messages whose KEYS (or UNIQ_KEY) hold KEY
    show-msg ID [--topic T]                 a message by offset message id, else by UNIQ_KEY
    consumer-progress GROUP [--topic T]     per queue: broker offset, consumer offset, lag, last consumed
    reset-offset GROUP TOPIC --timestamp T  move the group to the first message stored at T (ms, ISO
                                            time, 'now', or 'latest'); live consumers follow at once
    reset-offset GROUP TOPIC --queue Q --offset N   move only queue Q, to offset N (past a corrupt record)
    topic-status TOPIC                      per queue: min / max offset, last store time; who consumes
    broker-status                           the broker's runtime info

Each prints a table, or JSON with ``--json``. Exit status: 0 done, 1 refused or not found, 2 bad input.
"""
from __future__ import annotations

import datetime as dt
import json
import sys

from protocol.admin_bodies import decode_mq_table
from protocol.codes import RequestCode as R
from protocol.codes import QUERY_NOT_FOUND_REMARK, ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import HeaderError
from protocol.message import MAX_INFLATED_BODY, MessageExt, decode_offset_msg_id, decode_records, inflate

from .topics import DLQ_PREFIX, RETRY_PREFIX

COMMANDS = ("query-key", "show-msg", "consumer-progress", "reset-offset", "topic-status", "broker-status",
            "delete-group")


class Refused(Exception):
    """The broker said no: the message is the remark, with the code."""


def add_parsers(sub) -> None:
    p = sub.add_parser("query-key", help="messages of TOPIC whose KEYS or UNIQ_KEY hold KEY")
    p.add_argument("topic")
    p.add_argument("key")
    p.add_argument("--max", type=int, default=64)
    p.add_argument("--begin", type=int, default=0, help="store time from (ms)")
    p.add_argument("--end", type=int, default=(1 << 63) - 1, help="store time to (ms)")
    p = sub.add_parser("show-msg", help="one message by offset message id or UNIQ_KEY")
    p.add_argument("id")
    p.add_argument("--topic", help="topic of a UNIQ_KEY (default: search every topic)")
    p = sub.add_parser("consumer-progress", help="a group's offsets and lag per queue")
    p.add_argument("group")
    p.add_argument("--topic")
    p = sub.add_parser("reset-offset", help="move a group's offsets on a topic to a time")
    p.add_argument("group")
    p.add_argument("topic")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--timestamp", help="ms since the epoch, ISO time (local), 'now' or 'latest'")
    to.add_argument("--queue", type=int, help="move only this queue, to --offset")
    p.add_argument("--offset", type=int, help="with --queue: the queue offset to move to")
    p.add_argument("--no-force", action="store_true", help="only move offsets back, never forward (a queue "
                   "the group has no offset for is left as it is)")
    p = sub.add_parser("topic-status", help="a topic's queues and consumers")
    p.add_argument("topic")
    sub.add_parser("broker-status", help="the broker's runtime info")
    p = sub.add_parser("delete-group", help="forget a consumer group that is gone: its config, committed offsets "
                       "and series, and its %%RETRY%% and %%DLQ%% topics")
    p.add_argument("group")
    p.add_argument("--keep-offsets", action="store_true", help="keep its committed offsets")
    p.add_argument("--keep-topics", action="store_true", help="keep its %%RETRY%% and %%DLQ%% topics")
    p.add_argument("--force", action="store_true", help="delete it even while consumers of it are connected")
    for name in COMMANDS:
        sub.choices[name].add_argument("--json", action="store_true")
    for name in ("query-key", "show-msg"):
        sub.choices[name].add_argument(
            "--max-inflated-body", type=_positive, default=MAX_INFLATED_BODY, metavar="BYTES",
            help="a compressed body is inflated up to this many bytes; past it (a zip bomb) it is shown as "
                 f"stored (default {MAX_INFLATED_BODY})")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


# Below this, a "ms since the epoch" is early 1973 as ms but the year 5138 as seconds: it was meant as seconds.
SECONDS_LOOK_ALIKE = 100_000_000_000


def parse_time(text: str) -> int:
    """ms since the epoch from '1700000000000', 'now', 'latest' (-1), ISO '2024-05-01T10:00:00[.123]' (local)
    or RocketMQ's 'yyyy-MM-dd#HH:mm:ss:SSS'."""
    t = text.strip()
    if t == "now":
        return int(dt.datetime.now().timestamp() * 1000)
    if t in ("latest", "-1"):
        return -1
    if t.isdigit():
        ms = int(t)
        if 0 < ms < SECONDS_LOOK_ALIKE:     # read as ms it is a moment of 1970: every offset would go back
            raise ValueError(f"--timestamp {text!r} looks like seconds since the epoch; give milliseconds "
                             f"({ms * 1000}), or 0 for the earliest offsets")
        return ms
    if "#" in t:
        day, _, clock = t.partition("#")
        h, m, s, ms = (clock.split(":") + ["0", "0", "0", "0"])[:4]
        t = f"{day}T{int(h):02d}:{int(m):02d}:{int(s):02d}.{int(ms):03d}"
    try:
        return int(dt.datetime.fromisoformat(t).timestamp() * 1000)
    except ValueError:
        raise ValueError(f"--timestamp {text!r}: give ms, ISO time, 'now' or 'latest'") from None


def when(ms: int) -> str:
    if ms <= 0:
        return "-"
    # Local time with its offset: read beside the UTC reports, or on another host, it says which zone it is in.
    return dt.datetime.fromtimestamp(ms / 1000).astimezone().isoformat(sep=" ", timespec="milliseconds")


def table(cols: list[str], rows: list[dict]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


async def run(args, call) -> int:
    """Run one command; ``call(cmd)`` sends a request and returns the response."""
    fn = {"query-key": query_key, "show-msg": show_msg, "consumer-progress": consumer_progress,
          "reset-offset": reset_offset, "topic-status": topic_status, "broker-status": broker_status,
          "delete-group": delete_group}[args.action]
    return await fn(args, call)


def refused(resp: RemotingCommand) -> str:
    """A refusal as said on stderr: its code and remark; a request the server does not know, why (else "refused (3):
    request type 901 not supported" alone, pointed at a name server's port or a stock RocketMQ broker)."""
    said = f"refused ({resp.code}): {resp.remark}"
    if resp.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED:
        said += ("\nthe server at --broker does not answer this request: not a txmq broker (a name server's port, 9876 "
                 "by default, or a stock RocketMQ broker?); give a txmq broker's address (port 10911 by default)")
    return said


async def _ok(call, code, fields=None, body=b"") -> RemotingCommand:
    resp = await call(RemotingCommand.request(code, fields, body))
    if resp.code != ResponseCode.SUCCESS:
        raise Refused(refused(resp))
    return resp


def _message(m: MessageExt, with_body: bool = False, max_inflated: int = MAX_INFLATED_BODY) -> dict:
    out = {"msg_id": m.msg_id, "offset_msg_id": m.offset_msg_id, "topic": m.topic, "queue_id": m.queue_id,
           "queue_offset": m.queue_offset, "commit_log_offset": m.physical_offset,
           "store_time": when(m.store_timestamp),
           "store_timestamp": m.store_timestamp, "keys": m.keys or "", "tags": m.tags or "",
           "body_bytes": len(m.body)}
    if with_body:
        stored_sys_flag = m.sys_flag        # as stored: inflating clears COMPRESSED
        why = inflate(m, max_inflated)      # shown as its producer sent it; a zip bomb as stored
        if why is not None:
            out["body_note"] = why
        out.update(born_time=when(m.born_timestamp), born_host="%s:%d" % m.born_host,
                   store_host="%s:%d" % m.store_host, reconsume_times=m.reconsume_times, sys_flag=stored_sys_flag,
                   properties=m.properties, body=m.body.decode("utf-8", "replace"))
    return out


async def _query(call, topic: str, key: str, max_num: int, begin: int, end: int, uniq: bool) -> list[MessageExt]:
    cmd = RemotingCommand.request(R.QUERY_MESSAGE, {"topic": topic, "key": key, "maxNum": max_num,
                                                    "beginTimestamp": begin, "endTimestamp": end})
    if uniq:
        cmd.ext_fields["_UNIQUE_KEY_QUERY"] = "true"
    resp = await call(cmd)
    if resp.code not in (ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND):
        raise Refused(refused(resp))
    # What the broker adds (the search stopped behind other keys of the hash, corrupt matches left out): unsaid,
    # "0 message(s)" told an operator the key was not there.
    if resp.remark and resp.remark != QUERY_NOT_FOUND_REMARK:
        print(f"{topic}: {resp.remark}", file=sys.stderr)
    return decode_records(resp.body_bytes()) if resp.code == ResponseCode.SUCCESS else []


async def query_key(args, call) -> int:
    found = await _query(call, args.topic, args.key, args.max, args.begin, args.end, False)
    rows = [_message(m, args.json, args.max_inflated_body) for m in found]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(table(["msg_id", "offset_msg_id", "queue_id", "queue_offset", "store_time", "keys", "tags",
                     "body_bytes"], rows))
        print(f"{len(rows)} message(s) with key {args.key!r} in {args.topic}")
    return 0 if rows else 1


async def show_msg(args, call) -> int:
    found: list[MessageExt] = []
    try:
        _host, _port, offset = decode_offset_msg_id(args.id)
    except HeaderError:
        offset = None
    if offset is not None:
        resp = await call(RemotingCommand.request(R.VIEW_MESSAGE_BY_ID, {"offset": offset}))
        if resp.code == ResponseCode.SUCCESS:
            found = [m for m in decode_records(resp.body_bytes()) if m.offset_msg_id.upper() == args.id.upper()]
    if not found:           # a UNIQ_KEY (the id a Java client shows first)
        if args.topic:
            topics = [args.topic]
        else:
            resp = await _ok(call, R.GET_ALL_TOPIC_CONFIG)
            topics = sorted(json.loads(resp.body_bytes())["topicConfigTable"])
        for topic in topics:
            found += [m for m in await _query(call, topic, args.id, 32, 0, (1 << 63) - 1, True)
                      if m.properties.get("UNIQ_KEY") == args.id]
    rows = [_message(m, True, args.max_inflated_body) for m in found]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print(f"no message with id {args.id}")
    else:
        print("\n\n".join("\n".join(f"{k:18} {v}" for k, v in r.items()) for r in rows))
    return 0 if rows else 1


async def consumer_progress(args, call) -> int:
    resp = await _ok(call, R.GET_CONSUME_STATS, {"consumerGroup": args.group, "topic": args.topic})
    obj, stats = decode_mq_table(resp.body_bytes())
    rows = [{"topic": t, "broker": b, "queue_id": q, "broker_offset": w["brokerOffset"],
             "consumer_offset": w["consumerOffset"], "lag": max(0, w["brokerOffset"] - w["consumerOffset"]),
             "last_consumed": when(w.get("lastTimestamp", 0))} for (t, b, q), w in sorted(stats.items())]
    conns = await call(RemotingCommand.request(R.GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": args.group}))
    clients = ([c["clientId"] for c in json.loads(conns.body_bytes())["connectionSet"]]
               if conns.code == ResponseCode.SUCCESS else [])
    total = sum(r["lag"] for r in rows)
    if args.json:
        print(json.dumps({"group": args.group, "queues": rows, "total_lag": total, "consume_tps": obj.get("consumeTps"),
                          "consumers": clients}, indent=1))
    else:
        print(table(["topic", "broker", "queue_id", "broker_offset", "consumer_offset", "lag", "last_consumed"], rows))
        print(f"total lag {total}; {len(clients)} consumer(s) online" + (f": {', '.join(clients)}" if clients else ""))
    return 0 if rows else 1


async def reset_offset(args, call) -> int:
    fields = {"topic": args.topic, "group": args.group, "isForce": not args.no_force}
    if args.queue is not None:
        if args.queue < 0 or args.offset is None or args.offset < 0:
            print("--queue needs --offset: the queue offset (>= 0) to move to")
            return 2
        ts = fields["timestamp"] = -1
        fields.update(queueId=args.queue, offset=args.offset)
    elif args.offset is not None:
        print("--offset goes with --queue (one queue), not --timestamp")
        return 2
    else:
        try:
            ts = fields["timestamp"] = parse_time(args.timestamp)
        except ValueError as exc:
            print(str(exc))
            return 2
    resp = await _ok(call, R.INVOKE_BROKER_TO_RESET_OFFSET, fields)
    _obj, table_ = decode_mq_table(resp.body_bytes())
    rows = [{"topic": t, "broker": b, "queue_id": q, "offset": o} for (t, b, q), o in sorted(table_.items())]
    if args.json:
        print(json.dumps({"group": args.group, "timestamp": ts, "queues": rows}, indent=1))
    elif not rows:      # --no-force, and no queue the group has an offset for
        where = args.topic if args.queue is None else f"queue {args.queue} of {args.topic}"
        print(f"group {args.group} has no offset on {where} to move back: nothing reset")
    else:
        print(table(["topic", "broker", "queue_id", "offset"], rows))
        print(f"group {args.group} reset to " + (f"offset {args.offset} of queue {args.queue}" if args.queue is not None
                                                  else when(ts) if ts > 0 else "the latest offsets"))
    return 0


async def topic_status(args, call) -> int:
    resp = await _ok(call, R.GET_TOPIC_STATS_INFO, {"topic": args.topic})
    _obj, stats = decode_mq_table(resp.body_bytes())
    rows = [{"broker": b, "queue_id": q, "min_offset": s["minOffset"], "max_offset": s["maxOffset"],
             "messages": s["maxOffset"] - s["minOffset"], "last_update": when(s["lastUpdateTimestamp"])}
            for (_t, b, q), s in sorted(stats.items())]
    who = await _ok(call, R.QUERY_TOPIC_CONSUME_BY_WHO, {"topic": args.topic})
    groups = json.loads(who.body_bytes())["groupList"]
    if args.json:
        print(json.dumps({"topic": args.topic, "queues": rows, "consumer_groups": groups}, indent=1))
    else:
        print(table(["broker", "queue_id", "min_offset", "max_offset", "messages", "last_update"], rows))
        print(f"{sum(r['messages'] for r in rows)} messages in {len(rows)} queues; consumed by: "
              f"{', '.join(groups) or 'no group'}")
    return 0


async def broker_status(args, call) -> int:
    resp = await _ok(call, R.GET_BROKER_RUNTIME_INFO)
    info = json.loads(resp.body_bytes())["table"]
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
    else:
        print(table(["key", "value"], [{"key": k, "value": v} for k, v in sorted(info.items())]))
    return 0


async def delete_group(args, call) -> int:
    """mqadmin deleteSubGroup -r true -c: the group's config and offsets, then its retry and dead-letter topics.
    Refused while consumers of the group are connected (unless --force): their retries waiting in %RETRY% and
    the dead letters in %DLQ% would go (the consumers' next heartbeat makes an empty %RETRY% again)."""
    if not args.force:
        conns = await call(RemotingCommand.request(R.GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": args.group}))
        if conns.code == ResponseCode.SUCCESS:
            clients = [c["clientId"] for c in json.loads(conns.body_bytes())["connectionSet"]]
            if clients:
                raise Refused(f"consumer group {args.group} has {len(clients)} connected consumer(s) "
                              f"({', '.join(clients[:5])}{', ...' if len(clients) > 5 else ''}): stop them "
                              "first, or give --force")
        elif conns.code != ResponseCode.CONSUMER_NOT_ONLINE:
            raise Refused(f"could not tell whether {args.group} has consumers ({conns.code}): {conns.remark}")
    await _ok(call, R.DELETE_SUBSCRIPTIONGROUP, {"groupName": args.group, "removeOffset": not args.keep_offsets})
    topics = [] if args.keep_topics else [RETRY_PREFIX + args.group, DLQ_PREFIX + args.group]
    for topic in topics:
        await _ok(call, R.DELETE_TOPIC_IN_BROKER, {"topic": topic})
    if args.json:
        print(json.dumps({"group": args.group, "offsets_removed": not args.keep_offsets, "topics_deleted": topics}))
    else:
        print(f"group {args.group} deleted" + ("" if args.keep_offsets else ", with its offsets")
              + (f"; topics {', '.join(topics)} deleted" if topics else ""))
    return 0
