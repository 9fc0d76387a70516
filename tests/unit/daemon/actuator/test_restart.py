"""Checkpoint restarts the actuator asks for (issue 11, item 6): a ``CheckpointRestart``
becomes a ``Restart`` sent until the job answers, journaled, held by the guardrails,
never sent for the runtime's own rollback nor twice. On an injected clock, a real
SQLite journal and the real cluster view."""

from __future__ import annotations

from pathlib import Path

import pytest
from msgspec.structs import replace

from tests.unit.daemon.actuator.test_actuator import JOB, T0, Harness, ack, migrate, status
from tmd import wire
from tmd.daemon import events


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path / "journal.sqlite3")


def restart(node: str = "w2", policy: str = "failover") -> events.CheckpointRestart:
    return events.CheckpointRestart(
        ts=T0, policy=policy, job=JOB, node=node, reason=f"GpuFault on {node} GPU 3: xid 79"
    )


def answer(mid: str, node: str = "w0", rank: int = 0) -> wire.Ack:
    return wire.Ack(ts=T0, job=JOB, migration_id=mid, kind="restarting", node=node, rank=rank,
                    local_rank=0)  # fmt: skip


def states(h: Harness, mid: str) -> list[str]:
    rows = h.journal.events(kind="MigrationState")
    return [e.body["state"] for e in rows if e.body["migration_id"] == mid]


def ask(h: Harness, now: float = T0) -> wire.Restart:
    [command] = h.actuator.on_event(restart(), now)
    assert isinstance(command, wire.Restart)
    return command


def test_a_checkpoint_restart_is_asked_until_the_job_answers(h: Harness) -> None:
    h.status(status(standbys={}))
    command = ask(h)
    assert (command.job, command.node) == (JOB, "w2")
    assert command.migration_id.startswith("r") and "GPU 3" in command.reason
    row = h.journal.migration(command.migration_id)
    assert row is not None and (row.state, row.leaver, row.joiner) == ("restarting", "w2", "")
    assert h.actuator.on_tick(T0 + 4) == []
    [again] = h.actuator.on_tick(T0 + 5)  # resend_s
    assert isinstance(again, wire.Restart) and again.migration_id == command.migration_id
    assert h.feed(answer(command.migration_id)) == []
    assert h.actuator.on_tick(T0 + 10) == []  # answered: no more resends
    [end] = h.finished()
    assert (end.migration_id, end.node, end.to, end.outcome) == (
        command.migration_id, "w2", "", "done",
    )  # fmt: skip
    assert states(h, command.migration_id) == ["restarting", "done"]
    assert h.journal.in_flight() == [] and h.actuator.guard_state.restarting == {}


def test_the_jobs_status_saying_restarting_answers_it(h: Harness) -> None:
    h.status(status(standbys={}))
    command = ask(h)
    h.status(status(standbys={}, state="restarting", ts=T0 + 2), T0 + 2)
    [end] = h.finished()
    assert end.outcome == "done"
    row = h.journal.migration(command.migration_id)
    assert row is not None and row.detail["detail"] == "the job's status says restarting"


def test_a_restart_nobody_answers_fails_after_the_switch_timeout(h: Harness) -> None:
    h.status(status(standbys={}))
    command = ask(h)
    h.actuator.on_tick(T0 + 19)
    assert h.finished() == []
    h.actuator.on_tick(T0 + 20)
    [end] = h.finished()
    assert end.outcome == "failed"
    assert states(h, command.migration_id) == ["restarting", "failed"]


def test_dry_run_journals_the_decision_and_asks_nothing(tmp_path: Path) -> None:
    h = Harness(tmp_path / "j.sqlite3", dry_run=True)
    h.status(status(standbys={}))
    assert h.actuator.on_event(restart(), T0) == []
    [why] = h.holds()
    assert "dry run" in why and "would ask job train to restart without w2" in why
    assert h.journal.recent_migrations(0) == []


