"""Planned migrations of a real multi-process gloo job, driven by ``JobController``.

Every test runs the same tiny job as an unmigrated reference and checks that the
migrated (or aborted) run ends with bit-identical parameters on every rank and
computed bit-identical losses at every (rank, step).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from tests.integration.conftest import Undisturbed
from tests.integration.runtime_conftest_helpers import assert_same_as, release, run_job
from tmd.runtime import JobController

pytestmark = pytest.mark.slow

NPROC = 3
STEPS = 80
ACK_TIMEOUT = timedelta(seconds=60)
JOB_TIMEOUT = timedelta(seconds=120)


@pytest.fixture(scope="module")
def reference(undisturbed: Undisturbed) -> Path:
    return undisturbed(NPROC, STEPS, quiet=False)


@pytest.fixture
def job_factory() -> Iterator[list[object]]:
    jobs: list[object] = []
    yield jobs
    for job in jobs:
        job.terminate()  # type: ignore[attr-defined]


def start(out: Path, jobs: list[object], *, standby: int = 1, extra: list[str] | None = None):  # type: ignore[no-untyped-def]
    job = run_job(out, nproc=NPROC, standby=standby, steps=STEPS, extra=extra, held=True)
    jobs.append(job)
    ctl = JobController(job.store, job="job")
    ctl.wait_standbys(*(f"standby{i}" for i in range(standby)), timeout=ACK_TIMEOUT)
    return job, ctl


def test_two_migrations_in_a_row(
    tmp_path: Path, reference: Path, job_factory: list[object]
) -> None:
    """A planned migration (switched once every process prepared), then one whose leaver
    is the first one's joiner, its switch requested while it prepares."""
    job, ctl = start(tmp_path, job_factory, standby=2)
    ctl.prepare("m1", leaver="worker1", joiner="standby0")
    ctl.wait_acks("m1", "prepared", count=NPROC + 1, timeout=ACK_TIMEOUT)
    ctl.switch("m1")
    switched = ctl.wait_acks("m1", "switched", count=NPROC + 1, timeout=ACK_TIMEOUT)
    ctl.prepare("m2", leaver="standby0", joiner="standby1")
    ctl.switch("m2")
    ctl.wait_acks("m2", "switched", count=NPROC + 1, timeout=ACK_TIMEOUT)
    release(tmp_path)
    codes = job.wait(JOB_TIMEOUT)

    assert codes == {"worker0": 0, "worker1": 0, "worker2": 0, "standby0": 0, "standby1": 0}
    joiner = next(a for a in switched if a.node == "standby0")
    assert joiner.rank == 1 and joiner.generation == 1
    # Measured by every member but the leaver. A median step (0.02 s and noise) is taken
    # off the gap, so it may dip below zero, not by much; a live switch costs far less
    # than 50 steps.
    downtimes = [a.downtime for a in switched if a.node != "worker1"]
    assert all(d is not None and -0.05 <= d.total_s < 50 * 0.02 for d in downtimes), downtimes
    status = ctl.status()
    assert status is not None and status.state == "stopped" and status.generation == 2
    assert [m.node for m in status.members] == ["worker0", "standby1", "worker2"]
    assert_same_as(tmp_path, reference, NPROC)


def test_aborted_migrations_keep_the_old_group(
    tmp_path: Path, reference: Path, job_factory: list[object]
) -> None:
    """Aborted once every process prepared, then (the standby standing by again) once
    its switch was requested for a boundary not reached yet: nothing switches."""
    job, ctl = start(tmp_path, job_factory)
    ctl.prepare("m1", leaver="worker1", joiner="standby0")
    ctl.wait_acks("m1", "prepared", count=NPROC + 1, timeout=ACK_TIMEOUT)
    ctl.abort("m1", reason="operator changed their mind")
    aborted = ctl.wait_acks("m1", "aborted", count=NPROC + 1, timeout=ACK_TIMEOUT)
    assert {a.node for a in aborted} == {"worker0", "worker1", "worker2", "standby0"}
    ctl.wait_standbys("standby0", timeout=ACK_TIMEOUT)
    ctl.prepare("m2", leaver="worker1", joiner="standby0")
    ctl.switch("m2", at_step=10_000)  # requested, agreed boundary not reached yet
    ctl.wait_acks("m2", "prepared", count=NPROC + 1, timeout=ACK_TIMEOUT)
    ctl.abort("m2")
    ctl.wait_acks("m2", "aborted", count=NPROC + 1, timeout=ACK_TIMEOUT)
    release(tmp_path)
    codes = job.wait(JOB_TIMEOUT)

    assert set(codes.values()) == {0}
    assert not [a for a in ctl.acks() if a.kind == "switched"]
    status = ctl.status()
    assert status is not None and status.generation == 0
    assert_same_as(tmp_path, reference, NPROC)


def test_a_joiner_dying_aborts_the_migration_and_the_old_group_goes_on(
    tmp_path: Path, reference: Path, job_factory: list[object]
) -> None:
    """standby0 is SIGKILLed once prepared; then standby1 exits inside the switch,
    after the leaver sent the switch message and before the commit (the commit vote
    fails). Each time every member aborts, the leaver stays, nothing is lost."""
    job, ctl = start(tmp_path, job_factory, standby=2,
                     extra=["--fault", "joiner-dies-at-switch"])  # fmt: skip
    ctl.prepare("m1", leaver="worker1", joiner="standby0")
    ctl.wait_acks("m1", "prepared", count=NPROC + 1, timeout=ACK_TIMEOUT)
    job.kill("standby0", signal.SIGKILL)
    killed = ctl.wait_acks("m1", "aborted", count=NPROC, timeout=ACK_TIMEOUT)
    ctl.prepare("m2", leaver="worker1", joiner="standby1")
    ctl.switch("m2")
    died = ctl.wait_acks("m2", "aborted", count=NPROC, timeout=ACK_TIMEOUT)
    release(tmp_path)
    codes = job.wait(JOB_TIMEOUT)

    workers = {"worker0", "worker1", "worker2"}
    assert {a.node for a in killed} == {a.node for a in died} == workers
    assert codes["standby0"] == -signal.SIGKILL
    assert codes["standby1"] not in (0, -signal.SIGKILL)
    assert {codes[f"worker{r}"] for r in range(NPROC)} == {0}
    assert_same_as(tmp_path, reference, NPROC)
