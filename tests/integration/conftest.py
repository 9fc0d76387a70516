"""Fixtures of the integration tests that start jobs (``tmd.runtime.launch.LocalJob``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def jobs() -> Iterator[list[Any]]:
    """Jobs a test started (append them): every process of each is stopped after it."""
    started: list[Any] = []
    yield started
    for job in started:
        job.terminate()
