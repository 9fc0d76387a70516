"""``tmd bench downtime`` at its smallest size (2 ranks, 1 layer; the size that once
divided by zero): it finishes, every downtime is within plausible bounds, each
breakdown adds up to its total, the ratios are finite, and every method trained
exactly the reference job. The numbers themselves are the benchmark's business."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest


def test_the_smallest_downtime_bench_measures_every_method_consistently() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tmd.cli", "bench", "downtime", "--nproc", "2", "--layers", "1",
         "--steps", "14", "--prepare-at", "4", "--switch-at", "7", "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    r: dict[str, Any] = json.loads(out.stdout)  # the JSON object alone

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
