import pytest

from tests.support.broker_process import BrokerProcess


@pytest.fixture
def broker_factory(tmp_path):
    started = []

    def make(*flags, store="store", env=None):
        b = BrokerProcess(tmp_path / store, *flags, env=env)
        started.append(b)
        return b.start()

    yield make
    for b in started:
        b.kill()


@pytest.fixture
def broker(broker_factory):
    return broker_factory()
