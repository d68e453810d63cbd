"""Replication as RocketMQ 4.x's HA does it: a slave follows its master's commit log byte for byte.

codec.py   the two one-way streams' bytes (offset reports; transfer frames)
waiter.py  the offset watermark SYNC_MASTER sends wait on (group commit, one timer)
master.py  HAMaster: a link per slave, streaming the log; confirm() for SYNC_MASTER sends
slave.py   HASlave: connect, report, append the master's bytes through the store's writer

``build(config, store, connect)`` makes the role's object, or None for a master with no HA port.
Broker ids as RocketMQ has them: 0 a master, 1 a slave (``broker_id_of``), for routes.
"""
from __future__ import annotations

from .master import HAMaster
from .slave import HASlave

__all__ = ["HAMaster", "HASlave", "build", "broker_id_of", "is_slave"]


def is_slave(config) -> bool:
    return config.broker_role == "SLAVE"


def broker_id_of(config) -> int:
    """This broker's id in routes (RocketMQ: 0 the master, 1+ a slave); an explicit broker_id wins."""
    explicit = getattr(config, "broker_id", None)
    if explicit is not None:
        return explicit
    return 1 if is_slave(config) else 0


def build(config, store, connect=None):
    if is_slave(config):
        store.set_replica_only()
        return HASlave(store, config, connect)
    if config.ha_port < 0:
        return None
    master = HAMaster(store, config)
    store.add_dispatch_listener(master.on_dispatch)
    return master


def topic_follower(topics):
    """(Slave) a dispatch listener that keeps the topic configs covering every queue the master's records
    name, so pulls and routes on the slave see them (RocketMQ's slave copies topics.json from its master
    every 60 s; here the log itself says which queues exist)."""
    from ..topics import TopicConfig

    def on_dispatch(info) -> None:
        if info.queue_offset < 0:
            return
        tc = topics.topics.get(info.topic)
        # (its master's write-only queues too: grown, the next sync set the copied config back, every interval)
        if tc is not None and info.queue_id < max(tc.read_queue_nums, tc.write_queue_nums):
            return
        n = info.queue_id + 1 if tc is None else max(info.queue_id + 1, tc.read_queue_nums)
        try:
            topics.create(TopicConfig(info.topic, n, n) if tc is None else
                          TopicConfig(tc.name, n, max(n, tc.write_queue_nums), tc.perm, tc.filter_type,
                                      tc.sys_flag, tc.order))
        except Exception:       # noqa: BLE001 - a topic limit: the records are stored all the same
            return

    return on_dispatch
