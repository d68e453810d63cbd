"""Client management: HEART_BEAT (34), UNREGISTER_CLIENT (35), GET_CONSUMER_LIST_BY_GROUP (38),
CHECK_CLIENT_CONFIG (46), LOCK_BATCH_MQ (41), UNLOCK_BATCH_MQ (42)."""
from __future__ import annotations

import asyncio
import json
import re

from protocol.codes import ResponseCode
from protocol.command import RemotingCommand
from protocol.errors import HeaderError
from protocol.message import MAX_CLIENT_ID_LENGTH, text_encodes, validate_group

from ..clients import build_subscription, is_tag_type
from ..limits import peer_host
from ..slices import in_steps, run_steps


def _notify(ctx, groups) -> None:
    """NOTIFY_CONSUMER_IDS_CHANGED to each group's consumers, unless its config turned that off (RocketMQ's
    ClientManageProcessor reads notifyConsumerIdsChangedEnable for HEART_BEAT and UNREGISTER_CLIENT)."""
    subs = ctx.subscriptions
    for group in groups:
        if subs is None or subs.notify_enabled(group):
            ctx.clients.notify_ids_changed(group)


def heart_beat(ctx, conn, cmd):
    if cmd.body_length() > ctx.config.max_heartbeat_bytes:
        return _heartbeat_too_large(ctx, conn, cmd)
    if cmd.body_length() > _LARGE_HEARTBEAT or _TURN in conn.attributes:
        return _in_order(conn, lambda: _heart_beat_in_slices(ctx, conn, cmd))
    return _heart_beat_done(ctx, conn, cmd, ctx.clients.heartbeat(conn, cmd))


# conn.attributes key: the last of its HEART_BEAT / UNREGISTER_CLIENT / LOCK_BATCH_MQ / UNLOCK_BATCH_MQ requests
# still waiting or under way behind a large heartbeat or lock batch. A large heartbeat is a task, and the requests
# after it on its connection were handled at once:
# an UNREGISTER_CLIENT sent right after it left nothing (not joined yet) and the heartbeat then joined the group
# (the consumer listed, its queues unread, until channel_expire_ms), a newer heartbeat was overwritten by it.
_TURN = "registration_turn"


def _in_order(conn, make):
    """A task running ``make()`` (a reply or an awaitable one) once the connection's earlier registration requests
    are done. One queued behind another stops the connection being read until the last is done: what waits here
    is frames already read, not every heartbeat of up to 16 MiB a client can pipeline (max_in_flight of them, a
    connection, each waiting for its address's turn). A stock client's single heartbeat leaves it read (its sends
    and pulls go on meanwhile)."""
    before = conn.attributes.get(_TURN)

    async def run():
        if before is not None:
            await asyncio.wait([before])            # its outcome is its own request's answer
        result = make()
        return result if result is None or isinstance(result, RemotingCommand) else await result

    task = asyncio.ensure_future(run())
    conn.attributes[_TURN] = task
    pause = getattr(conn, "pause_reading", None)
    if before is not None and pause is not None:
        pause("heartbeat")

    def done(t):
        if conn.attributes.get(_TURN) is t:
            del conn.attributes[_TURN]
            resume = getattr(conn, "resume_reading", None)
            if resume is not None:
                resume("heartbeat")
    task.add_done_callback(done)
    return task


# Body bytes past which a heartbeat is registered a slice of groups at a time (HEARTBEAT_SLICE, or fewer holding
# HEARTBEAT_SLICE_ITEMS tags), letting other clients in between: some 300 groups. One naming 9,000 groups (2 MB)
# held the loop 0.3 s, and a client sending them back to back held every other client's request up to 1.2 s.
_LARGE_HEARTBEAT = 64 * 1024


async def _heart_beat_in_slices(ctx, conn, cmd):
    # One at a time an address: the rest wait as frames, not as parsed bodies (ten times their size), and the
    # groups of one address's thousand connections are not registered all at once, slices interleaved.
    host = peer_host(conn)
    turn = ctx.heartbeat_turns.setdefault(host, [asyncio.Lock(), 0])
    turn[1] += 1
    try:
        async with turn[0]:
            if not conn.is_open:
                return None     # closed while it waited for its turn: it left its groups then
            steps = ctx.clients.heartbeat_steps(conn, cmd)
            try:
                while True:
                    next(steps)
                    await asyncio.sleep(0)
                    if not conn.is_open:
                        return None     # closed meanwhile: it left its groups then, and registers none after
            except StopIteration as done:
                outcome = done.value
    finally:
        turn[1] -= 1
        if not turn[1]:
            del ctx.heartbeat_turns[host]
    answer = _heart_beat_done(ctx, conn, cmd, outcome)
    return answer if isinstance(answer, RemotingCommand) else await answer


