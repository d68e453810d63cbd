"""The settings UPDATE_BROKER_CONFIG changes live (processors/broker_config.py), kept across restarts.

``<store>/config/brokerConfig.json``::

    {"brokerPermission": 4}

RocketMQ writes an updateBrokerConfig into its configuration file before it answers
(BrokerController.updateBrokerConfig, Configuration.persist), so a broker taken out of service for
maintenance stays out through a crash or a restart. Kept in memory only, one killed (or stopped) during
the maintenance came back read-write, taking sends and pulls again, with nothing said. Only what differs
from the default is kept: back to read-write, the key goes.

Written as the other tables (store/saved.py: synced, renamed, the previous copy kept as ``.bak``, a
damaged file read from it), and read before the broker serves.
"""
from __future__ import annotations

import logging
import os

from protocol.admin_bodies import dump
from protocol.codes import Perm

from .store.saved import check, is_int, load_saved, save

log = logging.getLogger("txmq.admin")

FILE_NAME = "brokerConfig.json"
PERMISSIONS = {Perm.READ_WRITE: "read-write", Perm.READ: "read-only", Perm.WRITE: "write-only", 0: "closed"}


def path_in(config_dir: str) -> str:
    return os.path.join(config_dir, FILE_NAME)


def load(config_dir: str) -> dict:
    """The settings saved by UPDATE_BROKER_CONFIG ({} when none); StoreError when neither the file nor its
    previous copy can be read (start-up stops: starting read-write would undo an operator's maintenance)."""
    return load_saved(path_in(config_dir), _parse, "live broker config file", log,
                      fallback_cost="at most one save older: a brokerPermission set since is as it was before",
                      reset_hint="move both away to start read-write, then set brokerPermission again with "
                                 "mqadmin updateBrokerConfig") or {}


def write(config_dir: str, values: dict) -> None:
    """Blocking (fsync, rename): call it off the loop."""
    os.makedirs(config_dir, exist_ok=True)
    save(path_in(config_dir), dump({k: v for k, v in values.items() if v != Perm.READ_WRITE}).encode())


def _parse(data) -> dict:
    check(isinstance(data, dict), "not a JSON object")
    # Only brokerPermission is kept here: any other key is a hand's typo (or a newer version's), and read past,
    # the broker started read-write in the middle of a maintenance without a word.
    unknown = sorted(str(k)[:100] for k in data if k != "brokerPermission")
    check(not unknown, f"unknown key {', '.join(unknown[:5])} (only brokerPermission is kept here)")
    perm = data.get("brokerPermission", Perm.READ_WRITE)
    check(is_int(perm) and perm in PERMISSIONS, f"brokerPermission = {perm!r} (6, 4, 2 or 0)")
    return {"brokerPermission": perm}
