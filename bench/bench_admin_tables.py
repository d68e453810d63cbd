"""The whole-table admin codes a slave's sync (and mqadmin) asks at a large history: their loop holds.

    python bench/bench_admin_tables.py [--topics 50000] [--offsets 100000] [--groups 10000]

Real TopicManager table entries, ConsumerOffsets and SubscriptionGroups, the real handlers (broker/processors),
everything else stubbed: GET_ALL_TOPIC_CONFIG (21) at ``--topics``, GET_ALL_SUBSCRIPTIONGROUP_CONFIG (201) and
INVOKE_BROKER_TO_RESET_OFFSET's existence check (222, a group with no offset on the topic: the whole check) at
``--offsets`` offsets of ``--groups`` groups; and the slave's side of the offsets' sync (SlaveSync.sync_once, the
master's GET_ALL_CONSUMER_OFFSET body of those offsets answered at once, the rest of the sync off). A handler that yields is driven a step at a time: its longest step
is what the loop is held (another client waits that long), its sum the work. Each is run beside "before", the
same work as the handler did it before this change (inlined here), in the same process on the same tables.
The last line is JSON; "ratio" = the longest hold now / before, the worst of the four.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.ha.sync import SlaveSync  # noqa: E402
from broker.processors import admin as admin_proc  # noqa: E402
from broker.processors.offsets import get_all_consumer_offset  # noqa: E402
from broker.processors import ops  # noqa: E402
from broker.store import ConsumerOffsets  # noqa: E402
from broker.subscriptions import SubscriptionGroups  # noqa: E402
from broker.topics import TopicConfig  # noqa: E402
from protocol.admin_bodies import quote_int_keys, split_at_string_literals  # noqa: E402
from protocol.codes import RequestCode, ResponseCode  # noqa: E402
from protocol.command import RemotingCommand  # noqa: E402


def drive(result):
    """(the response, [CPU seconds of each step]) of a handler's result, a coroutine driven a step at a time."""
    steps = []
    if not hasattr(result, "send"):
        return result, steps
    while True:
        t0 = time.process_time()
        try:
            result.send(None)
        except StopIteration as done:
            steps.append(time.process_time() - t0)
            return done.value, steps
        steps.append(time.process_time() - t0)


def timed(fn):
    t0 = time.process_time()
    result = fn()
    first = time.process_time() - t0
    resp, steps = drive(result)
    steps = [first + (steps[0] if steps else 0.0)] + steps[1:]
    return resp, steps


def before_21(ctx, conn, cmd):
    table = {name: {"topicName": tc.name, "readQueueNums": tc.read_queue_nums, "writeQueueNums": tc.write_queue_nums,
                    "perm": tc.perm, "topicFilterType": tc.filter_type, "topicSysFlag": tc.sys_flag,
                    "order": tc.order} for name, tc in ctx.topics.topics.items()}
    version = ctx.topics.data_version
    return cmd.response(0, body=json.dumps({"dataVersion": {"counter": version.counter,
                                                            "timestamp": version.timestamp},
                                            "topicConfigTable": table}).encode())


def before_201(ctx, conn, cmd):
    known = set(ctx.clients.consumers) | {g for (g, _t, _q), _o in ctx.offsets.items()}
    return cmd.response(0, body=ctx.subscriptions.encode(sorted(known)))


def before_222_check(ctx, group, topic):
    return any(g == group and t == topic for (g, t, _q), _o in ctx.offsets.items())


def before_slave_parse(body: bytes):
    """The one call of the slave's offsets sync that read the whole body (json.loads), its pieces quoted first
    (as the sync does, a slice at a time) and untimed."""
    pieces = split_at_string_literals(body.decode())
    pieces[::2] = map(quote_int_keys, pieces[::2])
    return lambda: json.loads("".join(pieces))["offsetTable"]


