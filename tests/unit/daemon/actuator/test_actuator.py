"""The actuator's state machine, on an injected clock, a real SQLite journal and the
real cluster view; the runtime's side is played by the acks and statuses it sends."""

from __future__ import annotations

from pathlib import Path

import pytest

from tmd import wire
from tmd.config import ActuatorConfig
from tmd.daemon import events
from tmd.daemon.actuator import RUNTIME_ACK_GRACE_S, Actuator
from tmd.daemon.actuator.guardrails import GuardrailsConfig
from tmd.daemon.actuator.resume import policy_of
from tmd.daemon.journal import Journal, MigrationRow
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import ClusterView

T0 = 1_800_000_000.0
JOB = "train"
WORKERS = ["w0", "w1", "w2"]


def status(
    generation: int = 0,
    members: list[str] | None = None,
    standbys: dict[str, str] | None = None,
    state: str = "running",
    ts: float = T0,
) -> wire.JobStatus:
    nodes = WORKERS if members is None else members
    ready = {"s0": "ready"} if standbys is None else standbys
    return wire.JobStatus(
        ts=ts, job=JOB, generation=generation, world_size=len(nodes),
        members=[wire.Member(r, n) for r, n in enumerate(nodes)],
        standbys=[wire.StandbyInfo(node=n, state=s, warmup_s=1.0) for n, s in ready.items()],  # type: ignore[arg-type]
        state=state,  # type: ignore[arg-type]
    )  # fmt: skip


def ack(mid: str, kind: str, node: str, total_s: float | None = None) -> wire.Ack:
    downtime = wire.Downtime(total_s=total_s, switch_s=total_s / 2) if total_s else None
    return wire.Ack(ts=T0, job=JOB, migration_id=mid, kind=kind, node=node, downtime=downtime)  # type: ignore[arg-type]


def migrate(node: str = "w2", policy: str = "alert", to: str | None = None) -> events.Migrate:
    return events.Migrate(ts=T0, policy=policy, job=JOB, node=node, reason="test", to=to)


class Harness:
    def __init__(self, path: Path, *, metrics: Metrics | None = None, **guard: object) -> None:
        self.path = path
        self.metrics = metrics
        self.view = ClusterView()
        self.journal = Journal(path)
        self.emitted: list[events.Event] = []
        self.guard = GuardrailsConfig(**{"min_standby_pool": 0, **guard})  # type: ignore[arg-type]
        self.actuator = self._actuator()

    def _actuator(self) -> Actuator:
        return Actuator(
            config=ActuatorConfig(prepare_timeout_s=30, switch_timeout_s=20, resend_s=5),
            guard=self.guard, view=self.view, journal=self.journal, emit=self.emit,
            metrics=self.metrics,
        )  # fmt: skip

    def emit(self, event: events.Event, source: str) -> None:
        self.journal.record(event, source=source)
        self.emitted.append(event)

    def status(self, s: wire.JobStatus, now: float = T0) -> list[wire.Message]:
        self.view.apply_job_status(s, now)
        return self.actuator.on_event(s, now)

    def feed(self, *acks: wire.Ack, now: float = T0) -> list[wire.Message]:
        out: list[wire.Message] = []
        for a in acks:
            out += self.actuator.on_event(a, now)
        return out

    def restart(self) -> None:
        """A new daemon process on the same journal file and a fresh view."""
        self.journal.close()
        self.journal = Journal(self.path)
        self.view = ClusterView()
        self.actuator = self._actuator()

    def finished(self) -> list[events.MigrationFinished]:
        return [e for e in self.emitted if isinstance(e, events.MigrationFinished)]

    def holds(self) -> list[str]:
        return [e.reason for e in self.emitted if isinstance(e, events.Hold)]


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path / "journal.sqlite3")


def start(h: Harness) -> str:
    h.status(status())
    out = h.actuator.on_event(migrate(), T0)
    assert [type(m) for m in out] == [wire.Prepare]
    prepare = out[0]
    assert isinstance(prepare, wire.Prepare)
    assert (prepare.job, prepare.leaver, prepare.joiner) == (JOB, "w2", "s0")
    return prepare.migration_id


def test_prepare_switch_done_with_the_measured_downtime(h: Harness) -> None:
    mid = start(h)
    assert h.feed(ack(mid, "prepared", "w0"), ack(mid, "prepared", "w1")) == []
    out = h.feed(ack(mid, "prepared", "w2"))
    assert [type(m) for m in out] == [wire.Switch] and out[0].migration_id == mid  # type: ignore[attr-defined]
    h.status(status(1, ["w0", "w1", "s0"]), T0 + 5)
    assert h.finished() == []  # the status says switched; the downtime comes with the acks
    h.feed(ack(mid, "switched", "w0", 0.2), ack(mid, "switched", "w1", 0.25))
    h.feed(ack(mid, "switched", "w2", 9.0))  # the leaver's own number does not count
    h.feed(ack(mid, "switched", "s0", 0.3))
    h.status(status(1, ["w0", "w1", "s0"]), T0 + 6)  # again: no second migration
    [done] = h.finished()
    assert (done.outcome, done.node, done.to, done.downtime_s) == ("done", "w2", "s0", 0.3)
    row = h.journal.migration(mid)
    assert row is not None and row.state == "done"
    assert row.detail["downtime_median_s"] == 0.25
    rows = h.journal.events(kind="MigrationState")
    states = [e.body["state"] for e in rows if e.body["migration_id"] == mid]
    assert states == ["planned", "preparing", "prepared", "switching", "done"]
    assert h.actuator.flights == {} and h.actuator.guard_state.in_flight == {}
    h.feed(ack(mid, "switched", "s0", 0.3))  # a late duplicate changes nothing
    assert len(h.finished()) == 1


