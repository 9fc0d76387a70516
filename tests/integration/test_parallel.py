"""Jobs wrapped by torch's own parallelism (``tmd.runtime.parallel``), through the real
session and ``JobController``: a machine of two ranks of a DDP, an FSDP2 and a
tensor-parallel job migrates live to a standby machine (HSDP's live migration is
``test_bench_downtime``'s); a machine of a DDP and of an HSDP job dies inside a step
and a standby machine takes its ranks from their replicas, the step run again; a
lost machine of an FSDP2 job (no replica of its shards) rolls the job back to its
sharded checkpoint. Every rank of the job ends where an unsharded copy of the model,
trained on the same batches, does, buffers included.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tmd.runtime import JobController

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).with_name("parallel_train.py"))
NPROC = 4
PER_NODE = 2
ACK_TIMEOUT = timedelta(seconds=60)
JOB_TIMEOUT = timedelta(seconds=150)


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp"])
def test_a_machine_of_a_wrapped_job_migrates_live(
    tmp_path: Path, jobs: list[object], layout: str
) -> None:
    from tmd.runtime.launch import LocalJob

    (tmp_path / "hold").touch()
    cmd = [sys.executable, SCRIPT, "--layout", layout, "--steps", "24", "--out", str(tmp_path),
           "--hold", str(tmp_path / "hold")]  # fmt: skip
    job = LocalJob(cmd, nproc=NPROC, standby=1, nproc_per_node=PER_NODE, job="job")
    jobs.append(job)
    ctl = JobController(job.store, job="job")
    everyone = NPROC + PER_NODE
    ctl.wait_standbys("standby0", timeout=ACK_TIMEOUT)
    ctl.prepare("m1", leaver="worker1", joiner="standby0")
    ctl.wait_acks("m1", "prepared", count=everyone, timeout=ACK_TIMEOUT)
    ctl.switch("m1")
    switched = ctl.wait_acks("m1", "switched", count=everyone, timeout=ACK_TIMEOUT)
    (tmp_path / "hold").unlink()
    codes = job.wait(JOB_TIMEOUT)

    assert set(codes.values()) == {0}, codes
    joiners = {(a.local_rank, a.rank) for a in switched if a.node == "standby0" and a.downtime}
    assert joiners == {(0, 2), (1, 3)}
    finals = [json.loads((tmp_path / f"final-rank{r}.json").read_text()) for r in range(NPROC)]
    assert [(f["node"], f["step"], f["shadow_steps"]) for f in finals] == [
        ("worker0", 24, 0), ("worker0", 24, 0), ("standby0", 24, 2), ("standby0", 24, 2)
    ]  # fmt: skip  # the joiners ran their shadow iterations, sandboxed
    assert all(f["max_diff"] < 1e-5 for f in finals), finals


@pytest.mark.parametrize("layout", ["ddp", "hsdp"])
def test_a_lost_machine_of_a_replicated_job_is_replaced_in_place_and_the_step_redone(
    tmp_path: Path, jobs: list[object], layout: str
) -> None:
    from tmd.runtime.launch import LocalJob

    # worker1 (ranks 2 and 3) dies inside a forward: the survivors' collectives of that
    # step fail or hang in the wrapper's code, which must not raise in the loop.
    cmd = [sys.executable, SCRIPT, "--layout", layout, "--steps", "14", "--out", str(tmp_path),
           "--kill-rank", "2", "--kill-rank", "3", "--kill-step", "9",
           "--kill-in", "forward"]  # fmt: skip
    job = LocalJob(cmd, nproc=NPROC, standby=1, nproc_per_node=PER_NODE, job="job")
    jobs.append(job)
    codes = job.wait(JOB_TIMEOUT)

    assert codes == {"worker0/0": 0, "worker0/1": 0, "worker1/0": -9, "worker1/1": -9,
                     "standby0/0": 0, "standby0/1": 0}, codes  # fmt: skip
    assert len(job.attempts) == 1  # no rollback
    acks = [a for a in job.attempts[0].acks if a.migration_id == "failover-g0"]
    assert [(a.kind, a.detail) for a in acks] == [("switched", "worker1 replaced by standby0")]
    finals = [json.loads((tmp_path / f"final-rank{r}.json").read_text()) for r in range(NPROC)]
    # The survivors ran step 9 again; the standby took ranks 2 and 3 from their
    # replicas (HSDP: the same shards in the other replica group) and ran it too.
    assert [(f["node"], f["step"], f["redone"]) for f in finals] == [
        ("worker0", 14, 1), ("worker0", 14, 1), ("standby0", 14, 0), ("standby0", 14, 0)
    ]  # fmt: skip
    assert all(f["max_diff"] < 1e-5 for f in finals), finals


def test_a_lost_machine_of_a_sharded_job_rolls_back_to_its_sharded_checkpoint(
    tmp_path: Path, jobs: list[object]
) -> None:
    from tmd.runtime.launch import LocalJob

    cmd = [sys.executable, SCRIPT, "--layout", "fsdp", "--steps", "14", "--out", str(tmp_path),
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4",
           "--kill-rank", "2", "--kill-rank", "3", "--kill-step", "9"]  # fmt: skip
    job = LocalJob(cmd, nproc=NPROC, standby=0, nproc_per_node=PER_NODE, job="job", max_restarts=1)
    jobs.append(job)
    codes = job.wait(JOB_TIMEOUT)

    assert set(codes.values()) == {0}, codes
    assert len(job.attempts) == 2  # the first run lost worker1, the second finished
    acks = [a for a in job.attempts[0].acks if a.migration_id == "failover-g0"]
    assert acks and {a.kind for a in acks} == {"failed"}, acks
    assert all("worker1" in a.detail for a in acks)
    finals = [json.loads((tmp_path / f"final-rank{r}.json").read_text()) for r in range(NPROC)]
    # Every rank, the restarted worker1's included, resumed from step 8's shards.
    assert {(f["run"], f["restored_step"], f["step"]) for f in finals} == {(1, 8, 14)}
    assert all(f["max_diff"] < 1e-5 for f in finals), finals
