"""What ``tmd bench downtime`` computes from the step records its runs leave.

Every process of a run writes one JSON record; its ``steps`` rows are ``[rank, step,
loss, end, step_s, rss_bytes, compute_s, allreduce_s, optimizer_s]``. These functions
read those rows: downtimes, medians, step-time noise, slowdowns and loss matches.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def records(out: Path) -> list[dict[str, Any]]:
    """The record of every process of the run kept in ``out``."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem != "killed"]


def step_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """Every step row of every process."""
    return [row for r in records for row in r["steps"]]


def median_step(rows: list[list[Any]], first: int, last: int) -> float:
    """The median step time of steps ``first`` to ``last - 1``."""
    return float(statistics.median(row[4] for row in rows if first <= row[1] < last))


def downtime(before: list[list[Any]], after: list[list[Any]], at: int, median: float) -> float:
    """End of step ``at - 1`` in ``before`` to end of step ``at`` in ``after`` (latest
    rank at both), minus one median step."""
    t_before = max(row[3] for row in before if row[1] == at - 1)
    t_after = max(row[3] for row in after if row[1] == at)
    return float(t_after - t_before - median)


def step_noise(reference: dict[tuple[int, int], list[Any]]) -> float:
    """How far an ordinary step of the unmigrated run strays from the median, measured
    like a downtime (gap between the latest rank's ends of two steps, minus the median
    gap): the 90th percentile of its size. A downtime under it is not measurable."""
    ends: dict[int, float] = {}
    for (_rank, step), row in reference.items():
        ends[step] = max(ends.get(step, 0.0), row[3])
    gaps = [ends[s] - ends[s - 1] for s in sorted(ends) if s >= 3 and s - 1 in ends]
    if not gaps:
        return 0.0  # too few steps to tell
    median = statistics.median(gaps)
    devs = sorted(abs(g - median) for g in gaps)
    return float(devs[int(0.9 * (len(devs) - 1))])


def slowdown(
    before: list[list[Any]], during: list[list[Any]], reference: dict[Any, list[Any]]
) -> float:
    """How much slower the steps ``during`` were than those ``before``, relative to the
    same steps of the ``reference`` run (0.1: 10 % slower)."""
    mine = statistics.mean(r[4] for r in during) / statistics.mean(r[4] for r in before)
    ref_during = statistics.mean(reference[(r[0], r[1])][4] for r in during)
    ref_before = statistics.mean(reference[(r[0], r[1])][4] for r in before)
    return float(mine / (ref_during / ref_before) - 1)


def worst(method: dict[str, Any]) -> float:
    """The larger of a switch's two downtimes: from the step records, and the worst
    rank's as the runtime reports it."""
    return float(max(method["downtime_s"], method.get("runtime_downtime_s", 0.0)))


def losses(out: Path) -> dict[tuple[int, int], float]:
    """Each (rank, step)'s loss in the run kept in ``out``."""
    return {(r[0], r[1]): r[2] for r in step_rows(records(out))}


def loss_match(got: dict[tuple[int, int], float], reference: dict[Any, list[Any]]) -> bool:
    """Same (rank, step) losses as the unmigrated run, within 1e-6."""
    return set(got) == set(reference) and all(
        abs(got[k] - reference[k][2]) <= 1e-6 for k in reference
    )
