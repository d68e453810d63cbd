"""CLONE_GROUP_OFFSET (broker/processors/ops.py) driven a step at a time: how many offsets one step of the loop
clones."""
from __future__ import annotations

import types

from broker.processors.ops import clone_group_offset
from broker.store.offsets import ConsumerOffsets
from protocol.codes import RequestCode, ResponseCode
from protocol.command import RemotingCommand


def test_a_clone_of_every_topic_of_a_big_group_lets_the_loop_run_between_slices(tmp_path):
    """With no topic, every topic the source holds offsets on is cloned: in one go, a group of 100,000 offsets held
    the broker's event loop about 2 s (every client waiting). Driven a step at a time, no step clones more than
    a slice (and one topic's queues)."""
    offsets = ConsumerOffsets(str(tmp_path))
    for t in range(40):
        for q in range(500):
            offsets.commit("src", f"T{t}", q, q)

    async def saved(**_):
        return 0.0
    offsets.saved = saved
    ctx = types.SimpleNamespace(
        offsets=offsets, topics=types.SimpleNamespace(get=lambda t: object()),
        clients=types.SimpleNamespace(reads_elsewhere=lambda g, t: False),
        limits=types.SimpleNamespace(offsets_full=lambda *a: None, warn=lambda *a: None),
        metrics=types.SimpleNamespace(offset_moves_deferred=types.SimpleNamespace(inc=lambda: None),
                                      group_in_use=lambda group: None))
    cmd = RemotingCommand.request(RequestCode.CLONE_GROUP_OFFSET, {"srcGroup": "src", "destGroup": "dst"})
    conn = types.SimpleNamespace(peer=("127.0.0.1", 1), remote_addr="127.0.0.1:1")
    run = clone_group_offset(ctx, conn, cmd)
    most, before = 0, 0
    reply = None
    while reply is None:
        try:
            run.send(None)
        except StopIteration as done:
            reply = done.value
        made = sum(len(offsets.of("dst", t)) for t in offsets.topics_of("dst"))
        most, before = max(most, made - before), made
    assert reply.code == ResponseCode.SUCCESS
    assert sum(len(offsets.of("dst", t)) for t in offsets.topics_of("dst")) == 20_000
    assert most <= 4096 + 500, most