def test_dry_run_journals_and_sends_nothing(tmp_path: Path) -> None:
    h = Harness(tmp_path / "j.sqlite3", dry_run=True)
    h.status(status())
    assert h.actuator.on_event(migrate(), T0) == []
    assert h.actuator.on_tick(T0 + 100) == []
    [why] = h.holds()
    assert "dry run" in why and "would migrate w2 to s0" in why
    assert h.journal.in_flight() == [] and h.journal.recent_migrations(0) == []


@pytest.mark.parametrize(
    ("setup", "decision", "expect"),
    [
        (status(standbys={}), migrate(), "no ready standby"),
        (status(standbys={"s0": "warming"}), migrate(), "no ready standby"),
        (status(), migrate(node="nope"), "not a member"),
        (status(), migrate(to="s9"), "s9 is not ready"),
        (None, migrate(), "has not reported its status"),
    ],
)
def test_holds(
    h: Harness, setup: wire.JobStatus | None, decision: events.Migrate, expect: str
) -> None:
    if setup is not None:
        h.status(setup)
    assert h.actuator.on_event(decision, T0) == []
    [why] = h.holds()
    assert expect in why
    [hold] = [e for e in h.emitted if isinstance(e, events.Hold)]
    assert (hold.policy, hold.held) == ("actuator", decision.policy)


def test_one_migration_per_node_and_guardrails_apply(h: Harness) -> None:
    start(h)
    assert h.actuator.on_event(migrate(), T0 + 1) == []
    assert "already being migrated" in h.holds()[-1]
    assert h.actuator.on_event(migrate(node="w1"), T0 + 1) == []
    assert "max_concurrent_per_job" in h.holds()[-1]


def test_standby_of_another_gpu_model_is_not_picked(h: Harness) -> None:
    def node(name: str, gpu: str) -> wire.NodeStatus:
        return wire.NodeStatus(
            ts=T0, node=name, state="online", gpus=[wire.GpuInfo(index=0, name=gpu)]
        )

    for name, gpu in [("w2", "H100"), ("s0", "A100"), ("s1", "H100")]:
        h.view.apply_node_status(node(name, gpu), T0)
    h.status(status(standbys={"s0": "ready", "s1": "ready"}))
    [prepare] = h.actuator.on_event(migrate(), T0)
    assert isinstance(prepare, wire.Prepare) and prepare.joiner == "s1"


def test_a_standby_with_a_fault_is_not_picked_until_its_agent_is_back(tmp_path: Path) -> None:
    h = Harness(tmp_path / "j.sqlite3", max_concurrent_per_job=2)
    h.status(status(standbys={"s0": "ready", "s1": "ready"}))
    h.view.note_fault("s0", T0)  # a GpuFault, as the daemon notes it when emitted
    [prepare] = h.actuator.on_event(migrate(), T0 + 1)
    assert isinstance(prepare, wire.Prepare) and prepare.joiner == "s1"
    h.view.note_fault("s1", T0 + 2)  # a NodeLost
    assert h.actuator.on_event(migrate(node="w1", policy="failover"), T0 + 3) == []
    assert "no ready standby" in h.holds()[-1]  # s0 faulty, s1 lost and joining
    h.view.apply_node_status(wire.NodeStatus(ts=T0 + 4, node="s0", state="online"), T0 + 4)
    assert h.view.ready_standbys(JOB, leaver="w1") == ["s0"]


def test_resend_then_timeout_aborts(h: Harness) -> None:
    mid = start(h)
    h.feed(ack(mid, "prepared", "w0"))
    [again] = h.actuator.on_tick(T0 + 6)
    assert isinstance(again, wire.Prepare) and again.migration_id == mid
    assert h.actuator.on_tick(T0 + 7) == []
    [abort] = h.actuator.on_tick(T0 + 31)
    assert isinstance(abort, wire.Abort) and "w1, w2" in abort.reason
    h.feed(ack(mid, "aborted", "w0"), ack(mid, "aborted", "w1"), ack(mid, "aborted", "w2"))
    [end] = h.finished()
    assert end.outcome == "aborted"


def test_a_switch_that_beat_the_abort_is_done(h: Harness) -> None:
    mid = start(h)
    h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    [abort] = h.actuator.on_tick(T0 + 21)  # the switch timed out ...
    assert isinstance(abort, wire.Abort)
    h.feed(*(ack(mid, "switched", n, 0.4) for n in ["w0", "w1", "s0"]))  # ... but happened
    [end] = h.finished()
    assert (end.outcome, end.downtime_s) == ("done", 0.4)


