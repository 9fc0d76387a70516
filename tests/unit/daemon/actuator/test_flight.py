"""The phase machine and membership changes as pure functions: a flight record, what
arrives, the time; no journal, no broker, no event loop."""

from __future__ import annotations

import copy

import pytest

from tmd import wire
from tmd.config import ActuatorConfig
from tmd.daemon.actuator.flight import Flight, Next, PhaseMachine, machine_slots, outcome_record
from tmd.daemon.actuator.membership import Membership, moved
from tmd.daemon.view import JobView

T0 = 1_800_000_000.0
MACHINE = PhaseMachine(ActuatorConfig(prepare_timeout_s=30, switch_timeout_s=20, resend_s=5))


def flight(phase: str = "preparing", **acks: list[str]) -> Flight:
    f = Flight(
        id="m1", job="j", leaver="w2", joiner="s0", policy="drain", reason="r",
        phase=phase, generation=3, members=frozenset({"w0", "w1", "w2"}),  # type: ignore[arg-type]
        deadline=T0 + 30, next_send=T0 + 5,
    )  # fmt: skip
    for kind, nodes in acks.items():
        for node in nodes:
            f.keep(ack(kind, node))
    return f


def ack(kind: str, node: str, total_s: float | None = None, mid: str = "m1") -> wire.Ack:
    downtime = wire.Downtime(total_s=total_s) if total_s is not None else None
    return wire.Ack(ts=T0, job="j", migration_id=mid, kind=kind, node=node, downtime=downtime)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("before", "answer", "expect", "phase"),
    [
        (flight(prepared=["w0"]), ack("prepared", "w1"), Next("none"), "preparing"),
        (flight(prepared=["w0", "w1"]), ack("prepared", "w2"), Next("switch"), "preparing"),
        (flight(), ack("failed", "w1"), Next("abort", "w1 failed: "), "preparing"),
        (flight(aborted=["w0"]), ack("aborted", "w1"), Next("none"), "aborting"),
        (flight(aborted=["w0"], failed=["w1"]), ack("aborted", "w2"), Next("aborted", "w2: "),
         "aborting"),
        # The prepared answers were lost: a switched answer moves it on all the same.
        (flight(switched=["w0", "w1"]), ack("switched", "s0"), Next("done"), "switching"),
        (flight("switching"), ack("switched", "w2"), Next("none"), "switching"),  # the leaver
        (flight("runtime"), ack("switched", "w0", mid="failover-g3"),
         Next("done", "replaced by the runtime's failover"), "runtime"),
    ],
)  # fmt: skip
def test_acks(before: Flight, answer: wire.Ack, expect: Next, phase: str) -> None:
    before = copy.deepcopy(before)  # the table's flights are built once, at collection
    assert MACHINE.on_ack(before, answer, T0 + 1) == expect
    assert before.phase == phase


@pytest.mark.parametrize(
    ("before", "at", "expect"),
    [
        (flight(), T0 + 4, Next("none")),
        (flight(), T0 + 5, Next("resend")),
        (flight(prepared=["w1"]), T0 + 30,
         Next("abort", "timed out waiting for prepared from w0, w2")),
        (flight("switching", switched=["w0"]), T0 + 30,
         Next("abort", "timed out waiting for switched from s0, w1")),
        (flight("aborting"), T0 + 30, Next("aborted", "")),  # the job runs with the leaver
        (flight("runtime"), T0 + 30, Next("done", "replaced by the runtime's failover")),
    ],
)  # fmt: skip
def test_ticks(before: Flight, at: float, expect: Next) -> None:
    job = JobView("j", state="running", members={0: "w0", 1: "w1", 2: "w2"})
    assert MACHINE.on_tick(copy.deepcopy(before), at, job) == expect


