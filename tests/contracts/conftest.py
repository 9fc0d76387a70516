"""Fixtures that hand each contract test every implementation of its interface."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import _need_mosquitto
from tests.contracts.channels import Harness, MqttHarness, StoreHarness
from tmd.tools.embedded_broker import EmbeddedBroker
from tmd.tools.mosquitto import Mosquitto

CHANNELS = ["store", "mqtt"]
BROKERS: dict[str, type[Mosquitto] | type[EmbeddedBroker]] = {
    "mosquitto": Mosquitto,
    "embedded": EmbeddedBroker,
}


def _harness(request: pytest.FixtureRequest, broker_fixture: str) -> Harness:
    if request.param == "store":
        return StoreHarness()
    return MqttHarness(request.getfixturevalue(broker_fixture))


@pytest.fixture(params=CHANNELS)
def control(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """A job on each control channel; MQTT runs on the session's mosquitto."""
    harness = _harness(request, "broker")
    yield harness
    harness.close()


@pytest.fixture(params=CHANNELS)
def control_own_transport(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """As ``control``, on a transport the test may take away (``harness.cut()``)."""
    harness = _harness(request, "own_broker")
    yield harness
    harness.close()


@pytest.fixture(params=list(BROKERS))
def broker_type(request: pytest.FixtureRequest) -> type[Mosquitto] | type[EmbeddedBroker]:
    """Each broker implementation, not started."""
    if request.param == "mosquitto":
        _need_mosquitto()  # fails under CI when missing, as every broker test does
    return BROKERS[request.param]


@pytest.fixture
def mqtt_broker(
    broker_type: type[Mosquitto] | type[EmbeddedBroker],
) -> Iterator[Mosquitto | EmbeddedBroker]:
    """A fresh broker of each kind for one test, so wildcards see only that test."""
    with broker_type(host="127.0.0.1", port=0) as b:
        yield b