def test_a_refusal_aborts_and_refusers_count_as_out(h: Harness) -> None:
    mid = start(h)
    [abort] = h.feed(ack(mid, "failed", "w1"))
    assert isinstance(abort, wire.Abort) and "w1 failed" in abort.reason
    h.feed(ack(mid, "aborted", "w0"), ack(mid, "aborted", "w2"))
    [end] = h.finished()
    assert end.outcome == "aborted"


def test_abort_unconfirmed_is_failed_unless_the_status_shows_the_old_group(h: Harness) -> None:
    mid = start(h)
    h.feed(ack(mid, "failed", "w1"))
    h.status(status(state="migrating"), T0 + 1)
    h.actuator.on_tick(T0 + 100)
    [end] = h.finished()
    assert end.outcome == "failed"
    assert h.journal.migration(mid).state == "failed"  # type: ignore[union-attr]


def test_acks_before_the_status_are_not_mistaken_for_a_runtime_failover(h: Harness) -> None:
    mid = start(h)
    h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    h.feed(*(ack(mid, "switched", n, 0.1) for n in ["w0", "w1", "s0"]))
    h.status(status(1, ["w0", "w1", "s0"]), T0 + 6)
    h.actuator.on_tick(T0 + 100)
    assert [e.migration_id for e in h.finished()] == [mid]


def test_switched_by_status_completes_when_the_acks_are_lost(h: Harness) -> None:
    mid = start(h)
    h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    h.status(status(1, ["w0", "w1", "s0"]), T0 + 2)
    assert h.actuator.on_tick(T0 + 30) == []
    [end] = h.finished()
    assert end.outcome == "done" and end.downtime_s is None


@pytest.mark.parametrize("killed_after", ["preparing", "prepared"])
def test_restart_resumes_and_finishes_exactly_once(h: Harness, killed_after: str) -> None:
    mid = start(h)
    if killed_after == "prepared":
        h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    h.restart()
    h.status(status(state="migrating"), T0 + 10)  # the retained status, on subscribe
    [command] = h.actuator.reconcile(T0 + 12)
    want = wire.Prepare if killed_after == "preparing" else wire.Switch
    assert isinstance(command, want) and command.migration_id == mid
    if killed_after == "preparing":  # the members answer the repeat
        [switch] = h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
        assert isinstance(switch, wire.Switch)
    h.feed(*(ack(mid, "switched", n, 0.2) for n in ["w0", "w1", "s0"]))
    assert [e.outcome for e in h.finished()] == ["done"]
    finished = h.journal.events(kind="MigrationFinished")
    assert [e.body["migration_id"] for e in finished] == [mid]
    resumed = [e.body for e in h.journal.events(kind="MigrationState") if e.body.get("resumed")]
    assert [r["state"] for r in resumed] == [
        "preparing" if killed_after == "preparing" else "switching"
    ]
    assert h.journal.in_flight() == []


def test_a_migration_stopped_before_its_prepare_is_prepared_on_resume(h: Harness) -> None:
    h.status(status())
    h.journal.begin_migration(id="m1", job=JOB, leaver="w2", joiner="s0", reason="alert: x",
                              ts=T0)  # fmt: skip
    h.restart()
    h.status(status(), T0 + 5)
    [prepare] = h.actuator.reconcile(T0 + 6)
    assert isinstance(prepare, wire.Prepare) and prepare.migration_id == "m1"
    row = h.journal.migration("m1")
    assert row is not None and row.state == "preparing" and row.detail["resumed"]
    assert row.detail["members"] == WORKERS


def test_restart_after_the_switch_finishes_from_the_status(h: Harness) -> None:
    mid = start(h)
    h.restart()
    h.status(status(1, ["w0", "w1", "s0"]), T0 + 10)
    assert h.actuator.reconcile(T0 + 12) == []
    [end] = h.finished()
    assert (end.migration_id, end.outcome) == (mid, "done")
    assert h.actuator.guard_state.in_flight == {}
    assert h.actuator.guard_state.last_on_node["w2"] == T0  # when it started, not resumed


def test_guardrails_remember_recent_migrations_across_a_restart(tmp_path: Path) -> None:
    h = Harness(tmp_path / "j.sqlite3", node_cooldown_s=600)
    mid = start(h)
    h.feed(*(ack(mid, "aborted", n) for n in WORKERS))
    h.restart()
    h.status(status())
    h.actuator.reconcile(T0 + 60)
    assert h.actuator.on_event(migrate(), T0 + 60) == []
    assert "node_cooldown_s" in h.holds()[-1]


def test_a_failover_the_runtime_did_is_journaled(h: Harness) -> None:
    h.status(status())
    h.status(status(1, ["w0", "s0", "w2"], standbys={}), T0 + 3)
    h.feed(ack("failover-g0", "switched", "w0", 1.1))
    [end] = h.finished()
    assert (end.node, end.to, end.outcome, end.downtime_s) == ("w1", "s0", "done", 1.1)
    assert h.actuator.on_event(migrate(node="w1", policy="failover"), T0 + 4) == []
    assert "already replaced by s0" in h.holds()[-1]


