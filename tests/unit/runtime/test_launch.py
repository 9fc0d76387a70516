"""When ``tmd launch`` starts a job again: a pure decision over exit statuses."""

from __future__ import annotations

import pytest

from tmd import wire
from tmd.runtime.checkpoint import EX_RESTART
from tmd.runtime.launch import ProcessSpec, needs_restart, next_plan, plan

MEMBERS = ["worker0", "worker1", "worker2"]
KILLED = -9


@pytest.mark.parametrize(
    ("codes", "stopped", "restart"),
    [
        # Running normally, or one rank killed and a standby replacing it.
        ({"worker0": None, "worker1": None, "worker2": None}, False, False),
        ({"worker0": None, "worker1": KILLED, "worker2": None, "standby0": None}, False, False),
        # A survivor could not recover in place: at once, whatever else still runs.
        ({"worker0": EX_RESTART, "worker1": KILLED, "worker2": None}, False, True),
        # Every member ended and one of them badly: nobody is left to ask for it.
        ({"worker0": KILLED, "worker1": KILLED, "worker2": KILLED, "standby0": None}, False, True),
        ({"worker0": 1, "worker1": 0, "worker2": 0}, False, True),
        # A clean end, or one the job reported as stopped.
        ({"worker0": 0, "worker1": 0, "worker2": 0, "standby0": None}, False, False),
        ({"worker0": 0, "worker1": 0, "worker2": 3}, True, False),
        # A standby that failed is no member: the job goes on.
        ({"worker0": None, "worker1": None, "worker2": None, "standby0": 3}, False, False),
    ],
)
def test_needs_restart(codes: dict[str, int | None], stopped: bool, restart: bool) -> None:
    assert needs_restart(codes, MEMBERS, stopped=stopped) is restart


def test_members_come_from_the_status_after_a_failover() -> None:
    # standby0 holds rank 1 now; the killed worker1 no longer counts.
    members = ["worker0", "standby0", "worker2"]
    codes = {"worker0": None, "worker1": KILLED, "worker2": None, "standby0": None}
    assert not needs_restart(codes, members, stopped=False)
    codes = {"worker0": 0, "worker1": KILLED, "worker2": 0, "standby0": KILLED}
    assert needs_restart(codes, members, stopped=False)


def _status(members: list[tuple[str, int]], excluded: list[str] | None = None) -> wire.JobStatus:
    return wire.JobStatus(
        ts=1.0, job="j", generation=1, world_size=len(members), state="restarting",
        members=[wire.Member(r, node, local) for r, (node, local) in enumerate(members)],
        excluded=excluded or [],
    )  # fmt: skip


def _layout(specs: list[ProcessSpec]) -> list[tuple[str, str, int, int]]:
    return [(s.role, s.node, s.rank, s.local_rank) for s in specs]


def test_the_plan_has_machines_of_k_ranks_and_standby_machines_of_k_slots() -> None:
    specs = plan(4, 1, nproc_per_node=2)
    assert _layout(specs) == [
        ("worker", "worker0", 0, 0), ("worker", "worker0", 1, 1),
        ("worker", "worker1", 2, 0), ("worker", "worker1", 3, 1),
        ("standby", "standby0", 0, 0), ("standby", "standby0", 0, 1),
    ]  # fmt: skip
    assert [s.name for s in specs][:2] == ["worker0/0", "worker0/1"]
    assert [s.name for s in plan(2, 1)] == ["worker0", "worker1", "standby0"]
    with pytest.raises(ValueError, match="multiple"):
        plan(3, 0, nproc_per_node=2)


def test_a_restart_without_a_machine_puts_a_standby_machine_in_its_place() -> None:
    specs = plan(4, 1, nproc_per_node=2)
    status = _status([("worker0", 0), ("worker0", 1), ("worker1", 0), ("worker1", 1)],
                     excluded=["worker0"])  # fmt: skip
    planned, stays = next_plan(specs, status, nproc_per_node=2)
    assert stays == []
    assert _layout(planned) == [
        ("worker", "standby0", 0, 0), ("worker", "standby0", 1, 1),
        ("worker", "worker1", 2, 0), ("worker", "worker1", 3, 1),
    ]  # fmt: skip
    # No standby machine left: the excluded machine is started again, and said so.
    planned, stays = next_plan(planned, _status(
        [("standby0", 0), ("standby0", 1), ("worker1", 0), ("worker1", 1)], excluded=["worker1"]
    ), nproc_per_node=2)  # fmt: skip
    assert stays == ["worker1"] and ("worker", "worker1", 2, 0) in _layout(planned)


def test_after_a_migration_the_next_start_follows_the_last_status() -> None:
    # worker1 moved to standby0 during the run, then the job restarts without worker0:
    # worker1 is not started again, and no standby machine is left for worker0.
    specs = plan(4, 1, nproc_per_node=2)
    status = _status([("worker0", 0), ("worker0", 1), ("standby0", 0), ("standby0", 1)],
                     excluded=["worker0"])  # fmt: skip
    planned, stays = next_plan(specs, status, nproc_per_node=2)
    assert "worker1" not in {s.node for s in planned}
    assert _layout(planned) == [
        ("worker", "worker0", 0, 0), ("worker", "worker0", 1, 1),
        ("worker", "standby0", 2, 0), ("worker", "standby0", 3, 1),
    ]  # fmt: skip
    assert stays == ["worker0"]
