"""What ``/metrics`` tells an operator about the cluster (``tmd.daemon.metrics``), read
from a daemon's registry as Prometheus would scrape it, without a broker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.clock import FakeClock
from tmd import config as config_mod
from tmd import wire
from tmd.daemon import events
from tmd.daemon.daemon import Daemon

TS = 1_800_000_000.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    config = config_mod.from_dict({"journal": {"path": str(tmp_path / "j.sqlite3")}})
    d = Daemon(config, clock=FakeClock(TS))
    yield d
    d.journal.close()


def value(daemon: Daemon, name: str, **labels: str) -> float | None:
    return daemon.metrics.registry.get_sample_value(name, labels)


def status(job: str, members: list[str], standbys: dict[str, str]) -> wire.JobStatus:
    return wire.JobStatus(
        ts=TS, job=job, generation=0, world_size=len(members),
        members=[wire.Member(rank=r, node=n) for r, n in enumerate(members)],
        standbys=[wire.StandbyInfo(node=n, state=s)  # type: ignore[arg-type]
                  for n, s in standbys.items()],
    )  # fmt: skip


def node(name: str, *, state: str = "online", role: str = "worker") -> wire.NodeStatus:
    return wire.NodeStatus(ts=TS, node=name, state=state, role=role)  # type: ignore[arg-type]


def test_machines_and_each_jobs_standbys_are_counted_when_scraped(daemon: Daemon) -> None:
    view = daemon.view
    view.apply_job_status(
        status("a", ["n0", "n1"], {"s0": "ready", "s1": "warming", "s2": "ready"}), TS
    )
    machines = [("n0", "online", "worker"), ("n1", "online", "worker"),
                ("s0", "online", "standby"), ("s2", "offline", "standby")]  # fmt: skip
    for name, state, role in machines:
        view.apply_node_status(node(name, state=state, role=role), TS)
    view.apply_gpu(wire.NodeGpu(ts=TS, node="x0"), TS)  # a sample before any status
    daemon.emit(events.GpuFault(ts=TS, node="s0", gpu=3, cause="xid 79"), "gpu_health")

    assert value(daemon, "tmd_machines", role="worker", state="online") == 3  # x0: a sample
    assert value(daemon, "tmd_machines", role="standby", state="online") == 1
    assert value(daemon, "tmd_machines", role="standby", state="offline") == 1
    assert value(daemon, "tmd_machines", role="worker", state="unknown") == 0  # every pair
    assert value(daemon, "tmd_machines_out_of_service", cause="gpu_fault") == 1  # s0
    assert value(daemon, "tmd_machines_out_of_service", cause="lost") == 1  # s2, offline
    assert value(daemon, "tmd_job_standbys", tmd_job="a", state="ready") == 2
    assert value(daemon, "tmd_job_standbys", tmd_job="a", state="warming") == 1
    assert value(daemon, "tmd_job_standbys", tmd_job="a", state="failed") == 0
    # s0 has a faulty GPU and s2 is offline: no standby can take a machine of the job.
    assert value(daemon, "tmd_job_standbys_ready", tmd_job="a") == 0
    assert value(daemon, "tmd_view_jobs") == 1 and value(daemon, "tmd_view_nodes") == 5

    view.apply_node_status(node("s0", role="standby"), TS + 2)  # its agent restarted
    assert value(daemon, "tmd_machines_out_of_service", cause="gpu_fault") == 0
    assert value(daemon, "tmd_job_standbys_ready", tmd_job="a") == 1
    assert view.forget_job("a")
    assert value(daemon, "tmd_job_standbys_ready", tmd_job="a") is None


def test_a_slow_machine_is_exported_while_it_is_flagged_and_in_its_job(daemon: Daemon) -> None:
    view = daemon.view
    view.apply_job_status(status("a", ["n0", "n1", "n2"], {"s0": "ready"}), TS)

    def found(slowdown: float) -> None:
        daemon.emit(events.StragglerFound(ts=TS, job="a", node="n1", slowdown=slowdown,
                                          confidence=0.9, since_step=10), "straggler")  # fmt: skip

    def finished(outcome: str) -> None:
        daemon.emit(events.MigrationFinished(ts=TS, migration_id=f"m-{outcome}", job="a",
                                             node="n1", to="s0", outcome=outcome),  # type: ignore[arg-type]
                    "actuator")  # fmt: skip

    def slowdown() -> float | None:
        return value(daemon, "tmd_straggler_slowdown", tmd_job="a", node="n1")

    assert slowdown() is None
    found(0.25)
    assert slowdown() == 0.25
    daemon.emit(events.StragglerCleared(ts=TS, job="a", node="n1"), "straggler")
    assert slowdown() is None
    found(0.3)
    finished("aborted")  # still in the job, as slow as it was
    assert slowdown() == 0.3
    finished("done")  # moved away
    assert slowdown() is None
    found(0.4)
    view.apply_job_status(status("a", ["n0", "s0", "n2"], {}), TS)  # a failover replaced it
    assert slowdown() is None
    assert ("a", "n1") in daemon.stragglers.by_key  # a scrape forgets nothing...
    daemon.housekeep(TS)
    assert daemon.stragglers.by_key == {}  # ... the housekeeping does
    view.apply_job_status(status("a", ["n0", "n1", "n2"], {}), TS)
    found(0.5)
    assert slowdown() == 0.5
    assert view.forget_job("a")
    assert slowdown() is None
    daemon.housekeep(TS)
    assert daemon.stragglers.by_key == {}  # nor kept for a job the view forgot


def test_a_scrape_changes_nothing_in_the_view(daemon: Daemon) -> None:
    """A fault its agent got over is forgotten by the policies' and the actuator's
    questions, not by Prometheus's: a scrape only reads."""
    view = daemon.view
    view.apply_job_status(status("a", ["n0"], {"s0": "ready", "s1": "ready"}), TS)
    view.apply_node_status(node("s0", role="standby"), TS)
    daemon.emit(events.GpuFault(ts=TS, node="s0", gpu=0, cause="xid 79"), "gpu_health")
    daemon.emit(events.NodeLost(ts=TS, node="s1", cause="heartbeat"), "node_liveness")
    view.apply_node_status(node("s0", role="standby"), TS + 1)  # its agent restarted
    view.apply_node_status(node("s1", role="standby"), TS + 1)  # and this one spoke again
    noted = (dict(view._faults), dict(view._lost))
    assert len(noted[0]) == len(noted[1]) == 1
    assert value(daemon, "tmd_machines_out_of_service", cause="gpu_fault") == 0
    assert value(daemon, "tmd_machines_out_of_service", cause="lost") == 0
    assert value(daemon, "tmd_job_standbys_ready", tmd_job="a") == 2
    assert (view._faults, view._lost) == noted