def _heart_beat_done(ctx, conn, cmd, outcome):
    changed, refused, oversized, crowded = outcome
    _notify(ctx, changed)
    # The halves this connection sent before its first heartbeat are its now: answered once that is recorded.
    naming = ctx.tx.connection_named(conn) if ctx.tx is not None else None
    response = _heartbeat_answer(ctx, conn, cmd, refused, oversized, crowded)
    return response if naming is None else _once(naming, response)


async def _once(writing, response):
    await writing
    return response


def _heartbeat_answer(ctx, conn, cmd, refused: int, oversized: list, crowded: list):
    clients = ctx.clients
    if not refused and not oversized and not crowded:
        return cmd.response(ResponseCode.SUCCESS)
    # The groups it is in were renewed; a stock client logs the failed heartbeat and sends the next one as ever.
    peer = getattr(conn, "peer", ("?", 0))
    why = []
    if refused:
        why.append(f"{refused} groups not joined: the connections from {peer[0]} are in "
                   f"{clients.max_groups_per_host} groups, the limit (max_groups_per_host); the groups already "
                   f"joined are renewed")
    for groups, past in ((oversized, f"their subscriptions are past max_subscription_bytes_per_group="
                                     f"{clients.max_subscription_bytes}"),
                         (crowded, f"their subscriptions would put the groups {peer[0]} set past "
                                   f"max_subscription_bytes_per_host={clients.max_subscription_bytes_per_host}")):
        if groups:
            why.append(f"consumer groups {', '.join(groups[:5])}{' ...' if len(groups) > 5 else ''} not joined "
                       f"nor changed: {past}")
    why = "; ".join(why)
    warning = f"HEART_BEAT from {peer[0]}:{peer[1]}: {why:.1000}"
    said = False    # the line is said once, with the first reason counted
    for reason, count in (("group-limit", refused), ("subscription-limit", oversized),
                          ("subscription-host-limit", crowded)):
        if count:
            ctx.limits.refused(reason, None if said else warning)
            said = True
    return cmd.response(ResponseCode.SYSTEM_BUSY, why[:2000])


def _heartbeat_too_large(ctx, conn, cmd):
    """Not parsed (one JSON document, parsed on the loop in one go: 15 MB held every other client 0.6-2 s): the
    groups the connection is in are renewed, so a client past the limit is not dropped from them meanwhile."""
    renewed = ctx.clients.renew(conn)
    peer = getattr(conn, "peer", ("?", 0))
    why = (f"heartbeat body of {cmd.body_length()} bytes is past max_heartbeat_bytes={ctx.config.max_heartbeat_bytes}: "
           f"not read; the {renewed} groups this connection is in are renewed, none joined or changed")
    ctx.limits.refused("heartbeat-size", f"HEART_BEAT from {peer[0]}:{peer[1]}: {why}")
    return cmd.response(ResponseCode.SYSTEM_BUSY, why)


def unregister_client(ctx, conn, cmd):
    if _TURN in conn.attributes:          # after the heartbeats before it on its connection
        return _in_order(conn, lambda: _unregister_client(ctx, conn, cmd))
    return _unregister_client(ctx, conn, cmd)


def _unregister_client(ctx, conn, cmd):
    producer_group = cmd.str_field("producerGroup")
    _notify(ctx, ctx.clients.unregister(conn, producer_group, cmd.str_field("consumerGroup")))
    if producer_group and ctx.tx is not None and ctx.clients.left_group(conn, producer_group):
        ctx.tx.producer_left(conn, producer_group)     # its checks in flight go to the group's others at once
    return cmd.response(ResponseCode.SUCCESS)


def get_consumer_list_by_group(ctx, conn, cmd):
    group = cmd.str_field("consumerGroup", required=True)
    ids = ctx.clients.consumer_ids(group)
    if not ids:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"no consumer for this group, {group}")
    return cmd.response(ResponseCode.SUCCESS, body=json.dumps({"consumerIdList": ids}).encode())


