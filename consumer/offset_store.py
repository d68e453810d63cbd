"""Where a push consumer keeps its progress.

Clustering consumers share a group's offsets on the broker (UPDATE_CONSUMER_OFFSET); broadcasting
consumers each read every queue, so each keeps its own offsets in a local file, as RocketMQ's
LocalFileOffsetStore does (``~/.rocketmq_offsets/<client id>/<group>/offsets.json``). The file is
replaced atomically (write, fsync, rename), so a crash leaves the old progress or the new, never half.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("txmq.consumer")

DEFAULT_DIR = Path.home() / ".txmq_offsets"


def _safe(name: str) -> str:
    """A path component from a client id or group name: no separators, never "." or ".."."""
    name = "".join(c if c.isalnum() or c in "-_.@%" else "_" for c in name)
    return name if name.strip(".") else name.replace(".", "_") or "_"


class BrokerOffsetStore:
    """The group's offsets on the broker (clustering)."""

    def __init__(self, client):
        self.client = client

    async def read(self, mq) -> int | None:
        return await self.client.fetch_offset(mq)

    async def write(self, mq, offset: int) -> None:
        await self.client.commit_offset(mq, offset)

    async def write_oneway(self, mq, offset: int) -> None:
        """``write`` with no reply asked for: the push consumer's commit rounds, as a Java consumer's persistAll
        (an offset store without it has its ``write`` called)."""
        await self.client.commit_offset(mq, offset, oneway=True)

    async def flush(self) -> None:
        pass


class LocalOffsetStore:
    """This consumer's own offsets in a JSON file (broadcasting). ``write`` updates memory; ``flush``
    saves the file (the push consumer flushes on its commit period and at shutdown)."""

    def __init__(self, directory: str | os.PathLike, client_id: str, group: str):
        self.path = Path(directory) / _safe(client_id) / _safe(group) / "offsets.json"
        self._offsets: dict[str, int] = {}
        self._dirty = False
        self._save_lock = threading.Lock()     # a flush cancelled at shutdown may still be saving in its thread
        self._load()

    @staticmethod
    def _key(mq) -> str:
        return f"{mq.topic}@{mq.broker_name}@{mq.queue_id}"

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            table = data["offsetTable"]
            self._offsets = {str(k): int(v) for k, v in table.items()}
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # A damaged file must not stop consumption: start from the queues' default position, loudly.
            log.error("offsets file %s is unreadable (%s); queues start from their default position",
                      self.path, exc)

    async def read(self, mq) -> int | None:
        return self._offsets.get(self._key(mq))

    async def write(self, mq, offset: int) -> None:
        key = self._key(mq)
        if self._offsets.get(key) != offset:
            self._offsets[key] = offset
            self._dirty = True

    async def flush(self) -> None:
        if not self._dirty:
            return
        text = json.dumps({"offsetTable": self._offsets}, sort_keys=True)
        self._dirty = False
        try:
            await asyncio.to_thread(self._save, text)
        except BaseException:
            self._dirty = True
            raise

    def _save(self, text: str) -> None:
        with self._save_lock:
            self._save_locked(text)

    def _save_locked(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
