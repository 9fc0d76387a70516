"""``Session.reconfigure``, the one way a process changes group: a one-process
session on a real store, a group of one, and a control channel that records."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tmd import wire
from tmd.runtime import Session
from tmd.runtime.env import RuntimeEnv
from tmd.runtime.group import StoreAddress
from tmd.runtime.launch import host_store
from tmd.runtime.membership import Membership, Reconfiguration
from tmd.runtime.timing import PendingSwitch


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _LoneGroup:
    """A group of one: every all-reduce is already done (the sum over one member)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        return _Done()


class _Recorder:
    """A ``ControlChannel`` that keeps what the session sends and sends no commands."""

    def __init__(self) -> None:
        self.acks: list[wire.Ack] = []
        self.statuses: list[wire.JobStatus] = []

    def poll(self) -> list[wire.Prepare | wire.Switch | wire.Abort]:
        return []

    def ack(self, ack: wire.Ack) -> None:
        self.acks.append(ack)

    def publish_status(self, status: wire.JobStatus) -> None:
        self.statuses.append(status)

    def stopped(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def standbys_changed(self) -> bool:
        return False


@pytest.fixture
def standby() -> Iterator[tuple[Session, _Recorder]]:
    store = host_store(0)
    env = RuntimeEnv(role="standby", job="unit", node="spare", rank=0, world_size=1,
                     store=StoreAddress("127.0.0.1", store.port), host="127.0.0.1",
                     backend="gloo")  # fmt: skip
    model = torch.nn.Linear(3, 1)
    control = _Recorder()
    session = Session(model, torch.optim.SGD(model.parameters(), lr=0.1), env=env,
                      control=control)  # fmt: skip
    yield session, control  # the store's server lives as long as this fixture


def test_a_reconfigured_standby_is_that_rank_of_that_generation(
    standby: tuple[Session, _Recorder],
) -> None:
    s, _ = standby
    group = _LoneGroup()
    assert (s.role, s.is_shadow, s.group) == ("standby", True, None)

    s.reconfigure(Reconfiguration(group, Membership(3, ("spare",)), rank=0, median_step_s=0.25))

    assert (s.role, s.is_shadow, s.rank, s.group) == ("worker", False, 0, group)
    assert s.membership == Membership(3, ("spare",))
    assert (s.telemetry.rank, s.telemetry.generation) == (0, 3)
    assert s.timing.median_step_s() == 0.25  # the first step is measured against it


def test_a_switch_is_acked_with_its_downtime_once_the_first_step_on_the_new_group_ends(
    standby: tuple[Session, _Recorder],
) -> None:
    s, control = standby
    resumed = time.monotonic()
    pending = PendingSwitch("m1", last_step_end=resumed - 0.5, resumed=resumed, switch_s=0.5)
    change = Reconfiguration(
        _LoneGroup(), Membership(1, ("spare",)), rank=0, switch=pending, median_step_s=0.0
    )
    s.reconfigure(change)
    assert control.acks == []  # nothing to say before the first step has ended

    s.state.model(torch.ones(2, 3)).sum().backward()
    s.step()

    (ack,) = control.acks
    assert (ack.migration_id, ack.kind, ack.generation, ack.rank) == ("m1", "switched", 1, 0)
    assert ack.downtime is not None and ack.downtime == s.last_downtime
    assert ack.downtime.switch_s == 0.5
    assert ack.downtime.total_s >= 0.5  # from the end of the last step before the switch
    assert s.state.step == 1


def test_a_model_nobody_would_average_or_tmd_could_not_move_is_refused_at_start() -> None:
    from tmd.errors import ConfigError
    from tmd.runtime.session import _wrapped
    from tmd.runtime.state import TrainState

    model = torch.nn.Linear(2, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _wrapped(model, state, installed=False) is False  # the session averages
    # parallel.init() ran, but no wrapper holds the model: nobody would average.
    with pytest.raises(ConfigError, match="no parameter is a DTensor"):
        _wrapped(model, state, installed=True)
    # DDP: on a group tmd cannot swap it is refused; on one it can, DDP reduces.
    import torch.distributed as dist

    from tmd.runtime import swap_group

    fixed = swap_group.shell(dist.ProcessGroupGloo(dist.HashStore(), 0, 1), rank=0, size=1,
                             store=dist.HashStore())  # fmt: skip
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=fixed, init_sync=False)
    with pytest.raises(ConfigError, match="DistributedDataParallel on a process group"):
        _wrapped(ddp, TrainState(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)))
    swappable = swap_group.SwappableGroup(0, 1)
    swappable.swap(swap_group.Loopback(0, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=swappable,
                                                    init_sync=False)  # fmt: skip
    assert _wrapped(ddp, TrainState(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))) is True
