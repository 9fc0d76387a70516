"""The actuator with machines of several ranks (issue 11): every process of a machine
answers for itself, and a machine is prepared, switched or aborted once all of them
did. On an injected clock, a real SQLite journal and the real cluster view."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.daemon.actuator.test_actuator import JOB, T0, Harness
from tmd import wire
from tmd.daemon import events

MACHINES = ["w0", "w1", "w2"]
K = 2


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path / "journal.sqlite3")


def status(
    generation: int = 0,
    machines: list[str] | None = None,
    standbys: dict[str, int] | None = None,
    ts: float = T0,
) -> wire.JobStatus:
    """The job on ``machines`` of K ranks each (rank = machine index * K + local rank),
    and ready standby machines of the given slots (default: s0 of K, s1 of 1)."""
    nodes = MACHINES if machines is None else machines
    slots = {"s0": K, "s1": 1} if standbys is None else standbys
    return wire.JobStatus(
        ts=ts, job=JOB, generation=generation, world_size=len(nodes) * K,
        members=[wire.Member(m * K + i, n, i) for m, n in enumerate(nodes) for i in range(K)],
        standbys=[wire.StandbyInfo(node=n, state="ready", slots=k) for n, k in slots.items()],
    )  # fmt: skip


def ack(
    mid: str, kind: str, node: str, local: int | None, total_s: float | None = None
) -> wire.Ack:
    downtime = wire.Downtime(total_s=total_s) if total_s is not None else None
    return wire.Ack(
        ts=T0, job=JOB, migration_id=mid, kind=kind, node=node, local_rank=local,  # type: ignore[arg-type]
        downtime=downtime,
    )  # fmt: skip


def every(mid: str, kind: str, nodes: list[str], total_s: float | None = None) -> list[wire.Ack]:
    return [ack(mid, kind, n, i, total_s) for n in nodes for i in range(K)]


def start(h: Harness) -> str:
    h.status(status())
    [prepare] = h.actuator.on_event(
        events.Migrate(ts=T0, policy="drain", job=JOB, node="w2", reason="test"), T0
    )
    assert isinstance(prepare, wire.Prepare)
    assert (prepare.leaver, prepare.joiner) == ("w2", "s0")  # s1 has one slot: it cannot
    return prepare.migration_id


def test_a_machine_migrates_once_every_process_of_every_machine_answered(h: Harness) -> None:
    mid = start(h)
    row = h.journal.migration(mid)
    assert row is not None and row.detail["slots"] == {"s0": 2, "w0": 2, "w1": 2, "w2": 2}
    *most, last = every(mid, "prepared", MACHINES)
    assert h.feed(*most) == []
    [switch] = h.feed(last)
    assert isinstance(switch, wire.Switch)
    h.feed(*every(mid, "switched", ["w0", "w1"], 0.2), ack(mid, "switched", "s0", 0, 0.4))
    h.feed(*every(mid, "switched", ["w2"], 9.0))  # the leaver's numbers do not count
    assert h.finished() == []  # one of the joiner's two processes has not switched
    h.feed(ack(mid, "switched", "s0", 1, 0.3))
    [done] = h.finished()
    assert (done.outcome, done.node, done.to, done.downtime_s) == ("done", "w2", "s0", 0.4)


def test_a_machine_with_no_standby_of_its_size_is_held(h: Harness) -> None:
    h.status(status(standbys={"s1": 1}))
    migrate = events.Migrate(ts=T0, policy="drain", job=JOB, node="w2", reason="test")
    assert h.actuator.on_event(migrate, T0) == []
    assert "no ready standby" in h.holds()[-1]


def test_an_abort_waits_for_every_process(h: Harness) -> None:
    mid = start(h)
    [abort] = h.feed(ack(mid, "failed", "w1", 1))
    assert isinstance(abort, wire.Abort) and "w1 failed" in abort.reason
    *most, last = [*every(mid, "aborted", ["w0", "w2"]), ack(mid, "aborted", "w1", 0)]
    h.feed(*most)
    assert h.finished() == [] and h.actuator.guard_state.in_flight == {JOB: 1}
    h.feed(last)
    assert [e.outcome for e in h.finished()] == ["aborted"]


def test_a_resumed_migration_still_waits_for_every_process(h: Harness) -> None:
    mid = start(h)
    h.restart()
    h.status(status(), T0 + 10)
    [prepare] = h.actuator.reconcile(T0 + 12)
    assert isinstance(prepare, wire.Prepare)
    assert h.feed(*[ack(mid, "prepared", n, 0) for n in MACHINES]) == []
    [switch] = h.feed(*[ack(mid, "prepared", n, 1) for n in MACHINES])
    assert isinstance(switch, wire.Switch)


def test_a_migration_journaled_before_machines_resumes_with_one_process_each(
    h: Harness,
) -> None:
    # What a daemon from before issue 11 journaled on entering "preparing": no slots.
    h.journal.begin_migration(id="m1", job=JOB, leaver="w2", joiner="s0", reason="drain: x",
                              ts=T0)  # fmt: skip
    h.journal.set_migration_state(
        "m1", "preparing", ts=T0, detail={"generation": 0, "members": MACHINES}
    )
    h.restart()
    h.status(status(), T0 + 10)  # the job now reports machines of two ranks
    [prepare] = h.actuator.reconcile(T0 + 12)
    assert isinstance(prepare, wire.Prepare) and prepare.migration_id == "m1"
    flight = h.actuator.flights["m1"]
    assert flight.slots == {} and flight.slots_of("w0") == 1
    [switch] = h.feed(*[ack("m1", "prepared", n, None) for n in MACHINES])  # old runtimes
    assert isinstance(switch, wire.Switch)


def test_a_machine_the_runtime_replaced_is_one_failover_naming_its_ranks(h: Harness) -> None:
    h.status(status())
    h.status(status(1, ["w0", "s0", "w2"], standbys={}), T0 + 3)  # w1's two ranks on s0
    h.feed(ack("failover-g0", "switched", "w0", 0, 0.6))
    [end] = h.finished()
    assert (end.node, end.to, end.outcome, end.downtime_s) == ("w1", "s0", "done", 0.6)
    [row] = h.journal.recent_migrations(0)
    assert row.reason == "the runtime replaced lost ranks 2, 3 (machine w1) with s0"
    assert row.detail["ranks"] == [2, 3]


@pytest.mark.parametrize("answer_first", [False, True])
def test_two_machines_the_runtime_replaced_at_once_both_end_on_its_one_answer(
    h: Harness, answer_first: bool
) -> None:
    # One failover of the runtime, one id (failover-g0) and one answer for both machines.
    answer = ack("failover-g0", "switched", "w2", 0, 0.7)
    h.status(status())
    if answer_first:
        h.feed(answer)
    h.status(status(1, ["s0", "s1", "w2"], standbys={}), T0 + 3)
    if not answer_first:
        h.feed(answer)
    ends = sorted((e.node, e.to, e.outcome, e.downtime_s) for e in h.finished())
    assert ends == [("w0", "s0", "done", 0.7), ("w1", "s1", "done", 0.7)]
    assert h.journal.in_flight() == []
