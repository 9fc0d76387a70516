"""Fixtures of the integration tests that start jobs (``tmd.runtime.launch.LocalJob``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def jobs() -> Iterator[list[Any]]:
    """Jobs a test started (append them): every process of each is stopped after it."""
    started: list[Any] = []
    yield started
    for job in started:
        job.terminate()


Undisturbed = Callable[..., Path]


@pytest.fixture(scope="session")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Undisturbed:
    """``undisturbed(nproc, steps, quiet=...)``: the output of an undisturbed run of the
    runtime tests' script (``runtime_conftest_helpers``), every rank's final parameters
    and losses, for tests to compare their migrated runs with. A rank's numbers depend on
    its rank, the world size, the steps and the noise (``quiet``: ``--no-noise``), not on
    its machine, its job's name or its pace: each run is made once a session, at full
    speed, and shared by every module that compares with it."""
    from tests.integration.runtime_conftest_helpers import run_job

    runs: dict[tuple[int, int, bool], Path] = {}

    def get(nproc: int, steps: int, *, quiet: bool) -> Path:
        key = (nproc, steps, quiet)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"undisturbed-{nproc}x{steps}{'-quiet' * quiet}")
            extra = ["--sleep", "0", *(["--no-noise"] if quiet else [])]
            job = run_job(out, nproc=nproc, steps=steps, extra=extra)
            try:
                assert set(job.wait(timedelta(seconds=150)).values()) == {0}
            finally:
                job.terminate()
            runs[key] = out
        return runs[key]

    return get
