"""The global rollback of real multi-process gloo jobs under ``LocalJob``'s restarts.

Where in-place failover cannot serve, the survivors ack ``failed`` and exit with
``EX_RESTART``; the launcher starts the job again and every rank resumes from the
latest complete checkpoint. The job then ends bit-identical to an undisturbed run:
the checkpoint holds every rank's RNG streams and data position, so the steps
recomputed after the rollback are the very same steps.
"""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.integration.runtime_conftest_helpers import assert_same_as, losses, run_job
from tmd.runtime import EX_RESTART, JobController
from tmd.runtime.checkpoint import complete_steps

pytestmark = pytest.mark.slow

NPROC = 3
STEPS = 16
EVERY = 4
KILL_STEP = 9  # the newest checkpoint before it is step 8
JOB_TIMEOUT = timedelta(seconds=120)
FAST = ["--sleep", "0.01", "--detect-timeout", "2", "--standby-wait", "0.5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    job = run_job(out, nproc=NPROC, steps=STEPS, extra=["--sleep", "0"])
    assert set(job.wait(JOB_TIMEOUT).values()) == {0}
    return out


def _start(out: Path, jobs: list[Any], *, standby: int, kill: list[int]) -> Any:
    extra = [*FAST, "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", str(EVERY),
             "--kill-step", str(KILL_STEP)]  # fmt: skip
    for rank in kill:
        extra += ["--kill-rank", str(rank)]
    job = run_job(out, nproc=NPROC, standby=standby, steps=STEPS, extra=extra, max_restarts=1)
    jobs.append(job)
    return job


def _assert_rolled_back(out: Path, reference: Path) -> None:
    # The second start began at the checkpoint, not at step 0, and recomputed
    # exactly what the reference computed from there on.
    assert {step for _, step in losses(out)} == set(range(8, STEPS))
    assert_same_as(out, reference, NPROC, losses_from=8)
    assert complete_steps(out / "ckpt") == [12, 16]  # two kept, older ones pruned


def test_a_rank_lost_without_a_standby_rolls_the_job_back_to_its_checkpoint(
    tmp_path: Path, reference: Path, jobs: list[Any]
) -> None:
    job = _start(tmp_path, jobs, standby=0, kill=[1])
    codes = job.wait(JOB_TIMEOUT)

    assert codes == {"worker0": 0, "worker1": 0, "worker2": 0}
    assert job.restarts == 1
    first = job.attempts[0]
    assert first.codes == {"worker0": EX_RESTART, "worker1": -signal.SIGKILL,
                           "worker2": EX_RESTART}  # fmt: skip
    failed = [a for a in first.acks if a.migration_id == "failover-g0"]
    assert {a.node for a in failed} == {"worker0", "worker2"}
    assert all(a.kind == "failed" for a in failed)
    assert all("no ready standby" in a.detail for a in failed)
    assert all("rollback to checkpoint step 8" in a.detail for a in failed)
    _assert_rolled_back(tmp_path, reference)


def test_two_machines_lost_at_once_with_one_standby_roll_back(
    tmp_path: Path, reference: Path, jobs: list[Any]
) -> None:
    job = _start(tmp_path, jobs, standby=1, kill=[1, 2])
    codes = job.wait(JOB_TIMEOUT)

    assert codes == {"worker0": 0, "worker1": 0, "worker2": 0, "standby0": 0}
    first = job.attempts[0]
    assert first.codes["worker0"] == EX_RESTART
    assert first.codes["worker1"] == first.codes["worker2"] == -signal.SIGKILL
    acks = [a for a in first.acks if a.migration_id == "failover-g0"]
    assert [(a.node, a.kind) for a in acks] == [("worker0", "failed")]
    # Two standby machines would replace both (tests/integration/test_runtime_machines.py);
    # one cannot, and half a replacement is none.
    assert "no ready standby machine" in acks[0].detail
    assert "worker1 (1 slot), worker2 (1 slot)" in acks[0].detail
    assert "rollback to checkpoint step 8" in acks[0].detail
    status = JobController(job.store, job="job").status()
    assert status is not None and status.state == "stopped" and status.generation == 0
    _assert_rolled_back(tmp_path, reference)


def test_failover_waits_for_a_standby_that_is_still_warming_up(
    tmp_path: Path, jobs: list[Any]
) -> None:
    # The standby needs 60 shadow steps of 0.05 s before it is ready; the rank dies
    # in step 1, long before. Waiting for it beats rolling back.
    extra = ["--no-noise", "--sleep", "0.05", "--shadow-steps", "60", "--standby-wait", "60",
             "--kill-rank", "1", "--kill-step", "1"]  # fmt: skip
    job = run_job(tmp_path, nproc=NPROC, standby=1, steps=STEPS, extra=extra, max_restarts=1)
    jobs.append(job)
    codes = job.wait(JOB_TIMEOUT)

    assert job.restarts == 0
    assert codes == {"worker0": 0, "worker1": -signal.SIGKILL, "worker2": 0, "standby0": 0}
    ctl = JobController(job.store, job="job")
    status = ctl.status()
    assert status is not None and status.generation == 1
    assert [m.node for m in status.members] == ["worker0", "standby0", "worker2"]
    switched = [a for a in ctl.acks() if a.migration_id == "failover-g0"]
    assert [(a.node, a.kind) for a in switched] == [("worker0", "switched")]
    # The wait is the downtime: at most the standby's warm-up (60 shadow steps of
    # 0.05 s), with room for slower steps; never below minus one step.
    downtime = switched[0].downtime
    assert downtime is not None and -0.05 <= downtime.total_s < 3 * 60 * 0.05, downtime
    assert switched[0].generation == 1


def test_a_joiner_lost_during_the_failover_step_is_replaced_in_turn(
    tmp_path: Path, jobs: list[Any]
) -> None:
    # standby0 takes rank 1's place, then dies inside that very step before its
    # all-reduce: the re-run of the step fails, and standby1 takes the place next.
    extra = ["--no-noise", *FAST, "--standby-wait", "30", "--fault", "standby0-dies-after-joining",
             "--kill-rank", "1", "--kill-step", str(KILL_STEP)]  # fmt: skip
    job = run_job(tmp_path, nproc=NPROC, standby=2, steps=STEPS, extra=extra)
    jobs.append(job)
    codes = job.wait(JOB_TIMEOUT)

    assert codes == {"worker0": 0, "worker1": -signal.SIGKILL, "worker2": 0,
                     "standby0": -signal.SIGKILL, "standby1": 0}  # fmt: skip
    ctl = JobController(job.store, job="job")
    status = ctl.status()
    assert status is not None and status.generation == 2
    assert [m.node for m in status.members] == ["worker0", "standby1", "worker2"]
    switched = [(a.migration_id, a.node) for a in ctl.acks() if a.kind == "switched"]
    assert switched == [("failover-g0", "worker0"), ("failover-g1", "worker0")]
    # Rank 1's step 9 was finished once, by the second joiner (the killed processes
    # never wrote theirs), and it carried on from there.
    survivors = {(r, s) for r in (0, 2) for s in range(STEPS)}
    assert set(losses(tmp_path)) == survivors | {(1, s) for s in range(KILL_STEP, STEPS)}