def test_a_runtime_failover_whose_ack_came_first_or_never(h: Harness) -> None:
    h.status(status())
    h.feed(ack("failover-g0", "switched", "w0", 0.9))
    h.status(status(1, ["w0", "s0", "w2"], standbys={}), T0 + 3)
    h.status(status(2, ["w0", "s0", "s1"], standbys={}), T0 + 4)
    assert h.finished()[0].downtime_s == 0.9
    h.actuator.on_tick(T0 + 4 + RUNTIME_ACK_GRACE_S)
    assert [(e.node, e.downtime_s) for e in h.finished()] == [("w1", 0.9), ("w2", None)]


@pytest.mark.parametrize("ack_first", [False, True])
def test_our_migration_of_a_machine_the_runtime_replaced_ends_on_the_runtime_s_answer(
    h: Harness, ack_first: bool
) -> None:
    # The failover policy asked to move w2, whose processes had died; the runtime's own
    # failover put the same ready standby in its place first. The stayers never answer
    # our migration id, so the runtime's one answer ends it, not the switch timeout.
    mid = start(h)
    replaced = status(1, ["w0", "w1", "s0"], standbys={})
    runtime = wire.Ack(ts=T0, job=JOB, migration_id="failover-g0", kind="switched", node="w0",
                       generation=1, detail="w2 replaced by s0",
                       downtime=wire.Downtime(total_s=0.8))  # fmt: skip
    if ack_first:
        h.feed(runtime, now=T0 + 2)
        h.status(replaced, T0 + 3)
    else:
        h.status(replaced, T0 + 3)
        assert h.finished() == []
        h.feed(runtime, now=T0 + 4)
    [end] = h.finished()
    assert (end.migration_id, end.outcome, end.node, end.to) == (mid, "done", "w2", "s0")
    assert end.downtime_s == 0.8
    assert h.journal.migration(mid).state == "done"  # type: ignore[union-attr]
    assert h.actuator.guard_state.in_flight == {}


def test_one_runtime_failover_of_two_machines_ends_ours_and_its_own(h: Harness) -> None:
    mid = start(h)  # ours: w2 to s0; the runtime replaced w1 with s1 and w2 with s0
    h.status(status(1, ["w0", "s1", "s0"], standbys={}), T0 + 3)
    h.feed(wire.Ack(ts=T0, job=JOB, migration_id="failover-g0", kind="switched", node="w0",
                    generation=1, detail="w1 replaced by s1, w2 replaced by s0",
                    downtime=wire.Downtime(total_s=0.6)), now=T0 + 4)  # fmt: skip
    ended = {(e.migration_id == mid, e.node, e.to, e.outcome) for e in h.finished()}
    assert ended == {(True, "w2", "s0", "done"), (False, "w1", "s1", "done")}


def test_another_failover_s_answer_does_not_end_ours(h: Harness) -> None:
    start(h)
    h.status(status(1, ["w0", "w1", "s0"], standbys={}), T0 + 3)
    stale = [  # a runtime's answer from another run, another generation, another swap
        wire.Ack(ts=T0, job=JOB, migration_id="failover-g0", kind="switched", node="w0",
                 generation=gen, detail=detail, downtime=wire.Downtime(total_s=7.7))
        for gen, detail in ((1, "w1 replaced by s3"), (5, "w2 replaced by s0"))
    ]  # fmt: skip
    h.feed(*stale, now=T0 + 4)
    h.feed(wire.Ack(ts=T0, job=JOB, migration_id="failover-g0", kind="switched", node="w2",
                    generation=1, downtime=wire.Downtime(total_s=7.7)), now=T0 + 4)  # fmt: skip
    assert h.finished() == []  # the leaver is no stayer to answer for it


def test_a_runtime_failover_pending_its_ack_survives_a_restart(h: Harness) -> None:
    h.status(status())
    h.status(status(1, ["w0", "s0", "w2"], standbys={}), T0 + 3)
    h.restart()
    h.status(status(1, ["w0", "s0", "w2"], standbys={}), T0 + 5)  # retained, on subscribe
    assert h.actuator.reconcile(T0 + 6) == []
    h.feed(ack("failover-g0", "switched", "w0", 1.2))
    [end] = h.finished()
    assert (end.node, end.to, end.outcome, end.downtime_s) == ("w1", "s0", "done", 1.2)


