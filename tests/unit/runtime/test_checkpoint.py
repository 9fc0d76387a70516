"""Periodic checkpoints: what counts as complete, pruning, and a save/restore round
trip through a one-rank session on a real store (no subprocesses)."""

from __future__ import annotations

import json
import random
from datetime import timedelta
from pathlib import Path

import numpy
import pytest
import torch

from tmd.errors import ConfigError, RestartRequired
from tmd.runtime import EX_RESTART, ResumableSampler, Session, SessionConfig, run, session
from tmd.runtime.checkpoint import (
    MARKER,
    commit,
    complete_steps,
    latest_step,
    prune,
    step_dir,
)
from tmd.runtime.env import RuntimeEnv
from tmd.runtime.group import StoreAddress
from tmd.runtime.launch import host_store


def _complete(root: Path, step: int, *, world_size: int = 1) -> Path:
    tmp = root / f".tmp-step-{step:09d}"
    tmp.mkdir(parents=True)
    (tmp / "small-rank0.pt").write_bytes(b"x")
    return commit(tmp, root, step=step, world_size=world_size)


def test_a_checkpoint_without_its_commit_marker_is_ignored(tmp_path: Path) -> None:
    _complete(tmp_path, 4)
    partial = step_dir(tmp_path, 8)  # every rank wrote, the commit never happened
    partial.mkdir()
    (partial / "small-rank0.pt").write_bytes(b"x")
    (tmp_path / ".tmp-step-000000012").mkdir()  # still being written
    mislabelled = step_dir(tmp_path, 16)
    mislabelled.mkdir()
    (mislabelled / MARKER).write_text(json.dumps({"step": 15, "world_size": 1}))
    garbled = step_dir(tmp_path, 20)
    garbled.mkdir()
    (garbled / MARKER).write_text("{not json")

    assert complete_steps(tmp_path) == [4]
    assert latest_step(tmp_path) == 4
    assert latest_step(tmp_path / "missing") is None


def test_prune_keeps_the_two_newest_and_drops_everything_unfinished(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _complete(tmp_path, step)
    step_dir(tmp_path, 8).mkdir()
    (tmp_path / ".tmp-step-000000010").mkdir()
    (tmp_path / ".trash-step-000000001-abcd").mkdir()
    (tmp_path / "notes.txt").write_text("the user's")

    prune(tmp_path)

    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt",
        "step-000000004",
        "step-000000006",
    ]


class _Run:
    """A one-rank job on its own fresh store (kept, with the session's clients)."""

    def __init__(self, root: Path, *, steps: int, every: int, restore: bool = True) -> None:
        self.store = host_store(0)
        self.session, self.losses = _train(root, self.store.port, steps=steps, every=every,
                                           restore=restore)  # fmt: skip


def _train(
    root: Path, port: int, *, steps: int, every: int, restore: bool
) -> tuple[Session, list[float]]:
    torch.manual_seed(7)
    numpy.random.seed(8)
    random.seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    sampler = ResumableSampler(64, batch_size=4, rank=0, world_size=1)
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    env = RuntimeEnv(role="worker", job="unit", node="n0", rank=0, world_size=1,
                     store=StoreAddress("127.0.0.1", port), host="127.0.0.1",
                     backend="gloo")  # fmt: skip
    config = SessionConfig(
        checkpoint_dir=root if restore or every else None,
        checkpoint_every=every,
        control_poll=timedelta(milliseconds=5),
    )
    losses = []
    with session(model, optimizer, scheduler=scheduler, stateful={"sampler": sampler},
                 config=config, env=env) as s:  # fmt: skip
        for _ in s.steps(steps):
            x = data[sampler.next_batch()] + float(numpy.random.rand()) * random.random()
            loss = model(x).pow(2).mean()
            loss.backward()  # type: ignore[no-untyped-call]
            losses.append(float(loss.item()))
            s.step()
    return s, losses


def test_a_restarted_session_resumes_from_the_latest_complete_checkpoint(tmp_path: Path) -> None:
    reference = _Run(tmp_path / "unused", steps=10, every=0, restore=False)
    first = _Run(tmp_path, steps=7, every=3)
    assert complete_steps(tmp_path) == [3, 6]
    partial = step_dir(tmp_path, 9)  # a later checkpoint whose commit never happened
    partial.mkdir()

    again = _Run(tmp_path, steps=10, every=0)

    assert again.session.restored_step == 6
    assert again.losses == reference.losses[6:]  # same batches, dropout masks and noise
    want = reference.session.state.model.state_dict()
    got = again.session.state.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert first.session.checkpoints_dropped == 0
    assert not partial.exists()  # rank 0 cleared it when it chose step 6


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path: Path) -> None:
    _complete(tmp_path, 4, world_size=2)
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        _Run(tmp_path, steps=5, every=0)


def test_checkpoint_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="checkpoint_every"):
        SessionConfig(checkpoint_every=5)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        SessionConfig(checkpoint_dir="/tmp/x", checkpoint_every=-1)
    with pytest.raises(ConfigError, match="standby_wait"):
        SessionConfig(standby_wait=timedelta(seconds=-1))


def test_run_turns_restart_required_into_the_restart_exit_status() -> None:
    def train() -> None:
        raise RestartRequired("2 ranks lost in generation 0", checkpoint_step=8)

    with pytest.raises(SystemExit) as exited:
        run(train)
    assert exited.value.code == EX_RESTART == 75
    assert "rollback to checkpoint step 8" in str(exited.value.__cause__)
    assert run(lambda x: x + 1, 1) == 2