def test_counters_operators_alert_on_are_exported_from_zero(daemon: Daemon) -> None:
    """``increase`` over a series that appears with its first event sees no increase:
    the alerts on failed migrations and plug-in restarts would miss the first one."""
    policies = {s.name for s in daemon.specs if s.kind == "policies"}
    assert {"alert", "drain", "failover", "rebalance"} <= policies  # enabled by default
    for outcome in ("done", "aborted", "failed"):
        assert value(daemon, "tmd_restarts_total", outcome=outcome) == 0
        # Every policy the daemon runs, and the runtime (its own failovers), from the
        # start: one resumed after a restart, or the runtime's, may start and end
        # between two scrapes.
        for policy in (*policies, "runtime"):
            assert value(daemon, "tmd_migrations_total", outcome=outcome, policy=policy) == 0
        assert value(daemon, "tmd_migrations_total", outcome=outcome, policy="fpi") is None
    for kind in events.ALL:
        assert value(daemon, "tmd_events_total", kind=kind.__name__) == 0
    daemon.metrics.migration_started("fpi")  # a migration of a policy since disabled
    daemon.metrics.plugin_started("straggler")
    assert value(daemon, "tmd_migrations_total", outcome="failed", policy="fpi") == 0
    assert value(daemon, "tmd_plugin_restarts_total", plugin="straggler") == 0


