"""The name servers' KV config (RocketMQ's KVConfigManager): namespace -> key -> value, kept in a file.

mqadmin updateKvConfig / deleteKvConfig / updateOrderConf and ``updateTopic -o true`` write it with
PUT_KV_CONFIG / DELETE_KV_CONFIG (processors/kv.py). The file is RocketMQ's kvConfig.json::

    {"configTable":{"<namespace>":{"<key>":"<value>"}}}

Each change is written whole (fsync, rename, the previous copy kept as ``.bak``) before it is answered (one a
full disk refused is answered SYSTEM_ERROR and written again until it is: retried_save.py); a file
that cannot be read is read from its previous copy, and start-up stops when neither can be (store/saved.py).
"""
from __future__ import annotations

import logging
import os
import threading

from protocol.admin_bodies import dump

from .retried_save import RetriedSave
from .slices import in_slices, sorted_in_slices, stop_if_gone
from .store.saved import check, load_saved, save

log = logging.getLogger("txmq.kvconfig")

FILE_NAME = "kvConfig.json"
# Keys and values together. Anyone who reaches a name server may PUT (RocketMQ's has no ACL either), and each
# change rewrites the whole file: unlimited, a few 16 MiB values filled the broker's store disk (the embedded name
# server keeps it there) and made every change write gigabytes. mqadmin's use is small: an order config a topic.
MAX_BYTES = 4 * 1024 * 1024
# Keys sorted or written out in one turn of the event loop. Written whole, a table of MAX_BYTES in short keys
# (100,000) held the loop at each PUT_KV_CONFIG's save and each GET_KVLIST_BY_NAMESPACE, every other client waiting
# (130-190 ms encoding on a quiet host, 1-2 s on a loaded one: bench/bench_config_holds.py), and anyone who reaches
# a name server may send them back to back.
KEY_SLICE = 2048


class KvConfig(RetriedSave):
    _what, _log = "KV config file", log
    _undone = "a key set or deleted since is as it was before"

    def __init__(self, path: str):
        self.path = path
        self.table: dict[str, dict[str, str]] = {}
        self.counter = 0                    # changes made: a write of an older table is skipped
        self._saved_counter = 0
        self._write_lock = threading.Lock()
        saved = load_saved(path, _parse_file, "KV config file", log,
                           fallback_cost="at most one save older: a key set or deleted since is as it was before",
                           reset_hint="move both away to start with no KV config, then set it again with "
                                      "mqadmin updateKvConfig")
        if saved is not None:
            self.table = saved
        self.size = sum(_size(ns, k, v) for ns, kv in self.table.items() for k, v in kv.items())

    def get(self, namespace: str, key: str) -> str | None:
        return self.table.get(namespace, {}).get(key)

    def put(self, namespace: str, key: str, value: str) -> bool:
        """False, changing nothing, when the table would pass MAX_BYTES."""
        old = self.get(namespace, key)
        size = self.size + _size(namespace, key, value) - (0 if old is None else _size(namespace, key, old))
        if size > MAX_BYTES:
            return False
        self.table.setdefault(namespace, {})[key] = value
        self.size = size
        self.counter += 1
        return True

    def delete(self, namespace: str, key: str) -> bool:
        kv = self.table.get(namespace)
        old = None if kv is None else kv.pop(key, None)
        if old is None:
            return False
        self.size -= _size(namespace, key, old)
        if not kv:
            del self.table[namespace]
        self.counter += 1
        return True

    def encode(self) -> bytes:
        return dump({"configTable": self.table}).encode()

    async def _encoded(self) -> tuple[bytes, int]:
        """(RetriedSave) ``encode()``'s bytes, of the table as it is now, a slice of keys at a time."""
        counter, table = self.counter, {namespace: dict(kv) for namespace, kv in self.table.items()}
        return f'{{"configTable":{await dump_in_slices(table)}}}'.encode(), counter

    def write(self, data: bytes, counter: int) -> None:
        """Blocking (fsync, rename): call it off the loop with ``encode()`` and ``counter`` taken together."""
        with self._write_lock:
            if counter < self._saved_counter:
                return
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            save(self.path, data)
            self._saved_counter = counter


async def dump_in_slices(table: dict[str, dict[str, str]], conn=None) -> str:
    """``dump(table)`` (names over objects of string values: the namespaces' table), sorted and written KEY_SLICE
    keys at a time, the loop running between two. ``table``: a copy nobody changes meanwhile. Stopped once
    ``conn`` (an asker's) is gone (stop_if_gone)."""
    out = []
    for name in sorted(table):
        kv, members = table[name], []
        async for part in in_slices(await sorted_in_slices(kv, KEY_SLICE, conn), KEY_SLICE):
            stop_if_gone(conn)
            members.append(dump({key: kv[key] for key in part})[1:-1])
        out.append(f"{dump(name)}:{{{','.join(members)}}}")
    return f"{{{','.join(out)}}}"


def _size(namespace: str, key: str, value: str) -> int:
    return len(namespace) + len(key) + len(value)


def _parse_file(data) -> dict[str, dict[str, str]]:
    check(isinstance(data, dict), "not a JSON object")
    table = data.get("configTable") or {}
    check(isinstance(table, dict), "configTable is not an object")
    for namespace, kv in table.items():
        check(isinstance(kv, dict) and all(isinstance(v, str) for v in kv.values()),
              f"namespace {namespace!r} is not an object of strings")
    return table
