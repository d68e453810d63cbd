"""The name servers' KV config (RocketMQ's KVConfigManager): namespace -> key -> value, kept in a file.

mqadmin updateKvConfig / deleteKvConfig / updateOrderConf and ``updateTopic -o true`` write it with
PUT_KV_CONFIG / DELETE_KV_CONFIG (processors/kv.py). The file is RocketMQ's kvConfig.json::

    {"configTable":{"<namespace>":{"<key>":"<value>"}}}

Each change is written whole (fsync, rename, the previous copy kept as ``.bak``) before it is answered;
a file that cannot be read leaves the table empty and says so, and its previous copy is used when readable.
"""
from __future__ import annotations

import json
import logging
import os
import threading

from protocol.admin_bodies import dump

from .store.mapped_file import BACKUP_SUFFIX, fsync_dir, keep_previous

log = logging.getLogger("txmq.kvconfig")

FILE_NAME = "kvConfig.json"


class KvConfig:
    def __init__(self, path: str):
        self.path = path
        self.table: dict[str, dict[str, str]] = {}
        self.counter = 0                    # changes made: a write of an older table is skipped
        self._saved_counter = 0
        self._write_lock = threading.Lock()
        why = self._load_from(path)
        if why is not None:
            bad = self._load_from(path + BACKUP_SUFFIX)
            if bad is None:
                log.error("%s %s: using its previous copy", path, "is missing" if why == "missing" else
                          f"cannot be read ({why})")
            elif why != "missing":
                log.error("ignoring unreadable %s (%s) and its previous copy (%s): the KV config starts empty",
                          path, why, bad)

    def _load_from(self, path: str) -> str | None:
        try:
            with open(path, encoding="utf-8") as fh:
                table = json.load(fh).get("configTable") or {}
            loaded = {ns: {str(k): str(v) for k, v in kv.items()} for ns, kv in table.items() if isinstance(kv, dict)}
        except FileNotFoundError:
            return "missing"
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            return str(exc) or type(exc).__name__
        self.table = loaded
        return None

    def get(self, namespace: str, key: str) -> str | None:
        return self.table.get(namespace, {}).get(key)

    def put(self, namespace: str, key: str, value: str) -> None:
        self.table.setdefault(namespace, {})[key] = value
        self.counter += 1

    def delete(self, namespace: str, key: str) -> bool:
        kv = self.table.get(namespace)
        if kv is None or kv.pop(key, None) is None:
            return False
        if not kv:
            del self.table[namespace]
        self.counter += 1
        return True

    def encode(self) -> bytes:
        return dump({"configTable": self.table}).encode()

    def write(self, data: bytes, counter: int) -> None:
        """Blocking (fsync, rename): call it off the loop with ``encode()`` and ``counter`` taken together."""
        tmp = self.path + ".tmp"
        with self._write_lock:
            if counter < self._saved_counter:
                return
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            keep_previous(self.path)
            os.replace(tmp, self.path)
            fsync_dir(os.path.dirname(self.path) or ".")
            self._saved_counter = counter