def test_the_runtimes_own_rollback_is_not_asked_for(h: Harness) -> None:
    h.status(status(standbys={}))
    h.feed(ack("failover-g0", "failed", "w0"))  # the runtime could not replace a machine
    [rollback] = [e for e in h.emitted if isinstance(e, events.CheckpointRestart)]
    assert rollback.policy == "runtime"
    assert h.actuator.on_event(rollback, T0) == []  # as the bus brings it back
    assert h.journal.recent_migrations(0) == [] and h.holds() == []


def test_a_restarted_daemon_resumes_the_restart_and_never_asks_twice(h: Harness) -> None:
    h.status(status(standbys={}))
    mid = ask(h).migration_id
    h.restart()
    h.status(status(standbys={}), T0 + 10)  # the retained status, on subscribe
    [again] = h.actuator.reconcile(T0 + 12)
    assert isinstance(again, wire.Restart) and again.migration_id == mid  # the same one
    assert h.actuator.on_event(restart(), T0 + 13) == []  # decided again after the restart
    assert "already restarting" in h.holds()[-1]
    h.feed(answer(mid), now=T0 + 14)
    assert [(e.migration_id, e.outcome) for e in h.finished()] == [(mid, "done")]
    # Its status still runs the old group for a moment: asked once is enough.
    assert h.actuator.on_event(restart(), T0 + 15) == []
    assert "already asked to restart without it" in h.holds()[-1]
    assert [r.id for r in h.journal.recent_migrations(0)] == [mid]
    resumed = [e.body for e in h.journal.events(kind="MigrationState") if e.body.get("resumed")]
    assert [r["state"] for r in resumed] == ["restarting"]


def test_a_restart_the_status_answered_while_the_daemon_was_down_ends_on_resume(
    h: Harness,
) -> None:
    h.status(status(standbys={}))
    mid = ask(h).migration_id
    h.restart()
    h.status(status(standbys={}, state="restarting", ts=T0 + 9), T0 + 10)
    assert h.actuator.reconcile(T0 + 12) == []
    assert [(e.migration_id, e.outcome) for e in h.finished()] == [(mid, "done")]


@pytest.mark.parametrize(
    ("setup", "node", "expect"),
    [
        (None, "w2", "has not reported its status"),
        (status(standbys={}), "w9", "w9 is not a member of job train"),
        (status(standbys={}, state="restarting"), "w2", "job train is restarting"),
        (status(standbys={}, state="stopped"), "w2", "job train is stopped"),
    ],
)
def test_a_restart_is_asked_only_of_a_running_job_with_the_machine(
    h: Harness, setup: wire.JobStatus | None, node: str, expect: str
) -> None:
    if setup is not None:
        h.status(setup)
    assert h.actuator.on_event(restart(node), T0) == []
    [hold] = [e for e in h.emitted if isinstance(e, events.Hold)]
    assert expect in hold.reason and hold.held == "failover"  # the policy decides again


def test_a_job_never_migrates_and_restarts_at_once(h: Harness, tmp_path: Path) -> None:
    h.status(status())
    [prepare] = h.actuator.on_event(migrate(node="w1"), T0)
    assert isinstance(prepare, wire.Prepare)
    assert h.actuator.on_event(restart(), T0 + 1) == []
    assert "migration(s) in flight" in h.holds()[-1]
    h.feed(*(ack(prepare.migration_id, "aborted", n) for n in ["w0", "w1", "w2"]))
    ask(h, T0 + 2)
    other = Harness(tmp_path / "other.sqlite3", max_concurrent_per_job=3)
    other.status(status())
    [_] = other.actuator.on_event(restart(), T0)
    assert other.actuator.on_event(migrate(node="w1"), T0 + 1) == []
    assert "is restarting from its checkpoint" in other.holds()[-1]


