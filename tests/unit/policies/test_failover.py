"""The failover policy with machines as the unit (issue 11): a GPU's fault moves the job
on that machine and says which GPU; with no standby machine of the right size the job
restarts without it, and the machine is decided about again once that is over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tmd import wire
from tmd.clock import SystemClock
from tmd.config import ActuatorConfig, GuardrailsConfig
from tmd.daemon import events
from tmd.daemon.actuator import Actuator
from tmd.daemon.journal import Journal
from tmd.daemon.plugins import Context
from tmd.daemon.view import ClusterView
from tmd.detectors.gpu_health import GpuHealthConfig, GpuHealthDetector
from tmd.policies.failover import FailoverConfig, FailoverPolicy

T0 = 1_800_000_000.0


def job_status(
    machines: list[str], standbys: dict[str, int], *, generation: int = 0, ts: float = T0
) -> wire.JobStatus:
    """Job "a" on ``machines`` of two ranks each, with ready standby machines of the
    given slots."""
    return wire.JobStatus(
        ts=ts, job="a", generation=generation, world_size=2 * len(machines),
        members=[wire.Member(2 * m + i, n, i) for m, n in enumerate(machines) for i in (0, 1)],
        standbys=[wire.StandbyInfo(node=n, state="ready", slots=k) for n, k in standbys.items()],
    )  # fmt: skip


def setup(standbys: dict[str, int]) -> tuple[ClusterView, FailoverPolicy]:
    view = ClusterView()
    view.apply_job_status(job_status(["h0", "h1"], standbys), T0)
    # Another job on other machines: a fault on h1 is none of its business.
    view.apply_job_status(
        wire.JobStatus(ts=T0, job="b", generation=0, world_size=1, members=[wire.Member(0, "h9")]),
        T0,
    )
    return view, FailoverPolicy(FailoverConfig(), context=Context(view=view, clock=SystemClock()))


def decided(out: Any) -> list[tuple[str, str, str]]:
    return [(type(d).__name__, getattr(d, "job", ""), getattr(d, "node", "")) for d in out]


def test_an_xid_on_a_machines_gpu_moves_the_job_on_that_machine_and_names_the_gpu() -> None:
    view, policy = setup({"s1": 1, "s2": 2})
    detector = GpuHealthDetector(GpuHealthConfig(), context=Context(view=view, clock=SystemClock()))
    xid = wire.XidEvent(ts=T0, node="h1", gpu=1, xid=79)  # what the agent on h1 publishes
    [fault] = detector.observe(xid, T0)
    assert isinstance(fault, events.GpuFault) and (fault.node, fault.gpu) == ("h1", 1)
    [decision] = policy.observe(fault, T0)
    assert isinstance(decision, events.Migrate)
    assert (decision.job, decision.node) == ("a", "h1")  # the machine, every rank on it
    assert decision.reason == "GpuFault on h1 GPU 1: xid 79"
    assert view.ready_standbys("a", leaver="h1") == ["s2"]  # the standby that fits


def test_without_a_standby_machine_of_its_size_the_job_restarts_without_it() -> None:
    _, policy = setup({"s1": 1})
    fault = events.GpuFault(ts=T0, node="h0", gpu=5, cause="xid 48")
    [decision] = policy.observe(fault, T0)
    assert isinstance(decision, events.CheckpointRestart)
    assert decision.reason == (
        "GpuFault on h0 GPU 5: xid 48; no ready standby of 2 slots, so restart from the last "
        "checkpoint"
    )


@pytest.fixture
def actuator(tmp_path: Path) -> Any:
    def make(view: ClusterView, emitted: list[events.Event]) -> Actuator:
        return Actuator(
            config=ActuatorConfig(resend_s=5, switch_timeout_s=20),
            guard=GuardrailsConfig(min_standby_pool=0), view=view,
            journal=Journal(tmp_path / "j.sqlite3"), emit=lambda e, _source: emitted.append(e),
        )  # fmt: skip

    return make


def test_the_machine_is_decided_about_again_once_the_restart_is_over(actuator: Any) -> None:
    view, policy = setup({})
    emitted: list[events.Event] = []
    act = actuator(view, emitted)
    act.on_event(job_status(["h0", "h1"], {}), T0)
    fault = events.GpuFault(ts=T0, node="h1", gpu=0, cause="xid 79")
    [decision] = policy.observe(fault, T0)
    assert isinstance(decision, events.CheckpointRestart)
    [command] = act.on_event(decision, T0)
    assert isinstance(command, wire.Restart) and command.node == "h1"
    assert list(policy.observe(fault, T0 + 1)) == []  # one decision while it runs
    answer = wire.Ack(ts=T0, job="a", migration_id=command.migration_id, kind="restarting",
                      node="h0", rank=0, local_rank=0)  # fmt: skip
    act.on_event(answer, T0 + 2)
    [finished] = emitted
    assert isinstance(finished, events.MigrationFinished) and finished.outcome == "done"
    list(policy.observe(finished, T0 + 2))
    # The job has not restarted yet: decided again, the actuator does not ask twice.
    [again] = policy.observe(fault, T0 + 3)
    assert act.on_event(again, T0 + 3) == []
    [hold] = emitted[1:]
    assert isinstance(hold, events.Hold) and hold.held == "failover"
    list(policy.observe(hold, T0 + 3))
    assert decided(policy.observe(fault, T0 + 4)) == [("CheckpointRestart", "a", "h1")]


def test_a_new_run_or_a_machine_that_left_is_decided_about_anew() -> None:
    _, policy = setup({})
    fault = events.GpuFault(ts=T0, node="h1", gpu=0, cause="xid 79")
    assert len(list(policy.observe(fault, T0))) == 1
    assert list(policy.observe(fault, T0)) == []
    list(policy.observe(events.JobRestarted(ts=T0, job="b", generation=0, step=0), T0))
    assert list(policy.observe(fault, T0)) == []  # another job's restart
    list(policy.observe(events.JobRestarted(ts=T0, job="a", generation=0, step=40), T0))
    assert len(list(policy.observe(fault, T0))) == 1
    list(policy.observe(job_status(["h0", "h1"], {}, generation=1), T0))
    assert list(policy.observe(fault, T0)) == []  # h1 still a member
    list(policy.observe(job_status(["h0", "h2"], {}, generation=2), T0))  # h1 left
    assert len(list(policy.observe(fault, T0))) == 1  # the view still has h1 in job a


def test_a_migration_held_while_the_job_restarts_is_decided_again(actuator: Any) -> None:
    # An XID is reported once: the policy must not keep a decision the actuator dropped.
    view, policy = setup({"s2": 2})
    emitted: list[events.Event] = []
    act = actuator(view, emitted)
    act.on_event(job_status(["h0", "h1"], {"s2": 2}), T0)
    other = events.CheckpointRestart(ts=T0, policy="alert", job="a", node="h0", reason="x")
    [command] = act.on_event(other, T0)  # the job is restarting without h0
    assert isinstance(command, wire.Restart)
    fault = events.GpuFault(ts=T0, node="h1", gpu=1, cause="xid 79")
    [decision] = policy.observe(fault, T0 + 1)
    assert isinstance(decision, events.Migrate)
    assert act.on_event(decision, T0 + 1) == []
    [hold] = [e for e in emitted if isinstance(e, events.Hold)]
    assert "is restarting from its checkpoint" in hold.reason and hold.held == "failover"
    assert list(policy.observe(hold, T0 + 1)) == []
    assert decided(policy.observe(fault, T0 + 2)) == [("Migrate", "a", "h1")]