def test_a_resumed_migration_is_counted_under_the_policy_that_decided_it(
    tmp_path: Path,
) -> None:
    """The journal names the policy (the reason of a runtime's failover is a sentence,
    which would have become a label value): a migration resumed after a restart is
    counted under the same ``policy`` as one that was not."""
    h = Harness(tmp_path / "journal.sqlite3", metrics=Metrics())
    h.status(status())
    h.status(status(1, ["w0", "s0", "w2"], standbys={}), T0 + 3)  # the runtime's failover
    [row] = h.journal.in_flight()
    assert row.detail["policy"] == "runtime" and ":" not in row.reason
    h.metrics = Metrics()  # a new process
    h.restart()
    h.status(status(1, ["w0", "s0", "w2"], standbys={}), T0 + 5)
    assert h.actuator.reconcile(T0 + 6) == []
    assert [f.policy for f in h.actuator.ledger.flights.values()] == ["runtime"]
    h.feed(ack("failover-g0", "switched", "w0", 1.2))
    registry = h.metrics.registry
    labels = {s.labels["policy"] for f in registry.collect() if f.name == "tmd_migrations"
              for s in f.samples}  # fmt: skip
    assert labels == {"runtime"}
    done = {"outcome": "done", "policy": "runtime"}
    assert registry.get_sample_value("tmd_migrations_total", done) == 1

    h = Harness(tmp_path / "another.sqlite3")
    mid = start(h)  # the alert policy's, resumed from its prepare
    assert h.journal.migration(mid).detail["policy"] == "alert"  # type: ignore[union-attr]
    h.restart()
    h.status(status(), T0 + 10)
    [prepare] = h.actuator.reconcile(T0 + 12)
    assert isinstance(prepare, wire.Prepare) and h.actuator.ledger.flights[mid].policy == "alert"


@pytest.mark.parametrize(
    ("reason", "detail", "policy"),
    [
        ("the runtime replaced lost rank 1 (machine w1) with s0", {"runtime_id": "f"}, "runtime"),
        ("rebalance: n1 +30% for 60 s", {}, "rebalance"),
        ("a sentence, not a policy: x", {}, "unknown"),
        ("no colon at all", {}, "unknown"),
        ("drain: operator drain", {"policy": "drain"}, "drain"),
    ],
)
def test_the_policy_of_a_row_journaled_before_its_detail_named_it(
    reason: str, detail: dict[str, str], policy: str
) -> None:
    row = MigrationRow("m", JOB, "w1", "s0", "switching", reason, T0, T0, detail)
    assert policy_of(row) == policy


def test_a_runtime_that_cannot_fail_over_is_recorded_as_checkpoint_restart(h: Harness) -> None:
    h.status(status())
    h.feed(ack("failover-g0", "failed", "w0"), ack("failover-g0", "failed", "w2"))  # survivors
    [decision] = [e for e in h.emitted if isinstance(e, events.CheckpointRestart)]
    assert decision.policy == "runtime"


def test_a_restarted_job_starts_over_at_generation_0(h: Harness) -> None:
    h.status(status())
    h.status(status(1, ["w0", "s0", "w2"], standbys={}), T0 + 3)
    h.feed(ack("failover-g0", "switched", "w0", 1.0))
    h.feed(ack("failover-g1", "failed", "w0"))  # a second loss, no standby: rollback
    mid = start_on(h, status(0, standbys={"s0": "ready"}, ts=T0 + 60))  # the new run
    assert len([e for e in h.emitted if isinstance(e, events.CheckpointRestart)]) == 1
    h.status(status(1, ["w0", "w1", "s0"], ts=T0 + 70), T0 + 70)  # our migration switched
    h.feed(*(ack(mid, "switched", n, 0.2) for n in ["w0", "w1", "s0"]))
    h.status(status(2, ["w0", "s1", "s0"], standbys={}, ts=T0 + 80), T0 + 80)
    h.feed(ack("failover-g1", "switched", "w0", 0.7))  # the new run's failover-g1
    ends = [(e.node, e.to, e.outcome, e.downtime_s) for e in h.finished()]
    assert ends == [("w1", "s0", "done", 1.0), ("w2", "s0", "done", 0.2), ("w1", "s1", "done", 0.7)]
    assert h.status(status(0, ts=T0 + 5), T0 + 81) == []  # a late old status changes nothing
    assert len(h.finished()) == 3


def start_on(h: Harness, s: wire.JobStatus) -> str:
    h.status(s, s.ts)
    [prepare] = h.actuator.on_event(migrate(), s.ts)
    assert isinstance(prepare, wire.Prepare)
    h.feed(*(ack(prepare.migration_id, "prepared", n) for n in WORKERS))
    return prepare.migration_id


def test_membership_change_under_a_migration_ends_it(h: Harness) -> None:
    mid = start(h)
    h.status(status(1, ["s0", "w1", "w2"], standbys={}), T0 + 3)  # w0 died, s0 took it
    outcomes = {e.migration_id: e.outcome for e in h.finished()}
    assert outcomes[mid] == "aborted"
    h.actuator.on_tick(T0 + 3 + RUNTIME_ACK_GRACE_S)
    assert [(e.node, e.to, e.outcome) for e in h.finished()][1:] == [("w0", "s0", "done")]


# -- found in review ---------------------------------------------------------------------


def test_a_resumed_migration_waits_for_every_member_even_before_the_status(h: Harness) -> None:
    mid = start(h)
    h.restart()  # no retained status arrives before the reconcile
    [prepare] = h.actuator.reconcile(T0 + 10)
    assert isinstance(prepare, wire.Prepare)
    assert h.feed(ack(mid, "prepared", "w0")) == []  # two members have not answered
    [switch] = h.feed(ack(mid, "prepared", "w1"), ack(mid, "prepared", "w2"))
    assert isinstance(switch, wire.Switch)
    h.feed(ack(mid, "switched", "s0", 0.1))
    assert h.finished() == []  # the stayers' answers are still missing
    h.feed(ack(mid, "switched", "w0", 0.1), ack(mid, "switched", "w1", 0.3))
    assert [(e.outcome, e.downtime_s) for e in h.finished()] == [("done", 0.3)]