def test_an_abort_nobody_confirmed_failed_and_a_switch_seen_in_the_status_is_done() -> None:
    assert MACHINE.on_tick(flight("aborting"), T0 + 30, None) == Next(
        "failed", "no confirmation of the abort"
    )
    f = flight("switching")
    assert MACHINE.on_status(f, 3, {"w0", "w1", "s0"}) == Next("none")  # not a newer generation
    assert MACHINE.on_status(f, 4, {"w0", "w1", "s0"}) == Next("switched")
    assert MACHINE.on_tick(f, T0 + 30, None).action == "done"
    other = flight()
    assert MACHINE.on_status(other, 4, {"w0", "s1", "w2"}) == Next(
        "aborted", "the job's membership changed"
    )


def test_the_downtime_is_the_worst_of_the_stayers_and_the_joiner() -> None:
    f = flight("switching")
    for node, total in (("w0", 0.2), ("w1", 0.4), ("s0", 0.3), ("w2", 9.0)):
        f.keep(ack("switched", node))
        f.keep(ack("switched", node, total))  # a repeat with the downtime replaces it
    record, downtime = outcome_record(f, "done")
    assert downtime == 0.4 and record["downtime_median_s"] == 0.3


def test_a_machine_the_runtime_replaced_is_found_once_and_ours_are_not() -> None:
    before = Membership(generation=1, step=10, ts=T0, members={0: "a", 1: "a", 2: "b", 3: "c"})
    after = Membership(generation=2, step=11, ts=T0, members={0: "x", 1: "x", 2: "y", 3: "c"})
    assert moved("j", before, after, switched_to=set(), replaced={}) == [
        ((0, 1), "a", "x"),
        ((2,), "b", "y"),
    ]
    assert moved("j", before, after, switched_to={"y"}, replaced={("j", "a"): "x"}) == []
    assert moved("j", after, after, switched_to=set(), replaced={}) == []


def test_the_joiners_prepared_does_not_stand_in_for_a_members() -> None:
    # The standby answers "prepared" too; only the members' answers move it on.
    f = flight(prepared=["w0", "w1"])
    assert MACHINE.on_ack(f, ack("prepared", "s0"), T0 + 1) == Next("none")
    assert MACHINE.on_ack(f, ack("prepared", "w2"), T0 + 2) == Next("switch")


def test_a_failed_answer_while_switching_aborts() -> None:
    f = flight("switching", switched=["w0"])
    assert MACHINE.on_ack(f, ack("failed", "w1"), T0 + 1) == Next("abort", "w1 failed: ")


def test_more_answers_do_not_push_the_phase_deadline_back() -> None:
    f = flight()
    MACHINE.set_phase(f, "aborting", T0)
    deadline = f.deadline
    MACHINE.on_ack(f, ack("aborted", "w0"), T0 + 5)
    assert (f.phase, f.deadline) == ("aborting", deadline)
    MACHINE.set_phase(f, "switching", T0)
    deadline = f.deadline
    MACHINE.on_ack(f, ack("switched", "w0"), T0 + 5)
    assert (f.phase, f.deadline) == ("switching", deadline)


def test_a_runtime_failover_waits_for_its_donors_switched_answer() -> None:
    f = flight("runtime")
    assert MACHINE.on_ack(f, ack("failed", "w0", mid="failover-g3"), T0 + 1) == Next("none")
    assert MACHINE.on_tick(f, T0 + 29, None) == Next("none")
    assert MACHINE.on_status(f, 9, {"w0", "w1", "x"}) == Next("none")  # not ours to abort
    assert MACHINE.on_tick(f, T0 + 30, None).action == "done"


def test_a_repeat_without_the_downtime_does_not_replace_one_with_it() -> None:
    f = flight("switching")
    f.keep(ack("switched", "w0", 0.9))
    f.keep(ack("switched", "w0"))  # a late copy of an answer from before it measured
    assert outcome_record(f, "done")[1] == 0.9


def test_the_commands_carry_the_job_the_id_and_the_time() -> None:
    f = flight()
    f.abort_reason = "x" * 2000  # a member's detail can be long; the wire bounds it
    assert MACHINE.command(f, T0 + 1) == wire.Prepare(
        ts=T0 + 1, job="j", migration_id="m1", leaver="w2", joiner="s0", deadline_s=30
    )
    f.phase = "switching"
    assert MACHINE.command(f, T0 + 2) == wire.Switch(ts=T0 + 2, job="j", migration_id="m1")
    f.phase = "aborting"
    abort = MACHINE.command(f, T0 + 3)
    assert abort == wire.Abort(ts=T0 + 3, job="j", migration_id="m1", reason="x" * 1000)
    assert wire.decode(wire.encode(abort), wire.Control) == abort
    assert f.next_send == T0 + 3 + 5


