"""The benchmarks run and print the fields their issues ask for (small sizes; the
numbers themselves are the benchmarks' business, not the tests')."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import _need_mosquitto


def bench(*args: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "tmd.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout)  # the JSON object alone
    return result


@pytest.mark.parametrize("via", ["direct", "agent"])
def test_bench_ingest_prints_its_fields_and_loses_nothing_at_small_scale(via: str) -> None:
    _need_mosquitto()  # the bench starts its own
    r = bench("ingest", "--ranks", "256", "--via", via, "--seconds", "3", "--no-baseline",
              "--json")  # fmt: skip
    for key in (
        "ranks",
        "via",
        "cpu_us_per_rank_step",
        "cpu_fraction",
        "decisions",
        "seconds",
        "rank_steps_per_s",
        "messages_per_s",
        "loss",
        "p50_latency_s",
        "p99_latency_s",
        "rss_mb",
        "cpu_s",
        "publisher_max_behind_s",
        "publisher_behind_limit_s",
        "shortfalls",
        "holds_target",
    ):
        assert key in r, key
    assert r["ranks"] == 256 and r["via"] == via and r["loss"] == 0.0 and r["rejected"] == 0.0
    assert r["messages_lost"] == 0  # the agents number theirs: none went missing
    assert r["decisions"] == 0  # a healthy cluster: nothing found, nothing moved
    # Through the agents, one message per machine of 8 ranks (and its GPU sample).
    assert r["nodes"] == 32
    assert r["published_rank_steps"] == r["rank_steps_in_view"]
    # Counted from each step's end, which precedes its publishing and applying.
    assert isinstance(r["p50_latency_s"], float) and r["p50_latency_s"] > 0
    assert r["holds_target"] is (r["shortfalls"] == [])
    # Where the machine's other cores went: the generator, the broker this bench started
    # (read in clock ticks: a light run's broker may round to 0).
    assert r["publisher_cpu_fraction"] > 0 and r["broker_cpu_fraction"] >= 0


def test_bench_detect_prints_its_fields() -> None:
    _need_mosquitto()  # the bench starts its own for the GPU-fault latency
    r = bench("detect", "--seeds", "1", "--xids", "2", "--rho", "0.98", "--sigma", "0.05", "--json")
    for key in (
        "precision",
        "recall",
        "false_findings_clean",
        "median_latency_steps",
        "p95_latency_steps",
        "inseparable_labels",
        "inseparable_recall",
        "naive_precision",
        "naive_recall",
        "naive_busy_precision",
        "naive_busy_recall",
        "naive_busy_false_findings_clean",
        "min_z",
        "scenarios",
        "gpu_fault_latency",
    ):
        assert key in r, key
    assert (r["rho"], r["sigma"], r["ranks_per_machine"]) == (0.98, 0.05, 8)
    assert isinstance(r["machines"], int) and r["machines"] >= 16
    scenarios = r["scenarios"]
    assert isinstance(scenarios, dict)
    for name in ("clean", "two_stragglers", "node_ramp", "gpu_ramp", "node_intermittent"):
        assert name in scenarios, name
    assert r["gpu_fault_latency"]["samples"] == 2  # type: ignore[index]