def test_a_failover_while_the_daemon_was_down_is_journaled_once(h: Harness) -> None:
    h.status(status())
    h.restart()
    h.status(status(1, ["w0", "s0", "w2"], standbys={}, ts=T0 + 50), T0 + 60)  # retained
    h.actuator.reconcile(T0 + 62)
    h.feed(ack("failover-g0", "switched", "w0", 0.8))  # resent by nobody: lost; or late
    [end] = h.finished()
    assert (end.node, end.to, end.downtime_s) == ("w1", "s0", 0.8)
    h.restart()
    h.status(status(1, ["w0", "s0", "w2"], standbys={}, ts=T0 + 50), T0 + 90)
    h.actuator.reconcile(T0 + 92)
    assert len(h.finished()) == 1 and h.journal.in_flight() == []


def test_a_planned_switch_while_the_daemon_was_down_is_not_also_a_runtime_failover(
    h: Harness,
) -> None:
    mid = start(h)
    h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    h.restart()
    h.status(status(1, ["w0", "w1", "s0"], ts=T0 + 50), T0 + 60)
    h.actuator.reconcile(T0 + 62)
    h.actuator.on_tick(T0 + 100)
    assert [(e.migration_id, e.outcome) for e in h.finished()] == [(mid, "done")]
    assert len(h.journal.recent_migrations(0)) == 1


def test_each_rollback_of_a_job_is_recorded_even_at_generation_0(h: Harness) -> None:
    def rollbacks() -> int:
        return len([e for e in h.emitted if isinstance(e, events.CheckpointRestart)])

    h.status(wire.JobStatus(**{**_fields(status()), "step": 40}))
    h.feed(ack("failover-g0", "failed", "w0"))
    h.status(wire.JobStatus(**{**_fields(status(ts=T0 + 30)), "step": 32}), T0 + 30)  # new run
    h.feed(ack("failover-g0", "failed", "w0"))
    assert rollbacks() == 2
    h.status(wire.JobStatus(**{**_fields(status(ts=T0 + 1)), "step": 20}), T0 + 31)  # late, old
    h.feed(ack("failover-g0", "failed", "w2"))  # another survivor of the same failure
    assert rollbacks() == 2


def _fields(s: wire.JobStatus) -> dict[str, object]:
    return {f: getattr(s, f) for f in s.__struct_fields__}


def test_an_answer_with_the_downtime_replaces_one_without(h: Harness) -> None:
    mid = start(h)
    h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    h.feed(ack(mid, "switched", "w0"), ack(mid, "switched", "s0", 0.1))  # w0's first: none
    h.feed(ack(mid, "switched", "w0", 0.9))  # its answer to a resend carries it
    h.feed(ack(mid, "switched", "w1", 0.2))
    assert [e.downtime_s for e in h.finished()] == [0.9]


def test_an_answer_from_another_job_with_the_same_id_is_not_ours(h: Harness) -> None:
    mid = start(h)

    def other(kind: str, node: str, mid: str = mid) -> wire.Ack:
        return wire.Ack(ts=T0, job="other", migration_id=mid, kind=kind, node=node)  # type: ignore[arg-type]

    assert h.feed(*(other("prepared", n) for n in WORKERS)) == []  # no Switch
    assert h.feed(other("failed", "w1")) == []  # no Abort
    assert h.actuator.flights[mid].phase == "preparing" and h.actuator.flights[mid].acks == {}
    [switch] = h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    assert isinstance(switch, wire.Switch)
    # The runtime's own failover ids repeat in every job: another job's answer does not
    # end this job's failover, nor give it that job's downtime.
    h.status(status(1, ["w0", "w1", "s0"], standbys={}), T0 + 3)
    h.feed(*(ack(mid, "switched", n, 0.2) for n in ["w0", "w1", "s0"]))
    h.status(status(2, ["s1", "w1", "s0"], standbys={}), T0 + 4)  # the runtime's failover
    h.feed(other("switched", "w1", "failover-g1"))
    assert [e.node for e in h.finished()] == ["w2"]
    h.feed(ack("failover-g1", "switched", "w1", 0.7))
    assert [(e.node, e.to, e.downtime_s) for e in h.finished()][1:] == [("w0", "s1", 0.7)]