def test_the_journal_keeps_the_worst_downtime_and_its_breakdown() -> None:
    f = flight("switching")
    parts = {"stop_s": 0.1, "transfer_s": 0.05, "switch_s": 0.2, "first_step_s": 0.05}
    f.keep(ack("switched", "w0", 0.2))
    f.keep(ack("switched", "s0", 0.3))
    f.keep(wire.Ack(ts=T0, job="j", migration_id="m1", kind="switched", node="w1",
                    downtime=wire.Downtime(total_s=0.4, **parts)))  # fmt: skip
    f.keep(ack("switched", "w2", 9.0))  # the leaver's
    assert outcome_record(f, "done", "late") == (
        {"outcome": "done", "detail": "late", "downtime_s": 0.4, "downtime_median_s": 0.3,
         "breakdown": parts},
        0.4,
    )  # fmt: skip
    assert outcome_record(flight(), "aborted", "why") == (
        {"outcome": "aborted", "detail": "why"},
        None,
    )


def test_a_refusers_answer_to_the_abort_can_be_the_last_one() -> None:
    f = flight(aborted=["w0", "w2"])
    MACHINE.set_phase(f, "aborting", T0)
    assert MACHINE.on_ack(f, ack("failed", "w1"), T0 + 1) == Next("aborted", "")


# -- machines of several processes (issue 11) --------------------------------------------


def machines_flight(phase: str = "preparing") -> Flight:
    """Three machines of two processes each; w2 leaves for the two-slot standby s0."""
    return Flight(
        id="m1", job="j", leaver="w2", joiner="s0", policy="drain", reason="r",
        phase=phase, generation=3, members=frozenset({"w0", "w1", "w2"}),  # type: ignore[arg-type]
        deadline=T0 + 30, next_send=T0 + 5, slots={"w0": 2, "w1": 2, "w2": 2, "s0": 2},
    )  # fmt: skip


def process(kind: str, node: str, local: int, total_s: float | None = None) -> wire.Ack:
    downtime = wire.Downtime(total_s=total_s) if total_s is not None else None
    return wire.Ack(
        ts=T0, job="j", migration_id="m1", kind=kind, node=node, local_rank=local,  # type: ignore[arg-type]
        downtime=downtime,
    )  # fmt: skip


def test_a_machine_is_prepared_once_every_one_of_its_processes_is() -> None:
    f = machines_flight()
    for node in ("w0", "w1"):
        for local in (0, 1):
            assert MACHINE.on_ack(f, process("prepared", node, local), T0) == Next("none")
    assert MACHINE.on_ack(f, process("prepared", "w2", 0), T0) == Next("none")
    assert MACHINE.on_ack(f, process("prepared", "w2", 0), T0) == Next("none")  # a repeat
    assert f.acked("prepared") == {"w0", "w1"}
    assert MACHINE.on_tick(f, T0 + 30, None) == Next(
        "abort", "timed out waiting for prepared from w2 (1 of 2)"
    )
    assert MACHINE.on_ack(f, process("prepared", "w2", 1), T0) == Next("switch")


def test_a_switch_with_one_of_the_joiners_two_processes_is_not_done() -> None:
    f = machines_flight("switching")
    for node in ("w0", "w1"):
        for local in (0, 1):
            MACHINE.on_ack(f, process("switched", node, local, 0.1), T0)
    assert MACHINE.on_ack(f, process("switched", "s0", 0, 0.2), T0) == Next("none")
    assert MACHINE.on_tick(f, T0 + 30, None) == Next(
        "abort", "timed out waiting for switched from s0 (1 of 2)"
    )
    assert MACHINE.on_ack(f, process("switched", "s0", 1, 0.3), T0) == Next("done")