def test_a_new_run_ends_the_restart_and_may_be_asked_again(h: Harness) -> None:
    h.status(status(standbys={}))
    mid = ask(h).migration_id
    h.status(replace(status(1, standbys={}), step=50, ts=T0 + 10), T0 + 10)
    assert h.finished() == []  # a later generation of the same run, w2 still in it
    # The answer was lost; the next run starts from the checkpoint at generation 0, with
    # the machine repaired.
    h.status(replace(status(0, standbys={}), step=40, ts=T0 + 80), T0 + 80)
    [end] = h.finished()
    assert (end.migration_id, end.outcome) == (mid, "done")
    [new_run] = [e for e in h.emitted if isinstance(e, events.JobRestarted)]
    assert (new_run.job, new_run.generation, new_run.step) == (JOB, 0, 40)
    assert ask(h, T0 + 1800).migration_id != mid  # once the machine's cooldown is over


# -- found in review ---------------------------------------------------------------------


def run_of(run: int, *, step: int = 40, ts: float = T0, **fields: object) -> wire.JobStatus:
    """The job's status in its ``run``-th run (the launcher's restart count)."""
    return replace(status(standbys={}), step=step, run=run, ts=ts, **fields)


def test_the_usual_new_run_after_a_restart_is_seen_by_its_run(h: Harness) -> None:
    # The new run restores the checkpoint the old one wrote at the step it stopped on,
    # at generation 0: only its run tells it from the old run's last status.
    h.status(run_of(0))
    mid = ask(h).migration_id
    h.status(run_of(0, state="restarting", excluded=["w2"], ts=T0 + 2), T0 + 2)
    assert [(e.migration_id, e.outcome) for e in h.finished()] == [(mid, "done")]
    members = [wire.Member(r, n) for r, n in enumerate(["w0", "w1", "s0"])]
    h.status(run_of(1, members=members, ts=T0 + 30), T0 + 30)
    [new_run] = [e for e in h.emitted if isinstance(e, events.JobRestarted)]
    assert (new_run.generation, new_run.step, new_run.run) == (0, 40, 1)
    assert h.actuator.ledger.restarts_asked == {}  # what was asked of the old run is moot


def test_a_new_run_whose_answer_was_lost_ends_the_restart_as_done(h: Harness) -> None:
    h.status(run_of(0))
    mid = ask(h).migration_id
    members = [wire.Member(r, n) for r, n in enumerate(["w0", "w1", "s0"])]
    h.status(run_of(1, members=members, ts=T0 + 30), T0 + 30)  # w2 gone, a spare in
    [end] = h.finished()
    assert (end.migration_id, end.outcome) == (mid, "done")
    row = h.journal.migration(mid)
    assert row is not None and row.detail["detail"] == "the job restarted"


def test_a_status_of_an_earlier_run_delivered_late_changes_nothing(h: Harness) -> None:
    h.status(run_of(0, step=90, ts=T0 + 10), T0 + 10)
    h.status(run_of(1, step=40, ts=T0 + 30), T0 + 30)
    assert len([e for e in h.emitted if isinstance(e, events.JobRestarted)]) == 1
    moved = [wire.Member(r, n) for r, n in enumerate(["w0", "s0", "w2"])]
    late = run_of(0, step=95, ts=T0 + 12, generation=1, members=moved)
    assert h.status(late, T0 + 31) == []
    assert len([e for e in h.emitted if isinstance(e, events.JobRestarted)]) == 1
    assert h.journal.recent_migrations(0) == []  # not mistaken for a runtime failover
    assert h.journal.memberships()[JOB].run == 1


def test_a_job_launched_again_from_scratch_is_a_new_run_though_its_run_is_lower(
    h: Harness,
) -> None:
    # A new launcher counts from 0 again: newer than the last status, it is no late one.
    h.status(run_of(2, step=900, ts=T0))
    h.status(run_of(0, step=0, ts=T0 + 600), T0 + 600)
    [new_run] = [e for e in h.emitted if isinstance(e, events.JobRestarted)]
    assert new_run.run == 0


