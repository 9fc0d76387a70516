"""Shared fixtures: a real mosquitto on 127.0.0.1, a running daemon, an MQTT publisher.

Tests that need mosquitto fail (they are not skipped) when it is missing under CI, so
a broken install cannot pass as a green run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from tests.helpers import Publisher
from tmd import config as config_mod
from tmd.daemon.daemon import Daemon
from tmd.tools.mosquitto import Mosquitto, find_mosquitto


@pytest.fixture(autouse=True)
def _default_logging() -> Iterator[None]:
    """Tests that configure logging leave it as they found it."""
    yield
    structlog.reset_defaults()


def _need_mosquitto() -> None:
    if find_mosquitto() is None:
        if os.environ.get("CI"):
            pytest.fail("mosquitto is not installed, and CI must run the broker tests")
        pytest.skip("mosquitto is not installed (apt-get install -y mosquitto)")


@pytest.fixture(scope="session")
def broker() -> Iterator[Mosquitto]:
    """One broker for the session; tests use distinct job and node names."""
    _need_mosquitto()
    with Mosquitto() as b:
        yield b


@pytest.fixture
def own_broker() -> Iterator[Mosquitto]:
    """A broker for one test (which may restart it)."""
    _need_mosquitto()
    with Mosquitto() as b:
        yield b


@pytest.fixture
def publisher(broker: Mosquitto) -> Iterator[Publisher]:
    p = Publisher(broker.host, broker.port)
    yield p
    p.close()


DaemonFactory = Callable[..., Any]


@pytest.fixture
async def start_daemon(tmp_path: Path) -> AsyncIterator[DaemonFactory]:
    """``await start_daemon(broker, **config sections)`` -> a ready Daemon."""
    tasks: list[asyncio.Task[None]] = []

    async def start(b: Mosquitto, **sections: Any) -> Daemon:
        raw: dict[str, Any] = {
            "mqtt": {
                "host": b.host,
                "port": b.port,
                "reconnect_min_s": 0.1,
                "reconnect_max_s": 0.5,
            },
            "api": {"port": 0},
            "journal": {"path": str(tmp_path / f"journal-{len(tasks)}.sqlite3")},
        }
        for name, table in sections.items():
            raw[name] = {**raw.get(name, {}), **table}
        daemon = Daemon(config_mod.from_dict(raw))
        tasks.append(asyncio.create_task(daemon.run()))
        await asyncio.wait_for(daemon.ready.wait(), 20)
        return daemon

    yield start
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
