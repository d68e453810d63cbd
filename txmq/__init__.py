"""txmq: a transactional message broker speaking Apache RocketMQ 4.x's remoting protocol.

The import names are ``txmq.protocol``, ``txmq.broker``, ``txmq.producer``, ``txmq.consumer`` and
``txmq.ops``; the client API is also here: ``from txmq import Producer, TransactionProducer,
PushConsumer, PullConsumer`` (and ``txmq.sync`` for scripts). The installed wheel holds only this
``txmq`` package (docs/design.md, "Import names"). In a source checkout the five folders sit at the
top level, where their old names (``import broker``) keep working; there this package maps
``txmq.<name>`` onto them, so both names give the very same module objects.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

PACKAGES = ("protocol", "broker", "producer", "consumer", "ops")
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# Installed (wheel): the subpackages live inside this folder. Source checkout: beside it.
SOURCE_TREE = not os.path.isdir(os.path.join(_HERE, "protocol")) and os.path.isdir(os.path.join(_ROOT, "protocol"))


class _Alias(importlib.abc.Loader):
    """Loads ``txmq.X.y`` as the module ``X.y`` itself (one module object under two names)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """First in sys.meta_path: ``txmq.X...`` -> ``X...``. Last: a top-level ``X`` from the checkout,
    only when no other finder has one (an editable install run from another directory)."""

    def __init__(self, last: bool):
        self.last = last

    def find_spec(self, fullname, path=None, target=None):
        head, _, rest = fullname.partition(".")
        if not self.last and head == "txmq" and rest and rest.split(".")[0] in PACKAGES:
            module = importlib.import_module(rest)
            return importlib.machinery.ModuleSpec(fullname, _Alias(rest), is_package=hasattr(module, "__path__"))
        if self.last and fullname in PACKAGES:
            return importlib.machinery.PathFinder.find_spec(fullname, [_ROOT])
        return None


if SOURCE_TREE and not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _SourceTreeFinder(last=False))
    sys.meta_path.append(_SourceTreeFinder(last=True))

from .protocol import __version__  # noqa: E402

_CLIENT_API = {
    "Producer": "producer", "TransactionProducer": "producer", "LocalTransactionState": "producer",
    "TransactionListener": "producer", "SendResult": "producer", "SendStatus": "producer",
    "TransactionSendResult": "producer", "MessageQueue": "producer",
    "PullConsumer": "consumer", "PushConsumer": "consumer", "ConsumeStatus": "consumer",
    "PullResult": "consumer", "PullStatus": "consumer", "SqliteIdempotency": "consumer",
    "MessageSelector": "consumer",
}
__all__ = ["__version__", *_CLIENT_API]


def __getattr__(name: str):
    """The client API, imported on first use (``import txmq`` alone loads no client code)."""
    if name in _CLIENT_API:
        return getattr(importlib.import_module(f"{__name__}.{_CLIENT_API[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