def check_client_config(ctx, conn, cmd):
    """A Java consumer with an SQL92 subscription asks this of every broker at start, and fails to start on
    anything but SUCCESS (ClientManageProcessor.checkClientConfig)."""
    try:
        data = json.loads(cmd.body_bytes() or b"{}")
        sub = data.get("subscriptionData") or {}
        expression_type, expression = sub.get("expressionType"), sub.get("subString")
    except (ValueError, AttributeError, RecursionError):
        raise HeaderError("CHECK_CLIENT_CONFIG body is not a JSON object") from None
    if is_tag_type(expression_type):
        return cmd.response(ResponseCode.SUCCESS)
    if not ctx.config.enable_property_filter:
        return cmd.response(ResponseCode.SYSTEM_ERROR, f"The broker does not support consumer to filter message by {expression_type}")
    why = build_subscription(str(sub.get("topic")), expression, 0, str(expression_type)).filter_error
    if why is not None:
        # (a line each was any client's to repeat, the expression at any length: 300 asks, 300 lines)
        ctx.limits.warn("sql92-refused", f"client {str(data.get('clientId'))[:200]} of group "
                        f"{str(data.get('group'))[:200]}: SQL92 expression {str(expression)[:200]!r} refused: {why[:200]}")
        return cmd.response(ResponseCode.SUBSCRIPTION_PARSE_FAILED, why)
    return cmd.response(ResponseCode.SUCCESS)


# A LOCK/UNLOCK_BATCH_MQ body past this many bytes is read, and its queues locked, a slice of LOCK_SLICE queues at
# a time, the loop running between, in the connection's turn (_in_order). One of 15 MB (250,000 queues, a frame's
# worth) held the loop 4.7 s at LOCK and 2.8 s at UNLOCK: json.loads alone was most of it.
_LARGE_LOCK_BODY = 64 * 1024
LOCK_SLICE = 2048
_WS = re.compile(r"[ \t\n\r]*")
_JSON = json.JSONDecoder()


def lock_batch_mq(ctx, conn, cmd):
    return _lock_request(ctx, conn, cmd, _lock_steps)


def unlock_batch_mq(ctx, conn, cmd):
    return _lock_request(ctx, conn, cmd, _unlock_steps)


def _lock_request(ctx, conn, cmd, steps):
    """``steps(ctx, conn, cmd)`` (a generator, each yield a slice done) run at once for a small body, else in the
    connection's turn with the loop running between two slices."""
    if cmd.body_length() <= _LARGE_LOCK_BODY and _TURN not in getattr(conn, "attributes", ()):
        return run_steps(steps(ctx, conn, cmd))
    return _in_order(conn, lambda: in_steps(steps(ctx, conn, cmd)))


def _lock_body(cmd):
    """Generator: (group, client id, queues) of a LOCK/UNLOCK_BATCH_MQ body, typed as RocketMQ's
    LockBatchRequestBody, each queue once (its mqSet is a Java Set of MessageQueue: topic, broker name and queue
    id), yielding every LOCK_SLICE queues read. A queue that is not an object, or a name or queue id of the wrong
    type, refuses the request before any lock is taken (it failed half-way, the locks before it granted but not
    answered)."""
    try:
        data = yield from _json_object_steps(cmd.body_bytes().decode())
        group, client_id, mqs = data["consumerGroup"], data["clientId"], data.get("mqSet") or {}
        if not all(isinstance(v, str) for v in (group, client_id)) or not isinstance(mqs, dict):
            raise TypeError("consumerGroup and clientId must be text, mqSet a list")
        why = validate_group(group, "consumerGroup")      # each lock keeps it, until it expires
        if why is None and (len(client_id) > MAX_CLIENT_ID_LENGTH or not text_encodes(client_id)):
            why = f"clientId is not UTF-8 text of at most {MAX_CLIENT_ID_LENGTH} characters"
        if why is not None:
            raise ValueError(why)
        return group, client_id, list(mqs.values())
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise HeaderError(f"lock body must be {{consumerGroup, clientId, mqSet}}: {exc}") from None


def _json_object_steps(text: str):
    """Generator: the JSON object ``text`` as json.loads reads it, but for its "mqSet" array, read an element at
    a time into a dict of its distinct queues (yielding every LOCK_SLICE): the C scanner reads each piece."""
    out = {}
    i = _WS.match(text, 0).end()
    if text[i:i + 1] != "{":
        raise ValueError("not a JSON object")
    i = _WS.match(text, i + 1).end()
    closing = text[i:i + 1] == "}"
    while not closing:
        key, i = _JSON.raw_decode(text, i)
        if not isinstance(key, str):
            raise ValueError(f"member name {key!r} is not a string")
        i = _WS.match(text, i).end()
        if text[i:i + 1] != ":":
            raise ValueError(f"':' expected at {i}")
        i = _WS.match(text, i + 1).end()
        if key == "mqSet" and text[i:i + 1] == "[":
            out[key], i = yield from _queue_set_steps(text, i + 1)
        else:
            out[key], i = _JSON.raw_decode(text, i)
        i, closing = _next_member(text, i, "}")
    if _WS.match(text, i + 1).end() != len(text):
        raise ValueError(f"extra data at {i + 1}")
    return out


