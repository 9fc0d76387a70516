"""Clock skew between a job's machines (issue 12, item 10): the actuator tells a new run
of a job from a late status by the job's counts (run, generation, step), not by the
time each member's own clock put on its status. A restarted job whose new rank 0's
clock is behind is the new run; a status of the run before, or of this run gone back,
is late even when its sender's clock is ahead."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from msgspec.structs import replace

from tests.unit.daemon.actuator.test_actuator import JOB, T0, Harness, status
from tmd import wire
from tmd.daemon import events
from tmd.daemon.actuator.membership import Since, of, since

SKEW_S = 30.0


def at(run: int, generation: int, step: int, ts: float) -> wire.JobStatus:
    return replace(status(generation, standbys={}), run=run, step=step, ts=ts)


def without_run(s: wire.JobStatus) -> wire.JobStatus:
    """``s`` as a runtime from before runs sends it: no run at all."""
    fields = msgspec.json.decode(wire.encode(s))
    del fields["run"]
    decoded: wire.JobStatus = wire.decode(msgspec.json.encode(fields), wire.JobStatus)
    return decoded


def _named(s: wire.JobStatus) -> str:
    return f"run{s.run}-g{s.generation}-s{s.step}-t{s.ts - T0:+.0f}"


BEFORE = at(run=1, generation=2, step=500, ts=T0 + 100)


@pytest.mark.parametrize(
    ("status_", "seen"),
    [
        # The launcher restarted the job; the new rank 0's clock is behind the old one's.
        (at(2, 0, 480, T0 + 100 - SKEW_S), "new run"),
        (at(2, 0, 480, T0 - 3600), "new run"),
        (at(2, 3, 900, T0 + 100 - SKEW_S), "new run"),
        # This run moved on, stamped by a member whose clock is behind: no late status.
        (at(1, 3, 501, T0 + 100 - SKEW_S), "next"),
        (at(1, 2, 500, T0 + 100 - SKEW_S), "next"),  # the same status, sent again
        # This run gone back, from a member whose clock is ahead: late, no new run.
        (at(1, 1, 400, T0 + 100 + SKEW_S), "late"),
        (at(1, 2, 499, T0 + 100 + SKEW_S), "late"),
        (at(1, 1, 900, T0 + 100 + SKEW_S), "late"),
        # The run before, delivered late.
        (at(0, 4, 470, T0 + 90), "late"),
        (at(0, 2, 500, T0 + 100), "late"),
    ],
    ids=lambda v: _named(v) if isinstance(v, wire.JobStatus) else v,
)
def test_a_status_is_placed_by_the_jobs_counts_whatever_its_clock(
    status_: wire.JobStatus, seen: Since
) -> None:
    assert since(of(BEFORE), status_) == seen


def test_a_status_without_a_run_is_run_0_and_only_its_time_can_tell_a_restart() -> None:
    # A runtime from before runs restarts at generation 0 with every run numbered 0:
    # nothing but the time tells its new run from a late status of the old one.
    before = of(without_run(at(0, 2, 500, T0 + 100)))
    assert before.run == 0
    assert since(before, without_run(at(0, 0, 480, T0 + 130))) == "new run"
    assert since(before, without_run(at(0, 1, 450, T0 + 90))) == "late"
    assert since(before, without_run(at(0, 2, 501, T0 + 90))) == "next"
    # A runtime that counts runs, after one that did not: its first restart is run 1.
    assert since(before, at(1, 0, 480, T0 + 100 - SKEW_S)) == "new run"


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path / "journal.sqlite3")


def restarts(h: Harness) -> list[events.JobRestarted]:
    return [e for e in h.emitted if isinstance(e, events.JobRestarted)]


def test_a_restarted_job_whose_new_rank_0_is_behind_is_the_new_run(h: Harness) -> None:
    h.status(at(0, 2, 500, T0 + 100), T0 + 100)
    h.status(at(1, 0, 480, T0 + 100 - SKEW_S), T0 + 120)  # stamped 30 s before the last
    [new_run] = restarts(h)
    assert (new_run.run, new_run.generation, new_run.step) == (1, 0, 480)
    assert h.journal.memberships()[JOB].run == 1
    # The new run goes on, still on that clock: each status is the next, not late.
    h.status(at(1, 1, 490, T0 + 100 - SKEW_S + 20), T0 + 140)
    assert len(restarts(h)) == 1
    assert (h.journal.memberships()[JOB].generation, h.journal.memberships()[JOB].step) == (
        1,
        490,
    )


def test_a_late_status_from_a_clock_ahead_is_no_new_run(h: Harness) -> None:
    h.status(at(1, 2, 500, T0 + 100), T0 + 100)
    # A member of the same run whose clock is ahead; its status of generation 1 came
    # after the generation 2 one.
    assert h.status(at(1, 1, 450, T0 + 100 + SKEW_S), T0 + 101) == []
    assert restarts(h) == []
    # A status of the run before, from a machine whose clock is behind.
    assert h.status(at(0, 4, 520, T0 + 100 - SKEW_S), T0 + 102) == []
    assert restarts(h) == []
    assert h.journal.memberships()[JOB].generation == 2
