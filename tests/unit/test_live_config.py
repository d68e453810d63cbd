"""broker/live_config.py: config/brokerConfig.json, what updateBrokerConfig set (brokerPermission)."""
from __future__ import annotations

import json

import pytest

from broker import live_config
from protocol.codes import Perm
from protocol.errors import StoreError


def _saved(tmp_path, body) -> str:
    (tmp_path / live_config.FILE_NAME).write_text(json.dumps(body))
    return str(tmp_path)


def test_the_permission_saved_is_read_back(tmp_path):
    live_config.write(str(tmp_path), {"brokerPermission": Perm.READ})
    assert live_config.load(str(tmp_path)) == {"brokerPermission": Perm.READ}
    live_config.write(str(tmp_path), {"brokerPermission": Perm.READ_WRITE})     # back to the default: key gone
    assert json.loads((tmp_path / live_config.FILE_NAME).read_text()) == {}
    assert live_config.load(str(tmp_path)) == {"brokerPermission": Perm.READ_WRITE}


@pytest.mark.parametrize("key", ["brokerPermision", "brokerpermission", "perm"])
def test_a_key_it_does_not_know_stops_start_up(tmp_path, key):
    """A hand's typo ({"brokerPermision": 4}) was read past: the broker started read-write, taking sends during
    the maintenance it was meant to keep it out of, with nothing said."""
    with pytest.raises(StoreError, match=key):
        live_config.load(_saved(tmp_path, {key: 4}))
