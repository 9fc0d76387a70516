"""What ``tmd bench downtime`` computes, pinned on fixed step records.

Rows are ``[rank, step, loss, end, step_s, rss_bytes, compute_s, allreduce_s,
optimizer_s]``; ``end`` is when the step's update ended, before its boundary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tmd.tools.bench import measure


def row(rank: int, step: int, end: float, step_s: float = 1.0, loss: float = 2.0) -> list[Any]:
    return [rank, step, loss, end, step_s, 100, 0.6, 0.3, 0.1]


def steady(ranks: int, steps: range) -> list[list[Any]]:
    """Every rank ends step ``s`` at ``s + 1`` seconds, rank ``r`` ``r`` ms late."""
    return [row(r, s, s + 1 + r / 1000) for s in steps for r in range(ranks)]


def test_downtime_runs_from_the_last_update_before_to_the_first_step_after_minus_a_median() -> None:
    # Steps 0-4 end at 1..5 s; the switch runs after step 4's update (at 5.002 s on the
    # latest rank) and takes 0.7 s; step 5 then takes a median second and ends at 6.7.
    rows = steady(3, range(5)) + [row(r, 5, 6.7 + r / 1000) for r in range(3)]

    got = measure.downtime(rows, rows, at=5, median=1.0)

    assert got == pytest.approx(0.7)


def test_downtime_is_reported_unclamped_below_zero() -> None:
    # The first step after a free switch was 0.05 s faster than the median.
    rows = steady(2, range(5)) + [row(r, 5, 5.950 + r / 1000) for r in range(2)]

    assert measure.downtime(rows, rows, at=5, median=1.0) == pytest.approx(-0.05)


def test_downtime_across_two_runs_takes_the_latest_rank_at_both_ends() -> None:
    before = steady(2, range(4))  # step 3 ends at 4.001 on the latest rank
    after = [row(0, 4, 20.0), row(1, 4, 21.0)]

    assert measure.downtime(before, after, at=4, median=1.0) == pytest.approx(21.0 - 4.001 - 1.0)


def test_median_step_reads_only_the_steps_asked_for() -> None:
    rows = [row(0, s, s, step_s=d) for s, d in enumerate([9.0, 9.0, 1.0, 2.0, 3.0, 9.0])]

    assert measure.median_step(rows, 2, 5) == 2.0


def test_step_noise_is_the_p90_deviation_of_the_gaps_between_step_ends() -> None:
    ends = [0.0, 1.0, 2.0]  # warm-up, not counted
    gaps = [1.0] * 9 + [1.5]  # ten gaps from step 3 on; one straggling step
    for gap in gaps:
        ends.append(ends[-1] + gap)
    rows = [row(0, s, t) for s, t in enumerate(ends)]

    # Deviations from the median gap (1.0): nine of 0, one of 0.5; the p90 index of
    # ten sorted values is 8, a zero.
    assert measure.step_noise(rows) == pytest.approx(0.0)
    rows.append(row(0, len(ends), ends[-1] + 1.4))
    assert measure.step_noise(rows) == pytest.approx(0.4)


def test_step_noise_takes_the_latest_rank_and_is_zero_without_enough_steps() -> None:
    rows = [row(0, 3, 3.0), row(1, 3, 3.2), row(0, 4, 4.0), row(1, 4, 4.1),
            row(0, 5, 5.0), row(1, 5, 5.5)]  # fmt: skip
    # Latest ends 3.2, 4.1, 5.5: gaps 0.9 and 1.4, median 1.15, deviations 0.25 both.
    assert measure.step_noise(rows) == pytest.approx(0.25)
    assert measure.step_noise([row(0, 3, 3.0), row(0, 4, 4.0)]) is None  # one gap
    assert measure.step_noise([]) is None


@pytest.mark.parametrize(
    ("numerator", "denominator", "noise", "want"),
    [
        (10.0, 0.5, 0.1, 20.0),  # a downtime above the noise
        (10.0, 0.007, 0.1, 100.0),  # lost in the noise: the noise divides, not 7 ms
        (10.0, -0.05, 0.1, 100.0),  # measured below zero
        (10.0, 0.0, 0.0, None),  # nothing to divide by: no ratio, no ZeroDivisionError
        (10.0, -0.1, 0.0, None),
        (10.0, 0.001, None, None),  # noise not measurable: no ratio, however small 1 ms is
    ],
)
def test_a_ratio_divides_by_the_larger_of_the_downtime_and_the_noise(
    numerator: float, denominator: float, noise: float | None, want: float | None
) -> None:
    got = measure.ratio(numerator, denominator, noise)
    assert got == (pytest.approx(want) if want is not None else None)


def test_the_plain_ratio_exists_only_above_the_noise() -> None:
    assert measure.above_noise(10.0, 0.5, 0.1) == pytest.approx(20.0)
    assert measure.above_noise(10.0, 0.05, 0.1) is None
    assert measure.above_noise(10.0, 0.0, 0.0) is None
    assert measure.above_noise(10.0, 0.5, None) is None


def test_worst_takes_the_larger_of_the_records_and_the_runtime() -> None:
    assert measure.worst({"downtime_s": 0.2, "runtime_downtime_s": 0.3}) == 0.3
    assert measure.worst({"downtime_s": 0.2, "runtime_downtime_s": None}) == 0.2
    assert measure.worst({"downtime_s": -0.1}) == -0.1


def test_the_breakdown_is_the_worst_members_and_its_parts_add_up() -> None:
    stayer = {"total_s": 0.4, "stop_s": 0.1, "transfer_s": 0.0, "switch_s": 0.25,
              "first_step_s": 0.05}  # fmt: skip
    joiner = {"total_s": 0.6, "stop_s": 0.0, "transfer_s": 0.2, "switch_s": 0.3,
              "first_step_s": 0.1}  # fmt: skip

    got = measure.parts_of({"worker0": stayer, "standby0": joiner})

    assert got["member"] == "standby0" and got["total_s"] == 0.6
    assert got["parts_sum_s"] == pytest.approx(got["total_s"])
    assert measure.parts_of({}) == {}


def test_a_restarts_parts_are_consecutive_and_add_up_to_its_downtime() -> None:
    before = [
        {"steps": [row(0, 4, 5.0)], "save": [5.1, 6.0]},
        {"steps": [row(1, 4, 5.2)], "save": [5.3, 6.5]},
    ]
    after = [
        {"steps": [row(0, 5, 30.0)], "t_built": 15.0, "t_entered": 16.0, "t_loaded": 18.0},
        {"steps": [row(1, 5, 30.5)], "t_built": 15.5, "t_entered": 16.2, "t_loaded": 18.5},
    ]

    parts = measure.restart_parts(before, after, at=5, median=1.0, exited=7.0)

    assert parts == pytest.approx({
        "stop_s": 5.3 - 5.2, "save_s": 6.5 - 5.3, "exit_s": 7.0 - 6.5, "start_s": 15.5 - 7.0,
        "init_group_s": 16.2 - 15.5, "load_s": 18.5 - 16.2, "first_step_s": 30.5 - 18.5 - 1.0,
    })  # fmt: skip
    rows_before = [r for rec in before for r in rec["steps"]]
    rows_after = [r for rec in after for r in rec["steps"]]
    total = measure.downtime(rows_before, rows_after, at=5, median=1.0)
    assert sum(parts.values()) == pytest.approx(total)


def test_slowdown_is_relative_to_the_same_steps_of_the_reference() -> None:
    reference = {(0, s): row(0, s, s, step_s=1.0 if s < 4 else 1.5) for s in range(8)}
    before = [row(0, s, s, step_s=2.0) for s in range(4)]
    # The reference itself got 50 % slower at step 4; these steps got 65 % slower.
    during = [row(0, s, s, step_s=3.3) for s in range(4, 8)]

    assert measure.slowdown(before, during, reference) == pytest.approx(1.65 / 1.5 - 1)


def test_losses_and_loss_match_read_every_rank_and_step(tmp_path: Path) -> None:
    reference = {(r, s): row(r, s, s, loss=2.0 - s / 10) for r in range(2) for s in range(3)}
    for r in range(2):
        steps = [row(r, s, s, loss=2.0 - s / 10 + 1e-7) for s in range(3)]
        (tmp_path / f"worker{r}.json").write_text(json.dumps({"steps": steps}))
    (tmp_path / "killed-1.json").write_text(json.dumps({"t_kill": 1.0}))  # not a record

    got = measure.losses(tmp_path)

    assert set(got) == set(reference)
    assert measure.loss_match(got, reference)
    assert not measure.loss_match({**got, (1, 2): got[(1, 2)] + 1e-5}, reference)
    missing = {k: v for k, v in got.items() if k != (0, 1)}
    assert not measure.loss_match(missing, reference)
    # After a failover the killed rank's losses are missing; the rest must still match.
    assert measure.loss_match(missing, reference, complete=False)
    assert not measure.loss_match({**missing, (1, 2): 0.0}, reference, complete=False)
    assert not measure.loss_match({**missing, (2, 0): 2.0}, reference, complete=False)


def test_a_machines_processes_each_leave_a_record_and_the_first_kill_counts(
    tmp_path: Path,
) -> None:
    # Two processes of worker1 share its node name; each kills itself, a little apart.
    for local in range(2):
        record = {"node": "worker1", "local_rank": local, "steps": [row(2 + local, 0, 1.0)]}
        (tmp_path / f"worker1-{local}.json").write_text(json.dumps(record))
        (tmp_path / f"killed-{2 + local}.json").write_text(json.dumps({"t_kill": 5.0 + local}))

    assert [r["local_rank"] for r in measure.records(tmp_path)] == [0, 1]
    assert measure.killed_at(tmp_path) == 5.0


def machine(**changed: Any) -> dict[str, Any]:
    """A machine's result that holds every target, with ``changed`` fields replaced."""
    m: dict[str, Any] = {
        "downtime_s": 0.1, "runtime_downtime_s": 0.12, "median_step_s": 0.4,
        "ratio_checkpoint_restart_vs_noise": 80.0, "failover_downtime_s": 1.0,
        "failover": {"runtime_downtime_s": 1.1}, "loss_match": True,
        "loss_match_checkpoint_restart": True, "loss_match_failover": True,
        "stayer_rss_overhead": 0.01,
    }  # fmt: skip
    return {**m, **changed}


