"""Downtime from a member's step history: a switch's and a failover's, table-tested."""

from __future__ import annotations

import msgspec
import pytest

from tmd import wire
from tmd.runtime.failover import Recovery
from tmd.runtime.membership import Membership, Reconfiguration
from tmd.runtime.timing import PendingSwitch, StepTimes


@pytest.mark.parametrize(
    ("pending", "first_step_end", "median", "want"),
    [
        # A stayer: stopped 0.1 s after its last step, 0.3 s to switch, a 0.5 s first
        # step against a 0.2 s median.
        (
            PendingSwitch("m1", last_step_end=10.0, resumed=10.4, stop_s=0.1, switch_s=0.3),
            10.9,
            0.2,
            wire.Downtime(total_s=0.7, stop_s=0.1, switch_s=0.3, first_step_s=0.3),
        ),
        # A joiner: its downtime starts when the state began to arrive.
        (
            PendingSwitch("m1", last_step_end=5.0, resumed=5.5, transfer_s=0.25, switch_s=0.25),
            6.0,
            0.25,
            wire.Downtime(total_s=0.75, transfer_s=0.25, switch_s=0.25, first_step_s=0.25),
        ),
        # Faster than a median step: reported as measured, below zero (step noise),
        # not clamped; a part is never negative and the first step takes the rest.
        (
            PendingSwitch("m1", last_step_end=1.0, resumed=1.0, stop_s=-0.001),
            1.1,
            0.5,
            wire.Downtime(total_s=-0.4, first_step_s=-0.4),
        ),
    ],
)
def test_a_switch_costs_its_first_step_and_the_gap_before_it_minus_a_median_step(
    pending: PendingSwitch, first_step_end: float, median: float, want: wire.Downtime
) -> None:
    got = pending.downtime(first_step_end, median)
    for name in ("total_s", "stop_s", "transfer_s", "switch_s", "first_step_s"):
        assert getattr(got, name) == pytest.approx(getattr(want, name)), name
    parts = got.stop_s + got.transfer_s + got.switch_s + got.first_step_s
    assert parts == pytest.approx(got.total_s)
    msgspec.json.decode(wire.encode(got), type=wire.Downtime)  # a negative total travels


def test_a_failover_costs_the_failed_step_minus_a_median_one() -> None:
    rec = Recovery(
        id="failover-g0", swaps={"n1": "spare"}, reports=True, detect_s=0.4,
        transfer_s=0.2, build_s=0.3,
        change=Reconfiguration(object(), Membership(1, ("n0", "spare")), rank=0),
    )  # fmt: skip

    got = rec.downtime(step_start=19.0, step_end=20.5, median_step_s=0.5)

    assert got.total_s == pytest.approx(1.0)
    assert (got.stop_s, got.transfer_s, got.switch_s) == (0.4, 0.2, 0.3)
    assert got.first_step_s == pytest.approx(0.1)  # the rest: the parts add up


def test_a_process_taking_over_a_rank_measures_against_that_ranks_median() -> None:
    times = StepTimes()
    for duration in (0.1, 0.1, 0.9):
        times.durations.append(duration)
    assert times.median_step_s() == pytest.approx(0.1)

    times.inherit(0.3)

    assert times.median_step_s() == pytest.approx(0.3)
    assert StepTimes().median_step_s() == 0.0