def test_an_abort_ends_when_every_process_of_every_member_confirmed() -> None:
    f = machines_flight()
    MACHINE.set_phase(f, "aborting", T0)
    for node in ("w0", "w1"):
        for local in (0, 1):
            MACHINE.on_ack(f, process("aborted", node, local), T0)
    assert MACHINE.on_ack(f, process("aborted", "w2", 0), T0) == Next("none")
    # One process refused the prepare (it counts as out), its sibling aborted.
    assert MACHINE.on_ack(f, process("failed", "w2", 1), T0) == Next("aborted", "")


def test_one_process_that_fails_or_aborts_speaks_for_the_migration() -> None:
    f = machines_flight()
    assert MACHINE.on_ack(f, process("failed", "w1", 1), T0) == Next("abort", "w1 failed: ")
    g = machines_flight("switching")
    assert MACHINE.on_ack(g, process("aborted", "s0", 1), T0) == Next("none")
    assert g.phase == "aborting"


def test_the_downtime_is_the_worst_of_every_process_but_the_leavers() -> None:
    f = machines_flight("switching")
    for node, local, total in [
        ("w0", 0, 0.2),
        ("w0", 1, 0.5),
        ("w1", 0, 0.1),
        ("w1", 1, 0.1),
        ("s0", 0, 0.3),
        ("s0", 1, 0.4),
        ("w2", 0, 9.0),
        ("w2", 1, 9.0),
    ]:
        f.keep(process("switched", node, local, total))  # fmt: skip
    record, downtime = outcome_record(f, "done")
    assert downtime == 0.5 and record["downtime_median_s"] == 0.25


def test_each_machines_processes_come_from_its_ranks_and_the_joiner_takes_the_leavers() -> None:
    machines = {"w0": [0, 1], "w1": [2, 3], "w2": [4]}
    assert machine_slots(machines, "w1", "s0") == {"w0": 2, "w1": 2, "s0": 2}
    assert machine_slots(machines, "w2", "s0") == {"w0": 2, "w1": 2}  # one: the default
    assert machine_slots({"w0": [0], "s0": [1, 2]}, "w9", "s0") == {"s0": 2, "w9": 2}  # switched


def restart_flight() -> Flight:
    return Flight(
        id="r1", job="j", leaver="w2", joiner="", policy="failover", reason="GpuFault on w2",
        phase="restarting", generation=3, members=frozenset({"w0", "w1", "w2"}),
        deadline=T0 + 20, next_send=T0 + 5, slots={"w2": 2},
    )  # fmt: skip


def test_a_restart_is_done_on_any_processs_answer_or_the_jobs_status() -> None:
    f = restart_flight()
    assert MACHINE.command(f, T0) == wire.Restart(
        ts=T0, job="j", migration_id="r1", node="w2", reason="GpuFault on w2"
    )
    answer = wire.Ack(ts=T0, job="j", migration_id="r1", kind="restarting", node="w0", rank=0,
                      local_rank=0)  # fmt: skip
    assert MACHINE.on_ack(restart_flight(), answer, T0) == Next(
        "done", "w0 rank 0 answered restarting"
    )
    assert MACHINE.on_status(f, 3, {"w0", "w1", "w2"}) == Next("none")
    assert MACHINE.on_status(f, 3, {"w0", "w1", "w2"}, state="restarting") == Next(
        "done", "the job's status says restarting"
    )
    assert MACHINE.on_status(f, 4, {"w0", "w1", "s9"}) == Next(
        "aborted",
        "w2 left the job in generation 4 without a restart (the runtime replaced it, or went "
        "on without it)",
    )
    assert MACHINE.on_tick(f, T0 + 5, None) == Next("resend")
    assert MACHINE.on_tick(f, T0 + 20, None) == Next(
        "failed", "no answer to the restart within 20 s"
    )
    refused = wire.Ack(ts=T0, job="j", migration_id="r1", kind="failed", node="w1", detail="io")
    assert MACHINE.on_ack(restart_flight(), refused, T0) == Next("failed", "w1 failed: io")