def test_a_restarted_daemon_keeps_the_run_it_saw(h: Harness) -> None:
    h.status(run_of(0))
    h.status(run_of(1, ts=T0 + 30), T0 + 30)
    h.restart()
    h.status(run_of(1, ts=T0 + 30), T0 + 60)  # the same retained status, on subscribe
    assert len([e for e in h.emitted if isinstance(e, events.JobRestarted)]) == 1


def test_the_restart_names_the_run_it_is_for_even_when_resumed(h: Harness) -> None:
    h.status(run_of(3))
    command = ask(h)
    assert command.run == 3
    h.restart()
    h.status(run_of(3), T0 + 10)
    [again] = h.actuator.reconcile(T0 + 12)
    assert isinstance(again, wire.Restart) and again.run == 3


@pytest.mark.parametrize("how", ["offline", "lost", "lost, then its agent reported"])
def test_a_lost_machines_processes_are_not_asked_to_restart(h: Harness, how: str) -> None:
    h.status(status(standbys={}))
    if how == "offline":  # its agent's Last Will
        h.view.apply_node_status(wire.NodeStatus(ts=T0, node="w2", state="offline"), T0)
    else:  # a NodeLost on a heartbeat, as the daemon notes it when emitted
        h.view.apply_gpu(wire.NodeGpu(ts=T0, node="w2"), T0)
        h.view.note_fault("w2", T0 + 1, lost=True)
    if how == "lost, then its agent reported":
        h.view.apply_gpu(wire.NodeGpu(ts=T0 + 2, node="w2"), T0 + 2)
        ask(h, T0 + 3)
        return
    assert h.actuator.on_event(restart(), T0 + 3) == []
    [hold] = [e for e in h.emitted if isinstance(e, events.Hold)]
    assert "w2 is lost" in hold.reason and hold.held == "failover"
    assert h.journal.recent_migrations(0) == []


def test_a_gpu_fault_is_no_loss_the_machines_processes_are_asked(h: Harness) -> None:
    h.status(status(standbys={}))
    h.view.note_fault("w2", T0)  # a GpuFault
    ask(h, T0 + 1)


def test_a_restart_nobody_answered_is_not_asked_for_a_second_time(h: Harness) -> None:
    h.status(status(standbys={}))
    mid = ask(h).migration_id
    h.actuator.on_tick(T0 + 20)
    assert [e.outcome for e in h.finished()] == ["failed"]
    assert h.actuator.on_event(restart(), T0 + 21) == []
    assert f"already asked to restart without it ({mid})" in h.holds()[-1]


def test_a_machine_is_restarted_without_at_most_once_per_cooldown(tmp_path: Path) -> None:
    h = Harness(tmp_path / "j.sqlite3", node_cooldown_s=600)
    h.status(run_of(0))
    ask(h)
    h.status(run_of(1, ts=T0 + 60), T0 + 60)  # a new run, the machine still in it
    assert h.actuator.on_event(restart(), T0 + 61) == []
    assert (
        "asked to restart without w2 61 s ago (guardrails.node_cooldown_s = 600)" in (h.holds()[-1])
    )
    h.restart()  # a restarted daemon remembers it from the journal
    h.status(run_of(1, ts=T0 + 60), T0 + 62)
    h.actuator.reconcile(T0 + 62)
    assert h.actuator.on_event(restart(), T0 + 63) == []
    assert "node_cooldown_s" in h.holds()[-1]
    ask(h, T0 + 600)


def test_a_machine_the_jobs_status_excludes_is_not_asked_for(h: Harness) -> None:
    h.status(replace(status(standbys={}), excluded=["w2"]))
    assert h.actuator.on_event(restart(), T0) == []
    assert "already goes on without it" in h.holds()[-1]


def test_a_job_that_stopped_did_not_restart(h: Harness) -> None:
    h.status(status(standbys={}))
    mid = ask(h).migration_id
    h.status(status(standbys={}, state="stopped", ts=T0 + 2), T0 + 2)
    [end] = h.finished()
    assert (end.migration_id, end.outcome) == (mid, "aborted")
    row = h.journal.migration(mid)
    assert row is not None and row.detail["detail"] == "the job stopped"
