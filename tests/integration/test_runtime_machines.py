"""Machines of several ranks, moved as one: abort, failover and restart of a machine of
two ranks in a real gloo job, driven by ``JobController`` (its live migration, driven by
the daemon, is ``test_e2e``'s).

Each run ends with the parameters of every rank equal to an undisturbed run's and
the same loss at every (rank, step).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.integration.conftest import Undisturbed
from tests.integration.runtime_conftest_helpers import assert_same_as, release, run_job
from tmd.runtime import EX_RESTART, JobController

pytestmark = pytest.mark.slow

NPROC = 4
PER_NODE = 2
STEPS = 60
ACK_TIMEOUT = timedelta(seconds=60)
JOB_TIMEOUT = timedelta(seconds=150)


@pytest.fixture(scope="module")
def reference(undisturbed: Undisturbed) -> Path:
    # A rank's numbers depend on its rank and the world, not on its machine.
    return undisturbed(NPROC, STEPS, quiet=True)


@pytest.mark.parametrize(
    ("killed", "nproc", "per_node", "standby", "replaced"),
    [
        # Both processes of worker1 die at once: the standby machine takes both ranks.
        ([2, 3], NPROC, PER_NODE, 1, {"worker1": "standby0"}),
        # One process of worker1 dies: the machine is not trusted, and goes as a whole
        # (its live rank leaves the job).
        ([3], NPROC, PER_NODE, 1, {"worker1": "standby0"}),
        # Two machines at once, with two standby machines ready: both replaced, in one
        # generation, from the one survivor.
        ([1, 2], 3, 1, 2, {"worker1": "standby0", "worker2": "standby1"}),
    ],
    ids=["whole-machine", "part-of-a-machine", "two-machines"],
)
def test_a_lost_machine_is_replaced_from_replicas_without_rollback(
    tmp_path: Path, reference: Path, jobs: list[object], killed: list[int], nproc: int,
    per_node: int, standby: int, replaced: dict[str, str], undisturbed: Undisturbed,
) -> None:  # fmt: skip
    kill = [a for r in killed for a in ("--kill-rank", str(r))]
    extra = ["--no-noise", "--kill-step", "20", "--detect-timeout", "5"]
    job = run_job(tmp_path, nproc=nproc, nproc_per_node=per_node, standby=standby, steps=STEPS,
                  extra=[*extra, *kill])  # fmt: skip
    jobs.append(job)
    ref = reference if nproc == NPROC else undisturbed(nproc, STEPS, quiet=True)
    job.wait(JOB_TIMEOUT)

    status = JobController(job.store, job="job").status()
    assert status is not None and status.state == "stopped", status
    assert status.generation == 1  # one failover, no rollback
    for lost, new in replaced.items():
        assert lost not in {m.node for m in status.members}
        assert new in {m.node for m in status.members}
    acks = [a for a in job.attempts[-1].acks if a.migration_id == "failover-g0"]
    assert [a.kind for a in acks] == ["switched"], acks
    assert len(job.attempts) == 1
    # A live rank of a lost machine computed the step of the failure before it left.
    again = frozenset((r, 20) for node in replaced for r in _ranks(node, per_node, nproc)
                      if r not in killed)  # fmt: skip
    assert_same_as(tmp_path, ref, nproc, losses_from=20, again=again)


def _ranks(node: str, per_node: int, nproc: int) -> list[int]:
    """The ranks ``tmd launch`` puts on machine ``workerM``."""
    m = int(node.removeprefix("worker"))
    return [r for r in range(nproc) if r // per_node == m]


def test_a_restart_checkpoints_and_starts_again_without_the_machine(
    tmp_path: Path, reference: Path, jobs: list[object]
) -> None:
    ckpt = tmp_path / "ckpt"
    job = run_job(tmp_path, nproc=NPROC, nproc_per_node=PER_NODE, standby=1, steps=STEPS,
                  extra=["--no-noise", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "7"],
                  max_restarts=1, held=True)  # fmt: skip
    jobs.append(job)
    ctl = JobController(job.store, job="job")
    while not (ckpt / "step-000000007").exists():  # running, with a checkpoint behind it
        time.sleep(0.02)
    ctl.restart("r1", node="worker1", reason="ECC errors pending")
    ctl.wait_acks("r1", "restarting", count=1, timeout=ACK_TIMEOUT)
    release(tmp_path)
    job.wait(JOB_TIMEOUT)

    first = job.attempts[0]
    assert first.status is not None and first.status.state == "restarting"
    assert first.status.excluded == ["worker1"]
    answers = [a for a in first.acks if a.migration_id == "r1"]
    assert [(a.kind, a.rank) for a in answers] == [("restarting", 0)], answers
    assert "checkpoint at step" in answers[0].detail
    assert set(first.codes.values()) <= {EX_RESTART, -9}, first.codes  # idle standby killed
    # The second start runs worker1's ranks on the standby machine, from the checkpoint
    # written at the restart, and ends where an undisturbed run ends.
    last = job.attempts[-1]
    assert last.status is not None and last.status.state == "stopped"
    assert [(m.node, m.local_rank) for m in last.status.members] == [
        ("worker0", 0), ("worker0", 1), ("standby0", 0), ("standby0", 1)
    ]  # fmt: skip
    assert set(last.codes.values()) == {0}, last.codes
    assert_same_as(tmp_path, reference, NPROC, losses_from=STEPS)


def test_an_aborted_migration_returns_both_ranks_and_a_leaver_dying_while_joined_fails_over(
    tmp_path: Path, reference: Path, jobs: list[object]
) -> None:
    """worker1's migration, prepared then aborted: both its ranks stay, both slots of the
    standby machine stand by again. Then worker1 dies while the standby machine is
    joining it (its slots wait on groups the dead machine will never complete): the
    joiner leaves the migration at once and takes the dead machine's ranks in the
    survivors' failover, within their wait for a ready standby; no restart, no
    rollback."""
    from tmd.runtime.control import standbys

    job = run_job(tmp_path, nproc=NPROC, nproc_per_node=PER_NODE, standby=1, steps=STEPS,
                  extra=["--no-noise", "--detect-timeout", "5"], held=True)  # fmt: skip
    jobs.append(job)
    ctl = JobController(job.store, job="job")
    everyone = NPROC + PER_NODE  # every process of the job and of the standby machine
    ctl.wait_standbys("standby0", timeout=ACK_TIMEOUT)
    ctl.prepare("m0", leaver="worker1", joiner="standby0")
    ctl.wait_acks("m0", "prepared", count=everyone, timeout=ACK_TIMEOUT)
    ctl.abort("m0", reason="test")
    aborted = ctl.wait_acks("m0", "aborted", count=everyone, timeout=ACK_TIMEOUT)
    assert {(a.node, a.local_rank) for a in aborted} >= {("worker1", 0), ("worker1", 1)}
    ctl.wait_standbys("standby0", timeout=ACK_TIMEOUT)  # both slots ready again
    ctl.prepare("m1", leaver="worker1", joiner="standby0")
    deadline = time.monotonic() + ACK_TIMEOUT.total_seconds()
    while not any(s.state == "joining" for s in standbys(job.store)):
        assert time.monotonic() < deadline, "the standby machine never started joining"
        time.sleep(0.005)
    job.kill("worker1")  # both of its processes
    release(tmp_path)
    job.wait(JOB_TIMEOUT)

    status = ctl.status()
    assert status is not None and status.state == "stopped", status
    assert status.generation == 1
    assert [(m.node, m.local_rank) for m in status.members] == [
        ("worker0", 0), ("worker0", 1), ("standby0", 0), ("standby0", 1)
    ]  # fmt: skip
    assert len(job.attempts) == 1  # replaced from replicas, not restarted
    joiner = {a.kind for a in job.attempts[-1].acks if a.migration_id == "m1"
              and a.node == "standby0"}  # fmt: skip
    assert joiner <= {"aborted", "failed"}, joiner
    assert_same_as(tmp_path, reference, NPROC, losses_from=STEPS)
