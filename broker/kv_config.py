"""The name servers' KV config (RocketMQ's KVConfigManager): namespace -> key -> value, kept in a file.

mqadmin updateKvConfig / deleteKvConfig / updateOrderConf and ``updateTopic -o true`` write it with
PUT_KV_CONFIG / DELETE_KV_CONFIG (processors/kv.py). The file is RocketMQ's kvConfig.json::

    {"configTable":{"<namespace>":{"<key>":"<value>"}}}

Each change is written whole (fsync, rename, the previous copy kept as ``.bak``) before it is answered (one a
full disk refused is answered SYSTEM_ERROR and written again until it is: retried_save.py); a file
that cannot be read is read from its previous copy, and start-up stops when neither can be (store/saved.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Mapping

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
# a name server may send them back to back. 512, not 2,048: another client's median SEND while GET_KVLIST_BY_NAMESPACE
# answers a full namespace 10 ms, not 22 (two runs each of bench_config_holds --asks 5), the answers no slower within
# this host's noise; 8,192 doubled the worst SEND and loop lag (409 and 145 ms, not 183 and 52).
KEY_SLICE = 512


class KvConfig(RetriedSave):
    _what, _log = "KV config file", log
    _undone = "a key set or deleted since is as it was before"

    def __init__(self, path: str):
        self.path = path
        self.table: dict[str, dict[str, str]] = {}
        self.counter = 0                    # changes made: a write of an older table is skipped
        self._saved_counter = 0
        self._write_lock = threading.Lock()
        # Saves and GET_KVLIST answers reading the table across turns of the loop (frozen): a change copies its
        # namespace's dict first while one of them still reads it.
        self._readers: list[Frozen] = []
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
        self._writable(namespace)[key] = value
        self.size = size
        self.counter += 1
        return True

    def delete(self, namespace: str, key: str) -> bool:
        if self.get(namespace, key) is None:
            return False
        kv = self._writable(namespace)
        old = kv.pop(key)
        self.size -= _size(namespace, key, old)
        if not kv:
            del self.table[namespace]
        self.counter += 1
        return True

    def _writable(self, namespace: str) -> dict[str, str]:
        """The namespace's dict, to change in place: a copy of it first while a reader (frozen) still reads it."""
        kv, shared = self.table.get(namespace), False
        for reader in self._readers:
            if namespace not in reader.before:
                reader.before[namespace], shared = kv, True
        if kv is None:
            kv = self.table[namespace] = {}
        elif shared:
            kv = self.table[namespace] = dict(kv)
        return kv

    @contextlib.contextmanager
    def frozen(self, namespace: str | None = None):
        """The table as it is now (only ``namespace`` in it when given), to read across turns of the loop: a change
        meanwhile copies its namespace's dict first, this one keeps the one it had. Copied whole as a save began
        (every namespace's keys), 400,000 one-key namespaces (they fit in MAX_BYTES) held a loaded host's loop
        0.9 s, a shallow copy alone 150 ms."""
        reader = Frozen(self.table, list(self.table) if namespace is None else [namespace])
        self._readers.append(reader)
        try:
            yield reader
        finally:
            self._readers.remove(reader)

    def encode(self) -> bytes:
        return dump({"configTable": self.table}).encode()

    async def _encoded(self) -> tuple[bytes, int]:
        """(RetriedSave) ``encode()``'s bytes, of the table as it is now, a slice of keys at a time."""
        with self.frozen() as table:
            counter = self.counter
            return f'{{"configTable":{await dump_in_slices(table)}}}'.encode(), counter

    def write(self, data: bytes, counter: int) -> None:
        """Blocking (fsync, rename): call it off the loop with ``encode()`` and ``counter`` taken together."""
        with self._write_lock:
            if counter < self._saved_counter:
                return
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            save(self.path, data)
            self._saved_counter = counter


class Frozen(Mapping):
    """The KV table as it was when a reader began (KvConfig.frozen): the namespaces' names then, each one's dict
    the table's own until a change replaces it, then the one kept in ``before`` (None: a namespace not there)."""

    def __init__(self, table: dict[str, dict[str, str]], names: list[str]):
        self._table, self._names, self.before = table, names, {}

    def __getitem__(self, namespace: str) -> dict[str, str]:
        kv = self.before[namespace] if namespace in self.before else self._table.get(namespace)
        if kv is None:
            raise KeyError(namespace)
        return kv

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


async def dump_in_slices(table: Mapping[str, dict[str, str]], conn=None) -> str:
    """``dump(table)`` (names over objects of string values: the namespaces' table), sorted and written KEY_SLICE
    keys at a time, the loop running between two. ``table``: a copy nobody changes meanwhile (KvConfig.frozen).
    Stopped once ``conn`` (an asker's) is gone (stop_if_gone). Namespaces of few keys are written KEY_SLICE keys'
    worth together: one at a time with no turn between two, 400,000 one-key namespaces held the loop 21 s."""
    out, small, keys = [], {}, 0
    for name in await sorted_in_slices(table, KEY_SLICE, conn):
        kv = table[name]
        if len(kv) < KEY_SLICE:
            small[name], keys = kv, keys + len(kv) + 1
            if keys >= KEY_SLICE:
                out.append(dump(small)[1:-1])
                small, keys = {}, 0
                await asyncio.sleep(0)
                stop_if_gone(conn)
            continue
        if small:
            out.append(dump(small)[1:-1])
            small, keys = {}, 0
        members = []
        async for part in in_slices(await sorted_in_slices(kv, KEY_SLICE, conn), KEY_SLICE):
            stop_if_gone(conn)
            members.append(dump({key: kv[key] for key in part})[1:-1])
        out.append(f"{dump(name)}:{{{','.join(members)}}}")
        await asyncio.sleep(0)
        stop_if_gone(conn)
    if small:
        out.append(dump(small)[1:-1])
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