def _queue_set_steps(text: str, i: int):
    """Generator: ({(topic, brokerName, queueId): queue}, the index past the array) of the mqSet array whose
    first element is at ``i``, yielding every LOCK_SLICE queues."""
    queues: dict = {}
    i = _WS.match(text, i).end()
    closing = text[i:i + 1] == "]"
    read = 0
    while not closing:
        mq, i = _JSON.raw_decode(text, i)
        queues.setdefault(_queue_key(mq), mq)
        read += 1
        if read % LOCK_SLICE == 0:
            yield
        i, closing = _next_member(text, i, "]")
    return queues, i + 1


def _next_member(text: str, i: int, close: str) -> tuple[int, bool]:
    """(where the next member starts, or the index of ``close``; whether it is ``close``) after a member that
    ended at ``i``."""
    i = _WS.match(text, i).end()
    c = text[i:i + 1]
    if c == close:
        return i, True
    if c != ",":
        raise ValueError(f"',' or {close!r} expected at {i}")
    return _WS.match(text, i + 1).end(), False


def _queue_key(mq) -> tuple:
    if not isinstance(mq, dict) or not all(isinstance(mq.get(k), (str, type(None))) for k in ("topic", "brokerName")):
        raise TypeError(f"queue {mq!r} is not {{topic, brokerName, queueId}}")
    qid = mq.get("queueId")
    if isinstance(qid, bool) or not isinstance(qid, (int, str, type(None))):
        raise TypeError(f"queueId {qid!r} is not an integer")
    return mq.get("topic"), mq.get("brokerName"), qid


def _lock_steps(ctx, conn, cmd):
    group, client_id, mqs = yield from _lock_body(cmd)
    clients = ctx.clients
    config = ctx.config
    now = clients.clock()               # monotonic: a wall clock step must not free or pin a lock
    ttl = config.queue_lock_max_live_ms
    clients.maybe_expire_locks(ttl, now)
    granted = []
    refused: dict[str, int] = {}
    topics = ctx.topics.topics
    closed = getattr(conn, "closed", None)
    for n, mq in enumerate(mqs, 1):
        if n % LOCK_SLICE == 0:
            yield
        # Its connection gone (while it waited for its turn or between slices), its answer can never reach the
        # client, which would not know it holds these queues: the rest of its group kept off them for ttl.
        if (n == 1 or n % LOCK_SLICE == 0) and closed is not None and closed.is_set():
            return None
        # Only queues this broker has: a lock is held for queue_lock_max_live_ms, and any name was taken, so one
        # 15 MB request of made-up queues kept some 70 MB for a minute; a client sending them in a loop, gigabytes.
        # (UPDATE_CONSUMER_OFFSET refuses such queues the same way.) Not granted, it is left out of the answer.
        topic = mq.get("topic")
        tc = topics.get(topic)
        qid = mq.get("queueId")
        if tc is None or type(qid) is not int or not 0 <= qid < tc.queue_count:
            continue
        why = clients.lock_queue((group, topic, qid), client_id, conn, now, ttl, config.max_queue_locks,
                                 config.max_queue_locks_per_connection, config.max_queue_locks_per_host)
        if why is None:
            granted.append(mq)
        elif why != "held":
            refused[why] = refused.get(why, 0) + 1
    if refused:
        peer = getattr(conn, "peer", ("?", 0))
        ctx.limits.refused("queue-lock-limit", (
            f"LOCK_BATCH_MQ of group {group} from client {client_id} at {peer[0]}:{peer[1]}: "
            f"{sum(refused.values())} queue locks not granted (past {' and '.join(sorted(refused))}; "
            f"{len(clients.locks)} locks held in all): the client will try again later"))
    return cmd.response(ResponseCode.SUCCESS, body=json.dumps({"lockOKMQSet": granted}).encode())


def _unlock_steps(ctx, conn, cmd):
    group, client_id, mqs = yield from _lock_body(cmd)
    for n, mq in enumerate(mqs, 1):
        if n % LOCK_SLICE == 0:
            yield
        ctx.clients.unlock_queue((group, mq.get("topic"), mq.get("queueId")), client_id)
    return cmd.response(ResponseCode.SUCCESS)