def slave_sync(body: bytes):
    """SlaveSync.sync_once against a master that answers GET_ALL_CONSUMER_OFFSET with ``body`` at once."""
    with tempfile.TemporaryDirectory() as d:
        sync = SlaveSync(ConsumerOffsets(d), 10.0)
    sync.on_registered("ns", SimpleNamespace(ext_fields={"masterAddr": "127.0.0.1:10911"}))

    async def request(addr, cmd, timeout):
        return cmd.response(ResponseCode.SUCCESS if cmd.code == RequestCode.GET_ALL_CONSUMER_OFFSET else 1,
                            body=body)
    sync.pool.request = request
    return sync.sync_once


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topics", type=int, default=50_000)
    p.add_argument("--offsets", type=int, default=100_000)
    p.add_argument("--groups", type=int, default=10_000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        offsets = ConsumerOffsets(d)
        subs = SubscriptionGroups(d, lambda: 0)
    per_group = a.offsets // a.groups
    for i in range(a.offsets):
        g = i // per_group
        offsets.commit(f"CG{g}", f"T{(g + i % per_group // 8) % a.topics}", i % 8, i)
    topics = {f"T{i}": TopicConfig(f"T{i}", 8, 8) for i in range(a.topics)}
    gc.collect()
    gc.freeze()     # as the broker settles its heap after loading (broker/heap.py): no full collection walks them
    ctx = SimpleNamespace(topics=SimpleNamespace(topics=topics, data_version=SimpleNamespace(counter=7, timestamp=1),
                                                 get=topics.get),
                          offsets=offsets, subscriptions=subs, clients=SimpleNamespace(consumers={}),
                          config=SimpleNamespace(broker_name="b0", broker_role="ASYNC_MASTER"))
    fig = {"topics": a.topics, "offsets": offsets.count(), "groups": a.groups}
    body = drive(get_all_consumer_offset(ctx, None, RemotingCommand.request(RequestCode.GET_ALL_CONSUMER_OFFSET)))[0]
    body = body.body_bytes()
    cases = {
        "21": (lambda: before_21(ctx, None, RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG)),
               lambda: admin_proc.get_all_topic_config(ctx, None,
                                                      RemotingCommand.request(RequestCode.GET_ALL_TOPIC_CONFIG))),
        "201": (lambda: before_201(ctx, None, RemotingCommand.request(RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG)),
                lambda: ops.get_all_subscription_group(
                    ctx, None, RemotingCommand.request(RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG))),
        "slave": (before_slave_parse(body), slave_sync(body)),
        "222": (lambda: before_222_check(ctx, "CG1", "T5"),
                lambda: ops.reset_offset(ctx, None, RemotingCommand.request(
                    RequestCode.INVOKE_BROKER_TO_RESET_OFFSET, {"topic": "T5", "group": "CG1", "timestamp": -1}))),
    }
    ratios = []
    for code, (before, now) in cases.items():
        b_resp, b_steps = timed(before)
        n_resp, n_steps = timed(now)
        if code in ("21", "201"):
            assert n_resp.body_bytes() == b_resp.body_bytes(), f"{code}: the bodies differ"
        elif code == "slave":
            assert n_resp is True and len(b_resp) == len({(g, t) for (g, t, _q), _o in offsets.items()})
        else:
            assert b_resp is False and n_resp.remark == "THe consumer group <CG1> not exist", n_resp.remark
        for arm, steps in (("before", b_steps), ("now", n_steps)):
            print(f"{code} {arm}: {sum(steps) * 1000:.1f} ms CPU in {len(steps)} steps, the loop held "
                  f"{max(steps) * 1000:.2f} ms at most")
            fig[f"{code}_{arm}_cpu_ms"] = round(sum(steps) * 1000, 2)
            fig[f"{code}_{arm}_hold_ms"] = round(max(steps) * 1000, 2)
        ratios.append(max(n_steps) / max(b_steps))
    fig["ratio"] = round(max(ratios), 4)
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
