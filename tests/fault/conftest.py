from tests.integration.conftest import broker_factory  # noqa: F401 - the same real-broker fixture
