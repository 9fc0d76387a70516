"""Shared fixtures: a real mosquitto on 127.0.0.1, a running daemon, an MQTT publisher.

Tests that need an outside tool (mosquitto, systemd-analyze, openssl...) ask for it
through ``need_tool``: skipped where it is missing, but failed under CI (``CI`` set),
so a broken install cannot pass as a green run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
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


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection loaded (torch, every test module) lives until the run ends:
    frozen, the collector no longer walks it at each full collection (in the unit
    tests' run, 62 of them took 13 s; 6 s frozen)."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _default_logging() -> Iterator[None]:
    """Tests that configure logging leave it as they found it."""
    yield
    structlog.reset_defaults()


def need_tool(tool: str, path: str | None, *, install: str) -> str:
    """``path``, where ``tool`` was found; else skip the test, or fail it under CI."""
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed, and CI must run the tests that need it")
        pytest.skip(f"{tool} is not installed ({install})")
    return path


def _need_mosquitto() -> None:
    need_tool("mosquitto", find_mosquitto(), install="apt-get install -y mosquitto")


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
    # A daemon that does not end once cancelled fails the test with its stack, rather
    # than hold the whole run until CI's limit.
    stuck = (await asyncio.wait(tasks, timeout=60))[1] if tasks else set()
    if stuck:  # every task left, so the one that ignored its cancel is named
        for t in asyncio.all_tasks():
            if t is not asyncio.current_task():
                t.print_stack()
    assert not stuck, f"{len(stuck)} daemon(s) still running 60 s after being cancelled"
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
