"""The cost model: reading the bench's output, the checkpoint-interval formulas
against their published figures, and how each recovery method is priced."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tmd.sim import cost
from tmd.sim.cost import Costs, Local

# The shape `tmd bench downtime --nproc 4 --nproc-per-node 2 --json` prints (trimmed
# to what the model reads, plus a few fields it must ignore).
SAMPLE: dict[str, Any] = {
    "nproc": 4,
    "nproc_per_node": 2,
    "steps": 24,
    "median_step_s": 1.25,
    "live": {"downtime_s": 0.135, "runtime_downtime_s": 0.068, "median_step_s": 1.25},
    "cold_standby": {"downtime_s": 1.44, "runtime_downtime_s": 1.51},
    "checkpoint_restart": {"downtime_s": 14.5, "median_step_s": 1.25},
    "failover": {"downtime_s": 1.99, "runtime_downtime_s": 2.05, "exit_codes": [0, -9]},
    "machine": {
        "nproc_per_node": 2,
        "downtime_s": 0.207,
        "runtime_downtime_s": 0.252,
        "median_step_s": 1.54,
        "failover_downtime_s": 1.58,
        "checkpoint_restart": {"downtime_s": 15.3},
        "failover": {"downtime_s": 1.58, "runtime_downtime_s": 1.38},
        "holds_target": True,
    },
}

MINUTE = 60.0
HOUR = 3600.0


def one_process() -> dict[str, Any]:
    return {**copy.deepcopy(SAMPLE), "machine": None}


def test_fit_prefers_the_machine_run_and_takes_the_worse_downtime() -> None:
    local = cost.fit(SAMPLE, source="sample")
    assert local == Local(step_s=1.54, live_s=0.252, failover_s=1.58,
                          checkpoint_restart_s=15.3, source="sample")  # fmt: skip


def test_fit_reads_machines_of_one_process_without_a_machine_run() -> None:
    local = cost.fit(one_process())
    assert (local.step_s, local.live_s, local.failover_s, local.checkpoint_restart_s) == (
        1.25, 0.135, 2.05, 14.5,
    )  # fmt: skip


def test_fit_takes_the_machine_object_alone() -> None:
    assert cost.fit(SAMPLE["machine"]).live_s == 0.252


def test_fit_floors_a_negative_downtime_lost_in_the_noise() -> None:
    result = one_process()
    result["live"] = {"downtime_s": -0.112, "runtime_downtime_s": -0.038}
    assert cost.fit(result).live_s == 0.0


def test_fit_without_runtime_downtimes_uses_the_step_records() -> None:
    result = one_process()
    del result["live"]["runtime_downtime_s"]
    result["failover"]["runtime_downtime_s"] = None
    local = cost.fit(result)
    assert (local.live_s, local.failover_s) == (0.135, 1.99)


@pytest.mark.parametrize(
    ("shape", "path"),
    [
        ("machine", "machine.failover.downtime_s"),
        ("machine", "machine.checkpoint_restart.downtime_s"),
        ("machine", "machine.median_step_s"),
        ("machine", "machine.downtime_s"),
        ("process", "live.downtime_s"),
        ("process", "median_step_s"),
        ("process", "failover.downtime_s"),
    ],
)
def test_fit_names_a_missing_field(shape: str, path: str) -> None:
    result = copy.deepcopy(SAMPLE) if shape == "machine" else one_process()
    *parents, leaf = path.split(".")
    here = result
    for key in parents:
        here = here[key]
    del here[leaf]
    with pytest.raises(ValueError, match=re.escape(repr(path))):
        cost.fit(result)


def test_fit_rejects_what_is_not_the_bench_output() -> None:
    with pytest.raises(ValueError, match="'live'"):
        cost.fit({"median_step_s": 1.0})


@pytest.mark.parametrize("bad", ["1.5", None, True, float("nan")])
def test_fit_rejects_a_field_that_is_not_a_number(bad: object) -> None:
    result = copy.deepcopy(SAMPLE)
    result["machine"]["checkpoint_restart"]["downtime_s"] = bad
    with pytest.raises(ValueError, match=re.escape("'machine.checkpoint_restart.downtime_s'")):
        cost.fit(result)


def test_load_defaults_to_the_readme_figures_and_reads_a_saved_run(tmp_path: Path) -> None:
    default = cost.load()
    assert (default.step_s, default.live_s, default.failover_s) == (1.54, 0.252, 1.58)
    assert "b730c00" in default.source
    saved = tmp_path / "downtime.json"
    saved.write_text(json.dumps(one_process()))
    assert cost.load(saved) == cost.fit(one_process(), source=str(saved))
    saved.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        cost.load(saved)


def test_young() -> None:
    # sqrt(2 * 5 min * 24 h) = 120 min exactly
    assert cost.young(5 * MINUTE, 24 * HOUR) == pytest.approx(120 * MINUTE)


# Daly (2006) reports tau_opt for delta = 5 min (R = 10 min, which eq. 37 does not
# use) to the precision printed: whole minutes for 117 and 57, a tenth for 9.1. Eq. 37
# lands within half the last printed digit of each (116.69, 56.71, 9.14 min).
@pytest.mark.parametrize(
    ("mtbf_s", "published_s", "printed_to_s"),
    [(24 * HOUR, 117 * MINUTE, MINUTE), (6 * HOUR, 57 * MINUTE, MINUTE),
     (15 * MINUTE, 9.1 * MINUTE, 0.1 * MINUTE)],
)  # fmt: skip
def test_daly_matches_the_published_intervals(
    mtbf_s: float, published_s: float, printed_to_s: float
) -> None:
    assert abs(cost.daly(5 * MINUTE, mtbf_s) - published_s) <= printed_to_s / 2


def test_daly_checkpoints_once_per_mtbf_when_a_save_outlasts_two() -> None:
    assert cost.daly(2 * HOUR, HOUR) == HOUR
    assert cost.daly(3 * HOUR, HOUR) == HOUR
    assert cost.daly(1 * MINUTE, HOUR) < cost.young(1 * MINUTE, HOUR)


def test_interval_formulas_reject_non_positive_inputs() -> None:
    with pytest.raises(ValueError, match="mtbf_s"):
        cost.daly(1.0, 0.0)
    with pytest.raises(ValueError, match="delta_s"):
        cost.young(-1.0, 10.0)


def test_ettr_is_clipped_useful_over_wall() -> None:
    assert cost.ettr(90.0, 100.0) == pytest.approx(0.9)
    assert cost.ettr(120.0, 100.0) == 1.0
    assert cost.ettr(-5.0, 100.0) == 0.0
    with pytest.raises(ValueError, match="wall_s"):
        cost.ettr(1.0, 0.0)


SIZES = [8, 32, 256, 1024, 2048, 8192, 16_384, 131_072]
GROWING = ["live_migration_s", "machine_failover_s", "restart_init_s", "warm_standby_restart_s"]


def at(gpus: int, **kw: Any) -> Costs:
    return cost.at_scale(cost.load(), gpus, **kw)


@pytest.mark.parametrize("field", GROWING)
def test_switch_and_restart_costs_grow_with_the_job(field: str) -> None:
    values = [getattr(at(n), field) for n in SIZES]
    assert values == sorted(values)
    assert values[-1] > values[0]


def test_trainmover_growth_adds_ten_seconds_from_32_to_1024_gpus() -> None:
    assert at(1024).live_migration_s - at(32).live_migration_s == pytest.approx(10.0)
    assert at(8).live_migration_s == at(32).live_migration_s == cost.load().live_s


def test_restart_at_8192_gpus_is_near_trainmovers_cold_start() -> None:
    c = at(8192)
    # TrainMover's measured cold start of an 8,192-GPU job: 4.45 min (267 s).
    assert c.restart_init_s + c.checkpoint_load_s == pytest.approx(267.0, rel=0.1)


def test_step_time_is_a_parameter() -> None:
    assert at(1024).step_s == cost.MEGASCALE_STEP_S
    assert at(1024, step_s=2.0).step_s == 2.0
    with pytest.raises(ValueError, match="gpus"):
        at(0)
    with pytest.raises(ValueError, match="step_s"):
        at(8, step_s=0.0)


def price(method: cost.Method, signal: cost.Signal, gpus: int = 8192, **kw: Any) -> cost.Recovery:
    args: dict[str, Any] = {"since_checkpoint_s": 1800.0, "standby_ready": True, **kw}
    return cost.recovery(method, signal, at(gpus), **args)


def total(r: cost.Recovery) -> float:
    return r.detect_s + r.downtime_s + r.lost_work_s + r.degraded_s * r.degraded_fraction


@pytest.mark.parametrize("gpus", SIZES)
@pytest.mark.parametrize("signal", ["xid", "node_lost"])
def test_tmd_failover_onto_a_ready_standby_beats_checkpoint_restart(
    gpus: int, signal: cost.Signal
) -> None:
    tmd = price("tmd", signal, gpus)
    restart = price("checkpoint_restart", signal, gpus)
    assert tmd.downtime_s < restart.downtime_s
    assert tmd.lost_work_s == 0.5 * at(gpus).step_s < restart.lost_work_s
    assert tmd.uses_standby and not restart.uses_standby


@pytest.mark.parametrize("signal", ["xid", "node_lost", "planned", "straggler"])
def test_tmd_without_a_ready_standby_falls_back_to_checkpoint_restart(
    signal: cost.Signal,
) -> None:
    tmd = price("tmd", signal, standby_ready=False)
    restart = price("checkpoint_restart", signal, standby_ready=False)
    assert (tmd.downtime_s, tmd.lost_work_s, tmd.uses_standby) == (
        restart.downtime_s, restart.lost_work_s, False,
    )  # fmt: skip


def test_tmd_fails_over_only_with_replicas_but_moves_live_without() -> None:
    assert (
        price("tmd", "xid", replicas=False).downtime_s
        == price("checkpoint_restart", "xid").downtime_s
    )
    assert price("tmd", "planned", replicas=False).downtime_s == at(8192).live_migration_s


@pytest.mark.parametrize("signal", ["hang", "crash"])
def test_tmd_restarts_from_a_checkpoint_on_a_hang_or_crash(signal: cost.Signal) -> None:
    assert price("tmd", signal) == price("checkpoint_restart", signal)


def test_tmd_moves_a_planned_or_slow_machine_live_without_losing_work() -> None:
    signals: tuple[cost.Signal, ...] = ("planned", "straggler")
    for signal in signals:
        r = price("tmd", signal)
        assert (r.detect_s, r.downtime_s, r.lost_work_s) == (0.0, at(8192).live_migration_s, 0.0)


@pytest.mark.parametrize("signal", ["xid", "node_lost", "hang", "crash"])
def test_checkpoint_restart_loses_the_work_since_the_last_checkpoint(
    signal: cost.Signal,
) -> None:
    c = at(8192)
    r = price("checkpoint_restart", signal, since_checkpoint_s=1234.0)
    assert r.lost_work_s == 1234.0
    assert r.downtime_s == pytest.approx(c.requeue_s + c.restart_init_s + c.checkpoint_load_s)


def test_a_planned_checkpoint_restart_checkpoints_first() -> None:
    r = price("checkpoint_restart", "planned", since_checkpoint_s=1234.0)
    assert r.lost_work_s == 0.0
    assert r.downtime_s > price("checkpoint_restart", "xid").downtime_s


def test_detection_depends_on_signal_and_method() -> None:
    c = at(8192)
    assert price("tmd", "xid").detect_s == c.detect_xid_s
    assert price("tmd", "node_lost").detect_s == c.detect_lost_s == 15.0
    assert price("checkpoint_restart", "xid").detect_s == c.detect_other_s
    assert price("torchft_style", "node_lost").detect_s == c.torchft_timeout_s
    assert {price(m, "hang").detect_s for m in cost.METHODS} == {c.detect_hang_s}
    assert {price(m, "planned").detect_s for m in cost.METHODS} == {0.0}


def test_no_standby_provisions_a_machine_only_when_one_leaves() -> None:
    c = at(8192)
    for signal in ("xid", "node_lost"):
        extra = (
            price("no_standby", signal).downtime_s - price("checkpoint_restart", signal).downtime_s
        )  # type: ignore[arg-type]
        assert extra == pytest.approx(c.cold_standby_s)
    assert price("no_standby", "hang") == price("checkpoint_restart", "hang")


def test_warm_standby_restart_is_byterobusts_fraction_of_a_requeue() -> None:
    c = at(8192)
    r = price("warm_standby_restart", "xid")
    requeue = c.requeue_s + c.restart_init_s + c.checkpoint_load_s
    assert r.downtime_s == pytest.approx(requeue / 10.87)
    assert (r.lost_work_s, r.uses_standby) == (0.5 * c.step_s, True)
    assert price("warm_standby_restart", "xid", standby_ready=False) == price(
        "checkpoint_restart", "xid"
    )


def test_torchft_drops_a_group_and_runs_degraded_while_it_heals() -> None:
    c = at(8192)
    r = price("torchft_style", "xid", replica_groups=10)
    assert (r.downtime_s, r.lost_work_s, r.degraded_fraction) == (
        c.torchft_heal_s,
        0.5 * c.step_s,
        0.1,
    )
    assert r.degraded_s == c.restart_init_s
    slow = price("torchft_style", "xid", standby_ready=False)
    assert slow.degraded_s == c.restart_init_s + c.requeue_s
    assert slow.degraded_fraction == 1 / cost.TORCHFT_REPLICA_GROUPS
    assert price("torchft_style", "hang") == price("checkpoint_restart", "hang")
    unreplicated = price("torchft_style", "xid", replicas=False)
    restart = price("checkpoint_restart", "xid")
    assert (unreplicated.downtime_s, unreplicated.lost_work_s) == (restart.downtime_s, 1800.0)
    with pytest.raises(ValueError, match="replica_groups"):
        price("torchft_style", "xid", replica_groups=1)


def test_recovery_rejects_unknown_names_and_negative_progress() -> None:
    with pytest.raises(ValueError, match="method"):
        price("reboot", "xid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="signal"):
        price("tmd", "meteor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="since_checkpoint_s"):
        price("tmd", "xid", since_checkpoint_s=-1.0)


def test_every_method_prices_every_signal_non_negatively() -> None:
    for method in cost.METHODS:
        for signal in cost.SIGNALS:
            r = price(method, signal)
            assert min(r.detect_s, r.downtime_s, r.lost_work_s, r.degraded_s) >= 0
            assert 0 <= r.degraded_fraction < 1
            assert total(r) > 0