def test_no_metric_has_a_label_prometheus_sets_itself(daemon: Daemon) -> None:
    """A training job is ``tmd_job``: a label ``job`` would be renamed ``exported_job``
    by the scrape (``job`` is the scrape job), one ``instance`` likewise."""
    daemon.view.apply_job_status(status("a", ["n0", "n1"], {"s0": "ready"}), TS)
    daemon.view.apply_node_status(node("n0"), TS)
    daemon.emit(events.StragglerFound(ts=TS, job="a", node="n1", slowdown=0.2,
                                      confidence=0.9, since_step=1), "straggler")  # fmt: skip
    daemon.metrics.migration_started("rebalance")
    labels = {
        name
        for family in daemon.metrics.registry.collect()
        for sample in family.samples
        for name in sample.labels
    }
    assert {"tmd_job", "node", "kind", "outcome", "policy", "reason", "state"} <= labels
    assert not labels & {"job", "instance"}


def test_ready_standbys_are_those_of_the_job_s_worst_off_machine(daemon: Daemon) -> None:
    """A standby takes a machine of as many slots and of its GPU model: a job whose
    one ready standby fits only some of its machines is not covered."""
    view = daemon.view

    def gpu(name: str, model: str) -> None:
        gpus = [wire.GpuInfo(index=0, name=model)]
        view.apply_node_status(wire.NodeStatus(ts=TS, node=name, state="online", gpus=gpus), TS)

    def ready() -> float | None:
        return value(daemon, "tmd_job_standbys_ready", tmd_job="a")

    for name, model in (("n0", "H100"), ("n1", "A100"), ("s0", "H100"), ("s1", "A100")):
        gpu(name, model)
    view.apply_job_status(status("a", ["n0", "n1"], {"s0": "ready"}), TS)
    assert ready() == 0  # s0 could take n0, not n1
    view.apply_job_status(status("a", ["n0", "n1"], {"s0": "ready", "s1": "ready"}), TS)
    assert ready() == 1
    # Machines of two ranks each: a standby of one slot takes none of them.
    two = wire.JobStatus(
        ts=TS, job="a", generation=1, world_size=4,
        members=[wire.Member(r, n, r % 2) for r, n in enumerate(["n0", "n0", "n1", "n1"])],
        standbys=[wire.StandbyInfo(node="s0", state="ready", slots=2),
                  wire.StandbyInfo(node="s1", state="ready", slots=1)],
    )  # fmt: skip
    view.apply_job_status(two, TS)
    assert ready() == 0  # s1 (A100) has one slot: n1 has no standby
    assert view.ready_standbys("a") == ["s0", "s1"]  # what ignoring slots would count


def test_each_job_s_state_is_exported_one_series_a_state(daemon: Daemon) -> None:
    """What the alert on ready standbys reads to leave out a job that ended: the view
    keeps it (with no standby left to it) until ``ingest.forget_after_s``."""

    def states() -> dict[str, float | None]:
        names = ("running", "migrating", "restarting", "stopped", "unknown")
        return {s: value(daemon, "tmd_job_state", tmd_job="a", state=s) for s in names}

    view = daemon.view
    view.apply_job_status(status("a", ["n0"], {"s0": "ready"}), TS)
    assert states() == {"running": 1, "migrating": 0, "restarting": 0, "stopped": 0,
                        "unknown": 0}  # fmt: skip
    ended = wire.JobStatus(ts=TS + 1, job="a", generation=1, world_size=1,
                           members=[wire.Member(0, "s0")], state="stopped")  # fmt: skip
    view.apply_job_status(ended, TS + 1)
    assert states()["stopped"] == 1 and sum(v or 0 for v in states().values()) == 1
    assert value(daemon, "tmd_job_standbys_ready", tmd_job="a") == 0
    step = wire.StepTiming(1, TS, 1.0, 0.5, 0.4, 0.05, 0.05)
    view.apply_iter(wire.IterBatch(ts=TS, job="b", rank=0, node="n9", steps=[step]), TS)
    assert value(daemon, "tmd_job_state", tmd_job="b", state="unknown") == 1


def test_every_stall_of_the_event_loop_is_counted_not_only_the_last_lag(daemon: Daemon) -> None:
    """The lag gauge holds the last measurement (about one a second): a stall between
    two scrapes is gone from it by the next one, not from the counter."""
    assert value(daemon, "tmd_event_loop_stalls_total") == 0
    for lag in (0.01, 7.0, 0.02, 4.9, 5.0, 0.01):
        daemon.metrics.loop_lagged(lag)
    assert value(daemon, "tmd_event_loop_lag_seconds") == 0.01
    assert value(daemon, "tmd_event_loop_stalls_total") == 2