@pytest.mark.parametrize("first", ["aborted", "failed"])
def test_an_abort_holds_its_guardrail_slot_until_every_member_confirmed(
    h: Harness, first: str
) -> None:
    # "aborted": a member aborted on its own (the joiner died); "failed": a member
    # refused, which counts as out, and the actuator sent the abort.
    mid = start(h)
    h.feed(ack(mid, first, "w1"))
    h.feed(ack(mid, "aborted", "w0"))
    assert h.finished() == [] and h.actuator.guard_state.in_flight == {JOB: 1}
    assert h.actuator.on_event(migrate(node="w0"), T0 + 1) == []
    assert "max_concurrent_per_job" in h.holds()[-1]
    h.feed(ack(mid, "aborted", "w2"))
    assert [e.outcome for e in h.finished()] == ["aborted"]
    assert h.actuator.guard_state.in_flight == {}
    [prepare] = h.actuator.on_event(migrate(node="w0"), T0 + 2)
    assert isinstance(prepare, wire.Prepare)


def test_a_switch_the_status_showed_stays_done_when_its_joiner_is_replaced_next(
    h: Harness,
) -> None:
    # The switch happened (the status shows it), its acks are late, and then the joiner
    # dies and the runtime puts another standby in its place: w2 did leave.
    mid = start(h)
    h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    h.status(status(1, ["w0", "w1", "s0"], standbys={"s1": "ready"}), T0 + 2)
    h.status(status(2, ["w0", "w1", "s1"], standbys={}), T0 + 3)
    h.actuator.on_tick(T0 + 3 + RUNTIME_ACK_GRACE_S)
    assert [(e.node, e.to, e.outcome) for e in h.finished()] == [("s0", "s1", "done")]
    h.actuator.on_tick(T0 + 30)
    ends = [(e.migration_id, e.outcome) for e in h.finished()]
    assert ends[1:] == [(mid, "done")]
    row = h.journal.migration(mid)
    assert row is not None and "acks missing" in row.detail["detail"]


def test_a_member_that_aborted_on_its_own_has_the_others_told(h: Harness) -> None:
    mid = start(h)
    assert h.feed(wire.Ack(ts=T0, job=JOB, migration_id=mid, kind="aborted", node="w0",
                           detail="the joiner s0 stopped beating")) == []  # fmt: skip
    [abort] = h.actuator.on_tick(T0 + 5)  # the resend is the abort, not the prepare
    assert isinstance(abort, wire.Abort) and abort.reason == "w0: the joiner s0 stopped beating"


def test_a_restart_while_aborting_resends_the_abort_with_its_reason(h: Harness) -> None:
    mid = start(h)
    h.feed(wire.Ack(ts=T0, job=JOB, migration_id=mid, kind="failed", node="w1", detail="busy"))
    h.restart()
    h.status(status(state="migrating"), T0 + 10)
    [abort] = h.actuator.reconcile(T0 + 12)
    assert isinstance(abort, wire.Abort) and abort.reason == "w1 failed: busy"
    h.feed(ack(mid, "aborted", "w0"), ack(mid, "aborted", "w2"), ack(mid, "failed", "w1"))
    row = h.journal.migration(mid)
    assert row is not None and (row.state, row.detail["detail"]) == ("aborted", "w1 failed: busy")


def test_a_one_machine_job_whose_member_refuses_ends_at_once(h: Harness) -> None:
    h.status(status(members=["w0"]))
    [prepare] = h.actuator.on_event(migrate(node="w0"), T0)
    assert isinstance(prepare, wire.Prepare)
    [abort] = h.feed(ack(prepare.migration_id, "failed", "w0"), now=T0 + 1)
    assert isinstance(abort, wire.Abort)
    [end] = h.finished()
    assert (end.outcome, end.ts) == ("aborted", T0 + 1)
    assert h.actuator.guard_state.in_flight == {}


def test_why_a_migration_ended_is_journaled(h: Harness) -> None:
    mid = start(h)
    h.status(status(1, ["s1", "w1", "w2"], standbys={}), T0 + 3)  # w0 replaced under it
    row = h.journal.migration(mid)
    assert row is not None and row.detail["detail"] == "the job's membership changed"


def test_an_abort_the_old_group_confirms_by_its_status_keeps_its_reason(h: Harness) -> None:
    mid = start(h)
    [abort] = h.actuator.on_tick(T0 + 30)  # nobody prepared
    assert isinstance(abort, wire.Abort)
    h.status(status(ts=T0 + 40), T0 + 40)  # running, with the leaver: the abort took
    h.actuator.on_tick(T0 + 30 + 60)  # no member answered it
    row = h.journal.migration(mid)
    assert row is not None and row.state == "aborted"
    assert row.detail["detail"] == "timed out waiting for prepared from w0, w1, w2"


def test_a_resumed_migration_ends_when_the_membership_changed_while_down(h: Harness) -> None:
    mid = start(h)
    h.restart()
    # While the daemon was down the runtime replaced w0 (which drops a planned migration).
    h.status(status(1, ["s1", "w1", "w2"], standbys={"s0": "ready"}), T0 + 10)
    h.actuator.reconcile(T0 + 12)
    h.status(status(1, ["s1", "w1", "w2"], standbys={"s0": "ready"}, ts=T0 + 15), T0 + 15)
    assert (mid, "aborted") in [(e.migration_id, e.outcome) for e in h.finished()]


