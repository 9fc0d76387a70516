"""``tmd bench downtime`` at its smallest sizes (1 layer): 2 ranks on machines of one
process (the size that once divided by zero), and, with ``--machine-only``, 4 ranks on
machines of two, moved and lost whole. Each finishes, every downtime is within
plausible bounds, each breakdown adds up to its total, the ratios are finite, and
every method trained exactly the reference job. The numbers themselves, targets
included, are the benchmark's business."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

SMALL = ["--layers", "1", "--steps", "14", "--prepare-at", "4", "--switch-at", "7", "--json"]


def bench(*args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tmd.cli", "bench", "downtime", *args, *SMALL],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout)  # the JSON object alone
    return result


def test_the_smallest_downtime_bench_measures_every_method_consistently() -> None:
    r = bench("--nproc", "2")

    noise = r["step_noise_s"]
    assert noise is not None and noise >= 0  # 14 steps are enough to measure it
    for name in ("live", "cold_standby", "failover"):
        method = r[name]
        median = method["median_step_s"]
        # The window holds the switch and one step; it can come out below zero by
        # step noise only (the first step after being faster than the median).
        assert -(noise + median) <= method["downtime_s"] < 60, name
        parts = method["breakdown"]
        assert parts["parts_sum_s"] == pytest.approx(parts["total_s"], abs=1e-9), name
        assert parts["total_s"] == method["runtime_downtime_s"], name
        assert math.isfinite(method["ratio_checkpoint_restart_vs_noise"]), name
    restart = r["checkpoint_restart"]
    assert sum(restart["breakdown"].values()) == pytest.approx(restart["downtime_s"], abs=1e-6)
    # A restart starts every process over: slower than a switch by far more than noise.
    assert restart["downtime_s"] > r["live"]["downtime_s"] + noise
    assert r["ratio_checkpoint_restart_vs_noise"] > 1
    assert r["ratio_checkpoint_restart"] is None or r["ratio_checkpoint_restart"] > 1
    assert r["loss_match"] and r["loss_match_cold_standby"]
    assert r["loss_match_checkpoint_restart"] and r["loss_match_failover"]
    assert r["failover"]["ranks_completing_step"] == [0, 1]
    assert r["machine"] is None  # machines of one process only


def test_a_machine_of_two_ranks_is_moved_restarted_and_lost_whole_consistently() -> None:
    r = bench("--nproc", "4", "--nproc-per-node", "2", "--machine-only")

    assert "live" not in r  # the runs on machines of one process were skipped
    m = r["machine"]
    assert m["nproc_per_node"] == 2
    noise = m["step_noise_s"]
    assert noise is not None and noise >= 0
    # Live: both ranks of worker1 moved to the standby machine's two slots.
    assert -(noise + m["median_step_s"]) <= m["downtime_s"] < 60
    parts = m["breakdown"]
    assert parts["parts_sum_s"] == pytest.approx(parts["total_s"], abs=1e-9)
    assert parts["total_s"] == m["runtime_downtime_s"]
    # Failover: both processes of worker1 died mid-step; the standby machine's two
    # slots finished that step.
    failover = m["failover"]
    assert m["failover_downtime_s"] == failover["downtime_s"]
    assert -(noise + failover["median_step_s"]) <= failover["downtime_s"] < 60
    parts = failover["breakdown"]
    assert parts["parts_sum_s"] == pytest.approx(parts["total_s"], abs=1e-9)
    assert parts["total_s"] == failover["runtime_downtime_s"]
    assert failover["ranks_completing_step"] == [0, 1, 2, 3]
    assert failover["exit_codes"]["worker1/0"] == failover["exit_codes"]["worker1/1"] == -9
    restart = m["checkpoint_restart"]
    assert sum(restart["breakdown"].values()) == pytest.approx(restart["downtime_s"], abs=1e-6)
    assert restart["downtime_s"] > m["downtime_s"] + noise
    assert m["ratio_checkpoint_restart_vs_noise"] > 1
    assert math.isfinite(failover["ratio_checkpoint_restart_vs_noise"])
    assert m["loss_match"] and m["loss_match_checkpoint_restart"] and m["loss_match_failover"]
    assert math.isfinite(m["stayer_rss_overhead"])
    assert m["holds_target"] == (m["shortfalls"] == [])
