"""The benchmarks run and print the fields their issues ask for (small sizes; the
numbers themselves are the benchmarks' business, not the tests')."""

from __future__ import annotations

import json
import subprocess
import sys


def bench(*args: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "tmd.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_bench_ingest_prints_its_fields_and_loses_nothing_at_small_scale() -> None:
    r = bench("ingest", "--ranks", "256", "--seconds", "3", "--no-baseline", "--json")
    for key in (
        "ranks",
        "seconds",
        "rank_steps_per_s",
        "messages_per_s",
        "loss",
        "p50_latency_s",
        "p99_latency_s",
        "rss_mb",
        "cpu_s",
    ):
        assert key in r, key
    assert r["ranks"] == 256 and r["loss"] == 0.0 and r["rejected"] == 0.0
    assert r["published_rank_steps"] == r["rank_steps_in_view"]


def test_bench_detect_prints_its_fields() -> None:
    r = bench("detect", "--seeds", "1", "--xids", "2", "--json")
    for key in (
        "precision",
        "recall",
        "false_findings_clean",
        "median_latency_steps",
        "p95_latency_steps",
        "scenarios",
        "gpu_fault_latency",
    ):
        assert key in r, key
    scenarios = r["scenarios"]
    assert isinstance(scenarios, dict) and "clean" in scenarios and "two_stragglers" in scenarios
    assert r["gpu_fault_latency"]["samples"] == 2  # type: ignore[index]
