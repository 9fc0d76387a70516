"""A member's memory of migration ids stays bounded over a long job (issue 12, item 8):
it remembers the newest ``MAX_REMEMBERED`` ids it acted on and the answers it gave,
answers a repeat of one of them with what already happened, and takes a command for an
id that fell out for a new one. A one-process session on a real store, a group of one,
commands fed at the step boundary."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from tests.unit.runtime.test_session import _LoneGroup, _Recorder
from tmd import wire
from tmd.runtime import Session
from tmd.runtime.commands import MAX_REMEMBERED
from tmd.runtime.env import RuntimeEnv
from tmd.runtime.group import StoreAddress
from tmd.runtime.launch import host_store
from tmd.runtime.membership import Membership, Reconfiguration
from tmd.runtime.migration import no_votes

NODE = "w0"


class _Feed(_Recorder):
    """A control channel that hands the session the commands put in ``inbox``."""

    def __init__(self) -> None:
        super().__init__()
        self.inbox: list[wire.Control] = []

    def poll(self) -> list[wire.Control]:  # type: ignore[override]
        out, self.inbox = self.inbox, []
        return out


@pytest.fixture
def member() -> Iterator[tuple[Session, _Feed]]:
    store = host_store(0)
    env = RuntimeEnv(role="standby", job="unit", node=NODE, rank=0, world_size=1,
                     store=StoreAddress("127.0.0.1", store.port), host="127.0.0.1",
                     backend="gloo")  # fmt: skip
    model = torch.nn.Linear(3, 1)
    control = _Feed()
    session = Session(model, torch.optim.SGD(model.parameters(), lr=0.1), env=env,
                      control=control)  # fmt: skip
    session.reconfigure(Reconfiguration(_LoneGroup(), Membership(1, (NODE,)), rank=0))
    yield session, control  # the store's server lives as long as this fixture


def restart(mid: str) -> wire.Restart:
    # Refused at once: the job has no checkpoint directory to restart from.
    return wire.Restart(ts=time.time(), job="unit", migration_id=mid, node=NODE)


def prepare(mid: str) -> wire.Prepare:
    # Refused at once: the joiner is already a member.
    return wire.Prepare(ts=time.time(), job="unit", migration_id=mid, leaver=NODE, joiner=NODE)


def boundary(s: Session, control: _Feed, *commands: wire.Control) -> list[wire.Ack]:
    control.inbox += commands
    before = len(control.acks)
    s.commands.boundary(no_votes())
    return control.acks[before:]


def test_a_long_job_remembers_the_newest_migration_ids_only(
    member: tuple[Session, _Feed],
) -> None:
    s, control = member
    ids = [f"m{i}" for i in range(5 * MAX_REMEMBERED)]
    for start in range(0, len(ids), 256):
        chunk = ids[start : start + 256]
        acks = boundary(s, control, *(restart(m) if i % 2 else prepare(m) for i, m in
                                      enumerate(chunk)))  # fmt: skip
        assert [(a.migration_id, a.kind) for a in acks] == [(m, "failed") for m in chunk]
        for mid in chunk:
            s.commands.measured(mid, wire.Downtime(total_s=0.1))
        commands = s.commands
        assert max(len(commands.seen), len(commands.outcomes)) <= MAX_REMEMBERED
        assert len(commands.downtimes) <= MAX_REMEMBERED
    # A repeat of a recent command is answered with what happened, and not acted on.
    [again] = boundary(s, control, restart(ids[-1]))
    assert (again.kind, again.detail) == ("failed", "already failed")
    assert again.downtime == wire.Downtime(total_s=0.1)
    # One of an id that fell out is taken for a new command: judged, and answered, anew
    # (the controller never sends one: see ``tmd.runtime.commands``).
    [anew] = boundary(s, control, restart(ids[0]))
    assert anew.kind == "failed" and anew.detail.startswith("no checkpoint_dir")
    assert list(s.commands.seen)[-1] == ids[0]