def test_a_runtime_that_could_not_fail_over_names_the_job_and_the_machine(h: Harness) -> None:
    h.status(status())
    h.feed(wire.Ack(ts=T0, job=JOB, migration_id="failover-g0", kind="failed", node="w0",
                    detail="no ready standby"))  # fmt: skip
    [decision] = [e for e in h.emitted if isinstance(e, events.CheckpointRestart)]
    assert (decision.job, decision.node) == (JOB, "w0")
    assert decision.reason.endswith("no ready standby")


def test_a_failed_answer_after_the_status_showed_the_switch_does_not_abort_it(
    h: Harness,
) -> None:
    mid = start(h)
    h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    h.status(status(1, ["w0", "w1", "s0"], standbys={}), T0 + 2)
    assert h.feed(ack(mid, "failed", "w0"), now=T0 + 3) == []  # no Abort: it switched
    assert h.actuator.flights[mid].phase == "switching"
    h.feed(*(ack(mid, "switched", n, 0.2) for n in ["w0", "w1", "s0"]), now=T0 + 4)
    assert [(e.migration_id, e.outcome) for e in h.finished()] == [(mid, "done")]


def test_answers_from_outside_a_migration_move_nothing(h: Harness) -> None:
    """Only the job's machines and the joiner answer for a migration: a forged or
    misdirected ack of any kind, from any other node, changes nothing."""
    mid = start(h)
    for kind in ("failed", "aborted", "switched", "prepared"):
        assert h.feed(ack(mid, kind, "intruder")) == []
    flight = h.actuator.flights[mid]
    assert flight.phase == "preparing" and h.finished() == []
    out = h.feed(*(ack(mid, "prepared", n) for n in WORKERS))
    assert [type(m) for m in out] == [wire.Switch]  # the real answers still count


def test_the_job_s_own_failovers_do_not_spend_the_hourly_budget(tmp_path: Path) -> None:
    """max_per_hour bounds what the daemon starts; failovers the runtime did (which a
    job's status, forged or not, reports) are recorded but not counted, before and
    after a restart of the daemon."""
    h = Harness(tmp_path / "journal.sqlite3", max_per_hour=1)
    h.status(status(standbys={"s0": "ready", "s1": "ready", "s2": "ready"}))
    h.status(status(1, ["w0", "s0", "w2"], standbys={"s1": "ready", "s2": "ready"}), T0 + 3)
    h.feed(ack("failover-g0", "switched", "w0", 1.1))
    assert [e.node for e in h.finished()] == ["w1"]
    assert not h.actuator.guard_state.started  # recorded, cooled down, not budgeted
    h.restart()
    h.status(status(1, ["w0", "s0", "w2"], standbys={"s1": "ready", "s2": "ready"}), T0 + 5)
    h.actuator.reconcile(T0 + 6)
    out = h.actuator.on_event(migrate(node="w2"), T0 + 7)
    assert [type(m) for m in out] == [wire.Prepare], h.holds()


def test_no_migration_starts_while_the_view_is_stale_and_one_decided_then_runs_after(
    h: Harness,
) -> None:
    """Decisions taken while the daemon's view is stale or settling are kept, the
    latest per job and machine, and run once it is trusted again."""
    from tmd.daemon.freshness import Freshness

    h.status(status())
    h.view.freshness = f = Freshness(interval_s=1.0, max_lag_s=2.0, settle_s=5.0)
    f.connection(True, T0)
    f.answered(T0, T0)
    assert h.actuator.on_event(migrate(policy="failover"), T0 + 1) == []  # settling
    for t in range(1, 5):  # its probes keep coming back; settling until T0 + 5
        f.answered(T0 + t, T0 + t)
        assert h.actuator.on_tick(T0 + t) == []
    assert h.holds() == [] and h.actuator.flights == {}
    f.answered(T0 + 5, T0 + 5)
    out = h.actuator.on_tick(T0 + 5.5)
    assert [type(m) for m in out] == [wire.Prepare] and out[0].leaver == "w2"  # type: ignore[attr-defined]
    assert h.actuator.on_tick(T0 + 6) == []  # once


def test_a_deferred_decision_that_fails_is_held_and_the_others_still_run(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tmd.daemon.freshness import Freshness

    h.status(status())
    h.view.freshness = f = Freshness(interval_s=1.0, max_lag_s=2.0, settle_s=0.0)
    f.connection(True, T0)
    f.answered(T0, T0)
    f.connection(False, T0 + 0.5)  # the broker went away: decisions wait
    for node in ("w1", "w2"):
        assert h.actuator.on_event(migrate(node=node, policy="failover"), T0 + 1) == []
    real = h.actuator._on_migrate

    def broken(decision: events.Migrate, now: float) -> list[wire.Message]:
        if decision.node == "w1":
            raise RuntimeError("journal on fire")
        return real(decision, now)

    monkeypatch.setattr(h.actuator, "_on_migrate", broken)
    f.connection(True, T0 + 2)
    f.answered(T0 + 2, T0 + 2)
    out = h.actuator.on_tick(T0 + 2)
    assert [(type(m), m.leaver) for m in out] == [(wire.Prepare, "w2")]  # type: ignore[attr-defined]
    assert "journal on fire" in h.holds()[-1] and "w1" in h.holds()[-1]
