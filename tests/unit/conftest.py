import pytest


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    """A home of its own for each test: a NameServer built with the default config keeps its KV config in
    ~/namesrv/kvConfig.json (RocketMQ's default), and read -- or, from a previous copy, rewrote -- the user's."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
