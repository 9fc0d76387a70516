"""What the actuator keeps of jobs and machines stays bounded however many names outside
publishers choose (issue 12, item 8): memberships, the runtime's early answers, who
replaced whom, restarts asked, cooldowns and rate limits, a runtime failover's answers.
On an injected clock, a real SQLite journal and the real cluster view."""

from __future__ import annotations

from pathlib import Path

import pytest
from msgspec.structs import replace

from tests.unit.daemon.actuator.test_actuator import JOB, T0, WORKERS, Harness, ack, status
from tmd import wire
from tmd.daemon import events
from tmd.daemon.actuator.guardrails import GuardState
from tmd.daemon.actuator.ledger import MAX_REPLACED
from tmd.daemon.actuator.membership import MAX_EARLY_ACKS, Membership, Memberships
from tmd.daemon.journal import Journal


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path / "journal.sqlite3")


def test_memberships_are_kept_for_the_jobs_the_view_holds_and_read_back_when_one_returns(
    h: Harness,
) -> None:
    for i in range(2000):  # a job a second, each silent after its status
        now = T0 + i
        h.status(replace(status(), job=f"j{i}"), now)
        if i % 50 == 49:  # the daemon's housekeeping
            h.view.forget_silent(now, after_s=5)
            h.actuator.prune(now)
            assert set(h.actuator.memberships._seen) <= set(h.view.jobs)
        assert len(h.actuator.memberships) <= 50 + 6  # the view's, and those since
    assert h.journal.membership("j7") is not None  # until the journal prunes it
    # A forgotten job's next status is still compared with its last membership: the
    # runtime replaced w1 meanwhile, and that is journaled as its failover.
    h.status(replace(status(1, ["w0", "s0", "w2"], standbys={}), job="j7"), T0 + 3000)
    [flight] = h.actuator.flights.values()
    assert (flight.job, flight.leaver, flight.joiner, flight.phase) == ("j7", "w1", "s0", "runtime")


def test_memberships_in_memory_are_a_capped_cache_of_the_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    memberships = Memberships(journal, cap=8)
    for i in range(1000):
        job = f"j{i}"
        memberships.record(replace(status(generation=i), job=job), memberships.get(job), now=T0)
        assert len(memberships) <= 8
    assert memberships.get("j0") == Membership(0, 0, T0, dict(enumerate(WORKERS)))  # read back
    assert memberships.get("j999") is not None and memberships.get("nobody") is None


def test_answers_of_unknown_jobs_are_not_kept_and_those_of_a_known_one_are_capped(
    h: Harness,
) -> None:
    for i in range(5000):  # made up, or another head's: no status of the job came
        h.feed(replace(ack("failover-g0", "failed", "w0"), job=f"nobody{i}"))
    assert len(h.actuator.failover_acks) == 0
    assert not [e for e in h.emitted if isinstance(e, events.CheckpointRestart)]
    h.status(status())
    for i in range(3 * MAX_EARLY_ACKS):
        h.feed(ack(f"failover-g{i}", "failed", "w0"))
    assert len(h.actuator.failover_acks) <= 2 * MAX_EARLY_ACKS
    h.view.forget_job(JOB)
    h.actuator.prune(T0)
    assert len(h.actuator.failover_acks) == 0


def test_who_replaced_whom_is_capped_and_forgotten_with_its_job(h: Harness) -> None:
    ledger = h.actuator.ledger
    h.status(status())
    for i in range(3 * MAX_REPLACED):
        ledger.replace(JOB if i % 2 else f"gone{i}", f"n{i}", f"s{i}")
    assert len(ledger.replaced) == MAX_REPLACED
    newest = 3 * MAX_REPLACED - 1
    assert ledger.replaced[(JOB, f"n{newest}")] == f"s{newest}"  # the oldest went
    ledger.restarts_asked[(JOB, "w2")] = "r1"
    ledger.restarts_asked[("gone", "w2")] = "r2"
    h.actuator.prune(T0)
    assert {job for job, _ in ledger.replaced} == {JOB}
    assert ledger.restarts_asked == {(JOB, "w2"): "r1"}


def test_cooldowns_and_rate_limits_are_forgotten_once_they_ran_out() -> None:
    state = GuardState()
    for i in range(10_000):  # a migration a second, each of another machine
        decision = events.Migrate(ts=T0 + i, policy="failover", reason="", job="j", node=f"n{i}")
        state.record_start(decision, T0 + i)
        state.record_end("j")
        state.last_restart[("j", f"n{i}")] = T0 + i
    state.prune(T0 + 10_000, cooldown_s=1800)
    # Kept: what still holds a machine back (started less than 1800 s ago), and the
    # starts of the last hour.
    assert len(state.last_on_node) == len(state.last_restart) == 1799
    assert min(state.last_on_node.values()) == T0 + 10_000 - 1799
    assert list(state.started) == [T0 + i for i in range(6400, 10_000)]
    assert state.in_flight == {}


def test_a_runtime_failover_keeps_only_the_answer_that_ends_it(h: Harness) -> None:
    h.status(status())
    h.status(status(1, ["w0", "s0", "w2"], standbys={}), T0 + 3)
    [flight] = h.actuator.flights.values()
    for i in range(2000):  # answers of no use to it, from any node
        h.feed(wire.Ack(ts=T0, job=JOB, migration_id="failover-g0", kind="prepared", node=f"x{i}"))
    assert flight.acks == {}
    h.feed(ack("failover-g0", "switched", "w0", 0.7))
    [end] = h.finished()
    assert (end.node, end.to, end.downtime_s) == ("w1", "s0", 0.7) and len(flight.acks) == 1