@pytest.mark.parametrize(
    ("changed", "missed"),
    [
        ({}, []),
        # The runtime's measure counts too: 0.5 s is more than a 0.4 s step.
        ({"runtime_downtime_s": 0.5}, ["live downtime 0.500 s > one median step 0.400 s"]),
        ({"ratio_checkpoint_restart_vs_noise": 29.9}, ["checkpoint-restart ratio 29.9 < 30"]),
        (
            {"ratio_checkpoint_restart_vs_noise": None},
            ["checkpoint-restart ratio not measurable (step noise unknown)"],
        ),
        ({"failover": {"runtime_downtime_s": 2.5}}, ["failover downtime 2.500 s > 2 s"]),
        ({"failover_downtime_s": 2.1, "failover": {"runtime_downtime_s": None}},
         ["failover downtime 2.100 s > 2 s"]),
        ({"loss_match_failover": False},
         ["loss_match_failover false: not the reference job's training"]),
        ({"stayer_rss_overhead": 0.021}, ["stayer RSS overhead 0.021 > 0.02"]),
        ({"downtime_s": 0.4, "runtime_downtime_s": None, "stayer_rss_overhead": 0.02}, []),
        # Net of what the unmigrated run grew by over the same steps, where measured.
        ({"stayer_rss_overhead": 0.12, "stayer_rss_overhead_net": 0.01}, []),
        ({"stayer_rss_overhead": 0.01, "stayer_rss_overhead_net": 0.03},
         ["stayer RSS overhead 0.030 net of the reference run's growth > 0.02"]),
    ],
    ids=["holds", "live", "ratio", "no-ratio", "failover-runtime", "failover-records",
         "loss", "rss", "at-the-limits", "rss-net-holds", "rss-net"],
)  # fmt: skip
def test_a_machine_misses_each_target_for_its_own_reason(
    changed: dict[str, Any], missed: list[str]
) -> None:
    assert measure.machine_shortfalls(machine(**changed)) == missed


def test_the_load_says_how_busy_the_machine_was() -> None:
    got = measure.Load().as_dict()

    assert got["cpus"] >= 1
    assert got["load_1m_start"] >= 0 and got["load_1m_end"] >= 0
    assert got["python_loop_ns"] > 0
    steal = got["steal_fraction"]  # None where /proc/stat did not move, or is not there
    assert steal is None or 0 <= steal <= 1


def test_rss_growth_is_the_rise_of_the_peak() -> None:
    rows = lambda *rss: [[0, i, 0.0, 0.0, 1.0, r] for i, r in enumerate(rss)]  # noqa: E731
    assert measure.rss_growth(rows(100, 200), rows(150, 210)) == pytest.approx(0.05)
    assert measure.rss_growth(rows(200), rows(100)) == pytest.approx(-0.5)
